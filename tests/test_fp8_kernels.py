"""The FP8 kernels' specs on the CPU (issue 42): quantize_fp8 and conv_fp8's numpy references against
onnxruntime's QuantizeLinear / DequantizeLinear (float8e4m3fn, opset 19) and Conv, the weight packing,
the reasons ``supports`` gives, the e4m3 rows of the wgmma family, and the prepared launches against the
parameter lists of the checked-in compute_90a PTX. The GPU runs: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels import CONV3X3_WGMMA, KERNELS, ConvGeometry, spec_for_stem
from dualtrack.kernels.conv3x3_wgmma import E4M3_CONFIGS, input_map, weight_map
from dualtrack.kernels.conv_fp8 import ConvFp8Spec, quantize_weights, split_packed
from dualtrack.kernels.device import REFERENCE, for_target
from dualtrack.kernels.quantize_fp8 import QuantizeFp8Spec, fp8_available, from_e4m3, to_e4m3
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime.tensors import GpuTensor

QUANT = KERNELS["quantize_fp8"]
CONV = KERNELS["conv_fp8"]
assert isinstance(QUANT, QuantizeFp8Spec) and isinstance(CONV, ConvFp8Spec)
PTX = Path(__file__).resolve().parents[1] / "handwritten_ptx" / "ptx" / "compute_90a"
F8 = TensorProto.FLOAT8E4M3FN
MAX_DYNAMIC_SMEM = 227 * 1024  # sm_90's opt-in limit per block
SMEM_PER_SM = 228 * 1024
u8, f16, f32 = np.dtype("uint8"), np.dtype("float16"), np.dtype("float32")


def ort_run(
    nodes: list, inputs: dict[str, np.ndarray], inits: list, outputs: list, ins: list | None = None
) -> list[np.ndarray]:
    if ins is None:
        ins = [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in inputs.items()
        ]
    graph = helper.make_graph(nodes, "fp8", ins, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


def ort_quantize(x: np.ndarray, scale: float) -> np.ndarray:
    zp = helper.make_tensor("zp", F8, [], [0.0])
    sc = numpy_helper.from_array(np.array(scale, np.float32), "sc")
    out = helper.make_tensor_value_info("q", F8, list(x.shape))
    return ort_run([helper.make_node("QuantizeLinear", ["x", "sc", "zp"], ["q"])], {"x": x}, [zp, sc], [out])[0]


# -- quantize_fp8 ------------------------------------------------------------------------------------


def test_quantize_reference_is_onnxruntimes_quantize_linear_for_a_power_of_two_scale() -> None:
    # x * (1/s) and ONNX's x / s are the same number when s is a power of two: every byte equal,
    # saturation (|x / s| > 448 -> +-448) and NaN included.
    rng = np.random.default_rng()
    x = (rng.standard_normal((2, 5, 7, 24)) * 40).astype(np.float16)
    x.reshape(-1)[:3] = [np.float16(60000), np.float16(-60000), np.float16(np.nan)]
    s = 0.125
    got = QUANT.reference(x, inv_scale=1 / s)
    want = ort_quantize(x.astype(np.float32), s)
    assert got.dtype == np.uint8 and got.shape == x.shape
    assert np.array_equal(got, want)
    assert got.reshape(-1)[0] == 0x7E and got.reshape(-1)[1] == 0xFE and got.reshape(-1)[2] & 0x7F == 0x7F


def test_quantize_reference_matches_quantize_linear_within_one_step_for_any_scale() -> None:
    # x * fl(1/s) and x / s differ in the last fp32 bit at most: a different e4m3 byte only where the
    # value sits on a rounding tie's edge, never more than one step (tolerance: 0.1% of the bytes).
    rng = np.random.default_rng()
    x = (rng.standard_normal((1, 9, 11, 32)) * 3).astype(np.float16)
    s = float(np.abs(x).max()) / 448
    got = QUANT.reference(x, inv_scale=float(np.float32(1 / s)))
    want = ort_quantize(x.astype(np.float32), s)
    differ = got != want
    assert differ.mean() <= 1e-3
    steps = np.abs(got[differ].astype(np.int16) - want[differ].astype(np.int16))
    assert (steps <= 1).all()
    assert np.abs(from_e4m3(got) * s - x.astype(np.float64)).max() <= 448 * s / 16  # e4m3: 3 mantissa bits


def test_quantize_prepares_the_argument_list_its_ptx_takes() -> None:
    call = KernelCall("quantize_fp8", ("x",), ("xq",), (), (("inv_scale", f32_bits(4.0)),), ("q",))
    x, y = GpuTensor(0x1000, (2, 5, 7, 48), f16, ld=64), GpuTensor(0x2000, (2, 5, 7, 48), u8)
    p = QUANT.prepare_inputs(call, [x], y, [], ctx=None)  # type: ignore[arg-type]
    assert p.entry == "quantize_fp8_f16" and QUANT.entries == ("quantize_fp8_f16",)
    assert [v for v, _ in p.args] == [0x1000, 0x2000, 2, 5, 7, 48, 64, 4.0]
    assert kinds(p.args) == ptx_param_kinds("quantize_fp8", p.entry) == "PPIIIIIF"
    assert p.config.block == (256, 1, 1) and p.config.grid == (-(-2 * 5 * 7 * 6 // 256), 1, 1)  # 8 channels a thread
    odd = QUANT.prepare_inputs(
        call, [GpuTensor(0x1000, (1, 3, 3, 20), f16)], GpuTensor(0x2000, (1, 3, 3, 20), u8), [], None
    )  # type: ignore[arg-type]
    assert odd.config.grid == (1, 1, 1) and [v for v, _ in odd.args][5:7] == [20, 20]


def test_quantize_refuses_what_it_cannot_write() -> None:
    call = KernelCall("quantize_fp8", ("x",), ("xq",), (), (("inv_scale", f32_bits(2.0)),), ("q",))
    x = GpuTensor(0x1000, (1, 4, 4, 32), f16)
    with pytest.raises(InputError, match="writes uint8 of x's shape"):
        QUANT.prepare_inputs(call, [x], GpuTensor(0x2000, (1, 4, 4, 32), f16), [], None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="dense e4m3 tensor; its channel stride 48 must be C=32"):
        QUANT.prepare_inputs(call, [x], GpuTensor(0x2000, (1, 4, 4, 32), u8, ld=48), [], None)  # type: ignore[arg-type]
    bad = KernelCall("quantize_fp8", ("x",), ("xq",), (), (("inv_scale", f32_bits(float("inf"))),), ("q",))
    with pytest.raises(InputError, match="inv_scale=inf must be a finite positive float"):
        QUANT.prepare_inputs(bad, [x], GpuTensor(0x2000, (1, 4, 4, 32), u8), [], None)  # type: ignore[arg-type]


def test_fp8_runs_on_sm90_only() -> None:
    assert fp8_available(for_target("h100")) and fp8_available(REFERENCE)
    assert not fp8_available(for_target("sm_89")) and not fp8_available(for_target("sm_120"))
    assert QUANT.available(REFERENCE) and CONV.available(REFERENCE)
    assert QUANT.ptx_arches == CONV.ptx_arches == ("compute_90a",)
    assert spec_for_stem("conv3x3_wgmma") is CONV3X3_WGMMA and CONV.source == CONV3X3_WGMMA.stem
    assert CONV.defines() == CONV3X3_WGMMA.defines()


# -- conv_fp8: weights, reference, supports ----------------------------------------------------------


def conv_call(geom: ConvGeometry | None, x_scale: float, *, bias: bool = True, act: Activation | None = None,
              residual: bool = False, relu: bool = False) -> KernelCall:  # fmt: skip
    """A conv_fp8 call as the compiler writes it: the general conv's attrs (``geom``) or conv3x3's (None)."""
    ins = ("xq", "r") if residual else ("xq",)
    weights = ("W", "B") if bias else ("W",)
    if geom is None:
        attrs: tuple[tuple[str, int], ...] = (("relu", int(relu)),)
    else:
        attrs = (*geom.attrs(), *(act or Activation()).attrs(), ("residual", int(residual)))
    return KernelCall("conv_fp8", ins, ("y",), weights, (*attrs, ("x_scale", f32_bits(x_scale))), ("conv",))


PAD1: dict[str, int] = {"R": 3, "S": 3, "pad_top": 1, "pad_left": 1, "pad_bottom": 1, "pad_right": 1}
G3 = ConvGeometry(**PAD1)
G1 = ConvGeometry(1, 1)


def test_pack_weights_round_trips_per_output_channel() -> None:
    rng = np.random.default_rng()
    K, C = 24, 32
    w = rng.standard_normal((K, C, 3, 3)) * rng.uniform(0.01, 3, (K, 1, 1, 1))
    w[5] = 0.0  # an all-zero filter keeps a positive scale
    s_x = 0.0371
    packed = CONV.pack_weights(conv_call(G3, s_x), {"W": w.astype(np.float32), "B": np.arange(K, dtype=np.float16)})
    assert packed["B"].dtype == np.float32 and packed["B"].shape == (K,)
    flat = packed["W"]
    assert flat.dtype == np.uint8 and flat.ndim == 1 and flat.size == K * 9 * C + 4 * K
    wq, dequant = split_packed(flat, K, 9)
    _, s_w, _ = quantize_weights(w, s_x)
    assert np.allclose(dequant, s_x * s_w, rtol=1e-7) and dequant.dtype == np.float32
    back = from_e4m3(wq).reshape(K, 3, 3, C).transpose(0, 3, 1, 2) * s_w[:, None, None, None]
    amax = np.abs(w).reshape(K, -1).max(axis=1)
    assert np.all(np.abs(back - w) <= amax[:, None, None, None] / 16 + 1e-30)  # half an e4m3 step at the top
    assert np.all(np.abs(from_e4m3(wq)).reshape(K, -1).max(axis=1)[amax > 0] == 448)  # each filter's amax -> 448
    assert not back[5].any() and s_w[5] > 0
    one = CONV.pack_weights(conv_call(G1, s_x, bias=False), {"W": w[:, :, :1, :1].astype(np.float32)})
    assert set(one) == {"W"} and one["W"].size == K * C + 4 * K


def onnx_conv(x: np.ndarray | None, xq: np.ndarray | None, s_x: float, w: np.ndarray, b: np.ndarray,
              res: np.ndarray | None, pad: int) -> np.ndarray:  # fmt: skip
    """onnxruntime, NHWC outside: Relu(Conv(x) + b [+ res]) where x is DequantizeLinear(xq, s_x) (per
    tensor) and the weights DequantizeLinear(e4m3, s_w) (per output channel), or with ``x`` given, the
    fp32 conv of the unquantized tensors. The inputs are initializers (e4m3 as raw float8 bytes)."""
    K = w.shape[0]
    if x is None:
        assert xq is not None
        wq, s_w, _ = quantize_weights(w, s_x)
        wq_oihw = np.ascontiguousarray(wq.transpose(0, 3, 1, 2))
        inits = [
            helper.make_tensor("zp", F8, [], [0.0]),
            helper.make_tensor("wzp", F8, [K], [0.0] * K),
            numpy_helper.from_array(np.array(s_x, np.float32), "sx"),
            numpy_helper.from_array(s_w.astype(np.float32), "sw"),
            helper.make_tensor("wq", F8, list(wq_oihw.shape), wq_oihw.tobytes(), raw=True),
            helper.make_tensor("xq", F8, list(xq.shape), np.ascontiguousarray(xq).tobytes(), raw=True),
        ]
        nodes = [
            helper.make_node("DequantizeLinear", ["xq", "sx", "zp"], ["x_nhwc"]),
            helper.make_node("DequantizeLinear", ["wq", "sw", "wzp"], ["w"], axis=0),
        ]
    else:
        inits = [
            numpy_helper.from_array(x.astype(np.float32), "x_nhwc"),
            numpy_helper.from_array(w.astype(np.float32), "w"),
        ]
        nodes = []
    inits.append(numpy_helper.from_array(b.astype(np.float32), "b"))
    nodes += [
        helper.make_node("Transpose", ["x_nhwc"], ["x"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4),
    ]
    feed: dict[str, np.ndarray] = {}
    inputs = []
    last = "c"
    if res is not None:
        feed["r"] = np.ascontiguousarray(res.transpose(0, 3, 1, 2).astype(np.float32))
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, list(feed["r"].shape)))
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        last = "s"
    nodes += [helper.make_node("Relu", [last], ["y"]), helper.make_node("Transpose", ["y"], ["out"], perm=[0, 2, 3, 1])]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    return ort_run(nodes, feed, inits, [out], inputs)[0]


@pytest.mark.parametrize(("geom", "residual"), [(G3, False), (G3, True), (G1, True), (None, False)])
def test_conv_reference_is_onnxruntimes_dequantized_conv(geom: ConvGeometry | None, residual: bool) -> None:
    # Tolerance: the reference rounds once to fp16 (rel. 2^-11) and ORT sums in fp32: rel-L2 <= 1e-3.
    rng = np.random.default_rng()
    N, H, W, C, K = 2, 7, 9, 48, 40
    R = 1 if geom is G1 else 3
    x = rng.standard_normal((N, H, W, C)).astype(np.float32)
    s_x = float(np.abs(x).max()) / 448
    xq = to_e4m3(x / s_x)
    w = (rng.standard_normal((K, C, R, R)) / np.sqrt(C * R * R)).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32) * 0.1
    res = rng.standard_normal((N, H, W, K)).astype(np.float16) if residual else None
    act = Activation.named("relu")
    call = conv_call(geom, s_x, act=act, residual=residual, relu=True)
    got = CONV.run_reference(call, [xq, *([res] if residual else [])], {"W": w, "B": b})
    want = onnx_conv(None, xq, s_x, w, b, res, pad=R // 2)
    assert got.dtype == np.float16 and got.shape == (N, H, W, K)
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert err <= 1e-3, err
    # what FP8 costs against the fp32 conv of the unquantized tensors: printed (calibration's business)
    exact = onnx_conv(x, None, s_x, w, b, res, pad=R // 2)
    fp8 = np.linalg.norm(got.astype(np.float64) - exact) / np.linalg.norm(exact)
    print(
        f"conv_fp8 {R}x{R} residual={residual}: rel-L2 {err:.1e} vs ORT's dequantized conv, {fp8:.1e} vs the fp32 conv"
    )


def test_supports_says_why_a_call_stays_fp16() -> None:
    s = 0.02
    assert CONV.supports(conv_call(G3, s), C=48, K=40) is None
    assert CONV.supports(conv_call(G1, s), C=16, K=8) is None
    assert CONV.supports(conv_call(None, s, relu=True)) is None  # a conv3x3 call's attrs: 3x3 pad 1
    cases = {
        "stride 2,2 dilation 1,1 pads 1,1,1,1: conv_fp8 takes 3x3 and 1x1 windows, stride 1, dilation 1": (
            ConvGeometry(3, 3, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1), 48, 40),
        "group=2: conv_fp8 takes group 1": (ConvGeometry(**PAD1, groups=2), 48, 40),
        "5x5 stride 1,1": (ConvGeometry(5, 5, pad_top=2, pad_left=2, pad_bottom=2, pad_right=2), 48, 40),
        "takes padding 1 on every side of a 3x3 window": (ConvGeometry(3, 3), 48, 40),
        "dilation 2,2": (ConvGeometry(3, 3, dil_h=2, dil_w=2, **{k: 2 for k in PAD1 if k.startswith("pad")}), 48, 40),
        "C=24: the e4m3 rows' TMA rows need C % 16 == 0": (G3, 24, 40),
        "K=12: the epilogue's 16-byte stores need K % 8 == 0": (G1, 48, 12),
    }  # fmt: skip
    for want, (g, C, K) in cases.items():
        why = CONV.supports(conv_call(g, s), C=C, K=K)
        assert why is not None and want in why, (want, why)
    for bad in (0.0, float("nan"), -1.0):
        assert "x_scale" in (CONV.supports(conv_call(G3, bad)) or "")
    with pytest.raises(InputError, match="C=24: the e4m3 rows' TMA rows need C % 16 == 0; keep the layer fp16"):
        CONV.pack_weights(conv_call(G3, s), {"W": np.ones((8, 24, 3, 3), np.float32)})


# -- the e4m3 rows of the wgmma family ---------------------------------------------------------------


def test_the_e4m3_rows_are_rows_of_the_wgmma_family() -> None:
    macro = CONV3X3_WGMMA.defines()["CONV_WGMMA_ENTRIES"]
    assert CONV.entries == tuple(c.entry for c in E4M3_CONFIGS)
    assert set(CONV.entries) <= set(CONV3X3_WGMMA.entries) and not set(CONV.entries) & {
        c.entry for c in CONV3X3_WGMMA.configs
    }
    for c in E4M3_CONFIGS:
        kind = "CONV_WGMMA_E4M3_1X1_ENTRY" if c.pointwise else "CONV_WGMMA_E4M3_ENTRY"
        assert macro.split().count(f"{kind}({c.bn},{c.mt},{c.wgs},{c.bk},{c.stages},{c.min_blocks})") == 1
        assert c.entry.startswith("conv3x3_wgmma_e4m3_") and c.item_bytes == 1 and c.map_dtype == "uint8"
        assert c.row_bytes in (64, 128) and c.bk in (64, 128) and not c.halo_tw
        assert (c.a_rows * c.row_bytes) % 1024 == 0 and (c.bn * c.row_bytes) % 1024 == 0
        assert c.smem_bytes <= MAX_DYNAMIC_SMEM
        assert (c.smem_bytes + c.static_smem_bytes + 1024) * c.min_blocks <= SMEM_PER_SM, c
        assert c.bm * (c.bn + 8) * 2 <= c.stages * c.stage_bytes  # the epilogue's staging reuses the pipeline
        assert CONV3X3_WGMMA.config(c.entry) is c


def test_the_e4m3_maps_are_uint8_with_one_byte_rows() -> None:
    c = CONV3X3_WGMMA.config("conv3x3_wgmma_e4m3_bn128_mt2_wg2_bk128")
    m = input_map(c, 0x10000, 2, 9, 13, 144, 144)
    assert (m.dtype, m.dims, m.strides, m.box, m.swizzle_bytes) == (
        "uint8", (144, 13, 9, 2), (144, 13 * 144, 9 * 13 * 144), (128, 16, 16, 1), 128,
    )  # fmt: skip
    w = weight_map(c, 0x20000, 136, 144)
    assert (w.dims, w.strides, w.box, w.element_bytes) == ((9 * 144, 136), (9 * 144,), (128, 128), 1)
    assert m.box_bytes + w.box_bytes == c.stage_bytes  # what the producer's expect_tx counts
    pw = CONV3X3_WGMMA.config("conv3x3_wgmma_e4m3_bn64_mt1_wg2_bk64_1x1")
    assert input_map(pw, 0x10000, 3, 5, 7, 48, 48).dims == (48, 105) and pw.row_bytes == 64
    with pytest.raises(InputError, match="stride 1 = 24 bytes is not a positive multiple of 16"):
        input_map(c, 0x10000, 1, 4, 4, 24, 24)


def test_choose_picks_e4m3_rows_that_fit_the_channels() -> None:
    from dualtrack.kernels.problems import ConvProblem

    big = CONV.choose(ConvProblem.dense(8, 64, 64, 256, 256))
    assert big.entry == "conv3x3_wgmma_e4m3_bn128_mt2_wg2_bk128"
    assert CONV.choose(ConvProblem.dense(1, 9, 11, 48, 40)).bk == 64  # C <= 64: 64-channel rows
    narrow = CONV.choose(ConvProblem.dense(1, 9, 11, 144, 8))
    assert narrow.bn == 32 and not narrow.pointwise
    pw = CONV.choose(ConvProblem.dense(3, 7, 9, 144, 136), pointwise=True)
    assert pw.pointwise and pw.e4m3 and pw.bn <= 160


# -- prepared launches against the PTX ---------------------------------------------------------------


class EncodedMap:
    def __init__(self, m: TiledMap) -> None:
        self.m = m

    def getPtr(self) -> int:  # cuda.bindings' spelling
        return 0


class Context:
    def __init__(self, wgmma_off: str | None = None) -> None:
        self.wgmma_off = wgmma_off
        self.device = REFERENCE
        self.maps: list[TiledMap] = []

    def tuned_entry(self, call: KernelCall, batch: int) -> str | None:
        return None

    def tensor_map(self, m: TiledMap) -> EncodedMap:
        self.maps.append(m)
        return EncodedMap(m)

    def workspace(self, nbytes: int) -> int:
        self.workspace_bytes = nbytes
        return 0x9000


def kinds(args: list[tuple[Any, Any]]) -> str:
    table = {ctypes.c_void_p: "P", ctypes.c_int32: "I", ctypes.c_float: "F"}
    return "".join("M" if t is None else table[t] for _, t in args)


def ptx_param_kinds(stem: str, entry: str) -> str:
    """An entry's parameters as the checked-in compute_90a PTX declares them (M: a 128-byte struct by value)."""
    text = (PTX / f"{stem}.ptx").read_text()
    head = text[text.index(f".entry {entry}(") :]
    params = head[: head.index(")")]
    found = re.findall(r"\.param (?:\.align \d+ )?(\.\w+)(?: \w+\[(\d+)\])?", params)
    return "".join("M" if t == ".b8" else {".u64": "P", ".u32": "I", ".f32": "F"}[t] for t, _ in found)


def test_conv_fp8_prepares_the_argument_list_its_ptx_takes() -> None:
    N, H, W, C, K = 2, 9, 13, 144, 136
    call = conv_call(G3, 0.05, act=Activation.named("silu"), residual=True)
    xq = GpuTensor(0x10000, (N, H, W, C), u8)
    y, r = GpuTensor(0x20000, (N, H, W, K), f16, ld=144), GpuTensor(0x30000, (N, H, W, K), f16)
    w, b = GpuTensor(0x40000, (K * (9 * C + 4),), u8), GpuTensor(0x50000, (K,), f32)
    ctx = Context()
    p = CONV.prepare_inputs(call, [xq, r], y, [w, b], ctx)  # type: ignore[arg-type]
    assert p.entry in CONV.entries and p.choice is not None and p.choice.impl == "wgmma"
    assert kinds(p.args) == ptx_param_kinds("conv3x3_wgmma", p.entry) == "MMPPPPIIIIIIIIFFIIPP"
    v = dict(zip(CONV.PARAMS, [a for a, _ in p.args], strict=True))
    assert (v["bias"], v["dequant"], v["res"], v["y"]) == (0x50000, 0x40000 + 9 * C * K, 0x30000, 0x20000)
    assert (v["N"], v["H"], v["W"], v["C"], v["K"], v["ldy"], v["ldr"]) == (N, H, W, C, K, 144, K)
    assert v["act"] == Activation.named("silu").code
    assert [m.dtype for m in ctx.maps] == ["uint8", "uint8"] and ctx.maps[1].address == 0x40000
    cfg = CONV3X3_WGMMA.config(p.entry)
    assert p.config.block == (cfg.threads, 1, 1) and p.config.shared_bytes == cfg.smem_bytes
    assert p.config.grid[0] == cfg.ctas(N, H, W, K) and p.config.grid[1] == p.choice.splits
    assert (v["ws"] == 0x9000) == (p.choice.splits > 1)


def test_conv_fp8_1x1_from_a_conv1x1_call_reads_its_window_from_the_weights() -> None:
    N, H, W, C, K = 3, 5, 7, 48, 40
    call = conv_call(None, 0.05, relu=True, bias=False)  # conv1x1's attrs: relu only
    xq, y = GpuTensor(0x10000, (N, H, W, C), u8), GpuTensor(0x20000, (N, H, W, K), f16)
    w = GpuTensor(0x40000, (K * (C + 4),), u8)
    ctx = Context()
    p = CONV.prepare_inputs(call, [xq], y, [w], ctx)  # type: ignore[arg-type]
    assert p.entry.endswith("_1x1") and kinds(p.args) == ptx_param_kinds("conv3x3_wgmma", p.entry)
    v = dict(zip(CONV.PARAMS, [a for a, _ in p.args], strict=True))
    assert (v["bias"], v["dequant"], v["res"], v["act"]) == (0, 0x40000 + C * K, 0, Activation.named("relu").code)
    assert ctx.maps[0].dims == (C, N * H * W)


def test_conv_fp8_refuses_launches_it_cannot_take() -> None:
    call = conv_call(G3, 0.05)
    xq, y = GpuTensor(0x10000, (1, 4, 4, 32), u8), GpuTensor(0x20000, (1, 4, 4, 16), f16)
    w, b = GpuTensor(0x40000, (16 * (9 * 32 + 4),), u8), GpuTensor(0x50000, (16,), f32)
    with pytest.raises(InputError, match=r"needs the wgmma kernel \(off\); build with precision fp16"):
        CONV.prepare_inputs(call, [xq], y, [w, b], Context("off"))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="reads uint8 \\(e4m3\\) and writes fp16"):
        CONV.prepare_inputs(call, [GpuTensor(0x10000, (1, 4, 4, 32), f16)], y, [w, b], Context())  # type: ignore[arg-type]
    with pytest.raises(InputError, match="ldx=40 bytes"):
        CONV.prepare_inputs(call, [GpuTensor(0x10000, (1, 4, 4, 32), u8, ld=40)], y, [w, b], Context())  # type: ignore[arg-type]
    with pytest.raises(InputError, match="are not this call's packed weights"):
        CONV.prepare_inputs(call, [xq], y, [GpuTensor(0x40000, (16, 3, 3, 32), u8), b], Context())  # type: ignore[arg-type]


def test_the_cost_model_charges_conv_fp8_at_twice_the_wgmma_rate() -> None:
    from dualtrack.compiler import cost

    rates = cost.load_rates()
    for device in ("h200", "h100"):
        r = rates[device]
        assert r.track_a_fp8 is not None and r.track_a_wgmma is not None
        assert r.track_a_for("conv_fp8") is r.track_a_fp8 and r.track_a_fp8.tflops == 2 * r.track_a_wgmma.tflops
        assert r.track_a_for("quantize_fp8") is r.track_a_simt  # a bytes-bound pass
        assert cost.parse_rates({"rows": {device: r.to_json()}})[device] == r  # the row round-trips
    assert rates["sm_80"].track_a_fp8 is None and rates["sm_80"].track_a_for("conv_fp8") is rates["sm_80"].track_a_conv
