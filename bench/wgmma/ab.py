#!/usr/bin/env python3
"""Time several builds of handwritten_ptx/conv3x3_wgmma.cu (PTX files of the same ABI) on the same
layers, launch for launch, to find what a source change cost: the builds run in alternating rounds
on identical inputs, tensor maps and arguments, and each build's output is checked against the
first build's before it is timed.

    python bench/wgmma/ab.py NAME=PATH.ptx [NAME=PATH.ptx ...] [--iters 100] [--rounds 5]

A layer is ``N,H,W,C,K``; each runs ``Conv3x3WgmmaSpec.choose``'s entry without split-K, and with
``Conv3x3WgmmaSpec.splits``' split-K where that is more than one (builds that have split-K only).
Needs the H200 (sm_90a), torch with CUDA and dualtrack on the path; prints microseconds (median of
the rounds' medians) per layer and build.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import torch

from dualtrack import kernels
from dualtrack.kernels.conv3x3_wgmma import input_map, weight_map
from dualtrack.kernels.problems import ConvProblem
from dualtrack.runtime import tma
from dualtrack.runtime.driver import Device, Module, Stream

WG = kernels.CONV3X3_WGMMA
LAYERS = (  # the reference U-Net's and ResNet-34's shapes (N, H, W, C, K)
    (8, 512, 512, 32, 32), (8, 256, 256, 64, 64), (8, 128, 128, 64, 128), (8, 64, 64, 256, 256),
    (1, 32, 32, 512, 512), (1, 16, 16, 512, 512), (1, 32, 32, 256, 256), (1, 512, 512, 32, 32),
)  # fmt: skip


def time_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="NAME=PATH.ptx; the first is the reference for the outputs")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-split", nargs="*", default=[], help="builds without split-K (time them at one split)")
    args = ap.parse_args()
    torch.cuda.init()
    dev = Device(0)
    if dev.cc != (9, 0):
        print(f"ab.py: needs sm_90a; this GPU is {dev.cc}", file=sys.stderr)
        return 2
    ctx = dev.primary_context()
    ctx.make_current()
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream, ctx)
    builds = dict(b.split("=", 1) for b in args.builds)
    funcs = {}
    for name, path in builds.items():
        with open(path, "rb") as f:
            image = f.read()
        mod = Module.load(ctx, image, kind="ptx", origin=path, target="compute_90a")
        for c in WG.configs:
            fn = mod.function(c.entry)
            fn.set_max_dynamic_shared(c.smem_bytes)
            funcs[name, c.entry] = fn
    print(f"{'layer':24} {'entry':38} {'splits':>6} " + " ".join(f"{n:>9}" for n in builds))
    for n, h, w, c, k in LAYERS:
        p = ConvProblem.dense(n, h, w, c, k)
        x = torch.randn(n, h, w, c, device="cuda", dtype=torch.float16)
        wt = (torch.randn(k, 3, 3, c, device="cuda") / (9 * c) ** 0.5).half()
        b = torch.randn(k, device="cuda")
        y = torch.empty(n, h, w, k, device="cuda", dtype=torch.float16)
        cfg = WG.choose(n, h, w, c, k)
        tmx = tma.encode(input_map(cfg, x.data_ptr(), n, h, w, c, c))
        tmw = tma.encode(weight_map(cfg, wt.data_ptr(), k, c))
        for splits in sorted({1, WG.splits(cfg, n, h, w, c, k)}):
            ws = torch.zeros(max(WG.workspace_bytes(cfg, n, h, w, k, splits), 4), dtype=torch.uint8, device="cuda")
            a = WG.args(p, tmx=tmx, tmw=tmw, bias=b.data_ptr(), y=y.data_ptr(), relu=True, entry=cfg.entry,
                        ws=ws.data_ptr() if splits > 1 else None)  # fmt: skip
            geo = WG.launch("float16", n, h, w, c, k, entry=cfg.entry, splits=splits)
            names = [nm for nm in builds if splits == 1 or nm not in args.no_split]
            launch = {
                nm: (lambda f=funcs[nm, cfg.entry], g=geo, a=a: f.launch(g.grid, g.block, g.shared_bytes, stream, a))
                for nm in names
            }
            ref = None
            for nm in names:
                y.fill_(float("nan"))
                launch[nm]()
                torch.cuda.synchronize()
                got = y.float().cpu().numpy()
                assert np.isfinite(got).all(), f"{nm}: non-finite output on {(n, h, w, c, k)}"
                if ref is None:
                    ref = got
                else:
                    assert np.allclose(got, ref, rtol=2e-3, atol=2e-3), f"{nm} differs from {names[0]}"
            times = {nm: [] for nm in names}
            for _ in range(args.rounds):
                for nm in names:
                    times[nm].append(time_us(launch[nm], args.iters))
            row = " ".join(f"{statistics.median(times[nm]):9.1f}" if nm in times else f"{'-':>9}" for nm in builds)
            print(f"{(n, h, w, c, k)!s:24} {cfg.entry.removeprefix('conv3x3_wgmma_'):38} {splits:>6} {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
