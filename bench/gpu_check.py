"""One GPU run for issue 3: load, verify, segment the sample, time both tracks, write the result file.

    python bench/gpu_check.py --bundle build/unet --image models/sample.png --out bench/results/

Prints a short table last; writes `gpu_check-<commit>.json` with the commit hash, GPU, driver and
every number (module load times cold/cached, per-inference time and track shares at each batch
size, host waits and their cost, peak device memory, verification errors, GPU-vs-CPU mask diff),
which kernel each Track A conv3x3 ran at each batch size (`conv3x3`: the sm_90a wgmma kernel or an
mma.sync entry, and why) and, where the wgmma kernel ran, the same timings with DUALTRACK_WGMMA=0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np


def _commit() -> str:
    if os.environ.get("DUALTRACK_COMMIT"):
        return os.environ["DUALTRACK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def module_load_times(bundle, ctx) -> dict:
    """Track A module load: shipped cubin, PTX JIT cold (empty cache) and PTX with the cache warm."""
    from dualtrack.contract import arch
    from dualtrack.runtime.driver import Module

    ta = bundle.track_a
    dev = ctx.device
    out: dict = {}
    choice = arch.choose_image(dev.cc, sorted(ta["cubin"]), [])
    ptx_arch = arch.choose_image(dev.cc, [], sorted(ta["ptx"])).arch
    for stem in sorted(ta["cubin"][choice.arch]):  # each target has its own kernels (wgmma: sm_90a only)
        cub = Module.load(
            ctx,
            (bundle.root / ta["cubin"][choice.arch][stem]["path"]).read_bytes(),
            kind="cubin",
            origin=stem,
            target=choice.arch,
        )
        ptx = (bundle.root / ta["ptx"][ptx_arch][stem]["path"]).read_bytes()
        with tempfile.TemporaryDirectory() as cache:
            cold = Module.load(ctx, ptx, kind="ptx", origin=stem, target=ptx_arch, cache_dir=Path(cache))
            warm = Module.load(ctx, ptx, kind="ptx", origin=stem, target=ptx_arch, cache_dir=Path(cache))
        direct = Module.load(ctx, ptx, kind="ptx", origin=stem, target=ptx_arch)
        out[stem] = {
            "cubin_ms": round(cub.load_ms, 3),
            "ptx_jit_cold_ms": round(cold.load_ms + cold.jit_ms, 3),
            "ptx_cached_ms": round(warm.load_ms, 3),
            "ptx_cache": [cold.cache, warm.cache],
            "ptx_direct_ms": round(direct.load_ms, 3),
            "ptx_arch": ptx_arch,
            "cubin_arch": choice.arch,
        }
        for m in (cub, cold, warm, direct):
            m.close()
    return out


def time_batch(engine, batch: int, iters: int, warmup: int) -> dict:
    """Median per-inference time with the input already on the GPU, and each track's share."""
    from dualtrack.compiler.verify import random_input

    be = engine.backend
    x = be.from_host(random_input(engine.input_spec, batch, np.random.default_rng()))
    for _ in range(warmup):
        engine.run_batch(x, batch)
    totals, a_ms, b_ms, waits, wait_ms = [], [], [], [], []
    for _ in range(iters):
        be.timings = {"A": 0.0, "B": 0.0}
        w0, wm0 = be.stats.host_waits, be.stats.host_wait_ms
        t0 = time.perf_counter()
        engine.run_batch(x, batch)
        be.stream.synchronize()
        totals.append((time.perf_counter() - t0) * 1e3)
        a_ms.append(be.timings["A"])
        b_ms.append(be.timings["B"])
        waits.append(be.stats.host_waits - w0)
        wait_ms.append(be.stats.host_wait_ms - wm0)
    med = statistics.median
    return {
        "batch": batch,
        "median_ms": round(med(totals), 3),
        "p90_ms": round(sorted(totals)[int(0.9 * len(totals))], 3),
        "track_a_ms": round(med(a_ms), 3),
        "track_b_ms": round(med(b_ms), 3),
        "host_waits": med(waits),
        "host_wait_ms": round(med(wait_ms), 4),
        "images_per_s": round(batch / med(totals) * 1e3, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--image", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()

    from cuda.bindings import driver as cu
    from PIL import Image

    from dualtrack.compiler.verify import verify_engine
    from dualtrack.runtime.driver import call
    from dualtrack.runtime.engine import Engine

    result: dict = {"commit": _commit(), "bundle": str(args.bundle)}
    from dualtrack.runtime.driver import Device

    ctx = Device(0).primary_context()  # the engine retains this same primary context
    free0, total = call(cu.cuMemGetInfo)
    t0 = time.perf_counter()
    engine = Engine.load(args.bundle, "cuda")
    result["engine_load_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    be = engine.backend
    dev = be.device
    result.update(
        gpu=dev.name,
        cc=f"{dev.cc[0]}.{dev.cc[1]}",
        driver=dev.driver_version,
        iree_target=be.target,
        track_a_image=be.stats.image,
    )
    result["track_a_module_load"] = module_load_times(engine.bundle, be.ctx)
    result["engine_module_load_ms"] = {k: round(v, 3) for k, v in be.stats.module_load_ms.items()}

    be.poison = True
    report = verify_engine(engine, samples=2, interpret=False)
    be.poison = False
    result["verification"] = report.to_json()
    print("\n".join(report.lines()))

    img = np.asarray(Image.open(args.image).convert("RGB"))[None]
    gpu_mask = engine.run(img)["mask"]
    with Engine.load(args.bundle, "cpu") as cpu:
        cpu_out = cpu.run(img)
    gpu_out = engine.run(img)
    diff = int(np.count_nonzero(gpu_mask != cpu_out["mask"]))
    p_gpu, p_cpu = gpu_out["probs"].astype(np.float64), cpu_out["probs"].astype(np.float64)
    result["sample"] = {
        "pixels": int(gpu_mask.size),
        "mask_pixels_differing_gpu_vs_cpu": diff,
        "probs_rel_l2_gpu_vs_cpu": float(np.linalg.norm(p_gpu - p_cpu) / np.linalg.norm(p_cpu)),
        "class_counts_gpu": np.bincount(gpu_mask.ravel()).tolist(),
    }
    Image.fromarray(gpu_mask[0]).save(Path(tempfile.gettempdir()) / "sample_mask_gpu.png")

    be.pool.reset_peak()
    result["timing"] = [time_batch(engine, b, args.iters, 5) for b in engine.batch_sizes]
    be.use_graphs = False  # the same, one launch per kernel: what the CUDA graph saves
    result["timing_without_cuda_graphs"] = [time_batch(engine, b, args.iters, 5) for b in engine.batch_sizes]
    be.use_graphs = True
    result["wgmma"] = be.stats.wgmma
    result["conv3x3"] = {node: {str(n): c for n, c in per.items()} for node, per in be.stats.conv3x3.items()}
    if be.wgmma_off is None:  # the same engine with every conv3x3 on the mma.sync kernel
        os.environ["DUALTRACK_WGMMA"] = "0"
        try:
            with Engine.load(args.bundle, "cuda") as plain:
                result["timing_without_wgmma"] = [time_batch(plain, b, args.iters, 5) for b in plain.batch_sizes]
        finally:
            del os.environ["DUALTRACK_WGMMA"]
    free1, _ = call(cu.cuMemGetInfo)
    result["memory"] = {
        "track_a_pool_peak_bytes": be.pool.peak_bytes(),
        # Everything the engine holds after both batch sizes ran: weights, both tracks' activations,
        # IREE's own pools and module code (cuMemGetInfo before Engine.load and after the timings).
        "device_used_by_engine_bytes": int(free0 - free1) if free1 < free0 else 0,
        "device_total_bytes": int(total),
    }
    engine.close()
    ctx.close()
    out = args.out / f"gpu_check-{result['commit'][:10]}.json"
    out.write_text(json.dumps(result, indent=2))

    print(
        f"\n{result['gpu']} (cc {result['cc']}), driver {result['driver']}, "
        f"IREE {result['iree_target']}, Track A {result['track_a_image']}"
    )
    for stem, t in result["track_a_module_load"].items():
        print(
            f"load {stem:<18} cubin {t['cubin_ms']:8.2f} ms | PTX JIT cold {t['ptx_jit_cold_ms']:8.2f} ms | "
            f"PTX cached {t['ptx_cached_ms']:6.2f} ms"
        )
    print(
        f"verification: {'passed' if report.passed else 'FAILED'} ({len(report.checks)} checks, worst rel_l2 "
        f"{max(c.rel_l2 for c in report.checks):.2e})"
    )
    s = result["sample"]
    print(
        f"sample: {s['mask_pixels_differing_gpu_vs_cpu']} of {s['pixels']} mask pixels differ GPU vs CPU; "
        f"probs rel_l2 {s['probs_rel_l2_gpu_vs_cpu']:.2e}"
    )
    print(f"{'batch':>5} {'median ms':>10} {'track A':>8} {'track B':>8} {'waits':>6} {'wait ms':>8} {'img/s':>8}")
    for t in result["timing"]:
        print(
            f"{t['batch']:>5} {t['median_ms']:>10.3f} {t['track_a_ms']:>8.3f} {t['track_b_ms']:>8.3f} "
            f"{t['host_waits']:>6} {t['host_wait_ms']:>8.4f} {t['images_per_s']:>8.1f}"
        )
    for t in result["timing_without_cuda_graphs"]:
        row = f"{t['batch']:>5} {t['median_ms']:>10.3f} {t['track_a_ms']:>8.3f} {t['track_b_ms']:>8.3f}"
        print(f"{row}   (no CUDA graph)")
    for t in result.get("timing_without_wgmma", []):
        row = f"{t['batch']:>5} {t['median_ms']:>10.3f} {t['track_a_ms']:>8.3f} {t['track_b_ms']:>8.3f}"
        print(f"{row}   (DUALTRACK_WGMMA=0: every conv3x3 on mma.sync)")
    print(f"conv3x3 wgmma kernel: {result['wgmma']}")
    for node, per in result["conv3x3"].items():
        picks = ", ".join(f"N={n}: {c['impl']} {c['entry']}" for n, c in per.items())
        print(f"  {node}: {picks}")
    m = result["memory"]
    print(
        f"memory: Track A pool peak {m['track_a_pool_peak_bytes'] / 2**20:.1f} MiB; "
        f"engine total {m['device_used_by_engine_bytes'] / 2**20:.1f} MiB"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
