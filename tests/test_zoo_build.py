"""Each zoo model, exported by the zoo script, builds unedited from its config in configs/zoo/ and
verifies on the CPU, then `dualtrack run` segments an image with it.

CI's size: the exports are 128x128 instead of 512x512 (the same export code, the same config with only
`model:` pointed at the small export) and built `--cpu-only`. Skipped where the zoo extra is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from zoo import CONFIGS, FULL_BUILD, load_export

from dualtrack.cli import main
from dualtrack.compiler.config import load_config

zoo = load_export()
SIZE = (128, 128)  # at 64x64 LR-ASPP's deepest maps are 4x4 and its fp16 error tail reaches the tolerance


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zoo128")
    for name in FULL_BUILD:
        zoo.export_model(name, out, SIZE)
    return out


@pytest.mark.parametrize("name", sorted(FULL_BUILD))
def test_a_zoo_model_builds_unedited_verifies_and_segments(exports: Path, tmp_path: Path, name: str) -> None:
    text = (CONFIGS / f"{name}.yaml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("model:"))
    config = tmp_path / f"{name}.yaml"
    config.write_text(text.replace(line, f"model: {exports / f'{name}.onnx'}"))
    bundle = tmp_path / "bundle"

    built = CliRunner().invoke(main, ["build", str(config), "-o", str(bundle), "--cpu-only", "--json"])
    assert built.exit_code == 0, built.output
    assert json.loads(built.stdout)["verification_passed"] is True
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["plan"]["precision"] == "fp16"
    assert any(r.startswith("precision:") for r in manifest["model"]["frontend"])
    checks = json.loads((bundle / "verify.json").read_text())["checks"]
    assert any(c["name"].startswith("frontend b8 logits") and c["passed"] for c in checks)
    assert all(c["passed"] for c in checks)
    if name == "smp_unet_resnet34":  # the stem's 3x3/2 max-pool and the head on Track A: one Track A segment
        assert [s["track"] for s in manifest["plan"]["segments"]] == ["B", "A"]
        (body,) = [s for s in manifest["plan"]["segments"] if s["track"] == "A"]
        assert {"maxpool", "concat", "seghead"} <= {c["op"] for c in body["calls"]}

    image = tmp_path / "photo.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (96, 80, 3), dtype=np.uint8)).save(image)
    ran = CliRunner().invoke(main, ["run", str(bundle), str(image), "-o", str(tmp_path / "mask.png")])
    assert ran.exit_code == 0, ran.output
    mask = np.asarray(Image.open(tmp_path / "mask.png"))
    assert mask.shape == (96, 80)  # back at the image's size
    assert set(np.unique(mask)) <= {0, 1}


IREE_ONLY = sorted((CONFIGS / "iree_only").glob("*/*.yaml"))


def _at(exports: Path, config: Path, tmp_path: Path) -> Path:
    """``config`` with `model:` pointed at the small export of its zoo model."""
    text = config.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("model:"))
    name = Path(line.split(":", 1)[1].strip()).stem
    out = tmp_path / config.name
    out.write_text(text.replace(line, f"model: {exports / f'{name}.onnx'}"))
    return out


@pytest.mark.parametrize("variant", IREE_ONLY, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_an_iree_only_variant_builds_and_verifies_on_the_cpu(exports: Path, tmp_path: Path, variant: Path) -> None:
    """Each IREE-only flag variant (bench/zoo_bench.py's iree_only rows) is the whole graph on Track B
    and its CPU path verifies: a variant refused on the GPU is the GPU code's fault, not the graph's."""
    bundle = tmp_path / "bundle"
    built = CliRunner().invoke(main, ["build", str(_at(exports, variant, tmp_path)), "-o", str(bundle), "--cpu-only"])
    assert built.exit_code == 0, built.output
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["verification"]["passed"] is True
    assert [s["track"] for s in manifest["plan"]["segments"]] == ["B"]
    assert all(c["passed"] for c in json.loads((bundle / "verify.json").read_text())["checks"])


def test_an_fp16_iree_only_variant_shares_the_zoo_bundles_model(exports: Path, tmp_path: Path) -> None:
    """bench/prepare_carry.sh carries an fp16 variant without model.onnx; the zoo bundle's must be it."""
    variant = next(p for p in IREE_ONLY if load_config(p).precision == "fp16")
    zoo_cfg = CONFIGS / f"{variant.parent.name}.yaml"
    sha = {}
    for cfg, out in ((variant, tmp_path / "v"), (zoo_cfg, tmp_path / "z")):
        built = CliRunner().invoke(main, ["build", str(_at(exports, cfg, tmp_path)), "-o", str(out), "--cpu-only"])
        assert built.exit_code == 0, built.output
        sha[out.name] = json.loads((out / "manifest.json").read_text())["model"]["sha256"]
    assert sha["v"] == sha["z"]
