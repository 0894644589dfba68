"""The front end: exports as torch writes them build without hand edits, and what it rewrites is checked."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from exports import reference_logits, torch_style
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError

from dualtrack.compiler import frontend, onnx_graph, partition, verify
from dualtrack.compiler.config import DEFAULT_TOLERANCES, BuildConfig, Postprocess, Preprocess, Tolerance
from dualtrack.contract.plan import parameter_key
from dualtrack.errors import ConfigError, ModelError

FP32 = DEFAULT_TOLERANCES["fp32"]


def _cfg(**kw) -> BuildConfig:
    return BuildConfig(model=Path("export.onnx"), **kw)


def _ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def _plan(cfg: BuildConfig, fe: frontend.FrontEnd):
    cfg = cfg.model_copy(update={"precision": fe.precision})
    return partition.build_plan(cfg, partition.name_nodes(fe.model))


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


# -- the stages ----------------------------------------------------------------------------------------


def test_weights_listed_as_graph_inputs_become_initializers() -> None:
    fe = frontend.prepare(_cfg(), torch_style(weights_as_inputs=True))
    assert [i.name for i in fe.model.graph.input] == ["input.1"]
    assert any(r.stage == "weights" and "7 initializers" in r.detail for r in fe.rewrites)


def test_an_old_opset_is_upgraded_and_recorded() -> None:
    fe = frontend.prepare(_cfg(), torch_style(opset=11))
    assert next(o.version for o in fe.model.opset_import if o.domain == "") == frontend.TARGET_OPSET
    assert any(r.stage == "opset" and "from opset 11 to 17" in r.detail for r in fe.rewrites)


def test_identity_weights_constants_and_shape_ops_are_folded() -> None:
    fe = frontend.prepare(_cfg(), torch_style())
    assert not _ops(fe.model) & {"Identity", "Constant", "Shape", "Expand"}
    assert any(r.stage == "simplify" and "Identity" in r.detail for r in fe.rewrites)


def test_a_graph_with_nothing_to_fold_is_left_byte_identical() -> None:
    from dualtrack.compiler.reference import UNetSpec, build_unet

    model = build_unet(UNetSpec(base=4, depth=2, height=32, width=32, precision="fp16"))
    fe = frontend.prepare(_cfg(), model)
    assert fe.rewrites == []
    assert fe.model.SerializeToString(deterministic=True) == model.SerializeToString(deterministic=True)
    assert fe.precision == "fp16"


@pytest.mark.parametrize("export_batch", [1, 4])
def test_a_fixed_export_batch_becomes_generic_and_matches_the_export_image_by_image(export_batch: int) -> None:
    """Reshape and Resize constants carry the export batch; at batch 3 the processed model must still
    give what the export gives on each group of `export_batch` images."""
    fe = frontend.prepare(_cfg(batch_sizes=(1, 3)), torch_style(batch=export_batch))
    assert fe.export_batch == export_batch
    rewritten = next(r.detail for r in fe.rewrites if r.stage == "batch" and "shape constant" in r.detail)
    assert "Reshape" in rewritten and "Resize" in rewritten
    plan, _ = _plan(_cfg(batch_sizes=(1, 3)), fe)
    assert plan.inputs[0].shape == (1, 3, 16, 16)
    checks = verify.check_frontend(fe, (1, 3, 5), FP32, seed=0)
    assert [c.name for c in checks] == ["frontend b1 logits", "frontend b3 logits", "frontend b5 logits"]
    assert all(c.passed and c.rel_l2 <= 1e-6 for c in checks), [verify.Report.line(c) for c in checks]
    assert all(f"run {export_batch} at a time" in c.note for c in checks)


def test_a_batch_the_front_end_cannot_free_is_refused_with_the_fix_but_batch_one_builds() -> None:
    """The logits minus their mean over the batch: at the export's batch of 1 a no-op per image, at any
    other batch a mix of the images, so the batch cannot be freed (a ConstantOfShape([1, ...]) added
    instead broadcasts, which is right at any batch)."""
    model = torch_style()
    g = model.graph
    g.node.append(helper.make_node("ReduceMean", ["logits_raw"], ["bmean"], name="bmean", axes=[0], keepdims=1))
    g.node.append(helper.make_node("Sub", ["logits_raw", "bmean"], ["logits"], name="centre"))
    for n in g.node:
        if n.name == "/head/Conv":
            n.output[0] = "logits_raw"
    model = copy.deepcopy(model)
    with pytest.raises(
        ModelError, match=r"ReduceMean 'bmean' reduces over the dim that holds the batch.*batch_sizes: \[1\]"
    ):
        _plan(_cfg(batch_sizes=(1, 2)), frontend.prepare(_cfg(batch_sizes=(1, 2), simplify=False), model))
    plan, _ = _plan(_cfg(batch_sizes=(1,)), frontend.prepare(_cfg(batch_sizes=(1,), simplify=False), model))
    assert plan.batch_sizes == (1,)


def test_parameter_keys_follow_the_iree_importer(tmp_path: Path) -> None:
    """The rule is checked against iree-import-onnx itself: it names each externalized weight (it
    externalizes those of 100 elements or more, so these have 256)."""
    from dualtrack.compiler.tools import run_tool

    names = ["onnx::Conv_546", "encoder.layer1.0.conv1.weight", "/dec/Constant_3_output_0", "a::b:c"]
    inits = [numpy_helper.from_array(np.full((16, 16, 1, 1), i + 1, np.float32), n) for i, n in enumerate(names)]
    nodes, x = [], "x"
    for i, n in enumerate(names):
        nodes.append(helper.make_node("Conv", [x, n], [f"y{i}"], name=f"c{i}"))
        x = f"y{i}"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 4, 4])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 16, 4, 4])],
        inits,
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "m.mlir"
    run_tool("iree-import-onnx", [str(src), "-o", str(out), "--externalize-params"], what="importing")
    keys = set(re.findall(r'#stream\.parameter\.named<"model"::"([^"]+)">', out.read_text()))
    assert keys == {parameter_key(n) for n in names}
    assert parameter_key("onnx::Conv_546") == "onnx__Conv_546"


def test_initializers_whose_parameter_keys_collide_are_renamed_apart() -> None:
    model = torch_style()
    for init in model.graph.initializer:
        if init.name == "onnx::Conv_6":
            init.name = "onnx__Conv_5"  # the key of onnx::Conv_5
    for n in model.graph.node:
        for j, x in enumerate(n.input):
            if x == "onnx::Conv_6":
                n.input[j] = "onnx__Conv_5"
    fe = frontend.prepare(_cfg(), model)
    keys = [parameter_key(i.name) for i in fe.model.graph.initializer]
    assert len(keys) == len(set(keys))
    assert any(r.stage == "names" for r in fe.rewrites)
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(_run(fe.model, {"input.1": x})["logits"], reference_logits(model, x), rtol=1e-6)


# -- precision --------------------------------------------------------------------------------------------


def test_precision_comes_from_the_model_unless_the_config_asks() -> None:
    model = torch_style()
    assert frontend.prepare(_cfg(), model).precision == "fp32"
    fe = frontend.prepare(_cfg(precision="fp16"), model)
    assert fe.precision == "fp16"
    assert any(r.stage == "precision" for r in fe.rewrites)
    assert {i.data_type for i in fe.model.graph.initializer if len(i.dims) == 4} == {TensorProto.FLOAT16}
    assert fe.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # I/O types kept
    checks = verify.check_frontend(fe, (1, 2), DEFAULT_TOLERANCES["fp16"], seed=1)
    assert all(c.passed for c in checks), [verify.Report.line(c) for c in checks]
    assert all(0 < c.rel_l2 < 1e-2 for c in checks)  # really converted, and close to the fp32 export


def _cast_region_net(start: str = "float") -> onnx.ModelProto:  # "float" or "none"
    """x -> Conv -> [Cast to FLOAT] -> Gram matrix over W (MatMul with its transpose) / 4096 -> [Cast to FLOAT]
    -> + 1: the product sums 64 squares of values near 40, past fp16's 65504 unless kept in fp32 (as torch's
    `a.float() @ a.float().mT ... .to(dtype)` asks). ``start`` "none": no casts at all."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(
        (rng.standard_normal((4, 4, 1, 1)) * 0.1 + np.eye(4)[:, :, None, None] * 40).astype(np.float32), "w"
    )
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv")]
    a = "c"
    if start == "float":
        nodes.append(helper.make_node("Cast", ["c"], ["a"], name="up", to=TensorProto.FLOAT))
        a = "a"
    nodes += [
        helper.make_node("Transpose", [a], ["at"], name="t", perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", [a, "at"], ["gram"], name="gram"),
        helper.make_node("Div", ["gram", "k"], ["scaled"], name="scale"),
    ]
    out = "scaled"
    if start == "float":
        nodes.append(helper.make_node("Cast", ["scaled"], ["back"], name="down", to=TensorProto.FLOAT))
        out = "back"
    nodes.append(helper.make_node("Add", [out, "one"], ["y"], name="add"))
    inits = [
        w,
        numpy_helper.from_array(np.array(4096.0, np.float32), "k"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    graph = helper.make_graph(
        nodes, "cast_region", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _computes_in(model: onnx.ModelProto, node: str) -> int:
    """The element type of the named node's output."""
    _, elems = onnx_graph.inferred_dims(model)
    return elems[next(n.output[0] for n in model.graph.node if n.name == node)]


def test_math_the_export_casts_to_float32_itself_stays_fp32_in_an_fp16_build() -> None:
    x = {"x": np.random.default_rng(4).uniform(0.9, 1.1, (1, 4, 8, 64)).astype(np.float32)}
    model = _cast_region_net()
    assert frontend.explicit_fp32_tensors(model) == {"a", "at", "gram", "scaled", "back"}
    want = _run(model, x)["y"]
    fe = frontend.prepare(_cfg(precision="fp16", simplify=False), model)
    kept = [r.detail for r in fe.rewrites if r.stage == "precision" and "between its own casts" in r.detail]
    assert len(kept) == 1 and kept[0].startswith("5 node(s)"), fe.rewrites
    got = _run(fe.body, x)["y"]
    assert np.isfinite(got).all() and np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)
    assert _computes_in(fe.body, "gram") == _computes_in(fe.body, "scale") == TensorProto.FLOAT
    assert _computes_in(fe.body, "conv") == TensorProto.FLOAT16
    # The same math without the casts is fp16 (whether a runtime then overflows is its own: IREE's did on
    # EfficientViT, onnxruntime's CPU MatMul accumulates and scales in fp32).
    bare = frontend.prepare(_cfg(precision="fp16", simplify=False), _cast_region_net("none"))
    assert _computes_in(bare.body, "gram") == TensorProto.FLOAT16
    # A cast on its own marks no math (MONAI's HighResNet casts each block's input): nothing kept.
    lone = helper.make_model(
        helper.make_graph(
            [helper.make_node("Cast", ["x"], ["y"], name="c", to=TensorProto.FLOAT)], "lone",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    assert frontend.explicit_fp32_tensors(lone) == frozenset()


def test_fp32_on_an_fp16_model_is_refused() -> None:
    from dualtrack.compiler.reference import UNetSpec, build_unet

    model = build_unet(UNetSpec(base=4, depth=2, height=32, width=32, precision="fp16"))
    with pytest.raises(ConfigError, match=r"precision: fp32.*weights are fp16"):
        frontend.prepare(_cfg(precision="fp32"), model)


# -- the image wrap ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "color"), [("NCHW", "RGB"), ("NCHW", "BGR"), ("NHWC", "RGB")])
def test_the_wrap_feeds_the_model_the_declared_normalisation(layout: str, color: str) -> None:
    model = torch_style()
    if layout == "NHWC":  # an NHWC model: a transpose in front of the NCHW body
        g = model.graph
        for n in g.node:
            for j, x in enumerate(n.input):
                if x == "input.1":
                    n.input[j] = "input_nchw"
        g.node.insert(0, helper.make_node("Transpose", ["input.1"], ["input_nchw"], name="t", perm=[0, 3, 1, 2]))
        del g.input[:]
        g.input.append(helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 16, 16, 3]))
    pre = Preprocess(layout=layout, color=color, scale=255.0, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))
    fe = frontend.prepare(_cfg(preprocess=pre, postprocess=Postprocess()), model)
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    got = _run(fe.model, {"image": image})
    # the reference, by hand: float64 normalisation in numpy, the export run image by image
    px = image.astype(np.float64)[..., ::-1] if color == "BGR" else image.astype(np.float64)
    x = (px / 255.0 - np.array(pre.mean)) / np.array(pre.std)
    x = x.astype(np.float32) if layout == "NHWC" else x.transpose(0, 3, 1, 2).astype(np.float32)
    logits = reference_logits(model, x)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = e / e.sum(axis=1, keepdims=True)
    assert got["probs"].dtype == np.float32 and got["mask"].dtype == np.uint8
    np.testing.assert_allclose(got["probs"], probs, atol=1e-5)
    confident = np.abs(probs[:, 0] - probs[:, 1]) > 1e-4
    assert np.array_equal(got["mask"][confident], probs.argmax(axis=1)[confident])
    assert [o.name for o in fe.model.graph.output] == ["mask", "probs"]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_a_one_channel_model_reads_the_luma_of_the_rgb_image(layout: str) -> None:
    """`color: GRAY`: the bundle still takes uint8 (N, H, W, 3) RGB; the model's one channel is the
    luma 0.299 R + 0.587 G + 0.114 B, normalised by the one mean and std."""
    model = torch_style(in_channels=1)
    if layout == "NHWC":
        g = model.graph
        for n in g.node:
            n.input[:] = ["input_nchw" if x == "input.1" else x for x in n.input]
        g.node.insert(0, helper.make_node("Transpose", ["input.1"], ["input_nchw"], name="t", perm=[0, 3, 1, 2]))
        del g.input[:]
        g.input.append(helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 16, 16, 1]))
    pre = Preprocess(layout=layout, color="GRAY", scale=255.0, mean=(0.45,), std=(0.22,))
    fe = frontend.prepare(_cfg(preprocess=pre, postprocess=Postprocess()), model)
    image = np.random.default_rng(6).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    got = _run(fe.model, {"image": image})
    luma = image.astype(np.float64) @ np.array([0.299, 0.587, 0.114])  # (N, H, W)
    x = ((luma / 255.0 - 0.45) / 0.22).astype(np.float32)[:, None]
    logits = reference_logits(model, x if layout == "NCHW" else x.transpose(0, 2, 3, 1))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(got["probs"], e / e.sum(axis=1, keepdims=True), atol=1e-5)
    assert any("GRAY (the luma of RGB)" in r.detail for r in fe.rewrites if r.stage == "wrap")
    # a grey image (R = G = B, as the bundle reads a grey PNG) reaches the model as its own values
    grey = np.repeat(image[..., :1], 3, axis=-1)
    flat = ((grey[..., 0].astype(np.float64) / 255.0 - 0.45) / 0.22).astype(np.float32)[:, None]
    np.testing.assert_allclose(
        _run(fe.model, {"image": grey})["probs"],
        _softmax(reference_logits(model, flat if layout == "NCHW" else flat.transpose(0, 2, 3, 1))),
        atol=1e-5,
    )


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_a_color_that_does_not_fit_the_model_channels_names_the_setting() -> None:
    with pytest.raises(ModelError, match=r"has 1 channel\(s\) and color RGB feeds 3; set preprocess.color: GRAY"):
        frontend.prepare(_cfg(preprocess=Preprocess()), torch_style(in_channels=1))
    with pytest.raises(ModelError, match=r"has 3 channel\(s\) and color GRAY feeds 1; set preprocess.color: RGB"):
        frontend.prepare(_cfg(preprocess=Preprocess(color="GRAY", mean=(0.5,))), torch_style())


def test_gray_takes_one_mean_and_std_and_rgb_takes_one_or_three() -> None:
    assert Preprocess(color="GRAY").per_channel("mean") == (0.0,)  # the defaults are equal: one value
    assert Preprocess(mean=(0.5,)).per_channel("mean") == (0.5, 0.5, 0.5)
    with pytest.raises(ValidationError, match=r"takes one value, not \[0.4, 0.5, 0.6\].*mean: \[0.4\]"):
        Preprocess(color="GRAY", mean=(0.4, 0.5, 0.6))
    with pytest.raises(ValidationError, match="give 3 values"):
        Preprocess(std=(0.2, 0.3))


def test_one_class_with_sigmoid_masks_where_p_exceeds_half() -> None:
    pre = Preprocess(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    fe = frontend.prepare(_cfg(preprocess=pre, postprocess=Postprocess(activation="sigmoid")), torch_style(classes=1))
    image = np.random.default_rng(3).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    got = _run(fe.model, {"image": image})
    assert got["probs"].shape == (2, 1, 16, 16) and got["mask"].shape == (2, 16, 16)
    assert np.array_equal(got["mask"], (got["probs"][:, 0] > 0.5).astype(np.uint8))
    assert 0 < got["mask"].mean() < 1  # both classes present: the check is not vacuous


def test_a_model_whose_output_is_not_a_segmentation_map_is_refused_with_the_fix() -> None:
    model = torch_style()
    g = model.graph
    g.node.append(helper.make_node("GlobalAveragePool", ["logits"], ["pooled"], name="gap"))
    g.node.append(helper.make_node("Flatten", ["pooled"], ["scores"], name="flat"))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2]))
    with pytest.raises(ModelError, match=r"one 4-D \(N, classes, H, W\) float output.*postprocess.output"):
        frontend.prepare(_cfg(postprocess=Postprocess()), model)
    with pytest.raises(ModelError, match="not a segmentation map"):
        frontend.prepare(_cfg(postprocess=Postprocess(output="scores")), model)
    with pytest.raises(ConfigError, match="no output 'nope'"):
        frontend.prepare(_cfg(postprocess=Postprocess(output="nope")), model)


def test_class_names_must_match_the_channels() -> None:
    with pytest.raises(ConfigError, match=r"names 3 classes.*2 channels"):
        frontend.prepare(_cfg(postprocess=Postprocess(classes=("a", "b", "c"))), torch_style())


def test_a_model_with_two_inputs_is_refused_with_the_fix() -> None:
    model = torch_style()
    model.graph.input.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1, 3]))
    with pytest.raises(ModelError, match=r"2 inputs \('input.1', 'extra'\).*one input tensor"):
        frontend.prepare(_cfg(), model)


def test_a_preprocess_that_does_not_fit_the_input_is_refused() -> None:
    with pytest.raises(ModelError, match=r"not a NHWC float image with 3 channel\(s\); fix preprocess.layout"):
        frontend.prepare(_cfg(preprocess=Preprocess(layout="NHWC")), torch_style())


# -- verification ----------------------------------------------------------------------------------------------


def test_max_abs_scales_with_the_output() -> None:
    """Logits that reach 1e4 with a 1e-6 relative error pass; the same absolute error at O(1) fails."""
    tol = Tolerance(rel_l2=1e-4, max_abs=1e-3, mismatch=0)
    rng = np.random.default_rng(4)
    big = rng.standard_normal(1000) * 1e4
    assert verify.compare("big", big, big * (1 + 1e-6), tol).passed
    small = rng.standard_normal(1000)
    off = small.copy()
    off[7] += 2e-2
    check = verify.compare("small", small, off, tol)
    assert not check.passed and check.max_abs == pytest.approx(2e-2 / max(1.0, np.abs(small).max()))


def test_random_float_inputs_are_signed() -> None:
    from dualtrack.contract.plan import TensorSpec

    x = verify.random_input(TensorSpec("t", (1, 8, 8, 8), "float32"), 2, np.random.default_rng(5))
    assert x.min() < 0 < x.max()


def test_a_model_onnxruntime_cannot_load_is_a_model_error() -> None:
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="example.custom")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    )
    with pytest.raises(ModelError, match=r"onnxruntime .* cannot load the reference model .*NoSuchOp"):
        verify.ort_session(model, "the reference model")


def test_an_output_already_called_probs_or_mask_is_renamed_out_of_the_way() -> None:
    model = torch_style()
    for n in model.graph.node:
        if n.name == "/head/Conv":
            n.output[0] = "probs"
    model.graph.output[0].name = "probs"
    fe = frontend.prepare(_cfg(preprocess=Preprocess(), postprocess=Postprocess(output="probs")), model)
    assert [o.name for o in fe.model.graph.output] == ["mask", "probs"]
    image = np.random.default_rng(6).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    got = _run(fe.model, {"image": image})
    np.testing.assert_allclose(got["probs"].sum(axis=1), 1.0, rtol=1e-6)  # softmax'd logits, not the logits
    assert any("output 'probs'" in r.detail for r in fe.rewrites)


def test_an_fp16_model_is_checked_against_the_same_weights_in_fp32() -> None:
    """verify.upcast widens weights, casts and boundaries: the reference computes the fp16 network exactly."""
    from dualtrack.compiler.reference import UNetSpec, build_unet

    model = build_unet(UNetSpec(base=4, depth=2, height=32, width=32, precision="fp16", seed=2))
    wide = verify.upcast(model)
    assert not {i.data_type for i in wide.graph.initializer} & {TensorProto.FLOAT16}
    assert all(a.i != TensorProto.FLOAT16 for n in wide.graph.node for a in n.attribute if a.name == "to")
    image = np.random.default_rng(7).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    narrow, exact = _run(model, {"image": image}), _run(wide, {"image": image})
    for a, b in zip(model.graph.initializer, wide.graph.initializer, strict=True):
        assert np.array_equal(numpy_helper.to_array(a).astype(np.float32), numpy_helper.to_array(b))
    err = np.linalg.norm(narrow["probs"] - exact["probs"]) / np.linalg.norm(exact["probs"])
    assert 0 < err < 1e-2  # the fp16 run rounds; the widened one does not, and they agree to fp16's precision
    sess = ort.InferenceSession(wide.SerializeToString(), providers=["CPUExecutionProvider"])
    got = verify.run_ort(sess, {"image": image})  # uint8 feeds pass through unchanged
    np.testing.assert_array_equal(got["mask"], exact["mask"])


def test_a_mask_is_compared_where_its_reference_decides_the_class() -> None:
    """A class flip where the reference's top two probabilities tie within the measured error is rounding;
    a flip anywhere else is a mismatch, and the mask check fails on it."""
    tol = Tolerance(rel_l2=1e-2, max_abs=0.1, mismatch=0.0)
    rng = np.random.default_rng(8)
    p1 = rng.uniform(0.6, 1.0, (1, 8, 8))
    p1[0, 0, 0] = 0.501  # a near tie
    probs = np.stack([1 - p1, p1], axis=1).astype(np.float32)
    got_probs = probs.copy()
    got_probs[0, :, 0, 0] = [0.503, 0.497]  # rounding moved it across
    mask = np.ones((1, 8, 8), np.uint8)
    flipped = mask.copy()
    flipped[0, 0, 0] = 0
    ref = {"mask": mask, "probs": probs}
    ok = verify.compare_outputs("plan b1", "#0", ref, {"mask": flipped, "probs": got_probs}, tol)
    assert all(c.passed for c in ok) and "1 of 64 pixels within rounding of a tie left out" in ok[0].note
    wrong = flipped.copy()
    wrong[0, 5, 5] = 0  # a decided pixel (p1 >= 0.6)
    bad = verify.compare_outputs("plan b1", "#0", ref, {"mask": wrong, "probs": got_probs}, tol)
    assert not bad[0].passed and bad[0].mismatch == pytest.approx(1 / 63)


def test_probabilities_out_of_tolerance_excuse_no_mask_flip() -> None:
    """Garbage probs (error 1.0) must not make every pixel a 'tie': the mask is then compared everywhere."""
    tol = Tolerance(rel_l2=1e-2, max_abs=0.1, mismatch=0.0)
    probs = np.stack([np.full((1, 4, 4), 0.1), np.full((1, 4, 4), 0.9)], axis=1).astype(np.float32)
    garbage = probs[:, ::-1].copy()
    ref = {"mask": np.ones((1, 4, 4), np.uint8), "probs": probs}
    checks = verify.compare_outputs(
        "plan b1", "#0", ref, {"mask": np.zeros((1, 4, 4), np.uint8), "probs": garbage}, tol
    )
    assert [c.passed for c in checks] == [False, False] and checks[0].mismatch == 1.0 and checks[0].note == ""


def test_an_output_that_is_also_read_inside_converts_to_fp16() -> None:
    """onnxconverter-common casts a kept-fp32 output in place; one read inside the graph gets its own Identity first."""
    model = torch_style()
    model.graph.output.append(
        helper.make_tensor_value_info("/enc/relu/Relu_output_0", TensorProto.FLOAT, [1, 8, 16, 16])
    )
    fe = frontend.prepare(_cfg(precision="fp16"), model)
    checks = verify.check_frontend(fe, (1, 2), DEFAULT_TOLERANCES["fp16"], seed=4)
    assert [c.name for c in checks] == [
        f"frontend b{b} {n}" for b in (1, 2) for n in ("logits", "/enc/relu/Relu_output_0")
    ]
    assert all(c.passed for c in checks), [verify.Report.line(c) for c in checks]


def test_a_constant_shared_by_an_fp32_resize_and_an_fp16_norm_converts_to_fp16() -> None:
    """The dynamo exporter shares equal constants: here a 4-channel InstanceNorm's scale and a Resize's
    scales, both [1, 1, 1, 1]. onnxconverter-common keeps a Resize's inputs fp32, and so kept the shared
    tensor fp32 for the norm too (an invalid graph); each side now gets its own copy, and the fp16 model
    computes the fp32 one's answer."""
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    ones = numpy_helper.from_array(np.ones(4, np.float32), "ones")
    zeros = numpy_helper.from_array(np.zeros(4, np.float32), "zeros")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("InstanceNormalization", ["c", "ones", "zeros"], ["n"]),
        helper.make_node("Resize", ["n", "", "ones"], ["r"], mode="linear"),
        helper.make_node("Relu", ["r"], ["logits"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 10])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4, 12, 10])
    graph = helper.make_graph(nodes, "g", [x], [y], [w, ones, zeros])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    converted, precision = frontend.convert_precision(model, "fp16", [])
    onnx.checker.check_model(converted, full_check=True)
    norm = next(n for n in converted.graph.node if n.op_type == "InstanceNormalization")
    resize = next(n for n in converted.graph.node if n.op_type == "Resize")
    types = {i.name: i.data_type for i in converted.graph.initializer}
    assert precision == "fp16" and types[norm.input[1]] == TensorProto.FLOAT16
    assert types[resize.input[2]] == TensorProto.FLOAT
    feeds = {"x": rng.standard_normal((1, 3, 12, 10)).astype(np.float32)}
    np.testing.assert_allclose(_run(converted, feeds)["logits"], _run(model, feeds)["logits"], rtol=0.02, atol=0.02)


def test_zeros_of_a_default_constant_of_shape_convert_to_fp16() -> None:
    """A ConstantOfShape without `value` makes float32 zeros (the dynamo exporter's canvas for a MaxUnpool's
    ScatterND). onnxconverter-common converts float attributes, not defaults, so the zeros stayed float32
    beside the fp16 updates (an invalid graph); the value is now spelt out first and converts with the rest."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)).astype(np.float32), "w")
    idx = numpy_helper.from_array(np.array([[0], [2], [5]], np.int64), "idx")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["zeros"]),
        helper.make_node("Transpose", ["c"], ["t"], perm=[1, 0, 2, 3]),
        helper.make_node("Slice", ["t", "z0", "n3", "z0"], ["upd"]),
        helper.make_node("Transpose", ["zeros"], ["zt"], perm=[1, 0, 2, 3]),
        helper.make_node("ScatterND", ["zt", "idx", "upd"], ["sc"]),
        helper.make_node("Transpose", ["sc"], ["logits"], perm=[1, 0, 2, 3]),
    ]
    consts = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("z0", 0), ("n3", 3))]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 7, 9])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 6, 7, 9])
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], [w, idx, *consts]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    converted, precision = frontend.convert_precision(model, "fp16", [])
    onnx.checker.check_model(converted, full_check=True)
    fill = next(n for n in converted.graph.node if n.op_type == "ConstantOfShape")
    assert precision == "fp16" and helper.get_attribute_value(fill.attribute[0]).data_type == TensorProto.FLOAT16
    feeds = {"x": rng.standard_normal((1, 3, 7, 9)).astype(np.float32)}
    want = _run(model, feeds)["logits"]
    assert not want[:, [1, 3, 4]].any() and want[:, [0, 2, 5]].any()
    np.testing.assert_allclose(_run(converted, feeds)["logits"], want, rtol=0.02, atol=0.02)


def test_chained_resizes_with_the_export_batch_in_their_sizes_all_become_generic() -> None:
    """torch's dynamo exporter writes every F.interpolate's sizes as a constant with the batch in it; after
    the first becomes scales, shape inference names the batch afresh (N x 1.0), and the next must follow."""
    x = "x"
    nodes, inits = [], []
    for i, hw in enumerate((16, 32, 64)):
        inits.append(numpy_helper.from_array(np.array([1, 4, hw, hw], np.int64), f"sizes{i}"))
        nodes.append(helper.make_node("Resize", [x, "", "", f"sizes{i}"], [f"up{i}"], name=f"up{i}", mode="nearest"))
        nodes.append(helper.make_node("Relu", [f"up{i}"], [f"r{i}"], name=f"relu{i}"))
        x = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4, 64, 64])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    fe = frontend.prepare(_cfg(batch_sizes=(1, 3)), model)
    assert "3 shape constant(s) carried the export batch 1" in " ".join(r.detail for r in fe.rewrites)
    plan, _ = _plan(_cfg(batch_sizes=(1, 3)), fe)
    assert plan.outputs[0].shape == (1, 4, 64, 64)
    checks = verify.check_frontend(fe, (1, 3), FP32, seed=9)
    assert all(c.passed and c.rel_l2 == 0 for c in checks), [verify.Report.line(c) for c in checks]


def _resize_to_shape_of(h: int, w: int, ho: int, wo: int) -> onnx.ModelProto:
    """x (N, 3, h, w) -> Resize to the size of y (N, 3, ho, wo), as torch exports
    ``F.interpolate(x, size=y.shape[-2:], mode="bilinear")``: sizes = Concat(Shape(x)[:2], Shape(y)[2:])."""
    c = helper.make_tensor
    nodes = [
        helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[1, 1], strides=[h // ho or 1, w // wo or 1]),
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Shape", ["y"], ["sy"]),
        helper.make_node("Slice", ["sx", "zero", "two"], ["nc"]),
        helper.make_node("Slice", ["sy", "two", "four"], ["hw"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["y", "", "", "sizes"], ["up"], mode="linear"),
        helper.make_node("Add", ["up", "up"], ["out"]),
    ]
    inits = [c(n, TensorProto.INT64, [1], [v]) for n, v in (("zero", 0), ("two", 2), ("four", 4))]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, h, w])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_resize_sizes_computed_from_static_shapes_become_constant_scales() -> None:
    model = _resize_to_shape_of(16, 12, 16, 12)  # y has x's size: the sizes are (h, w)
    model.graph.node[0].attribute[1].ints[:] = [2, 3]  # y: (8, 4), Resize back up to (8, 4)
    log: list[frontend.Rewrite] = []
    out = frontend.static_resize_scales(model, log)
    resize = next(n for n in out.graph.node if n.op_type == "Resize")
    scales = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}[resize.input[2]]
    assert len(resize.input) == 3 and scales.tolist() == [1, 1, 1, 1]
    assert "Shape" not in _ops(out) and "Concat" not in _ops(out)  # the shape nodes are gone
    assert log and log[0].stage == "resize"
    x = np.random.default_rng().standard_normal((2, 3, 16, 12)).astype(np.float32)
    np.testing.assert_array_equal(_run(out, {"x": x})["out"], _run(model, {"x": x})["out"])


@pytest.mark.parametrize(("size", "out"), [(11, 13), (10, 19), (38, 75), (15, 31)])
def test_resize_sizes_whose_ratio_float32_rounds_low_get_a_scale_that_gives_the_size_in_every_arithmetic(
    size: int, out: int
) -> None:
    """float32(13/11) * 11 is 12.99... in float64 and float32(1.9) * 10 is 18.99999976 (U^2-Net's
    upsample-like from a ceil-mode pool's 10 to 19): ONNX shape inference (float64) then gave one pixel less
    than onnxruntime (float32) and the next Concat failed. The scale is raised an ulp until both give the size."""
    model = _resize_to_shape_of(size, size, size, size)
    model.graph.initializer.append(helper.make_tensor("target", TensorProto.INT64, [2], [out, out]))
    model.graph.node[5].input[1] = "target"
    out_model = frontend.static_resize_scales(model, log := [])
    assert log, "not rewritten"
    inferred = onnx.shape_inference.infer_shapes(out_model, strict_mode=True)
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    assert dims["up"][2:] == [out, out]
    x = np.random.default_rng(3).standard_normal((2, 3, size, size)).astype(np.float32)
    got, want = _run(out_model, {"x": x})["out"], _run(model, {"x": x})["out"]
    assert got.shape == want.shape == (2, 3, out, out)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_resize_scale_gives_every_size_back_in_float32_and_float64() -> None:
    for size in range(1, 130):
        for out in range(1, 4 * size + 1):
            scale = onnx_graph.resize_scale(out, size)
            assert scale is not None and scale.dtype == np.float32, (out, size)
            assert int(np.floor(np.float32(size) * scale)) == out == int(np.floor(size * float(scale))), (out, size)


@pytest.mark.parametrize(
    ("reduce", "op", "k"), [("ReduceSum", "Add", 4), ("ReduceMean", "Add", 3), ("ReduceMax", "Max", 2)]
)
def test_a_reduction_over_a_stack_becomes_an_element_wise_chain(reduce: str, op: str, k: int) -> None:
    """torch.stack(xs).sum(0) (smp FPN's merge) puts the batch in dim 1: rewritten as a chain of
    element-wise ops on the tensors themselves, the same result, every tensor batch-major."""
    rng = np.random.default_rng(3)
    xs = [f"x{i}" for i in range(k)]
    nodes, inits = [], [numpy_helper.from_array(np.array([0], np.int64), "zero")]
    for x in xs:
        nodes.append(helper.make_node("Relu", ["image"], [f"{x}_r"]))
        nodes.append(helper.make_node("Mul", [f"{x}_r", f"{x}_s"], [x]))
        inits.append(numpy_helper.from_array(rng.standard_normal((1, 3, 1, 1)).astype(np.float32), f"{x}_s"))
        nodes.append(helper.make_node("Unsqueeze", [x, "zero"], [f"{x}_u"]))
    nodes.append(helper.make_node("Concat", [f"{x}_u" for x in xs], ["stack"], axis=0))
    nodes.append(helper.make_node(reduce, ["stack", "zero"] if reduce == "ReduceSum" else ["stack"], ["y"], keepdims=0,
                                  **({} if reduce == "ReduceSum" else {"axes": [0]})))  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    log: list = []
    out = frontend.unstack_reductions(model, log)
    ops = [n.op_type for n in out.graph.node]
    assert "Concat" not in ops and "Unsqueeze" not in ops and reduce not in ops
    assert ops.count(op) == k - 1 and str(log[0]).startswith("stack: 1 reduction(s)")
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    want = _run(model, {"image": x})["y"]
    np.testing.assert_allclose(_run(out, {"image": x})["y"], want, rtol=1e-6, atol=1e-6)


def test_unnamed_nodes_convert_to_fp16() -> None:
    """onnxconverter-common names the Casts around the ops it keeps in fp32 after their nodes: two unnamed
    ones (a ReduceMean and a ReduceSum here) gave two `_output_cast_0`s, an invalid graph that stopped the
    build as a dualtrack bug. Nodes are named first."""
    rng = np.random.default_rng(8)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("ReduceMax", ["c"], ["m"], axes=[1], keepdims=1),
        helper.make_node("ReduceMean", ["c"], ["a"], axes=[1], keepdims=1),
        helper.make_node("ReduceSum", ["c", "axes"], ["s"], keepdims=1),
        helper.make_node("Concat", ["m", "a", "s"], ["logits"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 6, 5])],
        [w, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    converted, _ = frontend.convert_precision(model, "fp16", [])
    onnx.checker.check_model(converted, full_check=True)
    feeds = {"x": rng.standard_normal((1, 3, 6, 5)).astype(np.float32)}
    np.testing.assert_allclose(_run(converted, feeds)["logits"], _run(model, feeds)["logits"], rtol=0.02, atol=0.02)


@pytest.mark.parametrize("opset", [17, 18])
def test_a_max_over_the_whole_picture_becomes_a_maxpool_window(opset: int) -> None:
    """ReduceMax over H, W with keepdims (dynamo's adaptive_max_pool2d(x, 1)) and GlobalMaxPool become the
    MaxPool of one picture-sized window (Track A's max-pool takes it); a max over the channels or without
    keepdims stays as it is. The same values, by onnxruntime."""
    rng = np.random.default_rng(9)
    w = numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)).astype(np.float32), "w")
    inits = [w]
    hw = {"keepdims": 1}
    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array([2, 3], np.int64), "axes_hw"))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes_c"))
        reduce_hw = helper.make_node("ReduceMax", ["c", "axes_hw"], ["m1"], name="rmax_hw", **hw)
        reduce_c = helper.make_node("ReduceMax", ["c", "axes_c"], ["m3"], name="rmax_c", keepdims=1)
    else:
        reduce_hw = helper.make_node("ReduceMax", ["c"], ["m1"], name="rmax_hw", axes=[-2, -1], **hw)
        reduce_c = helper.make_node("ReduceMax", ["c"], ["m3"], name="rmax_c", axes=[1], keepdims=1)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        reduce_hw,
        helper.make_node("GlobalMaxPool", ["c"], ["m2"], name="gmp"),
        reduce_c,
        helper.make_node("Add", ["m1", "m2"], ["g"], name="add"),
        helper.make_node("Mul", ["c", "g"], ["cg"], name="gate"),
        helper.make_node("Add", ["cg", "m3"], ["logits"], name="plus"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 13, 9])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 6, 13, 9])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    log: list = []
    out = frontend.global_max_pools(model, log)
    ops = {n.name: (n.op_type, [(a.name, helper.get_attribute_value(a)) for a in n.attribute]) for n in out.graph.node}
    assert ops["rmax_hw"] == ("MaxPool", [("kernel_shape", [13, 9])]) and ops["gmp"][0] == "MaxPool"
    assert ops["rmax_c"][0] == "ReduceMax" and [r.stage for r in log] == ["pools"]
    feeds = {"x": rng.standard_normal((1, 3, 13, 9)).astype(np.float32)}
    np.testing.assert_array_equal(_run(out, feeds)["logits"], _run(model, feeds)["logits"])


def test_shape_inference_and_the_stage_check_without_the_weights_answer_as_with_them() -> None:
    """onnx_graph.infer_shapes and check_model see the float weights as typed graph inputs (onnx_graph.weightless):
    every tensor's inferred shape and type is the full model's, the small constants a shape is computed from
    (a Reshape's shape, a Resize's scales) keep their values, the model's own inputs are the inferred model's, and
    a model the checker rejects is still rejected."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b")  # 6 elements: stays an initializer
    shape = numpy_helper.from_array(np.array([0, 6, -1], np.int64), "shape")
    scales = numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Resize", ["c", "", "scales"], ["r"], mode="nearest"),
        helper.make_node("Reshape", ["r", "shape"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 10, 7])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, None])
    graph = helper.make_graph(nodes, "g", [x], [y], [w, b, shape, scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()

    light = onnx_graph.weightless(model)
    assert [i.name for i in light.graph.input] == ["x", "w"]
    assert sorted(i.name for i in light.graph.initializer) == ["b", "scales", "shape"]
    full = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    got = onnx_graph.infer_shapes(model, strict_mode=True, data_prop=True)
    assert model.SerializeToString() == before  # the model itself is not changed
    assert [i.name for i in got.graph.input] == ["x"]

    def typed(m: onnx.ModelProto) -> dict[str, str]:
        return {v.name: str(v.type) for v in [*m.graph.value_info, *m.graph.output]}

    assert typed(got) == typed(full)
    assert [d.dim_value for d in got.graph.output[0].type.tensor_type.shape.dim][1:] == [6, 10 * 12]  # scales read
    onnx_graph.check_model(model, full_check=True)

    bad = copy.deepcopy(model)
    bad.graph.node[0].input[1] = "missing"  # a stage that dropped the tensor a node reads
    with pytest.raises(onnx.checker.ValidationError, match="missing"):
        onnx_graph.check_model(bad)
