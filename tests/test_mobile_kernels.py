"""The mobile kernels' numpy references (dwconv, gap, fc, eltwise, resize) on the CPU against
onnxruntime running a one-node ONNX model of the op they stand for (an independent implementation
of the ONNX semantics), on odd shapes and fresh random inputs; and their argument lists (the ABI of
handwritten_ptx/README.md) and launch geometry."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.contract.activations import ACTIVATIONS
from dualtrack.contract.plan import REDUCE_OPS, KernelCall, bits_f32, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels import KERNELS, Activation, DwConvSpec, DwGeometry, ResizeMode
from dualtrack.kernels.base import cdiv
from dualtrack.kernels.device import DEVICES, REFERENCE

DW, GAP, FC, ELT, RESIZE = (KERNELS[k] for k in ("dwconv", "gap", "fc", "eltwise", "resize"))
# fp32: the kernels' and onnxruntime's sums differ in order only; fp16: one rounding of the result
# (half an ulp, 2^-11 relative) on top of that.
REL = {"float32": 1e-5, "float16": 2.0**-10}


def nchw(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def nhwc(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def run_onnx(nodes: list, inputs: dict[str, np.ndarray], inits: dict[str, np.ndarray], opset: int = 17) -> np.ndarray:
    """The output ``y`` of a graph of ``nodes`` (NCHW, float32) run by onnxruntime on the CPU."""
    graph = helper.make_graph(
        nodes,
        "one_op",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {k: v.astype(np.float32) for k, v in inputs.items()})[0]


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, scale: np.ndarray | float = 1.0) -> None:
    """|got - want| <= REL[dtype] * (|want| + scale): ``scale`` bounds what the sums cancelled."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = REL[dtype] * (np.abs(want.astype(np.float64)) + scale)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


ACT_NODES = {  # activation -> (ONNX node building the same thing on input "t", its Activation)
    "relu": (lambda: helper.make_node("Relu", ["t"], ["y"]), Activation.named("relu")),
    "relu6": (
        lambda: helper.make_node("Clip", ["t", "lo", "hi"], ["y"]),
        Activation.named("clip", 0.0, 6.0),
    ),
    "hardsigmoid": (
        lambda: helper.make_node("HardSigmoid", ["t"], ["y"], alpha=1 / 6),
        Activation.named("hardsigmoid", float(np.float32(1 / 6)), 0.5),
    ),
    "hardswish": (lambda: helper.make_node("HardSwish", ["t"], ["y"]), Activation.named("hardswish")),
    "sigmoid": (lambda: helper.make_node("Sigmoid", ["t"], ["y"]), Activation.named("sigmoid")),
}
CLIP_BOUNDS = {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}


def with_act(node, act: str | None) -> tuple[list, dict[str, np.ndarray], Activation]:
    """``node`` (writing "y") followed by the activation ``act``: nodes, extra initializers, epilogue."""
    if act is None:
        return [node], {}, Activation()
    node.output[0] = "t"
    make, a = ACT_NODES[act]
    return [node, make()], (CLIP_BOUNDS if act == "relu6" else {}), a


# --- dwconv -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("N", "H", "W", "C", "R", "S", "D", "pads", "act"),
    [
        (2, 9, 7, 5, 3, 1, 1, (1, 1, 1, 1), "relu"),  # MobileNetV3's 3x3, odd everything
        (1, 11, 13, 16, 3, 2, 1, (1, 1, 1, 1), "hardswish"),  # stride 2 on odd sizes
        (2, 10, 9, 7, 5, 2, 1, (2, 2, 2, 2), "relu6"),  # 5x5 stride 2
        (1, 12, 11, 9, 5, 1, 2, (4, 4, 4, 4), "hardswish"),  # the dilated 5x5 of LR-ASPP's last stages
        (1, 8, 8, 3, 3, 1, 3, (3, 3, 3, 3), None),  # dilation 3, no activation
        (1, 7, 10, 4, 3, 2, 1, (0, 1, 1, 0), "sigmoid"),  # asymmetric pads (TF-style SAME export)
        (3, 5, 6, 33, 5, 3, 1, (1, 0, 2, 3), "hardsigmoid"),  # stride 3, odd pads, C > 32
    ],
)
def test_dwconv_reference_matches_onnxruntime(dtype, N, H, W, C, R, S, D, pads, act) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = (rng.standard_normal((C, 1, R, R)) / R).astype(dtype)
    b = rng.standard_normal(C).astype(dtype)
    conv = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], group=C, kernel_shape=[R, R], strides=[S, S], dilations=[D, D],
        pads=[pads[0], pads[1], pads[2], pads[3]],
    )  # fmt: skip
    nodes, extra, a = with_act(conv, act)
    inits = {"w": w.astype(np.float32), "b": b.astype(np.float32), **extra}
    want = nhwc(run_onnx(nodes, {"x": nchw(x)}, inits))
    g = DwGeometry(R, S, D, pads)
    assert DW.output_shape(N, H, W, C, 0, g) == want.shape
    wp, bp = DwConvSpec.pack(w, b)
    got = DW.reference(x, wp, bp, g, a)
    assert got.dtype == np.dtype(dtype)
    scale = np.abs(x.astype(np.float64)).max() * np.abs(w.astype(np.float64)).sum(axis=(1, 2, 3)).max() + 1
    assert_close(got, want, dtype, scale)


def test_dwconv_geometry_refuses_what_the_kernel_cannot() -> None:
    with pytest.raises(InputError, match=r"dwconv takes kernels of 1..7 a side; got 8x8"):
        DwGeometry(8)
    with pytest.raises(InputError, match=r"has no output pixel"):
        DwGeometry(5, 1, 2, (0, 0, 0, 0)).output_hw(6, 20)
    with pytest.raises(InputError, match=r"channel multiplier 1 has K = 1\*C: C=8, K=4"):
        DW.output_shape(1, 8, 8, 8, 4)
    with pytest.raises(InputError, match=r"\(K, 1, R, S\)"):
        DwConvSpec.pack(np.zeros((8, 2, 3, 3), np.float32))


def test_dwconv_takes_the_tiled_entries_where_they_apply() -> None:
    """The tiled entries: fp16, dilation 1, stride 1 or 2 both ways, no channel multiplier, C and
    strides multiples of 8; the tall tile where its blocks fill the GPU twice over, else the short
    one's twice as many."""
    unit, g = DwGeometry(7, pads=(3, 3, 3, 3)), DwGeometry(5, 2, pads=(2, 2, 2, 2))
    assert DW.tile_path("float16", unit, 96, 96, 104)
    assert DW.tile_path("float16", DwGeometry(1, pads=(0, 3, 0, 3), S=7), 40, 40)  # 1x7
    assert not DW.tile_path("float16", unit, 16, 16)  # fewer channels than a block's 32
    assert not DW.tile_path("float32", unit, 96, 96)
    assert DW.tile_path("float16", g, 96, 96)  # MobileNet's stride-2 5x5
    assert DW.tile_path("float16", DwGeometry(3, 2, pads=(0, 0, 1, 1)), 96, 96)  # TF-style SAME pads
    assert not DW.tile_path("float16", DwGeometry(3, 3), 96, 96)  # stride 3
    assert not DW.tile_path("float16", DwGeometry(3, 2, stride_w=1), 96, 96)  # stride 2 along H only
    assert not DW.tile_path("float16", DwGeometry(3, 2, 2, (2, 2, 2, 2)), 96, 96)  # stride and dilation 2
    assert not DW.tile_path("float16", DwGeometry(3, dilation=2, pads=(2, 2, 2, 2)), 96, 96)
    assert not DW.tile_path("float16", DwGeometry(3, multiplier=2), 96, 96)
    assert not DW.tile_path("float16", unit, 20, 20) and not DW.tile_path("float16", unit, 96, 100)
    h200 = REFERENCE  # 132 SMs: a full wave of three a SM is 384 blocks
    entry, cfg = DW.tile_choice(8, 128, 128, 96, unit, h200)  # 8 x 8 x 8 tiles x 3 channel blocks
    assert (entry, cfg.grid, cfg.block, cfg.shared_bytes) == (DW.tile_entry, (512, 3, 1), (128, 1, 1), 22 * 22 * 128)
    entry, cfg = DW.tile_choice(1, 128, 128, 96, unit, h200)  # 192 tall blocks: the short tile's 384
    assert (entry, cfg.grid, cfg.shared_bytes) == (DW.tile_short_entry, (128, 3, 1), 14 * 22 * 128)
    assert DW.tile_launch(1, 5, 3, 264, DwGeometry(3)).grid == (1, 9, 1)  # 264 channels: 9 blocks of 32
    # Stride 2: half the rows (8 tall, 4 short) of a patch twice as wide: ((rows - 1) * 2 + R) x 37.
    stride2 = DwGeometry(7, 2, pads=(3, 3, 3, 3))  # its tall patch holds two a SM: a full wave is 256
    entry, cfg = DW.tile_choice(8, 64, 64, 96, stride2, h200)  # 8 x 8 x 4 tiles x 3 channel blocks
    assert (entry, cfg.grid, cfg.shared_bytes) == (DW.tile_entry, (256, 3, 1), 21 * 37 * 128)
    entry, cfg = DW.tile_choice(4, 28, 28, 96, g, h200)  # 4 x 4 x 2 x 3 = 96 tall blocks of 512 wanted
    assert (entry, cfg.grid, cfg.shared_bytes) == (DW.tile_short_entry, (56, 3, 1), 11 * 35 * 128)
    # With tile3 on, a 3x3 takes the 3x3 entries, at either stride and tile (their own registers: dwconv_nhwc.cu).
    dw3 = dataclasses.replace(DW, tile3=True)
    for geom in (DwGeometry(3), DwGeometry(3, 2, pads=(0, 0, 1, 1))):
        for n, entry in ((8, DW.tile3_entry), (1, DW.tile3_short_entry)):
            got, cfg = dw3.tile_choice(n, 128 // geom.stride, 128 // geom.stride, 96, geom, h200)
            assert got == entry and cfg == DW.tile_launch(
                n, 128 // geom.stride, 128 // geom.stride, 96, geom, short=entry == DW.tile3_short_entry
            )
    # With tile3 off (the default until they run on a GPU), the general entries take a 3x3.
    assert DW.tile_choice(8, 128, 128, 96, DwGeometry(3), h200)[0] == DW.tile_entry
    # The 3x1 and 1x3 bands are not the 3x3's one instance: the general entries take them.
    assert dw3.tile_choice(8, 128, 128, 96, DwGeometry(3, pads=(1, 0, 1, 0), S=1), h200)[0] == DW.tile_entry


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_dwconv_tiles_fit_every_device(device: str) -> None:
    """Every tiled launch tile_choice makes for a kernel of 1..7 a side at stride 1 or 2 fits what a
    block of the device may opt in to, and prepare_inputs takes it (tile_resident > 0); on Hopper the
    stride-2 tall tiles of 3x3, 5x5 and 7x7 leave at least two blocks a SM."""
    dev = DEVICES[device]
    for stride in (1, 2):
        for R in range(1, 8):
            for S in range(1, 8):
                g = DwGeometry(R, stride, pads=(R // 2, S // 2, R // 2, S // 2), S=S)
                assert DW.tile_path("float16", g, 64, 64)
                for n in (1, 64):  # the short tile and (for the larger batch) the tall one
                    _, ho, wo, _ = DW.output_shape(n, 112, 112, 64, 0, g)
                    entry, cfg = dataclasses.replace(DW, tile3=True).tile_choice(n, ho, wo, 64, g, dev)
                    square3 = (R, S) == (3, 3)
                    ours = (DW.tile3_entry, DW.tile3_short_entry) if square3 else (DW.tile_entry, DW.tile_short_entry)
                    assert entry in ours
                    assert cfg.shared_bytes <= dev.shared_per_block and DW.tile_resident(cfg, dev, square3) >= 1
    if dev.cc[0] == 9:
        for R in (3, 5, 7):
            tall = DW.tile_launch(8, 56, 56, 96, DwGeometry(R, 2, pads=(R // 2,) * 4))
            assert DW.tile_resident(tall, dev) >= 2 and 2 * (tall.shared_bytes + 1024) <= dev.shared_per_sm


def test_dwconv_tile_choice_skips_a_tall_tile_the_device_cannot_hold() -> None:
    """A device whose blocks may take less than a tall patch gets the short tile, whatever the grid;
    a patch over the limit has no resident block (prepare_inputs then launches the per-element entry)."""
    small = dataclasses.replace(REFERENCE, shared_per_block=80 * 1024, shared_per_sm=81 * 1024)
    g = DwGeometry(7, 2, pads=(3, 3, 3, 3))
    assert DW.tile_launch(64, 112, 112, 96, g).shared_bytes > small.shared_per_block
    assert DW.tile_resident(DW.tile_launch(64, 112, 112, 96, g), small) == 0
    entry, cfg = DW.tile_choice(64, 112, 112, 96, g, small)
    assert entry == DW.tile_short_entry and DW.tile_resident(cfg, small) == 1


def test_dwconv_takes_the_column_entries_for_3x3s() -> None:
    """The column entries: fp16 3x3, dilation 1, stride 1 or 2 both ways, no channel multiplier, C
    and strides multiples of 8 (any number of channels: a block's vectors follow C), where the spec's
    `cols` is on; they come before the tiles, which keep every other window. The tall entry where its
    blocks fill the GPU twice over."""
    unit, s2 = DwGeometry(3), DwGeometry(3, 2)
    COLS = dataclasses.replace(DW, cols=True)
    assert COLS.cols_path("float16", unit, 8, 8, 16) and COLS.cols_path("float16", s2, 2048, 2048)
    assert COLS.cols_path("float16", DwGeometry(3, pads=(0, 0, 0, 0)), 16, 16)  # valid padding
    assert not COLS.cols_path("float32", unit, 96, 96)
    assert not COLS.cols_path("float16", DwGeometry(5, pads=(2, 2, 2, 2)), 96, 96)  # 5x5: the tiles
    assert not COLS.cols_path("float16", DwGeometry(3, pads=(1, 0, 1, 0), S=1), 96, 96)  # 3x1
    assert not COLS.cols_path("float16", DwGeometry(3, 3), 96, 96)  # stride 3
    assert not COLS.cols_path("float16", DwGeometry(3, 2, stride_w=1), 96, 96)
    assert not COLS.cols_path("float16", DwGeometry(3, dilation=2, pads=(2, 2, 2, 2)), 96, 96)
    assert not COLS.cols_path("float16", DwGeometry(3, multiplier=2), 96, 96)
    assert not COLS.cols_path("float16", unit, 20, 20) and not COLS.cols_path("float16", unit, 96, 100)
    assert not DW.cols_path("float16", unit, 96, 96)  # off by default: not yet run on a GPU
    h200 = REFERENCE  # 132 SMs: two full waves of two a SM are 512 blocks
    # SegFormer-b2's first Mix-FFN 3x3 at batch 8: 32 vectors, one block of 8 columns a pixel row strip.
    entry, cfg = DW.cols_choice(8, 128, 128, 256, unit, h200)
    assert (entry, cfg.grid, cfg.block) == (DW.cols_entry, (8 * 16 * 16, 1, 1), (32, 8, 1))
    # Its last stage at batch 1: 16x16 pixels, 256 vectors in 8 blocks; 2 x 2 tall blocks each is too few.
    entry, cfg = DW.cols_choice(1, 16, 16, 2048, unit, h200)
    assert (entry, cfg.grid, cfg.block) == (DW.cols_short_entry, (8 * 2, 8, 1), (32, 8, 1))
    # 65 vectors: three blocks of 22 (the last one 21 live), 11 columns each; stride 2 halves the rows.
    assert DW.cols_launch(2, 10, 30, 520, s2).grid == (2 * 3 * 3, 3, 1)
    assert DW.cols_launch(2, 10, 30, 520, s2).block == (22, 11, 1)
    assert DW.cols_launch(1, 3, 5, 16, unit).block == (2, 5, 1)  # no more columns than the image has


def cols_cover(cfg, N: int, Ho: int, Wo: int, C: int, rows: int) -> np.ndarray:
    """How many times the column kernel's index math (dwconv_nhwc.cu's dwconv_cols) writes each
    (n, ho, wo, channel vector) of an output under ``cfg``, thread by thread."""
    hits = np.zeros((N, Ho, Wo, C // 8), np.int64)
    vectors, cols = cfg.block[0], cfg.block[1]
    tiles_w, tiles_h = cdiv(Wo, cols), cdiv(Ho, rows)
    for bx in range(cfg.grid[0]):
        for by in range(cfg.grid[1]):
            t = bx
            w0 = (t % tiles_w) * cols
            t //= tiles_w
            ho0, n = (t % tiles_h) * rows, t // tiles_h
            for ty in range(cols):
                for tx in range(vectors):
                    k, wo = (by * vectors + tx) * 8, w0 + ty
                    if k >= C or wo >= Wo:
                        continue
                    for b in range(rows):
                        if ho0 + b < Ho:
                            hits[n, ho0 + b, wo, k // 8] += 1
    return hits


@pytest.mark.parametrize(
    ("N", "H", "W", "C", "stride"), [(2, 37, 23, 40, 1), (1, 6, 7, 520, 2), (3, 2, 1, 16, 1), (1, 33, 31, 2048, 2)]
)
def test_dwconv_column_launches_write_every_output_once(N: int, H: int, W: int, C: int, stride: int) -> None:
    g = DwGeometry(3, stride)
    _, Ho, Wo, _ = DW.output_shape(N, H, W, C, 0, g)
    for short in (False, True):
        cfg = DW.cols_launch(N, Ho, Wo, C, g, short)
        assert cfg.block[0] * cfg.block[1] <= DW.cols_threads
        assert (cols_cover(cfg, N, Ho, Wo, C, DW.cols_rows(stride, short)) == 1).all()


def fma32(x: np.ndarray, w: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """fmaf as the kernels do it, to the rounding: the float32 product is exact in float64."""
    return (x.astype(np.float64) * w.astype(np.float64) + acc).astype(np.float32)


def emulate_dwconv_tile(x: np.ndarray, wp: np.ndarray, bp: np.ndarray, g: DwGeometry, short: bool) -> np.ndarray:
    """dwconv_nhwc.cu's dwconv_tile in numpy, block by block over tile_launch's grid: the patch
    ((rows - 1) * stride + R) x ((tile_w - 1) * stride + S) pixels from its origin (zeros outside the
    image and past C), then each output's taps in r, s order from patch pixel (row * stride + r,
    col * stride + s), an out-of-image tap adding 0 * w. Outputs no block writes stay NaN."""
    N, H, W, C = x.shape
    _, Ho, Wo, _ = DW.output_shape(N, H, W, C, 0, g)
    cfg = DW.tile_launch(N, Ho, Wo, C, g, short)
    TH, TW, TC, sd, R, S = DW.tile_rows(g.stride, short), DW.tile_w, DW.tile_c, g.stride, g.R, g.width
    IH, IW = (TH - 1) * sd + R, (TW - 1) * sd + S
    assert cfg.shared_bytes == IH * IW * TC * 4 and cfg.grid[1] == cdiv(C, TC)
    y = np.full((N, Ho, Wo, C), np.nan, np.float32)
    tiles_w, tiles_h = cdiv(Wo, TW), cdiv(Ho, TH)
    for blk in range(cfg.grid[0]):
        wo0, ho0, n = (blk % tiles_w) * TW, (blk // tiles_w % tiles_h) * TH, blk // tiles_w // tiles_h
        hs, ws = ho0 * sd - g.pads[0] + np.arange(IH), wo0 * sd - g.pads[1] + np.arange(IW)
        inside = ((hs >= 0) & (hs < H))[:, None] & ((ws >= 0) & (ws < W))[None, :]
        rows, cols = min(TH, Ho - ho0), min(TW, Wo - wo0)  # the strips the kernel skips past the image
        for c0 in range(0, cfg.grid[1] * TC, TC):
            k = slice(c0, min(C, c0 + TC))
            patch = np.zeros((IH, IW, TC), np.float32)
            patch[inside, : k.stop - c0] = x[n, hs.clip(0, H - 1)][:, ws.clip(0, W - 1)][inside, k]
            acc = np.broadcast_to(bp[k], (rows, cols, k.stop - c0)).astype(np.float32)
            for r in range(R):
                for s_ in range(S):
                    tap = patch[r : r + sd * (rows - 1) + 1 : sd, s_ : s_ + sd * (cols - 1) + 1 : sd, : k.stop - c0]
                    acc = fma32(tap, wp[r, s_, k], acc)
            y[n, ho0 : ho0 + rows, wo0 : wo0 + cols, k] = acc
    return y


def emulate_dwconv_element(x: np.ndarray, wp: np.ndarray, bp: np.ndarray, g: DwGeometry) -> np.ndarray:
    """The per-element path's chain (dwconv in dwconv_nhwc.cu): bias, then the in-image taps in r, s order."""
    N, H, W, C = x.shape
    _, Ho, Wo, _ = DW.output_shape(N, H, W, C, 0, g)
    acc = np.broadcast_to(bp, (N, Ho, Wo, C)).astype(np.float32)
    for r in range(g.R):
        for s_ in range(g.width):
            h = np.arange(Ho) * g.stride - g.pads[0] + r
            w = np.arange(Wo) * g.stride - g.pads[1] + s_
            inside = ((h >= 0) & (h < H))[:, None] & ((w >= 0) & (w < W))[None, :]
            tap = x[:, h.clip(0, H - 1)][:, :, w.clip(0, W - 1)].astype(np.float32)
            acc = np.where(inside[None, :, :, None], fma32(tap, wp[r, s_], acc), acc)
    return acc


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "g"),
    [
        (2, 23, 37, 40, DwGeometry(3, 2)),  # odd sizes, tiles cut by both edges, C not a multiple of 32
        (1, 34, 33, 32, DwGeometry(5, 2, pads=(2, 2, 2, 2))),
        (1, 19, 21, 72, DwGeometry(7, 2, pads=(3, 3, 3, 3))),
        (1, 16, 18, 40, DwGeometry(3, 2, pads=(0, 0, 1, 1))),  # TF-style SAME: the padding below and right
        (2, 9, 8, 32, DwGeometry(3, 2, pads=(0, 1, 0, 1), S=5)),  # 3x5, the general loop
        (1, 12, 12, 48, DwGeometry(7, pads=(3, 3, 3, 3))),  # stride 1, as before
    ],
)
def test_dwconv_tile_emulation_matches_the_per_element_chain(short, n, h, w, c, g) -> None:
    """The tiled path's geometry (tile_launch's grid and patch, tile_rows, the stride-2 taps) in a
    numpy emulation: every output written, equal to the per-element chain up to the sign of a zero,
    and within fp32 rounding of the reference."""
    rng = np.random.default_rng()
    x = rng.standard_normal((n, h, w, c)).astype(np.float16)
    wp, _ = DwConvSpec.pack((rng.standard_normal((c, 1, g.R, g.width)) / g.R).astype(np.float16))
    bias = rng.standard_normal(c).astype(np.float32)
    got = emulate_dwconv_tile(x, wp, bias, g, short)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(np.abs(got), np.abs(emulate_dwconv_element(x, wp, bias, g)))
    want = DW.reference(x.astype(np.float32), wp.astype(np.float32), bias, g)
    assert_close(
        got, want, "float32", np.abs(x.astype(np.float64)).max() * np.abs(wp.astype(np.float64)).sum(axis=(0, 1)).max()
    )


def test_dwconv_args_follow_the_abi() -> None:
    g = DwGeometry(5, 2, 1, (2, 1, 2, 2))
    args = DW.args(
        x=0x10, w=0x20, y=0x30, N=2, H=9, W=7, C=5, geometry=g, ldx=8, ldy=6, act=Activation.named("clip", -1, 2)
    )
    assert [v for v, _ in args] == [
        0x10, 0x20, 0, 0x30, 2, 9, 7, 5, 5, 3, 8, 6, 5, 5, 2, 2, 1, 1, 2, 1, 1, 2, -1.0, 2.0,
    ]  # fmt: skip
    assert [t for _, t in args] == [ctypes.c_void_p] * 4 + [ctypes.c_int32] * 18 + [ctypes.c_float] * 2
    assert len(args) == len(DW.PARAMS)
    cfg = DW.launch("float16", 2, 9, 7, 5, 0, g)
    assert cfg.block == (DW.block_threads, 1, 1) and cfg.grid[0] * cfg.block[0] >= 2 * 5 * 3 * 5


# --- gap ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("N", "H", "W", "C"), [(2, 9, 7, 5), (1, 33, 31, 72), (3, 1, 1, 40)])
@pytest.mark.parametrize("op", ["GlobalAveragePool", *REDUCE_OPS])
def test_gap_reference_matches_onnxruntime(dtype, N, H, W, C, op) -> None:
    """Every reduction of the table over H, W (and GlobalAveragePool, the mean) against onnxruntime's
    Reduce op. fp16: onnxruntime sums in fp16, the reference in fp32 with one rounding (assert_close's
    fp16 tolerance, scaled by the largest |sum term|); max and min exact."""
    x = np.random.default_rng().standard_normal((N, H, W, C)).astype(dtype)
    if op == "GlobalAveragePool":
        want = nhwc(run_onnx([helper.make_node(op, ["x"], ["y"])], {"x": nchw(x)}, {}))
    else:  # opset 18: every Reduce op takes its axes as an input
        node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)
        want = nhwc(run_onnx([node], {"x": nchw(x)}, {"axes": np.array([2, 3], np.int64)}, opset=18))
    got = GAP.reference(x, op=REDUCE_OPS.get(op, REDUCE_OPS["ReduceMean"]))
    assert got.shape == GAP.output_shape(N, H, W, C) == want.shape
    if op in ("ReduceMax", "ReduceMin"):
        np.testing.assert_array_equal(got, want)
        return
    terms = x.astype(np.float64) ** 2 if op in ("ReduceL2", "ReduceSumSquare") else x.astype(np.float64)
    scale = (
        np.abs(terms).sum(axis=(1, 2)).max() if op != "ReduceMean" and op != "GlobalAveragePool" else np.abs(x).max()
    )
    assert_close(got, want, dtype, float(np.sqrt(scale) if op == "ReduceL2" else scale))


def test_gap_refuses_an_op_outside_the_table() -> None:
    with pytest.raises(InputError, match=r"gap op 9: not one of"):
        GAP.args(x=1, y=2, N=3, H=4, W=5, C=70, ldy=72, op=9)
    with pytest.raises(InputError, match=r"gap op 7: not one of"):
        GAP.reference(np.zeros((1, 2, 2, 3), np.float32), op=7)


def test_gap_args_and_launch() -> None:
    args = GAP.args(x=1, y=2, N=3, H=4, W=5, C=70, ldy=72)
    assert [v for v, _ in args] == [1, 2, 3, 4, 5, 70, 70, 72, REDUCE_OPS["ReduceMean"]]
    cfg = GAP.launch("float32", 3, 4, 5, 70)
    assert cfg.grid == (3, 3, 1) and cfg.block == (GAP.block_threads, 1, 1)


# --- fc ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("N", "C", "K", "act"), [(2, 72, 24, "relu"), (3, 24, 72, "hardsigmoid"), (1, 960, 240, "relu"), (2, 5, 3, None)]
)
def test_fc_reference_matches_onnxruntime(dtype, N, C, K, act) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((N, 1, 1, C)).astype(dtype)
    w = (rng.standard_normal((K, C, 1, 1)) / np.sqrt(C)).astype(dtype)
    b = rng.standard_normal(K).astype(dtype)
    nodes, extra, a = with_act(helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[1, 1]), act)
    want = nhwc(run_onnx(nodes, {"x": nchw(x)}, {"w": w.astype(np.float32), "b": b.astype(np.float32), **extra}))
    got = FC.reference(x, w, b.astype(np.float32), a)
    assert got.shape == FC.output_shape(N, 1, 1, C, K) == want.shape
    assert_close(got, want, dtype, np.abs(x.astype(np.float64)).max() * np.abs(w.astype(np.float64)).sum(1).max())


def test_fc_takes_only_a_pooled_vector() -> None:
    with pytest.raises(InputError, match=r"fc takes a pooled \(N, 1, 1, C\) vector; got an 4x4 image"):
        FC.output_shape(1, 4, 4, 8, 8)
    args = FC.args(x=1, w=2, y=3, N=2, C=960, K=240, act=Activation.named("hardsigmoid", 0.2, 0.5))
    assert [v for v, _ in args][4:] == [2, 960, 240, 960, 240, ACTIVATIONS["hardsigmoid"], pytest.approx(0.2), 0.5]
    assert FC.launch("float16", 2, 1, 1, 960, 240).grid == (2 * 240 // (FC.block_threads // 32), 1, 1)


# --- eltwise -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("act", [*ACT_NODES, "clip", "hardsigmoid_default"])
def test_eltwise_activations_match_onnxruntime(dtype, act) -> None:
    x = (3 * np.random.default_rng().standard_normal((2, 7, 5, 9))).astype(dtype)
    if act == "clip":
        node, inits, a = (
            helper.make_node("Clip", ["x", "lo", "hi"], ["y"]),
            {"lo": np.array(-1.5, np.float32), "hi": np.array(0.25, np.float32)},
            Activation.named("clip", -1.5, 0.25),
        )
    elif act == "hardsigmoid_default":  # ONNX's defaults alpha 0.2, beta 0.5 (Keras exports)
        node, inits, a = helper.make_node("HardSigmoid", ["x"], ["y"]), {}, Activation.named("hardsigmoid", 0.2, 0.5)
    else:
        make, a = ACT_NODES[act]
        node = make()
        node.input[0] = "x"
        inits = CLIP_BOUNDS if act == "relu6" else {}
    want = nhwc(run_onnx([node], {"x": nchw(x)}, inits))
    got = ELT.reference(x, None, "unary", a)
    assert_close(got, want, dtype, 0.1)  # 1e-6 absolute: onnxruntime vectorises Sigmoid, HardSwish (about 1e-7 off)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("op", "gate"), [("Add", False), ("Mul", False), ("Mul", True), ("Add", True)])
def test_eltwise_binary_matches_onnxruntime(dtype, op, gate) -> None:
    rng = np.random.default_rng()
    a = rng.standard_normal((2, 9, 7, 13)).astype(dtype)
    b = rng.standard_normal((2, 1, 1, 13) if gate else a.shape).astype(dtype)
    want = nhwc(run_onnx([helper.make_node(op, ["a", "b"], ["y"])], {"a": nchw(a), "b": nchw(b)}, {}))
    got = ELT.reference(a, b, op.lower())
    assert_close(got, want, dtype, 0.1)
    # fused activation after the op
    nodes, extra, act = with_act(helper.make_node(op, ["a", "b"], ["y"]), "hardswish")
    want = nhwc(run_onnx(nodes, {"a": nchw(a), "b": nchw(b)}, extra))
    assert_close(ELT.reference(a, b, op.lower(), act), want, dtype, 0.1)


def test_eltwise_args_and_refusals() -> None:
    args = ELT.args(a=1, b=2, y=3, N=2, H=3, W=4, C=5, op="mul", bcast=True, ldb=8, act=Activation.named("relu"))
    assert [v for v, _ in args] == [1, 2, 3, 2, 3, 4, 5, 5, 8, 5, 2, 1, 1, 0.0, 0.0]
    unary = ELT.args(a=1, y=3, N=1, H=1, W=1, C=1)
    assert [v for v, _ in unary][1] == 0 and [v for v, _ in unary][10:12] == [0, 0]
    gate = ELT.args(a=1, b=2, y=3, N=2, H=3, W=4, C=5, op="mul", bcast=3, ldb=1)  # an (N,H,W,1) map: ldb >= 1
    assert [v for v, _ in gate][8] == 1 and [v for v, _ in gate][11] == 3
    with pytest.raises(InputError, match=r"ldb=4 is smaller than the 5 channels"):
        ELT.args(a=1, b=2, y=3, N=2, H=3, W=4, C=5, op="mul", bcast=1, ldb=4)
    with pytest.raises(InputError, match=r"b is a null device pointer"):
        ELT.args(a=1, y=3, N=1, H=1, W=1, C=1, op="add")
    with pytest.raises(InputError, match=r"eltwise op 'pow' is not one of unary, add, mul, sub"):
        ELT.args(a=1, b=2, y=3, N=1, H=1, W=1, C=1, op="pow")
    with pytest.raises(InputError, match=r"takes b of a's shape"):
        ELT.reference(np.ones((1, 2, 2, 3), np.float32), np.ones((1, 2, 1, 3), np.float32), "add")


# --- resize ------------------------------------------------------------------------------------------

RESIZE_CASES = [  # (mode, coord, nearest, H, W, scales or None, sizes or None)
    ("linear", "half_pixel", "floor", 7, 5, (2.0, 2.0), None),  # torch bilinear, align_corners=False
    ("linear", "half_pixel", "floor", 9, 11, None, (64, 40)),  # LR-ASPP's head: to a given size
    ("linear", "pytorch_half_pixel", "floor", 6, 1, (1.5, 3.0), None),  # a 1-wide image
    ("linear", "pytorch_half_pixel", "floor", 9, 8, None, (1, 3)),  # to 1 row: coordinate 0
    ("linear", "align_corners", "floor", 7, 5, None, (13, 17)),  # torch align_corners=True
    ("linear", "align_corners", "floor", 8, 8, (0.5, 0.75), None),  # downsampling
    ("linear", "asymmetric", "floor", 5, 7, (2.5, 1.7), None),  # fractional scales, floor(in*scale) sizes
    ("linear", "half_pixel", "floor", 16, 12, (0.37, 0.5), None),
    ("nearest", "asymmetric", "floor", 7, 5, (2.0, 3.0), None),  # torch nearest
    ("nearest", "asymmetric", "floor", 9, 10, None, (20, 7)),
    ("nearest", "half_pixel", "round_prefer_floor", 7, 6, (2.0, 1.5), None),  # ONNX's default nearest
    ("nearest", "half_pixel", "round_prefer_ceil", 5, 5, None, (11, 9)),
    ("nearest", "align_corners", "ceil", 6, 9, None, (13, 4)),
    ("nearest", "pytorch_half_pixel", "floor", 8, 7, (0.5, 2.6), None),
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("mode", "coord", "nearest", "H", "W", "scales", "sizes"), RESIZE_CASES)
def test_resize_reference_matches_onnxruntime(dtype, mode, coord, nearest, H, W, scales, sizes) -> None:
    N, C = 2, 3
    x = np.random.default_rng().standard_normal((N, H, W, C)).astype(dtype)
    inits = {"roi": np.zeros(0, np.float32)}
    if scales is not None:
        inits["scales"] = np.array([1, 1, *scales], np.float32)
        ins = ["x", "roi", "scales"]
    else:
        inits["scales"] = np.zeros(0, np.float32)
        inits["sizes"] = np.array([N, C, *sizes], np.int64)
        ins = ["x", "roi", "scales", "sizes"]
    node = helper.make_node("Resize", ins, ["y"], mode=mode, coordinate_transformation_mode=coord, nearest_mode=nearest)
    want = nhwc(run_onnx([node], {"x": nchw(x)}, inits))
    _, Ho, Wo, _ = want.shape
    if scales is not None:
        sh, sw = (float(np.float32(s)) for s in scales)
    else:
        sh, sw = (float(np.float32(o) / np.float32(i)) for o, i in ((Ho, H), (Wo, W)))
    how = ResizeMode(mode, coord, nearest, sh, sw)
    got = RESIZE.reference(x, Ho, Wo, how)
    if mode == "nearest":  # a copy: exactly onnxruntime's pick
        np.testing.assert_array_equal(got, want.astype(dtype))
    else:
        assert_close(got, want, dtype, np.abs(x.astype(np.float64)).max())


def test_resize_mode_round_trips_through_call_attrs() -> None:
    how = ResizeMode("nearest", "align_corners", "round_prefer_ceil", 2.5, 0.3)
    call = KernelCall("resize", ("x",), ("y",), (), (*how.attrs(), ("Ho", 5), ("Wo", 3)))
    back = ResizeMode.of(call)
    assert back.mode == how.mode and back.coord == how.coord and back.nearest == how.nearest
    assert back.scale_h == 2.5 and back.scale_w == float(np.float32(0.3))
    with pytest.raises(InputError, match=r"resize takes nearest, linear; got 'cubic'"):
        ResizeMode("cubic")
    args = RESIZE.args(x=1, y=2, N=1, H=2, W=3, C=4, Ho=5, Wo=3, how=how)
    assert [t for _, t in args][-2:] == [ctypes.c_float] * 2 and len(args) == len(RESIZE.PARAMS)


def test_float_attrs_keep_the_exported_float32() -> None:
    for v in (1 / 6, 0.2, -np.inf, 6.0, 1e-30):
        assert bits_f32(f32_bits(v)) == float(np.float32(v))
