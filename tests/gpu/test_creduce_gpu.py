"""The channel reduction kernel (handwritten_ptx/creduce_nhwc.cu: each Reduce op of REDUCE_OPS over the
channels of each pixel) on a real GPU against its numpy reference (kernels.creduce),
read from channel slices and written into one channel of a wider output (a Concat's, as CBAM's
[max, mean] pair is): the output is poisoned (NaN inside, a sentinel outside), so an element not written,
or one written outside the slice, fails. Shapes no zoo model has: C 1, 3, 5, 8, 40, 264; odd pictures;
batches 1 and 3; slices that keep (8) or break (3, 4) the fp16 entry's 16-byte path.

Tolerance: max and min exact (a comparison, no rounding); the sums (L1, L2, sum of squares too: fp32 sums
in channel order, one rounding) fp16 rel-L2 2e-3 / max |diff| 1e-2, fp32 1e-5 / 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_ptx import Slices, checked_in_entries

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.contract.plan import REDUCE_OPS
from dualtrack.runtime.engine import Engine

CREDUCE = kernels.KERNELS["creduce"]
TOL = {
    "float16": Tolerance(rel_l2=2e-3, max_abs=1e-2, mismatch=0),
    "float32": Tolerance(rel_l2=1e-5, max_abs=1e-4, mismatch=0),
}


@pytest.fixture(scope="module")
def mods(engine: Engine):
    with checked_in_entries(engine, ("creduce_nhwc",)) as found:
        yield found


def run(mods, s: Slices, x: np.ndarray, op: int, out_channels: int = 1) -> np.ndarray:
    """The kernel on ``x`` (in a channel slice) writing channel 0 of an ``out_channels``-wide output slice."""
    n, h, w, c = x.shape
    px, ldx = s.input(x)
    py, ldy = s.output((n, h, w, out_channels))
    cfg = CREDUCE.launch(s.dtype, n, h, w, c)
    args = CREDUCE.args(x=px, y=py, N=n, H=h, W=w, C=c, K=1, ldx=ldx, ldy=ldy, op=op)
    mods[CREDUCE.entry(s.dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
    return s.result()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 3, 4, 8])
@pytest.mark.parametrize("op", list(REDUCE_OPS))
@pytest.mark.parametrize(
    ("n", "h", "w", "c"), [(1, 37, 23, 5), (3, 16, 16, 40), (1, 9, 7, 264), (2, 5, 3, 1), (1, 64, 48, 8)]
)
def test_creduce_kernel(engine, mods, dtype, off, op, n, h, w, c) -> None:
    s = Slices(engine, dtype, off)
    x = (2 * s.rng.standard_normal((n, h, w, c)) + 0.5).astype(dtype)
    ref = CREDUCE.reference(x, op=REDUCE_OPS[op])
    got = run(mods, s, x, REDUCE_OPS[op])
    if op in ("ReduceMax", "ReduceMin"):
        np.testing.assert_array_equal(got, ref)
    else:
        result = compare(f"creduce {op}", ref, got, TOL[dtype])
        assert result.passed, result


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_one_channel_of_a_wider_output_and_nan_propagation(engine, mods, dtype) -> None:
    """CBAM's pair: max into channel 0 of a 2-channel output slice, the other channel untouched (NaN
    poison stays: result() checks the sentinels outside, here the second channel inside); a NaN in a
    pixel's channels comes out of max and min as NaN, as ONNX's reference gives."""
    s = Slices(engine, dtype, 2)
    x = s.rng.standard_normal((2, 6, 10, 24)).astype(dtype)
    x[0, 1, 2, 5] = np.nan
    for op in ("ReduceMax", "ReduceMin"):
        got = run(mods, s, x, REDUCE_OPS[op], out_channels=2)
        assert np.isnan(got[..., 1]).all(), "the second output channel was written"
        ref = CREDUCE.reference(x, op=REDUCE_OPS[op])
        np.testing.assert_array_equal(got[..., :1], ref)
        assert np.isnan(got[0, 1, 2, 0])
