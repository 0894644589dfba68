"""The tuning file: what `dualtrack tune` measured on a GPU, and what `dualtrack build` reads.

One JSON document, ``{"schema": "dualtrack-tuning", "version": 1, "records": [...]}``, written
atomically (a temporary file renamed into place). Every record has a ``kind``; this module reads
and writes the file for every kind (:func:`read_records`, :func:`save_records`: a save replaces
records of the kinds it writes that have the same key, and keeps all others as they are), and
types the Track A kind, ``track_a_tile`` (:class:`TileRecord`): the fastest verified tile of one
kernel for one problem on one GPU,

    kernel, entry, params (the tile), source_sha256, dtype, problem (N, H, W, C, K, ldx, ldy),
    gpu, cc, arch, driver, nvrtc, time_ms, baseline_entry, baseline_ms, speedup, rel_l2,
    tried, rejected ([entry, reason] pairs), layers (the nodes it was measured for), date

keyed by (kernel, source_sha256, problem, gpu, cc, driver).

``source_sha256`` hashes the kernel source and the ``-D`` tile macros it is built with
(:func:`source_sha256`); a record whose hash differs from the current source is stale, and
:func:`select` ignores it. For a build target a record applies when its compute capability equals
the target's; of several, the newest wins. A winner less than :data:`MIN_SPEEDUP` times faster
than the baseline (the heuristic's entry, ``Conv3x3Spec.variant``, always timed alongside) is
recorded but not used: the build keeps the heuristic's entry, as timing noise is not worth an
extra kernel.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from dualtrack import atomic
from dualtrack.compiler.config import BuildConfig
from dualtrack.compiler.cost import ConvKey
from dualtrack.compiler.kernel_build import SOURCE_DIR
from dualtrack.compiler.partition import model_hash, strip_initializers
from dualtrack.contract.arch import Resolution, resolve
from dualtrack.contract.plan import Plan
from dualtrack.errors import ConfigError, InputError
from dualtrack.kernels import KERNELS, Conv3x3Spec, F16Tile
from dualtrack.kernels.problems import ConvProblem, conv_layers

SCHEMA = "dualtrack-tuning"
SCHEMA_VERSION = 1
TILE_KIND = "track_a_tile"
MIN_SPEEDUP = 1.02

Record = dict[str, Any]


# -- the file, any kind of record ---------------------------------------------------------------


def _fix(path: Path) -> str:
    return f"re-run `dualtrack tune CONFIG -o {path}` on the GPU, or point `tuning:` / --tuning elsewhere"


def read_records(path: str | Path) -> list[Record]:
    """Every record of a tuning file; ConfigError (one line, with the fix) if it is missing or is
    not a tuning file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"tuning file {path} not found; {_fix(path)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read tuning file {path} ({e.__class__.__name__}); {_fix(path)}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"tuning file {path} is not JSON (line {e.lineno}: {e.msg}); {_fix(path)}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ConfigError(f'{path} is not a dualtrack tuning file (no "schema": "{SCHEMA}"); {_fix(path)}')
    if doc.get("version") != SCHEMA_VERSION:
        raise ConfigError(
            f"tuning file {path} is version {doc.get('version')}, this dualtrack reads {SCHEMA_VERSION}; {_fix(path)}"
        )
    records = doc.get("records")
    if not isinstance(records, list) or not all(isinstance(r, dict) and "kind" in r for r in records):
        raise ConfigError(f'tuning file {path} has no "records" list of objects with a "kind"; {_fix(path)}')
    return records


def merge_records(old: Iterable[Record], new: Iterable[Record], key: Callable[[Record], Any]) -> list[Record]:
    """``old`` with each record of a kind that ``new`` holds replaced by the ``new`` one of the
    same ``key``; records of other kinds are kept as they are. Sorted by kind, then key."""
    new = list(new)
    kinds = {r["kind"] for r in new}
    kept = [r for r in old if r["kind"] not in kinds]
    mine = {repr(key(r)): r for r in old if r["kind"] in kinds}
    mine.update((repr(key(r)), r) for r in new)
    return sorted(kept, key=lambda r: (r["kind"], json.dumps(r, sort_keys=True))) + [mine[k] for k in sorted(mine)]


def write_records(path: str | Path, records: Sequence[Record]) -> Path:
    """Write a tuning file atomically: readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "version": SCHEMA_VERSION, "records": list(records)}
    return atomic.write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def save_records(path: str | Path, new: Iterable[Record], key: Callable[[Record], Any]) -> list[Record]:
    """Merge ``new`` into the file at ``path`` (created if missing) and write it; returns every record.
    An existing file that is not a tuning file is refused (ConfigError), never overwritten."""
    path = Path(path)
    merged = merge_records(read_records(path) if path.exists() else [], new, key)
    write_records(path, merged)
    return merged


# -- Track A: the fastest tile of a kernel for one problem ------------------------------------------


def source_sha256(spec: Conv3x3Spec | None = None, source_dir: Path = SOURCE_DIR) -> str:
    """SHA-256 of a kernel's source file, the headers it may include and the ``-D`` macros it is
    compiled with."""
    conv = spec or KERNELS["conv3x3"]
    h = hashlib.sha256((Path(source_dir) / f"{conv.source}.cu").read_bytes())
    for header in sorted(Path(source_dir).glob("*.cuh")):
        h.update(header.name.encode() + header.read_bytes())
    h.update(json.dumps(conv.defines(), sort_keys=True).encode())
    return h.hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class TileRecord:
    """The fastest verified entry of a Track A kernel for one problem on one GPU (kind ``track_a_tile``)."""

    kernel: str  # source stem, e.g. conv3x3_nhwc
    entry: str
    params: F16Tile
    source_sha256: str
    problem: ConvProblem
    gpu: str
    cc: str  # "9.0"
    arch: str  # "sm_90a"
    driver: int  # cuDriverGetVersion form: 13000 is CUDA 13.0
    nvrtc: str
    time_ms: float
    baseline_entry: str
    baseline_ms: float
    rel_l2: float
    tried: int
    rejected: tuple[tuple[str, str], ...] = ()
    layers: tuple[str, ...] = ()
    date: str = field(default_factory=_now)

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.time_ms if self.time_ms > 0 else 0.0

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.kernel, self.source_sha256, self.problem, self.gpu, self.cc, self.driver)

    @property
    def beats_baseline(self) -> bool:
        """Whether a build launches :attr:`entry` rather than the heuristic's (the baseline's) choice."""
        return self.entry != self.baseline_entry and self.speedup >= MIN_SPEEDUP

    def to_json(self) -> Record:
        p = self.params
        return {
            "kind": TILE_KIND,
            "kernel": self.kernel,
            "entry": self.entry,
            "params": {
                "bm": p.bm,
                "bn": p.bn,
                "bk": p.bk,
                "warps_m": p.warps_m,
                "warps_n": p.warps_n,
                "stages": p.stages,
                "min_blocks": p.min_blocks,
            },
            "source_sha256": self.source_sha256,
            "dtype": self.problem.dtype,
            "problem": self.problem.to_json(),
            "gpu": self.gpu,
            "cc": self.cc,
            "arch": self.arch,
            "driver": self.driver,
            "nvrtc": self.nvrtc,
            "time_ms": round(self.time_ms, 5),
            "baseline_entry": self.baseline_entry,
            "baseline_ms": round(self.baseline_ms, 5),
            "speedup": round(self.speedup, 4),
            "rel_l2": self.rel_l2,
            "tried": self.tried,
            "rejected": [list(r) for r in self.rejected],
            "layers": list(self.layers),
            "date": self.date,
        }

    @classmethod
    def from_json(cls, d: Record) -> TileRecord:
        """Parse one record; KeyError, TypeError or ValueError says what is wrong."""
        params = F16Tile(**{k: int(v) for k, v in d["params"].items()})
        spec = KERNELS["conv3x3"]
        assert isinstance(spec, Conv3x3Spec)
        if d["kernel"] != spec.source:
            raise ValueError(f"kernel {d['kernel']!r} has no tunable tiles (only {spec.source})")
        if spec.entry_tile(d["entry"]) != params:
            raise ValueError(f"entry {d['entry']} does not run the tile of its params ({params.name})")
        return cls(
            kernel=str(d["kernel"]),
            entry=str(d["entry"]),
            params=params,
            source_sha256=str(d["source_sha256"]),
            problem=ConvProblem.from_json({**d["problem"], "dtype": d.get("dtype", "float16")}),
            gpu=str(d["gpu"]),
            cc=str(d["cc"]),
            arch=str(d["arch"]),
            driver=int(d["driver"]),
            nvrtc=str(d["nvrtc"]),
            time_ms=float(d["time_ms"]),
            baseline_entry=str(d["baseline_entry"]),
            baseline_ms=float(d["baseline_ms"]),
            rel_l2=float(d["rel_l2"]),
            tried=int(d["tried"]),
            rejected=tuple((str(e), str(r)) for e, r in d.get("rejected", ())),
            layers=tuple(str(x) for x in d.get("layers", ())),
            date=str(d["date"]),
        )


def tile_key(record: Record) -> tuple[Any, ...]:
    """The merge key of a ``track_a_tile`` record in its JSON form."""
    return TileRecord.from_json(record).key


def load(path: str | Path) -> list[TileRecord]:
    """The Track A records of a tuning file (records of other kinds are skipped); ConfigError if the
    file is missing or malformed."""
    out = []
    for i, r in enumerate(read_records(path)):
        if r["kind"] != TILE_KIND:
            continue
        try:
            out.append(TileRecord.from_json(r))
        except (KeyError, TypeError, ValueError, AttributeError, InputError) as e:
            what = f"missing {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
            raise ConfigError(f"tuning file {path}: record {i} is malformed ({what}); {_fix(Path(path))}") from None
    return out


def save(path: str | Path, records: Iterable[TileRecord]) -> list[Record]:
    """Merge Track A records into the tuning file at ``path`` (see :func:`save_records`)."""
    return save_records(path, [r.to_json() for r in records], tile_key)


def stale(records: Iterable[TileRecord], current: str) -> list[TileRecord]:
    """Records made from another version of the source than ``current`` (its :func:`source_sha256`)."""
    return [r for r in records if r.source_sha256 != current]


def lookup(
    records: Iterable[TileRecord], problem: ConvProblem, cc: tuple[int, int], source: str, kernel: str
) -> TileRecord | None:
    """The record for ``problem`` on a GPU of compute capability ``cc``, made from the source whose
    hash is ``source``: the newest that matches (then by GPU and driver, for a stable choice), or None."""
    cc_str = f"{cc[0]}.{cc[1]}"
    found = [
        r
        for r in records
        if r.kernel == kernel and r.source_sha256 == source and r.problem == problem and r.cc == cc_str
    ]
    return max(found, key=lambda r: (r.date, r.gpu, r.driver), default=None)


@dataclass(frozen=True)
class TunedTarget:
    """What a tuning file decides for one build target."""

    arch: str  # the target, e.g. sm_90a
    calls: dict[str, dict[str, str]]  # Conv node -> batch size (a string: JSON keys) -> entry to launch
    tiles: frozenset[F16Tile]  # tiles whose tuned entries the target's PTX must have
    records: tuple[TileRecord, ...]  # every record consulted, chosen or not

    def to_json(self) -> dict[str, Any]:
        conv = KERNELS["conv3x3"]
        assert isinstance(conv, Conv3x3Spec)
        return {
            "calls": self.calls,
            "entries": sorted(conv.tuned_entry(t) for t in self.tiles),
            "tuned_on": sorted({f"{r.gpu} (driver {r.driver // 1000}.{r.driver % 1000 // 10})" for r in self.records}),
            "records": len(self.records),
        }


@dataclass(frozen=True)
class Selection:
    """A tuning file applied to one plan and its targets."""

    path: Path
    sha256: str
    targets: dict[str, TunedTarget]
    stale: int

    def tiles_for(self, ptx_arch: str, resolutions: Iterable[Resolution]) -> frozenset[F16Tile]:
        """The tiles to compile into one PTX: the union over the targets built from it."""
        out: set[F16Tile] = set()
        for r in resolutions:
            if r.arch.ptx_arch == ptx_arch and r.arch.name in self.targets:
                out |= self.targets[r.arch.name].tiles
        return frozenset(out)

    def key(self) -> str:
        """What the build key covers: every record consulted and every choice made."""
        doc = {a: {"calls": t.calls, "records": [r.to_json() for r in t.records]} for a, t in self.targets.items()}
        return json.dumps(doc, sort_keys=True)

    def note(self) -> str | None:
        """The one warning line about stale records, if there are any."""
        if not self.stale:
            return None
        return (
            f"tuning file {self.path}: {self.stale} record(s) were measured on another version of "
            f"{KERNELS['conv3x3'].source}.cu and are ignored; re-run `dualtrack tune` to refresh them"
        )


def select(path: str | Path, plan: Plan, resolutions: Sequence[Resolution]) -> Selection:
    """Read the tuning file at ``path`` and decide, for each target and each Track A conv layer at
    each batch size, the entry to launch. Only choices that differ from the heuristic are kept."""
    path = Path(path)
    records = load(path)
    spec = KERNELS["conv3x3"]
    assert isinstance(spec, Conv3x3Spec)
    current = source_sha256(spec)
    layers = conv_layers(plan)
    targets: dict[str, TunedTarget] = {}
    for res in resolutions:
        calls: dict[str, dict[str, str]] = {}
        tiles: set[F16Tile] = set()
        used: dict[str, TileRecord] = {}
        for layer in layers:
            rec = lookup(records, layer.problem, res.arch.cc, current, spec.source)
            if rec is None:
                continue
            used[repr(rec.key)] = rec
            p = layer.problem
            if not rec.beats_baseline or rec.entry == spec.variant(p.dtype, p.N, p.H, p.W, p.C, p.K):
                continue
            if spec.smallc_supported(p.dtype, p.C, p.K) is None:
                continue  # a small-C layer runs the direct entry whatever the file says (kernels.conv_choice)
            calls.setdefault(layer.node, {})[str(layer.batch)] = rec.entry
            if rec.entry not in spec.f16_tiles():
                tiles.add(rec.params)
        if used:
            targets[res.arch.name] = TunedTarget(
                res.arch.name, calls, frozenset(tiles), tuple(used[k] for k in sorted(used))
            )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Selection(path, digest, targets, len(stale(records, current)))


def measured_times(path: str | Path, cc: tuple[int, int]) -> dict[ConvKey, float]:
    """What `partition: auto`'s cost model takes from a tuning file: the fastest measured time (ms)
    of each conv3x3 launch shape, from the current records of compute capability ``cc`` (the build's
    first target). Records keyed by channel strides collapse to the dense shape the partition sees."""
    spec = KERNELS["conv3x3"]
    assert isinstance(spec, Conv3x3Spec)
    current, cc_str = source_sha256(spec), f"{cc[0]}.{cc[1]}"
    out: dict[ConvKey, float] = {}
    for r in load(path):
        if r.source_sha256 == current and r.cc == cc_str:
            p = r.problem
            key = (p.N, p.H, p.W, p.C, p.K, p.dtype)
            out[key] = min(out.get(key, r.time_ms), r.time_ms)
    return out


def measured_for(cfg: BuildConfig) -> dict[ConvKey, float] | None:
    """The Track A times `dualtrack build` gives the partition's cost model for ``cfg``: those of its
    tuning file on its first target (one plan serves every target), or None without a tuning file or
    a GPU target. Every command that partitions a config asks this, so that they all see one plan."""
    if cfg.tuning is None or not cfg.targets:
        return None
    return measured_times(cfg.tuning, resolve(cfg.targets[0]).cc)


# -- Track B: IREE flag records (`dualtrack tune --track-b` writes them, `build` reads them) ----------

RECORD_KIND = "iree_flags"
# What a bundle's manifest keeps of the record each tuned module was compiled from.
TUNED_FIELDS = ("flags", "candidate", "gpu", "time_ms", "baseline_ms", "speedup")


def segment_key(model: onnx.ModelProto) -> str:
    """What a flag choice is valid for: the segment's graph without weights and without a batch."""
    return model_hash(strip_initializers(model))


def record_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    """Records with the same key replace each other when a tuning file is merged."""
    return (rec["kind"], rec["segment_key"], rec["iree_target"], rec["batch"], rec["gpu"], rec["cc"])


def flag_records(path: str | Path) -> list[dict[str, Any]]:
    """The Track B records of a tuning file (ConfigError, with the fix, if it is not one)."""
    return [r for r in read_records(path) if r.get("kind") == RECORD_KIND]


def flags_for(recs: Sequence[dict[str, Any]], key: str, iree_target: str, batch: int) -> dict[str, Any] | None:
    """The record whose winning flags `build` uses for this segment graph, IREE target and batch."""
    found = [
        r
        for r in recs
        if r.get("kind") == RECORD_KIND
        and r.get("segment_key") == key
        and r.get("iree_target") == iree_target
        and r.get("batch") == batch
        and r.get("flags") is not None
    ]
    return max(found, key=lambda r: r.get("date", "")) if found else None
