"""GPU and pinned host memory: a stream-ordered pool, buffers that own their memory, copies.

Device memory comes from a dedicated pool (cuMemPoolCreate) whose release threshold is
UINT64_MAX, so memory freed between batches stays reserved in the pool instead of going back to
the driver, and the pool's high-water mark measures what a run really needed. Allocation and
free are stream-ordered (cuMemAllocFromPoolAsync / cuMemFreeAsync): a buffer is freed on the
stream that last used it, after the work already queued there.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from dualtrack.errors import CudaError, DeviceError
from dualtrack.runtime.driver import Context, Stream, call, copy_async, held_calls, release

UINT64_MAX = (1 << 64) - 1
_ATTR = cu.CUmemPool_attribute


def fmt_bytes(n: int) -> str:
    """Bytes for people: 1.50 GiB, 3.0 MiB, 512 B."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"


def oom_message(asked: int, free: int, total: int, pool_reserved: int, device: str) -> str:
    """The one line an out-of-memory failure prints: what was asked, what there is, what to do."""
    return (
        f"out of GPU memory on {device}: asked for {fmt_bytes(asked)} with {fmt_bytes(free)} free of "
        f"{fmt_bytes(total)} (dualtrack's pool holds {fmt_bytes(pool_reserved)}); use a smaller batch "
        "(--batch) or free the GPU of other processes (nvidia-smi)"
    )


class DevicePool:
    """A stream-ordered memory pool of one device that keeps what it reserves (threshold UINT64_MAX)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        props = cu.CUmemPoolProps()
        props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ctx.device.index
        self.handle: cu.CUmemoryPool = call(cu.cuMemPoolCreate, props)
        # Streams being captured into a CUDA graph, and frees that arrived meanwhile: a free queued on
        # a capturing stream would become a node of the graph (freed again at every replay).
        self.capturing: set[int] = set()
        self.deferred: list[tuple[int, Stream]] = []
        self._finalizer = weakref.finalize(self, release, ctx, cu.cuMemPoolDestroy, self.handle)
        call(cu.cuMemPoolSetAttribute, self.handle, _ATTR.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cu.cuuint64_t(UINT64_MAX))

    @contextlib.contextmanager
    def capture(self, stream: Stream) -> Iterator[None]:
        """While ``stream`` is captured: frees meant for it wait, and the cyclic garbage collector
        (whose finalizers would free) is off; afterwards the waiting frees are queued on it."""
        was_enabled = gc.isenabled()
        gc.disable()
        self.capturing.add(int(stream.handle))
        try:
            yield
        finally:
            self.capturing.discard(int(stream.handle))
            if was_enabled:
                gc.enable()
            waiting = [d for d in self.deferred if d[1] is stream]
            self.deferred = [d for d in self.deferred if d[1] is not stream]
            for ptr, st in waiting:
                _free_async(self, ptr, st)

    def alloc(self, nbytes: int, stream: Stream) -> DeviceBuffer:
        """``nbytes`` of device memory, usable by work queued on ``stream`` from now on."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        try:
            ptr = call(cu.cuMemAllocFromPoolAsync, nbytes, self.handle, stream.handle)
        except CudaError as exc:
            if exc.name != "CUDA_ERROR_OUT_OF_MEMORY":
                raise
            with self.ctx.push_current():
                free, total = call(cu.cuMemGetInfo)
            raise DeviceError(oom_message(nbytes, free, total, self.reserved_bytes(), self.ctx.device.name)) from None
        return DeviceBuffer(int(ptr), nbytes, self, stream)

    def _get(self, attr: cu.CUmemPool_attribute) -> int:
        return int(call(cu.cuMemPoolGetAttribute, self.handle, attr))

    def used_bytes(self) -> int:
        """Bytes now allocated from the pool."""
        return self._get(_ATTR.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)

    def peak_bytes(self) -> int:
        """The most bytes allocated at once since creation or :meth:`reset_peak`."""
        return self._get(_ATTR.CU_MEMPOOL_ATTR_USED_MEM_HIGH)

    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the driver (allocated or kept for reuse)."""
        return self._get(_ATTR.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)

    def reset_peak(self) -> None:
        call(cu.cuMemPoolSetAttribute, self.handle, _ATTR.CU_MEMPOOL_ATTR_USED_MEM_HIGH, cu.cuuint64_t(0))

    def trim(self, keep_bytes: int = 0) -> None:
        """Give unused reserved memory back to the driver, keeping ``keep_bytes``."""
        call(cu.cuMemPoolTrimTo, self.handle, keep_bytes)

    def close(self) -> None:
        """Destroy the pool, now if nothing is allocated from it; else once the last buffer that
        holds it is collected (results handed to a caller may outlive the engine: destroying the
        pool under them crashed the driver on the H200, driver 580)."""
        if self._finalizer.alive and self.used_bytes() == 0:
            self._finalizer()


def _free_async(pool: DevicePool, ptr: int, stream: Stream) -> None:
    if int(stream.handle) in pool.capturing:
        pool.deferred.append((ptr, stream))  # queued when the capture ends (DevicePool.capture)
        return
    # A stream destroyed before this buffer (an engine closed while a caller still holds one of its
    # tensors) must not be named again: free on the legacy stream, which orders after all work.
    alive = stream._finalizer is None or stream._finalizer.alive
    release(pool.ctx, cu.cuMemFreeAsync, ptr, stream.handle if alive else cu.CUstream(0))


class DeviceBuffer:
    """Device memory from a :class:`DevicePool`: ``ptr`` (int), ``nbytes``, ``owner`` (the pool).

    Freed on ``close()`` or collection with cuMemFreeAsync on ``stream`` (the allocating one
    unless :meth:`close` names another), so queued work that uses it completes first. Keep that
    stream open until the buffer is freed.
    """

    def __init__(self, ptr: int, nbytes: int, owner: DevicePool, stream: Stream) -> None:
        self.ptr, self.nbytes, self.owner, self.stream = ptr, nbytes, owner, stream
        # The finalizer holds the pool (and so the context) and the stream until the free is queued.
        self._finalizer = weakref.finalize(self, _free_async, owner, ptr, stream)

    def close(self, stream: Stream | None = None) -> None:
        """Free after the work queued on ``stream`` (default: the allocating stream). Idempotent."""
        if stream is None or stream is self.stream or not self._finalizer.alive:
            self._finalizer()
            return
        self._finalizer.detach()
        _free_async(self.owner, self.ptr, stream)

    def __int__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"DeviceBuffer(0x{self.ptr:x}, {fmt_bytes(self.nbytes)})"


class HostBuffer:
    """Page-locked host memory (cuMemHostAlloc) for truly asynchronous copies.

    :meth:`numpy` views keep the buffer alive; ``close()`` frees at once, so do not touch views
    after it, nor before the copies that use the buffer have completed.
    """

    def __init__(self, ctx: Context, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        self.ctx, self.nbytes = ctx, nbytes
        self.ptr = int(call(cu.cuMemHostAlloc, nbytes, cu.CU_MEMHOSTALLOC_PORTABLE))
        self._finalizer = weakref.finalize(self, release, ctx, cu.cuMemFreeHost, self.ptr)

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def numpy(self, dtype: np.dtype | type | str = np.uint8, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A numpy view of the buffer (or of its first ``prod(shape)`` elements)."""
        flat = np.asarray(self).view(np.dtype(dtype))
        return flat if shape is None else flat[: int(np.prod(shape))].reshape(shape)

    def close(self) -> None:
        self._finalizer()


def _host_span(x: HostBuffer | np.ndarray, *, writable: bool) -> tuple[int, int]:
    if isinstance(x, HostBuffer):
        return x.ptr, x.nbytes
    if not x.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous: pass np.ascontiguousarray(a)")
    if writable and not x.flags.writeable:
        raise ValueError("host array is read-only: download needs a writable destination")
    return x.ctypes.data, x.nbytes


def _span(nbytes: int | None, *sizes: int) -> int:
    n = min(sizes) if nbytes is None else nbytes
    if n > min(sizes):
        raise ValueError(f"copy of {n} bytes does not fit: the buffers hold {' and '.join(map(str, sizes))} bytes")
    return n


def upload(stream: Stream, dst: DeviceBuffer, src: HostBuffer | np.ndarray, nbytes: int | None = None) -> None:
    """Queue a host-to-device copy (of ``nbytes``, default all that fits).

    From a HostBuffer the copy is asynchronous: keep the buffer unchanged until ``stream`` passes
    it. From a pageable numpy array the driver stages the data before this returns.
    """
    ptr, size = _host_span(src, writable=False)
    if isinstance(src, HostBuffer):  # returns at once: keeps the GIL (driver.HeldCalls)
        copy_async("HtoD", dst.ptr, ptr, _span(nbytes, dst.nbytes, size), stream.handle)
    else:  # the driver stages pageable memory before it returns: let the GIL go meanwhile
        call(cu.cuMemcpyHtoDAsync, dst.ptr, ptr, _span(nbytes, dst.nbytes, size), stream.handle)


def download(stream: Stream, dst: HostBuffer | np.ndarray, src: DeviceBuffer, nbytes: int | None = None) -> None:
    """Queue a device-to-host copy. Into a HostBuffer, the data is there once ``stream`` is
    synchronized; into a pageable numpy array, the call returns after the copy."""
    ptr, size = _host_span(dst, writable=True)
    if isinstance(dst, HostBuffer):  # returns at once: keeps the GIL (driver.HeldCalls)
        copy_async("DtoH", ptr, src.ptr, _span(nbytes, src.nbytes, size), stream.handle)
    else:  # into pageable memory the call waits for the stream: let the GIL go meanwhile
        call(cu.cuMemcpyDtoHAsync, ptr, src.ptr, _span(nbytes, src.nbytes, size), stream.handle)


class PinnedRange:
    """Host memory the caller owns (a numpy array, a mapped file), page-locked for the GPU with
    ``cuMemHostRegister`` until :meth:`close`: copies into it run asynchronously, as into a
    :class:`HostBuffer`, without a staging copy.

    It keeps no reference to the memory: the owner must keep it mapped until ``close()`` (an
    ``mmap`` refuses to close while a view of it lives, so holding one here would block that).
    """

    def __init__(self, ctx: Context, array: np.ndarray) -> None:
        if not array.flags.c_contiguous or array.nbytes == 0:
            raise ValueError("only a non-empty C-contiguous array can be page-locked")
        self.start, self.nbytes = int(array.ctypes.data), int(array.nbytes)
        # DEVICEMAP: the GPU may also store into it itself (Engine.signal's cuStreamWriteValue64).
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        call(cu.cuMemHostRegister, self.start, self.nbytes, flags)
        self._finalizer = weakref.finalize(self, release, ctx, cu.cuMemHostUnregister, self.start)
        self._device_start: int | None = None

    def device_address(self, ptr: int) -> int:
        """The GPU's address of host address ``ptr`` inside this range (for the GPU's own stores)."""
        if not self.holds(ptr, 1):
            raise ValueError(f"address {ptr:#x} is not in this page-locked range")
        if self._device_start is None:
            self._device_start = int(call(cu.cuMemHostGetDevicePointer, self.start, 0))
        return self._device_start + (ptr - self.start)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def holds(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside this range while it is registered."""
        return self._finalizer.alive and self.start <= ptr and ptr + nbytes <= self.start + self.nbytes

    def close(self) -> None:
        """Unregister (idempotent); copies into the range must have completed."""
        self._finalizer()


def copy_rows_to_host(stream: Stream, src: int, row_bytes: int, dests: Sequence[tuple[int, int]]) -> None:
    """Queue on ``stream`` the copy of device row ``i`` (``row_bytes`` each, from ``src``) to host
    address ``a``, for each ``(i, a)`` of ``dests``; the host memory must be page-locked (a
    :class:`HostBuffer` or a :class:`PinnedRange`).

    One ``cuMemcpyBatchAsync`` for all of them: every driver call lets the GIL go and must win it
    back, and in the service that turn costs more than the call (docs/performance.md, "Every
    driver call is a GIL turn"). A driver older than CUDA 12.8 gets one ``cuMemcpyDtoHAsync`` per row.
    """
    if not dests:
        return
    global _BATCH_COPY
    held = held_calls()
    if _BATCH_COPY and held is not None and held.has("cuMemcpyBatchAsync"):  # keeping the GIL
        try:
            held.copy_batch([a for _, a in dests], [src + i * row_bytes for i, _ in dests], [row_bytes] * len(dests),
                            stream.handle)  # fmt: skip
            return
        except CudaError as err:
            if err.name not in ("CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_FOUND"):
                raise
            _BATCH_COPY = False
    if _BATCH_COPY:
        attrs = cu.CUmemcpyAttributes()
        attrs.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        try:
            call(
                cu.cuMemcpyBatchAsync,
                [cu.CUdeviceptr(a) for _, a in dests],
                [cu.CUdeviceptr(src + i * row_bytes) for i, _ in dests],
                [row_bytes] * len(dests),
                len(dests),
                [attrs],
                [0],
                1,
                stream.handle,
            )
            return
        except (CudaError, RuntimeError) as err:  # RuntimeError: cuda-bindings found no such symbol
            if isinstance(err, CudaError) and err.name not in ("CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_FOUND"):
                raise
            _BATCH_COPY = False  # this driver lacks it: one copy per row from now on
    for i, a in dests:
        copy_async("DtoH", a, src + i * row_bytes, row_bytes, stream.handle)


_BATCH_COPY = True  # cuMemcpyBatchAsync works here (until a driver says it does not)
