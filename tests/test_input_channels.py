"""The image's channels widened to a multiple of 8 for the convolutions that read it
(compiler/input_channels.py): the widened model computes what the export computes (onnxruntime, fresh
random inputs, float32 rounding only: the added products are zeros), the convolutions read the padded
tensor, and the inputs the pass must leave alone are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.input_channels import widen_input_channels

RTOL, ATOL = 1e-5, 1e-5  # float32, another summation order of the same products


def _model(c: int, convs: list[dict], extra: str | None = None) -> onnx.ModelProto:
    """Input x (N, c, 23, 30) read by each conv of ``convs`` (kernel, strides, dilations, group, k) and,
    with ``extra``, by a node of that op too; every result an output."""
    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    for i, spec in enumerate(convs):
        r, g, k = spec["kernel"], spec.get("group", 1), spec.get("k", 6)
        w = rng.standard_normal((k, c // g, r, r)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), f"b{i}"),
        ]
        attrs = {
            "pads": [r // 2] * 4,
            "strides": spec.get("strides", [1, 1]),
            "dilations": spec.get("dilations", [1, 1]),
        }
        nodes.append(helper.make_node("Conv", ["x", f"w{i}", f"b{i}"], [f"y{i}"], name=f"conv{i}", group=g, **attrs))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    if extra == "Relu":
        nodes.append(helper.make_node("Relu", ["x"], ["r"], name="relu"))
        outs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, 23, 30])
    m = helper.make_model(helper.make_graph(nodes, "g", [x], outs, inits), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(m: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize(
    ("c", "convs", "wide"),
    [
        (3, [{"kernel": 7, "strides": [2, 2]}], 8),  # a ResNet stem
        (3, [{"kernel": 3, "strides": [2, 2]}, {"kernel": 1, "strides": [2, 2], "k": 16}], 8),  # MONAI's unit 0
        (5, [{"kernel": 5, "dilations": [2, 2], "strides": [1, 2]}], 8),
        (12, [{"kernel": 1}], 16),  # a multispectral input: 1x1 is no conv3x3
        (1, [{"kernel": 4, "strides": [4, 4]}], 8),  # a ConvNeXt-like patchify stem on one channel
    ],
)
def test_widened_input_computes_what_the_export_computes(c: int, convs: list[dict], wide: int) -> None:
    m = _model(c, convs)
    got, detail = widen_input_channels(m)
    onnx.shape_inference.infer_shapes(got, strict_mode=True)  # the widened weights fit the padded input
    assert detail is not None and f"{c} -> {wide} channels" in detail
    pad = got.graph.node[0]
    assert pad.op_type == "Pad" and all(n.input[0] == pad.output[0] for n in got.graph.node[1:])
    weights = {t.name: numpy_helper.to_array(t) for t in got.graph.initializer}
    assert all(weights[f"w{i}"].shape[1] == wide for i in range(len(convs)))
    x = np.random.default_rng().standard_normal((2, c, 23, 30)).astype(np.float32)
    for want, have in zip(_run(m, x), _run(got, x), strict=True):
        np.testing.assert_allclose(have, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("c", "convs", "extra"),
    [
        (8, [{"kernel": 3, "strides": [2, 2]}], None),  # already a multiple of 8
        (3, [{"kernel": 3}], None),  # 3x3 stride 1: the conv3x3 op's small-C entry takes it as it is
        (3, [{"kernel": 7, "strides": [2, 2]}, {"kernel": 3}], None),  # one such reader keeps the input
        (6, [{"kernel": 3, "strides": [2, 2], "group": 3}], None),  # grouped
        (3, [{"kernel": 7, "strides": [2, 2]}], "Relu"),  # another reader would see the zeros
    ],
)
def test_inputs_the_pass_must_leave_alone(c: int, convs: list[dict], extra: str | None) -> None:
    m = _model(c, convs, extra)
    got, detail = widen_input_channels(m)
    assert detail is None and got is m
