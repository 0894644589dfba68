"""dualtrack.compiler.tools: which program runs for an IREE tool, and its version asked once a process."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dualtrack.compiler import tools
from dualtrack.errors import ToolError


def test_iree_compile_runs_the_compiler_wheels_native_binary() -> None:
    path = Path(tools.executable("iree-compile"))
    assert path.read_bytes()[:4] == b"\x7fELF", f"{path} is not the native compiler (a Python wrapper?)"
    assert tools.run_tool("iree-compile", ["--version"], what="reading its version").strip()


def _fake_compiler(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "iree-compile"
    exe.write_text(f"#!/bin/sh\necho 'IREE (https://iree.dev):'\necho '  IREE compiler version {version}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_iree_tool_path_chooses_the_compiler_and_a_replaced_one_is_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = _fake_compiler(tmp_path / "bin", "1.2.3")
    monkeypatch.setenv("IREE_TOOL_PATH", str(exe.parent))
    assert tools.executable("iree-compile") == str(exe)
    assert tools.tool_version("iree-compile") == "IREE compiler version 1.2.3"
    exe.write_text(exe.read_text().replace("1.2.3", "1.2.4"))
    os.utime(exe, ns=(exe.stat().st_atime_ns, exe.stat().st_mtime_ns + 10**9))
    assert tools.tool_version("iree-compile") == "IREE compiler version 1.2.4"


def test_a_failing_tool_is_a_tool_error_with_a_repro(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = _fake_compiler(tmp_path / "bin", "1.0")
    exe.write_text("#!/bin/sh\necho 'error: no such input' >&2\nexit 3\n")
    monkeypatch.setenv("IREE_TOOL_PATH", str(exe.parent))
    with pytest.raises(ToolError, match="no such input") as info:
        tools.run_tool("iree-compile", ["x.mlir"], what="compiling")
    assert info.value.returncode == 3 and info.value.argv == [str(exe), "x.mlir"]
