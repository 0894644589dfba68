"""ConvTranspose as a sub-pixel convolution (issue 38; compiler/convt_phases.py): the rewritten Conv +
DepthToSpace against onnxruntime on the original ConvTranspose, over kernels, strides, pads and
output paddings no zoo model uses, and the cases the pass must leave alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.convt_phases import axis_plan, sub_pixel_convolutions

# The rewrite sums the same products in another order: fp32 rounding of a sum of C * taps terms.
REL = 1e-5


def convt_model(
    C: int, K: int, H: int, W: int, kernel: tuple[int, int], bias: bool, **attrs: object
) -> onnx.ModelProto:
    rng = np.random.default_rng(sum(kernel) + C + K)
    inits = [numpy_helper.from_array(rng.standard_normal((C, K, *kernel)).astype(np.float32), "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(K).astype(np.float32), "b"))
        ins.append("b")
    node = helper.make_node("ConvTranspose", ins, ["y"], name="up", kernel_shape=list(kernel), **attrs)
    graph = helper.make_graph(
        [node], "convt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


CASES = [  # (C, K, H, W, kernel, strides, pads, output_padding, bias)
    (5, 3, 7, 6, (3, 3), 2, [1, 1, 1, 1], [1, 1], True),  # MONAI's up-convolution, on odd sizes
    (4, 6, 5, 9, (4, 4), 2, [1, 1, 1, 1], [0, 0], False),  # the DCGAN / pix2pix form
    (3, 2, 6, 5, (3, 3), 3, [0, 0, 0, 0], [0, 0], True),  # stride 3, non-overlapping but 3x3
    (6, 5, 4, 7, (5, 3), 2, [2, 1, 2, 1], [1, 1], True),  # non-square kernel, unequal pads per axis
    (2, 7, 5, 5, (4, 2), 2, [1, 0, 1, 0], [0, 0], True),  # one axis non-overlapping
    (3, 4, 6, 4, (6, 6), 4, [1, 1, 1, 1], [0, 0], False),  # stride 4
]


@pytest.mark.parametrize(("C", "K", "H", "W", "kernel", "s", "pads", "opad", "bias"), CASES)
def test_the_sub_pixel_convolution_computes_the_convtranspose(C, K, H, W, kernel, s, pads, opad, bias) -> None:
    model = convt_model(C, K, H, W, kernel, bias, strides=[s, s], pads=pads, output_padding=opad)
    out, detail = sub_pixel_convolutions(model)
    assert detail is not None and detail.startswith("1 ConvTranspose(s)")
    assert [n.op_type for n in out.graph.node] == ["Conv", "DepthToSpace"]
    onnx.checker.check_model(out)
    x = np.random.default_rng(1).standard_normal((2, C, H, W)).astype(np.float32)
    want, got = run(model, x), run(out, x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=REL, atol=REL * float(np.abs(want).max()))


@pytest.mark.parametrize(
    ("why", "kernel", "attrs"),
    [
        ("k2 s2 without pads: convt2x2's own product", (2, 2), {"strides": [2, 2]}),
        ("an odd output length would need a crop", (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
        ("groups", (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1], "group": 2}),
        ("unequal strides: DepthToSpace has one block size", (3, 3), {"strides": [2, 1], "pads": [1, 1, 1, 1]}),
        ("dilation", (3, 3), {"strides": [2, 2], "dilations": [2, 2], "output_padding": [1, 1]}),
        ("stride 1 is a convolution already", (3, 3), {"strides": [1, 1]}),
    ],
)
def test_convtransposes_the_rewrite_does_not_hold_for_are_left_alone(why: str, kernel, attrs) -> None:
    model = convt_model(4, 4, 6, 6, kernel, True, **attrs)
    out, detail = sub_pixel_convolutions(model)
    assert detail is None and out is model, why


def test_each_phase_takes_its_own_taps_along_an_axis() -> None:
    """k3 s2 pad 1 -> output 2L: phase 0 takes tap 1 at offset 0, phase 1 taps 2 and 0 at offsets 0 and
    1; the window is 2 wide with one pad after the input."""
    plan = axis_plan(length=5, kernel=3, stride=2, pad=1, out=10)
    assert plan is not None
    assert (plan.window, plan.pad_begin, plan.pad_end) == (2, 0, 1)
    assert plan.taps == ((1, -1), (2, 0))
    assert axis_plan(length=5, kernel=3, stride=2, pad=1, out=9) is None  # 9 is no multiple of 2
