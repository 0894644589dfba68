"""Running external tools: argv lists only, and failures that carry everything needed to reproduce them."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Sequence

from dualtrack.errors import ToolError
from dualtrack.settings import tool_path


def executable(tool: str) -> str:
    """The program to run for ``tool``. For iree-compile, the compiler wheel's native binary (iree.compiler's
    own lookup, which honours ``IREE_TOOL_PATH``): the ``iree-compile`` console script beside this Python is a
    Python wrapper that starts an interpreter only to run that binary, 0.35 s a call. Otherwise
    :func:`dualtrack.settings.tool_path`."""
    if tool == "iree-compile":
        try:
            from iree.compiler.tools import binaries
        except ImportError:
            pass
        else:
            try:
                return binaries.find_tool(tool)
            except ValueError:
                pass
    return tool_path(tool)


def run_tool(tool: str, args: Sequence[str], *, what: str, timeout_s: float = 1800) -> str:
    """Run `tool args...`; return stdout. Raise ToolError with exit code, stderr and a repro command."""
    argv = [executable(tool), *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise ToolError(
            tool, f"not found; install it with `pip install iree-base-compiler==3.13.*` ({what})", argv=argv
        ) from None
    except subprocess.TimeoutExpired:
        raise ToolError(tool, f"timed out after {timeout_s:.0f} s while {what}", argv=argv) from None
    if proc.returncode != 0:
        first = next((ln for ln in proc.stderr.splitlines() if "error" in ln.lower()), proc.stderr.strip()[:200])
        raise ToolError(
            tool, f"failed while {what}: {first.strip()}", returncode=proc.returncode, stderr=proc.stderr, argv=argv
        )
    return proc.stdout


def tool_version(tool: str) -> str:
    """First line of `tool --version`, for cache keys and the manifest: asked once a process for each
    installed program (a build asks for every module's cache key), again after it is replaced."""
    path = executable(tool)
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = None
    return _version(tool, path, stamp)


@functools.cache
def _version(tool: str, path: str, stamp: int | None) -> str:
    out = run_tool(tool, ["--version"], what="reading its version")
    return next((ln.strip() for ln in out.splitlines() if "version" in ln.lower()), out.strip().splitlines()[0])
