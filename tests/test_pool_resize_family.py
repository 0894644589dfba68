"""The pooling, resampling and constant-operand rows of Track A without a GPU (issue 38): the numpy
references of the pooling family (maxpool_nhwc.cu's average modes), of Resize and of the eltwise
kernel's constant-operand and PReLU rows against onnxruntime on fresh random inputs, over windows,
scales and shapes no zoo model uses; and the partition taking the ONNX nodes (AveragePool, Resize by
sizes, PRelu, Mul/Add/Sub/Div by a per-channel constant) onto Track A, its calls reproducing
onnxruntime's segment outputs. The GPU side: tests/gpu/test_pool_resize_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from test_partition_conv import Graph, a_calls, plan_of, track_a_matches_onnxruntime

from dualtrack.compiler.build import build
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import ELTWISE_OPS, POOL_MODES, KernelCall
from dualtrack.errors import PartitionError
from dualtrack.kernels import KERNELS, MaxPoolSpec, PoolGeometry, ResizeMode

POOL = KERNELS["maxpool"]
assert isinstance(POOL, MaxPoolSpec)
RNG = np.random.default_rng()
TOL = 1e-6  # float32 relative L2: the references sum in float32 as onnxruntime does, in another order


def ort_run(node: onnx.NodeProto, x_nchw: np.ndarray, inits: tuple[onnx.TensorProto, ...] = ()) -> np.ndarray:
    """onnxruntime's result of one node on ``x`` (NCHW, the node's first input "x"; output "y")."""
    elem = helper.np_dtype_to_tensor_dtype(x_nchw.dtype)
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", elem, x_nchw.shape)],
        [helper.make_tensor_value_info("y", elem, None)],
        list(inits),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x_nchw})[0]


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    got64, ref64 = got.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(got64 - ref64) / np.linalg.norm(ref64))


# (kernel, stride, pads top/left/bottom/right, ceil_mode) over inputs no zoo model has.
AVG_WINDOWS = [
    ((3, 3), (2, 2), (1, 1, 1, 1), 1),
    ((3, 3), (2, 2), (1, 1, 1, 1), 0),
    ((5, 5), (3, 3), (0, 0, 0, 0), 0),
    ((5, 5), (3, 3), (2, 1, 2, 1), 1),
    ((2, 3), (1, 2), (0, 1, 1, 0), 1),
    ((7, 7), (7, 7), (0, 0, 0, 0), 1),
    ((8, 8), (8, 8), (0, 0, 0, 0), 0),  # PSPNet's AdaptiveAvgPool2d(bins) exports as kernel = stride = H / bins
    ((16, 15), (16, 15), (0, 0, 0, 0), 0),  # windows past 15 a side (PSPNet's bin 2 pools 32x32 of a 64x64 map)
]


def avg_node(kernel, stride, pads, ceil: int, include: int) -> onnx.NodeProto:
    return helper.make_node(
        "AveragePool", ["x"], ["y"], kernel_shape=list(kernel), strides=list(stride), pads=list(pads),
        ceil_mode=ceil, count_include_pad=include,
    )  # fmt: skip


@pytest.mark.parametrize("include", [0, 1])
@pytest.mark.parametrize(("kernel", "stride", "pads", "ceil"), AVG_WINDOWS)
def test_average_pool_reference_matches_onnxruntime(kernel, stride, pads, ceil: int, include: int) -> None:
    x = RNG.standard_normal((2, 5, 17, 23)).astype(np.float32)
    mode = POOL_MODES["avg_include_pad" if include else "avg_exclude_pad"]
    g = PoolGeometry(*kernel, *stride, 1, 1, *pads, ceil_mode=ceil, mode=mode)
    assert POOL.supports("float32", 17, 23, 5, g) is None
    ref = ort_run(avg_node(kernel, stride, pads, ceil, include), x)
    got = POOL.reference(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), g).transpose(0, 3, 1, 2)
    assert got.shape == ref.shape
    assert rel_l2(got, ref) <= TOL


def test_average_pool_counts_the_window_clipped_to_the_padded_image() -> None:
    # 3x3 / 2, pad 1, ceil_mode on 5 rows: output rows start at -1, 1, 3; the last reaches row 5, the
    # bottom pad (counted with count_include_pad 1), and no further.
    g = PoolGeometry(3, 3, 2, 2, 1, 1, 1, 1, 1, 1, ceil_mode=1, mode=POOL_MODES["avg_include_pad"])
    assert g.output_hw(5, 5) == (3, 3)
    assert g.counts(5, 5).tolist() == [[9.0] * 3] * 3
    # No padding, 6 rows: windows start at 0, 2, 4; the last holds rows 4, 5 only (count 2, not 3).
    g0 = PoolGeometry(3, 3, 2, 2, ceil_mode=1, mode=POOL_MODES["avg_include_pad"])
    assert g0.output_hw(6, 6) == (3, 3)
    assert g0.counts(6, 6)[2].tolist() == [6.0, 6.0, 4.0]
    excl = PoolGeometry(3, 3, 2, 2, 1, 1, 1, 1, 1, 1, ceil_mode=1, mode=POOL_MODES["avg_exclude_pad"])
    assert excl.counts(5, 5)[0].tolist() == [4.0, 6.0, 4.0]


def test_dilated_average_pool_is_refused() -> None:
    g = PoolGeometry(3, 3, 1, 1, 2, 2, mode=POOL_MODES["avg_exclude_pad"])
    assert "dilated average pool" in (POOL.supports("float32", 16, 16, 4, g) or "")


def test_pool_arguments_carry_the_mode_and_the_bottom_right_pads() -> None:
    g = PoolGeometry(3, 3, 2, 2, 1, 1, 1, 1, 2, 1, ceil_mode=1, mode=POOL_MODES["avg_include_pad"])
    args = dict(zip(POOL.PARAMS, (v for v, _ in POOL.args(x=256, y=512, N=1, H=17, W=23, C=8, geom=g)), strict=True))
    assert (args["pb"], args["pr"], args["mode"], args["pt"], args["pl"]) == (2, 1, 1, 1, 1)
    assert (args["Ho"], args["Wo"]) == g.output_hw(17, 23)


# --- Resize: nearest and bilinear at scales no zoo model uses, by scales or by sizes ----------------


def ort_resize(x: np.ndarray, mode: str, coord: str, *, scales=None, sizes=None, nearest="floor") -> np.ndarray:
    inits = []
    inputs = ["x", ""]
    if scales is not None:
        inits.append(numpy_helper.from_array(np.array([1, 1, *scales], np.float32), "scales"))
        inputs.append("scales")
    else:
        inits.append(numpy_helper.from_array(np.array([*x.shape[:2], *sizes], np.int64), "sizes"))
        inputs += ["", "sizes"]
    node = helper.make_node(
        "Resize", inputs, ["y"], mode=mode, coordinate_transformation_mode=coord, nearest_mode=nearest
    )
    return ort_run(node, x, tuple(inits))


RESIZES = [
    # (mode, coord, scales, sizes): the sizes' scale is output / input, as ONNX and the lowering take it
    ("linear", "align_corners", None, (34, 46)),  # x2 by sizes
    ("linear", "align_corners", None, (6, 9)),  # x0.37 by sizes
    ("linear", "half_pixel", (0.37, 0.37), None),
    ("linear", "pytorch_half_pixel", None, (1, 9)),  # an output row of 1: pytorch_half_pixel's special case
    ("linear", "asymmetric", (2.5, 1.5), None),
    ("nearest", "asymmetric", (3.0, 3.0), None),
    ("nearest", "half_pixel", None, (40, 10)),
    ("nearest", "align_corners", None, (7, 31)),
]


@pytest.mark.parametrize(("mode", "coord", "scales", "sizes"), RESIZES)
def test_resize_reference_matches_onnxruntime(mode: str, coord: str, scales, sizes) -> None:
    x = RNG.standard_normal((2, 3, 17, 23)).astype(np.float32)
    ref = ort_resize(x, mode, coord, scales=scales, sizes=sizes)
    Ho, Wo = ref.shape[2:]
    if scales is not None:
        sh, sw = (float(np.float32(s)) for s in scales)
    else:
        sh, sw = float(np.float32(Ho) / np.float32(17)), float(np.float32(Wo) / np.float32(23))
    how = ResizeMode(mode, coord, "floor", sh, sw)
    got = KERNELS["resize"].reference(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), Ho, Wo, how)
    assert rel_l2(got.transpose(0, 3, 1, 2), ref) <= TOL


IDENTITY_RESIZES = [  # (mode, coord, scales, sizes, identity): same size by sizes or by scales of 1
    ("linear", "half_pixel", None, (17, 23), True),  # smp Segformer's decoder resizes its 1/4 feature so
    ("linear", "pytorch_half_pixel", (1.0, 1.0), None, True),
    ("linear", "align_corners", None, (17, 23), True),
    ("linear", "asymmetric", (1.0, 1.0), None, True),
    ("nearest", "half_pixel", None, (17, 23), True),
    ("linear", "half_pixel", None, (17, 46), False),  # one axis the same: the blend, not a copy
]


@pytest.mark.parametrize(("mode", "coord", "scales", "sizes", "identity"), IDENTITY_RESIZES)
def test_an_identity_resize_is_a_copy_as_onnxruntime_makes_it(mode, coord, scales, sizes, identity) -> None:
    """onnxruntime copies a Resize whose output is its input's size (inf and NaN stay where they are,
    where the blend's weight of 0 would spread them to their neighbours); the reference (and
    resize_nhwc.cu, tests/gpu/test_pool_resize_gpu.py) does the same, and only then: a resize of
    another size blends (where non-finite inputs spread as the formula's lerps spread them, not as
    onnxruntime's weighted sum does: the other tests compare finite inputs)."""
    x = RNG.standard_normal((2, 3, 17, 23)).astype(np.float32)
    x[0, 1, 4, 5], x[1, 2, 9, 9] = np.inf, np.nan
    want = ort_resize(x, mode, coord, scales=scales, sizes=sizes)
    Ho, Wo = want.shape[2:]
    sh, sw = (
        (float(np.float32(s)) for s in scales)
        if scales
        else (float(np.float32(Ho) / np.float32(17)), float(np.float32(Wo) / np.float32(23)))
    )
    how = ResizeMode(mode, coord, "floor", sh, sw)
    assert how.identity(17, 23, Ho, Wo) is identity
    with np.errstate(invalid="ignore"):  # the blend's inf - inf and 0 * inf, where it is not a copy
        got = KERNELS["resize"].reference(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), Ho, Wo, how)
    if identity:
        np.testing.assert_array_equal(got.transpose(0, 3, 1, 2), x)
        np.testing.assert_array_equal(want, x)


# --- eltwise: constant operands, PReLU, Sub and Div ---------------------------------------------------

ELT = KERNELS["eltwise"]
C = 6


def channel_constant(shape: tuple[int, ...]) -> np.ndarray:
    """Random values of either sign, 0.25 to 2 in magnitude (a divisor kept off zero)."""
    return (RNG.uniform(0.25, 2.0, shape) * np.sign(RNG.standard_normal(shape))).astype(np.float32)


@pytest.mark.parametrize(
    ("op_type", "const_first", "shape", "op"),
    [
        ("PRelu", False, (C, 1, 1), "prelu"),  # torch's per-channel PReLU
        ("PRelu", False, (1,), "prelu"),  # nn.PReLU() with one slope
        ("Mul", False, (C, 1, 1), "mul"),  # ConvNeXt's layer scale
        ("Mul", True, (1, C, 1, 1), "mul"),
        ("Add", False, (1, C, 1, 1), "add"),
        ("Sub", False, (C, 1, 1), "sub"),
        ("Sub", True, (), "rsub"),  # 1 - x
        ("Div", False, (C, 1, 1), "div"),
        ("Div", True, (1, 1, 1), "rdiv"),
    ],
)
def test_constant_operand_reference_matches_onnxruntime(op_type: str, const_first: bool, shape, op: str) -> None:
    x = RNG.standard_normal((2, C, 5, 7)).astype(np.float32)
    k = channel_constant(shape)
    inputs = ["k", "x"] if const_first else ["x", "k"]
    ref = ort_run(helper.make_node(op_type, inputs, ["y"]), x, (numpy_helper.from_array(k, "k"),))
    call = KernelCall("eltwise", ("x",), ("y",), ("k",), (("op", ELTWISE_OPS[op]), ("C", C)))
    packed = ELT.pack_weights(call, {"k": k})
    assert packed["k"].shape == (C,)
    got = ELT.run_reference(call, [np.ascontiguousarray(x.transpose(0, 2, 3, 1))], {"k": k})
    assert rel_l2(got.transpose(0, 3, 1, 2), ref) <= TOL


@pytest.mark.parametrize(("op_type", "gate_first", "op"), [("Sub", False, "sub"), ("Div", True, "rdiv")])
def test_sub_and_div_of_two_tensors_match_onnxruntime(op_type: str, gate_first: bool, op: str) -> None:
    a = RNG.standard_normal((2, 5, 4, 3)).astype(np.float32)
    g = (RNG.uniform(0.5, 2.0, (2, 1, 1, 3)) * np.sign(RNG.standard_normal((2, 1, 1, 3)))).astype(np.float32)
    want = (g - a if op_type == "Sub" else g / a) if gate_first else (a - g if op_type == "Sub" else a / g)
    assert rel_l2(ELT.reference(a, g, op), want) <= TOL


def test_a_pixel_gate_reference_matches_onnxruntime_and_the_partition_takes_it(tmp_path: Path) -> None:
    """x * sigmoid(psi(x)) with psi(x) of one channel, (N, 1, H, W): an attention gate (MONAI AttentionUnet,
    scSE) broadcast over the channels is one eltwise call on Track A, and its calls reproduce onnxruntime."""
    a = RNG.standard_normal((2, 6, 5, 7)).astype(np.float32)
    gate = RNG.uniform(0, 1, (2, 1, 5, 7)).astype(np.float32)
    got = ELT.reference(a.transpose(0, 2, 3, 1), gate.transpose(0, 2, 3, 1), "mul")
    want = ort_run(helper.make_node("Mul", ["x", "g"], ["y"]), a, (numpy_helper.from_array(gate, "g"),))
    assert rel_l2(got.transpose(0, 3, 1, 2), want) <= TOL
    g = Graph(8, 9, 11)
    g.inits.append(numpy_helper.from_array(RNG.standard_normal((1, 8, 1, 1)).astype(np.float32), "psi.w"))
    psi = g.op("Conv", "a/psi", ["x0", "psi.w"])
    t = g.op("Mul", "a/gated", ["x0", g.op("Sigmoid", "a/sig", [psi])])
    model = g.model(t)
    plan = plan_of(model, tmp_path)
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    assert [c.op for c in a_calls(plan)][-1] == "eltwise" and a_calls(plan)[-1].nodes == ("a/gated",)
    track_a_matches_onnxruntime(model, plan)


# --- the partition takes them: one Track A segment whose calls reproduce onnxruntime ------------------


def family_graph() -> tuple[Graph, str]:
    """pre/relu -> a/...: AveragePool 3x3/2 pad 1 ceil_mode (count_include_pad 0), a bilinear
    align_corners Resize by sizes (x0.37), PRelu per channel, a nearest asymmetric Resize x3, Mul by
    a (C,1,1) layer scale, 1 - x, AveragePool 5x5/3 (count_include_pad 1), Div by a scalar ->
    post/sigmoid, on a 17x23 image of 8 channels."""
    g = Graph(8, 17, 23)

    def init(name: str, value: np.ndarray) -> str:
        g.inits.append(numpy_helper.from_array(value, name))
        return name

    t = g.op(
        "AveragePool", "a/avg3", ["x0"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
        count_include_pad=0,
    )  # fmt: skip  # 9 x 12
    t = g.op("Resize", "a/down", [t, "", "", init("sizes", np.array([1, 8, 3, 4], np.int64))],
             mode="linear", coordinate_transformation_mode="align_corners")  # fmt: skip
    t = g.op("PRelu", "a/prelu", [t, init("slope", channel_constant((8, 1, 1)))])
    t = g.op("Resize", "a/up", [t, "", init("up", np.array([1, 1, 3, 3], np.float32))],
             mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")  # fmt: skip  # 9 x 12
    t = g.op("Mul", "a/scale", [t, init("gamma", channel_constant((8, 1, 1)))])
    t = g.op("Sub", "a/one_minus", [init("one", np.array(1.0, np.float32)), t])
    t = g.op("AveragePool", "a/avg5", [t], kernel_shape=[5, 5], strides=[3, 3], pads=[2, 2, 2, 2], count_include_pad=1)
    t = g.op("Div", "a/div", [t, init("three", np.array([3.0], np.float32))])
    return g, t


def test_the_partition_takes_pools_resizes_prelu_and_constant_operands(tmp_path: Path) -> None:
    g, out = family_graph()
    model = g.model(out)
    plan = plan_of(model, tmp_path)
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    calls = a_calls(plan)
    assert [(c.op, c.nodes[0]) for c in calls] == [
        ("maxpool", "a/avg3"), ("resize", "a/down"), ("eltwise", "a/prelu"), ("resize", "a/up"),
        ("eltwise", "a/scale"), ("eltwise", "a/one_minus"), ("maxpool", "a/avg5"), ("eltwise", "a/div"),
    ]  # fmt: skip
    ops = {c.nodes[0]: c for c in calls}
    assert PoolGeometry.from_call(ops["a/avg3"]).mode == POOL_MODES["avg_exclude_pad"]
    assert PoolGeometry.from_call(ops["a/avg5"]).mode == POOL_MODES["avg_include_pad"]
    assert ops["a/one_minus"].attr("op") == ELTWISE_OPS["rsub"] and ops["a/one_minus"].weights == ("one",)
    assert ops["a/prelu"].attr("op") == ELTWISE_OPS["prelu"] and ops["a/prelu"].attr("C") == 8
    track_a_matches_onnxruntime(model, plan)


def test_a_runtime_slope_or_a_column_constant_is_refused_with_the_reason(tmp_path: Path) -> None:
    g = Graph(4, 6, 6)
    t = g.op("PRelu", "a/prelu", ["x0", "x0"])
    with pytest.raises(PartitionError, match=r"\(PRelu, a slope computed at run time"):
        plan_of(g.model(t), tmp_path)
    g = Graph(4, 6, 6)
    g.inits.append(numpy_helper.from_array(np.ones((6,), np.float32), "cols"))
    t = g.op("Mul", "a/mul", ["x0", "cols"])
    with pytest.raises(
        PartitionError, match=r"\(Mul, a constant of shape \[6\] \(the kernel takes one value per channel"
    ):
        plan_of(g.model(t), tmp_path)


# --- a tiny `dualtrack build` of them in fp16, verified on the CPU ----------------------------------

BUILD_CONFIG = """\
model: family.onnx
precision: fp16
batch_sizes: [1]
targets: [sm_80]
partition:
  mode: rules
  track_a:
    name_prefixes: [a/]
verify:
  samples: 1
"""


def test_an_fp16_build_of_them_verifies_on_the_cpu(tmp_path: Path) -> None:
    """The front end's fp16 conversion turns the constants fp16 (the eltwise operand's dtype check)
    and wraps the Resizes in fp32 islands; the build verifies the Track A segment by the kernels'
    numpy references and through IREE llvm-cpu against onnxruntime."""
    g, out = family_graph()
    onnx.save(g.model(out), str(tmp_path / "family.onnx"))
    (tmp_path / "family.yaml").write_text(BUILD_CONFIG)
    build(tmp_path / "family.yaml", tmp_path / "out")  # raises when verification fails
    report = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert report["passed"] is True and report["precision"] == "fp16"
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    calls = plan.segments[1].calls
    assert [c.op for c in calls].count("eltwise") == 4 and [c.op for c in calls].count("maxpool") == 2
