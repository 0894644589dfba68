"""`dualtrack tune`: search the fp16 conv3x3 kernel's tiles on this GPU; verify, then time, every one.

Phases, each timed (:attr:`TuneResult.phases`):

- ``plan``: the config's plan (partitioned here; no IREE compiler needed) or a bundle's, and its
  Track A conv layers at each batch size, grouped into distinct problems (:mod:`.problems`); fp16
  layers only, and not those with C <= ``kernels.SMALL_C_MAX``, which run the small-C entry;
- ``compile``: every candidate tile (:mod:`.space`) compiled ONCE for this GPU — as extra entries of
  a few NVRTC programs built in parallel, then nvJitLink (ptxas' report rejects a tile that spills)
  and ``cuModuleLoadData`` — and launched on every problem (kernel_tuner would compile each
  candidate once per problem: ~36 problems x ~36 tiles; see handwritten_ptx/README.md);
- ``inputs``: per problem, seeded random fp16 input (:func:`random_fp16`), weights and bias,
  uploaded, and the numpy reference (``Conv3x3Spec.reference_at``) at one random output pixel in
  every run of :attr:`TuneOptions.sample_run` (the smallest BM, so every block of every tile is
  checked), all K channels; at every pixel when the problem is small;
- ``verify``: each candidate once, its output NaN-poisoned first: every output element must be
  written, channels past K (a concatenation's other slices) left alone, and the sampled pixels
  within :attr:`TuneOptions.tolerance` relative L2 of the reference. A candidate that fails is
  recorded with the reason and never timed;
- ``time``: each verified candidate, the heuristic's entry (``Conv3x3Spec.variant``, the baseline)
  always among them: warm-up launches, then the median of ``iters`` back-to-back launches timed
  with CUDA events (inputs stay in L2 where they fit, as they partly do in the engine);
- ``write``: one record per problem merged into the tuning file (:mod:`dualtrack.compiler.tuned`).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

from dualtrack import kernels
from dualtrack.compiler import kernel_build as ptx
from dualtrack.compiler import tuned as tuning
from dualtrack.contract import arch
from dualtrack.contract.plan import Plan
from dualtrack.errors import ArchError, ConfigError, DeviceError, VerificationError
from dualtrack.kernels import Conv3x3Spec, F16Tile
from dualtrack.kernels.device import REFERENCE
from dualtrack.kernels.problems import ConvLayer, ConvProblem, by_problem, conv_layers
from dualtrack.runtime.driver import NO_DEVICE, NO_DRIVER, Context, Device, Event, Kernel, Module, Stream, call
from dualtrack.runtime.memory import DeviceBuffer, DevicePool, HostBuffer, download, upload
from dualtrack.settings import Settings
from dualtrack.tuning import space

_POISON = 0x7E00  # an fp16 quiet NaN: what no finite computation writes
Progress = Callable[[str], None]
ProblemProgress = Callable[[int, int, str], None]  # (done, total, what is next)


@dataclass(frozen=True)
class TuneOptions:
    """What `dualtrack tune` searches and how it measures."""

    batches: tuple[int, ...] = ()  # () = the plan's batch sizes
    layers: str | None = None  # glob on Conv node names, e.g. "enc*"
    max_configs: int | None = None  # candidate tiles at most (the fixed variants come first)
    iters: int = 20  # timed launches per candidate (the median is kept)
    warmup: int = 3
    tolerance: float = 2e-3  # relative L2 at the sampled pixels: fp32 sums in another order, one fp16 rounding
    sample_run: int = 64  # one checked pixel in every run of this many output pixels
    sample_all: int = 16384  # problems with at most this many output pixels are checked everywhere
    seed: int = 0
    device_index: int = 0

    def __post_init__(self) -> None:
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"--iters {self.iters} / warm-up {self.warmup}: need at least 1 timed launch")
        if self.max_configs is not None and self.max_configs < 1:
            raise ConfigError(f"--max-configs {self.max_configs} must be at least 1")
        if any(b < 1 for b in self.batches):
            raise ConfigError(f"--batch {list(self.batches)}: batch sizes are positive integers")


@dataclass
class TuneResult:
    """What a tuning run measured and wrote."""

    output: Path
    records: list[tuning.TileRecord]
    gpu: str
    arch: str
    candidates: int  # tiles compiled and loaded
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    seconds: float = 0.0


class _Phases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def load_plan(source: str | Path) -> Plan:
    """The plan of a build config (partitioned here) or of a built bundle (a directory)."""
    from dualtrack.compiler import partition
    from dualtrack.compiler.config import load_config
    from dualtrack.contract.bundle import Bundle

    path = Path(source)
    if path.is_dir():
        return Bundle.open(path, check_hashes=False).plan
    cfg = load_config(path)
    plan, _ = partition.plan_config(cfg, tuning.measured_for(cfg))
    return plan


def load_plans(source: str | Path) -> list[Plan]:
    """Every input size's plan (config or bundle `sizes`: a layer's shape differs per size, and a
    tuning record is keyed by shape); the one plan of :func:`load_plan` without sizes."""
    from dualtrack.compiler.build import front_end
    from dualtrack.compiler.config import load_config
    from dualtrack.contract.bundle import Bundle

    path = Path(source)
    if path.is_dir():
        b = Bundle.open(path, check_hashes=False)
        return [b.plan, *(s.plan for s in b.manifest.sizes)]
    cfg = load_config(path)
    if cfg.sizes is None:
        return [load_plan(path)]
    lead = front_end(cfg, tuning.measured_for(cfg), [], lambda msg: None)
    return [lead.plan, *(o.plan for o in lead.others)]


def default_output(source: str | Path) -> Path:
    """Where results go without -o: the config's `tuning`, else ./tuning.json."""
    from dualtrack.compiler.config import load_config

    path = Path(source)
    if path.is_file():
        configured = load_config(path).tuning
        if configured is not None:
            return configured
    return Path("tuning.json")


def arch_of(cc: tuple[int, int]) -> arch.ArchInfo:
    """The Track A target of a GPU's compute capability (sm_90a for 9.0)."""
    for a in arch.ARCHES.values():
        if a.cc == cc:
            return a
    known = ", ".join(f"{a.name} ({a.cc_str})" for a in arch.ARCHES.values())
    raise ArchError(f"no Track A target for compute capability {cc[0]}.{cc[1]}; tune runs on {known}")


# -- compile ---------------------------------------------------------------------------------------


@dataclass
class _Compiled:
    entries: dict[str, F16Tile]  # entry -> tile, every candidate that can run
    program: dict[str, int]  # entry -> index of the cubin that holds it
    rejected: dict[str, str]  # entry -> why it cannot (spills)
    cubins: list[bytes]


def compile_candidates(conv: Conv3x3Spec, tiles: Sequence[F16Tile], target: arch.ArchInfo, jobs: int) -> _Compiled:
    """NVRTC + nvJitLink for every tile, as extra entries of a few programs compiled in parallel
    (NVRTC and nvJitLink release the GIL). Every program also holds the fixed entries, so there is
    always at least one, and the fixed entries are taken from the first."""
    extra = sorted({t for t in tiles if conv.tuned_entry(t) not in conv.f16_tiles()})
    per = max(2, math.ceil(len(extra) / max(1, jobs)))
    chunks = [extra[i : i + per] for i in range(0, len(extra), per)] or [[]]
    source = ptx.SOURCE_DIR / f"{conv.source}.cu"

    def build(chunk: list[F16Tile]) -> tuple[tuple[str, ...], ptx.CubinArtifact]:
        art = ptx.compile_ptx(source, target.ptx_arch, {**conv.defines(), **conv.extra_entries_define(chunk)})
        return art.entries, ptx.assemble_cubin(art.text, target.cubin_arch, name=f"{conv.source}.ptx")

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(chunks)))) as pool:
        built = list(pool.map(build, chunks))
    cubins = [c for _, c in built]
    out = _Compiled({}, {}, {}, [c.data for c in cubins])
    for tile in tiles:
        entry = conv.tuned_entry(tile)
        # The PTX says which program has the entry; nvJitLink's info log (registers, spills) is
        # not guaranteed to list every kernel with every nvJitLink release.
        index = next(i for i, (entries, _) in enumerate(built) if entry in entries)
        res = cubins[index].resources.get(entry)
        if res is not None and res.spills:
            out.rejected[entry] = f"spills {res.spill_stores} B ({res.registers} registers)"
        else:
            out.entries[entry], out.program[entry] = tile, index
    return out


# -- one problem ---------------------------------------------------------------------------------------


def random_fp16(rng: np.random.Generator, size: int) -> np.ndarray:
    """``size`` random fp16 values, ±[1/8, 2): random sign, one of four exponents and a random
    mantissa, made from random bits (10x faster than drawing floats: the inputs at N=8, 512x512
    are 10^8 values)."""
    bits = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    exponent = bits >> 10
    exponent &= 3
    exponent += 12  # 2^-3 .. 2^0
    exponent <<= 10
    bits &= 0x83FF  # sign and mantissa
    bits |= exponent
    return bits.view(np.float16)


def sample_pixels(pixels: int, rng: np.random.Generator, run: int, all_below: int) -> np.ndarray:
    """Output pixels to check: all of them for a small problem, else one random pixel in every run
    of ``run`` consecutive pixels (so every block of a tile at least ``run`` pixels tall has one)."""
    if pixels <= all_below:
        return np.arange(pixels, dtype=np.int64)
    starts = np.arange(0, pixels, run, dtype=np.int64)
    return np.minimum(starts + rng.integers(0, run, starts.size), pixels - 1)


def _median_ms(launch: Callable[[], None], events: list[Event], stream: Stream, warmup: int) -> float:
    """Median of back-to-back launches, each between two CUDA events, after ``warmup`` launches."""
    for _ in range(warmup):
        launch()
    events[0].record(stream)
    for ev in events[1:]:
        launch()
        ev.record(stream)
    return statistics.median(a.elapsed_ms(b) for a, b in itertools.pairwise(events))


@dataclass(frozen=True)
class _Gpu:
    """This GPU as a record states it, and what runs on it."""

    device: Device
    info: kernels.DeviceInfo  # what the chooser plans for (device.info())
    target: arch.ArchInfo
    nvrtc: str
    source_sha256: str
    ctx: Context
    stream: Stream
    pool: DevicePool
    events: list[Event]


def _open_device(index: int) -> Device:
    """The GPU to tune on, or DeviceError naming where to run `dualtrack tune`."""
    try:
        return Device(index)
    except DeviceError as exc:
        if exc.message not in (NO_DRIVER, NO_DEVICE):
            raise
        found = exc.message.split(";")[0]
        raise DeviceError(
            f"dualtrack tune times kernels on a GPU: {found}; run it on the GPU machine and build "
            "with its file (`dualtrack build CONFIG --tuning FILE`)"
        ) from None


# What the tuner searches: mma.sync tiles, so it asks the chooser with the wgmma kernel off.
_MMA_ONLY = "the tuner times conv3x3_nhwc's mma.sync tiles"


def _problems(source: str | Path, opts: TuneOptions) -> tuple[dict[ConvProblem, list[ConvLayer]], int]:
    """The distinct problems worth tuning (and how many layers they cover): those the chooser runs on
    an mma.sync tile. fp32 has one entry, and a small-C layer runs the direct entry whatever is
    tuned (``kernels.conv_choice``): neither has tiles to search. Which kernel runs a layer does not
    depend on the device (its tile does), so this is asked before there is one."""
    device = REFERENCE
    layers = [x for plan in load_plans(source) for x in conv_layers(plan, opts.batches or None, opts.layers)]
    problems = {
        p: ls
        for p, ls in by_problem(layers).items()
        if kernels.conv_choice(p, device, wgmma_off=_MMA_ONLY).impl == "mma.sync"
    }
    if not problems:
        what = f" matching {opts.layers!r}" if opts.layers else ""
        raise ConfigError(
            f"{source}: no fp16 Track A conv3x3 layer{what} to tune (fp32 convolutions have one "
            f"entry, and layers with C <= {kernels.SMALL_C_MAX} run the small-C entry: nothing to "
            "search); check --layers and the config's precision and partition"
        )
    return problems, len(layers)


def tune_track_a(
    source: str | Path,
    output: str | Path | None = None,
    options: TuneOptions | None = None,
    *,
    progress: Progress | None = None,
    on_problem: ProblemProgress | None = None,
    settings: Settings | None = None,
) -> TuneResult:
    """Tune every Track A conv3x3 problem of ``source`` (a build config or a bundle) on this GPU and
    merge the winners into ``output`` (default: :func:`default_output`). The Python API behind
    `dualtrack tune`. DeviceError (exit 9) where there is no GPU."""
    t0 = time.perf_counter()
    opts = options or TuneOptions()
    say = progress or (lambda msg: None)
    settings = settings or Settings.from_env()
    phase = _Phases()
    conv = kernels.KERNELS["conv3x3"]
    assert isinstance(conv, Conv3x3Spec)

    with phase("plan"):
        out_path = Path(output) if output is not None else default_output(source)
        problems, n_layers = _problems(source, opts)
        say(f"{n_layers} conv layers x batch sizes -> {len(problems)} distinct problems")
    device = _open_device(opts.device_index)
    target = arch_of(device.cc)
    ctx = device.primary_context()
    stream = Stream(ctx)
    gpu = _Gpu(
        device,
        device.info(),
        target,
        "{}.{}".format(*ptx.nvrtc_version()),
        tuning.source_sha256(conv),
        ctx,
        stream,
        DevicePool(ctx),
        [Event(ctx) for _ in range(opts.iters + 1)],
    )
    try:
        with phase("compile"):
            tiles = space.candidates(device.cc, list(conv.f16_tiles().values()), opts.max_configs)
            say(f"compile {len(tiles)} candidate tiles for {target.cubin_arch} ({device.name})")
            built = compile_candidates(conv, tiles, target, settings.jobs)
            modules = [
                Module.load(ctx, data, kind="cubin", origin=f"tune program {i}", target=target.cubin_arch)
                for i, data in enumerate(built.cubins)
            ]
            functions = {e: modules[0].function(e) for e in conv.f16_tiles()}  # the baselines
            functions.update((e, modules[i].function(e)) for e, i in built.program.items())
            for entry, why in built.rejected.items():
                say(f"{entry}: rejected ({why})")
        records: list[tuning.TileRecord] = []
        for i, (problem, group) in enumerate(problems.items()):
            if on_problem:
                on_problem(i, len(problems), problem.label())
            records.append(_tune_problem(gpu, conv, problem, group, built, functions, opts, phase, say))
        if on_problem:
            on_problem(len(problems), len(problems), "done")
        with phase("write"):
            tuning.save(out_path, records)
    finally:
        stream.synchronize()
        gpu.pool.close()
        stream.close()
        ctx.close()
    seconds = time.perf_counter() - t0
    return TuneResult(out_path, records, device.name, target.name, len(built.entries), phase.seconds, seconds)


@dataclass
class _Inputs:
    """One problem's data on the GPU and its reference at the sampled pixels."""

    bufs: list[DeviceBuffer]  # x, w, bias
    y: DeviceBuffer
    host: HostBuffer
    pixels: np.ndarray
    ref: np.ndarray
    ref_norm: float

    def close(self) -> None:
        for buf in (*self.bufs, self.y):
            buf.close()
        self.host.close()


def _inputs(gpu: _Gpu, conv: Conv3x3Spec, p: ConvProblem, opts: TuneOptions) -> _Inputs:
    """Seeded random input, weights and bias uploaded, and the numpy reference at the sampled pixels."""
    stream, M = gpu.stream, p.pixels
    rng = np.random.default_rng([opts.seed, p.N, p.H, p.W, p.C, p.K, p.ldx, p.ldy])
    x = random_fp16(rng, M * p.ldx)
    w = (rng.standard_normal((p.K, 3, 3, p.C), dtype=np.float32) / math.sqrt(9 * p.C)).astype(np.float16)
    bias = rng.standard_normal(p.K, dtype=np.float32)
    pixels = sample_pixels(M, rng, opts.sample_run, opts.sample_all)
    ref = conv.reference_at(x.reshape(p.N, p.H, p.W, p.ldx)[..., : p.C], w, pixels, bias).astype(np.float64)
    bufs = [gpu.pool.alloc(a.nbytes, stream) for a in (x, w, bias)]
    for buf, a in zip(bufs, (x, w, bias), strict=True):
        upload(stream, buf, a)
    y = gpu.pool.alloc(M * p.ldy * 2, stream)
    host = HostBuffer(gpu.ctx, M * p.ldy * 2)
    stream.synchronize()
    return _Inputs(bufs, y, host, pixels, ref, max(float(np.linalg.norm(ref)), 1e-30))


def _verify(
    gpu: _Gpu, p: ConvProblem, data: _Inputs, launchers: dict[str, Callable[[], None]], opts: TuneOptions, say: Progress
) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """Each candidate once on a NaN-poisoned output: {entry: rel L2} of those that pass, and
    (entry, why) of those that fail."""
    stream, M = gpu.stream, p.pixels
    verified: dict[str, float] = {}
    rejected: list[tuple[str, str]] = []
    for entry, launch in launchers.items():
        call(cu.cuMemsetD16Async, data.y.ptr, _POISON, M * p.ldy, stream.handle)
        launch()
        download(stream, data.host, data.y)
        stream.synchronize()
        out = data.host.numpy(np.uint16, (M, p.ldy))
        result = _check(out, p.K, data.pixels, data.ref, data.ref_norm, opts.tolerance)
        if isinstance(result, str):
            rejected.append((entry, result))
            say(f"{p.label()}: {entry} rejected ({result})")
        else:
            verified[entry] = result
    return verified, rejected


def _tune_problem(
    gpu: _Gpu,
    conv: Conv3x3Spec,
    p: ConvProblem,
    group: list[ConvLayer],
    built: _Compiled,
    functions: dict[str, Kernel],
    opts: TuneOptions,
    phase: _Phases,
    say: Progress,
) -> tuning.TileRecord:
    """Inputs, reference, verification and timing of every candidate on one problem -> its record."""
    with phase("inputs"):
        data = _inputs(gpu, conv, p, opts)
    try:
        x, w, bias = (b.ptr for b in data.bufs)
        args = conv.args(
            x=x, w=w, bias=bias, y=data.y.ptr, N=p.N, H=p.H, W=p.W, C=p.C, K=p.K, ldx=p.ldx, ldy=p.ldy, relu=False
        )
        # What the engine launches without a tuning file (the wgmma kernel aside: it is not tuned).
        baseline = kernels.conv_choice(p, gpu.info, wgmma_off=_MMA_ONLY).entry
        every = [*built.entries.values(), *(conv.entry_tile(e) for e in built.rejected)]
        entries = list(dict.fromkeys([baseline, *(conv.tuned_entry(t) for t in space.prune(every, p.pixels, p.K))]))
        # The baseline runs whatever ptxas said: it is what the engine launches without a tuning file.
        rejected: list[tuple[str, str]] = [(e, built.rejected[e]) for e in entries[1:] if e in built.rejected]
        candidates = [baseline, *(e for e in entries[1:] if e not in built.rejected)]

        def launcher(entry: str) -> Callable[[], None]:
            cfg = conv.launch(p.dtype, p.N, p.H, p.W, p.C, p.K, entry=entry)
            kern = functions[entry]
            return lambda: kern.launch(cfg.grid, cfg.block, cfg.shared_bytes, gpu.stream, args)

        launchers = {entry: launcher(entry) for entry in candidates}
        with phase("verify"):
            verified, failed = _verify(gpu, p, data, launchers, opts, say)
        rejected += failed
        if baseline not in verified:
            reason = dict(rejected).get(baseline, "not run")
            raise VerificationError(
                f"the heuristic's entry {baseline} fails on {p.label()} ({reason}): a kernel bug, not a "
                "tuning result; run `make gpu-test`"
            )
        with phase("time"):
            times = {e: _median_ms(launchers[e], gpu.events, gpu.stream, opts.warmup) for e in verified}
    finally:  # also when a candidate fails: the pool is reused by the next problem
        data.close()
    best = min(times, key=times.__getitem__)
    say(
        f"{p.label()}: {best} {times[best]:.4f} ms, baseline {baseline} {times[baseline]:.4f} ms "
        f"({times[baseline] / times[best]:.2f}x; {len(candidates)} run, {len(rejected)} rejected)"
    )
    return _record(gpu, conv, p, group, best, baseline, times, verified[best], len(entries), rejected)


def _record(
    gpu: _Gpu,
    conv: Conv3x3Spec,
    p: ConvProblem,
    group: list[ConvLayer],
    best: str,
    baseline: str,
    times: dict[str, float],
    rel_l2: float,
    tried: int,
    rejected: list[tuple[str, str]],
) -> tuning.TileRecord:
    """One problem's tuning record: the winner, the baseline, this GPU and toolchain."""
    cc = gpu.device.cc
    return tuning.TileRecord(
        kernel=conv.source,
        entry=best,
        params=conv.entry_tile(best),
        source_sha256=gpu.source_sha256,
        problem=p,
        gpu=gpu.device.name,
        cc=f"{cc[0]}.{cc[1]}",
        arch=gpu.target.name,
        driver=gpu.device.driver_version,
        nvrtc=gpu.nvrtc,
        time_ms=times[best],
        baseline_entry=baseline,
        baseline_ms=times[baseline],
        rel_l2=rel_l2,
        tried=tried,
        rejected=tuple(rejected),
        layers=tuple(dict.fromkeys(f"{layer.node}@{layer.batch}" for layer in group)),
    )


def _check(out: np.ndarray, K: int, pixels: np.ndarray, ref: np.ndarray, ref_norm: float, tol: float) -> float | str:
    """A candidate's output (fp16 bits, (M, ldy)) against the poison and the reference: its rel L2
    at the sampled pixels, or why it is rejected."""
    unwritten = int(np.count_nonzero(out[:, :K] == _POISON))
    if unwritten:
        return f"{unwritten} of {out.shape[0] * K} outputs not written"
    if out.shape[1] > K and not np.all(out[:, K:] == _POISON):
        return "wrote channels past K (another tensor's slice)"
    got = out[pixels, :K].view(np.float16).astype(np.float64)
    if not np.all(np.isfinite(got)):
        return "non-finite outputs"
    rel = float(np.linalg.norm(got - ref) / ref_norm)
    if rel > tol:
        return f"rel L2 {rel:.2e} > {tol:.0e}"
    return rel


__all__ = ["TuneOptions", "TuneResult", "compile_candidates", "load_plan", "sample_pixels", "tune_track_a"]
