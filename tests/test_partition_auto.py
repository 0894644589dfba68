"""`partition: auto`: the Track A predicates, the cost model, island merging, rules as overrides, the
report, and a whole CPU build. Small graphs made with onnx.helper, the tiny U-Net and the reference
U-Net (generated, as `dualtrack make-reference` writes it). No GPU."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from dualtrack.cli import main
from dualtrack.compiler import cost, partition
from dualtrack.compiler import tuned as tuning
from dualtrack.compiler.build import PARTITION_REPORT, build, refused_to_track_a
from dualtrack.compiler.config import BuildConfig, PartitionConfig, Rules, load_config
from dualtrack.compiler.reference import UNetSpec, write_reference
from dualtrack.compiler.verify import ort_session, run_ort
from dualtrack.contract.bundle import Bundle
from dualtrack.errors import ConfigError, PartitionError, SegmentCompileError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
C, H, W = 8, 16, 16  # channels and size of the small graphs


# --- small graphs ---------------------------------------------------------------------------------


class Graph:
    """A float32 NCHW graph from `x` (1, C, H, W) built node by node; every node names its output."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(7)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def add(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(self, name: str, x: str, k: int = 3, cout: int = C, cin: int = C, group: int = 1, stride: int = 1) -> str:
        shape = (cout, cin // group, k, k)
        w = numpy_helper.from_array(self.rng.normal(size=shape).astype(np.float32), f"{name}.w")
        b = numpy_helper.from_array(self.rng.normal(size=(cout,)).astype(np.float32), f"{name}.b")
        self.inits += [w, b]
        attrs = {"kernel_shape": [k, k], "pads": [k // 2] * 4, "group": group, "strides": [stride] * 2}
        return self.add("Conv", name, [x, w.name, b.name], **attrs)

    def model(self, *outputs: str) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, H, W])
        g = helper.make_graph(self.nodes, "g", [x], [], self.inits)
        m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
        m.graph.output.extend(vi for vi in m.graph.value_info if vi.name in outputs)
        del m.graph.value_info[:]
        onnx.checker.check_model(m)
        return m


def auto(switch_us: float | None = None, track_a: Rules | None = None, track_b: Rules | None = None) -> BuildConfig:
    rules = {"track_a": track_a or Rules(), "track_b": track_b or Rules()}
    part = PartitionConfig(mode="auto", switch_cost_us=switch_us, **rules)
    return BuildConfig(model=Path("graph.onnx"), batch_sizes=(1, 8), partition=part)


def tracks(p: partition.Partitioned) -> dict[str, str]:
    return {d.node: d.track for d in p.assignment.decisions}


def why(p: partition.Partitioned, node: str) -> str:
    return next(d.why for d in p.assignment.decisions if d.node == node)


def lone_pool() -> onnx.ModelProto:
    """B (Sin) -> one 2x2 max-pool, the only node Track A takes -> B (Sin)."""
    g = Graph()
    g.add("Sin", "pre", ["x"])
    g.add("MaxPool", "pool", ["pre"], kernel_shape=[2, 2], strides=[2, 2])
    g.add("Sin", "post", ["pool"])
    return g.model("post")


def test_a_lone_supported_node_moves_to_b_when_switches_cost_more_than_it_saves() -> None:
    p = partition.partition_model(auto(switch_us=1000.0), lone_pool())
    assert tracks(p) == {"pre": "B", "pool": "B", "post": "B"}
    assert [s.track for s in p.plan.segments] == ["B"]
    # Its saving on Track A (B's per-node overhead, both batch sizes) is below 2 switches x 2 batch sizes.
    d = next(d for d in p.assignment.decisions if d.node == "pool")
    saving = d.b_us - d.a_us
    assert 0 < saving < 4 * 1000.0
    assert re.fullmatch(
        rf"moved to Track B with its island pool \.\. pool \(1 nodes\): on Track A it saves {saving:.1f} us, "
        r"less than the 4000\.0 us of the 2 track switch\(es\) it costs",
        d.why,
    )
    assert any(n.startswith("moved the island pool .. pool (1 nodes) to Track B") for n in p.plan.notes)


def test_a_node_kept_on_a_stays_there_whatever_its_cost() -> None:
    """keep_a (what a build passes after IREE failed on a node's segment): the pool that the switch
    cost moves to Track B stays on A, and says why; a node no Track A kernel takes stays on B."""
    keep = {"pool": "IREE failed on its segment for cuda-sm_89 (shared memory)", "pre": "IREE failed"}
    p = partition.partition_model(auto(switch_us=1000.0), lone_pool(), keep_a=keep)
    assert tracks(p) == {"pre": "B", "pool": "A", "post": "B"}
    assert why(p, "pool") == f"a Track A kernel takes it; kept there: {keep['pool']}"


def test_a_build_keeps_on_a_the_nodes_iree_failed_on_that_cost_alone_moved() -> None:
    """refused_to_track_a: the nodes of the failed segment that a Track A kernel takes (the pool),
    none where the segment holds only IREE's nodes, none for `partition: rules`."""
    cfg = auto(switch_us=1000.0)
    err = SegmentCompileError("seg0_B", "cuda-sm_89", "iree-compile", "uses 1597440 bytes of shared memory")
    kept = refused_to_track_a(err, partition.partition_model(cfg, lone_pool()), cfg, {})
    assert list(kept) == ["pool"] and "cuda-sm_89" in kept["pool"]
    again = partition.partition_model(cfg, lone_pool(), keep_a=kept)  # seg0_B now holds "pre" alone
    assert refused_to_track_a(err, again, cfg, kept) == {}  # nothing more to try: the error stands
    rules = cfg.model_copy(update={"partition": PartitionConfig(mode="rules")})
    assert refused_to_track_a(err, partition.partition_model(rules, lone_pool()), rules, {}) == {}


def test_a_lone_supported_node_stays_on_a_when_switches_are_free() -> None:
    p = partition.partition_model(auto(switch_us=0.0), lone_pool())
    assert tracks(p) == {"pre": "B", "pool": "A", "post": "B"}
    assert [s.track for s in p.plan.segments] == ["B", "A", "B"]
    assert why(p, "pool") == "a Track A kernel takes it"
    assert why(p, "pre") == "not a Track A node: no hand-written kernel"
    assert any(
        n.startswith(
            "plan: 3 segment(s) (B A B); host waits per inference: none where every Track B module replays "
            "(FACTS 23), else 1 "
        )
        for n in p.plan.notes
    )


def test_the_default_switch_cost_is_the_replayed_paths() -> None:
    assert cost.DEFAULT_PATH == "replay" and cost.SWITCH_COST_US == {"replay": 3.0, "iree": 80.0}
    p = partition.partition_model(auto(), lone_pool())
    assert "; 3 us per track switch (the default runtime path, Track B replayed in one CUDA graph; " in p.plan.notes[1]
    assert p.assignment.switch_us == 3.0
    assert tracks(p)["pool"] == "A"  # it saves more than 2 x 2 x 3 us


def test_many_small_islands_each_go_by_the_switch_cost() -> None:
    """Twelve conv + Relu islands between Sins (no Track A kernel): all on Track A with free switches,
    all merged into one Track B segment at the IREE runtime's 80 us (each saves ~30 us over the two
    batch sizes)."""
    g = Graph()
    x = g.add("Sin", "s0", ["x"])
    for i in range(12):
        x = g.add("Sin", f"s{i + 1}", [g.add("Relu", f"r{i}", [g.conv(f"c{i}", x)])])
    m = g.model(x)
    assert [s.track for s in partition.partition_model(auto(0.0), m).plan.segments] == ["B", "A"] * 12 + ["B"]
    p = partition.partition_model(auto(cost.SWITCH_COST_US["iree"]), m)
    assert [s.track for s in p.plan.segments] == ["B"]
    assert sum(n.startswith("moved the island") for n in p.plan.notes) == 12


def conv_chain() -> onnx.ModelProto:
    """B -> 3x3 conv + Relu (A) -> grouped 17x17 conv (no Track A kernel) -> 3x3 conv, shared output: its
    Relu an eltwise call of its own -> B."""
    g = Graph()
    g.add("Sin", "pre", ["x"])
    g.add("Relu", "c1_relu", [g.conv("c1", "pre")])
    g.conv("cg", "c1_relu", k=17, group=2)
    g.conv("c2", "cg")
    g.add("Relu", "c2_relu", ["c2"])
    g.add("Sin", "side", ["c2"])  # c2's output is read twice: its Relu cannot fuse
    g.add("Add", "y", ["c2_relu", "side"])
    return g.model("y")


def test_every_node_gets_the_predicates_answer() -> None:
    p = partition.partition_model(auto(switch_us=0.0), conv_chain())
    assert tracks(p) == {
        "pre": "B", "c1": "A", "c1_relu": "A", "cg": "B", "c2": "A", "c2_relu": "B", "side": "B", "y": "B",
    }  # fmt: skip
    assert why(p, "c1_relu") == "a Track A kernel takes it (no launch of its own)"
    assert why(p, "cg") == "not a Track A node: kernel 17x17: the general conv takes 1..15 a side"
    # An eltwise Relu at the edge of its segment costs a launch on Track A and nothing in IREE's
    # dispatch beside it: step 3b moves it (the switches are free here).
    assert why(p, "c2_relu").startswith("moved to Track B off the edge of its Track A segment: ")
    calls = [c for s in p.plan.segments for c in s.calls]
    assert [(c.op, c.nodes, c.attr("relu")) for c in calls[:2]] == [
        ("conv3x3", ("c1", "c1_relu"), 1),
        ("conv3x3", ("c2",), 0),
    ]
    assert len(calls) == 2  # c2_relu is IREE's now


def refused_convs() -> onnx.ModelProto:
    """Between Sins: a grouped 17x17 conv and a depthwise 17x17 (wider than the depthwise kernel's 7, so the
    general conv's, and wider than its 15): both refused in the general conv's words."""
    g = Graph()
    g.add("Sin", "pre", ["x"])
    g.conv("grouped", "pre", k=17, group=2)
    g.conv("dw17", "grouped", k=17, group=C)
    g.add("Sin", "post", ["dw17"])
    return g.model("post")


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        ("grouped", "kernel 17x17: the general conv takes 1..15 a side"),
        ("dw17", "kernel 17x17: the general conv takes 1..15 a side"),
    ],
)
def test_the_lowering_and_auto_ask_the_same_predicate(node: str, reason: str) -> None:
    """A conv the kernels refuse, dense or depthwise: auto's reason and the lowering's refusal are the
    same words, and the refusal says which node and why."""
    m = partition.name_nodes(refused_convs())
    specs = partition.infer_specs(m)
    conv = next(n for n in m.graph.node if n.name == node)
    assert partition.track_a_support(conv, partition.SupportContext.of(m, specs)) == reason
    assert why(partition.partition_model(auto(0.0), m), node) == f"not a Track A node: {reason}"
    rules = BuildConfig(
        model=Path("g.onnx"), partition=PartitionConfig(mode="rules", track_a=Rules(name_prefixes=(node,)))
    )
    with pytest.raises(PartitionError, match=rf"^node '{node}' \(Conv, {re.escape(reason)}\) is on Track A") as e:
        partition.build_plan(rules, m)
    assert isinstance(e.value, partition.TrackARefusal) and (e.value.node, e.value.why) == (node, reason)


def shared_concat_input() -> onnx.ModelProto:
    """Two convs concatenated, the first one's output also read by a Track B node: its input leaves
    the segment, so it cannot be a channel slice there, and is copied into one (lower_pad)."""
    g = Graph()
    g.add("Sin", "pre", ["x"])
    a, b = g.conv("a", "pre"), g.conv("b", "pre")
    g.add("Concat", "cat", [a, b], axis=1)
    g.conv("c", "cat", cin=2 * C)
    g.add("Sin", "side", [a])
    g.add("Add", "y", ["c", "side"])
    return g.model("y")


def test_a_concat_whose_input_leaves_its_segment_stays_on_a_with_a_copy_of_that_input() -> None:
    p = partition.partition_model(auto(switch_us=0.0), shared_concat_input())
    t = tracks(p)
    assert (t["a"], t["b"], t["cat"], t["side"]) == ("A", "A", "A", "B")
    cat_seg = next(s for s in p.plan.segments if "cat" in s.nodes)
    assert [(c.op, c.inputs) for c in cat_seg.calls if c.op in ("pad", "concat")] == [
        ("pad", ("a",)),
        ("concat", ("cat__part0", "b")),
    ]
    for seg in p.plan.segments:  # every Track A segment lowers; every node is covered once
        if seg.track == "A":
            assert tuple(n for c in seg.calls for n in c.nodes) == seg.nodes


def test_rules_override_auto_node_by_node() -> None:
    # A Track A rule keeps the lone pool on Track A whatever the switches cost ...
    p = partition.partition_model(auto(1000.0, track_a=Rules(name_prefixes=("pool",))), lone_pool())
    assert tracks(p)["pool"] == "A" and why(p, "pool") == "rule partition.track_a.name_prefixes 'pool'"
    # ... a Track B rule takes a node auto would put on Track A ...
    p = partition.partition_model(auto(0.0, track_b=Rules(op_types=("MaxPool",))), lone_pool())
    assert tracks(p)["pool"] == "B" and why(p, "pool") == "rule partition.track_b.op_types 'MaxPool'"
    # ... and a Track A rule on a node no kernel takes fails as it does without auto.
    with pytest.raises(PartitionError, match=r"^node 'cg' \(Conv, kernel 17x17: the general conv takes 1..15 a side"):
        partition.partition_model(auto(0.0, track_a=Rules(name_prefixes=("cg",))), conv_chain())


def test_the_model_input_and_output_stay_on_track_b() -> None:
    g = Graph()
    g.add("MaxPool", "first", ["x"], kernel_shape=[2, 2], strides=[2, 2])
    g.add("Sin", "mid", ["first"])
    g.add("MaxPool", "last", ["mid"], kernel_shape=[2, 2], strides=[2, 2])
    p = partition.partition_model(auto(0.0), g.model("last"))
    assert set(tracks(p).values()) == {"B"}
    io = "reads or writes the model's own input/output (Track A works in NHWC)"
    assert why(p, "first") == io and why(p, "last") == io


def test_rules_mode_reports_its_reasons_and_estimate() -> None:
    cfg = BuildConfig(
        model=Path("g.onnx"), partition=PartitionConfig(mode="rules", track_a=Rules(op_types=("MaxPool",)))
    )
    p = partition.partition_model(cfg, lone_pool())
    assert tracks(p) == {"pre": "B", "pool": "A", "post": "B"}
    assert why(p, "pre") == "no rule puts it on Track A"
    assert p.plan.notes[0] == "partition: hand-written rules (partition.track_a / track_b)"
    est = p.assignment.estimate_us(3)
    assert f"estimated {est:.0f} us" in p.plan.notes[2]


# --- the cost model -------------------------------------------------------------------------------


def test_conv_work_counts_every_tap_of_every_output_pixel() -> None:
    """2 FLOPs a multiply-add, the kernel's taps over the group's channels per output pixel (a stride
    shrinks the output, a group the taps); bytes: activations in and out, the weights once."""
    g = Graph()
    g.conv("s7", "x", k=7, stride=2)
    g.conv("dw", "s7", group=C)
    m = partition.name_nodes(g.model("dw"))
    specs = partition.infer_specs(m)
    inits = {i.name for i in m.graph.initializer}
    s7, dw = (cost.node_work(n, specs, inits) for n in m.graph.node)
    P, Q = H // 2, W // 2
    assert s7.flops == 2 * P * Q * C * C * 7 * 7
    assert s7.act_bytes == (C * H * W + C * P * Q) * 4  # float32
    assert s7.weight_bytes == (C * C * 7 * 7 + C) * 4
    assert dw.flops == 2 * P * Q * C * 3 * 3
    assert dw.act_bytes == 2 * C * P * Q * 4
    assert dw.weight_bytes == (C * 3 * 3 + C) * 4


def mobile_block() -> onnx.ModelProto:
    """Between Sins: a strided 3x3 (the general conv), a depthwise 3x3 + HardSwish, squeeze-and-excite
    (global pool, 1x1 fc + HardSigmoid, gated Mul) and a bilinear 2x upsampling."""
    g = Graph()
    g.add("Sin", "pre", ["x"])
    s2 = g.conv("s2", "pre", stride=2)
    act = g.add("HardSwish", "act", [g.conv("dw", s2, group=C)])
    fc = g.conv("fc", g.add("GlobalAveragePool", "gap", [act]), k=1)
    gate = g.add("HardSigmoid", "gate", [fc], alpha=1 / 6)
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    g.inits.append(scales)
    up = g.add("Resize", "up", [g.add("Mul", "mul", [act, gate]), "", "scales"], mode="linear")
    g.add("Sin", "post", [up])
    return g.model("post")


def test_each_track_a_node_is_costed_on_the_kernel_it_lowers_to() -> None:
    """track_a_kernel names the call the lowering makes (None: fused into the call before it); the
    general conv takes its own roofline, the mobile ops the SIMT kernels', on which they are
    bytes-bound."""
    m = partition.name_nodes(mobile_block())
    specs = partition.infer_specs(m)
    ctx = partition.SupportContext.of(m, specs)
    body = [n for n in m.graph.node if n.op_type != "Sin"]
    kernels = {n.name: partition.track_a_kernel(n, ctx) for n in body}
    assert kernels == {
        "s2": "conv", "dw": "dwconv", "act": None, "gap": "gap", "fc": "fc", "gate": None, "mul": "eltwise",
        "up": "resize",
    }  # fmt: skip
    p = partition.partition_model(auto(0.0), m)
    assert [s.track for s in p.plan.segments] == ["B", "A", "B"]
    calls = p.plan.segments[1].calls
    assert [(c.op, c.nodes[0]) for c in calls] == [(k, n) for n, k in kernels.items() if k is not None]
    rates, inits = cost.DEFAULT_RATES, set(ctx.inits)
    for n in body:
        d = next(d for d in p.assignment.decisions if d.node == n.name)
        if kernels[n.name] is None:
            assert d.a_us == 0.0
            continue
        work, r = cost.node_work(n, specs, inits), rates.track_a_for(kernels[n.name])
        assert r is (rates.track_a_conv if n.name == "s2" else rates.track_a_simt)
        want = sum(r.time_us(b * work.flops, b * work.act_bytes + work.weight_bytes) for b in (1, 8))
        assert d.a_us == pytest.approx(want)
        if n.name != "s2":  # memory-bound: the bytes take longer than the FLOPs
            assert work.flops / (r.tflops * 1e6) < (work.act_bytes + work.weight_bytes) / (r.tbps * 1e6)


def test_measured_conv_times_replace_the_estimate() -> None:
    m = partition.name_nodes(conv_chain())
    specs = partition.infer_specs(m)
    c1 = next(n for n in m.graph.node if n.name == "c1")
    key = cost.conv3x3_key(c1, specs, 8)
    assert key == (8, H, W, C, C, "float32")
    plain = cost.node_cost(c1, specs, set(), (1, 8), on_a=None, kernel="conv3x3")
    measured = cost.node_cost(c1, specs, set(), (1, 8), on_a=None, kernel="conv3x3", measured={key: 0.5})
    at_1 = cost.node_cost(c1, specs, set(), (1,), on_a=None, kernel="conv3x3").a_us
    assert (plain.source, measured.source) == ("model", "measured")
    assert measured.a_us == pytest.approx(at_1 + 500.0)
    assert measured.b_us == plain.b_us


def test_a_conv_measured_slower_on_track_a_moves_to_b_even_with_free_switches() -> None:
    g = Graph()
    g.add("Sin", "pre", ["x"])
    g.add("Sin", "post", [g.conv("conv", "pre")])
    m = g.model("post")
    slow = {(b, H, W, C, C, "float32"): 10.0 for b in (1, 8)}  # 10 ms a launch, measured
    assert tracks(partition.partition_model(auto(0.0), m))["conv"] == "A"
    p = partition.partition_model(auto(0.0), m, measured=slow)
    d = next(d for d in p.assignment.decisions if d.node == "conv")
    assert d.track == "B" and d.a_us == 20_000.0
    assert (
        d.why
        == f"moved to Track B with its island conv .. conv (1 nodes): it is {d.a_us - d.b_us:.1f} us faster on Track B"
    )
    assert p.plan.notes[1].startswith("costs: 1 conv(s) measured (the `tuning:` records), the rest the default model")


def test_measured_times_come_from_the_tuning_files_current_records(
    tiny_full_config: Path, tmp_path: Path, hand_tuning
) -> None:
    records = hand_tuning(tiny_full_config, tmp_path / "tuning.json")
    times = tuning.measured_times(tmp_path / "tuning.json", (9, 0))
    current = [r for r in records if r.cc == "9.0" and r.source_sha256 == tuning.source_sha256()]
    want = {(r.problem.N, r.problem.H, r.problem.W, r.problem.C, r.problem.K, r.problem.dtype) for r in current}
    assert set(times) == want and set(times.values()) == {0.01}
    assert set(tuning.measured_times(tmp_path / "tuning.json", (8, 0)).values()) == {0.03}


def test_every_command_takes_the_times_of_the_configs_first_target(
    tiny_full_config: Path, tmp_path: Path, hand_tuning
) -> None:
    hand_tuning(tiny_full_config, tmp_path / "tuning.json")
    cfg = load_config(tiny_full_config).model_copy(update={"tuning": tmp_path / "tuning.json"})
    assert cfg.targets[0] == "sm_90a"
    assert tuning.measured_for(cfg) == tuning.measured_times(tmp_path / "tuning.json", (9, 0))
    assert tuning.measured_for(cfg.model_copy(update={"targets": ("sm_80",)})) == tuning.measured_times(
        tmp_path / "tuning.json", (8, 0)
    )
    assert tuning.measured_for(cfg.model_copy(update={"tuning": None})) is None


# --- the U-Nets -----------------------------------------------------------------------------------


def test_tiny_unet_auto_puts_the_body_and_head_on_track_a(tiny_config: Path) -> None:
    cfg = load_config(tiny_config)
    model = partition.name_nodes(onnx.load(str(cfg.model)))
    p = partition.partition_model(cfg.model_copy(update={"partition": PartitionConfig(mode="auto")}), model)
    prefixes = ("enc", "mid/", "dec", "head/", "post/", "probs", "mask")
    hand = cfg.model_copy(update={"partition": PartitionConfig(mode="rules", track_a=Rules(name_prefixes=prefixes))})
    assert p.plan.segments == partition.build_plan(hand, model)[0].segments
    assert [s.track for s in p.plan.segments] == ["B", "A"]
    assert p.plan.segments[-1].calls[-1].op == "seghead"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/unet.yaml beside the reference models, as `make models` lays them out."""
    root = tmp_path_factory.mktemp("ref")
    write_reference(root / "models", UNetSpec())
    (root / "configs").mkdir()
    shutil.copy(CONFIGS / "unet.yaml", root / "configs" / "unet.yaml")
    return root / "configs" / "unet.yaml"


def test_reference_unet_auto_chooses_configs_unet_yamls_plan(reference: Path) -> None:
    cfg = load_config(reference)
    hand, _ = partition.plan_config(cfg)
    auto_cfg = cfg.model_copy(update={"partition": PartitionConfig(mode="auto")})
    chosen, _ = partition.plan_config(auto_cfg)
    assert [(s.track, s.nodes[0], s.nodes[-1], len(s.nodes)) for s in chosen.segments] == [
        ("B", "pre/cast", "pre/to_fp16", 5),
        ("A", "enc1/conv1", "mask", 53),
    ]
    assert chosen.segments == hand.segments
    # Its estimate (N=1 and N=8 summed) against bench-962eac1199's measured 0.75 + 2.9 ms: within 25%.
    est = float(re.search(r"estimated (\d+) us", next(n for n in chosen.notes if n.startswith("plan:")))[1])
    assert 0.75 * 3650 < est < 1.25 * 3650
    # The same plan with free switches (nothing on Track A is cheaper on Track B) and through the
    # IREE runtime's 80 us ones (the body saves far more than two switches).
    for switch in (0.0, cost.SWITCH_COST_US["iree"]):
        part = PartitionConfig(mode="auto", switch_cost_us=switch)
        assert partition.plan_config(cfg.model_copy(update={"partition": part}))[0].segments == hand.segments


# --- the config and a whole build -----------------------------------------------------------------


def test_config_reads_partition_auto(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: m.onnx\n")
    assert load_config(path).partition.mode == "auto"  # the default: a config needs no partition line
    path.write_text("model: m.onnx\npartition: iree\n")
    assert load_config(path).partition == PartitionConfig(mode="iree")
    path.write_text("model: m.onnx\npartition: auto\n")
    assert load_config(path).partition == PartitionConfig(mode="auto")
    path.write_text("model: m.onnx\npartition:\n  mode: auto\n  switch_cost_us: 2.5\n  track_b: {op_types: [Concat]}\n")
    part = load_config(path).partition
    assert (part.mode, part.switch_cost_us, part.track_b.op_types) == ("auto", 2.5, ("Concat",))


@pytest.mark.parametrize(
    ("section", "pattern"),
    [
        ("partition: automatic", r"c\.yaml:2: `partition`: Value error, 'automatic' is not a partition; write "),
        (
            "partition:\n  mode: rules\n  switch_cost_us: 5",
            r"c\.yaml:2: `partition`: Value error, switch_cost_us only applies to `mode: auto`; add `mode: auto`",
        ),
        (
            "partition:\n  mode: iree\n  track_a: {op_types: [Conv]}",
            r"c\.yaml:2: `partition`: Value error, `mode: iree` runs every node on Track B; drop the track_a rules",
        ),
        ("partition:\n  mode: auto\n  switch_cost_us: -1", r"c\.yaml:4: `partition\.switch_cost_us`: Input should be"),
    ],
)
def test_config_refuses_a_bad_partition(tmp_path: Path, section: str, pattern: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"model: m.onnx\n{section}\n")
    with pytest.raises(ConfigError, match=pattern):
        load_config(path)


def test_cpu_build_with_auto_verifies_and_reports_its_plan(tiny_config: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_config.parent / "tiny_fp32.onnx", tmp_path / "tiny_fp32.onnx")
    text = re.sub(r"partition:\n(  .*\n)+", "partition: auto\n", tiny_config.read_text())
    assert "partition: auto\n" in text
    config = tmp_path / "auto.yaml"
    config.write_text(text.replace("batch_sizes: [1, 4]", "batch_sizes: [1, 2]"))
    result = build(config, tmp_path / "bundle", cpu_only=True)
    assert result.verification is not None and result.verification["passed"]
    bundle = Bundle.open(tmp_path / "bundle")
    assert [s.track for s in bundle.plan.segments] == ["B", "A"]
    assert bundle.plan.notes[0] == "partition: auto"
    assert any(n.startswith("plan: 2 segment(s) (B A); host waits per inference: ") for n in result.notes)
    report = json.loads((bundle.root / PARTITION_REPORT).read_text())
    assert report["notes"] == list(bundle.plan.notes)
    nodes = {d["node"]: d for d in report["nodes"]}
    assert set(nodes) == {n for s in bundle.plan.segments for n in s.nodes}
    assert nodes["enc1/conv1"]["track"] == "A" and nodes["enc1/conv1"]["a_us"] < nodes["enc1/conv1"]["b_us"]
    assert nodes["post/softmax"]["why"] == "a Track A kernel takes it"
    assert nodes["post/argmax"]["why"] == "a Track A kernel takes it (no launch of its own)"
    info = CliRunner().invoke(main, ["info", str(tmp_path / "bundle")])
    assert info.exit_code == 0, info.stderr
    assert "partition  partition: auto" in info.stdout
    assert re.search(r"^partition  Track A \(\d+\): a Track A kernel takes it: enc1/conv1, ", info.stdout, re.M)


def test_a_tuned_time_counts_only_where_the_chooser_runs_the_tuned_tile() -> None:
    # fp16 64 -> 64 channels: on an sm_90a target the wgmma kernel takes it (no tuned tile runs), on
    # sm_80 an mma.sync tile does; a 3-channel layer runs the direct entry everywhere.
    key = (8, 64, 64, 64, 64, "float16")
    assert cost.ConvTarget.of("sm_90a").runs_tuned_tile(key) is False
    assert cost.ConvTarget.of("sm_80").runs_tuned_tile(key) is True
    assert cost.ConvTarget.of("sm_80").runs_tuned_tile((8, 64, 64, 3, 64, "float16")) is False


# --- never slower than IREE alone -------------------------------------------------------------------


def _estimates(p: partition.Partitioned) -> tuple[float, float]:
    """(the chosen plan's estimate, IREE alone's), both as the partition computes them."""
    a = p.assignment
    alone = cost.plan_us((d.b_us for d in a.decisions), 1, a.switch_us, len(a.batch_sizes))
    return a.estimate_us(len(p.plan.segments)), alone


@pytest.mark.parametrize("graph", [lone_pool, conv_chain, refused_convs, shared_concat_input, mobile_block])
@pytest.mark.parametrize("switch_us", [0.0, 3.0, 80.0, 1e6])
def test_auto_never_picks_a_plan_it_predicts_slower_than_iree_alone(graph, switch_us: float) -> None:
    p = partition.partition_model(auto(switch_us), partition.name_nodes(graph()))
    chosen, alone = _estimates(p)
    assert chosen <= alone * (1 + 1e-9)
    if switch_us == 1e6:  # a switch costs more than any kernel saves: one segment, on Track B
        assert [s.track for s in p.plan.segments] == ["B"]


def test_iree_alone_replaces_a_plan_whose_islands_only_pay_together() -> None:
    """The greedy moves look at one island at a time; the last step compares the whole plan with
    IREE alone and takes IREE alone where it is predicted no slower, saying so on every node."""
    m = partition.name_nodes(conv_chain())
    names = [n.name for n in m.graph.node]
    tracks = {n: "AB"[i % 2] for i, n in enumerate(names)}  # islands of one node between Track B nodes
    why = {n: "a Track A kernel takes it" for n in names}
    # Each node is 1 us faster on A, each segment costs 10: no single island pays, all of them moved do.
    estimate = lambda t, n_seg: 10.0 * n_seg + sum(1.0 for v in t.values() if v == "B")  # noqa: E731
    notes = partition._iree_alone_if_faster(m, tracks, why, set(), estimate)
    assert set(tracks.values()) == {"B"}
    assert notes and notes[0].startswith("took IREE alone: IREE alone is predicted")
    assert all(why[n].startswith("moved to Track B with the whole plan") for n in names[::2])
    kept = {n: "AB"[i % 2] for i, n in enumerate(names)}
    assert partition._iree_alone_if_faster(m, kept, dict(why), set(), lambda t, n: 0.0 if "A" in t.values() else 1.0)
    assert "A" in kept.values()  # a plan predicted faster than IREE alone stays


def test_info_lists_each_op_types_tracks_and_why() -> None:
    """The plan's notes (what `dualtrack info` prints) count each op type's nodes per track, with
    Track B's reasons reduced to their kind."""
    p = partition.partition_model(auto(3.0), partition.name_nodes(refused_convs()))
    lines = [n for n in p.plan.notes if n.startswith("ops: ")]
    per_op = {line.split(":")[1].strip(): line for line in lines}
    decisions = p.assignment.decisions
    for op, line in per_op.items():
        n_a = sum(d.op == op and d.track == "A" for d in decisions)
        n_b = sum(d.op == op and d.track == "B" for d in decisions)
        assert f"{n_a} on Track A, {n_b} on Track B" in line
    assert set(per_op) == {d.op for d in decisions}


def test_a_constant_the_graph_computes_never_crosses_between_tracks() -> None:
    """Shape(x) put on Track A by a rule, read by an Expand on Track B: the Track B segment computes the
    shape itself (partition.recompute_constants), so no shape value crosses a boundary (it has no batch),
    and the Track A segment keeps only what its kernels run."""
    g = Graph()
    g.add("Sin", "pre", ["x"])
    conv = g.conv("a/conv", "pre")
    g.add("Shape", "a/shape", [conv])
    g.add("Sin", "post", [conv])
    g.add("Expand", "b/expand", ["post", "a/shape"])
    g.add("Sin", "y", ["b/expand"])
    m = g.model("y")
    rules = BuildConfig(
        model=Path("g.onnx"), partition=PartitionConfig(mode="rules", track_a=Rules(name_prefixes=("a/",)))
    )
    p = partition.partition_model(rules, m)
    assert [(s.track, s.nodes) for s in p.plan.segments] == [
        ("B", ("pre",)),
        ("A", ("a/conv",)),
        ("B", ("a/shape", "post", "b/expand", "y")),
    ]
    assert all(t.name != "a/shape" for s in p.plan.segments for t in (*s.inputs, *s.outputs))
    x = np.random.default_rng(1).standard_normal((2, C, H, W)).astype(np.float32)
    env = {"x": x}
    for seg, sm in zip(p.plan.segments, p.seg_models, strict=True):  # each segment's own model, chained
        env.update(run_ort(ort_session(sm), {t.name: env[t.name] for t in seg.inputs}))
    want = run_ort(ort_session(m), {"x": x})["y"]
    np.testing.assert_allclose(env["y"], want, rtol=1e-5, atol=1e-5)


def test_an_fp32_island_whose_cast_down_writes_the_models_output_goes_to_track_b_whole() -> None:
    """An fp16 model whose last op is an upsample: its fp32 island (Cast up, Resize, Cast down) ends in the
    model's output, which Track A cannot write (NHWC); the island moves to Track B whole instead of leaving
    the Resize alone on Track A between two switches (an extra segment)."""
    f16 = TensorProto.FLOAT16
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.normal(size=(C, C, 3, 3)).astype(np.float16), "w"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
    ]
    nodes = [
        helper.make_node("Sin", ["x"], ["s"], name="sin"),
        helper.make_node("Conv", ["s", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Cast", ["r"], ["up"], name="up", to=TensorProto.FLOAT),
        helper.make_node("Resize", ["up", "", "scales"], ["big"], name="resize", mode="linear"),
        helper.make_node("Cast", ["big"], ["y"], name="down", to=f16),
    ]
    graph = helper.make_graph(
        nodes, "island", [helper.make_tensor_value_info("x", f16, ["N", C, H, W])],
        [helper.make_tensor_value_info("y", f16, ["N", C, 2 * H, 2 * W])], inits,
    )  # fmt: skip
    m = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    p = partition.partition_model(auto(0.0), m)
    t = tracks(p)
    assert (t["up"], t["resize"], t["down"]) == ("B", "B", "B") and t["conv"] == "A"
    assert [s.track for s in p.plan.segments] == ["B", "A", "B"]
    why = {d.node: d.why for d in p.assignment.decisions}
    assert why["resize"].startswith("its fp32 island moves whole: 'down' is on Track B")
