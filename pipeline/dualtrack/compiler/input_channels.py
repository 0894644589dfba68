"""The image's channels widened to a multiple of 8 for the convolutions that read it (a front-end pass).

Every segmenter's first convolution reads the 3 channels of an RGB image. Track A's fp16 convolutions
load a pixel's channels 8 at a time (one 16-byte vector); a channel count that is no multiple of 8 takes
the general conv's gather entry, which loads them one by one and spent 0.30 ms of smp Unet-resnet34's
2.33 ms at N=8 on an H100 (its 7x7 stem; `kernel_profile-a387fe0.json`), 0.25 of MONAI UNet's 1.75 ms
(`kernel_profile-57da030-corpus6-h100.json`, two 3-channel convs) and 0.12 of LR-ASPP's 1.79 ms. Padding
the input with zero channels to 8 and the weights with zero input channels computes the same sums (the
added products are 0 * 0; exact in fp32 and fp16), lets the vector entries take those convolutions, and
costs one Pad that IREE fuses into the pre-processing dispatch already writing that tensor (a Pad over
channels has no Track A kernel: the partition leaves it on Track B with the pre-processing).

Taken: a graph input of a known (N, C, H, W) float shape, C % 8 != 0, every reader of which is a 2-D
``Conv`` (group 1, constant weights) reading it as its data input, none of them a 3x3 stride-1 conv: those
take the conv3x3 op's small-C entry, written for a 3-channel image (the reference U-Net's first layer),
which reads the 3 channels as they are. An input that anything else reads (a
Concat of the image into a skip, a Resize of it) is left as it is: padding it would change what that
reader sees. The pass runs only where Track A may run (a GPU target, the image batch mode).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.onnx_graph import fresh_name

VECTOR = 8  # channels one 16-byte fp16 load holds: the vector entries' unit
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


def _shape(vi: onnx.ValueInfoProto) -> list[int | str] | None:
    t = vi.type.tensor_type
    if t.elem_type not in _FLOATS or not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]


def _small_c_3x3(conv: onnx.NodeProto, w: np.ndarray) -> bool:
    """Whether the conv3x3 op (its small-C entry) takes the conv: 3x3, stride 1, dilation 1."""
    attrs = {a.name: list(a.ints) for a in conv.attribute if a.ints}
    ones = [1, 1]
    return w.shape[2:] == (3, 3) and attrs.get("strides", ones) == ones and attrs.get("dilations", ones) == ones


def _widened_weight(conv: onnx.NodeProto, inits: dict[str, onnx.TensorProto], c: int) -> np.ndarray | None:
    """The conv's (K, C, R, S) weight with zero input channels up to ``c``, where the pass takes it."""
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    if group != 1 or len(conv.input) < 2 or conv.input[1] not in inits:
        return None
    w = numpy_helper.to_array(inits[conv.input[1]])
    if w.ndim != 4 or _small_c_3x3(conv, w):
        return None
    return np.concatenate([w, np.zeros((w.shape[0], c - w.shape[1], *w.shape[2:]), w.dtype)], axis=1)


def widen_input_channels(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The model with each qualifying input padded to a multiple of :data:`VECTOR` channels before its
    convolutions (module docstring), and what changed (None: nothing did)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}
    taken = {n.name for n in g.node} | {x for n in g.node for x in (*n.input, *n.output)} | set(inits)
    taken |= {i.name for i in g.input}
    done: list[str] = []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    og = out.graph
    index = {id(n): i for i, n in enumerate(g.node)}
    pads: list[onnx.NodeProto] = []
    for inp in g.input:
        shape = _shape(inp)
        if inp.name in inits or shape is None or len(shape) != 4 or not isinstance(shape[1], int):
            continue
        c, users = shape[1], readers.get(inp.name, [])
        wide = -(-c // VECTOR) * VECTOR
        if c % VECTOR == 0 or not users or inp.name in outputs:
            continue
        if not all(u.op_type == "Conv" and u.input[0] == inp.name and inp.name not in u.input[1:] for u in users):
            continue
        weights = [_widened_weight(u, inits, wide) for u in users]
        if any(w is None for w in weights) or len({u.input[1] for u in users}) != len(users):
            continue  # a weight shared by two readers (or another node) keeps its shape
        if any(len(readers.get(u.input[1], [])) != 1 for u in users):
            continue
        padded = fresh_name(f"{inp.name}_widened", taken)
        pads_name = fresh_name(f"{inp.name}_channel_pads", taken)
        node_name = fresh_name(f"{inp.name}_ChannelPad", taken)
        taken |= {padded, pads_name, node_name}
        og.initializer.append(numpy_helper.from_array(np.array([0, 0, 0, 0, 0, wide - c, 0, 0], np.int64), pads_name))
        pads.append(helper.make_node("Pad", [inp.name, pads_name], [padded], name=node_name))
        by_name = {t.name: t for t in og.initializer}
        for u, w in zip(users, weights, strict=True):
            og.node[index[id(u)]].input[0] = padded
            by_name[u.input[1]].CopyFrom(numpy_helper.from_array(w, u.input[1]))
        done.append(f"{inp.name} ({c} -> {wide} channels, {len(users)} conv(s))")
    for k, node in enumerate(pads):
        og.node.insert(k, node)
    if not done:
        return model, None
    return out, "zero channels added for the vector convolutions: " + ", ".join(done)


__all__ = ["VECTOR", "widen_input_channels"]
