"""Issue 38's convolutions on a real GPU against onnxruntime (CPU, fp32 on the same fp16-rounded
inputs), fp16 and fp32: grouped convolutions on the general conv (grid.z a group; odd per-group
widths, ResNeXt's 4 channels a group, dilation), depthwise kernels dwconv did not take before (7x7,
1x5 / 5x1, strides and dilations per axis, a channel multiplier), and any ConvTranspose on convt
(groups, dilation, output padding). Each launch has a fused activation, and a residual where the
kernel takes one; x, the residual and y are channel slices of wider buffers (offset 3: unaligned,
the scalar paths; offset 0: the vector paths), the output slice poisoned first.

Tolerance: |got - want| <= REL * (|want| + S), S the largest sum of |x * w| over an output's taps
(what the sums may cancel): fp32 sums in another order, fp16 one rounding of the result."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest
from gpu_ptx import Slices, checked_in_entries
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.kernels import Activation, ConvGeometry, ConvTGeometry, DwConvSpec, DwGeometry
from dualtrack.kernels.conv import block_diagonal
from dualtrack.kernels.convt import pack_convt_general
from dualtrack.runtime.driver import Kernel
from dualtrack.runtime.engine import Engine

REL = {"float16": 3e-3, "float32": 3e-5}
CONV, DW, CONVT = kernels.KERNELS["conv"], kernels.KERNELS["dwconv"], kernels.KERNELS["convt"]
ACT = Activation.named("leakyrelu", 0.1)


@pytest.fixture(scope="module")
def fns(engine: Engine) -> Iterator[dict[str, Kernel]]:
    with checked_in_entries(engine, (CONV.stem, DW.stem, CONVT.stem)) as found:
        yield found


def onnx_nhwc(op: str, x: np.ndarray, w: np.ndarray, b: np.ndarray, **attrs: object) -> np.ndarray:
    """One ``op`` node by onnxruntime on the CPU: x NHWC -> y NHWC, float32 math."""
    node = helper.make_node(op, ["x", "w", "b"], ["y"], **attrs)
    xs = (x.shape[0], x.shape[3], x.shape[1], x.shape[2])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(b.astype(np.float32), "b")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(["y"], {"x": np.ascontiguousarray(x.transpose(0, 3, 1, 2)).astype(np.float32)})[0]
    return y.transpose(0, 2, 3, 1).astype(np.float64)


def check(got: np.ndarray, want: np.ndarray, dtype: str, x: np.ndarray, w: np.ndarray, taps: int) -> None:
    scale = float(np.abs(x).max() * np.abs(w).max() * taps) + 1.0
    err = np.abs(got.astype(np.float64) - want)
    bound = REL[dtype] * (np.abs(want) + scale)
    assert np.isfinite(got).all() and (err <= bound).all(), f"max error {err.max():.3g}, bound {bound.min():.3g}"


def data(dtype: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], k: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng()
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    return x, w, rng.standard_normal(k).astype(np.float32)


# --- grouped conv --------------------------------------------------------------------------------

GROUPED = [  # (N, H, W, C, K, geometry)
    (2, 19, 17, 6, 10, ConvGeometry(3, 3, 1, 1, 1, 1, 1, 1, 1, 1, groups=2)),  # 3 -> 5 a group
    (1, 23, 21, 128, 128, ConvGeometry(3, 3, 2, 2, 1, 1, 1, 1, 1, 1, groups=32)),  # ResNeXt: 4 a group, stride 2
    (1, 33, 30, 64, 96, ConvGeometry(3, 3, 1, 1, 3, 3, 3, 3, 3, 3, groups=4)),  # 16 -> 24, dilation 3
    (2, 15, 16, 256, 256, ConvGeometry(3, 3, 1, 1, 1, 1, 1, 1, 1, 1, groups=8)),  # 32 -> 32: the tiles
    (1, 12, 13, 9, 12, ConvGeometry(1, 5, 1, 2, 1, 1, 0, 2, 0, 1, groups=3)),  # 1x5 stride (1, 2)
    # Depthwise windows past dwconv's 7 (one-channel groups): InceptionNeXt's 1x11 and 11x1 bands
    (2, 16, 15, 24, 24, ConvGeometry(1, 11, 1, 1, 1, 1, 0, 5, 0, 5, groups=24)),
    (1, 19, 9, 12, 12, ConvGeometry(11, 1, 1, 1, 1, 1, 5, 0, 5, 0, groups=12)),
]


def run_grouped(engine, fns, dtype, shape, geom, off, entry=None, merge=False) -> None:
    """One grouped conv launch against onnxruntime's; ``merge``: launched as the partition lowers it,
    its narrow groups merged (ConvGeneralSpec.merged) into block-diagonal weights."""
    n, h, w_, c, k = shape
    x, w, b = data(dtype, (n, h, w_, c), (k, c // geom.groups, geom.R, geom.S), k)
    _, p, q, _ = CONV.output_shape(n, h, w_, c, k, geom=geom)
    res = np.random.default_rng().standard_normal((n, p, q, k)).astype(dtype)
    pads = [geom.pad_top, geom.pad_left, geom.pad_bottom, geom.pad_right]
    y = onnx_nhwc(
        "Conv", x, w, b, group=geom.groups, kernel_shape=[geom.R, geom.S], strides=[geom.stride_h, geom.stride_w],
        dilations=[geom.dil_h, geom.dil_w], pads=pads,
    )  # fmt: skip
    want = ACT.apply((y + res.astype(np.float64)).astype(np.float32)).astype(np.float64)
    s = Slices(engine, dtype, off)
    (dx, ldx), (dr, ldr), (dy, ldy) = s.input(x), s.input(res), s.output((n, p, q, k))
    onnx_groups = geom.groups
    if merge:
        geom = CONV.merged(dtype, c, k, geom)
        assert geom.merge > 1
        w = block_diagonal(w, onnx_groups, geom.merge)
    wp, bp = kernels.pack_conv_weights(w, b, any_size=True)
    entry = entry or CONV.variant(dtype, n, h, w_, c, k, geom)  # what the chooser runs: wgmma takes no groups
    cfg = CONV.launch(dtype, n, h, w_, c, k, geom=geom, entry=entry)
    args = CONV.args(
        x=dx, w=s.weights(wp), bias=s.weights(bp), res=dr, y=dy, N=n, H=h, W=w_, C=c, K=k, geom=geom,
        ldx=ldx, ldy=ldy, ldr=ldr, act=ACT,
    )  # fmt: skip
    fns[entry].launch(cfg.grid, cfg.block, cfg.shared_bytes, engine.backend.stream, args)
    check(s.result(), want, dtype, x, w, c // onnx_groups * geom.R * geom.S)


@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("shape", "geom"), [(s[:5], s[5]) for s in GROUPED], ids=["g2", "g32", "g4dil3", "g8", "g3_1x5", "dw1x11", "dw11x1"]
)
def test_grouped_conv_with_residual_and_activation(engine, fns, dtype, shape, geom, off) -> None:
    run_grouped(engine, fns, dtype, shape, geom, off)


MERGED = [  # (N, H, W, C, K, ONNX's geometry): narrow groups the partition lowers merged
    (2, 33, 31, 128, 128, ConvGeometry(3, 3, 2, 2, 1, 1, 1, 1, 1, 1, groups=32)),  # ResNeXt's 4 a group, stride 2
    (1, 20, 22, 256, 256, ConvGeometry(3, 3, 1, 1, 1, 1, 1, 1, 1, 1, groups=32)),  # 8 a group
    (1, 17, 19, 72, 72, ConvGeometry(3, 3, 1, 1, 2, 2, 2, 2, 2, 2, groups=24)),  # 3 a group -> 24, dilation 2
    (1, 9, 12, 64, 128, ConvGeometry(5, 5, 1, 1, 1, 1, 2, 1, 2, 3, groups=16)),  # 4 -> 8 a group, uneven pads
    (1, 10, 9, 512, 512, ConvGeometry(3, 3, 1, 1, 1, 1, 1, 1, 1, 1, groups=32)),  # 16 a group -> 32
]


@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize(
    ("shape", "geom"), [(s[:5], s[5]) for s in MERGED], ids=["g32x4s2", "g32x8", "g24x3", "g16x4to8", "g32x16"]
)
def test_merged_groups_on_the_gpu(engine, fns, shape, geom, off) -> None:
    run_grouped(engine, fns, "float16", shape, geom, off, merge=True)


@pytest.mark.parametrize("entry", list(CONV.f16_tiles()))
def test_every_f16_tile_takes_groups(engine, fns, entry) -> None:
    run_grouped(engine, fns, "float16", (2, 15, 16, 256, 256), GROUPED[3][5], 0, entry=entry)


# --- depthwise -----------------------------------------------------------------------------------

DEPTHWISE = [  # (N, H, W, C, geometry)
    (2, 21, 19, 24, DwGeometry(7, 1, 1, (3, 3, 3, 3))),  # ConvNeXt 7x7 (vector path at offset 0)
    (1, 17, 33, 40, DwGeometry(1, 1, 1, (0, 2, 0, 2), S=5, stride_w=2)),  # 1x5, stride 2 along W
    (1, 19, 12, 7, DwGeometry(5, 2, 2, (4, 0, 3, 0), S=1, stride_w=1, dil_w=1)),  # 5x1, dilated along H
    (2, 14, 15, 16, DwGeometry(3, 2, 1, (1, 1, 1, 1), multiplier=2)),  # channel multiplier 2
    (1, 9, 10, 5, DwGeometry(4, 1, 1, (2, 1, 1, 1), S=2, dil_w=2, multiplier=3)),  # even kernel, multiplier 3
    # The row path (stride and dilation 1 along W: 4 output pixels an item), rows not a multiple of 4 wide:
    (2, 13, 13, 16, DwGeometry(3, 2, 1, (1, 1, 1, 1), S=3, stride_w=1, dil_w=1)),  # stride 2 along H only
    (1, 11, 9, 24, DwGeometry(5, 1, 2, (4, 2, 4, 2), S=5, stride_w=1, dil_w=1)),  # dilated along H only
    (1, 6, 30, 8, DwGeometry(7, 1, 1, (3, 3, 3, 3))),  # a row wider than the kernel, one vector a pixel
]


@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("shape", "g"),
    [(s[:4], s[4]) for s in DEPTHWISE],
    ids=["7x7", "1x5s2", "5x1d2", "m2", "m3", "rows_s2h", "rows_d2h", "rows_7x7"],
)
def test_depthwise_with_activation(engine, fns, dtype, shape, g, off) -> None:
    n, h, w_, c = shape
    k = c * g.multiplier
    x, w, b = data(dtype, (n, h, w_, c), (k, 1, g.R, g.width), k)
    y = onnx_nhwc(
        "Conv", x, w, b, group=c, kernel_shape=[g.R, g.width], strides=[g.stride, g.stride_w],
        dilations=[g.dilation, g.dil_w], pads=list(g.pads),
    )  # fmt: skip
    want = ACT.apply(y.astype(np.float32)).astype(np.float64)
    s = Slices(engine, dtype, off)
    (dx, ldx), (dy, ldy) = s.input(x), s.output(want.shape)
    wp, bp = DwConvSpec.pack(w, b)
    cfg = DW.launch(dtype, n, h, w_, c, 0, g, ldy=ldy)
    args = DW.args(
        x=dx, w=s.weights(wp), bias=s.weights(bp), y=dy, N=n, H=h, W=w_, C=c, geometry=g, ldx=ldx, ldy=ldy, act=ACT
    )
    fns[DW.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, engine.backend.stream, args)
    check(s.result(), want, dtype, x, w, g.R * g.width)


# --- ConvTranspose -------------------------------------------------------------------------------

TRANSPOSED = [  # (N, H, W, C, K, geometry)
    (1, 13, 11, 16, 24, ConvTGeometry(3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1)),  # MONAI UNet's upsampler
    (2, 9, 10, 32, 16, ConvTGeometry(4, 4, 2, 2, 1, 1, 1, 1, 1, 1)),  # k4 s2 p1
    (1, 7, 6, 5, 7, ConvTGeometry(5, 5, 3, 3)),  # k5 s3, odd channels
    (1, 8, 9, 12, 16, ConvTGeometry(3, 2, 2, 3, 2, 1, 2, 0, 1, 1, 1, 2, groups=2)),  # dilated, grouped
    (2, 6, 5, 8, 8, ConvTGeometry(2, 2, 2, 2, out_pad_h=1, out_pad_w=1)),  # 2x2/2 that convt2x2 refuses
]


@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("shape", "g"), [(s[:5], s[5]) for s in TRANSPOSED], ids=["k3s2op1", "k4s2p1", "k5s3", "grouped", "2x2op1"]
)
def test_convtranspose_with_residual_and_activation(engine, fns, dtype, shape, g, off) -> None:
    n, h, w_, c, k = shape
    x, w, b = data(dtype, (n, h, w_, c), (c, k // g.groups, g.R, g.S), k)
    y = onnx_nhwc(
        "ConvTranspose", x, w, b, group=g.groups, kernel_shape=[g.R, g.S], strides=[g.stride_h, g.stride_w],
        dilations=[g.dil_h, g.dil_w], pads=[g.pad_top, g.pad_left, g.pad_bottom, g.pad_right],
        output_padding=[g.out_pad_h, g.out_pad_w],
    )  # fmt: skip
    res = np.random.default_rng().standard_normal(y.shape).astype(dtype)
    want = ACT.apply((y + res.astype(np.float64)).astype(np.float32)).astype(np.float64)
    s = Slices(engine, dtype, off)
    (dx, ldx), (dr, ldr), (dy, ldy) = s.input(x), s.input(res), s.output(y.shape)
    wp, bp = pack_convt_general(w, b, g.groups)
    cfg = CONVT.launch(dtype, n, h, w_, c, k, g)
    args = CONVT.args(
        x=dx, w=s.weights(wp), bias=s.weights(bp), res=dr, y=dy, N=n, H=h, W=w_, C=c, K=k, geom=g,
        ldx=ldx, ldy=ldy, ldr=ldr, act=ACT,
    )  # fmt: skip
    fns[CONVT.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, engine.backend.stream, args)
    check(s.result(), want, dtype, x, w, c // g.groups * g.R * g.S)
