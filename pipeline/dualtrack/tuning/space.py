"""The search space of the fp16 conv3x3 kernel's tiles, as pure functions.

:func:`violations` restates every ``static_assert`` of ``f16conv::Cfg`` (handwritten_ptx/
conv3x3_nhwc.cu) as a Python predicate, so no candidate that cannot compile is ever handed to
NVRTC (a test compiles the whole space, and checks that rejected samples really fail to compile).
:func:`resource_limits` adds what the GPU imposes: threads per block and per SM, shared memory per
SM, and the register cap that ``__launch_bounds__(THREADS, MIN_BLOCKS)`` implies.

:func:`conv3x3_space` is the stated space: each block tile (BM x BN) of :data:`TILES`, each
k-depth of :data:`DEPTHS` and each warp count of :data:`WARP_COUNTS`, with the warp layout whose
warp tile is closest to square (at least :data:`MIN_WARP_TILE`), the two deepest pipelines of
:data:`STAGES` that fit, and as min-blocks the largest of :data:`MIN_BLOCKS` the SM holds with
registers to spare. That is 35 tiles on every supported compute capability (:data:`SPACE_SIZE`
bounds it; a test holds it there), plus the kernel's four fixed variants. :func:`prune` drops,
per problem, tiles that would compute mostly padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualtrack.kernels import F16Tile

STATIC_SHARED_CAP = 48 * 1024  # bytes: the kernel's tiles are static __shared__ arrays
MAX_BLOCK_THREADS = 1024
TILES = ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128), (256, 32), (256, 64))
DEPTHS = (32, 64)  # BK: the swizzle handles 64- and 128-byte rows
WARP_COUNTS = (4, 8)
STAGES = (2, 3, 4, 5)
STAGE_CHOICES = 2  # the deepest pipelines that fit, per (tile, depth, warps)
MIN_WARP_TILE = (32, 16)  # (pixels, channels) of one warp's tile: below that, fragment reuse is poor
MIN_BLOCKS = (1, 2, 3, 4)
# Registers a thread needs besides its accumulators (fragments, im2col state, addresses), from
# ptxas on sm_90a: tiles under this margin compile without spills (tests/test_tune_space.py).
REGISTER_MARGIN = 56
SPACE_SIZE = (20, 40)  # stated bounds on len(conv3x3_space(cc)); a test holds the space to them


@dataclass(frozen=True)
class SmLimits:
    """What one SM of a compute capability holds (CUDA C Programming Guide, compute capabilities)."""

    threads: int  # resident threads
    shared: int  # shared memory, bytes
    registers: int = 65536
    block_reserved_shared: int = 1024  # the system's shared memory per resident block (sm_80+)


SM_LIMITS: dict[tuple[int, int], SmLimits] = {
    (8, 0): SmLimits(2048, 164 * 1024),
    (8, 6): SmLimits(1536, 100 * 1024),
    (8, 9): SmLimits(1536, 100 * 1024),
    (9, 0): SmLimits(2048, 228 * 1024),
    (10, 0): SmLimits(2048, 228 * 1024),
    (12, 0): SmLimits(1536, 100 * 1024),
}


def smem_halves(t: F16Tile) -> int:
    """``Cfg::SMEM_HALVES``: the pipeline's stages, or the epilogue tile if that is larger."""
    pipe = t.stages * (t.bm + t.bn) * t.bk
    return max(pipe, t.bm * (t.bn + 8))


def smem_bytes(t: F16Tile) -> int:
    return 2 * smem_halves(t)


def accumulators(t: F16Tile) -> int:
    """fp32 accumulator registers a thread holds: (warp tile / m16n8 tile) x 4."""
    return (t.bm // t.warps_m // 16) * (t.bn // t.warps_n // 8) * 4


def violations(t: F16Tile) -> list[str]:
    """The ``static_assert`` messages of ``f16conv::Cfg`` that ``t`` fails (empty: it compiles)."""
    threads, cpr = t.threads, t.bk // 8
    stage = (t.bm + t.bn) * t.bk
    seg_cmax = (smem_halves(t) - (stage + 4 * t.bm)) // (3 * (t.bm + 2))
    checks = (
        (t.bm % (16 * t.warps_m) == 0 and t.bn % (16 * t.warps_n) == 0, "warp tile must be m16 x n16 multiples"),
        (t.bk in (32, 64), "the swizzle is written for 64- and 128-byte tile rows"),
        (t.stages >= 2, "cp.async pipeline needs two stages or more"),
        (threads % cpr == 0 and (t.bm * cpr) % threads == 0 and (t.bn * cpr) % threads == 0, "vector loads"),
        (threads % t.bk == 0 and (t.bm * t.bk) % threads == 0 and (t.bn * t.bk) % threads == 0, "scalar loads"),
        (threads % (t.bn // 8) == 0 and (t.bm * (t.bn // 8)) % threads == 0, "epilogue stores"),
        (smem_bytes(t) <= STATIC_SHARED_CAP, "static shared memory is capped at 48 KiB"),
        (seg_cmax >= 3, "the first layer's C = 3 must take the segment path"),
    )
    return [msg for ok, msg in checks if not ok]


def register_cap(t: F16Tile, limits: SmLimits) -> int:
    """Registers a thread may use under ``__launch_bounds__(threads, min_blocks)`` (8-register
    allocation granules, 255 at most)."""
    return min(255, limits.registers // (t.threads * t.min_blocks) // 8 * 8)


def resource_limits(t: F16Tile, cc: tuple[int, int]) -> list[str]:
    """Why ``t`` does not fit a GPU of compute capability ``cc`` (empty: it fits)."""
    limits = sm_limits(cc)
    out = []
    if not 32 <= t.threads <= MAX_BLOCK_THREADS:
        out.append(f"{t.threads} threads per block (1 to {MAX_BLOCK_THREADS // 32} warps)")
    if t.threads * t.min_blocks > limits.threads:
        out.append(f"{t.min_blocks} blocks of {t.threads} threads exceed the SM's {limits.threads}")
    if t.min_blocks * (smem_bytes(t) + limits.block_reserved_shared) > limits.shared:
        out.append(f"{t.min_blocks} blocks of {smem_bytes(t)} B shared memory exceed the SM's {limits.shared} B")
    need = accumulators(t) + REGISTER_MARGIN
    if register_cap(t, limits) < need:
        out.append(f"{t.min_blocks} blocks leave {register_cap(t, limits)} registers a thread, it needs ~{need}")
    return out


def sm_limits(cc: tuple[int, int]) -> SmLimits:
    try:
        return SM_LIMITS[cc]
    except KeyError:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(SM_LIMITS))
        raise ValueError(f"no SM limits for compute capability {cc[0]}.{cc[1]}; known: {known}") from None


def valid(t: F16Tile, cc: tuple[int, int]) -> bool:
    return not violations(t) and not resource_limits(t, cc)


def warp_layout(bm: int, bn: int, warps: int) -> tuple[int, int] | None:
    """The ``warps_m x warps_n`` split of ``warps`` whose warp tile is closest to square (ties: more
    rows, so A fragments are reused across more n8 tiles), or None if none divides the tile."""
    splits = [(wm, warps // wm) for wm in (1, 2, 4, 8) if warps % wm == 0 and warps // wm >= 1]
    ok = [(wm, wn) for wm, wn in splits if bm % (16 * wm) == 0 and bn % (16 * wn) == 0]
    if not ok:
        return None
    return min(ok, key=lambda s: (abs((bm // s[0]) - (bn // s[1])), -(bm // s[0])))


def conv3x3_space(cc: tuple[int, int]) -> list[F16Tile]:
    """The candidate tiles for a GPU of compute capability ``cc``, every one valid there, sorted."""
    out: set[F16Tile] = set()
    for bm, bn in TILES:
        for bk in DEPTHS:
            for warps in WARP_COUNTS:
                layout = warp_layout(bm, bn, warps)
                if layout is None or bm // layout[0] < MIN_WARP_TILE[0] or bn // layout[1] < MIN_WARP_TILE[1]:
                    continue
                deepest: list[F16Tile] = []
                for stages in STAGES:
                    fits = [t for b in MIN_BLOCKS if valid(t := F16Tile(bm, bn, bk, *layout, stages, b), cc)]
                    if fits:
                        deepest.append(max(fits, key=lambda t: t.min_blocks))
                out.update(deepest[-STAGE_CHOICES:])
    return sorted(out)


def candidates(cc: tuple[int, int], fixed: list[F16Tile], max_configs: int | None = None) -> list[F16Tile]:
    """The tiles to try: the kernel's fixed variants first (they compile everywhere; their
    min-blocks may exceed what a smaller SM holds, which only caps registers), then
    :func:`conv3x3_space` in order; at most ``max_configs`` (None: all)."""
    seen: list[F16Tile] = [t for t in fixed if not violations(t)]
    seen += [t for t in conv3x3_space(cc) if t not in seen]
    return seen if max_configs is None else seen[: max(1, max_configs)]


def prune(tiles: list[F16Tile], pixels: int, channels: int) -> list[F16Tile]:
    """The tiles worth timing on a problem of ``pixels`` output pixels (N*H*W) and ``channels``
    output channels (K): BN at most twice K rounded up to 16, and BM at most the pixel count
    rounded up to 64 (a bigger tile computes only padding)."""
    k_cap = 2 * (-(-channels // 16) * 16)
    m_cap = -(-pixels // 64) * 64
    return [t for t in tiles if t.bn <= k_cap and t.bm <= m_cap]
