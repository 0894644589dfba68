"""Squeeze-excitation and channel-attention MLPs written with Linears on flattened (N, C) vectors, written on
(N, C, 1, 1) images by the front end (compiler/pooled_vectors.py): the rewritten graph computes the export's
answer (onnxruntime, fp32, at batches the export did not use), its rank-2 ops are gone, and a region that
is not closed is left as exported. Channel counts, reductions and Gemm attributes no zoo model has."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.onnx_graph import constants
from dualtrack.compiler.pooled_vectors import vectors_as_images
from dualtrack.compiler.verify import ort_session, run_ort

C, H, W = 12, 7, 9
TOL = 1e-5


class Graph:
    def __init__(self, seed: int = 4) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def add(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def model(self, *outputs: str) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, H, W])
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["N", C, H, W]) for o in outputs]
        m = helper.make_model(
            helper.make_graph(self.nodes, "g", [x], outs, self.inits), opset_imports=[helper.make_opsetid("", 17)]
        )
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m

    def mat(self, name: str, *shape: int) -> str:
        return self.const(name, (self.rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))


def se_gemm_matmul() -> onnx.ModelProto:
    """GAP -> Flatten -> Gemm (transB, alpha, beta) -> ReLU -> MatMul + Add(bias) -> HardSigmoid ->
    Reshape to (-1, C, 1, 1) -> Expand to x's shape -> Mul(x, gate)."""
    g = Graph()
    g.add("GlobalAveragePool", "gap", ["x"])
    g.add("Flatten", "flat", ["gap"], axis=1)
    g.add("Gemm", "fc1", ["flat", g.mat("w1", 5, C), g.mat("b1", 5)], transB=1, alpha=0.7, beta=1.3)
    g.add("Relu", "relu", ["fc1"])
    g.add("MatMul", "fc2", ["relu", g.mat("w2", 5, C)])
    g.add("Add", "fc2b", [g.mat("b2", C), "fc2"])
    g.add("HardSigmoid", "gate", ["fc2b"], alpha=0.25, beta=0.5)
    g.add("Reshape", "back", ["gate", g.const("shape", np.array([-1, C, 1, 1], np.int64))])
    g.add("Shape", "xshape", ["x"])
    g.add("Expand", "wide", ["back", "xshape"])
    g.add("Mul", "y", ["x", "wide"])
    return g.model("y")


def cbam_channel_attention() -> onnx.ModelProto:
    """CBAM's channel attention: one MLP (its Gemms sharing weights) on the average- and the max-pooled
    vector (a ReduceMean without keepdims, a GlobalMaxPool squeezed), added, sigmoid, unsqueezed back."""
    g = Graph(7)
    w1, b1, w2 = g.mat("w1", C, 3), g.mat("b1", 3), g.mat("w2", 3, C)
    g.add("ReduceMean", "avg", ["x"], axes=[2, 3], keepdims=0)
    g.add("GlobalMaxPool", "maxp", ["x"])
    g.add("Squeeze", "mx", ["maxp", g.const("hw", np.array([2, 3], np.int64))])
    for p in ("avg", "mx"):
        g.add("Gemm", f"{p}_fc1", [p, w1, b1])
        g.add("Relu", f"{p}_relu", [f"{p}_fc1"])
        g.add("Gemm", f"{p}_fc2", [f"{p}_relu", w2])
    g.add("Add", "sum", ["avg_fc2", "mx_fc2"])
    g.add("Sigmoid", "att", ["sum"])
    g.add("Unsqueeze", "att4", ["att", g.const("axes", np.array([2, 3], np.int64))])
    g.add("Mul", "y", ["att4", "x"])
    return g.model("y")


def _check_same(model: onnx.ModelProto, rewritten: onnx.ModelProto) -> None:
    rng = np.random.default_rng(9)
    for n in (1, 3):
        feeds = {"x": rng.standard_normal((n, C, H, W)).astype(np.float32)}
        want, got = run_ort(ort_session(model), feeds), run_ort(ort_session(rewritten), feeds)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=TOL, atol=TOL, err_msg=k)


@pytest.mark.parametrize("make", [se_gemm_matmul, cbam_channel_attention], ids=["se", "cbam"])
def test_a_linear_mlp_on_pooled_vectors_becomes_1x1_convs_on_images_and_computes_the_same(make) -> None:
    model = make()
    rewritten, note = vectors_as_images(model, constants(model.graph))
    assert note is not None
    ops = [n.op_type for n in rewritten.graph.node]
    assert not {"Gemm", "MatMul", "Flatten", "Squeeze", "Unsqueeze", "Reshape", "Expand"} & set(ops), ops
    linears = sum(n.op_type in ("Gemm", "MatMul") for n in model.graph.node)
    assert ops.count("Conv") == linears
    _check_same(model, rewritten)


def eca(taps: int, dilation: int, pads: tuple[int, int], bias: bool, reduce: bool) -> onnx.ModelProto:
    """ECA-Net's channel attention as exported: the pooled vector (a ReduceMean without keepdims, or a GAP
    flattened) viewed as a row (N, 1, C), a one-channel Conv1d across the channels, a sigmoid, viewed back to
    (N, C, 1, 1) and expanded to scale the image."""
    g = Graph(11)
    if reduce:
        g.add("ReduceMean", "v", ["x"], axes=[2, 3], keepdims=0)
    else:
        g.add("GlobalAveragePool", "gap", ["x"])
        g.add("Flatten", "v", ["gap"], axis=1)
    g.add("Reshape", "row", ["v", g.const("row_shape", np.array([-1, 1, C], np.int64))])
    w = g.const("w", g.rng.standard_normal((1, 1, taps)).astype(np.float32))
    ins = ["row", w, *([g.const("b", np.array([0.3], np.float32))] if bias else [])]
    g.add("Conv", "conv", ins, kernel_shape=[taps], dilations=[dilation], pads=list(pads))
    g.add("Sigmoid", "gate", ["conv"])
    g.add("Reshape", "back", ["gate", g.const("shape", np.array([-1, C, 1, 1], np.int64))])
    g.add("Shape", "xshape", ["x"])
    g.add("Expand", "wide", ["back", "xshape"])
    g.add("Mul", "y", ["x", "wide"])
    return g.model("y")


@pytest.mark.parametrize(
    ("taps", "dilation", "pads", "bias", "reduce"),
    [(3, 1, (1, 1), False, True), (5, 1, (2, 2), True, False), (3, 2, (2, 2), False, True), (4, 1, (1, 2), True, True)],
    ids=["k3", "k5_bias_gap", "k3_dilated", "k4_uneven_pads"],
)
def test_a_conv1d_across_a_pooled_vector_s_channels_becomes_a_banded_1x1_conv_and_computes_the_same(
    taps: int, dilation: int, pads: tuple[int, int], bias: bool, reduce: bool
) -> None:
    """ECA: the Conv1d's taps become a banded (C, C) 1x1 Conv on the (N, C, 1, 1) vector; the rows, views and
    the Expand are gone; onnxruntime gives the export's answer at batches 1 and 3 (fp32, 1e-5)."""
    model = eca(taps, dilation, pads, bias, reduce)
    rewritten, note = vectors_as_images(model, constants(model.graph))
    assert note is not None and "1 Conv1d" in note, note
    ops = [n.op_type for n in rewritten.graph.node]
    assert not {"Flatten", "Squeeze", "Unsqueeze", "Reshape", "Expand"} & set(ops), ops
    (conv,) = [n for n in rewritten.graph.node if n.op_type == "Conv"]
    weight = next(numpy_helper.to_array(i) for i in rewritten.graph.initializer if i.name == conv.input[1])
    assert weight.shape == (C, C, 1, 1)
    assert np.count_nonzero(weight[:, :, 0, 0]) <= C * taps  # a band, not a dense matrix
    _check_same(model, rewritten)


def test_a_conv1d_that_changes_the_row_s_length_stays_as_exported() -> None:
    """A Conv1d whose output is not C long (stride 2 here) is not a map of the channels onto themselves."""
    g = Graph(12)
    g.add("ReduceMean", "v", ["x"], axes=[2, 3], keepdims=0)
    g.add("Reshape", "row", ["v", g.const("row_shape", np.array([-1, 1, C], np.int64))])
    w = g.const("w", g.rng.standard_normal((1, 1, 3)).astype(np.float32))
    g.add("Conv", "conv", ["row", w], kernel_shape=[3], pads=[1, 1], strides=[2])
    g.add("Sigmoid", "gate", ["conv"])
    g.add("Reshape", "back", ["gate", g.const("shape", np.array([-1, C // 2, 1, 1], np.int64))])
    g.add("Tile", "wide", ["back", g.const("reps", np.array([1, 2, H, W], np.int64))])
    g.add("Mul", "y", ["x", "wide"])
    model = g.model("y")
    rewritten, note = vectors_as_images(model, constants(model.graph))
    assert note is None and rewritten is model


def test_a_region_read_outside_stays_as_exported() -> None:
    """The MLP's hidden (N, 5) tensor is a graph output: not every reader is the region's, so no rewrite."""
    model = se_gemm_matmul()
    model.graph.output.append(helper.make_tensor_value_info("relu", TensorProto.FLOAT, ["N", 5]))
    rewritten, note = vectors_as_images(model, constants(model.graph))
    assert note is None and rewritten is model


def test_a_gate_that_is_a_graph_output_stays_as_exported() -> None:
    model = se_gemm_matmul()
    model.graph.output.append(helper.make_tensor_value_info("back", TensorProto.FLOAT, ["N", C, 1, 1]))
    rewritten, note = vectors_as_images(model, constants(model.graph))
    assert note is None and rewritten is model


def test_an_expand_beside_a_smaller_operand_is_kept() -> None:
    """Mul(expanded gate, an (N, C, 1, W) tensor): without the Expand the product would be (N, C, 1, W), so the
    Expand stays (reading the gate's twin) and the answer is the export's."""
    model = se_gemm_matmul()
    g = model.graph
    mul = next(n for n in g.node if n.name == "y")
    g.node.insert(list(g.node).index(mul), helper.make_node("ReduceMean", ["x"], ["xrow"], name="xrow", axes=[2]))
    mul.input[0] = "xrow"
    onnx.checker.check_model(model)
    rewritten, note = vectors_as_images(model, constants(model.graph))
    assert note is not None and "Expand" in [n.op_type for n in rewritten.graph.node]
    _check_same(model, rewritten)


def test_a_flatten_without_a_linear_is_left_alone() -> None:
    """A pooled vector flattened for something else (an Identity-like ReLU and a view back): nothing gained."""
    g = Graph()
    g.add("GlobalAveragePool", "gap", ["x"])
    g.add("Flatten", "flat", ["gap"], axis=1)
    g.add("Relu", "relu", ["flat"])
    g.add("Unsqueeze", "back", ["relu", g.const("axes", np.array([2, 3], np.int64))])
    g.add("Add", "y", ["x", "back"])
    model = g.model("y")
    assert vectors_as_images(model, constants(model.graph))[1] is None


def write_se_project(root: Path, exporter: str) -> Path:
    """A net with squeeze-excitation written with nn.Linear (view(b, c), Linear, ReLU, Linear, Sigmoid,
    view(b, c, 1, 1), expand_as), exported by either torch exporter at opset 17."""
    torch = pytest.importorskip("torch")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    nn = torch.nn

    class SE(nn.Module):
        def __init__(self, c: int, r: int = 4) -> None:
            super().__init__()
            self.fc = nn.Sequential(nn.Linear(c, c // r), nn.ReLU(), nn.Linear(c // r, c), nn.Sigmoid())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, c = x.shape[:2]
            y = self.fc(nn.functional.adaptive_avg_pool2d(x, 1).view(b, c)).view(b, c, 1, 1)
            return x * y.expand_as(x)

    class Net(nn.Module):
        def __init__(self, c: int = 20) -> None:
            super().__init__()
            self.stem, self.se, self.conv = nn.Conv2d(3, c, 3, padding=1), SE(c), nn.Conv2d(c, c, 3, padding=1)
            self.se2, self.head = SE(c, 5), nn.Conv2d(c, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.se(torch.relu(self.stem(x)))
            return self.head(self.se2(torch.relu(self.conv(x))) + x)

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, 24, 28)
    torch.onnx.export(Net().eval(), (x,), str(root / "net.onnx"), opset_version=17, dynamo=exporter == "dynamo")
    cfg = root / "net.yaml"
    cfg.write_text("model: net.onnx\nbatch_sizes: [1, 2]\ntargets: [sm_80]\nverify:\n  samples: 1\n")
    return cfg


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_linear_squeeze_excitation_export_runs_on_track_a_and_verifies(exporter: str, tmp_path: Path) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    build(write_se_project(tmp_path, exporter), tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments].count("A") == 1, [(s.name, s.track) for s in plan.segments]
    fcs = [c for s in plan.segments for c in s.calls if c.op == "fc"]
    assert len(fcs) == 4


def test_an_eca_export_runs_on_track_a_in_one_segment_and_verifies(tmp_path: Path) -> None:
    """timm's EcaModule as written (x.mean((2, 3)).view(N, 1, -1), Conv1d(1, 1, k, padding=(k - 1) // 2),
    sigmoid, view(N, -1, 1, 1), expand_as) at two channel counts, exported by torch at batch 1 and built for
    the CPU at batches 1 and 2: the body is one Track A segment and the build's verification passes."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Eca(nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.conv = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x.mean((2, 3)).view(x.shape[0], 1, -1))
            return x * torch.sigmoid(y).view(x.shape[0], -1, 1, 1).expand_as(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.conv = nn.Conv2d(3, 18, 3, padding=1), nn.Conv2d(18, 26, 3, stride=2, padding=1)
            self.eca1, self.eca2, self.head = Eca(3), Eca(5), nn.Conv2d(26, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.eca2(torch.relu(self.conv(self.eca1(torch.relu(self.stem(x)))))))

    torch.manual_seed(0)
    x = torch.randn(1, 3, 22, 26)
    torch.onnx.export(Net().eval(), (x,), str(tmp_path / "net.onnx"), opset_version=17, dynamo=False)
    (tmp_path / "net.yaml").write_text("model: net.onnx\nbatch_sizes: [1, 2]\nverify:\n  samples: 1\n")
    from dualtrack.compiler.build import build

    result = build(tmp_path / "net.yaml", tmp_path / "out", cpu_only=True)  # raises when verification fails
    tracks = "".join(s.track for s in result.plan.segments)
    assert tracks == "BAB", tracks
    body = next(s for s in result.plan.segments if s.track == "A")
    assert sum(c.op == "fc" for c in body.calls) == 2, [c.op for c in body.calls]  # each band on the fc kernel
