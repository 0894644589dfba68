"""FP8 against fp16 on the GPU (issue 42, delivery 4): one model's fp16 bundle and its fp8 bundle, same weights.

    PYTHONPATH=pipeline python bench/fp8_bench.py --dir .carry_fp8 --out bench/results

`--dir` holds the pairs bench/prepare_fp8.sh builds: `unet` + `unet_fp8` (the reference U-Net,
configs/unet.yaml for sm_90a and configs/unet_fp8.yaml) and `zoo/<name>` + `zoo/<name>.fp8` (a corpus
model and its fp8 build, bench/corpus_configs.py --fp8); `--pair PREFIX FP16 FP8` names one more.
A pair is made whole first: the fp8 bundle's model.onnx and weights.bin, where they are the fp16 bundle's,
travel once and are copied back; a corpus pair sealed by bench/fp8_seal.py (no weights.bin) is grown back,
both bundles from the fp16 bundle's weights.regrow.npz (`reweight.py regrow FP16 FP8`).

Rows (names as bench/bench.py and bench/zoo_bench.py write them, so they compare across result files):

    dualtrack_api              the reference fp16 bundle through Engine.run on a torch CUDA uint8 tensor
    fp8/dualtrack_api          its fp8 bundle, the same call
    <zoo>/dualtrack_api        a corpus fp16 bundle (sm_90a only), the same call
    <zoo>/fp8/dualtrack_api    its fp8 bundle

at N=1 and N=8. Before timing, each engine passes its first-load check and `verify_engine` at its
build's tolerance (an fp8 bundle's: twice its fp8 plan's measured error, compiler/fp8.py); a bundle
refused there gets rows that say `skipped` and why. Each row has `mask_agree_fp32`: the % of mask pixels
its engine (N=1, numpy in) shares with fp32 onnxruntime on the CPU (the bundle's model upcast) over
`--agree-images` seeded random images; the fp8 rows also `mask_agree_fp16` (against the fp16 engine's
masks on the same images), `speedup` (fp16 median / fp8 median at that N), how many convolutions run
fp8 and the agreement its build measured (precision.json). Timing as bench.py's dualtrack_api row
(`time_api`: host wall time around Engine.run with the device drained after).
Writes fp8_bench-<commit10>.json (commit, GPU, driver, rows); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench as common  # noqa: E402  (bench/bench.py: git, GPU name, time_api)

API = "dualtrack_api"
FP8 = "fp8"
REGROW = "weights.regrow.npz"
WEIGHTS = "weights.bin"
MODEL = "model.onnx"
IMAGE_SEED = 4242  # not the builds' calibration seed (0): the agreement here is on images they never saw


def pairs_in(folder: Path) -> list[tuple[str, Path, Path]]:
    """(row prefix, fp16 bundle, fp8 bundle) for each pair under ``folder`` whose both bundles are there:
    `unet` + `unet_fp8` (prefix ''), `zoo/<name>` + `zoo/<name>.fp8` (prefix '<name>/')."""
    out = []
    if (folder / "unet").is_dir() and (folder / "unet_fp8").is_dir():
        out.append(("", folder / "unet", folder / "unet_fp8"))
    for fp8 in sorted((folder / "zoo").glob(f"*.{FP8}")):
        fp16 = fp8.with_name(fp8.name[: -len(FP8) - 1])
        if fp16.is_dir() and fp8.is_dir():
            out.append((f"{fp16.name}/", fp16, fp8))
    return out


def row_name(prefix: str, fp8: bool) -> str:
    return f"{prefix}{FP8 + '/' if fp8 else ''}{API}"


def agree_pct(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """% of pixels where masks ``a[i]`` and ``b[i]`` give the same class, over all the pairs."""
    if len(a) != len(b) or not a:
        raise ValueError(f"{len(a)} masks against {len(b)}: compare the same images")
    same = sum(int(np.sum(np.asarray(x) == np.asarray(y))) for x, y in zip(a, b, strict=True))
    total = sum(np.asarray(x).size for x in a)
    return round(100.0 * same / total, 4)


def with_speedup(fp16_rows: list[dict], fp8_rows: list[dict]) -> list[dict]:
    """``fp8_rows``, each given `speedup` (the fp16 row's median_ms / its own at the same batch) where both
    were timed."""
    base = {r["batch"]: r["median_ms"] for r in fp16_rows if r.get("median_ms")}
    out = []
    for r in fp8_rows:
        ms = r.get("median_ms")
        out.append({**r, "speedup": round(base[r["batch"]] / ms, 3) if ms and r["batch"] in base else None})
    return out


def build_record(bundle: Path) -> dict[str, Any]:
    """What the build chose and measured (precision.json): convolutions in fp8, agreement per image set."""
    from dualtrack.contract.precision import PrecisionRecord

    rec = PrecisionRecord.read(bundle)
    if rec is None:
        return {"precision": "fp16"}
    if not rec.applied:
        return {"precision": "fp16", "fp8_note": rec.note}
    return {
        "precision": FP8,
        "fp8_convs": sum(x.precision == FP8 for x in rec.layers),
        "convs": len(rec.layers),
        "build_agree_fp32": {a.images: round(a.vs_fp32, 3) for a in rec.agreement},
        "agreement_floor": rec.floor,
    }


def table(rows: list[dict]) -> str:
    """The printed table: one line a row."""
    head = f"{'row':42s} {'N':>2s} {'median ms':>10s} {'speedup':>8s} {'agree fp32':>11s} {'agree fp16':>11s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['name']:42s} {r['batch']:>2d} skipped: {r['skipped'][:90]}")
            continue
        cells = [r.get("speedup"), r.get("mask_agree_fp32"), r.get("mask_agree_fp16")]
        sp, a32, a16 = (f"{c:.3f}" if c is not None else "-" for c in cells)
        lines.append(f"{r['name']:42s} {r['batch']:>2d} {r['median_ms']:>10.3f} {sp:>8s} {a32:>11s} {a16:>11s}")
    return "\n".join(lines)


def completed(fp16: Path, fp8: Path) -> None:
    """Make a carried pair whole: the fp8 bundle's model.onnx and weights.bin where they travelled once (the
    fp16 bundle's; hashes checked at load), a sealed pair's weights and reference cases grown back, both from
    the fp16 bundle's seed file (bench/reweight.py)."""
    for f in (MODEL, WEIGHTS):
        if not (fp8 / f).is_file() and (fp16 / f).is_file():
            shutil.copyfile(fp16 / f, fp8 / f)
    if (fp16 / REGROW).is_file() and not ((fp16 / WEIGHTS).is_file() and (fp8 / WEIGHTS).is_file()):
        import reweight

        reweight.regrow(fp16, [fp8])


def images(spec: Any, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` seeded random inputs of ``batch`` images in the input's shape and dtype."""
    rng = np.random.default_rng(seed)
    shape = (batch, *spec.shape[1:])
    return [rng.integers(0, 256, shape, dtype=np.uint8).astype(spec.dtype) for _ in range(count)]


def fp32_masks(bundle: Path, plan: Any, xs: list[np.ndarray]) -> list[np.ndarray]:
    """fp32 onnxruntime's masks (CPU) on the bundle's model, upcast, as the fp8 build compares them."""
    from dualtrack.compiler import verify
    from dualtrack.compiler.bundle_writer import load_model
    from dualtrack.compiler.fp8 import mask_of
    from dualtrack.contract.bundle import Bundle

    session = verify.ort_session(verify.upcast(load_model(Bundle.open(bundle))))
    return [mask_of(plan, verify.run_ort(session, {plan.inputs[0].name: x})) for x in xs]


def engine_masks(engine: Any, xs: list[np.ndarray]) -> list[np.ndarray]:
    from dualtrack.compiler.fp8 import mask_of

    return [mask_of(engine.plan, engine.run(x)) for x in xs]


def loaded(bundle: Path) -> tuple[Any, str | None]:
    """The engine on the GPU, past its first-load check and ``verify_engine`` at its build's tolerance;
    else None and why."""
    from dualtrack.compiler.verify import verify_engine
    from dualtrack.errors import DualtrackError
    from dualtrack.runtime.engine import Engine

    try:
        engine = Engine.load(bundle, "cuda")  # the first load on this GPU checks it (runtime/selfcheck.py)
    except DualtrackError as e:
        return None, f"refused at load: {e}"
    report = verify_engine(engine, samples=1, tol=engine.bundle.tolerance())
    worst = max((c.rel_l2 for c in report.checks if not c.integer), default=0.0)
    print(f"[{bundle}] verify on the GPU: {'passed' if report.passed else 'FAILED'} (worst rel L2 {worst:.2e})")
    if not report.passed:
        engine.close()
        bad = "; ".join(line for line in report.lines() if line.startswith("FAIL"))
        return None, f"GPU verification failed: {bad[:300]}"
    return engine, None


def bundle_rows(
    torch: Any, name: str, bundle: Path, args: Any, ref: dict[str, Any]
) -> tuple[list[dict], list[np.ndarray] | None]:
    """``bundle``'s rows (``name`` at each batch) and its masks on the agreement images. ``ref`` carries the
    fp32 masks (computed on the first bundle's model, kept for the second) and the fp16 engine's masks."""
    extra = build_record(bundle)
    engine, why = loaded(bundle)
    if engine is None:
        print(f"[{name}] skipped: {why}")
        return [{"name": name, "batch": b, **extra, "skipped": why} for b in args.batches], None
    try:
        xs = images(engine.input_spec, 1, args.agree_images, IMAGE_SEED)
        if "fp32" not in ref:
            ref["fp32"] = fp32_masks(bundle, engine.plan, xs)
        masks = engine_masks(engine, xs)
        agree = {"mask_agree_fp32": agree_pct(masks, ref["fp32"]), "agree_images": len(xs)}
        if ref.get("fp16") is not None:
            agree["mask_agree_fp16"] = agree_pct(masks, ref["fp16"])
        engine.warmup()
        rows = []
        for b in args.batches:
            host = images(engine.input_spec, b, args.input_sets, IMAGE_SEED + b)
            t = common.time_api(torch, engine, [torch.from_numpy(x).cuda() for x in host], args.warmup, args.iters)
            rows.append({"name": name, "batch": b, **extra, **agree, **t})
            print(f"[{name}] N={b}: {t['median_ms']:.3f} ms, masks as fp32's on {agree['mask_agree_fp32']:.3f}%")
    finally:
        engine.close()
    return rows, masks


def pair_rows(torch: Any, prefix: str, fp16: Path, fp8: Path, args: Any) -> list[dict]:
    """The fp16 rows, then the fp8 rows with their agreement against the fp16 engine and their speedup."""
    completed(fp16, fp8)
    ref: dict[str, Any] = {}
    rows16, ref["fp16"] = bundle_rows(torch, row_name(prefix, False), fp16, args, ref)
    rows8, _ = bundle_rows(torch, row_name(prefix, True), fp8, args, ref)
    return rows16 + with_speedup(rows16, rows8)


def write_result(out: Path, commit: str, gpu: str, driver: str, rows: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fp8_bench-{commit[:10]}.json"
    path.write_text(json.dumps({"commit": commit, "gpu": gpu, "driver": driver, "rows": rows}, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(".carry_fp8"), help="the pairs bench/prepare_fp8.sh built")
    ap.add_argument("--pair", nargs=3, action="append", default=[], metavar=("PREFIX", "FP16", "FP8"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--input-sets", type=int, default=3, help="inputs rotated through (no warm-L2 flattery)")
    ap.add_argument("--agree-images", type=int, default=4, help="N=1 images the masks are compared on")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--commit", default=os.environ.get("DUALTRACK_COMMIT") or common._git("rev-parse", "HEAD"))
    args = ap.parse_args(argv)
    pairs = pairs_in(args.dir) + [(p, Path(a), Path(b)) for p, a, b in args.pair]
    if not pairs:
        print(
            f"fp8_bench: no fp16 + fp8 bundle pair in {args.dir}; build them with bench/prepare_fp8.sh", file=sys.stderr
        )
        return 2
    import torch

    rows = [r for prefix, fp16, fp8 in pairs for r in pair_rows(torch, prefix, fp16, fp8, args)]
    gpu, driver = common.gpu_and_driver()
    path = write_result(args.out, args.commit or "unknown", gpu, driver, rows)
    print(f"wrote {path} ({gpu}, driver {driver})")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
