"""dwconv_nhwc: the dwconv op (depthwise convolution: MobileNet's 3x3/5x5, ConvNeXt's 7x7, the
factorised 1xk / kx1, with a channel multiplier), one thread per output element (fp16: per 8
channels where C and the strides allow), and for fp16 convolutions of dilation 1 and stride 1 or 2 a
tiled entry (``dwconv_nhwc_f16_tile``: :meth:`DwConvSpec.tile_path`) that stages each block's input
patch in shared memory once; a 3x3 window has its own pair of tiled entries too (``_tile3``), whose
registers the 7x7's weights do not set (107 a thread against 214 on sm_90a: twice the blocks an SM), taken
where :attr:`DwConvSpec.tile3` is on (off until measured on a GPU).

Every depthwise Conv is this op's, never the grouped general conv's: with one input channel a group,
the general conv's implicit GEMM would be C GEMMs of depth R*S whose loads are strided 2-byte reads
(one input channel a grid layer), where this kernel's warps read neighbouring channels of a pixel
together. The work is R*S FMAs per output element. The per-element paths read each tap through L1, one after
another, and were latency-bound on the H100 (ConvNeXt-tiny's 18 depthwise 7x7 layers: 1.81 ms at batch
8, ten times their bytes' time); the tiled entry loads a block's whole patch at once and feeds the FMAs
from shared memory (handwritten_ptx/dwconv_nhwc.cu says how). 3x3 kernels (stride 1 or 2) take
the column entries (``dwconv_nhwc_f16_cols``: :meth:`DwConvSpec.cols_path`) instead, where
:attr:`DwConvSpec.cols` is on (off: slower than the tiles at N=8 on every layer measured), which keep a
thread's 8 channels and its 9 weights in registers and read each input row once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    DeviceTensor,
    LaunchConfig,
    LaunchContext,
    PreparedCall,
    Tensors,
    cdiv,
    dtype_name,
    positive,
)
from dualtrack.kernels.conv import named_weights
from dualtrack.kernels.device import DeviceInfo
from dualtrack.kernels.streaming import ElementSpec, onnx_weight_bias

MAX_KERNEL = 7  # R and S: ConvNeXt's 7x7 is the largest depthwise kernel of the networks served
TILE_STRIDES = (1, 2)  # the tiled entries' strides, the same both ways (dwconv_nhwc.cu's dwconv_tile_any)
UNROLLED = (3, 5)  # the square kernels the source unrolls (dwconv_any); the others loop


@dataclass(frozen=True)
class DwGeometry:
    """The convolution's shape attributes as ONNX writes them: kernel R x S, strides, dilations,
    pads (top, left, bottom, right) and the channel multiplier (K = multiplier * C). ``S``,
    ``stride_w`` and ``dil_w`` default to ``R``, ``stride`` and ``dilation`` (a square window)."""

    R: int = 3
    stride: int = 1
    dilation: int = 1
    pads: tuple[int, int, int, int] = (1, 1, 1, 1)
    S: int | None = None
    stride_w: int | None = None
    dil_w: int | None = None
    multiplier: int = 1

    def __post_init__(self) -> None:
        for name, same in (("S", self.R), ("stride_w", self.stride), ("dil_w", self.dilation)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, same)
        if not (1 <= self.R <= MAX_KERNEL and 1 <= self.width <= MAX_KERNEL):
            raise InputError(f"dwconv takes kernels of 1..{MAX_KERNEL} a side; got {self.R}x{self.width}")
        positive(stride=self.stride, dilation=self.dilation, multiplier=self.multiplier)
        positive(stride_w=self.stride_w, dil_w=self.dil_w)
        if min(self.pads) < 0:
            raise InputError(f"dwconv pads {self.pads} must be >= 0")

    @property
    def width(self) -> int:
        """S, resolved (the kernel's columns)."""
        assert self.S is not None  # __post_init__ resolves it
        return self.S

    @classmethod
    def of(cls, call: KernelCall) -> DwGeometry:
        """A call's attributes; ``S``, ``stride_w``, ``dil_w`` (0: absent) and ``multiplier``
        (default 1) where the lowering wrote them."""
        a = call.attr
        pads = (a("pad_t"), a("pad_l"), a("pad_b"), a("pad_r"))
        wide = {k: a(k) or None for k in ("S", "stride_w", "dil_w")}
        return cls(a("R"), a("stride"), a("dilation"), pads, **wide, multiplier=a("multiplier", 1))

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The geometry as :class:`KernelCall` attributes (what :meth:`of` reads)."""
        t, left, b, r = self.pads
        return (
            ("R", self.R), ("stride", self.stride), ("dilation", self.dilation),
            ("pad_t", t), ("pad_l", left), ("pad_b", b), ("pad_r", r),
            ("S", self.width), ("stride_w", int(self.stride_w or 0)), ("dil_w", int(self.dil_w or 0)),
            ("multiplier", self.multiplier),
        )  # fmt: skip

    def output_hw(self, H: int, W: int) -> tuple[int, int]:
        t, left, b, r = self.pads
        sw, dw = int(self.stride_w or 0), int(self.dil_w or 0)
        Ho = (H + t + b - self.dilation * (self.R - 1) - 1) // self.stride + 1
        Wo = (W + left + r - dw * (self.width - 1) - 1) // sw + 1
        if Ho < 1 or Wo < 1:
            raise InputError(f"dwconv {self} of a {H}x{W} image has no output pixel")
        return Ho, Wo


@dataclass(frozen=True)
class DwConvSpec(ElementSpec):
    """Depthwise R x S convolution (1..7 a side; any strides, dilations, padding and channel
    multiplier), bias and an activation fused. Weights: ONNX (K, 1, R, S) packed RSK
    (:meth:`pack`), bias fp32. ``C`` is the input's channels, the output has ``multiplier * C``."""

    MACRO: ClassVar[str] = "DWCONV"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "w", "bias", "y", "N", "H", "W", "C", "Ho", "Wo", "ldx", "ldy",
        "R", "S", "sh", "sw", "dh", "dw", "pt", "pl", "M", "act", "p0", "p1",
    )  # fmt: skip
    F16_LANES: ClassVar[int] = 8  # the fp16 vector path: one 16-byte access
    POINTERS: ClassVar[int] = 4
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))  # ldy: K, arg_values
    SHAPE_ATTRS: ClassVar[tuple[str, ...]] = ("geometry",)
    # Output pixels of one row a work item of the row path computes (dwconv_nhwc.cu's dwconv_rows, -DDW_ROW).
    row_outputs: int = 4
    # The tiled entries (-DDW_TILE_*): a block computes tile_h (``_tile``) or tile_h_short
    # (``_tile_short``) x tile_w output pixels x tile_c channels with tile_threads threads, a thread
    # tile_b outputs of one row for two channels; at stride 2 half the rows (:meth:`tile_rows`: a patch
    # of about the stride-1 rows, twice as wide). Its input patch, ((rows - 1) * stride + R) x
    # ((tile_w - 1) * stride + S) pixels x tile_c fp32 (:meth:`tile_launch`), is 62 KiB for the tall
    # tile of a stride-1 7x7 and 97 KiB for a stride-2 one (the runtime opts in above 48 KiB).
    tile_h: int = 16
    tile_h_short: int = 8
    tile_w: int = 16
    tile_c: int = 32
    tile_b: int = 8
    tile_threads: int = 128
    # The tall tile where its blocks fill the GPU this many times over (resident blocks a SM: the
    # tile_per_sm the threshold was set with on the H100, fewer where the SM's shared memory holds fewer
    # patches: :meth:`tile_resident`); below, the short one's twice as many blocks.
    tall_waves: int = 2
    tile_per_sm: int = 3
    # The 3x3 entries' (``_tile3``: the one window alone, its own registers; dwconv_nhwc.cu): four
    # 128-thread blocks of the tall one's 107 registers fit a Hopper SM's 64 K (ptxas, sm_90a; the
    # general tall entry takes 214, the 7x7's weights, two blocks), and four of its 3x3 patches (42 KiB).
    tile3_per_sm: int = 4
    # Whether tile_choice sends a 3x3 to the 3x3 entries (off: the general ones, which hold a 3x3 instance too).
    # Off until they have run on a GPU (tests/gpu/test_mobile_gpu.py::test_dwconv_tile_kernel launches them;
    # bench/mobile_layers.py --dw-tile3 and bench/zoo_bench.py --dwconv-tile3 time them beside the general ones).
    tile3: bool = False
    # The column entries (-DDW_COLS_*, 3x3 only): a thread cols_h (``_cols``) or cols_h_short
    # (``_cols_short``) output rows of one column for 8 channels, a block at most cols_threads threads
    # (:meth:`cols_launch`); half the rows at stride 2. The tall entry where its blocks fill the GPU
    # ``tall_waves`` times with cols_per_sm blocks a SM, else the short one.
    cols_h: int = 8
    cols_h_short: int = 2
    cols_threads: int = 256
    cols_per_sm: int = 2
    cols_min_blocks: int = 1  # __launch_bounds__' second argument: ptxas keeps registers to fit this many a SM
    # Whether prepare_inputs launches them. Off: correct on the GPU (tests/gpu/test_mobile_gpu.py), but slower
    # than the tiles at N=8 on every layer of bench/mobile_layers.py (SegFormer-b2's stage-1 3x3: 206 us
    # against 128, H100, mobile_layers-9062b2d-s18dwcols-h100.json) and through Engine.run (SegFormer-b2 N=8
    # 5.94 ms against 5.73); faster only on some N=1 maps of 16-32 pixels. bench/mobile_layers.py and
    # zoo_bench.py --dwconv-cols time them.
    cols: bool = False

    def defines(self) -> dict[str, int | str]:
        tile = {"DW_TILE_H": self.tile_h, "DW_TILE_H_SHORT": self.tile_h_short, "DW_TILE_W": self.tile_w}
        tile |= {"DW_TILE_C": self.tile_c, "DW_TILE_B": self.tile_b, "DW_TILE_THREADS": self.tile_threads}
        cols = {"DW_COLS_H": self.cols_h, "DW_COLS_H_SHORT": self.cols_h_short, "DW_COLS_THREADS": self.cols_threads}
        cols["DW_COLS_MIN_BLOCKS"] = self.cols_min_blocks
        return {**super().defines(), "DW_ROW": self.row_outputs, **tile, **cols}

    @property
    def tile_entry(self) -> str:
        return f"{self.stem}_f16_tile"

    @property
    def tile_short_entry(self) -> str:
        return f"{self.stem}_f16_tile_short"

    @property
    def tile3_entry(self) -> str:
        return f"{self.stem}_f16_tile3"

    @property
    def tile3_short_entry(self) -> str:
        return f"{self.stem}_f16_tile3_short"

    @property
    def cols_entry(self) -> str:
        return f"{self.stem}_f16_cols"

    @property
    def cols_short_entry(self) -> str:
        return f"{self.stem}_f16_cols_short"

    @property
    def entries(self) -> tuple[str, ...]:
        tiles = (self.tile_entry, self.tile_short_entry, self.tile3_entry, self.tile3_short_entry)
        return (*super().entries, *tiles, self.cols_entry, self.cols_short_entry)

    def cols_path(self, dtype: Any, g: DwGeometry, C: int, *strides: int) -> bool:
        """Whether the column entries take a launch (dwconv_nhwc.cu's dwconv_cols_any): fp16, a 3x3
        kernel, no channel multiplier, dilation 1 and stride 1 or 2, the same both ways, and C and
        every channel stride multiples of 8 (16-byte loads; the pointers must be 16-byte aligned too,
        which :meth:`prepare_inputs` checks)."""
        square3 = (g.R, g.width) == (3, 3)
        stride = g.stride == g.stride_w and g.stride in TILE_STRIDES
        unit = (g.dilation, g.dil_w) == (1, 1)
        vec = all(v % 8 == 0 for v in (C, *strides))
        return (
            self.cols and dtype_name(dtype) == "float16" and g.multiplier == 1 and square3 and stride and unit and vec
        )

    def cols_rows(self, stride: int, short: bool = False) -> int:
        """Output rows a thread of a column entry computes at ``stride`` (dwconv_cols_any's TH / SD)."""
        return (self.cols_h_short if short else self.cols_h) // stride

    def cols_launch(self, N: int, Ho: int, Wo: int, C: int, g: DwGeometry, short: bool = False) -> LaunchConfig:
        """A column entry's grid: (column strips x row tiles x N, channel blocks); its block (vectors,
        columns): the channels' 8-wide vectors split into the fewest blocks of at most 32 (a warp reads
        one pixel's channels, or several whole pixels), as many columns as :attr:`cols_threads` allows."""
        positive(N=N, Ho=Ho, Wo=Wo, C=C)
        vectors = cdiv(C, 8)
        blocks_c = cdiv(vectors, 32)
        per_block = cdiv(vectors, blocks_c)
        cols = max(1, min(self.cols_threads // per_block, Wo))
        rows = self.cols_rows(g.stride, short)
        return LaunchConfig(grid=(N * cdiv(Ho, rows) * cdiv(Wo, cols), blocks_c, 1), block=(per_block, cols, 1))

    def cols_choice(
        self, N: int, Ho: int, Wo: int, C: int, g: DwGeometry, device: DeviceInfo
    ) -> tuple[str, LaunchConfig]:
        """The column entry for a launch on ``device``: the tall one where its blocks make
        :attr:`tall_waves` full waves of :attr:`cols_per_sm` a SM, else the short one."""
        tall = self.cols_launch(N, Ho, Wo, C, g)
        if tall.grid[0] * tall.grid[1] >= self.tall_waves * device.full_wave(self.cols_per_sm):
            return self.cols_entry, tall
        return self.cols_short_entry, self.cols_launch(N, Ho, Wo, C, g, short=True)

    def tile_path(self, dtype: Any, g: DwGeometry, C: int, *strides: int) -> bool:
        """Whether the tiled entries take a launch (dwconv_nhwc.cu's dwconv_tile_any): fp16, no
        channel multiplier, dilation 1 and stride 1 or 2 (:data:`TILE_STRIDES`), the same both ways,
        at least :attr:`tile_c` channels, and C and every channel stride multiples of 8 (16-byte patch
        loads; the pointers must be 16-byte aligned too, which :meth:`prepare_inputs` checks)."""
        stride = g.stride == g.stride_w and g.stride in TILE_STRIDES
        unit = (g.dilation, g.dil_w) == (1, 1)
        vec = all(v % 8 == 0 for v in (C, *strides))
        # Fewer channels than a block's tile_c leave threads idle: MobileNetV3's 16-channel 3x3 at
        # 256x256 took 58 us at N=8 tiled, 38 per element (H100, mobile_layers-80dcaa6-h100.json).
        wide = self.tile_c <= C
        return dtype_name(dtype) == "float16" and g.multiplier == 1 and stride and unit and vec and wide

    def tile_rows(self, stride: int, short: bool = False) -> int:
        """Output rows of a tiled entry's block at ``stride`` (dwconv_tile_any's TH / SD): half at
        stride 2, whose patch is twice as wide, so that a 7x7's tall patch (97 KiB) still leaves two
        blocks a Hopper SM and fits sm_120's 99 KiB a block."""
        return (self.tile_h_short if short else self.tile_h) // stride

    def tile_launch(self, N: int, Ho: int, Wo: int, C: int, g: DwGeometry, short: bool = False) -> LaunchConfig:
        """A tiled entry's grid: (output tiles of every image, channel blocks), its patch in shared
        memory; ``short``: ``_tile_short``'s."""
        positive(N=N, Ho=Ho, Wo=Wo, C=C)
        rows, sd = self.tile_rows(g.stride, short), g.stride
        patch = ((rows - 1) * sd + g.R) * ((self.tile_w - 1) * sd + g.width) * self.tile_c * 4
        tiles = N * cdiv(Ho, rows) * cdiv(Wo, self.tile_w)
        return LaunchConfig(grid=(tiles, cdiv(C, self.tile_c), 1), block=(self.tile_threads, 1, 1), shared_bytes=patch)

    @staticmethod
    def square3(g: DwGeometry) -> bool:
        """Whether ``g``'s window is the one the 3x3 tiled entries are compiled for."""
        return (g.R, g.width) == (3, 3)

    def tile_resident(self, launch: LaunchConfig, device: DeviceInfo, square3: bool = False) -> int:
        """Blocks of a tiled launch an SM of ``device`` holds at once: :attr:`tile_per_sm` (the 3x3
        entries' :attr:`tile3_per_sm`), or fewer where its shared memory (less the 1 KiB the system
        reserves a block) holds fewer patches; 0 where one patch is over what a block may opt in to."""
        if launch.shared_bytes > device.shared_per_block:
            return 0
        per_sm = self.tile3_per_sm if square3 else self.tile_per_sm
        return min(per_sm, device.shared_per_sm // (launch.shared_bytes + 1024))

    def tile_choice(
        self, N: int, Ho: int, Wo: int, C: int, g: DwGeometry, device: DeviceInfo
    ) -> tuple[str, LaunchConfig]:
        """The tiled entry for a launch on ``device`` and its geometry: the tall tile where its
        blocks make :attr:`tall_waves` full waves of :meth:`tile_resident` a SM, else the short one
        (whose patch :meth:`prepare_inputs` still checks against the device's limit). Where
        :attr:`tile3` is on, a 3x3 window (:meth:`square3`) takes the 3x3 entries (``_tile3``,
        ``_tile3_short``); every other window takes the general ones."""
        square3 = self.tile3 and self.square3(g)
        tall = self.tile_launch(N, Ho, Wo, C, g)
        resident = self.tile_resident(tall, device, square3)
        if resident and tall.grid[0] * tall.grid[1] >= self.tall_waves * device.full_wave(resident):
            return (self.tile3_entry if square3 else self.tile_entry), tall
        short = self.tile3_short_entry if square3 else self.tile_short_entry
        return short, self.tile_launch(N, Ho, Wo, C, g, short=True)

    @staticmethod
    def row_path(g: DwGeometry) -> bool:
        """Whether the kernel's row path takes the launch (dwconv_nhwc.cu's ``dwconv_row_path``): a
        square 3, 5 or 7 kernel, stride and dilation 1 along W, no channel multiplier."""
        return g.multiplier == 1 and g.width == g.R and g.R in (3, 5, 7) and g.stride_w == 1 and g.dil_w == 1

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, geometry: DwGeometry | None = None
    ) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        g = geometry or DwGeometry()
        if K not in (0, g.multiplier * C):
            raise InputError(
                f"a depthwise convolution of channel multiplier {g.multiplier} has K = {g.multiplier}*C: C={C}, K={K}"
            )
        return (N, *g.output_hw(H, W), g.multiplier * C)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """``Ho, Wo`` of the output, ``R, S, sh, sw, dh, dw, pt, pl, M`` of the ``geometry`` (a
        :class:`DwGeometry`) and the epilogue ``act, p0, p1``."""
        g: DwGeometry = kw["geometry"]
        _, Ho, Wo, K = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, g)
        if kw["ldy"] < K:
            raise InputError(f"ldy={kw['ldy']} is smaller than the {K} output channels it must hold; use ldy >= {K}")
        geometry = {
            "R": g.R, "S": g.width, "sh": g.stride, "sw": g.stride_w, "dh": g.dilation, "dw": g.dil_w,
            "pt": g.pads[0], "pl": g.pads[1], "M": g.multiplier,
        }  # fmt: skip
        return {"Ho": Ho, "Wo": Wo, **geometry, **self.epilogue(kw)}

    @staticmethod
    def pack(w: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """ONNX depthwise weights (K, 1, R, S) -> RSK (R, S, K) in the same dtype; bias -> fp32."""
        if w.ndim != 4 or w.shape[1] != 1:
            raise InputError(f"depthwise weights must be (K, 1, R, S) as ONNX stores them; got {w.shape}")
        packed = np.ascontiguousarray(w[:, 0].transpose(1, 2, 0))
        if bias is None:
            return packed, None
        if bias.shape != (w.shape[0],):
            raise InputError(f"dwconv bias has shape {bias.shape}; expected ({w.shape[0]},)")
        return packed, np.ascontiguousarray(bias, dtype=np.float32)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return named_weights(call, self.pack(*onnx_weight_bias(call, weights)))

    def reference(
        self,
        x: np.ndarray,
        w: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        geometry: DwGeometry | None = None,
        act: Activation | None = None,
    ) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C), ``w`` (R,S,K) packed (K = multiplier * C; output
        channel k reads input channel k // multiplier), ``bias`` (K,) or None; float32 products and
        sums, then bias, then the activation, rounded once to x's dtype."""
        g = geometry or DwGeometry()
        K = g.multiplier * x.shape[-1]
        if w is None or x.ndim != 4 or w.shape != (g.R, g.width, K):
            raise InputError(
                f"dwconv takes x (N,H,W,C) and w (R,S,K) = ({g.R},{g.width},{K}); got x {x.shape}, "
                f"w {getattr(w, 'shape', None)}"
            )
        N, H, W, _ = x.shape
        Ho, Wo = g.output_hw(H, W)
        t, left, b, r = g.pads
        xp = np.repeat(np.pad(x.astype(np.float32), ((0, 0), (t, b), (left, r), (0, 0))), g.multiplier, axis=3)
        out = np.zeros((N, Ho, Wo, K), np.float32)
        sh, sw, dh, dw = g.stride, int(g.stride_w or 0), g.dilation, int(g.dil_w or 0)
        for i in range(g.R):
            for j in range(g.width):
                tap = xp[:, i * dh : i * dh + sh * (Ho - 1) + 1 : sh, j * dw : j * dw + sw * (Wo - 1) + 1 : sw, :]
                out += tap * w[i, j].astype(np.float32)
        if bias is not None:
            out += bias.astype(np.float32)
        return (act or Activation()).apply(out).astype(x.dtype)

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"geometry": DwGeometry.of(call), "act": Activation.of(call)}

    def call_launch(self, dtype: Any, kw: Mapping[str, Any]) -> LaunchConfig:
        """:class:`ElementSpec`'s grid, with one channel an item under a channel multiplier (the
        kernel's vector path takes M = 1 only), and items of :attr:`row_outputs` pixels on the row path."""
        g: DwGeometry = kw["geometry"]
        if self.row_path(g):  # a work item is row_outputs pixels of one row
            n, ho, wo, k = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], g)
            return self.output_launch(dtype, (n, ho, cdiv(wo, self.row_outputs), k), kw["ldy"], kw["ldx"])
        if g.multiplier == 1:
            return super().call_launch(dtype, kw)
        out = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], g)
        return self.element_launch(dtype, *out, kw["ldy"])

    def prepare_inputs(
        self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        """A column entry (:meth:`cols_choice`) where :meth:`cols_path` holds and x, y and the packed
        weights are 16-byte aligned; else a tiled entry (:meth:`tile_choice`) where :meth:`tile_path`
        holds, they are aligned and the chosen patch fits the device's shared memory a block; else the
        per-element entry of the dtype."""
        kw = self.call_args(call, inputs, y, weights)
        x = inputs[0]
        g: DwGeometry = kw["geometry"]
        aligned = all(v % 16 == 0 for v in (kw["x"], kw["y"], kw["w"]))
        if aligned and self.cols_path(x.dtype, g, kw["C"], kw["ldx"], kw["ldy"]):
            entry, launch = self.cols_choice(kw["N"], *tuple(y.shape)[1:3], kw["C"], g, ctx.device)
            return PreparedCall(entry, launch, self.args(**kw))
        if aligned and self.tile_path(x.dtype, g, kw["C"], kw["ldx"], kw["ldy"]):
            entry, launch = self.tile_choice(kw["N"], *tuple(y.shape)[1:3], kw["C"], g, ctx.device)
            if self.tile_resident(launch, ctx.device):
                return PreparedCall(entry, launch, self.args(**kw))
        return PreparedCall(self.entry(x.dtype), self.call_launch(x.dtype, kw), self.args(**kw))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The NHWC keyword arguments, the packed weights and bias, the geometry and the epilogue;
        ``y`` must have the convolution's output shape."""
        kw = {
            **super().call_args(call, inputs, y, weights),
            "geometry": DwGeometry.of(call),
            "act": Activation.of(call),
        }
        expect = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, kw["geometry"])
        if tuple(y.shape) != expect:
            raise InputError(f"dwconv {call.nodes}: output {y.shape} is not {expect}")
        return kw
