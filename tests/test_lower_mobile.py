"""The mobile ops' Track A lowering (lower_mobile through partition.lower_track_a): which ONNX
nodes become which kernel calls, which activations fuse, what is refused and why; and that the
lowered calls, run by their numpy references (verify.interpret_track_a), compute what
onnxruntime computes for the Track A segment's own ONNX model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from mobile_net import build_mobile_net
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import lower_mobile, partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig, Rules
from dualtrack.compiler.verify import interpret_track_a
from dualtrack.contract.activations import ACTIVATIONS
from dualtrack.contract.plan import ELTWISE_OPS, RESIZE_COORDS, RESIZE_MODES, bits_f32
from dualtrack.errors import PartitionError


def config(
    model_path: str, batch_sizes: tuple[int, ...] = (1, 2), prefixes: tuple[str, ...] = ("body/",)
) -> BuildConfig:
    return BuildConfig(
        model=model_path,
        precision="fp32",
        batch_sizes=batch_sizes,
        targets=["sm_80"],
        partition=PartitionConfig(mode="rules", track_a=Rules(name_prefixes=prefixes)),
    )


def plan_of(model: onnx.ModelProto, tmp_path, batch_sizes=(1, 2), prefixes=("body/",)):
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    return partition.build_plan(config(str(path), batch_sizes, prefixes), partition.name_nodes(model))


@pytest.fixture(scope="module")
def mobile(tmp_path_factory):
    model = build_mobile_net(32, 32, seed=4)
    plan, seg_models = plan_of(model, tmp_path_factory.mktemp("mobile"))
    return model, plan, seg_models


def test_mobile_body_lowers_to_one_track_a_segment(mobile) -> None:
    _, plan, _ = mobile
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    calls = plan.segments[1].calls
    # The dense 1x1 convs are the general conv's: it fuses the projection's residual Add (b1, up) and
    # the expansion's HardSwish (b2); the rest are the mobile kernels, activations fused where they can be.
    assert [(c.op, c.nodes) for c in calls] == [
        ("dwconv", ("body/b1/dw", "body/b1/dw/relu")),
        ("conv", ("body/b1/project", "body/b1/add")),  # projection + residual in one kernel
        ("conv", ("body/b2/expand", "body/b2/expand/act")),
        ("dwconv", ("body/b2/dw", "body/b2/dw/act")),  # 5x5 stride 2 + HardSwish fused
        ("gap", ("body/b2/se/pool",)),
        ("fc", ("body/b2/se/fc1", "body/b2/se/relu")),
        ("fc", ("body/b2/se/fc2", "body/b2/se/gate")),
        ("eltwise", ("body/b2/se/mul",)),  # the SE gate
        ("conv", ("body/b2/project",)),
        ("dwconv", ("body/b3/dw", "body/b3/dw/relu6")),  # dilated + ReLU6
        ("gap", ("body/b3/se/pool",)),  # ReduceMean
        ("fc", ("body/b3/se/fc1", "body/b3/se/relu")),
        ("fc", ("body/b3/se/fc2", "body/b3/se/gate")),
        ("eltwise", ("body/b3/se/mul",)),
        ("eltwise", ("body/b3/add",)),
        ("resize", ("body/up/resize",)),
        ("conv", ("body/up/project", "body/up/add")),
        ("resize", ("body/up2/resize",)),
    ]
    act, elt = ACTIVATIONS, ELTWISE_OPS
    assert [c.attr("act") for c in calls if c.op in ("dwconv", "fc")] == [
        act["relu"],
        act["hardswish"],
        act["relu"],
        act["hardsigmoid"],
        act["clip"],
        act["relu"],
        act["sigmoid"],
    ]
    assert [c.attr("op") for c in calls if c.op == "eltwise"] == [elt["mul"], elt["mul"], elt["add"]]
    covered = [n for c in calls for n in c.nodes]
    assert sorted(covered) == sorted(plan.segments[1].nodes)  # every node, once


def test_lowered_attributes_carry_the_export(mobile) -> None:
    _, plan, _ = mobile
    calls = {c.nodes[0]: c for c in plan.segments[1].calls}
    dw = calls["body/b2/dw"]
    assert (dw.attr("R"), dw.attr("stride"), dw.attr("dilation"), dw.attr("pad_t"), dw.attr("pad_r")) == (5, 2, 1, 2, 2)
    dil = calls["body/b3/dw"]
    assert (dil.attr("R"), dil.attr("dilation"), dil.attr("pad_l")) == (3, 2, 2)
    assert (bits_f32(dil.attr("act_p0")), bits_f32(dil.attr("act_p1"))) == (0.0, 6.0)
    gate = calls["body/b2/se/fc2"]
    assert bits_f32(gate.attr("act_p0")) == float(np.float32(1 / 6)) and bits_f32(gate.attr("act_p1")) == 0.5
    mul = calls["body/b2/se/mul"]
    assert mul.inputs == ("body/b2/dw/act", "body/b2/se/gate")  # the full tensor first, the gate second
    up = calls["body/up/resize"]
    assert (up.attr("mode"), up.attr("coord"), bits_f32(up.attr("scale_h"))) == (
        RESIZE_MODES["linear"], RESIZE_COORDS["half_pixel"], 2.0,
    )  # fmt: skip
    assert (up.attr("Ho"), up.attr("Wo")) == (16, 16)


@pytest.mark.parametrize("batch", [1, 2])
def test_lowered_calls_compute_what_onnxruntime_computes_for_the_segment(mobile, batch) -> None:
    model, plan, seg_models = mobile
    seg, seg_model = plan.segments[1], seg_models[1]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rng = np.random.default_rng()
    feeds = {t.name: rng.standard_normal(t.at_batch(batch)).astype(t.dtype) for t in seg.inputs}
    got = interpret_track_a(seg, weights, feeds)
    sess = ort.InferenceSession(seg_model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(names, feeds), strict=True))
    for t in seg.outputs:
        g, w = got[t.name].astype(np.float64), want[t.name].astype(np.float64)
        assert g.shape == w.shape
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w), t.name  # fp32: summation order only


# --- refusals: one-node graphs ------------------------------------------------------------------


def one_op(node: onnx.NodeProto, x_shape, inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    """image -> Relu (stem/, Track B) -> node (body/) -> Relu (head/): the node between two tracks."""
    node.name = "body/op"
    node.input[0] = "stem"
    node.output[0] = "mid"
    nodes = [helper.make_node("Relu", ["image"], ["stem"], name="stem/relu"), node]
    nodes.append(helper.make_node("Relu", ["mid"], ["out"], name="head/relu"))
    graph = helper.make_graph(
        nodes,
        "one",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", *x_shape[1:]])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def refusal(model, tmp_path, batch_sizes=(1, 2)) -> str:
    with pytest.raises(PartitionError) as e:
        plan_of(model, tmp_path, batch_sizes)
    return str(e.value)


def dw_node(k: int, c: int, **attrs) -> tuple[onnx.NodeProto, dict]:
    w = np.random.default_rng().standard_normal((c, 1, k, k)).astype(np.float32)
    return helper.make_node("Conv", ["x", "w"], ["y"], group=c, kernel_shape=[k, k], **attrs), {"w": w}


def test_depthwise_wider_than_the_general_conv_is_refused_with_the_reason(tmp_path) -> None:
    # 9x9 is past the depthwise kernel's 7 and the general conv's (its groups merged); 17x17 past both.
    node, inits = dw_node(17, 8, pads=[8, 8, 8, 8])
    msg = refusal(one_op(node, (1, 8, 20, 20), inits), tmp_path)
    assert "node 'body/op' (Conv, kernel 17x17: the general conv takes 1..15 a side)" in msg
    assert "partition.track_b.name_prefixes: ['body/op']" in msg


@pytest.mark.parametrize(
    ("window", "pads", "strides"),
    [((1, 11), [0, 5, 0, 5], [1, 1]), ((11, 1), [5, 0, 5, 0], [1, 1]), ((9, 9), [4, 3, 2, 5], [2, 1])],
    ids=["band1x11", "band11x1", "9x9s2asym"],
)
def test_a_depthwise_window_past_seven_is_the_general_convs(tmp_path, window, pads, strides) -> None:
    # InceptionNeXt's 1x11 / 11x1 bands: past dwconv's 7 a side, lowered to the general conv (one-channel
    # groups); its numpy reference against onnxruntime on the segment's own model.
    c = 12
    w = np.random.default_rng(5).standard_normal((c, 1, *window)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=c, kernel_shape=list(window), pads=pads, strides=strides)
    model = one_op(node, (1, c, 17, 14), {"w": w})
    plan, seg_models = plan_of(model, tmp_path)
    seg = plan.segments[1]
    assert seg.track == "A" and [call.op for call in seg.calls] == ["conv"]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    feeds = {t.name: np.random.default_rng(6).standard_normal(t.at_batch(2)).astype(t.dtype) for t in seg.inputs}
    got = interpret_track_a(seg, weights, feeds)
    sess = ort.InferenceSession(seg_models[1].SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    for t in seg.outputs:
        g, ref = got[t.name].astype(np.float64), want[t.name].astype(np.float64)
        assert g.shape == ref.shape and np.linalg.norm(g - ref) <= 1e-5 * np.linalg.norm(ref), t.name


def test_same_auto_pad_is_refused(tmp_path) -> None:
    node, inits = dw_node(3, 4, auto_pad="SAME_UPPER")
    assert "auto_pad SAME_UPPER (re-export with explicit pads)" in refusal(one_op(node, (1, 4, 6, 6), inits), tmp_path)


def test_resize_cubic_and_tf_modes_are_refused(tmp_path) -> None:
    inits = {"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)}
    cubic = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="cubic")
    assert "mode cubic (the kernel takes nearest, linear)" in refusal(one_op(cubic, (1, 3, 4, 4), inits), tmp_path)
    tf = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="linear",
                          coordinate_transformation_mode="tf_half_pixel_for_nn")  # fmt: skip
    assert "coordinate_transformation_mode tf_half_pixel_for_nn" in refusal(one_op(tf, (1, 3, 4, 4), inits), tmp_path)
    over_c = dict(inits, scales=np.array([1, 2, 2, 2], np.float32))
    plain = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="linear")
    assert "not over H and W" in refusal(one_op(plain, (1, 3, 4, 4), over_c), tmp_path)


def test_resize_by_constant_sizes_lowers_with_their_scale(tmp_path) -> None:
    sizes = {"sizes": np.array([1, 3, 7, 10], np.int64)}
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear",
                            coordinate_transformation_mode="align_corners")  # fmt: skip
    plan, _ = plan_of(one_op(node, (1, 3, 5, 4), sizes), tmp_path, batch_sizes=(1,))
    (call,) = plan.segments[1].calls
    assert call.op == "resize" and (call.attr("Ho"), call.attr("Wo")) == (7, 10)
    assert bits_f32(call.attr("scale_w")) == float(np.float32(10) / np.float32(4))


def test_reduce_mean_over_h_w_is_gap_over_channels_creduce_and_without_keepdims_refused(tmp_path) -> None:
    axes = {"axes": np.array([1], np.int64)}
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"])
    plan, _ = plan_of(one_op(node, (1, 4, 6, 6), axes), tmp_path)
    assert [c.op for c in plan.segments[1].calls] == ["creduce"]
    over_h = {"axes": np.array([2], np.int64)}
    assert "axes [2] (the kernels reduce over H and W, axes [2, 3], or over the channels" in refusal(
        one_op(node, (1, 4, 6, 6), over_h), tmp_path
    )
    hw = {"axes": np.array([-2, -1], np.int64)}
    flat = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=0)
    assert "keepdims=0" in refusal(one_op(flat, (1, 4, 6, 6), hw), tmp_path)
    plan, _ = plan_of(one_op(helper.make_node("ReduceMean", ["x", "axes"], ["y"]), (1, 4, 6, 6), hw), tmp_path)
    assert [c.op for c in plan.segments[1].calls] == ["gap"]


def test_mul_by_a_constant_along_w_or_a_row_broadcast_is_refused(tmp_path) -> None:
    scale = {"s": np.full((1, 1, 1, 6), 0.5, np.float32)}  # one value per column: not a channel vector
    node = helper.make_node("Mul", ["x", "s"], ["y"])
    assert "(Mul, a constant of shape [1, 1, 1, 6]" in refusal(one_op(node, (1, 4, 6, 6), scale), tmp_path)
    node = helper.make_node("Mul", ["x", "row"], ["y"])
    model = one_op(node, (1, 4, 6, 6), {"axis_h": np.array([2], np.int64)})
    model.graph.node.insert(1, helper.make_node("ReduceMean", ["stem", "axis_h"], ["row"], name="stem/row"))
    assert "broadcast of [1, 4, 6, 6] with [1, 4, 1, 6]" in refusal(model, tmp_path)


def test_activation_feeding_two_consumers_is_not_fused(tmp_path) -> None:
    node, inits = dw_node(3, 4, pads=[1, 1, 1, 1])
    model = one_op(node, (1, 4, 6, 6), inits)
    # the conv output goes to a HardSwish and to the head: the HardSwish runs on its own
    model.graph.node.insert(2, helper.make_node("HardSwish", ["mid"], ["hs"], name="body/hs"))
    model.graph.node.append(helper.make_node("Add", ["out", "hs"], ["out2"], name="head/add"))
    model.graph.output[0].name = "out2"
    plan, _ = plan_of(model, tmp_path)
    calls = plan.segments[1].calls
    assert [(c.op, c.attr("act")) for c in calls] == [("dwconv", 0), ("eltwise", ACTIVATIONS["hardswish"])]


def test_supports_answers_without_a_plan() -> None:
    model = build_mobile_net(16, 16)
    specs = partition.infer_specs(model)
    facts = lower_mobile.Facts(model, specs)
    by_name = {n.name: n for n in model.graph.node}
    assert lower_mobile.supports(by_name["body/b3/dw"], facts) is None
    assert lower_mobile.claims(by_name["body/b2/project"], facts) is False  # a dense 1x1: not ours
    assert lower_mobile.supports(by_name["stem/conv"], facts) == (
        "not a depthwise convolution nor a convolution of an (N,C,1,1) vector"
    )
    assert lower_mobile.supports(by_name["body/b2/se/pool"], facts) is None
    assert lower_mobile.supports(helper.make_node("Softmax", ["x"], ["y"]), facts) == (
        "Softmax is not a mobile-kernel op"
    )


def test_an_fp32_island_lowers_where_the_export_orders_another_node_inside_it(tmp_path) -> None:
    """An fp16 model's Resize runs in an fp32 island (Cast up, Resize, Cast down); a topological order may
    put another node of the segment between them (here a Relu of the other branch). The island is one call
    all the same, and the segment computes what onnxruntime computes."""
    f16 = TensorProto.FLOAT16
    inits = [numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
             numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales")]  # fmt: skip
    nodes = [
        helper.make_node("Relu", ["image"], ["stem"], name="stem/relu"),
        helper.make_node("Cast", ["stem"], ["up"], name="body/up", to=TensorProto.FLOAT),
        helper.make_node("Relu", ["stem"], ["side"], name="body/side"),
        helper.make_node(
            "Resize",
            ["up", "roi", "scales"],
            ["big"],
            name="body/resize",
            mode="linear",
            coordinate_transformation_mode="half_pixel",
        ),
        helper.make_node("Cast", ["big"], ["down"], name="body/down", to=f16),
        helper.make_node("Relu", ["down"], ["out"], name="head/relu"),
        helper.make_node("Relu", ["side"], ["out2"], name="head/relu2"),
    ]
    graph = helper.make_graph(
        nodes,
        "island",
        [helper.make_tensor_value_info("image", f16, ["N", 4, 5, 6])],
        [helper.make_tensor_value_info("out", f16, None), helper.make_tensor_value_info("out2", f16, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    plan, seg_models = plan_of(model, tmp_path, batch_sizes=(1,))
    body = next(s for s in plan.segments if s.track == "A")
    assert sorted(c.op for c in body.calls) == ["eltwise", "resize"]
    (island,) = [c for c in body.calls if c.op == "resize"]
    assert island.nodes == ("body/up", "body/resize", "body/down")
    feeds = {t.name: np.random.default_rng(3).standard_normal(t.at_batch(1)).astype(t.dtype) for t in body.inputs}
    got = interpret_track_a(body, {}, feeds)
    sess = ort.InferenceSession(
        seg_models[plan.segments.index(body)].SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(names, feeds), strict=True))
    for t in body.outputs:
        g, w = got[t.name].astype(np.float64), want[t.name].astype(np.float64)
        assert g.shape == w.shape and np.abs(g - w).max() <= 2e-3 * max(1.0, np.abs(w).max()), t.name  # fp16 rounding


def test_pow_2_is_a_square_on_track_a_and_other_exponents_are_refused(tmp_path) -> None:
    """x ** 2 (PoolFormerV2's StarReLU squares its ReLU) is one eltwise product of x with itself; x ** 3
    stays on Track B with the reason."""
    node = helper.make_node("Pow", ["x", "e"], ["y"])
    plan, _ = plan_of(one_op(node, (1, 5, 7, 6), {"e": np.array(2.0, np.float32)}), tmp_path)
    (call,) = plan.segments[1].calls
    assert call.op == "eltwise" and call.inputs == ("stem", "stem") and call.attr("op") == ELTWISE_OPS["mul"]
    cube = helper.make_node("Pow", ["x", "e"], ["y"])
    msg = refusal(one_op(cube, (1, 5, 7, 6), {"e": np.array(3.0, np.float32)}), tmp_path)
    assert "an exponent other than the constant 2 (the kernel squares: x * x)" in msg
