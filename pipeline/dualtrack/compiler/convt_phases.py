"""ConvTranspose written as a sub-pixel convolution (a front-end pass).

A transposed convolution of stride s computes each output phase (the outputs whose row is a mod s
and column b mod s) as an ordinary correlation of the input with a subset of its kernel's taps. All
s*s phases together are one Conv with s*s*K output channels, whose weights hold each phase's taps
(zeros where a phase has none), followed by ``DepthToSpace(blocksize=s, mode=DCR)``, which puts
phase (a, b) of channel k at output pixel (s*q + a, s*p + b). On Track A that Conv runs on the
tensor-core convolution kernels instead of the transposed convolution's gather kernel on CUDA cores
(MONAI's UNet and AttentionUnet upsample by k3 s2 ConvTransposes: most of their time on the H100),
at the price of the zero taps: 9 of 16 for k3 s2, 16 of 36 for k4 s2 p1.

Per axis, with pad ``p`` before the input, kernel R and stride s, phase a takes taps r = a + p - s*t
for the input offsets t (out[s*q + a] = sum_t x[q + t] * w[a + p - s*t]); the offsets of all phases
span [T0, T1], the Conv's window, with T0 <= 0 as its leading pad. Rewritten only where that holds,
where the output length is a multiple of s (no crop), groups and dilations are 1, the strides are
equal (DepthToSpace's one block size), and the weights are constants; a k2 s2 ConvTranspose without
pads stays as it is (Track A's convt2x2 kernel computes that product in one launch). Anything else is
left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.onnx_graph import fresh_name, infer_shapes

# A phase's share of the Conv's taps below which the zero taps would cost more than the tensor cores save.
MIN_TAP_SHARE = 0.25


@dataclass(frozen=True)
class AxisPlan:
    """One axis of the rewrite: the Conv's window, its pads, and the kernel tap of (phase, window offset)."""

    window: int
    pad_begin: int
    pad_end: int
    taps: tuple[tuple[int, ...], ...]  # taps[a][j]: the ConvTranspose's tap for phase a at window offset j, or -1


def axis_plan(length: int, kernel: int, stride: int, pad: int, out: int) -> AxisPlan | None:
    """The plan along one axis (input ``length``, ConvTranspose ``kernel``, ``stride``, leading ``pad``,
    output ``out``), or None where the rewrite does not hold (the module's docstring)."""
    if out % stride:
        return None
    offsets = [
        (a, (a + pad - r) // stride, r) for a in range(stride) for r in range(kernel) if (a + pad - r) % stride == 0
    ]
    if not offsets:
        return None
    t0, t1 = min(t for _, t, _ in offsets), max(t for _, t, _ in offsets)
    window = t1 - t0 + 1
    pad_end = out // stride - length + t0 + window - 1
    if t0 > 0 or pad_end < 0:
        return None
    taps = [[-1] * window for _ in range(stride)]
    for a, t, r in offsets:
        taps[a][t - t0] = r
    return AxisPlan(window, -t0, pad_end, tuple(tuple(row) for row in taps))


def phase_weights(w: np.ndarray, bias: np.ndarray | None, rows: AxisPlan, cols: AxisPlan, s: int) -> tuple:
    """The Conv's weights (s*s*K, C, window_h, window_w) and bias from the ConvTranspose's (C, K, R, S)
    and (K,): output channel (a*s + b)*K + k is phase (a, b) of channel k (DepthToSpace's DCR order)."""
    C, K = w.shape[:2]
    out = np.zeros((s * s * K, C, rows.window, cols.window), dtype=w.dtype)
    for a in range(s):
        for b in range(s):
            block = out[(a * s + b) * K : (a * s + b + 1) * K]
            for j, r in enumerate(rows.taps[a]):
                for i, q in enumerate(cols.taps[b]):
                    if r >= 0 and q >= 0:
                        block[:, :, j, i] = w[:, :, r, q].T
    return out, (np.tile(bias, s * s) if bias is not None else None)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _plan(node: onnx.NodeProto, w: np.ndarray, x_shape: list[int], y_shape: list[int]) -> tuple | None:
    """(rows, cols, stride) for a ConvTranspose the rewrite takes, else None."""
    a = _attrs(node)
    strides = list(a.get("strides", [1, 1]))
    if w.ndim != 4 or len(strides) != 2 or strides[0] != strides[1] or strides[0] < 2:
        return None
    if a.get("group", 1) != 1 or list(a.get("dilations", [1, 1])) != [1, 1] or "output_shape" in a:
        return None
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    s, (R, S) = strides[0], w.shape[2:]
    pads = list(a.get("pads", [0, 0, 0, 0]))
    if (R, S, s) == (2, 2, 2) and not any(pads) and not any(a.get("output_padding", [0, 0])):
        return None  # Track A's convt2x2 kernel computes this product (a GEMM and its scatter) in one launch
    rows = axis_plan(x_shape[2], R, s, pads[0], y_shape[2])
    cols = axis_plan(x_shape[3], S, s, pads[1], y_shape[3])
    if rows is None or cols is None or R * S / (rows.window * cols.window * s * s) < MIN_TAP_SHARE:
        return None
    return rows, cols, s


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = infer_shapes(model)
    out: dict[str, list[int]] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if len(dims) == 4 and all(d.HasField("dim_value") for d in dims[1:]):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in dims]
    return out


def sub_pixel_convolutions(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The model with every ConvTranspose the rewrite takes written as Conv + DepthToSpace (the
    module's docstring), and a line saying which (None where none)."""
    if not any(n.op_type == "ConvTranspose" for n in model.graph.node):
        return model, None  # nothing to rewrite: no shape inference, no copy
    shapes = _static_shapes(model)
    inits = {i.name: i for i in model.graph.initializer}
    names = {n.name for n in model.graph.node} | {o for n in model.graph.node for o in n.output} | set(inits)
    done: list[str] = []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    for node in out.graph.node:
        w = (
            numpy_helper.to_array(inits[node.input[1]])
            if node.op_type == "ConvTranspose" and node.input[1] in inits
            else None
        )
        bias_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
        plan = None
        if (
            w is not None
            and node.input[0] in shapes
            and node.output[0] in shapes
            and (bias_name is None or bias_name in inits)
        ):
            plan = _plan(node, w, shapes[node.input[0]], shapes[node.output[0]])
        if plan is None:
            nodes.append(node)
            continue
        rows, cols, s = plan
        bias = numpy_helper.to_array(inits[bias_name]) if bias_name else None
        pw, pb = phase_weights(w, bias, rows, cols, s)
        base = fresh_name(f"{node.name or node.output[0]}/phases", names)
        ins = [node.input[0], base + ".weight"]
        out.graph.initializer.append(numpy_helper.from_array(pw, ins[1]))
        if pb is not None:
            ins.append(base + ".bias")
            out.graph.initializer.append(numpy_helper.from_array(pb, ins[2]))
        pads = [rows.pad_begin, cols.pad_begin, rows.pad_end, cols.pad_end]
        conv = helper.make_node("Conv", ins, [base], name=base, kernel_shape=[rows.window, cols.window], pads=pads)
        shuffle = helper.make_node("DepthToSpace", [base], [node.output[0]], name=node.name, blocksize=s, mode="DCR")
        nodes += [conv, shuffle]
        done.append(node.name or node.output[0])
    if not done:
        return model, None
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    read = {i for n in nodes for i in n.input}
    kept = [i for i in out.graph.initializer if i.name in read]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    listed = ", ".join(f"'{n}'" for n in done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
    return (
        out,
        f"{len(done)} ConvTranspose(s) as sub-pixel convolutions (Conv of s*s*K channels, DepthToSpace): {listed}",
    )


__all__ = ["AxisPlan", "axis_plan", "phase_weights", "sub_pixel_convolutions"]
