"""The Track A executor: hand-written kernels on our stream, in the shared context.

Modules of the device's image (runtime/images.py) loaded once, through runtime/driver.py (PTX
JIT-compiled once and cached); weights packed by each kernel's spec and uploaded once;
activations in buffers planned once per batch size from a stream-ordered pool, reused on every
run. Each launch is prepared once per call, batch size and set of pointers by the call's kernel
spec (``KernelSpec.prepare``: on sm_90a a conv3x3 runs the TMA + wgmma kernel wherever it can,
with its tensor maps encoded for those fixed buffers and kept with the launch); with CUDA graphs
on, a segment's launches are captured once per batch size and replayed.

cuda.core 1.2 (``Graph``/``GraphBuilder``, ``launch``) is not adopted here: the launches go
through runtime/driver.py's one checker, whose errors name the fix, and its Stream is what IREE
and the memory pool share; the capture below is four driver calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from dualtrack import kernels
from dualtrack.contract.plan import ALIAS_OPS, KernelCall, Plan, Segment
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime import tma
from dualtrack.runtime.code_images import DeviceImages
from dualtrack.runtime.driver import (
    SHARED_DEFAULT,
    Context,
    Event,
    Kernel,
    Module,
    Stream,
    call,
    copy_async,
    graph_launch,
)
from dualtrack.runtime.memory import DeviceBuffer, DevicePool
from dualtrack.runtime.tensors import GpuTensor, Stats

# Poison written into Track A outputs before a verification run: fp16 / fp32 quiet NaN; a uint8
# mask gets 255 (no class id of a head of fewer than 256 classes).
_POISON = {"float16": (0x7E00, 2), "float32": (0x7FC00000, 4), "uint8": (0xFF, 1)}
_MEMSET = {1: cu.cuMemsetD8Async, 2: cu.cuMemsetD16Async, 4: cu.cuMemsetD32Async}


@dataclass
class Launch:
    """One prepared kernel launch (what :meth:`CudaBackend.prepare` returns): calling it enqueues
    the kernel on a stream. ``args`` hold everything the launch needs, tensor maps included."""

    kernel: Kernel
    config: kernels.LaunchConfig
    args: list[kernels.KernelArg]
    entry: str
    choice: kernels.ConvChoice | None = None  # conv3x3: which implementation, and why
    before: tuple[Launch, ...] = ()  # launched first, in order (a norm's statistics passes)

    def __call__(self, stream: Stream) -> None:
        for first in self.before:
            first(stream)
        self.kernel.launch(self.config.grid, self.config.block, self.config.shared_bytes, stream, self.args)


class TrackA:
    """Runs Track A segments of a plan on one stream (:meth:`run`); ``stats`` is the backend's."""

    def __init__(
        self,
        ctx: Context,
        stream: Stream,
        pool: DevicePool,
        stats: Stats,
        images: DeviceImages,
        *,
        root: Path,
        use_graphs: bool,
        jit_cache: Path,
    ) -> None:
        self.ctx, self.stream, self.pool, self.stats = ctx, stream, pool, stats
        self.use_graphs = use_graphs
        self.wgmma_off = images.wgmma_off
        self.device = ctx.device.info()  # what the conv chooser and the specs' grids plan for
        self.tuned = dict(images.tuned)  # Conv node -> batch -> entry (bundle.tuned_calls)
        self.launches: dict[tuple[str, int], tuple[tuple[int, ...], Launch]] = {}
        self.graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.staged: dict[tuple[int, int], dict[str, GpuTensor]] = {}
        self.buffers: dict[int, tuple[dict[str, GpuTensor], list[GpuTensor]]] = {}
        self.weights: dict[str, GpuTensor] = {}
        self.workspaces: dict[tuple[str, int], DeviceBuffer] = {}  # (call, batch) -> split-K scratch
        self.kernels = self.load(images, root, jit_cache)
        self.ev_start, self.ev_end = Event(ctx), Event(ctx)

    def load(self, images: DeviceImages, root: Path, jit_cache: Path) -> dict[str, Kernel]:
        """Every entry of the image's kernels (files under the bundle's ``root``; the wgmma module
        only where it may run), by name."""
        self.stats.image = images.description
        self.stats.wgmma = images.wgmma
        tuned_entries = {e for per in images.tuned.values() for e in per.values()}
        found: dict[str, Kernel] = {}
        for stem in sorted(images.files):
            if stem == kernels.CONV3X3_WGMMA.stem and images.wgmma_off:
                continue
            path = root / images.files[stem]["path"]
            mod = Module.load(
                self.ctx,
                path.read_bytes(),
                kind=images.kind,
                origin=str(path),
                target=images.arch,
                cache_dir=jit_cache if images.kind == "ptx" else None,
            )
            self.stats.module_load_ms[stem] = mod.load_ms
            self.stats.module_cache[stem] = mod.cache
            spec = kernels.spec_for_stem(stem)
            if spec is None:
                continue  # a kernel this version of dualtrack does not launch
            for entry in spec.entries:
                found[entry] = mod.function(entry)
            if spec is kernels.KERNELS["conv3x3"]:
                found.update((e, mod.function(e)) for e in sorted(tuned_entries))
            if spec is kernels.CONV3X3_WGMMA:
                for cfg in kernels.CONV3X3_WGMMA.all_configs:  # over 48 KiB: opt in once per function
                    found[cfg.entry].set_max_dynamic_shared(cfg.smem_bytes)
        return found

    def upload_weights(
        self, plan: Plan, weights: Mapping[str, np.ndarray], upload: Callable[[np.ndarray], GpuTensor]
    ) -> None:
        """Every Track A call's weights, packed as its kernel reads them (its spec's
        ``pack_weights``: KRSC, (4K, C), fp32 bias), uploaded once."""
        for seg in plan.segments:
            for c in seg.calls:
                if c.op in ALIAS_OPS:
                    continue
                for name, arr in kernels.kernel(c.op).pack_weights(c, weights).items():
                    self.weights[name] = upload(arr)

    def _plan_buffers(self, seg: Segment, batch: int) -> tuple[dict[str, GpuTensor], list[GpuTensor]]:
        """Every Track A tensor at this batch size, planned once and reused: (views, root buffers).

        A concatenation's inputs are channel slices of its output buffer (their producers write
        there with a channel stride), and a channel slice's output is a view of its input
        (``Segment.channel_views``), so no kernel ever copies for them.

        A buffer no other track reads whose pixels are not a multiple of 16 bytes (a segmentation
        head's 2 or 3 classes) gets its channel stride rounded up to 16 bytes (``Segment.buffer_widths``):
        every Track A kernel takes a channel stride, and the TMA / wgmma convolutions need one of 16
        bytes, so a head's 3x3 or 1x1 conv runs there (with 16-channel tiles) instead of on the
        direct entry's CUDA cores. Segment outputs stay dense: IREE reads them.
        """
        key = seg.index * 1_000_003 + batch
        if key in self.buffers:
            return self.buffers[key]
        specs = {t.name: t for t in (*seg.tensors, *seg.outputs)}
        widths = seg.buffer_widths()
        where = seg.channel_views()
        roots: dict[str, GpuTensor] = {}
        views: dict[str, GpuTensor] = {}
        for name, t in specs.items():
            root, offset = where[name]
            if root not in roots:
                r = specs[root]
                dtype = np.dtype(r.dtype)
                shape = (*r.at_batch(batch)[:-1], widths[root])
                buf = self.pool.alloc(int(np.prod(shape)) * dtype.itemsize, self.stream)
                roots[root] = GpuTensor(int(buf), shape, dtype, buf)
            base = roots[root]
            views[name] = GpuTensor(
                base.ptr + offset * base.dtype.itemsize,
                t.at_batch(batch),
                np.dtype(t.dtype),
                base.keepalive,
                ld=base.shape[-1] if root != name or base.shape[-1] != t.shape[-1] else 0,
            )
        self.buffers[key] = (views, list(roots.values()))
        return self.buffers[key]

    def run(self, seg: Segment, batch: int, ins: dict[str, GpuTensor], *, poison: bool) -> dict[str, GpuTensor]:
        """Enqueue the segment's launches between ``ev_start`` and ``ev_end``; returns its outputs."""
        views, roots = self._plan_buffers(seg, batch)
        env: dict[str, GpuTensor] = {**ins, **views}
        if poison:
            for t in roots:
                value, width = _POISON[t.dtype.name]
                call(_MEMSET[width], t.ptr, value, t.nbytes // width, self.stream.handle)
        self.ev_start.record(self.stream)
        if self.use_graphs:
            # A graph replays fixed addresses: inputs (IREE's buffers, new every call) are copied into
            # planned ones first, a few microseconds of device bandwidth against one launch per kernel.
            staged = self._staged_inputs(seg, batch)
            for name, t in ins.items():
                copy_async("DtoD", staged[name].ptr, t.ptr, t.nbytes, self.stream.handle)
            graph_launch(self._graph(seg, batch, {**env, **staged}), self.stream.handle)
        else:
            self._launch_all(seg, env)
        self.ev_end.record(self.stream)
        return {t.name: env[t.name] for t in seg.outputs}

    def enqueue(self, seg: Segment, batch: int, ins: dict[str, GpuTensor]) -> dict[str, GpuTensor]:
        """Queue the segment's launches on the stream, reading ``ins`` where they are (no events,
        no graph of its own): what the backend records into one graph for a whole inference."""
        views, _roots = self._plan_buffers(seg, batch)
        env: dict[str, GpuTensor] = {**ins, **views}
        self._launch_all(seg, env)
        return {t.name: env[t.name] for t in seg.outputs}

    def _launch_all(self, seg: Segment, env: dict[str, GpuTensor]) -> None:
        for c in seg.calls:
            if c.op not in ALIAS_OPS:
                self._launch(c, env)

    def _staged_inputs(self, seg: Segment, batch: int) -> dict[str, GpuTensor]:
        key = (seg.index, batch)
        if key not in self.staged:
            staged = {}
            for t in seg.inputs:
                dtype = np.dtype(t.dtype)
                buf = self.pool.alloc(int(np.prod(t.at_batch(batch))) * dtype.itemsize, self.stream)
                staged[t.name] = GpuTensor(int(buf), t.at_batch(batch), dtype, buf)
            self.staged[key] = staged
        return self.staged[key]

    def _graph(self, seg: Segment, batch: int, env: dict[str, GpuTensor]) -> Any:
        """The segment's launches captured once per batch size as a CUDA graph, then replayed."""
        key = (seg.index, batch)
        if key not in self.graphs:
            # Prepare first (tensor maps: cuTensorMapEncodeTiled): only launches are captured.
            for c in seg.calls:
                if c.op not in ALIAS_OPS:
                    self._prepared(c, env)
            mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
            with self.pool.capture(self.stream):
                call(cu.cuStreamBeginCapture, self.stream.handle, mode)
                try:
                    self._launch_all(seg, env)
                except BaseException:
                    cu.cuStreamEndCapture(self.stream.handle)  # leave capture mode; the launch error wins
                    raise
                graph = call(cu.cuStreamEndCapture, self.stream.handle)
            self.graphs[key] = (graph, call(cu.cuGraphInstantiate, graph, 0))
        return self.graphs[key][1]

    def _launch(self, c: KernelCall, env: dict[str, GpuTensor]) -> None:
        self._prepared(c, env)(self.stream)

    def _prepared(self, c: KernelCall, env: dict[str, GpuTensor]) -> Launch:
        """A call's launch, prepared once per call, batch size and pointers (the planned buffers do
        not move; a segment input in the one-by-one path may, and then the launch, tensor maps
        included, is prepared again). Records the conv3x3 choice in ``stats.conv3x3``."""
        outs = [env[o] for o in c.outputs]
        key = (_call_key(c), outs[0].shape[0])
        pointers = tuple(v for t in (*(env[i] for i in c.inputs), *outs) for v in (t.ptr, t.channel_stride))
        cached = self.launches.get(key)
        if cached is None or cached[0] != pointers:
            launch = self.prepare(c, env)
            if launch.choice is not None:
                self.stats.conv3x3.setdefault(key[0], {})[key[1]] = launch.choice.to_json()
            cached = self.launches[key] = (pointers, launch)
        return cached[1]

    def prepare(self, c: KernelCall, env: Mapping[str, GpuTensor], *, allow_wgmma: bool = True) -> Launch:
        """The launch of one kernel call on the tensors ``env`` names for its inputs and output
        (the planned buffers, or others of the same shapes: bench/bench.py times layers this way),
        as the call's kernel spec prepares it (``KernelSpec.prepare_outputs``: entry, geometry,
        arguments, tensor maps). ``allow_wgmma=False``: a conv3x3 never runs the wgmma kernel."""
        wgmma_off = self.wgmma_off if allow_wgmma else "not allowed (prepare(allow_wgmma=False))"
        key = (_call_key(c), env[c.outputs[0]].shape[0])
        ctx = _Context(wgmma_off, self.device, self.tuned, lambda nbytes: self._workspace(key, nbytes))
        weights = [self.weights[name] for name in c.weights]
        inputs = [env[name] for name in c.inputs]
        outputs = [env[name] for name in c.outputs]
        p = kernels.kernel(c.op).prepare_outputs(c, inputs, outputs, weights, ctx)
        for q in (*p.before, p):  # a launch over 48 KiB of dynamic shared memory opts in first
            if q.config.shared_bytes > SHARED_DEFAULT:
                self.kernels[q.entry].set_max_dynamic_shared(q.config.shared_bytes)
        before = tuple(Launch(self.kernels[b.entry], b.config, b.args, b.entry) for b in p.before)
        return Launch(self.kernels[p.entry], p.config, p.args, p.entry, p.choice, before)

    def _workspace(self, key: tuple[str, int], nbytes: int) -> int:
        """Zeroed scratch memory of one call at one batch size (a launch prepared again for other
        pointers reuses it: its split-K counters are back at zero after every launch)."""
        have = self.workspaces.get(key)
        if have is None or have.nbytes < nbytes:
            if have is not None:
                have.close(self.stream)
            have = self.workspaces[key] = self.pool.alloc(nbytes, self.stream)
            call(cu.cuMemsetD8Async, have.ptr, 0, nbytes, self.stream.handle)
        return have.ptr

    def close(self) -> None:
        """Free graphs, planned buffers, workspaces and weights (the caller synchronizes the stream first)."""
        for graph, graph_exec in self.graphs.values():
            call(cu.cuGraphExecDestroy, graph_exec)
            call(cu.cuGraphDestroy, graph)
        self.graphs.clear()
        self.launches.clear()
        for staged in self.staged.values():
            for t in staged.values():
                t.keepalive.close(self.stream)
        for _views, roots in self.buffers.values():
            for t in roots:
                t.keepalive.close(self.stream)
        for buf in self.workspaces.values():
            buf.close(self.stream)
        self.workspaces.clear()
        self.weights.clear()
        self.ev_start.close()  # now, in this context (a handle freed later could name one since recreated)
        self.ev_end.close()


@dataclass(frozen=True)
class _Context:
    """What a kernel spec asks the runtime while it prepares a launch (``kernels.LaunchContext``)."""

    wgmma_off: str | None
    device: kernels.DeviceInfo  # the GPU launched on (runtime.driver.Device.info)
    tuned: Mapping[str, Mapping[str, str]]  # Conv node -> batch size -> tuned entry
    alloc: Callable[[int], int]  # zeroed scratch of the call being prepared (TrackA._workspace)

    def tuned_entry(self, call: KernelCall, batch: int) -> str | None:
        return self.tuned.get(call.nodes[0], {}).get(str(batch)) if call.nodes else None

    def tensor_map(self, m: TiledMap) -> cu.CUtensorMap:
        return tma.encode(m)

    def workspace(self, nbytes: int) -> int:
        return self.alloc(nbytes)


def _call_key(c: KernelCall) -> str:
    """A kernel call's name: its first ONNX node (the Conv node for a conv), else its output."""
    return c.nodes[0] if c.nodes else c.outputs[0]
