"""eltwise_nhwc: the eltwise op (standalone activations; Add, Mul, Sub and Div of NHWC tensors, of
the squeeze-and-excitation gate or of a constant per-channel vector; PReLU), one thread per output
element (fp16: per 8 channels where C and the strides allow).

A constant operand (a PReLU slope, ConvNeXt's layer scale, an unfolded per-channel affine) is the
call's one weight, packed as a (C,) vector in its own dtype (the activations' in a built model: the
front end converts both) and read broadcast over N, H and W (``bcast`` 2)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import ELTWISE_OPS, KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, Tensors, dtype_name, pointer, positive, stride
from dualtrack.kernels.streaming import ElementSpec

OP_NAMES = {code: name for name, code in ELTWISE_OPS.items()}
BCAST_MODES = (0, 1, 2, 3)  # b of a's shape, (N, 1, 1, C), (C,), (N, H, W, 1)

# a op b in float32, as eltwise_nhwc.cu's binary_op (the ops but unary).
BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "mul": np.multiply,
    "sub": np.subtract,
    "div": np.divide,
    "rsub": lambda a, b: b - a,
    "rdiv": lambda a, b: b / a,
    "prelu": lambda a, b: np.where(a < 0, a * b, a),
}


@dataclass(frozen=True)
class EltwiseSpec(ElementSpec):
    """``y = act(a)`` or ``act(a op b)`` (:data:`BINARY`) on NHWC tensors; ``b`` of ``a``'s shape,
    (N, 1, 1, C) broadcast over H and W (``bcast`` 1), a constant (C,) vector (``bcast`` 2, the
    call's weight), or an (N, H, W, 1) map broadcast over C (``bcast`` 3: an attention gate). fp32
    math, one rounding."""

    MACRO: ClassVar[str] = "ELTWISE"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "a", "b", "y", "N", "H", "W", "C", "lda", "ldb", "ldy", "op", "bcast", "act", "p0", "p1",
    )  # fmt: skip
    F16_LANES: ClassVar[int] = 8  # the fp16 vector path: one 16-byte access
    POINTERS: ClassVar[int] = 3
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"b"})  # unary: none; a binary op's is checked with op
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("lda", "C"), ("ldy", "C"))

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        return (N, H, W, C)

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The ``op`` (a name of :data:`~dualtrack.contract.plan.ELTWISE_OPS`) by its code; for a
        binary one the operand ``b`` (required), its stride ``ldb`` (default ``C``) and ``bcast``
        (0, 1: b is (N, 1, 1, C), 2: b is a (C,) vector, 3: b is an (N, H, W, 1) map); the epilogue
        ``act, p0, p1``."""
        op, C = kw.get("op", "unary"), kw["C"]
        self.output_shape(kw["N"], kw["H"], kw["W"], C)
        if op not in ELTWISE_OPS:
            raise InputError(f"eltwise op '{op}' is not one of {', '.join(ELTWISE_OPS)}")
        binary = op != "unary"
        bcast = int(kw.get("bcast") or 0) if binary else 0
        if bcast not in BCAST_MODES:
            raise InputError(f"eltwise bcast {bcast} is not one of {BCAST_MODES}")
        operand = {
            "b": pointer("b", kw.get("b"), required=binary),
            "ldb": stride("ldb", kw.get("ldb"), 1 if bcast == 3 else C) if binary and bcast != 2 else C,
            "bcast": bcast,
        }
        return {**operand, "op": ELTWISE_OPS[op], **self.epilogue(kw)}

    def reference(
        self, a: np.ndarray, b: np.ndarray | None = None, op: str = "unary", act: Activation | None = None
    ) -> np.ndarray:
        """numpy semantics: float32 ``a`` or ``a op b`` (:data:`BINARY`; ``b`` broadcast as numpy
        does: (N,H,W,C), (N,1,1,C) or (C,)), then the activation, rounded once to a's dtype."""
        v = a.astype(np.float32)
        if op != "unary":
            if op not in BINARY:
                raise InputError(f"eltwise op '{op}' is not one of {', '.join(ELTWISE_OPS)}")
            shapes = (a.shape, (a.shape[0], 1, 1, a.shape[3]), (a.shape[3],), (*a.shape[:3], 1))
            if b is None or b.shape not in shapes:
                raise InputError(
                    f"eltwise {op} takes b of a's shape {a.shape}, (N,1,1,C), (C,) or (N,H,W,1); "
                    f"got {getattr(b, 'shape', None)}"
                )
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf and NaN as on the GPU
                v = BINARY[op](v, b.astype(np.float32)).astype(np.float32)
        return (act or Activation()).apply(v).astype(a.dtype)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A constant operand (the call's one weight, ONNX-broadcastable to (1, C, 1, 1)) as a
        contiguous (C,) vector in its own dtype, C the call's ``C`` attr."""
        if not call.weights:
            return {}
        name = call.weights[0]
        value, C = np.asarray(weights[name]), call.attr("C")
        if value.size not in (1, C):
            raise InputError(
                f"eltwise {call.nodes}: constant {name} of shape {value.shape} is not a {C}-channel vector"
            )
        return {name: np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (C,)))}

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        op = OP_NAMES[call.attr("op")]
        b = self.pack_weights(call, weights).get(call.weights[0]) if call.weights else None
        if len(inputs) > 1:
            b = inputs[1]
        return self.reference(inputs[0], b, op, Activation.of(call))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The keyword arguments of :meth:`args`: ``a`` is the first input (its shape the call's),
        ``b`` the second where the op is binary, of a's shape or (N, 1, 1, C) (broadcast), or the
        call's weight, a (C,) vector of a's dtype."""
        op = OP_NAMES[call.attr("op")]
        if (op == "unary") != (len(inputs) + len(weights) == 1):
            raise InputError(f"eltwise {op} ({call.nodes}) got {len(inputs)} inputs and {len(weights)} weights")
        kw = super().call_args(call, inputs, y, [])  # no w/bias: a weight here is the operand b
        a = inputs[0]
        n, h, w, c = a.shape
        if weights:
            b = weights[0]
            if tuple(b.shape) != (c,) or dtype_name(b.dtype) != dtype_name(a.dtype):
                raise InputError(f"eltwise {op} ({call.nodes}): constant {b.shape} {b.dtype} is not a ({c},) {a.dtype}")
            operand = {"b": b.ptr, "ldb": c, "bcast": 2}
        else:
            b = inputs[1] if len(inputs) > 1 else None
            bcast = 0
            if b is not None and tuple(b.shape) != tuple(a.shape):
                shapes = {(n, 1, 1, c): 1, (n, h, w, 1): 3}
                if tuple(b.shape) not in shapes:
                    raise InputError(
                        f"eltwise {op} ({call.nodes}): b {b.shape} is none of {a.shape}, {(n, 1, 1, c)}, {(n, h, w, 1)}"
                    )
                bcast = shapes[tuple(b.shape)]
            operand = {"b": b.ptr, "ldb": b.channel_stride, "bcast": bcast} if b is not None else {}
        return {
            **kw,
            "a": a.ptr,
            "lda": a.channel_stride,
            **operand,
            "op": op,
            "act": Activation.of(call),
        }
