"""One engine behind several worker processes (`dualtrack serve --workers N`), on the CPU.

The engine host and its clients run here in one process (threads stand in for the worker
processes: the protocol, the slot file and the socket are the same); the CLI test at the end runs
the real thing, N uvicorn processes in front of one engine.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from dualtrack import Engine
from dualtrack.errors import InputError
from dualtrack.serve import NotReadyError, Phase, QueueFullError, ServeOptions, imaging
from dualtrack.serve.shared import EngineClient, EngineHost, RemoteMetrics

WAIT_S = 120.0


def _until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path) -> Iterator[Engine]:
    """The engine the host serves (only its batcher calls it)."""
    e = Engine.load(tiny_bundle, device="cpu")
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(tiny_bundle: Path) -> Iterator[Engine]:
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


def _key(host: EngineHost) -> str:
    import json

    return json.loads(host.worker_env({}))["key"]


def _images(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(n)]


def test_two_workers_share_batches_and_get_their_own_masks(engine, reference, rng) -> None:
    with hosting(engine, max_batch_delay_ms=500) as host, client_of(host) as a, client_of(host) as b:
        assert a.engine.input_spec == engine.input_spec and a.engine.batch_sizes == engine.batch_sizes
        images = _images(rng, 8)
        # Alternate the clients: batches of 4 (the largest compiled size) must mix the two workers.
        futures = [(a if i % 2 else b).submit(x) for i, x in enumerate(images)]
        results = [f.result(WAIT_S) for f in futures]
        expected = reference.run(np.stack(images))["mask"]
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


# --- the CLI: real worker processes --------------------------------------------------------------


def _png(rng: np.random.Generator, height: int, width: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _expected_mask(engine: Engine, data: bytes) -> np.ndarray:
    img = imaging.decode_image(data)
    _, height, width, _ = engine.input_spec.shape
    mask = engine.run(imaging.to_model_input(img, height, width)[None])["mask"][0]
    return imaging.mask_to_size(mask, img.height, img.width)


def _answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _children(pid: int) -> list[int]:
    """The live worker processes of ``pid`` (Linux /proc; multiprocessing's resource tracker is not one)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return [c for c in out if _alive(c) and b"resource_tracker" not in _cmdline(c)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_serve_cli_workers_share_one_engine(tiny_bundle: Path, reference, rng) -> None:
    """`--workers 2`: two HTTP processes on one port, one engine and one /metrics; a killed worker is
    replaced; SIGTERM stops all."""
    with socket.socket() as s:  # a free port: with workers, uvicorn reports port 0 as it was given
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    argv = [sys.executable, "-m", "dualtrack.cli", "serve", str(tiny_bundle), "--workers", "2"]
    argv += ["--port", str(port), "--log-level", "warning", "--device", "cpu", "--max-batch-delay-ms", "200"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        # The kernel spreads fresh connections over the workers: a run of 200s means both are ready.
        _until(lambda: all(_answers(base) for _ in range(16)), "both workers to be ready")
        images = [_png(rng, 48 + i, 64) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda b: httpx.post(f"{base}/v1/segment", content=b, timeout=WAIT_S), images))
        for data, r in zip(images, answers, strict=True):
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(imaging.decode_mask_png(r.content), _expected_mask(reference, data))
        # Whichever worker answers /metrics, it reports the whole service (within one flush period).
        ok = 'dualtrack_requests_total{code="200",endpoint="/v1/segment"}'
        _until(lambda: _sample(httpx.get(f"{base}/metrics").text, ok) == 8, "both workers' counts in /metrics", 10)
        text = httpx.get(f"{base}/metrics").text
        assert _sample(text, "dualtrack_batch_size_sum") == 8  # one engine ran every image
        assert _sample(text, "dualtrack_queue_wait_seconds_count") == 8
        # A worker that dies is replaced (uvicorn) and the new one connects to the same engine.
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        _until(lambda: len(_children(proc.pid)) == 2 and workers[0] not in _children(proc.pid), "a new worker")
        _until(lambda: all(_answers(base) for _ in range(16)), "the new worker to be ready")
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda b: httpx.post(f"{base}/v1/segment", content=b, timeout=WAIT_S), images[:4]))
        assert [r.status_code for r in again] == [200] * 4, [r.text for r in again]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read()
    assert "2 HTTP processes" in output and "one engine in process" in output, output
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not [n for n in after - before if n.startswith("dualtrack-serve-")], "slot file left behind"
