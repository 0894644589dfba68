"""attention: the attention op (handwritten_ptx/attention.cu), Q·Kᵀ, scale, additive bias, softmax and
·V in one launch, flash style (one pass over the keys, fp32 running max and sum), fp16 tensor cores.

A call reads its operands where they lie: each of Q, K, V and the output O is an
:class:`OperandView`, four element strides (batch, head, row, dim) and an offset into a Track A
tensor as the runtime holds it (an NHWC image, or a token tensor (N, L, C) as the graph has it), so
the Reshapes and Transposes an exporter writes between token and head layouts cost nothing
(``compiler.attention_patterns`` derives the views). A constant bias (relative positions, a mask) is
the call's one weight, packed fp32 as (heads or 1, Lq or 1, Lk or 1), broadcast where a dim is 1.

fp16 only (Q, K, V and O); head dims :data:`HEAD_DIMS` (one entry each); any Lq, Lk, head count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import KernelCall, bits_f32, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    GRID_Y_MAX,
    INT32_MAX,
    DeviceTensor,
    KernelArg,
    KernelSpec,
    LaunchConfig,
    LaunchContext,
    PreparedCall,
    Tensors,
    cdiv,
    dtype_name,
    positive,
)

HEAD_DIMS = (16, 32, 64, 128)  # the entries attention_f16_d<D>; other head dims stay on Track B
OPERANDS = ("q", "k", "v", "o")
_AXES = ("b", "h", "i", "c")  # batch, head, row (query or key), head-dim channel


@dataclass(frozen=True)
class OperandView:
    """Where element (b, h, i, c) of an operand lies in its tensor's buffer: ``off + b*b_ + h*h + i*i + c*c``
    (elements; a stride is 0 where the operand broadcasts, as a head count of 1 does)."""

    off: int
    b: int
    h: int
    i: int
    c: int

    def strides(self) -> tuple[int, int, int, int]:
        return (self.b, self.h, self.i, self.c)

    def attrs(self, name: str) -> tuple[tuple[str, int], ...]:
        return ((f"{name}_off", self.off), *((f"{name}_{a}", s) for a, s in zip(_AXES, self.strides(), strict=True)))

    @classmethod
    def from_call(cls, call: KernelCall, name: str) -> OperandView:
        return cls(call.attr(f"{name}_off"), *(call.attr(f"{name}_{a}") for a in _AXES))


@dataclass(frozen=True)
class AttentionGeometry:
    """One call's shape: ``heads`` heads of ``d`` dims, ``lq`` queries, ``lk`` keys, the softmax ``scale``,
    the four operand views, and the Track A shape of the output tensor but its batch (``out_shape``:
    what the CPU interpreter allocates)."""

    heads: int
    d: int
    lq: int
    lk: int
    scale: float
    views: tuple[OperandView, OperandView, OperandView, OperandView]  # q, k, v, o
    out_shape: tuple[int, ...]

    def attrs(self) -> tuple[tuple[str, int], ...]:
        dims = (("heads", self.heads), ("d", self.d), ("lq", self.lq), ("lk", self.lk), ("scale", f32_bits(self.scale)))
        out = (("out_rank", len(self.out_shape)), *((f"out_{j}", n) for j, n in enumerate(self.out_shape)))
        return (*dims, *out, *(a for name, v in zip(OPERANDS, self.views, strict=True) for a in v.attrs(name)))

    @classmethod
    def from_call(cls, call: KernelCall) -> AttentionGeometry:
        views = tuple(OperandView.from_call(call, name) for name in OPERANDS)
        out_shape = tuple(call.attr(f"out_{j}") for j in range(call.attr("out_rank")))
        return cls(
            call.attr("heads"), call.attr("d"), call.attr("lq"), call.attr("lk"), bits_f32(call.attr("scale")),
            views, out_shape,  # type: ignore[arg-type]
        )  # fmt: skip


def supports(dtype: str, d: int, dv: int) -> str | None:
    """Why the kernel cannot take an attention of this dtype and head dims (Q·K's ``d``, V's ``dv``), or None."""
    if dtype != "float16":
        return f"dtype {dtype} (the attention kernel is fp16: build with precision fp16)"
    if d != dv:
        return f"Q/K head dim {d} differs from V's {dv} (the kernel takes one head dim)"
    if d not in HEAD_DIMS:
        return f"head dim {d} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    return None


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, bias: np.ndarray | None = None) -> np.ndarray:
    """numpy semantics on (B, heads, L, d) arrays: ``softmax(scale * q @ kᵀ + bias) @ v`` over the keys,
    in float32 (the max subtracted; a row of -inf scores gives NaN, as onnxruntime), rounded once to
    q's dtype. ``bias`` broadcasts against the (B, heads, Lq, Lk) scores."""
    if q.ndim != 4 or k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3]:
        raise InputError(
            f"attention takes q (B,h,Lq,d), k (B,h,Lk,d), v (B,h,Lk,dv); got {q.shape}, {k.shape}, {v.shape}"
        )
    s = np.float32(scale) * np.matmul(q.astype(np.float32), np.swapaxes(k.astype(np.float32), -1, -2))
    if bias is not None:
        s = s + bias.astype(np.float32)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    return np.matmul(p, v.astype(np.float32)).astype(q.dtype)


def _strided(flat: np.ndarray, view: OperandView, shape: tuple[int, ...], writeable: bool = False) -> np.ndarray:
    """The (B, heads, L, d) operand ``view`` of a tensor's dense buffer ``flat`` (1-D); ``writeable``
    for the output, which the caller writes through it."""
    item = flat.itemsize
    last = view.off + sum((n - 1) * s for n, s in zip(shape, view.strides(), strict=True))
    if view.off < 0 or last >= flat.size:
        raise InputError(f"attention view {view} of {shape} reaches past its tensor's {flat.size} elements")
    return np.lib.stride_tricks.as_strided(
        flat[view.off :], shape=shape, strides=tuple(s * item for s in view.strides()), writeable=writeable
    )


@dataclass(frozen=True)
class AttentionSpec(KernelSpec):
    """The attention op: inputs Q, K, V tensors (one tensor may serve several: a fused qkv projection),
    output O, the constant bias as the one optional weight; :class:`AttentionGeometry` in the attrs."""

    tile: int = 64  # queries a block and keys a step (ATTN_TILE): 4 warps of 16 query rows

    PARAMS: ClassVar[tuple[str, ...]] = (
        "q", "k", "v", "bias", "o", "B", "Hd", "Lq", "Lk",
        "q_b", "q_h", "q_i", "q_c", "k_b", "k_h", "k_i", "k_c", "v_b", "v_h", "v_i", "v_c", "o_b", "o_h", "o_i", "o_c",
        "bias_b", "bias_h", "bias_i", "bias_j", "bmod", "bias_f32", "scale",
    )  # fmt: skip
    POINTERS: ClassVar[int] = 5
    FLOATS: ClassVar[frozenset[str]] = frozenset({"scale"})
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias"})

    def defines(self) -> dict[str, int | str]:
        return {"ATTN_TILE": self.tile}

    def threads(self, dtype: Any) -> int:
        dtype_name(dtype)
        return self.tile // 16 * 32

    def entry(self, dtype: Any, d: int = 64) -> str:
        """The entry of head dim ``d``: ``attention_f16_d64``."""
        if dtype_name(dtype) != "float16" or d not in HEAD_DIMS:
            raise InputError(f"attention has no {dtype_name(dtype)} entry of head dim {d}; {supports('float16', d, d)}")
        return f"{self.stem}_f16_d{d}"

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(f"{self.stem}_f16_d{d}" for d in HEAD_DIMS)

    def attention_launch(self, batch: int, heads: int, lq: int) -> LaunchConfig:
        """A block per (image, head) and tile of queries."""
        positive(B=batch, heads=heads, Lq=lq)
        if batch * heads > INT32_MAX or cdiv(lq, self.tile) > GRID_Y_MAX:
            raise InputError(f"attention of {batch}x{heads} heads and {lq} queries exceeds the grid; split the batch")
        return LaunchConfig(grid=(batch * heads, cdiv(lq, self.tile), 1), block=(self.threads("float16"), 1, 1))

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The shape checked: positive sizes, 32-bit strides."""
        positive(B=kw["B"], Hd=kw["Hd"], Lq=kw["Lq"], Lk=kw["Lk"])
        big = next((n for n in self.PARAMS[5:-1] if abs(int(kw[n])) > INT32_MAX), None)
        if big is not None:
            raise InputError(f"attention {big}={kw[big]} exceeds 2^31-1 elements; split the batch")
        return {}

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """Pointers at each view's offset, the views' strides, the batch from the output's dim 0; the
        bias (fp32, (heads|1, Lq|1, Lk|1)) with stride 0 on its broadcast dims."""
        g = AttentionGeometry.from_call(call)
        tensors = (*inputs, y)
        if len(inputs) != 3:
            raise InputError(f"attention ({call.nodes}) takes Q, K, V inputs; the call names {len(inputs)}")
        for t in tensors:
            if dtype_name(t.dtype) != "float16" or t.channel_stride != t.shape[-1]:
                raise InputError(
                    f"attention ({call.nodes}) reads whole fp16 tensors; got {t.dtype} {t.shape} with channel "
                    f"stride {t.channel_stride} (keep its producer's output out of a Concat)"
                )
        kw: dict[str, Any] = {"B": y.shape[0], "Hd": g.heads, "Lq": g.lq, "Lk": g.lk, "scale": g.scale}
        for name, t, view in zip(OPERANDS, tensors, g.views, strict=True):
            kw[name] = t.ptr + view.off * 2
            kw.update((f"{name}_{a}", s) for a, s in zip(_AXES, view.strides(), strict=True))
        bias = {"bias": None, "bias_b": 0, "bias_h": 0, "bias_i": 0, "bias_j": 0, "bmod": 1, "bias_f32": 1}
        if weights:
            hb, qb, kb = weights[0].shape
            bias.update(bias=weights[0].ptr, bias_h=qb * kb if hb > 1 else 0, bias_i=kb if qb > 1 else 0)
            bias["bias_j"] = 1 if kb > 1 else 0
        return {**kw, **bias}

    def prepare_inputs(
        self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        kw = self.call_args(call, inputs, y, weights)
        entry = self.entry(inputs[0].dtype, call.attr("d"))
        args: list[KernelArg] = self.args(**kw)
        return PreparedCall(entry, self.attention_launch(kw["B"], kw["Hd"], kw["Lq"]), args)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The bias constant (ONNX-broadcastable to the (1, heads, Lq, Lk) scores) as fp32
        (heads|1, Lq|1, Lk|1), contiguous."""
        if not call.weights:
            return {}
        name = call.weights[0]
        return {name: pack_bias(np.asarray(weights[name]), call.attr("heads"), call.attr("lq"), call.attr("lk"))}

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        """The call on Track A's arrays (NHWC images, token tensors): the views read, :func:`reference`
        computed, the output tensor written through its view."""
        g = AttentionGeometry.from_call(call)
        n = inputs[0].shape[0]
        flats = [np.ascontiguousarray(x).reshape(-1) for x in inputs]
        shapes = [(n, g.heads, g.lq, g.d), (n, g.heads, g.lk, g.d), (n, g.heads, g.lk, g.d)]
        q, k, v = (_strided(f, view, s) for f, view, s in zip(flats, g.views[:3], shapes, strict=True))
        bias = self.pack_weights(call, weights).get(call.weights[0]) if call.weights else None
        out = reference(q, k, v, g.scale, bias)
        y = np.full((n, *g.out_shape), np.nan, dtype=out.dtype)
        _strided(y.reshape(-1), g.views[3], out.shape, writeable=True)[...] = out
        return y


def pack_bias(value: np.ndarray, heads: int, lq: int, lk: int) -> np.ndarray:
    """A bias constant broadcastable to (1, heads, lq, lk) (or (1, lq, lk) where heads is 1) as fp32
    (heads|1, lq|1, lk|1), or InputError naming the shape."""
    v = value.astype(np.float32)
    while v.ndim > 3:
        if v.shape[0] != 1:
            raise InputError(f"attention bias {value.shape} varies over the batch (the kernel takes one per head)")
        v = v[0]
    v = v.reshape((1,) * (3 - v.ndim) + v.shape)
    for n, want in zip(v.shape, (heads, lq, lk), strict=True):
        if n not in (1, want):
            raise InputError(f"attention bias {value.shape} does not broadcast to ({heads}, {lq}, {lk})")
    return np.ascontiguousarray(v)
