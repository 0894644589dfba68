"""gap_nhwc: the gap op (a reduction over each image's pixels: ONNX GlobalAveragePool, or a Reduce op of
REDUCE_OPS over H, W with keepdims)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import REDUCE_OPS, KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import reduce_ops
from dualtrack.kernels.base import GRID_Y_MAX, LaunchConfig, cdiv, positive
from dualtrack.kernels.streaming import StreamingSpec

LANES = 32  # channels a block owns (gap_nhwc.cu: one warp's width)


@dataclass(frozen=True)
class GapSpec(StreamingSpec):
    """(N, H, W, C) -> (N, 1, 1, C): ``op`` over the image (the mean by default; :mod:`reduce_ops`), in
    fp32, one rounding. A block per
    image and group of 32 channels; ``block_threads / 32`` pixel rows share the image (fp16 with
    C and ldx multiples of 8: ``block_threads / 4`` rows of 16-byte loads). 1024 threads: at N=1 an
    SE block's pool has a handful of blocks (C=72: 3), so each needs as many loads in flight as a
    block can hold."""

    block_threads: int = 1024

    MACRO: ClassVar[str] = "GAP"
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "y", "N", "H", "W", "C", "ldx", "ldy", "op")
    POINTERS: ClassVar[int] = 2
    FLOATS: ClassVar[frozenset[str]] = frozenset()
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        return (N, 1, 1, C)

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        self.output_shape(N, H, W, C)
        if N > GRID_Y_MAX:
            raise InputError(f"gap of a batch of {N} needs {N} grid rows; the grid allows {GRID_Y_MAX}")
        return LaunchConfig(grid=(cdiv(C, LANES), N, 1), block=(self.threads(dtype), 1, 1), shared_bytes=0)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The mean unless ``op`` says otherwise."""
        self.checked_output(kw)
        op = kw.get("op", REDUCE_OPS["ReduceMean"])
        reduce_ops.checked(op, "gap")
        return {"op": op}

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"op": call.attr("op", REDUCE_OPS["ReduceMean"])}

    def reference(self, x: np.ndarray, *_: Any, op: int = REDUCE_OPS["ReduceMean"], **__: Any) -> np.ndarray:
        """numpy semantics: ``op`` over axes 1, 2 (keepdims) in float32, rounded once to x's dtype
        (:func:`reduce_ops.reduce`)."""
        if x.ndim != 4:
            raise InputError(f"gap takes x (N,H,W,C); got {x.shape}")
        return reduce_ops.reduce(x, (1, 2), op, "gap")
