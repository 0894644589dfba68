"""Where the engine process's time goes with the GPU JPEG decoder, without HTTP in front (issue 15).

The service's rate is bounded by the engine process's batch cycle (take a batch, decode and stage
it, launch it, answer it) and by the requests' transit around it. This measures the first alone,
in one process, on the reference bundle:

1. the engine alone at the largest batch: ``Engine.run`` from a host array, mask out (the issue's
   reference rate) and ``stage``/``launch`` back to back (the overlapped path the batcher uses);
2. nvImageCodec's decode of one batch of JPEGs into the batch's device rows
   (``GpuJpegDecoder.decode_into``, resize included), for each set of nvImageCodec backends: the
   host time of the call and the stream time to its end (CUDA events), alone on the GPU;
3. the batcher (``serve.batcher.Batcher``, the one the service runs) under T closed-loop client
   threads submitting pre-routed JPEGs (``submit_jpeg``) or decoded pixels (``submit``), for each
   decoder backend set: images/s, rows per batch, and per batch the time spent in ``stage`` (the
   decode and upload, on the batcher thread) and from launch to answer;
4. with ``--kernels``, every kernel of a few seconds of (3) by name (torch.profiler's CUPTI trace):
   what the decode puts on the SMs beside the engine.

    python bench/decode_probe.py --bundle .carry/unet --jpg .carry/sample.jpg --out DIR [--kernels]

Writes decode_probe-<commit>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench as common  # noqa: E402  (bench/bench.py: git, GPU name)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def engine_alone(engine: Any, batch: int, iters: int) -> dict[str, Any]:
    x = engine.host_array(batch)
    x[...] = np.random.default_rng(0).integers(0, 255, size=x.shape, dtype=np.uint8)
    for _ in range(5):
        engine.run(x, outputs=("mask",))
    run_ms = []
    for _ in range(iters):
        t = time.perf_counter()
        engine.run(x, outputs=("mask",))
        run_ms.append((time.perf_counter() - t) * 1e3)
    # stage / launch with one batch in flight behind the one collected: the batcher's pattern
    subs = [engine.launch(engine.stage(x), outputs=("mask",))]
    t = time.perf_counter()
    for _ in range(iters):
        subs.append(engine.launch(engine.stage(x), outputs=("mask",)))
        subs.pop(0).result()
    subs.pop(0).result()
    overlapped = (time.perf_counter() - t) * 1e3 / iters
    return {
        "batch": batch,
        "run_host_array_ms": _median(run_ms),
        "run_img_s": round(batch / statistics.median(run_ms) * 1e3, 1),
        "stage_launch_ms": round(overlapped, 4),
        "stage_launch_img_s": round(batch / overlapped * 1e3, 1),
    }


def decode_alone(engine: Any, jpeg: Any, batch: int, backends: tuple[str, ...], iters: int) -> dict[str, Any]:
    from dualtrack.runtime.driver import Event, Stream
    from dualtrack.runtime.gpu_jpeg import GpuJpegDecoder

    be = engine.backend
    be.ctx.make_current()
    _, h, w, _ = engine.input_spec.shape
    stream = Stream(be.ctx)
    buf = be.pool.alloc(batch * h * w * 3, stream)
    dec = GpuJpegDecoder(be.ctx, backends=backends)
    rows = dict.fromkeys(range(batch), jpeg)
    e0, e1 = Event(be.ctx), Event(be.ctx)
    host_ms, gpu_ms, wall_ms = [], [], []
    try:
        for i in range(iters + 3):
            t = time.perf_counter()
            e0.record(stream)
            out = dec.decode_into(stream, rows, buf.ptr, h, w)
            t1 = time.perf_counter()
            e1.record(stream)
            e1.synchronize()
            t2 = time.perf_counter()
            if out.refused:
                return {"backends": list(backends), "error": f"refused rows: {out.refused}"}
            if i >= 3:
                host_ms.append((t1 - t) * 1e3)
                wall_ms.append((t2 - t) * 1e3)
                gpu_ms.append(e0.elapsed_ms(e1))
            out.keepalive.clear()
    finally:
        buf.close(stream)
        stream.synchronize()
        e0.close()
        e1.close()
        stream.close()
    return {
        "backends": list(backends),
        "batch": batch,
        "host_call_ms": _median(host_ms),
        "stream_ms": _median(gpu_ms),
        "wall_ms": _median(wall_ms),
    }


def decode_contended(engine: Any, jpeg: Any, iters: int, kernels: Any = None) -> list[dict[str, Any]]:
    """One JPEG's decode, as a decode lane does it (one nvImageCodec call on an urgent stream of its
    own, then a wait for that stream), with the GPU idle or busy with the engine's batches back to
    back (the service at load), with and without Python threads contending for the GIL, and with
    each output layout nvImageCodec offers: where a lone decode's ~1 ms in the service's stage
    comes from (the hardware takes ~0.34 ms for it alone), and whether an output without the
    colour-conversion kernel (planar YCbCr) waits less behind the engine's kernels."""
    import random

    from dualtrack.runtime.driver import Event, Stream
    from dualtrack.runtime.gpu_jpeg import GpuJpegDecoder

    be = engine.backend
    be.ctx.make_current()
    dec = GpuJpegDecoder(be.ctx)
    nv = dec.nv
    layouts: dict[str, Any] = {"srgb_interleaved": dec.params}
    wanted = {
        "srgb_planar": {"color_spec": "SRGB", "sample_format": "P_RGB"},
        "ycc_planar": {"color_spec": "SYCC", "sample_format": "P_YUV"},
        "unchanged_planar": {"sample_format": "P_UNCHANGED"},
    }
    rows: list[dict[str, Any]] = []
    for name, kw in wanted.items():
        try:
            args = {k: getattr(nv.ColorSpec if k == "color_spec" else nv.SampleFormat, v) for k, v in kw.items()}
            layouts[name] = nv.DecodeParams(apply_exif_orientation=False, allow_any_depth=False, **args)
        except Exception as err:  # this nvImageCodec has no such layout: say so
            rows.append({"layout": name, "error": f"{type(err).__name__}: {err}"})
    decoder = nv.Decoder(device_id=be.ctx.device.index, backends=dec._backend_kinds)
    with be.ctx.push_current():
        stream = Stream(be.ctx, urgent=True)
    e0, e1 = Event(be.ctx), Event(be.ctx)
    data = jpeg.data

    stop = threading.Event()

    def engine_busy() -> None:  # the service at load: batches back to back on the compute stream
        be.ctx.make_current()
        x = engine.host_array(max(engine.batch_sizes))
        subs = [engine.launch(engine.stage(x), outputs=("mask",))]
        while not stop.is_set():
            subs.append(engine.launch(engine.stage(x), outputs=("mask",)))
            subs.pop(0).result()
        subs.pop(0).result()

    def gil_busy() -> None:  # a Python thread that runs ~50 us bursts and sleeps, as the service's do
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 5e-5:
                pass
            time.sleep(5e-5)

    def one(params: Any) -> tuple[float, float, float, Any]:
        t0 = time.perf_counter()
        e0.record(stream)
        images = decoder.decode([nv.CodeStream(data)], params=params, cuda_stream=int(stream.handle))
        t1 = time.perf_counter()
        e1.record(stream)
        stream.finish()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3, e0.elapsed_ms(e1), images[0]

    try:
        for load in ("idle", "engine", "gil", "engine+gil"):
            stop.clear()
            threads = []
            if "engine" in load:
                threads.append(threading.Thread(target=engine_busy, daemon=True))
            if "gil" in load:
                threads += [threading.Thread(target=gil_busy, daemon=True) for _ in range(4)]
            for th in threads:
                th.start()
            time.sleep(0.3)
            for name, params in layouts.items():
                host, wall, gpu = [], [], []
                info = None
                for i in range(iters + 3):
                    time.sleep(random.uniform(0.0005, 0.003))  # land anywhere in the engine's batch
                    h_ms, w_ms, g_ms, image = one(params)
                    if image is None:
                        info = "refused"
                        break
                    if info is None:
                        cai = image.__cuda_array_interface__
                        info = {"shape": list(cai["shape"]), "strides": cai.get("strides"), "typestr": cai["typestr"]}
                    if i >= 3:
                        host.append(h_ms)
                        wall.append(w_ms)
                        gpu.append(g_ms)
                    del image
                row = {"load": load, "layout": name, "image": info}
                if wall:
                    row.update(
                        host_call_ms=_median(host), wall_ms=_median(wall), stream_ms=_median(gpu),
                        wall_p90_ms=round(float(np.percentile(wall, 90)), 4),
                    )  # fmt: skip
                rows.append(row)
                print("contended", row, flush=True)
            stop.set()
            for th in threads:
                th.join()
        if kernels is not None:  # what each layout puts on the GPU (CUPTI), the GPU otherwise idle
            for name, params in layouts.items():
                per = kernels(lambda p=params: [one(p) for _ in range(20)])
                rows.append({"layout": name, "kernels_per_20": {k: round(v, 1) for k, v in per.items()}})
                print("contended kernels", rows[-1], flush=True)
    finally:
        stop.set()
        stream.synchronize()
        e0.close()
        e1.close()
        stream.close()
        decoder = None
        dec.close()
    return rows


def gil_share(fn: Any, seconds: float = 1.0) -> float:
    """How much of its lone rate a pure-Python spinner thread keeps while ``fn`` runs in a loop on
    this thread: ~1 where ``fn`` waits with the GIL released, ~0.5 where it runs Python, ~0 where
    it holds the GIL in C (every other thread of the process stalls behind it)."""
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    time.sleep(0.2)
    c0, t0 = count[0], time.perf_counter()
    time.sleep(seconds / 2)
    alone = (count[0] - c0) / (time.perf_counter() - t0)
    c0, t0 = count[0], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
    busy = (count[0] - c0) / (time.perf_counter() - t0)
    stop.set()
    th.join()
    return round(busy / alone, 3)


class _Timed:
    """Wraps the engine's stage and launch to time them per batch (the batcher calls them)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage_ms: list[float] = []
        self.launch_ms: list[float] = []
        self._stage, self._launch = engine.stage, engine.launch
        engine.stage, engine.launch = self.stage, self.launch

    def stage(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return self._stage(*a, **k)
        finally:
            self.stage_ms.append((time.perf_counter() - t) * 1e3)

    def launch(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return self._launch(*a, **k)
        finally:
            self.launch_ms.append((time.perf_counter() - t) * 1e3)

    def restore(self) -> None:
        self.engine.stage, self.engine.launch = self._stage, self._launch


def batcher_load(
    engine: Any, what: str, payload: Any, clients: int, seconds: float, backends: tuple[str, ...], delay_ms: float,
    profile: Any = None,
) -> dict[str, Any]:  # fmt: skip
    from dualtrack.runtime import gpu_jpeg
    from dualtrack.serve.batcher import Batcher, Phase

    batches: list[tuple[int, float, float]] = []  # rows, run ms, mean queue ms

    def on_batch(results: list[Any]) -> None:
        batches.append((results[0].batch_size, results[0].run_ms, statistics.fmean(r.queue_ms for r in results)))

    # The decoder the batcher opens: the same module function, with these backends.
    original = gpu_jpeg.GpuJpegDecoder
    gpu_jpeg.GpuJpegDecoder = lambda ctx, **k: original(ctx, **k, backends=backends)  # type: ignore[misc]
    batcher = Batcher(engine, max_batch_delay_s=delay_ms / 1e3, max_queue=4096, device="cuda", on_batch=on_batch)
    batcher.start()
    try:
        while batcher.phase in (Phase.LOADING, Phase.WARMING):
            time.sleep(0.05)
        if batcher.phase is not Phase.READY:
            return {"error": batcher.error}
        if what == "jpeg" and batcher.decoder[0] != "gpu":
            return {"error": f"decoder is {batcher.decoder}"}
        submit = (lambda: batcher.submit_jpeg(payload)) if what == "jpeg" else (lambda: batcher.submit(payload))
        stop = threading.Event()
        done = [0] * clients
        lat: list[list[float]] = [[] for _ in range(clients)]

        def client(i: int) -> None:
            while not stop.is_set():
                t = time.perf_counter()
                submit().result()
                lat[i].append((time.perf_counter() - t) * 1e3)
                done[i] += 1

        timed = _Timed(engine)
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for th in threads:
            th.start()
        time.sleep(1.0)  # ramp
        n0, b0, s0, l0 = sum(done), len(batches), len(timed.stage_ms), len(timed.launch_ms)
        t0 = time.perf_counter()
        if profile is not None:
            kernels = profile(lambda: time.sleep(seconds))
        else:
            kernels = None
            time.sleep(seconds)
        elapsed = time.perf_counter() - t0
        n1, b1 = sum(done), len(batches)
        stop.set()
        for th in threads:
            th.join()
        timed.restore()
        window = batches[b0:b1]
        every = [x for lx in lat for x in lx]
        out = {
            "what": what,
            "backends": list(backends) if what == "jpeg" else None,
            "clients": clients,
            "img_s": round((n1 - n0) / elapsed, 1),
            "latency_ms": {"p50": _median(every), "p99": round(float(np.percentile(every, 99)), 3)},
            "batches_per_s": round((b1 - b0) / elapsed, 1),
            "mean_rows": round(statistics.fmean(b[0] for b in window), 3) if window else 0,
            "run_ms": _median([b[1] for b in window]),
            "queue_ms": _median([b[2] for b in window]),
            "stage_ms": _median(timed.stage_ms[s0:]),
            "launch_ms": _median(timed.launch_ms[l0:]),
        }
        if kernels is not None:
            out["kernels_per_batch"] = {k: round(v / max(b1 - b0, 1), 2) for k, v in kernels.items()}
        return out
    finally:
        batcher.close(30)
        gpu_jpeg.GpuJpegDecoder = original  # type: ignore[misc]


def cupti_profile(fn: Any) -> dict[str, float]:
    """GPU microseconds by kernel name (memcpy too) while ``fn`` runs, from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    per: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            per[ev.name[:60]] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:20])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--jpg", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--clients", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--delay-ms", type=float, default=8.0)
    sets = ["HW_GPU_ONLY,GPU_ONLY", "HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"]
    ap.add_argument("--backends", nargs="+", default=sets, help="nvImageCodec backend sets, comma-separated")
    ap.add_argument(
        "--decode-batches", type=int, nargs="+", default=[], help="(2) also at these batch sizes (default: the largest)"
    )
    ap.add_argument("--kernels", action="store_true", help="a CUPTI kernel table of the batcher run (needs torch)")
    ap.add_argument(
        "--contention-only", action="store_true",
        help="only the engine alone and one JPEG's decode beside the engine's batches and busy threads",
    )  # fmt: skip
    args = ap.parse_args()

    from dualtrack import imaging
    from dualtrack.kernels import RESIZE_RGB
    from dualtrack.runtime.engine import Engine

    gpu, driver = common.gpu_and_driver()
    commit = os.environ.get("DUALTRACK_COMMIT") or common._git("rev-parse", "--short", "HEAD") or "unknown"
    if args.kernels:
        import torch

        torch.cuda.init()
    engine = Engine.load(args.bundle, device="cuda")
    engine.warmup()
    _, h, w, _ = engine.input_spec.shape
    batch = max(engine.batch_sizes)
    data = args.jpg.read_bytes()
    jpeg = imaging.route_jpeg(data, h, w, max_downscale=RESIZE_RGB.max_downscale)
    if isinstance(jpeg, str):
        raise SystemExit(f"{args.jpg} does not go to the GPU decoder: {jpeg}")
    pixels = imaging.load_for_model(data, h, w).pixels
    sets = [tuple(s.split(",")) for s in args.backends]
    report: dict[str, Any] = {"commit": commit, "gpu": gpu, "driver": driver, "jpeg_bytes": len(data)}
    report["engine"] = engine_alone(engine, batch, 100)
    print("engine alone", report["engine"], flush=True)
    if args.contention_only:
        report["contended"] = decode_contended(engine, jpeg, 100, cupti_profile if args.kernels else None)
        engine.close()
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"decode_probe-{commit}-contended.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")
        return
    from dualtrack.runtime.gpu_jpeg import GpuJpegDecoder

    gil_decoder = GpuJpegDecoder(engine.backend.ctx)
    x8 = engine.host_array(batch)
    report["gil_share"] = {
        "nvimagecodec_decode_now_8": gil_share(lambda: gil_decoder.decode_now([jpeg] * batch)),
        "engine_run_host_array_8": gil_share(lambda: engine.run(x8, outputs=("mask",))),
        "sleep_1ms": gil_share(lambda: time.sleep(0.001)),
    }
    gil_decoder.close()
    gil_decoder = None  # nvImageCodec's decoder goes before the engine's context
    print("GIL share kept by a spinner thread", report["gil_share"], flush=True)
    report["decode"] = []
    for s in sets:
        for n in sorted({batch, *args.decode_batches}):
            try:
                row = decode_alone(engine, jpeg, n, s, 30)
            except Exception as err:  # a backend set nvImageCodec refuses here: say so, go on
                row = {"backends": list(s), "batch": n, "error": f"{type(err).__name__}: {err}"}
            report["decode"].append(row)
            print("decode", row, flush=True)
    report["batcher"] = []
    for clients in args.clients:
        row = batcher_load(engine, "pixels", pixels, clients, args.seconds, (), args.delay_ms)
        report["batcher"].append(row)
        print("batcher", row, flush=True)
        for s in sets:
            try:
                row = batcher_load(engine, "jpeg", jpeg, clients, args.seconds, s, args.delay_ms)
            except Exception as err:
                row = {"what": "jpeg", "backends": list(s), "clients": clients, "error": f"{type(err).__name__}: {err}"}
            report["batcher"].append(row)
            print("batcher", row, flush=True)
    if args.kernels:
        for what, payload in (("jpeg", jpeg), ("pixels", pixels)):
            row = batcher_load(engine, what, payload, max(args.clients), 2.0, sets[0], args.delay_ms, cupti_profile)
            report.setdefault("kernels", []).append(row)
            print("kernels", json.dumps(row, indent=1), flush=True)
    engine.close()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_probe-{commit}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'what':8} {'backends':26} {'clients':>7} {'img/s':>8} {'rows':>5} {'stage':>7} {'launch':>7} {'run':>7}")
    for r in report["batcher"]:
        if "error" in r:
            print(f"{r.get('what', ''):8} {','.join(r.get('backends') or []):26} error: {r['error']}")
            continue
        print(
            f"{r['what']:8} {','.join(r['backends'] or ['-']):26} {r['clients']:>7} {r['img_s']:>8} "
            f"{r['mean_rows']:>5} {r['stage_ms']:>7} {r['launch_ms']:>7} {r['run_ms']:>7}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
