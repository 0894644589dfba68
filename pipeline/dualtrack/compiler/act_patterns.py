"""Activations that exporters write as several nodes, matched back to one row of the activation table.

At the opsets users export at (17, 18) there is no Gelu op, and SiLU never had one. torch writes
``x * sigmoid(x)`` as Mul(x, Sigmoid(x)) and Mish below opset 18 as Mul(x, Tanh(Softplus(x))). Erf-GELU
is Div(x, sqrt 2) (or Mul(x, 1/sqrt 2)), Erf, Add 1, then the products by x and by 0.5 in any order:
(x * y) * 0.5 and (x * 0.5) * y from the TorchScript exporter, x * (0.5 * y) from the dynamo exporter.
Tanh-GELU is the cube (x*x*x, or Pow(x, 3) from dynamo), Mul 0.044715, Add x, Mul sqrt(2/pi), Tanh,
Add 1, and the same two products. The dynamo exporter writes softplus's threshold too:
Where(x > 20, x, Softplus(x)). Older MobileNetV3 code writes hardswish and its squeeze-excitation gate
as x * relu6(x + 3) / 6 and relu6(x + 3) / 6 (Add 3, Clip(0, 6), Div 6 or Mul 1/6, Mul x), and both
exporters write softsign as x / (1 + |x|) (Abs, Add 1, Div).
:func:`decomposed` finds such a chain starting at a tensor ``t``, so that a convolution's epilogue
(``partition._fuse_epilogue``), a norm's apply pass (``lower_norm``) or one eltwise call
(``lower_mobile.find_act_chains``) computes it as the row it is. Every intermediate of the chain must
be read by the chain alone (``private``), so nothing the chain computes is needed elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import onnx

from dualtrack.contract.activations import Activation

Const = Callable[[str], np.ndarray | None]
# How far a constant of the pattern may sit from its exact value: the fp32 and fp16 spellings of sqrt(2) and
# 1/sqrt(2) (an fp16 model's constants are rounded to 11 bits: 1.4140625, 2^-11 relative at most).
_REL = 1e-3


class _Chain:
    """The graph around ``t`` as one pattern walk sees it."""

    def __init__(
        self, consumers: Mapping[str, list[onnx.NodeProto]], usable: Callable[[onnx.NodeProto], bool], const: Const
    ) -> None:
        self.consumers, self.usable, self.const = consumers, usable, const

    def readers(self, t: str) -> list[onnx.NodeProto]:
        return list(self.consumers.get(t, []))

    def sole(self, t: str, op: str) -> onnx.NodeProto | None:
        """The one node reading ``t``, if it is an ``op`` this walk may take."""
        users = self.readers(t)
        if len(users) == 1 and users[0].op_type == op and self.usable(users[0]):
            return users[0]
        return None

    def scalar(self, node: onnx.NodeProto, t: str) -> float | None:
        """The constant scalar that binary ``node`` combines with ``t``, or None."""
        if len(node.input) != 2 or t not in node.input or node.input[0] == node.input[1]:
            return None
        other = node.input[1] if node.input[0] == t else node.input[0]
        value = self.const(other)
        return float(value.reshape(())) if value is not None and value.size == 1 else None


def _near(value: float | None, want: float) -> bool:
    return value is not None and abs(value - want) <= _REL * abs(want)


def _silu(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    users = ch.readers(t)
    sig = next((u for u in users if u.op_type == "Sigmoid"), None)
    mul = next((u for u in users if u.op_type == "Mul"), None)
    if len(users) != 2 or sig is None or mul is None or not (ch.usable(sig) and ch.usable(mul)):
        return None
    if sorted(mul.input) != sorted([t, sig.output[0]]) or ch.readers(sig.output[0]) != [mul]:
        return None
    return Activation.named("silu"), [sig, mul], mul.output[0]


def _mish(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """x * tanh(softplus(x)), as torch writes nn.Mish below opset 18 (which has a Mish op)."""
    users = ch.readers(t)
    soft = next((u for u in users if u.op_type == "Softplus"), None)
    mul = next((u for u in users if u.op_type == "Mul"), None)
    if len(users) != 2 or soft is None or mul is None or not (ch.usable(soft) and ch.usable(mul)):
        return None
    tanh = ch.sole(soft.output[0], "Tanh")
    if tanh is None or sorted(mul.input) != sorted([t, tanh.output[0]]) or ch.readers(tanh.output[0]) != [mul]:
        return None
    return Activation.named("mish"), [soft, tanh, mul], mul.output[0]


def _times_x_and_half(t: str, y: str, other: onnx.NodeProto, ch: _Chain) -> tuple[list[onnx.NodeProto], str] | None:
    """The two products that finish a GELU, 0.5 * x * y, from ``y`` (1 + erf or 1 + tanh), where ``other``
    is the product node that reads x (``t``) besides the chain: (x * y) * 0.5, (x * 0.5) * y, or
    x * (0.5 * y) as the dynamo exporter writes it. Their nodes in graph order and the output."""
    if other.op_type != "Mul":
        return None
    if sorted(other.input) == sorted([t, y]) and ch.readers(y) == [other]:  # (x * y) * 0.5
        half = ch.sole(other.output[0], "Mul")
        if half is None or not _near(ch.scalar(half, other.output[0]), 0.5):
            return None
        return [other, half], half.output[0]
    if _near(ch.scalar(other, t), 0.5):  # (x * 0.5) * y
        last = ch.sole(y, "Mul")
        if last is None or sorted(last.input) != sorted([other.output[0], y]) or ch.readers(other.output[0]) != [last]:
            return None
        return [other, last], last.output[0]
    half = ch.sole(y, "Mul")  # x * (0.5 * y)
    if half is None or not _near(ch.scalar(half, y), 0.5) or ch.readers(half.output[0]) != [other]:
        return None
    if sorted(other.input) != sorted([t, half.output[0]]):
        return None
    return [half, other], other.output[0]


def _gelu(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """0.5 * x * (1 + erf(x / sqrt 2)): x read by the scaling into Erf and by one Mul."""
    users = ch.readers(t)
    if len(users) != 2 or not all(ch.usable(u) for u in users):
        return None
    scale = next((u for u in users if _erf_scale(u, t, ch)), None)
    if scale is None:
        return None
    other = users[1] if users[0] is scale else users[0]
    erf = ch.sole(scale.output[0], "Erf")
    plus = ch.sole(erf.output[0], "Add") if erf is not None else None
    if plus is None or not _near(ch.scalar(plus, erf.output[0]), 1.0):
        return None
    tail = _times_x_and_half(t, plus.output[0], other, ch)
    if tail is None:
        return None
    return Activation.named("gelu"), [scale, erf, plus, *tail[0]], tail[1]


def _cube(t: str, ch: _Chain) -> tuple[list[onnx.NodeProto], str] | None:
    """x^3 as Mul(x, Mul(x, x)) or Pow(x, 3): its nodes and output."""
    users = ch.readers(t)
    pw = next((u for u in users if u.op_type == "Pow" and u.input[0] == t and _near(ch.scalar(u, t), 3.0)), None)
    if pw is not None and ch.usable(pw):
        return [pw], pw.output[0]
    sq = next((u for u in users if u.op_type == "Mul" and list(u.input) == [t, t]), None)
    cube = ch.sole(sq.output[0], "Mul") if sq is not None else None
    if cube is None or sorted(cube.input) != sorted([t, sq.output[0]]):
        return None
    return [sq, cube], cube.output[0]


def _gelu_tanh(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as torch writes
    ``gelu(approximate="tanh")``: the cube x*x*x (TorchScript) or Pow(x, 3) (dynamo), and the inner Add and
    the outer product reading x besides."""
    users = list({id(u): u for u in ch.readers(t)}.values())
    if not all(ch.usable(u) for u in users):
        return None
    cubed = _cube(t, ch)
    if cubed is None:
        return None
    head, c3 = cubed
    kappa = ch.sole(c3, "Mul")
    if kappa is None or not _near(ch.scalar(kappa, c3), 0.044715):
        return None
    inner = ch.sole(kappa.output[0], "Add")
    if inner is None or sorted(inner.input) != sorted([t, kappa.output[0]]):
        return None
    scale = ch.sole(inner.output[0], "Mul")
    if scale is None or not _near(ch.scalar(scale, inner.output[0]), math.sqrt(2.0 / math.pi)):
        return None
    tanh = ch.sole(scale.output[0], "Tanh")
    plus = ch.sole(tanh.output[0], "Add") if tanh is not None else None
    if plus is None or not _near(ch.scalar(plus, tanh.output[0]), 1.0):
        return None
    # x's readers: the cube's first node(s), the inner Add, and the one product that finishes the GELU.
    known = {id(n) for n in head if t in n.input} | {id(inner)}
    rest = [u for u in users if id(u) not in known]
    if len(rest) != 1:
        return None
    tail = _times_x_and_half(t, plus.output[0], rest[0], ch)
    if tail is None:
        return None
    return Activation.named("gelu_tanh"), [*head, kappa, inner, scale, tanh, plus, *tail[0]], tail[1]


def _softplus(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """torch's softplus (beta 1) as the dynamo exporter writes its threshold: Where(x > thr, x, Softplus(x)).
    Past a threshold of 15 or more the two branches differ by log1p(exp(-thr)) < 3.1e-7, below fp32's
    rounding of x there: the chain is Softplus."""
    users = list({id(u): u for u in ch.readers(t)}.values())
    sp = next((u for u in users if u.op_type == "Softplus"), None)
    gt = next((u for u in users if u.op_type == "Greater" and u.input[0] == t), None)
    if len(users) != 3 or sp is None or gt is None or not all(ch.usable(u) for u in users):
        return None
    thr = ch.scalar(gt, t)
    where = ch.sole(gt.output[0], "Where")
    if thr is None or thr < 15.0 or where is None or list(where.input) != [gt.output[0], t, sp.output[0]]:
        return None
    if ch.readers(sp.output[0]) != [where]:
        return None
    return Activation.named("softplus"), [sp, gt, where], where.output[0]


def _relu6_of_x_plus_3(t: str, add: onnx.NodeProto, ch: _Chain) -> onnx.NodeProto | None:
    """The Clip(x + 3, 0, 6) (torch's relu6 / hardtanh(0, 6)) that ``add``, an Add of x and 3, feeds."""
    if add.op_type != "Add" or not _near(ch.scalar(add, t), 3.0):
        return None
    clip = ch.sole(add.output[0], "Clip")
    if clip is None or len(clip.input) != 3 or clip.input[0] != add.output[0]:
        return None
    lo, hi = ch.const(clip.input[1]), ch.const(clip.input[2])
    ok = lo is not None and hi is not None and lo.size == 1 and hi.size == 1
    return clip if ok and float(lo.reshape(())) == 0.0 and float(hi.reshape(())) == 6.0 else None


def _over_6(node: onnx.NodeProto | None, t: str, ch: _Chain) -> bool:
    """Whether ``node`` is t / 6 or t * (1 / 6)."""
    if node is not None and node.op_type == "Div":
        return node.input[0] == t and _near(ch.scalar(node, t), 6.0)
    return node is not None and node.op_type == "Mul" and _near(ch.scalar(node, t), 1.0 / 6.0)


def _sixth(t: str, ch: _Chain) -> onnx.NodeProto | None:
    users = ch.readers(t)
    return users[0] if len(users) == 1 and ch.usable(users[0]) and _over_6(users[0], t, ch) else None


def _hardswish(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """x * relu6(x + 3) / 6 as older MobileNetV3 code writes it: x * (relu6(x + 3) / 6), or
    (x * relu6(x + 3)) / 6."""
    users = ch.readers(t)
    add = next((u for u in users if u.op_type == "Add"), None)
    mul = next((u for u in users if u.op_type == "Mul"), None)
    if len(users) != 2 or add is None or mul is None or not (ch.usable(add) and ch.usable(mul)):
        return None
    clip = _relu6_of_x_plus_3(t, add, ch)
    if clip is None:
        return None
    sixth = _sixth(clip.output[0], ch)
    if sixth is not None and sorted(mul.input) == sorted([t, sixth.output[0]]) and ch.readers(sixth.output[0]) == [mul]:
        return Activation.named("hardswish"), [add, clip, sixth, mul], mul.output[0]
    if sorted(mul.input) == sorted([t, clip.output[0]]) and ch.readers(clip.output[0]) == [mul]:
        last = _sixth(mul.output[0], ch)
        if last is not None:
            return Activation.named("hardswish"), [add, clip, mul, last], last.output[0]
    return None


def _hardsigmoid(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """relu6(x + 3) / 6: HardSigmoid(alpha 1/6, beta 0.5), the gate of older squeeze-excitation code."""
    users = ch.readers(t)
    if len(users) != 1 or not ch.usable(users[0]):
        return None
    clip = _relu6_of_x_plus_3(t, users[0], ch)
    sixth = _sixth(clip.output[0], ch) if clip is not None else None
    if sixth is None:
        return None
    return Activation.named("hardsigmoid", 1.0 / 6.0, 0.5), [users[0], clip, sixth], sixth.output[0]


def _erf_scale(node: onnx.NodeProto, t: str, ch: _Chain) -> bool:
    """Whether ``node`` is x / sqrt 2 or x * (1 / sqrt 2), with x as its first operand for Div."""
    if node.op_type == "Div" and node.input[0] == t:
        return _near(ch.scalar(node, t), math.sqrt(2.0))
    return node.op_type == "Mul" and _near(ch.scalar(node, t), 1.0 / math.sqrt(2.0))


def _softsign(t: str, ch: _Chain) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """x / (1 + |x|): both exporters write nn.Softsign as Abs, Add 1, Div (ONNX's Softsign op unused)."""
    users = ch.readers(t)
    absn = next((u for u in users if u.op_type == "Abs"), None)
    div = next((u for u in users if u.op_type == "Div"), None)
    if len(users) != 2 or absn is None or div is None or not (ch.usable(absn) and ch.usable(div)):
        return None
    add = ch.sole(absn.output[0], "Add")
    if add is None or not _near(ch.scalar(add, absn.output[0]), 1.0):
        return None
    if list(div.input) != [t, add.output[0]] or ch.readers(add.output[0]) != [div]:
        return None
    return Activation.named("softsign"), [absn, add, div], div.output[0]


PATTERNS = (_silu, _mish, _gelu, _gelu_tanh, _softplus, _hardswish, _hardsigmoid, _softsign)
# The op types the patterns' nodes have.
OPS = ("Sigmoid", "Mul", "Div", "Erf", "Add", "Tanh", "Softplus", "Pow", "Greater", "Where", "Clip", "Abs")


def decomposed(
    t: str,
    consumers: Mapping[str, list[onnx.NodeProto]],
    usable: Callable[[onnx.NodeProto], bool],
    private: Callable[[str], bool],
    const: Const,
) -> tuple[Activation, list[onnx.NodeProto], str] | None:
    """The activation a chain of nodes computes from ``t`` (the module's docstring): its row, the
    nodes in graph order, and the tensor it ends in; None where no pattern matches. ``usable``: may
    this node be taken (in the caller's segment, not claimed by another fusion); ``private``: is this
    tensor read by the graph's nodes alone (not an output the caller sees)."""
    if not private(t):
        return None
    ch = _Chain(consumers, usable, const)
    for pattern in PATTERNS:
        found = pattern(t, ch)
        if found is not None and all(private(o) for n in found[1][:-1] for o in n.output):
            return found
    return None


__all__ = ["OPS", "PATTERNS", "decomposed"]
