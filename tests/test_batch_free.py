"""Batch freeing (compiler/batch_free.py): an export whose batch is written into its shape arguments builds for
other batches, and each freed graph gives, in onnxruntime, what the export gives run one image at a time
(verify.check_frontend, fp32 tolerance: rel_l2 1e-4, max_abs 1e-3, on fresh N(0, 1) inputs). A graph whose
batch cannot be freed is refused in one line that names the node and why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import frontend, partition, verify
from dualtrack.compiler.config import DEFAULT_TOLERANCES, BuildConfig
from dualtrack.errors import ModelError

C, H, W = 8, 4, 4  # channels, height, width of every synthetic export
T = H * W  # tokens
HEADS, D = 2, 4  # attention heads and head size (HEADS * D == C)


class Export:
    """A small graph as an exporter writes it at batch ``b``: its input x (b, C, H, W), shape arguments as
    constants with ``b`` in them, random weights."""

    def __init__(self, b: int, seed: int = 0) -> None:
        self.b, self.nodes, self.inits = b, [], []
        self.rng = np.random.default_rng(seed)

    def const(self, value: np.ndarray | list[int]) -> str:
        name = f"c{len(self.inits)}"
        value = np.asarray(value, np.int64) if isinstance(value, list) else value
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def weight(self, *shape: int) -> str:
        return self.const(self.rng.normal(0, 0.5, shape).astype(np.float32))

    def op(self, op: str, *inputs: str, **attrs) -> str:
        out = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"{op.lower()}{len(self.nodes)}", **attrs))
        return out

    def tokens(self, x: str) -> str:
        """(b, C, H, W) -> (b, T, C), as torch's x.flatten(2).transpose(1, 2) is exported at batch b."""
        return self.op("Transpose", self.op("Reshape", x, self.const([self.b, C, -1])), perm=[0, 2, 1])

    def image(self, t: str) -> str:
        """(b, T, C) -> (b, C, H, W)."""
        return self.op("Reshape", self.op("Transpose", t, perm=[0, 2, 1]), self.const([self.b, C, H, W]))

    def model(self, y: str, out_shape: tuple[int, ...] = (C, H, W), opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "export",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [self.b, C, H, W])],
            [helper.make_tensor_value_info(y, TensorProto.FLOAT, [self.b, *out_shape])],
            self.inits,
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def tokens_with_layer_norm(b: int) -> onnx.ModelProto:
    g = Export(b)
    t = g.tokens(g.op("Conv", "x", g.weight(C, C, 1, 1)))
    t = g.op("LayerNormalization", t, g.weight(C), g.weight(C), axis=-1)
    return g.model(g.image(g.op("MatMul", t, g.weight(C, C))))


def attention_heads(b: int) -> onnx.ModelProto:
    """Global attention as the exporters write it: heads split, (b * heads, T, d) for the score MatMuls."""
    g = Export(b)
    t = g.tokens("x")

    def heads(w: str) -> str:
        split = g.op("Reshape", g.op("MatMul", t, w), g.const([b, T, HEADS, D]))
        return g.op("Reshape", g.op("Transpose", split, perm=[0, 2, 1, 3]), g.const([b * HEADS, T, D]))

    q, k, v = (heads(g.weight(C, C)) for _ in range(3))
    scores = g.op("Softmax", g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 2, 1])), g.weight(1)))
    o = g.op("Reshape", g.op("MatMul", scores, v), g.const([b, HEADS, T, D]))
    o = g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([b, T, C]))
    return g.model(g.image(g.op("Add", o, t)))


def seq_first_attention(b: int) -> onnx.ModelProto:
    """torch.nn.MultiheadAttention as both exporters write it: the tokens sequence-first (T, b, C), the heads
    (T, b * heads, d), and the output projection a Gemm over the (T * b, C) rows, where the batch is the middle
    part of dim 0 (at batch 1 the Reshape to (T, C) also reads as the batch outside C)."""
    g = Export(b)
    t = g.op("Transpose", g.op("Reshape", "x", g.const([b, C, -1])), perm=[2, 0, 1])  # (T, b, C)
    q = g.op("Add", g.op("MatMul", t, g.weight(C, C)), g.weight(C))
    heads = g.op("Transpose", g.op("Reshape", q, g.const([T, b * HEADS, D])), perm=[1, 0, 2])  # (b * heads, T, d)
    scores = g.op("Softmax", g.op("MatMul", heads, g.op("Transpose", heads, perm=[0, 2, 1])), axis=-1)
    o = g.op("Reshape", g.op("MatMul", scores, heads), g.const([b, HEADS, T, D]))
    o = g.op("Reshape", g.op("Transpose", o, perm=[2, 0, 1, 3]), g.const([T * b, C]))  # (T * b, C)
    o = g.op("Relu", g.op("Gemm", o, g.weight(C, C), g.weight(C), transB=1))
    o = g.op("Transpose", g.op("Reshape", o, g.const([T, b, C])), perm=[1, 2, 0])  # (b, C, T)
    return g.model(g.op("Add", g.op("Reshape", o, g.const([b, C, H, W])), "x"))


def kv_stacked(b: int) -> onnx.ModelProto:
    """SegFormer's K and V from one Linear: (b, T, 2, heads, d) permuted to (2, b, heads, T, d), then picked."""
    g = Export(b)
    t = g.tokens("x")
    kv = g.op("Reshape", g.op("MatMul", t, g.weight(C, 2 * C)), g.const([b, -1, 2, HEADS, D]))
    kv = g.op("Transpose", kv, perm=[2, 0, 3, 1, 4])
    k, v = (g.op("Gather", kv, g.const(np.array(i, np.int64)), axis=0) for i in (0, 1))
    scores = g.op("Softmax", g.op("MatMul", k, g.op("Transpose", v, perm=[0, 1, 3, 2])))
    o = g.op("Reshape", g.op("Transpose", g.op("MatMul", scores, v), perm=[0, 2, 1, 3]), g.const([b, T, C]))
    return g.model(g.image(o))


def flatten_to_one_hw_c(b: int) -> onnx.ModelProto:
    """(1, HW, C) at batch 1: a channels-last flatten, a Linear, and back."""
    g = Export(b)
    t = g.op("Reshape", g.op("Transpose", "x", perm=[0, 2, 3, 1]), g.const([b, H * W, C]))
    t = g.op("Reshape", g.op("Relu", g.op("MatMul", t, g.weight(C, C))), g.const([b, H, W, C]))
    return g.model(g.op("Transpose", t, perm=[0, 3, 1, 2]))


def pooled_expand_and_tile(b: int) -> onnx.ModelProto:
    """A pooled (b, C, 1, 1) context broadcast back with Expand([b, C, H, W]) and Tile([1, 1, H, W])."""
    g = Export(b)
    pooled = g.op("GlobalAveragePool", "x")
    wide = g.op("Expand", pooled, g.const([b, C, H, W]))
    tiled = g.op("Tile", g.op("Sigmoid", pooled), g.const([1, 1, H, W]))
    return g.model(g.op("Add", g.op("Mul", "x", tiled), wide))


def constant_of_shape_and_slice(b: int) -> onnx.ModelProto:
    """ConstantOfShape([b, C, H, W]) added (a broadcast at batch 1), x[:b, :C // 2] (a Slice ending at the
    export batch), concatenated back to C channels."""
    g = Export(b)
    half = g.op("ConstantOfShape", g.const([b, C, H, W]), value=numpy_helper.from_array(np.array([0.5], np.float32)))
    x = g.op("Add", "x", half)
    first = g.op("Slice", x, g.const([0, 0]), g.const([b, C // 2]), g.const([0, 1]))
    second = g.op("Slice", x, g.const([0, C // 2]), g.const([b, C]), g.const([0, 1]))
    return g.model(g.op("Concat", g.op("Relu", first), g.op("Neg", second), axis=1))


def resize_to_sizes(b: int) -> onnx.ModelProto:
    g = Export(b)
    up = g.op("Resize", "x", "", "", g.const([b, C, 2 * H, 2 * W]), mode="linear")
    return g.model(g.op("Conv", up, g.weight(C, C, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]))


def resize_sizes_of_some_axes(b: int) -> onnx.ModelProto:
    """Opset 18's Resize `axes`: sizes of H and W only (no batch in them), then of the batch and H."""
    g = Export(b)
    up = g.op("Resize", "x", "", "", g.const([2 * H, 2 * W]), mode="nearest", axes=[2, 3])
    down = g.op("Resize", up, "", "", g.const([b, H]), mode="nearest", axes=[0, 2])
    return g.model(down, out_shape=(C, H, 2 * W), opset=18)


def pooled_as_strided(b: int) -> onnx.ModelProto:
    """torch's as_strided of a pooled (b, C, 1, 1) map, as the dynamo exporter writes it (smp UPerNet's pyramid
    pooling): flattened to (b * C,), then a Gather with constant (b, C, 1, 1) indices, image i's shifted by i * C."""
    g = Export(b)
    flat = g.op("Reshape", g.op("ReduceMean", "x", axes=[2, 3], keepdims=1), g.const([-1]))
    offsets = (np.arange(b).reshape(b, 1, 1, 1) * C + np.arange(C).reshape(1, C, 1, 1)).astype(np.int64)
    picked = g.op("Gather", flat, g.const(offsets), axis=0)
    return g.model(g.op("Mul", "x", g.op("Sigmoid", g.op("Conv", picked, g.weight(C, C, 1, 1)))))


def einsum_attention(b: int) -> onnx.ModelProto:
    """MONAI UNETR's attention: q and k picked from a (3, b, heads, T, d) stack, scores by Einsum."""
    g = Export(b)
    qkv = g.op("Reshape", g.op("MatMul", g.tokens("x"), g.weight(C, 3 * C)), g.const([b, T, 3, HEADS, D]))
    qkv = g.op("Transpose", qkv, perm=[2, 0, 3, 1, 4])
    q, k, v = (g.op("Gather", qkv, g.const(np.array(i, np.int64)), axis=0) for i in range(3))
    scores = g.op("Softmax", g.op("Einsum", q, k, equation="blxd,blyd->blxy"))
    o = g.op("Einsum", scores, v, equation="bhxy,bhyd->bhxd")
    return g.model(g.image(g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([b, T, C]))))


def indexed_bins(b: int) -> onnx.ModelProto:
    """Advanced indexing over H and W with the batch behind them (smp UPerNet's adaptive pooling to bins that do
    not divide the map, as the dynamo exporter writes it): (H, W, b, C) indexed by GatherND, then back."""
    g = Export(b)
    bins = np.array([[[0, 0], [0, 3]], [[3, 0], [2, 2]]], np.int64)  # (2, 2) picks of (h, w)
    picked = g.op("GatherND", g.op("Transpose", "x", perm=[2, 3, 0, 1]), g.const(bins))
    return g.model(g.op("Transpose", picked, perm=[2, 3, 0, 1]), out_shape=(C, 2, 2))


FREED: dict[str, Callable[[int], onnx.ModelProto]] = {
    f.__name__: f
    for f in (
        tokens_with_layer_norm,
        attention_heads,
        kv_stacked,
        seq_first_attention,
        flatten_to_one_hw_c,
        pooled_expand_and_tile,
        constant_of_shape_and_slice,
        resize_to_sizes,
        resize_sizes_of_some_axes,
        pooled_as_strided,
        einsum_attention,
        indexed_bins,
    )
}


def _cfg(batch_sizes: tuple[int, ...]) -> BuildConfig:
    return BuildConfig(model=Path("export.onnx"), batch_sizes=batch_sizes)


@pytest.mark.parametrize("export_batch", [1, 2])
@pytest.mark.parametrize("case", sorted(FREED))
def test_a_baked_batch_is_freed_and_each_batch_matches_the_export_run_image_by_image(
    case: str, export_batch: int
) -> None:
    export = FREED[case](export_batch)
    onnx.checker.check_model(export, full_check=True)
    sizes = (1, 3) if export_batch == 1 else (2, 6)
    fe = frontend.prepare(_cfg(sizes), export)
    plan, _ = partition.build_plan(
        _cfg(sizes).model_copy(update={"precision": fe.precision}), partition.name_nodes(fe.model)
    )
    assert plan.batch_sizes == sizes
    checks = verify.check_frontend(fe, (*sizes, 5), DEFAULT_TOLERANCES["fp32"], seed=3)
    assert len(checks) == 3
    assert all(c.passed for c in checks), [verify.Report.line(c) for c in checks]
    assert all(f"run {export_batch} at a time" in c.note for c in checks)


def test_the_rewrites_are_reported_and_the_batch_dim_becomes_minus_one() -> None:
    fe = frontend.prepare(_cfg((1, 3)), attention_heads(1))
    note = next(r.detail for r in fe.rewrites if r.stage == "batch" and "shape constant" in r.detail)
    # 9: the export's flatten of the input into tokens is gone (the tokens stage has the q, k, v Linears read the image)
    assert note.startswith("9 shape constant(s) carried the export batch 1: Reshape")
    inits = {i.name: numpy_helper.to_array(i) for i in fe.body.graph.initializer}
    targets = [inits[n.input[1]].tolist() for n in fe.body.graph.node if n.op_type == "Reshape"]
    assert [-1, T, D] in targets and [-1, HEADS, T, D] in targets and [-1, C, H, W] in targets


def test_unsimplified_a_constant_of_shape_with_the_export_batch_reads_the_batch_at_run_time() -> None:
    """Without the simplifier the ConstantOfShape([2, C, H, W]) stays a node: its shape becomes Concat(Shape(x)[:1],
    [C, H, W]); with it, it is a folded constant of two equal images and keeps one, which broadcasts."""
    cfg = BuildConfig(model=Path("export.onnx"), batch_sizes=(2, 6), simplify=False)
    fe = frontend.prepare(cfg, constant_of_shape_and_slice(2))
    assert "ConstantOfShape 'constantofshape0'" in next(r.detail for r in fe.rewrites if "shape constant" in r.detail)
    assert "Shape" in {n.op_type for n in fe.body.graph.node}
    checks = verify.check_frontend(fe, (2, 6, 3), DEFAULT_TOLERANCES["fp32"], seed=5)
    assert all(c.passed for c in checks), [verify.Report.line(c) for c in checks]


def _mean_over_batch(b: int) -> onnx.ModelProto:
    g = Export(b)
    return g.model(g.op("Sub", "x", g.op("ReduceMean", "x", axes=[0], keepdims=1)))


def _first_image(b: int) -> onnx.ModelProto:
    """x[0] (a Gather on the batch), broadcast back: at batch 1 every image is the first."""
    g = Export(b)
    return g.model(g.op("Add", "x", g.op("Gather", "x", g.const(np.array(0, np.int64)), axis=0)))


def _gather_across(b: int) -> onnx.ModelProto:
    """The flattened batch gathered in reverse: image i takes image b - 1 - i's values."""
    g = Export(b)
    flat = g.op("Reshape", "x", g.const([-1]))
    n = C * H * W
    order = (np.arange(b)[::-1].reshape(b, 1) * n + np.arange(n).reshape(1, n)).reshape(b, C, H, W).astype(np.int64)
    return g.model(g.op("Gather", flat, g.const(order), axis=0))


def _batch_into_channels(b: int) -> onnx.ModelProto:
    """(2, 6, 4, 4) viewed as (3, 64): rows that straddle two images."""
    g = Export(b)
    x = g.op("Conv", "x", g.weight(6, C, 1, 1))
    mixed = g.op("Reshape", g.op("Relu", g.op("Reshape", x, g.const([3, -1]))), g.const([b, 6, H, W]))
    return g.model(g.op("Conv", mixed, g.weight(C, 6, 1, 1)))


def _concat_on_batch(b: int) -> onnx.ModelProto:
    g = Export(b)
    both = g.op("Concat", "x", g.op("Neg", "x"), axis=0)
    return g.model(g.op("Slice", both, g.const([0]), g.const([b]), g.const([0])))


REFUSED = {
    "mean over the batch": (_mean_over_batch, 1, r"ReduceMean 'reducemean0' reduces over the dim that holds"),
    "a picked image": (_first_image, 1, r"Gather 'gather0' indexes along the dim that holds the batch"),
    "batch mixed into rows": (_batch_into_channels, 2, r"Reshape 'reshape1' mixes the batch into other dims"),
    "concat on the batch": (_concat_on_batch, 1, r"Concat 'concat1' concatenates along the batch"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_batch_that_cannot_be_freed_is_refused_naming_the_node_but_the_export_batch_builds(case: str) -> None:
    build, b, why = REFUSED[case]
    with pytest.raises(
        ModelError, match=rf"^cannot free the batch the export fixed at {b}: {why}.*batch_sizes: \[{b}\]$"
    ):
        frontend.prepare(_cfg((b, b + 1)), build(b))
    fe = frontend.prepare(_cfg((b,)), build(b))
    assert any("the batch stays fixed" in r.detail for r in fe.rewrites)
    checks = verify.check_frontend(fe, (b,), DEFAULT_TOLERANCES["fp32"], seed=4)
    assert all(c.passed for c in checks), [verify.Report.line(c) for c in checks]


def test_an_export_batch_whose_rows_an_op_combines_is_refused_at_every_batch_naming_batch_fixed() -> None:
    """Image i takes image b - 1 - i's values: the image path runs rows one by one, so no batch computes that;
    `batch: fixed` builds the exported shape whole (tests/test_fixed_shape.py)."""
    for sizes in ((2, 3), (2,)):
        with pytest.raises(
            ModelError,
            match=r"^cannot free the batch the export fixed at 2: Gather 'gather1' indexes across the "
            r"images of the batch, so its dim 0 holds data .*`batch: fixed`",
        ):
            frontend.prepare(_cfg(sizes), _gather_across(2))


def test_a_dynamo_export_of_segformer_at_batch_one_builds_for_two_on_the_cpu(tmp_path: Path) -> None:
    """smp Segformer("mit_b0") as torch.onnx.export(..., dynamo=True) writes it at batch 1 (64x64): its
    views carry the batch, and its K/V stack holds it in dim 1. Built for [1, 2] through IREE on the CPU, each
    batch verified against the export run one image at a time and the engine against onnxruntime."""
    from zoo import CONFIGS, load_export

    from dualtrack.compiler.build import build

    zoo = load_export()
    name = "smp_segformer_mit_b0"
    exported = zoo.export_model(name, tmp_path / "export", zoo.small_size(name))
    lines = (CONFIGS / f"{name}.yaml").read_text().splitlines()
    keep = [ln for ln in lines if not ln.startswith(("model:", "batch_sizes:", "output:"))]
    config = tmp_path / f"{name}.yaml"
    config.write_text("\n".join([*keep, f"model: {exported.path}", "batch_sizes: [1, 2]", "partition: iree"]) + "\n")
    result = build(config, tmp_path / "bundle", cpu_only=True)

    assert result.verification is not None and result.verification["passed"] is True
    checks = {c["name"]: c for c in result.verification["checks"]}
    assert all(c["passed"] for c in checks.values())
    assert "vs export run 1 at a time" in checks["frontend b2 logits"]["note"]
    assert {"plan b1 probs #0", "plan b2 probs #0"} <= set(checks)
    assert result.plan is not None and result.plan.batch_sizes == (1, 2)
