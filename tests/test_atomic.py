"""dualtrack.atomic: a file appears whole or not at all, and a failed write leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualtrack import atomic


def test_writes_replace_the_file_and_create_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "f.bin"
    atomic.write_bytes(path, b"one")
    atomic.write_text(path, "two")
    assert path.read_bytes() == b"two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.bin"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()  # a folder where the file should go: the rename fails
    (target / "keep").write_text("x")
    with pytest.raises(OSError):
        atomic.write_bytes(target, b"data")
    assert (target / "keep").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
