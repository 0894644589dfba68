"""A/B: several bundles of one model timed in one process, in alternating rounds, with the timer of
`make bench` (host perf_counter around run_batch + stream sync, input on the GPU).

Alternating rounds put every bundle under the same host and GPU conditions, so a difference of a
few percent between two partitions, flag sets or kernel versions means something, where two
separate bench runs differ by more than that (bench/results/bench-*.json). Prints a table and
writes JSON (`--out DIR` -> DIR/ab-<tag>.json).

    python3 bench/ab.py tuned=build/unet untuned=build/unet_untuned --batches 1 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundles", nargs="+", metavar="NAME=PATH", help="bundles to compare")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (median of the rounds' medians)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per bundle, batch and round")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tag", default="ab")
    args = p.parse_args()

    import numpy as np

    sys.path.insert(0, str(HERE))
    from bench import gpu_and_driver, time_engine

    from dualtrack.contract.bundle import Bundle
    from dualtrack.runtime.engine import Engine

    named = [b.split("=", 1) for b in args.bundles]
    if any(len(n) != 2 for n in named):
        p.error("bundles are NAME=PATH")
    engines = {name: Engine.load(Bundle.open(path), "cuda") for name, path in named}
    rng = np.random.default_rng(0)
    shape = next(iter(engines.values())).bundle.plan.inputs[0].shape
    rows: list[dict[str, Any]] = []
    try:
        for batch in args.batches:
            xs = [rng.integers(0, 256, (batch, *shape[1:]), dtype=np.uint8) for _ in range(4)]
            dev = {n: [e.backend.from_host(x) for x in xs] for n, e in engines.items()}
            runs: dict[str, list[dict[str, Any]]] = {n: [] for n in engines}
            for _ in range(args.rounds):
                for n, e in engines.items():
                    runs[n].append(time_engine(e, dev[n], batch, warmup=5, iters=args.iters))
            for n, rs in runs.items():
                med = statistics.median(r["median_ms"] for r in rs)
                segs = {k: round(statistics.median(r["segments_ms"][k] for r in rs), 4) for k in rs[0]["segments_ms"]}
                tracks = {k: round(statistics.median(r["tracks_ms"][k] for r in rs), 4) for k in rs[0]["tracks_ms"]}
                rounds = [r["median_ms"] for r in rs]
                rows.append({"name": n, "batch": batch, "median_ms": med, "rounds_ms": rounds, "tracks_ms": tracks,
                             "segments_ms": segs})  # fmt: skip
                print(f"{n:>16} N={batch}: {med:.3f} ms (rounds {', '.join(f'{x:.3f}' for x in rounds)}) "
                      f"tracks {tracks} segments {segs}")  # fmt: skip
    finally:
        for e in engines.values():
            e.close()
    if args.out:
        gpu, driver = gpu_and_driver()
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"gpu": gpu, "driver": driver, "bundles": dict(named), "rounds": args.rounds, "iters": args.iters,
                  "rows": rows}  # fmt: skip
        (args.out / f"ab-{args.tag}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
