"""The service under load against the engine's own batch-8 throughput, measured in the same run.

    python bench/serve_bench.py --bundle .carry/unet --png .carry/sample.png --jpg .carry/sample.jpg --out OUT

1. The engine alone, batch 8: images/s with the input already on the GPU (what bench.py reports, the
   number issue 5 compares with), and numpy in -> mask out, from a host array (the service's path)
   and from a plain numpy array; then from a host array at each of the bundle's batch sizes.
2. One request's CPU stages on this machine (decode, export into the batch row, mask PNG, counts),
   on one thread and on N threads at once: how far they scale with the cores.
3. ``dualtrack serve`` in a child process under ``dualtrack loadtest``'s client (16 connections; --clients
   16 32 runs every case at each), PNG in -> mask PNG out, JPEG in -> JSON out, JPEG in -> mask PNG
   out, then a 64x64 JPEG in -> JSON out, each with the JPEG decoder /readyz reports and the server's RSS (images that
   cost almost nothing: what is left is the service's own cost per request, so this case's rate
   is the most one server process can answer): throughput, latency, errors, the ratio to (1), the
   server's batch statistics (from /metrics), and the CPU time of the client and of each of the
   server's threads (event loop, image threads, batcher), per request and as cores kept busy.
4. Each ``--variant NAME=ARGS``: PNG -> PNG, JPEG -> JSON and JPEG -> PNG on ``dualtrack serve
   ARGS`` (e.g. ``--workers 6``: HTTP processes in front of one engine; their CPU time is summed
   as "worker: THREAD"). ``--only-variants`` skips (3), for sweeps of settings; ``--cases`` picks cases.
   Leading ``NAME=VALUE`` words of ARGS are the server's environment; ``--bundle PATH`` in ARGS
   serves that bundle instead of ``--bundle`` (whose engine alone is (1)).
5. A variant with ``--backend ray`` (the Ray Serve application): CPU time and RSS over Ray's whole
   process tree by process title, and grouped as a request's path (proxy, ingress, replica, metrics,
   Ray's rest: ``ray_path_cpu_ms_per_request``), Ray's processes reaped after the server stops, and the device
   check of its model replicas (``/readyz``'s ``devices`` against ``nvidia-smi``'s compute
   processes: each replica sees one GPU and holds one primary context there, no two share a GPU).
6. ``--profile``: py-spy (when on PATH) samples the server's processes during each timed load test,
   once over the threads that hold the GIL and once over all running threads, without pausing them
   (``--nonblocking``): ``pyspy-<case>-{gil,cpu}.txt`` (collapsed stacks), and each case's entry gets
   ``gil_busy`` (per process: the share of samples in which some thread of it held the GIL).

Writes ``serve_bench-<commit>[-TAG].json`` and ``serve-metrics-<commit>[-TAG].txt``, with a Ray
variant also ``serve_ray-<commit>.json`` (issue 17's ``scaling``: GPUs -> requests/s, JPEG -> JSON
at the most clients); prints a summary last.
Linux only (/proc); the child names its threads (prctl) so their CPU time can be told apart.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import io
import itertools
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

CLIENTS = 16  # what issue 5 measures at; --clients changes it
PORT = 8087
# (name, request path, content type): the image each sends is chosen in under_load.
CASES = (
    ("png_in_png_out", "/v1/segment", "image/png"),
    ("jpeg_in_json_out", "/v1/segment?format=json", "image/jpeg"),
    ("jpeg_in_png_out", "/v1/segment", "image/jpeg"),
    ("tiny_jpeg_in_json_out", "/v1/segment?format=json", "image/jpeg"),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--png", type=Path, required=True, help="the PNG sent in the PNG -> PNG case")
    p.add_argument("--jpg", type=Path, required=True, help="the JPEG sent in the JPEG -> JSON case")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--duration-s", type=float, default=15.0, help="per load test")
    p.add_argument("--iters", type=int, default=100, help="engine-only timed runs per variant")
    p.add_argument("--commit", default=os.environ.get("DUALTRACK_COMMIT", "unknown"))
    p.add_argument("--serve-arg", action="append", default=[], help="extra `dualtrack serve` argument (repeatable)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="also run PNG -> PNG, JPEG -> JSON and JPEG -> PNG on `dualtrack serve ARGS`, e.g. "
        "'workers_6=--workers 6 --max-batch-delay-ms 8' (repeatable; the cases are named CASE_NAME); leading "
        "NAME=VALUE words set the server's environment, e.g. 'lanes_4=DUALTRACK_JPEG_LANES=4 --workers 4'",
    )
    p.add_argument("--only-variants", action="store_true", help="skip the default cases: a sweep of --variant")
    p.add_argument(
        "--cases",
        nargs="+",
        choices=[c[0] for c in CASES],
        help="run only these cases (default: all; a --variant runs the first three)",
    )
    p.add_argument("--profile", action="store_true", help="py-spy the server during each timed load test (item 6)")
    p.add_argument("--tag", default="", help="appended to the result file names")
    p.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=[CLIENTS],
        help="concurrent closed-loop connections of the load test; several values run every case at each",
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "commit": args.commit,
        "machine": machine(),
        "device": args.device,
        "clients": args.clients,
    }
    report["engine"], mask = engine_alone(args.bundle, args.device, args.iters, args.png.read_bytes())
    report["machine"]["commit"] = args.commit
    report["stages"] = stages(args.png.read_bytes(), args.jpg.read_bytes(), mask)
    report["loadtests"], metrics_text, report["device_checks"] = under_load(args, report["engine"]["reference_img_s"])
    name = args.commit[:10] + (f"-{args.tag}" if args.tag else "")
    if report["device_checks"]:
        write_ray_summary(args, report)
    (args.out / f"serve-metrics-{name}.txt").write_text(metrics_text)
    path = args.out / f"serve_bench-{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)
    print(f"wrote {path}")


def machine() -> dict[str, Any]:
    import PIL

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines() if "model name" in line), "?"
    )
    gpu = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "gpu": gpu,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pillow": PIL.__version__,
    }


# -- 1. the engine alone --------------------------------------------------------------------------


def engine_alone(bundle: Path, device: str, iters: int, png: bytes) -> tuple[dict[str, Any], np.ndarray]:
    """Batch-8 timings, and the model's mask of ``png`` (what the stages below encode)."""
    from dualtrack import imaging
    from dualtrack.runtime.engine import Engine

    engine = Engine.load(bundle, device=device)
    try:
        engine.warmup()
        batch = 8 if 8 in engine.batch_sizes else max(engine.batch_sizes)
        rng = np.random.default_rng(0)
        pinned = engine.host_array(batch)
        pinned[:] = rng.integers(0, 256, pinned.shape, dtype=np.uint8)
        _, height, width, _ = engine.input_spec.shape
        pinned[0] = imaging.to_model_input(imaging.decode_image(png), height, width)
        mask = engine.run(pinned, outputs=("mask",))["mask"][0]
        plain = np.array(pinned)
        out: dict[str, Any] = {"batch": batch}
        if device == "cuda":
            be = engine.backend
            on_gpu = be.from_host(pinned)

            def device_run() -> None:
                engine.run_batch(on_gpu, batch)
                be.stream.synchronize()

            out["input_on_gpu"] = _time_batches(device_run, batch, iters)
        out["host_array_in_mask_out"] = _time_batches(lambda: engine.run(pinned, outputs=("mask",)), batch, iters)
        out["numpy_in_mask_out"] = _time_batches(lambda: engine.run(plain, outputs=("mask",)), batch, iters)
        reference = out.get("input_on_gpu", out["host_array_in_mask_out"])
        out["reference_img_s"] = reference["img_s"]
        for k, v in out.items():
            if isinstance(v, dict):
                print(f"[engine] batch {batch}, {k}: {v['median_ms']:.3f} ms = {v['img_s']:.1f} img/s")
        # What a batch that starts before it is full costs (serve --batches-in-flight): each size.
        out["host_array_by_batch"] = {}
        for size in sorted(engine.batch_sizes):
            part = pinned[:size]
            timed = _time_batches(lambda part=part: engine.run(part, outputs=("mask",)), size, iters)
            out["host_array_by_batch"][str(size)] = timed
            ms, rate = timed["median_ms"], timed["img_s"]
            print(f"[engine] batch {size}, host array in, mask out: {ms:.3f} ms = {rate:.1f} img/s")
        return out, mask
    finally:
        engine.close()


def _time_batches(fn: Any, batch: int, iters: int) -> dict[str, float]:
    for _ in range(10):
        fn()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    median = statistics.median(ms)
    return {
        "median_ms": round(median, 3),
        "p90_ms": round(float(np.percentile(ms, 90)), 3),
        "img_s": round(batch * 1e3 / median, 1),
    }


# -- 2. the CPU stages of one request ---------------------------------------------------------------


def stages(png: bytes, jpg: bytes, mask: np.ndarray) -> dict[str, Any]:
    """ms per call on one thread; requests' image work per second on 1, 4, 8 and all-core threads."""
    from dualtrack import imaging

    img = imaging.decode_image(png)
    row = np.zeros((img.height, img.width, 3), np.uint8)
    mask = imaging.mask_to_size(mask, img.height, img.width)

    def export() -> None:
        row[:] = imaging.to_model_input(img, img.height, img.width)

    one = {
        "decode_png": _per_call_ms(lambda: imaging.decode_image(png)),
        "decode_jpeg": _per_call_ms(lambda: imaging.decode_image(jpg)),
        "export_into_row": _per_call_ms(export),
        "encode_mask_png": _per_call_ms(lambda: imaging.encode_mask_png(mask)),
        "class_counts": _per_call_ms(lambda: imaging.class_counts(mask, 2)),
    }

    def png_request() -> None:  # all of a PNG -> PNG request's image work
        row[:] = imaging.to_model_input(imaging.decode_image(png), img.height, img.width)
        imaging.encode_mask_png(mask)

    def json_request() -> None:
        row[:] = imaging.to_model_input(imaging.decode_image(jpg), img.height, img.width)
        imaging.class_counts(mask, 2)

    scaling = {}
    for name, fn in (("png_request", png_request), ("json_request", json_request)):
        scaling[name] = {str(n): _throughput(fn, n) for n in sorted({1, 4, 8, len(os.sched_getaffinity(0))})}
    for k, v in one.items():
        print(f"[stages] {k}: {v:.3f} ms")
    for name, by_threads in scaling.items():
        print(f"[stages] {name}: image work per second, by threads: {by_threads}")
    return {"one_thread_ms": one, "ops_per_s_by_threads": scaling}


def _per_call_ms(fn: Any, seconds: float = 0.5) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return round((time.perf_counter() - t0) / n * 1e3, 3)


def _throughput(fn: Any, threads: int, seconds: float = 1.5) -> float:
    stop = time.perf_counter() + seconds
    counts = [0] * threads

    def work(i: int) -> None:
        while time.perf_counter() < stop:
            fn()
            counts[i] += 1

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return round(sum(counts) / (time.perf_counter() - t0), 1)


# -- 3. the service under load ------------------------------------------------------------------------


def under_load(args: argparse.Namespace, reference_img_s: float) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """The cases on a plain `dualtrack serve` (unless --only-variants), then on each --variant; and
    each `--backend ray` variant's device check (:func:`_device_check`), by variant name."""
    images = {"png": args.png.read_bytes(), "jpeg": args.jpg.read_bytes(), "tiny": _tiny_jpeg(args.jpg)}
    cases = [(name, images[name.split("_")[0]], path, kind) for name, path, kind in CASES]
    results, metrics_text, checks = [], "", {}
    if not args.only_variants:
        chosen = [c for c in cases if not args.cases or c[0] in args.cases]
        results, metrics_text, _ = _serve_and_load(args, reference_img_s, chosen, {})
    for variant in args.variant:
        name, _, argv = variant.partition("=")
        vcases = [(f"{c[0]}_{name}", *c[1:]) for c in cases[:3] if not args.cases or c[0] in args.cases]
        words = argv.split()  # leading NAME=VALUE words are the server's environment, the rest its arguments
        assigns = list(itertools.takewhile(lambda w: re.match(r"[A-Z_][A-Z0-9_]*=", w), words))
        env = dict(w.split("=", 1) for w in assigns)
        more, metrics_text, check = _serve_and_load(args, reference_img_s, vcases, env, words[len(assigns) :])
        for entry in more:
            entry["variant"] = name
        results += more
        if check is not None:
            checks[name] = check
    return results, metrics_text, checks


def _serve_and_load(
    args: argparse.Namespace,
    reference_img_s: float,
    cases: list[tuple[str, bytes, str, str]],
    env: dict[str, str],
    extra: tuple[str, ...] | list[str] = (),
) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None]:
    """Start `dualtrack serve ARGS`, run ``cases`` at each client count, stop it. Under ``--backend
    ray`` the server is Ray's process tree (CPU time and RSS are summed over it by process title,
    and whatever of it outlives the server is killed) and the placement of its model replicas is
    checked (:func:`_device_check`, the third value; None otherwise)."""
    from dualtrack.serve.loadtest import run_loadtest

    on_ray = _flag(extra, "--backend") == "ray"
    cpu_of = _tree_cpu if on_ray else _thread_cpu
    check = None
    tree: set[int] = set()

    extra = list(extra)
    bundle = args.bundle
    if "--bundle" in extra:  # the variant's own bundle
        at = extra.index("--bundle")
        bundle = Path(extra[at + 1])
        del extra[at : at + 2]
    cmd = [sys.executable, __file__, "--child", "serve", str(bundle), "--device", args.device]
    cmd += ["--port", str(PORT), "--log-level", "warning", *args.serve_arg, *extra]
    log = io.StringIO()
    server = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}
    )
    reader = threading.Thread(target=lambda: [log.write(line) for line in server.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()
    base = f"http://127.0.0.1:{PORT}"
    results = []
    try:
        t0 = time.monotonic()
        _wait_ready(base, server)
        if on_ray:  # each model replica reports where its engine runs with its metrics (every 1.25 s)
            ready = _wait_devices(base, _flag(extra, "--replicas") or "1")
        else:
            ready = json.loads(urllib.request.urlopen(f"{base}/readyz", timeout=10).read())
        decoder = ready.get("jpeg_decoder", {"name": "cpu", "reason": "this dualtrack reports none"})
        print(f"[serve] ready after {time.monotonic() - t0:.1f} s {env or ''}; JPEG decoder {decoder}")
        for (case, body, path, content_type), clients in ((c, n) for c in cases for n in args.clients):
            name = f"{case}_c{clients}"
            run_loadtest(base + path, body, content_type=content_type, concurrency=clients, requests=400)  # warm
            before, cpu0, usage0 = _metrics(base), cpu_of(server.pid), resource.getrusage(resource.RUSAGE_SELF)
            spies = _start_spies(args, server.pid, name) if args.profile else []
            spread: list[int] = []  # the clients' connections held by each process, midway through
            sampler = threading.Timer(args.duration_s / 2, _sample_connections, [server.pid, spread])
            sampler.start()
            rep = run_loadtest(
                base + path,
                body,
                content_type=content_type,
                concurrency=clients,
                requests=10**6,
                duration_s=args.duration_s,
            )
            after, cpu1, usage1 = _metrics(base), cpu_of(server.pid), resource.getrusage(resource.RUSAGE_SELF)
            sampler.cancel()
            sampler.join()
            for line in rep.lines():
                print(f"[{name}] {line}")
            gil_busy = _finish_spies(spies)
            ok = max(rep.ok, 1)
            client_s = usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime
            server_s = {k: cpu1[k] - cpu0.get(k, 0) for k in cpu1 if cpu1[k] > cpu0.get(k, 0)}
            server_ms = {k: round(v * 1e3 / ok, 3) for k, v in server_s.items()}
            batches = after["batches"] - before["batches"]
            entry = {
                "case": name,
                "clients": clients,
                "jpeg_decoder": decoder,
                "backend": "ray" if on_ray else "dualtrack",
                "server_rss_mb": _tree_rss_mb(server.pid)["total"] if on_ray else _rss_mb(server.pid),
                "image_bytes": len(body),
                # How the load test's connections were spread over the server's processes (most first):
                # each HTTP process answers its own connections one after another.
                "connections_per_process": spread,
                "report": rep.to_json(),
                "ratio": round(rep.throughput_rps / reference_img_s, 4),
                "cpu_ms_per_request": {"client": round(client_s * 1e3 / ok, 3), "server": server_ms},
                "server_cpu_ms_per_request": round(sum(server_ms.values()), 3),
                "cores_busy": {
                    "client": round(client_s / rep.elapsed_s, 2),
                    **{k: round(v / rep.elapsed_s, 2) for k, v in server_s.items()},
                },
                "batches": {
                    "count": batches,
                    "mean_rows": _ratio(after["rows"] - before["rows"], batches),
                    "padded_rows": after["padded"] - before["padded"],
                    "engine_run_mean_ms": _ratio(1e3 * (after["inference_s"] - before["inference_s"]), batches),
                    "track_a_mean_ms": _ratio(1e3 * (after["track_a_s"] - before["track_a_s"]), batches),
                    "track_b_mean_ms": _ratio(1e3 * (after["track_b_s"] - before["track_b_s"]), batches),
                    "queue_wait_mean_ms": _ratio(
                        1e3 * (after["queue_wait_s"] - before["queue_wait_s"]), after["queued"] - before["queued"]
                    ),
                    # Where a batch's time goes (serve/batcher.py), mean ms per batch.
                    "phase_mean_ms": {
                        p: _ratio(1e3 * (after[f"phase_{p}_s"] - before[f"phase_{p}_s"]), batches) for p in PHASES
                    },
                },
                # The app's own wall time per POST (body read to answer), against the client's latency:
                # the difference is HTTP and the loopback; the handler's minus queue and run is the hand-overs.
                "handler_mean_ms": _ratio(
                    1e3 * (after["handler_s"] - before["handler_s"]), after["handled"] - before["handled"]
                ),
            }
            if spies:
                entry["gil_busy"] = gil_busy
                print(f"[{name}] GIL held (share of samples, by process): {gil_busy}")
            print(f"[{name}] batches {entry['batches']}; handler mean {entry['handler_mean_ms']} ms")
            print(f"[{name}] client connections per server process: {spread}")
            print(f"[{name}] CPU ms per request: client {entry['cpu_ms_per_request']['client']}, server {server_ms}")
            print(f"[{name}] cores kept busy: {entry['cores_busy']}")
            if on_ray:
                entry["server_rss_mb_by_process"] = _tree_rss_mb(server.pid)
                entry["cpu_accounting"] = RAY_CPU_NOTE
                entry["ray_path_cpu_ms_per_request"] = ray_path(server_ms)
                print(f"[{name}] Ray request path, CPU ms per request: {entry['ray_path_cpu_ms_per_request']}")
            results.append(entry)
        if on_ray:  # while the replicas hold their engines: what they report, and what nvidia-smi sees
            tree = set(_descendants(server.pid))
            ready = json.loads(urllib.request.urlopen(f"{base}/readyz", timeout=10).read())
            check = _device_check(ready, tree, int(_flag(extra, "--replicas-per-gpu") or "1"))
            print(f"[serve] device check: {json.dumps(check)}")
        metrics_text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    finally:
        tree |= set(_descendants(server.pid)) if on_ray and server.poll() is None else set()
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(5)
        if on_ray:
            _reap(tree)
        tail = log.getvalue().strip().splitlines()[-15:]
        print("[serve] server output (last lines):\n  " + "\n  ".join(tail))
    return results, metrics_text, check


PYSPY_RATE = 200  # samples per second


def _start_spies(args: argparse.Namespace, pid: int, name: str) -> list[tuple[subprocess.Popen[bytes], Path, str, int]]:
    """py-spy over ``pid`` and its children for the timed load test: GIL holders, and all running threads."""
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        print("[serve] --profile: py-spy is not on PATH; no profile")
        return []
    seconds = max(1, int(args.duration_s) - 2)
    spies = []
    for kind in ("gil", "cpu"):
        path = args.out / f"pyspy-{name}-{kind}.txt"
        cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--threads", "--format", "raw"]
        cmd += ["--rate", str(PYSPY_RATE), "--duration", str(seconds), "-o", str(path)]
        cmd += ["--gil"] if kind == "gil" else []
        spies.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), path, kind, seconds))
    return spies


def _finish_spies(spies: list[tuple[subprocess.Popen[bytes], Path, str, int]]) -> dict[str, float]:
    """Wait for the samplers; from the GIL profile, the share of sampling instants in which some thread
    of each process held the GIL (samples of one instant are counted once per process)."""
    busy: dict[str, float] = {}
    for spy, path, kind, seconds in spies:
        try:
            _, err = spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
        if spy.returncode != 0 or not path.exists():
            print(f"[serve] py-spy ({kind}) failed: {err.decode(errors='replace').strip()[-300:]}")
            continue
        if kind != "gil":
            continue
        per_process: collections.Counter[str] = collections.Counter()
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                procs = [f for f in stack.split(";") if f.startswith("process ")]  # a child nests in its parent
                per_process[procs[-1][:60] if procs else "?"] += int(count)
        # One thread holds a process's GIL at a time: its samples over the instants sampled.
        busy = {proc: round(n / (seconds * PYSPY_RATE), 3) for proc, n in per_process.most_common()}
    return busy


def _rss_mb(pid: int) -> float | None:
    """Resident memory of the server process (VmRSS), MiB."""
    match = re.search(r"^VmRSS:\s+(\d+) kB", _read(f"/proc/{pid}/status"), re.MULTILINE)
    return round(int(match.group(1)) / 1024, 1) if match else None


def _tiny_jpeg(jpg: Path) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    with Image.open(jpg) as img:
        img.convert("RGB").resize((64, 64)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _wait_ready(base: str, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"`dualtrack serve` exited with {server.returncode} before it was ready")
        try:
            if urllib.request.urlopen(f"{base}/readyz", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("`dualtrack serve` was not ready within 300 s")


# dualtrack_batch_phase_seconds (serve/batcher.py)
PHASES = ("gather", "stage", "slot", "rows", "decode", "sync", "handoff", "gpu")
_SAMPLES = {
    "batches": "dualtrack_batch_size_count",
    "rows": "dualtrack_batch_size_sum",
    "padded": "dualtrack_padded_rows_total",
    "inference_s": "dualtrack_inference_seconds_sum",
    "queue_wait_s": "dualtrack_queue_wait_seconds_sum",
    "queued": "dualtrack_queue_wait_seconds_count",
    "track_a_s": 'dualtrack_track_seconds_sum{track="a"}',
    "track_b_s": 'dualtrack_track_seconds_sum{track="b"}',
    "handler_s": "dualtrack_request_latency_seconds_sum",
    "handled": "dualtrack_request_latency_seconds_count",
    **{f"phase_{p}_s": f'dualtrack_batch_phase_seconds_sum{{phase="{p}"}}' for p in PHASES},
}


def _metrics(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    out = {}
    for key, name in _SAMPLES.items():
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        out[key] = float(match.group(1)) if match else 0.0
    return out


def _thread_cpu(pid: int, prefix: str = "") -> dict[str, float]:
    """CPU seconds by thread name (the event loop is the process's main thread), then the same for
    its child processes (`serve --workers N`: the HTTP workers), summed over them as "worker: NAME"."""
    tick = os.sysconf("SC_CLK_TCK")
    out: collections.Counter[str] = collections.Counter()
    children: list[str] = []
    for tid in _listdir(f"/proc/{pid}/task"):
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        children += _read(f"/proc/{pid}/task/{tid}/children").split()
        try:
            name = "event loop" if tid == str(pid) else stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[prefix + name.rstrip("_0123456789")] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (ValueError, IndexError):  # the thread ended while being read
            continue
    if not prefix:
        for child in children:
            out.update(_thread_cpu(int(child), "worker: "))
    return dict(out)


# -- the Ray backend (`--variant 'NAME=--backend ray ...'`) -----------------------------------------

RAY_CPU_NOTE = (
    "summed over the process tree of `dualtrack serve --backend ray` (Ray's gcs_server, raylet and "
    "workers are its descendants), by process title; a process that left the tree (reparented) is "
    "not counted, and 'worker: NAME' threads are not told apart inside a Ray process"
)


# Ray's processes by title, grouped the way issue 41 counts a request's CPU: the rest is Ray's own
# (GCS, raylet, controller, dashboard agent, the driver), a cost per second spread over the requests.
RAY_PATH = (
    ("proxy", ("ray::ProxyActor", "haproxy", "ray::HAProxyManager")),
    ("ingress", ("ray::ServeReplica:dualtrack:DualtrackIngress",)),
    ("replica", ("ray::ServeReplica:dualtrack:DualtrackModel",)),
    ("metrics", ("ray::ServeReplica:dualtrack:DualtrackMetrics",)),
)


def ray_path(server_ms: dict[str, float]) -> dict[str, float]:
    """A Ray variant's server CPU ms per request as proxy, ingress, replica, metrics and Ray's rest."""
    out = {part: round(sum(server_ms.get(t, 0.0) for t in titles), 3) for part, titles in RAY_PATH}
    out["ray_rest"] = round(sum(server_ms.values()) - sum(out.values()), 3)
    return out


def _flag(argv: tuple[str, ...] | list[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--name VALUE`` or ``--name=VALUE``), or None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of its threads, recursively)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for tid in _listdir(f"/proc/{parent}/task"):
            children = [int(c) for c in _read(f"/proc/{parent}/task/{tid}/children").split()]
            out += children
            todo += children
    return out


def _sample_connections(pid: int, into: list[int]) -> None:
    into.extend(_connections_by_process(pid))


def _connections_by_process(pid: int, port: int = PORT) -> list[int]:
    """How many established TCP connections to ``port`` each of ``pid`` and its descendants holds, most
    first (/proc/net/tcp{,6} by socket inode, against each process's open files)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(table).splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    counts = []
    for proc in (pid, *_descendants(pid)):
        held = 0
        for fd in _listdir(f"/proc/{proc}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{proc}/fd/{fd}")
                held += link.startswith("socket:[") and link[8:-1] in inodes
        if held:
            counts.append(held)
    return sorted(counts, reverse=True)


def _title(pid: int) -> str:
    """A process's name for the tables: Ray's title for its workers (``ray::ServeReplica:APP:DEPLOYMENT``),
    else the executable's name."""
    argv0 = _read(f"/proc/{pid}/cmdline").split("\0", 1)[0]
    if argv0.startswith("ray::"):  # the title carries the method running now: ray::ProxyActor.receive_asgi_messages
        return argv0.split(" ", 1)[0].split(".", 1)[0]
    stat = _read(f"/proc/{pid}/stat")
    return stat[stat.find("(") + 1 : stat.rfind(")")] if stat else "?"


def _tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid`` ("dualtrack serve") and each of its descendants, summed by title."""
    tick = os.sysconf("SC_CLK_TCK")
    out: collections.Counter[str] = collections.Counter()
    for proc in (pid, *_descendants(pid)):
        stat = _read(f"/proc/{proc}/stat")
        try:
            fields = stat[stat.rindex(")") + 2 :].split()
            name = "dualtrack serve" if proc == pid else _title(proc)
            out[name] += (int(fields[11]) + int(fields[12])) / tick
        except (ValueError, IndexError):  # the process ended while being read
            continue
    return dict(out)


def _tree_rss_mb(pid: int) -> dict[str, float]:
    """Resident memory of ``pid`` and its descendants by title, MiB, and their ``total``."""
    out: collections.Counter[str] = collections.Counter()
    for proc in (pid, *_descendants(pid)):
        rss = _rss_mb(proc)
        if rss is not None:
            out["dualtrack serve" if proc == pid else _title(proc)] += rss
    return {k: round(v, 1) for k, v in {**out, "total": sum(out.values())}.items()}


def _wait_devices(base: str, replicas: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """/readyz once 8 answers in a row list every model replica's device (each reports it with its metrics).

    Each ingress replica answers /readyz from its own view of the model deployment, so one that has
    not yet seen it ready answers 503 after another answered 200: retried until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    streak = 0  # consecutive complete answers: Ray's proxy spreads them over the ingress replicas
    while True:
        try:
            ready = json.loads(urllib.request.urlopen(f"{base}/readyz", timeout=10).read())
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise
            ready = {}
        streak = streak + 1 if len(ready.get("devices", ())) >= int(replicas) else 0
        if streak >= 8 or time.monotonic() > deadline:
            return ready
        time.sleep(0.25)


def _device_check(ready: dict[str, Any], tree: set[int], per_gpu: int = 1) -> dict[str, Any]:
    """Does each model replica's engine own one GPU, and no more than ``per_gpu`` replicas share one
    (``--replicas-per-gpu``)?

    From the replicas (``/readyz``'s ``devices``: their CUDA_VISIBLE_DEVICES and what their CUDA
    driver reports) and from outside (``nvidia-smi``'s compute processes: every process holding a
    context on a GPU, once per GPU): each replica sees one device, holds exactly one active primary
    context, on that device, and its engine runs in that context; nvidia-smi lists the replica's
    process on that GPU alone, and no other process of the Ray tree on any GPU.
    """
    devices = ready.get("devices", [])
    gpus = _smi(["--query-gpu=index,uuid,pci.bus_id,name"])
    apps = _smi(["--query-compute-apps=pid,gpu_uuid,used_memory"])
    uuids = {g[1] for g in gpus}
    problems = []
    if not devices:
        problems.append("/readyz lists no model replica's device")
    for d in devices:
        who = f"replica pid {d.get('pid')}"
        if d.get("device") != "cuda" or "error" in d:
            problems.append(f"{who}: engine on {d.get('device')} {d.get('error', '')}".strip())
            continue
        if d.get("visible_devices") != 1:
            seen = f"{d.get('visible_devices')} devices (CUDA_VISIBLE_DEVICES={d.get('cuda_visible_devices')})"
            problems.append(f"{who} sees {seen}")
        if d.get("active_primary_contexts") != [d.get("index")]:
            active = d.get("active_primary_contexts")
            problems.append(f"{who}: active primary contexts on devices {active}, not on [{d.get('index')}] alone")
        if not d.get("engine_context_is_primary"):
            problems.append(f"{who}: the engine's context is not the device's primary context")
        if gpus and d.get("uuid") not in uuids:
            problems.append(f"{who}: {d.get('uuid')} is none of nvidia-smi's GPUs")
        on = [a[1] for a in apps if a[0] == str(d.get("pid"))]
        if apps and on != [d.get("uuid")]:
            problems.append(f"{who}: nvidia-smi lists it on {on}, not once on {d.get('uuid')}")
    held = [d.get("uuid") for d in devices]
    if any(held.count(u) > per_gpu for u in held):
        problems.append(f"more than {per_gpu} replica(s) on one GPU: {held}")
    replicas = {str(d.get("pid")) for d in devices}
    strays = [a for a in apps if a[0] not in replicas and int(a[0]) in tree]
    if strays:
        problems.append(f"other processes of the Ray tree hold a GPU context: {strays}")
    return {
        "devices": devices,
        "nvidia_smi_gpus": gpus,
        "nvidia_smi_compute_apps": apps,
        # Where nvidia-smi lists no process (a container that hides other PID namespaces), the
        # outside half of the check did not run: the replicas' own reports remain.
        "outside_check": "ran" if apps else "nvidia-smi listed no compute process",
        "ok": not problems,
        "problems": problems,
    }


def _smi(query: list[str]) -> list[list[str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[f.strip() for f in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def _reap(pids: set[int], timeout_s: float = 30.0) -> None:
    """Wait for Ray's processes of a stopped server to exit; kill (by pid) those still there after."""
    deadline = time.monotonic() + timeout_s
    alive = {p for p in pids if os.path.exists(f"/proc/{p}")}
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = {p for p in alive if os.path.exists(f"/proc/{p}") and "zombie" not in _read(f"/proc/{p}/status")}
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    if alive:
        print(f"[serve] killed {len(alive)} Ray processes left after the server stopped: {sorted(alive)}")


def write_ray_summary(args: argparse.Namespace, report: dict[str, Any]) -> Path:
    """``serve_ray-<commit>.json``: every case's numbers, the device checks, and ``scaling`` (GPUs ->
    requests/s of the Ray application, JPEG -> JSON at the most clients; issue 17's format; where
    several variants have the same GPU count, the first one's, and ``scaling_by_variant`` has each)."""
    gpu = report["machine"]["gpu"].splitlines()[0] if report["machine"]["gpu"] else "?"
    name, _, driver = gpu.partition(",")
    keep = ("throughput_rps", "latency_ms", "errors", "ok", "elapsed_s")
    cases = [
        {
            "case": e["case"],
            "variant": e.get("variant"),
            "backend": e["backend"],
            "clients": e["clients"],
            **{k: e["report"].get(k) for k in keep},
            "ratio_to_engine": e["ratio"],
            "server_rss_mb": e["server_rss_mb"],
            "server_cpu_ms_per_request": e["server_cpu_ms_per_request"],
            "ray_path_cpu_ms_per_request": e.get("ray_path_cpu_ms_per_request"),
            "cores_busy": e["cores_busy"],
            "batches": e["batches"],
        }
        for e in report["loadtests"]
    ]
    by_variant: dict[str, dict[str, float]] = {}
    for variant, check in report["device_checks"].items():
        rows = [c for c in cases if c["variant"] == variant and c["case"].startswith("jpeg_in_json_out")]
        if rows:
            best = max(rows, key=lambda c: c["clients"])
            by_variant[variant] = {str(max(len(check["devices"]), 1)): best["throughput_rps"]}
    scaling: dict[str, float] = {}
    for gpus_rps in by_variant.values():  # per GPU count, the first variant's (the command line's order)
        for gpus, rps in gpus_rps.items():
            scaling.setdefault(gpus, rps)
    out = {
        "commit": args.commit,
        "gpu": name.strip(),
        "driver": driver.strip(),
        "machine": report["machine"],
        "engine_alone_img_s": report["engine"]["reference_img_s"],
        "clients": args.clients,
        "duration_s": args.duration_s,
        "cases": cases,
        "scaling": scaling,
        "scaling_by_variant": by_variant,
        "device_checks": report["device_checks"],
        "cpu_accounting": RAY_CPU_NOTE,
    }
    path = args.out / f"serve_ray-{args.commit[:10]}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}: scaling {scaling}")
    return path


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # the process ended
        return []


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def print_summary(report: dict[str, Any]) -> None:
    ref = report["engine"]["reference_img_s"]
    print(f"\nengine alone, batch {report['engine']['batch']}: {ref:.1f} img/s (the reference)")
    for entry in report["loadtests"]:
        rep = entry["report"]
        lat = rep["latency_ms"]
        print(
            f"{entry['case']:34s} {rep['throughput_rps']:8.1f} req/s = {100 * entry['ratio']:5.1f}% of the engine   "
            f"p50 {lat.get('p50', 0):.1f} ms  p99 {lat.get('p99', 0):.1f} ms   errors {rep['errors'] or 'none'}   "
            f"RSS {entry['server_rss_mb']} MiB   decoder {entry['jpeg_decoder']['name']}   "
            f"server CPU {entry['server_cpu_ms_per_request']:.2f} ms/req   rows/batch {entry['batches']['mean_rows']}"
            f"   connections {entry.get('connections_per_process')}"
        )


def _child(argv: list[str]) -> None:
    """`dualtrack` with each Python thread's name given to its OS thread, so /proc tells them apart."""
    libc = ctypes.CDLL(None)
    run = threading.Thread.run

    def named_run(self: threading.Thread) -> None:
        libc.prctl(15, self.name.replace(" ", "-")[:15].encode(), 0, 0, 0)  # 15: PR_SET_NAME
        run(self)

    threading.Thread.run = named_run  # type: ignore[method-assign]
    from dualtrack.cli import main as dualtrack

    dualtrack(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
    else:
        main()
