"""The fp16 verification tolerance is judged on the network, and a failed check names the key that sets it.

A correct fp16 build of a deep network can miss a fixed rel-L2 by a hair; the default fp16 tolerance is
therefore what the same model computed with fp16 storage reaches against fp32, times a factor, within
a floor (the fixed default) and a ceiling (compiler/verify.py). A failure's message gives the config key
with values that would pass, except where the outputs are not finite.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import verify
from dualtrack.contract.checks import DEFAULT_TOLERANCES, Check, Report
from dualtrack.contract.plan import Plan, TensorSpec
from dualtrack.errors import VerificationError

C, H, W = 8, 12, 12


def conv_chain(depth: int, gain: float, seed: int = 0, offset: float = 0.0) -> onnx.ModelProto:
    """x (1, C, H, W) fp16 -> ``depth`` x (Conv 3x3 + Tanh) -> (+ offset - offset) -> y: ``gain``
    scales the weights; the offset's round trip costs fp16 the bits its magnitude takes (at 100,
    a spacing of 1/16: a rel-L2 error of about 0.02 on O(1) values, twice that past the default)."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(depth):
        w = (gain * rng.standard_normal((C, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float16)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Tanh", [f"c{i}"], [f"t{i}"]))
        x = f"t{i}"
    if offset:
        inits.append(numpy_helper.from_array(np.array(offset, np.float16), "offset"))
        nodes.append(helper.make_node("Add", [x, "offset"], ["up"]))
        nodes.append(helper.make_node("Sub", ["up", "offset"], ["down"]))
        x = "down"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, C, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, C, H, W])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def plan_of(precision: str) -> Plan:
    spec = TensorSpec("x", (1, C, H, W), "float16" if precision == "fp16" else "float32")
    return Plan((spec,), (TensorSpec("y", (1, C, H, W), spec.dtype),), (), precision, (1,))


def test_fp16_tolerance_is_what_fp16_itself_reaches_times_the_factor() -> None:
    model = conv_chain(depth=4, gain=3.0, offset=100.0)
    tol, note = verify.judged_tolerance(model, plan_of("fp16"), seed=5)
    # The floor measured independently: fp16 storage against the fp32 upcast, same input.
    x = verify.random_input(plan_of("fp16").inputs[0], 1, np.random.default_rng(5))
    ref = verify.run_ort(verify.ort_session(verify.upcast(model)), {"x": x})["y"]
    got = verify.run_ort(verify.ort_session(verify.fp16_storage(verify.upcast(model))), {"x": x})["y"]
    floor = verify.compare("y", ref, got, DEFAULT_TOLERANCES["fp16"])
    want = min(max(DEFAULT_TOLERANCES["fp16"].rel_l2, verify.FP16_FLOOR_FACTOR * floor.rel_l2), 0.08)
    assert DEFAULT_TOLERANCES["fp16"].rel_l2 < want < verify.FP16_CEILING.rel_l2  # the case this is about
    assert tol.rel_l2 == pytest.approx(want, rel=1e-9)
    assert tol.mismatch == DEFAULT_TOLERANCES["fp16"].mismatch
    assert "judged on this network" in note and "`verify.tolerance`" in note


def test_the_judged_tolerance_never_passes_the_ceiling() -> None:
    tol, _ = verify.judged_tolerance(conv_chain(depth=2, gain=3.0, offset=2000.0), plan_of("fp16"), seed=2)
    assert (tol.rel_l2, tol.max_abs) == (verify.FP16_CEILING.rel_l2, verify.FP16_CEILING.max_abs)


def test_a_shallow_fp16_network_keeps_the_fixed_default() -> None:
    tol, _ = verify.judged_tolerance(conv_chain(depth=1, gain=0.5), plan_of("fp16"), seed=1)
    assert tol == DEFAULT_TOLERANCES["fp16"]


def test_fp32_is_never_judged() -> None:
    assert verify.judged_tolerance(conv_chain(depth=2, gain=1.0), plan_of("fp32"), seed=1) == (
        DEFAULT_TOLERANCES["fp32"],
        "",
    )


def test_a_failed_check_names_the_config_key_with_values_that_pass() -> None:
    bad = Check("plan b1 probs #0", rel_l2=0.0216, max_abs=0.01, mismatch=0.0, nonfinite=0, passed=False)
    report = Report("cpu", "fp16", DEFAULT_TOLERANCES["fp16"], [bad], seed=1)
    with pytest.raises(VerificationError) as e:
        report.raise_if_failed()
    msg = str(e.value)
    assert "set `verify: {tolerance: {rel_l2: 0.027, max_abs: 0.15, mismatch: 0.005}}` in the config" in msg
    assert msg.endswith("or build with `precision: fp32`")


def test_non_finite_outputs_are_never_excused_by_a_tolerance() -> None:
    bad = Check("plan b1 logits #0", float("inf"), float("inf"), 0.0, nonfinite=3, passed=False)
    with pytest.raises(VerificationError, match=r"non-finite outputs are a wrong result: no tolerance accepts them$"):
        Report("cpu", "fp16", DEFAULT_TOLERANCES["fp16"], [bad], seed=1).raise_if_failed()


def fp32_chain(depth: int, gain: float) -> onnx.ModelProto:
    """conv_chain with fp32 weights (drawn afresh: not fp16 values) and tensors: an export before the
    fp16 conversion."""
    model = conv_chain(depth, gain)
    rng = np.random.default_rng(11)
    for init in model.graph.initializer:
        w = gain * rng.standard_normal(init.dims) / np.sqrt(9 * C)
        init.CopyFrom(numpy_helper.from_array(w.astype(np.float32), init.name))
    for vi in [*model.graph.input, *model.graph.output]:
        vi.type.tensor_type.elem_type = TensorProto.FLOAT
    return model


def test_the_front_end_check_is_judged_on_the_exports_own_fp16_weights() -> None:
    """A deep network amplifies fp16's rounding of its weights alone past 2e-2 (a random ResNeXt-50 or
    MobileNetV2 export); the front end's check is then held to twice what rounding the export's weights
    does, within the floor and the ceiling. fp32 builds keep the fixed default."""
    from types import SimpleNamespace

    chaotic = SimpleNamespace(precision="fp16", original=fp32_chain(depth=24, gain=3.0))
    tol, note = verify.frontend_tolerance(chaotic, seed=3)
    x = verify.random_input(plan_of("fp32").inputs[0], 1, np.random.default_rng(3))
    ref = verify.run_ort(verify.ort_session(chaotic.original), {"x": x})["y"]
    got = verify.run_ort(verify.ort_session(verify.rounded_weights(chaotic.original)), {"x": x})["y"]
    floor = verify.compare("y", ref, got, DEFAULT_TOLERANCES["fp16"]).rel_l2
    assert floor > 0 and tol.rel_l2 == pytest.approx(min(max(0.02, 2 * floor), verify.FP16_CEILING.rel_l2))
    assert "the export with its weights rounded to fp16" in note
    calm = SimpleNamespace(precision="fp16", original=fp32_chain(depth=1, gain=0.5))
    assert verify.frontend_tolerance(calm, seed=3)[0] == DEFAULT_TOLERANCES["fp16"]
    assert verify.frontend_tolerance(SimpleNamespace(precision="fp32", original=None)) == (
        DEFAULT_TOLERANCES["fp32"],
        "",
    )


def test_the_judged_tolerance_covers_every_segment_boundary_a_check_compares() -> None:
    """A boundary tensor can carry more of fp16's relative error than the outputs (a difference of close
    values, later offset again): the floor is taken over the segments' outputs too."""
    from dualtrack.contract.plan import Segment

    model = conv_chain(depth=2, gain=1.0, offset=100.0)  # ... -> down = (t + 100) - 100 -> y
    bump = numpy_helper.from_array(np.array(100.0, np.float16), "bump")
    model.graph.initializer.append(bump)
    model.graph.node[-1].CopyFrom(helper.make_node("Add", ["down", "bump"], ["y"]))  # y ~ 100: fp16 barely rounds it
    alone = plan_of("fp16")
    spec = TensorSpec("down", (1, C, H, W), "float16")
    seg = Segment(0, "B", ("n",), alone.inputs, (spec,), "segments/seg0_B.onnx", "k")
    with_boundary = Plan(alone.inputs, alone.outputs, (seg,), "fp16", (1,))
    tol_out, _ = verify.judged_tolerance(model, alone, seed=4)
    tol_all, _ = verify.judged_tolerance(model, with_boundary, seed=4)
    assert tol_out.rel_l2 == DEFAULT_TOLERANCES["fp16"].rel_l2 < tol_all.rel_l2


def test_a_handful_of_values_is_judged_by_the_scaled_max_abs_alone() -> None:
    from dualtrack.contract.checks import REL_L2_MIN_ELEMENTS, compare

    tol = DEFAULT_TOLERANCES["fp16"]
    one = compare("pooled", np.array([[[[0.5]]]]), np.array([[[[0.515]]]]), tol)  # 3% off, 0.015 absolute
    assert one.passed and "rel_l2 not judged" in one.note
    far = compare("pooled", np.array([[[[0.5]]]]), np.array([[[[0.9]]]]), tol)  # 0.4 absolute: past max_abs
    assert not far.passed
    many = np.full(REL_L2_MIN_ELEMENTS, 0.5)
    assert not compare("map", many, many * 1.03, tol).passed  # enough values: rel_l2 decides again
