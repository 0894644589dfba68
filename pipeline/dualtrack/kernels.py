"""The registry of Track A's hand-written kernels: the one place that knows their tile sizes.

Each :class:`KernelSpec` ties an op of the plan ("conv3x3", "maxpool2x2", "convt2x2") to its CUDA source
(``handwritten_ptx/<stem>.cu``), the PTX arches it is built for, its entry symbols, the ``-D`` macros
that fix its tile sizes at compile time (so the source and the launch geometry cannot disagree), its
launch geometry, its ``cuLaunchKernel`` argument list (the ABI of ``handwritten_ptx/README.md``) and
its numpy reference. :data:`KERNELS` holds each op's portable kernel; :data:`CONV3X3_WGMMA` is the
Hopper-only (compute_90a) conv3x3 that :func:`choose_conv3x3` prefers where the device and the shape
allow it. :data:`SPECS` lists every source.

Tensors are NHWC with a per-pixel channel stride (``ldx``/``ldy``); conv weights are KRSC in the
activation dtype and the bias is fp32. The references take dense arrays (stride = channels);
reading or writing channel slices is the runtime's business.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.arch import PTX_ARCHES
from dualtrack.errors import InputError

DTYPES: dict[str, str] = {"float16": "f16", "float32": "f32"}  # numpy dtype name -> entry suffix
_INT32_MAX = 2**31 - 1
_GRID_Y_MAX = 65535

# The small-C conv3x3 entry (``conv3x3_nhwc_f16_smallc``, a direct convolution on CUDA cores) takes
# fp16 layers with at most SMALL_C_MAX input channels (the RGB first layer), where the implicit
# GEMM's 9*C-deep reduction is too short for tensor-core tiles, and at most SMALL_C_K_MAX output
# channels (its fp32 weights stay in shared memory). Such a layer always runs it:
# :meth:`Conv3x3Spec.variant` and :func:`choose_conv3x3` put it before every other fp16 entry.
SMALL_C_MAX = 4
SMALL_C_K_MAX = 128

# (value, ctypes type) for cuLaunchKernel's kernelParams; (struct, None) passes a cuda.bindings
# struct such as a CUtensorMap by value (cuda-python packs the bytes behind its getPtr()).
KernelArg = tuple[Any, Any]


def dtype_name(dtype: Any) -> str:
    """Normalise ``"float16"``, ``np.float16`` or ``np.dtype("float16")`` to its numpy name."""
    try:
        name = np.dtype(dtype).name
    except TypeError as exc:
        raise InputError(f"dtype {dtype!r} is not a numpy dtype; Track A kernels take float16 or float32") from exc
    if name not in DTYPES:
        raise InputError(f"dtype {name} has no Track A kernel; use float16 or float32")
    return name


@dataclass(frozen=True)
class LaunchConfig:
    """Grid and block dimensions and dynamic shared memory of one kernel launch."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0


def kernel_params(args: list[KernelArg]) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """Split an :meth:`KernelSpec.args` list into the (values, types) pair cuda.bindings'
    ``cuLaunchKernel`` takes as ``kernelParams``."""
    return tuple(v for v, _ in args), tuple(t for _, t in args)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{name}={value!r} must be a positive integer")


def _stride(name: str, value: int | None, channels: int) -> int:
    if value is None:
        return channels
    if value < channels:
        raise InputError(
            f"{name}={value} is smaller than the {channels} channels it must hold; use {name} >= {channels}"
        )
    return int(value)


def _pointer(name: str, value: int | None, *, required: bool = True) -> int:
    if value is None or value == 0:
        if required:
            raise InputError(f"{name} is a null device pointer")
        return 0
    return int(value)


def _pixels(N: int, H: int, W: int, ld: int) -> int:
    # The kernels index pixels with 32-bit ints (element offsets are 64-bit).
    if N * H * W > _INT32_MAX:
        raise InputError(f"N*H*W = {N * H * W} output pixels exceed 2^31-1; split the batch")
    if ld > _INT32_MAX:
        raise InputError(f"channel stride {ld} exceeds 2^31-1")
    return N * H * W


def _gemm_grid(M: int, K: int, bm: int, bn: int, z: int = 1) -> tuple[int, int, int]:
    """The grid of the GEMM-shaped kernels: pixel tiles along x, channel tiles along y."""
    grid_y = _cdiv(K, bn)
    if grid_y > _GRID_Y_MAX:
        raise InputError(f"K={K} output channels need {grid_y} channel tiles; the grid allows {_GRID_Y_MAX}")
    return (_cdiv(M, bm), grid_y, z)


def _gemm_values(
    x: int, w: int, bias: int | None, y: int, N: int, H: int, W: int, C: int, K: int, ldx: int | None, ldy: int | None
) -> dict[str, int]:
    """Checked ``x, w, bias, y, N, H, W, C, K, ldx, ldy`` shared by the conv-like (GEMM) kernels."""
    _positive(N=N, H=H, W=W, C=C, K=K)
    ldx_ = _stride("ldx", ldx, C)
    ldy_ = _stride("ldy", ldy, K)
    _pixels(N, H, W, max(ldx_, ldy_))
    return {
        "x": _pointer("x", x),
        "w": _pointer("w", w),
        "bias": _pointer("bias", bias, required=False),
        "y": _pointer("y", y),
        "N": N, "H": H, "W": W, "C": C, "K": K,
        "ldx": ldx_, "ldy": ldy_,
    }  # fmt: skip


@dataclass(frozen=True)
class KernelSpec:
    """One op's kernels (an fp16 and an fp32 entry in one source file)."""

    op: str
    stem: str  # handwritten_ptx/<stem>.cu; entries are <stem>_f16 and <stem>_f32

    # Kernel parameters in ABI order (handwritten_ptx/README.md); pointers first, then int32s.
    PARAMS: ClassVar[tuple[str, ...]] = ()
    POINTERS: ClassVar[int] = 0
    # The PTX arches the source is compiled for (`make ptx`, ptx/<arch>/<stem>.ptx) and shipped in.
    ptx_arches: ClassVar[tuple[str, ...]] = PTX_ARCHES

    def entry(self, dtype: Any) -> str:
        """The kernel's symbol name for an activation dtype, e.g. ``conv3x3_nhwc_f16``."""
        return f"{self.stem}_{DTYPES[dtype_name(dtype)]}"

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self.entry(d) for d in DTYPES)

    @property
    def source(self) -> str:
        """The source stem (``handwritten_ptx/<source>.cu``, ``ptx/<arch>/<source>.ptx``)."""
        return self.stem

    def defines(self) -> dict[str, int]:
        """The ``-D`` macros the source is compiled with (tile and block sizes)."""
        raise NotImplementedError

    def threads(self, dtype: Any) -> int:
        """Threads per block of the entry for ``dtype`` (its ``__launch_bounds__``)."""
        raise NotImplementedError

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        raise NotImplementedError

    def args(self, **kwargs: Any) -> list[KernelArg]:
        raise NotImplementedError

    def reference(self, x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        raise NotImplementedError

    def _ordered(self, values: Mapping[str, int]) -> list[KernelArg]:
        """Values by name -> the ABI's ordered (value, ctypes type) list: 64-bit device addresses
        as ``c_void_p``, then ``c_int32``."""
        return [
            (int(values[name]), ctypes.c_void_p if i < self.POINTERS else ctypes.c_int32)
            for i, name in enumerate(self.PARAMS)
        ]


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


class _ConvAbi(KernelSpec):
    """The argument list the conv kernels share (conv3x3 and conv1x1 entries): checked by the
    kind's :meth:`output_shape`, then ``x, w, bias, y, N, H, W, C, K, ldx, ldy, relu``."""

    PARAMS: ClassVar[tuple[str, ...]] = ("x", "w", "bias", "y", "N", "H", "W", "C", "K", "ldx", "ldy", "relu")
    POINTERS: ClassVar[int] = 4

    def args(
        self,
        *,
        x: int,
        w: int,
        y: int,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        bias: int | None = None,
        ldx: int | None = None,
        ldy: int | None = None,
        relu: bool = False,
        **_: Any,
    ) -> list[KernelArg]:
        """``x, w, bias, y, N, H, W, C, K, ldx, ldy, relu`` as (value, ctypes type) pairs.

        Pointers are device addresses (ints); ``bias`` may be omitted (null: no bias);
        ``ldx``/``ldy`` default to ``C``/``K`` (dense tensors).
        """
        self.output_shape(N, H, W, C, K)
        values = _gemm_values(x, w, bias, y, N, H, W, C, K, ldx, ldy)
        return self._ordered({**values, "relu": 1 if relu else 0})


@dataclass(frozen=True)
class Conv3x3Spec(_ConvAbi):
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

    f16_bm: int = 128
    f16_bn: int = 64
    f16_bk: int = 32
    f16_warps_m: int = 2
    f16_warps_n: int = 2
    f16_stages: int = 4
    f16_min_blocks: int = 4
    f16_narrow: tuple[int, ...] = (128, 32, 32, 4, 1, 4, 4)
    f16_wide: tuple[int, ...] = (128, 128, 32, 4, 2, 3, 2)
    f16_small: tuple[int, ...] = (64, 64, 64, 2, 2, 3, 4)
    # rows, columns of the output tile, threads (at most), min blocks per SM
    f16_smallc: tuple[int, ...] = (16, 64, 256, 2)
    # variant(): wide tiles when there are at least this many of them, else the default tile when
    # it has at least f16_main_min_tiles, else small (measured on an H200, 132 SMs).
    f16_wide_min_tiles: int = 256
    f16_main_min_tiles: int = 512
    f32_bm: int = 64
    f32_bn: int = 64
    f32_bk: int = 16
    f32_tm: int = 4
    f32_tn: int = 4

    def defines(self) -> dict[str, int | str]:
        return {
            "CONV_F16_BM": self.f16_bm,
            "CONV_F16_BN": self.f16_bn,
            "CONV_F16_BK": self.f16_bk,
            "CONV_F16_WARPS_M": self.f16_warps_m,
            "CONV_F16_WARPS_N": self.f16_warps_n,
            "CONV_F16_STAGES": self.f16_stages,
            "CONV_F16_MIN_BLOCKS": self.f16_min_blocks,
            **{f"CONV_F16_{v.upper()}": ",".join(map(str, getattr(self, f"f16_{v}"))) for v in self.F16_VARIANTS},
            "CONV_F16_SMALLC": ",".join(map(str, self.f16_smallc)),
            "CONV_F16_SMALLC_CMAX": SMALL_C_MAX,
            "CONV_F16_SMALLC_KMAX": SMALL_C_K_MAX,
            "CONV_F32_BM": self.f32_bm,
            "CONV_F32_BN": self.f32_bn,
            "CONV_F32_BK": self.f32_bk,
            "CONV_F32_TM": self.f32_tm,
            "CONV_F32_TN": self.f32_tn,
        }

    @property
    def entries(self) -> tuple[str, ...]:
        """Every entry in the PTX: the default fp16 and fp32 ones, the fp16 variants, the small-C one."""
        return (
            *(self.entry(d) for d in DTYPES),
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
        name = dtype_name(dtype)
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

    def variant(self, dtype: Any, N: int, H: int, W: int, C: int, K: int) -> str:
        """The entry to launch for this shape (fp32: the one entry). Launch it with the geometry of
        ``launch(dtype, N, H, W, C, K, entry=<this name>)``; every entry computes the same thing.

        fp16: the small-C entry wherever :meth:`smallc_supported` takes the shape; else ``_narrow``
        for K <= 32, ``_wide`` with enough wide tiles, the default entry with enough of its tiles,
        else ``_small``."""
        name = dtype_name(dtype)
        _positive(N=N, H=H, W=W, C=C, K=K)
        if name != "float16":
            return self.entry(name)
        if self.smallc_supported(name, C, K) is None:
            return self.smallc_entry
        M = N * H * W
        narrow_bn = self.f16_narrow[1]
        if narrow_bn >= K:
            return f"{self.stem}_f16_narrow"
        wbm, wbn = self.f16_wide[:2]
        if wbn <= K and _cdiv(M, wbm) * _cdiv(K, wbn) >= self.f16_wide_min_tiles:
            return f"{self.stem}_f16_wide"
        if _cdiv(M, self.f16_bm) * _cdiv(K, self.f16_bn) >= self.f16_main_min_tiles:
            return self.entry(name)
        return f"{self.stem}_f16_small"

    def tile(self, dtype: Any, entry: str | None = None) -> tuple[int, int]:
        """(output pixels, output channels) computed by one block of ``entry`` (default entry: None)."""
        if dtype_name(dtype) == "float16":
            return self._f16_config(entry)[:2]
        return self.f32_bm, self.f32_bn

    def threads(self, dtype: Any, entry: str | None = None) -> int:
        """Threads per block of an entry's ``__launch_bounds__`` (the small-C entry's launches may use fewer)."""
        if dtype_name(dtype) == "float16":
            return self.smallc_threads if entry == self.smallc_entry else self._f16_config(entry)[2]
        return (self.f32_bm // self.f32_tm) * (self.f32_bn // self.f32_tn)

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        _positive(N=N, H=H, W=W, C=C, K=K)
        return (N, H, W, K)

    def launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0, *, entry: str | None = None
    ) -> LaunchConfig:
        """One block per (pixel tile, channel tile); grid.x runs over pixels so that blocks in
        flight together share one slice of the weights. ``entry``: the fp16 variant launched
        (:meth:`variant`); None is the default entry of ``dtype``."""
        _positive(N=N, H=H, W=W, C=C, K=K)
        M = _pixels(N, H, W, C)
        if dtype_name(dtype) != "float16" and entry not in (None, self.entry(dtype)):
            raise InputError(f"'{entry}' is not the {dtype_name(dtype)} entry of {self.stem}")
        if entry == self.smallc_entry:
            return self._smallc_launch(dtype, N, H, W, C, K)
        bm, bn = self.tile(dtype, entry)
        return LaunchConfig(grid=_gemm_grid(M, K, bm, bn), block=(self.threads(dtype, entry), 1, 1), shared_bytes=0)

    def _smallc_launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int) -> LaunchConfig:
        """The small-C entry: a 1-D grid of ``N * ceil(H/rows) * ceil(W/cols)`` blocks (column tile
        fastest, then row tile, then image); a block's units are its ``rows * cols / 8`` pixel groups
        x ``ceil(K/8)`` channel groups, one thread each up to the entry's thread count."""
        why = self.smallc_supported(dtype, C, K)
        if why is not None:
            raise InputError(f"{self.smallc_entry} cannot run this conv: {why}; launch variant()'s entry")
        rows, cols, threads, _ = self.f16_smallc
        blocks = N * _cdiv(H, rows) * _cdiv(W, cols)
        if blocks > _INT32_MAX:
            raise InputError(f"{self.smallc_entry} needs {blocks} blocks; the grid allows 2^31-1; split the batch")
        units = rows * cols // 8 * _cdiv(K, 8)
        return LaunchConfig(grid=(blocks, 1, 1), block=(min(threads, units), 1, 1), shared_bytes=0)

    def reference(
        self, x: np.ndarray, w: np.ndarray | None = None, bias: np.ndarray | None = None, relu: bool = False
    ) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C), ``w`` (K,3,3,C), ``bias`` (K,) or None.

        Computes in float32 (products and sums, then bias, then ReLU) and returns x's dtype,
        rounded once, as the kernels do.
        """
        if w is None:
            raise InputError("conv3x3 reference needs weights w of shape (K, 3, 3, C)")
        if x.ndim != 4 or w.ndim != 4 or w.shape[1:] != (3, 3, x.shape[3]):
            raise InputError(f"conv3x3 takes x (N,H,W,C) and w (K,3,3,C); got x {x.shape}, w {w.shape}")
        N, H, W, _ = x.shape
        K = w.shape[0]
        xp = np.pad(x.astype(np.float32), ((0, 0), (1, 1), (1, 1), (0, 0)))
        wf = w.astype(np.float32)
        out = np.zeros((N, H, W, K), np.float32)
        for r in range(3):
            for s in range(3):
                out += xp[:, r : r + H, s : s + W, :] @ wf[:, r, s, :].T
        if bias is not None:
            if bias.shape != (K,):
                raise InputError(f"bias has shape {bias.shape}; expected ({K},)")
            out += bias.astype(np.float32)
        if relu:
            np.maximum(out, 0.0, out=out)
        return out.astype(x.dtype)

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


@dataclass(frozen=True)
class Conv1x1Spec(_ConvAbi):
    """1x1 convolution, stride 1, no padding, bias and optional ReLU fused (a segmentation head:
    a few classes out of a few dozen features). No GEMM: one thread per pixel and group of
    ``k_group`` output channels (grid.y: the groups), fp32 accumulation, the group's weights in
    shared memory as fp32, so C is at most ``max_c``. Weights as ONNX stores them, (K, C, 1, 1)
    = :func:`pack_conv_weights`'s KRSC; bias fp32."""

    block_threads: int = 256
    k_group: int = 4
    max_c: int = 512

    def defines(self) -> dict[str, int]:
        return {"CONV1X1_THREADS": self.block_threads, "CONV1X1_KG": self.k_group, "CONV1X1_MAX_C": self.max_c}

    def threads(self, dtype: Any) -> int:
        dtype_name(dtype)
        return self.block_threads

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        _positive(N=N, H=H, W=W, C=C, K=K)
        if self.max_c < C:
            raise InputError(
                f"conv1x1 takes at most {self.max_c} input channels (its weights stay in shared memory); got C={C}"
            )
        return (N, H, W, K)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        self.output_shape(N, H, W, C, K)
        blocks = _cdiv(_pixels(N, H, W, C), self.block_threads)
        groups = _cdiv(K, self.k_group)
        if blocks > _INT32_MAX or groups > _GRID_Y_MAX:
            raise InputError(f"conv1x1 of {N}x{H}x{W}x{C} -> {K} needs a {blocks}x{groups} grid; split the batch")
        return LaunchConfig(grid=(blocks, groups, 1), block=(self.threads(dtype), 1, 1), shared_bytes=0)

    def reference(
        self, x: np.ndarray, w: np.ndarray | None = None, bias: np.ndarray | None = None, relu: bool = False
    ) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C), ``w`` (K,1,1,C) or (K,C), ``bias`` (K,) or None; in
        float32 (products and sums, then bias, then ReLU), rounded once to x's dtype."""
        if w is None:
            raise InputError("conv1x1 reference needs weights w of shape (K, 1, 1, C)")
        wk = w.reshape(w.shape[0], -1)
        if x.ndim != 4 or wk.shape[1] != x.shape[3]:
            raise InputError(f"conv1x1 takes x (N,H,W,C) and w (K,1,1,C); got x {x.shape}, w {w.shape}")
        out = x.astype(np.float32) @ wk.astype(np.float32).T
        if bias is not None:
            if bias.shape != (wk.shape[0],):
                raise InputError(f"bias has shape {bias.shape}; expected ({wk.shape[0]},)")
            out += bias.astype(np.float32)
        if relu:
            np.maximum(out, 0.0, out=out)
        return out.astype(x.dtype)


@dataclass(frozen=True)
class MaxPool2x2Spec(KernelSpec):
    """2x2 max-pool, stride 2: one thread per output pixel and 16-byte chunk of channels."""

    block_threads: int = 256
    CHUNK_BYTES: ClassVar[int] = 16
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "y", "N", "H", "W", "C", "ldx", "ldy")
    POINTERS: ClassVar[int] = 2

    def vector(self, dtype: Any) -> int:
        """Channels a thread handles: one 16-byte chunk."""
        return self.CHUNK_BYTES // np.dtype(dtype_name(dtype)).itemsize

    def defines(self) -> dict[str, int]:
        return {
            "POOL_THREADS": self.block_threads,
            "POOL_VEC_F16": self.vector("float16"),
            "POOL_VEC_F32": self.vector("float32"),
        }

    def threads(self, dtype: Any) -> int:
        dtype_name(dtype)
        return self.block_threads

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        _positive(N=N, H=H, W=W, C=C)
        if H < 2 or W < 2:
            raise InputError(f"maxpool2x2 needs H, W >= 2; got {H}x{W}")
        return (N, H // 2, W // 2, C)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        _, Ho, Wo, _ = self.output_shape(N, H, W, C)
        _pixels(N, H, W, C)
        work = N * Ho * Wo * _cdiv(C, self.vector(dtype))
        blocks = _cdiv(work, self.block_threads)
        if blocks > _INT32_MAX:
            raise InputError(f"maxpool2x2 of {N}x{H}x{W}x{C} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    def args(
        self,
        *,
        x: int,
        y: int,
        N: int,
        H: int,
        W: int,
        C: int,
        ldx: int | None = None,
        ldy: int | None = None,
        **_: Any,
    ) -> list[KernelArg]:
        """``x, y, N, H, W, C, ldx, ldy`` as (value, ctypes type) pairs; strides default to ``C``."""
        self.output_shape(N, H, W, C)
        ldx_ = _stride("ldx", ldx, C)
        ldy_ = _stride("ldy", ldy, C)
        _pixels(N, H, W, max(ldx_, ldy_))
        values = {
            "x": _pointer("x", x),
            "y": _pointer("y", y),
            "N": N,
            "H": H,
            "W": W,
            "C": C,
            "ldx": ldx_,
            "ldy": ldy_,
        }
        return self._ordered(values)

    def reference(self, x: np.ndarray, *_: Any, **__: Any) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C) -> (N,H//2,W//2,C); an odd last row/column is dropped."""
        if x.ndim != 4:
            raise InputError(f"maxpool2x2 takes x (N,H,W,C); got {x.shape}")
        N, Ho, Wo, C = self.output_shape(*x.shape)
        return x[:, : 2 * Ho, : 2 * Wo, :].reshape(N, Ho, 2, Wo, 2, C).max(axis=(2, 4))


@dataclass(frozen=True)
class ConvT2x2Spec(KernelSpec):
    """2x2 transposed convolution, stride 2, no padding, group 1 (ONNX ConvTranspose), bias fused.

    With the packed weights (:func:`pack_convt_weights`, shape (4K, C)) this is a GEMM of the
    N*H*W input pixels by the 4K (tap, channel) columns, each column scattered to its output pixel.
    A block computes a ``bm x bn`` tile of it (input pixels x columns ``t*K + k``, which may span
    taps); the grid is 1-D, the ``ceil(4K / bn)`` column tiles fastest, then the pixel tiles.
    fp16: tensor cores, ``32 * f16_warps_m * f16_warps_n`` threads, ``f16_bk``-deep cp.async stages.
    fp32: SIMT, ``f32_tm x f32_tn`` outputs a thread.
    """

    PARAMS: ClassVar[tuple[str, ...]] = ("x", "w", "bias", "y", "N", "H", "W", "C", "K", "ldx", "ldy")
    POINTERS: ClassVar[int] = 4
    TAPS: ClassVar[int] = 4

    f16_bm: int = 128
    f16_bn: int = 64
    f16_bk: int = 32
    f16_warps_m: int = 2
    f16_warps_n: int = 2
    f16_stages: int = 3
    f32_bm: int = 64
    f32_bn: int = 64
    f32_bk: int = 16
    f32_tm: int = 4
    f32_tn: int = 4

    def defines(self) -> dict[str, int]:
        return {
            "CONVT_F16_BM": self.f16_bm,
            "CONVT_F16_BN": self.f16_bn,
            "CONVT_F16_BK": self.f16_bk,
            "CONVT_F16_WARPS_M": self.f16_warps_m,
            "CONVT_F16_WARPS_N": self.f16_warps_n,
            "CONVT_F16_STAGES": self.f16_stages,
            "CONVT_F32_BM": self.f32_bm,
            "CONVT_F32_BN": self.f32_bn,
            "CONVT_F32_BK": self.f32_bk,
            "CONVT_F32_TM": self.f32_tm,
            "CONVT_F32_TN": self.f32_tn,
        }

    def tile(self, dtype: Any) -> tuple[int, int]:
        """(input pixels, output channels of one tap) computed by one block."""
        if dtype_name(dtype) == "float16":
            return self.f16_bm, self.f16_bn
        return self.f32_bm, self.f32_bn

    def threads(self, dtype: Any) -> int:
        if dtype_name(dtype) == "float16":
            return 32 * self.f16_warps_m * self.f16_warps_n
        return (self.f32_bm // self.f32_tm) * (self.f32_bn // self.f32_tn)

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        _positive(N=N, H=H, W=W, C=C, K=K)
        return (N, 2 * H, 2 * W, K)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        """One block per (pixel tile, tile of the 4K GEMM columns) on a 1-D grid, the column tile
        fastest: the blocks in flight together read one tile of the input, which then comes from
        DRAM once (handwritten_ptx/convt2x2_nhwc.cu)."""
        _positive(N=N, H=H, W=W, C=C, K=K)
        M = _pixels(N, H, W, C)
        bm, bn = self.tile(dtype)
        blocks = _cdiv(M, bm) * _cdiv(self.TAPS * K, bn)
        if blocks > _INT32_MAX:
            raise InputError(f"convt2x2 of {N}x{H}x{W}x{C} -> {K} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.threads(dtype), 1, 1), shared_bytes=0)

    def args(
        self,
        *,
        x: int,
        w: int,
        y: int,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        bias: int | None = None,
        ldx: int | None = None,
        ldy: int | None = None,
        **_: Any,
    ) -> list[KernelArg]:
        """``x, w, bias, y, N, H, W, C, K, ldx, ldy`` as (value, ctypes type) pairs.

        ``w`` is the packed (4K, C) weights; ``bias`` may be omitted (null: no bias);
        ``ldx``/``ldy`` default to ``C``/``K`` (dense tensors).
        """
        return self._ordered(_gemm_values(x, w, bias, y, N, H, W, C, K, ldx, ldy))

    def reference(self, x: np.ndarray, wp: np.ndarray | None = None, bias: np.ndarray | None = None) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C), packed ``wp`` (4K, C) (see :func:`pack_convt_weights`),
        ``bias`` (K,) or None -> (N, 2H, 2W, K).

        Computes in float32 (products and sums, then bias) and returns x's dtype, rounded once, as
        the kernels do.
        """
        if wp is None:
            raise InputError("convt2x2 reference needs packed weights wp of shape (4K, C)")
        if x.ndim != 4 or wp.ndim != 2 or wp.shape[0] % 4 != 0 or wp.shape[0] == 0 or wp.shape[1] != x.shape[3]:
            raise InputError(f"convt2x2 takes x (N,H,W,C) and packed wp (4K,C); got x {x.shape}, wp {wp.shape}")
        N, H, W, _ = x.shape
        K = wp.shape[0] // 4
        cols = x.astype(np.float32) @ wp.astype(np.float32).T  # (N,H,W,4K), column (i*2+j)*K + k
        out = cols.reshape(N, H, W, 2, 2, K).transpose(0, 1, 3, 2, 4, 5).reshape(N, 2 * H, 2 * W, K)
        if bias is not None:
            if bias.shape != (K,):
                raise InputError(f"bias has shape {bias.shape}; expected ({K},)")
            out = out + bias.astype(np.float32)
        return out.astype(x.dtype)


# -- the Hopper conv3x3: TMA + wgmma.mma_async, sm_90a only ---------------------------------------


@dataclass(frozen=True)
class WgmmaConfig:
    """One compiled configuration of ``conv3x3_wgmma.cu``: the ``CONV_WGMMA_ENTRY`` macro's arguments.

    A CTA computes ``bm = 64 * mt * wgs`` output pixels of one image (a TH x TW spatial tile) by
    ``bn`` output channels with ``wgs`` consumer warpgroups of ``mt`` m64 blocks each, plus one
    producer warp that issues the TMA loads. The reduction (9 taps x C channels) runs in
    ``bk``-channel k-blocks (one 64- or 128-byte swizzled shared-memory row) through ``stages``
    pipeline stages; registers are capped so that ``min_blocks`` CTAs fit on an SM.

    ``halo_tw`` > 0: the column-copy scheme (entry suffix ``_h<TW>``, the .cu's header). The tile
    is ``bm / halo_tw`` rows of ``halo_tw`` pixels, and a stage holds one box of TH + 2 rows per
    column shift plus the weights of its three taps, so each input pixel comes from L2 about three
    times instead of nine.
    """

    bn: int
    mt: int
    wgs: int
    bk: int
    stages: int
    min_blocks: int
    halo_tw: int = 0

    ELEMENT_BYTES: ClassVar[int] = 2  # fp16
    ALIGN: ClassVar[int] = 1024  # the kernel rounds its dynamic shared memory up to the 128-byte swizzle repeat

    @property
    def bm(self) -> int:
        return 64 * self.mt * self.wgs

    @property
    def threads(self) -> int:
        return 32 * (4 * self.wgs + 1)  # consumer warpgroups + the producer warp

    @property
    def row_bytes(self) -> int:
        """Bytes of one shared-memory tile row: the TMA/wgmma swizzle span (64 or 128)."""
        return self.bk * self.ELEMENT_BYTES

    @property
    def a_rows(self) -> int:
        """Rows of a stage's A box: the tile's pixels, plus two image rows for a column copy."""
        return self.bm + 2 * self.halo_tw

    @property
    def taps_per_stage(self) -> int:
        return 3 if self.halo_tw else 1

    @property
    def stage_bytes(self) -> int:
        """Bytes one stage brings in (A box + its taps' B boxes): the mbarrier transaction count."""
        return (self.a_rows + self.taps_per_stage * self.bn) * self.row_bytes

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch (the kernel aligns its base up to 1024 bytes)."""
        return self.stages * self.stage_bytes + self.ALIGN

    @property
    def static_smem_bytes(self) -> int:
        return 2 * 8 * self.stages  # the full[] and empty[] mbarriers

    @property
    def entry(self) -> str:
        halo = f"_h{self.halo_tw}" if self.halo_tw else ""
        return f"conv3x3_wgmma_bn{self.bn}_mt{self.mt}_wg{self.wgs}_bk{self.bk}{halo}"

    @property
    def macro(self) -> str:
        args = f"{self.bn},{self.mt},{self.wgs},{self.bk},{self.stages},{self.min_blocks}"
        if self.halo_tw:
            return f"CONV_WGMMA_HALO_ENTRY({args},{self.halo_tw})"
        return f"CONV_WGMMA_ENTRY({args})"

    def tw_log2(self, W: int) -> int:
        """log2 of the spatial tile's width TW: ``halo_tw`` for a column-copy entry (compiled in),
        else the smallest power of two >= W, at most ``bm`` (the tile is ``bm / TW`` rows of TW
        pixels)."""
        if self.halo_tw:
            return self.halo_tw.bit_length() - 1
        tw = 1
        while tw < W and tw < self.bm:
            tw *= 2
        return tw.bit_length() - 1

    def ctas(self, N: int, H: int, W: int, K: int) -> int:
        """CTAs of a launch: N x spatial tiles x channel tiles (the kernel's 1-D grid)."""
        log2 = self.tw_log2(W)
        return N * _cdiv(H, self.bm >> log2) * _cdiv(W, 1 << log2) * _cdiv(K, self.bn)


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
)

_TMA_DIM_LIMIT = 2**32  # cuTensorMapEncodeTiled: every dimension < 2^32 elements
_TMA_STRIDE_LIMIT = 2**40  # and every byte stride < 2^40


@dataclass(frozen=True)
class Conv3x3WgmmaSpec(KernelSpec):
    """The conv3x3 op (same semantics as :class:`Conv3x3Spec`, fp16 only) on Hopper: the input and
    weight tiles come by TMA (``cp.async.bulk.tensor`` into an mbarrier pipeline; the tensor map's
    zero fill outside the image is the padding), the products by ``wgmma.mma_async`` from shared
    memory, fp32 accumulators, bias + ReLU and one fp16 rounding in the epilogue.

    sm_90a only (:attr:`ptx_arches`). One entry per :class:`WgmmaConfig` (:attr:`configs`, compiled
    in through ``-DCONV_WGMMA_ENTRIES``); :meth:`choose` picks one per shape, :meth:`supported`
    says which launches it can take at all. The input and the weights are passed as two
    ``CUtensorMap`` structs by value (``runtime/tma.py`` builds them) instead of ``x``, ``w``, ``ldx``.
    """

    PARAMS: ClassVar[tuple[str, ...]] = (
        "tmx", "tmw", "bias", "y", "N", "H", "W", "C", "K", "ldy", "relu", "tw_log2", "status",
    )  # fmt: skip
    ptx_arches: ClassVar[tuple[str, ...]] = ("compute_90a",)  # wgmma exists on sm_90a only

    configs: tuple[WgmmaConfig, ...] = WGMMA_CONFIGS
    # choose(), fitted to the per-layer winners of bench/results/wgmma_check-770a528.json (H200, 132
    # SMs): of these tiles, the first that makes at least `min_ctas` CTAs, else the one with most.
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
    )  # K <= 32
    min_ctas: int = 128

    def defines(self) -> dict[str, str]:
        return {"CONV_WGMMA_ENTRIES": " ".join(c.macro for c in self.configs)}

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(c.entry for c in self.configs)

    def entry(self, dtype: Any) -> str:
        raise InputError(f"{self.stem} has one entry per tile configuration; use choose(...).entry")

    def config(self, entry: str) -> WgmmaConfig:
        """The configuration an entry name stands for; InputError for any other name."""
        for c in self.configs:
            if c.entry == entry:
                return c
        raise InputError(f"'{entry}' is not an entry of {self.stem}; use one of {', '.join(self.entries)}")

    def threads(self, dtype: Any, entry: str | None = None) -> int:
        if entry is None:
            raise InputError(f"{self.stem}: threads() needs the entry (configurations differ)")
        return self.config(entry).threads

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        _positive(N=N, H=H, W=W, C=C, K=K)
        return (N, H, W, K)

    def supported(
        self,
        dtype: Any,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        ldx: int | None = None,
        ldy: int | None = None,
        *,
        x: int = 0,
        w: int = 0,
        y: int = 0,
    ) -> str | None:
        """None when this kernel can run the launch, else why not (the caller keeps the mma.sync kernel).

        TMA needs 16-byte multiples for the weight rows (9C halves) and the pixel stride ``ldx``,
        and 16-byte aligned ``x`` and ``w``; the epilogue's 16-byte stores need ``ldy % 8 == 0`` and
        an aligned ``y``. Pointers default to 0 (aligned): the plan's shapes alone can be checked.
        """
        if dtype_name(dtype) != "float16":
            return f"{dtype_name(dtype)}: the wgmma kernel is fp16 only"
        _positive(N=N, H=H, W=W, C=C, K=K)
        ldx_, ldy_ = _stride("ldx", ldx, C), _stride("ldy", ldy, K)
        if C % 8:
            return f"C={C}: TMA needs 16-byte weight rows (C % 8 == 0)"
        if ldx_ % 8:
            return f"ldx={ldx_}: TMA needs a 16-byte pixel stride (ldx % 8 == 0)"
        if ldy_ % 8:
            return f"ldy={ldy_}: the epilogue's 16-byte stores need ldy % 8 == 0"
        for name, p in (("x", x), ("w", w), ("y", y)):
            if int(p) % 16:
                return f"{name}={int(p):#x} is not 16-byte aligned"
        if N * H * W > _INT32_MAX or max(ldx_, ldy_) > _INT32_MAX:
            return f"N*H*W = {N * H * W} pixels or a channel stride exceed 2^31-1"
        if max(N, H, W, 9 * C, K) >= _TMA_DIM_LIMIT or N * H * W * ldx_ * 2 >= _TMA_STRIDE_LIMIT:
            return "the input is too large for a tensor map (dims < 2^32, byte strides < 2^40)"
        return None

    def choose(self, N: int, H: int, W: int, C: int, K: int) -> WgmmaConfig:
        """The configuration to launch for this shape (H200 measurements, handwritten_ptx/README.md):

        k-blocks of 64 channels when ``C % 64 == 0``, else of 32. K <= 32: the 256x32 column-copy
        tile. Else 256x128, then the 256x64 and 128x64 column-copy tiles (128x64 first when C <= 64),
        then 64x64 (with 32-channel k-blocks: the 256x64 column-copy tile only), skipping tiles
        wider than K rounded up to 32: the first that makes at least :attr:`min_ctas` CTAs, else
        the one that makes the most (of equals, the smaller). Within 0.5% of the per-layer best on
        the U-Net's 26 (layer, batch) pairs (the worst single layer: 1.3%).
        """
        _positive(N=N, H=H, W=W, C=C, K=K)
        bk = 64 if C % 64 == 0 else 32
        by_entry = {c.entry: c for c in self.configs}
        if K > 32:
            k32 = _cdiv(K, 32) * 32
            order = list(self.prefer)
            if C <= 64:
                order.remove(self.one_block_first)
                order.insert(1, self.one_block_first)
            wide = [by_entry[e] for e in order if by_entry[e].bk == bk and by_entry[e].bn <= k32]
            for c in wide:
                if c.ctas(N, H, W, K) >= self.min_ctas:
                    return c
            if wide:
                # of equals the smaller tile: the same CTAs computing fewer rows and channels past the image
                return max(wide, key=lambda c: (c.ctas(N, H, W, K), -c.bm * c.bn))
        return next(by_entry[e] for e in self.narrow if by_entry[e].bk == bk)

    def launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0, *, entry: str | None = None
    ) -> LaunchConfig:
        """1-D grid (channel tile fastest, so the CTAs that share an input tile run together),
        block of ``32 * (4 * wgs + 1)`` threads, dynamic shared memory of the configuration (more
        than 48 KiB: set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first). ``entry`` None:
        :meth:`choose`'s."""
        dtype_name(dtype)
        _positive(N=N, H=H, W=W, C=C, K=K)
        _pixels(N, H, W, C)
        cfg = self.config(entry) if entry is not None else self.choose(N, H, W, C, K)
        ctas = cfg.ctas(N, H, W, K)
        if ctas > _INT32_MAX:
            raise InputError(f"{ctas} CTAs exceed the grid's 2^31-1; split the batch")
        return LaunchConfig(grid=(ctas, 1, 1), block=(cfg.threads, 1, 1), shared_bytes=cfg.smem_bytes)

    def args(
        self,
        *,
        tmx: Any,
        tmw: Any,
        y: int,
        N: int,
        H: int,
        W: int,
        C: int,
        K: int,
        entry: str,
        bias: int | None = None,
        ldy: int | None = None,
        relu: bool = False,
        status: int | None = None,
        **_: Any,
    ) -> list[KernelArg]:
        """``tmx, tmw, bias, y, N, H, W, C, K, ldy, relu, tw_log2, status`` as (value, type) pairs.

        ``tmx``/``tmw`` are the input's and the weights' tensor maps (``runtime/tma.py``), passed by
        value; ``entry`` fixes ``tw_log2`` (the tile shape the maps were made for); ``status``: an
        int[8] device buffer for the watchdog's report, or None (a stuck wait then traps).
        """
        _positive(N=N, H=H, W=W, C=C, K=K)
        ldy_ = _stride("ldy", ldy, K)
        _pixels(N, H, W, ldy_)
        for name, m in (("tmx", tmx), ("tmw", tmw)):
            if not callable(getattr(m, "getPtr", None)):
                raise InputError(f"{name} must be a CUtensorMap (runtime/tma.py encode()), not {type(m).__name__}")
        cfg = self.config(entry)
        return [
            (tmx, None),
            (tmw, None),
            (_pointer("bias", bias, required=False), ctypes.c_void_p),
            (_pointer("y", y), ctypes.c_void_p),
            *((int(v), ctypes.c_int32) for v in (N, H, W, C, K, ldy_, 1 if relu else 0, cfg.tw_log2(W))),
            (_pointer("status", status, required=False), ctypes.c_void_p),
        ]

    def reference(
        self, x: np.ndarray, w: np.ndarray | None = None, bias: np.ndarray | None = None, relu: bool = False
    ) -> np.ndarray:
        """The conv3x3 op's numpy semantics (:meth:`Conv3x3Spec.reference`)."""
        return KERNELS["conv3x3"].reference(x, w, bias, relu)


@dataclass(frozen=True)
class ConvChoice:
    """Which kernel runs one conv3x3 launch, and why (:func:`choose_conv3x3`)."""

    # "wgmma" (conv3x3_wgmma, sm_90a), "mma.sync" (conv3x3_nhwc fp16), "direct" (its small-C fp16
    # entry, CUDA cores), "simt" (fp32)
    impl: str
    entry: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"impl": self.impl, "entry": self.entry, "reason": self.reason}


KERNELS: Mapping[str, KernelSpec] = {
    "conv3x3": Conv3x3Spec(op="conv3x3", stem="conv3x3_nhwc"),
    "maxpool2x2": MaxPool2x2Spec(op="maxpool2x2", stem="maxpool2x2_nhwc"),
    "convt2x2": ConvT2x2Spec(op="convt2x2", stem="convt2x2_nhwc"),
    "conv1x1": Conv1x1Spec(op="conv1x1", stem="conv1x1_nhwc"),
}


def kernel(op: str) -> KernelSpec:
    """The spec of a plan op, or InputError naming the ops that exist."""
    try:
        return KERNELS[op]
    except KeyError:
        raise InputError(f"no Track A kernel for op '{op}'; Track A has {', '.join(sorted(KERNELS))}") from None


def output_shape(op: str, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
    """NHWC output shape of ``op`` on an (N,H,W,C) input (K: output channels, conv only)."""
    return kernel(op).output_shape(N, H, W, C, K)


def pack_conv_weights(w: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """ONNX Conv weights (K, C, 3, 3) or (K, C, 1, 1) and bias (K,) -> what the conv kernels take:
    KRSC weights in the same dtype (contiguous) and an fp32 bias (None stays None)."""
    if w.ndim != 4 or w.shape[2:] not in ((3, 3), (1, 1)):
        raise InputError(f"conv weights must be (K, C, 3, 3) or (K, C, 1, 1) as ONNX stores them; got {w.shape}")
    packed = np.ascontiguousarray(w.transpose(0, 2, 3, 1))
    if bias is None:
        return packed, None
    if bias.shape != (w.shape[0],):
        raise InputError(f"conv bias has shape {bias.shape}; expected ({w.shape[0]},)")
    return packed, np.ascontiguousarray(bias, dtype=np.float32)


def pack_convt_weights(w: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """ONNX ConvTranspose weights (C, K, 2, 2) and bias (K,) -> what the convt2x2 kernels take:
    ``wp`` of shape (4K, C) in the same dtype (contiguous), ``wp[(i*2+j)*K + k, c] = w[c, k, i, j]``,
    and an fp32 bias (None stays None)."""
    if w.ndim != 4 or w.shape[2:] != (2, 2):
        raise InputError(f"convt2x2 weights must be (C, K, 2, 2) as ONNX stores them; got {w.shape}")
    C, K = w.shape[:2]
    packed = np.ascontiguousarray(w.transpose(2, 3, 1, 0).reshape(4 * K, C))
    if bias is None:
        return packed, None
    if bias.shape != (K,):
        raise InputError(f"convt2x2 bias has shape {bias.shape}; expected ({K},)")
    return packed, np.ascontiguousarray(bias, dtype=np.float32)


CONV3X3_WGMMA = Conv3x3WgmmaSpec(op="conv3x3", stem="conv3x3_wgmma")
SPECS: tuple[KernelSpec, ...] = (*KERNELS.values(), CONV3X3_WGMMA)  # every source under handwritten_ptx/


def spec_for_stem(stem: str) -> KernelSpec | None:
    """The spec of a source stem (``conv3x3_wgmma``), or None."""
    return next((spec for spec in SPECS if spec.stem == stem), None)


def defines_for_stem(stem: str) -> dict[str, int | str]:
    """The ``-D`` macros a source file is compiled with (empty for a stem no spec names)."""
    spec = spec_for_stem(stem)
    return spec.defines() if spec is not None else {}


def ptx_arches_for_stem(stem: str) -> tuple[str, ...]:
    """The PTX arches a source is compiled for (every one of ``arch.PTX_ARCHES`` unless its spec
    says otherwise: conv3x3_wgmma is compute_90a only)."""
    spec = spec_for_stem(stem)
    return spec.ptx_arches if spec is not None else PTX_ARCHES


def choose_conv3x3(
    dtype: Any,
    N: int,
    H: int,
    W: int,
    C: int,
    K: int,
    ldx: int | None = None,
    ldy: int | None = None,
    *,
    wgmma_off: str | None,
    tuned: str | None = None,
    x: int = 0,
    w: int = 0,
    y: int = 0,
) -> ConvChoice:
    """The kernel for one conv3x3 launch, in this order:

    1. the wgmma kernel wherever it is available (``wgmma_off`` is None: a cc 9.0 device whose
       image has it, DUALTRACK_WGMMA not 0) and :meth:`Conv3x3WgmmaSpec.supported` takes the
       launch, with :meth:`Conv3x3WgmmaSpec.choose`'s tile (it never takes C <= SMALL_C_MAX: TMA
       needs C % 8 == 0);
    2. the small-C direct entry for fp16 with C <= :data:`SMALL_C_MAX` (and K <= :data:`SMALL_C_K_MAX`,
       :meth:`Conv3x3Spec.smallc_supported`), even where the layer has a tuned entry: tuning
       searches mma.sync tiles, and for such layers those gather their A tile element by element
       (`dualtrack tune` skips these layers, and builds ignore their records);
    3. the tuned mma.sync entry of the layer (``tuned``, from a `dualtrack tune` file);
    4. :meth:`Conv3x3Spec.variant`.

    A tuned entry never displaces the wgmma kernel: the tuner searches mma.sync tiles only, and the
    wgmma kernel beat cuDNN on every U-Net layer it takes (bench/results/wgmma_check-e477c6d.json).
    """
    why = wgmma_off or CONV3X3_WGMMA.supported(dtype, N, H, W, C, K, ldx, ldy, x=x, w=w, y=y)
    if why is None:
        cfg = CONV3X3_WGMMA.choose(N, H, W, C, K)
        reason = f"{cfg.bm}x{cfg.bn} tile, {cfg.ctas(N, H, W, K)} CTAs"
        return ConvChoice("wgmma", cfg.entry, reason)
    conv = KERNELS["conv3x3"]
    assert isinstance(conv, Conv3x3Spec)
    if conv.smallc_supported(dtype, C, K) is None:
        unused = f"; tuned {tuned.removeprefix(conv.stem + '_')} not used" if tuned else ""
        reason = f"C={C} <= {SMALL_C_MAX}: small-C direct conv{unused}; wgmma: {why}"
        return ConvChoice("direct", conv.smallc_entry, reason)
    impl = "mma.sync" if dtype_name(dtype) == "float16" else "simt"
    if tuned:
        return ConvChoice(impl, tuned, f"tuned (dualtrack tune); wgmma: {why}")
    return ConvChoice(impl, conv.variant(dtype, N, H, W, C, K), f"heuristic; wgmma: {why}")
