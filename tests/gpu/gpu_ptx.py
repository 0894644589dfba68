"""The checked-in PTX of a Track A kernel, loaded for a GPU test (tests/gpu/test_*_gpu.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def checked_in_ptx(engine, stem: str) -> Iterator:
    """The module of handwritten_ptx/ptx/<arch>/<stem>.ptx for this device's arch, JIT-compiled by
    the driver (the engine only loads the kernels its bundle's plan lists); closed afterwards."""
    from dualtrack.arch import PTX_ARCHES, choose_image
    from dualtrack.ptx import SOURCE_DIR, ptx_path
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
