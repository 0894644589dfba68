"""IREE flag search, the part that needs no GPU: candidates and the kit of compiled modules."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import onnx
import pytest

from dualtrack.compiler import tuned as tuning
from dualtrack.compiler.config import load_config
from dualtrack.errors import BundleError, ConfigError
from dualtrack.tuning import iree_flags as tune_b


def test_candidates_start_with_the_config_and_drop_duplicates(tiny_config: Path) -> None:
    cfg = load_config(tiny_config)
    table = tune_b._candidates(cfg, None)
    assert next(iter(table)) == tune_b.BASELINE
    assert table[tune_b.BASELINE] == (*cfg.track_b.flags, *cfg.track_b.cuda_flags)
    assert len(set(table.values())) == len(table)
    # The tiny config has no IREE flags, so "default" (no flags) is the baseline itself.
    assert "default" not in table


def test_unknown_candidate_names_the_choices(tiny_config: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown IREE flag candidate\(s\) fast; choose from config, "):
        tune_b._candidates(load_config(tiny_config), ["fast"])


def test_kit_holds_every_segment_candidate_and_batch(tiny_config: Path, tmp_path: Path) -> None:
    kit = tune_b.prepare_kit(tiny_config, tmp_path / "kit", only=["O3", "O3-direct-conv"])
    cfg = load_config(tiny_config)
    assert kit.iree_target == "cuda-sm_89"  # sm_90a's IREE target (FACTS 1/4)
    assert kit.batch_sizes == cfg.batch_sizes
    assert list(kit.candidates) == [tune_b.BASELINE, "O3", "O3-direct-conv"]
    assert [s.name for s in kit.segments] == ["seg0_B", "seg2_B"]
    for seg in kit.segments:
        assert (kit.root / seg.onnx).is_file()
        assert len(seg.key) == 64
        for cand in kit.candidates:
            for b in cfg.batch_sizes:
                vmfb = kit.root / seg.modules[cand][b]
                assert zipfile.is_zipfile(vmfb), vmfb  # a .vmfb is a zip around the module flatbuffer
    # The segment key ignores weights and batch: the same graph is the same key.
    again = tune_b.prepare_kit(tiny_config, tmp_path / "kit2", only=["O3"])
    assert [s.key for s in again.segments] == [s.key for s in kit.segments]
    assert not list(tmp_path.glob(".kit*"))  # no temporary folder left behind
    # Segment graphs travel without weights; the kit's model.onnx has them, checked by hash.
    assert all(not onnx.load(str(kit.root / s.onnx)).graph.initializer for s in kit.segments)
    assert kit.weights()
    model = kit.root / tune_b.MODEL_FILE
    model.write_bytes(model.read_bytes() + b"\0")
    with pytest.raises(BundleError, match="is not the model this kit was prepared from"):
        kit.weights()
    model.unlink()
    with pytest.raises(BundleError, match=r"has no model.onnx; copy in the model it was prepared from"):
        kit.weights()


def test_kit_open_errors(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"is not a tuning kit .* --prepare-kit DIR"):
        tune_b.Kit.open(tmp_path)
    (tmp_path / tune_b.KIT_FILE).write_text("{")
    with pytest.raises(BundleError, match="is not valid JSON"):
        tune_b.Kit.open(tmp_path)
    (tmp_path / tune_b.KIT_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(BundleError, match="has format 'other'"):
        tune_b.Kit.open(tmp_path)


def test_winner_is_the_fastest_verified_candidate() -> None:
    r = tune_b.CandidateResult
    res = tune_b.SegmentResult(
        "seg0_B",
        "k",
        1,
        (
            r("config", ("--a",), True, 0.30, 1e-4),
            r("O3", ("--b",), True, 0.20, 1e-4),
            r("wrong", ("--c",), False, None, 3.0, "wrong results"),
            r("broken", ("--d",), False, None, None, "did not compile"),
        ),
    )
    assert res.winner is not None and res.winner.name == "O3"
    assert res.baseline is not None and res.baseline.time_ms == 0.30
    none = tune_b.SegmentResult("s", "k", 1, (r("wrong", (), False, None, 3.0, "wrong results"),))
    assert none.winner is None and none.baseline is None


def test_flags_for_picks_the_newest_matching_record() -> None:
    base = {"kind": tuning.RECORD_KIND, "segment_key": "k", "iree_target": "cuda-sm_89", "batch": 1}
    recs = [
        {**base, "flags": ["--old"], "date": "2026-01-01T00:00:00Z"},
        {**base, "flags": ["--new"], "date": "2026-02-01T00:00:00Z"},
        {**base, "batch": 8, "flags": ["--b8"], "date": "2026-03-01T00:00:00Z"},
        {**base, "flags": None, "date": "2026-04-01T00:00:00Z"},  # nothing passed: no winner
        {**base, "kind": "kernel", "flags": ["--x"], "date": "2026-05-01T00:00:00Z"},
    ]
    assert tuning.flags_for(recs, "k", "cuda-sm_89", 1)["flags"] == ["--new"]
    assert tuning.flags_for(recs, "k", "cuda-sm_89", 8)["flags"] == ["--b8"]
    assert tuning.flags_for(recs, "k", "cuda-sm_80", 1) is None
    assert tuning.flags_for(recs, "other", "cuda-sm_89", 1) is None


def test_build_compiles_a_segment_with_its_tuned_flags(tiny_config: Path, tmp_path: Path) -> None:
    from dualtrack.compiler import partition
    from dualtrack.compiler.build import build
    from dualtrack.compiler.tuned import save_records
    from dualtrack.contract.bundle import Bundle

    cfg = load_config(tiny_config)
    plan, seg_models = partition.plan_config(cfg)
    seg = next(s for s in plan.segments if s.track == "B" and s.index > 0)
    key = tuning.segment_key(seg_models[seg.index])
    rec = {
        "kind": tuning.RECORD_KIND,
        "segment": seg.name,
        "segment_key": key,
        "iree_target": "cuda-sm_89",
        "batch": cfg.batch_sizes[-1],
        "gpu": "NVIDIA H200",
        "cc": "9.0",
        "driver": 13000,
        "flags": ["--iree-opt-level=O3"],
        "candidate": "O3",
        "time_ms": 0.1,
        "baseline_ms": 0.2,
        "speedup": 2.0,
        "date": "2026-11-29T00:00:00Z",
    }
    tuning_file = tmp_path / "tuning.json"
    save_records(tuning_file, [rec], tuning.record_key)
    out = build(tiny_config, tmp_path / "b", tuning=tuning_file)
    m = Bundle.open(out.bundle).manifest
    tuned = m.artifacts.iree_tuned_flags
    assert tuned == {seg.name: {"cuda-sm_89": {str(rec["batch"]): {k: rec[k] for k in tuning.TUNED_FIELDS}}}}
    assert any("tuned IREE flags" in n for n in out.notes)
    # The tuned module differs from the one the config's flags give; the other batch is unchanged.
    plain = Bundle.open(build(tiny_config, tmp_path / "plain").bundle)
    tuned_b = Bundle.open(out.bundle)
    big, small = cfg.batch_sizes[-1], cfg.batch_sizes[0]
    assert tuned_b.vmfb(seg, "cuda-sm_89", big).read_bytes() != plain.vmfb(seg, "cuda-sm_89", big).read_bytes()
    assert tuned_b.vmfb(seg, "cuda-sm_89", small).read_bytes() == plain.vmfb(seg, "cuda-sm_89", small).read_bytes()
    assert tuned_b.manifest.build_key != plain.manifest.build_key
    from click.testing import CliRunner

    from dualtrack.cli import main

    info = CliRunner().invoke(main, ["info", str(out.bundle)])
    assert info.exit_code == 0, info.output
    assert (
        f"tuned      {seg.name} cuda-sm_89 N={big}: O3 (--iree-opt-level=O3); tuned on NVIDIA H200, 2.00x"
        in info.output
    )


def test_tune_cli_prepares_a_kit_and_refuses_kit_options_without_track_b(tiny_config: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dualtrack.cli import main

    r = CliRunner().invoke(main, ["tune", str(tiny_config), "--prepare-kit", str(tmp_path / "k")])
    assert r.exit_code == 2 and "go with --track-b" in r.output
    r = CliRunner().invoke(
        main, ["tune", str(tiny_config), "--track-b", "--prepare-kit", str(tmp_path / "k"), "--candidates", "O3"]
    )
    assert r.exit_code == 0, r.output
    assert "time them on the GPU with `dualtrack tune" in r.output
    assert list(tune_b.Kit.open(tmp_path / "k").candidates) == [tune_b.BASELINE, "O3"]


def test_tune_track_b_without_a_gpu_says_how_to_split(tiny_config: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dualtrack.cli import main
    from dualtrack.runtime.driver import load_driver

    try:
        load_driver()
        pytest.skip("this machine has a GPU")
    except Exception:
        pass
    r = CliRunner().invoke(main, ["tune", str(tiny_config), "--track-b", "-o", str(tmp_path / "t.json")])
    assert r.exit_code == 9, r.output
    assert "--prepare-kit DIR`, then run `dualtrack tune DIR --track-b` there" in r.output
    assert not (tmp_path / "t.json").exists()
