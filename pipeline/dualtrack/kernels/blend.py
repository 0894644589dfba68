"""blend_nhwc: sliding-window inference's three kernels (runtime/tiling.py), and their numpy references.

Not a plan op: the engine's window path launches them around its runs. ``cut`` copies a batch of
windows out of the (H, W, 3) uint8 image on the GPU into the engine's (batch, h, w, 3) input, zero
outside the image; ``accumulate`` adds each window's weighted (C, h, w) float32 probabilities and
its weights into a ring of ``band`` rows of ``C + 1`` planes (plane C: the sum of weights); ``finish``
divides the finished rows, chooses the class (argmax, the first of equal ones; one class: p > 0.5)
into the mask and zeroes their ring rows for reuse. Float32 throughout, each product and sum
rounded once in the numpy order (no fused multiply-add), so the kernels and :func:`accumulate` /
:func:`finish` give the same bits.

Origins travel by value in ``struct BlendOrigins`` (the 4 KiB of kernel parameters): at most
:attr:`BlendSpec.max_windows` windows a launch, which caps the engine batch the window path takes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.errors import InputError
from dualtrack.kernels.base import INT32_MAX, KernelArg, KernelSpec, LaunchConfig, cdiv, pointer, positive

Origin = tuple[int, int]


@dataclass(frozen=True)
class Clip:
    """A window's part inside the image: image rows ``[r0, r1)`` and columns ``[c0, c1)``, which are
    the window's rows ``[r0 - oy, r1 - oy)`` and columns ``[c0 - ox, c1 - ox)``."""

    oy: int
    ox: int
    r0: int
    r1: int
    c0: int
    c1: int

    @classmethod
    def of(cls, origin: Origin, window: Origin, image: Origin) -> Clip:
        (oy, ox), (h, w), (H, W) = origin, window, image
        return cls(oy, ox, max(oy, 0), min(oy + h, H), max(ox, 0), min(ox + w, W))


def accumulate(
    acc: np.ndarray, probs: np.ndarray, weights: np.ndarray, origins: Sequence[Origin], image: Origin, done: int
) -> None:
    """The ``accumulate`` kernel: ``acc`` (C + 1, band, W) float32 += each window's ``probs`` (n, C, h, w)
    times ``weights`` (h, w), and the weights into plane C, image row ``y`` in ring row ``y % band``.
    Rows below ``done`` are finished; a window must end within ``done + band``."""
    C, band = acc.shape[0] - 1, acc.shape[1]
    window = weights.shape
    for p, origin in zip(probs, origins, strict=False):
        k = Clip.of(origin, window, image)
        if k.r0 < done or k.r1 > done + band:
            raise InputError(f"window rows [{k.r0}, {k.r1}) outside the band [{done}, {done + band})")
        ring = np.arange(k.r0, k.r1) % band
        wy, wx = slice(k.r0 - k.oy, k.r1 - k.oy), slice(k.c0 - k.ox, k.c1 - k.ox)
        w = weights[wy, wx]
        acc[:C, ring, k.c0 : k.c1] += p[:, wy, wx] * w
        acc[C, ring, k.c0 : k.c1] += w


def finish(acc: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``finish`` kernel: image rows ``[lo, hi)`` of ``acc`` (C + 1, band, W) as their mask
    (hi - lo, W) uint8 and probabilities (C, hi - lo, W) float32; their ring rows zeroed."""
    C, band = acc.shape[0] - 1, acc.shape[1]
    ring = np.arange(lo, hi) % band
    rows = acc[:, ring]
    p = rows[:C] / rows[C]
    mask = (p[0] > 0.5) if C == 1 else np.argmax(p, axis=0)
    acc[:, ring] = 0.0
    return mask.astype(np.uint8), p


@functools.cache
def _origins_type(max_windows: int) -> type[ctypes.Structure]:
    class BlendOrigins(ctypes.Structure):  # struct BlendOrigins of blend_nhwc.cu, field for field
        _fields_ = [("y", ctypes.c_int32 * max_windows), ("x", ctypes.c_int32 * max_windows), ("count", ctypes.c_int32)]

    return BlendOrigins


@dataclass(frozen=True)
class BlendSpec(KernelSpec):
    """The cut, accumulate and finish entries of ``blend_nhwc.cu`` (one thread a pixel, grid-stride)."""

    block_threads: int = 256
    max_windows: int = 64  # origins a launch: 2 x 64 int32 + count, 516 bytes of parameters
    POINTERS: ClassVar[int] = 0

    @property
    def cut_entry(self) -> str:
        return f"{self.stem}_cut_u8"

    @property
    def accumulate_entry(self) -> str:
        return f"{self.stem}_accumulate_f32"

    @property
    def finish_entry(self) -> str:
        return f"{self.stem}_finish_f32"

    @property
    def entries(self) -> tuple[str, ...]:
        return (self.cut_entry, self.accumulate_entry, self.finish_entry)

    def defines(self) -> dict[str, int | str]:
        return {"BLEND_THREADS": self.block_threads, "BLEND_MAX_WINDOWS": self.max_windows}

    def threads(self, dtype: Any = None) -> int:
        return self.block_threads

    def _grid(self, items: int) -> LaunchConfig:
        blocks = min(cdiv(max(items, 1), self.block_threads), 65535 * 8)  # grid-stride: any grid is correct
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1))

    def origins(self, origins: Sequence[Origin]) -> ctypes.Structure:
        """``struct BlendOrigins`` of 1 to :attr:`max_windows` origins."""
        if not 1 <= len(origins) <= self.max_windows:
            raise InputError(
                f"a blend launch takes 1 to {self.max_windows} windows, got {len(origins)}; "
                f"set window.batch to at most {self.max_windows}"
            )
        table = _origins_type(self.max_windows)()
        for i, (y, x) in enumerate(origins):
            table.y[i], table.x[i] = y, x
        table.count = len(origins)
        return table

    def cut_call(
        self, image: int, windows: int, H: int, W: int, h: int, w: int, batch: int, origins: Sequence[Origin]
    ) -> tuple[LaunchConfig, list[KernelArg]]:
        """The windows at ``origins`` of the (H, W, 3) uint8 image at ``image`` into the (batch, h, w, 3)
        buffer at ``windows``; pixels outside the image and rows past ``len(origins)`` are zero."""
        positive(H=H, W=W, h=h, w=w, batch=batch)
        if len(origins) > batch or batch * h * w > INT32_MAX:
            raise InputError(f"{len(origins)} windows of {h}x{w} do not fit a batch of {batch}")
        i32 = ctypes.c_int32
        args: list[KernelArg] = [
            (pointer("image", image), ctypes.c_void_p),
            (pointer("windows", windows), ctypes.c_void_p),
        ]
        args += [(v, i32) for v in (H, W, h, w, batch)] + [(self.origins(origins), None)]
        return self._grid(batch * h * w), args

    def accumulate_call(
        self, probs: int, weights: int, acc: int, C: int, h: int, w: int, H: int, W: int, band: int, done: int,
        origins: Sequence[Origin],
    ) -> tuple[LaunchConfig, list[KernelArg]]:  # fmt: skip
        """Blend the (n, C, h, w) float32 ``probs`` of the windows at ``origins`` with ``weights`` (h, w)
        into ``acc`` ((C + 1, band, W) float32, image row y at ring row y % band; rows below ``done``
        finished). The launch covers the batch's box in the image."""
        positive(C=C, h=h, w=w, H=H, W=W, band=band)
        clips = [Clip.of(o, (h, w), (H, W)) for o in origins]
        r0, r1 = min(k.r0 for k in clips), max(k.r1 for k in clips)
        c0, c1 = min(k.c0 for k in clips), max(k.c1 for k in clips)
        if r0 < done or r1 > done + band:
            raise InputError(f"window rows [{r0}, {r1}) outside the band [{done}, {done + band})")
        i32 = ctypes.c_int32
        args: list[KernelArg] = [
            (pointer("probs", probs), ctypes.c_void_p),
            (pointer("weights", weights), ctypes.c_void_p),
            (pointer("acc", acc), ctypes.c_void_p),
        ]
        args += [(v, i32) for v in (C, h, w, H, W, band, r0, r1, c0, c1)] + [(self.origins(origins), None)]
        return self._grid((r1 - r0) * (c1 - c0)), args

    def finish_call(
        self, acc: int, mask: int, probs: int, C: int, H: int, W: int, band: int, lo: int, hi: int
    ) -> tuple[LaunchConfig, list[KernelArg]]:
        """Rows ``[lo, hi)`` of ``acc`` into the (H, W) uint8 ``mask`` and, where ``probs`` is not 0,
        the (C, H, W) float32 probabilities; their ring rows zeroed."""
        positive(C=C, H=H, W=W, band=band)
        if not 0 <= lo < hi <= H or hi - lo > band:
            raise InputError(f"rows [{lo}, {hi}) are not finished rows of a {H}-row image in a {band}-row band")
        i32 = ctypes.c_int32
        args: list[KernelArg] = [
            (pointer("acc", acc), ctypes.c_void_p),
            (pointer("mask", mask), ctypes.c_void_p),
            (pointer("probs", probs, required=False), ctypes.c_void_p),
        ]
        args += [(v, i32) for v in (C, H, W, band, lo, hi)]
        return self._grid((hi - lo) * W), args

    def reference(self, x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        """:func:`finish` of :func:`accumulate` over ``x`` (n, C, h, w) at ``origins`` (keyword) with
        ``weights`` in an (H, W) ``image`` taken whole: the blended mask (H, W)."""
        weights, origins, image = kwargs["weights"], kwargs["origins"], kwargs["image"]
        acc = np.zeros((x.shape[1] + 1, image[0], image[1]), np.float32)
        accumulate(acc, x, weights, origins, image, 0)
        return finish(acc, 0, image[0])[0]
