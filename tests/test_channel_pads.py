"""Constant Pads over channels written as 1x1 convolutions (compiler/channel_pads.py): the rewritten model computes
what the Pad computes (onnxruntime, fp32 and fp16, bit for bit: a product by 1 plus zeros), over pads, values and
axes no zoo model has; H/W pads in the same node stay a Pad; what the pass does not take (N pads, crops, reflect,
run-time pads) is left exactly as it is."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.channel_pads import channel_pads_as_convs

C, H, W = 5, 6, 7


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
    out, detail = channel_pads_as_convs(model)
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
    out, detail = channel_pads_as_convs(model)
    assert detail is None and out is model
