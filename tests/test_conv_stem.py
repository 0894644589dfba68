"""The general conv's stem entries (C <= 8, conv_stem.cuh) on the CPU: the kernel's index arithmetic
(patch, k-pair offset table, padded filters) replayed in numpy against the spec's reference, that
reference against onnxruntime on stem-shaped layers, the shared-memory bound, the launch, and which
entry a small-C convolution gets."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import KERNELS, Activation, ConvGeneralSpec, ConvGeometry, choose_conv
from dualtrack.kernels.conv_stem import SHARED_LIMIT, StemTile
from dualtrack.kernels.device import DEVICES
from dualtrack.kernels.problems import ConvProblem

SPEC = KERNELS["conv"]
assert isinstance(SPEC, ConvGeneralSpec)
STEM, NARROW = "conv_nhwc_f16_stem", "conv_nhwc_f16_stem_narrow"


def geom(R: int, S: int, stride: tuple[int, int] = (1, 1), dil: tuple[int, int] = (1, 1), pads=(0, 0, 0, 0)):
    return ConvGeometry(R, S, *stride, *dil, *pads)


# Windows no zoo model has, beside the stems that motivate the entries.
CASES = {
    "7x7/2 pad 3 (ResNet stem)": (3, geom(7, 7, (2, 2), pads=(3, 3, 3, 3))),
    "3x3/2 pad 1 C=1": (1, geom(3, 3, (2, 2), pads=(1, 1, 1, 1))),
    "3x5 stride 3,1 asymmetric C=5": (5, geom(3, 5, (3, 1), pads=(0, 2, 2, 1))),
    "5x5 dilation 2 C=2": (2, geom(5, 5, dil=(2, 2), pads=(4, 3, 1, 4))),
    "1x1/4 C=7": (7, geom(1, 1, (4, 4))),
    "11x11/4 pad 5 C=1": (1, geom(11, 11, (4, 4), pads=(5, 5, 2, 2))),
    "3x3 C=8": (8, geom(3, 3, pads=(1, 1, 1, 1))),
}


def emulate(x: np.ndarray, w: np.ndarray, g: ConvGeometry, tile: StemTile) -> np.ndarray:
    """conv_stem.cuh's arithmetic in float64: per output tile the patch ([PH][PW][CP], zero outside
    the image and past C), A[m, k] = patch half 2 * (base(m) + table[k // 2]) + k % 2, filters
    [K][KP] zero-padded; the tile's GEMM, written where the pixel is inside P x Q."""
    N, H, W, C = x.shape
    K = w.shape[0]
    P, Q = g.output_hw(H, W)
    cp = C + (C & 1)
    kk = g.R * g.S * cp
    kp = -(-kk // 16) * 16
    ph = (tile.rows - 1) * g.stride_h + (g.R - 1) * g.dil_h + 1
    pw = (tile.COLS - 1) * g.stride_w + (g.S - 1) * g.dil_w + 1
    table = np.zeros(kp // 2, np.int64)
    wp = np.zeros((K, kp))
    taps = w.reshape(K, g.R * g.S, C).astype(np.float64)
    for k in range(0, kk):
        tap, c = divmod(k, cp)
        r, s = divmod(tap, g.S)
        if k % 2 == 0:
            table[k // 2] = (r * g.dil_h * pw + s * g.dil_w) * (cp // 2) + c // 2
        if c < C:
            wp[:, k] = taps[:, tap, c]
    rows, cols = np.divmod(np.arange(tile.rows * tile.COLS), tile.COLS)
    base = (rows * g.stride_h * pw + cols * g.stride_w) * (cp // 2)
    half = 2 * (base[:, None] + table[np.arange(kp) // 2][None, :]) + np.arange(kp)[None, :] % 2
    out = np.zeros((N, P, Q, K))
    for n in range(N):
        for op0 in range(0, P, tile.rows):
            for oq0 in range(0, Q, tile.COLS):
                patch = np.zeros((ph, pw, cp))
                h0, w0 = op0 * g.stride_h - g.pad_top, oq0 * g.stride_w - g.pad_left
                for i in range(ph):
                    for j in range(pw):
                        if 0 <= h0 + i < H and 0 <= w0 + j < W:
                            patch[i, j, :C] = x[n, h0 + i, w0 + j]
                tile_out = patch.reshape(-1)[half] @ wp.T
                inside = (op0 + rows < P) & (oq0 + cols < Q)
                out[n, op0 + rows[inside], oq0 + cols[inside]] = tile_out[inside]
    return out


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("tile", ["main", "narrow"])
def test_kernel_index_arithmetic_matches_the_reference(case: str, tile: str) -> None:
    C, g = CASES[case]
    st = SPEC.stem_main if tile == "main" else SPEC.stem_narrow
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 37, 53, C)).astype(np.float32)
    w = rng.standard_normal((13, g.R, g.S, C)).astype(np.float32)
    got = emulate(x, w, g, st)
    want = SPEC.reference(x, w, geom=g).astype(np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def ort_conv(x_nhwc: np.ndarray, w_krsc: np.ndarray, b: np.ndarray, g: ConvGeometry) -> np.ndarray:
    """onnxruntime's Conv (fp32, NCHW) on NHWC data, answered NHWC."""
    K = w_krsc.shape[0]
    w = numpy_helper.from_array(w_krsc.transpose(0, 3, 1, 2).astype(np.float32), "w")
    bias = numpy_helper.from_array(b.astype(np.float32), "b")
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], kernel_shape=[g.R, g.S], strides=[g.stride_h, g.stride_w],
        dilations=[g.dil_h, g.dil_w], pads=[g.pad_top, g.pad_left, g.pad_bottom, g.pad_right],
    )  # fmt: skip
    N, H, W, C = x_nhwc.shape
    graph = helper.make_graph(
        [node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, bias],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x_nhwc.transpose(0, 3, 1, 2).astype(np.float32)})
    assert y.shape[1] == K
    return y.transpose(0, 2, 3, 1)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_reference_matches_onnxruntime_on_stem_layers(case: str) -> None:
    C, g = CASES[case]
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 37, 53, C)).astype(np.float32)
    w = (rng.standard_normal((24, g.R, g.S, C)) / math.sqrt(g.R * g.S * C)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    want = ort_conv(x, w, b, g)
    got = SPEC.reference(x, w, b, geom=g)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))


def test_small_c_layers_take_the_stem_entries() -> None:
    resnet = CASES["7x7/2 pad 3 (ResNet stem)"][1]
    monai = geom(3, 3, (2, 2), pads=(1, 1, 1, 1))
    assert SPEC.variant("float16", 8, 512, 512, 3, 64, resnet) == STEM
    assert SPEC.variant("float16", 8, 512, 512, 3, 16, monai) == NARROW  # K <= 32
    assert SPEC.variant("float16", 1, 64, 64, 8, 96, monai) == STEM  # C = 8 too: one tap a 32-deep k-tile wastes 3/4
    assert SPEC.variant("float16", 1, 64, 64, 3, 8, monai) == "conv_nhwc_f16_direct"  # a few classes first
    assert SPEC.variant("float16", 1, 64, 64, 9, 64, monai) == "conv_nhwc_f16_gather"  # C > 8
    grouped = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, groups=2)
    assert SPEC.variant("float16", 1, 64, 64, 6, 64, grouped) == "conv_nhwc_f16_gather"  # group 1 only
    assert SPEC.variant("float32", 1, 64, 64, 3, 64, resnet) == "conv_nhwc_f32"


def test_long_filters_fall_back_to_narrow_then_to_the_gather_entry() -> None:
    big = geom(11, 11, (4, 4), pads=(5, 5, 5, 5))
    assert SPEC.stem_main.refusal(2, big) is not None and SPEC.stem_narrow.refusal(2, big) is None
    assert SPEC.variant("float16", 1, 224, 224, 2, 96, big) == NARROW
    why = SPEC.stem_narrow.refusal(6, big)
    assert why is not None and "shared memory" in why
    assert SPEC.variant("float16", 1, 224, 224, 6, 96, big) == "conv_nhwc_f16_gather"
    assert SPEC.variant("float16", 1, 224, 224, 8, 96, big) == "conv_nhwc_f16_small"  # C = 8: the vector path


def test_choose_conv_gives_the_resnet_stem_the_stem_entry_on_hopper() -> None:
    g = CASES["7x7/2 pad 3 (ResNet stem)"][1]
    for key in ("h100", "h200"):
        choice = choose_conv(SPEC, ConvProblem.dense(8, 512, 512, 3, 64), DEVICES[key], window=g, act=Activation())
        assert (choice.impl, choice.entry) == ("mma.sync", STEM), choice.reason


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_launch_fits_shared_memory_and_covers_the_channels(case: str) -> None:
    C, g = CASES[case]
    N, H, W, K = 3, 37, 53, 72
    entry = SPEC.variant("float16", N, H, W, C, K, g)
    assert entry in (STEM, NARROW) and entry in SPEC.entries
    tile = SPEC.stem_tiles()[entry]
    cfg = SPEC.launch("float16", N, H, W, C, K, geom=g, entry=entry, device=DEVICES["h100"])
    P, Q = g.output_hw(H, W)
    assert cfg.block == (tile.threads, 1, 1) and cfg.shared_bytes == tile.shared_bytes(C, g) <= SHARED_LIMIT
    assert cfg.grid[0] <= N * -(-P // tile.rows) * -(-Q // tile.COLS) and cfg.grid[2] == 1
    assert cfg.grid[1] * tile.bn >= K > (cfg.grid[1] - 1) * tile.bn
    assert SPEC.threads("float16", entry) == tile.threads


def test_stem_entry_refuses_what_it_cannot_compute() -> None:
    grouped = ConvGeometry(3, 3, groups=3)
    with pytest.raises(InputError, match="group 1"):
        SPEC.launch("float16", 1, 16, 16, 6, 9, geom=grouped, entry=STEM)
    with pytest.raises(InputError, match="C=12 > 8"):
        SPEC.launch("float16", 1, 16, 16, 12, 16, geom=geom(3, 3), entry=STEM)


def test_stem_macros_reach_the_source() -> None:
    d = SPEC.defines()
    assert d["CONVG_STEM"] == SPEC.stem_main.macro() == "4,64,4"
    assert d["CONVG_STEM_NARROW"] == SPEC.stem_narrow.macro()


def test_cost_model_charges_stem_layers_at_the_stem_rate() -> None:
    from dualtrack.compiler import cost

    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[7, 7], strides=[2, 2], pads=[3, 3, 3, 3])
    specs = {"x": ((1, 3, 512, 512), "float16"), "w": ((64, 3, 7, 7), "float16"), "y": ((1, 64, 256, 256), "float16")}
    rates = cost.rates_for_target("sm_90a")
    target = cost.ConvTarget.of("sm_90a")
    assert rates.track_a_stem is not None and target.runs_stem(node, specs)
    got = cost.node_cost(node, specs, {"w"}, [8], on_a=None, kernel="conv", rates=rates, target=target)
    work = cost.node_work(node, specs, {"w"})
    assert got.a_us == pytest.approx(rates.track_a_stem.time_us(8 * work.flops, 8 * work.act_bytes + work.weight_bytes))


def test_call_of_a_stem_layer_picks_the_stem_entry_through_the_registry() -> None:
    from dualtrack.kernels import conv_choice

    g = CASES["7x7/2 pad 3 (ResNet stem)"][1]
    call = KernelCall("conv", ("x",), ("y",), ("w",), (*g.attrs(), ("act", 1), ("residual", 0)), ("stem",))
    choice = conv_choice(ConvProblem.dense(1, 512, 512, 3, 64), DEVICES["h100"], call=call)
    assert choice.entry == STEM
