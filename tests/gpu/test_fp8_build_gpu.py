"""A `precision: fp8` bundle on an H100/H200 (issue 42): the small conv net of tests/test_fp8_build.py (16 and 32
channels, 16x16 images, batch sizes 1 and 3), calibrated and verified at build time on the CPU, loaded on the GPU
(its first-load self-check holds the fp8 kernels to the tolerance the build measured), then run on fresh random
images: the engine (quantize_fp8 + conv_fp8 kernels) against the same plan through the kernels' numpy references
(rel L2 of the probabilities <= 1e-2: fp32 sums in another order, one fp16 rounding a layer; masks >= 99% the
same) and against fp32 onnxruntime (mask agreement within a point of the references' own on those images).

The bundle: DUALTRACK_TEST_FP8_BUNDLE (built where iree-compile is: `build_fp8_bundle` below), else built here.
Skipped where the GPU is not compute capability 9.0 (the fp8 kernels are sm_90a only)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dualtrack.compiler import fp8, verify
from dualtrack.compiler.bundle_writer import load_model, segment_model
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.checks import DEFAULT_TOLERANCES, compare
from dualtrack.contract.precision import PrecisionRecord
from dualtrack.runtime.driver import Device
from dualtrack.runtime.engine import Engine
from dualtrack.settings import tool_path

PROBS_REL_L2 = 1e-2  # the kernels against their own numpy semantics, through three fp8 layers
SAME_MASK = 99.0  # % of pixels: the kernels and the references see the same quantized values
FP32_SLACK = 1.0  # points: the kernels' masks against fp32 as the references' masks are, on the same images


def build_fp8_bundle(root: Path, dest: Path) -> Path:
    """The conv net of tests/test_fp8_build.py, precision fp8 for sm_90a (batch sizes 1 and 3), into ``dest``."""
    from test_fp8_build import CONFIG, FLOOR, project

    from dualtrack.compiler.build import build

    config = CONFIG.replace("targets: []", "targets: [sm_90a]").replace("batch_sizes: [1]", "batch_sizes: [1, 3]")
    path = project(root, f"calibration: {{agreement_floor: {FLOOR}}}\n", config=config)
    return build(path, dest).bundle


@pytest.fixture(scope="module")
def fp8_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = Device(0).cc
    if cc != (9, 0):
        pytest.skip(f"the fp8 kernels are sm_90a only; this GPU is compute capability {cc[0]}.{cc[1]}")
    carried = os.environ.get("DUALTRACK_TEST_FP8_BUNDLE")
    if carried:
        return Path(carried)
    if shutil.which(tool_path("iree-compile")) is None:
        pytest.skip("no iree-compile here to build the fp8 bundle: carry one as DUALTRACK_TEST_FP8_BUNDLE")
    root = tmp_path_factory.mktemp("fp8_gpu")
    return build_fp8_bundle(root, root / "bundle")


@pytest.fixture(scope="module")
def engine(fp8_bundle: Path) -> Iterator[Engine]:
    with Engine.load(fp8_bundle, "cuda") as e:  # the first load runs the reference cases
        yield e


def test_the_fp8_kernels_compute_the_plans_numpy_semantics_and_keep_the_masks(engine: Engine) -> None:
    bundle: Bundle = engine.bundle
    plan = bundle.plan
    assert sum(c.op == "conv_fp8" for s in plan.segments for c in s.calls) >= 2
    record = PrecisionRecord.read(bundle.root)
    assert record is not None and record.applied
    runner = fp8.PlanRunner(plan, [segment_model(bundle, s) for s in plan.segments], bundle.weights)
    fp32 = verify.ort_session(verify.upcast(load_model(bundle)))
    rng = np.random.default_rng()
    images = verify.random_input(plan.inputs[0], 3, rng)
    got = engine.run(images)  # one batch of 3 on the GPU
    same = agree = agree_ref = pixels = 0
    for i in range(len(images)):
        x = images[i : i + 1]
        want = runner.run(plan, x)
        check = compare("probs", want["probs"], got["probs"][i : i + 1], DEFAULT_TOLERANCES["fp16"])
        assert check.rel_l2 <= PROBS_REL_L2 and check.nonfinite == 0, check
        ref = verify.run_ort(fp32, {plan.inputs[0].name: x})
        same += int(np.sum(got["mask"][i : i + 1] == want["mask"]))
        agree += int(np.sum(got["mask"][i : i + 1] == ref["mask"]))
        agree_ref += int(np.sum(want["mask"] == ref["mask"]))
        pixels += want["mask"].size
    pct, pct_ref = 100.0 * agree / pixels, 100.0 * agree_ref / pixels
    print(
        f"fp8 on the GPU: {pct:.3f}% of mask pixels as fp32 onnxruntime's, the references {pct_ref:.3f}% "
        f"(the build recorded {min(a.vs_fp32 for a in record.agreement):.3f}% on its images)"
    )
    assert 100.0 * same / pixels >= SAME_MASK
    assert pct >= pct_ref - FP32_SLACK
