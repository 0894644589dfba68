"""dualtrack.compiler.layout.sink_transposes: the rewritten graph computes the same outputs (onnxruntime,
fresh random inputs) with the activation transposes gone wherever the ops allow."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.layout import sink_transposes

RTOL, ATOL = 1e-5, 1e-5  # fp32: only the summation order of a 1x1 conv may change


def _model(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "main", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _run(m: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def _same(m: onnx.ModelProto, feed: dict[str, np.ndarray]) -> onnx.ModelProto:
    sunk = sink_transposes(m)
    onnx.checker.check_model(sunk, full_check=True)
    for a, b in zip(_run(m, feed), _run(sunk, feed), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)
    assert [i.name for i in sunk.graph.initializer] == [i.name for i in m.graph.initializer]
    return sunk


def _activation_transposes(m: onnx.ModelProto) -> list[str]:
    """The Transposes that move activations, not weights (or what nodes derive from weights)."""
    derived = {i.name for i in m.graph.initializer}
    for n in m.graph.node:
        if n.op_type == "Constant" or (n.input and set(n.input) <= derived | {""}):
            derived.update(n.output)
    return [n.name for n in m.graph.node if n.op_type == "Transpose" and not set(n.input) <= derived]


def _nhwc(name: str, elem=TensorProto.FLOAT, c: int = 8) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, ["N", 6, 5, c])


def test_head_softmax_argmax_run_per_pixel_with_one_transpose_for_probs():
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Transpose", ["x"], ["x_nchw"], name="in", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["x_nchw", "w", "b"], ["z"], name="head", kernel_shape=[1, 1]),
        helper.make_node("Softmax", ["z"], ["p"], name="softmax", axis=1),
        helper.make_node("Cast", ["p"], ["probs"], name="probs", to=TensorProto.DOUBLE),
        helper.make_node("ArgMax", ["p"], ["am"], name="argmax", axis=1, keepdims=0),
        helper.make_node("Cast", ["am"], ["mask"], name="mask", to=TensorProto.UINT8),
    ]
    inits = {"w": rng.standard_normal((3, 8, 1, 1)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    outs = [
        helper.make_tensor_value_info("probs", TensorProto.DOUBLE, ["N", 3, 6, 5]),
        helper.make_tensor_value_info("mask", TensorProto.UINT8, ["N", 6, 5]),
    ]
    m = _model(nodes, [_nhwc("x")], outs, inits)
    sunk = _same(m, {"x": rng.standard_normal((2, 6, 5, 8)).astype(np.float32)})
    ops = [n.op_type for n in sunk.graph.node]
    assert "Conv" not in ops and "MatMul" in ops
    assert len(_activation_transposes(sunk)) == 1  # probs back to NCHW, at the very end
    assert sunk.graph.node[-1].op_type == "Transpose" and sunk.graph.node[-1].output[0] == "probs"


def test_preprocessing_transposes_cancel_with_constants_permuted():
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Cast", ["image"], ["f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["f"], ["f_nchw"], name="nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Sub", ["f_nchw", "mean"], ["s"], name="sub"),
        helper.make_node("Mul", ["s", "inv_std"], ["m"], name="mul"),  # rank-3 constant [C, 1, 1]
        helper.make_node("Add", ["m", "col"], ["a"], name="add"),  # rank-1 constant [W]
        helper.make_node("Mul", ["a", "two"], ["t"], name="scalar"),  # rank-0 constant
        helper.make_node("Transpose", ["t"], ["y"], name="back", perm=[0, 2, 3, 1]),
    ]
    inits = {
        "mean": rng.standard_normal((1, 3, 1, 1)).astype(np.float32),
        "inv_std": rng.standard_normal((3, 1, 1)).astype(np.float32),
        "col": rng.standard_normal(5).astype(np.float32),
        "two": np.array(2.0, np.float32),
    }
    m = _model(
        nodes,
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["N", 6, 5, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 5, 3])],
        inits,
    )
    sunk = _same(m, {"image": rng.integers(0, 256, (2, 6, 5, 3), dtype=np.uint8)})
    assert _activation_transposes(sunk) == []


def test_an_op_without_a_rule_gets_the_nchw_tensor_once():
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Transpose", ["x"], ["x_nchw"], name="in", perm=[0, 3, 1, 2]),
        helper.make_node("Relu", ["x_nchw"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w3"], ["c1"], name="conv3", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["r"], ["mp"], name="pool", kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("ArgMax", ["r"], ["am"], name="argmax_h", axis=2, keepdims=0),  # not over C
    ]
    inits = {"w3": rng.standard_normal((4, 8, 3, 3)).astype(np.float32)}
    outs = [
        helper.make_tensor_value_info("c1", TensorProto.FLOAT, ["N", 4, 6, 5]),
        helper.make_tensor_value_info("mp", TensorProto.FLOAT, ["N", 8, 5, 4]),
        helper.make_tensor_value_info("am", TensorProto.INT64, ["N", 8, 5]),
    ]
    m = _model(nodes, [_nhwc("x")], outs, inits)
    sunk = _same(m, {"x": rng.standard_normal((2, 6, 5, 8)).astype(np.float32)})
    assert len(_activation_transposes(sunk)) == 1  # the Relu's output, put back once for three users


def test_keepdims_argmax_and_binary_of_two_nhwc_tensors_stay_nhwc():
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Transpose", ["x"], ["a"], name="ta", perm=[0, 3, 1, 2]),
        helper.make_node("Transpose", ["y"], ["b"], name="tb", perm=[0, 3, 1, 2]),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("LogSoftmax", ["s"], ["ls"], name="logsoftmax", axis=-3),
        helper.make_node("ArgMin", ["ls"], ["am"], name="argmin", axis=1, keepdims=1),
    ]
    outs = [
        helper.make_tensor_value_info("ls", TensorProto.FLOAT, ["N", 8, 6, 5]),
        helper.make_tensor_value_info("am", TensorProto.INT64, ["N", 1, 6, 5]),
    ]
    m = _model(nodes, [_nhwc("x"), _nhwc("y")], outs, {})
    feed = {k: rng.standard_normal((3, 6, 5, 8)).astype(np.float32) for k in ("x", "y")}
    sunk = _same(m, feed)
    assert len(_activation_transposes(sunk)) == 2  # each output once, at the end


def test_a_graph_without_nhwc_views_is_left_as_it_is():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 6, 5])],
        {},
    )
    assert sink_transposes(m).graph.node == m.graph.node


@pytest.mark.parametrize("nhwc", [True, False])
def test_partition_rewrites_track_b_segments_only(tiny_config, nhwc):
    """The tiny U-Net (decoder on Track B): with `track_b.nhwc` its pre-processing segment loses
    the NCHW round trip (the segment chain is checked against the whole model in
    test_partition.py); the decoder's inputs feed ConvTranspose and Concat, which need NCHW, so
    they keep their transposes; the Track A segment is never rewritten."""
    from dualtrack.compiler import partition
    from dualtrack.compiler.config import load_config

    cfg = load_config(tiny_config)
    cfg = cfg.model_copy(update={"track_b": cfg.track_b.model_copy(update={"nhwc": nhwc})})
    plan, seg_models = partition.plan_config(cfg)
    counts = {s.name: len(_activation_transposes(m)) for s, m in zip(plan.segments, seg_models, strict=True)}
    assert counts["seg1_A"] == 4  # one in, three out: as the plan says, whatever `nhwc` is
    assert counts["seg0_B"] == (0 if nhwc else 2)
    assert counts["seg2_B"] == 3


# --- widen_elementwise: an element-wise NHWC segment with few channels, viewed as wide rows -----


def _pre(h: int, w: int, c: int, const_shapes: dict[str, tuple[int, ...]], extra=()) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Cast", ["image"], ["f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["f"], ["f_nchw"], name="nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Sub", ["f_nchw", "mean"], ["s"], name="sub"),
        helper.make_node("Mul", ["s", "inv_std"], ["m"], name="mul"),
        *extra,
        helper.make_node("Cast", ["m"], ["m16"], name="to_fp16", to=TensorProto.FLOAT16),
        helper.make_node("Transpose", ["m16"], ["y"], name="back", perm=[0, 2, 3, 1]),
    ]
    inits = {k: (rng.random(v) + 0.5).astype(np.float32) for k, v in const_shapes.items()}
    return _model(
        nodes,
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["N", h, w, c])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", h, w, c])],
        inits,
    )


@pytest.mark.parametrize(
    ("h", "w", "row"),
    # rows: a divisor of H*W whose pixels x 3 are a multiple of 16 where one is (the longest), else the longest <= 512
    [(16, 64, 64), (22, 24, 528), (15, 63, 315), (33, 16, 528), (528, 528, 528), (600, 600, 720), (512, 512, 1024)],
)
def test_preprocessing_runs_on_wide_rows_with_tiled_channel_constants(h, w, row):
    from dualtrack.compiler.layout import row_pixels, widen_elementwise

    assert row_pixels(h * w) == row
    m = _pre(h, w, 3, {"mean": (1, 3, 1, 1), "inv_std": (3, 1, 1)})
    wide = widen_elementwise(sink_transposes(m))
    onnx.checker.check_model(wide, full_check=True)
    feed = {"image": np.random.default_rng().integers(0, 256, (3, h, w, 3), dtype=np.uint8)}
    (want,), (got,) = _run(m, feed), _run(wide, feed)
    np.testing.assert_array_equal(got, want)  # the same fp32 ops on the same values: bit for bit
    reshapes = [n for n in wide.graph.node if n.op_type == "Reshape"]
    assert len(reshapes) == 2 and not _activation_transposes(wide)
    rows = [n for n in wide.graph.node if n.op_type == "Concat" and n.output[0].endswith("__row")]
    assert len(rows) == 2  # mean and 1/std, each tiled to one row, in pieces the importer keeps inline
    pieces = [
        n for n in wide.graph.node if n.op_type == "Constant" and n.output[0].rsplit("__", 1)[0].endswith("__row")
    ]
    assert sum(numpy_helper.to_array(n.attribute[0].t).size for n in pieces) == 2 * 3 * row
    assert max(numpy_helper.to_array(n.attribute[0].t).size for n in pieces) < 100


@pytest.mark.parametrize(("h", "w"), [(528, 528), (600, 600), (720, 1280)])
def test_the_rows_view_compiles_to_vectorised_cuda_code(h: int, w: int, tmp_path) -> None:
    """IREE's CUDA config gives a thread 16 elements of a row of the view (layout._VECTOR's note): 528x528 got
    one element a thread with rows of 484 pixels, 127 us for 8 images on an H100 against 10 for 512x512."""
    import re
    import shutil
    import subprocess

    from dualtrack.compiler import iree_build
    from dualtrack.compiler.layout import widen_elementwise
    from dualtrack.compiler.partition import with_batch
    from dualtrack.settings import tool_path

    if shutil.which(tool_path("iree-compile")) is None:
        pytest.skip("no iree-compile here")
    wide = widen_elementwise(sink_transposes(_pre(h, w, 3, {"mean": (1, 3, 1, 1), "inv_std": (1, 3, 1, 1)})))
    mlir = iree_build.import_onnx(with_batch(wide, 8), tmp_path)
    flags = [*iree_build.cuda_target("sm_89").flags, f"--iree-hal-dump-executable-configurations-to={tmp_path}"]
    subprocess.run([tool_path("iree-compile"), str(mlir), *flags, "-o", str(tmp_path / "m.vmfb")], check=True)
    (config,) = [f.read_text() for f in tmp_path.glob("configured_*.mlir")]
    assert re.findall(r"thread = \[1, (\d+)\]", config) == ["16"], config[-2000:]


@pytest.mark.parametrize(
    ("h", "w", "c", "shapes", "softmax", "why"),
    [
        (16, 64, 3, {"mean": (1, 3, 1, 1), "inv_std": (1, 1, 1, 64)}, False, "a constant along W, not C"),
        (31, 31, 3, {"mean": (1, 3, 1, 1), "inv_std": (1, 3, 1, 1)}, False, "H*W's divisors too small for a row"),
        (16, 64, 16, {"mean": (1, 16, 1, 1), "inv_std": (1, 16, 1, 1)}, False, "too many channels to gain"),
        (16, 64, 3, {"mean": (1, 3, 1, 1), "inv_std": (1, 3, 1, 1)}, True, "an op that is not element-wise"),
    ],
)
def test_segments_that_are_not_plain_element_wise_keep_their_shape(h, w, c, shapes, softmax, why):
    from dualtrack.compiler.layout import widen_elementwise

    extra = (helper.make_node("Softmax", ["m"], ["sm"], name="softmax", axis=1),) if softmax else ()
    m = _pre(h, w, c, shapes, extra)
    if softmax:
        next(n for n in m.graph.node if n.name == "to_fp16").input[0] = "sm"
        onnx.checker.check_model(m, full_check=True)
    sunk = sink_transposes(m)
    assert widen_elementwise(sunk) is sunk, why
