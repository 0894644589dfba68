"""The kernel registry on the CPU: numpy references against independent float64 code, launch
geometry, and the cuLaunchKernel argument lists of the ABI (handwritten_ptx/README.md)."""

from __future__ import annotations

import ctypes
import math
import re

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from dualtrack.compiler.kernel_build import SOURCE_DIR
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import (
    KERNELS,
    SMALL_C_K_MAX,
    SMALL_C_MAX,
    Conv3x3Spec,
    ConvT2x2Spec,
    MaxPool2x2Spec,
    conv_choice,
    kernel,
    output_shape,
    pack_conv_weights,
    pack_convt_weights,
)
from dualtrack.kernels.device import REFERENCE
from dualtrack.kernels.problems import ConvProblem
from dualtrack.runtime.driver import kernel_params
from dualtrack.runtime.tensors import GpuTensor

CONV = KERNELS["conv3x3"]
POOL = KERNELS["maxpool2x2"]
CONVT = KERNELS["convt2x2"]
DTYPES = ("float16", "float32")


def conv_loops(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, relu: bool) -> np.ndarray:
    """float64 conv by explicit loops over output pixels and taps, bounds-checked (no padding)."""
    N, H, W, _ = x.shape
    K = w.shape[0]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    out = np.zeros((N, H, W, K))
    for n in range(N):
        for h in range(H):
            for v in range(W):
                acc = np.zeros(K) if bias is None else bias.astype(np.float64).copy()
                for r in range(3):
                    for s in range(3):
                        hh, vv = h + r - 1, v + s - 1
                        if 0 <= hh < H and 0 <= vv < W:
                            acc += w64[:, r, s, :] @ x64[n, hh, vv, :]
                out[n, h, v] = np.maximum(acc, 0.0) if relu else acc
    return out


def conv_im2col(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, relu: bool) -> np.ndarray:
    """float64 conv as one einsum over 3x3 windows of the zero-padded input."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    windows = sliding_window_view(xp, (3, 3), axis=(1, 2))  # (N, H, W, C, 3, 3)
    out = np.einsum("nhwcrs,krsc->nhwk", windows, w.astype(np.float64))
    if bias is not None:
        out = out + bias
    return np.maximum(out, 0.0) if relu else out


def conv_bound(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, dtype: str) -> np.ndarray:
    """Error allowed to the reference: float32 accumulation, 1e-5 of the sum of |terms|, plus, for
    float16, one rounding to nearest (2^-11 relative, 2^-24 absolute for subnormals)."""
    magnitude = conv_im2col(np.abs(x), np.abs(w), None if bias is None else np.abs(bias), relu=False)
    bound = 1e-5 * magnitude + 1e-30
    if dtype == "float16":
        exact = conv_im2col(x, w, bias, relu=False)
        bound += 2.0**-11 * np.abs(exact) + 2.0**-24
    return bound


def random_conv(rng: np.random.Generator, dtype: str, N: int, H: int, W: int, C: int, K: int, bias: bool = True):
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = (rng.standard_normal((K, 3, 3, C)) / math.sqrt(9 * C)).astype(dtype)
    b = rng.standard_normal(K).astype(np.float32) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("N", "H", "W", "C", "K", "relu", "bias"),
    [
        (2, 5, 7, 3, 5, True, True),
        (1, 1, 1, 4, 2, False, True),
        (2, 6, 4, 9, 3, True, False),
        (1, 37, 37, 3, 5, True, True),
    ],
)
def test_conv_reference_matches_float64_loops(
    dtype: str, N: int, H: int, W: int, C: int, K: int, relu: bool, bias: bool
) -> None:
    rng = np.random.default_rng()
    x, w, b = random_conv(rng, dtype, N, H, W, C, K, bias)
    ref = CONV.reference(x, w, b, relu)
    assert ref.dtype == np.dtype(dtype) and ref.shape == output_shape("conv3x3", N, H, W, C, K)
    exact = conv_loops(x, w, b, relu)
    err = np.abs(ref.astype(np.float64) - exact)
    assert (err <= conv_bound(x, w, b, dtype)).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_reference_matches_float64_im2col(dtype: str) -> None:
    rng = np.random.default_rng()
    x, w, b = random_conv(rng, dtype, 2, 16, 13, 32, 40)
    ref = CONV.reference(x, w, b, relu=True)
    err = np.abs(ref.astype(np.float64) - conv_im2col(x, w, b, relu=True))
    assert (err <= conv_bound(x, w, b, dtype)).all(), f"max error {err.max():.3g}"
    # the two float64 implementations agree with each other to rounding
    np.testing.assert_allclose(
        conv_im2col(x[:1, :5], w, b, True), conv_loops(x[:1, :5], w, b, True), rtol=1e-12, atol=1e-12
    )


def test_conv_reference_rejects_bad_shapes() -> None:
    x = np.zeros((1, 4, 4, 3), np.float32)
    with pytest.raises(InputError, match="w \\(K,3,3,C\\)"):
        CONV.reference(x, np.zeros((2, 3, 3, 4), np.float32))
    with pytest.raises(InputError, match="bias"):
        CONV.reference(x, np.zeros((2, 3, 3, 3), np.float32), np.zeros(3, np.float32))


def pool_loops(x: np.ndarray) -> np.ndarray:
    N, H, W, C = x.shape
    out = np.empty((N, H // 2, W // 2, C), np.float64)
    for n in range(N):
        for h in range(H // 2):
            for v in range(W // 2):
                for c in range(C):
                    taps = [float(x[n, 2 * h + dh, 2 * v + dv, c]) for dh in (0, 1) for dv in (0, 1)]
                    out[n, h, v, c] = math.nan if any(math.isnan(t) for t in taps) else max(taps)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "H", "W", "C"), [(2, 6, 8, 3), (1, 7, 5, 16), (3, 2, 3, 1)])
def test_maxpool_reference_matches_loops(dtype: str, N: int, H: int, W: int, C: int) -> None:
    x = np.random.default_rng().standard_normal((N, H, W, C)).astype(dtype)
    x.flat[0] = np.nan  # NaN propagates, as in the kernels (max.NaN)
    ref = POOL.reference(x)
    assert ref.dtype == np.dtype(dtype) and ref.shape == output_shape("maxpool2x2", N, H, W, C)
    np.testing.assert_array_equal(ref.astype(np.float64), pool_loops(x))  # max is exact


LAUNCH_SHAPES = [
    (2, 37, 37, 3, 5),
    (1, 1, 1, 1, 1),
    (3, 23, 19, 48, 72),
    (1, 13, 17, 16, 24),
    (8, 512, 512, 32, 32),
    (8, 32, 32, 512, 512),
    (1, 3, 5, 7, 65),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "H", "W", "C", "K"), LAUNCH_SHAPES)
def test_conv_launch_covers_the_output(dtype: str, N: int, H: int, W: int, C: int, K: int) -> None:
    assert isinstance(CONV, Conv3x3Spec)
    cfg = CONV.launch(dtype, N, H, W, C, K)
    bm, bn = CONV.tile(dtype)
    M = N * H * W
    assert cfg.grid[0] * bm >= M and (cfg.grid[0] - 1) * bm < M  # every pixel, no empty block
    assert cfg.grid[1] * bn >= K and (cfg.grid[1] - 1) * bn < K
    assert cfg.grid[2] == 1 and cfg.block == (CONV.threads(dtype), 1, 1) and cfg.shared_bytes == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "H", "W", "C", "K"), LAUNCH_SHAPES)
def test_pool_launch_covers_the_output(dtype: str, N: int, H: int, W: int, C: int, K: int) -> None:
    if H < 2 or W < 2:
        with pytest.raises(InputError, match="H, W >= 2"):
            POOL.launch(dtype, N, H, W, C)
        return
    assert isinstance(POOL, MaxPool2x2Spec)
    cfg = POOL.launch(dtype, N, H, W, C, K)  # K is ignored
    work = N * (H // 2) * (W // 2) * math.ceil(C / POOL.vector(dtype))  # one thread per 16-byte chunk
    threads = cfg.grid[0] * cfg.block[0]
    assert threads >= work and threads - work < cfg.block[0]
    assert POOL.vector("float16") == 8 and POOL.vector("float32") == 4


def test_launch_refuses_too_many_pixels() -> None:
    with pytest.raises(InputError, match="exceed 2\\^31-1"):
        CONV.launch("float16", 64, 8192, 8192, 3, 32)


# -- the small-C entry (conv3x3_nhwc_f16_smallc) -----------------------------------------------------

SMALLC_SHAPES = [  # (N, H, W, C, K): odd sizes, N > 1, every C it takes, K around its thresholds
    (1, 512, 512, 3, 32),
    (8, 512, 512, 3, 32),
    (2, 17, 33, 1, 8),
    (2, 17, 33, 4, 16),
    (3, 1, 1, 2, 4),
    (1, 65, 129, 3, 40),
    (2, 37, 45, 3, 128),
]


def test_small_c_bound_is_one_named_constant() -> None:
    assert isinstance(CONV, Conv3x3Spec)
    assert (SMALL_C_MAX, SMALL_C_K_MAX) == (4, 128)
    defines = CONV.defines()
    assert defines["CONV_F16_SMALLC_CMAX"] == SMALL_C_MAX and defines["CONV_F16_SMALLC_KMAX"] == SMALL_C_K_MAX
    assert defines["CONV_F16_SMALLC"] == ",".join(map(str, CONV.f16_smallc))
    assert CONV.entries[-1] == CONV.smallc_entry == "conv3x3_nhwc_f16_smallc"
    assert CONV.smallc_entry not in CONV.f16_tiles()  # not a GEMM tile: tuning never searches or names it


@pytest.mark.parametrize("C", range(1, SMALL_C_MAX + 1))
@pytest.mark.parametrize("K", [1, 4, 8, 32, 33, SMALL_C_K_MAX])
def test_variant_picks_the_small_c_entry(C: int, K: int) -> None:
    assert isinstance(CONV, Conv3x3Spec)
    for N, H, W in ((1, 512, 512), (8, 512, 512), (2, 17, 33), (1, 1, 1)):
        assert CONV.variant("float16", N, H, W, C, K) == CONV.smallc_entry
    assert CONV.smallc_supported("float16", C, K) is None
    assert CONV.variant("float32", 1, 64, 64, C, K) == "conv3x3_nhwc_f32"


@pytest.mark.parametrize(
    ("dtype", "C", "K", "why"),
    [
        ("float16", SMALL_C_MAX + 1, 32, r"C=5: the small-C entry takes C <= 4"),
        ("float16", 8, 32, r"C=8: the small-C entry takes C <= 4"),
        ("float16", 3, SMALL_C_K_MAX + 1, r"K=129: the small-C entry takes K <= 128"),
        ("float32", 3, 32, r"float32: the small-C entry is fp16 only"),
    ],
)
def test_small_c_entry_refuses_other_shapes(dtype: str, C: int, K: int, why: str) -> None:
    assert isinstance(CONV, Conv3x3Spec)
    assert re.fullmatch(why + r".*", CONV.smallc_supported(dtype, C, K) or "")
    assert CONV.variant(dtype, 2, 17, 33, C, K) != CONV.smallc_entry
    if dtype == "float16":
        with pytest.raises(InputError, match=f"conv3x3_nhwc_f16_smallc cannot run this conv: {why}"):
            CONV.launch(dtype, 2, 17, 33, C, K, entry=CONV.smallc_entry)
    else:
        with pytest.raises(InputError, match="is not the float32 entry"):
            CONV.launch(dtype, 2, 17, 33, C, K, entry=CONV.smallc_entry)


def test_small_c_entry_has_no_gemm_tile() -> None:
    assert isinstance(CONV, Conv3x3Spec)
    assert CONV.threads("float16", CONV.smallc_entry) == CONV.smallc_threads == 256
    with pytest.raises(InputError, match="has no GEMM tile"):
        CONV.tile("float16", CONV.smallc_entry)
    with pytest.raises(InputError, match="'conv3x3_nhwc_f16_smallc' is not an fp16 entry"):
        CONV.entry_tile(CONV.smallc_entry)


@pytest.mark.parametrize(("N", "H", "W", "C", "K"), SMALLC_SHAPES)
def test_small_c_launch_geometry(N: int, H: int, W: int, C: int, K: int) -> None:
    assert isinstance(CONV, Conv3x3Spec)
    rows, cols, threads, _ = CONV.f16_smallc
    assert (rows, cols, threads) == (16, 64, 256)
    cfg = CONV.launch("float16", N, H, W, C, K, entry=CONV.smallc_entry)
    assert cfg.grid == (N * math.ceil(H / 16) * math.ceil(W / 64), 1, 1) and cfg.shared_bytes == 0
    units = 16 * 64 // 8 * math.ceil(K / 8)  # 8-pixel groups x 8-channel groups of a tile
    assert cfg.block == (min(256, units), 1, 1) and cfg.block[0] % 32 == 0
    # The kernel's decode (smallc::conv in conv3x3_nhwc.cu): block b -> (image, row tile, column
    # tile), column tile fastest; thread t takes units t, t + blockDim, ...; unit u -> pixel group
    # u // KG (8 pixels of one tile row), channel group u % KG. Every output is written exactly once.
    tiles_w, tiles_h, kg = math.ceil(W / cols), math.ceil(H / rows), math.ceil(K / 8)
    if N * H * W * K > 2_000_000:
        return  # the geometry above is what matters for the big shapes; enumerating them is slow
    written = np.zeros((N, H, W, K), np.int32)
    for b in range(cfg.grid[0]):
        tw, th, n = b % tiles_w, b // tiles_w % tiles_h, b // tiles_w // tiles_h
        assert n < N
        for t in range(cfg.block[0]):
            for u in range(t, rows * cols // 8 * kg, cfg.block[0]):
                g, cg = divmod(u, kg)
                h, w0 = th * rows + g // (cols // 8), tw * cols + g % (cols // 8) * 8
                if h < H and w0 < W:
                    written[n, h, w0 : w0 + 8, cg * 8 : cg * 8 + 8] += 1
    assert (written == 1).all()


def test_choose_conv3x3_puts_the_small_c_entry_before_tuned_tiles() -> None:
    assert isinstance(CONV, Conv3x3Spec)
    tuned = "conv3x3_nhwc_f16_t64x32x32_w2x2_s4_b4"  # h200.json's enc1/conv1 at N=8, say
    for wgmma_off in (None, "DUALTRACK_WGMMA=0"):
        for C in (1, 3, 4):
            choice = conv_choice(ConvProblem.dense(8, 512, 512, C, 32), REFERENCE, wgmma_off=wgmma_off, tuned=tuned)
            assert (choice.impl, choice.entry) == ("direct", CONV.smallc_entry)
            assert choice.reason.startswith(f"C={C} <= 4: small-C direct conv; tuned f16_t64x32x32_w2x2_s4_b4 not used")
        plain = conv_choice(ConvProblem.dense(1, 512, 512, 3, 32), REFERENCE, wgmma_off=wgmma_off)
        assert (plain.impl, plain.entry) == ("direct", CONV.smallc_entry) and "not used" not in plain.reason
    # Past the bounds, or fp32: the tuned entry, else the heuristic's, as before.
    five = conv_choice(ConvProblem.dense(1, 64, 64, 5, 32), REFERENCE, wgmma_off="off", tuned=tuned)
    assert (five.impl, five.entry) == ("mma.sync", tuned)
    wide = conv_choice(ConvProblem.dense(1, 64, 64, 3, 256), REFERENCE, wgmma_off="off")
    assert (wide.impl, wide.entry) == ("mma.sync", CONV.variant("float16", 1, 64, 64, 3, 256))
    fp32 = conv_choice(ConvProblem.dense(1, 64, 64, 3, 32, "float32"), REFERENCE, wgmma_off=None)
    assert (fp32.impl, fp32.entry) == ("simt", "conv3x3_nhwc_f32")


def test_entries() -> None:
    assert CONV.source == "conv3x3_nhwc" and POOL.source == "maxpool2x2_nhwc"
    assert CONV.entry("float16") == "conv3x3_nhwc_f16"
    assert CONV.entry(np.float32) == "conv3x3_nhwc_f32"
    assert POOL.entry(np.dtype("float16")) == "maxpool2x2_nhwc_f16"
    assert POOL.entries == ("maxpool2x2_nhwc_f16", "maxpool2x2_nhwc_f32")
    with pytest.raises(InputError, match="int8 has no Track A kernel"):
        CONV.entry("int8")
    with pytest.raises(InputError, match="no Track A kernel for op 'softmax'"):
        kernel("softmax")


def test_conv_args_follow_the_abi() -> None:
    args = CONV.args(x=0x1000, w=0x2000, bias=0x3000, y=0x4000, N=2, H=37, W=36, C=3, K=5, ldy=8, relu=True)
    assert [v for v, _ in args] == [0x1000, 0x2000, 0x3000, 0x4000, 2, 37, 36, 3, 5, 3, 8, 1]
    assert [t for _, t in args] == [ctypes.c_void_p] * 4 + [ctypes.c_int32] * 8
    values, types = kernel_params(args)
    assert values[:4] == (0x1000, 0x2000, 0x3000, 0x4000) and types[4] is ctypes.c_int32
    no_bias = CONV.args(x=1, w=2, y=3, N=1, H=1, W=1, C=1, K=1)
    assert [v for v, _ in no_bias][2] == 0 and [v for v, _ in no_bias][-1] == 0
    with pytest.raises(InputError, match="ldx=2 is smaller than the 3 channels"):
        CONV.args(x=1, w=2, y=3, N=1, H=1, W=1, C=3, K=1, ldx=2)
    with pytest.raises(InputError, match="w is a null device pointer"):
        CONV.args(x=1, w=0, y=3, N=1, H=1, W=1, C=3, K=1)


def test_pool_args_follow_the_abi() -> None:
    args = POOL.args(x=0x10, y=0x20, N=1, H=9, W=8, C=40, ldx=72)
    assert [v for v, _ in args] == [0x10, 0x20, 1, 9, 8, 40, 72, 40]
    assert [t for _, t in args] == [ctypes.c_void_p] * 2 + [ctypes.c_int32] * 6


def test_specs_without_a_choice_prepare_the_default_launch() -> None:
    """maxpool2x2, conv1x1 and convt2x2 prepare through KernelSpec.prepare: the entry of x's dtype,
    launch()'s geometry and args() of the call's tensors (channel slices keep their strides)."""
    f16 = np.dtype("float16")
    pool_call = KernelCall("maxpool2x2", ("x",), ("y",), (), (), ("pool",))
    x, y = GpuTensor(0x1000, (2, 9, 8, 40), f16, ld=72), GpuTensor(0x2000, (2, 4, 4, 40), f16, ld=48)
    pool = POOL.prepare(pool_call, x, y, [], ctx=None)
    assert (pool.entry, pool.config, pool.choice) == ("maxpool2x2_nhwc_f16", POOL.launch(f16, 2, 9, 8, 40), None)
    assert pool.args == POOL.args(x=0x1000, y=0x2000, N=2, H=9, W=8, C=40, ldx=72, ldy=48)

    head_call = KernelCall("conv1x1", ("x",), ("y",), ("w", "b"), (("relu", 1),), ("head",))
    x, y = GpuTensor(0x1000, (1, 5, 7, 32), f16, ld=64), GpuTensor(0x2000, (1, 5, 7, 3), f16)
    w, b = GpuTensor(0x3000, (3, 1, 1, 32), f16), GpuTensor(0x4000, (3,), np.dtype("float32"))
    head = CONV1.prepare(head_call, x, y, [w, b], ctx=None)
    assert (head.entry, head.config) == ("conv1x1_nhwc_f16", CONV1.launch(f16, 1, 5, 7, 32, 3))
    expected = CONV1.args(x=0x1000, w=0x3000, bias=0x4000, y=0x2000, N=1, H=5, W=7, C=32, K=3, ldx=64, relu=True)
    assert head.args == expected

    up_call = KernelCall("convt2x2", ("x",), ("y",), ("w",), (), ("up",))
    x, y = GpuTensor(0x1000, (1, 4, 4, 16), f16), GpuTensor(0x2000, (1, 8, 8, 8), f16, ld=24)
    up = CONVT.prepare(up_call, x, y, [GpuTensor(0x3000, (32, 16), f16)], ctx=None)
    assert (up.entry, up.config) == ("convt2x2_nhwc_f16", CONVT.launch(f16, 1, 4, 4, 16, 8))
    assert up.args == CONVT.args(x=0x1000, w=0x3000, y=0x2000, N=1, H=4, W=4, C=16, K=8, ldy=24)


def test_readme_documents_the_registered_abi() -> None:
    readme = (SOURCE_DIR / "README.md").read_text()
    for spec in KERNELS.values():
        for entry in spec.entries:
            assert f"`{entry}`" in readme
        assert f"`{', '.join(spec.PARAMS)}`" in readme


def test_pack_conv_weights_matches_onnx_semantics() -> None:
    rng = np.random.default_rng()
    w_oihw = rng.standard_normal((5, 3, 3, 3)).astype(np.float16)
    b = rng.standard_normal(5).astype(np.float16)
    w, bias = pack_conv_weights(w_oihw, b)
    assert w.shape == (5, 3, 3, 3) and w.dtype == np.float16 and w.flags.c_contiguous
    assert bias is not None and bias.dtype == np.float32
    assert w[4, 2, 0, 1] == w_oihw[4, 1, 2, 0]  # w[k, r, s, c] = w_onnx[k, c, r, s]
    # the reference on packed weights is the ONNX cross-correlation
    x = rng.standard_normal((1, 6, 5, 3)).astype(np.float32)
    expected = conv_loops(x, w.astype(np.float32), b.astype(np.float32), relu=False)
    got = CONV.reference(x, w.astype(np.float32), bias)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    assert pack_conv_weights(w_oihw)[1] is None
    with pytest.raises(InputError, match="\\(K, C, 3, 3\\) or \\(K, C, 1, 1\\)"):
        pack_conv_weights(np.zeros((5, 3, 2, 2), np.float16))


# --- convt2x2: ONNX ConvTranspose, kernel 2x2, stride 2, no padding, group 1 -------------------


def convt_loops(x: np.ndarray, w_onnx: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """float64 ConvTranspose straight from the ONNX definition, on the UNPACKED (C, K, 2, 2)
    weights: every input pixel scatters x[n,h,w,:] @ W[:, :, i, j] to output pixel (2h+i, 2w+j)."""
    N, H, W, _ = x.shape
    K = w_onnx.shape[1]
    x64, w64 = x.astype(np.float64), w_onnx.astype(np.float64)
    out = np.zeros((N, 2 * H, 2 * W, K))
    for n in range(N):
        for h in range(H):
            for v in range(W):
                for i in range(2):
                    for j in range(2):
                        out[n, 2 * h + i, 2 * v + j] += x64[n, h, v] @ w64[:, :, i, j]
    if bias is not None:
        out += bias.astype(np.float64)
    return out


def convt_bound(x: np.ndarray, w_onnx: np.ndarray, bias: np.ndarray | None, dtype: str) -> np.ndarray:
    """As conv_bound: float32 accumulation (1e-5 of the sum of |terms|) plus, for float16, one
    rounding to nearest."""
    magnitude = convt_loops(np.abs(x), np.abs(w_onnx), None if bias is None else np.abs(bias))
    bound = 1e-5 * magnitude + 1e-30
    if dtype == "float16":
        bound += 2.0**-11 * np.abs(convt_loops(x, w_onnx, bias)) + 2.0**-24
    return bound


def random_convt(rng: np.random.Generator, dtype: str, N: int, H: int, W: int, C: int, K: int, bias: bool = True):
    """x (N,H,W,C), ONNX weights (C,K,2,2) in ``dtype``, an fp16-representable bias or None."""
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = (rng.standard_normal((C, K, 2, 2)) / math.sqrt(C)).astype(dtype)
    b = rng.standard_normal(K).astype(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("N", "H", "W", "C", "K", "bias"),
    [
        (2, 7, 5, 3, 5, True),
        (1, 1, 1, 1, 1, True),
        (2, 3, 4, 16, 8, False),
        (1, 6, 9, 40, 72, True),
    ],
)
def test_convt_reference_matches_float64_loops(dtype: str, N: int, H: int, W: int, C: int, K: int, bias: bool) -> None:
    rng = np.random.default_rng()
    x, w, b = random_convt(rng, dtype, N, H, W, C, K, bias)
    wp, bp = pack_convt_weights(w, b)
    ref = CONVT.reference(x, wp, bp)
    assert ref.dtype == np.dtype(dtype) and ref.shape == output_shape("convt2x2", N, H, W, C, K) == (N, 2 * H, 2 * W, K)
    exact = convt_loops(x, w, b)
    err = np.abs(ref.astype(np.float64) - exact)
    assert (err <= convt_bound(x, w, b, dtype)).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize(("N", "H", "W", "C", "K"), [(2, 7, 5, 3, 5), (1, 4, 6, 32, 16)])
def test_convt_reference_matches_onnxruntime(N: int, H: int, W: int, C: int, K: int) -> None:
    """A one-node ONNX ConvTranspose model (NCHW, float32) run by onnxruntime: the ONNX semantics
    themselves, independent of the float64 loops above."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng()
    x, w, b = random_convt(rng, "float32", N, H, W, C, K)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    graph = helper.make_graph(
        [node],
        "convt",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y_nchw,) = sess.run(None, {"x": np.ascontiguousarray(x.transpose(0, 3, 1, 2))})
    want = y_nchw.transpose(0, 2, 3, 1).astype(np.float64)
    assert want.shape == (N, 2 * H, 2 * W, K)
    wp, bp = pack_convt_weights(w, b)
    got = CONVT.reference(x, wp, bp).astype(np.float64)
    bound = 2e-5 * convt_loops(np.abs(x), np.abs(w), np.abs(b)) + 1e-30  # two float32 summations
    assert (np.abs(got - want) <= bound).all()
    assert (np.abs(convt_loops(x, w, b) - want) <= bound).all()


def test_convt_reference_rejects_bad_shapes() -> None:
    x = np.zeros((1, 4, 4, 3), np.float32)
    with pytest.raises(InputError, match="needs packed weights"):
        CONVT.reference(x)
    with pytest.raises(InputError, match="packed wp \\(4K,C\\)"):
        CONVT.reference(x, np.zeros((3, 2, 2, 2), np.float32))  # unpacked ONNX weights
    with pytest.raises(InputError, match="packed wp"):
        CONVT.reference(x, np.zeros((6, 3), np.float32))  # rows not a multiple of 4
    with pytest.raises(InputError, match="packed wp"):
        CONVT.reference(x, np.zeros((8, 4), np.float32))  # wrong C
    with pytest.raises(InputError, match="bias"):
        CONVT.reference(x, np.zeros((8, 3), np.float32), np.zeros(3, np.float32))


def test_pack_convt_weights_layout() -> None:
    rng = np.random.default_rng()
    C, K = 3, 5
    w_onnx = rng.standard_normal((C, K, 2, 2)).astype(np.float16)
    b = rng.standard_normal(K).astype(np.float16)
    wp, bias = pack_convt_weights(w_onnx, b)
    assert wp.shape == (4 * K, C) and wp.dtype == np.float16 and wp.flags.c_contiguous
    assert bias is not None and bias.dtype == np.float32 and bias.flags.c_contiguous
    np.testing.assert_array_equal(bias, b.astype(np.float32))
    for i in range(2):
        for j in range(2):
            for k in range(K):
                for c in range(C):
                    assert wp[(i * 2 + j) * K + k, c] == w_onnx[c, k, i, j]
    assert pack_convt_weights(w_onnx)[1] is None
    with pytest.raises(InputError, match="\\(C, K, 2, 2\\)"):
        pack_convt_weights(np.zeros((3, 5, 3, 3), np.float16))
    with pytest.raises(InputError, match="bias"):
        pack_convt_weights(w_onnx, np.zeros(C, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "H", "W", "C", "K"), LAUNCH_SHAPES)
def test_convt_launch_covers_the_output(dtype: str, N: int, H: int, W: int, C: int, K: int) -> None:
    """The 1-D grid, decoded as the kernel does (block_tile: column tile fastest, then pixel tile),
    gives every (pixel tile, tile of the 4K GEMM columns) exactly once."""
    assert isinstance(CONVT, ConvT2x2Spec)
    cfg = CONVT.launch(dtype, N, H, W, C, K)
    bm, bn = CONVT.tile(dtype)
    M = N * H * W
    m_tiles, n_tiles = -(-M // bm), -(-4 * K // bn)
    assert cfg.grid == (m_tiles * n_tiles, 1, 1)
    assert cfg.block == (CONVT.threads(dtype), 1, 1) and cfg.shared_bytes == 0
    tiles = {((b // n_tiles) * bm, (b % n_tiles) * bn) for b in range(cfg.grid[0])}
    assert tiles == {(m * bm, n * bn) for m in range(m_tiles) for n in range(n_tiles)}
    assert len(tiles) == cfg.grid[0]
    assert CONVT.output_shape(N, H, W, C, K) == (N, 2 * H, 2 * W, K)


def test_convt_launch_refuses_bad_sizes() -> None:
    with pytest.raises(InputError, match="exceed 2\\^31-1"):
        CONVT.launch("float16", 64, 8192, 8192, 32, 16)
    with pytest.raises(InputError, match="K=0"):
        CONVT.launch("float32", 1, 2, 2, 3, 0)


def test_convt_entries_and_args_follow_the_abi() -> None:
    assert CONVT.source == "convt2x2_nhwc"
    assert CONVT.entries == ("convt2x2_nhwc_f16", "convt2x2_nhwc_f32")
    args = CONVT.args(x=0x1000, w=0x2000, bias=0x3000, y=0x4000, N=2, H=7, W=5, C=3, K=5, ldy=16)
    assert [v for v, _ in args] == [0x1000, 0x2000, 0x3000, 0x4000, 2, 7, 5, 3, 5, 3, 16]
    assert [t for _, t in args] == [ctypes.c_void_p] * 4 + [ctypes.c_int32] * 7
    no_bias = CONVT.args(x=1, w=2, y=3, N=1, H=1, W=1, C=1, K=1)
    assert [v for v, _ in no_bias][2] == 0
    with pytest.raises(InputError, match="ldy=4 is smaller than the 5 channels"):
        CONVT.args(x=1, w=2, y=3, N=1, H=1, W=1, C=3, K=5, ldy=4)
    with pytest.raises(InputError, match="y is a null device pointer"):
        CONVT.args(x=1, w=2, y=0, N=1, H=1, W=1, C=3, K=1)
    f16 = ("BM", "BN", "BK", "WARPS_M", "WARPS_N", "STAGES")
    f32 = ("BM", "BN", "BK", "TM", "TN")
    assert set(CONVT.defines()) == {f"CONVT_F16_{n}" for n in f16} | {f"CONVT_F32_{n}" for n in f32}


# --- conv1x1: ONNX Conv, kernel 1x1, stride 1, no padding (the segmentation head) ---------------

CONV1 = KERNELS["conv1x1"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("relu", [False, True])
def test_conv1x1_reference_matches_float64(dtype: str, relu: bool) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 5, 7, 12)).astype(dtype)
    w = rng.standard_normal((3, 12, 1, 1)).astype(dtype)
    b = rng.standard_normal(3).astype(dtype)
    wp, bp = pack_conv_weights(w, b)
    assert wp.shape == (3, 1, 1, 12) and bp is not None and bp.dtype == np.float32
    got = CONV1.reference(x, wp, bp, relu)
    exact = np.einsum("nhwc,kc->nhwk", x.astype(np.float64), w[:, :, 0, 0].astype(np.float64)) + b.astype(np.float64)
    if relu:
        exact = np.maximum(exact, 0.0)
    assert got.dtype == np.dtype(dtype) and got.shape == (2, 5, 7, 3)
    # fp32 sums, then one rounding to the output dtype
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w[:, :, 0, 0]).T.astype(np.float64) + np.abs(b)) + (
        np.abs(exact) * np.finfo(dtype).eps
    )
    assert (np.abs(got.astype(np.float64) - exact) <= bound + 1e-30).all()


def test_conv1x1_launch_args_and_limits() -> None:
    cfg = CONV1.launch("float16", 8, 512, 512, 32, 2)
    assert cfg.grid == (8 * 512 * 512 // CONV1.block_threads, 1, 1) and cfg.block == (CONV1.block_threads, 1, 1)
    assert CONV1.launch("float32", 1, 3, 5, 7, 9).grid == (1, 3, 1)  # 15 pixels; ceil(9 / 4) channel groups
    with pytest.raises(InputError, match=r"at most 512 input channels .* got C=513"):
        CONV1.launch("float16", 1, 4, 4, 513, 2)
    assert CONV1.entries == ("conv1x1_nhwc_f16", "conv1x1_nhwc_f32")
    args = CONV1.args(x=0x1000, w=0x2000, bias=0x3000, y=0x4000, N=2, H=7, W=5, C=32, K=2, ldx=64, relu=True)
    assert [v for v, _ in args] == [0x1000, 0x2000, 0x3000, 0x4000, 2, 7, 5, 32, 2, 64, 2, 1]
    assert [t for _, t in args] == [ctypes.c_void_p] * 4 + [ctypes.c_int32] * 8
    assert set(CONV1.defines()) == {"CONV1X1_THREADS", "CONV1X1_KG", "CONV1X1_MAX_C"}
