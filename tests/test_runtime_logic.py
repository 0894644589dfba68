"""The runtime's logic that needs no GPU: the checker, JIT options, kernel parameters, the cubin
cache key, DLPack on host memory (numpy and IREE's CPU driver as consumers), memory messages."""

from __future__ import annotations

import ctypes
import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cuda.bindings import driver as cu

from dualtrack.errors import CudaError, DeviceError, InputError
from dualtrack.runtime import dlpack as dl
from dualtrack.runtime import driver as drv
from dualtrack.runtime.memory import fmt_bytes, oom_message

CU = cu.CUresult


# --- the checker ------------------------------------------------------------------------------


def test_check_raises_cuda_error_with_name_and_explanation() -> None:
    with pytest.raises(CudaError, match=r"^cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory") as err:
        drv.check((CU.CUDA_ERROR_OUT_OF_MEMORY,), "cuMemAlloc")
    assert err.value.call == "cuMemAlloc"
    assert err.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert err.value.explanation.startswith("out of memory")
    assert isinstance(err.value, DeviceError)


def test_check_unwraps_values() -> None:
    assert drv.check((CU.CUDA_SUCCESS,), "f") is None
    assert drv.check((CU.CUDA_SUCCESS, 7), "f") == 7
    assert drv.check((CU.CUDA_SUCCESS, 1, 2), "f") == (1, 2)
    assert drv.check(CU.CUDA_SUCCESS, "f") is None


def test_check_names_an_unknown_code() -> None:
    with pytest.raises(CudaError, match=r"cuFoo failed: CUresult 99999"):
        drv.check((99999,), "cuFoo")


def test_call_maps_missing_libcuda_to_one_device_error_line() -> None:
    def cuFake() -> tuple:
        raise drv._LibNotFound('"cuda" is an NVIDIA driver library and can only be found via system search')

    with pytest.raises(DeviceError, match=r"no NVIDIA GPU or driver found .* --device cpu") as err:
        drv.call(cuFake)
    assert "\n" not in str(err.value)


def test_call_passes_the_function_name_to_the_checker() -> None:
    def cuLaunchKernel() -> tuple:
        return (CU.CUDA_ERROR_INVALID_VALUE,)

    with pytest.raises(CudaError, match=r"^cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE: invalid"):
        drv.call(cuLaunchKernel)


def test_load_driver_without_gpu_raises_the_one_line_message() -> None:
    try:
        drv.load_driver()
    except DeviceError as exc:
        assert str(exc) in (drv.NO_DRIVER, drv.NO_DEVICE)
        assert "\n" not in str(exc)
    else:
        pytest.skip("this machine has a GPU and a driver")


def test_load_driver_maps_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drv.cu, "cuInit", lambda flags: (CU.CUDA_ERROR_NO_DEVICE,))
    with pytest.raises(DeviceError, match=r"no NVIDIA GPU found") as err:
        drv.load_driver()
    assert not isinstance(err.value, CudaError)


# --- JIT options and kernel parameters --------------------------------------------------------


def test_jit_options_list() -> None:
    jit = drv.jit_options(opt_level=3, log_size=4096)
    o = cu.CUjit_option
    assert jit.options == [
        o.CU_JIT_OPTIMIZATION_LEVEL,
        o.CU_JIT_CACHE_MODE,
        o.CU_JIT_INFO_LOG_BUFFER,
        o.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        o.CU_JIT_ERROR_LOG_BUFFER,
        o.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        o.CU_JIT_WALL_TIME,
        o.CU_JIT_LOG_VERBOSE,
    ]
    assert jit.values[0] == 3
    assert jit.values[1] is cu.CUjit_cacheMode.CU_JIT_CACHE_OPTION_CA
    assert jit.values[2] is jit.info_log and len(jit.info_log) == 4096 and jit.values[3] == 4096
    assert jit.values[4] is jit.error_log and jit.values[5] == 4096
    assert jit.values[7] == 1
    with pytest.raises(ValueError, match=r"0..4"):
        drv.jit_options(opt_level=5)


def test_jit_option_values_are_what_cuda_bindings_marshals() -> None:
    helper = getattr(cu, "_HelperCUjit_option", None)
    if helper is None:
        pytest.skip("this cuda-bindings hides its JIT option marshaller")
    jit = drv.jit_options()
    ptrs = [helper(k, v).cptr for k, v in zip(jit.options, jit.values, strict=True)]
    assert ptrs[0] == 4  # by value
    assert ptrs[1] == int(cu.CUjit_cacheMode.CU_JIT_CACHE_OPTION_CA)
    # The log buffers are passed by address, so the driver writes into our bytearrays.
    assert ptrs[2] == ctypes.addressof((ctypes.c_char * len(jit.info_log)).from_buffer(jit.info_log))
    assert ptrs[4] == ctypes.addressof((ctypes.c_char * len(jit.error_log)).from_buffer(jit.error_log))


def test_decode_log_and_logs_text() -> None:
    jit = drv.jit_options(log_size=64)
    jit.error_log[:24] = b"line 3; error: bad\n\0junk"
    assert drv.decode_log(jit.error_log) == "line 3; error: bad"
    assert jit.logs() == "error log:\nline 3; error: bad"


def test_kernel_params_form_and_packing() -> None:
    params = drv.kernel_params([(0x7F0000001000, ctypes.c_void_p), (2.5, ctypes.c_float), (1000, ctypes.c_uint)])
    assert params == ((0x7F0000001000, 2.5, 1000), (ctypes.c_void_p, ctypes.c_float, ctypes.c_uint))
    assert drv.kernel_params([]) == 0
    packer = getattr(cu, "_HelperKernelParams", None)
    if packer is None:
        pytest.skip("this cuda-bindings hides its kernelParams packer")
    packed = packer(params)  # owns the arrays: keep it alive while reading them
    slots = (ctypes.c_void_p * 3).from_address(packed.ckernelParams)
    assert ctypes.c_uint64.from_address(slots[0]).value == 0x7F0000001000
    assert ctypes.c_float.from_address(slots[1]).value == 2.5
    assert ctypes.c_uint.from_address(slots[2]).value == 1000


def test_kernel_params_refuse_what_would_pack_wrongly() -> None:
    with pytest.raises(TypeError, match=r"argument 0: a pointer must be an int"):
        drv.kernel_params([(cu.CUdeviceptr(4096), ctypes.c_void_p)])
    with pytest.raises(TypeError, match=r"argument 1: .* is not a ctypes scalar"):
        drv.kernel_params([(1, ctypes.c_int), (1, int)])


def test_param_array_points_at_what_cuda_python_packs() -> None:
    """HeldCalls' kernelParams (ctypes, the GIL kept) hold the same bytes as cuda-python's, for
    scalars, a pointer and a struct by value (resize_rgb_u8's jobs)."""

    class Jobs(ctypes.Structure):
        _fields_ = (("w", ctypes.c_int), ("src", ctypes.c_uint64 * 2))

    jobs = Jobs(640, (ctypes.c_uint64 * 2)(0x7F00DEAD0000, 0x7F00BEEF0000))
    args = [(0x7F0000001000, ctypes.c_void_p), (2.5, ctypes.c_float), (1000, ctypes.c_uint), (jobs, None)]
    drv.kernel_params(args)  # accepted by the checker
    array, keep = drv.param_array(args)
    assert ctypes.c_uint64.from_address(array[0]).value == 0x7F0000001000
    assert ctypes.c_float.from_address(array[1]).value == 2.5
    assert ctypes.c_uint.from_address(array[2]).value == 1000
    assert array[3] == ctypes.addressof(jobs)
    assert ctypes.string_at(array[3], ctypes.sizeof(Jobs)) == bytes(jobs)
    assert len(keep) == 3


def test_memcpy_attributes_lay_out_as_cuda_h() -> None:
    """The ctypes CUmemcpyAttributes HeldCalls.copy_batch passes has cuda-python's layout (cuda.h)."""
    theirs = cu.CUmemcpyAttributes()
    theirs.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    theirs.srcLocHint.type = cu.CUmemLocationType(1)
    theirs.srcLocHint.id = 3
    theirs.dstLocHint.type = cu.CUmemLocationType(2)
    theirs.dstLocHint.id = 5
    theirs.flags = 1
    ours = drv._MemcpyAttributes(
        srcAccessOrder=drv._SRC_ACCESS_ORDER_STREAM,
        srcLocHint=drv._MemLocation(1, 3),
        dstLocHint=drv._MemLocation(2, 5),
        flags=1,
    )
    assert ctypes.string_at(int(theirs.getPtr()), ctypes.sizeof(ours)) == bytes(ours)


def test_held_calls_check_every_status_and_skip_missing_symbols() -> None:
    """A failing status raises the checker's CudaError naming the call; a symbol this libcuda lacks
    is left to cuda-python (has() is False). Here a stand-in library records the calls."""
    seen: list[tuple[str, tuple[int, ...]]] = []

    def symbol(name: str, status: int):  # a ctypes function's surface: argtypes, restype, call
        def fn(*args: int) -> int:
            seen.append((name, args))
            return status

        return fn

    lib = SimpleNamespace(
        cuEventRecord=symbol("cuEventRecord", 0),
        cuStreamWaitEvent=symbol("cuStreamWaitEvent", int(CU.CUDA_ERROR_INVALID_HANDLE)),
        cuMemcpyDtoDAsync_v2=symbol("cuMemcpyDtoDAsync_v2", 0),
    )
    held = drv.HeldCalls(lib)  # type: ignore[arg-type]
    assert held.has("cuEventRecord") and held.has("cuMemcpyDtoDAsync")
    assert not held.has("cuLaunchKernel") and not held.has("cuMemcpyBatchAsync")
    held.event_record(0x10, cu.CUstream(0x20))
    held.copy("DtoD", 0x1000, 0x2000, 64, 0x20)
    with pytest.raises(CudaError, match=r"^cuStreamWaitEvent failed: CUDA_ERROR_INVALID_HANDLE"):
        held.stream_wait(0x20, 0x10)
    assert seen == [
        ("cuEventRecord", (0x10, 0x20)),
        ("cuMemcpyDtoDAsync_v2", (0x1000, 0x2000, 64, 0x20)),
        ("cuStreamWaitEvent", (0x20, 0x10, 0)),
    ]


def test_hold_gil_is_a_setting(monkeypatch) -> None:
    from dualtrack.settings import Settings

    assert Settings.from_env().hold_gil
    monkeypatch.setenv("DUALTRACK_HOLD_GIL", "0")
    assert not Settings.from_env().hold_gil


def test_cubin_cache_name_moves_with_every_input() -> None:
    ptx = b".version 8.0\n.target sm_80\n"
    base = drv.cubin_cache_name(ptx, arch="sm_90", driver_version=13000, opt_level=4)
    assert base.startswith("sm_90-") and base.endswith(".cubin")
    assert drv.cubin_cache_name(ptx + b"\0", arch="sm_90", driver_version=13000, opt_level=4) == base
    changed = {
        drv.cubin_cache_name(ptx + b"// edit\n", arch="sm_90", driver_version=13000, opt_level=4),
        drv.cubin_cache_name(ptx, arch="sm_89", driver_version=13000, opt_level=4),
        drv.cubin_cache_name(ptx, arch="sm_90", driver_version=13010, opt_level=4),
        drv.cubin_cache_name(ptx, arch="sm_90", driver_version=13000, opt_level=3),
    }
    assert base not in changed and len(changed) == 4


def _fake_ctx(driver_version: int = 13000) -> SimpleNamespace:
    return SimpleNamespace(device=SimpleNamespace(driver_version=driver_version, arch="sm_90"), handle=None)


def test_module_load_refuses_a_ptx_isa_the_driver_cannot_jit() -> None:
    ptx = b".version 9.0\n.target sm_90a\n.address_size 64\n"
    with pytest.raises(DeviceError, match=r"PTX ISA 9.0, which needs a CUDA 13.0 driver; this driver is CUDA 12.9"):
        drv.Module.load(_fake_ctx(12090), ptx, kind="ptx", origin="conv.ptx", target="compute_90a")
    with pytest.raises(ValueError, match=r"kind must be"):
        drv.Module.load(_fake_ctx(), ptx, kind="fatbin", origin="conv.ptx", target="compute_90a")


def test_jit_error_carries_origin_target_fix_and_log() -> None:
    module = drv.Module.__new__(drv.Module)
    module.ctx, module.origin, module.target = _fake_ctx(), "ptx/conv_compute_90a.ptx", "compute_90a"
    jit = drv.jit_options(log_size=256)
    jit.error_log[:40] = b"ptxas application ptx input, line 7; e\0"
    failure = CudaError("cuModuleLoadDataEx", "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed")
    err = module._jit_error(failure, jit, "ptx")
    assert str(err).startswith(
        "cuModuleLoadDataEx(ptx/conv_compute_90a.ptx, ptx for compute_90a) failed: CUDA_ERROR_INVALID_PTX: "
        "a PTX JIT compilation failed (ptxas application ptx input, line 7; e); the PTX does not assemble "
        "for this GPU (sm_90)"
    )
    assert "line 7" in err.detail and err.name == "CUDA_ERROR_INVALID_PTX"


class FakeDriver:
    """Just enough of cuda.bindings.driver to drive Module.load's JIT and cubin-cache logic."""

    CUBIN = b"\x7fELF fake cubin"

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.loaded: list[bytes] = []
        self.links = self.destroyed = 0
        self.bad_ptx = False
        self._cubin = ctypes.create_string_buffer(self.CUBIN, len(self.CUBIN))
        ok = CU.CUDA_SUCCESS

        def cuModuleLoadDataEx(image: bytes, n: int, opts: list, vals: list) -> tuple:
            if image.startswith(b"garbage"):
                return (CU.CUDA_ERROR_INVALID_IMAGE, None)
            self.loaded.append(bytes(image))
            return ok, cu.CUmodule(len(self.loaded))

        def cuLinkCreate(n: int, opts: list, vals: list) -> tuple:
            self.error_log = vals[opts.index(cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER)]
            return ok, cu.CUlinkState(1)

        def cuLinkAddData(state: object, kind: object, data: bytes, size: int, *rest: object) -> tuple:
            assert kind == cu.CUjitInputType.CU_JIT_INPUT_PTX and data.endswith(b"\0") and size == len(data)
            self.links += 1
            if self.bad_ptx:
                self.error_log[:24] = b"line 9; error: bad reg\0"
                return (CU.CUDA_ERROR_INVALID_PTX,)
            return (ok,)

        def cuLinkComplete(state: object) -> tuple:
            return ok, ctypes.addressof(self._cubin), len(self.CUBIN)

        def cuLinkDestroy(state: object) -> tuple:
            self.destroyed += 1
            return (ok,)

        for fn in (cuModuleLoadDataEx, cuLinkCreate, cuLinkAddData, cuLinkComplete, cuLinkDestroy):
            mp.setattr(cu, fn.__name__, fn)
        mp.setattr(cu, "cuModuleUnload", lambda handle: (ok,))
        mp.setattr(cu, "cuCtxPushCurrent", lambda handle: (ok,))
        mp.setattr(cu, "cuCtxPopCurrent", lambda: (ok, None))


PTX = b"// test\n.version 8.0\n.target sm_80\n.address_size 64\n"


def _load(**kw: object) -> drv.Module:
    ctx = _fake_ctx()
    ctx._finalizer = SimpleNamespace(alive=True)
    return drv.Module.load(ctx, PTX, kind="ptx", origin="k.ptx", target="sm_80", **kw)  # type: ignore[arg-type]


def test_module_load_cubin_cache_miss_hit_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    fake = FakeDriver(monkeypatch)
    first = _load(cache_dir=tmp_path)
    (entry,) = tmp_path.iterdir()
    assert (first.cache, fake.links, fake.destroyed) == ("miss", 1, 1)
    assert entry.read_bytes() == fake.loaded[-1] == FakeDriver.CUBIN and entry.name.startswith("sm_90-")
    assert 0 < first.jit_ms <= first.load_ms
    second = _load(cache_dir=tmp_path)
    assert (second.cache, second.jit_ms, fake.links) == ("hit", 0.0, 1)
    entry.write_bytes(b"garbage")
    third = _load(cache_dir=tmp_path)
    assert (third.cache, fake.links, entry.read_bytes()) == ("rebuilt", 2, FakeDriver.CUBIN)
    plain = _load()
    assert plain.cache == "off" and fake.loaded[-1] == PTX + b"\0" and 0 < plain.jit_ms <= plain.load_ms
    for m in (first, second, third, plain):
        m.close()


def test_module_load_link_failure_keeps_log_and_writes_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    fake = FakeDriver(monkeypatch)
    fake.bad_ptx = True
    with pytest.raises(
        CudaError,
        match=r"^cuLinkAddData\(k\.ptx, ptx for sm_80\) failed: CUDA_ERROR_INVALID_PTX: "
        r".*\(line 9; error: bad reg\); the PTX does not assemble",
    ) as err:
        _load(cache_dir=tmp_path)
    assert "line 9; error: bad reg" in err.value.detail
    assert fake.destroyed == 1 and not list(tmp_path.iterdir())


# --- DLPack on host memory --------------------------------------------------------------------


class Owner:
    """Something that owns memory; weakref-able so tests can see when it is let go."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class HostProducer:
    def __init__(self, owner: Owner) -> None:
        self.owner = owner

    def __dlpack_device__(self) -> tuple[int, int]:
        return int(dl.DLDeviceType.kDLCPU), 0

    def __dlpack__(self, **_: object) -> object:
        a = self.owner.array
        return dl.to_capsule(a.ctypes.data, a.shape, a.dtype, 0, self.owner, device_type=dl.DLDeviceType.kDLCPU)


def _gone(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def test_capsule_round_trip_through_from_capsule() -> None:
    rng = np.random.default_rng(1)
    owner = Owner(rng.standard_normal((3, 5)).astype(np.float32))
    ref = weakref.ref(owner)
    capsule = HostProducer(owner).__dlpack__()
    ptr = owner.array.ctypes.data
    del owner
    view = dl.from_capsule(capsule)
    assert "used_dltensor" in repr(capsule)
    assert (view.ptr, view.shape, view.strides, view.dtype) == (ptr, (3, 5), (5, 1), np.dtype(np.float32))
    assert (view.device_type, view.device_id) == (int(dl.DLDeviceType.kDLCPU), 0)
    assert not _gone(ref)  # the consumer holds it
    with pytest.raises(InputError, match=r"unconsumed DLPack capsule"):
        dl.from_capsule(capsule)
    view.keepalive.close()
    del view
    assert _gone(ref)


def test_numpy_consumes_the_capsule_zero_copy() -> None:
    rng = np.random.default_rng(2)
    expected = rng.standard_normal((4, 6)).astype(np.float32)
    owner = Owner(expected.copy())
    ref = weakref.ref(owner)
    got = np.from_dlpack(HostProducer(owner))
    np.testing.assert_array_equal(got, expected)
    owner.array[1, 2] = 42.0
    assert got[1, 2] == 42.0  # the same memory
    del owner
    assert not _gone(ref)
    np.testing.assert_array_equal(got[0], expected[0])
    del got
    assert _gone(ref)


def test_unconsumed_capsule_releases_its_owner() -> None:
    owner = Owner(np.arange(4, dtype=np.int64))
    ref = weakref.ref(owner)
    capsule = HostProducer(owner).__dlpack__()
    del owner
    assert not _gone(ref)
    del capsule
    assert _gone(ref)


@pytest.mark.parametrize("versioned", [False, True])
def test_from_capsule_reads_numpys_capsules(versioned: bool) -> None:
    a = np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2]  # strided
    capsule = a.__dlpack__(max_version=(1, 0)) if versioned else a.__dlpack__()
    view = dl.from_capsule(capsule)
    assert (view.ptr, view.shape, view.strides, view.dtype) == (a.ctypes.data, (4, 3), (6, 2), np.dtype(np.int16))
    view.keepalive.close()


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_, np.complex64]
)
def test_dtype_mapping_round_trips(dtype: type) -> None:
    assert dl.np_dtype(dl.dl_dtype(dtype)) == np.dtype(dtype)


def test_dtype_mapping_refuses_what_numpy_lacks() -> None:
    with pytest.raises(InputError, match=r"no numpy equivalent"):
        dl.np_dtype(dl.DLDataType(4, 16, 1))  # bfloat16
    with pytest.raises(InputError, match=r"no DLPack equivalent"):
        dl.dl_dtype(np.dtype("U4"))


def test_iree_cpu_imports_the_capsule_zero_copy() -> None:
    ireert = pytest.importorskip("iree.runtime")
    device = ireert.get_device("local-task")
    raw = np.zeros(64 + 32, dtype=np.float32)  # IREE wants 64-byte aligned host pointers
    start = (-raw.ctypes.data % 64) // 4
    owner = Owner(raw[start : start + 32].reshape(4, 8))
    owner.array[:] = np.random.default_rng(3).standard_normal((4, 8))
    ref = weakref.ref(owner)
    view = device.from_dlpack_capsule(HostProducer(owner).__dlpack__())
    np.testing.assert_array_equal(ireert.DeviceArray(device, view).to_host(), owner.array)
    owner.array[:] = 5.0  # new data, same memory: IREE must see it
    np.testing.assert_array_equal(ireert.DeviceArray(device, view).to_host(), np.full((4, 8), 5.0, np.float32))
    del owner
    assert not _gone(ref)
    del view
    assert _gone(ref)


def test_device_array_interfaces() -> None:
    owner = object()
    arr = dl.DeviceArray(0x7F0000000000, (2, 3), np.float16, 1, owner)
    assert arr.__dlpack_device__() == (int(dl.DLDeviceType.kDLCUDA), 1)
    assert arr.nbytes == 12
    assert arr.__cuda_array_interface__ == {
        "shape": (2, 3),
        "typestr": "<f2",
        "data": (0x7F0000000000, False),
        "version": 3,
        "strides": None,
        "stream": None,
    }
    view = dl.from_capsule(arr.__dlpack__(stream=None))
    assert (view.ptr, view.shape, view.dtype, view.device_type, view.device_id) == (
        0x7F0000000000,
        (2, 3),
        np.dtype(np.float16),
        2,
        1,
    )
    view.keepalive.close()
    with pytest.raises(BufferError, match=r"without copying"):
        arr.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"not"):
        arr.__dlpack__(dl_device=(2, 0))


def test_from_cuda_array_interface() -> None:
    class Foreign:
        __cuda_array_interface__ = {  # noqa: RUF012
            "shape": (4, 3),
            "typestr": "<f4",
            "data": (0x7F0000002000, False),
            "version": 3,
            "strides": (24, 8),
            "stream": None,
        }

    obj = Foreign()
    view = dl.from_cuda_array_interface(obj)
    assert (view.ptr, view.shape, view.strides, view.dtype) == (0x7F0000002000, (4, 3), (6, 2), np.dtype("<f4"))
    assert view.keepalive is obj and view.device_type == int(dl.DLDeviceType.kDLCUDA)
    obj.__cuda_array_interface__ = {**Foreign.__cuda_array_interface__, "mask": object()}
    with pytest.raises(InputError, match=r"masked"):
        dl.from_cuda_array_interface(obj)


# --- memory messages --------------------------------------------------------------------------


def test_oom_message_names_sizes_and_fix() -> None:
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 << 20) == "3.0 MiB" and fmt_bytes(3 << 29) == "1.50 GiB"
    msg = oom_message(2 << 30, 1 << 30, 141 << 30, 8 << 30, "NVIDIA H200")
    assert msg == (
        "out of GPU memory on NVIDIA H200: asked for 2.00 GiB with 1.00 GiB free of 141.00 GiB (dualtrack's "
        "pool holds 8.00 GiB); use a smaller batch (--batch) or free the GPU of other processes (nvidia-smi)"
    )


# -- IREE runtime settings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, ("caching",)), ("caching", ("caching",)), ("none", ()), ("", ()), (" caching , x ", ("caching", "x"))],
)
def test_iree_allocator_setting(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: tuple[str, ...]) -> None:
    from dualtrack.settings import Settings

    if value is None:
        monkeypatch.delenv("DUALTRACK_IREE_ALLOCATOR", raising=False)
    else:
        monkeypatch.setenv("DUALTRACK_IREE_ALLOCATOR", value)
    monkeypatch.setenv("DUALTRACK_IREE_FLAGS", "--a=1  --b=2")
    s = Settings.from_env()
    assert s.iree_allocators == expected
    assert s.iree_flags == ("--a=1", "--b=2")


def test_iree_caching_allocator_runs_a_module(tiny_bundle: Path) -> None:
    """The caching allocator layered over IREE's CPU device gives the same results as the plain one."""

    from dualtrack.contract.bundle import Bundle
    from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index

    bundle = Bundle.open(tiny_bundle)
    seg = bundle.plan.segments[0]
    x = np.random.default_rng(3).integers(0, 256, (1, *seg.inputs[0].shape[1:]), dtype=np.uint8)
    params = parameter_index(bundle.weights)
    outs = []
    for allocators in ((), ("caching",)):
        dev = IreeDevice.create("cpu", allocators=allocators)
        mod = IreeModule(dev, bundle.vmfb(seg, "llvm-cpu", 1), params, "main")
        outs.append([np.array(o.to_host(), copy=True) for o in mod(x)])
        del mod, dev
    for plain, cached in zip(*outs, strict=True):
        np.testing.assert_array_equal(plain, cached)
