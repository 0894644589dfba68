"""The seghead kernel (a segmentation head's softmax / sigmoid / none, probabilities and class mask) on
a real GPU against its numpy semantics (kernels.SegHeadSpec.reference): 2, 3, 9 and 21 classes (each of
the kernel's paths), fp16 and
fp32 logits, odd sizes, logits read from a channel slice (ldx > C), the reference U-Net's fp16
roundings, a one-class threshold, ties and large values. Both outputs are poisoned first (NaN
probabilities, mask 255), so an element the kernel does not write fails. Then the tiny fp16 U-Net
with `partition: auto` (its plan ends in the seghead call) through the engine: masks equal to the
CPU engine's and probabilities within tolerance, verification against onnxruntime passing.

The module is loaded from handwritten_ptx/ptx/<arch>/seghead_nhwc.ptx; the tiny bundle's engine
provides the context, stream and memory pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_ptx import checked_in_ptx

from dualtrack import kernels
from dualtrack.compiler.verify import compare_outputs, random_input, verify_engine
from dualtrack.kernels import HeadMode
from dualtrack.runtime.engine import Engine

SPEC = kernels.KERNELS["seghead"]
# fp32 math like the reference; expf (2 ulp) against numpy's exp and the order of nothing else.
PROBS_TOL = {"float32": 2e-6, "float16": 2.0**-11}  # fp16: one ulp of a rounded probability below 1


@pytest.fixture(scope="module")
def mod(engine: Engine):
    with checked_in_ptx(engine, SPEC.stem) as m:
        yield {entry: m.function(entry) for entry in SPEC.entries}


def run_kernel(engine: Engine, mod, x: np.ndarray, mode: HeadMode, off: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel on ``x`` (N, H, W, C) read from channels [off, off + C) of a wider tensor (noise
    around them); outputs poisoned first."""
    be, rng = engine.backend, np.random.default_rng()
    be.ctx.make_current()
    n, h, w, c = x.shape
    ld = c + 2 * off
    wide = rng.standard_normal((n, h, w, ld)).astype(x.dtype) * 100
    wide[..., off : off + c] = x
    dx = be.from_host(wide)
    probs = be.from_host(np.full((n, c, h, w), np.nan, mode.probs_dtype))
    mask = be.from_host(np.full((n, h, w), 255, np.uint8))
    args = SPEC.args(
        x=dx.ptr + off * x.dtype.itemsize, probs=probs.ptr, mask=mask.ptr, N=n, H=h, W=w, C=c, ldx=ld, mode=mode
    )
    cfg = SPEC.launch(x.dtype, n, h, w, c)
    mod[SPEC.entry(x.dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
    return be.to_host(probs), be.to_host(mask)


MODES = {
    "softmax": HeadMode("softmax"),
    "softmax_fp16_rounded": HeadMode("softmax", round_probs=True, round_arg=True),  # the reference U-Net's
    "softmax_in_fp16": HeadMode("softmax", round_in=True),
    "sigmoid": HeadMode("sigmoid"),
    "none_fp16_probs": HeadMode("none", probs_dtype="float16"),
}


@pytest.mark.parametrize("classes", [2, 3, 9, 21])  # registers for C <= 4 and C <= 16, re-reads above
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize("kind", ["random", "ties", "large"])
def test_kernel_matches_its_numpy_semantics(
    engine: Engine, mod, classes: int, dtype: str, mode: str, off: int, kind: str
) -> None:
    rng = np.random.default_rng()
    shape = (3, 7, 13, classes)  # odd sizes: 273 pixels, two blocks' worth
    if kind == "ties":
        x = rng.integers(-2, 3, size=shape).astype(dtype)
    elif kind == "large":
        x = rng.uniform(-6e4 if dtype == "float16" else -1e4, 6e4 if dtype == "float16" else 1e4, shape).astype(dtype)
    else:
        x = (rng.standard_normal(shape) * 3).astype(dtype)
    how = MODES[mode]
    ref_p, ref_m = SPEC.reference(x, how)
    got_p, got_m = run_kernel(engine, mod, x, how, off)
    tol = PROBS_TOL["float16" if how.round_probs or how.probs_dtype == "float16" else "float32"]
    assert got_p.shape == ref_p.shape and got_p.dtype == ref_p.dtype
    assert np.isfinite(got_p.astype(np.float32)).all(), "a probability was not written"
    err = np.abs(got_p.astype(np.float64) - ref_p.astype(np.float64))
    assert err.max() <= tol, (err.max(), tol)
    top = np.sort(ref_p.astype(np.float64), axis=1)
    decided = top[:, -1] - top[:, -2] > 2 * tol
    assert (got_m < classes).all(), "a mask byte was not written"
    assert np.array_equal(got_m[decided], ref_m[decided])
    if kind == "ties" and how.act == "none":  # equal logits, bit-equal values: the first class, exactly
        assert np.array_equal(got_m, ref_m)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_one_class_threshold_and_nan_logits(engine: Engine, mod, dtype: str) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 5, 9, 1)).astype(dtype)
    how = HeadMode("sigmoid", threshold=0.5)
    ref_p, ref_m = SPEC.reference(x, how)
    got_p, got_m = run_kernel(engine, mod, x, how, 1)
    assert np.abs(got_p - ref_p).max() <= 2e-6
    assert np.array_equal(got_m, ref_m)
    y = (rng.standard_normal((1, 3, 5, 3)) * 2).astype(dtype)
    y[0, 0, 0, 0] = y[0, 1, 1, 1] = y[0, 2, 2, 2] = np.nan
    for act in ("softmax", "none"):
        ref_p, ref_m = SPEC.reference(y, HeadMode(act))
        got_p, got_m = run_kernel(engine, mod, y, HeadMode(act), 0)
        assert np.array_equal(np.isnan(got_p), np.isnan(ref_p))
        assert np.array_equal(got_m, ref_m)  # onnxruntime's: a NaN is never chosen after class 0


# --- through the engine: the tiny fp16 U-Net with `partition: auto` -------------------------------------


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_with_the_head_on_track_a_matches_the_cpu_engine(
    tiny_head_bundle: Path, graphs: bool, monkeypatch
) -> None:
    monkeypatch.setenv("DUALTRACK_CUDA_GRAPHS", "1" if graphs else "0")
    with Engine.load(tiny_head_bundle, "cuda") as gpu, Engine.load(tiny_head_bundle, "cpu") as cpu:
        assert gpu.plan.segments[-1].track == "A" and gpu.plan.segments[-1].calls[-1].op == "seghead"
        report = verify_engine(gpu, samples=2, interpret=False)  # poisons Track A outputs itself
        assert report.passed, "\n".join(report.lines())
        tol = report.tolerance  # the fp16 tolerance verification holds the engine to
        for batch in gpu.plan.batch_sizes:
            x = random_input(gpu.input_spec, batch, np.random.default_rng())
            want, got = cpu.run(x), gpu.run(x)
            assert got["probs"].shape == want["probs"].shape == (batch, 2, 64, 64)  # NCHW, the model's layout
            checks = compare_outputs(f"b{batch}", "gpu vs cpu", want, {k: got[k] for k in ("probs", "mask")}, tol)
            assert all(c.passed for c in checks), checks
            mask = next(c for c in checks if " mask " in c.name)
            assert mask.mismatch == 0.0, mask  # equal wherever the CPU engine's top two classes are apart
