"""The numpy semantics of the reduction kernels' ``op`` (creduce over a pixel's channels, gap over an
image's pixels): one ONNX Reduce op of :data:`REDUCE_OPS` computed in float32 as
handwritten_ptx/dualtrack_reduce.cuh does, each value mapped (``|v|``, ``v * v``), summed or taken the
max / min of (a NaN propagates), finished once (the mean's one division, L2's one square root), and
rounded once to the input's dtype."""

from __future__ import annotations

import numpy as np

from dualtrack.contract.plan import REDUCE_OPS
from dualtrack.errors import InputError

NAMES = {code: name for name, code in REDUCE_OPS.items()}


def checked(op: int, kernel: str) -> str:
    """The ONNX op name of ``op``, or an :class:`InputError` naming the table."""
    if op not in NAMES:
        raise InputError(f"{kernel} op {op}: not one of {REDUCE_OPS}")
    return NAMES[op]


def reduce(x: np.ndarray, axes: tuple[int, ...], op: int, kernel: str) -> np.ndarray:
    """``x`` reduced over ``axes`` (keepdims) by ``op``, in float32, rounded once to ``x``'s dtype."""
    name = checked(op, kernel)
    f = x.astype(np.float32)
    if name in ("ReduceMax", "ReduceMin"):
        return (np.max if name == "ReduceMax" else np.min)(f, axis=axes, keepdims=True).astype(x.dtype)
    if name == "ReduceL1":
        f = np.abs(f)
    elif name in ("ReduceL2", "ReduceSumSquare"):
        f = f * f
    out = f.sum(axis=axes, keepdims=True, dtype=np.float32)
    if name == "ReduceMean":
        out = out / np.float32(np.prod([x.shape[a] for a in axes]))
    elif name == "ReduceL2":
        out = np.sqrt(out)
    return out.astype(x.dtype)
