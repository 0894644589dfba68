"""maxpool_nhwc: the general ``maxpool`` op, the pooling family — ONNX MaxPool and AveragePool on
2-D NHWC images: any window up to :data:`MAX_KERNEL` a side, strides, dilations (max only),
padding, ``ceil_mode`` 0 or 1 (MaxPool's first output only: no Indices), and for the average
``count_include_pad`` 1 or 0 — a mode row (:data:`~dualtrack.contract.plan.POOL_MODES`) of the one
kernel. One thread per output pixel and 16-byte chunk of channels, as maxpool2x2's, or for a large window
several (:meth:`MaxPoolSpec.lanes`), each a share of its rows.

**The average** sums the window's taps inside the image in fp32 (row-major tap order; with lanes, each lane's rows
and then the lanes' sums pairwise) and divides
once: by the taps inside the image (``count_include_pad`` 0), or by the window clipped to the
padded image (1: a ``ceil_mode`` window that reaches past the bottom/right pads counts only up to
them), onnxruntime's and PyTorch's rule (tests/test_pool_resize_family.py checks it against
onnxruntime). The bottom/right pads are kernel arguments for that count alone.

A call's window is its attributes (:class:`PoolGeometry`); :meth:`MaxPoolSpec.supports` is the one
predicate that says whether the kernel computes a pooling, and the partition asks it before it
lowers a MaxPool to this op (a plain 2x2 / stride 2 window goes to ``maxpool2x2``, which is
specialised for it: ``partition._pool_kernel``).

**The output size** (:meth:`PoolGeometry.output_hw`) is onnxruntime's: per axis
``(L + pads - dil*(k-1) - 1) / stride + 1``, floored, or with ``ceil_mode`` rounded up and then one
less where the last window would start in the bottom/right padding (PyTorch's rule too). ONNX's
shape inference (onnx 1.23) skips that last step, so on such a model the graph's shape and
onnxruntime's disagree; the partition leaves those on Track B (it checks the graph's shape against
this one). A geometry in which some window holds no pixel of the image (padding or dilation wider
than the image) is refused: onnxruntime writes the lowest finite value there, a NaN-free -inf
convention no other framework shares.

**NaN** propagates: a window with a NaN gives NaN (PTX ``max.NaN``), as numpy's max, PyTorch's
max_pool2d, IREE (``arith.maximumf``) and maxpool2x2 do. onnxruntime's CPU MaxPool has no single
rule to copy: whether a NaN wins depends on where it sits in the window and on which of its code
paths runs (MLAS's ``maxps`` keeps the later operand, its scalar loop ``if (x > max)`` skips NaN),
e.g. a NaN in the last tap of a 2x2 window gives NaN, in the first gives the other taps' max.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import POOL_MODES, KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    INT32_MAX,
    DeviceTensor,
    KernelArg,
    LaunchConfig,
    Tensors,
    cdiv,
    dtype_name,
    pixels,
    pointer,
    positive,
    stride,
)
from dualtrack.kernels.conv_general import ConvGeometry
from dualtrack.kernels.streaming import StreamingSpec

MAX_KERNEL = 256  # R and S: a window of 256 x 256 taps is 2048 per lane on 32 lanes (lanes below)
# Windows of at least this many taps get several threads (lanes) per output chunk, each a share of the
# window's rows, met by warp shuffles (maxpool_nhwc.cu): one thread walking a 66 x 66 window alone was
# 157 us of PSPNet's 0.70 ms at N=1 on an H200 (bench/results/kernel_profile-b3f5f15-h200.json).
LANE_TAPS = 64
MAX_LANES = 32  # a warp: the lanes of one output meet by shuffles


@dataclass(frozen=True)
class PoolGeometry(ConvGeometry):
    """A pooling's window: :class:`ConvGeometry`'s (kernel, strides, dilations, ONNX pads top, left,
    bottom, right), ONNX's ``ceil_mode``, which with the bottom/right padding sets the output size,
    and what it computes (``mode``, :data:`~dualtrack.contract.plan.POOL_MODES`: max by default)."""

    ceil_mode: int = 0
    mode: int = POOL_MODES["max"]

    @property
    def average(self) -> bool:
        return self.mode != POOL_MODES["max"]

    def counts(self, H: int, W: int) -> np.ndarray:
        """(Ho, Wo) float32: an average's divisor per output pixel (maxpool_nhwc.cu's count)."""
        Ho, Wo = self.output_hw(H, W)
        axes = []
        for n_out, L, k, s, d, before, after in (
            (Ho, H, self.R, self.stride_h, self.dil_h, self.pad_top, self.pad_bottom),
            (Wo, W, self.S, self.stride_w, self.dil_w, self.pad_left, self.pad_right),
        ):
            if self.mode == POOL_MODES["avg_include_pad"]:
                o0 = np.arange(n_out, dtype=np.int64) * s - before
                axes.append(np.minimum(o0 + k, L + after) - o0)
            else:
                lo, hi = self._taps_inside(n_out, L, k, s, d, before)
                axes.append(hi - lo)
        return (axes[0][:, None] * axes[1][None, :]).astype(np.float32)

    @staticmethod
    def _axis(L: int, k: int, s: int, d: int, before: int, after: int, ceil: bool) -> int:
        room = L + before + after - d * (k - 1) - 1
        if room < 0:
            return 0
        n = (cdiv(room, s) if ceil else room // s) + 1
        # ceil_mode: a last window that would start in the bottom/right padding is dropped.
        return n - 1 if ceil and (n - 1) * s >= L + before else n

    def output_hw(self, H: int, W: int) -> tuple[int, int]:
        """(Ho, Wo) on an H x W input, onnxruntime's rule (the module's docstring); 0 where empty."""
        c = bool(self.ceil_mode)
        return (
            self._axis(H, self.R, self.stride_h, self.dil_h, self.pad_top, self.pad_bottom, c),
            self._axis(W, self.S, self.stride_w, self.dil_w, self.pad_left, self.pad_right, c),
        )

    @staticmethod
    def _taps_inside(n_out: int, L: int, k: int, s: int, d: int, before: int) -> tuple[np.ndarray, np.ndarray]:
        """Per output coordinate, [lo, hi): its window's taps that land in [0, L) (maxpool_nhwc.cu's
        taps_inside)."""
        o0 = np.arange(n_out, dtype=np.int64) * s - before
        lo = np.where(o0 < 0, -(o0 // d), 0)  # ceil(-o0 / d)
        hi = np.where(o0 < L, np.minimum(k, -((o0 - L) // d)), 0)  # ceil((L - o0) / d)
        return lo, hi

    def empty_window(self, H: int, W: int) -> str | None:
        """Why some output pixel's window holds no pixel of an H x W image (all padding), or None."""
        Ho, Wo = self.output_hw(H, W)
        axes = (
            ("row", Ho, H, self.R, self.stride_h, self.dil_h, self.pad_top),
            ("column", Wo, W, self.S, self.stride_w, self.dil_w, self.pad_left),
        )
        for name, n_out, L, k, s, d, before in axes:
            lo, hi = self._taps_inside(n_out, L, k, s, d, before)
            empty = np.flatnonzero(lo >= hi)
            if empty.size:
                return f"output {name} {int(empty[0])}'s window lies wholly in the padding"
        return None

    @classmethod
    def from_call(cls, call: KernelCall) -> PoolGeometry:
        got = dict(call.attrs)
        if "R" not in got or "S" not in got:
            raise InputError(f"pooling call {call.nodes or call.outputs} has no R/S attribute")
        return cls(**{k: int(v) for k, v in got.items() if k in cls.__dataclass_fields__})

    def label(self) -> str:
        mode = next((k for k, v in POOL_MODES.items() if v == self.mode), str(self.mode))
        return f"{mode} {super().label()}{' ceil_mode' if self.ceil_mode else ''}"


@dataclass(frozen=True)
class MaxPoolSpec(StreamingSpec):
    """ONNX MaxPool and AveragePool, NHWC, :meth:`lanes` threads per output pixel and 16-byte chunk of
    channels (8 fp16 or 4 fp32): one vector load per tap when C, the strides and the pointers allow,
    element loads otherwise (the device decides; the grid is the same)."""

    MACRO: ClassVar[str] = "MAXPOOL"
    CHUNK_BYTES: ClassVar[int] = 16
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "y", "N", "H", "W", "C", "Ho", "Wo", "ldx", "ldy", "R", "S", "sh", "sw", "dh", "dw", "pt", "pl",
        "pb", "pr", "mode", "lanes",
    )  # fmt: skip
    POINTERS: ClassVar[int] = 2

    @staticmethod
    def lanes(geom: PoolGeometry) -> int:
        """Threads per output chunk: 1 for a small window; for one of :data:`LANE_TAPS` taps or more,
        the largest power of two up to its rows and :data:`MAX_LANES` (each lane takes whole rows)."""
        if geom.R * geom.S < LANE_TAPS:
            return 1
        return min(MAX_LANES, 1 << (geom.R.bit_length() - 1))

    def vector(self, dtype: Any) -> int:
        """Channels a thread handles: one 16-byte chunk."""
        return self.CHUNK_BYTES // np.dtype(dtype_name(dtype)).itemsize

    def defines(self) -> dict[str, int | str]:
        return {
            **super().defines(),
            "MAXPOOL_VEC_F16": self.vector("float16"),
            "MAXPOOL_VEC_F32": self.vector("float32"),
        }

    def supports(self, dtype: Any, H: int, W: int, C: int, geom: PoolGeometry) -> str | None:
        """None when the kernel computes this pooling of an H x W x C input, else why not. The
        partition lowers a MaxPool or AveragePool to this op only where this says None; launches
        check it again."""
        try:
            dtype_name(dtype)
        except InputError as exc:
            return str(exc)
        g = geom
        why = g.window_problem(MAX_KERNEL, "the average pool" if g.average else "the max-pool")
        if why:
            return why
        if g.ceil_mode not in (0, 1):
            return f"ceil_mode {g.ceil_mode}"
        if g.mode not in POOL_MODES.values():
            return f"pooling mode {g.mode} (one of {POOL_MODES})"
        if g.average and (g.dil_h, g.dil_w) != (1, 1):
            return f"a dilated average pool ({g.dil_h},{g.dil_w}): the kernel averages windows of dilation 1"
        if min(H, W, C) < 1:
            return f"input {H}x{W}x{C}: every size must be >= 1"
        Ho, Wo = g.output_hw(H, W)
        if Ho < 1 or Wo < 1:
            return f"{g.label()} on {H}x{W} has an empty output ({Ho}x{Wo})"
        return g.empty_window(H, W)

    def output_shape(
        self, N: int, H: int, W: int, C: int, K: int = 0, geom: PoolGeometry | None = None
    ) -> tuple[int, int, int, int]:
        if geom is None:
            raise InputError("the pooling's output shape needs its window (geom=PoolGeometry(...))")
        positive(N=N, H=H, W=W, C=C)
        if K not in (0, C):
            raise InputError(f"a pooling keeps the channels: C={C}, K={K}")
        why = self.supports("float32", H, W, C, geom)
        if why:
            raise InputError(f"the pooling kernel cannot run this pooling: {why}")
        return (N, *geom.output_hw(H, W), C)

    def launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0, geom: PoolGeometry | None = None
    ) -> LaunchConfig:
        _, Ho, Wo, _ = self.output_shape(N, H, W, C, K, geom)
        pixels(N, H, W, C)
        if self.block_threads % MAX_LANES:
            raise InputError(f"maxpool's block of {self.block_threads} threads must be a multiple of {MAX_LANES}")
        blocks = cdiv(N * Ho * Wo * cdiv(C, self.vector(dtype)) * self.lanes(geom), self.block_threads)
        if blocks > INT32_MAX:
            raise InputError(f"maxpool of {N}x{H}x{W}x{C} needs {blocks} blocks; split the batch")
        return LaunchConfig(grid=(blocks, 1, 1), block=(self.block_threads, 1, 1), shared_bytes=0)

    def call_launch(self, dtype: Any, kw: Mapping[str, Any]) -> LaunchConfig:
        return self.launch(dtype, kw["N"], kw["H"], kw["W"], kw["C"], 0, kw["geom"])

    def args(
        self,
        *,
        x: int,
        y: int,
        N: int,
        H: int,
        W: int,
        C: int,
        geom: PoolGeometry,
        ldx: int | None = None,
        ldy: int | None = None,
        **_: Any,
    ) -> list[KernelArg]:
        """``x, y, N, H, W, C, Ho, Wo, ldx, ldy, R, S, sh, sw, dh, dw, pt, pl, pb, pr, mode, lanes``;
        strides default to ``C``."""
        _, Ho, Wo, _ = self.output_shape(N, H, W, C, 0, geom)
        ldx_, ldy_ = stride("ldx", ldx, C), stride("ldy", ldy, C)
        pixels(N, H, W, max(ldx_, ldy_))
        g = geom
        return self.typed({
            "x": pointer("x", x), "y": pointer("y", y), "N": N, "H": H, "W": W, "C": C, "Ho": Ho, "Wo": Wo,
            "ldx": ldx_, "ldy": ldy_, "R": g.R, "S": g.S, "sh": g.stride_h, "sw": g.stride_w,
            "dh": g.dil_h, "dw": g.dil_w, "pt": g.pad_top, "pl": g.pad_left, "pb": g.pad_bottom,
            "pr": g.pad_right, "mode": g.mode, "lanes": self.lanes(g),
        })  # fmt: skip

    def reference(self, x: np.ndarray, geom: PoolGeometry | None = None) -> np.ndarray:
        """numpy semantics: ``x`` (N,H,W,C) -> (N,Ho,Wo,C). Max: the max over each window of ``x``
        padded with -inf (NaN propagates: np.maximum), exact in x's dtype. Average: the float32 sum of
        the window's taps in row-major order (padding adds zeros) divided by
        :meth:`PoolGeometry.counts`, rounded once to x's dtype (the kernel's order and rounding)."""
        if x.ndim != 4:
            raise InputError(f"maxpool takes x (N,H,W,C); got {x.shape}")
        g = geom or PoolGeometry(2, 2, 2, 2)
        N, Ho, Wo, C = self.output_shape(*x.shape, 0, g)
        _, H, W, _ = x.shape
        # Pad far enough for ceil_mode's last window, which may reach past the bottom/right pads.
        bottom = max(0, (Ho - 1) * g.stride_h + g.dil_h * (g.R - 1) + 1 - H - g.pad_top)
        right = max(0, (Wo - 1) * g.stride_w + g.dil_w * (g.S - 1) + 1 - W - g.pad_left)
        dtype = np.dtype(np.float32) if g.average else x.dtype
        fill = 0.0 if g.average else -np.inf
        xp = np.full((N, g.pad_top + H + bottom, g.pad_left + W + right, C), fill, dtype)
        xp[:, g.pad_top : g.pad_top + H, g.pad_left : g.pad_left + W] = x
        out = np.full((N, Ho, Wo, C), fill, dtype)
        for r in range(g.R):
            for s in range(g.S):
                h, w = r * g.dil_h, s * g.dil_w
                tap = xp[
                    :, h : h + g.stride_h * (Ho - 1) + 1 : g.stride_h, w : w + g.stride_w * (Wo - 1) + 1 : g.stride_w
                ]
                out = out + tap if g.average else np.maximum(out, tap)
        if g.average:
            return (out / g.counts(H, W)[None, :, :, None]).astype(x.dtype)
        return out

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        return self.reference(inputs[0], PoolGeometry.from_call(call))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The NHWC keyword arguments and the window; ``y`` must have the pooling's output shape."""
        kw = {**super().call_args(call, inputs, y, weights), "geom": PoolGeometry.from_call(call)}
        expect = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], 0, kw["geom"])
        if tuple(y.shape) != expect:
            raise InputError(f"maxpool {call.nodes}: output {y.shape} is not {expect}")
        return kw
