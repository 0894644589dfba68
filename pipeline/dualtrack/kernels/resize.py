"""resize_nhwc: the resize op (ONNX Resize over H and W, nearest or bilinear), one thread per
output element, or per 8 channels of an output pixel on the fp16 vector path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import RESIZE_COORDS, RESIZE_MODES, RESIZE_NEAREST, KernelCall, bits_f32, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, Tensors, positive
from dualtrack.kernels.streaming import ElementSpec


@dataclass(frozen=True)
class ResizeMode:
    """How one Resize maps output to input pixels: its mode, coordinate transformation, nearest
    rounding, and the float32 scales (output / input, as ONNX divides by them) of H and W."""

    mode: str = "linear"
    coord: str = "half_pixel"
    nearest: str = "floor"
    scale_h: float = 2.0
    scale_w: float = 2.0

    def __post_init__(self) -> None:
        for value, table in ((self.mode, RESIZE_MODES), (self.coord, RESIZE_COORDS), (self.nearest, RESIZE_NEAREST)):
            if value not in table:
                raise InputError(f"resize takes {', '.join(table)}; got '{value}'")
        if not (self.scale_h > 0 and self.scale_w > 0):
            raise InputError(f"resize scales must be > 0; got {self.scale_h}, {self.scale_w}")

    @classmethod
    def of(cls, call: KernelCall) -> ResizeMode:
        names = [{v: k for k, v in t.items()} for t in (RESIZE_MODES, RESIZE_COORDS, RESIZE_NEAREST)]
        a = call.attr
        return cls(
            names[0][a("mode")], names[1][a("coord")], names[2][a("nearest")],
            bits_f32(a("scale_h")), bits_f32(a("scale_w")),
        )  # fmt: skip

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The call attrs that :meth:`of` reads back."""
        return (
            ("mode", RESIZE_MODES[self.mode]), ("coord", RESIZE_COORDS[self.coord]),
            ("nearest", RESIZE_NEAREST[self.nearest]), ("scale_h", f32_bits(self.scale_h)),
            ("scale_w", f32_bits(self.scale_w)),
        )  # fmt: skip

    def source(self, o: np.ndarray, L: int, Lo: int, scale: float) -> np.ndarray:
        """Source coordinates (float32) of output coordinates ``o`` on an axis (resize_nhwc.cu)."""
        of, s = o.astype(np.float32), np.float32(scale)
        half = np.float32(0.5)
        if self.coord == "half_pixel" or (self.coord == "pytorch_half_pixel" and Lo > 1):
            return (of + half) / s - half
        if self.coord == "asymmetric":
            return of / s
        if self.coord == "align_corners" and Lo > 1:
            return of * np.float32(L - 1) / np.float32(Lo - 1)
        return np.zeros_like(of)

    def nearest_index(self, v: np.ndarray, L: int) -> np.ndarray:
        fl = np.floor(v)
        tie = v == fl + np.float32(0.5)
        r = {
            "floor": fl,
            "ceil": np.ceil(v),
            "round_prefer_floor": np.where(tie, fl, np.rint(v)),
            "round_prefer_ceil": np.where(tie, np.ceil(v), np.rint(v)),
        }[self.nearest]
        return np.clip(r.astype(np.int64), 0, L - 1)

    def taps(self, o: np.ndarray, L: int, Lo: int, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Linear taps of an axis: (i0, i1, weight of i1) per output coordinate."""
        v = np.clip(self.source(o, L, Lo, scale), np.float32(0), np.float32(L - 1))
        i0 = v.astype(np.int64)
        return i0, np.minimum(i0 + 1, L - 1), (v - i0.astype(np.float32)).astype(np.float32)


@dataclass(frozen=True)
class ResizeSpec(ElementSpec):
    """(N, H, W, C) -> (N, Ho, Wo, C) by :class:`ResizeMode`; fp32 math, one rounding."""

    MACRO: ClassVar[str] = "RESIZE"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "y", "N", "H", "W", "C", "Ho", "Wo", "ldx", "ldy", "mode", "coord", "nearest", "sh", "sw",
    )  # fmt: skip
    FLOATS: ClassVar[frozenset[str]] = frozenset({"sh", "sw"})
    POINTERS: ClassVar[int] = 2
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))
    SHAPE_ATTRS: ClassVar[tuple[str, ...]] = ("Ho", "Wo")
    F16_LANES: ClassVar[int] = 8  # the fp16 vector path: one 16-byte access

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, Ho: int = 0, Wo: int = 0
    ) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C, Ho=Ho, Wo=Wo)
        return (N, Ho, Wo, C)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The output size checked, and the ``how`` (a :class:`ResizeMode`) as
        ``mode, coord, nearest, sh, sw``."""
        self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, kw["Ho"], kw["Wo"])
        how: ResizeMode = kw["how"]
        modes = {
            "mode": RESIZE_MODES[how.mode],
            "coord": RESIZE_COORDS[how.coord],
            "nearest": RESIZE_NEAREST[how.nearest],
        }
        return {**modes, "sh": how.scale_h, "sw": how.scale_w}

    def reference(self, x: np.ndarray, Ho: int = 0, Wo: int = 0, how: ResizeMode | None = None) -> np.ndarray:
        """numpy semantics of resize_nhwc.cu: ``x`` (N,H,W,C) -> (N,Ho,Wo,C) in float32, rounded once."""
        how = how or ResizeMode()
        if x.ndim != 4:
            raise InputError(f"resize takes x (N,H,W,C); got {x.shape}")
        _, H, W, _ = x.shape
        self.output_shape(*x.shape, 0, Ho, Wo)
        oh, ow = np.arange(Ho), np.arange(Wo)
        if how.mode == "nearest":
            hi = how.nearest_index(how.source(oh, H, Ho, how.scale_h), H)
            wi = how.nearest_index(how.source(ow, W, Wo, how.scale_w), W)
            return x[:, hi][:, :, wi]
        h0, h1, th = how.taps(oh, H, Ho, how.scale_h)
        w0, w1, tw = how.taps(ow, W, Wo, how.scale_w)
        xf = x.astype(np.float32)
        tw_, th_ = tw[None, None, :, None], th[None, :, None, None]
        top = xf[:, h0][:, :, w0] + tw_ * (xf[:, h0][:, :, w1] - xf[:, h0][:, :, w0])
        bottom = xf[:, h1][:, :, w0] + tw_ * (xf[:, h1][:, :, w1] - xf[:, h1][:, :, w0])
        return (top + th_ * (bottom - top)).astype(x.dtype)

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        return self.reference(inputs[0], call.attr("Ho"), call.attr("Wo"), ResizeMode.of(call))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The NHWC keyword arguments, the output's size and the call's :class:`ResizeMode`."""
        return {
            **super().call_args(call, inputs, y, weights),
            "Ho": y.shape[1],
            "Wo": y.shape[2],
            "how": ResizeMode.of(call),
        }
