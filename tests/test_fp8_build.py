"""`precision: fp8` on the CPU (issue 42; compiler/fp8.py): the calibration statistics against numpy, the
per-layer choice (a layer with one huge-outlier channel in its input stays fp16, with its reason), the
lowering, config errors (one line each), a whole build of a small conv net with its mask agreement printed,
and `dualtrack info`'s listing. The plans run through the kernels' numpy references (conv_fp8's too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from dualtrack import kernels
from dualtrack.cli import main
from dualtrack.compiler import fp8, frontend, partition, verify
from dualtrack.compiler.build import BuildResult, build
from dualtrack.compiler.config import BuildConfig, CalibrationConfig, load_config
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.checks import DEFAULT_TOLERANCES
from dualtrack.contract.plan import KernelCall, Plan, Segment, TensorSpec, bits_f32, f32_bits
from dualtrack.contract.precision import PRECISION_FILE, LayerPrecision, PrecisionRecord
from dualtrack.errors import ConfigError, VerificationError

SIZE = 16
CHANNELS = (3, 16, 32, 32, 32, 4)  # c1..c5: 3x3, 3x3, 3x3, 1x1, 1x1 (c2..c4 are what conv_fp8 takes)
WINDOWS = (3, 3, 3, 1, 1)
CONFIG = """model: net.onnx
precision: fp8
preprocess: {layout: NCHW, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}
postprocess: {activation: softmax}
batch_sizes: [1]
targets: []
partition:
  mode: rules
  track_a:
    op_types: [Conv, Relu]
verify: {samples: 1, seed: 3}
"""
# Random weights on random images leave many pixels within a few percent of a class tie, where e4m3's
# rounding (about 4% a layer here) flips them: about 93% of pixels agree with fp32 (fp16: 99.9%). A
# trained network's masks are decided by wider margins; the tests set a floor this net can meet.
FLOOR = 80.0


def conv_net(path: Path, *, hostile: bool = False, seed: int = 0) -> Path:
    """Five convolutions (He-scaled random weights, ReLU between) on a (1, 3, SIZE, SIZE) input. With
    ``hostile``, c3's input holds one channel near 1e4 (c2's bias; fp16 conversion clips at 1e4) and the
    others near 0.01, and c3 reads only those others: a per-tensor e4m3 scale set by the outlier rounds
    them to zero."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "image"
    for i, (c, k, r) in enumerate(zip(CHANNELS, CHANNELS[1:], WINDOWS, strict=False)):
        w = rng.standard_normal((k, c, r, r)) * np.sqrt(2.0 / (c * r * r))
        b = rng.standard_normal(k) * 0.1
        if hostile and i == 1:
            w[1:] *= 0.01
            b[1:] *= 0.01
            b[0] = 1e4
        if hostile and i == 2:
            w[:, 0] = 0.0
            w *= 100.0
        name = f"c{i + 1}"
        inits += [
            numpy_helper.from_array(w.astype(np.float32), f"{name}.weight"),
            numpy_helper.from_array(b.astype(np.float32), f"{name}.bias"),
        ]
        nodes.append(helper.make_node("Conv", [x, f"{name}.weight", f"{name}.bias"], [f"{name}_out"], name=name))
        nodes[-1].attribute.append(helper.make_attribute("pads", [r // 2] * 4))
        x = f"{name}_out"
        if i < len(WINDOWS) - 1:
            nodes.append(helper.make_node("Relu", [x], [f"{name}_relu"], name=f"{name}_relu"))
            x = f"{name}_relu"
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, CHANNELS[-1], SIZE, SIZE])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def project(root: Path, extra: str = "", *, hostile: bool = False, config: str = CONFIG) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    conv_net(root / "net.onnx", hostile=hostile)
    path = root / "fp8.yaml"
    path.write_text(config + extra)
    return path


def fp16_stage(path: Path) -> tuple[BuildConfig, onnx.ModelProto, partition.Partitioned]:
    """What the fp8 stage receives: the front end's model (fp16) and its fp16 plan."""
    cfg, fe = frontend.load(load_config(path))
    model = partition.name_nodes(fe.model)
    return cfg, model, partition.partition_model(cfg, model)


def stage(path: Path, cal: CalibrationConfig, wgmma: dict[str, bool] | None = None) -> fp8.Fp8Build:
    _, model, parted = fp16_stage(path)
    return fp8.build_fp8(cal, model, parted.plan, parted.seg_models, wgmma or {}, print)


def by_layer(record: PrecisionRecord) -> dict[str, LayerPrecision]:
    return {x.layer: x for x in record.layers}


# --- calibration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("percentile", [99.99, 99.9, 97.5, 50.5])
def test_the_streamed_percentile_is_numpys_over_all_images(percentile: float) -> None:
    rng = np.random.default_rng(7)
    images = [rng.standard_normal((1, 5, 7, 16)).astype(np.float16) * s for s in (1.0, 30.0, 0.2)]
    stat = fp8.TailStatistic(sum(x.size for x in images), "percentile", percentile)
    for x in images:
        stat.add(x)
    want = np.percentile(np.abs(np.concatenate([x.ravel() for x in images]).astype(np.float32)), percentile)
    assert stat.value() == pytest.approx(float(want), rel=1e-6)
    assert stat.keep < sum(x.size for x in images)  # it kept the tail only


def test_amax_is_the_largest_magnitude() -> None:
    rng = np.random.default_rng(8)
    images = [rng.standard_normal((1, 4, 4, 16)).astype(np.float16) for _ in range(3)]
    stat = fp8.TailStatistic(sum(x.size for x in images), "amax", 100.0)
    for x in images:
        stat.add(x)
    assert stat.value() == float(max(np.abs(x.astype(np.float32)).max() for x in images))


@pytest.mark.parametrize("method", ["percentile", "amax"])
def test_calibration_statistics_match_numpy_on_the_conv_inputs(tmp_path: Path, method: str) -> None:
    """Each conv input's statistic over the calibration images, from the plan run through the kernels'
    references, against numpy's over the same tensors computed by onnxruntime in fp32 (fp16 storage
    and fp32 arithmetic differ by ~1e-3)."""
    path = project(tmp_path)
    _, model, parted = fp16_stage(path)
    cal = CalibrationConfig(method=method, samples=4)
    images = fp8.calibration_images(cal, parted.plan.inputs[0])
    runner = fp8.PlanRunner(parted.plan, parted.seg_models, fp8.model_weights(model))
    stats, traces = fp8.calibrate(runner, parted.plan, images.calibrate, cal)
    names = sorted({c.inputs[0] for _, c in fp8.conv_calls(parted.plan)})
    assert len(names) == 5 and set(stats) == set(names) and len(traces) == fp8.ERROR_IMAGES
    session = verify.ort_session(verify.with_outputs(verify.upcast(model), names))
    feeds = [{parted.plan.inputs[0].name: x} for x in images.calibrate]
    runs = [verify.run_ort(session, f) for f in feeds]
    for name in names:
        values = np.abs(np.concatenate([r[name].ravel() for r in runs]).astype(np.float64))
        want = values.max() if method == "amax" else np.percentile(values, 99.99)
        assert stats[name] == pytest.approx(want, rel=1e-2), name
        assert fp8.scale_of(stats[name]) == pytest.approx(stats[name] / 448, rel=1e-6)


def test_the_fp16_plan_traced_through_onnxruntime_is_what_the_references_compute(tmp_path: Path) -> None:
    """Calibration runs the fp16 plan's Track A segments through onnxruntime (fp32 arithmetic, fp16 where the
    plan stores), its convolutions' inputs and outputs read back NHWC: the references' tensors to fp16 rounding
    (rel L2 <= 2e-3; C = H = W = 16 for c2's input, so a wrong transpose cannot pass on shapes)."""
    _, model, parted = fp16_stage(project(tmp_path))
    runner = fp8.PlanRunner(parted.plan, parted.seg_models, fp8.model_weights(model))
    seg = next(s for s in parted.plan.segments if s.track == "A")
    assert seg.name in runner.sessions
    x = verify.random_input(parted.plan.inputs[0], 1, np.random.default_rng())
    fast, slow = {}, {}
    out_fast = runner.run(parted.plan, x, fast, references=False)
    out_slow = runner.run(parted.plan, x, slow)
    for name in sorted(fp8.traced_names(seg)):
        a, b = fast[name].astype(np.float64), slow[name].astype(np.float64)
        assert fast[name].dtype == np.float16 and a.shape == b.shape, name
        assert np.linalg.norm(a - b) <= 2e-3 * np.linalg.norm(b), name
    assert np.mean(out_fast["mask"] == out_slow["mask"]) >= 0.99


def test_calibration_images_from_a_folder_are_resized_and_split(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
    spec = TensorSpec("image", (1, SIZE, SIZE, 3), "uint8", "NHWC")
    got = fp8.calibration_images(CalibrationConfig(images=folder), spec)
    assert (len(got.calibrate), len(got.held_out)) == (4, 2)  # held_out 0.25 of 6, rounded
    assert all(x.shape == (1, SIZE, SIZE, 3) and x.dtype == np.uint8 for x in got.calibrate + got.held_out)
    assert "6 images from" in got.source


# --- the per-layer choice and the lowering -------------------------------------------------------


def test_a_layer_with_a_huge_outlier_channel_in_its_input_stays_fp16_with_its_reason(tmp_path: Path) -> None:
    cal = CalibrationConfig(agreement_floor=FLOOR)
    hostile = by_layer(stage(project(tmp_path / "hostile", hostile=True), cal).record)
    assert hostile["c3"].precision == "fp16"
    assert "exceeds calibration.threshold 0.1" in hostile["c3"].reason and hostile["c3"].error > 0.3
    assert hostile["c3"].x_scale > 10  # set by the outlier channel (1e4 / 448)
    assert [hostile[n].precision for n in ("c2", "c4")] == ["fp8", "fp8"]
    assert "the first convolution" in hostile["c1"].reason and "the last convolution" in hostile["c5"].reason
    plain = stage(project(tmp_path / "plain"), cal)
    layers = by_layer(plain.record)
    assert [layers[n].precision for n in ("c1", "c2", "c3", "c4", "c5")] == ["fp16", "fp8", "fp8", "fp8", "fp16"]
    assert all(layers[n].error < 0.1 for n in ("c2", "c3", "c4"))
    ops = [c.op for s in plain.plan.segments for c in s.calls]
    assert ops == ["conv", *["quantize_fp8", "conv_fp8"] * 3, "conv"]


def test_fp16_layers_replace_the_default_and_name_a_conv(tmp_path: Path) -> None:
    path = project(tmp_path)
    layers = by_layer(stage(path, CalibrationConfig(fp16_layers=("c3",), agreement_floor=FLOOR)).record)
    assert layers["c3"].reason == "listed in calibration.fp16_layers" and layers["c3"].precision == "fp16"
    assert layers["c2"].precision == "fp8"
    # c1 reads 3 channels, c5 writes 4: conv_fp8 itself refuses them (its supports() reason).
    assert layers["c1"].precision == "fp16" and "C=3" in layers["c1"].reason
    assert layers["c5"].precision == "fp16" and "K=4" in layers["c5"].reason
    with pytest.raises(ConfigError, match=r"^calibration.fp16_layers names 'c9', no convolution .*: c1, c2") as e:
        stage(path, CalibrationConfig(fp16_layers=("c9",)))
    assert "\n" not in str(e.value)


def call(op: str, x: str, y: str, w: str, **attrs: int) -> KernelCall:
    return KernelCall(op, (x,), (y,), (w,), tuple(attrs.items()), (y,))


def test_the_lowering_quantizes_each_tensor_once_before_its_first_reader() -> None:
    spec = TensorSpec("x", (1, 8, 8, 32), "float16", "NHWC")
    res = TensorSpec("r", (1, 8, 8, 32), "float16", "NHWC")
    a = call("conv3x3", "x", "a", "wa", relu=1)
    b = KernelCall("conv", ("x", "r"), ("b",), ("wb",), (("R", 1), ("S", 1), ("residual", 1)), ("b",))
    c = call("conv1x1", "a", "c", "wc")
    outs = tuple(TensorSpec(n, (1, 8, 8, 32), "float16", "NHWC") for n in "bc")
    seg = Segment(1, "A", ("a", "b", "c"), (spec, res), outs, "s.onnx", calls=(a, b, c), tensors=(outs[0],))
    plan = Plan((spec,), outs, (seg,), "fp16", (1,))
    layers = [LayerPrecision("a", "conv3x3", "fp8", "", 0.5), LayerPrecision("b", "conv", "fp8", "", 0.5)]
    lowered = fp8.lower(plan, [*layers, LayerPrecision("c", "conv1x1", "fp16", "kept")]).segments[0]
    assert [k.op for k in lowered.calls] == ["quantize_fp8", "conv_fp8", "conv_fp8", "conv1x1"]
    q, fa, fb, fc = lowered.calls
    assert q.inputs == ("x",) and bits_f32(q.attr("inv_scale")) == 2.0
    assert fa.inputs == (q.outputs[0],) and fb.inputs == (q.outputs[0], "r") and fc == c
    assert fa.attrs == (("relu", 1), ("x_scale", f32_bits(0.5)))
    assert bits_f32(fb.attr("x_scale")) == 0.5 and fb.attr("residual") == 1 and fb.weights == ("wb",)
    assert lowered.tensors[-1] == TensorSpec(q.outputs[0], (1, 8, 8, 32), "uint8", "NHWC")
    assert fp8.lower(plan, []) == plan


def test_convolutions_sharing_a_weight_stay_fp16_with_the_reason() -> None:
    """conv_fp8 packs the input's scale into the weights it uploads under the weight's name, so two
    convolutions reading one weight with their own scales stay fp16; the one beside them goes fp8."""
    rng = np.random.default_rng(3)
    names = ["x", "a", "b", "c", "d"]
    specs = {n: TensorSpec(n, (1, 9, 7, 16), "float16", "NHWC") for n in names}
    calls = (
        call("conv3x3", "x", "a", "w1", relu=1),
        call("conv3x3", "a", "b", "ws", relu=1),
        call("conv3x3", "b", "c", "ws", relu=1),
        call("conv3x3", "c", "d", "w4"),
    )
    seg = Segment(1, "A", ("a", "b", "c", "d"), (specs["x"],), (specs["d"],), "s.onnx", calls=calls,
                  tensors=tuple(specs[n] for n in "abc"))  # fmt: skip
    plan = Plan((specs["x"],), (specs["d"],), (seg,), "fp16", (1,))
    weights = {w: (rng.standard_normal((16, 16, 3, 3)) / 12).astype(np.float32) for w in ("w1", "ws", "w4")}
    weights |= {f"{w}_b": np.zeros(16, np.float32) for w in ("w1", "ws", "w4")}
    trace = {"x": rng.standard_normal((1, 9, 7, 16)).astype(np.float16)}
    for k in calls:
        trace[k.outputs[0]] = kernels.kernel("conv3x3").run_reference(k, [trace[k.inputs[0]]], weights)
    scales = {n: float(np.abs(trace[n]).max()) / 448 for n in "xabc"}
    chosen = fp8.choose(plan, scales, [trace], weights, CalibrationConfig(fp16_layers=("a",)))
    layers = {x.layer: x for x in chosen}
    assert [layers[n].precision for n in "abcd"] == ["fp16", "fp16", "fp16", "fp8"]
    assert "weights ws are shared with another convolution" in layers["b"].reason == layers["c"].reason


def test_targets_other_than_sm_90a_build_fp16_with_a_note(tmp_path: Path) -> None:
    path = project(tmp_path)
    _, model, parted = fp16_stage(path)
    done = fp8.build_fp8(
        CalibrationConfig(), model, parted.plan, parted.seg_models, {"sm_90a": True, "sm_80": False}, print
    )
    assert done.plan is parted.plan and not done.record.applied and done.tolerance is None
    assert done.record.note.startswith("precision fp8 needs sm_90a") and "sm_80 cannot run it" in done.record.note
    assert "\n" not in done.record.note


def test_a_passed_stage_is_read_back_from_the_cache_until_an_input_moves(tmp_path: Path) -> None:
    _, model, parted = fp16_stage(project(tmp_path))
    cache, cal = tmp_path / "cache", CalibrationConfig(agreement_floor=FLOOR, samples=3)

    def run(c: CalibrationConfig) -> tuple[fp8.Fp8Build, list[str]]:
        said: list[str] = []
        return fp8.build_fp8(c, model, parted.plan, parted.seg_models, {}, said.append, cache), said

    first, said = run(cal)
    again, said_again = run(cal)
    assert not any("(cached)" in x for x in said) and any(x.startswith("fp8 (cached): ") for x in said_again)
    assert (again.plan, again.record, again.tolerance) == (first.plan, first.record, first.tolerance)
    _, said_other = run(cal.model_copy(update={"threshold": 0.05}))
    assert not any("(cached)" in x for x in said_other) and len(list(cache.iterdir())) == 2


def test_a_plan_without_track_a_convolutions_stays_fp16_with_a_note(tmp_path: Path) -> None:
    iree = CONFIG.replace("  mode: rules\n  track_a:\n    op_types: [Conv, Relu]\n", "  mode: iree\n")
    path = project(tmp_path, config=iree)
    done = stage(path, CalibrationConfig())
    assert not done.record.applied and "has none (see `partition`)" in done.record.note


# --- config errors: one line each --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("calibration: {method: amax}\n", r"`calibration:` applies to `precision: fp8`; set it or drop"),
        ("precision: fp8\ncalibration: {method: amax, percentile: 99}\n", r"`percentile` applies to `method: perc"),
        ("precision: fp8\ncalibration: {held_out: 1.5}\n", r"`calibration.held_out`: Input should be less than 1"),
        ("precision: fp8\ncalibration: {agreement_floor: 0}\n", r"`calibration.agreement_floor`: Input should be gr"),
        ("precision: fp8\ncalibration: {treshold: 0.1}\n", r"unknown key `calibration.treshold`; did you mean `thr"),
        ("precision: fp8\ncalibration: {samples: 1}\n", r"`calibration.samples`: Input should be greater than or"),
        ("precision: fp8\nbatch: fixed\n", r"`precision: fp8` quantizes Track A convolutions, which `batch: fixed`"),
    ],
)
def test_config_errors_are_one_line(tmp_path: Path, extra: str, match: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: m.onnx\n" + extra)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_calibration_images_errors_are_one_line(tmp_path: Path) -> None:
    missing = project(tmp_path / "a", "calibration: {images: nowhere}\n")
    assert load_config(missing).calibration.images == (tmp_path / "a" / "nowhere").resolve()
    folder = tmp_path / "b" / "one"
    folder.mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / "x.png")
    floats = CONFIG.replace("preprocess: {layout: NCHW, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}\n", "")
    cases = [
        (missing, r"^calibration.images .*nowhere is not a folder; name a folder of PNG/JPEG images$"),
        (project(tmp_path / "b", "calibration: {images: one}\n"), r"holds 1 PNG/JPEG image\(s\); put at least 2"),
        (
            project(tmp_path / "c", f"calibration: {{images: {folder}}}\n", config=floats),
            r"needs a model that takes \(N, H, W, 3\) uint8 images, not float32 \[1, 3, 16, 16\]; add `preprocess:`",
        ),
    ]
    for path, match in cases:
        with pytest.raises(ConfigError, match=match) as e:
            build(path, tmp_path / "out")
        assert "\n" not in str(e.value)


# --- the whole build -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], BuildResult]:
    """The conv net built with precision fp8 for the CPU, calibrated on a folder of 6 PNGs."""
    root = tmp_path_factory.mktemp("fp8")
    (root / "images").mkdir()
    rng = np.random.default_rng(1)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (SIZE + 4, SIZE, 3), dtype=np.uint8)).save(root / "images" / f"{i}.png")
    path = project(root, f"calibration: {{images: images, agreement_floor: {FLOOR}}}\n")
    lines: list[str] = []
    result = build(path, root / "bundle", progress=lines.append)
    return root / "bundle", lines, result


def test_a_cpu_build_with_precision_fp8_prints_and_records_its_agreement(fp8_bundle: tuple) -> None:
    bundle, lines, result = fp8_bundle
    printed = [s for s in lines if s.startswith("fp8: agreement")]
    assert any(n.startswith("fp8: 3 of 5 convolutions in fp8") for n in result.notes)
    print("\n".join(printed))
    assert [s.split()[2] for s in printed] == ["calibration", "held-out"]
    record = PrecisionRecord.read(bundle)
    assert record is not None and record.applied and record.floor == FLOOR
    assert [a.count for a in record.agreement] == [4, 2]
    assert all(FLOOR <= a.vs_fp32 <= 100 and a.fp16_vs_fp32 >= 99 for a in record.agreement)
    b = Bundle.open(bundle)  # precision.json is hashed with the rest
    assert b.manifest.config["precision"] == "fp8" and b.plan.precision == "fp16"  # as asked; the base network
    assert PRECISION_FILE in b.manifest.files and b.manifest.verification.passed
    assert [c.op for s in b.plan.segments for c in s.calls].count("conv_fp8") == 3
    tol = b.tolerance()  # the GPU's first-load check: widened to the fp8 plan's measured error
    assert tol.rel_l2 >= DEFAULT_TOLERANCES["fp16"].rel_l2
    assert tol.mismatch >= 2 * (100 - min(a.vs_fp32 for a in record.agreement)) / 100 - 1e-9


def test_dualtrack_info_lists_each_layers_precision_and_why(fp8_bundle: tuple) -> None:
    result = CliRunner().invoke(main, ["info", str(fp8_bundle[0])])
    assert result.exit_code == 0, result.output
    fp8_lines = [s for s in result.output.splitlines() if s.startswith("fp8 ")]
    assert "precision  fp16 (the config's fp8: the `fp8` lines below); batch sizes [1]" in result.output
    assert fp8_lines[0].startswith("fp8        fp8: 3 of 5 convolutions in fp8; masks as fp32's on ")
    assert fp8_lines[0].endswith("% (held-out)")
    assert any(s.startswith("fp8        c1 (conv): fp16: the first convolution") for s in fp8_lines)
    assert any(s.startswith("fp8        c3 (conv): fp8: fp8 error") and "x_scale" in s for s in fp8_lines)
    assert sum(s.startswith("fp8        agreement ") for s in fp8_lines) == 2


def test_the_build_refuses_below_the_agreement_floor_naming_it(tmp_path: Path) -> None:
    path = project(tmp_path, "calibration: {agreement_floor: 99.99}\n")
    with pytest.raises(VerificationError, match=r"below calibration.agreement_floor 99.99%; list the worst") as e:
        build(path, tmp_path / "out")
    assert "\n" not in str(e.value) and e.value.exit_code == 7
    assert not (tmp_path / "out").exists()
