"""The general max-pool (maxpool_nhwc.cu, op ``maxpool``) on a real GPU against its numpy reference
(kernels/maxpool.py, itself checked against onnxruntime in tests/test_maxpool.py): fp16 and fp32,
odd image sizes, strides, dilations, pads, ceil_mode, windows from 1x1 to 15x15, C a multiple of 8
or not, and channel-slice reads and writes (ld > C) whose neighbouring channels must survive. The
output slice is poisoned (NaN) first, so an element the kernel does not write fails; max is exact,
so the comparison is too. Inputs are fresh random normals, all below zero in half the cases (a
padded tap read as 0 would win there), with NaNs in some (they propagate).

The slice offsets (OFFS) run both load paths: dense and 16-byte aligned slices take the vector
path (8 fp16 / 4 fp32 channels a load) where C allows; strides that are multiples of 8 on pointers
8 bytes off 16-byte alignment and odd strides take the element loop under the same grid.
The module is loaded from handwritten_ptx/ptx/<arch>/maxpool_nhwc.ptx; the tiny bundle's engine
provides the context, stream and memory pool."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gpu_ptx import Slices, checked_in_ptx

from dualtrack import kernels
from dualtrack.contract.plan import POOL_MODES
from dualtrack.kernels import PoolGeometry
from dualtrack.runtime.engine import Engine

POOL = kernels.KERNELS["maxpool"]
OFFS = [0, 3, 4, 8]  # as test_mobile_gpu.py: dense, odd strides, misaligned by 8 bytes, aligned slices
STEM = PoolGeometry(3, 3, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)  # ResNet's / smp's
GEOMS = {
    "stem": STEM,
    "2x2s2": PoolGeometry(2, 2, 2, 2),
    "2x2s2_ceil": PoolGeometry(2, 2, 2, 2, ceil_mode=1),
    "3x3s1_same": PoolGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1),
    "3x3s2_ceil": PoolGeometry(3, 3, 2, 2, ceil_mode=1),
    "5x3_mixed": PoolGeometry(5, 3, 2, 3, dil_h=2, pad_top=2, pad_left=1, pad_bottom=3, pad_right=0, ceil_mode=1),
    "1x1s2": PoolGeometry(1, 1, 2, 2),
    "7x7s3_pad3": PoolGeometry(7, 7, 3, 3, pad_top=3, pad_left=3, pad_bottom=3, pad_right=3),
    "15x15_same": PoolGeometry(15, 15, pad_top=7, pad_left=7, pad_bottom=7, pad_right=7),
    "dilated_asym": PoolGeometry(3, 2, 1, 2, dil_h=3, dil_w=2, pad_top=0, pad_left=1, pad_bottom=2, pad_right=1),
}
SHAPES = [(2, 37, 23, 5), (3, 11, 7, 8), (1, 64, 64, 64), (2, 17, 19, 40), (1, 16, 15, 12), (2, 9, 30, 3)]


@pytest.fixture(scope="module")
def mods(engine: Engine):
    """The two entries of maxpool_nhwc, from the checked-in PTX of this device's arch."""
    with checked_in_ptx(engine, POOL.stem) as mod:
        yield {entry: mod.function(entry) for entry in POOL.entries}


def run_pool(engine: Engine, mods, dtype: str, off: int, x: np.ndarray, g: PoolGeometry, tol: float = 0.0) -> None:
    """One launch on slices at channel offset ``off``, compared with the reference: exactly, or within
    ``tol`` (relative and absolute)."""
    n, h, w, c = x.shape
    ref = POOL.reference(x, g)
    s = Slices(engine, dtype, off)
    (px, ldx), (py, ldy) = s.input(x), s.output(ref.shape)
    cfg = POOL.launch(dtype, n, h, w, c, 0, g)
    args = POOL.args(x=px, y=py, N=n, H=h, W=w, C=c, geom=g, ldx=ldx, ldy=ldy)
    mods[POOL.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
    got, msg = s.result(), f"{g.label()} on {x.shape} {dtype}, offset {off}"
    if tol:
        np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=tol, atol=tol, err_msg=msg)
    else:
        np.testing.assert_array_equal(got, ref, err_msg=msg)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize("name", list(GEOMS))
def test_maxpool_kernel_matches_its_reference(engine, mods, dtype: str, off: int, name: str) -> None:
    g = GEOMS[name]
    rng = np.random.default_rng()
    for i, (n, h, w, c) in enumerate(SHAPES):
        assert POOL.supports(dtype, h, w, c, g) is None
        x = rng.standard_normal((n, h, w, c))
        if i % 2:
            x = -np.abs(x) - 1  # everything below zero: a padded tap read as 0 would win
        x = x.astype(dtype)
        if i == 2:
            x[0, h // 2, w // 3, c - 1] = np.nan
        run_pool(engine, mods, dtype, off, x, g)


@pytest.mark.parametrize("n", [1, 8])
def test_smp_resnet34_stem_pool(engine, mods, n: int) -> None:
    """smp Unet-resnet34's stem pool: (n, 256, 256, 64) fp16 -> (n, 128, 128, 64), dense (the vector
    path) and as the plan runs it, reading a channel slice of the Concat its input also feeds."""
    x = np.random.default_rng().standard_normal((n, 256, 256, 64)).astype("float16")
    run_pool(engine, mods, "float16", 0, x, STEM)
    run_pool(engine, mods, "float16", 8, x, STEM)


# Windows of LANE_TAPS taps or more run on several lanes per output chunk (MaxPoolSpec.lanes): a
# pyramid pool's global window (PSPNet's bin 1 pools its whole map), a 23 x 23 bin, a padded 9 x 9
# stride-1 window with ceil_mode and a tall narrow one, on sizes no zoo model has (C 13 takes the
# element loop, C 40 the vector path); N = 3 so a group of lanes starts mid-block.
LARGE = [
    ((3, 70, 70, 40), PoolGeometry(70, 70, 70, 70)),
    ((3, 69, 46, 13), PoolGeometry(23, 23, 23, 23)),
    ((3, 31, 29, 40), PoolGeometry(9, 9, 1, 1, pad_top=4, pad_left=4, pad_bottom=4, pad_right=4)),
    ((3, 40, 27, 13), PoolGeometry(33, 2, 5, 2, pad_top=1, pad_left=0, pad_bottom=2, pad_right=1, ceil_mode=1)),
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize("mode", ["max", "avg_exclude_pad", "avg_include_pad"])
@pytest.mark.parametrize("case", range(len(LARGE)))
def test_large_windows_split_over_lanes(engine, mods, dtype: str, off: int, mode: str, case: int) -> None:
    """Max exactly; the average within one fp16 rounding (2e-3 relative) or fp32's summation order
    (1e-5), as the lanes sum in another order than the reference's row-major one."""
    shape, g0 = LARGE[case]
    g = dataclasses.replace(g0, mode=POOL_MODES[mode])
    assert POOL.lanes(g) > 1 and POOL.supports(dtype, *shape[1:], g) is None
    x = np.random.default_rng().standard_normal(shape).astype(dtype)
    tol = 0.0 if mode == "max" else 2e-3 if dtype == "float16" else 1e-5
    run_pool(engine, mods, dtype, off, x, g, tol)
