"""Spatial re-shaping: the front end's image model at another input height and width.

The config's ``sizes`` (contract/sizes.py) asks for one plan per input size. Each is the same graph,
weights and nodes, with the ``image`` input's H and W rewritten and every shape inferred again
(:func:`at_size`). That is right for a network whose shapes all follow from its input (convolutions,
pools, element-wise ops, Resizes by scales, Reshapes that compute their spatial dims with ``0``/``-1``);
an export whose spatial size is written into a constant is not, and it is handled as the batch is
in :mod:`dualtrack.compiler.batch_free`:

- a Resize to constant ``sizes`` becomes one by ``scales`` (:func:`free_sizes`, the rule of
  ``batch_free._resize`` over H and W), where float32 scales give the sizes back exactly;
- a Reshape of a tensor whose size follows the input that writes one of that tensor's spatial dims
  (or their product) as a number, or has no ``-1`` to absorb the change, is refused;
- any other shape that no longer fits (an Expand or a MatMul map made at the export's size, a
  skip connection whose two sides round an odd size differently) is refused where ONNX shape
  inference finds the conflict;

each refusal one line naming the node and why. Every output must end in the input's H and W
(``mask`` (N, H, W), ``probs`` (N, C, H, W)), since the engine crops outputs back to the image.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import numpy as np
import onnx

from dualtrack.compiler.batch_free import replace_input, static_shapes, with_batch
from dualtrack.compiler.onnx_graph import constants, infer_shapes, resize_scale
from dualtrack.contract.sizes import Size, label
from dualtrack.errors import ModelError

_FIX = "export the model with dynamic height and width, or drop `sizes` to build the export's size only"


def image_size(model: onnx.ModelProto) -> Size:
    """(H, W) of the model's (N, H, W, 3) image input (the front end's wrap)."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    if len(dims) != 4 or dims[3].dim_value != 3 or not (dims[1].dim_value and dims[2].dim_value):
        raise ModelError(
            f"`sizes` needs an (N, H, W, 3) image input; '{model.graph.input[0].name}' is not one: add `preprocess`"
        )
    return dims[1].dim_value, dims[2].dim_value


def free_sizes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Resizes to constant ``sizes`` over H or W as Resizes by ``scales`` (exact at the export's size);
    the model (a copy where any changed) and the nodes rewritten."""
    shapes = static_shapes(with_batch(model, 1))  # a symbolic batch leaves no dim static
    consts = constants(model.graph)
    out, done = model, []
    for k, node in enumerate(model.graph.node):
        if node.op_type != "Resize" or len(node.input) < 4 or node.input[3] not in consts:
            continue
        src, sizes = shapes.get(node.input[0]), consts[node.input[3]]
        if src is None or min(src) <= 0 or any(a.name == "axes" for a in node.attribute):
            continue  # opset 18's axes: the front end widened those with scales (resize_maps.widened_axes)
        ratios = [resize_scale(int(o), int(i)) for o, i in zip(sizes, src, strict=True)]
        if any(r is None for r in ratios):
            raise ModelError(f"Resize '{node.name}' resizes to sizes {sizes.tolist()} that no scale reproduces; {_FIX}")
        if out is model:
            out = copy.deepcopy(model)
        target = out.graph.node[k]
        if len(target.input) < 3:
            target.input.append("")
        replace_input(out, target, 2, np.array(ratios, np.float32), "scales")
        del target.input[3:]
        done.append(node.name)
    return out, done


def at_size(model: onnx.ModelProto, size: Size) -> onnx.ModelProto:
    """``model`` (an image model, its Resizes freed) with an (N, *size, 3) input, shapes re-inferred;
    ModelError (one line: the node and why) where the graph cannot take that size."""
    export = image_size(model)
    if size == export:
        return model
    m = copy.deepcopy(model)
    dims = m.graph.input[0].type.tensor_type.shape.dim
    dims[1].dim_value, dims[2].dim_value = size
    for out in m.graph.output:
        d = out.type.tensor_type.shape.dim
        if len(d) < 3 or (d[-2].dim_value, d[-1].dim_value) != export:
            shape = [x.dim_value or x.dim_param for x in d]
            raise ModelError(
                f"output '{out.name}' is {shape}, not at the input's {label(export)}: `sizes` crops every output "
                "back to the image, so each must end in the input's height and width (add `postprocess`)"
            )
        d[-2].dim_value, d[-1].dim_value = size
    del m.graph.value_info[:]
    _refuse_baked_reshapes(model, m, size)
    try:
        infer_shapes(m, check_type=True, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as e:
        raise ModelError(_inference_refusal(str(e), size)) from None
    return m


def _refuse_baked_reshapes(export: onnx.ModelProto, sized: onnx.ModelProto, size: Size) -> None:
    """A Reshape of a tensor that grows with the input, whose target writes one of its spatial dims
    as a number (or has no -1 to take the change): refused, naming the node."""
    before, after = static_shapes(with_batch(export, 1)), static_shapes(with_batch(sized, 1))
    consts = constants(export.graph)
    for node in export.graph.node:
        if node.op_type != "Reshape" or node.input[1] not in consts:
            continue
        src, moved = before.get(node.input[0]), after.get(node.input[0])
        if src is None or moved is None or src == moved or min(src) <= 0:
            continue
        target = [int(v) for v in consts[node.input[1]]]
        spatial = {k for k, (d, e) in enumerate(zip(src, moved, strict=False)) if d != e}
        fixed = {d for k, d in enumerate(src) if k not in spatial}
        written = sorted({v for v in target if v > 0 and v in _runs(spatial, src) and v not in fixed})
        if written or -1 not in target:
            why = (
                f"writes the export's spatial size {written[0]} into its shape {target}"
                if written
                else f"reshapes a tensor that grows with the input to the fixed shape {target}"
            )
            raise ModelError(f"Reshape '{node.name}' cannot take {label(size)}: it {why}; {_FIX}")


def _runs(spatial: set[int], shape: Iterable[int]) -> set[int]:
    """The spatial dims (``spatial``: their indices) and the products of neighbouring dims that
    include one (H*W, C*H*W ...): the numbers a Reshape that bakes the size writes."""
    dims, out = list(shape), set()
    for i in range(len(dims)):
        p = 1
        for j in range(i, len(dims)):
            p *= dims[j]
            if any(k in spatial for k in range(i, j + 1)):
                out.add(p)
    return out


def _inference_refusal(message: str, size: Size) -> str:
    """ONNX's inference error as one line naming the node: ``(op_type:Add, node name: x): ...``."""
    found = re.search(r"op_type:(\w+), node name: ([^)]*)\):\s*(?:\[\w+\]\s*)?([^\n]*)", message)
    if found is None:
        first = message.strip().splitlines()[0] if message.strip() else "shape inference failed"
        return f"the model cannot take {label(size)} ({first[:200]}); {_FIX}"
    op, name, why = found.groups()
    return (
        f"{op} '{name}' cannot take {label(size)}: {why.strip()[:200]} (a shape fixed at the export's size, or a "
        f"size the network's strides do not divide: pick sizes that are multiples of its total stride); {_FIX}"
    )


__all__ = ["at_size", "free_sizes", "image_size"]
