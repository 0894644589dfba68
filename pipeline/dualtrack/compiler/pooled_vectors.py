"""Pooled channel vectors written as the (N, C, 1, 1) images they are (a front-end pass).

Squeeze-excitation and channel-attention blocks written with ``nn.Linear`` (MONAI's ChannelSELayer, CBAM's
shared MLP, much hand-written code) pool an image to (N, C, 1, 1), flatten it to an (N, C) matrix, run
Linears (Gemm, or MatMul + Add) and activations on it, and view the result back as (N, K, 1, 1) (often
``expand_as`` the image) to scale the image by. Track A's kernels see images: a 1x1 Conv on an
(N, C, 1, 1) vector is the ``fc`` kernel, its activations and the gate are element-wise calls, but the
rank-2 middle has no kernel, so each such block went to IREE with two track switches.

:func:`vectors_as_images` finds each *region*: rank-2 (N, C) tensors made by flattening an (N, C, 1, 1)
tensor (Reshape, Flatten or Squeeze; or a ReduceMean over H and W without keepdims), the ops on them
(Gemm and MatMul by constants, element-wise ops of one tensor, binary ops with scalars, (K,) vectors or
other tensors of the region), views between (N, C) and the row (N, 1, C), a one-channel Conv1d over such a
row (ECA-Net's channel attention: a k-tap band across neighbouring channels), and the views back to
(N, K, 1, 1). A region is rewritten only where it is closed: every reader of its tensors is one of those
ops. Then each region tensor has a *twin* (N, C, 1, 1): a Gemm / MatMul becomes a 1x1 Conv with the
matrix as (K, C, 1, 1) weights (``transB``, ``alpha`` and ``beta`` applied), a Conv1d over a row a 1x1
Conv with its taps as a banded (C, C) matrix (the same sums: a tap past either end of the channels would
read the Conv1d's zero padding, which the band leaves out), a view between (N, C) and (N, 1, C) nothing
(both have the one twin), a (K,) constant becomes (1, K, 1, 1), the views back disappear (their readers
read the twin), and an Expand of a twin to an image's shape that only feeds broadcasting binary ops
disappears too (the ops broadcast the (N, K, 1, 1) gate themselves). The rewrite is exact: the same
arithmetic on the same values, one row of the matrix per image as before, and it takes any batch (no
shape is written). Written by hand rather than with an ONNX optimiser: onnxslim and onnxoptimizer fuse
MatMul + Add into Gemm but do not move a rank-2 MLP back into the image layout.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.channels_last import BINARY, UNARY
from dualtrack.compiler.onnx_graph import copy_node, fresh_name, infer_shapes, live_nodes, node_attrs, taken_names

FLATTENS = frozenset({"Reshape", "Flatten", "Squeeze"})
VIEWS_BACK = frozenset({"Reshape", "Unsqueeze"})
LINEAR = frozenset({"Gemm", "MatMul"})
MIXING = LINEAR | {"Conv"}  # the ops that mix channels: a region without one is left as exported
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div"})


def _shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    inferred = infer_shapes(model, data_prop=True)  # view(b, c) with b = x.size(0)
    g = inferred.graph
    out: dict[str, tuple] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in t.shape.dim)
    return out


def _is_vector_image(shape: tuple | None) -> bool:
    return shape is not None and len(shape) == 4 and isinstance(shape[1], int) and shape[1] > 0 and shape[2:] == (1, 1)


def _is_matrix(shape: tuple | None, c: int | None = None) -> bool:
    return (
        shape is not None and len(shape) == 2 and isinstance(shape[1], int) and (c is None or shape[1] == c)
    )  # fmt: skip


def _vector_k(shape: tuple | None) -> int | None:
    """K of a region tensor's shape: the matrix (N, K) or the row (N, 1, K); None for any other."""
    if _is_matrix(shape):
        return shape[1]
    if shape is not None and len(shape) == 3 and shape[1] == 1 and isinstance(shape[2], int):
        return shape[2]
    return None


def _channel_conv(node: onnx.NodeProto, consts: dict[str, np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(the (K, K) band matrix, the (K,) bias) of a Conv1d of one input and one output channel, stride 1, over
    a row (N, 1, K) that it maps to (N, 1, K): output channel c sums tap j times input channel
    c - pad_begin + j * dilation where that is a channel (the zero padding elsewhere)."""
    if node.op_type != "Conv" or len(node.input) < 2:
        return None
    w = consts.get(node.input[1])
    a = node_attrs(node)
    if w is None or w.shape[:2] != (1, 1) or w.ndim != 3 or a.get("group", 1) != 1 or a.get("strides", [1]) != [1]:
        return None
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    taps, (d,) = w.reshape(-1), a.get("dilations", [1])
    begin, end = a.get("pads", [0, 0])
    if k + begin + end - d * (len(taps) - 1) != k:
        return None
    band = np.zeros((k, k), w.dtype)
    for j, tap in enumerate(taps):
        for c in range(k):
            src = c - begin + j * d
            if 0 <= src < k:
                band[c, src] += tap
    b = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros(1, w.dtype)
    if b is None or b.size != 1:
        return None
    return band, np.full(k, b.reshape(-1)[0], w.dtype)


class _Region:
    """One region being grown: its rank-2 tensors (name -> channels) and its nodes."""

    def __init__(self) -> None:
        self.channels: dict[str, int] = {}
        self.nodes: list[onnx.NodeProto] = []
        self.names: set[str] = set()
        self.seeds: dict[str, str] = {}  # a flattened tensor -> the (N, C, 1, 1) tensor it flattens ("": reduced)
        self.ends: dict[str, str] = {}  # a view back's output -> the rank-2 tensor it views

    def take(self, node: onnx.NodeProto) -> None:
        if node.name not in self.names:
            self.names.add(node.name)
            self.nodes.append(node)


def _seed(node: onnx.NodeProto, shapes: dict[str, tuple]) -> tuple[str, int] | None:
    """(the image, C) where ``node`` flattens an (N, C, 1, 1) image into (N, C), or reduces an image
    over H and W into (N, C)."""
    y = shapes.get(node.output[0]) if node.output else None
    x = shapes.get(node.input[0]) if node.input else None
    if node.op_type in FLATTENS and _is_vector_image(x) and _is_matrix(y, x[1]):
        return node.input[0], x[1]
    return None


def _reduce_seed(node: onnx.NodeProto, shapes: dict[str, tuple], consts: dict[str, np.ndarray]) -> int | None:
    """C where ``node`` is a ReduceMean of an (N, C, H, W) image over H and W without keepdims."""
    if node.op_type != "ReduceMean" or node_attrs(node).get("keepdims", 1) != 0:
        return None
    x, y = shapes.get(node.input[0]), shapes.get(node.output[0])
    axes = node_attrs(node).get("axes")
    if axes is None and len(node.input) > 1:
        v = consts.get(node.input[1])
        axes = None if v is None else v.reshape(-1).tolist()
    if x is None or len(x) != 4 or not isinstance(x[1], int) or axes is None:
        return None
    return x[1] if sorted(int(a) % 4 for a in axes) == [2, 3] and _is_matrix(y, x[1]) else None


def _linear_weight(
    node: onnx.NodeProto, consts: dict[str, np.ndarray], c: int
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(W as (K, C), bias (K,) or None) of a Gemm or MatMul of a region tensor by constants."""
    if node.op_type == "MatMul":
        b = consts.get(node.input[1])
        if b is None or b.ndim != 2 or b.shape[0] != c:
            return None
        return b.T, None
    a = node_attrs(node)
    if a.get("transA", 0):
        return None
    b = consts.get(node.input[1])
    if b is None or b.ndim != 2:
        return None
    w = (b if a.get("transB", 0) else b.T) * np.asarray(a.get("alpha", 1.0), b.dtype)
    if w.shape[1] != c:
        return None
    bias = None
    if len(node.input) > 2 and node.input[2]:
        cb = consts.get(node.input[2])
        if cb is None or cb.size not in (1, w.shape[0]) or (cb.ndim == 2 and cb.shape[0] != 1):
            return None
        bias = np.broadcast_to(cb.reshape(-1), (w.shape[0],)) * np.asarray(a.get("beta", 1.0), cb.dtype)
    return w, bias


def _same_image(a: tuple | None, b: tuple | None) -> bool:
    """Whether two 4-D shapes have the same C, H, W, all known (the batch may be named differently)."""
    return (
        a is not None
        and b is not None
        and len(a) == len(b) == 4
        and a[1:] == b[1:]
        and all(isinstance(d, int) for d in a[1:])
    )


def _vector_const(v: np.ndarray, k: int) -> bool:
    """A constant a region tensor combines with per column or as a scalar: size 1, (K,), (1, K) or (1, 1, K)
    (a rank the tensor's own broadcasts to another shape, which its output's shape check refuses)."""
    return v.size == 1 or (v.shape in ((k,), (1, k), (1, 1, k)))


def _data_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of a region node that are region tensors (not its weights, bounds or target shape)."""
    return [x for x in node.input if x] if node.op_type in BINARY else list(node.input[:1])


def _grow(
    start: str, c: int, region: _Region, shapes: dict[str, tuple], consts: dict[str, np.ndarray],
    consumers: dict[str, list[onnx.NodeProto]], outputs: set[str],
) -> bool:  # fmt: skip
    """Take every reader of the rank-2 tensors reachable from ``start``; False where one is not an op the
    region can rewrite (the region is then left as exported)."""
    todo = [start]
    region.channels[start] = c
    while todo:
        t = todo.pop()
        if t in outputs:
            return False
        for n in consumers.get(t, []):
            if n.name in region.names:
                continue
            k = region.channels[t]
            y = n.output[0] if n.output else ""
            ys = shapes.get(y)
            if n.op_type in LINEAR and n.input[0] == t:
                wb = _linear_weight(n, consts, k)
                if wb is None:
                    return False
                out_k = wb[0].shape[0]
            elif n.op_type == "Conv" and n.input[0] == t:
                if _channel_conv(n, consts, k) is None or _is_matrix(shapes.get(t)):
                    return False
                out_k = k
            elif n.op_type in FLATTENS | VIEWS_BACK and n.input[0] == t and _vector_k(ys) == k:
                out_k = k  # (N, K) <-> (N, 1, K): the same twin
            elif n.op_type in UNARY and n.input[0] == t and all(x in consts for x in n.input[1:] if x):
                out_k = k
            elif n.op_type in BINARY and n.op_type != "PRelu" and len(n.input) == 2:
                other = n.input[1] if n.input[0] == t else n.input[0]
                if other in consts and not _vector_const(consts[other], k):
                    return False
                if other not in consts and _vector_k(shapes.get(other)) != k:
                    return False
                out_k = k
            elif n.op_type in VIEWS_BACK and n.input[0] == t and _is_vector_image(ys) and ys[1] == k:
                if y in outputs:  # the graph's own output: left as exported
                    return False
                region.ends[y] = t
                region.take(n)
                continue
            else:
                return False
            if _vector_k(ys) != out_k:
                return False
            region.take(n)
            region.channels[y] = out_k
            todo.append(y)
    return True


def _grown(
    first: onnx.NodeProto, g: onnx.GraphProto, shapes: dict[str, tuple], consts: dict[str, np.ndarray],
    consumers: dict[str, list[onnx.NodeProto]], outputs: set[str], producer: dict[str, onnx.NodeProto],
) -> _Region | None:  # fmt: skip
    """The closed region that the seed ``first`` starts, with the other seeds its binary ops read (CBAM:
    the MLP of the average and of the max pool, added); None where it is not closed."""
    region = _Region()
    todo = [first]
    while todo:
        n = todo.pop()
        seed = _seed(n, shapes)
        c = seed[1] if seed is not None else _reduce_seed(n, shapes, consts)
        if c is None:
            return None
        region.seeds[n.output[0]] = seed[0] if seed is not None else ""
        region.take(n)
        if not _grow(n.output[0], c, region, shapes, consts, consumers, outputs):
            return None
        for m in region.nodes:
            if m.output[0] in region.seeds:
                continue
            for x in _data_inputs(m):
                if x not in consts and x not in region.channels:
                    behind = _seeds_behind(x, shapes, consts, producer, set())
                    if behind is None:
                        return None
                    todo.extend(s for s in behind if s.name not in region.names and s not in todo)
    return region


def _seeds_behind(
    x: str, shapes: dict[str, tuple], consts: dict[str, np.ndarray], producer: dict[str, onnx.NodeProto],
    seen: set[str],
) -> list[onnx.NodeProto] | None:  # fmt: skip
    """The seeds a rank-2 operand of the region is computed from through region ops (CBAM's other path);
    None where it comes from anything else."""
    n = producer.get(x)
    if n is None or n.name in seen:
        return None if n is None else []
    seen.add(n.name)
    if _seed(n, shapes) is not None or _reduce_seed(n, shapes, consts) is not None:
        return [n]
    if n.op_type not in MIXING | UNARY | BINARY | FLATTENS | VIEWS_BACK:
        return None
    found: list[onnx.NodeProto] = []
    for y in _data_inputs(n):
        if y in consts:
            continue
        more = _seeds_behind(y, shapes, consts, producer, seen)
        if more is None:
            return None
        found += more
    return found


def vectors_as_images(model: onnx.ModelProto, consts: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, str | None]:
    """The model with its closed pooled-vector regions rewritten (the module's docstring), and a note, or
    the model itself and None."""
    g = model.graph
    shapes = _shapes(model)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in dict.fromkeys(n.input):
            consumers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output}
    regions: list[_Region] = []
    taken_by: set[str] = set()
    for n in g.node:
        if n.name in taken_by or (_seed(n, shapes) is None and _reduce_seed(n, shapes, consts) is None):
            continue
        region = _grown(n, g, shapes, consts, consumers, outputs, producer)
        if region is None or not region.ends or region.names & taken_by:
            continue
        if any(m.op_type in MIXING for m in region.nodes):
            regions.append(region)
            taken_by.update(region.names)
    if not regions:
        return model, None
    mixing = [m.op_type for r in regions for m in r.nodes if m.op_type in MIXING]
    return _rewrite(model, regions, consts, consumers, shapes), (
        f"{len(regions)} pooled-vector region(s) (squeeze-excitation with Linears, ECA's Conv1d over channels) "
        f"written on (N, C, 1, 1) images: {len(mixing) - mixing.count('Conv')} Gemm/MatMul and "
        f"{mixing.count('Conv')} Conv1d as 1x1 Convs"
    )


def _rewrite(
    model: onnx.ModelProto, regions: list[_Region], consts: dict[str, np.ndarray],
    consumers: dict[str, list[onnx.NodeProto]], shapes: dict[str, tuple],
) -> onnx.ModelProto:  # fmt: skip
    model_out = onnx.ModelProto()
    model_out.CopyFrom(model)
    g = model_out.graph
    taken = taken_names(g)
    replaced: dict[str, list[onnx.NodeProto]] = {}  # an original node's name -> the nodes written for it
    rename: dict[str, str] = {}  # a view back's output / a dropped Expand's output -> the twin it reads
    inits: list[onnx.TensorProto] = []
    for region in regions:
        twin: dict[str, str] = {}
        order = {n.name: i for i, n in enumerate(g.node)}
        for n in sorted(region.nodes, key=lambda m: order[m.name]):
            y = n.output[0]
            if y in region.seeds:
                if region.seeds[y]:  # a flatten: the twin is the (N, C, 1, 1) tensor itself
                    twin[y] = region.seeds[y]
                    replaced[n.name] = []
                else:  # ReduceMean over H, W: keep the dims
                    t = fresh_name(f"{y}_img", taken)
                    new = copy_node(n, list(n.input), t)
                    for a in new.attribute:
                        if a.name == "keepdims":
                            a.i = 1
                    new.name = fresh_name(f"{n.name}_img", taken)
                    twin[y] = t
                    replaced[n.name] = [new]
                continue
            if y in region.ends:
                rename[y] = twin[region.ends[y]]
                replaced[n.name] = []
                continue
            if n.op_type in FLATTENS | VIEWS_BACK:  # (N, K) <-> (N, 1, K): one twin
                twin[y] = twin[n.input[0]]
                replaced[n.name] = []
                continue
            t = fresh_name(f"{y}_img", taken)
            name = fresh_name(f"{n.name}_img", taken)
            if n.op_type in MIXING:
                k = region.channels[n.input[0]]
                mixed = _linear_weight(n, consts, k) if n.op_type in LINEAR else _channel_conv(n, consts, k)
                assert mixed is not None  # _grow took the node for it
                w, bias = mixed
                wn = fresh_name(f"{name}.weight", taken)
                inits.append(numpy_helper.from_array(np.ascontiguousarray(w[:, :, None, None]), wn))
                ins = [twin[n.input[0]], wn]
                if bias is not None:
                    bn = fresh_name(f"{name}.bias", taken)
                    inits.append(numpy_helper.from_array(np.ascontiguousarray(bias), bn))
                    ins.append(bn)
                new = helper.make_node("Conv", ins, [t], name=name, kernel_shape=[1, 1])
            else:
                ins = []
                for x in n.input:
                    if not x or x in twin:
                        ins.append(twin.get(x, x))
                    elif x in consts and consts[x].size > 1:  # (K,) or (1, K) -> (1, K, 1, 1)
                        cn = fresh_name(f"{name}.{x}", taken)
                        inits.append(numpy_helper.from_array(consts[x].reshape(1, -1, 1, 1), cn))
                        ins.append(cn)
                    else:
                        ins.append(x)
                new = copy_node(n, ins, t)
                new.name = name
            twin[y] = t
            replaced[n.name] = [new]
    # An Expand of a twin that only broadcasting binary ops read, each beside an operand of the Expand's own
    # shape: they broadcast the gate themselves, to the same shape.
    outs = {o.name for o in g.output}
    for n in g.node:
        if n.op_type == "Expand" and rename.get(n.input[0]) is not None:
            y, wide = n.output[0], shapes.get(n.output[0])
            readers = consumers.get(y, [])
            beside = [x for r in readers for x in r.input if x != y]
            if (
                readers and wide is not None and y not in outs
                and all(r.op_type in BROADCASTING for r in readers)
                and all(_same_image(shapes.get(x), wide) for x in beside)
            ):  # fmt: skip
                rename[y] = rename[n.input[0]]
                replaced[n.name] = []
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        if n.name in replaced:
            nodes.extend(replaced[n.name])
            continue
        new = onnx.NodeProto()
        new.CopyFrom(n)
        del new.input[:]
        new.input.extend(rename.get(x, x) for x in n.input)
        nodes.append(new)
    outs = {o.name for o in g.output}
    del g.node[:]
    g.node.extend(live_nodes(nodes, outs))
    g.initializer.extend(inits)
    read = {x for n in g.node for x in n.input}
    kept = [i for i in g.initializer if i.name in read or i.name in outs]
    del g.initializer[:]
    g.initializer.extend(kept)
    del g.value_info[:]
    return model_out


__all__ = ["vectors_as_images"]
