"""`batch: fixed` on the GPU: a model whose dim 0 holds data (ReduceMean and Softmax over axis 0, a Concat along it)
built for sm_90a and sm_80, its IREE CUDA module run whole (the first load's self-check runs the one reference case
whole too), against onnxruntime at the fp32 default tolerance on fresh random inputs; another shape is refused.

The bundle: DUALTRACK_TEST_FIXED_BUNDLE (built where iree-compile is: `build_fixed_bundle` below, which
bench/prepare_carry.sh runs), else built here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dualtrack.contract.checks import DEFAULT_TOLERANCES, compare
from dualtrack.errors import InputError
from dualtrack.runtime.engine import Engine
from dualtrack.settings import tool_path


def build_fixed_bundle(root: Path, dest: Path) -> Path:
    """The axis-0 model (tests/test_fixed_shape.py) built with `batch: fixed` for sm_90a and sm_80 into ``dest``."""
    from test_fixed_shape import axis0_model

    from dualtrack.compiler.build import build

    root.mkdir(parents=True, exist_ok=True)
    onnx.save(axis0_model(), str(root / "axis0.onnx"))
    (root / "axis0.yaml").write_text("model: axis0.onnx\ntargets: [sm_90a, sm_80]\nbatch: fixed\nverify: {seed: 5}\n")
    return build(root / "axis0.yaml", dest).bundle


@pytest.fixture(scope="module")
def fixed_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    carried = os.environ.get("DUALTRACK_TEST_FIXED_BUNDLE")
    if carried:
        return Path(carried)
    if shutil.which(tool_path("iree-compile")) is None:
        pytest.skip("no iree-compile here to build the fixed-shape bundle: carry one as DUALTRACK_TEST_FIXED_BUNDLE")
    root = tmp_path_factory.mktemp("fixed_gpu")
    return build_fixed_bundle(root, root / "bundle")


@pytest.mark.parametrize("graphs", [False, True])
def test_a_fixed_shape_bundle_runs_whole_on_the_gpu(fixed_bundle: Path, graphs: bool, monkeypatch) -> None:
    from test_fixed_shape import SHAPE, axis0_model

    monkeypatch.setenv("DUALTRACK_CUDA_GRAPHS", "1" if graphs else "0")
    ref = ort.InferenceSession(axis0_model().SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    with Engine.load(fixed_bundle, "cuda") as engine:
        for _ in range(3):
            x = rng.standard_normal(SHAPE).astype(np.float32)
            got = engine.run(x)
            want = dict(zip(["mean", "both"], ref.run(None, {"x": x}), strict=True))
            for name, value in want.items():
                check = compare(name, value, np.asarray(got[name]), DEFAULT_TOLERANCES["fp32"])
                assert check.passed, check
        with pytest.raises(InputError, match="takes exactly"):
            engine.run(np.zeros((1, *SHAPE[1:]), np.float32))
