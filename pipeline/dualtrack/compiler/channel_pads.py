"""A constant Pad over channels written as a 1x1 convolution (a front-end pass).

Some networks widen a residual by padding its channels with zeros (MONAI's HighResNet, "option A"
ResNet shortcuts): ``Pad`` with pads on C. Track A's pad kernel pads H and W only, and a Pad of an
image's channels between two Track A convolutions would split their segment in two, so the pass
writes the channel pad as what it is arithmetically: a 1x1 Conv from C to c0 + C + c1 channels whose
weight is the identity placed at channel offset c0 (one 1 a row, zeros elsewhere) and whose bias is
the pad value on the new channels. It is exact in fp32 and fp16 alike (a product by 1 plus zeros,
accumulated in fp32), and every track runs a 1x1 Conv. Pads over H and W in the same node stay a Pad
after the Conv (a zero one the next convolution may then absorb: ``frontend.fold_zero_pads``).

Rewritten only where the mode is constant, the pads and value are constants, nothing pads N, no pad
is negative (a crop), and the input is 4-D with a known channel count. The one difference from the
Pad: a non-finite input value in one channel (inf, NaN) reaches the other channels of its pixel as
NaN (0 * inf), which no fp16 network that serves has. ONNX cleanup libraries (onnxslim,
onnxoptimizer) keep the Pad, and onnxruntime's optimizer rewrites inside its session only.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.lower_pad import full_pads

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _consts(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    out = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    out.update(
        (n.output[0], numpy_helper.to_array(n.attribute[0].t))
        for n in g.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    )
    return out


def _channel_pad(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> tuple[list[int], float] | None:
    """The Pad's 8 pads (begins, then ends, over N, C, H, W) and its value, where the pass takes it."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("mode", b"constant") not in (b"constant", "constant") or len(node.input) < 2:
        return None
    pads = consts.get(node.input[1])
    value = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros(1)
    has_axes = len(node.input) > 3 and bool(node.input[3])
    axes = consts.get(node.input[3]) if has_axes else None
    if pads is None or value is None or value.size != 1 or (has_axes and axes is None):
        return None
    full = full_pads([int(p) for p in pads.reshape(-1)], axes)
    if full is None or full[0] or full[4] or min(full) < 0 or not (full[1] or full[5]):
        return None
    return full, float(value.reshape(()))


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """Each 4-D float tensor's (channels, element type) where the channel count is known."""
    inferred = onnx.shape_inference.infer_shapes(model)
    out: dict[str, tuple[int, int]] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info]:
        t = vi.type.tensor_type
        if len(t.shape.dim) == 4 and t.shape.dim[1].HasField("dim_value") and t.elem_type in _FLOATS:
            out[vi.name] = (t.shape.dim[1].dim_value, t.elem_type)
    return out


def channel_pads_as_convs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The model with every channel Pad the pass takes written as a 1x1 Conv (and a Pad over H and W
    where the node pads those too), and a line saying which (None where none)."""
    g = model.graph
    if not any(n.op_type == "Pad" for n in g.node):
        return model, None  # nothing to rewrite: no shape inference, no copy
    consts = _consts(g)
    found = {k: p for k, n in enumerate(g.node) if n.op_type == "Pad" and (p := _channel_pad(n, consts)) is not None}
    if not found:
        return model, None
    shapes = _shapes(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {n.name for n in g.node} | {o for n in g.node for o in n.output} | set(consts)
    nodes: list[onnx.NodeProto] = []
    done: list[str] = []
    for k, node in enumerate(out.graph.node):
        plan = found.get(k)
        if plan is None or node.input[0] not in shapes:
            nodes.append(node)
            continue
        (full, value), (C, elem) = plan, shapes[node.input[0]]
        nodes += _as_conv(node, full, value, C, elem, out.graph, taken)
        done.append(node.name or node.output[0])
    if not done:
        return model, None
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    listed = ", ".join(f"'{n}'" for n in done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
    return out, f"{len(done)} channel Pad(s) as 1x1 convolutions (identity weights at the pad's offset): {listed}"


def _as_conv(
    node: onnx.NodeProto, full: list[int], value: float, C: int, elem: int, g: onnx.GraphProto, taken: set[str]
) -> list[onnx.NodeProto]:
    """The Conv (and the H/W Pad after it) that replace channel Pad ``node``; their weights added to ``g``."""
    c0, c1 = full[1], full[5]
    K = c0 + C + c1
    dtype = np.float16 if elem == onnx.TensorProto.FLOAT16 else np.float32
    weight = np.zeros((K, C, 1, 1), dtype)
    weight[c0 + np.arange(C), np.arange(C), 0, 0] = 1
    base = _fresh(f"{node.name or node.output[0]}/channels", taken)
    ins = [node.input[0], f"{base}.weight"]
    g.initializer.append(numpy_helper.from_array(weight, ins[1]))
    if value != 0.0:
        bias = np.full(K, value, dtype)
        bias[c0 : c0 + C] = 0
        ins.append(f"{base}.bias")
        g.initializer.append(numpy_helper.from_array(bias, ins[2]))
    spatial = [0, 0, full[2], full[3], 0, 0, full[6], full[7]]
    if not any(spatial):
        return [helper.make_node("Conv", ins, [node.output[0]], name=node.name or base, kernel_shape=[1, 1])]
    conv = helper.make_node("Conv", ins, [base], name=base, kernel_shape=[1, 1])
    pads_name = f"{base}.pads"
    g.initializer.append(numpy_helper.from_array(np.array(spatial, np.int64), pads_name))
    rest = [base, pads_name]
    if value != 0.0:
        rest.append(f"{base}.value")
        g.initializer.append(numpy_helper.from_array(np.array(value, dtype), rest[2]))
    return [conv, helper.make_node("Pad", rest, [node.output[0]], name=node.name or f"{base}/pad", mode="constant")]


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}{k}"
    taken.add(name)
    return name


__all__ = ["channel_pads_as_convs"]
