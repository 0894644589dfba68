"""Convolution launch shapes (:class:`ConvProblem`), and the Track A convolutions of a plan as
tuning problems, as pure functions.

A problem is what the kernel sees at launch: ``N, H, W, C, K``, the channel strides ``ldx``/``ldy``
(a convolution that writes into a concatenation writes a channel slice of a wider buffer) and the
dtype. ReLU is not part of it: it costs the same with or without. Layers with equal problems (the
same shape at the same batch size) are tuned once. The conv3x3 selection policy
(:func:`~dualtrack.kernels.select.choose_conv`) and the Hopper kernel's shape checks take one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from dualtrack.contract.plan import KernelCall, Plan, Segment
from dualtrack.kernels.base import DeviceTensor, dtype_name

TUNED_OPS = ("conv3x3",)  # convt2x2's tiles are namespace constants, not a template: nothing to search


@dataclass(frozen=True, order=True)
class ConvProblem:
    """One conv3x3 launch shape: input (N, H, W, C) with pixel stride ``ldx``, K output channels
    with pixel stride ``ldy``."""

    N: int
    H: int
    W: int
    C: int
    K: int
    ldx: int
    ldy: int
    dtype: str = "float16"

    @classmethod
    def dense(cls, N: int, H: int, W: int, C: int, K: int, dtype: str = "float16") -> ConvProblem:
        """A problem on dense tensors (pixel strides ``C`` and ``K``)."""
        return cls(N, H, W, C, K, C, K, dtype)

    @classmethod
    def of(cls, x: DeviceTensor, y: DeviceTensor) -> ConvProblem:
        """The launch that reads ``x`` and writes ``y`` (NHWC; a channel slice has its buffer's stride)."""
        n, h, w, c = x.shape
        return cls(n, h, w, c, y.shape[3], x.channel_stride, y.channel_stride, dtype_name(x.dtype))

    @property
    def pixels(self) -> int:
        return self.N * self.H * self.W

    @property
    def flops(self) -> int:
        return 2 * self.pixels * self.K * 9 * self.C

    def label(self) -> str:
        strides = "" if (self.ldx, self.ldy) == (self.C, self.K) else f" ldx {self.ldx} ldy {self.ldy}"
        return f"{self.N}x{self.H}x{self.W} C{self.C}->K{self.K}{strides}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ConvProblem:
        fields = ("N", "H", "W", "C", "K", "ldx", "ldy")
        values = {f: d[f] for f in fields}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values.values()):
            raise ValueError(f"problem {d!r} needs positive integers {', '.join(fields)}")
        dtype = d.get("dtype", "float16")
        if dtype not in ("float16", "float32"):
            raise ValueError(f"problem dtype {dtype!r} is not float16 or float32")
        return cls(**values, dtype=dtype)


@dataclass(frozen=True)
class ConvLayer:
    """One conv3x3 call of the plan at one batch size."""

    node: str  # the ONNX Conv node the call covers (KernelCall.nodes[0])
    batch: int
    problem: ConvProblem
    relu: bool
    call: KernelCall | None = None


def channel_strides(seg: Segment) -> dict[str, int]:
    """Per-pixel channel stride of every tensor of a Track A segment, as the runtime plans its buffers
    (``Segment.channel_views``): a channel slice of another buffer (a concatenation's input, a
    slice's output) has that buffer's stride; a buffer of the segment's own (neither its input nor its
    output) has :func:`~dualtrack.contract.plan.padded_channels`; the inputs and outputs are dense."""
    widths = seg.buffer_widths()
    return {name: widths[root] for name, (root, _) in seg.channel_views().items()}


def conv_layers(
    plan: Plan, batches: Iterable[int] | None = None, layers: str | None = None, ops: tuple[str, ...] = TUNED_OPS
) -> list[ConvLayer]:
    """Every Track A conv3x3 call (``ops``: calls of these ops) of ``plan`` at each batch size
    (default: the plan's), in plan order; ``layers`` is a glob on the Conv node's name (``enc*``,
    ``dec1/*``). The problem's H and W are the input's."""
    sizes = tuple(batches) if batches else plan.batch_sizes
    out: list[ConvLayer] = []
    for seg in plan.segments:
        if seg.track != "A":
            continue
        specs = {t.name: t for t in (*seg.inputs, *seg.tensors, *seg.outputs)}
        strides = channel_strides(seg)
        for c in seg.calls:
            if c.op not in ops or (layers and not fnmatch.fnmatchcase(c.nodes[0], layers)):
                continue
            x, y = specs[c.inputs[0]], specs[c.outputs[0]]
            _, h, w, ch = x.shape
            for n in sizes:
                p = ConvProblem(n, h, w, ch, y.shape[-1], strides[x.name], strides[y.name], x.dtype)
                out.append(ConvLayer(c.nodes[0], n, p, bool(c.attr("relu")), c))
    return out


def by_problem(layers: Iterable[ConvLayer]) -> dict[ConvProblem, list[ConvLayer]]:
    """Layers grouped by problem, problems in order of first appearance."""
    out: dict[ConvProblem, list[ConvLayer]] = {}
    for layer in layers:
        out.setdefault(layer.problem, []).append(layer)
    return out
