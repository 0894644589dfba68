"""`serve --workers N` in a GPU test: an engine process's host for one worker, and that worker's client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from polling import until


@contextmanager
def host_and_client(engine: Any, *, max_batch_delay_ms: float = 2) -> Iterator[tuple[Any, Any]]:
    """An :class:`EngineHost` of ``engine`` for one worker, warmed up, and a connected
    :class:`EngineClient`; both closed after (the host within 60 s, or the test fails)."""
    from dualtrack.serve import Phase, ServeOptions
    from dualtrack.serve.shared import EngineClient, EngineHost

    host = EngineHost(engine, ServeOptions(max_batch_delay_ms=max_batch_delay_ms), 1)
    host.start()
    try:
        until(lambda: host.batcher.phase is Phase.READY, "the engine to warm up", 120)
        client = EngineClient(host.address, bytes.fromhex(json.loads(host.worker_env({}))["key"]))
        client.start()
        try:
            assert client.phase is Phase.READY, client.error
            yield host, client
        finally:
            client.close(30)
    finally:
        assert host.close(60)
