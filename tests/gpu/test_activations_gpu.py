"""Every row of the activation table (dualtrack.contract.activations) through every kernel family that
fuses one, on a real GPU, against onnxruntime on the same computation as an ONNX graph: the general
conv's epilogue (an fp16 tensor-core tile, the fp16 direct entry, fp32), dwconv and fc (Conv nodes
followed by the activation) and eltwise's unary op (the activation node alone, with NaN, infinities
and large magnitudes, which must come out as onnxruntime's).

Parameters are not ONNX's defaults (tests/activation_cases.py), so a kernel that reads p0/p1 from the
wrong place fails. onnxruntime runs in float32 on the same (fp16-rounded where the kernel is fp16)
inputs; the kernels compute in fp32 and round once, so the bounds are a few fp32 ulps of the sums for
fp32 and one fp16 rounding of the output for fp16. Kernels come from the checked-in PTX of this
device's arch (handwritten_ptx/ptx/<arch>/), so regenerate it (`make ptx`) before running this."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from activation_cases import ROWS, act_nodes, case_activation, opset, run_ort_activation
from gpu_ptx import Slices, checked_in_entries
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.contract.activations import Activation, ActivationKind
from dualtrack.kernels import ConvGeometry, DwConvSpec, DwGeometry
from dualtrack.runtime.engine import Engine

# |got - ort| <= ATOL * max(1, |ort|): fp32 differs by summation order and the device's expf/tanhf/erff
# (2 ulps); fp16 by one rounding of outputs up to ~16 (half an ulp: 2^-11 relative) on top.
ATOL = {"float32": 2e-5, "float16": 2e-3}
STEMS = ("conv_nhwc", "dwconv_nhwc", "fc_nhwc", "eltwise_nhwc")
IDS = [k.name for k in ROWS]
CONV, DW, FC, ELT = (kernels.KERNELS[op] for op in ("conv", "dwconv", "fc", "eltwise"))


@pytest.fixture(scope="module")
def mods(engine: Engine):
    """Every entry of the four kernel families, from this device's checked-in PTX."""
    with checked_in_entries(engine, STEMS) as found:
        yield found


def ort_conv_act(x: np.ndarray, w: np.ndarray, b: np.ndarray, act: Activation, pads: int, group: int) -> np.ndarray:
    """onnxruntime's Conv (NCHW) followed by the activation's nodes, on NHWC ``x``; NHWC out."""
    x_nchw = x.astype(np.float32).transpose(0, 3, 1, 2)
    nodes, inits = act_nodes(act, "t", "y")
    conv = helper.make_node("Conv", ["x", "w", "b"], ["t"], pads=[pads] * 4, group=group)
    inits += [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(b, "b")]
    graph = helper.make_graph(
        [conv, *nodes],
        "conv_act",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_nchw.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset(act.kind))])
    model.ir_version = 9  # what onnxruntime 1.20+ loads, whatever IR the installed onnx writes by default
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x_nchw})[0].transpose(0, 2, 3, 1)


def check(what: str, got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    bound = ATOL[dtype] * np.maximum(1.0, np.abs(want64))
    bad = ~((np.abs(got64 - want64) <= bound) | (np.isnan(got64) & np.isnan(want64)) | (got64 == want64))
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} differ, e.g. got {got64[bad][:4]} want {want64[bad][:4]}"


def _inputs(s: Slices, shape: tuple[int, ...], dtype: str, scale: float) -> np.ndarray:
    return (scale * s.rng.standard_normal(shape)).astype(dtype)


@pytest.mark.parametrize("kind", ROWS, ids=IDS)
@pytest.mark.parametrize(
    ("dtype", "entry", "shape"),
    [
        ("float16", None, (1, 9, 11, 16, 24)),  # a tensor-core tile (variant())
        ("float16", "conv_nhwc_f16_direct", (1, 20, 22, 16, 5)),  # a head's few classes
        ("float32", None, (1, 9, 11, 16, 24)),
    ],
    ids=["f16", "f16_direct", "f32"],
)
def test_conv_epilogue(engine, mods, kind: ActivationKind, dtype: str, entry: str | None, shape) -> None:
    act, s = case_activation(kind), Slices(engine, dtype, 0)
    n, h, w, c, k = shape
    geom = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
    x = _inputs(s, (n, h, w, c), dtype, 1.0)
    w_onnx = _inputs(s, (k, c, 3, 3), dtype, 3.0 / np.sqrt(9 * c))  # pre-activation values ~ N(0, 3^2)
    b = s.rng.standard_normal(k).astype(np.float32)
    wp, bp = kernels.pack_conv_weights(w_onnx, b, any_size=True)
    want = ort_conv_act(x, w_onnx, b, act, 1, 1)
    (px, ldx), (py, ldy) = s.input(x), s.output(want.shape)
    entry = entry or CONV.variant(dtype, n, h, w, c, k, geom)
    cfg = CONV.launch(dtype, n, h, w, c, k, geom=geom, entry=entry)
    args = CONV.args(x=px, w=s.weights(wp), bias=s.weights(bp), y=py, N=n, H=h, W=w, C=c, K=k, geom=geom,
                     ldx=ldx, ldy=ldy, act=act)  # fmt: skip
    mods[entry].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
    check(f"{entry} {act}", s.result(), want, dtype)


@pytest.mark.parametrize("kind", ROWS, ids=IDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dwconv_epilogue(engine, mods, kind: ActivationKind, dtype: str) -> None:
    act, s = case_activation(kind), Slices(engine, dtype, 0)
    n, h, w, c = 2, 9, 11, 24
    g = DwGeometry(3, 1, 1, (1, 1, 1, 1))
    x = _inputs(s, (n, h, w, c), dtype, 1.0)
    wt = _inputs(s, (c, 1, 3, 3), dtype, 1.0)  # pre-activation values ~ N(0, 3^2)
    b = s.rng.standard_normal(c).astype(np.float32)
    wp, bp = DwConvSpec.pack(wt, b)
    want = ort_conv_act(x, wt, b, act, 1, c)
    (px, ldx), (py, ldy) = s.input(x), s.output(want.shape)
    args = DW.args(x=px, w=s.weights(wp), bias=s.weights(bp), y=py, N=n, H=h, W=w, C=c, geometry=g,
                   ldx=ldx, ldy=ldy, act=act)  # fmt: skip
    cfg = DW.launch(dtype, n, h, w, c, 0, g, ldy=ldy)
    mods[DW.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
    check(f"dwconv {act}", s.result(), want, dtype)


@pytest.mark.parametrize("kind", ROWS, ids=IDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fc_epilogue(engine, mods, kind: ActivationKind, dtype: str) -> None:
    act, s = case_activation(kind), Slices(engine, dtype, 0)
    n, c, k = 3, 40, 24
    x = _inputs(s, (n, 1, 1, c), dtype, 1.0)
    wt = _inputs(s, (k, c, 1, 1), dtype, 3.0 / np.sqrt(c))
    b = s.rng.standard_normal(k).astype(np.float32)
    want = ort_conv_act(x, wt, b, act, 0, 1)
    (px, ldx), (py, ldy) = s.input(x), s.output(want.shape)
    args = FC.args(x=px, w=s.weights(wt), bias=s.weights(b), y=py, N=n, C=c, K=k, ldx=ldx, ldy=ldy, act=act)
    cfg = FC.launch(dtype, n, 1, 1, c, k)
    mods[FC.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
    check(f"fc {act}", s.result(), want, dtype)


@pytest.mark.parametrize("kind", ROWS, ids=IDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_eltwise_unary_with_special_values(engine, mods, kind: ActivationKind, dtype: str) -> None:
    act, s = case_activation(kind), Slices(engine, dtype, 0)
    n, h, w, c = 2, 5, 7, 40  # C % 8 == 0: fp16's 8-channel vector path
    a = _inputs(s, (n, h, w, c), dtype, 4.0)
    big = 6e4 if dtype == "float16" else 1e30
    a.reshape(-1)[:9] = [np.nan, np.inf, -np.inf, big, -big, 0.0, -0.0, 30.0, -30.0]
    want = run_ort_activation(act, a.astype(np.float32))
    (pa, lda), (py, ldy) = s.input(a), s.output(a.shape)
    args = ELT.args(a=pa, y=py, N=n, H=h, W=w, C=c, op="unary", bcast=False, lda=lda, ldy=ldy, act=act)
    cfg = ELT.launch(dtype, n, h, w, c, 0, ldy=ldy)
    mods[ELT.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
    # fp16 rounds ORT's fp32 answer the kernel's way (nearest) before comparing.
    check(f"eltwise {act}", s.result(), want.astype(dtype), dtype)
