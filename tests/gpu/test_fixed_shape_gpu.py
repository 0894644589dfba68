"""`batch: fixed` on the GPU: a model whose dim 0 holds data (ReduceMean and Softmax over axis 0, a Concat along it)
built for sm_90a and sm_80, its IREE CUDA module run whole (the first load's self-check runs the one reference case
whole too), against onnxruntime at the fp32 default tolerance on fresh random inputs; another shape is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dualtrack.contract.checks import DEFAULT_TOLERANCES, compare
from dualtrack.errors import InputError
from dualtrack.runtime.engine import Engine


@pytest.fixture(scope="module")
def fixed_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_fixed_shape import axis0_model

    from dualtrack.compiler.build import build

    root = tmp_path_factory.mktemp("fixed_gpu")
    onnx.save(axis0_model(), str(root / "axis0.onnx"))
    (root / "axis0.yaml").write_text("model: axis0.onnx\ntargets: [sm_90a, sm_80]\nbatch: fixed\nverify: {seed: 5}\n")
    return build(root / "axis0.yaml", root / "bundle").bundle


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
