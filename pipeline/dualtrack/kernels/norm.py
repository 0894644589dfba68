"""norm_nhwc: the norm op, the normalisation family (handwritten_ptx/norm_nhwc.cu has the math).

One call, by its ``kind`` attr (``plan.NORM_KINDS``):

- ``group``: GroupNorm with ``groups`` G (InstanceNorm: G = C): a split reduction to fp32 statistics
  per (image, group), then one fused pass: three launches (stats, finalize, apply), the first two
  before the call's own entry (``PreparedCall.before``), their partial sums in the call's workspace;
- ``layer``: LayerNorm over the channels of each pixel (ConvNeXt's LayerNorm2d): one launch;
- ``affine``: an unfolded BatchNormalization, its running mean and variance as per-channel constants:
  the apply entry alone.

Every kind applies ``y = act(norm(x) * gamma[c] + beta[c] (+ r, res 1)) (+ r, res 2)``: weights
(gamma, beta[, mean, var]) are fp32 vectors of C (an opset-18 GroupNormalization's per-group scale is
repeated over its groups' channels when packed), ``eps`` a float32 attr (bits), ``res`` the residual
mode (``plan.NORM_RES``) with the residual as the call's second input.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import NORM_KINDS, NORM_RES, KernelCall, bits_f32
from dualtrack.errors import InputError
from dualtrack.kernels.base import (
    GRID_Y_MAX,
    INT32_MAX,
    DeviceTensor,
    KernelArg,
    LaunchConfig,
    LaunchContext,
    PreparedCall,
    Tensors,
    cdiv,
    dtype_name,
    pixels,
    positive,
)
from dualtrack.kernels.streaming import StreamingSpec

KIND_NAMES = {code: name for name, code in NORM_KINDS.items()}
RES_NAMES = {code: name for name, code in NORM_RES.items()}
TILE_C = 32  # channels a stats block reduces (norm_nhwc.cu: one warp's width)
STATS_PARAMS = ("x", "part", "N", "H", "W", "C", "ldx", "chunk")
FINALIZE_PARAMS = ("part", "mean", "var", "N", "HW", "C", "G", "chunk", "chunks")
LAYER_PARAMS = (
    "x", "r", "y", "gamma", "beta", "N", "H", "W", "C", "ldx", "ldr", "ldy", "res", "eps", "act", "p0", "p1",
)  # fmt: skip


def typed(params: Sequence[str], pointers: int, values: Mapping[str, Any]) -> list[KernelArg]:
    """An entry's ABI list: the first ``pointers`` parameters ``c_void_p`` (None: null), ``eps``,
    ``p0``, ``p1`` ``c_float``, the rest ``c_int32``."""
    out: list[KernelArg] = []
    for i, name in enumerate(params):
        v = values[name]
        if i < pointers:
            out.append((int(v or 0), ctypes.c_void_p))
        elif name in ("eps", "p0", "p1"):
            out.append((float(v), ctypes.c_float))
        else:
            out.append((int(v), ctypes.c_int32))
    return out


@dataclass(frozen=True)
class Chunking:
    """How a group-statistics launch splits each image's pixels: ``chunks`` chunks of ``chunk``
    pixels (the last one shorter), and the workspace it needs (partials, then mean and var)."""

    chunk: int
    chunks: int
    part_floats: int  # N * chunks * C * 2
    stat_floats: int  # N * G, twice

    @property
    def nbytes(self) -> int:
        return 4 * (self.part_floats + 2 * self.stat_floats)


@dataclass(frozen=True)
class NormSpec(StreamingSpec):
    """The norm op's spec. ``waves``: stats blocks per SM the chunking aims for, so that one image of
    a few groups fills the GPU; ``min_chunk``: the fewest pixels a stats block reduces (4 rows of
    its fp16 vector path's 64); ``apply_waves``: full-occupancy waves the apply pass's threads make
    (each then streams its channel vector over H*W / threads-an-image pixels)."""

    fin_threads: int = 256
    waves: int = 4
    min_chunk: int = 256
    apply_waves: int = 2

    MACRO: ClassVar[str] = "NORM"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "r", "y", "mean", "var", "gamma", "beta",
        "N", "H", "W", "C", "ldx", "ldr", "ldy", "G", "stat_n", "res", "eps", "act", "p0", "p1",
    )  # fmt: skip
    POINTERS: ClassVar[int] = 7
    FLOATS: ClassVar[frozenset[str]] = frozenset({"eps", "p0", "p1"})
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"r", "gamma", "beta"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))

    def defines(self) -> dict[str, int | str]:
        return {"NORM_THREADS": self.block_threads, "NORM_FIN_THREADS": self.fin_threads}

    @property
    def entries(self) -> tuple[str, ...]:
        sub = ("", "_stats", "_layer")
        return (*(f"{self.stem}{s}_{d}" for s in sub for d in ("f16", "f32")), f"{self.stem}_finalize")

    def sub_entry(self, part: str, dtype: Any) -> str:
        """``stats`` or ``layer``'s entry for ``dtype`` (the apply entry is :meth:`entry`)."""
        return self.entry(dtype).replace(self.stem, f"{self.stem}_{part}", 1)

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        return (N, H, W, C)

    # -- geometry ------------------------------------------------------------------------------------

    def chunking(self, N: int, H: int, W: int, C: int, G: int, sms: int) -> Chunking:
        """The split of a group-statistics launch on a GPU of ``sms`` SMs."""
        positive(N=N, H=H, W=W, C=C, G=G, sms=sms)
        hw = H * W
        per = max(1, cdiv(self.waves * sms, cdiv(C, TILE_C) * N))  # chunks an image wants
        chunk = max(min(self.min_chunk, hw), cdiv(hw, per))
        chunks = cdiv(hw, chunk)
        if N > GRID_Y_MAX or chunks > GRID_Y_MAX:
            raise InputError(f"norm statistics of a batch of {N} need {N} grid layers; the grid allows {GRID_Y_MAX}")
        return Chunking(chunk, chunks, N * chunks * C * 2, N * G)

    def stats_launch(self, N: int, C: int, ch: Chunking) -> LaunchConfig:
        return LaunchConfig((cdiv(C, TILE_C), ch.chunks, N), (self.block_threads, 1, 1))

    def finalize_launch(self, N: int, G: int) -> LaunchConfig:
        if N > GRID_Y_MAX:
            raise InputError(f"norm statistics of a batch of {N}: the grid allows {GRID_Y_MAX} images")
        return LaunchConfig((G, N, 1), (self.fin_threads, 1, 1))

    def apply_launch(self, dtype: Any, N: int, H: int, W: int, C: int, *lds: int, sms: int = 0) -> LaunchConfig:
        """Grid (blocks, N): an image's blocks give each of its C/V channel vectors (V = 8 where the fp16
        vector path may run, else 1) at least one thread, and together about ``apply_waves`` full
        waves of a GPU of ``sms`` SMs (none given: a thread an item); never more than a thread an item."""
        lanes = 8 if dtype_name(dtype) == "float16" and all(v % 8 == 0 for v in (C, *lds)) else 1
        if N > GRID_Y_MAX:
            raise InputError(f"norm of a batch of {N}: the grid allows {GRID_Y_MAX} images; split the batch")
        items = H * W * (C // lanes)
        least = cdiv(C // lanes, self.block_threads)
        most = max(least, cdiv(items, self.block_threads))
        want = cdiv(self.apply_waves * sms * (2048 // self.block_threads), N) if sms else most
        blocks = min(most, max(least, want))
        if blocks > INT32_MAX:
            raise InputError(f"norm needs {blocks} blocks an image; split the image")
        return LaunchConfig((blocks, N, 1), (self.block_threads, 1, 1))

    def layer_launch(self, N: int, H: int, W: int) -> LaunchConfig:
        """A warp per pixel."""
        return self._blocks(cdiv(N * H * W, self.block_threads // 32))

    def _blocks(self, blocks: int) -> LaunchConfig:
        if blocks > INT32_MAX:
            raise InputError(f"norm needs {blocks} blocks; split the batch")
        return LaunchConfig((blocks, 1, 1), (self.block_threads, 1, 1))

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        return self.apply_launch(dtype, N, H, W, C)

    # -- the call --------------------------------------------------------------------------------------

    @staticmethod
    def attrs_of(call: KernelCall) -> dict[str, Any]:
        """The call's attributes: ``kind``, ``groups``, ``eps``, ``res`` (names) and ``act``."""
        return {
            "kind": KIND_NAMES[call.attr("kind")],
            "groups": call.attr("groups", 1),
            "eps": bits_f32(call.attr("eps")),
            "res": RES_NAMES[call.attr("res")],
            "act": Activation.of(call),
        }

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each weight as an fp32 vector of the call's ``C`` channels (a vector of ``groups`` values,
        an opset-18 GroupNormalization's scale or bias, repeated over each group's channels)."""
        c, g = call.attr("C"), call.attr("groups", 1)
        out = {}
        for name in call.weights:
            v = np.asarray(weights[name], np.float32).reshape(-1)
            if v.size == g and g != c:
                v = np.repeat(v, c // g)
            if v.size != c:
                raise InputError(f"norm weight '{name}' has {v.size} values; the call ({call.nodes}) has {c} channels")
            out[name] = v
        return out

    def reference(
        self,
        x: np.ndarray,
        *weights: np.ndarray,
        kind: str = "group",
        groups: int = 1,
        eps: float = 1e-5,
        res: str = "none",
        act: Activation | None = None,
        r: np.ndarray | None = None,
    ) -> np.ndarray:
        """numpy float64 semantics of an NHWC ``x`` (``weights``: gamma, beta[, mean, var] as (C,)
        vectors, either may be missing for group and layer), rounded once to x's dtype."""
        v = x.astype(np.float64)
        n, h, w, c = v.shape
        if kind == "group":
            if c % groups:
                raise InputError(f"GroupNorm of {c} channels in {groups} groups; C must be a multiple of G")
            gv = v.reshape(n, h * w, groups, c // groups)
            mean = gv.mean(axis=(1, 3), keepdims=True)
            var = gv.var(axis=(1, 3), keepdims=True)
            v = ((gv - mean) / np.sqrt(var + eps)).reshape(v.shape)
        elif kind == "layer":
            v = (v - v.mean(axis=3, keepdims=True)) / np.sqrt(v.var(axis=3, keepdims=True) + eps)
        else:
            mean, var = (np.asarray(a, np.float64) for a in weights[2:4])
            v = (v - mean) / np.sqrt(var + eps)
        if len(weights) > 0:
            v = v * np.asarray(weights[0], np.float64)
        if len(weights) > 1:
            v = v + np.asarray(weights[1], np.float64)
        if res == "before_act":
            v = v + np.asarray(r, np.float64)
        v = (act or Activation()).apply(v).astype(np.float64)  # the table's formula, in fp32
        if res == "after_act":
            v = v + np.asarray(r, np.float64)
        return v.astype(x.dtype)

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        packed = self.pack_weights(call, weights)
        r = inputs[1] if len(inputs) > 1 else None
        return self.reference(inputs[0], *(packed[n] for n in call.weights), r=r, **self.attrs_of(call))

    def prepare_inputs(
        self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        """The call's launches on these tensors: for ``group`` the stats and finalize launches (into
        the call's workspace) before the apply entry."""
        a = self.attrs_of(call)
        x = inputs[0]
        r = inputs[1] if a["res"] != "none" else None
        if a["res"] != "none" and len(inputs) != 2:
            raise InputError(f"norm ({call.nodes}) with residual mode {a['res']} needs 2 inputs; got {len(inputs)}")
        return self.prepare_norm(
            x.dtype, *x.shape, x=x.ptr, y=y.ptr, ldx=x.channel_stride, ldy=y.channel_stride,
            r=r.ptr if r is not None else None, ldr=r.channel_stride if r is not None else 0,
            weights=[t.ptr for t in weights], ctx=ctx, **a,
        )  # fmt: skip

    def prepare_norm(
        self,
        dtype: Any,
        N: int,
        H: int,
        W: int,
        C: int,
        *,
        x: int,
        y: int,
        weights: Sequence[int],
        ctx: LaunchContext,
        kind: str = "group",
        groups: int = 1,
        eps: float = 1e-5,
        res: str = "none",
        act: Activation | None = None,
        r: int | None = None,
        ldx: int | None = None,
        ldy: int | None = None,
        ldr: int = 0,
    ) -> PreparedCall:
        """The launches of one norm on device pointers (what :meth:`prepare_inputs` and the GPU tests
        call): ``weights`` gamma, beta[, mean, var] (fp32 vectors of C; for group and layer one or
        none may be given)."""
        ldx, ldy = ldx or C, ldy or C
        pixels(N, H, W, max(ldx, ldy, ldr))
        if min(ldx, ldy) < C or (res != "none" and (r is None or ldr < C)):
            raise InputError(f"norm strides ldx={ldx} ldy={ldy} ldr={ldr} must hold the {C} channels")
        if kind == "affine" and len(weights) != 4:
            raise InputError(f"an affine norm takes gamma, beta, mean, var; got {len(weights)} weights")
        G = C if kind == "affine" else groups
        if kind == "group" and (G < 1 or C % G):
            raise InputError(f"GroupNorm of {C} channels in {G} groups; C must be a multiple of G")
        gamma, beta = (*weights[:2], None, None)[:2]
        values: dict[str, Any] = {
            "x": x, "y": y, "r": r if res != "none" else None, "gamma": gamma, "beta": beta,
            "N": N, "H": H, "W": W, "C": C, "ldx": ldx, "ldy": ldy, "ldr": ldr or C, "G": G,
            "res": NORM_RES[res], "eps": eps, **(act or Activation()).kernel_args(),
        }  # fmt: skip
        if kind == "layer":
            return PreparedCall(
                self.sub_entry("layer", dtype), self.layer_launch(N, H, W), typed(LAYER_PARAMS, 5, values)
            )
        before: tuple[PreparedCall, ...] = ()
        if kind == "affine":
            values.update(mean=weights[2], var=weights[3], stat_n=0)
        else:
            ch = self.chunking(N, H, W, C, G, ctx.device.sm_count)
            part = ctx.workspace(ch.nbytes)
            mean = part + 4 * ch.part_floats
            var = mean + 4 * ch.stat_floats
            values.update(part=part, mean=mean, var=var, stat_n=G, HW=H * W, chunk=ch.chunk, chunks=ch.chunks)
            before = (
                PreparedCall(
                    self.sub_entry("stats", dtype), self.stats_launch(N, C, ch), typed(STATS_PARAMS, 2, values)
                ),
                PreparedCall(f"{self.stem}_finalize", self.finalize_launch(N, G), typed(FINALIZE_PARAMS, 3, values)),
            )
        lds = (ldx, ldy, *((ldr,) if res != "none" else ()))
        config = self.apply_launch(dtype, N, H, W, C, *lds, sms=ctx.device.sm_count)
        return PreparedCall(self.entry(dtype), config, typed(self.PARAMS, self.POINTERS, values), before=before)
