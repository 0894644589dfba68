"""pad_nhwc: the pad op (ONNX Pad over H and W: constant, reflect, edge), which is also Track A's
channel copy (zero pads from a first input channel ``c0``), one thread per output element, or per
8 channels of an output pixel on the fp16 vector path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import PAD_MODES, KernelCall, bits_f32, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, Tensors, positive
from dualtrack.kernels.streaming import ElementSpec

_NUMPY_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge"}


@dataclass(frozen=True)
class PadMode:
    """One pad call: its mode, its non-negative pads (top, left, bottom, right), a constant pad's
    value, and the channels it takes from its input: ``channels`` of them from ``c0`` (0: all)."""

    mode: str = "constant"
    pt: int = 0
    pl: int = 0
    pb: int = 0
    pr: int = 0
    value: float = 0.0
    c0: int = 0
    channels: int = 0

    def __post_init__(self) -> None:
        if self.mode not in PAD_MODES:
            raise InputError(f"pad mode '{self.mode}' is not one of {', '.join(PAD_MODES)}")
        if min(self.pt, self.pl, self.pb, self.pr, self.c0, self.channels) < 0:
            raise InputError(f"pad takes non-negative pads and channels; got {self}")

    @classmethod
    def copy(cls, c0: int = 0, channels: int = 0) -> PadMode:
        """A copy of ``channels`` channels from ``c0`` (0: all): no padding."""
        return cls(c0=c0, channels=channels)

    @classmethod
    def of(cls, call: KernelCall) -> PadMode:
        a = call.attr
        mode = {v: k for k, v in PAD_MODES.items()}[a("mode")]
        return cls(mode, a("pt"), a("pl"), a("pb"), a("pr"), bits_f32(a("value")), a("c0"), a("channels"))

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The call attrs that :meth:`of` reads back."""
        return (
            ("mode", PAD_MODES[self.mode]), ("pt", self.pt), ("pl", self.pl), ("pb", self.pb), ("pr", self.pr),
            ("value", f32_bits(self.value)), ("c0", self.c0), ("channels", self.channels),
        )  # fmt: skip

    def out_channels(self, C: int) -> int:
        """The channels written, of an input of ``C`` (InputError where the slice does not fit)."""
        k = self.channels or C - self.c0
        if k < 1 or self.c0 + k > C:
            raise InputError(f"pad copies channels [{self.c0}, {self.c0 + k}) of an input of {C}; keep them inside it")
        return k

    def check(self, H: int, W: int) -> str | None:
        """Why this pad cannot apply to an H x W image (ONNX's reflect needs every pad < the size), or None."""
        if self.mode == "reflect" and (max(self.pt, self.pb) >= H or max(self.pl, self.pr) >= W):
            return f"reflect pads {[self.pt, self.pl, self.pb, self.pr]} of a {H}x{W} image (each must be < the size)"
        return None


@dataclass(frozen=True)
class PadSpec(ElementSpec):
    """(N, H, W, C) -> (N, H + pt + pb, W + pl + pr, K) by :class:`PadMode`: the input's channels
    [c0, c0 + K), copied bit for bit, the border by the mode."""

    MACRO: ClassVar[str] = "PAD"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "y", "N", "H", "W", "C", "Ho", "Wo", "ldx", "ldy", "pt", "pl", "mode", "value",
    )  # fmt: skip
    FLOATS: ClassVar[frozenset[str]] = frozenset({"value"})
    POINTERS: ClassVar[int] = 2
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))
    SHAPE_ATTRS: ClassVar[tuple[str, ...]] = ("Ho", "Wo")
    F16_LANES: ClassVar[int] = 8  # the fp16 vector path: one 16-byte access

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, Ho: int = 0, Wo: int = 0
    ) -> tuple[int, int, int, int]:
        """``C`` here is the channels written (the kernel's ``C``: x already points at channel c0)."""
        positive(N=N, H=H, W=W, C=C, Ho=Ho, Wo=Wo)
        return (N, Ho, Wo, C)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The output size checked against the pads of ``how`` (a :class:`PadMode`), which pass as
        ``pt, pl, mode, value``."""
        how: PadMode = kw["how"]
        N, H, W, C, Ho, Wo = (kw[k] for k in ("N", "H", "W", "C", "Ho", "Wo"))
        self.output_shape(N, H, W, C, 0, Ho, Wo)
        if (Ho, Wo) != (H + how.pt + how.pb, W + how.pl + how.pr):
            raise InputError(f"pad {how} of {H}x{W} gives {H + how.pt + how.pb}x{W + how.pl + how.pr}, not {Ho}x{Wo}")
        why = how.check(H, W)
        if why:
            raise InputError(f"pad: {why}")
        return {"pt": how.pt, "pl": how.pl, "mode": PAD_MODES[how.mode], "value": how.value}

    def reference(self, x: np.ndarray, how: PadMode | None = None) -> np.ndarray:
        """numpy semantics of pad_nhwc.cu: channels [c0, c0 + K) of ``x`` (N,H,W,C), padded over H, W."""
        how = how or PadMode()
        if x.ndim != 4:
            raise InputError(f"pad takes x (N,H,W,C); got {x.shape}")
        why = how.check(x.shape[1], x.shape[2])
        if why:
            raise InputError(f"pad: {why}")
        k = how.out_channels(x.shape[3])
        part = x[..., how.c0 : how.c0 + k]
        width = ((0, 0), (how.pt, how.pb), (how.pl, how.pr), (0, 0))
        if how.mode == "constant":
            return np.pad(part, width, mode="constant", constant_values=np.array(how.value, x.dtype))
        return np.pad(part, width, mode=_NUMPY_MODES[how.mode])

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        return self.reference(inputs[0], PadMode.of(call))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """x moved to its first channel copied (``c0``), the output's channel count and size, and
        the call's :class:`PadMode`."""
        x = inputs[0]
        n, h, w, c = x.shape
        how = PadMode.of(call)
        k = how.out_channels(c)
        if y.shape[3] != k:
            raise InputError(f"pad ({call.nodes}) writes {k} channels into an output of {y.shape[3]}")
        return {
            "x": x.ptr + how.c0 * np.dtype(x.dtype).itemsize, "y": y.ptr,
            "N": n, "H": h, "W": w, "C": k, "K": k, "Ho": y.shape[1], "Wo": y.shape[2],
            "ldx": x.channel_stride, "ldy": y.channel_stride, "how": how,
        }  # fmt: skip
