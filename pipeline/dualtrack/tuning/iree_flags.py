"""IREE flag search for Track B segments: compile candidates, verify each on the GPU, keep the fastest.

Two stages, because the IREE compiler and the GPU are often on different machines (the compiler
wheel is large; serving machines rarely carry it):

- :func:`prepare_kit` (needs `iree-compile`, no GPU): every Track B segment of a config's plan,
  compiled with every candidate flag set for one CUDA target and each batch size, plus the segment's
  ONNX with its weights, into a self-contained folder (written to a temporary sibling and renamed);
- :func:`time_kit` (needs a GPU, no compiler): for each segment and batch, fresh random inputs, the
  onnxruntime reference once, then every candidate is run and checked against it BEFORE it is timed
  (FACTS 11b: `--iree-codegen-llvmgpu-use-direct-convolution` compiles, runs and is wrong); the
  fastest passing candidate is the winner. The baseline is the config's own flags.

`dualtrack tune CONFIG --track-b` runs both where both are available; `--prepare-kit DIR` and
`--kit DIR` split them. Winners go into the tuning file that `build` reads (:mod:`dualtrack.compiler.tuned`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from dualtrack.compiler import frontend, partition
from dualtrack.compiler import iree_build as track_b
from dualtrack.compiler.config import BuildConfig, Tolerance, load_config
from dualtrack.compiler.tuned import RECORD_KIND, measured_for, record_key, segment_key
from dualtrack.contract import arch
from dualtrack.contract.plan import Segment, TensorSpec
from dualtrack.errors import BundleError, ConfigError, ToolError
from dualtrack.settings import Settings

KIT_FORMAT = "dualtrack-iree-kit-1"
KIT_FILE = "kit.json"
# The weights, once: segment graphs are stored without them. A bundle built from the same model has
# the same model.onnx, so a kit can travel without it and borrow the bundle's (checked by hash).
MODEL_FILE = "model.onnx"
BASELINE = "config"  # the candidate made of the config's own track_b.flags + cuda_flags

# Candidate flag sets (besides the config's own). Stated, small, and each one a known lever on
# IREE 3.13's CUDA path (FACTS 11b measured the first four on the whole model).
CANDIDATES: dict[str, tuple[str, ...]] = {
    "default": (),
    "O3": ("--iree-opt-level=O3",),
    "O3-fusion": ("--iree-opt-level=O3", "--iree-dispatch-creation-enable-aggressive-fusion"),
    "O3-fusion-igemm": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-codegen-llvmgpu-use-igemm",
    ),
    "O3-fusion-transposes": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-opt-aggressively-propagate-transposes",
    ),
    "O3-fusion-im2col": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-global-opt-use-im2col-for-convs",
    ),
    # Levers on the reductions (softmax, argmax) and layout changes of the pre/post segments.
    "O3-transposes-vecdist": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-opt-aggressively-propagate-transposes",
        "--iree-codegen-llvmgpu-use-vector-distribution",
    ),
    "O3-transposes-reduction-vecdist": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-opt-aggressively-propagate-transposes",
        "--iree-codegen-llvmgpu-use-reduction-vector-distribution",
    ),
    "O3-transposes-split-reduction": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-opt-aggressively-propagate-transposes",
        "--iree-dispatch-creation-enable-split-reduction",
    ),
    "O3-transposes-through-conv": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-opt-aggressively-propagate-transposes",
        "--iree-global-opt-propagate-transposes-through-conv",
    ),
    "O3-reshape-movement": (
        "--iree-opt-level=O3",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-dispatch-creation-enable-aggressive-reshape-movement",
    ),
    # FACTS 11b: compiles, runs, and is WRONG on convolutions; kept so the search shows it rejected.
    "O3-direct-conv": (
        "--iree-opt-level=O3",
        "--iree-codegen-llvmgpu-use-direct-convolution",
        "--iree-codegen-llvmgpu-use-tile-and-fuse-convolution",
    ),
}


@dataclass(frozen=True)
class KitSegment:
    name: str
    key: str
    onnx: str  # file in the kit: the segment's graph, weights in the kit's model.onnx
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    modules: dict[str, dict[int, str]]  # candidate -> batch -> vmfb file

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "onnx": self.onnx,
            "inputs": [asdict(t) for t in self.inputs],
            "outputs": [asdict(t) for t in self.outputs],
            "modules": {c: {str(b): f for b, f in per.items()} for c, per in self.modules.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KitSegment:
        return cls(
            d["name"],
            d["key"],
            d["onnx"],
            tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            tuple(TensorSpec.from_json(t) for t in d["outputs"]),
            {c: {int(b): f for b, f in per.items()} for c, per in d["modules"].items()},
        )


@dataclass(frozen=True)
class Kit:
    root: Path
    config: str
    iree_target: str
    batch_sizes: tuple[int, ...]
    candidates: dict[str, tuple[str, ...]]
    tolerance: Tolerance
    compiler: str
    model_sha256: str
    segments: tuple[KitSegment, ...]

    @classmethod
    def open(cls, root: str | Path) -> Kit:
        root = Path(root)
        path = root / KIT_FILE
        if not path.is_file():
            raise BundleError(
                f"{root} is not a tuning kit (no {KIT_FILE}); "
                "make one with `dualtrack tune CONFIG --track-b --prepare-kit DIR`"
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise BundleError(f"{path} is not valid JSON ({e.msg}); prepare the kit again") from None
        if d.get("format") != KIT_FORMAT:
            raise BundleError(f"{path} has format {d.get('format')!r}, expected {KIT_FORMAT}; prepare the kit again")
        return cls(
            root,
            d["config"],
            d["iree_target"],
            tuple(d["batch_sizes"]),
            {k: tuple(v) for k, v in d["candidates"].items()},
            Tolerance(**d["tolerance"]),
            d["compiler"],
            d["model_sha256"],
            tuple(KitSegment.from_json(s) for s in d["segments"]),
        )

    def weights(self) -> dict[str, np.ndarray]:
        """The model's initializers, from the kit's model.onnx (checked against the recorded hash)."""
        path = self.root / MODEL_FILE
        if not path.is_file():
            raise BundleError(
                f"{self.root} has no {MODEL_FILE}; copy in the model it was prepared from "
                f"(e.g. a bundle's model.onnx with SHA-256 {self.model_sha256[:12]}...)"
            )
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.model_sha256:
            raise BundleError(f"{path} is not the model this kit was prepared from; copy in the right one")
        return _weights(onnx.load_from_string(data))


def _candidates(cfg: BuildConfig, only: Sequence[str] | None) -> dict[str, tuple[str, ...]]:
    table = {BASELINE: (*cfg.track_b.flags, *cfg.track_b.cuda_flags), **CANDIDATES}
    if only:
        unknown = [n for n in only if n not in table]
        if unknown:
            raise ConfigError(f"unknown IREE flag candidate(s) {', '.join(unknown)}; choose from {', '.join(table)}")
        table = {n: f for n, f in table.items() if n == BASELINE or n in only}
    # Two names with the same flags would be compiled and timed twice: keep the first.
    seen: dict[tuple[str, ...], str] = {}
    return {n: f for n, f in table.items() if seen.setdefault(f, n) == n}


def prepare_kit(
    config: str | Path,
    out: str | Path,
    *,
    target: str | None = None,
    only: Sequence[str] | None = None,
    settings: Settings | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> Kit:
    """Compile every Track B segment of CONFIG's plan with every candidate into the kit folder OUT.

    ``target``: the GPU arch to tune for (default: the config's first target); its IREE target is
    what gets compiled (sm_90a -> cuda-sm_89, FACTS 1/4).
    """
    settings = settings or Settings.from_env()
    cfg = load_config(config)
    arch_name = target or cfg.targets[0]
    res = arch.resolve_targets([arch_name], enable_tma=cfg.enable_tma, iree_target=cfg.track_b.iree_target)[0]
    iree_target = track_b.cuda_target(res.iree_target)
    cands = _candidates(cfg, only)
    cfg, model, segs = _track_b_segments(cfg)
    jobs = [
        track_b.CompileJob(f"{s.name}:{c}", m, b, iree_target, flags)
        for s, m in segs
        for c, flags in cands.items()
        for b in cfg.batch_sizes
    ]
    say(
        f"compiling {len(jobs)} modules: {len(segs)} segment(s) x {len(cands)} candidates"
        f" x {len(cfg.batch_sizes)} batch sizes"
    )
    compiler = track_b.compiler_version()
    results = _compile_candidates(jobs, compiler, settings)
    dest = Path(out)
    with _replaced_folder(dest) as tmp:
        model_bytes = model.SerializeToString()
        (tmp / MODEL_FILE).write_bytes(model_bytes)
        kit_segments, failed = _write_segments(tmp, segs, results)
        manifest = {
            "format": KIT_FORMAT,
            "config": str(config),
            "iree_target": iree_target.name,
            "batch_sizes": list(cfg.batch_sizes),
            "candidates": {k: list(v) for k, v in cands.items()},
            "compile_failures": failed,
            "tolerance": cfg.tolerance().to_json(),
            "compiler": compiler,
            "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
            "segments": [k.to_json() for k in kit_segments],
        }
        (tmp / KIT_FILE).write_text(json.dumps(manifest, indent=1))
    for seg, per in failed.items():
        for cand, err in per.items():
            say(f"{seg}: candidate {cand} does not compile: {err}")
    return Kit.open(dest)


def _track_b_segments(cfg: BuildConfig) -> tuple[BuildConfig, onnx.ModelProto, list[tuple[Segment, onnx.ModelProto]]]:
    """The config after the front end, the named model, and the plan's Track B segments with their models."""
    cfg, fe = frontend.load(cfg)
    model = partition.name_nodes(fe.model)
    plan, seg_models = partition.build_plan(cfg, model, measured_for(cfg))
    segs = [(s, m) for s, m in zip(plan.segments, seg_models, strict=True) if s.track == "B"]
    if not segs:
        raise ConfigError(f"{cfg.model.name}: the plan has no Track B segment, so there are no IREE flags to tune")
    return cfg, model, segs


_Compiled = tuple[track_b.CompileJob, bytes | None, str]  # the job, its module or None, why it failed


def _compile_candidates(jobs: list[track_b.CompileJob], compiler: str, settings: Settings) -> list[_Compiled]:
    """Every job compiled, ``settings.jobs`` at a time; a candidate that does not compile is a result."""
    cache = track_b.ModuleCache(settings.cache_dir / "iree", enabled=settings.use_cache)

    def compile_one(job: track_b.CompileJob) -> _Compiled:
        try:
            return job, track_b.run_job(job, cache, compiler, settings.save_temps).vmfb, ""
        except (ToolError, ConfigError) as e:
            return job, None, str(e).splitlines()[0]

    with ThreadPoolExecutor(max_workers=settings.jobs) as pool:
        return list(pool.map(compile_one, jobs))


@contextlib.contextmanager
def _replaced_folder(dest: Path) -> Iterator[Path]:
    """A fresh folder beside ``dest`` to fill; it replaces ``dest`` when the block succeeds, and is
    removed when it fails, so a kit folder is never half written."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_segments(
    kit: Path, segs: list[tuple[Segment, onnx.ModelProto]], results: list[_Compiled]
) -> tuple[list[KitSegment], dict[str, dict[str, str]]]:
    """Each segment's ONNX (weights stripped) and compiled modules in the kit folder; returns the
    segments' entries and, per segment, the candidates that did not compile and why."""
    kit_segments = []
    failed: dict[str, dict[str, str]] = {}
    for s, m in segs:
        (kit / "segments").mkdir(exist_ok=True)
        onnx_rel = f"segments/{s.name}.onnx"
        onnx.save(partition.strip_initializers(m), str(kit / onnx_rel))
        modules: dict[str, dict[int, str]] = {}
        for job, data, err in results:
            seg_name, cand = job.segment.split(":", 1)
            if seg_name != s.name:
                continue
            if data is None:
                failed.setdefault(s.name, {})[cand] = err
                continue
            rel = f"iree/{s.name}/{cand}/b{job.batch}.vmfb"
            (kit / rel).parent.mkdir(parents=True, exist_ok=True)
            (kit / rel).write_bytes(data)
            modules.setdefault(cand, {})[job.batch] = rel
        kit_segments.append(KitSegment(s.name, segment_key(m), onnx_rel, s.inputs, s.outputs, modules))
    return kit_segments, failed


# -- timing on the GPU ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateResult:
    name: str
    flags: tuple[str, ...]
    passed: bool
    time_ms: float | None
    rel_l2: float | None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "flags": list(self.flags),
            "passed": self.passed,
            "time_ms": self.time_ms,
            "rel_l2": self.rel_l2,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class SegmentResult:
    segment: str
    key: str
    batch: int
    results: tuple[CandidateResult, ...]

    @property
    def baseline(self) -> CandidateResult | None:
        return next((r for r in self.results if r.name == BASELINE), None)

    @property
    def winner(self) -> CandidateResult | None:
        ok = [r for r in self.results if r.passed and r.time_ms is not None]
        return min(ok, key=lambda r: r.time_ms) if ok else None


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def time_kit(
    kit: Kit,
    *,
    iters: int = 30,
    warmup: int = 5,
    seed: int = 0,
    device_index: int = 0,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, Any], list[SegmentResult]]:
    """Verify, then time, every candidate of every segment and batch on the GPU.

    Returns the GPU's identity (name, cc, driver) and one result per (segment, batch).
    """
    import iree.runtime as rt

    from dualtrack.compiler.verify import compare, ort_session, random_input, run_ort
    from dualtrack.runtime.driver import Device
    from dualtrack.runtime.engine import as_dtype
    from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index

    settings = Settings.from_env()
    device = Device(device_index)
    gpu = {"gpu": device.name, "cc": f"{device.cc[0]}.{device.cc[1]}", "driver": device.driver_version}
    dev = IreeDevice.create("cuda", device_index, allocators=settings.iree_allocators, flags=settings.iree_flags)
    out: list[SegmentResult] = []
    all_weights = kit.weights()
    for seg in kit.segments:
        model = partition.attach_initializers(onnx.load(str(kit.root / seg.onnx)), all_weights)
        weights = _weights(model)
        params = parameter_index(weights)
        for batch in kit.batch_sizes:
            rng = np.random.default_rng(seed)
            feeds = {t.name: random_input(t, batch, rng) for t in seg.inputs}
            ref = run_ort(ort_session(partition.with_batch(model, batch)), feeds)
            args = [rt.asdevicearray(dev.device, feeds[t.name]) for t in seg.inputs]
            results = []
            for cand, flags in kit.candidates.items():
                rel = seg.modules.get(cand, {}).get(batch)
                if rel is None:
                    results.append(CandidateResult(cand, flags, False, None, None, "did not compile"))
                    continue
                mod = IreeModule(dev, kit.root / rel, params, "main")
                try:
                    got = [np.asarray(o.to_host()) for o in mod(*args)]
                    checks = [
                        compare(f"{seg.name}/{t.name}", ref[t.name], as_dtype(g, t.dtype), kit.tolerance)
                        for t, g in zip(seg.outputs, got, strict=True)
                    ]
                    worst = max((c.rel_l2 for c in checks if not c.integer), default=0.0)
                    bad = [c for c in checks if not c.passed]
                    if bad:
                        why = "; ".join(f"{c.name}: rel L2 {c.rel_l2:.2e}, mismatch {c.mismatch:.2e}" for c in bad)
                        results.append(CandidateResult(cand, flags, False, None, worst, f"wrong results ({why})"))
                        say(f"{seg.name} N={batch} {cand}: REJECTED, {why}")
                        continue
                    for _ in range(warmup):
                        mod(*args)
                    times = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        mod(*args)  # synchronous: returns after the GPU work (FACTS 8)
                        times.append((time.perf_counter() - t0) * 1e3)
                    ms = statistics.median(times)
                    results.append(CandidateResult(cand, flags, True, round(ms, 4), worst))
                    say(f"{seg.name} N={batch} {cand}: {ms:.3f} ms (rel L2 {worst:.1e})")
                finally:
                    del mod
            out.append(SegmentResult(seg.name, seg.key, batch, tuple(results)))
    del args
    del dev
    return gpu, out


def kit_digest(kit: Kit) -> str:
    """A short id of the kit's modules (which compile the records came from)."""
    h = hashlib.sha256()
    for seg in kit.segments:
        for cand in sorted(seg.modules):
            for b in sorted(seg.modules[cand]):
                h.update((kit.root / seg.modules[cand][b]).read_bytes())
    return h.hexdigest()[:16]


# -- records for the tuning file --------------------------------------------------------------------


def records(kit: Kit, gpu: dict[str, Any], results: Sequence[SegmentResult]) -> list[dict[str, Any]]:
    """One tuning-file record per (segment, batch): the winner, the baseline, every candidate."""
    import iree.runtime as rt

    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = []
    for r in results:
        win, base = r.winner, r.baseline
        out.append(
            {
                "kind": RECORD_KIND,
                "segment": r.segment,
                "segment_key": r.key,
                "iree_target": kit.iree_target,
                "batch": r.batch,
                **gpu,
                "compiler": kit.compiler,
                "runtime": getattr(rt, "__version__", ""),
                "flags": list(win.flags) if win else None,
                "candidate": win.name if win else None,
                "time_ms": win.time_ms if win else None,
                "baseline_flags": list(base.flags) if base else None,
                "baseline_ms": base.time_ms if base else None,
                "speedup": round(base.time_ms / win.time_ms, 3) if win and base and base.time_ms else None,
                "candidates": [c.to_json() for c in r.results],
                "date": now,
            }
        )
    return out


# -- the command ----------------------------------------------------------------------------------


def _require_gpu() -> None:
    from dualtrack.errors import DeviceError
    from dualtrack.runtime.driver import load_driver

    try:
        load_driver()
    except DeviceError as e:
        raise DeviceError(
            f"{str(e).split(';')[0]}: the IREE flag candidates are timed on a GPU; compile them here with "
            "`dualtrack tune CONFIG --track-b --prepare-kit DIR`, then run `dualtrack tune DIR --track-b` there"
        ) from None


@dataclass(frozen=True)
class TrackBTuneResult:
    output: Path | None  # the tuning file written (None: only a kit was prepared)
    kit: Kit
    gpu: dict[str, Any]
    results: tuple[SegmentResult, ...]
    seconds: float


def tune_track_b(
    source: str | Path,
    output: str | Path | None = None,
    *,
    prepare_only: str | Path | None = None,
    target: str | None = None,
    only: Sequence[str] | None = None,
    iters: int = 30,
    device_index: int = 0,
    say: Callable[[str], None] = lambda _: None,
) -> TrackBTuneResult:
    """The Python API behind `dualtrack tune SOURCE --track-b`.

    SOURCE is a build config (compile the candidates, then time them: needs `iree-compile` and a
    GPU) or a kit folder (time only). ``prepare_only``: compile into that kit folder and stop.
    Winners are merged into ``output`` (default: the config's `tuning`, else ./tuning.json).
    """
    import tempfile

    from dualtrack.compiler.tuned import save_records
    from dualtrack.tuning.tiles import default_output

    t0 = time.perf_counter()
    source = Path(source)
    if prepare_only is not None:
        kit = prepare_kit(source, prepare_only, target=target, only=only, say=say)
        return TrackBTuneResult(None, kit, {}, (), time.perf_counter() - t0)
    dest = Path(output) if output is not None else default_output(source)
    _require_gpu()  # before compiling anything: the candidates are timed here
    with tempfile.TemporaryDirectory(prefix="dualtrack-kit-") as tmp:
        if (source / KIT_FILE).is_file():
            kit = Kit.open(source)
        else:
            kit = prepare_kit(source, Path(tmp) / "kit", target=target, only=only, say=say)
        gpu, results = time_kit(kit, iters=iters, device_index=device_index, say=say)
        save_records(dest, records(kit, gpu, results), record_key)
    return TrackBTuneResult(dest, kit, gpu, tuple(results), time.perf_counter() - t0)
