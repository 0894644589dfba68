"""A bundle's first load on a GPU checks what that GPU computes, because the build could not.

The build verifies every bundle on the CPU (IREE llvm-cpu and the kernels' numpy semantics). The
GPU runs other code: IREE's CUDA modules, the driver's JIT of their PTX, the hand-written kernels. A
toolchain can get that code wrong where the CPU code is right: IREE 3.13's CUDA code for LR-ASPP in
fp16 computes garbage from MobileNetV3's first inverted residual on, while its fp32 and its CPU code
agree with onnxruntime to 1e-6 (bench/results/lraspp_diag-c14dd25-fp16.log, -fp32.log). Serving such a bundle would
be silent wrong output. So the first :meth:`Engine.load` of a bundle on a GPU runs
:func:`check_cases` once: the reference cases the build stored in the bundle (contract/cases.py: K
images and onnxruntime's outputs for them) through the whole plan at every compiled batch size, the
K images tiled over the rows, each row compared with its image's reference at the build's tolerance
(contract/checks.py, the comparison the build's verification uses). No onnxruntime and no compiler
run here: a serving process has neither. The result is recorded per bundle and GPU (the cache's
``verified/``); a bundle that fails is refused, and later loads read the record.
``DUALTRACK_GPU_SELF_CHECK=0`` skips the check.

The check is of the whole plan: which segment computes wrong is for the build tools to find,
``DUALTRACK_GPU_SELF_CHECK=0 dualtrack verify BUNDLE --device cuda`` (every segment against
onnxruntime) on a machine that has them, as the refusal says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dualtrack import atomic
from dualtrack.contract.checks import Report
from dualtrack.errors import VerificationError
from dualtrack.runtime.replay import compare, log_fallback, random_input


class GpuCheckError(VerificationError):
    """The first-load check's refusal (same exit code as any VerificationError); ``record`` is what it
    measured: the report's JSON (every check with its error), as the cache keeps it."""

    def __init__(self, message: str, record: dict[str, Any], *, detail: str = "") -> None:
        super().__init__(message, detail=detail)
        self.record = record


def check_cases(engine: Any) -> Report:
    """Run the bundle's reference cases through ``engine`` at every batch size of its plan; the
    build's tolerance (the config's ``verify.tolerance``, else the precision's default). On a GPU,
    Track A outputs are filled with NaN before every run, so an element a kernel fails to write
    fails the check instead of passing with stale data."""
    bundle, plan = engine.bundle, engine.plan
    tol = bundle.tolerance()
    cases = bundle.cases
    poison_before = getattr(engine.backend, "poison", None)
    if poison_before is not None:
        engine.backend.poison = True
    try:
        checks = []
        if plan.fixed_shape:  # its one case is the input's one shape, run whole
            checks += cases.check_whole(engine.run(cases.inputs), tol, "plan")
        for b in () if plan.fixed_shape else plan.batch_sizes:
            checks += cases.check(engine.run(cases.batch(b)), b, tol, f"plan b{b}")
    finally:
        if poison_before is not None:
            engine.backend.poison = poison_before
    return Report(engine.device, plan.precision, tol, checks, cases.seed)


def record_path(cache_dir: Path, build_key: str, device: str) -> Path:
    """Where the result for this bundle (its build key) on this device (name, cc, driver) is kept."""
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in device)
    return cache_dir / "verified" / f"{build_key[:24]}-{safe}.json"


def self_check(
    engine: Any, device: str, cache_dir: Path, *, check: Callable[[Any], Report] | None = None
) -> dict[str, Any]:
    """Check ``engine`` on its device once (:func:`check_cases`); the record of a passed check makes
    later calls free.

    ``device`` names the device as the record should (GPU name, compute capability, driver). Raises
    GpuCheckError, with the first failing check and the way out, when the device gets it wrong.
    """
    manifest = engine.bundle.manifest
    path = record_path(cache_dir, manifest.build_key, device)
    try:
        record = json.loads(path.read_text())
        if record.get("passed") is True:
            return record
    except (OSError, ValueError):
        pass  # no record yet (or an unreadable one): check
    report = (check or check_cases)(engine)
    record = {**report.to_json(), "passed": report.passed, "device": device, "build_key": manifest.build_key}
    atomic.write_text(path, json.dumps(record, indent=2) + "\n")
    try:
        report.raise_if_failed()
    except VerificationError as e:
        raise GpuCheckError(
            f"{engine.bundle.root} computes wrong results on {device}: {e.message}; the CPU build verified, so "
            "this GPU's code for it is wrong: rebuild with another `precision` or `track_b` flags (IREE 3.13's "
            "fp16 CUDA code was right where its default was not with `track_b: {cuda_flags: "
            "[--iree-codegen-llvmgpu-use-vector-distribution=false, "
            "--iree-codegen-llvmgpu-use-tile-and-fuse-matmul=false]}`; "
            "to find the segment, run `DUALTRACK_GPU_SELF_CHECK=0 dualtrack verify BUNDLE --device cuda` where the "
            "build tools are installed), or set DUALTRACK_GPU_SELF_CHECK=0 to load it regardless",
            record,
            detail=e.detail,
        ) from None
    return record


def replay_check(engine: Any, device: str, cache_dir: Path, *, seed: int = 0) -> dict[str, Any]:
    """Run every replayed Track B module (runtime/replay.py) once both ways, replay and IREE runtime,
    on the same random inputs; a module whose results are not bit-identical goes back to the IREE
    runtime for good on this device (a warning names it). The record (``verified/``, per bundle and
    device) makes later loads apply the outcome without running it again."""
    backend = engine.backend
    track_b = backend.track_b
    manifest = engine.bundle.manifest
    path = record_path(cache_dir, manifest.build_key, device).with_suffix(".replay.json")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = None
    plan = engine.bundle.plan
    if record is None or record.get("build_key") != manifest.build_key:
        rng = np.random.default_rng(seed)
        modules: list[dict[str, Any]] = []
        for seg in (s for s in plan.segments if s.track == "B"):
            for batch in plan.batch_sizes:
                if track_b.decide(seg, batch).path != "replay":
                    continue
                host = {t.name: random_input(t.at_batch(batch), t.dtype, rng) for t in seg.inputs}
                ins = {k: backend.from_host(v) for k, v in host.items()}
                replayed = {k: backend.to_host(v) for k, v in track_b.replay(seg, batch, ins, backend.stream).items()}
                iree, _ms = track_b.run(seg, batch, ins, before_call=backend.stream.synchronize)
                diffs = [f"{k}: {d}" for k in replayed if (d := compare(replayed[k], backend.to_host(iree[k])))]
                modules.append({"segment": seg.name, "batch": batch, "identical": not diffs, "diff": "; ".join(diffs)})
        record = {"build_key": manifest.build_key, "device": device, "seed": seed, "modules": modules}
        atomic.write_text(path, json.dumps(record, indent=2) + "\n")
    by_name = {s.name: s for s in plan.segments}
    for m in record["modules"]:
        if not m["identical"] and m["segment"] in by_name:
            seg = by_name[m["segment"]]
            track_b.replayer.refuse(seg, m["batch"], f"replay differs from the IREE runtime ({m['diff']})")
            log_fallback(seg, m["batch"], m["diff"])
    return record
