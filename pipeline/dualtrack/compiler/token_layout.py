"""Token tensors written as the images they are (a front-end pass).

A vision transformer's token tensor ``t`` of shape (N, L, C), channels last, made from an image by
``x.flatten(2).transpose(1, 2)``, is that image's NHWC buffer: Track A holds the image (N, C, H, W) as
NHWC, whose pixel (h, w) is token ``h*W + w``. The exporters write the token side as rank-3 ops that
Track A's lowerings do not see as image ops (LayerNormalization over the last axis, ``nn.Linear`` as a
MatMul by a constant (C, K) matrix and an Add of a (K,) bias, Gelu, the residual Adds), between
Reshape / Transpose pairs to and from the image layout. :func:`tokens_as_images` gives every such token
tensor an NCHW *twin* (N, C, H, W) and writes its ops over the twins, as ``channels_last`` does for
4-D channels-last blocks: a Linear is a 1x1 Conv with its bias, LayerNormalization keeps a Transpose
pair (``lower_norm``'s LayerNorm over channels), element-wise ops take (C,) and (1, L, C) constants as
(1, C, 1, 1) and (1, C, H, W) ones, and the layout nodes between image and tokens disappear.

Unlike ``channels_last``, the regions need not be closed: a token tensor that an op the pass does not
write reads (attention's Reshape into heads, a graph output) is written back from its twin by the
exported form, ``Transpose(Reshape(twin, [-1, C, L]), [0, 2, 1])``, and a token tensor that such an
op produces (attention's output) enters by the inverse. Track A reads those pairs as views (the
attention call folds them into its operands' strides); Track B computes them as the export did.

(H, W) of a token tensor comes from the image it was flattened from or is reshaped back into: token
tensors joined by the ops the pass writes (and Transposes between (N, L, C) and (N, C, L)) form a
group, and a group takes the pass only where all its layout nodes agree on one (H, W).

A channels-last image (N, H, W, C), ``Transpose(image, [0, 2, 3, 1])``, is the same case with its (H, W) in
its shape: the regions ``channels_last`` leaves as exported because another op reads them (Swin's Reshape
into windows) are written here, with that reader given ``Transpose(image)`` back and a channels-last result
of such an op entering where it meets the region at an element-wise op (the residual Add after the windows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.channels_last import BINARY, TO_NCHW, TO_NHWC, UNARY
from dualtrack.compiler.onnx_graph import (
    copy_node,
    fresh_name,
    live_nodes,
    node_attrs,
    taken_names,
    transpose_perm,
    weightless,
)

SWAP = [0, 2, 1]  # (N, L, C) <-> (N, C, L)
TOK, CF, NHWC = "tok", "cf", "nhwc"  # a tensor's relation to its twin image: (N, L, C), (N, C, L) or (N, H, W, C)


@dataclass
class _Groups:
    """Union-find over rank-3 tensors that share one (H, W), with the (H, W) their layout nodes name."""

    parent: dict[str, str] = field(default_factory=dict)
    hints: dict[str, set[tuple[int, int]]] = field(default_factory=dict)

    def root(self, t: str) -> str:
        while self.parent.setdefault(t, t) != t:
            t = self.parent[t]
        return t

    def union(self, a: str, b: str) -> None:
        ra, rb = self.root(a), self.root(b)
        if ra != rb:
            self.parent[rb] = ra
            self.hints.setdefault(ra, set()).update(self.hints.pop(rb, set()))

    def hint(self, t: str, hw: tuple[int, int]) -> None:
        self.hints.setdefault(self.root(t), set()).add(hw)

    def hw(self, t: str) -> tuple[int, int] | None:
        h = self.hints.get(self.root(t), set())
        return next(iter(h)) if len(h) == 1 else None


@dataclass
class _Graph:
    """Shapes (batch dim as 0), constants and readers of the graph being rewritten."""

    shapes: dict[str, tuple[int, ...]]
    consts: dict[str, np.ndarray]
    readers: dict[str, list[onnx.NodeProto]]
    producers: dict[str, onnx.NodeProto] = field(default_factory=dict)

    def shape(self, t: str) -> tuple[int, ...] | None:
        return self.shapes.get(t)

    def reshape_to(self, node: onnx.NodeProto) -> tuple[int, ...] | None:
        """The output shape of a Reshape (or Flatten) as inferred, where its input's is known."""
        if node.op_type not in ("Reshape", "Flatten") or self.shape(node.input[0]) is None:
            return None
        return self.shape(node.output[0])


def _shapes(model: onnx.ModelProto, batch: int) -> dict[str, tuple[int, ...]]:
    """Static shapes after dim 0 (dim 0 recorded as 0), inferred with the input's batch at ``batch``,
    the export's: its Reshapes still carry it (the front end frees them later)."""
    at = weightless(model)
    for i in at.graph.input:
        dims = i.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value"):
            dims[0].Clear()
            dims[0].dim_value = batch
    inferred = onnx.shape_inference.infer_shapes(at, data_prop=True)  # Shape -> Reshape chains (TorchScript)
    out: dict[str, tuple[int, ...]] = {}
    g = inferred.graph
    for v in [*g.value_info, *g.input, *g.output]:
        dims = v.type.tensor_type.shape.dim
        if not v.type.tensor_type.HasField("shape") or not dims:
            continue
        rest = [d.dim_value if d.HasField("dim_value") else -1 for d in dims[1:]]
        if all(d > 0 for d in rest):
            out[v.name] = (0, *rest)
    return out


def _flat_hw(image: tuple[int, ...], flat: tuple[int, ...]) -> tuple[int, int] | None:
    """(H, W) where ``image`` (N, C, H, W) and ``flat`` (N, C, H*W) are one tensor's two forms."""
    if len(image) == 4 and len(flat) == 3 and image[1] == flat[1] and image[2] * image[3] == flat[2]:
        return image[2], image[3]
    return None


def _token_hw(image_nhwc: tuple[int, ...], tokens: tuple[int, ...]) -> tuple[int, int] | None:
    """(H, W) where ``image_nhwc`` (N, H, W, C) and ``tokens`` (N, H*W, C) are one tensor's two forms."""
    ok = len(image_nhwc) == 4 and len(tokens) == 3 and image_nhwc[3] == tokens[2]
    return (image_nhwc[1], image_nhwc[2]) if ok and image_nhwc[1] * image_nhwc[2] == tokens[1] else None


def _is_token_op(g: _Graph, node: onnx.NodeProto) -> bool:
    """An op this pass may write over twins (its checks on operands come at rewrite time)."""
    out = g.shape(node.output[0]) if node.output else None
    if out is None or len(out) not in (3, 4) or len(node.output) != 1:
        return False
    if node.op_type == "MatMul":
        w = g.consts.get(node.input[1])
        return w is not None and w.ndim == 2
    return node.op_type in UNARY or node.op_type in BINARY or node.op_type == "LayerNormalization"


def _same(g: _Graph, node: onnx.NodeProto) -> bool:
    """A layout node that leaves a rank-3 tensor as it is (an Identity; a flatten of a flat tensor)."""
    shape = g.shape(node.input[0]) if node.input else None
    if node.op_type == "Identity":
        return shape is not None and len(shape) == 3
    to = g.reshape_to(node)
    return to is not None and len(to) == 3 and to == shape


def _norm_chain(g: _Graph, node: onnx.NodeProto) -> bool:
    """A LayerNormalization between a Transpose to NHWC and Transposes back alone: the form ``lower_norm``
    takes already (``channels_last`` writes it so)."""
    producer = g.producers.get(node.input[0])
    readers = g.readers.get(node.output[0], [])
    if producer is None or transpose_perm(producer) != TO_NHWC or not readers:
        return False
    return all(transpose_perm(r) == TO_NCHW for r in readers)


def _flattens(g: _Graph, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(H, W) where ``node`` flattens an image (N, C, H, W) into (N, C, H*W) that only Transposes into
    tokens read (``x.flatten(2).transpose(1, 2)``; the merge of attention's heads, (N, L, heads, d) ->
    (N, L, C), has the same shapes)."""
    to = g.reshape_to(node)
    readers = g.readers.get(node.output[0], [])
    if to is None or not readers or any(transpose_perm(r) != SWAP for r in readers):
        return None
    return _flat_hw(g.shape(node.input[0]) or (), to)


def _unflattens(g: _Graph, node: onnx.NodeProto, swapped: set[str]) -> tuple[int, int] | None:
    """(H, W) where ``node`` reshapes tokens back into an image: (N, C, L) that a Transpose made into
    (N, C, H, W), or (N, L, C) into (N, H, W, C) that only Transposes to NCHW read."""
    to = g.reshape_to(node)
    if to is None:
        return None
    src = g.shape(node.input[0]) or ()
    if node.input[0] in swapped and (hw := _flat_hw(to, src)):
        return hw
    readers = g.readers.get(node.output[0], [])
    if readers and all(transpose_perm(r) == TO_NCHW for r in readers):
        return _token_hw(to, src)
    return None


def _groups(graph: onnx.GraphProto, g: _Graph) -> _Groups:
    """Token tensors joined by the ops the pass writes, and the (H, W) their layout nodes name (only
    the unambiguous ones: :func:`_flattens`, :func:`_unflattens`)."""
    groups = _Groups()
    swapped = {n.output[0] for n in graph.node if transpose_perm(n) == SWAP}
    for n in graph.node:
        if _is_token_op(g, n):
            for i in n.input:
                if i and i not in g.consts and len(g.shape(i) or ()) == 3:
                    groups.union(n.output[0], i)
        elif (transpose_perm(n) == SWAP and g.shape(n.input[0]) is not None) or _same(g, n):
            groups.union(n.output[0], n.input[0])
        elif hw := _flattens(g, n):
            groups.hint(n.output[0], hw)
        elif hw := _unflattens(g, n, swapped):
            groups.hint(n.input[0], hw)
    return groups


@dataclass
class _Rewriter:
    """One walk over the graph in order. ``twin``: a token tensor's twin image and its relation to it;
    ``rename``: a tensor that is its twin image itself (the layout nodes back to the image)."""

    g: _Graph
    groups: _Groups
    taken: set[str]
    outputs: set[str]
    twin: dict[str, tuple[str, str]] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)
    skip: set[str] = field(default_factory=set)  # outputs of nodes an earlier rewrite took in (a Linear's bias Add)
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    rewritten: int = 0

    def fresh(self, base: str) -> str:
        return fresh_name(f"{base}__img", self.taken)

    def constant(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def walk(self, graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if node.output and node.output[0] in self.skip:
                continue
            for k, x in enumerate(node.input):
                if x in self.rename:
                    node.input[k] = self.rename[x]
            made = self.rewrite(node) if _is_token_op(self.g, node) else None
            if made is None:
                self.nodes.append(node)
                self.relate(node)
                continue
            self.rewritten += 1
            self.nodes.extend(made)

    def relate(self, node: onnx.NodeProto) -> None:
        """Record what a layout node's output is to a twin (the node itself stays, read by what is left)."""
        x, out = (node.input[0], node.output[0]) if node.input and node.output else ("", "")
        shape, to = self.g.shape(x), self.g.reshape_to(node)
        if _same(self.g, node) and x in self.twin:
            self.twin[out] = self.twin[x]
        elif transpose_perm(node) == SWAP and x in self.twin:
            image, kind = self.twin[x]
            self.twin[out] = (image, CF if kind == TOK else TOK)
        elif transpose_perm(node) == TO_NCHW and self.twin.get(x, ("", ""))[1] == NHWC and out not in self.outputs:
            self.rename[out] = self.twin[x][0]
        elif transpose_perm(node) == TO_NHWC and x not in self.twin and shape is not None and len(shape) == 4:
            self.twin[out] = (x, NHWC)  # an image channels-last (a region channels_last left open)
        elif to is None or shape is None:
            return
        elif x in self.twin and out not in self.outputs:
            image, kind = self.twin[x]
            if kind == CF and to == self.g.shape(image):
                self.rename[out] = image
            elif kind == TOK and (hw := self.groups.hw(x)) and to == (0, *hw, shape[2]):
                self.twin[out] = (image, NHWC)
        elif len(shape) == 4 and (hw := _flattens(self.g, node)) and self.groups.hw(out) == hw:
            self.twin[out] = (x, CF)

    def exit(self, out: str, image: str, kind: str) -> list[onnx.NodeProto]:
        """``out`` written back from its twin as the export has it: Transpose(Reshape(image, [-1, C, L])) for
        tokens, Transpose(image) to NHWC for a channels-last image."""
        # Named after the reader that takes the tokens (an attention's split into heads), whose track it shares
        # (rules by name prefix: the exit is that reader's layout, the attention call folds it).
        others = [r for r in self.g.readers.get(out, []) if not _is_token_op(self.g, r)]
        base = others[0].name if others and others[0].name else out
        if kind == NHWC:
            return [helper.make_node("Transpose", [image], [out], name=self.fresh(f"{base}_nhwc"), perm=TO_NHWC)]
        _, c, h, w = self.g.shapes[image]
        shape = self.constant(f"{out}_flat", np.array([-1, c, h * w], np.int64))
        flat = self.fresh(f"{out}_flat")
        return [
            helper.make_node("Reshape", [image, shape], [flat], name=self.fresh(f"{base}_tokens_cf")),
            helper.make_node("Transpose", [flat], [out], name=self.fresh(f"{base}_tokens"), perm=SWAP),
        ]

    def entry(self, t: str) -> tuple[str, list[onnx.NodeProto]]:
        """The twin of a token tensor an op this pass does not write produced (attention's output)."""
        producer = self.g.producers.get(t)
        base = producer.name if producer is not None and producer.name else t  # its producer's layout (as exits)
        if len(self.g.shapes[t]) == 4:  # a channels-last image (Swin's window reverse): its transpose
            _, h, w, c = self.g.shapes[t]
            image = self.fresh(t)
            self.g.shapes[image], self.twin[t] = (0, c, h, w), (image, NHWC)
            return image, [helper.make_node("Transpose", [t], [image], name=self.fresh(f"{base}_image"), perm=TO_NCHW)]
        hw = self.groups.hw(t)
        assert hw is not None
        _, _, c = self.g.shapes[t]
        image, cf = self.fresh(t), self.fresh(f"{t}_cf")
        self.g.shapes[image] = (0, c, *hw)
        shape = self.constant(f"{t}_image", np.array([-1, c, *hw], np.int64))
        self.twin[t] = (image, TOK)
        return image, [
            helper.make_node("Transpose", [t], [cf], name=self.fresh(f"{base}_image_cf"), perm=SWAP),
            helper.make_node("Reshape", [cf, shape], [image], name=self.fresh(f"{base}_image")),
        ]

    def operand(self, t: str, enter: bool) -> str | None:
        """How an op reads token tensor ``t``: its twin, or None where it has none (``enter``: may get one)."""
        if t in self.twin:
            image, kind = self.twin[t]
            return image if kind != CF else None
        shape = self.g.shape(t)
        if not enter or shape is None:
            return None
        hw = self.groups.hw(t) if len(shape) == 3 else None
        if len(shape) == 4 or (hw is not None and shape[1] == hw[0] * hw[1]):
            return ""  # an entry, made once the whole op is known to be written
        return None

    def hw(self, t: str) -> tuple[int, int] | None:
        """(H, W) of the twin image of token tensor or channels-last image ``t``."""
        shape = self.g.shape(t) or ()
        return (shape[1], shape[2]) if len(shape) == 4 else self.groups.hw(t)

    def out(self, node: onnx.NodeProto, channels: int) -> tuple[str, list[onnx.NodeProto]]:
        """The twin name of ``node``'s output ((N, L, channels) or (N, H, W, channels)) and the exit that
        writes the original back."""
        o = node.output[0]
        hw = self.hw(o)
        assert hw is not None
        image, kind = self.fresh(o), NHWC if len(self.g.shapes[o]) == 4 else TOK
        self.g.shapes[image] = (0, channels, *hw)
        self.twin[o] = (image, kind)
        return image, self.exit(o, image, kind)

    def rewrite(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """``node`` written over twins (entries first, the exit of its output last), or None."""
        if self.hw(node.output[0]) is None:
            return None
        if node.op_type == "MatMul":
            return self._matmul(node)
        if node.op_type == "LayerNormalization":
            return self._layer_norm(node)
        return self._eltwise(node)

    def _inputs(self, node: onnx.NodeProto, tokens: list[int], enter: bool) -> list[str] | None:
        """The node's inputs with each token input at ``tokens`` replaced by its twin (entries emitted)."""
        got = [self.operand(node.input[k], enter) for k in tokens]
        if any(t is None for t in got):
            return None
        ins = list(node.input)
        for k, t in zip(tokens, got, strict=True):
            if t == "":
                t, made = self.entry(node.input[k])
                self.nodes.extend(made)
            ins[k] = t
        return ins

    def _matmul(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """A MatMul by a constant (C, K) matrix: a 1x1 Conv, taking as its bias the Add of a constant
        (K,) vector that alone reads its product (``nn.Linear`` as exported)."""
        w = self.g.consts[node.input[1]]
        shape = self.g.shape(node.input[0])
        if shape is None or len(shape) not in (3, 4) or shape[-1] != w.shape[0]:
            return None
        ins = self._inputs(node, [0], enter=len(shape) == 3)  # an image channels-last enters at a residual Add
        if ins is None:
            return None
        weight = self.constant(f"{node.name}_weight", np.ascontiguousarray(w.T)[:, :, None, None])
        conv_ins, last = [ins[0], weight], node
        add = self.g.readers.get(node.output[0], [])
        if len(add) == 1 and add[0].op_type == "Add" and node.output[0] not in self.outputs:
            other = [i for i in add[0].input if i != node.output[0]]
            bias = self.g.consts.get(other[0]) if len(other) == 1 else None
            if bias is not None and bias.size == w.shape[1] and bias.shape[-1:] == (w.shape[1],):
                conv_ins.append(self.constant(f"{add[0].name}_bias", bias.reshape(-1).astype(w.dtype)))
                last = add[0]
                self.skip.add(add[0].output[0])
        image, back = self.out(last, int(w.shape[1]))
        conv = helper.make_node("Conv", conv_ins, [image], name=node.name, kernel_shape=[1, 1])
        return [conv, *back]

    def _layer_norm(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """LayerNormalization over the last axis: over the twin's channels, between a Transpose pair
        (the form ``lower_norm`` takes as a LayerNorm over channels)."""
        shape = self.g.shape(node.input[0])
        if shape is None or node_attrs(node).get("axis", -1) not in (-1, len(shape) - 1):
            return None
        if any(i in self.twin for i in node.input[1:]) or _norm_chain(self.g, node):
            return None
        ins = self._inputs(node, [0], enter=len(shape) == 3)
        if ins is None:
            return None
        nhwc, normed = self.fresh(f"{node.output[0]}_nhwc"), self.fresh(f"{node.output[0]}_normed")
        norm = copy_node(node, [nhwc, *ins[1:]], normed)
        image, back = self.out(node, shape[-1])
        return [
            helper.make_node("Transpose", [ins[0]], [nhwc], name=self.fresh(f"{node.name}_to_nhwc"), perm=TO_NHWC),
            norm,
            helper.make_node("Transpose", [normed], [image], name=self.fresh(f"{node.name}_to_nchw"), perm=TO_NCHW),
            *back,
        ]

    def _eltwise(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """A unary or binary element-wise op: token operands by their twins (one of them must have one;
        another of the same shape may enter), constants broadcast over tokens as images."""
        shape = self.g.shape(node.output[0])
        assert shape is not None
        tokens = [k for k, i in enumerate(node.input) if i and i not in self.g.consts]
        if node.op_type in UNARY and tokens != [0]:
            return None
        if not tokens or any(self.g.shape(node.input[k]) != shape for k in tokens):
            return None  # a token tensor broadcast against another: not an image op
        if not any(node.input[k] in self.twin for k in tokens):
            return None
        consts = {}
        for k, i in enumerate(node.input):
            if k not in tokens and i and node.op_type in BINARY:
                consts[k] = self._broadcast(node, k, shape)
                if consts[k] is None:
                    return None
        ins = self._inputs(node, tokens, enter=True)
        if ins is None:
            return None
        for k, c in consts.items():
            ins[k] = c
        image, back = self.out(node, shape[-1])
        return [copy_node(node, ins, image), *back]

    def _broadcast(self, node: onnx.NodeProto, k: int, shape: tuple[int, ...]) -> str | None:
        """Constant input ``k`` of a binary op on tokens (N, L, C) or a channels-last image (N, H, W, C) as the
        constant the twins take."""
        c, name = self.g.consts[node.input[k]], node.input[k]
        if c.size == 1:
            return name
        if c.ndim > len(shape):
            return None
        cr = c.reshape((1,) * (len(shape) - c.ndim) + c.shape)
        if cr.shape[0] != 1 or any(d not in (1, n) for d, n in zip(cr.shape[1:], shape[1:], strict=True)):
            return None
        if cr.ndim == 3:  # (1, L or 1, C or 1): the tokens' (H, W) or one pixel
            hw = self.hw(node.output[0])
            assert hw is not None
            h, w = hw if cr.shape[1] == shape[1] else (1, 1)
            cr = cr.reshape(1, h, w, cr.shape[2])
        return self.constant(f"{node.name}_in{k}", np.ascontiguousarray(cr.transpose(TO_NCHW)))


def tokens_as_images(
    model: onnx.ModelProto, consts: dict[str, np.ndarray], batch: int = 1
) -> tuple[onnx.ModelProto, str | None]:
    """The model with its token tensors' ops written over their twin images (the module's docstring),
    and a line saying what changed (None where nothing did). ``consts``: the graph's constant tensors;
    ``batch``: the batch the export's shapes were written at (its input's dim 0 may be symbolic now)."""
    if not any(transpose_perm(n) in (SWAP, TO_NHWC) for n in model.graph.node):
        return model, None  # no token tensor or channels-last image made from an image
    consts = dict(consts)
    for n in model.graph.node:  # exporters alias shared weights through Identity nodes
        if n.op_type == "Identity" and n.input and n.input[0] in consts:
            consts[n.output[0]] = consts[n.input[0]]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in out.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    producers = {o: n for n in out.graph.node for o in n.output}
    g = _Graph(_shapes(model, batch), consts, readers, producers)
    outputs = {o.name for o in model.graph.output}
    rw = _Rewriter(g, _groups(out.graph, g), taken_names(out.graph), outputs)
    rw.walk(out.graph)
    if not rw.rewritten:
        return model, None
    nodes = live_nodes([onnx.NodeProto.FromString(n.SerializeToString()) for n in rw.nodes], outputs)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(rw.inits)
    read = {i for n in nodes for i in n.input} | outputs
    kept = [i for i in out.graph.initializer if i.name in read]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    del out.graph.value_info[:]  # the token tensors' producers changed; the partition infers shapes again
    return out, (
        f"{rw.rewritten} token-tensor op(s) written over their images (Linear as 1x1 Conv, LayerNorm over "
        "channels, element-wise ops on images; the token layout nodes left only where other ops read tokens)"
    )


__all__ = ["tokens_as_images"]
