"""Seal an fp8 corpus bundle with its fp16 bundle's re-drawn weights, and calibrate it again on them.

    python bench/fp8_seal.py FP16 FP8   # here, after both `dualtrack build`s (bench/prepare_fp8.sh)

Why: bench/reweight.py replaces a corpus bundle's weights with seeded draws so that they need not travel
(its docstring). An fp8 bundle sealed beside its fp16 bundle (``reweight.py seal FP16 FP8``) gets those
weights too, but what its build computed from the export's weights would no longer hold: each activation's
e4m3 scale (``x_scale``, from the calibration images' activations), the per-layer choice (each fp8
layer's error against fp16), the agreement in precision.json, and the bundle's tolerance, which reweight
sets to the re-weighted fp16 network's and so drops the fp8 plan's widening (compiler/fp8.py: twice its
measured error; the GPU's first-load check holds the bundle to it). The weight scales need nothing: the
runtime quantizes each layer's weights per output channel when it uploads them (kernels/conv_fp8.py).

So this seals both, then runs the fp8 stage again (``fp8.build_fp8``, the same calibration settings and
images) on the re-weighted model and the fp16 bundle's plan, and writes its plan, precision.json,
tolerance (the fp16 bundle's judged tolerance widened as the build widens it) and reference cases. It
refuses where the fp8 bundle's plan is not the fp16 plan lowered with its recorded layers (not the fp8
build of the same plan), or where the new calibration moves a layer between fp8 and fp16 (the kernels
compiled into the bundle were chosen for the old choice: build it again instead).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import reweight  # noqa: E402  (bench/reweight.py; puts pipeline/ on the path)

from dualtrack.compiler import fp8  # noqa: E402
from dualtrack.compiler.bundle_writer import load_model, segment_model  # noqa: E402
from dualtrack.compiler.config import CalibrationConfig  # noqa: E402
from dualtrack.compiler.verify import Tolerance  # noqa: E402
from dualtrack.contract.bundle import CASES, MANIFEST, Bundle  # noqa: E402
from dualtrack.contract.plan import Plan  # noqa: E402
from dualtrack.contract.precision import PRECISION_FILE, PrecisionRecord  # noqa: E402


def check_lowered(fp16_plan: Plan, fp8_plan: Plan, record: PrecisionRecord) -> None:
    """Raise unless ``fp8_plan`` is ``fp16_plan`` lowered with ``record``'s layers."""
    if fp8.lower(fp16_plan, record.layers).dumps() != fp8_plan.dumps():
        raise SystemExit("fp8_seal: the fp8 bundle's plan is not the fp16 bundle's lowered; build both from one config")


def same_choice(old: PrecisionRecord, new: PrecisionRecord) -> None:
    """Raise where a layer's precision moved (the bundle's compiled kernels were chosen for the old plan)."""
    pairs = zip(old.layers, new.layers, strict=True)
    moved = [f"{a.layer}: {a.precision} -> {b.precision}" for a, b in pairs if a.precision != b.precision]
    if moved:
        raise SystemExit(f"fp8_seal: on the re-weighted model {', '.join(moved)}; rebuild the fp8 bundle from it")


def refit(fp16_dir: Path, fp8_dir: Path) -> PrecisionRecord:
    """The fp8 stage again on ``fp8_dir``'s (re-weighted) model and ``fp16_dir``'s plan; its outcome written."""
    a = Bundle.open(fp16_dir)
    b = Bundle.open(fp8_dir)
    manifest = json.loads((fp8_dir / MANIFEST).read_text())
    old = PrecisionRecord.read(fp8_dir)
    if old is None or not old.applied:
        raise SystemExit(f"fp8_seal: {fp8_dir} runs no fp8 layer (precision.json); nothing to calibrate")
    check_lowered(a.plan, b.plan, old)
    cal = CalibrationConfig.model_validate(manifest["config"]["calibration"] or {})
    seg_models = [segment_model(a, seg) for seg in a.plan.segments]
    done = fp8.build_fp8(cal, load_model(b), a.plan, seg_models, {"sm_90a": True}, print)
    same_choice(old, done.record)
    fp16_tol = Tolerance(**json.loads((fp16_dir / MANIFEST).read_text())["tolerance"])
    tol = fp8.widest(fp16_tol, done).to_json()
    manifest["plan"] = done.plan.to_json()
    manifest["tolerance"] = tol
    if manifest.get("verification"):  # none where the build did not verify (track_b.cpu: false)
        manifest["verification"]["tolerance"] = tol
    manifest["notes"] = [n for n in manifest["notes"] if not n.startswith("fp8:")] + [done.record.headline()]
    reweight._record(fp8_dir, manifest, {PRECISION_FILE: json.dumps(done.record.to_json(), indent=2).encode()})
    seed = int(np.load(fp8_dir / CASES)["seed"])  # the seed reweight.seal drew the cases with
    reweight._record(fp8_dir, manifest, {CASES: reweight._cases(fp8_dir, seed)})
    Bundle.open(fp8_dir)  # every hash checks out
    return done.record


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    fp16_dir, fp8_dir = Path(argv[0]), Path(argv[1])
    reweight.seal(fp16_dir, [fp8_dir])
    record = refit(fp16_dir, fp8_dir)
    print(f"fp8_seal {fp8_dir}: {record.headline()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
