"""IREE's fp16 CUDA code for single ops, run through Track B's runtime module on the GPU, against
onnxruntime fp32 on the same fp16-rounded weights and inputs (cases: tests/iree_fp16_ops.py).

The modules come from DUALTRACK_TEST_IREE_FP16_KIT (the GPU machine has no IREE compiler), built here by

    PYTHONPATH=pipeline .venv/bin/python tests/iree_fp16_ops.py .carry/iree_fp16/fixed

and are otherwise compiled on the spot where the IREE compiler is installed. A kit built with ``--old``
(without Track B's fp32 sums) must fail at least the average pools and ReduceMean: IREE's CUDA code for
an fp16 AveragePool is one serial chain of `add.rn.f16` over the window per output (its PTX), the order
that misses by 6.8e-3 (64x64) and 4.0e-3 (33x33) on llvm-cpu, and ReduceMean's sum over 256x256 values
near 1 passes fp16's 65504 in any order. GlobalAveragePool, ReduceSum, ReduceL2 and CumSum miss on
llvm-cpu (2.5e-3 to 3.8e-2) but are a tree over 1024 threads on CUDA and may pass there. The convolution
cases locate any other fp16 error of IREE's GPU code (IREE-alone MONAI UNet, which has no such sum, was
off by 6.7e-2 on the H100).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from iree_fp16_ops import CASES, ENTRY, KIT_ENV, TOLERANCE, build_kit, case_input, reference, rel_l2, weights_of

from dualtrack.errors import DeviceError


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get(KIT_ENV)
    if prebuilt:
        path = Path(prebuilt)
        names = json.loads((path / "kit.json").read_text())["cases"]
        assert names == [c.name for c in CASES], f"{path} is a kit of other cases: rebuild it (tests/iree_fp16_ops.py)"
        return path
    pytest.importorskip("iree.compiler", reason=f"no IREE compiler here: set {KIT_ENV} to a kit built elsewhere")
    return build_kit(tmp_path_factory.mktemp("iree_fp16"))


@pytest.fixture(scope="module")
def device():
    from dualtrack.runtime.iree import IreeDevice

    try:
        return IreeDevice.create("cuda")
    except DeviceError as e:
        pytest.skip(f"needs IREE's CUDA runtime: {e}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_fp16_cuda_module_matches_onnxruntime_fp32(case, kit: Path, device) -> None:
    from dualtrack.runtime.iree import IreeModule, parameter_index

    weights = weights_of(onnx.load(str(kit / f"{case.name}.onnx")))
    index = parameter_index(weights)  # the module reads the arrays through it: both outlive the call
    module = IreeModule(device, kit / f"{case.name}.vmfb", index, ENTRY)
    x = case_input(case, np.random.default_rng())
    got = np.array(module(x)[0].to_host(), copy=True)  # a copy before the module's buffer goes
    del module, index
    err = rel_l2(got, reference(case, x))
    made = json.loads((kit / "kit.json").read_text())
    assert np.isfinite(got).all() and err <= TOLERANCE, (
        f"{case.name}: relative L2 {err:.3g} against onnxruntime fp32 (tolerance {TOLERANCE}; "
        f"kit {kit}, fp32 sums {'on' if made['stage0_fp32_sums'] else 'off'}, flags {made.get('flags', [])})"
    )
