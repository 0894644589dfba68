"""quantize_fp8: an fp16 NHWC tensor as e4m3 bytes, the input of the FP8 convolutions (issue 42).

``KernelCall(op="quantize_fp8", inputs=(x,), outputs=(xq,), attrs=(("inv_scale", f32_bits(1 / s_x)),))``:
``xq = satfinite(rne(x * inv_scale))`` as OCP float8 e4m3fn, one byte an element, dense NHWC (the
conv_fp8 entries' TMA rows are its C bytes); ``x`` may be a channel slice of a wider buffer. The
scale is per tensor and calibrated by the compiler (``s_x = amax / 448``); this kernel only applies it.
sm_90a only (:attr:`QuantizeFp8Spec.ptx_arches`), as the convolutions that read its output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from dualtrack.contract.plan import KernelCall, bits_f32
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, LaunchContext, PreparedCall, Tensors, dtype_name, positive, stride
from dualtrack.kernels.device import DeviceInfo
from dualtrack.kernels.streaming import ElementSpec

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn
FP8_PTX_ARCHES = ("compute_90a",)  # the e4m3 conversions (sm_89+) and wgmma's e4m3 form (sm_90a)


def fp8_available(device: DeviceInfo) -> bool:
    """Whether ``device`` runs the FP8 kernels: compute capability 9.0 (their compute_90a PTX)."""
    return tuple(device.cc) == (9, 0)


def to_e4m3(v: np.ndarray) -> np.ndarray:
    """float values -> e4m3fn bytes (uint8) as the kernels round them: clipped to +-448 (the
    hardware's satfinite; ml_dtypes' cast does not saturate), then round to nearest even; NaN stays NaN."""
    with np.errstate(invalid="ignore"):
        return np.clip(np.asarray(v, np.float32), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def from_e4m3(q: np.ndarray) -> np.ndarray:
    """e4m3fn bytes (uint8) -> their exact values in float64."""
    return np.asarray(q, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


@dataclass(frozen=True)
class QuantizeFp8Spec(ElementSpec):
    """``quantize_fp8_f16(x, y, N, H, W, C, ldx, inv_scale)``: one thread per 8 channels of a pixel
    where C and ``ldx`` are multiples of 8 (per element otherwise); ``y`` dense uint8."""

    MACRO: ClassVar[str] = "QUANTIZE_FP8"
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "y", "N", "H", "W", "C", "ldx", "inv_scale")
    POINTERS: ClassVar[int] = 2
    FLOATS: ClassVar[frozenset[str]] = frozenset({"inv_scale"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"),)
    F16_LANES: ClassVar[int] = 8
    ptx_arches: ClassVar[tuple[str, ...]] = FP8_PTX_ARCHES

    @property
    def entries(self) -> tuple[str, ...]:
        return (self.entry("float16"),)

    def available(self, device: DeviceInfo) -> bool:
        """Whether ``device`` runs this kernel (sm_90a)."""
        return fp8_available(device)

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        return (N, H, W, C)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The shape checked (the output is dense: its pixel stride is C) and ``inv_scale`` a
        finite positive float."""
        self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"])
        ldy = kw.get("ldy")
        if ldy is not None and ldy != kw["C"]:
            raise InputError(f"quantize_fp8 writes a dense e4m3 tensor; its channel stride {ldy} must be C={kw['C']}")
        s = float(kw["inv_scale"])
        if not (np.isfinite(s) and s > 0):
            raise InputError(f"quantize_fp8: inv_scale={s} must be a finite positive float (1 / the tensor's scale)")
        return {}

    def reference(self, x: np.ndarray, inv_scale: float = 1.0) -> np.ndarray:
        """numpy semantics: ``x * inv_scale`` in float32, then :func:`to_e4m3` (uint8 bytes)."""
        if x.ndim != 4:
            raise InputError(f"quantize_fp8 takes an NHWC tensor; got shape {x.shape}")
        return to_e4m3(x.astype(np.float32) * np.float32(inv_scale))

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        return self.reference(inputs[0], **self.call_attrs(call))

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        return {"inv_scale": bits_f32(call.attr("inv_scale"))}

    def prepare_inputs(
        self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        """The fp16 entry on ``inputs[0]`` writing the uint8 ``y`` (of x's shape, dense)."""
        x = inputs[0]
        if dtype_name(x.dtype) != "float16":
            raise InputError(f"quantize_fp8 ({call.nodes}) reads fp16; got {x.dtype}")
        if np.dtype(y.dtype) != np.uint8 or tuple(y.shape) != tuple(x.shape):
            raise InputError(
                f"quantize_fp8 ({call.nodes}) writes uint8 of x's shape {x.shape}; got {y.dtype} {y.shape}"
            )
        kw = self.call_args(call, inputs, y, weights)
        stride("ldx", kw["ldx"], kw["C"])
        return PreparedCall(self.entry(x.dtype), self.call_launch(x.dtype, kw), self.args(**kw))
