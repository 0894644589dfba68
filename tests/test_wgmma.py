"""The sm_90a conv3x3 (TMA + wgmma) on the CPU: its configurations, which launches it takes and
with which tile, its tensor maps and kernel arguments, its place in the bundles, and the runtime's
glue (launches prepared once per buffer set) against a mock driver.

The GPU tests (tests/gpu/test_wgmma_gpu.py) run it against the numpy reference; bench/wgmma/ holds
the standalone prototype whose host plan (conv_plan.py) ran 200 of 200 checks on an H200: the
geometry and the tensor maps here must stay equal to it.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as cu

from dualtrack import kernels
from dualtrack.compiler.build import track_a_stems
from dualtrack.compiler.kernel_build import SOURCE_DIR, assemble_cubin, ptx_path
from dualtrack.contract.arch import ARCHES
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import CONV3X3_WGMMA, WGMMA_CONFIGS, ConvChoice, Pointers, choose_conv, conv_choice
from dualtrack.kernels.conv3x3_wgmma import input_map, weight_map
from dualtrack.kernels.device import REFERENCE
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime import tma

ROOT = Path(__file__).resolve().parents[1]
WG = CONV3X3_WGMMA
MEASURED = ROOT / "bench" / "results" / "wgmma_check-770a528.json"
SMEM_PER_SM = 233472  # H100/H200: 228 KiB per SM
SMEM_RESERVED_PER_BLOCK = 1024
MAX_DYNAMIC_SMEM = 232448  # 227 KiB, the opt-in limit per block
REGISTERS_PER_SM = 65536


def choose_conv3x3(p: ConvProblem, *, wgmma_off: str | None, tuned: str | None = None, x=0, w=0, y=0) -> ConvChoice:
    """The chooser's answer for a conv3x3 launch on the H200."""
    return conv_choice(p, REFERENCE, tuned=tuned, wgmma_off=wgmma_off, at=Pointers(x, w, y))


# The reference U-Net's 3x3 layers after the first (C=3): (name, C, K, H=W) at a 512x512 input.
UNET_LAYERS = (
    ("enc1b/dec1b", 32, 32, 512), ("enc2a", 32, 64, 256), ("enc2b/dec2b", 64, 64, 256),
    ("enc3a", 64, 128, 128), ("enc3b/dec3b", 128, 128, 128), ("enc4a", 128, 256, 64),
    ("enc4b/dec4b", 256, 256, 64), ("bott_a", 256, 512, 32), ("bott_b", 512, 512, 32),
    ("dec4a", 512, 256, 64), ("dec3a", 256, 128, 128), ("dec2a", 128, 64, 256), ("dec1a", 64, 32, 512),
)  # fmt: skip
X, W_, Y = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000  # aligned device addresses (never dereferenced)


@pytest.fixture(scope="module")
def prototype():
    """bench/wgmma/conv_plan.py, the prototype's host plan (standalone: no dualtrack import)."""
    sys.path.insert(0, str(ROOT / "bench" / "wgmma"))
    try:
        import conv_plan
    finally:
        sys.path.remove(str(ROOT / "bench" / "wgmma"))
    return conv_plan


# -- configurations ---------------------------------------------------------------------------------


def test_configurations_fit_an_sm90_sm() -> None:
    assert len({c.entry for c in WGMMA_CONFIGS}) == len(WGMMA_CONFIGS)
    for c in WGMMA_CONFIGS:
        assert (c.a_rows * c.row_bytes) % 1024 == 0 and c.b_pitch % 1024 == 0  # tiles stay 1024-aligned
        # a column copy's tap shift (TW rows) keeps the 8-row core groups on the swizzle repeat
        assert c.halo_tw == 0 or (c.halo_tw % 8 == 0 and (c.halo_tw * c.row_bytes) % (8 * c.row_bytes) == 0)
        assert c.smem_bytes <= MAX_DYNAMIC_SMEM, c
        per_cta = c.smem_bytes + c.static_smem_bytes + SMEM_RESERVED_PER_BLOCK
        assert per_cta * c.min_blocks <= SMEM_PER_SM, c
        assert c.bm * (c.bn + 8) * 2 <= c.stages * c.stage_bytes, c  # the epilogue's staging reuses the pipeline
        assert c.stages >= 2 and c.bk in (16, 32, 64) and c.bn in (16, 32, 64, 128, 256), c


def test_defines_instantiate_every_configuration() -> None:
    macro = WG.defines()["CONV_WGMMA_ENTRIES"]
    for c in WGMMA_CONFIGS:
        args = f"{c.bn},{c.mt},{c.wgs},{c.bk},{c.stages},{c.min_blocks}"
        want = f"CONV_WGMMA_HALO_ENTRY({args},{c.halo_tw})" if c.halo_tw else f"CONV_WGMMA_ENTRY({args})"
        want = f"CONV_WGMMA_1X1_ENTRY({args})" if c.pointwise else want
        assert macro.split().count(want) == 1
    assert WG.entries == tuple(c.entry for c in WG.all_configs)  # the fp16 rows, then the e4m3 ones (conv_fp8)
    assert WG.config("conv3x3_wgmma_bn64_mt2_wg2_bk32").stages == 5
    with pytest.raises(InputError, match="'conv3x3_wgmma_bn16' is not an entry of conv3x3_wgmma"):
        WG.config("conv3x3_wgmma_bn16")


def test_the_cubin_fits_the_configurations() -> None:
    """ptxas' own report on the checked-in PTX: no spills or stack, static shared memory = the
    mbarriers, registers low enough for `min_blocks` CTAs per SM."""
    text = ptx_path(SOURCE_DIR, SOURCE_DIR / "conv3x3_wgmma.cu", "compute_90a").read_text()
    cubin = assemble_cubin(text, "sm_90a", name="conv3x3_wgmma.ptx")
    assert set(cubin.resources) == set(WG.entries)
    for c in WGMMA_CONFIGS:
        r = cubin.resources[c.entry]
        assert not r.spills and r.stack_bytes == 0, (c.entry, r)
        assert r.shared_bytes == c.static_smem_bytes, (c.entry, r)
        assert r.registers * c.threads * c.min_blocks <= REGISTERS_PER_SM, (c.entry, r)
    assert "warning" not in cubin.info_log.lower()  # e.g. C7509: ptxas serialized the wgmma


def test_same_configurations_and_geometry_as_the_prototype(prototype) -> None:
    """The prototype's configurations, launch geometry and tensor maps are what ran on the H200
    (its 3x3 ones: the 1x1 entries are tests/test_wgmma1x1.py's)."""
    ours = {c.entry: c for c in WGMMA_CONFIGS if not c.pointwise}
    assert set(ours) == {c.entry for c in prototype.CONFIGS}
    assert prototype.kernel_arg_names() == WG.PARAMS
    for p in prototype.CONFIGS:
        c = ours[p.entry]
        assert (c.bn, c.mt, c.wgs, c.bk, c.stages, c.min_blocks, c.halo_tw) == (
            p.bn, p.mt, p.wgs, p.bk, p.stages, p.min_blocks, p.halo_tw
        )  # fmt: skip
        assert (c.smem_bytes, c.threads, c.stage_bytes) == (p.smem_bytes, p.threads, p.stage_bytes)
        for N, H, W, C, K, ldx in ((1, 9, 13, 64, 40, 72), (2, 512, 512, 32, 32, 64), (3, 5, 200, 96, 300, 96)):
            geo = prototype.launch(p, N, H, W, K)
            ours_launch = WG.launch("float16", N, H, W, C, K, entry=c.entry)
            assert (ours_launch.grid, ours_launch.block, ours_launch.shared_bytes) == (
                geo.grid, geo.block, geo.smem_bytes
            )  # fmt: skip
            assert c.tw_log2(W) == geo.tw_log2
            for mine, theirs in (
                (input_map(c, X, N, H, W, C, ldx), prototype.input_map(p, X, N, H, W, C, ldx, geo.tw_log2)),
                (weight_map(c, W_, K, C), prototype.weight_map(p, W_, K, C)),
            ):
                assert (mine.address, mine.dims, mine.strides, mine.box) == (
                    theirs.address, theirs.dims, theirs.strides, theirs.box
                )  # fmt: skip
                assert mine.swizzle_bytes == theirs.swizzle_bytes
                assert mine.l2_promotion_bytes == theirs.l2_promotion_bytes


def _decode(cfg: kernels.WgmmaConfig, block: int, H: int, W: int, K: int) -> tuple[int, int, int, int]:
    """(image, h0, w0, n0) of CTA ``block``, as conv3x3_wgmma.cu decodes blockIdx.x."""
    log2 = cfg.tw_log2(W)
    tiles_w, tiles_h, n_tiles = -(-W // (1 << log2)), -(-H // (cfg.bm >> log2)), -(-K // cfg.bn)
    nt, t = block % n_tiles, block // n_tiles
    tw, t = t % tiles_w, t // tiles_w
    return t // tiles_h, (t % tiles_h) * (cfg.bm >> log2), tw << log2, nt * cfg.bn


@pytest.mark.parametrize("shape", [(2, 9, 13, 40), (1, 32, 32, 512), (3, 5, 70, 64), (1, 1, 1, 8)])
def test_the_grid_covers_every_output_once(shape: tuple[int, int, int, int]) -> None:
    N, H, W, K = shape
    for c in (c for c in WGMMA_CONFIGS if not c.pointwise):  # the 1x1 tiles: tests/test_wgmma1x1.py
        th, tw = c.bm >> c.tw_log2(W), 1 << c.tw_log2(W)
        seen = np.zeros((N, H, W, -(-K // c.bn)), np.int32)
        for b in range(WG.launch("float16", N, H, W, 8, K, entry=c.entry).grid[0]):
            img, h0, w0, n0 = _decode(c, b, H, W, K)
            seen[img, h0 : h0 + th, w0 : w0 + tw, n0 // c.bn] += 1
        assert (seen == 1).all(), c.entry


# -- which launches, which tile ---------------------------------------------------------------------


def test_supported_says_why_not() -> None:
    assert WG.supported(ConvProblem.dense(1, 512, 512, 32, 32)) is None
    slices = ConvProblem(2, 16, 16, 64, 32, ldx=128, ldy=96)
    assert WG.supported(slices, x=X + 128, y=Y + 64) is None
    cases = [
        (ConvProblem.dense(1, 8, 8, 64, 64, "float32"), {}, "fp16 only"),
        (ConvProblem.dense(1, 8, 8, 3, 32), {}, r"C=3: TMA needs 16-byte weight rows"),
        (ConvProblem(1, 8, 8, 64, 32, ldx=68, ldy=32), {}, r"ldx=68: TMA needs a 16-byte pixel stride"),
        (ConvProblem.dense(1, 8, 8, 64, 36), {}, r"ldy=36: the epilogue's 16-byte stores"),
        (ConvProblem(1, 8, 8, 64, 32, ldx=72, ldy=32), {"x": X + 8}, r"x=0x7f0000000008 is not 16-byte aligned"),
        (ConvProblem.dense(1, 8, 8, 64, 32), {"y": Y + 2}, r"y=0x7f0000200002 is not 16-byte aligned"),
        (ConvProblem.dense(70000, 256, 256, 64, 64), {}, r"exceed 2\^31-1"),
    ]
    for problem, pointers, why in cases:
        reason = WG.supported(problem, **pointers)
        assert reason is not None and re.search(why, reason), (why, reason)
    with pytest.raises(InputError, match="ldx=16 is smaller than the 32 channels"):
        WG.supported(ConvProblem(1, 8, 8, 32, 32, ldx=16, ldy=32))


def _measured() -> list[dict]:
    return json.loads(MEASURED.read_text())["layers"]


def test_choose_follows_the_measured_winners() -> None:
    """choose() against every config the prototype timed per U-Net layer on the H200: within 0.5%
    of the per-layer best in total (each layer: 7%), and exactly the winner where it won by more
    than 7%."""
    total, best_total = {1: 0.0, 8: 0.0}, {1: 0.0, 8: 0.0}
    for row in _measured():
        times = {k: v for k, v in row["per_config_ms"].items() if v}
        best = min(times, key=times.get)
        c = WG.choose(row["N"], row["H"], row["W"], row["C"], row["K"])
        assert c.entry in times, (row["layer"], row["N"], c.entry)
        n = len(row["layer"].split("/"))  # a/b names share a shape: the model runs it twice
        total[row["N"]] += n * times[c.entry]
        best_total[row["N"]] += n * times[best]
        assert times[c.entry] <= 1.07 * times[best], (row["layer"], row["N"], c.entry, best)
        if sorted(times.values())[1:2] and sorted(times.values())[1] > 1.07 * times[best]:
            assert c.entry == best, (row["layer"], row["N"])
    for n in total:
        assert total[n] <= 1.005 * best_total[n], (n, total[n], best_total[n])
    assert round(total[1], 3) == 0.339 and round(total[8], 2) == 1.68  # ms: what handwritten_ptx/README.md quotes


def test_choose_on_shapes_outside_the_unet() -> None:
    # few channels: 16-channel k-blocks for C <= 16 and 16-channel tiles for K <= 16 (no zeros multiplied)
    assert WG.choose(1, 8, 8, 8, 8).entry == "conv3x3_wgmma_bn16_mt2_wg2_bk16_h16"
    assert WG.choose(8, 512, 512, 16, 16).entry == "conv3x3_wgmma_bn16_mt2_wg2_bk16_h16"
    assert WG.choose(8, 512, 512, 16, 32).entry == "conv3x3_wgmma_bn32_mt2_wg2_bk16_h16"
    assert WG.choose(8, 512, 512, 32, 16).entry == "conv3x3_wgmma_bn16_mt2_wg2_bk32_h16"
    assert WG.choose(8, 512, 512, 48, 32).entry == "conv3x3_wgmma_bn32_mt2_wg2_bk32_h16"  # C % 64 != 0, K <= 32
    assert WG.choose(1, 8, 8, 16, 40).entry == "conv3x3_wgmma_bn64_mt2_wg2_bk32_h16"  # K > 32: 32-channel blocks
    assert WG.choose(1, 8, 8, 16, 16, dilation=2).bk == 32  # a dilated 3x3: the per-tap tiles, as before
    assert WG.choose(1, 8, 8, 64, 40).entry == "conv3x3_wgmma_bn64_mt1_wg1_bk64"  # few CTAs: the most
    assert WG.choose(64, 64, 64, 128, 1000).entry == "conv3x3_wgmma_bn128_mt2_wg2_bk64"  # many CTAs: the largest
    assert WG.choose(1, 1, 1, 64, 8).entry == "conv3x3_wgmma_bn16_mt2_wg2_bk64_h16"
    # C <= 64: the 128x64 column-copy tile before the 256x64 one; C = 128: the other way round
    assert WG.choose(8, 256, 256, 64, 64).entry == "conv3x3_wgmma_bn64_mt1_wg2_bk64_h16"
    assert WG.choose(8, 256, 256, 128, 64).entry == "conv3x3_wgmma_bn64_mt2_wg2_bk64_h16"


def test_split_k_fills_the_gpu_where_the_tiles_do_not() -> None:
    """Launches of fewer than min_ctas CTAs split their reduction (at most max_splits ways, each
    split at least min_split_kb k-blocks, none empty); the grid's y is the split and the workspace
    holds a partial tile per (tile, split) and a counter per tile."""
    cases = {  # (N, H, W, C, K) -> splits, on ResNet-34's stages and the U-Net's
        (1, 16, 16, 512, 512): 4,  # 32 CTAs of 64x64, 72 k-blocks
        (1, 32, 32, 256, 256): 2,  # 64 CTAs
        (8, 16, 16, 512, 512): 1,  # enough CTAs
        (1, 16, 16, 64, 64): 1,  # 9 k-blocks: too short to split
        (1, 512, 512, 32, 32): 1,
    }
    for (n, h, w, c, k), want in cases.items():
        cfg = WG.choose(n, h, w, c, k)
        splits = WG.splits(cfg, n, h, w, c, k)
        assert splits == want, ((n, h, w, c, k), cfg.entry, splits)
        kb = cfg.k_blocks(c)
        assert (splits - 1) * -(-kb // splits) < kb  # no empty split
        launch = WG.launch("float16", n, h, w, c, k, entry=cfg.entry, splits=splits)
        assert launch.grid == (cfg.ctas(n, h, w, k), splits, 1)
        ws = WG.workspace_bytes(cfg, n, h, w, k, splits)
        assert ws == (0 if splits == 1 else cfg.ctas(n, h, w, k) * (splits * cfg.bm * cfg.bn * 4 + 4))
        choice = choose_conv3x3(ConvProblem.dense(n, h, w, c, k), wgmma_off=None)
        assert (choice.impl, choice.entry, choice.splits) == ("wgmma", cfg.entry, splits)
        assert ("split-K" in choice.reason) == (splits > 1) and choice.to_json().get("splits", 1) == splits
    cfg = WG.config("conv3x3_wgmma_bn64_mt1_wg1_bk64")
    with pytest.raises(InputError, match="leave one empty"):
        WG.launch("float16", 1, 16, 16, 64, 64, entry=cfg.entry, splits=6)  # 9 k-blocks: 5 splits of 2 fit, 6 do not
    with pytest.raises(InputError, match="splits=0"):
        WG.launch("float16", 1, 16, 16, 64, 64, entry=cfg.entry, splits=0)


def test_choose_conv3x3_decides_between_the_kernels() -> None:
    p = ConvProblem.dense(1, 64, 64, 64, 128)
    on = choose_conv3x3(p, wgmma_off=None, tuned="conv3x3_nhwc_f16_t64x32x32_w2x2_s4_b4", x=X, w=W_, y=Y)
    assert (on.impl, on.entry) == ("wgmma", WG.choose(1, 64, 64, 64, 128).entry)  # a tuned tile does not displace it
    assert "CTAs" in on.reason and on.to_json() == {"impl": on.impl, "entry": on.entry, "reason": on.reason}
    off = choose_conv3x3(p, wgmma_off="DUALTRACK_WGMMA=0")
    assert off == kernels.ConvChoice(
        "mma.sync",
        kernels.KERNELS["conv3x3"].variant("float16", 1, 64, 64, 64, 128),
        "heuristic; wgmma: DUALTRACK_WGMMA=0",
    )
    tuned = choose_conv3x3(p, wgmma_off="DUALTRACK_WGMMA=0", tuned="conv3x3_nhwc_f16_wide")
    assert (tuned.impl, tuned.entry) == ("mma.sync", "conv3x3_nhwc_f16_wide") and tuned.reason.startswith("tuned")
    first = choose_conv3x3(ConvProblem.dense(1, 64, 64, 3, 32), wgmma_off=None)  # the RGB layer: the small-C entry
    assert (first.impl, first.entry) == ("direct", "conv3x3_nhwc_f16_smallc") and "wgmma: C=3" in first.reason
    misaligned = choose_conv3x3(p, wgmma_off=None, x=X + 8)
    assert misaligned.impl == "mma.sync" and "not 16-byte aligned" in misaligned.reason
    fp32 = choose_conv3x3(ConvProblem.dense(1, 64, 64, 64, 128, "float32"), wgmma_off=None)
    assert (fp32.impl, fp32.entry) == ("simt", "conv3x3_nhwc_f32")


# -- tensor maps and kernel arguments ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 8])
def test_tensor_maps_of_every_unet_layer(n: int) -> None:
    for _, C, K, HW in UNET_LAYERS:
        assert WG.supported(ConvProblem.dense(n, HW, HW, C, K)) is None
        for c in (c for c in WGMMA_CONFIGS if not c.pointwise):  # the 1x1 maps: tests/test_wgmma1x1.py
            mx = input_map(c, X, n, HW, HW, C, C)
            mw = weight_map(c, W_, K, C)
            # what the producer's expect_tx counts: the A box and its taps' B boxes
            assert mx.box_bytes + c.taps_per_stage * mw.box_bytes == c.tx_bytes
            tw = c.halo_tw or min(c.bm, HW)
            halo = 2 if c.halo_tw else 0  # a column copy's two extra image rows
            assert mx.box == (c.bk, tw, c.bm // tw + halo, 1) and mw.box == (c.bk, c.bn)
            assert mx.swizzle_bytes == mw.swizzle_bytes == c.row_bytes


def test_tensor_maps_of_channel_slices() -> None:
    c = WG.config("conv3x3_wgmma_bn64_mt2_wg2_bk64")
    m = input_map(c, X + 32, 2, 24, 40, 96, 128)  # channels [16, 112) of a 128-wide tensor
    assert m.address == X + 32 and m.dims == (96, 40, 24, 2)
    assert m.strides == (256, 40 * 256, 24 * 40 * 256)
    w = weight_map(c, W_, 40, 96)
    assert w.dims == (9 * 96, 40) and w.strides == (9 * 96 * 2,)


def test_tensor_map_rules_name_the_broken_one() -> None:
    c = WG.config("conv3x3_wgmma_bn128_mt2_wg2_bk64")
    with pytest.raises(InputError, match="address 0x1008 is not 16-byte aligned"):
        input_map(c, 0x1008, 1, 8, 8, 64, 64)
    with pytest.raises(InputError, match="stride 1 = 136 bytes is not a positive multiple of 16"):
        input_map(c, 0x1000, 1, 8, 8, 64, 68)
    with pytest.raises(InputError, match="stride 1 = 112 bytes is less than the 128 bytes"):
        input_map(c, 0x1000, 1, 8, 8, 64, 56)
    base = TiledMap(0x1000, (64, 8), (128,), (64, 8), swizzle_bytes=128)
    base.validate()
    bad = {
        "box dim 1 = 512 is outside 1..256": {"box": (64, 512)},
        "inner 256 bytes exceed the 128-byte swizzle": {"box": (128, 8), "dims": (128, 8), "strides": (256,)},
        "box's inner dimension is 10 bytes": {"box": (5, 8), "swizzle_bytes": 0},
        "dim 0 = 0 is outside": {"dims": (0, 8)},
        "needs rank-1 = 1 strides": {"strides": ()},
        "swizzle 96 is not one of": {"swizzle_bytes": 96},
        "L2 promotion 32 is not one of": {"l2_promotion_bytes": 32},
    }
    for message, change in bad.items():
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            TiledMap(**{**base.__dict__, **change}).validate()


def test_encode_args_are_what_cuTensorMapEncodeTiled_takes() -> None:
    c = WG.config("conv3x3_wgmma_bn64_mt2_wg2_bk32")
    args = tma.encode_args(input_map(c, X, 2, 9, 13, 8, 16))
    dtype, rank, address, dims, strides, box, elem, interleave, swizzle, l2, oob = args
    assert dtype == cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16 and rank == 4 and address == X
    assert [int(d) for d in dims] == [8, 13, 9, 2] and [int(s) for s in strides] == [32, 13 * 32, 9 * 13 * 32]
    assert [int(b) for b in box] == [32, 16, 16, 1] and [int(e) for e in elem] == [1, 1, 1, 1]
    assert interleave == cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    assert swizzle == cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B
    assert l2 == cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B
    assert oob == cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE  # zeros: the padding
    w = tma.encode_args(weight_map(WG.config("conv3x3_wgmma_bn128_mt2_wg2_bk64"), W_, 64, 64))
    assert w[8] == cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B and [int(b) for b in w[5]] == [64, 128]


def test_kernel_args_pass_the_tensor_maps_by_value() -> None:
    entry = "conv3x3_wgmma_bn128_mt1_wg1_bk64"
    tmx, tmw = cu.CUtensorMap(), cu.CUtensorMap()
    tmx.opaque = [cu.cuuint64_t(0x1111_0000 + i) for i in range(16)]
    p = ConvProblem(2, 9, 13, 64, 200, ldx=64, ldy=208)
    args = WG.args(p, tmx=tmx, tmw=tmw, bias=0x7F00, y=Y, relu=True, entry=entry)
    values, types = zip(*args, strict=True)
    c32, f32 = ctypes.c_int32, ctypes.c_float
    assert types == (
        None, None, *(ctypes.c_void_p,) * 3, *(c32,) * 8, f32, f32, c32, c32, ctypes.c_void_p, ctypes.c_void_p
    )  # fmt: skip
    # no residual (null, ldr 0); act 1 (ReLU), p0 = p1 = 0; tw_log2: 16 columns for W=13; dilation 1;
    # no split-K workspace; status null
    assert values[2:] == (0x7F00, 0, Y, 2, 9, 13, 64, 200, 208, 0, 1, 0.0, 0.0, 4, 1, 0, 0)
    assert len(args) == len(WG.PARAMS)
    from dualtrack.runtime.driver import kernel_params

    packed = cu._HelperKernelParams(kernel_params(args))  # what cuLaunchKernel hands the driver
    slots = (ctypes.c_void_p * len(args)).from_address(packed.ckernelParams)
    assert ctypes.string_at(slots[0], 128) == b"".join((0x1111_0000 + i).to_bytes(8, "little") for i in range(16))
    assert ctypes.c_int32.from_address(slots[15]).value == 4
    with pytest.raises(InputError, match="tmx must be a CUtensorMap"):
        WG.args(ConvProblem.dense(1, 1, 1, 8, 8), tmx=X, tmw=tmw, y=Y, entry=entry)
    with pytest.raises(TypeError, match=r"a by-value struct must be a cuda\.bindings struct"):
        kernel_params([(X, None)])


# -- bundles ----------------------------------------------------------------------------------------


def test_only_sm90a_targets_carry_the_wgmma_kernel(tiny_full_config: Path) -> None:
    from dualtrack.compiler import partition
    from dualtrack.compiler.config import load_config

    cfg = load_config(tiny_full_config)
    plan, _ = partition.plan_config(cfg)
    fp16 = ["conv3x3_nhwc", "convt2x2_nhwc", "maxpool2x2_nhwc"]
    assert track_a_stems(plan, "compute_90a") == ["conv3x3_nhwc", "conv3x3_wgmma", "convt2x2_nhwc", "maxpool2x2_nhwc"]
    assert track_a_stems(plan, "compute_80") == track_a_stems(plan, "compute_120") == fp16
    assert ARCHES["sm_90a"].ptx_arch in WG.ptx_arches and ARCHES["sm_120"].ptx_arch not in WG.ptx_arches


def test_tiny_full_bundle_has_the_wgmma_module_for_sm90a_only(tiny_full_bundle: Path) -> None:
    ta = Bundle.open(tiny_full_bundle).track_a
    assert "conv3x3_wgmma" in ta["kernels"]
    assert "conv3x3_wgmma" in ta["ptx"]["compute_90a"] and "conv3x3_wgmma" in ta["cubin"]["sm_90a"]
    assert "conv3x3_wgmma" not in ta["ptx"]["compute_80"] and "conv3x3_wgmma" not in ta["cubin"]["sm_80"]
    cubin = (tiny_full_bundle / ta["cubin"]["sm_90a"]["conv3x3_wgmma"]["path"]).read_bytes()
    assert cubin[:4] == b"\x7fELF" and all(e.encode() in cubin for e in WG.entries)


def test_the_gpu_tests_model_runs_the_wgmma_kernel_almost_everywhere(tiny_wgmma_config: Path) -> None:
    """tests/data/tiny_wgmma.yaml (the GPU tests' bundle): every conv but the first (C=3) on the
    wgmma kernel at both batch sizes, skip connections written into concatenation slices, partial
    tiles, several configurations."""
    from dualtrack.compiler import partition
    from dualtrack.compiler.config import load_config
    from dualtrack.kernels.problems import conv_layers

    cfg = load_config(tiny_wgmma_config)
    plan, _ = partition.plan_config(cfg)
    assert track_a_stems(plan, "compute_90a") == ["conv3x3_nhwc", "conv3x3_wgmma", "convt2x2_nhwc", "maxpool2x2_nhwc"]
    layers = conv_layers(plan)
    picks = {}
    for x in layers:
        picks[x.node, x.batch] = choose_conv3x3(x.problem, wgmma_off=None)
    assert [key for key, c in picks.items() if c.impl != "wgmma"] == [("enc1/conv1", 1), ("enc1/conv1", 3)]
    assert any(x.problem.ldy > x.problem.K for x in layers)  # a conv writing half of a concatenation
    on = [(x.problem, picks[x.node, x.batch]) for x in layers]
    on = [(p, WG.config(c.entry)) for p, c in on if c.impl == "wgmma"]
    assert any(p.W % (1 << cfg.tw_log2(p.W)) for p, cfg in on)  # tiles that hang over the image's edge
    assert len({c.entry for c in picks.values() if c.impl == "wgmma"}) >= 3


def test_enable_tma_false_carries_no_wgmma_module(tiny_full_config: Path) -> None:
    """`enable_tma: false` keeps every arch on mma.sync: the TMA kernel is not even shipped."""
    from dualtrack.compiler import partition
    from dualtrack.compiler.config import load_config

    cfg = load_config(tiny_full_config)
    plan, _ = partition.plan_config(cfg)
    assert "conv3x3_wgmma" in track_a_stems(plan, "compute_90a", use_tma=True)
    assert "conv3x3_wgmma" not in track_a_stems(plan, "compute_90a", use_tma=False)


def test_unsupported_plans_carry_no_wgmma_module(tiny_config: Path) -> None:
    from dualtrack.compiler import partition
    from dualtrack.compiler.config import load_config

    cfg = load_config(tiny_config)  # fp32: the wgmma kernel is fp16 only
    plan, _ = partition.plan_config(cfg)
    assert "conv3x3_wgmma" not in track_a_stems(plan, "compute_90a")


# -- the runtime's glue, on a mock driver -----------------------------------------------------------


class _Kernel:
    def __init__(self, name: str, launched: list) -> None:
        self.name, self.launched = name, launched
        self.max_dynamic_shared = 48 << 10

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        self.max_dynamic_shared = nbytes

    def launch(self, grid, block, shared, stream, args) -> None:
        assert shared <= self.max_dynamic_shared, f"{self.name}: {shared} B of shared memory without opting in"
        self.launched.append((self.name, grid, block, shared, args))


def _backend(monkeypatch: pytest.MonkeyPatch, wgmma_off: str | None = None):
    """A Track A executor with no GPU: kernels that record launches, tensor maps encoded by a fake."""
    from dualtrack.runtime import gpu, track_a

    encoded: list[TiledMap] = []

    def fake_encode(m: TiledMap) -> cu.CUtensorMap:
        encoded.append(m)
        return cu.CUtensorMap()

    monkeypatch.setattr(tma, "encode", fake_encode)
    be = track_a.TrackA.__new__(track_a.TrackA)
    launched: list = []
    names = [*kernels.KERNELS["conv3x3"].entries, *WG.entries]
    be.kernels = {n: _Kernel(n, launched) for n in names}
    be.weights = {
        "w": gpu.GpuTensor(W_, (64, 3, 3, 64), np.dtype("float16")),
        "b": gpu.GpuTensor(0x7E00, (64,), np.dtype("float32")),
    }
    be.tuned, be.launches, be.stats, be.stream = {}, {}, gpu.Stats(), object()
    be.wgmma_off, be.device = wgmma_off, REFERENCE
    be._workspace = lambda key, nbytes: 0x7F0000  # split-K scratch: an address (nothing runs)
    return be, launched, encoded


def _env(x_ptr: int, *, c: int = 64, ld: int = 0):
    from dualtrack.runtime.gpu import GpuTensor

    return {
        "x": GpuTensor(x_ptr, (1, 32, 32, c), np.dtype("float16"), ld=ld),
        "y": GpuTensor(Y, (1, 32, 32, 64), np.dtype("float16")),
    }


CALL = KernelCall("conv3x3", ("x",), ("y",), ("w", "b"), (("relu", 1),), ("enc2/conv2",))


def test_launches_are_prepared_once_per_buffer_set(monkeypatch: pytest.MonkeyPatch) -> None:
    be, launched, encoded = _backend(monkeypatch)
    env = _env(X)
    be._launch(CALL, env)
    be._launch(CALL, env)
    cfg = WG.choose(1, 32, 32, 64, 64)
    assert [name for name, *_ in launched] == [cfg.entry, cfg.entry]
    assert launched[0][3] == cfg.smem_bytes and launched[0][4] is launched[1][4]  # the same prepared arguments
    assert [m.address for m in encoded] == [X, W_]  # two maps, encoded once
    (recorded,) = be.stats.conv3x3["enc2/conv2"].values()
    assert (recorded["impl"], recorded["entry"]) == ("wgmma", cfg.entry) and list(be.stats.conv3x3["enc2/conv2"]) == [1]
    be._launch(CALL, _env(X + 4096))  # a segment input at another address (no CUDA graph): new maps
    assert [m.address for m in encoded] == [X, W_, X + 4096, W_]
    assert len(be.launches) == 1


def test_unsupported_or_disabled_convs_keep_the_mma_sync_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    be, launched, encoded = _backend(monkeypatch)
    be._launch(CALL, _env(X + 8, ld=72))  # misaligned slice
    assert launched[-1][0] == kernels.KERNELS["conv3x3"].variant("float16", 1, 32, 32, 64, 64) and not encoded
    assert "not 16-byte aligned" in be.stats.conv3x3["enc2/conv2"][1]["reason"]
    be, launched, encoded = _backend(monkeypatch, wgmma_off="DUALTRACK_WGMMA=0")
    be.tuned = {"enc2/conv2": {"1": "conv3x3_nhwc_f16_small"}}
    be._launch(CALL, _env(X))
    assert launched[-1][0] == "conv3x3_nhwc_f16_small" and not encoded
    assert be.stats.conv3x3["enc2/conv2"][1]["impl"] == "mma.sync"
    be2, _, _ = _backend(monkeypatch)
    assert be2.prepare(CALL, _env(X), allow_wgmma=False).choice.impl == "mma.sync"


def _general_call(*, act: str = "relu", stride: int = 1, residual: bool = True) -> KernelCall:
    geom = kernels.ConvGeometry(3, 3, stride, stride, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
    ins = ("x", "r") if residual else ("x",)
    attrs = (*geom.attrs(), ("act", kernels.ACTIVATIONS[act]), ("residual", int(residual)))
    return KernelCall("conv", ins, ("y",), ("w", "b"), attrs, ("layer4/1/conv2",))


def test_general_3x3_convs_with_a_residual_run_the_wgmma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """ResNet's second conv of a block (the general conv: bias + residual + ReLU) takes the wgmma
    kernel on sm_90a, the residual's pointer and stride in its arguments, and so does one with
    another activation (its id and parameters in the arguments); strides other than 1 or a residual
    the epilogue cannot read keep the mma.sync kernel."""
    from dualtrack.runtime.gpu import GpuTensor

    be, launched, encoded = _backend(monkeypatch)
    general = kernels.KERNELS["conv"]
    be.kernels.update({n: _Kernel(n, launched) for n in general.entries})
    res = 0x7D0000
    env = {**_env(X), "r": GpuTensor(res, (1, 32, 32, 64), np.dtype("float16"), ld=128)}
    be._launch(_general_call(), env)
    cfg = WG.choose(1, 32, 32, 64, 64)
    name, *_, args = launched[-1]
    assert name == cfg.entry and [m.address for m in encoded] == [X, W_]
    got = dict(zip(WG.PARAMS, (v for v, _ in args), strict=True))
    assert (got["res"], got["ldr"], got["act"], got["ldy"], got["bias"]) == (res, 128, 1, 64, 0x7E00)
    assert be.stats.conv3x3["layer4/1/conv2"][1]["impl"] == "wgmma"

    be, launched, encoded = _backend(monkeypatch)
    be.kernels.update({n: _Kernel(n, launched) for n in general.entries})
    odd = {**env, "r": GpuTensor(res, (1, 32, 32, 64), np.dtype("float16"), ld=65)}
    be._launch(_general_call(act="sigmoid"), env)
    got = dict(zip(WG.PARAMS, (v for v, _ in launched[-1][-1]), strict=True))
    assert launched[-1][0] == cfg.entry and got["act"] == kernels.ACTIVATIONS["sigmoid"]
    encoded.clear()
    cases = (
        (_general_call(stride=2, residual=False), env),
        (_general_call(), odd),
    )
    for call, e in cases:
        be.launches.clear()
        if call.attr("stride_h") == 2:
            e = {**e, "y": GpuTensor(Y, (1, 16, 16, 64), np.dtype("float16"))}
        be._launch(call, e)
        assert launched[-1][0].startswith("conv_nhwc_f16"), call
    assert not encoded
    why = choose_conv(general, ConvProblem.dense(1, 32, 32, 64, 64), REFERENCE, window=kernels.ConvGeometry(3, 3,
        pad_top=1, pad_left=1, pad_bottom=1, pad_right=1), act=kernels.Activation.named("relu"),
        at=Pointers(res=res, ldr=65)).reason  # fmt: skip
    assert why.endswith("wgmma: ldr=65: the epilogue reads the residual's channel pairs (ldr % 2 == 0)")


class _Module:
    def __init__(self, origin: str, opted: dict) -> None:
        self.origin, self.opted, self.load_ms, self.cache = origin, opted, 0.1, "off"

    def function(self, name: str):
        opted = self.opted

        class _Fn:
            def set_max_dynamic_shared(self, nbytes: int) -> None:
                opted[name] = nbytes

        return _Fn()


@pytest.mark.parametrize(
    ("cc", "wgmma", "off"),
    [
        ((9, 0), True, None),
        ((9, 0), False, "DUALTRACK_WGMMA=0"),
        ((8, 0), True, "the sm_80 cubin has no conv3x3_wgmma (sm_90a targets only)"),
    ],
)
def test_the_loader_loads_the_wgmma_module_where_it_runs(
    tiny_full_bundle: Path, monkeypatch: pytest.MonkeyPatch, cc, wgmma, off
) -> None:
    from dualtrack.runtime import gpu, track_a
    from dualtrack.runtime.code_images import device_images

    loaded: list[str] = []
    opted: dict[str, int] = {}

    def fake_load(ctx, image, *, kind, origin, target, cache_dir=None):
        loaded.append(Path(origin).stem)
        return _Module(origin, opted)

    monkeypatch.setattr(track_a.Module, "load", staticmethod(fake_load))
    bundle = Bundle.open(tiny_full_bundle)
    images = device_images(bundle, cc, wgmma=wgmma)
    assert images.wgmma_off == off
    ta = track_a.TrackA.__new__(track_a.TrackA)
    ta.ctx, ta.stats = None, gpu.Stats()
    found = ta.load(images, bundle.root, tiny_full_bundle / "jit")
    assert ta.stats.wgmma == (f"off: {off}" if off else "on: conv3x3_wgmma in the sm_90a cubin")
    assert ("conv3x3_wgmma" in loaded) == (off is None)
    assert set(WG.entries) <= set(found) if off is None else not set(WG.entries) & set(found)
    assert opted == ({c.entry: c.smem_bytes for c in WG.all_configs} if off is None else {})


def test_a_heads_few_channels_get_a_16_byte_stride_and_run_on_the_wgmma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Track A buffer no other track reads, of 2 fp16 channels (a head's classes), is laid out with a channel
    stride of 8 (16 bytes), so its 3x3 conv takes the wgmma kernel's 16-channel tile instead of the direct
    entry; a segment output stays dense (IREE reads it), and so do buffers of whole 16-byte pixels."""
    from dualtrack.contract.plan import Segment, TensorSpec, padded_channels
    from dualtrack.kernels.problems import channel_strides
    from dualtrack.runtime import track_a

    assert [padded_channels(c, "float16") for c in (1, 2, 3, 8, 9, 16)] == [8, 8, 8, 8, 16, 16]
    assert [padded_channels(c, "float32") for c in (2, 4, 5)] == [4, 4, 8]
    assert padded_channels(3, "uint8") == 3  # e4m3 activations: quantize_fp8 writes them dense
    geom = kernels.ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
    head = KernelCall("conv", ("x",), ("logits",), ("hw", "hb"), (*geom.attrs(), ("act", 0), ("residual", 0)), ("h",))
    side = KernelCall("conv", ("x",), ("side",), ("hw", "hb"), (*geom.attrs(), ("act", 0), ("residual", 0)), ("s",))
    spec = lambda name, c: TensorSpec(name, (1, 96, 80, c), "float16")  # noqa: E731
    seg = Segment(1, "A", ("h", "s"), (spec("x", 16),), (spec("side", 2),), "", calls=(head, side),
                  tensors=(spec("logits", 2),))  # fmt: skip
    be, launched, _ = _backend(monkeypatch)
    be.weights.update(hw=track_a.GpuTensor(W_, (2, 3, 3, 16), np.dtype("float16")))
    be.weights.update(hb=track_a.GpuTensor(0x7E00, (2,), np.dtype("float32")))
    be.kernels.update((n, _Kernel(n, launched)) for n in kernels.KERNELS["conv"].entries)
    be.buffers, be.pool = {}, type("Pool", (), {"alloc": lambda self, nbytes, stream: 0x7F1000000000 + nbytes})()
    views, roots = be._plan_buffers(seg, 8)
    assert (views["logits"].shape, views["logits"].channel_stride) == ((8, 96, 80, 2), 8)
    assert (views["side"].shape, views["side"].channel_stride, views["side"].ld) == ((8, 96, 80, 2), 2, 0)
    assert sorted(r.shape[-1] for r in roots) == [2, 8]
    assert channel_strides(seg) == {"x": 16, "logits": 8, "side": 2}  # what the tuner and the cost model see
    x = track_a.GpuTensor(X, (8, 96, 80, 16), np.dtype("float16"))
    be._launch(head, {**views, "x": x})
    be._launch(side, {**views, "x": x})
    chosen = be.stats.conv3x3["h"][8]
    assert chosen["impl"] == "wgmma" and chosen["entry"] == "conv3x3_wgmma_bn16_mt2_wg2_bk16_h16"
    assert [name for name, *_ in launched] == ["conv3x3_wgmma_bn16_mt2_wg2_bk16_h16", "conv_nhwc_f16_direct"]
