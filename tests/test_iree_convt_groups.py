"""A grouped ConvTranspose reaches IREE a group at a time (compiler/iree_build.split_grouped_convtransposes):
the split model computes what the grouped one computes (onnxruntime, fp32) over group counts, strides, pads and
output paddings no zoo model has, depthwise (MedNeXt's upsampling) included; its weights keep their names (IREE's
are externalized); and a Track A segment holding one builds for the CPU and verifies (IREE 3.13 cannot compile the
grouped form)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.build import build
from dualtrack.compiler.iree_build import split_grouped_convtransposes


def convt_model(c: int, k: int, groups: int, kernel: int, stride: int, pads: list[int], out_pad: list[int],
                bias: bool) -> onnx.ModelProto:  # fmt: skip
    rng = np.random.default_rng(groups * 7 + kernel)
    inits = [numpy_helper.from_array(rng.standard_normal((c, k // groups, kernel, kernel)).astype(np.float32), "w")]
    ins = ["r", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "b"))
        ins.append("b")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="pre"),
        helper.make_node(
            "ConvTranspose",
            ins,
            ["t"],
            name="up",
            group=groups,
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=pads,
            output_padding=out_pad,
        ),
        helper.make_node("Relu", ["t"], ["y"], name="post"),
    ]
    graph = helper.make_graph(
        nodes, "convt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", k, "h", "w"])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]


@pytest.mark.parametrize(
    ("c", "k", "groups", "kernel", "stride", "pads", "out_pad", "bias"),
    [
        (6, 4, 2, 3, 2, [1, 1, 1, 1], [1, 1], True),
        (12, 12, 12, 7, 2, [3, 3, 3, 3], [0, 0], False),  # depthwise, its output 2H - 1 (MedNeXt's)
        (9, 6, 3, 4, 3, [0, 2, 1, 0], [2, 0], True),
    ],
)
def test_a_grouped_convtranspose_is_computed_a_group_at_a_time(c, k, groups, kernel, stride, pads, out_pad, bias):
    model = convt_model(c, k, groups, kernel, stride, pads, out_pad, bias)
    split = split_grouped_convtransposes(model)
    convts = [n for n in split.graph.node if n.op_type == "ConvTranspose"]
    assert len(convts) == groups and all(not any(a.name == "group" for a in n.attribute) for n in convts)
    assert {i.name for i in split.graph.initializer} == {i.name for i in model.graph.initializer}
    onnx.checker.check_model(split)
    x = np.random.default_rng(1).standard_normal((2, c, 5, 6)).astype(np.float32)
    want, got = run(model, x), run(split, x)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)  # the same sums in another order


def test_an_ungrouped_model_is_passed_through() -> None:
    model = convt_model(4, 4, 1, 3, 2, [1, 1, 1, 1], [1, 1], True)
    assert split_grouped_convtransposes(model) is model


def test_a_track_a_segment_with_a_depthwise_convtranspose_builds_for_the_cpu_and_verifies(tmp_path: Path) -> None:
    onnx.save(convt_model(16, 16, 16, 7, 2, [3, 3, 3, 3], [1, 1], True), str(tmp_path / "m.onnx"))
    (tmp_path / "m.yaml").write_text("model: m.onnx\nprecision: fp32\nbatch_sizes: [1, 2]\n")
    result = build(tmp_path / "m.yaml", tmp_path / "bundle", cpu_only=True)
    assert result.verification is not None and result.verification["passed"]
    assert any(s.track == "A" and any(c.op == "convt" for c in s.calls) for s in result.plan.segments)
