"""The front end's rewrites of ops IREE 3.13 cannot take as exported (compiler/resize_maps.py, compiler/iree_forms.py):
each graph, with a symbolic batch where the op allows one, is rewritten (the op gone) and computes what the export
computes in onnxruntime, on fresh random inputs at batch 2, to 1e-5 of the output's scale (exact for the integer
and index forms). The conformance runner checks the same forms on ONNX's own node tests through IREE (SpaceToDepth
CRD there only: the checker here does not take its opset-28 `mode` on a graph built by hand)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import frontend
from dualtrack.compiler.config import BuildConfig

F, U8 = TensorProto.FLOAT, TensorProto.UINT8


def _model(node: onnx.NodeProto, shape: list, out: list, inits: dict[str, np.ndarray], elem: int = F, opset: int = 19):
    graph = helper.make_graph(
        [node],
        "form",
        [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, out)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 14 if opset >= 28 else 9
    return model


def _resize(**attrs) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        ins = {
            "roi": np.array([0, 0, 0.1, 0.2, 1, 1, 0.8, 0.9], np.float32),
            "scales": np.array([1, 1, 0.5, 0.8], np.float32),
        }
        node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], **attrs)
        return _model(node, ["N", 3, 40, 30], ["N", 3, 20, 24], ins)

    return make


FORMS: dict[str, Callable[[], onnx.ModelProto]] = {
    "resize antialias linear": _resize(mode="linear", antialias=1),
    "resize cubic exclude_outside": _resize(mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5),
    "resize tf_crop_and_resize": _resize(
        mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=2.5
    ),
    "resize nearest align_corners": _resize(mode="nearest", coordinate_transformation_mode="align_corners"),
    "slice negative steps": lambda: _model(
        helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"]),
        ["N", 6, 9],
        ["N", 3, 4],
        {"s": np.array([-1, 7]), "e": np.array([-100, 0]), "a": np.array([1, 2]), "t": np.array([-2, -2])},
    ),
    "pow of whole exponents": lambda: _model(
        helper.make_node("Pow", ["x", "p"], ["y"]), ["N", 4], ["N", 4], {"p": np.array([2, 3, 0, 5], np.float32)}
    ),
    "uint8 div": lambda: _model(
        helper.make_node("Div", ["x", "d"], ["y"]),
        ["N", 5],
        ["N", 5],
        {"d": np.array([3, 7, 200, 1, 129], np.uint8)},
        U8,
    ),
    "matmul of a vector": lambda: _model(
        helper.make_node("MatMul", ["x", "v"], ["y"]), ["N", 3, 4], ["N", 3], {"v": np.arange(4, dtype=np.float32)}
    ),
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_the_form_is_rewritten_and_computes_what_the_export_computes(name: str, tmp_path: Path) -> None:
    export = FORMS[name]()
    fe = frontend.prepare(BuildConfig(model=tmp_path / "form.onnx", targets=()), export)
    op = export.graph.node[0].op_type
    left = [n for n in fe.model.graph.node if n.op_type == op and n.input[0] == "x" and n.output[0] == "y"]
    assert not left, f"{op} left as exported: {[str(r) for r in fe.rewrites]}"
    shape = [
        2 if isinstance(d, str) else d
        for d in [2, *[d.dim_value for d in export.graph.input[0].type.tensor_type.shape.dim[1:]]]
    ]
    rng = np.random.default_rng()
    if export.graph.input[0].type.tensor_type.elem_type == U8:
        x = rng.integers(0, 256, size=shape, dtype=np.uint8)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    want = ort.InferenceSession(export.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(fe.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(1.0, float(np.max(np.abs(want.astype(np.float64)))))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize(("axes", "scales"), [([2, 3], [2.0, 3.0]), ([-1], [0.5]), ([3, 1, 2], [2.0, 1.0, 1.5])])
def test_a_resize_over_opset_18_axes_is_widened_to_every_axis_and_stays_a_resize(axes, scales, tmp_path: Path) -> None:
    """Scales over `axes` become scales over every axis (1 elsewhere) and `axes` goes: the same Resize in the form
    IREE and Track A's resize kernel take, not per-axis maps; what it computes is onnxruntime's for the export."""
    inits = {"scales": np.array(scales, np.float32)}
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear", axes=axes)
    export = _model(node, ["N", 4, 6, 8], ["N", "c", "h", "w"], inits, opset=18)
    fe = frontend.prepare(BuildConfig(model=tmp_path / "form.onnx", targets=()), export)
    (resize,) = [n for n in fe.model.graph.node if n.op_type == "Resize"]
    assert not any(a.name == "axes" for a in resize.attribute) and not frontend_forms_left(fe.model)
    assert any("instead of opset 18's axes" in str(r) for r in fe.rewrites)
    x = np.random.default_rng(4).standard_normal((2, 4, 6, 8)).astype(np.float32)
    want = ort.InferenceSession(export.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(fe.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape and np.array_equal(got, want)


def frontend_forms_left(model: onnx.ModelProto) -> list[str]:
    """The per-axis map ops a Resize rewrite would leave."""
    return [n.op_type for n in model.graph.node if n.op_type in ("MatMul", "Gather")]
