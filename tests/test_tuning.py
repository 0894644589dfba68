"""The tuning file (round trip, merge, atomic write, lookup, staleness, other kinds kept), the
problems a plan poses, the sampled reference the tuner checks against, and `dualtrack build` with a
tuning file on the tiny fp16 U-Net. No GPU: `dualtrack tune` itself is tested in tests/gpu."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dualtrack import atomic
from dualtrack.compiler import partition
from dualtrack.compiler import tuned as tuning
from dualtrack.compiler.build import build
from dualtrack.compiler.config import load_config
from dualtrack.compiler.kernel_build import SOURCE_DIR, assemble_cubin
from dualtrack.contract.arch import resolve_targets
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import Plan
from dualtrack.errors import ConfigError
from dualtrack.kernels import KERNELS, Conv3x3Spec, F16Tile
from dualtrack.kernels.problems import ConvProblem, by_problem, channel_strides, conv_layers
from dualtrack.tuning.tiles import random_fp16, sample_pixels

CONV = KERNELS["conv3x3"]
assert isinstance(CONV, Conv3x3Spec)
TILE = F16Tile(64, 32, 32, 2, 2, 4, 4)
HAND_TILES = ((64, 32, 32, 2, 2, 4, 4), (64, 64, 32, 2, 4, 4, 3), (128, 32, 64, 4, 1, 2, 4))  # all in the space


def record(**change: object) -> tuning.TileRecord:
    base = {
        "kernel": "conv3x3_nhwc",
        "entry": CONV.tuned_entry(TILE),
        "params": TILE,
        "source_sha256": tuning.source_sha256(),
        "problem": ConvProblem(8, 64, 64, 32, 32, 32, 64),
        "gpu": "NVIDIA H200",
        "cc": "9.0",
        "arch": "sm_90a",
        "driver": 13000,
        "nvrtc": "13.0",
        "time_ms": 0.05,
        "baseline_entry": "conv3x3_nhwc_f16_narrow",
        "baseline_ms": 0.08,
        "rel_l2": 3e-4,
        "tried": 30,
        "rejected": (("conv3x3_nhwc_f16_t64x32x64_w2x2_s4_b4", "rel L2 1.0e+00 > 2e-03"),),
        "layers": ("enc1/conv2@8",),
        "date": "2026-11-29T10:00:00Z",
    }
    return tuning.TileRecord(**{**base, **change})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def full_plan(tiny_full_config: Path) -> Plan:
    cfg = load_config(tiny_full_config)
    plan, _ = partition.plan_config(cfg)
    return plan


# --- the file --------------------------------------------------------------------------------------


def test_record_round_trips_through_json_and_the_file(tmp_path: Path) -> None:
    r = record()
    doc = r.to_json()
    assert doc["kind"] == tuning.TILE_KIND and doc["speedup"] == 1.6 and doc["dtype"] == "float16"
    assert doc["problem"] == {"N": 8, "H": 64, "W": 64, "C": 32, "K": 32, "ldx": 32, "ldy": 64, "dtype": "float16"}
    assert tuning.TileRecord.from_json(json.loads(json.dumps(doc))) == r
    path = tmp_path / "t.json"
    tuning.save(path, [r])
    assert tuning.load(path) == [r]
    assert json.loads(path.read_text())["schema"] == "dualtrack-tuning"


def test_merge_replaces_the_same_key_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    a, b = record(), record(problem=ConvProblem(1, 64, 64, 32, 32, 32, 64))
    tuning.save(path, [a, b])
    newer = record(time_ms=0.04, date="2026-11-30T10:00:00Z")  # same key as a: tuned again
    other_gpu = record(gpu="NVIDIA H100 80GB HBM3")
    tuning.save(path, [newer, other_gpu])
    got = tuning.load(path)
    assert len(got) == 3 and newer in got and other_gpu in got and b in got and a not in got


def test_records_of_other_kinds_are_kept_untouched(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    foreign = {"kind": "iree_flags", "segment_key": "abc", "flags": ["--iree-opt-level=O3"], "batch": 8}
    tuning.write_records(path, [foreign])
    tuning.save(path, [record()])
    raw = tuning.read_records(path)
    assert foreign in raw and len(raw) == 2
    assert tuning.load(path) == [record()]


def test_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.json"
    tuning.save(path, [record()])
    before = path.read_text()

    def crash(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", crash)  # tuning files are written through dualtrack.atomic
    with pytest.raises(OSError, match="disk full"):
        tuning.save(path, [record(time_ms=0.01)])
    assert path.read_text() == before  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary left behind


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, r"^tuning file .*missing\.json not found; re-run `dualtrack tune CONFIG -o .*missing\.json` on the GPU"),
        ("{not json", r"is not JSON \(line 1: Expecting property name"),
        ('{"records": []}', r'is not a dualtrack tuning file \(no "schema": "dualtrack-tuning"\)'),
        ('{"schema": "dualtrack-tuning", "version": 7, "records": []}', r"is version 7, this dualtrack reads 1"),
        ('{"schema": "dualtrack-tuning", "version": 1, "records": {}}', r'has no "records" list'),
    ],
)
def test_missing_or_malformed_file_is_one_config_error(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / ("missing.json" if text is None else "bad.json")
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        tuning.load(path)
    assert "\n" not in info.value.message and info.value.exit_code == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"params": None}, r"record 0 is malformed \(.*NoneType"),
        ({"entry": "conv3x3_nhwc_f16_wide"}, r"entry conv3x3_nhwc_f16_wide does not run the tile of its params"),
        ({"problem": {"N": 0, "H": 1, "W": 1, "C": 1, "K": 1, "ldx": 1, "ldy": 1}}, r"needs positive integers"),
        ({"kernel": "convt2x2_nhwc"}, r"kernel 'convt2x2_nhwc' has no tunable tiles"),
        ({"time_ms": None}, r"record 0 is malformed"),
    ],
)
def test_malformed_record_names_itself(tmp_path: Path, change: dict, message: str) -> None:
    path = tmp_path / "t.json"
    tuning.write_records(path, [{**record().to_json(), **change}])
    with pytest.raises(ConfigError, match=message):
        tuning.load(path)
    missing = record().to_json()
    del missing["gpu"]
    tuning.write_records(path, [missing])
    with pytest.raises(ConfigError, match=r"record 0 is malformed \(missing 'gpu'\)"):
        tuning.load(path)


def test_save_refuses_to_overwrite_a_file_that_is_not_a_tuning_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.json"
    path.write_text('{"mine": 1}')
    with pytest.raises(ConfigError, match="is not a dualtrack tuning file"):
        tuning.save(path, [record()])
    assert path.read_text() == '{"mine": 1}'


def test_lookup_matches_kernel_source_problem_and_cc_and_takes_the_newest() -> None:
    src = tuning.source_sha256()
    p = record().problem
    old = record(gpu="NVIDIA H100", date="2026-01-01T00:00:00Z")
    new = record(time_ms=0.03, date="2026-11-30T00:00:00Z")
    recs = [old, new, record(cc="8.0", arch="sm_80"), record(source_sha256="0" * 64, date="2027-01-01T00:00:00Z")]
    assert tuning.lookup(recs, p, (9, 0), src, "conv3x3_nhwc") == new
    assert tuning.lookup(recs, p, (8, 0), src, "conv3x3_nhwc").cc == "8.0"
    assert tuning.lookup(recs, p, (12, 0), src, "conv3x3_nhwc") is None
    assert tuning.lookup(recs, dataclasses.replace(p, ldy=32), (9, 0), src, "conv3x3_nhwc") is None
    assert tuning.stale(recs, src) == [recs[3]]


def test_source_hash_moves_with_the_source_and_the_tile_macros(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    cu = SOURCE_DIR / "conv3x3_nhwc.cu"
    for f in (cu, *SOURCE_DIR.glob("*.cuh")):
        shutil.copy(f, src / f.name)
    assert tuning.source_sha256(source_dir=src) == tuning.source_sha256()
    (src / cu.name).write_text(cu.read_text() + "\n// a comment\n")
    assert tuning.source_sha256(source_dir=src) != tuning.source_sha256()
    (src / cu.name).write_text(cu.read_text())
    header = next(src.glob("*.cuh"))
    header.write_text(header.read_text() + "\n// a comment\n")
    assert tuning.source_sha256(source_dir=src) != tuning.source_sha256()  # the shared header counts too
    wider = dataclasses.replace(CONV, f16_wide=(128, 128, 32, 4, 2, 2, 2))
    assert tuning.source_sha256(wider) != tuning.source_sha256()


def test_only_winners_that_beat_the_baseline_are_used() -> None:
    assert record().beats_baseline
    assert not record(time_ms=0.079).beats_baseline  # within MIN_SPEEDUP: noise, keep the heuristic
    assert not record(time_ms=0.09).beats_baseline  # slower: recorded, never used
    assert not record(
        entry="conv3x3_nhwc_f16_narrow", params=CONV.f16_tiles()["conv3x3_nhwc_f16_narrow"]
    ).beats_baseline


# --- problems -----------------------------------------------------------------------------------


def test_conv_layers_and_their_strides(full_plan: Plan) -> None:
    seg = next(s for s in full_plan.segments if s.track == "A")
    strides = channel_strides(seg)
    concat = [c for c in seg.calls if c.op == "concat"]
    assert concat
    for c in concat:  # a concatenation's inputs are slices of its output
        width = next(t for t in (*seg.tensors, *seg.outputs) if t.name == c.outputs[0]).shape[-1]
        assert all(strides[x] == width for x in c.inputs)
    layers = conv_layers(full_plan)
    convs = [c for c in seg.calls if c.op == "conv3x3"]
    assert len(layers) == len(convs) * len(full_plan.batch_sizes)
    enc = [x for x in layers if x.node == "enc1/conv2"]
    assert [x.batch for x in enc] == [1, 4]
    # reads a 4-channel buffer of its own, laid out 8 channels apart (16 bytes: contract.plan.padded_channels),
    # and writes half of a concat
    assert enc[0].problem == ConvProblem(1, 64, 64, 4, 4, 8, 8) and enc[0].relu
    assert all(x.problem.ldx >= x.problem.C and x.problem.ldy >= x.problem.K for x in layers)
    assert {x.node for x in conv_layers(full_plan, [4], "dec*")} == {c.nodes[0] for c in convs if "dec" in c.nodes[0]}
    assert {x.batch for x in conv_layers(full_plan, [4], "dec*")} == {4}
    groups = by_problem(layers)
    assert sum(map(len, groups.values())) == len(layers) and len(groups) <= len(layers)


def test_sample_pixels_covers_every_run() -> None:
    rng = np.random.default_rng(0)
    assert sample_pixels(1000, rng, 64, 4096).tolist() == list(range(1000))
    got = sample_pixels(100_003, rng, 64, 4096)
    assert got.size == -(-100_003 // 64) and got.min() >= 0 and got.max() < 100_003
    assert np.array_equal(got // 64, np.arange(got.size))  # one pixel in every run of 64


def test_random_fp16_inputs_are_finite_nonzero_and_both_signs() -> None:
    x = random_fp16(np.random.default_rng(0), 1 << 16).astype(np.float32)
    assert np.all(np.isfinite(x)) and np.abs(x).min() >= 0.125 and np.abs(x).max() < 2
    assert 0.45 < np.mean(x > 0) < 0.55 and len(np.unique(x)) > 4000
    again = random_fp16(np.random.default_rng(0), 1 << 16).astype(np.float32)
    assert np.array_equal(x, again)  # seeded


@pytest.mark.parametrize("relu", [False, True])
def test_reference_at_is_the_reference_at_those_pixels(relu: bool) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 11, 7, 6)).astype(np.float16)
    w = (rng.standard_normal((5, 3, 3, 6)) / 7).astype(np.float16)
    b = rng.standard_normal(5).astype(np.float32)
    full = CONV.reference(x, w, b, relu).reshape(-1, 5)
    pixels = rng.choice(full.shape[0], 40, replace=False)
    np.testing.assert_array_equal(CONV.reference_at(x, w, pixels, b, relu), full[pixels])
    np.testing.assert_array_equal(CONV.reference_at(x, w, np.arange(full.shape[0]), b, relu), full)


# --- build with a tuning file ---------------------------------------------------------------------


def _small_c(p: ConvProblem) -> bool:
    """Whether a layer runs the small-C entry whatever a tuning file says (kernels.choose_conv3x3)."""
    small = CONV.smallc_supported(p.dtype, p.C, p.K) is None
    assert small == (p.C <= 4)  # the tiny U-Net's K is at most 16
    return small


@pytest.fixture(scope="module")
def tuned(
    tiny_full_config: Path, tmp_path_factory: pytest.TempPathFactory, hand_tuning: Callable[..., list]
) -> tuple[Path, Path, object]:
    """The tiny fp16 U-Net built with a hand-written tuning file: (bundle, tuning file, build result)."""
    root = tmp_path_factory.mktemp("tuned")
    path = root / "tuning.json"
    hand_tuning(tiny_full_config, path, tiles=HAND_TILES)
    result = build(tiny_full_config, root / "bundle", tuning=path)
    return root / "bundle", path, result


def test_selection_decides_per_target(
    full_plan: Plan, tmp_path: Path, tiny_full_config: Path, hand_tuning: Callable[..., list]
) -> None:
    path = tmp_path / "t.json"
    records = hand_tuning(tiny_full_config, path, tiles=HAND_TILES)
    sel = tuning.select(path, full_plan, resolve_targets(["sm_90a", "sm_80", "sm_120"]))
    assert sel.stale == 1 and "re-run `dualtrack tune`" in (sel.note() or "")
    h200, a100 = sel.targets["sm_90a"], sel.targets["sm_80"]
    assert "sm_120" not in sel.targets
    # The file has a winner for every layer, but the layers with C <= 4 run the small-C entry.
    assert {(n, b) for n, per in h200.calls.items() for b in per} == {
        (x.node, str(x.batch)) for x in conv_layers(full_plan) if not _small_c(x.problem)
    }
    assert h200.tiles == {F16Tile(*t) for t in HAND_TILES}
    assert a100.calls == {} and len(a100.records) == 1  # slower than its baseline: consulted, not used
    assert sel.tiles_for("compute_90a", resolve_targets(["sm_90a", "sm_80"])) == h200.tiles
    assert sel.tiles_for("compute_80", resolve_targets(["sm_90a", "sm_80"])) == frozenset()
    assert len(records) == len({r.key for r in records})


def test_build_compiles_the_tuned_entries_into_the_target_ptx_and_cubin(tuned) -> None:
    bundle, _, result = tuned
    b = Bundle.open(bundle)
    ta = b.track_a
    want = sorted(CONV.tuned_entry(F16Tile(*t)) for t in HAND_TILES)
    meta = ta["ptx"]["compute_90a"]["conv3x3_nhwc"]
    assert meta["tuned_entries"] == want
    ptx = (bundle / meta["path"]).read_text()
    entries = set(re.findall(r"\.entry (\w+)\(", ptx))
    assert set(want) | set(CONV.entries) == entries
    cubin = (bundle / ta["cubin"]["sm_90a"]["conv3x3_nhwc"]["path"]).read_bytes()
    assert all(e.encode() in cubin for e in want)
    resources = assemble_cubin(ptx, "sm_90a").resources
    assert all(not resources[e].spills for e in want)
    # Targets without tuned entries ship the checked-in PTX, byte for byte.
    sm80 = ta["ptx"]["compute_80"]["conv3x3_nhwc"]
    assert "tuned_entries" not in sm80
    checked_in = SOURCE_DIR / "ptx" / "compute_80" / "conv3x3_nhwc.ptx"
    assert (bundle / sm80["path"]).read_bytes() == checked_in.read_bytes()
    assert result.verification is not None and result.verification["passed"]


def test_build_records_the_chosen_entry_per_layer_batch_and_arch(tuned, full_plan: Plan) -> None:
    bundle, path, result = tuned
    b = Bundle.open(bundle)
    calls = b.tuned_calls((9, 0))
    assert set(calls) == {x.node for x in conv_layers(full_plan) if not _small_c(x.problem)}
    assert all(set(per) == {"1", "4"} for per in calls.values())
    assert b.tuned_calls((8, 0)) == {} and b.tuned_calls((12, 0)) == {}
    assert b.track_a["tuned"]["sm_90a"]["tuned_on"] == ["NVIDIA H200 (driver 13.0)"]
    assert b.track_a["tuning"]["path"] == str(path)
    stale = [n for n in result.notes if "tuning file" in n]
    assert len(stale) == 1 and "1 record(s)" in stale[0] and "re-run `dualtrack tune`" in stale[0]


def test_tuning_content_is_in_the_build_key(
    tuned, tiny_full_config: Path, tmp_path: Path, hand_tuning: Callable[..., list]
) -> None:
    bundle, path, _ = tuned
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    assert build(tiny_full_config, copy, tuning=path).up_to_date  # unchanged file: nothing to do
    key = Bundle.open(copy).manifest.build_key
    hand_tuning(tiny_full_config, path, time_ms=0.005, tiles=HAND_TILES)  # same choices, new measurements
    result = build(tiny_full_config, copy, tuning=path)
    assert not result.up_to_date and result.verification is not None
    assert Bundle.open(copy).manifest.build_key != key
    assert build(tiny_full_config, copy, tuning=path).up_to_date


def test_without_a_tuning_file_nothing_is_tuned(tiny_full_bundle: Path) -> None:
    ta = Bundle.open(tiny_full_bundle).track_a
    assert ta["tuned"] == {} and "tuning" not in ta
    for ptx_arch, per in ta["ptx"].items():
        for stem, meta in per.items():
            assert "tuned_entries" not in meta
            checked_in = SOURCE_DIR / "ptx" / ptx_arch / f"{stem}.ptx"
            assert (tiny_full_bundle / meta["path"]).read_bytes() == checked_in.read_bytes()


def test_tuning_key_in_the_config_is_relative_to_it(tiny_full_config: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny_full_config.read_text() + "tuning: t/tuning.json\n")
    assert load_config(cfg).tuning == (tmp_path / "t" / "tuning.json").resolve()
    cfg.write_text(tiny_full_config.read_text() + "tunning: x.json\n")
    with pytest.raises(ConfigError, match=r"unknown key `tunning`; did you mean `tuning`\?"):
        load_config(cfg)
