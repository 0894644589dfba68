"""The general conv kernels (op ``conv``, conv_nhwc.cu) on a real GPU against their numpy
reference: every fp16 tile entry and the fp32 entry, the vector path (C % 8 == 0) and the scalar
one (the RGB stem, odd C), ResNet's layer shapes (7x7/2, 3x3/2, 1x1/2, 3x3/1 + residual), odd
sizes, dilation and asymmetric padding, every activation, and channel slices for x, the residual
and y (ldx, ldr, ldy wider than the tensor) whose other channels must survive. Outputs are
poisoned (NaN) first, so every element must be written.

The module is loaded from handwritten_ptx/ptx/<arch>/conv_nhwc.ptx (the engine only loads the
kernels its bundle's plan lists); the engine provides the context, stream and memory pool."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gpu_ptx import checked_in_ptx

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.kernels import ACTIVATIONS, ConvGeometry
from dualtrack.runtime.driver import Kernel
from dualtrack.runtime.engine import Engine

SPEC = kernels.KERNELS["conv"]
assert isinstance(SPEC, kernels.ConvGeneralSpec)
# fp32 accumulation and one rounding on both sides; only the summation order differs (and expf).
KERNEL_TOL = {"float16": 2e-3, "float32": 1e-5}
SENTINEL = -1234.5  # exactly representable in fp16 and fp32
F16_ENTRIES = tuple(SPEC.f16_tiles())


def pads(t: int, left: int, b: int, r: int) -> dict[str, int]:
    return {"pad_top": t, "pad_left": left, "pad_bottom": b, "pad_right": r}


STEM = ConvGeometry(7, 7, 2, 2, **pads(3, 3, 3, 3))
S2 = ConvGeometry(3, 3, 2, 2, **pads(1, 1, 1, 1))
DOWN = ConvGeometry(1, 1, 2, 2)
S1 = ConvGeometry(3, 3, **pads(1, 1, 1, 1))
ODD = ConvGeometry(5, 3, 1, 2, 2, 1, **pads(3, 0, 1, 2))


@pytest.fixture(scope="module")
def conv(engine: Engine) -> Iterator[dict[str, Kernel]]:
    """Every entry, from the checked-in PTX for this device's arch, JIT-compiled by the driver."""
    with checked_in_ptx(engine, SPEC.stem) as mod:
        yield {entry: mod.function(entry) for entry in SPEC.entries}


def _wide(rng, n: int, h: int, w: int, width: int, dtype: str, fill: float | None = None) -> np.ndarray:
    """An (n, h, w, width) buffer: random noise, or ``fill``."""
    if fill is not None:
        return np.full((n, h, w, width), fill, dtype)
    return rng.standard_normal((n, h, w, width)).astype(dtype)


def _run(
    engine: Engine,
    conv: dict[str, Kernel],
    dtype: str,
    shape: tuple[int, int, int, int, int],
    geom: ConvGeometry,
    *,
    entry: str | None = None,
    act: str = "relu",
    residual: bool = True,
    bias: bool = True,
    x_slice: tuple[int, int] = (0, 0),  # (offset, extra channels after) of x in a wider buffer
    y_slice: tuple[int, int] = (0, 0),
    r_slice: tuple[int, int] = (0, 0),
) -> None:
    """One launch on fresh random data against the reference; channels outside y's slice hold
    SENTINEL, its own channels NaN before the launch."""
    be = engine.backend
    be.ctx.make_current()
    rng = np.random.default_rng()
    n, h, w, c, k = shape
    _, p, q, _ = SPEC.output_shape(n, h, w, c, k, geom=geom)
    x = rng.standard_normal((n, h, w, c)).astype(dtype)
    w_onnx = (rng.standard_normal((k, c, geom.R, geom.S)) / np.sqrt(c * geom.R * geom.S)).astype(dtype)
    b = rng.standard_normal(k).astype(np.float32) if bias else None
    res = rng.standard_normal((n, p, q, k)).astype(dtype) if residual else None
    wp, bp = kernels.pack_conv_weights(w_onnx, b, any_size=True)
    code = kernels.Activation.named(act)  # ONNX's default parameters
    ref = SPEC.reference(x, wp, bp, res, geom=geom, act=code)

    item = np.dtype(dtype).itemsize
    (xo, xe), (yo, ye), (ro, re) = x_slice, y_slice, r_slice
    x_wide = _wide(rng, n, h, w, xo + c + xe, dtype)  # other channels: noise, never read
    x_wide[..., xo : xo + c] = x
    y_wide = _wide(rng, n, p, q, yo + k + ye, dtype, SENTINEL)
    y_wide[..., yo : yo + k] = np.nan  # poisoned: every element of the slice must be written
    dx, dw, dy = be.from_host(x_wide), be.from_host(wp), be.from_host(y_wide)
    db = be.from_host(bp) if bp is not None else None
    dr = None
    if res is not None:
        r_wide = _wide(rng, n, p, q, ro + k + re, dtype)
        r_wide[..., ro : ro + k] = res
        dr = be.from_host(r_wide)

    entry = entry or SPEC.variant(dtype, n, h, w, c, k, geom)
    cfg = SPEC.launch(dtype, n, h, w, c, k, geom=geom, entry=entry)
    args = SPEC.args(
        x=dx.ptr + xo * item, w=dw.ptr, bias=None if db is None else db.ptr,
        res=None if dr is None else dr.ptr + ro * item, y=dy.ptr + yo * item,
        N=n, H=h, W=w, C=c, K=k, geom=geom, ldx=xo + c + xe, ldy=yo + k + ye, ldr=ro + k + re, act=code,
    )  # fmt: skip
    conv[entry].launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
    got_wide = be.to_host(dy)

    got = got_wide[..., yo : yo + k]
    check = compare(f"conv {entry}", ref, got, Tolerance(rel_l2=KERNEL_TOL[dtype], max_abs=1.0, mismatch=0))
    assert check.passed, check
    outside = np.delete(got_wide, np.s_[yo : yo + k], axis=3)
    assert (outside == SENTINEL).all(), "channels outside the output slice were written"


@pytest.mark.parametrize("entry", F16_ENTRIES)
@pytest.mark.parametrize(
    ("shape", "geom"),
    [
        ((2, 37, 29, 64, 72), S1),  # vector path, K not a multiple of any tile, odd image
        ((1, 33, 35, 24, 130), S2),  # stride 2 on odd sizes, C % BK != 0
        ((2, 20, 18, 3, 40), STEM),  # the RGB stem: scalar path
        ((1, 17, 15, 13, 9), ODD),  # scalar path, dilation, asymmetric padding, stride (1, 2)
    ],
    ids=["3x3s1", "3x3s2", "7x7s2_c3", "5x3_dil_asym"],
)
def test_every_f16_tile_on_odd_shapes(engine, conv, entry, shape, geom) -> None:
    _run(engine, conv, "float16", shape, geom, entry=entry)


@pytest.mark.parametrize(
    ("shape", "geom", "residual"),
    [
        ((1, 128, 128, 3, 64), STEM, False),  # smp's stem at 256x256
        ((2, 64, 64, 64, 64), S1, True),  # layer1 basic block conv2 + residual
        ((2, 64, 64, 64, 128), S2, False),  # layer2's first conv
        ((2, 64, 64, 64, 128), DOWN, False),  # layer2's downsample
        ((1, 16, 16, 256, 512), S2, False),  # layer4's first conv: few pixels, small tiles
    ],
    ids=["stem", "block", "s2", "downsample", "deep"],
)
def test_resnet_layers(engine, conv, shape, geom, residual) -> None:
    _run(engine, conv, "float16", shape, geom, residual=residual)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_every_activation(engine, conv, dtype, act) -> None:
    _run(engine, conv, dtype, (1, 19, 21, 16, 24), S1, act=act)


@pytest.mark.parametrize(
    ("shape", "geom"),
    [((2, 37, 29, 64, 72), S1), ((2, 20, 18, 3, 40), STEM), ((1, 17, 15, 13, 9), ODD), ((1, 9, 9, 8, 5), DOWN)],
)
def test_f32_entry(engine, conv, shape, geom) -> None:
    _run(engine, conv, "float32", shape, geom)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("x_slice", "y_slice", "r_slice"),
    [
        ((64, 0), (0, 32), (32, 0)),  # aligned slices: 16-byte paths everywhere (a concat's halves)
        ((3, 2), (5, 1), (1, 6)),  # odd slices: element loads and stores
    ],
    ids=["aligned", "odd"],
)
def test_channel_slices(engine, conv, dtype, x_slice, y_slice, r_slice) -> None:
    _run(engine, conv, dtype, (2, 14, 12, 32, 40), S2, x_slice=x_slice, y_slice=y_slice, r_slice=r_slice)


def test_no_bias_no_residual_no_activation(engine, conv) -> None:
    _run(engine, conv, "float16", (1, 12, 12, 16, 16), S1, act="none", residual=False, bias=False)


@pytest.mark.parametrize(
    ("shape", "geom", "x_slice", "y_slice"),
    [
        ((2, 37, 29, 16, 2), S1, (0, 0), (0, 0)),  # a segmentation head: vector loads, K=2
        ((1, 33, 35, 24, 8), S2, (8, 0), (3, 1)),  # K at the limit, stride 2, x and y in slices
        ((2, 20, 18, 3, 5), STEM, (0, 0), (0, 0)),  # C % 8 != 0: element loads
        ((1, 17, 15, 13, 3), ODD, (1, 2), (2, 0)),  # dilation, asymmetric padding, odd slices
    ],
    ids=["head", "k8_s2_slices", "c3", "odd"],
)
@pytest.mark.parametrize("act", ["none", "relu", "hardswish"])
def test_direct_entry_for_few_output_channels(engine, conv, shape, geom, x_slice, y_slice, act) -> None:
    n, h, w, c, k = shape
    assert SPEC.variant("float16", n, h, w, c, k, geom) == SPEC.direct_entry  # the policy picks it
    _run(engine, conv, "float16", shape, geom, act=act, x_slice=x_slice, y_slice=y_slice)
