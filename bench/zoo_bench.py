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
    <zoo>/iree_only/<variant>    an IREE-only bundle carried beside the zoo bundle (below), Engine.run on
                                 a torch CUDA tensor like dualtrack_api
    <zoo>/iree_alone             the fastest of those variants, of the zoo bundle's precision, that verified
                                 (`variant` names it); `skipped`, with each variant's reason, if none did
    <zoo>/iree_alone_fp32        the same over the fp32 variants: a labelled extra, IREE alone where its
                                 fp16 code is wrong (bench/results/lraspp_diag-c14dd25-*.log)

IREE-only variants: every bundle `<zoo>.iree_only/<variant>/` next to the zoo bundle `<zoo>/` (built
from configs/zoo/iree_only/<zoo>/<variant>.yaml: the whole graph on Track B, one Track B flag set
each, sm_90a only; bench/prepare_carry.sh zoo builds them). Each is checked the way the zoo bundle is;
a variant the GPU gets wrong is reported with its error and the module and flags that computed it.

The zoo configs take `partition: auto` (Track A where its kernels take a node and that pays); each
row says `track_a_segments`. Results written before that (zoo_bench-74c94fbc6f and older) are IREE alone.

Checks before timing: the engine passes `verify_engine` on the GPU (every segment and the whole plan
against onnxruntime, the build's tolerances); each torch row's probs at N=1 are within the relative L2
that dualtrack's own fp16 bundles are verified with (2e-2, dualtrack.compiler.config.DEFAULT_TOLERANCES) of
onnxruntime on the bundle's model (smp's fp16 torch rows differ by 1.2e-2, zoo_bench-7029b1b).
A row that fails is reported and not timed. Timing is
host wall time around one call with the device drained after (`torch.cuda.synchronize`, which waits
for IREE's streams too: one primary context). Writes zoo_bench-<commit10>.json; prints a table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench as common  # noqa: E402  (bench/bench.py: git, GPU name, stats, torch timing)

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
CHECK_REL_L2 = 2e-2  # = DEFAULT_TOLERANCES["fp16"].rel_l2: torch is held to what dualtrack is held to
# A re-weighted bundle's torch rows are checked against torch's own fp32 run: fp16 of a deep random
# network may be that far from fp32 on its own (compiler/verify.FP16_CEILING, what fp16 builds may reach).
CHECK_SELF_REL_L2 = 8e-2


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


API_ROWS = (("dualtrack_api", True), ("dualtrack_api_numpy", False))  # (row, input a torch CUDA tensor?)
IREE_ONLY = "iree_only"  # the folder beside a zoo bundle that holds its IREE-alone variants
IREE_ALONE = "iree_alone"  # the summary row: the issue's `<model>/iree_alone`


def iree_only_variants(bundle: Path) -> list[Path]:
    """The IREE-only bundles carried beside a zoo bundle: ``<zoo>.iree_only/<variant>/`` next to
    ``<zoo>/``, one per config in configs/zoo/iree_only/<zoo>/ (a Track B flag variant, or fp32)."""
    folder = bundle.parent / f"{bundle.name}.{IREE_ONLY}"
    return sorted(m.parent for m in folder.glob("*/manifest.json"))


def track_a_flop_share(bundle: Path) -> float | None:
    """The fraction of the model's FLOPs its Track A nodes compute (the bundle's partition.json, whose
    nodes carry their FLOPs since 38's partition), None where the bundle does not say."""
    path = bundle / "partition.json"
    if not path.is_file():
        return None
    nodes = json.loads(path.read_text()).get("nodes", [])
    total = sum(n.get("flops", 0.0) for n in nodes)
    on_a = sum(n.get("flops", 0.0) for n in nodes if n.get("track") == "A")
    return round(on_a / total, 4) if total else None


def prediction_row(name: str, bundle: Path, rows: list[dict]) -> dict | None:
    """Whether the partition's prediction held: its estimate for the plan and for IREE alone (the
    bundle's partition.json, summed over the batch sizes) beside the measured `dualtrack_api` and
    `iree_alone` medians summed the same way; ``held`` where both say the same one is faster."""
    path = bundle / "partition.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    if "estimate_us" not in report:
        return None
    batches = report["batch_sizes"]

    def measured(row: str) -> float | None:
        got = [
            r["median_ms"] for r in rows if r["name"] == f"{name}/{row}" and "median_ms" in r and r["batch"] in batches
        ]
        return 1e3 * sum(got) if len(got) == len(batches) else None

    mine, alone = measured("dualtrack_api"), measured(IREE_ALONE)
    out = {
        "name": f"{name}/prediction",
        "batch": 0,
        "predicted_us": report["estimate_us"],
        "predicted_iree_alone_us": report["iree_alone_us"],
        "measured_us": mine,
        "measured_iree_alone_us": alone,
    }
    if mine is not None and alone is not None:
        out["held"] = (report["estimate_us"] <= report["iree_alone_us"]) == (mine <= alone)
    return out


def worst_rel_l2(checks: list[dict[str, Any]]) -> float:
    """The largest relative L2 error over the float checks of a verification report's JSON."""
    return max((c["rel_l2"] for c in checks if not c.get("integer")), default=0.0)


def engine_rows(
    torch: Any,
    name: str,
    bundle: Path,
    images: dict[int, list[np.ndarray]],
    args: Any,
    rows: tuple[tuple[str, bool], ...] = API_ROWS,
    extra: dict[str, Any] | None = None,
) -> list[dict]:
    """Load ``bundle`` on the GPU (its first-load check), verify it against onnxruntime, then time
    Engine.run for each (row, GPU input?) in ``rows`` at each batch size. A bundle refused at load or
    failing verification gets rows that say `skipped`, with the reason and the error measured."""
    from dualtrack.compiler.verify import verify_engine
    from dualtrack.errors import DualtrackError
    from dualtrack.runtime.engine import Engine
    from dualtrack.runtime.selfcheck import GpuCheckError

    extra = extra or {}

    def skipped(why: str, worst: float | None) -> list[dict]:
        err = {} if worst is None else {"verify_worst_rel_l2": round(worst, 6)}
        return [
            {"name": f"{name}/{r}", "batch": b, **extra, "skipped": why, **err} for r, _ in rows for b in args.batches
        ]

    try:
        engine = Engine.load(bundle, "cuda")  # the first load on this GPU checks it (runtime/selfcheck.py)
    except DualtrackError as e:
        worst = worst_rel_l2(e.record["checks"]) if isinstance(e, GpuCheckError) else None
        print(f"[{name}] {bundle} refused at load: {e}")
        return skipped(f"refused at load: {e}", worst)
    out: list[dict[str, Any]] = []
    try:
        report = verify_engine(engine, samples=1, tol=engine.bundle.tolerance())  # the build's (judged) tolerance
        worst = worst_rel_l2([asdict(c) for c in report.checks])
        print(f"[{name}] verify on the GPU: {'passed' if report.passed else 'FAILED'} (worst rel L2 {worst:.2e})")
        if not report.passed:
            bad = "; ".join(line for line in report.lines() if line.startswith("FAIL"))
            return skipped(f"GPU verification failed: {bad[:300]}", worst)
        engine.warmup()
        track_a = sum(s.track == "A" for s in engine.plan.segments)
        share = track_a_flop_share(bundle)
        for b in args.batches:
            gpu = [torch.from_numpy(x).cuda() for x in images[b]]
            for row, on_gpu in rows:
                t = time_host(torch, engine.run, gpu if on_gpu else images[b], args.warmup, args.iters)
                out.append(
                    {
                        "name": f"{name}/{row}",
                        "batch": b,
                        **extra,
                        **t,
                        "track_a_segments": track_a,
                        "segments": len(engine.plan.segments),
                        "track_a_flop_share": share,
                        "verify_worst_rel_l2": round(worst, 6),
                    }
                )
                print(f"[{name}/{row}] N={b}: {t['median_ms']:.3f} ms")
    finally:
        engine.close()
    return out


def iree_only_rows(
    torch: Any, name: str, precision: str, bundle: Path, images: dict[int, list[np.ndarray]], args: Any
) -> list[dict]:
    """Each IREE-only variant beside ``bundle`` as its own row (`<zoo>/iree_only/<variant>`), timed and
    verified like the dualtrack_api row, then the summary rows (:func:`best_iree_only`)."""
    variants: list[dict] = []
    for path in iree_only_variants(bundle):
        # The config as the manifest records it, read as JSON: a variant that does not open (its
        # model.onnx missing, say) still gets its row, refused by Engine.load with the reason.
        cfg = json.loads((path / "manifest.json").read_text())["config"]
        extra = {
            "variant": path.name,
            "precision": cfg["precision"],
            "track_b_flags": [*cfg["track_b"]["flags"], *cfg["track_b"]["cuda_flags"]],
        }
        variants += engine_rows(torch, name, path, images, args, ((f"{IREE_ONLY}/{path.name}", True),), extra)
    return variants + best_iree_only(name, precision, variants, args.batches)


def measured(row: dict) -> str:
    """A skipped row's error in a few words: its worst relative L2 where the check measured one."""
    return f"rel L2 {row['verify_worst_rel_l2']:.3g}" if "verify_worst_rel_l2" in row else "not loaded"


def best_iree_only(name: str, precision: str, variants: list[dict], batches: list[int]) -> list[dict]:
    """The `<zoo>/iree_alone` row at each batch size: the fastest variant of the zoo bundle's precision
    that verified on the GPU (the row names it); `<zoo>/iree_alone_<precision>` the same for each other
    precision built (fp32: a labelled extra, never the comparison). Where no variant of a precision
    verified, its row says `skipped` with each variant's reason and error: never a time for a wrong result."""
    out: list[dict] = []
    for prec in sorted({v["precision"] for v in variants}, key=lambda p: p != precision):
        row = IREE_ALONE if prec == precision else f"{IREE_ALONE}_{prec}"
        mine = [v for v in variants if v["precision"] == prec]
        for b in batches:
            timed = [v for v in mine if v["batch"] == b and "median_ms" in v]
            if timed:
                best = min(timed, key=lambda v: v["median_ms"])
                out.append({**best, "name": f"{name}/{row}", "of_variants": len({v["variant"] for v in mine})})
                continue
            why = ", ".join(f"{v['variant']} {measured(v)}" for v in mine if v["batch"] == b)
            out.append(
                {
                    "name": f"{name}/{row}",
                    "batch": b,
                    "precision": prec,
                    "skipped": f"no variant verified on the GPU ({why}; each variant's row says why)",
                }
            )
    return out


def _normalisation(torch: Any) -> tuple[Any, Any]:
    mean = torch.from_numpy(MEAN * 255).cuda().view(1, 3, 1, 1)
    return mean, torch.from_numpy(1 / (STD * 255)).cuda().view(1, 3, 1, 1)


def torch_network(torch: Any, zoo: Any, name: str, size: tuple[int, int]) -> tuple[Any, Any]:
    """The seeded export's network, fp32 channels_last on the GPU (``.half()`` it before running the
    other), and the whole inference as torch runs it (uint8 NHWC images -> normalised fp16 -> network
    -> softmax probabilities and the argmax mask), uncompiled: the torch rows compile it,
    bench/kernel_profile.py --torch profiles it."""
    net = zoo.build_model(name, size=size).eval().cuda().to(memory_format=torch.channels_last)
    mean, inv = _normalisation(torch)

    def whole(x: Any) -> tuple[Any, Any]:
        f = ((x.permute(0, 3, 1, 2).float() - mean) * inv).half().contiguous(memory_format=torch.channels_last)
        y = net(f)
        y = y["out"] if isinstance(y, dict) else y
        probs = torch.softmax(y.float(), dim=1)
        return probs, probs.argmax(dim=1).to(torch.uint8)

    return net, whole


def torch_rows(
    torch: Any, zoo: Any, name: str, size: tuple[int, int], ref_probs: np.ndarray | None, images, args
) -> list:
    """torch eager and torch.compile on the seeded export's network. ``ref_probs``: onnxruntime's on
    the bundle's model, the check of the torch rows; None for a re-weighted bundle (bench/reweight.py),
    whose weights are not torch's: the rows are then checked against torch's own fp32 run."""
    # A fresh dynamo per model: past its cache size limit torch.compile silently runs eager (a "first call"
    # of 0.1 s and eager times, seen from the fifth model of one process on).
    torch._dynamo.reset()
    net, whole = torch_network(torch, zoo, name, size)
    against = "onnxruntime"
    if ref_probs is None:
        with torch.no_grad():
            x = torch.from_numpy(images[1][0]).cuda()
            mean, inv = _normalisation(torch)
            y = net(((x.permute(0, 3, 1, 2).float() - mean) * inv).contiguous(memory_format=torch.channels_last))
            ref_probs = torch.softmax((y["out"] if isinstance(y, dict) else y).float(), dim=1).cpu().numpy()
        against = "torch fp32 (a re-weighted bundle)"
    net.half()

    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        modes = (("torch_eager_cl", None), ("torch_compile_cudagraphs", "reduce-overhead"))
        for row, mode in (m for m in modes if not (args.quick and m[1] is None)):
            fn = whole if mode is None else torch.compile(whole, mode=mode, dynamic=False)
            t0 = time.perf_counter()
            probs = fn(torch.from_numpy(images[1][0]).cuda())[0].cpu().numpy()
            first = time.perf_counter() - t0
            err = common.rel_l2(ref_probs, probs)
            print(f"[{name}/{row}] probs vs {against} at N=1: rel L2 {err:.2e}; first call {first:.1f} s")
            if not err <= (CHECK_REL_L2 if against == "onnxruntime" else CHECK_SELF_REL_L2):
                rows += [
                    {"name": f"{name}/{row}", "batch": b, "skipped": f"probs differ from {against}: {err:.2e}"}
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


def write_result(out: Path, commit: str, gpu: str, driver: str, torch_version: str, rows: list[dict]) -> Path:
    result = {
        "commit": commit,
        "gpu": gpu,
        "driver": driver,
        "torch": torch_version,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"zoo_bench-{commit[:10]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", action="append", type=Path, required=True, help="a zoo bundle (folder = zoo name)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--input-sets", type=int, default=4)
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="only the rows the corpus is judged by: dualtrack_api, torch_compile_cudagraphs, iree_alone",
    )
    p.add_argument(
        "--dwconv-cols",
        action="store_true",
        help="A/B: the depthwise 3x3s on the column entries (DwConvSpec.cols, off by default; rows say dwconv_cols)",
    )
    p.add_argument(
        "--dwconv-tile3",
        action="store_true",
        help="A/B: the depthwise 3x3s on their own tiled entries (DwConvSpec.tile3, off by default; rows say "
        "dwconv_tile3)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the torch.compile rows (an A/B's second run)")
    args = p.parse_args(argv)

    import onnxruntime as ort
    import torch

    from dualtrack import kernels

    if args.dwconv_cols:  # the registry the engine prepares its calls from, before any bundle loads
        registry = cast(dict, kernels.KERNELS)
        registry["dwconv"] = replace(registry["dwconv"], cols=True)
    if args.dwconv_tile3:
        registry = cast(dict, kernels.KERNELS)
        registry["dwconv"] = replace(registry["dwconv"], tile3=True)

    from dualtrack.compiler.bundle_writer import load_model
    from dualtrack.contract.bundle import Bundle

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
        ref_probs = None
        if not (bundle / "weights.regrow.npz").is_file():
            sess = ort.InferenceSession(load_model(b).SerializeToString(), providers=["CPUExecutionProvider"])
            ref_probs = sess.run(["probs"], {"image": images[1][0]})[0]
        rows += engine_rows(torch, name, bundle, images, args, API_ROWS[:1] if args.quick else API_ROWS)
        rows += iree_only_rows(torch, name, b.plan.precision, bundle, images, args)
        if not args.no_torch:
            rows += torch_rows(torch, zoo, name, (h, w), ref_probs, images, args)
        for r in rows:
            r.setdefault("dwconv_cols", kernels.KERNELS["dwconv"].cols)
            r.setdefault("dwconv_tile3", kernels.KERNELS["dwconv"].tile3)
        held = prediction_row(name, bundle, rows)
        rows += [held] if held else []
        # Written after every model: a call cut off at its time limit keeps the models it finished.
        path = write_result(args.out, commit, gpu, driver, torch.__version__, rows)
    print(f"\n{gpu}, driver {driver}, commit {commit[:10]} -> {path}")
    print(f"{'row':<52} {'N':>3} {'median ms':>10}")
    for r in rows:
        label = r["name"] if r["name"].endswith(f"/{r.get('variant')}") else f"{r['name']} {r.get('variant', '')}"
        if r["name"].endswith("/prediction"):
            est = f"predicted {r['predicted_us']:.0f} us vs IREE alone {r['predicted_iree_alone_us']:.0f} us"
            print(f"{r['name']:<52}     {est}; held: {r.get('held')}")
            continue
        print(f"{label.strip():<52} {r['batch']:>3} {r.get('median_ms', 'skipped: ' + str(r.get('skipped'))[:40]):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
