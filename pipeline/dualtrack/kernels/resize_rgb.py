"""resize_rgb_u8: a decoded RGB picture, EXIF orientation applied, resized into one model input row.

Not a plan op: the service's GPU JPEG path (:mod:`dualtrack.runtime.gpu_jpeg`) launches it between
nvImageCodec's decode and the engine's run, so a JPEG never leaves the GPU. Its contract is
:mod:`dualtrack.imaging`'s CPU path, bit for bit: ``ImageOps.exif_transpose`` then Pillow's
``Image.resize(..., Resampling.BILINEAR)`` (an antialiasing triangle filter, two passes with 8-bit
rounding between them, 22-bit fixed-point weights). :meth:`ResizeRgbSpec.reference` restates
Pillow's ``libImaging/Resample.c`` in numpy, so the reference is checked against Pillow itself on
the CPU and the kernel against the reference on a GPU, both with tolerance 0.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.errors import InputError
from dualtrack.kernels.base import KernelArg, KernelSpec, LaunchConfig, cdiv, pointer, positive

PRECISION_BITS = 22  # Pillow's fixed point for 8-bit images
QUARTER_TURNS = (5, 6, 7, 8)  # EXIF orientations whose displayed width is the stored height


@dataclass(frozen=True)
class ResizeJob:
    """One picture of a launch: its stored pixels (device address, size, row pitch in bytes, EXIF
    orientation) and the device address of the ``out_h x out_w x 3`` row it is resized into."""

    src: int
    dst: int
    src_w: int
    src_h: int
    src_pitch: int
    orientation: int = 1


class _JobC(ctypes.Structure):
    """``struct ResizeJob`` of resize_rgb_u8.cu, field for field (32 bytes)."""

    _fields_ = [
        ("src", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("src_w", ctypes.c_int32),
        ("src_h", ctypes.c_int32),
        ("src_pitch", ctypes.c_int32),
        ("orientation", ctypes.c_int32),
    ]


@functools.cache
def _jobs_type(max_rows: int) -> type[ctypes.Structure]:
    class Jobs(ctypes.Structure):
        _fields_ = [("job", _JobC * max_rows), ("out_w", ctypes.c_int32), ("out_h", ctypes.c_int32)]

    return Jobs


@dataclass(frozen=True)
class ResizeRgbSpec(KernelSpec):
    """Orientation + Pillow-exact bilinear resize of 8-bit RGB into a dense ``(H, W, 3)`` row."""

    tile: int = 16  # output pixels per block side
    max_taps: int = 17  # taps per axis: a downscale of up to 8x ((max_taps - 1) / 2)
    max_rows: int = 64  # jobs per launch: their table (32 bytes each) travels in the 4 KiB of parameters
    PARAMS: ClassVar[tuple[str, ...]] = ("jobs",)  # one struct ResizeJobs, by value
    POINTERS: ClassVar[int] = 0

    @property
    def entries(self) -> tuple[str, ...]:
        return (self.stem,)

    def defines(self) -> dict[str, int | str]:
        return {"RESIZE_TILE": self.tile, "RESIZE_MAX_TAPS": self.max_taps, "RESIZE_MAX_ROWS": self.max_rows}

    def jobs_type(self) -> type[ctypes.Structure]:
        """``struct ResizeJobs`` of resize_rgb_u8.cu for :attr:`max_rows` jobs."""
        return _jobs_type(self.max_rows)

    def threads(self, dtype: Any = None) -> int:
        return self.tile * self.tile

    @property
    def max_downscale(self) -> int:
        return (self.max_taps - 1) // 2

    def supported(self, src_w: int, src_h: int, out_w: int, out_h: int, orientation: int = 1) -> str | None:
        """Why the kernel cannot take this picture (None when it can): more taps than it holds."""
        shown_w, shown_h = (src_h, src_w) if orientation in QUARTER_TURNS else (src_w, src_h)
        for axis, size, out in (("width", shown_w, out_w), ("height", shown_h, out_h)):
            if _taps(size, out) > self.max_taps:
                return (
                    f"its {axis} {size} -> {out} is a downscale over {self.max_downscale}x "
                    f"({_taps(size, out)} taps, the kernel holds {self.max_taps})"
                )
        return None

    def launch(self, out_w: int, out_h: int, rows: int = 1) -> LaunchConfig:  # type: ignore[override]
        """``rows`` jobs (at most :attr:`max_rows`: :meth:`chunks` splits more) of ``out_w x out_h``."""
        positive(out_w=out_w, out_h=out_h, rows=rows)
        if rows > self.max_rows:
            raise InputError(f"{rows} jobs in one resize_rgb_u8 launch; it takes at most {self.max_rows}")
        grid = (cdiv(out_w, self.tile), cdiv(out_h, self.tile), rows)
        return LaunchConfig(grid=grid, block=(self.tile, self.tile, 1))

    def chunks(self, jobs: Sequence[ResizeJob]) -> list[Sequence[ResizeJob]]:
        """``jobs`` in launches of at most :attr:`max_rows`."""
        return [jobs[i : i + self.max_rows] for i in range(0, len(jobs), self.max_rows)]

    def args(self, *, jobs: Sequence[ResizeJob], out_w: int, out_h: int) -> list[KernelArg]:  # type: ignore[override]
        """One launch's argument: its jobs (1 to :attr:`max_rows`, each checked) as ``struct
        ResizeJobs`` by value, for :meth:`launch` ``(out_w, out_h, len(jobs))``."""
        positive(out_w=out_w, out_h=out_h)
        if not 1 <= len(jobs) <= self.max_rows:
            raise InputError(f"a resize_rgb_u8 launch takes 1 to {self.max_rows} jobs, got {len(jobs)}")
        table = self.jobs_type()()
        table.out_w, table.out_h = out_w, out_h
        for i, job in enumerate(jobs):
            self._check(job, out_w, out_h)
            table.job[i] = _JobC(
                pointer("src", job.src), pointer("dst", job.dst), job.src_w, job.src_h, job.src_pitch, job.orientation
            )
        return [(table, None)]

    def _check(self, job: ResizeJob, out_w: int, out_h: int) -> None:
        positive(src_w=job.src_w, src_h=job.src_h)
        if job.src_pitch < 3 * job.src_w:
            raise InputError(
                f"src_pitch={job.src_pitch} is smaller than a row of {job.src_w} RGB pixels ({3 * job.src_w} bytes)"
            )
        if not 1 <= job.orientation <= 8:
            raise InputError(f"orientation={job.orientation} is not an EXIF orientation (1-8)")
        why = self.supported(job.src_w, job.src_h, out_w, out_h, job.orientation)
        if why is not None:
            raise InputError(f"resize_rgb_u8 cannot resize a {job.src_w}x{job.src_h} picture: {why}")

    def reference(self, x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        """``x`` (h, w, 3) uint8 as stored -> ``(out_h, out_w, 3)`` uint8: ``reference(x, out_h, out_w,
        orientation=1)``, what the kernel computes and what ``exif_transpose`` + Pillow's BILINEAR give."""
        out_h, out_w = args[:2] if len(args) >= 2 else (kwargs["out_h"], kwargs["out_w"])
        orientation = kwargs.get("orientation", args[2] if len(args) > 2 else 1)
        if x.ndim != 3 or x.shape[2] != 3 or x.dtype != np.uint8:
            raise InputError(f"resize_rgb_u8 takes (h, w, 3) uint8; got {x.dtype}{list(x.shape)}")
        shown = oriented(x, orientation)
        return _pass(_pass(shown, out_w, axis=1), out_h, axis=0)


def oriented(x: np.ndarray, orientation: int) -> np.ndarray:
    """``x`` as displayed under EXIF ``orientation`` (the kernel's index map, as numpy views)."""
    if orientation in QUARTER_TURNS:
        x = x.transpose(1, 0, 2)  # displayed (u, v) reads stored (v, u) before the flips below
    flip_u = orientation in (2, 3, 6, 7)  # displayed columns run backwards through the stored axis
    flip_v = orientation in (3, 4, 7, 8)
    return x[:: -1 if flip_v else 1, :: -1 if flip_u else 1]


def _taps(in_size: int, out_size: int) -> int:
    return 2 * math.ceil(max(in_size / out_size, 1.0)) + 1


def axis_coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` for one axis (bilinear, box 0 ..
    in_size): per output index the first source index, the number of taps, and int32 weights
    ``(out_size, ksize)``. Every float64 operation in Pillow's order (numpy rounds each one), and
    the weight sum sequential (``cumsum``: ``np.sum`` sums pairwise and may round differently)."""
    scale = np.float64(in_size) / np.float64(out_size)
    filterscale = max(scale, np.float64(1.0))
    support = filterscale
    ksize = math.ceil(support) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    ss = np.float64(1.0) / filterscale
    first = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first
    taps = np.arange(ksize)
    t = ((taps[None, :] + first[:, None]).astype(np.float64) - center[:, None] + 0.5) * ss
    t = np.abs(t)
    w = np.where(t < 1.0, 1.0 - t, 0.0)
    w[taps[None, :] >= count[:, None]] = 0.0
    ww = np.cumsum(w, axis=1)[:, -1:]
    w = np.divide(w, ww, out=w.copy(), where=ww != 0.0)
    scaled = w * np.float64(1 << PRECISION_BITS)
    fixed = np.trunc(np.where(w < 0.0, -0.5 + scaled, 0.5 + scaled)).astype(np.int32)
    return first, count, fixed


def _pass(x: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One of Pillow's two 8-bit passes along ``axis`` (1: horizontal, 0: vertical)."""
    in_size = x.shape[axis]
    first, _count, k = axis_coefficients(in_size, out_size)
    index = np.minimum(first[:, None] + np.arange(k.shape[1])[None, :], in_size - 1)  # weight 0 past count
    taken = np.take(x, index, axis=axis).astype(np.int64)  # axis replaced by (out_size, ksize)
    weights = k.astype(np.int64)
    # horizontal: (h, out, ksize, 3); vertical: (out, ksize, w, 3)
    acc = np.einsum("hokc,ok->hoc" if axis == 1 else "okwc,ok->owc", taken, weights)
    acc += 1 << (PRECISION_BITS - 1)
    return np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)
