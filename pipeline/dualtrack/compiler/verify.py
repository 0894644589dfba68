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
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler.bundle_writer import load_model, segment_model
from dualtrack.compiler.onnx_graph import infer_shapes, widen_fp16
from dualtrack.contract.cases import ReferenceCases
from dualtrack.contract.checks import DEFAULT_TOLERANCES, Check, Report, Tolerance, compare, compare_outputs
from dualtrack.contract.plan import Plan, Segment, TensorSpec
from dualtrack.contract.precision import FP8_OPS
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
    if any(n.op_type in ("If", "Loop", "Scan") for n in model.graph.node) or not _has_fp16(model):
        return model
    return widen_fp16(copy.deepcopy(model))


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
    seg: Segment,
    weights: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    trace: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Run a Track A segment's kernel calls with the kernels' numpy semantics (NHWC throughout):
    each call's spec packs its weights and runs its reference; the alias ops (buffer views in the
    runtime) are numpy's: a concat a concatenation, a slice a channel slice. ``trace``, where given,
    receives every tensor of the segment (fp8 calibration reads the convolutions' inputs)."""
    env = trace if trace is not None else {}
    env.update(inputs)
    channels = {t.name: t.shape[-1] for t in (*seg.tensors, *seg.outputs)}
    for call in seg.calls:
        args = [env[i] for i in call.inputs]
        if call.op == "concat":
            env[call.outputs[0]] = np.concatenate(args, axis=-1)
        elif call.op == "slice":
            start = call.attr("start")
            env[call.outputs[0]] = args[0][..., start : start + channels[call.outputs[0]]]
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
    judged: bool = False,
    interpret: bool = True,
    progress=None,
) -> Report:
    """Verify a loaded Engine's every segment and its whole plan against onnxruntime.

    An fp16 segment check that misses ``tol`` is held again to what fp16 itself reaches on that
    check's own inputs (:func:`_held_to_fp16`): a segment is fed random tensors no image produces, on
    which rounding may weigh more than on the network's own. With ``judged`` (``tol`` is the build's
    judged tolerance, not one a config set), so is a whole-plan check."""
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
        checks = _verify_checks(engine, samples, tol, rng, step, interpret, judged)
    finally:
        if poison_before is not None:
            engine.backend.poison = poison_before
    return Report(engine.device, plan.precision, tol, checks, seed)


def _verify_checks(
    engine, samples: int, tol: Tolerance, rng: np.random.Generator, step, interpret: bool, judged: bool
) -> list[Check]:
    bundle, plan = engine.bundle, engine.plan
    checks: list[Check] = []
    b0 = plan.batch_sizes[0]
    for seg in plan.segments:
        step(f"verify {seg.name}")
        seg_model = upcast(segment_model(bundle, seg))
        sess = ort_session(seg_model, f"segment {seg.name}")
        for s in range(samples):
            feeds = {t.name: random_input(t, b0, rng) for t in seg.inputs}
            ref = run_ort(sess, feeds)
            got = engine.backend.run_segment(seg, b0, {k: engine.backend.from_host(v) for k, v in feeds.items()})
            where = "kernels" if (seg.track == "A" and engine.device == "cuda") else engine.backend.target
            host = {t.name: engine.backend.to_host(got[t.name]) for t in seg.outputs}
            runs = {f"{seg.name}[{where}]": host}
            fp8 = seg.track == "A" and any(c.op in FP8_OPS for c in seg.calls)
            if fp8 and where == "kernels":
                # fp8 calls on random tensors outside their calibrated ranges: the kernels are held to their
                # own numpy semantics here; the build checked the fp8 plan's masks on images (compiler/fp8.py).
                ref = interpret_track_a(seg, bundle.weights, feeds)
            elif seg.track == "A" and interpret and not fp8:
                runs[f"{seg.name}[numpy kernels]"] = interpret_track_a(seg, bundle.weights, feeds)
            checks += _held_to_fp16(plan.precision, seg_model, feeds, ref, runs, f"#{s}", tol)
    step("verify whole plan")
    full = upcast(load_model(bundle))
    full_session = ort_session(full)
    for b in plan.batch_sizes:
        for s in range(samples):
            x = random_input(plan.inputs[0], b, rng)
            feeds = {plan.inputs[0].name: x}
            ref = run_ort(full_session, feeds)
            got = engine.run(x)
            runs = {f"plan b{b}": {t.name: got[t.name] for t in plan.outputs}}
            checks += _held_to_fp16(plan.precision if judged else "", full, feeds, ref, runs, f"#{s}", tol)
    return checks


def _held_to_fp16(
    precision: str,
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    ref: Mapping[str, np.ndarray],
    runs: Mapping[str, Mapping[str, np.ndarray]],
    tag: str,
    tol: Tolerance,
) -> list[Check]:
    """``runs`` (where -> outputs) compared with ``ref`` at ``tol``; for an fp16 ``precision``, where
    one misses it, all are compared again at FP16_FLOOR_FACTOR times what ``model`` computed with fp16
    storage reaches on these same ``feeds`` (at least ``tol``, at most FP16_CEILING), and the checks
    say so. Computed only on a miss: a passing check costs no second reference run."""
    checks = [c for where, got in runs.items() for c in compare_outputs(where, tag, ref, got, tol)]
    if precision != "fp16" or all(c.passed for c in checks):
        return checks
    try:
        fp16 = run_ort(ort_session(fp16_storage(model), "the model with fp16 storage"), feeds)
    except ModelError:
        return checks
    held = _fp16_floor(ref, fp16, tol)
    note = f"fp16 storage on these inputs judged: held to rel_l2 {held.rel_l2:.3g}, max_abs {held.max_abs:.3g}"
    return [
        replace(c, note=f"{c.note}; {note}" if c.note else note)
        for where, got in runs.items()
        for c in compare_outputs(where, tag, ref, got, held)
    ]


def _fp16_floor(ref: Mapping[str, np.ndarray], fp16: Mapping[str, np.ndarray], floor: Tolerance) -> Tolerance:
    """FP16_FLOOR_FACTOR times the error ``fp16`` (a run with fp16 storage) has from ``ref`` on their
    float outputs, never below ``floor`` and, above it, never past FP16_CEILING."""
    errs = [compare(k, ref[k], fp16[k], floor) for k in ref if k in fp16 and np.issubdtype(ref[k].dtype, np.floating)]
    rel = max((c.rel_l2 for c in errs), default=0.0)
    mx = max((c.max_abs for c in errs), default=0.0)
    if not (np.isfinite(rel) and np.isfinite(mx)):
        return floor
    return Tolerance(
        rel_l2=max(floor.rel_l2, min(FP16_FLOOR_FACTOR * rel, FP16_CEILING.rel_l2)),
        max_abs=max(floor.max_abs, min(FP16_FLOOR_FACTOR * mx, FP16_CEILING.max_abs)),
        mismatch=floor.mismatch,
    )


# A correct fp16 build can miss a fixed fp16 tolerance on a deep network, where rounding accumulates
# with depth (a DeepLabV3+-style network at rel_l2 0.0216 against 0.02, not one mask pixel different).
# So where the config sets no `verify.tolerance`, the fp16 tolerance is judged on the network itself:
# the model computed with fp16 storage (:func:`fp16_storage`) against fp32, on the verification's
# kind of input, is what fp16 delivers there; a second fp16 implementation rounds differently, so the build
# may be off by FP16_FLOOR_FACTOR times that, never held tighter than the fixed default and never
# looser than FP16_CEILING (past it, fp16 is not a precision this network can be served in).
FP16_FLOOR_FACTOR = 2.0
FP16_CEILING = Tolerance(rel_l2=0.08, max_abs=0.3, mismatch=DEFAULT_TOLERANCES["fp16"].mismatch)


def fp16_storage(model: onnx.ModelProto) -> onnx.ModelProto:
    """An fp32 model whose every float tensor a node writes is rounded to fp16 and back: fp32
    arithmetic inside each op and fp16 between them, which is what an fp16 engine computes (IREE and
    Track A accumulate in fp32). Not onnxruntime's own fp16 run: its CPU provider casts the fp16 ops
    it lacks to fp32 and drops the casts between them, so its intermediates stay fp32."""
    inferred = infer_shapes(model).graph
    floats = {
        vi.name for vi in [*inferred.value_info, *inferred.output] if vi.type.tensor_type.elem_type == TensorProto.FLOAT
    }
    model = copy.deepcopy(model)
    g = model.graph
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        nodes.append(n)
        for k, y in enumerate(n.output):
            if y in floats:
                n.output[k] = f"{y}.fp32"
                nodes.append(helper.make_node("Cast", [f"{y}.fp32"], [f"{y}.fp16"], to=TensorProto.FLOAT16))
                nodes.append(helper.make_node("Cast", [f"{y}.fp16"], [y], to=TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    return model


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """The model with the float tensors ``names`` that its nodes compute as graph outputs too."""
    computed = {o for n in model.graph.node for o in n.output}
    have = {o.name for o in model.graph.output}
    inferred = {vi.name: vi for vi in infer_shapes(model).graph.value_info}
    extra = [
        inferred[x]
        for x in dict.fromkeys(names)
        if x in computed and x not in have and x in inferred
        and inferred[x].type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
    ]  # fmt: skip
    if not extra:
        return model
    model = copy.deepcopy(model)
    model.graph.output.extend(extra)
    return model


def judged_tolerance(
    model: onnx.ModelProto, plan: Plan, seed: int, *, ceiling: Tolerance | None = FP16_CEILING
) -> tuple[Tolerance, str]:
    """The default tolerance of ``plan``'s precision, for fp16 judged on ``model`` (the bundle's
    whole model; see FP16_FLOOR_FACTOR) over the images of the reference cases ``seed`` draws
    (:func:`case_images`), each alone, and a note that says how it was set. ``ceiling`` None: no
    cap (bench/reweight.py, for a network of drawn weights that fp16 cannot serve: its bench rows
    time the GPU against that network's own fp16 floor)."""
    default = DEFAULT_TOLERANCES[plan.precision]
    if plan.precision != "fp16":
        return default, ""
    # Every tensor a check compares: the model's outputs and every segment's (its boundaries), whose
    # values may be smaller, and fp16's relative error on them larger, than the outputs'.
    wide = with_outputs(upcast(model), [t.name for seg in plan.segments for t in seg.outputs])
    session = ort_session(wide)
    checks = []
    try:
        fp16_session = ort_session(fp16_storage(wide), "the model with fp16 storage")
        for image in case_images(plan.inputs[0], seed):
            feeds = {plan.inputs[0].name: image}
            fp16, ref = run_ort(fp16_session, feeds), run_ort(session, feeds)
            checks += [compare(k, ref[k], fp16[k], default) for k in ref if np.issubdtype(ref[k].dtype, np.floating)]
    except ModelError as e:
        return default, f"fp16 tolerance: the fixed default (onnxruntime cannot run the model with fp16 storage: {e})"
    if not checks:
        return default, ""
    return _loosened(checks, "the model with fp16 storage", ceiling)


def _loosened(checks: list[Check], what: str, ceiling: Tolerance | None = FP16_CEILING) -> tuple[Tolerance, str]:
    """The fp16 default loosened to FP16_FLOOR_FACTOR times the error ``checks`` measured of ``what``
    (within the default and FP16_CEILING), and the note that says so."""
    default = DEFAULT_TOLERANCES["fp16"]
    rel, mx = max(c.rel_l2 for c in checks), max(c.max_abs for c in checks)
    if not (np.isfinite(rel) and np.isfinite(mx)):
        return default, f"fp16 tolerance: the fixed default ({what} overflows)"
    cap = ceiling or Tolerance(rel_l2=np.inf, max_abs=np.inf, mismatch=default.mismatch)
    tol = Tolerance(
        rel_l2=min(max(default.rel_l2, FP16_FLOOR_FACTOR * rel), cap.rel_l2),
        max_abs=min(max(default.max_abs, FP16_FLOOR_FACTOR * mx), cap.max_abs),
        mismatch=default.mismatch,
    )
    note = (
        f"fp16 tolerance judged on this network: {what} is off by rel_l2 {rel:.3g}, max_abs {mx:.3g} from fp32, "
        f"so the build may be off by rel_l2 {tol.rel_l2:.3g}, max_abs {tol.max_abs:.3g} "
        f"({FP16_FLOOR_FACTOR:g}x that, at least the fixed default {default.rel_l2:g} / {default.max_abs:g}, "
        + (f"at most {cap.rel_l2:g} / {cap.max_abs:g}; " if ceiling else "uncapped; ")
        + "`verify.tolerance` in the config overrides it)"
    )
    return tol, note


def rounded_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every fp32 weight (initializer or Constant) rounded to fp16 and back: what an
    fp16 conversion does to the weights alone, the arithmetic still fp32."""
    model = copy.deepcopy(model)

    def rounded(t: onnx.TensorProto) -> onnx.TensorProto:
        a = numpy_helper.to_array(t)
        return numpy_helper.from_array(a.astype(np.float16).astype(np.float32), t.name) if a.dtype == np.float32 else t

    for i, init in enumerate(model.graph.initializer):
        model.graph.initializer[i].CopyFrom(rounded(init))
    for n in model.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(rounded(a.t))
    return model


CASE_IMAGES = 2  # images in a bundle's reference cases, which the fp16 tolerance is also judged on


def case_images(spec: TensorSpec, seed: int, k: int = CASE_IMAGES) -> list[np.ndarray]:
    """The ``k`` images (each a batch of one) that ``seed`` draws for the reference cases."""
    rng = np.random.default_rng(seed)
    return [random_input(spec, 1, rng) for _ in range(k)]


def reference_cases(model: onnx.ModelProto, plan: Plan, seed: int, k: int = CASE_IMAGES) -> ReferenceCases:
    """:func:`case_images` and onnxruntime's outputs for them, each image run alone, from the fp32
    model (:func:`upcast`) as the whole-plan check computes them."""
    spec = plan.inputs[0]
    images = case_images(spec, seed, k if spec.batched else 1)  # a fixed-shape plan's one shape: one case
    session = ort_session(upcast(model))
    rows = [run_ort(session, {spec.name: image}) for image in images]
    whole = {o.name: rows[0][o.name] for o in plan.outputs}  # a fixed-shape plan's one case, not rows
    ref = {o.name: np.concatenate([r[o.name] for r in rows]) for o in plan.outputs} if spec.batched else whole
    return ReferenceCases.from_reference(seed, np.concatenate(images), plan.outputs, ref)


def _rows(name: str, value: np.ndarray, step: int) -> np.ndarray:
    """An output of an export run ``step`` images at a time, which must hold one row per image."""
    if value.ndim == 0 or value.shape[0] != step:
        raise ModelError(
            f"output '{name}' of the export has shape {list(value.shape)} at the batch it fixed ({step}), not one row "
            "per image in dim 0; dualtrack runs a model image by image along dim 0 of its input and outputs: "
            "make dim 0 of every output the batch, or set `batch: fixed` where dim 0 holds data rather than images"
        )
    return value


def _export_model(fe) -> tuple[onnx.ModelProto, ort.InferenceSession, int | None]:
    """The export and onnxruntime on it; where onnxruntime cannot load the export's opset (1.32 dropped
    Add, Mul, Gemm... below opset 7), the export upgraded by onnx.version_converter: the model, its
    session and the opset it was upgraded to, else None."""
    try:
        return fe.original, ort_session(fe.original, "the exported model"), None
    except ModelError:
        if fe.upgraded is None:
            raise
    opset = next(o.version for o in fe.upgraded.opset_import if o.domain in ("", "ai.onnx"))
    return fe.upgraded, ort_session(fe.upgraded, f"the exported model upgraded to opset {opset}"), opset


def _run_export(session: ort.InferenceSession, x: np.ndarray, step: int | None, dtype) -> dict[str, np.ndarray]:
    """The export's outputs for the images ``x``: at once, or for an export with a fixed batch
    ``step``, ``step`` images at a time (the last group padded with zeros, its padding rows dropped)."""
    name = session.get_inputs()[0].name
    if step is None:
        return run_ort(session, {name: x.astype(dtype)})
    parts = []
    for i in range(0, len(x), step):
        chunk = x[i : i + step].astype(dtype)
        pad = step - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
        parts.append({k: _rows(k, v, step)[: step - pad] for k, v in run_ort(session, {name: chunk}).items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def check_frontend(
    fe, batch_sizes: tuple[int, ...], tol: Tolerance | None = None, seed: int | None = None
) -> list[Check]:
    """The front end's processed model (before the image wrap) against the export, in onnxruntime,
    at every batch size being built, on fresh signed inputs.

    An export with a fixed batch B runs B images at a time (the last group padded), so a batch-8
    result of the processed model is checked against eight batch-1 runs of the export: this is what
    proves the batch rewrites. ``fe`` is a :class:`dualtrack.compiler.frontend.FrontEnd`.

    ``tol`` None is the precision's default; for fp16, a batch whose check misses it is held again to
    FP16_FLOOR_FACTOR times what the export with its weights rounded to fp16 reaches on the same
    inputs (a deep random network amplifies that rounding past 2e-2 on some inputs and not others).
    """
    rng = np.random.default_rng(seed)
    # The processed model computed in fp32 (:func:`upcast`): this check is about the rewrites and the
    # fp16 weights, not fp16 arithmetic, whose error the engine's checks judge (:func:`judged_tolerance`).
    body = ort_session(upcast(fe.body), "the processed model")
    export_model, export, upgraded = _export_model(fe)
    outputs = [o.name for o in export.get_outputs()]
    body_in = fe.body.graph.input[0]
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in body_in.type.tensor_type.shape.dim)
    spec = TensorSpec(
        body_in.name, shape, np.dtype(helper.tensor_dtype_to_np_dtype(body_in.type.tensor_type.elem_type)).name
    )
    export_dtype = helper.tensor_dtype_to_np_dtype(fe.original.graph.input[0].type.tensor_type.elem_type)
    step = fe.export_batch or None
    judge = tol is None and fe.precision == "fp16"
    tol = tol or DEFAULT_TOLERANCES[fe.precision]
    how = f"export run {step} at a time" if step else "export"
    how += f" upgraded to opset {upgraded} (onnxruntime cannot run its own)" if upgraded else ""
    checks: list[Check] = []
    for b in sorted(set(batch_sizes)):
        x = random_input(spec, b, rng)
        got = run_ort(body, {body_in.name: x})
        ref = _run_export(export, x, step, export_dtype)
        names = [k for k in outputs if k in got]
        batch = [compare(f"frontend b{b} {k}", ref[k], got[k], tol, note=f"vs {how}") for k in names]
        if judge and not all(c.passed for c in batch):
            rounded = ort_session(rounded_weights(export_model), "the export with fp16 weights")
            held = _fp16_floor(ref, _run_export(rounded, x, step, export_dtype), tol)
            note = (
                f"vs {how}; held to rel_l2 {held.rel_l2:.3g}, max_abs {held.max_abs:.3g}: "
                f"{FP16_FLOOR_FACTOR:g}x what the export with its weights rounded to fp16 reaches on these inputs"
            )
            batch = [compare(f"frontend b{b} {k}", ref[k], got[k], held, note=note) for k in names]
        checks += batch
    return checks


__all__ = [
    "FP16_CEILING",
    "FP16_FLOOR_FACTOR",
    "Check",
    "Report",
    "Tolerance",
    "check_frontend",
    "compare",
    "compare_outputs",
    "fp16_storage",
    "interpret_track_a",
    "judged_tolerance",
    "ort_session",
    "random_input",
    "reference_cases",
    "rounded_weights",
    "run_ort",
    "upcast",
    "verify_engine",
]
