"""convt_nhwc: the general ``convt`` op — ONNX ConvTranspose of any kernel, stride, dilation, padding,
output padding and group count, with convt2x2's neighbours' fused epilogue (bias, a residual added
before the activation, any row of :mod:`dualtrack.contract.activations`), writing into a channel slice.

Gather form on CUDA cores (handwritten_ptx/convt_nhwc.cu): every output element sums the input taps
that reach it, so each is written once with no atomics. The 2x2 stride-2 unpadded ConvTranspose of
U-Nets stays convt2x2's (a tensor-core GEMM); the partition picks between the two
(``partition._convt_kernel``). A call's window is its attributes (:class:`ConvTGeometry`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    INT32_MAX,
    DeviceTensor,
    LaunchConfig,
    Tensors,
    cdiv,
    dtype_name,
    pixels,
    positive,
)
from dualtrack.kernels.conv import named_weights
from dualtrack.kernels.streaming import StreamingSpec

MAX_KERNEL = 15  # R and S: the gather loops every tap, so nothing in the kernel caps them; this bounds the work
LANES = 8  # output channels a work item (convt_nhwc.cu's V)


@dataclass(frozen=True)
class ConvTGeometry:
    """A transposed convolution's window as ONNX writes it: ``R x S`` kernel, strides, dilations,
    ``pads`` (top, left, bottom: crop the full output), ``output_padding`` (rows and columns added
    at the bottom and right) and groups."""

    R: int
    S: int
    stride_h: int = 1
    stride_w: int = 1
    dil_h: int = 1
    dil_w: int = 1
    pad_top: int = 0
    pad_left: int = 0
    pad_bottom: int = 0
    pad_right: int = 0
    out_pad_h: int = 0
    out_pad_w: int = 0
    groups: int = 1

    def output_hw(self, H: int, W: int) -> tuple[int, int]:
        """(P, Q) on an H x W input (ONNX: stride*(in-1) + output_padding + dilation*(k-1) + 1 - pads)."""
        P = self.stride_h * (H - 1) + self.out_pad_h + self.dil_h * (self.R - 1) + 1 - self.pad_top - self.pad_bottom
        Q = self.stride_w * (W - 1) + self.out_pad_w + self.dil_w * (self.S - 1) + 1 - self.pad_left - self.pad_right
        return P, Q

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The geometry as :class:`KernelCall` attributes."""
        return tuple(asdict(self).items())

    @classmethod
    def from_call(cls, call: KernelCall) -> ConvTGeometry:
        got = dict(call.attrs)
        if "R" not in got or "S" not in got:
            raise InputError(f"convt call {call.nodes or call.outputs} has no R/S attribute")
        return cls(**{k: int(v) for k, v in got.items() if k in cls.__dataclass_fields__})

    def problem(self, C: int, K: int) -> str | None:
        """Why the kernel cannot take this window on C -> K channels, or None."""
        if not (1 <= self.R <= MAX_KERNEL and 1 <= self.S <= MAX_KERNEL):
            return f"kernel {self.R}x{self.S}: the general ConvTranspose takes 1..{MAX_KERNEL} a side"
        if min(self.stride_h, self.stride_w, self.dil_h, self.dil_w, self.groups) < 1:
            return f"strides, dilations and group of {self.label()} must be >= 1"
        if min(self.pad_top, self.pad_left, self.pad_bottom, self.pad_right, self.out_pad_h, self.out_pad_w) < 0:
            return f"negative pads or output_padding in {self.label()}"
        if self.out_pad_h >= max(self.stride_h, self.dil_h) or self.out_pad_w >= max(self.stride_w, self.dil_w):
            return f"output_padding {self.out_pad_h},{self.out_pad_w} must be below the stride or the dilation"
        if C % self.groups or K % self.groups:
            return f"group={self.groups} does not divide C={C} and K={K}"
        return None

    def label(self) -> str:
        pads = (self.pad_top, self.pad_left, self.pad_bottom, self.pad_right)
        return (
            f"{self.R}x{self.S} stride {self.stride_h},{self.stride_w} dilation {self.dil_h},{self.dil_w} "
            f"pads {','.join(map(str, pads))} output_padding {self.out_pad_h},{self.out_pad_w} group {self.groups}"
        )


def pack_convt_general(
    w: np.ndarray, bias: np.ndarray | None = None, groups: int = 1
) -> tuple[np.ndarray, np.ndarray | None]:
    """ONNX ConvTranspose weights (C, K/groups, R, S) and bias (K,) -> (groups, R, S, C/groups,
    K/groups) in the same dtype (a (tap, input channel)'s output channels contiguous) and an fp32 bias."""
    if w.ndim != 4 or w.shape[0] % groups:
        raise InputError(f"ConvTranspose weights must be (C, K/group, R, S), group={groups} dividing C; got {w.shape}")
    C, kg, R, S = w.shape
    packed = np.ascontiguousarray(w.reshape(groups, C // groups, kg, R, S).transpose(0, 3, 4, 1, 2))
    if bias is None:
        return packed, None
    if bias.shape != (kg * groups,):
        raise InputError(f"ConvTranspose bias has shape {bias.shape}; expected ({kg * groups},)")
    return packed, np.ascontiguousarray(bias, dtype=np.float32)


@dataclass(frozen=True)
class ConvTSpec(StreamingSpec):
    """Any ConvTranspose (:class:`ConvTGeometry`) with bias, residual and activation fused; one
    thread per output pixel and 8 output channels of one group. Weights :func:`pack_convt_general`."""

    MACRO: ClassVar[str] = "CONVTG"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "w", "bias", "res", "y", "N", "H", "W", "C", "K", "G", "P", "Q", "R", "S", "stride_h", "stride_w",
        "pad_top", "pad_left", "dil_h", "dil_w", "ldx", "ldy", "ldr", "act", "p0", "p1",
    )  # fmt: skip
    POINTERS: ClassVar[int] = 5
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias", "res"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "K"), ("ldr", "K"))
    _GEOMETRY: ClassVar[tuple[str, ...]] = ("R", "S", "stride_h", "stride_w", "pad_top", "pad_left", "dil_h", "dil_w")

    def supports(self, dtype: Any, H: int, W: int, C: int, K: int, geom: ConvTGeometry) -> str | None:
        """None when the kernel computes this ConvTranspose (H x W x C input, K outputs), else why not:
        the one predicate the partition asks before it lowers a ConvTranspose to this op."""
        try:
            dtype_name(dtype)
        except InputError as exc:
            return str(exc)
        why = geom.problem(C, K)
        if why:
            return why
        if min(H, W, C, K) < 1:
            return f"input {H}x{W}x{C} -> {K} channels: every size must be >= 1"
        P, Q = geom.output_hw(H, W)
        if P < 1 or Q < 1:
            return f"{geom.label()} on {H}x{W} has an empty output ({P}x{Q})"
        return None

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, geom: ConvTGeometry | None = None
    ) -> tuple[int, int, int, int]:
        if geom is None:
            raise InputError("the general ConvTranspose's output shape needs its geometry (geom=ConvTGeometry(...))")
        positive(N=N, H=H, W=W, C=C, K=K)
        why = self.supports("float32", H, W, C, K, geom)
        if why:
            raise InputError(f"the general ConvTranspose cannot run this: {why}")
        return (N, *geom.output_hw(H, W), K)

    def launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0, geom: ConvTGeometry | None = None
    ) -> LaunchConfig:
        """One thread per (output pixel, 8 output channels of a group), 1-D grid (the kernel loops
        grid-stride, so any grid is correct)."""
        _, P, Q, _ = self.output_shape(N, H, W, C, K, geom)
        assert geom is not None
        pixels(N, P, Q, K)
        items = N * P * Q * geom.groups * cdiv(K // geom.groups, LANES)
        blocks = cdiv(items, self.threads(dtype))
        if blocks > INT32_MAX:
            raise InputError(f"convt of {N}x{H}x{W}x{C} -> {K} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    def call_launch(self, dtype: Any, kw: Mapping[str, Any]) -> LaunchConfig:
        return self.launch(dtype, kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], kw["geom"])

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The output size ``P, Q``, one group's ``C, K`` and the group count ``G``, the window
        of ``geom`` and the epilogue ``act, p0, p1``."""
        g: ConvTGeometry = kw["geom"]
        _, P, Q, _ = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], g)
        pixels(kw["N"], max(P, kw["H"]), max(Q, kw["W"]), max(kw["ldx"], kw["ldy"], kw.get("ldr") or 0))
        group = {"C": kw["C"] // g.groups, "K": kw["K"] // g.groups, "G": g.groups}
        return {"P": P, "Q": Q, **group, **{n: getattr(g, n) for n in self._GEOMETRY}, **self.epilogue(kw)}

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        bias = weights[call.weights[1]] if len(call.weights) > 1 else None
        groups = ConvTGeometry.from_call(call).groups
        return named_weights(call, pack_convt_general(weights[call.weights[0]], bias, groups))

    def reference(
        self,
        x: np.ndarray,
        w: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        res: np.ndarray | None = None,
        *,
        geom: ConvTGeometry | None = None,
        act: Activation | None = None,
    ) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C), packed ``w`` (G,R,S,C/G,K/G), ``bias`` (K,) or None,
        ``res`` (N,P,Q,K) or None. Scatter form (each input pixel's taps added where they land, then
        the pads cropped), float32, then bias, residual and activation, rounded once to x's dtype."""
        g = geom
        if w is None or g is None:
            raise InputError("the general ConvTranspose's reference needs packed weights and its geometry")
        G = g.groups
        if x.ndim != 4 or w.ndim != 5 or w.shape[:4] != (G, g.R, g.S, x.shape[3] // G) or x.shape[3] % G:
            raise InputError(f"convt takes x (N,H,W,C) and w ({G},{g.R},{g.S},C/{G},K/{G}); got {x.shape}, {w.shape}")
        N, H, W, C = x.shape
        kg = w.shape[4]
        _, P, Q, K = self.output_shape(N, H, W, C, kg * G, g)
        full_h = max(g.stride_h * (H - 1) + g.dil_h * (g.R - 1) + 1, g.pad_top + P)
        full_w = max(g.stride_w * (W - 1) + g.dil_w * (g.S - 1) + 1, g.pad_left + Q)
        full = np.zeros((N, full_h, full_w, K), np.float32)
        xf, wf, cg = x.astype(np.float32), w.astype(np.float32), C // G
        for r in range(g.R):
            for s in range(g.S):
                rows = slice(r * g.dil_h, r * g.dil_h + g.stride_h * (H - 1) + 1, g.stride_h)
                cols = slice(s * g.dil_w, s * g.dil_w + g.stride_w * (W - 1) + 1, g.stride_w)
                for j in range(G):
                    full[:, rows, cols, j * kg : (j + 1) * kg] += xf[..., j * cg : (j + 1) * cg] @ wf[j, r, s]
        out = full[:, g.pad_top : g.pad_top + P, g.pad_left : g.pad_left + Q]
        if bias is not None:
            out = out + bias.astype(np.float32)
        if res is not None:
            if res.shape != out.shape:
                raise InputError(f"residual has shape {res.shape}; expected the output's {out.shape}")
            out = out + res.astype(np.float32)
        return (act or Activation()).apply(out).astype(x.dtype)

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        packed = self.pack_weights(call, weights)
        bias = packed.get(call.weights[1]) if len(call.weights) > 1 else None
        res = inputs[1] if call.attr("residual") else None
        return self.reference(inputs[0], packed[call.weights[0]], bias, res, **self.call_attrs(call))

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"geom": ConvTGeometry.from_call(call), "act": Activation.of(call)}

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The NHWC keyword arguments, the window and epilogue, the residual (``inputs[1]``) where
        the call has one; ``y`` must have the output shape."""
        kw = super().call_args(call, inputs, y, weights)
        if call.attr("residual"):
            if len(inputs) < 2:
                raise InputError(f"convt call {call.nodes} has a residual input: prepare it with prepare_inputs")
            kw.update(res=inputs[1].ptr, ldr=inputs[1].channel_stride)
        expect = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], kw["geom"])
        for what, t in (("output", y), ("residual", inputs[1] if call.attr("residual") else None)):
            if t is not None and tuple(t.shape) != expect:
                raise InputError(f"convt call {call.nodes}: {what} has shape {tuple(t.shape)}; expected {expect}")
        return kw
