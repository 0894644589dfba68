#!/usr/bin/env python3
"""GPU check and benchmark of the wgmma/TMA 3x3 convolution (handwritten_ptx/conv3x3_wgmma.cu).

    python3 bench/wgmma/check.py              # everything, < 90 s on an H200
    python3 bench/wgmma/check.py --quick      # probes + N=1 layers only
    python3 bench/wgmma/check.py --only N= --no-watchdog   # the layers, watchdog compiled out (its cost)

Needs: an sm_90 GPU, cuda.bindings (driver API: module load, tensor maps, launches), torch (random
data, the fp32 reference conv, cuDNN timing; the kernel itself is launched through cuda.bindings).
Uses bench/wgmma/conv_plan.py (geometry, tensor-map arguments) and, for the fallback build,
bench/wgmma/build.py. Writes $OUT/wgmma_check.json (--no-watchdog: wgmma_check_nowd.json) when OUT is set.

Kernel binary, first that works: the sm_90a cubin built on the dev machine
(conv3x3_wgmma.sm_90a.cubin, if build.json's source hash matches the .cu), the PTX beside it
(driver JIT), a fresh NVRTC compile of the .cu.

Robustness: the tests run in a worker subprocess that reports one JSON line per test. A kernel
whose mbarrier wait times out records where in a status word and exits (in-kernel watchdog, 2 s);
a fault (illegal address/instruction) kills the worker's CUDA context: the parent records the
test that was running, restarts a worker after it and skips that config from then on. A test that
makes no progress for --test-timeout seconds is killed the same way. The whole run stops taking
new tests at --budget seconds.

Tests, in order (names in the table):
  probe-id/<cfg>    one CTA, x[p,c] = distinct fp16 bit patterns, w = identity on the centre tap:
                    y must equal x bit for bit; a mismatch is decoded to the (pixel, channel) each
                    output came from (swizzle / descriptor / fragment-layout bugs show as a pattern)
  probe-w/<cfg>     one CTA, x one-hot, w = distinct bit patterns: decodes the (k, c) of B used
  rand1/<cfg>       one CTA, random data vs the fp32 reference
  tap<r><s>/<cfg>   2 images of 10x20 (partial tiles, borders), identity on one tap: every output
                    must be x shifted by (r-1, s-1) with zeros outside; decoded on mismatch
  slice/<cfg>       input = channels [16, 16+C) of a wider tensor (ldx > C), output written to
                    channels [24, 24+K) of a wider buffer (ldy > K); the other channels must stay
                    untouched (NaN poison)
  <layer>/N=<n>     every U-Net 3x3 layer at N=1 and N=8, every applicable config: rel L2 vs the
                    fp32 reference, time (CUDA events, median of 20 after warm-up), cuDNN time
PASS: rel L2 < 2e-3 vs the fp32 reference (fp16 output rounding alone gives ~3e-4), no NaN left in
the output, nothing written outside it, watchdog silent; probes: bit-exact.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import conv_plan as cp  # noqa: E402

REL_L2_TOL = 2e-3
DEVICE = "cuda"  # "cpu" with --emulate
EMULATE = False  # --emulate: the numpy emulator (emulate.py) stands in for the GPU kernel
NO_WATCHDOG = False  # --no-watchdog: built here with -DCONV_WGMMA_WATCHDOG_NS=0 (NVRTC + nvJitLink)
CURRENT_TEST = ""  # name of the test the worker runs
EMU_POISONED = False  # --emulate: a simulated fault "destroyed the context"
TIMED_RUNS = 20
WARMUP_RUNS = 5
PROBE_BASE = 0x1000  # fp16 bit pattern of the first distinct probe value (2^-11, normal)

# ------------------------------------------------------------------------------------------------
# Test list (parent and worker build the same one)


@dataclass(frozen=True)
class Item:
    name: str
    kind: str  # probe-id, probe-w, rand1, tap, slice, layer
    cfg: str  # entry name
    N: int = 1
    H: int = 1
    W: int = 1
    C: int = 64
    K: int = 64
    tap: int = 4
    layer: str = ""


def one_tile_shape(cfg: cp.WgmmaConfig) -> tuple[int, int]:
    """(H, W) of an image that is exactly one tile of ``cfg``."""
    tw = cfg.halo_tw or min(64, cfg.bm)
    return cfg.bm // tw, tw


def configs_for(C: int, K: int) -> list[cp.WgmmaConfig]:
    cands = list(cp.applicable(C))
    # no channel tile wider than K, nor so narrow that K needs more than 8 of them
    useful = [c for c in cands if c.bn <= max(K, 32) and 8 * c.bn >= K]
    return useful or cands


def build_items(quick: bool, only: str = "") -> list[Item]:
    """The tests, in order; ``only``: comma-separated substrings, keep the tests whose name has one."""
    items = _all_items(quick)
    keys = [k for k in only.split(",") if k]
    return [it for it in items if any(k in it.name for k in keys)] if keys else items


def _all_items(quick: bool) -> list[Item]:
    items: list[Item] = []
    for cfg in cp.CONFIGS:
        H, W = one_tile_shape(cfg)
        C = cfg.bk  # 64 or 32 channels: one k-block per tap
        K = min(cfg.bn, 64)
        items.append(Item(f"probe-id/{cfg.entry}", "probe-id", cfg.entry, 1, H, W, C, C))
        items.append(Item(f"probe-w/{cfg.entry}", "probe-w", cfg.entry, 1, H, W, C, K))
        items.append(Item(f"rand1/{cfg.entry}", "rand1", cfg.entry, 1, H, W, 2 * C, cfg.bn))
    taps_of = ("conv3x3_wgmma_bn128_mt2_wg2_bk64", "conv3x3_wgmma_bn32_mt2_wg2_bk32",
               "conv3x3_wgmma_bn64_mt2_wg2_bk64_h16", "conv3x3_wgmma_bn32_mt2_wg2_bk32_h16")  # fmt: skip
    for entry in taps_of:
        cfg = cp.BY_ENTRY[entry]
        for tap in range(9):
            r, s = divmod(tap, 3)
            items.append(Item(f"tap{r}{s}/{entry}", "tap", entry, 2, 10, 20, cfg.bk, cfg.bk, tap))
    for cfg in cp.CONFIGS:
        C = 96 if cfg.bk == 64 else 32
        items.append(Item(f"slice/{cfg.entry}", "slice", cfg.entry, 2, 24, 40, C, max(40, cfg.bn // 2)))
    for n in (1,) if quick else (1, 8):
        for layer, C, K, HW in cp.UNET_LAYERS:
            if EMULATE:
                HW = 6  # the emulator is slow: one small image per layer shape
            for cfg in configs_for(C, K):
                items.append(Item(f"{layer}/N={n}/{cfg.entry}", "layer", cfg.entry, n, HW, HW, C, K, layer=layer))
    return items


# ------------------------------------------------------------------------------------------------
# Driver glue (worker side)


class CudaFailure(RuntimeError):
    pass


def _cu():
    from cuda.bindings import driver

    return driver


def cu_check(result: Any, what: str) -> Any:
    cu = _cu()
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        _, name = cu.cuGetErrorName(status)
        _, text = cu.cuGetErrorString(status)
        raise CudaFailure(f"{what}: {name.decode() if name else status}: {text.decode() if text else ''}")
    return values[0] if len(values) == 1 else (tuple(values) if values else None)


class Module:
    """The kernel module in torch's (primary) context, with one CUfunction per config."""

    def __init__(self) -> None:
        cu = _cu()
        cu_check(cu.cuInit(0), "cuInit")
        dev = cu_check(cu.cuDeviceGet(0), "cuDeviceGet")
        self.ctx = cu_check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        cu_check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.dev = dev
        self.sms = cu_check(
            cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "attr"
        )
        self.source, self.module = self._load()
        self.functions: dict[str, Any] = {}
        self.info: dict[str, dict[str, int]] = {}
        A = cu.CUfunction_attribute
        for cfg in cp.CONFIGS:
            f = cu_check(cu.cuModuleGetFunction(self.module, cfg.entry.encode()), f"cuModuleGetFunction {cfg.entry}")
            cu_check(
                cu.cuFuncSetAttribute(f, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cfg.smem_bytes),
                f"max dynamic smem {cfg.entry}",
            )
            occ = cu_check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, cfg.threads, cfg.smem_bytes), "occupancy")
            self.functions[cfg.entry] = f
            self.info[cfg.entry] = {
                "registers": cu_check(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, f), "regs"),
                "local_bytes": cu_check(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f), "lmem"),
                "static_smem": cu_check(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f), "smem"),
                "dynamic_smem": cfg.smem_bytes,
                "blocks_per_sm": occ,
                "wanted_blocks_per_sm": cfg.min_blocks,
            }

    def _load(self) -> tuple[str, Any]:
        cu = _cu()
        errors = []
        if NO_WATCHDOG:  # the same NVRTC + nvJitLink route as the prebuilt cubin, without the watchdog
            import build

            text, _log = build.compile_ptx(extra=("-DCONV_WGMMA_WATCHDOG_NS=0",))
            cubin_bytes, _info = build.assemble_cubin(text)
            return "NVRTC + nvJitLink here, watchdog compiled out", cu_check(
                cu.cuModuleLoadData(cubin_bytes), "cuModuleLoadData(no-watchdog cubin)"
            )
        manifest = HERE / "build.json"
        cubin = HERE / "conv3x3_wgmma.sm_90a.cubin"
        ptx = HERE / "conv3x3_wgmma.ptx"
        fresh = False
        try:
            import build

            fresh = json.loads(manifest.read_text())["source_sha256"] == build.source_key()
        except Exception as exc:
            errors.append(f"manifest: {exc}")
        if fresh and cubin.is_file():
            try:
                return "prebuilt cubin (nvJitLink, dev machine)", cu_check(
                    cu.cuModuleLoadData(cubin.read_bytes()), "cuModuleLoadData(cubin)"
                )
            except CudaFailure as exc:
                errors.append(str(exc))
        if fresh and ptx.is_file():
            try:
                return "prebuilt PTX (driver JIT)", cu_check(
                    cu.cuModuleLoadData(ptx.read_bytes().rstrip(b"\0") + b"\0"), "cuModuleLoadData(ptx)"
                )
            except CudaFailure as exc:
                errors.append(str(exc))
        import build

        text, _log = build.compile_ptx()
        try:
            return "NVRTC here (driver JIT)", cu_check(
                cu.cuModuleLoadData(text.encode() + b"\0"), "cuModuleLoadData(NVRTC ptx)"
            )
        except CudaFailure as exc:
            errors.append(str(exc))
            raise CudaFailure("no kernel binary could be loaded: " + " | ".join(errors)) from exc

    def tensor_map(self, spec: cp.TensorMapSpec) -> Any:
        cu = _cu()
        swz = {
            64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
            128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        }
        l2 = {
            128: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            256: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        }
        return cu_check(
            cu.cuTensorMapEncodeTiled(
                cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                spec.rank,
                spec.address,
                [cu.cuuint64_t(d) for d in spec.dims],
                [cu.cuuint64_t(s) for s in spec.strides],
                [cu.cuuint32_t(b) for b in spec.box],
                [cu.cuuint32_t(1)] * spec.rank,
                cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                swz[spec.swizzle_bytes],
                l2[spec.l2_promotion_bytes],
                cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            ),
            f"cuTensorMapEncodeTiled(dims={spec.dims}, strides={spec.strides}, box={spec.box})",
        )


class Launcher:
    """Everything one (config, problem) launch needs, built once: tensor maps and the void** array."""

    def __init__(self, mod: Module, cfg: cp.WgmmaConfig, x: int, w: int, bias: int, y: int, N: int, H: int, W: int,
                 C: int, K: int, ldx: int, ldy: int, relu: bool, status: int) -> None:  # fmt: skip
        why = cp.supported(N, H, W, C, K, ldx, ldy, x, w, y)
        if why:
            raise ValueError(why)
        self.cfg = cfg
        self.geo = cp.launch(cfg, N, H, W, K)
        self.func = mod.functions[cfg.entry]
        self.tmx = mod.tensor_map(cp.input_map(cfg, x, N, H, W, C, ldx, self.geo.tw_log2))
        self.tmw = mod.tensor_map(cp.weight_map(cfg, w, K, C))
        self.scalars = [ctypes.c_uint64(bias), ctypes.c_uint64(0), ctypes.c_uint64(y)]  # no residual
        # act: the activation table's id, 1 ReLU / 0 none; its parameters p0, p1 unused by both
        self.scalars += [ctypes.c_int32(v) for v in (N, H, W, C, K, ldy, 0, int(relu))]
        self.scalars += [ctypes.c_float(0.0), ctypes.c_float(0.0), ctypes.c_int32(self.geo.tw_log2)]
        self.scalars.append(ctypes.c_int32(1))  # dilation 1
        self.scalars.append(ctypes.c_uint64(0))  # no split-K workspace: grid.y = 1
        self.scalars.append(ctypes.c_uint64(status))
        ptrs = [self.tmx.getPtr(), self.tmw.getPtr()] + [ctypes.addressof(v) for v in self.scalars]
        assert len(ptrs) == len(cp.kernel_arg_names())
        self.params = (ctypes.c_void_p * len(ptrs))(*ptrs)

    def __call__(self, stream: int) -> None:
        cu = _cu()
        g = self.geo
        cu_check(
            cu.cuLaunchKernel(self.func, *g.grid, *g.block, g.smem_bytes, cu.CUstream(stream),
                              ctypes.addressof(self.params), 0),
            f"cuLaunchKernel({self.cfg.entry}, grid={g.grid})",
        )  # fmt: skip


class EmuModule:
    """--emulate: stands in for Module (no CUDA)."""

    def __init__(self) -> None:
        self.source = "numpy emulator (emulate.py)"
        self.sms = cp.NUM_SMS
        self.info: dict[str, dict[str, int]] = {}


class EmuLauncher:
    """--emulate: runs emulate.run on CPU tensors in place of the kernel launch."""

    def __init__(self, cfg: cp.WgmmaConfig, xf: Any, w: Any, bias: Any | None, yf: Any, N: int, H: int, W: int, C: int,
                 K: int, ldx: int, ldy: int, relu: bool, x_off: int, y_off: int) -> None:  # fmt: skip
        why = cp.supported(N, H, W, C, K, ldx, ldy, 2 * x_off, 0, 2 * y_off)
        if why:
            raise ValueError(why)
        import emulate  # numpy: only needed here, so the GPU run does not depend on it

        self.emulate = emulate
        self.cfg, self.geo = cfg, cp.launch(cfg, N, H, W, K)
        self.args = (xf, w, bias, yf, x_off, y_off)
        self.prob = emulate.Problem(N, H, W, C, K, ldx, ldy, relu)

    def __call__(self, stream: int) -> None:
        # WGMMA_EMULATE_FAULT=<raise|reject|hang|exit>:<test-name substring> simulates a kernel
        # fault (context lost), a rejected launch (context fine), a hang or a crashed process, to
        # test the worker's and the parent's recovery.
        global EMU_POISONED
        mode, _, where = os.environ.get("WGMMA_EMULATE_FAULT", "").partition(":")
        if mode and where and where in CURRENT_TEST:
            if mode == "raise":
                EMU_POISONED = True
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            if mode == "reject":
                raise ValueError("cuLaunchKernel: CUDA_ERROR_INVALID_VALUE (simulated)")
            if mode == "hang":
                time.sleep(3600)
            if mode == "exit":
                os._exit(139)
        self.emulate.BUG = os.environ.get("WGMMA_EMULATE_BUG", "")
        xf, w, bias, yf, x_off, y_off = self.args
        b = None if bias is None else bias.float().numpy()
        self.emulate.run(self.cfg, self.prob, xf.numpy(), w.numpy(), b, x_off=x_off, y_off=y_off, y=yf.numpy())


# ------------------------------------------------------------------------------------------------
# Worker: the tests


class Ctx:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        # The fp32 reference may use TF32 tensor cores: every fp16 value is exact in TF32 (same
        # 11-bit significand, wider exponent), so the products are exact and the sums fp32, as in
        # a plain fp32 conv, at tensor-core speed (the N=8 references would take ~20 s otherwise).
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        if EMULATE:
            self.mod: Any = EmuModule()
        else:
            torch.cuda.init()
            torch.empty(1, device=DEVICE)  # creates the primary context the module joins
            self.mod = Module()
        self.status = torch.zeros(8, dtype=torch.int32, device=DEVICE)
        self.gen = torch.Generator(device=DEVICE)

    @property
    def stream(self) -> int:
        return 0 if EMULATE else self.torch.cuda.current_stream().cuda_stream

    def sync(self) -> None:
        if not EMULATE:
            self.torch.cuda.synchronize()

    def healthy(self) -> bool:
        """Whether CUDA still works after an exception (a kernel fault leaves the context unusable)."""
        if EMULATE and EMU_POISONED:
            return False
        try:
            self.sync()
            return float(self.torch.ones(1, device=DEVICE).add_(1).item()) == 2.0
        except Exception:  # any failure here means the context is gone
            return False

    def launcher(self, cfg: cp.WgmmaConfig, xf: Any, w: Any, bias: Any | None, yf: Any, N: int, H: int, W: int, C: int,
                 K: int, ldx: int, ldy: int, relu: bool, x_off: int, y_off: int) -> Any:  # fmt: skip
        """A reusable launch of ``cfg`` on these buffers (x/y: the slices start at x_off/y_off)."""
        if EMULATE:
            return EmuLauncher(cfg, xf, w, bias, yf, N, H, W, C, K, ldx, ldy, relu, x_off, y_off)
        bias_ptr = 0 if bias is None else bias.data_ptr()
        return Launcher(self.mod, cfg, xf.data_ptr() + 2 * x_off, w.data_ptr(), bias_ptr, yf.data_ptr() + 2 * y_off,
                        N, H, W, C, K, ldx, ldy, relu, self.status.data_ptr())  # fmt: skip

    def status_report(self) -> dict[str, int] | None:
        s = self.status.tolist()
        if s[0] == 0:
            return None
        what = {1: "consumer waiting on full[] (TMA bytes never arrived)", 2: "producer waiting on empty[]"}
        return {"what": what.get(s[1], str(s[1])), "block": s[2], "thread": s[3], "kb": s[4], "stage": s[5],
                "parity": s[6]}  # fmt: skip


def distinct_f16(torch: Any, n: int) -> Any:
    """n distinct positive normal fp16 values: bit patterns PROBE_BASE + i."""
    if PROBE_BASE + n > 0x7BFF:
        raise ValueError(f"{n} distinct probe values do not fit below fp16's largest finite value")
    bits = torch.arange(PROBE_BASE, PROBE_BASE + n, dtype=torch.int32, device=DEVICE).to(torch.int16)
    return bits.view(torch.float16)


def f16_bits(torch: Any, t: Any) -> Any:
    return t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def run_kernel(ctx: Ctx, cfg: cp.WgmmaConfig, x: Any, w: Any, bias: Any | None, y: Any, N: int, H: int, W: int, C: int,
               K: int, ldx: int, ldy: int, relu: bool, x_off: int = 0, y_off: int = 0) -> Any:  # fmt: skip
    """One launch into y (already poisoned); x/y are full buffers, the slices start at x_off/y_off."""
    ctx.status.zero_()
    launch = ctx.launcher(cfg, x, w, bias, y, N, H, W, C, K, ldx, ldy, relu, x_off, y_off)
    launch(ctx.stream)
    ctx.sync()
    return launch


def reference(torch: Any, x_nhwc: Any, w_krsc: Any, bias: Any | None, relu: bool) -> Any:
    """fp32-accumulated conv of fp16 inputs (exact products, see Ctx), NHWC (N,H,W,K) float32."""
    F = torch.nn.functional
    # cuDNN's heuristic choice: benchmarking every reference shape would cost seconds.
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=True):
        out = F.conv2d(x_nhwc.permute(0, 3, 1, 2).float(), w_krsc.permute(0, 3, 1, 2).float(),
                       None if bias is None else bias.float(), padding=1)  # fmt: skip
    if relu:
        out = out.relu()
    return out.permute(0, 2, 3, 1)


def diagnose(torch: Any, y: Any, ref: Any, cfg: cp.WgmmaConfig, geo: cp.Launch, H: int, W: int) -> dict[str, Any]:
    """Where the wrong outputs are: by tile row/column, channel chunk, image border, first examples."""
    yf = y.float()
    bad = ~(torch.isfinite(yf) & ((yf - ref).abs() <= 1e-2 + 1e-2 * ref.abs()))
    out: dict[str, Any] = {"bad_fraction": round(bad.float().mean().item(), 6), "nan": int(torch.isnan(yf).sum())}
    if not bad.any():
        return out
    TW = 1 << geo.tw_log2
    TH = cfg.bm // TW
    K = y.shape[-1]
    hh = torch.arange(H, device=y.device)
    ww = torch.arange(W, device=y.device)
    per_pix = bad.any(-1)  # N,H,W
    out["bad_by_tile_row"] = [
        round(v, 3) for v in [per_pix[:, (hh % TH) == r, :].float().mean().item() for r in range(min(TH, 16))]
    ]
    out["bad_by_tile_col_x8"] = [round(per_pix[:, :, ((ww % TW) // 8) == c].float().mean().item(), 3)
                                 for c in range(max(1, min(TW, W) // 8))]  # fmt: skip
    per_k = bad.reshape(-1, K).float().mean(0)
    out["bad_by_channel_x8"] = [round(per_k[i : i + 8].mean().item(), 3) for i in range(0, min(K, 256), 8)]
    border = torch.zeros(H, W, dtype=torch.bool, device=y.device)
    border[0, :] = border[-1, :] = True
    border[:, 0] = border[:, -1] = True
    out["bad_border_vs_interior"] = [
        round(per_pix[:, border].float().mean().item(), 3),
        round(per_pix[:, ~border].float().mean().item(), 3) if (~border).any() else None,
    ]
    flat = bad.reshape(-1).nonzero()[:8, 0].tolist()
    dims = list(y.shape)
    idx = [[f // (dims[1] * dims[2] * dims[3]), f // (dims[2] * dims[3]) % dims[1], f // dims[3] % dims[2], f % dims[3]]
           for f in flat]  # fmt: skip
    out["first_bad"] = [{"nhwk": i, "got": float(yf[tuple(i)]), "ref": float(ref[tuple(i)])} for i in idx]
    return out


def decode_probe(torch: Any, got_bits: Any, want_bits: Any, width: int, names: tuple[str, str]) -> dict[str, Any]:
    """Mismatches of a bit-exact probe, each decoded to the (row, col) of the value it holds."""
    wrong = got_bits != want_bits
    res: dict[str, Any] = {"wrong": int(wrong.sum()), "of": int(wrong.numel())}
    if not wrong.any():
        return res
    # The commonest (row offset, column XOR) between where each wrong value came from and where it
    # landed: a swizzle bug shows as a column XOR, a fragment/row bug as a row offset.
    pos = wrong.nonzero()
    g = got_bits[wrong].long() - PROBE_BASE
    ok = (g >= 0) & (g < got_bits.shape[0] * width)
    res["undecodable"] = int((~ok).sum())
    if ok.any():
        pairs = torch.stack([g[ok] // width - pos[ok, 0], (g[ok] % width) ^ pos[ok, 1]], 1)
        uniq, counts = torch.unique(pairs, dim=0, return_counts=True)
        top = counts.argsort(descending=True)[:6]
        res[f"top_({names[0]}_offset,{names[1]}_xor)"] = [
            [int(uniq[t, 0]), int(uniq[t, 1]), int(counts[t])] for t in top.tolist()
        ]
    idx = pos[:12].tolist()
    ex = []
    for i in idx:
        g = int(got_bits[tuple(i)])
        src = divmod(g - PROBE_BASE, width) if g >= PROBE_BASE else None
        ex.append({"at": i, "got_bits": hex(g), f"got_from_{names[0]}_{names[1]}": src,
                   "want_bits": hex(int(want_bits[tuple(i)]))})  # fmt: skip
    res["examples"] = ex
    return res


def t_probe_id(ctx: Ctx, it: Item, cfg: cp.WgmmaConfig) -> dict[str, Any]:
    torch = ctx.torch
    N, H, W, C, K = it.N, it.H, it.W, it.C, it.K
    P = N * H * W
    x = distinct_f16(torch, P * C).reshape(N, H, W, C)
    w = torch.zeros(K, 3, 3, C, dtype=torch.float16, device=DEVICE)
    w[:, 1, 1, :] = torch.eye(K, C, dtype=torch.float16, device=DEVICE)
    y = torch.full((N, H, W, K), float("nan"), dtype=torch.float16, device=DEVICE)
    run_kernel(ctx, cfg, x, w, None, y, N, H, W, C, K, C, K, False)
    got = f16_bits(torch, y).reshape(P, K)
    want = f16_bits(torch, x).reshape(P, C)[:, :K]
    d = decode_probe(torch, got, want, C, ("pixel", "channel"))
    return {"pass": d["wrong"] == 0, "probe": d}


def t_probe_w(ctx: Ctx, it: Item, cfg: cp.WgmmaConfig) -> dict[str, Any]:
    torch = ctx.torch
    N, H, W, C, K = it.N, it.H, it.W, it.C, it.K
    P = N * H * W
    p = torch.arange(P, device=DEVICE)
    x = torch.zeros(P, C, dtype=torch.float16, device=DEVICE)
    x[p, p % C] = 1.0
    x = x.reshape(N, H, W, C)
    wv = distinct_f16(torch, K * C).reshape(K, C)
    w = torch.zeros(K, 3, 3, C, dtype=torch.float16, device=DEVICE)
    w[:, 1, 1, :] = wv
    y = torch.full((N, H, W, K), float("nan"), dtype=torch.float16, device=DEVICE)
    run_kernel(ctx, cfg, x, w, None, y, N, H, W, C, K, C, K, False)
    got = f16_bits(torch, y).reshape(P, K)
    want = f16_bits(torch, wv)[:, p % C].T  # y[p, k] = w[k, p % C]
    d = decode_probe(torch, got, want, C, ("k", "c"))
    return {"pass": d["wrong"] == 0, "probe": d}


def t_tap(ctx: Ctx, it: Item, cfg: cp.WgmmaConfig) -> dict[str, Any]:
    torch = ctx.torch
    N, H, W, C = it.N, it.H, it.W, it.C
    r, s = divmod(it.tap, 3)
    P = N * H * W
    x = distinct_f16(torch, P * C).reshape(N, H, W, C)
    w = torch.zeros(C, 3, 3, C, dtype=torch.float16, device=DEVICE)
    w[:, r, s, :] = torch.eye(C, dtype=torch.float16, device=DEVICE)
    y = torch.full((N, H, W, C), float("nan"), dtype=torch.float16, device=DEVICE)
    run_kernel(ctx, cfg, x, w, None, y, N, H, W, C, C, C, C, False)
    xp = torch.nn.functional.pad(x, (0, 0, 1, 1, 1, 1))  # zero border in W and H
    want = f16_bits(torch, xp[:, r : r + H, s : s + W, :]).reshape(P, C)
    got = f16_bits(torch, y).reshape(P, C)
    d = decode_probe(torch, got, want, C, ("pixel", "channel"))
    if d["wrong"]:
        # Which (dh, dw) shifts did the wrong outputs really come from?
        shifts: dict[str, int] = {}
        for e in d.get("examples", []):
            src = e.get("got_from_pixel_channel")
            if src is None:
                shifts["zero/garbage"] = shifts.get("zero/garbage", 0) + 1
                continue
            sp, _ = src
            pi = e["at"][0]
            dh = (sp // W) % H - (pi // W) % H
            dw = sp % W - pi % W
            key = f"dh={dh},dw={dw}"
            shifts[key] = shifts.get(key, 0) + 1
        d["source_shifts_of_examples"] = shifts
        d["expected_shift"] = f"dh={r - 1},dw={s - 1}"
    return {"pass": d["wrong"] == 0, "probe": d}


_CASE: dict[str, Any] = {}


def make_case(ctx: Ctx, it: Item, slice_: bool) -> dict[str, Any]:
    """Seeded random x (in a wider buffer when slice_), w, bias and their reference; the last case
    is kept, so the configs of one layer share data and one reference conv."""
    key = (it.N, it.H, it.W, it.C, it.K, slice_)
    if _CASE.get("key") == key:
        return _CASE
    _CASE.clear()
    torch = ctx.torch
    N, H, W, C, K = it.N, it.H, it.W, it.C, it.K
    ctx.gen.manual_seed(zlib.crc32(repr(key).encode()))
    x_off, y_off = (16, 24) if slice_ else (0, 0)
    ldx, ldy = (C + 32, K + 40) if slice_ else (C, K)
    xf = torch.randn(N, H, W, ldx, generator=ctx.gen, device=DEVICE).half()
    w = (torch.randn(K, 3, 3, C, generator=ctx.gen, device=DEVICE) / math.sqrt(9 * C)).half()
    bias = torch.randn(K, generator=ctx.gen, device=DEVICE) * 0.1
    ref = reference(torch, xf[..., x_off : x_off + C], w, bias, True)
    _CASE.update(key=key, xf=xf, w=w, bias=bias, ref=ref, x_off=x_off, y_off=y_off, ldx=ldx, ldy=ldy)
    return _CASE


def t_random(ctx: Ctx, it: Item, cfg: cp.WgmmaConfig, *, slice_: bool = False, timed: bool = False) -> dict[str, Any]:
    torch = ctx.torch
    N, H, W, C, K = it.N, it.H, it.W, it.C, it.K
    case = make_case(ctx, it, slice_)
    x_off, y_off, ldx, ldy, ref = case["x_off"], case["y_off"], case["ldx"], case["ldy"], case["ref"]
    yf = torch.full((N, H, W, ldy), float("nan"), dtype=torch.float16, device=DEVICE)
    launch = run_kernel(ctx, cfg, case["xf"], case["w"], case["bias"], yf, N, H, W, C, K, ldx, ldy, True,
                        x_off, y_off)  # fmt: skip
    y = yf[..., y_off : y_off + K]
    rel = ((y.float() - ref).nan_to_num(nan=1e30).norm() / ref.norm()).item()
    nan = int(torch.isnan(y).sum())
    outside = int((~torch.isnan(yf[..., :y_off])).sum() + (~torch.isnan(yf[..., y_off + K :])).sum())
    res: dict[str, Any] = {"rel_l2": rel, "nan_left": nan, "written_outside": outside,
                           "tw": 1 << launch.geo.tw_log2, "ctas": launch.geo.tiles}  # fmt: skip
    res["pass"] = rel < REL_L2_TOL and nan == 0 and outside == 0
    if not res["pass"]:
        res["where"] = diagnose(torch, y, ref, cfg, launch.geo, H, W)
    if timed and res["pass"]:
        res["ms"] = time_it(ctx, lambda: launch(ctx.stream))
        res["tflops"] = cp.flops(N, H, W, C, K) / (res["ms"] * 1e-3) / 1e12
    del yf
    return res


def time_it(ctx: Ctx, fn: Any) -> float:
    """Median ms of TIMED_RUNS runs, each between its own CUDA events; the launches are queued
    behind a sleep kernel so host launch overhead does not leak into the GPU times."""
    torch = ctx.torch
    if EMULATE:  # one run, host wall time: exercises the code path, measures nothing
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(WARMUP_RUNS):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(TIMED_RUNS)]
    torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time to queue everything behind
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


_CUDNN_CACHE: dict[tuple[int, ...], dict[str, float]] = {}


def cudnn_times(ctx: Ctx, N: int, H: int, W: int, C: int, K: int) -> dict[str, float]:
    key = (N, H, W, C, K)
    if key in _CUDNN_CACHE:
        return _CUDNN_CACHE[key]
    torch = ctx.torch
    F = torch.nn.functional
    ctx.gen.manual_seed(1234)
    dt = torch.float32 if EMULATE else torch.float16  # CPU convs are fp32 (emulate mode only)
    x = torch.randn(N, C, H, W, generator=ctx.gen, device=DEVICE).to(dt).to(memory_format=torch.channels_last)
    w = (torch.randn(K, C, 3, 3, generator=ctx.gen, device=DEVICE) / math.sqrt(9 * C)).to(dt)
    w = w.to(memory_format=torch.channels_last)
    b = (torch.randn(K, generator=ctx.gen, device=DEVICE) * 0.1).to(dt)
    with torch.no_grad():
        full = time_it(ctx, lambda: F.conv2d(x, w, b, padding=1).relu_())
        conv = time_it(ctx, lambda: F.conv2d(x, w, b, padding=1))
        ref = reference(torch, x.permute(0, 2, 3, 1), w.permute(0, 2, 3, 1), b, True)
        got = F.conv2d(x, w, b, padding=1).relu_().permute(0, 2, 3, 1).float()
        rel = ((got - ref).norm() / ref.norm()).item()
    res = {"cudnn_ms": full, "cudnn_conv_only_ms": conv, "cudnn_rel_l2": rel}
    _CUDNN_CACHE[key] = res
    return res


def run_item(ctx: Ctx, it: Item) -> dict[str, Any]:
    cfg = cp.BY_ENTRY[it.cfg]
    if it.kind == "probe-id":
        return t_probe_id(ctx, it, cfg)
    if it.kind == "probe-w":
        return t_probe_w(ctx, it, cfg)
    if it.kind == "tap":
        return t_tap(ctx, it, cfg)
    if it.kind == "rand1":
        return t_random(ctx, it, cfg)
    if it.kind == "slice":
        return t_random(ctx, it, cfg, slice_=True)
    if it.kind == "layer":
        res = t_random(ctx, it, cfg, timed=True)
        res.update(cudnn_times(ctx, it.N, it.H, it.W, it.C, it.K))
        return res
    raise ValueError(it.kind)


def worker(args: argparse.Namespace) -> int:
    global CURRENT_TEST
    items = build_items(args.quick, args.only)
    skip = set(filter(None, args.skip_configs.split(",")))

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        ctx = Ctx()
    except Exception as exc:
        emit({"event": "init_failed", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return 3
    gpu = "numpy emulator (--emulate)" if EMULATE else ctx.torch.cuda.get_device_name(0)
    emit({"event": "ready", "binary": ctx.mod.source, "functions": ctx.mod.info, "sms": ctx.mod.sms,
          "gpu": gpu, "torch": ctx.torch.__version__})  # fmt: skip
    for i in range(args.start, len(items)):
        it = items[i]
        if it.cfg in skip:
            continue
        emit({"event": "start", "index": i, "name": it.name})
        CURRENT_TEST = it.name
        t0 = time.time()
        try:
            res = run_item(ctx, it)
        except Exception as exc:  # reported; the worker goes on only if CUDA still works
            error = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            if ctx.healthy():  # e.g. a rejected tensor map or launch: the context is fine
                emit({"event": "result", "index": i, "name": it.name, "cfg": it.cfg, "kind": it.kind,
                      "layer": it.layer, "pass": False, **error})  # fmt: skip
                continue
            emit({"event": "error", "index": i, "name": it.name, **error})  # a fault: the context is gone
            return 2
        wd = ctx.status_report()
        if wd:
            res["pass"] = False
            res["watchdog"] = wd
        res.update({"event": "result", "index": i, "name": it.name, "cfg": it.cfg, "kind": it.kind,
                    "layer": it.layer, "N": it.N, "H": it.H, "W": it.W, "C": it.C, "K": it.K,
                    "seconds": round(time.time() - t0, 3)})  # fmt: skip
        emit(res)
    emit({"event": "done"})
    return 0


# ------------------------------------------------------------------------------------------------
# Parent: run workers with timeouts, restart after faults, print the report


def sass_counts() -> dict[str, Any] | None:
    try:
        import build

        cubin = (HERE / "conv3x3_wgmma.sm_90a.cubin").read_bytes()
        return build.sass_summary(cubin)
    except Exception as exc:
        return {"error": str(exc)}


def failed(it: Item, error: str) -> dict[str, Any]:
    return {"name": it.name, "cfg": it.cfg, "kind": it.kind, "pass": False, "error": error}


@dataclass
class Run:
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    ready: dict[str, Any] = field(default_factory=dict)


def parent(args: argparse.Namespace) -> int:
    t_start = time.time()
    items = build_items(args.quick, args.only)
    run = Run()
    bad_configs: set[str] = set()
    start = 0
    restarts = 0
    print(f"[check] {len(items)} tests; budget {args.budget:.0f} s; SASS: ", end="", flush=True)
    sass = sass_counts()
    print(json.dumps(sass) if sass else "no cuobjdump", flush=True)
    while start < len(items) and time.time() - t_start < args.budget:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--start", str(start),
               "--skip-configs", ",".join(sorted(bad_configs))]  # fmt: skip
        cmd += (["--quick"] if args.quick else []) + (["--emulate"] if args.emulate else [])
        cmd += ["--only", args.only] if args.only else []
        cmd += ["--no-watchdog"] if args.no_watchdog else []
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        lines: queue.Queue[str | None] = queue.Queue()
        err_tail: list[str] = []

        def pump_out(p: subprocess.Popen = proc, q: queue.Queue = lines) -> None:
            for line in p.stdout:  # type: ignore[union-attr]
                q.put(line)
            q.put(None)

        def pump_err(p: subprocess.Popen = proc, tail: list[str] = err_tail) -> None:
            for line in p.stderr:  # type: ignore[union-attr]
                tail.append(line)
                del tail[:-40]

        threading.Thread(target=pump_out, daemon=True).start()
        threading.Thread(target=pump_err, daemon=True).start()
        current: dict[str, Any] | None = None
        timeout = args.init_timeout
        finished = False
        while True:
            left = args.budget - (time.time() - t_start)
            try:
                line = lines.get(timeout=max(1.0, min(timeout, left)))
            except queue.Empty:
                proc.kill()
                if args.budget - (time.time() - t_start) <= 0:
                    print(f"[check] time budget of {args.budget:.0f} s used up: stopping", flush=True)
                    start = len(items)
                    break
                if current is not None:
                    i = current["index"]
                    run.results[i] = failed(items[i], f"no progress for {timeout:.0f} s: killed (hang?)")
                    bad_configs.add(items[i].cfg)
                    start = i + 1
                    print(f"[check] HANG in {items[i].name}: killed", flush=True)
                else:
                    print("[check] worker made no progress (start-up or budget): stopping", flush=True)
                    start = len(items)
                break
            if line is None:
                break
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            kind = ev.get("event")
            if kind == "ready":
                run.ready = ev
                timeout = args.test_timeout
                print(f"[check] worker ready: {ev['gpu']}, {ev['sms']} SMs, binary: {ev['binary']}", flush=True)
                for name, info in ev["functions"].items():
                    print(f"          {name:32s} {info}", flush=True)
            elif kind == "init_failed":
                print(f"[check] worker init failed: {ev['error']}\n{ev['trace']}", flush=True)
                run.events.append(ev)
                start = len(items)
                finished = True
            elif kind == "start":
                current = ev
            elif kind == "result":
                i = ev["index"]
                run.results[i] = ev
                current = None
                start = i + 1
                if not ev.get("pass"):
                    print(f"[check] FAIL {ev['name']}: {json.dumps({k: ev[k] for k in ev if k not in ('event',)})}",
                          flush=True)  # fmt: skip
                else:
                    extra = f" rel_l2={ev['rel_l2']:.2e}" if "rel_l2" in ev else ""
                    if "ms" in ev:
                        extra += f" {ev['ms']:.4f} ms, cuDNN {ev.get('cudnn_ms', float('nan')):.4f} ms"
                    print(f"[check] pass {ev['name']}{extra}", flush=True)
            elif kind == "error":
                i = ev["index"]
                run.results[i] = {**failed(items[i], ev["error"]), "trace": ev["trace"]}
                bad_configs.add(items[i].cfg)
                start = i + 1
                print(f"[check] ERROR in {ev['name']}: {ev['error']}\n{ev['trace']}", flush=True)
            elif kind == "done":
                start = len(items)
                finished = True
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if proc.returncode not in (0, None) and not finished and current is not None:
            i = current["index"]
            if i not in run.results:
                run.results[i] = failed(items[i], f"worker died (exit {proc.returncode}): {''.join(err_tail)[-1500:]}")
                bad_configs.add(items[i].cfg)
                start = i + 1
                print(f"[check] worker died in {items[i].name}: {''.join(err_tail)[-1500:]}", flush=True)
        if finished:
            break
        restarts += 1
        if restarts > args.max_restarts:
            print(f"[check] {restarts} worker restarts: giving up", flush=True)
            break
    report(items, run, sass, bad_configs, time.time() - t_start)
    return 0 if all(r.get("pass") for r in run.results.values()) and len(run.results) else 1


def _cudnn_fields(result: dict[str, Any] | None) -> dict[str, Any]:
    """The cuDNN numbers of a layer test's result (not its own ms, rel_l2, ...)."""
    return {k: v for k, v in (result or {}).items() if k.startswith("cudnn_")}


def report(items: list[Item], run: Run, sass: Any, bad_configs: set[str], seconds: float) -> None:
    res = run.results
    print("\n== probes and edge cases ==")
    for i, it in enumerate(items):
        if it.kind == "layer":
            continue
        r = res.get(i)
        status = "SKIP" if r is None else ("PASS" if r.get("pass") else "FAIL")
        extra = ""
        if r is not None and "rel_l2" in r:
            extra = f" rel_l2={r['rel_l2']:.2e}"
        if r is not None and not r.get("pass"):
            extra += " " + json.dumps({k: r[k] for k in ("probe", "where", "watchdog", "error") if k in r})[:600]
        print(f"  {status}  {it.name}{extra}")

    print("\n== U-Net 3x3 layers (best config per layer; speedup = cuDNN ms / ours) ==")
    hdr = f"{'layer':14s} {'N':>2s} {'C':>4s} {'K':>4s} {'HxW':>8s} {'best config':29s} {'ms':>8s} {'TFLOP/s':>8s} " \
          f"{'cuDNN ms':>9s} {'cuDNN TF':>8s} {'speedup':>8s} {'rel_l2':>9s} result"  # fmt: skip
    print(hdr)
    rows = []
    groups: dict[tuple[str, int], list[tuple[Item, dict[str, Any] | None]]] = {}
    for i, it in enumerate(items):
        if it.kind == "layer":
            groups.setdefault((it.layer, it.N), []).append((it, res.get(i)))
    totals: dict[int, list[float]] = {}
    for (layer, n), lst in groups.items():
        it0 = lst[0][0]
        done = [(it, r) for it, r in lst if r is not None]
        ok = [(it, r) for it, r in done if r.get("pass") and "ms" in r]
        all_pass = len(done) == len(lst) and all(r.get("pass") for _, r in done)
        flops = cp.flops(n, it0.H, it0.W, it0.C, it0.K)
        cud = next((r for _, r in done if "cudnn_ms" in r), None)
        if ok:
            it, best = min(ok, key=lambda t: t[1]["ms"])
            ms = best["ms"]
            cu_ms = cud["cudnn_ms"] if cud else float("nan")
            status = "PASS" if all_pass else f"FAIL({sum(1 for _, r in done if not r.get('pass'))} cfg)"
            if len(done) < len(lst):
                status += f" ({len(lst) - len(done)} cfg not run)"
            print(f"{layer:14s} {n:2d} {it0.C:4d} {it0.K:4d} {it0.H:4d}x{it0.W:<4d} {it.cfg[14:]:29s} {ms:8.4f} "
                  f"{flops / ms / 1e9:8.1f} {cu_ms:9.4f} {flops / cu_ms / 1e9:8.1f} {cu_ms / ms:8.2f} "
                  f"{best['rel_l2']:9.2e} {status}")  # fmt: skip
            mult = len(layer.split("/"))
            t = totals.setdefault(n, [0.0, 0.0])
            t[0] += mult * ms
            t[1] += mult * cu_ms
            rows.append({"layer": layer, "N": n, "C": it0.C, "K": it0.K, "H": it0.H, "W": it0.W, "best_cfg": it.cfg,
                         "ms": ms, "tflops": flops / ms / 1e9, **_cudnn_fields(cud), "rel_l2": best["rel_l2"],
                         "status": status,
                         "per_config_ms": {i2.cfg: r2.get("ms") for i2, r2 in done}})  # fmt: skip
        else:
            why = "not run" if not done else "; ".join(
                str(r.get("error") or r.get("watchdog") or r.get("where") or f"rel_l2={r.get('rel_l2')}")[:120]
                for _, r in done[:2])  # fmt: skip
            print(f"{layer:14s} {n:2d} {it0.C:4d} {it0.K:4d} {it0.H:4d}x{it0.W:<4d} {'-':29s} {'':8s} {'':8s} "
                  f"{(cud or {}).get('cudnn_ms', float('nan')):9.4f} {'':8s} {'':8s} {'':9s} "
                  f"{'SKIP' if not done else 'FAIL'} {why}")  # fmt: skip
            rows.append({"layer": layer, "N": n, "status": "SKIP" if not done else "FAIL", "why": why})
    for n, (ours, theirs) in sorted(totals.items()):
        print(f"sum over the U-Net's 3x3 layers (shared shapes counted twice), N={n}: ours {ours:.3f} ms, "
              f"cuDNN {theirs:.3f} ms, speedup {theirs / ours:.2f}  (only layers that ran)")  # fmt: skip
    print("\nper-config ms (layer/N: config=ms):")
    for row in rows:
        if "per_config_ms" in row:
            cfgs = " ".join(f"{k[14:]}={v:.4f}" if v else f"{k[14:]}=FAIL" for k, v in row["per_config_ms"].items())
            print(f"  {row['layer']}/N={row['N']}: {cfgs}")
    n_fail = sum(1 for r in res.values() if not r.get("pass"))
    print(f"\n{len(res)} of {len(items)} tests ran, {n_fail} failed; configs that faulted or hung: "
          f"{sorted(bad_configs) or 'none'}; {seconds:.1f} s")  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / ("wgmma_check_nowd.json" if NO_WATCHDOG else "wgmma_check.json")
        doc = {
            "watchdog": not NO_WATCHDOG,
            "ready": run.ready,
            "sass": sass,
            "layers": rows,
            "tests": [{**res[i], "name": items[i].name} for i in sorted(res)],
            "bad_configs": sorted(bad_configs),
            "seconds": seconds,
        }
        path.write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="probes, edge cases and N=1 layers only")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only tests whose name has one")
    ap.add_argument("--budget", type=float, default=80.0, help="stop starting tests after this many seconds")
    ap.add_argument("--test-timeout", type=float, default=25.0, help="kill a test that makes no progress this long")
    ap.add_argument(
        "--init-timeout", type=float, default=60.0, help="worker start-up limit (torch import, module load)"
    )
    ap.add_argument("--max-restarts", type=int, default=5)
    ap.add_argument("--emulate", action="store_true", help="test check.py itself on a CPU: numpy emulator, tiny layers")
    ap.add_argument(
        "--no-watchdog", action="store_true", help="compile the kernel here without its watchdog, to time its cost"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--skip-configs", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEVICE, EMULATE, NO_WATCHDOG
    if args.emulate:
        DEVICE, EMULATE = "cpu", True
    NO_WATCHDOG = args.no_watchdog and not args.emulate
    return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    sys.exit(main())
