"""Track A lowering of the mobile-network ops (MobileNetV3, LR-ASPP): which ONNX nodes the
dwconv, gap, fc, eltwise and resize kernels take, and the kernel call each becomes.

One table, :data:`RULES` (op type -> :class:`Rule`), is the single answer to "can Track A run
this node?" for these ops: :func:`supports` gives None or the reason it cannot, :func:`lower` the
call. ``partition.TRACK_A_SUPPORT`` wraps :func:`supports` for every op this module claims, so
``partition.lower_track_a`` and `partition: auto` ask it the same question, and the lowering asks
it before its own (dense conv, pool, convt) branches. An activation node that directly
follows a dwconv, fc or eltwise call (its only consumer) is fused into that call's epilogue.

This module reads ONNX; it never imports the kernels (partition sits left of the tracks). The
attr codes it writes are the contract's (:mod:`dualtrack.contract.activations`; plan's ELTWISE_OPS,
RESIZE_*), which the kernel specs read back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler import act_patterns
from dualtrack.compiler.onnx_graph import TARGET_OPSET, fp32_only_ops
from dualtrack.contract import activations
from dualtrack.contract.activations import Activation, match_onnx
from dualtrack.contract.plan import (
    ELTWISE_OPS,
    REDUCE_OPS,
    RESIZE_COORDS,
    RESIZE_MODES,
    RESIZE_NEAREST,
    KernelCall,
    f32_bits,
)
from dualtrack.kernels.dwconv import DwGeometry

DESCRIPTION = (
    "depthwise Conv 1..7 a side (any strides, dilations, pads, channel multiplier), "
    "1x1 Conv on a pooled (N,C,1,1) vector, "
    "GlobalAveragePool, ReduceSum / ReduceMean / ReduceMax / ReduceMin / ReduceL1 / ReduceL2 / ReduceSumSquare "
    "over H,W or over C, "
    "Add, Mul, Sub and Div of NHWC tensors, Pow(x, 2) as x * x "
    "(or an (N,C,1,1) or (N,1,H,W) gate, "
    "or a constant per-channel vector or scalar), PRelu (per-channel or single slope), "
    f"{'/'.join(activations.ONNX_OPS)} (fused into the op before them where they can be), "
    "Resize nearest/linear over H,W"
)
DW_MAX_KERNEL = 7  # dwconv_nhwc.cu takes R, S in 1..7 (kernels.dwconv.MAX_KERNEL)
ACT_OPS = activations.ONNX_OPS  # the activation nodes: the ops some row of the table matches
SpecMap = dict[str, tuple[tuple[int, ...], str]]


class LoweringRefused(Exception):
    """:func:`lower` cannot lower a node that :func:`supports` accepts in this segment's context
    (partition turns the reason into its PartitionError)."""


@dataclass
class Facts:
    """What the predicates need to know about the graph: tensor shapes and dtypes (``specs``, at
    batch 1), and constant values (initializers and Constant nodes)."""

    model: onnx.ModelProto
    specs: SpecMap
    _consts: dict[str, np.ndarray] = field(default_factory=dict, init=False)

    consumers: dict[str, list[onnx.NodeProto]] = field(default_factory=dict, init=False)
    producer: dict[str, onnx.NodeProto] = field(default_factory=dict, init=False)
    inits: set[str] = field(default_factory=set, init=False)  # what a call may name as a weight

    def __post_init__(self) -> None:
        for n in self.model.graph.node:
            for x in n.input:
                self.consumers.setdefault(x, []).append(n)
            for y in n.output:
                self.producer[y] = n
        for init in self.model.graph.initializer:
            self._consts[init.name] = numpy_helper.to_array(init)
            self.inits.add(init.name)
        for n in self.model.graph.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self._consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def const(self, name: str) -> np.ndarray | None:
        """The value of a constant tensor, None when the name is empty or computed at run time."""
        return self._consts.get(name) if name else None

    def is_const(self, name: str) -> bool:
        return name in self._consts

    def shape(self, name: str) -> tuple[int, ...]:
        return self.specs[name][0]


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


# --- activations ---------------------------------------------------------------------------------


def activation(node: onnx.NodeProto, facts: Facts) -> tuple[Activation | None, str | None]:
    """The activation a node is (a row of :mod:`dualtrack.contract.activations` and its
    parameters), or (None, why not)."""
    return match_activation(node, facts.const)


def match_activation(
    node: onnx.NodeProto, const: Callable[[str], np.ndarray | None]
) -> tuple[Activation | None, str | None]:
    """:func:`activation` with constants from ``const`` (a tensor name -> its value or None): the
    table's one lookup from an ONNX node to a row and its parameters (Clip's min and max may be
    scalar constant inputs since opset 11)."""
    if node.op_type == "PRelu":
        return _uniform_prelu(node, const)
    scalars: dict[int, float | None] = {}
    for j, name in enumerate(node.input[1:], start=1):
        if name:
            value = const(name)
            scalars[j] = float(value.reshape(())) if value is not None and value.size == 1 else None
    return match_onnx(node.op_type, _attrs(node), scalars)


def _uniform_prelu(
    node: onnx.NodeProto, const: Callable[[str], np.ndarray | None]
) -> tuple[Activation | None, str | None]:
    """A PRelu whose slope is one value for every element (torch's ``nn.PReLU()``, num_parameters=1, and
    MONAI's PRELU write it as a (1, 1, 1) constant) is LeakyReLU with that slope: the same function, so
    every kernel that fuses an activation computes it (MONAI UNet's 17 InstanceNorm + PReLU pairs ran the
    PReLU as an eltwise pass of its own each). A per-channel slope is not a row of the table: the eltwise
    kernel's prelu op takes it."""
    slope = const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if slope is None or slope.size == 0:
        return None, "PRelu's slope is computed at run time"
    flat = np.asarray(slope, np.float32).ravel()
    if not (flat == flat[0]).all():
        return None, "PRelu with a slope per channel is the eltwise kernel's op, not an activation of the table"
    return Activation.named("leakyrelu", float(flat[0])), None


def _act_attrs(act: Activation | None) -> tuple[tuple[str, int], ...]:
    return (act or Activation()).attrs()


# --- predicates: None when the kernels take the node, else why not ---------------------------------


def conv_kind(node: onnx.NodeProto, facts: Facts) -> str | None:
    """ "dwconv" for a depthwise Conv (group == C == K > 1) of at most DW_MAX_KERNEL a side, "fc" for a
    group-1 Conv on an (N, C, 1, 1) input, None for the other convolutions (partition's dense conv
    branches: a wider depthwise window, InceptionNeXt's 1x11 and 11x1 bands, is the general conv's, its
    one-channel groups merged into block-diagonal ones)."""
    if node.op_type != "Conv" or node.input[0] not in facts.specs:
        return None
    x = facts.shape(node.input[0])
    group = _attrs(node).get("group", 1)
    if len(x) == 4 and group > 1 and group == x[1]:
        w = facts.shape(node.input[1]) if node.input[1] in facts.specs else ()
        if len(w) == 4 and max(w[2:]) > DW_MAX_KERNEL:
            return None
        return "dwconv"
    if len(x) == 4 and group == 1 and x[2:] == (1, 1):
        return "fc"
    return None


def _conv_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    kind = conv_kind(node, facts)
    if kind is None:
        return "not a depthwise convolution nor a convolution of an (N,C,1,1) vector"
    if any(not facts.is_const(w) for w in node.input[1:] if w):
        return "weights computed at run time"
    a = _attrs(node)
    w = facts.shape(node.input[1])
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return f"auto_pad {a['auto_pad']} (re-export with explicit pads)"
    pads = [0] * 4 if a.get("auto_pad") == "VALID" else list(a.get("pads", [0, 0, 0, 0]))
    if kind == "fc":
        if w[2:] != (1, 1) or any(pads):
            return f"kernel {list(w[2:])} pads {pads} on a 1x1 input"
        return None
    x = facts.shape(node.input[0])
    if w[0] % x[1] or w[1] != 1:
        return f"depthwise weights {list(w)} on {x[1]} channels (K must be a multiple of C, one input channel a group)"
    if not all(1 <= k <= DW_MAX_KERNEL for k in w[2:]):
        return f"depthwise kernel {list(w[2:])} (the kernel takes 1..{DW_MAX_KERNEL} a side)"
    if len(pads) != 4 or min(pads) < 0:
        return f"pads {pads}"
    return None


def _reduce_axes(node: onnx.NodeProto, facts: Facts) -> tuple[list[int] | None, str | None]:
    """A Reduce node's axes over a 4-D (NCHW) input, sorted and non-negative, or why not: the axes
    attribute (input since opset 18, a constant), keepdims 1."""
    if len(facts.shape(node.input[0])) != 4:
        return None, f"input of rank {len(facts.shape(node.input[0]))}, not an image"
    a = _attrs(node)
    axes = a.get("axes")
    if len(node.input) > 1 and node.input[1]:  # opset 18: axes as an input
        value = facts.const(node.input[1])
        if value is None:
            return None, "axes computed at run time"
        axes = value.tolist()
    if a.get("keepdims", 1) != 1:
        return None, "keepdims=0 (the kernels keep the reduced dims)"
    if axes is None:
        return None, "axes: all (the kernels reduce over H and W, or over C)"
    return sorted(int(v) % 4 for v in axes), None


def _gap_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    """GlobalAveragePool, or a Reduce op of REDUCE_OPS over H and W (keepdims) of an image: the gap kernel."""
    if len(facts.shape(node.input[0])) != 4:
        return f"input of rank {len(facts.shape(node.input[0]))}, not an image"
    if node.op_type == "GlobalAveragePool":
        return None
    axes, why = _reduce_axes(node, facts)
    if why is not None:
        return why
    if axes != [2, 3]:
        return f"axes {axes} (the kernels reduce over H and W, axes [2, 3], or over the channels, axis 1)"
    return None


def _creduce_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    """A Reduce op of REDUCE_OPS over the channels (axis 1, keepdims) of an image: the creduce kernel."""
    axes, why = _reduce_axes(node, facts)
    if why is not None:
        return why
    if axes != [1]:
        return f"axes {axes} (the kernels reduce over H and W, axes [2, 3], or over the channels, axis 1)"
    return None


def _reduce_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    """A Reduce op over H, W (gap) or over C (creduce); the reason names both. noop_with_empty_axes only
    matters where axes is empty, which neither takes."""
    if _gap_ok(node, facts) is None:
        return None
    return _creduce_ok(node, facts)


# A binary node lowered to one eltwise call: its tensor inputs, its constant operand (a weight), its op.
Binary = tuple[tuple[str, ...], tuple[str, ...], str]
# The op when the broadcast operand is the node's first input: a - b and a / b turn around.
_SWAPPED = {"add": "add", "mul": "mul", "sub": "rsub", "div": "rdiv"}


def _channel_constant(name: str, x: str, facts: Facts) -> str | None:
    """None when ``name`` is an initializer of ``x``'s dtype that ONNX broadcasts to ``x`` (N,C,H,W)
    as one value per channel, a (1, C, 1, 1) shape once right-aligned ((C,1,1), (1,C,1,1), a
    scalar), else why not."""
    value = facts.const(name)
    if value is None or name not in facts.inits:
        return f"operand '{name}' is computed at run time"
    xs = facts.shape(x)
    if value.ndim > 4 or len(xs) != 4:
        return f"a constant of shape {list(value.shape)} on {list(xs)}"
    v4 = (1,) * (4 - value.ndim) + tuple(value.shape)
    if v4[0] != 1 or v4[2:] != (1, 1) or v4[1] not in (1, xs[1]):
        return f"a constant of shape {list(value.shape)} (the kernel takes one value per channel: (C,1,1) or a scalar)"
    if value.dtype.name != facts.specs[x][1]:
        return f"a {value.dtype.name} constant on a {facts.specs[x][1]} tensor"
    return None


def _binary_operands(node: onnx.NodeProto, facts: Facts) -> tuple[Binary | None, str | None]:
    """(tensor inputs in kernel order, constant operand, eltwise op) of an Add/Mul/Sub/Div or PRelu,
    or (None, why not): tensors of equal shapes, a full tensor and an (N,C,1,1) gate, or a tensor and
    a constant per-channel vector (PRelu's slope)."""
    op = node.op_type.lower()
    if len(node.input) != 2:
        return None, f"{len(node.input)} inputs"
    consts = [facts.is_const(x) for x in node.input]
    if all(consts):
        return None, "both operands constant (the front end folds these)"
    if op == "prelu" and consts[0]:
        return None, "a constant input (the front end folds these)"
    if any(consts):
        x, c = (node.input[1], node.input[0]) if consts[0] else (node.input[0], node.input[1])
        why = _channel_constant(c, x, facts)
        if why:
            return None, why
        return ((x,), (c,), op if not consts[0] or op == "prelu" else _SWAPPED[op]), None
    if op == "prelu":
        return None, "a slope computed at run time (the kernel takes a constant per-channel slope)"
    s0, s1 = facts.shape(node.input[0]), facts.shape(node.input[1])
    if len(s0) != 4 or len(s1) != 4:
        return None, f"operands {list(s0)}, {list(s1)} are not both images"
    if s0 == s1:
        return ((node.input[0], node.input[1]), (), op), None
    for full, gate in ((0, 1), (1, 0)):
        sf, sg = (s0, s1)[full], (s0, s1)[gate]
        if sg in ((sf[0], sf[1], 1, 1), (sf[0], 1, sf[2], sf[3])) and sf[1] > 1:  # a channel or a pixel gate
            return ((node.input[full], node.input[gate]), (), op if full == 0 else _SWAPPED[op]), None
    return None, (
        f"broadcast of {list(s0)} with {list(s1)} (the kernel takes equal shapes, an (N,C,1,1) or an (N,1,H,W) gate)"
    )


def _binary_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    return _binary_operands(node, facts)[1]


def _square_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    """Pow(x, 2) of an image (PoolFormerV2's StarReLU squares its ReLU): x * x, exact as powf's."""
    if len(facts.shape(node.input[0])) != 4:
        return f"input of rank {len(facts.shape(node.input[0]))}, not an image"
    e = facts.const(node.input[1]) if len(node.input) > 1 else None
    if e is None or e.size != 1 or float(e.reshape(())) != 2.0:
        return "an exponent other than the constant 2 (the kernel squares: x * x)"
    return None


def _act_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    if len(facts.shape(node.input[0])) != 4:
        return f"input of rank {len(facts.shape(node.input[0]))}, not an image"
    return activation(node, facts)[1]


def resize_mode(node: onnx.NodeProto, facts: Facts) -> tuple[tuple[tuple[str, int], ...] | None, str | None]:
    """The resize call's attrs (mode, coord, nearest, scales, Ho, Wo), or (None, why not)."""
    a = _attrs(node)
    mode = a.get("mode", "nearest")
    coord = a.get("coordinate_transformation_mode", "half_pixel")
    nearest = a.get("nearest_mode", "round_prefer_floor")
    if mode not in RESIZE_MODES:
        return None, f"mode {mode} (the kernel takes {', '.join(RESIZE_MODES)})"
    if coord not in RESIZE_COORDS:
        return None, f"coordinate_transformation_mode {coord} (the kernel takes {', '.join(RESIZE_COORDS)})"
    if mode == "nearest" and nearest not in RESIZE_NEAREST:
        return None, f"nearest_mode {nearest}"
    if a.get("antialias", 0) or a.get("axes") is not None or a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return None, "antialias, axes or keep_aspect_ratio_policy"
    x = facts.shape(node.input[0])
    y = facts.shape(node.output[0])
    if len(x) != 4 or len(y) != 4 or x[:2] != y[:2]:
        return None, f"a resize of {list(x)} to {list(y)} that is not over H and W of an image"
    scales = facts.const(node.input[2]) if len(node.input) > 2 else None
    sizes = facts.const(node.input[3]) if len(node.input) > 3 else None
    if scales is not None and scales.size:
        if scales.size != 4 or scales[0] != 1 or scales[1] != 1:
            return None, f"scales {scales.tolist()}"
        sh, sw = float(np.float32(scales[2])), float(np.float32(scales[3]))
    elif sizes is not None and sizes.size == 4:
        sh, sw = float(np.float32(y[2]) / np.float32(x[2])), float(np.float32(y[3]) / np.float32(x[3]))
    else:
        return None, "scales or sizes computed at run time"
    attrs = (
        ("mode", RESIZE_MODES[mode]), ("coord", RESIZE_COORDS[coord]),
        ("nearest", RESIZE_NEAREST.get(nearest, 0)), ("scale_h", f32_bits(sh)), ("scale_w", f32_bits(sw)),
        ("Ho", y[2]), ("Wo", y[3]),
    )  # fmt: skip
    return attrs, None


def _resize_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    return resize_mode(node, facts)[1]


# The front end's fp16 conversion keeps reductions and Resize in fp32 (frontend.FP32_REDUCTIONS and
# onnxconverter-common's block list): Cast(fp16 -> fp32) -> op -> Cast(fp32 -> fp16). The kernels
# compute exactly that in fp16 storage (fp32 math, one rounding at the end), so the three nodes
# lower to one fp16 call.
# Activations ONNX defines for float32 only (Celu) are kept fp32 the same way, and lower alike.
CAST_WRAPPED = (
    "GlobalAveragePool", *REDUCE_OPS, "Resize",
    *sorted(set(ACT_OPS) & fp32_only_ops(TARGET_OPSET)),
)  # fmt: skip
_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def _cast_to(node: onnx.NodeProto) -> int | None:
    return _attrs(node).get("to") if node.op_type == "Cast" else None


def cast_sandwich(node: onnx.NodeProto, facts: Facts) -> tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto] | None:
    """(cast up, op, cast down) when ``node`` is either Cast of a Cast(fp16->fp32) -> op -> Cast(->fp16)
    chain around one of :data:`CAST_WRAPPED` whose intermediate tensors have no other reader."""
    if node.op_type != "Cast":
        return None
    if _cast_to(node) == _FLOAT:
        up = node
    elif _cast_to(node) == _FLOAT16 and node.input[0] in facts.producer:
        op = facts.producer[node.input[0]]
        up = facts.producer.get(op.input[0]) if op.input else None
        if up is None:
            return None
    else:
        return None
    if _cast_to(up) != _FLOAT or facts.specs.get(up.input[0], ((), ""))[1] != "float16":
        return None
    readers = facts.consumers.get(up.output[0], [])
    if len(readers) != 1 or readers[0].op_type not in CAST_WRAPPED or readers[0].input[0] != up.output[0]:
        return None
    op = readers[0]
    after = facts.consumers.get(op.output[0], [])
    if len(after) != 1 or _cast_to(after[0]) != _FLOAT16:
        return None
    return up, op, after[0]


def _cast_ok(node: onnx.NodeProto, facts: Facts) -> str | None:
    chain = cast_sandwich(node, facts)
    if chain is None:
        return "a Cast that is not the fp32 island of a pooling or Resize in an fp16 model"
    return RULES[chain[1].op_type].supports(chain[1], facts)


# --- lowering --------------------------------------------------------------------------------------


def _lower_conv(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    weights = tuple(w for w in node.input[1:] if w)
    if conv_kind(node, facts) == "fc":
        return KernelCall("fc", (node.input[0],), (node.output[0],), weights, (), (node.name,))
    a = _attrs(node)
    K, _, R, S = facts.shape(node.input[1])
    pads = [0] * 4 if a.get("auto_pad") == "VALID" else list(a.get("pads", [0, 0, 0, 0]))
    (sh, sw), (dh, dw) = a.get("strides", [1, 1]), a.get("dilations", [1, 1])
    mult = K // facts.shape(node.input[0])[1]
    geom = DwGeometry(R, sh, dh, (pads[0], pads[1], pads[2], pads[3]), S=S, stride_w=sw, dil_w=dw, multiplier=mult)
    return KernelCall("dwconv", (node.input[0],), (node.output[0],), weights, geom.attrs(), (node.name,))


def _lower_gap(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    op = REDUCE_OPS.get(node.op_type, REDUCE_OPS["ReduceMean"])  # GlobalAveragePool: the mean
    return KernelCall("gap", (node.input[0],), (node.output[0],), (), (("op", op),), (node.name,))


def _lower_creduce(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    return KernelCall(
        "creduce", (node.input[0],), (node.output[0],), (), (("op", REDUCE_OPS[node.op_type]),), (node.name,)
    )


def _lower_reduce(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    return _lower_gap(node, facts) if _gap_ok(node, facts) is None else _lower_creduce(node, facts)


def _lower_binary(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    parts, _ = _binary_operands(node, facts)
    assert parts is not None
    inputs, weights, op = parts
    attrs: tuple[tuple[str, int], ...] = (("op", ELTWISE_OPS[op]),)
    if weights:  # the constant's length once packed: the channels it is broadcast over
        attrs += (("C", facts.shape(inputs[0])[1]),)
    return KernelCall("eltwise", inputs, (node.output[0],), weights, attrs, (node.name,))


def _lower_square(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    x = node.input[0]
    return KernelCall("eltwise", (x, x), (node.output[0],), (), (("op", ELTWISE_OPS["mul"]),), (node.name,))


def _lower_act(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    act, _ = activation(node, facts)
    attrs = (("op", ELTWISE_OPS["unary"]), *_act_attrs(act))
    return KernelCall("eltwise", (node.input[0],), (node.output[0],), (), attrs, (node.name,))


def _lower_resize(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    attrs, _ = resize_mode(node, facts)
    assert attrs is not None
    return KernelCall("resize", (node.input[0],), (node.output[0],), (), attrs, (node.name,))


def _lower_cast(node: onnx.NodeProto, facts: Facts) -> KernelCall:
    chain = cast_sandwich(node, facts)
    assert chain is not None
    up, op, down = chain
    call = RULES[op.op_type].lower(op, facts)
    nodes = (up.name, op.name, down.name)
    return KernelCall(call.op, (up.input[0],), (down.output[0],), call.weights, call.attrs, nodes)


@dataclass(frozen=True)
class Rule:
    """One op type: whether the kernels take a node (None, or why not), the call it lowers to,
    and whether an activation after it can join its epilogue."""

    supports: Callable[[onnx.NodeProto, Facts], str | None]
    lower: Callable[[onnx.NodeProto, Facts], KernelCall]
    fuses_act: bool = False


RULES: dict[str, Rule] = {
    "Conv": Rule(_conv_ok, _lower_conv, fuses_act=True),
    "GlobalAveragePool": Rule(_gap_ok, _lower_gap),
    **{op: Rule(_reduce_ok, _lower_reduce) for op in REDUCE_OPS},
    "Add": Rule(_binary_ok, _lower_binary, fuses_act=True),
    "Mul": Rule(_binary_ok, _lower_binary, fuses_act=True),
    "Sub": Rule(_binary_ok, _lower_binary, fuses_act=True),
    "Div": Rule(_binary_ok, _lower_binary, fuses_act=True),
    "PRelu": Rule(_binary_ok, _lower_binary, fuses_act=True),
    "Pow": Rule(_square_ok, _lower_square, fuses_act=True),
    "Resize": Rule(_resize_ok, _lower_resize),
    "Cast": Rule(_cast_ok, _lower_cast),
    **{op: Rule(_act_ok, _lower_act) for op in ACT_OPS},
}


def claims(node: onnx.NodeProto, facts: Facts) -> bool:
    """Whether the node is one of this module's ops (a Conv only when depthwise or on a 1x1 vector;
    a Relu after a dense conv is partition's to fuse): the lowering answers for it, yes or no."""
    if node.op_type == "Conv":
        return conv_kind(node, facts) is not None
    return node.op_type in RULES


def supports(node: onnx.NodeProto, facts: Facts) -> str | None:
    """None when a mobile kernel takes the node, else why not (for an error message or a policy)."""
    rule = RULES.get(node.op_type)
    if rule is None:
        return f"{node.op_type} is not a mobile-kernel op"
    return rule.supports(node, facts)


@dataclass(frozen=True)
class ActChain:
    """A multi-node activation (:mod:`act_patterns`: erf- and tanh-GELU, SiLU, Mish as the exporters
    write them) that no convolution's epilogue or norm takes: its nodes in graph order and the one
    unary eltwise call they lower to."""

    nodes: tuple[str, ...]
    call: KernelCall
    # Its input is written by an op whose call fuses an activation (a depthwise conv, a binary op) and read
    # by the chain alone: lowered in that call's epilogue (partition._add_chain), no launch of its own.
    in_producer: bool = False


@dataclass
class ActChains:
    """The graph's stand-alone activation chains by node."""

    found: dict[str, ActChain] = field(default_factory=dict)

    def kernel(self, node: onnx.NodeProto) -> str | None:
        """``eltwise`` for the chain's first node (its launch is charged there), None for the others
        and for a chain in its producer's epilogue."""
        chain = self.found[node.name]
        return "eltwise" if chain.nodes[0] == node.name and not chain.in_producer else None


_ACT_KEYS = ("act", "act_p0", "act_p1")


def with_chain(call: KernelCall, chain: ActChain) -> KernelCall:
    """``call`` (of an op whose rule ``fuses_act``, writing the chain's input) computing the chain's
    activation in its epilogue and writing the chain's output."""
    act = tuple(kv for kv in chain.call.attrs if kv[0] in _ACT_KEYS)
    attrs = tuple(kv for kv in call.attrs if kv[0] not in _ACT_KEYS) + act
    return KernelCall(call.op, call.inputs, chain.call.outputs, call.weights, attrs, (*call.nodes, *chain.nodes))


def find_act_chains(facts: Facts, taken: set[str]) -> ActChains:
    """Every decomposed activation on an image tensor whose nodes no other lowering has ``taken`` (conv
    epilogues, heads, norms, attentions): one eltwise call each. Without it a GELU after a depthwise
    conv or a token view (a Mix-FFN's) would reach Track B through its Erf, which has no kernel alone,
    with two track switches, and a SiLU there would be two passes."""
    chains = ActChains()
    busy = set(taken)
    outputs = {o.name for o in facts.model.graph.output}
    for node in facts.model.graph.node:
        for t in node.output:
            spec = facts.specs.get(t)
            if spec is None or len(spec[0]) != 4 or spec[1] not in ("float16", "float32"):
                continue
            found = act_patterns.decomposed(
                t, facts.consumers, lambda n: n.name not in busy, lambda x: x not in outputs, facts.const
            )
            if found is None:
                continue
            act, nodes, y = found
            names = tuple(n.name for n in nodes)
            call = KernelCall("eltwise", (t,), (y,), (), (("op", ELTWISE_OPS["unary"]), *_act_attrs(act)), names)
            fuses = claims(node, facts) and RULES[node.op_type].fuses_act and supports(node, facts) is None
            alone = all(u.name in names for u in facts.consumers.get(t, []))
            busy.update(names)
            chains.found.update((name, ActChain(names, call, fuses and alone)) for name in names)
    return chains


def islands_together(seg: list[onnx.NodeProto], facts: Facts) -> list[onnx.NodeProto]:
    """``seg`` with each fp32 island (:func:`cast_sandwich`) moved to consecutive places, at its cast
    up: a topological order may put other nodes between its three (a Resize's island beside the branch
    it is concatenated with). Moving the op and the cast down earlier keeps the order valid when the
    op's other inputs (a Resize's scales or sizes) are not computed after the cast up in ``seg``;
    an island where they are stays where it is (and :func:`lower` refuses it)."""
    pos = {n.name: k for k, n in enumerate(seg)}
    moved: dict[str, list[onnx.NodeProto]] = {}
    for node in seg:
        chain = cast_sandwich(node, facts) if node.op_type == "Cast" and _cast_to(node) == _FLOAT else None
        if chain is None or not all(n.name in pos for n in chain):
            continue
        up, op, down = chain
        late = [
            t for t in op.input[1:] if t and t in facts.producer and pos.get(facts.producer[t].name, -1) > pos[up.name]
        ]
        if not late:
            moved[up.name] = [op, down]
    if not moved:
        return seg
    skip = {n.name for pair in moved.values() for n in pair}
    out: list[onnx.NodeProto] = []
    for node in seg:
        if node.name not in skip:
            out.append(node)
            out.extend(moved.get(node.name, []))
    return out


def lower(seg: list[onnx.NodeProto], i: int, facts: Facts, fusable: Callable[[str], bool]) -> tuple[KernelCall, int]:
    """The call for ``seg[i]`` (which :func:`supports`) and how many nodes it covers: 2 when the
    next node is an activation of its output that ``fusable(output)`` allows (one consumer, not
    leaving the segment) and the kernel can fuse."""
    node = seg[i]
    call = RULES[node.op_type].lower(node, facts)
    if node.op_type == "Cast":  # the fp32 island of an fp16 model: three nodes, in this order
        names = [n.name for n in seg[i : i + 3]]
        if names != list(call.nodes):
            raise LoweringRefused(f"its fp32 island {', '.join(call.nodes)} is not consecutive in the segment's order")
        return call, 3
    nxt = seg[i + 1] if i + 1 < len(seg) else None
    if (
        RULES[node.op_type].fuses_act
        and nxt is not None
        and nxt.op_type in ACT_OPS
        and list(nxt.input[:1]) == [node.output[0]]
        and fusable(node.output[0])
    ):
        act, why = activation(nxt, facts)
        if why is None:
            attrs = tuple(kv for kv in call.attrs if kv[0] != "act") + _act_attrs(act)
            fused = KernelCall(call.op, call.inputs, (nxt.output[0],), call.weights, attrs, (*call.nodes, nxt.name))
            return fused, 2
    return call, 1
