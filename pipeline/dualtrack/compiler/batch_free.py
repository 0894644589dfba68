"""Batch freeing: make an export whose batch was fixed at export time take any batch.

An exporter that traces at batch B fixes dim 0 of the input and writes B into shape arguments
(``Reshape(x, [B, C, -1])``, ``Resize(x, sizes=[B, C, H, W])``, ``Expand(x, [B, ...])``). The front end
(:mod:`dualtrack.compiler.frontend`) calls :func:`symbolic_batch` to make dim 0 the symbol ``N`` and
:func:`batch_generic_shapes` to turn the shape constants that carry B into "this dim of the input".
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import numpy_helper

BATCH = "N"  # the symbolic batch dimension


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


def batch_generic_shapes(model: onnx.ModelProto, export_batch: int | None) -> tuple[onnx.ModelProto, str | None]:
    """Shape constants that carry the export's fixed batch are made batch-generic.

    Where the tensor reshaped keeps the batch in dim 0 (shape inference with a symbolic batch says
    so), the B becomes "this dim of the input": 0 for Reshape (copy), scales instead of sizes for
    Resize, 1 for Expand (broadcast). Anything else that carries the batch is caught by the batch
    check at the sizes being built. Returns the model and a note of what changed (None: nothing).
    """
    if export_batch is None:
        return model, None
    model = copy.deepcopy(model)
    del model.graph.value_info[:]  # shapes recorded at the export batch would pin dim 0 again
    done: list[str] = []
    for _ in range(len(model.graph.node) + 1):  # each pass frees the consumers of the last; bounded
        dims = _dim0(model)
        inits = {i.name: i for i in model.graph.initializer}
        changed = 0
        for node in model.graph.node:
            # A symbolic dim 0 is the batch: the input's N, or the fresh symbol shape inference gives
            # the output of an op that scales N (a Resize with scales: N x 1.0).
            if not node.input or not isinstance(dims.get(node.input[0]), str):
                continue
            rewrite = _BATCH_REWRITES.get(node.op_type)
            if rewrite is not None and rewrite(model, node, inits, export_batch, dims):
                done.append(f"{node.op_type} '{node.name or node.output[0]}'")
                changed += 1
        if not changed:
            break
    if not done:
        return model, None
    shown = ", ".join(done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
    return model, f"{len(done)} shape constant(s) carried the export batch {export_batch}: {shown}"


def _dim0(model: onnx.ModelProto) -> dict[str, str | int]:
    """Dim 0 of every tensor under shape inference with the symbolic batch: a symbol ("N", or one
    inference made up for it) or an int."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except onnx.shape_inference.InferenceError:
        return {}
    out: dict[str, str | int] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and len(t.shape.dim):
            d = t.shape.dim[0]
            out[vi.name] = d.dim_param if d.HasField("dim_param") else d.dim_value
    return out


def _const_input(model: onnx.ModelProto, inits: dict, node: onnx.NodeProto, k: int) -> np.ndarray | None:
    if len(node.input) <= k or node.input[k] not in inits:
        return None
    return numpy_helper.to_array(inits[node.input[k]])


def replace_input(model: onnx.ModelProto, node: onnx.NodeProto, k: int, value: np.ndarray, tag: str) -> None:
    """Give input ``k`` of ``node`` a constant of its own (the old one may be shared)."""
    names = {i.name for i in model.graph.initializer}
    name, i = f"{node.input[k] or node.name}__{tag}", 0
    while name in names:
        i += 1
        name = f"{node.input[k]}__{tag}{i}"
    model.graph.initializer.append(numpy_helper.from_array(value, name))
    node.input[k] = name


def _reshape_batch(model, node, inits, batch, dims) -> bool:
    shape = _const_input(model, inits, node, 1)
    if shape is None or shape.ndim != 1 or not len(shape) or int(shape[0]) != batch:
        return False
    allowzero = next((a.i for a in node.attribute if a.name == "allowzero"), 0)
    if allowzero and -1 in shape[1:]:
        return False
    new = shape.copy()
    new[0] = -1 if allowzero else 0  # 0: copy dim 0 of the input, which is the batch
    replace_input(model, node, 1, new, "batch")
    return True


def _resize_batch(model, node, inits, batch, dims) -> bool:
    sizes = _const_input(model, inits, node, 3)
    if sizes is None or len(sizes) < 3 or int(sizes[0]) != batch:
        return False
    shapes = static_shapes(model)
    src = shapes.get(node.input[0])
    if src is None or len(src) != len(sizes) or any(d <= 0 for d in src[1:]):
        return False
    scales = np.array([1.0] + [float(o) / float(i) for o, i in zip(sizes[1:], src[1:], strict=True)], np.float32)
    if any(int(np.floor(i * s)) != int(o) for i, s, o in zip(src[1:], scales[1:], sizes[1:], strict=True)):
        return False  # the ratio does not round back to the size in float32: leave it to the batch check
    replace_input(model, node, 2, scales, "scales")
    del node.input[3:]
    return True


def _expand_batch(model, node, inits, batch, dims) -> bool:
    shape = _const_input(model, inits, node, 1)
    if shape is None or shape.ndim != 1 or not len(shape) or int(shape[0]) != batch:
        return False
    new = shape.copy()
    new[0] = 1  # broadcast: keeps the input's batch
    replace_input(model, node, 1, new, "batch")
    return True


_BATCH_REWRITES = {"Reshape": _reshape_batch, "Resize": _resize_batch, "Expand": _expand_batch}


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape under ONNX shape inference; -1 for a dim it leaves symbolic."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    out = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return out
