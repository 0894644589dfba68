"""Track B without the IREE runtime: a module's launch plan (launch_plan.py) run on our stream.

IREE's CUDA HAL runs on its own streams and can neither wait on nor signal a CUDA event (FACTS 8,
15), so every A -> B hand-over through it costs a host wait and no inference can be one CUDA
graph. A static-shape module is a fixed list of launches over a fixed buffer plan (FACTS 23): its
PTX is loaded here as Track A's is (runtime/driver.py: the same Module/Kernel types, JIT options
and cubin cache), its transient slabs come from the backend's pool, its parameters are uploaded
once by key from the bundle's initializers, and its launches go on the backend's stream, inside
the backend's stream capture when it records a whole inference.

A wrong replay would be silent, so :func:`check` runs every replayed module once both ways on the
first load of a bundle on a device and demands bit-identical results (runtime/selfcheck.py keeps
the record); a module that differs goes back to the IREE runtime with a warning that names it.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from dualtrack.contract import arch
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.launch_plan import BINDING_ALIGNMENT, Command, Copy, Dispatch, Fill, LaunchPlan, Ref
from dualtrack.contract.plan import Segment, parameter_key
from dualtrack.errors import ArchError
from dualtrack.runtime.driver import SHARED_DEFAULT, Context, Kernel, Module, Stream, call, copy_async
from dualtrack.runtime.memory import DevicePool, upload
from dualtrack.runtime.tensors import GpuTensor

log = logging.getLogger("dualtrack.replay")

_MEMSET = {1: cu.cuMemsetD8Async, 2: cu.cuMemsetD16Async, 4: cu.cuMemsetD32Async}


class ReplaySegment:
    """One (segment, batch) module as launches: :meth:`enqueue` puts them on a stream."""

    def __init__(
        self,
        seg: Segment,
        batch: int,
        plan: LaunchPlan,
        kernels: Mapping[str, Kernel],
        buffers: Mapping[str, Sequence[GpuTensor]],
        pool: DevicePool,
        stream: Stream,
    ) -> None:
        """``buffers``: the module's slabs, parameters, constants and globals (``Ref.kind`` ->
        buffers). The initialiser's commands run here, once, on ``stream``."""
        self.seg, self.batch, self.plan = seg, batch, plan
        self.kernels = kernels
        self.bases: dict[str, list[GpuTensor]] = {k: list(v) for k, v in buffers.items()}
        self.pool, self.stream = pool, stream
        self._commands(plan.init, [], stream)
        self.aligned: dict[int, GpuTensor] = {}  # input -> an aligned copy, for inputs IREE could not take
        self.dtypes = [(spec.name, spec.at_batch(batch), np.dtype(spec.dtype)) for spec in seg.outputs]
        for r, (name, shape, dtype) in zip(plan.results, self.dtypes, strict=True):
            if r.source.length != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ValueError(f"{name}: the module's result spans {r.source.length} B, not {shape} {dtype}")

    def _ptr(self, r: Ref, inputs: Sequence[GpuTensor]) -> int:
        if r.kind == "input":
            return inputs[r.index].ptr + r.offset
        return self.bases[r.kind][r.index].ptr + r.offset

    def _inputs(self, ins: Mapping[str, GpuTensor], stream: Stream) -> list[GpuTensor]:
        out = []
        for i, (spec, want) in enumerate(zip(self.seg.inputs, self.plan.inputs, strict=True)):
            t = ins[spec.name]
            if t.nbytes < want.min_bytes or t.ld:
                raise ValueError(f"{spec.name}: {t.nbytes} B (ld {t.ld}) where the module reads {want.min_bytes} dense")
            if t.ptr % BINDING_ALIGNMENT:
                # IREE's kernels assume aligned bindings (their vector loads): copy into one that is.
                if i not in self.aligned:
                    buf = self.pool.alloc(t.nbytes, self.stream)
                    self.aligned[i] = GpuTensor(int(buf), t.shape, t.dtype, buf)
                a = self.aligned[i]
                copy_async("DtoD", a.ptr, t.ptr, t.nbytes, stream.handle)
                t = a
            out.append(t)
        return out

    def enqueue(self, ins: Mapping[str, GpuTensor], stream: Stream) -> dict[str, GpuTensor]:
        """Queue the module's commands on ``stream``; its outputs (views of its slabs, valid until
        the next enqueue)."""
        inputs = self._inputs(ins, stream)
        self._commands(self.plan.commands, inputs, stream)
        return {
            name: GpuTensor(self._ptr(r.source, inputs), shape, dtype, self.bases["slab"])
            for r, (name, shape, dtype) in zip(self.plan.results, self.dtypes, strict=True)
        }

    def _commands(self, commands: Sequence[Command], inputs: Sequence[GpuTensor], stream: Stream) -> None:
        for cmd in commands:
            if isinstance(cmd, Dispatch):
                args: list[tuple[Any, Any]] = [(self._ptr(b, inputs), ctypes.c_void_p) for b in cmd.bindings]
                args += [(v, ctypes.c_uint32) for v in cmd.constants]
                self.kernels[cmd.kernel].launch(cmd.grid, cmd.block, cmd.shared_bytes, stream, args)
            elif isinstance(cmd, Fill):
                count = cmd.target.length // cmd.width
                call(_MEMSET[cmd.width], self._ptr(cmd.target, inputs), cmd.pattern, count, stream.handle)
            elif isinstance(cmd, Copy):
                src, dst = self._ptr(cmd.source, inputs), self._ptr(cmd.target, inputs)
                copy_async("DtoD", dst, src, cmd.source.length, stream.handle)


@dataclass(frozen=True)
class ReplayDecision:
    """Which path a Track B module takes on this device, and why (``dualtrack info``, stats)."""

    path: str  # "replay" or "iree"
    reason: str


class Replayer:
    """The bundle's launch plans for one device: modules, parameters and slabs, loaded on demand."""

    def __init__(
        self,
        bundle: Bundle,
        target: str,
        ctx: Context,
        stream: Stream,
        pool: DevicePool,
        *,
        jit_cache: Any,
        enabled: str = "",
    ) -> None:
        """``enabled``: "" to replay wherever a plan exists, else why the IREE runtime runs all."""
        self.bundle, self.target, self.ctx, self.stream, self.pool = bundle, target, ctx, stream, pool
        self.jit_cache, self.disabled = jit_cache, enabled
        self.segments: dict[tuple[int, int], ReplaySegment] = {}
        self.params: dict[tuple[str, str], GpuTensor] = {}
        self.modules: dict[str, Module] = {}
        self.refused: dict[tuple[int, int], str] = {}  # self-check failures
        self.decisions: dict[tuple[int, int], ReplayDecision] = {}
        self.version = 0  # moves when a module is refused: cached choices built on decisions are stale
        self.param_names = {parameter_key(n): n for n in bundle.weights}

    def entry(self, seg: Segment, batch: int) -> Mapping[str, Any] | None:
        return self.bundle.manifest.artifacts.iree_replay.get(seg.name, {}).get(self.target, {}).get(str(batch))

    def refuse(self, seg: Segment, batch: int, why: str) -> None:
        """Send this module to the IREE runtime from now on (the both-ways check found a difference)."""
        self.refused[(seg.index, batch)] = why
        self.decisions.pop((seg.index, batch), None)
        self.version += 1

    def decide(self, seg: Segment, batch: int) -> ReplayDecision:
        key = (seg.index, batch)
        if key not in self.decisions:
            self.decisions[key] = self._decide(seg, batch)
        return self.decisions[key]

    def _decide(self, seg: Segment, batch: int) -> ReplayDecision:
        if self.disabled:
            return ReplayDecision("iree", self.disabled)
        if (seg.index, batch) in self.refused:
            return ReplayDecision("iree", self.refused[(seg.index, batch)])
        e = self.entry(seg, batch)
        if e is None:
            return ReplayDecision("iree", "the bundle has no launch plan for it (built before replay existed: rebuild)")
        if "refused" in e:
            return ReplayDecision("iree", f"not replayable: {e['refused']}")
        return ReplayDecision("replay", f"{len(self.plan(e).dispatches)} launches on the engine's stream")

    def plan(self, e: Mapping[str, Any]) -> LaunchPlan:
        return LaunchPlan.from_json(json.loads((self.bundle.root / e["plan"]).read_bytes()))

    def segment(self, seg: Segment, batch: int) -> ReplaySegment:
        key = (seg.index, batch)
        if key not in self.segments:
            self.segments[key] = self._load(seg, batch)
        return self.segments[key]

    def _module(self, e: Mapping[str, Any], i: int) -> Module:
        dev = self.ctx.device
        cubins = e.get("cubin", {})
        try:
            choice = arch.choose_image(dev.cc, sorted(cubins), [])
            rel, kind, target = cubins[choice.arch][i], "cubin", choice.arch
        except ArchError:
            rel, kind, target = e["ptx"][i], "ptx", self.target
        if rel not in self.modules:
            self.modules[rel] = Module.load(
                self.ctx,
                (self.bundle.root / rel).read_bytes(),
                kind=kind,
                origin=str(self.bundle.root / rel),
                target=target,
                cache_dir=self.jit_cache if kind == "ptx" else None,
            )
        return self.modules[rel]

    def upload(self, arr: np.ndarray) -> GpuTensor:
        """A device copy of host bytes the replay keeps (parameters, constants), queued on the stream."""
        buf = self.pool.alloc(max(arr.nbytes, 1), self.stream)
        upload(self.stream, buf, np.ascontiguousarray(arr), arr.nbytes)
        return GpuTensor(int(buf), arr.shape, arr.dtype, buf)

    def _param(self, scope: str, key: str) -> GpuTensor:
        if (scope, key) not in self.params:
            name = self.param_names.get(key)
            if name is None:
                raise KeyError(f"parameter {scope}::{key} is not an initializer of the bundle's model")
            arr = np.ascontiguousarray(self.bundle.weights[name]).reshape(-1).view(np.uint8)
            self.params[(scope, key)] = self.upload(arr)
        return self.params[(scope, key)]

    def _load(self, seg: Segment, batch: int) -> ReplaySegment:
        e = self.entry(seg, batch)
        assert e is not None and "plan" in e
        plan = self.plan(e)
        mods = [self._module(e, i) for i in range(plan.modules)]
        kernels: dict[str, Kernel] = {}
        for cmd in (*plan.init, *plan.commands):
            if isinstance(cmd, Dispatch) and cmd.kernel not in kernels:
                k = kernels[cmd.kernel] = mods[cmd.module].function(cmd.kernel)
                if cmd.shared_bytes > SHARED_DEFAULT:
                    k.set_max_dynamic_shared(cmd.shared_bytes)

        def alloc(size: int) -> GpuTensor:
            buf = self.pool.alloc(max(size, 1), self.stream)
            return GpuTensor(int(buf), (size,), np.dtype(np.uint8), buf)

        params = []
        for p in plan.params:
            base = self._param(p.scope, p.key)
            if p.offset + p.length > base.nbytes:
                raise ValueError(f"parameter {p.key}: [{p.offset}, +{p.length}) past its {base.nbytes} B")
            params.append(GpuTensor(base.ptr + p.offset, (p.length,), np.dtype(np.uint8), base.keepalive))
        consts = [self.upload(np.frombuffer(c, np.uint8).copy()) for c in plan.constants]
        buffers = {
            "slab": [alloc(n) for n in plan.slabs],
            "param": params,
            "const": consts,
            "glob": [alloc(n) for n in plan.globals],
        }
        return ReplaySegment(seg, batch, plan, kernels, buffers, self.pool, self.stream)

    def close(self) -> None:
        """Drop slabs, parameters and modules (the caller synchronizes the stream first)."""
        for s in self.segments.values():
            for t in (*s.bases["slab"], *s.bases["const"], *s.bases["glob"], *s.aligned.values()):
                t.keepalive.close(self.stream)
        for t in self.params.values():
            t.keepalive.close(self.stream)
        self.segments.clear()
        self.params.clear()
        self.modules.clear()


def compare(a: np.ndarray, b: np.ndarray) -> str:
    """ "" when two results are bit-identical, else what differs."""
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    x, y = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if x.nbytes != y.nbytes:
        return f"{x.nbytes} vs {y.nbytes} bytes"
    diff = np.flatnonzero(x != y)
    return "" if diff.size == 0 else f"{diff.size} of {x.nbytes} bytes differ (first at byte {int(diff[0])})"


def random_input(spec_shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Inputs for the both-ways check: random bytes of the right range (never zeros)."""
    dt = np.dtype(dtype)
    if dt.kind in "ui":
        info = np.iinfo(dt)
        return rng.integers(max(info.min, -128), min(info.max, 255) + 1, size=spec_shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=spec_shape).astype(dt)
    return rng.standard_normal(spec_shape).astype(dt)


def log_fallback(seg: Segment, batch: int, why: str) -> None:
    log.warning("track B segment %s at batch %d: replay differs from the IREE runtime (%s); "
                "running it through the IREE runtime", seg.name, batch, why)  # fmt: skip
