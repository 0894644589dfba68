"""What every front-end pass asks of an ONNX graph: which tensors are constants (and their values), the
names taken and a name not yet taken for a tensor or node it adds; and the small node helpers the layout
passes (channels_last, token_layout) share: attributes, a Transpose's perm, a node copied onto new
tensors, the nodes still read."""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

TARGET_OPSET = 17  # what the front end upgrades exports to (the reference and the zoo's); IREE 3.13 imports it


def constants(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and Constant nodes' values (``value`` tensors), by name."""
    out = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    out.update(
        (n.output[0], numpy_helper.to_array(n.attribute[0].t))
        for n in g.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    )
    return out


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base`` with the first number that makes it new; added to ``taken``."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}{k}"
    taken.add(name)
    return name


def taken_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name of ``graph`` (initializers, inputs, outputs, node outputs and names)."""
    names = {i.name for i in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    for n in graph.node:
        names.update(n.output)
        names.add(n.name)
    return names


# -- shape inference and the checker without the weights ----------------------------------------------------
# Both take the model serialized: onnx.shape_inference.infer_shapes copies it through protobuf bytes both ways,
# and onnx.checker.check_model one way. The front end asks them about every stage's model, so a network's weights
# were copied some 40 times a build (11 of the 18 s of a cached smp Unet-ConvNeXt-tiny build, 92 MB of weights).
# They read a weight's type and dims only, but for the small constants a shape is computed from (a Reshape's
# shape, a Resize's scales, a Slice's starts): so every float initializer over WEIGHTLESS_ELEMENTS elements is
# given to them as a graph input of its type and dims instead.
WEIGHTLESS_ELEMENTS = 64
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its float weights (initializers of over :data:`WEIGHTLESS_ELEMENTS` elements) as graph
    inputs of their type and dims, appended after its own inputs; the model itself is not changed. An
    initializer that is already a graph input (below IR 4 they all are) stays an initializer."""
    g = model.graph
    listed = {i.name for i in g.input}

    def large(t: TensorProto) -> bool:
        return t.data_type in _FLOATS and int(np.prod(t.dims)) > WEIGHTLESS_ELEMENTS and t.name not in listed

    typed = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer if large(t)]
    small = [t for t in g.initializer if not large(t)]
    graph = helper.make_graph(list(g.node), g.name, [*g.input, *typed], list(g.output), small, value_info=g.value_info)
    graph.sparse_initializer.extend(g.sparse_initializer)
    out = onnx.ModelProto(ir_version=model.ir_version, producer_name=model.producer_name)
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    out.graph.CopyFrom(graph)
    return out


def infer_shapes(model: onnx.ModelProto, **options: bool) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes(model, **options)`` on :func:`weightless` ``model``: the graph's
    inputs, outputs and value_info as inference gives them (the inputs the model's own), its large weights
    absent. For the shapes and types only; ``InferenceError`` as onnx raises it."""
    inferred = onnx.shape_inference.infer_shapes(weightless(model), **options)
    del inferred.graph.input[len(model.graph.input) :]
    return inferred


def check_model(model: onnx.ModelProto, full_check: bool = False) -> None:
    """``onnx.checker.check_model`` on :func:`weightless` ``model``: every check but that of the large weights'
    bytes (a model the front end writes makes them with numpy_helper; the export's own are checked whole when it
    is loaded, and the front end's result once more at its end)."""
    onnx.checker.check_model(weightless(model), full_check=full_check)


def inferred_dims(model: onnx.ModelProto, data_prop: bool = False) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every tensor's inferred dims (-1 where unknown, as the batch is) and its element type."""
    inferred = infer_shapes(model, data_prop=data_prop)
    dims: dict[str, list[int]] = {}
    elems: dict[str, int] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            dims[vi.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        elems[vi.name] = t.elem_type
    return dims, elems


def node_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def transpose_perm(node: onnx.NodeProto) -> list[int] | None:
    """A Transpose's ``perm``; None for any other op."""
    return [int(p) for p in node_attrs(node).get("perm", [])] if node.op_type == "Transpose" else None


def copy_node(node: onnx.NodeProto, inputs: list[str], output: str) -> onnx.NodeProto:
    """``node`` reading ``inputs`` and writing ``output`` (its first output) instead."""
    new = onnx.NodeProto()
    new.CopyFrom(node)
    del new.input[:]
    new.input.extend(inputs)
    new.output[0] = output
    return new


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose every node has a unique name (partition rules and the plan refer to nodes by name;
    onnxconverter-common names its Casts after the nodes, so two unnamed ones collided)."""
    model = copy.deepcopy(model)
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)
    return model


def live_nodes(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` less those whose outputs nothing reads on the way to ``outputs``."""
    needed, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in n.input if i)
    return keep[::-1]


def resize_scale(out: int, size: int) -> np.float32 | None:
    """The float32 scale a Resize by ``scales`` needs to turn ``size`` into ``out``: ``out / size`` rounded
    to float32, raised an ulp at a time (at most a few) until ``floor(size * scale)`` is ``out`` in float32
    and in float64 arithmetic alike, as implementations differ (onnxruntime multiplies in float32, ONNX
    shape inference in float64: 10 * float32(1.9) is 19 in one and 18.99999976 in the other). None where
    no scale near the ratio gives ``out`` in both."""
    scale = np.float32(out / size)
    for _ in range(4):
        if int(np.floor(np.float32(size) * scale)) == out and int(np.floor(float(size) * float(scale))) == out:
            return scale
        scale = np.nextafter(scale, np.float32(np.inf))
    return None


__all__ = [
    "as_float32",
    "constants",
    "copy_node",
    "fresh_name",
    "live_nodes",
    "node_attrs",
    "resize_scale",
    "taken_names",
    "transpose_perm",
]


def as_float32(model: onnx.ModelProto, elem: int) -> onnx.ModelProto:
    """``model`` with every tensor of float type ``elem`` (FLOAT16, DOUBLE) as float32, in place:
    initializers, tensor attributes (Constant values), ``to`` of Casts and the graph's declared types.
    Subgraphs (If, Loop, Scan) are not visited."""
    g = model.graph

    def single(t: onnx.TensorProto) -> onnx.TensorProto:
        return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)

    for i, init in enumerate(g.initializer):
        if init.data_type == elem:
            g.initializer[i].CopyFrom(single(init))
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == elem:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == elem:
                a.i = TensorProto.FLOAT
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == elem:
                a.t.CopyFrom(single(a.t))
    return model


def widen_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` computed in fp32, in place (:func:`as_float32` of FLOAT16; weights widen exactly).
    verify.upcast (the reference of an fp16 engine) and linear_maps' probes call it."""
    return as_float32(model, TensorProto.FLOAT16)


def fp32_only_ops(opset: int) -> frozenset[str]:
    """The ai.onnx ops whose schema at ``opset`` takes float32 but not float16 for one of its inputs
    (Celu; IsInf below opset 20; QuantizeLinear's input before 19): a conversion to fp16 must keep them
    fp32, or the model it writes is invalid. Read from ONNX's own schemas, not listed by hand."""
    out = set()
    for schema in onnx.defs.get_all_schemas():
        if schema.domain not in ("", "ai.onnx"):
            continue
        try:
            at = onnx.defs.get_schema(schema.name, opset, "")
        except onnx.defs.SchemaError:
            continue
        allowed = {t.type_param_str: set(t.allowed_type_strs) for t in at.type_constraints}
        for formal in at.inputs:
            types = allowed.get(formal.type_str, {formal.type_str})
            if "tensor(float)" in types and "tensor(float16)" not in types:
                out.add(at.name)
                break
    return frozenset(out)
