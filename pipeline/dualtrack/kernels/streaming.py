"""What the streaming (memory-bound, one thread per output element) kernels share: their block
size macro, their 1-D grid, and their per-call argument list with the activation epilogue last.

dwconv, eltwise and resize launch one thread per output element (pixel x channel, channel
fastest); gap and fc have their own geometry but the same ``-D`` block-size convention.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.errors import InputError
from dualtrack.kernels.base import INT32_MAX, KernelArg, KernelSpec, LaunchConfig, cdiv, dtype_name, pixels
from dualtrack.kernels.epilogue import Activation
from dualtrack.plan import KernelCall


@dataclass(frozen=True)
class StreamingSpec(KernelSpec):
    """A kernel of ``block_threads`` threads a block, compiled with ``-D<MACRO>_THREADS``."""

    block_threads: int = 256
    MACRO: ClassVar[str] = ""
    FLOATS: ClassVar[frozenset[str]] = frozenset({"p0", "p1"})  # float32 scalars of PARAMS

    def defines(self) -> dict[str, int | str]:
        return {f"{self.MACRO}_THREADS": self.block_threads}

    def threads(self, dtype: Any) -> int:
        dtype_name(dtype)
        return self.block_threads

    def element_launch(self, dtype: Any, N: int, H: int, W: int, C: int, ld: int) -> LaunchConfig:
        """One thread per element of an (N, H, W, C) output (channel stride ``ld``)."""
        pixels(N, H, W, ld)
        blocks = cdiv(N * H * W * C, self.threads(dtype))
        if blocks > INT32_MAX:
            raise InputError(f"{self.op} of {N}x{H}x{W}x{C} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    def typed(self, values: Mapping[str, float]) -> list[KernelArg]:
        """Values by name -> the ABI's ordered list (:attr:`PARAMS`): pointers as ``c_void_p``,
        the names in :attr:`FLOATS` as ``c_float``, the rest ``c_int32``."""

        def ctype(i: int, name: str) -> Any:
            return ctypes.c_void_p if i < self.POINTERS else ctypes.c_float if name in self.FLOATS else ctypes.c_int32

        return [
            (float(values[n]) if n in self.FLOATS else int(values[n]), ctype(i, n)) for i, n in enumerate(self.PARAMS)
        ]

    def with_act(self, values: dict[str, int], act: Activation) -> list[KernelArg]:
        """The ABI's list with the activation epilogue (``act, p0, p1``, the last three params)."""
        return self.typed({**values, "act": act.code, "p0": act.p0, "p1": act.p1})


def onnx_weight_bias(call: KernelCall, weights: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """A conv-like call's weight and bias as the plan holds them (ONNX layout; no bias: None)."""
    return weights[call.weights[0]], (weights[call.weights[1]] if len(call.weights) > 1 else None)
