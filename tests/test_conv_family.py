"""Every convolution on Track A (issue 38): grouped convolutions on the general conv, depthwise ones of
any kernel up to 7x7 (non-square, strided, dilated, with a channel multiplier) on dwconv, and any
ConvTranspose on convt (convt2x2 keeps its 2x2 / stride 2). The numpy references against
onnxruntime on shapes no zoo model has, fp32 and fp16-rounded; the partition taking them all; and a
tiny `dualtrack build` of a network of them verifying on the CPU. The GPU side:
tests/gpu/test_conv_family_gpu.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from body_net import build_body_net
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.contract.activations import Activation
from dualtrack.contract.bundle import Bundle
from dualtrack.kernels import KERNELS, ConvGeometry, ConvTGeometry, DwConvSpec, DwGeometry, pack_conv_weights
from dualtrack.kernels.convt import pack_convt_general

# One rounding of the result in fp16 (the inputs are rounded before both sides see them); fp32 sums
# in another order.
REL = {"float32": 2e-5, "float16": 2e-3}


def run_onnx(node: onnx.NodeProto, x: np.ndarray, inits: dict[str, np.ndarray]) -> np.ndarray:
    """``node`` (input "x", output "y", NCHW float32) run by onnxruntime on the CPU."""
    graph = helper.make_graph(
        [node],
        "one_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x.astype(np.float32)})[0]


def nhwc(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, scale: float) -> None:
    """|got - want| <= REL[dtype] * (|want| + scale), ``scale`` the largest sum of |x * w| (cancellation)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = REL[dtype] * (np.abs(want.astype(np.float64)) + scale)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def operands(dtype: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], k: int) -> tuple[np.ndarray, ...]:
    """Fresh random x (NCHW), w and bias, rounded to ``dtype`` (what both sides then compute on)."""
    rng = np.random.default_rng()
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    return x, w, rng.standard_normal(k).astype(dtype)


def scale_of(x: np.ndarray, w: np.ndarray, b: np.ndarray, per_output_taps: float) -> float:
    return float(np.abs(x).max() * np.abs(w).max() * per_output_taps + np.abs(b).max())


# --- grouped convolutions: the general conv ------------------------------------------------------

GROUPED = [  # (N, C, H, W, K, kernel, stride, dilation, pads, group)
    (2, 6, 9, 11, 10, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 2),  # g=2, odd per-group widths 3 -> 5
    (1, 9, 13, 10, 15, (3, 3), (2, 2), (2, 2), (2, 2, 2, 2), 3),  # g=3, dilation 2, stride 2, odd input
    (1, 128, 8, 7, 128, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 32),  # ResNeXt 32x4d: 4 channels a group
    (1, 64, 9, 9, 96, (3, 3), (1, 1), (3, 3), (3, 3, 3, 3), 8),  # 8 -> 12 a group, dilation 3 (DeepLab)
    (2, 6, 7, 12, 4, (1, 5), (1, 2), (1, 1), (0, 2, 0, 1), 2),  # non-square, asymmetric pads
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("N", "C", "H", "W", "K", "kernel", "stride", "dil", "pads", "group"), GROUPED)
def test_grouped_conv_reference_matches_onnxruntime(dtype, N, C, H, W, K, kernel, stride, dil, pads, group) -> None:
    x, w, b = operands(dtype, (N, C, H, W), (K, C // group, *kernel), K)
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], group=group, kernel_shape=list(kernel), strides=list(stride),
        dilations=list(dil), pads=list(pads),
    )  # fmt: skip
    want = nhwc(run_onnx(node, x, {"w": w.astype(np.float32), "b": b.astype(np.float32)}))
    geom = ConvGeometry(*kernel, *stride, *dil, *pads, groups=group)
    spec = KERNELS["conv"]
    assert spec.supports(dtype, H, W, C, K, geom) is None
    wp, bp = pack_conv_weights(w, b, any_size=True)
    got = spec.reference(nhwc(x), wp, bp, geom=geom)
    assert got.dtype == np.dtype(dtype)
    assert_close(got, want, dtype, scale_of(x, w, b, C // group * kernel[0] * kernel[1]))


def test_grouped_conv_epilogue_adds_the_residual_before_the_activation() -> None:
    x, w, b = operands("float32", (1, 12, 6, 6), (12, 4, 3, 3), 12)
    geom = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, groups=3)
    res = np.random.default_rng().standard_normal((1, 6, 6, 12)).astype(np.float32)
    wp, bp = pack_conv_weights(w, b, any_size=True)
    spec = KERNELS["conv"]
    plain = spec.reference(nhwc(x), wp, bp, geom=geom)
    got = spec.reference(nhwc(x), wp, bp, res, geom=geom, act=Activation.named("leakyrelu", 0.1))
    np.testing.assert_allclose(got, np.where(plain + res > 0, plain + res, 0.1 * (plain + res)), rtol=1e-6)


def test_grouped_launch_has_a_grid_layer_a_group_and_per_group_channels() -> None:
    spec = KERNELS["conv"]
    geom = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, groups=32)
    cfg = spec.launch("float16", 1, 64, 64, 512, 512, geom=geom)  # 16 -> 16 channels a group
    assert cfg.grid[2] == 32 and cfg.grid[1] == 1
    args = dict(
        zip(
            spec.PARAMS, (v for v, _ in spec.args(x=1, w=2, y=3, N=1, H=64, W=64, C=512, K=512, geom=geom)), strict=True
        )
    )
    assert (args["C"], args["K"], args["ldx"], args["ldy"]) == (16, 16, 512, 512)
    assert "does not divide" in (spec.supports("float16", 8, 8, 12, 8, ConvGeometry(1, 1, groups=8)) or "")


# --- depthwise: dwconv ---------------------------------------------------------------------------

DEPTHWISE = [  # (N, C, H, W, mult, kernel, stride, dilation, pads)
    (2, 24, 15, 14, 1, (7, 7), (1, 1), (1, 1), (3, 3, 3, 3)),  # ConvNeXt's 7x7
    (1, 10, 9, 17, 1, (1, 5), (1, 2), (1, 1), (0, 2, 0, 2)),  # 1x5, stride 2 along W only
    (1, 7, 11, 8, 1, (5, 1), (2, 1), (2, 1), (4, 0, 3, 0)),  # 5x1, dilated along H
    (2, 6, 10, 9, 2, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),  # channel multiplier 2
    (1, 5, 8, 8, 3, (4, 2), (1, 1), (1, 2), (2, 1, 1, 1)),  # even, non-square kernel, multiplier 3
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("N", "C", "H", "W", "mult", "kernel", "stride", "dil", "pads"), DEPTHWISE)
def test_depthwise_reference_matches_onnxruntime(dtype, N, C, H, W, mult, kernel, stride, dil, pads) -> None:
    x, w, b = operands(dtype, (N, C, H, W), (C * mult, 1, *kernel), C * mult)
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], group=C, kernel_shape=list(kernel), strides=list(stride),
        dilations=list(dil), pads=list(pads),
    )  # fmt: skip
    want = nhwc(run_onnx(node, x, {"w": w.astype(np.float32), "b": b.astype(np.float32)}))
    g = DwGeometry(kernel[0], stride[0], dil[0], pads, S=kernel[1], stride_w=stride[1], dil_w=dil[1], multiplier=mult)
    spec = KERNELS["dwconv"]
    assert spec.output_shape(N, H, W, C, 0, g) == want.shape
    wp, bp = DwConvSpec.pack(w, b)
    got = spec.reference(nhwc(x), wp, bp, g, Activation.named("silu"))
    act = Activation.named("silu").apply(want.astype(np.float32))
    assert_close(got, act, dtype, scale_of(x, w, b, kernel[0] * kernel[1]))


# --- ConvTranspose: convt ------------------------------------------------------------------------

TRANSPOSED = [  # (N, C, H, W, K, kernel, stride, dilation, pads, output_padding, group)
    (1, 5, 7, 6, 3, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (1, 1), 1),  # MONAI UNet's upsampler
    (2, 8, 5, 9, 6, (4, 4), (2, 2), (1, 1), (1, 1, 1, 1), (0, 0), 1),  # k4 s2 p1 (DCGAN/FCN style)
    (1, 3, 4, 5, 7, (5, 5), (3, 3), (1, 1), (0, 0, 0, 0), (0, 0), 1),  # k5 s3
    (1, 6, 6, 5, 4, (3, 2), (2, 3), (2, 1), (2, 0, 1, 1), (1, 2), 2),  # dilated, non-square, groups 2
    (1, 4, 3, 3, 4, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), (1, 1), 1),  # 2x2/2 with output padding
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("N", "C", "H", "W", "K", "kernel", "stride", "dil", "pads", "opad", "group"), TRANSPOSED)
def test_convtranspose_reference_matches_onnxruntime(dtype, N, C, H, W, K, kernel, stride, dil, pads, opad, group):
    x, w, b = operands(dtype, (N, C, H, W), (C, K // group, *kernel), K)
    node = helper.make_node(
        "ConvTranspose", ["x", "w", "b"], ["y"], group=group, kernel_shape=list(kernel), strides=list(stride),
        dilations=list(dil), pads=list(pads), output_padding=list(opad),
    )  # fmt: skip
    want = nhwc(run_onnx(node, x, {"w": w.astype(np.float32), "b": b.astype(np.float32)}))
    geom = ConvTGeometry(*kernel, *stride, *dil, *pads, *opad, groups=group)
    spec = KERNELS["convt"]
    assert spec.supports(dtype, H, W, C, K, geom) is None
    assert spec.output_shape(N, H, W, C, K, geom) == want.shape
    wp, bp = pack_convt_general(w, b, group)
    got = spec.reference(nhwc(x), wp, bp, geom=geom)
    assert_close(got, want, dtype, scale_of(x, w, b, C // group * kernel[0] * kernel[1]))


def test_convtranspose_refusals_name_the_problem() -> None:
    spec = KERNELS["convt"]
    assert "output_padding 2,0 must be below" in (
        spec.supports("float16", 4, 4, 2, 2, ConvTGeometry(3, 3, 2, 2, out_pad_h=2)) or ""
    )
    assert "kernel 16x3" in (spec.supports("float16", 4, 4, 2, 2, ConvTGeometry(16, 3)) or "")
    assert "empty output" in (spec.supports("float16", 1, 1, 2, 2, ConvTGeometry(1, 1, pad_top=1)) or "")


# --- the partition and a build -------------------------------------------------------------------

C0, H0 = 12, 13  # the small network's channels and (odd) size


def conv_family_net(height: int = H0) -> onnx.ModelProto:
    """``stem`` (Sin: Track B) -> body: grouped conv (g=3) + residual + LeakyRelu, dilated grouped conv
    (g=4, stride 2 on an odd size), depthwise 7x7, depthwise 1x5 with multiplier 2, ConvTranspose k3
    s2 p1 op1, ConvTranspose k4 s2 p1 (groups 2), ConvTranspose k2 s2 (convt2x2) -> ``head`` (Sin)."""
    rng = np.random.default_rng(3)
    nodes, inits = [helper.make_node("Sin", ["image"], ["stem"], name="stem")], []

    def conv(op: str, name: str, x: str, w_shape: tuple[int, ...], **attrs: object) -> str:
        w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
        out_ch = w_shape[0] if op == "Conv" else w_shape[1] * int(attrs.get("group", 1))  # type: ignore[call-overload]
        inits.extend(
            [
                numpy_helper.from_array(w, f"{name}.w"),
                numpy_helper.from_array(rng.standard_normal(out_ch).astype(np.float32), f"{name}.b"),
            ]
        )
        ins = [x, f"{name}.w", f"{name}.b"]  # kernel_shape written out, as torch.onnx.export does
        nodes.append(helper.make_node(op, ins, [name], name=name, kernel_shape=list(w_shape[2:]), **attrs))
        return name

    g1 = conv("Conv", "body/g3", "stem", (C0, C0 // 3, 3, 3), group=3, pads=[1] * 4)
    nodes.append(helper.make_node("Add", [g1, "stem"], ["body/add"], name="body/add"))
    nodes.append(helper.make_node("LeakyRelu", ["body/add"], ["body/act"], name="body/act", alpha=0.1))
    g2 = conv(
        "Conv", "body/g4", "body/act", (16, C0 // 4, 3, 3), group=4, strides=[2, 2], dilations=[2, 2], pads=[2] * 4
    )
    d7 = conv("Conv", "body/dw7", g2, (16, 1, 7, 7), group=16, pads=[3] * 4)
    d5 = conv("Conv", "body/dw1x5", d7, (32, 1, 1, 5), group=16, pads=[0, 2, 0, 2])
    t3 = conv("ConvTranspose", "body/up3", d5, (32, 8, 3, 3), strides=[2, 2], pads=[1] * 4, output_padding=[1, 1])
    t4 = conv("ConvTranspose", "body/up4", t3, (8, 3, 4, 4), strides=[2, 2], pads=[1] * 4, group=2)
    t2 = conv("ConvTranspose", "body/up2", t4, (6, 4, 2, 2), strides=[2, 2])
    nodes.append(helper.make_node("Sin", [t2], ["logits"], name="head"))
    graph = helper.make_graph(
        nodes, "conv_family", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", C0, height, height])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_the_partition_puts_every_convolution_on_track_a() -> None:
    part = PartitionConfig(mode="auto", switch_cost_us=0.0)
    p = partition.partition_model(
        BuildConfig(model=Path("g.onnx"), batch_sizes=(1,), partition=part), conv_family_net()
    )
    tracks = {d.node: (d.track, d.why) for d in p.assignment.decisions}
    body = {n: t for n, t in tracks.items() if n.startswith("body/")}
    assert all(t == "A" for t, _ in body.values()), body
    calls = {c.nodes[0]: c for s in p.plan.segments if s.track == "A" for c in s.calls}
    assert calls["body/g3"].op == "conv" and calls["body/g3"].attr("groups") == 3
    assert calls["body/g3"].attr("residual") == 1 and "body/act" in calls["body/g3"].nodes  # fused epilogue
    assert (calls["body/g4"].op, calls["body/g4"].attr("groups")) == ("conv", 4)
    assert calls["body/dw7"].op == "dwconv" and calls["body/dw1x5"].attr("multiplier") == 2
    assert (calls["body/up3"].op, calls["body/up4"].op, calls["body/up2"].op) == ("convt", "convt", "convt2x2")
    assert ConvTGeometry.from_call(calls["body/up4"]).groups == 2


def test_a_network_of_these_convolutions_builds_and_verifies_on_the_cpu(tmp_path: Path) -> None:
    out, report = build_body_net(tmp_path, conv_family_net(), "family")
    assert report["passed"] is True
    assert any(c["name"].startswith("seg1_A[numpy kernels]") for c in report["checks"])
    ops = {c.op for s in Bundle.open(out).manifest.plan.segments for c in s.calls}
    assert {"conv", "dwconv", "convt", "convt2x2"} <= ops
