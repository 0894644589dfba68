"""Split-K of the general conv on a real GPU (conv_nhwc.cu's tile entries writing fp32 slices into
the call's workspace, then ``conv_nhwc_f16_splitk``) against onnxruntime fp32 (Conv, Add of the
residual, the activation node) on fresh random inputs, over shapes no zoo model has: PAN's deep
one-channel 7x7 (512 -> 1 on 8x8, N=1 and 3), a 5x5 stride-2 96 -> 3 on 5x7 with a residual, a
grouped 3x3 1000 -> 40 in two groups on 4x4 (500 channels a group: the scalar path), a 1x1
2048 -> 16 on 2x2 with LeakyReLU(0.1); x, the residual and y in channel slices (ldy > K: the
other channels must survive, the slice's own are NaN before the launch), and the workspace NaN
before the launch (every slice element must be written before the sum reads it).

Each case also runs the same entry unsplit: the two differ only in the fp32 summation order, so
they agree to fp16 rounding (rel L2 <= 1e-3), and a second split run is bit-identical (the slices
are added in a fixed order). Tolerance against onnxruntime: fp16 output, fp32 accumulation,
relative L2 <= 2e-3 (the general conv's GPU tests' bound) and no element off by more than 0.25."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from conv_ort import ort_reference
from gpu_ptx import Slices, checked_in_entries

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.contract.plan import KernelCall
from dualtrack.kernels import Activation, ConvChoice, ConvGeometry
from dualtrack.runtime.driver import Kernel
from dualtrack.runtime.tensors import GpuTensor

SPEC = kernels.KERNELS["conv"]
assert isinstance(SPEC, kernels.ConvGeneralSpec)
TOL = Tolerance(rel_l2=2e-3, max_abs=0.25, mismatch=0)
F16 = np.dtype("float16")
TILES = tuple(SPEC.f16_tiles())


def pads(p: int) -> dict[str, int]:
    return {"pad_top": p, "pad_left": p, "pad_bottom": p, "pad_right": p}


PAN = ConvGeometry(7, 7, **pads(3))
S2_5X5 = ConvGeometry(5, 5, 2, 2, **pads(2))
G2 = ConvGeometry(3, 3, **pads(1), groups=2)
PW = ConvGeometry(1, 1)


@pytest.fixture(scope="module")
def conv(engine) -> Iterator[dict[str, Kernel]]:
    with checked_in_entries(engine, (SPEC.stem,)) as found:
        yield found


class Ctx:
    """The LaunchContext of a test: the device, no wgmma (these are the mma.sync entries), and a
    workspace full of NaN."""

    wgmma_off = "the split-K tests run the mma.sync entries"

    def __init__(self, engine) -> None:
        self.be = engine.backend
        self.device = self.be.device.info()
        self.keep: list = []

    def tuned_entry(self, call, batch):
        return None

    def tensor_map(self, m):
        raise AssertionError("the mma.sync entries take no tensor map")

    def workspace(self, nbytes: int) -> int:
        buf = self.be.from_host(np.full(max(nbytes // 4, 1), np.nan, np.float32))
        self.keep.append(buf)
        return buf.ptr


def run_case(
    engine,
    conv,
    shape: tuple[int, int, int, int, int],
    geom: ConvGeometry,
    *,
    act: tuple[str, float, float] | None = ("relu", 0.0, 0.0),
    residual: bool = False,
    off: int = 0,
    entry: str | None = None,
    splits: int | None = None,
) -> ConvChoice:
    """One conv on fresh random data, split (the chooser's entry and slices, or ``entry`` forced
    with ``splits``) and unsplit; checked as the module docstring says. Returns the split choice."""
    n, h, w, c, k = shape
    _, p, q, _ = SPEC.output_shape(n, h, w, c, k, geom=geom)
    s = Slices(engine, "float16", off)
    x = s.rng.standard_normal((n, h, w, c)).astype(F16)
    w_onnx = s.rng.standard_normal((k, c // geom.groups, geom.R, geom.S)) / np.sqrt(c // geom.groups * geom.R * geom.S)
    w_onnx = w_onnx.astype(F16)
    b = s.rng.standard_normal(k).astype(np.float32)
    r = s.rng.standard_normal((n, p, q, k)).astype(F16) if residual else None
    want = ort_reference(x, w_onnx, b, r, geom, act)

    code = Activation() if act is None else Activation.named(*act)
    wp, bp = kernels.pack_conv_weights(w_onnx, b, any_size=True)
    x_ptr, ldx = s.input(x)
    inputs = [GpuTensor(x_ptr, x.shape, F16, ld=ldx)]
    if r is not None:
        r_ptr, ldr = s.input(r)
        inputs.append(GpuTensor(r_ptr, r.shape, F16, ld=ldr))
    weights = [GpuTensor(s.weights(wp), wp.shape, F16), GpuTensor(s.weights(bp), bp.shape, np.dtype("float32"))]
    call = KernelCall(
        "conv", ("x", "r") if residual else ("x",), ("y",), ("w", "b"),
        (*geom.attrs(), *code.attrs(), ("residual", int(residual))), ("split",),
    )  # fmt: skip
    ctx = Ctx(engine)

    def run(forced: ConvChoice | None) -> tuple[np.ndarray, ConvChoice]:
        """One launch into a freshly poisoned output (and workspace): the chooser's (``forced``
        None) or ``forced``'s entry and slices."""
        y_ptr, ldy = s.output((n, p, q, k))
        y = GpuTensor(y_ptr, (n, p, q, k), F16, ld=ldy)
        if forced is None:
            prep = SPEC.prepare_inputs(call, inputs, y, weights, ctx)
        else:
            prep = SPEC.prepare_entry(forced, SPEC.call_args(call, inputs, y, weights), ctx)
        for one in (*prep.before, prep):
            conv[one.entry].launch(
                one.config.grid, one.config.block, one.config.shared_bytes, engine.backend.stream, one.args
            )
        return s.result(), prep.choice or ConvChoice("mma.sync", prep.entry, "unsplit", 1)

    force = None if entry is None else ConvChoice("mma.sync", entry, "forced by the test", splits or 2)
    got, choice = run(force)
    assert choice.splits > 1 and choice.entry in SPEC.f16_tiles(), choice
    label = f"{choice.entry} x{choice.splits} {shape} {geom.label()}"
    check = compare(label, want, got, TOL)
    assert check.passed, check
    again, _ = run(force)
    assert np.array_equal(got, again), f"{label}: a second run differs (the slices must be summed in a fixed order)"
    whole, _ = run(ConvChoice("mma.sync", choice.entry, "unsplit", 1))
    check = compare(f"{label} against its unsplit run", whole, got, Tolerance(rel_l2=1e-3, max_abs=0.25, mismatch=0))
    assert check.passed, check
    return choice


@pytest.mark.parametrize("n", [1, 3])
def test_pans_deep_one_channel_conv_splits(engine, conv, n) -> None:
    choice = run_case(engine, conv, (n, 8, 8, 512, 1), PAN)
    assert choice.entry == "conv_nhwc_f16_narrow"


def test_a_grouped_conv_splits_each_group(engine, conv) -> None:
    choice = run_case(engine, conv, (1, 4, 4, 1000, 40), G2, act=("leakyrelu", 0.1, 0.0), residual=True, off=3)
    assert choice.entry == "conv_nhwc_f16_gather"  # 500 channels a group: the scalar path


def test_a_pointwise_conv_into_a_channel_slice(engine, conv) -> None:
    run_case(engine, conv, (1, 2, 2, 2048, 16), PW, act=("leakyrelu", 0.1, 0.0), off=8)


def test_a_strided_5x5_with_a_residual_on_a_forced_tile(engine, conv) -> None:
    # The chooser gives 96 -> 3 to the direct entry (no split there): every tile entry split instead.
    for entry in TILES:
        run_case(engine, conv, (1, 5, 7, 96, 3), S2_5X5, residual=True, off=5, entry=entry, splits=3)


@pytest.mark.parametrize("entry", TILES)
@pytest.mark.parametrize(
    ("shape", "geom", "splits"),
    [
        ((2, 9, 11, 64, 72), ConvGeometry(3, 3, **pads(1)), 5),  # vector path, K tails in a tile
        ((1, 13, 9, 13, 9), ConvGeometry(5, 3, 1, 2, 2, 1, 3, 0, 1, 2), 4),  # scalar path, dilation, asymmetric pads
        ((1, 6, 6, 64, 24), ConvGeometry(3, 3, **pads(1)), 7),  # 18 k-tiles, 7 slices of 3: the last empty (zeros)
    ],
    ids=["vector", "scalar", "uneven"],
)
def test_every_tile_entry_splits_on_both_paths(engine, conv, entry, shape, geom, splits) -> None:
    run_case(engine, conv, shape, geom, act=("clip", -0.5, 1.5), residual=True, off=3, entry=entry, splits=splits)
