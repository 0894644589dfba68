"""Measure this GPU's Track A rates for the partition's cost model and write its row of
pipeline/dualtrack/compiler/rates.json (`python bench/measure_rates.py [--out FILE]`, under a minute).

Through the real kernels (the checked-in PTX, JIT-compiled by the driver), on random fp16 data:
- ``track_a.tflops``: conv3x3_nhwc's mma.sync entries, as the chooser picks them with the wgmma
  kernel off, on three U-Net-like problems at N=8 (on sm_90a the wgmma kernel is faster: a lower bound);
- ``track_a_conv.tflops``: the general conv (conv_nhwc) on a ResNet-like 3x3 and a 3x3 stride-2 layer;
- ``tbps`` (every Track A row): maxpool2x2_nhwc's bytes read and written per second at N=8, 256x256x64;
- ``launch_us``: one small launch inside a CUDA graph (200 of them captured, the graph replayed).
The SIMT kernels' FLOP rate and Track B's row are not measured here: they stay as the table has them
for this device class (the H200's where it has none), and the row's ``basis`` says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from dualtrack import kernels
from dualtrack.compiler.cost import RATES_FILE, parse_rates
from dualtrack.contract.arch import PTX_ARCHES, choose_image
from dualtrack.kernels import ConvGeometry, DeviceInfo
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.sources import SOURCE_DIR, ptx_path
from dualtrack.runtime.driver import Context, Device, Event, Kernel, Module, Stream, call, graph_launch
from dualtrack.runtime.memory import DeviceBuffer, DevicePool, upload

CONV3X3 = tuple(ConvProblem.dense(8, hw, hw, c, c) for hw, c in ((128, 64), (64, 128), (32, 256)))
GENERAL = ((8, 64, 64, 128, 128, ConvGeometry(3, 3, 1, 1, 1, 1, 1, 1, 1, 1)),
           (8, 64, 64, 128, 256, ConvGeometry(3, 3, 2, 2, 1, 1, 1, 1, 1, 1)))  # fmt: skip
POOL = (8, 256, 256, 64)
GRAPH_LAUNCHES = 200
MMA_ONLY = "measure_rates times the mma.sync entries"


class Gpu:
    """One device, its stream and memory, the kernels of the checked-in PTX for its arch."""

    def __init__(self) -> None:
        self.device = Device(0)
        self.info: DeviceInfo = self.device.info()
        self.ctx: Context = self.device.primary_context()
        self.stream = Stream(self.ctx)
        self.pool = DevicePool(self.ctx)
        self.arch = choose_image(self.device.cc, [], list(PTX_ARCHES)).arch
        self.functions: dict[str, Kernel] = {}
        self.modules = []
        for stem in ("conv3x3_nhwc", "conv_nhwc", "maxpool2x2_nhwc"):
            path = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{stem}.cu", self.arch)
            mod = Module.load(self.ctx, path.read_bytes(), kind="ptx", origin=str(path), target=self.arch)
            self.modules.append(mod)
            spec = kernels.spec_for_stem(stem)
            assert spec is not None
            self.functions.update((e, mod.function(e)) for e in spec.entries)
        self.events = [Event(self.ctx) for _ in range(21)]

    def random(self, count: int, rng: np.random.Generator, dtype: str = "float16") -> DeviceBuffer:
        """A buffer of ``count`` random values in [-1, 1), uploaded."""
        host = rng.uniform(-1, 1, count).astype(dtype)
        buf = self.pool.alloc(host.nbytes, self.stream)
        upload(self.stream, buf, host)
        self.stream.synchronize()
        return buf

    def median_ms(self, launch: Callable[[], None], warmup: int = 3) -> float:
        for _ in range(warmup):
            launch()
        self.events[0].record(self.stream)
        for ev in self.events[1:]:
            launch()
            ev.record(self.stream)
        return statistics.median(a.elapsed_ms(b) for a, b in zip(self.events, self.events[1:], strict=False))


def conv3x3_tflops(gpu: Gpu, rng: np.random.Generator) -> float:
    """FLOPs over time of the chooser's mma.sync entries on :data:`CONV3X3`, summed."""
    spec = kernels.KERNELS["conv3x3"]
    flops = ms = 0.0
    for p in CONV3X3:
        x, w, y = gpu.random(p.pixels * p.C, rng), gpu.random(p.K * 9 * p.C, rng), gpu.random(p.pixels * p.K, rng)
        bias = gpu.random(p.K, rng, "float32")
        entry = kernels.conv_choice(p, gpu.info, wgmma_off=MMA_ONLY).entry
        cfg = spec.launch(p.dtype, p.N, p.H, p.W, p.C, p.K, entry=entry)
        dims = {"N": p.N, "H": p.H, "W": p.W, "C": p.C, "K": p.K}
        args = spec.args(x=x.ptr, w=w.ptr, bias=bias.ptr, y=y.ptr, **dims, ldx=p.C, ldy=p.K, relu=True)
        kern = gpu.functions[entry]
        ms += gpu.median_ms(lambda k=kern, c=cfg, a=args: k.launch(c.grid, c.block, c.shared_bytes, gpu.stream, a))
        flops += p.flops
    return flops / (ms * 1e9)


def general_tflops(gpu: Gpu, rng: np.random.Generator) -> float:
    """FLOPs (every tap of every output pixel) over time of the general conv on :data:`GENERAL`."""
    spec = kernels.KERNELS["conv"]
    assert isinstance(spec, kernels.ConvGeneralSpec)
    relu = kernels.Activation.named("relu")
    flops = ms = 0.0
    for n, h, w_, c, k, g in GENERAL:
        P, Q = g.output_hw(h, w_)
        x, w, y = gpu.random(n * h * w_ * c, rng), gpu.random(k * g.R * g.S * c, rng), gpu.random(n * P * Q * k, rng)
        entry = spec.variant("float16", n, h, w_, c, k, g, device=gpu.info)
        cfg = spec.launch("float16", n, h, w_, c, k, geom=g, entry=entry, device=gpu.info)
        args = spec.args(x=x.ptr, w=w.ptr, y=y.ptr, N=n, H=h, W=w_, C=c, K=k, geom=g, act=relu)
        kern = gpu.functions[entry]
        ms += gpu.median_ms(lambda k=kern, c=cfg, a=args: k.launch(c.grid, c.block, c.shared_bytes, gpu.stream, a))
        flops += 2.0 * n * P * Q * k * g.R * g.S * c
    return flops / (ms * 1e9)


def pool_launch(gpu: Gpu, rng: np.random.Generator, n: int, h: int, w: int, c: int) -> tuple[Callable[[], None], int]:
    """A maxpool2x2 launch on random data and the bytes it moves."""
    spec = kernels.KERNELS["maxpool2x2"]
    x, y = gpu.random(n * h * w * c, rng), gpu.random(n * (h // 2) * (w // 2) * c, rng)
    cfg = spec.launch("float16", n, h, w, c)
    args = spec.args(x=x.ptr, y=y.ptr, N=n, H=h, W=w, C=c)
    kern = gpu.functions[spec.entry("float16")]
    nbytes = 2 * (n * h * w * c + n * (h // 2) * (w // 2) * c)
    return lambda: kern.launch(cfg.grid, cfg.block, cfg.shared_bytes, gpu.stream, args), nbytes


def graph_launch_us(gpu: Gpu, rng: np.random.Generator) -> float:
    """Microseconds per small launch inside a captured CUDA graph."""
    launch, _ = pool_launch(gpu, rng, 1, 2, 2, 8)
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    call(cu.cuStreamBeginCapture, gpu.stream.handle, mode)
    for _ in range(GRAPH_LAUNCHES):
        launch()
    graph = call(cu.cuStreamEndCapture, gpu.stream.handle)
    exe = call(cu.cuGraphInstantiate, graph, 0)
    try:
        ms = gpu.median_ms(lambda: graph_launch(exe, gpu.stream.handle))
    finally:
        call(cu.cuGraphExecDestroy, exe)
        call(cu.cuGraphDestroy, graph)
    return ms * 1e3 / GRAPH_LAUNCHES


def measured_row(gpu: Gpu, old: dict[str, Any]) -> dict[str, Any]:
    """This GPU's row: Track A measured, the SIMT FLOP rate and Track B carried over from ``old``."""
    rng = np.random.default_rng(0)
    launch, nbytes = pool_launch(gpu, rng, *POOL)
    tbps = nbytes / (gpu.median_ms(launch) * 1e9)
    us = graph_launch_us(gpu, rng)
    conv, general = conv3x3_tflops(gpu, rng), general_tflops(gpu, rng)
    info = gpu.info
    return merge_row(old, info.key, f"{info.name} ({info.sm_count} SMs)", conv, general, tbps, us)


def merge_row(
    old: dict[str, Any], key: str, gpu: str, conv: float, general: float, tbps: float, launch_us: float
) -> dict[str, Any]:
    """The row written for device class ``key``: the measured numbers (3 significant digits), the
    SIMT FLOP rate and Track B as ``old`` (this class's row, else the H200's) has them."""
    base = old["rows"].get(key) or old["rows"]["h200"]

    def track(tflops: float) -> dict[str, float]:
        return {"tflops": float(f"{tflops:.3g}"), "tbps": float(f"{tbps:.3g}"), "launch_us": float(f"{launch_us:.3g}")}

    return {
        "covers": base["covers"] if key in old["rows"] else [key],
        "status": "measured",
        "basis": (
            f"bench/measure_rates.py on {gpu}: conv3x3 mma.sync entries (no wgmma), the general conv, "
            "maxpool2x2's bandwidth, a launch in a CUDA graph; the SIMT FLOP rate and Track B carried "
            f"over from the {base['status']} row ({base['basis'][:80]}...)"
        ),
        "track_a": track(conv),
        "track_a_conv": track(general),
        "track_a_simt": track(base["track_a_simt"]["tflops"]),
        "track_b": base["track_b"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RATES_FILE, help="rates table to update (default: the package's)")
    args = ap.parse_args(argv)
    old = json.loads(args.out.read_text())
    gpu = Gpu()
    row = measured_row(gpu, old)
    new = {**old, "rows": {**old["rows"], gpu.info.key: row}}
    parse_rates(new, str(args.out))  # a row the cost model would refuse is never written
    args.out.write_text(json.dumps(new, indent=2) + "\n")
    print(json.dumps({gpu.info.key: row}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
