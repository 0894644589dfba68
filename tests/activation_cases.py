"""The activation table's rows as ONNX nodes, with parameters chosen away from ONNX's defaults, for the
tests that hold each row to onnxruntime (tests/test_activations.py, tests/gpu/test_activations_gpu.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dualtrack.contract.activations import KINDS, Activation, ActivationKind

# p0, p1 of the rows that have parameters: not ONNX's defaults, so that a parameter read from the
# wrong place (or left at its default) shows.
TEST_PARAMS: dict[str, tuple[float, float]] = {
    "clip": (-1.5, 2.25),
    "hardsigmoid": (0.3, 0.4),
    "leakyrelu": (0.15, 0.0),
    "elu": (0.7, 0.0),
    "selu": (1.5, 1.25),
    "celu": (2.5, 0.0),
}
ROWS: tuple[ActivationKind, ...] = tuple(k for k in KINDS if k.name != "none")


def case_activation(kind: ActivationKind) -> Activation:
    """The row with its test parameters (ONNX's defaults for a row not in TEST_PARAMS)."""
    p0, p1 = TEST_PARAMS.get(kind.name, kind.defaults)
    return Activation(kind.id, float(np.float32(p0)), float(np.float32(p1)))


def opset(kind: ActivationKind) -> int:
    return max(13, kind.onnx.opset if kind.onnx else 13)


def act_nodes(act: Activation, x: str, y: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """ONNX nodes computing ``act`` from tensor ``x`` into ``y``, and the initializers they read (the
    exported form: silu as Mul(x, Sigmoid(x)), Clip's bounds as inputs)."""
    kind = act.kind
    if kind.onnx is None:  # silu, the one pattern row
        assert kind.name == "silu", kind
        return [helper.make_node("Sigmoid", [x], [f"{y}/sig"]), helper.make_node("Mul", [x, f"{y}/sig"], [y])], []
    values = (act.p0, act.p1)
    inputs, attrs, inits = [x], {}, []
    for j, p in enumerate(kind.onnx.params):
        if p.input:
            name = f"{y}/{p.attr}"
            inits.append(numpy_helper.from_array(np.array(values[j], np.float32), name))
            inputs.append(name)
        else:
            attrs[p.attr] = values[j]
    if kind.onnx.select is not None:
        attrs[kind.onnx.select[0]] = kind.onnx.select[1]
    return [helper.make_node(kind.onnx.op, inputs, [y], **attrs)], inits


def run_ort_activation(act: Activation, x: np.ndarray) -> np.ndarray:
    """onnxruntime's answer for ``act`` on float32 ``x`` (a one-node model: two nodes for silu)."""
    nodes, inits = act_nodes(act, "x", "y")
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(x.shape)) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "act", [vi[0]], [vi[1]], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset(act.kind))])
    model.ir_version = 9  # what onnxruntime 1.20+ loads, whatever IR the installed onnx writes by default
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.astype(np.float32)})[0]
