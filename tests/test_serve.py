"""The HTTP service over real HTTP on loopback, against the real engine of the tiny bundle on the CPU.

Every server here is uvicorn in a thread on 127.0.0.1 with a port the kernel picked. Waits are
bounded; a request that should be stuck in the queue is detected through /metrics, not with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from click.testing import CliRunner
from PIL import Image
from polling import until

from dualtrack import Engine, imaging
from dualtrack.cli import main
from dualtrack.errors import InputError
from dualtrack.serve import Phase, create_app
from dualtrack.serve.loadtest import loopback_target, run_loadtest

WAIT_S = 120.0  # upper bound on any wait (engine load + warmup on a slow CI core included)


# --- helpers -------------------------------------------------------------------------------------


@contextmanager
def serving(app) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    """Run ``app`` under uvicorn on 127.0.0.1 in a thread; yield its base URL. Stops it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _until(lambda: server.started, "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


def _until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    until(condition, what, timeout)


def _answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _wait_ready(base: str) -> None:
    _until(lambda: httpx.get(f"{base}/readyz").status_code == 200, "/readyz to answer 200")


def _serving(proc: subprocess.Popen) -> str:
    """The base URL a `dualtrack serve --port 0` process announces, once it answers /readyz."""
    port = None
    deadline = time.monotonic() + WAIT_S
    while port is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"`dualtrack serve` exited with {proc.wait()}"
        match = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
        port = int(match.group(1)) if match else None
    base = f"http://127.0.0.1:{port}"
    _wait_ready(base)
    return base


def _metric(base: str, name: str) -> float:
    """The value of one unlabelled sample in /metrics."""
    text = httpx.get(f"{base}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _png(rng: np.random.Generator, height: int, width: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _expected_mask(engine: Engine, data: bytes) -> np.ndarray:
    """What the server must answer: engine.run at batch 1 on the resized image, resized back NEAREST."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    _, height, width, _ = engine.input_spec.shape
    # Resize independently of serve.imaging, with the filter its docs promise.
    x = np.asarray(img.resize((width, height), Image.Resampling.BILINEAR), dtype=np.uint8)
    np.testing.assert_array_equal(x, imaging.to_model_input(img, height, width))
    mask = engine.run(x[None])["mask"][0]
    back = Image.fromarray(np.ascontiguousarray(mask)).resize(img.size, Image.Resampling.NEAREST)
    return np.asarray(back)


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_bundle: Path) -> Iterator[Engine]:
    """An engine of its own for expected answers (the server's engine is only called by its batcher)."""
    engine = Engine.load(tiny_bundle, device="cpu")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(tiny_bundle: Path) -> Iterator[tuple[str, object]]:
    """The app loading the bundle itself, with room for 12 concurrent requests and a small body limit."""
    app = create_app(tiny_bundle, max_batch_delay_ms=100, max_queue=32, max_body_bytes=256 * 1024)
    with serving(app) as (base, _server, _thread):
        _wait_ready(base)
        yield base, app


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


# --- answers -------------------------------------------------------------------------------------


def test_png_mask_equals_engine_run(server, reference, rng) -> None:
    base, _ = server
    data = _png(rng, 50, 80)  # not the model's 64x64: both resizes are exercised
    r = httpx.post(f"{base}/v1/segment", content=data, headers={"Content-Type": "image/png"}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    assert "inference;dur=" in r.headers["server-timing"]
    mask = imaging.decode_mask_png(r.content)
    assert mask.shape == (50, 80)
    np.testing.assert_array_equal(mask, _expected_mask(reference, data))


def test_json_counts_sum_to_pixels(server, reference, rng) -> None:
    base, _ = server
    data = _png(rng, 64, 64)
    r = httpx.post(f"{base}/v1/segment?format=json", content=data, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    body = r.json()
    classes = reference.output_specs[[s.name for s in reference.output_specs].index("probs")].shape[1]
    assert body["shape"] == [64, 64] and body["model_shape"] == [64, 64] and body["classes"] == classes
    assert sum(body["counts"]) == 64 * 64 and len(body["counts"]) == classes
    expected = _expected_mask(reference, data)
    assert body["counts"] == np.bincount(expected.ravel(), minlength=classes).tolist()
    assert {"queue", "inference", "request"} <= body["timings_ms"].keys()


def test_multipart_and_jpeg(server, reference, rng) -> None:
    base, _ = server
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    r = httpx.post(f"{base}/v1/segment", files={"image": ("x.jpg", data, "image/jpeg")}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(imaging.decode_mask_png(r.content), _expected_mask(reference, data))


def test_concurrent_requests_are_batched(server, reference, rng) -> None:
    base, _ = server
    images = [_png(rng, 64, 64) for _ in range(12)]
    batches_before = _metric(base, "dualtrack_batch_size_count")
    rows_before = _metric(base, "dualtrack_batch_size_sum")
    start = threading.Barrier(len(images))

    def send(data: bytes) -> httpx.Response:
        start.wait(WAIT_S)
        return httpx.post(f"{base}/v1/segment?format=json", content=data, timeout=WAIT_S)

    with ThreadPoolExecutor(len(images)) as pool:
        answers = list(pool.map(send, images))
    assert [a.status_code for a in answers] == [200] * len(images), [a.text for a in answers]
    batches = _metric(base, "dualtrack_batch_size_count") - batches_before
    rows = _metric(base, "dualtrack_batch_size_sum") - rows_before
    assert rows == len(images)
    assert batches < len(images), "12 concurrent requests ran one per batch: no micro-batching happened"
    assert max(a.json()["batch_size"] for a in answers) > 1
    # Rows are not mixed up: each answer counts its own image's classes (pad rows dropped).
    # A row of a batch of 4 may differ from a batch-1 run in float rounding, so allow 0.5% of pixels.
    for data, answer in zip(images, answers, strict=True):
        expected = np.bincount(_expected_mask(reference, data).ravel(), minlength=answer.json()["classes"])
        assert np.abs(np.array(answer.json()["counts"]) - expected).sum() <= 0.005 * 64 * 64 * 2


# --- bad input, limits, probes -------------------------------------------------------------------


# Bad request bodies (httpx keyword arguments) and the reason each 400 must give; test_serve_ray.py
# sends them to the Ray backend too.
BAD_INPUTS = [
    pytest.param(b"this is not an image\n", {}, r"not a PNG or JPEG image", id="text"),
    pytest.param(b"", {}, r"empty image", id="empty"),
    pytest.param(
        b"\x89PNG\r\n\x1a\n" + b"\0" * 40, {}, r"(corrupt or truncated|not a PNG or JPEG)", id="truncated-png"
    ),
    pytest.param(b"GIF89a" + b"\0" * 20, {}, r"not a PNG or JPEG image", id="gif"),
    pytest.param(
        None, {"files": {"other": ("a.png", b"x", "image/png")}}, r"no field 'image'", id="multipart-no-image"
    ),
    pytest.param(
        None,
        {"data": {"image": "text, not a file"}, "files": {"x": ("x", b"", "text/plain")}},
        r"file part",
        id="multipart-text-field",
    ),
]


@pytest.mark.parametrize(("body", "kwargs", "reason"), BAD_INPUTS)
def test_bad_input_is_400_with_reason(server, body, kwargs, reason) -> None:
    base, _ = server
    r = httpx.post(f"{base}/v1/segment", content=body, timeout=WAIT_S, **kwargs)
    assert r.status_code == 400, r.text
    assert re.search(reason, r.json()["error"]), r.json()
    assert "\n" not in r.json()["error"]


def test_truncated_png_is_400(server, rng) -> None:
    base, _ = server
    data = _png(rng, 64, 64)
    r = httpx.post(f"{base}/v1/segment", content=data[: len(data) // 2], timeout=WAIT_S)
    assert r.status_code == 400
    assert "truncated" in r.json()["error"]


def test_bad_format_404_405_are_json(server, rng) -> None:
    base, _ = server
    r = httpx.post(f"{base}/v1/segment?format=xml", content=_png(rng, 8, 8))
    assert r.status_code == 400 and "format=png" in r.json()["error"]
    assert httpx.get(f"{base}/no/such/page").json()["error"].endswith("Not Found")
    assert httpx.get(f"{base}/v1/segment").status_code == 405


def test_body_over_limit_is_413(server, rng) -> None:
    base, app = server
    limit = app.state.options.max_body_bytes
    r = httpx.post(f"{base}/v1/segment", content=b"\0" * (limit + 1), timeout=WAIT_S)
    assert r.status_code == 413
    assert str(limit) in r.json()["error"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for _ in range(limit // 4096 + 2):
            yield b"\0" * 4096

    r = httpx.post(f"{base}/v1/segment", content=chunked(), timeout=WAIT_S)
    assert r.status_code == 413
    # A body exactly at the limit is read (and refused only as not an image).
    r = httpx.post(f"{base}/v1/segment", content=b"\0" * limit, timeout=WAIT_S)
    assert r.status_code == 400


def test_bad_input_never_takes_the_server_down(server, rng) -> None:
    base, _ = server
    for body in (b"x", b"\xff\xd8\xff" + b"\0" * 100, b"\0" * 10):
        assert httpx.post(f"{base}/v1/segment", content=body).status_code == 400
    assert httpx.get(f"{base}/healthz").json() == {"status": "alive"}
    assert httpx.post(f"{base}/v1/segment", content=_png(rng, 16, 16), timeout=WAIT_S).status_code == 200


def test_metrics_exposition(server, rng) -> None:
    base, _ = server
    httpx.post(f"{base}/v1/segment", content=_png(rng, 32, 32), timeout=WAIT_S)
    httpx.post(f"{base}/v1/segment", content=b"nope")
    r = httpx.get(f"{base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in (
        "dualtrack_requests_total",
        "dualtrack_request_errors_total",
        "dualtrack_request_latency_seconds_bucket",
        "dualtrack_queue_wait_seconds_bucket",
        "dualtrack_batch_size_bucket",
        "dualtrack_inference_seconds_bucket",
        "dualtrack_queue_depth",
        "dualtrack_ready",
    ):
        assert f"\n{name}" in r.text, name
    assert 'dualtrack_requests_total{code="200",endpoint="/v1/segment"}' in r.text
    assert 'dualtrack_request_errors_total{code="400",endpoint="/v1/segment"}' in r.text
    assert _metric(base, "dualtrack_ready") == 1.0


def test_index_page(server) -> None:
    base, _ = server
    r = httpx.get(f"{base}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'id="file"' in r.text and "/v1/segment" in r.text


def test_readyz_is_503_until_loaded_and_warm(tiny_bundle: Path, rng) -> None:
    release = threading.Event()

    def slow_load() -> Engine:  # the real engine; only the moment it loads is held back
        assert release.wait(WAIT_S)
        return Engine.load(tiny_bundle, device="cpu")

    app = create_app(slow_load, max_batch_delay_ms=1)
    with serving(app) as (base, _server, _thread):
        r = httpx.get(f"{base}/readyz")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json() == {"error": "engine is loading"}
        assert httpx.get(f"{base}/healthz").status_code == 200
        r = httpx.post(f"{base}/v1/segment", content=_png(rng, 8, 8))
        assert r.status_code == 503 and "loading" in r.json()["error"]
        assert _metric(base, "dualtrack_ready") == 0.0
        release.set()
        _wait_ready(base)
        assert app.state.batcher.phase is Phase.READY
        assert httpx.post(f"{base}/v1/segment", content=_png(rng, 8, 8), timeout=WAIT_S).status_code == 200


def test_failed_load_is_reported_by_readyz(tmp_path: Path) -> None:
    app = create_app(tmp_path / "no-such-bundle")
    with serving(app) as (base, _server, _thread):
        _until(lambda: app.state.batcher.phase is Phase.FAILED, "the load to fail")
        r = httpx.get(f"{base}/readyz")
        assert r.status_code == 503 and r.json()["error"].startswith("engine failed to load: ")
        assert httpx.get(f"{base}/healthz").status_code == 200


def test_full_queue_is_503_with_retry_after(tiny_bundle: Path, rng) -> None:
    # One waiting request fills the queue; the batch of 4 never fills, so it waits the full delay.
    app = create_app(tiny_bundle, max_batch_delay_ms=3000, max_queue=1, retry_after_s=2)
    with serving(app) as (base, _server, _thread), ThreadPoolExecutor(1) as pool:
        _wait_ready(base)
        first = pool.submit(httpx.post, f"{base}/v1/segment", content=_png(rng, 16, 16), timeout=WAIT_S)
        _until(lambda: _metric(base, "dualtrack_queue_depth") == 1, "the first request to be queued", 10)
        r = httpx.post(f"{base}/v1/segment", content=_png(rng, 16, 16), timeout=WAIT_S)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "2"
        assert "queue is full" in r.json()["error"]
        assert first.result(WAIT_S).status_code == 200


def test_graceful_shutdown_finishes_in_flight_request(tiny_bundle: Path, reference, rng) -> None:
    app = create_app(tiny_bundle, max_batch_delay_ms=1500, max_queue=4)
    data = _png(rng, 64, 64)
    with serving(app) as (base, server, thread), ThreadPoolExecutor(1) as pool:
        _wait_ready(base)
        in_flight = pool.submit(httpx.post, f"{base}/v1/segment", content=data, timeout=WAIT_S)
        _until(lambda: _metric(base, "dualtrack_queue_depth") == 1, "the request to be queued", 10)
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        answer = in_flight.result(WAIT_S)
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(imaging.decode_mask_png(answer.content), _expected_mask(reference, data))
    assert app.state.batcher.phase is Phase.CLOSED


def test_serve_cli_sigterm_finishes_in_flight_request(tiny_bundle: Path, rng) -> None:
    argv = [sys.executable, "-m", "dualtrack.cli", "serve", str(tiny_bundle)]
    argv += ["--port", "0", "--max-batch-delay-ms", "1500", "--log-level", "info"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = _serving(proc)
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, f"{base}/v1/segment", content=_png(rng, 64, 64), timeout=WAIT_S)
            _until(lambda: _metric(base, "dualtrack_queue_depth") == 1, "the request to be queued", 10)
            proc.send_signal(signal.SIGTERM)
            assert in_flight.result(WAIT_S).status_code == 200
        # Uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM.
        assert proc.wait(WAIT_S) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- load test command ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://example.com:8080/", "http://10.0.0.1:8080", "http://127.0.0.1.example.com/", "http://[2001:db8::1]:80/"],
)
def test_loadtest_refuses_non_loopback(url: str, tmp_path: Path) -> None:
    image = tmp_path / "x.png"
    image.write_bytes(b"not read")
    result = CliRunner().invoke(main, ["loadtest", url, "--image", str(image), "--requests", "1"])
    assert result.exit_code == InputError.exit_code, result.output
    assert result.output.count("\n") == 1 and "not loopback" in result.output, result.output
    with pytest.raises(InputError, match="not loopback"):
        loopback_target(url)


def test_loopback_target_accepts_loopback() -> None:
    assert loopback_target("http://127.0.0.1:8080").path == "/v1/segment"
    assert loopback_target("http://127.5.6.7:9/v1/segment?format=json").path == "/v1/segment?format=json"
    assert loopback_target("http://[::1]:8080/").host == "::1"
    assert loopback_target("http://localhost:1/").port == 1


def test_loadtest_against_server(server, rng, tmp_path: Path) -> None:
    base, _ = server
    image = tmp_path / "img.png"
    image.write_bytes(_png(rng, 64, 64))
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(
        main,
        ["loadtest", base, "--image", str(image), "--concurrency", "4", "--requests", "12", "--json", str(report_path)],
    )
    assert result.exit_code == 0, result.output
    assert re.search(r"12 sent, 12 ok\s+errors: none", result.output)
    assert "p50" in result.output and "p99" in result.output and "req/s" in result.output
    assert '"ok": 12' in report_path.read_text()


def test_loadtest_is_bounded_in_seconds(server, rng) -> None:
    base, _ = server
    report = run_loadtest(base, _png(rng, 64, 64), concurrency=2, requests=10**9, duration_s=1.0)
    assert report.ok > 0
    assert report.elapsed_s < 1.0 + 5.0  # stops issuing at 1 s; the last requests take one batch delay
    assert report.sent < 10**9


def _ready(base: str) -> bool:
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
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
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
        _until(lambda: all(_ready(base) for _ in range(16)), "both workers to be ready")
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
        _until(lambda: all(_ready(base) for _ in range(16)), "the new worker to be ready")
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


def _connections_by_process(pids: list[int], port: int) -> dict[int, int]:
    """Established TCP connections to ``port`` each of ``pids`` holds (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    held = {}
    for pid in pids:
        links = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        held[pid] = sum(link.startswith("socket:[") and link[8:-1] in inodes for link in links)
    return held


def _keep_alive(port: int, count: int) -> list[socket.socket]:
    """``count`` connections opened together, each answered once (so a worker holds it)."""
    conns = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(count)]
    for c in conns:
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    for c in conns:
        assert c.recv(4096).startswith(b"HTTP/1.1 200"), "a connection was not answered"
    return conns


def _each_handed_a_connection(port: int, pids: list[int]) -> Callable[[], bool]:
    """A condition: one connection at a time (opened, answered, closed) until each of ``pids`` has held
    one; a worker is handed connections once its app has started and it registered with the balancer."""
    seen: set[int] = set()

    def probe() -> bool:
        (conn,) = _keep_alive(port, 1)
        with conn:
            seen.update(pid for pid, n in _connections_by_process(pids, port).items() if n)
        _until(lambda: sum(_connections_by_process(pids, port).values()) == 0, "the probe to close")
        return seen >= set(pids)

    return probe


def test_serve_cli_workers_hold_equal_shares_of_the_connections(tiny_bundle: Path) -> None:
    """`--workers 3`: 12 connections opened at once land 4 / 4 / 4 (the engine process hands each to the
    worker holding the fewest; uvicorn's shared socket gave 16 / 0 / 0 / 0 to four workers); a worker
    whose event loop stops answering is killed, replaced, and the new one gets the next connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "dualtrack.cli", "serve", str(tiny_bundle), "--workers", "3"]
    argv += ["--port", str(port), "--log-level", "info", "--device", "cpu"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    conns: list[socket.socket] = []
    try:
        base = f"http://127.0.0.1:{port}"
        _until(lambda: len(_children(proc.pid)) == 3 and _answers(base), "three workers")
        workers = _children(proc.pid)
        _until(_each_handed_a_connection(port, workers), "every worker to be handed a connection")
        conns = _keep_alive(port, 12)
        assert sorted(_connections_by_process(workers, port).values()) == [4, 4, 4]
        # A worker frozen (SIGSTOP) no longer answers the balancer's pings: after uvicorn's
        # timeout_worker_healthcheck (5 s) it is killed and another takes its place.
        os.kill(workers[0], signal.SIGSTOP)
        _until(lambda: workers[0] not in _children(proc.pid) and len(_children(proc.pid)) == 3, "a replacement", 60)
        for c in conns:
            c.close()
        _until(lambda: _answers(base), "the service to answer")
        _until(_each_handed_a_connection(port, _children(proc.pid)), "the replacement to be handed a connection")
        conns = _keep_alive(port, 6)  # every worker's connections closed before: 2 / 2 / 2
        assert sorted(_connections_by_process(_children(proc.pid), port).values()) == [2, 2, 2]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) in (0, -signal.SIGTERM)
    finally:
        for c in conns:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read()
    assert "each connection handed to the one holding the fewest" in output, output
    assert f"HTTP worker [{workers[0]}] did not answer" in output, output


# --- images: the CLI's pixels, memory under a burst of large ones ------------------------------


def _displayed_reference(engine: Engine, upright: np.ndarray) -> np.ndarray:
    """The mask for an image whose displayed RGB pixels are ``upright`` (computed in numpy by the test)."""
    _, height, width, _ = engine.input_spec.shape
    x = np.asarray(Image.fromarray(upright).resize((width, height), Image.Resampling.BILINEAR))
    mask = engine.run(x[None])["mask"][0]
    back = Image.fromarray(np.ascontiguousarray(mask)).resize(upright.shape[1::-1], Image.Resampling.NEAREST)
    return np.asarray(back)


def test_cli_and_service_give_the_same_mask_for_16_bit_and_rotated_images(
    server, reference, rng, tiny_bundle: Path, tmp_path: Path
) -> None:
    from test_imaging import raw_png

    base, _ = server
    samples = rng.integers(0, 65536, (48, 70), dtype=np.uint16)
    png16 = raw_png(samples, color_type=0)  # 16-bit grey: was clipped to white everywhere
    stored = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed turned a quarter clockwise: 40 wide, 56 high
    buf = io.BytesIO()
    Image.fromarray(stored).save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    jpeg = buf.getvalue()
    with Image.open(io.BytesIO(jpeg)) as img:
        decoded = np.asarray(img.convert("RGB"))  # the codec's pixels, as stored
    cases = {
        "deep.png": (png16, np.repeat((samples >> 8).astype(np.uint8)[..., None], 3, axis=-1)),
        "turned.jpg": (jpeg, np.ascontiguousarray(np.rot90(decoded, k=-1))),
    }
    for name, (data, upright) in cases.items():
        want = _displayed_reference(reference, upright)
        r = httpx.post(f"{base}/v1/segment", content=data, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        served = imaging.decode_mask_png(r.content)
        path = tmp_path / name
        path.write_bytes(data)
        out = tmp_path / f"{name}.mask.png"
        result = CliRunner().invoke(main, ["run", str(tiny_bundle), str(path), "-o", str(out)])
        assert result.exit_code == 0, result.stderr
        written = np.asarray(Image.open(out))
        assert served.shape == upright.shape[:2], name
        np.testing.assert_array_equal(served, want, err_msg=name)
        np.testing.assert_array_equal(written, served, err_msg=name)


def _rss_mb(pid: int, key: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's RSS from /proc")
def test_memory_stays_bounded_under_a_burst_of_large_images(tiny_bundle: Path) -> None:
    """50 concurrent 8192x8192 palette PNGs (8 KB each on the wire, 320 MB each to decode) at a
    server with 8 image threads: the 1 GiB image budget, not the threads, bounds the peak, and the
    memory goes back to the OS after the burst. ~35 s on 2 cores (the decodes themselves)."""
    buf = io.BytesIO()
    Image.new("P", (8192, 8192)).save(buf, format="PNG")  # the widest decode per wire byte: P -> RGB
    data = buf.getvalue()
    argv = [sys.executable, "-m", "dualtrack.cli", "serve", str(tiny_bundle), "--port", "0"]
    argv += ["--image-threads", "8", "--max-queue", "64", "--log-level", "info"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = _serving(proc)
        assert httpx.post(f"{base}/v1/segment", content=_png(np.random.default_rng(), 64, 64)).status_code == 200
        idle = _rss_mb(proc.pid)

        async def burst() -> list[int]:
            limits = httpx.Limits(max_connections=50)
            async with httpx.AsyncClient(timeout=WAIT_S, limits=limits) as client:
                urls = [f"{base}/v1/segment" + ("?format=json" if i % 2 else "") for i in range(50)]
                answers = await asyncio.gather(*(client.post(url, content=data) for url in urls))
            return [r.status_code for r in answers]

        assert asyncio.run(burst()) == [200] * 50
        peak = _rss_mb(proc.pid, "VmHWM")  # the kernel's high-water mark: no sample can miss the peak
        assert peak <= 2048, f"peak RSS {peak:.0f} MB (idle {idle:.0f} MB)"
        _until(lambda: _rss_mb(proc.pid) < 1.5 * idle, f"RSS back under 1.5x the idle {idle:.0f} MB", 10)
    finally:
        proc.terminate()
        try:
            proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
