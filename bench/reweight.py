"""Carry a corpus bundle to the GPU machine without its weights, and grow them back there, byte for byte.

    python bench/reweight.py seal BUNDLE [SHARING ...]   # here, after `dualtrack build`
    python bench/reweight.py regrow BUNDLE [SHARING ...]  # on the GPU machine, before loading

Why: the carry is 64 MiB a call and a ResNet-34 corpus model's fp16 weights alone are ~48 MB, so the
corpus cannot travel with its weights. Timing does not depend on the weights' values, only on their
shapes, provided they keep the activations' scale (no overflow to inf, no denormals). So ``seal``
replaces the bundle's weights with values a seeded generator draws (numpy's PCG64, the same bytes on
every platform and numpy version): per output channel (a tensor's leading dimension) the same mean and
standard deviation as the export's, tensors of at most ``EXACT_MAX`` elements kept as they are. Those
statistics alone do not keep the activations' scale: decorrelated draws lose the export's structure
(small weights on large input channels...) and activations grow layer after layer until fp16 overflows
(smp PAN, MAnet, ResNeXt-50, FCN-ResNet50 did). So ``seal`` then calibrates (:func:`calibrate`, like
LSUV init): the Conv, ConvTranspose, Gemm and MatMul weights it drew are rescaled in topological order,
per output channel where the weight's rows are the channels (else one factor), so that each node's
output RMS (bias aside) on a seeded input at the bundle's size equals the export's there. It writes what
is needed to draw them again (``weights.regrow.npz``: per-channel statistics, calibration factors and the
small tensors, a few hundred KB: regrow runs no network), recomputes the reference cases
(``verify/cases.npz``: onnxruntime on the re-weighted model) and the manifest's hashes. ``regrow``
draws ``weights.bin`` again from that file and checks its SHA-256 against the manifest (the bundle then
opens with every hash checked); reference cases it lacks (they weigh ~6 MB at 512x512 and need not
travel) it recomputes with onnxruntime there, recording their new hash.

``SHARING``: other bundles of the same model (the IREE-alone bundle beside a corpus bundle) get the
same weights.bin and their own cases; their manifests are updated alike. The torch rows of
bench/zoo_bench.py build their own network from the seeded export and are checked against their own
fp32 run (not against the bundle's re-weighted model).

Not for serving: a bench tool. A sealed bundle's ``ModelInfo.source_sha256`` still names the export it
was built from, its weights are not that export's, and ``weights.regrow.npz`` in its file list says so.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "pipeline"))

from dualtrack.atomic import write_bytes  # noqa: E402
from dualtrack.contract.bundle import CASES, MANIFEST, WEIGHTS, Bundle, model_digest, sha256  # noqa: E402
from dualtrack.contract.manifest import Manifest  # noqa: E402

REGROW = "weights.regrow.npz"
EXACT_MAX = 4096  # tensors this small (biases, norm scales, small heads) travel as they are
CALIBRATED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # weight in input 1
PASS_THROUGH = ("Cast", "Identity")  # value-preserving nodes between a weight's initializer and its layer
CALIBRATION_SEED = 0
CALIBRATION_BATCH = 1  # images; a free batch dimension takes it
INPUT_DTYPES = {TensorProto.UINT8: np.uint8, TensorProto.FLOAT16: np.float16, TensorProto.FLOAT: np.float32}


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def draw(
    name: str, shape: tuple[int, ...], dtype: str, mean: np.ndarray, std: np.ndarray, scale: np.ndarray | None = None
) -> np.ndarray:
    """A tensor's seeded values: per leading index k, (mean[k] + std[k] * N(0, 1)) * scale[k], in its dtype
    (float64 arithmetic, one rounding: the same bytes here and on the GPU machine)."""
    rows = shape[0] if shape else 1
    z = _rng(name).standard_normal((rows, int(np.prod(shape[1:], dtype=np.int64)) if shape else 1))
    v = mean[:, None] + std[:, None] * z
    if scale is not None:
        v = v * scale[:, None]
    return v.astype(dtype).reshape(shape)


def drawn(name: str, shape: tuple[int, ...], dtype: str, regrow: np.lib.npyio.NpzFile | dict) -> np.ndarray:
    """A drawn tensor's values from the regrow file's entries (its calibration scale where it has one)."""
    scale = regrow.get(f"scale/{name}")
    return draw(name, shape, dtype, regrow[f"mean/{name}"], regrow[f"std/{name}"], scale)


def _stats(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = w.astype(np.float64).reshape(w.shape[0] if w.ndim else 1, -1)
    return rows.mean(axis=1), rows.std(axis=1)


def statistics(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The regrow file's entries before calibration: ``exact/<name>`` for a small or non-float tensor,
    ``mean/<name>`` and ``std/<name>`` (per leading index) for one to draw."""
    regrow: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if w.size <= EXACT_MAX or w.ndim == 0 or not np.issubdtype(w.dtype, np.floating):
            regrow[f"exact/{name}"] = np.array(w)
        else:
            regrow[f"mean/{name}"], regrow[f"std/{name}"] = _stats(np.asarray(w))
    return regrow


def _grown(manifest: dict, regrow: np.lib.npyio.NpzFile | dict) -> bytes:
    """weights.bin's bytes from the manifest's index and the regrow file."""
    size = max((w["offset"] + w["length"] for w in manifest["weights"].values()), default=0)
    out = bytearray(size)
    for name, w in manifest["weights"].items():
        if f"exact/{name}" in regrow:
            arr = np.asarray(regrow[f"exact/{name}"])
        else:
            arr = drawn(name, tuple(w["shape"]), w["dtype"], regrow)
        data = np.ascontiguousarray(arr.astype(np.dtype(w["dtype"]).newbyteorder("<"))).tobytes()
        assert len(data) == w["length"], name
        out[w["offset"] : w["offset"] + w["length"]] = data
    return bytes(out)


@dataclass(frozen=True)
class Layer:
    """A node whose weight ``seal`` draws and then rescales so that its output keeps the export's scale."""

    output: str  # the node's output tensor, measured
    weight: str  # the drawn initializer behind its weight input
    per_row: bool  # the weight's leading dimension is the output's channel axis: one factor per channel
    axis: int  # the output's channel axis
    bias: str | None  # an initializer added after the product: subtracted before measuring, never scaled
    bias_mul: float  # Gemm's beta


def _layer(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], drawn_names: set[str]) -> Layer | None:
    if node.op_type not in CALIBRATED_OPS or len(node.input) < 2:
        return None
    weight = node.input[1]
    while weight in producers and producers[weight].op_type in PASS_THROUGH:
        weight = producers[weight].input[0]
    if weight not in drawn_names:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    # ConvTranspose's leading dimension is its input channels and MatMul's B is (K, N): one factor per tensor.
    per_row = node.op_type == "Conv" or (node.op_type == "Gemm" and attrs.get("transB", 0) == 1)
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    axis = 1 if node.op_type.startswith("Conv") else -1
    return Layer(node.output[0], weight, per_row, axis, bias, float(attrs.get("beta", 1.0)))


def waves(graph: onnx.GraphProto, drawn_names: set[str]) -> list[list[Layer]]:
    """The calibrated layers by depth: a layer of wave d reads only tensors that layers of waves < d
    (and uncalibrated nodes) make, so it is measured with its inputs settled. A weight that several
    nodes read (directly or through a Cast) stays uncalibrated: one factor cannot suit them all."""
    producers = {o: n for n in graph.node for o in n.output}
    readers = Counter(i for n in graph.node for i in set(n.input))
    shared = {w for w, k in readers.items() if k > 1}
    level: dict[str, int] = {}
    out: list[list[Layer]] = []
    for node in graph.node:  # ONNX keeps nodes in topological order
        depth = max((level.get(i, 0) for i in node.input), default=0)
        layer = _layer(node, producers, drawn_names)
        if layer is not None and not {layer.weight, node.input[1]} & shared:
            depth += 1
            out.extend([] for _ in range(depth - len(out)))
            out[depth - 1].append(layer)
        for o in node.output:
            level[o] = depth
    return out


def _inputs(graph: onnx.GraphProto, drawn_names: set[str]) -> dict[str, np.ndarray]:
    """Seeded calibration inputs at the graph's own size: uniform bytes for an image, N(0, 1) otherwise;
    a free dimension (the batch) CALIBRATION_BATCH."""
    rng = np.random.default_rng(CALIBRATION_SEED)
    feeds = {}
    for i in graph.input:
        if i.name in drawn_names:
            continue
        t = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else CALIBRATION_BATCH for d in t.shape.dim]
        dtype = INPUT_DTYPES.get(t.elem_type)
        if dtype is None:
            raise SystemExit(f"reweight: input '{i.name}' is not uint8 or float; calibration draws those only")
        raw = rng.integers(0, 256, shape) if dtype == np.uint8 else rng.standard_normal(shape)
        feeds[i.name] = raw.astype(dtype)
    return feeds


def _rms(y: np.ndarray, layer: Layer, bias: np.ndarray | None) -> np.ndarray:
    """The output's RMS without its bias: per channel for a per-row layer, else one value."""
    y = y.astype(np.float64)
    if bias is not None:
        b = layer.bias_mul * bias.astype(np.float64)
        y = y - (b.reshape(-1, *[1] * (y.ndim - 2)) if layer.axis == 1 and b.ndim == 1 else b)
    rows = np.moveaxis(y, layer.axis, 0).reshape(y.shape[layer.axis], -1) if layer.per_row else y.reshape(1, -1)
    return np.sqrt(np.mean(rows * rows, axis=1))


def _submodel(model: onnx.ModelProto, nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray]) -> bytes:
    """``nodes`` as a model of their own: ``feeds`` its inputs, the model's other initializers they read
    its initializers, every tensor they make an output."""
    made = {o for n in nodes for o in n.output if o}
    read = {i for n in nodes for i in n.input if i and i not in made}
    inits = [i for i in model.graph.initializer if i.name in read and i.name not in feeds]
    inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()
    ]
    outputs = [helper.make_empty_tensor_value_info(o) for n in nodes for o in n.output if o]
    graph = helper.make_graph(nodes, "slice", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version).SerializeToString()


@dataclass
class _Run:
    """The drawn network computed slice by slice: ``values`` holds the tensors computed so far that a node
    still to come reads; a slice computes just what the next wave's layers need from them, so a seal costs
    about two forward passes, not one per wave."""

    model: onnx.ModelProto
    values: dict[str, np.ndarray]
    producer: dict[str, int] = field(default_factory=dict)
    readers: dict[str, set[int]] = field(default_factory=dict)
    final: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        for k, n in enumerate(self.model.graph.node):
            self.producer.update((o, k) for o in n.output if o)
            for i in n.input:
                self.readers.setdefault(i, set()).add(k)

    def compute(self, wanted: list[str], weights: dict[str, np.ndarray]) -> None:
        """Put ``wanted`` into ``values``, the drawn weights as ``weights`` holds them now."""
        todo, stack = set(), list(wanted)
        while stack:
            t = stack.pop()
            if t in self.values or t not in self.producer or self.producer[t] in todo:
                continue
            todo.add(self.producer[t])
            stack.extend(self.model.graph.node[self.producer[t]].input)
        nodes = [self.model.graph.node[k] for k in sorted(todo)]  # the model's (topological) order
        made = {o for n in nodes for o in n.output}
        read = {i for n in nodes for i in n.input if i and i not in made}
        feeds = {i: self.values[i] for i in read if i in self.values} | {i: weights[i] for i in read if i in weights}
        session = ort.InferenceSession(_submodel(self.model, nodes, feeds), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        self.values.update(zip(names, session.run(names, feeds), strict=True))
        self.final |= todo

    def settle(self, measured: list[str]) -> None:
        """The layers just measured are computed again with their scaled weights when a later slice reads
        them: forget their outputs, and every tensor that no node still to come reads."""
        for t in measured:
            self.values.pop(t, None)
            self.final.discard(self.producer[t])
        for t in [t for t in self.values if self.readers.get(t, set()) <= self.final]:
            del self.values[t]


def _export_rms(model: onnx.ModelProto, layers: list[Layer], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The export's RMS at each layer: one onnxruntime run with the layers' outputs as its outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.extend(helper.make_empty_tensor_value_info(layer.output) for layer in layers)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    ys = session.run([layer.output for layer in layers], feeds)
    export = {i.name: i for i in model.graph.initializer}
    bias = {la.output: numpy_helper.to_array(export[la.bias]) if la.bias in export else None for la in layers}
    return {la.output: _rms(y, la, bias[la.output]) for la, y in zip(layers, ys, strict=True)}


def calibrate(model: onnx.ModelProto, regrow: dict[str, np.ndarray]) -> str:
    """Add ``scale/<weight>`` to ``regrow`` for each calibrated layer (LSUV-like): with the layers before
    it already scaled, its output's RMS without bias (per channel where the weight's rows are the
    channels) on a seeded input equals the export's at that node. Decorrelated draws lose the export's
    scale structure and activations grow layer after layer (fp16 overflows in deep nets); this keeps every
    layer at the export's scale. ``model`` carries the export's weights. Returns a line for the log."""
    start = time.perf_counter()
    inits = {i.name: i for i in model.graph.initializer}
    shapes = {k: (tuple(i.dims), helper.tensor_dtype_to_np_dtype(i.data_type)) for k, i in inits.items()}
    names = {k.removeprefix("mean/") for k in regrow if k.startswith("mean/")}
    plan = waves(model.graph, names)
    layers = [layer for wave in plan for layer in wave]
    if not layers:
        return "calibration: no drawn Conv/ConvTranspose/Gemm/MatMul weight"
    feeds = _inputs(model.graph, names)
    target = _export_rms(model, layers, feeds)
    fed = {n: drawn(n, *shapes[n], regrow) for n in names}
    run = _Run(model, dict(feeds))
    for wave in plan:
        run.compute([layer.output for layer in wave], fed)
        for layer in wave:
            bias = None
            if layer.bias in fed or layer.bias in inits:
                bias = fed[layer.bias] if layer.bias in fed else numpy_helper.to_array(inits[layer.bias])
            have, want = _rms(run.values[layer.output], layer, bias), target[layer.output]
            factor = np.where(np.isfinite(have) & (have > 0), want / np.where(have > 0, have, 1.0), 1.0)
            rows = shapes[layer.weight][0][0]
            regrow[f"scale/{layer.weight}"] = factor if layer.per_row else np.full(rows, factor[0])
            fed[layer.weight] = drawn(layer.weight, *shapes[layer.weight], regrow)
        run.settle([layer.output for layer in wave])
    x = next(iter(feeds.values()))
    return (
        f"calibration: {len(layers)} layers in {len(plan)} waves on a seeded {'x'.join(map(str, x.shape))} "
        f"input, {time.perf_counter() - start:.0f} s"
    )


def _cases(bundle_dir: Path, seed: int, missing_only: bool = False) -> dict[str, bytes]:
    """The reference cases of every input size the bundle holds (one file a size: ``CASES`` for its own
    size, ``sizes/<HxW>/verify/cases.npz`` for configs/unet_sizes.yaml's others), by file; with
    ``missing_only`` those whose file is absent (they need not travel)."""
    from dualtrack.compiler.bundle_writer import load_model  # onnx + onnxruntime: here and on the GPU machine
    from dualtrack.compiler.verify import reference_cases

    # Not Bundle.open: the cases being made are missing or stale; the weights were checked before.
    b = Bundle(bundle_dir, Manifest.from_json(json.loads((bundle_dir / MANIFEST).read_text()), str(bundle_dir)))
    views = [b.at_size(size) for size in b.sizes] if b.size is not None else [b]
    return {
        v.cases_file: reference_cases(load_model(v), v.plan, seed).to_bytes()
        for v in views
        if not (missing_only and (bundle_dir / v.cases_file).is_file())
    }


JUDGE_SEEDS = (0, 1, 2)  # the further image seeds _judged measures a drawn network's fp16 error on


def _judged(bundle_dir: Path, seed: int) -> dict[str, float]:
    """The bundle's tolerance judged again on its (re-weighted) model as the build judges it, on the
    images of its reference cases (``seed``), without the build's ceiling: drawn weights can make a
    network that fp16 itself computes far from fp32 on some image (LR-ASPP's drawn network: a
    probability off by 0.91 with fp16 storage in onnxruntime, on the CPU as on the GPU), which the
    build would refuse as not servable in fp16; the bench times it against its own fp16 floor, and
    says so."""
    from dualtrack.compiler.bundle_writer import load_model
    from dualtrack.compiler.verify import FP16_CEILING, judged_tolerance

    b = Bundle(bundle_dir, Manifest.from_json(json.loads((bundle_dir / MANIFEST).read_text()), str(bundle_dir)))
    model = load_model(b)
    # The cases' images, and JUDGE_SEEDS' more: how far rounding moves a drawn network's answer varies
    # from image to image (LR-ASPP's: a probability off by 0.12 on one image, by 0.91 on the next), and
    # fp16 storage in onnxruntime rounds elsewhere than the kernels do, so a few images more measure
    # how sensitive the network is rather than one image's luck.
    judged = [judged_tolerance(model, b.plan, s, ceiling=None) for s in (seed, *JUDGE_SEEDS)]
    tol = max((t for t, _ in judged), key=lambda t: (t.max_abs, t.rel_l2))
    tol = type(tol)(rel_l2=max(t.rel_l2 for t, _ in judged), max_abs=tol.max_abs, mismatch=tol.mismatch)
    if tol.rel_l2 > FP16_CEILING.rel_l2 or tol.max_abs > FP16_CEILING.max_abs:
        print(
            f"{bundle_dir}: the drawn network is past the build's fp16 ceiling (fp16 storage off by up to rel_l2 "
            f"{tol.rel_l2 / 2:.3g}, max_abs {tol.max_abs / 2:.3g}): its bench rows are checked at twice that"
        )
    return tol.to_json()


def _record(bundle_dir: Path, manifest: dict, files: dict[str, bytes]) -> None:
    """Write ``files`` into the bundle and their hashes (and the model's identity) into its manifest."""
    for rel, data in files.items():
        write_bytes(bundle_dir / rel, data)
        manifest["files"][rel] = sha256(data)
    manifest["files"] = dict(sorted(manifest["files"].items()))
    manifest["model"]["sha256"] = model_digest(manifest["files"])
    write_bytes(bundle_dir / MANIFEST, json.dumps(manifest, indent=2).encode())


def seal(bundle_dir: Path, sharing: list[Path]) -> None:
    b = Bundle.open(bundle_dir)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    regrow = statistics(b.weights)
    from dualtrack.compiler.bundle_writer import load_model

    print(calibrate(load_model(b), regrow))
    del b
    weights = _grown(manifest, regrow)
    seed = int(np.load(bundle_dir / CASES)["seed"])
    regrow["cases_seed"] = np.int64(seed)
    buf = BytesIO()
    np.savez_compressed(buf, **regrow)
    for d in (bundle_dir, *sharing):
        m = json.loads((d / MANIFEST).read_text())
        _record(d, m, {WEIGHTS: weights, REGROW: buf.getvalue()})
        if m.get("tolerance") and not m["config"].get("verify", {}).get("tolerance"):
            m["tolerance"] = _judged(d, seed)  # the re-weighted network's fp16 error, not the export's
        m["verification"] = None  # the build's checks were of the export's weights, not these
        _record(d, m, _cases(d, seed))
        Bundle.open(d)  # every hash checks out
        kb = len(buf.getvalue()) / 1e3
        print(f"sealed {d}: {len(weights) / 1e6:.1f} MB of weights, drawn again from {REGROW} ({kb:.0f} KB)")


def regrow(bundle_dir: Path, sharing: list[Path]) -> None:
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    with np.load(bundle_dir / REGROW) as z:
        stored = {k: z[k] for k in z.files}
    weights = _grown(manifest, stored)
    if sha256(weights) != manifest["files"][WEIGHTS]:
        raise SystemExit(f"{bundle_dir}: the regrown {WEIGHTS} does not match its recorded hash (another numpy?)")
    for d in (bundle_dir, *sharing):
        m = json.loads((d / MANIFEST).read_text())
        write_bytes(d / WEIGHTS, weights)
        _record(d, m, _cases(d, int(stored["cases_seed"]), missing_only=True))
        Bundle.open(d)
        print(f"regrew {d}: {len(weights) / 1e6:.1f} MB of weights, hashes checked")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("seal", "regrow"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    (seal if argv[0] == "seal" else regrow)(Path(argv[1]), [Path(p) for p in argv[2:]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
