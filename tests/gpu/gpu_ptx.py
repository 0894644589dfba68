"""What the kernel GPU tests (tests/gpu/test_*_gpu.py) share: the checked-in PTX of a Track A kernel,
loaded for a test, and channel-slice buffers with a poisoned output slice."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dualtrack.runtime.engine import Engine

SENTINEL = -1234.5  # exactly representable in fp16 and fp32


@contextmanager
def checked_in_ptx(engine, stem: str) -> Iterator:
    """The module of handwritten_ptx/ptx/<arch>/<stem>.ptx for this device's arch, JIT-compiled by
    the driver (the engine only loads the kernels its bundle's plan lists); closed afterwards."""
    from dualtrack.contract.arch import PTX_ARCHES, choose_image
    from dualtrack.kernels.sources import SOURCE_DIR, ptx_path
    from dualtrack.runtime.driver import Module

    be = engine.backend
    be.ctx.make_current()
    choice = choose_image(be.device.cc, [], list(PTX_ARCHES))
    path = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{stem}.cu", choice.arch)
    mod = Module.load(be.ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch)
    try:
        yield mod
    finally:
        be.ctx.make_current()
        be.stream.synchronize()
        mod.close()


@contextmanager
def checked_in_entries(engine, stems: tuple[str, ...]) -> Iterator[dict]:
    """Every entry of the kernels of ``stems`` (entry name -> function), from this device's checked-in
    PTX (:func:`checked_in_ptx`); the modules closed afterwards."""
    from dualtrack import kernels

    with ExitStack() as stack:
        found = {}
        for stem in stems:
            mod = stack.enter_context(checked_in_ptx(engine, stem))
            found.update({entry: mod.function(entry) for entry in kernels.spec_for_stem(stem).entries})
        yield found


class Slices:
    """Device copies of NHWC arrays placed in channel slices of wider buffers (noise around them),
    and a poisoned output slice (NaN inside, SENTINEL outside)."""

    def __init__(self, engine: Engine, dtype: str, off: int) -> None:
        self.be, self.dtype, self.off = engine.backend, dtype, off
        self.be.ctx.make_current()
        self.rng = np.random.default_rng()
        self.keep: list = []

    def input(self, x: np.ndarray) -> tuple[int, int]:
        """(device pointer of the slice, channel stride)."""
        ld = x.shape[3] + 2 * self.off
        wide = self.rng.standard_normal((*x.shape[:3], ld)).astype(self.dtype)
        wide[..., self.off : self.off + x.shape[3]] = x
        d = self.be.from_host(wide)
        self.keep.append(d)
        return d.ptr + self.off * np.dtype(self.dtype).itemsize, ld

    def output(self, shape: tuple[int, ...]) -> tuple[int, int]:
        ld = shape[3] + 2 * self.off
        wide = np.full((*shape[:3], ld), SENTINEL, self.dtype)
        wide[..., self.off : self.off + shape[3]] = np.nan
        self.y, self.y_c = self.be.from_host(wide), shape[3]
        return self.y.ptr + self.off * np.dtype(self.dtype).itemsize, ld

    def weights(self, arr: np.ndarray) -> int:
        d = self.be.from_host(np.ascontiguousarray(arr))
        self.keep.append(d)
        return d.ptr

    def result(self) -> np.ndarray:
        wide = self.be.to_host(self.y)
        outside = np.delete(wide, np.s_[self.off : self.off + self.y_c], axis=3)
        assert (outside == SENTINEL).all(), "channels outside the output slice were written"
        return wide[..., self.off : self.off + self.y_c]
