"""The execution plan: an ordered list of segments, each on Track A or Track B.

The plan is what `dualtrack build` writes into `manifest.json` and what every runtime executes.
It is plain data (frozen dataclasses with a JSON form), so the CPU runtime, the GPU runtime, the
verifier and `dualtrack info` all read the same thing.

Conventions:
- Dim 0 of every tensor is the batch. ``TensorSpec.shape`` is recorded at batch 1; at batch ``n``
  the shape is ``(n, *shape[1:])``. Except in a fixed-shape plan (the config's ``batch: fixed``):
  there dim 0 is data, every spec is ``batched=False`` and its shape is exact at the plan's one batch
  size (the input's dim 0), so that a reduction or a concatenation over axis 0 keeps its own shape.
- ``layout`` is ``"NHWC"`` or ``"NCHW"`` for 4-D image tensors and ``""`` otherwise. Tensors that
  Track A produces or consumes are NHWC (the hand-written kernels work channels-last); the segment
  ONNX files take and return their boundary tensors in the recorded layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

Track = Literal["A", "B"]
# Track A ops with no kernel: buffer aliases (Segment.channel_views). A concatenation is realised by
# its producers writing into channel slices of one buffer (the kernels take a per-pixel channel
# stride); a slice (attr ``start``) is a channel slice of its input, which its consumers read with
# that stride.
ALIAS_OPS = frozenset({"concat", "slice"})
PLAN_SCHEMA_VERSION = 1

# The fused activations' ids (a call's ``act``, ``act_p0``, ``act_p1`` attrs) are the table in
# dualtrack.contract.activations.

# The eltwise call's ``op`` attr: y = act(a op b); rsub, rdiv: b - a, b / a; prelu: a < 0 ? a * b : a.
# ``b`` is its second input, of a's shape or (N, 1, 1, C) broadcast over H, W (``bcast`` 1), or, for a
# call with a weight, that constant: a (C,) vector broadcast over N, H and W (``bcast`` 2), a call's
# ``C`` attr its length (a scalar constant is broadcast to it when packed).
ELTWISE_OPS: dict[str, int] = {
    "unary": 0, "add": 1, "mul": 2, "sub": 3, "div": 4, "rsub": 5, "rdiv": 6, "prelu": 7,
}  # fmt: skip
# The maxpool call's ``mode`` attr (kernels.maxpool.PoolGeometry): ONNX MaxPool, or AveragePool with
# count_include_pad 1 or 0 (what its divisor counts: the padded window, or the taps in the image).
POOL_MODES: dict[str, int] = {"max": 0, "avg_include_pad": 1, "avg_exclude_pad": 2}
# The ``op`` attr of the reductions, creduce (over the channels of each pixel) and gap (over each image's
# H and W): the ONNX Reduce op computed, in fp32 (handwritten_ptx/dualtrack_reduce.cuh, whose enum
# tests/test_reductions.py holds to this table). A gap call without it is a mean (bundles before the table).
REDUCE_OPS: dict[str, int] = {
    "ReduceSum": 0, "ReduceMean": 1, "ReduceMax": 2, "ReduceMin": 3, "ReduceL1": 4, "ReduceL2": 5, "ReduceSumSquare": 6,
}  # fmt: skip
# The resize call's ``mode``, ``coord`` (ONNX coordinate_transformation_mode) and ``nearest`` attrs;
# ``scale_h`` / ``scale_w`` hold the float32 bits of the scale ONNX divides by.
RESIZE_MODES: dict[str, int] = {"nearest": 0, "linear": 1}
RESIZE_COORDS: dict[str, int] = {"half_pixel": 0, "pytorch_half_pixel": 1, "align_corners": 2, "asymmetric": 3}
RESIZE_NEAREST: dict[str, int] = {"floor": 0, "ceil": 1, "round_prefer_floor": 2, "round_prefer_ceil": 3}
# The pad call's ``mode`` attr (handwritten_ptx/pad_nhwc.cu); ``value`` holds the float32 bits of a
# constant pad's value, ``c0`` the input's first channel copied (a pad of zeros is a channel copy).
PAD_MODES: dict[str, int] = {"constant": 0, "reflect": 1, "edge": 2}
# The norm call's ``kind`` attr (kernels.norm): statistics per (image, group of ``groups``), per pixel
# over the channels, or per-channel constants (an unfolded BatchNormalization); ``eps`` holds float32
# bits; ``res``: where its second input, a residual, is added (none, before or after the activation).
NORM_KINDS: dict[str, int] = {"group": 0, "layer": 1, "affine": 2}
NORM_RES: dict[str, int] = {"none": 0, "before_act": 1, "after_act": 2}

# The seghead call (the segmentation head's post-processing: probabilities and class mask): its
# ``act`` attr, the fp16 roundings of its ``flags`` attr (bits), and ``thr``, the float32 bits of a
# one-class head's threshold (mask = p > thr). handwritten_ptx/seghead_nhwc.cu has the semantics.
HEAD_ACTS: dict[str, int] = {"none": 0, "softmax": 1, "sigmoid": 2}
HEAD_FLAGS: dict[str, int] = {"round_in": 1, "round_probs": 2, "round_arg": 4, "probs_f16": 8, "threshold": 16}
# Track A ops that write the model's own outputs in the model's layout (NCHW probabilities, an
# (N, H, W) mask) rather than NHWC: the only Track A calls a graph output may come from.
MODEL_LAYOUT_OPS = frozenset({"seghead"})


def f32_bits(value: float) -> int:
    """The IEEE float32 bit pattern of ``value`` as a signed int32 (how a plan attr holds a float)."""
    return int(np.array(value, np.float32).view(np.int32))


def bits_f32(bits: int) -> float:
    """Inverse of :func:`f32_bits`."""
    return float(np.array(bits, np.int32).view(np.float32))


def parameter_key(name: str) -> str:
    """The key under which a Track B module looks up the initializer ``name``.

    `iree-import-onnx --externalize-params` names each parameter after its initializer with every
    ':' replaced by '_' (its ``sanitize_name``: torch exports name weights ``onnx::Conv_546``, which
    the module asks for as ``onnx__Conv_546``). The runtime builds its parameter index with this
    rule and the front end keeps the keys unique.
    """
    return name.replace(":", "_")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor at a segment boundary (or inside a Track A segment)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float16", "float32", "uint8", "int64"
    layout: str = ""
    batched: bool = True  # False: a fixed-shape plan's tensor (module docstring), its shape exact

    def at_batch(self, n: int) -> tuple[int, ...]:
        return (n, *self.shape[1:]) if self.batched else self.shape

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TensorSpec:
        return cls(
            name=d["name"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            layout=d.get("layout", ""),
            batched=d.get("batched", True),
        )


def _without_batched(value: Any) -> Any:
    """The JSON form with ``batched: true`` left out of every spec: a batched plan (every plan an image
    model gets) is written as before fixed-shape plans existed, so its build key does not move."""
    if isinstance(value, dict):
        return {k: _without_batched(v) for k, v in value.items() if not (k == "batched" and v is True)}
    if isinstance(value, list | tuple):
        return type(value)(_without_batched(v) for v in value)
    return value


@dataclass(frozen=True)
class KernelCall:
    """One hand-written kernel launch in a Track A segment.

    ``op`` names an entry of :data:`dualtrack.kernels.KERNELS`; ``inputs``/``outputs`` are
    activation tensor names (NHWC); ``weights`` are names in the bundle's Track A weight file;
    ``attrs`` are op attributes (e.g. ``relu``); ``nodes`` are the ONNX nodes the call covers.
    """

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    attrs: tuple[tuple[str, int], ...] = ()
    nodes: tuple[str, ...] = ()

    def attr(self, name: str, default: int = 0) -> int:
        return dict(self.attrs).get(name, default)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KernelCall:
        return cls(
            op=d["op"],
            inputs=tuple(d["inputs"]),
            outputs=tuple(d["outputs"]),
            weights=tuple(d.get("weights", ())),
            attrs=tuple((k, int(v)) for k, v in d.get("attrs", ())),
            nodes=tuple(d.get("nodes", ())),
        )


def padded_channels(channels: int, dtype: str) -> int:
    """The channel stride of a Track A buffer of ``channels`` that no other track reads: whole 16-byte
    pieces for fp16 and fp32 (what TMA and the 16-byte stores need, so that a head's 2-class conv runs on
    the wgmma kernel), ``channels`` for any other dtype (uint8: the e4m3 activations, which quantize_fp8
    writes dense) and where they are whole pieces already. The runtime lays its buffers out so
    (runtime/track_a.py); a segment's inputs and outputs stay dense (IREE writes and reads them)."""
    size = {"float16": 2, "float32": 4}.get(dtype)
    if size is None or channels % (16 // size) == 0:
        return channels
    return -(-channels // (16 // size)) * (16 // size)


@dataclass(frozen=True)
class Segment:
    """A maximal run of nodes on one track, in execution order."""

    index: int
    track: Track
    nodes: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    onnx: str  # bundle-relative path of the segment's own ONNX model
    key: str = ""  # content hash of the segment ONNX + everything that changes its build
    calls: tuple[KernelCall, ...] = ()  # Track A only
    tensors: tuple[TensorSpec, ...] = ()  # Track A intermediates (NHWC), for buffer planning

    @property
    def name(self) -> str:
        return f"seg{self.index}_{self.track}"

    def buffer_widths(self) -> dict[str, int]:
        """The channel stride of every buffer the runtime lays out for this Track A segment (each root of
        :meth:`channel_views`): a segment input or output dense (IREE writes or reads it), any other
        :func:`padded_channels`."""
        dense = {t.name for t in (*self.inputs, *self.outputs)}
        return {
            t.name: t.shape[-1] if t.name in dense else padded_channels(t.shape[-1], t.dtype)
            for t in (*self.inputs, *self.tensors, *self.outputs)
        }

    def channel_views(self) -> dict[str, tuple[str, int]]:
        """Every tensor of this Track A segment -> (the tensor whose buffer holds it, its first channel
        there), as the runtime lays them out (:data:`ALIAS_OPS`): a concatenation's inputs are channel
        slices of its output, a slice's output a channel slice of its input, nested ones included;
        any other tensor is its own buffer, from channel 0."""
        channels = {t.name: t.shape[-1] for t in (*self.inputs, *self.tensors, *self.outputs)}
        parent: dict[str, tuple[str, int]] = {}
        for c in self.calls:
            if c.op == "concat":
                offset = 0
                for x in c.inputs:
                    parent[x] = (c.outputs[0], offset)
                    offset += channels[x]
            elif c.op == "slice":
                parent[c.outputs[0]] = (c.inputs[0], c.attr("start"))
        out = {}
        for name in channels:
            root, offset = name, 0
            while root in parent:
                root, extra = parent[root]
                offset += extra
            out[name] = (root, offset)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Segment:
        return cls(
            index=d["index"],
            track=d["track"],
            nodes=tuple(d["nodes"]),
            inputs=tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in d["outputs"]),
            onnx=d["onnx"],
            key=d.get("key", ""),
            calls=tuple(KernelCall.from_json(c) for c in d.get("calls", ())),
            tensors=tuple(TensorSpec.from_json(t) for t in d.get("tensors", ())),
        )


@dataclass(frozen=True)
class Plan:
    """The whole model as segments. ``inputs``/``outputs`` are the model's own, in its layout."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    segments: tuple[Segment, ...]
    precision: str
    batch_sizes: tuple[int, ...]
    schema_version: int = PLAN_SCHEMA_VERSION
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return _without_batched(asdict(self))

    @property
    def fixed_shape(self) -> bool:
        """Built with ``batch: fixed``: the input's exact shape, run whole (the module docstring)."""
        return bool(self.inputs) and not self.inputs[0].batched

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Plan:
        return cls(
            inputs=tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in d["outputs"]),
            segments=tuple(Segment.from_json(s) for s in d["segments"]),
            precision=d["precision"],
            batch_sizes=tuple(d["batch_sizes"]),
            schema_version=d.get("schema_version", PLAN_SCHEMA_VERSION),
            notes=tuple(d.get("notes", ())),
        )

    def summary(self) -> list[str]:
        """One line per segment, for `dualtrack info` and build logs."""
        lines = []
        for s in self.segments:
            what = f"{len(s.calls)} kernel calls" if s.track == "A" else "IREE module"
            lines.append(
                f"{s.name}: {len(s.nodes)} nodes, {what}; "
                f"in {[t.name for t in s.inputs]} -> out {[t.name for t in s.outputs]}"
            )
        return lines
