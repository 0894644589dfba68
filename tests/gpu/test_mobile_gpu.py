"""The mobile kernels (dwconv, gap, fc, eltwise, resize) on a real GPU against their numpy
semantics: fp16 and fp32, odd shapes, every activation, strides/dilations/pads, the Resize modes,
and channel-slice reads and writes (ld > C) whose neighbouring channels must survive. Outputs are
poisoned (NaN) first, so an element a kernel does not write fails the comparison. The fp16 vector
paths (dwconv, eltwise, gap: 8 channels a 16-byte access) and their scalar fallbacks both run: the
slice offsets (OFFS) give dense and 16-byte aligned slices (vector), strides that are multiples of 8
on misaligned pointers (the host sizes the grid for vectors, the device falls back) and odd strides. Then a tiny
MobileNetV3-like bundle (tests/mobile_net.py, body on Track A) runs through the engine against
onnxruntime.

Each module is loaded from handwritten_ptx/ptx/<arch>/<stem>.ptx (the engine only loads the kernels
its bundle lists); the engine of the tiny bundle provides the context, stream and memory pool."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gpu_ptx import Slices, checked_in_entries

from dualtrack import kernels
from dualtrack.compiler.bundle_writer import load_model
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare, ort_session, random_input, run_ort, verify_engine
from dualtrack.contract.plan import REDUCE_OPS
from dualtrack.kernels import Activation, DwConvSpec, DwGeometry, ResizeMode
from dualtrack.runtime.driver import SHARED_DEFAULT
from dualtrack.runtime.engine import Engine

# fp32 math and one rounding, like the references; only summation order (and expf) differ.
TOL = {
    "float16": Tolerance(rel_l2=2e-3, max_abs=2e-3, mismatch=0),
    "float32": Tolerance(rel_l2=1e-5, max_abs=1e-5, mismatch=0),
}
ACTS = [
    Activation(),
    Activation.named("relu"),
    Activation.named("clip", 0.0, 6.0),
    Activation.named("hardsigmoid", float(np.float32(1 / 6)), 0.5),
    Activation.named("hardswish"),
    Activation.named("sigmoid"),
]
# Channel offsets of the slices: 0 dense; 8 aligned slices (ld = C + 16); 4 strides still multiples of
# 8 for C % 8 == 0 but pointers 8 bytes off 16-byte alignment in fp16 (the device's scalar fallback
# under a vector-sized grid); 3 odd strides (scalar everywhere).
OFFS = [0, 3, 4, 8]
STEMS = ("dwconv_nhwc", "gap_nhwc", "fc_nhwc", "eltwise_nhwc", "resize_nhwc")


@pytest.fixture(scope="module")
def mods(engine: Engine):
    """Every entry of the five mobile kernels, from the checked-in PTX of this device's arch."""
    with checked_in_entries(engine, STEMS) as found:
        yield found


def launch(mods, spec, dtype: str, cfg, args, s: Slices) -> None:
    mods[spec.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)


def check(name: str, ref: np.ndarray, got: np.ndarray, dtype: str, exact: bool = False) -> None:
    if exact:
        np.testing.assert_array_equal(got, ref)
        return
    result = compare(name, ref, got, TOL[dtype])
    assert result.passed, result


DW = kernels.KERNELS["dwconv"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "g"),
    [
        (2, 37, 23, 5, DwGeometry(3, 1, 1, (1, 1, 1, 1))),
        (3, 11, 7, 8, DwGeometry(3, 1, 1, (1, 1, 1, 1))),  # one vector a pixel
        (1, 64, 64, 72, DwGeometry(5, 2, 1, (2, 2, 2, 2))),
        (3, 17, 19, 40, DwGeometry(3, 2, 1, (1, 1, 1, 1))),
        (1, 32, 32, 960, DwGeometry(5, 1, 2, (4, 4, 4, 4))),  # LR-ASPP's last dilated stage
        (2, 9, 12, 33, DwGeometry(3, 3, 2, (0, 1, 2, 0))),
    ],
)
def test_dwconv_kernel(engine, mods, dtype, off, n, h, w, c, g) -> None:
    for act in ACTS[:2] if c > 100 else ACTS:
        s = Slices(engine, dtype, off)
        x = s.rng.standard_normal((n, h, w, c)).astype(dtype)
        wt = (s.rng.standard_normal((c, 1, g.R, g.R)) / g.R).astype(dtype)
        b = s.rng.standard_normal(c).astype(np.float32)
        wp, bp = DwConvSpec.pack(wt, b)
        ref = DW.reference(x, wp, bp, g, act)
        (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
        args = DW.args(x=px, w=s.weights(wp), bias=s.weights(bp), y=py, N=n, H=h, W=w, C=c, geometry=g,
                       ldx=ldx, ldy=ldy, act=act)  # fmt: skip
        launch(mods, DW, dtype, DW.launch(dtype, n, h, w, c, 0, g, ldy=ldy), args, s)
        check(f"dwconv {act}", ref, s.result(), dtype)


@pytest.mark.parametrize("off", [0, 8])  # dense, and 16-byte aligned slices (ld = C + 16) in and out
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "g"),
    [  # the tiled entries (fp16, dilation 1, stride 1 or 2): tiles cut by the image's edges, C not a
        # multiple of its 32-channel block, the square kernels it unrolls and the general loop
        (1, 13, 29, 40, DwGeometry(7, pads=(3, 3, 3, 3))),
        (3, 16, 16, 32, DwGeometry(3)),  # exactly one tall tile, one channel block
        (2, 33, 21, 264, DwGeometry(5, pads=(2, 2, 2, 2))),
        (1, 5, 70, 72, DwGeometry(1, pads=(0, 3, 0, 3), S=7)),  # factorised 1x7
        (2, 19, 9, 48, DwGeometry(7, pads=(3, 0, 3, 0), S=1)),  # and 7x1
        (1, 12, 12, 96, DwGeometry(4, pads=(1, 2, 2, 1), S=2)),  # even, asymmetric: output 12x14
        (2, 3, 2, 48, DwGeometry(7, pads=(3, 3, 3, 3))),  # an image smaller than the window
        (1, 20, 20, 32, DwGeometry(3, pads=(0, 0, 0, 0))),  # valid: output 18x18
        # stride 2 (half the rows, a patch twice as wide): MobileNet's 3x3 and 5x5, and a 7x7
        (2, 23, 37, 40, DwGeometry(3, 2)),  # odd sizes: output 12x19, both edges cut
        (1, 112, 112, 32, DwGeometry(3, 2)),  # MobileNetV2's first stride-2 layer at 224 (56x56 out)
        (1, 34, 33, 72, DwGeometry(5, 2, pads=(2, 2, 2, 2))),
        (2, 19, 21, 48, DwGeometry(7, 2, pads=(3, 3, 3, 3))),
        (1, 16, 18, 40, DwGeometry(3, 2, pads=(0, 0, 1, 1))),  # TF-style SAME: padded below and right only
        (2, 15, 17, 32, DwGeometry(5, 2, pads=(0, 1, 0, 1))),  # padded left and right only: output 6x8
        (2, 9, 8, 32, DwGeometry(3, 2, pads=(0, 1, 0, 1), S=5)),  # 3x5: the general loop
        (1, 5, 4, 264, DwGeometry(7, 2, pads=(3, 3, 3, 3))),  # an image smaller than the window
    ],
)
def test_dwconv_tile_kernel(engine, mods, off, n, h, w, c, g) -> None:
    """Both tiled entries (and a 3x3's two 3x3 entries) against the numpy reference (every activation of
    ACTS) and against the per-element entry on the same data (the same fmaf chain: equal up to the sign
    of a zero)."""
    assert DW.tile_path("float16", g, c, c + 2 * off, c + 2 * off)
    _, ho, wo, _ = DW.output_shape(n, h, w, c, 0, g)
    launches = {
        DW.tile_entry: DW.tile_launch(n, ho, wo, c, g),
        DW.tile_short_entry: DW.tile_launch(n, ho, wo, c, g, short=True),
        DW.entry("float16"): DW.launch("float16", n, h, w, c, 0, g, ldy=c + 2 * off),
    }
    if DW.square3(g):  # the 3x3 entries too (the general ones' loop takes a 3x3 as well)
        launches[DW.tile3_entry] = DW.tile_launch(n, ho, wo, c, g)
        launches[DW.tile3_short_entry] = DW.tile_launch(n, ho, wo, c, g, short=True)
    for entry, cfg in launches.items():
        if cfg.shared_bytes > SHARED_DEFAULT:
            mods[entry].set_max_dynamic_shared(cfg.shared_bytes)
    for act in ACTS:
        outs = []
        s = Slices(engine, "float16", off)
        x = s.rng.standard_normal((n, h, w, c)).astype("float16")
        wt = (s.rng.standard_normal((c, 1, g.R, g.width)) / g.R).astype("float16")
        wp, bp = DwConvSpec.pack(wt, s.rng.standard_normal(c).astype(np.float32))
        ref = DW.reference(x, wp, bp, g, act)
        for entry, cfg in launches.items():
            s = Slices(engine, "float16", off)
            (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
            args = DW.args(x=px, w=s.weights(wp), bias=s.weights(bp), y=py, N=n, H=h, W=w, C=c, geometry=g,
                           ldx=ldx, ldy=ldy, act=act)  # fmt: skip
            mods[entry].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
            outs.append(s.result())
        got_by = dict(zip(launches, outs, strict=True))
        element = got_by.pop(DW.entry("float16"))
        for entry, got in got_by.items():
            check(f"dwconv {entry} {act}", ref, got, "float16")
            np.testing.assert_array_equal(np.abs(got), np.abs(element))


@pytest.mark.parametrize("off", [0, 8])  # dense, and 16-byte aligned slices (ld = C + 16) in and out
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "g"),
    [  # the column entries (fp16 3x3, dilation 1, stride 1 or 2): row tiles and column strips cut by
        # the image's edges, channel blocks of uneven vectors, one vector a pixel, pads of every side
        (2, 37, 23, 40, DwGeometry(3)),
        (1, 9, 70, 8, DwGeometry(3)),  # one vector a pixel: 256 columns a block, 70 of them live
        (2, 17, 5, 264, DwGeometry(3)),  # 33 vectors: two blocks of 17
        (1, 6, 7, 520, DwGeometry(3)),  # 65 vectors: three blocks of 22, the last one short
        (3, 2, 1, 16, DwGeometry(3)),  # an image smaller than the window
        (1, 20, 20, 32, DwGeometry(3, pads=(0, 0, 0, 0))),  # valid: output 18x18
        (1, 12, 13, 48, DwGeometry(3, pads=(2, 0, 0, 2))),  # asymmetric: output 12x13
        (2, 23, 37, 40, DwGeometry(3, 2)),  # stride 2, odd sizes: output 12x19
        (1, 16, 18, 72, DwGeometry(3, 2, pads=(0, 0, 1, 1))),  # TF-style SAME
        (1, 33, 31, 2048, DwGeometry(3, 2)),  # SegFormer-b2-wide channels at stride 2
    ],
)
def test_dwconv_cols_kernel(engine, mods, off, n, h, w, c, g) -> None:
    """Both column entries against the numpy reference (every activation of ACTS, and GELU, which
    they inline) and against the per-element entry on the same data (the same fmaf chain: equal up to
    the sign of a zero; GELU's inlined erf against the table's call: within the tolerance)."""
    assert replace(DW, cols=True).cols_path("float16", g, c, c + 2 * off, c + 2 * off)
    _, ho, wo, _ = DW.output_shape(n, h, w, c, 0, g)
    launches = {
        DW.cols_entry: DW.cols_launch(n, ho, wo, c, g),
        DW.cols_short_entry: DW.cols_launch(n, ho, wo, c, g, short=True),
        DW.entry("float16"): DW.launch("float16", n, h, w, c, 0, g, ldy=c + 2 * off),
    }
    for act in [*ACTS, Activation.named("gelu")]:
        outs = []
        s = Slices(engine, "float16", off)
        x = s.rng.standard_normal((n, h, w, c)).astype("float16")
        wt = (s.rng.standard_normal((c, 1, 3, 3)) / 3).astype("float16")
        wp, bp = DwConvSpec.pack(wt, s.rng.standard_normal(c).astype(np.float32))
        ref = DW.reference(x, wp, bp, g, act)
        for entry, cfg in launches.items():
            s = Slices(engine, "float16", off)
            (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
            args = DW.args(x=px, w=s.weights(wp), bias=s.weights(bp), y=py, N=n, H=h, W=w, C=c, geometry=g,
                           ldx=ldx, ldy=ldy, act=act)  # fmt: skip
            mods[entry].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
            outs.append(s.result())
        for entry, got in zip(launches, outs[:2], strict=False):
            check(f"dwconv {entry} {act}", ref, got, "float16")
            if act.kind.name != "gelu":
                np.testing.assert_array_equal(np.abs(got), np.abs(outs[2]))


GAP = kernels.KERNELS["gap"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [*OFFS, 5])
@pytest.mark.parametrize("op", list(REDUCE_OPS))
@pytest.mark.parametrize(
    ("n", "h", "w", "c"), [(2, 37, 23, 5), (1, 128, 128, 72), (8, 16, 16, 960), (3, 1, 1, 33), (2, 7, 9, 40)]
)
def test_gap_kernel(engine, mods, dtype, off, op, n, h, w, c) -> None:
    """Every reduction of the table over H, W (the entries compile one body an op): max and min exact,
    the sums (fp32, one rounding; L2 one square root) within TOL."""
    s = Slices(engine, dtype, off)
    x = (s.rng.standard_normal((n, h, w, c)) + 3).astype(dtype)  # a mean far from 0: the sums grow
    ref = GAP.reference(x, op=REDUCE_OPS[op])
    (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
    args = GAP.args(x=px, y=py, N=n, H=h, W=w, C=c, ldx=ldx, ldy=ldy, op=REDUCE_OPS[op])
    launch(mods, GAP, dtype, GAP.launch(dtype, n, h, w, c), args, s)
    check(f"gap {op}", ref, s.result(), dtype, exact=op in ("ReduceMax", "ReduceMin"))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gap_max_and_min_keep_a_nan(engine, mods, dtype) -> None:
    """A NaN anywhere in an image's channel comes out of max and min as NaN (ONNX's reference; fmaxf
    alone would drop it), through the shuffles and the shared-memory merge alike; other channels exact."""
    for off in (0, 3):  # the fp16 vector path and the scalar path
        s = Slices(engine, dtype, off)
        x = s.rng.standard_normal((2, 19, 13, 40)).astype(dtype)
        x[1, 17, 4, 9] = np.nan
        for op in ("ReduceMax", "ReduceMin"):
            (px, ldx), (py, ldy) = s.input(x), s.output((2, 1, 1, 40))
            args = GAP.args(x=px, y=py, N=2, H=19, W=13, C=40, ldx=ldx, ldy=ldy, op=REDUCE_OPS[op])
            launch(mods, GAP, dtype, GAP.launch(dtype, 2, 19, 13, 40), args, s)
            got = s.result()
            assert np.isnan(got[1, 0, 0, 9]), (op, off)
            np.testing.assert_array_equal(got, GAP.reference(x, op=REDUCE_OPS[op]))


FC = kernels.KERNELS["fc"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("n", "c", "k"), [(1, 72, 24), (8, 960, 240), (3, 5, 37), (2, 240, 960)])
def test_fc_kernel(engine, mods, dtype, n, c, k) -> None:
    for act, bias in ((ACTS[1], True), (ACTS[3], True), (ACTS[0], False)):
        s = Slices(engine, dtype, 2)
        x = s.rng.standard_normal((n, 1, 1, c)).astype(dtype)
        wt = (s.rng.standard_normal((k, c, 1, 1)) / np.sqrt(c)).astype(dtype)
        b = s.rng.standard_normal(k).astype(np.float32) if bias else None
        ref = FC.reference(x, wt, b, act)
        (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
        args = FC.args(x=px, w=s.weights(wt), bias=s.weights(b) if bias else None, y=py, N=n, C=c, K=k,
                       ldx=ldx, ldy=ldy, act=act)  # fmt: skip
        launch(mods, FC, dtype, FC.launch(dtype, n, 1, 1, c, k), args, s)
        check(f"fc {act}", ref, s.result(), dtype)


ELT = kernels.KERNELS["eltwise"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [*OFFS, 1])
@pytest.mark.parametrize("c", [37, 40, 8])
@pytest.mark.parametrize(
    ("op", "gate"), [("unary", False), ("add", False), ("mul", False), ("mul", True), ("add", True)]
)
def test_eltwise_kernel(engine, mods, dtype, off, c, op, gate) -> None:
    n, h, w = 2, 19, 13
    for act in ACTS:
        s = Slices(engine, dtype, off)
        a = (3 * s.rng.standard_normal((n, h, w, c))).astype(dtype)
        b = s.rng.standard_normal((n, 1, 1, c) if gate else a.shape).astype(dtype) if op != "unary" else None
        ref = ELT.reference(a, b, op, act)
        pa, lda = s.input(a)
        pb, ldb = s.input(b) if b is not None else (None, None)
        py, ldy = s.output(ref.shape)
        args = ELT.args(a=pa, b=pb, y=py, N=n, H=h, W=w, C=c, op=op, bcast=gate, lda=lda, ldb=ldb, ldy=ldy, act=act)
        launch(mods, ELT, dtype, ELT.launch(dtype, n, h, w, c, 0, ldy=ldy), args, s)
        check(f"eltwise {op} {act}", ref, s.result(), dtype)


def test_vector_and_scalar_paths_agree_bit_for_bit_under_any_grid(engine, mods) -> None:
    """dwconv and eltwise fp16 on the same data: the vector path (dense) and the scalar fallback
    (slices 4 channels in: 8 bytes off 16-byte alignment) give identical bits (the same fp32 math
    and rounding per element), with the grid the spec chooses, one thread per element and a single
    block (the kernels loop over their work items)."""
    n, h, w, c, g = 2, 21, 17, 48, DwGeometry(3, 2, 1, (1, 1, 1, 1))
    rng = np.random.default_rng()
    x = rng.standard_normal((n, h, w, c)).astype("float16")
    wp, bp = DwConvSpec.pack((rng.standard_normal((c, 1, 3, 3)) / 3).astype("float16"), rng.standard_normal(c))
    b = rng.standard_normal((n, 1, 1, c)).astype("float16")
    act = Activation.named("hardswish")
    _, ho, wo, _ = DW.output_shape(n, h, w, c, 0, g)
    one_block = kernels.LaunchConfig(grid=(1, 1, 1), block=(DW.block_threads, 1, 1))
    grids = [  # (dwconv's, eltwise's): the spec's (vector-sized), one thread per element, one block
        (DW.launch("float16", n, h, w, c, 0, g), ELT.launch("float16", n, h, w, c)),
        (DW.element_launch("float16", n, ho, wo, c, c), ELT.element_launch("float16", n, h, w, c, c)),
        (one_block, one_block),
    ]
    outs = []
    for off in (0, 4):
        for dw_cfg, elt_cfg in grids:
            s = Slices(engine, "float16", off)
            (px, ldx), (py, ldy) = s.input(x), s.output((n, ho, wo, c))
            args = DW.args(x=px, w=s.weights(wp), bias=s.weights(bp), y=py, N=n, H=h, W=w, C=c, geometry=g,
                           ldx=ldx, ldy=ldy, act=act)  # fmt: skip
            launch(mods, DW, "float16", dw_cfg, args, s)
            dw = s.result()
            s = Slices(engine, "float16", off)
            (pa, lda), (pb, ldb), (py, ldy) = s.input(x), s.input(b), s.output(x.shape)
            args = ELT.args(a=pa, b=pb, y=py, N=n, H=h, W=w, C=c, op="mul", bcast=True, lda=lda, ldb=ldb, ldy=ldy,
                            act=act)  # fmt: skip
            launch(mods, ELT, "float16", elt_cfg, args, s)
            outs.append((dw, s.result()))
    check("dwconv", DW.reference(x, wp, bp, g, act), outs[0][0], "float16")
    check("eltwise", ELT.reference(x, b, "mul", act), outs[0][1], "float16")
    for dw, elt in outs[1:]:
        np.testing.assert_array_equal(dw.view(np.uint16), outs[0][0].view(np.uint16))
        np.testing.assert_array_equal(elt.view(np.uint16), outs[0][1].view(np.uint16))


RESIZE = kernels.KERNELS["resize"]
RESIZES: list[tuple[ResizeMode, tuple[int, int, int, int]]] = [  # (mode, (H, W, Ho, Wo))
    (ResizeMode("linear", "half_pixel", "floor", 8.0, 8.0), (64, 64, 512, 512)),  # LR-ASPP's final x8
    (ResizeMode("linear", "half_pixel", "floor", 64 / 33, 64 / 31), (33, 31, 64, 64)),  # to a size
    (ResizeMode("linear", "pytorch_half_pixel", "floor", 1.5, 1.0 / 7), (10, 7, 15, 1)),
    (ResizeMode("linear", "align_corners", "floor", 13 / 7, 17 / 5), (7, 5, 13, 17)),
    (ResizeMode("linear", "asymmetric", "floor", 0.5, 0.75), (16, 12, 8, 9)),
    (ResizeMode("nearest", "asymmetric", "floor", 2.0, 3.0), (7, 5, 14, 15)),
    (ResizeMode("nearest", "half_pixel", "round_prefer_floor", 2.5, 1.5), (6, 6, 15, 9)),
    (ResizeMode("nearest", "align_corners", "round_prefer_ceil", 11 / 5, 9 / 5), (5, 5, 11, 9)),
    (ResizeMode("nearest", "pytorch_half_pixel", "ceil", 0.5, 2.6), (8, 7, 4, 18)),
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 2])
@pytest.mark.parametrize(("how", "dims"), RESIZES)
def test_resize_kernel(engine, mods, dtype, off, how, dims) -> None:
    h, w, ho, wo = dims
    n, c = 2, 6
    s = Slices(engine, dtype, off)
    x = s.rng.standard_normal((n, h, w, c)).astype(dtype)
    how = ResizeMode(how.mode, how.coord, how.nearest, float(np.float32(how.scale_h)), float(np.float32(how.scale_w)))
    ref = RESIZE.reference(x, ho, wo, how)
    (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
    args = RESIZE.args(x=px, y=py, N=n, H=h, W=w, C=c, Ho=ho, Wo=wo, how=how, ldx=ldx, ldy=ldy)
    launch(mods, RESIZE, dtype, RESIZE.launch(dtype, n, h, w, c, 0, ldy=ldy, Ho=ho, Wo=wo), args, s)
    check(f"resize {how}", ref, s.result(), dtype, exact=how.mode == "nearest")


# --- the whole engine on a tiny MobileNetV3-like bundle ----------------------------------------------


@pytest.fixture(scope="module")
def mobile_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DUALTRACK_TEST_MOBILE_BUNDLE names a prebuilt bundle (GPU machines carry one: no IREE
    compiler there; bench/prepare_carry.sh builds it); else it is built here (mobile_net.write_mobile_project)."""
    prebuilt = os.environ.get("DUALTRACK_TEST_MOBILE_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    pytest.importorskip("iree.compiler", reason="building the mobile bundle needs the IREE compiler")
    from mobile_net import write_mobile_project

    from dualtrack.compiler.build import build

    root = tmp_path_factory.mktemp("mobile")
    build(write_mobile_project(root, ("sm_90a", "sm_80")), root / "out")
    return root / "out"


@pytest.mark.parametrize("graphs", [False, True])
def test_mobile_bundle_on_the_gpu_matches_onnxruntime(mobile_bundle: Path, graphs: bool, monkeypatch) -> None:
    monkeypatch.setenv("DUALTRACK_CUDA_GRAPHS", "1" if graphs else "0")
    with Engine.load(mobile_bundle, "cuda") as e:  # the first load's self-check runs here too
        e.backend.poison = True  # Track A outputs NaN before each run: every element must be written
        try:
            report = verify_engine(e, samples=2, interpret=False)
        finally:
            e.backend.poison = False
        assert report.passed, "\n".join(report.lines())
        assert any("[kernels]" in c.name for c in report.checks)
        for batch in (1, 2):
            x = random_input(e.input_spec, batch, np.random.default_rng())
            ref = run_ort(ort_session(load_model(e.bundle)), {e.input_spec.name: x})
            got = e.run(x)
            for name, want in ref.items():
                result = compare(name, want, got[name], Tolerance(rel_l2=5e-3, max_abs=5e-3, mismatch=0))
                assert result.passed, result
