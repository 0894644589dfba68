"""The wgmma conv's watchdog on a stuck pipeline, in a process of its own (run by
tests/gpu/test_wgmma_gpu.py: a trap leaves the CUDA context unusable).

    python wgmma_watchdog.py handwritten_ptx/ptx/compute_90a/conv3x3_wgmma.ptx

The weight map's box is half the height the kernel expects, so every stage receives fewer bytes
than its mbarrier waits for and no consumer ever gets past its first k-block. First with a status
buffer: the watchdog must record the wait and let the launch finish. Then with none, as the engine
launches it: the kernel must trap, so that the launch fails instead of hanging the GPU. Prints one
JSON line: the status words, the error of the trapped launch, and how long each took.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from dualtrack import kernels
from dualtrack.errors import CudaError
from dualtrack.kernels.conv3x3_wgmma import input_map
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime import tma
from dualtrack.runtime.driver import Device, Module, Stream
from dualtrack.runtime.memory import DevicePool, download, upload


def main(ptx: Path) -> None:
    wg = kernels.CONV3X3_WGMMA
    ctx = Device(0).primary_context()
    stream, pool = Stream(ctx), DevicePool(ctx)
    entry = "conv3x3_wgmma_bn64_mt1_wg1_bk64"
    cfg = wg.config(entry)
    kern = Module.load(ctx, ptx.read_bytes(), kind="ptx", origin=str(ptx), target="compute_90a").function(entry)
    kern.set_max_dynamic_shared(cfg.smem_bytes)
    n, h, w, c, k = 1, 8, 8, 64, 64
    x, wt, y = (pool.alloc(size * 2, stream) for size in (n * h * w * c, k * 9 * c, n * h * w * k))
    status = pool.alloc(32, stream)
    for buf, size in ((x, n * h * w * c), (wt, k * 9 * c)):
        upload(stream, buf, np.ones(size, np.float16))
    upload(stream, status, np.zeros(8, np.int32))
    tmx = tma.encode(input_map(cfg, int(x), n, h, w, c, c))
    short = TiledMap(int(wt), (9 * c, k), (9 * c * 2,), (cfg.bk, cfg.bn // 2), cfg.row_bytes, 256)
    tmw = tma.encode(short)
    geo = wg.launch("float16", n, h, w, c, k, entry=entry)
    problem = ConvProblem.dense(n, h, w, c, k)
    common = {"tmx": tmx, "tmw": tmw, "y": int(y), "entry": entry}

    t0 = time.perf_counter()
    kern.launch(geo.grid, geo.block, geo.shared_bytes, stream, wg.args(problem, **common, status=int(status)))
    stream.synchronize()
    report_s = time.perf_counter() - t0
    words = np.zeros(8, np.int32)
    download(stream, words, status)
    stream.synchronize()

    t0 = time.perf_counter()
    try:
        kern.launch(geo.grid, geo.block, geo.shared_bytes, stream, wg.args(problem, **common, status=None))
        stream.synchronize()
        trap = "no error"
    except CudaError as exc:
        trap = exc.name
    trap_s = time.perf_counter() - t0
    print(json.dumps({"status": words.tolist(), "report_s": report_s, "trap": trap, "trap_s": trap_s}))
    sys.stdout.flush()
    os._exit(0)  # no finalizers: after a trap every driver call in this context fails


if __name__ == "__main__":
    main(Path(sys.argv[1]))
