"""Encoding tensor maps (``CUtensorMap``) for Track A's bulk-tensor-copy (TMA) kernels.

A kernel's spec describes its maps as data (``kernels/tensormap.py``'s :class:`TiledMap`, checked
against the driver's rules on any machine); :func:`encode_args` turns one into the arguments of
``cuTensorMapEncodeTiled`` and :func:`encode` is the one call to it, through the runtime's checker.

``cuTensorMapEncodeTiled`` only fills 128 host bytes (it launches nothing). The kernel receives
the struct by value (``__grid_constant__``): the driver copies it at launch, and a CUDA graph keeps
its own copy from the capture, so a map must describe the buffer the launch or graph will use.

cuda.core 1.2 has ``StridedMemoryView.as_tensor_map``; it is not used here because it builds the
map from a view's shape and strides, while the conv maps reinterpret the tensor (the weights as a
(9C, K) matrix, the input with a halo box) and need exact control of box, swizzle and L2 promotion.
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu

from dualtrack.errors import CudaError
from dualtrack.kernels.tensormap import DTYPES, L2_PROMOTION, SWIZZLE, TiledMap
from dualtrack.runtime.driver import call


def encode_args(m: TiledMap) -> tuple[Any, ...]:
    """``cuTensorMapEncodeTiled``'s arguments for ``m``, in order (after :meth:`TiledMap.validate`)."""
    m.validate()
    return (
        getattr(cu.CUtensorMapDataType, DTYPES[m.dtype][1]),
        m.rank,
        m.address,
        [cu.cuuint64_t(d) for d in m.dims],
        [cu.cuuint64_t(s) for s in m.strides],
        [cu.cuuint32_t(b) for b in m.box],
        [cu.cuuint32_t(1)] * m.rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{SWIZZLE[m.swizzle_bytes]}"),
        getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{L2_PROMOTION[m.l2_promotion_bytes]}"),
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
