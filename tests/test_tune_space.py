"""The conv3x3 tile search space: its predicates against the kernel's static_asserts (NVRTC is the
judge), its size, its resource limits against ptxas, and per-problem pruning."""

from __future__ import annotations

import re

import pytest

from dualtrack.compiler.kernel_build import SOURCE_DIR, assemble_cubin, compile_ptx
from dualtrack.contract.arch import ARCHES
from dualtrack.errors import ToolError
from dualtrack.kernels import KERNELS, Conv3x3Spec, F16Tile
from dualtrack.tuning import space

CONV = KERNELS["conv3x3"]
assert isinstance(CONV, Conv3x3Spec)
SOURCE = SOURCE_DIR / "conv3x3_nhwc.cu"
H200 = (9, 0)


def compile_tiles(tiles: list[F16Tile], arch: str = "compute_90a") -> str:
    return compile_ptx(SOURCE, arch, {**CONV.defines(), **CONV.extra_entries_define(tiles)}).text


@pytest.mark.parametrize("cc", sorted(space.SM_LIMITS))
def test_space_has_the_stated_size_and_only_valid_tiles(cc: tuple[int, int]) -> None:
    tiles = space.conv3x3_space(cc)
    lo, hi = space.SPACE_SIZE
    assert lo <= len(tiles) <= hi
    assert tiles == sorted(set(tiles))
    for t in tiles:
        assert space.violations(t) == [] and space.resource_limits(t, cc) == [], t
        assert t.bm // t.warps_m >= space.MIN_WARP_TILE[0] and t.bn // t.warps_n >= space.MIN_WARP_TILE[1]


def test_fixed_variants_satisfy_the_kernel_predicates() -> None:
    for entry, tile in CONV.f16_tiles().items():
        assert space.violations(tile) == [], entry
        assert space.resource_limits(tile, H200) == [], entry


@pytest.fixture(scope="module")
def space_cubin() -> tuple[str, dict]:
    """The whole H200 space compiled as ONE program, as `dualtrack tune` compiles it, and assembled."""
    tiles = space.conv3x3_space(H200)
    text = compile_tiles(tiles)
    return text, assemble_cubin(text, "sm_90a", name="space.ptx").resources


def test_every_tile_of_the_space_compiles_without_spills(space_cubin: tuple[str, dict]) -> None:
    text, resources = space_cubin
    limits = space.sm_limits(H200)
    for t in space.conv3x3_space(H200):
        entry = CONV.tuned_entry(t)
        m = re.search(rf"\.entry {entry}\([^)]*\)\s*\.maxntid (\d+)(?:, 1, 1)?\s*\.minnctapersm (\d+)", text)
        assert m, f"{entry} missing from the PTX"
        assert (int(m.group(1)), int(m.group(2))) == (t.threads, t.min_blocks)  # __launch_bounds__
        assert CONV.launch("float16", 2, 37, 37, 8, 40, entry=entry).block == (t.threads, 1, 1)
        res = resources[entry]
        assert not res.spills, f"{entry}: {res}"
        assert res.registers <= space.register_cap(t, limits)
        assert res.shared_bytes == space.smem_bytes(t)  # the predicates' shared memory is the kernel's


def test_fixed_entries_are_not_compiled_twice(space_cubin: tuple[str, dict]) -> None:
    _, resources = space_cubin
    fixed = set(CONV.f16_tiles())
    assert fixed <= set(resources)
    in_space = [t for t in space.conv3x3_space(H200) if CONV.tuned_entry(t) in fixed]
    assert in_space, "the default tile is in the space, under its own name"
    assert not any(e.endswith(t.name) for t in in_space for e in resources)


@pytest.mark.parametrize(
    ("tile", "message"),
    [
        (F16Tile(128, 64, 64, 2, 2, 3, 2), "static shared memory is capped at 48 KiB"),
        (F16Tile(64, 48, 32, 2, 2, 3, 2), "warp tile must be m16 x n16 multiples"),
        (F16Tile(64, 64, 48, 2, 2, 3, 2), "the swizzle is written for 64- and 128-byte tile rows"),
        (F16Tile(64, 64, 32, 2, 2, 1, 2), "cp.async pipeline needs two stages or more"),
        (F16Tile(64, 96, 32, 2, 2, 3, 2), "epilogue stores"),
        (F16Tile(64, 32, 32, 4, 2, 2, 2), "vector loads"),
        (F16Tile(64, 32, 64, 1, 1, 2, 2), "scalar loads"),
    ],
)
def test_rejected_tiles_fail_to_compile_with_the_same_reason(tile: F16Tile, message: str) -> None:
    assert message in space.violations(tile)
    with pytest.raises(ToolError) as info:
        compile_tiles([tile])
    assert f'static assertion failed with "{message}' in info.value.detail


def test_tiles_the_predicates_accept_outside_the_space_compile() -> None:
    odd = [F16Tile(32, 32, 32, 2, 2, 2, 2), F16Tile(64, 32, 32, 2, 1, 3, 1), F16Tile(128, 32, 64, 4, 1, 2, 1)]
    assert all(space.violations(t) == [] for t in odd)
    assert all(t not in space.conv3x3_space(H200) for t in odd)
    entries = re.findall(r"\.entry (\w+)\(", compile_tiles(odd))
    assert {CONV.tuned_entry(t) for t in odd} <= set(entries)


def test_predicates_match_a_tile_that_barely_fits() -> None:
    # 4 stages of (128 + 64) x 32 halves is exactly 48 KiB: the default tile.
    edge = F16Tile(128, 64, 32, 2, 2, 4, 1)
    assert space.smem_bytes(edge) == 48 * 1024 and space.violations(edge) == []
    assert "static shared memory is capped at 48 KiB" in space.violations(F16Tile(128, 64, 32, 2, 2, 5, 1))


def test_resource_limits_name_what_does_not_fit() -> None:
    big = F16Tile(128, 128, 32, 2, 2, 3, 4)  # 128 accumulators a thread; 4 blocks leave 128 registers
    assert any("registers a thread" in m for m in space.resource_limits(big, H200))
    many = F16Tile(64, 64, 32, 2, 4, 3, 9)
    assert any("threads exceed" in m for m in space.resource_limits(many, H200))
    smem = F16Tile(64, 64, 64, 2, 2, 3, 3)  # 3 x 49 KiB exceed the 100 KiB of an sm_86 SM, not an H200's
    assert space.resource_limits(smem, H200) == []
    assert any("shared memory exceed" in m for m in space.resource_limits(smem, (8, 6)))
    with pytest.raises(ValueError, match=r"no SM limits for compute capability 7\.5"):
        space.sm_limits((7, 5))


def test_warp_layout_prefers_square_warp_tiles() -> None:
    assert space.warp_layout(128, 64, 4) == (2, 2)  # 64x32 warp tiles
    assert space.warp_layout(128, 32, 4) == (4, 1)  # 32x32
    assert space.warp_layout(64, 128, 8) == (2, 4)  # 32x32
    assert space.warp_layout(32, 32, 8) is None


def test_candidates_put_the_fixed_variants_first() -> None:
    fixed = list(CONV.f16_tiles().values())
    tiles = space.candidates(H200, fixed)
    assert tiles[: len(fixed)] == fixed
    assert len(tiles) == len(set(tiles)) == len(set(fixed) | set(space.conv3x3_space(H200)))
    assert space.candidates(H200, fixed, max_configs=6) == tiles[:6]


def test_prune_drops_tiles_that_only_compute_padding() -> None:
    tiles = space.conv3x3_space(H200)
    small_k = space.prune(tiles, pixels=1 << 20, channels=4)
    assert small_k and all(t.bn <= 32 for t in small_k)
    assert {t.bn for t in space.prune(tiles, 1 << 20, 40)} == {32, 64}  # 2 x 48
    few_pixels = space.prune(tiles, pixels=100, channels=512)
    assert few_pixels and all(t.bm <= 128 for t in few_pixels)
    assert space.prune(tiles, 1 << 20, 512) == tiles


def test_tuned_entry_names_encode_their_tile() -> None:
    t = F16Tile(64, 128, 32, 1, 4, 3, 4)
    entry = CONV.tuned_entry(t)
    assert entry == "conv3x3_nhwc_f16_t64x128x32_w1x4_s3_b4"
    assert CONV.entry_tile(entry) == t and F16Tile.parse(t.name) == t
    assert CONV.tuned_entry(CONV.f16_tiles()["conv3x3_nhwc_f16_wide"]) == "conv3x3_nhwc_f16_wide"
    cfg = CONV.launch("float16", 1, 30, 30, 8, 200, entry=entry)
    assert cfg.grid == (-(-900 // 64), -(-200 // 128), 1) and cfg.block == (128, 1, 1)
    assert CONV.extra_entries_define([t, CONV.f16_tiles()["conv3x3_nhwc_f16"]]) == {
        "CONV_F16_EXTRA_ENTRIES": f"CONV_F16_TUNED({entry}, 64,128,32,1,4,3,4)"
    }
    assert CONV.extra_entries_define(CONV.f16_tiles().values()) == {}
    with pytest.raises(Exception, match=r"'conv3x3_nhwc_f16_t64x128' is not an fp16 entry"):
        CONV.entry_tile("conv3x3_nhwc_f16_t64x128")


def test_without_extra_entries_the_checked_in_ptx_is_unchanged() -> None:
    # The hook adds nothing unless the build or the tuner defines CONV_F16_EXTRA_ENTRIES.
    assert compile_tiles([]) == (SOURCE_DIR / "ptx" / "compute_90a" / "conv3x3_nhwc.ptx").read_text()


@pytest.mark.parametrize("gpu", ["sm_80", "sm_120"])
def test_tuned_entries_compile_for_the_other_ptx_targets(gpu: str) -> None:
    info = ARCHES[gpu]
    tiles = [space.conv3x3_space(info.cc)[i] for i in (0, 7, -1)]
    cubin = assemble_cubin(compile_tiles(tiles, info.ptx_arch), gpu)
    for t in tiles:
        assert not cubin.resources[CONV.tuned_entry(t)].spills
