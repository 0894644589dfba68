"""seghead_nhwc: the seghead op (a segmentation head's post-processing: Softmax / Sigmoid / none
over the classes, the probabilities and the ArgMax class mask), NHWC logits in, the model's own
outputs out in the model's layout (probabilities NCHW, mask (N, H, W) uint8).

Tolerance against onnxruntime (tests/test_seghead_ref.py measures it on random and large logits):
probabilities within 1e-6 absolute in fp32 (CUDA's ``expf`` is within 2 ulp, the division exact to
rounding; onnxruntime's Softmax multiplies by the reciprocal of the sum), within one fp16 ulp of
the graph's rounding where it rounds to fp16; the mask is the argmax of the probabilities as this
kernel computes them, so it equals onnxruntime's except where two classes' probabilities lie within
that error of each other (verify.compare_outputs leaves those pixels out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import HEAD_ACTS, HEAD_FLAGS, KernelCall, bits_f32, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    DeviceTensor,
    KernelArg,
    LaunchConfig,
    PreparedCall,
    Tensors,
    cdiv,
    pixels,
    pointer,
    positive,
    stride,
)
from dualtrack.kernels.streaming import StreamingSpec

MAX_CLASSES = 256  # the mask holds class ids as uint8
BLOCKS_MAX = 1 << 20  # a grid-stride loop: more blocks than this only add scheduling


@dataclass(frozen=True)
class HeadMode:
    """What one head computes: its activation (``none``, ``softmax``, ``sigmoid``), where the graph
    rounds to fp16 (the logits before the activation, the probabilities written, the values the
    argmax compares), the probabilities' dtype, and a one-class head's threshold (None: argmax)."""

    act: str = "softmax"
    round_in: bool = False
    round_probs: bool = False
    round_arg: bool = False
    probs_dtype: str = "float32"
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.act not in HEAD_ACTS:
            raise InputError(f"seghead takes the activations {', '.join(HEAD_ACTS)}; got '{self.act}'")
        if self.probs_dtype not in ("float16", "float32"):
            raise InputError(f"seghead writes float16 or float32 probabilities; got {self.probs_dtype}")

    @property
    def flags(self) -> int:
        bits = {
            "round_in": self.round_in, "round_probs": self.round_probs, "round_arg": self.round_arg,
            "probs_f16": self.probs_dtype == "float16", "threshold": self.threshold is not None,
        }  # fmt: skip
        return sum(HEAD_FLAGS[name] for name, on in bits.items() if on)

    @classmethod
    def of(cls, call: KernelCall) -> HeadMode:
        flags = call.attr("flags")
        on = {name: bool(flags & bit) for name, bit in HEAD_FLAGS.items()}
        return cls(
            act={v: k for k, v in HEAD_ACTS.items()}[call.attr("act")],
            round_in=on["round_in"], round_probs=on["round_probs"], round_arg=on["round_arg"],
            probs_dtype="float16" if on["probs_f16"] else "float32",
            threshold=bits_f32(call.attr("thr")) if on["threshold"] else None,
        )  # fmt: skip

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """The call attrs that :meth:`of` reads back."""
        return (("act", HEAD_ACTS[self.act]), ("flags", self.flags), ("thr", f32_bits(self.threshold or 0.0)))


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class SegHeadSpec(StreamingSpec):
    """(N, H, W, C) logits -> probabilities (N, C, H, W) and a uint8 mask (N, H, W): one thread per
    pixel, fp32 math, the graph's fp16 roundings (:class:`HeadMode`)."""

    MACRO: ClassVar[str] = "SEGHEAD"
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "probs", "mask", "N", "H", "W", "C", "ldx", "act", "flags", "thr")
    FLOATS: ClassVar[frozenset[str]] = frozenset({"thr"})
    POINTERS: ClassVar[int] = 3

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        """The probabilities' shape, NCHW (the mask is (N, H, W))."""
        positive(N=N, H=H, W=W, C=C)
        return (N, C, H, W)

    def supports(self, C: int, mode: HeadMode) -> str | None:
        """None when the kernel computes this head, else why not (the partition asks the same)."""
        if C > MAX_CLASSES and mode.threshold is None:
            return f"{C} classes: the mask holds class ids as uint8 (at most {MAX_CLASSES} classes)"
        if mode.threshold is not None and C != 1:
            return f"a threshold mask over {C} classes (the kernel thresholds one class)"
        return None

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        self.output_shape(N, H, W, C)
        blocks = min(cdiv(N * H * W, self.threads(dtype)), BLOCKS_MAX)
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    def args(
        self,
        *,
        x: int,
        probs: int,
        mask: int,
        N: int,
        H: int,
        W: int,
        C: int,
        mode: HeadMode,
        ldx: int | None = None,
        **_: Any,
    ) -> list[KernelArg]:
        """``x, probs, mask, N, H, W, C, ldx, act, flags, thr``; ``ldx`` defaults to ``C``."""
        self.output_shape(N, H, W, C)
        why = self.supports(C, mode)
        if why:
            raise InputError(f"seghead: {why}")
        ldx_ = stride("ldx", ldx, C)
        pixels(N, H, W, ldx_)
        values = {
            "x": pointer("x", x), "probs": pointer("probs", probs), "mask": pointer("mask", mask),
            "N": N, "H": H, "W": W, "C": C, "ldx": ldx_, "act": HEAD_ACTS[mode.act], "flags": mode.flags,
            "thr": mode.threshold or 0.0,
        }  # fmt: skip
        return self.typed(values)

    def reference(self, x: np.ndarray, mode: HeadMode | None = None) -> tuple[np.ndarray, np.ndarray]:
        """numpy semantics of seghead_nhwc.cu: ``x`` (N, H, W, C) -> (probabilities (N, C, H, W) in
        ``mode.probs_dtype``, mask (N, H, W) uint8), float32 math, classes summed in order, the argmax
        a strict ``>`` scan from class 0 (the first of equal values; a NaN is never chosen)."""
        mode = mode or HeadMode()
        if x.ndim != 4:
            raise InputError(f"seghead takes x (N,H,W,C); got {x.shape}")
        v = x.astype(np.float32)
        v = _f16(v) if mode.round_in else v
        C = v.shape[-1]
        with np.errstate(invalid="ignore", over="ignore"):
            if mode.act == "softmax":
                m = np.fmax.reduce(v, axis=-1, keepdims=True)  # as fmaxf: a NaN is not the max
                e = np.exp(v - m)
                total = np.zeros((*v.shape[:-1], 1), np.float32)
                for c in range(C):  # in class order, as the kernel sums
                    total += e[..., c : c + 1]
                a = e / total
            elif mode.act == "sigmoid":
                a = np.float32(1) / (np.float32(1) + np.exp(-v))
            else:
                a = v
        a = a.astype(np.float32)
        probs = (_f16(a) if mode.round_probs else a).astype(mode.probs_dtype)
        s = _f16(a) if mode.round_arg else a
        if mode.threshold is not None:
            mask = s[..., 0] > np.float32(mode.threshold)
        else:
            mask = np.zeros(s.shape[:-1], np.int64)
            best = s[..., 0].copy()
            for c in range(1, C):
                take = s[..., c] > best
                mask[take], best[take] = c, s[..., c][take]
        return np.ascontiguousarray(probs.transpose(0, 3, 1, 2)), mask.astype(np.uint8)

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Both outputs, in ``call.outputs`` order (probabilities, mask)."""
        return self.reference(inputs[0], HeadMode.of(call))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        raise InputError(f"seghead ({call.nodes}) writes two outputs: prepare it with prepare_outputs")

    def outputs_args(
        self, call: KernelCall, x: DeviceTensor, probs: DeviceTensor, mask: DeviceTensor
    ) -> dict[str, Any]:
        """The keyword arguments of :meth:`args` for logits ``x`` (NHWC, any channel stride) and the
        dense outputs ``probs`` (N, C, H, W) and ``mask`` (N, H, W) (or (N, 1, H, W))."""
        mode = HeadMode.of(call)
        n, h, w, c = x.shape
        if tuple(probs.shape) != (n, c, h, w) or probs.dtype.name != mode.probs_dtype:
            raise InputError(
                f"seghead ({call.nodes}): probs {probs.shape} {probs.dtype} is not ({n}, {c}, {h}, {w}) "
                f"{mode.probs_dtype} for logits {x.shape}"
            )
        if tuple(mask.shape) not in ((n, h, w), (n, 1, h, w)) or mask.dtype.name != "uint8":
            raise InputError(f"seghead ({call.nodes}): mask {mask.shape} {mask.dtype} is not ({n}, {h}, {w}) uint8")
        return {
            "x": x.ptr, "probs": probs.ptr, "mask": mask.ptr,
            "N": n, "H": h, "W": w, "C": c, "ldx": x.channel_stride, "mode": mode,
        }  # fmt: skip

    def prepare_outputs(
        self, call: KernelCall, inputs: Tensors, outputs: Tensors, weights: Tensors, ctx: Any
    ) -> PreparedCall:
        if len(inputs) != 1 or len(outputs) != 2:
            raise InputError(f"seghead ({call.nodes}) takes 1 input and 2 outputs; got {len(inputs)}, {len(outputs)}")
        kw = self.outputs_args(call, inputs[0], outputs[0], outputs[1])
        dtype = inputs[0].dtype
        return PreparedCall(self.entry(dtype), self.launch(dtype, kw["N"], kw["H"], kw["W"], kw["C"]), self.args(**kw))
