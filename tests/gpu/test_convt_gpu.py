"""The convt2x2 kernels (ONNX ConvTranspose 2x2, stride 2) on a real GPU against their numpy
semantics: fp16 and fp32, vector and scalar paths, odd sizes, batches, and channel-slice reads and
writes (ldx > C, ldy > K) whose neighbouring channels must survive. Outputs are poisoned first.

The module is loaded here from handwritten_ptx/ptx/<arch>/convt2x2_nhwc.ptx (the engine only loads
the kernels its bundle's plan lists); the engine provides the context, stream and memory pool."""

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

SPEC = kernels.KERNELS["convt2x2"]
# fp16 kernels accumulate in fp32 and round once, like the reference; fp32 sums in another order.
KERNEL_TOL = {"float16": 2e-3, "float32": 1e-5}
SENTINEL = -1234.5  # exactly representable in fp16 and fp32


@pytest.fixture(scope="module")
def convt(engine: Engine) -> Iterator[dict[str, Kernel]]:
    """Both entries, from the checked-in PTX for this device's arch, JIT-compiled by the driver."""
    with checked_in_ptx(engine, SPEC.stem) as mod:
        yield {entry: mod.function(entry) for entry in SPEC.entries}


def _run(
    engine: Engine,
    convt: dict[str, Kernel],
    dtype: str,
    n: int,
    h: int,
    w: int,
    c: int,
    k: int,
    *,
    bias: bool = True,
    x_off: int = 0,
    ldx: int | None = None,
    y_off: int = 0,
    ldy: int | None = None,
) -> None:
    """One launch on fresh random data; x read from channels [x_off, x_off+c) of an (n,h,w,ldx)
    buffer, y written to channels [y_off, y_off+k) of an (n,2h,2w,ldy) buffer whose other channels
    hold SENTINEL and whose own slice holds NaN before the launch."""
    be = engine.backend
    be.ctx.make_current()
    rng = np.random.default_rng()
    ldx = c + x_off if ldx is None else ldx
    ldy = k + y_off if ldy is None else ldy
    x = rng.standard_normal((n, h, w, c)).astype(dtype)
    w_onnx = (rng.standard_normal((c, k, 2, 2)) / np.sqrt(c)).astype(dtype)
    b = rng.standard_normal(k).astype(dtype) if bias else None
    wp, bp = kernels.pack_convt_weights(w_onnx, b)
    ref = SPEC.reference(x, wp, bp)
    assert ref.shape == SPEC.output_shape(n, h, w, c, k)

    x_wide = rng.standard_normal((n, h, w, ldx)).astype(dtype)  # other channels: noise, never read
    x_wide[..., x_off : x_off + c] = x
    y_wide = np.full((n, 2 * h, 2 * w, ldy), SENTINEL, dtype)
    y_wide[..., y_off : y_off + k] = np.nan  # poisoned: every element of the slice must be written
    item = np.dtype(dtype).itemsize
    dx, dw, dy = be.from_host(x_wide), be.from_host(wp), be.from_host(y_wide)
    db = be.from_host(bp) if bp is not None else None

    cfg = SPEC.launch(dtype, n, h, w, c, k)
    args = SPEC.args(
        x=dx.ptr + x_off * item,
        w=dw.ptr,
        bias=None if db is None else db.ptr,
        y=dy.ptr + y_off * item,
        N=n, H=h, W=w, C=c, K=k, ldx=ldx, ldy=ldy,
    )  # fmt: skip
    convt[SPEC.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
    got_wide = be.to_host(dy)

    got = got_wide[..., y_off : y_off + k]
    check = compare("convt2x2", ref, got, Tolerance(rel_l2=KERNEL_TOL[dtype], max_abs=1.0, mismatch=0))
    assert check.passed, check
    outside = np.delete(got_wide, np.s_[y_off : y_off + k], axis=3)
    assert (outside == SENTINEL).all(), "channels outside [0, K) of the output slice were written"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "k"),
    [
        (2, 7, 5, 3, 5),  # scalar path, odd everything
        (1, 32, 32, 64, 32),  # vector path, the decoder's shape
        (3, 16, 16, 40, 72),  # C % 8 == 0 but not a k-tile multiple; K tail of a channel tile
        (1, 8, 8, 512, 256),  # deep C: many pipeline stages
        (2, 33, 17, 24, 5),  # pixels not a tile multiple, tiny K
        (1, 1, 1, 1, 1),
        (2, 9, 11, 12, 130),  # fp32 vector path, fp16 scalar path (C % 8 != 0)
    ],
)
def test_convt2x2_kernel(engine, convt, dtype, n, h, w, c, k) -> None:
    _run(engine, convt, dtype, n, h, w, c, k)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_convt2x2_without_bias(engine, convt, dtype) -> None:
    _run(engine, convt, dtype, 2, 12, 10, 32, 24, bias=False)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "k", "x_off", "ldx", "y_off", "ldy"),
    [
        # aligned slices (16-byte chunks in and out): the U-Net's concat buffer [up | skip]
        (2, 16, 12, 64, 32, 0, 64, 0, 64),
        (1, 16, 16, 32, 16, 32, 96, 16, 48),
        # odd slices: element stores, and for fp16 element loads
        (2, 7, 9, 16, 5, 3, 21, 3, 11),
        (1, 5, 6, 3, 7, 1, 5, 2, 12),
    ],
)
def test_convt2x2_channel_slices(engine, convt, dtype, n, h, w, c, k, x_off, ldx, y_off, ldy) -> None:
    _run(engine, convt, dtype, n, h, w, c, k, x_off=x_off, ldx=ldx, y_off=y_off, ldy=ldy)
