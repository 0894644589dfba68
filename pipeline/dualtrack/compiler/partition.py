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
import textwrap
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler import (
    act_patterns,
    attention_patterns,
    cost,
    frontend,
    layout,
    lower_head,
    lower_mobile,
    lower_norm,
    lower_pad,
)
from dualtrack.compiler.batch_free import with_batch
from dualtrack.compiler.config import FIXED_BATCH, BuildConfig, Rules
from dualtrack.compiler.frontend import model_precision
from dualtrack.compiler.onnx_graph import infer_shapes, name_nodes
from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import MODEL_LAYOUT_OPS, POOL_MODES, KernelCall, Plan, Segment, TensorSpec
from dualtrack.errors import ModelError, PartitionError, UnsupportedOpError
from dualtrack.kernels import ConvGeometry, PoolGeometry

TRACK_A_DESCRIPTION = (
    "Conv of any kernel size, stride, dilation, padding and group count (optionally +Add of a residual "
    "+Relu/Clip(0,6)/HardSwish/HardSigmoid/Sigmoid/SiLU), MaxPool and AveragePool of any window up to "
    f"{kernels.maxpool.MAX_KERNEL}x{kernels.maxpool.MAX_KERNEL} (no Indices output), ConvTranspose of any window, "
    f"{lower_pad.DESCRIPTION}, "
    f"the mobile ops: {lower_mobile.DESCRIPTION}; and {lower_head.DESCRIPTION}"
    f"; the normalisation family: {lower_norm.DESCRIPTION}"
    f"; {attention_patterns.DESCRIPTION}"
)
# A 1x1 conv with at most this many output channels (a segmentation head of a few classes) runs
# conv1x1, one thread per pixel and one pass over x (its k_group); wider ones are GEMMs for the general
# conv. Up to 16 measured 341 us for MobileNetV2's 32 -> 16 1x1 at 256x256, N=8, on the H100, about 20x
# its bytes' time: four passes over x (kernel_profile-6fba64a-s9mobile-h100.json).
CONV1X1_MAX_K = kernels.KERNELS["conv1x1"].k_group  # type: ignore[attr-defined]
# A fp16 3x3 conv with at most ConvGeneralSpec.direct_k output channels on an image of at least this
# many pixels runs the general conv's direct entry instead of conv3x3's tiles: measured on smp
# Unet-resnet34's head (16 -> 2 channels at 512x512, kernel_profile-e75130f: conv3x3's narrow tile
# 273 us at N=8); smaller images keep the tiles (not measured there).
DIRECT_MIN_PIXELS = 128 * 128
_TO_NCHW, _TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def _dtype(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


SpecMap = tuple[tuple[int, ...], str]


def infer_specs(model: onnx.ModelProto, batch: int = 1) -> dict[str, SpecMap]:
    """Static shape and dtype of every tensor at a given batch size."""
    try:
        inferred = infer_shapes(with_batch(model, batch), strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as e:
        raise ModelError(
            f"ONNX shape inference failed at batch {batch}: {str(e).splitlines()[0]}; the export may have its batch "
            "written into a shape, or hold data rather than images in dim 0 (dualtrack runs a model image by image "
            "along dim 0): re-export with a dynamic batch, build only the batch sizes it takes, or set "
            f"`{FIXED_BATCH}` to build the exported shape whole"
        ) from None
    g = inferred.graph
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
        specs[vi.name] = (dims, _dtype(t.elem_type))
    for init in model.graph.initializer:
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


def batch_checked_specs(
    model: onnx.ModelProto, batch_sizes: tuple[int, ...] = (1, 2), fixed: bool = False
) -> tuple[dict[str, SpecMap], dict[str, str]]:
    """Specs at batch 1, and the tensors that carry the batch but not as dim 0 (a transformer's
    ``(B * heads, T, d)``, ``(2, B, heads, T, d)``) with their shapes: only Track B may touch those and no
    segment boundary may cut one (:func:`_check_batch_major_boundaries`). Constants and shape values
    are exempt (:func:`batch_free`). ``fixed`` (`batch: fixed`): dim 0 is data, so no tensor is batch-major and
    none is checked."""
    one = infer_specs(model, 1)
    if fixed:
        return one, {}
    minor: dict[str, str] = {}
    free = batch_free(model)
    carried = {name: shape for name, (shape, _) in one.items() if name not in free}
    for name, shape in carried.items():
        if -1 in shape:
            raise PartitionError(
                f"tensor '{name}' has a shape ONNX cannot infer statically ({shape}){_first_open(model, one)}; "
                "export the model with static shapes"
            )
    for name, shape in carried.items():  # at batch 1 dim 0 is 1, whatever else is built (a (N*L,) view is not)
        if not shape or shape[0] != 1:
            minor[name] = f"batch 1: {shape}"
    for b in sorted(set(batch_sizes) - {1}):
        other = infer_specs(model, b)
        for name, shape in carried.items():
            got = other.get(name, (None,))[0]
            if name in minor:
                continue
            if not got or got[0] != b * shape[0] or got[1:] != shape[1:]:
                minor.setdefault(name, f"batch 1: {shape}, batch {b}: {got}")
    return one, minor


def _first_open(model: onnx.ModelProto, specs: dict[str, SpecMap]) -> str:
    """Where static shapes stop: the first node whose inputs all have static shapes and an output does not
    (a Range whose limit is computed from other values, say: ONNX's inference does not fold it), as a
    clause for the error; empty where none is found."""
    for node in model.graph.node:
        known = all(x and x in specs and -1 not in specs[x][0] for x in node.input if x)
        if known and any(-1 in specs.get(y, ((-1,), ""))[0] for y in node.output if y):
            return f": shape inference stops at node '{node.name}' ({node.op_type}), whose output size it cannot tell"
    return ""


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
class TrackDecision:
    """Where one node runs and why; its estimated time on each track (us, summed over the batch
    sizes: `dualtrack.compiler.cost`), ``a_us`` None where no Track A kernel takes it."""

    node: str
    op: str
    track: str  # "A" or "B"
    why: str
    a_us: float | None
    b_us: float
    flops: float = 0.0  # at batch 1 (dualtrack.compiler.cost.node_work)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


GROUP_NAMES = 8  # node names a plan note lists per (track, reason)


@dataclass(frozen=True)
class Assignment:
    """The track of every node, why, and what the partition says about itself (mode, costs, moves)."""

    tracks: dict[str, str]
    decisions: tuple[TrackDecision, ...]  # in graph order
    notes: tuple[str, ...]
    switch_us: float  # per track switch and batch size, as the estimate charges it
    batch_sizes: tuple[int, ...]

    def estimate_us(self, n_segments: int) -> float:
        """The plan's estimated time (us, summed over the batch sizes) with ``n_segments`` segments."""
        per_node = ((d.a_us or 0.0) if d.track == "A" else d.b_us for d in self.decisions)
        return cost.plan_us(per_node, n_segments, self.switch_us, len(self.batch_sizes))

    def iree_alone_us(self) -> float:
        """IREE alone's estimate: every node's Track B time, one segment (what step 4 compares with)."""
        return cost.plan_us((d.b_us for d in self.decisions), 1, self.switch_us, len(self.batch_sizes))

    def track_a_flop_share(self) -> float:
        """The fraction of the model's FLOPs (batch 1) that its Track A nodes compute."""
        total = sum(d.flops for d in self.decisions)
        return sum(d.flops for d in self.decisions if d.track == "A") / total if total else 0.0

    def by_op(self) -> list[str]:
        """One line per op type: how many of its nodes run on each track and, for Track B, why (the
        reasons reduced to their kind, so a model's 40 refused Pads read as one reason)."""
        per_op: dict[str, dict[str, list[str]]] = {}
        for d in self.decisions:
            per_op.setdefault(d.op, {"A": [], "B": []})[d.track].append(_reason_kind(d.why))
        lines = []
        for op, tracks in sorted(per_op.items(), key=lambda kv: (-len(kv[1]["B"]), kv[0])):
            line = f"ops: {op}: {len(tracks['A'])} on Track A, {len(tracks['B'])} on Track B"
            kinds: dict[str, int] = {}
            for k in tracks["B"]:
                kinds[k] = kinds.get(k, 0) + 1
            if kinds:
                line += " (" + "; ".join(f"{n}x {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])) + ")"
            lines.append(line)
        return lines

    def grouped(self, most: int = GROUP_NAMES) -> list[str]:
        """One line per (track, reason): the nodes it holds, in graph order, the first ``most`` by
        name (the bundle's partition.json lists every node)."""
        groups: dict[tuple[str, str], list[str]] = {}
        for d in self.decisions:
            groups.setdefault((d.track, d.why), []).append(d.node)
        lines = []
        for (t, why), ns in groups.items():
            more = f" and {len(ns) - most} more (partition.json lists them)" if len(ns) > most else ""
            lines.append(f"Track {t} ({len(ns)}): {why}: {', '.join(ns[:most])}{more}")
        return lines


def _reason_kind(why: str) -> str:
    """A Track B node's reason without what names one node (its island, its shapes' details)."""
    for prefix, kind in (
        ("moved to Track B with its island", "its Track A island is not worth its track switches"),
        ("moved to Track B with the whole plan", "IREE alone is predicted faster"),
        ("Track A cannot lower it in its segment", "Track A cannot lower it in its segment"),
    ):
        if why.startswith(prefix):
            return kind
    why = why.removeprefix("not a Track A node: ")
    return textwrap.shorten(why.split(" (")[0], 100, placeholder=" ...")  # whole words: `info` prints it


def assign_tracks(
    model: onnx.ModelProto,
    cfg: BuildConfig,
    specs: dict[str, SpecMap],
    measured: cost.MeasuredTimes | None = None,
    ctx: SupportContext | None = None,
    keep_a: Mapping[str, str] | None = None,
) -> Assignment:
    """Track per node. ``partition.mode: rules``: Track B rules win, then Track A rules, then Track B
    (the default). ``auto``: :func:`auto_tracks`, with the rules as overrides. ``measured``: Track A
    kernel times from a tuning file (`dualtrack.compiler.tuned.measured_times`) for the cost model; ``ctx``:
    the model's :class:`SupportContext`, where the caller has it; ``keep_a``: nodes ``auto`` keeps on
    Track A where a kernel takes them, whatever their cost, and why (IREE could not compile them)."""
    nodes = list(model.graph.node)
    _check_rules(nodes, cfg)
    part = cfg.partition
    switch = part.switch_cost_us if part.switch_cost_us is not None else cost.SWITCH_COST_US[cost.DEFAULT_PATH]
    ctx = ctx or SupportContext.of(model, specs)
    first = cfg.targets[0] if cfg.targets else None
    costs = _node_costs(model, ctx, cfg.batch_sizes, measured, _target_rates(cfg), cost.ConvTarget.of(first))
    flops = {n.name: cost.node_work(n, ctx.specs, set(ctx.inits)).flops for n in nodes}
    if part.mode == "auto":
        return _with_flops(auto_tracks(model, cfg, ctx, costs, switch, keep_a or {}), flops)
    tracks: dict[str, str] = {}
    decisions = []
    for n in nodes:
        rule_b, rule_a = _rule(n, part.track_b, "track_b"), _rule(n, part.track_a, "track_a")
        if part.mode == "iree":
            track, why = "B", "partition: iree (IREE alone)"
        else:
            track, why = ("B", rule_b) if rule_b else ("A", rule_a) if rule_a else ("B", "no rule puts it on Track A")
        tracks[n.name] = track
        decisions.append(TrackDecision(n.name, n.op_type, track, why, costs[n.name].a_us, costs[n.name].b_us))
    head = (
        "partition: iree, every node on Track B"
        if part.mode == "iree"
        else "partition: hand-written rules (partition.track_a / track_b)"
    )
    notes = (head, _cost_note(switch, costs, cfg))
    return _with_flops(Assignment(tracks, tuple(decisions), notes, switch, cfg.batch_sizes), flops)


def _with_flops(a: Assignment, flops: Mapping[str, float]) -> Assignment:
    decisions = tuple(replace(d, flops=flops[d.node]) for d in a.decisions)
    return replace(a, decisions=decisions)


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


def recompute_constants(
    model: onnx.ModelProto, segments: list[list[onnx.NodeProto]], tracks: Mapping[str, str]
) -> tuple[list[list[onnx.NodeProto]], list[str]]:
    """Segments in which a constant the graph computes (:func:`batch_free`: a ConstantOfShape, a
    Shape chain the front end did not fold) is computed again by every Track B segment that reads it,
    instead of crossing a boundary: the tracks hand over tensors per batch, and such a tensor has no
    batch. The copies keep their node names (the same node, run twice); a producer left with no
    reader in its own segment is dropped, and a segment left empty goes, its neighbours joined.
    Returns the segments and each one's track (a copy's own track may be the other one)."""
    free = batch_free(model)
    producer = {o: n for n in model.graph.node for o in n.output if o}
    out = []
    seg_tracks = [tracks[seg[0].name] for seg in segments]
    for seg, track in zip(segments, seg_tracks, strict=True):
        made = {o for n in seg for o in n.output}
        wanted = [x for n in seg for x in n.input if x in free and x not in made]
        clones = _producers(wanted, producer, free, made) if track == "B" else []
        out.append(clones + list(seg))
    return _drop_unread_constants(model, out, free, seg_tracks)


def _producers(
    tensors: list[str], producer: Mapping[str, onnx.NodeProto], free: set[str], made: set[str]
) -> list[onnx.NodeProto]:
    """The nodes that compute ``tensors`` from constants (and Shape), in topological order, less
    those whose outputs are in ``made``."""
    order: list[onnx.NodeProto] = []
    todo = list(tensors)
    seen: set[str] = set()
    while todo:
        t = todo.pop()
        n = producer.get(t)
        if n is None or t in made or n.name in seen:
            continue
        seen.add(n.name)
        order.append(n)
        todo += [x for x in n.input if x in free]
    position = {id(n): i for i, n in enumerate(producer.values())}
    return sorted(order, key=lambda n: position.get(id(n), 0))


def _drop_unread_constants(
    model: onnx.ModelProto, segments: list[list[onnx.NodeProto]], free: set[str], seg_tracks: list[str]
) -> tuple[list[list[onnx.NodeProto]], list[str]]:
    """Drop a node computing constants that no reader needs from its segment (every other segment
    that reads them computes them itself); then drop empty segments and join same-track neighbours."""
    keep_out = {o.name for o in model.graph.output}
    changed = True
    while changed:
        changed = False
        for k, seg in enumerate(segments):
            read_here = {x for n in seg for x in n.input}
            others = [s for j, s in enumerate(segments) if j != k]
            for n in list(seg):
                outs = [o for o in n.output if o]
                idle = bool(outs) and all(o in free and o not in keep_out and o not in read_here for o in outs)
                if idle and all(_computes(s, outs) for s in others if _reads(s, outs)):
                    segments[k] = seg = [m for m in seg if m is not n]  # by identity: a copy is equal to it
                    changed = True
    merged: list[list[onnx.NodeProto]] = []
    merged_tracks: list[str] = []
    for seg, track in zip(segments, seg_tracks, strict=True):
        if not seg:
            continue
        if merged_tracks and merged_tracks[-1] == track:
            merged[-1].extend(seg)
        else:
            merged.append(list(seg))
            merged_tracks.append(track)
    return merged, merged_tracks


def _reads(seg: list[onnx.NodeProto], tensors: list[str]) -> bool:
    return any(x in tensors for n in seg for x in n.input)


def _computes(seg: list[onnx.NodeProto], tensors: list[str]) -> bool:
    return all(any(t in n.output for n in seg) for t in tensors)


@dataclass(frozen=True)
class _Boundaries:
    inputs: list[str]
    outputs: list[str]


def _boundaries(model: onnx.ModelProto, segments: list[list[onnx.NodeProto]]) -> list[_Boundaries]:
    inits = {i.name for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    # Which segments read a tensor they do not compute themselves (recompute_constants gives some
    # segments their own copy of a constant's producers).
    consumers: dict[str, set[int]] = defaultdict(set)
    for k, seg in enumerate(segments):
        made = {o for n in seg for o in n.output}
        for n in seg:
            for i in n.input:
                if i and i not in made:
                    consumers[i].add(k)
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
    """None when a Conv is one the fixed-shape Track A kernels take (conv3x3: 3x3 with padding 1,
    conv1x1: 1x1 without); the general conv takes the rest (:func:`conv_geometry`)."""
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


def _attrs(node: onnx.NodeProto) -> dict:
    return {x.name: helper.get_attribute_value(x) for x in node.attribute}


def _window_pads(
    a: dict, x_shape: tuple[int, ...], kernel: list[int], strides: list[int], dilations: list[int]
) -> tuple[list[int] | None, str | None]:
    """The (top, left, bottom, right) pads of a 2-D Conv's or pool's window as ONNX defines them
    (``auto_pad`` resolved against the input size), or (None, why) for an ``auto_pad`` it has not."""
    pads = [int(v) for v in a.get("pads", [0, 0, 0, 0])]
    auto_pad = a.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        return [0, 0, 0, 0], None
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        # ONNX: output = ceil(input / stride); the odd pixel of padding goes last (UPPER) or first.
        totals = [
            max((-(-size // st) - 1) * st + (k - 1) * d + 1 - size, 0)
            for size, st, k, d in zip(x_shape[2:], strides, kernel, dilations, strict=True)
        ]
        first = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
        return [first[0], first[1], totals[0] - first[0], totals[1] - first[1]], None
    if auto_pad != "NOTSET":
        return None, f"auto_pad {auto_pad}"
    return pads, None


def conv_geometry(node: onnx.NodeProto, specs: dict) -> tuple[ConvGeometry | None, int, str | None]:
    """(geometry, group, None) of a 2-D Conv as ONNX defines it (``auto_pad`` resolved against the
    input size), or (None, group, why not) for one that is not 2-D or whose attributes are unknown."""
    a = _attrs(node)
    w_shape, x_shape = specs[node.input[1]][0], specs[node.input[0]][0]
    group = int(a.get("group", 1))
    if len(w_shape) != 4 or len(x_shape) != 4:
        return None, group, f"a {len(w_shape) - 2}-D convolution (Track A takes 2-D)"
    R, S = (int(v) for v in a.get("kernel_shape", w_shape[2:]))
    sh, sw = (int(v) for v in a.get("strides", [1, 1]))
    dh, dw = (int(v) for v in a.get("dilations", [1, 1]))
    pads, why = _window_pads(a, x_shape, [R, S], [sh, sw], [dh, dw])
    if pads is None:
        return None, group, why
    return ConvGeometry(R, S, sh, sw, dh, dw, *pads, groups=group), group, None


def pool_geometry(node: onnx.NodeProto, specs: dict) -> tuple[PoolGeometry | None, str | None]:
    """(window, None) of a 2-D MaxPool or AveragePool as ONNX defines it (its mode one of
    ``plan.POOL_MODES``), or (None, why not): not 2-D, an Indices output, or attributes the kernels
    do not know."""
    a = _attrs(node)
    x_shape = specs[node.input[0]][0]
    if len(x_shape) != 4:
        return None, f"a {len(x_shape) - 2}-D pooling (Track A takes 2-D)"
    if len([o for o in node.output if o]) != 1:
        return None, "an Indices output (Track A computes the values only)"
    kernel = [int(v) for v in a.get("kernel_shape", [])]
    if len(kernel) != 2:
        return None, f"kernel_shape {kernel}"
    strides = [int(v) for v in a.get("strides", [1, 1])]
    dilations = [int(v) for v in a.get("dilations", [1, 1])]
    pads, why = _window_pads(a, x_shape, kernel, strides, dilations)
    if pads is None:
        return None, why
    # storage_order only orders the Indices output, which Track A never computes.
    mode = POOL_MODES["max"]
    if node.op_type == "AveragePool":
        mode = POOL_MODES["avg_include_pad" if a.get("count_include_pad", 0) else "avg_exclude_pad"]
    return PoolGeometry(*kernel, *strides, *dilations, *pads, ceil_mode=int(a.get("ceil_mode", 0)), mode=mode), None


def _constant(name: str, model: onnx.ModelProto) -> np.ndarray | None:
    """The value of an initializer or a Constant node's output, or None."""
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for n in model.graph.node:
        if n.op_type == "Constant" and list(n.output) == [name]:
            value = _attrs(n).get("value")
            return numpy_helper.to_array(value) if value is not None else None
    return None


@dataclass(frozen=True)
class _Epilogue:
    """What a Conv's consumers add to its kernel call: the covered nodes after the Conv, the
    residual tensor, the activation, and the tensor the call writes."""

    nodes: tuple[onnx.NodeProto, ...] = ()
    residual: str | None = None
    act: Activation = field(default_factory=Activation)
    output: str = ""


def _fuse_epilogue(
    conv: onnx.NodeProto,
    model: onnx.ModelProto,
    specs: dict,
    in_seg: set[str],
    private: Callable[[str], bool],
    consumers: dict[str, list[onnx.NodeProto]],
    claimed: set[str],
) -> _Epilogue:
    """The Add (of a same-shaped activation computed elsewhere: a residual) and the activation that
    follow a Conv and can run in its epilogue: each must be in this segment, not yet claimed, and
    the only reader of what it consumes (``private``)."""
    inits = {i.name for i in model.graph.initializer}
    t = conv.output[0]
    nodes: list[onnx.NodeProto] = []
    residual = None

    def sole(name: str) -> onnx.NodeProto | None:
        users = consumers.get(name, [])
        if len(users) == 1 and private(name) and users[0].name in in_seg and users[0].name not in claimed:
            return users[0]
        return None

    nxt = sole(t)
    if nxt is not None and nxt.op_type == "Add" and len(nxt.input) == 2 and t in nxt.input:
        other = nxt.input[1] if nxt.input[0] == t else nxt.input[0]
        if other != t and other not in inits and specs.get(other) == specs.get(t) and _constant(other, model) is None:
            nodes.append(nxt)
            residual, t = other, nxt.output[0]
            nxt = sole(t)
    act = Activation()
    if nxt is not None and len([x for x in nxt.input if x]) >= 1 and nxt.input[0] == t:
        found, _ = lower_mobile.match_activation(nxt, lambda name: _constant(name, model))
        if found is not None:
            nodes.append(nxt)
            act, t = found, nxt.output[0]
    elif (
        found := act_patterns.decomposed(
            t, consumers, lambda n: n.name in in_seg and n.name not in claimed, private, lambda n: _constant(n, model)
        )
    ) is not None:  # SiLU, GELU as the exporters write them
        act, more, t = found
        nodes += more
    return _Epilogue(tuple(nodes), residual, act, t)


# -- which nodes Track A takes: one predicate per op, asked by lower_track_a and by `partition: auto` --


@dataclass(frozen=True)
class SupportContext:
    """What a Track A predicate may look at besides the node: shapes, the graph around it, and the
    epilogue every dense Conv fuses as :func:`_fuse_epilogue` finds it in the whole graph (a segment
    boundary may cut one short: that is lower_track_a's to see)."""

    specs: dict[str, SpecMap]
    inits: frozenset[str]
    producers: Mapping[str, onnx.NodeProto]  # tensor -> the node that computes it
    consumers: Mapping[str, list[onnx.NodeProto]]  # tensor -> the nodes that read it
    uses: Mapping[str, int]  # tensor -> how many node inputs read it
    graph_outputs: frozenset[str]
    constant: frozenset[str]  # batch_free: computed from weights, constants or shapes alone
    facts: lower_mobile.Facts  # the same graph as the mobile ops' predicates see it
    epilogues: Mapping[str, _Epilogue]  # dense Conv -> the Add and activation its call covers
    fused_into: Mapping[str, onnx.NodeProto]  # a node of such an epilogue -> its Conv
    heads: lower_head.Heads  # the segmentation heads the seghead kernel takes, by node
    norms: lower_norm.Norms  # the normalisation chains the norm kernel takes, by node
    minor: frozenset[str] = frozenset()  # tensors that carry the batch outside dim 0 (batch_checked_specs)
    # The attentions the attention kernel takes, by node (attention_patterns).
    attentions: attention_patterns.Attentions = field(default_factory=attention_patterns.Attentions)
    # The multi-node activations no other call takes, by node: one eltwise call each (lower_mobile).
    act_chains: lower_mobile.ActChains = field(default_factory=lower_mobile.ActChains)

    @classmethod
    def of(
        cls, model: onnx.ModelProto, specs: dict[str, SpecMap], minor: frozenset[str] = frozenset()
    ) -> SupportContext:
        uses: dict[str, int] = defaultdict(int)
        consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in model.graph.node:
            for i in n.input:
                uses[i] += 1
                consumers[i].append(n)
        graph_outputs = frozenset(o.name for o in model.graph.output)
        facts = lower_mobile.Facts(model, specs)
        everywhere = {n.name for n in model.graph.node}
        heads = _supported_heads(facts)

        def private(t: str) -> bool:  # segments aside: an intermediate the caller never sees
            return t not in graph_outputs

        epilogues: dict[str, _Epilogue] = {}
        fused_into: dict[str, onnx.NodeProto] = {}
        for n in model.graph.node:
            if n.op_type == "Conv" and not lower_mobile.claims(n, facts):
                ep = _fuse_epilogue(n, model, specs, everywhere, private, consumers, {*fused_into, *heads.found})
                epilogues[n.name] = ep
                fused_into.update((e.name, n) for e in ep.nodes)
        norms = lower_norm.find_norms(facts, {*fused_into, *heads.found})
        attentions = attention_patterns.find_attention(facts, {*fused_into, *heads.found, *norms.found}, minor)
        act_chains = lower_mobile.find_act_chains(facts, {*fused_into, *heads.found, *norms.found, *attentions.found})
        return cls(
            specs=specs,
            inits=frozenset(i.name for i in model.graph.initializer),
            producers={o: n for n in model.graph.node for o in n.output if o},
            consumers=dict(consumers),
            uses=dict(uses),
            graph_outputs=graph_outputs,
            constant=frozenset(batch_free(model)),
            facts=facts,
            epilogues=epilogues,
            fused_into=fused_into,
            heads=heads,
            norms=norms,
            minor=minor,
            attentions=attentions,
            act_chains=act_chains,
        )


def _supported_heads(facts: lower_mobile.Facts) -> lower_head.Heads:
    """The model's heads (:func:`lower_head.find_heads`) that the seghead kernel computes; the nodes
    of the others get the kernel's reason (``SegHeadSpec.supports``, the check its launch makes)."""
    found = lower_head.find_heads(facts)
    spec = kernels.KERNELS["seghead"]
    assert isinstance(spec, kernels.SegHeadSpec)
    heads = lower_head.Heads(refused=dict(found.refused))
    for name, head in found.found.items():
        why = spec.supports(head.classes, kernels.HeadMode.of(head.call()))
        if why:
            heads.refused[name] = f"the seghead kernel does not take its head: {why}"
        else:
            heads.found[name] = head
    return heads


Predicate = Callable[[onnx.NodeProto, SupportContext], "str | None"]


@dataclass(frozen=True)
class TrackAOp:
    """An ONNX op Track A takes: the predicate that says which of its nodes (None: this one; else
    why not), and the kernel a node it takes launches (a `KernelCall.op`, which picks its cost), or
    None where it has no launch of its own: fused into another node's kernel, or a buffer alias."""

    check: Predicate
    kernel: Callable[[onnx.NodeProto, SupportContext], str | None]


def _constant_weights(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    if any(w and w not in ctx.inits for w in node.input[1:]):
        return "weights computed at run time"
    return None


def _conv_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """A depthwise Conv or one on a pooled (N,C,1,1) vector is lower_mobile's (never the dense conv's,
    even where the general conv could take it); the others the dense kernels' (:func:`_dense_conv`)."""
    if lower_mobile.claims(node, ctx.facts):
        return lower_mobile.supports(node, ctx.facts)
    return _constant_weights(node, ctx) or _dense_conv(node, ctx.epilogues[node.name], ctx.specs)[2]


def _conv_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str:
    if lower_mobile.claims(node, ctx.facts):
        return lower_mobile.RULES["Conv"].lower(node, ctx.facts).op
    return _dense_conv(node, ctx.epilogues[node.name], ctx.specs)[0]


def convt_geometry(node: onnx.NodeProto, specs: dict) -> tuple[kernels.ConvTGeometry | None, str | None]:
    """(window, None) of a 2-D ConvTranspose with explicit pads, or (None, why not)."""
    a = _attrs(node)
    w_shape = specs[node.input[1]][0]
    if len(w_shape) != 4 or len(specs[node.input[0]][0]) != 4:
        return None, f"a {len(w_shape) - 2}-D transposed convolution (Track A takes 2-D)"
    auto_pad = a.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if a.get("output_shape") or auto_pad not in ("NOTSET", "VALID"):
        return None, "output_shape or auto_pad SAME_* (re-export with explicit pads and output_padding)"
    R, S = (int(v) for v in a.get("kernel_shape", w_shape[2:]))
    pads = [0, 0, 0, 0] if auto_pad == "VALID" else [int(v) for v in a.get("pads", [0, 0, 0, 0])]
    rest = (*a.get("strides", [1, 1]), *a.get("dilations", [1, 1]), *pads, *a.get("output_padding", [0, 0]))
    return kernels.ConvTGeometry(R, S, *(int(v) for v in rest), groups=int(a.get("group", 1))), None


def _convt_choice(node: onnx.NodeProto, specs: dict) -> tuple[str, kernels.ConvTGeometry | None, str | None]:
    """The kernel a ConvTranspose runs: convt2x2 (tensor cores) for the 2x2 stride-2 unpadded one it is
    written for, else the general ``convt``, with its window and why its spec refuses it (None: takes it)."""
    if _convt_attrs_ok(node) is None:
        return "convt2x2", None, None
    geom, why = convt_geometry(node, specs)
    if geom is None:
        return "convt", None, why
    (_, c, h, w), dtype = specs[node.input[0]]
    k = specs[node.output[0]][0][1]
    spec = kernels.KERNELS["convt"]
    assert isinstance(spec, kernels.ConvTSpec)
    return "convt", geom, spec.supports(dtype, h, w, c, k, geom)


def _convt_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return _constant_weights(node, ctx) or _convt_choice(node, ctx.specs)[2]


def _convt_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str:
    return _convt_choice(node, ctx.specs)[0]


# The window maxpool2x2 is specialised for (the reference U-Net's pools); the general maxpool takes the rest.
_POOL_2X2 = PoolGeometry(2, 2, 2, 2)


def _max_pool(node: onnx.NodeProto, specs: dict) -> tuple[str, PoolGeometry | None, str | None]:
    """The kernel a MaxPool or AveragePool runs, its window and why the kernel cannot take it (None where it can):
    ``maxpool2x2`` for a plain 2x2 / stride 2 window, else the general ``maxpool``, where its spec's
    :meth:`~dualtrack.kernels.MaxPoolSpec.supports` says so and its output size is the graph's
    (ONNX's shape inference and onnxruntime disagree on some ``ceil_mode`` windows:
    :mod:`dualtrack.kernels.maxpool`)."""
    geom, why = pool_geometry(node, specs)
    if geom is None:
        return "maxpool", None, why
    if geom == _POOL_2X2:
        return "maxpool2x2", geom, None
    (_, c, h, w), dtype = specs[node.input[0]]
    spec = kernels.KERNELS["maxpool"]
    assert isinstance(spec, kernels.MaxPoolSpec)
    why = spec.supports(dtype, h, w, c, geom)
    if why is None and specs[node.output[0]][0][2:] != geom.output_hw(h, w):
        why = (
            f"{geom.label()} on {h}x{w}: the graph says {specs[node.output[0]][0][2:]}, onnxruntime computes "
            f"{geom.output_hw(h, w)} (ceil_mode's last window would start in the padding)"
        )
    return "maxpool", geom, why


def _pool_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return _max_pool(node, ctx.specs)[2]


def _pool_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str:
    return _max_pool(node, ctx.specs)[0]


def _in_conv_epilogue(node: onnx.NodeProto, ctx: SupportContext) -> bool:
    """Whether the node runs in the epilogue of a dense Conv that Track A takes (no kernel of its own)."""
    conv = ctx.fused_into.get(node.name)
    return conv is not None and track_a_support(conv, ctx) is None


def _mobile_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return lower_mobile.supports(node, ctx.facts)


def _mobile_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    # The Casts around the fp32 island of an fp16 model lower with the pool or Resize they wrap
    # (one call, lower_mobile.CAST_WRAPPED): that node's kernel is the island's launch.
    return None if node.op_type == "Cast" else lower_mobile.RULES[node.op_type].lower(node, ctx.facts).op


def _epilogue_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """An Add, Mul or activation (Relu and the others): none of its own in the epilogue of the dense
    Conv before it (:func:`_fuse_epilogue`) where Track A takes that Conv; else the eltwise kernel's."""
    return None if _in_conv_epilogue(node, ctx) else _mobile_support(node, ctx)


def _epilogue_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    if _in_conv_epilogue(node, ctx):
        return None
    x = node.input[0]
    producer = ctx.producers.get(x)
    rule = lower_mobile.RULES.get(producer.op_type) if producer is not None else None
    if producer is None or rule is None or node.op_type not in lower_mobile.ACT_OPS:
        return _mobile_kernel(node, ctx)
    if (
        rule.fuses_act
        and lower_mobile.claims(producer, ctx.facts)
        and ctx.uses.get(x, 0) == 1
        and x not in ctx.graph_outputs
    ):
        return None  # in the epilogue of the dwconv, fc or eltwise call before it (lower_mobile.lower)
    return _mobile_kernel(node, ctx)


def _moves_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """Pad, Slice, Split, Concat: lower_pad's (a Concat's inputs from anywhere: copies where needed)."""
    return lower_pad.supports(node, ctx.facts)


def _moves_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return lower_pad.kernel(node, ctx.facts)


def _launches(op: str | None) -> Callable[[onnx.NodeProto, SupportContext], str | None]:
    return lambda node, ctx: op


def _head_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    return ctx.heads.why(node)


def _head_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """A head is one seghead launch, charged to its first node; the others have none of their own."""
    return "seghead" if ctx.heads.found[node.name].nodes[0] == node.name else None


def _or_head(op: TrackAOp) -> TrackAOp:
    """``op`` for a node of an op type heads share with other lowerings (Cast, Sigmoid), unless the
    node is in a head: then the head's."""

    def check(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        return None if node.name in ctx.heads.found else op.check(node, ctx)

    def kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        return _head_kernel(node, ctx) if node.name in ctx.heads.found else op.kernel(node, ctx)

    return TrackAOp(check, kernel)


# op type -> its predicate and kernel. A new Track A op joins lower_track_a's checks and `partition:
# auto` here; every op lower_mobile claims is its predicate's (lower_mobile.RULES).
TRACK_A_SUPPORT: dict[str, TrackAOp] = {
    **{op: TrackAOp(_mobile_support, _mobile_kernel) for op in lower_mobile.RULES},
    **{op: TrackAOp(_epilogue_support, _epilogue_kernel) for op in ("Add", "Mul", *lower_mobile.ACT_OPS)},
    "Conv": TrackAOp(_conv_support, _conv_kernel),
    "MaxPool": TrackAOp(_pool_support, _pool_kernel),
    "AveragePool": TrackAOp(_pool_support, _pool_kernel),
    "ConvTranspose": TrackAOp(_convt_support, _convt_kernel),
    **{op: TrackAOp(_moves_support, _moves_kernel) for op in lower_pad.OPS},
}
# The segmentation head's ops (lower_head: one seghead call writes the model's probs and mask).
TRACK_A_SUPPORT.update(
    {op: _or_head(TRACK_A_SUPPORT[op]) if op in TRACK_A_SUPPORT else TrackAOp(_head_support, _head_kernel)
     for op in lower_head.OPS}
)  # fmt: skip


def _or_norm(op: TrackAOp | None) -> TrackAOp:
    """``op`` (None: no other lowering takes the op type) for a node outside a normalisation chain;
    a chain's nodes are its norm call's (lower_norm), launched once, charged to its first node."""

    def check(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        if node.name in ctx.norms.found or op is None:
            return ctx.norms.why(node)
        return op.check(node, ctx)

    def kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        if node.name in ctx.norms.found or op is None:
            return ctx.norms.kernel(node)
        return op.kernel(node, ctx)

    return TrackAOp(check, kernel)


# The normalisation family's ops (lower_norm: a chain is one norm call).
TRACK_A_SUPPORT.update({op: _or_norm(TRACK_A_SUPPORT.get(op)) for op in lower_norm.OPS})


def _or_epilogue(op: TrackAOp | None) -> TrackAOp:
    """``op`` (None: no kernel of its own) for a node outside a dense Conv's epilogue; a node of a
    multi-node activation fused there (act_patterns: GELU's Div, Erf, Add, Muls) launches nothing,
    and one of a stand-alone chain (``ctx.act_chains``) is its eltwise call, charged to its first node."""

    def check(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        if _in_conv_epilogue(node, ctx) or node.name in ctx.act_chains.found:
            return None
        return op.check(node, ctx) if op is not None else "no hand-written kernel (only in a convolution's epilogue)"

    def kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        if node.name in ctx.act_chains.found and not _in_conv_epilogue(node, ctx):
            return ctx.act_chains.kernel(node)
        return None if _in_conv_epilogue(node, ctx) or op is None else op.kernel(node, ctx)

    return TrackAOp(check, kernel)


TRACK_A_SUPPORT.update({op: _or_epilogue(TRACK_A_SUPPORT.get(op)) for op in act_patterns.OPS})


def _or_attention(op: TrackAOp | None) -> TrackAOp:
    """``op`` (None: no other lowering takes the op type) for a node outside a matched attention; a
    match's nodes are its attention call's (attention_patterns), launched once, charged to its first
    node. A Softmax that looked like attention but is not one gives that reason where nothing else
    takes it."""

    def check(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        if node.name in ctx.attentions.found:
            return None
        why = op.check(node, ctx) if op is not None else "no hand-written kernel"
        return ctx.attentions.refused.get(node.name, why) if why else None

    def kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
        if node.name in ctx.attentions.found:
            return ctx.attentions.kernel(node)
        return op.kernel(node, ctx) if op is not None else None

    return TrackAOp(check, kernel)


TRACK_A_SUPPORT.update({op: _or_attention(TRACK_A_SUPPORT.get(op)) for op in attention_patterns.OPS})


def track_a_support(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """None when a Track A kernel takes ``node``, else why not: the one question lower_track_a and
    `partition: auto` both ask (the segment-level conditions, an epilogue in its Conv's segment, an
    activation right after the op it fuses into, a Concat's producers in its segment, are
    lower_track_a's)."""
    op = TRACK_A_SUPPORT.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if op is None:
        return "no hand-written kernel"
    if node.name in ctx.attentions.found:  # its layout nodes' tensors are strides of the call, never buffers
        return None
    dtype = ctx.specs[node.output[0]][1]
    # A head's mask is uint8; a norm chain's Shape (of its own input) is int64 and an activation's threshold
    # test (softplus's Greater) bool, and they launch nothing.
    in_call = (ctx.heads.found, ctx.norms.found, ctx.act_chains.found, ctx.fused_into)
    if dtype not in ("float16", "float32") and not any(node.name in found for found in in_call):
        return f"dtype {dtype}"
    off = next((x for x in [*node.input, *node.output] if x in ctx.minor), None)
    if off is not None:
        return f"'{off}' carries the batch outside dim 0 (Track A kernels take batch-major tensors)"
    # The data input, or either operand of a binary op (1 - x: Sub's constant comes first).
    if all(x in ctx.constant for x in node.input[:2] if x):
        return "input computed from constants alone (not batch-major)"
    # A constant the graph computes (ConstantOfShape, a Shape chain left unfolded) is no weight the
    # lowering can fold, and as a tensor it is not batch-major: it cannot cross into a Track A segment.
    computed = next((x for x in node.input if x and x in ctx.constant and ctx.facts.const(x) is None), None)
    if computed is not None and node.name not in ctx.norms.found:  # a chain reads its shapes at build time
        return (
            f"input '{computed}' is computed at run time from shapes, not from the image (zeros sized by the "
            "input, or a shape chain `simplify` could not fold); Track A kernels read weights and batch-major data"
        )
    return op.check(node, ctx)


def track_a_kernel(node: onnx.NodeProto, ctx: SupportContext) -> str | None:
    """The kernel (`KernelCall.op`) a node :func:`track_a_support` takes launches on Track A, or None
    where it has no launch of its own (an epilogue, a Concat's buffer alias, an fp32 island's Cast)."""
    return TRACK_A_SUPPORT[node.op_type].kernel(node, ctx)


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
    """Match a Track A segment's nodes to hand-written kernel calls (Conv with its fused epilogue,
    MaxPool, ConvTranspose, the mobile ops of :mod:`dualtrack.compiler.lower_mobile`) and buffer aliases
    (Concat); each node must pass :func:`track_a_support`. A Conv's call covers the Add and the
    activation after it (:func:`_fuse_epilogue`) and is placed where the last of them was, so that
    a residual computed between them (ResNet's downsample) is ready. ``ctx``: the model's, where the
    caller has it."""
    ctx = ctx or SupportContext.of(model, specs)
    seg = lower_mobile.islands_together(seg, ctx.facts)
    in_seg = {n.name for n in seg}

    def private(t: str) -> bool:  # an intermediate no other track or graph output sees
        return t not in ctx.graph_outputs and t not in boundary_outputs

    escaping = boundary_outputs | ctx.graph_outputs

    # A segmentation head is one call, emitted at its last node in the segment (it reads its logits
    # alone, computed before any of its nodes); none of its nodes joins a Conv's epilogue or a mobile op's.
    last_of = {ctx.heads.found[n.name]: n.name for n in seg if n.name in ctx.heads.found}
    head_at = {name: h for h, name in last_of.items()}
    in_heads = {name for h in last_of for name in h.nodes}
    # A norm chain is one call too, emitted at its last node (its residual is computed before that).
    norm_last = {ctx.norms.found[n.name]: n.name for n in seg if n.name in ctx.norms.found}
    norm_at = {name: nm for nm, name in norm_last.items()}
    in_norms = {name for nm in norm_last for name in nm.nodes}
    # An attention is one call, emitted at its last node (its Q, K, V roots are computed before its first).
    attn_last = {ctx.attentions.found[n.name]: n.name for n in seg if n.name in ctx.attentions.found}
    attn_at = {name: att for att, name in attn_last.items()}
    # A stand-alone activation chain is one eltwise call, emitted at its last node (it reads one tensor).
    chain_last = {ctx.act_chains.found[n.name]: n.name for n in seg if n.name in ctx.act_chains.found}
    chain_at = {name: ch for ch, name in chain_last.items()}
    groups = _fusion_groups(
        seg, model, specs, ctx, private, in_heads | in_norms | set(ctx.attentions.found) | set(ctx.act_chains.found)
    )

    def fusable(t: str) -> bool:  # an op's output that an activation after it may consume in place
        return ctx.uses[t] == 1 and private(t) and not any(u.name in in_heads for u in ctx.consumers.get(t, []))

    calls: list[KernelCall] = []
    concats: dict[str, tuple[str, ...]] = {}  # the ONNX inputs of each Concat lowered so far (lower_pad)
    i = 0
    while i < len(seg):
        node = seg[i]
        i += 1
        if node.name in in_heads:
            head = ctx.heads.found[node.name]
            _all_here(node, head.nodes, in_seg, "segmentation head")
            if node.name in head_at:
                calls.append(head.call())
            continue
        if node.name in in_norms:
            norm = ctx.norms.found[node.name]
            _all_here(node, norm.nodes, in_seg, "normalisation")
            if node.name in norm_at:
                calls.append(norm.call)
            continue
        if node.name in ctx.attentions.found:
            att = ctx.attentions.found[node.name]
            _all_here(node, att.nodes, in_seg, "attention")
            if node.name in attn_at:
                calls.append(att.call)
            continue
        if node.name in ctx.act_chains.found:
            chain = ctx.act_chains.found[node.name]
            _all_here(node, chain.nodes, in_seg, "activation")
            if node.name in chain_at:
                _add_chain(calls, chain, private)
            continue
        if node.name in groups.claimed:  # in the epilogue of a Conv of this segment, which answers for it
            if node.name in groups.emit_at:
                conv = groups.emit_at[node.name]
                calls.append(_conv_call(conv, groups.epilogues[conv.name], specs, _refusal))
            continue
        why = track_a_support(node, ctx)
        if why:
            raise _refusal(node, why)
        if lower_mobile.claims(node, ctx.facts):
            call, covered_nodes = _lower_mobile_op(seg, i - 1, ctx.facts, fusable)
            calls.append(call)
            i += covered_nodes - 1
            continue
        if node.op_type in lower_pad.OPS:
            calls += lower_pad.lower(node, ctx.facts, lower_pad.SegmentSoFar(calls, escaping, specs, concats))
            continue
        call = _lower_dense_op(node, specs, groups)
        if call is not None:
            calls.append(call)
    return calls


def _all_here(node: onnx.NodeProto, nodes: Sequence[str], in_seg: set[str], what: str) -> None:
    """Refuse ``node`` where the one call its ``what`` (a head, a norm, an attention, an activation chain)
    lowers to would take nodes of another segment."""
    missing = [name for name in nodes if name not in in_seg]
    if missing:
        raise _refusal(node, f"its {what}'s nodes {', '.join(missing)} are in another segment")


def _add_chain(calls: list[KernelCall], chain: lower_mobile.ActChain, private: Callable[[str], bool]) -> None:
    """A stand-alone activation chain's call, folded into the call that wrote its input where
    ``find_act_chains`` found that op fuses an activation (a depthwise conv's epilogue: a Mix-FFN's GELU)
    and that call, in this segment, writes nothing else and nothing after it reads the input."""
    t = chain.call.inputs[0]
    k = next((i for i in range(len(calls) - 1, -1, -1) if t in calls[i].outputs), None)
    if (
        chain.in_producer and k is not None and calls[k].outputs == (t,) and calls[k].attr("act") == 0
        and private(t) and not any(t in c.inputs for c in calls[k + 1 :])
    ):  # fmt: skip
        calls[k] = lower_mobile.with_chain(calls[k], chain)
    else:
        calls.append(chain.call)


def _refusal(node: onnx.NodeProto, why: str) -> TrackARefusal:
    return TrackARefusal(
        f"node '{node.name}' ({node.op_type}, {why}) is on Track A, whose kernels cover {TRACK_A_DESCRIPTION}; "
        f"move it to Track B with partition.track_b.name_prefixes: ['{node.name}']",
        node=node.name,
        why=why,
    )


@dataclass
class _FusionGroups:
    """A segment's dense Convs with the epilogue each fuses within the segment."""

    epilogues: dict[str, _Epilogue]  # Conv name -> its epilogue
    emit_at: dict[str, onnx.NodeProto]  # node name -> the Conv whose call goes where that node was
    claimed: set[str]  # nodes another call answers for: epilogue and segmentation head nodes


def _fusion_groups(
    seg: list[onnx.NodeProto],
    model: onnx.ModelProto,
    specs: dict,
    ctx: SupportContext,
    private: Callable[[str], bool],
    in_heads: set[str],
) -> _FusionGroups:
    """Fusion groups first: the Conv's call is emitted at the position of its group's last node."""
    in_seg = {n.name for n in seg}
    groups = _FusionGroups({}, {}, set(in_heads))
    for node in seg:
        if node.op_type == "Conv" and not lower_mobile.claims(node, ctx.facts):  # depthwise / vector: lower_mobile's
            ep = _fuse_epilogue(node, model, specs, in_seg, private, ctx.consumers, groups.claimed)
            groups.epilogues[node.name] = ep
            groups.claimed.update(n.name for n in ep.nodes)
            groups.emit_at[(ep.nodes[-1] if ep.nodes else node).name] = node
    return groups


def _lower_mobile_op(
    seg: list[onnx.NodeProto], at: int, facts: lower_mobile.Facts, fusable: Callable[[str], bool]
) -> tuple[KernelCall, int]:
    """The lower_mobile.RULES call for ``seg[at]`` (depthwise/pooled-vector Conv, pools, eltwise,
    Resize) and how many nodes it covers."""
    node = seg[at]
    # An Add or activation whose predicate counted on its Conv's epilogue, which this segment does not
    # hold, is an eltwise call of its own here.
    why = lower_mobile.supports(node, facts)
    if why:
        raise _refusal(node, why)
    try:
        return lower_mobile.lower(seg, at, facts, fusable)
    except lower_mobile.LoweringRefused as e:
        raise _refusal(node, str(e)) from None


def _lower_dense_op(node: onnx.NodeProto, specs: dict, groups: _FusionGroups) -> KernelCall | None:
    """The call for a dense Conv without epilogue nodes, MaxPool or ConvTranspose (None for a Conv
    whose call waits for its epilogue's last node)."""
    if node.op_type == "Conv":
        if node.name in groups.emit_at:  # no epilogue nodes: the call goes here
            return _conv_call(node, groups.epilogues[node.name], specs, _refusal)
        return None
    if node.op_type in ("MaxPool", "AveragePool"):
        op, geom, _ = _max_pool(node, specs)
        attrs = geom.attrs() if op == "maxpool" and geom is not None else ()
        return KernelCall(op, (node.input[0],), (node.output[0],), (), attrs, (node.name,))
    if node.op_type == "ConvTranspose":
        weights = tuple(w for w in node.input[1:] if w)
        op, tgeom, why = _convt_choice(node, specs)
        if why:
            raise _refusal(node, why)
        attrs = () if tgeom is None else tgeom.attrs()
        return KernelCall(op, (node.input[0],), (node.output[0],), weights, attrs, (node.name,))
    raise _refusal(node, "no hand-written kernel")


def _dense_conv(node: onnx.NodeProto, ep: _Epilogue, specs: dict) -> tuple[str, ConvGeometry | None, str | None]:
    """The kernel a dense Conv with epilogue ``ep`` runs: conv3x3 or conv1x1 where their fixed shapes
    and epilogue (bias, ReLU) fit, as before the general conv existed (except a 3x3 conv on a large
    image with few enough output channels for the general conv's direct entry, :data:`DIRECT_MIN_PIXELS`:
    a segmentation head, whose tensor-core tiles would be mostly empty); else the general ``conv``,
    with its geometry (narrow groups merged: :meth:`~dualtrack.kernels.ConvGeneralSpec.merged`) and
    why its spec's :meth:`~dualtrack.kernels.ConvGeneralSpec.supports` refuses it (None where it
    takes it)."""
    x_shape, dtype = specs[node.input[0]]
    w_shape = specs[node.input[1]][0]
    spec = kernels.KERNELS["conv"]
    assert isinstance(spec, kernels.ConvGeneralSpec)
    relu_only = ep.residual is None and ep.act.relu_flag() is not None
    if relu_only and len(x_shape) == 4 and _conv_attrs_ok(node) is None:
        few = (
            dtype == "float16"
            and x_shape[2] * x_shape[3] >= DIRECT_MIN_PIXELS
            and spec.direct_supported(x_shape[1], w_shape[0], ConvGeometry(3, 3)) is None
        )
        if w_shape[2:] == (3, 3) and not few:
            return "conv3x3", None, None
        if w_shape[2:] == (1, 1) and x_shape[1] <= kernels.KERNELS["conv1x1"].max_c and w_shape[0] <= CONV1X1_MAX_K:  # type: ignore[attr-defined]
            return "conv1x1", None, None
    geom, _, why = conv_geometry(node, specs)
    if geom is None:
        return "conv", None, why
    (_, c, h, w), k = x_shape, w_shape[0]
    why = spec.supports(dtype, h, w, c, k, geom)
    return "conv", geom if why else spec.merged(dtype, c, k, geom), why


def _conv_call(
    node: onnx.NodeProto, ep: _Epilogue, specs: dict, refuse: Callable[[onnx.NodeProto, str], PartitionError]
) -> KernelCall:
    """A Conv and its fused epilogue as one call, on the kernel :func:`_dense_conv` picks."""
    op, geom, why = _dense_conv(node, ep, specs)
    if why:
        raise refuse(node, why)
    weights = tuple(w for w in node.input[1:] if w)
    covered = (node.name, *(n.name for n in ep.nodes))
    ins = (node.input[0],) if ep.residual is None else (node.input[0], ep.residual)
    if geom is None:  # conv3x3 / conv1x1
        attrs: tuple[tuple[str, int], ...] = (("relu", ep.act.relu_flag() or 0),)
    else:
        attrs = (*geom.attrs(), *ep.act.attrs(), ("residual", 1 if ep.residual else 0))
    return KernelCall(op, ins, (ep.output,), weights, attrs, covered)


# -- partition: auto ------------------------------------------------------------------------------
#
# 1. Every node a Track A kernel takes (track_a_support) starts on Track A; a node that reads the
#    model's input or writes its output stays on Track B (Track A works in NHWC); rules override.
# 2. Segments are cut (order_segments) and every Track A segment lowered (lower_track_a); a node it
#    refuses (a Concat whose input leaves the segment, an Add the eltwise kernel cannot take once a
#    segment boundary cuts it off its Conv's epilogue) moves to Track B, and the segments are cut again.
# 3. Then, greedily, a Track A segment whose move to Track B lowers the plan's estimated time moves
#    (dualtrack.compiler.cost: node times plus one switch cost per segment boundary), the one that saves the
#    least on Track A first; back to 2. Where no island pays, a few nodes at either end of a Track A
#    segment that are cheaper on Track B (element-wise ops IREE fuses into its neighbour's dispatch)
#    move (3b); back to 2.
# 4. Last, the plan's estimate is compared with IREE alone's (every node on Track B, one segment),
#    and IREE alone is taken where it is predicted no slower: auto never picks a plan it predicts
#    slower than not using Track A at all.
# Nodes only ever move from A to B (Track B takes every op), so this ends within one pass per node.
# Greedy, not optimal: an island is moved whole or not at all, which is the choice the switch cost
# is about; trimming single nodes off an island's edge is not tried.


def _node_costs(
    model: onnx.ModelProto,
    ctx: SupportContext,
    batch_sizes: tuple[int, ...],
    measured: cost.MeasuredTimes | None,
    rates: cost.Rates = cost.DEFAULT_RATES,
    target: cost.ConvTarget | None = None,
) -> dict[str, cost.NodeCost]:
    out = {}
    inits = set(ctx.inits)
    for n in model.graph.node:
        why = track_a_support(n, ctx)
        kernel = None if why else track_a_kernel(n, ctx)
        on_a = why if why else "fused" if kernel is None else None
        head = ctx.heads.found.get(n.name) if kernel == "seghead" else None
        work = cost.head_work(ctx.specs, head.logits, (head.probs, head.mask)) if head is not None else None
        if kernel == "norm":
            call = ctx.norms.found[n.name].call
            work = cost.norm_work(ctx.specs, call.inputs, call.outputs[0], call.attr("kind"))
        if kernel == "attention":
            work = attention_patterns.attention_work(ctx.specs, ctx.attentions.found[n.name].call)
        out[n.name] = cost.node_cost(
            n,
            ctx.specs,
            inits,
            batch_sizes,
            on_a=on_a,
            kernel=kernel,
            rates=rates,
            measured=measured,
            work=work,
            target=target,
        )
    return out


def _target_rates(cfg: BuildConfig) -> cost.Rates:
    """The cost model's row for the build's first target (the H200's for a CPU-only build)."""
    return cost.rates_for_target(cfg.targets[0] if cfg.targets else None)


def _rates_label(cfg: BuildConfig) -> str:
    rates = _target_rates(cfg)
    return f"the {rates.device} rooflines of compiler/rates.json, {rates.status}"


def _cost_note(switch: float, costs: dict[str, cost.NodeCost], cfg: BuildConfig) -> str:
    n_measured = sum(c.source == "measured" for c in costs.values())
    source = (
        f"{n_measured} conv(s) measured (the `tuning:` records), the rest the default model"
        if n_measured
        else f"the default model (dualtrack.compiler.cost: {_rates_label(cfg)})"
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
    keep_a: Mapping[str, str] | None = None,
) -> Assignment:
    """`partition: auto` (the steps are at the top of this section), on the nodes' ``costs``; the
    nodes of ``keep_a`` that a Track A kernel takes start there and no cost moves them."""
    nodes = list(model.graph.node)
    tracks, why, forced_a = _first_tracks(model, cfg, ctx)
    kept = {n for n, reason in (keep_a or {}).items() if tracks.get(n) == "A" and n not in forced_a}
    for n in kept:
        why[n] = f"a Track A kernel takes it; kept there: {keep_a[n]}"  # type: ignore[index]
    forced_a = forced_a | kept
    batches = len(cfg.batch_sizes)

    def estimate(trial: dict[str, str], n_segments: int) -> float:
        return cost.plan_us((costs[n].on(t) for n, t in trial.items()), n_segments, switch, batches)

    moves: list[str] = []
    lowered: dict[tuple[tuple[str, ...], frozenset[str]], TrackARefusal | None] = {}
    while True:
        segments = order_segments(model, tracks)
        refusal = _first_refusal(model, ctx, segments, tracks, lowered)
        if refusal is not None:
            if refusal.node in forced_a - kept:
                raise refusal  # the config's rule put it there; the message names the fix
            forced_a.discard(refusal.node)
            tracks[refusal.node], why[refusal.node] = "B", f"Track A cannot lower it in its segment: {refusal.why}"
            _whole_islands(model, ctx, tracks, why, forced_a)
            continue
        best = _island_to_move(model, segments, tracks, forced_a, costs, estimate)
        if best is not None:
            moves.append(_move_island(*best, tracks, why, costs, switch * batches))
            continue
        # A head's or a norm chain's nodes are one launch (charged to its first node): never split.
        chained = forced_a | set(ctx.heads.found) | set(ctx.norms.found) | set(ctx.act_chains.found)
        edge = _edge_to_trim(model, segments, tracks, chained, estimate)
        if edge is None:
            break
        saving = sum(costs[n.name].on("A") - costs[n.name].on("B") for n in edge)
        because = f"{saving:.1f} us less on Track B beside it (IREE fuses element-wise ops into its dispatches)"
        moves.append(f"moved {', '.join(n.name for n in edge)} off the edge of their Track A segment: {because}")
        for n in edge:
            tracks[n.name], why[n.name] = "B", f"moved to Track B off the edge of its Track A segment: {because}"
    moves += _iree_alone_if_faster(model, tracks, why, forced_a, estimate)
    decisions = tuple(
        TrackDecision(n.name, n.op_type, tracks[n.name], why[n.name], costs[n.name].a_us, costs[n.name].b_us)
        for n in nodes
    )
    notes = ("partition: auto", _cost_note(switch, costs, cfg), *moves)
    return Assignment(tracks, decisions, notes, switch, cfg.batch_sizes)


def _move_island(
    seg: list[onnx.NodeProto],
    fewer: int,
    tracks: dict[str, str],
    why: dict[str, str],
    costs: dict[str, cost.NodeCost],
    switch_all_batches: float,
) -> str:
    """Step 3's move of one island to Track B (``tracks`` and ``why`` updated); its partition note."""
    saving = sum(costs[n.name].on("B") - costs[n.name].on("A") for n in seg)
    island = f"island {seg[0].name} .. {seg[-1].name} ({len(seg)} nodes)"
    because = (
        f"on Track A it saves {saving:.1f} us, less than the {fewer * switch_all_batches:.1f} us of the "
        f"{fewer} track switch(es) it costs"
        if saving > 0
        else f"it is {-saving:.1f} us faster on Track B"
    )
    for n in seg:
        tracks[n.name], why[n.name] = "B", f"moved to Track B with its {island}: {because}"
    return f"moved the {island} to Track B: {because}"


EDGE_MAX = 8  # nodes step 3b tries to trim off either end of a Track A segment


def _edge_to_trim(
    model: onnx.NodeProto,
    segments: list[list[onnx.NodeProto]],
    tracks: dict[str, str],
    keep: set[str],
    estimate: Callable[[dict[str, str], int], float],
) -> list[onnx.NodeProto] | None:
    """Step 3b (``keep``: nodes never trimmed): the first few nodes at either end of a Track A segment
    (up to EDGE_MAX) whose move to
    Track B lowers the estimate: element-wise ops that IREE fuses into the dispatch beside them (an
    image's normalisation before the body) cost a launch each on Track A and nothing there. Step 3
    moves whole islands only, and a segment that holds the body never pays to move whole."""
    now = estimate(tracks, len(segments))
    for seg in segments:
        if tracks[seg[0].name] != "A":
            continue
        ends = [seg[:j] for j in range(1, min(len(seg) - 1, EDGE_MAX) + 1)]
        ends += [seg[-j:] for j in range(1, min(len(seg) - 1, EDGE_MAX) + 1)]
        for part in ends:
            if any(n.name in keep for n in part):
                continue
            trial = {**tracks, **{n.name: "B" for n in part}}
            if estimate(trial, len(order_segments(model, trial))) < now - 1e-6:
                return part
    return None


def _iree_alone_if_faster(
    model: onnx.ModelProto,
    tracks: dict[str, str],
    why: dict[str, str],
    forced_a: set[str],
    estimate: Callable[[dict[str, str], int], float],
) -> list[str]:
    """Step 4: the greedy moves can stop at a plan that is slower than no Track A at all (moving any
    one island does not pay, moving them all would). Compare the two estimates and, where IREE alone
    is predicted no slower, take it (``tracks`` and ``why`` updated in place); a config's Track A
    rules (``forced_a``) keep their nodes on A. Returns the partition note for the comparison."""
    chosen = estimate(tracks, len(order_segments(model, tracks)))
    alone = {n: ("A" if n in forced_a else "B") for n in tracks}
    if alone == tracks:
        return []
    alone_us = estimate(alone, len(order_segments(model, alone)))
    if alone_us > chosen:
        return [f"the plan is predicted {chosen:.1f} us against {alone_us:.1f} us for IREE alone: kept"]
    because = f"IREE alone is predicted {alone_us:.1f} us, the mixed plan {chosen:.1f} us"
    for n, t in alone.items():
        if t != tracks[n]:
            tracks[n], why[n] = t, f"moved to Track B with the whole plan: {because}"
    return [f"took IREE alone: {because}"]


def _first_tracks(
    model: onnx.ModelProto, cfg: BuildConfig, ctx: SupportContext
) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """Step 1 of `partition: auto`: every node's first track and why, and the nodes a rule puts on A."""
    part = cfg.partition
    model_in = {i.name for i in model.graph.input}
    tracks: dict[str, str] = {}
    why: dict[str, str] = {}
    forced_a: set[str] = set()
    for n in model.graph.node:
        rule_b, rule_a = _rule(n, part.track_b, "track_b"), _rule(n, part.track_a, "track_a")
        reason = track_a_support(n, ctx)
        if rule_b:
            tracks[n.name], why[n.name] = "B", rule_b
        elif rule_a:
            tracks[n.name], why[n.name] = "A", rule_a
            forced_a.add(n.name)
        elif reason:
            tracks[n.name], why[n.name] = "B", f"not a Track A node: {reason}"
        elif any(x in model_in for x in n.input) or (
            n.name not in ctx.heads.found and any(o in ctx.graph_outputs for o in n.output)
        ):
            # A head's call writes the model's outputs in the model's layout (MODEL_LAYOUT_OPS).
            tracks[n.name], why[n.name] = "B", "reads or writes the model's own input/output (Track A works in NHWC)"
        else:
            launches = track_a_kernel(n, ctx) is not None
            tracks[n.name], why[n.name] = (
                "A",
                "a Track A kernel takes it" + ("" if launches else " (no launch of its own)"),
            )
    _whole_islands(model, ctx, tracks, why, forced_a)
    return tracks, why, forced_a


def _whole_islands(
    model: onnx.ModelProto, ctx: SupportContext, tracks: dict[str, str], why: dict[str, str], forced_a: set[str]
) -> None:
    """An fp16 model's fp32 island (Cast up, pooling or Resize, Cast down: one Track A call) with a node
    on Track B goes to Track B whole: its op alone on Track A would be a segment of its own between two
    switches (a last upsample whose Cast down writes the model's output)."""
    for n in model.graph.node:
        chain = lower_mobile.cast_sandwich(n, ctx.facts) if n.op_type == "Cast" else None
        if chain is None or chain[0].name != n.name or any(x.name in forced_a for x in chain):
            continue
        on_b = [x for x in chain if tracks.get(x.name) == "B"]
        if on_b and len(on_b) < len(chain):
            for x in chain:
                if tracks.get(x.name) == "A":
                    tracks[x.name] = "B"
                    why[x.name] = f"its fp32 island moves whole: '{on_b[0].name}' is on Track B ({why[on_b[0].name]})"


def _island_to_move(
    model: onnx.ModelProto,
    segments: list[list[onnx.NodeProto]],
    tracks: dict[str, str],
    forced_a: set[str],
    costs: dict[str, cost.NodeCost],
    estimate: Callable[[dict[str, str], int], float],
) -> tuple[list[onnx.NodeProto], int] | None:
    """Step 3: the first Track A island whose move to Track B lowers the estimate, and how many
    segments fewer the plan then has; None where no move pays."""
    now = estimate(tracks, len(segments))
    islands = [s for s in segments if tracks[s[0].name] == "A" and not any(n.name in forced_a for n in s)]
    # Tried in the order of what they would save if each took its two switches with it (an island
    # inside Track B does); the first that really lowers the estimate moves. Cutting the segments
    # for every island on every round would cost islands^2 cuts.
    islands.sort(key=lambda s: sum(costs[n.name].on("B") - costs[n.name].on("A") for n in s))
    for seg in islands:
        trial = {**tracks, **{n.name: "B" for n in seg}}
        n_after = len(order_segments(model, trial))
        if estimate(trial, n_after) < now:
            return seg, len(segments) - n_after
    return None


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
        return helper.make_tensor_value_info(t.name, elem, ["N", *t.shape[1:]] if t.batched else list(t.shape))

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
        a = self.assignment
        return {
            "notes": list(self.plan.notes),
            # Summed over the batch sizes, as the partition compared them (bench/zoo_bench.py checks
            # the measured times against these).
            "estimate_us": round(a.estimate_us(len(self.plan.segments)), 3),
            "iree_alone_us": round(a.iree_alone_us(), 3),
            "batch_sizes": list(a.batch_sizes),
            "nodes": [d.to_json() for d in a.decisions],
        }


def build_plan(
    cfg: BuildConfig, model: onnx.ModelProto, measured: cost.MeasuredTimes | None = None
) -> tuple[Plan, list[onnx.ModelProto]]:
    """Partition a (named) model into a Plan plus one ONNX model per segment (:func:`partition_model`)."""
    p = partition_model(cfg, model, measured)
    return p.plan, p.seg_models


def partition_model(
    cfg: BuildConfig,
    model: onnx.ModelProto,
    measured: cost.MeasuredTimes | None = None,
    keep_a: Mapping[str, str] | None = None,
) -> Partitioned:
    """Partition a (named) model: the plan, whose notes say how it was chosen, the segment models and
    the decision behind every node. ``measured``, ``keep_a``: see :func:`assign_tracks`."""
    if len(model.graph.input) != 1:
        raise ModelError(f"the model has {len(model.graph.input)} inputs; dualtrack serves single-input models")
    fixed = cfg.batch == "fixed"  # dim 0 is data: nothing is batch-major, every spec is exact (contract/plan.py)
    specs, minor = batch_checked_specs(model, (1, *cfg.batch_sizes), fixed=fixed)
    _check_input(cfg, model, specs)
    ctx = SupportContext.of(model, specs, frozenset(minor))
    assignment = assign_tracks(model, cfg, specs, measured, ctx, keep_a)
    tracks = assignment.tracks
    segments, seg_track = recompute_constants(model, order_segments(model, tracks), tracks)
    bounds = _boundaries(model, segments)
    _check_batch_major_boundaries(model, bounds, minor)
    spec = _boundary_spec(specs, ctx.graph_outputs, _nhwc_tensors(model, bounds, seg_track, ctx), batched=not fixed)
    plan_segments: list[Segment] = []
    seg_models: list[onnx.ModelProto] = []
    for k, (nodes, b) in enumerate(zip(segments, bounds, strict=True)):
        segment, seg_model = _segment(k, seg_track[k], nodes, b, model, cfg, specs, ctx, spec)
        plan_segments.append(segment)
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


def _check_batch_major_boundaries(model: onnx.ModelProto, bounds: list[_Boundaries], minor: dict[str, str]) -> None:
    """Every tensor that crosses a boundary is batch-major: the tracks run it per batch size."""
    free = batch_free(model)
    for k, b in enumerate(bounds):
        off = next((t for t in b.outputs if t in minor), None)
        if off is not None:
            raise PartitionError(
                f"tensor '{off}' does not keep the batch in dim 0 ({minor[off]}) and would leave segment {k}; "
                "keep its producers and consumers on one track (partition rules), build only the export's batch "
                "size, re-export the model with a dynamic batch (torch.onnx.export(..., dynamic_axes=...)), or set "
                f"`{FIXED_BATCH}` where dim 0 holds data"
            )
        crossing = [t for t in b.outputs if t in free]
        if crossing:
            raise PartitionError(
                f"'{crossing[0]}' is a constant or shape value (computed from weights, constants or Shape; not "
                f"batch-major) that would leave segment {k} for another track; keep its producers and consumers on "
                "one track (partition rules), or leave `simplify` on to fold it"
            )


def _nhwc_tensors(
    model: onnx.ModelProto, bounds: list[_Boundaries], seg_track: list[str], ctx: SupportContext
) -> set[str]:
    """The boundary tensors in NHWC: wherever Track A is on either side of a boundary, but for the
    model's own outputs: a Track A segment writes those only through a call that writes the model's
    layout (MODEL_LAYOUT_OPS: the segmentation head), checked once the segment is lowered."""
    graph_io = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    touches_a: set[str] = set()
    for k, b in enumerate(bounds):
        if seg_track[k] == "A":
            touches_a.update(b.inputs, b.outputs)
    for k, b in enumerate(bounds):
        if seg_track[k] == "A":
            for t in b.inputs + [o for o in b.outputs if o not in ctx.graph_outputs or _head_output(o, ctx) is None]:
                if t in graph_io:
                    raise PartitionError(
                        f"Track A would read or write the model's own input/output '{t}' directly; "
                        "Track A works in NHWC, "
                        "so keep the first and last ops on Track B (narrow partition.track_a)"
                    )
    return touches_a


def _boundary_spec(
    specs: dict, graph_outputs: frozenset[str], touches_a: set[str], batched: bool = True
) -> Callable[[str], TensorSpec]:
    """A boundary tensor's spec: its shape, dtype and layout as the plan records it (``batched`` False:
    a fixed-shape plan's, its shape exact)."""

    def spec(name: str) -> TensorSpec:
        shape, dtype = specs[name]
        if name in graph_outputs:  # the model's own layout wherever it is written (NCHW for an image)
            layout = "NCHW" if name in touches_a and len(shape) == 4 else ""
            return TensorSpec(name, shape, dtype, layout, batched)
        if name in touches_a and len(shape) == 4:
            return TensorSpec(name, _nhwc(shape), dtype, "NHWC", batched)
        return TensorSpec(name, shape, dtype, "", batched)  # as the model has it (ONNX does not record layouts)

    return spec


def _segment(
    k: int,
    track: str,
    nodes: list[onnx.NodeProto],
    b: _Boundaries,
    model: onnx.ModelProto,
    cfg: BuildConfig,
    specs: dict,
    ctx: SupportContext,
    spec: Callable[[str], TensorSpec],
) -> tuple[Segment, onnx.ModelProto]:
    """Segment ``k`` of the plan, its kernel calls lowered where it is on Track A, and its ONNX model."""
    ins, outs = [spec(t) for t in b.inputs], [spec(t) for t in b.outputs]
    seg_model = extract_segment(model, nodes, ins, outs, nhwc=track == "B" and cfg.track_b.nhwc)
    calls: tuple[KernelCall, ...] = ()
    tensors: tuple[TensorSpec, ...] = ()
    if track == "A":
        calls = tuple(lower_track_a(nodes, model, specs, set(b.outputs), ctx))
        _check_model_outputs(k, calls, set(ctx.graph_outputs))
        boundary = {t.name for t in ins + outs}
        inner = [t for c in calls for t in c.outputs if t not in boundary]
        # 4-D tensors are NHWC on Track A; others (an attention's token tensors) as the graph has them.
        tensors = tuple(
            TensorSpec(t, _nhwc(specs[t][0]), specs[t][1], "NHWC")
            if len(specs[t][0]) == 4
            else TensorSpec(t, specs[t][0], specs[t][1])
            for t in inner
        )
    segment = Segment(
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
    return segment, seg_model


def _head_output(t: str, ctx: SupportContext) -> lower_head.Head | None:
    """The head whose call writes ``t``, or None."""
    producer = ctx.producers.get(t)
    return ctx.heads.found.get(producer.name) if producer is not None else None


def _check_model_outputs(k: int, calls: tuple[KernelCall, ...], graph_outputs: set[str]) -> None:
    """A Track A segment's calls write a model output only where they write the model's layout."""
    for c in calls:
        for t in c.outputs:
            if t in graph_outputs and c.op not in MODEL_LAYOUT_OPS:
                raise PartitionError(
                    f"Track A would write the model's own output '{t}' with {c.op} (segment {k}), which writes "
                    "NHWC; keep the last ops on Track B (narrow partition.track_a)"
                )


def _notes(assignment: Assignment, seg_track: list[str]) -> tuple[str, ...]:
    """The plan's notes: how the partition was chosen, the plan in one line, and each node's reason."""
    waits = sum(1 for k in range(len(seg_track) - 1) if seg_track[k] == "A" and seg_track[k + 1] == "B")
    all_b = sum(d.b_us for d in assignment.decisions)
    plan_line = (
        f"plan: {len(seg_track)} segment(s) ({' '.join(seg_track)}); host waits per inference: none where every "
        f"Track B module replays (FACTS 23), else {waits} (one per Track A -> Track B hand-over, FACTS 8); "
        f"estimated {assignment.estimate_us(len(seg_track)):.0f} us (Track B alone: {all_b:.0f} us); "
        f"Track A computes {100 * assignment.track_a_flop_share():.1f}% of the FLOPs"
    )
    return (*assignment.notes, plan_line, *assignment.by_op(), *assignment.grouped())


def _check_input(cfg: BuildConfig, model: onnx.ModelProto, specs: dict) -> None:
    inp = model.graph.input[0]
    shape, dtype = specs[inp.name]
    want = cfg.input
    if want.name is not None and want.name != inp.name:
        raise PartitionError(
            f"input.name is '{want.name}' but the model's input is '{inp.name}'; fix `input.name` in the config"
        )
    if want.shape is not None and cfg.batch == "fixed" and tuple(want.shape) != tuple(shape):
        raise PartitionError(
            f"input.shape {list(want.shape)} does not match the model's input {list(shape)} (`batch: fixed`: "
            "all of it); fix `input.shape`"
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
