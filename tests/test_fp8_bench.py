"""bench/fp8_bench.py's CPU side (issue 42's bench rows): which bundle pairs a carry folder holds, the rows'
names, mask agreement, speedups, the table, a pair made whole from what travelled once; the fp8 bench
configs (configs/unet_fp8.yaml, bench/corpus_configs.py --fp8) and bench/fp8_seal.py's refusals. No GPU,
no torch: made-up rows and masks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dualtrack.compiler.config import load_config
from dualtrack.contract.precision import PRECISION_FILE, Agreement, LayerPrecision, PrecisionRecord

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import corpus_configs  # noqa: E402
import fp8_bench  # noqa: E402


def _bundle(path: Path, files: dict[str, bytes] | None = None) -> Path:
    path.mkdir(parents=True)
    for name, data in (files or {"manifest.json": b"{}"}).items():
        (path / name).write_bytes(data)
    return path


def test_pairs_in_finds_reference_and_corpus_pairs(tmp_path: Path) -> None:
    for d in ("unet", "unet_fp8", "zoo/smp_unet_resnet34", "zoo/smp_unet_resnet34.fp8", "zoo/lonely.fp8", "zoo/x"):
        _bundle(tmp_path / d)
    pairs = fp8_bench.pairs_in(tmp_path)
    assert pairs == [
        ("", tmp_path / "unet", tmp_path / "unet_fp8"),
        ("smp_unet_resnet34/", tmp_path / "zoo/smp_unet_resnet34", tmp_path / "zoo/smp_unet_resnet34.fp8"),
    ]
    assert fp8_bench.pairs_in(tmp_path / "nothing") == []


def test_row_names_match_bench_and_zoo_bench() -> None:
    assert fp8_bench.row_name("", False) == "dualtrack_api"
    assert fp8_bench.row_name("", True) == "fp8/dualtrack_api"
    assert fp8_bench.row_name("smp_unet_resnet34/", False) == "smp_unet_resnet34/dualtrack_api"
    assert fp8_bench.row_name("smp_unet_resnet34/", True) == "smp_unet_resnet34/fp8/dualtrack_api"


def test_agree_pct_against_a_float64_count() -> None:
    rng = np.random.default_rng()
    a = [rng.integers(0, 3, (1, 37, 41), dtype=np.uint8) for _ in range(3)]
    b = [np.where(rng.random(x.shape) < 0.07, (x + 1) % 3, x).astype(np.uint8) for x in a]
    want = 100.0 * np.mean(np.concatenate([(x == y).ravel() for x, y in zip(a, b, strict=True)]).astype(np.float64))
    assert fp8_bench.agree_pct(a, b) == pytest.approx(want, abs=1e-4)  # rounded to 4 decimals
    assert fp8_bench.agree_pct(a, a) == 100.0
    with pytest.raises(ValueError, match="3 masks against 2"):
        fp8_bench.agree_pct(a, b[:2])


def test_speedup_is_fp16_over_fp8_at_the_same_batch() -> None:
    fp16 = [{"batch": 1, "median_ms": 3.0}, {"batch": 8, "median_ms": 12.0}]
    fp8 = [{"batch": 1, "median_ms": 2.0}, {"batch": 8, "median_ms": 7.5}, {"batch": 4, "median_ms": 1.0}]
    out = fp8_bench.with_speedup(fp16, fp8)
    assert [r["speedup"] for r in out] == [1.5, 1.6, None]
    skipped = fp8_bench.with_speedup([{"batch": 8, "skipped": "refused"}], [{"batch": 8, "median_ms": 7.5}])
    assert skipped[0]["speedup"] is None


def test_table_lists_timed_and_skipped_rows() -> None:
    rows = [
        {"name": "dualtrack_api", "batch": 8, "median_ms": 12.0, "mask_agree_fp32": 99.99},
        {
            "name": "fp8/dualtrack_api",
            "batch": 8,
            "median_ms": 7.5,
            "speedup": 1.6,
            "mask_agree_fp32": 94.2,
            "mask_agree_fp16": 94.21,
        },
        {"name": "smp_unet_resnet34/fp8/dualtrack_api", "batch": 1, "skipped": "refused at load: checksum"},
    ]
    lines = fp8_bench.table(rows).splitlines()
    assert "speedup" in lines[0] and len(lines) == 5
    assert lines[3].split()[1:] == ["8", "7.500", "1.600", "94.200", "94.210"]
    assert lines[2].split()[-1] == "-"  # the fp16 row has no agreement against itself
    assert "skipped: refused at load" in lines[4]


def test_build_record_reads_precision_json(tmp_path: Path) -> None:
    layers = (
        LayerPrecision("a", "conv3x3", "fp16", "the first convolution"),
        LayerPrecision("b", "conv3x3", "fp8", "fp8 error 0.04", 0.02, 0.04),
        LayerPrecision("c", "conv1x1", "fp8", "fp8 error 0.03", 0.01, 0.03),
    )
    agree = (Agreement("calibration", 6, 95.5, 95.4, 99.99), Agreement("held-out", 2, 95.1, 95.0, 99.98))
    rec = PrecisionRecord("fp8", True, "", {"samples": 8}, layers, agree, 90.0)
    b = _bundle(tmp_path / "b", {PRECISION_FILE: json.dumps(rec.to_json()).encode()})
    got = fp8_bench.build_record(b)
    assert got == {
        "precision": "fp8",
        "fp8_convs": 2,
        "convs": 3,
        "build_agree_fp32": {"calibration": 95.5, "held-out": 95.1},
        "agreement_floor": 90.0,
    }
    assert fp8_bench.build_record(_bundle(tmp_path / "fp16")) == {"precision": "fp16"}
    note = PrecisionRecord("fp8", False, "precision fp8 needs sm_90a", {})
    c = _bundle(tmp_path / "c", {PRECISION_FILE: json.dumps(note.to_json()).encode()})
    assert fp8_bench.build_record(c) == {"precision": "fp16", "fp8_note": "precision fp8 needs sm_90a"}


def test_completed_copies_what_travelled_once(tmp_path: Path) -> None:
    a = _bundle(tmp_path / "unet", {"model.onnx": b"graph", "weights.bin": b"w" * 64})
    b = _bundle(tmp_path / "unet_fp8", {"manifest.json": b"{}"})
    fp8_bench.completed(a, b)
    assert (b / "model.onnx").read_bytes() == b"graph" and (b / "weights.bin").read_bytes() == b"w" * 64
    c = _bundle(tmp_path / "own", {"model.onnx": b"its own"})
    fp8_bench.completed(a, c)
    assert (c / "model.onnx").read_bytes() == b"its own"


def test_unet_fp8_config_is_the_reference_unet_in_fp8() -> None:
    fp8 = load_config(ROOT / "configs" / "unet_fp8.yaml")
    ref = load_config(ROOT / "configs" / "unet.yaml")
    assert fp8.precision == "fp8" and list(fp8.targets) == ["sm_90a"]
    assert fp8.model == ref.model and fp8.input == ref.input and list(fp8.batch_sizes) == list(ref.batch_sizes)
    assert fp8.partition == ref.partition and fp8.track_b.cuda_flags == ref.track_b.cuda_flags
    assert fp8.calibration is not None and fp8.calibration.agreement_floor < 99.5  # said why in the config


def test_corpus_configs_write_an_fp8_config(tmp_path: Path) -> None:
    assert corpus_configs.main([str(tmp_path), "smp_unet_resnet34", str(ROOT / "configs/unet.yaml"), "--fp8"]) == 0
    for name in ("smp_unet_resnet34", "unet"):
        fp16 = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
        fp8 = yaml.safe_load((tmp_path / f"{name}.fp8.yaml").read_text())
        assert fp8 == {**fp16, "precision": "fp8", "calibration": corpus_configs.FP8_CALIBRATION}
        assert fp16["targets"] == ["sm_90a"] and fp16["track_b"]["cpu"] is False
        assert Path(fp16["model"]).is_absolute()
        load_config(tmp_path / f"{name}.fp8.yaml")  # a valid config
    unet = yaml.safe_load((tmp_path / "unet.yaml").read_text())
    assert Path(unet["tuning"]) == ROOT / "configs" / "tuning" / "h200.json"
    assert corpus_configs.main([str(tmp_path / "no_fp8"), "smp_unet_resnet34"]) == 0
    assert not (tmp_path / "no_fp8" / "smp_unet_resnet34.fp8.yaml").exists()
    no_vd = load_config(tmp_path / "smp_unet_resnet34.iree_no_vd.yaml")  # IREE alone with the flags that verify
    assert no_vd.partition.mode == "iree" and set(corpus_configs.NO_VD) <= set(no_vd.track_b.cuda_flags)


def test_fp8_seal_refuses_a_moved_layer() -> None:
    import fp8_seal

    old = PrecisionRecord("fp8", True, "", {}, (LayerPrecision("a", "conv3x3", "fp8", "", 0.1, 0.03),))
    new = PrecisionRecord("fp8", True, "", {}, (LayerPrecision("a", "conv3x3", "fp16", "error 0.2", 0.1, 0.2),))
    fp8_seal.same_choice(old, old)
    with pytest.raises(SystemExit, match="a: fp8 -> fp16; rebuild the fp8 bundle"):
        fp8_seal.same_choice(old, new)
