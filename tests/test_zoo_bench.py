"""bench/zoo_bench.py's pure parts and the IREE-only zoo configs: which bundles are a zoo model's
IREE-only variants, which variant the `iree_only` row reports, and that a variant the GPU got wrong
never gives that row a time (made-up rows, no GPU, no torch)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dualtrack.compiler.config import load_config

ROOT = Path(__file__).resolve().parents[1]
ZOO_BENCH = ROOT / "bench" / "zoo_bench.py"
VARIANTS = sorted((ROOT / "configs" / "zoo" / "iree_only").glob("*/*.yaml"))


@pytest.fixture(scope="module")
def zb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dualtrack_zoo_bench", ZOO_BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _row(variant: str, batch: int, ms: float | None, precision: str = "fp16", err: float = 1e-3) -> dict:
    row = {"name": f"lraspp/iree_only/{variant}", "batch": batch, "variant": variant, "precision": precision}
    if ms is None:
        return {**row, "skipped": f"refused at load: .../{variant} computes wrong results", "verify_worst_rel_l2": err}
    return {**row, "median_ms": ms, "verify_worst_rel_l2": err}


def test_variants_are_the_bundles_in_the_folder_beside_the_zoo_bundle(zb: ModuleType, tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    for d in ("m", "m.iree_only/o2", "m.iree_only/fp32", "m.iree_only/half_written", "other.iree_only/o2"):
        (zoo / d).mkdir(parents=True)
    for d in ("m", "m.iree_only/o2", "m.iree_only/fp32", "other.iree_only/o2"):
        (zoo / d / "manifest.json").write_text("{}")
    assert [p.name for p in zb.iree_only_variants(zoo / "m")] == ["fp32", "o2"]
    assert zb.iree_only_variants(zoo / "other.iree_only") == []


def test_iree_only_is_the_fastest_verified_variant_at_each_batch(zb: ModuleType) -> None:
    rows = [_row("a", 1, 1.2), _row("a", 8, 5.0), _row("b", 1, 1.0), _row("b", 8, 5.5), _row("c", 1, None, err=1.05)]
    rows.append(_row("c", 8, None, err=1.05))
    best = {r["batch"]: r for r in zb.best_iree_only("lraspp", "fp16", rows, [1, 8])}
    assert (best[1]["name"], best[1]["variant"], best[1]["median_ms"]) == ("lraspp/iree_alone", "b", 1.0)
    assert (best[8]["variant"], best[8]["median_ms"], best[8]["of_variants"]) == ("a", 5.0, 3)


def test_no_verified_variant_gives_a_skipped_row_with_each_error_never_a_time(zb: ModuleType) -> None:
    rows = [_row(v, b, None, err=e) for v, e in (("o2", 0.93), ("o3_fusion", 1.05)) for b in (1, 8)]
    rows += [_row("fp32", b, ms, precision="fp32", err=7e-7) for b, ms in ((1, 2.5), (8, 11.0))]
    out = {(r["name"], r["batch"]): r for r in zb.best_iree_only("lraspp", "fp16", rows, [1, 8])}
    for b in (1, 8):
        fp16 = out[("lraspp/iree_alone", b)]
        assert "median_ms" not in fp16
        assert fp16["skipped"].startswith("no variant verified on the GPU (o2 rel L2 0.93, o3_fusion rel L2 1.05;")
        assert out[("lraspp/iree_alone_fp32", b)]["variant"] == "fp32"  # the labelled extra row
    assert out[("lraspp/iree_alone_fp32", 8)]["median_ms"] == 11.0
    assert list(out)[:2] == [("lraspp/iree_alone", 1), ("lraspp/iree_alone", 8)]  # the zoo's precision first


@pytest.mark.parametrize("path", VARIANTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_variant_config_is_its_zoo_config_all_on_track_b(path: Path) -> None:
    """Same model, input, pre- and post-processing and batch sizes as the zoo config (so an fp16
    variant's model.onnx is that bundle's and travels once); no Track A rule; sm_90a only; its
    bundle lands beside the zoo bundle, where zoo_bench.py looks."""
    variant, zoo = load_config(path), load_config(path.parents[2] / f"{path.parent.name}.yaml")
    same = ("model", "input", "preprocess", "postprocess", "batch_sizes", "verify")
    assert {k: getattr(variant, k) for k in same} == {k: getattr(zoo, k) for k in same}
    p = variant.partition
    assert (p.mode, p.track_a.name_prefixes, p.track_a.op_types) == ("iree", (), ())
    assert variant.targets == ("sm_90a",) and variant.track_b.cpu is False
    assert variant.output == zoo.output.parent / f"{zoo.output.name}.iree_only" / path.stem
    assert variant.track_b.cuda_flags  # each variant names its flags (a stated list, not IREE's defaults)


def test_the_variants_differ_in_flags_or_precision() -> None:
    seen = {(load_config(p).precision, load_config(p).track_b.cuda_flags) for p in VARIANTS}
    assert len(VARIANTS) >= 2 and len(seen) == len(VARIANTS)


def test_the_prediction_row_says_whether_the_partitions_estimate_held(zb, tmp_path: Path) -> None:
    bundle = tmp_path / "m"
    bundle.mkdir()
    report = {"estimate_us": 300.0, "iree_alone_us": 900.0, "batch_sizes": [1, 8], "nodes": []}
    (bundle / "partition.json").write_text(json.dumps(report))
    rows = [
        {"name": "m/dualtrack_api", "batch": 1, "median_ms": 0.1},
        {"name": "m/dualtrack_api", "batch": 8, "median_ms": 0.5},
        {"name": "m/iree_alone", "batch": 1, "median_ms": 0.4},
        {"name": "m/iree_alone", "batch": 8, "median_ms": 2.0},
    ]
    row = zb.prediction_row("m", bundle, rows)
    assert row["measured_us"] == pytest.approx(600.0) and row["measured_iree_alone_us"] == pytest.approx(2400.0)
    assert row["held"] is True
    rows[1] = {"name": "m/dualtrack_api", "batch": 8, "median_ms": 5.0}  # measured slower than IREE alone
    assert zb.prediction_row("m", bundle, rows)["held"] is False
    rows[1] = {"name": "m/dualtrack_api", "batch": 8, "skipped": "refused"}  # nothing to compare: no verdict
    assert "held" not in zb.prediction_row("m", bundle, rows)
