"""``precision: fp8``: calibration, the per-layer choice, the lowering and its verification (issue 42).

The fp16 plan is built first; then, on sm_90a targets only (wgmma's e4m3 operands):

    calibration_images -> calibrate (each convolution input's |value| statistic over the calibration
    images, the fp16 plan run through onnxruntime) -> choose (per convolution: fp8, or fp16 and why:
    the first and last, what conv_fp8 does not take, an fp8 error over the threshold) -> lower (a
    ``quantize_fp8`` before each chosen convolution, one per input tensor, and the convolution turned
    into ``conv_fp8``, as fixed by the FP8 ABI) -> verify (mask agreement
    of the fp8 plan against fp32 onnxruntime and against the fp16 plan, on the calibration images
    and the held-out ones; below ``calibration.agreement_floor`` the build stops)

The plans run on the CPU here (:class:`PlanRunner`): Track B segments, and the fp16 plan's Track A
segments, through onnxruntime (fp32 arithmetic, the plan's dtypes where it stores); the fp8 plan's
Track A segments through the kernels' numpy references (:func:`dualtrack.compiler.verify.interpret_track_a`).
docs/fp8.md says what each knob does.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from dualtrack import atomic, imaging, kernels
from dualtrack.compiler import verify
from dualtrack.compiler.config import CalibrationConfig
from dualtrack.contract.checks import DEFAULT_TOLERANCES, MASK, Tolerance, compare
from dualtrack.contract.plan import KernelCall, Plan, Segment, TensorSpec, f32_bits
from dualtrack.contract.precision import Agreement, LayerPrecision, PrecisionRecord
from dualtrack.errors import ConfigError, VerificationError
from dualtrack.kernels.quantize_fp8 import E4M3_MAX

CONV_OPS = ("conv3x3", "conv1x1", "conv")  # the fp16 convolution ops conv_fp8 may replace
SCALE_FLOOR = 1e-6  # a statistic below this (an all-zero input) is held here: the scale stays finite
ERROR_IMAGES = 2  # calibration images each layer's fp8 error is measured on (it runs the layer twice)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
TOLERANCE_FACTOR = 2.0  # the bundle's tolerance: this times the fp8 plan's measured error (the GPU's self-check)


@dataclass(frozen=True)
class CalibrationSet:
    """The images (each a batch of one) that calibrate, those held out, and where they came from."""

    calibrate: tuple[np.ndarray, ...]
    held_out: tuple[np.ndarray, ...]
    source: str


@dataclass(frozen=True)
class Fp8Build:
    """The fp8 stage's outcome: the plan (the fp16 one where fp8 was not applied), its record, and the
    tolerance its measured error asks of the bundle's checks (None: the fp16 plan's stands)."""

    plan: Plan
    record: PrecisionRecord
    tolerance: Tolerance | None = None


def calibration_summary(cal: CalibrationConfig) -> dict[str, object]:
    stat = "amax" if cal.method == "amax" else f"percentile {cal.percentile:g}"
    return {"statistic": stat, "threshold": cal.threshold, "held_out": cal.held_out}


def unsupported_targets(wgmma: Mapping[str, bool]) -> str | None:
    """A note where a GPU target (arch name -> runs e4m3 wgmma: sm_90a, TMA kernels on) cannot run fp8, else None."""
    others = sorted(name for name, ok in wgmma.items() if not ok)
    if not others:
        return None
    return (
        f"precision fp8 needs sm_90a with its TMA kernels on (wgmma with e4m3 operands; `enable_tma`); "
        f"{', '.join(others)} cannot run it, so this bundle is fp16 (build fp8 with `targets: [sm_90a]` alone)"
    )


# --- images ----------------------------------------------------------------------------------------


def calibration_images(cal: CalibrationConfig, spec: TensorSpec) -> CalibrationSet:
    """The config's images (a folder of PNG/JPEG, resized to the model's input) or, without one,
    ``cal.samples`` random inputs; the last ``held_out`` share (by file name) kept for verification."""
    if cal.images is None:
        rng = np.random.default_rng(cal.seed)
        images = [verify.random_input(spec, 1, rng) for _ in range(cal.samples)]
        source = f"{cal.samples} random images (seed {cal.seed}; real images calibrate better: calibration.images)"
    else:
        images = [_read_image(p, spec) for p in _image_files(cal.images, spec)]
        source = f"{len(images)} images from {cal.images}"
    held = min(len(images) - 1, max(1, round(cal.held_out * len(images)))) if cal.held_out > 0 else 0
    return CalibrationSet(tuple(images[: len(images) - held]), tuple(images[len(images) - held :]), source)


def _image_files(folder: Path, spec: TensorSpec) -> list[Path]:
    if len(spec.shape) != 4 or spec.dtype != "uint8" or spec.shape[-1] != 3:
        raise ConfigError(
            f"calibration.images needs a model that takes (N, H, W, 3) uint8 images, not {spec.dtype} "
            f"{list(spec.shape)}; add `preprocess:` or drop calibration.images (random inputs calibrate)"
        )
    if not folder.is_dir():
        raise ConfigError(f"calibration.images {folder} is not a folder; name a folder of PNG/JPEG images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if len(files) < 2:
        raise ConfigError(
            f"calibration.images {folder} holds {len(files)} PNG/JPEG image(s); put at least 2 there "
            "(some calibrate, some are held out)"
        )
    return files


def _read_image(path: Path, spec: TensorSpec) -> np.ndarray:
    img = imaging.decode_image(path.read_bytes(), name=str(path))
    return imaging.to_model_input(img, spec.shape[1], spec.shape[2])[None].copy()


# --- running plans on the CPU ------------------------------------------------------------------------


class PlanRunner:
    """Runs a plan (or its fp8 lowering: the same segments, other Track A calls) on the CPU, image by
    image. Track B segments: onnxruntime on their fp32 form, cast back to the plan's dtypes at the
    boundaries. Track A segments: the kernels' numpy references (``references``: what the fp8 plan
    is checked by), or, for the fp16 plan, onnxruntime on the segment's fp32 form with its
    convolutions' inputs and outputs as extra outputs, read back NHWC in the plan's dtypes (the numpy
    conv references take minutes a layer at 512x512; a segment whose model lacks one of those tensors
    runs the references)."""

    def __init__(self, plan: Plan, seg_models: Sequence[onnx.ModelProto], weights: Mapping[str, np.ndarray]) -> None:
        self.weights = weights
        self.sessions: dict[str, ort.InferenceSession] = {}
        for seg, sm in zip(plan.segments, seg_models, strict=True):
            wide = verify.upcast(sm)
            if seg.track == "A":
                made = {o for n in sm.graph.node for o in n.output}
                extra = sorted(traced_names(seg) - {t.name for t in (*seg.inputs, *seg.outputs)})
                if not made.issuperset(extra):
                    continue
                wide = verify.with_outputs(wide, extra)
            self.sessions[seg.name] = verify.ort_session(wide, f"segment {seg.name}")

    def run(
        self, plan: Plan, x: np.ndarray, trace: dict[str, np.ndarray] | None = None, *, references: bool = True
    ) -> dict[str, np.ndarray]:
        """The plan's outputs for the input ``x``; ``trace`` receives the Track A tensors (every one
        through the references, the convolutions' inputs and outputs at least)."""
        env: dict[str, np.ndarray] = {plan.inputs[0].name: x}
        for seg in plan.segments:
            feeds = {t.name: env[t.name] for t in seg.inputs}
            out = None
            if seg.track == "B" or not references:
                out = self._onnx(seg, feeds, trace)
            if out is None:
                out = verify.interpret_track_a(seg, self.weights, feeds, trace)
            env.update(out)
        return {t.name: env[t.name] for t in plan.outputs}

    def _onnx(
        self, seg: Segment, feeds: dict[str, np.ndarray], trace: dict[str, np.ndarray] | None
    ) -> dict[str, np.ndarray] | None:
        """A segment through onnxruntime; None for a Track A one it cannot trace (the references run it)."""
        if seg.name not in self.sessions:
            return None
        got = verify.run_ort(self.sessions[seg.name], feeds)
        out = {t.name: np.asarray(got[t.name]).astype(t.dtype) for t in seg.outputs}
        if seg.track == "A" and trace is not None:
            specs = {t.name: t for t in seg.tensors}
            inner = {k: nchw_to_plan(v, specs[k]) if k in specs else None for k, v in got.items() if k not in out}
            if any(v is None for v in inner.values()):
                return None
            trace.update({**feeds, **out, **inner})
        return out


def traced_names(seg: Segment) -> set[str]:
    """The tensors calibration and the per-layer error read: each convolution's inputs and output."""
    return {n for c in seg.calls if c.op in CONV_OPS for n in (*c.inputs, c.outputs[0])}


def nchw_to_plan(value: np.ndarray, spec: TensorSpec) -> np.ndarray | None:
    """A tensor inside a Track A segment's graph (NCHW there: ONNX's convolutions' layout) as the plan
    holds it (NHWC, its dtype); None where the shapes do not say so."""
    a = np.asarray(value)
    if a.ndim != 4 or (a.shape[0], *a.shape[2:], a.shape[1]) != spec.at_batch(a.shape[0]):
        return None
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1).astype(spec.dtype))


def model_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The model's initializers by name, as the plan's calls name their weights."""
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


# --- calibration --------------------------------------------------------------------------------------


class TailStatistic:
    """One tensor's |value| statistic over every calibration image: its maximum (amax), or the
    ``percentile`` exactly as ``np.percentile`` (linear) computes it over all the values at once,
    from only the top values it needs (``total``: the values it will be given)."""

    def __init__(self, total: int, method: str, percentile: float) -> None:
        self.method = method
        q = percentile / 100.0 * (total - 1)
        self.rank = math.floor(q)  # ascending rank of the lower of the two values it interpolates
        self.frac = q - self.rank
        self.keep = max(total - self.rank, 1)
        self.top = np.zeros(0, np.float32)
        self.amax = 0.0

    def add(self, x: np.ndarray) -> None:
        a = np.abs(x.astype(np.float32)).ravel()
        a = a[np.isfinite(a)]  # an overflow is the fp16 plan's problem, not a scale
        if self.method == "amax":
            self.amax = max(self.amax, float(a.max(initial=0.0)))
            return
        merged = np.concatenate([self.top, a])
        if merged.size > self.keep:
            merged = np.partition(merged, merged.size - self.keep)[-self.keep :]
        self.top = merged

    def value(self) -> float:
        if self.method == "amax":
            return self.amax
        s = np.sort(self.top.astype(np.float64))
        if s.size == 0:
            return 0.0
        return float(s[0] + self.frac * (s[1] - s[0])) if s.size > 1 else float(s[0])


def scale_of(statistic: float) -> float:
    """The per-tensor scale (float32): the statistic maps to e4m3's largest finite value."""
    return float(np.float32(max(statistic, SCALE_FLOOR) / E4M3_MAX))


def layer_of(call: KernelCall) -> str:
    """A convolution call's layer name: its ONNX conv node (the first it covers)."""
    return call.nodes[0] if call.nodes else call.outputs[0]


def conv_calls(plan: Plan) -> list[tuple[Segment, KernelCall]]:
    """Every convolution call of the plan's Track A segments, in execution order."""
    return [(s, c) for s in plan.segments if s.track == "A" for c in s.calls if c.op in CONV_OPS]


def calibrate(
    runner: PlanRunner, plan: Plan, images: Sequence[np.ndarray], cal: CalibrationConfig
) -> tuple[dict[str, float], list[dict[str, np.ndarray]]]:
    """Each convolution input's statistic over ``images`` (the fp16 plan run on each), and the
    traced tensors of the first :data:`ERROR_IMAGES` images (the per-layer error runs on them)."""
    names = {c.inputs[0] for _, c in conv_calls(plan)}
    stats: dict[str, TailStatistic] = {}
    kept: list[dict[str, np.ndarray]] = []
    for i, x in enumerate(images):
        trace: dict[str, np.ndarray] = {}
        runner.run(plan, x, trace, references=False)
        for name in names:
            t = trace[name]
            if name not in stats:
                stats[name] = TailStatistic(t.size * len(images), cal.method, cal.percentile)
            stats[name].add(t)
        if i < ERROR_IMAGES:
            kept.append(trace)
    return {name: s.value() for name, s in stats.items()}, kept


# --- the per-layer choice -----------------------------------------------------------------------------


def fp8_calls(call: KernelCall, scale: float) -> tuple[KernelCall, KernelCall]:
    """The ABI's pair for one convolution reading its input at ``scale``: the quantize call and the
    conv_fp8 call (the same weights and attrs, plus ``x_scale``)."""
    x = call.inputs[0]
    xq = quantized_name(x)
    inv = float(np.float32(1.0) / np.float32(scale))
    quant = KernelCall(op="quantize_fp8", inputs=(x,), outputs=(xq,), attrs=(("inv_scale", f32_bits(inv)),))
    attrs = (*call.attrs, ("x_scale", f32_bits(scale)))
    conv = replace(call, op="conv_fp8", inputs=(xq, *call.inputs[1:]), attrs=attrs)
    return quant, conv


def quantized_name(x: str) -> str:
    return f"{x}/e4m3"


def layer_error(call: KernelCall, scale: float, traces: Sequence[Mapping[str, np.ndarray]], weights) -> float:
    """Relative L2 of the convolution's fp8 output against its fp16 output (traced with its inputs)."""
    quant, conv = fp8_calls(call, scale)
    num = den = 0.0
    for t in traces:
        args = [t[i] for i in call.inputs]
        y16 = t[call.outputs[0]].astype(np.float64)
        xq = kernels.kernel("quantize_fp8").run_reference(quant, args[:1], weights)
        y8 = kernels.kernel("conv_fp8").run_reference(conv, [xq, *args[1:]], weights).astype(np.float64)
        num += float(np.sum((y8 - y16) ** 2))
        den += float(np.sum(y16**2))
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def kept_fp16(plan: Plan, cal: CalibrationConfig) -> dict[str, str]:
    """conv node -> why it stays fp16 by configuration: ``fp16_layers``, else the first and last conv."""
    convs = [c for _, c in conv_calls(plan)]
    if cal.fp16_layers is None:
        if not convs:
            return {}
        ends = {layer_of(convs[0]): "the first convolution", layer_of(convs[-1]): "the last convolution"}
        return {k: f"{v} (fp16 by default: calibration.fp16_layers)" for k, v in ends.items()}
    nodes = {n for c in convs for n in c.nodes}
    if unknown := [n for n in cal.fp16_layers if n not in nodes]:
        names = ", ".join(map(layer_of, convs[:6])) + (", ..." if len(convs) > 6 else "")
        raise ConfigError(
            f"calibration.fp16_layers names {unknown[0]!r}, no convolution of the Track A plan; its convolutions: "
            f"{names or 'none'}"
        )
    return {n: "listed in calibration.fp16_layers" for n in cal.fp16_layers}


def choose(
    plan: Plan,
    scales: Mapping[str, float],
    traces: Sequence[Mapping[str, np.ndarray]],
    weights: Mapping[str, np.ndarray],
    cal: CalibrationConfig,
) -> tuple[LayerPrecision, ...]:
    """Each convolution's precision and why: fp16 where the config keeps it, where conv_fp8 does not
    take it (its spec's reason) or where its fp8 error on the calibration images passes
    ``calibration.threshold``; fp8 otherwise."""
    kept = kept_fp16(plan, cal)
    spec = kernels.kernel("conv_fp8")
    # conv_fp8's packed weights carry the input's scale (dequant = s_x * s_w) under the weight's name:
    # a weight two convolutions read would be packed once for one of their scales.
    readers = Counter(call.weights[0] for _, call in conv_calls(plan))
    out = []
    for _, call in conv_calls(plan):
        layer = layer_of(call)
        scale = scales[call.inputs[0]]
        named = next((kept[n] for n in call.nodes if n in kept), None)
        if named is None and readers[call.weights[0]] > 1:
            named = f"its weights {call.weights[0]} are shared with another convolution (fp8 packs its input's scale)"
        K, C = np.shape(weights[call.weights[0]])[:2]
        why = named or spec.supports(fp8_calls(call, scale)[1], C=C, K=K)  # type: ignore[attr-defined]
        if why is not None:
            out.append(LayerPrecision(layer, call.op, "fp16", why))
            continue
        err = layer_error(call, scale, traces, weights)
        if not err <= cal.threshold:
            why = f"fp8 error {err:.3g} against fp16 exceeds calibration.threshold {cal.threshold:g}"
            out.append(LayerPrecision(layer, call.op, "fp16", why, scale, err))
        else:
            out.append(LayerPrecision(layer, call.op, "fp8", f"fp8 error {err:.3g} against fp16", scale, err))
    return tuple(out)


# --- the lowering -------------------------------------------------------------------------------------


def lower(plan: Plan, layers: Sequence[LayerPrecision]) -> Plan:
    """The plan with each fp8 layer's convolution as ``conv_fp8`` reading its input quantized by a
    ``quantize_fp8`` call placed before the first convolution that reads it (one per input tensor:
    a tensor has one scale). Layers are matched by their conv node; others stay as they are."""
    scale = {x.layer: x.x_scale for x in layers if x.precision == "fp8" and x.x_scale is not None}
    return replace(plan, segments=tuple(_lowered(s, scale) if s.track == "A" else s for s in plan.segments))


def _lowered(seg: Segment, scale: Mapping[str, float]) -> Segment:
    specs = {t.name: t for t in (*seg.inputs, *seg.tensors, *seg.outputs)}
    calls: list[KernelCall] = []
    added: list[TensorSpec] = []
    done: set[str] = set()
    for call in seg.calls:
        layer = layer_of(call)
        if call.op not in CONV_OPS or layer not in scale:
            calls.append(call)
            continue
        quant, conv = fp8_calls(call, scale[layer])
        x = call.inputs[0]
        if x not in done:
            done.add(x)
            quant = replace(quant, nodes=(layer,))
            calls.append(quant)
            added.append(replace(specs[x], name=quant.outputs[0], dtype="uint8", layout="NHWC"))
        calls.append(conv)
    return replace(seg, calls=tuple(calls), tensors=(*seg.tensors, *added)) if added else seg


# --- verification -------------------------------------------------------------------------------------


def mask_of(plan: Plan, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The class mask of a run: the plan's ``mask`` output, else the argmax over the channels of its
    first float output (a one-channel output: logit > 0)."""
    if MASK in outputs:
        return np.asarray(outputs[MASK])
    spec = next(t for t in plan.outputs if np.issubdtype(np.dtype(t.dtype), np.floating))
    a = np.asarray(outputs[spec.name], np.float32)
    axis = -1 if spec.layout == "NHWC" else 1
    return a.argmax(axis) if a.shape[axis] > 1 else np.squeeze(a > 0, axis)


def agreement(
    runner: PlanRunner, plans: tuple[Plan, Plan], reference, images: Sequence[np.ndarray], what: str
) -> tuple[Agreement, list]:
    """Mask agreement of the fp8 plan (``plans[1]``) against fp32 onnxruntime (``reference``, a
    session on the upcast model) and the fp16 plan (``plans[0]``) on ``images``; and the fp8 plan's
    float outputs compared with fp32 (for the bundle's tolerance)."""
    fp16, fp8 = plans
    same = {"vs_fp32": 0, "vs_fp16": 0, "fp16_vs_fp32": 0}
    pixels = 0
    checks = []
    for x in images:
        ref = verify.run_ort(reference, {fp16.inputs[0].name: x})
        a, b = runner.run(fp16, x, references=False), runner.run(fp8, x)
        m32, m16, m8 = mask_of(fp16, ref), mask_of(fp16, a), mask_of(fp8, b)
        same["vs_fp32"] += int(np.sum(m8 == m32))
        same["vs_fp16"] += int(np.sum(m8 == m16))
        same["fp16_vs_fp32"] += int(np.sum(m16 == m32))
        pixels += m32.size
        floats = [t.name for t in fp8.outputs if np.issubdtype(np.dtype(t.dtype), np.floating)]
        checks += [compare(k, ref[k], b[k], DEFAULT_TOLERANCES["fp16"]) for k in floats]
    pct = {k: 100.0 * v / max(pixels, 1) for k, v in same.items()}
    return Agreement(what, len(images), pct["vs_fp32"], pct["vs_fp16"], pct["fp16_vs_fp32"]), checks


def measured_tolerance(checks: Sequence, agreements: Sequence[Agreement]) -> Tolerance:
    """What the bundle's checks (the GPU's first-load self-check) hold the fp8 plan to: the fp16
    default, or :data:`TOLERANCE_FACTOR` times the fp8 plan's measured error where that is larger."""
    base = DEFAULT_TOLERANCES["fp16"]
    rel = max((c.rel_l2 for c in checks if math.isfinite(c.rel_l2)), default=0.0)
    mx = max((c.max_abs for c in checks if math.isfinite(c.max_abs)), default=0.0)
    miss = max((100.0 - a.vs_fp32) / 100.0 for a in agreements) if agreements else 0.0
    return Tolerance(
        rel_l2=max(base.rel_l2, TOLERANCE_FACTOR * rel),
        max_abs=max(base.max_abs, TOLERANCE_FACTOR * mx),
        mismatch=max(base.mismatch, TOLERANCE_FACTOR * miss),
    )


# --- the stage ----------------------------------------------------------------------------------------


def build_fp8(
    cal: CalibrationConfig,
    model: onnx.ModelProto,
    plan: Plan,
    seg_models: Sequence[onnx.ModelProto],
    wgmma: Mapping[str, bool],
    say,
    cache: Path | None = None,
) -> Fp8Build:
    """The fp8 stage (module docstring) on the front end's ``model`` and its fp16 ``plan``;
    ``wgmma``: each GPU target's arch name -> whether it runs e4m3 wgmma. Raises VerificationError
    when the fp8 plan's mask agreement with fp32 falls below ``calibration.agreement_floor``. A
    stage that passed on the same model, plan, settings, images and code is read from ``cache``."""
    summary = calibration_summary(cal)
    note = unsupported_targets(wgmma)
    if note is None and not conv_calls(plan):
        note = "precision fp8 runs Track A convolutions and this plan has none (see `partition`): the bundle is fp16"
    if note is not None:
        return Fp8Build(plan, PrecisionRecord("fp8", False, note, summary, floor=cal.agreement_floor))
    images = calibration_images(cal, plan.inputs[0])
    summary.update(images=images.source, calibrate=len(images.calibrate), held_out_images=len(images.held_out))
    path = cache / f"{stage_key(cal, model, plan, images)}.json" if cache is not None else None
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        record = PrecisionRecord.from_json(saved["record"])
        for line in (x.line() for x in (*record.layers, *record.agreement)):
            say(f"fp8 (cached): {line}")
        return Fp8Build(lower(plan, record.layers), record, Tolerance(**saved["tolerance"]))
    done = calibrated(cal, model, plan, seg_models, images, summary, say)
    if path is not None and done.tolerance is not None:
        atomic.write_text(path, json.dumps({"record": done.record.to_json(), "tolerance": done.tolerance.to_json()}))
    return done


def stage_key(cal: CalibrationConfig, model: onnx.ModelProto, plan: Plan, images: CalibrationSet) -> str:
    """What the stage's outcome depends on: the settings, the model, the fp16 plan, the images and the
    code that computes it (this module and the fp8 kernels' specs, whose references it runs)."""
    h = hashlib.sha256(cal.model_dump_json().encode())
    h.update(model.SerializeToString(deterministic=True))
    h.update(plan.dumps().encode())
    for x in (*images.calibrate, b"|", *images.held_out):
        h.update(x if isinstance(x, bytes) else x.tobytes())
    for op in ("quantize_fp8", "conv_fp8"):
        h.update(Path(inspect.getfile(type(kernels.kernel(op)))).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def calibrated(
    cal: CalibrationConfig,
    model: onnx.ModelProto,
    plan: Plan,
    seg_models: Sequence[onnx.ModelProto],
    images: CalibrationSet,
    summary: dict[str, object],
    say,
) -> Fp8Build:
    """Calibrate, choose, lower and verify (the module docstring's stages) on ``images``."""
    weights = model_weights(model)
    runner = PlanRunner(plan, seg_models, weights)
    say(f"fp8: calibrating {len(conv_calls(plan))} convolution(s) on {len(images.calibrate)} image(s)")
    stats, traces = calibrate(runner, plan, images.calibrate, cal)
    layers = choose(plan, {k: scale_of(v) for k, v in stats.items()}, traces, weights, cal)
    for x in layers:
        say(f"fp8: {x.line()}")
    plan8 = lower(plan, layers)
    reference = verify.ort_session(verify.upcast(model))
    sets = [("calibration", images.calibrate), ("held-out", images.held_out)]
    agreements, checks = [], []
    for what, imgs in (s for s in sets if s[1]):
        a, c = agreement(runner, (plan, plan8), reference, imgs, what)
        say(f"fp8: agreement {a.line()}")
        agreements.append(a)
        checks += c
    record = PrecisionRecord("fp8", True, "", summary, layers, tuple(agreements), cal.agreement_floor)
    low = min(agreements, key=lambda a: a.vs_fp32)
    if low.vs_fp32 < cal.agreement_floor:
        raise VerificationError(
            f"fp8 masks agree with fp32 on {low.vs_fp32:.3f}% of pixels ({low.images} images), below "
            f"calibration.agreement_floor {cal.agreement_floor:g}%; list the worst layers in calibration.fp16_layers, "
            "lower calibration.threshold, or build fp16"
        )
    return Fp8Build(plan8, record, measured_tolerance(checks, agreements))


__all__ = [
    "CalibrationSet",
    "Fp8Build",
    "PlanRunner",
    "TailStatistic",
    "build_fp8",
    "calibrate",
    "calibration_images",
    "choose",
    "lower",
    "mask_of",
]


def widest(tol: Tolerance, done: Fp8Build | None) -> Tolerance:
    """The bundle's tolerance: ``tol`` (the fp16 plan's), widened to the fp8 plan's measured one."""
    if done is None or done.tolerance is None:
        return tol
    t = done.tolerance
    return Tolerance(max(tol.rel_l2, t.rel_l2), max(tol.max_abs, t.max_abs), max(tol.mismatch, t.mismatch))
