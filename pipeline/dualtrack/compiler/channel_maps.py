"""Channel-only data movement written as 1x1 convolutions (a front-end pass): a constant Pad over
channels, and a chain of Reshapes and Transposes that permutes channels (a channel shuffle).

Some networks widen a residual by padding its channels with zeros (MONAI's HighResNet, "option A"
ResNet shortcuts): ``Pad`` with pads on C. Track A's pad kernel pads H and W only, and a Pad of an
image's channels between two Track A convolutions would split their segment in two, so the pass
writes the channel pad as what it is arithmetically: a 1x1 Conv from C to c0 + C + c1 channels whose
weight is the identity placed at channel offset c0 (one 1 a row, zeros elsewhere) and whose bias is
the pad value on the new channels. It is exact in fp32 and fp16 alike (a product by 1 plus zeros,
accumulated in fp32), and every track runs a 1x1 Conv. Pads over H and W in the same node stay a Pad
after the Conv (a zero one the next convolution may then absorb: ``frontend.fold_zero_pads``).

A channel shuffle (ShuffleNet's Reshape (N, g, C/g, H, W), Transpose of the two channel axes, Reshape
back) moves every channel of a pixel to another place and nothing else; Track A has no kernel for the
5-D tensors in between, so the shuffle would leave Track A twice. Any chain of Reshapes and Transposes
from an (N, C, H, W) tensor to one of the same shape is run on a tensor of channel, row and column codes:
where every output value is its own pixel's, the chain is a permutation p of the channels and becomes a
1x1 Conv whose weight row k is the unit vector of channel p[k] (exact likewise).

A Pad is rewritten only where the mode is constant, the pads and value are constants, nothing pads N, no pad
is negative (a crop), and the input is 4-D with a known channel count. The one difference from the
Pad: a non-finite input value in one channel (inf, NaN) reaches the other channels of its pixel as
NaN (0 * inf), which no fp16 network that serves has. ONNX cleanup libraries (onnxslim,
onnxoptimizer) keep the Pad, and onnxruntime's optimizer rewrites inside its session only.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.lower_pad import full_pads
from dualtrack.compiler.onnx_graph import constants, fresh_name, inferred_dims

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _channel_pad(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> tuple[list[int], float] | None:
    """The Pad's 8 pads (begins, then ends, over N, C, H, W) and its value, where the pass takes it."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("mode", b"constant") not in (b"constant", "constant") or len(node.input) < 2:
        return None
    pads = consts.get(node.input[1])
    value = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros(1)
    has_axes = len(node.input) > 3 and bool(node.input[3])
    axes = consts.get(node.input[3]) if has_axes else None
    if pads is None or value is None or value.size != 1 or (has_axes and axes is None):
        return None
    full = full_pads([int(p) for p in pads.reshape(-1)], axes)
    if full is None or full[0] or full[4] or min(full) < 0 or not (full[1] or full[5]):
        return None
    return full, float(value.reshape(()))


def _image(name: str, dims: dict[str, list[int]], elems: dict[str, int]) -> bool:
    """A 4-D float tensor whose C, H and W are known."""
    d = dims.get(name)
    return d is not None and len(d) == 4 and min(d[1:]) > 0 and elems.get(name) in _FLOATS


def channel_maps_as_convs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The model with every channel Pad and channel permutation the pass takes written as a 1x1 Conv
    (a Pad over H and W after it where the node pads those too), and a line saying which (None: none)."""
    g = model.graph
    if not any(n.op_type in ("Pad", "Transpose") for n in g.node):
        return model, None  # nothing to rewrite: no shape inference, no copy
    consts = constants(g)
    pads = {k: p for k, n in enumerate(g.node) if n.op_type == "Pad" and (p := _channel_pad(n, consts)) is not None}
    chains = _chains(g) if any(n.op_type == "Transpose" for n in g.node) else []
    if not pads and not chains:
        return model, None
    dims, elems = inferred_dims(model)
    perms = [found for chain in chains if (found := _longest_permutation(chain, dims, elems, consts)) is not None]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {n.name for n in g.node} | {o for n in g.node for o in n.output} | set(consts)
    starts = {chain[0].output[0]: (chain, p) for chain, p in perms}  # by output: node names may be empty
    skip = {n.output[0] for chain, _ in perms for n in chain[1:]}
    nodes: list[onnx.NodeProto] = []
    done: list[str] = []
    for k, node in enumerate(out.graph.node):
        x = node.input[0] if node.input else ""
        if node.output and node.output[0] in skip:
            continue
        if node.output and node.output[0] in starts:
            chain, p = starts[node.output[0]]
            name = node.name or node.output[0]
            nodes.append(_permute(x, chain[-1].output[0], p, elems[x], name, out.graph, taken))
            done.append(f"shuffle '{name}'")
        elif k in pads and _image(x, dims, elems):
            full, value = pads[k]
            nodes += _as_conv(node, full, value, dims[x][1], elems[x], out.graph, taken)
            done.append(f"pad '{node.name or node.output[0]}'")
        else:
            nodes.append(node)
    return _rewritten(model, out, nodes, done, "channel Pad(s) / permutation(s) as 1x1 convolutions")


def _rewritten(
    model: onnx.ModelProto, out: onnx.ModelProto, nodes: list[onnx.NodeProto], done: list[str], what: str
) -> tuple[onnx.ModelProto, str | None]:
    """``out`` with ``nodes`` as its graph's nodes and the line naming ``done`` (the first four), or
    ``model`` itself and None where nothing was done."""
    if not done:
        return model, None
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    listed = ", ".join(done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
    return out, f"{len(done)} {what}: {listed}"


def _longest_permutation(
    chain: list[onnx.NodeProto], dims: dict[str, list[int]], elems: dict[str, int], consts: dict[str, np.ndarray]
) -> tuple[list[onnx.NodeProto], np.ndarray] | None:
    """The longest prefix of ``chain`` (two nodes at least) that permutes the channels of an image, not
    as the identity, and its permutation."""
    if not _image(chain[0].input[0], dims, elems):
        return None
    for end in range(len(chain), 1, -1):
        p = _permutation(chain[:end], dims, consts)
        if p is not None:
            return (chain[:end], p) if not np.array_equal(p, np.arange(len(p))) else None
    return None


def _permute(
    x: str, y: str, p: np.ndarray, elem: int, name: str, g: onnx.GraphProto, taken: set[str]
) -> onnx.NodeProto:
    """The 1x1 Conv y[:, k] = x[:, p[k]], its weight added to ``g``."""
    C = len(p)
    weight = np.zeros((C, C, 1, 1), np.float16 if elem == onnx.TensorProto.FLOAT16 else np.float32)
    weight[np.arange(C), p, 0, 0] = 1
    w = fresh_name(f"{name}/permutation.weight", taken)
    g.initializer.append(numpy_helper.from_array(weight, w))
    return helper.make_node("Conv", [x, w], [y], name=name, kernel_shape=[1, 1])


def _as_conv(
    node: onnx.NodeProto, full: list[int], value: float, C: int, elem: int, g: onnx.GraphProto, taken: set[str]
) -> list[onnx.NodeProto]:
    """The Conv (and the H/W Pad after it) that replace channel Pad ``node``; their weights added to ``g``."""
    c0, c1 = full[1], full[5]
    K = c0 + C + c1
    dtype = np.float16 if elem == onnx.TensorProto.FLOAT16 else np.float32
    weight = np.zeros((K, C, 1, 1), dtype)
    weight[c0 + np.arange(C), np.arange(C), 0, 0] = 1
    base = fresh_name(f"{node.name or node.output[0]}/channels", taken)
    ins = [node.input[0], f"{base}.weight"]
    g.initializer.append(numpy_helper.from_array(weight, ins[1]))
    if value != 0.0:
        bias = np.full(K, value, dtype)
        bias[c0 : c0 + C] = 0
        ins.append(f"{base}.bias")
        g.initializer.append(numpy_helper.from_array(bias, ins[2]))
    spatial = [0, 0, full[2], full[3], 0, 0, full[6], full[7]]
    if not any(spatial):
        return [helper.make_node("Conv", ins, [node.output[0]], name=node.name or base, kernel_shape=[1, 1])]
    conv = helper.make_node("Conv", ins, [base], name=base, kernel_shape=[1, 1])
    pads_name = f"{base}.pads"
    g.initializer.append(numpy_helper.from_array(np.array(spatial, np.int64), pads_name))
    rest = [base, pads_name]
    if value != 0.0:
        rest.append(f"{base}.value")
        g.initializer.append(numpy_helper.from_array(np.array(value, dtype), rest[2]))
    return [conv, helper.make_node("Pad", rest, [node.output[0]], name=node.name or f"{base}/pad", mode="constant")]


def _permutation(
    chain: list[onnx.NodeProto], dims: dict[str, list[int]], consts: dict[str, np.ndarray]
) -> np.ndarray | None:
    """The channel permutation ``chain`` (Reshapes and Transposes, first to last) computes, or None: run
    on one image of codes c * H * W + h * W + w, its every node shaped as inference found it (the batch
    dim 0 kept whole, taken as 1)."""
    x, y = chain[0].input[0], chain[-1].output[0]
    if x not in dims or dims.get(y) != dims[x]:
        return None
    _, C, H, W = dims[x]
    v = np.arange(C * H * W, dtype=np.int64).reshape(1, C, H, W)
    for node in chain:
        if node.op_type == "Transpose":
            perm = [a.ints for a in node.attribute if a.name == "perm"]
            if not perm or perm[0][0] != 0:
                return None
            v = v.transpose(list(perm[0]))
        else:
            shape = dims.get(node.output[0])
            if shape is None or node.input[1] not in consts or int(np.prod(shape[1:])) != C * H * W:
                return None
            v = v.reshape([1, *shape[1:]])
    moved = v.reshape(C, H * W)
    p = moved[:, 0] // (H * W)
    if not np.array_equal(moved, p[:, None] * (H * W) + np.arange(H * W)):
        return None  # something moved within or between pixels, not a channel permutation
    return p if sorted(p.tolist()) == list(range(C)) else None


def _chains(g: onnx.GraphProto) -> list[list[onnx.NodeProto]]:
    """Maximal runs of Reshape/Transpose nodes whose every tensor but the last is read by the next alone
    (and is no graph output)."""
    movers = ("Reshape", "Transpose")
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    outputs = {o.name for o in g.output}

    def next_of(n: onnx.NodeProto) -> onnx.NodeProto | None:
        users = readers.get(n.output[0], [])
        ok = len(users) == 1 and users[0].op_type in movers and n.output[0] not in outputs
        return users[0] if ok else None

    inside = {nxt.output[0] for n in g.node if n.op_type in movers and (nxt := next_of(n)) is not None}
    chains = []
    for n in g.node:
        if n.op_type not in movers or n.output[0] in inside:
            continue
        chain = [n]
        while (nxt := next_of(chain[-1])) is not None:
            chain.append(nxt)
        if len(chain) > 1:
            chains.append(chain)
    return chains


__all__ = ["channel_maps_as_convs"]


# -- zeros concatenated on channels ---------------------------------------------------------------------
# PyTorch ENet (and other "widen the shortcut" code) writes its channel pad as
# torch.cat([x, torch.zeros(n, k, h, w)], 1): a Concat whose other input is zeros, a constant of the
# export's batch (an initializer once the simplifier folded it) or a ConstantOfShape of shapes read
# from x. As a Concat it joins a batch-major tensor with one the batch does not run through (the batch
# cannot be freed), and Track A would leave the segment for the ConstantOfShape; it is the channel Pad
# it computes, which the pass above then writes as a 1x1 Conv.

_PASS_THROUGH = ("Expand", "Cast", "Identity")


def _zeros(t: str, producer: dict[str, onnx.NodeProto], consts: dict[str, np.ndarray]) -> bool:
    """Whether tensor ``t`` is all zeros whatever the input: a zero constant, a ConstantOfShape of
    value 0 (its default), or an Expand / Cast / Identity of one."""
    if t in consts:
        return bool(consts[t].size) and not np.any(consts[t])
    node = producer.get(t)
    if node is None:
        return False
    if node.op_type in _PASS_THROUGH:
        return _zeros(node.input[0], producer, consts)
    if node.op_type == "ConstantOfShape":
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return value is None or not np.any(numpy_helper.to_array(value))
    return False


def zero_concats_as_pads(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The model with each channel Concat of one image and zeros written as the constant Pad of that
    image's channels (zeros before it and after it: pads on C at both ends), and a line saying which
    (None: none). Taken where the Concat is along C of 4-D tensors and the zeros' N, H, W are the
    image's (or unknown N); the zeros' channel counts must be known."""
    g = model.graph
    cats = [n for n in g.node if n.op_type == "Concat" and len(n.input) > 1]
    if not cats:
        return model, None
    consts = constants(g)
    producer = {o: n for n in g.node for o in n.output}
    found = {}
    for n in cats:
        zero = [_zeros(t, producer, consts) for t in n.input]
        live = [k for k, z in enumerate(zero) if not z]
        if len(live) == 1 and any(zero):
            found[n.output[0]] = live[0]
    if not found:
        return model, None
    dims, _ = inferred_dims(model, data_prop=True)  # a ConstantOfShape's dims come from the shapes it reads
    for name, arr in consts.items():
        dims.setdefault(name, list(arr.shape))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {n.name for n in g.node} | {o for n in g.node for o in n.output} | set(consts)
    nodes, done = [], []
    for node in out.graph.node:
        live = found.get(node.output[0]) if node.op_type == "Concat" else None
        pads = None if live is None else _concat_pads(node, live, dims)
        if pads is None:
            nodes.append(node)
            continue
        base = fresh_name(f"{node.name or node.output[0]}/pads", taken)
        out.graph.initializer.append(numpy_helper.from_array(np.array(pads, np.int64), base))
        pad = helper.make_node("Pad", [node.input[live], base], [node.output[0]], name=node.name, mode="constant")
        nodes.append(pad)
        done.append(f"'{node.name or node.output[0]}'")
    return _rewritten(model, out, nodes, done, "channel Concat(s) of zeros as channel Pads")


def _concat_pads(node: onnx.NodeProto, live: int, dims: dict[str, list[int]]) -> list[int] | None:
    """The 8 pads (N, C, H, W begins, then ends) of Concat ``node`` of image ``node.input[live]`` and
    zeros, or None where the shapes do not say it is one."""
    axis = next((int(helper.get_attribute_value(a)) for a in node.attribute if a.name == "axis"), None)
    x = dims.get(node.input[live])
    if x is None or len(x) != 4 or axis not in (1, -3):
        return None
    before = after = 0
    for k, t in enumerate(node.input):
        if k == live:
            continue
        z = dims.get(t)
        if z is None or len(z) != 4 or z[1] <= 0 or z[2:] != x[2:] or min(x[2:]) <= 0:
            return None
        if z[0] not in (x[0], -1) and x[0] != -1:
            return None
        if k < live:
            before += z[1]
        else:
            after += z[1]
    return [0, before, 0, 0, 0, after, 0, 0]
