"""Tensor maps (``CUtensorMap``) for Track A's bulk-tensor-copy (TMA) kernels.

A tensor map tells the copy engine where a global tensor lies: base address, up to five dimensions
(innermost first, in elements), the byte strides of dimensions 1 and up, the box one copy moves
into shared memory, the shared-memory swizzle, and what to read outside the tensor (zeros here).
What to encode is computed by pure functions (:class:`TiledMap`, :func:`conv3x3_input`,
:func:`conv3x3_weights`, :func:`encode_args`), checked against the driver's rules first so that a
bad map is an error that names the value, and tested on CPU machines; :func:`encode` is the one
call to ``cuTensorMapEncodeTiled``, through the runtime's checker.

``cuTensorMapEncodeTiled`` only fills 128 host bytes (it launches nothing). The kernel receives
the struct by value (``__grid_constant__``): the driver copies it at launch, and a CUDA graph keeps
its own copy from the capture, so a map must describe the buffer the launch or graph will use.

The conv3x3 wgmma kernel (``handwritten_ptx/conv3x3_wgmma.cu``) reads two maps, both fp16, with
the swizzle of one BK-channel row (BK = 64: 128 bytes, BK = 32: 64 bytes) and zero fill:

- the input, NHWC with pixel stride ``ldx`` (a channel slice of a wider buffer: the address is the
  slice's first channel), as the 4-D tensor (C, W, H, N); box (BK, TW, TH, 1), one spatial tile of
  BK channels. Coordinates outside the image or past C read as zeros: the convolution's padding.
- the packed weights (K, 3, 3, C) as the 2-D tensor (9C, K); box (BK, BN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cuda.bindings import driver as cu

from dualtrack.errors import CudaError, InputError
from dualtrack.kernels import WgmmaConfig
from dualtrack.runtime.driver import call

BOX_MAX = 256  # elements per box dimension
DIM_LIMIT = 1 << 32  # elements per dimension
STRIDE_LIMIT = 1 << 40  # bytes per stride
_DTYPES = {"float16": (2, "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"), "float32": (4, "CU_TENSOR_MAP_DATA_TYPE_FLOAT32")}
_SWIZZLE = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
_L2_PROMOTION = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}


@dataclass(frozen=True)
class TiledMap:
    """The arguments of one ``cuTensorMapEncodeTiled`` call (no interleave, unit element strides,
    out-of-bound elements read as zero)."""

    address: int  # device address of element (0, ..., 0)
    dims: tuple[int, ...]  # elements, innermost first
    strides: tuple[int, ...]  # bytes between consecutive indices of dims[1:]
    box: tuple[int, ...]  # elements one copy moves, per dimension
    swizzle_bytes: int  # shared-memory swizzle span: 0, 32, 64 or 128
    l2_promotion_bytes: int = 0  # 0, 64, 128 or 256
    dtype: str = "float16"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def element_bytes(self) -> int:
        return _DTYPES[self.dtype][0]

    @property
    def box_bytes(self) -> int:
        """Bytes one copy writes to shared memory (out-of-bound elements included: they count
        towards an mbarrier's transaction bytes too)."""
        n = self.element_bytes
        for b in self.box:
            n *= b
        return n

    def describe(self) -> str:
        return f"{self.dtype} dims {self.dims}, strides {self.strides} B, box {self.box}, swizzle {self.swizzle_bytes}"

    def validate(self) -> None:
        """The driver's rules for a tiled map; InputError naming the rule a value breaks."""
        what = f"tensor map ({self.describe()})"
        if self.dtype not in _DTYPES:
            raise InputError(f"{what}: dtype {self.dtype} has no tensor-map type here; use {', '.join(_DTYPES)}")
        if not 1 <= self.rank <= 5:
            raise InputError(f"{what}: rank {self.rank} is outside 1..5")
        if len(self.strides) != self.rank - 1 or len(self.box) != self.rank:
            raise InputError(f"{what}: needs rank-1 = {self.rank - 1} strides and rank = {self.rank} box dims")
        if self.address % 16:
            raise InputError(f"{what}: address {self.address:#x} is not 16-byte aligned")
        for i, d in enumerate(self.dims):
            if not 1 <= d < DIM_LIMIT:
                raise InputError(f"{what}: dim {i} = {d} is outside 1..2^32-1")
        span = self.dims[0] * self.element_bytes
        for i, s in enumerate(self.strides, start=1):
            if s % 16 or not 0 < s < STRIDE_LIMIT:
                raise InputError(f"{what}: stride {i} = {s} bytes is not a positive multiple of 16 below 2^40")
            if s < span:
                raise InputError(f"{what}: stride {i} = {s} bytes is less than the {span} bytes it must span")
            span = s * self.dims[i]
        for i, b in enumerate(self.box):
            if not 1 <= b <= BOX_MAX:
                raise InputError(f"{what}: box dim {i} = {b} is outside 1..{BOX_MAX}")
        inner = self.box[0] * self.element_bytes
        if inner % 16:
            raise InputError(f"{what}: the box's inner dimension is {inner} bytes, not a multiple of 16")
        if self.swizzle_bytes not in _SWIZZLE:
            raise InputError(f"{what}: swizzle {self.swizzle_bytes} is not one of {sorted(_SWIZZLE)}")
        if self.swizzle_bytes and inner > self.swizzle_bytes:
            raise InputError(f"{what}: the box's inner {inner} bytes exceed the {self.swizzle_bytes}-byte swizzle")
        if self.l2_promotion_bytes not in _L2_PROMOTION:
            raise InputError(f"{what}: L2 promotion {self.l2_promotion_bytes} is not one of {sorted(_L2_PROMOTION)}")


def conv3x3_input(cfg: WgmmaConfig, x: int, N: int, H: int, W: int, C: int, ldx: int) -> TiledMap:
    """The input map of the wgmma conv for configuration ``cfg``: x (NHWC, pixel stride ``ldx``
    elements) as (C, W, H, N), box (BK, TW, TH, 1) with ``TW = 2**cfg.tw_log2(W)``; a column-copy
    configuration's box has the two halo rows too, (BK, TW, TH + 2, 1)."""
    tw = 1 << cfg.tw_log2(W)
    item = cfg.ELEMENT_BYTES
    m = TiledMap(
        address=int(x),
        dims=(C, W, H, N),
        strides=(ldx * item, W * ldx * item, H * W * ldx * item),
        box=(cfg.bk, tw, cfg.a_rows // tw, 1),
        swizzle_bytes=cfg.row_bytes,
        l2_promotion_bytes=128,
    )
    m.validate()
    return m


def conv3x3_weights(cfg: WgmmaConfig, w: int, K: int, C: int) -> TiledMap:
    """The weight map of the wgmma conv: packed KRSC weights as the (9C, K) matrix, box (BK, BN).
    A box that runs past a tap's C channels reads the next tap's weights, which multiply the zeros
    the input map supplies past C; past the last tap and past K it reads zeros."""
    m = TiledMap(
        address=int(w),
        dims=(9 * C, K),
        strides=(9 * C * cfg.ELEMENT_BYTES,),
        box=(cfg.bk, cfg.bn),
        swizzle_bytes=cfg.row_bytes,
        l2_promotion_bytes=256,
    )
    m.validate()
    return m


def encode_args(m: TiledMap) -> tuple[Any, ...]:
    """``cuTensorMapEncodeTiled``'s arguments for ``m``, in order (after :meth:`TiledMap.validate`)."""
    m.validate()
    return (
        getattr(cu.CUtensorMapDataType, _DTYPES[m.dtype][1]),
        m.rank,
        m.address,
        [cu.cuuint64_t(d) for d in m.dims],
        [cu.cuuint64_t(s) for s in m.strides],
        [cu.cuuint32_t(b) for b in m.box],
        [cu.cuuint32_t(1)] * m.rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{_SWIZZLE[m.swizzle_bytes]}"),
        getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{_L2_PROMOTION[m.l2_promotion_bytes]}"),
        # NONE: out-of-bound elements read as zero (NAN_REQUEST_ZERO_FMA would read NaN).
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )


def encode(m: TiledMap) -> cu.CUtensorMap:
    """The 128-byte ``CUtensorMap`` for ``m`` (host memory; pass it to a launch as ``(map, None)``).
    A driver refusal is a CudaError that names the map."""
    args = encode_args(m)
    try:
        return call(cu.cuTensorMapEncodeTiled, *args)
    except CudaError as exc:
        raise CudaError(f"cuTensorMapEncodeTiled({m.describe()})", exc.name, exc.explanation) from None
