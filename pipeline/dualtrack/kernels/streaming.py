"""What the streaming (memory-bound) kernels share: their block size macro, their typed argument
list with the activation epilogue last, and (:class:`ElementSpec`) the 1-D grid of one thread per
output element.

dwconv and eltwise launch one thread per output element (pixel x channel, channel fastest; their
fp16 entries one per 8 channels where they can); resize, gap and fc have their own geometry but the
same ``-D`` block-size convention.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import INT32_MAX, KernelSpec, LaunchConfig, cdiv, dtype_name, pixels


@dataclass(frozen=True)
class StreamingSpec(KernelSpec):
    """A kernel of ``block_threads`` threads a block, compiled with ``-D<MACRO>_THREADS``; its
    float parameters are an activation epilogue's (:meth:`epilogue`) unless it says otherwise."""

    block_threads: int = 256
    MACRO: ClassVar[str] = ""
    FLOATS: ClassVar[frozenset[str]] = frozenset({"p0", "p1"})  # float32 scalars of PARAMS

    def defines(self) -> dict[str, int | str]:
        return {f"{self.MACRO}_THREADS": self.block_threads}

    def threads(self, dtype: Any) -> int:
        dtype_name(dtype)
        return self.block_threads

    def element_launch(self, dtype: Any, N: int, H: int, W: int, C: int, ld: int, lanes: int = 1) -> LaunchConfig:
        """One thread per element of an (N, H, W, C) output (channel stride ``ld``), or per
        ``lanes`` neighbouring channels of a pixel (a vector path; ``C`` a multiple of it)."""
        pixels(N, H, W, ld)
        blocks = cdiv(N * H * W * (C // lanes), self.threads(dtype))
        if blocks > INT32_MAX:
            raise InputError(f"{self.op} of {N}x{H}x{W}x{C} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    @staticmethod
    def epilogue(kw: Mapping[str, Any]) -> dict[str, float]:
        """The activation epilogue (``act``, an :class:`Activation`; none by default) as the last
        three parameters: ``act``, ``p0``, ``p1``."""
        act: Activation = kw.get("act") or Activation()
        return act.kernel_args()


@dataclass(frozen=True)
class ElementSpec(StreamingSpec):
    """A streaming kernel of one thread per element of its output, :meth:`output_shape` of the call
    (which may take the attributes named in :attr:`SHAPE_ATTRS`, from :meth:`call_args`).

    A spec whose fp16 entry has a vector path (:attr:`F16_LANES` channels a work item: dwconv,
    eltwise) gets a grid of one thread per vector when the output's channels and every channel
    stride allow it. Those kernels loop over their work items (grid-stride) and choose the path on
    the device from the same conditions plus pointer alignment, so the grid is never wrong, only
    sized for the path the device will most likely take."""

    SHAPE_ATTRS: ClassVar[tuple[str, ...]] = ()
    F16_LANES: ClassVar[int] = 1  # channels a work item of the fp16 entry's vector path

    def launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0, *shape: Any, ldy: int | None = None, **attrs: Any
    ) -> LaunchConfig:
        """:meth:`output_launch` of :meth:`output_shape` (input (N, H, W, C), its attributes),
        written with channel stride ``ldy`` (None: dense)."""
        return self.output_launch(dtype, self.output_shape(N, H, W, C, K, *shape, **attrs), ldy)

    def output_launch(self, dtype: Any, out: tuple[int, int, int, int], ldy: int | None, *strides: int) -> LaunchConfig:
        """One thread per element of the output ``out`` written with channel stride ``ldy`` (None:
        dense), or per vector (:meth:`lanes`) when the output and the input ``strides`` allow it."""
        n, h, w, c = out
        ld = ldy or c
        return self.element_launch(dtype, n, h, w, c, ld, self.lanes(dtype, c, ld, *strides))

    def lanes(self, dtype: Any, *channels: int) -> int:
        """:attr:`F16_LANES` for fp16 when every channel count and stride given is a multiple of it, else 1."""
        v = self.F16_LANES
        return v if dtype_name(dtype) == "float16" and all(c % v == 0 for c in channels) else 1

    def call_launch(self, dtype: Any, kw: Mapping[str, Any]) -> LaunchConfig:
        shape = {name: kw[name] for name in self.SHAPE_ATTRS}
        out = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw["K"], **shape)
        strides = (v for k, v in kw.items() if k in ("ldx", "lda", "ldb") and v is not None)
        return self.output_launch(dtype, out, kw["ldy"], *strides)


def onnx_weight_bias(call: KernelCall, weights: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """A conv-like call's weight and bias as the plan holds them (ONNX layout; no bias: None)."""
    return weights[call.weights[0]], (weights[call.weights[1]] if len(call.weights) > 1 else None)
