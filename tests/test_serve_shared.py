"""One engine behind several worker processes (`dualtrack serve --workers N`), on the CPU.

The engine host and its clients run here in one process (threads stand in for the worker
processes: the protocol, the slot file and the socket are the same); tests/test_serve.py runs the
real thing, `dualtrack serve --workers 2`, over HTTP.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from polling import until

from dualtrack import Engine
from dualtrack.errors import ConfigError, InputError
from dualtrack.serve import NotReadyError, Phase, QueueFullError, ServeOptions, shared
from dualtrack.serve.shared import EngineClient, EngineHost, RemoteMetrics

WAIT_S = 120.0


def _until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    until(condition, what, timeout)


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path) -> Iterator[Engine]:
    """The engine the hosts serve, and the reference for their answers (Engine.run is serialised)."""
    e = Engine.load(tiny_bundle, device="cpu")
    yield e
    e.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


@contextmanager
def hosting(engine: Engine, workers: int = 2, **options: float) -> Iterator[EngineHost]:
    host = EngineHost(engine, ServeOptions(**options), workers)
    host.start()
    _until(lambda: host.batcher.phase is Phase.READY, "the engine to warm up")
    try:
        yield host
    finally:
        assert host.close(WAIT_S)


@contextmanager
def client_of(host: EngineHost) -> Iterator[EngineClient]:
    client = EngineClient(host.address, bytes.fromhex(_key(host)))
    client.start()
    assert client.phase is Phase.READY, client.error
    try:
        yield client
    finally:
        client.close(WAIT_S)


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _key(host: EngineHost) -> str:
    import json

    return json.loads(host.worker_env({}))["key"]


def _images(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(n)]


def test_two_workers_share_batches_and_get_their_own_masks(engine, rng) -> None:
    with hosting(engine, max_batch_delay_ms=500) as host, client_of(host) as a, client_of(host) as b:
        assert a.engine.input_spec == engine.input_spec and a.engine.batch_sizes == engine.batch_sizes
        images = _images(rng, 8)
        # Alternate the clients: batches of 4 (the largest compiled size) must mix the two workers.
        futures = [(a if i % 2 else b).submit(x) for i, x in enumerate(images)]
        results = [f.result(WAIT_S) for f in futures]
        expected = engine.run(np.stack(images))["mask"]
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r.mask, expected[i])
        assert max(r.batch_size for r in results) == 4, [r.batch_size for r in results]
        assert a.depth == b.depth == 0  # every slot came back


def test_cancelled_request_is_withdrawn_and_its_slot_reused(engine, rng) -> None:
    # A lone request waits the whole delay for company: time to cancel it before its batch starts.
    with hosting(engine, max_batch_delay_ms=3000, max_queue=4) as host, client_of(host) as a:
        slots = host.slots_per_range
        future = a.submit(_images(rng, 1)[0])
        _until(lambda: host.batcher.depth == 1, "the request to be queued", 10)
        assert future.cancel()
        _until(lambda: a.depth == 0, "the engine process to give the slot back", 10)
        with pytest.raises(CancelledError):
            future.result(0)
        # The worker can still fill every slot of its range, and the next request is answered.
        x = _images(rng, 1)[0]
        assert a.submit(x).result(WAIT_S).mask.shape == (64, 64)
        assert slots == 4 + max(engine.batch_sizes)


def test_full_engine_queue_reaches_the_worker_as_queue_full(engine, rng) -> None:
    with hosting(engine, max_batch_delay_ms=3000, max_queue=1) as host, client_of(host) as a, client_of(host) as b:
        first = a.submit(_images(rng, 1)[0])
        _until(lambda: host.batcher.depth == 1, "the first request to be queued", 10)
        with pytest.raises(QueueFullError, match="queue is full"):
            b.submit(_images(rng, 1)[0]).result(WAIT_S)
        assert first.result(WAIT_S).batch_size == 1


def test_a_worker_out_of_slots_refuses_at_once(engine, rng) -> None:
    with hosting(engine, max_batch_delay_ms=3000, max_queue=1) as host, client_of(host) as a:
        a._free.clear()  # as if all of its slots held requests in flight
        with pytest.raises(QueueFullError, match="requests in flight"):
            a.submit(_images(rng, 1)[0])


def test_wrong_image_shape_is_refused_in_the_worker(engine) -> None:
    with hosting(engine) as host, client_of(host) as a, pytest.raises(InputError, match=r"uint8\[64, 64, 3\]"):
        a.submit(np.zeros((32, 64, 3), np.uint8))


def test_metrics_of_every_worker_land_in_one_registry(engine, rng) -> None:
    with hosting(engine, max_batch_delay_ms=1) as host, client_of(host) as a, client_of(host) as b:
        for client, code in ((a, 200), (b, 200), (b, 400)):
            RemoteMetrics(client).observe_request("/v1/segment", code)
        # a's own observations arrive before its question (one connection, in order); b's within a flush.
        ok = 'dualtrack_requests_total{code="200",endpoint="/v1/segment"}'
        _until(lambda: _sample(RemoteMetrics(a).exposition().decode(), ok) == 2, "b's flush", 10)
        text = RemoteMetrics(a).exposition().decode()
        assert re.search(r'^dualtrack_request_errors_total\{code="400",endpoint="/v1/segment"\} 1\.0$', text, re.M)
        a.submit(_images(rng, 1)[0]).result(WAIT_S)
        text = RemoteMetrics(b).exposition().decode()
        assert re.search(r"^dualtrack_batch_size_sum 1\.0$", text, re.M)
        assert re.search(r"^dualtrack_ready 1\.0$", text, re.M)


def test_slot_ranges_run_out_with_a_reason(engine) -> None:
    with hosting(engine, workers=1) as host:  # one range per worker and two spares: three
        clients = [EngineClient(host.address, bytes.fromhex(_key(host))) for _ in range(4)]
        try:
            for c in clients:
                c.start()
            assert [c.phase for c in clients[:3]] == [Phase.READY] * 3
            assert clients[3].phase is Phase.FAILED
            assert "all 3 slot ranges are in use" in clients[3].error
        finally:
            for c in clients:
                c.close(5)
        # A range comes back when its worker leaves.
        _until(lambda: len(host._free_ranges) == 3, "the ranges to be given back", 10)


def test_wrong_key_or_no_engine_fails_readiness_with_the_reason(engine) -> None:
    with hosting(engine) as host:
        bad = EngineClient(host.address, b"not the key")
        bad.start()
        assert bad.phase is Phase.FAILED and "cannot reach the engine process" in bad.error
    gone = EngineClient(str(Path(tempfile.gettempdir()) / "no-such-dualtrack.sock"), b"k")
    gone.start()
    assert gone.phase is Phase.FAILED and "cannot reach the engine process" in gone.error
    with pytest.raises(NotReadyError, match="cannot reach the engine process"):
        gone.submit(np.zeros((64, 64, 3), np.uint8))


def test_a_client_hanging_up_in_the_handshake_does_not_stop_accepting(engine, rng) -> None:
    with hosting(engine) as host:
        for _ in range(3):  # connects, then hangs up before answering the key challenge
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stray:
                stray.connect(host.address)
        with client_of(host) as a:
            assert a.submit(_images(rng, 1)[0]).result(WAIT_S).mask.shape == (64, 64)
        accepting = host._accepting
    assert not accepting.is_alive()  # close() ended the accept thread


def test_no_room_for_the_slots_is_a_config_error(engine, tmp_path, monkeypatch) -> None:
    tiny = tmp_path / "full"
    tiny.mkdir()
    monkeypatch.setattr(shared, "slot_directory", lambda nbytes: tiny)
    monkeypatch.setattr(os, "posix_fallocate", _no_space)
    with pytest.raises(ConfigError, match=r"cannot reserve \d+ MiB for the image slots in .*full: No space left"):
        EngineHost(engine, ServeOptions(), 2)
    assert list(tiny.iterdir()) == []  # no half-made slot file left


def _no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(28, "No space left on device")  # what a full tmpfs answers


def test_an_engine_process_that_never_answers_fails_readiness(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shared, "CONNECT_TIMEOUT_S", 0.5)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:  # accepts, never says a word
        silent.bind(str(tmp_path / "silent.sock"))
        silent.listen()
        client = EngineClient(str(tmp_path / "silent.sock"), b"key")
        client.start()
    assert client.phase is Phase.FAILED and "no answer within" in client.error


def test_engine_process_going_away_fails_requests_not_the_worker(engine, rng) -> None:
    host = EngineHost(engine, ServeOptions(max_batch_delay_ms=1), 1)
    host.start()
    _until(lambda: host.batcher.phase is Phase.READY, "the engine to warm up")
    client = EngineClient(host.address, bytes.fromhex(_key(host)))
    client.start()
    try:
        assert client.submit(_images(rng, 1)[0]).result(WAIT_S).batch_size == 1
        slot_file = host.slots.path
        assert host.close(WAIT_S)
        assert not slot_file.exists()  # nothing left behind in /dev/shm
        _until(lambda: client.phase is Phase.FAILED, "the worker to notice", 10)
        assert "engine process closed the connection" in client.error
        with pytest.raises(NotReadyError, match="engine process closed the connection"):
            client.submit(_images(rng, 1)[0])
    finally:
        client.close(5)
