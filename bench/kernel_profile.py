"""Where one inference's GPU time goes: every kernel of ``Engine.run``, by name, from CUPTI.

torch.profiler's CUDA activity (CUPTI) records every kernel of the process's primary context, the
ones the engine's CUDA graph launches included (Track A's cubins and Track B's replayed IREE
dispatches alike). For each bundle and batch size this runs ``Engine.run`` on a torch CUDA uint8
tensor a few times under the profiler and prints, per kernel name, the calls and the GPU
microseconds per inference, the sum of kernel time, and the wall time per inference, so the gap
(launch gaps, copies, host waits) shows too. --out writes kernel_profile-<commit>.json. ``--torch``: the
same for torch.compile + CUDA graphs on the bundle's zoo network (bench/zoo_bench.py's), side by side.

    python bench/kernel_profile.py --bundle .carry/zoo/smp_unet_resnet34 --batches 1 8 --out DIR

Nsight Compute cannot read counters on the lent machines (gVisor); CUPTI's activity trace needs
none. A run where CUPTI records no kernel says so instead of printing an empty table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench as common  # noqa: E402  (bench/bench.py: git, GPU name)


def profile(torch: Any, run: Any, shape: tuple[int, ...], reps: int) -> dict[str, Any]:
    """Kernel time per inference of ``run`` (Engine.run, or torch's whole inference) on uint8 images of
    ``shape`` (N, H, W, 3), by kernel name."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch = shape[0]
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    for _ in range(5):
        run(x)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            run(x)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / reps
    per_name: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        per_name[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    rows = sorted(
        ({"kernel": n, "calls": len(t) / reps, "us": sum(t) / reps} for n, t in per_name.items()),
        key=lambda r: -r["us"],
    )
    return {
        "batch": batch,
        "reps": reps,
        "wall_ms_per_inference": round(wall_ms, 4),
        "kernel_ms_per_inference": round(sum(r["us"] for r in rows) / 1e3, 4),
        "kernels": [{**r, "us": round(r["us"], 2), "calls": round(r["calls"], 2)} for r in rows],
    }


def torch_no_grad(torch: Any, fn: Any, x: Any) -> Any:
    with torch.no_grad():
        return fn(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25, help="kernel rows printed per bundle and batch")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--torch",
        action="store_true",
        help="also profile torch.compile + CUDA graphs on the zoo network (the folder's zoo name), as zoo_bench has it",
    )
    args = ap.parse_args()

    import torch

    from dualtrack.runtime.engine import Engine

    gpu, driver = common.gpu_and_driver()
    commit = os.environ.get("DUALTRACK_COMMIT") or common._git("rev-parse", "--short", "HEAD") or "unknown"
    result: dict[str, Any] = {"commit": commit, "gpu": gpu, "driver": driver, "profiles": []}
    for bundle in args.bundle:
        engine = Engine.load(bundle, device="cuda")
        shape = tuple(engine.input_spec.shape[1:])
        runs = [(bundle.name, engine.run)]
        if args.torch:
            from zoo_bench import load_zoo, torch_network

            torch._dynamo.reset()
            net, whole = torch_network(torch, load_zoo(), bundle.name, shape[:2])
            net.half()
            compiled = torch.compile(whole, mode="reduce-overhead", dynamic=False)
            runs.append((f"{bundle.name}/torch_compile_cudagraphs", lambda x, f=compiled: torch_no_grad(torch, f, x)))
        for batch in args.batches:
            if batch not in engine.batch_sizes:
                continue
            for label, run in runs:
                p = profile(torch, run, (batch, *shape), args.reps)
                p["bundle"] = label
                result["profiles"].append(p)
                print(
                    f"\n{label} N={batch}: wall {p['wall_ms_per_inference']:.3f} ms/inference, "
                    f"kernels {p['kernel_ms_per_inference']:.3f} ms ({len(p['kernels'])} names)"
                )
                if not p["kernels"]:
                    print("  CUPTI recorded no kernel (profiler unavailable here)")
                for r in p["kernels"][: args.top]:
                    print(f"  {r['us']:9.1f} us  x{r['calls']:<5g} {r['kernel'][:110]}")
        engine.close()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"kernel_profile-{result['commit']}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
