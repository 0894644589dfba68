"""A small conv net (not a zoo model) for the `sizes` tests (issue 40): its export at 32x32 with a Resize to
constant sizes, its config, and onnxruntime on a bundle's graph at one size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.bundle_writer import load_model
from dualtrack.contract import sizes
from dualtrack.contract.bundle import Bundle

EXPORT = (32, 32)
SIZES = ((40, 56), (64, 48))
PROBS_REL_L2 = 1e-5
MASK_MISMATCH = 1e-3
CLASSES = 3


def conv_net(seed: int = 0, *, baked_reshape: bool = False) -> onnx.ModelProto:
    """x (1, 3, 32, 32) -> conv3x3 relu -> conv3x3 stride 2 relu -> Resize x2 (sizes, nearest) -> + skip ->
    conv1x1 -> 3 classes. ``baked_reshape``: a Reshape to (1, 8, 32*32) and back with the export's size written
    as numbers around a softmax over the pixels, as a tracer without dynamic axes writes it."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    inits = [w("w1", 8, 3, 3, 3), w("b1", 8), w("w2", 8, 8, 3, 3), w("b2", 8), w("w3", CLASSES, 8, 1, 1), w("b3", 3)]
    inits.append(numpy_helper.from_array(np.array([1, 8, *EXPORT], np.int64), "up_sizes"))
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Resize", ["r2", "", "", "up_sizes"], ["up"], name="up", mode="nearest"),
        helper.make_node("Add", ["up", "r1"], ["skip"], name="skip"),
    ]
    last = "skip"
    if baked_reshape:
        inits.append(numpy_helper.from_array(np.array([1, 8, EXPORT[0] * EXPORT[1]], np.int64), "flat"))
        inits.append(numpy_helper.from_array(np.array([1, 8, *EXPORT], np.int64), "back"))
        nodes.append(helper.make_node("Reshape", ["skip", "flat"], ["flat_x"], name="flatten_hw"))
        nodes.append(helper.make_node("Softmax", ["flat_x"], ["soft_x"], name="spatial_softmax", axis=2))
        nodes.append(helper.make_node("Reshape", ["soft_x", "back"], ["unflat"], name="unflatten_hw"))
        last = "unflat"
    nodes.append(helper.make_node("Conv", [last, "w3", "b3"], ["logits"], name="head"))
    graph = helper.make_graph(
        nodes,
        "sizes_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 3, *EXPORT))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, (1, CLASSES, *EXPORT))],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def write_config(root: Path, model: onnx.ModelProto, extra: str, *, seed: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(root / "net.onnx"))
    cfg = root / "net.yaml"
    cfg.write_text(
        "model: net.onnx\nprecision: fp32\ntargets: []\nbatch_sizes: [1, 2]\n"
        "preprocess: {layout: NCHW, mean: [0.4, 0.5, 0.6], std: [0.2, 0.25, 0.3]}\n"
        "postprocess: {activation: softmax}\npartition: {mode: rules, track_a: {op_types: [Conv, Relu, Add]}}\n"
        + ("verify: {seed: 5}\n" if seed else "")
        + extra
    )
    return cfg


def reference(bundle: Bundle, size: sizes.Size, x: np.ndarray) -> dict[str, np.ndarray]:
    """onnxruntime on the bundle's own graph at ``size`` (the wrapped model: image in, mask and probs out)."""
    model = load_model(bundle.at_size(size))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {sess.get_inputs()[0].name: x}), strict=True))


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))
