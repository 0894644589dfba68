"""Constant Pads over channels written as 1x1 convolutions (compiler/channel_maps.py): the rewritten model computes
what the Pad computes (onnxruntime, fp32 and fp16, bit for bit: a product by 1 plus zeros), over pads, values and
axes no zoo model has; H/W pads in the same node stay a Pad; what the pass does not take (N pads, crops, reflect,
run-time pads) is left exactly as it is."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.channel_maps import channel_maps_as_convs, zero_concats_as_pads

C, H, W = 5, 6, 7  # H != W: a swap of the two is not a permutation of channels


def pad_model(pads: list[int], value: float | None = None, axes: list[int] | None = None, elem: int = TensorProto.FLOAT,
              mode: str = "constant") -> onnx.ModelProto:  # fmt: skip
    """x (N, C, H, W) -> Relu -> Pad -> Relu -> y, the Pad's operands constants."""
    np_dtype = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    inits = [numpy_helper.from_array(np.array(pads, np.int64), "pads")]
    ins = ["r", "pads"]
    if value is not None or axes is not None:
        ins.append("value" if value is not None else "")
        if value is not None:
            inits.append(numpy_helper.from_array(np.array(value, np_dtype), "value"))
    if axes is not None:
        ins.append("axes")
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="pre"),
        helper.make_node("Pad", ins, ["p"], name="pad", mode=mode),
        helper.make_node("Neg", ["p"], ["y"], name="post"),
    ]
    graph = helper.make_graph(
        nodes, "pad", [helper.make_tensor_value_info("x", elem, ["N", C, H, W])],
        [helper.make_tensor_value_info("y", elem, ["N", "c", "h", "w"])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x})[0]


@pytest.mark.parametrize(
    ("pads", "value", "axes", "elem", "spatial"),
    [
        ([0, 3, 0, 0, 0, 0, 0, 0], None, None, TensorProto.FLOAT, False),
        ([0, 2, 1, 0, 0, 9, 0, 2], 0.75, None, TensorProto.FLOAT, True),
        ([4, 1], -2.5, [1], TensorProto.FLOAT16, False),
        ([1, 0, 2, 3, 0, 1], 0.0, [-3, -2, -1], TensorProto.FLOAT16, True),
    ],
)
def test_a_channel_pad_is_a_1x1_conv_that_computes_the_same_bits(pads, value, axes, elem, spatial) -> None:
    model = pad_model(pads, value, axes, elem)
    out, detail = channel_maps_as_convs(model)
    assert detail is not None and "1 channel Pad(s)" in detail
    onnx.checker.check_model(out)
    onnx.shape_inference.infer_shapes(out, strict_mode=True)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("Conv") == 1 and ops.count("Pad") == int(spatial)
    x = (
        np.random.default_rng(5)
        .standard_normal((3, C, H, W))
        .astype(np.float16 if elem == TensorProto.FLOAT16 else np.float32)
    )
    want, got = run(model, x), run(out, x)
    assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize(
    ("pads", "mode"),
    [([1, 2, 0, 0, 0, 0, 0, 0], "constant"), ([0, -1, 0, 0, 0, 0, 0, 0], "constant"),
     ([0, 2, 0, 0, 0, 2, 0, 0], "reflect"), ([0, 0, 1, 1, 0, 0, 1, 1], "constant")],
)  # fmt: skip
def test_what_the_pass_does_not_take_is_left_as_it_is(pads, mode) -> None:
    model = pad_model(pads, mode=mode)
    out, detail = channel_maps_as_convs(model)
    assert detail is None and out is model


def chain_model(steps: list[tuple[str, list[int]]], elem: int = TensorProto.FLOAT, c: int = 12) -> onnx.ModelProto:
    """x (N, c, H, W) -> Relu -> the Reshape ("r", shape) / Transpose ("t", perm) steps -> Neg -> y."""
    nodes = [helper.make_node("Relu", ["x"], ["t0"], name="pre")]
    inits = []
    for k, (op, arg) in enumerate(steps):
        if op == "r":
            inits.append(numpy_helper.from_array(np.array(arg, np.int64), f"shape{k}"))
            nodes.append(helper.make_node("Reshape", [f"t{k}", f"shape{k}"], [f"t{k + 1}"], name=f"reshape{k}"))
        else:
            nodes.append(helper.make_node("Transpose", [f"t{k}"], [f"t{k + 1}"], name=f"transpose{k}", perm=arg))
    nodes.append(helper.make_node("Neg", [f"t{len(steps)}"], ["y"], name="post"))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", elem, ["N", c, H, W])],
        [helper.make_tensor_value_info("y", elem, ["N", "c", "h", "w"])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


SHUFFLE3 = [("r", [-1, 3, 4, H, W]), ("t", [0, 2, 1, 3, 4]), ("r", [-1, 12, H, W])]


@pytest.mark.parametrize(
    ("steps", "elem"),
    [
        (SHUFFLE3, TensorProto.FLOAT),
        ([("r", [0, 4, 3, H, W]), ("t", [0, 2, 1, 3, 4]), ("r", [0, 12, H, W])], TensorProto.FLOAT16),
        ([("r", [-1, 2, 3, 2, H * W]), ("t", [0, 3, 2, 1, 4]), ("r", [-1, 12, H, W])], TensorProto.FLOAT),
    ],
)
def test_a_channel_permutation_is_a_1x1_conv_that_computes_the_same_bits(steps, elem) -> None:
    """ShuffleNet's shuffle (groups 3 and 4, batch as -1 or 0) and a three-axis channel permutation."""
    model = chain_model(steps, elem)
    out, detail = channel_maps_as_convs(model)
    assert detail is not None and "shuffle 'reshape0'" in detail
    assert [n.op_type for n in out.graph.node] == ["Relu", "Conv", "Neg"]
    onnx.checker.check_model(out)
    x = np.random.default_rng(2).standard_normal((2, 12, H, W))
    x = x.astype(np.float16 if elem == TensorProto.FLOAT16 else np.float32)
    assert np.array_equal(run(out, x), run(model, x))


@pytest.mark.parametrize(
    "steps",
    [
        [("t", [0, 1, 3, 2]), ("r", [-1, 12, W, H])],  # H and W swapped: pixels move
        [("r", [-1, 12, H * W]), ("t", [0, 2, 1]), ("r", [-1, 12, H, W])],  # values move between pixels
        [("r", [-1, 3, 4, H, W]), ("r", [-1, 12, H, W])],  # the identity
        [("r", [-1, 3, 4, H, W]), ("t", [0, 2, 1, 3, 4])],  # ends 5-D
    ],
)
def test_a_chain_that_is_not_a_channel_permutation_is_left_as_it_is(steps) -> None:
    model = chain_model(steps)
    out, detail = channel_maps_as_convs(model)
    assert detail is None and out is model


def zeros_cat_model(before: int, after: int, source: str, batch: int | str = "N") -> onnx.ModelProto:
    """x (N, C, H, W) -> Relu -> Concat on channels with zeros of ``before`` channels ahead and ``after``
    behind -> Neg -> y. ``source``: how the zeros are written: "init" (a folded constant of the export's
    batch), "cos" (ConstantOfShape of x's N, H, W read at run time), "expand" (a zero scalar Expanded)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="pre")]
    inits = []
    zeros = []
    for k, c in (("a", before), ("b", after)):
        if not c:
            zeros.append(None)
            continue
        z = f"z{k}"
        if source == "init":
            inits.append(numpy_helper.from_array(np.zeros((int(batch), c, H, W), np.float32), z))
        else:
            inits.append(numpy_helper.from_array(np.array([c], np.int64), f"c{k}"))
            nodes += [
                helper.make_node("Shape", ["x"], [f"s{k}"]),
                helper.make_node("Gather", [f"s{k}", "i0"], [f"n{k}"], axis=0),
                helper.make_node("Slice", [f"s{k}", "i2", "i4"], [f"hw{k}"]),
                helper.make_node("Concat", [f"n{k}", f"c{k}", f"hw{k}"], [f"shape{k}"], axis=0),
            ]
            if source == "cos":
                nodes.append(helper.make_node("ConstantOfShape", [f"shape{k}"], [z]))
            else:
                nodes.append(helper.make_node("Expand", ["zero", f"shape{k}"], [z]))
        zeros.append(z)
    if source != "init":
        inits += [numpy_helper.from_array(np.array([v], np.int64), f"i{v}") for v in (0, 2, 4)]
        inits.append(numpy_helper.from_array(np.zeros((1, 1, 1, 1), np.float32), "zero"))
    cat = [t for t in (zeros[0], "r", zeros[1]) if t]
    nodes += [helper.make_node("Concat", cat, ["c"], name="cat", axis=1), helper.make_node("Neg", ["c"], ["y"])]
    graph = helper.make_graph(
        nodes, "cat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, C, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, "c", H, W])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    ("before", "after", "source", "batch"),
    [(0, 3, "init", 2), (2, 4, "cos", "N"), (5, 0, "expand", "N"), (1, 1, "cos", 3)],
)
def test_a_concat_of_zeros_on_channels_is_the_channel_pad(before, after, source, batch) -> None:
    """ENet's torch.cat([x, torch.zeros(...)], 1), however the zeros are written: the rewritten model
    has no Concat and computes the same bits; then the channel-pad pass writes that Pad as a 1x1 Conv."""
    model = zeros_cat_model(before, after, source, batch)
    out, detail = zero_concats_as_pads(model)
    assert detail is not None and "1 channel Concat(s) of zeros" in detail
    onnx.checker.check_model(out)
    assert "Concat" not in [n.op_type for n in out.graph.node if n.name == "cat"]
    n = 2 if batch == "N" else int(batch)
    x = np.random.default_rng(7).standard_normal((n, C, H, W)).astype(np.float32)
    want = run(model, x)
    got = run(out, x)
    assert got.shape == (n, C + before + after, H, W) and np.array_equal(got, want)
    conv, _ = channel_maps_as_convs(out)
    assert np.array_equal(run(conv, x), want)


@pytest.mark.parametrize("case", ["ones", "two_images", "spatial_axis"])
def test_a_concat_that_is_not_a_channel_pad_is_left_as_it_is(case) -> None:
    model = zeros_cat_model(0, 3, "init", 2)
    g = model.graph
    if case == "ones":
        g.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((2, 3, H, W), np.float32), "zb"))
    elif case == "two_images":
        g.node[1].input[:] = ["r", "r", "zb"]
    else:
        g.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((2, C, 2, W), np.float32), "zb"))
        g.node[1].attribute[0].i = 2
    out, detail = zero_concats_as_pads(model)
    assert detail is None and out is model
