"""Batching inside a Ray Serve model replica: dualtrack's Batcher against Ray's ``@serve.batch``.

One replica of each on the same bundle and device, in one local Ray instance; ``--callers``
concurrent callers send one image each through a DeploymentHandle, as the ingress does, for
``--seconds`` per variant, alternating twice. Both variants gather up to the bundle's largest batch
size within the same delay, pad to a compiled batch size and answer each caller its own mask;
every answer is checked against a batch-1 run of the same image (within 0.5% of pixels: rows of a
padded batch may round differently). Prints a table; ``--out`` writes ``ray_batching-<commit>.json``.

    python bench/ray_batching.py --bundle build/unet --device cuda --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray
from ray import serve

from dualtrack.runtime.engine import Engine
from dualtrack.serve.batcher import MASK_OUTPUT, BatchResult, padded_batch_size
from dualtrack.serve.ray_app import ModelReplica
from dualtrack.serve.ray_config import RayAppOptions


class NoMetrics:
    """Stands in for the metrics deployment's handle: this bench times batching, not reporting."""

    class _Record:
        async def remote(self, *args: object) -> None:  # awaited on the replica's loop, as a response is
            pass

    record = _Record()


class RayBatched:
    """The alternative: Ray's @serve.batch gathers the rows; one thread owns the engine (its CUDA context)."""

    def __init__(self, options: RayAppOptions) -> None:
        self.engine = Engine.load(options.bundle, device=options.device)
        self.engine.warmup()
        self.sizes = tuple(self.engine.batch_sizes)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="engine")  # every engine call on one thread
        self.run_batch.set_max_batch_size(max(self.sizes))
        self.run_batch.set_batch_wait_timeout_s(options.max_batch_delay_ms / 1e3)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def run_batch(self, images: list[np.ndarray]) -> list[BatchResult]:
        n = len(images)
        size = padded_batch_size(n, self.sizes)
        x = np.zeros((size, *images[0].shape), np.uint8)
        x[:n] = np.stack(images)  # the copy the Batcher does not make: rows are written in place there

        def run() -> tuple[np.ndarray, float]:
            start = time.monotonic()
            out = self.engine.run(x, outputs=(MASK_OUTPUT,))[MASK_OUTPUT]
            return out, (time.monotonic() - start) * 1e3

        masks, run_ms = await asyncio.wrap_future(self.thread.submit(run))
        return [BatchResult(masks[i], n, size, 0.0, run_ms) for i in range(n)]

    async def run(self, image: np.ndarray) -> BatchResult:
        return await self.run_batch(image)


def load(handle, images: list[np.ndarray], callers: int, seconds: float) -> dict:
    """``callers`` threads send images in turn through ``handle`` for ``seconds``; latencies and rows."""
    latencies: list[float] = []
    answers: list[tuple[int, np.ndarray]] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def caller(k: int) -> None:
        i = k
        while time.monotonic() < stop:
            start = time.perf_counter()
            result = handle.run.remote(images[i % len(images)]).result()
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if len(answers) < 64:
                    answers.append((i % len(images), result.mask))
            i += callers

    start = time.monotonic()
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    lat = np.array(latencies) * 1e3
    return {
        "requests": len(latencies),
        "throughput_per_s": round(len(latencies) / wall, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    # The batcher's queue as behind ingress replicas: twice the largest batch (the callers here are handles).
    options = RayAppOptions(
        bundle=args.bundle, device=args.device, max_batch_delay_ms=args.delay_ms, ingress_replicas=1
    ).resolved()
    reference = Engine.load(args.bundle, device="cpu")
    rng = np.random.default_rng()
    shape = reference.input_spec.shape[1:]
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(32)]
    expected = [reference.run(x[None], outputs=(MASK_OUTPUT,))[MASK_OUTPUT][0] for x in images]

    ray.init(include_dashboard=False, log_to_driver=False)
    gpu = {"num_gpus": 1} if args.device == "cuda" else {}
    common = {"max_ongoing_requests": options.max_ongoing_requests, "ray_actor_options": {"num_cpus": 1, **gpu}}
    variants = {
        "dualtrack_batcher": serve.deployment(ModelReplica, name="batcher", **common).bind(options, NoMetrics()),
        "ray_serve_batch": serve.deployment(RayBatched, name="serve_batch", **common).bind(options),
    }
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        for _round in range(2):
            for name, app in variants.items():
                handle = serve.run(app, name=name, route_prefix=None)
                load(handle, images, args.callers, 1.0)  # warm the path
                row = load(handle, images, args.callers, args.seconds)
                for i, mask in row.pop("answers"):
                    wrong = np.count_nonzero(mask != expected[i])
                    assert wrong <= 0.005 * mask.size, f"{name}: image {i} has {wrong} wrong pixels"
                rows[name].append(row)
                serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()

    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{'variant':<20} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}   ({args.callers} callers, {args.device})")
    for name, runs in rows.items():
        for row in runs:
            print(f"{name:<20} {row['throughput_per_s']:>8} {row['p50_ms']:>8} {row['p99_ms']:>8}")
    if args.out is not None:
        report = {"commit": commit, "bundle": args.bundle, "device": args.device, "callers": args.callers,
                  "seconds": args.seconds, "delay_ms": args.delay_ms, "rows": rows}  # fmt: skip
        path = args.out / f"ray_batching-{commit}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
