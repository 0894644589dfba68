"""Lowering Conv nodes to the general conv op (``conv``) and fusing their epilogues (residual Add,
activations), on small ONNX graphs built here: which calls the plan gets, which nodes each covers,
what is refused and why, and the lowered calls run with the kernels' numpy semantics against
onnxruntime on the whole graph. No compilers, no GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig, Rules
from dualtrack.compiler.verify import interpret_track_a
from dualtrack.contract.plan import Plan
from dualtrack.kernels import ACTIVATIONS, Activation

RNG = np.random.default_rng()


class Graph:
    """A float32 NCHW graph under construction: `pre/relu` (Track B) first, `post/sigmoid` last,
    everything named `a/...` in between goes to Track A."""

    def __init__(self, c: int, h: int, w: int) -> None:
        self.nodes: list[onnx.NodeProto] = [helper.make_node("Relu", ["image"], ["x0"], name="pre/relu")]
        self.inits: list[onnx.TensorProto] = []
        self.shape = (1, c, h, w)

    def conv(self, name: str, x: str, c: int, k: int, r: int, s: int, **attrs) -> str:
        w = (RNG.standard_normal((k, c, r, s)) / np.sqrt(c * r * s)).astype(np.float32)
        b = RNG.standard_normal(k).astype(np.float32) * 0.1
        self.inits += [numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")]
        self.nodes.append(
            helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [name], name=name, kernel_shape=[r, s], **attrs)
        )
        return name

    def op(self, op: str, name: str, inputs: list[str], **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def const(self, name: str, value: float) -> str:
        self.inits.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    def model(self, last: str) -> onnx.ModelProto:
        self.nodes.append(helper.make_node("Sigmoid", [last], ["out"], name="post/sigmoid"))
        graph = helper.make_graph(
            self.nodes,
            "g",
            [helper.make_tensor_value_info("image", TensorProto.FLOAT, list(self.shape))],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", "c", "h", "w"])],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.checker.check_model(model)
        return model


def plan_of(model: onnx.ModelProto, tmp_path: Path) -> Plan:
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    cfg = BuildConfig(
        model=path, targets=(), partition=PartitionConfig(mode="rules", track_a=Rules(name_prefixes=("a/",)))
    )
    plan, _ = partition.build_plan(cfg, partition.name_nodes(model))
    return plan


def a_calls(plan: Plan) -> tuple:
    return next(s for s in plan.segments if s.track == "A").calls


def track_a_matches_onnxruntime(model: onnx.ModelProto, plan: Plan) -> None:
    """The Track A segment's calls, run with the kernels' numpy semantics on onnxruntime's own
    segment inputs, reproduce onnxruntime's segment outputs (float32: 1e-5 relative L2)."""
    (seg,) = [s for s in plan.segments if s.track == "A"]
    names = [t.name for t in (*seg.inputs, *seg.outputs)]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    image = RNG.standard_normal(dims).astype(np.float32)
    values = dict(zip(names, sess.run(names, {"image": image}), strict=True))
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    nhwc = {t.name: values[t.name].transpose(0, 2, 3, 1) for t in seg.inputs}
    got = interpret_track_a(seg, weights, nhwc)
    for t in seg.outputs:
        ref = values[t.name].transpose(0, 2, 3, 1)
        rel = np.linalg.norm(got[t.name] - ref) / np.linalg.norm(ref)
        assert rel <= 1e-5, (t.name, rel)


def test_conv_add_relu_fuses_into_one_call(tmp_path: Path) -> None:
    g = Graph(16, 12, 10)
    c1 = g.conv("a/conv1", "x0", 16, 16, 3, 3, pads=[1, 1, 1, 1])
    r1 = g.op("Relu", "a/relu1", [c1])
    c2 = g.conv("a/conv2", r1, 16, 16, 3, 3, pads=[1, 1, 1, 1])
    add = g.op("Add", "a/add", [c2, "x0"])
    out = g.op("Relu", "a/relu2", [add])
    model = g.model(out)
    plan = plan_of(model, tmp_path)
    calls = a_calls(plan)
    # conv1 + Relu is the fixed 3x3 kernel's, as before; conv2 + Add + Relu is one general-conv call
    assert [(c.op, c.nodes) for c in calls] == [
        ("conv3x3", ("a/conv1", "a/relu1")),
        ("conv", ("a/conv2", "a/add", "a/relu2")),
    ]
    fused = calls[1]
    assert fused.inputs == ("a/relu1", "x0") and fused.outputs == ("a/relu2",)
    assert (fused.attr("residual"), fused.attr("act"), fused.attr("R"), fused.attr("pad_top")) == (1, 1, 3, 1)
    track_a_matches_onnxruntime(model, plan)


def test_resnet_downsample_block_places_the_call_after_its_residual(tmp_path: Path) -> None:
    """torch's order: conv2 comes before the downsample conv its Add reads; the fused call goes
    where the Add was, after the downsample's call."""
    g = Graph(8, 15, 13)
    stem = g.conv("a/stem", "x0", 8, 16, 7, 7, strides=[2, 2], pads=[3, 3, 3, 3])
    stem_relu = g.op("Relu", "a/stem_relu", [stem])
    c1 = g.conv("a/conv1", stem_relu, 16, 24, 3, 3, strides=[2, 2], pads=[1, 1, 1, 1])
    r1 = g.op("Relu", "a/relu1", [c1])
    c2 = g.conv("a/conv2", r1, 24, 24, 3, 3, pads=[1, 1, 1, 1])
    ds = g.conv("a/down", stem_relu, 16, 24, 1, 1, strides=[2, 2])
    add = g.op("Add", "a/add", [c2, ds])
    out = g.op("Relu", "a/relu2", [add])
    model = g.model(out)
    plan = plan_of(model, tmp_path)
    calls = a_calls(plan)
    assert [(c.op, c.nodes[0], c.inputs) for c in calls] == [
        ("conv", "a/stem", ("x0",)),
        ("conv", "a/conv1", ("a/stem_relu",)),
        ("conv", "a/down", ("a/stem_relu",)),
        ("conv", "a/conv2", ("a/relu1", "a/down")),
    ]
    assert calls[0].attr("stride_h") == 2 and calls[0].attr("R") == 7 and calls[0].attr("act") == 1
    assert calls[2].attr("act") == 0 and calls[2].attr("residual") == 0
    track_a_matches_onnxruntime(model, plan)


@pytest.mark.parametrize(
    ("make", "act"),
    [
        (lambda g, t: g.op("Clip", "a/act", [t, g.const("lo", 0.0), g.const("hi", 6.0)]), "clip"),
        (lambda g, t: g.op("HardSwish", "a/act", [t]), "hardswish"),
        (lambda g, t: g.op("HardSigmoid", "a/act", [t], alpha=1 / 6, beta=0.5), "hardsigmoid"),
        (lambda g, t: g.op("Sigmoid", "a/act", [t]), "sigmoid"),
        (lambda g, t: g.op("Mul", "a/act", [t, g.op("Sigmoid", "a/sig", [t])]), "silu"),
    ],
    ids=["relu6", "hardswish", "hardsigmoid", "sigmoid", "silu"],
)
def test_activations_fuse(tmp_path: Path, make, act: str) -> None:
    g = Graph(5, 9, 11)
    t = g.conv("a/conv", "x0", 5, 12, 3, 3, pads=[1, 1, 1, 1])
    out = make(g, t)
    model = g.model(out)
    plan = plan_of(model, tmp_path)
    (call,) = a_calls(plan)
    assert call.op == "conv" and call.attr("act") == ACTIVATIONS[act] and call.outputs == ("a/act",)
    assert len(call.nodes) == (3 if act == "silu" else 2)
    track_a_matches_onnxruntime(model, plan)


def test_clip_with_any_bounds_fuses_with_its_bounds(tmp_path: Path) -> None:
    """The conv's epilogue takes every row of the activation table with its parameters: Clip(-1, 1)
    is the clip row with p0 = -1, p1 = 1 (the kernels with a relu flag only cannot take it)."""
    g = Graph(4, 6, 6)
    t = g.conv("a/conv", "x0", 4, 8, 3, 3, pads=[1, 1, 1, 1])
    out = g.op("Clip", "a/clip", [t, g.const("lo", -1.0), g.const("hi", 1.0)])
    model = g.model(out)
    plan = plan_of(model, tmp_path)
    (conv,) = a_calls(plan)
    assert conv.op == "conv" and conv.nodes == ("a/conv", "a/clip")
    assert Activation.of(conv) == Activation.named("clip", -1.0, 1.0)
    track_a_matches_onnxruntime(model, plan)


def test_broadcast_add_of_a_constant_is_not_a_residual(tmp_path: Path) -> None:
    g = Graph(4, 6, 6)
    t = g.conv("a/conv", "x0", 4, 8, 3, 3, pads=[1, 1, 1, 1])
    out = g.op("Add", "a/add", [t, g.const("one", 1.0)])
    model = g.model(out)
    plan = plan_of(model, tmp_path)
    # the conv's call has no residual; the Add is an eltwise call with the scalar as its constant operand
    assert [c.attr("residual") for c in a_calls(plan) if c.op != "eltwise"] == [0]
    (add,) = [c for c in a_calls(plan) if c.op == "eltwise"]
    assert add.nodes == ("a/add",) and add.weights == ("one",) and add.inputs == ("a/conv",)
    track_a_matches_onnxruntime(model, plan)


def test_same_upper_auto_pad_and_asymmetric_pads(tmp_path: Path) -> None:
    g = Graph(6, 10, 9)
    t = g.conv("a/c1", "x0", 6, 8, 3, 3, strides=[2, 2], auto_pad="SAME_UPPER")
    out = g.conv("a/c2", t, 8, 8, 2, 4, pads=[0, 1, 1, 2], dilations=[1, 2])
    model = g.model(out)
    plan = plan_of(model, tmp_path)
    c1, c2 = a_calls(plan)
    assert (c1.attr("pad_top"), c1.attr("pad_bottom"), c1.attr("pad_left"), c1.attr("pad_right")) == (0, 1, 1, 1)
    assert (c2.attr("pad_left"), c2.attr("pad_right"), c2.attr("dil_w")) == (1, 2, 2)
    track_a_matches_onnxruntime(model, plan)


def test_grouped_conv_lowers_to_the_general_conv_with_its_groups(tmp_path: Path) -> None:
    g = Graph(8, 6, 6)
    out = g.conv("a/g2", "x0", 4, 8, 3, 3, pads=[1, 1, 1, 1], group=2)  # grouped, not depthwise
    [call] = a_calls(plan_of(g.model(out), tmp_path))
    assert (call.op, call.attr("groups"), call.attr("R")) == ("conv", 2, 3)


def test_residual_add_read_twice_keeps_the_add_out(tmp_path: Path) -> None:
    """A conv output that something else reads too cannot be fused away: the Add then runs as its
    own eltwise call after the conv, which keeps its output."""
    g = Graph(4, 6, 6)
    t = g.conv("a/conv", "x0", 4, 4, 3, 3, pads=[1, 1, 1, 1])
    add = g.op("Add", "a/add", [t, "x0"])
    out = g.op("Mul", "a/mul", [add, t])
    plan = plan_of(g.model(out), tmp_path)
    calls = a_calls(plan)
    assert [c.nodes for c in calls] == [("a/conv",), ("a/add",), ("a/mul",)]
    assert [c.op for c in calls][1:] == ["eltwise", "eltwise"]


@pytest.mark.parametrize(
    ("c", "k", "hw", "dtype", "op"),
    [
        (16, 2, 128, "float16", "conv"),  # a segmentation head on a large image: the direct entry
        (16, 8, 256, "float16", "conv"),
        (16, 9, 256, "float16", "conv3x3"),  # more channels than the direct entry keeps
        (16, 2, 64, "float16", "conv3x3"),  # a small image keeps the tiles
        (16, 2, 128, "float32", "conv3x3"),  # the direct entry is fp16 only
        (512, 2, 256, "float16", "conv3x3"),  # 2*3*3*512 filter values exceed its shared memory
    ],
)
def test_3x3_heads_with_few_classes_run_the_direct_entry(c: int, k: int, hw: int, dtype: str, op: str) -> None:
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="head", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    specs = {"x": ((1, c, hw, hw), dtype), "w": ((k, c, 3, 3), dtype), "y": ((1, k, hw, hw), dtype)}
    got, _, why = partition._dense_conv(node, partition._Epilogue(output="y"), specs)
    assert (got, why) == (op, None)
    if op == "conv":
        spec = partition.kernels.KERNELS["conv"]
        assert (
            spec.variant(
                dtype,
                1,
                hw,
                hw,
                c,
                k,
                spec_geom := partition.ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1),
            )
            == spec.direct_entry
        ), spec_geom
