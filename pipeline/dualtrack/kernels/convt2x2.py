"""convt2x2_nhwc: the convt2x2 op (ONNX ConvTranspose, 2x2 kernel, stride 2) as one GEMM.

Its argument list is the conv one without ``relu``; its weights are packed to (4K, C)
(:func:`pack_convt_weights`) so that each GEMM column is one (tap, output channel).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import INT32_MAX, LaunchConfig, cdiv, dtype_name, pixels, positive
from dualtrack.kernels.conv import ConvAbi, GemmTiles, named_weights


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


@dataclass(frozen=True)
class ConvT2x2Spec(ConvAbi, GemmTiles):
    """2x2 transposed convolution, stride 2, no padding, group 1 (ONNX ConvTranspose), bias fused.

    With the packed weights (:func:`pack_convt_weights`, shape (4K, C)) this is a GEMM of the
    N*H*W input pixels by the 4K (tap, channel) columns, each column scattered to its output pixel.
    A block computes a ``bm x bn`` tile of it (input pixels x columns ``t*K + k``, which may span
    taps); the grid is 1-D, the ``ceil(4K / bn)`` column tiles fastest, then the pixel tiles.
    fp16: tensor cores, ``32 * f16_warps_m * f16_warps_n`` threads, ``f16_bk``-deep cp.async stages.
    fp32: SIMT, ``f32_tm x f32_tn`` outputs a thread.
    """

    # The conv argument list without relu (ConvAbi.args drops what PARAMS does not name).
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "w", "bias", "y", "N", "H", "W", "C", "K", "ldx", "ldy")
    TAPS: ClassVar[int] = 4
    MACRO_PREFIX: ClassVar[str] = "CONVT"

    def defines(self) -> dict[str, int | str]:
        return self.tile_defines()

    def tile(self, dtype: Any) -> tuple[int, int]:
        """(input pixels, output channels of one tap) computed by one block."""
        return self.gemm_tile(dtype_name(dtype))

    def threads(self, dtype: Any) -> int:
        return self.gemm_threads(dtype_name(dtype))

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C, K=K)
        return (N, 2 * H, 2 * W, K)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        """One block per (pixel tile, tile of the 4K GEMM columns) on a 1-D grid, the column tile
        fastest: the blocks in flight together read one tile of the input, which then comes from
        DRAM once (handwritten_ptx/convt2x2_nhwc.cu)."""
        positive(N=N, H=H, W=W, C=C, K=K)
        M = pixels(N, H, W, C)
        bm, bn = self.tile(dtype)
        blocks = cdiv(M, bm) * cdiv(self.TAPS * K, bn)
        if blocks > INT32_MAX:
            raise InputError(f"convt2x2 of {N}x{H}x{W}x{C} -> {K} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.threads(dtype), 1, 1), shared_bytes=0)

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
        # (N,H,W,4K), column (i*2+j)*K + k; one 2-D GEMM (a 4-D matmul runs stacked, ~5x slower)
        cols = (x.astype(np.float32).reshape(-1, x.shape[3]) @ wp.astype(np.float32).T).reshape(N, H, W, 4 * K)
        out = cols.reshape(N, H, W, 2, 2, K).transpose(0, 1, 3, 2, 4, 5).reshape(N, 2 * H, 2 * W, K)
        if bias is not None:
            if bias.shape != (K,):
                raise InputError(f"bias has shape {bias.shape}; expected ({K},)")
            out = out + bias.astype(np.float32)
        return out.astype(x.dtype)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        bias = weights[call.weights[1]] if len(call.weights) > 1 else None
        return named_weights(call, pack_convt_weights(weights[call.weights[0]], bias))
