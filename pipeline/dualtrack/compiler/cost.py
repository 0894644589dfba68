"""What a plan costs: the estimates `partition: auto` minimises (`dualtrack.compiler.partition.assign_tracks`).

A plan's estimated time is the sum of its nodes' times, each on the track it runs on, plus one
switch cost for every boundary between two segments, at every batch size being built (each batch
size weighs the same). Times are in microseconds per call.

**A track switch** is what the runtime pays where one track hands over to the other, and that
depends on the path Track B takes (:data:`SWITCH_COST_US`). By default (`DUALTRACK_TRACK_B=replay`)
each Track B module's dispatches replay on the engine's stream, and when all of them do the whole
inference is one CUDA graph (FACTS 23): a switch is one more kernel boundary in that graph. Through
the IREE runtime (`DUALTRACK_TRACK_B=iree`, or a module whose replay the build refused) each Track B
segment is one synchronous IREE call, ~80 us on the H200 (FACTS 9; `docs/performance.md` measured
0.10-0.15 ms of host time per call inside the reference U-Net), and each A -> B hand-over a host wait
(FACTS 8), so an island inside Track B costs two such switches. The plan is made before IREE
compiles, so it takes the default path's cost; `partition.switch_cost_us` overrides it (80 for a
bundle served through the IREE runtime).

**A node's time** on a track is, where a `dualtrack tune` file has a record for its launch shape on
the build's first target, the measured kernel time (Track A conv3x3 only: what the tile records
hold; Track B records time whole segments, which cannot be split into nodes). Otherwise a roofline:
``max(FLOPs / rate, bytes / bandwidth) + launch`` with the numbers of :data:`DEFAULT_RATES`, measured
on the H200 (`bench/results/bench-962eac1199.json`, `bench/results/conv_layers-6097e87.json` and the
Track B records of `configs/tuning/h200.json`; each number's source is next to it). Track A has one
roofline per kind of kernel (:meth:`Rates.track_a_for`): the fixed-shape tensor-core kernels
(conv3x3, conv1x1, convt2x2; maxpool2x2 by its bytes), the general conv (any kernel size and stride:
its FLOPs count every tap of every output pixel, so the stride is in them), and the SIMT kernels of
the mobile ops (dwconv, gap, fc, eltwise, resize) and of the general max-pool (one comparison per
tap), whose few FLOPs per byte leave them bytes-bound.
A Track A node with no kernel of its own (an Add or activation fused into its Conv, a Concat
realised as channel slices) costs nothing there. The numbers are the H200's; on another GPU they
are a guess of the right order, which is all an island decision needs (an island moves when its
saving is below the switches it costs, and Track A's convolutions are ~10x IREE's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

# us per track switch, by Track B's runtime path (settings.Settings.track_b).
SWITCH_COST_US = {
    # One CUDA graph: Track A's graph shows no measurable gap between its kernels (kernel sum 0.485 ms,
    # graph 0.468 ms at N=1, bench-962eac1199), so this charges one launch (Rates.track_a) per switch,
    # enough that of two plans that cost the same the one with fewer segments wins.
    "replay": 3.0,
    "iree": 80.0,  # FACTS 9: one synchronous IREE call on device-resident data, H200
}
DEFAULT_PATH = "replay"  # the runtime's default (DUALTRACK_TRACK_B)

# Launch shape of a Track A conv3x3 call -> measured time (ms): (N, H, W, C, K, dtype), NHWC, dense.
ConvKey = tuple[int, int, int, int, int, str]
MeasuredTimes = Mapping[ConvKey, float]


# The Track A kernels on the CUDA cores, memory-bound (Rates.track_a_simt): the mobile ops', the
# general max-pool's (one comparison per tap, node_work) and the segmentation head's.
SIMT_KERNELS = ("dwconv", "gap", "fc", "eltwise", "resize", "maxpool", "seghead")


@dataclass(frozen=True)
class TrackRates:
    """One track's roofline: sustained TFLOP/s on convolutions, effective TB/s, overhead per node (us)."""

    tflops: float
    tbps: float
    launch_us: float

    def time_us(self, flops: float, nbytes: float) -> float:
        return max(flops / (self.tflops * 1e6), nbytes / (self.tbps * 1e6)) + self.launch_us


@dataclass(frozen=True)
class Rates:
    """The default model's numbers, one roofline per track."""

    # Track A, bench-962eac1199 at N=1: the 18 conv3x3 launches of the reference U-Net, 92.3 GFLOP
    # in 0.310 ms (297 TFLOP/s; 426 at N=8); the 2x2 max-pools move 39 MB in 0.016 ms (2.5 TB/s);
    # the smallest kernels (a max-pool at 64x64) take ~5 us, of which ~3 us is the launch in a graph.
    track_a: TrackRates = TrackRates(tflops=300.0, tbps=2.5, launch_us=3.0)
    # The general conv (`conv`), conv_layers-6097e87 at N=8 (smp Unet-resnet34's layers, fp16): the
    # 3x3 layers of 64..512 channels run 100-230 TFLOP/s, ~140 typical; the 7x7/2 stem on 3 channels
    # 23 (its GEMM's reduction, 147 taps, is short for the tile). Its N=1 rows time single launches
    # from the host (~35 us each, cuDNN's too), so the launch is Track A's in a graph.
    track_a_conv: TrackRates = TrackRates(tflops=140.0, tbps=2.5, launch_us=3.0)
    # The mobile ops' SIMT kernels (dwconv, gap, fc, eltwise, resize): fp32 math on the CUDA cores
    # (the H200's 67 TFLOP/s peak, half of it sustained) and the max-pool's 2.5 TB/s, the other
    # memory-bound Track A kernel; a depthwise 3x3 does ~4.5 FLOPs a byte in fp16, under the ridge.
    track_a_simt: TrackRates = TrackRates(tflops=33.0, tbps=2.5, launch_us=3.0)
    # Track B (IREE 3.13 with configs/unet.yaml's flags): the reference U-Net alone runs 8 x 96.6
    # GFLOP in 18.6 ms (FACTS 11b: 41 TFLOP/s); the pre- and post-processing segments of its plan
    # take ~0.05 ms at N=1 for 4-5 nodes (configs/tuning/h200.json: ~10 us each). 1 TB/s puts the
    # model's estimate of IREE alone on that U-Net at 3.42 / 23.3 ms (N=1 / N=8) against the
    # measured 3.26 / 18.8 ms (bench-962eac1199's `iree_only` rows): within 25%, on the slow side.
    track_b: TrackRates = TrackRates(tflops=41.0, tbps=1.0, launch_us=10.0)

    def track_a_for(self, kernel: str | None) -> TrackRates:
        """The Track A roofline of ``kernel`` (a `KernelCall.op`; None: the fixed-shape kernels')."""
        if kernel == "conv":
            return self.track_a_conv
        if kernel in SIMT_KERNELS:
            return self.track_a_simt
        return self.track_a


DEFAULT_RATES = Rates()


@dataclass(frozen=True)
class NodeCost:
    """A node's estimated time on each track (us, summed over the batch sizes); ``a_us`` is None where
    no Track A kernel takes it. ``source`` says where the Track A number comes from."""

    a_us: float | None
    b_us: float
    source: str  # "model", "measured" or "fused" (no kernel of its own on Track A)

    def on(self, track: str) -> float:
        """The time on ``track`` ("A" or "B"); a node with no Track A kernel is never placed there."""
        if track == "B":
            return self.b_us
        if self.a_us is None:
            raise ValueError("no Track A time: no Track A kernel takes this node")
        return self.a_us


def plan_us(node_us: Iterable[float], n_segments: int, switch_us: float, n_batches: int) -> float:
    """A plan's estimated time: its nodes' times plus one switch per segment boundary and batch size."""
    return sum(node_us) + switch_us * n_batches * max(n_segments - 1, 0)


@dataclass(frozen=True)
class Work:
    """What one node computes at batch 1: FLOPs, activation bytes (scale with the batch), weight bytes."""

    flops: float
    act_bytes: float
    weight_bytes: float


def _numel(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def node_work(node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]], inits: set[str]) -> Work:
    """FLOPs and bytes of one node at batch 1, from the static shapes (``partition.infer_specs``).

    Convolutions and matrix products count 2 FLOPs per multiply-add, a max-pool one per tap; any
    other node one per output element (they are memory-bound: the bytes decide)."""
    outs = [specs[o] for o in node.output if o and o in specs]
    out_elems = sum(_numel(s) for s, _ in outs)
    act = sum(_numel(s) * _itemsize(d) for s, d in outs)
    weights = 0
    for x in node.input:
        if x and x in specs:
            size = _numel(specs[x][0]) * _itemsize(specs[x][1])
            if x in inits:
                weights += size
            else:
                act += size
    flops = float(out_elems)
    if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in specs:
        flops = 2.0 * out_elems * _numel(specs[node.input[1]][0][1:])  # (K, C/group, kh, kw)
    elif node.op_type == "ConvTranspose" and len(node.input) > 1 and node.input[1] in specs:
        flops = 2.0 * _numel(specs[node.input[0]][0]) * _numel(specs[node.input[1]][0][1:])  # (C, K/group, kh, kw)
    elif node.op_type == "MaxPool" and node.output[0] in specs:
        kernel = next((list(x.ints) for x in node.attribute if x.name == "kernel_shape"), [])
        flops = float(_numel(specs[node.output[0]][0]) * _numel(kernel))  # one comparison per tap
    elif node.op_type in ("MatMul", "Gemm") and node.input[0] in specs:
        a = specs[node.input[0]][0]
        trans_a = any(x.name == "transA" and x.i for x in node.attribute)
        inner = a[-2] if trans_a and len(a) >= 2 else a[-1] if a else 1
        flops = 2.0 * out_elems * inner
    return Work(flops, float(act), float(weights))


def head_work(specs: Mapping[str, tuple[tuple[int, ...], str]], logits: str, outputs: Sequence[str]) -> Work:
    """What the seghead kernel moves at batch 1, charged to its head's first node (the others have no
    launch of their own): the logits read once, the probabilities and the mask written once; ~10
    FLOPs a logit (softmax's max, exp, sum, divide, argmax), far under the SIMT roofline's ridge."""
    shape, dtype = specs[logits]
    nbytes = _numel(shape) * _itemsize(dtype) + sum(_numel(specs[o][0]) * _itemsize(specs[o][1]) for o in outputs)
    return Work(10.0 * _numel(shape), float(nbytes), 0.0)


def conv3x3_key(node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]], batch: int) -> ConvKey | None:
    """The launch shape a tuning record of conv3x3 is keyed by, for a 3x3 Conv at ``batch``; else None."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if node.op_type != "Conv" or list(a.get("kernel_shape", [])) != [3, 3] or node.input[0] not in specs:
        return None
    (_, c, h, w), dtype = specs[node.input[0]]
    k = specs[node.output[0]][0][1]
    return (batch, h, w, c, k, dtype)


def node_cost(
    node: onnx.NodeProto,
    specs: Mapping[str, tuple[tuple[int, ...], str]],
    inits: set[str],
    batch_sizes: Sequence[int],
    *,
    on_a: str | None,
    kernel: str | None = None,
    rates: Rates = DEFAULT_RATES,
    measured: MeasuredTimes | None = None,
    work: Work | None = None,
) -> NodeCost:
    """The node's time on each track, summed over ``batch_sizes``.

    ``on_a``: None where a Track A kernel takes the node, "fused" where it runs with no kernel of
    its own (its Track A time is 0), else the reason it cannot run there (no Track A time).
    ``kernel``: the Track A kernel it launches (`KernelCall.op`, :meth:`Rates.track_a_for`); the
    tuning file's ``measured`` times are conv3x3's, so they count for that kernel alone. ``work``:
    what its Track A kernel moves where that is not the node's own (:func:`head_work`); its Track B
    time stays the node's."""
    own = node_work(node, specs, inits)
    a_work = work or own

    def roofline(r: TrackRates, b: int, w: Work = a_work) -> float:
        return r.time_us(b * w.flops, b * w.act_bytes + w.weight_bytes)

    b_us = sum(roofline(rates.track_b, b, own) for b in batch_sizes)
    if on_a == "fused":
        return NodeCost(0.0, b_us, "fused")
    if on_a is not None:
        return NodeCost(None, b_us, "model")
    a_us, source = 0.0, "model"
    track_a = rates.track_a_for(kernel)
    for b in batch_sizes:
        key = conv3x3_key(node, specs, b) if measured and kernel == "conv3x3" else None
        if key is not None and measured is not None and key in measured:
            a_us += measured[key] * 1e3
            source = "measured"
        else:
            a_us += roofline(track_a, b)
    return NodeCost(a_us, b_us, source)
