"""What the GPU path holds and reports: device tensors and the counters of a run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class GpuTensor:
    """A device tensor in the engine's context: raw pointer, shape, dtype, and what keeps it alive."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    keepalive: object = None
    ld: int = 0  # per-pixel channel stride of an NHWC channel slice (0: dense)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # math.prod: np.prod costs microseconds a call

    @property
    def channel_stride(self) -> int:
        return self.ld or self.shape[-1]


@dataclass
class Stats:
    """What the GPU path paid and ran, for `make bench` and the result file."""

    module_load_ms: dict[str, float] = field(default_factory=dict)
    module_cache: dict[str, str] = field(default_factory=dict)
    image: str = ""
    host_waits: int = 0
    host_wait_ms: float = 0.0
    wgmma: str = ""  # whether conv3x3 launches may use the wgmma kernel here ("on: ..." / "off: why")
    # Conv node -> batch size -> the kernel its launches run ({"impl", "entry", "reason"}: ConvChoice)
    conv3x3: dict[str, dict[int, dict[str, str]]] = field(default_factory=dict)
