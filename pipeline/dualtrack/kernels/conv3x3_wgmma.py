"""conv3x3_wgmma: the Hopper (sm_90a) convolutions, TMA loads and ``wgmma.mma_async`` products: the
3x3 stride-1 convolution (the conv3x3 op, the general conv's 3x3 layers) and, as ``_1x1`` entries of
the same kernel, the 1x1 convolution (a GEMM over the N*H*W pixels: the general conv's pointwise
layers, ConvNeXt's and the transformers' MLPs), with bias, residual and every activation fused.

:class:`WgmmaConfig` is one compiled tile configuration (the ``CONV_WGMMA_ENTRY`` macro's
arguments), :data:`WGMMA_CONFIGS` those compiled in; :func:`input_map` and :func:`weight_map`
describe the two tensor maps a launch passes by value. The conv specs
(:class:`~dualtrack.kernels.conv3x3.Conv3x3Spec`, :class:`~dualtrack.kernels.conv_general.ConvGeneralSpec`,
their ``hopper``) hand a launch over to :meth:`Conv3x3WgmmaSpec.prepare_entry` where the selection
policy picks this kernel.

The kernel reads two maps, both fp16, with the swizzle of one BK-channel row (BK = 64: 128 bytes,
BK = 32: 64 bytes, BK = 16: 32 bytes) and zero fill:

- the input, NHWC with pixel stride ``ldx`` (a channel slice of a wider buffer: the address is the
  slice's first channel), as the 4-D tensor (C, W, H, N); box (BK, TW, TH, 1), one spatial tile of
  BK channels. Coordinates outside the image or past C read as zeros: the convolution's padding.
  A 1x1 entry's: the 2-D tensor (C, N*H*W), box (BK, BM), BM consecutive pixels of any image.
- the packed weights (K, 3, 3, C) as the 2-D tensor (9C, K) (a 1x1 entry's (K, 1, 1, C): (C, K));
  box (BK, BN).

A 1x1 entry is a row of this family rather than a kernel of its own: the pipeline, the consumers,
split-K, the watchdog and the epilogue are the 3x3 kernel's with one tap; only the tile's pixels
(a run of the flattened pixels instead of a spatial tile) and the input map differ.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dualtrack.contract.activations import Activation
from dualtrack.errors import InputError
from dualtrack.kernels import base
from dualtrack.kernels.conv import Conv3x3Reference
from dualtrack.kernels.device import REFERENCE, DeviceInfo
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.select import ConvChoice
from dualtrack.kernels.tensormap import DIM_LIMIT, STRIDE_LIMIT, TiledMap


@dataclass(frozen=True)
class WgmmaConfig:
    """One compiled configuration of ``conv3x3_wgmma.cu``: the ``CONV_WGMMA_ENTRY`` macro's arguments.

    A CTA computes ``bm = 64 * mt * wgs`` output pixels of one image (a TH x TW spatial tile) by
    ``bn`` output channels with ``wgs`` consumer warpgroups of ``mt`` m64 blocks each, plus one
    producer warp that issues the TMA loads. The reduction (9 taps x C channels) runs in
    ``bk``-channel k-blocks (one 32-, 64- or 128-byte swizzled shared-memory row) through ``stages``
    pipeline stages; registers are capped so that ``min_blocks`` CTAs fit on an SM.

    ``halo_tw`` > 0: the column-copy scheme (entry suffix ``_h<TW>``, the .cu's header). The tile
    is ``bm / halo_tw`` rows of ``halo_tw`` pixels, and a stage holds one box of TH + 2 rows per
    column shift plus the weights of its three taps, so each input pixel comes from L2 about three
    times instead of nine.

    ``pointwise``: a 1x1 entry (suffix ``_1x1``): ``bm`` consecutive pixels of the flattened
    N*H*W by ``bn`` channels, ceil(C / bk) k-blocks.

    ``e4m3``: an FP8 row (prefix ``conv3x3_wgmma_e4m3_``, the conv_fp8 op's): both operands one-byte
    e4m3, so a 128-byte swizzled row holds bk = 128 channels (64 bytes: 64); the fp32 accumulators
    are scaled by a per-channel ``dequant`` vector in the epilogue.
    """

    bn: int
    mt: int
    wgs: int
    bk: int
    stages: int
    min_blocks: int
    halo_tw: int = 0
    pointwise: bool = False
    e4m3: bool = False

    ELEMENT_BYTES: ClassVar[int] = 2  # fp16
    ALIGN: ClassVar[int] = 1024  # the kernel rounds its dynamic shared memory up to the 128-byte swizzle repeat

    @property
    def bm(self) -> int:
        return 64 * self.mt * self.wgs

    @property
    def threads(self) -> int:
        return 32 * (4 * self.wgs + 1)  # consumer warpgroups + the producer warp

    @property
    def item_bytes(self) -> int:
        """Bytes of one operand element: 2 (fp16), 1 (an e4m3 row)."""
        return 1 if self.e4m3 else self.ELEMENT_BYTES

    @property
    def map_dtype(self) -> str:
        """The tensor maps' element type (:data:`~dualtrack.kernels.tensormap.DTYPES`)."""
        return "uint8" if self.e4m3 else "float16"

    @property
    def row_bytes(self) -> int:
        """Bytes of one shared-memory tile row: the TMA/wgmma swizzle span (32, 64 or 128)."""
        return self.bk * self.item_bytes

    @property
    def a_rows(self) -> int:
        """Rows of a stage's A box: the tile's pixels, plus two image rows for a column copy."""
        return self.bm + 2 * self.halo_tw

    @property
    def taps_per_stage(self) -> int:
        return 3 if self.halo_tw else 1

    @property
    def a_bytes(self) -> int:
        """Bytes of a stage's A (input) box."""
        return self.a_rows * self.row_bytes

    @property
    def b_bytes(self) -> int:
        """Bytes of one tap's B (weight) box."""
        return self.bn * self.row_bytes

    @property
    def b_pitch(self) -> int:
        """Bytes between a stage's B boxes: :attr:`b_bytes` rounded up to the 1024-byte alignment every
        tile keeps (a 16-channel x 16-row box of 32-byte rows is 512 bytes)."""
        return base.cdiv(self.b_bytes, self.ALIGN) * self.ALIGN

    @property
    def acc_registers(self) -> int:
        """fp32 accumulator registers a consumer thread holds."""
        return self.mt * self.bn // 2

    @property
    def stage_bytes(self) -> int:
        """Shared memory of one stage: the A box, then its taps' B boxes :attr:`b_pitch` apart."""
        return self.a_bytes + self.taps_per_stage * self.b_pitch

    @property
    def tx_bytes(self) -> int:
        """Bytes one stage's boxes bring in: the mbarrier transaction count."""
        return self.a_bytes + self.taps_per_stage * self.b_bytes

    @property
    def taps(self) -> int:
        """Taps of the convolution: 9 (3x3) or 1 (a 1x1 entry)."""
        return 1 if self.pointwise else 9

    @property
    def epilogue_f32_bytes(self) -> int:
        """Bytes of the general epilogue's fp32 staging: ``bm`` rows of ``bn + 8`` floats."""
        return self.bm * (self.bn + 8) * 4

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the pipeline's stages, or the fp32 staging of the
        general epilogue where that is larger (the kernel aligns its base up to 1024 bytes)."""
        return max(self.stages * self.stage_bytes, self.epilogue_f32_bytes) + self.ALIGN

    @property
    def static_smem_bytes(self) -> int:
        return 2 * 8 * self.stages  # the full[] and empty[] mbarriers

    @property
    def entry(self) -> str:
        suffix = f"_h{self.halo_tw}" if self.halo_tw else "_1x1" if self.pointwise else ""
        kind = "_e4m3" if self.e4m3 else ""
        return f"conv3x3_wgmma{kind}_bn{self.bn}_mt{self.mt}_wg{self.wgs}_bk{self.bk}{suffix}"

    @property
    def macro(self) -> str:
        args = f"{self.bn},{self.mt},{self.wgs},{self.bk},{self.stages},{self.min_blocks}"
        if self.e4m3:
            return f"CONV_WGMMA_E4M3_{'1X1_' if self.pointwise else ''}ENTRY({args})"
        if self.halo_tw:
            return f"CONV_WGMMA_HALO_ENTRY({args},{self.halo_tw})"
        if self.pointwise:
            return f"CONV_WGMMA_1X1_ENTRY({args})"
        return f"CONV_WGMMA_ENTRY({args})"

    def tw_log2(self, W: int) -> int:
        """log2 of the spatial tile's width TW: ``halo_tw`` for a column-copy entry (compiled in),
        0 for a 1x1 entry (its tile is a run of pixels, not a spatial tile), else the smallest power
        of two >= W, at most ``bm`` (the tile is ``bm / TW`` rows of TW pixels)."""
        if self.pointwise:
            return 0
        if self.halo_tw:
            return self.halo_tw.bit_length() - 1
        tw = 1
        while tw < W and tw < self.bm:
            tw *= 2
        return tw.bit_length() - 1

    def k_blocks(self, C: int) -> int:
        """Pipeline stages of the whole reduction: 9 taps (3 column copies; 1 tap for a 1x1
        entry) x ceil(C / bk)."""
        return (self.taps // self.taps_per_stage) * base.cdiv(C, self.bk)

    def ctas(self, N: int, H: int, W: int, K: int) -> int:
        """CTAs of a launch: N x spatial tiles x channel tiles, for a 1x1 entry pixel runs x
        channel tiles (the kernel's grid.x; split-K multiplies them by grid.y)."""
        if self.pointwise:
            return base.cdiv(N * H * W, self.bm) * base.cdiv(K, self.bn)
        log2 = self.tw_log2(W)
        return N * base.cdiv(H, self.bm >> log2) * base.cdiv(W, 1 << log2) * base.cdiv(K, self.bn)


# The compiled configurations (bench/wgmma/README.md, "Configurations"): stages as many as fit the
# shared memory that `min_blocks` CTAs per SM leave, registers capped to match; no spills.
WGMMA_CONFIGS: tuple[WgmmaConfig, ...] = (
    WgmmaConfig(bn=256, mt=1, wgs=2, bk=64, stages=4, min_blocks=1),
    WgmmaConfig(bn=128, mt=2, wgs=2, bk=64, stages=4, min_blocks=1),
    WgmmaConfig(bn=128, mt=1, wgs=2, bk=64, stages=3, min_blocks=2),
    WgmmaConfig(bn=64, mt=2, wgs=2, bk=64, stages=5, min_blocks=1),
    WgmmaConfig(bn=64, mt=1, wgs=2, bk=64, stages=4, min_blocks=2),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=64, stages=3, min_blocks=2),
    WgmmaConfig(bn=128, mt=1, wgs=1, bk=64, stages=4, min_blocks=2),
    WgmmaConfig(bn=64, mt=1, wgs=1, bk=64, stages=4, min_blocks=3),
    WgmmaConfig(bn=64, mt=2, wgs=2, bk=32, stages=5, min_blocks=2),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=32, stages=6, min_blocks=2),
    # Column copies (halo_tw=16): for the layers with few channels, which per-tap boxes make L2-bound.
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=32, stages=3, min_blocks=2, halo_tw=16),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=64, stages=2, min_blocks=2, halo_tw=16),
    WgmmaConfig(bn=64, mt=2, wgs=2, bk=32, stages=3, min_blocks=2, halo_tw=16),
    WgmmaConfig(bn=64, mt=2, wgs=2, bk=64, stages=3, min_blocks=1, halo_tw=16),
    WgmmaConfig(bn=64, mt=1, wgs=2, bk=64, stages=2, min_blocks=2, halo_tw=16),
    WgmmaConfig(bn=128, mt=2, wgs=2, bk=64, stages=2, min_blocks=1, halo_tw=16),
    # Narrow column copies for few channels (the full-resolution layers of U-Net decoders and MONAI's
    # networks, 8 or 16 channels in or out): 16-channel k-blocks (32-byte rows) where C <= 16 and
    # 16-channel tiles where K <= 16, so the tensor cores do not multiply the zeros of a 32- or
    # 64-channel tile (a 16 -> 16 layer on the 256x32 tile with 32-channel blocks is 3/4 zeros). A
    # CTA's whole reduction is 3 stages of a few KiB: the overlap is between CTAs, 3 an SM.
    WgmmaConfig(bn=16, mt=2, wgs=2, bk=16, stages=3, min_blocks=3, halo_tw=16),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=16, stages=3, min_blocks=3, halo_tw=16),
    WgmmaConfig(bn=16, mt=2, wgs=2, bk=32, stages=3, min_blocks=3, halo_tw=16),
    WgmmaConfig(bn=16, mt=2, wgs=2, bk=64, stages=2, min_blocks=2, halo_tw=16),
    # 1x1 entries. Not measured yet: tiles that fit two CTAs an SM (three for 64x64) so that one
    # CTA's epilogue overlaps another's loads, since a pointwise layer's reduction is short (C = 96
    # is 3 k-blocks of 32) and its output is as large as its input; stages as many as that leaves.
    WgmmaConfig(bn=128, mt=1, wgs=2, bk=64, stages=3, min_blocks=2, pointwise=True),
    WgmmaConfig(bn=128, mt=1, wgs=2, bk=32, stages=6, min_blocks=2, pointwise=True),
    WgmmaConfig(bn=64, mt=1, wgs=2, bk=64, stages=4, min_blocks=2, pointwise=True),
    WgmmaConfig(bn=64, mt=1, wgs=2, bk=32, stages=8, min_blocks=2, pointwise=True),
    WgmmaConfig(bn=64, mt=1, wgs=1, bk=64, stages=4, min_blocks=3, pointwise=True),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=64, stages=3, min_blocks=2, pointwise=True),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=32, stages=6, min_blocks=2, pointwise=True),
)

# The e4m3 rows (the conv_fp8 op, kernels/conv_fp8.py): a 128-channel e4m3 row is the bytes of a
# 64-channel fp16 one, so each is the fp16 row of the same bytes (bk 64 -> 128, 32 -> 64) with its
# stages and occupancy. Not measured yet. Per-tap boxes only: no column copies.
E4M3_CONFIGS: tuple[WgmmaConfig, ...] = (
    WgmmaConfig(bn=256, mt=1, wgs=2, bk=128, stages=4, min_blocks=1, e4m3=True),
    WgmmaConfig(bn=128, mt=2, wgs=2, bk=128, stages=4, min_blocks=1, e4m3=True),
    WgmmaConfig(bn=64, mt=2, wgs=2, bk=128, stages=5, min_blocks=1, e4m3=True),
    WgmmaConfig(bn=64, mt=1, wgs=1, bk=128, stages=4, min_blocks=3, e4m3=True),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=128, stages=3, min_blocks=2, e4m3=True),
    WgmmaConfig(bn=64, mt=2, wgs=2, bk=64, stages=5, min_blocks=2, e4m3=True),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=64, stages=6, min_blocks=2, e4m3=True),
    WgmmaConfig(bn=128, mt=1, wgs=2, bk=128, stages=3, min_blocks=2, pointwise=True, e4m3=True),
    WgmmaConfig(bn=64, mt=1, wgs=2, bk=128, stages=4, min_blocks=2, pointwise=True, e4m3=True),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=128, stages=3, min_blocks=2, pointwise=True, e4m3=True),
    WgmmaConfig(bn=64, mt=1, wgs=2, bk=64, stages=8, min_blocks=2, pointwise=True, e4m3=True),
    WgmmaConfig(bn=32, mt=2, wgs=2, bk=64, stages=6, min_blocks=2, pointwise=True, e4m3=True),
)


def input_map(cfg: WgmmaConfig, x: int, N: int, H: int, W: int, C: int, ldx: int) -> TiledMap:
    """The input map of the wgmma conv for configuration ``cfg``: x (NHWC, pixel stride ``ldx``
    elements) as (C, W, H, N), box (BK, TW, TH, 1) with ``TW = 2**cfg.tw_log2(W)``; a column-copy
    configuration's box has the two halo rows too, (BK, TW, TH + 2, 1); a 1x1 configuration's is
    the matrix (C, N*H*W), box (BK, BM): rows past N*H*W and channels past C read as zeros."""
    item = cfg.item_bytes
    if cfg.pointwise:
        m = TiledMap(
            address=int(x),
            dims=(C, N * H * W),
            strides=(ldx * item,),
            box=(cfg.bk, cfg.bm),
            swizzle_bytes=cfg.row_bytes,
            l2_promotion_bytes=128,
            dtype=cfg.map_dtype,
        )
        m.validate()
        return m
    tw = 1 << cfg.tw_log2(W)
    m = TiledMap(
        address=int(x),
        dims=(C, W, H, N),
        strides=(ldx * item, W * ldx * item, H * W * ldx * item),
        box=(cfg.bk, tw, cfg.a_rows // tw, 1),
        swizzle_bytes=cfg.row_bytes,
        l2_promotion_bytes=128,
        dtype=cfg.map_dtype,
    )
    m.validate()
    return m


def weight_map(cfg: WgmmaConfig, w: int, K: int, C: int) -> TiledMap:
    """The weight map of the wgmma conv: packed KRSC weights as the (9C, K) matrix (a 1x1
    configuration's: (C, K)), box (BK, BN). A box that runs past a tap's C channels reads the next
    tap's weights, which multiply the zeros the input map supplies past C; past the last tap and
    past K it reads zeros."""
    m = TiledMap(
        address=int(w),
        dims=(cfg.taps * C, K),
        strides=(cfg.taps * C * cfg.item_bytes,),
        box=(cfg.bk, cfg.bn),
        swizzle_bytes=cfg.row_bytes,
        l2_promotion_bytes=256,
        dtype=cfg.map_dtype,
    )
    m.validate()
    return m


@dataclass(frozen=True)
class Conv3x3WgmmaSpec(Conv3x3Reference, base.KernelSpec):
    """The 3x3 stride-1 convolution (the conv3x3 op's semantics, fp16 only) and the 1x1 convolution
    on Hopper: the input and weight tiles come by TMA (``cp.async.bulk.tensor`` into an mbarrier
    pipeline; the tensor map's zero fill outside the image is the padding), the products by
    ``wgmma.mma_async`` from shared memory, fp32 accumulators; bias, the residual, any activation of
    the table and one fp16 rounding in the epilogue (the general conv's epilogue).

    sm_90a only (:attr:`ptx_arches`). One entry per :class:`WgmmaConfig` (:attr:`configs`, compiled
    in through ``-DCONV_WGMMA_ENTRIES``); :meth:`choose` picks one per shape, :meth:`supported`
    says which launches it can take at all. The input and the weights are passed as two
    ``CUtensorMap`` structs by value (``runtime/tma.py`` builds them) instead of ``x``, ``w``, ``ldx``.
    :meth:`reference` is the conv3x3 op's (ReLU or none); with a residual, another activation or a
    1x1 window, the general conv's :meth:`~dualtrack.kernels.ConvGeneralSpec.reference` is what it
    computes (the GPU tests hold it to that and to onnxruntime).
    """

    PARAMS: ClassVar[tuple[str, ...]] = (
        "tmx", "tmw", "bias", "res", "y", "N", "H", "W", "C", "K", "ldy", "ldr", "act", "p0", "p1", "tw_log2", "dil",
        "ws", "status",
    )  # fmt: skip
    ptx_arches: ClassVar[tuple[str, ...]] = ("compute_90a",)  # wgmma exists on sm_90a only

    configs: tuple[WgmmaConfig, ...] = WGMMA_CONFIGS
    # The e4m3 rows, compiled into the same source; only the conv_fp8 op launches them.
    e4m3_configs: tuple[WgmmaConfig, ...] = E4M3_CONFIGS
    # choose(), fitted to the per-layer winners of bench/results/wgmma_check-770a528.json (H200): of
    # these tiles, the first that makes a full wave of CTAs (DeviceInfo.full_wave), else the one with most.
    prefer: tuple[str, ...] = (
        "conv3x3_wgmma_bn128_mt2_wg2_bk64",  # 256x128
        "conv3x3_wgmma_bn64_mt2_wg2_bk64_h16",  # 256x64, column copies
        "conv3x3_wgmma_bn64_mt1_wg2_bk64_h16",  # 128x64, column copies
        "conv3x3_wgmma_bn64_mt1_wg1_bk64",  # 64x64
        "conv3x3_wgmma_bn64_mt2_wg2_bk32_h16",  # 256x64, column copies, C % 64 != 0
    )
    # With one channel block (C <= 64) a CTA fills only 3 stages: two smaller CTAs per SM overlap
    # one's loads with the other's math, so the 128x64 tile goes before the 256x64 one.
    one_block_first: str = "conv3x3_wgmma_bn64_mt1_wg2_bk64_h16"
    narrow: tuple[str, ...] = (
        "conv3x3_wgmma_bn32_mt2_wg2_bk64_h16",
        "conv3x3_wgmma_bn32_mt2_wg2_bk32_h16",
        "conv3x3_wgmma_bn32_mt2_wg2_bk16_h16",
    )  # 16 < K <= 32
    narrow16: tuple[str, ...] = (
        "conv3x3_wgmma_bn16_mt2_wg2_bk64_h16",
        "conv3x3_wgmma_bn16_mt2_wg2_bk32_h16",
        "conv3x3_wgmma_bn16_mt2_wg2_bk16_h16",
    )  # K <= 16
    # 16-channel k-blocks only for C <= 16 (C = 8 or 16) and only on the narrow tiles (K <= 32): a
    # wider layer keeps the 32-channel blocks it was measured with.
    bk16_max_c: int = 16
    # choose(pointwise=True), for the 1x1 entries, by the same rule (not fitted: no measurements
    # yet): 128x128 and 128x64 at two CTAs an SM, then 64x64 (64-channel k-blocks only) at three.
    pw_prefer: tuple[str, ...] = (
        "conv3x3_wgmma_bn128_mt1_wg2_bk64_1x1",
        "conv3x3_wgmma_bn128_mt1_wg2_bk32_1x1",
        "conv3x3_wgmma_bn64_mt1_wg2_bk64_1x1",
        "conv3x3_wgmma_bn64_mt1_wg2_bk32_1x1",
        "conv3x3_wgmma_bn64_mt1_wg1_bk64_1x1",
    )
    pw_narrow: tuple[str, ...] = ("conv3x3_wgmma_bn32_mt2_wg2_bk64_1x1", "conv3x3_wgmma_bn32_mt2_wg2_bk32_1x1")
    # The 3x3 rows' large tiles (128x256, 256x128, one CTA an SM) as 1x1 entries for deep GEMMs (C >= 256) were
    # measured slower on the H100: FCN-ResNet50 at N=8 7.61 ms against 6.64 on these tiles, UPerNet 6.55 against
    # 6.35, the same machine (zoo_bench-02b21b6-s10deep-h100.json against zoo_bench-9e8659f-nodeep-s10*); not kept.
    # Split-K (:meth:`splits`): a launch of less than a full wave of CTAs splits its reduction over up
    # to max_splits CTAs a tile, each at least min_split_kb k-blocks, so the GPU fills (ResNet-34's
    # last stages at N=1: 32 CTAs of 64x64 and 72 k-blocks at 16x16x512).
    max_splits: int = 4
    min_split_kb: int = 8

    @property
    def all_configs(self) -> tuple[WgmmaConfig, ...]:
        """Every compiled row: the fp16 ones, then the e4m3 ones."""
        return (*self.configs, *self.e4m3_configs)

    def defines(self) -> dict[str, str]:
        return {"CONV_WGMMA_ENTRIES": " ".join(c.macro for c in self.all_configs)}

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(c.entry for c in self.all_configs)

    def entry(self, dtype: Any) -> str:
        raise InputError(f"{self.stem} has one entry per tile configuration; use choose(...).entry")

    def config(self, entry: str) -> WgmmaConfig:
        """The configuration an entry name stands for; InputError for any other name."""
        for c in self.all_configs:
            if c.entry == entry:
                return c
        raise InputError(f"'{entry}' is not an entry of {self.stem}; use one of {', '.join(self.entries)}")

    def threads(self, dtype: Any, entry: str | None = None) -> int:
        if entry is None:
            raise InputError(f"{self.stem}: threads() needs the entry (configurations differ)")
        return self.config(entry).threads

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        base.positive(N=N, H=H, W=W, C=C, K=K)
        return (N, H, W, K)

    def supported(self, p: ConvProblem, *, x: int = 0, w: int = 0, y: int = 0) -> str | None:
        """None when this kernel can run launch ``p``, else why not (the caller keeps the mma.sync kernel).

        TMA needs 16-byte multiples for the weight rows (9C halves) and the pixel stride ``ldx``,
        and 16-byte aligned ``x`` and ``w``; the epilogue's 16-byte stores need ``ldy % 8 == 0`` and
        an aligned ``y``. Pointers default to 0 (aligned): the plan's shapes alone can be checked.
        """
        if base.dtype_name(p.dtype) != "float16":
            return f"{base.dtype_name(p.dtype)}: the wgmma kernel is fp16 only"
        N, H, W, C, K = p.N, p.H, p.W, p.C, p.K
        base.positive(N=N, H=H, W=W, C=C, K=K)
        ldx, ldy = base.stride("ldx", p.ldx, C), base.stride("ldy", p.ldy, K)
        if C % 8:
            return f"C={C}: TMA needs 16-byte weight rows (C % 8 == 0)"
        if ldx % 8:
            return f"ldx={ldx}: TMA needs a 16-byte pixel stride (ldx % 8 == 0)"
        if ldy % 8:
            return f"ldy={ldy}: the epilogue's 16-byte stores need ldy % 8 == 0"
        for name, ptr in (("x", x), ("w", w), ("y", y)):
            if int(ptr) % 16:
                return f"{name}={int(ptr):#x} is not 16-byte aligned"
        if N * H * W > base.INT32_MAX or max(ldx, ldy) > base.INT32_MAX:
            return f"N*H*W = {N * H * W} pixels or a channel stride exceed 2^31-1"
        if max(N, H, W, 9 * C, K) >= DIM_LIMIT or N * H * W * ldx * 2 >= STRIDE_LIMIT:
            return "the input is too large for a tensor map (dims < 2^32, byte strides < 2^40)"
        return None

    def residual_supported(self, K: int, res: int, ldr: int) -> str | None:
        """None when the epilogue can add the residual at ``res`` (channel stride ``ldr``) to a
        K-channel output, else why not: it reads channel pairs, 4-byte words."""
        if ldr < K:
            return f"ldr={ldr} < K={K}: the residual's pixels overlap"
        if ldr % 2:
            return f"ldr={ldr}: the epilogue reads the residual's channel pairs (ldr % 2 == 0)"
        if int(res) % 4:
            return f"res={int(res):#x} is not 4-byte aligned"
        return None

    def choose(
        self,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        *,
        device: DeviceInfo = REFERENCE,
        pointwise: bool = False,
        dilation: int = 1,
    ) -> WgmmaConfig:
        """The configuration to launch for this shape on ``device`` (H200 measurements,
        handwritten_ptx/README.md); ``pointwise``: of the 1x1 entries (:meth:`choose_pointwise`).

        k-blocks of 64 channels when ``C % 64 == 0``, else of 32, and of 16 for C <= 16 (with K <= 32, dilation
        1). K <= 16: the 256x16 column-copy tile; K <= 32: the 256x32 one. Else 256x128, then the 256x64 and
        128x64 column-copy tiles (128x64 first when C <= 64), then 64x64 (with 32-channel k-blocks: the 256x64
        column-copy tile only), skipping tiles wider than K rounded up to 32: the first that makes at least
        :attr:`min_ctas` CTAs, else the one that makes the most (of equals, the smaller). Within 0.5% of the
        per-layer best on the U-Net's 26 (layer, batch) pairs (the worst single layer: 1.3%). A CTA a time per
        SM: a full wave is :meth:`DeviceInfo.full_wave` CTAs (128 on the H200's 132 SMs).

        ``dilation`` > 1 (a dilated 3x3): the per-tap tiles only (the column copies' box holds the
        rows of dilation 1), no wider than K rounded up to 32, largest first, by the same rule (not
        fitted: no measurements of dilated layers yet).
        """
        base.positive(N=N, H=H, W=W, C=C, K=K, dilation=dilation)
        if pointwise:
            return self.choose_pointwise(N * H * W, C, K, device=device)
        min_ctas = device.full_wave()
        bk = 64 if C % 64 == 0 else 32
        if self.bk16_max_c >= C and K <= 32 and dilation == 1:
            bk = 16
        if dilation > 1:
            k32 = base.cdiv(K, 32) * 32
            per_tap = [c for c in self.configs if not (c.halo_tw or c.pointwise) and c.bk == bk and c.bn <= k32]
            per_tap.sort(key=lambda c: -c.bm * c.bn)
            return next(
                (c for c in per_tap if c.ctas(N, H, W, K) >= min_ctas),
                max(per_tap, key=lambda c: (c.ctas(N, H, W, K), -c.bm * c.bn)),
            )
        by_entry = {c.entry: c for c in self.configs}
        if K > 32:
            k32 = base.cdiv(K, 32) * 32
            order = list(self.prefer)
            if C <= 64:
                order.remove(self.one_block_first)
                order.insert(1, self.one_block_first)
            wide = [
                by_entry[e]
                for e in order
                if by_entry[e].bk == bk and by_entry[e].bn <= k32 and (dilation == 1 or not by_entry[e].halo_tw)
            ]
            for c in wide:
                if c.ctas(N, H, W, K) >= min_ctas:
                    return c
            if wide:
                # of equals the smaller tile: the same CTAs computing fewer rows and channels past the image
                return max(wide, key=lambda c: (c.ctas(N, H, W, K), -c.bm * c.bn))
        return next(by_entry[e] for e in (self.narrow16 if K <= 16 else self.narrow) if by_entry[e].bk == bk)

    def choose_pointwise(self, M: int, C: int, K: int, *, device: DeviceInfo = REFERENCE) -> WgmmaConfig:
        """The 1x1 entry for an M-pixel GEMM of C -> K channels: k-blocks of 64 channels when
        ``C % 64 == 0``, else of 32; K <= 32: the 256x32 tile; else :attr:`pw_prefer`'s tiles no
        wider than K rounded up to 32, the first whose CTAs fill the GPU at its occupancy
        (:meth:`DeviceInfo.full_wave` of its ``min_blocks``), else the one that makes the most."""
        base.positive(M=M, C=C, K=K)
        bk = 64 if C % 64 == 0 else 32
        by_entry = {c.entry: c for c in self.configs}
        if K > 32:
            k32 = base.cdiv(K, 32) * 32
            wide = [by_entry[e] for e in self.pw_prefer if by_entry[e].bk == bk and by_entry[e].bn <= k32]
            for c in wide:
                if c.ctas(1, 1, M, K) >= device.full_wave(c.min_blocks):
                    return c
            if wide:
                return max(wide, key=lambda c: (c.ctas(1, 1, M, K), -c.bm * c.bn))
        return next(by_entry[e] for e in self.pw_narrow if by_entry[e].bk == bk)

    def splits(
        self, cfg: WgmmaConfig, N: int, H: int, W: int, C: int, K: int, *, device: DeviceInfo = REFERENCE
    ) -> int:
        """Split-K factor of a launch: 1 where it makes a full wave of CTAs on ``device``
        (:meth:`DeviceInfo.full_wave`), else enough splits to reach one (at most :attr:`max_splits`),
        each at least :attr:`min_split_kb` k-blocks long; never an empty split."""
        ctas, kb = cfg.ctas(N, H, W, K), cfg.k_blocks(C)
        want = min(self.max_splits, base.cdiv(device.full_wave(), ctas), kb // self.min_split_kb)
        if want <= 1:
            return 1
        per = base.cdiv(kb, want)
        return base.cdiv(kb, per)  # splits of `per` k-blocks, the last one not empty

    def workspace_bytes(self, cfg: WgmmaConfig, N: int, H: int, W: int, K: int, splits: int) -> int:
        """Bytes of a split-K launch's workspace: fp32 partial sums of every (tile, split), then an
        int counter per tile (0 where splits == 1: no workspace)."""
        if splits <= 1:
            return 0
        ctas = cfg.ctas(N, H, W, K)
        return ctas * splits * cfg.bm * cfg.bn * 4 + ctas * 4

    def launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0, *, entry: str | None = None, splits: int = 1
    ) -> base.LaunchConfig:
        """Grid (tiles, splits): the tiles along x (channel tile fastest, so the CTAs that share an
        input tile run together), the split-K parts along y; block of ``32 * (4 * wgs + 1)``
        threads, dynamic shared memory of the configuration (more than 48 KiB: set
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first). ``entry`` None: :meth:`choose`'s."""
        base.dtype_name(dtype)
        base.positive(N=N, H=H, W=W, C=C, K=K, splits=splits)
        base.pixels(N, H, W, C)
        cfg = self.config(entry) if entry is not None else self.choose(N, H, W, C, K)
        ctas = cfg.ctas(N, H, W, K)
        if ctas > base.INT32_MAX:
            raise InputError(f"{ctas} CTAs exceed the grid's 2^31-1; split the batch")
        kb = cfg.k_blocks(C)
        if splits > 1 and (splits - 1) * base.cdiv(kb, splits) >= kb:
            raise InputError(f"{splits} splits of {kb} k-blocks leave one empty; use splits() for the count")
        if splits > 65535:
            raise InputError(f"splits={splits} exceeds grid.y's 65535")
        return base.LaunchConfig(grid=(ctas, splits, 1), block=(cfg.threads, 1, 1), shared_bytes=cfg.smem_bytes)

    def args(
        self,
        p: ConvProblem,
        *,
        tmx: Any,
        tmw: Any,
        y: int,
        entry: str,
        bias: int | None = None,
        res: int | None = None,
        ldr: int | None = None,
        relu: bool = False,
        act: Activation | None = None,
        ws: int | None = None,
        status: int | None = None,
        dil: int = 1,
    ) -> list[base.KernelArg]:
        """``tmx, tmw, bias, res, y, N, H, W, C, K, ldy, ldr, act, p0, p1, tw_log2, dil, ws, status`` of
        launch ``p`` as (value, type) pairs; ``act``: the activation (an :class:`Activation`; None:
        ReLU where ``relu``, else none); ``ws``: the split-K workspace (:meth:`workspace_bytes`,
        zeroed), None for a launch of one split.

        ``tmx``/``tmw`` are the input's and the weights' tensor maps (``runtime/tma.py``), passed by
        value in place of ``x``, ``w`` and ``ldx``; ``entry`` fixes ``tw_log2`` (the tile shape the
        maps were made for); ``res``: the residual added before the activation (None: none), its
        channel stride ``ldr`` (default K); ``status``: an int[8] device buffer for the watchdog's
        report, or None (a stuck wait then traps); ``dil``: a 3x3's dilation (its padding on every
        side; a column-copy entry takes 1 only).
        """
        base.positive(N=p.N, H=p.H, W=p.W, C=p.C, K=p.K, dil=dil)
        if dil > 1 and (self.config(entry).halo_tw or self.config(entry).pointwise):
            raise InputError(f"{entry} takes dilation 1 only; choose(..., dilation={dil}) picks a per-tap tile")
        ldy = base.stride("ldy", p.ldy, p.K)
        base.pixels(p.N, p.H, p.W, ldy)
        for name, m in (("tmx", tmx), ("tmw", tmw)):
            if not callable(getattr(m, "getPtr", None)):
                raise InputError(f"{name} must be a CUtensorMap (runtime/tma.py encode()), not {type(m).__name__}")
        if res is None:
            ldr = 0
        else:
            ldr = base.stride("ldr", ldr, p.K)
            why = self.residual_supported(p.K, res, ldr)
            if why:
                raise InputError(f"{self.stem} cannot add this residual: {why}")
            base.pixels(p.N, p.H, p.W, ldr)
        if act is None:
            act = Activation.named("relu" if relu else "none")
        elif not isinstance(act, Activation):
            raise InputError(f"act={act!r} is not an Activation; pass dualtrack.kernels.Activation.named(NAME, p0, p1)")
        ints = (p.N, p.H, p.W, p.C, p.K, ldy, ldr, act.code)
        return [
            (tmx, None),
            (tmw, None),
            (base.pointer("bias", bias, required=False), ctypes.c_void_p),
            (base.pointer("res", res, required=False), ctypes.c_void_p),
            (base.pointer("y", y), ctypes.c_void_p),
            *((int(v), ctypes.c_int32) for v in ints),
            (float(act.p0), ctypes.c_float),
            (float(act.p1), ctypes.c_float),
            (self.config(entry).tw_log2(p.W), ctypes.c_int32),
            (int(dil), ctypes.c_int32),
            (base.pointer("ws", ws, required=False), ctypes.c_void_p),
            (base.pointer("status", status, required=False), ctypes.c_void_p),
        ]

    def prepare_entry(
        self,
        choice: ConvChoice,
        x: base.DeviceTensor,
        y: base.DeviceTensor,
        weights: Sequence[base.DeviceTensor],
        act: Activation,
        ctx: base.LaunchContext,
        res: base.DeviceTensor | None = None,
        dil: int = 1,
    ) -> base.PreparedCall:
        """The launch of the entry ``choice`` names on these tensors (the conv3x3 op's spec, and
        the general conv's for its 3x3 and 1x1 stride-1 layers, hand it over where they pick this
        kernel): the input's and the weights' tensor maps, encoded by the runtime for these very
        buffers, then the geometry and arguments; ``act``: the activation, ``res``: the residual
        added before it, or None; ``dil``: a 3x3's dilation (padding ``dil`` on every side)."""
        p = ConvProblem.of(x, y)
        cfg = self.config(choice.entry)
        window = tuple(weights[0].shape[1:3])
        if len(weights[0].shape) == 4 and window != ((1, 1) if cfg.pointwise else (3, 3)):
            raise InputError(f"{choice.entry} cannot run {window[0]}x{window[1]} weights; ask choose_conv for one")
        tmx = ctx.tensor_map(input_map(cfg, x.ptr, p.N, p.H, p.W, p.C, p.ldx))
        tmw = ctx.tensor_map(weight_map(cfg, weights[0].ptr, p.K, p.C))
        bias = weights[1].ptr if len(weights) > 1 else None
        extra: dict[str, int] = {} if res is None else {"res": res.ptr, "ldr": res.channel_stride}
        if choice.splits > 1:
            extra["ws"] = ctx.workspace(self.workspace_bytes(cfg, p.N, p.H, p.W, p.K, choice.splits))
        args = self.args(p, tmx=tmx, tmw=tmw, y=y.ptr, entry=choice.entry, bias=bias, act=act, dil=dil, **extra)
        config = self.launch(p.dtype, p.N, p.H, p.W, p.C, p.K, entry=choice.entry, splits=choice.splits)
        return base.PreparedCall(choice.entry, config, args, choice)

    def choice(self, p: ConvProblem, device: DeviceInfo, *, pointwise: bool = False, dilation: int = 1) -> ConvChoice:
        """The launch of ``p`` (a 3x3 convolution of this ``dilation``; ``pointwise``: a 1x1 one) on
        this kernel and ``device`` (:meth:`choose`'s tile, :meth:`splits`' split-K) and why."""
        cfg = self.choose(p.N, p.H, p.W, p.C, p.K, device=device, pointwise=pointwise, dilation=dilation)
        splits = self.splits(cfg, p.N, p.H, p.W, p.C, p.K, device=device)
        ctas = cfg.ctas(p.N, p.H, p.W, p.K)
        split = f" x {splits} split-K" if splits > 1 else ""
        dil = f", dilation {dilation}" if dilation > 1 else ""
        return ConvChoice("wgmma", cfg.entry, f"{cfg.bm}x{cfg.bn} tile, {ctas} CTAs{split}{dil}", splits)
