"""norm_nhwc: the norm op, the normalisation family (handwritten_ptx/norm_nhwc.cu has the math).

One call, by its ``kind`` attr (``plan.NORM_KINDS``):

- ``group``: GroupNorm with ``groups`` G (InstanceNorm: G = C): a split reduction to fp32 statistics
  per (image, group) whose last block of each image merges the image's partials, then one fused
  pass: two launches (stats, apply), the first before the call's own entry (``PreparedCall.before``),
  its partials, statistics and arrival counters in the call's workspace;
- ``layer``: LayerNorm over the channels of each pixel (ConvNeXt's LayerNorm2d): one launch;
- ``affine``: an unfolded BatchNormalization, its running mean and variance as per-channel constants:
  the apply entry alone.

Every kind applies ``y = act(norm(x) * gamma[c] + beta[c] (+ r, res 1)) (+ r, res 2)``: weights
(gamma, beta[, mean, var]) are fp32 vectors of C (an opset-18 GroupNormalization's per-group scale is
repeated over its groups' channels when packed), ``eps`` a float32 attr (bits), ``res`` the residual
mode (``plan.NORM_RES``) with the residual as the call's second input.
"""

from __future__ import annotations

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
    LaunchConfig,
    LaunchContext,
    PreparedCall,
    Tensors,
    cdiv,
    dtype_name,
    pixels,
    positive,
    typed,
)
from dualtrack.kernels.streaming import StreamingSpec

KIND_NAMES = {code: name for name, code in NORM_KINDS.items()}
RES_NAMES = {code: name for name, code in NORM_RES.items()}
# The LayerNorm register path's pixels a team takes a step by vectors a lane (norm_nhwc.cu,
# layer_norm_any's switch), and the most channels it takes (LAYER_MAX_C); only the grid size reads them.
LAYER_PIXELS = {1: 4, 2: 2, 3: 1, 4: 1}
LAYER_MAX_C = 1024
STATS_PARAMS = ("x", "part", "mean", "var", "arrivals", "N", "H", "W", "C", "ldx", "G", "chunk", "reps")
LAYER_PARAMS = (
    "x", "r", "y", "gamma", "beta", "N", "H", "W", "C", "ldx", "ldr", "ldy", "res", "eps", "act", "p0", "p1",
)  # fmt: skip


def vector_lanes(dtype: Any, C: int, lds: Sequence[int], pointers: Sequence[int] = ()) -> int:
    """Channels a norm thread takes in one 16-byte access (8 fp16, 4 fp32) where C, the strides and
    the pointers allow it, else 1: the choice the kernel makes (norm_nhwc.cu, vec_ok)."""
    v = 8 if dtype_name(dtype) == "float16" else 4
    ok = all(n % v == 0 for n in (C, *lds)) and all(p % 16 == 0 for p in pointers)
    return v if ok else 1


def flat_reps(dtype: Any, hw: int, C: int, lds: Sequence[int], pointers: Sequence[int]) -> int:
    """How many copies of the C channels one 16-byte vector holds in the flat view of a dense tensor
    (V / C, where C divides V = 8 fp16 or 4 fp32, every stride is C, every pointer 16-byte aligned and
    an image is whole vectors), else 1: a thin tensor (an RGB-like C = 2) read as V-channel pixels,
    so its loads are 16 bytes wide. norm_nhwc.cu's flat_reps decides the same for the apply pass."""
    v = 8 if dtype_name(dtype) == "float16" else 4
    ok = v > C and v % C == 0 and all(n == C for n in lds) and hw % (v // C) == 0
    return v // C if ok and all(p % 16 == 0 for p in pointers) else 1


@dataclass(frozen=True)
class Chunking:
    """How a group-statistics launch splits its work: ``tiles`` tiles of channels (all C up to a block's
    width of 16-byte vectors), each image's pixels in ``chunks`` chunks of ``chunk`` (the last one
    shorter); and the workspace it needs: partials, mean and var, then an arrival counter an image."""

    chunk: int
    chunks: int
    tiles: int
    part_floats: int  # N * chunks * C * 2
    stat_floats: int  # N * G, twice
    images: int  # N int32 counters, zero between launches (the last block of an image resets its own)

    @property
    def nbytes(self) -> int:
        return 4 * (self.part_floats + 2 * self.stat_floats + self.images)


@dataclass(frozen=True)
class NormSpec(StreamingSpec):
    """The norm op's spec. ``waves``: stats blocks per SM the chunking aims for, at most: the blocks an
    SM holds at once (norm_nhwc.cu's NORM_STATS_BLOCKS at 256 threads), so that one image of a few
    groups fills the GPU and a launch is one wave with no tail of late blocks; ``merge_items``: the
    most partials the block that finalizes an image merges (chunks x G where a block holds every
    channel and writes a partial a group, chunks x C otherwise), which bounds the chunks of a wide
    tensor (the merge is one block's L2 round trips: 8192 items are 4 rounds of 8 loads a thread);
    ``min_chunk_bytes``: the least a stats block reads (two of its 16 KB passes), so that a small
    tensor is split over fewer blocks, each of which pays a tree and a partial the last block merges,
    rather than over a full wave of blocks that read a few KB each; ``apply_waves``: waves of the
    apply blocks an SM holds (:attr:`apply_blocks`) that the apply pass's grid makes, rounded down, so
    no late blocks trail the launch (every thread streams its channel vector over H*W / threads-an-image
    pixels, NORM_UNROLL at a time: a trailing block would double the pass); ``layer_waves``:
    full-occupancy waves of the LayerNorm launch, at most."""

    waves: int = 3
    merge_items: int = 8192
    min_chunk_bytes: int = 32768
    apply_waves: int = 1
    layer_waves: int = 2

    MACRO: ClassVar[str] = "NORM"
    PARAMS: ClassVar[tuple[str, ...]] = (
        "x", "r", "y", "mean", "var", "gamma", "beta",
        "N", "H", "W", "C", "ldx", "ldr", "ldy", "G", "stat_n", "res", "eps", "act", "p0", "p1",
    )  # fmt: skip
    POINTERS: ClassVar[int] = 7
    FLOATS: ClassVar[frozenset[str]] = frozenset({"eps", "p0", "p1"})
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"r", "gamma", "beta"})
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = (("ldx", "C"), ("ldy", "C"))

    @property
    def apply_blocks(self) -> int:
        """Apply blocks an SM holds: norm_nhwc.cu's NORM_APPLY_BLOCKS, its register bound (768 threads)."""
        return max(1, 768 // self.block_threads)

    def defines(self) -> dict[str, int | str]:
        return {"NORM_THREADS": self.block_threads}

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(f"{self.stem}{s}_{d}" for s in ("", "_stats", "_layer") for d in ("f16", "f32"))

    def sub_entry(self, part: str, dtype: Any) -> str:
        """``stats`` or ``layer``'s entry for ``dtype`` (the apply entry is :meth:`entry`)."""
        return self.entry(dtype).replace(self.stem, f"{self.stem}_{part}", 1)

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        positive(N=N, H=H, W=W, C=C)
        return (N, H, W, C)

    # -- geometry ------------------------------------------------------------------------------------

    def chunking(self, N: int, H: int, W: int, C: int, G: int, sms: int, lanes: int = 1, itemsize: int = 2) -> Chunking:
        """The split of a group-statistics launch on a GPU of ``sms`` SMs, its threads taking ``lanes``
        channels a load (:func:`vector_lanes`; the kernel covers C whichever it finds) of ``itemsize``
        bytes each. A block is ``rows`` rows of ``cols`` channel vectors; a chunk gives each row at
        least one pixel, and a block at least :attr:`min_chunk_bytes` where the image has them."""
        positive(N=N, H=H, W=W, C=C, G=G, sms=sms, lanes=lanes, itemsize=itemsize)
        hw, cv = H * W, max(1, C // lanes)
        cols = min(cv, self.block_threads)
        rows, tiles = self.block_threads // cols, cdiv(cv, cols)
        per = max(1, self.waves * sms // (tiles * N))  # chunks an image wants: one wave, rounded down
        per = min(per, max(1, self.merge_items // (G if tiles == 1 else C)))
        chunk = min(hw, max(rows, cdiv(hw, per), cdiv(self.min_chunk_bytes, C * itemsize)))
        chunks = cdiv(hw, chunk)
        if N > GRID_Y_MAX or chunks > GRID_Y_MAX:
            raise InputError(f"norm statistics of a batch of {N} need {N} grid layers; the grid allows {GRID_Y_MAX}")
        return Chunking(chunk, chunks, tiles, N * chunks * C * 2, N * G, N)

    def merge_team(self, G: int, items: int) -> int:
        """Threads the finalizing block gives each group of ``items`` partials (norm_nhwc.cu,
        finalize_image): the widest power of two with a team for every group while the block lasts,
        no wider than the items."""
        team = 1
        while team * 2 <= self.block_threads // G and items > team:
            team *= 2
        return team

    def stats_launch(self, N: int, ch: Chunking) -> LaunchConfig:
        return LaunchConfig((ch.tiles, ch.chunks, N), (self.block_threads, 1, 1))

    def apply_launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, *lds: int, sms: int = 0, pointers: Sequence[int] = ()
    ) -> LaunchConfig:
        """Grid (blocks, N): an image's blocks give each of its C channels at least one thread (so the
        kernel finds its C/V channel vectors whichever V it takes: 8 fp16 or 4 fp32 where C, the
        strides and the pointers allow 16-byte accesses, else 1), and together at most ``apply_waves``
        waves of the ``apply_blocks`` an SM holds on a GPU of ``sms`` SMs (none given: a thread an
        item), unless the channels need more; never more than a thread an item."""
        reps = flat_reps(dtype, H * W, C, lds, pointers)
        per_item = C * reps if reps > 1 else vector_lanes(dtype, C, lds, pointers)  # elements a thread's step
        if N > GRID_Y_MAX:
            raise InputError(f"norm of a batch of {N}: the grid allows {GRID_Y_MAX} images; split the batch")
        items = H * W * C // per_item
        least = cdiv(C, self.block_threads)
        most = max(least, cdiv(items, self.block_threads))
        want = max(1, self.apply_waves * sms * self.apply_blocks // N) if sms else most
        blocks = min(most, max(least, want))
        if blocks > INT32_MAX:
            raise InputError(f"norm needs {blocks} blocks an image; split the image")
        return LaunchConfig((blocks, N, 1), (self.block_threads, 1, 1))

    def layer_launch(
        self, dtype: Any, N: int, H: int, W: int, C: int, *lds: int, sms: int = 0, pointers: Sequence[int] = ()
    ) -> LaunchConfig:
        """A team of L lanes a pixel taking P pixels a step (norm_nhwc.cu, layer_norm_any: L = C/V
        rounded up to a power of two, at most 32; K = C/V / L vectors a lane, P = 4/K pixels, or a warp
        a pixel past LAYER_MAX_C channels): blocks for every pixel once, at most ``layer_waves`` full
        waves of a GPU of ``sms`` SMs (the kernel strides over the rest)."""
        cv = C // vector_lanes(dtype, C, lds, pointers)
        team = min(32, 1 << (cv - 1).bit_length())
        k = cdiv(cv, team)
        per_warp = (32 // team) * LAYER_PIXELS[k] if C <= LAYER_MAX_C and k in LAYER_PIXELS else 1
        blocks = cdiv(N * H * W, (self.block_threads // 32) * per_warp)
        if sms:
            blocks = min(blocks, self.layer_waves * sms * (2048 // self.block_threads))
        return self._blocks(blocks)

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
        """The call's launches on these tensors: for ``group`` the stats launch (into the call's
        workspace) before the apply entry."""
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
        lds, ptrs = (ldx, ldy, *((ldr,) if res != "none" else ())), (x, y, *((r or 0,) if res != "none" else ()))
        sms = ctx.device.sm_count
        if kind == "layer":
            config = self.layer_launch(dtype, N, H, W, C, *lds, sms=sms, pointers=ptrs)
            return PreparedCall(self.sub_entry("layer", dtype), config, typed(LAYER_PARAMS, 5, values))
        before: tuple[PreparedCall, ...] = ()
        if kind == "affine":
            values.update(mean=weights[2], var=weights[3], stat_n=0)
        else:
            reps = flat_reps(dtype, H * W, C, (ldx,), (x,))
            size = np.dtype(dtype_name(dtype)).itemsize
            if reps > 1:  # the flat view: H*W / reps pixels of reps * C channels
                ch = self.chunking(N, H * W // reps, 1, C * reps, G, sms, C * reps, size)
            else:
                ch = self.chunking(N, H, W, C, G, sms, vector_lanes(dtype, C, (ldx,), (x,)), size)
            part = ctx.workspace(ch.nbytes)
            mean = part + 4 * ch.part_floats
            var = mean + 4 * ch.stat_floats
            arrivals = var + 4 * ch.stat_floats
            values.update(part=part, mean=mean, var=var, arrivals=arrivals, stat_n=G, chunk=ch.chunk, reps=reps)
            stats = self.sub_entry("stats", dtype)
            before = (PreparedCall(stats, self.stats_launch(N, ch), typed(STATS_PARAMS, 5, values)),)
        config = self.apply_launch(dtype, N, H, W, C, *lds, sms=sms, pointers=ptrs)
        return PreparedCall(self.entry(dtype), config, typed(self.PARAMS, self.POINTERS, values), before=before)
