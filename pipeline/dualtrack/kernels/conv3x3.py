"""conv3x3_nhwc: the conv3x3 op on every arch (mma.sync tensor cores in fp16, SIMT in fp32).

Its fp16 entries are one implicit GEMM in several tiles (the default, ``_narrow``, ``_wide``,
``_small`` and the tuned ones, :class:`F16Tile`) and a direct convolution for few input channels
(``_smallc``). On Hopper the op prefers conv3x3_wgmma (:attr:`Conv3x3Spec.hopper`); which kernel
and entry a launch runs is the one convolution chooser's (select.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import base
from dualtrack.kernels.conv import Conv3x3Reference, ConvAbi, GemmTiles
from dualtrack.kernels.conv3x3_wgmma import Conv3x3WgmmaSpec
from dualtrack.kernels.device import REFERENCE, DeviceInfo
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.select import SMALL_C_K_MAX, SMALL_C_MAX, Pointers, choose_conv


@dataclass(frozen=True, order=True)
class F16Tile:
    """One fp16 conv3x3 tile: the template arguments of ``f16conv::Cfg`` in conv3x3_nhwc.cu.

    ``bm x bn`` output tile (pixels x channels) per block, ``bk``-deep k-tiles, ``warps_m x warps_n``
    warps, ``stages`` cp.async stages, registers capped so that ``min_blocks`` blocks fit on an SM.
    """

    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int
    min_blocks: int

    NAME: ClassVar[re.Pattern[str]] = re.compile(r"t(\d+)x(\d+)x(\d+)_w(\d+)x(\d+)_s(\d+)_b(\d+)")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def name(self) -> str:
        """The tile as an entry-name suffix, e.g. ``t128x64x32_w2x2_s4_b4``."""
        return f"t{self.bm}x{self.bn}x{self.bk}_w{self.warps_m}x{self.warps_n}_s{self.stages}_b{self.min_blocks}"

    def as_tuple(self) -> tuple[int, ...]:
        return (self.bm, self.bn, self.bk, self.warps_m, self.warps_n, self.stages, self.min_blocks)

    @classmethod
    def parse(cls, suffix: str) -> F16Tile | None:
        """The tile a :attr:`name` suffix encodes, or None if ``suffix`` is not one."""
        m = cls.NAME.fullmatch(suffix)
        return cls(*(int(g) for g in m.groups())) if m else None


@dataclass(frozen=True, kw_only=True)
class Conv3x3Spec(Conv3x3Reference, ConvAbi, GemmTiles):
    """3x3 convolution, stride 1, padding 1, bias and optional ReLU fused.

    fp16: tensor-core implicit GEMM, a ``f16_bm x f16_bn`` output tile (pixels x channels) per
    block of ``32 * f16_warps_m * f16_warps_n`` threads, ``f16_bk``-deep cp.async stages.
    Besides that default entry (``conv3x3_nhwc_f16``), shape-selected fp16 variants with the same
    ABI: ``_narrow`` (K <= 32), ``_wide`` (K >= 128 with enough pixels), ``_small`` (too few
    default tiles to fill the GPU); :meth:`variant` picks one, ``launch(..., entry=...)`` gives its
    geometry. Each variant's tile is ``(bm, bn, bk, warps_m, warps_n, stages, min_blocks)``.
    ``_smallc`` is no GEMM: a direct convolution on CUDA cores for C <= :data:`SMALL_C_MAX` and
    K <= :data:`SMALL_C_K_MAX` (:meth:`smallc_supported`), one ``rows x cols`` output tile of one
    image per block of ``threads`` (``f16_smallc = (rows, cols, threads, min_blocks)``), 8 pixels x
    8 channels a thread at a time; :meth:`variant` picks it first wherever it applies.
    Tuned entries (``dualtrack tune``) are compiled in on demand (:meth:`extra_entries_define`);
    their names encode their tile (:meth:`tuned_entry`), so :meth:`launch` reads it back from them.
    fp32: SIMT GEMM, an ``f32_bm x f32_bn`` tile per block, ``f32_tm x f32_tn`` outputs a thread.
    """

    F16_VARIANTS: ClassVar[tuple[str, ...]] = ("narrow", "wide", "small")
    MACRO_PREFIX: ClassVar[str] = "CONV"

    f16_stages: int = 4
    f16_min_blocks: int = 4
    f16_narrow: tuple[int, ...] = (128, 32, 32, 4, 1, 4, 4)
    f16_wide: tuple[int, ...] = (128, 128, 32, 4, 2, 3, 2)
    f16_small: tuple[int, ...] = (64, 64, 64, 2, 2, 3, 4)
    # rows, columns of the output tile, threads (at most), min blocks per SM
    f16_smallc: tuple[int, ...] = (16, 64, 256, 2)
    # The Hopper kernel of the same op that the chooser prefers where it runs (None: none).
    hopper: Conv3x3WgmmaSpec | None = None

    def defines(self) -> dict[str, int | str]:
        return {
            **self.tile_defines(),
            "CONV_F16_MIN_BLOCKS": self.f16_min_blocks,
            **{f"CONV_F16_{v.upper()}": ",".join(map(str, getattr(self, f"f16_{v}"))) for v in self.F16_VARIANTS},
            "CONV_F16_SMALLC": ",".join(map(str, self.f16_smallc)),
            "CONV_F16_SMALLC_CMAX": SMALL_C_MAX,
            "CONV_F16_SMALLC_KMAX": SMALL_C_K_MAX,
        }

    @property
    def entries(self) -> tuple[str, ...]:
        """Every entry in the PTX: the default fp16 and fp32 ones, the fp16 variants, the small-C one."""
        return (
            *(self.entry(d) for d in base.DTYPES),
            *(f"{self.stem}_f16_{v}" for v in self.F16_VARIANTS),
            self.smallc_entry,
        )

    @property
    def smallc_entry(self) -> str:
        """The fp16 direct convolution for few input channels (:meth:`smallc_supported`)."""
        return f"{self.stem}_f16_smallc"

    @property
    def smallc_threads(self) -> int:
        """The small-C entry's ``__launch_bounds__`` (a launch with fewer units, K <= 8, uses fewer)."""
        return self.f16_smallc[2]

    def smallc_supported(self, dtype: Any, C: int, K: int) -> str | None:
        """None when the small-C entry computes this conv, else why not. It takes fp16 with
        ``C <= SMALL_C_MAX`` and ``K <= SMALL_C_K_MAX``, any ``ldx``/``ldy`` and alignment (16-byte
        stores where ``ldy % 8 == 0`` and ``y`` is aligned, element stores elsewhere)."""
        name = base.dtype_name(dtype)
        if name != "float16":
            return f"{name}: the small-C entry is fp16 only"
        if C > SMALL_C_MAX:
            return f"C={C}: the small-C entry takes C <= {SMALL_C_MAX}"
        if K > SMALL_C_K_MAX:
            return f"K={K}: the small-C entry takes K <= {SMALL_C_K_MAX} (its weights stay in shared memory)"
        return None

    def f16_tiles(self) -> dict[str, F16Tile]:
        """The tile of every fixed fp16 entry (default, narrow, wide, small), by entry name."""
        default = (self.f16_bm, self.f16_bn, self.f16_bk, self.f16_warps_m, self.f16_warps_n)
        tiles = {self.entry("float16"): F16Tile(*default, self.f16_stages, self.f16_min_blocks)}
        for v in self.F16_VARIANTS:
            tiles[f"{self.stem}_f16_{v}"] = F16Tile(*getattr(self, f"f16_{v}"))
        return tiles

    def tuned_entry(self, tile: F16Tile) -> str:
        """The entry that runs ``tile``: a fixed entry with that very tile, else the tuned entry
        ``<stem>_f16_<tile.name>`` (compiled in through :meth:`extra_entries_define`)."""
        for entry, fixed in self.f16_tiles().items():
            if fixed == tile:
                return entry
        return f"{self.stem}_f16_{tile.name}"

    def entry_tile(self, entry: str) -> F16Tile:
        """The tile of an fp16 entry, fixed or tuned; InputError for any other name."""
        fixed = self.f16_tiles()
        if entry in fixed:
            return fixed[entry]
        prefix = f"{self.stem}_f16_"
        tile = F16Tile.parse(entry.removeprefix(prefix)) if entry.startswith(prefix) else None
        if tile is None:
            raise InputError(
                f"'{entry}' is not an fp16 entry of {self.stem}; use one of {', '.join(fixed)} "
                f"or a tuned entry {prefix}t<BM>x<BN>x<BK>_w<WM>x<WN>_s<STAGES>_b<MIN_BLOCKS>"
            )
        return tile

    def extra_entries_define(self, tiles: Iterable[F16Tile]) -> dict[str, str]:
        """The ``-D`` macro that compiles tuned entries for ``tiles`` into the source (none for a
        tile a fixed entry already has); merge it into :meth:`defines`."""
        extra = sorted({t for t in tiles if self.tuned_entry(t) not in self.f16_tiles()})
        if not extra:
            return {}
        body = " ".join(f"CONV_F16_TUNED({self.tuned_entry(t)}, {','.join(map(str, t.as_tuple()))})" for t in extra)
        return {"CONV_F16_EXTRA_ENTRIES": body}

    def _f16_config(self, entry: str | None) -> tuple[int, int, int]:
        """(bm, bn, threads) of an fp16 GEMM entry (None: the default one)."""
        if entry == self.smallc_entry:
            raise InputError(f"{entry} has no GEMM tile (its block depends on K): use launch(..., entry=...)")
        tile = self.entry_tile(entry if entry is not None else self.entry("float16"))
        return tile.bm, tile.bn, tile.threads

    def hopper_window(self, geom: Any, act: Any) -> str | None:
        """None: the op is 3x3 stride 1 with ReLU or none, all the wgmma kernel computes."""
        return None

    def direct_for(self, p: ConvProblem, geom: Any = None) -> tuple[str, str] | None:
        """The small-C entry and why, where :meth:`smallc_supported` takes ``p``; else None."""
        if self.smallc_supported(p.dtype, p.C, p.K) is None:
            return self.smallc_entry, f"C={p.C} <= {SMALL_C_MAX}: small-C direct conv"
        return None

    def split_k(
        self,
        dtype: Any,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        geom: Any,
        entry: str,
        *,
        device: DeviceInfo = REFERENCE,
    ) -> int:
        """1: conv3x3's mma.sync tiles do not split their reduction (its deep layers with few tiles are
        the wgmma kernel's on Hopper, which splits them; the general conv's tiles split theirs)."""
        return 1

    def variant(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int, geom: Any = None, *, device: DeviceInfo = REFERENCE
    ) -> str:
        """The entry to launch for this shape on ``device`` (fp32: the one entry). Launch it with
        the geometry of ``launch(dtype, N, H, W, C, K, entry=<this name>)``; every entry computes
        the same thing. ``geom`` is unused (the op's window is fixed).

        fp16: the small-C entry wherever :meth:`smallc_supported` takes the shape; else ``_narrow``
        for K <= 32, ``_wide`` where its tiles make a full wave at their occupancy
        (:meth:`DeviceInfo.full_wave` of its min-blocks), the default entry where its tiles do,
        else ``_small``."""
        name = base.dtype_name(dtype)
        base.positive(N=N, H=H, W=W, C=C, K=K)
        if name != "float16":
            return self.entry(name)
        if self.smallc_supported(name, C, K) is None:
            return self.smallc_entry
        M = N * H * W
        narrow_bn = self.f16_narrow[1]
        if narrow_bn >= K:
            return f"{self.stem}_f16_narrow"
        wide = F16Tile(*self.f16_wide)
        if wide.bn <= K and base.cdiv(M, wide.bm) * base.cdiv(K, wide.bn) >= device.full_wave(wide.min_blocks):
            return f"{self.stem}_f16_wide"
        main_tiles = base.cdiv(M, self.f16_bm) * base.cdiv(K, self.f16_bn)
        if main_tiles >= device.full_wave(self.f16_min_blocks):
            return self.entry(name)
        return f"{self.stem}_f16_small"

    def tile(self, dtype: Any, entry: str | None = None) -> tuple[int, int]:
        """(output pixels, output channels) computed by one block of ``entry`` (default entry: None)."""
        if base.dtype_name(dtype) == "float16":
            return self._f16_config(entry)[:2]
        return self.gemm_tile("float32")

    def threads(self, dtype: Any, entry: str | None = None) -> int:
        """Threads per block of an entry's ``__launch_bounds__`` (the small-C entry's launches may use fewer)."""
        if base.dtype_name(dtype) == "float16":
            return self.smallc_threads if entry == self.smallc_entry else self._f16_config(entry)[2]
        return self.gemm_threads("float32")

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        base.positive(N=N, H=H, W=W, C=C, K=K)
        return (N, H, W, K)

    def launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0, *, entry: str | None = None
    ) -> base.LaunchConfig:
        """One block per (pixel tile, channel tile); grid.x runs over pixels so that blocks in
        flight together share one slice of the weights. ``entry``: the fp16 variant launched
        (:meth:`variant`); None is the default entry of ``dtype``."""
        base.positive(N=N, H=H, W=W, C=C, K=K)
        M = base.pixels(N, H, W, C)
        if base.dtype_name(dtype) != "float16" and entry not in (None, self.entry(dtype)):
            raise InputError(f"'{entry}' is not the {base.dtype_name(dtype)} entry of {self.stem}")
        if entry == self.smallc_entry:
            return self._smallc_launch(dtype, N, H, W, C, K)
        bm, bn = self.tile(dtype, entry)
        return base.LaunchConfig(
            grid=base.gemm_grid(M, K, bm, bn), block=(self.threads(dtype, entry), 1, 1), shared_bytes=0
        )

    def _smallc_launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int) -> base.LaunchConfig:
        """The small-C entry: a 1-D grid of ``N * ceil(H/rows) * ceil(W/cols)`` blocks (column tile
        fastest, then row tile, then image); a block's units are its ``rows * cols / 8`` pixel groups
        x ``ceil(K/8)`` channel groups, one thread each up to the entry's thread count."""
        why = self.smallc_supported(dtype, C, K)
        if why is not None:
            raise InputError(f"{self.smallc_entry} cannot run this conv: {why}; launch variant()'s entry")
        rows, cols, threads, _ = self.f16_smallc
        blocks = N * base.cdiv(H, rows) * base.cdiv(W, cols)
        if blocks > base.INT32_MAX:
            raise InputError(f"{self.smallc_entry} needs {blocks} blocks; the grid allows 2^31-1; split the batch")
        units = rows * cols // 8 * base.cdiv(K, 8)
        return base.LaunchConfig(grid=(blocks, 1, 1), block=(min(threads, units), 1, 1), shared_bytes=0)

    def reference_at(
        self,
        x: np.ndarray,
        w: np.ndarray,
        pixels: np.ndarray,
        bias: np.ndarray | None = None,
        relu: bool = False,
    ) -> np.ndarray:
        """:meth:`reference` at some output pixels only: ``pixels`` are flat indices into N*H*W,
        the result is (len(pixels), K). For checking a kernel on problems too big for the full
        reference (the tuner checks one pixel in every run of 64)."""
        if x.ndim != 4 or w.ndim != 4 or w.shape[1:] != (3, 3, x.shape[3]):
            raise InputError(f"conv3x3 takes x (N,H,W,C) and w (K,3,3,C); got x {x.shape}, w {w.shape}")
        N, H, W, C = x.shape
        pixels = np.asarray(pixels, dtype=np.int64)
        if pixels.size and (pixels.min() < 0 or pixels.max() >= N * H * W):
            raise InputError(f"pixel indices must lie in [0, {N * H * W})")
        n, hw = np.divmod(pixels, H * W)
        h, col = np.divmod(hw, W)
        wf = w.astype(np.float32)
        out = np.zeros((pixels.size, w.shape[0]), np.float32)
        patch = np.empty((pixels.size, C), np.float32)
        for r in range(3):
            for s in range(3):
                hh, ww = h + r - 1, col + s - 1
                ok = (hh >= 0) & (hh < H) & (ww >= 0) & (ww < W)
                patch[:] = 0.0
                patch[ok] = x[n[ok], hh[ok], ww[ok]]
                out += patch @ wf[:, r, s, :].T
        if bias is not None:
            out += bias.astype(np.float32)
        if relu:
            np.maximum(out, 0.0, out=out)
        return out.astype(x.dtype)

    def prepare_inputs(
        self,
        call: KernelCall,
        inputs: base.Tensors,
        y: base.DeviceTensor,
        weights: base.Tensors,
        ctx: base.LaunchContext,
    ) -> base.PreparedCall:
        """What :func:`~dualtrack.kernels.select.choose_conv` picks on ``ctx.device``: the Hopper
        kernel (its own preparation, tensor maps included) where it is on and takes the launch, else
        the small-C entry, the layer's tuned entry, or :meth:`variant`'s."""
        x = inputs[0]
        kw = self.call_args(call, inputs, y, weights)
        p = ConvProblem.of(x, y)
        tuned = ctx.tuned_entry(call, p.N)
        at = Pointers(x.ptr, kw["w"], y.ptr)
        choice = choose_conv(self, p, ctx.device, tuned=tuned, wgmma_off=ctx.wgmma_off, at=at)
        if choice.impl == "wgmma":
            assert self.hopper is not None  # the chooser picks wgmma only where there is one
            act = Activation.named("relu" if kw["relu"] else "none")
            return self.hopper.prepare_entry(choice, x, y, weights, act, ctx)
        config = self.launch(p.dtype, p.N, p.H, p.W, p.C, p.K, entry=choice.entry)
        return base.PreparedCall(choice.entry, config, self.args(**kw), choice)
