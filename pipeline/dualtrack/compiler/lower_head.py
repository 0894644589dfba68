"""Track A lowering of a segmentation head's post-processing: which ONNX nodes the seghead kernel
takes (one call for all of them), and the call they become.

A *head* is what the front end's image wrap appends (`post/*`, frontend.wrap_image_io) or a model
ends with in the same shape (the reference U-Net's Softmax -> Cast `probs`, ArgMax -> Cast `mask`):

    L (N, C, H, W) float --[Cast | Identity]* -- Softmax(axis 1) | Sigmoid | nothing --[Cast | Identity]*--> T
    T --ArgMax(axis 1, select_last_index 0)--> Cast(uint8) --> mask        (a graph output)
      or, one class:  Greater(T, constant) [--Squeeze(axes [1])] --> Cast(uint8) --> mask
    a tensor of the chain L..T --[Cast | Identity]*--> probs               (a graph output, float)

The kernel reads L (NHWC on Track A) once and writes both graph outputs in the model's layout
(probs NCHW, mask (N, H, W)): the whole head is one call, ``seghead``. The fp16 roundings the
chain's Casts and tensors make are the call's flags (plan.HEAD_FLAGS): where the logits are
rounded before the activation, and whether the probabilities written and the values the mask
compares are fp16-rounded. Every tensor inside the head must be read by head nodes alone.

:func:`find_heads` finds every head of a model once (``partition.SupportContext`` keeps them);
a head whose shape is off gives each node it walked the reason. Like :mod:`lower_mobile`, this
module reads ONNX and writes plan attrs; the kernel's own limits (``SegHeadSpec.supports``) are the
partition's to ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from dualtrack.compiler.lower_mobile import Facts, cast_sandwich
from dualtrack.contract.plan import HEAD_ACTS, HEAD_FLAGS, KernelCall, f32_bits

DESCRIPTION = (
    "a segmentation head: Softmax over the classes / Sigmoid / none, its probabilities and its ArgMax "
    "(or one-class threshold) mask as the model's outputs, with the Casts and Identities between"
)
OPS = ("Softmax", "Sigmoid", "Identity", "Cast", "ArgMax", "Greater", "Squeeze")  # the op types a head has
ACTS = {"Softmax": "softmax", "Sigmoid": "sigmoid"}
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


@dataclass(frozen=True)
class Head:
    """One head: the logits it reads, the two graph outputs it writes, its nodes (graph order), its
    class count and its call's attrs (plan.HEAD_ACTS / HEAD_FLAGS)."""

    logits: str
    probs: str
    mask: str
    nodes: tuple[str, ...]
    classes: int
    attrs: tuple[tuple[str, int], ...]

    def call(self) -> KernelCall:
        return KernelCall("seghead", (self.logits,), (self.probs, self.mask), (), self.attrs, self.nodes)


@dataclass(frozen=True)
class Heads:
    """Every head of a model by node name, and for the nodes of a would-be head why it is not one."""

    found: dict[str, Head] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def why(self, node: onnx.NodeProto) -> str | None:
        """None for a node of a head, else why it is not in one."""
        if node.name in self.found:
            return None
        return self.refused.get(node.name, f"{node.op_type} outside a segmentation head ({DESCRIPTION})")


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _axis_is_classes(axis: int) -> bool:
    return axis in (1, -3)  # of a 4-D tensor


def _float_cast(node: onnx.NodeProto, facts: Facts) -> bool:
    """A Cast between float32 and float16 that is not the fp32 island of a pool or Resize (lower_mobile's)."""
    return (
        node.op_type == "Cast"
        and _attrs(node).get("to") in _FLOATS
        and facts.specs.get(node.input[0], ((), ""))[1] in ("float16", "float32")
        and cast_sandwich(node, facts) is None
    )


class _NotAHead(Exception):
    pass


def _mask_nodes(mask: str, facts: Facts) -> tuple[list[onnx.NodeProto], str, float | None]:
    """(the nodes from T to the mask, T, the threshold or None)."""
    cast = facts.producer.get(mask)
    if cast is None or cast.op_type != "Cast" or _attrs(cast).get("to") != TensorProto.UINT8:
        raise _NotAHead("the uint8 output is not a Cast to uint8")
    pick = facts.producer.get(cast.input[0])
    if pick is None:
        raise _NotAHead("the mask is cast from a model input")
    nodes = [cast, pick]
    if pick.op_type == "ArgMax":
        a = _attrs(pick)
        if not _axis_is_classes(int(a.get("axis", 0))) or a.get("select_last_index", 0) != 0:
            raise _NotAHead(
                f"ArgMax axis {a.get('axis', 0)} select_last_index {a.get('select_last_index', 0)} "
                "(the kernel takes axis 1, the first of equal values)"
            )
        return nodes, pick.input[0], None
    greater = pick
    if pick.op_type == "Squeeze":
        axes = facts.const(pick.input[1]) if len(pick.input) > 1 else None
        axes = axes.tolist() if axes is not None else _attrs(pick).get("axes")
        if axes is None or [int(v) for v in axes] not in ([1], [-3]):
            raise _NotAHead(f"Squeeze axes {axes} (the one-class mask squeezes axis 1)")
        greater = facts.producer.get(pick.input[0])
        if greater is None:
            raise _NotAHead("the mask squeezes a model input")
        nodes.append(greater)
    if greater.op_type != "Greater":
        raise _NotAHead(f"the mask comes from {greater.op_type}, not ArgMax or a Greater threshold")
    thr = facts.const(greater.input[1])
    if thr is None or thr.size != 1:
        raise _NotAHead("a threshold that is not one constant")
    return nodes, greater.input[0], float(thr.reshape(()))


def _value_chain(t: str, facts: Facts) -> tuple[list[onnx.NodeProto], list[str], onnx.NodeProto | None]:
    """Up from ``t`` through Casts, Identities and at most one activation: (nodes, tensors from ``t``
    to the logits, the activation or None). The last tensor is the logits L."""
    nodes, tensors, act = [], [t], None
    while (prod := facts.producer.get(t)) is not None:
        if prod.op_type == "Identity" or _float_cast(prod, facts):
            pass
        elif prod.op_type in ACTS and act is None:
            act = prod
        else:
            break
        nodes.append(prod)
        t = prod.input[0]
        tensors.append(t)
    return nodes, tensors, act


def _probs_tail(facts: Facts, chain: list[str], outputs: list[str]) -> tuple[str, list[onnx.NodeProto], str]:
    """(the probabilities output, its Casts/Identities up to the chain, the chain tensor it leaves from)."""
    for out in outputs:
        tail, t = [], out
        while t not in chain:
            prod = facts.producer.get(t)
            if prod is None or not (prod.op_type == "Identity" or _float_cast(prod, facts)):
                break
            tail.append(prod)
            t = prod.input[0]
        if t in chain:
            return out, tail, t
    raise _NotAHead("no float output of the model holds the probabilities the mask is computed from")


def _head(mask: str, facts: Facts, seen: list[onnx.NodeProto]) -> Head:
    graph_outputs = [o.name for o in facts.model.graph.output]
    mask_nodes, t, threshold = _mask_nodes(mask, facts)
    seen += mask_nodes
    chain_nodes, chain, act = _value_chain(t, facts)
    seen += chain_nodes
    logits = chain[-1]
    shape, dtype = facts.specs.get(logits, ((), ""))
    if len(shape) != 4 or dtype not in ("float16", "float32"):
        raise _NotAHead(f"logits {list(shape)} {dtype}, not a float (N, classes, H, W) tensor")
    floats = [o for o in graph_outputs if o != mask and facts.specs.get(o, ((), ""))[1] in ("float16", "float32")]
    probs, tail, branch = _probs_tail(facts, chain, floats)
    seen += tail
    if act is not None:
        a = _attrs(act)
        if act.op_type == "Softmax" and (_opset(facts.model) < 13 or not _axis_is_classes(int(a.get("axis", -1)))):
            raise _NotAHead(
                f"Softmax axis {a.get('axis', -1)} at opset {_opset(facts.model)} (the kernel normalises over "
                "the classes: axis 1, opset 13 or later)"
            )
        at = chain.index(act.output[0])
        if chain.index(branch) > at:
            raise _NotAHead("the mask compares the activation's output, the probabilities are taken before it")
    nodes = {n.name for n in (*mask_nodes, *chain_nodes, *tail)}
    ends = {probs, mask}
    for n in (*mask_nodes, *chain_nodes, *tail):
        for o in n.output:
            readers = facts.consumers.get(o, [])
            if o not in ends and (o in graph_outputs or any(r.name not in nodes for r in readers)):
                raise _NotAHead(f"'{o}' inside the head is read outside it")

    def f16(tensors: list[str]) -> bool:
        return any(facts.specs.get(x, ((), ""))[1] == "float16" for x in tensors)

    # The tensors whose fp16 dtype rounds what the kernel computes: before the activation (L itself
    # aside: its values are what they are), after it up to T, and after it up to the probabilities.
    b, tail_out = chain.index(branch), [o for n in tail for o in n.output]
    if act is None:  # the values are the logits'
        in_chain, arg_chain, probs_chain = [], chain[:-1], [*chain[b:-1], *tail_out]
    else:
        in_chain, arg_chain, probs_chain = chain[at + 1 : -1], chain[: at + 1], [*chain[b : at + 1], *tail_out]
    flags = {
        "round_in": f16(in_chain), "round_probs": f16(probs_chain), "round_arg": f16(arg_chain),
        "probs_f16": facts.specs[probs][1] == "float16", "threshold": threshold is not None,
    }  # fmt: skip
    attrs = (
        ("act", HEAD_ACTS[ACTS[act.op_type]] if act is not None else HEAD_ACTS["none"]),
        ("flags", sum(HEAD_FLAGS[k] for k, on in flags.items() if on)),
        ("thr", f32_bits(threshold or 0.0)),
    )
    order = {n.name: i for i, n in enumerate(facts.model.graph.node)}
    return Head(logits, probs, mask, tuple(sorted(nodes, key=order.__getitem__)), shape[1], attrs)


def find_heads(facts: Facts) -> Heads:
    """Every head of the model (one per uint8 graph output that is a class mask), and for the nodes
    of a uint8 output's would-be head the reason it is not one the kernel can take."""
    heads = Heads()
    for out in facts.model.graph.output:
        if facts.specs.get(out.name, ((), ""))[1] != "uint8":
            continue
        seen: list[onnx.NodeProto] = []
        try:
            head = _head(out.name, facts, seen)
        except _NotAHead as e:
            for n in seen:
                heads.refused.setdefault(n.name, f"not a segmentation head the kernel takes: {e}")
            continue
        heads.found.update((n, head) for n in head.nodes)
    return heads
