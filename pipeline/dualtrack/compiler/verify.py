"""Numeric verification against onnxruntime, on fresh random inputs, with stated tolerances.

Checks, each with its own report row:
- every segment as the engine runs it (IREE llvm-cpu on the CPU; kernels or IREE CUDA on a GPU)
  against onnxruntime on that segment's ONNX model;
- on the CPU, every Track A segment's kernel-call list interpreted with the kernels' numpy
  semantics (this proves the lowering: fusion, weight repacking, NHWC boundaries);
- the whole plan, at every compiled batch size, against onnxruntime on the whole model.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler.config import DEFAULT_TOLERANCES, Tolerance
from dualtrack.compiler.frontend import MASK, PROBS
from dualtrack.contract.plan import ALIAS_OPS, Segment, TensorSpec
from dualtrack.errors import ModelError, VerificationError


@dataclass(frozen=True)
class Check:
    name: str
    rel_l2: float
    max_abs: float
    mismatch: float
    nonfinite: int
    passed: bool
    note: str = ""
    integer: bool = False


def compare(name: str, ref: np.ndarray, got: np.ndarray, tol: Tolerance, note: str = "") -> Check:
    """Relative L2 and max-abs error for floats; the fraction of differing elements for integers.

    The max-abs bound scales with the output (:class:`~dualtrack.compiler.config.Tolerance`): a float output
    passes when rel_l2 <= tol.rel_l2 and max|got - ref| <= tol.max_abs * max(1, max|ref|).
    ``Check.max_abs`` reports that scaled difference, max|got - ref| / max(1, max|ref|).
    """
    if ref.shape != got.shape:
        return Check(name, float("inf"), float("inf"), 1.0, 0, False, f"shape {got.shape} != reference {ref.shape}")
    if np.issubdtype(ref.dtype, np.integer):
        mism = float(np.mean(ref != got)) if ref.size else 0.0
        return Check(name, 0.0, 0.0, mism, 0, mism <= tol.mismatch, note, integer=True)
    r, g = ref.astype(np.float64), got.astype(np.float64)
    nonfinite = int(np.count_nonzero(~np.isfinite(g)))
    diff = g - r
    rel = float(np.linalg.norm(diff) / max(np.linalg.norm(r), 1e-30)) if nonfinite == 0 else float("inf")
    scale = max(1.0, float(np.max(np.abs(r)))) if r.size and np.isfinite(r).all() else 1.0
    mx = (
        float(np.max(np.abs(diff))) / scale
        if diff.size and nonfinite == 0
        else (0.0 if not diff.size else float("inf"))
    )
    return Check(name, rel, mx, 0.0, nonfinite, nonfinite == 0 and rel <= tol.rel_l2 and mx <= tol.max_abs, note)


def compare_outputs(
    where: str, tag: str, ref: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], tol: Tolerance
) -> list[Check]:
    """One check per output of ``got``. A class-id ``mask`` computed beside its ``probs`` (the image
    wrap's outputs) is compared where the class is decided: a pixel whose reference top two classes
    are within twice the measured probability error can flip by rounding alone, so it is left out
    (and counted in the note); anywhere else a different class is a mismatch. A probability error
    beyond the tolerance excuses nothing: then every pixel is compared."""
    checks = []
    decided = None
    if MASK in got and PROBS in got and ref[PROBS].ndim == 4 and ref[PROBS].shape == got[PROBS].shape:
        p_ref = ref[PROBS].astype(np.float64)
        err = float(np.max(np.abs(got[PROBS].astype(np.float64) - p_ref))) if p_ref.size else 0.0
        if p_ref.shape[1] == 1:
            margin = np.abs(2 * p_ref[:, 0] - 1)  # one class (sigmoid): p against 0.5
        else:
            top = np.sort(p_ref, axis=1)
            margin = top[:, -1] - top[:, -2]
        # Only an error the probs check accepts can excuse a flip: beyond it, every pixel counts.
        decided = margin > 2 * err if err <= tol.max_abs else np.ones(margin.shape, bool)
    for name in got:
        if name == MASK and decided is not None and ref[name].shape == decided.shape:
            undecided = int(decided.size - np.count_nonzero(decided))
            note = f"{undecided} of {decided.size} pixels within rounding of a tie left out" if undecided else ""
            checks.append(
                compare(f"{where} {name} {tag}", ref[name][decided], np.asarray(got[name])[decided], tol, note)
            )
        else:
            checks.append(compare(f"{where} {name} {tag}", ref[name], got[name], tol))
    return checks


def random_input(spec: TensorSpec, batch: int, rng: np.random.Generator) -> np.ndarray:
    """Fresh inputs that look like real data: images as uint8 pixels, other tensors signed and O(1)
    (a kernel that mishandles negative values must fail the check, not pass on ReLU-like data)."""
    shape = spec.at_batch(batch)
    if spec.dtype == "uint8":
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    if np.issubdtype(np.dtype(spec.dtype), np.integer):
        return rng.integers(0, 4, size=shape).astype(spec.dtype)
    return rng.standard_normal(shape).astype(spec.dtype)


def ort_session(model: onnx.ModelProto, what: str = "the model") -> ort.InferenceSession:
    """An onnxruntime CPU session; a model it cannot load is a ModelError that says why."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own pybind exception types (Fail, InvalidGraph, ...)
        raise ModelError(
            f"onnxruntime {ort.__version__} cannot load {what} ({_first_line(e)}); re-export the model with a "
            "current opset (e.g. opset_version=17) or replace the op it names"
        ) from None


def upcast(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same network computed in fp32: fp16 weights, constants, casts and boundary types widened.

    The reference for an fp16 engine. Measured against onnxruntime's own fp16 kernels, an fp16 engine
    is compared with a second fp16 implementation whose rounding differs as much as its own (on
    LR-ASPP, both lie up to 0.07 from fp32 on a probability near 0.5, and up to 0.12 from each other);
    against fp32, the check sees the engine's error alone. Weights widen exactly. A model with
    subgraphs (If, Loop) is returned as it is.
    """
    g = model.graph
    if not any(n.op_type in ("If", "Loop", "Scan") for n in g.node) and _has_fp16(model):
        model = copy.deepcopy(model)
        g = model.graph
        for i, init in enumerate(g.initializer):
            if init.data_type == TensorProto.FLOAT16:
                g.initializer[i].CopyFrom(
                    numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name)
                )
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
                vi.type.tensor_type.elem_type = TensorProto.FLOAT
        for n in g.node:
            for a in n.attribute:
                if a.name == "to" and a.i == TensorProto.FLOAT16:
                    a.i = TensorProto.FLOAT
                elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT16:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
    return model


def _has_fp16(model: onnx.ModelProto) -> bool:
    g = model.graph
    return (
        any(i.data_type == TensorProto.FLOAT16 for i in g.initializer)
        or any(vi.type.tensor_type.elem_type == TensorProto.FLOAT16 for vi in [*g.input, *g.output])
        or any(a.name == "to" and a.i == TensorProto.FLOAT16 for n in g.node for a in n.attribute)
    )


def run_ort(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a session; fp16 feeds to an fp32 input (an :func:`upcast` model) are widened first."""
    names = [o.name for o in session.get_outputs()]
    wants = {i.name: i.type for i in session.get_inputs()}
    feeds = {
        k: v.astype(np.float32) if v.dtype == np.float16 and wants.get(k) == "tensor(float)" else v
        for k, v in feeds.items()
    }
    try:
        return dict(zip(names, session.run(names, dict(feeds)), strict=True))
    except Exception as e:  # as above
        raise ModelError(f"onnxruntime failed to run the reference model ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]


def interpret_track_a(
    seg: Segment, weights: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Run a Track A segment's kernel calls with the kernels' numpy semantics (NHWC throughout):
    each call's spec packs its weights and runs its reference; a concat (an alias op: the
    runtime writes its inputs into slices of its output) is a numpy concatenation."""
    # Imported here only because the rest of this module has another owner (issue 18).

    env = dict(inputs)
    for call in seg.calls:
        args = [env[i] for i in call.inputs]
        if call.op in ALIAS_OPS:
            env[call.outputs[0]] = np.concatenate(args, axis=-1)
        else:
            out = kernels.kernel(call.op).run_reference(call, args, weights)
            env.update(zip(call.outputs, out if isinstance(out, tuple) else (out,), strict=True))
    return {t.name: env[t.name] for t in seg.outputs}


@dataclass
class Report:
    device: str
    precision: str
    tolerance: Tolerance
    checks: list[Check]
    seed: int

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "precision": self.precision,
            "tolerance": self.tolerance.model_dump(),
            "seed": self.seed,
            "passed": self.passed,
            "checks": [asdict(c) for c in self.checks],
        }

    def lines(self) -> list[str]:
        return [self.line(c) for c in self.checks]

    @staticmethod
    def line(c: Check) -> str:
        what = f"mismatch {c.mismatch:.2e}" if c.integer else f"rel_l2 {c.rel_l2:.2e} max_abs {c.max_abs:.2e}"
        return f"{'ok  ' if c.passed else 'FAIL'} {c.name:<44} {what}{'  ' + c.note if c.note else ''}"

    def raise_if_failed(self) -> None:
        if not self.passed:
            bad = [c for c in self.checks if not c.passed]
            first = bad[0]
            raise VerificationError(
                f"{len(bad)} of {len(self.checks)} checks exceed the {self.precision} tolerance "
                f"(rel_l2 {self.tolerance.rel_l2:g}, max_abs {self.tolerance.max_abs:g} scaled, "
                f"mismatch {self.tolerance.mismatch:g}); "
                f"first: {first.name} rel_l2 {first.rel_l2:.3g} max_abs {first.max_abs:.3g} "
                f"mismatch {first.mismatch:.3g}"
                f"{' (' + first.note + ')' if first.note else ''}",
                detail="\n".join(self.lines()),
            )


def verify_engine(
    engine,
    *,
    samples: int = 1,
    seed: int | None = None,
    tol: Tolerance | None = None,
    interpret: bool = True,
    progress=None,
) -> Report:
    """Verify a loaded Engine's every segment and its whole plan against onnxruntime."""
    plan = engine.plan
    tol = tol or DEFAULT_TOLERANCES[plan.precision]
    seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
    rng = np.random.default_rng(seed)
    step = progress or (lambda msg: None)
    # On a GPU, Track A outputs are filled with NaN before every run: an element a kernel fails to
    # write then fails the check instead of passing with stale data.
    poison_before = getattr(engine.backend, "poison", None)
    if poison_before is not None:
        engine.backend.poison = True
    try:
        checks = _verify_checks(engine, samples, tol, rng, step, interpret)
    finally:
        if poison_before is not None:
            engine.backend.poison = poison_before
    return Report(engine.device, plan.precision, tol, checks, seed)


def _verify_checks(
    engine, samples: int, tol: Tolerance, rng: np.random.Generator, step, interpret: bool
) -> list[Check]:
    bundle, plan = engine.bundle, engine.plan
    checks: list[Check] = []
    b0 = plan.batch_sizes[0]
    for seg in plan.segments:
        step(f"verify {seg.name}")
        sess = ort_session(upcast(bundle.segment_model(seg)), f"segment {seg.name}")
        for s in range(samples):
            feeds = {t.name: random_input(t, b0, rng) for t in seg.inputs}
            ref = run_ort(sess, feeds)
            got = engine.backend.run_segment(seg, b0, {k: engine.backend.from_host(v) for k, v in feeds.items()})
            where = "kernels" if (seg.track == "A" and engine.device == "cuda") else engine.backend.target
            host = {t.name: engine.backend.to_host(got[t.name]) for t in seg.outputs}
            checks += compare_outputs(f"{seg.name}[{where}]", f"#{s}", ref, host, tol)
            if seg.track == "A" and interpret:
                got_i = interpret_track_a(seg, bundle.weights, feeds)
                checks += compare_outputs(f"{seg.name}[numpy kernels]", f"#{s}", ref, got_i, tol)
    step("verify whole plan")
    full = ort_session(upcast(bundle.model))
    for b in plan.batch_sizes:
        for s in range(samples):
            x = random_input(plan.inputs[0], b, rng)
            ref = run_ort(full, {plan.inputs[0].name: x})
            got = engine.run(x)
            checks += compare_outputs(f"plan b{b}", f"#{s}", ref, {t.name: got[t.name] for t in plan.outputs}, tol)
    return checks


def check_frontend(fe, batch_sizes: tuple[int, ...], tol: Tolerance, seed: int | None = None) -> list[Check]:
    """The front end's processed model (before the image wrap) against the export, in onnxruntime,
    at every batch size being built, on fresh signed inputs.

    An export with a fixed batch B runs B images at a time (the last group padded), so a batch-8
    result of the processed model is checked against eight batch-1 runs of the export: this is what
    proves the batch rewrites. ``fe`` is a :class:`dualtrack.compiler.frontend.FrontEnd`.
    """
    rng = np.random.default_rng(seed)
    body = ort_session(fe.body, "the processed model")
    export = ort_session(fe.original, "the exported model")
    inp = export.get_inputs()[0]
    outputs = [o.name for o in export.get_outputs()]
    body_in = fe.body.graph.input[0]
    shape = tuple(d.dim_value or 1 for d in body_in.type.tensor_type.shape.dim)
    spec = TensorSpec(
        body_in.name, shape, np.dtype(helper.tensor_dtype_to_np_dtype(body_in.type.tensor_type.elem_type)).name
    )
    export_dtype = helper.tensor_dtype_to_np_dtype(fe.original.graph.input[0].type.tensor_type.elem_type)
    step = fe.export_batch or None
    checks: list[Check] = []
    for b in sorted(set(batch_sizes)):
        x = random_input(spec, b, rng)
        got = run_ort(body, {body_in.name: x})
        if step is None:
            ref = run_ort(export, {inp.name: x.astype(export_dtype)})
        else:
            parts = []
            for i in range(0, b, step):
                chunk = x[i : i + step].astype(export_dtype)
                pad = step - len(chunk)
                if pad:
                    chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
                parts.append({k: v[: step - pad] for k, v in run_ort(export, {inp.name: chunk}).items()})
            ref = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        how = f"export run {step} at a time" if step else "export"
        for name in outputs:
            if name in got:
                checks.append(compare(f"frontend b{b} {name}", ref[name], got[name], tol, note=f"vs {how}"))
    return checks
