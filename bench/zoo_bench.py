"""The model zoo on the GPU: each zoo bundle through the public API against PyTorch with the same weights.

    PYTHONPATH=pipeline python bench/zoo_bench.py --bundle build/zoo/smp_unet_resnet34 \\
        --bundle build/zoo/tv_lraspp_mobilenet_v3_large --out bench/results

A bundle's folder name is its zoo name (`models/zoo/export.py`); its weights are the zoo export's, so
the torch rows build the same network with `export.build_model(name)` (same seed, same size). fp16,
the bundle's input size, N=1 and N=8. Every row runs the whole thing a service runs: uint8 NHWC image
in, `probs` and `mask` out (the torch rows do the same normalisation, softmax and argmax).

Rows, per zoo name (the names the issues use):

    <zoo>/dualtrack_api          Engine.run on a torch CUDA uint8 tensor (GPU in, GPU out)
    <zoo>/dualtrack_api_numpy    Engine.run on a numpy array (host in, host out), as a service calls it
    <zoo>/torch_eager_cl         PyTorch eager, channels_last
    <zoo>/torch_compile_cudagraphs  torch.compile(mode="reduce-overhead")

The zoo configs take `partition: auto` (Track A where its kernels take a node and that pays); each
row says `track_a_segments`. Results written before that (zoo_bench-74c94fbc6f and older) are IREE alone.

Checks before timing: the engine passes `verify_engine` on the GPU (every segment and the whole plan
against onnxruntime, the build's tolerances); each torch row's probs at N=1 are within the relative L2
that dualtrack's own fp16 bundles are verified with (2e-2, dualtrack.config.DEFAULT_TOLERANCES) of
onnxruntime on the bundle's model (smp's fp16 torch rows differ by 1.2e-2, zoo_bench-7029b1b). A row that fails is reported and not timed. Timing is
host wall time around one call with the device drained after (`torch.cuda.synchronize`, which waits
for IREE's streams too: one primary context). Writes zoo_bench-<commit10>.json; prints a table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench as common  # noqa: E402  (bench/bench.py: git, GPU name, stats, torch timing)

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
CHECK_REL_L2 = 2e-2  # = DEFAULT_TOLERANCES["fp16"].rel_l2: torch is held to what dualtrack is held to


def load_zoo() -> Any:
    spec = importlib.util.spec_from_file_location("zoo_export", ROOT / "models" / "zoo" / "export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def time_host(torch: Any, fn: Any, xs: list[Any], warmup: int, iters: int) -> dict[str, Any]:
    for i in range(warmup):
        fn(xs[i % len(xs)])
    torch.cuda.synchronize()
    host = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(xs[i % len(xs)])
        torch.cuda.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
    s = common.stats(host)
    return {
        "median_ms": round(s["median"], 4),
        "p10_ms": round(s["p10"], 4),
        "p90_ms": round(s["p90"], 4),
        "timer": "host perf_counter around Engine.run + torch.cuda.synchronize (drains IREE's streams too)",
    }


def dualtrack_rows(torch: Any, name: str, bundle: Path, images: dict[int, list[np.ndarray]], args) -> list[dict]:
    from dualtrack.errors import DualtrackError
    from dualtrack.runtime.engine import Engine
    from dualtrack.verify import verify_engine

    try:
        engine = Engine.load(bundle, "cuda")  # the first load on this GPU checks it (runtime/selfcheck.py)
    except DualtrackError as e:
        print(f"[{name}] refused at load: {e}")
        return [
            {"name": f"{name}/{r}", "batch": b, "skipped": f"refused at load: {e}"}
            for r in ("dualtrack_api", "dualtrack_api_numpy")
            for b in args.batches
        ]
    rows: list[dict[str, Any]] = []
    try:
        report = verify_engine(engine, samples=1)
        worst = max((c.rel_l2 for c in report.checks if not c.integer), default=0.0)
        print(f"[{name}] verify on the GPU: {'passed' if report.passed else 'FAILED'} (worst rel L2 {worst:.2e})")
        if not report.passed:
            bad = "; ".join(line for line in report.lines() if line.startswith("FAIL"))
            return [
                {"name": f"{name}/{r}", "batch": b, "skipped": f"GPU verification failed: {bad[:300]}"}
                for r in ("dualtrack_api", "dualtrack_api_numpy")
                for b in args.batches
            ]
        engine.warmup()
        track_a = sum(s.track == "A" for s in engine.plan.segments)
        for b in args.batches:
            gpu = [torch.from_numpy(x).cuda() for x in images[b]]
            for row, xs in (("dualtrack_api", gpu), ("dualtrack_api_numpy", images[b])):
                t = time_host(torch, engine.run, xs, args.warmup, args.iters)
                rows.append(
                    {
                        "name": f"{name}/{row}",
                        "batch": b,
                        **t,
                        "track_a_segments": track_a,
                        "segments": len(engine.plan.segments),
                        "verify_worst_rel_l2": round(worst, 6),
                    }
                )
                print(f"[{name}/{row}] N={b}: {t['median_ms']:.3f} ms")
    finally:
        engine.close()
    return rows


def torch_rows(torch: Any, zoo: Any, name: str, size: tuple[int, int], ref_probs: np.ndarray, images, args) -> list:
    net = zoo.build_model(name, size=size).eval().cuda().half().to(memory_format=torch.channels_last)
    mean = torch.from_numpy(MEAN * 255).cuda().view(1, 3, 1, 1)
    inv = torch.from_numpy(1 / (STD * 255)).cuda().view(1, 3, 1, 1)

    def whole(x: Any) -> tuple[Any, Any]:
        f = ((x.permute(0, 3, 1, 2).float() - mean) * inv).half().contiguous(memory_format=torch.channels_last)
        y = net(f)
        y = y["out"] if isinstance(y, dict) else y
        probs = torch.softmax(y.float(), dim=1)
        return probs, probs.argmax(dim=1).to(torch.uint8)

    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for row, mode in (("torch_eager_cl", None), ("torch_compile_cudagraphs", "reduce-overhead")):
            fn = whole if mode is None else torch.compile(whole, mode=mode, dynamic=False)
            t0 = time.perf_counter()
            probs = fn(torch.from_numpy(images[1][0]).cuda())[0].cpu().numpy()
            first = time.perf_counter() - t0
            err = common.rel_l2(ref_probs, probs)
            print(f"[{name}/{row}] probs vs onnxruntime at N=1: rel L2 {err:.2e}; first call {first:.1f} s")
            if not err <= CHECK_REL_L2:
                rows += [
                    {"name": f"{name}/{row}", "batch": b, "skipped": f"probs differ from onnxruntime: {err:.2e}"}
                    for b in args.batches
                ]
                continue
            for b in args.batches:
                xs = [torch.from_numpy(x).cuda() for x in images[b]]
                if mode:
                    fn(xs[0])  # compile for this batch size outside the timing
                t = time_host(torch, fn, xs, args.warmup, args.iters)
                rows.append({"name": f"{name}/{row}", "batch": b, **t, "check_rel_l2": round(err, 6)})
                print(f"[{name}/{row}] N={b}: {t['median_ms']:.3f} ms")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", action="append", type=Path, required=True, help="a zoo bundle (folder = zoo name)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--input-sets", type=int, default=4)
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = p.parse_args(argv)

    import onnxruntime as ort
    import torch

    from dualtrack.bundle import Bundle

    zoo = load_zoo()
    gpu, driver = common.gpu_and_driver()
    commit = args.commit or common._git("rev-parse", "HEAD") or "unknown"
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for bundle in args.bundle:
        name = bundle.name
        b = Bundle.open(bundle)
        h, w = b.plan.inputs[0].shape[1:3]
        images = {
            n: [rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for _ in range(args.input_sets)]
            for n in args.batches
        }
        if 1 not in images:
            images[1] = [rng.integers(0, 256, (1, h, w, 3), dtype=np.uint8)]
        sess = ort.InferenceSession(b.model.SerializeToString(), providers=["CPUExecutionProvider"])
        ref_probs = sess.run(["probs"], {"image": images[1][0]})[0]
        rows += dualtrack_rows(torch, name, bundle, images, args)
        rows += torch_rows(torch, zoo, name, (h, w), ref_probs, images, args)
    result = {
        "commit": commit,
        "gpu": gpu,
        "driver": driver,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"zoo_bench-{commit[:10]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{gpu}, driver {driver}, commit {commit[:10]} -> {path}")
    print(f"{'row':<52} {'N':>3} {'median ms':>10}")
    for r in rows:
        print(f"{r['name']:<52} {r['batch']:>3} {r.get('median_ms', 'skipped: ' + str(r.get('skipped'))[:40]):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
