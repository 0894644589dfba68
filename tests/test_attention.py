"""Attention on Track A (compiler/attention_patterns.py, kernels/attention.py): which exported graphs
become one attention call, that the call, run by the kernel's numpy reference through its operand
views, computes what onnxruntime computes for the nodes it covers, the graphs that stay on Track B
and why, torch's exports (dynamo=False and True) of spatial-reduction and token attention, and a
tiny `dualtrack build` of a conv + attention block verifying on the CPU. The GPU side:
tests/gpu/test_attention_gpu.py.

Tolerances: the reference in float32 against onnxruntime's fp32 graph on the same values, rel-L2
1e-5 (summation order only); on fp16 inputs, whose output it rounds once to fp16, rel-L2 1e-3
(fp16's half ulp is 2^-11 = 4.9e-4 relative per element: a rel-L2 of ~3e-4)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from attention_cases import (
    Case,
    attention_graph,
    attentions,
    exported_fp16,
    feeds,
    rel_l2,
    torch_modules,
    track_a_array,
)
from onnx import TensorProto, numpy_helper

from dualtrack import kernels
from dualtrack.compiler import attention_patterns, frontend, partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.contract.plan import bits_f32
from dualtrack.kernels.attention import AttentionGeometry

ATTN = kernels.KERNELS["attention"]

CASES = [
    Case(1, 32, 37, 53, flat=True),
    Case(1, 64, 20, 20, "div", "causal"),
    Case(3, 32, 70, 19, "scores", "head"),
    Case(3, 64, 65, 130, "q", "none", kt=True),
    Case(8, 32, 33, 64, "qk", "causal"),
    Case(8, 64, 1, 77, "div", "head"),
    Case(3, 16, 9, 200, "scores", "causal", kt=True),
    Case(2, 128, 17, 31, "q", "head"),
]


def run_ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in inputs.items() if k in names})[0]


def the_one(model: onnx.ModelProto) -> attention_patterns.Attention:
    found = attentions(model)
    matched = {id(a): a for a in found.found.values()}
    assert len(matched) == 1, found.refused
    return next(iter(matched.values()))


def weights_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_the_call_computes_what_onnxruntime_computes(case: Case) -> None:
    model = attention_graph(case)
    att = the_one(model)
    assert set(att.nodes) == {n.name for n in model.graph.node}, "the match covers every node"
    assert att.call.inputs == ("q", "k", "v") and att.call.outputs == ("o",)
    x = feeds(case, n=2)
    want = run_ort(attention_graph(case, TensorProto.FLOAT), x)  # the same (fp16-exact) values in fp32
    weights = weights_of(model)
    got32 = ATTN.run_reference(att.call, [x[t] for t in att.call.inputs], weights)
    assert got32.dtype == np.float32 and rel_l2(got32, want) <= 1e-5
    got16 = ATTN.run_reference(att.call, [x[t].astype(np.float16) for t in att.call.inputs], weights)
    assert got16.dtype == np.float16 and rel_l2(got16, want) <= 1e-3


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_the_views_read_token_tensors_in_place(case: Case) -> None:
    """Q (N, Lq, heads*d) is read at q[b, i, h*d + c]: strides (Lq*C, d, C, 1); Kᵀ handed over as
    (N, C, Lk) is K with a dim stride of Lk."""
    g = AttentionGeometry.from_call(the_one(attention_graph(case)).call)
    q, k, v, o = g.views
    c = case.c
    assert (g.heads, g.d, g.lq, g.lk) == (case.heads, case.d, case.lq, case.lk)
    assert math.isclose(g.scale, case.scale, rel_tol=2e-3)  # the fp16 constants' rounding
    head = case.d
    assert same(q.strides(), (case.lq * c, head, c, 1), case.heads, case.lq)
    assert same(o.strides(), (case.lq * c, head, c, 1), case.heads, case.lq)
    assert same(v.strides(), (case.lk * c, head, c, 1), case.heads, case.lk)
    k_head = case.d * (case.lk if case.kt else 1)
    want = (case.lk * c, k_head, 1, case.lk) if case.kt else (case.lk * c, k_head, c, 1)
    assert same(k.strides(), want, case.heads, case.lk)


def same(got: tuple[int, ...], want: tuple[int, ...], heads: int, rows: int) -> bool:
    """Strides equal but where a dim has one element (any stride reads it: the views give 0)."""
    return all(g == w or n == 1 for g, w, n in zip(got, want, (2, heads, rows, 2), strict=True))


def refusal(model: onnx.ModelProto) -> str:
    found = attentions(model)
    assert not found.found
    return found.refused["softmax"]


def test_a_softmax_over_the_queries_stays_on_track_b() -> None:
    assert "another axis" in refusal(attention_graph(Case(3, 32, 20, 20), softmax_axis=2))


def test_a_scale_read_at_run_time_stays_on_track_b() -> None:
    why = refusal(attention_graph(Case(3, 32, 20, 24, "scores"), runtime_scale=True))
    assert "not a constant scale or bias" in why


def test_a_bias_computed_at_run_time_stays_on_track_b() -> None:
    assert "computed at run time" in refusal(attention_graph(Case(3, 32, 20, 24, bias="head"), runtime_bias=True))


def test_fp32_and_unsupported_head_dims_stay_on_track_b() -> None:
    assert "fp16" in refusal(attention_graph(Case(2, 32, 9, 9), TensorProto.FLOAT))
    assert "head dim 24" in refusal(attention_graph(Case(2, 24, 9, 9)))


def test_the_partition_gives_the_refusal_and_takes_a_match_whole() -> None:
    model = partition.name_nodes(attention_graph(Case(3, 32, 20, 20), softmax_axis=2))
    ctx = partition.SupportContext.of(model, partition.infer_specs(model))
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    assert "another axis" in (partition.track_a_support(softmax, ctx) or "")
    model = partition.name_nodes(attention_graph(Case(3, 32, 20, 24, "div", "head")))
    ctx = partition.SupportContext.of(model, partition.infer_specs(model))
    assert all(partition.track_a_support(n, ctx) is None for n in model.graph.node)
    launches = [partition.track_a_kernel(n, ctx) for n in model.graph.node]
    assert launches.count("attention") == 1 and set(launches) == {"attention", None}


# -- torch's exports ------------------------------------------------------------------------------


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("name", ["sra", "tokens", "einsum", "sdpa", "mha", "mha_seq_first"])
def test_torch_exports_are_one_call_that_matches_onnxruntime(tmp_path: Path, name: str, dynamo: bool) -> None:
    model = exported_fp16(tmp_path, name, dynamo)
    att = the_one(model)
    call = att.call
    ops = {n.op_type for n in model.graph.node if n.name in att.nodes}
    assert {"Softmax", "Transpose"} <= ops and ("Einsum" if name == "einsum" else "MatMul") in ops
    assert (call.weights != ()) == (name == "tokens")  # the relative-position bias
    # onnxruntime on the whole fp16 model, its roots and output kept as outputs.
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    for t in dict.fromkeys([*call.inputs, *call.outputs]):
        probe.graph.output.append(inferred[t])
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    shape = partition.infer_specs(model)[model.graph.input[0].name][0]
    x = np.random.default_rng(3).standard_normal((3, *shape[1:])).astype(np.float32)
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {model.graph.input[0].name: x}), strict=True))
    got = ATTN.run_reference(call, [track_a_array(outs[t]) for t in call.inputs], weights_of(model))
    assert rel_l2(got, track_a_array(outs[call.outputs[0]])) <= 2e-3  # onnxruntime's fp16 products round more


def test_manet_position_attention_is_not_attention(tmp_path: Path) -> None:
    """Its softmax normalises the whole HW x HW map (a Reshape between product and Softmax)."""
    found = attentions(exported_fp16(tmp_path, "pab", dynamo=False))
    assert not found.found and any("between the scores and the Softmax" in why for why in found.refused.values())


# -- the partition and a build on the CPU ------------------------------------------------------------

CONFIG = """\
model: block.onnx
precision: fp16
batch_sizes: [1, 2]
targets: [sm_80]
partition:
  mode: {mode}
  track_a:
    name_prefixes: [/body/]{track_b}
verify:
  samples: 1
"""


def _block_model(tmp_path: Path, body: str = "sra") -> Path:
    """An image net: Sin (no Track A kernel: the body's ends are boundaries), the body, Sin. ``sra``: convs
    and attention on NHWC images; ``tokens``: the image's pixels as (N, L, C) tokens, whose qkv and proj
    Linears (1x1 Convs over the tokens' image, Track B by rule) hand the attention NHWC images."""
    torch, modules = torch_modules()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = modules["sra"][0]() if body == "sra" else modules["tokens"][0](c=64, heads=2, length=64)

        def forward(self, x):
            x = torch.sin(x)
            if body == "sra":
                return torch.sin(self.body(x))
            n, c, h, w = x.shape
            return torch.sin(self.body(x.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(n, c, h, w))

    torch.manual_seed(1)
    path = tmp_path / "block.onnx"
    torch.onnx.export(
        Net().eval(), (torch.randn(1, 64, 8, 8),), str(path), dynamo=False, opset_version=17,
        input_names=["x"], dynamic_axes={"x": {0: "N"}},
    )  # fmt: skip
    return path


def test_auto_partition_charges_an_attention_once(tmp_path: Path) -> None:
    path = _block_model(tmp_path)
    cfg = BuildConfig(model=path, precision="fp16", batch_sizes=(1, 2), targets=["sm_80"])
    cfg = cfg.model_copy(update={"partition": PartitionConfig(mode="auto")})
    model = partition.name_nodes(frontend.prepare(cfg).model)
    p = partition.partition_model(cfg, model)
    by = {d.node: d for d in p.assignment.decisions}
    ctx = partition.SupportContext.of(model, partition.infer_specs(model))
    nodes = sorted({n for a in ctx.attentions.found.values() for n in a.nodes})
    assert nodes and all(by[n].track == "A" for n in nodes)
    assert len([n for n in nodes if (by[n].a_us or 0) > 0]) == 1  # one launch, its other nodes cost nothing


@pytest.mark.parametrize("body", ["sra", "tokens"])
def test_an_attention_block_builds_and_verifies_on_the_cpu(tmp_path: Path, body: str) -> None:
    from dualtrack.compiler.build import build

    _block_model(tmp_path, body)
    linears = "\n  track_b:\n    name_prefixes: [/body/qkv/, /body/proj/]" if body == "tokens" else ""
    (tmp_path / "block.yaml").write_text(CONFIG.format(mode="rules", track_b=linears))
    build(tmp_path / "block.yaml", tmp_path / "out")  # raises when verification fails
    plan = json.loads((tmp_path / "out" / "manifest.json").read_text())["plan"]
    tracks = [s["track"] for s in plan["segments"]]
    a = next(s for s in plan["segments"] if s["track"] == "A")
    ops = [c["op"] for c in a["calls"]]
    assert ops.count("attention") == 1
    if body == "sra":  # convs and attention in one segment, on NHWC images
        assert tracks == ["B", "A", "B"] and len(ops) == 5
    else:  # the Linears, 1x1 Convs over the tokens' image (the front end's `tokens` stage), hand it NHWC images
        assert tracks == ["B", "A", "B"] and ops == ["attention"]
        assert all(len(t["shape"]) == 4 and t["layout"] == "NHWC" for t in (*a["inputs"], *a["outputs"]))
    report = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert report["passed"] is True
    assert any(c["name"].startswith("seg1_A[numpy kernels]") for c in report["checks"])
    call = next(c for c in a["calls"] if c["op"] == "attention")
    want = 0.25 if body == "sra" else 32**-0.5
    assert bits_f32(dict(call["attrs"])["scale"]) == pytest.approx(want, rel=1e-3)
