"""Large images on the GPU: dualtrack's sliding window against MONAI's ``sliding_window_inference``.

    PYTHONPATH=pipeline python bench/tiles_bench.py --bundle .carry/zoo/smp_unet_resnet34 --out bench/results

A zoo bundle (its folder name is its zoo name, ``models/zoo/export.py``: the torch rows build the same
network) compiled at its window size (512x512), run on random uint8 images of 2048x2048 and 4096x4096:

    tiles_<S>/dualtrack             Engine.run on the (1, S, S, 3) numpy image: windows cut on the GPU, run in
                                    batches of 8, blended by the blend_nhwc kernels (runtime/tiling.py),
                                    mask at S x S back on the host; `mask_agree`: against MONAI's
                                    sliding_window_inference run with the bundle's own network (Engine.run
                                    on each window batch) as its predictor, so the tiling and blending are
                                    checked, not the weights (a corpus bundle's are bench/reweight.py's,
                                    which the torch network below does not have)
    tiles_<S>/monai_sliding_window  monai.inferers.sliding_window_inference (roi = the window, sw_batch_size 8,
                                    the same overlap and blend) around the torch.compile'd
                                    (mode="reduce-overhead") fp16 channels_last network, its predictor
                                    returning softmax probabilities as the bundle's; the same uint8 image
                                    uploaded, normalised, argmax'ed and the mask downloaded

A bundle built without ``window:`` runs the same tiling with the window given here (``--overlap``,
``--blend``, batch 8) through :class:`dualtrack.runtime.tiling.GpuTiler`, what Engine.run calls for a
bundle with one (the row's ``path`` says which). Timing: host wall time around one image, the device
drained after. Writes tiles_bench-<commit10>.json (commit, GPU, driver, torch, MONAI); prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench as common  # noqa: E402  (bench/bench.py: git, GPU name, stats)
import zoo_bench  # noqa: E402  (the zoo's networks and their normalisation)

SW_BATCH = 8  # windows per engine run and MONAI's sw_batch_size: the comparison


def timed(torch: Any, fn: Any, warmup: int, iters: int) -> tuple[dict[str, Any], Any]:
    """Host wall time of ``fn()`` with the device drained after; its last answer."""
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
    s = common.stats(host)
    return {"median_ms": round(s["median"], 3), "p10_ms": round(s["p10"], 3), "p90_ms": round(s["p90"], 3)}, out


def dualtrack_fn(engine: Any, image: np.ndarray, spec: Any) -> tuple[Any, str]:
    """The dualtrack row's call: Engine.run where the bundle has this window, else its GPU tiling."""
    from dualtrack.runtime import tiling

    if engine.bundle.manifest.window == spec:
        return (lambda: engine.run(image[None])["mask"][0]), "Engine.run"
    size = engine.input_spec.shape[1:3]
    classes = next(o.shape[1] for o in engine.output_specs if o.name == "probs")
    batch = SW_BATCH if SW_BATCH in engine.batch_sizes else engine.batch_sizes[-1]  # a compiled batch size
    t = tiling.Tiling.plan(image.shape[:2], spec, size, batch, engine.batch_sizes)
    tiler = tiling.GpuTiler(engine.backend)
    return (lambda: tiler.run(image, t, spec, engine.run_batch, classes).mask), "GpuTiler (bundle without window:)"


def monai_fn(torch: Any, zoo: Any, name: str, window: tuple[int, int], image: np.ndarray, spec: Any) -> Any:
    """MONAI's row: sliding_window_inference around the compiled fp16 channels_last network."""
    from monai.inferers import sliding_window_inference

    torch._dynamo.reset()
    net = zoo.build_model(name, size=window).eval().cuda().half().to(memory_format=torch.channels_last)
    mean = torch.from_numpy(zoo_bench.MEAN * 255).cuda().view(1, 3, 1, 1)
    inv = torch.from_numpy(1 / (zoo_bench.STD * 255)).cuda().view(1, 3, 1, 1)

    def probs(w: Any) -> Any:
        y = net(w.half().contiguous(memory_format=torch.channels_last))
        return torch.softmax((y["out"] if isinstance(y, dict) else y).float(), dim=1)

    predictor = torch.compile(probs, mode="reduce-overhead", dynamic=False)

    def run() -> np.ndarray:
        with torch.no_grad():
            x = (torch.from_numpy(image).cuda().permute(2, 0, 1)[None].float() - mean) * inv
            p = sliding_window_inference(
                x, window, SW_BATCH, predictor, overlap=spec.overlap, mode=spec.blend, sigma_scale=spec.sigma_scale
            )
            return p[0].argmax(0).to(torch.uint8).cpu().numpy()

    return run


def monai_blend_of_ours(torch: Any, engine: Any, image: np.ndarray, spec: Any) -> np.ndarray:
    """The mask MONAI's sliding_window_inference makes of the bundle's own probabilities: the reference
    the dualtrack row's mask is checked against (untimed). The windows go to Engine.run as the uint8
    images they were cut from."""
    from monai.inferers import sliding_window_inference

    window = engine.input_spec.shape[1:3]

    def probs(w: Any) -> Any:
        batch = w.permute(0, 2, 3, 1).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
        out = np.concatenate([engine.run(batch[i : i + 1], outputs=["probs"])["probs"] for i in range(len(batch))])
        return torch.from_numpy(out.astype(np.float32)).cuda()

    with torch.no_grad():
        x = torch.from_numpy(image).cuda().permute(2, 0, 1)[None].float()
        p = sliding_window_inference(
            x, window, SW_BATCH, probs, overlap=spec.overlap, mode=spec.blend, sigma_scale=spec.sigma_scale
        )
        return p[0].argmax(0).to(torch.uint8).cpu().numpy()


def rows_for(torch: Any, zoo: Any, engine: Any, name: str, side: int, spec: Any, args: Any) -> list[dict[str, Any]]:
    from dualtrack.runtime import tiling

    window = engine.input_spec.shape[1:3]
    image = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    windows = len(tiling.window_origins((side, side), window, spec.overlap))
    fn, path = dualtrack_fn(engine, image, spec)
    ours, mask = timed(torch, fn, args.warmup, args.iters)
    theirs, _ = timed(torch, monai_fn(torch, zoo, name, window, image, spec), args.warmup, args.iters)
    agree = round(float(np.mean(mask == monai_blend_of_ours(torch, engine, image, spec))), 6)
    common_fields = {"model": name, "window": list(window), "overlap": spec.overlap, "blend": spec.blend}
    common_fields |= {"windows": windows, "sw_batch": SW_BATCH}
    print(f"[tiles_{side}] dualtrack {ours['median_ms']:.2f} ms, MONAI {theirs['median_ms']:.2f} ms, agree {agree}")
    return [
        {"name": f"tiles_{side}/dualtrack", **ours, **common_fields, "path": path, "mask_agree": agree},
        {"name": f"tiles_{side}/monai_sliding_window", **theirs, **common_fields, "mask_agree": agree},
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True, help="a zoo bundle (folder = zoo name)")
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--overlap", type=float, default=0.25)
    p.add_argument("--blend", choices=["gaussian", "constant"], default="gaussian")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = p.parse_args(argv)

    import monai
    import torch

    from dualtrack.contract.manifest import Window
    from dualtrack.runtime.engine import Engine

    zoo = zoo_bench.load_zoo()
    gpu, driver = common.gpu_and_driver()
    commit = args.commit or common._git("rev-parse", "HEAD") or "unknown"
    rows: list[dict[str, Any]] = []
    with Engine.load(args.bundle, "cuda") as engine:
        spec = engine.bundle.manifest.window or Window(overlap=args.overlap, blend=args.blend, batch=SW_BATCH)
        for side in args.sizes:
            rows += rows_for(torch, zoo, engine, args.bundle.name, side, spec, args)
    result = {
        "commit": commit,
        "gpu": gpu,
        "driver": driver,
        "torch": torch.__version__,
        "monai": monai.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tiles_bench-{commit[:10]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{gpu}, driver {driver}, commit {commit[:10]} -> {path}")
    for r in rows:
        print(f"{r['name']:<36} {r['median_ms']:>10.2f} ms  windows {r['windows']}  mask_agree {r['mask_agree']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
