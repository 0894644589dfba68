"""Files that appear whole or not at all: a sibling temporary file, then one rename.

Every cache entry, tuning file, model and mask dualtrack writes goes through :func:`write_bytes` or
:func:`write_text`, so a reader (a concurrent build, a second process) sees the old file or the new
one, never half of one, and a failed write leaves no temporary file behind. (Whole directories,
such as a bundle, are swapped in by their own writer: :class:`dualtrack.compiler.bundle_writer.BundleWriter`.)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (creating its folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode())
