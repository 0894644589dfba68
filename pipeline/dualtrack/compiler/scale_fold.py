"""Constant per-channel scales and shifts after a convolution folded into its weights and bias (a front-end pass).

ConvNeXt's layer scale (timm's ``gamma``, exported by dynamo as ``Mul(conv_out, view_k)`` with a
(1, K, 1, 1) constant) sits between a block's last 1x1 convolution and its residual Add. Left as it is,
it is an elementwise pass of its own and it keeps the Add out of the convolution's epilogue: two more
reads and writes of the block's tensor each (smp UPerNet-convnext_tiny at N=8 on an H100: 37
elementwise calls, 0.50 ms of 6.48, kernel_profile-6fba64a-s9upernet-h100.json). ``Conv -> Mul(c)``
(or ``Div(c)``) with ``c`` a constant of one value per output channel (or one value) is the convolution
with row ``k`` of its weight and its bias times ``c[k]``: ``(W x + b) c = (c W) x + c b``; an Add (Sub) of
such a constant is its bias plus (minus) ``c``. A chain folds node by node (torchvision's FrozenBatchNorm2d,
an unfolded affine: Mul then Add).

In exact arithmetic. In the model's dtype the scaled weights are rounded once where the unfolded model
rounds the convolution's output and then the product: as accurate, not the same bits (the build's
verification judges the result as it judges any kernel). What the fold must not do is push weights out of
the dtype's range: a tiny scale (timm initialises ``gamma`` at 1e-6) times fp16 weights lands below fp16's
smallest normal (6.1e-5), where values lose their digits or flush to zero; a large one overflows. The fold
is kept only where every output channel's scaled weights (and the scaled bias) round to the dtype within
twice its rounding of a normal value (relative L2 a channel): random or trained weights have a few
subnormal values of their own, so the check is of each channel as a whole, not of each value. A node
that fails it is left unfolded and named in the pass's note; so is a Div by zero.

Only a Conv whose weight and bias are constants and whose output the Mul alone reads is folded; its
weights are copied (another Conv may share them). onnxruntime's own ConvMulFusion does this inside its
session, on its whole graph at once, with no range check, and does not hand back the graph; the ONNX
cleanup libraries (onnxslim, onnxoptimizer) fold BatchNormalization and bias Adds but not a Mul.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import numpy_helper

from dualtrack.compiler.onnx_graph import constants, fresh_name, taken_names


def channel_vector(c: np.ndarray, k: int, rank: int) -> np.ndarray | None:
    """``c`` as a (k,) vector where it broadcasts against a (N, k, ...) rank-``rank`` tensor as one
    value per channel (or one value); None where it varies along another axis."""
    if c.ndim > rank:
        return None
    shape = (1,) * (rank - c.ndim) + tuple(c.shape)
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, k):
        return None
    return np.broadcast_to(c.reshape(-1).astype(np.float32), (k,)) if c.size == 1 else c.reshape(k).astype(np.float32)


def holds_in_dtype(v: np.ndarray, dtype: np.dtype, absolute: bool = False) -> bool:
    """Whether ``v`` (fp32, one row an output channel) rounds to ``dtype`` finite and, row by row, within
    twice the dtype's rounding (relative L2): values pushed into the subnormals lose their digits.
    ``absolute``: a bias, whose values are each their own channel's offset, is held where every value
    rounds within twice its own rounding or to within the dtype's smallest normal (a zero, a tiny one)."""
    r = v.astype(dtype).astype(np.float32)
    if not np.isfinite(r).all():
        return False
    bound = float(np.finfo(dtype).eps)  # twice the half-ulp of a normal value
    if absolute:
        return bool((np.abs(r - v) <= np.maximum(bound * np.abs(v), float(np.finfo(dtype).tiny))).all())
    rows, err = v.reshape(v.shape[0], -1), (r - v).reshape(v.shape[0], -1)
    return bool((np.linalg.norm(err, axis=1) <= bound * np.linalg.norm(rows, axis=1)).all())


# A node after the conv as (scale, shift) of its rows from the constant's per-channel vector:
# (W x + b) * s, / s, + s, - s.
_AFFINE = {
    "Mul": lambda v: (v, None),
    "Div": lambda v: (1.0 / v, None),
    "Add": lambda v: (None, v),
    "Sub": lambda v: (None, -v),
}


def fold_channel_affines(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """``model`` with every foldable ``Conv -> Mul/Div/Add/Sub(per-channel constant)`` written as one Conv
    of scaled weights and shifted bias (chains too: torchvision's FrozenBatchNorm2d exports as a Mul and
    an Add); returns it, the folded nodes' names and, for each one left alone because the result would
    leave the dtype's range, a line saying why."""
    model = copy.deepcopy(model)
    g = model.graph
    consts = constants(g)
    readers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output}
    taken = taken_names(g)
    folded: list[str] = []
    refused: list[str] = []
    gone: set[str] = set()  # the folded nodes' outputs (now the convs')
    for node in g.node:
        if node.op_type not in _AFFINE or len(node.input) != 2:
            continue
        for t, c in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            conv = producer.get(t)
            if node.op_type in ("Div", "Sub") and t != node.input[0]:
                continue  # c / conv and c - conv are no affine map of the conv's rows
            if conv is None or conv.op_type != "Conv" or c not in consts or t in consts:
                continue
            if readers.get(t) != 1 or t in outputs or conv.input[1] not in consts:
                continue
            if len(conv.input) > 2 and conv.input[2] and conv.input[2] not in consts:
                continue
            w = consts[conv.input[1]]
            bias = consts[conv.input[2]] if len(conv.input) > 2 and conv.input[2] else None
            vec = channel_vector(consts[c], w.shape[0], w.ndim)
            if vec is None:
                continue
            label = node.name or node.output[0]
            if node.op_type == "Div" and not vec.all():
                refused.append(f"'{label}' divides by zero")
                break
            scale, shift = _AFFINE[node.op_type](vec)
            ws = w.astype(np.float32) * scale.reshape((-1,) + (1,) * (w.ndim - 1)) if scale is not None else None
            b32 = bias.astype(np.float32) if bias is not None else np.zeros(w.shape[0], np.float32)
            bs = b32 * scale if scale is not None else b32
            bs = bs + shift if shift is not None else bs
            held = ws is None or holds_in_dtype(ws, w.dtype)
            if not held or not holds_in_dtype(bs.reshape(1, -1), w.dtype, absolute=True):
                refused.append(f"'{label}': folded, {conv.name or t}'s weights or bias would leave {w.dtype}'s range")
                break
            inputs = [conv.input[0], conv.input[1]]
            if ws is not None:
                new_w = numpy_helper.from_array(ws.astype(w.dtype), fresh_name(f"{conv.input[1]}__scaled", taken))
                g.initializer.append(new_w)
                consts[new_w.name] = ws.astype(w.dtype)
                inputs[1] = new_w.name
            if bias is not None or shift is not None:
                base = conv.input[2] if bias is not None else f"{conv.input[1]}__bias"
                new_b = numpy_helper.from_array(bs.astype(w.dtype), fresh_name(f"{base}__folded", taken))
                g.initializer.append(new_b)
                consts[new_b.name] = bs.astype(w.dtype)
                inputs.append(new_b.name)
            del conv.input[:]
            conv.input.extend(inputs)
            conv.output[0] = node.output[0]
            producer[node.output[0]] = conv
            gone.add(node.output[0])
            folded.append(label)
            break
    if gone:
        kept = [n for n in g.node if n.op_type == "Conv" or n.output[0] not in gone]
        del g.node[:]
        g.node.extend(kept)
        used = {x for n in g.node for x in n.input}
        inits = [i for i in g.initializer if i.name in used or i.name in outputs]
        del g.initializer[:]
        g.initializer.extend(inits)
        stale = [v for v in g.value_info if v.name not in used and v.name not in outputs]
        for v in stale:
            g.value_info.remove(v)
    return model, folded, refused


__all__ = ["channel_vector", "fold_channel_affines", "holds_in_dtype"]
