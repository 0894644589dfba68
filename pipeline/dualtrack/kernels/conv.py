"""What the convolution-like kernels share: their argument list, their GEMM tile fields, their weights.

- :class:`ConvAbi`: ``x, w, bias, y, N, H, W, C, K, ldx, ldy[, relu]`` checked once, and the
  preparation of a launch that reads one input, packed weights and an optional fp32 bias
  (conv3x3's portable kernel, conv1x1, convt2x2).
- :class:`GemmTiles`: the fp16 (tensor-core) and fp32 (SIMT) tile fields of the GEMM-shaped
  kernels, and their ``-D`` macros under a source's prefix (``CONV_F16_BM``, ``CONVT_F32_TN``...).
- :func:`pack_conv_weights`: ONNX conv weights -> KRSC and an fp32 bias; :func:`block_diagonal`:
  a grouped conv's weights as those of fewer, wider groups (the general conv's merged groups).
- :func:`conv3x3_reference`: the conv3x3 op's numpy semantics, which its two kernels
  (conv3x3_nhwc and the Hopper conv3x3_wgmma) both compute (their specs' :class:`Conv3x3Reference`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.base import KernelSpec


def pack_conv_weights(
    w: np.ndarray, bias: np.ndarray | None = None, *, any_size: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """ONNX Conv weights (K, C, 3, 3) or (K, C, 1, 1) (``any_size``: any (K, C, R, S), the general
    conv's) and bias (K,) -> what the conv kernels take: KRSC weights in the same dtype
    (contiguous) and an fp32 bias (None stays None)."""
    if w.ndim != 4 or not (any_size or w.shape[2:] in ((3, 3), (1, 1))):
        sizes = "(K, C, R, S)" if any_size else "(K, C, 3, 3) or (K, C, 1, 1)"
        raise InputError(f"conv weights must be {sizes} as ONNX stores them; got {w.shape}")
    packed = np.ascontiguousarray(w.transpose(0, 2, 3, 1))
    if bias is None:
        return packed, None
    if bias.shape != (w.shape[0],):
        raise InputError(f"conv bias has shape {bias.shape}; expected ({w.shape[0]},)")
    return packed, np.ascontiguousarray(bias, dtype=np.float32)


def block_diagonal(w: np.ndarray, groups: int, merge: int) -> np.ndarray:
    """ONNX weights (K, C/groups, R, S) of a ``groups``-group conv as those of the same conv in
    groups/merge groups, (K, merge*C/groups, R, S): each filter keeps its own group's values at that
    group's place among the ``merge`` it now shares, and zeros elsewhere, so it reads nothing else."""
    K, cg, R, S = w.shape
    if merge < 1 or groups % merge or K % groups:
        raise InputError(f"cannot merge {groups} groups of {K} filters by {merge}: it must divide both")
    kg = K // groups
    parts = w.reshape(groups // merge, merge, kg, cg, R, S)
    out = np.zeros((groups // merge, merge, kg, merge, cg, R, S), w.dtype)
    for i in range(merge):
        out[:, i, :, i] = parts[:, i]
    return out.reshape(K, merge * cg, R, S)


def named_weights(call: KernelCall, packed: tuple[np.ndarray, np.ndarray | None]) -> dict[str, np.ndarray]:
    """A packer's (weights, bias) by the call's weight names (the bias only where the call has one)."""
    return {name: arr for name, arr in zip(call.weights, packed, strict=False) if arr is not None}


def conv3x3_reference(
    x: np.ndarray, w: np.ndarray | None = None, bias: np.ndarray | None = None, relu: bool = False
) -> np.ndarray:
    """numpy semantics of the conv3x3 op: ``x`` (N,H,W,C), ``w`` (K,3,3,C), ``bias`` (K,) or None.

    Computes in float32 (products and sums, then bias, then ReLU) and returns x's dtype,
    rounded once, as the kernels do.
    """
    if w is None:
        raise InputError("conv3x3 reference needs weights w of shape (K, 3, 3, C)")
    if x.ndim != 4 or w.ndim != 4 or w.shape[1:] != (3, 3, x.shape[3]):
        raise InputError(f"conv3x3 takes x (N,H,W,C) and w (K,3,3,C); got x {x.shape}, w {w.shape}")
    N, H, W, _ = x.shape
    K = w.shape[0]
    xp = np.pad(x.astype(np.float32), ((0, 0), (1, 1), (1, 1), (0, 0)))
    wf = w.astype(np.float32)
    out = np.zeros((N, H, W, K), np.float32)
    for r in range(3):
        for s in range(3):
            # One 2-D GEMM of a contiguous copy: numpy's matmul of a strided 4-D view runs without BLAS (~50x slower).
            tap = np.ascontiguousarray(xp[:, r : r + H, s : s + W, :]).reshape(-1, xp.shape[3])
            out += (tap @ wf[:, r, s, :].T).reshape(out.shape)
    if bias is not None:
        if bias.shape != (K,):
            raise InputError(f"bias has shape {bias.shape}; expected ({K},)")
        out += bias.astype(np.float32)
    if relu:
        np.maximum(out, 0.0, out=out)
    return out.astype(x.dtype)


class Conv3x3Reference:
    """The conv3x3 op's numpy semantics (:func:`conv3x3_reference`) as a spec's :meth:`reference`:
    the op's two kernels, conv3x3_nhwc and the Hopper conv3x3_wgmma, compute the same thing."""

    def reference(
        self, x: np.ndarray, w: np.ndarray | None = None, bias: np.ndarray | None = None, relu: bool = False
    ) -> np.ndarray:
        return conv3x3_reference(x, w, bias, relu)


@dataclass(frozen=True, kw_only=True)  # keyword-only: a kernel spec's op and stem come first
class GemmTiles:
    """The tile fields of a GEMM-shaped kernel, and the ``-D`` macros that fix them in its source.

    fp16: tensor cores, an ``f16_bm x f16_bn`` output tile per block of ``32 * f16_warps_m *
    f16_warps_n`` threads, ``f16_bk``-deep k-tiles through ``f16_stages`` cp.async stages.
    fp32: SIMT, an ``f32_bm x f32_bn`` tile per block, ``f32_tm x f32_tn`` outputs a thread.
    """

    f16_bm: int = 128
    f16_bn: int = 64
    f16_bk: int = 32
    f16_warps_m: int = 2
    f16_warps_n: int = 2
    f16_stages: int = 3
    f32_bm: int = 64
    f32_bn: int = 64
    f32_bk: int = 16
    f32_tm: int = 4
    f32_tn: int = 4

    # The macro prefix of the source (CONV_F16_BM, CONVT_F16_BM, ...).
    MACRO_PREFIX: ClassVar[str] = ""
    _F16: ClassVar[tuple[str, ...]] = ("bm", "bn", "bk", "warps_m", "warps_n", "stages")
    _F32: ClassVar[tuple[str, ...]] = ("bm", "bn", "bk", "tm", "tn")

    def tile_defines(self) -> dict[str, int | str]:
        """``<PREFIX>_F16_BM=...``, ..., ``<PREFIX>_F32_TN=...``: every tile field as its macro."""
        p = self.MACRO_PREFIX
        return {
            **{f"{p}_F16_{f.upper()}": getattr(self, f"f16_{f}") for f in self._F16},
            **{f"{p}_F32_{f.upper()}": getattr(self, f"f32_{f}") for f in self._F32},
        }

    def gemm_tile(self, dtype_name: str) -> tuple[int, int]:
        """(rows, columns) of the output tile one block of the default entry computes."""
        if dtype_name == "float16":
            return self.f16_bm, self.f16_bn
        return self.f32_bm, self.f32_bn

    def gemm_threads(self, dtype_name: str) -> int:
        """Threads per block of the default entry: a thread per warp slot (fp16), per micro-tile (fp32)."""
        if dtype_name == "float16":
            return 32 * self.f16_warps_m * self.f16_warps_n
        return (self.f32_bm // self.f32_tm) * (self.f32_bn // self.f32_tn)


class ConvAbi(KernelSpec):
    """The argument list the conv-like kernels share (conv3x3, conv1x1; convt2x2 without ``relu``):
    checked by the kind's :meth:`output_shape`, then ``x, w, bias, y, N, H, W, C, K, ldx, ldy, relu``
    (``bias`` may be omitted: none; ``ldx``/``ldy`` default to ``C``/``K``)."""

    PARAMS: ClassVar[tuple[str, ...]] = ("x", "w", "bias", "y", "N", "H", "W", "C", "K", "ldx", "ldy", "relu")
    POINTERS: ClassVar[int] = 4
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"bias"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "K"))

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The kind's :meth:`output_shape` checks, and ``relu`` (a bool; False by default)."""
        return {**super().arg_values(kw), "relu": 1 if kw.get("relu") else 0}

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        bias = weights[call.weights[1]] if len(call.weights) > 1 else None
        return named_weights(call, pack_conv_weights(weights[call.weights[0]], bias))

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        """The fused ReLU, where the kernel has one."""
        return {"relu": bool(call.attr("relu"))} if "relu" in self.PARAMS else {}
