"""Pad, Slice / Split and Concat on Track A (issue 38), on the CPU: the front end's fold of a zero Pad
into the Conv / AveragePool after it (against onnxruntime), the pad kernel's numpy reference in every
mode (against onnxruntime's Pad), the partition taking Pad, Slice, Split and a Concat whose inputs
come from both tracks (the segments' calls by their numpy semantics against onnxruntime), and a tiny
torch export (ReflectionPad2d, Conv, Split, Concat) built and verified by `dualtrack build`.
The kernels on a GPU: tests/gpu/test_pad_gpu.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler import frontend, partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.compiler.frontend import Rewrite
from dualtrack.compiler.verify import interpret_track_a, ort_session, run_ort
from dualtrack.kernels import PadMode

C, H, W = 8, 13, 11  # odd sizes: every pad lands somewhere asymmetric
PAD = kernels.KERNELS["pad"]
# The reference copies values bit for bit; a Conv's sum over taps in another order is the only difference.
CONV_TOL = 1e-4


class Graph:
    """A float32 NCHW graph from ``x`` (N, C, H, W), node by node; each node names its output."""

    def __init__(self, seed: int = 3) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def add(self, op: str, name: str, inputs: list[str], outputs: list[str] | None = None, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, outputs or [name], name=name, **attrs))
        return name

    def conv(self, name: str, x: str, cin: int, cout: int = C, k: int = 3, pads: list[int] | None = None) -> str:
        w = self.const(f"{name}.w", (self.rng.standard_normal((cout, cin, k, k)) / k).astype(np.float32))
        b = self.const(f"{name}.b", self.rng.standard_normal(cout).astype(np.float32))
        return self.add("Conv", name, [x, w, b], kernel_shape=[k, k], pads=pads if pads is not None else [k // 2] * 4)

    def pad(self, name: str, x: str, hw: tuple[int, int, int, int], mode: str = "constant", value: float = 0.0) -> str:
        """Pad over H, W by (top, left, bottom, right), pads and value as inputs (opset 11+)."""
        t, le, b, r = hw
        pads = self.const(f"{name}.pads", np.array([0, 0, t, le, 0, 0, b, r], np.int64))
        ins = [x, pads] + ([self.const(f"{name}.value", np.array(value, np.float32))] if mode == "constant" else [])
        return self.add("Pad", name, ins, mode=mode)

    def model(self, *outputs: str) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, H, W])
        g = helper.make_graph(self.nodes, "g", [x], [], self.inits)
        m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
        m.graph.output.extend(vi for vi in m.graph.value_info if vi.name in outputs)
        del m.graph.value_info[:]
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


def run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    return run_ort(ort_session(model), {"x": x})


def image(n: int = 2) -> np.ndarray:
    return np.random.default_rng().standard_normal((n, C, H, W)).astype(np.float32)


# --- the front end's fold ---------------------------------------------------------------------------


def padded_readers() -> onnx.ModelProto:
    """Zero Pads of odd pads (1, 2, 0, 3) before a Conv, an AveragePool that counts its padding, and
    not foldable: a smaller AveragePool, a MaxPool (whose padding is -inf), a crop (a negative pad)."""
    g = Graph()
    g.pad("p_conv", "x", (1, 2, 0, 3))
    g.conv("conv", "p_conv", C, pads=[1, 0, 2, 1])
    g.pad("p_avg", "x", (1, 2, 0, 3))
    g.add("AveragePool", "avg", ["p_avg"], kernel_shape=[5, 5], pads=[1, 1, 1, 1], count_include_pad=1)
    g.pad("p_big", "x", (1, 2, 0, 3))  # its pads would reach the window: onnxruntime refuses those
    g.add("AveragePool", "big", ["p_big"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)
    g.pad("p_max", "x", (1, 2, 0, 3))
    g.add("MaxPool", "max", ["p_max"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.pad("p_crop", "x", (1, -1, 0, 0))
    g.conv("crop_conv", "p_crop", C)
    return g.model("conv", "avg", "big", "max", "crop_conv")


def test_a_zero_pad_folds_into_the_conv_and_average_pool_after_it_and_the_outputs_stay() -> None:
    model = padded_readers()
    log: list[Rewrite] = []
    folded = frontend.fold_zero_pads(model, log)
    left = {n.name for n in folded.graph.node if n.op_type == "Pad"}
    assert left == {"p_big", "p_max", "p_crop"}  # MaxPool pads with -inf; a crop is not a pad
    conv = next(n for n in folded.graph.node if n.name == "conv")
    assert conv.input[0] == "x" and list(helper.get_attribute_value(conv.attribute[-1])) == [2, 2, 2, 4]
    assert [str(r) for r in log] == [
        "pad: 2 zero Pad(s) folded into the padding of the Conv/AveragePool after them: 'p_conv', 'p_avg'"
    ]
    x = image()
    want, got = run(model, x), run(folded, x)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=CONV_TOL, atol=CONV_TOL, err_msg=name)


def test_a_nonzero_or_non_constant_pad_or_a_pad_with_another_reader_stays() -> None:
    g = Graph()
    g.pad("half", "x", (1, 1, 1, 1), value=0.5)
    g.conv("c1", "half", C)
    g.pad("refl", "x", (1, 1, 1, 1), mode="reflect")
    g.conv("c2", "refl", C)
    g.pad("shared", "x", (1, 1, 1, 1))
    g.conv("c3", "shared", C)
    g.add("Relu", "r", ["shared"])
    log: list[Rewrite] = []
    folded = frontend.fold_zero_pads(g.model("c1", "c2", "c3", "r"), log)
    assert sum(n.op_type == "Pad" for n in folded.graph.node) == 3 and log == []


# --- the pad kernel's reference against onnxruntime ---------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(
    ("mode", "value", "hw"),
    [
        ("reflect", 0.0, (3, 0, 2, 5)),
        ("edge", 0.0, (3, 0, 2, 5)),
        ("constant", 0.5, (1, 2, 0, 3)),
        ("edge", 0.0, (0, 0, 0, 0)),
    ],
)
def test_the_pad_reference_computes_onnx_pad(dtype: str, mode: str, value: float, hw: tuple[int, ...]) -> None:
    g = Graph()
    g.pad("p", "x", hw, mode=mode, value=value)  # type: ignore[arg-type]
    model = g.model("p")
    x = image()
    want = run(model, x)["p"]
    got = PAD.reference(x.transpose(0, 2, 3, 1).astype(dtype), PadMode(mode, *hw, value=value))
    np.testing.assert_array_equal(got, want.transpose(0, 2, 3, 1).astype(dtype))  # a copy: exact


def test_the_pad_reference_copies_a_channel_slice_and_refuses_what_onnx_refuses() -> None:
    x = np.random.default_rng().standard_normal((2, 5, 4, 9)).astype(np.float16)
    np.testing.assert_array_equal(PAD.reference(x, PadMode.copy(c0=3, channels=4)), x[..., 3:7])
    with pytest.raises(Exception, match=r"reflect pads \[5, 0, 0, 0\] of a 5x4 image"):
        PAD.reference(x, PadMode("reflect", 5, 0, 0, 0))
    with pytest.raises(Exception, match=r"channels \[6, 10\) of an input of 9"):
        PAD.reference(x, PadMode.copy(c0=6, channels=4))


# --- the partition --------------------------------------------------------------------------------------


def mixed_tracks() -> onnx.ModelProto:
    """Track B (Sin) -> conv -> reflect Pad -> conv (no pads) -> Split [3, 5] and Slice [2:6] of it,
    a conv of the first part, a Track B branch (Sin), and a Concat of all four -> conv -> Sin."""
    g = Graph()
    g.add("Sin", "pre", ["x"])
    g.conv("a", "pre", C)
    g.pad("rp", "a", (1, 2, 0, 3), mode="reflect")
    g.conv("b", "rp", C, pads=[0, 0, 0, 0])
    g.add("Split", "sp", ["b", g.const("sp.sizes", np.array([3, 5], np.int64))], ["s0", "s1"], axis=1)
    g.conv("c", "s0", 3, 4)
    g.add(
        "Slice", "sl", ["b", g.const("st", np.array([2])), g.const("en", np.array([6])), g.const("ax", np.array([1]))]
    )
    g.add("Pad", "ep", ["sl", g.const("ep.pads", np.array([0, 0, 0, 1, 0, 0, 2, 0], np.int64))], mode="edge")
    g.add("Slice", "crop", ["ep", g.const("cs", np.array([0, 0])), g.const("ce", np.array([-2, -1])),
                            g.const("ca", np.array([2, 3]))])  # fmt: skip
    g.add("Sin", "side", ["b"])
    g.add("Concat", "cat", ["c", "s1", "crop", "side"], axis=1)
    g.conv("d", "cat", 4 + 5 + 4 + C)
    g.add("Sin", "y", ["d"])
    return g.model("y")


def auto_plan(model: onnx.ModelProto) -> partition.Partitioned:
    cfg = BuildConfig(
        model=Path("g.onnx"), batch_sizes=(1, 2), partition=PartitionConfig(mode="auto", switch_cost_us=0.0)
    )
    return partition.partition_model(cfg, model)


def test_pad_slice_split_and_a_concat_of_both_tracks_run_on_track_a() -> None:
    model = mixed_tracks()
    p = auto_plan(model)
    on_b = {d.node for d in p.assignment.decisions if d.track == "B"}
    assert on_b == {"pre", "side", "y", "crop"}  # the spatial crop (a Slice over H, W) is IREE's
    calls = [c for s in p.plan.segments for c in s.calls]
    by_node = {n: c for c in calls for n in c.nodes}
    assert by_node["rp"].op == "pad" and PadMode.of(by_node["rp"]) == PadMode("reflect", 1, 2, 0, 3)
    assert by_node["ep"].op == "pad" and PadMode.of(by_node["ep"]).mode == "edge"
    # s0 and the slice stay in their segment: views of b (read by the conv and the edge pad there); s1
    # leaves it (for the concat after Track B's branch): a dense copy.
    assert by_node["sp"].op == "slice" and by_node["sp"].outputs == ("s0",)
    assert [(c.op, PadMode.of(c).c0, PadMode.of(c).channels) for c in calls if c.outputs == ("s1",)] == [("pad", 3, 5)]
    assert by_node["sl"].op == "slice" and by_node["sl"].attr("start") == 2
    # The concat takes Track B's branch: its inputs from other segments are copied into their slices.
    cat_seg = next(s for s in p.plan.segments if "cat" in s.nodes)
    assert cat_seg.track == "A" and by_node["cat"].op == "concat"
    assert {c.inputs[0] for c in cat_seg.calls if c.op == "pad"} == {"c", "s1", "crop", "side"}
    for seg in p.plan.segments:  # every node covered once
        assert tuple(n for c in seg.calls for n in c.nodes) == (seg.nodes if seg.track == "A" else ())


def test_track_a_segments_compute_what_onnxruntime_computes() -> None:
    model = mixed_tracks()
    p = auto_plan(model)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rng = np.random.default_rng()
    for seg, seg_model in zip(p.plan.segments, p.seg_models, strict=True):
        if seg.track != "A":
            continue
        feeds = {t.name: rng.standard_normal(t.at_batch(2)).astype(t.dtype) for t in seg.inputs}
        want = run_ort(ort_session(seg_model), feeds)
        got = interpret_track_a(seg, weights, feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=CONV_TOL, atol=CONV_TOL, err_msg=name)


def test_a_slice_view_is_a_channel_slice_of_its_input_buffer() -> None:
    p = auto_plan(mixed_tracks())
    seg = next(s for s in p.plan.segments if "sp" in s.nodes)
    views = seg.channel_views()
    assert views["s0"] == ("b", 0) and views["b"] == ("b", 0) and views["s1"] == ("s1", 0)
    cat_seg = next(s for s in p.plan.segments if "cat" in s.nodes)
    offsets = [cat_seg.channel_views()[x][1] for x in next(c for c in cat_seg.calls if c.op == "concat").inputs]
    assert offsets == [0, 4, 9, 13]


def dense_blocks(layers: int = 4, growth: int = 6) -> onnx.ModelProto:
    """DenseNet's pattern, at channel counts no zoo model has: layer k of a block concatenates the block's
    input and the outputs of every layer before it, in order; BatchNorm + ReLU on the concatenation, a
    1x1 and a 3x3 conv; then a transition (1x1 conv, average pool) and a second block."""
    g = Graph(seed=5)
    x, width = g.conv("stem", "x", C, 10), 10
    for blk in range(2):
        feats = [x]
        for k in range(layers):
            cat = g.add("Concat", f"b{blk}cat{k}", feats, axis=1) if len(feats) > 1 else feats[0]
            cin = width + growth * k
            bn = [g.const(f"b{blk}bn{k}.{p}", v) for p, v in zip("sbmv", (
                g.rng.uniform(0.5, 1.5, cin), g.rng.normal(0, 0.1, cin), g.rng.normal(0, 0.1, cin),
                g.rng.uniform(0.5, 2.0, cin)), strict=True)]  # fmt: skip
            g.add("BatchNormalization", f"b{blk}bn{k}", [cat, *(n for n in bn)], epsilon=1e-5)
            g.add("Relu", f"b{blk}r{k}", [f"b{blk}bn{k}"])
            h = g.add("Relu", f"b{blk}r{k}b", [g.conv(f"b{blk}p{k}", f"b{blk}r{k}", cin, 16, k=1)])
            feats.append(g.conv(f"b{blk}c{k}", h, 16, growth))
        out = g.add("Concat", f"b{blk}out", feats, axis=1)
        width += growth * layers
        if blk == 0:
            t = g.conv("trans", out, width, 12, k=1)
            x, width = g.add("AveragePool", "pool", [t], kernel_shape=[2, 2], strides=[2, 2]), 12
    g.add("Sin", "y", [g.conv("head", out, width, 3, k=1)])
    for i in g.inits:  # BatchNorm's inputs as float32, as an export writes them
        if i.data_type == TensorProto.DOUBLE:
            i.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(i).astype(np.float32), i.name))
    return g.model("y")


def test_dense_block_concatenations_nest_instead_of_copying_their_inputs() -> None:
    """Each Concat that begins with the previous one's inputs takes that Concat as its first part: every
    layer's output is written once, into one buffer a block, and no call copies (the lowering used to copy
    every earlier input again, layers^2 / 2 copies a block); the segment computes onnxruntime's answer."""
    model = dense_blocks()
    p = auto_plan(model)
    seg = next(s for s in p.plan.segments if s.track == "A" and "b0cat3" in s.nodes)
    assert "b1out" in seg.nodes
    # one copy: the first block's input, the stem's output, comes from Track B (the cost model's choice)
    assert [c.inputs for c in seg.calls if c.op == "pad"] == [("stem",)]
    cats = {c.outputs[0]: c.inputs for c in seg.calls if c.op == "concat"}
    assert cats["b0cat2"] == ("b0cat1", "b0c1") and cats["b0out"] == ("b0cat3", "b0c3")
    assert cats["b1cat1"] == ("pool", "b1c0") and cats["b1out"] == ("b1cat3", "b1c3")
    views = seg.channel_views()
    assert [views[f"b0c{k}"] for k in range(4)] == [("b0out", 10 + 6 * k) for k in range(4)]
    assert views["b0cat2"] == ("b0out", 0) and views["b1cat3"] == ("b1out", 0)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    feeds = {t.name: np.random.default_rng(7).standard_normal(t.at_batch(2)).astype(t.dtype) for t in seg.inputs}
    seg_model = p.seg_models[p.plan.segments.index(seg)]
    want, got = run_ort(ort_session(seg_model), feeds), interpret_track_a(seg, weights, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=CONV_TOL, atol=CONV_TOL, err_msg=name)


# --- a torch export, built ------------------------------------------------------------------------------


def write_reflect_project(root: Path) -> Path:
    """A torch net (ReflectionPad2d + Conv, F.pad replicate, a Split and a Concat of its parts with a
    conv's output) exported with torch.onnx.export's defaults, and its config: body on Track A."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
            # (left, right, top, bottom): ONNX pads (0, 1, 3, 2), which IREE 3.13's llvm-cpu cannot
            # compile as a Pad; iree_build.gather_pads hands it over as Gathers (tests/test_iree_pads.py).
            self.pad = torch.nn.ReflectionPad2d((1, 2, 0, 3))
            self.conv = torch.nn.Conv2d(8, 12, 3)
            self.mix = torch.nn.Conv2d(5, 4, 1)
            self.head = torch.nn.Conv2d(4 + 7 + 12, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(self.pad(torch.relu(self.stem(x))))
            a, b = torch.split(y, [5, 7], dim=1)
            z = torch.nn.functional.pad(torch.relu(y), (1, 1, 0, 2), mode="replicate")[:, :, :-2, 1:-1]
            return self.head(torch.cat([self.mix(a), b, z], 1))

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    # torch.onnx.export's defaults, as users export (the front end makes the fixed batch symbolic).
    torch.onnx.export(Net().eval(), (torch.randn(1, 3, 20, 24),), str(root / "net.onnx"), opset_version=17)
    cfg = root / "net.yaml"
    cfg.write_text(
        "model: net.onnx\nbatch_sizes: [1, 2]\ntargets: [sm_80]\npartition:\n  mode: auto\nverify:\n  samples: 1\n"
    )
    return cfg


def test_a_reflection_padded_torch_export_builds_on_track_a_and_verifies(tmp_path: Path) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    build(write_reflect_project(tmp_path), tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    ops = {c.op for s in plan.segments for c in s.calls}
    assert {"pad", "concat"} <= ops and ops & {"slice", "pad"}
    pads = [c for s in plan.segments for c in s.calls if c.op == "pad"]
    assert {PadMode.of(c).mode for c in pads} >= {"reflect", "edge"}
