"""Attention as the exporters write it, matched back to one ``attention`` call (``kernels.attention``).

torch (``dynamo=False`` and ``True``) writes scaled dot-product attention as nodes:

    scores = MatMul(Q, Kᵀ) -> (Mul | Div by a scalar constant)* -> (Add a constant bias)? -> Softmax(last axis)
    out    = MatMul(scores, V)

where the scale may instead sit on Q or K (Mul/Div before the MatMul), Kᵀ is a Transpose of K or a
tensor that arrives transposed (a flattened NCHW map: smp's position attention), and Q, K, V, out
reach the tensors around them through Reshape / Transpose / Flatten / Squeeze / Unsqueeze and a
Gather of a fused projection's q, k or v. Those layout nodes are folded into the call: each operand
is an :class:`~dualtrack.kernels.attention.OperandView` (strides and an offset) of a *root* tensor,
the farthest one back (forward for the output) along such nodes whose layout on Track A makes the
view a strided one. Track A holds a 4-D tensor as NHWC (its NCHW element (n, c, h, w) at
``((n*H + h)*W + w)*C + c``) and any other as the graph has it (a token tensor (N, L, C): row-major),
so a token tensor is an image with H = 1 and an image's pixels are its tokens.

The batch stays dim 0 of every root and moves only through Transposes and Gathers on other dims;
a Reshape keeps it as dim 0 (the product of the other dims unchanged), so windows folded into the
batch (Swin's window partition) end the walk there. Every tensor the matched nodes compute, but
the output root, is read by the matched nodes alone and is no graph output.

:func:`find_attention` answers for the whole graph once (``partition.SupportContext.attentions``);
the partition charges the call to the match's first node and emits it at its last one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from dualtrack.compiler import cost
from dualtrack.compiler.lower_mobile import Facts
from dualtrack.contract.plan import KernelCall
from dualtrack.kernels.attention import AttentionGeometry, OperandView, supports

DESCRIPTION = "attention (MatMul, scale, bias Add, Softmax over the keys, MatMul; fp16, head dims 16-128)"
VIEW_OPS = ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze")
PICK_OPS = ("Gather", "Split", "Slice")  # q, k, v out of a fused projection (inputs' side only)
SCALE_OPS = ("Mul", "Div")
# Every op type a match may hold (partition routes these nodes to the match's answer).
PRODUCTS = ("MatMul", "Einsum")  # MONAI's attention writes its products as einsum('blxd,blyd->blxy')
OPS = (*PRODUCTS, "Softmax", "Add", *PICK_OPS, *SCALE_OPS, *VIEW_OPS)


@dataclass(frozen=True)
class Attention:
    """One matched attention: its nodes in graph order and the call it lowers to."""

    nodes: tuple[str, ...]
    call: KernelCall


@dataclass
class Attentions:
    """The graph's attentions by node, and why a Softmax that looked like one is not."""

    found: dict[str, Attention] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def kernel(self, node: onnx.NodeProto) -> str | None:
        """``attention`` for the match's first node (its launch is charged there), None for the others."""
        return "attention" if self.found[node.name].nodes[0] == node.name else None


Sub = tuple[int, int, bool]  # a sub-dim of a view's dim: size (at batch 1), element stride, is the batch


class NoMatch(Exception):
    """The nodes around a Softmax are not an attention the kernel takes; the message says why."""


@dataclass(frozen=True)
class View:
    """A tensor as strides over its root's buffer. Each dim is a group of sub-dims (size at batch 1,
    element stride), outermost first: a Reshape that merges dims which are not contiguous (the batch
    with the heads, as the dynamo exporter writes K's transpose: (N, h, L, d) -> (N*h, L, d) ->
    (N*h, d, L) -> (N, h, d, L)) keeps them apart, and a later Reshape that splits them back gives
    plain strides again; only a dim still merged at the end needs them contiguous (:attr:`strides`).
    The batch is a sub-dim of its own (``batch`` flag; size 1 at batch 1), dim ``bd`` holds it."""

    groups: tuple[tuple[Sub, ...], ...]
    off: int = 0

    @classmethod
    def of_root(cls, shape: tuple[int, ...]) -> View:
        """The root's layout on Track A: NHWC for a 4-D tensor, else the graph's (row-major)."""
        if len(shape) == 4:
            _, c, h, w = shape
            return cls._plain(shape, (h * w * c, 1, w * c, c))
        return cls.row_major(shape)

    @classmethod
    def row_major(cls, shape: tuple[int, ...]) -> View:
        strides = [1] * len(shape)
        for j in range(len(shape) - 2, -1, -1):
            strides[j] = strides[j + 1] * shape[j + 1]
        return cls._plain(shape, tuple(strides))

    @classmethod
    def _plain(cls, shape: tuple[int, ...], strides: tuple[int, ...]) -> View:
        return cls(tuple(((n, s, j == 0),) for j, (n, s) in enumerate(zip(shape, strides, strict=True))))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(n for n, _, _ in g) for g in self.groups)

    @property
    def bd(self) -> int:
        """The dim that holds the batch (-1: none; never the case for a view of a batch-major root)."""
        return next((j for j, g in enumerate(self.groups) if any(b for _, _, b in g)), -1)

    @property
    def strides(self) -> tuple[int, ...]:
        """One element stride per dim; NoMatch where a merged dim's sub-dims are not contiguous or the
        batch shares its dim."""
        out = []
        for g in self.groups:
            subs = [x for x in g if x[0] != 1 or x[2]]
            if len(subs) > 1 and any(b for _, _, b in subs):
                raise NoMatch("the batch merged with another dim (the kernel reads it as its own)")
            if any(subs[k][1] != subs[k + 1][1] * subs[k + 1][0] for k in range(len(subs) - 1)):
                raise NoMatch("a merged dim that needs a copy in the Track A layout")
            out.append(subs[-1][1] if subs else 0)
        return tuple(out)

    def transpose(self, perm: list[int]) -> View:
        return View(tuple(self.groups[p] for p in perm), self.off)

    def swap_last(self) -> View:
        """The last two dims exchanged (a matrix transposed in place)."""
        if len(self.groups) < 2:
            raise NoMatch(f"a product operand of shape {self.shape}")
        return self.transpose([*range(len(self.groups) - 2), len(self.groups) - 1, len(self.groups) - 2])

    def _single(self, axis: int, what: str) -> Sub:
        subs = [x for x in self.groups[axis] if x[0] != 1 or x[2]]
        if axis == self.bd or len(subs) > 1:
            raise NoMatch(f"a {what} over the batch or over a merged dim")
        return subs[0] if subs else (1, 0, False)

    def narrow(self, axis: int, start: int, size: int) -> View:
        """Elements start .. start+size-1 of dim ``axis`` (a Split's or Slice's part)."""
        _, stride, _ = self._single(axis, "Split or Slice")
        groups = (*self.groups[:axis], ((size, stride, False),), *self.groups[axis + 1 :])
        return View(groups, self.off + start * stride)

    def gather(self, axis: int, index: int) -> View:
        _, stride, _ = self._single(axis, "Gather")
        return View(tuple(g for j, g in enumerate(self.groups) if j != axis), self.off + index * stride)

    def squeeze(self, axes: set[int]) -> View:
        if self.bd in axes or any(self.shape[a] != 1 for a in axes):
            raise NoMatch("a Squeeze of the batch or of a dim longer than 1")
        return View(tuple(g for j, g in enumerate(self.groups) if j not in axes), self.off)

    def unsqueeze(self, axes: set[int]) -> View:
        rest = iter(self.groups)
        return View(tuple(() if j in axes else next(rest) for j in range(len(self.groups) + len(axes))), self.off)

    def reshape(self, new: tuple[int, ...]) -> View:
        """The same elements as ``new`` (batch 1 sizes): the sub-dims regrouped, split where a new dim
        ends inside one (which needs no contiguity); the batch sub-dim opens the next new dim."""
        subs = [x for g in self.groups for x in g if x[0] != 1 or x[2]]
        groups: list[tuple[Sub, ...]] = []
        i = 0
        for n in new:
            group: list[Sub] = []
            if i < len(subs) and subs[i][2]:
                group.append(subs[i])
                i += 1
            size = 1
            while size < n:
                if i >= len(subs) or subs[i][2]:
                    raise NoMatch(f"a Reshape {self.shape} -> {new} that moves the batch")
                m, stride, _ = subs[i]
                k = n // size
                if m > k:  # the new dim ends inside this sub-dim: split it
                    if m % k:
                        raise NoMatch(f"a Reshape {self.shape} -> {new} across dims")
                    group.append((k, stride * (m // k), False))
                    subs[i] = (m // k, stride, False)
                    size *= k
                else:
                    group.append(subs[i])
                    size *= m
                    i += 1
            if size != n:
                raise NoMatch(f"a Reshape {self.shape} -> {new} across dims")
            groups.append(tuple(group))
        if i != len(subs):
            raise NoMatch(f"a Reshape {self.shape} -> {new} that leaves the batch behind")
        return View(tuple(groups), self.off)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class _Walk:
    """The graph one match reads: shapes, constants, producers and readers, and the nodes it may not take."""

    def __init__(self, facts: Facts, taken: set[str], shared: bool = True, minor: frozenset[str] = frozenset()) -> None:
        self.facts, self.taken, self.shared, self.minor = facts, taken, shared, minor
        self.outputs = {o.name for o in facts.model.graph.output}

    def shape(self, t: str) -> tuple[int, ...]:
        if t not in self.facts.specs:
            raise NoMatch(f"'{t}' has no static shape")
        return tuple(self.facts.shape(t))

    def dtype(self, t: str) -> str:
        self.shape(t)
        return self.facts.specs[t][1]

    def producer(self, t: str) -> onnx.NodeProto | None:
        p = self.facts.producer.get(t)
        return p if p is not None and p.name not in self.taken else None

    def sole_reader(self, t: str) -> onnx.NodeProto | None:
        users = self.facts.consumers.get(t, [])
        if len(users) != 1 or t in self.outputs or users[0].name in self.taken:
            return None
        return users[0]

    def scalar(self, node: onnx.NodeProto, t: str) -> float | None:
        """The constant scalar factor ``node`` (Mul, or Div with ``t`` the dividend) applies to ``t``, or None."""
        if node.op_type not in SCALE_OPS or len(node.input) != 2 or t not in node.input:
            return None
        other = node.input[1] if node.input[0] == t else node.input[0]
        if other == t or (node.op_type == "Div" and node.input[0] != t):
            return None
        value = self.facts.const(other)
        if value is None or value.size != 1:
            return None
        v = float(value.reshape(()))
        return v if node.op_type == "Mul" else 1.0 / v

    def view_step(self, node: onnx.NodeProto, view: View, out: str) -> View:
        """``view`` of ``node``'s data input carried to its output ``out``."""
        if node.op_type == "Transpose":
            perm = [int(p) for p in _attrs(node).get("perm", range(len(view.shape) - 1, -1, -1))]
            return view.transpose(perm)
        if node.op_type == "Gather":
            index = self.facts.const(node.input[1])
            if index is None or index.size != 1 or index.ndim != 0:
                raise NoMatch(f"Gather {node.name} of a non-constant or non-scalar index")
            axis = int(_attrs(node).get("axis", 0)) % len(view.shape)
            return view.gather(axis, int(index) % view.shape[axis])
        if node.op_type == "Split":
            axis = int(_attrs(node).get("axis", 0)) % len(view.shape)
            sizes = [self.shape(o)[axis] for o in node.output]
            j = list(node.output).index(out)
            return view.narrow(axis, sum(sizes[:j]), sizes[j])
        if node.op_type == "Slice":
            return self._slice(node, view, out)
        if node.op_type in ("Squeeze", "Unsqueeze"):
            return self._squeeze(node, view, out)
        return view.reshape(self.shape(out))  # Reshape, Flatten

    def _squeeze(self, node: onnx.NodeProto, view: View, out: str) -> View:
        """Squeeze or Unsqueeze of explicit axes: size-1 dims dropped or added, the batch kept where it is."""
        given = _attrs(node).get("axes")
        axes_const = self.facts.const(node.input[1]) if given is None and len(node.input) > 1 else None
        axes = list(given) if given is not None else None if axes_const is None else axes_const.reshape(-1).tolist()
        if axes is None:
            raise NoMatch(f"{node.op_type} {node.name} without constant axes")
        if node.op_type == "Squeeze":
            return view.squeeze({int(a) % len(view.shape) for a in axes})
        return view.unsqueeze({int(a) % (len(view.shape) + len(axes)) for a in axes})

    def _slice(self, node: onnx.NodeProto, view: View, out: str) -> View:
        """A Slice of constant starts (step 1) as narrowed dims; its output shape gives the sizes."""
        consts = [self.facts.const(x) if x else None for x in node.input[1:]]
        starts, axes = consts[0], consts[2] if len(consts) > 2 else None
        steps = consts[3] if len(consts) > 3 else None
        if starts is None or (len(node.input) > 3 and node.input[3] and axes is None):
            raise NoMatch(f"Slice {node.name} of run-time starts or axes")
        if steps is not None and np.any(steps != 1):
            raise NoMatch(f"Slice {node.name} with a step")
        rank, want = len(view.shape), self.shape(out)
        for k, start in enumerate(starts.reshape(-1)):
            axis = int(axes.reshape(-1)[k]) % rank if axes is not None else k
            n = view.shape[axis]
            first = min(max(int(start) + n if start < 0 else int(start), 0), n)
            view = view.narrow(axis, first, want[axis])
        return view

    def back(self, t: str) -> tuple[str, list[tuple[onnx.NodeProto, str]]]:
        """From ``t`` back along view nodes, Gathers, Splits and Slices of constant positions and scalar
        Mul/Div: the farthest tensor reached and the (node, its output on the way) passed, nearest first.
        ``shared`` off: only through tensors the walk's next node reads alone (a fused qkv
        projection's tensor has three readers)."""
        nodes: list[tuple[onnx.NodeProto, str]] = []
        while (p := self.producer(t)) is not None:
            if not self.shared and (len(self.facts.consumers.get(t, [])) > 1 or t in self.outputs):
                break
            if p.op_type in SCALE_OPS:
                data = next((x for x in p.input if self.scalar(p, x) is not None), None)
                if data is None:
                    break
            elif p.op_type in (*VIEW_OPS, *PICK_OPS):
                data = p.input[0]
            else:
                break
            nodes.append((p, t))
            t = data
        return t, nodes


def _operand(walk: _Walk, t: str) -> tuple[str, View, list[onnx.NodeProto], float]:
    """The root of MatMul operand ``t`` and ``t``'s view over it: the farthest root whose layout gives
    a strided view (scales are taken only up to it), the nodes between, the scale they apply."""
    far, chain = walk.back(t)
    forward = list(reversed(chain))  # (node, its output) from the farthest root to t
    roots = [far] + [out for _, out in forward]
    major = _batch_major(walk, far, forward)
    why = "no strided view"
    for depth, root in enumerate(roots):
        path = forward[depth:]  # the steps from this root to t, in order
        if root not in major:
            continue
        try:
            view = View.of_root(walk.shape(root))
            scale = 1.0
            for node, out in path:
                if node.op_type in SCALE_OPS:
                    data = next(x for x in node.input if walk.scalar(node, x) is not None)
                    scale *= walk.scalar(node, data) or 1.0
                    continue
                view = walk.view_step(node, view, out)
            return root, view, [node for node, _ in path], scale
        except NoMatch as e:
            why = str(e)
    raise NoMatch(why)


def _batch_major(walk: _Walk, far: str, forward: list[tuple[onnx.NodeProto, str]]) -> set[str]:
    """The tensors from ``far`` (taken to be batch-major) along ``forward`` whose batch is still dim 0:
    the only ones an operand may be read from (a buffer per batch size; not a fused qkv tensor's
    (3, N, ...) permutation), as row-major views of ``far`` carry it (they never need a copy)."""
    major = set() if far in walk.minor else {far}
    try:
        view = View.row_major(walk.shape(far))
        for node, out in forward:
            if node.op_type not in SCALE_OPS:
                view = walk.view_step(node, view, out)
            if view.bd == 0 and out not in walk.minor:
                major.add(out)
    except NoMatch:
        pass  # past a step the batch cannot be followed through: none of the later tensors
    return major


def _output(walk: _Walk, t: str) -> tuple[str, View, list[onnx.NodeProto]]:
    """The root the output MatMul's result ``t`` reaches forward along view nodes (each its input's
    one reader), and ``t``'s view over it: the farthest such tensor with a strided view."""
    chain: list[onnx.NodeProto] = []
    u = t
    while (r := walk.sole_reader(u)) is not None and r.op_type in VIEW_OPS and r.input[0] == u:
        chain.append(r)
        u = r.output[0]
    why = "no strided view"
    for depth in range(len(chain), -1, -1):
        path = chain[:depth]
        root = path[-1].output[0] if path else t
        if root in walk.minor:
            continue
        try:
            view = View.of_root(walk.shape(root))
            for node in reversed(path):  # the inverse steps, from the root back to t
                if node.op_type == "Transpose":
                    perm = [int(p) for p in _attrs(node).get("perm", range(len(view.shape) - 1, -1, -1))]
                    view = view.transpose([perm.index(j) for j in range(len(perm))])
                else:
                    view = view.reshape(walk.shape(node.input[0]))
            return root, view, path
        except NoMatch as e:
            why = str(e)
    raise NoMatch(why)


def _heads_view(view: View, heads: int, what: str) -> OperandView:
    """An operand view of rank 3 (one head) or 4 as (batch, head, row, dim) strides."""
    if view.bd != 0 or len(view.shape) not in (3, 4):
        raise NoMatch(f"{what} of shape {view.shape} (the kernel takes (N, L, d) or (N, heads, L, d))")
    s = view.strides
    if len(view.shape) == 3:
        return OperandView(view.off, s[0], 0, s[1], s[2])
    if view.shape[1] not in (1, heads):
        raise NoMatch(f"{what} has {view.shape[1]} heads, the scores {heads}")
    return OperandView(view.off, s[0], s[1] if view.shape[1] > 1 else 0, s[2], s[3])


def _scores(walk: _Walk, softmax: onnx.NodeProto) -> tuple[onnx.NodeProto, list[onnx.NodeProto], float, str | None]:
    """Back from the Softmax's input: the Q·Kᵀ MatMul, the nodes between, their scale and the bias constant."""
    rank = len(walk.shape(softmax.input[0]))
    default = -1 if (walk.facts.model.opset_import and _opset(walk.facts.model) >= 13) else 1
    if int(_attrs(softmax).get("axis", default)) % rank != rank - 1:
        raise NoMatch("a Softmax over another axis than the last (the keys)")
    nodes: list[onnx.NodeProto] = []
    scale, bias, t = 1.0, None, softmax.input[0]
    while (p := walk.producer(t)) is not None and p.op_type not in PRODUCTS:
        if walk.sole_reader(t) is None:
            raise NoMatch(f"'{t}' between the scores and the Softmax is read elsewhere")
        if p.op_type == "Add" and bias is None and len(p.input) == 2:
            other = p.input[1] if walk.facts.const(p.input[1]) is not None else p.input[0]
            if walk.facts.const(other) is None or other not in walk.facts.inits:
                raise NoMatch("a bias Add of a tensor computed at run time (the kernel adds a constant bias)")
            if nodes:  # walking back, a scale met before the Add is applied after it
                raise NoMatch("a scale after the bias Add (the kernel scales the product before the bias)")
            bias, t = other, p.input[0] if other == p.input[1] else p.input[1]
        elif p.op_type in SCALE_OPS and (x := next((i for i in p.input if walk.scalar(p, i) is not None), None)):
            scale *= walk.scalar(p, x) or 1.0
            t = x
        else:
            raise NoMatch(f"{p.op_type} {p.name} between the scores and the Softmax (not a constant scale or bias)")
        nodes.append(p)
    if p is None or walk.sole_reader(t) is None:
        raise NoMatch("the Softmax's scores do not come from a MatMul read by it alone")
    _b_transposed(p)  # an Einsum that is no matrix product raises
    return p, nodes, scale, bias


def _b_transposed(node: onnx.NodeProto) -> bool:
    """Of a product A·B (a MatMul, or an Einsum that is one, A as (.., m, k)): whether B is given as
    (.., n, k) (einsum's 'bhxd,bhyd->bhxy') rather than MatMul's (.., k, n); NoMatch for other Einsums."""
    if node.op_type == "MatMul":
        return False
    eq = _attrs(node).get("equation", b"")
    eq = (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")
    lhs, _, out = eq.partition("->")
    a, _, b = lhs.partition(",")
    if "." in eq or not (len(a) == len(b) == len(out) >= 3) or len(set(a + b + out)) != len(a) + 1:
        raise NoMatch(f"Einsum {node.name} '{eq}' is not a batched matrix product")
    batch, (x, k), n = a[:-2], a[-2:], out[-1]
    if b[:-2] != batch or out[:-1] != batch + x or b[-2:] not in (k + n, n + k):
        raise NoMatch(f"Einsum {node.name} '{eq}' is not a batched matrix product")
    return b[-2:] == n + k


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def match(softmax: onnx.NodeProto, facts: Facts, taken: set[str], minor: frozenset[str] = frozenset()) -> Attention:
    """The attention around ``softmax``, or NoMatch saying why not: with its operands' roots as far
    back as view nodes lead, or where a tensor on the way is read elsewhere too, only up to it."""
    try:
        return _match(_Walk(facts, taken, True, minor), softmax)
    except NoMatch:
        return _match(_Walk(facts, taken, False, minor), softmax)


def _match(walk: _Walk, softmax: onnx.NodeProto) -> Attention:
    facts = walk.facts
    qk, between, scale, bias = _scores(walk, softmax)
    pv = walk.sole_reader(softmax.output[0])
    if pv is None or pv.op_type not in PRODUCTS or pv.input[0] != softmax.output[0]:
        raise NoMatch("the Softmax's probabilities are not the first operand of a MatMul read by it alone")
    q_root, q_view, q_nodes, q_scale = _operand(walk, qk.input[0])
    k_root, kt_view, k_nodes, k_scale = _operand(walk, qk.input[1])
    v_root, v_view, v_nodes, _ = _operand(walk, pv.input[1])
    o_root, o_view, o_nodes = _output(walk, pv.output[0])
    score_shape = walk.shape(qk.output[0])
    heads = score_shape[1] if len(score_shape) == 4 else 1
    v_t = _b_transposed(pv)  # V given as (.., dv, Lk)
    d, dv = walk.shape(qk.input[0])[-1], walk.shape(pv.input[1])[-2 if v_t else -1]
    roots = (q_root, k_root, v_root, o_root)
    why = supports(walk.dtype(qk.input[0]), d, dv) or next(
        (f"{t} is {walk.dtype(t)}" for t in roots if walk.dtype(t) != "float16"), None
    )
    if why:
        raise NoMatch(why)
    if not _b_transposed(qk):  # Kᵀ (.., d, Lk) as K (.., Lk, d): the last two dims swapped
        kt_view = kt_view.swap_last()
    if v_t:
        v_view = v_view.swap_last()
    views = (
        _heads_view(q_view, heads, "Q"), _heads_view(kt_view, heads, "K"),
        _heads_view(v_view, heads, "V"), _heads_view(o_view, heads, "the output"),
    )  # fmt: skip
    o_shape = walk.shape(o_root)
    geom = AttentionGeometry(
        heads, d, score_shape[-2], score_shape[-1], scale * q_scale * k_scale, views,  # type: ignore[arg-type]
        (o_shape[2], o_shape[3], o_shape[1]) if len(o_shape) == 4 else o_shape[1:],
    )  # fmt: skip
    nodes = {n.name for n in (qk, *between, softmax, pv, *q_nodes, *k_nodes, *v_nodes, *o_nodes)}
    _check_private(walk, nodes, o_root)
    order = [n.name for n in facts.model.graph.node if n.name in nodes]
    weights = (bias,) if bias is not None else ()
    call = KernelCall("attention", (q_root, k_root, v_root), (o_root,), weights, geom.attrs(), tuple(order))
    return Attention(tuple(order), call)


def _check_private(walk: _Walk, nodes: set[str], o_root: str) -> None:
    """Every tensor the matched nodes compute but the output is read by them alone and no graph output."""
    for n in walk.facts.model.graph.node:
        if n.name not in nodes:
            continue
        if n.name in walk.taken:
            raise NoMatch(f"node {n.name} is another fusion's")
        for t in n.output:
            if t == o_root:
                continue
            readers = walk.facts.consumers.get(t, [])
            if t in walk.outputs or any(r.name not in nodes for r in readers):
                raise NoMatch(f"'{t}' (of {n.name}) is read outside the attention")


def find_attention(facts: Facts, taken: set[str], minor: frozenset[str] = frozenset()) -> Attentions:
    """Every Softmax of the graph that is an attention the kernel takes (by each of its nodes), and
    why the others that read a MatMul's product are not."""
    found = Attentions()
    claimed = set(taken)
    for node in facts.model.graph.node:
        if node.op_type != "Softmax" or node.name in claimed:
            continue
        try:
            att = match(node, facts, claimed, minor)
        except NoMatch as e:
            if _reads_a_product(facts, node):  # a class softmax (a head) keeps its own reason
                found.refused[node.name] = f"not an attention the kernel takes: {e}"
            continue
        if claimed.intersection(att.nodes):
            found.refused[node.name] = "its nodes overlap another attention"
            continue
        claimed.update(att.nodes)
        found.found.update((name, att) for name in att.nodes)
    return found


def _reads_a_product(facts: Facts, softmax: onnx.NodeProto, depth: int = 4) -> bool:
    """Whether a MatMul or Einsum lies a few nodes up the Softmax's data input: it looked like attention."""
    t = softmax.input[0]
    for _ in range(depth):
        p = facts.producer.get(t)
        if p is None or not p.input:
            return False
        if p.op_type in PRODUCTS:
            return True
        t = next((x for x in p.input if x and not facts.is_const(x)), p.input[0])
    return False


def attention_work(specs: dict, call: KernelCall) -> cost.Work:
    """What an attention call computes and moves at batch 1, charged to its first node: the two
    products (4·h·Lq·Lk·d FLOPs), Q, K, V read and O written once, the bias once per image and head."""
    g = AttentionGeometry.from_call(call)
    flops = 4.0 * g.heads * g.lq * g.lk * g.d
    act = 2.0 * g.heads * g.d * (2 * g.lq + 2 * g.lk)
    return cost.Work(flops, act, float(np.prod(specs[call.weights[0]][0]) * 4) if call.weights else 0.0)


__all__ = ["DESCRIPTION", "OPS", "Attention", "Attentions", "attention_work", "find_attention", "match"]
