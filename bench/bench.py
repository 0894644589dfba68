"""Issue 4 benchmarks: dualtrack against PyTorch on the reference U-Net, in one GPU run.

    PYTHONPATH=pipeline python bench/bench.py --bundle build/unet \\
        --seed-split-bundle build/unet_seed_split --iree-only-bundle build/iree_only --skip-autotune

(those three bundle paths are also the defaults; a bundle that is not there skips its row with the
reason printed). Bundles are built beforehand where the IREE compiler is: `dualtrack build CONFIG`.

Same weights (the bundle's model.onnx), fp16, the bundle's input size (512x512), N=1 and N=8.
Every row runs the whole model, uint8 NHWC image in -> probs and mask out, input already on the GPU.
Rows (names are fixed so that result files compare across commits):

    dualtrack                 bundle of configs/unet.yaml
    dualtrack_seed_split      bundle of configs/unet_seed_split.yaml (encoder on Track A, the rest IREE)
    iree_only                 bundle of configs/iree_only.yaml (no Track A: the whole model through IREE)
    torch_eager               PyTorch eager, NCHW
    torch_eager_cl            PyTorch eager, channels_last
    torch_compile             torch.compile mode="max-autotune-no-cudagraphs" ("default" with --skip-autotune)
    torch_compile_cudagraphs  torch.compile mode="reduce-overhead" (CUDA graphs)
    dualtrack_head_b          bundle of configs/unet_head_b.yaml (the head's 1x1 conv on Track B, with softmax)
    dualtrack_mma_sync        the dualtrack bundle with DUALTRACK_WGMMA=0: every conv3x3 on the mma.sync
                              kernel (only where the dualtrack row ran the sm_90a wgmma kernel)
    dualtrack_api             the dualtrack bundle through Engine.run on a torch CUDA tensor (what a service
                              calls; the dualtrack row times run_batch, the internal path)
    dualtrack_api_numpy       the same from numpy, results back on the host
    dualtrack_iree            the dualtrack bundle with DUALTRACK_TRACK_B=iree: Track B through the IREE
                              runtime instead of its launch plans replayed in the engine's CUDA graph
    dualtrack_api_iree        that engine through Engine.run on a torch CUDA tensor

`<HxW>/dualtrack_api` (`--sizes-bundle`, the bundle of configs/unet_sizes.yaml: the same U-Net built
for two non-square native sizes, 720x1280 and 1024x768): Engine.run on a torch CUDA uint8 tensor of
each native size (that size's plan, unpadded), checked against onnxruntime on the bundle's graph at
that size; reported under `sizes` in the result file, beside a torch_compile_cudagraphs row at the
same size where torch.compile is on (`<HxW>/torch_compile_cudagraphs`).

Every Engine.run row records `host_waits`, the host waits per inference (the replayed path has none:
the whole inference is one CUDA graph; through the IREE runtime each A -> B hand-over is one).

Timing: `median_ms` is host wall time around one synchronous call (time.perf_counter, the GPU idle
before and drained after), the one clock that sees IREE's own streams; torch rows also record
CUDA events on their stream (`median_event_ms`). Inputs rotate among --input-sets sets so that no
row is flattered by a warm L2. Before a row is timed its probs are checked against onnxruntime
(CPU) on one image at N=1 (relative L2 <= 1e-2); a row that fails is reported and not timed.

`--layers` (on by default) times every Track A conv3x3 call of the dualtrack bundle alone against
cuDNN (torch conv2d, channels_last fp16, benchmark mode) on the same shape, with CUDA events over a
queue of launches held behind a GPU sleep so that neither side's host launch cost is counted. "Ours"
is the kernel the engine launches for that layer and batch (`CudaBackend.prepare`: on sm_90a the
TMA + wgmma kernel where it takes the layer); where that is the wgmma kernel, the mma.sync kernel it
displaced is timed too (`mma_sync_ms`). The dualtrack rows record which kernel each conv ran
(`conv3x3`, from the engine's stats) and whether the wgmma kernel was on (`wgmma`). The same table
(`layers`, each row's `op` naming its kind) times every maxpool2x2 and convt2x2 call against
PyTorch (max_pool2d; conv_transpose2d with the model's weights and bias) in GB/s (bytes read and
written once / time), ours on buffers laid out as the plan lays them out (a concat's channel slice
where the plan reads or writes one); the 70% target is about conv3x3 rows only.

`--breakdown` (on by default) runs the dualtrack bundle's Track A calls one by one, queued behind a
GPU sleep with a CUDA event between launches, and sets the sum of their times against the Track A
time of the dualtrack row (one CUDA graph): the difference is launch gaps and tails inside the graph
(`track_a_breakdown`, by batch size).

Writes bench/results/bench-<commit10>.json and .png; prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# docs/facts.md, "The reference workload": 96.6 GFLOP per image; 790 TFLOP/s measured bf16 GEMM rate.
GFLOP_PER_IMAGE = 96.6
FLOOR_TFLOPS = 790.0
CHECK_REL_L2 = 1e-2
LAYER_TARGET = 0.70  # issue 4: each Track A conv >= 70% of cuDNN's throughput on the same layer
BASELINE = "torch_compile_cudagraphs"
ROWS = (
    "dualtrack",
    "dualtrack_seed_split",
    "iree_only",
    "torch_eager",
    "torch_eager_cl",
    "torch_compile",
    "torch_compile_cudagraphs",
    "dualtrack_mma_sync",  # late: the chart's colours of the older rows stay as they were
    "dualtrack_head_b",
    "dualtrack_api",  # Engine.run on a torch CUDA tensor: what a service calls (the dualtrack row: run_batch)
    "dualtrack_api_numpy",  # Engine.run on numpy, results copied back to the host
    "dualtrack_iree",  # the dualtrack bundle, Track B through the IREE runtime (run_batch)
    "dualtrack_api_iree",  # the same through Engine.run on a torch CUDA tensor
)
BUNDLE_ROWS = {  # row -> (argparse dest, config that builds its bundle)
    "dualtrack": ("bundle", "configs/unet.yaml"),
    "dualtrack_seed_split": ("seed_split_bundle", "configs/unet_seed_split.yaml"),
    "iree_only": ("iree_only_bundle", "configs/iree_only.yaml"),
    "dualtrack_mma_sync": ("bundle", "configs/unet.yaml"),
    "dualtrack_head_b": ("head_b_bundle", "configs/unet_head_b.yaml"),
    "dualtrack_iree": ("bundle", "configs/unet.yaml"),
}
# Settings a row's engine is loaded with.
ROW_ENV = {"dualtrack_mma_sync": {"DUALTRACK_WGMMA": "0"}, "dualtrack_iree": {"DUALTRACK_TRACK_B": "iree"}}
# Engine.run rows of a bundle row: (row name, input on the GPU as a torch tensor?).
API_ROWS = {
    "dualtrack": (("dualtrack_api", True), ("dualtrack_api_numpy", False)),
    "dualtrack_iree": (("dualtrack_api_iree", True),),
}


# -- small helpers ----------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def gpu_and_driver() -> tuple[str, str]:
    """GPU name and driver version from nvidia-smi, else from the Driver API."""
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
        name, driver = (s.strip() for s in out[0].rsplit(",", 1))
        return name, driver
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    try:
        from dualtrack.runtime.driver import Device

        dev = Device(0)
        return dev.name, f"CUDA driver API {dev.driver_version // 1000}.{dev.driver_version % 1000 // 10}"
    except Exception as exc:  # no GPU at all: say so in the result rather than crash before the table
        return "unknown", f"unknown ({type(exc).__name__}: {exc})"


def rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    ref64, got64 = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(np.linalg.norm(got64 - ref64) / max(np.linalg.norm(ref64), 1e-30))


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median": statistics.median(s),
        "p10": s[int(0.1 * (len(s) - 1))],
        "p90": s[int(0.9 * (len(s) - 1))],
        "min": s[0],
    }


def floor_ms(batch: int) -> float:
    return GFLOP_PER_IMAGE * 1e9 * batch / (FLOOR_TFLOPS * 1e12) * 1e3


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for a block (dualtrack reads its settings when an engine loads)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def skipped(name: str, reason: str, batches: list[int]) -> list[dict[str, Any]]:
    print(f"[{name}] skipped: {reason}")
    return [{"name": name, "batch": b, "median_ms": None, "skipped": reason} for b in batches]


def guarded(name: str, batches: list[int], fn: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run one row; an exception becomes a skipped row with its message (the traceback is printed),
    so that one broken row does not cost the rest of a GPU run."""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        return skipped(name, f"failed: {type(exc).__name__}: {exc}", batches)


# -- the reference model, read from ONNX --------------------------------------------------------------


def load_weights(model_path: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def unet_depth(weights: dict[str, np.ndarray]) -> int:
    levels = {int(k[3 : k.index("/")]) for k in weights if k.startswith("enc") and k.endswith("/conv1.weight")}
    if not levels or levels != set(range(1, max(levels) + 1)):
        raise ValueError(f"model.onnx has encoder levels {sorted(levels)}; expected enc1/ .. encD/ (reference.py)")
    return max(levels)


def model_gflop(weights: dict[str, np.ndarray], height: int, width: int) -> float:
    """Multiply-adds x 2 of every conv and transposed conv (the FACTS count ignores the rest)."""
    depth, flops = unet_depth(weights), 0

    def conv(name: str, pixels: int) -> int:
        k, c, r, s = weights[f"{name}.weight"].shape
        return 2 * pixels * k * c * r * s

    for level in range(1, depth + 1):
        px = (height >> (level - 1)) * (width >> (level - 1))
        flops += conv(f"enc{level}/conv1", px) + conv(f"enc{level}/conv2", px)
        cin, cout = weights[f"dec{level}/up.weight"].shape[:2]
        flops += 2 * px * cin * cout + conv(f"dec{level}/conv1", px) + conv(f"dec{level}/conv2", px)
    px = (height >> depth) * (width >> depth)
    flops += conv("mid/conv1", px) + conv("mid/conv2", px) + conv("head/conv", height * width)
    return flops / 1e9


def build_torch_unet(torch: Any, weights: dict[str, np.ndarray], *, channels_last: bool) -> Any:
    """The U-Net of dualtrack/reference.py as a torch module holding the ONNX initializers.

    forward(image uint8 NHWC) -> (probs float32 (N, classes, H, W), mask uint8 (N, H, W)), exactly the
    ONNX graph: cast, NCHW, (x - mean) * inv_std in fp32, to the weights' dtype; encoder levels of
    (conv3x3 + ReLU) x 2 then maxpool 2x2; mid/; decoder levels of ConvTranspose 2x2 s2, concat
    [up, skip], (conv3x3 + ReLU) x 2; head 1x1 conv; softmax in the weights' dtype; argmax.
    """
    nn, F = torch.nn, torch.nn.functional
    depth = unet_depth(weights)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def param(name: str) -> Any:
        return nn.Parameter(torch.from_numpy(np.array(weights[name], copy=True)), requires_grad=False)

    def conv(name: str) -> Any:
        w = weights[f"{name}.weight"]
        m = nn.Conv2d(w.shape[1], w.shape[0], w.shape[2], padding=w.shape[2] // 2, device="meta")
        m.weight, m.bias = param(f"{name}.weight"), param(f"{name}.bias")
        return m

    def up(name: str) -> Any:
        w = weights[f"{name}.weight"]  # (Cin, Cout, 2, 2), as ONNX ConvTranspose stores it
        m = nn.ConvTranspose2d(w.shape[0], w.shape[1], 2, stride=2, device="meta")
        m.weight, m.bias = param(f"{name}.weight"), param(f"{name}.bias")
        return m

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dtype = torch.float16 if weights["enc1/conv1.weight"].dtype == np.float16 else torch.float32
            names = [f"enc{i}/conv{j}" for i in range(1, depth + 1) for j in (1, 2)]
            names += ["mid/conv1", "mid/conv2", "head/conv"]
            names += [f"dec{i}/conv{j}" for i in range(1, depth + 1) for j in (1, 2)]
            self.convs = nn.ModuleDict({n.replace("/", "_"): conv(n) for n in names})
            self.ups = nn.ModuleDict({f"dec{i}_up": up(f"dec{i}/up") for i in range(1, depth + 1)})
            self.register_buffer("mean", torch.from_numpy(np.array(weights["pre/mean"], np.float32)))
            self.register_buffer("inv_std", torch.from_numpy(np.array(weights["pre/inv_std"], np.float32)))

        def block(self, x: Any, name: str) -> Any:
            x = F.relu(self.convs[f"{name}_conv1"](x))
            return F.relu(self.convs[f"{name}_conv2"](x))

        def forward(self, image: Any) -> tuple[Any, Any]:
            x = (image.permute(0, 3, 1, 2).float() - self.mean) * self.inv_std
            x = x.to(self.dtype, memory_format=fmt)
            skips = []
            for level in range(1, depth + 1):
                x = self.block(x, f"enc{level}")
                skips.append(x)
                x = F.max_pool2d(x, 2, 2)
            x = self.block(x, "mid")
            for level in range(depth, 0, -1):
                x = torch.cat([self.ups[f"dec{level}_up"](x), skips[level - 1]], dim=1)
                x = self.block(x, f"dec{level}")
            probs = torch.softmax(self.convs["head_conv"](x), dim=1)
            return probs.float(), probs.argmax(dim=1).to(torch.uint8)

    model = UNet().eval()
    return model.to(memory_format=fmt) if channels_last else model


def ort_probs(model_path: Path, image: np.ndarray) -> np.ndarray:
    """onnxruntime (CPU) probs of the bundle's model: the reference every row is checked against."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    return sess.run(["probs"], {sess.get_inputs()[0].name: image})[0]


# -- dualtrack rows -------------------------------------------------------------------------------


@contextlib.contextmanager
def segment_timer(backend: Any) -> Iterator[dict[str, float]]:
    """Host ms of every segment of the next run_batch calls, by segment name (reset by the caller).

    Each segment returns with its work complete (Track A waits on its end event, IREE's call is
    synchronous), so host time per segment is its time on the GPU plus its own overheads.
    """
    times: dict[str, float] = {}
    inner = backend.run_segment

    def timed(seg: Any, batch: int, inputs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(seg, batch, inputs)
        times[seg.name] = times.get(seg.name, 0.0) + (time.perf_counter() - t0) * 1e3
        return out

    backend.run_segment = timed
    try:
        yield times
    finally:
        del backend.run_segment  # back to the class's method


def time_engine(engine: Any, xs: list[Any], batch: int, warmup: int, iters: int) -> dict[str, Any]:
    be = engine.backend
    for i in range(warmup):
        engine.run_batch(xs[i % len(xs)], batch)
    be.stream.synchronize()
    totals: list[float] = []
    tracks: dict[str, list[float]] = {"A": [], "B": []}
    graph: list[float] = []
    segs: dict[str, list[float]] = {}
    with segment_timer(be) as seg_ms:
        for i in range(iters):
            x = xs[i % len(xs)]
            be.timings = {"A": 0.0, "B": 0.0, "graph": 0.0}
            seg_ms.clear()
            t0 = time.perf_counter()
            engine.run_batch(x, batch)
            be.stream.synchronize()
            totals.append((time.perf_counter() - t0) * 1e3)
            be.collect_timings()
            for k in tracks:
                tracks[k].append(be.timings[k])
            graph.append(be.timings.get("graph", 0.0))
            for k, v in seg_ms.items():
                segs.setdefault(k, []).append(v)
    st = stats(totals)
    return {
        "median_ms": _r(st["median"]),
        "median_event_ms": None,
        "p10_ms": _r(st["p10"]),
        "p90_ms": _r(st["p90"]),
        "min_ms": _r(st["min"]),
        "timer": "host perf_counter around run_batch + stream sync (IREE runs on its own streams)",
        "tracks_ms": {k: _r(statistics.median(v)) for k, v in tracks.items()},
        "graph_ms": _r(statistics.median(graph)) if any(graph) else None,  # the whole inference as one graph
        "segments_ms": {k: _r(statistics.median(v)) for k, v in segs.items()},
    }


def time_api(torch: Any, engine: Any, xs: list[Any], warmup: int, iters: int) -> dict[str, Any]:
    """The public path: ``Engine.run`` as a service calls it, the device drained after each call
    (``torch.cuda.synchronize`` waits for IREE's streams too: one primary context)."""
    for i in range(warmup):
        engine.run(xs[i % len(xs)])
    torch.cuda.synchronize()
    totals, waits = [], []
    for i in range(iters):
        w0 = engine.backend.stats.host_waits
        t0 = time.perf_counter()
        engine.run(xs[i % len(xs)])
        torch.cuda.synchronize()
        totals.append((time.perf_counter() - t0) * 1e3)
        waits.append(engine.backend.stats.host_waits - w0)
    st = stats(totals)
    return {
        "host_waits": statistics.median(waits),  # per inference: each an A -> B hand-over
        "median_ms": _r(st["median"]),
        "median_event_ms": None,
        "p10_ms": _r(st["p10"]),
        "p90_ms": _r(st["p90"]),
        "min_ms": _r(st["min"]),
        "timer": "host perf_counter around Engine.run + torch.cuda.synchronize",
    }


def api_rows(engine: Any, b: int, ctx: dict[str, Any], row: str) -> list[dict[str, Any]]:
    """`<row>_api` rows (API_ROWS): a torch CUDA uint8 tensor in, DLPack arrays out, or numpy in,
    numpy out: the calls a service makes, beside the row's run_batch."""
    import torch

    args = ctx["args"]
    host = ctx["inputs"][b]
    out = []
    for name, on_gpu in API_ROWS[row]:
        xs = [torch.from_numpy(x).cuda() for x in host] if on_gpu else host
        t = time_api(torch, engine, xs, args.warmup, args.iters)
        print(f"[{name}] N={b}: {t['median_ms']:.3f} ms")
        out.append({"name": name, "batch": b, **t})
    return out


def size_rows(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """The `<HxW>/dualtrack_api` rows: each native size of --sizes-bundle through ``Engine.run`` on a torch
    CUDA tensor of that size (the engine runs that size's plan: ``Engine.at_size``, timed directly so that
    its host waits are its own), after a check of its probs against onnxruntime at N=1; and where
    torch.compile is on, `<HxW>/torch_compile_cudagraphs` on the same images."""
    args, path = ctx["args"], ctx["args"].sizes_bundle
    if path is None or not (path / "manifest.json").is_file():
        why = f"bundle {path} not found (build it with `dualtrack build configs/unet_sizes.yaml`)"
        return skipped("sizes/dualtrack_api", why, args.batches)
    import torch

    from dualtrack.contract.bundle import Bundle
    from dualtrack.contract.sizes import label
    from dualtrack.runtime.engine import Engine

    bundle, rows, rng = Bundle.open(path), [], np.random.default_rng(1)
    src = bundle.manifest.model.source_sha256
    if ctx["source_sha256"] and src != ctx["source_sha256"]:  # the torch rows use the reference's weights
        return skipped("sizes/dualtrack_api", f"{path} was built from another model than {ctx['model_path']}", [])
    with Engine.load(bundle, "cuda") as engine:
        for size in bundle.sizes:
            name, sub = f"{label(size)}/dualtrack_api", engine.at_size(size)
            x1 = rng.integers(0, 256, (1, *size, 3), dtype=np.uint8)
            got = torch.from_dlpack(engine.run(torch.from_numpy(x1).cuda())["probs"]).cpu().numpy()
            err = rel_l2(ort_probs(path / bundle.at_size(size).model_file, x1), got)
            print(f"[{name}] probs vs onnxruntime at N=1: rel L2 {err:.2e} (limit {CHECK_REL_L2:.0e})")
            if not err <= CHECK_REL_L2:
                rows += skipped(name, f"probs differ from onnxruntime: rel L2 {err:.2e}", args.batches)
                continue
            for b in args.batches:
                if b not in sub.batch_sizes:
                    rows += skipped(name, f"N={b} is not compiled in {path} (has {list(sub.batch_sizes)})", [b])
                    continue
                host = [rng.integers(0, 256, (b, *size, 3), dtype=np.uint8) for _ in range(args.input_sets)]
                t = time_api(torch, sub, [torch.from_numpy(x).cuda() for x in host], args.warmup, args.iters)
                print(f"[{name}] N={b}: {t['median_ms']:.3f} ms")
                rows.append({"name": name, "batch": b, "size": list(size), **t, "check_rel_l2": _r(err, 6)})
                if not args.skip_torch_compile:
                    rows += guarded(f"{label(size)}/torch_compile_cudagraphs", [b], lambda h=host: _size_torch(ctx, h))
    return rows


def _size_torch(ctx: dict[str, Any], host: list[np.ndarray]) -> list[dict[str, Any]]:
    """torch.compile(mode="reduce-overhead") of the same U-Net on ``host`` images of one native size."""
    import torch

    args = ctx["args"]
    n, h, w = host[0].shape[:3]
    net = build_torch_unet(torch, ctx["weights"], channels_last=True).cuda()
    fn = torch.compile(net, mode="reduce-overhead", dynamic=False)
    xs = [torch.from_numpy(x).cuda() for x in host]
    with torch.no_grad():
        t = time_torch(torch, fn, xs, args.warmup, args.iters, torch.compiler.cudagraph_mark_step_begin)
    print(f"[{h}x{w}/torch_compile_cudagraphs] N={n}: {t['median_ms']:.3f} ms")
    return [{"name": f"{h}x{w}/torch_compile_cudagraphs", "batch": n, "size": [h, w], **t}]


def bench_bundle(name: str, path: Path | None, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of one bundle at every batch size; for `dualtrack` with --layers also ctx["layers"], with
    --breakdown ctx["track_a_breakdown"]."""
    args, batches = ctx["args"], ctx["args"].batches
    config = BUNDLE_ROWS[name][1]
    if path is None or not (path / "manifest.json").is_file():
        where = f"bundle {path} not found" if path else "no bundle given"
        return skipped(name, f"{where} (build it with `dualtrack build {config}`)", batches)
    from dualtrack.contract.bundle import Bundle
    from dualtrack.runtime.engine import Engine

    bundle = Bundle.open(path)
    src = bundle.manifest.model.source_sha256
    if ctx["source_sha256"] and src and src != ctx["source_sha256"]:
        return skipped(name, f"{path} was built from another model than {ctx['model_path']}", batches)
    plan = [
        {"segment": s.name, "track": s.track, "nodes": len(s.nodes), "first": s.nodes[0], "last": s.nodes[-1]}
        for s in bundle.plan.segments
    ]
    if name == "dualtrack_mma_sync" and not ctx.get("wgmma_on"):
        return skipped(name, "the dualtrack row ran no wgmma kernel: this row would repeat it", batches)
    print(f"[{name}] {path}: " + "; ".join(f"{p['segment']} {p['first']} .. {p['last']}" for p in plan))
    t0 = time.perf_counter()
    with _environ(ROW_ENV.get(name, {})):  # read once, when the engine's backend is made
        engine = Engine.load(bundle, "cuda")
    load_s = time.perf_counter() - t0
    be = engine.backend
    if name == "dualtrack":
        ctx["wgmma_on"] = be.stats.wgmma.startswith("on")
    print(f"[{name}] wgmma conv3x3: {be.stats.wgmma}")
    rows: list[dict[str, Any]] = []
    try:
        err = rel_l2(ctx["ref_probs"], engine.run(ctx["sample"])["probs"])
        print(f"[{name}] probs vs onnxruntime at N=1: rel L2 {err:.2e} (limit {CHECK_REL_L2:.0e})")
        if not err <= CHECK_REL_L2:
            return skipped(name, f"probs differ from onnxruntime: rel L2 {err:.2e} > {CHECK_REL_L2:.0e}", batches)
        for b in batches:
            if b not in engine.batch_sizes:
                rows += skipped(name, f"N={b} is not compiled in {path} (has {list(engine.batch_sizes)})", [b])
                continue

            def one(b: int = b) -> list[dict[str, Any]]:
                xs = [engine.backend.from_host(x) for x in ctx["inputs"][b]]
                t = time_engine(engine, xs, b, args.warmup, args.iters)
                print(f"[{name}] N={b}: {t['median_ms']:.3f} ms (tracks {t['tracks_ms']}, segments {t['segments_ms']})")
                row = {"name": name, "batch": b, **t, "check_rel_l2": _r(err, 6), "bundle": str(path)}
                conv = {node: per[b] for node, per in be.stats.conv3x3.items() if b in per}
                extra = {"wgmma": be.stats.wgmma, "conv3x3": conv} if conv else {}
                return [{**row, "engine_load_s": round(load_s, 2), "plan": plan, **extra}]

            rows += guarded(name, [b], one)
            if name in API_ROWS:
                rows += guarded(API_ROWS[name][0][0], [b], lambda b=b: api_rows(engine, b, ctx, name))
        if name == "dualtrack" and args.layers:
            try:
                ctx["layers"] = bench_layers(engine, batches, args)
            except Exception:
                traceback.print_exc()
                print("[layers] failed (traceback above)")
        if name == "dualtrack" and args.breakdown:
            graph_ms = {r["batch"]: r["tracks_ms"]["A"] for r in rows if r.get("tracks_ms", {}).get("A")}
            try:
                ctx["track_a_breakdown"] = bench_track_a(engine, graph_ms, args)
            except Exception:
                traceback.print_exc()
                print("[track A] breakdown failed (traceback above)")
    finally:
        engine.close()
    return rows


# -- torch rows -----------------------------------------------------------------------------------


def time_torch(
    torch: Any,
    fn: Callable[[Any], Any],
    xs: list[Any],
    warmup: int,
    iters: int,
    before: Callable[[], None] | None = None,
) -> dict[str, Any]:
    for i in range(warmup):
        if before:
            before()
        fn(xs[i % len(xs)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, events = [], []
    for i in range(iters):
        x = xs[i % len(xs)]
        if before:
            before()
        t0 = time.perf_counter()
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
        events.append(start.elapsed_time(end))
    sh, se = stats(host), stats(events)
    return {
        "median_ms": _r(sh["median"]),
        "median_event_ms": _r(se["median"]),
        "p10_ms": _r(sh["p10"]),
        "p90_ms": _r(sh["p90"]),
        "min_ms": _r(sh["min"]),
        "timer": "host perf_counter around the call + cuda synchronize; CUDA events on the current stream",
    }


def torch_variant(torch: Any, name: str, channels_last: bool, mode: str | None, ctx: dict[str, Any]) -> list[dict]:
    """One torch row at every batch size: build, (compile,) check against onnxruntime, time."""
    args = ctx["args"]
    model = build_torch_unet(torch, ctx["weights"], channels_last=channels_last).to(ctx["torch_sample"].device)
    fn: Callable[[Any], Any] = model
    before = None
    if mode is not None:
        fn = torch.compile(model, mode=None if mode == "default" else mode, dynamic=False)
        if mode == "reduce-overhead":
            before = torch.compiler.cudagraph_mark_step_begin  # a new graph replay, outputs not kept

    def first_call(x: Any) -> tuple[Any, float]:
        if before:
            before()
        t0 = time.perf_counter()
        probs = fn(x)[0].float().cpu().numpy()
        torch.cuda.synchronize()
        return probs, time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        probs, first_s = first_call(ctx["torch_sample"])
        compile_s = {1: first_s}
        err = rel_l2(ctx["ref_probs"], probs)
        extra = f" (first call, compile included: {first_s:.1f} s)" if mode else ""
        print(f"[{name}] probs vs onnxruntime at N=1: rel L2 {err:.2e} (limit {CHECK_REL_L2:.0e}){extra}")
        if not err <= CHECK_REL_L2:
            return skipped(name, f"probs differ from onnxruntime: rel L2 {err:.2e} > {CHECK_REL_L2:.0e}", args.batches)
        for b in args.batches:
            xs = ctx["torch_inputs"][b]
            if mode and b not in compile_s:
                compile_s[b] = first_call(xs[0])[1]
                print(f"[{name}] compile for N={b}: {compile_s[b]:.1f} s (first call)")
            t = time_torch(torch, fn, xs, args.warmup, args.iters, before)
            row = {"name": name, "batch": b, **t, "check_rel_l2": _r(err, 6)}
            row["layout"] = "channels_last" if channels_last else "NCHW"
            if mode:
                row.update(compile_mode=mode, compile_s=round(compile_s[b], 2))
            rows.append(row)
            print(f"[{name}] N={b}: {t['median_ms']:.3f} ms (events {t['median_event_ms']:.3f} ms)")
    return rows


def torch_rows(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    args, batches = ctx["args"], ctx["args"].batches
    names = ["torch_eager", "torch_eager_cl", "torch_compile", "torch_compile_cudagraphs"]
    try:
        import torch
    except ImportError as exc:
        return [r for n in names for r in skipped(n, f"torch is not installed ({exc})", batches)]
    if not torch.cuda.is_available():
        return [r for n in names for r in skipped(n, "torch sees no CUDA device", batches)]
    ctx["torch"] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(0),
    }
    torch.backends.cudnn.benchmark = True
    ctx["torch_sample"] = torch.from_numpy(ctx["sample"]).cuda()
    ctx["torch_inputs"] = {b: [torch.from_numpy(x).cuda() for x in xs] for b, xs in ctx["inputs"].items()}
    compile_mode = "default" if args.skip_autotune else "max-autotune-no-cudagraphs"
    variants: list[tuple[str, bool, str | None]] = [("torch_eager", False, None), ("torch_eager_cl", True, None)]
    rows: list[dict[str, Any]] = []
    if args.skip_torch_compile:
        rows += [r for n in names[2:] for r in skipped(n, "--skip-torch-compile", batches)]
    else:
        variants += [("torch_compile", True, compile_mode), ("torch_compile_cudagraphs", True, "reduce-overhead")]
    for name, channels_last, mode in variants:
        torch._dynamo.reset()  # each compiled row starts from nothing: its compile time is its own
        rows += guarded(name, batches, lambda n=name, c=channels_last, m=mode: torch_variant(torch, n, c, m, ctx))
        torch._dynamo.reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rows


# -- Track A convolutions against cuDNN -------------------------------------------------------------


def _queued_ms(
    sleep: Callable[[], None],
    record: Callable[[str], None],
    elapsed: Callable[[], float],
    launch: Callable[[], None],
    per_rep: int,
    reps: int,
) -> tuple[float, float]:
    """Median ms per launch of `per_rep` launches queued behind a GPU sleep; also the worst host
    enqueue time of one rep, which must stay below the sleep for the GPU to run them back to back."""
    out, worst_enqueue = [], 0.0
    for _ in range(reps):
        sleep()
        t0 = time.perf_counter()
        record("start")
        for _ in range(per_rep):
            launch()
        record("end")
        worst_enqueue = max(worst_enqueue, (time.perf_counter() - t0) * 1e3)
        out.append(elapsed() / per_rep)
    return statistics.median(out), worst_enqueue


def _nhwc(spec: Any, batch: int) -> tuple[int, ...]:
    """(N, H, W, C) of a plan tensor at a batch size (Track A tensors are NHWC; be safe about NCHW)."""
    s = spec.at_batch(batch)
    return (s[0], s[2], s[3], s[1]) if spec.layout == "NCHW" else s


class LayerClock:
    """CUDA-event ms per launch of launches queued behind a GPU sleep, on our stream or on torch's
    (:func:`_queued_ms`): the clock of ``--layers`` and of the Track A breakdown."""

    def __init__(self, torch: Any, be: Any, launches: int, reps: int) -> None:
        from dualtrack.runtime.driver import Event

        self.torch, self.be, self.launches, self.reps = torch, be, launches, reps
        self.ours_stream = torch.cuda.ExternalStream(int(be.stream.handle))
        self.torch_stream = torch.cuda.current_stream()
        self.ev = {"start": Event(be.ctx), "end": Event(be.ctx)}
        self.tev = {"start": torch.cuda.Event(enable_timing=True), "end": torch.cuda.Event(enable_timing=True)}
        # Calibrate torch.cuda._sleep (clock cycles) to milliseconds once.
        torch.cuda._sleep(1_000_000)
        self.tev["start"].record()
        torch.cuda._sleep(10_000_000)
        self.tev["end"].record()
        torch.cuda.synchronize()
        self.ms_per_cycle = self.tev["start"].elapsed_time(self.tev["end"]) / 10_000_000

    def sleep_ours(self, ms: float) -> None:
        """Hold our stream for ``ms`` (work queued after it starts only when the sleep ends)."""
        with self.torch.cuda.stream(self.ours_stream):
            self.torch.cuda._sleep(int(ms / self.ms_per_cycle))

    def sleep_torch(self, ms: float) -> None:
        with self.torch.cuda.stream(self.torch_stream):
            self.torch.cuda._sleep(int(ms / self.ms_per_cycle))

    def size_sleep(self, ours: Callable[[], Any], theirs: Callable[[], Any]) -> float:
        """Warm both sides up (cuDNN benchmark picks its algorithm here) and size the sleep: twice
        the slower side's host enqueue time of ``launches`` launches, plus 0.2 ms."""
        enq = []
        for fn, sync in ((ours, self.be.stream.synchronize), (theirs, self.torch.cuda.synchronize)):
            for _ in range(3):
                fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(self.launches):
                fn()
            enq.append((time.perf_counter() - t0) * 1e3)
            sync()
        return 2.0 * max(enq) + 0.2

    def queued_ours(self, fn: Callable[[], Any], sleep_ms: float) -> tuple[float, float]:
        """(median ms per launch, worst host enqueue ms of one rep) of ``fn`` on our stream."""

        def record(name: str) -> None:
            self.ev[name].record(self.be.stream)

        def elapsed() -> float:
            return self.ev["start"].elapsed_ms(self.ev["end"])

        return _queued_ms(lambda: self.sleep_ours(sleep_ms), record, elapsed, fn, self.launches, self.reps)

    def queued_torch(self, fn: Callable[[], Any], sleep_ms: float) -> tuple[float, float]:
        """(median ms per launch, worst host enqueue ms of one rep) of ``fn`` on torch's stream."""

        def record(name: str) -> None:
            self.tev[name].record(self.torch_stream)

        def elapsed() -> float:
            self.tev["end"].synchronize()
            return self.tev["start"].elapsed_time(self.tev["end"])

        return _queued_ms(lambda: self.sleep_torch(sleep_ms), record, elapsed, fn, self.launches, self.reps)


# -- Track A tensors laid out as the plan lays them out (pure parts first) ---------------------------

MEMORY_OPS = ("maxpool2x2", "convt2x2")  # the Track A ops timed against PyTorch in GB/s, not TFLOP/s


def layer_label(c: Any) -> str:
    """A kernel call's name in the tables: its weights' name (``dec4/up``), else its node or output."""
    if c.weights:
        return c.weights[0].removesuffix(".weight")
    return c.nodes[0] if c.nodes else c.outputs[0]


def channel_slices(seg: Any) -> dict[str, tuple[str, int]]:
    """Every tensor of a Track A segment -> (the tensor whose buffer holds it, its first channel there),
    as the engine lays them out: ``Segment.channel_views`` (a concat's inputs, a slice's output)."""
    return seg.channel_views()


def layer_bytes(op: str, n: int, h: int, w: int, c: int, k: int, itemsize: int) -> int:
    """Bytes a layer must read and write at least, each tensor once (the GB/s of the memory ops):
    maxpool2x2 (N,H,W,C) -> (N,H/2,W/2,C); convt2x2 (N,H,W,C) and (C,K,2,2) weights + bias -> (N,2H,2W,K)."""
    if op == "maxpool2x2":
        return (n * h * w * c + n * (h // 2) * (w // 2) * c) * itemsize
    if op == "convt2x2":
        return (n * h * w * c + 4 * c * k + k + n * 2 * h * 2 * w * k) * itemsize
    raise ValueError(f"layer_bytes knows {MEMORY_OPS}, not {op!r}")


def plan_views(
    be: Any, seg: Any, batch: int, names: tuple[str, ...], data: dict[str, np.ndarray] | None = None
) -> dict[str, Any]:
    """GpuTensors for ``names`` laid out as the engine lays them out (:func:`channel_slices`: a
    concat input is a channel slice of its concat's buffer), in fresh buffers; two names of one
    concat share its buffer. ``data`` (NHWC arrays by name) is uploaded into those names' channels."""
    from dualtrack.runtime.gpu import GpuTensor

    data = data or {}
    specs = {t.name: t for t in (*seg.inputs, *seg.tensors, *seg.outputs)}
    slices = channel_slices(seg)
    by_root: dict[str, list[str]] = {}
    for name in names:
        by_root.setdefault(slices[name][0], []).append(name)
    views = {}
    for root, members in by_root.items():
        if specs[root].layout != "NHWC" and root not in data:  # a model output in its own layout (seghead's)
            shape = specs[root].at_batch(batch)
            dtype = np.dtype(specs[root].dtype)
            buf = be.pool.alloc(int(np.prod(shape)) * dtype.itemsize, be.stream)
            views[root] = GpuTensor(int(buf), shape, dtype, buf)
            continue
        n, h, w, ld = _nhwc(specs[root], batch)
        dtype = np.dtype(specs[root].dtype)
        if any(m in data for m in members):
            host = np.zeros((n, h, w, ld), dtype)
            for m in members:
                if m in data:
                    offset = slices[m][1]
                    host[..., offset : offset + data[m].shape[3]] = data[m]
            buf = be.from_host(host).keepalive
        else:
            buf = be.pool.alloc(n * h * w * ld * dtype.itemsize, be.stream)
        for m in members:
            shape = _nhwc(specs[m], batch)
            ptr = int(buf) + slices[m][1] * dtype.itemsize
            views[m] = GpuTensor(ptr, shape, np.dtype(specs[m].dtype), buf, ld=ld if root != m else 0)
    return views


def view_to_host(be: Any, t: Any) -> np.ndarray:
    """A tensor of :func:`plan_views` on the host: its buffer downloaded, its channels cut out."""
    from dualtrack.runtime.gpu import GpuTensor

    buf = t.keepalive
    n, h, w, c = t.shape
    offset = (t.ptr - int(buf)) // t.dtype.itemsize
    full = be.to_host(GpuTensor(int(buf), (n, h, w, t.channel_stride), t.dtype, buf))
    return full[..., offset : offset + c]


def bench_layers(engine: Any, batches: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every Track A conv3x3 call of the plan: the kernel the engine launches for it alone (and the
    mma.sync kernel where the wgmma kernel displaced it) vs cuDNN on the same shape; then every
    maxpool2x2 and convt2x2 call against PyTorch (:func:`_bench_memory_layer`)."""
    try:
        import torch
    except ImportError as exc:
        print(f"[layers] skipped: torch is not installed ({exc})")
        return []
    from dualtrack.runtime.gpu import GpuTensor

    be = engine.backend
    torch.backends.cudnn.benchmark = True
    clock = LayerClock(torch, be, args.layer_launches, args.layer_reps)
    rng = np.random.default_rng(1)
    out: list[dict[str, Any]] = []
    track_a = [(seg, c) for seg in engine.plan.segments if seg.track == "A" for c in seg.calls]
    calls = [(seg, c) for seg, c in track_a if c.op == "conv3x3"]
    if not track_a:
        print("[layers] the dualtrack bundle has no Track A kernel calls")
        return []
    for seg, c in calls:
        specs = {t.name: t for t in (*seg.inputs, *seg.tensors, *seg.outputs)}
        xs, ys = specs[c.inputs[0]], specs[c.outputs[0]]
        dtype = np.dtype(xs.dtype)
        wname = c.weights[0]
        label = wname.removesuffix(".weight")
        for b in batches:
            if b not in engine.batch_sizes:
                continue
            n, h, w, ch = _nhwc(xs, b)
            k = _nhwc(ys, b)[3]
            x = np.abs(rng.standard_normal((n, h, w, ch))).astype(dtype)
            dx = be.from_host(x)
            ybuf = be.pool.alloc(n * h * w * k * dtype.itemsize, be.stream)
            # What the engine launches for this layer and batch (CudaBackend.prepare: the wgmma kernel
            # on sm_90a where it takes the layer, else the tuned or heuristic mma.sync entry), on dense
            # buffers; where that is the wgmma kernel, the mma.sync kernel it displaced is timed too.
            tensors = {
                c.inputs[0]: GpuTensor(dx.ptr, (n, h, w, ch), dtype, dx),
                c.outputs[0]: GpuTensor(int(ybuf), (n, h, w, k), dtype, ybuf),
            }
            launch = be.prepare(c, tensors)
            displaced = be.prepare(c, tensors, allow_wgmma=False) if launch.choice.impl == "wgmma" else None

            def ours(launch: Any = launch) -> None:
                launch(be.stream)

            wt = torch.from_numpy(engine.bundle.weights[wname]).cuda().contiguous(memory_format=torch.channels_last)
            bt = torch.from_numpy(engine.bundle.weights[c.weights[1]]).cuda() if len(c.weights) > 1 else None
            xt = torch.from_numpy(x).cuda().permute(0, 3, 1, 2)  # NHWC memory = channels_last NCHW view

            def cudnn(xt: Any = xt, wt: Any = wt) -> None:
                torch.nn.functional.conv2d(xt, wt, None, padding=1)

            # Correctness of the launches first (bias and ReLU fused in ours, as the plan runs it).
            want = torch.nn.functional.conv2d(xt, wt, bt, padding=1)
            if c.attr("relu"):
                want = torch.relu(want)
            want_nhwc = want.permute(0, 2, 3, 1).float().cpu().numpy()
            errs = {}
            for what, prepared in (("ours", launch), ("displaced", displaced)):
                if prepared is not None:
                    prepared(be.stream)
                    errs[what] = rel_l2(want_nhwc, be.to_host(GpuTensor(int(ybuf), (n, h, w, k), dtype, ybuf)))
            err = errs["ours"]

            # Warm up (cuDNN benchmark picks its algorithm here) and size the sleep from host enqueue time.
            sleep_ms = clock.size_sleep(ours, cudnn)
            ms_ours, enq_ours = clock.queued_ours(ours, sleep_ms)
            ms_cudnn, enq_cudnn = clock.queued_torch(cudnn, sleep_ms)
            ms_displaced = None
            if displaced is not None:
                for _ in range(3):
                    displaced(be.stream)
                ms_displaced, _ = clock.queued_ours(lambda d=displaced: d(be.stream), sleep_ms)
            launch_bound = max(enq_ours, enq_cudnn) >= sleep_ms
            flops = 2.0 * n * h * w * ch * k * 9
            t_ours, t_cudnn = flops / (ms_ours * 1e9), flops / (ms_cudnn * 1e9)
            row = {
                "op": "conv3x3",
                "layer": label,
                "segment": seg.name,
                "batch": b,
                "N": n,
                "H": h,
                "W": w,
                "C": ch,
                "K": k,
                "impl": launch.choice.impl,
                "entry": launch.entry,
                "choice_reason": launch.choice.reason,
                "ours_ms": _r(ms_ours, 5),
                "ours_tflops": _r(t_ours, 2),
                "cudnn_ms": _r(ms_cudnn, 5),
                "cudnn_tflops": _r(t_cudnn, 2),
                "ratio": _r(t_ours / t_cudnn, 3),
                "meets_target": t_ours / t_cudnn >= LAYER_TARGET,
                "rel_l2_vs_cudnn": _r(err, 6),
                "launch_bound_warning": launch_bound,
                "grid": list(launch.config.grid),
                "block": list(launch.config.block),
                "shared_bytes": launch.config.shared_bytes,
            }
            if displaced is not None:
                row.update(
                    mma_sync_entry=displaced.entry,
                    mma_sync_ms=_r(ms_displaced, 5),
                    mma_sync_rel_l2_vs_cudnn=_r(errs["displaced"], 6),
                    speedup_vs_mma_sync=_r(ms_displaced / ms_ours, 3),
                )
            out.append(row)
            alt = f", mma.sync {ms_displaced * 1e3:.1f} us" if ms_displaced is not None else ""
            print(
                f"[layers] {label} N={b} {h}x{w} {ch}->{k} [{launch.choice.impl} {launch.entry}]: "
                f"ours {ms_ours * 1e3:.1f} us {t_ours:.1f} TFLOP/s, cuDNN {ms_cudnn * 1e3:.1f} us "
                f"{t_cudnn:.1f} TFLOP/s, ratio {t_ours / t_cudnn:.2f}{alt}, "
                f"rel L2 {err:.1e}{' (LAUNCH-BOUND: sleep too short)' if launch_bound else ''}"
            )
            del dx, ybuf, xt, wt, bt, want
    for seg, c in track_a:
        if c.op not in MEMORY_OPS:
            continue
        for b in batches:
            if b not in engine.batch_sizes:
                continue
            try:  # a failure here must not cost the conv rows above
                out.append(_bench_memory_layer(engine, clock, torch, seg, c, b, rng))
            except Exception:
                traceback.print_exc()
                print(f"[layers] {layer_label(c)} N={b} failed (traceback above)")
    be.stream.synchronize()
    return out


def _bench_memory_layer(
    engine: Any, clock: LayerClock, torch: Any, seg: Any, c: Any, b: int, rng: np.random.Generator
) -> dict[str, Any]:
    """One maxpool2x2 or convt2x2 call at batch ``b``: the kernel the engine launches, on buffers laid
    out as the plan lays them out (a pool reading, or a convt writing, a channel slice of a concat
    buffer: ldx / ldy > C / K), against PyTorch on dense channels_last tensors of the same shapes."""
    be = engine.backend
    F = torch.nn.functional
    specs = {t.name: t for t in (*seg.inputs, *seg.tensors, *seg.outputs)}
    xname, yname = c.inputs[0], c.outputs[0]
    n, h, w, ch = _nhwc(specs[xname], b)
    k = _nhwc(specs[yname], b)[3]
    dtype = np.dtype(specs[xname].dtype)
    x = np.abs(rng.standard_normal((n, h, w, ch))).astype(dtype)
    env = plan_views(be, seg, b, (xname, yname), {xname: x})
    launch = be.prepare(c, env)
    xt = torch.from_numpy(x).cuda().permute(0, 3, 1, 2)  # NHWC memory = channels_last NCHW view
    if c.op == "maxpool2x2":

        def theirs() -> Any:
            return F.max_pool2d(xt, 2, 2)

    else:  # weights as ONNX stores them, (C, K, 2, 2): what conv_transpose2d takes
        wt = torch.from_numpy(engine.bundle.weights[c.weights[0]]).cuda().contiguous(memory_format=torch.channels_last)
        bt = torch.from_numpy(engine.bundle.weights[c.weights[1]]).cuda() if len(c.weights) > 1 else None

        def theirs() -> Any:
            return F.conv_transpose2d(xt, wt, bt, stride=2)

    def ours() -> None:
        launch(be.stream)

    ours()
    got = view_to_host(be, env[yname])
    err = rel_l2(theirs().permute(0, 2, 3, 1).float().cpu().numpy(), got)
    sleep_ms = clock.size_sleep(ours, theirs)
    ms_ours, enq_ours = clock.queued_ours(ours, sleep_ms)
    ms_torch, enq_torch = clock.queued_torch(theirs, sleep_ms)
    launch_bound = max(enq_ours, enq_torch) >= sleep_ms
    nbytes = layer_bytes(c.op, n, h, w, ch, k, dtype.itemsize)
    row = {
        "op": c.op,
        "layer": layer_label(c),
        "segment": seg.name,
        "batch": b,
        "N": n,
        "H": h,
        "W": w,
        "C": ch,
        "K": k,
        "ldx": env[xname].channel_stride,
        "ldy": env[yname].channel_stride,
        "entry": launch.entry,
        "bytes": nbytes,
        "ours_ms": _r(ms_ours, 5),
        "ours_gbps": _r(nbytes / (ms_ours * 1e6), 1),
        "torch_ms": _r(ms_torch, 5),
        "torch_gbps": _r(nbytes / (ms_torch * 1e6), 1),
        "ratio": _r(ms_torch / ms_ours, 3),
        "rel_l2_vs_torch": _r(err, 6),
        "launch_bound_warning": launch_bound,
        "grid": list(launch.config.grid),
        "block": list(launch.config.block),
        "shared_bytes": launch.config.shared_bytes,
    }
    print(
        f"[layers] {row['layer']} N={b} {h}x{w} {ch}->{k} ld {row['ldx']}/{row['ldy']} [{launch.entry}]: "
        f"ours {ms_ours * 1e3:.1f} us {row['ours_gbps']:.0f} GB/s, torch {ms_torch * 1e3:.1f} us "
        f"{row['torch_gbps']:.0f} GB/s, ratio {row['ratio']:.2f}, rel L2 {err:.1e}"
        f"{' (LAUNCH-BOUND: sleep too short)' if launch_bound else ''}"
    )
    return row


# -- Track A: its kernels one by one against the CUDA graph ------------------------------------------


def bench_track_a(engine: Any, graph_ms: dict[int, float], args: argparse.Namespace) -> dict[str, Any]:
    """Per batch size in ``graph_ms``: every Track A kernel of the plan run one by one, against
    ``graph_ms[b]``, the dualtrack row's Track A time (CUDA events around the input copy and the
    graph launch). The difference is what the graph run adds: launch gaps and tails."""
    try:
        import torch
    except ImportError as exc:
        print(f"[track A] skipped: torch is not installed ({exc})")
        return {}
    clock = LayerClock(torch, engine.backend, args.layer_launches, args.layer_reps)
    rng = np.random.default_rng(2)
    return {str(b): _track_a_at(engine, clock, b, graph, rng) for b, graph in sorted(graph_ms.items())}


def _track_a_at(engine: Any, clock: LayerClock, b: int, graph_ms: float, rng: np.random.Generator) -> dict[str, Any]:
    """The Track A segments' kernels at batch ``b`` (with CUDA graphs on, first the copy of each
    segment input into the graph's fixed buffer, which the Track A time includes), on buffers laid
    out as the plan lays them out, all queued behind a GPU sleep with a CUDA event between
    consecutive launches (so each kernel sits between a pair); median ms of each over
    --layer-reps runs."""
    from cuda.bindings import driver as cu

    from dualtrack.contract.plan import ALIAS_OPS
    from dualtrack.runtime.driver import Event, call

    be = engine.backend
    steps: list[tuple[dict[str, str], Callable[[], None]]] = []
    keep: list[Any] = []  # buffers the steps use
    for seg in (s for s in engine.plan.segments if s.track == "A"):
        names = tuple(t.name for t in (*seg.inputs, *seg.tensors, *seg.outputs))
        data = {t.name: np.abs(rng.standard_normal(_nhwc(t, b))).astype(t.dtype) for t in seg.inputs}
        env = plan_views(be, seg, b, names, data)
        keep.append(env)
        if be.use_graphs:
            for t in seg.inputs:
                src, dst = env[t.name], be.pool.alloc(env[t.name].nbytes, be.stream)
                keep.append(dst)

                def copy(d: Any = dst, s: Any = src) -> None:
                    call(cu.cuMemcpyDtoDAsync, int(d), s.ptr, s.nbytes, be.stream.handle)

                steps.append(({"segment": seg.name, "op": "copy", "name": f"in {t.name}", "kernel": "DtoD"}, copy))
        for c in seg.calls:
            if c.op not in ALIAS_OPS:
                launch = be.prepare(c, env)
                info = {"segment": seg.name, "op": c.op, "name": layer_label(c), "kernel": launch.entry}
                steps.append((info, lambda la=launch: la(be.stream)))
    events = [Event(be.ctx) for _ in range(len(steps) + 1)]

    def run_all() -> float:
        """Enqueue every step; the host ms that took."""
        t0 = time.perf_counter()
        events[0].record(be.stream)
        for i, (_, fn) in enumerate(steps):
            fn()
            events[i + 1].record(be.stream)
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        run_all()
    be.stream.synchronize()
    sleep_ms = 2.0 * run_all() + 0.2
    be.stream.synchronize()
    per: list[list[float]] = [[] for _ in steps]
    worst = 0.0
    for _ in range(clock.reps):
        clock.sleep_ours(sleep_ms)
        worst = max(worst, run_all())
        for i, ms in enumerate(per):
            ms.append(events[i].elapsed_ms(events[i + 1]))
    be.stream.synchronize()
    calls = [{**info, "ms": _r(statistics.median(ms), 5)} for (info, _), ms in zip(steps, per, strict=True)]
    return {
        **summarize_breakdown(calls, graph_ms),
        "cuda_graph": be.use_graphs,
        "launch_bound_warning": worst >= sleep_ms,
        "calls": calls,
    }


# -- report -----------------------------------------------------------------------------------------


def add_ratios(rows: list[dict[str, Any]]) -> None:
    base = {r["batch"]: r["median_ms"] for r in rows if r["name"] == BASELINE and r.get("median_ms")}
    for r in rows:
        ms = r.get("median_ms")
        r["floor_ms"] = _r(floor_ms(r["batch"]))
        r["ratio_to_" + BASELINE] = _r(ms / base[r["batch"]], 3) if ms and r["batch"] in base else None
        r["ratio_to_floor"] = _r(ms / floor_ms(r["batch"]), 2) if ms else None


def summarize_breakdown(calls: list[dict[str, Any]], graph_ms: float) -> dict[str, Any]:
    """The Track A breakdown's totals: the one-by-one times summed (per op too), the graph's time
    for the same work and the difference (launch gaps and tails inside the graph)."""
    by_op: dict[str, float] = {}
    for c in calls:
        by_op[c["op"]] = by_op.get(c["op"], 0.0) + c["ms"]
    total = sum(by_op.values())
    return {
        "kernel_sum_ms": _r(total),
        "by_op_ms": {op: _r(ms) for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "graph_ms": _r(graph_ms),
        "gap_ms": _r(graph_ms - total),
    }


def breakdown_lines(breakdown: dict[str, dict[str, Any]], top: int = 5) -> list[str]:
    """Two lines a batch size: totals, then the ``top`` slowest calls."""
    if not breakdown:
        return []
    lines = ["\nTrack A: its calls one by one (CUDA events, launches queued) vs the graph (dualtrack's track A time)"]
    for b, bd in sorted(breakdown.items(), key=lambda kv: int(kv[0])):
        ops = ", ".join(f"{op} {ms:.3f}" for op, ms in bd["by_op_ms"].items())
        share = bd["gap_ms"] / bd["graph_ms"] if bd["graph_ms"] else 0.0
        warn = " (LAUNCH-BOUND: sleep too short)" if bd.get("launch_bound_warning") else ""
        lines.append(
            f"N={b}: sum {bd['kernel_sum_ms']:.3f} ms ({ops}), graph {bd['graph_ms']:.3f} ms, "
            f"gap {bd['gap_ms']:.3f} ms ({share:.0%}){warn}"
        )
        slowest = sorted(bd["calls"], key=lambda c: -c["ms"])[:top]
        lines.append("  top: " + ", ".join(f"{c['name']} {c['ms'] * 1e3:.1f} us" for c in slowest))
    return lines


def memory_layer_lines(layers: list[dict[str, Any]]) -> list[str]:
    """The maxpool2x2 / convt2x2 rows of ``layers`` as a table, with a sum per batch size."""
    mem = [r for r in layers if r.get("op") in MEMORY_OPS]
    if not mem:
        return []
    lines = [
        "\nTrack A maxpool2x2 / convt2x2 vs PyTorch (channels_last fp16; ours on the plan's buffers, "
        "ldx/ldy > C/K: a concat's channel slice; torch on dense tensors, convt with bias)",
        f"{'layer':<12} {'N':>2} {'HxW':>9} {'C->K':>9} {'ldx/ldy':>9} {'ours us':>9} {'GB/s':>6} "
        f"{'torch us':>9} {'GB/s':>6} {'ratio':>6} {'rel L2':>8}",
    ]
    for r in mem:
        lines.append(
            f"{r['layer']:<12} {r['batch']:>2} {r['H']:>4}x{r['W']:<4} {r['C']:>4}->{r['K']:<4} "
            f"{str(r['ldx']) + '/' + str(r['ldy']):>9} {r['ours_ms'] * 1e3:>9.1f} {r['ours_gbps']:>6.0f} "
            f"{r['torch_ms'] * 1e3:>9.1f} {r['torch_gbps']:>6.0f} {r['ratio']:>6.2f} {r['rel_l2_vs_torch']:>8.1e}"
            + ("  LAUNCH-BOUND" if r.get("launch_bound_warning") else "")
        )
    for b in sorted({r["batch"] for r in mem}):
        rows_b = [r for r in mem if r["batch"] == b]
        ours, theirs = sum(r["ours_ms"] for r in rows_b), sum(r["torch_ms"] for r in rows_b)
        lines.append(f"sum N={b}: ours {ours:.3f} ms, torch {theirs:.3f} ms")
    return lines


def print_table(
    rows: list[dict[str, Any]], layers: list[dict[str, Any]], breakdown: dict[str, dict[str, Any]] | None = None
) -> None:
    # Result files from before the "op" key hold conv3x3 rows only.
    conv = [r for r in layers if r.get("op", "conv3x3") == "conv3x3"]
    if conv:
        print(
            f"\nTrack A conv3x3 vs cuDNN (channels_last fp16; ours with bias+ReLU fused, cuDNN conv alone), "
            f"target ratio >= {LAYER_TARGET:.2f}"
        )
        print(
            f"{'layer':<12} {'N':>2} {'HxW':>9} {'C->K':>9} {'kernel':<26} {'ours us':>9} {'TFLOP/s':>8} "
            f"{'cuDNN us':>9} {'TFLOP/s':>8} {'ratio':>6} {'mma.sync us':>11}  ok"
        )
        for r in conv:
            kernel = (
                f"{r.get('impl', '')} {r.get('entry', '').removeprefix('conv3x3_wgmma_').removeprefix('conv3x3_nhwc_')}"
            )
            mma = f"{r['mma_sync_ms'] * 1e3:>11.1f}" if r.get("mma_sync_ms") is not None else f"{'-':>11}"
            print(
                f"{r['layer']:<12} {r['batch']:>2} {r['H']:>4}x{r['W']:<4} {r['C']:>4}->{r['K']:<4} {kernel:<26} "
                f"{r['ours_ms'] * 1e3:>9.1f} {r['ours_tflops']:>8.1f} {r['cudnn_ms'] * 1e3:>9.1f} "
                f"{r['cudnn_tflops']:>8.1f} {r['ratio']:>6.2f} {mma}  {'yes' if r['meets_target'] else 'NO'}"
            )
        for b in sorted({r["batch"] for r in conv}):
            rows_b = [r for r in conv if r["batch"] == b]
            ours, cudnn = sum(r["ours_ms"] for r in rows_b), sum(r["cudnn_ms"] for r in rows_b)
            mma = sum(r.get("mma_sync_ms") or r["ours_ms"] for r in rows_b)
            print(f"sum N={b}: ours {ours:.3f} ms, cuDNN {cudnn:.3f} ms, all on mma.sync {mma:.3f} ms")
        print(f"{sum(r['meets_target'] for r in conv)} of {len(conv)} layer/batch pairs meet the target")
    for line in memory_layer_lines(layers):
        print(line)
    print("\nmedian ms: host wall time of one synchronous call (perf_counter; the GPU idle before, drained after),")
    print("the only clock for dualtrack rows (IREE runs on its own streams); event ms: CUDA events, torch rows only.")
    print(f"{'name':<26} {'batch':>5} {'median ms':>10} {'event ms':>9} {'x ' + BASELINE:>27} {'x floor':>8}")
    for r in rows:
        if r.get("median_ms") is None:
            print(f"{r['name']:<26} {r['batch']:>5} {'-':>10} {'':>9} {'':>27} {'':>8}  {r.get('skipped', '')}")
            continue
        ev = f"{r['median_event_ms']:.3f}" if r.get("median_event_ms") is not None else "-"
        ratio = r["ratio_to_" + BASELINE]
        print(
            f"{r['name']:<26} {r['batch']:>5} {r['median_ms']:>10.3f} {ev:>9} "
            f"{(f'{ratio:.2f}' if ratio is not None else '-'):>27} {r['ratio_to_floor']:>8.1f}"
        )
    for r in rows:
        if r.get("tracks_ms"):
            segs = ", ".join(f"{k} {v:.3f}" for k, v in r["segments_ms"].items())
            print(
                f"{r['name']} N={r['batch']}: track A {r['tracks_ms']['A']:.3f} ms, "
                f"track B {r['tracks_ms']['B']:.3f} ms; segments (host ms) {segs}"
            )
    for b in sorted({r["batch"] for r in rows}):
        print(f"floor N={b}: {floor_ms(b):.3f} ms ({GFLOP_PER_IMAGE} GFLOP/image at {FLOOR_TFLOPS:.0f} TFLOP/s)")
    for line in breakdown_lines(breakdown or {}):
        print(line)


def write_chart(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"chart skipped: matplotlib is not installed ({exc})")
        return False
    batches = sorted({r["batch"] for r in rows})
    names = [n for n in ROWS if any(r["name"] == n and r.get("median_ms") for r in rows)]
    if not names:
        return False
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for i, name in enumerate(names):
        ms = {r["batch"]: r["median_ms"] for r in rows if r["name"] == name and r.get("median_ms")}
        xs = [j + (i - (len(names) - 1) / 2) * width for j, b in enumerate(batches) if b in ms]
        ys = [ms[b] for b in batches if b in ms]
        bars = ax.bar(xs, ys, width * 0.95, label=name, color=f"C{ROWS.index(name)}")  # stable colour per row
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, rotation=90, padding=2)
    for j, b in enumerate(batches):
        ax.hlines(
            floor_ms(b), j - 0.45, j + 0.45, colors="k", linestyles="dashed", label="compute floor" if j == 0 else None
        )
    ax.set_yscale("log")
    top = max(r["median_ms"] for r in rows if r.get("median_ms"))
    ax.set_ylim(top=top * 5)  # room for the value labels
    ax.set_xticks(range(len(batches)), [f"N={b}" for b in batches])
    ax.set_ylabel("median ms per call (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--bundle", type=Path, default=Path("build/unet"), help="bundle of configs/unet.yaml (row dualtrack)"
    )
    p.add_argument(
        "--seed-split-bundle",
        type=Path,
        default=Path("build/unet_seed_split"),
        help="bundle of configs/unet_seed_split.yaml (row dualtrack_seed_split); skipped if missing",
    )
    p.add_argument(
        "--iree-only-bundle",
        type=Path,
        default=Path("build/iree_only"),
        help="bundle of configs/iree_only.yaml (row iree_only); skipped if missing",
    )
    p.add_argument(
        "--head-b-bundle",
        type=Path,
        default=Path("build/unet_head_b"),
        help="bundle of configs/unet_head_b.yaml (row dualtrack_head_b); skipped if missing",
    )
    p.add_argument(
        "--sizes-bundle",
        type=Path,
        default=Path("build/unet_sizes"),
        help="bundle of configs/unet_sizes.yaml (rows <HxW>/dualtrack_api); skipped if missing",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--iters", type=int, default=100, help="timed calls per row and batch (median reported)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--input-sets", type=int, default=4, help="distinct inputs the timed calls rotate among")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--skip-torch-compile", action="store_true", help="no torch.compile rows")
    p.add_argument(
        "--skip-autotune",
        action="store_true",
        help='torch_compile in mode "default" instead of "max-autotune-no-cudagraphs" (minutes saved)',
    )
    p.add_argument(
        "--layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time each Track A conv3x3 alone against cuDNN, maxpool2x2 / convt2x2 against PyTorch (default: on)",
    )
    p.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the Track A kernels one by one against the CUDA graph's Track A time (default: on)",
    )
    p.add_argument("--layer-launches", type=int, default=20, help="launches queued per timed rep (layers)")
    p.add_argument("--layer-reps", type=int, default=10, help="timed reps per layer (median reported)")
    p.add_argument("--commit", default=None, help="commit id for the result file (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.input_sets < 1 or min(args.batches) < 1:
        p.error("--iters, --input-sets and --batches must be positive, --warmup >= 0")
    args.batches = sorted(set(args.batches))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if importlib.util.find_spec("dualtrack") is None:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(ROOT / "pipeline"))
    from dualtrack.compiler.reference import sample_image

    t_start = time.perf_counter()
    commit = args.commit or _git("rev-parse", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    gpu, driver = gpu_and_driver()
    print(f"{gpu}, driver {driver}, commit {commit[:10]}{' (dirty tree)' if dirty else ''}")

    # The weights: the first bundle given that exists; every other row must be built from the same model.
    paths = {name: getattr(args, dest) for name, (dest, _) in BUNDLE_ROWS.items()}
    present = [p for p in paths.values() if p is not None and (p / "model.onnx").is_file()]
    if not present:
        sys.exit(f"no bundle found among {[str(p) for p in paths.values()]}: build one with `make build`")
    model_path = present[0] / "model.onnx"
    manifest = json.loads((present[0] / "manifest.json").read_text())
    weights = load_weights(model_path)
    h, w = (int(d) for d in manifest["plan"]["inputs"][0]["shape"][1:3])
    gflop = model_gflop(weights, h, w)
    note = (
        ""
        if abs(gflop - GFLOP_PER_IMAGE) < 0.01 * GFLOP_PER_IMAGE
        else f" (FACTS says {GFLOP_PER_IMAGE}: floor uses FACTS)"
    )
    print(f"model {model_path}: {h}x{w}, {gflop:.1f} GFLOP per image{note}")
    sample = sample_image(h, w)[None]
    t0 = time.perf_counter()
    ref = ort_probs(model_path, sample)
    print(f"onnxruntime reference probs at N=1: {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    ctx: dict[str, Any] = {
        "args": args,
        "weights": weights,
        "model_path": model_path,
        "sample": sample,
        "ref_probs": ref,
        "source_sha256": manifest.get("model", {}).get("source_sha256"),
        "inputs": {
            b: [rng.integers(0, 256, (b, h, w, 3), dtype=np.uint8) for _ in range(args.input_sets)]
            for b in args.batches
        },
    }

    rows: list[dict[str, Any]] = []
    for name in BUNDLE_ROWS:
        rows += guarded(name, args.batches, lambda n=name: bench_bundle(n, paths[n], ctx))
    rows += torch_rows(ctx)
    sized = size_rows(ctx)  # their own list: other sizes than the floor and the ratios of `rows` are for
    layers: list[dict[str, Any]] = ctx.get("layers", [])
    breakdown: dict[str, Any] = ctx.get("track_a_breakdown", {})
    rows.sort(key=lambda r: (r["batch"], ROWS.index(r["name"])))
    add_ratios(rows)

    result = {
        "gpu": gpu,
        "driver": driver,
        "commit": commit,
        "dirty": dirty,
        "torch": ctx.get("torch"),
        "model": str(model_path),
        "model_gflop_per_image": round(gflop, 2),
        "floor": {"gflop_per_image": GFLOP_PER_IMAGE, "tflops": FLOOR_TFLOPS},
        "iters": args.iters,
        "warmup": args.warmup,
        "input_sets": args.input_sets,
        "skip_autotune": args.skip_autotune,
        "check_rel_l2_limit": CHECK_REL_L2,
        "rows": rows,
        "sizes": sized,
        "layers": layers,
        "layer_target_ratio": LAYER_TARGET,
        "track_a_breakdown": breakdown,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench-{commit[:10]}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print_table(rows, layers, breakdown)
    for r in sized:
        print(
            f"{r['name']:<40} N={r['batch']}: "
            + (f"{r['median_ms']:.3f} ms" if r.get("median_ms") else r.get("skipped", ""))
        )
    title = f"{gpu}, driver {driver}, commit {commit[:10]}: U-Net fp16 {h}x{w}, median ms (log), dashed: compute floor"
    charted = write_chart(rows, stem.with_suffix(".png"), title)
    print(f"wrote {stem.with_suffix('.json')}" + (f" and {stem.with_suffix('.png')}" if charted else ""))
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
