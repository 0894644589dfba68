"""Batch freeing: make an export whose batch was fixed at export time take any batch.

An exporter that traces at batch B fixes dim 0 of the input and writes B into shape arguments
(``Reshape(x, [B, C, -1])``, ``Resize(x, sizes=[B, C, H, W])``, ``Expand(x, [B, ...])``, a ``Slice`` that
ends at B). torch's dynamo exporter does it for every ``view`` of a transformer's tokens, with the batch
folded into other dims as well (attention's ``(B * heads, T, d)``). The front end
(:mod:`dualtrack.compiler.frontend`) calls :func:`symbolic_batch` to make dim 0 the symbol ``N`` and
:func:`free_batch` to make the shape arguments generic, so one graph serves every batch.

Why not a library: onnx's shape inference and onnxruntime's ``symbolic_shape_infer`` both propagate a
symbolic N, but take a constant shape argument at its face value (a baked ``[1, 256, 1, 32]`` gives
dim 0 = 1, and N is lost there); onnxslim and onnxscript's optimizer fold constants, they do not unfold
them. What is missing is knowing which entry of a constant is the batch, and that is what this module
decides: it walks the graph once with the shapes at B (onnx shape inference) and tracks, per tensor, the
one dim that holds the batch (row-major: the outer part of that dim, B x f, or for the row-wise ops that take
it there, a middle part, g x B x f: the (T * B, C) rows torch's MultiheadAttention hands its output
projection, whose tokens are sequence-first). Each
shape argument is then rewritten so the batch dim is computed rather than written: ``-1`` in a Reshape
(every other dim made concrete), ``1`` in an Expand (broadcast keeps the input's), scales for a Resize,
an open end for a Slice. Where the batch would be reduced, gathered, concatenated on, mixed into another
dim that a weight depends on, or cannot be placed, the walk stops with one line naming the node and why.
The build then checks the freed graph at every batch against the export run image by image
(:func:`dualtrack.compiler.verify.check_frontend`).

At an export batch of 1 a Reshape can leave the batch's place open: (T, 1, C) -> (T, C) holds it as the outer
part of C or as the inner part of T, the same bytes at batch 1 and different tensors at any other. The walk
takes the outer part of the outermost dim first (what every other view of the zoo's exports needs) and, where
a later node refuses the result, walks again with the next reading of the last such Reshape before it
(:data:`_MAX_WALKS` walks at most); the image-by-image check above catches a reading that is wrong yet
consistent.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from dualtrack.compiler.config import FIXED_BATCH
from dualtrack.compiler.onnx_graph import constants, infer_shapes, resize_scale
from dualtrack.errors import ModelError

BATCH = "N"  # the symbolic batch dimension
_OPEN_END = np.iinfo(np.int64).max  # a Slice end past any dim
Axis = int | None  # the dim of a tensor that holds the batch; None: the tensor has none (weights, shapes)
_UNKNOWN = -99  # the batch is somewhere this walk cannot tell (after an op it does not model)
_MAX_WALKS = 64  # walks over the readings of Reshapes that leave the batch's place open (batch 1)


def symbolic_batch(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int | None]:
    """Make dim 0 of the input (and of the outputs) the symbolic batch ``N``.

    Returns the batch the export fixed, or None when it was symbolic already. Recorded shapes of
    inner tensors are dropped: they were inferred at the export's batch. The model has one input
    (the front end checks that first).
    """
    model = copy.deepcopy(model)
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    fixed = dim.dim_value if dim.HasField("dim_value") else None
    for vi in [*model.graph.input, *model.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if len(dims) and (fixed is None or not dims[0].HasField("dim_value") or dims[0].dim_value == fixed):
            dims[0].Clear()
            dims[0].dim_param = BATCH
    del model.graph.value_info[:]
    return model, fixed


class _Refuse(Exception):
    """The batch cannot be freed at this node; the message says why."""


class _Mixes(_Refuse):
    """The node combines the rows of the dim that holds the batch (reduces, normalises, gathers, joins or splits
    along it, or takes a constant with rows of its own): no image-by-image run computes it."""


class MixedRows(ModelError):
    """An export whose dim 0 holds data that its ops combine across rows: refused whatever batch is built,
    since the image path runs the rows one by one (`batch: fixed` builds it whole)."""


@dataclass
class _Walk:
    """The state of one walk: the model being rewritten, its shapes at the export batch, its constants."""

    model: onnx.ModelProto
    batch: int
    shapes: dict[str, tuple[int, ...]]
    consts: dict[str, np.ndarray]
    symbolic: dict[str, int]  # tensors computed from run-time shapes: the dim shape inference keeps symbolic
    done: list[str] = field(default_factory=list)
    lost: str = ""  # the first op after which the walk lost the batch
    # Where the batch is a middle part of its dim (g x B x f): g, per tensor (absent: 1, the outer part).
    outer: dict[str, int] = field(default_factory=dict)
    # Reshapes that leave the batch's place open: the reading each takes (absent: the first), and in walk
    # order every such Reshape met with its number of readings.
    readings: dict[str, int] = field(default_factory=dict)
    open_reshapes: list[tuple[str, int]] = field(default_factory=list)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes or any(d < 0 for d in self.shapes[name]):
            raise _Refuse(f"shape inference gives no static shape for '{name}' at batch {self.batch}")
        return self.shapes[name]

    def const(self, node: onnx.NodeProto, k: int) -> np.ndarray | None:
        return self.consts.get(node.input[k]) if len(node.input) > k and node.input[k] else None

    def batch_vector(self) -> str:
        """A 1-D tensor holding the input's batch, read at run time (added once, first in the graph)."""
        name = f"{self.model.graph.input[0].name}__batch"
        if not any(n.output[0] == name for n in self.model.graph.node):
            shape = onnx.helper.make_node("Shape", [self.model.graph.input[0].name], [name], name=name, start=0, end=1)
            self.model.graph.node.insert(0, shape)
        return name

    def rewrite(self, node: onnx.NodeProto, k: int, value: np.ndarray, tag: str) -> None:
        replace_input(self.model, node, k, value, tag)
        self.consts[node.input[k]] = value
        self.done.append(f"{node.op_type} '{node.name or node.output[0]}'")


def free_batch(
    model: onnx.ModelProto, export_batch: int | None, batch_sizes: tuple[int, ...]
) -> tuple[onnx.ModelProto, str | None]:
    """Rewrite the shape arguments that carry the export's fixed batch so the graph takes any batch.

    ModelError (one line: the node and why) where the batch cannot be freed and a batch other than
    the export's is built; where only the export's is, the model stays as it was and the note says
    why, unless a node combines the rows of an export batch above one (:class:`MixedRows`: the image
    path would run those rows one by one). Returns the model and a note of what changed (None: nothing).
    """
    if export_batch is None:
        return model, None
    try:
        freed, done = _freed(model, export_batch, other=max(batch_sizes))
    except ModelError as e:
        if set(batch_sizes) <= {export_batch} and not isinstance(e, MixedRows):
            return model, f"the batch stays fixed at {export_batch}, the only batch built: {e}"
        raise
    if not done:
        return freed, None
    shown = ", ".join(done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
    return freed, f"{len(done)} shape constant(s) carried the export batch {export_batch}: {shown}"


def _freed(model: onnx.ModelProto, export_batch: int, other: int) -> tuple[onnx.ModelProto, list[str]]:
    """The walks: the first reading of every Reshape, then, while one refuses, the next reading of the last
    Reshape with one left before the refusal (the readings after it back to their first). The first walk's
    refusal is the one reported."""
    model = copy.deepcopy(model)
    del model.graph.value_info[:]  # shapes recorded at the export batch would pin dim 0 again
    shapes, symbolic = _shapes_at(model, export_batch), _symbolic_dims(model)
    readings: dict[str, int] = {}
    first: ModelError | None = None
    for _ in range(_MAX_WALKS):
        walk = _Walk(copy.deepcopy(model), export_batch, shapes, constants(model.graph), symbolic, readings=readings)
        try:
            return _walk_once(walk, export_batch, other)
        except ModelError as e:
            first = first or e
            if isinstance(e, MixedRows):
                raise
            left = [i for i, (n, k) in enumerate(walk.open_reshapes) if readings.get(n, 0) + 1 < k]
            if not left:
                break
            name = walk.open_reshapes[left[-1]][0]
            later = {n for n, _ in walk.open_reshapes[left[-1] + 1 :]}
            readings = {n: r for n, r in readings.items() if n not in later}
            readings[name] = readings.get(name, 0) + 1
    assert first is not None
    raise first


def _walk_once(walk: _Walk, export_batch: int, other: int) -> tuple[onnx.ModelProto, list[str]]:
    """One walk: every node's rule, in graph order, from the input's batch in dim 0."""
    model, symbolic = walk.model, walk.symbolic
    axes: dict[str, Axis] = {model.graph.input[0].name: 0}
    for node in list(model.graph.node):
        ins = [axes.get(x) if x else None for x in node.input]
        try:
            if any(a is not None for a in ins):
                part = _middle_part(walk, node, ins)
                outs = _rule(node.op_type)(walk, node, ins)
                if part > 1 and node.op_type != "Reshape":  # a Reshape places the batch itself (_reshape)
                    walk.outer.update({o: part for o, a in zip(node.output, outs, strict=False) if a is not None})
            else:  # from weights and shapes only: the batch is where shape inference keeps N (x.new_zeros(x.shape))
                outs = _batch_made(walk, node) or [symbolic.get(o) for o in node.output]
        except _Refuse as e:
            if isinstance(e, _Mixes) and export_batch > 1:
                raise MixedRows(
                    f"cannot free the batch the export fixed at {export_batch}: {node.op_type} '{node.name}' {e}, so "
                    "its dim 0 holds data rather than images run one by one; set "
                    f"`{FIXED_BATCH}` to build the exported shape whole, or re-export with a dynamic batch"
                ) from None
            raise ModelError(
                f"cannot free the batch the export fixed at {export_batch}: {node.op_type} '{node.name}' {e}; "
                f"re-export with a dynamic batch, set `{FIXED_BATCH}` where dim 0 holds data rather than images, "
                f"or build only batch_sizes: [{export_batch}]"
            ) from None
        for k, name in enumerate(node.output):
            axes[name] = outs[min(k, len(outs) - 1)]
    for out in model.graph.output:
        if walk.outer.get(out.name, 1) > 1:
            raise ModelError(
                f"cannot free the batch the export fixed at {export_batch}: output '{out.name}' holds the batch inside "
                f"dim {axes.get(out.name)}; re-export with a dynamic batch, or build only batch_sizes: [{export_batch}]"
            )
    for vi in [*model.graph.input, *model.graph.output]:  # a simplifier may write the export batch back into them
        dims = vi.type.tensor_type.shape.dim
        if axes.get(vi.name) == 0 and len(dims):
            dims[0].Clear()
            dims[0].dim_param = BATCH
    _check_generic(model, export_batch, other)
    return model, walk.done


def _check_generic(model: onnx.ModelProto, export_batch: int, other: int) -> None:
    """Shape inference at a batch other than the export's must go through the freed graph."""
    b = other if other != export_batch else export_batch + 1
    try:
        infer_shapes(with_batch(model, b), strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as e:
        first = str(e).strip().splitlines()[0][:240]
        raise ModelError(
            f"the export fixed its batch at {export_batch} and freeing it left a graph that fails shape inference at "
            f"batch {b} ({first}); re-export with a dynamic batch, set `{FIXED_BATCH}` where dim 0 holds data "
            f"rather than images, or build only batch_sizes: [{export_batch}]"
        ) from None


# -- where the batch goes, op by op ---------------------------------------------------------------------

Rule = Callable[[_Walk, onnx.NodeProto, list[Axis]], list[Axis]]


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _known(walk: _Walk, ins: list[Axis]) -> None:
    if _UNKNOWN in ins:
        raise _Refuse(f"takes a tensor whose batch dim cannot be told (it went through {walk.lost}, not modelled)")


def _middle_part(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> int:
    """g where the node's inputs hold the batch as the middle part g x B x f of a dim (1: the outer part), after
    checking that the op takes it there: ops that treat the rows of that dim one by one (a Gemm's or
    MatMul's rows, element-wise ops with no constant along it, norms and softmaxes along other dims) and the
    views that move it (Reshape, Transpose)."""
    parts = {walk.outer.get(x, 1) for x, a in zip(node.input, ins, strict=True) if a is not None and x}
    g = max(parts, default=1)
    if g == 1:
        return 1
    where = f"inside dim {max(a for a in ins if a is not None)}, after {g} rows of its own"
    if node.op_type not in _ROWWISE:
        raise _Refuse(f"takes the batch {where} (a view of tokens seq-first), which it does not treat row by row")
    if len(parts) > 1:
        raise _Refuse(f"takes inputs that hold the batch in different parts of a dim ({sorted(parts)})")
    if node.op_type in _ELEMENTWISE:
        rank = len(walk.shape(node.output[0]))
        out = next(a + rank - len(walk.shape(x)) for x, a in zip(node.input, ins, strict=True) if a is not None)
        for x, a in zip(node.input, ins, strict=True):
            if a is None and x:
                shape = walk.shape(x)
                k = out - (rank - len(shape))
                if 0 <= k < len(shape) and shape[k] != 1:
                    raise _Refuse(f"takes '{x}' with a value per row of the dim that holds the batch {where}")
    return g


def _elementwise(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """Broadcasting ops: the batch dims of the inputs, right-aligned, must be one dim of the output."""
    if _UNKNOWN in ins:
        return [_UNKNOWN]
    rank = len(walk.shape(node.output[0]))
    aligned = {a + rank - len(walk.shape(x)) for x, a in zip(node.input, ins, strict=True) if a is not None}
    if len(aligned) != 1:
        raise _Refuse(f"broadcasts inputs that hold the batch in different dims ({sorted(aligned)})")
    out = aligned.pop()
    for k, (x, a) in enumerate(zip(node.input, ins, strict=True)):
        if a is None and x in walk.consts and walk.batch > 1:
            _one_image_of(walk, node, k, out - (rank - walk.consts[x].ndim))
    return [out]


def _one_image_of(walk: _Walk, node: onnx.NodeProto, k: int, dim: int) -> None:
    """A constant with the export batch in the batch's dim (a ConstantOfShape the simplifier folded) keeps
    one slice, which broadcasts, where every slice is the same; a per-image constant cannot be freed."""
    value = walk.consts[node.input[k]]
    if not 0 <= dim < value.ndim or value.shape[dim] != walk.batch:
        return
    first = np.take(value, [0], axis=dim)
    if not np.array_equal(np.broadcast_to(first, value.shape), value):
        raise _Mixes(f"takes a constant '{node.input[k]}' with a different value for each image of the batch")
    walk.rewrite(node, k, first, "batch")


def _batch_major(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """Convolutions, pools, norms over channels: the batch must be dim 0 of the data and nowhere else."""
    _known(walk, ins)
    if ins[0] != 0 or any(a is not None for a in ins[1:]):
        where = f"dim {ins[0]} of its input" if ins[0] else "one of its weights"
        raise _Refuse(f"needs the batch in dim 0 of its data, but it is in {where} (mixed with channels or pixels)")
    return [0]


def _along_axis(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """Softmax, LayerNormalization, CumSum...: work along dims that must not be the batch."""
    if _UNKNOWN in ins:
        return [_UNKNOWN]
    a, rank = ins[0], len(walk.shape(node.input[0]))
    axis = _attr(node, "axis", -1) % rank
    spans = range(axis, rank) if node.op_type in ("LayerNormalization", "RMSNormalization") else (axis,)
    if a in spans:
        raise _Mixes(f"normalises along dim {axis}, which holds the batch")
    if a is None or any(x is not None for x in ins[1:]):
        raise _Refuse(f"normalises along dim {axis}, which holds the batch")
    return [a] + [a] * (len(node.output) - 1)


def _transpose(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    if ins[0] == _UNKNOWN:
        return [_UNKNOWN]
    perm = _attr(node, "perm") or list(reversed(range(len(walk.shape(node.input[0])))))
    return [list(perm).index(ins[0])]


def _matmul(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """(..., M, K) @ (..., K, P): the batch may be in the broadcast dims, in M of the left or P of the right."""
    _known(walk, ins)
    rank = len(walk.shape(node.output[0]))
    out: set[int] = set()
    for side, (x, a) in enumerate(zip(node.input[:2], ins[:2], strict=True)):
        if a is None:
            continue
        r = len(walk.shape(x))
        contracted = r - 1 if side == 0 else r - 2
        if r < 2 or a == contracted:
            raise _Refuse("contracts over the dim that holds the batch")
        out.add(a + rank - r)
    if len(out) != 1:
        raise _Refuse("multiplies tensors that hold the batch in different dims")
    return [out.pop()]


def _reshape(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """The batch stays the outer part of one output dim; a constant target becomes the output shape at
    the export batch with -1 in that dim."""
    _known(walk, ins)
    src, dst = walk.shape(node.input[0]), walk.shape(node.output[0])
    options = _reshaped_axes(src, dst, ins[0], walk.batch, walk.outer.get(node.input[0], 1))
    if len(options) > 1:
        walk.open_reshapes.append((node.name, len(options)))
    k, g = options[min(walk.readings.get(node.name, 0), len(options) - 1)]
    if g > 1:
        walk.outer[node.output[0]] = g
    target = walk.const(node, 1)
    if target is not None:
        new = np.array(dst, np.int64)
        new[k] = -1
        if not np.array_equal(new, target):
            walk.rewrite(node, 1, new, "batch")
    return [k]


def _reshaped_axes(src: tuple[int, ...], dst: tuple[int, ...], a: int, batch: int, g: int = 1) -> list[tuple[int, int]]:
    """The readings (output dim k, its part g' before the batch) of where the batch lands: the elements
    before it are those before it in the input (the dims before ``a`` and the ``g`` rows of ``a`` before
    it), what follows it is what followed it. The outer part of a dim (g' = 1) first, outermost first, then
    the middle parts: at batch 1 several may qualify (a batch of 1 reads like any other dim of 1)."""
    before, inner = int(np.prod(src[:a])) * g, src[a] // (g * batch) * int(np.prod(src[a + 1 :]))
    outer, middle = [], []
    for k in range(len(dst)):
        lead = int(np.prod(dst[:k]))
        if before % lead or dst[k] % (before // lead * batch):
            continue
        part = before // lead
        if dst[k] // (part * batch) * int(np.prod(dst[k + 1 :])) == inner:
            (outer if part == 1 else middle).append((k, part))
    if not outer and not middle:
        raise _Refuse(f"mixes the batch into other dims ({list(src)} -> {list(dst)} at batch {batch})")
    return outer + middle


def _flatten(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    _known(walk, ins)
    axis = _attr(node, "axis", 1) % max(1, len(walk.shape(node.input[0])))
    return [0 if ins[0] < axis else 1]


def _unsqueeze(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    if ins[0] == _UNKNOWN:
        return [_UNKNOWN]
    rank = len(walk.shape(node.output[0]))
    added = sorted(int(x) % rank for x in _axes(walk, node))
    kept = [d for d in range(rank) if d not in added]
    return [kept[ins[0]]]


def _squeeze(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    if ins[0] == _UNKNOWN:
        return [_UNKNOWN]
    src = walk.shape(node.input[0])
    gone = {int(x) % len(src) for x in _axes(walk, node)} or {d for d, n in enumerate(src) if n == 1}
    if ins[0] in gone:
        raise _Refuse("squeezes away the dim that holds the batch")
    return [ins[0] - sum(1 for d in gone if d < ins[0])]


def _axes(walk: _Walk, node: onnx.NodeProto) -> list[int]:
    axes = _attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = walk.const(node, 1)
        if value is None:
            raise _Refuse("takes its axes from a computed tensor")
        axes = value.tolist()
    return list(axes or [])


def _reduce(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    _known(walk, ins)
    rank = len(walk.shape(node.input[0]))
    axes = _attr(node, "axes")
    if axes is None and node.op_type in ("ArgMax", "ArgMin"):
        axes = [_attr(node, "axis", 0)]
    if axes is None:
        axes = _axes(walk, node) if len(node.input) > 1 else []
    axes = {int(x) % rank for x in axes} or (set() if _attr(node, "noop_with_empty_axes", 0) else set(range(rank)))
    if ins[0] in axes:
        raise _Mixes("reduces over the dim that holds the batch")
    return [ins[0] if _attr(node, "keepdims", 1) else ins[0] - sum(1 for d in axes if d < ins[0])]


def _gather(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    _known(walk, ins)
    rank, axis = len(walk.shape(node.input[0])), _attr(node, "axis", 0)
    axis %= rank
    if ins[0] is None or ins[1] is not None:
        raise _Refuse("indexes with indices computed from the batch")
    if ins[0] == axis:
        _gather_per_image(walk, node, axis)
        return [axis]
    return [ins[0] if ins[0] < axis else ins[0] + len(walk.shape(node.input[1])) - 1]


def _gather_per_image(walk: _Walk, node: onnx.NodeProto, axis: int) -> None:
    """A Gather along the dim that holds the batch (B x f) with constant indices whose first dim is the batch
    and whose block b is block 0 shifted by b x f (torch's ``as_strided`` after a flatten, as the dynamo exporter
    writes it) picks the same f-wide slice of every image: the data is viewed as (..., N, f, ...) and block 0
    gathered along f. Other indices pick across images: refused."""
    src, idx = walk.shape(node.input[0]), walk.const(node, 1)
    f = src[axis] // walk.batch
    if idx is None or idx.ndim < 1 or idx.shape[0] != walk.batch:
        raise _Mixes("indexes along the dim that holds the batch")
    idx = np.where(idx < 0, idx + src[axis], idx).astype(np.int64)
    shifted = idx - (np.arange(walk.batch) * f).reshape((-1,) + (1,) * (idx.ndim - 1))
    if not (np.all(shifted == shifted[:1]) and np.all((shifted >= 0) & (shifted < f))):
        raise _Mixes("indexes across the images of the batch")
    g, view = walk.model.graph, f"{node.input[0]}__{node.output[0]}__images"
    g.initializer.append(numpy_helper.from_array(np.array([*src[:axis], -1, f, *src[axis + 1 :]], np.int64), view))
    reshape = onnx.helper.make_node("Reshape", [node.input[0], view], [view + "_t"], name=view)
    g.node.insert(next(i for i, n in enumerate(g.node) if n.output[0] == node.output[0]), reshape)
    node.input[0] = view + "_t"
    walk.rewrite(node, 1, shifted[0], "batch")
    for a in node.attribute:
        if a.name == "axis":
            a.i = axis + 1
    if not any(a.name == "axis" for a in node.attribute):
        node.attribute.append(onnx.helper.make_attribute("axis", axis + 1))


def _gather_nd(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """Indices into the leading dims of the data (torch's advanced indexing, adaptive pooling's bins) keep
    the batch where it is not indexed: after the indices' own dims."""
    _known(walk, ins)
    k = walk.shape(node.input[1])[-1]
    if ins[0] is None or ins[1] is not None or _attr(node, "batch_dims", 0) or ins[0] < k:
        raise _Refuse("indexes the dim that holds the batch")
    return [len(walk.shape(node.input[1])) - 1 + ins[0] - k]


def _einsum(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """The batch's letter in each input's term must survive into the output's, at one place."""
    _known(walk, ins)
    equation = _attr(node, "equation")
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    if "->" not in equation or "..." in equation:
        return _unknown(walk, node, ins)
    terms, out = equation.split("->")
    places = {out.find(term[a]) for term, a in zip(terms.split(","), ins, strict=True) if a is not None}
    if -1 in places or len(places) != 1:
        raise _Refuse(f"contracts over the batch or moves it to two places ({equation})")
    return [places.pop()]


def _concat(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    _known(walk, ins)
    axis = _attr(node, "axis") % len(walk.shape(node.output[0]))
    if len(set(ins)) != 1 or ins[0] == axis:
        raise _Mixes("concatenates along the batch, or joins tensors with and without it")
    return [ins[0]]


def _split(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    _known(walk, ins)
    if ins[0] is None or _attr(node, "axis", 0) % len(walk.shape(node.input[0])) == ins[0]:
        raise _Mixes("splits along the dim that holds the batch")
    return [ins[0]] * len(node.output)


def _slice(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """A slice of the batch dim that takes all of it at the export batch takes all of it at any batch."""
    _known(walk, ins)
    a, src = ins[0], walk.shape(node.input[0])
    if a is None or any(x is not None for x in ins[1:]):
        raise _Refuse("slices with bounds computed from the batch")
    starts, ends = walk.const(node, 1), walk.const(node, 2)
    if starts is None or ends is None:
        raise _Refuse("slices with bounds computed at run time")
    axes = walk.const(node, 3) if len(node.input) > 3 and node.input[3] else np.arange(len(starts))
    steps = walk.const(node, 4) if len(node.input) > 4 and node.input[4] else np.ones(len(starts), np.int64)
    if axes is None or steps is None:
        raise _Refuse("slices with axes or steps computed at run time")
    for i, ax in enumerate(int(x) % len(src) for x in axes):
        if ax != a:
            continue
        if int(starts[i]) != 0 or int(steps[i]) != 1 or int(ends[i]) < src[a]:
            raise _Mixes(f"takes part of the dim that holds the batch ({int(starts[i])}:{int(ends[i])})")
        if int(ends[i]) != _OPEN_END:
            new = ends.astype(np.int64).copy()
            new[i] = _OPEN_END
            walk.rewrite(node, 2, new, "batch")
    return [a]


def _expand(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """Expand to a shape with the batch in it: 1 in that dim broadcasts the input's batch instead."""
    _known(walk, ins)
    if ins[0] is None:
        raise _Refuse("expands a tensor to a shape computed from the batch")
    rank, target = len(walk.shape(node.output[0])), walk.const(node, 1)
    a = ins[0] + rank - len(walk.shape(node.input[0]))
    k = a - (rank - (len(target) if target is not None else rank))
    if target is not None and 0 <= k < len(target) and int(target[k]) != 1:
        new = target.astype(np.int64).copy()
        new[k] = 1
        walk.rewrite(node, 1, new, "batch")
    return [a]


def _tile(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    _known(walk, ins)
    repeats = walk.const(node, 1)
    if ins[0] is None or repeats is None or int(repeats[ins[0]]) != 1:
        raise _Mixes("repeats the dim that holds the batch")
    return [ins[0]]


def _resize(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    """Sizes with the batch in them become scales (1 for the batch), where the ratios round back exactly."""
    out = _batch_major(walk, node, [ins[0], *(None for _ in ins[1:])])
    sizes = walk.const(node, 3)
    if sizes is None:
        return out
    src = walk.shape(node.input[0])
    # Opset 18's `axes`: the sizes are of those axes only, in that order (else of every axis).
    axes = [int(a) % len(src) for a in _attr(node, "axes", range(len(src)))]
    if 0 not in axes:
        return out  # the batch is not among the sizes
    ratios = [
        np.float32(1.0) if a == 0 else resize_scale(int(o), int(src[a])) for a, o in zip(axes, sizes, strict=True)
    ]
    if any(r is None for r in ratios):
        raise _Refuse(f"resizes to sizes {sizes.tolist()} that no float32 scale reproduces")
    scales = np.array(ratios, np.float32)
    walk.rewrite(node, 2, scales, "scales")
    del node.input[3:]
    return out


def _gemm(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    if _attr(node, "transA", 0):
        raise _Refuse("contracts over the dim that holds the batch (transA)")
    out = _batch_major(walk, node, ins)
    if len(node.input) > 2 and node.input[2] in walk.consts and walk.batch > 1:  # C, broadcast to (M, N): M rows
        _one_image_of(walk, node, 2, walk.consts[node.input[2]].ndim - 2)
    return out


def _batch_made(walk: _Walk, node: onnx.NodeProto) -> list[Axis] | None:
    """ConstantOfShape, Expand or Tile of a tensor without the batch to a constant shape whose dim 0 is
    the export batch (above 1: a 1 reads as a broadcast, which is right at any batch): dim 0 becomes the
    input's batch, read at run time."""
    k = {"ConstantOfShape": 0, "Expand": 1, "Tile": 1}.get(node.op_type)
    value = walk.const(node, k) if k is not None and walk.batch > 1 else None
    if value is None or value.ndim != 1 or not len(value) or int(value[0]) != walk.batch:
        return None
    g = walk.model.graph
    rest = f"{node.input[k]}__rest"
    g.initializer.append(numpy_helper.from_array(value[1:].astype(np.int64), rest))
    shape = f"{node.input[k]}__{node.output[0]}__batch"
    concat = onnx.helper.make_node("Concat", [walk.batch_vector(), rest], [shape], name=shape, axis=0)
    g.node.insert(next(i for i, n in enumerate(g.node) if n.output[0] == node.output[0]), concat)
    node.input[k] = shape
    walk.done.append(f"{node.op_type} '{node.name or node.output[0]}'")
    return [0]


def _unknown(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    walk.lost = walk.lost or f"{node.op_type} '{node.name}'"
    return [_UNKNOWN] * len(node.output)


def _no_batch(walk: _Walk, node: onnx.NodeProto, ins: list[Axis]) -> list[Axis]:
    return [None] * len(node.output)  # computed from shapes at run time: right at any batch


# Op names as one string each: a list literal of 55 names would take 55 lines.
_ELEMENTWISE = (  # noqa: SIM905
    "Add Sub Mul Div Pow Mod Max Min Mean Sum Where Equal Less LessOrEqual Greater GreaterOrEqual And Or Xor Not "
    "PRelu Relu LeakyRelu Sigmoid HardSigmoid HardSwish Tanh Erf Gelu Exp Log Sqrt Reciprocal Abs Neg Sign Floor "
    "Ceil Round Clip Elu Selu Celu Mish Softplus Softsign ThresholdedRelu Sin Cos IsNaN IsInf Cast CastLike "
    "Identity Dropout"
).split()
_BATCH_MAJOR = (  # noqa: SIM905
    "Conv ConvTranspose MaxPool AveragePool LpPool GlobalAveragePool GlobalMaxPool GlobalLpPool BatchNormalization "
    "InstanceNormalization GroupNormalization LpNormalization LRN Pad DepthToSpace SpaceToDepth MaxUnpool"
).split()
# Ops that take the batch as a middle part of a dim (:func:`_middle_part`): they treat its rows one by one.
_ROWWISE = frozenset(_ELEMENTWISE).union(
    ("Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization", "Gemm", "MatMul", "Reshape", "Transpose"),
    ("Shape", "Size"),
)
_RULES: dict[str, Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(_BATCH_MAJOR, _batch_major),
    **dict.fromkeys(["Softmax", "LogSoftmax", "Hardmax", "LayerNormalization", "RMSNormalization"], _along_axis),
    **dict.fromkeys(
        ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2"], _reduce
    ),
    **dict.fromkeys(["ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp", "ArgMax", "ArgMin"], _reduce),
    **dict.fromkeys(["Shape", "Size"], _no_batch),
    "Gemm": _gemm,
    "Einsum": _einsum,
    "GatherND": _gather_nd,
    "Transpose": _transpose,
    "MatMul": _matmul,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Gather": _gather,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Expand": _expand,
    "Tile": _tile,
    "Resize": _resize,
}


def _rule(op: str) -> Rule:
    return _RULES.get(op, _unknown)


# -- helpers --------------------------------------------------------------------------------------------


def with_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy whose graph inputs and outputs have dim 0 fixed to `batch` where it is symbolic. A dim 0
    that holds a value is left as it is: a fixed-shape model's (`batch: fixed`: data, not a batch)."""
    model = copy.deepcopy(model)
    for vi in [*model.graph.input, *model.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if len(dims) and not dims[0].HasField("dim_value"):
            dims[0].Clear()
            dims[0].dim_value = batch
    del model.graph.value_info[:]
    return model


def _shapes_at(model: onnx.ModelProto, batch: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's static shape with the input at ``batch`` (-1 where inference leaves a dim open)."""
    shapes = static_shapes(with_batch(model, batch))
    shapes.update({i.name: tuple(i.dims) for i in model.graph.initializer})
    return shapes


def _symbolic_dims(model: onnx.ModelProto) -> dict[str, int]:
    """Tensors with exactly one symbolic dim under shape inference with the batch ``N`` (data propagated
    through Shape, Gather, Concat): where a tensor built from run-time shapes keeps the batch."""
    inferred = infer_shapes(model, strict_mode=False, data_prop=True)
    out = {}
    for vi in inferred.graph.value_info:
        dims = vi.type.tensor_type.shape.dim
        symbolic = [k for k, d in enumerate(dims) if d.HasField("dim_param") and d.dim_param == BATCH]
        if len(symbolic) == 1:
            out[vi.name] = symbolic[0]
    return out


def replace_input(model: onnx.ModelProto, node: onnx.NodeProto, k: int, value: np.ndarray, tag: str) -> None:
    """Give input ``k`` of ``node`` a constant of its own (the old one may be shared)."""
    names = {i.name for i in model.graph.initializer}
    name, i = f"{node.input[k] or node.name}__{tag}", 0
    while name in names:
        i += 1
        name = f"{node.input[k]}__{tag}{i}"
    model.graph.initializer.append(numpy_helper.from_array(value, name))
    node.input[k] = name


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape under ONNX shape inference; -1 for a dim it leaves symbolic."""
    inferred = infer_shapes(model, strict_mode=False, data_prop=True)
    out = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return out
