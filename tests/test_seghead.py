"""The seghead kernel's spec (the segmentation head: softmax / sigmoid / none, probabilities and class
mask) and its lowering: the numpy reference against onnxruntime's Softmax / Sigmoid / ArgMax on random
logits (ties, large values, NaN), the spec's checks, and which heads the partition takes (lower_head).
No GPU: tests/gpu/test_seghead_gpu.py runs the kernel against the same reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import cost, frontend, lower_head, lower_mobile, partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig, Postprocess
from dualtrack.compiler.verify import ort_session, run_ort
from dualtrack.contract.plan import HEAD_ACTS, KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import KERNELS, HeadMode
from dualtrack.kernels.seghead import MAX_CLASSES
from dualtrack.runtime.tensors import GpuTensor

SPEC = KERNELS["seghead"]
ONNX_TYPE = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}


def head_model(classes: int, h: int, w: int, logits: str, act: str, probs_cast: bool = False) -> onnx.ModelProto:
    """logits (N, C, H, W) -> act -> probs (fp32) and ArgMax -> uint8 mask, as the image wrap (or the
    reference U-Net, ``probs_cast``: an fp16 softmax cast to fp32) writes it."""
    nodes, x = [], "logits"
    if logits != "float32" and not probs_cast:  # the wrap computes in fp32
        nodes.append(helper.make_node("Cast", [x], ["fp32"], name="post/fp32", to=TensorProto.FLOAT))
        x = "fp32"
    if act != "none":
        nodes.append(
            helper.make_node(
                act.capitalize(), [x], ["act"], name="post/act", **({"axis": 1} if act == "softmax" else {})
            )
        )
        x = "act"
    if probs_cast:
        nodes.append(helper.make_node("Cast", [x], ["probs"], name="post/probs", to=TensorProto.FLOAT))
    else:
        nodes.append(helper.make_node("Identity", [x], ["probs"], name="post/probs"))
    nodes.append(helper.make_node("ArgMax", [x], ["argmax"], name="post/argmax", axis=1, keepdims=0))
    nodes.append(helper.make_node("Cast", ["argmax"], ["mask"], name="post/mask", to=TensorProto.UINT8))
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("logits", ONNX_TYPE[logits], ["N", classes, h, w])],
        [
            helper.make_tensor_value_info("mask", TensorProto.UINT8, ["N", h, w]),
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", classes, h, w]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def logits_of(kind: str, shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "ties":  # small integers: many exactly equal classes, the first of them must win
        return rng.integers(-2, 3, size=shape).astype(dtype)
    if kind == "large":  # a naive exp overflows: the max must be subtracted first
        big = 6e4 if dtype == "float16" else 1e4
        return (rng.uniform(-big, big, size=shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype) * 3


# The tolerance the spec's docstring states: fp32 probabilities within 1e-6; fp16-rounded ones within
# one fp16 ulp below 1 (2^-11); the mask equal wherever the top two probabilities are further apart.
def tolerance(mode: HeadMode) -> float:
    return 2.0**-11 if mode.round_probs or mode.probs_dtype == "float16" else 1e-6


CASES = [
    # (classes, logits dtype, activation, fp16 softmax cast to fp32 as the reference U-Net has it)
    (2, "float32", "softmax", False),
    (3, "float16", "softmax", False),
    (21, "float32", "softmax", False),
    (2, "float16", "softmax", True),
    (5, "float32", "sigmoid", False),
    (4, "float16", "none", False),
]


@pytest.mark.parametrize(("classes", "dtype", "act", "probs_cast"), CASES)
@pytest.mark.parametrize("kind", ["random", "ties", "large"])
def test_the_reference_matches_onnxruntime(classes: int, dtype: str, act: str, probs_cast: bool, kind: str) -> None:
    rng = np.random.default_rng()
    n, h, w = 2, 7, 9
    model = head_model(classes, h, w, dtype, act, probs_cast)
    x = logits_of(kind, (n, classes, h, w), dtype, rng)
    ref = run_ort(ort_session(model), {"logits": x})
    head = _found(model)
    mode = HeadMode.of(head.call())
    # Where the graph rounds: the fp16 softmax of the reference U-Net rounds its probabilities and
    # the values the argmax compares; an fp16 logits tensor cast to fp32 first rounds nothing.
    assert mode.round_probs == mode.round_arg == (act != "none" and probs_cast)
    probs, mask = SPEC.reference(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), mode)
    assert probs.shape == (n, classes, h, w) and probs.dtype == np.float32
    assert mask.shape == (n, h, w) and mask.dtype == np.uint8
    err = float(np.max(np.abs(probs.astype(np.float64) - ref["probs"])))
    assert err <= tolerance(mode), (kind, err)
    top = np.sort(ref["probs"].astype(np.float64), axis=1)
    decided = top[:, -1] - top[:, -2] > 2 * tolerance(mode)
    assert np.array_equal(mask[decided], ref["mask"][decided])
    if kind == "ties" and not mode.round_arg and act != "sigmoid":
        assert np.array_equal(mask, ref["mask"])  # exact ties: the first class, as onnxruntime


def test_one_class_sigmoid_thresholds_at_the_exported_constant() -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 5, 6, 1)).astype(np.float32)
    probs, mask = SPEC.reference(x, HeadMode("sigmoid", threshold=0.5))
    p = 1 / (1 + np.exp(-x[..., 0].astype(np.float64)))
    assert np.max(np.abs(probs[:, 0] - p)) < 1e-6
    assert np.array_equal(mask, (x[..., 0] > 0).astype(np.uint8))


def test_nan_logits_give_nan_probabilities_and_the_first_class_as_onnxruntime() -> None:
    x = np.array([[[[np.nan, 1, 1, 2]], [[0, np.nan, 1, np.nan]], [[5, 2, np.nan, np.nan]]]], np.float32)
    for act in ("softmax", "none"):
        model = head_model(3, 1, 4, "float32", act)
        ref = run_ort(ort_session(model), {"logits": x})
        probs, mask = SPEC.reference(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), HeadMode(act))
        assert np.array_equal(np.isnan(probs), np.isnan(ref["probs"]))
        assert np.array_equal(mask, ref["mask"]), act


def test_the_spec_refuses_what_the_kernel_cannot_compute() -> None:
    assert SPEC.supports(MAX_CLASSES, HeadMode()) is None
    assert SPEC.supports(MAX_CLASSES + 1, HeadMode()) == (
        "257 classes: the mask holds class ids as uint8 (at most 256 classes)"
    )
    assert SPEC.supports(2, HeadMode("sigmoid", threshold=0.5)) == (
        "a threshold mask over 2 classes (the kernel thresholds one class)"
    )
    with pytest.raises(InputError, match=r"^ldx=2 is smaller than the 3 channels it must hold; use ldx >= 3$"):
        SPEC.args(x=1, probs=2, mask=3, N=1, H=2, W=2, C=3, ldx=2, mode=HeadMode())
    with pytest.raises(InputError, match=r"^mask is a null device pointer$"):
        SPEC.args(x=1, probs=2, mask=0, N=1, H=2, W=2, C=3, mode=HeadMode())
    with pytest.raises(InputError, match=r"^seghead takes the activations none, softmax, sigmoid; got 'relu'$"):
        HeadMode("relu")


def test_outputs_of_the_wrong_layout_are_refused_not_written() -> None:
    call = KernelCall("seghead", ("x",), ("p", "m"), (), HeadMode().attrs(), ("post/softmax",))
    x = GpuTensor(0x1000, (1, 4, 5, 3), np.dtype("float16"))
    nhwc = GpuTensor(0x2000, (1, 4, 5, 3), np.dtype("float32"))
    mask = GpuTensor(0x3000, (1, 4, 5), np.dtype("uint8"))
    with pytest.raises(InputError, match=r"probs \(1, 4, 5, 3\) float32 is not \(1, 3, 4, 5\) float32"):
        SPEC.prepare_outputs(call, [x], [nhwc, mask], [], None)
    nchw = GpuTensor(0x2000, (1, 3, 4, 5), np.dtype("float32"))
    with pytest.raises(InputError, match=r"mask \(1, 4, 5\) float32 is not \(1, 4, 5\) uint8"):
        SPEC.prepare_outputs(call, [x], [nchw, GpuTensor(0x3000, (1, 4, 5), np.dtype("float32"))], [], None)


def test_head_mode_round_trips_through_the_calls_attrs() -> None:
    for mode in (HeadMode(), HeadMode("sigmoid", threshold=0.25), HeadMode("none", True, True, False, "float16")):
        call = KernelCall("seghead", ("x",), ("p", "m"), (), mode.attrs())
        assert HeadMode.of(call) == mode


# --- which heads the partition takes (lower_head) ----------------------------------------------------


def _found(model: onnx.ModelProto) -> lower_head.Head:
    model = partition.name_nodes(model)
    specs = partition.infer_specs(model, 1)
    heads = lower_head.find_heads(lower_mobile.Facts(model, specs))
    assert heads.refused == {}
    (head,) = set(heads.found.values())
    return head


def conv_logits(classes: int, dtype: int = TensorProto.FLOAT, h: int = 8, w: int = 8) -> onnx.ModelProto:
    """x (N, 4, H, W) -> a 3x3 conv -> `logits` (N, classes, H, W): a network for the image wrap."""
    rng = np.random.default_rng(3)
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    wt = numpy_helper.from_array(rng.standard_normal((classes, 4, 3, 3)).astype(np_dtype), "w")
    node = helper.make_node("Conv", ["x", "w"], ["logits"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [node],
        "net",
        [helper.make_tensor_value_info("x", dtype, ["N", 4, h, w])],
        [helper.make_tensor_value_info("logits", dtype, ["N", classes, h, w])],
        [wt],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def wrapped(model: onnx.ModelProto, post: Postprocess) -> onnx.ModelProto:
    return partition.name_nodes(frontend.wrap_image_io(model, None, post, []))


def auto_plan(model: onnx.ModelProto) -> partition.Partitioned:
    cfg = BuildConfig(
        model=Path("m.onnx"), batch_sizes=(1, 2), partition=PartitionConfig(mode="auto", switch_cost_us=0)
    )
    return partition.partition_model(cfg, model)


@pytest.mark.parametrize(
    ("classes", "dtype", "act", "flags"),
    [
        (2, TensorProto.FLOAT, "softmax", 0),
        (3, TensorProto.FLOAT16, "softmax", 0),  # post/fp32 casts the fp16 logits up: nothing rounds
        (21, TensorProto.FLOAT, "none", 0),
        (1, TensorProto.FLOAT, "sigmoid", 16),  # one class: the threshold
    ],
)
def test_every_head_the_wrap_writes_lowers_to_one_seghead_call(classes: int, dtype: int, act: str, flags: int) -> None:
    p = auto_plan(wrapped(conv_logits(classes, dtype), Postprocess(activation=act)))
    assert [s.track for s in p.plan.segments] == ["B", "A"]  # the conv reads the model's input
    (call,) = p.plan.segments[-1].calls
    assert call.op == "seghead" and call.inputs == ("logits",) and call.outputs == ("probs", "mask")
    assert dict(call.attrs)["act"] == HEAD_ACTS[act] and dict(call.attrs)["flags"] == flags
    assert set(call.nodes) == set(p.plan.segments[-1].nodes)
    outs = {t.name: t for t in p.plan.outputs}
    assert (outs["probs"].shape, outs["probs"].layout) == ((1, classes, 8, 8), "NCHW")  # the model's own layout
    assert (outs["mask"].shape, outs["mask"].dtype) == ((1, 8, 8), "uint8")


def test_a_head_the_kernel_cannot_take_stays_on_track_b_with_the_reason() -> None:
    p = auto_plan(wrapped(conv_logits(300), Postprocess(activation="softmax")))
    assert [s.track for s in p.plan.segments] == ["B"]
    d = {x.node: x for x in p.assignment.decisions}
    assert d["post/softmax"].why == (
        "not a Track A node: the seghead kernel does not take its head: 300 classes: the mask holds class ids "
        "as uint8 (at most 256 classes)"
    )


def test_a_softmax_over_another_axis_is_not_a_head() -> None:
    model = head_model(3, 4, 4, "float32", "softmax")
    next(n for n in model.graph.node if n.op_type == "Softmax").attribute[0].i = 3
    model = partition.name_nodes(model)
    heads = lower_head.find_heads(lower_mobile.Facts(model, partition.infer_specs(model, 1)))
    assert heads.found == {}
    assert heads.refused["post/act"] == (
        "not a segmentation head the kernel takes: Softmax axis 3 at opset 17 (the kernel normalises over "
        "the classes: axis 1, opset 13 or later)"
    )


def test_a_probability_read_outside_the_head_keeps_it_off_the_kernel() -> None:
    model = head_model(3, 4, 4, "float32", "softmax")
    model.graph.node.append(helper.make_node("Neg", ["act"], ["neg"], name="other"))
    model.graph.output.append(helper.make_tensor_value_info("neg", TensorProto.FLOAT, ["N", 3, 4, 4]))
    model = partition.name_nodes(model)
    heads = lower_head.find_heads(lower_mobile.Facts(model, partition.infer_specs(model, 1)))
    assert heads.found == {}
    assert (
        heads.refused["post/argmax"]
        == "not a segmentation head the kernel takes: 'act' inside the head is read outside it"
    )


def test_the_cost_model_charges_the_head_one_launch_of_its_bytes() -> None:
    p = auto_plan(wrapped(conv_logits(2), Postprocess()))
    d = {x.node: x for x in p.assignment.decisions}
    (call,) = p.plan.segments[-1].calls
    a_us = [d[n].a_us for n in call.nodes]
    # logits (fp32 2x8x8) read once, probs (fp32) and mask (uint8) written once, at batch 1 and 2
    nbytes, flops = 2 * 64 * 4 + 2 * 64 * 4 + 64, 10.0 * 2 * 64
    simt = cost.DEFAULT_RATES.track_a_simt
    assert a_us[0] == pytest.approx(sum(simt.time_us(b * flops, b * nbytes) for b in (1, 2)))
    assert a_us[1:] == [0.0] * (len(a_us) - 1)  # one launch for the whole head
    assert a_us[0] < sum(d[n].b_us for n in call.nodes)  # against ~10 us a node on Track B
