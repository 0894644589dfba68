"""The norm apply pass's launch (kernels/norm.py NormSpec.apply_launch) against the kernel's own map from a
thread to its work (handwritten_ptx/norm_nhwc.cu, norm_apply): image blockIdx.y; of the image's threads, the
first multiple of C/V keep channel vector i % (C/V) and stride over its pixels from i / (C/V) by their count
over C/V. Every (image, pixel, channel vector) must get exactly one thread, over shapes and GPU sizes no zoo
model has (C not a multiple of the block, more channel vectors than a block has threads, one pixel)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dualtrack import kernels
from dualtrack.errors import InputError
from dualtrack.kernels.norm import LAYER_MAX_C, LAYER_PIXELS, flat_reps

NORM = kernels.KERNELS["norm"]


def visits(N: int, H: int, W: int, C: int, V: int, sms: int, dtype: str) -> np.ndarray:
    """How many threads of the launch write each (image, pixel, channel vector), as norm_apply maps them
    when it takes V channels a thread (the launch planned for ``dtype``'s 16-byte vectors where C
    allows: V = 1 is the kernel's path for a pointer it finds unaligned)."""
    cfg = NORM.apply_launch(dtype, N, H, W, C, C, C, sms=sms)
    (bx, by, bz), (tx, ty, tz) = cfg.grid, cfg.block
    assert (by, bz, ty, tz) == (N, 1, 1, 1)
    cv, hw = C // V, H * W
    lanes = bx * tx // cv * cv
    assert lanes > 0, "the launch gives an image fewer threads than channel vectors"
    seen = np.zeros((N, hw, cv), np.int64)
    i = np.arange(lanes)
    for p0 in range(0, hw, lanes // cv):  # the k-th step of every thread at once
        p = p0 + i // cv
        ok = p < hw
        np.add.at(seen, (slice(None), p[ok], (i % cv)[ok]), 1)
    return seen


@pytest.mark.parametrize(
    ("N", "hw", "C", "dtype", "V", "sms"),
    [
        (n, hw, c, dtype, v, sms)
        for n, hw, c, (dtype, v), sms in itertools.product(
            (1, 3),
            ((1, 1), (5, 7), (33, 20)),
            (3, 8, 20, 24, 200, 4104),
            (("float16", 8), ("float16", 1), ("float32", 4), ("float32", 1)),
            (0, 2, 132),
        )
        if c % v == 0
    ],
)
def test_every_item_of_the_apply_pass_gets_exactly_one_thread(
    N: int, hw: tuple[int, int], C: int, dtype: str, V: int, sms: int
) -> None:
    assert (visits(N, *hw, C, V, sms, dtype) == 1).all()


def test_a_gpu_size_makes_threads_stream_several_pixels_and_none_is_idle_beyond_a_block() -> None:
    """At 512x512 x 32 channels, batch 8, on 132 SMs: one wave of the apply blocks an SM holds, each
    thread streaming pixels."""
    cfg = NORM.apply_launch("float16", 8, 512, 512, 32, 32, 32, sms=132)
    threads = cfg.grid[0] * cfg.block[0]
    assert cfg.grid[1] == 8 and 512 * 512 * 4 / threads > 4
    assert cfg.grid[0] * cfg.grid[1] <= 132 * NORM.apply_blocks


@pytest.mark.parametrize(("N", "sms"), [(1, 132), (3, 132), (7, 132), (8, 132), (5, 2), (13, 78)])
def test_the_apply_grid_is_one_wave_with_no_trailing_blocks(N: int, sms: int) -> None:
    """A thread streams its whole share of the image, so a block past the resident wave would run alone
    after it and double the pass: the grid is rounded down to the blocks the SMs hold (big tensors)."""
    cfg = NORM.apply_launch("float16", N, 256, 256, 16, 16, 16, sms=sms)
    assert cfg.grid[0] * cfg.grid[1] <= max(N, sms * NORM.apply_blocks)
    assert cfg.grid[0] * cfg.grid[1] > sms * NORM.apply_blocks - N


def test_a_batch_past_the_grid_is_refused_with_the_fix() -> None:
    with pytest.raises(InputError, match="split the batch"):
        NORM.apply_launch("float16", 70000, 4, 4, 8, 8, 8, sms=132)


def team_width(G: int, items: int) -> int:
    """norm_nhwc.cu's team_width (the Python twin is NormSpec.merge_team)."""
    S = NORM.merge_team(G, items)
    assert S & (S - 1) == 0 and NORM.block_threads % S == 0 and (items <= S or NORM.block_threads // G < S * 2)
    return S


def group_partials_coverage(C: int, Cr: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    """How often group_partials reads each flat channel's chunk summary and writes each group's partial:
    team g % teams of S threads takes group g, lane l items l, l + S, ... of its reps x cg channels
    (copy i / cg of real channel g cg + i % cg is flat channel copy Cr + g cg + i % cg); lane 0 writes.
    Every flat channel must be read once, into the group of its real channel."""
    cg = Cr // G
    items = C // Cr * cg
    S = team_width(G, items)
    teams = NORM.block_threads // S
    reads, writes = np.zeros(C, np.int64), np.zeros(G, np.int64)
    for g0 in range(0, G, teams):
        for g in range(g0, min(G, g0 + teams)):
            for lane in range(S):
                for i in range(lane, items, S):
                    copy = i // cg
                    f = copy * Cr + g * cg + i - copy * cg
                    assert (f % Cr) // cg == g
                    reads[f] += 1
            writes[g] += 1
    return reads, writes


def stats_coverage(
    N: int, H: int, W: int, C: int, planned: int, V: int, sms: int, G: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """How often the stats launch (planned for ``planned`` lanes) reads each (image, pixel, channel) and
    writes each partial when the kernel takes V channels a thread, as norm_stats and stats_tile map
    them: tiles blockIdx.x, += gridDim.x; thread t is row t / cols, column t % cols; row r visits pixels
    p0 + r, += rows of its chunk. A block holding every channel (one tile, a grid one tile wide) merges
    row 0's summaries into a partial a group (group_partials: writes (image, chunk, group)); otherwise
    row 0 writes a partial a channel (writes (image, chunk, channel))."""
    T, hw = NORM.block_threads, H * W
    ch = NORM.chunking(N, H, W, C, G, sms, planned)
    cfg = NORM.stats_launch(N, ch)
    assert cfg.grid == (ch.tiles, ch.chunks, N) and cfg.block == (T, 1, 1)
    cv = C // V
    cols = min(cv, T)
    rows, tiles = T // cols, -(-cv // cols)
    grouped = tiles == 1 and ch.tiles == 1
    reads = np.zeros((N, hw, C), np.int64)
    writes = np.zeros((N, ch.chunks, C), np.int64)
    t = np.arange(rows * cols)
    row, col = t // cols, t % cols
    for k in range(ch.chunks):
        p0 = k * ch.chunk
        length = min(ch.chunk, hw - p0)
        for bx in range(ch.tiles):
            for tile in range(bx, tiles, ch.tiles):
                c = (tile * cols + col) * V
                for j in range(V):
                    ok = c + j < C
                    for p in range(0, length, rows):  # the rows' j-th pixel at once
                        hit = ok & (p + row < length)
                        np.add.at(reads, (slice(None), p0 + p + row[hit], c[hit] + j), 1)
                    first = ok & (row == 0)
                    np.add.at(writes, (slice(None), k, c[first] + j), 1)
    if not grouped:
        return reads, writes
    assert (writes == 1).all()  # row 0's summaries, each read once by the group merge
    summaries, groups = group_partials_coverage(C, C, G)
    assert (summaries == 1).all()
    return reads, np.broadcast_to(groups, (N, ch.chunks, G))


@pytest.mark.parametrize(
    ("N", "hw", "C", "planned", "V"),
    [
        (n, hw, c, p, v)
        for n, hw, c, (p, v) in itertools.product(
            (1, 5),
            ((1, 1), (3, 5), (30, 20)),
            (1, 3, 8, 20, 36, 264, 2056),
            ((8, 8), (8, 1), (4, 4), (1, 1)),
        )
        if c % v == 0 and c % p == 0
    ],
)
def test_the_stats_launch_reads_every_element_once_and_writes_every_partial_once(
    N: int, hw: tuple[int, int], C: int, planned: int, V: int
) -> None:
    """Whichever vector width the kernel finds (the plan's, or 1 for an unaligned pointer); one group,
    C groups, and a group count between where C allows."""
    for G in dict.fromkeys((1, C, 4 if C % 4 == 0 else 1)):
        reads, writes = stats_coverage(N, *hw, C, planned, V, sms=132, G=G)
        assert (reads == 1).all() and (writes == 1).all()


def merge_coverage(
    HW: int, C: int, G: int, chunk: int, chunks: int, reps: int = 1, grouped: bool = False
) -> np.ndarray:
    """The pixels finalize_image merges into each group of an image: team g % teams of S threads takes
    group g; its lane l merges items l, l + S, ..., each counted as its chunk's pixels (of the flat
    view's HW / reps where reps > 1). Per-channel partials [chunk][reps C] (item_offset: chunk
    i / (reps C/G), then the group's channel j % (C/G) in copy j / (C/G) of the C channels, j the item
    within its chunk): every one merged once, into the group of its channel modulo C. ``grouped``
    partials [chunk][G] (group_partials): item i is chunk i, counted reps C/G times (its channels)."""
    T, cg = NORM.block_threads, C // G
    reps_cg = reps * cg
    items = chunks if grouped else chunks * reps_cg
    S = team_width(G, items)
    teams = T // S
    seen = np.zeros((chunks, G if grouped else reps * C), np.int64)
    pixels = np.zeros(G, np.int64)
    for g0 in range(0, G, teams):
        for team in range(teams):
            g = g0 + team
            if g >= G:
                continue
            for lane in range(S):
                for i in range(lane, items, S):
                    if grouped:
                        seen[i, g] += 1
                        pixels[g] += min(chunk, HW // reps - i * chunk) * reps_cg
                        continue
                    k = i // reps_cg
                    j = i - k * reps_cg
                    v = (j // cg) * C + g * cg + j % cg
                    assert (v % C) // cg == g
                    seen[k, v] += 1
                    pixels[g] += min(chunk, HW // reps - k * chunk)
    assert (seen == 1).all()
    return pixels


@pytest.mark.parametrize(
    ("hw", "C", "G"),
    [
        (hw, c, g)
        for hw, c, g in itertools.product(((1, 1), (3, 5), (300, 200)), (1, 3, 8, 20, 36, 264, 2056), (1, 2, 4, 0))
        if c % (g or c) == 0
    ],
)
def test_the_final_merge_takes_every_partial_of_every_group_once(hw: tuple[int, int], C: int, G: int) -> None:
    G = G or C  # 0: instance norm
    ch = NORM.chunking(1, *hw, C, G, sms=132, lanes=8 if C % 8 == 0 else 1)
    grouped = ch.tiles == 1  # a block holds every channel: a partial a group
    assert ch.chunks * (G if grouped else C) <= max(C, NORM.merge_items)
    pixels = merge_coverage(hw[0] * hw[1], C, G, ch.chunk, ch.chunks, grouped=grouped)
    assert (pixels == hw[0] * hw[1] * (C // G)).all()


def layer_visits(N: int, H: int, W: int, C: int, dtype: str, V: int, sms: int) -> np.ndarray:
    """How often the LayerNorm launch writes each (pixel, channel) when the kernel takes V channels a
    load, as layer_norm_any and layer_norm_regs map them (teams of L lanes, K vectors a lane, P pixels
    a team a step, warps striding uniformly), or a warp a pixel (layer_norm) past the register path."""
    cfg = NORM.layer_launch(dtype, N, H, W, C, C, C, sms=sms)
    (bx, by, bz), (tx, ty, tz) = cfg.grid, cfg.block
    assert (by, bz, ty, tz) == (1, 1, 1, 1) and tx % 32 == 0
    pixels, cv = N * H * W, C // V
    team = min(32, 1 << (cv - 1).bit_length())
    k = -(-cv // team)
    seen = np.zeros((pixels, C), np.int64)
    warps = bx * tx // 32
    if C > LAYER_MAX_C or k not in LAYER_PIXELS:
        for p in range(pixels):  # warp p % warps, lanes over the vectors
            seen[p] += 1
        return seen
    per_warp = 32 // team
    step = per_warp * LAYER_PIXELS[k]
    lane, t = np.arange(32) % team, np.arange(32) // team
    for w in range(warps):
        for base in range(w * step, pixels, warps * step):
            for q in range(LAYER_PIXELS[k]):
                p = base + q * per_warp + t
                for kk in range(k):
                    vec = lane + kk * team
                    ok = (p < pixels) & (vec < cv)
                    for j in range(V):
                        np.add.at(seen, (p[ok], vec[ok] * V + j), 1)
    return seen


@pytest.mark.parametrize(
    ("N", "hw", "C", "dtype", "V", "sms"),
    [
        (n, hw, c, dtype, v, sms)
        for n, hw, c, (dtype, v), sms in itertools.product(
            (1, 3),
            ((1, 1), (5, 7)),
            (3, 8, 20, 96, 264, 768, 1032),
            (("float16", 8), ("float16", 1), ("float32", 4)),
            (0, 2),
        )
        if c % v == 0
    ],
)
def test_every_pixel_and_channel_of_the_layer_norm_gets_exactly_one_write(
    N: int, hw: tuple[int, int], C: int, dtype: str, V: int, sms: int
) -> None:
    assert (layer_visits(N, *hw, C, dtype, V, sms) == 1).all()


@pytest.mark.parametrize(("hw", "C", "G", "dtype"), [(hw, c, g, d) for hw in ((4, 6), (300, 200)) for c, g, d in (
    (1, 1, "float16"), (2, 1, "float16"), (2, 2, "float16"), (4, 2, "float16"), (4, 4, "float16"),
    (1, 1, "float32"), (2, 2, "float32"), (2, 1, "float32"))])  # fmt: skip
def test_a_thin_dense_tensor_is_read_flat_and_merged_into_its_own_groups(
    hw: tuple[int, int], C: int, G: int, dtype: str
) -> None:
    """C dividing a 16-byte vector's channels, dense and aligned: the stats launch reads the flat view
    (reps copies of C a vector), and the final merge still gives each group its own pixels."""
    v = 8 if dtype == "float16" else 4
    HW = hw[0] * hw[1]
    reps = flat_reps(dtype, HW, C, (C,), (0x1000,))
    assert reps == v // C
    assert flat_reps(dtype, HW, C, (C + 1,), (0x1000,)) == flat_reps(dtype, HW, C, (C,), (0x1008,)) == 1
    ch = NORM.chunking(1, HW // reps, 1, C * reps, G, sms=132, lanes=C * reps)
    assert ch.tiles == 1 and ch.chunk * ch.chunks >= HW // reps
    summaries, groups = group_partials_coverage(C * reps, C, G)  # each chunk's copies of C, into their groups
    assert (summaries == 1).all() and (groups == 1).all()
    pixels = merge_coverage(HW, C, G, ch.chunk, ch.chunks, reps, grouped=True)
    assert (pixels == HW * (C // G)).all()
