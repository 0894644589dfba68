"""Serve a bundle over HTTP: micro-batching, probes, Prometheus metrics, a small web page.

``create_app(engine_or_bundle, ...)`` returns a Starlette ASGI app (run it with uvicorn, or
``dualtrack serve BUNDLE``); ``dualtrack loadtest URL`` measures it. The endpoints are documented in
:mod:`dualtrack.serve.app`, the image and mask conventions in :mod:`dualtrack.imaging`.
"""

from __future__ import annotations

from typing import Any

from dualtrack.serve.options import ServeOptions

__all__ = ["BatchResult", "Batcher", "NotReadyError", "Phase", "QueueFullError", "ServeOptions", "create_app"]

_LAZY = {
    "create_app": "dualtrack.serve.app",
    "BatchResult": "dualtrack.serve.batcher",
    "Batcher": "dualtrack.serve.batcher",
    "NotReadyError": "dualtrack.serve.batcher",
    "Phase": "dualtrack.serve.batcher",
    "QueueFullError": "dualtrack.serve.batcher",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `dualtrack --help` (which imports serve.cli) does not pay for Starlette and numpy.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dualtrack.serve' has no attribute {name!r}")
