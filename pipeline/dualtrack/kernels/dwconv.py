"""dwconv_nhwc: the dwconv op (depthwise convolution: MobileNet's 3x3/5x5, ConvNeXt's 7x7, the
factorised 1xk / kx1, with a channel multiplier), one thread per output element (fp16: per 8
channels where C and the strides allow).

Every depthwise Conv is this op's, never the grouped general conv's: with one input channel a group,
the general conv's implicit GEMM would be C GEMMs of depth R*S whose loads are strided 2-byte reads
(one input channel a grid layer), where this kernel's warps read neighbouring channels of a pixel
together. The work is R*S FMAs per output element, so bandwidth decides, and coalescing is all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, LaunchConfig, Tensors, cdiv, positive
from dualtrack.kernels.conv import named_weights
from dualtrack.kernels.streaming import ElementSpec, onnx_weight_bias

MAX_KERNEL = 7  # R and S: ConvNeXt's 7x7 is the largest depthwise kernel of the networks served
UNROLLED = (3, 5)  # the square kernels the source unrolls (dwconv_any); the others loop


@dataclass(frozen=True)
class DwGeometry:
    """The convolution's shape attributes as ONNX writes them: kernel R x S, strides, dilations,
    pads (top, left, bottom, right) and the channel multiplier (K = multiplier * C). ``S``,
    ``stride_w`` and ``dil_w`` default to ``R``, ``stride`` and ``dilation`` (a square window)."""

    R: int = 3
    stride: int = 1
    dilation: int = 1
    pads: tuple[int, int, int, int] = (1, 1, 1, 1)
    S: int | None = None
    stride_w: int | None = None
    dil_w: int | None = None
    multiplier: int = 1

    def __post_init__(self) -> None:
        for name, same in (("S", self.R), ("stride_w", self.stride), ("dil_w", self.dilation)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, same)
        if not (1 <= self.R <= MAX_KERNEL and 1 <= self.width <= MAX_KERNEL):
            raise InputError(f"dwconv takes kernels of 1..{MAX_KERNEL} a side; got {self.R}x{self.width}")
        positive(stride=self.stride, dilation=self.dilation, multiplier=self.multiplier)
        positive(stride_w=self.stride_w, dil_w=self.dil_w)
        if min(self.pads) < 0:
            raise InputError(f"dwconv pads {self.pads} must be >= 0")

    @property
    def width(self) -> int:
        """S, resolved (the kernel's columns)."""
        assert self.S is not None  # __post_init__ resolves it
        return self.S

    @classmethod
    def of(cls, call: KernelCall) -> DwGeometry:
        """A call's attributes; ``S``, ``stride_w``, ``dil_w`` (0: absent) and ``multiplier``
        (default 1) where the lowering wrote them."""
        a = call.attr
        pads = (a("pad_t"), a("pad_l"), a("pad_b"), a("pad_r"))
        wide = {k: a(k) or None for k in ("S", "stride_w", "dil_w")}
        return cls(a("R"), a("stride"), a("dilation"), pads, **wide, multiplier=a("multiplier", 1))

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The geometry as :class:`KernelCall` attributes (what :meth:`of` reads)."""
        t, left, b, r = self.pads
        return (
            ("R", self.R), ("stride", self.stride), ("dilation", self.dilation),
            ("pad_t", t), ("pad_l", left), ("pad_b", b), ("pad_r", r),
            ("S", self.width), ("stride_w", int(self.stride_w or 0)), ("dil_w", int(self.dil_w or 0)),
            ("multiplier", self.multiplier),
        )  # fmt: skip

    def output_hw(self, H: int, W: int) -> tuple[int, int]:
        t, left, b, r = self.pads
        sw, dw = int(self.stride_w or 0), int(self.dil_w or 0)
        Ho = (H + t + b - self.dilation * (self.R - 1) - 1) // self.stride + 1
        Wo = (W + left + r - dw * (self.width - 1) - 1) // sw + 1
        if Ho < 1 or Wo < 1:
            raise InputError(f"dwconv {self} of a {H}x{W} image has no output pixel")
        return Ho, Wo


@dataclass(frozen=True)
class DwConvSpec(ElementSpec):
    """Depthwise R x S convolution (1..7 a side; any strides, dilations, padding and channel
    multiplier), bias and an activation fused. Weights: ONNX (K, 1, R, S) packed RSK
    (:meth:`pack`), bias fp32. ``C`` is the input's channels, the output has ``multiplier * C``."""

    MACRO: ClassVar[str] = "DWCONV"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "w", "bias", "y", "N", "H", "W", "C", "Ho", "Wo", "ldx", "ldy",
        "R", "S", "sh", "sw", "dh", "dw", "pt", "pl", "M", "act", "p0", "p1",
    )  # fmt: skip
    F16_LANES: ClassVar[int] = 8  # the fp16 vector path: one 16-byte access
    POINTERS: ClassVar[int] = 4
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))  # ldy: K, arg_values
    SHAPE_ATTRS: ClassVar[tuple[str, ...]] = ("geometry",)
    # Output pixels of one row a work item of the row path computes (dwconv_nhwc.cu's dwconv_rows, -DDW_ROW).
    row_outputs: int = 4

    def defines(self) -> dict[str, int | str]:
        return {**super().defines(), "DW_ROW": self.row_outputs}

    @staticmethod
    def row_path(g: DwGeometry) -> bool:
        """Whether the kernel's row path takes the launch (dwconv_nhwc.cu's ``dwconv_row_path``): a
        square 3, 5 or 7 kernel, stride and dilation 1 along W, no channel multiplier."""
        return g.multiplier == 1 and g.width == g.R and g.R in (3, 5, 7) and g.stride_w == 1 and g.dil_w == 1

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, geometry: DwGeometry | None = None
    ) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        g = geometry or DwGeometry()
        if K not in (0, g.multiplier * C):
            raise InputError(
                f"a depthwise convolution of channel multiplier {g.multiplier} has K = {g.multiplier}*C: C={C}, K={K}"
            )
        return (N, *g.output_hw(H, W), g.multiplier * C)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """``Ho, Wo`` of the output, ``R, S, sh, sw, dh, dw, pt, pl, M`` of the ``geometry`` (a
        :class:`DwGeometry`) and the epilogue ``act, p0, p1``."""
        g: DwGeometry = kw["geometry"]
        _, Ho, Wo, K = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, g)
        if kw["ldy"] < K:
            raise InputError(f"ldy={kw['ldy']} is smaller than the {K} output channels it must hold; use ldy >= {K}")
        geometry = {
            "R": g.R, "S": g.width, "sh": g.stride, "sw": g.stride_w, "dh": g.dilation, "dw": g.dil_w,
            "pt": g.pads[0], "pl": g.pads[1], "M": g.multiplier,
        }  # fmt: skip
        return {"Ho": Ho, "Wo": Wo, **geometry, **self.epilogue(kw)}

    @staticmethod
    def pack(w: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """ONNX depthwise weights (K, 1, R, S) -> RSK (R, S, K) in the same dtype; bias -> fp32."""
        if w.ndim != 4 or w.shape[1] != 1:
            raise InputError(f"depthwise weights must be (K, 1, R, S) as ONNX stores them; got {w.shape}")
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
        """numpy semantics: ``x`` (N,H,W,C), ``w`` (R,S,K) packed (K = multiplier * C; output
        channel k reads input channel k // multiplier), ``bias`` (K,) or None; float32 products and
        sums, then bias, then the activation, rounded once to x's dtype."""
        g = geometry or DwGeometry()
        K = g.multiplier * x.shape[-1]
        if w is None or x.ndim != 4 or w.shape != (g.R, g.width, K):
            raise InputError(
                f"dwconv takes x (N,H,W,C) and w (R,S,K) = ({g.R},{g.width},{K}); got x {x.shape}, "
                f"w {getattr(w, 'shape', None)}"
            )
        N, H, W, _ = x.shape
        Ho, Wo = g.output_hw(H, W)
        t, left, b, r = g.pads
        xp = np.repeat(np.pad(x.astype(np.float32), ((0, 0), (t, b), (left, r), (0, 0))), g.multiplier, axis=3)
        out = np.zeros((N, Ho, Wo, K), np.float32)
        sh, sw, dh, dw = g.stride, int(g.stride_w or 0), g.dilation, int(g.dil_w or 0)
        for i in range(g.R):
            for j in range(g.width):
                tap = xp[:, i * dh : i * dh + sh * (Ho - 1) + 1 : sh, j * dw : j * dw + sw * (Wo - 1) + 1 : sw, :]
                out += tap * w[i, j].astype(np.float32)
        if bias is not None:
            out += bias.astype(np.float32)
        return (act or Activation()).apply(out).astype(x.dtype)

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"geometry": DwGeometry.of(call), "act": Activation.of(call)}

    def call_launch(self, dtype: Any, kw: Mapping[str, Any]) -> LaunchConfig:
        """:class:`ElementSpec`'s grid, with one channel an item under a channel multiplier (the
        kernel's vector path takes M = 1 only), and items of :attr:`row_outputs` pixels on the row path."""
        g: DwGeometry = kw["geometry"]
        if self.row_path(g):  # a work item is row_outputs pixels of one row
            n, ho, wo, k = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], g)
            return self.output_launch(dtype, (n, ho, cdiv(wo, self.row_outputs), k), kw["ldy"], kw["ldx"])
        if g.multiplier == 1:
            return super().call_launch(dtype, kw)
        out = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], g)
        return self.element_launch(dtype, *out, kw["ldy"])

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
