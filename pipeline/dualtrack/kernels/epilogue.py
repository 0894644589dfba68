"""The fused activation epilogue of the mobile kernels (dwconv, fc, eltwise): its numpy semantics
and how a call's attrs become kernel arguments.

The codes are :data:`dualtrack.contract.plan.ACTIVATIONS` (the plan's contract: partition writes them); the
device side is ``apply_act`` in ``handwritten_ptx/dualtrack_device.cuh``. It travels as the last three
kernel arguments, ``act`` (int32), ``p0``, ``p1`` (float32): ``StreamingSpec.epilogue``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dualtrack.contract.plan import ACTIVATIONS, KernelCall, bits_f32
from dualtrack.errors import InputError

ACT_NAMES = {code: name for name, code in ACTIVATIONS.items()}


@dataclass(frozen=True)
class Activation:
    """One epilogue: an :data:`ACTIVATIONS` code and its two float parameters (unused ones 0)."""

    code: int = 0
    p0: float = 0.0
    p1: float = 0.0

    def __post_init__(self) -> None:
        if self.code not in ACT_NAMES:
            raise InputError(f"activation code {self.code} is not one of {sorted(ACT_NAMES)} ({ACTIVATIONS})")

    @classmethod
    def of(cls, call: KernelCall) -> Activation:
        """The epilogue a call's attrs name (``act``, ``act_p0``, ``act_p1``; none by default)."""
        return cls(call.attr("act"), bits_f32(call.attr("act_p0")), bits_f32(call.attr("act_p1")))

    @classmethod
    def named(cls, name: str, p0: float = 0.0, p1: float = 0.0) -> Activation:
        return cls(ACTIVATIONS[name], p0, p1)

    def apply(self, v: np.ndarray) -> np.ndarray:
        """The activation on float32 values (what the kernels compute before their one rounding)."""
        v = np.asarray(v, np.float32)
        one, zero = np.float32(1), np.float32(0)
        with np.errstate(over="ignore"):  # sigmoid of a large negative value: exp overflows to inf, 1/inf = 0
            match ACT_NAMES[self.code]:
                case "none":
                    return v
                case "relu":
                    return np.where(v < 0, zero, v)
                case "clip":
                    return _clamp(v, np.float32(self.p0), np.float32(self.p1))
                case "hardsigmoid":
                    return _clamp(np.float32(self.p0) * v + np.float32(self.p1), zero, one)
                case "hardswish":
                    return v * _clamp(v / np.float32(6) + np.float32(0.5), zero, one)
                case _:  # sigmoid
                    return one / (one + np.exp(-v))


def _clamp(v: np.ndarray, lo: np.float32, hi: np.float32) -> np.ndarray:
    # np.clip would do, but this spelling keeps NaN exactly as the device's comparisons do.
    return np.where(v < lo, lo, np.where(v > hi, hi, v)).astype(np.float32)
