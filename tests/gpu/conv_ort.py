"""onnxruntime's fp32 convolution as the GPU conv tests' reference (test_conv_stem_gpu.py,
test_conv_splitk_gpu.py): Conv (any window, groups), then Add of a residual, then an activation
node, on NHWC arrays."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dualtrack.kernels import ConvGeometry


def ort_reference(
    x: np.ndarray,
    w_onnx: np.ndarray,
    b: np.ndarray | None,
    res: np.ndarray | None,
    geom: ConvGeometry,
    act: tuple[str, float, float] | None,
) -> np.ndarray:
    """onnxruntime fp32: Conv (+ Add residual) (+ LeakyRelu / Clip / Relu), NHWC in and out; ``w_onnx``
    (K, C/groups, R, S); ``act`` (name, p0, p1) or None."""
    f32 = np.float32
    inits = [numpy_helper.from_array(w_onnx.astype(f32), "w")]
    conv_in = ["x", "w"]
    if b is not None:
        inits.append(numpy_helper.from_array(b.astype(f32), "b"))
        conv_in.append("b")
    pads = [geom.pad_top, geom.pad_left, geom.pad_bottom, geom.pad_right]
    nodes = [
        helper.make_node(
            "Conv", conv_in, ["c"], kernel_shape=[geom.R, geom.S], strides=[geom.stride_h, geom.stride_w],
            dilations=[geom.dil_h, geom.dil_w], pads=pads, group=geom.groups,
        )
    ]  # fmt: skip
    feeds = {"x": x.transpose(0, 3, 1, 2).astype(f32)}
    last = "c"
    if res is not None:
        nodes.append(helper.make_node("Add", ["c", "r"], ["a"]))
        feeds["r"] = res.transpose(0, 3, 1, 2).astype(f32)
        last = "a"
    if act is not None:
        name, p0, p1 = act
        if name == "leakyrelu":
            nodes.append(helper.make_node("LeakyRelu", [last], ["y"], alpha=p0))
        elif name == "clip":
            inits += [
                numpy_helper.from_array(np.array(p0, f32), "lo"),
                numpy_helper.from_array(np.array(p1, f32), "hi"),
            ]
            nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["y"]))
        else:
            nodes.append(helper.make_node("Relu", [last], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
    graph = helper.make_graph(
        nodes, "conv", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # the device's onnx writes IR 14, which its onnxruntime refuses (IR 13 at most)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, feeds)
    return y.transpose(0, 2, 3, 1)
