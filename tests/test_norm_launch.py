"""The norm apply pass's launch (kernels/norm.py NormSpec.apply_launch) against the kernel's own map from a
thread to its work (handwritten_ptx/norm_nhwc.cu, norm_apply): image blockIdx.y; of the image's threads, the
first multiple of C/V keep channel vector i % (C/V) and stride over its pixels from i / (C/V) by their count
over C/V. Every (image, pixel, channel vector) must get exactly one thread, over shapes and GPU sizes no zoo
model has (C not a multiple of the block, more channel vectors than a block has threads, one pixel)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dualtrack import kernels
from dualtrack.errors import InputError

NORM = kernels.KERNELS["norm"]


def visits(N: int, H: int, W: int, C: int, V: int, sms: int) -> np.ndarray:
    """How many threads of the launch write each (image, pixel, channel vector), as norm_apply maps them."""
    dtype = "float16" if V == 8 else "float32"
    cfg = NORM.apply_launch(dtype, N, H, W, C, C, C, sms=sms)
    (bx, by, bz), (tx, ty, tz) = cfg.grid, cfg.block
    assert (by, bz, ty, tz) == (N, 1, 1, 1)
    cv, hw = C // V, H * W
    lanes = bx * tx // cv * cv
    assert lanes > 0, "the launch gives an image fewer threads than channel vectors"
    seen = np.zeros((N, hw, cv), np.int64)
    i = np.arange(lanes)
    for p0 in range(0, hw, lanes // cv):  # the k-th step of every thread at once
        p = p0 + i // cv
        ok = p < hw
        np.add.at(seen, (slice(None), p[ok], (i % cv)[ok]), 1)
    return seen


@pytest.mark.parametrize(
    ("N", "hw", "C", "V", "sms"),
    [
        (n, hw, c, v, sms)
        for n, hw, c, v, sms in itertools.product(
            (1, 3), ((1, 1), (5, 7), (33, 20)), (8, 24, 200, 4104), (1, 8), (0, 2, 132)
        )
        if not (v == 8 and c % 8)
    ],
)
def test_every_item_of_the_apply_pass_gets_exactly_one_thread(
    N: int, hw: tuple[int, int], C: int, V: int, sms: int
) -> None:
    assert (visits(N, *hw, C, V, sms) == 1).all()


def test_a_gpu_size_makes_threads_stream_several_pixels_and_none_is_idle_beyond_a_block() -> None:
    """At 512x512 x 32 channels, batch 8, on 132 SMs: about two full waves, each thread streaming pixels."""
    cfg = NORM.apply_launch("float16", 8, 512, 512, 32, 32, 32, sms=132)
    threads = cfg.grid[0] * cfg.block[0]
    assert cfg.grid[1] == 8 and 512 * 512 * 4 / threads > 4
    assert cfg.grid[0] * cfg.grid[1] * cfg.block[0] <= 2 * 132 * 2048 + 8 * cfg.block[0]


def test_a_batch_past_the_grid_is_refused_with_the_fix() -> None:
    with pytest.raises(InputError, match="split the batch"):
        NORM.apply_launch("float16", 70000, 4, 4, 8, 8, 8, sms=132)
