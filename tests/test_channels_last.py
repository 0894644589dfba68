"""Channels-last blocks (issue 38, ConvNeXt's form) on Track A: the front end's rewrite of a closed
channels-last region into NCHW (compiler/channels_last.py) against onnxruntime on the original graph,
regions it must leave alone, GELU and SiLU as exported matched into a convolution's epilogue
(compiler/act_patterns.py), and a small network of such blocks built and verified on the CPU. Shapes
and constants are ones no zoo model has (odd channel counts, non-square images, both orders of GELU's
multiplications)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import act_patterns, partition
from dualtrack.compiler.build import build
from dualtrack.compiler.channels_last import channels_first
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.compiler.frontend import _graph_constants, simplify
from dualtrack.contract.activations import Activation

C, HID, H, W = 20, 52, 11, 9  # block channels, MLP width, a non-square odd image
# The rewrite reorders no sums but MatMul and a 1x1 Conv accumulate in different orders: fp32 rounding.
REL = 1e-5


class Net:
    """A graph under construction: nodes, initializers, fresh names, seeded random constants."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray | float) -> str:
        value = value if isinstance(value, np.ndarray) else np.float32(value)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def rand(self, name: str, *shape: int, scale: float = 1.0) -> str:
        return self.const(name, self.rng.standard_normal(shape).astype(np.float32) * scale)

    def op(self, op: str, ins: list[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, ins, [name], name=name, **attrs))
        return name

    def gelu(self, x: str, name: str, form: str) -> str:
        """GELU as torch writes it at opset 17: ``div`` x / sqrt2 ... (x * (1 + erf)) * 0.5; ``half_first``
        x * (1/sqrt2) ... (x * 0.5) * (1 + erf); ``tanh`` gelu(approximate="tanh")."""
        if form == "tanh":
            cube = self.op("Mul", [x, self.op("Mul", [x, x], f"{name}/sq")], f"{name}/cube")
            inner = self.op(
                "Add", [x, self.op("Mul", [self.const(f"{name}.k", 0.044715), cube], f"{name}/k")], f"{name}/in"
            )
            s = self.op("Mul", [self.const(f"{name}.c", math.sqrt(2 / math.pi)), inner], f"{name}/scale")
            p = self.op("Add", [self.const(f"{name}.one", 1.0), self.op("Tanh", [s], f"{name}/tanh")], f"{name}/plus")
            return self.op(
                "Mul", [self.const(f"{name}.half", 0.5), self.op("Mul", [x, p], f"{name}/mul")], f"{name}/half"
            )
        if form == "div":
            s = self.op("Div", [x, self.const(f"{name}.sqrt2", math.sqrt(2.0))], f"{name}/scale")
        else:
            s = self.op("Mul", [x, self.const(f"{name}.rsqrt2", 1 / math.sqrt(2.0))], f"{name}/scale")
        e = self.op("Erf", [s], f"{name}/erf")
        p = self.op("Add", [e, self.const(f"{name}.one", 1.0)], f"{name}/plus")
        if form == "div":
            m = self.op("Mul", [x, p], f"{name}/mul")
            return self.op("Mul", [m, self.const(f"{name}.half", 0.5)], f"{name}/half")
        h = self.op("Mul", [self.const(f"{name}.half", 0.5), x], f"{name}/half")
        return self.op("Mul", [h, p], f"{name}/mul")

    def block(self, x: str, name: str, form: str) -> str:
        """ConvNeXt's block after its depthwise conv: permute, LayerNorm, Linear, GELU, Linear, layer
        scale (C,), permute back, residual."""
        t = self.op("Transpose", [x], f"{name}/to_nhwc", perm=[0, 2, 3, 1])
        ln = self.op("LayerNormalization", [t, self.rand(f"{name}.g", C), self.rand(f"{name}.b", C)], f"{name}/ln")
        f1 = self.op("MatMul", [ln, self.rand(f"{name}.w1", C, HID, scale=C**-0.5)], f"{name}/fc1")
        b1 = self.op("Add", [self.rand(f"{name}.b1", HID), f1], f"{name}/fc1_bias")  # the bias first, as exported
        g = self.gelu(b1, f"{name}/act", form)
        f2 = self.op("MatMul", [g, self.rand(f"{name}.w2", HID, C, scale=HID**-0.5)], f"{name}/fc2")
        b2 = self.op("Add", [f2, self.rand(f"{name}.b2", C)], f"{name}/fc2_bias")
        s = self.op("Mul", [b2, self.rand(f"{name}.gamma", C, scale=0.5)], f"{name}/scale")
        back = self.op("Transpose", [s], f"{name}/to_nchw", perm=[0, 3, 1, 2])
        return self.op("Add", [back, x], f"{name}/residual")

    def model(self, outputs: list[str], channels: int = C) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, "channels_last",
            [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", channels, H, W])],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], self.inits,
        )  # fmt: skip
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return onnx.shape_inference.infer_shapes(m)


def convnext_net(forms: tuple[str, ...] = ("div", "half_first", "tanh")) -> onnx.ModelProto:
    """``stem`` (Sin: Track B) -> a 3x3 conv -> one block per GELU form -> a 3x3 conv -> ``head`` (Sin)."""
    n = Net(7)
    x = n.op("Sin", ["image"], "stem")
    x = n.op("Conv", [x, n.rand("body/conv.w", C, C, 3, 3, scale=0.1)], "body/conv", kernel_shape=[3, 3], pads=[1] * 4)
    for k, form in enumerate(forms):
        x = n.block(x, f"body/block{k}", form)
    x = n.op("Conv", [x, n.rand("body/out.w", 3, C, 3, 3, scale=0.1)], "body/out", kernel_shape=[3, 3], pads=[1] * 4)
    n.op("Sin", [x], "logits")
    return n.model(["logits"])


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"image": x})


def rewritten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    return channels_first(model, _graph_constants(model.graph))


def assert_same(a: onnx.ModelProto, b: onnx.ModelProto, batch: int = 2) -> None:
    x = np.random.default_rng(11).standard_normal((batch, C, H, W)).astype(np.float32)
    for want, got in zip(run(a, x), run(b, x), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=REL, atol=REL * float(np.abs(want).max()))


def test_a_channels_last_block_is_rewritten_channels_first_and_computes_the_same() -> None:
    model = convnext_net()
    out, detail = rewritten(model)
    assert detail is not None and detail.startswith("3 channels-last region(s)")
    ops = [n.op_type for n in out.graph.node]
    assert "MatMul" not in ops and ops.count("Conv") == 8  # the two 3x3 and two 1x1 per block
    assert ops.count("Add") == 2 + 2 + 3  # GELU's (+ 1; tanh's also + x) and the residuals: the biases are the Convs'
    # The only Transposes left are each LayerNorm's own pair, which lower_norm matches around it.
    pairs = [(n.op_type, out.graph.node[i + 1].op_type) for i, n in enumerate(out.graph.node[:-1])]
    assert ops.count("Transpose") == 6 and pairs.count(("Transpose", "LayerNormalization")) == 3
    onnx.checker.check_model(out)
    assert_same(model, out)


def gated_net(equal: bool) -> onnx.ModelProto:
    """MambaOut's gated CNN block, channels-last: LayerNorm, a Linear to gate, identity and conv channels (7, 9
    and 5 of 21, or 7 each: no sizes), split along the last axis;
    the conv part permuted to NCHW for a depthwise 3x3 and back; Concat(identity, conv) along the last axis
    (mixed back to 7 channels here, so that it can gate); GELU(gate) times it; a Linear back; permute; residual."""
    n = Net(9)
    x = n.op("Conv", ["image", n.rand("conv.w", C, C, 3, 3, scale=0.1)], "conv", kernel_shape=[3, 3], pads=[1] * 4)
    t = n.op("Transpose", [x], "to_nhwc", perm=[0, 2, 3, 1])
    ln = n.op("LayerNormalization", [t, n.rand("g", C), n.rand("b", C)], "ln")
    f1 = n.op("MatMul", [ln, n.rand("w1", C, 21, scale=C**-0.5)], "fc1")
    parts = ["gate", "ident", "convpart"]
    if equal:
        n.nodes.append(helper.make_node("Split", [f1], parts, name="split", axis=-1))
    else:
        sizes = n.const("sizes", np.array([7, 9, 5], np.int64))
        n.nodes.append(helper.make_node("Split", [f1, sizes], parts, name="split", axis=3))
    c = n.op("Transpose", ["convpart"], "c_nchw", perm=[0, 3, 1, 2])
    k = 7 if equal else 5
    c = n.op("Conv", [c, n.rand("dw.w", k, 1, 3, 3, scale=0.3)], "dw", kernel_shape=[3, 3], pads=[1] * 4, group=k)
    c = n.op("Transpose", [c], "c_nhwc", perm=[0, 2, 3, 1])
    cat = n.op("Concat", ["ident", c], "cat", axis=-1)
    mixed = n.op("MatMul", [cat, n.rand("w_in", 21 - 7, 7, scale=0.3)], "mix")  # 14 channels back to the gate's 7
    g = n.op("Mul", [n.gelu("gate", "act", "div"), mixed], "gated")
    f2 = n.op("MatMul", [g, n.rand("w2", 7, C, scale=7**-0.5)], "fc2")
    back = n.op("Transpose", [f2], "to_nchw", perm=[0, 3, 1, 2])
    y = n.op("Add", [back, x], "residual")
    n.op("Sin", [y], "logits")
    return n.model(["logits"])


@pytest.mark.parametrize("equal", [False, True], ids=["sizes", "equal_parts"])
def test_a_gated_block_s_split_and_concat_over_channels_map_to_axis_one_and_compute_the_same(equal: bool) -> None:
    model = gated_net(equal)
    out, detail = rewritten(model)
    assert detail is not None, "the region was left as exported"
    ops = [n.op_type for n in out.graph.node]
    assert "MatMul" not in ops and ops.count("Transpose") == 2  # the LayerNorm's own pair
    split = next(n for n in out.graph.node if n.op_type == "Split")
    concat = next(n for n in out.graph.node if n.op_type == "Concat")
    axis = {a.name: a.i for a in [*split.attribute, *concat.attribute] if a.name == "axis"}
    assert axis == {"axis": 1}
    onnx.checker.check_model(out)
    assert_same(model, out)


@pytest.mark.parametrize("reader", ["Reshape", "output"])
def test_a_region_read_by_something_else_is_left_exactly_as_exported(reader: str) -> None:
    """A Reshape into windows (Swin) or a graph output reads the channels-last tensor itself: the pass
    would need a Transpose back for it, so it leaves the whole region alone."""
    n = Net(5)
    t = n.op("Transpose", ["image"], "to_nhwc", perm=[0, 2, 3, 1])
    m = n.op("MatMul", [t, n.rand("w", C, C)], "fc")
    n.op("Transpose", [m], "back", perm=[0, 3, 1, 2])
    outputs = ["back"]
    if reader == "Reshape":
        n.op("Reshape", [m, n.const("shape", np.array([0, -1, C], dtype=np.int64))], "windows")
        outputs.append("windows")
    else:
        outputs.append("fc")
    model = n.model(outputs)
    out, detail = rewritten(model)
    assert detail is None and out.SerializeToString() == model.SerializeToString()


def test_reductions_softmax_and_a_transpose_back_that_is_an_output_map_their_axes() -> None:
    """ReduceMean over the last axis (keepdims), a Softmax over it, a (1, 1, W, C) constant and a Max of
    two region tensors: axes and broadcasts follow the layout; the Transpose back, a graph output,
    becomes an Identity of the rewritten tensor."""
    n = Net(9)
    t = n.op("Transpose", ["image"], "to_nhwc", perm=[0, 2, 3, 1])
    mean = n.op("ReduceMean", [t], "mean", axes=[-1], keepdims=1)
    centred = n.op("Sub", [t, mean], "centred")
    soft = n.op("Softmax", [centred], "soft", axis=-1)
    rows = n.op("Mul", [soft, n.rand("wc", 1, 1, W, C)], "rows")
    most = n.op("Max", [rows, centred], "most")
    n.op("Transpose", [most], "out", perm=[0, 3, 1, 2])
    model = n.model(["out"])
    out, detail = rewritten(model)
    assert detail is not None
    assert [x.op_type for x in out.graph.node] == ["ReduceMean", "Sub", "Softmax", "Mul", "Max", "Identity"]
    softmax = next(x for x in out.graph.node if x.op_type == "Softmax")
    assert helper.get_attribute_value(softmax.attribute[0]) == 1
    assert_same(model, out, batch=3)


@pytest.mark.parametrize(
    ("form", "row", "size"), [("div", "gelu", 5), ("half_first", "gelu", 5), ("tanh", "gelu_tanh", 9)]
)
def test_gelu_as_exported_after_a_conv_is_one_pattern_of_the_conv_epilogue(form: str, row: str, size: int) -> None:
    n = Net(2)
    y = n.op("Conv", ["image", n.rand("w", 6, C, 1, 1)], "conv", kernel_shape=[1, 1])
    n.gelu(y, "act", form)
    model = n.model([n.nodes[-1].output[0]])
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    consts = _graph_constants(model.graph)
    found = act_patterns.decomposed(y, consumers, lambda node: True, lambda t: True, consts.get)
    assert found is not None
    act, nodes, end = found
    assert act == Activation.named(row) and len(nodes) == size and end == model.graph.output[0].name
    # An intermediate read elsewhere (here: the graph's output) keeps the chain out of the epilogue.
    inside = "act/tanh" if form == "tanh" else "act/erf"
    assert act_patterns.decomposed(y, consumers, lambda node: True, lambda t: t != inside, consts.get) is None
    # A constant that is not GELU's (x / 2 instead of x / sqrt 2, 0.5 for sqrt(2/pi)) is no GELU.
    consts = {**consts, "act.sqrt2": np.float32(2.0), "act.rsqrt2": np.float32(0.5), "act.c": np.float32(0.5)}
    assert act_patterns.decomposed(y, consumers, lambda node: True, lambda t: True, consts.get) is None


def test_the_partition_runs_the_rewritten_blocks_on_track_a_with_gelu_in_the_conv_epilogue() -> None:
    model, _ = rewritten(convnext_net())
    model = simplify(model, [])
    part = PartitionConfig(mode="auto", switch_cost_us=0.0)
    p = partition.partition_model(BuildConfig(model=Path("g.onnx"), batch_sizes=(1,), partition=part), model)
    body = {d.node: (d.track, d.why) for d in p.assignment.decisions if d.node.startswith("body/")}
    assert all(t == "A" for t, _ in body.values()), body
    calls = [c for s in p.plan.segments if s.track == "A" for c in s.calls]
    gelu = [c for c in calls if Activation.of(c) in (Activation.named("gelu"), Activation.named("gelu_tanh"))]
    assert len(gelu) == 3 and all(c.op == "conv" for c in gelu)
    assert sum(Activation.of(c) == Activation.named("gelu_tanh") for c in gelu) == 1
    assert {c.op for c in calls} >= {"norm", "conv"}


CONFIG = """\
model: blocks.onnx
precision: fp32
batch_sizes: [1, 2]
targets: [sm_80]
verify:
  samples: 1
"""


def test_a_network_of_channels_last_blocks_builds_and_verifies_on_the_cpu(tmp_path: Path) -> None:
    onnx.save(convnext_net(), str(tmp_path / "blocks.onnx"))
    (tmp_path / "blocks.yaml").write_text(CONFIG)
    result = build(tmp_path / "blocks.yaml", tmp_path / "out")  # raises when verification fails
    report = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert report["passed"] is True
    assert result.plan is not None and "A" in {s.track for s in result.plan.segments}


def test_mish_as_torch_writes_it_below_opset_18_is_one_pattern_of_the_conv_epilogue() -> None:
    """nn.Mish below opset 18: Softplus, Tanh, Mul by x; a Mul by anything else, or a Tanh read elsewhere, is not."""
    n = Net(2)
    y = n.op("Conv", ["image", n.rand("w", 6, C, 1, 1)], "conv", kernel_shape=[1, 1])
    soft = n.op("Softplus", [y], "soft")
    tanh = n.op("Tanh", [soft], "tanh")
    n.op("Mul", [y, tanh], "mish")
    model = n.model(["mish"])
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    found = act_patterns.decomposed(y, consumers, lambda node: True, lambda t: True, {}.get)
    assert found is not None and found[0] == Activation.named("mish") and found[2] == "mish"
    assert [x.op_type for x in found[1]] == ["Softplus", "Tanh", "Mul"]
    assert act_patterns.decomposed(y, consumers, lambda node: True, lambda t: t != "tanh", {}.get) is None
    other = {**consumers, "tanh": [helper.make_node("Mul", ["soft", "tanh"], ["m2"])]}
    assert act_patterns.decomposed(y, other, lambda node: True, lambda t: True, {}.get) is None


def shared_permute_net() -> onnx.ModelProto:
    """One Transpose to NHWC read by two LayerNorms (other epsilons and weights), each transposed back
    and read by its own 3x3 conv: what an exporter's common-subexpression elimination makes of a
    ConvNeXt stage's downsample norm and a neck's norm of the same feature map."""
    n = Net(13)
    x = n.op("Sin", ["image"], "stem")
    t = n.op("Transpose", [x], "body/to_nhwc", perm=[0, 2, 3, 1])
    outs = []
    for k, eps in enumerate((1e-6, 1e-3)):
        ln = n.op(
            "LayerNormalization",
            [t, n.rand(f"body/ln{k}.g", C), n.rand(f"body/ln{k}.b", C)],
            f"body/ln{k}",
            epsilon=eps,
        )
        back = n.op("Transpose", [ln], f"body/ln{k}/to_nchw", perm=[0, 3, 1, 2])
        w = n.rand(f"body/conv{k}.w", 4 + k, C, 3, 3, scale=0.1)
        outs.append(n.op("Conv", [back, w], f"body/conv{k}", kernel_shape=[3, 3], pads=[1] * 4))
    n.op("Concat", outs, "body/cat", axis=1)
    n.op("Sin", ["body/cat"], "logits")
    return n.model(["logits"])


def test_layernorms_sharing_one_transpose_each_get_their_own_pair_and_run_as_norm_calls() -> None:
    """Left shared, neither LayerNorm's chain owns the Transpose and both ran on Track B (UPerNet-ConvNeXt's
    six stage norms); rewritten, each is a ``norm`` call on Track A and the graph computes the same."""
    model = shared_permute_net()
    out, detail = rewritten(model)
    assert detail is not None and detail.startswith("1 channels-last region(s)")
    nodes = list(out.graph.node)
    for k in range(2):
        i = next(j for j, x in enumerate(nodes) if x.name == f"body/ln{k}")
        assert nodes[i - 1].op_type == "Transpose" and nodes[i + 1].op_type == "Transpose"
        assert nodes[i - 1].input[0] == "stem" and nodes[i - 1].output[0] == nodes[i].input[0]
    assert sum(x.op_type == "Transpose" for x in nodes) == 4
    onnx.checker.check_model(out)
    assert_same(model, out)
    part = PartitionConfig(mode="auto", switch_cost_us=0.0)
    cfg = BuildConfig(model=Path("g.onnx"), batch_sizes=(1,), partition=part)
    p = partition.partition_model(cfg, simplify(out, []))
    body = {d.node: (d.track, d.why) for d in p.assignment.decisions if d.node.startswith("body/")}
    assert body["body/ln0"][0] == "A" and body["body/ln1"][0] == "A", body
    norms = [c for s in p.plan.segments if s.track == "A" for c in s.calls if c.op == "norm"]
    assert len(norms) == 2
    # Unrewritten, the shared Transpose keeps both off Track A, with the reason.
    before = partition.partition_model(cfg, simplify(model, []))
    why = {d.node: d.why for d in before.assignment.decisions}
    assert "its Transpose's output has other readers" in why["body/ln0"]
