"""The service's parts without a model: the mask PNG writer, the batcher's input arrays, the load
test client's HTTP reading. (tests/test_serve.py runs the whole service over HTTP.)"""

from __future__ import annotations

import asyncio
import io
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image
from polling import until

from dualtrack import imaging
from dualtrack.contract.plan import TensorSpec
from dualtrack.errors import ConfigError, InputError
from dualtrack.serve import Batcher, ServeOptions
from dualtrack.serve.batcher import BatchQueue
from dualtrack.serve.loadtest import run_loadtest
from dualtrack.serve.metrics import ServeMetrics
from dualtrack.serve.shared import EngineClient

WAIT_S = 30.0


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()


# --- mask PNG ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (9, 1), (50, 80), (512, 512), (333, 1001)])
def test_mask_png_decodes_to_the_mask(rng, shape) -> None:
    mask = rng.integers(0, 256, shape, dtype=np.uint8)
    mask[: shape[0] // 2] = 1  # runs as well as noise
    png = imaging.encode_mask_png(mask)
    with Image.open(io.BytesIO(png)) as img:
        img.verify()  # chunk CRCs and structure, as Pillow checks them
    with Image.open(io.BytesIO(png)) as img:
        assert (img.format, img.mode, img.size) == ("PNG", "L", (shape[1], shape[0]))
    np.testing.assert_array_equal(imaging.decode_mask_png(png), mask)


def test_mask_png_of_a_strided_view(rng) -> None:
    batch = rng.integers(0, 3, (4, 30, 40), dtype=np.uint8)
    view = batch[1, ::2, 1::3]  # not contiguous
    np.testing.assert_array_equal(imaging.decode_mask_png(imaging.encode_mask_png(view)), view)


def test_model_input_is_the_bilinear_resize(rng) -> None:
    img = Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8))
    x = imaging.to_model_input(img, 64, 32)
    assert x.shape == (64, 32, 3) and x.dtype == np.uint8
    np.testing.assert_array_equal(x, np.asarray(img.resize((32, 64), Image.Resampling.BILINEAR)))


def test_exif_orientation_is_applied(rng) -> None:
    pixels = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° clockwise to display
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", exif=exif.tobytes())
    img = imaging.decode_image(buf.getvalue())
    assert img.size == (20, 30)
    np.testing.assert_array_equal(np.asarray(img), np.rot90(pixels, k=-1))


def test_image_threads_option() -> None:
    assert ServeOptions(image_threads=3).threads == 3
    assert ServeOptions().threads >= 1
    with pytest.raises(ConfigError, match=r"image_threads=-1 is invalid"):
        ServeOptions(image_threads=-1)


# --- batcher -------------------------------------------------------------------------------------


class FakeEngine:
    """The engine surface the batcher uses; records every input it runs and hands out host arrays."""

    def __init__(self, batch_sizes: tuple[int, ...] = (1, 4), hold: threading.Event | None = None) -> None:
        self.input_spec = TensorSpec("image", (1, 4, 5, 3), "uint8")
        self.output_specs = (TensorSpec("mask", (1, 4, 5), "uint8"),)
        self.batch_sizes = batch_sizes
        self.device = "cpu"
        self.last_timings: dict[str, float] = {}
        self.inputs: list[np.ndarray] = []
        self.host_arrays: list[np.ndarray] = []
        self.hold = hold

    def host_array(self, n: int) -> np.ndarray:
        x = np.zeros((n, 4, 5, 3), np.uint8)
        self.host_arrays.append(x)
        return x

    def run(self, x: np.ndarray, outputs: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        if self.hold is not None:
            assert self.hold.wait(WAIT_S)
        self.inputs.append(x.copy())
        assert any(np.shares_memory(x, a) for a in self.host_arrays), "the batch is not one of the host arrays"
        return {"mask": x[..., 0].copy()}  # the mask of an image is its red channel

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def batcher_of(engine: FakeEngine, delay_s: float = 0.2, max_queue: int = 16, **options: object) -> Iterator[Batcher]:
    """A started batcher of ``engine``, ready; ``options`` are Batcher's other keywords."""
    b = Batcher(engine, max_batch_delay_s=delay_s, max_queue=max_queue, **options)  # type: ignore[arg-type]
    b.start()
    deadline = time.monotonic() + WAIT_S
    while b.phase.value != "ready":
        assert time.monotonic() < deadline, b.error
        time.sleep(0.01)
    try:
        yield b
    finally:
        assert b.close(WAIT_S)


def _image(value: int) -> np.ndarray:
    return np.full((4, 5, 3), value, np.uint8)


def test_batch_rows_are_written_into_host_arrays_and_pad_rows_are_zero() -> None:
    engine = FakeEngine()
    with batcher_of(engine) as b, ThreadPoolExecutor(3) as pool:
        # Three at once: one batch of 3, run at the compiled size 4 with one pad row.
        futures = list(pool.map(b.submit, [_image(v) for v in (7, 8, 9)]))
        results = [f.result(WAIT_S) for f in futures]
        assert sorted(int(r.mask[0, 0]) for r in results) == [7, 8, 9]
        assert {(r.batch_size, r.padded_size) for r in results} == {(3, 4)}
        # Then one alone: batch size 1, and the host array of 4 rows it reuses held the earlier images.
        alone = b.submit(_image(5)).result(WAIT_S)
        assert (alone.batch_size, alone.padded_size, int(alone.mask[0, 0])) == (1, 1, 5)
    assert [len(x) for x in engine.inputs] == [4, 1]
    assert not engine.inputs[0][3].any(), "the pad row is not zeros"
    assert len(engine.host_arrays) <= 2


def test_submit_copies_the_image(rng) -> None:
    engine = FakeEngine(batch_sizes=(1,))
    with batcher_of(engine, delay_s=0.0) as b:
        image = _image(3)
        future = b.submit(image)
        image[:] = 200  # the caller reuses its buffer at once
        assert int(future.result(WAIT_S).mask[0, 0]) == 3


def test_cancelled_request_gives_up_its_row() -> None:
    hold = threading.Event()
    engine = FakeEngine(hold=hold)
    with batcher_of(engine, delay_s=0.0) as b:
        first = b.submit(_image(1))  # runs alone, held in engine.run until `hold` is set
        while not first.running():
            time.sleep(0.005)
        queued = [b.submit(_image(v)) for v in (2, 3, 4)]  # the next batch, formed while the first runs
        assert queued[1].cancel()
        hold.set()
        assert int(first.result(WAIT_S).mask[0, 0]) == 1
        assert [int(f.result(WAIT_S).mask[0, 0]) for f in (queued[0], queued[2])] == [2, 4]
        assert queued[2].result(WAIT_S).batch_size == 2
    assert [row[0, 0, 0] for row in engine.inputs[1]] == [2, 4, 0, 0]


def test_queue_limit_counts_requests_not_batches() -> None:
    hold = threading.Event()
    engine = FakeEngine(hold=hold)
    with batcher_of(engine, delay_s=0.0, max_queue=5) as b:
        running = b.submit(_image(1))
        while not running.running():
            time.sleep(0.005)
        waiting = [b.submit(_image(v)) for v in range(5)]  # two batches: 4 rows and 1
        assert b.depth == 5
        with pytest.raises(Exception, match="queue is full"):
            b.submit(_image(9))
        hold.set()
        assert [f.result(WAIT_S).batch_size for f in waiting] == [4, 4, 4, 4, 1]
        assert b.depth == 0


class FakeGpuEngine(FakeEngine):
    """The overlapped surface of a GPU engine (stage, launch, a submission's result) on the CPU. The
    result of launch ``k`` waits for ``gates[k]``: a batch whose masks are still coming down."""

    def __init__(self, gates: list[threading.Event]) -> None:
        super().__init__()
        self.device = "cuda"
        self.gates = gates
        self.launched: list[np.ndarray] = []
        self.into: list[dict[str, list] | None] = []  # what each launch was given

    def stage(self, x: np.ndarray, fill: object = None) -> np.ndarray:
        assert fill is None  # no JPEG rows here
        return x.copy()

    def launch(
        self, staged: np.ndarray, outputs: tuple[str, ...] = (), into: dict[str, list] | None = None
    ) -> _HeldSubmission:
        gate = self.gates[len(self.launched)]
        self.launched.append(staged)
        self.into.append(into)
        mask = staged[..., 0].copy()
        if into is None:
            return _HeldSubmission(gate, mask)
        for row, dst in zip(mask, into["mask"], strict=True):  # as Engine.launch: the rows go into the arrays
            if dst is not None:
                dst[...] = row
        return _HeldSubmission(gate, None)


class _HeldSubmission:
    def __init__(self, gate: threading.Event, mask: np.ndarray | None) -> None:
        self.gate, self.mask = gate, mask

    def result(self) -> dict[str, np.ndarray]:
        assert self.gate.wait(WAIT_S)
        return {} if self.mask is None else {"mask": self.mask}


def test_a_staged_batch_is_launched_while_the_one_ahead_is_still_being_collected() -> None:
    """The GPU must not idle while a batch's masks come down and its requests are answered: the
    launcher queues the next batch behind it at once, and the answers still come in launch order."""
    gates = [threading.Event() for _ in range(3)]
    engine = FakeGpuEngine(gates)
    b = Batcher(engine, max_batch_delay_s=0.01, max_queue=16, jpeg_decoder="cpu")
    b.start()
    try:
        until(lambda: b.phase.value == "ready", "the batcher to be ready", WAIT_S)
        first = b.submit(_image(1))
        until(lambda: len(engine.launched) == 1, "the first batch's launch", WAIT_S)
        second = b.submit(_image(2))
        # The first batch's result is held back: the second is launched all the same.
        until(lambda: len(engine.launched) == 2, "the second launch while the first is uncollected", WAIT_S)
        assert not first.done() and not second.done()
        gates[1].set()  # the second's masks are down first: it is still answered after the first
        time.sleep(0.05)
        assert not second.done()
        gates[0].set()
        assert int(first.result(WAIT_S).mask[0, 0]) == 1
        assert int(second.result(WAIT_S).mask[0, 0]) == 2
        # Where each batch's time went: the first's masks were held back for at least the 50 ms slept.
        phases = {"batch_gather_ms", "batch_stage_ms", "batch_handoff_ms", "batch_gpu_ms"}
        for f in (first, second):
            assert phases <= f.result().timings.keys() and min(f.result().timings[k] for k in phases) >= 0
        assert first.result().timings["batch_gpu_ms"] >= 50
        metrics = ServeMetrics(queue_depth=lambda: 0, ready=lambda: True)
        metrics.observe_batch([first.result()])
        text = metrics.exposition().decode()
        for phase in ("gather", "stage", "handoff", "gpu"):
            assert f'dualtrack_batch_phase_seconds_count{{phase="{phase}"}} 1.0' in text
        assert float(text.split('dualtrack_batch_phase_seconds_sum{phase="gpu"} ')[1].split()[0]) >= 0.05
    finally:
        for gate in gates:
            gate.set()
        assert b.close(WAIT_S)


def test_batches_in_flight_start_a_batch_before_it_is_full_while_the_engine_has_room() -> None:
    """--batches-in-flight 2: while fewer than 2 batches are in the engine (launched, not yet
    answered), the next batch starts with the rows it has, at the smallest compiled size that holds
    them; with 2 in flight it gathers as before (here it would wait out a 60 s delay) until one is
    answered."""
    gates = [threading.Event() for _ in range(3)]
    engine = FakeGpuEngine(gates)  # compiled batch sizes 1 and 4
    with batcher_of(engine, 60.0, jpeg_decoder="cpu", batches_in_flight=2) as b, _opened(gates):
        first = b.submit(_image(1))
        until(lambda: len(engine.launched) == 1, "a lone request's batch to start at once", WAIT_S)
        second = b.submit(_image(2))
        until(lambda: len(engine.launched) == 2, "a second batch while one is in flight", WAIT_S)
        rest = [b.submit(_image(v)) for v in (3, 4)]
        time.sleep(0.2)
        assert len(engine.launched) == 2, "a third batch started with 2 batches in flight"
        gates[0].set()  # the first is answered: one batch in flight, the gathering one starts
        until(lambda: len(engine.launched) == 3, "the gathering batch once a batch was answered", WAIT_S)
        assert [int(row[0, 0, 0]) for row in engine.launched[2]] == [3, 4, 0, 0]
        gates[1].set()
        gates[2].set()
        assert [int(f.result(WAIT_S).mask[0, 0]) for f in (first, second, *rest)] == [1, 2, 3, 4]
        assert [(f.result().batch_size, f.result().padded_size) for f in (first, second, rest[0])] == [
            (1, 1),
            (1, 1),
            (2, 4),
        ]


@contextmanager
def _opened(gates: list[threading.Event]) -> Iterator[None]:
    """Open every gate on the way out, so that the batcher can finish its batches and close."""
    try:
        yield
    finally:
        for gate in gates:
            gate.set()


def test_batches_in_flight_on_the_cpu_start_each_batch_with_what_waits() -> None:
    """On the CPU a batch runs before the next is taken: with --batches-in-flight 1 a lone request
    runs at once (batch size 1) instead of waiting out the 60 s delay for others."""
    engine = FakeEngine()
    with batcher_of(engine, 60.0, batches_in_flight=1) as b:
        result = b.submit(_image(6)).result(WAIT_S)
        assert (result.batch_size, result.padded_size, int(result.mask[0, 0])) == (1, 1, 6)
    with pytest.raises(ValueError, match="batches_in_flight must be >= 0"):
        Batcher(engine, max_batch_delay_s=0.0, max_queue=1, batches_in_flight=-1)
    with pytest.raises(ConfigError, match="batches_in_flight=-1 is invalid"):
        ServeOptions(batches_in_flight=-1)


def test_masks_go_into_the_callers_arrays() -> None:
    """submit(into=...): the mask is written into the caller's array and the result's mask is that
    array. A batch whose every row has one is launched with them (the GPU writes them: Engine.launch's
    ``into``); a batch with a row without one is launched as before and the rows that have one are
    copied into it. A wrong array is refused at submit."""
    gates = [threading.Event() for _ in range(2)]
    for gate in gates:
        gate.set()
    engine = FakeGpuEngine(gates)
    b = Batcher(engine, max_batch_delay_s=0.05, max_queue=16, jpeg_decoder="cpu")
    b.start()
    try:
        until(lambda: b.phase.value == "ready", "the batcher to be ready", WAIT_S)
        arrays = [np.full((4, 5), 99, np.uint8) for _ in range(4)]
        direct = [b.submit(_image(v), into=a) for v, a in zip((3, 5), arrays, strict=False)]
        results = [f.result(WAIT_S) for f in direct]
        assert engine.into[0] is not None and len(engine.into[0]["mask"]) == 4  # padded to the batch size 4
        assert engine.into[0]["mask"][2:] == [None, None]
        for result, array, v in zip(results, arrays, (3, 5), strict=False):
            assert result.mask is array and (array == v).all()
        mixed = [b.submit(_image(7), into=arrays[2]), b.submit(_image(8))]
        assert mixed[0].result(WAIT_S).mask is arrays[2] and (arrays[2] == 7).all()
        assert int(mixed[1].result(WAIT_S).mask[0, 0]) == 8
        assert engine.into[1] is None
        with pytest.raises(InputError, match=r"into is a uint8\[5, 4\] array; a mask needs a writable C-contiguous"):
            b.submit(_image(1), into=np.zeros((5, 4), np.uint8))
        with pytest.raises(InputError, match="writable"):
            b.submit(_image(1), into=np.broadcast_to(np.zeros(5, np.uint8), (4, 5)))  # read-only, not contiguous
    finally:
        assert b.close(WAIT_S)


def test_the_batcher_and_a_workers_engine_client_are_both_batch_queues() -> None:
    # What the app holds in one process and in each worker of `serve --workers N`; test_serve_shared.py
    # runs the same HTTP requests over both.
    assert isinstance(Batcher(FakeEngine(), max_batch_delay_s=0.0, max_queue=1), BatchQueue)
    assert isinstance(EngineClient("/nonexistent/engine.sock", b"key"), BatchQueue)
    assert not isinstance(FakeEngine(), BatchQueue)  # an engine has no phase, submit or life cycle


# --- load test client ----------------------------------------------------------------------------


@contextmanager
def raw_server(answer: bytes, close_after: bool = False) -> Iterator[int]:
    """A loopback HTTP server that reads each request (Content-Length body) and sends ``answer`` as is."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).lower()
                length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def stop() -> None:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    server = loop.run_until_complete(asyncio.start_server(handle, sock=sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


@pytest.mark.parametrize(
    ("answer", "close_after"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", False),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n2;x=y\r\nlo\r\n0\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello until the end", True),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nhello", True),
    ],
    ids=["content-length", "chunked", "close-delimited", "http-1.0"],
)
def test_loadtest_reads_every_answer_framing(answer: bytes, close_after: bool) -> None:
    with raw_server(answer, close_after) as port:
        report = run_loadtest(f"http://127.0.0.1:{port}/", b"x" * 1000, concurrency=3, requests=30, duration_s=WAIT_S)
    assert (report.sent, report.ok, report.errors) == (30, 30, {}), report


def test_loadtest_reports_the_mean_of_each_server_timing_duration() -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
        b'Server-Timing: queue;dur=1.5, inference;desc="engine";dur=3, cache, bad;dur=x, hop_in;dur=0.25\r\n\r\nok'
    )
    with raw_server(answer) as port:
        report = run_loadtest(f"http://127.0.0.1:{port}/", b"x", concurrency=2, requests=10, duration_s=WAIT_S)
    assert report.ok == 10
    # No duration (cache) or a bad one: left out, not counted as zero.
    assert report.server_timing_ms == {"queue": 1.5, "inference": 3.0, "hop_in": 0.25}
    assert report.lines()[-1] == "server says (mean ms)  queue 1.50  inference 3.00  hop_in 0.25"


def test_loadtest_counts_errors_by_status_and_exception() -> None:
    with raw_server(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n") as port:
        report = run_loadtest(f"http://127.0.0.1:{port}/", b"x", concurrency=2, requests=6, duration_s=WAIT_S)
    assert (report.ok, report.errors) == (0, {"503": 6})
    with raw_server(b"SPAM\r\n\r\n") as port:
        report = run_loadtest(f"http://127.0.0.1:{port}/", b"x", concurrency=1, requests=2, duration_s=WAIT_S)
    assert report.errors == {"_BadResponse": 2}
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    report = run_loadtest(f"http://127.0.0.1:{port}/", b"x", concurrency=1, requests=2, duration_s=WAIT_S)
    assert report.errors == {"ConnectionRefusedError": 2}


@pytest.mark.parametrize(
    ("installed", "stack"),
    [({"uvloop", "httptools"}, ("uvloop", "httptools")), (set(), ("asyncio", "h11")), ({"uvloop"}, ("uvloop", "h11"))],
)
def test_server_stack_uses_the_fast_parts_when_installed(monkeypatch, installed, stack) -> None:
    import importlib.util

    from dualtrack.cli import service as cli

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert cli.server_stack() == stack
