"""Where the Track A kernels' sources and their checked-in PTX live, and the PTX as loaders take it.

The runtime reads the PTX from here (the GPU JPEG path's resize kernel); the compiler
(:mod:`dualtrack.compiler.kernel_build`) builds from the same folder with NVRTC.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import re
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


_ENTRY = re.compile(r"\.entry\s+\w+\s*\(([^)]*)\)")
_ENTRY_NAME = re.compile(r"\.entry\s+(\w+)\s*\(")
_ARRAY = re.compile(r"(\[\d+\])$")


def _param(decl: str) -> str:
    """One parameter's declaration without its name: ``.param .align 64 .b8 name[128]`` ->
    ``.align 64 .b8 [128]``."""
    tokens = decl.split()
    size = _ARRAY.search(tokens[-1])
    return " ".join(tokens[1:-1]) + (size.group(1) if size else "")


def launch_abi(ptx: str) -> str:
    """The launch ABI of a PTX module, as a short digest: the distinct parameter lists of its entries
    (each parameter's type, alignment and array size, in order). A kernel that gains, loses or retypes
    a parameter changes it; another tile of the same kernel (a tuned entry) does not. The manifest
    records it per kernel module (compiler/build.py) and the runtime refuses a bundle whose kernels'
    ABI is not the one it launches with (runtime/code_images.py): the driver would take the wrong
    argument list without a word. A change of meaning that keeps every type (two int parameters
    swapped) it cannot see: that one bumps contract.manifest.BUNDLE_FORMAT."""
    lists = {",".join(_param(d) for d in params.split(",") if d.strip()) for params in _ENTRY.findall(ptx)}
    return hashlib.sha256("\n".join(sorted(lists)).encode()).hexdigest()[:16]


def entry_names(ptx: str) -> list[str]:
    """The ``.entry`` names of a PTX module, sorted: what the build records beside :func:`launch_abi`, so
    that the loader can tell a bundle that lacks an entry this version launches (a tile added since)."""
    return sorted(set(_ENTRY_NAME.findall(ptx)))


@functools.cache
def expected_abi(arch: str, stem: str, root: Path = SOURCE_DIR) -> str | None:
    """:func:`launch_abi` of this dualtrack's own PTX of kernel ``stem`` for ``arch``, which its
    launches are written for; None where it has no such kernel."""
    path = ptx_path(root, Path(f"{stem}.cu"), arch)
    return launch_abi(path.read_text()) if path.exists() else None
