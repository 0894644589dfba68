"""The GPU backend: runs a plan's segments on one GPU, both tracks in ONE CUDA context.

- Context: the device's primary context, retained here and made current (FACTS 5: IREE's CUDA HAL
  uses the same one), so pointers pass between the tracks as they are.
- What runs here: runtime/images.py's :func:`device_images` (Track A cubin or PTX, IREE target).
- Track A: runtime/track_a.py (modules, weights, planned buffers, prepared launches, CUDA graphs).
- Track B: runtime/track_b.py (IREE CUDA modules, zero-copy DLPack in and out).
- This module: host <-> device copies through pinned staging, and the order between the tracks.
  IREE 3.13 can neither wait on nor signal a CUDA event (FACTS 8), so the one place the tracks
  meet in the A -> B direction costs a host wait (see `_handoff_to_iree`). B -> A needs none:
  IREE's synchronous call returns after its work is complete.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dualtrack.bundle import Bundle
from dualtrack.errors import InputError
from dualtrack.plan import KernelCall, Segment, TensorSpec
from dualtrack.runtime import dlpack
from dualtrack.runtime.driver import Device, Kernel, Stream
from dualtrack.runtime.images import device_images
from dualtrack.runtime.memory import DeviceBuffer, DevicePool, HostBuffer, download, upload
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
        self.timings = {"A": 0.0, "B": 0.0}
        self.poison = False
        self.track_a_pending = False
        self.staging: dict[int, HostBuffer] = {}
        self.host_arrays: list[HostBuffer] = []  # handed out by host_array(); uploaded from directly
        self.slots: dict[tuple[str | None, int], DeviceBuffer] = {}
        images = device_images(bundle, self.device.cc, wgmma=settings.wgmma)
        self.target = images.iree_target
        self.track_b = TrackB(bundle, device_index, images.iree_target, settings)
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
            out = self.track_a.run(seg, batch, ins, poison=self.poison)
            self.track_a_pending = True  # settled by the next Track B segment (_handoff_to_iree)
            return out
        timed_a = self.track_a_pending
        out, call_ms = self.track_b.run(seg, batch, ins, before_call=self._handoff_to_iree if timed_a else _nothing)
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

    def _handoff_to_iree(self) -> None:
        """Host wait before IREE reads what Track A wrote on our stream: the one wait per A -> B edge.

        IREE runs on its own streams and 3.13 cannot import a CUDA event or wait on a foreign
        stream (HalSemaphore.import_timepoint with CUDA_EVENT is UNIMPLEMENTED, FACTS 8). With
        that, or with `cuStreamWaitValue32` on a value IREE signals, this wait would become a
        device-side dependency and the host would not block. B -> A needs no wait: IREE's
        synchronous call returns after its work is complete.
        """
        t0 = time.perf_counter()
        self.track_a.ev_end.synchronize()
        self.stats.host_waits += 1
        self.stats.host_wait_ms += (time.perf_counter() - t0) * 1e3
        self.track_a_pending = False

    def close(self) -> None:
        self.ctx.make_current()
        self.stream.synchronize()  # nothing may still run when modules and buffers go away
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
        self.ctx.close()


def _nothing() -> None:
    pass


@dataclass
class _Raw:
    """A borrowed device range, for download() from memory IREE owns."""

    ptr: int
    nbytes: int

    def __int__(self) -> int:
        return self.ptr
