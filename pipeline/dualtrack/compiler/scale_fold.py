"""Constant per-channel scales after a convolution folded into its weights and bias (a front-end pass).

ConvNeXt's layer scale (timm's ``gamma``, exported by dynamo as ``Mul(conv_out, view_k)`` with a
(1, K, 1, 1) constant) sits between a block's last 1x1 convolution and its residual Add. Left as it is,
it is an elementwise pass of its own and it keeps the Add out of the convolution's epilogue: two more
reads and writes of the block's tensor each (smp UPerNet-convnext_tiny at N=8 on an H100: 37
elementwise calls, 0.50 ms of 6.48, kernel_profile-6fba64a-s9upernet-h100.json). ``Conv -> Mul(c)``
(or ``Div(c)``) with ``c`` a constant of one value per output channel (or one value) is the convolution
with row ``k`` of its weight and its bias times ``c[k]``: ``(W x + b) c = (c W) x + c b``.

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


def _channel_scale(c: np.ndarray, k: int, rank: int) -> np.ndarray | None:
    """``c`` as a (k,) vector where it broadcasts against a (N, k, ...) rank-``rank`` tensor as one
    value per channel (or one value); None where it varies along another axis."""
    if c.ndim > rank:
        return None
    shape = (1,) * (rank - c.ndim) + tuple(c.shape)
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, k):
        return None
    return np.broadcast_to(c.reshape(-1).astype(np.float32), (k,)) if c.size == 1 else c.reshape(k).astype(np.float32)


def _holds(v: np.ndarray, dtype: np.dtype) -> bool:
    """Whether ``v`` (fp32, one row a output channel) rounds to ``dtype`` finite and, row by row, within
    twice the dtype's rounding (relative L2): values pushed into the subnormals lose their digits."""
    r = v.astype(dtype).astype(np.float32)
    if not np.isfinite(r).all():
        return False
    rows, err = v.reshape(v.shape[0], -1), (r - v).reshape(v.shape[0], -1)
    bound = float(np.finfo(dtype).eps)  # twice the half-ulp of a normal value
    return bool((np.linalg.norm(err, axis=1) <= bound * np.linalg.norm(rows, axis=1)).all())


def fold_channel_scales(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """``model`` with every foldable ``Conv -> Mul/Div(per-channel constant)`` written as one Conv of
    scaled weights; returns it, the folded Mul/Div nodes' names and, for each one left alone because
    its scaled weights would leave the dtype's range, a line saying why."""
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
    gone: set[int] = set()
    for node in g.node:
        if node.op_type not in ("Mul", "Div") or len(node.input) != 2:
            continue
        for t, c in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            conv = producer.get(t)
            if node.op_type == "Div" and t != node.input[0]:
                continue  # c / conv is no scale
            if conv is None or conv.op_type != "Conv" or c not in consts or t in consts:
                continue
            if readers.get(t) != 1 or t in outputs or conv.input[1] not in consts:
                continue
            if len(conv.input) > 2 and conv.input[2] and conv.input[2] not in consts:
                continue
            w = consts[conv.input[1]]
            bias = consts[conv.input[2]] if len(conv.input) > 2 and conv.input[2] else None
            scale = _channel_scale(consts[c], w.shape[0], w.ndim)
            if scale is None:
                continue
            label = node.name or node.output[0]
            if node.op_type == "Div":
                if not scale.all():
                    refused.append(f"'{label}' divides by zero")
                    break
                scale = 1.0 / scale
            ws = w.astype(np.float32) * scale.reshape((-1,) + (1,) * (w.ndim - 1))
            bs = bias.astype(np.float32) * scale if bias is not None else None
            if not _holds(ws, w.dtype) or (bs is not None and not _holds(bs.reshape(1, -1), bias.dtype)):
                refused.append(f"'{label}': its scale would put {conv.name or t}'s weights outside {w.dtype}'s range")
                break
            new_w = numpy_helper.from_array(ws.astype(w.dtype), fresh_name(f"{conv.input[1]}__scaled", taken))
            g.initializer.append(new_w)
            inputs = [conv.input[0], new_w.name]
            if bs is not None:
                new_b = numpy_helper.from_array(bs.astype(bias.dtype), fresh_name(f"{conv.input[2]}__scaled", taken))
                g.initializer.append(new_b)
                inputs.append(new_b.name)
            del conv.input[:]
            conv.input.extend(inputs)
            conv.output[0] = node.output[0]
            gone.add(id(node))
            folded.append(label)
            break
    if gone:
        kept = [n for n in g.node if id(n) not in gone]
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


__all__ = ["fold_channel_scales"]
