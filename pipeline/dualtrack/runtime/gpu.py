"""The shared Driver API loader: Track A kernels and Track B IREE modules in ONE CUDA context.

- Context: the device's primary context, retained here and made current (FACTS 5: IREE's CUDA HAL
  uses the same one), so pointers pass between the tracks as they are.
- Track A: the bundle's cubin for this exact arch, else its PTX JIT-compiled once and cached
  (runtime/driver.py); weights repacked (KRSC, fp32 bias) and uploaded once; activations in
  buffers planned once per batch size from a stream-ordered pool, reused on every run. Each
  launch is prepared once per call, batch size and set of pointers (:meth:`CudaBackend.prepare`):
  on sm_90a a conv3x3 runs the TMA + wgmma kernel wherever it can (``kernels.choose_conv3x3``),
  with its two tensor maps encoded for those fixed buffers (runtime/tma.py) and kept with the
  launch; ``stats.conv3x3`` records which kernel each conv layer runs, and why.
- Track B: IREE CUDA modules. Inputs go in zero-copy as DLPack capsules over our buffers
  (FACTS 6); results come out zero-copy as DLPack capsules over IREE's buffers (FACTS 7, with
  `--cuda_async_allocations=false`).
- Ordering: IREE 3.13 can neither wait on nor signal a CUDA event (FACTS 8), so the one place the
  tracks meet in the A -> B direction costs a host wait (see `_handoff_to_iree`). B -> A needs
  none: IREE's synchronous call returns after its work is complete.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from dualtrack import arch, kernels
from dualtrack.bundle import Bundle
from dualtrack.errors import InputError
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.plan import ALIAS_OPS, KernelCall, Segment, TensorSpec
from dualtrack.runtime import dlpack, tma
from dualtrack.runtime.driver import Device, Event, Kernel, Module, Stream, call
from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index
from dualtrack.runtime.memory import DeviceBuffer, DevicePool, HostBuffer, download, upload
from dualtrack.settings import Settings

# Poison written into Track A outputs before a verification run: fp16 / fp32 quiet NaN.
_POISON = {"float16": (0x7E00, 2), "float32": (0x7FC00000, 4)}


@dataclass
class GpuTensor:
    """A device tensor in the engine's context: raw pointer, shape, dtype, and what keeps it alive."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    keepalive: object = None
    ld: int = 0  # per-pixel channel stride of an NHWC channel slice (0: dense)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def channel_stride(self) -> int:
        return self.ld or self.shape[-1]


@dataclass
class Stats:
    """What the GPU path paid and ran, for `make bench` and the result file."""

    module_load_ms: dict[str, float] = field(default_factory=dict)
    module_cache: dict[str, str] = field(default_factory=dict)
    image: str = ""
    host_waits: int = 0
    host_wait_ms: float = 0.0
    wgmma: str = ""  # whether conv3x3 launches may use the wgmma kernel here ("on: ..." / "off: why")
    # Conv node -> batch size -> the kernel its launches run ({"impl", "entry", "reason"}: ConvChoice)
    conv3x3: dict[str, dict[int, dict[str, str]]] = field(default_factory=dict)


@dataclass
class Launch:
    """One prepared kernel launch (what :meth:`CudaBackend.prepare` returns): calling it enqueues
    the kernel on a stream. ``args`` hold everything the launch needs, tensor maps included."""

    kernel: Kernel
    config: kernels.LaunchConfig
    args: list[kernels.KernelArg]
    entry: str
    choice: kernels.ConvChoice | None = None  # conv3x3: which implementation, and why

    def __call__(self, stream: Stream) -> None:
        self.kernel.launch(self.config.grid, self.config.block, self.config.shared_bytes, stream, self.args)


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
        self.timings = {"A": 0.0, "B": 0.0}
        self.poison = False
        self.track_a_pending = False
        self.staging: dict[int, HostBuffer] = {}
        self.host_arrays: list[HostBuffer] = []  # handed out by host_array(); uploaded from directly
        self.slots: dict[tuple[str | None, int], DeviceBuffer] = {}
        self.use_graphs = settings.cuda_graphs
        self.graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.staged: dict[tuple[int, int], dict[str, GpuTensor]] = {}
        self.buffers: dict[int, tuple[dict[str, GpuTensor], list[GpuTensor]]] = {}
        self.target = self._iree_target()
        self.iree = IreeDevice.create(
            "cuda", device_index, allocators=settings.iree_allocators, flags=settings.iree_flags
        )
        self.params = parameter_index(bundle.weights)
        self.modules: dict[tuple[int, int], IreeModule] = {}
        self.wgmma_off: str | None = "the bundle has no Track A kernels"  # None: conv3x3 may run wgmma
        self.launches: dict[tuple[str, int], tuple[tuple[int, ...], Launch]] = {}
        self.kernels = self._load_track_a(settings.cache_dir / "jit", wgmma=settings.wgmma)
        self.weights = self._upload_weights()
        self.ev_start, self.ev_end = Event(self.ctx), Event(self.ctx)

    # -- loading ----------------------------------------------------------------------------------

    def _iree_target(self) -> str:
        """The IREE module built for this device's arch (sm_89 PTX on Hopper, FACTS 1 and 4)."""
        built = [(t["arch"], t["track_b_iree_target"]) for t in self.bundle.manifest["targets"]]
        return "cuda-" + arch.choose_iree_target(self.device.cc, built)

    def _load_track_a(self, jit_cache: Path, *, wgmma: bool) -> dict[str, Kernel]:
        ta = self.bundle.track_a
        self.tuned: dict[str, dict[str, str]] = {}  # Conv node -> batch -> entry (bundle.tuned_calls)
        if not ta.get("kernels"):
            self.stats.wgmma = f"off: {self.wgmma_off}"
            return {}
        choice = arch.choose_image(self.device.cc, sorted(ta.get("cubin", {})), sorted(ta.get("ptx", {})))
        self.stats.image = f"{choice.kind} {choice.arch}: {choice.reason}"
        # Tuned tiles for this arch (dualtrack tune): their entries are in the image chosen above,
        # which the build compiled from the same target's PTX.
        self.tuned.update(self.bundle.tuned_calls(self.device.cc))
        tuned_entries = {e for per in self.tuned.values() for e in per.values()}
        image = ta[choice.kind][choice.arch]  # stem -> file: each target has its own set of kernels
        wgmma_stem = kernels.CONV3X3_WGMMA.stem
        if not wgmma:
            self.wgmma_off = "DUALTRACK_WGMMA=0"
        elif wgmma_stem not in image:
            self.wgmma_off = f"the {choice.arch} {choice.kind} has no {wgmma_stem} (sm_90a targets only)"
        else:
            self.wgmma_off = None
        self.stats.wgmma = (
            f"off: {self.wgmma_off}" if self.wgmma_off else f"on: {wgmma_stem} in the {choice.arch} {choice.kind}"
        )
        found: dict[str, Kernel] = {}
        for stem in sorted(image):
            if stem == wgmma_stem and self.wgmma_off:
                continue
            meta = image[stem]
            path = self.bundle.root / meta["path"]
            mod = Module.load(
                self.ctx,
                path.read_bytes(),
                kind=choice.kind,
                origin=str(path),
                target=choice.arch,
                cache_dir=jit_cache if choice.kind == "ptx" else None,
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
                for cfg in kernels.CONV3X3_WGMMA.configs:  # over 48 KiB: opt in once per function
                    found[cfg.entry].set_max_dynamic_shared(cfg.smem_bytes)
        return found

    def _upload_weights(self) -> dict[str, GpuTensor]:
        """Every Track A call's weights, packed as its kernel reads them (its spec's
        ``pack_weights``: KRSC, (4K, C), fp32 bias), uploaded once."""
        out: dict[str, GpuTensor] = {}
        for seg in self.bundle.plan.segments:
            for c in seg.calls:
                if c.op in ALIAS_OPS:
                    continue
                for name, arr in kernels.kernel(c.op).pack_weights(c, self.bundle.weights).items():
                    out[name] = self.from_host(arr)
        self.stream.synchronize()
        return out

    def module(self, seg: Segment, batch: int) -> IreeModule:
        key = (seg.index, batch)
        if key not in self.modules:
            self.modules[key] = IreeModule(self.iree, self.bundle.vmfb(seg, self.target, batch), self.params, "main")
        return self.modules[key]

    # -- host <-> device ----------------------------------------------------------------------------

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

    # -- execution ----------------------------------------------------------------------------------

    def run_segment(self, seg: Segment, batch: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
        self.ctx.make_current()  # callers may be on any thread
        ins = {t.name: self._as_gpu(inputs[t.name], t, batch) for t in seg.inputs}
        if seg.track == "A":
            return self._run_track_a(seg, batch, ins)
        return self._run_track_b(seg, batch, ins)

    def _as_gpu(self, value: Any, spec: TensorSpec, batch: int) -> GpuTensor:
        if isinstance(value, GpuTensor):
            t = value
        elif isinstance(value, np.ndarray):
            t = self.from_host(value)
        else:
            imp = (
                dlpack.from_capsule(value.__dlpack__())
                if hasattr(value, "__dlpack__")
                else dlpack.from_cuda_array_interface(value)
            )
            t = GpuTensor(imp.ptr, imp.shape, imp.dtype, imp.keepalive)
        want = spec.at_batch(batch)
        if tuple(t.shape) != want or t.dtype.name != spec.dtype:
            raise InputError(f"{spec.name}: got {t.shape} {t.dtype}, expected {want} {spec.dtype}")
        return t

    def _plan_buffers(self, seg: Segment, batch: int) -> tuple[dict[str, GpuTensor], list[GpuTensor]]:
        """Every Track A tensor at this batch size, planned once and reused: (views, root buffers).

        A concatenation's inputs are channel slices of its output buffer (their producers write
        there with a channel stride), so no kernel ever copies for a Concat.
        """
        key = seg.index * 1_000_003 + batch
        if key in self.buffers:
            return self.buffers[key]
        specs = {t.name: t for t in (*seg.tensors, *seg.outputs)}
        parent: dict[str, tuple[str, int]] = {}
        for c in seg.calls:
            if c.op in ALIAS_OPS:
                offset = 0
                for x in c.inputs:
                    parent[x] = (c.outputs[0], offset)
                    offset += specs[x].shape[-1]
        roots: dict[str, GpuTensor] = {}
        views: dict[str, GpuTensor] = {}
        for name, t in specs.items():
            root, offset = name, 0
            while root in parent:
                root, extra = parent[root]
                offset += extra
            if root not in roots:
                r = specs[root]
                dtype = np.dtype(r.dtype)
                buf = self.pool.alloc(int(np.prod(r.at_batch(batch))) * dtype.itemsize, self.stream)
                roots[root] = GpuTensor(int(buf), r.at_batch(batch), dtype, buf)
            base = roots[root]
            views[name] = GpuTensor(
                base.ptr + offset * base.dtype.itemsize,
                t.at_batch(batch),
                np.dtype(t.dtype),
                base.keepalive,
                ld=base.shape[-1] if root != name else 0,
            )
        self.buffers[key] = (views, list(roots.values()))
        return self.buffers[key]

    def _run_track_a(self, seg: Segment, batch: int, ins: dict[str, GpuTensor]) -> dict[str, Any]:
        views, roots = self._plan_buffers(seg, batch)
        env: dict[str, GpuTensor] = {**ins, **views}
        if self.poison:
            for t in roots:
                value, width = _POISON[t.dtype.name]
                fn = call_memset_d16 if width == 2 else call_memset_d32
                fn(t.ptr, value, t.nbytes // width, self.stream)
        self.ev_start.record(self.stream)
        if self.use_graphs:
            # A graph replays fixed addresses: inputs (IREE's buffers, new every call) are copied into
            # planned ones first, a few microseconds of device bandwidth against one launch per kernel.
            staged = self._staged_inputs(seg, batch)
            for name, t in ins.items():
                call(cu.cuMemcpyDtoDAsync, staged[name].ptr, t.ptr, t.nbytes, self.stream.handle)
            call(cu.cuGraphLaunch, self._graph(seg, batch, {**env, **staged}), self.stream.handle)
        else:
            self._launch_all(seg, env)
        self.ev_end.record(self.stream)
        self.track_a_pending = True  # settled by the next Track B segment (_handoff_to_iree)
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
            mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
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
        x, y = env[c.inputs[0]], env[c.outputs[0]]
        key = (_call_key(c), x.shape[0])
        pointers = (x.ptr, y.ptr, x.channel_stride, y.channel_stride)
        cached = self.launches.get(key)
        if cached is None or cached[0] != pointers:
            launch = self.prepare(c, env)
            if launch.choice is not None:
                self.stats.conv3x3.setdefault(key[0], {})[key[1]] = launch.choice.to_json()
            cached = self.launches[key] = (pointers, launch)
        return cached[1]

    def prepare(self, c: KernelCall, env: Mapping[str, GpuTensor], *, allow_wgmma: bool = True) -> Launch:
        """The launch of one kernel call on the tensors ``env`` names for its input and output
        (the planned buffers, or others of the same shapes: bench/bench.py times layers this way),
        as the call's kernel spec prepares it (``KernelSpec.prepare``: entry, geometry, arguments,
        tensor maps). ``allow_wgmma=False``: a conv3x3 never runs the wgmma kernel."""
        wgmma_off = self.wgmma_off if allow_wgmma else "not allowed (prepare(allow_wgmma=False))"
        ctx = _Context(wgmma_off, self.tuned)
        weights = [self.weights[name] for name in c.weights]
        p = kernels.kernel(c.op).prepare(c, env[c.inputs[0]], env[c.outputs[0]], weights, ctx)
        return Launch(self.kernels[p.entry], p.config, p.args, p.entry, p.choice)

    def _handoff_to_iree(self) -> None:
        """Host wait before IREE reads what Track A wrote on our stream: the one wait per A -> B edge.

        IREE runs on its own streams and 3.13 cannot import a CUDA event or wait on a foreign
        stream (HalSemaphore.import_timepoint with CUDA_EVENT is UNIMPLEMENTED, FACTS 8). With
        that, or with `cuStreamWaitValue32` on a value IREE signals, this wait would become a
        device-side dependency and the host would not block. B -> A needs no wait: IREE's
        synchronous call returns after its work is complete.
        """
        t0 = time.perf_counter()
        self.ev_end.synchronize()
        self.stats.host_waits += 1
        self.stats.host_wait_ms += (time.perf_counter() - t0) * 1e3
        self.track_a_pending = False

    def _run_track_b(self, seg: Segment, batch: int, ins: dict[str, GpuTensor]) -> dict[str, Any]:
        mod = self.module(seg, batch)
        dev = self.iree.device
        # The views only wrap pointers: made before the wait, they are off the A -> B critical path.
        views = [
            dev.from_dlpack_capsule(dlpack.to_capsule(t.ptr, t.shape, t.dtype, self.device.index, t.keepalive))
            for t in (ins[s.name] for s in seg.inputs)
        ]
        timed_a = self.track_a_pending
        if timed_a:
            self._handoff_to_iree()
        t0 = time.perf_counter()
        outs = mod.call_views(*views)  # synchronous: returns after IREE's work is complete (FACTS 8)
        self.timings["B"] += (time.perf_counter() - t0) * 1e3
        if timed_a:
            self.timings["A"] += self.ev_start.elapsed_ms(self.ev_end)  # after the call: off the path too
        result = {}
        for spec, out in zip(seg.outputs, outs, strict=True):
            view = getattr(out, "_buffer_view", out)  # FunctionInvoker wraps results in DeviceArray
            imp = dlpack.from_capsule(
                dev.create_dlpack_capsule(view, int(dlpack.DLDeviceType.kDLCUDA), self.device.index)
            )
            # IREE exports ONNX uint8 as int8 (signless i8): the plan's dtype is the truth.
            result[spec.name] = GpuTensor(imp.ptr, imp.shape, np.dtype(spec.dtype), (imp.keepalive, view))
        return result

    def close(self) -> None:
        self.ctx.make_current()
        self.stream.synchronize()  # nothing may still run when modules and buffers go away
        self.modules.clear()
        self.iree = None  # type: ignore[assignment]
        self.params = None  # an index still alive at interpreter exit is reported as a leak by nanobind
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
        for b in self.slots.values():
            b.close(self.stream)
        self.weights.clear()
        self.stream.synchronize()
        self.kernels.clear()
        for h in (*self.staging.values(), *self.host_arrays):
            h.close()
        self.pool.close()
        self.stream.close()
        self.ctx.close()


@dataclass(frozen=True)
class _Context:
    """What a kernel spec asks the runtime while it prepares a launch (``kernels.LaunchContext``)."""

    wgmma_off: str | None
    tuned: Mapping[str, Mapping[str, str]]  # Conv node -> batch size -> tuned entry

    def tuned_entry(self, call: KernelCall, batch: int) -> str | None:
        return self.tuned.get(call.nodes[0], {}).get(str(batch)) if call.nodes else None

    def tensor_map(self, m: TiledMap) -> cu.CUtensorMap:
        return tma.encode(m)


def _call_key(c: KernelCall) -> str:
    """A kernel call's name: its first ONNX node (the Conv node for a conv), else its output."""
    return c.nodes[0] if c.nodes else c.outputs[0]


@dataclass
class _Raw:
    """A borrowed device range, for download() from memory IREE owns."""

    ptr: int
    nbytes: int

    def __int__(self) -> int:
        return self.ptr


def call_memset_d16(ptr: int, value: int, count: int, stream: Stream) -> None:
    call(cu.cuMemsetD16Async, ptr, value, count, stream.handle)


def call_memset_d32(ptr: int, value: int, count: int, stream: Stream) -> None:
    call(cu.cuMemsetD32Async, ptr, value, count, stream.handle)
