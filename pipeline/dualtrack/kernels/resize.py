"""resize_nhwc: the resize op (ONNX Resize over H and W, nearest or bilinear). A block owns a strip
of output columns over a set of output rows, with the columns' taps computed once per block in
shared memory; a work item is an output pixel times the widest channel vector the shapes and
pointers allow (up to 16 bytes). The grid is :meth:`ResizeSpec.strips` strips by the output rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import RESIZE_COORDS, RESIZE_MODES, RESIZE_NEAREST, KernelCall, bits_f32, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    GRID_Y_MAX,
    DeviceTensor,
    LaunchConfig,
    Tensors,
    cdiv,
    dtype_name,
    pixels,
    positive,
)
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

    def identity(self, H: int, W: int, Ho: int, Wo: int) -> bool:
        """Whether every output pixel's source coordinate is its own (same size, and a scale of 1
        or align_corners, whose coordinate does not read it): a copy, as onnxruntime's Resize
        makes it, bit for bit, where the blend would spread a non-finite neighbour through its
        weight of 0 (resize_nhwc.cu decides the same)."""
        exact = self.coord == "align_corners" or (self.scale_h == 1.0 and self.scale_w == 1.0)
        return Ho == H and Wo == W and exact

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
    VECTOR_BYTES: ClassVar[int] = 16  # the widest access of a work item
    # Columns whose taps a block keeps in shared memory (32 bytes each: three 64-bit offsets and a
    # weight) for one pass over its rows; a wider strip takes several passes, so the grid keeps
    # strips within it.
    columns: int = 256
    # Work items a block aims at: a few a thread, so that a block's setup (the column taps, two
    # barriers, the row's taps) is paid for, while small outputs still split into enough blocks.
    items_a_block: int = 1024
    # Blocks a launch aims at before it splits rows into narrower strips (about two waves of an
    # H100's 132 SMs at the 4 blocks an SM the kernel is built for); never fewer work items a block
    # than threads.
    min_blocks: int = 1024

    def defines(self) -> dict[str, int | str]:
        return {**super().defines(), "RESIZE_COLUMNS": self.columns}

    def lanes(self, dtype: Any, *channels: int) -> int:
        """The channels of a work item the device will most likely take (the widest vector of at
        most :attr:`VECTOR_BYTES` dividing every channel count and stride given; the device also
        needs the pointers aligned to it, which only it knows)."""
        v = self.VECTOR_BYTES // np.dtype(dtype_name(dtype)).itemsize
        while v > 1 and any(c % v for c in channels):
            v //= 2
        return v

    def strips(self, dtype: Any, out: tuple[int, int, int, int], *strides: int) -> int:
        """Column strips of the output ``out`` (N, Ho, Wo, C), each a block per output row: enough
        that a strip fits :attr:`columns` and holds about :attr:`items_a_block` work items, more
        when there are too few rows to fill the GPU; never an empty strip."""
        n, ho, wo, c = out
        items = wo * (c // self.lanes(dtype, c, *strides))  # work items of an output row
        want = max(cdiv(wo, self.columns), cdiv(items, self.items_a_block))
        if n * ho * want < self.min_blocks:
            want = max(want, min(cdiv(self.min_blocks, n * ho), cdiv(items, self.block_threads)))
        return cdiv(wo, cdiv(wo, min(want, wo)))

    def output_launch(self, dtype: Any, out: tuple[int, int, int, int], ldy: int | None, *strides: int) -> LaunchConfig:
        """:meth:`strips` along x, the output rows along y (a block loops over the rows past
        grid.y's limit)."""
        n, ho, wo, c = out
        pixels(n, ho, wo, ldy or c)
        grid = (self.strips(dtype, out, ldy or c, *strides), min(n * ho, GRID_Y_MAX), 1)
        return LaunchConfig(grid=grid, block=(self.block_threads, 1, 1), shared_bytes=0)

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
        if how.identity(H, W, Ho, Wo):
            return x.copy()
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
