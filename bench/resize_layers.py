#!/usr/bin/env python3
"""Time and bandwidth of the resize op (handwritten_ptx/resize_nhwc.cu) on the decoder resizes of
the zoo's segmentation models at 512x512, fp16, against ``F.interpolate`` on channels_last tensors.

    python bench/resize_layers.py OUT.json [--batches 8 1] [--iters 50] [--only segformer]

Needs a CUDA GPU, torch with CUDA (random data, eager torch for comparison) and dualtrack on the path
(the kernel is the checked-in PTX for the device's arch, JIT-compiled by the driver and launched
through dualtrack's driver layer on torch's stream). Each launch is what ``ResizeSpec.prepare``
answers for the plan's call (entry, grid, arguments), so the script times whatever launch the tree
has: to time an older tree, run this file with that tree's ``pipeline/`` first on PYTHONPATH (its PTX
comes with it), e.g. from a worktree of the commit before the change::

    git worktree add --detach /tmp/resize_old <commit>
    PYTHONPATH=/tmp/resize_old/pipeline python bench/resize_layers.py /tmp/resize_old.json

The rows are the Resize nodes of the zoo's exports at 512x512 (``uses``: how often the shape occurs in
one inference; 0: a comparison shape):
- smp Segformer("mit_b0"): its decoder's four resizes of the 256-channel MLP outputs (16, 32, 64, 128
  -> 128, bilinear half_pixel, the last a x1), each written into its channel slice of the
  1024-channel concatenation (ldy 1024); the final x4 of the two-class logits (128 -> 512,
  align_corners) — and the same at 16 channels (uses 0);
- smp Unet("tu-convnext_tiny"): its decoder's x2 nearest upsamples (768, 256, 128, 64, 32 channels at
  16 .. 256 pixels), the first three into the concatenation with their skip (384, 192, 96 channels);
- the same x2 shapes bilinear (uses 0), as FPN-like decoders upsample.

Each row is checked first: our output (NaN-poisoned before, inside its slice) against torch's fp32
computation of the same fp16 data (bilinear: rel L2 <= 2e-3, the one fp16 rounding; nearest: equal
bits). Times are ``--iters`` launches captured in one CUDA graph, replayed between CUDA events after
a warm-up (median of 5 replays, per launch). ``gbps``: the bytes a resize must move (the input read
once, the output written once) over our time; ``torch_gbps`` the same over torch's, whose output is a
dense tensor of its own (no concatenation slice). Prints a table and writes the rows and per-batch
totals of each model (weighted by ``uses``) as JSON, with the commit (env DUALTRACK_COMMIT) and the GPU's name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mobile_layers import graph_ms  # bench/: the same CUDA-graph timer

from dualtrack.compiler.kernel_build import SOURCE_DIR, ptx_path
from dualtrack.contract.arch import PTX_ARCHES, choose_image
from dualtrack.contract.plan import KernelCall
from dualtrack.kernels import KERNELS, ResizeMode
from dualtrack.runtime.driver import Device, Module, Stream
from dualtrack.runtime.tensors import GpuTensor

RESIZE = KERNELS["resize"]
TOL = 2e-3  # fp16 output rounding


@dataclass(frozen=True)
class Layer:
    """An ``H`` x ``H`` input of ``C`` channels resized to ``Ho`` x ``Ho`` by ``mode`` and ``coord``,
    written at channel ``at`` of an output ``ldy`` channels wide (0: dense)."""

    name: str
    uses: int
    C: int
    H: int
    Ho: int
    mode: str = "linear"
    coord: str = "half_pixel"
    ldy: int = 0
    at: int = 0


NEAREST = {"mode": "nearest", "coord": "asymmetric"}
LAYERS = (
    Layer("segformer 16->128", 1, 256, 16, 128, ldy=1024, at=0),
    Layer("segformer 32->128", 1, 256, 32, 128, ldy=1024, at=256),
    Layer("segformer 64->128", 1, 256, 64, 128, ldy=1024, at=512),
    Layer("segformer 128->128", 1, 256, 128, 128, ldy=1024, at=768),
    Layer("segformer 128->512 c2", 1, 2, 128, 512, coord="align_corners"),
    Layer("segformer 128->512 c16", 0, 16, 128, 512, coord="align_corners"),
    Layer("unet 16->32 c768", 1, 768, 16, 32, **NEAREST, ldy=1152),
    Layer("unet 32->64 c256", 1, 256, 32, 64, **NEAREST, ldy=448),
    Layer("unet 64->128 c128", 1, 128, 64, 128, **NEAREST, ldy=224),
    Layer("unet 128->256 c64", 1, 64, 128, 256, **NEAREST),
    Layer("unet 256->512 c32", 1, 32, 256, 512, **NEAREST),
    Layer("x2 bilinear c256", 0, 256, 32, 64),
    Layer("x2 bilinear c128", 0, 128, 64, 128),
    Layer("x2 bilinear c64", 0, 64, 128, 256),
)
TORCH_MODES = {  # F.interpolate's arguments for (mode, coord)
    ("linear", "half_pixel"): {"mode": "bilinear", "align_corners": False},
    ("linear", "align_corners"): {"mode": "bilinear", "align_corners": True},
    ("nearest", "asymmetric"): {"mode": "nearest"},
}


class NoContext:
    """The LaunchContext a resize is prepared with: it asks for nothing."""


def run_layer(fns: dict, ctx, stream: torch.cuda.Stream, layer: Layer, n: int, iters: int) -> dict:
    c, h, ho = layer.C, layer.H, layer.Ho
    ldy = layer.ldy or c
    x = torch.randn(n, h, h, c, device="cuda", dtype=torch.float16)
    wide = torch.randn(n, ho, ho, ldy, device="cuda", dtype=torch.float16)
    wide[..., layer.at : layer.at + c] = float("nan")
    how = ResizeMode(layer.mode, layer.coord, "floor", ho / h, ho / h)
    call = KernelCall("resize", ("x",), ("y",), (), (*how.attrs(), ("Ho", ho), ("Wo", ho)))
    f16 = np.dtype("float16")
    xt = GpuTensor(x.data_ptr(), (n, h, h, c), f16)
    yt = GpuTensor(wide.data_ptr() + 2 * layer.at, (n, ho, ho, c), f16, ld=ldy)
    p = RESIZE.prepare_inputs(call, [xt], yt, [], NoContext())
    fn = fns[p.entry]
    ours_stream = Stream.from_handle(stream.cuda_stream, ctx)

    def ours() -> None:
        fn.launch(p.config.grid, p.config.block, p.config.shared_bytes, ours_stream, p.args)

    xc = x.permute(0, 3, 1, 2)  # NCHW view of NHWC memory: channels_last
    kw = TORCH_MODES[(layer.mode, layer.coord)]

    def theirs() -> torch.Tensor:
        return F.interpolate(xc, size=(ho, ho), **kw)

    with torch.cuda.stream(stream):
        ours()
    stream.synchronize()
    got = wide[..., layer.at : layer.at + c].permute(0, 3, 1, 2).float()
    ref = F.interpolate(xc.float(), size=(ho, ho), **kw)
    if layer.mode == "linear":
        rel = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
        passed = rel <= TOL
    else:
        rel = float((got - ref).abs().max())
        passed = bool(torch.equal(got, ref))
    moved = (x.numel() + n * ho * ho * c) * 2
    row = {
        **asdict(layer), "N": n, "entry": p.entry, "grid": list(p.config.grid), "block": p.config.block[0],
        "bytes": moved, "rel_l2": rel, "passed": passed,
    }  # fmt: skip
    if passed:
        row["us"] = 1e3 * graph_ms(ours, stream, iters)
        row["torch_us"] = 1e3 * graph_ms(theirs, stream, iters)
        row["gbps"] = moved / row["us"] / 1e3
        row["torch_gbps"] = moved / row["torch_us"] / 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--iters", type=int, default=50, help="launches per captured graph")
    ap.add_argument("--only", default="", help="run the layers whose name contains this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("resize_layers: needs a CUDA GPU and torch with CUDA", file=sys.stderr)
        return 2
    torch.cuda.init()
    dev = Device(0)
    ctx = dev.primary_context()  # the one torch uses
    ctx.make_current()
    choice = choose_image(dev.cc, [], list(PTX_ARCHES))
    path = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{RESIZE.stem}.cu", choice.arch)
    mod = Module.load(ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch)
    fns = {e: mod.function(e) for e in RESIZE.entries}
    stream = torch.cuda.Stream()
    print(f"ptx: {path}")
    print(
        f"{'layer':24} {'N':>2} {'uses':>4} {'grid':>16} {'rel_l2':>8} {'ours us':>8} {'GB/s':>6}"
        f" {'torch us':>8} {'GB/s':>6}"
    )
    rows, totals = [], {}
    for n in args.batches:
        for layer in LAYERS:
            if args.only and args.only not in layer.name:
                continue
            row = run_layer(fns, ctx, stream, layer, n, args.iters)
            rows.append(row)
            grid = "x".join(str(g) for g in row["grid"])
            timing = (
                f"{row['us']:8.1f} {row['gbps']:6.0f} {row['torch_us']:8.1f} {row['torch_gbps']:6.0f}"
                if row["passed"]
                else "  FAILED"
            )
            print(f"{layer.name:24} {n:2} {layer.uses:4} {grid:>16} {row['rel_l2']:8.1e} {timing}")
        for net in ("segformer", "unet"):  # one inference's resizes of each model
            mine = [r for r in rows if r["N"] == n and r["passed"] and r["name"].startswith(net)]
            t = {k: sum(r[k] * r["uses"] for r in mine) for k in ("us", "torch_us", "bytes")}
            totals.setdefault(str(n), {})[net] = t
            if t["us"]:
                print(
                    f"N={n} {net}: weighted by use, ours {t['us']:.1f} us ({t['bytes'] / t['us'] / 1e3:.0f} GB/s), "
                    f"torch {t['torch_us']:.1f} us"
                )
    doc = {
        "commit": os.environ.get("DUALTRACK_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "arch": choice.arch,
        "ptx": str(path),
        "iters": args.iters,
        "rows": rows,
        "totals": totals,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    mod.close()
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
