"""Keep NHWC tensors NHWC inside a segment's ONNX graph: sink the boundary Transposes.

Track A hands tensors over in NHWC, and ONNX convolutions are NCHW, so a segment model starts
with ``Transpose(0, 3, 1, 2)`` where it reads from Track A (partition.extract_segment) and the
model's own pre-processing may transpose its NHWC image too. Left in the graph, the transpose
decides the layout of everything after it: IREE then runs a 1x1 convolution as a 2 x HW matmul
and a softmax over channels as a strided reduction across the whole image.

:func:`sink_transposes` rewrites each op downstream of such a transpose to work on the NHWC
tensor directly, and puts a transpose back only where an op cannot (or a graph output needs NCHW):

- element-wise ops, with constant operands permuted to match (by nodes on the original
  initializers, so a segment's weights stay the model's initializers: FACTS 11a);
- Softmax / LogSoftmax / ArgMax / ArgMin with their axis moved (an ArgMax over the channels
  without keepdims gives the same N x H x W tensor in either layout);
- a 1x1 stride-1 unpadded Conv becomes ``MatMul(x, W^T) + b``;
- ``Transpose(0, 2, 3, 1)`` of such a tensor is the NHWC tensor itself.

The rewrite changes no value: every output keeps its name, shape and layout, and the build checks
each compiled segment against onnxruntime on the original graph as it always does.

:func:`widen_elementwise` then takes a segment that is nothing but element-wise ops on NHWC tensors
with a few channels (the pre-processing: uint8 image -> normalised fp16) and views every tensor as
rows of up to ``WIDE_ROW`` pixels (:func:`row_pixels`: the most that divide H x W), the per-channel
constants tiled to a row. IREE 3.13 gives an element-wise dispatch whose innermost dimension is 3 one
element per thread in 32-thread workgroups (0.14 ms for eight 512x512 images, 6 MB in; 127 us for
eight 528x528 images on an H100, when rows had to be exactly WIDE_ROW pixels and 528 x 528 is not a
multiple of 512); with 1536-wide rows it loads 16 bytes a thread (10 us).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.onnx_graph import infer_shapes

TO_NCHW, TO_NHWC = (0, 3, 1, 2), (0, 2, 3, 1)
# Where each NCHW axis is in NHWC.
_NHWC_AXIS = {0: 0, 1: 3, 2: 1, 3: 2}

_UNARY = frozenset(
    {
        "Abs", "Cast", "Ceil", "Clip", "Elu", "Erf", "Exp", "Floor", "HardSigmoid", "HardSwish",
        "Identity", "LeakyRelu", "Log", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu",
        "Sigmoid", "Sign", "Softplus", "Sqrt", "Tanh",
    }
)  # fmt: skip
_BINARY = frozenset({"Add", "And", "Div", "Equal", "Greater", "Less", "Max", "Min", "Mul", "Or", "Pow", "Sub"})
_AXIS_OPS = frozenset({"Softmax", "LogSoftmax", "ArgMax", "ArgMin"})


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


class _Rewriter:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.opset = _opset(model)
        self.inits = {i.name: i for i in model.graph.initializer}
        self.ranks = {i.name: len(i.dims) for i in model.graph.initializer}
        inferred = infer_shapes(model).graph  # ranks of the intermediate tensors
        for vi in (*inferred.input, *inferred.output, *inferred.value_info):
            if vi.type.tensor_type.HasField("shape"):
                self.ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
        self.nhwc: dict[str, str] = {}  # NCHW tensor name -> the name of the same data in NHWC
        self.materialized: set[str] = set()  # NCHW tensors already put back
        self.out: list[onnx.NodeProto] = []
        self.fresh = 0

    def name(self, hint: str) -> str:
        self.fresh += 1
        return f"{hint}__nhwc{self.fresh}"

    def emit(self, op: str, inputs: list[str], outputs: list[str], hint: str, **attrs) -> None:
        self.out.append(helper.make_node(op, inputs, outputs, name=self.name(hint), **attrs))

    def constant(self, value: np.ndarray, hint: str) -> str:
        out = self.name(hint)
        self.emit("Constant", [], [out], hint, value=numpy_helper.from_array(value))
        return out

    def materialize(self, t: str) -> None:
        """Put the NCHW tensor ``t`` back (once) for an op that needs it."""
        if t in self.nhwc and t not in self.materialized:
            self.emit("Transpose", [self.nhwc[t]], [t], f"{t}__to_nchw", perm=list(TO_NCHW))
            self.materialized.add(t)

    def keep(self, node: onnx.NodeProto) -> None:
        for t in node.input:
            self.materialize(t)
        self.out.append(node)
        for t in node.output:
            self.ranks.setdefault(t, -1)

    def permuted_constant(self, t: str, hint: str) -> str | None:
        """An initializer broadcast against an NCHW tensor, as nodes that give its NHWC twin."""
        if t not in self.inits:
            return None
        rank = len(self.inits[t].dims)
        if rank == 0:
            return t
        src = t
        if rank < 4:
            axes = self.constant(np.arange(4 - rank, dtype=np.int64), f"{hint}_axes")
            src = self.name(f"{hint}_4d")
            self.emit("Unsqueeze", [t, axes], [src], hint)
        out = self.name(f"{hint}_nhwc")
        self.emit("Transpose", [src], [out], hint, perm=list(TO_NHWC))
        return out

    # -- one rule per kind of op: True when the node was rewritten -----------------------------------

    def rewrite(self, node: onnx.NodeProto) -> bool:
        ins = list(node.input)
        if node.op_type == "Transpose" and len(ins) == 1 and self.ranks.get(ins[0]) == 4:
            perm = tuple(_attrs(node).get("perm", ()))
            if perm == TO_NCHW and ins[0] not in self.nhwc:
                self.nhwc[node.output[0]] = ins[0]
                return True
            if perm == TO_NHWC and ins[0] in self.nhwc:
                self.emit("Identity", [self.nhwc[ins[0]]], [node.output[0]], node.name)
                return True
            return False
        if not any(t in self.nhwc for t in ins):
            return False
        if node.op_type in _UNARY:
            return self._unary(node)
        if node.op_type in _BINARY:
            return self._binary(node)
        if node.op_type in _AXIS_OPS:
            return self._axis(node)
        if node.op_type == "Conv":
            return self._conv1x1(node)
        return False

    def _produce(self, node: onnx.NodeProto, inputs: list[str], **attrs) -> None:
        out = node.output[0]
        nhwc_out = self.name(out)
        kept = {k: v for k, v in _attrs(node).items() if k not in attrs}
        self.out.append(helper.make_node(node.op_type, inputs, [nhwc_out], name=node.name, **kept, **attrs))
        self.nhwc[out] = nhwc_out

    def _unary(self, node: onnx.NodeProto) -> bool:
        x, *rest = node.input
        if x not in self.nhwc or len(node.output) != 1 or any(t in self.nhwc for t in rest):
            return False
        self._produce(node, [self.nhwc[x], *rest])  # Clip's min/max are scalars
        return True

    def _binary(self, node: onnx.NodeProto) -> bool:
        if len(node.output) != 1:
            return False
        inputs = []
        for t in node.input:
            if t in self.nhwc:
                inputs.append(self.nhwc[t])
                continue
            twin = self.permuted_constant(t, f"{node.name}_{t}")
            if twin is None:
                return False
            inputs.append(twin)
        self._produce(node, inputs)
        return True

    def _axis(self, node: onnx.NodeProto) -> bool:
        x = node.input[0]
        attrs = _attrs(node)
        if node.op_type in ("Softmax", "LogSoftmax") and self.opset < 13:
            return False  # before opset 13 the axis flattens the trailing dims: not a per-axis op
        axis = attrs.get("axis", -1 if node.op_type in ("Softmax", "LogSoftmax") else 0) % 4
        new_axis = _NHWC_AXIS[axis]
        if node.op_type in ("ArgMax", "ArgMin") and not attrs.get("keepdims", 1):
            if axis != 1:
                return False  # the result would be a permutation of the NCHW one: not worth a rule
            # Over the channels, NCHW's [N, H, W] and NHWC's [N, H, W] are the same tensor.
            out = node.output[0]
            kept = {k: v for k, v in attrs.items() if k != "axis"}
            self.out.append(helper.make_node(node.op_type, [self.nhwc[x]], [out], name=node.name, axis=3, **kept))
            return True
        self._produce(node, [self.nhwc[x]], axis=new_axis)
        return True

    def _conv1x1(self, node: onnx.NodeProto) -> bool:
        x, w, *b = node.input
        attrs = _attrs(node)
        if (
            x not in self.nhwc
            or w not in self.inits
            or tuple(self.inits[w].dims[2:]) != (1, 1)
            or attrs.get("group", 1) != 1
            or any(s != 1 for s in attrs.get("strides", [1, 1]))
            or any(d != 1 for d in attrs.get("dilations", [1, 1]))
            or any(p != 0 for p in attrs.get("pads", [0, 0, 0, 0]))
            or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID")
            or (b and b[0] and b[0] not in self.inits)
        ):
            return False
        axes = self.constant(np.array([2, 3], dtype=np.int64), f"{node.name}_axes")
        w2, wt = self.name(f"{node.name}_w2d"), self.name(f"{node.name}_wt")
        self.emit("Squeeze", [w, axes], [w2], node.name)
        self.emit("Transpose", [w2], [wt], node.name, perm=[1, 0])  # [K, C] -> [C, K]
        out = node.output[0]
        y = self.name(out)
        self.emit("MatMul", [self.nhwc[x], wt], [y], node.name)
        if b and b[0]:
            yb = self.name(out)
            self.emit("Add", [y, b[0]], [yb], node.name)  # bias [K] broadcasts over the last axis
            y = yb
        self.nhwc[out] = y
        return True


def sink_transposes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every NCHW view of an NHWC tensor kept in NHWC as far as its ops allow.

    The graph's inputs and outputs, and its initializers, are unchanged; the nodes must be in
    topological order (as ONNX requires).
    """
    rw = _Rewriter(model)
    for node in model.graph.node:
        if not rw.rewrite(node):
            rw.keep(copy.deepcopy(node))
    for o in model.graph.output:
        rw.materialize(o.name)
    out = copy.deepcopy(model)
    del out.graph.node[:]
    out.graph.node.extend(_live(rw.out, [o.name for o in model.graph.output]))
    del out.graph.value_info[:]  # intermediate names changed; shape inference recomputes them
    return out


WIDE_ROW = 512  # pixels per row of the widened view


# `iree-import-onnx --externalize-params` turns a constant of 100 elements or more into a parameter
# under a made-up key that the runtime's index (the model's initializers) does not have.
_IMPORT_INLINE_MAX = 99


def _inline_constant(value: np.ndarray, name: str) -> list[onnx.NodeProto]:
    """Nodes that give the 1-D constant ``value`` as ``name`` and stay inline through the importer:
    a Concat of pieces under its threshold (IREE folds it back into one constant)."""
    if value.size <= _IMPORT_INLINE_MAX:
        return [helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value))]
    pieces = [value[i : i + _IMPORT_INLINE_MAX] for i in range(0, value.size, _IMPORT_INLINE_MAX)]
    names = [f"{name}__{k}" for k in range(len(pieces))]
    nodes = [
        helper.make_node("Constant", [], [n], name=n, value=numpy_helper.from_array(np.ascontiguousarray(p)))
        for n, p in zip(names, pieces, strict=True)
    ]
    return [*nodes, helper.make_node("Concat", names, [name], name=name, axis=0)]


def _elementwise(n: onnx.NodeProto, active: set[str]) -> bool:
    """An element-wise op on activations (a unary op's other inputs, Clip's bounds, constant)."""
    if n.op_type in _UNARY:
        return n.input[0] in active and not any(t in active for t in n.input[1:])
    return n.op_type in _BINARY and len(n.output) == 1


_WIDE_MAX_C = 8
_ROW_MIN = 32  # fewer pixels a row than this (an H x W with large prime factors only) is not worth the view


# IREE 3.13's CUDA element-wise config (read from `--iree-hal-dump-executable-configurations-to`, sm_89,
# 8 images) gives each thread 16 elements of a row only where the row's elements and the rows are both
# multiples of 16: rows of 512 px x 3 of 512x512 images get `thread = [1, 16]` (10 us on an H100); of 484
# px x 3 of 528x528 (1452 elements) `thread = [1, 1]` (127 us); 256 px x 3 of 528x528 (768, but 8712 rows)
# and 960 px x 3 of 600x600 (3000 rows) `thread = [1, 1]`; 528 px x 3 of 528x528, 720 px x 3 of 600x600
# (4000 rows), 960 px x 3 of 720x1280 and 784 px x 3 of 224x224 `thread = [1, 16]`.
_VECTOR = 16


def row_pixels(hw: int, c: int = 3) -> int:
    """The pixels a row of the widened view holds: a divisor of ``hw`` (an image's H x W) up to 2 x WIDE_ROW
    whose row (pixels x ``c``) is a multiple of 16 where one is, its rows an image divisible by as much of
    16 as can be (a batch of 8 multiplies them by 8), the longest such row; else the longest row up to
    WIDE_ROW pixels."""

    def score(d: int) -> tuple[bool, int, int]:
        row_ok = d * c % _VECTOR == 0
        rows = hw // d
        return row_ok, min(_VECTOR, rows & -rows) if row_ok else 0, d if (row_ok or d <= WIDE_ROW) else 0

    return max((d for d in range(1, min(2 * WIDE_ROW, hw) + 1) if hw % d == 0), key=score)


def widen_elementwise(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model unchanged unless every node is element-wise (or computes a constant) and every
    graph input and output is an (N, H, W, C) tensor with the same H, W and C <= 8, H*W a multiple
    of WIDE_ROW, and every constant operand a scalar or a per-channel vector (shape (..., 1, C) or
    (..., 1, 1)); then the same graph on (N*H*W/R, R*C) views, constants tiled, R = :func:`row_pixels`."""
    g = model.graph
    dims = _narrow_image(g)
    split = _split_elementwise(g) if dims is not None else None
    if dims is None or split is None:
        return model
    h, w, c = dims
    const, active = split
    row = row_pixels(h * w, c)
    tiled = _tiled_constants(model, const, c, row)
    if tiled is None:
        return model  # a constant broadcasts along more than the channels: no per-row form
    nodes, row_names = tiled
    nodes += _reshape_constants(g.name, (-1, c * row), (-1, h, w, c))
    nodes += _rows_body(g, active, row_names)
    out = copy.deepcopy(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = {t for n in nodes for t in n.input}
    kept = [i for i in out.graph.initializer if i.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    del out.graph.value_info[:]
    return out


def _narrow_image(g: onnx.GraphProto) -> tuple[int, int, int] | None:
    """The (H, W, C) every graph input and output shares, if C is narrow and H*W fills whole rows."""
    dims = {}
    for vi in (*g.input, *g.output):
        shape = vi.type.tensor_type.shape.dim
        if len(shape) != 4 or not all(d.HasField("dim_value") for d in shape[1:]):
            return None
        dims[vi.name] = tuple(d.dim_value for d in shape[1:])
    if len(set(dims.values())) != 1:
        return None
    h, w, c = next(iter(dims.values()))
    if c > _WIDE_MAX_C or row_pixels(h * w, c) < _ROW_MIN:
        return None
    return h, w, c


def _split_elementwise(g: onnx.GraphProto) -> tuple[set[str], set[str]] | None:
    """The graph's constant tensors and the tensors computed from its inputs, if every node that
    reads an input is element-wise and every output is computed from the inputs."""
    const = {i.name for i in g.initializer}
    active = {i.name for i in g.input}
    for n in g.node:
        if not any(t in active for t in n.input):
            if n.op_type != "Constant" and not all(t in const for t in n.input if t):
                return None
            const.update(n.output)
        elif _elementwise(n, active):
            active.update(n.output)
        else:
            return None
    if not all(o.name in active for o in g.output):
        return None
    return const, active


def _tiled_constants(
    model: onnx.ModelProto, const: set[str], c: int, row_px: int
) -> tuple[list[onnx.NodeProto], dict[str, str]] | None:
    """The constant operands of the element-wise ops as Constant nodes tiled to one row of ``row_px``
    pixels, and each operand's row name; None if one is not a scalar or per-channel vector."""
    from onnx.reference import ReferenceEvaluator

    g = model.graph
    # Evaluated here: they are data movement of the model's initializers (Transpose, Unsqueeze).
    wanted = sorted({t for n in g.node if n.op_type in _BINARY for t in n.input if t in const})
    values: dict[str, np.ndarray] = {}
    if wanted:
        sub = helper.make_graph(
            [n for n in g.node if all(t in const for t in n.output)],
            "constants",
            [],
            [helper.make_tensor_value_info(t, onnx.TensorProto.UNDEFINED, None) for t in wanted],
            list(g.initializer),
        )
        sub_model = helper.make_model(sub, opset_imports=list(model.opset_import))
        values = dict(zip(wanted, ReferenceEvaluator(sub_model).run(None, {}), strict=True))
    row = c * row_px
    nodes: list[onnx.NodeProto] = []
    tiled: dict[str, str] = {}
    for name, v in values.items():
        if v.ndim > 4 or any(d != 1 for d in v.shape[:-1]) or (v.ndim and v.shape[-1] not in (1, c)):
            return None
        flat = v.reshape(-1)
        tiled[name] = f"{name}__row"
        value = np.tile(flat, row // flat.size) if flat.size == c else flat
        nodes.extend(_inline_constant(value, tiled[name]))
    return nodes, tiled


def _reshape_constants(graph: str, rows: tuple[int, int], nhwc: tuple[int, ...]) -> list[onnx.NodeProto]:
    """The two shapes the widened graph reshapes through: its inputs to rows, its outputs back."""
    nodes = []
    for suffix, shape in (("__rows_shape", rows), ("__nhwc_shape", nhwc)):
        name = f"{graph}{suffix}"
        value = numpy_helper.from_array(np.array(shape, np.int64))
        nodes.append(helper.make_node("Constant", [], [name], name=name, value=value))
    return nodes


def _rows_body(g: onnx.GraphProto, active: set[str], tiled: dict[str, str]) -> list[onnx.NodeProto]:
    """Inputs reshaped to rows, the element-wise nodes on rows (constants read as their tiled rows),
    outputs reshaped back to NHWC."""
    to_rows, back = f"{g.name}__rows_shape", f"{g.name}__nhwc_shape"
    nodes: list[onnx.NodeProto] = []
    rename = {}
    for i in g.input:
        rename[i.name] = f"{i.name}__rows"
        nodes.append(helper.make_node("Reshape", [i.name, to_rows], [rename[i.name]], name=f"{i.name}__to_rows"))
    for n in g.node:
        if not any(t in active for t in n.output):
            continue  # constants: replaced by their tiled rows
        n2 = copy.deepcopy(n)
        for j, t in enumerate(n2.input):
            n2.input[j] = rename.get(t, tiled.get(t, t))
        for j, t in enumerate(n2.output):
            rename[t] = n2.output[j] = f"{t}__rows"
        nodes.append(n2)
    for o in g.output:
        nodes.append(helper.make_node("Reshape", [rename[o.name], back], [o.name], name=f"{o.name}__to_nhwc"))
    return nodes


def _live(nodes: list[onnx.NodeProto], outputs: Iterable[str]) -> list[onnx.NodeProto]:
    """The nodes that some graph output depends on (a sunk transpose's leftovers are not)."""
    needed = set(outputs)
    keep = []
    for n in reversed(nodes):
        if any(t in needed for t in n.output):
            keep.append(n)
            needed.update(t for t in n.input if t)
    return keep[::-1]
