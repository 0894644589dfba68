"""Token tensors on Track A, on the GPU (compiler/token_layout.py, issue 39): tests/test_token_ops.py's block (tokens
from a 1x1 Conv's image, a (1, L, C) position embedding, LayerNorm, Linear C->K, Gelu, Linear K->C, the residual Add,
back to an image; L = 37 tokens, C = 48, K = 136; a Sin the block's first tensor enters from and the tokens' mean as
a second output, read as tokens) built for sm_90a and sm_80, run through Engine.run at batches 1 and 3 against
onnxruntime on the export in fp32, at the fp16 default tolerance (rel L2 2e-2), on fresh random inputs. Its Track A
segment holds the LayerNorm (norm, layer kind, over 48 channels of 37 pixels), both Linears as 1x1 convolutions of
an image one pixel high and the Gelu fused or on eltwise: the shapes no zoo model has.

The bundle: DUALTRACK_TEST_TOKENS_BUNDLE (built where iree-compile is: `build_token_bundle` below), else built here."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dualtrack.contract.checks import DEFAULT_TOLERANCES, compare
from dualtrack.runtime.engine import Engine
from dualtrack.settings import tool_path

BATCHES = (1, 3)


def build_token_bundle(root: Path, dest: Path) -> Path:
    """The token block (tests/test_token_ops.py, tanh Gelu, with its entry and exit) for sm_90a and sm_80."""
    from test_token_ops import token_block

    from dualtrack.compiler.build import build

    root.mkdir(parents=True, exist_ok=True)
    onnx.save(token_block("tanh", exits=True, seed=11), str(root / "tokens.onnx"))
    config = "model: tokens.onnx\nprecision: fp16\nbatch_sizes: [1, 3]\ntargets: [sm_90a, sm_80]\nverify: {seed: 5}\n"
    (root / "tokens.yaml").write_text(config)
    return build(root / "tokens.yaml", dest).bundle


@pytest.fixture(scope="module")
def token_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    carried = os.environ.get("DUALTRACK_TEST_TOKENS_BUNDLE")
    if carried:
        return Path(carried)
    if shutil.which(tool_path("iree-compile")) is None:
        pytest.skip("no iree-compile here to build the token bundle: carry one as DUALTRACK_TEST_TOKENS_BUNDLE")
    root = tmp_path_factory.mktemp("tokens_gpu")
    return build_token_bundle(root, root / "bundle")


def test_the_token_block_is_on_track_a_in_the_bundle(token_bundle: Path) -> None:
    plan = json.loads((token_bundle / "manifest.json").read_text())["plan"]
    body = [s for s in plan["segments"] if any(n.startswith("/blk/") for n in s["nodes"])]
    assert len(body) == 1 and body[0]["track"] == "A"
    assert "norm" in [c["op"] for c in body[0]["calls"]]


@pytest.mark.parametrize("graphs", [False, True])
def test_the_token_block_matches_onnxruntime_on_the_gpu(token_bundle: Path, graphs: bool, monkeypatch) -> None:
    from test_token_ops import H, W, token_block

    monkeypatch.setenv("DUALTRACK_CUDA_GRAPHS", "1" if graphs else "0")
    model = token_block("tanh", exits=True, seed=11)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    rng = np.random.default_rng()
    with Engine.load(token_bundle, "cuda") as engine:
        for n in BATCHES:
            x = rng.standard_normal((n, 3, H, W)).astype(np.float32)
            got = engine.run(x)
            for name, value in zip(names, ref.run(None, {"image": x}), strict=True):
                check = compare(f"b{n} {name}", value, np.asarray(got[name]), DEFAULT_TOLERANCES["fp16"])
                assert check.passed, check
