"""The reference segmentation model, generated as ONNX from numpy (no torch).

A U-Net in the Ronneberger layout (base width 32, depth 4, BatchNorm folded into the convolutions,
2 classes, 512x512: 7.76 M parameters), wrapped the way a segmentation service uses it:

    image uint8 NHWC -> pre/ (cast, NCHW, normalise) -> enc*/, mid/, dec*/, head/ -> post/ (softmax, argmax)
    -> mask uint8 (N, H, W) and probs float32 (N, classes, H, W)

Node names carry the part of the model as a prefix (`pre/`, `enc1/`..`enc4/`, `mid/`, `dec4/`..`dec1/`,
`head/`, `post/`), which is what the partition rules in configs/*.yaml match on. Weights come from a
seeded generator, so the same arguments always give byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dualtrack import atomic

OPSET = 17
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class UNetSpec:
    """Shape of a generated U-Net. The defaults are the reference model of docs/facts.md."""

    base: int = 32
    depth: int = 4
    classes: int = 2
    height: int = 512
    width: int = 512
    precision: str = "fp16"  # "fp16" or "fp32"
    seed: int = 0

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self.precision == "fp16" else np.float32)


class _Builder:
    def __init__(self, spec: UNetSpec) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        out = name  # the node's single output tensor shares its name
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def conv(self, name: str, x: str, cin: int, cout: int, k: int, relu: bool) -> str:
        # He initialisation keeps activations O(1) through the ReLU stack, so fp16 never overflows.
        # The bias stands for a folded BatchNorm shift.
        w = self.rng.normal(0.0, np.sqrt(2.0 / (cin * k * k)), size=(cout, cin, k, k))
        b = self.rng.normal(0.0, 0.05, size=(cout,))
        dt = self.spec.dtype
        y = self.node(
            "Conv",
            f"{name}",
            [x, self.const(f"{name}.weight", w.astype(dt)), self.const(f"{name}.bias", b.astype(dt))],
            kernel_shape=[k, k],
            pads=[k // 2] * 4,
            strides=[1, 1],
        )
        if relu:
            y = self.node("Relu", f"{name}_relu", [y])
        return y

    def up(self, name: str, x: str, cin: int, cout: int) -> str:
        w = self.rng.normal(0.0, np.sqrt(1.0 / cin), size=(cin, cout, 2, 2))
        b = self.rng.normal(0.0, 0.05, size=(cout,))
        dt = self.spec.dtype
        return self.node(
            "ConvTranspose",
            name,
            [x, self.const(f"{name}.weight", w.astype(dt)), self.const(f"{name}.bias", b.astype(dt))],
            kernel_shape=[2, 2],
            strides=[2, 2],
        )


def build_unet(spec: UNetSpec = UNetSpec()) -> onnx.ModelProto:
    """Generate the U-Net with its pre- and post-processing as an ONNX model (dynamic batch ``N``)."""
    if spec.precision not in ("fp16", "fp32"):
        raise ValueError(f"precision must be fp16 or fp32, not {spec.precision!r}")
    if spec.height % (1 << spec.depth) or spec.width % (1 << spec.depth):
        raise ValueError(f"height and width must be multiples of {1 << spec.depth} for depth {spec.depth}")
    b = _Builder(spec)
    elem = TensorProto.FLOAT16 if spec.precision == "fp16" else TensorProto.FLOAT

    # pre/: uint8 NHWC -> normalised NCHW in the model's precision.
    x = b.node("Cast", "pre/cast", ["image"], to=TensorProto.FLOAT)
    x = b.node("Transpose", "pre/nchw", [x], perm=[0, 3, 1, 2])
    mean = np.array(MEAN, np.float32).reshape(1, 3, 1, 1) * 255.0
    scale = 1.0 / (np.array(STD, np.float32).reshape(1, 3, 1, 1) * 255.0)
    x = b.node("Sub", "pre/sub_mean", [x, b.const("pre/mean", mean)])
    x = b.node("Mul", "pre/scale", [x, b.const("pre/inv_std", scale.astype(np.float32))])
    if spec.precision == "fp16":
        x = b.node("Cast", "pre/to_fp16", [x], to=TensorProto.FLOAT16)

    skips: list[tuple[str, int]] = []
    cin, width = 3, spec.base
    for level in range(1, spec.depth + 1):
        x = b.conv(f"enc{level}/conv1", x, cin, width, 3, relu=True)
        x = b.conv(f"enc{level}/conv2", x, width, width, 3, relu=True)
        skips.append((x, width))
        x = b.node("MaxPool", f"enc{level}/pool", [x], kernel_shape=[2, 2], strides=[2, 2])
        cin, width = width, width * 2
    x = b.conv("mid/conv1", x, cin, width, 3, relu=True)
    x = b.conv("mid/conv2", x, width, width, 3, relu=True)
    for level in range(spec.depth, 0, -1):
        skip, sw = skips[level - 1]
        x = b.up(f"dec{level}/up", x, width, sw)
        x = b.node("Concat", f"dec{level}/concat", [x, skip], axis=1)
        x = b.conv(f"dec{level}/conv1", x, 2 * sw, sw, 3, relu=True)
        x = b.conv(f"dec{level}/conv2", x, sw, sw, 3, relu=True)
        width = sw
    logits = b.conv("head/conv", x, width, spec.classes, 1, relu=False)

    probs = b.node("Softmax", "post/softmax", [logits], axis=1)
    if spec.precision == "fp16":
        probs_out = b.node("Cast", "probs", [probs], to=TensorProto.FLOAT)
    else:
        probs_out = b.node("Identity", "probs", [probs])
    b.nodes.append(helper.make_node("ArgMax", [probs], ["post/argmax"], name="post/argmax", axis=1, keepdims=0))
    b.node("Cast", "mask", ["post/argmax"], to=TensorProto.UINT8)

    h, w = spec.height, spec.width
    graph = helper.make_graph(
        b.nodes,
        f"unet_b{spec.base}_d{spec.depth}_{spec.precision}",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["N", h, w, 3])],
        [
            helper.make_tensor_value_info("mask", TensorProto.UINT8, ["N", h, w]),
            helper.make_tensor_value_info(probs_out, TensorProto.FLOAT, ["N", spec.classes, h, w]),
        ],
        b.inits,
    )
    del elem  # the element type is carried by the initializers and casts
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dualtrack")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def parameter_count(model: onnx.ModelProto) -> int:
    """Learned parameters (conv weights and biases), excluding the normalisation constants."""
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if not t.name.startswith("pre/"))


def sample_image(height: int = 512, width: int = 512, seed: int = 0) -> np.ndarray:
    """A deterministic synthetic RGB scene (uint8 HWC): a gradient with discs and bars on it."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([xx / width * 160 + 40, yy / height * 120 + 60, np.full_like(xx, 90.0)], axis=-1)
    for _ in range(6):
        cy, cx = rng.uniform(0.15, 0.85, size=2) * (height, width)
        r = rng.uniform(0.05, 0.15) * min(height, width)
        inside = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
        img[inside] = rng.uniform(0, 255, size=3)
    for _ in range(3):
        y0 = int(rng.uniform(0, height * 0.9))
        img[y0 : y0 + height // 32, :] = rng.uniform(0, 255, size=3)
    img += rng.normal(0, 6, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_reference(out_dir: Path, spec: UNetSpec = UNetSpec()) -> dict[str, Path]:
    """Write the fp16 and fp32 reference models and the sample image into ``out_dir``."""
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for precision in ("fp16", "fp32"):
        s = UNetSpec(**{**spec.__dict__, "precision": precision})
        path = out_dir / f"unet_{precision}.onnx"
        atomic.write_bytes(path, build_unet(s).SerializeToString())
        written[precision] = path
    img_path = out_dir / "sample.png"
    Image.fromarray(sample_image(spec.height, spec.width)).save(img_path)
    written["sample"] = img_path
    return written
