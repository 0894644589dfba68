"""Reflect and edge Pads reach IREE as Gathers of constant indices (compiler/iree_build.gather_pads).

IREE 3.13's llvm-cpu backend fails to compile many reflect Pads (ReflectionPad2d(1) with a dynamic batch,
pads (0,1,3,2) always); the Gather form computes the same values bit for bit and compiles everywhere.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import iree_build
from dualtrack.compiler.verify import ort_session, run_ort

H, W = 11, 14


def pad_model(mode: str, pads: list[int], *, as_input: bool = True, axes: list[int] | None = None) -> onnx.ModelProto:
    """x (N, 3, H, W) -> Pad -> Relu -> y, batch dynamic; ``pads`` in ONNX order for ``axes`` (all four
    by default)."""
    inits = []
    inputs = ["x"]
    attrs: dict = {"mode": mode}
    if as_input:
        inits.append(numpy_helper.from_array(np.array(pads, np.int64), "pads"))
        inputs.append("pads")
        if axes is not None:
            inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
            inputs += ["", "axes"]
    else:
        attrs["pads"] = pads
    nodes = [helper.make_node("Pad", inputs, ["p"], **attrs), helper.make_node("Relu", ["p"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "pad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, "h", "w"])],
        inits,
    )
    opset = 18 if axes is not None else (17 if as_input else 10)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


CASES = [
    ("reflect", [0, 0, 0, 1, 0, 0, 3, 2]),  # ReflectionPad2d((1, 2, 0, 3)): IREE's llvm-cpu fails on it
    ("reflect", [0, 0, 1, 1, 0, 0, 1, 1]),
    ("reflect", [0, 0, 10, 13, 0, 0, 10, 13]),  # the largest reflect pads: size - 1
    ("edge", [0, 0, 4, 0, 0, 0, 0, 7]),
    ("edge", [0, 0, 0, 0, 0, 0, 2, 0]),
]


@pytest.mark.parametrize(("mode", "pads"), CASES)
def test_the_gather_form_computes_the_pad_bit_for_bit(mode: str, pads: list[int]) -> None:
    model = pad_model(mode, pads)
    rewritten = iree_build.gather_pads(model)
    assert "Pad" not in {n.op_type for n in rewritten.graph.node}
    x = np.random.default_rng().standard_normal((2, 3, H, W)).astype(np.float32)
    want = run_ort(ort_session(model), {"x": x})["y"]
    got = run_ort(ort_session(rewritten), {"x": x})["y"]
    assert got.shape == want.shape and np.array_equal(got, want)


def test_pads_as_an_attribute_and_with_opset18_axes_are_rewritten_too() -> None:
    for model in (
        pad_model("reflect", [0, 0, 2, 1, 0, 0, 1, 2], as_input=False),
        pad_model("reflect", [2, 1, 1, 2], axes=[2, 3]),
    ):
        rewritten = iree_build.gather_pads(model)
        assert [n.op_type for n in rewritten.graph.node].count("Gather") == 2
        x = np.random.default_rng().standard_normal((1, 3, H, W)).astype(np.float32)
        assert np.array_equal(
            run_ort(ort_session(rewritten), {"x": x})["y"], run_ort(ort_session(model), {"x": x})["y"]
        )


def test_constant_pads_and_pads_over_channels_are_left_alone() -> None:
    for model in (pad_model("constant", [0, 0, 1, 1, 0, 0, 1, 1]), pad_model("reflect", [0, 1, 1, 1, 0, 1, 1, 1])):
        assert [n.op_type for n in iree_build.gather_pads(model).graph.node] == ["Pad", "Relu"]


def test_the_gather_form_compiles_for_llvm_cpu(tmp_path) -> None:
    """The case IREE 3.13 refuses as a Pad (dynamic batch, pads (0,1,3,2)) compiles once rewritten."""
    mlir = iree_build.import_onnx(pad_model("reflect", [0, 0, 0, 1, 0, 0, 3, 2]), tmp_path)
    out = iree_build.compile_module(mlir, iree_build.cpu_target("x86-64-v3"), (), tmp_path / "m.vmfb")
    assert out.stat().st_size > 0
