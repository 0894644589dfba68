"""The general conv op (``conv``, conv_nhwc.cu) on the CPU: its numpy reference against float64
loops and onnxruntime on odd shapes, every activation and the residual; the predicate; launch
geometry and the argument list of the ABI (handwritten_ptx/README.md)."""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import KERNELS, Activation, ConvGeneralSpec, ConvGeometry, pack_conv_weights
from dualtrack.kernels.device import REFERENCE
from dualtrack.runtime.tensors import GpuTensor

SPEC = KERNELS["conv"]
assert isinstance(SPEC, ConvGeneralSpec)
# The activations act64 writes out independently, as the table's rows with their parameters.
ACTS = {
    "none": Activation(),
    "relu": Activation.named("relu"),
    "relu6": Activation.named("clip", 0.0, 6.0),
    "hardswish": Activation.named("hardswish"),
    "hardsigmoid": Activation.named("hardsigmoid", 1 / 6, 0.5),
    "sigmoid": Activation.named("sigmoid"),
    "silu": Activation.named("silu"),
}


def act64(v: np.ndarray, act: str) -> np.ndarray:
    """The activations in float64, written from their ONNX definitions."""
    if act == "relu":
        return np.maximum(v, 0)
    if act == "relu6":
        return np.minimum(np.maximum(v, 0), 6)
    if act == "hardswish":
        return v * np.maximum(0, np.minimum(1, v / 6 + 0.5))
    if act == "hardsigmoid":
        return np.maximum(0, np.minimum(1, v / 6 + 0.5))
    if act == "sigmoid":
        return 1 / (1 + np.exp(-v))
    if act == "silu":
        return v / (1 + np.exp(-v))
    return v


def conv_loops(x: np.ndarray, w: np.ndarray, bias, res, g: ConvGeometry, act: str) -> np.ndarray:
    """float64 conv by loops over output pixels and taps, bounds-checked against the unpadded input."""
    N, H, W, _ = x.shape
    K = w.shape[0]
    P, Q = g.output_hw(H, W)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    out = np.zeros((N, P, Q, K))
    for n in range(N):
        for p in range(P):
            for q in range(Q):
                acc = np.zeros(K) if bias is None else bias.astype(np.float64).copy()
                for r in range(g.R):
                    for s in range(g.S):
                        h = p * g.stride_h - g.pad_top + r * g.dil_h
                        v = q * g.stride_w - g.pad_left + s * g.dil_w
                        if 0 <= h < H and 0 <= v < W:
                            acc += w64[:, r, s, :] @ x64[n, h, v, :]
                if res is not None:
                    acc += res[n, p, q].astype(np.float64)
                out[n, p, q] = act64(acc, act)
    return out


def bound(x, w, bias, res, g, act, dtype) -> np.ndarray:
    """Error allowed to the reference: float32 sums (1e-5 of the sum of |terms|, which a Lipschitz-1
    activation does not grow), a float32 exp, and for float16 one rounding to nearest."""
    mag = conv_loops(np.abs(x), np.abs(w), None if bias is None else np.abs(bias), None, g, "none")
    if res is not None:
        mag = mag + np.abs(res.astype(np.float64))
    b = 1e-5 * mag + 1e-6
    if dtype == "float16":
        b = b + 2.0**-11 * np.abs(conv_loops(x, w, bias, res, g, act)) + 2.0**-24
    return b


def random_case(rng, dtype, N, H, W, C, K, g: ConvGeometry, *, residual: bool):
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = (rng.standard_normal((K, g.R, g.S, C)) / math.sqrt(g.R * g.S * C)).astype(dtype)
    b = rng.standard_normal(K).astype(np.float32)
    P, Q = g.output_hw(H, W)
    res = rng.standard_normal((N, P, Q, K)).astype(dtype) if residual else None
    return x, w, b, res


GEOMS = {
    "stem 7x7/2 pad 3": ConvGeometry(7, 7, 2, 2, pad_top=3, pad_left=3, pad_bottom=3, pad_right=3),
    "3x3/2 pad 1": ConvGeometry(3, 3, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1),
    "1x1/2 downsample": ConvGeometry(1, 1, 2, 2),
    "3x3/1 pad 1": ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1),
    "5x5 dilation 2 pad 4": ConvGeometry(5, 5, dil_h=2, dil_w=2, pad_top=4, pad_left=4, pad_bottom=4, pad_right=4),
    "3x5 stride 2,1 asymmetric pads": ConvGeometry(3, 5, 2, 1, pad_top=0, pad_left=2, pad_bottom=2, pad_right=1),
    "5x5 valid": ConvGeometry(5, 5),
}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("geom", list(GEOMS), ids=list(GEOMS))
@pytest.mark.parametrize(("act", "residual"), [("relu", True), ("none", False), ("silu", True), ("hardswish", False)])
def test_reference_matches_float64_loops(dtype: str, geom: str, act: str, residual: bool) -> None:
    rng = np.random.default_rng()
    g = GEOMS[geom]
    x, w, b, res = random_case(rng, dtype, 2, 11, 9, 5, 7, g, residual=residual)
    got = SPEC.reference(x, w, b, res, geom=g, act=ACTS[act])
    assert got.dtype == np.dtype(dtype) and got.shape == SPEC.output_shape(2, 11, 9, 5, 7, geom=g)
    exact = conv_loops(x, w, b, res, g, act)
    err = np.abs(got.astype(np.float64) - exact)
    assert (err <= bound(x, w, b, res, g, act, dtype)).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("act", list(ACTS))
def test_every_activation_matches_float64(act: str) -> None:
    rng = np.random.default_rng()
    g = GEOMS["3x3/1 pad 1"]
    x, w, b, res = random_case(rng, "float32", 1, 6, 7, 3, 4, g, residual=True)
    x *= 4  # outputs well past the activations' knees (|v| > 3, 6)
    got = SPEC.reference(x, w, b, res, geom=g, act=ACTS[act])
    exact = conv_loops(x, w, b, res, g, act)
    assert np.abs(got - exact).max() <= 1e-5 * max(1.0, np.abs(exact).max())
    if act != "none":
        assert not np.allclose(exact, conv_loops(x, w, b, res, g, "none"))  # the activation did something


def _onnx_conv(x_nchw, w_oihw, b, g: ConvGeometry, auto_pad: str | None = None) -> np.ndarray:
    attrs = {"kernel_shape": [g.R, g.S], "strides": [g.stride_h, g.stride_w], "dilations": [g.dil_h, g.dil_w]}
    if auto_pad:
        attrs["auto_pad"] = auto_pad
    else:
        attrs["pads"] = [g.pad_top, g.pad_left, g.pad_bottom, g.pad_right]
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_nchw.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w_oihw, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x_nchw})[0]


@pytest.mark.parametrize("geom", list(GEOMS), ids=list(GEOMS))
def test_reference_matches_onnxruntime(geom: str) -> None:
    """The ONNX Conv on ONNX-layout weights, through pack_conv_weights (any kernel size)."""
    rng = np.random.default_rng()
    g = GEOMS[geom]
    x = rng.standard_normal((2, 13, 10, 6)).astype(np.float32)
    w_oihw = rng.standard_normal((9, 6, g.R, g.S)).astype(np.float32)
    b = rng.standard_normal(9).astype(np.float32)
    wp, bp = pack_conv_weights(w_oihw, b, any_size=True)
    got = SPEC.reference(x, wp, bp, geom=g)
    ref = _onnx_conv(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), w_oihw, b, g).transpose(0, 2, 3, 1)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_run_reference_reads_the_call() -> None:
    """A plan call: geometry, act and the residual (its second input) come from the call."""
    rng = np.random.default_rng()
    g = GEOMS["3x3/2 pad 1"]
    x, w, b, res = random_case(rng, "float32", 1, 8, 8, 4, 6, g, residual=True)
    w_onnx = np.ascontiguousarray(w.transpose(0, 3, 1, 2))
    call = KernelCall(
        "conv", ("x", "r"), ("y",), ("w", "b"), (*g.attrs(), ("act", ACTS["relu"].code), ("residual", 1)), ("c",)
    )
    assert ConvGeometry.from_call(call) == g
    got = SPEC.run_reference(call, [x, res], {"w": w_onnx, "b": b})
    np.testing.assert_array_equal(got, SPEC.reference(x, w, b, res, geom=g, act=ACTS["relu"]))


def test_supports_names_what_it_refuses() -> None:
    ok = ConvGeometry(3, 3)
    assert SPEC.supports("float16", 8, 8, 3, 4, ok) is None
    assert SPEC.supports("float16", 8, 8, 32, 32, ConvGeometry(3, 3, groups=32)) is None  # grouped: per-group GEMMs
    assert "group=4 does not divide C=30" in (
        SPEC.supports("float16", 8, 8, 30, 32, ConvGeometry(3, 3, groups=4)) or ""
    )
    assert "int8" in (SPEC.supports("int8", 8, 8, 3, 4, ok) or "")
    assert "kernel 17x3" in (SPEC.supports("float16", 32, 32, 3, 4, ConvGeometry(17, 3)) or "")
    assert "negative padding" in (SPEC.supports("float16", 8, 8, 3, 4, ConvGeometry(3, 3, pad_top=-1)) or "")
    assert "empty output" in (SPEC.supports("float16", 2, 2, 3, 4, ConvGeometry(5, 5)) or "")
    assert "must be >= 1" in (SPEC.supports("float16", 8, 8, 3, 4, ConvGeometry(3, 3, stride_h=0)) or "")
    with pytest.raises(InputError, match="empty output"):
        SPEC.output_shape(1, 2, 2, 3, 4, geom=ConvGeometry(5, 5))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("N", "H", "W", "C", "K", "geom"),
    [
        (1, 512, 512, 3, 64, "stem 7x7/2 pad 3"),
        (8, 128, 128, 64, 128, "3x3/2 pad 1"),
        (1, 16, 16, 512, 512, "3x3/1 pad 1"),
        (3, 7, 5, 5, 9, "3x5 stride 2,1 asymmetric pads"),
        (1, 64, 64, 64, 20, "1x1/2 downsample"),
    ],
)
def test_launch_covers_the_output(dtype: str, N: int, H: int, W: int, C: int, K: int, geom: str) -> None:
    g = GEOMS[geom]
    _, P, Q, _ = SPEC.output_shape(N, H, W, C, K, geom=g)
    entry = SPEC.variant(dtype, N, H, W, C, K, g)
    assert entry in SPEC.entries
    cfg = SPEC.launch(dtype, N, H, W, C, K, geom=g, entry=entry)
    if entry in SPEC.stem_tiles():  # the stem entries walk their tiles in a grid-stride loop (test_conv_stem.py)
        assert cfg.grid[1] * SPEC.stem_tiles()[entry].bn >= K and cfg.shared_bytes > 0
        return
    if dtype == "float16":
        tile = SPEC.f16_tiles()[entry]
        bm, bn, threads = tile.bm, tile.bn, tile.threads
    else:
        bm, bn, threads = SPEC.f32[0], SPEC.f32[1], 256
    assert cfg.block == (threads, 1, 1)
    assert cfg.grid[0] * bm >= N * P * Q > (cfg.grid[0] - 1) * bm
    assert cfg.grid[1] * bn >= K > (cfg.grid[1] - 1) * bn


def test_variants_follow_the_shape() -> None:
    g = GEOMS["3x3/1 pad 1"]
    assert SPEC.variant("float16", 1, 64, 64, 64, 32, g) == "conv_nhwc_f16_narrow"
    assert SPEC.variant("float16", 8, 128, 128, 64, 128, g) == "conv_nhwc_f16_wide"
    assert SPEC.variant("float16", 8, 128, 128, 64, 64, g) == "conv_nhwc_f16"
    assert SPEC.variant("float16", 4, 32, 32, 256, 256, g) == "conv_nhwc_f16_small"
    assert SPEC.variant("float16", 1, 16, 16, 512, 512, g) == "conv_nhwc_f16_small"  # deep is off by default
    assert SPEC.variant("float32", 1, 16, 16, 512, 512, g) == "conv_nhwc_f32"
    assert SPEC.variant("float16", 1, 64, 64, 3, 64, g) == "conv_nhwc_f16_stem"  # C <= 8: the patch in shared memory
    assert SPEC.variant("float16", 1, 64, 64, 12, 64, g) == "conv_nhwc_f16_gather"  # C % 8 != 0
    assert SPEC.variant("float16", 8, 512, 512, 16, 2, g) == "conv_nhwc_f16_direct"  # a head's classes
    assert SPEC.variant("float16", 1, 64, 64, 3, 8, g) == "conv_nhwc_f16_direct"
    assert SPEC.variant("float16", 1, 64, 64, 512, 2, g) == "conv_nhwc_f16_narrow"  # filters too big for it


def test_direct_entry_launch_and_limits() -> None:
    g = GEOMS["3x3/1 pad 1"]
    cfg = SPEC.launch("float16", 2, 37, 29, 16, 2, geom=g)
    assert cfg.block == (SPEC.direct_threads, 1, 1) and cfg.grid[0] * SPEC.direct_threads >= 2 * 37 * 29
    assert SPEC.direct_supported(16, 9, g) == "K=9 > 8 output channels"
    with pytest.raises(InputError, match="conv_nhwc_f16_direct cannot run this convolution: K=16 > 8"):
        SPEC.launch("float16", 1, 8, 8, 16, 16, geom=g, entry=SPEC.direct_entry)


def test_args_follow_the_abi() -> None:
    g = ConvGeometry(7, 5, 2, 1, 1, 2, pad_top=3, pad_left=4, pad_bottom=2, pad_right=1)
    args = SPEC.args(
        x=0x10,
        w=0x20,
        bias=0x30,
        res=0x40,
        y=0x50,
        N=2,
        H=21,
        W=19,
        C=3,
        K=5,
        geom=g,
        ldx=8,
        ldy=16,
        ldr=24,
        act=ACTS["relu6"],
    )
    P, Q = g.output_hw(21, 19)
    assert [v for v, _ in args] == [
        0x10,
        0x20,
        0x30,
        0x40,
        0x50,
        0,  # ws: no split-K
        2,
        21,
        19,
        3,
        5,
        P,
        Q,
        7,
        5,
        2,
        1,
        3,
        4,
        1,
        2,
        8,
        16,
        24,
        2,
        0.0,
        6.0,
        1,  # splits
    ]
    assert [t for _, t in args] == [ctypes.c_void_p] * 6 + [ctypes.c_int32] * 19 + [ctypes.c_float] * 2 + [
        ctypes.c_int32
    ]
    dense = SPEC.args(x=1, w=2, y=3, N=1, H=4, W=4, C=3, K=6, geom=ConvGeometry(1, 1))
    assert [v for v, _ in dense][2:4] == [0, 0] and [v for v, _ in dense][-7:] == [3, 6, 6, 0, 0.0, 0.0, 1]
    with pytest.raises(InputError, match="act=9 is not an Activation"):
        SPEC.args(x=1, w=2, y=3, N=1, H=4, W=4, C=3, K=6, geom=ConvGeometry(1, 1), act=9)
    with pytest.raises(InputError, match="ldr=2 is smaller than the 6 channels"):
        SPEC.args(x=1, w=2, y=3, res=4, N=1, H=4, W=4, C=3, K=6, geom=ConvGeometry(1, 1), ldr=2)


def test_prepare_reads_the_call_and_its_tensors() -> None:
    """A plan call on device tensors (channel slices keep their strides): variant()'s entry, its
    launch and args() of the call's geometry, activation, weights and residual (no Hopper kernel)."""
    f16 = np.dtype("float16")
    ctx = SimpleNamespace(wgmma_off="not an sm_90a device", device=REFERENCE)
    g = GEOMS["3x3/2 pad 1"]
    silu = ACTS["silu"]
    call = KernelCall("conv", ("x", "r"), ("y",), ("w", "b"), (*g.attrs(), *silu.attrs(), ("residual", 1)), ("c",))
    P, Q = g.output_hw(9, 10)
    x = GpuTensor(0x1000, (2, 9, 10, 24), f16, ld=40)
    res, y = GpuTensor(0x2000, (2, P, Q, 48), f16, ld=96), GpuTensor(0x3000, (2, P, Q, 48), f16, ld=64)
    w, b = GpuTensor(0x4000, (48, 3, 3, 24), f16), GpuTensor(0x5000, (48,), np.dtype("float32"))
    got = SPEC.prepare_inputs(call, [x, res], y, [w, b], ctx=ctx)
    entry = SPEC.variant(f16, 2, 9, 10, 24, 48, g)
    assert (got.entry, got.config) == (entry, SPEC.launch(f16, 2, 9, 10, 24, 48, geom=g, entry=entry))
    assert got.args == SPEC.args(
        x=0x1000, w=0x4000, bias=0x5000, res=0x2000, y=0x3000, N=2, H=9, W=10, C=24, K=48, geom=g,
        ldx=40, ldy=64, ldr=96, act=silu,
    )  # fmt: skip
    with pytest.raises(InputError, match="has a residual input: prepare it with prepare_inputs"):
        SPEC.prepare(call, x, y, [w, b], ctx=ctx)
    with pytest.raises(InputError, match="residual has shape"):
        SPEC.prepare_inputs(call, [x, GpuTensor(0x2000, (2, P, Q + 1, 48), f16)], y, [w, b], ctx=ctx)

    plain = KernelCall("conv", ("x",), ("y",), ("w",), g.attrs(), ("c",))
    no_res = SPEC.prepare(plain, x, y, [w], ctx=ctx)
    assert no_res.args == SPEC.args(x=0x1000, w=0x4000, y=0x3000, N=2, H=9, W=10, C=24, K=48, geom=g, ldx=40, ldy=64)


def test_launch_refuses_too_many_pixels() -> None:
    with pytest.raises(InputError, match="exceeds 2\\^31-1 pixels; split the batch"):
        SPEC.launch("float16", 64, 8192, 8192, 3, 8, geom=ConvGeometry(3, 3, pad_top=1, pad_left=1))
