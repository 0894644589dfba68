"""Partitioning the tiny U-Net: the plan's shape, kernel lowering, and the segment ONNX models
checked against the whole model with onnxruntime on fresh random images. No compilers, no GPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dualtrack.compiler import frontend, partition
from dualtrack.compiler.config import BuildConfig, InputSpec, PartitionConfig, Rules, load_config
from dualtrack.contract.plan import Plan
from dualtrack.errors import ModelError, PartitionError, UnsupportedOpError

PROBS_REL_L2 = 1e-5  # fp32 end to end, same onnxruntime kernels: only summation order may differ
MASK_MISMATCH = 1e-3  # argmax may flip only where two classes tie to within fp32 rounding


@pytest.fixture(scope="module")
def tiny(tiny_config: Path) -> tuple[BuildConfig, onnx.ModelProto]:
    cfg = load_config(tiny_config)  # the partition on the model as written: no front-end rewrites
    return cfg, partition.name_nodes(frontend.load_model(cfg.model))


def with_partition(cfg: BuildConfig, track_a: Rules, track_b: Rules | None = None) -> BuildConfig:
    return cfg.model_copy(
        update={"partition": PartitionConfig(mode="rules", track_a=track_a, track_b=track_b or Rules())}
    )


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    r, g = ref.astype(np.float64), got.astype(np.float64)
    return float(np.linalg.norm(g - r) / np.linalg.norm(r))


# --- the plan ---------------------------------------------------------------------------------


def test_tiny_model_splits_b_a_b_with_nhwc_boundaries(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    plan, seg_models = partition.build_plan(cfg, model)
    assert [s.name for s in plan.segments] == ["seg0_B", "seg1_A", "seg2_B"]
    assert len(seg_models) == 3
    pre, enc, dec = plan.segments
    assert pre.nodes == ("pre/cast", "pre/nchw", "pre/sub_mean", "pre/scale")
    assert all(n.startswith(("enc", "mid/")) for n in enc.nodes) and len(enc.nodes) == 14
    assert dec.nodes[0] == "dec2/up" and dec.nodes[-1] == "mask"

    def io(tensors) -> list[tuple]:
        return [(t.name, t.shape, t.dtype, t.layout) for t in tensors]

    assert io(pre.inputs) == [("image", (1, 64, 64, 3), "uint8", pre.inputs[0].layout)]
    assert io(pre.outputs) == [("pre/scale", (1, 64, 64, 3), "float32", "NHWC")]
    assert enc.inputs == pre.outputs
    assert io(enc.outputs) == [
        ("enc1/conv2_relu", (1, 64, 64, 4), "float32", "NHWC"),
        ("enc2/conv2_relu", (1, 32, 32, 8), "float32", "NHWC"),
        ("mid/conv2_relu", (1, 16, 16, 16), "float32", "NHWC"),
    ]
    assert sorted(t.name for t in dec.inputs) == sorted(t.name for t in enc.outputs)
    assert all(t.layout == "NHWC" for t in dec.inputs)
    assert io(dec.outputs) == [("probs", (1, 2, 64, 64), "float32", ""), ("mask", (1, 64, 64), "uint8", "")]
    assert [t.name for t in plan.outputs] == ["mask", "probs"]
    assert [s.onnx for s in plan.segments] == ["segments/seg0_B.onnx", "segments/seg1_A.onnx", "segments/seg2_B.onnx"]
    assert (plan.precision, plan.batch_sizes) == ("fp32", (1, 4))


def test_model_input_layout_is_not_mislabelled(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    plan, _ = partition.build_plan(cfg, model)
    assert plan.inputs[0].layout in ("", "NHWC")


def test_conv_relu_fused_into_one_kernel_call(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    plan, _ = partition.build_plan(cfg, model)
    calls = plan.segments[1].calls
    assert [c.op for c in calls] == ["conv3x3", "conv3x3", "maxpool2x2"] * 2 + ["conv3x3", "conv3x3"]
    first = calls[0]
    assert first.nodes == ("enc1/conv1", "enc1/conv1_relu")
    assert (first.inputs, first.outputs) == (("pre/scale",), ("enc1/conv1_relu",))
    assert first.weights == ("enc1/conv1.weight", "enc1/conv1.bias")
    assert first.attr("relu") == 1
    assert all(c.attr("relu") == 1 for c in calls if c.op == "conv3x3")
    # Every node of the segment is covered exactly once, in order.
    assert tuple(n for c in calls for n in c.nodes) == plan.segments[1].nodes
    # Intermediates (not boundary outputs) are planned as NHWC buffers.
    inner = {t.name: t for t in plan.segments[1].tensors}
    assert inner["enc1/pool"].shape == (1, 32, 32, 4) and inner["enc1/pool"].layout == "NHWC"
    assert "enc1/conv2_relu" not in inner  # a boundary output, not an intermediate


def test_plan_json_round_trip_and_deterministic_keys(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    plan, _ = partition.build_plan(cfg, model)
    again, _ = partition.build_plan(cfg, copy.deepcopy(model))
    assert Plan.from_json(json.loads(plan.dumps())) == plan
    assert [s.key for s in plan.segments] == [s.key for s in again.segments]
    assert len({s.key for s in plan.segments}) == 3


def test_track_b_rules_win_over_track_a(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    cfg2 = with_partition(cfg, Rules(name_prefixes=("enc", "mid/")), Rules(name_prefixes=("enc2/",)))
    plan, _ = partition.build_plan(cfg2, model)
    assert [(s.name, s.nodes[0], s.nodes[-1]) for s in plan.segments] == [
        ("seg0_B", "pre/cast", "pre/scale"),
        ("seg1_A", "enc1/conv1", "enc1/pool"),
        ("seg2_B", "enc2/conv1", "enc2/pool"),
        ("seg3_A", "mid/conv1", "mid/conv2_relu"),
        ("seg4_B", "dec2/up", "mask"),
    ]


# --- the segment models against the whole model -----------------------------------------------


def test_segment_models_chained_reproduce_the_whole_model(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    plan, seg_models = partition.build_plan(cfg, model)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    x = np.random.default_rng(seed).integers(0, 256, size=(3, 64, 64, 3), dtype=np.uint8)

    env: dict[str, np.ndarray] = {"image": x}
    for seg, sm in zip(plan.segments, seg_models, strict=True):
        feeds = {t.name: env[t.name] for t in seg.inputs}
        for t in seg.inputs:
            assert feeds[t.name].shape == t.at_batch(3) and feeds[t.name].dtype == np.dtype(t.dtype), (seg.name, t)
        out = run(session(sm), feeds)
        for t in seg.outputs:
            assert out[t.name].shape == t.at_batch(3) and out[t.name].dtype == np.dtype(t.dtype), (seg.name, t)
        env.update(out)

    # The whole model, with every boundary tensor exposed as an extra (NCHW) output.
    boundary = [t.name for s in plan.segments[:-1] for t in s.outputs]
    whole = copy.deepcopy(model)
    whole.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in boundary)
    ref = run(session(whole), {"image": x})

    assert rel_l2(ref["probs"], env["probs"]) <= PROBS_REL_L2, f"seed {seed}"
    assert np.mean(ref["mask"] != env["mask"]) <= MASK_MISMATCH, f"seed {seed}"
    for name in boundary:  # NHWC at the boundary means exactly the model's NCHW tensor, transposed
        nhwc = np.transpose(ref[name], (0, 2, 3, 1))
        assert rel_l2(nhwc, env[name]) <= PROBS_REL_L2, f"{name}, seed {seed}"


def test_segment_model_has_dynamic_batch_and_transposes(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    _, seg_models = partition.build_plan(cfg, model)
    enc = seg_models[1]
    assert enc.graph.name == "main"
    assert enc.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    ops = [n.op_type for n in enc.graph.node]
    assert ops[0] == "Transpose" and ops[-3:] == ["Transpose"] * 3  # one in, three out
    assert {i.name for i in enc.graph.initializer} == {w for n in enc.graph.node for w in n.input} & {
        i.name for i in model.graph.initializer
    }


# --- refusals ---------------------------------------------------------------------------------


def test_prefix_matching_no_node(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    with pytest.raises(
        PartitionError,
        match=r"^partition\.track_a\.name_prefixes: 'encoder/' matches no node of the model; node names start with: "
        r"dec1/, dec2/, enc1/, enc2/, head/",
    ):
        partition.build_plan(with_partition(cfg, Rules(name_prefixes=("encoder/",))), model)


def test_track_b_prefix_matching_no_node(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    with pytest.raises(PartitionError, match=r"^partition\.track_b\.name_prefixes: 'dec9/' matches no node"):
        partition.build_plan(with_partition(cfg, Rules(name_prefixes=("enc",)), Rules(name_prefixes=("dec9/",))), model)


def test_op_type_that_is_not_onnx(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    with pytest.raises(PartitionError, match=r"^partition\.track_a\.op_types: 'Conv2D' is not an ONNX op type$"):
        partition.build_plan(with_partition(cfg, Rules(op_types=("Conv2D",))), model)


def test_op_type_the_model_lacks(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    with pytest.raises(PartitionError, match=r"^partition\.track_a\.op_types: the model has no 'Gemm' node$"):
        partition.build_plan(with_partition(cfg, Rules(op_types=("Gemm",))), model)


def test_node_without_kernel_on_track_a_names_node_and_fix(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    with pytest.raises(
        PartitionError,
        match=r"^node 'pre/nchw' \(Transpose, no hand-written kernel\) is on Track A, whose kernels cover "
        r"Conv of any kernel size, stride, dilation, padding and group count \(optionally \+Add of a residual "
        r"\+Relu/Clip\(0,6\)/HardSwish/HardSigmoid/Sigmoid/SiLU\), MaxPool and AveragePool of any window up to 256x256 "
        r"\(no Indices "
        r"output\), ConvTranspose of any window, "
        r"channel Concat of any inputs .*, Pad constant/reflect/edge over H,W, the mobile ops: depthwise Conv "
        r".* Resize nearest/linear over H,W; and a segmentation head: .*; move it to Track B with "
        r"partition\.track_b\.name_prefixes: \['pre/nchw'\]$",
    ):
        partition.build_plan(with_partition(cfg, Rules(name_prefixes=("enc", "mid/", "pre/nchw"))), model)


def test_a_head_split_across_segments_names_its_other_nodes(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    with pytest.raises(
        PartitionError,
        match=r"^node 'post/softmax' \(Softmax, its segmentation head's nodes probs, post/argmax, mask are in "
        r"another segment\) is on Track A, .*; move it to Track B with partition\.track_b\.name_prefixes: "
        r"\['post/softmax'\]$",
    ):
        partition.build_plan(with_partition(cfg, Rules(name_prefixes=("enc", "mid/", "post/softmax"))), model)


def test_whole_unet_body_lowers_to_kernels(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    """enc, mid and dec on Track A: conv3x3, maxpool, convt2x2 and concat aliases, one segment."""
    cfg, model = tiny
    plan, _ = partition.build_plan(with_partition(cfg, Rules(name_prefixes=("enc", "mid/", "dec"))), model)
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    ops = [c.op for c in plan.segments[1].calls]
    assert ops.count("convt2x2") == 2 and ops.count("concat") == 2 and ops.count("maxpool2x2") == 2
    cat = next(c for c in plan.segments[1].calls if c.op == "concat")
    assert cat.inputs == ("dec2/up", "enc2/conv2_relu")
    assert [t.name for t in plan.segments[1].outputs] == ["dec1/conv2_relu"]


def test_conv_the_kernel_cannot_take_names_why(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    wide = copy.deepcopy(model)
    head = next(n for n in wide.graph.node if n.name == "head/conv")
    del head.attribute[:]  # a 17x17 window: wider than the general conv's 15x15
    head.attribute.extend([helper.make_attribute("kernel_shape", [17, 17]), helper.make_attribute("pads", [8] * 4)])
    w = next(i for i in wide.graph.initializer if i.name == head.input[1])
    k, c = w.dims[0], w.dims[1]
    w.CopyFrom(helper.make_tensor(w.name, w.data_type, [k, c, 17, 17], np.ones(k * c * 289, np.float32)))
    with pytest.raises(
        PartitionError,
        match=r"^node 'head/conv' \(Conv, kernel 17x17: the general conv takes 1..15 a side\) is on Track A",
    ):
        partition.build_plan(with_partition(cfg, Rules(name_prefixes=("enc", "mid/", "dec", "head/"))), wide)


def test_dilated_1x1_head_lowers_to_the_general_conv(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    """What conv1x1 refuses (a dilation, even a harmless one) the general conv takes."""
    cfg, model = tiny
    dilated = copy.deepcopy(model)
    head = next(n for n in dilated.graph.node if n.name == "head/conv")
    head.attribute.append(helper.make_attribute("dilations", [2, 2]))  # same shapes for a 1x1 kernel
    plan, _ = partition.build_plan(with_partition(cfg, Rules(name_prefixes=("enc", "mid/", "dec", "head/"))), dilated)
    last = plan.segments[1].calls[-1]
    assert (last.op, last.nodes, last.attr("dil_h"), last.attr("R"), last.attr("act")) == (
        "conv",
        ("head/conv",),
        2,
        1,
        0,
    )


def test_head_1x1_conv_on_track_a(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    """The head's 1x1 conv lowers to a conv1x1 call at the end of the Track A segment; Track B
    keeps softmax/argmax, reading the class scores in NHWC."""
    cfg, model = tiny
    plan, seg_models = partition.build_plan(
        with_partition(cfg, Rules(name_prefixes=("enc", "mid/", "dec", "head/"))), model
    )
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    last = plan.segments[1].calls[-1]
    assert (last.op, last.nodes, last.attr("relu")) == ("conv1x1", ("head/conv",), 0)
    (scores,) = plan.segments[1].outputs
    assert (scores.name, scores.layout, scores.shape) == ("head/conv", "NHWC", (1, 64, 64, 2))
    assert {n.op_type for n in seg_models[2].graph.node} >= {"Softmax", "ArgMax"}
    assert "Conv" not in {n.op_type for n in seg_models[2].graph.node}


def test_track_a_touching_the_model_input(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    with pytest.raises(
        PartitionError,
        match=r"^Track A would read or write the model's own input/output 'image' directly; Track A works in NHWC, "
        r"so keep the first and last ops on Track B \(narrow partition\.track_a\)$",
    ):
        partition.build_plan(with_partition(cfg, Rules(name_prefixes=("pre/", "enc"))), model)


def test_custom_domain_op_is_unsupported(tiny: tuple[BuildConfig, onnx.ModelProto], tmp_path: Path) -> None:
    cfg, model = tiny
    custom = copy.deepcopy(model)
    for node in custom.graph.node:
        if node.name == "dec1/concat":
            node.domain, node.op_type = "com.acme", "FancyConcat"
    custom.opset_import.append(helper.make_opsetid("com.acme", 1))
    path = tmp_path / "custom.onnx"
    onnx.save(custom, str(path))
    loaded = partition.name_nodes(frontend.load_model(path))  # the checker lets custom domains through
    with pytest.raises(
        UnsupportedOpError,
        match=r"^node 'dec1/concat' is op com\.acme::FancyConcat, which no track can take "
        r".*replace it with standard ONNX ops and re-export$",
    ) as err:
        partition.build_plan(cfg, loaded)
    assert err.value.exit_code == PartitionError.exit_code


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        (
            "shape",
            (1, 32, 32, 3),
            r"^input\.shape \[1, 32, 32, 3\] does not match the model's input \[1, 64, 64, 3\] "
            r"\(batch excluded\); fix `input\.shape`$",
        ),
        ("dtype", "float32", r"^input\.dtype is float32 but the model's input is uint8; fix `input\.dtype`$"),
        ("name", "img", r"^input\.name is 'img' but the model's input is 'image'; fix `input\.name` in the config$"),
    ],
)
def test_input_mismatch_with_config(
    tiny: tuple[BuildConfig, onnx.ModelProto], field: str, value: object, pattern: str
) -> None:
    cfg, model = tiny
    bad = cfg.model_copy(update={"input": InputSpec(**{**cfg.input.model_dump(), field: value})})
    with pytest.raises(PartitionError, match=pattern):
        partition.build_plan(bad, model)


# --- model loading ----------------------------------------------------------------------------


def test_missing_model_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.onnx"
    with pytest.raises(ModelError, match=rf"^model file {path} not found; check `model:` in the config"):
        frontend.load_model(path)


def test_garbage_bytes_are_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"\x00not an onnx model\xff" * 8)
    with pytest.raises(ModelError, match=rf"^{path} is not a readable ONNX model \(\w+\); re-export it$"):
        frontend.load_model(path)


def test_model_failing_the_checker(tiny: tuple[BuildConfig, onnx.ModelProto], tmp_path: Path) -> None:
    _, model = tiny
    broken = copy.deepcopy(model)
    broken.graph.node[5].input[0] = "does_not_exist"
    path = tmp_path / "broken.onnx"
    onnx.save(broken, str(path))
    with pytest.raises(
        ModelError, match=rf"^{path} fails the ONNX checker: .*'does_not_exist'.*; re-export the model$"
    ):
        frontend.load_model(path)


def test_model_with_two_inputs(tiny: tuple[BuildConfig, onnx.ModelProto]) -> None:
    cfg, model = tiny
    two = copy.deepcopy(model)
    two.graph.input.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["N", 3]))
    with pytest.raises(ModelError, match=r"^the model has 2 inputs; dualtrack serves single-input models$"):
        partition.build_plan(cfg, two)


def test_name_nodes_gives_unique_names() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["z"], name="Relu_0")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
    )
    named = partition.name_nodes(helper.make_model(graph))
    names = [n.name for n in named.graph.node]
    assert names[0] == "Relu_0" and len(set(names)) == 2


def _flattened_whole() -> onnx.ModelProto:
    """x (N, 4, 6, 6) -> Relu -> Reshape to (-1,) (the batch merged into one long dim, as the dynamo exporter
    writes MaxUnpool's scatter) -> Sigmoid -> Reshape back to (-1, 4, 6, 6)."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "flat"], ["f"], name="flatten"),
        helper.make_node("Sigmoid", ["f"], ["s"], name="sig"),
        helper.make_node("Reshape", ["s", "back"], ["y"], name="unflatten"),
    ]
    inits = [
        helper.make_tensor("flat", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("back", TensorProto.INT64, [4], [-1, 4, 6, 6]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6, 6])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch_sizes", [(1,), (1, 4)])
def test_a_tensor_with_the_batch_inside_its_dim_0_is_not_batch_major_even_at_batch_1_alone(batch_sizes) -> None:
    """At batch 1 the flattened (144,) tensor's dim 0 is not the batch: a plan built for batch 1 alone once
    declared it ("N",) at a segment boundary, and IREE compiled the segment for a one-element tensor."""
    _, minor = partition.batch_checked_specs(_flattened_whole(), batch_sizes)
    assert set(minor) == {"f", "s"}, minor
    _, none = partition.batch_checked_specs(_flattened_whole(), batch_sizes, fixed=True)
    assert none == {}


def test_a_shape_inference_cannot_follow_names_the_node_where_it_stops() -> None:
    """A Range whose limit is computed (the dynamo exporter's flattened indices of a MaxUnpool): ONNX's shape
    inference gives its output no size, and every shape after it is open; the error names the Range."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("ReduceProd", ["s"], ["count"], name="count", keepdims=0),
        helper.make_node("Range", ["zero", "count", "one"], ["idx"], name="flat_index"),
        helper.make_node("Reshape", ["x", "flat"], ["xf"], name="flatten"),
        helper.make_node("Gather", ["xf", "idx"], ["z"], name="take"),
        helper.make_node("Reshape", ["z", "back"], ["y"], name="back_to_image"),
    ]
    inits = [
        onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
        onnx.numpy_helper.from_array(np.array(1, np.int64), "one"),
        onnx.numpy_helper.from_array(np.array([-1, 2, 3, 4], np.int64), "back"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 3, 4])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(PartitionError, match=r"shape inference stops at node 'flat_index' \(Range\)"):
        partition.batch_checked_specs(model, (1, 2))
