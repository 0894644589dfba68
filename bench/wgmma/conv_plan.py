"""Host-side plan of the wgmma/TMA 3x3 convolution (bench/wgmma/conv3x3_wgmma.cu): pure functions.

Everything the host must compute to launch the kernel lives here, with no GPU and no CUDA library
needed, so it is unit-tested on a CPU machine (test_local.py):

- :data:`CONFIGS` -- the compiled configurations (the one source of truth: build.py turns them
  into the ``-DCONV_WGMMA_ENTRIES`` macro, so code and launch geometry cannot disagree);
- :func:`tile_width` / :func:`launch` -- spatial tile, grid, block, dynamic shared memory;
- :func:`input_map` / :func:`weight_map` -- the ``cuTensorMapEncodeTiled`` arguments, validated
  against the driver's documented rules;
- :func:`smem_desc` -- the wgmma shared-memory descriptor, bit for bit as the kernel builds it
  (the numpy emulator in emulate.py decodes it back);
- :func:`supported` -- which shapes/strides/pointers the kernel takes (else: fall back);
- :func:`pick_config` -- a first heuristic (check.py times every applicable config anyway);
- :data:`UNET_LAYERS` -- the reference U-Net's 3x3 layers (C, K, H=W).
"""

from __future__ import annotations

from dataclasses import dataclass

# The configuration type is dualtrack's: one definition for the kernel that ships and this bench.
from dualtrack.kernels import WgmmaConfig

# ---- machine limits (H100/H200, compute capability 9.0) -------------------------------------
SMEM_PER_SM = 233472  # 228 KiB
SMEM_RESERVED_PER_BLOCK = 1024  # the system's share of each resident block
MAX_DYN_SMEM_PER_BLOCK = 232448  # 227 KiB opt-in limit (cuFuncSetAttribute)
ALIGN = 1024  # slack for rounding the dynamic shared-memory base up to 1024 bytes
NUM_SMS = 132
MAX_STAGES = 8
MAX_HALO_STAGES = 3  # a C <= 64 layer fills 3 stages per CTA in all
ELEM = 2  # fp16 bytes

# tensor-map rules (cuTensorMapEncodeTiled)
TMA_BOX_MAX = 256
TMA_STRIDE_LIMIT = 1 << 40
TMA_DIM_LIMIT = 1 << 32


def smem_budget(min_blocks: int, stages: int) -> int:
    """Bytes of pipeline (stage) memory one CTA may use so that ``min_blocks`` CTAs fit on an SM."""
    per_block = SMEM_PER_SM // min_blocks - SMEM_RESERVED_PER_BLOCK
    per_block = min(per_block, MAX_DYN_SMEM_PER_BLOCK)
    return per_block - ALIGN - 2 * stages * 8


def stages_for(bn: int, mt: int, wgs: int, bk: int, min_blocks: int, halo_tw: int = 0) -> int:
    """As many stages as fit (at most MAX_STAGES; a column-copy config at most MAX_HALO_STAGES),
    checked against the epilogue's staging tile."""
    bm = 64 * mt * wgs
    stage = (bm + 2 * halo_tw + (3 if halo_tw else 1) * bn) * bk * ELEM
    stages = MAX_HALO_STAGES if halo_tw else MAX_STAGES
    while stages >= 2 and stages * stage > smem_budget(min_blocks, stages):
        stages -= 1
    if stages < 2:
        raise ValueError(f"bn={bn} mt={mt} bk={bk}: not even two stages fit in shared memory")
    if bm * (bn + 8) * ELEM > stages * stage:
        raise ValueError(f"bn={bn} mt={mt} bk={bk}: the epilogue tile does not fit in the pipeline memory")
    return stages


def _config(bn: int, mt: int, wgs: int, bk: int, min_blocks: int, halo_tw: int = 0) -> WgmmaConfig:
    stages = stages_for(bn, mt, wgs, bk, min_blocks, halo_tw)
    return WgmmaConfig(bn=bn, mt=mt, wgs=wgs, bk=bk, stages=stages, min_blocks=min_blocks, halo_tw=halo_tw)


# Registers: 288 threads x 224 = 64.5 K -> one CTA per SM for 128 accumulators a thread; configs
# with <= 64 accumulators cap at 112 registers so two CTAs (and their epilogues) overlap. The
# one-warpgroup (wgs=1, BM=64) configs serve layers with few pixels (bottleneck at N=1).
CONFIGS: tuple[WgmmaConfig, ...] = (
    _config(256, 1, 2, 64, 1),
    _config(128, 2, 2, 64, 1),
    _config(128, 1, 2, 64, 2),
    _config(64, 2, 2, 64, 1),
    _config(64, 1, 2, 64, 2),
    _config(32, 2, 2, 64, 2),
    _config(128, 1, 1, 64, 2),
    _config(64, 1, 1, 64, 3),
    _config(64, 2, 2, 32, 2),
    _config(32, 2, 2, 32, 2),
    # Column copies (halo_tw = 16: 16 x 16 or 8 x 16 pixel tiles), for the layers with few
    # channels whose per-tap boxes make them L2-bound.
    _config(32, 2, 2, 32, 2, 16),
    _config(32, 2, 2, 64, 2, 16),
    _config(64, 2, 2, 32, 2, 16),
    _config(64, 2, 2, 64, 1, 16),
    _config(64, 1, 2, 64, 2, 16),
    _config(128, 2, 2, 64, 1, 16),
    # narrow column copies for 8- and 16-channel layers (16-channel k-blocks: 32-byte rows)
    _config(16, 2, 2, 16, 3, 16),
    _config(32, 2, 2, 16, 3, 16),
    _config(16, 2, 2, 32, 3, 16),
    _config(16, 2, 2, 64, 2, 16),
)
BY_ENTRY = {c.entry: c for c in CONFIGS}


def entries_macro(configs: tuple[WgmmaConfig, ...] = CONFIGS) -> str:
    """The -DCONV_WGMMA_ENTRIES value that instantiates ``configs``."""
    return " ".join(c.macro for c in configs)


# ---- geometry --------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_width(cfg: WgmmaConfig, W: int) -> int:
    """log2 of the tile width TW: ``halo_tw`` for a column-copy config, else the smallest power of
    two >= W, capped at BM (TH = BM / TW)."""
    if cfg.halo_tw:
        return cfg.halo_tw.bit_length() - 1
    tw = 1
    while tw < W and tw < cfg.bm:
        tw *= 2
    return tw.bit_length() - 1


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    tw_log2: int
    tiles: int  # CTAs
    tiles_per_image: int


def launch(cfg: WgmmaConfig, N: int, H: int, W: int, K: int) -> Launch:
    """Grid (1-D: channel tile fastest, then tile column, tile row, image), block, shared memory."""
    tw_log2 = tile_width(cfg, W)
    TW = 1 << tw_log2
    TH = cfg.bm // TW
    per_image = _cdiv(H, TH) * _cdiv(W, TW)
    tiles = N * per_image * _cdiv(K, cfg.bn)
    if tiles > 2**31 - 1:
        raise ValueError(f"{tiles} CTAs exceed the grid limit; split the batch")
    return Launch((tiles, 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes, tw_log2, tiles, per_image)


def decode_tile(cfg: WgmmaConfig, block: int, H: int, W: int, K: int, tw_log2: int) -> tuple[int, int, int, int]:
    """(image, h0, w0, n0) of CTA ``block``: the kernel's decode, mirrored for the emulator."""
    TW = 1 << tw_log2
    TH = cfg.bm >> tw_log2
    tiles_w = (W + TW - 1) >> tw_log2
    tiles_h = _cdiv(H, TH)
    n_tiles = _cdiv(K, cfg.bn)
    t = block
    nt = t % n_tiles
    t //= n_tiles
    tw = t % tiles_w
    t //= tiles_w
    th = t % tiles_h
    img = t // tiles_h
    return img, th * TH, tw * TW, nt * cfg.bn


# ---- tensor maps -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMapSpec:
    """Arguments of cuTensorMapEncodeTiled (fp16, no interleave, zero OOB fill)."""

    address: int
    dims: tuple[int, ...]  # elements, innermost first
    strides: tuple[int, ...]  # bytes, dims 1.. (rank-1 values)
    box: tuple[int, ...]
    swizzle_bytes: int  # 64 or 128
    l2_promotion_bytes: int  # 128 or 256

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        n = ELEM
        for b in self.box:
            n *= b
        return n

    def validate(self) -> None:
        """The driver's documented rules; raises ValueError naming the broken one."""
        if not 1 <= self.rank <= 5:
            raise ValueError(f"tensor rank {self.rank} is outside 1..5")
        if len(self.strides) != self.rank - 1 or len(self.box) != self.rank:
            raise ValueError("strides must have rank-1 entries and box rank entries")
        if self.address % 16:
            raise ValueError(f"global address {self.address:#x} is not 16-byte aligned")
        for i, d in enumerate(self.dims):
            if not 1 <= d <= TMA_DIM_LIMIT:
                raise ValueError(f"dim {i} = {d} is outside 1..2^32")
        prev = self.dims[0] * ELEM
        for i, s in enumerate(self.strides):
            if s % 16 or s >= TMA_STRIDE_LIMIT:
                raise ValueError(f"stride {i + 1} = {s} bytes must be a multiple of 16 below 2^40")
            if s < prev:
                raise ValueError(f"stride {i + 1} = {s} bytes is smaller than the {prev} bytes it must span")
            prev = s * self.dims[i + 1]
        for i, b in enumerate(self.box):
            if not 1 <= b <= TMA_BOX_MAX:
                raise ValueError(f"box dim {i} = {b} is outside 1..256")
        if (self.box[0] * ELEM) % 16:
            raise ValueError(f"box inner dimension {self.box[0] * ELEM} bytes is not a multiple of 16")
        if self.box[0] * ELEM > self.swizzle_bytes:
            raise ValueError(
                f"box inner dimension {self.box[0] * ELEM} bytes exceeds the {self.swizzle_bytes}-byte swizzle"
            )


def input_map(cfg: WgmmaConfig, x: int, N: int, H: int, W: int, C: int, ldx: int, tw_log2: int) -> TensorMapSpec:
    """x (NHWC, per-pixel stride ldx elements) as a 4-D tensor (C, W, H, N); box (BK, TW, TH, 1),
    for a column-copy config (BK, TW, TH + 2, 1)."""
    TW = 1 << tw_log2
    spec = TensorMapSpec(
        address=x,
        dims=(C, W, H, N),
        strides=(ldx * ELEM, W * ldx * ELEM, H * W * ldx * ELEM),
        box=(cfg.bk, TW, (cfg.bm + 2 * cfg.halo_tw) // TW, 1),
        swizzle_bytes=cfg.row_bytes,
        l2_promotion_bytes=128,
    )
    spec.validate()
    return spec


def weight_map(cfg: WgmmaConfig, w: int, K: int, C: int) -> TensorMapSpec:
    """Packed weights (K, 3, 3, C) as a 2-D (9C, K) tensor; box (BK, BN)."""
    spec = TensorMapSpec(
        address=w,
        dims=(9 * C, K),
        strides=(9 * C * ELEM,),
        box=(cfg.bk, cfg.bn),
        swizzle_bytes=cfg.row_bytes,
        l2_promotion_bytes=256,
    )
    spec.validate()
    return spec


# ---- wgmma descriptor --------------------------------------------------------------------------


def smem_desc(addr: int, row_bytes: int) -> int:
    """The kernel's smem_desc(): K-major swizzled tile with rows of ``row_bytes`` (= swizzle span)."""
    swizzle = {128: 1, 64: 2, 32: 3}[row_bytes]
    return ((addr & 0x3FFFF) >> 4) | (1 << 16) | (((8 * row_bytes) >> 4) << 32) | (swizzle << 62)


@dataclass(frozen=True)
class Desc:
    start: int  # bytes
    lbo: int  # bytes
    sbo: int  # bytes
    base_offset: int
    swizzle_bytes: int  # 0 (none), 32, 64, 128


def decode_desc(desc: int) -> Desc:
    """The fields of a wgmma matrix descriptor (PTX ISA, 'Matrix Descriptor Format')."""
    mode = (desc >> 62) & 3
    return Desc(
        start=(desc & 0x3FFF) << 4,
        lbo=((desc >> 16) & 0x3FFF) << 4,
        sbo=((desc >> 32) & 0x3FFF) << 4,
        base_offset=(desc >> 49) & 7,
        swizzle_bytes={0: 0, 1: 128, 2: 64, 3: 32}[mode],
    )


# ---- what the kernel takes ---------------------------------------------------------------------


def supported(
    N: int, H: int, W: int, C: int, K: int, ldx: int, ldy: int, x: int = 0, w: int = 0, y: int = 0
) -> str | None:
    """None when the wgmma kernel can run this case, else why not (the caller falls back)."""
    if min(N, H, W, C, K) < 1:
        return "empty tensor"
    if C % 8:
        return f"C={C}: the weight rows (9*C halves) must be 16-byte multiples for TMA (C % 8 == 0)"
    if ldx < C or ldy < K:
        return f"ldx={ldx} / ldy={ldy} smaller than the channel count"
    if ldx % 8:
        return f"ldx={ldx}: TMA needs the pixel stride to be a multiple of 16 bytes (ldx % 8 == 0)"
    if ldy % 8:
        return f"ldy={ldy}: the epilogue's 16-byte stores need ldy % 8 == 0"
    for name, p in (("x", x), ("w", w), ("y", y)):
        if p % 16:
            return f"{name} = {p:#x} is not 16-byte aligned"
    if N * H * W * max(ldx, ldy) >= 2**62:
        return "tensor too large"
    if 9 * C > TMA_DIM_LIMIT:
        return "C too large for a tensor-map dimension"
    return None


def applicable(C: int) -> tuple[WgmmaConfig, ...]:
    """Configs whose k-block suits C: BK=64 when C % 64 == 0, else the BK=32 ones."""
    bk = 64 if C % 64 == 0 else 32
    return tuple(c for c in CONFIGS if c.bk == bk)


def pick_config(N: int, H: int, W: int, C: int, K: int, num_sms: int = NUM_SMS) -> WgmmaConfig:
    """A first heuristic: the widest channel tile that still gives about two waves of CTAs."""
    cands = applicable(C)
    # Prefer tiles that do not waste channels (bn <= K rounded up to 32), then big tiles, as
    # long as there are >= 2 CTAs per SM; otherwise the config with the most CTAs.
    useful = [c for c in cands if c.bn <= max(32, K)] or list(cands)
    useful.sort(key=lambda c: (c.bn * c.bm, c.bn), reverse=True)
    for c in useful:
        if launch(c, N, H, W, K).tiles >= 2 * num_sms * c.min_blocks:
            return c
    return max(useful, key=lambda c: (launch(c, N, H, W, K).tiles, c.bn))


def kernel_arg_names() -> tuple[str, ...]:
    """cuLaunchKernel parameter order (the .cu's CONV_WGMMA_ENTRY)."""
    return (
        "tmx", "tmw", "bias", "res", "y", "N", "H", "W", "C", "K", "ldy", "ldr", "act", "p0", "p1", "tw_log2", "dil",
        "ws", "status",
    )  # fmt: skip


def flops(N: int, H: int, W: int, C: int, K: int) -> int:
    return 2 * N * H * W * K * 9 * C


# The reference U-Net's 3x3 convolutions (base width 32, depth 4, 512x512 input), by name:
# (C, K, H=W); a/b names share a shape (count them twice for a whole-model total). The first
# layer (C=3) is out of scope (TMA needs C % 8 == 0).
UNET_LAYERS: tuple[tuple[str, int, int, int], ...] = (
    ("enc1b/dec1b", 32, 32, 512),
    ("enc2a", 32, 64, 256),
    ("enc2b/dec2b", 64, 64, 256),
    ("enc3a", 64, 128, 128),
    ("enc3b/dec3b", 128, 128, 128),
    ("enc4a", 128, 256, 64),
    ("enc4b/dec4b", 256, 256, 64),
    ("bott_a", 256, 512, 32),
    ("bott_b", 512, 512, 32),
    ("dec4a", 512, 256, 64),
    ("dec3a", 256, 128, 128),
    ("dec2a", 128, 64, 256),
    ("dec1a", 64, 32, 512),
)
