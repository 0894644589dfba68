"""Track A lowering of the normalisation family: which ONNX nodes one ``norm`` call takes.

A norm is a chain of nodes matched from its core node (:data:`CORE`, one matcher each) and lowered to
one call (``kernels.norm``):

- InstanceNormalization of an image (G = C groups), any epsilon;
- GroupNorm as torch's opset-17 export writes it: Reshape(x, [N, G, -1]) -> InstanceNormalization
  (scale ones, B zeros) -> Reshape(back to x's shape) [-> Mul(gamma[C,1,1])] [-> Add(beta[C,1,1])];
  and the GroupNormalization node (opset 18: per-group scale and bias; 21: per-channel);
- LayerNormalization over channels: Transpose(0,2,3,1) -> LayerNormalization(axis -1) ->
  Transpose(0,3,1,2) (the transposes are layout no-ops on Track A, which is NHWC already);
- BatchNormalization the export did not fold (inference mode): per-channel constants.

After the core chain, an Add of a same-shaped tensor (a residual) and an activation (any row of the
activation table, or SiLU as ``Mul(t, Sigmoid(t))``) join the call in either order. Casts between
links (an fp16 conversion's islands) are absorbed when the call's input and output keep one dtype.
Every intermediate tensor must have one reader and not be a graph output.

:func:`find_norms` answers for the whole graph once (``partition.SupportContext.norms``); the
partition charges the call to the chain's first node and emits it at its last one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from dualtrack.compiler import act_patterns
from dualtrack.compiler.lower_mobile import ACT_OPS, Facts, match_activation
from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import NORM_KINDS, NORM_RES, KernelCall, f32_bits

DESCRIPTION = (
    "InstanceNormalization, GroupNorm (torch's Reshape/InstanceNormalization/Reshape/Mul/Add export or "
    "GroupNormalization), LayerNormalization over channels (between NCHW<->NHWC Transposes), unfolded "
    "BatchNormalization, each with a following residual Add and activation fused"
)
CORE = ("InstanceNormalization", "GroupNormalization", "LayerNormalization", "BatchNormalization", "ReduceMean")
# Every op type a norm chain may hold (partition routes these nodes to the norm's answer).
_PARTS = ("Reshape", "Shape", "Transpose", "Cast", "Mul", "Add", "Sub", "Sqrt")
OPS = tuple(dict.fromkeys((*CORE, *_PARTS, *act_patterns.OPS, *ACT_OPS)))


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@dataclass(frozen=True)
class Norm:
    """One matched chain: its nodes in graph order and the call it lowers to."""

    nodes: tuple[str, ...]
    call: KernelCall


@dataclass
class Norms:
    """The graph's norms by node, and why a core node is not one."""

    found: dict[str, Norm] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def why(self, node: onnx.NodeProto) -> str | None:
        if node.name in self.found:
            return None
        # Another op type (Reshape, Transpose) outside a chain: no kernel of its own, as for any op.
        return self.refused.get(node.name, "no hand-written kernel")

    def kernel(self, node: onnx.NodeProto) -> str | None:
        """``norm`` for the chain's first node (its launch is charged there), None for the others."""
        return "norm" if self.found[node.name].nodes[0] == node.name else None


class _Chain:
    """A chain being matched: its nodes, its current tail tensor, and the graph it reads."""

    def __init__(self, facts: Facts, taken: set[str], x: str) -> None:
        self.facts, self.taken = facts, taken
        self.nodes: list[onnx.NodeProto] = []
        self.x, self.t = x, x
        self.eps: float | None = None  # a decomposed norm's epsilon (a core op's attribute otherwise)

    def sole(self, name: str | None = None) -> onnx.NodeProto | None:
        """The one reader of ``name`` (default the tail), skipping Casts; None where there are several,
        it is a graph output, or the reader is another lowering's."""
        name = name or self.t
        outs = {o.name for o in self.facts.model.graph.output}
        users = self.facts.consumers.get(name, [])
        if len(users) != 1 or name in outs or users[0].name in self.taken:
            return None
        return users[0]

    def take(self, node: onnx.NodeProto) -> None:
        self.nodes.append(node)
        self.t = node.output[0]

    def dtype(self, name: str) -> str:
        return self.facts.specs[name][1]

    def skip_casts(self) -> None:
        """Absorb an fp16 model's fp32 island around the chain: a Cast of x whose only reader is the
        chain's first node, and a Cast of the tail back to x's dtype."""
        cast = self.facts.producer.get(self.x)
        first = self.nodes[0] if self.nodes else None
        if cast is not None and cast.op_type == "Cast" and first is not None and self.sole(self.x) is first:
            self.nodes.insert(0, cast)
            self.x = cast.input[0]
        nxt = self.sole()
        back = nxt is not None and nxt.op_type == "Cast" and self.dtype(nxt.output[0]) == self.dtype(self.x)
        if back and nxt is not None and self.dtype(self.t) != self.dtype(self.x):
            self.take(nxt)


def _const_vec(facts: Facts, name: str, size: int) -> np.ndarray | None:
    v = facts.const(name)
    return None if v is None or v.size != size else v.reshape(-1)


def _channel_const(facts: Facts, node: onnx.NodeProto, t: str, c: int) -> str | None:
    """The constant operand of a Mul/Add of ``t`` by a per-channel (C,1,1) / (1,C,1,1) vector, or None."""
    if len(node.input) != 2 or t not in node.input:
        return None
    other = node.input[1] if node.input[0] == t else node.input[0]
    v = facts.const(other)
    if v is None or v.size != c or v.ndim < 3 or v.shape[-2:] != (1, 1):
        return None
    return other


def _group_chain(node: onnx.NodeProto, facts: Facts, ch: _Chain) -> tuple[str, str | None, list[str], int]:
    """InstanceNormalization alone (G = C) or inside torch's GroupNorm chain: (kind, why not, weights, G)."""
    shape = facts.shape(node.input[0])
    if len(shape) == 4:
        c = shape[1]
        if any(not facts.is_const(w) for w in node.input[1:3]):
            return "group", "scale or B computed at run time", [], 0
        ch.take(node)
        return "group", None, [node.input[1], node.input[2]], c
    before = facts.producer.get(node.input[0])
    if len(shape) != 3 or before is None or before.op_type != "Reshape" or len(facts.shape(before.input[0])) != 4:
        return "group", f"an InstanceNormalization of a rank-{len(shape)} tensor that is not torch's GroupNorm", [], 0
    x_shape, g = facts.shape(before.input[0]), shape[1]
    ones, zeros = _const_vec(facts, node.input[1], g), _const_vec(facts, node.input[2], g)
    if ones is None or zeros is None or np.any(ones != 1) or np.any(zeros != 0):
        return "group", "a GroupNorm whose InstanceNormalization has a scale or B other than ones and zeros", [], 0
    ch.x = ch.t = before.input[0]
    if ch.sole(before.output[0]) is not node:
        return "group", "its Reshape's output has other readers", [], 0
    ch.take(before)
    ch.take(node)
    after = ch.sole()
    if after is None or after.op_type != "Reshape" or facts.shape(after.output[0]) != x_shape:
        return "group", "its InstanceNormalization is not reshaped back to the image", [], 0
    shape_of = _shape_of_input(after, before.input[0], facts)
    if shape_of is False:
        return "group", "its InstanceNormalization is reshaped back by a shape computed at run time", [], 0
    if shape_of is not None:  # Reshape(.., Shape(x)): x's own shape, the chain's (no launch, no tensor)
        ch.nodes.append(shape_of)
    ch.take(after)
    return "group", None, _affine(ch, x_shape[1]), g


def _affine(ch: _Chain, c: int) -> list[str]:
    """The per-channel Mul (gamma) and Add (beta) by (C, 1, 1) constants after the chain's tail, taken:
    their constants in that order (a beta without a gamma stays an eltwise Add)."""
    weights: list[str] = []
    for op in ("Mul", "Add"):
        nxt = ch.sole()
        operand = _channel_const(ch.facts, nxt, ch.t, c) if nxt is not None and nxt.op_type == op else None
        if operand is None or nxt is None:
            break
        weights.append(operand)
        ch.take(nxt)
    return weights


def _shape_of_input(reshape: onnx.NodeProto, x: str, facts: Facts) -> onnx.NodeProto | bool | None:
    """None where the Reshape's target shape is a constant; the Shape node where it is Shape(x) of
    the chain's own input read by this Reshape alone (a decoder's GroupNorm when the batch is
    symbolic: the front end cannot fold it); False for any other shape computed at run time."""
    target = reshape.input[1] if len(reshape.input) > 1 else ""
    if facts.is_const(target):
        return None
    shape = facts.producer.get(target)
    whole = shape is not None and not any(a.name in ("start", "end") for a in shape.attribute)
    if whole and shape.op_type == "Shape" and shape.input[0] == x and len(facts.consumers.get(target, [])) == 1:
        return shape
    return False


def _group_norm(node: onnx.NodeProto, facts: Facts, ch: _Chain) -> tuple[str, str | None, list[str], int]:
    if len(facts.shape(node.input[0])) != 4:
        return "group", "a GroupNormalization of a tensor that is not an image", [], 0
    if any(not facts.is_const(w) for w in node.input[1:3]):
        return "group", "scale or bias computed at run time", [], 0
    ch.take(node)
    return "group", None, [node.input[1], node.input[2]], int(_attrs(node)["num_groups"])


def _layer_norm(node: onnx.NodeProto, facts: Facts, ch: _Chain) -> tuple[str, str | None, list[str], int]:
    before = facts.producer.get(node.input[0])
    if before is None or before.op_type != "Transpose" or list(_attrs(before).get("perm", [])) != [0, 2, 3, 1]:
        return "layer", "a LayerNormalization that is not over the channels of an NCHW image", [], 0
    a = _attrs(node)
    if a.get("axis", -1) not in (-1, 3) or len([o for o in node.output if o]) != 1:
        return "layer", "a LayerNormalization over more than the last axis, or with Mean/InvStdDev outputs", [], 0
    if any(w and not facts.is_const(w) for w in node.input[1:3]):
        return "layer", "scale or bias computed at run time", [], 0
    ch.x = ch.t = before.input[0]
    if ch.sole(before.output[0]) is not node:
        return "layer", "its Transpose's output has other readers", [], 0
    ch.take(before)
    ch.take(node)
    after = ch.sole()
    if after is None or after.op_type != "Transpose" or list(_attrs(after).get("perm", [])) != [0, 3, 1, 2]:
        return "layer", "its output is not transposed back to NCHW", [], 0
    ch.take(after)
    return "layer", None, [w for w in node.input[1:3] if w], 1


def _channel_mean(node: onnx.NodeProto | None, facts: Facts) -> bool:
    """Whether ``node`` is a ReduceMean over the channels (axis 1) of an image that keeps its dims."""
    if node is None or node.op_type != "ReduceMean" or len(facts.shape(node.input[0])) != 4:
        return False
    a = _attrs(node)
    axes = a.get("axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        v = facts.const(node.input[1])
        axes = None if v is None else v.reshape(-1).tolist()
    return a.get("keepdims", 1) == 1 and axes is not None and [int(k) % 4 for k in axes] == [1]


def _fp32_island(node: onnx.NodeProto, facts: Facts) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None]:
    """The Casts around a reduction an fp16 model keeps in fp32 (frontend.FP32_REDUCTIONS), each None
    where absent: the Cast up that alone feeds ``node`` and the Cast back that alone reads it."""
    up = facts.producer.get(node.input[0])
    if up is None or up.op_type != "Cast" or facts.consumers.get(up.output[0], []) != [node]:
        up = None
    users = facts.consumers.get(node.output[0], [])
    down = users[0] if len(users) == 1 and users[0].op_type == "Cast" else None
    return up, down


def _layer_decomposed(node: onnx.NodeProto, facts: Facts, ch: _Chain) -> tuple[str, str | None, list[str], int]:
    """A LayerNorm over the channels of an NCHW image written out, as ConvNeXt's ``LayerNorm(...,
    data_format="channels_first")`` and many hand-written blocks do: u = mean_c(x); d = x - u;
    v = mean_c(d^2) (Pow 2 or d * d); y = d / sqrt(v + eps); then the per-channel affine."""
    why = "a ReduceMean that is not the mean over the channels of a decomposed LayerNorm"
    if not _channel_mean(node, facts):
        return "layer", why, [], 0
    up, down = _fp32_island(node, facts)
    x = up.input[0] if up is not None else node.input[0]
    u = down.output[0] if down is not None else node.output[0]
    sub = next(iter(facts.consumers.get(u, [])), None)
    if sub is None or sub.op_type != "Sub" or list(sub.input) != [x, u] or len(facts.consumers[u]) != 1:
        return "layer", why, [], 0
    d = sub.output[0]
    readers = {id(n): n for n in facts.consumers.get(d, [])}.values()
    sq = next(
        (n for n in readers if n.op_type == "Pow" and n.input[0] == d and _scalar(facts, n.input[1]) == 2.0), None
    )
    sq = sq or next((n for n in readers if n.op_type == "Mul" and list(n.input) == [d, d]), None)
    div = next((n for n in readers if n.op_type == "Div" and list(n.input[:1]) == [d]), None)
    if sq is None or div is None or len(list(readers)) != 2 or len(facts.consumers.get(sq.output[0], [])) != 1:
        return "layer", why, [], 0
    var = facts.consumers[sq.output[0]][0]
    var_up = var if var.op_type == "Cast" else None
    if var_up is not None:
        var = next(iter(facts.consumers.get(var_up.output[0], [])), None)
    if not _channel_mean(var, facts):
        return "layer", why, [], 0
    var_up2, var_down = _fp32_island(var, facts)
    if (var_up is None) != (var_up2 is None):
        return "layer", why, [], 0
    v = var_down.output[0] if var_down is not None else var.output[0]
    plus = next(iter(facts.consumers.get(v, [])), None)
    eps = _scalar(facts, plus.input[1] if plus is not None and plus.input[0] == v else plus.input[0]) if plus else None
    if plus is None or plus.op_type != "Add" or eps is None or len(facts.consumers[v]) != 1:
        return "layer", why, [], 0
    root = facts.consumers.get(plus.output[0], [])
    if len(root) != 1 or root[0].op_type != "Sqrt" or facts.consumers.get(root[0].output[0], []) != [div]:
        return "layer", why, [], 0
    if list(div.input) != [d, root[0].output[0]]:
        return "layer", why, [], 0
    chain = [up, node, down, sub, sq, var_up, var, var_down, plus, root[0], div]
    inner = [n for n in chain if n is not None]
    if any(n.name in ch.taken for n in inner):
        return "layer", "its nodes are another lowering's", [], 0
    ch.x = x
    for n in inner:
        ch.take(n)
    ch.eps = eps
    c = facts.shape(x)[1]
    return "layer", None, _affine(ch, c), 1


def _scalar(facts: Facts, name: str) -> float | None:
    v = facts.const(name)
    return float(v.reshape(())) if v is not None and v.size == 1 else None


def _batch_norm(node: onnx.NodeProto, facts: Facts, ch: _Chain) -> tuple[str, str | None, list[str], int]:
    if len(facts.shape(node.input[0])) != 4 or _attrs(node).get("training_mode", 0):
        return "affine", "a BatchNormalization in training mode or not of an image", [], 0
    if any(not facts.is_const(w) for w in node.input[1:5]) or len([o for o in node.output if o]) != 1:
        return "affine", "statistics computed at run time, or running-statistics outputs", [], 0
    ch.take(node)
    return "affine", None, list(node.input[1:5]), 1


_MATCHERS: dict[str, Callable[[onnx.NodeProto, Facts, _Chain], tuple[str, str | None, list[str], int]]] = {
    "InstanceNormalization": _group_chain,
    "GroupNormalization": _group_norm,
    "LayerNormalization": _layer_norm,
    "BatchNormalization": _batch_norm,
    "ReduceMean": _layer_decomposed,
}


def _residual(ch: _Chain) -> str | None:
    """An Add of the tail and a same-shaped computed tensor: taken, its other operand returned."""
    nxt = ch.sole()
    if nxt is None or nxt.op_type != "Add" or len(nxt.input) != 2 or ch.t not in nxt.input:
        return None
    other = nxt.input[1] if nxt.input[0] == ch.t else nxt.input[0]
    spec, mine = ch.facts.specs.get(other), ch.facts.specs.get(ch.t)
    if other == ch.t or ch.facts.is_const(other) or spec != mine or spec is None or spec[1] != ch.facts.specs[ch.x][1]:
        return None
    ch.take(nxt)
    return other


def _activation(ch: _Chain) -> Activation | None:
    """An activation of the tail (a row of the table, or one the exporters write as several nodes:
    :func:`act_patterns.decomposed`'s SiLU, GELU, Mish): taken."""
    t, nxt = ch.t, ch.sole()
    if nxt is not None and nxt.input[:1] == [t]:
        act, _ = match_activation(nxt, ch.facts.const)
        if act is not None:
            ch.take(nxt)
            return act
    outs = {o.name for o in ch.facts.model.graph.output}
    found = act_patterns.decomposed(
        t, ch.facts.consumers, lambda n: n.name not in ch.taken, lambda x: x not in outs, ch.facts.const
    )
    if found is None:
        return None
    act, nodes, _ = found
    for n in nodes:
        ch.take(n)
    return act


def match(node: onnx.NodeProto, facts: Facts, taken: set[str]) -> tuple[Norm | None, str | None]:
    """The norm whose core is ``node`` (one of :data:`CORE`), or (None, why not)."""
    ch = _Chain(facts, taken, node.input[0])
    kind, why, weights, groups = _MATCHERS[node.op_type](node, facts, ch)
    if why:
        return None, why
    ch.skip_casts()
    res, r = "none", _residual(ch)
    if r is not None:
        res = "before_act"
    act = _activation(ch)
    if r is None and act is not None and (r := _residual(ch)) is not None:
        res = "after_act"
    ch.skip_casts()
    x_spec, y_spec = facts.specs[ch.x], facts.specs[ch.t]
    if x_spec != y_spec and ch.nodes[0].op_type == "Cast":
        # A Cast into the chain with none back out is not an fp32 island around this norm but the end
        # of another's (BiSeNetV2's BatchNorm of an fp16 model's pooled vector, after the pool's Cast
        # down): the chain starts after it.
        ch.x = ch.nodes.pop(0).output[0]
        x_spec = facts.specs[ch.x]
    if x_spec != y_spec:
        return None, f"the chain turns {x_spec} into {y_spec} (the kernel keeps the shape and dtype)"
    c = x_spec[0][1]
    core = next(n for n in ch.nodes if n.op_type in CORE)
    eps = ch.eps if ch.eps is not None else float(_attrs(core).get("epsilon", 1e-5))
    attrs = (
        ("kind", NORM_KINDS[kind]), ("groups", groups), ("C", c), ("eps", f32_bits(eps)), ("res", NORM_RES[res]),
        *(act or Activation()).attrs(),
    )  # fmt: skip
    inputs = (ch.x, r) if r is not None else (ch.x,)
    order = {n.name: i for i, n in enumerate(facts.model.graph.node)}
    nodes = tuple(sorted((n.name for n in ch.nodes), key=order.__getitem__))
    return Norm(nodes, KernelCall("norm", inputs, (ch.t,), tuple(weights), attrs, nodes)), None


def find_norms(facts: Facts, taken: set[str]) -> Norms:
    """Every norm of the graph whose nodes no other lowering has ``taken`` (conv epilogues, heads)."""
    norms = Norms()
    busy = set(taken)
    for node in facts.model.graph.node:
        if node.op_type not in CORE or node.name in busy:
            continue
        found, why = match(node, facts, busy)
        if found is None:
            norms.refused[node.name] = why or "no match"
            continue
        busy.update(found.nodes)
        norms.found.update((name, found) for name in found.nodes)
    return norms
