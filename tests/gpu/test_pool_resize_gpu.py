"""The pooling family's average modes (maxpool_nhwc.cu), the eltwise kernel's constant-operand and
PReLU rows and Sub/Div (eltwise_nhwc.cu), and Resize by sizes at odd scales, at channel counts that
take each of its vector widths and under grids other than its launcher's (resize_nhwc.cu) on a
real GPU against onnxruntime (CPU, float32, on the same dtype-rounded inputs) and against the
kernels' numpy references (which tests/test_pool_resize_family.py checks against onnxruntime):
fp16 and fp32, windows, scales and shapes no zoo model uses, C a multiple of 8 (the vector paths) or
not, and channel-slice reads and writes whose neighbours must survive (tests/gpu/gpu_ptx.Slices;
the output slice is poisoned with NaN first, so an element not written fails).

Tolerances: against the reference, fp32 1e-6 relative L2 (the same fp32 sum order and IEEE
division: only the division's last bit may differ); against onnxruntime, fp32 1e-5 and fp16 2e-3
relative L2 (the output's one fp16 rounding, ~5e-4 relative per element), max abs 1e-5 / 1e-2."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_ptx import Slices, checked_in_entries
from onnx import helper, numpy_helper
from test_pool_resize_family import AVG_WINDOWS, RESIZES, avg_node, channel_constant, ort_resize, ort_run

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.contract.plan import POOL_MODES, KernelCall
from dualtrack.kernels import PoolGeometry, ResizeMode
from dualtrack.runtime.engine import Engine

POOL, ELT, RESIZE = kernels.KERNELS["maxpool"], kernels.KERNELS["eltwise"], kernels.KERNELS["resize"]
STEMS = ("maxpool_nhwc", "eltwise_nhwc", "resize_nhwc")
OFFS = [0, 3, 4, 8]  # as test_mobile_gpu.py: dense, odd strides, misaligned by 8 bytes, aligned slices
VS_REF = Tolerance(rel_l2=1e-6, max_abs=1e-5, mismatch=0)
VS_ORT = {
    "float16": Tolerance(rel_l2=2e-3, max_abs=1e-2, mismatch=0),
    "float32": Tolerance(rel_l2=1e-5, max_abs=1e-5, mismatch=0),
}


@pytest.fixture(scope="module")
def mods(engine: Engine):
    with checked_in_entries(engine, STEMS) as found:
        yield found


def launch(mods, spec, dtype: str, cfg, args, s: Slices) -> None:
    mods[spec.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)


def check(name: str, got: np.ndarray, ref: np.ndarray, ort_nhwc: np.ndarray, dtype: str) -> None:
    tight = VS_REF if dtype == "float32" else VS_ORT["float16"]  # fp16: the reference rounds once too
    for what, want, tol in (("reference", ref, tight), ("onnxruntime", ort_nhwc, VS_ORT[dtype])):
        result = compare(f"{name} vs {what}", want.astype(np.float32), got.astype(np.float32), tol)
        assert result.passed, result


def nchw(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float32).transpose(0, 3, 1, 2))


def nhwc(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 2, 3, 1)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize("shape", [(2, 17, 23, 5), (1, 16, 15, 16)])
@pytest.mark.parametrize("include", [0, 1])
@pytest.mark.parametrize(("kernel", "stride", "pads", "ceil"), AVG_WINDOWS)
def test_average_pool_kernel(engine, mods, dtype, off, shape, include, kernel, stride, pads, ceil) -> None:
    n, h, w, c = shape
    x = np.random.default_rng().standard_normal(shape).astype(dtype)
    mode = POOL_MODES["avg_include_pad" if include else "avg_exclude_pad"]
    g = PoolGeometry(*kernel, *stride, 1, 1, *pads, ceil_mode=ceil, mode=mode)
    ref = POOL.reference(x, g)
    s = Slices(engine, dtype, off)
    (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
    args = POOL.args(x=px, y=py, N=n, H=h, W=w, C=c, geom=g, ldx=ldx, ldy=ldy)
    launch(mods, POOL, dtype, POOL.launch(dtype, n, h, w, c, 0, g), args, s)
    want = nhwc(ort_run(avg_node(kernel, stride, pads, ceil, include), nchw(x)))
    check(f"{g.label()} on {shape} {dtype} offset {off}", s.result(), ref, want, dtype)


# (ONNX op, constant first, constant shape, eltwise op)
CONSTANT_OPS = [
    ("PRelu", False, (-1, 1, 1), "prelu"),
    ("PRelu", False, (1,), "prelu"),
    ("Mul", False, (-1, 1, 1), "mul"),
    ("Add", True, (1, -1, 1, 1), "add"),
    ("Sub", True, (), "rsub"),
    ("Div", False, (-1, 1, 1), "div"),
    ("Div", True, (1, 1, 1), "rdiv"),
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize("c", [5, 16])
@pytest.mark.parametrize(("op_type", "const_first", "shape", "op"), CONSTANT_OPS)
def test_eltwise_constant_operand_kernel(engine, mods, dtype, off, c, op_type, const_first, shape, op) -> None:
    n, h, w = 2, 7, 9
    rng = np.random.default_rng()
    # Both signs (PReLU's two branches), magnitudes kept off zero (rdiv divides by them; fp16 overflows)
    a = (rng.uniform(0.25, 3.0, (n, h, w, c)) * np.sign(rng.standard_normal((n, h, w, c)))).astype(dtype)
    k = channel_constant(tuple(c if d == -1 else d for d in shape)).astype(dtype)
    call = KernelCall("eltwise", ("a",), ("y",), ("k",), (("op", 0), ("C", c)))
    vec = ELT.pack_weights(call, {"k": k})["k"]  # (C,): the scalar broadcast
    ref = ELT.reference(a, vec, op)
    s = Slices(engine, dtype, off)
    (pa, lda), (py, ldy) = s.input(a), s.output(ref.shape)
    pk = s.weights(vec)
    args = ELT.args(a=pa, b=pk, y=py, N=n, H=h, W=w, C=c, op=op, bcast=2, lda=lda, ldy=ldy)
    launch(mods, ELT, dtype, ELT.launch(dtype, n, h, w, c, 0, ldy=ldy), args, s)
    node = helper.make_node(op_type, ["k", "x"] if const_first else ["x", "k"], ["y"])
    want = nhwc(ort_run(node, nchw(a), (numpy_helper.from_array(k.astype(np.float32), "k"),)))
    check(f"{op_type} by {k.shape} on C={c} {dtype} offset {off}", s.result(), ref, want, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize(("op", "gate"), [("sub", False), ("div", True), ("rsub", True), ("rdiv", False)])
def test_eltwise_sub_and_div_of_two_tensors(engine, mods, dtype, off, op, gate) -> None:
    n, h, w, c = 2, 5, 6, 24
    rng = np.random.default_rng()
    a = (rng.uniform(0.5, 2.0, (n, h, w, c)) * np.sign(rng.standard_normal((n, h, w, c)))).astype(dtype)
    b_shape = (n, 1, 1, c) if gate else (n, h, w, c)
    b = (rng.uniform(0.5, 2.0, b_shape) * np.sign(rng.standard_normal(b_shape))).astype(dtype)
    ref = ELT.reference(a, b, op)
    s = Slices(engine, dtype, off)
    (pa, lda), (pb, ldb), (py, ldy) = s.input(a), s.input(b), s.output(ref.shape)
    args = ELT.args(a=pa, b=pb, y=py, N=n, H=h, W=w, C=c, op=op, bcast=int(gate), lda=lda, ldb=ldb, ldy=ldy)
    launch(mods, ELT, dtype, ELT.launch(dtype, n, h, w, c, 0, ldy=ldy), args, s)
    a32, b32 = a.astype(np.float64), b.astype(np.float64)
    want = {"sub": a32 - b32, "div": a32 / b32, "rsub": b32 - a32, "rdiv": b32 / a32}[op]
    check(f"{op} {dtype} offset {off}", s.result(), ref, want, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 4])
@pytest.mark.parametrize("c", [3, 16])
@pytest.mark.parametrize(("mode", "coord", "scales", "sizes"), RESIZES)
def test_resize_kernel_by_scales_and_sizes(engine, mods, dtype, off, c, mode, coord, scales, sizes) -> None:
    n, h, w = 2, 17, 23
    x = np.random.default_rng().standard_normal((n, h, w, c)).astype(dtype)
    want = nhwc(ort_resize(nchw(x), mode, coord, scales=scales, sizes=sizes))
    Ho, Wo = want.shape[1:3]
    if scales is not None:
        sh, sw = (float(np.float32(v)) for v in scales)
    else:  # what the lowering records for sizes (lower_mobile.resize_mode)
        sh, sw = float(np.float32(Ho) / np.float32(h)), float(np.float32(Wo) / np.float32(w))
    how = ResizeMode(mode, coord, "floor", sh, sw)
    ref = RESIZE.reference(x, Ho, Wo, how)
    s = Slices(engine, dtype, off)
    (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
    args = RESIZE.args(x=px, y=py, N=n, H=h, W=w, C=c, Ho=Ho, Wo=Wo, ldx=ldx, ldy=ldy, how=how)
    launch(mods, RESIZE, dtype, RESIZE.launch(dtype, n, h, w, c, 0, Ho=Ho, Wo=Wo, ldy=ldy), args, s)
    check(f"resize {mode} {coord} {scales or sizes} {dtype}", s.result(), ref, want, dtype)


# (mode, coord, nearest, scales): up by 2.6 and down by 0.7, per axis, in each coordinate mode
ODD_RESIZES = [
    ("linear", "half_pixel", "floor", (0.7, 2.6)),
    ("linear", "pytorch_half_pixel", "floor", (2.6, 2.6)),
    ("linear", "align_corners", "floor", (2.6, 0.7)),
    ("linear", "asymmetric", "floor", (0.7, 0.7)),
    ("nearest", "half_pixel", "round_prefer_floor", (2.6, 0.7)),
    ("nearest", "asymmetric", "floor", (0.7, 2.6)),
    ("nearest", "align_corners", "round_prefer_ceil", (2.6, 2.6)),
]


def resize_case(
    engine, dtype: str, off: int, n: int, h: int, w: int, c: int, mode: str, coord: str, nearest: str, scales
) -> tuple[np.ndarray, np.ndarray, ResizeMode, Slices, list, tuple[int, int, int]]:
    """Random x (N, H, W, C), onnxruntime's Resize of it by ``scales`` (NHWC), the mode as the
    lowering records it, the slices (x and y in channel slices at ``off``) and the kernel's arguments."""
    x = np.random.default_rng().standard_normal((n, h, w, c)).astype(dtype)
    want = nhwc(ort_resize(nchw(x), mode, coord, scales=scales, nearest=nearest))
    Ho, Wo = want.shape[1:3]
    how = ResizeMode(mode, coord, nearest, *(float(np.float32(v)) for v in scales))
    s = Slices(engine, dtype, off)
    (px, ldx), (py, ldy) = s.input(x), s.output((n, Ho, Wo, c))
    args = RESIZE.args(x=px, y=py, N=n, H=h, W=w, C=c, Ho=Ho, Wo=Wo, ldx=ldx, ldy=ldy, how=how)
    return x, want, how, s, args, (Ho, Wo, ldy)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize("c", [20, 264, 3])  # fp16 vectors of 4 and 8 channels (fp32: 4), and single channels
@pytest.mark.parametrize(("mode", "coord", "nearest", "scales"), ODD_RESIZES)
def test_resize_kernel_at_odd_channels_and_scales(engine, mods, dtype, off, c, mode, coord, nearest, scales) -> None:
    """C 20 and 264 (no zoo model's), N 3, non-integer scales up and down, channel slices on both
    sides (OFFS: the widest vector each allows, down to single elements on odd strides)."""
    n, h, w = 3, 9, 13
    x, want, how, s, args, (Ho, Wo, ldy) = resize_case(engine, dtype, off, n, h, w, c, mode, coord, nearest, scales)
    ref = RESIZE.reference(x, Ho, Wo, how)
    launch(mods, RESIZE, dtype, RESIZE.launch(dtype, n, h, w, c, 0, Ho=Ho, Wo=Wo, ldy=ldy), args, s)
    check(f"resize {mode} {coord} {nearest} x{scales} C={c} {dtype} offset {off}", s.result(), ref, want, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize("c", [256, 20, 3])
@pytest.mark.parametrize(
    ("mode", "coord"), [("linear", "half_pixel"), ("linear", "align_corners"), ("nearest", "asymmetric")]
)
def test_an_identity_resize_copies_bit_for_bit(engine, mods, dtype, off, c, mode, coord) -> None:
    """A Resize to its input's size (smp Segformer's 1/4 feature into its concatenation) is a copy, as
    onnxruntime's: inf and NaN stay where they are (tests/test_pool_resize_family.py checks
    onnxruntime and the reference)."""
    n, h, w = 3, 9, 13
    x = np.random.default_rng().standard_normal((n, h, w, c)).astype(dtype)
    x[0, 1, 2, 0], x[2, 4, 5, c - 1], x[1, 8, 12, c // 2] = np.inf, np.nan, -np.inf
    how = ResizeMode(mode, coord, "floor", 1.0, 1.0)
    assert how.identity(h, w, h, w)
    s = Slices(engine, dtype, off)
    (px, ldx), (py, ldy) = s.input(x), s.output(x.shape)
    args = RESIZE.args(x=px, y=py, N=n, H=h, W=w, C=c, Ho=h, Wo=w, ldx=ldx, ldy=ldy, how=how)
    launch(mods, RESIZE, dtype, RESIZE.launch(dtype, n, h, w, c, 0, Ho=h, Wo=w, ldy=ldy), args, s)
    np.testing.assert_array_equal(s.result(), x)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("grid", [(1, 1, 1), (1, 5, 1), (3, 2, 1), (1000, 2, 1)])
@pytest.mark.parametrize(("mode", "coord", "nearest", "scales"), [ODD_RESIZES[0], ODD_RESIZES[5]])
def test_resize_kernel_is_right_under_any_grid(engine, mods, dtype, grid, mode, coord, nearest, scales) -> None:
    """The kernel follows gridDim (strips of the output width, a loop over the rows), so a grid that
    is not the launcher's still writes every element once: one block (strips wider than the
    RESIZE_COLUMNS column table: several passes), fewer rows than the output's, more strips than
    columns (empty blocks)."""
    n, h, w, c = 2, 5, 111, 20  # 2.6 x 111: 288 output columns, more than one column table
    x, want, how, s, args, (Ho, Wo, _) = resize_case(engine, dtype, 4, n, h, w, c, mode, coord, nearest, scales)
    ref = RESIZE.reference(x, Ho, Wo, how)
    mods[RESIZE.entry(dtype)].launch(grid, (RESIZE.block_threads, 1, 1), 0, s.be.stream, args)
    check(f"resize {mode} {coord} on grid {grid} {dtype}", s.result(), ref, want, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize("c", [24, 5])  # fp16: the 8-channel vector path, and the scalar one
@pytest.mark.parametrize("op", ["mul", "add", "rsub"])
def test_eltwise_pixel_gate(engine, mods, dtype, off, c, op) -> None:
    """b an (N, H, W, 1) map broadcast over the channels (bcast 3: an attention gate, scSE's spatial gate)."""
    n, h, w = 2, 7, 9
    rng = np.random.default_rng()
    a = rng.standard_normal((n, h, w, c)).astype(dtype)
    b = rng.uniform(0.0, 1.0, (n, h, w, 1)).astype(dtype)
    ref = ELT.reference(a, b, op)
    s = Slices(engine, dtype, off)
    (pa, lda), (pb, ldb), (py, ldy) = s.input(a), s.input(b), s.output(ref.shape)
    args = ELT.args(a=pa, b=pb, y=py, N=n, H=h, W=w, C=c, op=op, bcast=3, lda=lda, ldb=ldb, ldy=ldy)
    launch(mods, ELT, dtype, ELT.launch(dtype, n, h, w, c, 0, ldy=ldy), args, s)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = {"mul": a64 * b64, "add": a64 + b64, "rsub": b64 - a64}[op]
    check(f"{op} by an (N,H,W,1) gate, C={c} {dtype} offset {off}", s.result(), ref, want, dtype)
