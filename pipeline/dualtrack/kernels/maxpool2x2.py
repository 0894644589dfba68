"""maxpool2x2_nhwc: the maxpool2x2 op, one thread per output pixel and 16-byte chunk of channels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.errors import InputError
from dualtrack.kernels.base import INT32_MAX, KernelSpec, LaunchConfig, cdiv, dtype_name, pixels, positive


@dataclass(frozen=True)
class MaxPool2x2Spec(KernelSpec):
    """2x2 max-pool, stride 2: one thread per output pixel and 16-byte chunk of channels."""

    block_threads: int = 256
    CHUNK_BYTES: ClassVar[int] = 16
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "y", "N", "H", "W", "C", "ldx", "ldy")
    POINTERS: ClassVar[int] = 2
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))

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
        positive(N=N, H=H, W=W, C=C)
        if H < 2 or W < 2:
            raise InputError(f"maxpool2x2 needs H, W >= 2; got {H}x{W}")
        return (N, H // 2, W // 2, C)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        _, Ho, Wo, _ = self.output_shape(N, H, W, C)
        pixels(N, H, W, C)
        work = N * Ho * Wo * cdiv(C, self.vector(dtype))
        blocks = cdiv(work, self.block_threads)
        if blocks > INT32_MAX:
            raise InputError(f"maxpool2x2 of {N}x{H}x{W}x{C} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    def reference(self, x: np.ndarray, *_: Any, **__: Any) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C) -> (N,H//2,W//2,C); an odd last row/column is dropped."""
        if x.ndim != 4:
            raise InputError(f"maxpool2x2 takes x (N,H,W,C); got {x.shape}")
        N, Ho, Wo, C = self.output_shape(*x.shape)
        return x[:, : 2 * Ho, : 2 * Wo, :].reshape(N, Ho, 2, Wo, 2, C).max(axis=(2, 4))
