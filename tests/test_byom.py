"""Bring your own model: an export as torch writes it builds unedited (CPU only), verifies, and segments.

Through the real pipeline: `dualtrack build --cpu-only` (front end, partition, IREE llvm-cpu,
verification against onnxruntime), then the engine on uint8 images, checked against the export run
by onnxruntime on images normalised by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from exports import reference_logits, torch_style

from dualtrack.cli import main
from dualtrack.compiler.bundle_writer import load_model
from dualtrack.contract.bundle import Bundle
from dualtrack.errors import ToolError
from dualtrack.runtime.engine import Engine

CONFIG = """\
model: export.onnx
batch_sizes: [1, 2]
targets: [sm_90a]
preprocess: {{layout: NCHW, color: RGB, scale: 255, mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}}
postprocess: {{output: logits, activation: softmax, classes: [background, object]}}
verify: {{samples: 1, seed: 11}}
{extra}"""


def _project(root: Path, extra: str = "", **export) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    onnx.save(torch_style(**export), str(root / "export.onnx"))
    cfg = root / "model.yaml"
    cfg.write_text(CONFIG.format(extra=extra))
    return cfg


@pytest.fixture(scope="module")
def byom_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The torch-style export (batch fixed at 1, weights also listed as inputs, opset 11, `onnx::` names)
    built with `--cpu-only` although the config lists a GPU target."""
    root = tmp_path_factory.mktemp("byom")
    cfg = _project(root, weights_as_inputs=True, opset=11)
    result = CliRunner().invoke(main, ["build", str(cfg), "-o", str(root / "bundle"), "--cpu-only"])
    assert result.exit_code == 0, result.output
    assert "verification passed" in result.stdout
    return root / "bundle"


def test_an_unedited_torch_style_export_builds_and_verifies(byom_bundle: Path) -> None:
    b = Bundle.open(byom_bundle)
    m = b.manifest
    assert m.targets == () and "cuda" not in " ".join(b.iree_targets)
    stages = {line.split(":")[0] for line in m.model.frontend}
    assert stages >= {"weights", "opset", "batch", "simplify", "wrap"}
    assert m.model.export_batch == 1 and m.model.classes == ("background", "object")
    assert m.verification is not None and m.verification.passed
    checks = json.loads((byom_bundle / "verify.json").read_text())["checks"]
    names = [c["name"] for c in checks]
    assert "frontend b2 logits" in names and any(n.startswith("plan b2 mask") for n in names)
    # `onnx::` weights reached IREE under the importer's keys: the CPU module ran with the real weights
    assert any(i.name.startswith("onnx::") for i in load_model(b).graph.initializer)


def test_the_bundle_segments_images_as_the_export_does(byom_bundle: Path) -> None:
    root = byom_bundle.parent
    export = onnx.load(str(root / "export.onnx"))
    image = np.random.default_rng(12).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    with Engine.load(byom_bundle, "cpu") as engine:
        assert engine.input_spec.shape == (1, 16, 16, 3) and engine.input_spec.dtype == "uint8"
        out = engine.run(image)  # 3 rows: a batch of 2 and a padded one
    x = (image / 255.0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    logits = reference_logits(export, x.transpose(0, 3, 1, 2).astype(np.float32))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out["probs"], probs, rtol=1e-4, atol=1e-5)
    assert out["mask"].shape == (3, 16, 16)
    sure = np.abs(probs[:, 0] - probs[:, 1]) > 1e-4
    assert np.array_equal(out["mask"][sure], probs.argmax(axis=1)[sure])


def test_info_shows_the_front_end_and_cpu_only(byom_bundle: Path) -> None:
    result = CliRunner().invoke(main, ["info", str(byom_bundle)])
    assert result.exit_code == 0, result.output
    assert "front end  opset: upgraded from opset 11 to 17" in result.stdout
    assert "target     none: CPU only" in result.stdout
    assert "classes    background, object" in result.stdout


def test_targets_empty_in_the_config_is_a_cpu_only_build(tmp_path: Path) -> None:
    cfg = _project(tmp_path)
    cfg.write_text(cfg.read_text().replace("targets: [sm_90a]", "targets: []"))
    from dualtrack.compiler.build import build

    result = build(cfg, tmp_path / "bundle")
    assert result.verification and result.verification["passed"]
    assert Bundle.open(tmp_path / "bundle").iree_targets == ["llvm-cpu"]


def test_a_toolchain_failure_names_segment_batch_target_and_a_repro_that_works(tmp_path: Path) -> None:
    import subprocess

    cfg = _project(tmp_path, extra="track_b: {cpu_flags: [--iree-opt-level=O9]}\n")
    result = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "bundle"), "--cpu-only"])
    assert result.exit_code == ToolError.exit_code, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: iree-compile: failed on segment seg0_B at batch 1 for llvm-cpu")
    assert "--cpu-only" not in line or "drop" in line
    assert "reproduce with: " in line and "O9" in line
    assert not (tmp_path / "bundle").exists()  # nothing half-written
    argv = line.split("reproduce with: ", 1)[1].split()
    assert Path(argv[1]).is_file()  # the kept stage input: the repro runs as printed
    rerun = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert "O9" in rerun.stderr


def test_a_one_channel_model_builds_with_color_gray_and_segments_a_grey_png(tmp_path: Path) -> None:
    """A CT/MRI-style model (one input channel) with `preprocess.color: GRAY`: the bundle takes RGB
    uint8 like every other, `dualtrack run` reads a grey PNG as R = G = B, and the model sees the
    grey values themselves, normalised by the config's one mean and std."""
    from PIL import Image

    root = tmp_path / "gray"
    root.mkdir()
    onnx.save(torch_style(in_channels=1, seed=3), str(root / "export.onnx"))
    cfg = root / "model.yaml"
    cfg.write_text(CONFIG.replace("color: RGB", "color: GRAY").replace("[0.485, 0.456, 0.406]", "[0.3]")
                   .replace("[0.229, 0.224, 0.225]", "[0.2]").format(extra=""))  # fmt: skip
    result = CliRunner().invoke(main, ["build", str(cfg), "-o", str(root / "bundle"), "--cpu-only"])
    assert result.exit_code == 0, result.output
    grey = np.random.default_rng(13).integers(0, 256, (16, 16), dtype=np.uint8)
    Image.fromarray(grey, "L").save(root / "slice.png")
    result = CliRunner().invoke(
        main, ["run", str(root / "bundle"), str(root / "slice.png"), "-o", str(root / "mask.png"), "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    mask = np.asarray(Image.open(root / "mask.png"))
    x = ((grey / 255.0 - 0.3) / 0.2).astype(np.float32)[None, None]
    logits = reference_logits(onnx.load(str(root / "export.onnx")), x)[0]
    decided = np.abs(logits[0] - logits[1]) > 1e-3
    assert decided.mean() > 0.9 and 0 < mask.mean() < 1  # both classes: the check is not vacuous
    assert np.array_equal(mask[decided], logits.argmax(axis=0)[decided])
