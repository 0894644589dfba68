"""conv_nhwc: the general ``conv`` op — any R x S kernel, strides, dilations, padding and group count
with a fused epilogue: bias, a residual input added before the activation, and an activation
(any row of :mod:`dualtrack.contract.activations`, with its parameters), writing into a channel slice.

A call's geometry and epilogue are its attributes (:class:`ConvGeometry`, ``act`` / ``act_p0`` /
``act_p1``, ``residual``);
:meth:`ConvGeneralSpec.supports` is the one predicate that says whether the kernel computes a
convolution, and the partition asks it before it lowers a Conv to this op. fp16 runs an implicit
GEMM on mma.sync tensor cores in four tiles (:meth:`ConvGeneralSpec.variant`), fp32 a SIMT GEMM.
On Hopper its 3x3 stride-1 and 1x1 fp16 layers of group 1, with any activation and residual, run
conv3x3_wgmma instead (its ``_1x1`` entries for the 1x1 ones; :func:`~dualtrack.kernels.select.choose_conv`).

A grouped convolution (ResNeXt's 32 groups, any C/g and K/g) is the same GEMM per group, one grid
layer (``grid.z``) a group on channel slices: its launch passes the channels of one group and the
chooser sizes its tile for that group's GEMM. Narrow groups (a few channels each, ResNeXt's 4 and 8)
are merged first (:meth:`ConvGeneralSpec.merged`, the call's ``merge`` attribute): ``merge``
neighbouring groups run as one of block-diagonal weights, so the GEMM fills a tile's k-block and
columns, at the cost of multiply-adds by the zeros. Depthwise convolutions are the dwconv op's
(:mod:`dualtrack.kernels.dwconv`): with one input channel a group every load here would be a
strided 2-byte read, where dwconv reads neighbouring channels together.

Split-K (:meth:`ConvGeneralSpec.split_k`): an fp16 tile launch whose output tiles cannot fill the
GPU while its reduction (taps x channel blocks) is deep — PAN's 7x7 512 -> 1 on 8x8 pixels is one
block walking 784 k-tiles — splits its k-tiles over ``splits`` grid layers (``grid.z = groups *
splits``), each writing fp32 sums into the call's workspace; a second launch,
``conv_nhwc_f16_splitk``, adds the slices in split order (the same sum on every run) and applies
the epilogue (bias, residual, activation, one rounding into the output's channel slice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    DTYPES,
    GRID_Y_MAX,
    INT32_MAX,
    DeviceTensor,
    KernelArg,
    KernelSpec,
    LaunchConfig,
    LaunchContext,
    PreparedCall,
    Tensors,
    cdiv,
    dtype_name,
    gemm_grid,
    positive,
    typed,
)
from dualtrack.kernels.conv import block_diagonal, named_weights, pack_conv_weights
from dualtrack.kernels.conv3x3 import F16Tile
from dualtrack.kernels.conv3x3_wgmma import Conv3x3WgmmaSpec
from dualtrack.kernels.conv_stem import StemTile
from dualtrack.kernels.device import REFERENCE, DeviceInfo
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.select import ConvChoice, Pointers, choose_conv

MAX_KERNEL = 15  # R and S; larger kernels are not worth an implicit GEMM's per-tap loads


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution's window: ``R x S`` kernel, strides, dilations, and padding on each side (ONNX
    ``pads`` = top, left, bottom, right). The kernel reads the top/left padding; the bottom/right
    padding only sets the output size."""

    R: int
    S: int
    stride_h: int = 1
    stride_w: int = 1
    dil_h: int = 1
    dil_w: int = 1
    pad_top: int = 0
    pad_left: int = 0
    pad_bottom: int = 0
    pad_right: int = 0
    groups: int = 1  # ONNX ``group``: C and K split into this many independent convolutions
    # ONNX groups one of those holds (ConvGeneralSpec.merged): the packed weights are block-diagonal
    # over them, so the launch computes ``groups`` wider groups; ONNX's group is groups * merge.
    merge: int = 1

    def output_hw(self, H: int, W: int) -> tuple[int, int]:
        """(P, Q): output rows and columns on an H x W input (ONNX's floor rule)."""
        P = (H + self.pad_top + self.pad_bottom - self.dil_h * (self.R - 1) - 1) // self.stride_h + 1
        Q = (W + self.pad_left + self.pad_right - self.dil_w * (self.S - 1) - 1) // self.stride_w + 1
        return P, Q

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The geometry as :class:`KernelCall` attributes (``groups`` and ``merge`` only where they are
        not 1, so a group-1 call reads as it did before groups existed)."""
        return tuple((k, v) for k, v in asdict(self).items() if k not in ("groups", "merge") or v != 1)

    @classmethod
    def from_call(cls, call: KernelCall) -> ConvGeometry:
        names = cls.__dataclass_fields__
        got = dict(call.attrs)
        missing = [n for n in ("R", "S") if n not in got]
        if missing:
            raise InputError(f"conv call {call.nodes or call.outputs} has no {'/'.join(missing)} attribute")
        return cls(**{k: int(v) for k, v in got.items() if k in names})

    def window_problem(self, max_kernel: int, kernel: str) -> str | None:
        """Why ``kernel`` (taking windows up to ``max_kernel`` a side) cannot take this window, or None."""
        if not (1 <= self.R <= max_kernel and 1 <= self.S <= max_kernel):
            return f"kernel {self.R}x{self.S}: {kernel} takes 1..{max_kernel} a side"
        if min(self.stride_h, self.stride_w, self.dil_h, self.dil_w) < 1:
            return f"strides {self.stride_h},{self.stride_w} dilations {self.dil_h},{self.dil_w}: each must be >= 1"
        if min(self.pad_top, self.pad_left, self.pad_bottom, self.pad_right) < 0:
            return "negative padding (a crop)"
        if self.groups < 1 or self.merge < 1:
            return f"group={self.groups} merge={self.merge}: each must be >= 1"
        return None

    def group_problem(self, C: int, K: int) -> str | None:
        """Why C input and K output channels do not split into :attr:`groups` groups, or None."""
        if C % self.groups or K % self.groups:
            return f"group={self.groups} does not divide C={C} and K={K}"
        return None

    def label(self) -> str:
        pads = (self.pad_top, self.pad_left, self.pad_bottom, self.pad_right)
        grouped = f" group {self.groups}" if self.groups != 1 else ""
        if self.merge != 1:
            grouped = f" group {self.groups * self.merge} as {self.groups} merged"
        return (
            f"{self.R}x{self.S} stride {self.stride_h},{self.stride_w} dilation {self.dil_h},{self.dil_w} "
            f"pads {','.join(map(str, pads))}{grouped}"
        )


# The fp16 tiles (BM, BN, BK, warps_m, warps_n, stages, min_blocks): conv3x3_nhwc's shapes.
_MAIN = F16Tile(128, 64, 32, 2, 2, 4, 4)
_NARROW = F16Tile(128, 32, 32, 4, 1, 4, 4)
_WIDE = F16Tile(128, 128, 32, 4, 2, 3, 2)
_SMALL = F16Tile(64, 64, 32, 2, 2, 4, 4)
# The gather entry (C % 8 != 0): the fewest stages a tile may have (it uses one; its prefetch is in
# registers), so a small footprint and several blocks an SM to hide the element-wise gathers.
_GATHER = F16Tile(64, 64, 32, 2, 2, 2, 4)
# The stem entries (rows, channels, min blocks): 4 output rows x 32 columns a block.
_STEM = StemTile(4, 64, 4)
_STEM_NARROW = StemTile(4, 32, 4)  # K <= 32, or filters too long for _STEM's shared memory


@dataclass(frozen=True, kw_only=True)
class ConvGeneralSpec(KernelSpec):
    """The ``conv`` op: ``conv_nhwc_f16`` (128x64 tile) and its variants ``_narrow`` (K <= 32),
    ``_wide`` (K >= 128 with enough pixels) and ``_small`` (too few default tiles to fill the
    GPU), each an :class:`F16Tile`; ``conv_nhwc_f32``, a SIMT GEMM (``f32 = (BM, BN, BK, TM, TN)``).
    Weights KRSC (:func:`pack_conv_weights`), bias fp32 or null, residual and output NHWC with
    their own channel strides."""

    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "w", "bias", "res", "y", "ws", "N", "H", "W", "C", "K", "P", "Q", "R", "S", "stride_h", "stride_w",
        "pad_top", "pad_left", "dil_h", "dil_w", "ldx", "ldy", "ldr", "act", "p0", "p1", "splits",
    )  # fmt: skip
    POINTERS: ClassVar[int] = 6
    # conv_nhwc_f16_splitk, split-K's second launch: the slices' sums -> the epilogue.
    SPLITK_PARAMS: ClassVar[tuple[str, ...]] = (
        "ws", "bias", "res", "y", "M", "K", "splits", "ldy", "ldr", "act", "p0", "p1",
    )  # fmt: skip
    FLOATS: ClassVar[frozenset[str]] = frozenset({"p0", "p1"})  # the activation's parameters
    F16_VARIANTS: ClassVar[tuple[str, ...]] = ("narrow", "wide", "small", "gather")

    f16_main: F16Tile = _MAIN
    f16_narrow: F16Tile = _NARROW
    f16_wide: F16Tile = _WIDE
    f16_small: F16Tile = _SMALL
    f16_gather: F16Tile = _GATHER
    # The direct entry (``_f16_direct``, CUDA cores, a thread per output pixel): convs with at most
    # direct_k output channels (a head's classes) whose K*R*S*C fp32 filters fit its shared memory.
    direct_k: int = 8
    direct_weights: int = 8192
    direct_threads: int = 256
    f32: tuple[int, int, int, int, int] = (64, 64, 16, 4, 4)
    # Not the direct entry for a reduction of at least direct_deep taps over fewer than direct_pixels
    # output pixels (a thread per pixel: about a wave of 256-thread blocks on a 132-SM GPU): direct_serial.
    direct_deep: int = 1024
    direct_pixels: int = 32768
    # The direct entry's grid-stride loop: at most this many blocks per SM, enough to hide latency.
    direct_blocks_per_sm: int = 16
    # Narrow groups merged (:meth:`merged`). ResNeXt-50's 3x3s of 4 and 8 channels a group ran the
    # direct entry, a thread a pixel reading 8- and 16-byte pieces a tap: 8 launches took 3.97 of
    # 7.59 ms at batch 8 on the H100 (kernel_profile-9e8659f-nodeep-s10resnext-h100.log). Merged,
    # neighbouring groups are one group of block-diagonal weights up to merge_width channels each
    # way: a full k-tile and N tile of the narrow tile for merge-fold multiply-adds (the zeros),
    # which its tensor cores have to spare. At most merge_max groups (the zeros' cost), and only where
    # a merged group reaches merge_min_width input channels (half a k-tile).
    merge_width: int = 32
    merge_min_width: int = 16
    merge_max: int = 8
    # Nothing below small: a 64x32 tile with twice its blocks measured slower (docs/performance.md).
    # The Hopper kernel that its 3x3 stride-1 layers run where the device has it (None: none). On
    # the H200 it took ResNet-34's residual convs at 16x16..128x128 in about 60% of the small
    # tile's time (the conv3x3 op's same shapes, kernel_profile-acc495c).
    hopper: Conv3x3WgmmaSpec | None = None
    # The stem entries (``_stem``, ``_stem_narrow``: C <= 8, group 1; kernels/conv_stem.py): the
    # input patch staged once in shared memory instead of the gather entry's per-tap loads.
    stem_main: StemTile = _STEM
    stem_narrow: StemTile = _STEM_NARROW
    # Split-K (:meth:`split_k`): a tile launch of less than a full wave of blocks (at the tile's
    # min-blocks an SM) splits its k-tiles into at most max_splits slices of at least min_split_kt
    # k-tiles (twice a 4-stage pipeline's depth: shorter slices spend more on the prologue and the
    # slice's partial tile than they save); the summing launch runs splitk_threads a block, at most
    # splitk_blocks_per_sm blocks an SM (a grid-stride loop).
    max_splits: int = 64
    min_split_kt: int = 8
    splitk_threads: int = 256
    splitk_blocks_per_sm: int = 8

    def defines(self) -> dict[str, int | str]:
        bm, bn, bk, tm, tn = self.f32
        tiles = {v: ",".join(map(str, t.as_tuple())) for v, t in self.f16_tiles_by_variant().items()}
        return {
            **{f"CONVG_F16_{v.upper()}": t for v, t in tiles.items()},
            "CONVG_DIRECT_THREADS": self.direct_threads, "CONVG_DIRECT_K": self.direct_k,
            "CONVG_DIRECT_W": self.direct_weights,
            "CONVG_STEM": self.stem_main.macro(), "CONVG_STEM_NARROW": self.stem_narrow.macro(),
            "CONVG_SPLITK_THREADS": self.splitk_threads,
            "CONVG_F32_BM": bm, "CONVG_F32_BN": bn, "CONVG_F32_BK": bk, "CONVG_F32_TM": tm, "CONVG_F32_TN": tn,
        }  # fmt: skip

    def f16_tiles_by_variant(self) -> dict[str, F16Tile]:
        return {"main": self.f16_main, **{v: getattr(self, f"f16_{v}") for v in self.F16_VARIANTS}}

    def f16_tiles(self) -> dict[str, F16Tile]:
        """The tile of every fp16 entry, by entry name."""
        return {
            (self.entry("float16") if v == "main" else f"{self.stem}_f16_{v}"): t
            for v, t in self.f16_tiles_by_variant().items()
        }

    @property
    def entries(self) -> tuple[str, ...]:
        return (
            *(self.entry(d) for d in DTYPES),
            *(f"{self.stem}_f16_{v}" for v in self.F16_VARIANTS),
            self.direct_entry,
            *self.stem_tiles(),
            self.splitk_entry,
        )

    def stem_tiles(self) -> dict[str, StemTile]:
        """The stem entries' tiles, by entry name."""
        return {f"{self.stem}_f16_stem": self.stem_main, f"{self.stem}_f16_stem_narrow": self.stem_narrow}

    def stem_entry(self, C: int, K: int, geom: ConvGeometry) -> str | None:
        """The stem entry for a conv of C -> K channels (``_stem_narrow`` for K <= its 32 channels or
        where only its shared memory fits), or None where neither takes it (:meth:`StemTile.refusal`)."""
        main, narrow = self.stem_tiles()
        fits = {e: t.refusal(C, geom) is None for e, t in self.stem_tiles().items()}
        if fits[narrow] and (self.stem_narrow.bn >= K or not fits[main]):
            return narrow
        return main if fits[main] else None

    @property
    def direct_entry(self) -> str:
        return f"{self.stem}_f16_direct"

    @property
    def splitk_entry(self) -> str:
        """Split-K's second launch (the slices' sum and the epilogue)."""
        return f"{self.stem}_f16_splitk"

    def direct_supported(self, C: int, K: int, geom: ConvGeometry) -> str | None:
        """None when the direct entry takes a conv of C -> K channels (all groups; it runs one
        group's C/g -> K/g a grid layer), else why not."""
        C, K = C // geom.groups, K // geom.groups
        if self.direct_k < K:
            return f"K={K} > {self.direct_k} output channels"
        if self.direct_weights < K * geom.R * geom.S * C:
            return f"K*R*S*C = {K * geom.R * geom.S * C} fp32 filter values exceed its {self.direct_weights}"
        return None

    def group_merge(self, dtype: Any, C: int, K: int, geom: ConvGeometry) -> int:
        """How many neighbouring ONNX groups of a C -> K conv one launched group holds (1: none): the
        largest m <= :attr:`merge_max` dividing the groups with m*C/g and m*K/g <= :attr:`merge_width`
        and m*C/g >= :attr:`merge_min_width`, one with m*C/g a multiple of 8 (the vector path's 16-byte
        copies) first. fp16 only: the fp32 entry's SIMT GEMM has no multiply-adds to spare."""
        G = geom.groups
        if dtype_name(dtype) != "float16" or G == 1 or geom.merge != 1 or geom.group_problem(C, K):
            return 1
        cg, kg = C // G, K // G
        fits = [
            m
            for m in range(2, self.merge_max + 1)
            if G % m == 0 and max(m * cg, m * kg) <= self.merge_width and m * cg >= self.merge_min_width
        ]
        return max(fits, key=lambda m: (m * cg % 8 == 0, m)) if fits else 1

    def merged(self, dtype: Any, C: int, K: int, geom: ConvGeometry) -> ConvGeometry:
        """``geom`` with :meth:`group_merge`'s groups merged (``groups`` the launched ones, ``merge``
        ONNX's a launched one holds); ``geom`` itself where none merge. The partition lowers a Conv
        with this geometry, so the launch, the chooser, the reference and the plan all see the merged
        groups, and :meth:`pack_weights` makes their block-diagonal weights."""
        m = self.group_merge(dtype, C, K, geom)
        return geom if m == 1 else replace(geom, groups=geom.groups // m, merge=m)

    # --- the Hopper kernel ------------------------------------------------------------------------

    def hopper_window(self, geom: ConvGeometry | None, act: Activation | None) -> str | None:
        """None when :attr:`hopper` computes this window (3x3, stride 1, dilation d on both axes and
        padding d on every side: the map keeps its size, as in DeepLab's and PAN's dilated layers;
        or 1x1, stride 1, no padding: its ``_1x1`` entries; group 1), else why not. Its epilogue
        fuses every activation of the table."""
        g = geom
        if g is None or act is None:
            return "a general conv's launch needs its window and activation"
        if g.groups != 1:
            return f"group={g.groups}: the wgmma kernel takes group 1"
        three = (g.R, g.S) == (3, 3)
        pad = g.dil_h if three else 0
        if (g.R, g.S) not in ((3, 3), (1, 1)) or (g.stride_h, g.stride_w) != (1, 1):
            return f"{g.label()}: the wgmma kernel takes 3x3 and 1x1 windows of stride 1"
        if g.dil_h != g.dil_w or (not three and g.dil_h != 1):
            return f"{g.label()}: the wgmma kernel takes one dilation on both axes (a 1x1: dilation 1)"
        if (g.pad_top, g.pad_left, g.pad_bottom, g.pad_right) != (pad,) * 4:
            return f"{g.label()}: the wgmma kernel takes padding {pad} on every side of a {g.R}x{g.S} window"
        return None

    def direct_serial(self, pixels: int, C: int, geom: ConvGeometry) -> str | None:
        """Why the direct entry would be slower than a split tile on ``pixels`` output pixels: its
        thread per pixel sums the whole R*S*C/g reduction alone, so a deep one over too few pixels
        to fill the GPU is serial (PAN's 3x3 512 -> 1 on 8x8: 0.20 ms on the H100 at N=1 and N=8,
        against 0.047 for the narrow tile split four ways; conv_layers_split-80dcaa6-h100.json).
        None where the direct entry is the faster."""
        taps = geom.R * geom.S * (C // geom.groups)
        if taps >= self.direct_deep and pixels < self.direct_pixels:
            return f"R*S*C/g = {taps} taps on {pixels} pixels: a split tile"
        return None

    def direct_for(self, p: ConvProblem, geom: ConvGeometry | None) -> tuple[str, str] | None:
        """The direct entry and why, where it takes fp16 launch ``p`` (:meth:`direct_supported`,
        :meth:`direct_serial`); else None."""
        if geom is None or dtype_name(p.dtype) != "float16" or self.direct_supported(p.C, p.K, geom) is not None:
            return None
        P, Q = geom.output_hw(p.H, p.W)
        if self.direct_serial(p.N * P * Q, p.C, geom) is not None:
            return None
        per = f"K/g={p.K // geom.groups}" if geom.groups != 1 else f"K={p.K}"
        return self.direct_entry, f"{per} <= {self.direct_k}: direct conv"

    # --- what the kernel computes -----------------------------------------------------------------

    def supports(self, dtype: Any, H: int, W: int, C: int, K: int, geom: ConvGeometry) -> str | None:
        """None when the kernel computes this convolution (on an H x W x C input, K filters in
        ``geom.groups`` groups), else why not. The partition lowers a Conv to this op only where this
        says None; launches check it again."""
        try:
            dtype_name(dtype)
        except InputError as exc:
            return str(exc)
        g = geom
        why = g.window_problem(MAX_KERNEL, "the general conv") or g.group_problem(C, K)
        if why:
            return why
        if min(H, W, C, K) < 1:
            return f"input {H}x{W}x{C} -> {K} channels: every size must be >= 1"
        P, Q = g.output_hw(H, W)
        if P < 1 or Q < 1:
            return f"{g.label()} on {H}x{W} has an empty output ({P}x{Q})"
        if g.R * g.S * C > INT32_MAX // 2:
            return f"R*S*C = {g.R * g.S * C} taps exceed the kernel's 32-bit indices"
        if g.groups > GRID_Y_MAX:
            return f"group={g.groups}: the grid holds at most {GRID_Y_MAX} groups"
        return None

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, *, geom: ConvGeometry | None = None
    ) -> tuple[int, int, int, int]:
        if geom is None:
            raise InputError("the general conv's output shape needs its geometry (geom=ConvGeometry(...))")
        positive(N=N, H=H, W=W, C=C, K=K)
        why = self.supports("float32", H, W, C, K, geom)
        if why:
            raise InputError(f"the general conv cannot run this convolution: {why}")
        return (N, *geom.output_hw(H, W), K)

    def _checked_pixels(self, N: int, H: int, W: int, geom: ConvGeometry) -> int:
        """N*P*Q output pixels; the kernel indexes input pixels (padding included) and output
        pixels with 32-bit ints."""
        P, Q = geom.output_hw(H, W)
        extent = N * (H + geom.pad_top + geom.pad_bottom + 1) * (W + geom.pad_left + geom.pad_right + 1)
        if max(N * P * Q, extent) > INT32_MAX:
            raise InputError(f"a {N}x{H}x{W} input with its padding exceeds 2^31-1 pixels; split the batch")
        return N * P * Q

    def variant(
        self,
        dtype: Any,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        geom: ConvGeometry,
        *,
        device: DeviceInfo = REFERENCE,
    ) -> str:
        """The entry to launch on ``device`` (fp32: the one entry; fp16: ``_direct`` for a few output
        channels (:meth:`direct_supported`), ``_stem`` / ``_stem_narrow`` for C <= 8 of group 1 where its
        shared memory fits (:meth:`stem_entry`), ``_gather`` for the other C % 8 != 0 (the vector path's 16-byte
        copies cannot take the input), ``_narrow`` for K <= 32, ``_wide`` where its tiles make a full
        wave at their occupancy (:meth:`DeviceInfo.full_wave` of its min-blocks), the default entry
        where its tiles do, else ``_small``: a 64x32 tile with twice its blocks measured slower,
        docs/performance.md)."""
        name = dtype_name(dtype)
        if name != "float16":
            return self.entry(name)
        M = self._checked_pixels(N, H, W, geom)
        if self.direct_supported(C, K, geom) is None and self.direct_serial(M, C, geom) is None:
            return self.direct_entry
        stem = self.stem_entry(C, K, geom)
        if stem is not None:
            return stem
        G = geom.groups
        C, K = C // G, K // G  # one group's GEMM; G of them side by side in the grid
        if C % 8:
            return f"{self.stem}_f16_gather"
        if self.f16_narrow.bn >= K:
            return f"{self.stem}_f16_narrow"
        wide = self.f16_wide
        if wide.bn <= K and G * cdiv(M, wide.bm) * cdiv(K, wide.bn) >= device.full_wave(wide.min_blocks):
            return f"{self.stem}_f16_wide"
        main = self.f16_main
        if G * cdiv(M, main.bm) * cdiv(K, main.bn) >= device.full_wave(main.min_blocks):
            return self.entry(name)
        return f"{self.stem}_f16_small"

    # --- split-K ----------------------------------------------------------------------------------

    def k_tiles(self, C: int, geom: ConvGeometry, entry: str) -> int:
        """k-tiles of one group's reduction (C: that group's channels) as tile entry ``entry`` walks
        them: R*S taps x ceil(C / BK) channel blocks on the vector path (C % 8 == 0, as planned
        buffers are aligned), ceil(R*S*C / BK) flattened taps on the scalar one (``_gather``)."""
        bk = self._tile(entry).bk
        if C % 8 == 0 and entry != f"{self.stem}_f16_gather":
            return geom.R * geom.S * cdiv(C, bk)
        return cdiv(geom.R * geom.S * C, bk)

    def split_k(
        self,
        dtype: Any,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        geom: ConvGeometry,
        entry: str,
        *,
        device: DeviceInfo = REFERENCE,
    ) -> int:
        """Split-K slices of an fp16 tile launch (``entry`` one of :meth:`f16_tiles`; any other: 1):
        1 where its blocks (all groups') give every SM of ``device`` one (:meth:`DeviceInfo.full_wave`),
        else enough slices for a full wave at the tile's min-blocks an SM, at most :attr:`max_splits`,
        each at least :attr:`min_split_kt` k-tiles (:meth:`k_tiles`) and none empty."""
        if dtype_name(dtype) != "float16" or entry not in self.f16_tiles():
            return 1
        tile = self._tile(entry)
        G = geom.groups
        blocks = G * cdiv(self._checked_pixels(N, H, W, geom), tile.bm) * cdiv(K // G, tile.bn)
        if blocks >= device.full_wave():
            return 1
        kt = self.k_tiles(C // G, geom, entry)
        want = min(
            self.max_splits, cdiv(device.full_wave(tile.min_blocks), blocks), kt // self.min_split_kt, GRID_Y_MAX // G
        )
        if want <= 1:
            return 1
        per = cdiv(kt, want)
        return cdiv(kt, per)  # slices of `per` k-tiles, the last one not empty

    def splitk_workspace_bytes(self, N: int, H: int, W: int, K: int, geom: ConvGeometry, splits: int) -> int:
        """Bytes of a split launch's workspace: an fp32 (pixels x K) plane a slice (0 for one slice).
        Every element is written before it is read: no zeroing, no counters."""
        return 0 if splits <= 1 else splits * self._checked_pixels(N, H, W, geom) * K * 4

    def splitk_launch(self, M: int, K: int, *, device: DeviceInfo = REFERENCE) -> LaunchConfig:
        """The summing launch over M pixels x K channels: a thread an element, at most
        :attr:`splitk_blocks_per_sm` blocks an SM (the kernel strides over the rest)."""
        positive(M=M, K=K)
        blocks = min(cdiv(M * K, self.splitk_threads), device.sm_count * self.splitk_blocks_per_sm)
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.splitk_threads, 1, 1), shared_bytes=0)

    def splitk_args(self, **kw: Any) -> list[KernelArg]:
        """:data:`SPLITK_PARAMS` from values by name: ``ws`` (the workspace), ``bias`` and ``res``
        (None: null), ``y``, ``M`` pixels, ``K`` channels (every group's), ``splits``, ``ldy``,
        ``ldr`` and ``act`` (an :class:`Activation`)."""
        act = kw.pop("act", None) or Activation()
        if kw["splits"] < 2 or not kw["ws"] or not kw["y"]:
            raise InputError(f"split-K's sum needs a workspace, an output and >= 2 slices; got splits={kw['splits']}")
        return typed(self.SPLITK_PARAMS, 4, {"res": None, "bias": None, "ldr": 0, **kw, **act.kernel_args()})

    def threads(self, dtype: Any, entry: str | None = None) -> int:
        if dtype_name(dtype) == "float16":
            if entry == self.splitk_entry:
                return self.splitk_threads
            if entry in self.stem_tiles():
                return self.stem_tiles()[entry].threads
            return self.direct_threads if entry == self.direct_entry else self._tile(entry).threads
        bm, bn, _, tm, tn = self.f32
        return (bm // tm) * (bn // tn)

    def _tile(self, entry: str | None) -> F16Tile:
        tiles = self.f16_tiles()
        key = entry if entry is not None else self.entry("float16")
        if key not in tiles:
            raise InputError(f"'{entry}' is not an fp16 entry of {self.stem}; use one of {', '.join(tiles)}")
        return tiles[key]

    def launch(
        self,
        dtype: Any,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int = 0,
        *,
        geom: ConvGeometry,
        entry: str | None = None,
        device: DeviceInfo = REFERENCE,
        splits: int = 1,
    ) -> LaunchConfig:
        """One block per (output-pixel tile, channel tile), pixel tiles along grid.x, a grid layer a
        group (times ``splits`` split-K slices of a tile entry: :meth:`split_k`); ``entry``: the fp16
        variant launched (None: :meth:`variant`'s on ``device``); the direct entry loops over the
        pixels in at most :attr:`direct_blocks_per_sm` blocks per SM of ``device``; the summing
        entry is :meth:`splitk_launch`'s."""
        self.output_shape(N, H, W, C, K, geom=geom)
        M = self._checked_pixels(N, H, W, geom)
        name = dtype_name(dtype)
        if entry == self.splitk_entry:
            return self.splitk_launch(M, K, device=device)
        positive(splits=splits)
        if splits > 1 and (name != "float16" or entry not in self.f16_tiles()):
            raise InputError(f"split-K runs on the fp16 tile entries ({', '.join(self.f16_tiles())}); not {entry}")
        if geom.groups * splits > GRID_Y_MAX:
            raise InputError(f"{geom.groups} groups x {splits} slices exceed grid.z's {GRID_Y_MAX}; use fewer slices")
        if name == "float16":
            entry = entry if entry is not None else self.variant(dtype, N, H, W, C, K, geom, device=device)
            if entry == self.direct_entry:
                why = self.direct_supported(C, K, geom)
                if why:
                    raise InputError(f"{entry} cannot run this convolution: {why}")
                # The grid-stride loop's blocks per SM are shared by the groups' grid layers.
                per_group = max(1, device.sm_count * self.direct_blocks_per_sm // geom.groups)
                blocks = min(cdiv(M, self.direct_threads), per_group)
                grid = (blocks, 1, geom.groups)
                return LaunchConfig(grid=grid, block=(self.direct_threads, 1, 1), shared_bytes=0)
            if entry in self.stem_tiles():
                stem = self.stem_tiles()[entry]
                why = stem.refusal(C, geom)
                if why:
                    raise InputError(f"{entry} cannot run this convolution: {why}")
                return stem.launch(N, *geom.output_hw(H, W), K, C, geom, device)
            tile = self._tile(entry)
            bm, bn = tile.bm, tile.bn
            threads = tile.threads
        else:
            if entry not in (None, self.entry(name)):
                raise InputError(f"'{entry}' is not the {name} entry of {self.stem}")
            bm, bn = self.f32[:2]
            threads = self.threads(name)
        grid = gemm_grid(M, K // geom.groups, bm, bn, geom.groups * splits)
        return LaunchConfig(grid=grid, block=(threads, 1, 1), shared_bytes=0)

    # args(): the bias, the residual (``res``, stride ``ldr``) and the split-K workspace may be null.
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias", "res", "ws"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "K"), ("ldr", "K"))
    _GEOMETRY: ClassVar[tuple[str, ...]] = ("R", "S", "stride_h", "stride_w", "pad_top", "pad_left", "dil_h", "dil_w")

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The output size ``P, Q`` and the rest of the ``geom`` (a :class:`ConvGeometry`)
        checked, one group's channels ``C, K`` (the kernel's grid.z walks the groups), the
        activation ``act`` (an :class:`Activation`; none by default) as ``act, p0, p1``, and
        ``splits`` (1 by default; more: a split-K launch, whose ``ws`` is its workspace)."""
        g: ConvGeometry = kw["geom"]
        _, P, Q, _ = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], geom=g)
        self._checked_pixels(kw["N"], kw["H"], kw["W"], g)
        act = kw.get("act") or Activation()
        if not isinstance(act, Activation):
            raise InputError(f"act={act!r} is not an Activation; pass dualtrack.kernels.Activation.named(NAME, p0, p1)")
        per_group = {"C": kw["C"] // g.groups, "K": kw["K"] // g.groups}
        geometry = {name: getattr(g, name) for name in self._GEOMETRY}
        splits = int(kw.get("splits", 1))
        if splits < 1 or (splits > 1) != bool(kw.get("ws")):
            raise InputError(
                f"splits={splits} with ws={kw.get('ws')!r}: a split-K launch (splits > 1) needs a workspace"
            )
        return {"P": P, "Q": Q, **per_group, **geometry, **act.kernel_args(), "splits": splits}

    # --- a plan's call ----------------------------------------------------------------------------

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """KRSC weights and the fp32 bias; a call of merged groups (``merge`` > 1) gets its
        block-diagonal weights (:func:`~dualtrack.kernels.conv.block_diagonal`) from ONNX's."""
        bias = weights[call.weights[1]] if len(call.weights) > 1 else None
        w = weights[call.weights[0]]
        g = ConvGeometry.from_call(call)
        if g.merge != 1:
            w = block_diagonal(w, g.groups * g.merge, g.merge)
        return named_weights(call, pack_conv_weights(w, bias, any_size=True))

    def reference(
        self,
        x: np.ndarray,
        w: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        res: np.ndarray | None = None,
        *,
        geom: ConvGeometry | None = None,
        act: Activation | None = None,
    ) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C), ``w`` (K,R,S,C/groups), ``bias`` (K,) or None, ``res``
        (N,P,Q,K) or None; filter k reads group k // (K/groups)'s input channels. In float32: the
        products and sums, then bias and residual, then the activation, rounded once to x's dtype."""
        if w is None or geom is None:
            raise InputError("the general conv's reference needs weights w (K, R, S, C/groups) and its geometry")
        g = geom
        cg = x.shape[3] // g.groups if x.ndim == 4 else 0
        if x.ndim != 4 or w.ndim != 4 or w.shape[1:] != (g.R, g.S, cg) or x.shape[3] % g.groups:
            raise InputError(f"conv takes x (N,H,W,C) and w (K,{g.R},{g.S},C/{g.groups}); got x {x.shape}, w {w.shape}")
        N, H, W, C = x.shape
        K = w.shape[0]
        _, P, Q, _ = self.output_shape(N, H, W, C, K, geom=geom)
        kg = K // g.groups
        xp = np.pad(x.astype(np.float32), ((0, 0), (g.pad_top, g.pad_bottom), (g.pad_left, g.pad_right), (0, 0)))
        wf = w.astype(np.float32)
        out = np.zeros((N, P, Q, K), np.float32)
        for r in range(g.R):
            for s in range(g.S):
                h0, w0 = r * g.dil_h, s * g.dil_w
                rows = slice(h0, h0 + g.stride_h * (P - 1) + 1, g.stride_h)
                cols = slice(w0, w0 + g.stride_w * (Q - 1) + 1, g.stride_w)
                tap = xp[:, rows, cols]
                for j in range(g.groups):
                    ks, cs = slice(j * kg, (j + 1) * kg), slice(j * cg, (j + 1) * cg)
                    # One 2-D GEMM of a contiguous copy: numpy's matmul of a strided view runs without BLAS.
                    rows_c = np.ascontiguousarray(tap[..., cs]).reshape(-1, cg)  # (N*P*Q, C/groups)
                    out[..., ks] += (rows_c @ wf[ks, r, s, :].T).reshape(N, P, Q, kg)
        if bias is not None:
            if bias.shape != (K,):
                raise InputError(f"bias has shape {bias.shape}; expected ({K},)")
            out += bias.astype(np.float32)
        if res is not None:
            if res.shape != out.shape:
                raise InputError(f"residual has shape {res.shape}; expected the output's {out.shape}")
            out += res.astype(np.float32)
        return (act or Activation()).apply(out).astype(x.dtype)

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        packed = self.pack_weights(call, weights)
        w = packed[call.weights[0]]
        bias = packed.get(call.weights[1]) if len(call.weights) > 1 else None
        res = inputs[1] if call.attr("residual") else None
        return self.reference(inputs[0], w, bias, res, geom=ConvGeometry.from_call(call), act=Activation.of(call))

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"geom": ConvGeometry.from_call(call), "act": Activation.of(call)}

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The keyword arguments of :meth:`args` for one call on these tensors: the NHWC ones, the
        geometry, the activation, and the residual (``inputs[1]``) where the call has one
        (``residual`` attribute)."""
        kw = super().call_args(call, inputs, y, weights)
        if call.attr("residual"):
            if len(inputs) < 2:
                raise InputError(f"conv call {call.nodes} has a residual input: prepare it with prepare_inputs")
            kw.update(res=inputs[1].ptr, ldr=inputs[1].channel_stride)
        return kw

    def prepare_inputs(
        self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        """The entry :func:`~dualtrack.kernels.select.choose_conv` picks on ``ctx.device`` (the wgmma
        kernel where it takes the launch), its geometry and arguments; ``inputs``: x, then the
        residual where the call has one (``residual`` attribute)."""
        kw = self.call_args(call, inputs, y, weights)
        res = inputs[1] if call.attr("residual") else None
        shape = (kw["N"], kw["H"], kw["W"], kw["C"], kw["K"])
        expect = self.output_shape(*shape, geom=kw["geom"])
        for what, t in (("output", y), ("residual", res)):
            if t is not None and tuple(t.shape) != expect:
                raise InputError(f"conv call {call.nodes}: {what} has shape {tuple(t.shape)}; expected {expect}")
        x = inputs[0]
        at = Pointers(x.ptr, kw["w"], y.ptr, None if res is None else res.ptr, 0 if res is None else res.channel_stride)
        p = ConvProblem.of(x, y)
        choice = choose_conv(self, p, ctx.device, window=kw["geom"], act=kw["act"], wgmma_off=ctx.wgmma_off, at=at)
        if choice.impl == "wgmma":
            assert self.hopper is not None  # the chooser picks wgmma only where there is one
            return self.hopper.prepare_entry(choice, x, y, weights, kw["act"], ctx, res=res, dil=kw["geom"].dil_h)
        return self.prepare_entry(choice, kw, ctx)

    def prepare_entry(self, choice: ConvChoice, kw: Mapping[str, Any], ctx: LaunchContext) -> PreparedCall:
        """The launch of an fp16/fp32 entry of this kernel (``choice``: the chooser's, or one a test or
        bench forces: any entry, any split count its launch takes) on :meth:`call_args`' values
        ``kw``. With ``choice.splits`` > 1: the slices into the call's workspace (``before``), then
        :attr:`splitk_entry`'s sum and epilogue into y."""
        g: ConvGeometry = kw["geom"]
        N, H, W, K = kw["N"], kw["H"], kw["W"], kw["K"]
        dtype = "float32" if choice.impl == "simt" else "float16"
        launch = self.launch(
            dtype, N, H, W, kw["C"], K, geom=g, entry=choice.entry, device=ctx.device, splits=choice.splits
        )
        if choice.splits == 1:
            return PreparedCall(choice.entry, launch, self.args(**kw))
        ws = ctx.workspace(self.splitk_workspace_bytes(N, H, W, K, g, choice.splits))
        slices = PreparedCall(choice.entry, launch, self.args(**kw, ws=ws, splits=choice.splits))
        M = self._checked_pixels(N, H, W, g)
        ld = {"ldy": kw.get("ldy") or K, "ldr": kw.get("ldr") or K}
        finish = self.splitk_args(
            ws=ws, bias=kw.get("bias"), res=kw.get("res"), y=kw["y"], M=M, K=K, splits=choice.splits, act=kw.get("act"),
            **ld,
        )  # fmt: skip
        return PreparedCall(
            self.splitk_entry, self.splitk_launch(M, K, device=ctx.device), finish, choice, before=(slices,)
        )
