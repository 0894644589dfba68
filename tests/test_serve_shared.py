"""One engine behind several worker processes (`dualtrack serve --workers N`), on the CPU.

The engine host and its clients run here in one process (threads stand in for the worker
processes: the protocol, the slot file and the socket are the same); tests/test_serve.py runs the
real thing, `dualtrack serve --workers 2`, over HTTP.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import pickle
import re
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from multiprocessing.connection import Client, Connection, Listener, Pipe
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
from PIL import Image
from polling import until
from starlette.testclient import TestClient

from dualtrack import Engine, imaging
from dualtrack.contract.plan import TensorSpec
from dualtrack.errors import BundleError, ConfigError, DualtrackError, InputError
from dualtrack.imaging import GpuJpeg, load_for_model, route_jpeg
from dualtrack.serve import NotReadyError, Phase, QueueFullError, ServeOptions, create_app, shared
from dualtrack.serve.app import worker_app
from dualtrack.serve.batcher import BatchQueue, BatchResult
from dualtrack.serve.protocol import (
    Answer,
    Cancel,
    Cancelled,
    Done,
    EngineInfo,
    EngineMessage,
    Failed,
    Hello,
    LatencyObserved,
    Observations,
    PhaseChanged,
    Question,
    Refused,
    Replies,
    RequestObserved,
    RunJpeg,
    RunRequest,
    WorkerMessage,
)
from dualtrack.serve.shared import (
    EngineClient,
    EngineHost,
    FrameReader,
    RemoteMetrics,
    SlotFile,
    copy_holding_gil,
)

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


def test_answers_ready_together_travel_as_one_replies_message(engine, rng, monkeypatch) -> None:
    """A batch finishes its rows at once: the engine process's writer sends a worker's answers that
    are waiting together as one Replies (fewer sends and wake-ups), and each mask still comes back."""
    sent: list[object] = []
    send = shared._send_quietly

    def recording(conn: Connection, msg: object) -> bool:
        sent.append(msg)
        return send(conn, msg)

    monkeypatch.setattr(shared, "_send_quietly", recording)
    monkeypatch.setenv("DUALTRACK_SLOT_ANSWERS", "0")  # the answers that travel as messages
    with hosting(engine, max_batch_delay_ms=500) as host, client_of(host) as a:
        images = _images(rng, 4)
        results = [f.result(WAIT_S) for f in [a.submit(x) for x in images]]
    expected = engine.run(np.stack(images))["mask"]
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.mask, expected[i])
    answers = [m for m in sent if isinstance(m, Replies | Done)]
    assert sum(len(m.replies) if isinstance(m, Replies) else 1 for m in answers) == 4
    assert any(isinstance(m, Replies) for m in answers), [type(m).__name__ for m in answers]


def test_answers_written_into_the_slots_need_no_message(engine, rng, monkeypatch, capfd) -> None:
    """Each request that ran is answered from its slot (its worker woken by its semaphore): the
    right mask, the batch's sizes and timings, no Done message; its slot comes back for the next."""
    sent: list[object] = []
    send = shared._Peer._send_replies

    def recording(peer: object, replies: list[object]) -> bool:
        sent.extend(replies)
        return send(peer, replies)  # type: ignore[arg-type]

    monkeypatch.setattr(shared._Peer, "_send_replies", recording)
    with hosting(engine, max_batch_delay_ms=500) as host, client_of(host) as a, client_of(host) as b:
        assert host.answers is not None and a._answers is not None
        assert "answers go to the workers through their slots" in capfd.readouterr().err  # the startup line
        images = _images(rng, 8)
        futures = [(a if i % 2 else b).submit(x) for i, x in enumerate(images)]
        results = [f.result(WAIT_S) for f in futures]
        expected = engine.run(np.stack(images))["mask"]
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r.mask, expected[i])
            assert r.batch_size == 4 and r.padded_size == 4, (r.batch_size, r.padded_size)
            assert r.queue_ms > 0 and r.run_ms > 0 and "batch_gather_ms" in r.timings and "hop_in_ms" in r.timings
            assert "hop_writer_ms" not in r.timings  # no message's hand-overs: the slot answered it
        assert not [m for m in sent if isinstance(m, Done)], sent
        _until(lambda: a.depth == b.depth == 0, "the slots to come back", 10)
        # The slots are reused: the answer a slot held is never taken for the next request there.
        again = [a.submit(x) for x in images[4:]]
        for i, f in enumerate(again):
            np.testing.assert_array_equal(f.result(WAIT_S).mask, expected[4 + i])
        _until(lambda: a.depth == 0, "the slots to come back again", 10)


def test_answers_travel_as_messages_only_with_slot_answers_off(engine, rng, monkeypatch, capfd) -> None:
    monkeypatch.setenv("DUALTRACK_SLOT_ANSWERS", "0")
    with hosting(engine, max_batch_delay_ms=300) as host, client_of(host) as a:
        assert "answers go to the workers as messages (DUALTRACK_SLOT_ANSWERS=0)" in capfd.readouterr().err
        assert host.answers is None and a._answers is None and a._watcher is None
        images = _images(rng, 3)
        results = [f.result(WAIT_S) for f in [a.submit(x) for x in images]]
        expected = engine.run(np.stack(images))["mask"]
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r.mask, expected[i])
            assert "hop_writer_ms" in r.timings  # the Done message's hand-overs: the message answered it


def test_an_answer_that_cannot_be_written_into_its_slot_goes_as_a_message(engine, rng, monkeypatch, caplog) -> None:
    def broken(*_: object) -> bool:
        raise RuntimeError("answer area out of order")

    monkeypatch.setattr(shared.EngineHost, "answer_in_slot", broken)
    with hosting(engine, max_batch_delay_ms=300) as host, client_of(host) as a:
        assert host.answers is not None
        images = _images(rng, 2)
        with caplog.at_level(logging.ERROR, logger="dualtrack.serve.shared"):
            results = [f.result(WAIT_S) for f in [a.submit(x) for x in images]]
        expected = engine.run(np.stack(images))["mask"]
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r.mask, expected[i])
            assert "hop_writer_ms" in r.timings  # the message answered it
        assert "its answer goes as a message" in caplog.text


def test_a_slot_answer_is_taken_only_for_its_own_request(tmp_path) -> None:
    """The word names the request (token = id + 1); a word of another request, a cleared word or an
    answer too long for the area is no answer."""
    slots = SlotFile(tmp_path / "s", 3, 1000, create=True, answer_bytes=200)
    try:
        assert slots.payload_bytes == 800
        assert slots.read_answer(1, 8) is None  # nothing written yet (the word is 0)
        assert slots.write_answer(1, 8, b"seven's answer")
        assert slots.read_answer(1, 8) == b"seven's answer"
        assert slots.read_answer(1, 9) is None and slots.read_answer(0, 8) is None and slots.read_answer(2, 8) is None
        assert not slots.write_answer(1, 9, b"x" * 185)  # 16 bytes of head + 185 > 200: a message only
        assert slots.read_answer(1, 8) == b"seven's answer"  # untouched
        slots.clear_answer(1)
        assert slots.read_answer(1, 8) is None
        assert not slots.write_answer(2, 0, b"token 0 would read as no answer")
        np.testing.assert_array_equal(slots.buffer[:, :800], 0)  # the payloads are not touched
    finally:
        slots.close()


def test_an_answer_put_without_its_word_is_taken_once_the_word_lands(tmp_path) -> None:
    """put_answer writes the answer but not its word (the GPU writes that: Engine.signal); the word's
    address is 8-byte aligned, and index_of finds a slot from a view of it."""
    image = 5 * 7 * 3  # 105 bytes: not a multiple of 8
    assert shared.payload_bytes(image) == 128 and shared.payload_bytes(128) == 128
    slots = SlotFile(tmp_path / "s", 4, shared.payload_bytes(image) + 256, create=True, answer_bytes=256)
    try:
        word = slots.put_answer(2, b"answer of 41")
        assert word == slots.word_address(2) and word % 8 == 0
        assert slots.read_answer(2, 42) is None  # no word yet: no answer
        ctypes.c_uint64.from_address(word).value = 42  # what the GPU's store does
        assert slots.read_answer(2, 42) == b"answer of 41"
        assert slots.put_answer(1, b"x" * 241) is None  # 16 + 241 > 256
        assert slots.index_of(slots.array(3, (5, 7, 3))) == 3 and slots.index_of(slots.array(0, (4,))) == 0
        assert slots.index_of(slots.buffer[1, 8:16]) is None  # not a slot's start
        assert slots.index_of(np.zeros(4, np.uint8)) is None  # not in the file
    finally:
        slots.close()


@pytest.mark.skipif(not shared.semaphores.available(), reason="no process-shared semaphores in this C library")
def test_engine_signal_on_the_cpu_stores_the_marks_then_posts(engine, tmp_path) -> None:
    """Engine.signal on the CPU (a launch there has run when it returns): the marks stored and the C
    functions called at once; here sem_post, as the service has the CUDA driver's thread call it."""
    sems = shared.SemaphoreFile(tmp_path / "sem", 2, create=True)
    words = np.zeros(4, np.uint64)
    try:
        base = int(words.ctypes.data)
        engine.signal([(base + 8, 7), (base + 24, 2**63 + 5)], [(shared.semaphores.post_function(), sems.address(1))])
        assert words.tolist() == [0, 7, 0, 2**63 + 5]
        assert sems.wait(1, 0) and not sems.wait(1, 0) and not sems.wait(0, 0)
        with pytest.raises(InputError, match="aligned"):
            engine.signal([(base + 4, 1)])
        assert words.tolist() == [0, 7, 0, 2**63 + 5]
    finally:
        sems.close()


def test_a_worker_times_a_gpu_marked_answer_from_its_launch(tmp_path, monkeypatch) -> None:
    """An answer the GPU marked carries its launch time: the worker reads its run as the time from
    then (one monotonic clock for every process), not the 0 written before the run."""
    slots = SlotFile(tmp_path / "s", 2, 64 + 256, create=True, answer_bytes=256)
    try:
        client = EngineClient("unused", b"k")
        client._slots = slots
        launched = time.monotonic() - 0.004
        body = pickle.dumps((5, 8, 8, 2.5, 0.0, {"batch_gather_ms": 1.0}, 0.3, launched))
        assert slots.write_answer(1, 6, body)
        result = client._answer_from_slot(5, 1, (8, 8))
        assert result is not None and result.batch_size == 8 and result.queue_ms == 2.5
        assert 4.0 <= result.run_ms < 4.0 + WAIT_S * 1e3
        assert result.timings["batch_gpu_ms"] == result.run_ms and result.timings["hop_in_ms"] == 0.3
        assert slots.write_answer(0, 6, pickle.dumps((5, 8, 8, 2.5, 3.25, {}, 0.3, 0.0)))
        result = client._answer_from_slot(5, 0, (8, 8))
        assert result is not None and result.run_ms == 3.25 and "batch_gpu_ms" not in result.timings
    finally:
        slots.close()


def _post_from_another_process(path: str, index: int) -> None:
    from dualtrack.serve.semaphores import SemaphoreFile

    sems = SemaphoreFile(Path(path), 4, create=False)
    sems.post(index)
    sems.close()


@pytest.mark.skipif(not shared.semaphores.available(), reason="no process-shared semaphores in this C library")
def test_a_semaphore_posted_in_another_process_wakes_its_waiter(tmp_path) -> None:
    import multiprocessing

    sems = shared.SemaphoreFile(tmp_path / "sem", 4, create=True)
    try:
        assert not sems.wait(2, 0.05)  # nothing posted: the timeout
        child = multiprocessing.get_context("spawn").Process(
            target=_post_from_another_process, args=(str(sems.path), 2)
        )
        child.start()
        assert sems.wait(2, 30)
        child.join(30)
        assert not sems.wait(1, 0.05) and not sems.wait(2, 0.05)  # one post, one wake, that semaphore only
        sems.post(3)
        sems.post(3)
        assert sems.wait(3, 0) and sems.wait(3, 0) and not sems.wait(3, 0)
        for _ in range(5):
            sems.post(0)
        assert sems.drain(0) == 5 and sems.drain(0) == 0 and not sems.wait(0, 0)
        with pytest.raises(IndexError):
            sems.post(4)
    finally:
        sems.close()


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


def _jpeg_bytes(rng: np.random.Generator, w: int = 80, h: int = 60) -> bytes:
    buf = io.BytesIO()
    small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_a_jpeg_for_the_gpu_travels_as_bytes_to_the_engine_process(engine, rng, monkeypatch) -> None:
    """Under --workers a JPEG that route_jpeg gives the GPU goes to the engine process as its bytes and
    header (RunJpeg), into the batcher's submit_jpeg. The GPU decode itself is tested on the GPU
    (tests/gpu/test_gpu_decode_gpu.py); here the engine is on the CPU, so the batcher's submit_jpeg
    is replaced by what the CPU path does with the bytes it receives, and the mask must be the
    engine's on the CPU-decoded image."""
    with hosting(engine, max_batch_delay_ms=1) as host, client_of(host) as a:
        assert a.decoder[0] == "cpu" and a.max_jpeg_bytes == 64 * 64 * 3
        data = _jpeg_bytes(rng)
        jpeg = route_jpeg(data, 64, 64, max_downscale=8)
        assert isinstance(jpeg, GpuJpeg)
        with pytest.raises(NotReadyError, match="JPEG decoder is cpu"):
            a.submit_jpeg(jpeg)  # the engine process has no GPU decoder: the worker decodes
        received: list[GpuJpeg] = []

        def submit_jpeg(got: GpuJpeg, into: np.ndarray | None = None):
            received.append(got)
            return host.batcher.submit(load_for_model(got.data, 64, 64).pixels, into=into)

        monkeypatch.setattr(host.batcher, "submit_jpeg", submit_jpeg)
        monkeypatch.setattr(a, "decoder", ("gpu", "as if nvImageCodec had opened"))
        result = a.submit_jpeg(jpeg).result(WAIT_S)
        assert received == [jpeg]
        pixels = load_for_model(data, 64, 64).pixels
        np.testing.assert_array_equal(result.mask, engine.run(pixels[None])["mask"][0])
        assert a.depth == 0
        too_long = GpuJpeg(bytes(a.max_jpeg_bytes + 1), (64, 64), 1)
        with pytest.raises(InputError, match="does not fit"):
            a.submit_jpeg(too_long)
        # A forged RunJpeg outside the slot is refused in the engine process, not read past the slot.
        forged: Future[BatchResult] = Future()
        with a._lock:
            rid, slot = a._next_id, a._free.pop()
            a._pending[rid] = (slot, forged)
            a._next_id += 1
        a._send(RunJpeg(rid, slot, a.max_jpeg_bytes + 1, (64, 64), 1))
        with pytest.raises(InputError, match="outside this worker's range"):
            forged.result(WAIT_S)
        _until(lambda: a.depth == 0, "the slot to come back", 10)


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


# --- the messages --------------------------------------------------------------------------------

_SPEC = TensorSpec("image", (1, 64, 64, 3), "uint8", "NHWC")
_INFO = EngineInfo(_SPEC, (TensorSpec("mask", (1, 64, 64), "uint8"),), (1, 4), "cpu")
MESSAGES = [
    Hello("/dev/shm/dualtrack-x.slots", 24, 12288, 8, 8, _INFO, Phase.WARMING, ""),
    Refused("all 3 slot ranges are in use"),
    Done(7, 3, 4, 12.5, 3.25, {"track_a_ms": 1.5, "track_b_ms": 1.75}),
    Failed(8, "queue_full", "request queue is full (1 waiting)"),
    Cancelled(9),
    Replies((Done(10, 2, 4, 1.0, 2.0, {}), Failed(11, "input", "bad"), Cancelled(12))),
    Answer(10, b"# HELP dualtrack_ready 1 when ready to serve\n"),
    PhaseChanged(Phase.FAILED, "engine failed: out of memory"),
    PhaseChanged(Phase.READY, "", ("gpu", "nvImageCodec (nvJPEG) on the engine's GPU")),
    RunRequest(11, 5),
    RunJpeg(13, 6, 64123, (640, 480), 6),
    Cancel(11),
    Question(12, "metrics"),
    Observations((RequestObserved("/v1/segment", 200), LatencyObserved(0.0125), RequestObserved("/readyz", 503))),
]


def test_the_sample_messages_cover_the_whole_protocol() -> None:
    assert {type(m) for m in MESSAGES} == {*get_args(EngineMessage), *get_args(WorkerMessage)}


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_a_pipe(msg: object) -> None:
    here, there = Pipe()
    try:
        here.send(msg)
        assert there.poll(WAIT_S)
        got = there.recv()
    finally:
        here.close()
        there.close()
    assert type(got) is type(msg) and got == msg


@pytest.mark.parametrize(
    ("err", "kind", "raised"),
    [
        (QueueFullError("full"), "queue_full", QueueFullError),
        (NotReadyError("loading"), "not_ready", NotReadyError),
        (InputError("bad slot"), "input", InputError),
        (DualtrackError("engine failed"), "engine", DualtrackError),
        (BundleError("bad bundle"), "engine", DualtrackError),  # a class the worker does not map: a 500
        (RuntimeError("CUDA error"), "engine", DualtrackError),
    ],
)
def test_a_failure_is_raised_in_the_worker_as_the_batcher_raised_it(err, kind, raised) -> None:
    failed = Failed.of(3, err)
    assert (failed.rid, failed.kind, failed.message) == (3, kind, str(err))
    back = failed.error()
    assert type(back) is raised and str(back) == str(err)


def test_done_carries_the_batch_result_but_the_mask() -> None:
    mask = np.arange(12, dtype=np.uint8).reshape(3, 4)
    result = BatchResult(mask, 3, 4, 12.5, 3.25, {"track_a_ms": 1.5})
    done = Done.of(5, result)
    assert done == Done(5, 3, 4, 12.5, 3.25, {"track_a_ms": 1.5})
    assert done.result(mask) == result
    # With the hand-over stamps, the result's timings add them (ms): the way back from the monotonic clock.
    timed = Done.of(5, result, in_ms=0.25, writer_ms=0.5, sent=100.0).result(mask, received=100.002)
    assert timed.timings.keys() == {"track_a_ms", "hop_in_ms", "hop_writer_ms", "hop_back_ms"}
    assert (timed.timings["hop_in_ms"], timed.timings["hop_writer_ms"]) == (0.25, 0.5)
    assert timed.timings["hop_back_ms"] == pytest.approx(2.0, abs=1e-6)
    assert result.timings == {"track_a_ms": 1.5}  # the batch's own dict, shared by its rows, is not changed


def test_an_unknown_message_to_the_engine_process_drops_that_worker(engine, rng, caplog) -> None:
    with hosting(engine, workers=1) as host:
        free = len(host._free_ranges)
        with Client(host.address, family="AF_UNIX", authkey=bytes.fromhex(_key(host))) as conn:
            assert isinstance(conn.recv(), Hello)
            with caplog.at_level(logging.ERROR, logger="dualtrack.serve.shared"):
                conn.send(("run", 0, 0))  # the tuples this protocol replaced
                assert conn.poll(WAIT_S)
                with pytest.raises(EOFError):
                    conn.recv()  # the engine process hung up
        assert any(
            r.levelno == logging.ERROR
            and re.search(r"^worker \d+ sent tuple \('run', 0, 0\), .*closing the connection", r.message)
            for r in caplog.records
        ), caplog.text
        _until(lambda: len(host._free_ranges) == free, "its slot range to be given back", 10)
        with client_of(host) as a:  # the others are still served
            assert a.submit(_images(rng, 1)[0]).result(WAIT_S).batch_size == 1


def test_an_unknown_message_to_a_worker_fails_it_and_closes_the_connection(tmp_path, caplog) -> None:
    key = os.urandom(16)
    slots = SlotFile(tmp_path / "slots", 4, 64 * 64 * 3, create=True)
    with Listener(str(tmp_path / "engine.sock"), family="AF_UNIX", authkey=key) as listener:
        accepted: list[Connection] = []
        accepting = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        accepting.start()
        client = EngineClient(str(tmp_path / "engine.sock"), key)
        try:
            with caplog.at_level(logging.ERROR, logger="dualtrack.serve.shared"):
                # A pretend engine process: a good hello, then a message of another protocol.
                client_thread = threading.Thread(target=client.start, daemon=True)
                client_thread.start()
                accepting.join(WAIT_S)
                (conn,) = accepted
                conn.send(Hello(str(slots.path), 4, 64 * 64 * 3, 0, 4, _INFO, Phase.READY, ""))
                client_thread.join(WAIT_S)
                assert client.phase is Phase.READY, client.error
                future = client.submit(np.zeros((64, 64, 3), np.uint8))
                sent = conn.recv()
                assert isinstance(sent, RunRequest) and (sent.rid, sent.slot) == (0, 0)
                assert 0 <= time.monotonic() - sent.sent < WAIT_S  # stamped on the one clock of the machine
                conn.send(("done", 0, 1, 1, 0.0, 0.0, {}))
                with pytest.raises(NotReadyError, match=r"which is not a message of dualtrack\.serve\.protocol"):
                    future.result(WAIT_S)
                assert client.phase is Phase.FAILED
                assert "the engine connection failed: the engine process sent tuple ('done', 0," in client.error
                assert conn.poll(WAIT_S)
                with pytest.raises(EOFError):
                    conn.recv()  # the worker hung up
            assert any(r.levelno == logging.ERROR and "sent tuple ('done'" in r.message for r in caplog.records)
        finally:
            client.close(5)
            for conn in accepted:
                conn.close()
            slots.close()


# --- the app over either batcher -----------------------------------------------------------------


@contextmanager
def app_over(kind: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The HTTP app over a Batcher in this process, or over an EngineClient as a worker process has it."""
    if kind == "batcher":
        with TestClient(create_app(engine, max_batch_delay_ms=1)) as http:
            yield http
        return
    with hosting(engine, max_batch_delay_ms=1) as host:
        monkeypatch.setenv(shared.ENGINE_ENV, host.worker_env({"max_batch_delay_ms": 1}))
        with TestClient(worker_app()) as http:
            yield http


@pytest.mark.parametrize("kind", ["batcher", "engine client"])
def test_the_app_answers_the_same_over_a_batcher_and_an_engine_client(kind, engine, rng, monkeypatch) -> None:
    pixels = _images(rng, 1)[0]
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    with app_over(kind, engine, monkeypatch) as http:
        _until(lambda: http.get("/readyz").status_code == 200, "/readyz to answer 200")
        assert isinstance(http.app.state.batcher, BatchQueue)
        ready = http.get("/readyz").json()
        assert ready.pop("jpeg_decoder")["name"] == "cpu"  # a CPU engine: Pillow decodes every image
        assert ready == {
            "status": "ready",
            "model_shape": [64, 64],
            "classes": _classes(engine),
            "batch_sizes": list(engine.batch_sizes),
            "device": "cpu",
        }
        r = http.post("/v1/segment", content=buf.getvalue())
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(imaging.decode_mask_png(r.content), engine.run(pixels[None])["mask"][0])
        r = http.post("/v1/segment", content=b"not an image")
        assert r.status_code == 400 and "image" in r.json()["error"]
        r = http.post("/v1/segment?format=json", content=buf.getvalue())
        assert r.status_code == 200 and sum(r.json()["counts"]) == 64 * 64


def _classes(engine: Engine) -> int:
    (probs,) = (s for s in engine.output_specs if s.name != "mask")
    return probs.shape[-1] if probs.layout == "NHWC" else probs.shape[1]


def test_a_mask_goes_into_its_slot_whole_and_nowhere_else(rng) -> None:
    slots = np.zeros((3, 5000), np.uint8)
    mask = rng.integers(0, 7, (40, 60), dtype=np.uint8)
    dst = slots[1, : mask.size].reshape(mask.shape)
    copy_holding_gil(dst, mask[:, :])
    np.testing.assert_array_equal(dst, mask)
    assert not slots[0].any() and not slots[2].any() and not slots[1, mask.size :].any()
    copy_holding_gil(dst, np.asfortranarray(mask[::-1]))  # any layout of the source
    np.testing.assert_array_equal(dst, mask[::-1])
    with pytest.raises(ValueError, match=r"cannot copy uint8\[60, 40\] into uint8\[40, 60\]"):
        copy_holding_gil(dst, mask.T)


def test_the_frame_reader_reads_what_connection_send_writes_in_order() -> None:
    left, right = Pipe()  # Unix sockets: Connection's own framing
    try:
        frames = FrameReader(right)
        big = bytes(range(256)) * 300  # 76,800 bytes: sent as header and body apart, read in several chunks
        messages = [("small", i) for i in range(50)] + [big, {"after": "big"}]
        sender = threading.Thread(target=lambda: [left.send(m) for m in messages])
        sender.start()
        got = [frames.recv() for _ in messages]
        sender.join()
        assert got == messages
        # The long header (-1, then an 8-byte length) that Connection writes for bodies over 2 GiB.
        body = pickle.dumps(("long header", 7))
        os.write(left.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body)
        assert frames.recv() == ("long header", 7)
        left.send(("cut", 1))
        os.write(left.fileno(), struct.pack("!i", 100) + b"only part of it")
        assert frames.recv() == ("cut", 1)
    finally:
        left.close()
    with pytest.raises(EOFError, match="inside a message"):
        frames.recv()
    right.close()
    left, right = Pipe()
    with left, right:
        os.write(left.fileno(), struct.pack("!i", -7) + b"garbage")
        with pytest.raises(ValueError, match="a frame of -7 bytes"):
            FrameReader(right).recv()
