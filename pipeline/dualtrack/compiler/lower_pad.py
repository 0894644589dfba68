"""Track A lowering of the data-movement ops: Pad over H and W, Slice / Split along channels,
channel Concat of inputs from anywhere, and DepthToSpace.

- **Pad** (mode constant with any value, reflect, edge; non-negative pads on H and W) is one call
  of the pad kernel (``kernels.pad``). A constant 0 pad in front of a Conv never gets here: the
  front end folds it into the Conv's pads (``frontend.fold_zero_pads``).
- **Slice / Split** along channels (axis 1, step 1, constant bounds) of a tensor this segment
  computes is a **view** (a ``slice`` call, an alias op: its consumers read the input's buffer from
  the slice's first channel with its channel stride, no copy); where it cannot be one (its input
  comes from another segment, its output leaves the segment) it is a copy: a pad call of zero pads
  from channel ``c0``.
- **Concat** along channels is a ``concat`` call (an alias op: its inputs are channel slices of its
  output's buffer, written there by their producers). An input that cannot be such a slice (it
  comes from another segment or leaves this one, feeds another concatenation, is itself a view, or
  appears twice) is first copied into a tensor of its own that is (a pad call of zero pads), so a
  Concat never forces a track switch.
- **DepthToSpace** (DCR, the front end's sub-pixel ConvTranspose and ONNX's default; CRD, torch's
  PixelShuffle; any block size) is one call of the depth_to_space kernel (``kernels.depth_to_space``).

The predicates (:func:`supports`) read ONNX only; the lowering (:func:`lower`) needs the calls of
the segment so far and which tensors leave it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from dualtrack.compiler.lower_mobile import (
    Facts,
    _attrs,  # the one attribute reader of the lowerings
)
from dualtrack.contract.plan import KernelCall
from dualtrack.kernels.depth_to_space import D2S_MODES, DepthToSpace
from dualtrack.kernels.pad import PadMode

DESCRIPTION = (
    "channel Concat of any inputs (no copy of what the segment computes), Slice/Split along channels "
    "(a view where they can be), DepthToSpace DCR/CRD of any block size, Pad constant/reflect/edge over H,W"
)
OPS = ("Pad", "Slice", "Split", "Concat", "DepthToSpace")
SpecMap = dict[str, tuple[tuple[int, ...], str]]


def _image(node: onnx.NodeProto, facts: Facts) -> str | None:
    """Why the node's first input is not an (N, C, H, W) image, or None."""
    rank = len(facts.shape(node.input[0]))
    return None if rank == 4 else f"input of rank {rank}, not an image"


def _const_input(node: onnx.NodeProto, k: int, facts: Facts) -> tuple[np.ndarray | None, bool]:
    """(value, present) of optional input ``k``: (None, False) where absent; (None, True) where
    computed at run time."""
    name = node.input[k] if len(node.input) > k else ""
    if not name:
        return None, False
    return facts.const(name), True


# --- Pad --------------------------------------------------------------------------------------------


def pad_mode(node: onnx.NodeProto, facts: Facts) -> tuple[PadMode | None, str | None]:
    """The pad call's :class:`PadMode` of an ONNX Pad (pads and value as inputs since opset 11, as
    attributes before; opset 18's ``axes``), or (None, why not)."""
    why = _image(node, facts)
    if why:
        return None, why
    a = _attrs(node)
    mode = a.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        return None, f"mode {mode} (the kernel takes constant, reflect and edge)"
    pads, given = _const_input(node, 1, facts)
    if not given:
        pads = np.array(a["pads"]) if "pads" in a else None
    value, given = _const_input(node, 2, facts)
    if given and value is None:
        return None, "a constant value computed at run time"
    value = float(value.reshape(())) if value is not None and value.size == 1 else float(a.get("value", 0.0))
    axes, given = _const_input(node, 3, facts)
    if pads is None or (given and axes is None):
        return None, "pads or axes computed at run time"
    full = full_pads(pads.astype(np.int64).tolist(), axes)
    if full is None or any(full[i] for i in (0, 1, 4, 5)):
        return None, f"pads {pads.tolist()} on N or C (the kernel pads H and W)"
    if min(full) < 0:
        return None, f"negative pads {pads.tolist()} (a crop)"
    how = PadMode(mode, full[2], full[3], full[6], full[7], value)
    _, _, h, w = facts.shape(node.input[0])
    why = how.check(h, w)
    return (None, why) if why else (how, None)


def full_pads(pads: list[int], axes: np.ndarray | None) -> list[int] | None:
    """The 8 pads of a 4-D tensor (begins, then ends) from pads over ``axes`` (None: all four)."""
    if axes is None:
        return pads if len(pads) == 8 else None
    ax = [int(v) % 4 for v in axes.tolist()]
    if len(pads) != 2 * len(ax) or len(set(ax)) != len(ax):
        return None
    full = [0] * 8
    for j, axis in enumerate(ax):
        full[axis], full[axis + 4] = pads[j], pads[j + len(ax)]
    return full


def _pad_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    return pad_mode(node, facts)[1]


# --- Slice / Split ----------------------------------------------------------------------------------


def channel_ranges(node: onnx.NodeProto, facts: Facts) -> tuple[list[tuple[int, int]] | None, str | None]:
    """The [start, end) channel range of each output of a Slice or Split along channels (axis 1,
    step 1, constant bounds), or (None, why not)."""
    why = _image(node, facts)
    if why:
        return None, why
    C = facts.shape(node.input[0])[1]
    ranges = _slice_range(node, facts, C) if node.op_type == "Slice" else _split_ranges(node, facts, C)
    if isinstance(ranges, str):
        return None, ranges
    if any(e <= s for s, e in ranges):
        return None, f"an empty channel range {ranges}"
    return ranges, None


def _slice_range(node: onnx.NodeProto, facts: Facts, C: int) -> list[tuple[int, int]] | str:
    values = [_const_input(node, k, facts) for k in range(1, 5)]
    if any(v is None and given for v, given in values) or len(node.input) < 3:
        return "bounds computed at run time (or given as attributes, before opset 10)"
    starts, ends, axes, steps = (v.astype(np.int64).tolist() if v is not None else None for v, _ in values)
    axes = [int(a) % 4 for a in axes] if axes is not None else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    bounds = {a: (s, e, st) for a, s, e, st in zip(axes, starts, ends, steps, strict=True)}
    shape = facts.shape(node.input[0])
    for a, (s, e, st) in bounds.items():
        if a != 1 and (st != 1 or _clamp(s, shape[a]) != 0 or _clamp(e, shape[a]) != shape[a]):
            return f"a slice along axis {a} (the view takes channels: axis 1)"
    s, e, st = bounds.get(1, (0, C, 1))
    if st != 1:
        return f"step {st} (the view takes step 1)"
    return [(_clamp(s, C), _clamp(e, C))]


def _clamp(v: int, size: int) -> int:
    """An ONNX Slice bound (negative from the end, clamped to the axis) as an index in [0, size]."""
    return min(max(v + size if v < 0 else v, 0), size)


def _split_ranges(node: onnx.NodeProto, facts: Facts, C: int) -> list[tuple[int, int]] | str:
    a = _attrs(node)
    if int(a.get("axis", 0)) % 4 != 1:
        return f"a split along axis {a.get('axis', 0)} (Track A splits channels: axis 1)"
    sizes, given = _const_input(node, 1, facts)
    if given and sizes is None:
        return "split sizes computed at run time"
    outs = len(node.output)
    if sizes is None:
        sizes = np.array(a["split"]) if "split" in a else None
    if sizes is None:  # equal parts; opset 18's num_outputs gives the last one the remainder
        step = -(-C // outs)
        sizes = np.array([min(step, C - j * step) for j in range(outs)])
    if len(sizes) != outs or int(sizes.sum()) != C:
        return f"split sizes {sizes.tolist()} of {C} channels into {outs} outputs"
    ends = np.cumsum(sizes).tolist()
    return [(int(e - s), int(e)) for s, e in zip(sizes.tolist(), ends, strict=True)]


def _slices_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    return channel_ranges(node, facts)[1]


# --- Concat -----------------------------------------------------------------------------------------


def _concat_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    """Channels of images: the inputs' producers or copies write channel slices of the output."""
    axis = _attrs(node).get("axis")
    if axis is None or int(axis) % 4 != 1:
        return f"concatenation on axis {axis}, not channels"
    for x in node.input:
        if len(facts.shape(x)) != 4:
            return f"input '{x}' of rank {len(facts.shape(x))}, not an image"
        if facts.is_const(x):
            return f"input '{x}' is a constant"
    return None


# --- DepthToSpace ----------------------------------------------------------------------------------


def depth_to_space(node: onnx.NodeProto, facts: Facts) -> tuple[DepthToSpace | None, str | None]:
    """The call's :class:`DepthToSpace` of an ONNX DepthToSpace (``mode`` since opset 11; DCR
    before), or (None, why not)."""
    why = _image(node, facts)
    if why:
        return None, why
    a = _attrs(node)
    mode = str(a.get("mode", "DCR"))
    if mode not in D2S_MODES:
        return None, f"mode {mode} (the kernel takes {', '.join(D2S_MODES)})"
    blocksize = int(a.get("blocksize", 0))
    if blocksize < 1:
        return None, f"blocksize {blocksize} (ONNX takes one >= 1)"
    how = DepthToSpace(blocksize, mode)
    C = facts.shape(node.input[0])[1]
    if C % (how.blocksize**2):
        return None, f"{C} channels, not a multiple of blocksize^2 = {how.blocksize**2}"
    return how, None


def _d2s_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    return depth_to_space(node, facts)[1]


_PREDICATES: dict[str, Callable[[onnx.NodeProto, Facts], str | None]] = {
    "Pad": _pad_ok,
    "Slice": _slices_ok,
    "Split": _slices_ok,
    "Concat": _concat_ok,
    "DepthToSpace": _d2s_ok,
}


def supports(node: onnx.NodeProto, facts: Facts) -> str | None:
    """None when Track A takes the node (one of :data:`OPS`), else why not."""
    return _PREDICATES[node.op_type](node, facts)


def kernel(node: onnx.NodeProto, facts: Facts) -> str | None:
    """The kernel a node :func:`supports` launches, as the cost model charges it: ``pad`` for a Pad,
    ``depth_to_space`` for a DepthToSpace, none for a Concat or a channel view (the copies the
    lowering may add are not charged)."""
    return {"Pad": "pad", "DepthToSpace": "depth_to_space"}.get(node.op_type)


# --- lowering ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentSoFar:
    """What the lowering of a node needs from its segment: the calls before it, which tensors leave
    the segment (another segment or the graph's outputs read them), and the specs it adds the
    tensors it makes to (a copy into a concatenation)."""

    calls: list[KernelCall]
    escaping: set[str]
    specs: SpecMap
    concats: dict[str, tuple[str, ...]] = field(default_factory=dict)  # each Concat's ONNX inputs, by output

    def produced(self) -> set[str]:
        return {t for c in self.calls for t in c.outputs}

    def viewed(self) -> set[str]:
        """Tensors that are already a channel slice of another buffer: a slice's output, a
        concatenation's input."""
        out = {c.outputs[0] for c in self.calls if c.op == "slice"}
        out.update(x for c in self.calls if c.op == "concat" for x in c.inputs)
        return out


def lower(node: onnx.NodeProto, facts: Facts, seg: SegmentSoFar) -> list[KernelCall]:
    """The calls of a node :func:`supports` (in order), given its segment so far. One of them names
    the node (a Split's first, a Concat's concat); the others name none, so that every node is
    covered once and every call has a name of its own (its output's)."""
    if node.op_type == "Pad":
        how, _ = pad_mode(node, facts)
        assert how is not None
        return [KernelCall("pad", (node.input[0],), (node.output[0],), (), how.attrs(), (node.name,))]
    if node.op_type == "DepthToSpace":
        d2s, _ = depth_to_space(node, facts)
        assert d2s is not None
        return [KernelCall("depth_to_space", (node.input[0],), (node.output[0],), (), d2s.attrs(), (node.name,))]
    if node.op_type == "Concat":
        return _lower_concat(node, seg)
    ranges, _ = channel_ranges(node, facts)
    assert ranges is not None
    x = node.input[0]
    from_here = x in seg.produced()
    calls = []
    for j, (out, (s, e)) in enumerate(zip(node.output, ranges, strict=True)):
        names = (node.name,) if j == 0 else ()
        if from_here and out not in seg.escaping:
            calls.append(KernelCall("slice", (x,), (out,), (), (("start", s),), names))
        else:
            how = PadMode.copy(c0=s, channels=e - s)
            calls.append(KernelCall("pad", (x,), (out,), (), how.attrs(), names))
    return calls


def _lower_concat(node: onnx.NodeProto, seg: SegmentSoFar) -> list[KernelCall]:
    """The copies of the inputs that cannot be channel slices of the output, then the concat.

    A Concat whose inputs begin with all of an earlier Concat's, in order (DenseNet's dense blocks:
    layer k concatenates the block's input and every earlier layer's output, which is layer k-1's
    concatenation plus one more), takes that earlier concatenation as its first part: the earlier one
    becomes the first channels of this one's buffer, each layer's output is written once at its offset,
    and no input is copied again (the prefix's inputs are channel slices of it already: without this,
    layer k would copy its k-1 earlier inputs, k^2/2 copies a block)."""
    produced, viewed = seg.produced(), seg.viewed()
    parts: list[str] = []
    copies: list[KernelCall] = []
    seg.concats[node.output[0]] = tuple(node.input)
    prefix = max(
        (
            out
            for out, ins in seg.concats.items()
            if len(ins) < len(node.input)
            and tuple(node.input[: len(ins)]) == ins
            and out in produced
            and out not in seg.escaping
            and out not in viewed
        ),
        key=lambda out: len(seg.concats[out]),
        default=None,
    )
    nested = 0 if prefix is None else len(seg.concats[prefix])
    parts += [prefix] if prefix is not None else []
    for j, x in enumerate(node.input[nested:], start=nested):
        if x in produced and x not in seg.escaping and x not in viewed and x not in parts:
            parts.append(x)
            continue
        part = f"{node.output[0]}__part{j}"  # a tensor of its own, written into the output's slice
        seg.specs[part] = seg.specs[x]
        copies.append(KernelCall("pad", (x,), (part,), (), PadMode.copy().attrs()))
        parts.append(part)
    return [*copies, KernelCall("concat", tuple(parts), (node.output[0],), (), (), (node.name,))]
