"""Parallel convolutions of one tensor, summed, merged into one convolution (a front-end pass).

Networks trained with structural re-parameterisation (RepVGG, MobileOne, FastViT's RepMixer, ACNet's
asymmetric kernels, diverse branch blocks) sum several convolutions of one input while they train: a
k x k, a 1 x 1, the input itself through a BatchNorm. They are meant to collapse into one convolution for
inference, and a graph exported from the training-time module keeps every branch (timm's MobileOne and
FastViT blocks export that way unless the user ran timm's re-parameterisation first): k + 2
convolutions, their sums and a BatchNorm where one convolution would do. A user handed the ONNX file has
no torch module to re-parameterise.

A convolution is linear in its weights, so a sum of maps of one input ``x``

    sum_i c_i * Conv(x; W_i, b_i)  +  sum_j c_j * BN_j(x)  +  d

(``c`` a constant per output channel or one value: the sums may pass through Sub, Neg, and Mul or Div by
such a constant, as RepMixer's ``x + layer_scale * (mixer(x) - norm(x))`` does) is one convolution whose
weight is the sum of the ``c_i W_i``, each placed at its own offset in the union of the branches'
windows, plus each BatchNorm's per-channel scale (or 1, for ``x`` itself) on the window's tap that reads
the output's own pixel; its bias sums the biases, the BatchNorms' shifts and ``d``. Branches merge where
that one convolution exists: the same input, stride and group count; dilations equal along every axis
where both kernels are wider than one tap, and windows that start on the same dilation grid; a
BatchNorm or identity branch needs stride 1 and as many output channels as input ones (it is then a
block-diagonal kernel under any group count). Branches that cannot join keep their own nodes; a sum with
nothing to merge is left as it is.

Exact in real arithmetic. In the model's dtype the merged weights are rounded once where the unmerged
model rounds each branch's weights and then their outputs; a merged kernel is kept only where each output
channel's weights round to the final dtype (the config's precision) within twice its rounding, as
:mod:`.scale_fold` checks its folds (a tiny layer scale times fp16 weights would land in the subnormals);
the rest are left unmerged and named in the note. The build's verification judges the result.

Written here because neither the ONNX cleanup library this project runs (onnxslim, which folds a
BatchNorm into the Conv before it) nor onnxruntime's graph optimisers merge parallel branches, and timm's
``reparameterize_model`` needs the torch module.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.onnx_graph import constants, fresh_name, inferred_dims, taken_names
from dualtrack.compiler.scale_fold import channel_vector, holds_in_dtype

_LINEAR = ("Add", "Sub", "Mul", "Div", "Neg")  # the ops a sum passes through on its way to the root


@dataclass
class _Term:
    """One branch of a sum: ``coef`` times a map of ``source`` (a convolution, or a per-channel scale
    for a BatchNorm or the identity) plus its bias."""

    coef: np.ndarray  # (K,) float64: the branch's factor per output channel in the sum
    source: str
    tensor: str  # the branch's output, as the graph has it
    nodes: list[onnx.NodeProto]  # its Conv and BatchNormalization (none: the identity)
    weight: np.ndarray | None  # (K, C/g, kh, kw) float64; None for a per-channel map
    scale: np.ndarray | None  # (K,) a per-channel map's scale
    bias: np.ndarray  # (K,)
    strides: tuple[int, int] = (1, 1)
    dilations: tuple[int, int] = (1, 1)
    group: int | None = None  # None: a per-channel map, block-diagonal under any group count
    start: tuple[int, int] = (0, 0)  # where the window starts, in input pixels, from output pixel * stride
    end_pads: tuple[int, int] = (0, 0)

    @property
    def kernel(self) -> tuple[int, int]:
        return (1, 1) if self.weight is None else (int(self.weight.shape[2]), int(self.weight.shape[3]))


class _Graph:
    """What the pass reads of the graph: constants, producers, reader counts, outputs, dims, dtypes."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.consts = constants(g)
        self.producer = {o: n for n in g.node for o in n.output}
        self.readers: dict[str, int] = {}
        for n in g.node:
            for x in n.input:
                self.readers[x] = self.readers.get(x, 0) + 1
        self.outputs = {o.name for o in g.output}
        self.dims, self.elems = inferred_dims(model)

    def private(self, t: str) -> bool:
        """Whether ``t`` is read by one node alone and is no graph output (its producer may go)."""
        return self.readers.get(t) == 1 and t not in self.outputs and t not in self.consts

    def vector(self, name: str, k: int) -> np.ndarray | None:
        """A constant of one value per channel (or one value) as a (k,) float64 vector."""
        if name not in self.consts:
            return None
        v = channel_vector(self.consts[name], k, 4)
        return None if v is None else v.astype(np.float64)


def _flatten(gr: _Graph, t: str, coef: np.ndarray, dims: list[int], inner: list, leaves: list, bias: list) -> None:
    """The sum at ``t`` as its leaves (tensor, factor), the constant shift it adds, and the nodes it
    passed through (``inner``): Add, Sub, Neg, and Mul / Div by a per-channel constant, each read once
    and of the sum's own shape (no broadcasting between branches)."""
    n = gr.producer.get(t)
    k = dims[1]
    through = n is not None and n.op_type in _LINEAR and (not inner or gr.private(t)) and gr.dims.get(t) == dims
    if through and n.op_type == "Neg":
        inner.append(n)
        _flatten(gr, n.input[0], -coef, dims, inner, leaves, bias)
        return
    if through and len(n.input) == 2:
        a, b = n.input
        va, vb = gr.vector(a, k), gr.vector(b, k)
        sign = -1.0 if n.op_type == "Sub" else 1.0
        if n.op_type in ("Add", "Sub") and va is None and vb is None:
            if gr.dims.get(a) == dims and gr.dims.get(b) == dims:
                inner.append(n)
                _flatten(gr, a, coef, dims, inner, leaves, bias)
                _flatten(gr, b, sign * coef, dims, inner, leaves, bias)
                return
        elif n.op_type in ("Add", "Sub") and (va is None) != (vb is None):
            x, v, first = (b, va, True) if va is not None else (a, vb, False)
            if gr.dims.get(x) == dims:
                inner.append(n)
                bias.append((sign if not first else 1.0) * coef * v)
                _flatten(gr, x, (sign if first else 1.0) * coef, dims, inner, leaves, bias)
                return
        elif n.op_type == "Mul" and (va is None) != (vb is None):
            x, v = (b, va) if va is not None else (a, vb)
            if gr.dims.get(x) == dims:
                inner.append(n)
                _flatten(gr, x, coef * v, dims, inner, leaves, bias)
                return
        elif n.op_type == "Div" and va is None and vb is not None and vb.all() and gr.dims.get(a) == dims:
            inner.append(n)
            _flatten(gr, a, coef / vb, dims, inner, leaves, bias)
            return
    leaves.append((t, coef))


def _term(gr: _Graph, t: str, coef: np.ndarray, k: int) -> _Term:
    """A leaf of a sum as a map of its source: its Conv or BatchNormalization where the sum alone reads
    it, else the identity of the leaf itself."""
    n = gr.producer.get(t)
    identity = _Term(coef, t, t, [], None, np.ones(k), np.zeros(k))
    if n is None or not gr.private(t):
        return identity
    ins = [x for x in n.input]
    if (
        n.op_type == "Conv"
        and len(ins) >= 2
        and ins[1] in gr.consts
        and (len(ins) < 3 or not ins[2] or ins[2] in gr.consts)
    ):
        w = gr.consts[ins[1]]
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        auto = a.get("auto_pad", b"NOTSET")
        if w.ndim != 4 or w.shape[0] != k or auto not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
            return identity
        if len(gr.dims.get(ins[0], [])) != 4:
            return identity
        pads = [0, 0, 0, 0] if auto in (b"VALID", "VALID") else [int(p) for p in a.get("pads", [0, 0, 0, 0])]
        b = gr.consts[ins[2]].astype(np.float64) if len(ins) > 2 and ins[2] else np.zeros(k)
        return _Term(
            coef,
            ins[0],
            t,
            [n],
            w.astype(np.float64),
            None,
            b,
            strides=tuple(int(s) for s in a.get("strides", [1, 1])),  # type: ignore[arg-type]
            dilations=tuple(int(d) for d in a.get("dilations", [1, 1])),  # type: ignore[arg-type]
            group=int(a.get("group", 1)),
            start=(-pads[0], -pads[1]),
            end_pads=(pads[2], pads[3]),
        )
    if n.op_type == "BatchNormalization" and len(n.output) == 1 and all(x in gr.consts for x in ins[1:5]):
        s, beta, mean, var = (gr.consts[x].astype(np.float64).reshape(-1) for x in ins[1:5])
        eps = next((helper.get_attribute_value(x) for x in n.attribute if x.name == "epsilon"), 1e-5)
        if len(s) != k or gr.dims.get(ins[0]) != gr.dims.get(t):
            return identity
        scale = s / np.sqrt(var + eps)
        inner = _term(gr, ins[0], coef, k)
        if inner.weight is not None:  # a BatchNorm of a Conv's output (no simplifier folded it): one map
            inner.weight = inner.weight * scale.reshape(-1, 1, 1, 1)
            inner.bias = inner.bias * scale + beta - mean * scale
            inner.tensor, inner.nodes = t, [*inner.nodes, n]
            return inner
        return _Term(coef, ins[0], t, [n], None, scale, beta - mean * scale)
    return identity


def _free(term: _Term, axis: int) -> bool:
    """Whether the term's dilation along ``axis`` is free (one tap wide)."""
    return term.kernel[axis] == 1


def _joins(group: list[_Term], t: _Term, channels_in: int) -> bool:
    """Whether ``t`` can be one convolution with ``group`` (all of one source)."""
    kernels = [m for m in group if m.weight is not None]
    ref = kernels[0] if kernels else group[0]
    if t.weight is None and (ref.strides != (1, 1) or channels_in != len(t.coef)):
        return False
    if t.weight is not None and kernels and (t.strides != ref.strides or t.group != ref.group):
        return False
    for axis in (0, 1):
        wide = [m for m in [*group, t] if not _free(m, axis)]
        if len({m.dilations[axis] for m in wide}) > 1:
            return False
        d = wide[0].dilations[axis] if wide else 1
        if len({m.start[axis] % d for m in [*group, t]}) > 1:
            return False
    return True


def _merged(group: list[_Term], k: int, channels_in: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """The one convolution of ``group``: weight, bias and attributes."""
    kernels = [m for m in group if m.weight is not None]
    ref = kernels[0]
    groups = int(ref.group or 1)
    dil, start, size, end_pads = [], [], [], []
    for axis in (0, 1):
        wide = [m for m in group if not _free(m, axis)]
        d = wide[0].dilations[axis] if wide else 1
        lo = min(m.start[axis] for m in group)
        hi = max(m.start[axis] + d * (m.kernel[axis] - 1) for m in group)
        ref_end = ref.start[axis] + d * (ref.kernel[axis] - 1)
        dil.append(d)
        start.append(lo)
        size.append((hi - lo) // d + 1)
        end_pads.append(ref.end_pads[axis] + (hi - ref_end))
    w = np.zeros((k, channels_in // groups, size[0], size[1]))
    b = np.zeros(k)
    for m in group:
        oh, ow = ((m.start[a] - start[a]) // dil[a] for a in (0, 1))
        if m.weight is not None:
            kh, kw = m.kernel
            w[:, :, oh : oh + kh, ow : ow + kw] += m.coef.reshape(-1, 1, 1, 1) * m.weight
        else:
            rows = np.arange(k)
            w[rows, rows % (channels_in // groups), oh, ow] += m.coef * m.scale
        b += m.coef * m.bias
    attrs = {
        "kernel_shape": size,
        "strides": list(ref.strides),
        "dilations": dil,
        "group": groups,
        "pads": [-start[0], -start[1], end_pads[0], end_pads[1]],
    }
    return w, b, attrs


def merge_branches(
    model: onnx.ModelProto, dtype: np.dtype | None = None
) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """``model`` with every sum of parallel convolutions (and BatchNorms, and the identity) of one input
    written as one convolution; returns it, the sums merged (their output names, with the number of
    branches) and, for each merged kernel refused for ``dtype``'s range (default: the weights' own), a
    line saying why."""
    model = copy.deepcopy(model)
    g = model.graph
    gr = _Graph(model)
    taken = taken_names(g)
    merged: list[str] = []
    refused: list[str] = []
    gone: set[int] = set()  # ids of the nodes the merged sums replace
    replace: dict[int, list[onnx.NodeProto]] = {}  # id of a sum's root -> the nodes written in its place
    for root in reversed(list(g.node)):
        if id(root) in gone or root.op_type not in _LINEAR:
            continue
        dims = gr.dims.get(root.output[0])
        if dims is None or len(dims) != 4 or dims[1] <= 0:
            continue
        k = dims[1]
        inner: list[onnx.NodeProto] = []
        leaves: list[tuple[str, np.ndarray]] = []
        shifts: list[np.ndarray] = []
        _flatten(gr, root.output[0], np.ones(k), dims, inner, leaves, shifts)
        terms = [_term(gr, t, np.broadcast_to(c, (k,)).astype(np.float64), k) for t, c in leaves]
        groups: list[list[_Term]] = []
        for t in sorted(terms, key=lambda t: t.weight is None):  # kernels first: a per-channel map joins them
            cin = gr.dims.get(t.source, [0, 0])[1]
            home = next((grp for grp in groups if grp[0].source == t.source and _joins(grp, t, cin)), None)
            if home is None or (t.weight is None and not any(m.weight is not None for m in home)):
                groups.append([t])
            else:
                home.append(t)
        out: list[tuple[str, np.ndarray]] = []  # the sum's terms after merging: (tensor, factor)
        nodes: list[onnx.NodeProto] = []
        merged_here = 0
        shift = np.sum(shifts, axis=0) if shifts else np.zeros(k)
        for grp in groups:
            kernels = [m for m in grp if m.weight is not None]
            if len(grp) < 2 or not kernels:
                out.extend((m.tensor, m.coef) for m in grp)
                continue
            cin = kernels[0].weight.shape[1] * int(kernels[0].group or 1)
            own = gr.consts[kernels[0].nodes[0].input[1]].dtype
            final = np.dtype(dtype) if dtype is not None else own
            w, b, attrs = _merged(grp, k, cin)
            if not merged_here:
                b = b + shift  # the sum's constant shift rides on its first merged convolution
            if not (holds_in_dtype(w, final) and holds_in_dtype(b.reshape(1, -1), final, absolute=True)):
                why = f"{len(grp)} branches of '{grp[0].source}' would leave {final}'s range merged"
                refused.append(f"'{root.output[0]}': {why}")
                out.extend((m.tensor, m.coef) for m in grp)
                continue
            base = fresh_name(f"{root.output[0]}__merged", taken)
            wi = numpy_helper.from_array(w.astype(own), fresh_name(f"{base}.weight", taken))
            bi = numpy_helper.from_array(b.astype(own), fresh_name(f"{base}.bias", taken))
            g.initializer.extend([wi, bi])
            # Named as the first branch's Conv was (it goes): rules and reports that name it still find it.
            name = kernels[0].nodes[0].name or base
            conv = helper.make_node("Conv", [grp[0].source, wi.name, bi.name], [base], name=name, **attrs)
            nodes.append(conv)
            out.insert(merged_here, (base, np.ones(k)))
            gone.update(id(x) for m in grp for x in m.nodes)
            merged_here += 1
            merged.append(f"'{root.output[0]}' ({len(grp)} branches)")
        if not merged_here:
            continue
        if len(out) == 1:  # one convolution is the whole sum
            nodes[-1].output[0] = root.output[0]
        else:
            nodes += _sum(out, root.output[0], gr.elems.get(root.output[0]), taken, g)
        gone.update(id(n) for n in inner)
        gone.add(id(root))
        replace[id(root)] = nodes
    if not replace:
        return model, merged, refused
    kept: list[onnx.NodeProto] = []
    for n in g.node:
        if id(n) in replace:
            kept.extend(replace[id(n)])
        elif id(n) not in gone:
            kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    used = {x for n in g.node for x in n.input} | gr.outputs
    inits = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    stale = [v for v in g.value_info if v.name not in used]
    for v in stale:
        g.value_info.remove(v)
    return model, merged, refused


def _sum(
    terms: list[tuple[str, np.ndarray]], out: str, elem: int | None, taken: set[str], g: onnx.GraphProto
) -> list[onnx.NodeProto]:
    """Nodes writing ``out`` = the sum of ``terms`` (tensor, per-channel factor): Adds and Subs, a Mul by
    a (K, 1, 1) constant where a factor is neither 1 nor -1. The first term is a merged convolution (factor 1)."""
    nodes: list[onnx.NodeProto] = []
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else np.float32
    acc = terms[0][0]
    for i, (t, c) in enumerate(terms[1:], start=1):
        sign = -1.0 if np.all(c == -1.0) else 1.0
        if sign > 0 and not np.all(c == 1.0):
            ci = numpy_helper.from_array(c.reshape(-1, 1, 1).astype(dtype), fresh_name(f"{out}__factor", taken))
            g.initializer.append(ci)
            scaled = fresh_name(f"{out}__scaled", taken)
            nodes.append(helper.make_node("Mul", [t, ci.name], [scaled], name=fresh_name(f"{out}__scale", taken)))
            t = scaled
        name = out if i == len(terms) - 1 else fresh_name(f"{out}__sum", taken)
        op = "Sub" if sign < 0 else "Add"
        nodes.append(helper.make_node(op, [acc, t], [name], name=fresh_name(f"{out}__{op.lower()}", taken)))
        acc = name
    return nodes


__all__ = ["merge_branches"]
