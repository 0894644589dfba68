"""The 1x1 convolution (a GEMM) on the sm_90a wgmma kernel, on the CPU: its ``_1x1`` entries as rows
of the conv3x3_wgmma family, which launches the chooser gives them and which it keeps on mma.sync,
their grid, tensor maps and kernel arguments (the activation's id and parameters), the general
conv's preparation of a launch against a fake runtime, the epilogue's coverage of the activation
table, the numpy reference of what they compute against onnxruntime, and the cost model's rate.

The GPU tests (tests/gpu/test_wgmma1x1_gpu.py) run the entries against onnxruntime on an H100/H200.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from activation_cases import act_nodes, case_activation, opset
from cuda.bindings import driver as cu
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler import cost
from dualtrack.contract.activations import KINDS, Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import CONV3X3_WGMMA, WGMMA_CONFIGS, ConvGeometry, conv_choice
from dualtrack.kernels.conv3x3_wgmma import input_map, weight_map
from dualtrack.kernels.device import REFERENCE, for_target
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime import tma
from dualtrack.runtime.gpu import GpuTensor

ROOT = Path(__file__).resolve().parents[1]
WG = CONV3X3_WGMMA
GENERAL = kernels.KERNELS["conv"]
PW = tuple(c for c in WGMMA_CONFIGS if c.pointwise)
X, W_, Y, R, B = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000, 0x7F0000300000, 0x7F0000400000
ONE = ConvGeometry(1, 1)


def _call(geom: ConvGeometry = ONE, act: str = "gelu", residual: bool = False) -> KernelCall:
    ins = ("x", "r") if residual else ("x",)
    attrs = (*geom.attrs(), *Activation.named(act).attrs(), ("residual", int(residual)))
    return KernelCall("conv", ins, ("y",), ("w", "b"), attrs, ("block/pwconv1",))


# -- the entries ------------------------------------------------------------------------------------


def test_the_1x1_entries_are_rows_of_the_wgmma_family() -> None:
    assert PW and all(c.entry.endswith("_1x1") and c.entry in WG.entries for c in PW)
    macro = WG.defines()["CONV_WGMMA_ENTRIES"].split()
    for c in PW:
        assert macro.count(f"CONV_WGMMA_1X1_ENTRY({c.bn},{c.mt},{c.wgs},{c.bk},{c.stages},{c.min_blocks})") == 1
        assert (c.taps, c.taps_per_stage, c.halo_tw, c.tw_log2(1000)) == (1, 1, 0, 0)
        assert c.k_blocks(200) == -(-200 // c.bk) and c.stage_bytes == (c.bm + c.bn) * c.row_bytes
        # the general epilogue's fp32 rows fit the dynamic shared memory the launch asks for
        assert c.smem_bytes >= c.epilogue_f32_bytes + c.ALIGN and c.smem_bytes >= c.stages * c.stage_bytes
    assert {c.bk for c in PW} == {32, 64}  # C % 64 != 0 (96, 48, 200) has its 32-channel k-blocks
    for entry in (*WG.pw_prefer, *WG.pw_narrow):
        assert WG.config(entry).pointwise


@pytest.mark.parametrize(("M", "K"), [(126, 80), (1, 20), (2047, 200), (100, 384)])
def test_the_1x1_grid_covers_every_output_once(M: int, K: int) -> None:
    """As conv3x3_wgmma.cu decodes blockIdx.x for a 1x1 entry: channel tile fastest, then runs of
    BM pixels of the flattened N*H*W; a run that hangs over M is the last one."""
    for c in PW:
        n_tiles = -(-K // c.bn)
        grid = WG.launch("float16", 1, 1, M, 8, K, entry=c.entry).grid
        assert grid == (c.ctas(1, 1, M, K), 1, 1) == (-(-M // c.bm) * n_tiles, 1, 1)
        seen = np.zeros((M, n_tiles), np.int32)
        for b in range(grid[0]):
            m0, nt = (b // n_tiles) * c.bm, b % n_tiles
            assert m0 < M
            seen[m0 : m0 + c.bm, nt] += 1
        assert (seen == 1).all(), c.entry
    # the same pixels whatever N, H, W hold them
    c = PW[0]
    assert c.ctas(2, 7, 9, K) == c.ctas(1, 1, 126, K) == c.ctas(3, 42, 1, K)


# -- tensor maps and arguments ----------------------------------------------------------------------


def test_a_1x1_entry_reads_the_input_as_one_matrix_of_pixels() -> None:
    c = WG.config("conv3x3_wgmma_bn64_mt1_wg2_bk32_1x1")
    m = input_map(c, X + 16, 2, 7, 9, 48, 64)  # channels [8, 56) of a 64-wide tensor, 126 pixels
    assert (m.address, m.dims, m.strides, m.box) == (X + 16, (48, 126), (128,), (32, 128))
    w = weight_map(c, W_, 80, 48)
    assert (w.dims, w.strides, w.box) == ((48, 80), (96,), (32, 64))
    assert m.box_bytes + w.box_bytes == c.stage_bytes  # what the producer's expect_tx counts
    args = tma.encode_args(m)
    assert args[1] == 2 and [int(d) for d in args[3]] == [48, 126] and [int(b) for b in args[5]] == [32, 128]
    assert args[8] == cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B
    wide = tma.encode_args(weight_map(WG.config("conv3x3_wgmma_bn128_mt1_wg2_bk64_1x1"), W_, 384, 96))
    assert [int(d) for d in wide[3]] == [96, 384] and [int(b) for b in wide[5]] == [64, 128]
    assert wide[8] == cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B


def test_kernel_args_carry_the_activation_and_no_tile_width() -> None:
    entry = "conv3x3_wgmma_bn32_mt2_wg2_bk32_1x1"
    tmx, tmw = cu.CUtensorMap(), cu.CUtensorMap()
    p = ConvProblem(3, 5, 17, 80, 20, ldx=96, ldy=40)
    act = Activation.named("leakyrelu", 0.15)
    args = WG.args(p, tmx=tmx, tmw=tmw, bias=B, res=R, ldr=36, y=Y, act=act, entry=entry)
    got = dict(zip(WG.PARAMS, (v for v, _ in args), strict=True))
    assert (got["act"], got["p0"], got["p1"], got["tw_log2"]) == (kernels.ACTIVATIONS["leakyrelu"], 0.15, 0.0, 0)
    assert (got["res"], got["ldr"], got["ldy"], got["y"], got["bias"]) == (R, 36, 40, Y, B)
    assert dict(zip(WG.PARAMS, (t for _, t in args), strict=True))["p0"] is ctypes.c_float
    with pytest.raises(InputError, match="act='gelu' is not an Activation"):
        WG.args(p, tmx=tmx, tmw=tmw, y=Y, act="gelu", entry=entry)  # type: ignore[arg-type]


def test_every_activation_row_has_its_case_in_the_wgmma_epilogue() -> None:
    """The epilogue inlines every row (a call would serialize the wgmma): a row added to the table
    without its case there would fall through to none."""
    src = (ROOT / "handwritten_ptx" / "conv3x3_wgmma.cu").read_text()
    cases = set(re.findall(r"WG_ACT_CASE\((DT_ACT_\w+), dt_act_(\w+)\)", src))
    assert cases == {(k.enum, k.name) for k in KINDS if k.name != "none"}


# -- which launches the chooser gives the 1x1 entries -----------------------------------------------


def test_choose_pointwise_sizes_the_tile_to_the_gemm() -> None:
    big = WG.choose(8, 128, 128, 96, 384, pointwise=True)  # ConvNeXt's first MLP at N=8: C % 64 != 0
    assert big.entry == "conv3x3_wgmma_bn128_mt1_wg2_bk32_1x1"
    assert WG.choose(8, 64, 64, 384, 192, pointwise=True).entry == "conv3x3_wgmma_bn128_mt1_wg2_bk64_1x1"
    assert WG.choose(1, 7, 9, 48, 20, pointwise=True).entry == "conv3x3_wgmma_bn32_mt2_wg2_bk32_1x1"  # K <= 32
    assert WG.choose(1, 7, 9, 64, 48, pointwise=True).bn == 64  # no tile wider than K rounded up to 32
    few = WG.choose(1, 16, 16, 768, 3072, pointwise=True)  # too few CTAs for a full wave: the most CTAs
    assert few.entry == "conv3x3_wgmma_bn64_mt1_wg1_bk64_1x1"
    assert WG.choose(8, 128, 128, 96, 384).pointwise is False  # the 3x3 choice is unchanged by default
    assert WG.splits(few, 1, 16, 16, 768, 3072) == 1  # 768 CTAs need no split-K
    small = WG.choose_pointwise(64, 1024, 64)
    assert WG.splits(small, 1, 1, 64, 1024, 64) > 1  # one tile, 16 k-blocks: split-K fills the GPU


def test_the_chooser_runs_1x1_convs_on_wgmma_on_sm90a() -> None:
    p = ConvProblem.dense(2, 7, 9, 48, 80)
    for act in ("none", "relu", "gelu", "gelu_tanh", "hardswish", "selu"):
        c = conv_choice(p, REFERENCE, call=_call(act=act))
        assert (c.impl, c.entry) == ("wgmma", WG.choose(2, 7, 9, 48, 80, pointwise=True).entry), act
    assert conv_choice(p, REFERENCE, call=_call(residual=True), at=kernels.Pointers(res=R, ldr=80)).impl == "wgmma"
    three = conv_choice(p, REFERENCE, call=_call(ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)))
    assert three.impl == "wgmma" and not three.entry.endswith("_1x1")  # a 3x3 with GELU: the 3x3 entries


@pytest.mark.parametrize(
    ("problem", "geom", "off", "why"),
    [
        (ConvProblem.dense(2, 7, 9, 48, 80), ONE, "the target's image has no wgmma kernel", "no wgmma kernel"),
        (ConvProblem.dense(2, 8, 8, 48, 80), ConvGeometry(1, 1, 2, 2), None, "stride 2,2"),
        (ConvProblem.dense(2, 7, 9, 48, 80), ConvGeometry(1, 1, groups=2), None, "group=2"),
        (ConvProblem.dense(2, 7, 9, 48, 80), ConvGeometry(1, 1, pad_top=1, pad_bottom=1), None, "padding 0"),
        (ConvProblem.dense(2, 7, 9, 20, 80), ONE, None, "C=20: TMA needs"),
        (ConvProblem(2, 7, 9, 48, 80, 52, 80), ONE, None, "ldx=52"),
        (ConvProblem(2, 7, 9, 48, 80, 48, 84), ONE, None, "ldy=84"),
        (ConvProblem.dense(2, 7, 9, 48, 80, "float32"), ONE, None, "fp16 only"),
    ],
)
def test_1x1_convs_wgmma_cannot_take_keep_the_mma_sync_kernel(problem, geom, off, why) -> None:
    c = conv_choice(problem, REFERENCE, call=_call(geom), wgmma_off=off)
    assert c.impl == ("simt" if problem.dtype == "float32" else "mma.sync") and c.entry.startswith("conv_nhwc_f")
    assert why in c.reason


# -- the general conv's preparation, against a fake runtime -----------------------------------------


@dataclass
class _Ctx:
    """A kernels.LaunchContext with no GPU: tensor maps recorded, workspace at a fixed address."""

    wgmma_off: str | None = None
    device: kernels.DeviceInfo = REFERENCE
    maps: list[TiledMap] = field(default_factory=list)
    workspaces: list[int] = field(default_factory=list)

    def tuned_entry(self, call: KernelCall, batch: int) -> str | None:
        return None

    def tensor_map(self, m: TiledMap) -> cu.CUtensorMap:
        self.maps.append(m)
        return cu.CUtensorMap()

    def workspace(self, nbytes: int) -> int:
        self.workspaces.append(nbytes)
        return 0x7E0000000000


def _t(ptr: int, shape: tuple[int, ...], dtype: str = "float16", ld: int = 0) -> GpuTensor:
    return GpuTensor(ptr, shape, np.dtype(dtype), ld=ld)


def test_the_general_conv_hands_a_1x1_layer_to_the_wgmma_kernel() -> None:
    """A pointwise conv + GELU + residual writing a channel slice: the 1x1 entry, its maps made for
    these buffers, the residual's pointer and stride, the activation in its arguments."""
    ctx = _Ctx()
    x, y = _t(X + 16, (2, 7, 9, 48), ld=64), _t(Y + 32, (2, 7, 9, 80), ld=112)
    res = _t(R, (2, 7, 9, 80), ld=88)
    w, b = _t(W_, (80, 1, 1, 48)), _t(B, (80,), "float32")
    prep = GENERAL.prepare_inputs(_call(residual=True), [x, res], y, [w, b], ctx)
    cfg = WG.config(prep.entry)
    assert cfg.pointwise and prep.choice is not None and prep.choice.impl == "wgmma"
    assert [(m.address, m.dims) for m in ctx.maps] == [(X + 16, (48, 126)), (W_, (48, 80))]
    got = dict(zip(WG.PARAMS, (v for v, _ in prep.args), strict=True))
    assert (got["res"], got["ldr"], got["y"], got["ldy"], got["bias"]) == (R, 88, Y + 32, 112, B)
    assert got["act"] == kernels.ACTIVATIONS["gelu"] and (got["N"], got["H"], got["W"], got["C"], got["K"]) == (
        2, 7, 9, 48, 80,
    )  # fmt: skip
    assert prep.config.shared_bytes == cfg.smem_bytes and prep.config.block == (cfg.threads, 1, 1)
    assert not ctx.workspaces


def test_a_1x1_launch_with_few_pixels_gets_a_split_k_workspace() -> None:
    ctx = _Ctx()
    x, y = _t(X, (1, 8, 8, 1024)), _t(Y, (1, 8, 8, 64))
    prep = GENERAL.prepare_inputs(_call(act="silu"), [x], y, [_t(W_, (64, 1, 1, 1024))], ctx)
    assert prep.choice is not None and prep.choice.splits > 1 and prep.config.grid[1] == prep.choice.splits
    assert ctx.workspaces == [WG.workspace_bytes(WG.config(prep.entry), 1, 8, 8, 64, prep.choice.splits)]


def test_a_3x3_entry_refuses_1x1_weights() -> None:
    choice = kernels.ConvChoice("wgmma", "conv3x3_wgmma_bn64_mt1_wg1_bk64", "test")
    with pytest.raises(InputError, match="cannot run 1x1 weights"):
        WG.prepare_entry(
            choice, _t(X, (1, 8, 8, 64)), _t(Y, (1, 8, 8, 64)), [_t(W_, (64, 1, 1, 64))], Activation(), _Ctx()
        )


# -- what they compute, and what the partition thinks it costs ---------------------------------------


@pytest.mark.parametrize("name", ["gelu", "leakyrelu", "hardswish", "silu"])
def test_the_1x1_reference_matches_onnxruntime(name: str) -> None:
    """The general conv's numpy reference (what the GPU tests hold the 1x1 entries to besides
    onnxruntime) for a 1x1 conv + residual + activation, against onnxruntime's Conv, Add and the
    activation's nodes, in float32 on fresh random inputs: within 1e-5 relative."""
    rng = np.random.default_rng()
    n, h, w, c, k = 2, 5, 7, 48, 40
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wt = (rng.standard_normal((k, c, 1, 1)) / np.sqrt(c)).astype(np.float32)
    b, r = rng.standard_normal(k).astype(np.float32), rng.standard_normal((n, h, w, k)).astype(np.float32)
    act = case_activation(next(kind for kind in KINDS if kind.name == name))
    ours = GENERAL.reference(x, wt.transpose(0, 2, 3, 1), b, r, geom=ONE, act=act)
    nodes, inits = act_nodes(act, "s", "y")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["t"]), helper.make_node("Add", ["t", "r"], ["s"]), *nodes],
        "pw",
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in ("x", "r")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(wt, "w"), numpy_helper.from_array(b, "b"), *inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset(act.kind))])
    model.ir_version = 9
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x.transpose(0, 3, 1, 2), "r": r.transpose(0, 3, 1, 2)})[0].transpose(0, 2, 3, 1)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


def _pw_node(stride: int = 1) -> tuple[object, dict, set[str]]:
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="pw", kernel_shape=[1, 1], strides=[stride] * 2)
    specs = {"x": ((1, 96, 128, 128), "float16"), "w": ((384, 96, 1, 1), "float16"), "b": ((384,), "float16")}
    specs["y"] = ((1, 384, 128 // stride, 128 // stride), "float16")
    return node, specs, {"w", "b"}


@pytest.mark.parametrize(("target", "stride", "wgmma"), [("sm_90a", 1, True), ("h100", 1, True),
                                                          ("sm_90a", 2, False), ("sm_80", 1, False)])  # fmt: skip
def test_the_cost_model_charges_wgmma_1x1_layers_the_wgmma_rate(target: str, stride: int, wgmma: bool) -> None:
    node, specs, inits = _pw_node(stride)
    rates, conv_target = cost.rates_for_target(target), cost.ConvTarget.of(target)
    assert conv_target.runs_wgmma(node, specs) is wgmma
    got = cost.node_cost(node, specs, inits, (1, 8), on_a=None, kernel="conv", rates=rates, target=conv_target)
    work = cost.node_work(node, specs, inits)
    track = rates.track_a_wgmma if wgmma else rates.track_a_conv
    assert track is not None
    want = sum(track.time_us(n * work.flops, n * work.act_bytes + work.weight_bytes) for n in (1, 8))
    assert got.a_us == pytest.approx(want)
    if wgmma:  # the 3x3 wgmma's rate per FLOP, faster than the general conv's mma.sync roofline
        assert track.tflops > rates.track_a_conv.tflops


def test_rows_of_devices_without_the_wgmma_kernel_have_no_wgmma_rate() -> None:
    for target in ("sm_80", "sm_120"):
        assert cost.rates_for_target(target).track_a_wgmma is None
    row = cost.rates_for(for_target("h200"))
    assert row.to_json()["track_a_wgmma"] == {"tflops": 300.0, "tbps": 2.5, "launch_us": 3.0}


def test_an_sm90a_bundle_carries_the_wgmma_kernel_for_a_plan_of_1x1_convs_only() -> None:
    from dualtrack.compiler.build import track_a_stems
    from dualtrack.contract.plan import Plan, Segment, TensorSpec

    x, y = TensorSpec("x", (1, 16, 16, 48), "float16"), TensorSpec("y", (1, 16, 16, 80), "float16")
    seg = Segment(0, "A", ("block/pwconv1",), (x,), (y,), "", calls=(_call(),))
    plan = Plan((x,), (y,), (seg,), "fp16", (1, 8))
    assert track_a_stems(plan, "compute_90a") == ["conv3x3_wgmma", "conv_nhwc"]
    assert track_a_stems(plan, "compute_80") == ["conv_nhwc"]  # mma.sync: no wgmma off sm_90a
    assert track_a_stems(plan, "compute_90a", use_tma=False) == ["conv_nhwc"]


# -- the data path, emulated ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulate() -> Any:
    """bench/wgmma/emulate.py: TMA tiled loads (zero fill, swizzle), wgmma operand reads through the
    kernel's descriptors and the accumulator fragment layout, as the PTX ISA documents them."""
    import sys

    sys.path.insert(0, str(ROOT / "bench" / "wgmma"))
    try:
        import emulate as em
    finally:
        sys.path.remove(str(ROOT / "bench" / "wgmma"))
    return em


def _emulate_pointwise(
    em: Any,
    cfg: kernels.WgmmaConfig,
    x_wide: np.ndarray,
    x_off: int,
    w: np.ndarray,
    bias: np.ndarray,
    res: np.ndarray,
    act: Activation,
    y_wide: np.ndarray,
    y_off: int,
) -> None:
    """One launch of a 1x1 entry, CTA by CTA, with the kernel's own formulas (conv3x3_wgmma.cu, PW):
    the tile decode, the producer's 2-D coordinates, the consumers' descriptors, the general
    epilogue (fp32 staging with the bias, then per 8-channel chunk: pixel < M, residual, activation,
    one fp16 rounding, a store at pixel * ldy + channel)."""
    cp = em.cp
    N, H, W, ldx = x_wide.shape
    K, C = w.shape[0], w.shape[-1]
    M, ldy = N * H * W, y_wide.shape[-1]
    gx, gw = em.Memory(x_wide.nbytes, 0x10000), em.Memory(w.nbytes, 0x8000000)
    gx.words[:] = x_wide.reshape(-1).view(np.uint16)
    gw.words[:] = np.ascontiguousarray(w).reshape(-1).view(np.uint16)
    tmx, tmw = input_map(cfg, 0x10000 + 2 * x_off, N, H, W, C, ldx), weight_map(cfg, 0x8000000, K, C)
    raw = 0x50
    base = (raw + cp.ALIGN - 1) & ~(cp.ALIGN - 1)
    smem, row = em.Memory(cfg.smem_bytes, raw), cfg.row_bytes
    n_tiles, yf, rf = -(-K // cfg.bn), y_wide.reshape(-1), res.reshape(M, -1)
    for block in range(cfg.ctas(N, H, W, K)):
        nt, m0 = block % n_tiles, (block // n_tiles) * cfg.bm
        n0 = nt * cfg.bn
        acc = np.zeros((cfg.wgs, cfg.mt, 64, cfg.bn), np.float32)
        for kb in range(cfg.k_blocks(C)):
            stage = kb % cfg.stages
            a_dst = base + stage * cfg.stage_bytes
            got = em.tma_load(smem, a_dst, tmx, gx, (kb * cfg.bk, m0))
            got += em.tma_load(smem, a_dst + cfg.a_bytes, tmw, gw, (kb * cfg.bk, n0))
            assert got == cfg.stage_bytes, "expect_tx would not match the bytes TMA delivers"
            so = (stage * cfg.stage_bytes) >> 4
            for g in range(cfg.wgs):
                for k in range(cfg.bk // 16):
                    for mt in range(cfg.mt):
                        da = cp.smem_desc(base + g * cfg.mt * 64 * row, row) + so + ((mt * 64 * row + k * 32) >> 4)
                        db = cp.smem_desc(base + cfg.a_bytes, row) + so + ((k * 32) >> 4)
                        a = em.wgmma_operand(smem, da, 64).astype(np.float32)
                        acc[g, mt] += a @ em.wgmma_operand(smem, db, cfg.bn).astype(np.float32).T
        for g in range(cfg.wgs):
            tile = np.zeros((cfg.mt * 64, cfg.bn + 8), np.float32)  # stage_tile_f32
            for mt in range(cfg.mt):
                regs = em.hw_fragments(acc[g, mt])
                for t in range(128):
                    wl, lane = divmod(t, 32)
                    for j in range(cfg.bn // 8):
                        col = 8 * j + 2 * (lane & 3)
                        b = [bias[n0 + col + e] if n0 + col + e < K else 0.0 for e in (0, 1)]
                        for half in range(2):
                            r = mt * 64 + 16 * wl + (lane >> 2) + 8 * half
                            tile[r, col : col + 2] = regs[t, 4 * j + 2 * half : 4 * j + 2 * half + 2] + b
            for i in range(cfg.mt * 64 * (cfg.bn // 8)):  # store_general
                r, q = divmod(i, cfg.bn // 8)
                pix, k = m0 + g * cfg.mt * 64 + r, n0 + 8 * q
                if pix >= M or k >= K:
                    continue
                n = min(8, K - k)
                v = tile[r, 8 * q : 8 * q + n] + rf[pix, k : k + n].astype(np.float32)
                dst = pix * ldy + y_off + k
                yf[dst : dst + n] = act.apply(v).astype(np.float16)


@pytest.mark.parametrize(
    ("entry", "shape"),
    [
        ("conv3x3_wgmma_bn64_mt1_wg2_bk32_1x1", (2, 7, 9, 48, 80)),  # 126 pixels, C = 48 of 2 k-blocks, K tail
        ("conv3x3_wgmma_bn32_mt2_wg2_bk64_1x1", (1, 5, 61, 128, 20)),  # 305 pixels, 2 k-blocks of 64, K = 20
        ("conv3x3_wgmma_bn128_mt1_wg2_bk64_1x1", (1, 3, 50, 64, 136)),  # two channel tiles, the second 8 wide
    ],
)
def test_the_1x1_data_path_computes_the_reference(emulate, entry: str, shape: tuple) -> None:
    """The emulated launch (2-D boxes through the swizzle, the descriptors, the fragments, the general
    epilogue) against the general conv's float64-accurate reference on fresh random data: within
    one fp16 rounding (2e-3 relative); channels outside the output slice untouched."""
    rng = np.random.default_rng()
    cfg = WG.config(entry)
    n, h, w, c, k = shape
    x_off, y_off = 8, 8
    x_wide = rng.standard_normal((n, h, w, c + 16)).astype(np.float16)
    wt = (rng.standard_normal((k, 1, 1, c)) / np.sqrt(c)).astype(np.float16)
    bias = rng.standard_normal(k).astype(np.float32)
    res = rng.standard_normal((n, h, w, k)).astype(np.float16)
    act = Activation.named("gelu")
    y_wide = np.full((n, h, w, k + 24), -1234.5, np.float16)
    _emulate_pointwise(emulate, cfg, x_wide, x_off, wt, bias, res, act, y_wide, y_off)
    x = x_wide[..., x_off : x_off + c].astype(np.float32)
    want = GENERAL.reference(x, wt.astype(np.float32), bias, res.astype(np.float32), geom=ONE, act=act)
    got = y_wide[..., y_off : y_off + k].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert (np.delete(y_wide, np.s_[y_off : y_off + k], axis=3) == np.float16(-1234.5)).all()
