"""conv_fp8: the FP8 convolution (issue 42), the e4m3 rows of the wgmma family (conv3x3_wgmma.cu).

``KernelCall(op="conv_fp8", inputs=(xq[, res]), outputs=(y,), weights=(W[, B]), attrs=<the fp16 conv
call's> + (("x_scale", f32_bits(s_x)),))``: ``xq`` the e4m3 bytes of quantize_fp8 (dense NHWC uint8),
``y`` fp16 NHWC (a channel slice allowed), ``res`` an fp16 residual as in the fp16 convs. The attrs are
those of the call it replaces: the general conv's (``R``, ``S``, strides, pads, ``act``, ``residual``)
or conv3x3's / conv1x1's (``relu``; the window is then the weights').

    y = act(acc * dequant[k] + bias[k] + res),  acc = sum over taps and channels of xq * wq (fp32)

Weights (:meth:`ConvFp8Spec.pack_weights`): the ONNX weight (K, C, R, S) quantized per output channel,
``s_w[k] = max(amax_k, tiny) / 448``, as ONE uint8 array: the e4m3 KRSC bytes (K*R*S*C), then the fp32
``dequant[k] = s_x * s_w[k]`` (4*K bytes, 16-byte aligned since C % 16 == 0), so the call keeps the
fp16 call's weight names. The bias stays fp32. :func:`split_packed` reads it back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall, bits_f32
from dualtrack.errors import InputError
from dualtrack.kernels import base
from dualtrack.kernels.base import Tensors
from dualtrack.kernels.conv3x3_wgmma import Conv3x3WgmmaSpec, WgmmaConfig, input_map, weight_map
from dualtrack.kernels.conv_general import ConvGeometry
from dualtrack.kernels.device import REFERENCE, DeviceInfo
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.quantize_fp8 import E4M3_MAX, FP8_PTX_ARCHES, fp8_available, from_e4m3, to_e4m3
from dualtrack.kernels.select import ConvChoice

TINY = float(np.finfo(np.float32).tiny)  # an all-zero filter's amax: its scale stays positive
WINDOWS = {(3, 3): 1, (1, 1): 0}  # the windows the e4m3 rows take -> their padding on every side


def quantize_weights(w: np.ndarray, x_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ONNX weights (K, C, R, S) -> (e4m3 KRSC bytes, s_w (K,) float64, dequant (K,) float32 = s_x * s_w)."""
    w64 = np.asarray(w, np.float64)
    amax = np.abs(w64).reshape(w64.shape[0], -1).max(axis=1)
    s_w = np.maximum(amax, TINY) / E4M3_MAX
    q = to_e4m3((w64 / s_w[:, None, None, None]).transpose(0, 2, 3, 1))
    return np.ascontiguousarray(q), s_w, (np.float64(x_scale) * s_w).astype(np.float32)


def split_packed(packed: np.ndarray, K: int, taps: int) -> tuple[np.ndarray, np.ndarray]:
    """A packed conv_fp8 weight -> (e4m3 bytes (K, taps, C) uint8, dequant (K,) float32)."""
    flat = np.asarray(packed, np.uint8).reshape(-1)
    body = flat.size - 4 * K
    if body <= 0 or body % (K * taps):
        raise InputError(f"a packed conv_fp8 weight of {flat.size} bytes is not K={K} filters of {taps} taps + dequant")
    return flat[:body].reshape(K, taps, -1), flat[body:].view(np.float32).copy()


@dataclass(frozen=True)
class ConvFp8Spec(base.KernelSpec):
    """The conv_fp8 op: 3x3 stride-1 pad-1 and 1x1 stride-1 pad-0 convolutions (group 1, C % 16,
    K % 8) on e4m3 operands through :attr:`hopper`'s e4m3 rows (its ``e4m3_configs``); sm_90a only."""

    hopper: Conv3x3WgmmaSpec | None = None
    # choose(): of these (bn, mt, wgs), the first whose CTAs fill the GPU at its occupancy, else the
    # one with most; k-blocks of 128 channels unless C <= 64 (64). Not measured yet.
    prefer: tuple[tuple[int, int, int], ...] = (
        (128, 2, 2),
        (256, 1, 2),
        (64, 2, 2),
        (64, 1, 1),
        (128, 1, 2),
        (64, 1, 2),
    )

    ptx_arches: ClassVar[tuple[str, ...]] = FP8_PTX_ARCHES
    PARAMS: ClassVar[tuple[str, ...]] = (
        "tmx", "tmw", "bias", "dequant", "res", "y", "N", "H", "W", "C", "K", "ldy", "ldr", "act", "p0", "p1",
        "tw_log2", "dil", "ws", "status",
    )  # fmt: skip

    @property
    def wgmma(self) -> Conv3x3WgmmaSpec:
        if self.hopper is None:
            raise InputError("conv_fp8 has no wgmma kernel to run on (ConvFp8Spec(hopper=...))")
        return self.hopper

    @property
    def configs(self) -> tuple[WgmmaConfig, ...]:
        return self.wgmma.e4m3_configs

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(c.entry for c in self.configs)

    def defines(self) -> dict[str, int | str]:
        return self.wgmma.defines()  # one source: the wgmma family's rows

    def entry(self, dtype: Any) -> str:
        raise InputError(f"{self.op} has one entry per e4m3 row; use choice(...).entry")

    def available(self, device: DeviceInfo) -> bool:
        """Whether ``device`` runs this kernel (sm_90a)."""
        return fp8_available(device)

    # --- what the kernel computes -----------------------------------------------------------------

    def geometry(self, call: KernelCall, window: tuple[int, int] | None = None) -> ConvGeometry:
        """The call's window: the general conv's attributes, else (a conv3x3 or conv1x1 call's attrs)
        ``window`` (the weights' R, S; 3x3 when not known) with its padding."""
        if "R" in dict(call.attrs):
            return ConvGeometry.from_call(call)
        r, s = window or (3, 3)
        pad = WINDOWS.get((r, s), 0)
        return ConvGeometry(r, s, pad_top=pad, pad_left=pad, pad_bottom=pad, pad_right=pad)

    def activation(self, call: KernelCall) -> Activation:
        """The general conv's ``act`` attrs, or a conv3x3/conv1x1 call's ``relu``."""
        if "act" in dict(call.attrs):
            return Activation.of(call)
        return Activation.named("relu" if call.attr("relu") else "none")

    def supports(self, call: KernelCall, *, C: int | None = None, K: int | None = None) -> str | None:
        """None when the e4m3 rows compute this call (the compiler asks before it lowers a conv to
        conv_fp8; ``C``, ``K``: the input and output channels, checked where given), else why not."""
        g = self.geometry(call)
        if g.groups * g.merge != 1:
            return f"group={g.groups * g.merge}: conv_fp8 takes group 1"
        if (g.R, g.S) not in WINDOWS or (g.stride_h, g.stride_w, g.dil_h, g.dil_w) != (1, 1, 1, 1):
            return f"{g.label()}: conv_fp8 takes 3x3 and 1x1 windows, stride 1, dilation 1"
        pad = WINDOWS[(g.R, g.S)]
        if (g.pad_top, g.pad_left, g.pad_bottom, g.pad_right) != (pad,) * 4:
            return f"{g.label()}: conv_fp8 takes padding {pad} on every side of a {g.R}x{g.S} window"
        s = bits_f32(call.attr("x_scale"))
        if not (np.isfinite(s) and s > 0):
            return f"x_scale={s}: the input's scale must be a finite positive float"
        if C is not None and C % 16:
            return f"C={C}: the e4m3 rows' TMA rows need C % 16 == 0"
        if K is not None and K % 8:
            return f"K={K}: the epilogue's 16-byte stores need K % 8 == 0"
        return None

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        base.positive(N=N, H=H, W=W, C=C, K=K)
        return (N, H, W, K)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``W``: e4m3 KRSC bytes then the fp32 dequant vector, one uint8 array (module docstring);
        ``B`` (where the call has one): the fp32 bias."""
        w = np.asarray(weights[call.weights[0]])
        if w.ndim != 4 or w.shape[2:] not in WINDOWS:
            raise InputError(f"conv_fp8 {call.nodes}: weights {w.shape} are not (K, C, 3, 3) or (K, C, 1, 1)")
        why = self.supports(call, C=w.shape[1], K=w.shape[0])
        if why:
            raise InputError(f"conv_fp8 {call.nodes} cannot run: {why}; keep the layer fp16")
        q, _, dequant = quantize_weights(w, bits_f32(call.attr("x_scale")))
        out = {call.weights[0]: np.concatenate([q.reshape(-1), dequant.view(np.uint8)])}
        if len(call.weights) > 1:
            out[call.weights[1]] = np.ascontiguousarray(weights[call.weights[1]], dtype=np.float32).reshape(-1)
        return out

    def reference(
        self,
        xq: np.ndarray,
        w: np.ndarray,
        bias: np.ndarray | None = None,
        res: np.ndarray | None = None,
        *,
        geom: ConvGeometry,
        act: Activation | None = None,
    ) -> np.ndarray:
        """numpy semantics in float64: the conv of the exact e4m3 values of ``xq`` (N,H,W,C uint8)
        and of the packed weights ``w`` (:meth:`pack_weights`), times dequant[k] (= s_x * s_w[k]),
        + bias + residual, then the activation (on float32) and one rounding to fp16."""
        N, H, W, C = xq.shape
        taps, pad = geom.R * geom.S, WINDOWS[(geom.R, geom.S)]
        K = np.asarray(w).size // (taps * C + 4)
        wq, dequant = split_packed(w, K, taps)
        xv = np.pad(from_e4m3(xq), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        wv = from_e4m3(wq).reshape(K, geom.R, geom.S, C)
        out = np.zeros((N, H, W, K), np.float64)
        for r in range(geom.R):
            for s in range(geom.S):
                # One 2-D GEMM of a contiguous copy: numpy's matmul of a strided 4-D view runs without BLAS.
                tap = np.ascontiguousarray(xv[:, r : r + H, s : s + W, :]).reshape(-1, C)
                out += (tap @ wv[:, r, s, :].T).reshape(out.shape)
        out *= dequant.astype(np.float64)
        if bias is not None:
            out += np.asarray(bias, np.float64).reshape(K)
        if res is not None:
            if res.shape != out.shape:
                raise InputError(f"conv_fp8 residual has shape {res.shape}; expected the output's {out.shape}")
            out += res.astype(np.float64)
        return (act or Activation()).apply(out.astype(np.float32)).astype(np.float16)

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        packed = self.pack_weights(call, weights)
        window = tuple(np.asarray(weights[call.weights[0]]).shape[2:])
        bias = packed.get(call.weights[1]) if len(call.weights) > 1 else None
        res = inputs[1] if call.attr("residual") else None
        geom = self.geometry(call, window)  # type: ignore[arg-type]
        return self.reference(inputs[0], packed[call.weights[0]], bias, res, geom=geom, act=self.activation(call))

    # --- the launch ----------------------------------------------------------------------------------

    def choose(self, p: ConvProblem, device: DeviceInfo = REFERENCE, *, pointwise: bool = False) -> WgmmaConfig:
        """The e4m3 row for launch ``p`` on ``device``: k-blocks of 128 channels (64 where C <= 64),
        tiles no wider than K rounded up to 32 (K <= 32: the 32-wide tile), :attr:`prefer`'s order."""
        bk = 64 if p.C <= 64 else 128
        rows = [c for c in self.configs if c.pointwise == pointwise and c.bk == bk]
        k32 = base.cdiv(p.K, 32) * 32
        by_shape = {(c.bn, c.mt, c.wgs): c for c in rows}
        wide = [by_shape[t] for t in self.prefer if t in by_shape and t[0] <= k32]
        for c in wide:
            if c.ctas(p.N, p.H, p.W, p.K) >= device.full_wave(c.min_blocks):
                return c
        if wide:
            return max(wide, key=lambda c: (c.ctas(p.N, p.H, p.W, p.K), -c.bm * c.bn))
        return min(rows, key=lambda c: c.bn)

    def choice(self, p: ConvProblem, device: DeviceInfo, *, pointwise: bool = False) -> ConvChoice:
        """:meth:`choose`'s row and the family's split-K for ``device``, and why."""
        cfg = self.choose(p, device, pointwise=pointwise)
        splits = self.wgmma.splits(cfg, p.N, p.H, p.W, p.C, p.K, device=device)
        split = f" x {splits} split-K" if splits > 1 else ""
        return ConvChoice("wgmma", cfg.entry, f"e4m3 {cfg.bm}x{cfg.bn} tile{split}", splits)

    def check_tensors(self, call: KernelCall, xq: base.DeviceTensor, y: base.DeviceTensor) -> ConvProblem:
        """The launch shape, having checked what TMA and the epilogue need of the tensors."""
        if np.dtype(xq.dtype) != np.uint8 or base.dtype_name(y.dtype) != "float16":
            raise InputError(f"conv_fp8 {call.nodes} reads uint8 (e4m3) and writes fp16; got {xq.dtype} -> {y.dtype}")
        n, h, w, c = xq.shape
        p = ConvProblem(n, h, w, c, y.shape[3], xq.channel_stride, y.channel_stride, "float16")
        if tuple(y.shape) != (n, h, w, p.K):
            raise InputError(f"conv_fp8 {call.nodes}: output {tuple(y.shape)} is not {(n, h, w, p.K)}")
        why = self.supports(call, C=p.C, K=p.K)
        if why is None and (p.ldx % 16 or xq.ptr % 16):
            why = f"ldx={p.ldx} bytes, x={xq.ptr:#x}: TMA needs 16-byte pixel rows and a 16-byte aligned input"
        if why is None and (p.ldy % 8 or y.ptr % 16):
            why = f"ldy={p.ldy}, y={y.ptr:#x}: the epilogue's 16-byte stores need ldy % 8 == 0 and an aligned y"
        if why:
            raise InputError(f"conv_fp8 {call.nodes} cannot run: {why}")
        base.pixels(p.N, p.H, p.W, max(p.ldx, p.ldy))
        return p

    def prepare_inputs(
        self, call: KernelCall, inputs: Tensors, y: base.DeviceTensor, weights: Tensors, ctx: base.LaunchContext
    ) -> base.PreparedCall:
        """The e4m3 row :meth:`choice` picks on ``ctx.device`` (:meth:`prepare_entry`); ``inputs``:
        ``xq``, then the residual where the call has one."""
        if ctx.wgmma_off is not None:
            raise InputError(
                f"conv_fp8 {call.nodes} needs the wgmma kernel ({ctx.wgmma_off}); build with precision fp16"
            )
        p = self.check_tensors(call, inputs[0], y)
        taps = (weights[0].shape[0] - 4 * p.K) // (p.K * p.C) if len(weights[0].shape) == 1 else 0
        geom = self.geometry(call, {9: (3, 3), 1: (1, 1)}.get(taps))
        choice = self.choice(p, ctx.device, pointwise=(geom.R, geom.S) == (1, 1))
        return self.prepare_entry(call, choice, inputs, y, weights, ctx)

    def prepare_entry(
        self,
        call: KernelCall,
        choice: ConvChoice,
        inputs: Tensors,
        y: base.DeviceTensor,
        weights: Tensors,
        ctx: base.LaunchContext,
    ) -> base.PreparedCall:
        """The launch of the e4m3 row ``choice`` names (with its split-K): the UINT8 tensor maps of
        ``xq`` and of the packed weights, the family's arguments with ``dequant`` after ``bias``."""
        xq = inputs[0]
        p = self.check_tensors(call, xq, y)
        res = inputs[1] if call.attr("residual") else None
        if res is not None and tuple(res.shape) != tuple(y.shape):
            raise InputError(f"conv_fp8 {call.nodes}: residual {tuple(res.shape)} is not the output's {tuple(y.shape)}")
        cfg = self.wgmma.config(choice.entry)
        if not cfg.e4m3 or len(weights[0].shape) != 1 or weights[0].shape[0] != p.K * (cfg.taps * p.C + 4):
            raise InputError(
                f"conv_fp8 {call.nodes}: weights {weights[0].shape} are not this call's packed weights ({choice.entry})"
            )
        w_ptr = weights[0].ptr
        tmx = ctx.tensor_map(input_map(cfg, xq.ptr, p.N, p.H, p.W, p.C, p.ldx))
        tmw = ctx.tensor_map(weight_map(cfg, w_ptr, p.K, p.C))
        extra: dict[str, Any] = {} if res is None else {"res": res.ptr, "ldr": res.channel_stride}
        if choice.splits > 1:
            extra["ws"] = ctx.workspace(self.wgmma.workspace_bytes(cfg, p.N, p.H, p.W, p.K, choice.splits))
        bias = weights[1].ptr if len(weights) > 1 else None
        args = self.wgmma.args(
            p, tmx=tmx, tmw=tmw, y=y.ptr, entry=choice.entry, bias=bias, act=self.activation(call), **extra
        )
        # The e4m3 rows' one extra parameter: dequant after bias (the packed weight's tail).
        args.insert(3, (w_ptr + cfg.taps * p.K * p.C, ctypes.c_void_p))
        config = self.wgmma.launch("float16", p.N, p.H, p.W, p.C, p.K, entry=choice.entry, splits=choice.splits)
        return base.PreparedCall(choice.entry, config, args, choice)
