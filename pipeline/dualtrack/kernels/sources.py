"""Where the Track A kernels' sources and their checked-in PTX live, and the PTX as loaders take it.

The runtime reads the PTX from here (the GPU JPEG path's resize kernel); the compiler
(:mod:`dualtrack.compiler.kernel_build`) builds from the same folder with NVRTC.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from dualtrack.errors import DualtrackError


def source_dir() -> Path:
    """The folder of the kernel sources (``*.cu``, ``*.cuh``, ``ptx/<arch>/*.ptx``): the package data
    of an installed wheel (``dualtrack/handwritten_ptx``), else, in a source checkout or an editable
    install, the repository's ``handwritten_ptx/`` (which the wheel is built from)."""
    packaged = importlib.resources.files("dualtrack") / "handwritten_ptx"
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[3] / "handwritten_ptx"
    if checkout.is_dir():
        return checkout
    raise DualtrackError(
        "the Track A kernel sources are missing: neither the package data dualtrack/handwritten_ptx nor a "
        f"checkout's {checkout}; reinstall dualtrack from a wheel built with `pip wheel .`"
    )


SOURCE_DIR = source_dir()


def ptx_image(text: str | bytes) -> bytes:
    """PTX as the driver's loaders take it: bytes ending in exactly one NUL (FACTS 12)."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    return data.rstrip(b"\0") + b"\0"


def sources(root: Path = SOURCE_DIR) -> list[Path]:
    """The kernel sources, ``root/*.cu``, in name order."""
    return sorted(Path(root).glob("*.cu"))


def ptx_path(root: Path, source: Path, arch: str) -> Path:
    """Where the PTX of ``source`` for ``arch`` is kept: ``root/ptx/<arch>/<stem>.ptx``."""
    return Path(root) / "ptx" / arch / f"{Path(source).stem}.ptx"
