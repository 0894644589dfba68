"""Resize as constant per-axis maps: the ONNX Resize forms IREE 3.13 cannot lower, rewritten into ops it can.

IREE's ONNX importer (torch-mlir) lowers Resize with ``mode`` nearest, linear or cubic and the common
coordinate transformations, but refuses ``antialias``, ``axes`` (opset 18), a ``keep_aspect_ratio_policy``
other than stretch, ``exclude_outside``, ``tf_crop_and_resize`` and nearest with ``align_corners``
("failed to legalize onnx.Resize"). Every Resize mode is separable: the output is the input mapped along
each resized axis by a constant (out x in) matrix, plus, for ``tf_crop_and_resize``, the extrapolation value
where a coordinate falls outside the input. With static shapes and constant roi/scales/sizes those matrices
are fixed, so such a Resize becomes one Gather (a nearest map: one input index per output index) or one
MatMul per resized axis, and an Add of the extrapolation.

The matrices are not derived here from the spec's formulas: onnxruntime (the reference the build is verified
against) computes them, by running the node itself on a one-hot basis along each axis (one basis row per
input index in dim 0, which the node leaves alone). The rewrite is checked against the node in onnxruntime
on a random input before it is kept; a Resize it cannot rewrite stays as it was (IREE's refusal names it).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from dualtrack.compiler.batch_free import static_shapes
from dualtrack.compiler.onnx_graph import fresh_name, infer_shapes

PROBE_MAX = 1 << 22  # elements of a probe that keeps the other axes (keep_aspect_ratio_policy couples them)
_ATOL = 1e-5  # the rewrite against the node, relative to the output's scale (fp32 sums in another order)


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def iree_cannot_lower(node: onnx.NodeProto) -> bool:
    """Whether IREE 3.13 refuses this Resize for one of its attributes (module docstring)."""
    a = _attrs(node)
    coord = a.get("coordinate_transformation_mode", b"half_pixel")
    return bool(
        a.get("antialias", 0)
        or "axes" in a
        or a.get("keep_aspect_ratio_policy", b"stretch") != b"stretch"
        or a.get("exclude_outside", 0)
        or coord == b"tf_crop_and_resize"
        or (a.get("mode", b"nearest") == b"nearest" and coord == b"align_corners")
    )


def widened_axes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Every Resize whose opset-18 ``axes`` list its constant scales, over every axis instead (scale 1 on
    the others) and without ``axes``: the same op, in the form IREE and Track A's resize kernel take, where
    per-axis maps would put it on Track B. Sizes over ``axes`` stay as they are (the batch they leave out
    has no constant value), for :func:`resize_maps`. The model (changed in place) and the nodes widened."""
    todo = [n for n in model.graph.node if n.op_type == "Resize" and "axes" in _attrs(n)]
    if not todo:
        return model, []
    shapes = static_shapes(model)
    inits = {i.name: i for i in model.graph.initializer}
    taken = set(inits) | {o for n in model.graph.node for o in n.output}
    done = []
    for node in todo:
        ins = [*node.input, "", "", ""]
        rank = len(shapes.get(node.input[0], ()))
        if ins[1] or not ins[2] or ins[3] or ins[2] not in inits or rank < 1:
            continue  # an roi, sizes, or scales computed at run time
        axes = [int(a) % rank for a in _attrs(node)["axes"]]
        scales = numpy_helper.to_array(inits[ins[2]]).reshape(-1)
        if len(scales) != len(axes) or len(set(axes)) != len(axes):
            continue
        full = np.ones(rank, np.float32)
        full[axes] = scales
        name = fresh_name(f"{ins[2]}/all_axes", taken)
        model.graph.initializer.append(numpy_helper.from_array(full, name))
        node.input[2] = name
        kept = [a for a in node.attribute if a.name != "axes"]
        del node.attribute[:]
        node.attribute.extend(kept)
        done.append(node.name or node.output[0])
    return model, done


def resize_maps(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Every Resize IREE cannot lower, with static shapes and constant parameters, as per-axis maps; the
    model and the names of the nodes rewritten."""
    todo = [n for n in model.graph.node if n.op_type == "Resize" and iree_cannot_lower(n)]
    if not todo:
        return model, []
    shapes = static_shapes(model)
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    opset = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    done: list[str] = []
    for node in todo:
        src, dst = shapes.get(node.input[0], ()), shapes.get(node.output[0], ())
        params = [consts.get(x) if x else None for x in [*node.input, "", "", ""][1:4]]
        if len(src) < 3 or len(src) != len(dst) or min([*src[1:], *dst[1:]], default=0) <= 0:
            continue  # a symbolic batch is fine; the axes it maps must be static
        if any(x and p is None for x, p in zip(list(node.input)[1:4], params, strict=False)):
            continue  # roi, scales or sizes computed at run time
        dtype = onnx.helper.tensor_dtype_to_np_dtype(_elem_type(model, node.input[0]))
        if np.dtype(dtype).kind != "f":
            continue
        nodes, inits = _as_maps(node, tuple(src), tuple(dst), params, opset, np.dtype(dtype))
        if nodes is None or not _same(node, nodes, inits, tuple(src), params, opset, np.dtype(dtype)):
            continue
        at = list(model.graph.node).index(node)
        del model.graph.node[at]
        for k, n in enumerate(nodes):
            model.graph.node.insert(at + k, n)
        model.graph.initializer.extend(inits)
        done.append(f"'{node.name or node.output[0]}'")
    return model, done


def _elem_type(model: onnx.ModelProto, name: str) -> int:
    inferred = infer_shapes(model, strict_mode=False)
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if vi.name == name:
            return vi.type.tensor_type.elem_type
    return onnx.TensorProto.UNDEFINED


def _probe(
    node: onnx.NodeProto,
    shape: list[int],
    params: list[np.ndarray | None],
    opset: list[onnx.OperatorSetIdProto],
    x: np.ndarray,
    extrapolation: float | None = None,
) -> np.ndarray:
    """The node alone in onnxruntime on ``x`` (of ``shape``), its roi/scales/sizes ``params``."""
    names = ["x"]
    inits = []
    for k, p in enumerate(params):
        names.append(f"p{k}" if p is not None else "")
        if p is not None:
            inits.append(numpy_helper.from_array(p, f"p{k}"))
    probe = helper.make_node("Resize", names, ["y"])
    probe.attribute.extend(
        a for a in node.attribute if not (extrapolation is not None and a.name == "extrapolation_value")
    )
    if extrapolation is not None:
        probe.attribute.append(helper.make_attribute("extrapolation_value", extrapolation))
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    graph = helper.make_graph(
        [probe],
        "probe",
        [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=opset)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _probe_params(
    params: list[np.ndarray | None], axes: list[int], k: int, n: int, coupled: bool
) -> list[np.ndarray | None] | None:
    """roi/scales/sizes for the probe of axis ``k``: ``n`` basis rows in dim 0, one channel, the other axes
    left at 1 (or kept, where the aspect-ratio policy couples them); None where the node maps dim 0 or 1."""
    roi, scales, sizes = params
    if scales is not None and scales.size:
        scales = scales.astype(np.float32).copy()
        for i, d in enumerate(axes):
            if d in (0, 1) and scales[i] != 1:
                return None
            if d >= 2 and not coupled and d != k:
                scales[i] = 1.0
    if sizes is not None and sizes.size:
        sizes = sizes.astype(np.int64).copy()
        for i, d in enumerate(axes):
            if d >= 2 and not coupled and d != k:
                sizes[i] = 1
            elif d in (0, 1):
                sizes[i] = n if d == 0 else 1
    return [roi, scales, sizes]


def _axis_map(
    node: onnx.NodeProto,
    src: tuple[int, ...],
    dst: tuple[int, ...],
    k: int,
    params: list[np.ndarray | None],
    opset: list[onnx.OperatorSetIdProto],
) -> tuple[np.ndarray, np.ndarray] | None:
    """Axis ``k``'s (out x in) matrix and in-range mask, read off the node run on a one-hot basis."""
    a = _attrs(node)
    rank, n = len(src), src[k]
    coupled = a.get("keep_aspect_ratio_policy", b"stretch") != b"stretch"
    axes = [int(d) % rank for d in a.get("axes", range(rank))]  # type: ignore[call-overload]
    probe_params = _probe_params(params, axes, k, n, coupled)
    shape = [n, 1] + [src[d] if (coupled or d == k) else 1 for d in range(2, rank)]
    if probe_params is None or int(np.prod(shape)) > PROBE_MAX:
        return None
    basis = np.eye(n, dtype=np.float32).reshape([n] + [n if d == k else 1 for d in range(1, rank)])
    y = _probe(node, shape, probe_params, opset, np.ascontiguousarray(np.broadcast_to(basis, shape)), float("nan"))
    if y.shape[0] != n or y.shape[1] != 1 or y.shape[k] != dst[k]:
        return None
    cols = np.moveaxis(y, k, 1).reshape(n, dst[k], -1)  # the other axes' positions, one of them in range
    best = int(np.argmax(np.isfinite(cols).sum(axis=(0, 1))))
    m = cols[:, :, best].T.astype(np.float64)
    mask = np.isfinite(m).all(axis=1)
    m[~mask] = 0.0
    return m, mask


def _as_maps(
    node: onnx.NodeProto,
    src: tuple[int, ...],
    dst: tuple[int, ...],
    params: list[np.ndarray | None],
    opset: list[onnx.OperatorSetIdProto],
    dtype: np.dtype,
) -> tuple[list[onnx.NodeProto] | None, list[onnx.TensorProto]]:
    """The nodes and constants that compute ``node``: a Gather or MatMul per axis it maps, then the
    extrapolation; (None, []) where an axis cannot be read off."""
    rank, base = len(src), node.name or node.output[0]
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    masks = []
    cur = node.input[0]
    for k in range(2, rank):
        got = _axis_map(node, src, dst, k, params, opset)
        if got is None:
            return None, []
        m, mask = got
        masks.append(mask)
        if m.shape[0] == m.shape[1] and mask.all() and np.array_equal(m, np.eye(m.shape[0])):
            continue
        out = f"{base}__axis{k}"
        nodes += _map_nodes(cur, out, k, rank, m, mask, dtype, inits)
        cur = out
    e = float(_attrs(node).get("extrapolation_value", 0.0))  # type: ignore[arg-type]
    if e != 0.0 and not all(mk.all() for mk in masks):
        inside = masks[0].astype(np.float64)
        for mk in masks[1:]:
            inside = np.multiply.outer(inside, mk.astype(np.float64))
        inits.append(
            numpy_helper.from_array((e * (1 - inside)).reshape(1, 1, *dst[2:]).astype(dtype), f"{base}__extrapolated")
        )
        nodes.append(helper.make_node("Add", [cur, inits[-1].name], [f"{base}__add"], name=f"{base}__add"))
        cur = f"{base}__add"
    if not nodes:
        nodes.append(helper.make_node("Identity", [cur], [node.output[0]], name=f"{base}__identity"))
    nodes[-1].output[0] = node.output[0]
    return nodes, inits


def _map_nodes(
    cur: str,
    out: str,
    k: int,
    rank: int,
    m: np.ndarray,
    mask: np.ndarray,
    dtype: np.dtype,
    inits: list[onnx.TensorProto],
) -> list[onnx.NodeProto]:
    """``cur`` mapped along axis ``k`` by ``m``: a Gather where each output index takes one input index as it
    is (nearest), else a MatMul, with the mapped axis last (a Transpose either side when it is not)."""
    if mask.all() and np.all((m == 0) | (m == 1)) and np.all(m.sum(axis=1) == 1):
        inits.append(numpy_helper.from_array(m.argmax(axis=1).astype(np.int64), f"{out}_index"))
        return [helper.make_node("Gather", [cur, inits[-1].name], [out], name=out, axis=k)]
    inits.append(numpy_helper.from_array(np.ascontiguousarray(m.T).astype(dtype), f"{out}_map"))
    if k == rank - 1:
        return [helper.make_node("MatMul", [cur, inits[-1].name], [out], name=out)]
    perm = list(range(rank))
    perm[k], perm[-1] = perm[-1], perm[k]  # a swap: its own inverse
    return [
        helper.make_node("Transpose", [cur], [f"{out}_t"], name=f"{out}_t", perm=perm),
        helper.make_node("MatMul", [f"{out}_t", inits[-1].name], [f"{out}_m"], name=f"{out}_m"),
        helper.make_node("Transpose", [f"{out}_m"], [out], name=out, perm=perm),
    ]


def _same(
    node: onnx.NodeProto,
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    src: tuple[int, ...],
    params: list[np.ndarray | None],
    opset: list[onnx.OperatorSetIdProto],
    dtype: np.dtype,
) -> bool:
    """The rewrite against the node in onnxruntime, on one random input of the node's shape (batch 1)."""
    shape = [max(src[0], 1), *src[1:]]
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    ref = _probe(node, shape, params, opset, x)
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    graph = helper.make_graph(
        nodes,
        "maps",
        [helper.make_tensor_value_info(node.input[0], elem, shape)],
        [helper.make_tensor_value_info(node.output[0], elem, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=opset)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {node.input[0]: x}
    )[0]
    if got.shape != ref.shape:
        return False
    r, g = ref.astype(np.float64), got.astype(np.float64)
    scale = max(1.0, float(np.max(np.abs(r), initial=0.0)))
    return bool(np.allclose(g, r, rtol=0.0, atol=_ATOL * scale * (1 if dtype == np.float32 else 100)))


__all__ = ["iree_cannot_lower", "resize_maps", "widened_axes"]
