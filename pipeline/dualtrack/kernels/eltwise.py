"""eltwise_nhwc: the eltwise op (standalone activations, Add and Mul of NHWC tensors, the
squeeze-and-excitation gate), one thread per output element (fp16: per 8 channels where C and
the strides allow)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import ELTWISE_OPS, KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import DeviceTensor, Tensors, pointer, positive, stride
from dualtrack.kernels.streaming import ElementSpec

OP_NAMES = {code: name for name, code in ELTWISE_OPS.items()}


@dataclass(frozen=True)
class EltwiseSpec(ElementSpec):
    """``y = act(a)``, ``act(a + b)`` or ``act(a * b)`` on NHWC tensors; ``b`` of ``a``'s shape, or
    (N, 1, 1, C) broadcast over H and W (``bcast``). fp32 math, one rounding."""

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
        """The ``op`` (``"unary"``, ``"add"``, ``"mul"``) by its code; for a binary one the operand
        ``b`` (required), its stride ``ldb`` (default ``C``) and ``bcast`` (b is (N, 1, 1, C));
        the epilogue ``act, p0, p1``."""
        op, C = kw.get("op", "unary"), kw["C"]
        self.output_shape(kw["N"], kw["H"], kw["W"], C)
        if op not in ELTWISE_OPS:
            raise InputError(f"eltwise op '{op}' is not one of {', '.join(ELTWISE_OPS)}")
        binary = op != "unary"
        operand = {
            "b": pointer("b", kw.get("b"), required=binary),
            "ldb": stride("ldb", kw.get("ldb"), C) if binary else C,
            "bcast": 1 if binary and kw.get("bcast") else 0,
        }
        return {**operand, "op": ELTWISE_OPS[op], **self.epilogue(kw)}

    def reference(
        self, a: np.ndarray, b: np.ndarray | None = None, op: str = "unary", act: Activation | None = None
    ) -> np.ndarray:
        """numpy semantics: float32 ``a``, ``a + b`` or ``a * b`` (``b`` broadcast as numpy does:
        (N,H,W,C) or (N,1,1,C)), then the activation, rounded once to a's dtype."""
        v = a.astype(np.float32)
        if op != "unary":
            if b is None or b.shape not in (a.shape, (a.shape[0], 1, 1, a.shape[3])):
                raise InputError(
                    f"eltwise {op} takes b of a's shape {a.shape} or (N,1,1,C); got {getattr(b, 'shape', None)}"
                )
            v = v + b.astype(np.float32) if op == "add" else v * b.astype(np.float32)
        return (act or Activation()).apply(v).astype(a.dtype)

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        op = OP_NAMES[call.attr("op")]
        return self.reference(inputs[0], inputs[1] if len(inputs) > 1 else None, op, Activation.of(call))

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The keyword arguments of :meth:`args`: ``a`` is the first input (its shape the call's),
        ``b`` the second where the op is binary, of a's shape or (N, 1, 1, C) (broadcast)."""
        op = OP_NAMES[call.attr("op")]
        if (op == "unary") != (len(inputs) == 1):
            raise InputError(f"eltwise {op} ({call.nodes}) got {len(inputs)} inputs")
        kw = super().call_args(call, inputs, y, weights)
        a, b = inputs[0], (inputs[1] if len(inputs) > 1 else None)
        n, h, w, c = a.shape
        bcast = b is not None and tuple(b.shape) == (n, 1, 1, c) and (h, w) != (1, 1)
        if b is not None and not bcast and tuple(b.shape) != tuple(a.shape):
            raise InputError(f"eltwise {op} ({call.nodes}): b {b.shape} is neither {a.shape} nor {(n, 1, 1, c)}")
        operand = {"b": b.ptr, "ldb": b.channel_stride} if b is not None else {}
        return {
            **kw,
            "a": a.ptr,
            "lda": a.channel_stride,
            **operand,
            "op": op,
            "bcast": bcast,
            "act": Activation.of(call),
        }
