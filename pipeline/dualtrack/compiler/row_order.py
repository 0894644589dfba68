"""Row-wise ops moved to the batch-major side of the Transposes that reorder their rows (a front-end pass).

``nn.MultiheadAttention`` works sequence-first: with ``batch_first=True`` it transposes its (N, L, E)
input to (L, N, E), runs the in-projection (a MatMul and a bias Add, or a Gemm on the (L*N, E) rows viewed
back to (L, N, 3E)) there, and after the attention runs the out-projection on (L*N, E) rows, views them
back to (L, N, E) and transposes to (N, L, E). Models that feed it (L, N, E) themselves write
``x.flatten(2).permute(2, 0, 1)`` and ``.permute(1, 2, 0)`` around it. Every op on those tensors holds the
batch in dim 1, so no Track A kernel may take it (they take batch-major tensors), the projections stay on
IREE and the attention between them, which reads and writes only such tensors, finds no batch-major root
(``attention_patterns``): the whole block ran on Track B with two track switches.

A *row-wise* op acts on each row of the last axis alone: a MatMul by a constant matrix, an element-wise op
of one tensor, a binary op with a constant that varies along the last axis only, a LayerNormalization or
Softmax over the last axis. It commutes with any Transpose that keeps the last axis last, and with any
other Transpose once that is split in two (one that moves the last axis into place, one that keeps it):

- **sinking**: ``R(Transpose(X, p))`` with X batch-major and the Transpose's output not is written
  ``Transpose(R(X'), q)``, X' = X or ``Transpose(X, s)`` with s the order of p that brings p's last
  axis last (X' stays batch-major), ``q`` the rest of p;
- **hoisting**: ``Transpose(R(Z), p)`` with the Transpose's output batch-major and R's not is written
  ``Transpose(R(Transpose(Z, q)), s)``, q the order of p that keeps Z's last axis last (its output
  batch-major), s the move of the last axis to where p puts it (none when p keeps it last).

Each step leaves R on a batch-major tensor and moves the Transpose one op farther along, so the steps
repeat until no row-wise op reads or writes across one; a sunk Transpose never becomes a hoisted one
(its input is batch-major, its output not) and the other way round, so it ends. Before that, a Gemm
on rows flattened from a tensor and viewed back to that tensor's leading dims (how torch writes
``F.linear`` of a rank-3 tensor) is written as the MatMul and Add it is on the unflattened tensor, so it
is row-wise too. The token pass (``token_layout``), which runs next, then sees the projections as Linears
on token tensors (1x1 Convs on their images) and the attention reads them as views.

Which tensors are batch-major comes from shape inference at two batches (dim 0 is the batch, the rest
unchanged) on a copy whose batch is freed as the front end's ``batch`` stage will free it; where that
refuses, the pass leaves the model as it is (the stage reports why). Written by hand: onnxslim and
onnxoptimizer move Transposes only to fuse or cancel them, not past a MatMul to a side chosen by batch.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.batch_free import free_batch, static_shapes, with_batch
from dualtrack.compiler.channels_last import BINARY, UNARY
from dualtrack.compiler.onnx_graph import copy_node, fresh_name, live_nodes, node_attrs, taken_names, transpose_perm
from dualtrack.errors import ModelError

LAST_AXIS = frozenset({"LayerNormalization", "Softmax", "LogSoftmax"})  # ops with an axis that must be the last
_MAX_STEPS = 10_000  # moves per model: each one takes a row-wise op across a Transpose; far above any network's


def batch_major(model: onnx.ModelProto, export_batch: int | None) -> set[str] | None:
    """The tensors whose dim 0 holds the batch (:func:`_shapes`); None where the batch cannot be freed."""
    found = _shapes(model, export_batch)
    return None if found is None else found[0]


Shapes = dict[str, tuple[int, ...]]


def _shapes(model: onnx.ModelProto, export_batch: int | None) -> tuple[set[str], Shapes, Shapes] | None:
    """The tensors whose dim 0 holds the batch (whole, the outer part) and nothing else: at batch 1 and 2
    dim 0 is 1 and 2 and the other dims agree; and every tensor's shape at batch 1 and at batch 2. The
    batch is freed on a copy first where the export fixed it; None where that refuses (the front end's
    ``batch`` stage reports why, after the simplifier: a TorchScript export at a fixed batch computes its
    views' shapes at run time, which only the simplifier folds, so it is left as it is here)."""
    probe = model
    if export_batch is not None:
        try:
            probe, _ = free_batch(copy.deepcopy(model), export_batch, (1, 2))
        except ModelError:
            return None
    one, two = static_shapes(with_batch(probe, 1)), static_shapes(with_batch(probe, 2))
    inits = {i.name for i in probe.graph.initializer}
    major = {
        t
        for t, s in one.items()
        if t not in inits and s and s[0] == 1 and t in two and two[t][0] == 2 and two[t][1:] == s[1:] and -1 not in s
    }
    return major, one, two


class _Graph:
    """The node list being rewritten, with producers, readers, the constants it reads, which tensors are
    batch-major and every tensor's shape at batch 1 and 2 (:func:`_shapes`)."""

    def __init__(
        self, model: onnx.ModelProto, consts: dict[str, np.ndarray], major: set[str],
        shapes: tuple[Shapes, Shapes] = ({}, {}),
    ) -> None:  # fmt: skip
        self.consts, self.major, self.shapes = dict(consts), major, shapes
        self.nodes = list(model.graph.node)
        self.outputs = {o.name for o in model.graph.output}
        self.taken = taken_names(model.graph)
        self.inits: list[onnx.TensorProto] = []
        self.moved = 0
        self.gemms = 0

    def producer(self, t: str) -> onnx.NodeProto | None:
        return next((n for n in self.nodes if t in n.output), None)

    def readers(self, t: str) -> list[onnx.NodeProto]:
        return [n for n in self.nodes if t in n.input]

    def sole_reader(self, t: str) -> onnx.NodeProto | None:
        users = self.readers(t)
        return users[0] if len(users) == 1 and t not in self.outputs else None

    def view_shape(self, t: str) -> list[int] | None:
        """A Reshape target that gives ``t``'s shape at any batch: its dims at batch 1 and 2, -1 where they
        differ (the batch's place); None where shapes are missing or more than one dim differs."""
        one, two = (s.get(t) for s in self.shapes)
        if one is None or two is None or len(one) != len(two) or min(*one, *two) < 0:
            return None
        dims = [a if a == b else -1 for a, b in zip(one, two, strict=True)]
        return dims if dims.count(-1) <= 1 else None

    def name(self, base: str) -> str:
        return fresh_name(base, self.taken)

    def constant(self, base: str, value: np.ndarray) -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(value, name))
        self.consts[name] = value
        return name

    def transpose(self, x: str, perm: list[int], out: str | None = None) -> onnx.NodeProto:
        out = out or self.name(f"{x}__rows")
        return helper.make_node("Transpose", [x], [out], name=self.name(f"{out}__transpose"), perm=perm)

    def replace(self, old: list[onnx.NodeProto], new: list[onnx.NodeProto]) -> None:
        """``new`` in place of the first of ``old``; the others of ``old`` dropped."""
        at = min(self.nodes.index(n) for n in old)
        gone = {id(n) for n in old}
        kept = [n for n in self.nodes[:at] if id(n) not in gone]
        self.nodes = kept + new + [n for n in self.nodes[at:] if id(n) not in gone]

    def drop_if_unread(self, node: onnx.NodeProto) -> None:
        if node in self.nodes and not any(self.readers(o) or o in self.outputs for o in node.output):
            self.nodes.remove(node)


def _rank_kept_constant(g: _Graph, t: str, rank: int) -> bool:
    """``t`` is a constant that, broadcast against a rank-``rank`` tensor, varies along the last axis only."""
    c = g.consts.get(t)
    return c is not None and c.ndim <= rank and all(d == 1 for d in c.shape[:-1])


def _data_input(g: _Graph, node: onnx.NodeProto, rank: int) -> int | None:
    """Which input of ``node`` it acts on row-wise (along the last axis of a rank-``rank`` tensor), or None."""
    op, ins = node.op_type, list(node.input)
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    if op in UNARY:
        return 0 if all(x in g.consts for x in ins[1:] if x) else None
    if op == "MatMul":
        w = g.consts.get(ins[1])
        return 0 if w is not None and w.ndim == 2 and ins[0] not in g.consts else None
    if op in BINARY and len(ins) == 2:
        for k in (0, 1):
            if ins[k] not in g.consts and _rank_kept_constant(g, ins[1 - k], rank):
                return None if op == "PRelu" and k == 1 else k
        return None
    if op in LAST_AXIS:
        axis = int(node_attrs(node).get("axis", -1))  # opset 13+ (the front end upgrades older exports)
        return 0 if axis % rank == rank - 1 and all(x in g.consts for x in ins[1:] if x) else None
    return None


def _sink(g: _Graph, t_node: onnx.NodeProto) -> bool:
    """Move every row-wise reader of ``t_node``'s output above it (the module's docstring); True if one moved."""
    perm = transpose_perm(t_node) or []
    x, t = t_node.input[0], t_node.output[0]
    r = len(perm)
    if r < 2 or x not in g.major or t in g.major or perm[-1] == 0:
        return False
    moved = False
    for reader in g.readers(t):
        k = _data_input(g, reader, r)
        if k is None or reader.input[k] != t or list(reader.input).count(t) != 1:
            continue
        new: list[onnx.NodeProto] = []
        src, q = x, perm
        if perm[-1] != r - 1:  # bring p's last axis last first: X' = Transpose(X, s), still batch-major
            s = [a for a in range(r) if a != perm[-1]] + [perm[-1]]
            split = g.transpose(x, s)
            new.append(split)
            src = split.output[0]
            g.major.add(src)
            q = [s.index(a) for a in perm]
        y = g.name(f"{reader.output[0]}__rows")
        ins = list(reader.input)
        ins[k] = src
        new.append(copy_node(reader, ins, y))
        new[-1].name = g.name(f"{reader.name or y}__rows")
        g.major.add(y)
        new.append(g.transpose(y, q, reader.output[0]))
        g.replace([reader], new)
        g.moved += 1
        moved = True
    if moved:
        g.drop_if_unread(t_node)
    return moved


def _hoist(g: _Graph, t_node: onnx.NodeProto) -> bool:
    """Move the row-wise op that writes ``t_node``'s input below it (the module's docstring); True if it moved."""
    perm = transpose_perm(t_node) or []
    y, t = t_node.input[0], t_node.output[0]
    r = len(perm)
    if r < 2 or t not in g.major or y in g.major or perm[0] == r - 1:
        return False
    op = g.producer(y)
    if op is None or g.sole_reader(y) is not t_node:
        return False
    k = _data_input(g, op, r)
    if k is None:
        return False
    z = op.input[k]
    q = [a for a in perm if a != r - 1] + [r - 1]
    s = [q.index(a) for a in perm]
    zq = g.transpose(z, q)
    g.major.add(zq.output[0])
    keeps_last = s == list(range(r))
    out = t if keeps_last else g.name(f"{t}__rows")
    ins = list(op.input)
    ins[k] = zq.output[0]
    moved = copy_node(op, ins, out)
    moved.name = g.name(f"{op.name or out}__rows")
    g.major.add(out)
    new = [zq, moved] + ([] if keeps_last else [g.transpose(out, s, t)])
    g.replace([op, t_node], new)
    g.moved += 1
    return True


def _only_feed(g: _Graph, starts: list[onnx.NodeProto], sink: onnx.NodeProto) -> bool:
    """Whether everything ``starts`` compute is read, in the end, by ``sink``'s shape input alone."""
    todo, seen = list(starts), set()
    while todo:
        node = todo.pop()
        for t in node.output:
            if t in g.outputs:
                return False
            for r in g.readers(t):
                if r is sink:
                    if list(sink.input).index(t) != 1:
                        return False
                elif id(r) not in seen:
                    seen.add(id(r))
                    todo.append(r)
    return True


def _gemm_on_rows(g: _Graph, gemm: onnx.NodeProto) -> bool:
    """A Gemm on rows flattened from a tensor and viewed back to its leading dims as the MatMul (and
    bias Add) it is on the unflattened tensor; True if written. Only where the rows are not batch-major."""
    a = node_attrs(gemm)
    if a.get("transA", 0) or len(gemm.input) < 2 or len(gemm.output) != 1:
        return False
    w = g.consts.get(gemm.input[1])
    bias = g.consts.get(gemm.input[2]) if len(gemm.input) > 2 and gemm.input[2] else None
    if w is None or w.ndim != 2 or (len(gemm.input) > 2 and gemm.input[2] and bias is None):
        return False
    # Its readers: one Reshape (the view back), and Shape nodes that a TorchScript export computes that
    # view's target with and nothing else reads (they go with it).
    readers = g.readers(gemm.output[0])
    views = [r for r in readers if r.op_type == "Reshape" and r.input[0] == gemm.output[0]]
    if len(views) != 1 or gemm.output[0] in g.outputs or views[0].output[0] in g.major:
        return False
    view = views[0]
    shape_only = [r for r in readers if r is not view]
    if any(r.op_type != "Shape" for r in shape_only) or not _only_feed(g, shape_only, view):
        return False
    shape = g.consts.get(view.input[1])  # else computed from shapes at run time (a TorchScript export)
    shape = np.array(g.view_shape(view.output[0]) or [], np.int64) if shape is None else shape
    matrix = (w.T if a.get("transB", 0) else w) * np.asarray(a.get("alpha", 1.0), dtype=w.dtype)
    k_dim, e_dim = matrix.shape
    dims = [int(d) for d in shape.reshape(-1)]
    if len(dims) < 3 or dims[-1] != e_dim or 0 in dims or dims.count(-1) > 1:  # no 0: allowzero moot
        return False
    if bias is not None and (bias.size not in (1, e_dim) or (bias.ndim == 2 and bias.shape[0] != 1)):
        return False
    src = gemm.input[0]
    flat = g.producer(src)
    old = [gemm, view]
    if flat is not None and flat.op_type == "Reshape" and g.sole_reader(src) is gemm:
        src = flat.input[0]
        old.insert(0, flat)
    rows = g.name(f"{gemm.output[0]}__rows_in")
    new = [
        helper.make_node(
            "Reshape", [src, g.constant(f"{rows}_shape", np.array([*dims[:-1], k_dim], np.int64))], [rows],
            name=g.name(f"{rows}__reshape"),
        ),
    ]  # fmt: skip
    product = view.output[0] if bias is None else g.name(f"{gemm.output[0]}__rows_mm")
    weight = g.constant(f"{gemm.input[1]}__rows", matrix)
    new.append(helper.make_node("MatMul", [rows, weight], [product], name=g.name(gemm.name or product)))
    if bias is not None:
        b = (bias.reshape(-1) * np.asarray(a.get("beta", 1.0), dtype=bias.dtype)).astype(bias.dtype)
        b = np.broadcast_to(b, (e_dim,)).copy()
        shift = g.constant(f"{gemm.input[2]}__rows", b)
        new.append(helper.make_node("Add", [product, shift], [view.output[0]], name=g.name(f"{product}__bias")))
    g.replace(old, new)
    g.nodes = live_nodes(g.nodes, g.outputs)  # the Shape nodes that computed the view's target
    g.gemms += 1
    return True


def _row_transposes(model: onnx.ModelProto, consts: dict[str, np.ndarray]) -> bool:
    """Whether any Transpose reads a row-wise op's output or feeds one, or the graph has a Gemm (whose rows
    may be viewed back): the pass has something to look at, and the batch probe is worth its cost."""
    g = _Graph(model, consts, set())
    if any(n.op_type == "Gemm" for n in g.nodes):
        return True
    for node in g.nodes:
        perm = transpose_perm(node)
        if not perm:
            continue
        op = g.producer(node.input[0])
        if op is not None and _data_input(g, op, len(perm)) is not None:
            return True
        if any(_data_input(g, r, len(perm)) is not None for r in g.readers(node.output[0])):
            return True
    return False


def rows_batch_major(
    model: onnx.ModelProto, consts: dict[str, np.ndarray], export_batch: int | None
) -> tuple[onnx.ModelProto, str | None]:
    """The model with its row-wise ops moved to the batch-major side of the Transposes around them (the
    module's docstring), and a note; or the model itself and None where nothing moved."""
    if not _row_transposes(model, consts):
        return model, None
    found = _shapes(model, export_batch)
    if found is None:
        return model, None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph(out, consts, found[0], found[1:])
    for gemm in [n for n in g.nodes if n.op_type == "Gemm"]:
        _gemm_on_rows(g, gemm)
    steps = 0
    changed = True
    while changed and steps < _MAX_STEPS:
        changed = False
        for node in list(g.nodes):
            if node in g.nodes and node.op_type == "Transpose" and (_sink(g, node) or _hoist(g, node)):
                changed = True
                steps += 1
    if not g.moved:
        return model, None
    del out.graph.node[:]
    out.graph.node.extend(g.nodes)
    out.graph.initializer.extend(g.inits)
    del out.graph.value_info[:]  # shapes recorded for the moved tensors no longer hold
    gemms = f"; {g.gemms} Gemm(s) on flattened rows as MatMuls" if g.gemms else ""
    return out, f"{g.moved} row-wise op(s) moved past the Transposes that hold the batch outside dim 0{gemms}"
