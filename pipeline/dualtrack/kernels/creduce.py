"""creduce_nhwc: the creduce op (an ONNX Reduce op of REDUCE_OPS over the channels of each pixel,
keepdims: CBAM's spatial-attention pools)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import REDUCE_OPS, KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import reduce_ops
from dualtrack.kernels.base import LaunchConfig, positive
from dualtrack.kernels.streaming import StreamingSpec


@dataclass(frozen=True)
class CReduceSpec(StreamingSpec):
    """(N, H, W, C) -> (N, H, W, 1): one value a pixel over its C channels, in fp32, rounded once (the
    mean divides the sum by C once). A thread per pixel, grid-stride; the output may be one channel of a
    wider tensor (``ldy``: a Concat's slice)."""

    MACRO: ClassVar[str] = "CREDUCE"
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "y", "N", "H", "W", "C", "ldx", "ldy", "op")
    POINTERS: ClassVar[int] = 2
    FLOATS: ClassVar[frozenset[str]] = frozenset()
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "K"))

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        return (N, H, W, 1)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        self.output_shape(N, H, W, C)
        return self.element_launch(dtype, N, H, W, 1, 1)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        self.checked_output({**kw, "K": 1})
        reduce_ops.checked(kw["op"], "creduce")
        return {}

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"op": call.attr("op")}

    def reference(self, x: np.ndarray, *_: Any, op: int = REDUCE_OPS["ReduceMean"], **__: Any) -> np.ndarray:
        """numpy semantics: ``op`` over axis 3 (keepdims) in float32, rounded once to x's dtype
        (:func:`reduce_ops.reduce`)."""
        if x.ndim != 4:
            raise InputError(f"creduce takes x (N,H,W,C); got {x.shape}")
        return reduce_ops.reduce(x, (3,), op, "creduce")
