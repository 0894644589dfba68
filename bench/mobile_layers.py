#!/usr/bin/env python3
"""Per-layer time of the mobile kernels (dwconv, fc, gap, eltwise, resize: handwritten_ptx/*_nhwc.cu)
against PyTorch's kernel for the same op, on the distinct layer shapes of torchvision's
``lraspp_mobilenet_v3_large`` at 512x512, fp16; and of the max-pools (the general ``maxpool`` on smp
Unet-resnet34's 3x3/2 stem pool, 64 channels 256x256 -> 128x128, against ``F.max_pool2d``; both
max-pool kernels on a 2x2/2 window of the same input, the window ``maxpool2x2`` keeps).

    python bench/mobile_layers.py OUT.json [--batches 1 8] [--iters 200] [--only dwconv]

Needs a CUDA GPU, torch with CUDA and dualtrack on the path (each kernel is the checked-in PTX for
the device's arch, JIT-compiled by the driver and launched through dualtrack's driver layer on
torch's stream; torch and dualtrack share the primary context).

The shapes are hard-coded from torchvision's architecture (``_mobilenet_v3_conf("mobilenet_v3_large",
dilated=True)`` as ``lraspp_mobilenet_v3_large`` builds it, and ``LRASPPHead``) rather than read from
the zoo ONNX's plan: the GPU machines carry no zoo model, and the table below is what that plan's
Track A calls are (15 depthwise convs, 9 pools, 17 FCs, 9 gates, 2 resizes; ``uses`` counts repeats;
the max-pool rows are not LR-ASPP's: ``uses`` 1 for the smp stem pool, 0 for the 2x2 comparison).

A dwconv layer runs the entry the engine picks for it (the tiled ones, ``DwConvSpec.tile_path``; the
column entries for a 3x3 where ``DwConvSpec.cols`` is on), and beside it every other entry that
takes it (``elem us``: the per-element one; the tiles, tall and short, a 3x3's own pair ``tall3`` /
``short3`` (the engine's with ``--dw-tile3``), and the columns' sizes of ``--dw-cols`` / ``--dw-tile``).
Each row is checked first: our output (NaN-poisoned before) against torch's fp32 computation of the
same fp16 data, activation included (rel L2 <= 2e-3). Then both sides are timed as ``--iters`` launches
captured in one CUDA graph, replayed between CUDA events after a warm-up (median of 5 replays, per
launch): these kernels take microseconds, so launching from Python would time the host, and ``Engine.run`` replays the
whole inference as one CUDA graph anyway. PyTorch's side is the op alone, as eager torch runs it:
``F.conv2d(groups=C)`` on channels_last (cuDNN) + bias for dwconv, ``F.linear`` for fc, ``mean``
over H, W for gap, ``*`` / ``+`` for eltwise, ``F.interpolate`` for resize, ``F.max_pool2d``
(channels_last) for the max-pools; its fused activation would be one more kernel, so the ratio
flatters torch slightly.
Prints a table and writes the rows and per-batch totals (weighted by ``uses``) as JSON, with the
commit (env DUALTRACK_COMMIT), the GPU name and the driver version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from dualtrack.compiler.kernel_build import SOURCE_DIR, compile_ptx, ptx_path
from dualtrack.contract.arch import PTX_ARCHES, choose_image
from dualtrack.kernels import KERNELS, Activation, DwConvSpec, DwGeometry, PoolGeometry, ResizeMode
from dualtrack.runtime.driver import SHARED_DEFAULT, Device, Module, Stream

TOL = 2e-3  # fp16 output rounding and a different summation order
HSIG = (float(torch.tensor(1 / 6, dtype=torch.float32)), 0.5)  # torch's Hardsigmoid as ONNX HardSigmoid


@dataclass(frozen=True)
class Layer:
    """One distinct shape: ``C`` channels of an ``H`` x ``H`` input; ``K`` output channels (fc),
    ``R``/``stride``/``dilation`` (dwconv; ``R``/``stride`` the max-pools' window), ``Ho`` (resize),
    ``op2`` the eltwise op, ``act`` the fused activation."""

    name: str
    op: str
    uses: int
    H: int
    C: int
    act: str = "none"
    K: int = 0
    R: int = 3
    S: int = 0  # dwconv's kernel columns (0: R, a square window)
    stride: int = 1
    dilation: int = 1
    Ho: int = 0
    op2: str = ""


# torchvision MobileNetV3-Large (dilated, as LR-ASPP builds it) at 512x512: the stem halves to 256;
# blocks (in, k, exp, out, SE, act, stride, dilation); SE squeezes to make_divisible(exp / 4, 8);
# blocks with dilation 2 keep stride 1. LR-ASPP's head: 960 -> 128 (cbr) times sigmoid(fc(gap)),
# upsampled 32 -> 64, classifiers to 2 channels, added, upsampled 64 -> 512.
LAYERS = (
    Layer("dw16 3x3 @256", "dwconv", 1, 256, 16, "relu"),
    Layer("dw64 3x3/2 @256", "dwconv", 1, 256, 64, "relu", stride=2),
    Layer("dw72 3x3 @128", "dwconv", 1, 128, 72, "relu"),
    Layer("dw72 5x5/2 @128", "dwconv", 1, 128, 72, "relu", R=5, stride=2),
    Layer("dw120 5x5 @64", "dwconv", 2, 64, 120, "relu", R=5),
    Layer("dw240 3x3/2 @64", "dwconv", 1, 64, 240, "hardswish", stride=2),
    Layer("dw200 3x3 @32", "dwconv", 1, 32, 200, "hardswish"),
    Layer("dw184 3x3 @32", "dwconv", 2, 32, 184, "hardswish"),
    Layer("dw480 3x3 @32", "dwconv", 1, 32, 480, "hardswish"),
    Layer("dw672 3x3 @32", "dwconv", 1, 32, 672, "hardswish"),
    Layer("dw672 5x5 d2 @32", "dwconv", 1, 32, 672, "hardswish", R=5, dilation=2),
    Layer("dw960 5x5 d2 @32", "dwconv", 2, 32, 960, "hardswish", R=5, dilation=2),
    # Not LR-ASPP's (uses 0, outside its totals): the depthwise layers of smp Unet-convnext_tiny (7x7,
    # no activation; 3/3/9/3 blocks a stage) and SegFormer-mit_b0's MixFFN (3x3 on 4x the width, GELU
    # after it, 2 blocks a stage) at 512x512, and a factorised 1x7 (the tiled entry's general loop).
    Layer("cnx dw96 7x7 @128", "dwconv", 0, 128, 96, R=7),
    Layer("cnx dw192 7x7 @64", "dwconv", 0, 64, 192, R=7),
    Layer("cnx dw384 7x7 @32", "dwconv", 0, 32, 384, R=7),
    Layer("cnx dw768 7x7 @16", "dwconv", 0, 16, 768, R=7),
    Layer("segf dw128 3x3 @128", "dwconv", 0, 128, 128),
    Layer("segf dw256 3x3 @64", "dwconv", 0, 64, 256),
    Layer("segf dw640 3x3 @32", "dwconv", 0, 32, 640),
    Layer("segf dw1024 3x3 @16", "dwconv", 0, 16, 1024),
    Layer("dw136 1x7 @48", "dwconv", 0, 48, 136, "relu", R=1, S=7),
    Layer("segf dw128 3x3 gelu @128", "dwconv", 0, 128, 128, "gelu"),
    Layer("segf dw256 3x3 gelu @64", "dwconv", 0, 64, 256, "gelu"),
    # SegFormer-mit_b2's MixFFN (4x 64/128/320/512 channels; 3, 4, 6, 3 blocks a stage).
    Layer("segf-b2 dw256 3x3 gelu @128", "dwconv", 0, 128, 256, "gelu"),
    Layer("segf-b2 dw512 3x3 gelu @64", "dwconv", 0, 64, 512, "gelu"),
    Layer("segf-b2 dw1280 3x3 gelu @32", "dwconv", 0, 32, 1280, "gelu"),
    Layer("segf-b2 dw2048 3x3 gelu @16", "dwconv", 0, 16, 2048, "gelu"),
    Layer("gap72 @64", "gap", 1, 64, 72),
    Layer("gap120 @64", "gap", 2, 64, 120),
    Layer("gap480 @32", "gap", 1, 32, 480),
    Layer("gap672 @32", "gap", 2, 32, 672),
    Layer("gap960 @32", "gap", 3, 32, 960),  # two SE blocks and the head's scale branch
    Layer("fc 72->24", "fc", 1, 1, 72, "relu", K=24),
    Layer("fc 24->72", "fc", 1, 1, 24, "hardsigmoid", K=72),
    Layer("fc 120->32", "fc", 2, 1, 120, "relu", K=32),
    Layer("fc 32->120", "fc", 2, 1, 32, "hardsigmoid", K=120),
    Layer("fc 480->120", "fc", 1, 1, 480, "relu", K=120),
    Layer("fc 120->480", "fc", 1, 1, 120, "hardsigmoid", K=480),
    Layer("fc 672->168", "fc", 2, 1, 672, "relu", K=168),
    Layer("fc 168->672", "fc", 2, 1, 168, "hardsigmoid", K=672),
    Layer("fc 960->240", "fc", 2, 1, 960, "relu", K=240),
    Layer("fc 240->960", "fc", 2, 1, 240, "hardsigmoid", K=960),
    Layer("fc 960->128 head", "fc", 1, 1, 960, "sigmoid", K=128),
    Layer("gate72 @64", "eltwise", 1, 64, 72, op2="gate"),
    Layer("gate120 @64", "eltwise", 2, 64, 120, op2="gate"),
    Layer("gate480 @32", "eltwise", 1, 32, 480, op2="gate"),
    Layer("gate672 @32", "eltwise", 2, 32, 672, op2="gate"),
    Layer("gate960 @32", "eltwise", 2, 32, 960, op2="gate"),
    Layer("gate128 @32 head", "eltwise", 1, 32, 128, op2="gate"),
    Layer("add2 @64 head", "eltwise", 1, 64, 2, op2="add"),
    Layer("add40 @64 residual", "eltwise", 0, 64, 40, op2="add"),  # fused into the conv in a build: uses 0
    Layer("resize128 32->64", "resize", 1, 32, 128, Ho=64),
    Layer("resize2 64->512", "resize", 1, 64, 2, Ho=512),
    # Not LR-ASPP's: smp Unet-resnet34's stem pool (3x3/2, pad 1) on the general max-pool; then a 2x2/2
    # window of the same input on both max-pool kernels (uses 0), which says whether maxpool2x2 still
    # earns its place beside the general kernel (partition._max_pool routes 2x2/2 windows to it).
    Layer("maxpool64 3x3/2 @256", "maxpool", 1, 256, 64, R=3, stride=2),
    Layer("maxpool64 2x2/2 @256", "maxpool", 0, 256, 64, R=2, stride=2),
    Layer("maxpool2x2 64 @256", "maxpool2x2", 0, 256, 64, R=2, stride=2),
)


def act_of(name: str) -> Activation:
    return Activation.named(name, *HSIG) if name == "hardsigmoid" else Activation.named(name)


def torch_act(name: str, v: torch.Tensor) -> torch.Tensor:
    """The activation on fp32 values, as ONNX (and the kernels) define it."""
    match name:
        case "relu":
            return torch.relu(v)
        case "hardswish":
            return F.hardswish(v)
        case "hardsigmoid":
            return torch.clamp(HSIG[0] * v + HSIG[1], 0.0, 1.0)
        case "sigmoid":
            return torch.sigmoid(v)
        case "gelu":
            return F.gelu(v)
        case _:
            return v


def graph_ms(launch: Callable[[], None], stream: torch.cuda.Stream, iters: int) -> float:
    """Per-launch time of ``iters`` launches captured in one CUDA graph (median of 5 replays)."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            launch()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(iters):
            launch()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def problem(layer: Layer, n: int) -> tuple[dict, Callable[[], torch.Tensor], Callable[[], torch.Tensor], tuple]:
    """(our args by name, torch's fp32 reference, torch's fp16 op, our output shape NHWC) of a layer.
    Tensors are NHWC contiguous: their NCHW permute is channels_last, no copy."""
    dev, h, c = "cuda", layer.H, layer.C
    x = torch.randn(n, h, h, c, device=dev, dtype=torch.float16)
    xc = x.permute(0, 3, 1, 2)
    a = act_of(layer.act)
    if layer.op == "dwconv":
        S = layer.S or layer.R
        pt, pl = layer.dilation * (layer.R // 2), layer.dilation * (S // 2)
        g = DwGeometry(layer.R, layer.stride, layer.dilation, (pt, pl, pt, pl), S=S)
        w = (torch.randn(c, 1, layer.R, S, device=dev) / layer.R).half()
        b = torch.randn(c, device=dev)
        wp = w[:, 0].permute(1, 2, 0).contiguous()  # RSC, as DwConvSpec.pack
        conv = dict(stride=layer.stride, padding=(pt, pl), dilation=layer.dilation, groups=c)
        ref = lambda: torch_act(layer.act, F.conv2d(xc.float(), w.float(), b, **conv))  # noqa: E731
        bh = b.half()
        theirs = lambda: F.conv2d(xc, w, bh, **conv)  # noqa: E731
        _, ho, wo, _ = KERNELS["dwconv"].output_shape(n, h, h, c, 0, g)
        kw = dict(x=x, w=wp, bias=b, N=n, H=h, W=h, C=c, geometry=g, act=a, keep=(w,))
        return kw, ref, theirs, (n, ho, wo, c)
    if layer.op == "gap":
        ref = lambda: xc.float().mean((2, 3), keepdim=True)  # noqa: E731
        return dict(x=x, N=n, H=h, W=h, C=c), ref, lambda: xc.mean((2, 3)), (n, 1, 1, c)
    if layer.op == "fc":
        v = x.reshape(n, c)
        w = (torch.randn(layer.K, c, device=dev) / c**0.5).half()
        b = torch.randn(layer.K, device=dev)
        bh = b.half()
        ref = lambda: torch_act(layer.act, F.linear(v.float(), w.float(), b)).reshape(n, layer.K, 1, 1)  # noqa: E731
        kw = dict(x=x, w=w, bias=b, N=n, C=c, K=layer.K, act=a)
        return kw, ref, lambda: F.linear(v, w, bh), (n, 1, 1, layer.K)
    if layer.op == "eltwise":
        gate = layer.op2 == "gate"
        y = torch.rand(n, 1, 1, c, device=dev).half() if gate else torch.randn(n, h, h, c, device=dev).half()
        yc = y.permute(0, 3, 1, 2)
        op = "mul" if gate else "add"
        ref = (lambda: xc.float() * yc.float()) if gate else (lambda: xc.float() + yc.float())
        theirs = (lambda: xc * yc) if gate else (lambda: xc + yc)
        kw = dict(a=x, b=y, N=n, H=h, W=h, C=c, op=op, bcast=gate)
        return kw, ref, theirs, (n, h, h, c)
    if layer.op in ("maxpool", "maxpool2x2"):
        k, pad = layer.R, (layer.R - 1) // 2  # ResNet's 3x3/2 pads 1; a 2x2/2 window none
        g = PoolGeometry(k, k, layer.stride, layer.stride, pad_top=pad, pad_left=pad, pad_bottom=pad, pad_right=pad)
        ref = lambda: F.max_pool2d(xc.float(), k, layer.stride, pad)  # noqa: E731
        theirs = lambda: F.max_pool2d(xc, k, layer.stride, pad)  # noqa: E731
        _, ho, wo, _ = KERNELS["maxpool"].output_shape(n, h, h, c, 0, g)
        return dict(x=x, N=n, H=h, W=h, C=c, geom=g), ref, theirs, (n, ho, wo, c)
    ho = layer.Ho
    how = ResizeMode("linear", "half_pixel", "floor", ho / h, ho / h)
    ref = lambda: F.interpolate(xc.float(), size=(ho, ho), mode="bilinear", align_corners=False)  # noqa: E731
    theirs = lambda: F.interpolate(xc, size=(ho, ho), mode="bilinear", align_corners=False)  # noqa: E731
    return dict(x=x, N=n, H=h, W=h, C=c, Ho=ho, Wo=ho, how=how), ref, theirs, (n, ho, ho, c)


def run_layer(
    fns: dict, ctx, stream: torch.cuda.Stream, layer: Layer, n: int, iters: int, tiles: Sequence[DwConvSpec] = ()
) -> dict:
    spec = KERNELS[layer.op]
    kw, ref_fn, theirs, out_shape = problem(layer, n)
    y = torch.full(out_shape, float("nan"), device="cuda", dtype=torch.float16)
    ptrs = {k: v.data_ptr() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    call = {**kw, **ptrs, "y": y.data_ptr()}
    call.pop("keep", None)
    if layer.op == "dwconv":
        cfg = spec.launch("float16", n, layer.H, layer.H, layer.C, 0, kw["geometry"])
    elif layer.op == "maxpool":
        cfg = spec.launch("float16", n, layer.H, layer.H, layer.C, 0, kw["geom"])
    elif layer.op == "resize":
        cfg = spec.launch("float16", n, layer.H, layer.H, layer.C, 0, Ho=layer.Ho, Wo=layer.Ho)
    else:
        cfg = spec.launch("float16", n, layer.H, layer.H, layer.C, layer.K)
    args = spec.args(**call)
    ours_stream = Stream.from_handle(stream.cuda_stream, ctx)
    entries = {"elem": (spec.entry("float16"), cfg)}  # each entry that takes the layer, the engine's first
    _, ho, wo, _ = out_shape
    g = kw.get("geometry")
    if layer.op == "dwconv" and spec.tile_path("float16", g, layer.C, layer.C, layer.C):
        chosen = spec.tile_choice(n, ho, wo, layer.C, g, Device(0).info())  # what the engine launches
        entries = {"tile": chosen, **entries}
        entries["tall"] = (spec.tile_entry, spec.tile_launch(n, ho, wo, layer.C, g))
        entries["short"] = (spec.tile_short_entry, spec.tile_launch(n, ho, wo, layer.C, g, short=True))
        if spec.square3(g):  # the 3x3's own pair (DwConvSpec.tile3; --dw-tile3 makes them the engine's)
            entries["tall3"] = (spec.tile3_entry, spec.tile_launch(n, ho, wo, layer.C, g))
            entries["short3"] = (spec.tile3_short_entry, spec.tile_launch(n, ho, wo, layer.C, g, short=True))
        for t in tiles:  # --dw-tile: other tile sizes of the tall entry, compiled here
            if tile_name(t) in fns:
                entries.setdefault(tile_name(t), (tile_name(t), t.tile_launch(n, ho, wo, layer.C, g)))
    cols = replace(spec, cols=True) if layer.op == "dwconv" else None  # timed whether or not the engine takes them
    if cols is not None and cols.cols_path("float16", g, layer.C, layer.C, layer.C):
        chosen = cols.cols_choice(n, ho, wo, layer.C, g, Device(0).info())
        entries = {"cols": chosen, **entries} if spec.cols else {**entries, "cols": chosen}  # the engine's first
        entries["cols_tall"] = (spec.cols_entry, spec.cols_launch(n, ho, wo, layer.C, g))
        entries["cols_short"] = (spec.cols_short_entry, spec.cols_launch(n, ho, wo, layer.C, g, short=True))
        for t in tiles:  # --dw-cols: other sizes of the column entry, compiled here
            if cols_name(t) in fns:
                entries[cols_name(t)] = (cols_name(t), t.cols_launch(n, ho, wo, layer.C, g))
    ref = ref_fn()
    row = {**asdict(layer), "N": n}
    for name, (entry, config) in entries.items():
        fn = fns[entry]
        if config.shared_bytes > SHARED_DEFAULT:
            fn.set_max_dynamic_shared(config.shared_bytes)

        def ours(fn=fn, config=config) -> None:
            fn.launch(config.grid, config.block, config.shared_bytes, ours_stream, args)

        y.fill_(float("nan"))
        with torch.cuda.stream(stream):
            ours()
        stream.synchronize()
        got = y.permute(0, 3, 1, 2).float()
        rel = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
        if name == next(iter(entries)):  # the entry the engine launches: the row's own numbers
            row |= {"entry": entry, "grid": list(config.grid), "block": config.block[0], "rel_l2": rel}
            row["passed"] = rel <= TOL
            if row["passed"]:
                row["ours_ms"] = graph_ms(ours, stream, iters)
        else:  # the per-element entry beside the tiled one: what the tile saves
            row[f"{name}_rel_l2"] = rel
            row[f"{name}_ms"] = graph_ms(ours, stream, iters) if rel <= TOL else None
            row["passed"] = row["passed"] and rel <= TOL
    if row["passed"]:
        row["torch_ms"] = graph_ms(theirs, stream, iters)
        row["ratio"] = row["ours_ms"] / row["torch_ms"]
    return row


def cols_name(t: DwConvSpec) -> str:
    return f"cols{t.cols_h}t{t.cols_threads}m{t.cols_min_blocks}"


def tile_name(t: DwConvSpec) -> str:
    return f"tile{t.tile_h}x{t.tile_w}c{t.tile_c}b{t.tile_b}t{t.tile_threads}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=200, help="launches per captured graph")
    ap.add_argument("--only", default="", help="run the layers whose name or op contains this")
    ap.add_argument(
        "--dw-cols", action="append", default=[], metavar="H,H_SHORT,THREADS,MIN_BLOCKS",
        help="also time dwconv's column entry compiled (NVRTC, here) with these sizes (repeatable)",
    )  # fmt: skip
    ap.add_argument(
        "--dw-tile", action="append", default=[], metavar="H,W,C,B,THREADS",
        help="also time dwconv's tiled entry compiled (NVRTC, here) with these tile sizes (repeatable)",
    )  # fmt: skip
    ap.add_argument(
        "--dw-tile3", action="store_true",
        help="the engine's choice for a 3x3 is its own tiled pair (DwConvSpec.tile3, off by default)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.dw_tile3:  # the registry run_layer reads the spec from
        KERNELS["dwconv"] = replace(KERNELS["dwconv"], tile3=True)
    if not torch.cuda.is_available():
        print("mobile_layers: needs a CUDA GPU and torch with CUDA", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    torch.cuda.init()
    dev = Device(0)
    ctx = dev.primary_context()  # the one torch uses
    ctx.make_current()
    choice = choose_image(dev.cc, [], list(PTX_ARCHES))
    mods, fns, tiles = [], {}, []
    for op in sorted({layer.op for layer in LAYERS}):
        spec = KERNELS[op]
        path = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{spec.source}.cu", choice.arch)
        mods.append(Module.load(ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch))
        fns.update({e: mods[-1].function(e) for e in spec.entries})
    for sizes in args.dw_cols:
        h, hs, t, m = (int(v) for v in sizes.split(","))
        cols = replace(KERNELS["dwconv"], cols_h=h, cols_h_short=hs, cols_threads=t, cols_min_blocks=m)
        source = SOURCE_DIR / f"{cols.source}.cu"
        ptx = re.sub(rf"{cols.cols_entry}\b", cols_name(cols), compile_ptx(source, choice.arch, cols.defines()).text)
        mods.append(Module.load(ctx, ptx.encode(), kind="ptx", origin=f"{source} {sizes}", target=choice.arch))
        fns[cols_name(cols)] = mods[-1].function(cols_name(cols))
        tiles.append(cols)
    for sizes in args.dw_tile:
        h, w, c, b, t = (int(v) for v in sizes.split(","))
        tile = replace(KERNELS["dwconv"], tile_h=h, tile_w=w, tile_c=c, tile_b=b, tile_threads=t)
        source = SOURCE_DIR / f"{tile.source}.cu"
        ptx = compile_ptx(source, choice.arch, tile.defines()).text.replace(tile.tile_entry, tile_name(tile))
        mods.append(Module.load(ctx, ptx.encode(), kind="ptx", origin=f"{source} {sizes}", target=choice.arch))
        fns[tile_name(tile)] = mods[-1].function(tile_name(tile))
        tiles.append(tile)
    stream = torch.cuda.Stream()

    rows = []
    print(f"{'layer':20} {'op':8} {'N':>2} {'uses':>4} {'rel_l2':>8} {'ours us':>8} {'torch us':>8} {'ratio':>6}"
          f" {'elem us':>8}")  # fmt: skip
    for n in args.batches:
        for layer in LAYERS:
            if args.only and args.only not in layer.name and args.only != layer.op:
                continue
            row = run_layer(fns, ctx, stream, layer, n, args.iters, tiles)
            rows.append(row)
            us = (
                f"{1e3 * row['ours_ms']:8.2f} {1e3 * row['torch_ms']:8.2f} {row['ratio']:6.2f}"
                if row["passed"]
                else "  FAILED"
            )
            if row.get("elem_ms"):  # a dwconv layer the tiled entry takes: the per-element entry's time
                us += f" {1e3 * row['elem_ms']:8.2f} {row['entry'].rsplit('_', 1)[-1]}"
            variants = [
                k[: -len("_ms")] for k in row if k.endswith("_ms") and k not in ("ours_ms", "torch_ms", "elem_ms")
            ]
            for name in variants:  # the other entries that take the layer (tiles, columns, --dw-* sizes)
                ms = row.get(f"{name}_ms")
                us += f" {name} {1e3 * ms:.2f}" if ms else f" {name} FAILED"
            print(f"{layer.name:20} {layer.op:8} {n:>2} {layer.uses:>4} {row['rel_l2']:8.1e} {us}")
    totals: dict[str, dict[str, float]] = {}
    for n in args.batches:
        for op in sorted({r["op"] for r in rows}):
            mine = [r for r in rows if r["N"] == n and r["op"] == op and r["passed"]]
            ours, theirs = (sum(r[k] * r["uses"] for r in mine) for k in ("ours_ms", "torch_ms"))
            totals.setdefault(str(n), {})[op] = {"ours_ms": ours, "torch_ms": theirs}
            print(f"N={n} {op:8}: weighted by use, ours {1e3 * ours:8.2f} us, torch {1e3 * theirs:8.2f} us")
    doc = {
        "commit": os.environ.get("DUALTRACK_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(),
        "driver": subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "arch": choice.arch,
        "iters": args.iters,
        "rows": rows,
        "totals": totals,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    for m in mods:
        m.close()
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
