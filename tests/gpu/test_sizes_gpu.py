"""Several input sizes per bundle on the GPU (config `sizes`, issue 40): the small conv net of tests/sized_net.py
built for two non-square sizes (40x56, 64x48) for sm_90a and sm_80, its body on Track A (Conv, Relu, Add) and the
rest on IREE. Engine.run on images of both sizes and of sizes between (padded by the edge, cropped back) against
onnxruntime on the bundle's graph at the chosen size, on the padded input cropped back; a torch CUDA tensor of the
smaller size runs on that size's plan, unpadded. Tolerance: the fp32 default (contract/checks.py
DEFAULT_TOLERANCES) on probs, at most 1e-3 of mask pixels (argmax ties), fresh random images.

The bundle: DUALTRACK_TEST_SIZES_BUNDLE (built where iree-compile is: `build_sized_bundle` below, which
bench/prepare_carry.sh runs), else built here."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from sized_net import SIZES, conv_net, reference, write_config

from dualtrack.contract import sizes
from dualtrack.contract.checks import DEFAULT_TOLERANCES, compare
from dualtrack.runtime.engine import Engine
from dualtrack.settings import tool_path

MASK_MISMATCH = 1e-3


def build_sized_bundle(root: Path, dest: Path) -> Path:
    """The conv net of tests/sized_net.py built for 40x56 and 64x48, sm_90a and sm_80 (and the CPU), into ``dest``."""
    from dualtrack.compiler.build import build

    extra = f"sizes: {json.dumps([list(s) for s in SIZES])}\n"
    cfg = write_config(root, conv_net(), extra).read_text().replace("targets: []", "targets: [sm_90a, sm_80]")
    (root / "net.yaml").write_text(cfg)
    return build(root / "net.yaml", dest).bundle


@pytest.fixture(scope="module")
def sized_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    carried = os.environ.get("DUALTRACK_TEST_SIZES_BUNDLE")
    if carried:
        return Path(carried)
    if shutil.which(tool_path("iree-compile")) is None:
        pytest.skip("no iree-compile here to build the two-size bundle: carry one as DUALTRACK_TEST_SIZES_BUNDLE")
    root = tmp_path_factory.mktemp("sizes_gpu")
    return build_sized_bundle(root, root / "bundle")


@pytest.mark.parametrize("image", [(40, 56), (64, 48), (37, 50), (33, 47), (1, 1)], ids=lambda s: sizes.label(s))
def test_both_sizes_run_on_the_gpu_against_onnxruntime(sized_bundle: Path, image: sizes.Size) -> None:
    rng = np.random.default_rng()
    with Engine.load(sized_bundle, "cuda") as engine:
        for n in (1, 2):
            x = rng.integers(0, 256, (n, *image, 3), dtype=np.uint8)
            got = engine.run(x)
            choice = sizes.choose(image, engine.sizes)
            if image != engine.input_spec.shape[1:3]:  # the largest size's own images take the one-size path
                assert engine.last_size == choice
            padded = sizes.pad_to(x, choice.size)
            want = {
                k: sizes.crop_to(v, choice.size, image)
                for k, v in reference(engine.bundle, choice.size, padded).items()
            }
            assert got["mask"].shape == (n, *image)
            check = compare("probs", want["probs"], np.asarray(got["probs"]), DEFAULT_TOLERANCES["fp32"])
            assert check.passed, check
            assert np.mean(got["mask"] != want["mask"]) <= MASK_MISMATCH


def test_a_gpu_tensor_of_a_compiled_size_runs_on_that_plan(sized_bundle: Path) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    x = rng.integers(0, 256, (1, *SIZES[0], 3), dtype=np.uint8)
    with Engine.load(sized_bundle, "cuda") as engine:
        got = engine.run(torch.from_numpy(x).cuda())
        assert engine.last_size == sizes.Choice("fits", SIZES[0], SIZES[0])
        probs = torch.from_dlpack(got["probs"]).cpu().numpy()
        want = reference(engine.bundle, SIZES[0], x)
        check = compare("probs", want["probs"], probs, DEFAULT_TOLERANCES["fp32"])
        assert check.passed, check
