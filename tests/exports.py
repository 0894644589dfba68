"""Small ONNX models shaped like what exporters write, for the front-end tests.

``torch_style`` has what `torch.onnx.export` defaults leave in a real segmentation export: a batch
fixed at export time and written into shape constants (Reshape, Resize ``sizes``, Expand), weights
named ``onnx::Conv_N``, a weight behind an Identity, Constant and Shape nodes, an old opset, and
(optionally) every weight also listed as a graph input, as exporters before IR 4 did.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def torch_style(
    *,
    batch: int = 1,
    size: int = 16,
    classes: int = 2,
    in_channels: int = 3,
    opset: int = 13,
    weights_as_inputs: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """A conv net (NCHW float32 input ``input.1`` (batch, in_channels, size, size), output ``logits``)."""
    rng = np.random.default_rng(seed)
    half = size // 2
    inits: list[onnx.TensorProto] = []

    def weight(name: str, *shape: int) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        inits.append(numpy_helper.from_array(rng.normal(0, np.sqrt(2 / fan_in), shape).astype(np.float32), name))
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    nodes = [
        helper.make_node(
            "Conv",
            ["input.1", weight("onnx::Conv_5", 8, in_channels, 3, 3), weight("onnx::Conv_6", 8)],
            ["/enc/conv1/Conv_output_0"],
            name="/enc/conv1/Conv",
            pads=[1, 1, 1, 1],
            kernel_shape=[3, 3],
        ),
        helper.make_node("Relu", ["/enc/conv1/Conv_output_0"], ["/enc/relu/Relu_output_0"], name="/enc/relu/Relu"),
        # a weight behind an Identity (torch shares parameters this way)
        helper.make_node("Identity", [weight("enc.conv2.weight", 8, 8, 3, 3)], ["onnx::Conv_9"], name="Identity_0"),
        helper.make_node(
            "Conv",
            ["/enc/relu/Relu_output_0", "onnx::Conv_9"],
            ["/enc/conv2/Conv_output_0"],
            name="/enc/conv2/Conv",
            pads=[1, 1, 1, 1],
            kernel_shape=[3, 3],
            strides=[2, 2],
        ),
        # flatten and back with the export batch written in (torch's view(x.size(0), C, -1) traced at `batch`)
        helper.make_node(
            "Reshape",
            ["/enc/conv2/Conv_output_0", const("/enc/Constant_output_0", np.array([batch, 8, -1], np.int64))],
            ["/enc/Reshape_output_0"],
            name="/enc/Reshape",
        ),
        helper.make_node(
            "Constant",
            [],
            ["/enc/Constant_1_output_0"],
            name="/enc/Constant_1",
            value=numpy_helper.from_array(np.array([batch, 8, half, half], np.int64)),
        ),
        helper.make_node(
            "Reshape",
            ["/enc/Reshape_output_0", "/enc/Constant_1_output_0"],
            ["/enc/Reshape_1_output_0"],
            name="/enc/R1",
        ),
        # a Shape whose value only feeds a shape argument
        helper.make_node("Shape", ["/enc/Reshape_1_output_0"], ["/enc/Shape_output_0"], name="/enc/Shape"),
        helper.make_node(
            "Expand",
            ["/enc/Reshape_1_output_0", "/enc/Shape_output_0"],
            ["/enc/Expand_output_0"],
            name="/enc/Expand",
        ),
        # F.interpolate(size=...) traced at `batch`: sizes with the batch written in
        helper.make_node(
            "Resize",
            [
                "/enc/Expand_output_0",
                "" if opset >= 13 else const("/dec/roi", np.zeros(0, np.float32)),  # required before opset 13
                "" if opset >= 13 else const("/dec/scales", np.zeros(0, np.float32)),
                const("/dec/sizes", np.array([batch, 8, size, size], np.int64)),
            ],
            ["/dec/Resize_output_0"],
            name="/dec/Resize",
            mode="linear",
            coordinate_transformation_mode="half_pixel",
        ),
        helper.make_node(
            "Conv",
            ["/dec/Resize_output_0", weight("onnx::Conv_12", classes, 8, 1, 1), weight("onnx::Conv_13", classes)],
            ["logits"],
            name="/head/Conv",
            kernel_shape=[1, 1],
        ),
    ]
    if opset < 11:
        raise ValueError("the Resize above needs opset 11 or newer")
    inputs = [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [batch, in_channels, size, size])]
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(
        nodes,
        "main_graph",
        inputs,
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes, size, size])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="pytorch")
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def reference_logits(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The export's logits on a float NCHW batch, image by image (its batch is fixed)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    fixed = model.graph.input[0].type.tensor_type.shape.dim[0].dim_value or len(x)
    rows = []
    for i in range(0, len(x), fixed):
        chunk = x[i : i + fixed]
        pad = fixed - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
        rows.append(sess.run(["logits"], {sess.get_inputs()[0].name: chunk})[0][: fixed - pad])
    return np.concatenate(rows)
