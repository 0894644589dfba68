"""`dualtrack build`: config -> plan -> Track A and Track B artifacts -> verified bundle.

Named stages, in order:

    configure -> resolve (targets) -> front_end (exports cleaned, image I/O wrapped; partitioned
    into a plan) -> track_a_artifacts -> track_b_jobs -> [up_to_date] -> check_front_end (against
    the export) -> compile -> write_files (model, weights, segments, Track A, reference cases) ->
    write_modules (IREE) -> verify_on_cpu -> commit (rename)

A build whose inputs all hash the same as the bundle already at the destination compiles nothing,
verifies nothing and says so; otherwise only the modules whose cache key moved are compiled.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version as pkg_version
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from dualtrack import hostcpu, kernels
from dualtrack.compiler import fp8, frontend, partition, spatial, verify
from dualtrack.compiler import iree_build as track_b
from dualtrack.compiler import kernel_build as ptx
from dualtrack.compiler.bundle_writer import BundleWriter, externalize
from dualtrack.compiler.config import BuildConfig, CalibrationConfig, load_config
from dualtrack.compiler.tuned import TUNED_FIELDS, Selection, flag_records, flags_for, measured_for, segment_key
from dualtrack.compiler.tuned import select as select_tuning
from dualtrack.contract import arch
from dualtrack.contract.bundle import CASES, MANIFEST, WEIGHTS, Bundle, model_digest, sha256
from dualtrack.contract.manifest import Artifacts, Manifest, ModelInfo, SizePlan, Target, Verification, Weight, Window
from dualtrack.contract.plan import ALIAS_OPS, Plan
from dualtrack.contract.precision import PRECISION_FILE
from dualtrack.contract.sizes import Size, label
from dualtrack.errors import BundleError, ConfigError, SegmentCompileError, ToolError
from dualtrack.kernels import sources
from dualtrack.kernels.device import REFERENCE
from dualtrack.kernels.problems import ConvLayer, conv_layers
from dualtrack.runtime.engine import Engine
from dualtrack.settings import Settings

Progress = Callable[[str], None]
PARTITION_REPORT = "partition.json"  # every node's track, why, and its estimated time on each track


@dataclass
class BuildResult:
    bundle: Path
    up_to_date: bool
    compiled: int = 0
    cached: int = 0
    seconds: float = 0.0
    verification: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    plan: Plan | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "bundle": str(self.bundle),
            "up_to_date": self.up_to_date,
            "compiled": self.compiled,
            "cached": self.cached,
            "seconds": round(self.seconds, 3),
            "verification_passed": None if self.verification is None else self.verification["passed"],
            "notes": self.notes,
        }


def ptx_root() -> Path:
    return ptx.SOURCE_DIR  # the package data of an installed wheel, else the checkout's handwritten_ptx/


def track_a_stems(plan: Plan, ptx_arch: str, use_tma: bool = True) -> list[str]:
    """The kernel sources one target's bundle carries: those of the plan's Track A ops, and
    conv3x3_wgmma (TMA + wgmma) where the config enables TMA kernels (``use_tma``: `enable_tma` and
    an arch with the copy engine), it is built for ``ptx_arch`` (compute_90a only) and at least one
    conv of the plan runs it (``kernels.conv_choice`` with the plan's channel strides; pointers are
    checked at launch). Which conv runs which kernel is decided at launch, by the same chooser."""
    stems = {kernels.KERNELS[c.op].source for s in plan.segments for c in s.calls if c.op not in ALIAS_OPS}
    wgmma = kernels.CONV3X3_WGMMA

    def runs_wgmma(layer: ConvLayer) -> bool:
        # Whether the wgmma kernel takes a launch does not depend on the device (its tile does).
        return kernels.conv_choice(layer.problem, REFERENCE, call=layer.call).impl == "wgmma"

    if use_tma and ptx_arch in wgmma.ptx_arches and any(map(runs_wgmma, conv_layers(plan, ops=("conv3x3", "conv")))):
        stems.add(wgmma.stem)
    return sorted(s for s in stems if ptx_arch in kernels.ptx_arches_for_stem(s))


def track_a_artifacts(
    plan: Plan, resolutions: list[arch.Resolution], settings: Settings, tuning: Selection | None = None
) -> tuple[dict[str, bytes], dict[str, Any]]:
    """PTX for each needed arch (ISA checked) and cubins assembled from it, for the kernels the plan
    uses (:func:`track_a_stems`: each target its own set; ``kernels`` lists them all).

    The checked-in PTX, except where ``tuning`` selects tuned entries for a target: that target's
    PTX of the conv kernel is compiled here with NVRTC, the tuned entries added (cached).
    """
    per_target = {res.arch.ptx_arch: track_a_stems(plan, res.arch.ptx_arch, res.use_tma) for res in resolutions}
    stems = sorted({s for target in per_target.values() for s in target})
    files: dict[str, bytes] = {}
    meta: dict[str, Any] = {"ptx": {}, "cubin": {}, "kernels": stems, "tuned": {}}
    if not stems:
        return files, meta
    conv = kernels.KERNELS["conv3x3"]
    assert isinstance(conv, kernels.Conv3x3Spec)
    for res in resolutions:
        a = res.arch
        for stem in per_target[a.ptx_arch]:
            tiles = tuning.tiles_for(a.ptx_arch, resolutions) if tuning and stem == conv.source else frozenset()
            src = ptx_root() / "ptx" / a.ptx_arch / f"{stem}.ptx"
            if tiles:
                defines = {**conv.defines(), **conv.extra_entries_define(tiles)}
                cache = settings.cache_dir / "ptx"
                text = ptx.cached_ptx(ptx_root() / f"{stem}.cu", a.ptx_arch, defines, cache, enabled=settings.use_cache)
            elif src.exists():
                text = src.read_text()
            else:
                raise BundleError(f"{src} is missing; run `make ptx` to regenerate the Track A PTX")
            isa = arch.parse_ptx_isa(text)
            rel = f"track_a/ptx/{a.ptx_arch}/{stem}.ptx"
            files[rel] = text.encode()
            meta["ptx"].setdefault(a.ptx_arch, {})[stem] = {
                "path": rel,
                "isa": f"{isa[0]}.{isa[1]}",
                "target": arch.parse_ptx_target(text),
                "min_driver": arch.min_driver_for_isa(isa),
                "abi": sources.launch_abi(text),
                "entries": sources.entry_names(text),
                **({"tuned_entries": sorted(conv.tuned_entry(t) for t in tiles)} if tiles else {}),
            }
            cubin = ptx.cached_cubin(text, a.cubin_arch, settings.cache_dir / "cubin", enabled=settings.use_cache)
            crel = f"track_a/cubin/{a.cubin_arch}/{stem}.cubin"
            files[crel] = cubin
            meta["cubin"].setdefault(a.cubin_arch, {})[stem] = {"path": crel, "from": a.ptx_arch}
    if tuning is not None:
        meta["tuned"] = {name: t.to_json() for name, t in sorted(tuning.targets.items())}
        meta["tuning"] = {"path": str(tuning.path), "sha256": tuning.sha256, "stale": tuning.stale}
    return files, meta


def replay_files(
    writer: BundleWriter, base: str, replay: track_b.Replay, cubin_arches: list[str], settings: Settings
) -> dict[str, Any]:
    """Write a module's launch plan, its PTX and cubins for ``cubin_arches`` beside its .vmfb;
    the manifest entry that finds them (runtime/replay.py), or the reason it has none."""
    if replay.plan is None:
        return {"refused": replay.refused}
    writer.add(f"{base}.replay.json", json.dumps(replay.plan.to_json()).encode())
    entry: dict[str, Any] = {"plan": f"{base}.replay.json", "ptx": [], "cubin": {}}
    for i, text in enumerate(replay.ptx):
        entry["ptx"].append(f"{base}.m{i}.ptx")
        writer.add(entry["ptx"][-1], text)
        for a in cubin_arches:
            cubin = ptx.cached_cubin(text.decode(), a, settings.cache_dir / "cubin", enabled=settings.use_cache)
            entry["cubin"].setdefault(a, []).append(f"{base}.m{i}.{a}.cubin")
            writer.add(entry["cubin"][a][-1], cubin)
    return entry


def _build_key(
    cfg: BuildConfig,
    model_digest: str,
    plan: Plan,
    keys: list[str],
    ptx_files: dict[str, bytes],
    tuning: Selection | None = None,
) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(cfg.model_dump(mode="json", exclude={"output"}), sort_keys=True).encode())
    h.update(model_digest.encode())
    h.update(plan.dumps().encode())
    for k in sorted(keys):
        h.update(k.encode())
    for rel in sorted(ptx_files):
        h.update(rel.encode() + sha256(ptx_files[rel]).encode())
    if tuning is not None:  # the records consulted and the choices made, not the file's bytes
        h.update(tuning.key().encode())
    h.update(pkg_version("dualtrack").encode())
    return h.hexdigest()


@dataclass
class _Inputs:
    """What the stages after the front end read: the config as the front end left it, the model
    (nodes named) and its partition, the source file's hash."""

    cfg: BuildConfig
    fe: frontend.FrontEnd
    model: onnx.ModelProto
    parted: partition.Partitioned
    source_digest: str
    size: Size | None = None  # the input size of this model (config `sizes`; None: the export's, the only one)
    others: tuple[_Inputs, ...] = ()  # the smaller sizes (config `sizes`): this one is the largest

    @property
    def plan(self) -> Plan:
        return self.parted.plan


@dataclass
class _TrackB:
    """The IREE compile jobs of a build, their cache keys, the CPU target and the tuned flags used."""

    jobs: list[track_b.CompileJob]
    keys: list[str]
    compiler: str
    cpu_name: str | None
    cpu: track_b.IreeTarget | None
    tuned_flags: dict[str, dict[str, dict[str, Any]]]


def build(
    config: str | Path | BuildConfig,
    output: str | Path | None = None,
    *,
    force: bool = False,
    progress: Progress | None = None,
    settings: Settings | None = None,
    tuning: str | Path | None = None,
    cpu_only: bool = False,
) -> BuildResult:
    """Build (or confirm up to date) the bundle for a config. The Python API behind `dualtrack build`.

    ``tuning`` overrides the config's ``tuning`` (a file `dualtrack tune` wrote); ``cpu_only``
    builds IREE llvm-cpu modules only, whatever the config's ``targets`` (as ``targets: []`` does).
    """
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    settings = settings or Settings.from_env()
    cfg, dest, measured = configure(config, output, tuning, cpu_only)
    keep_a: dict[str, str] = {}
    while True:
        try:
            return _build(cfg, dest, measured, force, say, settings, t0, keep_a)
        except _Refused as refused:
            exc = refused.error
            kept = refused_to_track_a(exc, refused.parted, cfg, keep_a)
            if not kept:
                raise exc from None
            say(f"IREE failed on {exc.segment} for {exc.target}: {len(kept)} node(s) back on Track A, again")
            keep_a |= kept  # each round keeps more nodes on Track A, so the rounds end


class _Refused(Exception):
    """A round's :class:`SegmentCompileError` with the partition whose segment IREE failed on."""

    def __init__(self, error: SegmentCompileError, parted: partition.Partitioned) -> None:
        super().__init__(str(error))
        self.error, self.parted = error, parted


def _compiled(
    jobs: _TrackB, parted: partition.Partitioned, settings: Settings, say: Progress
) -> list[track_b.CompileResult]:
    """:func:`compile_modules`; a segment IREE fails on raises :class:`_Refused` with ``parted``."""
    try:
        return compile_modules(jobs, settings, say)
    except SegmentCompileError as exc:
        raise _Refused(exc, parted) from exc


def refused_to_track_a(
    exc: SegmentCompileError, parted: partition.Partitioned, cfg: BuildConfig, keep_a: Mapping[str, str]
) -> dict[str, str]:
    """The nodes of the segment of ``parted`` IREE failed on that ``partition: auto`` put on Track B by
    their cost alone (a Track A kernel takes them), to keep on Track A in the next round; none where
    every node there must run on IREE, or for another partition mode: then the error stands."""
    if cfg.partition.mode != "auto":
        return {}
    segment = next((s for s in parted.plan.segments if s.name == exc.segment), None)
    if segment is None:
        return {}
    reason = f"IREE failed on its segment for {exc.target} ({exc.message[:160]})"
    movable = {
        d.node
        for d in parted.assignment.decisions
        if d.node in segment.nodes and d.track == "B" and d.a_us is not None and d.node not in keep_a
    }
    return dict.fromkeys(sorted(movable), reason)


def _build(
    cfg: BuildConfig,
    dest: Path,
    measured: Any,
    force: bool,
    say: Progress,
    settings: Settings,
    t0: float,
    keep_a: Mapping[str, str],
) -> BuildResult:
    """One round of :func:`build` with the nodes of ``keep_a`` kept on Track A."""
    notes = list(cfg.notes)
    if keep_a:
        notes.append(
            f"partition: {len(keep_a)} node(s) kept on Track A after IREE failed on the segment the cost model "
            f"gave them ({', '.join(list(keep_a)[:4])}): {next(iter(keep_a.values()))}"
        )
    say("resolve targets")
    resolutions = resolve(cfg, notes)
    inputs = front_end(cfg, measured, notes, say, keep_a)
    inputs, fp8_build = fp8_stage(cfg, inputs, resolutions, settings, notes, say)
    plan = inputs.plan
    selection = None
    if inputs.cfg.tuning is not None:
        say(f"track A: tuning file {inputs.cfg.tuning}")
        selection = select_tuning(inputs.cfg.tuning, plan, resolutions)
        if stale := selection.note():
            notes.append(stale)
    say("track A: PTX and cubins")
    a_files, a_meta = track_a_artifacts(plan, resolutions, settings, selection)
    jobs = track_b_jobs(inputs, resolutions, notes)
    sized = [size_stages(o, resolutions, settings, say) for o in inputs.others]
    build_key = _build_key(inputs.cfg, inputs.source_digest, plan, jobs.keys, a_files, selection)
    build_key = _sizes_key(build_key, inputs, sized)
    if not force and (done := up_to_date(dest, build_key, len(jobs.jobs), [*notes, *plan.notes], plan)):
        say("up to date")
        done.seconds = time.perf_counter() - t0
        return done
    inputs = with_seed(inputs)
    for s, other in zip(sized, inputs.others, strict=True):  # the seed drawn now, for their cases and checks
        s.inputs = other
    frontend_checks = check_front_end(inputs, say)
    results = _compiled(jobs, inputs.parted, settings, say)
    for s in sized:
        s.results = _compiled(s.jobs, s.inputs.parted, settings, say)
    results = [*results, *(r for s in sized for r in s.results)]  # every size's modules, for the counts
    compiled = sum(not r.cached for r in results)
    writer = BundleWriter(dest)
    try:
        weights = write_files(writer, inputs, a_files)
        if fp8_build is not None:
            writer.add_json(PRECISION_FILE, fp8_build.record.to_json())
        iree_art, replay_art = write_modules(writer, results[: len(jobs.jobs)], resolutions, settings, notes)
        size_plans = tuple(write_size(writer, s, a_files, resolutions, settings, notes) for s in sized)
        artifacts = Artifacts(iree=iree_art, iree_tuned_flags=jobs.tuned_flags, track_a=a_meta, iree_replay=replay_art)
        manifest = Manifest(
            dualtrack_version=pkg_version("dualtrack"),
            build_key=build_key,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            model=model_info(inputs, writer.files),
            config=inputs.cfg.model_dump(mode="json"),
            targets=tuple(Target(**r.to_json()) for r in resolutions),
            plan=plan,
            artifacts=artifacts,
            tools=tool_versions(jobs.compiler),
            cpu_batch=cpu_batch(inputs.cfg),
            cpu_target=jobs.cpu_name,
            min_driver=max(
                (m["min_driver"] or 0 for per in a_meta["ptx"].values() for m in per.values()), default=None
            ),
            notes=tuple(notes),
            weights=weights,
            tolerance=fp8.widest(bundle_tolerance(inputs, plan, say), fp8_build).to_json(),
            window=window_record(inputs.cfg),
            sizes=size_plans,
        )
        verification = None
        if jobs.cpu is not None:
            manifest, verification = verify_on_cpu(writer, manifest, inputs, frontend_checks, say)
            manifest = verify_sizes_on_cpu(writer, manifest, inputs, say)
        say(f"write {dest}")
        writer.commit(manifest)
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - t0
    return BuildResult(
        dest, False, compiled, len(results) - compiled, seconds, verification, [*notes, *plan.notes], plan
    )


def configure(
    config: str | Path | BuildConfig, output: str | Path | None, tuning: str | Path | None, cpu_only: bool
) -> tuple[BuildConfig, Path, Any]:
    """The validated config with the call's overrides, the destination, and the tuning file's measured
    Track A times (``partition: auto`` decides with those of the config's own targets, so that
    --cpu-only builds the same plan)."""
    cfg = config if isinstance(config, BuildConfig) else load_config(config)
    if tuning is not None:
        cfg = cfg.model_copy(update={"tuning": Path(tuning).resolve()})
    measured = measured_for(cfg)
    if cpu_only:
        cfg = cfg.model_copy(update={"targets": (), "track_b": cfg.track_b.model_copy(update={"cpu": True})})
    if not cfg.targets and not cfg.track_b.cpu:
        raise ConfigError("`targets` is empty and `track_b.cpu` is false: nothing to build; list a target or set cpu")
    dest = Path(output) if output is not None else cfg.output
    if dest is None:
        raise BundleError("no output directory: pass -o DIR or set `output:` in the config")
    return cfg, dest, measured


def resolve(cfg: BuildConfig, notes: list[str]) -> list[arch.Resolution]:
    """The config's GPU targets resolved (none for a CPU-only build); their notes join ``notes``."""
    resolutions = (
        arch.resolve_targets(list(cfg.targets), enable_tma=cfg.enable_tma, iree_target=cfg.track_b.iree_target)
        if cfg.targets
        else []
    )
    for r in resolutions:
        notes.extend(f"{r.arch.name}: {n}" for n in r.notes)
    if not resolutions:
        notes.append("CPU only: no GPU code (add `targets` to build for a GPU)")
    return resolutions


def front_end(
    cfg: BuildConfig, measured: Any, notes: list[str], say: Progress, keep_a: Mapping[str, str] | None = None
) -> _Inputs:
    """The front end's model, nodes named, and its partition into segments and a plan (``keep_a``:
    :func:`partition.partition_model`'s)."""
    say(f"front end {cfg.model.name}")
    source_digest = sha256(cfg.model.read_bytes()) if cfg.model.exists() else ""
    cfg, fe = frontend.load(cfg)
    notes.extend(fe.notes())
    model = partition.name_nodes(fe.model)
    if cfg.sizes is not None:
        return sized_inputs(cfg, fe, model, source_digest, measured, notes, say, keep_a)
    say(f"partition {cfg.model.name}")
    parted = partition.partition_model(cfg, model, measured, keep_a)
    return _Inputs(cfg, fe, model, parted, source_digest)


def fp8_stage(
    requested: BuildConfig,
    inputs: _Inputs,
    resolutions: list[arch.Resolution],
    settings: Settings,
    notes: list[str],
    say: Progress,
) -> tuple[_Inputs, fp8.Fp8Build | None]:
    """``precision: fp8`` (compiler/fp8.py): the fp16 plan calibrated, its convolutions chosen, lowered
    and verified (every size takes the largest's choices); targets other than sm_90a keep it fp16."""
    if requested.precision != "fp8":
        return inputs, None
    say("fp8: calibration")
    cal = requested.calibration or CalibrationConfig()
    wgmma = {r.arch.name: r.arch.wgmma and r.use_tma for r in resolutions}  # conv_fp8 is the wgmma family's
    cache = settings.cache_dir / "fp8" if settings.use_cache else None
    done = fp8.build_fp8(cal, inputs.model, inputs.plan, inputs.parted.seg_models, wgmma, say, cache)
    notes.append(done.record.headline())

    def lowered(i: _Inputs) -> _Inputs:
        # The config as asked (the front end resolved fp8 to its fp16 network): the manifest and the build key.
        cfg = i.cfg.model_copy(update={"precision": "fp8"})
        if not done.record.applied:
            return replace(i, cfg=cfg)
        return replace(i, cfg=cfg, parted=replace(i.parted, plan=fp8.lower(i.plan, done.record.layers)))

    return replace(lowered(inputs), others=tuple(map(lowered, inputs.others))), done


def sized_inputs(
    cfg: BuildConfig,
    fe: frontend.FrontEnd,
    model: onnx.ModelProto,
    source_digest: str,
    measured: Any,
    notes: list[str],
    say: Progress,
    keep_a: Mapping[str, str] | None = None,
) -> _Inputs:
    """The config's ``sizes``: the model re-shaped to each (compiler/spatial.py) and partitioned there
    (Track A's kernels chosen for that shape). The largest size leads (the manifest's own plan, what an
    image too large for every size is resized to); the others ride in its ``others``."""
    model, freed = spatial.free_sizes(model)
    if freed:
        notes.append(f"sizes: {len(freed)} Resize(s) to constant sizes take scales instead: {', '.join(freed[:4])}")
    per_size = []
    for size in cfg.compiled_sizes(spatial.image_size(model)):
        say(f"partition {cfg.model.name} at {label(size)}")
        m = spatial.at_size(model, size)
        shape = cfg.input.shape
        if shape is not None and len(shape) == 4:  # the config names the export's shape: read it at this size
            shape = (shape[0], *size, shape[3])
        at = cfg.model_copy(update={"input": cfg.input.model_copy(update={"shape": shape})})
        parted = partition.partition_model(at, m, measured, keep_a)
        per_size.append(_Inputs(cfg, fe, m, parted, source_digest, size))
    *others, lead = per_size
    return replace(lead, others=tuple(others))


@dataclass
class _Sized:
    """One smaller input size's build stages (config ``sizes``): its inputs, Track A files, IREE jobs."""

    inputs: _Inputs
    selection: Selection | None
    a_files: dict[str, bytes]
    a_meta: dict[str, Any]
    jobs: _TrackB
    results: list[track_b.CompileResult] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        """Where its plan's files go in the bundle (weights.bin and identical PTX are shared)."""
        assert self.inputs.size is not None
        return f"sizes/{label(self.inputs.size)}/"


def size_stages(inputs: _Inputs, resolutions: list[arch.Resolution], settings: Settings, say: Progress) -> _Sized:
    """The Track A and Track B stages of one smaller size, as :func:`build` runs them for the largest
    (their notes are the largest's: not repeated)."""
    say(f"track A and B jobs at {label(inputs.size or (0, 0))}")
    selection = select_tuning(inputs.cfg.tuning, inputs.plan, resolutions) if inputs.cfg.tuning is not None else None
    a_files, a_meta = track_a_artifacts(inputs.plan, resolutions, settings, selection)
    return _Sized(inputs, selection, a_files, a_meta, track_b_jobs(inputs, resolutions, []))


def _sizes_key(lead_key: str, inputs: _Inputs, sized: list[_Sized]) -> str:
    """The build key over every size: the largest's, then each smaller one's (unchanged without sizes)."""
    if not sized:
        return lead_key
    h = hashlib.sha256(lead_key.encode())
    for s in sized:
        i = s.inputs
        h.update(_build_key(i.cfg, i.source_digest, i.plan, s.jobs.keys, s.a_files, s.selection).encode())
    return h.hexdigest()


def track_b_jobs(inputs: _Inputs, resolutions: list[arch.Resolution], notes: list[str]) -> _TrackB:
    """One IREE compile job per segment, target and batch (Track A segments: the CPU's only), with
    the tuning file's flags where it has a record, and each job's cache key."""
    cfg, plan = inputs.cfg, inputs.plan
    targets = sorted({track_b.cuda_target(r.iree_target) for r in resolutions}, key=lambda t: t.name)
    cpu_name = hostcpu.resolve(cfg.track_b.cpu_target) if cfg.track_b.cpu else None
    if cpu_name is not None and (why := hostcpu.cannot_run(cpu_name)):  # the build verifies on this CPU
        raise ConfigError(
            f"track_b.cpu_target {cpu_name}: {why}, so this build could not verify its CPU modules; "
            f"set track_b.cpu_target: auto ({hostcpu.resolve(hostcpu.AUTO)} here)"
        )
    cpu = track_b.cpu_target(cpu_name) if cpu_name is not None else None
    records_b = flag_records(cfg.tuning) if cfg.tuning is not None else []
    tuned_flags: dict[str, dict[str, dict[str, Any]]] = {}
    jobs: list[track_b.CompileJob] = []
    for seg, sm in zip(plan.segments, inputs.parted.seg_models, strict=True):
        seg_targets = ([] if seg.track == "A" else list(targets)) + ([cpu] if cpu else [])
        seg_key = segment_key(sm) if records_b and seg.track == "B" else ""
        for t in seg_targets:
            for b in cfg.batch_sizes if t is not cpu else (cpu_batch(cfg),):
                extra = cfg.track_b.cpu_flags if t is cpu else cfg.track_b.cuda_flags
                flags = (*cfg.track_b.flags, *extra)
                rec = flags_for(records_b, seg_key, t.name, b) if seg_key and t is not cpu else None
                if rec is not None:
                    flags = tuple(rec["flags"])
                    tuned = {k: rec[k] for k in TUNED_FIELDS}
                    tuned_flags.setdefault(seg.name, {}).setdefault(t.name, {})[str(b)] = tuned
                jobs.append(track_b.CompileJob(seg.name, sm, b, t, flags))
    if tuned_flags:
        n = sum(len(per_b) for per_t in tuned_flags.values() for per_b in per_t.values())
        notes.append(f"track B: {n} module(s) compiled with tuned IREE flags from {cfg.tuning}")
    if cpu is None:
        notes.append(
            "no llvm-cpu modules (track_b.cpu: false): verify on a GPU with `dualtrack verify BUNDLE --device cuda`"
        )
    compiler = track_b.compiler_version()
    keys = [
        track_b.cache_key(partition.with_batch(j.model, j.batch), j.batch, j.target, j.flags, compiler) for j in jobs
    ]
    return _TrackB(jobs, keys, compiler, cpu_name, cpu, tuned_flags)


def cpu_batch(cfg: BuildConfig) -> int:
    """The batch the llvm-cpu modules are compiled for: track_b.CPU_BATCH (the CPU runs a batch row by
    row), or with `batch: fixed` the one batch size, the input's dim 0 (a fixed-shape model runs whole)."""
    return cfg.batch_sizes[0] if cfg.batch == "fixed" else track_b.CPU_BATCH


def window_record(cfg: BuildConfig) -> Window | None:
    """The config's `window:` as the runtime reads it, its batch resolved (the largest compiled one); a
    window size left unset stays None: the runtime's largest compiled input size."""
    w = cfg.window
    if w is None:
        return None
    return Window(w.size, w.overlap, w.blend, w.sigma_scale, w.batch or max(cfg.batch_sizes))


def up_to_date(dest: Path, build_key: str, jobs: int, notes: list[str], plan: Plan) -> BuildResult | None:
    """The result of a build that has nothing to do: the bundle at ``dest`` has this build key and
    passed its verification. None otherwise (a broken bundle there is simply rebuilt)."""
    if not (dest / MANIFEST).exists():
        return None
    try:
        existing = Bundle.open(dest).manifest
    except BundleError:
        return None
    if existing.build_key != build_key or not (existing.verification and existing.verification.passed):
        return None
    return BuildResult(dest, True, 0, jobs, 0.0, asdict(existing.verification), notes, plan)


def with_seed(inputs: _Inputs) -> _Inputs:
    """``inputs`` with the config's seed, or one drawn now where it sets none (after the build key, which
    a fresh draw must not change): the front end's check, the judged tolerance, the reference cases and
    the CPU verification all draw from it, and the manifest records it, so a build reproduces."""
    if inputs.cfg.verify.seed is not None:
        return inputs
    verify_cfg = inputs.cfg.verify.model_copy(update={"seed": int(np.random.SeedSequence().entropy % (2**31))})
    cfg = inputs.cfg.model_copy(update={"verify": verify_cfg})
    return replace(inputs, cfg=cfg, others=tuple(replace(o, cfg=cfg) for o in inputs.others))


def check_front_end(inputs: _Inputs, say: Progress) -> list[verify.Check]:
    """The front end's rewrites checked against the export (onnxruntime); raises on a failure."""
    fe, cfg = inputs.fe, inputs.cfg
    if not fe.rewrites:
        return []
    say("front end: the processed model against the export (onnxruntime)")
    checks = verify.check_frontend(fe, cfg.batch_sizes, cfg.verify.tolerance, cfg.verify.seed)
    for c in checks:
        say(verify.Report.line(c))
    if any(not c.passed for c in checks):
        tol = cfg.verify.tolerance or verify.DEFAULT_TOLERANCES[fe.precision]
        verify.Report("onnxruntime", fe.precision, tol, checks, cfg.verify.seed).raise_if_failed()
    return checks


def compile_modules(jobs: _TrackB, settings: Settings, say: Progress) -> list[track_b.CompileResult]:
    """Every IREE module, ``settings.jobs`` at a time; those whose cache key is cached are not compiled."""
    say(f"track B: {len(jobs.jobs)} IREE modules")
    cache = track_b.ModuleCache(settings.cache_dir / "iree", enabled=settings.use_cache)
    with ThreadPoolExecutor(max_workers=settings.jobs) as pool:
        results = list(pool.map(lambda j: _compile(j, cache, jobs.compiler, settings), jobs.jobs))
    compiled = sum(not r.cached for r in results)
    say(f"track B: {compiled} compiled, {len(results) - compiled} from cache")
    return results


def write_files(writer: BundleWriter, inputs: _Inputs, a_files: dict[str, bytes]) -> dict[str, Weight]:
    """The model (graph in model.onnx, weights once in weights.bin), the partition report, each
    segment's graph, the Track A files and the reference cases; the weights' index."""
    plan = inputs.plan
    weights = writer.add_model(inputs.model)
    writer.add_json(PARTITION_REPORT, inputs.parted.report())
    for seg, sm in zip(plan.segments, inputs.parted.seg_models, strict=True):
        writer.add(seg.onnx, partition.strip_initializers(sm).SerializeToString())
    for rel, data in a_files.items():
        writer.add(rel, data)
    writer.add(CASES, verify.reference_cases(inputs.model, plan, inputs.cfg.verify.seed).to_bytes())
    return weights


def write_modules(
    writer: BundleWriter,
    results: list[track_b.CompileResult],
    resolutions: list[arch.Resolution],
    settings: Settings,
    notes: list[str],
    prefix: str = "",
) -> tuple[dict[str, dict[str, dict[str, str]]], dict[str, dict[str, dict[str, dict[str, Any]]]]]:
    """Each IREE module and its launch plan's files; the manifest's ``iree`` and ``iree_replay``
    entries. A module whose launch plan was refused gets a note (the IREE runtime runs it)."""
    iree_art: dict[str, dict[str, dict[str, str]]] = {}
    replay_art: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    cubin_arches = {
        track_b.cuda_target(r.iree_target).name: sorted(
            {x.arch.cubin_arch for x in resolutions if x.iree_target == r.iree_target}
        )
        for r in resolutions
    }
    for r in results:
        rel = f"{prefix}iree/{r.job.segment}/{r.job.target.name}/b{r.job.batch}.vmfb"
        writer.add(rel, r.vmfb)
        iree_art.setdefault(r.job.segment, {}).setdefault(r.job.target.name, {})[str(r.job.batch)] = rel
        if r.replay is not None:
            arches = cubin_arches.get(r.job.target.name, [])
            entry = replay_files(writer, rel.removesuffix(".vmfb"), r.replay, arches, settings)
            replay_art.setdefault(r.job.segment, {}).setdefault(r.job.target.name, {})[str(r.job.batch)] = entry
    refused = sorted(
        {
            f"{seg}: {e['refused']}"
            for seg, per in replay_art.items()
            for per_t in per.values()
            for e in per_t.values()
            if "refused" in e
        }
    )
    notes.extend(f"track B replay refused for {prefix}{r} (the IREE runtime runs it)" for r in refused)
    return iree_art, replay_art


def write_size(
    writer: BundleWriter,
    s: _Sized,
    lead_a_files: dict[str, bytes],
    resolutions: list[arch.Resolution],
    settings: Settings,
    notes: list[str],
) -> SizePlan:
    """One smaller size's files under ``sizes/HxW/`` (its graph beside model.onnx, reading the same
    weights.bin; Track A files identical to the largest's shared), and its manifest entry."""
    inputs, prefix = s.inputs, s.prefix
    assert inputs.size is not None
    graph, blob, _ = externalize(inputs.model)
    if sha256(blob) != writer.files[WEIGHTS]:  # the re-shaping touches shapes only, never an initializer
        raise BundleError(f"the model at {label(inputs.size)} has other weights than the largest size's")
    model_rel = f"model.{label(inputs.size)}.onnx"  # beside weights.bin: ONNX reads external data from its folder
    writer.add(model_rel, graph)
    plan = replace(inputs.plan, segments=tuple(replace(g, onnx=prefix + g.onnx) for g in inputs.plan.segments))
    writer.add_json(prefix + PARTITION_REPORT, inputs.parted.report())
    for seg, sm in zip(plan.segments, inputs.parted.seg_models, strict=True):
        writer.add(seg.onnx, partition.strip_initializers(sm).SerializeToString())
    moved = {rel: rel if lead_a_files.get(rel) == data else prefix + rel for rel, data in s.a_files.items()}
    for rel, data in s.a_files.items():
        if moved[rel] != rel:
            writer.add(moved[rel], data)
    a_meta = json.loads(json.dumps(s.a_meta, default=str))
    for kind in ("ptx", "cubin"):
        for entries in a_meta[kind].values():
            for m in entries.values():
                m["path"] = moved[m["path"]]
    cases_rel = f"{prefix}{CASES}"
    writer.add(cases_rel, verify.reference_cases(inputs.model, plan, inputs.cfg.verify.seed).to_bytes())
    iree_art, replay_art = write_modules(writer, s.results, resolutions, settings, notes, prefix)
    artifacts = Artifacts(iree=iree_art, iree_tuned_flags=s.jobs.tuned_flags, track_a=a_meta, iree_replay=replay_art)
    return SizePlan(*inputs.size, plan=plan, artifacts=artifacts, model=model_rel, cases=cases_rel)


def verify_sizes_on_cpu(writer: BundleWriter, manifest: Manifest, inputs: _Inputs, say: Progress) -> Manifest:
    """Every smaller size verified on the CPU against onnxruntime as the largest is (its own graph, at
    its own size): ``sizes/HxW/verify.json`` and the manifest's record; raise on a failure."""
    entries = []
    for entry in manifest.sizes:
        size = (entry.height, entry.width)
        say(f"verify {label(size)} on the CPU against onnxruntime")
        report = _verify_tmp(writer, manifest, inputs.cfg, say, size)
        writer.add_json(f"sizes/{label(size)}/verify.json", report)
        tol = verify.Tolerance(**report["tolerance"])
        if not report["passed"]:
            checks = [verify.Check(**c) for c in report["checks"]]
            verify.Report("cpu", inputs.fe.precision, tol, checks, report["seed"]).raise_if_failed()
        ver = Verification(passed=True, device="cpu", seed=report["seed"], tolerance=tol.to_json())
        entries.append(replace(entry, verification=ver))
    return replace(manifest, sizes=tuple(entries))


def model_info(inputs: _Inputs, files: dict[str, str]) -> ModelInfo:
    """The manifest's record of the model, once model.onnx and weights.bin are written."""
    digest = model_digest(files)
    assert digest is not None, "write_files writes model.onnx and weights.bin first"
    fe = inputs.fe
    return ModelInfo(
        source=str(inputs.cfg.model),
        source_sha256=inputs.source_digest,
        sha256=digest,
        graph=inputs.model.graph.name,
        export_batch=fe.export_batch,
        classes=fe.classes,
        frontend=tuple(str(r) for r in fe.rewrites),
    )


def verify_on_cpu(
    writer: BundleWriter, manifest: Manifest, inputs: _Inputs, frontend_checks: list[verify.Check], say: Progress
) -> tuple[Manifest, dict[str, Any]]:
    """Verify the written bundle on the CPU against onnxruntime; write verify.json and record the
    outcome in the manifest; raise (the bundle is not committed) on a failure."""
    say("verify on the CPU against onnxruntime")
    cfg = inputs.cfg
    verification = _verify_tmp(writer, manifest, cfg, say)
    if frontend_checks:
        verification["checks"] = [asdict(c) for c in frontend_checks] + verification["checks"]
    writer.add_json("verify.json", verification)
    tol = verify.Tolerance(**verification["tolerance"])
    manifest = manifest.with_verification(
        Verification(passed=verification["passed"], device="cpu", seed=verification["seed"], tolerance=tol.to_json())
    )
    if not verification["passed"]:
        checks = [verify.Check(**c) for c in verification["checks"]]
        verify.Report("cpu", inputs.fe.precision, tol, checks, verification["seed"]).raise_if_failed()
    return manifest, verification


def _compile(
    job: track_b.CompileJob, cache: track_b.ModuleCache, compiler: str, settings: Settings
) -> track_b.CompileResult:
    """One IREE module; a toolchain failure names the segment, batch and target, keeps the stage
    inputs for the repro command, and says how to get around it."""
    try:
        return track_b.run_job(job, cache, compiler, settings.save_temps, keep_failed=settings.cache_dir / "failed")
    except ToolError as e:
        around = (
            "build for the CPU only (`dualtrack build --cpu-only`) or drop the target"
            if job.target.driver == "cuda"
            else "set `track_b.cpu: false` and verify on a GPU"
        )
        raise SegmentCompileError(
            job.segment,
            job.target.name,
            e.tool,
            f"failed on segment {job.segment} at batch {job.batch} for {job.target.name} "
            f"({e.message.removeprefix(e.tool + ': ')}); to get around it: {around} or drop batch {job.batch}; "
            f"reproduce with: {e.repro}",
            returncode=e.returncode,
            stderr=e.stderr,
            argv=e.argv,
        ) from None


def bundle_tolerance(inputs: _Inputs, plan: Plan, say: Progress) -> verify.Tolerance:
    """The tolerance the bundle is held to (the manifest records it, for the CPU check and every GPU
    load alike): the config's, else the precision's default judged on the wrapped model."""
    cfg = inputs.cfg
    if cfg.verify.tolerance is not None:
        return cfg.verify.tolerance
    tol, note = verify.judged_tolerance(inputs.model, plan, cfg.verify.seed)
    if note:
        say(note)
    return tol


def _verify_tmp(
    writer: BundleWriter, manifest: Manifest, cfg: BuildConfig, say: Progress, size: Size | None = None
) -> dict[str, Any]:
    """Verify the not-yet-committed bundle (at one input ``size`` of several: config `sizes`) by
    loading it from its temporary directory."""
    bundle = Bundle(writer.tmp, manifest.with_files(writer.files))
    bundle = bundle.at_size(size) if size is not None else bundle
    engine = Engine.load(bundle, "cpu")
    try:
        tol = bundle.tolerance()  # the manifest's (bundle_tolerance)
        # Judged where the config sets no tolerance: a check that misses it is held again to what fp16
        # itself reaches on that check's own inputs (verify.verify_engine).
        report = verify.verify_engine(
            engine,
            samples=cfg.verify.samples,
            seed=cfg.verify.seed,
            tol=tol,
            judged=cfg.verify.tolerance is None,
            progress=say,
        )
    finally:
        engine.close()
    for line in report.lines():
        say(line)
    return report.to_json()


def tool_versions(compiler: str) -> dict[str, str]:

    out = {"iree-compile": compiler, "python": platform.python_version()}
    for pkg in ("iree-base-compiler", "iree-base-runtime", "onnx", "onnxruntime", "cuda-bindings", "numpy"):
        try:
            out[pkg] = pkg_version(pkg)
        except Exception:
            out[pkg] = "not installed"
    out.update(ptx.toolchain_versions())
    return out


__all__ = ["BuildResult", "build"]
