"""The CUDA runtime on a real GPU: context, PTX JIT and launch, the cubin cache, JIT error logs,
pool and pinned memory, and DLPack zero-copy into IREE's CUDA driver."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as cu

from dualtrack.errors import CudaError, DeviceError
from dualtrack.runtime import driver, memory
from dualtrack.runtime.dlpack import DeviceArray
from dualtrack.runtime.driver import Context, Device, Event, Module, Stream, call
from dualtrack.runtime.memory import DevicePool, HostBuffer, PinnedRange, copy_rows_to_host, download, upload

DATA = Path(__file__).parent / "data"
AXPY = (DATA / "axpy.ptx").read_bytes()


@pytest.fixture(scope="module")
def ctx() -> Iterator[Context]:
    context = Device(0).primary_context()
    yield context
    context.synchronize()


@pytest.fixture(scope="module")
def stream(ctx: Context) -> Stream:
    return Stream(ctx)


@pytest.fixture(scope="module")
def pool(ctx: Context) -> DevicePool:
    return DevicePool(ctx)


@pytest.fixture(params=[True, False], ids=["gil-held", "gil-released"])
def hold(request) -> Iterator[bool]:
    """Both ways of making the enqueue calls (driver.HeldCalls through ctypes, or cuda-python)."""
    driver.set_hold_gil(request.param)
    assert (driver.held_calls() is not None) == request.param
    try:
        yield request.param
    finally:
        driver.set_hold_gil(True)


def _axpy(ctx: Context, module: Module, stream: Stream, pool: DevicePool, n: int = 100_003) -> None:
    """Run y = a*x + y on fresh random data and compare with float64 numpy."""
    rng = np.random.default_rng()
    x, y, a = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32), np.float32(rng.uniform(-2, 2))
    dx, dy = pool.alloc(x.nbytes, stream), pool.alloc(y.nbytes, stream)
    upload(stream, dx, x)
    upload(stream, dy, y)
    module.function("axpy").launch(
        (n + 255) // 256,
        256,
        0,
        stream,
        [(dy.ptr, ctypes.c_void_p), (dx.ptr, ctypes.c_void_p), (float(a), ctypes.c_float), (n, ctypes.c_uint)],
    )
    out = np.empty_like(y)
    download(stream, out, dy)
    stream.synchronize()
    # fma in float32: one rounding of the exact result
    np.testing.assert_allclose(out, a.astype(np.float64) * x + y, rtol=1e-6, atol=1e-6)
    dx.close()
    dy.close()


def test_device_and_primary_context(ctx: Context) -> None:
    dev = ctx.device
    assert dev.name and dev.cc >= (7, 0) and dev.total_memory > 1 << 30
    assert dev.multiprocessor_count > 0 and dev.l2_size > 0 and dev.max_shared_per_block_optin >= 48 << 10
    assert dev.driver_version >= 12000
    assert int(call(cu.cuCtxGetCurrent)) == int(ctx.handle)
    assert int(call(cu.cuDevicePrimaryCtxRetain, dev.handle)) == int(ctx.handle)
    call(cu.cuDevicePrimaryCtxRelease, dev.handle)


def test_other_threads_make_the_context_current(ctx: Context) -> None:
    seen: list[int] = []

    def work() -> None:
        seen.append(int(call(cu.cuCtxGetCurrent)))
        ctx.make_current()
        seen.append(int(call(cu.cuCtxGetCurrent)))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [0, int(ctx.handle)]


def test_held_calls_find_every_symbol_and_report_errors(ctx: Context, stream: Stream) -> None:
    """This driver exports every call HeldCalls makes (their versioned names: a missing one would
    silently fall back to cuda-python), and a failing one raises the checker's CudaError."""
    held = driver.HeldCalls(ctypes.PyDLL("libcuda.so.1"))
    names = (
        "cuCtxSetCurrent",
        "cuEventRecord",
        "cuStreamWaitEvent",
        "cuGraphLaunch",
        "cuLaunchKernel",
        "cuStreamQuery",
    )
    for name in (*names, "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync", "cuMemcpyBatchAsync"):
        assert held.has(name), name
    with pytest.raises(CudaError, match="cuMemcpyDtoDAsync"):
        held.copy("DtoD", 0, 0, 16, stream.handle)
    held.set_current(ctx.handle)
    assert int(call(cu.cuCtxGetCurrent)) == int(ctx.handle)
    stream.synchronize()
    assert held.stream_done(stream.handle)
    stream.finish()


def test_ptx_loads_launches_and_computes(ctx: Context, stream: Stream, pool: DevicePool, hold: bool) -> None:
    module = Module.load(ctx, AXPY, kind="ptx", origin="tests/gpu/data/axpy.ptx", target="sm_80")
    assert module.cache == "off" and module.jit_ms > 0 and module.load_ms >= module.jit_ms
    _axpy(ctx, module, stream, pool)
    stream.synchronize()
    module.close()


def test_cubin_cache_miss_hit_and_rebuild(ctx: Context, stream: Stream, pool: DevicePool, tmp_path: Path) -> None:
    first = Module.load(ctx, AXPY, kind="ptx", origin="axpy.ptx", target="sm_80", cache_dir=tmp_path)
    assert first.cache == "miss" and first.jit_ms > 0
    (entry,) = tmp_path.glob("*.cubin")
    assert entry.name.startswith(ctx.device.arch) and entry.read_bytes()[:4] == b"\x7fELF"
    second = Module.load(ctx, AXPY, kind="ptx", origin="axpy.ptx", target="sm_80", cache_dir=tmp_path)
    assert second.cache == "hit" and second.jit_ms == 0.0
    _axpy(ctx, second, stream, pool)
    entry.write_bytes(b"not a cubin")
    third = Module.load(ctx, AXPY, kind="ptx", origin="axpy.ptx", target="sm_80", cache_dir=tmp_path)
    assert third.cache == "rebuilt"
    _axpy(ctx, third, stream, pool)
    stream.synchronize()
    for m in (first, second, third):
        m.close()


@pytest.mark.parametrize("cached", [False, True])
def test_jit_error_log_travels_with_the_error(ctx: Context, tmp_path: Path, cached: bool) -> None:
    with pytest.raises(
        CudaError, match=r"\(tests/gpu/data/broken.ptx, ptx for sm_80\) failed: CUDA_ERROR_INVALID_PTX"
    ) as err:
        Module.load(
            ctx,
            (DATA / "broken.ptx").read_bytes(),
            kind="ptx",
            origin="tests/gpu/data/broken.ptx",
            target="sm_80",
            cache_dir=tmp_path if cached else None,
        )
    assert "%f9" in err.value.detail and "error" in err.value.detail.lower()
    assert not list(tmp_path.glob("*.cubin"))


def test_unknown_kernel_name(ctx: Context) -> None:
    module = Module.load(ctx, AXPY, kind="ptx", origin="axpy.ptx", target="sm_80")
    with pytest.raises(DeviceError, match=r"kernel 'saxpy' is not in axpy\.ptx"):
        module.function("saxpy")
    module.close()


def test_dynamic_shared_memory_opt_in(ctx: Context, stream: Stream) -> None:
    module = Module.load(ctx, AXPY, kind="ptx", origin="axpy.ptx", target="sm_80")
    kernel = module.function("axpy")
    args = [(0, ctypes.c_void_p), (0, ctypes.c_void_p), (1.0, ctypes.c_float), (0, ctypes.c_uint)]  # n=0: no access
    big = 100 << 10
    with pytest.raises(CudaError, match=r"cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        kernel.launch(1, 32, big, stream, args)
    kernel.set_max_dynamic_shared(big)
    kernel.launch(1, 32, big, stream, args)
    stream.synchronize()
    with pytest.raises(DeviceError, match=r"per block: use smaller tiles"):
        kernel.set_max_dynamic_shared(ctx.device.max_shared_per_block_optin + 1)
    module.close()


def test_event_timing(ctx: Context, stream: Stream, pool: DevicePool, hold: bool) -> None:
    module = Module.load(ctx, AXPY, kind="ptx", origin="axpy.ptx", target="sm_80")
    start, end = Event(ctx), Event(ctx)
    start.record(stream)
    _axpy(ctx, module, stream, pool, n=1 << 20)
    end.record(stream)
    assert 0.0 < start.elapsed_ms(end) < 10_000
    module.close()


def test_pool_alloc_free_and_peak(ctx: Context, stream: Stream) -> None:
    pool = DevicePool(ctx)
    stream.synchronize()
    pool.reset_peak()
    a, b = pool.alloc(64 << 20, stream), pool.alloc(32 << 20, stream)
    assert a.ptr != b.ptr and a.owner is pool
    stream.synchronize()
    assert pool.used_bytes() >= 96 << 20
    a.close()
    b.close()
    stream.synchronize()
    assert pool.used_bytes() == 0
    assert pool.peak_bytes() >= 96 << 20
    assert pool.reserved_bytes() >= 96 << 20  # threshold UINT64_MAX: freed memory stays in the pool
    with pytest.raises(DeviceError, match=r"out of GPU memory .* asked for .* GiB .* smaller batch"):
        pool.alloc(2 * ctx.device.total_memory, stream)
    pool.trim()
    pool.close()


def test_pinned_upload_download_round_trip(ctx: Context, stream: Stream, pool: DevicePool, hold: bool) -> None:
    n = 1 << 20
    src, dst = HostBuffer(ctx, 4 * n), HostBuffer(ctx, 4 * n)
    expected = np.random.default_rng().standard_normal(n).astype(np.float32)
    src.numpy(np.float32)[:] = expected
    buf = pool.alloc(4 * n, stream)
    upload(stream, buf, src)
    download(stream, dst, buf)
    stream.synchronize()
    np.testing.assert_array_equal(dst.numpy(np.float32, (n,)), expected)
    buf.close()
    stream.synchronize()
    src.close()
    dst.close()


@pytest.mark.parametrize("batched", [True, False])
def test_rows_copied_into_a_page_locked_shared_file(
    ctx: Context, stream: Stream, pool: DevicePool, tmp_path: Path, monkeypatch, batched: bool, hold: bool
) -> None:
    """copy_rows_to_host: device rows land at the host addresses given (a mapped file registered
    with PinnedRange, as the service's slot file), in any order, and nothing else is written;
    cuMemcpyBatchAsync and the one-copy-per-row fallback alike. Exact (a copy)."""
    import mmap

    monkeypatch.setattr(memory, "_BATCH_COPY", batched)
    rows, row_bytes, slots = 5, 4096 + 64, 9
    path = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    f = path / f"dualtrack-test-{id(tmp_path)}.slots"
    with open(f, "w+b") as fh:
        fh.truncate(slots * row_bytes)
        mapped = mmap.mmap(fh.fileno(), slots * row_bytes)
    f.unlink()
    try:
        view = np.frombuffer(mapped, np.uint8).reshape(slots, row_bytes)
        view[:] = 0xEE
        pinned = PinnedRange(ctx, view)
        src = np.random.default_rng(3).integers(0, 255, (rows, row_bytes), dtype=np.uint8)
        buf = pool.alloc(src.nbytes, stream)
        upload(stream, buf, np.ascontiguousarray(src))
        targets = {0: 7, 2: 1, 3: 4, 4: 0}  # row -> slot; row 1 is not wanted
        copy_rows_to_host(stream, buf.ptr, row_bytes, [(r, int(view[s].ctypes.data)) for r, s in targets.items()])
        stream.synchronize()
        for r, s in targets.items():
            np.testing.assert_array_equal(view[s], src[r])
        untouched = sorted(set(range(slots)) - set(targets.values()))
        assert (view[untouched] == 0xEE).all()
        last = int(view[8].ctypes.data)
        assert pinned.holds(last, row_bytes) and not pinned.holds(last, row_bytes + 1)
        pinned.close()
        assert not pinned.holds(int(view[0].ctypes.data), 1)
        buf.close()
        stream.synchronize()
        del view
    finally:
        mapped.close()


def test_dlpack_capsule_into_iree_is_zero_copy(ctx: Context, stream: Stream, pool: DevicePool) -> None:
    ireert = pytest.importorskip("iree.runtime")
    device = ireert.get_device("cuda")
    ctx.make_current()  # IREE shares the primary context (FACTS 5); keep ours current here anyway
    rng = np.random.default_rng()
    first, second = rng.standard_normal((8, 128), np.float32), rng.standard_normal((8, 128), np.float32)
    buf = pool.alloc(first.nbytes, stream)
    upload(stream, buf, first)
    arr = DeviceArray(buf.ptr, first.shape, first.dtype, ctx.device.index, buf, stream=stream)
    view = device.from_dlpack_capsule(arr.__dlpack__())
    np.testing.assert_array_equal(ireert.DeviceArray(device, view, implicit_host_transfer=True).to_host(), first)
    upload(stream, buf, second)  # new data in the same memory
    stream.synchronize()
    np.testing.assert_array_equal(ireert.DeviceArray(device, view, implicit_host_transfer=True).to_host(), second)
    del view


def test_cupy_consumes_device_array(ctx: Context, stream: Stream, pool: DevicePool) -> None:
    cupy = pytest.importorskip("cupy")
    expected = np.random.default_rng().standard_normal((16, 16)).astype(np.float32)
    buf = pool.alloc(expected.nbytes, stream)
    upload(stream, buf, expected)
    arr = DeviceArray(buf.ptr, expected.shape, expected.dtype, ctx.device.index, buf, stream=stream)
    np.testing.assert_array_equal(cupy.asnumpy(cupy.from_dlpack(arr)), expected)
    np.testing.assert_array_equal(cupy.asnumpy(cupy.asarray(arr)), expected)  # __cuda_array_interface__
