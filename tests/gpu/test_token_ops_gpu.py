"""Token tensors on Track A, on the GPU (compiler/token_layout.py, issue 39): tests/test_token_ops.py's block (tokens
from a 1x1 Conv's image, a (1, L, C) position embedding, LayerNorm, Linear C->K, Gelu, Linear K->C, the residual Add,
back to an image; L = 37 tokens, C = 48, K = 136; a Sin the block's first tensor enters from and the tokens' mean as
a second output, read as tokens) built for sm_90a and sm_80, run through Engine.run at batches 1 and 3 against
onnxruntime on the export in fp32, at the fp16 default tolerance (rel L2 2e-2), on fresh random inputs. Its Track A
segment holds the LayerNorm (norm, layer kind, over 48 channels of 37 pixels), both Linears as 1x1 convolutions of
an image one pixel high and the Gelu fused or on eltwise: the shapes no zoo model has.

A second bundle, a pre-norm block with attention (SDPA) exported by torch's dynamo exporter, checks the attention
kernel reading Q, K, V from a 1x1 convolution's image through the token exits, end to end.

The bundles: DUALTRACK_TEST_TOKENS_BUNDLE (built where iree-compile and torch are: `build_token_bundle` below),
else built here."""

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


CONFIG = "model: {model}\nprecision: fp16\nbatch_sizes: [1, 3]\ntargets: [sm_90a, sm_80]\nverify: {{seed: 5}}\n"


def build_token_bundle(root: Path, dest: Path) -> Path:
    """Two bundles for sm_90a and sm_80 under ``dest``: ``ops``, the token block (tests/test_token_ops.py, tanh Gelu,
    with its entry and exit), and ``sdpa``, the pre-norm block with attention exported by torch's dynamo exporter at
    batch 1 (test_token_ops.torch_block_export), whose export is kept beside it as ``sdpa.onnx`` (the reference)."""
    from test_token_ops import token_block, torch_block_export

    from dualtrack.compiler.build import build

    root.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    onnx.save(token_block("tanh", exits=True, seed=11), str(root / "tokens.onnx"))
    (root / "tokens.yaml").write_text(CONFIG.format(model="tokens.onnx"))
    build(root / "tokens.yaml", dest / "ops")
    export = torch_block_export(root, dynamo=True)
    onnx.save(onnx.load(str(export)), str(dest / "sdpa.onnx"))  # weights inside: the reference travels alone
    (root / "sdpa.yaml").write_text(CONFIG.format(model=export.name))
    build(root / "sdpa.yaml", dest / "sdpa")
    return dest


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
    plan = json.loads((token_bundle / "ops" / "manifest.json").read_text())["plan"]
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
    with Engine.load(token_bundle / "ops", "cuda") as engine:
        for n in BATCHES:
            x = rng.standard_normal((n, 3, H, W)).astype(np.float32)
            got = engine.run(x)
            for name, value in zip(names, ref.run(None, {"image": x}), strict=True):
                check = compare(f"b{n} {name}", value, np.asarray(got[name]), DEFAULT_TOLERANCES["fp16"])
                assert check.passed, check


@pytest.mark.parametrize("graphs", [False, True])
def test_a_torch_exported_attention_block_matches_onnxruntime_on_the_gpu(
    token_bundle: Path, graphs: bool, monkeypatch
) -> None:
    """The dynamo export's pre-norm block (SDPA in 2 heads of 32 over 35 tokens, tanh-GELU MLP of 136): attention
    reading its Q, K, V from the qkv Linear's image through the pass's exits, its output entering the proj Linear's
    image, all in one Track A segment; against the export run an image at a time."""
    monkeypatch.setenv("DUALTRACK_CUDA_GRAPHS", "1" if graphs else "0")
    plan = json.loads((token_bundle / "sdpa" / "manifest.json").read_text())["plan"]
    ops = [c["op"] for s in plan["segments"] if s["track"] == "A" for c in s["calls"]]
    assert "attention" in ops and "norm" in ops
    ref = ort.InferenceSession(str(token_bundle / "sdpa.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    with Engine.load(token_bundle / "sdpa", "cuda") as engine:
        for n in BATCHES:
            x = rng.standard_normal((n, 3, 5, 7)).astype(np.float32)
            got = np.asarray(next(iter(engine.run(x).values())))
            want = np.concatenate([ref.run(None, {"x": x[i : i + 1]})[0] for i in range(n)])
            check = compare(f"b{n}", want, got, DEFAULT_TOLERANCES["fp16"])
            assert check.passed, check
