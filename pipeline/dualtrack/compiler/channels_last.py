"""Channels-last regions written back channels-first (a front-end pass).

PyTorch code that runs a block channels-last (ConvNeXt's ``permute(0, 2, 3, 1)``, LayerNorm, two
``nn.Linear`` and GELU, ``permute(0, 3, 1, 2)``) exports as Transpose, MatMul over the last axis,
element-wise ops with per-channel constants of shape (C,), and Transpose back. Track A keeps every
activation in NHWC already, so those Transposes move nothing there; what it needs is the region
written in the graph's NCHW convention, where its kernels' lowerings recognise it: a MatMul by a
constant (C, K) matrix over the last axis is a 1x1 Conv, a (C,) constant broadcast over the last axis
is a (C, 1, 1) one, a reduction, softmax, Split or Concat over axis 3 is one over axis 1, and a LayerNormalization
over the last axis keeps its own Transpose pair (``lower_norm``'s LayerNorm-over-channels chain).

:func:`channels_first` does this for every *closed* region: the tensors reachable from a
Transpose(0, 2, 3, 1) of a 4-D tensor through ops it rewrites, each of whose readers is such an op or
a Transpose(0, 3, 1, 2) (which then disappears). A region with any other reader (a Reshape into
windows, a graph output) is left exactly as exported: it would need a Transpose back for that reader.
A region of LayerNorms alone is rewritten only where LayerNorms share one Transpose (the exporter's
common-subexpression elimination): each then gets its own pair, which lower_norm matches.

Why hand-written: onnxruntime's transpose optimizer pushes Transposes through element-wise ops but
keeps MatMul a MatMul and runs inside a session (its output is onnxruntime's own graph); onnxslim and
onnxoptimizer cancel adjacent Transposes only. None turns a MatMul over channels into a Conv.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.onnx_graph import copy_node, fresh_name, live_nodes, node_attrs, taken_names, transpose_perm

TO_NHWC = [0, 2, 3, 1]
TO_NCHW = [0, 3, 1, 2]
# Element-wise ops of one tensor: the same op, whatever the layout (Clip's min and max, scalars, ride along).
UNARY = frozenset(
    {
        "Abs", "Cast", "Ceil", "Clip", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity",
        "LeakyRelu", "Log", "Mish", "Neg", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Softplus",
        "Softsign", "Sqrt", "Tanh",
    }
)  # fmt: skip
BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu"})
REDUCE = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceSumSquare"})
NCHW_AXIS = TO_NHWC  # axis a of the NHWC tensor is axis NCHW_AXIS[a] of its NCHW twin


@dataclass
class _Regions:
    """Union-find over the seeds (the Transposes into NHWC) whose regions meet in one node."""

    parent: dict[str, str] = field(default_factory=dict)
    open: set[str] = field(default_factory=set)
    useful: set[str] = field(default_factory=set)  # roots with an op besides LayerNormalization, or a shared one

    def root(self, s: str) -> str:
        while self.parent.setdefault(s, s) != s:
            s = self.parent[s]
        return s

    def union(self, seeds: list[str]) -> str:
        roots = [self.root(s) for s in seeds]
        for r in roots[1:]:
            if r != roots[0]:
                self.parent[r] = roots[0]
                if r in self.open:
                    self.open.add(roots[0])
                if r in self.useful:
                    self.useful.add(roots[0])
        return roots[0]


@dataclass
class _Rewriter:
    """One walk over the graph in order. ``twin`` maps a channels-last tensor of a region to its
    channels-first name, ``seed`` to its region's seed; ``allowed``: the seeds to rewrite (None: all,
    a dry run that finds which regions are closed)."""

    consts: dict[str, np.ndarray]
    allowed: set[str] | None
    regions: _Regions
    taken: set[str]
    outputs: set[str]
    twin: dict[str, str] = field(default_factory=dict)
    seed: dict[str, str] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)
    readers: dict[str, list[onnx.NodeProto]] = field(default_factory=dict)
    skip: set[str] = field(default_factory=set)  # outputs of nodes an earlier rewrite took in (a Linear's bias Add)
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    rewritten: int = 0

    def fresh(self, base: str) -> str:
        return fresh_name(f"{base}__nchw", self.taken)

    def constant(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def walk(self, graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for i in node.input:
                self.readers.setdefault(i, []).append(node)
        for node in graph.node:
            if node.output and node.output[0] in self.skip:
                continue
            for k, x in enumerate(node.input):
                if x in self.rename:
                    node.input[k] = self.rename[x]
            inside = [x for x in node.input if x in self.twin]
            if transpose_perm(node) == TO_NHWC and not inside:
                self.regions.root(node.output[0])
                if self.allowed is None or self.regions.root(node.output[0]) in self.allowed:
                    self.twin[node.output[0]], self.seed[node.output[0]] = node.input[0], node.output[0]
                self.nodes.append(node)
                continue
            if not inside:
                self.nodes.append(node)
                continue
            root = self.regions.union([self.seed[x] for x in inside])
            made = self.rewrite(node)
            if made is None:  # a reader the pass cannot rewrite: the region stays as exported
                self.regions.open.add(root)
                self.nodes.append(node)
                continue
            # A LayerNorm alone needs no rewrite (lower_norm matches it between its Transposes) unless
            # its Transpose is shared: an exporter's CSE gives one permute to two LayerNorms of the
            # same tensor (a ConvNeXt stage's downsample norm and an UPerNet neck's), and a chain must
            # own its nodes; the rewrite gives each LayerNorm a Transpose pair of its own.
            shared = node.op_type == "LayerNormalization" and len(self.readers.get(node.input[0], [])) > 1
            if node.op_type not in ("LayerNormalization", "Transpose") or shared:
                self.regions.useful.add(root)
            self.rewritten += 1
            self.nodes.extend(made)
        for o in graph.output:
            if o.name in self.twin:
                self.regions.open.add(self.regions.root(self.seed[o.name]))

    def out(self, node: onnx.NodeProto, root_of: str) -> str:
        """The channels-first name of ``node``'s output, recorded as its twin."""
        t = node.output[0]
        self.twin[t], self.seed[t] = self.fresh(t), self.seed[root_of]
        return self.twin[t]

    def rewrite(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """``node`` written over the channels-first twins, or None where the pass does not rewrite it."""
        op, x = node.op_type, next(i for i in node.input if i in self.twin)
        if op == "Split":
            return self._split(node, x)
        if len(node.output) != 1:
            return None
        if op == "Transpose":
            if transpose_perm(node) != TO_NCHW:
                return None
            if node.output[0] in self.outputs:  # the caller reads it by name
                return [helper.make_node("Identity", [self.twin[x]], [node.output[0]], name=node.name)]
            self.rename[node.output[0]] = self.twin[x]  # later readers take the twin itself
            return []
        if op == "LayerNormalization":
            return self._layer_norm(node, x)
        if op == "MatMul":
            return self._matmul(node, x)
        if op in UNARY:
            if node.input[0] != x or any(i in self.twin for i in node.input[1:]):
                return None
            return [copy_node(node, [self.twin[x], *node.input[1:]], self.out(node, x))]
        if op in BINARY:
            return self._binary(node, x)
        if op in REDUCE or op == "Softmax":
            return self._axes(node, x)
        if op == "Concat":
            if not all(i in self.twin for i in node.input):
                return None
            return [self._on_axis(copy_node(node, [self.twin[i] for i in node.input], self.out(node, x)))]
        return None

    def _on_axis(self, new: onnx.NodeProto) -> onnx.NodeProto:
        """``new`` (a copy of a Split or Concat over NHWC tensors) along the same axis of the NCHW twins."""
        for a in new.attribute:
            if a.name == "axis":
                a.i = NCHW_AXIS[a.i % 4]
        return new

    def _split(self, node: onnx.NodeProto, x: str) -> list[onnx.NodeProto] | None:
        """A Split of a region tensor (MambaOut's gate, input and conv channels out of one Linear) over the
        twin, along the same axis; each part's twin is a part of the twin."""
        if node.input[0] != x or any(i in self.twin for i in node.input[1:]) or "" in node.output:
            return None
        new = copy_node(node, [self.twin[x], *node.input[1:]], node.output[0])
        del new.output[:]
        for t in node.output:
            self.twin[t], self.seed[t] = self.fresh(t), self.seed[x]
            new.output.append(self.twin[t])
        if not any(a.name == "axis" for a in new.attribute):
            new.attribute.append(helper.make_attribute("axis", 0))
        return [self._on_axis(new)]

    def _layer_norm(self, node: onnx.NodeProto, x: str) -> list[onnx.NodeProto] | None:
        a = node_attrs(node)
        if node.input[0] != x or a.get("axis", -1) not in (-1, 3) or any(i in self.twin for i in node.input[1:]):
            return None
        into, back = self.fresh(f"{node.name}_to_nhwc"), self.fresh(f"{node.name}_to_nchw")
        nhwc = self.fresh(x)
        norm = copy_node(node, [nhwc, *node.input[1:]], node.output[0])  # writes its own output name, in NHWC
        return [
            helper.make_node("Transpose", [self.twin[x]], [nhwc], name=into, perm=TO_NHWC),
            norm,
            helper.make_node("Transpose", [node.output[0]], [self.out(node, x)], name=back, perm=TO_NCHW),
        ]

    def _matmul(self, node: onnx.NodeProto, x: str) -> list[onnx.NodeProto] | None:
        """A MatMul by a constant (C, K) matrix: a 1x1 Conv, taking as its bias the Add of a constant
        (K,) vector that alone reads its product (``nn.Linear`` as exported)."""
        w = self.consts.get(node.input[1])
        if node.input[0] != x or w is None or w.ndim != 2:
            return None
        weight = self.constant(f"{node.name}_weight", np.ascontiguousarray(w.T)[:, :, None, None])
        ins, out = [self.twin[x], weight], node
        add = self.readers.get(node.output[0], [])
        if len(add) == 1 and add[0].op_type == "Add" and node.output[0] not in self.outputs:
            other = [i for i in add[0].input if i != node.output[0]]
            bias = self.consts.get(other[0]) if len(other) == 1 else None
            if bias is not None and bias.size == w.shape[1] and bias.shape[-1:] == (w.shape[1],):
                ins.append(self.constant(f"{add[0].name}_bias", bias.reshape(-1).astype(w.dtype)))
                out = add[0]
                self.skip.add(add[0].output[0])
        conv = helper.make_node("Conv", ins, [self.out(out, x)], kernel_shape=[1, 1])
        conv.name = node.name
        return [conv]

    def _binary(self, node: onnx.NodeProto, x: str) -> list[onnx.NodeProto] | None:
        ins: list[str] = []
        for k, i in enumerate(node.input):
            if i in self.twin:
                ins.append(self.twin[i])
                continue
            c = self.consts.get(i)
            if c is None or c.ndim > 4:
                return None
            if c.size == 1:
                ins.append(i)
                continue
            four = c.reshape((1,) * (4 - c.ndim) + c.shape)
            ins.append(self.constant(f"{node.name}_in{k}", np.ascontiguousarray(four.transpose(TO_NCHW))))
        return [copy_node(node, ins, self.out(node, x))]

    def _axes(self, node: onnx.NodeProto, x: str) -> list[onnx.NodeProto] | None:
        a = node_attrs(node)
        if node.input[0] != x or a.get("keepdims", 1) != 1:
            return None
        new = copy_node(node, [self.twin[x], *node.input[1:]], self.out(node, x))
        if node.op_type == "Softmax":
            axes = [a.get("axis", -1)]
        elif len(node.input) > 1 and node.input[1]:
            if node.input[1] not in self.consts:
                return None
            axes = [int(v) for v in np.ravel(self.consts[node.input[1]])]
        else:
            axes = list(a.get("axes", [0, 1, 2, 3]))
        mapped = sorted(NCHW_AXIS[v % 4] for v in axes)
        del new.attribute[:]
        for k, v in a.items():
            if k not in ("axis", "axes"):
                new.attribute.append(helper.make_attribute(k, v))
        if node.op_type == "Softmax":
            new.attribute.append(helper.make_attribute("axis", mapped[0]))
        elif len(node.input) > 1 and node.input[1]:
            new.input[1] = self.constant(f"{node.name}_axes", np.array(mapped, dtype=np.int64))
        else:
            new.attribute.append(helper.make_attribute("axes", mapped))
        return [new]


def channels_first(model: onnx.ModelProto, consts: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, str | None]:
    """The model with every closed channels-last region written channels-first (the module's
    docstring), and a line saying what changed (None where nothing did). ``consts``: the graph's
    constant tensors by name (initializers and Constant nodes)."""
    if not any(transpose_perm(n) == TO_NHWC for n in model.graph.node):
        return model, None  # no region to rewrite: no copy of the model
    consts = dict(consts)
    for n in model.graph.node:  # exporters alias shared weights through Identity nodes
        if n.op_type == "Identity" and n.input[0] in consts:
            consts[n.output[0]] = consts[n.input[0]]
    dry = onnx.ModelProto()
    dry.CopyFrom(model)
    regions = _Regions()
    outputs = {o.name for o in model.graph.output}
    _Rewriter(consts, None, regions, taken_names(dry.graph), outputs).walk(dry.graph)
    closed = {r for r in regions.parent if regions.root(r) == r and r not in regions.open and r in regions.useful}
    if not closed:
        return model, None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    seeds = {s for s in regions.parent if regions.root(s) in closed}
    rw = _Rewriter(consts, seeds, _Regions(), taken_names(out.graph), outputs)
    rw.walk(out.graph)
    nodes = live_nodes([onnx.NodeProto.FromString(n.SerializeToString()) for n in rw.nodes], outputs)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(rw.inits)
    read = {i for n in nodes for i in n.input} | outputs
    kept = [i for i in out.graph.initializer if i.name in read]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    del out.graph.value_info[:]  # shapes of the rewritten tensors changed; the partition infers them again
    return out, (
        f"{len(closed)} channels-last region(s) written channels-first ({rw.rewritten} nodes: MatMul over channels "
        "as 1x1 Conv, per-channel constants as (C,1,1), their Transposes dropped)"
    )


__all__ = ["channels_first"]
