"""conv1x1_nhwc: the conv1x1 op (a segmentation head), one thread per pixel and output-channel group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dualtrack.errors import InputError
from dualtrack.kernels.base import GRID_Y_MAX, INT32_MAX, LaunchConfig, cdiv, dtype_name, pixels, positive
from dualtrack.kernels.conv import ConvAbi


@dataclass(frozen=True)
class Conv1x1Spec(ConvAbi):
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
        positive(N=N, H=H, W=W, C=C, K=K)
        if self.max_c < C:
            raise InputError(
                f"conv1x1 takes at most {self.max_c} input channels (its weights stay in shared memory); got C={C}"
            )
        return (N, H, W, K)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        self.output_shape(N, H, W, C, K)
        blocks = cdiv(pixels(N, H, W, C), self.block_threads)
        groups = cdiv(K, self.k_group)
        if blocks > INT32_MAX or groups > GRID_Y_MAX:
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
        # One 2-D GEMM over the pixels (a 4-D matmul runs stacked, ~5x slower).
        out = (x.astype(np.float32).reshape(-1, x.shape[3]) @ wk.astype(np.float32).T).reshape(*x.shape[:3], -1)
        if bias is not None:
            if bias.shape != (wk.shape[0],):
                raise InputError(f"bias has shape {bias.shape}; expected ({wk.shape[0]},)")
            out += bias.astype(np.float32)
        if relu:
            np.maximum(out, 0.0, out=out)
        return out.astype(x.dtype)
