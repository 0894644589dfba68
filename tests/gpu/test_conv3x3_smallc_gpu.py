"""The small-C conv3x3 entry (``conv3x3_nhwc_f16_smallc``: C <= 4, a direct convolution on CUDA
cores) on a real GPU against the numpy semantics: every C it takes, channel counts K below, at and
above one block's 32, partial channel groups (K % 8 != 0), odd H and W (partial tiles), N > 1,
ReLU on and off, no bias, and channel-slice reads and writes (ldx > C, ldy > K, misaligned slices
that take the element stores) whose neighbouring channels must survive.

Each launch runs on fresh random inputs. The output slice is NaN-poisoned first (every element must
be written), the output's other channels hold a sentinel (none may be written) and the input's other
channels hold NaN (none may be read: a NaN would reach the output). Tolerance: the kernel sums in
fp32 and rounds once to fp16, so each output is within one fp16 ulp of the exact (float64) result,
plus 2e-5 for the fp32 sum of 9*C + 1 terms of size O(1); and within rel L2 2e-3 of
``Conv3x3Spec.reference`` (the same fp32 sums in another order, one rounding), as the other conv
kernels' GPU tests ask.

The module is loaded here from handwritten_ptx/ptx/<arch>/conv3x3_nhwc.ptx, JIT-compiled by the
driver; the engine of the tiny bundle provides the context, stream and memory pool."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gpu_ptx import checked_in_ptx

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.runtime.driver import Kernel
from dualtrack.runtime.engine import Engine

SPEC = kernels.KERNELS["conv3x3"]
assert isinstance(SPEC, kernels.Conv3x3Spec)
ENTRY = SPEC.smallc_entry
REL_L2 = Tolerance(rel_l2=2e-3, max_abs=1.0, mismatch=0)  # against the fp32 reference, as for the other entries
ABS_SLACK = 2e-5  # fp32 accumulation error of 9*C + 1 O(1) terms, on top of one fp16 ulp
SENTINEL = np.float16(-1234.5)  # exactly representable


@pytest.fixture(scope="module")
def smallc(engine: Engine) -> Iterator[Kernel]:
    """The entry, from the checked-in PTX for this device's arch."""
    with checked_in_ptx(engine, SPEC.stem) as mod:
        yield mod.function(ENTRY)


def exact(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, relu: bool) -> np.ndarray:
    """The convolution in float64 (zero padding), bias, then ReLU."""
    N, H, W, _ = x.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    w64 = w.astype(np.float64)
    out = np.zeros((N, H, W, w.shape[0]))
    for r in range(3):
        for s in range(3):
            out += xp[:, r : r + H, s : s + W, :] @ w64[:, r, s, :].T
    if bias is not None:
        out += bias.astype(np.float64)
    return np.maximum(out, 0.0) if relu else out


def _run(
    engine: Engine,
    smallc: Kernel,
    n: int,
    h: int,
    w: int,
    c: int,
    k: int,
    *,
    relu: bool,
    bias: bool = True,
    x_off: int = 0,
    ldx: int | None = None,
    y_off: int = 0,
    ldy: int | None = None,
    w_off: int = 0,
) -> None:
    """One launch on fresh random data: x read from channels [x_off, x_off+c) of an (n,h,w,ldx)
    buffer, y written to channels [y_off, y_off+k) of an (n,h,w,ldy) buffer, the weights from
    ``w_off`` halves into their buffer (an odd offset: 2-byte aligned only)."""
    be = engine.backend
    be.ctx.make_current()
    rng = np.random.default_rng()
    ldx = c + x_off if ldx is None else ldx
    ldy = k + y_off if ldy is None else ldy
    x = rng.standard_normal((n, h, w, c)).astype(np.float16)
    wt = (rng.standard_normal((k, 3, 3, c)) / np.sqrt(9 * c)).astype(np.float16)
    b = rng.standard_normal(k).astype(np.float32) if bias else None

    x_wide = np.full((n, h, w, ldx), np.nan, np.float16)  # other channels: NaN, must never be read
    x_wide[..., x_off : x_off + c] = x
    w_buf = np.full(w_off + wt.size, np.nan, np.float16)
    w_buf[w_off:] = wt.reshape(-1)
    y_wide = np.full((n, h, w, ldy), SENTINEL, np.float16)
    y_wide[..., y_off : y_off + k] = np.nan  # poisoned: every element of the slice must be written
    dx, dw, dy = be.from_host(x_wide), be.from_host(w_buf), be.from_host(y_wide)
    db = be.from_host(b) if b is not None else None

    assert SPEC.variant("float16", n, h, w, c, k) == ENTRY
    cfg = SPEC.launch("float16", n, h, w, c, k, entry=ENTRY)
    args = SPEC.args(
        x=dx.ptr + 2 * x_off,
        w=dw.ptr + 2 * w_off,
        bias=None if db is None else db.ptr,
        y=dy.ptr + 2 * y_off,
        N=n, H=h, W=w, C=c, K=k, ldx=ldx, ldy=ldy, relu=relu,
    )  # fmt: skip
    smallc.launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
    got_wide = be.to_host(dy)

    got = got_wide[..., y_off : y_off + k]
    assert not np.isnan(got).any(), f"{int(np.isnan(got).sum())} outputs not written (or NaN read)"
    outside = np.delete(got_wide, np.s_[y_off : y_off + k], axis=3)
    assert (outside == SENTINEL).all(), "channels outside [0, K) of the output slice were written"
    ref64 = exact(x, wt, b, relu)
    err = np.abs(got.astype(np.float64) - ref64)
    bound = np.spacing(np.abs(ref64).astype(np.float16)).astype(np.float64) + ABS_SLACK
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"at {worst}: got {got[worst]}, exact {ref64[worst]}, bound {bound[worst]}"
    check = compare(ENTRY, SPEC.reference(x, wt, b, relu), got, REL_L2)
    assert check.passed, check


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("k", [8, 16, 32])
@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_smallc_odd_sizes(engine, smallc, c, k, relu) -> None:
    # 17 x 33: partial row and column tiles (a block is 16 x 64 pixels); N = 2: the image index
    _run(engine, smallc, 2, 17, 33, c, k, relu=relu)


@pytest.mark.parametrize(
    ("n", "h", "w", "c", "k"),
    [
        (1, 1, 1, 3, 32),  # one pixel: every tap but the centre is padding
        (3, 2, 9, 1, 4),  # K < 8: one partial channel group, element stores
        (2, 19, 70, 3, 24),  # three channel groups; 70 columns: a second column tile of 6
        (1, 33, 65, 4, 40),  # K > 32: a thread takes more than one unit
        (2, 9, 130, 3, 33),  # K % 8 == 1: the last group is one channel (element stores)
        (1, 16, 64, 3, 64),  # exactly one tile
        (1, 37, 129, 2, 128),  # the largest K
        (1, 128, 192, 3, 32),  # the U-Net's first layer on a smaller image: many blocks
    ],
)
def test_smallc_shapes(engine, smallc, n, h, w, c, k) -> None:
    _run(engine, smallc, n, h, w, c, k, relu=True)


def test_smallc_without_bias(engine, smallc) -> None:
    _run(engine, smallc, 2, 17, 33, 3, 32, relu=False, bias=False)


@pytest.mark.parametrize(
    ("n", "h", "w", "c", "k", "x_off", "ldx", "y_off", "ldy", "w_off"),
    [
        # the U-Net's skip concat: K channels at offset 0 / 32 of a 64-channel buffer (16-byte stores)
        (2, 17, 33, 3, 32, 0, 3, 0, 64, 0),
        (2, 17, 33, 3, 32, 0, 3, 32, 64, 0),
        # input slices: RGB inside RGBA (ldx 4), and at an odd offset of a wider buffer
        (1, 20, 41, 3, 16, 0, 4, 0, 16, 0),
        (2, 9, 14, 4, 8, 3, 11, 0, 8, 1),
        # misaligned outputs (element stores): odd offset, and ldy not a multiple of 8
        (2, 17, 33, 3, 32, 1, 5, 3, 40, 0),
        (1, 7, 70, 1, 16, 0, 1, 0, 20, 3),
        (2, 5, 6, 2, 5, 1, 4, 2, 12, 1),
    ],
)
def test_smallc_channel_slices(engine, smallc, n, h, w, c, k, x_off, ldx, y_off, ldy, w_off) -> None:
    _run(engine, smallc, n, h, w, c, k, relu=True, x_off=x_off, ldx=ldx, y_off=y_off, ldy=ldy, w_off=w_off)
