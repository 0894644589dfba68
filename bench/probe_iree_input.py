"""Does IREE's call cost more on a buffer imported from Track A's memory (the stream-ordered pool,
or plain cuMemAlloc) than on one IREE allocated itself? Times the reference bundle's
pre-processing module on each, then run_batch with its results dropped and kept (GPU machine,
the carried reference bundle at .carry/unet; bench/results/probe_iree_input-*.log):

    python3 bench/probe_iree_input.py [--bundle .carry/unet]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def median_ms(fn: Callable[[], Any], n: int = 300, warmup: int = 30) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def probe(engine: Any, batch: int) -> None:
    import iree.runtime as rt
    from cuda.bindings import driver as cu

    from dualtrack.runtime import dlpack
    from dualtrack.runtime.gpu import GpuTensor

    be = engine.backend
    host = np.random.default_rng(0).integers(0, 256, (batch, 512, 512, 3), dtype=np.uint8)
    mod = be.track_b.module(engine.plan.segments[0], batch)
    dev = be.track_b.iree.device

    def imported(t: GpuTensor) -> Any:
        return dev.from_dlpack_capsule(dlpack.to_capsule(t.ptr, t.shape, t.dtype, be.device.index, t.keepalive))

    pool_t = be.from_host(host)
    err, raw = cu.cuMemAlloc(host.nbytes)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    cu.cuMemcpyHtoD(raw, host.ctypes.data, host.nbytes)
    views = {
        "native": rt.asdevicearray(dev, host)._buffer_view,
        "pool": imported(pool_t),
        "cuMemAlloc": imported(GpuTensor(int(raw), host.shape, host.dtype, None)),
    }
    for name, view in views.items():
        print(f"N={batch} pre call_views input {name:>10}: {median_ms(lambda v=view: mod.call_views(v)):.3f} ms")

    def run_drop() -> None:
        engine.run_batch(pool_t, batch)
        be.stream.synchronize()

    print(f"N={batch} run_batch: {median_ms(run_drop, 200):.3f} ms")
    kept: list[Any] = []

    def run_keep() -> None:
        kept.append(engine.run_batch(pool_t, batch))
        be.stream.synchronize()
        del kept[:-4]  # results freed four calls later instead of at once

    print(f"N={batch} run_batch, results kept: {median_ms(run_keep, 200):.3f} ms")
    kept.clear()
    del views
    be.stream.synchronize()
    cu.cuMemFree(raw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=".carry/unet")
    args = p.parse_args()
    from dualtrack.contract.bundle import Bundle
    from dualtrack.runtime.engine import Engine

    with Engine.load(Bundle.open(args.bundle), "cuda") as engine:
        for batch in (8, 1):
            probe(engine, batch)


if __name__ == "__main__":
    main()
