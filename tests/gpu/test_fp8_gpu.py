"""The FP8 kernels (issue 42) on an H100/H200: quantize_fp8 and conv_fp8 (the e4m3 rows of the wgmma
family) against their numpy references (kernels/quantize_fp8.py, kernels/conv_fp8.py, themselves held to
onnxruntime's QuantizeLinear / DequantizeLinear + Conv by tests/test_fp8_kernels.py), on shapes no zoo
model has: C in {16, 48, 144}, K in {8, 40, 136}, odd H and W, N in {1, 3}, 3x3 and 1x1, with and
without a residual, ReLU and SiLU; the input quantized from a channel slice, the output written into one
(the channels around it must keep their SENTINEL); split-K where the pixels are few; every e4m3 row once.

Tolerances. quantize_fp8: bit-exact (the same fp32 product, round-to-nearest-even, satfinite). conv_fp8:
the kernel sums the exact e4m3 products in fp32 (another order than the reference's float64) and rounds
once to fp16: rel L2 <= 2e-3 against the reference's fp16 output. Printed, not bounded: the end-to-end
error of the chain (GPU quantize, GPU conv_fp8) against the fp32 conv of the unquantized tensors, what
FP8 costs before calibration chooses layers. The kernels come from the checked-in compute_90a PTX
(driver JIT): run `make ptx` first. Skipped where the GPU is not compute capability 9.0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from gpu_ptx import SENTINEL, Slices, checked_in_entries

from dualtrack import kernels
from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall, f32_bits
from dualtrack.kernels.conv3x3_wgmma import E4M3_CONFIGS
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime import tma
from dualtrack.runtime.engine import Engine
from dualtrack.runtime.tensors import GpuTensor

WG = kernels.CONV3X3_WGMMA
QUANT = kernels.KERNELS["quantize_fp8"]
CONV = kernels.KERNELS["conv_fp8"]
REL_L2 = 2e-3  # fp32 sums of exact e4m3 products vs float64, then one fp16 rounding
OFF = 8  # channel offset of every slice: 16 bytes, so TMA's and the epilogue's alignment hold
u8, f16, f32 = np.dtype("uint8"), np.dtype("float16"), np.dtype("float32")


@pytest.fixture(scope="module", autouse=True)
def sm90(engine: Engine) -> None:
    cc = engine.backend.device.cc
    if cc != (9, 0):
        pytest.skip(f"the FP8 kernels are sm_90a only; this GPU is compute capability {cc[0]}.{cc[1]}")


@pytest.fixture(scope="module")
def entries(engine: Engine) -> Iterator[dict[str, Any]]:
    """Every entry of the wgmma family (its e4m3 rows allowed their dynamic shared memory) and quantize_fp8."""
    with checked_in_entries(engine, (WG.stem, QUANT.stem)) as found:
        for c in E4M3_CONFIGS:
            found[c.entry].set_max_dynamic_shared(c.smem_bytes)
        yield found


class _Slices(Slices):
    """gpu_ptx.Slices with an output stride rounded up to 8 channels (the epilogue's 16-byte stores)."""

    def output(self, shape: tuple[int, ...]) -> tuple[int, int]:
        ld = -(-(shape[3] + 2 * self.off) // 8) * 8
        wide = np.full((*shape[:3], ld), SENTINEL, self.dtype)
        wide[..., self.off : self.off + shape[3]] = np.nan
        self.y, self.y_c = self.be.from_host(wide), shape[3]
        return self.y.ptr + self.off * np.dtype(self.dtype).itemsize, ld


@dataclass
class _Ctx:
    """kernels.LaunchContext: maps encoded by the driver, a zeroed split-K workspace the test keeps."""

    engine: Engine
    keep: list = field(default_factory=list)

    @property
    def wgmma_off(self) -> None:
        return None

    @property
    def device(self) -> kernels.DeviceInfo:
        return self.engine.backend.device.info()

    def tuned_entry(self, call: KernelCall, batch: int) -> None:
        return None

    def tensor_map(self, m: TiledMap) -> Any:
        return tma.encode(m)

    def workspace(self, nbytes: int) -> int:
        buf = self.engine.backend.from_host(np.zeros(max(nbytes // 4, 1), np.float32))
        self.keep.append(buf)
        return buf.ptr


def launch(engine: Engine, entries: dict[str, Any], p: kernels.PreparedCall) -> None:
    entries[p.entry].launch(p.config.grid, p.config.block, p.config.shared_bytes, engine.backend.stream, p.args)


def quantize_on_gpu(engine: Engine, entries: dict, s: _Slices, x: np.ndarray, inv_scale: float) -> np.ndarray:
    """quantize_fp8 of ``x`` read from a channel slice, into a dense uint8 buffer; its bytes."""
    x_ptr, ldx = s.input(x)
    out = engine.backend.from_host(np.zeros(x.shape, u8))
    s.keep.append(out)
    call = KernelCall("quantize_fp8", ("x",), ("xq",), (), (("inv_scale", f32_bits(inv_scale)),), ("q",))
    p = QUANT.prepare_inputs(call, [GpuTensor(x_ptr, x.shape, f16, ld=ldx)], out, [], None)  # type: ignore[arg-type]
    launch(engine, entries, p)
    return engine.backend.to_host(out)


@pytest.mark.parametrize("shape", [(1, 7, 9, 16), (3, 5, 11, 48), (1, 3, 13, 144), (2, 5, 3, 20)])
def test_quantize_is_bit_exact(engine: Engine, entries: dict, shape: tuple[int, int, int, int]) -> None:
    """C = 20: the per-element path (C % 8 != 0); the others 8 channels a thread, from a slice."""
    s = _Slices(engine, "float16", OFF)
    x = (s.rng.standard_normal(shape) * 30).astype(np.float16)
    x.reshape(-1)[:4] = [np.float16(30000), np.float16(-30000), np.float16(0.0), np.float16(-0.0)]
    inv = float(np.float32(448 / 96.0))  # no power of two: the fp32 product rounds
    got = quantize_on_gpu(engine, entries, s, x, inv)
    want = QUANT.reference(x, inv_scale=inv)
    assert np.array_equal(got, want), f"{(got != want).sum()} of {got.size} bytes differ"
    assert got.reshape(-1)[0] == 0x7E and got.reshape(-1)[1] == 0xFE  # saturated to +-448


def conv_call(window: int, x_scale: float, act: str, residual: bool) -> KernelCall:
    p = window // 2
    geom = kernels.ConvGeometry(window, window, pad_top=p, pad_left=p, pad_bottom=p, pad_right=p)
    attrs = (*geom.attrs(), *Activation.named(act).attrs(), ("residual", int(residual)), ("x_scale", f32_bits(x_scale)))
    return KernelCall("conv_fp8", ("xq", "r") if residual else ("xq",), ("y",), ("W", "B"), attrs, ("fp8",))


def run_conv_fp8(
    engine: Engine,
    entries: dict[str, Any],
    shape: tuple[int, int, int, int, int],
    window: int,
    act: str,
    *,
    residual: bool,
    entry: str | None = None,
    repeat: int = 1,
) -> str:
    """x (fp16, fresh random) quantized on the GPU, conv_fp8 on the GPU into an output slice, against
    the spec's reference on the same bytes (rel L2 <= REL_L2); the chain's error against the fp32 conv
    printed. ``entry``: force that e4m3 row (None: the chooser's). Returns the entry run."""
    n, h, w, c, k = shape
    s = _Slices(engine, "float16", OFF)
    x = s.rng.standard_normal((n, h, w, c)).astype(np.float16)
    s_x = float(np.abs(x.astype(np.float32)).max()) / 448
    xq = quantize_on_gpu(engine, entries, s, x, float(np.float32(1 / s_x)))
    wt = (s.rng.standard_normal((k, c, window, window)) / np.sqrt(window * window * c)).astype(np.float32)
    b = (s.rng.standard_normal(k) * 0.1).astype(np.float32)
    r = s.rng.standard_normal((n, h, w, k)).astype(np.float16) if residual else None
    call = conv_call(window, s_x, act, residual)
    packed = CONV.pack_weights(call, {"W": wt, "B": b})
    xq_dev = engine.backend.from_host(xq)
    s.keep.append(xq_dev)
    inputs = [xq_dev]
    if r is not None:
        r_ptr, ldr = s.input(r)
        inputs.append(GpuTensor(r_ptr, r.shape, f16, ld=ldr))
    y_ptr, ldy = s.output((n, h, w, k))
    y = GpuTensor(y_ptr, (n, h, w, k), f16, ld=ldy)
    weights = [GpuTensor(s.weights(packed["W"]), packed["W"].shape, u8), GpuTensor(s.weights(packed["B"]), (k,), f32)]
    ctx = _Ctx(engine)
    if entry is None:
        prep = CONV.prepare_inputs(call, inputs, y, weights, ctx)
    else:
        cfg = WG.config(entry)
        choice = kernels.ConvChoice("wgmma", entry, "forced by the test", WG.splits(cfg, n, h, w, c, k))
        prep = CONV.prepare_entry(call, choice, inputs, y, weights, ctx)
    assert prep.entry in CONV.entries and WG.config(prep.entry).pointwise is (window == 1), prep.entry
    first = None
    for _ in range(repeat):  # split-K's tile counters must be back at zero for the next launch
        launch(engine, entries, prep)
        got = s.result()
        assert first is None or np.array_equal(got, first, equal_nan=True), f"{prep.entry}: a repeat differs"
        first = got
    assert first is not None and np.isfinite(first).all()
    want = CONV.run_reference(call, [xq, *([r] if r is not None else [])], {"W": wt, "B": b})
    err = np.linalg.norm(first.astype(np.float64) - want) / max(np.linalg.norm(want.astype(np.float64)), 1e-30)
    what = f"{prep.entry} {shape} {window}x{window} {act}{' + residual' if residual else ''}"
    assert err <= REL_L2, f"{what}: rel L2 {err:.2e} against the reference"
    exact = fp32_conv(x, wt, b, r, window, Activation.named(act))
    e2e = np.linalg.norm(first.astype(np.float64) - exact) / max(np.linalg.norm(exact), 1e-30)
    print(f"{what}: rel L2 {err:.1e} vs the reference, {e2e:.1e} vs the fp32 conv of the unquantized tensors")
    return prep.entry


def fp32_conv(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, r: np.ndarray | None, window: int, act: Activation
) -> np.ndarray:
    """The unquantized layer in float64 (x NHWC fp16, w ONNX (K, C, R, S) fp32), the activation in float32."""
    pad = window // 2
    n, h, wd, _ = x.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    out = np.zeros((n, h, wd, w.shape[0]))
    for i in range(window):
        for j in range(window):
            out += xp[:, i : i + h, j : j + wd, :] @ w[:, :, i, j].astype(np.float64).T
    out += b
    if r is not None:
        out += r.astype(np.float64)
    return act.apply(out.astype(np.float32)).astype(np.float64)


SHAPES = [
    # n, h, w, c, k: every C of {16, 48, 144} with every K of {8, 40, 136}, odd H and W, N 1 or 3
    (1, 7, 9, 16, 8), (3, 5, 11, 16, 40), (1, 9, 13, 16, 136),
    (3, 7, 5, 48, 8), (1, 11, 9, 48, 40), (3, 5, 7, 48, 136),
    (1, 13, 7, 144, 8), (3, 9, 5, 144, 40), (1, 7, 11, 144, 136),
]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}_{s[3]}to{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("window", [3, 1])
@pytest.mark.parametrize(("act", "residual"), [("relu", False), ("silu", True)], ids=["relu", "silu+res"])
def test_conv_fp8_matches_its_reference(
    engine: Engine, entries: dict, shape: tuple, window: int, act: str, residual: bool
) -> None:
    """ReLU without a residual: the fp16-staging epilogue; SiLU with one: the fp32-staging epilogue."""
    run_conv_fp8(engine, entries, shape, window, act, residual=residual)


def test_few_pixels_split_the_reduction(engine: Engine, entries: dict) -> None:
    """35 pixels of 1024 channels: one tile, so split-K (dequant applied after the splits are summed);
    launched twice on one workspace."""
    p = ConvProblem.dense(1, 5, 7, 1024, 72)
    assert CONV.choice(p, engine.backend.device.info()).splits > 1
    run_conv_fp8(engine, entries, (1, 5, 7, 1024, 72), 3, "silu", residual=True, repeat=2)


@pytest.mark.parametrize("cfg", E4M3_CONFIGS, ids=[c.entry for c in E4M3_CONFIGS])
def test_every_e4m3_row(engine: Engine, entries: dict, cfg: kernels.WgmmaConfig) -> None:
    """Each compiled e4m3 row, whatever the chooser would pick: two k-blocks of its width plus a tail."""
    c = 2 * cfg.bk + 16
    run_conv_fp8(engine, entries, (1, 9, 21, c, 72), 1 if cfg.pointwise else 3, "relu", residual=True, entry=cfg.entry)
