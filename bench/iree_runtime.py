"""Which IREE runtime settings make Track B cheapest on this GPU: one process per setting.

IREE reads its CUDA driver flags once per process, so every setting runs in a child process that
loads the bundle, checks its probs against the first setting's, and times `run_batch` like
`make bench` does (host perf_counter + stream sync, input on the GPU, medians). Prints a table and
writes JSON (`--out DIR` -> DIR/iree_runtime.json).

    python3 bench/iree_runtime.py --bundle build/unet --batches 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# name -> (DUALTRACK_IREE_ALLOCATOR, DUALTRACK_IREE_FLAGS)
SETTINGS: dict[str, tuple[str, str]] = {
    "plain": ("none", ""),
    "caching": ("caching", ""),
    "caching+inline": ("caching", "--cuda_allow_inline_execution=true"),
    "caching+graphs": ("caching", "--cuda_use_streams=false"),
    "plain+inline": ("none", "--cuda_allow_inline_execution=true"),
}


def child(bundle: Path, batches: list[int], iters: int, probs_out: Path | None) -> dict[str, Any]:
    import numpy as np

    sys.path.insert(0, str(HERE))
    from bench import time_engine  # the same timer as `make bench`

    from dualtrack.contract.bundle import Bundle
    from dualtrack.runtime.engine import Engine

    engine = Engine.load(Bundle.open(bundle), "cuda")
    rng = np.random.default_rng(0)
    shape = engine.bundle.plan.inputs[0].shape
    rows = []
    try:
        for batch in batches:
            xs = [rng.integers(0, 256, (batch, *shape[1:]), dtype=np.uint8) for _ in range(2)]
            if probs_out is not None and batch == batches[0]:
                np.save(probs_out, engine.backend.to_host(engine.run_batch(xs[0], batch)["probs"]))
            dev = [engine.backend.from_host(x) for x in xs]
            r = time_engine(engine, dev, batch, warmup=10, iters=iters)
            keep = ("median_ms", "p10_ms", "p90_ms", "tracks_ms", "segments_ms")
            rows.append({"batch": batch, **{k: r[k] for k in keep}})
    finally:
        engine.close()
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probs", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.bundle, args.batches, args.iters, args.probs)))
        return 0

    import numpy as np

    results: dict[str, Any] = {}
    ref = None
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for name in args.settings:
        alloc, flags = SETTINGS[name]
        env = {**os.environ, "DUALTRACK_IREE_ALLOCATOR": alloc, "DUALTRACK_IREE_FLAGS": flags}
        probs = tmp / f"iree_runtime_{name.replace('+', '_')}.npy"
        argv = [sys.executable, __file__, "--bundle", str(args.bundle), "--iters", str(args.iters)]
        argv += ["--batches", *map(str, args.batches), "--child", name, "--probs", str(probs)]
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            results[name] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            print(f"{name:16s} FAILED: {results[name]['error']}")
            continue
        res = json.loads(p.stdout.strip().splitlines()[-1])
        out = np.load(probs).astype(np.float32)
        if ref is None:
            ref = out
        res["probs_rel_l2_vs_first"] = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
        results[name] = {"allocator": alloc, "flags": flags, **res}
        for r in res["rows"]:
            print(
                f"{name:16s} N={r['batch']}: {r['median_ms']:7.3f} ms  A {r['tracks_ms']['A']:6.3f}  "
                f"B {r['tracks_ms']['B']:6.3f}  segments {r['segments_ms']}"
            )
    if args.out:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
        name, _, driver = gpu.partition(", ")
        doc = {
            "gpu": name,
            "driver": driver,
            "commit": os.environ.get("DUALTRACK_COMMIT", "unknown"),
            "settings": results,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "iree_runtime.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
