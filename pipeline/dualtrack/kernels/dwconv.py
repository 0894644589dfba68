"""dwconv_nhwc: the dwconv op (depthwise convolution, MobileNet's), one thread per output element
(fp16: per 8 channels where C and the strides allow)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, Tensors, positive
from dualtrack.kernels.conv import named_weights
from dualtrack.kernels.streaming import ElementSpec, onnx_weight_bias

KERNEL_SIZES = (3, 5)  # what the source unrolls (dwconv_any)


@dataclass(frozen=True)
class DwGeometry:
    """The convolution's shape attributes: kernel R x R, stride, dilation, pads (top, left,
    bottom, right) as ONNX writes them."""

    R: int = 3
    stride: int = 1
    dilation: int = 1
    pads: tuple[int, int, int, int] = (1, 1, 1, 1)

    def __post_init__(self) -> None:
        if self.R not in KERNEL_SIZES:
            raise InputError(f"dwconv takes {' or '.join(f'{k}x{k}' for k in KERNEL_SIZES)} kernels; got {self.R}")
        positive(stride=self.stride, dilation=self.dilation)
        if min(self.pads) < 0:
            raise InputError(f"dwconv pads {self.pads} must be >= 0")

    @classmethod
    def of(cls, call: KernelCall) -> DwGeometry:
        a = call.attr
        return cls(a("R"), a("stride"), a("dilation"), (a("pad_t"), a("pad_l"), a("pad_b"), a("pad_r")))

    def output_hw(self, H: int, W: int) -> tuple[int, int]:
        span = self.dilation * (self.R - 1) + 1
        t, left, b, r = self.pads
        Ho, Wo = (H + t + b - span) // self.stride + 1, (W + left + r - span) // self.stride + 1
        if Ho < 1 or Wo < 1:
            raise InputError(f"dwconv {self} of a {H}x{W} image has no output pixel")
        return Ho, Wo


@dataclass(frozen=True)
class DwConvSpec(ElementSpec):
    """Depthwise R x R convolution (R = 3, 5; any stride, dilation and padding), bias and an
    activation fused. Weights: ONNX (C, 1, R, R) packed RSC (:meth:`pack`), bias fp32."""

    MACRO: ClassVar[str] = "DWCONV"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "w", "bias", "y", "N", "H", "W", "C", "Ho", "Wo", "ldx", "ldy",
        "R", "S", "D", "pt", "pl", "act", "p0", "p1",
    )  # fmt: skip
    F16_LANES: ClassVar[int] = 8  # the fp16 vector path: one 16-byte access
    POINTERS: ClassVar[int] = 4
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))
    SHAPE_ATTRS: ClassVar[tuple[str, ...]] = ("geometry",)

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, geometry: DwGeometry | None = None
    ) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        if K not in (0, C):
            raise InputError(f"a depthwise convolution keeps the channels: C={C}, K={K}")
        return (N, *(geometry or DwGeometry()).output_hw(H, W), C)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """``Ho, Wo`` of the output, ``R, S, D, pt, pl`` of the ``geometry`` (a :class:`DwGeometry`)
        and the epilogue ``act, p0, p1``."""
        g: DwGeometry = kw["geometry"]
        _, Ho, Wo, _ = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, g)
        geometry = {"R": g.R, "S": g.stride, "D": g.dilation, "pt": g.pads[0], "pl": g.pads[1]}
        return {"Ho": Ho, "Wo": Wo, **geometry, **self.epilogue(kw)}

    @staticmethod
    def pack(w: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """ONNX depthwise weights (C, 1, R, R) -> RSC (R, R, C) in the same dtype; bias -> fp32."""
        if w.ndim != 4 or w.shape[1] != 1 or w.shape[2] != w.shape[3]:
            raise InputError(f"depthwise weights must be (C, 1, R, R) as ONNX stores them; got {w.shape}")
        packed = np.ascontiguousarray(w[:, 0].transpose(1, 2, 0))
        if bias is None:
            return packed, None
        if bias.shape != (w.shape[0],):
            raise InputError(f"dwconv bias has shape {bias.shape}; expected ({w.shape[0]},)")
        return packed, np.ascontiguousarray(bias, dtype=np.float32)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return named_weights(call, self.pack(*onnx_weight_bias(call, weights)))

    def reference(
        self,
        x: np.ndarray,
        w: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        geometry: DwGeometry | None = None,
        act: Activation | None = None,
    ) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C), ``w`` (R,R,C) packed, ``bias`` (C,) or None; float32
        products and sums, then bias, then the activation, rounded once to x's dtype."""
        g = geometry or DwGeometry()
        if w is None or x.ndim != 4 or w.shape != (g.R, g.R, x.shape[3]):
            raise InputError(
                f"dwconv takes x (N,H,W,C) and w (R,R,C) with R={g.R}; got x {x.shape}, w {getattr(w, 'shape', None)}"
            )
        N, H, W, C = x.shape
        Ho, Wo = g.output_hw(H, W)
        t, left, b, r = g.pads
        xp = np.pad(x.astype(np.float32), ((0, 0), (t, b), (left, r), (0, 0)))
        out = np.zeros((N, Ho, Wo, C), np.float32)
        S, D = g.stride, g.dilation
        for i in range(g.R):
            for j in range(g.R):
                tap = xp[:, i * D : i * D + S * (Ho - 1) + 1 : S, j * D : j * D + S * (Wo - 1) + 1 : S, :]
                out += tap * w[i, j].astype(np.float32)
        if bias is not None:
            out += bias.astype(np.float32)
        return (act or Activation()).apply(out).astype(x.dtype)

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"geometry": DwGeometry.of(call), "act": Activation.of(call)}

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The NHWC keyword arguments, the packed weights and bias, the geometry and the epilogue;
        ``y`` must have the convolution's output shape."""
        kw = {
            **super().call_args(call, inputs, y, weights),
            "geometry": DwGeometry.of(call),
            "act": Activation.of(call),
        }
        expect = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, kw["geometry"])
        if tuple(y.shape) != expect:
            raise InputError(f"dwconv {call.nodes}: output {y.shape} is not {expect}")
        return kw
