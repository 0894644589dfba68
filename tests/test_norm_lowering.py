"""The normalisation family on Track A (compiler/lower_norm.py, kernels/norm.py): which ONNX chains
become one norm call, and that the call, run by the kernel's numpy float64 reference, computes what
onnxruntime computes for the ONNX nodes it covers (fresh random inputs, odd sizes, C not a multiple
of 8, GroupNorm of 1, 3, 8 and C groups, InstanceNorm, LayerNorm over channels, an unfolded
BatchNormalization, fused activations and residuals); that the partition keeps a norm block in one
Track A segment; that torch's exports of InstanceNorm2d and GroupNorm are taken whole; and a tiny
`dualtrack build` of such a block verifying on the CPU. The GPU side: tests/gpu/test_norm_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from norm_cases import Graph, lowered
from onnx import numpy_helper

from dualtrack import kernels
from dualtrack.compiler import lower_norm, partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig, Rules
from dualtrack.contract.plan import NORM_KINDS, NORM_RES, bits_f32

NORM = kernels.KERNELS["norm"]
# float64 reference vs onnxruntime's float32: only rounding and summation order differ.
RTOL, ATOL = 1e-4, 1e-4


def check_against_ort(model: onnx.ModelProto, n: int = 2, residual: bool = False) -> lower_norm.Norm:
    """The model's one norm chain, its call run by the numpy reference on NHWC inputs, against
    onnxruntime on the same NCHW inputs."""
    norms, facts = lowered(model)
    found = {id(v): v for v in norms.found.values()}
    assert len(found) == 1, norms.refused
    norm = next(iter(found.values()))
    assert set(norm.nodes) == {node.name for node in model.graph.node}, "the chain covers every node"
    rng = np.random.default_rng()
    g = model.graph
    feeds = {i.name: (3 * rng.standard_normal((n, *facts.shape(i.name)[1:])) + 1).astype(np.float32) for i in g.input}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, feeds)
    weights = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    nhwc = [feeds[name].transpose(0, 2, 3, 1) for name in norm.call.inputs]
    got = NORM.run_reference(norm.call, nhwc, weights)
    np.testing.assert_allclose(got.transpose(0, 3, 1, 2), want, rtol=RTOL, atol=ATOL)
    return norm


@pytest.mark.parametrize("groups", [1, 3, 8, 24])
@pytest.mark.parametrize(("h", "w"), [(13, 21), (4, 4)])
def test_torch_group_norm_chain_is_one_call_that_matches_onnxruntime(groups: int, h: int, w: int) -> None:
    gr = Graph(24, h, w)
    norm = check_against_ort(gr.model(gr.silu(gr.group_norm("x", groups))))
    c = norm.call
    assert (c.op, c.attr("kind"), c.attr("groups"), c.attr("res")) == ("norm", NORM_KINDS["group"], groups, 0)
    assert c.weights == ("gn.gamma", "gn.beta") and c.inputs == ("x",)


def test_group_norm_reshaped_back_by_the_shape_of_its_input_is_one_call() -> None:
    """A decoder's GroupNorm with a symbolic batch: Reshape(.., Shape(x)) back. The Shape is the chain's
    (no launch, no tensor leaves it), so a conv + GroupNorm + SiLU block is one Track A segment."""
    gr = Graph(16, 11, 9)
    norm = check_against_ort(gr.model(gr.silu(gr.group_norm("x", 4, shape_of_x=True))))
    assert "gn/shape_of_x" in norm.nodes and norm.call.attr("groups") == 4
    gr = Graph(16, 11, 9)
    x = gr.node("Sin", "pre", ["x"])
    w = gr.vec("conv.w", (16, 16, 3, 3), 0.1)
    t = gr.node("Conv", "conv", [x, w], pads=[1, 1, 1, 1])
    y = gr.node("Sin", "post", [gr.silu(gr.group_norm(t, 4, shape_of_x=True))])
    cfg = BuildConfig(model=Path("m.onnx"), precision="fp32", batch_sizes=(1, 2), targets=["sm_80"])
    p = partition.partition_model(cfg, partition.name_nodes(gr.model(y)))
    assert [s.track for s in p.plan.segments] == ["B", "A", "B"]
    assert "gn/shape_of_x" in p.plan.segments[1].nodes
    assert [c.op for c in p.plan.segments[1].calls] == ["conv", "norm"]


def test_group_norm_without_affine_and_another_epsilon() -> None:
    gr = Graph(6, 9, 7)
    norm = check_against_ort(gr.model(gr.node("LeakyRelu", "act", [gr.group_norm("x", 3, 1e-3, False)], alpha=0.2)))
    assert norm.call.weights == () and bits_f32(norm.call.attr("eps")) == pytest.approx(1e-3)


@pytest.mark.parametrize("c", [5, 32])
def test_instance_norm_with_leaky_relu(c: int) -> None:
    gr = Graph(c, 13, 21)
    check_against_ort(gr.model(gr.node("LeakyRelu", "act", [gr.instance_norm("x", 1e-3)], alpha=0.01)))


@pytest.mark.parametrize("slope_shape", [(1,), (1, 1, 1)])
def test_a_prelu_of_one_slope_is_fused_as_leaky_relu(slope_shape: tuple[int, ...]) -> None:
    """torch's nn.PReLU() (MONAI's PRELU) exports one slope as a (1, 1, 1) constant: the norm takes it as
    LeakyReLU with that slope (a negative slope here, which no zoo model has)."""
    gr = Graph(6, 9, 14)
    slope = gr.const("slope", np.full(slope_shape, -0.37, np.float32))
    norm = check_against_ort(gr.model(gr.node("PRelu", "act", [gr.instance_norm("x", 1e-3), slope])))
    assert norm.call.attr("act") != 0


def test_a_prelu_with_a_slope_per_channel_is_not_taken_as_an_activation() -> None:
    gr = Graph(6, 9, 14)
    slope = gr.const("slope", np.linspace(-0.5, 0.5, 6, dtype=np.float32).reshape(6, 1, 1))
    norms, _ = lowered(gr.model(gr.node("PRelu", "act", [gr.instance_norm("x", 1e-3), slope])))
    (norm,) = {id(v): v for v in norms.found.values()}.values()
    assert "act" not in norm.nodes and norm.call.attr("act") == 0


def test_instance_norm_with_a_residual_before_the_activation() -> None:
    gr = Graph(5, 11, 9)
    t = gr.node("Add", "res", [gr.instance_norm("x"), gr.second_input("skip")])
    norm = check_against_ort(gr.model(gr.node("Relu", "act", [t])))
    assert norm.call.attr("res") == NORM_RES["before_act"] and norm.call.inputs == ("x", "skip")


def test_layer_norm_over_channels_with_a_residual_after_gelu_tanh_free_activation() -> None:
    gr = Graph(40, 7, 9)
    t = gr.node("Elu", "act", [gr.layer_norm("x")], alpha=0.7)
    norm = check_against_ort(gr.model(gr.node("Add", "res", [gr.second_input("skip"), t])))
    assert norm.call.attr("kind") == NORM_KINDS["layer"] and norm.call.attr("res") == NORM_RES["after_act"]


@pytest.mark.parametrize("square", ["Pow", "Mul"])
@pytest.mark.parametrize("fp32_island", [False, True])
def test_a_written_out_layer_norm_over_channels_is_one_layer_norm_call(square: str, fp32_island: bool) -> None:
    """ConvNeXt's channels-first LayerNorm as ReduceMean / Sub / Pow / ReduceMean / Add / Sqrt / Div and the
    affine (the mean's Casts of an fp16 model's fp32 islands too), with a GELU after it."""
    gr = Graph(19, 5, 7)
    t = gr.layer_norm_decomposed("x", eps=1e-5, square=square, fp32_island=fp32_island)
    norm = check_against_ort(gr.model(gr.node("Elu", "act", [t], alpha=0.4)))
    c = norm.call
    assert (c.attr("kind"), c.weights, c.inputs) == (NORM_KINDS["layer"], ("lnd.gamma", "lnd.beta"), ("x",))
    assert bits_f32(c.attr("eps")) == pytest.approx(1e-5)


def test_a_mean_over_channels_that_is_not_a_layer_norm_is_refused() -> None:
    gr = Graph(6, 4, 4)
    u = gr.node("ReduceMean", "mean", ["x"], axes=[1], keepdims=1)
    norms, _ = lowered(gr.model(gr.node("Sub", "sub", ["x", u])))
    assert not norms.found and "decomposed LayerNorm" in norms.refused["mean"]


def test_unfolded_batch_norm_is_a_per_channel_affine_norm() -> None:
    gr = Graph(12, 5, 6)
    norm = check_against_ort(gr.model(gr.silu(gr.batch_norm("x"))))
    assert norm.call.attr("kind") == NORM_KINDS["affine"] and len(norm.call.weights) == 4


def test_layer_norm_not_over_channels_is_refused_with_the_reason() -> None:
    gr = Graph(8, 4, 4)
    scale = gr.vec("s", (4,))
    gr.node("LayerNormalization", "ln", ["x", scale], axis=-1)
    norms, _ = lowered(gr.model("ln"))
    assert not norms.found and "channels" in norms.refused["ln"]


def test_group_norm_with_a_non_trivial_instance_norm_scale_is_refused() -> None:
    gr = Graph(8, 4, 4)
    out = gr.group_norm("x", 2)
    gr.inits[2].CopyFrom(numpy_helper.from_array(np.full(2, 2.0, np.float32), "gn.ones"))
    norms, _ = lowered(gr.model(out))
    assert not norms.found and "ones and zeros" in norms.refused["gn/in"]


def test_reference_rejects_channels_that_are_not_a_multiple_of_the_groups() -> None:
    with pytest.raises(Exception, match="multiple of G"):
        NORM.reference(np.zeros((1, 2, 2, 5), np.float32), kind="group", groups=2)


def test_group_statistics_split_fills_the_gpu_for_one_image_of_few_channels() -> None:
    """Every SM gets a block, while the partials the last block merges stay within merge_items."""
    ch = NORM.chunking(1, 512, 512, 32, 32, sms=132, lanes=8)
    blocks = ch.chunks * ch.tiles
    assert blocks >= 132 and ch.chunk * ch.chunks >= 512 * 512 and (ch.chunks - 1) * ch.chunk < 512 * 512
    assert ch.chunks * 32 <= NORM.merge_items
    small = NORM.chunking(8, 3, 5, 5, 5, sms=132)
    assert small.chunks == 1 and small.chunk == 15


# -- the partition and torch exports ------------------------------------------------------------------


def _block_model(norm: str) -> onnx.ModelProto:
    """Conv -> norm -> activation twice, between a first and last Conv (the model's input and output
    stay on Track B): a U-Net block as torch exports it."""
    import torch
    from torch import nn

    def norm_layer(c: int) -> nn.Module:
        return nn.InstanceNorm2d(c, affine=True) if norm == "instance" else nn.GroupNorm(4, c)

    act = nn.LeakyReLU(0.01) if norm == "instance" else nn.SiLU()
    body = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), norm_layer(16), act, nn.Conv2d(16, 16, 3, padding=1), norm_layer(16), act
    )
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), body, nn.Conv2d(16, 2, 1))
    with torch.no_grad():
        for p in net.parameters():  # random affine parameters: not the ones/zeros onnxslim folds away
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 and p.shape[0] == 16 else 0.0))
    path = Path(__import__("tempfile").mkdtemp()) / f"{norm}.onnx"
    x = torch.randn(1, 3, 16, 20)
    torch.onnx.export(
        net.eval(), x, str(path), dynamo=False, opset_version=17, input_names=["image"], output_names=["logits"],
        dynamic_axes={"image": {0: "N"}, "logits": {0: "N"}},
    )  # fmt: skip
    return onnx.load(str(path))


def _config(path: Path) -> BuildConfig:
    return BuildConfig(
        model=path, precision="fp32", batch_sizes=(1, 2), targets=["sm_80"],
        partition=PartitionConfig(mode="rules", track_a=Rules(name_prefixes=("/1/",))),
    )  # fmt: skip


@pytest.mark.parametrize("norm", ["instance", "group"])
def test_torch_norm_blocks_are_taken_whole_and_stay_in_one_track_a_segment(norm: str, tmp_path: Path) -> None:
    from dualtrack.compiler import frontend

    pytest.importorskip("torch")
    path = tmp_path / "m.onnx"
    onnx.save(_block_model(norm), str(path))
    cfg = _config(path)
    fe = frontend.prepare(cfg)
    model = partition.name_nodes(fe.model)
    ctx = partition.SupportContext.of(model, partition.infer_specs(model))
    body = [n for n in model.graph.node if n.name.startswith("/1/")]
    assert all(partition.track_a_support(n, ctx) is None for n in body), [
        (n.name, partition.track_a_support(n, ctx)) for n in body
    ]
    cores = [n for n in body if n.op_type in lower_norm.CORE]
    assert len(cores) == 2 and all(n.name in ctx.norms.found for n in cores)
    plan, _ = partition.build_plan(cfg, model)
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    ops = [c.op for c in plan.segments[1].calls]
    assert ops.count("norm") == 2 and "eltwise" not in ops  # the activations fused into the norms
    acts = {c.attr("act") for c in plan.segments[1].calls if c.op == "norm"}
    assert acts == {7 if norm == "instance" else 6}  # leakyrelu / silu rows of the activation table


def test_auto_partition_charges_a_norm_once(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = tmp_path / "m.onnx"
    onnx.save(_block_model("group"), str(path))
    cfg = _config(path).model_copy(update={"partition": PartitionConfig(mode="auto")})
    from dualtrack.compiler import frontend

    model = partition.name_nodes(frontend.prepare(cfg).model)
    p = partition.partition_model(cfg, model)
    by = {d.node: d for d in p.assignment.decisions}
    norm_nodes = [n.name for n in model.graph.node if n.name.startswith("/1/") and n.op_type != "Conv"]
    assert all(by[n].track == "A" for n in norm_nodes)
    launching = [n for n in norm_nodes if (by[n].a_us or 0) > 0]
    assert len(launching) == 2  # one launch per norm chain, its other nodes cost nothing


# -- a whole build on the CPU -------------------------------------------------------------------------

CONFIG = """\
model: block.onnx
precision: fp32
batch_sizes: [1, 2]
targets: [sm_80]
partition:
  mode: rules
  track_a:
    name_prefixes: [/1/]
verify:
  samples: 1
"""


def test_a_norm_block_builds_and_verifies_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from dualtrack.compiler.build import build

    onnx.save(_block_model("instance"), str(tmp_path / "block.onnx"))
    (tmp_path / "block.yaml").write_text(CONFIG)
    build(tmp_path / "block.yaml", tmp_path / "out")  # raises when verification fails
    report = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert report["passed"] is True
    assert any(c["name"].startswith("seg1_A[numpy kernels]") for c in report["checks"])


def _write_layer_norm_2d_project(root: Path, exporter: str) -> Path:
    """ConvNeXt's official channels-first LayerNorm (mean and variance over dim 1 written out) in a small
    ConvNeXt-style net, exported at opset 17 by either torch exporter (dynamo keeps opset 18 here: its
    ReduceMeans take their axes as an input)."""
    torch = pytest.importorskip("torch")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    nn, f = torch.nn, torch.nn.functional

    class LayerNorm2d(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.rand(c) + 0.5), nn.Parameter(torch.randn(c) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u = x.mean(1, keepdim=True)
            v = (x - u).pow(2).mean(1, keepdim=True)
            return self.weight[:, None, None] * ((x - u) / torch.sqrt(v + 1e-6)) + self.bias[:, None, None]

    class Net(nn.Module):
        def __init__(self, c: int = 20) -> None:
            super().__init__()
            self.stem, self.n1 = nn.Conv2d(3, c, 2, stride=2), LayerNorm2d(c)
            self.dw, self.n2 = nn.Conv2d(c, c, 7, padding=3, groups=c), LayerNorm2d(c)
            self.pw1, self.pw2, self.head = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(3 * c, c, 1), nn.Conv2d(c, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.n1(self.stem(x))
            return self.head(x + self.pw2(f.gelu(self.pw1(self.n2(self.dw(x))))))

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, 28, 36)
    torch.onnx.export(Net().eval(), (x,), str(root / "net.onnx"), opset_version=17, dynamo=exporter == "dynamo")
    cfg = root / "net.yaml"
    cfg.write_text("model: net.onnx\nbatch_sizes: [1, 2]\ntargets: [sm_80]\nverify:\n  samples: 1\n")
    return cfg


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_written_out_layer_norm_2d_export_runs_on_track_a_and_verifies(exporter: str, tmp_path: Path) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    build(_write_layer_norm_2d_project(tmp_path, exporter), tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments].count("A") == 1, [(s.name, s.track) for s in plan.segments]
    norms = [c for s in plan.segments for c in s.calls if c.op == "norm"]
    assert [c.attr("kind") for c in norms] == [NORM_KINDS["layer"]] * 2


def _write_context_embedding_project(root: Path) -> Path:
    """BiSeNetV2's context embedding (a global average pool, a BatchNorm of the pooled vector, a 1x1
    conv and ReLU, broadcast-added back to the map) between convolutions, exported by the TorchScript
    exporter, built fp16 with an image in and a softmax out. The fp16 conversion keeps the pool fp32
    (Cast, ReduceMean, Cast down), so the BatchNorm's input is the Cast down of the pool's island."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self, c: int = 24) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
            self.bn = nn.BatchNorm2d(c)
            self.gap = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU())
            self.last, self.head = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            e = self.gap(self.bn(torch.mean(x, dim=(2, 3), keepdim=True)))
            return self.head(self.last(x + e))

    torch.manual_seed(1)
    net = Net()
    net.train()
    with torch.no_grad():
        for _ in range(3):  # batch-norm statistics from a few train-mode passes
            net(torch.randn(4, 3, 30, 22))
    root.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(net.eval(), (torch.randn(1, 3, 30, 22),), str(root / "ce.onnx"), opset_version=17, dynamo=False)
    cfg = root / "ce.yaml"
    cfg.write_text(
        "model: ce.onnx\nprecision: fp16\nbatch_sizes: [1, 2]\ntargets: [sm_90a]\nverify:\n  samples: 1\n"
        "preprocess: {layout: NCHW, color: RGB, scale: 255, mean: [0.5], std: [0.25]}\n"
        "postprocess: {activation: softmax}\n"
    )
    return cfg


def test_a_batch_norm_of_an_fp16_model_s_pooled_vector_runs_on_track_a(tmp_path: Path) -> None:
    """Before, the norm chain took the pool island's Cast down as its own and was refused (fp32 in, fp16
    out), so the BatchNorm alone took a Track B segment with a track switch each side."""
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    build(_write_context_embedding_project(tmp_path), tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments] == ["B", "A"], [(s.name, s.track, s.nodes) for s in plan.segments]
    norms = [c for s in plan.segments for c in s.calls if c.op == "norm"]
    assert [c.attr("kind") for c in norms] == [NORM_KINDS["affine"]]
    assert not any(n.endswith("cast0") or "Cast" in n for n in norms[0].nodes), norms[0].nodes
