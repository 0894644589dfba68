"""Waiting in tests without sleeps of a guessed length (a plain module: conftest.py is not importable
as such, tests/gpu/ has one too)."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(condition: Callable[[], bool], what: str, timeout: float) -> None:
    """Wait for ``condition`` (polled every 20 ms), failing with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)
