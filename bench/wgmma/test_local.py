"""CPU-only checks of the wgmma conv: build, host plan, emulated index math, pipeline protocol.

    .venv/bin/python -m pytest bench/wgmma/test_local.py -q

No GPU involved. What a CPU can prove: the kernel compiles for sm_90a with no spills and HGMMA in
its SASS (when a cuobjdump is around: $CUOBJDUMP, PATH or the nvidia-cuda-cuobjdump wheel); the
tensor-map arguments obey the driver's rules for every U-Net layer; the kernel's index math (tile
decode, TMA coordinates, swizzle, wgmma descriptors, fragment layout, epilogue addressing)
reproduces a float64 convolution under the documented hardware semantics (emulate.py); the
mbarrier parity protocol neither deadlocks nor overwrites a stage in use. check.py's own flow
runs under --emulate when torch is importable.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build  # noqa: E402
import conv_plan as cp  # noqa: E402
import emulate as em  # noqa: E402

# ---- build ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def record() -> build.BuildRecord:
    return build.build(write=False)


def test_ptx_is_isa_90_for_sm90a(record: build.BuildRecord) -> None:
    assert record.ptx_isa == "9.0"  # driver 580 JITs at most 9.0
    assert record.ptx_target == "sm_90a"  # wgmma needs the arch-specific target


def test_every_config_compiles_without_spills_or_warnings(record: build.BuildRecord) -> None:
    assert set(record.resources) == {c.entry for c in cp.CONFIGS}
    for c in cp.CONFIGS:
        r = record.resources[c.entry]
        assert r["stack_bytes"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, (c.entry, r)
        assert r["static_smem"] == c.static_smem_bytes, (c.entry, r)  # the mbarriers, nothing else
        # registers fit the CTAs per SM the config is sized for
        assert r["registers"] * c.threads * c.min_blocks <= 65536, (c.entry, r)
    # C7509 ("wgmma serialized") or any other ptxas warning would cost performance silently
    assert record.ptxas_warnings == []


def test_sass_has_hgmma_and_tma(record: build.BuildRecord) -> None:
    if record.sass is None:
        pytest.skip("no cuobjdump (set CUOBJDUMP or pip install nvidia-cuda-cuobjdump)")
    for c in cp.CONFIGS:
        s = record.sass[c.entry]
        assert s["HGMMA"] == c.mt * c.bk // 16, (c.entry, s)  # one per (k16 step, m64 block)
        assert s["UTMALDG"] == 2, (c.entry, s)  # the A box and the B box
        assert s["HMMA"] == 0 and s["LDL/STL"] == 0, (c.entry, s)


def test_build_problems_empty(record: build.BuildRecord) -> None:
    assert build.problems(record) == []


def test_source_key_tracks_source_and_configs() -> None:
    k = build.source_key()
    assert k == build.source_key()
    assert k != build.source_key(macro=cp.entries_macro(cp.CONFIGS[:1]))


# ---- plan -----------------------------------------------------------------------------------------


def test_configs_fit_the_sm() -> None:
    for c in cp.CONFIGS:
        assert c.a_bytes % 1024 == 0 and c.b_pitch % 1024 == 0  # tiles stay 1024-aligned
        per_cta = c.smem_bytes + c.static_smem_bytes + cp.SMEM_RESERVED_PER_BLOCK
        assert c.smem_bytes <= cp.MAX_DYN_SMEM_PER_BLOCK
        assert per_cta * c.min_blocks <= cp.SMEM_PER_SM, c
        assert c.bm * (c.bn + 8) * 2 <= c.stages * c.stage_bytes  # epilogue staging fits
        assert c.stages * c.taps_per_stage >= 3 or c.min_blocks > 1, c  # taps of work buffered


def test_entries_macro_names_every_config() -> None:
    m = cp.entries_macro()
    for c in cp.CONFIGS:
        args = f"{c.bn},{c.mt},{c.wgs},{c.bk},{c.stages},{c.min_blocks}"
        want = f"CONV_WGMMA_HALO_ENTRY({args},{c.halo_tw})" if c.halo_tw else f"CONV_WGMMA_ENTRY({args})"
        assert m.split().count(want) == 1


@pytest.mark.parametrize("n", [1, 8])
def test_tensor_maps_valid_for_every_unet_layer(n: int) -> None:
    for _, C, K, HW in cp.UNET_LAYERS:
        assert cp.supported(n, HW, HW, C, K, C, K) is None
        for c in cp.applicable(C):
            geo = cp.launch(c, n, HW, HW, K)
            mx = cp.input_map(c, 0x7F0000000000, n, HW, HW, C, C, geo.tw_log2)
            mw = cp.weight_map(c, 0x7F0000100000, K, C)
            assert mx.box_bytes + c.taps_per_stage * mw.box_bytes == c.tx_bytes  # = the expect_tx count
            tw = c.halo_tw or min(c.bm, HW)
            assert mx.box == (c.bk, tw, c.bm // tw + (2 if c.halo_tw else 0), 1)


def test_tensor_map_rules_reject_bad_arguments() -> None:
    c = cp.BY_ENTRY["conv3x3_wgmma_bn128_mt2_wg2_bk64"]
    with pytest.raises(ValueError, match="16-byte aligned"):
        cp.input_map(c, 0x1008, 1, 8, 8, 64, 64, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        cp.input_map(c, 0x1000, 1, 8, 8, 64, 68, 3)  # ldx*2 = 136 bytes
    with pytest.raises(ValueError, match="smaller than"):
        cp.input_map(c, 0x1000, 1, 8, 8, 64, 56, 3)  # ldx < C
    with pytest.raises(ValueError, match=r"outside 1\.\.256"):
        cp.input_map(c, 0x1000, 1, 8, 8, 64, 64, 9)  # TW = 512 > 256
    assert cp.supported(1, 8, 8, 3, 32, 3, 32) is not None  # first layer C=3: fall back
    assert cp.supported(1, 8, 8, 64, 32, 64, 36) is not None  # ldy % 8
    assert cp.supported(1, 8, 8, 64, 32, 64, 32, x=0x1008) is not None


def test_slice_strides() -> None:
    c = cp.BY_ENTRY["conv3x3_wgmma_bn64_mt2_wg2_bk64"]
    m = cp.input_map(c, 0x1020, 2, 24, 40, 96, 128, 6)  # channels [16, 112) of a 128-wide tensor
    assert m.dims == (96, 40, 24, 2)
    assert m.strides == (256, 40 * 256, 24 * 40 * 256)


def test_descriptor_encoding() -> None:
    d = cp.smem_desc(0x1400, 128)
    assert d & 0x3FFF == 0x1400 >> 4
    assert (d >> 16) & 0x3FFF == 1  # LBO (unused for swizzled K-major)
    assert (d >> 32) & 0x3FFF == 1024 >> 4  # SBO = 8 rows of 128 B
    assert (d >> 49) & 7 == 0
    assert d >> 62 == 1  # 128-byte swizzle
    d64 = cp.smem_desc(0x1400, 64)
    assert (d64 >> 32) & 0x3FFF == 512 >> 4 and d64 >> 62 == 2
    dec = cp.decode_desc(cp.smem_desc(0x2C000, 128) + ((3 * 32) >> 4))
    assert (dec.start, dec.sbo, dec.swizzle_bytes) == (0x2C000 + 96, 1024, 128)


@pytest.mark.parametrize("entry", [c.entry for c in cp.CONFIGS])
@pytest.mark.parametrize("shape", [(2, 9, 13, 40), (1, 32, 32, 512), (3, 5, 70, 64), (1, 1, 1, 8)])
def test_tiles_cover_every_output_once(entry: str, shape: tuple[int, int, int, int]) -> None:
    c = cp.BY_ENTRY[entry]
    N, H, W, K = shape
    geo = cp.launch(c, N, H, W, K)
    seen = np.zeros((N, H, W, -(-K // c.bn)), np.int32)
    TW = 1 << geo.tw_log2
    TH = c.bm // TW
    for b in range(geo.tiles):
        img, h0, w0, n0 = cp.decode_tile(c, b, H, W, K, geo.tw_log2)
        seen[img, h0 : h0 + TH, w0 : w0 + TW, n0 // c.bn] += 1
    assert (seen == 1).all()


# ---- swizzle: the PTX ISA's tables (16-byte chunk numbers per 128-byte line) ---------------------------

PTX_128B = [[i ^ r for i in range(8)] for r in range(8)]
PTX_64B = [[i ^ (r % 4) for i in range(8)] for r in range(8)]


@pytest.mark.parametrize(("span", "table"), [(128, PTX_128B), (64, PTX_64B)])
def test_swizzle_matches_ptx_tables(span: int, table: list[list[int]]) -> None:
    for line in range(16):
        for chunk in range(8):
            phys = em.swizzle(line * 128 + chunk * 16, span)
            assert phys // 128 == line
            assert (phys % 128) // 16 == table[line % 8][chunk]


# ---- emulator ---------------------------------------------------------------------------------------


def _emulate(entry: str, N: int, H: int, W: int, C: int, K: int, ldx: int, ldy: int, x_off: int = 0,
             y_off: int = 0, bias: bool = True, seed: int = 0) -> tuple[float, int, int]:  # fmt: skip
    rng = np.random.default_rng(seed)
    c = cp.BY_ENTRY[entry]
    p = em.Problem(N, H, W, C, K, ldx, ldy, True)
    x = rng.standard_normal((N, H, W, ldx)).astype(np.float16)
    w = (rng.standard_normal((K, 3, 3, C)) / np.sqrt(9 * C)).astype(np.float16)
    b = rng.standard_normal(K).astype(np.float32) if bias else None
    y = em.run(c, p, x, w, b, x_off=x_off, y_off=y_off)
    ref = em.reference(p, x, w, b, x_off)
    out = y[..., y_off : y_off + K].astype(np.float64)
    rel = float(np.linalg.norm(np.nan_to_num(out, nan=1e9) - ref) / np.linalg.norm(ref))
    nan = int(np.isnan(out).sum())
    outside = int((~np.isnan(y[..., :y_off])).sum() + (~np.isnan(y[..., y_off + K :])).sum())
    return rel, nan, outside


CASES = [
    # entry, N, H, W, C, K, ldx, ldy, x_off, y_off
    ("conv3x3_wgmma_bn256_mt1_wg2_bk64", 2, 9, 13, 64, 40, 72, 56, 8, 8),  # partial tiles, K tail
    ("conv3x3_wgmma_bn256_mt1_wg2_bk64", 1, 4, 8, 64, 300, 64, 304, 0, 0),  # two channel tiles, partial
    ("conv3x3_wgmma_bn128_mt2_wg2_bk64", 2, 5, 70, 96, 64, 128, 64, 16, 0),  # C tail inside a tap, W > TW
    ("conv3x3_wgmma_bn128_mt1_wg2_bk64", 1, 1, 1, 64, 128, 64, 128, 0, 0),  # 1x1 image: all padding
    ("conv3x3_wgmma_bn64_mt2_wg2_bk64", 3, 6, 5, 128, 64, 128, 96, 0, 24),  # W < TW, output slice
    ("conv3x3_wgmma_bn64_mt1_wg2_bk64", 1, 17, 9, 64, 24, 64, 24, 0, 0),  # K < BN, K % 16 != 0
    ("conv3x3_wgmma_bn32_mt2_wg2_bk64", 1, 8, 40, 64, 96, 64, 96, 0, 0),  # three channel tiles
    ("conv3x3_wgmma_bn64_mt2_wg2_bk32", 2, 7, 9, 32, 64, 48, 72, 8, 8),  # 64-byte swizzle, slices
    ("conv3x3_wgmma_bn32_mt2_wg2_bk32", 1, 12, 12, 96, 32, 96, 32, 0, 0),  # BK=32 with 3 blocks per tap
    ("conv3x3_wgmma_bn32_mt2_wg2_bk32", 1, 3, 200, 32, 32, 32, 32, 0, 0),  # W > BM: TW = BM, TH = 1
    ("conv3x3_wgmma_bn128_mt1_wg1_bk64", 2, 5, 9, 128, 200, 128, 208, 0, 0),  # one warpgroup, 2 ch tiles
    ("conv3x3_wgmma_bn64_mt1_wg1_bk64", 1, 32, 32, 64, 64, 96, 64, 32, 0),  # one warpgroup: 64x1 tiles
    # column copies (16-pixel-wide tiles, TH + 2 rows per copy, three taps per stage)
    ("conv3x3_wgmma_bn32_mt2_wg2_bk32_h16", 1, 20, 40, 32, 32, 32, 32, 0, 0),  # partial tiles both ways
    ("conv3x3_wgmma_bn64_mt2_wg2_bk32_h16", 2, 7, 9, 32, 64, 48, 72, 8, 8),  # W < TW, 64B swizzle, slices
    ("conv3x3_wgmma_bn32_mt2_wg2_bk64_h16", 1, 17, 18, 64, 32, 64, 32, 0, 0),  # one row past a tile
    ("conv3x3_wgmma_bn64_mt2_wg2_bk64_h16", 1, 18, 17, 128, 64, 128, 64, 0, 0),  # two channel blocks
    ("conv3x3_wgmma_bn64_mt1_wg2_bk64_h16", 2, 9, 20, 96, 40, 96, 40, 0, 0),  # C tail inside a copy, K tail
    ("conv3x3_wgmma_bn128_mt2_wg2_bk64_h16", 1, 16, 16, 64, 136, 64, 136, 0, 0),  # two channel tiles
    # narrow column copies: 32-byte swizzle (16-channel blocks), 16-channel tiles (B boxes of 512 bytes, 1024 apart)
    ("conv3x3_wgmma_bn16_mt2_wg2_bk16_h16", 2, 19, 21, 16, 16, 16, 16, 0, 0),  # partial tiles both ways
    ("conv3x3_wgmma_bn16_mt2_wg2_bk16_h16", 1, 9, 40, 8, 12, 24, 24, 8, 8),  # C = 8 (half a block), K tail, slices
    ("conv3x3_wgmma_bn16_mt2_wg2_bk16_h16", 1, 5, 20, 40, 40, 40, 40, 0, 0),  # C tail, three channel tiles
    ("conv3x3_wgmma_bn32_mt2_wg2_bk16_h16", 1, 17, 18, 16, 32, 16, 32, 0, 0),
    ("conv3x3_wgmma_bn16_mt2_wg2_bk32_h16", 1, 18, 17, 32, 16, 48, 16, 16, 0),
    ("conv3x3_wgmma_bn16_mt2_wg2_bk64_h16", 2, 7, 9, 128, 16, 128, 24, 0, 8),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0][14:]}-{c[1]}x{c[2]}x{c[3]}x{c[4]}-K{c[5]}" for c in CASES])
def test_emulated_kernel_matches_conv(case: tuple) -> None:
    rel, nan, outside = _emulate(*case)
    assert nan == 0 and outside == 0
    assert rel < 1e-3  # fp16 output rounding: ~2e-4


@pytest.mark.parametrize("bug", ["desc-swizzle", "tap-shift", "fragment", "bias"])
def test_emulator_catches_injected_bugs(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulator is sensitive to the mistakes it is meant to rule out."""
    monkeypatch.setattr(em, "BUG", bug)
    rel, _, _ = _emulate("conv3x3_wgmma_bn128_mt2_wg2_bk64", 1, 6, 20, 64, 64, 64, 64)
    assert rel > 1e-2


@pytest.mark.parametrize("bug", ["halo-shift", "tap-shift"])
def test_emulator_catches_column_copy_bugs(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(em, "BUG", bug)
    rel, _, _ = _emulate("conv3x3_wgmma_bn64_mt2_wg2_bk64_h16", 1, 16, 16, 64, 64, 64, 64)
    assert rel > 1e-2


def test_emulator_catches_a_wrong_stride_byte_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    real = cp.smem_desc

    def bad(addr: int, row_bytes: int) -> int:
        d = real(addr, row_bytes)
        return (d & ~(0x3FFF << 32)) | (((4 * row_bytes) >> 4) << 32)  # SBO of 4 rows instead of 8

    monkeypatch.setattr(cp, "smem_desc", bad)
    rel, _, _ = _emulate("conv3x3_wgmma_bn64_mt1_wg2_bk64", 1, 2, 64, 64, 64, 64, 64)
    assert rel > 1e-2


# ---- pipeline protocol ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("stages", "warps"), sorted({(c.stages, 4 * c.wgs) for c in cp.CONFIGS}))
def test_pipeline_protocol(stages: int, warps: int) -> None:
    for num_kb in sorted({1, 2, stages - 1, stages, stages + 1, 9, 18, 36}):
        if num_kb >= 1:
            for seed in range(10):
                em.pipeline_model(stages, num_kb, seed, warps=warps)


def test_pipeline_model_catches_wrong_parity_and_early_release() -> None:
    with pytest.raises(AssertionError, match="deadlock"):
        em.pipeline_model(4, 12, 0, producer_flip=0)
    with pytest.raises(AssertionError, match="refills stage"):
        for seed in range(20):
            em.pipeline_model(4, 12, seed, release_lag=0)


# ---- check.py itself -----------------------------------------------------------------------------------


def test_check_items_are_consistent() -> None:
    import check

    items = check.build_items(quick=False)
    assert len({it.name for it in items}) == len(items)
    for it in items:
        c = cp.BY_ENTRY[it.cfg]
        assert cp.supported(it.N, it.H, it.W, it.C, it.K, it.C, it.K) is None, it
        if it.kind in ("probe-id", "tap"):
            assert it.K <= it.C
        if it.kind in ("probe-id", "probe-w", "rand1"):
            assert cp.launch(c, it.N, it.H, it.W, it.K).tiles == -(-it.K // c.bn)  # one spatial tile
    assert check.build_items(quick=True, only="tap11")[0].kind == "tap"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed (check.py --emulate)")
def test_check_flow_under_emulation(tmp_path: Path) -> None:
    only = "probe-id/conv3x3_wgmma_bn64_mt2_wg2_bk32,tap21/conv3x3_wgmma_bn32,slice/conv3x3_wgmma_bn128_mt1_wg1"
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(HERE / "check.py"), "--emulate", "--quick", "--only", only],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "wgmma_check.json").is_file()
