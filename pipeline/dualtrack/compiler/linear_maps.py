"""Linear spatial maps: an exporter's index soup over an image's pixels, rewritten as one MatMul (a front-end pass).

Exporters decompose some spatial ops into index arithmetic. torch's dynamo exporter writes
``nn.AdaptiveAvgPool2d`` with bins that do not divide the map (smp UPerNet's PSP module pools a 16x16 map
into 3x3 and 6x6 bins) as Transpose -> GatherND (constant indices) -> Transpose -> Where(constant mask, 0, x)
-> a Gather per bin offset -> chains of Add -> Div(constant counts). IREE 3.13 compiles that soup to GPU
code that computes wrong results in fp16 (UPerNet's PSP segment failed the bundle's GPU self-check at
9ad02a1), and slowly. What it computes is one fixed linear map over the spatial positions, the same for
every channel and batch row: Y[n, c] = M @ X[n, c] with M of (Ho*Wo, H*W). This pass finds such regions,
reads M off onnxruntime, checks it, and writes ``Reshape(X, [-1, C, H*W]) -> MatMul(., M^T) ->
Reshape(., [-1, C, Ho, Wo])``: a MatMul by a constant, which IREE compiles with an fp32 accumulator.

**Regions.** One starts at a non-constant 4-D float tensor X (N, C, H, W) with C, H, W static, and takes,
in graph order, every node of :data:`REGION_OPS` whose inputs are X-derived (in the region) or constants
(initializers, Constant nodes, nodes computed from constants only). Its outputs are its tensors read
outside it (or graph outputs). An output becomes a map only where an index op (:data:`INDEX_OPS`) feeds
it inside the region, and it is (N, C, Ho, Wo) with X's N and C: plain Resize, pool, pad and slice regions
are left to the passes and kernels made for them.

**The matrix** is not derived from the ops' semantics: onnxruntime (CPU, fp32; an fp16 region widened)
runs the region extracted as a model at its own batch (the export's batch may be written into the
region's constants, GatherND indices that include the batch index among them), on one-hot images carried
by the channel axis: in pass k, channel c holds a one at position k*C + c. **The check** then runs the
region on seeded random inputs, normal and of large magnitude: every output must equal M applied per
(n, c) within :data:`RTOL` of its scale (fp32), which rejects anything nonlinear (x * x), affine (a
non-zero constant added) or that mixes channels or batch rows (a Gather on the channel axis). A region that
fails, or whose M would have more than :data:`MAX_ELEMENTS` elements, stays as exported, with a note. A map
that moves no pixel (a diagonal M: ``x + x[0]`` at a batch of 1) stays too, silently: it is an element-wise
op, which a dense MatMul would only slow down.

The Reshapes write ``-1`` in dim 0, so the rewrite takes any batch and batch freeing
(:mod:`dualtrack.compiler.batch_free`) has nothing left to do in the region; H*W and Ho*Wo are written
as numbers, so a build with other input ``sizes`` refuses it (spatial.py), as it refuses the soup's own
constant indices.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.onnx_graph import fresh_name, infer_shapes, live_nodes, node_attrs, taken_names, widen_fp16

# Index and linear ops a region grows over (a Cast only between float types, a Pad only of constant mode).
REGION_OPS = frozenset(
    {
        *("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Tile", "Identity", "Cast"),
        *("Gather", "GatherND", "GatherElements", "ScatterND", "Where", "Slice", "Concat", "Pad"),
        *("Add", "Sub", "Mul", "Div", "Neg", "ReduceSum", "ReduceMean"),
    }
)
# The ops that make a region an index soup rather than a plain pool, pad or slice.
INDEX_OPS = frozenset({"Gather", "GatherND", "GatherElements", "Where", "ScatterND"})
MAX_ELEMENTS = 1 << 22  # of M (Ho*Wo x H*W): a bigger map is a worse MatMul than the soup
RTOL = 1e-5  # the region against its map, relative to the output's largest magnitude (fp32)
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
_SCALES = (1.0, 1e4)  # the check's input magnitudes: normal, and large


@dataclass(frozen=True)
class Region:
    """The nodes grown from one source tensor X, and the outputs that are maps of X's pixels."""

    source: str
    shape: tuple[int, int, int]  # (C, H, W) of the source
    nodes: tuple[int, ...]  # positions in the graph's node list
    outputs: tuple[str, ...]  # read outside the region, fed by an index op, 4-D


@dataclass(frozen=True)
class LinearMap:
    """One region output as M applied to every (n, c) image of the source: M is (Ho*Wo, H*W)."""

    output: str
    size: tuple[int, int]  # (Ho, Wo)
    matrix: np.ndarray


@dataclass
class MapReport:
    """What the pass did: the regions it rewrote (their node counts and maps) and why it left others."""

    rewritten: list[tuple[Region, int, list[LinearMap]]] = field(default_factory=list)  # region, nodes removed, maps
    left: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        if self.rewritten:
            regions, nodes = len(self.rewritten), sum(k for _, k, _ in self.rewritten)
            shown = "; ".join(
                f"'{r.source}' ({r.shape[0]}, {r.shape[1]}x{r.shape[2]}) -> "
                + ", ".join(f"'{m.output}' {m.size[0]}x{m.size[1]}" for m in maps)
                for r, _, maps in self.rewritten[:4]
            )
            more = f" and {regions - 4} more" if regions > 4 else ""
            out.append(f"{regions} region(s) ({nodes} nodes) -> MatMul by a constant spatial map: {shown}{more}")
        out += self.left
        return out


def linear_maps_as_matmuls(model: onnx.ModelProto, batch: int | None) -> tuple[onnx.ModelProto, MapReport]:
    """Every index-soup region that is a per-channel linear map of an image's pixels, as one MatMul
    (module docstring). ``batch`` is the export's fixed batch (None: symbolic, probed at 2 so that a
    region mixing batch rows shows). Returns the model (a copy where anything changed) and the report."""
    report = MapReport()
    if not any(n.op_type in INDEX_OPS for n in model.graph.node):
        return model, report
    types, shapes = _inferred(model)
    consts = _constant_tensors(model.graph)
    candidates = [t for t in _tensors_in_order(model.graph) if _is_source(t, types, shapes, consts, batch)]
    work = model  # copied before the first rewrite
    view = _View.of(work.graph)
    covered: set[str] = set()  # tensors of a region rewritten: no source of another
    refused: set[str] = set()  # tensors of a region refused: tried as sources, but not noted again
    for x in candidates:
        if x in covered or x not in view.produced:
            continue
        region = _grow(view, x, shapes[x], types, shapes, batch)
        if region is None:
            continue
        tensors = {o for i in region.nodes for o in view.nodes[i].output}
        b = shapes[x][0] if shapes[x][0] > 0 else (batch or 2)
        maps, why = _read_maps(work, region, types[x], b)
        if why:
            if x not in refused:
                report.left.append(f"left as exported: the region from '{x}' ({len(region.nodes)} nodes): {why}")
            refused |= tensors
            continue
        if not maps:
            continue
        covered |= tensors
        work = copy.deepcopy(model) if work is model else work  # the positions in region.nodes hold in a copy
        report.rewritten.append((region, _rewrite(work, region, maps, types[x]), maps))
        view = _View.of(work.graph)
    return work, report


# -- finding regions ---------------------------------------------------------------------------------------


def _inferred(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Every tensor's element type and shape under ONNX shape inference (-1 for a dim it leaves symbolic)."""
    inferred = infer_shapes(model, strict_mode=False, data_prop=True)
    types: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        types[vi.name] = t.elem_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return types, shapes


def _constant_tensors(g: onnx.GraphProto) -> set[str]:
    """Initializers, Constant nodes' outputs, and what nodes compute from those alone."""
    out = {i.name for i in g.initializer}
    for n in g.node:
        from_constants = n.op_type == "Constant" or (
            any(n.input) and all(not x or x in out for x in n.input) and not n.op_type.startswith("Random")
        )
        if from_constants:
            out.update(o for o in n.output if o)
    return out


def _tensors_in_order(g: onnx.GraphProto) -> list[str]:
    return [i.name for i in g.input] + [o for n in g.node for o in n.output if o]


def _is_source(
    name: str, types: dict[str, int], shapes: dict[str, tuple[int, ...]], consts: set[str], batch: int | None
) -> bool:
    """A non-constant float (N, C, H, W) with static C, H, W and N the batch (symbolic or the batch's value)."""
    shape = shapes.get(name, ())
    if name in consts or types.get(name) not in _FLOATS or len(shape) != 4 or min(shape[1:]) <= 0:
        return False
    return shape[0] < 0 or batch is None or shape[0] == batch


def _joins(node: onnx.NodeProto, region: set[str], consts: set[str]) -> bool:
    """Whether ``node`` is a region op reading the region and otherwise constants only."""
    if node.op_type not in REGION_OPS or not any(x in region for x in node.input):
        return False
    if not all(not x or x in region or x in consts for x in node.input):
        return False
    a = node_attrs(node)
    if node.op_type == "Cast":
        return a.get("to") in _FLOATS
    if node.op_type == "Pad":
        return a.get("mode", b"constant") in (b"constant", "constant")
    return True


@dataclass(frozen=True)
class _View:
    """What region growing asks of a graph, computed once per version of it."""

    nodes: list[onnx.NodeProto]
    readers: dict[str, list[int]]  # tensor -> positions of the nodes that read it
    produced: set[str]  # graph inputs and node outputs
    consts: set[str]
    outputs: set[str]  # the graph's

    @classmethod
    def of(cls, g: onnx.GraphProto) -> _View:
        nodes = list(g.node)
        readers: dict[str, list[int]] = defaultdict(list)
        for i, n in enumerate(nodes):
            for t in n.input:
                readers[t].append(i)
        produced = {i.name for i in g.input} | {o for n in nodes for o in n.output}
        return cls(nodes, dict(readers), produced, _constant_tensors(g), {o.name for o in g.output})


def _grow(
    view: _View,
    x: str,
    x_shape: tuple[int, ...],
    types: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    batch: int | None,
) -> Region | None:
    """The region grown from ``x`` in graph order, or None where no output of it is a map candidate."""
    tensors, nodes = {x}, []
    queue = list(view.readers.get(x, []))
    seen = set(queue)
    heapq.heapify(queue)
    while queue:  # in graph order, so a node's region inputs are decided before it is
        i = heapq.heappop(queue)
        node = view.nodes[i]
        if not _joins(node, tensors, view.consts):
            continue
        nodes.append(i)
        for o in node.output:
            tensors.add(o)
            for r in view.readers.get(o, []):
                if r not in seen:
                    seen.add(r)
                    heapq.heappush(queue, r)
    if not any(view.nodes[i].op_type in INDEX_OPS for i in nodes):
        return None
    inside = set(nodes)
    outputs = [
        o
        for i in nodes
        for o in view.nodes[i].output
        if o and (o in view.outputs or any(r not in inside for r in view.readers.get(o, [])))
    ]
    indexed = _index_fed(view.nodes, nodes)
    n, c = x_shape[0], x_shape[1]
    maps = [
        o
        for o in outputs
        if o in indexed
        and types.get(o) == types.get(x)
        and len(shapes.get(o, ())) == 4
        and shapes[o][1] == c
        and (shapes[o][0] == n or shapes[o][0] < 0 or shapes[o][0] == batch)
    ]
    if not maps:
        return None
    return Region(x, (x_shape[1], x_shape[2], x_shape[3]), tuple(nodes), tuple(maps))


def _index_fed(graph_nodes: list[onnx.NodeProto], nodes: list[int]) -> set[str]:
    """The region's tensors that an index op computes or feeds (in graph order, so one pass)."""
    out: set[str] = set()
    for i in sorted(nodes):
        n = graph_nodes[i]
        if n.op_type in INDEX_OPS or any(x in out for x in n.input):
            out.update(n.output)
    return out


# -- reading and checking the maps ----------------------------------------------------------------------


def _region_model(model: onnx.ModelProto, region: Region, elem: int, batch: int) -> onnx.ModelProto:
    """The region alone: input the source at ``batch``, outputs its map candidates, computed in fp32."""
    g = model.graph
    inside = set(region.nodes)
    consts = _constant_tensors(g)
    pool = [n for i, n in enumerate(g.node) if i in inside or (n.output and all(o in consts for o in n.output))]
    nodes = live_nodes(pool, set(region.outputs))
    used = {t for n in nodes for t in n.input}
    c, h, w = region.shape
    graph = helper.make_graph(
        nodes,
        "linear_map_probe",
        [helper.make_tensor_value_info(region.source, elem, [batch, c, h, w])],
        [helper.make_tensor_value_info(o, elem, None) for o in region.outputs],
        [i for i in g.initializer if i.name in used],
    )
    probe = helper.make_model(graph, opset_imports=list(model.opset_import))
    probe.ir_version = model.ir_version
    return widen_fp16(probe)  # the region computed in fp32


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _read_maps(model: onnx.ModelProto, region: Region, elem: int, batch: int) -> tuple[list[LinearMap], str | None]:
    """Each output's M read off one-hot images, then checked on random ones; ([], why) where it fails."""
    c, h, w = region.shape
    p = h * w
    try:
        session = _session(_region_model(model, region, elem, batch))
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types by cause
        return [], f"onnxruntime cannot run it alone ({type(e).__name__}: {str(e).strip().splitlines()[0][:120]})"
    names = [o.name for o in session.get_outputs()]
    matrices: dict[str, np.ndarray] = {}
    for k in range(math.ceil(p / c)):
        x = np.zeros((batch, c, p), np.float32)
        pos = k * c + np.arange(c)
        hit = pos < p
        x[:, np.arange(c)[hit], pos[hit]] = 1.0
        ys = session.run(None, {region.source: x.reshape(batch, c, h, w)})
        for name, y in zip(names, ys, strict=True):
            if y.ndim != 4 or y.shape[:2] != (batch, c):
                return [], f"'{name}' is {list(y.shape)} at batch {batch}, not ({batch}, {c}, Ho, Wo)"
            if y.shape[2] * y.shape[3] * p > MAX_ELEMENTS:
                size = y.shape[2] * y.shape[3] * p
                return [], f"the map of '{name}' would have {size} elements, over {MAX_ELEMENTS}"
            m = matrices.setdefault(name, np.zeros((y.shape[2] * y.shape[3], p), np.float64))
            m[:, pos[hit]] = y[0].reshape(c, -1)[hit].T
    shapes = {name: y.shape[2:] for name, y in zip(names, ys, strict=True)}
    why = _check(session, region, names, matrices, batch)
    if why:
        return [], why
    maps = [LinearMap(name, (int(shapes[name][0]), int(shapes[name][1])), matrices[name]) for name in names]
    return [m for m in maps if not _moves_nothing(m.matrix)], None


def _moves_nothing(m: np.ndarray) -> bool:
    """A diagonal map: each pixel scaled where it is (x + x[0] at a batch of 1), an element-wise product
    that a dense (H*W)^2 MatMul would only make slower; left to the ops that wrote it."""
    return m.shape[0] == m.shape[1] and not np.any(m - np.diag(np.diag(m)))


def _check(
    session: ort.InferenceSession, region: Region, names: list[str], matrices: dict[str, np.ndarray], batch: int
) -> str | None:
    """The region against its maps on seeded random inputs; None where every output agrees within RTOL."""
    c, h, w = region.shape
    rng = np.random.default_rng(0)
    for scale in _SCALES:
        x = (rng.standard_normal((batch, c, h, w)) * scale).astype(np.float32)
        flat = x.reshape(batch, c, h * w).astype(np.float64)
        for name, y in zip(names, session.run(None, {region.source: x}), strict=True):
            want = np.einsum("op,ncp->nco", matrices[name], flat)
            got = y.reshape(batch, c, -1).astype(np.float64)
            err = float(np.max(np.abs(got - want), initial=0.0))
            top = max(float(np.max(np.abs(want), initial=0.0)), float(np.max(np.abs(got), initial=0.0)))
            if err > RTOL * top:
                return (
                    f"'{name}' is not one linear map of each channel's pixels (off by {err:.3g} where the values "
                    f"reach {top:.3g}, inputs of scale {scale:g}): nonlinear, affine, or mixing channels or images"
                )
    return None


# -- the rewrite -----------------------------------------------------------------------------------------


def _rewrite(model: onnx.ModelProto, region: Region, maps: list[LinearMap], elem: int) -> int:
    """Each map's output computed by Reshape -> MatMul -> Reshape from the source (in place of the node that
    computed it), then the region's nodes that nothing reads any more removed, with the constants only they
    read; returns how many of the region's nodes were removed."""
    g = model.graph
    taken = taken_names(g)
    c, h, w = region.shape
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    flat_shape = fresh_name(f"{region.source}/pixels_shape", taken)
    flat = fresh_name(f"{region.source}/pixels", taken)
    g.initializer.append(numpy_helper.from_array(np.array([-1, c, h * w], np.int64), flat_shape))
    new: dict[str, list[onnx.NodeProto]] = {}
    for m in maps:
        out_shape, matrix = fresh_name(f"{m.output}/map_shape", taken), fresh_name(f"{m.output}/map", taken)
        product = fresh_name(f"{m.output}/map_product", taken)
        g.initializer.append(numpy_helper.from_array(np.array([-1, c, *m.size], np.int64), out_shape))
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(m.matrix.T).astype(dtype), matrix))
        new[m.output] = [
            helper.make_node("MatMul", [flat, matrix], [product], name=product),
            helper.make_node("Reshape", [product, out_shape], [m.output], name=f"{m.output}/map_reshape"),
        ]
    inside = set(region.nodes)
    nodes: list[onnx.NodeProto] = []
    for i, n in enumerate(g.node):
        group = new.get(n.output[0]) if i in inside else None
        if group is None:
            nodes.append(n)
            continue
        if not any(k.output[0] == flat for k in nodes):  # the source flattened once, before its first map
            nodes.append(helper.make_node("Reshape", [region.source, flat_shape], [flat], name=flat))
        nodes += group
    # Nodes by their first output: the region's own (the replaced producers are gone already) and the
    # constant-only nodes that feed them.
    removable = {g.node[i].output[0] for i in region.nodes if g.node[i].output[0] not in new}
    removable |= _constants_feeding(g, region)
    nodes = _without_dead(nodes, {o.name for o in g.output}, removable)
    left = {n.output[0] for n in nodes}
    removed = sum(1 for i in region.nodes if g.node[i].output[0] in new or g.node[i].output[0] not in left)
    del g.node[:]
    g.node.extend(nodes)
    used = {t for n in g.node for t in n.input} | {o.name for o in g.output}
    inits = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    produced = {t for n in g.node for t in n.output} | {i.name for i in g.input}
    vis = [vi for vi in g.value_info if vi.name in produced]
    del g.value_info[:]
    g.value_info.extend(vis)
    return removed


def _constants_feeding(g: onnx.GraphProto, region: Region) -> set[str]:
    """The first outputs of the constant-only nodes whose values the region's nodes read (directly or not)."""
    consts = _constant_tensors(g) - {i.name for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output if o in consts}
    out: set[str] = set()
    todo = [t for i in region.nodes for t in g.node[i].input if t in producer]
    while todo:
        n = producer[todo.pop()]
        if n.output[0] not in out:
            out.add(n.output[0])
            todo += [t for t in n.input if t in producer]
    return out


def _without_dead(nodes: list[onnx.NodeProto], outputs: set[str], removable: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` less the ``removable`` ones (by first output) whose outputs nothing reads."""
    while True:
        read = {t for n in nodes for t in n.input} | outputs
        dead = {n.output[0] for n in nodes if n.output[0] in removable and not any(o in read for o in n.output if o)}
        if not dead:
            return nodes
        nodes = [n for n in nodes if n.output[0] not in dead]


__all__ = ["INDEX_OPS", "MAX_ELEMENTS", "REGION_OPS", "LinearMap", "MapReport", "Region", "linear_maps_as_matmuls"]
