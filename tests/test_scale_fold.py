"""compiler/scale_fold.py: ``Conv -> Mul/Div/Add/Sub(per-channel constant)`` becomes one Conv of scaled
weights and shifted bias.

Each graph (Conv geometries no zoo model has: grouped, strided, dilated, 1-D and 3-D, no bias, a
shared weight) is folded and run in onnxruntime beside the original on fresh random inputs: fp32 to
1e-5 of the output's scale, fp16 to the fp16 rounding of the output (2e-3 relative). Scales that
would push fp16 weights below the smallest normal, divisions by zero and scales that vary along H
or W are left as they are."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.scale_fold import fold_channel_affines

RNG = np.random.default_rng(7)


def _graph(
    nodes: list[onnx.NodeProto], x_shape: list, y_shape: list, inits: dict[str, np.ndarray], elem: int
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "scale",
        [helper.make_tensor_value_info("x", elem, x_shape)],
        [helper.make_tensor_value_info("y", elem, y_shape)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x})[0]


def _conv_scale(
    dtype: type,
    c: int,
    k: int,
    window: tuple[int, ...],
    scale_shape: tuple[int, ...],
    op: str = "Mul",
    bias: bool = True,
    scale: np.ndarray | None = None,
    **attrs: object,
) -> tuple[onnx.ModelProto, np.ndarray]:
    """x -> Conv -> Mul/Div(s) -> Relu -> y, with input of 2 images and spatial size 11 along each axis."""
    groups = int(attrs.get("group", 1))
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits = {"w": (RNG.standard_normal((k, c // groups, *window)) * 0.3).astype(dtype)}
    if bias:
        inits["b"] = RNG.standard_normal(k).astype(dtype)
    inits["s"] = (scale if scale is not None else RNG.uniform(-2, 2, scale_shape)).astype(dtype)
    conv = helper.make_node("Conv", ["x", "w", *(["b"] if bias else [])], ["t"], name="conv", **attrs)
    # the constant on either side of a Mul or Add
    ins = ["t", "s"] if op in ("Div", "Sub") or len(scale_shape) % 2 else ["s", "t"]
    nodes = [conv, helper.make_node(op, ins, ["u"], name="scale"), helper.make_node("Relu", ["u"], ["y"])]
    rank = len(window) + 2
    model = _graph(nodes, [2, c] + [11] * (rank - 2), [2, k] + ["H"] * (rank - 2), inits, elem)
    return model, RNG.standard_normal((2, c) + (11,) * (rank - 2)).astype(dtype)


CASES = {
    "2d grouped strided, (1,K,1,1)": dict(
        c=12, k=18, window=(3, 3), scale_shape=(1, 18, 1, 1), group=3, strides=[2, 2]
    ),
    "2d dilated 5x3, (K,1,1), Div": dict(
        c=5, k=7, window=(5, 3), scale_shape=(7, 1, 1), op="Div", dilations=[2, 1], pads=[4, 1, 4, 1]
    ),
    "2d 1x1 no bias, one value": dict(c=9, k=13, window=(1, 1), scale_shape=(1,), bias=False),
    "2d depthwise, scalar": dict(c=8, k=8, window=(3, 3), scale_shape=(), group=8, pads=[1, 1, 1, 1]),
    "1d, (1,K,1)": dict(c=6, k=10, window=(4,), scale_shape=(1, 10, 1)),
    "3d, (K,1,1,1)": dict(c=3, k=5, window=(2, 3, 3), scale_shape=(5, 1, 1, 1)),
    "2d Add, no bias": dict(c=6, k=4, window=(3, 3), scale_shape=(1, 4, 1, 1), op="Add", bias=False),
    "2d Sub, (K,1,1)": dict(c=6, k=4, window=(2, 2), scale_shape=(4, 1, 1), op="Sub", strides=[2, 2]),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_folded_conv_computes_what_the_export_does(case: str, dtype: type) -> None:
    model, x = _conv_scale(dtype, **CASES[case])  # type: ignore[arg-type]
    folded, names, refused = fold_channel_affines(model)
    assert (names, refused) == (["scale"], [])
    assert [n.op_type for n in folded.graph.node] == ["Conv", "Relu"]
    onnx.checker.check_model(folded, full_check=True)
    want, got = _run(model, x).astype(np.float32), _run(folded, x).astype(np.float32)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def test_an_unfolded_affine_folds_as_a_chain() -> None:
    """torchvision's FrozenBatchNorm2d after a Conv: Mul(scale) then Add(shift), both folded; then a
    Div after them too."""
    w = (RNG.standard_normal((6, 5, 3, 3)) * 0.3).astype(np.float16)
    inits = {"w": w, "s": RNG.uniform(0.5, 2, (1, 6, 1, 1)).astype(np.float16)}
    inits |= {"h": RNG.standard_normal((1, 6, 1, 1)).astype(np.float16), "d": np.array([3.0], np.float16)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["t"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["t", "s"], ["u"], name="bn_scale"),
        helper.make_node("Add", ["h", "u"], ["v"], name="bn_shift"),
        helper.make_node("Div", ["v", "d"], ["z"], name="div"),
        helper.make_node("Relu", ["z"], ["y"]),
    ]
    model = _graph(nodes, [2, 5, 10, 10], [2, 6, 10, 10], inits, TensorProto.FLOAT16)
    folded, names, refused = fold_channel_affines(model)
    assert (names, refused) == (["bn_scale", "bn_shift", "div"], [])
    assert [n.op_type for n in folded.graph.node] == ["Conv", "Relu"]
    x = RNG.standard_normal((2, 5, 10, 10)).astype(np.float16)
    want, got = _run(model, x).astype(np.float32), _run(folded, x).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()))


def test_a_shared_weight_is_copied_not_scaled_in_place() -> None:
    """Two Convs read one weight; only the one before the Mul gets the scaled copy."""
    w = (RNG.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    s = RNG.uniform(0.5, 2, (1, 4, 1, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["t"], name="a", pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["t", "s"], ["u"], name="scale"),
        helper.make_node("Conv", ["x", "w"], ["v"], name="b", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["u", "v"], ["y"]),
    ]
    model = _graph(nodes, [1, 3, 9, 9], [1, 4, 9, 9], {"w": w, "s": s}, TensorProto.FLOAT)
    folded, names, _ = fold_channel_affines(model)
    assert names == ["scale"]
    x = RNG.standard_normal((1, 3, 9, 9)).astype(np.float32)
    np.testing.assert_allclose(_run(folded, x), _run(model, x), rtol=1e-5, atol=1e-5)
    b = next(n for n in folded.graph.node if n.name == "b")
    assert b.input[1] == "w"


@pytest.mark.parametrize(
    "why, kwargs",
    [
        # timm's gamma at its initial 1e-6 times fp16 weights of ~0.3: below fp16's smallest normal
        ("would leave float16's range", dict(scale=np.full((1, 6, 1, 1), 1e-6))),
        ("divides by zero", dict(op="Div", scale=np.array([[[[1.0]], [[0.0]], [[2.0]], [[1.0]], [[1.0]], [[3.0]]]]))),
    ],
    ids=["tiny gamma", "div by zero"],
)
def test_a_scale_the_weights_cannot_hold_is_left_alone(why: str, kwargs: dict) -> None:
    model, _ = _conv_scale(np.float16, 4, 6, (3, 3), (1, 6, 1, 1), **kwargs)
    folded, names, refused = fold_channel_affines(model)
    assert names == [] and len(refused) == 1 and why in refused[0], refused
    assert [n.op_type for n in folded.graph.node] == ["Conv", kwargs.get("op", "Mul"), "Relu"]


def test_weights_with_a_few_subnormals_of_their_own_still_fold() -> None:
    """ConvNeXt's last MLP conv as exported: fp16 weights of a 384-wide reduction (some subnormal
    already) and layer scales in [0.1, 0.5]: every channel holds, so the Mul folds."""
    w = (RNG.standard_normal((96, 384, 1, 1)) * 0.05).astype(np.float16)
    assert (np.abs(w[w != 0]) < np.finfo(np.float16).tiny).any()
    model, x = _conv_scale(np.float16, 384, 96, (1, 1), (1, 96, 1, 1), scale=RNG.uniform(0.1, 0.5, (1, 96, 1, 1)))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    folded, names, refused = fold_channel_affines(model)
    assert (names, refused) == (["scale"], [])
    want, got = _run(model, x).astype(np.float32), _run(folded, x).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()))


def test_only_a_per_channel_constant_read_by_the_mul_alone_is_folded() -> None:
    """A scale that varies over W, a Conv output read twice, and a constant divided by (or less) the
    conv stay."""
    over_w, _ = _conv_scale(np.float32, 4, 6, (3, 3), (1, 6, 1, 9))
    assert fold_channel_affines(over_w)[1] == []
    w = RNG.standard_normal((4, 3, 1, 1)).astype(np.float32)
    s = RNG.uniform(0.5, 2, (1, 4, 1, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["t"], name="a"),
        helper.make_node("Mul", ["t", "s"], ["u"], name="scale"),
        helper.make_node("Add", ["u", "t"], ["y"]),
    ]
    twice = _graph(nodes, [1, 3, 5, 5], [1, 4, 5, 5], {"w": w, "s": s}, TensorProto.FLOAT)
    assert fold_channel_affines(twice)[1] == []
    nodes = [helper.make_node("Conv", ["x", "w"], ["t"], name="a"), helper.make_node("Div", ["s", "t"], ["y"])]
    rdiv = _graph(nodes, [1, 3, 5, 5], [1, 4, 5, 5], {"w": w, "s": s}, TensorProto.FLOAT)
    assert fold_channel_affines(rdiv)[1] == []
    nodes = [helper.make_node("Conv", ["x", "w"], ["t"], name="a"), helper.make_node("Sub", ["s", "t"], ["y"])]
    rsub = _graph(nodes, [1, 3, 5, 5], [1, 4, 5, 5], {"w": w, "s": s}, TensorProto.FLOAT)
    assert fold_channel_affines(rsub)[1] == []
