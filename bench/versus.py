"""Two trees of dualtrack side by side: the same models, each built and run by its own commit's code,
timed through the public API in one call on one GPU, in alternating rounds.

A restructuring that must not make anything slower (issue 37) is measured like this: the baseline
commit's `pipeline/` travels in `.ab/` (`git archive REV pipeline handwritten_ptx | tar -x -C .ab`)
with its own bundles, this tree's bundles beside them, and each round runs one process per tree:

    python3 bench/versus.py round --bundle unet=.carry/unet ... --tag new --out OUT/vs-new-1.json
    PYTHONPATH=.ab/pipeline python3 bench/versus.py round --bundle unet=.ab_carry/unet ... --tag base ...
    python3 bench/versus.py table OUT/vs-*.json --out OUT/versus.json

This script imports nothing of dualtrack but the public `dualtrack.Engine` (both trees have it), so
the same file times either tree. The timer is bench.py's `dualtrack_api` row's: host perf_counter
around `Engine.run` on a torch CUDA uint8 tensor, then `torch.cuda.synchronize`, median of the calls,
inputs rotating among several random images. Every engine is checked before it is timed by its own
first-load self-check (on by default), and the two trees' outputs on the same input are compared
in the table (class-mask agreement), so a faster tree that computes something else is caught.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _gpu() -> dict[str, str]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    name, _, driver = out.partition(", ")
    return {"gpu": name, "driver": driver}


def _time_run(torch: Any, engine: Any, xs: list[Any], warmup: int, iters: int) -> list[float]:
    for i in range(warmup):
        engine.run(xs[i % len(xs)])
    torch.cuda.synchronize()
    totals = []
    for i in range(iters):
        t0 = time.perf_counter()
        engine.run(xs[i % len(xs)])
        torch.cuda.synchronize()
        totals.append((time.perf_counter() - t0) * 1e3)
    return totals


def _mask_of(out: Any) -> np.ndarray | None:
    for key in ("mask",):
        if key in out:
            return np.asarray(out[key])
    return None


def run_round(args: argparse.Namespace) -> int:
    import torch

    from dualtrack import Engine

    rows: list[dict[str, Any]] = []
    masks: dict[str, list[int]] = {}
    for spec in args.bundle:
        name, _, path = spec.partition("=")
        with Engine.load(path, device="cuda") as engine:
            inp = engine.plan.inputs[0]
            for b in args.batches:
                shape = inp.at_batch(b)
                rng = np.random.default_rng(1234 + b)
                host = [rng.integers(0, 256, size=shape, dtype=np.uint8) for _ in range(args.input_sets)]
                xs = [torch.from_numpy(x).cuda() for x in host]
                ms = _time_run(torch, engine, xs, args.warmup, args.iters)
                mask = _mask_of(engine.run(host[0]))
                if mask is not None:
                    masks[f"{name}/b{b}"] = np.asarray(mask, np.uint8).reshape(-1)[:: args.mask_stride].tolist()
                rows.append(
                    {
                        "model": name,
                        "batch": b,
                        "tree": args.tag,
                        "median_ms": round(statistics.median(ms), 4),
                        "p10_ms": round(float(np.percentile(ms, 10)), 4),
                        "p90_ms": round(float(np.percentile(ms, 90)), 4),
                    }
                )
                print(f"[{args.tag}] {name} N={b}: {rows[-1]['median_ms']:.3f} ms", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tag": args.tag, "rows": rows, "masks": masks, **_gpu()}) + "\n")
    return 0


def table(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.files]
    by: dict[tuple[str, int, str], list[float]] = {}
    for r in runs:
        for row in r["rows"]:
            by.setdefault((row["model"], row["batch"], row["tree"]), []).append(row["median_ms"])
    trees = sorted({k[2] for k in by})
    keys = sorted({(m, b) for m, b, _ in by})
    out_rows = []
    print(f"{'model':<36} {'N':>2} " + " ".join(f"{t + ' ms':>12}" for t in trees) + "   ratio (rounds' medians)")
    for m, b in keys:
        med = {t: statistics.median(by[(m, b, t)]) for t in trees if (m, b, t) in by}
        ratio = med[trees[1]] / med[trees[0]] if len(med) == 2 else None
        out_rows.append(
            {
                "model": m,
                "batch": b,
                **{f"{t}_ms": round(v, 4) for t, v in med.items()},
                "rounds": {t: by[(m, b, t)] for t in trees if (m, b, t) in by},
                f"{trees[1]}_over_{trees[0]}" if len(trees) == 2 else "ratio": ratio,
            }
        )
        print(
            f"{m:<36} {b:>2} "
            + " ".join(f"{med.get(t, float('nan')):>12.3f}" for t in trees)
            + (f"   {ratio:.3f}" if ratio else "")
        )
    agree = _mask_agreement(runs)
    for k, v in agree.items():
        print(f"mask agreement {k}: {v:.5f}")
    result = {
        "commit": args.commit,
        **{k: runs[0][k] for k in ("gpu", "driver")},
        "trees": trees,
        "rows": out_rows,
        "mask_agreement": agree,
        "timer": "host perf_counter around Engine.run "
        "(torch CUDA uint8 tensor) + torch.cuda.synchronize; median per round, median of rounds",
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _mask_agreement(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Between the first round of each tree: the fraction of (sampled) mask pixels that agree."""
    first: dict[str, dict[str, list[int]]] = {}
    for r in runs:
        first.setdefault(r["tag"], r["masks"])
    if len(first) != 2:
        return {}
    a, b = first.values()
    return {k: float(np.mean(np.asarray(a[k]) == np.asarray(b[k]))) for k in a if k in b}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("round", help="time each bundle through Engine.run in this process")
    r.add_argument("--bundle", action="append", required=True, metavar="NAME=PATH")
    r.add_argument("--tag", required=True, help="which tree this is (e.g. base, new)")
    r.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    r.add_argument("--iters", type=int, default=100)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--input-sets", type=int, default=4)
    r.add_argument("--mask-stride", type=int, default=7, help="keep every n-th mask pixel for the agreement check")
    r.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table", help="the rounds' table: each tree's median of round medians, and their ratio")
    t.add_argument("files", nargs="+")
    t.add_argument("--commit", required=True)
    t.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    return run_round(args) if args.cmd == "round" else table(args)


if __name__ == "__main__":
    sys.exit(main())
