"""Does IREE's call cost more on a buffer imported from Track A's memory (the stream-ordered pool,
or plain cuMemAlloc) than on one IREE allocated itself? Times the reference bundle's
pre-processing module on each, then run_batch with its results dropped and kept (GPU machine,
the carried reference bundle at .carry/unet):

    python3 bench/probe_iree_input.py
"""
import time, sys
import numpy as np
import iree.runtime as rt
from cuda.bindings import driver as cu
from dualtrack.bundle import Bundle
from dualtrack.runtime.engine import Engine
from dualtrack.runtime import dlpack
eng = Engine.load(Bundle.open(".carry/unet"), "cuda")
be = eng.backend
seg0, seg2 = eng.plan.segments[0], eng.plan.segments[2]
for batch in (8, 1):
    host = np.random.default_rng(0).integers(0, 256, (batch, 512, 512, 3), dtype=np.uint8)
    pool_t = be.from_host(host)
    mod = be.module(seg0, batch)
    dev = be.iree.device
    def imp(t): return dev.from_dlpack_capsule(dlpack.to_capsule(t.ptr, t.shape, t.dtype, be.device.index, t.keepalive))
    v_pool = imp(pool_t)
    err, raw = cu.cuMemAlloc(host.nbytes); assert err == 0
    cu.cuMemcpyHtoD(raw, host.ctypes.data, host.nbytes)
    from dualtrack.runtime.gpu import GpuTensor
    raw_t = GpuTensor(int(raw), host.shape, host.dtype, None)
    v_raw = imp(raw_t)
    v_native = rt.asdevicearray(dev, host)._buffer_view
    def bench(fn, n=300):
        for _ in range(30): fn()
        t=[]
        for _ in range(n):
            t0=time.perf_counter(); fn(); t.append((time.perf_counter()-t0)*1e3)
        return np.median(t)
    for name, v in [("native", v_native), ("pool", v_pool), ("cuMemAlloc", v_raw), ("native", v_native)]:
        print(f"N={batch} pre call_views input {name:>10}: {bench(lambda: mod.call_views(v)):.3f} ms")
    # keep outputs alive vs drop
    print(f"N={batch} pre call_views + export: {bench(lambda: [be.iree.device.create_dlpack_capsule(o, 2, 0) for o in mod.call_views(v_pool)]):.3f} ms")
    x = pool_t
    def whole(): eng.run_batch(x, batch); be.stream.synchronize()
    print(f"N={batch} run_batch: {bench(whole, 200):.3f} ms")
    outs = []
    def whole_keep():
        outs.append(eng.run_batch(x, batch)); be.stream.synchronize()
        if len(outs) > 4: outs.pop(0)
    print(f"N={batch} run_batch, results kept: {bench(whole_keep, 200):.3f} ms")
    outs.clear()
    cu.cuMemFree(raw)
eng.close()
