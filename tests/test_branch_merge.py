"""compiler/branch_merge.py: sums of parallel convolutions (and BatchNorms, and the identity) of one input
become one convolution.

Each graph is built here (branch geometries no zoo model has: asymmetric and dilated windows, odd sizes
at stride 2, windows off centre, groups, Sub / Neg / per-channel factors between the branches), merged,
and run in onnxruntime beside the original on a random input: fp32 to 1e-5 of the output's scale.
Branches that cannot be one convolution (other strides, group counts, dilation grids; a branch another
node also reads; a merged kernel that leaves fp16's range) keep their nodes."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import frontend
from dualtrack.compiler.branch_merge import merge_branches
from dualtrack.compiler.config import BuildConfig

RNG = np.random.default_rng(11)


class Net:
    """A graph under construction: x (2, C, H, W) in, y out."""

    def __init__(self, c: int, h: int = 13, w: int = 11) -> None:
        self.c, self.h, self.w = c, h, w
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.k = 0

    def name(self, base: str) -> str:
        self.k += 1
        return f"{base}{self.k}"

    def const(self, v: np.ndarray) -> str:
        n = self.name("c")
        self.inits[n] = v.astype(np.float32)
        return n

    def conv(self, x: str, k: int, window: tuple[int, int], pads=(0, 0, 0, 0), cin: int | None = None, **attrs) -> str:
        g = int(attrs.get("group", 1))
        cin = cin or self.c
        w = self.const(RNG.standard_normal((k, cin // g, *window)) * 0.3)
        b = self.const(RNG.standard_normal(k))
        y = self.name("conv")
        self.nodes.append(helper.make_node("Conv", [x, w, b], [y], name=y, pads=list(pads), **attrs))
        return y

    def bn(self, x: str, c: int | None = None) -> str:
        c = c or self.c
        ins = [x] + [
            self.const(v)
            for v in (
                RNG.uniform(0.5, 1.5, c),
                RNG.standard_normal(c),
                RNG.standard_normal(c) * 0.1,
                RNG.uniform(0.5, 2.0, c),
            )
        ]
        y = self.name("bn")
        self.nodes.append(helper.make_node("BatchNormalization", ins, [y], name=y, epsilon=1e-3))
        return y

    def op(self, op: str, *xs: str) -> str:
        y = self.name(op.lower())
        self.nodes.append(helper.make_node(op, list(xs), [y], name=y))
        return y

    def add(self, *xs: str) -> str:
        acc = xs[0]
        for x in xs[1:]:
            acc = self.op("Add", acc, x)
        return acc

    def model(self, y: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            [*self.nodes, helper.make_node("Identity", [y], ["y"], name="out")],
            "branches",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, self.c, self.h, self.w])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(v, k) for k, v in self.inits.items()],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 9
        inferred = onnx.shape_inference.infer_shapes(model)
        y_type = next(v.type for v in inferred.graph.output if v.name == "y")
        model.graph.output[0].type.CopyFrom(y_type)
        onnx.checker.check_model(model, full_check=True)
        return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x})[0]


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def _merged(net: Net, y: str, **kw) -> tuple[onnx.ModelProto, onnx.ModelProto, list[str], list[str]]:
    """The net, merged; checked against the original in onnxruntime (fp32: 1e-5 of the output's scale)."""
    model = net.model(y)
    out, merged, refused = merge_branches(model, **kw)
    onnx.checker.check_model(out, full_check=True)
    x = RNG.standard_normal((2, net.c, net.h, net.w)).astype(np.float32)
    want, got = _run(model, x), _run(out, x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    return model, out, merged, refused


def test_a_repvgg_block_is_one_convolution() -> None:
    # RepVGG: 3x3 + BN, 1x1 + BN, BN of the input itself; then ReLU.
    n = Net(8)
    s = n.add(n.bn(n.conv("x", 8, (3, 3), (1, 1, 1, 1))), n.bn(n.conv("x", 8, (1, 1))), n.bn("x"))
    model, out, merged, _ = _merged(n, n.op("Relu", s))
    assert _ops(out) == {"Conv": 1, "Relu": 1, "Identity": 1}, _ops(out)
    assert merged == [f"'{s}' (3 branches)"]
    conv = next(x for x in out.graph.node if x.op_type == "Conv")
    assert [a.ints for a in conv.attribute if a.name == "kernel_shape"] == [[3, 3]]
    assert conv.name == next(x.name for x in model.graph.node if x.op_type == "Conv")  # the first branch's name


@pytest.mark.parametrize(("h", "w"), [(13, 11), (8, 9)])
def test_grouped_stride_two_branches_at_odd_sizes_are_one_convolution(h: int, w: int) -> None:
    # MobileOne's downsampling block: depthwise 3x3/2 branches and a depthwise 1x1/2 scale branch.
    n = Net(12, h, w)
    dw = dict(group=12, strides=[2, 2])
    terms = [n.conv("x", 12, (3, 3), (1, 1, 1, 1), **dw) for _ in range(3)] + [n.conv("x", 12, (1, 1), **dw)]
    _, out, merged, _ = _merged(n, n.add(*terms))
    assert _ops(out) == {"Conv": 1, "Identity": 1}
    assert merged and "(4 branches)" in merged[0]


def test_asymmetric_and_off_centre_windows_merge_with_their_offsets() -> None:
    # ACNet's 3x3 + 1x3 + 3x1, a 2x2 window padded at the end only, at stride 2 and dilation 1 ...
    n = Net(6, 12, 10)
    st = dict(strides=[2, 2])
    terms = [
        n.conv("x", 4, (3, 3), (1, 1, 1, 1), **st),
        n.conv("x", 4, (1, 3), (0, 1, 0, 1), **st),
        n.conv("x", 4, (3, 1), (1, 0, 1, 0), **st),
        n.conv("x", 4, (2, 2), (0, 0, 1, 1), **st),
    ]
    _, out, _, _ = _merged(n, n.add(*terms))
    assert _ops(out)["Conv"] == 1
    # ... and dilated: a 3x3 at dilation 2 beside a 1x1 and a 1x3 at dilation 2 along W.
    n = Net(6)
    terms = [
        n.conv("x", 6, (3, 3), (2, 2, 2, 2), dilations=[2, 2]),
        n.conv("x", 6, (1, 1)),
        n.conv("x", 6, (1, 3), (0, 2, 0, 2), dilations=[1, 2]),
    ]
    _, out, _, _ = _merged(n, n.add(*terms, "x"))
    assert _ops(out) == {"Conv": 1, "Identity": 1}


def test_a_repmixer_with_layer_scale_sub_and_neg_is_one_convolution() -> None:
    # FastViT's RepMixer: x + ls * (mixer(x) - norm(x)), mixer = dw 3x3 + BN(x), norm = BN(x); with a
    # Neg and a per-channel Div in the chain as well.
    n = Net(10)
    mixer = n.add(n.bn(n.conv("x", 10, (3, 3), (1, 1, 1, 1), group=10)), n.bn("x"))
    diff = n.op("Sub", mixer, n.bn("x"))
    scaled = n.op("Mul", n.const(RNG.uniform(0.1, 1.0, (10, 1, 1))), diff)
    y = n.op("Sub", n.op("Div", "x", n.const(RNG.uniform(1.0, 2.0, (10, 1, 1)))), n.op("Neg", scaled))
    y = n.op("Add", y, n.const(RNG.standard_normal((1, 10, 1, 1))))
    _, out, merged, _ = _merged(n, y)
    assert _ops(out) == {"Conv": 1, "Identity": 1}, _ops(out)
    assert merged == [f"'{y}' (4 branches)"], merged


def test_branches_of_other_inputs_strides_or_groups_keep_their_nodes() -> None:
    # x's two 3x3 branches merge; y's branch, the dense 1x1 beside depthwise ones and a factor
    # stay, summed with it.
    n = Net(8)
    other = n.op("Relu", "x")
    dw = dict(group=8)
    terms = [
        n.conv("x", 8, (3, 3), (1, 1, 1, 1), **dw),
        n.conv("x", 8, (5, 5), (2, 2, 2, 2), **dw),
        n.conv(other, 8, (3, 3), (1, 1, 1, 1)),
    ]
    dense = n.op("Mul", n.conv("x", 8, (1, 1)), n.const(RNG.uniform(0.5, 1.0, (8, 1, 1))))
    _, out, merged, _ = _merged(n, n.add(*terms, dense))
    assert _ops(out)["Conv"] == 3 and _ops(out)["Mul"] == 1, _ops(out)
    assert "(2 branches)" in merged[0]
    # Dilations that differ where both kernels are wide, and windows off each other's dilation grid.
    n = Net(4)
    terms = [
        n.conv("x", 4, (3, 3), (2, 2, 2, 2), dilations=[2, 2]),
        n.conv("x", 4, (3, 3), (3, 3, 3, 3), dilations=[3, 3]),
    ]
    _, out, merged, _ = _merged(n, n.add(*terms))
    assert merged == [] and _ops(out)["Conv"] == 2
    n = Net(4)
    terms = [n.conv("x", 4, (3, 3), (2, 2, 2, 2), dilations=[2, 2]), n.conv("x", 4, (2, 2), (1, 1, 0, 0))]
    _, out, merged, _ = _merged(n, n.add(*terms))
    assert merged == [] and _ops(out)["Conv"] == 2


def test_a_branch_read_elsewhere_or_a_strided_identity_is_not_merged() -> None:
    n = Net(6)
    a, b = n.conv("x", 6, (3, 3), (1, 1, 1, 1)), n.conv("x", 6, (1, 1))
    y = n.op("Mul", n.add(a, b), a)  # a is read twice: its Conv stays; b has nothing to join
    _, out, merged, _ = _merged(n, y)
    assert merged == [] and _ops(out)["Conv"] == 2
    # An identity cannot join stride-2 kernels: the two strided ones merge, the sum keeps x's map.
    n = Net(6, 8, 8)
    s = n.add(n.conv("x", 6, (3, 3), (1, 1, 1, 1), strides=[2, 2]), n.conv("x", 6, (1, 1), strides=[2, 2]))
    y = n.add(s, n.op("MaxPool", "x"))
    n.nodes[-2].attribute.extend(
        [helper.make_attribute("kernel_shape", [2, 2]), helper.make_attribute("strides", [2, 2])]
    )
    _, out, merged, _ = _merged(n, y)
    assert _ops(out)["Conv"] == 1 and merged


def test_a_merge_that_would_leave_fp16s_range_is_refused() -> None:
    # Both branches scaled by 1e-6 (a layer scale's start): merged under the factor, their fp16 weights
    # would be subnormal. The sum under it merges; the factor stays a Mul of its own.
    n = Net(4)
    s = n.add(n.conv("x", 4, (3, 3), (1, 1, 1, 1)), n.conv("x", 4, (1, 1)))
    y = n.op("Mul", s, n.const(np.full((4, 1, 1), 1e-6)))
    _, out, merged, refused = _merged(n, y, dtype=np.float16)
    assert len(refused) == 1 and "float16" in refused[0] and merged == [f"'{s}' (2 branches)"], (refused, merged)
    assert _ops(out) == {"Conv": 1, "Mul": 1, "Identity": 1}
    _, out, merged, refused = _merged(n, y)  # in fp32 the factor merges too
    assert refused == [] and merged == [f"'{y}' (2 branches)"] and _ops(out) == {"Conv": 1, "Identity": 1}


def test_the_front_end_merges_before_the_fp16_conversion() -> None:
    # The `reparam` stage, as a build runs it: fp32 weights summed, then converted once to fp16.
    n = Net(8, 16, 16)
    s = n.add(n.bn(n.conv("x", 8, (3, 3), (1, 1, 1, 1))), n.bn(n.conv("x", 8, (1, 1))), n.bn("x"))
    model = n.model(n.op("Relu", s))
    fe = frontend.prepare(BuildConfig(model=Path("repvgg.onnx"), precision="fp16"), model)
    stages = [r for r in fe.rewrites if r.stage == "reparam"]
    assert len(stages) == 1 and "1 sum(s) of parallel branches" in stages[0].detail, fe.rewrites
    assert _ops(fe.body)["Conv"] == 1 and "BatchNormalization" not in _ops(fe.body)
    x = RNG.standard_normal((2, 8, 16, 16)).astype(np.float32)
    want = _run(model, x)
    sess = ort.InferenceSession(fe.body.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {fe.body.graph.input[0].name: x})[0]
    # fp16 weights and storage: within 2e-3 of the output's scale
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * float(np.abs(want).max()))
