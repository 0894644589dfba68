"""Where the public path's host time goes: Engine.run on a torch CUDA tensor against run_batch.

For each batch size: the host time until Engine.run returns (its enqueue cost: the GPU is still
busy), the same with the device drained after each call, run_batch alike, and a cProfile of
Engine.run's calls (top functions by own time). Prints a table; --out writes JSON.

    python bench/api_profile.py --bundle .carry/unet --batches 1 8 --iters 300 --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import numpy as np


def _median_ms(fn, iters: int, sync, *, timed_sync: bool) -> float:
    """Median host ms of ``fn()``, with ``sync()`` after each call inside the timing or outside it."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if timed_sync:
            sync()
        out.append((time.perf_counter() - t0) * 1e3)
        if not timed_sync:
            sync()
    return statistics.median(out)


def main() -> None:
    import torch

    from dualtrack.runtime.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    engine = Engine.load(args.bundle, "cuda")
    rows = []
    for b in args.batches:
        x = torch.from_numpy(
            np.random.default_rng(b).integers(0, 256, (b, *engine.input_spec.shape[1:]), dtype=np.uint8)
        ).cuda()
        g = engine.backend.from_host(x.cpu().numpy())
        for _ in range(20):
            engine.run(x)
            engine.run_batch(g, b)
        torch.cuda.synchronize()

        def drained() -> None:
            torch.cuda.synchronize()

        row = {"batch": b}
        for gc_on in (True, False):
            (gc.enable if gc_on else gc.disable)()
            tag = "gc_on" if gc_on else "gc_off"
            run = lambda x=x: engine.run(x)  # noqa: E731
            internal = lambda g=g, b=b: engine.run_batch(g, b)  # noqa: E731
            row[f"run_enqueue_ms_{tag}"] = _median_ms(run, args.iters, drained, timed_sync=False)
            row[f"run_ms_{tag}"] = _median_ms(run, args.iters, drained, timed_sync=True)
            row[f"run_batch_enqueue_ms_{tag}"] = _median_ms(internal, args.iters, drained, timed_sync=False)
            row[f"run_batch_ms_{tag}"] = _median_ms(internal, args.iters, drained, timed_sync=True)
        gc.enable()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            engine.run(x)
            torch.cuda.synchronize()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        row["profile"] = s.getvalue()
        rows.append(row)
        print(f"N={b}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)))
        print(row["profile"])
    dev = engine.backend.device
    engine.close()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "commit": os.environ.get("DUALTRACK_COMMIT", "unknown"),
            "gpu": dev.name,
            "driver": f"CUDA driver API {dev.driver_version}",
            "bundle": str(args.bundle),
            "iters": args.iters,
            "rows": rows,
        }
        (args.out / "api_profile.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
