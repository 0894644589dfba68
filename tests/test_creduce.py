"""The channel reduction on Track A (kernels.creduce, handwritten_ptx/creduce_nhwc.cu; lowered by
compiler/lower_mobile.py): each Reduce op of REDUCE_OPS (sum, mean, max, min, L1, L2, sum of squares) over
axis 1 (keepdims) of an image, CBAM's spatial-attention pools, which ran on IREE with a track switch on
each side.

- the numpy reference against onnxruntime's Reduce ops, over channel counts and pictures no zoo model
  has, fp32 and fp16 (fp16: the reference sums in fp32 and rounds once, onnxruntime in fp16, so rel-L2
  2e-3; max and min exact);
- the partition: a CBAM block as torch writes it (a conv, the [max, mean] channel pools concatenated, a
  7x7 conv, a sigmoid gate) plus the table's other ops (ReduceSum's axes as an input), fp16, built for the CPU:
  one Track A segment holds every reduction, and the build verifies (the kernel-call list through the
  kernels' numpy semantics and the whole plan against onnxruntime); other axes and keepdims 0 stay on
  Track B with their reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.cli import main
from dualtrack.compiler.verify import ort_session, run_ort
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import REDUCE_OPS

CREDUCE = kernels.KERNELS["creduce"]


def reduce_model(op: str, c: int, h: int, w: int, elem: int, axes_input: bool) -> onnx.ModelProto:
    inits = []
    attrs: dict = {"keepdims": 1}
    inputs = ["x"]
    if axes_input:
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes"))
        inputs.append("axes")
    else:
        attrs["axes"] = [1]
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attrs)],
        "r",
        [helper.make_tensor_value_info("x", elem, [2, c, h, w])],
        [helper.make_tensor_value_info("y", elem, [2, 1, h, w])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18 if axes_input else 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", list(REDUCE_OPS))
@pytest.mark.parametrize(("c", "h", "w"), [(1, 5, 3), (3, 17, 9), (5, 8, 8), (40, 7, 11), (264, 3, 4)])
def test_the_reference_is_onnx_reduce_over_channels(dtype: str, op: str, c: int, h: int, w: int) -> None:
    elem = TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16
    x = (2 * np.random.default_rng().standard_normal((2, c, h, w)) + 0.5).astype(dtype)
    want = run_ort(ort_session(reduce_model(op, c, h, w, elem, axes_input=op != "ReduceMean")), {"x": x})["y"]
    got = CREDUCE.reference(x.transpose(0, 2, 3, 1), op=REDUCE_OPS[op]).transpose(0, 3, 1, 2)
    assert got.shape == want.shape and got.dtype == want.dtype
    if op in ("ReduceMax", "ReduceMin"):
        np.testing.assert_array_equal(got, want)
        return
    g, t = got.astype(np.float64), want.astype(np.float64)
    assert np.linalg.norm(g - t) <= (2e-3 if dtype == "float16" else 1e-6) * np.linalg.norm(t)


def test_max_and_min_propagate_nan() -> None:
    x = np.zeros((1, 2, 2, 4), np.float32)
    x[0, 1, 0, 2] = np.nan
    for op in ("ReduceMax", "ReduceMin"):
        y = CREDUCE.reference(x, op=REDUCE_OPS[op])
        assert np.isnan(y[0, 1, 0, 0]) and not np.isnan(np.delete(y.ravel(), 2)).any()


def cbam_model() -> onnx.ModelProto:
    """image (1, 3, 20, 18) -> conv 8 -> relu -> [every Reduce op of the table over C] ->
    Concat -> 7x7 conv -> sigmoid -> gate -> 1x1 conv 2 classes; and a ReduceMean over axes [1, 2]
    (no kernel: stays on Track B) feeding nothing the output needs but its own output."""
    rng = np.random.default_rng(7)
    w = lambda *s: numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32))  # noqa: E731
    inits = [
        *(w(*s) for s in ((8, 3, 3, 3), (1, 7, 7, 7), (2, 8, 1, 1))),
        numpy_helper.from_array(np.array([1], np.int64), "axes_c"),
    ]
    for t, name in zip(inits[:3], ("w1", "w2", "w3"), strict=True):
        t.name = name
    nodes = [
        helper.make_node("Conv", ["image", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("ReduceMax", ["r1"], ["mx"], axes=[1], keepdims=1),
        helper.make_node("ReduceMean", ["r1"], ["mn"], axes=[1], keepdims=1),
        helper.make_node("ReduceMin", ["r1"], ["mi"], axes=[1], keepdims=1),
        helper.make_node("ReduceSum", ["r1", "axes_c"], ["sm"], keepdims=1, noop_with_empty_axes=1),
        helper.make_node("ReduceL1", ["r1"], ["l1"], axes=[1], keepdims=1),
        helper.make_node("ReduceL2", ["r1"], ["l2"], axes=[1], keepdims=1),
        helper.make_node("ReduceSumSquare", ["r1"], ["ss"], axes=[1], keepdims=1),
        helper.make_node("Concat", ["mx", "mn", "mi", "sm", "l1", "l2", "ss"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "w2"], ["c2"], pads=[3, 3, 3, 3]),
        helper.make_node("Sigmoid", ["c2"], ["g"]),
        helper.make_node("Mul", ["r1", "g"], ["gated"]),
        helper.make_node("Conv", ["gated", "w3"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cbam",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 20, 18])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2, 20, 18])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


CONFIG = """\
model: cbam.onnx
precision: fp16
batch_sizes: [1, 3]
targets: [sm_90a]
preprocess: {layout: NCHW, color: RGB, scale: 255, mean: [0.5], std: [0.25]}
postprocess: {activation: softmax}
verify: {samples: 1, seed: 3}
"""


def test_a_cbam_block_keeps_its_channel_pools_on_track_a(tmp_path: Path) -> None:
    onnx.save(cbam_model(), str(tmp_path / "cbam.onnx"))
    (tmp_path / "cbam.yaml").write_text(CONFIG)
    result = CliRunner().invoke(main, ["build", str(tmp_path / "cbam.yaml"), "-o", str(tmp_path / "b"), "--cpu-only"])
    assert result.exit_code == 0, result.output
    assert "verification passed" in result.output
    plan = Bundle.open(tmp_path / "b").manifest.plan
    calls = [c for seg in plan.segments if seg.track == "A" for c in seg.calls if c.op == "creduce"]
    assert sorted(c.attr("op") for c in calls) == sorted(REDUCE_OPS.values())
    seg_of = {c.nodes[-1]: seg.name for seg in plan.segments if seg.track == "A" for c in seg.calls}
    assert len({seg_of[c.nodes[-1]] for c in calls}) == 1, "the pools and their convs in one Track A segment"


def test_other_axes_and_keepdims_0_are_refused_with_the_reason() -> None:
    from dualtrack.compiler import lower_mobile
    from dualtrack.compiler.partition import infer_specs

    for node, why in (
        (helper.make_node("ReduceMax", ["x"], ["y"], axes=[1, 2], keepdims=1), "axes [1, 2]"),
        (helper.make_node("ReduceMin", ["x"], ["y"], axes=[1], keepdims=0), "keepdims=0"),
        (helper.make_node("ReduceSum", ["x"], ["y"], keepdims=1), "axes: all"),
    ):
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 6])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        facts = lower_mobile.Facts(model, infer_specs(model))
        assert why in (lower_mobile.supports(node, facts) or "")
