"""Channel splits into a leading axis written on images (a front-end pass): split attention.

ResNeSt's split-attention block (timm's ``SplitAttn``, every ``resnest`` encoder; SKNet's selective kernel,
timm's ``SelectiveKernel``, stacks its paths with ``torch.stack(paths, 1)`` instead) views its (N, r*C, H, W)
feature map as (N, r, C, H, W), sums the r "radix" branches, pools, and weighs the branches by a softmax
over r before summing them again:

    x5 = x.reshape(N, r, C, H, W);  gap = x5.sum(1).mean((2, 3))
    a = softmax(fc2(...).view(N, card, r, -1).transpose(1, 2), dim=1)     # over the r branches
    out = (x5 * a.reshape(N, r, C, 1, 1)).sum(1)

Track A has no kernel for 5-D tensors, so each block left Track A four times (27 segments for a
ResNeSt-14 U-Net). Every one of those tensors is an image's channels seen through a Reshape, and the
pass writes the arithmetic on the images themselves:

- a tensor is *flat-equivalent* to a 4-D image E when it holds E's elements in E's order per image (a
  Reshape, Flatten, Squeeze or Unsqueeze that keeps dim 0 and the per-image count, from E or from another
  such tensor);
- a 5-D (N, r, C, h, w) tensor flat-equivalent to E (N, r*C, h, w) is E's radix view: branch i is E's
  channels [i*C, (i+1)*C); a Concat on axis 1 of radix views (a stack of Unsqueezed images) is the radix
  view of their images' Concat on channels;
- Mul, Add, Sub or Div of two radix views of the same split (their h, w equal or 1, as ONNX
  broadcasts) is the same op of their images, whose result the output is the radix view of;
- ReduceSum, ReduceMean, ReduceMax or ReduceMin of a radix view over axis 1 (keepdims 0) is a Split of
  the image into its r branches and an Add (Max, Min) chain, the mean scaled by 1/r once;
- the radix softmax of two branches: softmax over (a, b) is (sigmoid(a - b), sigmoid(b - a)). A Softmax
  over an axis of size 2 of any view of a pooled (N, K, 1, 1) image of logits (timm's Reshape to
  (N, card, 2, m) and Transpose(0, 2, 1, 3), or what a simplifier left of them: the views are run on
  the logits' channel numbers) is Sigmoid of a 1x1 Conv of the logits whose weight row j is +1 at the
  channel output j reads and -1 at its partner's (exact differences, accumulated in fp32), and the
  softmax's output is flat-equivalent to that image.

Only the Reduce nodes are replaced (their outputs keep their names); the 4-D nodes are added beside the
5-D ones, which become dead and go with the front end's pruning. The values are those of the export up
to rounding: the branch sums add r values in the tensor's dtype where the export summed them at once,
and the softmax of two is computed as one sigmoid. A softmax over more than two branches is left alone
(Track B runs it, with its reason). No constant of the pass holds the batch.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dualtrack.compiler.onnx_graph import constants, fresh_name, inferred_dims, node_attrs, taken_names

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
_VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
_BINARY = ("Mul", "Add", "Sub", "Div")
_CHAINS = {"ReduceSum": "Add", "ReduceMean": "Add", "ReduceMax": "Max", "ReduceMin": "Min"}


class _Rewrite:
    """One pass over a model: the images each tensor is flat-equivalent to, and the nodes written."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.g = model.graph
        self.dims, self.elems = inferred_dims(model)
        self.consts = constants(self.g)
        self.taken = taken_names(self.g) | set(self.consts)
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.flat: dict[str, str] = {}  # tensor -> the 4-D image it is flat-equivalent to
        self.code: dict[str, tuple[str, np.ndarray]] = {}  # a pooled image's view -> (image, its channels)
        self.inits: list[onnx.TensorProto] = []
        self.done: list[str] = []
        self.reduced = 0

    # --- shapes -------------------------------------------------------------------------------------

    def known(self, name: str) -> list[int] | None:
        """The dims after the batch, where all are known, with the batch first (-1 where symbolic)."""
        d = self.dims.get(name)
        return d if d is not None and len(d) >= 2 and min(d[1:]) > 0 else None

    def image(self, name: str) -> str | None:
        """The 4-D float image ``name`` is flat-equivalent to, or None."""
        if name in self.flat:
            return self.flat[name]
        d = self.known(name)
        return name if d is not None and len(d) == 4 and self.elems.get(name) in _FLOATS else None

    def radix(self, name: str) -> tuple[str, int] | None:
        """(image, r) where ``name`` is a 5-D radix view of an (N, r*C, h, w) image."""
        d, e = self.known(name), self.image(name)
        if d is None or len(d) != 5 or e is None or e == name:
            return None
        de = self.dims[e]
        return (e, d[1]) if de[1] == d[1] * d[2] and de[2:] == d[3:] else None

    # --- nodes --------------------------------------------------------------------------------------

    def const(self, base: str, value: np.ndarray) -> str:
        name = fresh_name(base, self.taken)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], base: str, outputs: list[str] | None = None, **attrs: object):
        outs = outputs or [fresh_name(f"{base}_out", self.taken)]
        return helper.make_node(op, inputs, outs, name=fresh_name(base, self.taken), **attrs)

    def visit(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """The nodes that stand for ``node`` (itself, itself and the 4-D nodes beside it, or its 4-D form)."""
        if node.op_type in _VIEWS and node.input and node.output:
            self.view(node)
            self.moved(node)
        elif node.op_type == "Transpose" and node.input and node.output:
            self.moved(node)
        elif node.op_type in _BINARY and len(node.input) == 2:
            return [node, *self.binary(node)]
        elif node.op_type in _CHAINS and node.input:
            return self.reduce(node) or [node]
        elif node.op_type == "Softmax":
            return [node, *self.softmax(node)]
        elif node.op_type == "Concat" and node.output:
            return [node, *self.concat(node)]
        return [node]

    def view(self, node: onnx.NodeProto) -> None:
        """A view that keeps dim 0 and the per-image count: its output holds its input's image."""
        x, y = node.input[0], node.output[0]
        e, dx, dy = self.image(x), self.known(x), self.known(y)
        if e is None or dx is None or dy is None or np.prod(dx[1:]) != np.prod(dy[1:]):
            return
        if node.op_type in ("Squeeze", "Unsqueeze"):
            axes = node_attrs(node).get("axes")
            if len(node.input) > 1 and node.input[1]:
                value = self.consts.get(node.input[1])
                axes = None if value is None else value.tolist()
            if axes is None or 0 in [int(a) % (len(dx) if node.op_type == "Squeeze" else len(dy)) for a in axes]:
                return
        if node.op_type == "Flatten" and int(node_attrs(node).get("axis", 1)) != 1:
            return
        self.flat[y] = e

    def binary(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        a, b = (self.radix(t) for t in node.input)
        if a is None or b is None or a[1] != b[1]:
            return []
        da, db = self.dims[node.input[0]], self.dims[node.input[1]]
        if da[:3][1:] != db[:3][1:] or any(p != q and 1 not in (p, q) for p, q in zip(da[3:], db[3:], strict=True)):
            return []
        out = self.node(node.op_type, [a[0], b[0]], f"{node.name or node.output[0]}_image")
        self.flat[node.output[0]] = out.output[0]
        self.dims[out.output[0]] = [-1, da[1] * da[2], max(da[3], db[3]), max(da[4], db[4])]
        self.elems[out.output[0]] = self.elems.get(a[0], onnx.TensorProto.FLOAT)
        return [out]

    def concat(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """A Concat of radix views on axis 1 (``torch.stack`` of images on dim 1 is one of Unsqueezes) is
        the radix view of their images' Concat on channels."""
        d = self.known(node.output[0])
        if d is None or len(d) != 5 or int(node_attrs(node).get("axis", 0)) % 5 != 1:
            return []
        parts = [self.radix(t) for t in node.input]
        if any(p is None or self.dims[t][2:] != d[2:] for p, t in zip(parts, node.input, strict=True)):
            return []
        images = [p[0] for p in parts if p is not None]
        out = self.node("Concat", images, f"{node.name or node.output[0]}_image", axis=1)
        self.flat[node.output[0]] = out.output[0]
        self.dims[out.output[0]] = [-1, d[1] * d[2], d[3], d[4]]
        self.elems[out.output[0]] = self.elems.get(images[0], onnx.TensorProto.FLOAT)
        return [out]

    def reduce(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        attrs = node_attrs(node)
        axes = attrs.get("axes")
        if len(node.input) > 1 and node.input[1]:
            value = self.consts.get(node.input[1])
            axes = None if value is None else value.reshape(-1).tolist()
        found = self.radix(node.input[0])
        if found is None or axes is None or [int(a) % 5 for a in axes] != [1] or attrs.get("keepdims", 1) != 0:
            return None
        e, r = found
        if r < 2:
            return None
        c = self.dims[e][1] // r
        base = node.name or node.output[0]
        split = self.node("Split", [e, self.const(f"{base}_sizes", np.full(r, c, np.int64))], f"{base}_branches",
                          outputs=[fresh_name(f"{base}_branch", self.taken) for _ in range(r)], axis=1)  # fmt: skip
        nodes, acc = [split], split.output[0]
        last = node.output[0] if node.op_type != "ReduceMean" else None
        for k, part in enumerate(split.output[1:], start=1):
            final = k == r - 1 and last is not None
            step = self.node(_CHAINS[node.op_type], [acc, part], f"{base}_{k}", outputs=[last] if final else None)
            nodes.append(step)
            acc = step.output[0]
        if node.op_type == "ReduceMean":
            dtype = helper.tensor_dtype_to_np_dtype(self.elems.get(e, onnx.TensorProto.FLOAT))
            scale = self.const(f"{base}_inv", np.array(1.0 / r, dtype=dtype))
            nodes.append(self.node("Mul", [acc, scale], f"{base}_mean", outputs=[node.output[0]]))
        self.done.append(f"'{base}' over {r} branches")
        self.reduced += 1
        return nodes

    def codes(self, name: str) -> tuple[str, np.ndarray] | None:
        """(L, codes) where ``name`` is a view of a pooled (N, K, 1, 1) image L: for each of its per-image
        elements, the channel of L it holds (Reshapes, Flattens, (Un)Squeezes and Transposes that keep
        the batch first, run on L's channel numbers, as ``channel_maps`` runs a shuffle)."""
        if name in self.code:
            return self.code[name]
        d = self.known(name)
        if d is None or len(d) != 4 or d[2:] != [1, 1] or self.image(name) != name:
            return None
        return name, np.arange(d[1], dtype=np.int64).reshape(d[1:])

    def moved(self, node: onnx.NodeProto) -> None:
        """The codes of a view or Transpose of a pooled image's view (:meth:`codes`)."""
        src, d = self.codes(node.input[0]), self.known(node.output[0])
        if src is None or d is None:
            return
        if node.op_type == "Transpose":
            perm = list(node_attrs(node).get("perm", []))
            if not perm or perm[0] != 0:
                return
            self.code[node.output[0]] = (src[0], src[1].transpose([p - 1 for p in perm[1:]]))
        elif int(np.prod(d[1:])) == src[1].size:
            self.code[node.output[0]] = (src[0], src[1].reshape(d[1:]))

    def softmax(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """A softmax of two over a view of pooled logits (module docstring) as Sigmoid(Conv 1x1 of them)."""
        found = self.codes(node.input[0])
        if found is None:
            return []
        logits, code = found
        axis = int(node_attrs(node).get("axis", -1)) % (code.ndim + 1)
        if axis == 0 or code.shape[axis - 1] != 2:
            return []
        partner = np.flip(code, axis=axis - 1).reshape(-1)
        k_in, k_out = self.dims[logits][1], code.size
        weight = np.zeros((k_out, k_in, 1, 1), np.float64)
        rows = np.arange(k_out)
        np.add.at(weight[:, :, 0, 0], (rows, code.reshape(-1)), 1.0)
        np.add.at(weight[:, :, 0, 0], (rows, partner), -1.0)
        dtype = helper.tensor_dtype_to_np_dtype(self.elems.get(logits, onnx.TensorProto.FLOAT))
        base = node.name or node.output[0]
        diff = self.node("Conv", [logits, self.const(f"{base}_diff", weight.astype(dtype))], f"{base}_diff",
                         kernel_shape=[1, 1])  # fmt: skip
        sig = self.node("Sigmoid", diff.output, f"{base}_of_two")
        self.flat[node.output[0]] = sig.output[0]
        self.dims[sig.output[0]] = [-1, k_out, 1, 1]
        self.elems[sig.output[0]] = self.elems.get(logits, onnx.TensorProto.FLOAT)
        self.done.append(f"'{base}' (a softmax of two branches)")
        return [diff, sig]


def radix_views_as_images(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The model with its split-attention arithmetic on 5-D radix views written on the images (module
    docstring), and a line saying what (None: nothing; the model itself is returned)."""
    g = model.graph
    stacks = any(n.op_type == "Unsqueeze" for n in g.node)  # torch.stack's views come from Unsqueezes
    if not any(n.op_type in _CHAINS for n in g.node) or not (
        stacks or any(len(d) == 5 for d in _dims_of_reshapes(model))
    ):
        return model, None  # no 5-D views: no copy
    rw = _Rewrite(model)
    nodes = [new for node in g.node for new in rw.visit(node)]
    if not rw.reduced:
        return model, None  # a softmax or product alone is no gain: nothing reads them on images
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(rw.inits)
    listed = ", ".join(rw.done[:4]) + (f" and {len(rw.done) - 4} more" if len(rw.done) > 4 else "")
    return out, f"{len(rw.done)} split-attention reduction(s) / softmax(es) written on images: {listed}"


def _dims_of_reshapes(model: onnx.ModelProto) -> list[list[int]]:
    """The shape constants of the model's Reshapes (a cheap test for 5-D views before shape inference)."""
    consts = constants(model.graph)
    return [
        consts[n.input[1]].reshape(-1).tolist()
        for n in model.graph.node
        if n.op_type == "Reshape" and len(n.input) > 1 and n.input[1] in consts
    ]
