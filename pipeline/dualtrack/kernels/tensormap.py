"""Tensor maps as data: what one ``cuTensorMapEncodeTiled`` call encodes, checked against the driver's rules.

A tensor map tells the copy engine where a global tensor lies: base address, up to five dimensions
(innermost first, in elements), the byte strides of dimensions 1 and up, the box one copy moves
into shared memory, the shared-memory swizzle, and what to read outside the tensor (zeros here).
A TMA kernel's spec describes its maps as :class:`TiledMap` values (pure, tested on CPU machines);
the runtime encodes them (``runtime/tma.py``, the one call to the driver).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualtrack.errors import InputError

BOX_MAX = 256  # elements per box dimension
DIM_LIMIT = 1 << 32  # elements per dimension
STRIDE_LIMIT = 1 << 40  # bytes per stride
# dtype -> (element bytes, CUtensorMapDataType member)
DTYPES = {
    "float16": (2, "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"),
    "float32": (4, "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"),
    "uint8": (1, "CU_TENSOR_MAP_DATA_TYPE_UINT8"),  # e4m3 bytes (the conv_fp8 rows): TMA only moves them
}
SWIZZLE = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
L2_PROMOTION = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}


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
        return DTYPES[self.dtype][0]

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
        if self.dtype not in DTYPES:
            raise InputError(f"{what}: dtype {self.dtype} has no tensor-map type here; use {', '.join(DTYPES)}")
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
        if self.swizzle_bytes not in SWIZZLE:
            raise InputError(f"{what}: swizzle {self.swizzle_bytes} is not one of {sorted(SWIZZLE)}")
        if self.swizzle_bytes and inner > self.swizzle_bytes:
            raise InputError(f"{what}: the box's inner {inner} bytes exceed the {self.swizzle_bytes}-byte swizzle")
        if self.l2_promotion_bytes not in L2_PROMOTION:
            raise InputError(f"{what}: L2 promotion {self.l2_promotion_bytes} is not one of {sorted(L2_PROMOTION)}")
