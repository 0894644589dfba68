"""The public corpus (issue 38): every zoo model that tests/test_zoo_build.py does not build is exported at a small
size and built from its config in configs/zoo/ through the Python API, on the CPU: the default partition (auto), the
Track A lowering, IREE llvm-cpu and the build's own verification against onnxruntime. Each test prints the plan it
got (segments, Track A's share of the nodes) so a CI log shows where each architecture runs.

CI's size: each model at the smallest side of at least 64 it takes (models/zoo/export.py's `small_size`: 96 for
PSPNet, 128 for PAN), batch 1 only, CPU modules only; the export, the front end and the partition are the same code
as at 512. Skipped where the zoo extra is missing. Issue 39's transformer entries and UPerNet, and three models the
breadth probe added, are built here only with DUALTRACK_ZOO_ALL=1 (tests/zoo.py says why: CI's 30 minutes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from zoo import BUILD_BEYOND_CI, CONFIGS, FULL_BUILD, in_ci, load_export, shared_export

from dualtrack.compiler.build import build
from dualtrack.compiler.config import load_config
from dualtrack.contract.plan import Plan

zoo = load_export()
CORPUS = sorted(set(zoo.ZOO) - set(FULL_BUILD))


# The verification's inputs fixed, so that CI's outcome is this run's: a build draws them afresh by default, and
# a random-weight network's fp16 error has a long tail over inputs (MAnet at 64x64: rel_l2 0.013 median, 0.28 at
# worst over 12 images, its weights rounded alone), past the fp16 ceiling that a trained network does not reach.
VERIFY_SEED = 5


def small_config(name: str, model: Path, tmp_path: Path) -> Path:
    """configs/zoo/<name>.yaml with `model:` at the small export, batch 1 only, the verification's seed fixed and
    the output left to the caller."""
    lines = (CONFIGS / f"{name}.yaml").read_text().splitlines()
    keep = [ln for ln in lines if not ln.startswith(("model:", "batch_sizes:", "output:"))]
    assert not any(ln.startswith("verify:") for ln in keep), f"{name}.yaml sets verify: merge the seed into it"
    config = tmp_path / f"{name}.yaml"
    extra = [f"model: {model}", "batch_sizes: [1]", "verify:", f"  seed: {VERIFY_SEED}"]
    config.write_text("\n".join([*keep, *extra]) + "\n")
    return config


def track_a_share(plan: Plan) -> float:
    """The fraction of the graph's nodes that run in Track A segments."""
    nodes = {s.track: 0 for s in plan.segments}
    for s in plan.segments:
        nodes[s.track] += len(s.nodes)
    return nodes.get("A", 0) / max(1, sum(nodes.values()))


@pytest.mark.spread  # each model built in its own tmp_path from the run's export: any worker may take each
@pytest.mark.parametrize("name", in_ci(CORPUS, BUILD_BEYOND_CI))
def test_a_corpus_model_builds_from_its_config_and_verifies_on_the_cpu(tmp_path: Path, name: str) -> None:
    size = zoo.small_size(name)
    config = small_config(name, shared_export(name, size), tmp_path)
    assert load_config(config).partition.mode == "auto"  # the default: the configs choose no partition
    result = build(config, tmp_path / "bundle", cpu_only=True)

    assert result.verification is not None and result.verification["passed"] is True
    checks = result.verification["checks"]
    assert checks and all(c["passed"] for c in checks)
    assert any(c["name"].startswith("frontend b1 logits") for c in checks)
    plan = result.plan
    assert plan is not None and plan.precision == "fp16" and plan.batch_sizes == (1,)
    tracks = "".join(s.track for s in plan.segments)
    print(
        f"\n{name} {size[0]}x{size[1]}: {len(plan.segments)} segments ({tracks}),"
        f" Track A {track_a_share(plan):.0%} of the nodes, built in {result.seconds:.0f} s"
    )


def test_every_zoo_model_has_a_config_written_like_the_readme_example() -> None:
    """A config per zoo entry, none choosing its partition: the corpus measures the build's default."""
    for name in zoo.ZOO:
        text = (CONFIGS / f"{name}.yaml").read_text()
        assert f"model: ../../models/zoo/{name}.onnx" in text.splitlines()
        if name not in FULL_BUILD:
            assert "partition:" not in text, f"{name}.yaml chooses its partition"
