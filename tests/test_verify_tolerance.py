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


def _fp16_storage_errors(model, seed: int) -> list[float]:
    """The floor measured independently: fp16 storage against the fp32 upcast, relative L2, on each of
    the reference cases' images (the seed's)."""
    rng = np.random.default_rng(seed)
    errs = []
    for _ in range(verify.CASE_IMAGES):
        x = verify.random_input(plan_of("fp16").inputs[0], 1, rng)
        ref = verify.run_ort(verify.ort_session(verify.upcast(model)), {"x": x})["y"]
        got = verify.run_ort(verify.ort_session(verify.fp16_storage(verify.upcast(model))), {"x": x})["y"]
        errs.append(verify.compare("y", ref, got, DEFAULT_TOLERANCES["fp16"]).rel_l2)
    return errs


def test_fp16_tolerance_is_what_fp16_itself_reaches_times_the_factor() -> None:
    model = conv_chain(depth=4, gain=3.0, offset=100.0)
    tol, note = verify.judged_tolerance(model, plan_of("fp16"), seed=5)
    # The floor measured independently: fp16 storage against the fp32 upcast, on the reference cases'
    # images (the seed's), the worst of them.
    errs = _fp16_storage_errors(model, seed=5)
    want = min(max(DEFAULT_TOLERANCES["fp16"].rel_l2, verify.FP16_FLOOR_FACTOR * max(errs)), 0.08)
    assert DEFAULT_TOLERANCES["fp16"].rel_l2 < want < verify.FP16_CEILING.rel_l2  # the case this is about
    assert tol.rel_l2 == pytest.approx(want, rel=1e-9)
    assert tol.mismatch == DEFAULT_TOLERANCES["fp16"].mismatch
    assert "judged on this network" in note and "`verify.tolerance`" in note


def test_the_judged_tolerance_never_passes_the_ceiling() -> None:
    tol, _ = verify.judged_tolerance(conv_chain(depth=2, gain=3.0, offset=2000.0), plan_of("fp16"), seed=2)
    assert (tol.rel_l2, tol.max_abs) == (verify.FP16_CEILING.rel_l2, verify.FP16_CEILING.max_abs)


def test_without_a_ceiling_the_judged_tolerance_is_the_factor_times_the_floor() -> None:
    """bench/reweight.py's seal: a drawn network past the ceiling is held to twice its own fp16 floor."""
    model = conv_chain(depth=2, gain=3.0, offset=2000.0)
    capped, _ = verify.judged_tolerance(model, plan_of("fp16"), seed=2)
    free, note = verify.judged_tolerance(model, plan_of("fp16"), seed=2, ceiling=None)
    assert free.rel_l2 > capped.rel_l2 == verify.FP16_CEILING.rel_l2 and free.max_abs >= capped.max_abs
    errs = _fp16_storage_errors(model, seed=2)
    assert free.rel_l2 == pytest.approx(verify.FP16_FLOOR_FACTOR * max(errs), rel=1e-9)
    assert "uncapped" in note


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
    # fp16: the fix named is fp32 (the range fp16 lacks); fp32: nothing to name, it is a wrong result.
    fp16 = r"no tolerance accepts them; the fp16 build overflows on these inputs: set `precision: fp32`$"
    with pytest.raises(VerificationError, match=fp16):
        Report("cpu", "fp16", DEFAULT_TOLERANCES["fp16"], [bad], seed=1).raise_if_failed()
    with pytest.raises(VerificationError, match=r"non-finite outputs are a wrong result: no tolerance accepts them$"):
        Report("cpu", "fp32", DEFAULT_TOLERANCES["fp32"], [bad], seed=1).raise_if_failed()


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


def fp16_body(model: onnx.ModelProto, scale: float = 1.0) -> onnx.ModelProto:
    """``model``'s graph with its weights in fp16 (times ``scale``) and fp16 tensors: what the front end
    hands on for an fp16 build, its rewrites aside."""
    body = onnx.ModelProto()
    body.CopyFrom(model)
    for init in body.graph.initializer:
        w = numpy_helper.to_array(init) * scale
        init.CopyFrom(numpy_helper.from_array(w.astype(np.float16), init.name))
    for vi in [*body.graph.input, *body.graph.output]:
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
        vi.type.tensor_type.shape.dim[0].dim_param = "N"  # the batch the front end freed
    return body


def test_the_front_end_check_is_judged_on_the_exports_own_fp16_weights_on_the_same_inputs() -> None:
    """A deep network amplifies fp16's rounding of its weights alone past 2e-2 (a random ResNeXt-50, MAnet
    or MobileNetV2 export), by how much depending on the input. A front-end check that misses the default
    is held again to twice what rounding the export's weights does on that check's own inputs: the
    processed model with the rounded weights passes; one whose weights are off by 1% more does not.
    fp32 builds and a tolerance the config sets are never loosened."""
    from types import SimpleNamespace

    export = fp32_chain(depth=14, gain=3.0)
    fe = SimpleNamespace(precision="fp16", original=export, upgraded=None, export_batch=1, body=fp16_body(export))
    checks = verify.check_frontend(fe, (1, 3), seed=3)
    assert len(checks) == 2 and all(c.passed for c in checks)
    assert any(c.rel_l2 > DEFAULT_TOLERANCES["fp16"].rel_l2 for c in checks)  # the default alone would fail
    assert any("weights rounded to fp16 reaches on these inputs" in c.note for c in checks)

    wrong = SimpleNamespace(**{**vars(fe), "body": fp16_body(export, scale=1.01)})
    assert not any(c.passed for c in verify.check_frontend(wrong, (1, 3), seed=3))
    # A tolerance the config sets is the one the check holds to.
    assert not any(c.passed for c in verify.check_frontend(fe, (1,), DEFAULT_TOLERANCES["fp16"], seed=3))
    calm_export = fp32_chain(depth=1, gain=0.5)
    calm = SimpleNamespace(**{**vars(fe), "original": calm_export, "body": fp16_body(calm_export)})
    (check,) = verify.check_frontend(calm, (1,), seed=3)
    assert check.passed and "held to" not in check.note


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


def test_a_missed_fp16_check_is_held_again_to_fp16_on_its_own_inputs_and_a_wrong_result_still_fails() -> None:
    """verify_engine's segment checks (and, for a judged tolerance, its whole-plan checks): an output that
    misses the tolerance by fp16's rounding on these inputs passes at twice that, with a note; one off by
    more than fp16 explains fails; an fp32 plan or a config's tolerance on the whole plan is never re-judged."""
    model = verify.upcast(conv_chain(depth=4, gain=3.0, offset=160.0))
    x = verify.random_input(plan_of("fp32").inputs[0], 1, np.random.default_rng(7))
    ref = verify.run_ort(verify.ort_session(model), {"x": x})
    fp16 = verify.run_ort(verify.ort_session(verify.fp16_storage(model)), {"x": x})
    tight = DEFAULT_TOLERANCES["fp16"]
    assert not verify.compare("y", ref["y"], fp16["y"], tight).passed  # the case this is about
    (ok,) = verify._held_to_fp16("fp16", model, {"x": x}, ref, {"seg": fp16}, "#0", tight)
    assert ok.passed and "fp16 storage on these inputs judged" in ok.note
    off = {"y": fp16["y"] + 0.2 * np.abs(ref["y"]).max() * np.sign(ref["y"])}
    (bad,) = verify._held_to_fp16("fp16", model, {"x": x}, ref, {"seg": off}, "#0", tight)
    assert not bad.passed
    (strict,) = verify._held_to_fp16("", model, {"x": x}, ref, {"seg": fp16}, "#0", tight)
    assert not strict.passed and "judged" not in strict.note
