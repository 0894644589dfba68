"""The conv1x1 kernels (a segmentation head: ONNX Conv 1x1, stride 1, no padding) on a real GPU
against their numpy semantics: fp16 and fp32, vector and scalar paths, K over several channel
groups, ReLU, no bias, and channel-slice reads and writes (ldx > C, ldy > K) whose neighbouring
channels must survive. Outputs are poisoned first.

The module is loaded here from handwritten_ptx/ptx/<arch>/conv1x1_nhwc.ptx (the engine only loads
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

SPEC = kernels.KERNELS["conv1x1"]
# Both accumulate in fp32 and round once, like the reference; only the summation order differs.
KERNEL_TOL = {"float16": 2e-3, "float32": 1e-5}
SENTINEL = -1234.5  # exactly representable in fp16 and fp32


@pytest.fixture(scope="module")
def conv1x1(engine: Engine) -> Iterator[dict[str, Kernel]]:
    """Both entries, from the checked-in PTX for this device's arch, JIT-compiled by the driver."""
    with checked_in_ptx(engine, SPEC.stem) as mod:
        yield {entry: mod.function(entry) for entry in SPEC.entries}


def _run(
    engine: Engine,
    conv1x1: dict[str, Kernel],
    dtype: str,
    n: int,
    h: int,
    w: int,
    c: int,
    k: int,
    *,
    bias: bool = True,
    relu: bool = False,
    x_off: int = 0,
    ldx: int | None = None,
    y_off: int = 0,
    ldy: int | None = None,
) -> None:
    """One launch on fresh random data; x read from channels [x_off, x_off+c) of an (n,h,w,ldx)
    buffer, y written to channels [y_off, y_off+k) of an (n,h,w,ldy) buffer whose other channels
    hold SENTINEL and whose own slice holds NaN before the launch."""
    be = engine.backend
    be.ctx.make_current()
    rng = np.random.default_rng()
    ldx = c + x_off if ldx is None else ldx
    ldy = k + y_off if ldy is None else ldy
    x = rng.standard_normal((n, h, w, c)).astype(dtype)
    w_onnx = (rng.standard_normal((k, c, 1, 1)) / np.sqrt(c)).astype(dtype)
    b = rng.standard_normal(k).astype(dtype) if bias else None
    wp, bp = kernels.pack_conv_weights(w_onnx, b)
    ref = SPEC.reference(x, wp, bp, relu)
    assert ref.shape == SPEC.output_shape(n, h, w, c, k)
    if relu:
        assert (ref == 0).any() and (ref > 0).any()  # the test would not see a missing ReLU otherwise

    x_wide = rng.standard_normal((n, h, w, ldx)).astype(dtype)  # other channels: noise, never read
    x_wide[..., x_off : x_off + c] = x
    y_wide = np.full((n, h, w, ldy), SENTINEL, dtype)
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
        N=n, H=h, W=w, C=c, K=k, ldx=ldx, ldy=ldy, relu=relu,
    )  # fmt: skip
    conv1x1[SPEC.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
    got_wide = be.to_host(dy)

    got = got_wide[..., y_off : y_off + k]
    check = compare("conv1x1", ref, got, Tolerance(rel_l2=KERNEL_TOL[dtype], max_abs=1.0, mismatch=0))
    assert check.passed, check
    outside = np.delete(got_wide, np.s_[y_off : y_off + k], axis=3)
    assert (outside == SENTINEL).all(), "channels outside the output slice were written"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "k"),
    [
        (1, 64, 64, 32, 2),  # the reference U-Net's head (at 64x64): vector path, one channel group
        (2, 7, 5, 3, 5),  # scalar path, odd everything, two channel groups
        (3, 16, 16, 40, 9),  # C % 8 == 0 but not % 16 (fp16 vectors of 8), three groups, one partial
        (1, 8, 8, 512, 4),  # the widest C the kernel takes
        (1, 1, 1, 1, 1),
        (2, 9, 11, 12, 130),  # fp32 vector path, fp16 scalar path (C % 8 != 0), many groups
    ],
)
def test_conv1x1_kernel(engine, conv1x1, dtype, n, h, w, c, k) -> None:
    _run(engine, conv1x1, dtype, n, h, w, c, k)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_conv1x1_relu_and_no_bias(engine, conv1x1, dtype) -> None:
    _run(engine, conv1x1, dtype, 2, 12, 10, 32, 6, relu=True)
    _run(engine, conv1x1, dtype, 2, 12, 10, 32, 6, bias=False)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "k", "x_off", "ldx", "y_off", "ldy"),
    [
        (2, 16, 12, 32, 2, 32, 64, 0, 8),  # aligned input slice: the vector path
        (1, 5, 6, 16, 3, 3, 21, 2, 12),  # odd input slice: element loads
    ],
)
def test_conv1x1_channel_slices(engine, conv1x1, dtype, n, h, w, c, k, x_off, ldx, y_off, ldy) -> None:
    _run(engine, conv1x1, dtype, n, h, w, c, k, x_off=x_off, ldx=ldx, y_off=y_off, ldy=ldy)
