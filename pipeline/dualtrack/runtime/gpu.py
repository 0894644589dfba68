"""The GPU backend: runs a plan's segments on one GPU, both tracks in ONE CUDA context.

- Context: the device's primary context, retained here and made current (FACTS 5: IREE's CUDA HAL
  uses the same one), so pointers pass between the tracks as they are.
- What runs here: runtime/images.py's :func:`device_images` (Track A cubin or PTX, IREE target).
- Track A: runtime/track_a.py (modules, weights, planned buffers, prepared launches, CUDA graphs).
- Track B: runtime/track_b.py: each module's launch plan replayed on our stream
  (runtime/replay.py), or the IREE CUDA module (zero-copy DLPack in and out).
- This module: host <-> device copies through pinned staging, and the order between the tracks.
  Replayed Track B launches share our stream with Track A: no wait between them, and when every
  Track B module of a batch size replays, the whole inference is captured once as ONE CUDA graph
  (:meth:`CudaBackend.run_plan`). Through the IREE runtime, which can neither wait on nor signal a
  CUDA event (FACTS 8), the tracks meet in the A -> B direction with a host wait (see
  `_handoff_to_iree`); B -> A needs none: IREE's synchronous call returns after its work is complete.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import KernelCall, Segment, TensorSpec
from dualtrack.errors import InputError
from dualtrack.runtime import dlpack
from dualtrack.runtime.code_images import device_images
from dualtrack.runtime.driver import Device, Event, Kernel, Stream, call, copy_async, graph_launch
from dualtrack.runtime.memory import DeviceBuffer, DevicePool, HostBuffer, download, upload
from dualtrack.runtime.replay import Replayer
from dualtrack.runtime.tensors import GpuTensor, Stats
from dualtrack.runtime.track_a import Launch, TrackA
from dualtrack.runtime.track_b import TrackB
from dualtrack.settings import Settings

__all__ = ["CudaBackend", "GpuTensor", "Launch", "Stats"]


class CudaBackend:
    """Runs a plan's segments on one GPU: Track A kernels on our stream, Track B through IREE CUDA."""

    def __init__(self, bundle: Bundle, device_index: int = 0, settings: Settings | None = None) -> None:
        settings = settings or Settings.from_env()
        self.bundle = bundle
        self.device = Device(device_index)
        self.ctx = self.device.primary_context()
        self.stream = Stream(self.ctx)
        self.pool = DevicePool(self.ctx)
        self.stats = Stats()
        self.timings = {"A": 0.0, "B": 0.0, "graph": 0.0}
        self.poison = False
        self.track_a_pending = False  # Track A launches queued since the last host wait
        self.stream_pending = False  # any work queued on our stream since the last host wait
        self.plan_graphs: dict[int, tuple[Any, Any, dict[str, GpuTensor], dict[str, GpuTensor]]] = {}
        self.graph_events: tuple[Event, Event] | None = None
        self.graph_ok: dict[tuple[int, int], bool] = {}
        self.import_event: Event | None = None
        self.graph_pending = False
        self.staging: dict[int, HostBuffer] = {}
        self.host_arrays: list[HostBuffer] = []  # handed out by host_array(); uploaded from directly
        self.slots: dict[tuple[str | None, int], DeviceBuffer] = {}
        images = device_images(bundle, self.device.cc, wgmma=settings.wgmma)
        self.target = images.iree_target
        replayer = Replayer(
            bundle, images.iree_target, self.ctx, self.stream, self.pool,
            jit_cache=settings.cache_dir / "jit",
            enabled="" if settings.track_b == "replay" else "DUALTRACK_TRACK_B=iree",
        )  # fmt: skip
        self.track_b = TrackB(bundle, device_index, images.iree_target, settings, replayer)
        self.track_a = TrackA(
            self.ctx, self.stream, self.pool, self.stats, images,
            root=bundle.root, use_graphs=settings.cuda_graphs, jit_cache=settings.cache_dir / "jit",
        )  # fmt: skip
        self.track_a.upload_weights(bundle.plan, bundle.weights, self.from_host)
        self.stream.synchronize()

    # Track A's state, as engine.py, bench/bench.py and the GPU tests read it.
    @property
    def kernels(self) -> dict[str, Kernel]:
        return self.track_a.kernels

    @property
    def tuned(self) -> dict[str, dict[str, str]]:
        return self.track_a.tuned

    @property
    def wgmma_off(self) -> str | None:
        return self.track_a.wgmma_off

    @property
    def use_graphs(self) -> bool:
        return self.track_a.use_graphs

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:
        self.track_a.use_graphs = on

    def prepare(self, c: KernelCall, env: Mapping[str, GpuTensor], *, allow_wgmma: bool = True) -> Launch:
        """:meth:`TrackA.prepare`: the launch of one call on the tensors ``env`` names."""
        return self.track_a.prepare(c, env, allow_wgmma=allow_wgmma)

    # -- host <-> device ----------------------------------------------------------------------------

    def import_tensor(self, x: Any) -> GpuTensor:
        """Another library's GPU tensor (DLPack or ``__cuda_array_interface__``), without a copy and
        ordered before our stream's next work. DLPack's producer is asked to make its pending
        writes visible on the legacy default stream (``__dlpack__(stream=1)``: for torch on its
        default stream, nothing to do; a side stream gets one event), and our stream waits for that
        stream with an event, on the device (asking for our own stream instead costs torch tens of
        microseconds a call). Refuses what the kernels cannot read as given."""
        if hasattr(x, "__dlpack__"):
            try:
                capsule = x.__dlpack__(stream=1)
            except TypeError:  # a producer without the stream argument (DLPack < 0.6)
                capsule = x.__dlpack__()
            imp = dlpack.from_capsule(capsule)
            self._wait_for(0)
        else:
            imp = dlpack.from_cuda_array_interface(x, wait=self._wait_for)
        if imp.device_type not in (dlpack.DLDeviceType.kDLCUDA, dlpack.DLDeviceType.kDLCUDAManaged):
            raise InputError("the tensor is not in GPU memory; pass a numpy array or a CUDA tensor")
        if imp.device_id not in (-1, self.device.index):
            raise InputError(f"the tensor is on GPU {imp.device_id}, this engine on GPU {self.device.index}; move it")
        dense = dlpack.compact_strides(imp.shape)
        if any(n > 1 and a != b for n, a, b in zip(imp.shape, imp.strides, dense, strict=True)):
            raise InputError(f"the tensor has strides {imp.strides}, not dense row-major; pass x.contiguous()")
        return GpuTensor(imp.ptr, imp.shape, imp.dtype, imp.keepalive)

    def _wait_for(self, stream: int) -> None:
        """Our stream waits (on the device) for the work queued so far on ``stream`` (0: legacy default)."""
        if self.import_event is None:
            self.import_event = Event(self.ctx, timing=False)
        call(cu.cuEventRecord, self.import_event.handle, cu.CUstream(stream))
        self.stream.wait(self.import_event)

    def own(self, t: GpuTensor) -> GpuTensor:
        """``t`` in a buffer of its own, ordered after the work queued so far: what a caller may keep
        while the next inference rewrites the planned buffers ``t`` may live in."""
        buf = self.pool.alloc(max(t.nbytes, 1), self.stream)
        copy_async("DtoD", int(buf), t.ptr, t.nbytes, self.stream.handle)
        return GpuTensor(int(buf), t.shape, t.dtype, buf)

    def from_host(self, arr: np.ndarray, *, slot: str | None = None) -> GpuTensor:
        """Upload through pinned staging, or straight from ``arr`` when it lies in a
        :meth:`host_array`. With `slot`, the device buffer is kept and reused by the next upload to
        the same slot and size (the engine's input: no allocation per request)."""
        arr = np.ascontiguousarray(arr)
        key = (slot, arr.nbytes)
        if slot is not None and key in self.slots:
            buf = self.slots[key]
        else:
            buf = self.pool.alloc(max(arr.nbytes, 1), self.stream)
            if slot is not None:
                self.slots[key] = buf
        if self._is_host_array(arr):
            upload(self.stream, buf, arr, arr.nbytes)
        else:
            staging = self._staging(arr.nbytes)
            staging.numpy(np.uint8, (arr.nbytes,))[:] = arr.reshape(-1).view(np.uint8)
            upload(self.stream, buf, staging, arr.nbytes)
        # The staging buffer is reused and a host array is the caller's again once run() returns:
        # the copy must be done before either is written.
        self._host_wait()
        return GpuTensor(int(buf), arr.shape, arr.dtype, buf)

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A zeroed page-locked array, freed by close(); from_host uploads from it without staging."""
        self.ctx.make_current()  # callers may be on any thread
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buf = HostBuffer(self.ctx, max(nbytes, 1))
        self.host_arrays.append(buf)
        arr = buf.numpy(dtype, shape)
        arr.fill(0)
        return arr

    def _is_host_array(self, arr: np.ndarray) -> bool:
        start = arr.ctypes.data
        return any(b.ptr <= start and start + arr.nbytes <= b.ptr + b.nbytes for b in self.host_arrays)

    def to_host(self, t: Any) -> np.ndarray:
        if isinstance(t, np.ndarray):
            return t
        out = np.empty(t.shape, t.dtype)
        staging = self._staging(t.nbytes)
        download(self.stream, staging, _Raw(t.ptr, t.nbytes), t.nbytes)
        self._host_wait()
        out.reshape(-1).view(np.uint8)[:] = staging.numpy(np.uint8, (t.nbytes,))
        return out

    def _staging(self, nbytes: int) -> HostBuffer:
        size = 1 << max(nbytes - 1, 1).bit_length()
        if size not in self.staging:
            self.staging[size] = HostBuffer(self.ctx, size)
        return self.staging[size]

    def _host_wait(self) -> None:
        t0 = time.perf_counter()
        self.stream.synchronize()
        self.stats.host_waits += 1
        self.stats.host_wait_ms += (time.perf_counter() - t0) * 1e3
        self.stream_pending = self.track_a_pending = False
        self.collect_timings()

    def collect_timings(self) -> None:
        """Add the last whole-inference graph's GPU time to ``timings["graph"]`` (once its work is
        complete: after a host wait)."""
        if self.graph_pending and self.graph_events is not None:
            self.timings["graph"] = self.timings.get("graph", 0.0) + self.graph_events[0].elapsed_ms(
                self.graph_events[1]
            )
            self.graph_pending = False

    # -- execution ----------------------------------------------------------------------------------

    def run_plan(self, batch: int, inputs: Mapping[str, Any], *, timed: bool = True) -> dict[str, Any]:
        """Every segment of the plan at ``batch``, as one CUDA graph where every Track B module
        replays and CUDA graphs are on (captured on the first call, then one graph launch after
        copying the inputs into the graph's own; no host wait); else segment by segment.
        ``timed=False`` leaves out the graph's timing events (``timings["graph"]``): two driver
        calls fewer for a caller that never reads them (the overlapped launch, runtime/overlap.py)."""
        plan = self.bundle.plan
        if not self._one_graph(batch):
            env = dict(inputs)
            for seg in plan.segments:
                env.update(self.run_segment(seg, batch, env))
            return {o.name: env[o.name] for o in plan.outputs}
        self.ctx.make_current()  # callers may be on any thread
        ins = {t.name: self._as_gpu(inputs[t.name], t, batch) for t in plan.inputs}
        _graph, graph_exec, staged, outs = self._plan_graph(batch)
        for name, t in ins.items():
            if t.ptr != staged[name].ptr:
                copy_async("DtoD", staged[name].ptr, t.ptr, t.nbytes, self.stream.handle)
        if not timed:
            graph_launch(graph_exec, self.stream.handle)
            self.stream_pending = True
            return dict(outs)
        if self.graph_events is None:
            self.graph_events = (Event(self.ctx), Event(self.ctx))
        self.graph_events[0].record(self.stream)
        graph_launch(graph_exec, self.stream.handle)
        self.graph_events[1].record(self.stream)
        self.graph_pending = self.stream_pending = True
        return dict(outs)

    def runs_on_stream(self, batch: int) -> bool:
        """Whether a run at ``batch`` is known to be one CUDA graph on :attr:`stream` (nothing of it on
        IREE's own streams), from any thread without a lock: False until a run has decided it."""
        if self.poison or not self.track_a.use_graphs:
            return False
        return self.graph_ok.get((batch, self.track_b.replayer.version), False)

    def _one_graph(self, batch: int) -> bool:
        """Whether this batch size runs as one graph: graphs on, no poisoned verification run, and
        every Track B module replayed (decided once per batch and set of refusals)."""
        if self.poison or not self.track_a.use_graphs:
            return False
        key = (batch, self.track_b.replayer.version)
        if key not in self.graph_ok:
            segs = self.bundle.plan.segments
            self.graph_ok[key] = all(self.track_b.decide(s, batch).path == "replay" for s in segs if s.track == "B")
            if not self.graph_ok[key]:
                self._drop_graph(batch)
        return self.graph_ok[key]

    def _drop_graph(self, batch: int) -> None:
        if batch in self.plan_graphs:
            graph, graph_exec, staged, _outs = self.plan_graphs.pop(batch)
            self.stream.synchronize()
            call(cu.cuGraphExecDestroy, graph_exec)
            call(cu.cuGraphDestroy, graph)
            for t in staged.values():
                t.keepalive.close(self.stream)

    def _plan_graph(self, batch: int) -> tuple[Any, Any, dict[str, GpuTensor], dict[str, GpuTensor]]:
        if batch in self.plan_graphs:
            return self.plan_graphs[batch]
        plan = self.bundle.plan
        staged = {}
        for t in plan.inputs:
            dtype = np.dtype(t.dtype)
            buf = self.pool.alloc(int(np.prod(t.at_batch(batch))) * dtype.itemsize, self.stream)
            staged[t.name] = GpuTensor(int(buf), t.at_batch(batch), dtype, buf)
        # Once uncaptured: modules load, buffers are planned and launches prepared (tensor maps),
        # so that the capture below records launches on the same, final pointers and nothing else.
        self._enqueue_plan(batch, dict(staged))
        self.stream.synchronize()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        with self.pool.capture(self.stream):
            call(cu.cuStreamBeginCapture, self.stream.handle, mode)
            try:
                env = self._enqueue_plan(batch, dict(staged))
            except BaseException:
                cu.cuStreamEndCapture(self.stream.handle)  # leave capture mode; the launch error wins
                raise
            graph = call(cu.cuStreamEndCapture, self.stream.handle)
        outs = {o.name: env[o.name] for o in plan.outputs}
        self.plan_graphs[batch] = (graph, call(cu.cuGraphInstantiate, graph, 0), staged, outs)
        return self.plan_graphs[batch]

    def _enqueue_plan(self, batch: int, env: dict[str, GpuTensor]) -> dict[str, GpuTensor]:
        for seg in self.bundle.plan.segments:
            ins = {t.name: env[t.name] for t in seg.inputs}
            if seg.track == "A":
                env.update(self.track_a.enqueue(seg, batch, ins))
            else:
                env.update(self.track_b.replay(seg, batch, ins, self.stream))
        return env

    def run_segment(self, seg: Segment, batch: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
        self.ctx.make_current()  # callers may be on any thread
        ins = {t.name: self._as_gpu(inputs[t.name], t, batch) for t in seg.inputs}
        if seg.track == "A":
            out = self.track_a.run(seg, batch, ins, poison=self.poison)
            self.track_a_pending = self.stream_pending = True  # settled by an IREE call (_handoff_to_iree)
            return out
        if self.track_b.decide(seg, batch).path == "replay":
            self.stream_pending = True  # our stream: ordered after Track A, no wait
            return self.track_b.replay(seg, batch, ins, self.stream)
        timed_a = self.track_a_pending
        waits = self.stream_pending
        out, call_ms = self.track_b.run(seg, batch, ins, before_call=self._handoff_to_iree if waits else _nothing)
        self.timings["B"] += call_ms
        if timed_a:  # after the call: off the A -> B path too
            self.timings["A"] += self.track_a.ev_start.elapsed_ms(self.track_a.ev_end)
        return out

    def _as_gpu(self, value: Any, spec: TensorSpec, batch: int) -> GpuTensor:
        if isinstance(value, GpuTensor):
            t = value
        elif isinstance(value, np.ndarray):
            t = self.from_host(value)
        else:
            t = self.import_tensor(value)
        want = spec.at_batch(batch)
        if tuple(t.shape) != want or t.dtype.name != spec.dtype:
            raise InputError(f"{spec.name}: got {t.shape} {t.dtype}, expected {want} {spec.dtype}")
        return t

    def _handoff_to_iree(self) -> None:
        """Host wait before IREE reads what Track A wrote on our stream: the one wait per A -> B edge.

        IREE runs on its own streams and 3.13 cannot import a CUDA event or wait on a foreign
        stream (HalSemaphore.import_timepoint with CUDA_EVENT is UNIMPLEMENTED, FACTS 8). With
        that, or with `cuStreamWaitValue32` on a value IREE signals, this wait would become a
        device-side dependency and the host would not block. B -> A needs no wait: IREE's
        synchronous call returns after its work is complete.
        """
        t0 = time.perf_counter()
        self.stream.synchronize()  # Track A's launches and any replayed Track B ones before them
        self.stats.host_waits += 1
        self.stats.host_wait_ms += (time.perf_counter() - t0) * 1e3
        self.track_a_pending = self.stream_pending = False

    def close(self) -> None:
        self.ctx.make_current()
        self.stream.synchronize()  # nothing may still run when modules and buffers go away
        for batch in list(self.plan_graphs):
            self._drop_graph(batch)
        for ev in (*(self.graph_events or ()), *([self.import_event] if self.import_event else [])):
            ev.close()  # now, in this context: a handle freed later could name a context since recreated
        self.track_b.close()
        self.track_a.close()
        for b in self.slots.values():
            b.close(self.stream)
        self.stream.synchronize()
        self.track_a.kernels.clear()
        for h in (*self.staging.values(), *self.host_arrays):
            h.close()
        self.pool.close()
        self.stream.close()
        # The primary context is not released here but by its finalizer, once the last object made
        # in it (a result a caller still holds, the pool under it) is gone: released earlier, a
        # later engine could retain a new primary context in which those handles name nothing, and
        # freeing them crashed the driver (H200, driver 580: tests/gpu/test_gpu_decode_gpu.py).


def _nothing() -> None:
    pass


@dataclass
class _Raw:
    """A borrowed device range, for download() from memory IREE owns."""

    ptr: int
    nbytes: int

    def __int__(self) -> int:
        return self.ptr
