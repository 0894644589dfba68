#!/usr/bin/env python3
"""Time and bandwidth of the norm op (handwritten_ptx/norm_nhwc.cu) on a corpus network's norm shapes
at 512x512: MONAI's UNet's 17 InstanceNorms (channels 16..256, num_res_units 2; the group path:
statistics, then apply), with ``--net segresnet`` MONAI SegResNet's 25 GroupNorms (8 groups, init_filters
16: channels 16..128), or, with ``--net convnext``, tu-convnext_tiny's 22 LayerNorms over channels
(96..768; the one-launch layer path).

    python bench/norm_layers.py OUT.json [--batches 1 8] [--iters 50] [--dtype float16]
        [--net monai|segresnet|convnext] [--min-chunk-bytes B ...]

``--min-chunk-bytes``: time the group path once per value of NormSpec.min_chunk_bytes (the least a
statistics block reads), each row tagged with its value; default: the registered spec's alone.

Needs a CUDA GPU, torch with CUDA (random data, eager torch for comparison) and dualtrack on the path
(the kernels are the checked-in PTX for the device's arch, JIT-compiled by the driver, launched
through dualtrack's driver layer on torch's stream). The launches are NormSpec.prepare_norm's, so
the script times whatever launch list the tree has: to time an older tree, run this file with that
tree's ``pipeline/`` first on PYTHONPATH (its PTX comes with it).

Each row is one distinct shape as the partition lowers it: InstanceNorm (G = C) with PReLU's one
slope (LeakyReLU 0.25) and, for a ResidualUnit's last norm, the unit's residual added after the
activation; ConvNeXt's LayerNorms (eps 1e-6) with neither. Before it is timed, the output
(NaN-poisoned first) is checked against the float64 reference (NormSpec.reference, rel L2 <= 2e-3).
Times are the median of ``--iters`` runs between CUDA events after 5 warm-ups: ``norm_us`` every
launch of the norm, ``<entry>_us`` each launch alone; ``graph_us`` and ``<entry>_graph_us`` the same
launches captured 20 times over in one CUDA graph, its replay's time over 20 (back to back, as the
engine's graph runs them: no launch gap between events). ``gbps`` is the bytes a norm must move (x read
twice for a group norm, once for a layer norm, the residual once, y written once) over ``norm_us``;
``stats_gbps`` and ``apply_gbps`` the same for their launches (x; x, r and y). ``torch_us``: eager
``F.instance_norm`` + ``leaky_relu`` (+ add) on channels_last tensors, or ``F.layer_norm`` over the
last dim of the NHWC tensor. Prints a table and writes the rows and per-batch totals (weighted by
how often a shape occurs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dualtrack.compiler.kernel_build import SOURCE_DIR, ptx_path
from dualtrack.contract.arch import PTX_ARCHES, choose_image
from dualtrack.kernels import KERNELS, Activation
from dualtrack.runtime.driver import Device, Module, Stream

NORM = KERNELS["norm"]
ACT = Activation.named("leakyrelu", 0.25)
TOL = 2e-3  # fp16 output rounding


@dataclass(frozen=True)
class Layer:
    name: str
    uses: int  # how often the shape occurs in the network
    C: int
    H: int
    residual: bool
    kind: str = "group"
    groups: int = 0  # 0: one a channel (InstanceNorm)


# MONAI UNet(channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2, out_channels=2):
# each down level and the bottom a ResidualUnit of two conv-norm-act subunits (the second's output
# plus the unit's residual), each up level a ConvTranspose-norm-act and a one-subunit ResidualUnit,
# the top level's ConvTranspose normed at 2 channels (its ResidualUnit ends in a bare conv).
LAYERS = [
    Layer("c16_256", 2, 16, 256, False),
    Layer("c16_256_res", 2, 16, 256, True),
    Layer("c32_128", 2, 32, 128, False),
    Layer("c32_128_res", 2, 32, 128, True),
    Layer("c64_64", 2, 64, 64, False),
    Layer("c64_64_res", 2, 64, 64, True),
    Layer("c128_32", 1, 128, 32, False),
    Layer("c128_32_res", 1, 128, 32, True),
    Layer("c256_32", 1, 256, 32, False),
    Layer("c256_32_res", 1, 256, 32, True),
    Layer("c2_512", 1, 2, 512, False),
]
# MONAI SegResNet(spatial_dims=2, init_filters=16) as models/zoo/export.py builds it: GroupNorm(8) + ReLU
# before each conv of a ResBlock (blocks_down 1, 2, 2, 4; blocks_up 1, 1, 1) and before the final conv.
SEGRESNET = [
    Layer("g16_512", 5, 16, 512, False, groups=8),
    Layer("g32_256", 6, 32, 256, False, groups=8),
    Layer("g64_128", 6, 64, 128, False, groups=8),
    Layer("g128_64", 8, 128, 64, False, groups=8),
]
# timm convnext_tiny as smp's tu- encoder: the stem's LayerNorm2d, each block's LayerNorm (channels
# last), each downsample's LayerNorm2d, stages of 3, 3, 9, 3 blocks at 128, 64, 32, 16 pixels.
CONVNEXT = [
    Layer("ln96_128", 5, 96, 128, False, "layer"),
    Layer("ln192_64", 4, 192, 64, False, "layer"),
    Layer("ln384_32", 10, 384, 32, False, "layer"),
    Layer("ln768_16", 3, 768, 16, False, "layer"),
]


NETS = {"monai": LAYERS, "segresnet": SEGRESNET, "convnext": CONVNEXT}


def median_us(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


class Workspace:
    """The LaunchContext a norm asks for: the device and zeroed scratch (torch memory, kept here)."""

    def __init__(self, device) -> None:
        self.device = device
        self.keep: list[torch.Tensor] = []

    def workspace(self, nbytes: int) -> int:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        self.keep.append(buf)
        return buf.data_ptr()


def graph_us(launch, ctx, iters: int, reps: int = 20) -> float:
    """``launch(stream)`` captured ``reps`` times into one CUDA graph (on torch's capture stream), the
    median replay over ``reps``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(Stream.from_handle(side.cuda_stream, ctx))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture = Stream.from_handle(torch.cuda.current_stream().cuda_stream, ctx)
        for _ in range(reps):
            launch(capture)
    return median_us(graph.replay, iters) / reps


def run_layer(
    kernels: dict, stream: Stream, ctx: Workspace, layer: Layer, n: int, dtype: str, iters: int, norm=NORM, cuda=None
) -> dict:
    tdt = getattr(torch, dtype)
    shape = (n, layer.H, layer.H, layer.C)
    x = (2 * torch.randn(shape, device="cuda") + 0.5).to(tdt)
    r = torch.randn(shape, device="cuda").to(tdt) if layer.residual else None
    y = torch.full(shape, float("nan"), device="cuda", dtype=tdt)
    gamma = (1 + 0.5 * torch.randn(layer.C, device="cuda")).float()
    beta = (0.5 * torch.randn(layer.C, device="cuda")).float()
    res = "after_act" if layer.residual else "none"
    act, eps = (ACT, 1e-5) if layer.kind == "group" else (Activation(), 1e-6)
    groups = layer.groups or layer.C
    p = norm.prepare_norm(
        dtype, *shape, x=x.data_ptr(), y=y.data_ptr(), r=r.data_ptr() if r is not None else None,
        weights=[gamma.data_ptr(), beta.data_ptr()], ctx=ctx, kind=layer.kind, groups=groups, res=res, act=act,
        eps=eps, ldr=layer.C if r is not None else 0,
    )  # fmt: skip
    launches = [(q, kernels[q.entry]) for q in (*p.before, p)]

    def launch(which=launches, on=stream) -> None:
        for q, fn in which:
            fn.launch(q.config.grid, q.config.block, q.config.shared_bytes, on, q.args)

    launch()
    torch.cuda.synchronize()
    want = NORM.reference(
        x.cpu().numpy(), gamma.cpu().numpy(), beta.cpu().numpy(), kind=layer.kind, groups=groups, eps=eps,
        res=res, act=act, r=r.cpu().numpy() if r is not None else None,
    ).astype(np.float64)  # fmt: skip
    got = y.float().cpu().numpy().astype(np.float64)
    rel_l2 = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    passed = bool(np.isfinite(got).all()) and rel_l2 <= TOL
    xb = x.numel() * x.element_size()
    row = {**asdict(layer), "N": n, "dtype": dtype, "rel_l2": rel_l2, "passed": passed, "launches": len(launches)}
    row["min_chunk_bytes"] = getattr(norm, "min_chunk_bytes", 0)
    if p.before:
        row["stats_grid"] = list(p.before[0].config.grid)
    row["norm_us"] = median_us(launch, iters)
    row["graph_us"] = graph_us(lambda on: launch(on=on), cuda, iters)
    row["gbps"] = (2 + (layer.kind == "group") + layer.residual) * xb / row["norm_us"] / 1e3
    for q, fn in launches:
        row[f"{q.entry}_us"] = median_us(lambda q=q, fn=fn: launch([(q, fn)]), iters)
        row[f"{q.entry}_graph_us"] = graph_us(lambda on, q=q, fn=fn: launch([(q, fn)], on), cuda, iters)
        moved = xb if "_stats_" in q.entry else (2 + layer.residual) * xb if q is p else 0
        if moved:
            row["stats_gbps" if "_stats_" in q.entry else "apply_gbps"] = moved / row[f"{q.entry}_us"] / 1e3
    row["torch_us"] = median_us(lambda: torch_norm(layer.kind, x, r, gamma, beta, layer.groups), iters)
    return row


def torch_norm(
    kind: str, x: torch.Tensor, r: torch.Tensor | None, gamma: torch.Tensor, beta: torch.Tensor, groups: int = 0
) -> torch.Tensor:
    if kind == "layer":
        return F.layer_norm(x, x.shape[-1:], gamma.to(x.dtype), beta.to(x.dtype), 1e-6)
    t = x.permute(0, 3, 1, 2)  # NCHW view of NHWC memory: channels_last
    if groups:
        t = F.leaky_relu(F.group_norm(t, groups, weight=gamma.to(x.dtype), bias=beta.to(x.dtype)), 0.25)
        return t + r.permute(0, 3, 1, 2) if r is not None else t
    t = F.leaky_relu(F.instance_norm(t, weight=gamma.to(x.dtype), bias=beta.to(x.dtype)), 0.25)
    return t + r.permute(0, 3, 1, 2) if r is not None else t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    ap.add_argument("--net", choices=tuple(NETS), default="monai", help="whose norms (default: %(default)s)")
    # None: the spec as registered (an older tree, run with its own pipeline/, has no such field).
    ap.add_argument("--min-chunk-bytes", type=int, nargs="+", default=[None])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("norm_layers: needs a CUDA GPU and torch with CUDA", file=sys.stderr)
        return 2
    torch.cuda.init()
    dev = Device(0)
    ctx = dev.primary_context()  # the one torch uses
    ctx.make_current()
    choice = choose_image(dev.cc, [], list(PTX_ARCHES))
    path = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{NORM.stem}.cu", choice.arch)
    mod = Module.load(ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch)
    kernels = {e: mod.function(e) for e in NORM.entries}
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream, ctx)
    work = Workspace(dev.info())
    rows, totals = [], {}
    print(
        f"{'layer':12} {'N':>2} {'min B':>6} {'rel_l2':>8} {'norm us':>8} {'graph us':>8} {'stats g':>8} {'GB/s':>6}"
        f" {'stats GB/s':>10} {'apply GB/s':>10} {'torch us':>8}"
    )
    stats_entry = NORM.sub_entry("stats", args.dtype)
    for n in args.batches:
        for size in args.min_chunk_bytes:
            norm = NORM if size is None else replace(NORM, min_chunk_bytes=size)
            size = getattr(norm, "min_chunk_bytes", 0)
            for layer in NETS[args.net]:
                row = run_layer(kernels, stream, work, layer, n, args.dtype, args.iters, norm, ctx)
                rows.append(row)
                print(
                    f"{layer.name:12} {n:2} {size:6} {row['rel_l2']:8.1e} {row['norm_us']:8.1f} {row['graph_us']:8.1f} "
                    f"{row.get(stats_entry + '_graph_us', 0):8.1f} {row['gbps']:6.0f} {row.get('stats_gbps', 0):10.0f} "
                    f"{row.get('apply_gbps', 0):10.0f} {row['torch_us']:8.1f}" + ("" if row["passed"] else "  FAILED")
                )
            mine = [r for r in rows if r["N"] == n and r["min_chunk_bytes"] == size]
            totals[f"{n}/{size}"] = {
                key: sum(r[key] * r["uses"] for r in mine) for key in ("norm_us", "graph_us", "torch_us")
            }
            print(
                f"N={n}, min_chunk_bytes {size}: the {args.net} norms, weighted by use: "
                f"{totals[f'{n}/{size}']['norm_us']:.1f} us (in a graph {totals[f'{n}/{size}']['graph_us']:.1f})"
            )
    doc = {
        "commit": os.environ.get("DUALTRACK_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(),
        "arch": choice.arch,
        "net": args.net,
        "rows": rows,
        "totals": totals,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    mod.close()
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
