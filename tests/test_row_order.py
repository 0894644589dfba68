"""Row-wise ops moved to the batch-major side of the Transposes around them (compiler/row_order.py): the
rewritten graph computes the export's answer (onnxruntime, fp32, at batches other than the export's), every
row-wise op reads and writes batch-major tensors afterwards, ops that mix rows stay where they were, and
torch's `nn.MultiheadAttention` (dynamo export, batch fixed at 1) builds as one Track A segment with its
attention one call. Sizes, permutations and Gemm attributes no zoo model has."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.onnx_graph import constants
from dualtrack.compiler.row_order import batch_major, rows_batch_major
from dualtrack.compiler.verify import ort_session, run_ort

L, E, K = 10, 12, 7
TOL = 1e-5
ROW_OPS = {"Gemm", "MatMul", "Add", "Mul", "Relu", "Gelu", "LayerNormalization", "Softmax", "Sigmoid"}


class Graph:
    def __init__(self, seed: int = 3) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def mat(self, name: str, *shape: int) -> str:
        return self.const(name, (self.rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    def add(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def model(self, x_shape: list, out: str, out_shape: list) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)
        y = helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)
        m = helper.make_model(
            helper.make_graph(self.nodes, "g", [x], [y], self.inits), opset_imports=[helper.make_opsetid("", 17)]
        )
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


def sequence_first_block() -> onnx.ModelProto:
    """(N, L, E) -> Transpose to (L, N, E) -> MatMul, bias Add, ReLU, LayerNormalization (last axis), a scale
    Mul by a (1, 1, K) constant, Softmax (last axis) -> Transpose back to (N, L, K)."""
    g = Graph()
    g.add("Transpose", "seq", ["x"], perm=[1, 0, 2])
    g.add("MatMul", "proj", ["seq", g.mat("w", E, K)])
    g.add("Add", "bias", [g.mat("b", K), "proj"])
    g.add("Relu", "relu", ["bias"])
    g.add("LayerNormalization", "ln", ["relu", g.mat("gamma", K), g.mat("beta", K)], axis=-1, epsilon=1e-5)
    g.add("Mul", "scaled", ["ln", g.mat("s", 1, 1, K)])
    g.add("Softmax", "soft", ["scaled"], axis=2)
    g.add("Transpose", "y", ["soft"], perm=[1, 0, 2])
    return g.model(["N", L, E], "y", ["N", L, K])


def channels_first_tokens() -> onnx.ModelProto:
    """(N, E, L) -> Transpose [2, 0, 1] to (L, N, E) (the last axis moved too) -> MatMul -> Sigmoid ->
    Transpose [1, 2, 0] to (N, K, L): both Transposes split, the ops on (N, L, .) between them."""
    g = Graph(5)
    g.add("Transpose", "seq", ["x"], perm=[2, 0, 1])
    g.add("MatMul", "proj", ["seq", g.mat("w", E, K)])
    g.add("Sigmoid", "gate", ["proj"])
    g.add("Transpose", "y", ["gate"], perm=[1, 2, 0])
    return g.model(["N", E, L], "y", ["N", K, L])


def gemm_on_flat_rows() -> onnx.ModelProto:
    """torch's F.linear of a sequence-first rank-3 tensor: Reshape to (L*N, E) rows, Gemm (transB, alpha,
    beta, a (1, K) bias), Reshape to (L, -1, K), Transpose to (N, L, K)."""
    g = Graph(7)
    g.add("Transpose", "seq", ["x"], perm=[1, 0, 2])
    g.add("Reshape", "flat", ["seq", g.const("rows", np.array([-1, E], np.int64))])
    g.add("Gemm", "fc", ["flat", g.mat("w", K, E), g.mat("b", 1, K)], transB=1, alpha=0.6, beta=1.7)
    g.add("Reshape", "back", ["fc", g.const("unflat", np.array([L, -1, K], np.int64))], allowzero=1)
    g.add("Transpose", "y", ["back"], perm=[1, 0, 2])
    return g.model(["N", L, E], "y", ["N", L, K])


def row_mixing_add() -> onnx.ModelProto:
    """A constant that varies along the rows ((L, 1, E) on (L, N, E)) is no row-wise op: it stays after the
    Transpose; the MatMul after it is still moved."""
    g = Graph(9)
    g.add("Transpose", "seq", ["x"], perm=[1, 0, 2])
    g.add("Add", "pos", ["seq", g.mat("p", L, 1, E)])
    g.add("MatMul", "proj", ["pos", g.mat("w", E, K)])
    g.add("Transpose", "y", ["proj"], perm=[1, 0, 2])
    return g.model(["N", L, E], "y", ["N", L, K])


def _same(model: onnx.ModelProto, rewritten: onnx.ModelProto) -> None:
    rng = np.random.default_rng(11)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]]
    for n in (1, 3):
        feeds = {"x": rng.standard_normal((n, *shape)).astype(np.float32)}
        want, got = run_ort(ort_session(model), feeds), run_ort(ort_session(rewritten), feeds)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=TOL, atol=TOL, err_msg=k)


def _row_ops_read(model: onnx.ModelProto) -> list[tuple[str, bool]]:
    """Each row-wise op and whether its data input and output are batch-major."""
    major = batch_major(model, None)
    assert major is not None
    inits = {i.name for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type in ROW_OPS:
            data = next(x for x in n.input if x not in inits)
            out.append((n.name, data in major and n.output[0] in major))
    return out


@pytest.mark.parametrize("make", [sequence_first_block, channels_first_tokens, gemm_on_flat_rows])
def test_row_wise_ops_move_onto_batch_major_tensors_and_compute_the_same(make) -> None:
    model = make()
    assert not all(ok for _, ok in _row_ops_read(model))
    rewritten, note = rows_batch_major(model, constants(model.graph), None)
    assert note is not None, "nothing moved"
    assert all(ok for _, ok in _row_ops_read(rewritten)), _row_ops_read(rewritten)
    assert "Gemm" not in {n.op_type for n in rewritten.graph.node}
    _same(model, rewritten)


def test_an_add_that_varies_along_the_rows_stays_where_it_was() -> None:
    model = row_mixing_add()
    rewritten, note = rows_batch_major(model, constants(model.graph), None)
    assert note is not None
    pos = next(n for n in rewritten.graph.node if n.name == "pos")
    assert pos.input[0] == "seq"  # still reads the sequence-first tensor
    ops = dict(_row_ops_read(rewritten))
    assert ops["pos"] is False and [ok for name, ok in ops.items() if name != "pos"] == [True]
    _same(model, rewritten)


def test_a_graph_without_sequence_first_rows_is_left_as_it_is() -> None:
    """A Transpose between two batch-major layouts ((N, L, E) -> (N, E, L)) is no row reordering."""
    g = Graph()
    g.add("MatMul", "proj", ["x", g.mat("w", E, K)])
    g.add("Transpose", "y", ["proj"], perm=[0, 2, 1])
    model = g.model(["N", L, E], "y", ["N", K, L])
    rewritten, note = rows_batch_major(model, constants(model.graph), None)
    assert note is None and rewritten is model


def write_mha_project(root: Path) -> Path:
    """A TransUNet-style net: a conv encoder to 1/4, LayerNorm + nn.MultiheadAttention (batch_first, 2
    heads of 32) + LayerNorm + GELU MLP over the map's tokens, a ConvTranspose back up, a skip Concat and
    a head; exported by the dynamo exporter at opset 17 with the batch fixed at 1 (its default); built fp16, as the
    attention kernel is."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self, c: int = 64, heads: int = 2) -> None:
            super().__init__()
            self.e1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
            self.e2 = nn.Sequential(nn.Conv2d(16, c, 3, stride=4, padding=1), nn.ReLU())
            self.ln1, self.attn = nn.LayerNorm(c), nn.MultiheadAttention(c, heads, batch_first=True)
            self.ln2, self.mlp = nn.LayerNorm(c), nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
            self.up, self.head = nn.ConvTranspose2d(c, 16, 4, stride=4), nn.Conv2d(32, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.e1(x)
            y = self.e2(a)
            n, c, h, w = y.shape
            t = y.flatten(2).transpose(1, 2)
            q = self.ln1(t)
            t = t + self.attn(q, q, q, need_weights=False)[0]
            t = t + self.mlp(self.ln2(t))
            return self.head(torch.cat([self.up(t.transpose(1, 2).reshape(n, c, h, w)), a], 1))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():  # a non-zero out-projection bias, which torch initialises to 0
        net.attn.out_proj.bias.normal_(0.0, 0.1)
    root.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, 40, 48)
    torch.onnx.export(net, (x,), str(root / "net.onnx"), opset_version=17, dynamo=True, verbose=False)
    cfg = root / "net.yaml"
    cfg.write_text("model: net.onnx\nprecision: fp16\nbatch_sizes: [1, 2]\ntargets: [sm_80]\nverify:\n  samples: 1\n")
    return cfg


def test_a_multihead_attention_export_runs_on_track_a_in_one_segment_and_verifies(tmp_path: Path) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    build(write_mha_project(tmp_path), tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments].count("A") == 1, [(s.name, s.track) for s in plan.segments]
    ops = [c.op for s in plan.segments for c in s.calls]
    assert ops.count("attention") == 1, ops
