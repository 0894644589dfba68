"""DLPack in ctypes: hand GPU memory to IREE, torch or cupy, and take theirs, without torch.

A DLPack capsule is a PyCapsule named "dltensor" around a ``DLManagedTensor*``. The producer
(:func:`to_capsule`) keeps the memory's owner alive until the consumer calls the tensor's
``deleter``; a consumer renames the capsule "used_dltensor" and becomes responsible for that
call. A capsule nobody consumed still has its name when it dies, and then its destructor calls
the deleter itself. :func:`from_capsule` is the consumer side, for capsules from IREE's
``HalDevice.create_dlpack_capsule`` or any ``__dlpack__()``. Strides here count elements, as
in DLPack (``__cuda_array_interface__`` counts bytes; :func:`from_cuda_array_interface`
converts).
"""

from __future__ import annotations

import ctypes
import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from cuda.bindings import driver as cu

from dualtrack.errors import InputError
from dualtrack.runtime.driver import Stream, call


class DLDeviceType(enum.IntEnum):
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLCUDAManaged = 13


class DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class DLManagedTensor(ctypes.Structure):
    # ``deleter`` is ``void (*)(DLManagedTensor*)``; read and written here as a plain address.
    _fields_ = (("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p))


class DLPackVersion(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class DLManagedTensorVersioned(ctypes.Structure):
    """DLPack >= 1.0 (capsule name "dltensor_versioned"), which torch returns when asked for it."""

    _fields_ = (
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    )


def _capi(name: str, restype: Any, *argtypes: Any) -> Any:
    # Own prototypes: never set argtypes on the shared ctypes.pythonapi attributes.
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_new = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_capsule_is_valid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_capsule_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
_capsule_set_name = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_capsule_name = _capi("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
# The destructor receives a dying capsule: only raw pointers may touch it, never a py_object.
_capsule_is_valid_raw = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
_capsule_pointer_raw = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_incref = _capi("Py_IncRef", None, ctypes.py_object)
_decref = _capi("Py_DecRef", None, ctypes.py_object)

# PyCapsule keeps a pointer to its name: these constants outlive every capsule.
_DLTENSOR = b"dltensor"
_USED = b"used_dltensor"
_DLTENSOR_V = b"dltensor_versioned"
_USED_V = b"used_dltensor_versioned"

_Deleter = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)  # called with the GIL held


def _release_export(managed: int) -> None:
    """Drop the reference :func:`to_capsule` took on its ``_Export`` (and so on the owner)."""
    if managed:
        holder = ctypes.cast(DLManagedTensor.from_address(managed).manager_ctx, ctypes.py_object).value
        _decref(holder)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _export_deleter(managed: int) -> None:
    _release_export(managed)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    if _capsule_is_valid_raw(capsule, _DLTENSOR):  # never consumed: the tensor is still ours
        _release_export(_capsule_pointer_raw(capsule, _DLTENSOR))


_EXPORT_DELETER_ADDR = ctypes.cast(_export_deleter, ctypes.c_void_p).value
_CAPSULE_DESTRUCTOR_ADDR = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value

_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool
_NP_KINDS = {v: k for k, v in _DL_CODES.items()}


def dl_dtype(dtype: np.dtype | type | str) -> DLDataType:
    """The DLDataType of a numpy dtype (one lane)."""
    dt = np.dtype(dtype)
    if dt.kind not in _DL_CODES:
        raise InputError(f"dtype {dt} has no DLPack equivalent; use an int, uint, float, complex or bool dtype")
    return DLDataType(_DL_CODES[dt.kind], dt.itemsize * 8, 1)


def np_dtype(dl: DLDataType) -> np.dtype:
    """The numpy dtype of a DLDataType; bfloat16 and vector lanes have none."""
    if dl.lanes != 1 or dl.code not in _NP_KINDS:
        raise InputError(
            f"DLPack dtype (code {dl.code}, {dl.bits} bits, {dl.lanes} lanes) has no numpy "
            "equivalent; export float16/float32 instead"
        )
    kind = _NP_KINDS[dl.code]
    return np.dtype(np.bool_) if kind == "b" else np.dtype(f"{kind}{dl.bits // 8}")


class _Export:
    """Everything one exported DLManagedTensor points into, and the owner of the memory."""

    def __init__(
        self,
        ptr: int,
        shape: Sequence[int],
        strides: Sequence[int] | None,
        dtype: np.dtype,
        device: DLDevice,
        owner: object,
    ) -> None:
        self.owner = owner
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        self.managed = DLManagedTensor()
        t = self.managed.dl_tensor
        t.data, t.device, t.ndim, t.dtype, t.byte_offset = ptr, device, len(shape), dl_dtype(dtype), 0
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            t.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        self.managed.manager_ctx = id(self)
        self.managed.deleter = _EXPORT_DELETER_ADDR


def to_capsule(
    ptr: int,
    shape: Sequence[int],
    dtype: np.dtype | type | str,
    device_id: int,
    owner: object,
    *,
    device_type: DLDeviceType = DLDeviceType.kDLCUDA,
    strides: Sequence[int] | None = None,
) -> Any:
    """A "dltensor" capsule over ``ptr`` that keeps ``owner`` alive until the consumer is done.

    ``strides`` (in elements) default to NULL, which DLPack reads as compact row-major.
    """
    if strides is not None and len(strides) != len(shape):
        raise ValueError(f"strides {tuple(strides)} do not match shape {tuple(shape)}")
    export = _Export(ptr, shape, strides, np.dtype(dtype), DLDevice(int(device_type), device_id), owner)
    _incref(export)  # released by the deleter, or by the destructor of a capsule nobody consumed
    try:
        return _capsule_new(ctypes.addressof(export.managed), _DLTENSOR, _CAPSULE_DESTRUCTOR_ADDR)
    except BaseException:
        _decref(export)
        raise


class Imported(NamedTuple):
    """A tensor taken from another library: keep ``keepalive`` as long as ``ptr`` is used."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: np.dtype
    device_type: int
    device_id: int
    keepalive: object


def compact_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class _Consumed:
    """Holds a consumed DLPack tensor; calls its producer's deleter when collected or closed."""

    def __init__(self, managed: int, deleter: int | None) -> None:
        self._finalizer = weakref.finalize(self, _Deleter(deleter), managed) if deleter else None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def from_capsule(capsule: Any) -> Imported:
    """Consume a DLPack capsule ("dltensor" or "dltensor_versioned"): the capsule is marked used,
    and the producer's deleter runs when the returned ``keepalive`` is collected."""
    kinds = ((_DLTENSOR, _USED, DLManagedTensor), (_DLTENSOR_V, _USED_V, DLManagedTensorVersioned))
    match = next((k for k in kinds if _capsule_is_valid(capsule, k[0])), None)
    if match is None:
        got = _capsule_name(capsule) if type(capsule).__name__ == "PyCapsule" else type(capsule).__name__
        raise InputError(f"expected an unconsumed DLPack capsule, got {got!r}; a capsule can be consumed once")
    name, used, struct = match
    managed = _capsule_pointer(capsule, name)
    m = struct.from_address(managed)
    t = m.dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else compact_strides(shape)
    dtype = np_dtype(t.dtype)  # before the capsule is marked used: a refusal leaves it unconsumed
    _capsule_set_name(capsule, used)
    return Imported(
        (t.data or 0) + t.byte_offset,
        shape,
        strides,
        dtype,
        t.device.device_type,
        t.device.device_id,
        _Consumed(managed, m.deleter),
    )


def from_cuda_array_interface(obj: Any, *, wait: Callable[[int], None] | None = None) -> Imported:
    """Read ``obj.__cuda_array_interface__`` (v3). ``keepalive`` is ``obj`` itself.

    The interface does not name the device: ``device_id`` is -1. If it names a stream, ``wait``
    is called with it (a consumer orders its own stream after it); without ``wait`` that stream
    is synchronized before returning, so the data is ready for any stream.
    """
    cai = obj.__cuda_array_interface__
    if cai.get("mask") is not None:
        raise InputError("masked __cuda_array_interface__ arrays are not supported; pass a plain array")
    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(n) for n in cai["shape"])
    if cai.get("strides") is None:
        strides = compact_strides(shape)
    else:
        if any(s % dtype.itemsize for s in cai["strides"]):
            raise InputError(f"strides {cai['strides']} are not whole {dtype} elements; pass an aligned array")
        strides = tuple(int(s) // dtype.itemsize for s in cai["strides"])
    if cai.get("stream") is not None:
        if wait is not None:
            wait(int(cai["stream"]))
        else:
            call(cu.cuStreamSynchronize, cu.CUstream(int(cai["stream"])))
    return Imported(int(cai["data"][0]), shape, strides, dtype, int(DLDeviceType.kDLCUDA), -1, obj)


class DeviceArray:
    """GPU memory with a shape and dtype that torch, cupy and IREE can take without a copy.

    ``owner`` (e.g. a DeviceBuffer) is kept alive as long as this array or any consumer of it is.
    ``stream`` is the stream the data is written on, if any: consumers are ordered after it.
    """

    def __init__(
        self,
        ptr: int,
        shape: Sequence[int],
        dtype: np.dtype | type | str,
        device_id: int,
        owner: object,
        *,
        stream: Stream | None = None,
    ) -> None:
        self.ptr, self.shape, self.dtype = int(ptr), tuple(int(n) for n in shape), np.dtype(dtype)
        self.device_id, self.owner, self.stream = device_id, owner, stream

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __dlpack_device__(self) -> tuple[int, int]:
        return int(DLDeviceType.kDLCUDA), self.device_id

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Export as a "dltensor" capsule (DLPack 0.8 layout, which every consumer accepts).

        The data is ready when this returns unless the consumer passes ``stream=-1``: the
        producing stream is synchronized (CUDA-event interop with IREE does not exist, FACTS 8).
        """
        if copy:
            raise BufferError("DeviceArray exports without copying; copy=True is not supported")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        if self.stream is not None and stream != -1:
            self.stream.synchronize()
        return to_capsule(self.ptr, self.shape, self.dtype, self.device_id, self)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        stream = None if self.stream is None else (int(self.stream.handle) or 1)  # 0 means legacy: 1 here
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": stream,
        }

    def __repr__(self) -> str:
        return f"DeviceArray(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype}, device={self.device_id})"
