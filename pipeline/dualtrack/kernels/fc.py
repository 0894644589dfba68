"""fc_nhwc: the fc op (a 1x1 convolution on an (N, 1, 1, C) vector: a squeeze-and-excitation FC)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import INT32_MAX, LaunchConfig, cdiv, positive
from dualtrack.kernels.conv import named_weights, pack_conv_weights
from dualtrack.kernels.streaming import StreamingSpec, onnx_weight_bias


@dataclass(frozen=True)
class FcSpec(StreamingSpec):
    """y = act(bias + w @ x) per image on (N, 1, 1, C) -> (N, 1, 1, K): one warp per output.
    Weights ONNX (K, C, 1, 1) as stored, bias fp32. Any C (no shared-memory bound, unlike conv1x1)."""

    MACRO: ClassVar[str] = "FC"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "w", "bias", "y", "N", "C", "K", "ldx", "ldy", "act", "p0", "p1",
    )  # fmt: skip
    POINTERS: ClassVar[int] = 4
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "K"))

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, C=C, K=K)
        if (H, W) != (1, 1):
            raise InputError(f"fc takes a pooled (N, 1, 1, C) vector; got an {H}x{W} image (use conv1x1)")
        return (N, 1, 1, K)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        self.output_shape(N, H, W, C, K)
        blocks = cdiv(N * K, self.threads(dtype) // 32)
        if blocks > INT32_MAX:
            raise InputError(f"fc of {N} x {K} outputs needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The vector's shape checked (no ``H``, ``W``: 1 x 1) and the epilogue ``act, p0, p1``."""
        self.output_shape(kw["N"], 1, 1, kw["C"], kw["K"])
        return self.epilogue(kw)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return named_weights(call, pack_conv_weights(*onnx_weight_bias(call, weights)))

    def reference(
        self, x: np.ndarray, w: np.ndarray | None = None, bias: np.ndarray | None = None, act: Activation | None = None
    ) -> np.ndarray:
        """numpy semantics: ``x`` (N,1,1,C), ``w`` (K,1,1,C) or (K,C); float32 products and sums,
        then bias, then the activation, rounded once to x's dtype."""
        if w is None:
            raise InputError("fc reference needs weights w of shape (K, 1, 1, C)")
        wk = w.reshape(w.shape[0], -1)
        if x.ndim != 4 or x.shape[1:3] != (1, 1) or wk.shape[1] != x.shape[3]:
            raise InputError(f"fc takes x (N,1,1,C) and w (K,1,1,C); got x {x.shape}, w {w.shape}")
        out = x.astype(np.float32) @ wk.astype(np.float32).T
        if bias is not None:
            out += bias.astype(np.float32)
        return (act or Activation()).apply(out).astype(x.dtype)

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"act": Activation.of(call)}
