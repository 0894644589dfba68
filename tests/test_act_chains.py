"""Activations the exporters write as several nodes (erf- and tanh-GELU, SiLU, Mish) where no convolution's
epilogue takes them (after a depthwise conv, a pool, a token view): one eltwise call on Track A
(``lower_mobile.find_act_chains``) or the epilogue of the depthwise conv before it, not a trip to IREE
for the Erf that has no kernel alone. Checked against onnxruntime on shapes no zoo model has (odd
channel counts and sizes, a 5x5 depthwise conv)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.compiler.verify import interpret_track_a, ort_session, run_ort
from dualtrack.contract.activations import Activation

C, H, W = 5, 11, 17
K = 10  # the stem's outputs: the channels the chains run over
TOL = 1e-4  # float32 kernels' references against onnxruntime's float32


class Graph:
    """A float32 NCHW graph from ``x`` (N, C, H, W), node by node; each node names its output."""

    def __init__(self, seed: int = 5) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: float | np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def add(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(self, name: str, x: str, cin: int, cout: int, k: int, group: int = 1, gain: float = 1.0) -> str:
        w = self.rng.standard_normal((cout, cin // group, k, k)) * gain / k
        b = self.rng.standard_normal(cout) * 0.3
        ins = [x, self.const(f"{name}.w", w), self.const(f"{name}.b", b)]
        return self.add("Conv", name, ins, kernel_shape=[k, k], pads=[k // 2] * 4, group=group)

    def model(self, *outputs: str) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, H, W])
        g = helper.make_graph(self.nodes, "g", [x], [], self.inits)
        m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
        m.graph.output.extend(vi for vi in m.graph.value_info if vi.name in outputs)
        del m.graph.value_info[:]
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


# Each chain as an exporter writes it, from tensor t; the names of its nodes, in graph order; its row.
def gelu_div(g: Graph, t: str) -> tuple[str, list[str], str]:
    g.add("Div", "a_div", [t, g.const("sqrt2", math.sqrt(2.0))])
    g.add("Erf", "a_erf", ["a_div"])
    g.add("Add", "a_add", ["a_erf", g.const("one", 1.0)])
    g.add("Mul", "a_mul", [t, "a_add"])
    g.add("Mul", "a_half", ["a_mul", g.const("half", 0.5)])
    return "a_half", ["a_div", "a_erf", "a_add", "a_mul", "a_half"], "gelu"


def gelu_half_first(g: Graph, t: str) -> tuple[str, list[str], str]:
    """(x * 0.5) * (1 + erf(x * (1 / sqrt 2))), the constants on the left where Mul allows it."""
    g.add("Mul", "a_scale", [g.const("rsqrt2", 1.0 / math.sqrt(2.0)), t])
    g.add("Erf", "a_erf", ["a_scale"])
    g.add("Add", "a_add", [g.const("one", 1.0), "a_erf"])
    g.add("Mul", "a_half", [t, g.const("half", 0.5)])
    g.add("Mul", "a_out", ["a_half", "a_add"])
    return "a_out", ["a_scale", "a_erf", "a_add", "a_half", "a_out"], "gelu"


def gelu_tanh(g: Graph, t: str) -> tuple[str, list[str], str]:
    g.add("Mul", "a_sq", [t, t])
    g.add("Mul", "a_cube", [t, "a_sq"])
    g.add("Mul", "a_k", ["a_cube", g.const("kappa", 0.044715)])
    g.add("Add", "a_in", [t, "a_k"])
    g.add("Mul", "a_s", ["a_in", g.const("s2pi", math.sqrt(2.0 / math.pi))])
    g.add("Tanh", "a_tanh", ["a_s"])
    g.add("Add", "a_p1", ["a_tanh", g.const("one", 1.0)])
    g.add("Mul", "a_x", [t, "a_p1"])
    g.add("Mul", "a_out", ["a_x", g.const("half", 0.5)])
    return "a_out", ["a_sq", "a_cube", "a_k", "a_in", "a_s", "a_tanh", "a_p1", "a_x", "a_out"], "gelu_tanh"


def silu(g: Graph, t: str) -> tuple[str, list[str], str]:
    g.add("Sigmoid", "a_sig", [t])
    g.add("Mul", "a_out", ["a_sig", t])
    return "a_out", ["a_sig", "a_out"], "silu"


def mish(g: Graph, t: str) -> tuple[str, list[str], str]:
    g.add("Softplus", "a_sp", [t])
    g.add("Tanh", "a_th", ["a_sp"])
    g.add("Mul", "a_out", [t, "a_th"])
    return "a_out", ["a_sp", "a_th", "a_out"], "mish"


def gelu_dynamo(g: Graph, t: str) -> tuple[str, list[str], str]:
    """x * (0.5 * (1 + erf(x / sqrt 2))), as torch 2.13's dynamo exporter writes nn.GELU at opset 17."""
    g.add("Div", "a_div", [t, g.const("sqrt2", math.sqrt(2.0))])
    g.add("Erf", "a_erf", ["a_div"])
    g.add("Add", "a_add", ["a_erf", g.const("one", 1.0)])
    g.add("Mul", "a_half", [g.const("half", 0.5), "a_add"])
    g.add("Mul", "a_out", [t, "a_half"])
    return "a_out", ["a_div", "a_erf", "a_add", "a_half", "a_out"], "gelu"


def gelu_tanh_dynamo(g: Graph, t: str) -> tuple[str, list[str], str]:
    """The dynamo exporter's tanh-GELU: Pow(x, 3), and x * (0.5 * (1 + tanh(...)))."""
    g.add("Pow", "a_pow", [t, g.const("three", 3.0)])
    g.add("Mul", "a_k", [g.const("kappa", 0.044715), "a_pow"])
    g.add("Add", "a_in", [t, "a_k"])
    g.add("Mul", "a_s", [g.const("s2pi", math.sqrt(2.0 / math.pi)), "a_in"])
    g.add("Tanh", "a_tanh", ["a_s"])
    g.add("Add", "a_p1", ["a_tanh", g.const("one", 1.0)])
    g.add("Mul", "a_half", [g.const("half", 0.5), "a_p1"])
    g.add("Mul", "a_out", [t, "a_half"])
    return "a_out", ["a_pow", "a_k", "a_in", "a_s", "a_tanh", "a_p1", "a_half", "a_out"], "gelu_tanh"


def softplus_dynamo(g: Graph, t: str) -> tuple[str, list[str], str]:
    """torch's softplus threshold as the dynamo exporter writes it: Where(x > 20, x, Softplus(x)). The
    inputs are scaled past the threshold in the test (``net``'s ``gain``), so both branches are taken."""
    g.add("Softplus", "a_sp", [t])
    g.add("Greater", "a_gt", [t, g.const("thr", 20.0)])
    g.add("Where", "a_out", ["a_gt", t, "a_sp"])
    return "a_out", ["a_sp", "a_gt", "a_out"], "softplus"


def _relu6_plus_3(g: Graph, t: str) -> str:
    g.add("Add", "a_add3", [g.const("three", 3.0), t])
    return g.add("Clip", "a_clip", ["a_add3", g.const("lo", 0.0), g.const("hi", 6.0)])


def hardswish_sixth_last(g: Graph, t: str) -> tuple[str, list[str], str]:
    """x * relu6(x + 3) / 6 as TorchScript writes it: (x * clip) / 6."""
    g.add("Mul", "a_mul", [t, _relu6_plus_3(g, t)])
    g.add("Div", "a_out", ["a_mul", g.const("six", 6.0)])
    return "a_out", ["a_add3", "a_clip", "a_mul", "a_out"], "hardswish"


def hardswish_gate(g: Graph, t: str) -> tuple[str, list[str], str]:
    """x * (relu6(x + 3) * (1 / 6))."""
    g.add("Mul", "a_sixth", [_relu6_plus_3(g, t), g.const("inv6", 1.0 / 6.0)])
    g.add("Mul", "a_out", ["a_sixth", t])
    return "a_out", ["a_add3", "a_clip", "a_sixth", "a_out"], "hardswish"


def hardsigmoid_sixth(g: Graph, t: str) -> tuple[str, list[str], str]:
    """relu6(x + 3) / 6, older squeeze-excitation code's gate: HardSigmoid(1/6, 0.5)."""
    g.add("Div", "a_out", [_relu6_plus_3(g, t), g.const("six", 6.0)])
    return "a_out", ["a_add3", "a_clip", "a_out"], "hardsigmoid"


def softsign(g: Graph, t: str) -> tuple[str, list[str], str]:
    """x / (1 + |x|): nn.Softsign as both exporters write it."""
    g.add("Abs", "a_abs", [t])
    g.add("Add", "a_add", ["a_abs", g.const("one", 1.0)])
    g.add("Div", "a_out", [t, "a_add"])
    return "a_out", ["a_abs", "a_add", "a_out"], "softsign"


CHAINS = (
    gelu_div, gelu_half_first, gelu_tanh, silu, mish, gelu_dynamo, gelu_tanh_dynamo, softplus_dynamo,
    hardswish_sixth_last, hardswish_gate, hardsigmoid_sixth, softsign,
)  # fmt: skip


def net(chain, after: str) -> tuple[onnx.ModelProto, list[str], str]:
    """stem conv -> (a 5x5 depthwise conv | a 3x3 max pool) -> the chain -> a 1x1 conv."""
    g = Graph()
    g.conv("stem", "x", C, K, 3, gain=30.0 if chain is softplus_dynamo else 1.0)
    if after == "dwconv":
        t = g.conv("dw", "stem", K, K, 5, group=K)
    else:
        t = g.add("MaxPool", "pool", ["stem"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    out, names, row = chain(g, t)
    g.conv("head", out, K, 3, 1)
    return g.model("head"), names, row


def auto_plan(model: onnx.ModelProto) -> partition.Partitioned:
    cfg = BuildConfig(
        model=Path("g.onnx"), batch_sizes=(1, 2), partition=PartitionConfig(mode="auto", switch_cost_us=0.0)
    )
    return partition.partition_model(cfg, model)


@pytest.mark.parametrize("after", ["dwconv", "maxpool"])
@pytest.mark.parametrize("chain", CHAINS, ids=[c.__name__ for c in CHAINS])
def test_a_stand_alone_activation_chain_is_one_eltwise_call_on_track_a(chain, after: str) -> None:
    model, names, row = net(chain, after)
    p = auto_plan(model)
    tracks = {d.node: d.track for d in p.assignment.decisions}
    assert all(tracks[n] == "A" for n in names), {n: tracks[n] for n in names}
    # The cost model charges the chain's launch to its first node, none in the depthwise conv's epilogue.
    why = {d.node: d.why for d in p.assignment.decisions}
    assert ("no launch of its own" in why[names[0]]) == (after == "dwconv"), why[names[0]]
    seg = next(s for s in p.plan.segments if names[0] in s.nodes)
    calls = [c for c in seg.calls if set(c.nodes) & set(names)]
    # After the depthwise conv the chain is its epilogue (the conv's call writes the chain's output); after
    # the pool, which fuses no activation, it is an eltwise call of its own.
    want = ("dwconv", {"dw", *names}) if after == "dwconv" else ("eltwise", set(names))
    assert len(calls) == 1 and (calls[0].op, set(calls[0].nodes)) == want
    assert Activation.of(calls[0]).kind.name == row
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    feeds = {t.name: np.random.default_rng(11).standard_normal(t.at_batch(2)).astype(t.dtype) for t in seg.inputs}
    want = run_ort(ort_session(p.seg_models[p.plan.segments.index(seg)]), feeds)
    got = interpret_track_a(seg, weights, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize("chain", CHAINS, ids=[c.__name__ for c in CHAINS])
def test_a_decomposed_activation_after_a_norm_is_the_norm_calls(chain) -> None:
    """InstanceNorm + affine, then the chain: one norm call computes both (its apply pass's activation)."""
    g = Graph()
    g.conv("stem", "x", C, K, 3)
    scale, bias = g.const("in.s", g.rng.uniform(0.5, 1.5, K)), g.const("in.b", g.rng.standard_normal(K) * 0.2)
    t = g.add("InstanceNormalization", "inorm", ["stem", scale, bias], epsilon=1e-5)
    out, names, row = chain(g, t)
    g.conv("head", out, K, 3, 1)
    model = g.model("head")
    p = auto_plan(model)
    calls = [c for s in p.plan.segments for c in s.calls if "inorm" in c.nodes]
    assert len(calls) == 1 and calls[0].op == "norm" and set(names) <= set(calls[0].nodes)
    assert Activation.of(calls[0]).kind.name == row
    seg = next(s for s in p.plan.segments if "inorm" in s.nodes)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    feeds = {t.name: np.random.default_rng(12).standard_normal(t.at_batch(2)).astype(t.dtype) for t in seg.inputs}
    want = run_ort(ort_session(p.seg_models[p.plan.segments.index(seg)]), feeds)
    got = interpret_track_a(seg, weights, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=TOL, atol=TOL, err_msg=name)


def test_a_chain_whose_intermediate_another_node_reads_is_not_taken() -> None:
    """GELU's Erf output read beside the chain (here by a graph output): the chain cannot be one call, so
    its nodes are judged one by one (the Erf, which has no kernel alone, goes to IREE)."""
    model, _, _ = net(gelu_div, "dwconv")
    model.graph.output.append(helper.make_tensor_value_info("a_erf", TensorProto.FLOAT, None))
    p = auto_plan(model)
    tracks = {d.node: d.track for d in p.assignment.decisions}
    assert tracks["a_erf"] == "B"
    assert not any(c.op == "eltwise" and "a_erf" in c.nodes for s in p.plan.segments for c in s.calls)


def write_mix_ffn_project(root: Path) -> Path:
    """A SegFormer Mix-FFN block (Linear, depthwise 3x3 between token views, GELU, Linear, residual)
    exported by the TorchScript exporter at opset 17: its GELU is Div, Erf, Add, Mul, Mul after the
    token view, where no convolution's epilogue can take it."""
    torch = pytest.importorskip("torch")

    class MixFFN(torch.nn.Module):
        def __init__(self, c: int = 12, hidden: int = 28) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
            self.fc1, self.fc2 = torch.nn.Linear(c, hidden), torch.nn.Linear(hidden, c)
            self.dw = torch.nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
            self.head = torch.nn.Conv2d(c, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            n, c, h, w = x.shape
            t = x.flatten(2).transpose(1, 2)
            y = self.fc1(t).transpose(1, 2).reshape(n, -1, h, w)
            y = self.dw(y).flatten(2).transpose(1, 2)
            y = self.fc2(torch.nn.functional.gelu(y)) + t
            return self.head(y.transpose(1, 2).reshape(n, c, h, w))

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, 20, 28)
    torch.onnx.export(MixFFN().eval(), (x,), str(root / "net.onnx"), opset_version=17, dynamo=False)
    cfg = root / "net.yaml"
    cfg.write_text("model: net.onnx\nbatch_sizes: [1, 2]\ntargets: [sm_80]\nverify:\n  samples: 1\n")
    return cfg


def test_a_torchscript_mix_ffn_runs_on_track_a_in_one_segment_and_verifies(tmp_path: Path) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    build(write_mix_ffn_project(tmp_path), tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    on_a = [s for s in plan.segments if s.track == "A"]
    assert len(on_a) == 1, [(s.name, s.track) for s in plan.segments]
    gelus = [c for c in on_a[0].calls if Activation.of(c).kind.name == "gelu"]
    assert [c.op for c in gelus] == ["dwconv"] and any("Erf" in n for n in gelus[0].nodes)


def write_dynamo_project(root: Path) -> Path:
    """A MedNeXt-style block net (depthwise 5x5, GroupNorm of one channel a group, 1x1 expand, GELU, 1x1
    back, residual) with a tanh-GELU after a depthwise conv and a softplus, exported by the dynamo exporter
    at opset 17 as the README says to export: its GELUs are x * (0.5 * (1 + erf(x / sqrt 2))), its
    tanh-GELU's cube a Pow, its softplus a Where over a Greater."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")

    class Block(torch.nn.Module):
        def __init__(self, c: int = 12) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
            self.dw = torch.nn.Conv2d(c, c, 5, padding=2, groups=c)
            self.norm = torch.nn.GroupNorm(c, c)
            self.up, self.down = torch.nn.Conv2d(c, 3 * c, 1), torch.nn.Conv2d(3 * c, c, 1)
            self.dw2 = torch.nn.Conv2d(c, c, 3, padding=1, groups=c)
            self.head = torch.nn.Conv2d(c, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(self.dw(x)))))
            y = torch.nn.functional.gelu(self.dw2(x), approximate="tanh")
            return self.head(torch.nn.functional.softplus(torch.nn.functional.gelu(self.norm(y))))

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, 24, 20)
    torch.onnx.export(Block().eval(), (x,), str(root / "net.onnx"), opset_version=17, dynamo=True, verbose=False)
    cfg = root / "net.yaml"
    cfg.write_text("model: net.onnx\nbatch_sizes: [1, 2]\ntargets: [sm_80]\nverify:\n  samples: 1\n")
    return cfg


def test_a_dynamo_export_s_activations_run_on_track_a_in_one_segment_and_verify(tmp_path: Path) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    cfg = write_dynamo_project(tmp_path)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "net.onnx")).graph.node}
    assert {"Erf", "Pow", "Where"} <= ops and "Gelu" not in ops  # the decomposed forms this test is about
    build(cfg, tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments].count("A") == 1, [(s.name, s.track) for s in plan.segments]
    acts = sorted(Activation.of(c).kind.name for s in plan.segments for c in s.calls if Activation.of(c).code)
    assert acts.count("gelu") == 2 and "gelu_tanh" in acts and "softplus" in acts, acts


def write_celu_project(root: Path, precision: str) -> Path:
    """Convolutions with CELU(alpha=1.7) after them (ONNX defines Celu for float32 only), exported by
    the TorchScript exporter, built at ``precision``."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self, c: int = 16) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
            self.dw = torch.nn.Conv2d(c, c, 3, padding=1, groups=c)
            self.head = torch.nn.Conv2d(c, 2, 1)
            self.act = torch.nn.CELU(alpha=1.7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.act(self.dw(self.act(self.stem(x)))))

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, 20, 24)
    torch.onnx.export(Net().eval(), (x,), str(root / "net.onnx"), opset_version=17, dynamo=False)
    cfg = root / "net.yaml"
    cfg.write_text(
        f"model: net.onnx\nprecision: {precision}\nbatch_sizes: [1, 2]\ntargets: [sm_80]\nverify:\n  samples: 1\n"
    )
    return cfg


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_celu_runs_on_track_a_at_either_precision(tmp_path: Path, precision: str) -> None:
    """fp16: the conversion keeps each Celu fp32 (Cast, Celu, Cast: an fp16 Celu is no valid ONNX), and
    the three nodes are one eltwise call; fp32: the depthwise conv's epilogue takes it (the stem's
    kernel fuses ReLU alone: an eltwise call after it). Either verifies."""
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    build(write_celu_project(tmp_path, precision), tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments].count("A") == 1, [(s.name, s.track) for s in plan.segments]
    celu = [c for s in plan.segments for c in s.calls if Activation.of(c).kind.name == "celu"]
    assert len(celu) == 2 and all(Activation.of(c).p0 == pytest.approx(1.7) for c in celu)
    if precision == "fp16":
        assert [c.op for c in celu] == ["eltwise", "eltwise"] and all(len(c.nodes) == 3 for c in celu)
    else:
        assert sorted(c.op for c in celu) == ["dwconv", "eltwise"] and all(len(c.nodes) <= 2 for c in celu)


def test_a_star_relu_network_runs_on_track_a_and_verifies(tmp_path: Path) -> None:
    """PoolFormerV2's StarReLU, ``s * relu(x) ** 2 + b`` with learnt scalars, after convolutions (TorchScript
    export, fp16): its Pow was the one op left on Track B, a track switch each side of every block. The
    rules partition puts the whole body on Track A (on a net this small the auto partition may leave its
    first layers to IREE by cost), so what is checked is the lowering, verified against onnxruntime."""
    torch = pytest.importorskip("torch")
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    class StarReLU(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale, self.bias = torch.nn.Parameter(torch.tensor(0.8)), torch.nn.Parameter(torch.tensor(-0.4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale * torch.relu(x) ** 2 + self.bias

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), StarReLU(), torch.nn.Conv2d(16, 16, 1), StarReLU(),
        torch.nn.Conv2d(16, 2, 1),
    )  # fmt: skip
    torch.manual_seed(0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        net.eval(), (torch.randn(1, 3, 22, 18),), str(tmp_path / "net.onnx"), opset_version=17, dynamo=False
    )
    cfg = tmp_path / "net.yaml"
    cfg.write_text(
        "model: net.onnx\nprecision: fp16\nbatch_sizes: [1, 2]\ntargets: [sm_90a]\nverify:\n  samples: 1\n"
        "preprocess: {layout: NCHW, color: RGB, scale: 255, mean: [0.5], std: [0.25]}\n"
        "postprocess: {activation: softmax}\n"
        "partition: {mode: rules, track_a: {op_types: [Conv, Relu, Pow, Mul, Add]}}\n"
    )
    build(cfg, tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    squares = [
        c for s in plan.segments for c in s.calls if c.op == "eltwise" and len(set(c.inputs)) == 1 < len(c.inputs)
    ]
    assert len(squares) == 2 and all(c.nodes[0].endswith("/Pow") for c in squares), squares
