"""Ops in forms IREE 3.13 mishandles, rewritten into forms it compiles right (front-end stages).

Each rewrite keeps the op's ONNX semantics exactly and is found by the conformance runner
(:mod:`dualtrack.compiler.conformance`), where IREE refused the form or computed it wrong:

- a MatMul with a 1-D operand ("failed to legalize onnx.MatMul" for 1-D x 3-D and 4-D x 1-D): the
  vector made a matrix the way ONNX defines it (a row in front, a column behind) and the added dim
  squeezed away after;
- uint8 Div and MaxPool, which IREE computes as signed i8 (a value above 127 taken as negative: 45% and
  all of the node tests' random inputs wrong): computed in a wider type that holds every uint8 exactly.
- fp16 sums (:data:`F16_ACCUMULATED`: average pools, the summing Reduce ops, CumSum), whose ONNX import
  IREE 3.13 lowers with an fp16 accumulator on every target (`linalg.fill ins(%cst : f16)` and
  `arith.addf ... : f16` in the dispatch; `add.rn.f16` in the CUDA PTX): computed in fp32 with the
  input cast up and the result cast back (Track B's stage 0, iree_build; docs/facts.md 26, found in the
  dispatch IR). Its convolutions, matmuls, norms and softmax accumulate in fp32 already.

- a Pow whose exponent is a constant of whole numbers, not all one value, which IREE computes as
  exp(y log x): NaN for every negative base, where x ** 3 is -27 for x = -3. Computed as
  |x| ** y times the constant sign (-1) ** y where x is negative.

- a Slice with a negative step ("expected offsets to be non-negative"): a Gather of the indices it
  takes along each sliced axis, the shapes being static;
- SpaceToDepth with ``mode`` CRD (opset 25), which IREE computes as DCR: its definition, a Reshape, a
  Transpose and a Reshape.
- DepthToSpace with ``mode`` CRD (torch's ``pixel_shuffle``), which IREE 3.13 computes wrong for every block
  size on llvm-cpu (blocksize 1, an identity, moved values by up to 3.5 on random data; ONNX's default DCR is
  right): its definition, a Reshape, a Transpose and a Reshape. Only in the graphs IREE is given (Track B's
  stage 0, iree_build.iree_graph, :func:`depth_to_space_crd`): Track A's depth_to_space kernel takes CRD itself.

float64 is not here: it is a precision, converted where the config asks for it (frontend.float64_as_float32).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.batch_free import static_shapes
from dualtrack.compiler.onnx_graph import constants, infer_shapes

# (op, input type) -> the type it is computed in, exact for every value of the input type.
WIDENED = {
    ("Div", TensorProto.UINT8): TensorProto.INT32,
    ("MaxPool", TensorProto.UINT8): TensorProto.FLOAT,  # MaxPool takes no int32; float32 holds uint8 exactly
}
# The ops IREE 3.13 sums in the element type: an fp16 accumulator over a 33x33 window or a 66x66 map
# (4.0e-3 and 2.4e-2 relative L2 on llvm-cpu, tests/test_iree_fp32_sums.py). ReduceLogSumExp, the norms,
# Softmax, Conv, ConvTranspose, MatMul, Gemm and Einsum accumulate in fp32 already.
F16_ACCUMULATED = (
    "AveragePool",
    "GlobalAveragePool",
    "GlobalLpPool",
    "ReduceMean",
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "CumSum",
)
FP32_SUMS = {(op, TensorProto.FLOAT16): TensorProto.FLOAT for op in F16_ACCUMULATED}


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = infer_shapes(model, strict_mode=False)
    g = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info, *g.output]}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    return types


def widened_unsigned(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Each op of :data:`WIDENED` on its unsigned type computed in the wider type: its inputs cast up, its
    first output cast back. The model (changed in place) and the nodes rewritten."""
    return _widened(model, WIDENED)


def fp32_sums(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each op of :data:`F16_ACCUMULATED` on fp16 computed in fp32 (:data:`FP32_SUMS`): its fp16 inputs
    cast up, its output cast back, so IREE accumulates in fp32. A copy where anything changed (Track B's
    segment models are shared by every target and batch), else ``model`` itself: a second pass, or an fp32
    graph."""
    if not any(n.op_type in F16_ACCUMULATED for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out if _widened(out, FP32_SUMS)[1] else model


def _widened(model: onnx.ModelProto, table: dict[tuple[str, int], int]) -> tuple[onnx.ModelProto, list[str]]:
    """Each node whose (op, first input's type) ``table`` maps to a wider type computed in that type:
    its inputs of the narrow type cast up (axes and other integer inputs stay), its first output cast
    back. The model (changed in place) and the nodes rewritten."""
    if not any(n.op_type in {op for op, _ in table} for n in model.graph.node):
        return model, []
    types = _elem_types(model)
    done: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        wide = table.get((node.op_type, types.get(node.input[0], 0))) if node.input else None
        if wide is None or len(node.output) != 1:  # MaxPool's Indices output is int64 already; one output only
            nodes.append(node)
            continue
        base, narrow = node.name or node.output[0], types[node.input[0]]
        for k, x in enumerate(node.input):
            if x and types.get(x) == narrow:
                nodes.append(helper.make_node("Cast", [x], [f"{base}__wide{k}"], name=f"{base}__wide{k}", to=wide))
                node.input[k] = f"{base}__wide{k}"
        out = node.output[0]
        node.output[0] = f"{base}__wide_out"
        nodes.append(node)
        nodes.append(helper.make_node("Cast", [node.output[0]], [out], name=f"{base}__narrow", to=narrow))
        done.append(f"{node.op_type} '{base}'")
    if done:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        del model.graph.value_info[:]
    return model, done


def matrix_matmuls(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Each MatMul with a 1-D operand as a matrix product: the vector unsqueezed to (1, K) in front or (K, 1)
    behind, the dim that added squeezed from the product. The model (changed in place), the nodes rewritten."""
    if not any(n.op_type == "MatMul" for n in model.graph.node):
        return model, []
    shapes = static_shapes(model)
    shapes.update({i.name: tuple(i.dims) for i in model.graph.initializer})
    done: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        ranks = [len(shapes.get(x, ())) if x in shapes else None for x in node.input]
        if node.op_type != "MatMul" or 1 not in ranks or None in ranks:
            nodes.append(node)
            continue
        base, out = node.name or node.output[0], node.output[0]
        squeeze = []
        for k, axis in ((0, 0), (1, 1)):
            if ranks[k] == 1:
                axes = f"{base}__axes{k}"
                model.graph.initializer.append(numpy_helper.from_array(_i64([axis]), axes))
                nodes.append(
                    helper.make_node("Unsqueeze", [node.input[k], axes], [f"{base}__mat{k}"], name=f"{base}__mat{k}")
                )
                node.input[k] = f"{base}__mat{k}"
                squeeze.append(-2 if k == 0 else -1)
        node.output[0] = f"{base}__product"
        nodes.append(node)
        # Both squeezed dims are counted from the end of the product: (.., 1, N) and (.., M, 1).
        axes = f"{base}__squeeze_axes"
        model.graph.initializer.append(numpy_helper.from_array(_i64(sorted(squeeze)), axes))
        nodes.append(helper.make_node("Squeeze", [node.output[0], axes], [out], name=f"{base}__vector"))
        done.append(f"'{base}'")
    if done:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        del model.graph.value_info[:]
    return model, done


def signed_powers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Each Pow of a constant whole-number exponent (not a single value: IREE gets x ** 2 right) as
    ``Pow(Abs(x), y) * Where(x < 0, (-1) ** y, 1)``. The model (changed in place), the nodes rewritten."""
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    done: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        y = consts.get(node.input[1]) if node.op_type == "Pow" else None
        if y is None or y.size < 2 or np.all(y == y.flat[0]) or not np.all(np.isfinite(y) & (np.round(y) == y)):
            nodes.append(node)
            continue
        base, x, out = node.name or node.output[0], node.input[0], node.output[0]
        odd = numpy_helper.from_array((np.abs(np.round(y)) % 2 == 1).astype(bool), f"{base}__odd")
        zero = f"{base}__zero"
        model.graph.initializer.append(odd)
        nodes += [
            helper.make_node("Abs", [x], [f"{base}__abs"], name=f"{base}__abs"),
            helper.make_node("Pow", [f"{base}__abs", node.input[1]], [f"{base}__magnitude"], name=base),
            helper.make_node("Neg", [f"{base}__magnitude"], [f"{base}__negated"], name=f"{base}__negated"),
            helper.make_node("Sub", [x, x], [zero], name=zero),  # a zero of x's type and shape
            helper.make_node("Less", [x, zero], [f"{base}__negative"], name=f"{base}__negative"),
            helper.make_node("And", [f"{base}__negative", odd.name], [f"{base}__flip"], name=f"{base}__flip"),
            helper.make_node(
                "Where", [f"{base}__flip", f"{base}__negated", f"{base}__magnitude"], [out], name=f"{base}__sign"
            ),
        ]
        done.append(f"'{base}'")
    if done:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        del model.graph.value_info[:]
    return model, done


def _replace(model: onnx.ModelProto, rewrite) -> list[str]:
    """Each node ``rewrite`` returns nodes for (None: kept) replaced by them, in place; the nodes rewritten."""
    nodes: list[onnx.NodeProto] = []
    done: list[str] = []
    for node in model.graph.node:
        new = rewrite(node)
        nodes += [node] if new is None else new
        if new is not None:
            done.append(f"{node.op_type} '{node.name or node.output[0]}'")
    if done:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        del model.graph.value_info[:]
    return done


def reshaped_forms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Negative-step Slices as Gathers, CRD SpaceToDepth as its definition
    (module docstring). The model (changed in place) and the nodes rewritten."""
    if not any(n.op_type in ("Slice", "SpaceToDepth") for n in model.graph.node):
        return model, []
    shapes, consts = static_shapes(model), constants(model.graph)
    shapes.update({i.name: tuple(i.dims) for i in model.graph.initializer})
    inits = model.graph.initializer

    def rewrite(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        shape = shapes.get(node.input[0]) if node.input else None
        if shape is None or any(d < 0 for d in shape[1:]):
            return None
        if node.op_type == "Slice":
            return _slice_gathers(node, shape, consts, inits)
        if node.op_type == "SpaceToDepth":
            return _space_to_depth_crd(node, shape, inits)
        return None

    return model, _replace(model, rewrite)


def _slice_gathers(node: onnx.NodeProto, shape: tuple[int, ...], consts: dict, inits) -> list[onnx.NodeProto] | None:
    args = [consts.get(x) if x else None for x in [*node.input, "", "", ""][1:5]]
    starts, ends, axes, steps = args
    if starts is None or ends is None or steps is None or not np.any(steps < 0) or (node.input[3:4] and axes is None):
        return None
    axes = np.arange(len(starts)) if axes is None else axes
    if any(int(a) % len(shape) == 0 and shape[0] < 0 for a in axes):
        return None  # the batch dim is not static
    base, cur, nodes = node.name or node.output[0], node.input[0], []
    for k, (a, b, e, st) in enumerate(zip(axes, starts, ends, steps, strict=True)):
        axis = int(a) % len(shape)
        # ONNX clamps start and end as Python's slice does, for either sign of the step.
        index = np.arange(shape[axis])[slice(int(b), int(e), int(st))].astype(np.int64)
        inits.append(numpy_helper.from_array(index, f"{base}__index{k}"))
        out = f"{base}__taken{k}"
        nodes.append(helper.make_node("Gather", [cur, f"{base}__index{k}"], [out], name=out, axis=axis))
        cur = out
    nodes[-1].output[0] = node.output[0]
    return nodes


def _space_to_depth_crd(node: onnx.NodeProto, shape: tuple[int, ...], inits) -> list[onnx.NodeProto] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("mode", b"DCR") != b"CRD" or len(shape) != 4:
        return None
    b, (_, c, h, w) = int(attrs["blocksize"]), shape
    blocks, depth = [0, c, h // b, b, w // b, b], [0, c * b * b, h // b, w // b]
    return _reshape_transpose_reshape(node, blocks, [0, 1, 3, 5, 2, 4], depth, inits)


def _reshape_transpose_reshape(
    node: onnx.NodeProto, blocks: list[int], perm: list[int], final: list[int], inits
) -> list[onnx.NodeProto]:
    """``node`` as ONNX defines SpaceToDepth / DepthToSpace: a Reshape to ``blocks``, a Transpose by ``perm``
    and a Reshape to ``final`` (Reshape's 0 keeps the input's batch); the shapes' constants into ``inits``."""
    base = node.name or node.output[0]
    inits.append(numpy_helper.from_array(_i64(blocks), f"{base}__blocks"))
    inits.append(numpy_helper.from_array(_i64(final), f"{base}__final"))
    return [
        helper.make_node("Reshape", [node.input[0], f"{base}__blocks"], [f"{base}__b"], name=f"{base}__b"),
        helper.make_node("Transpose", [f"{base}__b"], [f"{base}__t"], name=f"{base}__t", perm=perm),
        helper.make_node("Reshape", [f"{base}__t", f"{base}__final"], [node.output[0]], name=f"{base}__f"),
    ]


def depth_to_space_crd(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each DepthToSpace of ``mode`` CRD whose channels and picture are static as ONNX defines it: a Reshape
    to (N, C/b², b, b, H, W), a Transpose (0, 1, 4, 2, 5, 3) and a Reshape to (N, C/b², H b, W b), the
    batch kept by Reshape's 0. A copy where anything changed, else ``model`` itself (a second pass)."""
    if not any(n.op_type == "DepthToSpace" for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    shapes = static_shapes(out)
    shapes.update({i.name: tuple(i.dims) for i in out.graph.initializer})
    inits = out.graph.initializer

    def rewrite(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "DepthToSpace":
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        shape = shapes.get(node.input[0])
        if attrs.get("mode", b"DCR") != b"CRD" or shape is None or len(shape) != 4:
            return None
        b, (_, c, h, w) = int(attrs["blocksize"]), shape
        if min(c, h, w) < 0 or c % (b * b):
            return None
        k = c // (b * b)
        return _reshape_transpose_reshape(node, [0, k, b, b, h, w], [0, 1, 4, 2, 5, 3], [0, k, h * b, w * b], inits)

    return out if _replace(out, rewrite) else model


def _i64(values: list[int]) -> np.ndarray:
    return np.array(values, np.int64)


__all__ = [
    "F16_ACCUMULATED",
    "FP32_SUMS",
    "WIDENED",
    "depth_to_space_crd",
    "fp32_sums",
    "matrix_matmuls",
    "reshaped_forms",
    "signed_powers",
    "widened_unsigned",
]
