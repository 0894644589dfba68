"""depth_to_space_nhwc: ONNX DepthToSpace (DCR, a sub-pixel convolution's layout, and CRD, torch's
PixelShuffle) of NHWC tensors, one thread per output element, or per 8 channels of an output pixel
on the fp16 vector path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, LaunchConfig, Tensors, pixels, positive
from dualtrack.kernels.streaming import ElementSpec

# The call's ``mode`` attr (handwritten_ptx/depth_to_space_nhwc.cu): ONNX's mode names.
D2S_MODES: dict[str, int] = {"DCR": 0, "CRD": 1}


@dataclass(frozen=True)
class DepthToSpace:
    """One DepthToSpace: its block size (>= 1; 1 is a copy) and mode (DCR or CRD)."""

    blocksize: int = 2
    mode: str = "DCR"

    def __post_init__(self) -> None:
        if self.mode not in D2S_MODES:
            raise InputError(f"DepthToSpace mode '{self.mode}' is not one of {', '.join(D2S_MODES)}")
        positive(blocksize=self.blocksize)

    @classmethod
    def of(cls, call: KernelCall) -> DepthToSpace:
        return cls(call.attr("bs"), {v: k for k, v in D2S_MODES.items()}[call.attr("mode")])

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The call attrs that :meth:`of` reads back."""
        return (("bs", self.blocksize), ("mode", D2S_MODES[self.mode]))

    def out_channels(self, C: int) -> int:
        """The output channels of an input of ``C`` (InputError where bs*bs does not divide it)."""
        blocks = self.blocksize * self.blocksize
        if C % blocks:
            raise InputError(
                f"DepthToSpace of blocksize {self.blocksize} takes channels a multiple of {blocks}; got {C}"
            )
        return C // blocks


@dataclass(frozen=True)
class DepthToSpaceSpec(ElementSpec):
    """(N, H, W, K*bs*bs) -> (N, H*bs, W*bs, K) by :class:`DepthToSpace`, values copied bit for bit."""

    MACRO: ClassVar[str] = "D2S"
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "y", "N", "H", "W", "K", "ldx", "ldy", "bs", "mode")
    FLOATS: ClassVar[frozenset[str]] = frozenset()
    POINTERS: ClassVar[int] = 2
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "K"))
    SHAPE_ATTRS: ClassVar[tuple[str, ...]] = ("bs",)
    F16_LANES: ClassVar[int] = 8  # the fp16 vector path: one 16-byte store

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0, bs: int = 1) -> tuple[int, int, int, int]:
        """``C`` is the input's channels, ``bs`` the block size (``K``, the output's, follows from them)."""
        positive(N=N, H=H, W=W, C=C)
        return (N, H * bs, W * bs, DepthToSpace(bs).out_channels(C))

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The output channels ``K`` checked against the input's and the block size of ``how`` (a
        :class:`DepthToSpace`), which passes as ``bs, mode``; 32-bit pixel indices checked."""
        how: DepthToSpace = kw["how"]
        n, ho, wo, k = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, how.blocksize)
        if kw["K"] != k:
            raise InputError(
                f"DepthToSpace of {kw['C']} channels, blocksize {how.blocksize}, writes {k}, not {kw['K']}"
            )
        pixels(n, ho, wo, max(kw["ldx"], kw["ldy"]))
        return {"bs": how.blocksize, "mode": D2S_MODES[how.mode]}

    def call_launch(self, dtype: Any, kw: Mapping[str, Any]) -> LaunchConfig:
        """One thread per vector where the fp16 vector path can run: in CRD (8 gathered loads) x's
        stride does not matter, in DCR (one 16-byte load) it does."""
        how: DepthToSpace = kw["how"]
        out = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], how.blocksize)
        gathers = how.mode == "CRD" and how.blocksize > 1
        return self.output_launch(dtype, out, kw["ldy"], *(() if gathers else (kw["ldx"],)))

    def reference(self, x: np.ndarray, how: DepthToSpace | None = None) -> np.ndarray:
        """numpy semantics of depth_to_space_nhwc.cu on a dense ``x`` (N, H, W, C)."""
        how = how or DepthToSpace()
        if x.ndim != 4:
            raise InputError(f"DepthToSpace takes x (N,H,W,C); got {x.shape}")
        n, h, w, c = x.shape
        s, k = how.blocksize, how.out_channels(c)
        # x's channel axis split as ONNX's NCHW one is: (a, b, k) for DCR, (k, a, b) for CRD.
        if how.mode == "DCR":
            blocks = x.reshape(n, h, w, s, s, k)
        else:
            blocks = x.reshape(n, h, w, k, s, s).transpose(0, 1, 2, 4, 5, 3)
        return np.ascontiguousarray(blocks.transpose(0, 1, 3, 2, 4, 5).reshape(n, h * s, w * s, k))

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        return self.reference(inputs[0], DepthToSpace.of(call))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The input's shape, the output's channels and both strides, and the call's :class:`DepthToSpace`."""
        x = inputs[0]
        n, h, w, c = x.shape
        return {
            "x": x.ptr, "y": y.ptr, "N": n, "H": h, "W": w, "C": c, "K": y.shape[3],
            "ldx": x.channel_stride, "ldy": y.channel_stride, "how": DepthToSpace.of(call),
        }  # fmt: skip
