"""The CUDA Driver API, through cuda-python (`cuda.bindings.driver`), behind one checker.

Every driver call goes through :func:`call` (or :func:`check` on a result tuple), which turns a
failing ``CUresult`` into :class:`~dualtrack.errors.CudaError` ``"call failed: NAME: explanation"``.
Wrappers expose their raw handle as ``.handle`` and own it explicitly: what a wrapper created it
destroys in ``close()`` (or in a ``weakref.finalize`` when it is collected); what it borrowed
(:meth:`Stream.from_handle`) it never destroys. Dependents keep what they need alive (a Module
its Context), so finalizers run in a safe order.

Notes on cuda-python 13 that shape this module:

- JIT option values are passed as a Python list parallel to the ``CUjit_option`` list
  (:func:`jit_options`): ints for sizes/levels/flags, a ``CUjit_cacheMode`` member for
  CU_JIT_CACHE_MODE, a ``bytearray`` for each log buffer (the driver writes into it in place), a
  float for CU_JIT_WALL_TIME. Output *values* (the wall time, the filled log sizes) land in the
  binding's own ``void*`` array, which Python cannot reach: the load and JIT times on
  :class:`Module` are measured on the host around the calls that did the work.
- ``cuLaunchKernel`` takes ``kernelParams`` as ``((values...), (ctypes types...))`` — two tuples —
  and builds the ``void**`` array itself (:func:`kernel_params`); a type ``None`` passes a
  cuda.bindings struct (a ``CUtensorMap``) by value: the driver copies the bytes at its ``getPtr()``.
- Every cuda-python call lets the GIL go (``with nogil``) and must win it back. For a call that
  blocks (a synchronize) that is what it should do; for one that only queues work or sets the
  thread's context (microseconds in the driver), winning the GIL back behind a busy process's
  other threads costs far more than the call (docs/performance.md, "Every driver call is a GIL
  turn"). Those calls (:class:`HeldCalls`: context, event record and wait, kernel and graph launch,
  asynchronous copies) go to libcuda through ``ctypes.PyDLL``, which keeps the GIL, with the same
  checker and errors; ``DUALTRACK_HOLD_GIL=0`` sends them through cuda-python like the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu

from dualtrack import atomic
from dualtrack.contract.arch import check_ptx_loadable, parse_ptx_isa
from dualtrack.errors import CudaError, DeviceError
from dualtrack.kernels.device import DeviceInfo

try:  # cuda-bindings 13 raises this when libcuda.so.1 cannot be loaded
    from cuda.pathfinder import DynamicLibNotFoundError as _LibNotFound
except ImportError:  # pragma: no cover - older cuda-bindings
    _LibNotFound = RuntimeError

NO_DRIVER = "no NVIDIA GPU or driver found (libcuda.so.1 not loadable); run with --device cpu or on a GPU machine"
NO_DEVICE = (
    "no NVIDIA GPU found (the driver is installed but cuInit reports CUDA_ERROR_NO_DEVICE; check "
    "CUDA_VISIBLE_DEVICES and nvidia-smi); run with --device cpu or on a GPU machine"
)
_SUCCESS = cu.CUresult.CUDA_SUCCESS
_NOT_READY = int(cu.CUresult.CUDA_ERROR_NOT_READY)
_DEINITIALIZED = cu.CUresult.CUDA_ERROR_DEINITIALIZED


# ---------------------------------------------------------------------------------------------
# The checker


def _driver_missing(exc: BaseException) -> bool:
    return isinstance(exc, _LibNotFound) or (isinstance(exc, RuntimeError) and "libcuda" in str(exc))


def describe(status: cu.CUresult | int) -> tuple[str, str]:
    """``(name, explanation)`` for a CUresult, from the driver when it can be asked.

    Without libcuda (CI machines) the name comes from the enum and the explanation is made from it.
    """
    try:
        status = cu.CUresult(int(status))
    except ValueError:
        return f"CUresult {int(status)}", "an error code this cuda-python does not know"
    try:
        err, name = cu.cuGetErrorName(status)
        err2, text = cu.cuGetErrorString(status)
        if err == _SUCCESS and err2 == _SUCCESS and name and text:
            return name.decode(), text.decode()
    except Exception:  # no libcuda: the checker must still report the original failure
        pass
    words = status.name.removeprefix("CUDA_ERROR_").removeprefix("CUDA_").replace("_", " ").lower()
    return status.name, f"{words} (driver text unavailable: libcuda not loaded)"


def check(result: Any, call: str) -> Any:
    """Check a cuda-python result: raise CudaError on failure, else unwrap the returned values.

    ``result`` is what a ``cuda.bindings.driver`` function returns, ``(CUresult, *values)``, or a
    bare CUresult. Returns None for no values, the value itself for one, a tuple for several.
    """
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != int(_SUCCESS):
        raise CudaError(call, *describe(status))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call one ``cuda.bindings.driver`` function and :func:`check` its result.

    A missing libcuda becomes the one-line :class:`DeviceError` that names the fix.
    """
    try:
        result = fn(*args)
    except Exception as exc:
        if _driver_missing(exc):
            raise DeviceError(NO_DRIVER) from None
        raise
    return check(result, fn.__name__)


def release(ctx: Context | None, fn: Callable[..., Any], *args: Any) -> None:
    """Finalizer body: destroy one driver object with its context current.

    Collection can happen on any thread, so the owning context is pushed first. Finalizers hold
    the :class:`Context` object itself, so it outlives everything made in it. Once the driver
    has shut down there is nothing left to free.
    """
    if ctx is not None:
        if not ctx._finalizer.alive and not cu.cuDevicePrimaryCtxGetState(ctx.device.handle)[2]:
            return  # the context was closed and destroyed, and everything made in it went with it
        status = cu.cuCtxPushCurrent(ctx.handle)[0]
        if status == _DEINITIALIZED:
            return
        check((status,), "cuCtxPushCurrent")
    try:
        result = fn(*args)
        if result[0] != _DEINITIALIZED:
            check(result, fn.__name__)
    finally:
        if ctx is not None:
            cu.cuCtxPopCurrent()


# ---------------------------------------------------------------------------------------------
# Driver, device, context


@dataclass(frozen=True)
class DriverInfo:
    """What :func:`load_driver` found."""

    version: int  # cuDriverGetVersion form: 13000 is CUDA 13.0
    device_count: int


def load_driver() -> DriverInfo:
    """Initialize the driver, or raise one DeviceError line that says what to do instead."""
    try:
        call(cu.cuInit, 0)
    except CudaError as exc:
        if exc.name == "CUDA_ERROR_NO_DEVICE":
            raise DeviceError(NO_DEVICE) from None
        raise
    count = call(cu.cuDeviceGetCount)
    if count == 0:
        raise DeviceError(NO_DEVICE)
    return DriverInfo(call(cu.cuDriverGetVersion), count)


def _attr(dev: cu.CUdevice, name: str) -> int:
    return call(cu.cuDeviceGetAttribute, getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}"), dev)


class Device:
    """One GPU and the properties the engine plans with. ``Device(0)`` initializes the driver."""

    def __init__(self, index: int = 0) -> None:
        info = load_driver()
        if not 0 <= index < info.device_count:
            raise DeviceError(f"GPU {index} does not exist: this machine has {info.device_count}; pass --gpu 0")
        self.index = index
        self.handle: cu.CUdevice = call(cu.cuDeviceGet, index)
        self.name: str = call(cu.cuDeviceGetName, 256, self.handle).split(b"\0", 1)[0].decode()
        self.cc: tuple[int, int] = (
            _attr(self.handle, "COMPUTE_CAPABILITY_MAJOR"),
            _attr(self.handle, "COMPUTE_CAPABILITY_MINOR"),
        )
        self.driver_version: int = info.version
        self.total_memory: int = call(cu.cuDeviceTotalMem, self.handle)
        self.multiprocessor_count = _attr(self.handle, "MULTIPROCESSOR_COUNT")
        self.l2_size = _attr(self.handle, "L2_CACHE_SIZE")
        self.max_shared_per_block_optin = _attr(self.handle, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")

    def info(self) -> DeviceInfo:
        """What the kernels plan launches with (SMs, grid limits, shared memory, L2), read from
        ``cuDeviceGetAttribute`` through the one checker."""
        return DeviceInfo.from_attributes(self.name, lambda name: _attr(self.handle, name))

    @property
    def arch(self) -> str:
        """``sm_XY`` for the device's compute capability (sm_90 on an H200)."""
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def primary_context(self) -> Context:
        """Retain the device's primary context (the one IREE uses) and make it current here."""
        return Context(self)

    def __repr__(self) -> str:
        return f"Device({self.index}, {self.name!r}, {self.arch}, driver {self.driver_version})"


class Context:
    """A retained primary context. ``close()`` releases it; release it after everything made in it.

    CUDA keeps one current context per thread: a thread other than the one that created this
    object must call :meth:`make_current` (or use ``with ctx.push_current():``) before driver calls.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.handle: cu.CUcontext = call(cu.cuDevicePrimaryCtxRetain, device.handle)
        self._finalizer = weakref.finalize(self, release, None, cu.cuDevicePrimaryCtxRelease, device.handle)
        self.make_current()

    def make_current(self) -> None:
        """Bind this context to the calling thread (cuCtxSetCurrent, keeping the GIL)."""
        held = held_calls()
        if held is None or not held.has("cuCtxSetCurrent"):
            call(cu.cuCtxSetCurrent, self.handle)
        else:
            held.set_current(self.handle)

    @contextlib.contextmanager
    def push_current(self) -> Iterator[Context]:
        """Make this context current for a block, restoring the thread's previous one after."""
        call(cu.cuCtxPushCurrent, self.handle)
        try:
            yield self
        finally:
            call(cu.cuCtxPopCurrent)

    def synchronize(self) -> None:
        call(cu.cuCtxSynchronize)

    def close(self) -> None:
        """Release the primary context (cuDevicePrimaryCtxRelease). Idempotent."""
        self._finalizer()


# ---------------------------------------------------------------------------------------------
# Streams and events


class Stream:
    """A CUDA stream: owned (created non-blocking, destroyed on close) or borrowed (never destroyed)."""

    def __init__(self, ctx: Context, *, urgent: bool = False) -> None:
        """``urgent``: the context's highest stream priority. The block scheduler then starts this
        stream's waiting blocks before those of default-priority streams (nothing running is
        preempted): small kernels beside a long compute (a JPEG's resize next to the previous
        batch's convolutions) start as soon as blocks free up, not once the compute is done."""
        self.ctx = ctx
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        if urgent:
            _least, greatest = call(cu.cuCtxGetStreamPriorityRange)
            self.handle: cu.CUstream = call(cu.cuStreamCreateWithPriority, flags, greatest)
        else:
            self.handle = call(cu.cuStreamCreate, flags)
        self.owned = True
        self._finalizer = weakref.finalize(self, release, ctx, cu.cuStreamDestroy, self.handle)

    @classmethod
    def from_handle(cls, handle: int | cu.CUstream, ctx: Context | None = None) -> Stream:
        """Wrap a stream someone else owns (another library's, or 0 for the legacy default stream)."""
        self = cls.__new__(cls)
        self.ctx = ctx
        self.handle = handle if isinstance(handle, cu.CUstream) else cu.CUstream(int(handle))
        self.owned = False
        self._finalizer = None
        return self

    def synchronize(self) -> None:
        call(cu.cuStreamSynchronize, self.handle)

    def finish(self) -> None:
        """Wait for the stream's work, first asking without waiting (keeping the GIL): a stream
        already done costs no GIL turn, where :meth:`synchronize` always lets the GIL go."""
        held = held_calls()
        if held is None or not held.has("cuStreamQuery") or not held.stream_done(self.handle):
            self.synchronize()

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host wait; keeps the GIL)."""
        held = held_calls()
        if held is None or not held.has("cuStreamWaitEvent"):
            call(cu.cuStreamWaitEvent, self.handle, event.handle, 0)
        else:
            held.stream_wait(self.handle, event.handle)

    def close(self) -> None:
        """Destroy an owned stream (pending work still completes); a borrowed one is left alone."""
        if self._finalizer is not None:
            self._finalizer()

    def __int__(self) -> int:
        return int(self.handle)


class Event:
    """A CUDA event; with ``timing=True`` two of them measure GPU time between records."""

    def __init__(self, ctx: Context, *, timing: bool = True) -> None:
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle: cu.CUevent = call(cu.cuEventCreate, flags)
        self._finalizer = weakref.finalize(self, release, ctx, cu.cuEventDestroy, self.handle)

    def record(self, stream: Stream) -> Event:
        """Record this event on ``stream`` (keeps the GIL)."""
        held = held_calls()
        if held is None or not held.has("cuEventRecord"):
            call(cu.cuEventRecord, self.handle, stream.handle)
        else:
            held.event_record(self.handle, stream.handle)
        return self

    def synchronize(self) -> None:
        call(cu.cuEventSynchronize, self.handle)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end``; waits for ``end`` to complete first."""
        end.synchronize()
        return call(cu.cuEventElapsedTime, self.handle, end.handle)

    def close(self) -> None:
        self._finalizer()


# ---------------------------------------------------------------------------------------------
# JIT options, kernel parameters: pure functions


@dataclass(frozen=True)
class JitOptions:
    """The parallel lists cuModuleLoadDataEx / cuLinkCreate take, plus the log buffers they fill.

    The bytearrays must stay alive until the call (or, for cuLinkCreate, the link state) is done.
    """

    options: list[cu.CUjit_option]
    values: list[Any]
    info_log: bytearray
    error_log: bytearray

    def logs(self) -> str:
        """The error and info logs as one text (empty parts left out)."""
        parts = [("error log", decode_log(self.error_log)), ("info log", decode_log(self.info_log))]
        return "\n".join(f"{title}:\n{text}" for title, text in parts if text)


def jit_options(*, opt_level: int = 4, log_size: int = 1 << 16, verbose: bool = True) -> JitOptions:
    """Build the JIT options every load uses: -O level, cache-all loads (ld.ca), logs, wall time."""
    if not 0 <= opt_level <= 4:
        raise ValueError(f"opt_level {opt_level} is out of range: CU_JIT_OPTIMIZATION_LEVEL takes 0..4")
    info, error = bytearray(log_size), bytearray(log_size)
    o = cu.CUjit_option
    table: list[tuple[cu.CUjit_option, Any]] = [
        (o.CU_JIT_OPTIMIZATION_LEVEL, opt_level),
        (o.CU_JIT_CACHE_MODE, cu.CUjit_cacheMode.CU_JIT_CACHE_OPTION_CA),
        (o.CU_JIT_INFO_LOG_BUFFER, info),
        (o.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, log_size),
        (o.CU_JIT_ERROR_LOG_BUFFER, error),
        (o.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, log_size),
        (o.CU_JIT_WALL_TIME, 0.0),
        (o.CU_JIT_LOG_VERBOSE, int(verbose)),
    ]
    return JitOptions([k for k, _ in table], [v for _, v in table], info, error)


def decode_log(buf: bytes | bytearray) -> str:
    """A driver log buffer as text: up to the first NUL, trailing whitespace dropped."""
    return bytes(buf).split(b"\0", 1)[0].decode(errors="replace").rstrip()


# The ctypes types cuda-python's kernelParams packer accepts (plus c_void_p for pointers).
_PARAM_TYPES = (
    ctypes.c_bool, ctypes.c_byte, ctypes.c_ubyte, ctypes.c_short, ctypes.c_ushort, ctypes.c_int,
    ctypes.c_uint, ctypes.c_long, ctypes.c_ulong, ctypes.c_longlong, ctypes.c_ulonglong,
    ctypes.c_size_t, ctypes.c_float, ctypes.c_double, ctypes.c_void_p,
)  # fmt: skip


def kernel_params(args: Sequence[tuple[Any, type | None]]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | int:
    """Turn ``[(value, ctypes type), ...]`` into cuLaunchKernel's ``((values), (types))`` form.

    Pointers are ``(int address, ctypes.c_void_p)``: pass ``buffer.ptr``, never a CUdeviceptr
    object (the packer would take the address of its handle). A struct parameter passed by value
    is ``(value, None)``: a cuda.bindings struct (``__grid_constant__ CUtensorMap``) or a
    ``ctypes.Structure`` laid out as the kernel's struct (resize_rgb_u8's jobs); the driver copies
    as many bytes as the kernel's parameter takes. No arguments gives 0 (NULL).
    """
    if not args:
        return 0
    for i, (value, ctype) in enumerate(args):
        if ctype is None:
            if not (callable(getattr(value, "getPtr", None)) or isinstance(value, ctypes.Structure)):
                raise TypeError(
                    f"kernel argument {i}: a by-value struct must be a cuda.bindings struct (CUtensorMap) "
                    f"or a ctypes.Structure, got {type(value).__name__}"
                )
            continue
        if ctype not in _PARAM_TYPES:
            raise TypeError(f"kernel argument {i}: {ctype!r} is not a ctypes scalar type cuLaunchKernel can pack")
        if ctype is ctypes.c_void_p and not isinstance(value, int):
            raise TypeError(f"kernel argument {i}: a pointer must be an int address, got {type(value).__name__}")
    return tuple(v for v, _ in args), tuple(t for _, t in args)


def _dim3(d: int | Sequence[int]) -> tuple[int, int, int]:
    dims = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(dims) <= 3 or any(x < 1 for x in dims):
        raise ValueError(f"launch dimensions must be 1 to 3 positive ints, got {d!r}")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Modules and kernels

_JIT_FIXES = {
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "the PTX ISA is newer than this driver can JIT: upgrade the driver "
    "or rebuild with the pinned NVRTC 13.0 (`make ptx build`)",
    "CUDA_ERROR_INVALID_PTX": "the PTX does not assemble for this GPU ({arch}); fix or rebuild it for a target "
    "this GPU runs (error log: --verbose)",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "the image has no code for this GPU ({arch}); add {arch} to `targets` and rebuild",
    "CUDA_ERROR_INVALID_IMAGE": "the cubin is corrupt or for another GPU; rebuild the bundle or clear the cubin cache",
    "CUDA_ERROR_JIT_COMPILER_NOT_FOUND": "the driver's PTX JIT (libnvidia-ptxjitcompiler) is missing; "
    "reinstall the driver",
}


def cubin_cache_name(ptx: bytes, *, arch: str, driver_version: int, opt_level: int) -> str:
    """File name of the cached cubin: everything that changes the driver's output is in the hash."""
    key = hashlib.sha256()
    for part in (ptx.rstrip(b"\0"), arch.encode(), str(driver_version).encode(), f"O{opt_level}-ca".encode()):
        key.update(len(part).to_bytes(8, "little") + part)
    return f"{arch}-{key.hexdigest()[:40]}.cubin"


class Module:
    """A loaded CUDA module (cubin, or PTX JIT-compiled by the driver).

    Recorded at load: ``load_ms`` (host wall time of all of :meth:`load`), ``jit_ms`` (the part
    of it spent in the PTX JIT: the cuLink run on a cache miss, the whole cuModuleLoadDataEx of
    uncached PTX, 0 for a cubin or a cache hit), ``cache`` ("off", "hit", "miss" or "rebuilt")
    and ``info_log``. The driver's own CU_JIT_WALL_TIME is not readable through cuda-python.
    """

    handle: cu.CUmodule

    @classmethod
    def load(
        cls,
        ctx: Context,
        image: bytes,
        *,
        kind: str,
        origin: str,
        target: str,
        opt_level: int = 4,
        cache_dir: Path | None = None,
        log_size: int = 1 << 16,
    ) -> Module:
        """Load ``image`` into ``ctx``, which must be current on this thread.

        ``kind`` is "ptx" or "cubin"; ``origin`` (a file or bundle path) and ``target`` (the arch
        it was built for) travel with any error. PTX is checked against the driver's ISA limit
        first; with ``cache_dir``, PTX is JIT-compiled once through cuLink and the cubin is kept
        there under :func:`cubin_cache_name`, so the next start skips the JIT.
        """
        if kind not in ("ptx", "cubin"):
            raise ValueError(f"kind must be 'ptx' or 'cubin', got {kind!r}")
        self = cls.__new__(cls)
        self.ctx, self.origin, self.target, self.kind = ctx, origin, target, kind
        self.jit_ms, self.cache, self.info_log = 0.0, "off", ""
        t0 = time.perf_counter()
        if kind == "cubin":
            self._load(image, kind, opt_level, log_size)
        else:
            text = image.rstrip(b"\0")
            isa = parse_ptx_isa(text.decode(errors="replace"))
            check_ptx_loadable(isa, ctx.device.driver_version, origin=origin)
            ptx = text + b"\0"  # the driver reads PTX as a C string
            if cache_dir is None:
                self._load(ptx, kind, opt_level, log_size)
                self.jit_ms = (time.perf_counter() - t0) * 1e3
            else:
                self._load_through_cache(ptx, Path(cache_dir), opt_level, log_size)
        self.load_ms = (time.perf_counter() - t0) * 1e3
        return self

    def _load(self, image: bytes, kind: str, opt_level: int, log_size: int) -> None:
        jit = jit_options(opt_level=opt_level, log_size=log_size)
        try:
            handle = call(cu.cuModuleLoadDataEx, image, len(jit.options), jit.options, jit.values)
        except CudaError as exc:
            raise self._jit_error(exc, jit, kind) from None
        self.info_log = self.info_log or decode_log(jit.info_log)
        self.handle = handle
        self._finalizer = weakref.finalize(self, release, self.ctx, cu.cuModuleUnload, handle)

    def _load_through_cache(self, ptx: bytes, cache_dir: Path, opt_level: int, log_size: int) -> None:
        dev = self.ctx.device
        path = cache_dir / cubin_cache_name(ptx, arch=dev.arch, driver_version=dev.driver_version, opt_level=opt_level)
        if path.is_file():
            try:
                self._load(path.read_bytes(), "cubin", opt_level, log_size)
                self.cache = "hit"
                return
            except CudaError:  # a damaged entry (the key already covers arch and driver): compile again
                path.unlink(missing_ok=True)
                self.cache = "rebuilt"
        else:
            self.cache = "miss"
        cubin = self._link(ptx, opt_level, log_size)
        try:
            atomic.write_bytes(path, cubin)
        except OSError as exc:  # the load itself does not need the cache
            warnings.warn(
                f"cannot write the cubin cache {path}: {exc}; the next start JIT-compiles again", stacklevel=4
            )
        self._load(cubin, "cubin", opt_level, log_size)

    def _link(self, ptx: bytes, opt_level: int, log_size: int) -> bytes:
        """PTX -> cubin for the current context's device with the driver's linker (cuLink*)."""
        jit = jit_options(opt_level=opt_level, log_size=log_size)
        t0 = time.perf_counter()
        # cuLinkCreate keeps its option-value array (and so the log buffers' addresses) alive on the
        # returned state; ``jit`` keeps the bytearrays themselves alive until cuLinkDestroy.
        state = call(cu.cuLinkCreate, len(jit.options), jit.options, jit.values)
        try:
            call(
                cu.cuLinkAddData,
                state,
                cu.CUjitInputType.CU_JIT_INPUT_PTX,
                ptx,
                len(ptx),
                self.origin.encode(),
                0,
                None,
                None,
            )
            addr, size = call(cu.cuLinkComplete, state)
            cubin = ctypes.string_at(addr, size)  # owned by the link state: copy before destroying it
        except CudaError as exc:
            raise self._jit_error(exc, jit, "ptx") from None
        finally:
            call(cu.cuLinkDestroy, state)
        self.jit_ms = (time.perf_counter() - t0) * 1e3
        self.info_log = decode_log(jit.info_log)
        return cubin

    def _jit_error(self, exc: CudaError, jit: JitOptions, kind: str) -> CudaError:
        """The load failure again, with origin, target, the log's first line, the fix, and the logs."""
        arch = self.ctx.device.arch
        first = next((ln.strip() for ln in decode_log(jit.error_log).splitlines() if ln.strip()), "")
        fix = _JIT_FIXES.get(exc.name, "see the JIT log (--verbose)").format(arch=arch)
        explanation = f"{exc.explanation}{f' ({first[:200]})' if first else ''}; {fix}"
        where = f"{exc.call}({self.origin}, {kind} for {self.target})"
        return CudaError(where, exc.name, explanation, log=jit.logs())

    def function(self, name: str) -> Kernel:
        """The kernel ``name`` (its ``.entry`` name) in this module."""
        try:
            return Kernel(self, call(cu.cuModuleGetFunction, self.handle, name.encode()), name)
        except CudaError as exc:
            if exc.name != "CUDA_ERROR_NOT_FOUND":
                raise
            raise DeviceError(
                f"kernel '{name}' is not in {self.origin} ({self.target}); check the .entry names "
                "in the PTX or rebuild the bundle"
            ) from None

    def close(self) -> None:
        """Unload (cuModuleUnload). Synchronize every stream that runs its kernels first."""
        self._finalizer()


SHARED_DEFAULT = 48 << 10  # dynamic shared memory a launch may take without opting in (set_max_dynamic_shared)


class Kernel:
    """One ``__global__`` function of a :class:`Module`; keeps its module loaded."""

    def __init__(self, module: Module, handle: cu.CUfunction, name: str) -> None:
        self.module, self.handle, self.name = module, handle, name

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory (needed above 48 KiB)."""
        limit = self.module.ctx.device.max_shared_per_block_optin
        if nbytes > limit:
            raise DeviceError(
                f"kernel '{self.name}' asks for {nbytes} B of shared memory; this GPU allows "
                f"{limit} B per block: use smaller tiles"
            )
        call(
            cu.cuFuncSetAttribute,
            self.handle,
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            nbytes,
        )

    def launch(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        shared_bytes: int,
        stream: Stream,
        args: Sequence[tuple[Any, type | None]],
    ) -> None:
        """Enqueue one launch on ``stream``; ``args`` are ``(value, ctypes type)`` pairs in order
        (:func:`kernel_params`). The driver copies the parameters: nothing needs to outlive the call.
        Keeps the GIL (:class:`HeldCalls`)."""
        params = kernel_params(args)  # checks the arguments on either path
        held = held_calls()
        if held is not None and held.has("cuLaunchKernel"):
            held.launch_kernel(self.handle, _dim3(grid), _dim3(block), shared_bytes, stream.handle, args)
            return
        call(cu.cuLaunchKernel, self.handle, *_dim3(grid), *_dim3(block), shared_bytes, stream.handle, params, 0)


# ---------------------------------------------------------------------------------------------
# Calls that keep the GIL


def _address(handle: Any) -> int:
    """The pointer value of a cuda.bindings handle (CUstream, CUevent, ...) or an int."""
    return handle if isinstance(handle, int) else int(handle)


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (cuda.h, CUDA 12.8+)."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


def param_array(args: Sequence[tuple[Any, type | None]]) -> tuple[Any, list[Any]]:
    """cuLaunchKernel's ``void** kernelParams`` for ``args`` (checked by :func:`kernel_params`):
    the array, and the ctypes values it points at (keep them alive until the call returns)."""
    keep: list[Any] = []
    array = (ctypes.c_void_p * max(len(args), 1))()
    for i, (value, ctype) in enumerate(args):
        if ctype is None:  # a struct by value: its bytes' address
            array[i] = ctypes.addressof(value) if isinstance(value, ctypes.Structure) else int(value.getPtr())
            continue
        cell = ctype(value)
        keep.append(cell)
        array[i] = ctypes.addressof(cell)
    return array, keep


class HeldCalls:
    """libcuda's enqueue calls through ``ctypes.PyDLL``: the GIL is kept during the call.

    Why not cuda-python for these: its calls release the GIL, and in the service's engine process
    (a dozen threads) each release costs a wait to win the GIL back, ~75 us measured per call on
    the launcher's path (docs/performance.md), for a call that spends microseconds in the driver.
    Only calls that return at once belong here: context binding, event record and stream wait,
    kernel and graph launches, asynchronous copies, a stream's query. Blocking ones (synchronize)
    keep cuda-python's release. Errors go through the same checker as :func:`call`.
    """

    def __init__(self, lib: ctypes.PyDLL) -> None:
        p, u, st = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        dptr = ctypes.c_uint64
        self._fns: dict[str, Any] = {}
        signatures: dict[str, tuple[str, list[Any]]] = {
            "cuCtxSetCurrent": ("cuCtxSetCurrent", [p]),
            "cuEventRecord": ("cuEventRecord", [p, p]),
            "cuStreamWaitEvent": ("cuStreamWaitEvent", [p, p, u]),
            "cuGraphLaunch": ("cuGraphLaunch", [p, p]),
            "cuStreamQuery": ("cuStreamQuery", [p]),
            "cuLaunchKernel": ("cuLaunchKernel", [p, u, u, u, u, u, u, u, p, p, p]),
            "cuMemcpyHtoDAsync": ("cuMemcpyHtoDAsync_v2", [dptr, p, st, p]),
            "cuMemcpyDtoHAsync": ("cuMemcpyDtoHAsync_v2", [p, dptr, st, p]),
            "cuMemcpyDtoDAsync": ("cuMemcpyDtoDAsync_v2", [dptr, dptr, st, p]),
            "cuMemcpyBatchAsync": ("cuMemcpyBatchAsync_v2", [p, p, p, st, p, p, st, p]),
            "cuStreamWriteValue64": ("cuStreamWriteValue64_v2", [p, dptr, ctypes.c_uint64, u]),
            "cuLaunchHostFunc": ("cuLaunchHostFunc", [p, p, p]),
        }
        for name, (symbol, argtypes) in signatures.items():
            fn = getattr(lib, symbol, None)
            if fn is None:
                continue  # an older driver: that call goes through cuda-python
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._fns[name] = fn

    def has(self, name: str) -> bool:
        return name in self._fns

    def _call(self, name: str, *args: Any) -> None:
        status = self._fns[name](*args)
        if status:
            raise CudaError(name, *describe(status))

    def set_current(self, ctx: Any) -> None:
        self._call("cuCtxSetCurrent", _address(ctx))

    def event_record(self, event: Any, stream: Any) -> None:
        self._call("cuEventRecord", _address(event), _address(stream))

    def stream_wait(self, stream: Any, event: Any) -> None:
        self._call("cuStreamWaitEvent", _address(stream), _address(event), 0)

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self._call("cuGraphLaunch", _address(graph_exec), _address(stream))

    def stream_done(self, stream: Any) -> bool:
        """Whether all work queued on ``stream`` has completed (cuStreamQuery; never waits)."""
        status = self._fns["cuStreamQuery"](_address(stream))
        if status == _NOT_READY:
            return False
        if status:
            raise CudaError("cuStreamQuery", *describe(status))
        return True

    def launch_kernel(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: Any,
        args: Sequence[tuple[Any, type | None]],
    ) -> None:
        array, _keep = param_array(args)
        params = ctypes.addressof(array) if args else None
        self._call("cuLaunchKernel", _address(fn), *grid, *block, shared_bytes, _address(stream), params, None)

    def copy(self, kind: str, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """``kind``: ``HtoD``, ``DtoH`` or ``DtoD``; addresses as ints."""
        self._call(f"cuMemcpy{kind}Async", dst, src, nbytes, _address(stream))

    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: Any) -> None:
        """One ``cuMemcpyBatchAsync`` in stream order (every copy pointer to pointer)."""
        n = len(dsts)
        d, s = (ctypes.c_uint64 * n)(*dsts), (ctypes.c_uint64 * n)(*srcs)
        z = (ctypes.c_size_t * n)(*sizes)
        attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        index = (ctypes.c_size_t * 1)(0)
        self._call(
            "cuMemcpyBatchAsync",
            ctypes.addressof(d), ctypes.addressof(s), ctypes.addressof(z), n,
            ctypes.addressof(attrs), ctypes.addressof(index), 1, _address(stream),
        )  # fmt: skip

    def write_value(self, stream: Any, address: int, value: int) -> None:
        """``cuStreamWriteValue64``: the GPU stores ``value`` at device address ``address`` once
        ``stream`` reaches it, after a fence that makes everything before it on ``stream`` visible."""
        self._call("cuStreamWriteValue64", _address(stream), address, value, 0)

    def host_call(self, stream: Any, fn: int, arg: int) -> None:
        """``cuLaunchHostFunc``: the driver's own thread calls the C function at ``fn`` with ``arg``
        once ``stream`` reaches it; ``stream`` waits for it to return."""
        self._call("cuLaunchHostFunc", _address(stream), fn, arg)


def copy_async(kind: str, dst: int, src: int, nbytes: int, stream: Any) -> None:
    """``cuMemcpy{kind}Async`` (``HtoD``, ``DtoH``, ``DtoD``; addresses as ints) on ``stream`` (a
    handle), keeping the GIL where it can (:class:`HeldCalls`)."""
    held = held_calls()
    if held is not None and held.has(f"cuMemcpy{kind}Async"):
        held.copy(kind, dst, src, nbytes, stream)
        return
    call(getattr(cu, f"cuMemcpy{kind}Async"), dst, src, nbytes, stream)


def graph_launch(graph_exec: Any, stream: Any) -> None:
    """``cuGraphLaunch`` on ``stream`` (a handle), keeping the GIL where it can."""
    held = held_calls()
    if held is not None and held.has("cuGraphLaunch"):
        held.graph_launch(graph_exec, stream)
        return
    call(cu.cuGraphLaunch, graph_exec, stream)


_HELD: HeldCalls | None = None
_HELD_CHOSEN = False


def held_calls() -> HeldCalls | None:
    """The GIL-keeping calls, or None: ``DUALTRACK_HOLD_GIL=0``, or libcuda not loadable through
    ctypes (then every call goes through cuda-python). Decided once per process."""
    global _HELD, _HELD_CHOSEN
    if not _HELD_CHOSEN:
        _HELD = _open_held() if _hold_gil_wanted() else None
        _HELD_CHOSEN = True
    return _HELD


def set_hold_gil(on: bool) -> None:
    """Choose the path for this process from now on (tests compare the two)."""
    global _HELD, _HELD_CHOSEN
    _HELD, _HELD_CHOSEN = (_open_held() if on else None), True


def _hold_gil_wanted() -> bool:
    from dualtrack.settings import Settings

    return Settings.from_env().hold_gil


def _open_held() -> HeldCalls | None:
    try:
        return HeldCalls(ctypes.PyDLL("libcuda.so.1"))
    except OSError:
        return None
