"""The general conv's stem entries (``conv_nhwc_f16_stem``, ``_stem_narrow``: C <= 8, conv_stem.cuh)
on a real GPU against onnxruntime fp32 (Conv, then Add of the residual, then the activation node) on
fresh random inputs, over shapes no zoo model has: C in 1..8, 1x1 to 11x11 windows, strides 1-4,
dilation 2, asymmetric padding, odd image sizes, K with and without a tail of 8, batch 1 and 3,
with and without bias and residual, LeakyReLU(alpha) and Clip(min, max), x and the residual read
from channel slices (odd and 16-byte strides), the output written into a channel slice of a wider
tensor whose other channels must survive (its own channels are NaN before
the launch, so every element must be written). Tolerance: fp16 output, fp32 accumulation: relative
L2 <= 2e-3 against fp32 onnxruntime on the same (fp16-rounded) inputs.

Also the pick: ResNet's and MONAI's stems go to a stem entry by themselves (ConvGeneralSpec.variant)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from conv_ort import ort_reference
from gpu_ptx import SENTINEL, checked_in_ptx

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.kernels import Activation, ConvGeometry
from dualtrack.runtime.driver import Kernel
from dualtrack.runtime.engine import Engine

SPEC = kernels.KERNELS["conv"]
assert isinstance(SPEC, kernels.ConvGeneralSpec)
TOL = Tolerance(rel_l2=2e-3, max_abs=0.25, mismatch=0)
STEM, NARROW = "conv_nhwc_f16_stem", "conv_nhwc_f16_stem_narrow"


def g(R: int, S: int, stride=(1, 1), dil=(1, 1), pads=(0, 0, 0, 0)) -> ConvGeometry:
    return ConvGeometry(R, S, *stride, *dil, *pads)


@pytest.fixture(scope="module")
def conv(engine: Engine) -> Iterator[dict[str, Kernel]]:
    with checked_in_ptx(engine, SPEC.stem) as mod:
        yield {entry: mod.function(entry) for entry in SPEC.stem_tiles()}


def _in_slice(rng, a: np.ndarray, where: tuple[int, int]) -> np.ndarray:
    """``a`` as channels ``off .. off + C`` of a wider buffer of noise (``where`` = (off, extra after))."""
    off, extra = where
    wide = rng.standard_normal((*a.shape[:3], off + a.shape[3] + extra)).astype(a.dtype)
    wide[..., off : off + a.shape[3]] = a
    return wide


def run_case(
    engine, conv, shape, geom, *, entry=None, act=None, residual=False, bias=True, y_slice=(0, 0), in_slice=(0, 0)
) -> str:
    """One launch on fresh random data against onnxruntime; the entry launched (None: the chooser's).
    ``in_slice``: x and the residual as channel slices of wider buffers (offset, extra channels after)."""
    be = engine.backend
    be.ctx.make_current()
    rng = np.random.default_rng()
    n, h, w, c, k = shape
    _, p, q, _ = SPEC.output_shape(n, h, w, c, k, geom=geom)
    x = rng.standard_normal((n, h, w, c)).astype(np.float16)
    w_onnx = (rng.standard_normal((k, c, geom.R, geom.S)) / np.sqrt(c * geom.R * geom.S)).astype(np.float16)
    b = rng.standard_normal(k).astype(np.float32) if bias else None
    res = rng.standard_normal((n, p, q, k)).astype(np.float16) if residual else None
    want = ort_reference(x, w_onnx, b, res, geom, act)

    wp, bp = kernels.pack_conv_weights(w_onnx, b, any_size=True)
    yo, ye = y_slice
    ldy = yo + k + ye
    y_wide = np.full((n, p, q, ldy), SENTINEL, np.float16)
    y_wide[..., yo : yo + k] = np.nan
    xo, dx, dw, dy = in_slice[0] * 2, be.from_host(_in_slice(rng, x, in_slice)), be.from_host(wp), be.from_host(y_wide)
    db = be.from_host(bp) if bp is not None else None
    dr = be.from_host(_in_slice(rng, res, in_slice)) if res is not None else None
    ldx, ldr = sum(in_slice) + c, sum(in_slice) + k
    code = Activation() if act is None else Activation.named(*act)
    entry = entry or SPEC.variant("float16", n, h, w, c, k, geom)
    cfg = SPEC.launch("float16", n, h, w, c, k, geom=geom, entry=entry, device=be.device.info())
    args = SPEC.args(
        x=dx.ptr + xo, w=dw.ptr, bias=None if db is None else db.ptr, res=None if dr is None else dr.ptr + xo,
        y=dy.ptr + yo * 2, N=n, H=h, W=w, C=c, K=k, geom=geom, ldx=ldx, ldy=ldy, ldr=ldr, act=code,
    )  # fmt: skip
    conv[entry].launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
    got_wide = be.to_host(dy)
    got = got_wide[..., yo : yo + k]
    check = compare(f"conv {entry}", want, got, TOL)
    assert check.passed, check
    outside = np.delete(got_wide, np.s_[yo : yo + k], axis=3)
    assert (outside == SENTINEL).all(), "channels outside the output slice were written"
    return entry


CASES = {
    # (N, H, W, C, K), geometry, keywords
    "7x7s2_c3_k64_leaky_slice": ((1, 37, 53, 3, 64), g(7, 7, (2, 2), pads=(3, 3, 3, 3)),
                                 {"act": ("leakyrelu", 0.1, 0.0), "y_slice": (8, 24)}),
    "3x3s2_c1_k16_clip_res": ((3, 37, 53, 1, 16), g(3, 3, (2, 2), pads=(1, 1, 1, 1)),
                              {"act": ("clip", -0.5, 0.75), "residual": True, "in_slice": (3, 2)}),
    "5x5s1_c2_k24_nobias": ((1, 29, 31, 2, 24), g(5, 5, pads=(2, 2, 2, 2)), {"bias": False}),
    "3x5s3_asym_c5_k72_res_slice": ((3, 37, 53, 5, 72), g(3, 5, (3, 1), pads=(0, 2, 2, 1)),
                                    {"act": ("relu", 0.0, 0.0), "residual": True, "y_slice": (4, 4),
                                     "in_slice": (8, 0)}),
    "1x1s4_c7_k96": ((1, 37, 53, 7, 96), g(1, 1, (4, 4)), {"act": ("leakyrelu", 0.2, 0.0)}),
    "3x3dil2_c4_k8": ((3, 21, 19, 4, 8), g(3, 3, dil=(2, 2), pads=(2, 1, 2, 3)), {"residual": True}),
    "11x11s4_c1_k20_tail": ((1, 67, 61, 1, 20), g(11, 11, (4, 4), pads=(5, 5, 2, 2)),
                            {"act": ("clip", 0.0, 6.0), "y_slice": (3, 5)}),
    "7x7s2_c8_k64": ((1, 37, 53, 8, 64), g(7, 7, (2, 2), pads=(3, 3, 3, 3)), {"act": ("relu", 0.0, 0.0)}),
    "5x5s2_dil2_c3_k13_tail_res": ((3, 33, 35, 3, 13), g(5, 5, (2, 2), (2, 2), pads=(4, 4, 3, 4)),
                                   {"residual": True, "act": ("leakyrelu", 0.01, 0.0)}),
}  # fmt: skip


@pytest.mark.parametrize("entry", [STEM, NARROW])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_stem_entries_match_onnxruntime(engine, conv, entry: str, case: str) -> None:
    shape, geom, kw = CASES[case]
    if SPEC.stem_tiles()[entry].refusal(shape[3], geom) is not None:
        pytest.skip(f"{entry} does not take {case}: {SPEC.stem_tiles()[entry].refusal(shape[3], geom)}")
    run_case(engine, conv, shape, geom, entry=entry, **kw)


def test_resnet_and_monai_stems_pick_a_stem_entry(engine, conv) -> None:
    resnet = g(7, 7, (2, 2), pads=(3, 3, 3, 3))
    monai = g(3, 3, (2, 2), pads=(1, 1, 1, 1))
    assert run_case(engine, conv, (2, 96, 80, 3, 64), resnet, act=("relu", 0.0, 0.0)) == STEM
    assert run_case(engine, conv, (2, 96, 80, 3, 16), monai, act=("leakyrelu", 0.01, 0.0)) == NARROW
