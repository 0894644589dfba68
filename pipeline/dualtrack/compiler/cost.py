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
``max(FLOPs / rate, bytes / bandwidth) + launch`` with the numbers of the build's device class: the
rates table `compiler/rates.json` (:func:`load_rates`) has one row per class (H200, H100, the sm_120
and the sm_80 class), each saying whether it was measured (the H200's: `bench/results/bench-962eac1199.json`,
`conv_layers-6097e87.json`, the Track B records of `configs/tuning/h200.json`) or estimated from the
published peak ratios, and why; `python bench/measure_rates.py` on a GPU writes its row. The partition
takes the row of the device its first target names (:func:`rates_for_target`: ``sm_90a`` is the H200,
``h100`` the H100, ``sm_89`` the sm_80 class; ``kernels.device``). Track A has one
roofline per kind of kernel (:meth:`Rates.track_a_for`): the fixed-shape tensor-core kernels
(conv3x3, conv1x1, convt2x2; maxpool2x2 by its bytes), the general conv (any kernel size and stride:
its FLOPs count every tap of every output pixel, so the stride is in them; a launch of too few output
tiles to fill the GPU splits its deep reduction (split-K, :meth:`ConvTarget.splits`), which is what
lets a throughput roofline stand for it, and is charged its second launch), and the SIMT kernels of
the mobile ops (dwconv, gap, fc, eltwise, resize) and of the general max-pool (one comparison per
tap), whose few FLOPs per byte leave them bytes-bound; on an sm_90a target the general conv's layers
that the wgmma kernel takes (3x3 stride 1, 1x1) have the wgmma roofline (``track_a_wgmma``), and
its layers of few input channels that the stem entries take (C <= 8) the stem roofline (``track_a_stem``).
A Track A node with no kernel of its own (an Add or activation fused into its Conv, a Concat
realised as channel slices) costs nothing there. An estimated row is a guess of the right order,
which is all an island decision needs (an island moves when its saving is below the switches it
costs, and Track A's convolutions are ~10x IREE's).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from dualtrack.contract import arch
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import ConfigError
from dualtrack.kernels import KERNELS, ConvChoice, ConvGeneralSpec, ConvGeometry, conv_choice
from dualtrack.kernels.device import DeviceInfo, for_target
from dualtrack.kernels.problems import ConvProblem

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
# general max-pool's (one comparison per tap, node_work), the segmentation head's, the pad/copy's and
# DepthToSpace's; the general ConvTranspose's gather (convt) runs on the CUDA cores too.
SIMT_KERNELS = (
    "dwconv", "gap", "creduce", "fc", "eltwise", "resize", "maxpool", "seghead", "pad", "convt", "norm",
    "depth_to_space", "quantize_fp8",
)  # fmt: skip


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
    """One device class's numbers (a row of `compiler/rates.json`), one roofline per kind of kernel."""

    track_a: TrackRates  # the fixed-shape tensor-core kernels (conv3x3, conv1x1, convt2x2, maxpool2x2)
    track_a_conv: TrackRates  # the general conv (any window: its FLOPs count every tap)
    track_a_simt: TrackRates  # the mobile ops' and the max-pool's SIMT kernels, bytes-bound
    track_b: TrackRates  # IREE
    # The general conv's 3x3 and 1x1 layers that run the sm_90a wgmma kernel (ConvTarget.runs_wgmma):
    # the 3x3 wgmma's measured rate per FLOP, ASSUMED for its 1x1 entries too (the same mainloop; not
    # measured yet, rates.json's track_a_wgmma_basis). None where the row has no such kernel (sm_80,
    # sm_120): those layers keep track_a_conv.
    track_a_wgmma: TrackRates | None = None
    # conv_fp8 (the wgmma family's e4m3 rows, sm_90a): twice track_a_wgmma's rate per FLOP, wgmma's
    # e4m3 peak over its fp16 one; ASSUMED, not measured (rates.json's track_a_fp8_basis). None: no FP8.
    track_a_fp8: TrackRates | None = None
    # The general conv's stem entries (C <= 8, group 1: the RGB first layers, ConvTarget.runs_stem):
    # a conservative rate until a GPU measures them (rates.json's track_a_stem_basis). None: the row
    # has none, and those layers keep track_a_conv.
    track_a_stem: TrackRates | None = None
    device: str = "h200"  # the row's key
    status: str = "measured"  # or "estimate"
    basis: str = ""  # where the numbers come from

    def track_a_for(self, kernel: str | None) -> TrackRates:
        """The Track A roofline of ``kernel`` (a `KernelCall.op`; None: the fixed-shape kernels')."""
        # The attention kernel (mma.sync, one stage, 64x64 tiles, not yet measured) is charged as the
        # general conv's mma.sync tiles, not the fixed-shape kernels' roofline, until the throughput
        # shapes of tests/gpu/test_attention_gpu.py give it a row of its own.
        if kernel in ("conv", "attention"):
            return self.track_a_conv
        if kernel == "conv_fp8":
            return self.track_a_fp8 or self.track_a_wgmma or self.track_a_conv
        if kernel in SIMT_KERNELS:
            return self.track_a_simt
        return self.track_a

    def to_json(self) -> dict[str, Any]:
        """The row as `compiler/rates.json` holds it (what bench/measure_rates.py writes)."""
        hopper = {t: asdict(getattr(self, t)) for t in _HOPPER_TRACKS if getattr(self, t) is not None}
        hopper.update({t: asdict(getattr(self, t)) for t in _OPTIONAL_TRACKS if getattr(self, t) is not None})
        return {"status": self.status, "basis": self.basis, **{t: asdict(getattr(self, t)) for t in _TRACKS}, **hopper}


RATES_FILE = Path(__file__).with_name("rates.json")
_TRACKS = ("track_a", "track_a_conv", "track_a_simt", "track_b")
_HOPPER_TRACKS = ("track_a_wgmma", "track_a_fp8")  # optional: the rows of devices with the sm_90a kernels
_OPTIONAL_TRACKS = ("track_a_stem",)  # optional on any row


def _track(where: str, raw: Any) -> TrackRates:
    keys = ("tflops", "tbps", "launch_us")
    if not isinstance(raw, dict) or set(raw) != set(keys):
        raise ConfigError(f"{where} must have exactly {', '.join(keys)}; fix it or rerun bench/measure_rates.py")
    bad = [k for k in keys if isinstance(raw[k], bool) or not isinstance(raw[k], int | float) or raw[k] <= 0]
    if bad:
        fix = "fix it or rerun bench/measure_rates.py"
        raise ConfigError(f"{where}.{bad[0]} = {raw[bad[0]]!r} must be a positive number; {fix}")
    return TrackRates(*(float(raw[k]) for k in keys))


def parse_rates(doc: Any, origin: str = "rates.json") -> dict[str, Rates]:
    """The rows of a rates table by the device classes they cover (``covers``); ConfigError, one
    line naming the row and field, for anything else."""
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, dict) or not rows:
        raise ConfigError(f"{origin} has no 'rows' object of device classes; restore it from the package")
    out: dict[str, Rates] = {}
    for key, row in rows.items():
        where = f"{origin}: row {key!r}"
        if not isinstance(row, dict) or row.get("status") not in ("measured", "estimate"):
            raise ConfigError(f"{where} needs status 'measured' or 'estimate'")
        covers = row.get("covers", [key])
        if not isinstance(covers, list) or not all(isinstance(c, str) for c in covers):
            raise ConfigError(f"{where}: 'covers' must be a list of device classes such as 'h100' or 'sm_80'")
        tracks = [_track(f"{where} {t}", row.get(t)) for t in _TRACKS]
        for t in _HOPPER_TRACKS:
            tracks.append(None if row.get(t) is None else _track(f"{where} {t}", row[t]))
        for t in _OPTIONAL_TRACKS:
            tracks.append(None if row.get(t) is None else _track(f"{where} {t}", row[t]))
        rates = Rates(*tracks, device=key, status=row["status"], basis=str(row.get("basis", "")))
        for c in covers:
            if c in out:
                raise ConfigError(f"{where} covers {c!r}, which row {out[c].device!r} covers too; keep one")
            out[c] = rates
    return out


@functools.cache
def load_rates(path: Path = RATES_FILE) -> dict[str, Rates]:
    """:func:`parse_rates` of a rates file (default: the package's `compiler/rates.json`), read once."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the rates table {path}: {exc}; restore it from the package") from None
    return parse_rates(doc, str(path))


def rates_for(device: DeviceInfo, table: Mapping[str, Rates] | None = None) -> Rates:
    """The row of ``device``'s class (:attr:`DeviceInfo.key`); ConfigError where the table has none."""
    rows = table if table is not None else load_rates()
    if device.key not in rows:
        raise ConfigError(
            f"the rates table has no row for {device.name} ({device.key}); it has {', '.join(sorted(rows))}: "
            "run bench/measure_rates.py on that GPU, or set partition rules instead of `auto`"
        )
    return rows[device.key]


def rates_for_target(target: str | None) -> Rates:
    """The row of the device a build target names (``kernels.device.for_target``; None: the H200)."""
    return rates_for(for_target(target))


DEFAULT_RATES = rates_for(for_target(None))  # the reference H200's row


@dataclass(frozen=True)
class ConvTarget:
    """The GPU a build plans its convolutions for, as the one chooser (``kernels.conv_choice``) sees it:
    the device and whether the target's Track A image has the sm_90a wgmma kernel."""

    device: DeviceInfo
    wgmma: bool

    @classmethod
    def of(cls, target: str | None) -> ConvTarget:
        """The build's first target (None: a CPU-only build, costed as the reference H200)."""
        return cls(for_target(target), arch.resolve(target or "sm_90a").wgmma)

    def runs_wgmma(self, node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]]) -> bool:
        """Whether the chooser runs this Conv node, lowered to the general conv, on the sm_90a wgmma
        kernel (3x3 stride 1 and 1x1 layers of group 1 with channels TMA can read): what it asks does
        not depend on the batch, the activation or, for planned (aligned) buffers, the pointers."""
        if not self.wgmma:
            return False
        return self._conv_impl(node, specs) == "wgmma"

    def runs_stem(self, node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]]) -> bool:
        """Whether the chooser runs this Conv node, lowered to the general conv, on a stem entry (C <= 8)."""
        conv = KERNELS["conv"]
        return isinstance(conv, ConvGeneralSpec) and self._conv_impl(node, specs, entry=True) in conv.stem_tiles()

    def splits(self, node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]], batch: int) -> int:
        """Split-K slices of this Conv node's launch at ``batch`` (1: none, or not a conv the chooser
        takes): a split conv is two launches, the slices and their sum."""
        choice = self._choice(node, specs, batch)
        return 1 if choice is None else choice.splits

    def _conv_impl(
        self, node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]], *, entry: bool = False
    ) -> str | None:
        """The chooser's implementation (``entry``: its entry) for this Conv node at batch 1, or None."""
        choice = self._choice(node, specs, 1)
        if choice is None:
            return None
        return choice.entry if entry else choice.impl

    def _choice(
        self, node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]], batch: int
    ) -> ConvChoice | None:
        """The chooser's answer for this Conv node (lowered to the general conv) at ``batch``, or None."""
        if node.op_type != "Conv" or node.input[0] not in specs:
            return None
        (_, c, h, w), dtype = specs[node.input[0]]
        w_shape = specs[node.input[1]][0] if node.input[1] in specs else ()
        geom = _conv_window(node, w_shape)
        if geom is None or len(w_shape) != 4:
            return None
        geom = _merged(geom, dtype, c, w_shape[0])
        call = KernelCall("conv", ("x",), ("y",), ("w",), (*geom.attrs(), ("act", 0), ("residual", 0)), (node.name,))
        off = None if self.wgmma else "the target's image has no wgmma kernel"
        return conv_choice(ConvProblem.dense(batch, h, w, c, w_shape[0], dtype), self.device, call=call, wgmma_off=off)

    def runs_tuned_tile(self, key: ConvKey) -> bool:
        """Whether the chooser runs a tuned tile for this conv3x3 launch: only then does a tuning
        record's time stand for the node; where wgmma or the direct entry takes it (neither is tuned),
        the record measured a kernel that does not run."""
        n, h, w, c, k, dtype = key
        off = None if self.wgmma else "the target's image has no wgmma kernel"
        return conv_choice(ConvProblem.dense(n, h, w, c, k, dtype), self.device, wgmma_off=off).impl not in (
            "wgmma",
            "direct",
        )


def _conv_window(node: onnx.NodeProto, w_shape: Sequence[int]) -> ConvGeometry | None:
    """A 2-D Conv node's window from its attributes (None for auto_pad or a rank it is not)."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    ks = list(a.get("kernel_shape", w_shape[2:]))
    if len(ks) != 2 or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    (sh, sw), (dh, dw) = a.get("strides", (1, 1)), a.get("dilations", (1, 1))
    pads = list(a.get("pads", (0, 0, 0, 0)))
    return ConvGeometry(ks[0], ks[1], sh, sw, dh, dw, pads[0], pads[1], pads[2], pads[3], int(a.get("group", 1)))


def _merged(geom: ConvGeometry, dtype: str, c: int, k: int) -> ConvGeometry:
    """The window as the partition lowers it: the general conv's narrow groups merged."""
    conv = KERNELS["conv"]
    return conv.merged(dtype, c, k, geom) if isinstance(conv, ConvGeneralSpec) else geom


def conv_merge(node: onnx.NodeProto, specs: Mapping[str, tuple[tuple[int, ...], str]]) -> int:
    """How many ONNX groups a launched group of this Conv node holds on the general conv (1: none):
    its block-diagonal weights multiply-add that many times the node's own work."""
    if node.op_type != "Conv" or node.input[0] not in specs or node.input[1] not in specs:
        return 1
    (x_shape, dtype), w_shape = specs[node.input[0]], specs[node.input[1]][0]
    geom = _conv_window(node, w_shape)
    if geom is None or len(x_shape) != 4 or len(w_shape) != 4:
        return 1
    return _merged(geom, dtype, x_shape[1], w_shape[0]).merge


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

    Convolutions and matrix products count 2 FLOPs per multiply-add, a max- or average pool one per tap; any
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
    elif node.op_type in ("MaxPool", "AveragePool") and node.output[0] in specs:
        kernel = next((list(x.ints) for x in node.attribute if x.name == "kernel_shape"), [])
        flops = float(_numel(specs[node.output[0]][0]) * _numel(kernel))  # one comparison per tap
    elif node.op_type in ("MatMul", "Gemm") and node.input[0] in specs:
        a = specs[node.input[0]][0]
        trans_a = any(x.name == "transA" and x.i for x in node.attribute)
        inner = a[-2] if trans_a and len(a) >= 2 else a[-1] if a else 1
        flops = 2.0 * out_elems * inner
    return Work(flops, float(act), float(weights))


def norm_work(specs: Mapping[str, tuple[tuple[int, ...], str]], inputs: Sequence[str], output: str, kind: int) -> Work:
    """What a norm call moves at batch 1, charged to its chain's first node (the others have no launch
    of their own): a group norm's statistics read x once more (``kind`` 0, ``plan.NORM_KINDS``), the
    apply pass reads x (and a residual) and writes y; ~10 FLOPs an element, bytes-bound."""
    x_shape, dtype = specs[inputs[0]]
    x_bytes = _numel(x_shape) * _itemsize(dtype)
    reads = sum(_numel(specs[t][0]) * _itemsize(specs[t][1]) for t in inputs) + (x_bytes if kind == 0 else 0)
    return Work(10.0 * _numel(x_shape), float(reads + x_bytes), 0.0)


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


# Element-wise ops IREE fuses into the dispatch of the op that produces their input (its dispatch
# formation): on Track B they cost nothing of their own (no launch; their input and output are the
# producer's registers, not memory). A Track A island of a few of them (each its own launch and its
# own pass over memory) then does not look cheaper than leaving them to IREE's fusion.
IREE_FUSES = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Pow", "Erf",
        "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
        "Softplus", "Softsign", "Mish", "Gelu", "Cast", "Identity", "Min", "Max", "Where",
    }
)  # fmt: skip


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
    target: ConvTarget | None = None,
) -> NodeCost:
    """The node's time on each track, summed over ``batch_sizes``.

    ``on_a``: None where a Track A kernel takes the node, "fused" where it runs with no kernel of
    its own (its Track A time is 0), else the reason it cannot run there (no Track A time).
    ``kernel``: the Track A kernel it launches (`KernelCall.op`, :meth:`Rates.track_a_for`); the
    tuning file's ``measured`` times are conv3x3's, so they count for that kernel alone, and only where
    the chooser runs the tuned tile on ``target`` (:meth:`ConvTarget.runs_tuned_tile`). ``work``:
    what its Track A kernel moves where that is not the node's own (:func:`head_work`); its Track B
    time stays the node's."""
    own = node_work(node, specs, inits)
    a_work = work or own
    if kernel == "conv" and work is None and (m := conv_merge(node, specs)) > 1:
        a_work = replace(a_work, flops=a_work.flops * m)  # the merged groups' zeros

    def roofline(r: TrackRates, b: int, w: Work = a_work) -> float:
        return r.time_us(b * w.flops, b * w.act_bytes + w.weight_bytes)

    b_us = sum(roofline(rates.track_b, b, own) for b in batch_sizes)
    if node.op_type in IREE_FUSES:  # in the dispatch of the op before it: no launch, no bytes of its own
        b_us = 0.0
    if on_a == "fused":
        return NodeCost(0.0, b_us, "fused")
    if on_a is not None:
        return NodeCost(None, b_us, "model")
    a_us, source = 0.0, "model"
    track_a = rates.track_a_for(kernel)
    if kernel == "conv" and rates.track_a_wgmma is not None and target is not None and target.runs_wgmma(node, specs):
        track_a = rates.track_a_wgmma
    elif kernel == "conv" and rates.track_a_stem is not None and target is not None and target.runs_stem(node, specs):
        track_a = rates.track_a_stem
    for b in batch_sizes:
        key = conv3x3_key(node, specs, b) if measured and kernel == "conv3x3" else None
        if (
            key is not None
            and measured is not None
            and key in measured
            and (target is None or target.runs_tuned_tile(key))
        ):
            a_us += measured[key] * 1e3
            source = "measured"
        else:
            a_us += roofline(track_a, b)
            if kernel == "conv" and target is not None and target.splits(node, specs, b) > 1:
                a_us += track_a.launch_us  # split-K's second launch (the slices' sum and the epilogue)
    return NodeCost(a_us, b_us, source)
