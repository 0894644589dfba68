"""Split an ONNX model into an ordered plan of Track A and Track B segments.

The ONNX graph is the single source of truth. Stages, each a plain function:

    (frontend.prepare) -> name_nodes -> infer_specs -> assign_tracks -> order_segments
    -> lower_track_a (kernel calls) + extract_segment (one ONNX model per segment) -> Plan

Every segment, Track A included, gets its own ONNX model: Track B compiles it with IREE; for
Track A it is what the CPU runtime runs (through IREE llvm-cpu) and what the kernels are checked
against. Tensors that cross into or out of Track A are NHWC; the segment models carry Transpose
nodes at those boundaries so that each one computes exactly what the plan says it does.
"""

from __future__ import annotations

import copy
import hashlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack import cost, frontend, layout
from dualtrack.config import BuildConfig, Rules
from dualtrack.errors import ModelError, PartitionError, UnsupportedOpError
from dualtrack.frontend import model_precision
from dualtrack.plan import KernelCall, Plan, Segment, TensorSpec

TRACK_A_DESCRIPTION = (
    "Conv 3x3/stride 1/pad 1 and 1x1/stride 1/pad 0 (optionally +Relu), MaxPool 2x2/stride 2, "
    "ConvTranspose 2x2/stride 2 "
    "and channel Concat of their outputs"
)
_TO_NCHW, _TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every node a unique name (partition rules and the plan refer to nodes by name)."""
    model = copy.deepcopy(model)
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)
    return model


def with_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy whose graph inputs and outputs have dim 0 fixed to `batch`."""
    model = copy.deepcopy(model)
    for vi in [*model.graph.input, *model.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            dims[0].Clear()
            dims[0].dim_value = batch
    del model.graph.value_info[:]
    return model


def _dtype(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


SpecMap = tuple[tuple[int, ...], str]


def infer_specs(model: onnx.ModelProto, batch: int = 1) -> dict[str, SpecMap]:
    """Static shape and dtype of every tensor at a given batch size."""
    try:
        inferred = onnx.shape_inference.infer_shapes(with_batch(model, batch), strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as e:
        raise ModelError(
            f"ONNX shape inference failed at batch {batch}: {str(e).splitlines()[0]}; the export may have its batch "
            "written into a shape: re-export with a dynamic batch, or build only the batch sizes it takes"
        ) from None
    g = inferred.graph
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
        specs[vi.name] = (dims, _dtype(t.elem_type))
    for init in g.initializer:
        specs[init.name] = (tuple(init.dims), _dtype(init.data_type))
    return specs


def batch_free(model: onnx.ModelProto) -> set[str]:
    """Tensors that do not carry the batch: constants (initializers, Constant nodes and what is
    computed from them alone) and shape values (what Shape/Size produce and what is computed from
    those and constants). They are not batch-major, and need not be."""
    free = {i.name for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type in ("Shape", "Size") or all(not x or x in free for x in n.input):
            free.update(o for o in n.output if o)
    return free


def batch_checked_specs(model: onnx.ModelProto, batch_sizes: tuple[int, ...] = (1, 2)) -> dict[str, SpecMap]:
    """Specs at batch 1, after checking at every batch size being built that each tensor that
    carries the batch keeps it in dim 0 (constants and shape values are exempt: :func:`batch_free`)."""
    one = infer_specs(model, 1)
    free = batch_free(model)
    carried = {name: shape for name, (shape, _) in one.items() if name not in free}
    for name, shape in carried.items():
        if -1 in shape:
            raise PartitionError(
                f"tensor '{name}' has a shape ONNX cannot infer statically ({shape}); "
                "export the model with static shapes"
            )
    for b in sorted(set(batch_sizes) - {1}):
        other = infer_specs(model, b)
        for name, shape in carried.items():
            got = other.get(name, (None,))[0]
            if not shape or got is None or got[0] != b * shape[0] or got[1:] != shape[1:] or shape[0] != 1:
                raise PartitionError(
                    f"tensor '{name}' does not keep the batch in dim 0 (batch 1: {shape}, batch {b}: {got}); "
                    "dualtrack needs batch-major tensors: build only `batch_sizes: [1]`, or re-export the model "
                    "with a dynamic batch (torch.onnx.export(..., dynamic_axes={'<input>': {0: 'N'}}))"
                )
    return one


def _rule(node: onnx.NodeProto, rules: Rules, side: str) -> str | None:
    """The rule of ``rules`` that names ``node``, spelled as in the config, or None."""
    if node.op_type in rules.op_types:
        return f"rule partition.{side}.op_types '{node.op_type}'"
    prefix = next((p for p in rules.name_prefixes if node.name.startswith(p)), None)
    return f"rule partition.{side}.name_prefixes '{prefix}'" if prefix is not None else None


def _check_rules(nodes: list[onnx.NodeProto], cfg: BuildConfig) -> None:
    for side, rules in (("track_a", cfg.partition.track_a), ("track_b", cfg.partition.track_b)):
        for prefix in rules.name_prefixes:
            if not any(n.name.startswith(prefix) for n in nodes):
                heads = sorted({n.name.split("/")[0] + ("/" if "/" in n.name else "") for n in nodes})[:12]
                raise PartitionError(
                    f"partition.{side}.name_prefixes: '{prefix}' matches no node of the model; "
                    f"node names start with: {', '.join(heads)}"
                )
        for op in rules.op_types:
            if not onnx.defs.has(op):
                raise PartitionError(f"partition.{side}.op_types: '{op}' is not an ONNX op type")
            if not any(n.op_type == op for n in nodes):
                raise PartitionError(f"partition.{side}.op_types: the model has no '{op}' node")
    for n in nodes:
        if n.domain not in ("", "ai.onnx"):
            raise UnsupportedOpError(
                f"node '{n.name}' is op {n.domain}::{n.op_type}, which no track can take "
                f"(Track A: {TRACK_A_DESCRIPTION}; "
                "Track B: standard ONNX ops through IREE); replace it with standard ONNX ops and re-export"
            )


@dataclass(frozen=True)
class Decision:
    """Where one node runs and why; its estimated time on each track (us, summed over the batch
    sizes: `dualtrack.cost`), ``a_us`` None where no Track A kernel takes it."""

    node: str
    op: str
    track: str  # "A" or "B"
    why: str
    a_us: float | None
    b_us: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Assignment:
    """The track of every node, why, and what the partition says about itself (mode, costs, moves)."""

    tracks: dict[str, str]
    decisions: tuple[Decision, ...]  # in graph order
    notes: tuple[str, ...]
    switch_us: float  # per track switch and batch size, as the estimate charges it
    batch_sizes: tuple[int, ...]

    def estimate_us(self, n_segments: int) -> float:
        """The plan's estimated time (us, summed over the batch sizes) with ``n_segments`` segments."""
        per_node = ((d.a_us or 0.0) if d.track == "A" else d.b_us for d in self.decisions)
        return cost.plan_us(per_node, n_segments, self.switch_us, len(self.batch_sizes))

    def grouped(self) -> list[str]:
        """One line per (track, reason): the nodes it holds, in graph order."""
        groups: dict[tuple[str, str], list[str]] = {}
        for d in self.decisions:
            groups.setdefault((d.track, d.why), []).append(d.node)
        return [f"Track {t} ({len(ns)}): {why}: {', '.join(ns)}" for (t, why), ns in groups.items()]


def assign_tracks(
    model: onnx.ModelProto,
    cfg: BuildConfig,
    specs: dict[str, SpecMap],
    measured: cost.MeasuredTimes | None = None,
) -> Assignment:
    """Track per node. ``partition.mode: rules``: Track B rules win, then Track A rules, then Track B
    (the default). ``auto``: :func:`auto_tracks`, with the rules as overrides. ``measured``: Track A
    kernel times from a tuning file (`dualtrack.tuning.measured_times`) for the cost model."""
    nodes = list(model.graph.node)
    _check_rules(nodes, cfg)
    part = cfg.partition
    switch = part.switch_cost_us if part.switch_cost_us is not None else cost.SWITCH_COST_US[cost.DEFAULT_PATH]
    ctx = SupportContext.of(model, specs)
    costs = _node_costs(model, ctx, cfg.batch_sizes, measured)
    if part.mode == "auto":
        return auto_tracks(model, cfg, ctx, costs, switch)
    tracks: dict[str, str] = {}
    decisions = []
    for n in nodes:
        rule_b, rule_a = _rule(n, part.track_b, "track_b"), _rule(n, part.track_a, "track_a")
        track, why = ("B", rule_b) if rule_b else ("A", rule_a) if rule_a else ("B", "no rule puts it on Track A")
        tracks[n.name] = track
        decisions.append(Decision(n.name, n.op_type, track, why, costs[n.name].a_us, costs[n.name].b_us))
    notes = ("partition: hand-written rules (partition.track_a / track_b)", _cost_note(switch, costs, cfg))
    return Assignment(tracks, tuple(decisions), notes, switch, cfg.batch_sizes)


def order_segments(model: onnx.ModelProto, tracks: dict[str, str]) -> list[list[onnx.NodeProto]]:
    """Topological order that stays on one track as long as it can; maximal runs become segments."""
    nodes = list(model.graph.node)
    produced_by = {out: n.name for n in nodes for out in n.output}
    deps = {n.name: {produced_by[i] for i in n.input if i in produced_by} for n in nodes}
    users: dict[str, list[str]] = defaultdict(list)
    for name, ds in deps.items():
        for d in ds:
            users[d].append(name)
    by_name = {n.name: n for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    pending = {name: len(ds) for name, ds in deps.items()}
    ready = sorted((name for name, c in pending.items() if c == 0), key=position.__getitem__)
    segments: list[list[onnx.NodeProto]] = []
    current: str | None = None
    while ready:
        same = [r for r in ready if tracks[r] == current]
        pick = same[0] if same else ready[0]
        if tracks[pick] != current:
            current = tracks[pick]
            segments.append([])
        ready.remove(pick)
        segments[-1].append(by_name[pick])
        for u in users[pick]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
        ready.sort(key=position.__getitem__)
    if sum(map(len, segments)) != len(nodes):
        raise ModelError("the ONNX graph has a cycle or a dangling input; re-export the model")
    return segments


@dataclass(frozen=True)
class _Boundaries:
    inputs: list[str]
    outputs: list[str]


def _boundaries(model: onnx.ModelProto, segments: list[list[onnx.NodeProto]]) -> list[_Boundaries]:
    inits = {i.name for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    seg_of_node = {n.name: k for k, seg in enumerate(segments) for n in seg}
    consumers: dict[str, set[int]] = defaultdict(set)
    for n in model.graph.node:
        for i in n.input:
            if i:
                consumers[i].add(seg_of_node[n.name])
    result = []
    for k, seg in enumerate(segments):
        produced = [o for n in seg for o in n.output if o]
        produced_set = set(produced)
        ins: list[str] = []
        for n in seg:
            for i in n.input:
                if i and i not in inits and i not in produced_set and i not in ins:
                    ins.append(i)
        outs = [o for o in produced if o in graph_outputs or consumers[o] - {k}]
        result.append(_Boundaries(ins, outs))
    return result


def _conv_attrs_ok(node: onnx.NodeProto) -> str | None:
    """None when a Conv is one the Track A kernels take: 3x3 with padding 1, or 1x1 without."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    kernel = list(a.get("kernel_shape", []))
    if kernel not in ([3, 3], [1, 1]):
        return f"kernel {kernel}"
    if list(a.get("strides", [1, 1])) != [1, 1] or list(a.get("dilations", [1, 1])) != [1, 1]:
        return "stride or dilation other than 1"
    if a.get("group", 1) != 1:
        return "grouped convolution"
    auto_pad = a.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") or (auto_pad == "VALID" and kernel == [1, 1]):
        return None
    pad = 1 if kernel == [3, 3] else 0
    if list(a.get("pads", [0, 0, 0, 0])) != [pad] * 4:
        return f"pads {list(a.get('pads', [0, 0, 0, 0]))}"
    return None


def _convt_attrs_ok(node: onnx.NodeProto) -> str | None:
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if list(a.get("kernel_shape", [])) != [2, 2] or list(a.get("strides", [1, 1])) != [2, 2]:
        return f"kernel {list(a.get('kernel_shape', []))} stride {list(a.get('strides', [1, 1]))}"
    if any(a.get("pads", [0, 0, 0, 0])) or any(a.get("output_padding", [0, 0])) or a.get("output_shape"):
        return "padding or output_padding"
    if a.get("group", 1) != 1 or list(a.get("dilations", [1, 1])) != [1, 1]:
        return "grouped or dilated transposed convolution"
    return None


def _pool_attrs_ok(node: onnx.NodeProto) -> str | None:
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if list(a.get("kernel_shape", [])) != [2, 2] or list(a.get("strides", [1, 1])) != [2, 2]:
        return f"kernel {list(a.get('kernel_shape', []))} stride {list(a.get('strides', [1, 1]))}"
    if any(a.get("pads", [0, 0, 0, 0])) or a.get("ceil_mode", 0) or list(a.get("dilations", [1, 1])) != [1, 1]:
        return "padding, ceil_mode or dilation"
    if len([o for o in node.output if o]) != 1:
        return "an Indices output"
    return None


# -- which nodes Track A takes: one predicate per op, asked by lower_track_a and by `partition: auto` --


@dataclass(frozen=True)
class SupportContext:
    """What a Track A predicate may look at besides the node: shapes and the graph around it."""

    specs: dict[str, SpecMap]
    inits: frozenset[str]
    producers: Mapping[str, onnx.NodeProto]  # tensor -> the node that computes it
    uses: Mapping[str, int]  # tensor -> how many node inputs read it
    graph_outputs: frozenset[str]
    constant: frozenset[str]  # batch_free: computed from weights, constants or shapes alone

    @classmethod
    def of(cls, model: onnx.ModelProto, specs: dict[str, SpecMap]) -> SupportContext:
        uses: dict[str, int] = defaultdict(int)
        for n in model.graph.node:
            for i in n.input:
                uses[i] += 1
        return cls(
            specs=specs,
            inits=frozenset(i.name for i in model.graph.initializer),
            producers={o: n for n in model.graph.node for o in n.output if o},
            uses=dict(uses),
            graph_outputs=frozenset(o.name for o in model.graph.output),
            constant=frozenset(batch_free(model)),
        )


Predicate = Callable[[onnx.NodeProto, SupportContext], "str | None"]


@dataclass(frozen=True)
class TrackAOp:
    """An ONNX op Track A takes: the predicate that says which of its nodes (None: this one; else
    why not), and whether a node of it launches a kernel of its own (False: it is fused into its
    producer's kernel or realised as a buffer alias, and costs nothing on Track A)."""

    check: Predicate
    launches: bool = True


def _constant_weights(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    if any(w and w not in ctx.inits for w in node.input[1:]):
        return "weights computed at run time"
    return None


def _conv_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return _conv_attrs_ok(node) or _constant_weights(node, ctx)


def _convt_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return _convt_attrs_ok(node) or _constant_weights(node, ctx)


def _pool_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return _pool_attrs_ok(node)


def _relu_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """A Relu runs in the epilogue of the Conv that computes its input, when nothing else reads it."""
    x = node.input[0]
    conv = ctx.producers.get(x)
    if conv is None or conv.op_type != "Conv":
        return "a Relu not after a Conv (Track A fuses Relu into the Conv before it)"
    if ctx.uses.get(x, 0) != 1 or x in ctx.graph_outputs:
        return f"the output of Conv '{conv.name}' is read by more than this Relu, so it cannot fuse"
    why = track_a_support(conv, ctx)
    return f"its Conv '{conv.name}' is not on Track A ({why})" if why else None


def _concat_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """Producers write channel slices of the output; lower_track_a checks they share its segment."""
    axis = {x.name: helper.get_attribute_value(x) for x in node.attribute}.get("axis")
    if axis not in (1, -3):
        return f"concatenation on axis {axis}, not channels"
    for x in node.input:
        producer = ctx.producers.get(x)
        if producer is None or producer.op_type not in TRACK_A_SUPPORT or x in ctx.graph_outputs:
            return f"input '{x}' is not computed by a Track A kernel"
    return None


# op type -> its predicate. A new Track A op joins lower_track_a's checks and `partition: auto` here.
TRACK_A_SUPPORT: dict[str, TrackAOp] = {
    "Conv": TrackAOp(_conv_support),
    "Relu": TrackAOp(_relu_support, launches=False),
    "MaxPool": TrackAOp(_pool_support),
    "ConvTranspose": TrackAOp(_convt_support),
    "Concat": TrackAOp(_concat_support, launches=False),
}


def track_a_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """None when a Track A kernel takes ``node``, else why not: the one question lower_track_a and
    `partition: auto` both ask (the segment-level conditions, a Relu right after its Conv and a
    Concat's producers in its segment, are lower_track_a's)."""
    op = TRACK_A_SUPPORT.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if op is None:
        return "no hand-written kernel"
    dtype = ctx.specs[node.output[0]][1]
    if dtype not in ("float16", "float32"):
        return f"dtype {dtype}"
    if node.input[0] in ctx.constant:
        return "input computed from constants alone (not batch-major)"
    return op.check(node, ctx)


class TrackARefusal(PartitionError):
    """lower_track_a cannot lower a node of a Track A segment; ``node`` and ``why`` say which and why."""

    def __init__(self, message: str, *, node: str, why: str) -> None:
        super().__init__(message)
        self.node, self.why = node, why


def lower_track_a(
    seg: list[onnx.NodeProto],
    model: onnx.ModelProto,
    specs: dict,
    boundary_outputs: set[str],
    ctx: SupportContext | None = None,
) -> list[KernelCall]:
    """Match a Track A segment's nodes to hand-written kernel calls (Conv[+Relu], MaxPool,
    ConvTranspose) and buffer aliases (Concat). ``ctx``: the model's, where the caller has it."""
    ctx = ctx or SupportContext.of(model, specs)
    uses, graph_outputs = ctx.uses, ctx.graph_outputs
    calls: list[KernelCall] = []
    i = 0

    def refuse(node: onnx.NodeProto, why: str) -> TrackARefusal:
        return TrackARefusal(
            f"node '{node.name}' ({node.op_type}, {why}) is on Track A, whose kernels cover {TRACK_A_DESCRIPTION}; "
            f"move it to Track B with partition.track_b.name_prefixes: ['{node.name}']",
            node=node.name,
            why=why,
        )

    while i < len(seg):
        node = seg[i]
        why = track_a_support(node, ctx)
        if why:
            raise refuse(node, why)
        weights = tuple(w for w in node.input[1:] if w) if node.op_type in ("Conv", "ConvTranspose") else ()
        if node.op_type == "Conv":
            out = node.output[0]
            relu = 0
            nxt = seg[i + 1] if i + 1 < len(seg) else None
            if (
                nxt is not None
                and nxt.op_type == "Relu"
                and list(nxt.input) == [out]
                and uses[out] == 1
                and out not in graph_outputs
                and out not in boundary_outputs
            ):
                relu, out, covered = 1, nxt.output[0], (node.name, nxt.name)
                i += 1
            else:
                covered = (node.name,)
            op = "conv1x1" if specs[weights[0]][0][2:] == (1, 1) else "conv3x3"
            calls.append(KernelCall(op, (node.input[0],), (out,), weights, (("relu", relu),), covered))
        elif node.op_type == "MaxPool":
            calls.append(KernelCall("maxpool2x2", (node.input[0],), (node.output[0],), (), (), (node.name,)))
        elif node.op_type == "ConvTranspose":
            calls.append(KernelCall("convt2x2", (node.input[0],), (node.output[0],), weights, (), (node.name,)))
        elif node.op_type == "Concat":
            # No kernel: the producers write straight into channel slices of the output buffer
            # (the channel axis is _concat_support's check).
            produced = {t for c in calls for t in c.outputs}
            for x in node.input:
                if x not in produced or x in boundary_outputs or x in graph_outputs:
                    raise refuse(node, f"input '{x}' is not produced by a Track A kernel of this segment")
                if sum(1 for c in calls if c.op == "concat" and x in c.inputs):
                    raise refuse(node, f"input '{x}' already feeds another concatenation")
            calls.append(KernelCall("concat", tuple(node.input), (node.output[0],), (), (), (node.name,)))
        elif node.op_type == "Relu":
            raise refuse(node, "a Relu whose Conv does not run right before it in this segment")
        else:
            raise refuse(node, "no hand-written kernel")
        i += 1
    return calls


# -- partition: auto ------------------------------------------------------------------------------
#
# 1. Every node a Track A kernel takes (track_a_support) starts on Track A; a node that reads the
#    model's input or writes its output stays on Track B (Track A works in NHWC); rules override.
# 2. Segments are cut (order_segments) and every Track A segment lowered (lower_track_a); a node it
#    refuses (a Relu its Conv no longer precedes, a Concat whose input leaves the segment) moves to
#    Track B, and the segments are cut again.
# 3. Then, greedily, a Track A segment whose move to Track B lowers the plan's estimated time moves
#    (dualtrack.cost: node times plus one switch cost per segment boundary), the one that saves the
#    least on Track A first; back to 2.
# Nodes only ever move from A to B (Track B takes every op), so this ends within one pass per node.
# Greedy, not optimal: an island is moved whole or not at all, which is the choice the switch cost
# is about; trimming single nodes off an island's edge is not tried.


def _node_costs(
    model: onnx.ModelProto, ctx: SupportContext, batch_sizes: tuple[int, ...], measured: cost.MeasuredTimes | None
) -> dict[str, cost.NodeCost]:
    out = {}
    inits = set(ctx.inits)
    for n in model.graph.node:
        why = track_a_support(n, ctx)
        op = TRACK_A_SUPPORT.get(n.op_type)
        on_a = why if why else "fused" if op is not None and not op.launches else None
        out[n.name] = cost.node_cost(n, ctx.specs, inits, batch_sizes, on_a=on_a, measured=measured)
    return out


def _cost_note(switch: float, costs: dict[str, cost.NodeCost], cfg: BuildConfig) -> str:
    n_measured = sum(c.source == "measured" for c in costs.values())
    source = (
        f"{n_measured} conv(s) measured (the `tuning:` records), the rest the default model"
        if n_measured
        else "the default model (dualtrack.cost: H200 rooflines)"
    )
    given = (
        "partition.switch_cost_us"
        if cfg.partition.switch_cost_us is not None
        else "the default runtime path, Track B replayed in one CUDA graph; 80 through the IREE runtime"
    )
    return f"costs: {source}, summed over batch sizes {list(cfg.batch_sizes)}; {switch:g} us per track switch ({given})"


def _first_refusal(
    model: onnx.ModelProto,
    ctx: SupportContext,
    segments: list[list[onnx.NodeProto]],
    tracks: dict[str, str],
    seen: dict[tuple[tuple[str, ...], frozenset[str]], TrackARefusal | None],
) -> TrackARefusal | None:
    """The first node a Track A segment cannot lower; ``seen`` remembers segments already lowered
    (a segment that did not change lowers the same way)."""
    bounds = _boundaries(model, segments)
    for seg, b in zip(segments, bounds, strict=True):
        if tracks[seg[0].name] != "A":
            continue
        key = (tuple(n.name for n in seg), frozenset(b.outputs))
        if key not in seen:
            try:
                lower_track_a(seg, model, ctx.specs, set(b.outputs), ctx)
                seen[key] = None
            except TrackARefusal as refusal:
                seen[key] = refusal
        if seen[key] is not None:
            return seen[key]
    return None


def auto_tracks(
    model: onnx.ModelProto,
    cfg: BuildConfig,
    ctx: SupportContext,
    costs: dict[str, cost.NodeCost],
    switch: float,
) -> Assignment:
    """`partition: auto` (the steps are at the top of this section), on the nodes' ``costs``."""
    nodes = list(model.graph.node)
    part = cfg.partition
    model_in = {i.name for i in model.graph.input}
    tracks: dict[str, str] = {}
    why: dict[str, str] = {}
    forced_a: set[str] = set()
    for n in nodes:
        rule_b, rule_a = _rule(n, part.track_b, "track_b"), _rule(n, part.track_a, "track_a")
        reason = track_a_support(n, ctx)
        if rule_b:
            tracks[n.name], why[n.name] = "B", rule_b
        elif rule_a:
            tracks[n.name], why[n.name] = "A", rule_a
            forced_a.add(n.name)
        elif reason:
            tracks[n.name], why[n.name] = "B", f"not a Track A node: {reason}"
        elif any(x in model_in for x in n.input) or any(o in ctx.graph_outputs for o in n.output):
            tracks[n.name], why[n.name] = "B", "reads or writes the model's own input/output (Track A works in NHWC)"
        else:
            launches = TRACK_A_SUPPORT[n.op_type].launches
            tracks[n.name], why[n.name] = (
                "A",
                "a Track A kernel takes it" + ("" if launches else " (no launch of its own)"),
            )
    batches = len(cfg.batch_sizes)

    def estimate(trial: dict[str, str], n_segments: int) -> float:
        return cost.plan_us((costs[n].on(t) for n, t in trial.items()), n_segments, switch, batches)

    moves: list[str] = []
    lowered: dict[tuple[tuple[str, ...], frozenset[str]], TrackARefusal | None] = {}
    while True:
        segments = order_segments(model, tracks)
        refusal = _first_refusal(model, ctx, segments, tracks, lowered)
        if refusal is not None:
            if refusal.node in forced_a:
                raise refusal  # the config's rule put it there; the message names the fix
            tracks[refusal.node], why[refusal.node] = "B", f"Track A cannot lower it in its segment: {refusal.why}"
            continue
        now = estimate(tracks, len(segments))
        islands = [s for s in segments if tracks[s[0].name] == "A" and not any(n.name in forced_a for n in s)]
        # Tried in the order of what they would save if each took its two switches with it (an island
        # inside Track B does); the first that really lowers the estimate moves. Cutting the segments
        # for every island on every round would cost islands^2 cuts.
        islands.sort(key=lambda s: sum(costs[n.name].on("B") - costs[n.name].on("A") for n in s))
        best: tuple[list[onnx.NodeProto], int] | None = None
        for seg in islands:
            trial = {**tracks, **{n.name: "B" for n in seg}}
            n_after = len(order_segments(model, trial))
            if estimate(trial, n_after) < now:
                best = (seg, len(segments) - n_after)
                break
        if best is None:
            break
        seg, fewer = best
        saving = sum(costs[n.name].on("B") - costs[n.name].on("A") for n in seg)
        island = f"island {seg[0].name} .. {seg[-1].name} ({len(seg)} nodes)"
        because = (
            f"on Track A it saves {saving:.1f} us, less than the {fewer * switch * batches:.1f} us of the "
            f"{fewer} track switch(es) it costs"
            if saving > 0
            else f"it is {-saving:.1f} us faster on Track B"
        )
        moves.append(f"moved the {island} to Track B: {because}")
        for n in seg:
            tracks[n.name], why[n.name] = "B", f"moved to Track B with its {island}: {because}"
    decisions = tuple(
        Decision(n.name, n.op_type, tracks[n.name], why[n.name], costs[n.name].a_us, costs[n.name].b_us) for n in nodes
    )
    notes = ("partition: auto", _cost_note(switch, costs, cfg), *moves)
    return Assignment(tracks, decisions, notes, switch, cfg.batch_sizes)


def _nhwc(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[2], shape[3], shape[1])


def extract_segment(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    *,
    nhwc: bool = False,
) -> onnx.ModelProto:
    """The segment as a standalone ONNX model (function `main`, dynamic batch `N`).

    NHWC boundary tensors get a Transpose to the model's NCHW on the way in and back on the way out;
    ``nhwc``: then sink those (and the model's own) transposes as far as the ops allow
    (:func:`layout.sink_transposes`).
    """
    rename: dict[str, str] = {}
    pre: list[onnx.NodeProto] = []
    post: list[onnx.NodeProto] = []
    for t in inputs:
        if t.layout == "NHWC":
            rename[t.name] = f"{t.name}__nchw"
            pre.append(
                helper.make_node("Transpose", [t.name], [rename[t.name]], name=f"{t.name}__to_nchw", perm=_TO_NCHW)
            )
    out_rename: dict[str, str] = {}
    for t in outputs:
        if t.layout == "NHWC":
            out_rename[t.name] = f"{t.name}__nchw"
            post.append(
                helper.make_node("Transpose", [out_rename[t.name]], [t.name], name=f"{t.name}__to_nhwc", perm=_TO_NHWC)
            )
    body = []
    for n in nodes:
        n2 = copy.deepcopy(n)
        for j, x in enumerate(n2.input):
            n2.input[j] = out_rename.get(x, rename.get(x, x))
        for j, x in enumerate(n2.output):
            n2.output[j] = out_rename.get(x, x)
        body.append(n2)
    used = {x for n in nodes for x in n.input}
    inits = [copy.deepcopy(i) for i in model.graph.initializer if i.name in used]

    def vi(t: TensorSpec) -> onnx.ValueInfoProto:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
        return helper.make_tensor_value_info(t.name, elem, ["N", *t.shape[1:]])

    graph = helper.make_graph(pre + body + post, "main", [vi(t) for t in inputs], [vi(t) for t in outputs], inits)
    seg = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="dualtrack")
    seg.ir_version = model.ir_version
    if nhwc:
        seg = layout.widen_elementwise(layout.sink_transposes(seg))
    onnx.checker.check_model(seg)
    return seg


def strip_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph without weight data (the bundle keeps weights once, in model.onnx)."""
    m = copy.deepcopy(model)
    del m.graph.initializer[:]
    return m


def attach_initializers(graph_only: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Inverse of strip_initializers: add back the initializers the graph's nodes use."""
    m = copy.deepcopy(graph_only)
    used = {x for n in m.graph.node for x in n.input}
    m.graph.initializer.extend(numpy_helper.from_array(weights[k], k) for k in sorted(used & weights.keys()))
    return m


def model_hash(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


@dataclass(frozen=True)
class Partitioned:
    """A partitioned model: the plan, one ONNX model per segment, and the per-node decisions."""

    plan: Plan
    seg_models: list[onnx.ModelProto]
    assignment: Assignment

    def report(self) -> dict[str, object]:
        """What the bundle's `partition.json` holds: the plan's partition notes and every node's decision."""
        return {"notes": list(self.plan.notes), "nodes": [d.to_json() for d in self.assignment.decisions]}


def build_plan(
    cfg: BuildConfig, model: onnx.ModelProto, measured: cost.MeasuredTimes | None = None
) -> tuple[Plan, list[onnx.ModelProto]]:
    """Partition a (named) model into a Plan plus one ONNX model per segment (:func:`partition_model`)."""
    p = partition_model(cfg, model, measured)
    return p.plan, p.seg_models


def partition_model(
    cfg: BuildConfig, model: onnx.ModelProto, measured: cost.MeasuredTimes | None = None
) -> Partitioned:
    """Partition a (named) model: the plan, whose notes say how it was chosen, the segment models and
    the decision behind every node. ``measured``: see :func:`assign_tracks`."""
    if len(model.graph.input) != 1:
        raise ModelError(f"the model has {len(model.graph.input)} inputs; dualtrack serves single-input models")
    specs = batch_checked_specs(model, (1, *cfg.batch_sizes))
    _check_input(cfg, model, specs)
    assignment = assign_tracks(model, cfg, specs, measured)
    tracks = assignment.tracks
    segments = order_segments(model, tracks)
    bounds = _boundaries(model, segments)
    seg_track = [tracks[s[0].name] for s in segments]
    free = batch_free(model)
    for k, b in enumerate(bounds):
        crossing = [t for t in b.outputs if t in free]
        if crossing:
            raise PartitionError(
                f"'{crossing[0]}' is a constant or shape value (computed from weights, constants or Shape; not "
                f"batch-major) that would leave segment {k} for another track; keep its producers and consumers on "
                "one track (partition rules), or leave `simplify` on to fold it"
            )
    graph_io = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}

    # NHWC wherever Track A is on either side of a boundary.
    touches_a: set[str] = set()
    for k, b in enumerate(bounds):
        if seg_track[k] == "A":
            touches_a.update(b.inputs, b.outputs)
    for k, b in enumerate(bounds):
        if seg_track[k] == "A":
            for t in b.inputs + b.outputs:
                if t in graph_io:
                    raise PartitionError(
                        f"Track A would read or write the model's own input/output '{t}' directly; "
                        "Track A works in NHWC, "
                        "so keep the first and last ops on Track B (narrow partition.track_a)"
                    )

    def spec(name: str) -> TensorSpec:
        shape, dtype = specs[name]
        if name in touches_a and len(shape) == 4:
            return TensorSpec(name, _nhwc(shape), dtype, "NHWC")
        return TensorSpec(name, shape, dtype, "")  # as the model has it (ONNX does not record layouts)

    plan_segments: list[Segment] = []
    seg_models: list[onnx.ModelProto] = []
    for k, (nodes, b) in enumerate(zip(segments, bounds, strict=True)):
        ins, outs = [spec(t) for t in b.inputs], [spec(t) for t in b.outputs]
        seg_model = extract_segment(model, nodes, ins, outs, nhwc=seg_track[k] == "B" and cfg.track_b.nhwc)
        calls: tuple[KernelCall, ...] = ()
        tensors: tuple[TensorSpec, ...] = ()
        if seg_track[k] == "A":
            calls = tuple(lower_track_a(nodes, model, specs, set(b.outputs)))
            boundary = {t.name for t in ins + outs}
            inner = [t for c in calls for t in c.outputs if t not in boundary]
            tensors = tuple(TensorSpec(t, _nhwc(specs[t][0]), specs[t][1], "NHWC") for t in inner)
        track = seg_track[k]
        plan_segments.append(
            Segment(
                index=k,
                track=track,  # type: ignore[arg-type]
                nodes=tuple(n.name for n in nodes),
                inputs=tuple(ins),
                outputs=tuple(outs),
                onnx=f"segments/seg{k}_{track}.onnx",
                key=model_hash(seg_model),
                calls=calls,
                tensors=tensors,
            )
        )
        seg_models.append(seg_model)
    model_inputs = tuple(spec(i.name) for i in model.graph.input)
    model_outputs = tuple(spec(o.name) for o in model.graph.output)
    precision = cfg.precision or model_precision(model)
    plan = Plan(
        model_inputs,
        model_outputs,
        tuple(plan_segments),
        precision,
        cfg.batch_sizes,
        notes=_notes(assignment, seg_track),
    )
    return Partitioned(plan, seg_models, assignment)


def _notes(assignment: Assignment, seg_track: list[str]) -> tuple[str, ...]:
    """The plan's notes: how the partition was chosen, the plan in one line, and each node's reason."""
    waits = sum(1 for k in range(len(seg_track) - 1) if seg_track[k] == "A" and seg_track[k + 1] == "B")
    all_b = sum(d.b_us for d in assignment.decisions)
    plan_line = (
        f"plan: {len(seg_track)} segment(s) ({' '.join(seg_track)}); host waits per inference: none where every "
        f"Track B module replays (FACTS 23), else {waits} (one per Track A -> Track B hand-over, FACTS 8); "
        f"estimated {assignment.estimate_us(len(seg_track)):.0f} us (Track B alone: {all_b:.0f} us)"
    )
    return (*assignment.notes, plan_line, *assignment.grouped())


def _check_input(cfg: BuildConfig, model: onnx.ModelProto, specs: dict) -> None:
    inp = model.graph.input[0]
    shape, dtype = specs[inp.name]
    want = cfg.input
    if want.name is not None and want.name != inp.name:
        raise PartitionError(
            f"input.name is '{want.name}' but the model's input is '{inp.name}'; fix `input.name` in the config"
        )
    if want.shape is not None and tuple(want.shape[1:]) != tuple(shape[1:]):
        raise PartitionError(
            f"input.shape {list(want.shape)} does not match the model's input {list(shape)} (batch excluded); "
            "fix `input.shape`"
        )
    if want.dtype is not None and want.dtype != dtype:
        raise PartitionError(f"input.dtype is {want.dtype} but the model's input is {dtype}; fix `input.dtype`")


def plan_config(cfg: BuildConfig, measured: cost.MeasuredTimes | None = None) -> tuple[Plan, list[onnx.ModelProto]]:
    """The plan of a config's model as the build makes it: through the front end, then partitioned
    (``measured``: the tuning file's Track A times, as `dualtrack build` passes them to
    `partition: auto`'s cost model; without them the default model decides)."""
    cfg, fe = frontend.load(cfg)
    return build_plan(cfg, name_nodes(fe.model), measured)
