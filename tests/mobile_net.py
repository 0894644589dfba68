"""A tiny MobileNetV3-like segmentation network as ONNX (numpy weights, no torch): depthwise 3x3,
5x5/stride 2 and dilated convolutions, squeeze-and-excitation blocks (GlobalAveragePool and
ReduceMean flavours), HardSwish / HardSigmoid / ReLU6 / Sigmoid, residual adds, 1x1 expansions
and projections, and a head with a bilinear and a nearest Resize. Node names carry their part:
``stem/`` and ``head/`` (the first and last ops: Track B), ``body/`` (what a config puts on Track A).
Input ``image`` (N, 3, H, W) float32, output ``logits`` (N, 2, H, W)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from body_net import write_body_project
from onnx import TensorProto, helper, numpy_helper


class _Net:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(self, name: str, x: str, cin: int, cout: int, k: int, *, stride=1, dil=1, group=1, pads=None) -> str:
        w = self.rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / (cin // group * k * k))
        b = 0.1 * self.rng.standard_normal(cout)
        p = pads if pads is not None else [dil * (k // 2)] * 4
        wb = [self.const(f"{name}.w", w.astype(np.float32)), self.const(f"{name}.b", b.astype(np.float32))]
        return self.node(
            "Conv", name, [x, *wb],
            kernel_shape=[k, k], strides=[stride, stride], dilations=[dil, dil], group=group, pads=p,
        )  # fmt: skip

    def se(self, name: str, x: str, c: int, squeeze: int, *, reduce_mean: bool, gate: str) -> str:
        if reduce_mean:
            pooled = self.node("ReduceMean", f"{name}/pool", [x], axes=[2, 3], keepdims=1)
        else:
            pooled = self.node("GlobalAveragePool", f"{name}/pool", [x])
        h = self.node("Relu", f"{name}/relu", [self.conv(f"{name}/fc1", pooled, c, squeeze, 1)])
        s = self.conv(f"{name}/fc2", h, squeeze, c, 1)
        if gate == "hardsigmoid":
            s = self.node("HardSigmoid", f"{name}/gate", [s], alpha=1.0 / 6)
        else:
            s = self.node("Sigmoid", f"{name}/gate", [s])
        return self.node("Mul", f"{name}/mul", [s, x])  # gate first, as torchvision exports it


def build_mobile_net(height: int = 32, width: int = 32, seed: int = 0) -> onnx.ModelProto:
    """The network at a fixed size (height, width multiples of 4) with a dynamic batch."""
    n = _Net(seed)
    lo = n.const("relu6.lo", np.array(0, np.float32))
    hi = n.const("relu6.hi", np.array(6, np.float32))
    stem = n.node("HardSwish", "stem/act", [n.conv("stem/conv", "image", 3, 16, 3, stride=2)])  # H/2
    # block 1: MobileNetV3's first inverted residual: depthwise + ReLU, 1x1 projection, residual add
    b1 = n.node("Relu", "body/b1/dw/relu", [n.conv("body/b1/dw", stem, 16, 16, 3, group=16)])
    b1 = n.node("Add", "body/b1/add", [n.conv("body/b1/project", b1, 16, 16, 1), stem])
    # block 2: 1x1 expansion + HardSwish, depthwise 5x5 stride 2 + HardSwish, SE, projection  (H/4)
    b2 = n.node("HardSwish", "body/b2/expand/act", [n.conv("body/b2/expand", b1, 16, 48, 1)])
    b2 = n.node("HardSwish", "body/b2/dw/act", [n.conv("body/b2/dw", b2, 48, 48, 5, stride=2, group=48)])
    b2 = n.se("body/b2/se", b2, 48, 16, reduce_mean=False, gate="hardsigmoid")
    b2 = n.conv("body/b2/project", b2, 48, 24, 1)
    # block 3: dilated depthwise 3x3 + ReLU6, an SE through ReduceMean and Sigmoid, residual add
    b3 = n.node("Clip", "body/b3/dw/relu6", [n.conv("body/b3/dw", b2, 24, 24, 3, dil=2, group=24), lo, hi])
    b3 = n.node("Add", "body/b3/add", [n.se("body/b3/se", b3, 24, 8, reduce_mean=True, gate="sigmoid"), b2])
    # head: bilinear up to the block-1 size (x2), project, add the low-level features, nearest x2.
    # (Scales, not sizes: constant sizes would fix the batch; lowering tests cover sizes.)
    empty = n.const("empty", np.zeros(0, np.float32))
    two = n.const("body/scales2", np.array([1, 1, 2, 2], np.float32))
    up = n.node(
        "Resize", "body/up/resize", [b3, empty, two], mode="linear", coordinate_transformation_mode="half_pixel"
    )
    up = n.node("Add", "body/up/add", [n.conv("body/up/project", up, 24, 16, 1), b1])
    up2 = n.node(
        "Resize", "body/up2/resize", [up, empty, two], mode="nearest",
        coordinate_transformation_mode="asymmetric", nearest_mode="floor",
    )  # fmt: skip
    logits = n.conv("head/conv", up2, 16, 2, 1)
    graph = helper.make_graph(
        n.nodes,
        "mobile_net",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, height, width])],
        [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["N", 2, height, width])],
        n.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="dualtrack-tests")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


# fp16 with the body on Track A: what tests/test_mobile_build.py builds on the CPU and
# tests/gpu/test_mobile_gpu.py runs on a GPU (bench/prepare_carry.sh builds it for sm_90a, sm_80).
def write_mobile_project(root: Path, targets: tuple[str, ...] = ("sm_80",)) -> Path:
    """The network (32x32, seed 1) and its config in ``root``; returns the config path."""
    return write_body_project(
        root, build_mobile_net(32, 32, seed=1), "mobile", precision="fp16", batch_sizes=(1, 2), targets=targets
    )
