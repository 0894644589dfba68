"""Numeric verification against onnxruntime, on fresh random inputs, with stated tolerances.

Checks, each with its own report row:
- every segment as the engine runs it (IREE llvm-cpu on the CPU; kernels or IREE CUDA on a GPU)
  against onnxruntime on that segment's ONNX model;
- on the CPU, every Track A segment's kernel-call list interpreted with the kernels' numpy
  semantics (this proves the lowering: fusion, weight repacking, NHWC boundaries);
- the whole plan, at every compiled batch size, against onnxruntime on the whole model.

It also computes the reference cases a bundle carries for the runtime's first-load check on a GPU
(:func:`reference_cases`; contract/cases.py stores them, runtime/selfcheck.py runs them).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler.bundle_writer import load_model, segment_model
from dualtrack.contract.cases import ReferenceCases
from dualtrack.contract.checks import DEFAULT_TOLERANCES, Check, Report, Tolerance, compare, compare_outputs
from dualtrack.contract.plan import ALIAS_OPS, Plan, Segment, TensorSpec
from dualtrack.errors import ModelError

# The comparison itself (Check, compare, compare_outputs, Report) is contract/checks.py's, shared with
# the runtime's first-load check; this module runs the references (onnxruntime, the kernels' numpy).


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
    env = dict(inputs)
    for call in seg.calls:
        args = [env[i] for i in call.inputs]
        if call.op in ALIAS_OPS:
            env[call.outputs[0]] = np.concatenate(args, axis=-1)
        else:
            out = kernels.kernel(call.op).run_reference(call, args, weights)
            env.update(zip(call.outputs, out if isinstance(out, tuple) else (out,), strict=True))
    return {t.name: env[t.name] for t in seg.outputs}


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
        sess = ort_session(upcast(segment_model(bundle, seg)), f"segment {seg.name}")
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
    full = ort_session(upcast(load_model(bundle)))
    for b in plan.batch_sizes:
        for s in range(samples):
            x = random_input(plan.inputs[0], b, rng)
            ref = run_ort(full, {plan.inputs[0].name: x})
            got = engine.run(x)
            checks += compare_outputs(f"plan b{b}", f"#{s}", ref, {t.name: got[t.name] for t in plan.outputs}, tol)
    return checks


def reference_cases(model: onnx.ModelProto, plan: Plan, seed: int, k: int = 2) -> ReferenceCases:
    """``k`` fresh images (:func:`random_input`, seeded) and onnxruntime's outputs for them, each
    image run alone, from the fp32 model (:func:`upcast`) as the whole-plan check computes them."""
    rng = np.random.default_rng(seed)
    spec = plan.inputs[0]
    images = np.concatenate([random_input(spec, 1, rng) for _ in range(k)])
    session = ort_session(upcast(model))
    rows = [run_ort(session, {spec.name: images[i : i + 1]}) for i in range(k)]
    ref = {o.name: np.concatenate([r[o.name] for r in rows]) for o in plan.outputs}
    return ReferenceCases.from_reference(seed, images, plan.outputs, ref)


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


__all__ = [
    "Check",
    "Report",
    "Tolerance",
    "check_frontend",
    "compare",
    "compare_outputs",
    "interpret_track_a",
    "ort_session",
    "random_input",
    "reference_cases",
    "run_ort",
    "upcast",
    "verify_engine",
]
