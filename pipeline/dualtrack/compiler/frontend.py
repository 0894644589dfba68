"""The front end: turn what exporters produce into what the pipeline needs, and say what changed.

Stages, in order, each a function ``(model, ...) -> model`` that records its rewrites:

    load_model -> weights_out_of_inputs -> upgrade_opset -> symbolic_batch -> simplify
    -> linear_spatial_maps -> free_batch -> static_resize_scales -> channel_pad_convs -> fold_zero_pads
    -> unique_parameter_keys
    -> convert_precision
    -> wrap_image_io

The generic work is done by libraries: opset upgrades by ``onnx.version_converter``, constant
folding, shape-op folding, Identity and dead-node elimination by onnxslim, fp16 conversion by
onnxconverter-common. onnxslim was chosen over onnxsim (a C++ extension whose wheels lag Python
releases) and onnxscript's optimizer (it folds, but its rewriter also emits ops outside the
standard domain): it is pure Python, folds through its own symbolic shape inference (so the
symbolic batch survives) and keeps node and tensor names. Only what is specific to dualtrack is
written here: making the batch dimension generic, the IREE parameter-name rule, and the image
pre/post-processing the runtime and the service expect.

A model whose outputs might change under a rewrite is never trusted: :func:`dualtrack.compiler.verify.check_frontend`
runs the processed model against the exported one (image by image where the export fixed the batch)
before anything is compiled.
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.batch_free import BATCH, free_batch, replace_input, static_shapes, symbolic_batch, with_batch
from dualtrack.compiler.branch_merge import merge_branches
from dualtrack.compiler.channel_maps import channel_maps_as_convs, zero_concats_as_pads
from dualtrack.compiler.channels_last import channels_first
from dualtrack.compiler.config import BuildConfig, Postprocess, Preprocess
from dualtrack.compiler.convt_phases import sub_pixel_convolutions
from dualtrack.compiler.iree_forms import (
    F16_ACCUMULATED,
    WIDENED,
    matrix_matmuls,
    reshaped_forms,
    signed_powers,
    widened_unsigned,
)
from dualtrack.compiler.linear_maps import linear_maps_as_matmuls
from dualtrack.compiler.lower_pad import full_pads
from dualtrack.compiler.onnx_graph import (
    TARGET_OPSET,
    as_float32,
    check_model,
    fp32_only_ops,
    infer_shapes,
    inferred_dims,
    name_nodes,
    node_attrs,
    resize_scale,
)
from dualtrack.compiler.onnx_graph import constants as _graph_constants
from dualtrack.compiler.pooled_vectors import vectors_as_images
from dualtrack.compiler.radix_views import radix_views_as_images
from dualtrack.compiler.resize_maps import iree_cannot_lower, resize_maps, widened_axes
from dualtrack.compiler.row_order import rows_batch_major
from dualtrack.compiler.scale_fold import fold_channel_affines
from dualtrack.compiler.token_layout import tokens_as_images
from dualtrack.contract.checks import MASK, PROBS
from dualtrack.contract.plan import parameter_key
from dualtrack.errors import ConfigError, DualtrackError, InternalError, ModelError

IR_INITIALIZERS_APART = 4  # the first ONNX IR version in which an initializer need not be a graph input
IMAGE = "image"  # the wrap's input; its outputs MASK and PROBS are named in contract/checks.py
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
# ITU-R BT.601's luma weights of R, G, B (what Pillow's convert("L") computes, there rounded to an integer):
# `preprocess.color: GRAY` feeds a one-channel model this sum; R = G = B gives that value back.
LUMA = np.array([0.299, 0.587, 0.114], np.float32)
# onnxslim fusions that would emit ops newer than TARGET_OPSET (Gelu is opset 20).
_SKIP_FUSIONS = ["FusionGelu"]
# Reductions stay fp32 when a model is converted to fp16, as mixed precision keeps them: a sum over a
# feature map overflows fp16 (65504) long before its mean does. IREE's CUDA code for an fp16
# GlobalAveragePool over a 128x128 squeeze-excitation input gave inf on the H200 (LR-ASPP; its CPU
# code and onnxruntime accumulate in fp32), and torch accumulates half-precision means in fp32 too.
# The ops IREE sums in fp16 (iree_forms.F16_ACCUMULATED, which Track B's stage 0 computes in fp32 anyway) but
# the windowed AveragePool and CumSum, which this conversion keeps fp16, plus ReduceLogSumExp.
FP32_REDUCTIONS = (*(op for op in F16_ACCUMULATED if op not in ("AveragePool", "CumSum")), "ReduceLogSumExp")
# Ops whose presence means the simplifier has something to do (folding, elimination).
_FOLDABLE_OPS = {"Identity", "Constant", "Shape", "Size", "ConstantOfShape", "Dropout"}


@dataclass(frozen=True)
class Rewrite:
    """One change the front end made, for the build report."""

    stage: str
    detail: str

    def __str__(self) -> str:
        return f"{self.stage}: {self.detail}"


@dataclass
class FrontEnd:
    """The model as the pipeline takes it, and what it was made from.

    ``original`` is the export (weights moved out of its inputs, nothing else), ``body`` the processed
    model before the image wrap: the two are compared by :func:`dualtrack.compiler.verify.check_frontend`.
    """

    model: onnx.ModelProto
    body: onnx.ModelProto
    original: onnx.ModelProto
    export_batch: int | None  # the batch the export fixed (None: symbolic)
    precision: str
    classes: tuple[str, ...] | None = None
    rewrites: list[Rewrite] = field(default_factory=list)
    # ``original`` upgraded to TARGET_OPSET (None: no upgrade): the reference where onnxruntime no longer
    # runs the export's own opset (ONNX Runtime 1.32 dropped Add, Mul, Gemm... below opset 7).
    upgraded: onnx.ModelProto | None = None

    def notes(self) -> list[str]:
        return [f"front end: {r}" for r in self.rewrites]


def load_model(path: Path) -> onnx.ModelProto:
    """Read and check an ONNX model; ModelError names the file and the fix."""
    if not path.exists():
        raise ModelError(
            f"model file {path} not found; check `model:` in the config (run `make models` for the reference U-Net, "
            "`make zoo` for the zoo)"
        )
    try:
        model = onnx.load(str(path))
    except Exception as e:  # protobuf raises several unrelated types for a bad file
        raise ModelError(f"{path} is not a readable ONNX model ({type(e).__name__}); re-export it") from None
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0]
        raise ModelError(f"{path} fails the ONNX checker: {first}; re-export the model") from None
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            raise ModelError(
                f"initializer '{init.name}' of {path} is stored as external data; save the model with weights inside "
                "(onnx.save(model, path, save_as_external_data=False))"
            )
    return model


def full_check(model: onnx.ModelProto, what: str) -> None:
    """The ONNX checker with strict shape inference, on a model the front end produced."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ModelError(f"{what} fails the ONNX checker: {str(e).strip().splitlines()[0]}") from None


class StageCheck:
    """The ONNX checker on every model a front-end stage writes, held to the level the export passes:
    strict shape inference included where the export passes it, the structural check where it does not
    (a stage must not make a model worse than it got it). On the model without its weights' bytes
    (``onnx_graph.check_model``; :func:`full_check` reads them once, at the end). A failure is a dualtrack bug, so
    it is an InternalError that names the stage, not a ModelError that would send the user to re-export."""

    def __init__(self, export: onnx.ModelProto, source: str) -> None:
        self.source = source
        self.full = _checker_error(export, full=True) is None
        self._last: onnx.ModelProto | None = None

    def __call__(self, stage: str, model: onnx.ModelProto) -> onnx.ModelProto:
        if model is self._last:  # the stage had nothing to do and returned its input
            return model
        error = _checker_error(model, full=self.full)
        if error is not None and stage == "batch" and _checker_error(model, full=False) is None:
            # Sound, but an op's shape inference rejects a symbolic dim 0 (StringNormalizer takes [C] or [1, C]):
            # the model's dim 0 is not a batch, which is the user's to change.
            raise ModelError(
                f"with dim 0 of the input as the batch N, ONNX shape inference rejects the model ({error}); dualtrack "
                "runs a model image by image along dim 0: export it with a batch dimension its ops accept"
            )
        if error is not None:
            raise InternalError(
                f"the front end's `{stage}` stage wrote an invalid model from {self.source} ({error}); this is a "
                "dualtrack bug: please report it with the model and --verbose output"
            )
        self._last = model
        return model


def _checker_error(model: onnx.ModelProto, full: bool) -> str | None:
    """The first line of the ONNX checker's complaint about ``model``, or None."""
    try:
        check_model(model, full_check=full)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


# -- stages -------------------------------------------------------------------------------------------


def weights_out_of_inputs(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Graph inputs that are initializers (older exporters list every weight as an input) become
    plain initializers: they are not something a caller feeds."""
    inits = {i.name for i in model.graph.initializer}
    listed = [i for i in model.graph.input if i.name in inits]
    if not listed:
        return model
    model = copy.deepcopy(model)
    keep = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    detail = f"{len(listed)} initializers listed as graph inputs are weights, not inputs"
    if model.ir_version < IR_INITIALIZERS_APART:  # below it every initializer must also be an input
        detail += f" (IR version {model.ir_version} raised to {IR_INITIALIZERS_APART})"
        model.ir_version = IR_INITIALIZERS_APART
    log.append(Rewrite("weights", detail))
    return model


def single_input(model: onnx.ModelProto) -> onnx.ValueInfoProto:
    """The model's one input, a tensor with a batch dimension of at least one row, computing in fp16 or fp32
    (its outputs too); ModelError with the fix otherwise."""
    _refuse_float64(model)
    inputs = list(model.graph.input)
    if len(inputs) != 1:
        names = ", ".join(f"'{i.name}'" for i in inputs)
        raise ModelError(
            f"the model has {len(inputs)} inputs ({names}); dualtrack serves single-input image models: "
            "export the network with one input tensor"
        )
    if not inputs[0].type.HasField("tensor_type") or not len(inputs[0].type.tensor_type.shape.dim):
        raise ModelError(f"the model input '{inputs[0].name}' is not a tensor with a batch dimension; re-export it")
    batch = inputs[0].type.tensor_type.shape.dim[0]
    if batch.HasField("dim_value") and batch.dim_value < 1:
        raise ModelError(
            f"the model input '{inputs[0].name}' has {batch.dim_value} rows in dim 0, its batch; re-export it with a "
            "batch of at least 1 (or a dynamic one)"
        )
    return inputs[0]


def fixed_input_shape(model: onnx.ModelProto) -> tuple[int, ...]:
    """The input's shape, which `batch: fixed` builds whole; ModelError with the fix where a dim is symbolic."""
    inp = model.graph.input[0]
    dims = inp.type.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        raise ModelError(
            f"the model input '{inp.name}' has the shape {shape}; `batch: fixed` builds one exported shape: "
            "export the model with a static input shape, or use `batch: images` for a dynamic batch"
        )
    return tuple(d.dim_value for d in dims)


def _refuse_float64(model: onnx.ModelProto) -> None:
    """IREE 3.13's importer demotes float64 to float32, so a float64 model would meet its own module with
    buffers of half the size: refused instead, with the fix (`precision: fp32` converts it first)."""
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.type.tensor_type.elem_type == TensorProto.DOUBLE:
            raise ModelError(
                f"the model's {'input' if vi in model.graph.input else 'output'} '{vi.name}' is float64; dualtrack "
                "builds fp32 and fp16 models (IREE 3.13 computes float64 as float32): set `precision: fp32` to build "
                "it in float32 (verified against the float64 export at fp32's tolerance), or export it in float32"
            )


def float64_as_float32(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Every float64 tensor of the graph as float32: inputs, outputs, weights, constants and casts (what
    `precision: fp32` asks of a float64 export). The export stays the reference the build is checked against."""
    g = model.graph
    if not any(vi.type.tensor_type.elem_type == TensorProto.DOUBLE for vi in [*g.input, *g.output]) and not any(
        i.data_type == TensorProto.DOUBLE for i in g.initializer
    ):
        return model
    model = as_float32(copy.deepcopy(model), TensorProto.DOUBLE)
    log.append(Rewrite("precision", "float64 computed as float32 (`precision: fp32`): inputs, outputs and weights"))
    return model


def upgrade_opset(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Models below opset 17 are upgraded with onnx.version_converter (IREE and the Track A
    predicates are written against current op definitions)."""
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None or version >= TARGET_OPSET:
        return model
    if model.ir_version < IR_INITIALIZERS_APART:
        # The converter turns attributes into initializers (Pad's pads, Reshape's shape) without listing
        # them as inputs, which only IR 4 and later allow.
        model = copy.deepcopy(model)
        model.ir_version = IR_INITIALIZERS_APART
    try:
        upgraded = onnx.version_converter.convert_version(model, TARGET_OPSET)
    except Exception as e:  # the converter raises RuntimeError or ValidationError by op
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"cannot upgrade the model from opset {version} to {TARGET_OPSET} ({first}); "
            f"re-export it with opset_version={TARGET_OPSET}"
        ) from None
    # The converter keeps the IR version; the new opset's ops are defined from its own IR version on.
    upgraded.ir_version = max(upgraded.ir_version, helper.find_min_ir_version_for(list(upgraded.opset_import), True))
    log.append(Rewrite("opset", f"upgraded from opset {version} to {TARGET_OPSET} (onnx.version_converter)"))
    return upgraded


def simplify(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Constant folding, shape-op folding, Identity and dead-node elimination (onnxslim), where the
    graph has something for them; a graph without is left exactly as it is."""
    if not _has_foldable(model):
        return model
    import onnxslim  # heavy (sympy): loaded only when there is something to fold

    before = _op_counts(model)
    try:
        slim = onnxslim.slim(model, skip_fusion_patterns=_SKIP_FUSIONS)
    except Exception as e:  # onnxslim surfaces its internal errors as whatever raised them
        raise ModelError(
            f"the simplifier (onnxslim) failed on the model ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
            "set `simplify: false` in the config to build without it"
        ) from None
    after = _op_counts(slim)
    gone = {op: n - after.get(op, 0) for op, n in before.items() if n > after.get(op, 0)}
    new = {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}
    if gone or new:
        parts = [f"{n} {op}" for op, n in sorted(gone.items(), key=lambda kv: -kv[1])]
        added = [f"{n} {op}" for op, n in sorted(new.items(), key=lambda kv: -kv[1])]
        detail = f"removed {', '.join(parts)}" if parts else "no nodes removed"
        if added:
            detail += f"; added {', '.join(added)}"
        log.append(Rewrite("simplify", f"{detail} (onnxslim {onnxslim.__version__})"))
    return slim


def _op_counts(model: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for n in model.graph.node:
        out[n.op_type] += 1
    return dict(out)


def _has_foldable(model: onnx.ModelProto) -> bool:
    g = model.graph
    consts = {i.name for i in g.initializer}
    used = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    for n in g.node:
        if n.op_type in _FOLDABLE_OPS:
            return True
        if all(not x or x in consts for x in n.input):
            return True  # every input a constant: folds
        if not any(o in used for o in n.output if o):
            return True  # dead
        consts.update(o for o in n.output if o and all(not x or x in consts for x in n.input))
    return False


def linear_spatial_maps(model: onnx.ModelProto, export_batch: int | None, log: list[Rewrite]) -> onnx.ModelProto:
    """Index soups over an image's pixels (torch's dynamo export of an adaptive average pool) that are one
    linear map per channel, as a MatMul by a constant map (:mod:`.linear_maps`); after the simplifier, so
    the soup's constants are folded, and before batch freeing, which then has none of them to free."""
    m, report = linear_maps_as_matmuls(model, export_batch)
    log.extend(Rewrite("linear-maps", line) for line in report.lines())
    return m


def static_resize_scales(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """A Resize whose ``sizes`` are computed at run time from shapes (torch exports
    ``F.interpolate(x, size=y.shape[-2:])`` as Shape -> Slice -> Concat, which keeps the batch
    symbolic, so nothing folds it) but whose input and output are static apart from the batch
    gets constant ``scales`` instead: ``[1, 1, Ho/H, Wo/W]`` in float32, which is what onnxruntime
    and the ONNX spec divide by for ``sizes`` anyway. Only where ``floor(H * scale)`` gives ``Ho``
    back (else the output size would change; :func:`onnx_graph.resize_scale`); the shape nodes left unused
    are dropped. Track A's
    resize kernel takes constant scales only, and a shape value may not cross between tracks."""
    shapes = static_shapes(model)
    inits = {i.name for i in model.graph.initializer}
    done: list[str] = []
    for node in model.graph.node:
        if node.op_type != "Resize" or len(node.input) < 4 or not node.input[3] or node.input[3] in inits:
            continue
        src, dst = shapes.get(node.input[0]), shapes.get(node.output[0])
        if src is None or dst is None or len(src) != 4 or len(dst) != 4 or src[1] != dst[1]:
            continue
        if min(*src[1:], *dst[1:]) <= 0:
            continue  # not static
        hw = [resize_scale(o, i) for o, i in zip(dst[2:], src[2:], strict=True)]
        if any(sc is None for sc in hw):
            continue
        scales = np.array([1.0, 1.0, *hw], np.float32)
        if len(node.input) < 3:
            node.input.append("")
        replace_input(model, node, 2, scales, "scales")
        del node.input[3:]
        done.append(f"'{node.name or node.output[0]}'")
    if not done:
        return model
    model = _prune(model)
    log.append(
        Rewrite(
            "resize",
            f"{len(done)} Resize(s) with run-time sizes of static shapes take constant scales: "
            + ", ".join(done[:4])
            + (f" and {len(done) - 4} more" if len(done) > 4 else ""),
        )
    )
    return model


def separable_resizes(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """The Resize forms IREE 3.13 cannot lower (antialias, axes, an aspect-ratio policy, exclude_outside,
    tf_crop_and_resize, nearest align_corners) as constant per-axis maps (:mod:`dualtrack.compiler.resize_maps`)."""
    if not any(n.op_type == "Resize" and iree_cannot_lower(n) for n in model.graph.node):
        return model
    model, widened = widened_axes(copy.deepcopy(model))
    if widened:
        shown = ", ".join(widened[:4]) + (f" and {len(widened) - 4} more" if len(widened) > 4 else "")
        log.append(Rewrite("resize", f"{len(widened)} Resize(s) over every axis instead of opset 18's axes: {shown}"))
    model, done = resize_maps(model)
    if done:
        shown = ", ".join(done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
        log.append(Rewrite("resize", f"{len(done)} Resize(s) IREE cannot lower as per-axis Gather/MatMul: {shown}"))
    return model


def global_max_pools(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """A max over a whole picture (ReduceMax over H and W with keepdims: the dynamo exporter's
    ``adaptive_max_pool2d(x, 1)``, CBAM's and DANet's pooled vectors; GlobalMaxPool) written as the MaxPool
    of one window the picture's size, which Track A's max-pool takes (windows up to 256 a side) and IREE
    lowers as it does any MaxPool. Float images of static height and width only; the same values (a max
    is exact in any order)."""
    wanted = [n for n in model.graph.node if n.op_type in ("ReduceMax", "GlobalMaxPool")]
    if not wanted:
        return model
    inferred = infer_shapes(with_batch(model, 1), strict_mode=False, data_prop=True)
    types: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}  # one inference gives both (static_shapes would run it again)
    for vi in [*inferred.graph.input, *inferred.graph.value_info]:
        t = vi.type.tensor_type
        types[vi.name] = t.elem_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    consts = _graph_constants(model.graph)
    model = copy.deepcopy(model)
    done: list[str] = []
    for node in model.graph.node:
        if node.op_type not in ("ReduceMax", "GlobalMaxPool"):
            continue
        shape = shapes.get(node.input[0], ())
        if len(shape) != 4 or min(shape[2:]) < 1 or types.get(node.input[0]) not in _FLOATS:
            continue
        if node.op_type == "ReduceMax":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            axes = attrs.get("axes")
            if len(node.input) > 1 and node.input[1]:
                value = consts.get(node.input[1])
                axes = None if value is None else value.tolist()
            if attrs.get("keepdims", 1) != 1 or axes is None or sorted(int(a) % 4 for a in axes) != [2, 3]:
                continue
        node.op_type = "MaxPool"
        del node.input[1:]
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("kernel_shape", [int(shape[2]), int(shape[3])]))
        done.append(node.name or node.output[0])
    if done:
        shown = ", ".join(f"'{d}'" for d in done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
        log.append(Rewrite("pools", f"{len(done)} max(es) over a whole picture as MaxPool windows: {shown}"))
    return model


def iree_forms(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Ops in forms IREE 3.13 refuses or computes wrong, in forms it compiles right
    (:mod:`dualtrack.compiler.iree_forms`)."""
    wanted = ("MatMul", "Pow", "Slice", "SpaceToDepth", *(op for op, _ in WIDENED))
    if not any(n.op_type in wanted for n in model.graph.node):
        return model
    model = copy.deepcopy(model)
    model, reshaped = reshaped_forms(model)
    if reshaped:
        log.append(Rewrite("iree-forms", f"{len(reshaped)} op(s) in forms IREE takes: {', '.join(reshaped[:4])}"))
    model, vectors = matrix_matmuls(model)
    model, widened = widened_unsigned(model)
    model, powers = signed_powers(model)
    if powers:
        log.append(
            Rewrite("pow", f"{len(powers)} Pow(s) of whole exponents with the sign of x: {', '.join(powers[:4])}")
        )
    if vectors:
        shown = ", ".join(vectors[:4])
        log.append(Rewrite("matmul", f"{len(vectors)} MatMul(s) of a 1-D operand as matrix products: {shown}"))
    if widened:
        shown = ", ".join(widened[:4])
        log.append(Rewrite("unsigned", f"computed in a wider type (IREE takes uint8 as signed): {shown}"))
    return model


def channels_first_regions(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Channels-last blocks (ConvNeXt's permute, LayerNorm, Linear, GELU, permute) written in the
    graph's NCHW convention, where Track A's lowerings see convolutions (:mod:`.channels_last`)."""
    m, detail = channels_first(model, _graph_constants(model.graph))
    if detail:
        log.append(Rewrite("channels-last", detail))
    return m


def pooled_vector_images(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Squeeze-excitation MLPs written with Linears on flattened (N, C) vectors, written on the (N, C, 1, 1)
    images they come from (:mod:`.pooled_vectors`): the fc and eltwise kernels take them on Track A."""
    m, detail = vectors_as_images(model, _graph_constants(model.graph))
    if detail:
        log.append(Rewrite("pooled-vectors", detail))
    return m


def batch_major_rows(model: onnx.ModelProto, export_batch: int | None, log: list[Rewrite]) -> onnx.ModelProto:
    """Row-wise ops (projections, biases, norms over the last axis) that read or write tensors holding the
    batch outside dim 0 (``nn.MultiheadAttention``'s sequence-first layout) moved across the Transposes around
    them, onto batch-major tensors Track A takes (:mod:`.row_order`)."""
    m, detail = rows_batch_major(model, _graph_constants(model.graph), export_batch)
    if detail:
        log.append(Rewrite("rows", detail))
    return m


def token_images(
    model: onnx.ModelProto, cfg: BuildConfig, export_batch: int | None, log: list[Rewrite]
) -> onnx.ModelProto:
    """A transformer's token tensors (N, L, C) written as the NCHW images they are, their LayerNorms,
    Linears and element-wise ops as image ops (:mod:`.token_layout`). Not with ``sizes``: the pass writes the
    export's (H, W) into its Reshapes, which a plan at another size refuses (spatial.py), where the export's
    own may compute them."""
    m, detail = tokens_as_images(model, _graph_constants(model.graph), export_batch or 1)
    if detail and cfg.sizes is not None:
        log.append(Rewrite("tokens", "token tensors left as exported (Track B): `sizes` asks for other input sizes"))
        return model
    if detail:
        log.append(Rewrite("tokens", detail))
    return m


def sub_pixel_convtransposes(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Strided ConvTransposes as a Conv of s*s*K channels and a DepthToSpace (:mod:`.convt_phases`):
    tensor-core convolutions on Track A instead of a gather on CUDA cores."""
    m, detail = sub_pixel_convolutions(model)
    if detail:
        log.append(Rewrite("convtranspose", detail))
    return m


def channel_pad_convs(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Constant Pads over channels as 1x1 Convs (:mod:`.channel_maps`): no Pad of C between two
    Track A convolutions; before :func:`fold_zero_pads`, which may then take the H/W Pad left."""
    m, detail = channel_maps_as_convs(model)
    if detail:
        log.append(Rewrite("pad", detail))
        m = _prune(m)
    return m


def zero_channel_concats(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Concats of an image and zeros on channels (ENet's widened shortcut) as the channel Pads they are
    (:func:`.channel_maps.zero_concats_as_pads`), which :func:`channel_pad_convs` then writes as 1x1 Convs."""
    m, detail = zero_concats_as_pads(model)
    if detail:
        log.append(Rewrite("pad", detail))
        m = _prune(m)
    return m


def split_attention_images(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Split attention's 5-D radix views (ResNeSt) written on the images they view
    (:func:`.radix_views.radix_views_as_images`): the branch sums, products and the softmax of two."""
    m, detail = radix_views_as_images(model)
    if detail:
        log.append(Rewrite("radix", detail))
        m = _prune(m)
    return m


def parallel_branches(model: onnx.ModelProto, precision: str | None, log: list[Rewrite]) -> onnx.ModelProto:
    """Sums of parallel convolutions, BatchNorms and the identity of one input merged into one
    convolution each (:mod:`.branch_merge`): a RepVGG / MobileOne / RepMixer block exported from its
    training-time module runs as the one convolution it was trained to become. The merged weights are
    checked against the dtype ``precision`` will give them."""
    final = {"fp16": np.float16, "fp8": np.float16, "fp32": np.float32}.get(precision or "")
    m, merged, refused = merge_branches(model, final)
    if merged:
        more = f" and {len(merged) - 4} more" if len(merged) > 4 else ""
        what = f"{len(merged)} sum(s) of parallel branches of one input merged into one Conv each"
        log.append(Rewrite("reparam", f"{what}: {', '.join(merged[:4])}{more}"))
    for why in refused:
        log.append(Rewrite("reparam", f"not merged: {why}"))
    return m


def channel_affines(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """Constant per-channel Mul, Div, Add and Sub after a Conv folded into its weights and bias
    (:mod:`.scale_fold`): ConvNeXt's layer scale no longer stands between the block's last conv and
    its residual Add."""
    m, folded, refused = fold_channel_affines(model)
    if folded:
        more = f" and {len(folded) - 4} more" if len(folded) > 4 else ""
        names = ", ".join(f"'{n}'" for n in folded[:4])
        what = f"{len(folded)} per-channel constant Mul/Div/Add/Sub(s) folded into the Conv before them"
        log.append(Rewrite("scale", f"{what}: {names}{more}"))
    for why in refused:
        log.append(Rewrite("scale", f"not folded into its Conv: {why}"))
    return m


def fold_zero_pads(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """A Pad of zeros over H and W whose every reader is a Conv, or an AveragePool that counts its
    padding (``count_include_pad`` 1, ``ceil_mode`` 0), is dropped and its pads added to theirs: a
    convolution reads zeros outside the image anyway, so the padded tensor never has to exist (one
    op and one tensor fewer on either track). Not folded: a crop (a negative pad), pads on N or C,
    another value or mode, a MaxPool reader (its padding is -inf, not 0), an ``auto_pad`` SAME_*
    reader (its padding depends on the size it sees), a Pad the graph outputs."""
    model = copy.deepcopy(model)
    g = model.graph
    consts = _graph_constants(g)
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for x in n.input:
            readers[x].append(n)
    outputs = {o.name for o in g.output}
    folded: list[onnx.NodeProto] = []
    for pad in g.node:
        hw = _zero_pad_hw(pad, consts) if pad.op_type == "Pad" else None
        users = readers.get(pad.output[0], [])
        if hw is None or pad.output[0] in outputs or not users or not all(_takes_zeros(u, pad, hw) for u in users):
            continue
        for u in users:
            keep = [x for x in u.attribute if x.name not in ("pads", "auto_pad")]
            pads = _summed_pads(u, hw)
            del u.attribute[:]
            u.attribute.extend([*keep, helper.make_attribute("pads", pads)])
            u.input[0] = pad.input[0]
        folded.append(pad)
    if not folded:
        return model
    gone = {p.output[0] for p in folded}
    kept = [n for n in g.node if not (n.op_type == "Pad" and n.output[0] in gone)]
    del g.node[:]
    g.node.extend(kept)
    vis = [v for v in g.value_info if v.name not in gone]
    del g.value_info[:]
    g.value_info.extend(vis)
    model = _prune(model)
    names = ", ".join(f"'{p.name or p.output[0]}'" for p in folded[:4])
    more = f" and {len(folded) - 4} more" if len(folded) > 4 else ""
    what = f"{len(folded)} zero Pad(s) folded into the padding of the Conv/AveragePool after them"
    log.append(Rewrite("pad", f"{what}: {names}{more}"))
    return model


# A reduction over a stack of tensors, and the element-wise chain that computes it without the stack.
_STACK_REDUCTIONS = {"ReduceSum": "Add", "ReduceMean": "Add", "ReduceMax": "Max", "ReduceMin": "Min"}


def unstack_reductions(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """ReduceSum/Mean/Max/Min over axis 0 (keepdims 0) of Concat(axis 0) of Unsqueeze(axis 0) tensors
    (``torch.stack(xs).sum(0)``, smp FPN's merge) becomes an Add (Max, Min) chain of the tensors, a
    mean then scaled by 1/k. The stack puts the images of a batch in dim 1, which no track hands over
    per batch; the chain keeps every tensor batch-major, and is the same sum."""
    model = copy.deepcopy(model)
    g = model.graph
    consts = _graph_constants(g)
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = defaultdict(int)
    for n in g.node:
        for x in n.input:
            readers[x] += 1
    types = {vi.name: vi.type.tensor_type.elem_type for vi in infer_shapes(model).graph.value_info}
    gone: set[int] = set()
    new: dict[int, list[onnx.NodeProto]] = {}
    for r in g.node:
        stack = _stacked(r, producer, readers, consts) if r.op_type in _STACK_REDUCTIONS else None
        if stack is None:
            continue
        cat, unsq = stack
        chain, t = [], unsq[0].input[0]
        op = _STACK_REDUCTIONS[r.op_type]
        for k, u in enumerate(unsq[1:], start=1):
            y = r.output[0] if k == len(unsq) - 1 and r.op_type != "ReduceMean" else f"{r.output[0]}/{op.lower()}{k}"
            chain.append(helper.make_node(op, [t, u.input[0]], [y], name=f"{r.name or r.output[0]}/{op.lower()}{k}"))
            t = y
        if r.op_type == "ReduceMean":
            dtype = helper.tensor_dtype_to_np_dtype(types.get(unsq[0].input[0], TensorProto.FLOAT))
            scale = f"{r.output[0]}/one_over_{len(unsq)}"
            g.initializer.append(numpy_helper.from_array(np.array(1.0 / len(unsq), dtype), scale))
            chain.append(helper.make_node("Mul", [t, scale], [r.output[0]], name=f"{r.name or r.output[0]}/mean"))
        new[id(r)] = chain
        gone.update(id(n) for n in (cat, *unsq))
    if not new:
        return model
    nodes = [m for n in g.node if id(n) not in gone for m in new.get(id(n), [n])]
    del g.node[:]
    g.node.extend(nodes)
    model = _prune(model)
    log.append(Rewrite("stack", f"{len(new)} reduction(s) over a stacked axis 0 as element-wise chains"))
    return model


def _stacked(
    r: onnx.NodeProto, producer: dict, readers: dict[str, int], consts: dict[str, np.ndarray]
) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """(Concat, its Unsqueezes) where ``r`` reduces axis 0 (keepdims 0) of a stack built by them."""
    a = {x.name: helper.get_attribute_value(x) for x in r.attribute}
    axes = a.get("axes")
    if axes is None and len(r.input) > 1 and r.input[1]:
        axes = consts.get(r.input[1])
    if axes is None or [int(v) for v in np.ravel(axes)] != [0] or a.get("keepdims", 1) != 0:
        return None
    cat = producer.get(r.input[0])
    if cat is None or cat.op_type != "Concat" or readers[cat.output[0]] != 1:
        return None
    if {x.name: helper.get_attribute_value(x) for x in cat.attribute}.get("axis") != 0 or len(cat.input) < 2:
        return None
    unsq = [producer.get(x) for x in cat.input]
    for u in unsq:
        if u is None or u.op_type != "Unsqueeze" or readers[u.output[0]] != 1:
            return None
        ua = {x.name: helper.get_attribute_value(x) for x in u.attribute}
        u_axes = ua.get("axes", consts.get(u.input[1]) if len(u.input) > 1 else None)
        if u_axes is None or [int(v) for v in np.ravel(u_axes)] != [0]:
            return None
    return cat, unsq


def _zero_pad_hw(pad: onnx.NodeProto, consts: dict[str, np.ndarray]) -> list[int] | None:
    """The (top, left, bottom, right) pads of a constant-0 Pad over H and W of a 4-D tensor (pads
    and value constant inputs since opset 11, attributes before; opset 18's axes), or None."""
    a = {x.name: helper.get_attribute_value(x) for x in pad.attribute}
    if a.get("mode", b"constant") != b"constant":
        return None
    inputs = [*pad.input, "", "", ""]
    pads = consts.get(inputs[1]) if inputs[1] else np.array(a.get("pads", []))
    value = consts.get(inputs[2]) if inputs[2] else np.array(a.get("value", 0.0))
    axes = consts.get(inputs[3]) if inputs[3] else None
    if pads is None or value is None or value.size > 1 or (inputs[3] and axes is None):
        return None
    full = full_pads(pads.astype(np.int64).tolist(), axes)
    if full is None or float(value.reshape(())) != 0.0 or any(full[i] for i in (0, 1, 4, 5)) or min(full) < 0:
        return None
    return [full[2], full[3], full[6], full[7]]


def _summed_pads(node: onnx.NodeProto, hw: list[int]) -> list[int]:
    """A 2-D Conv's or pool's explicit pads (``auto_pad`` VALID: none) plus ``hw``."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    old = [0, 0, 0, 0] if a.get("auto_pad", b"NOTSET") == b"VALID" else list(a.get("pads", [0, 0, 0, 0]))
    return [int(p + q) for p, q in zip(old, hw, strict=True)]


def _takes_zeros(node: onnx.NodeProto, pad: onnx.NodeProto, hw: list[int]) -> bool:
    """Whether ``node`` reads ``pad``'s output as its image only and pads it with zeros of its own
    (an AveragePool's pads stay under its window, as onnxruntime requires)."""
    t = pad.output[0]
    if node.op_type not in ("Conv", "AveragePool") or node.input[0] != t or t in node.input[1:]:
        return False
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
        return False
    if node.op_type == "Conv":
        return True
    kernel = list(a.get("kernel_shape", []))
    pads = _summed_pads(node, hw)
    fits = len(kernel) == 2 and all(pads[i] < kernel[i % 2] for i in range(4))
    return fits and a.get("count_include_pad", 0) == 1 and a.get("ceil_mode", 0) == 0


def unique_parameter_keys(model: onnx.ModelProto, log: list[Rewrite]) -> onnx.ModelProto:
    """IREE's importer renames parameters (``onnx::Conv_5`` becomes ``onnx__Conv_5``, see
    :func:`dualtrack.contract.plan.parameter_key`) and the runtime looks them up under that key: two
    initializers whose keys collide are renamed apart here."""
    seen: dict[str, str] = {}
    clash = [i.name for i in model.graph.initializer if seen.setdefault(parameter_key(i.name), i.name) != i.name]
    if not clash:
        return model
    model = copy.deepcopy(model)
    taken = {parameter_key(i.name) for i in model.graph.initializer}
    rename: dict[str, str] = {}
    claimed: set[str] = set()
    for init in model.graph.initializer:
        key = parameter_key(init.name)
        if key not in claimed:
            claimed.add(key)
            continue
        k = 1
        while f"{key}__{k}" in taken:
            k += 1
        rename[init.name] = f"{key}__{k}"
        taken.add(rename[init.name])
        init.name = rename[init.name]
    for node in model.graph.node:
        for j, x in enumerate(node.input):
            node.input[j] = rename.get(x, x)
    log.append(Rewrite("names", f"{len(rename)} initializer(s) renamed: their IREE parameter keys collided"))
    return model


def model_precision(model: onnx.ModelProto) -> str:
    """fp16 or fp32: the float type that holds most of the weights."""
    count = {TensorProto.FLOAT16: 0, TensorProto.FLOAT: 0}
    for init in model.graph.initializer:
        if init.data_type in count:
            count[init.data_type] += int(np.prod(init.dims)) if len(init.dims) else 1
    if not any(count.values()):
        elem = single_input(model).type.tensor_type.elem_type
        return "fp16" if elem == TensorProto.FLOAT16 else "fp32"
    return "fp16" if count[TensorProto.FLOAT16] > count[TensorProto.FLOAT] else "fp32"


def explicit_fp32_tensors(model: onnx.ModelProto) -> frozenset[str]:
    """The tensors an fp32 export computes in float32 on purpose, between its own casts.

    torch's ``x.float()`` on an fp32 tensor exports as a Cast to FLOAT that does nothing in the export but
    says the author wants the math after it in float32, until ``.to(dtype)`` (another Cast to FLOAT there)
    brings it back: EfficientViT's linear attention, whose sums over the tokens overflow fp16 (non-finite
    outputs at 64x64 with random weights, 0.4% rel L2 kept in fp32), a softmax written
    ``attn.float().softmax(-1).type_as(x)``. The region: such a Cast's outputs, then every node whose
    inputs are all region tensors or constants, up to and including the Casts to FLOAT that leave it. It
    never takes a node with weights (a float constant of more than one value: a Conv, a norm's affine): a
    cast in front of the network's convolutions would otherwise take them all. Casts from other types (an
    int shape made float for a padding's arithmetic) start none."""
    g = model.graph
    starts = [n for n in g.node if n.op_type == "Cast" and node_attrs(n).get("to") == TensorProto.FLOAT]
    if not starts:
        return frozenset()
    _, elems = inferred_dims(model)
    consts = _graph_constants(g)
    weights = {k for k, v in consts.items() if v.dtype.kind == "f" and v.size > 1}
    region: set[str] = set()  # the math's tensors: what the next node's membership is judged by
    exits: set[str] = set()  # the casts back out: kept fp32 themselves, their readers not
    for n in g.node:  # graph order is topological
        ins = [x for x in n.input if x and x not in consts]
        inside = bool(ins) and all(x in region for x in ins)
        if n.op_type == "Cast" and node_attrs(n).get("to") == TensorProto.FLOAT:
            if inside:
                exits.update(n.output)
            elif len(ins) == 1 and elems.get(ins[0]) == TensorProto.FLOAT:
                region.update(n.output)
            continue
        if inside and not any(x in weights for x in n.input):
            region.update(n.output)
    # A cast that nothing in the region reads or writes marks no math (MONAI's HighResNet casts each
    # block's input to its own dtype): kept in fp32 alone it would only add two Casts around it.
    math = [n for n in g.node if n.op_type != "Cast" and any(o in region for o in n.output)]
    touched = {x for n in math for x in (*n.input, *n.output)}
    writer = {o: n for n in g.node for o in n.output}  # a cast back out of the math reads what it wrote
    return frozenset(t for t in region | exits if t in touched or any(x in touched for x in writer[t].input))


def convert_precision(
    model: onnx.ModelProto, want: str | None, log: list[Rewrite], fp32: frozenset[str] = frozenset()
) -> tuple[onnx.ModelProto, str]:
    """Keep the model's precision unless the config asks for another; fp32 -> fp16 is converted by
    onnxconverter-common with the inputs and outputs kept fp32 (verified against the original), and the
    nodes that write ``fp32`` tensors (:func:`explicit_fp32_tensors` of the export) kept in fp32."""
    have = model_precision(model)
    if want == "fp8":  # the fp16 network, some convolutions of which the build then lowers to e4m3 (fp8.py)
        want = "fp16"
    if want is None or want == have:
        return model, have
    if want == "fp32":
        raise ConfigError(
            "precision: fp32 was asked for, but the model's weights are fp16; set `precision: fp16` "
            "(or remove it) or export the model in fp32"
        )
    from onnxconverter_common import float16

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), TARGET_OPSET)
    # and the ops ONNX defines for float32 but not float16 (Celu): converted, they would be invalid
    fp32_only = fp32_only_ops(opset)
    blocked = list(dict.fromkeys([*float16.DEFAULT_OP_BLOCK_LIST, *FP32_REDUCTIONS, *sorted(fp32_only)]))
    bare = _constants_apart(_outputs_apart(_fill_values_spelt(_named(model))), set(blocked))
    del bare.graph.value_info[:]  # shapes recorded before the conversion mislead its Cast insertion
    kept_nodes = [n.name for n in bare.graph.node if n.output and all(o in fp32 for o in n.output if o)]
    try:
        with warnings.catch_warnings():  # it warns once per weight it rounds to fp16's range
            warnings.simplefilter("ignore")
            converted = float16.convert_float_to_float16(
                bare,
                keep_io_types=True,
                disable_shape_infer=False,
                op_block_list=blocked,
                node_block_list=kept_nodes,
            )
        del converted.graph.value_info[:]
    except Exception as e:  # the converter raises whatever its graph walk hits
        raise ModelError(
            f"converting the model to fp16 failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
            "export it in fp16 or build with `precision: fp32`"
        ) from None
    kept = sum(n.op_type in FP32_REDUCTIONS for n in model.graph.node)
    only = sorted({n.op_type for n in model.graph.node if n.op_type in fp32_only})
    log.append(
        Rewrite(
            "precision",
            "fp32 weights converted to fp16 (onnxconverter-common), inputs and outputs fp32"
            + (f"; {kept} reduction(s) kept in fp32" if kept else "")
            + (f"; {', '.join(only)} kept in fp32 (ONNX defines no fp16 form)" if only else ""),
        )
    )
    if kept_nodes:
        ops = ", ".join(
            f"{k} {v}" for k, v in Counter(n.op_type for n in bare.graph.node if n.name in kept_nodes).items()
        )
        what = f"{len(kept_nodes)} node(s) the export computes in float32 between its own casts kept in fp32 ({ops})"
        log.append(Rewrite("precision", f"{what}: '{kept_nodes[0]}' ..."))
    return converted, "fp16"


def _constants_apart(model: onnx.ModelProto, kept_fp32: set[str]) -> onnx.ModelProto:
    """``model`` with each float initializer that both an op kept in fp32 (``kept_fp32``: a Resize's
    ``scales``) and another op read copied, the copy for the fp32 readers: onnxconverter-common keeps
    such a shared tensor fp32 for all its readers, so an fp16 node reading it gets fp32 beside fp16 (the
    dynamo exporter shares equal constants: a 4-group GroupNorm's ones and a Resize's scales
    [1, 1, 1, 1]). The model itself when nothing is shared that way."""
    g = model.graph
    floats = {i.name for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in dict.fromkeys(n.input):
            if x in floats:
                readers.setdefault(x, []).append(n)
    mixed = {x for x, ns in readers.items() if len({n.op_type in kept_fp32 for n in ns}) == 2}
    if not mixed:
        return model
    model = copy.deepcopy(model)
    g = model.graph
    taken = {x for n in g.node for x in (*n.input, *n.output)} | {i.name for i in g.initializer}
    copies: dict[str, str] = {}
    for init in list(g.initializer):
        if init.name in mixed:
            name = init.name + "__fp32"
            while name in taken:
                name += "_"
            taken.add(name)
            dup = onnx.TensorProto()
            dup.CopyFrom(init)
            dup.name = name
            g.initializer.append(dup)
            copies[init.name] = name
    for n in g.node:
        if n.op_type in kept_fp32:
            n.input[:] = [copies.get(x, x) for x in n.input]
    return model


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every node named (onnxconverter-common names its Casts after their nodes: two unnamed
    nodes gave two `_output_cast_0`s, an invalid graph); the model itself when every node has a name."""
    return name_nodes(model) if any(not n.name for n in model.graph.node) else model


def _fill_values_spelt(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ConstantOfShape that leaves its ``value`` to the default (a float32 0: the dynamo
    exporter's zeros for a MaxUnpool's scatter) given that value explicitly: onnxconverter-common converts
    float attributes, not defaults, so the zeros stayed float32 beside fp16 updates. The model itself when
    none does."""
    bare = [i for i, n in enumerate(model.graph.node) if n.op_type == "ConstantOfShape" and not n.attribute]
    if not bare:
        return model
    model = copy.deepcopy(model)
    for i in bare:
        zero = onnx.helper.make_tensor("value", onnx.TensorProto.FLOAT, [1], [0.0])
        model.graph.node[i].attribute.append(onnx.helper.make_attribute("value", zero))
    return model


def _outputs_apart(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy in which no graph output is also read inside the graph: such an output gets an Identity
    of its own. onnxconverter-common keeps outputs fp32 (keep_io_types) by casting the tensor itself,
    so a node reading it would get fp32 next to fp16 weights (an invalid graph)."""
    model = copy.deepcopy(model)
    g = model.graph
    read = {x for n in g.node for x in n.input}
    names = {x for n in g.node for x in (*n.input, *n.output)} | {i.name for i in g.initializer}
    for out in g.output:
        if out.name not in read:
            continue
        inner = out.name + "__inner"
        while inner in names:
            inner += "_"
        names.add(inner)
        for n in g.node:
            n.input[:] = [inner if x == out.name else x for x in n.input]
            n.output[:] = [inner if x == out.name else x for x in n.output]
        g.node.append(helper.make_node("Identity", [inner], [out.name], name=f"{out.name}__out"))
    return model


# -- the image wrap -------------------------------------------------------------------------------


def _unique(model: onnx.ModelProto, want: str) -> str:
    """Rename any tensor of the model called ``want`` out of the way, so the wrap can use the name."""
    g = model.graph
    names = {i.name for i in g.initializer} | {x for n in g.node for x in (*n.input, *n.output)}
    names |= {i.name for i in g.input} | {o.name for o in g.output}
    if want not in names:
        return want
    new, k = f"{want}__model", 0
    while new in names:
        k += 1
        new = f"{want}__model{k}"
    for n in g.node:
        for j, x in enumerate(n.input):
            if x == want:
                n.input[j] = new
        for j, x in enumerate(n.output):
            if x == want:
                n.output[j] = new
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.name == want:
            vi.name = new
    for init in g.initializer:
        if init.name == want:
            init.name = new
    return new


def logits_output(model: onnx.ModelProto, post: Postprocess) -> onnx.ValueInfoProto:
    """The output that holds the segmentation map (N, classes, H, W), or ModelError with the fix."""
    outs = list(model.graph.output)
    shapes = static_shapes(model)
    if post.output is not None:
        chosen = [o for o in outs if o.name == post.output]
        if not chosen:
            raise ConfigError(
                f"postprocess.output: the model has no output '{post.output}'; its outputs are "
                f"{', '.join(repr(o.name) for o in outs)}"
            )
    else:
        chosen = [o for o in outs if len(shapes.get(o.name, ())) == 4 and _is_float(o)]
        if len(chosen) != 1:
            listed = ", ".join(f"'{o.name}' {list(shapes.get(o.name, ()))}" for o in outs)
            raise ModelError(
                f"postprocess needs one 4-D (N, classes, H, W) float output, the model has {listed}; "
                "name the logits with postprocess.output"
            )
    out = chosen[0]
    shape = shapes.get(out.name, ())
    if len(shape) != 4 or not _is_float(out) or min(shape[2:], default=0) < 2:
        raise ModelError(
            f"output '{out.name}' {list(shape)} is not a segmentation map (N, classes, H, W); "
            "point postprocess.output at the logits, or remove `postprocess` to serve the raw outputs"
        )
    if post.classes is not None and len(post.classes) != shape[1]:
        raise ConfigError(
            f"postprocess.classes names {len(post.classes)} classes, the output '{out.name}' has {shape[1]} channels"
        )
    return out


def _is_float(vi: onnx.ValueInfoProto) -> bool:
    return vi.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.FLOAT16)


def wrap_image_io(
    model: onnx.ModelProto, pre: Preprocess | None, post: Postprocess | None, log: list[Rewrite]
) -> onnx.ModelProto:
    """Put the declared pre- and post-processing around the model: uint8 (N, H, W, 3) RGB ``image``
    in (nodes ``pre/*``), ``mask`` and ``probs`` out (nodes ``post/*``), as the reference model has."""
    if pre is None and post is None:
        return model
    model = copy.deepcopy(model)
    g = model.graph
    pre_nodes, pre_inits = _wrap_input(model, pre, log) if pre is not None else ([], [])
    post_nodes, post_inits = _wrap_output(model, post, log) if post is not None else ([], [])
    body = list(g.node)
    del g.node[:]
    g.node.extend([*pre_nodes, *body, *post_nodes])
    g.initializer.extend([*pre_inits, *post_inits])
    del g.value_info[:]
    return _prune(model)


def _image_size(inp: onnx.ValueInfoProto, pre: Preprocess) -> tuple[int, int]:
    """The (height, width) of the model's image input; it must be a fixed-size float image of the
    preprocess's channels (3; 1 for GRAY)."""
    t = inp.type.tensor_type
    dims = [d.dim_value for d in t.shape.dim]
    channels = (dims[1] if pre.layout == "NCHW" else dims[-1]) if len(dims) == 4 else None
    if len(dims) == 4 and _is_float(inp) and channels != pre.channels and channels in (1, 3):
        fix = "preprocess.color: GRAY (the luma)" if channels == 1 else "preprocess.color: RGB or BGR"
        raise ModelError(
            f"preprocess: the model input '{inp.name}' {dims} has {channels} channel(s) and color {pre.color} "
            f"feeds {pre.channels}; set {fix}"
        )
    if len(dims) != 4 or channels != pre.channels or not _is_float(inp):
        raise ModelError(
            f"preprocess: the model input '{inp.name}' is {helper.tensor_dtype_to_np_dtype(t.elem_type)} "
            f"{dims}, not a {pre.layout} float image with {pre.channels} channel(s); fix preprocess.layout or "
            "remove `preprocess`"
        )
    h, w = (dims[2], dims[3]) if pre.layout == "NCHW" else (dims[1], dims[2])
    if h <= 0 or w <= 0:
        raise ModelError(
            f"preprocess: the model input '{inp.name}' has no fixed height and width ({dims}); "
            "export it with a fixed image size"
        )
    return h, w


def _wrap_input(
    model: onnx.ModelProto, pre: Preprocess, log: list[Rewrite]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Replace the model's input by a uint8 NHWC ``image``; returns the ``pre/*`` nodes that turn it
    into what the model read, and their constants. The model's body is rewired in place."""
    g = model.graph
    inp = single_input(model)
    elem_type = inp.type.tensor_type.elem_type
    h, w = _image_size(inp, pre)
    exported_name = inp.name
    _unique(model, IMAGE)  # a model tensor (its input too) called `image` moves out of the way
    body_in = single_input(model).name
    nodes, inits, x = _preprocess_nodes(pre, elem_type)
    for n in g.node:
        for j, name in enumerate(n.input):
            if name == body_in:
                n.input[j] = x
    del g.input[:]
    g.input.append(helper.make_tensor_value_info(IMAGE, TensorProto.UINT8, [BATCH, h, w, 3]))
    log.append(
        Rewrite(
            "wrap",
            f"uint8 image (N, {h}, {w}, 3) {pre.color}{' (the luma of RGB)' if pre.color == 'GRAY' else ''} "
            f"-> /{pre.scale:g}, mean {list(pre.per_channel('mean'))}, std {list(pre.per_channel('std'))} -> "
            f"{pre.layout} model input '{exported_name}'",
        )
    )
    return nodes, inits


def _preprocess_nodes(pre: Preprocess, elem_type: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """``image`` -> float -> channel order -> layout -> (x - mean) / std -> the model's dtype: the
    nodes, their constants, and the name of the tensor the model now reads."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    x = "pre/cast"
    nodes.append(helper.make_node("Cast", [IMAGE], [x], name="pre/cast", to=TensorProto.FLOAT))
    if pre.color == "BGR":
        inits.append(numpy_helper.from_array(np.array([2, 1, 0], np.int64), "pre/bgr_order"))
        nodes.append(helper.make_node("Gather", [x, "pre/bgr_order"], ["pre/bgr"], name="pre/bgr", axis=3))
        x = "pre/bgr"
    elif pre.color == "GRAY":  # the luma: a weighted sum over the pixel's channels, one channel kept
        inits.append(numpy_helper.from_array(LUMA.reshape(1, 1, 1, 3), "pre/luma_weights"))
        inits.append(numpy_helper.from_array(np.array([3], np.int64), "pre/luma_axis"))
        nodes.append(helper.make_node("Mul", [x, "pre/luma_weights"], ["pre/luma_terms"], name="pre/luma_terms"))
        nodes.append(
            helper.make_node(
                "ReduceSum", ["pre/luma_terms", "pre/luma_axis"], ["pre/luma"], name="pre/luma", keepdims=1
            )
        )
        x = "pre/luma"
    if pre.layout == "NCHW":
        nodes.append(helper.make_node("Transpose", [x], ["pre/nchw"], name="pre/nchw", perm=[0, 3, 1, 2]))
        x = "pre/nchw"
    c = pre.channels
    bshape = (1, c, 1, 1) if pre.layout == "NCHW" else (1, 1, 1, c)
    mean = (np.array(pre.per_channel("mean"), np.float32) * np.float32(pre.scale)).reshape(bshape)
    inv = (1.0 / (np.array(pre.per_channel("std"), np.float64) * pre.scale)).astype(np.float32).reshape(bshape)
    inits += [numpy_helper.from_array(mean, "pre/mean"), numpy_helper.from_array(inv, "pre/inv_std")]
    nodes.append(helper.make_node("Sub", [x, "pre/mean"], ["pre/sub_mean"], name="pre/sub_mean"))
    nodes.append(helper.make_node("Mul", ["pre/sub_mean", "pre/inv_std"], ["pre/scale"], name="pre/scale"))
    x = "pre/scale"
    if elem_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [x], ["pre/to_model"], name="pre/to_model", to=elem_type))
        x = "pre/to_model"
    return nodes, inits, x


def _wrap_output(
    model: onnx.ModelProto, post: Postprocess, log: list[Rewrite]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Replace the model's outputs by ``mask`` and ``probs`` computed from its logits; returns the
    ``post/*`` nodes and their constants. The graph's outputs are replaced in place."""
    g = model.graph
    exported = logits_output(model, post).name  # a string: the proto is renamed in place below
    name = exported
    for want in (MASK, PROBS):  # model tensors (the logits too) called `mask`/`probs` move out of the way
        moved = _unique(model, want)
        name = moved if name == want else name
    logits = next(o for o in g.output if o.name == name)
    shape = static_shapes(model)[logits.name]
    nodes, inits = _postprocess_nodes(post, logits, classes=shape[1])
    dropped = [o.name for o in g.output if o.name != logits.name]
    del g.output[:]
    g.output.extend(
        [
            helper.make_tensor_value_info(MASK, TensorProto.UINT8, [BATCH, shape[2], shape[3]]),
            helper.make_tensor_value_info(PROBS, TensorProto.FLOAT, [BATCH, shape[1], shape[2], shape[3]]),
        ]
    )
    log.append(
        Rewrite(
            "wrap",
            f"output '{exported}' (N, {', '.join(map(str, shape[1:]))}) -> {post.activation} "
            f"-> `{PROBS}` and `{MASK}`" + (f"; dropped outputs {', '.join(dropped)}" if dropped else ""),
        )
    )
    return nodes, inits


def _postprocess_nodes(
    post: Postprocess, logits: onnx.ValueInfoProto, classes: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """logits -> float -> activation -> ``probs``, and ``mask``: argmax over classes, or p > 0.5 for one."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    x = logits.name
    if logits.type.tensor_type.elem_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [x], ["post/fp32"], name="post/fp32", to=TensorProto.FLOAT))
        x = "post/fp32"
    if post.activation == "softmax":
        nodes.append(helper.make_node("Softmax", [x], ["post/probs"], name="post/softmax", axis=1))
    elif post.activation == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", [x], ["post/probs"], name="post/sigmoid"))
    else:
        nodes.append(helper.make_node("Identity", [x], ["post/probs"], name="post/probs"))
    nodes.append(helper.make_node("Identity", ["post/probs"], [PROBS], name="post/probs_out"))
    if classes == 1:  # one class: foreground where p > 0.5
        inits.append(numpy_helper.from_array(np.array(0.5, np.float32), "post/half"))
        nodes.append(helper.make_node("Greater", ["post/probs", "post/half"], ["post/fg"], name="post/fg"))
        nodes.append(helper.make_node("Squeeze", ["post/fg", "post/axis1"], ["post/fg2d"], name="post/squeeze"))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "post/axis1"))
        nodes.append(helper.make_node("Cast", ["post/fg2d"], [MASK], name="post/mask", to=TensorProto.UINT8))
    else:
        nodes.append(
            helper.make_node("ArgMax", ["post/probs"], ["post/argmax"], name="post/argmax", axis=1, keepdims=0)
        )
        nodes.append(helper.make_node("Cast", ["post/argmax"], [MASK], name="post/mask", to=TensorProto.UINT8))
    return nodes, inits


def _prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop nodes and initializers that no output needs (an auxiliary head the wrap dropped)."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep: list[onnx.NodeProto] = []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(x for x in n.input if x)
    keep.reverse()
    del g.node[:]
    g.node.extend(keep)
    inits = [i for i in g.initializer if i.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    return model


# -- the whole front end ---------------------------------------------------------------------------


def prepare(cfg: BuildConfig, model: onnx.ModelProto | None = None) -> FrontEnd:
    """Run every stage on the config's model (or ``model``, already loaded)."""
    raw = model if model is not None else load_model(cfg.model)
    log: list[Rewrite] = []
    check = StageCheck(raw, cfg.model.name)
    original = check("weights", weights_out_of_inputs(raw, log))
    m = check("float64", float64_as_float32(original, log)) if cfg.precision == "fp32" else original
    single_input(m)
    up = check("opset", upgrade_opset(m, log))
    upgraded, m = (up if up is not m else None), up
    fp32 = explicit_fp32_tensors(m)  # before the simplifier drops the casts that mark it
    export_batch = None
    if cfg.batch == "fixed":  # dim 0 is data: nothing to make generic (free_batch has nothing to free either)
        fixed_input_shape(m)
    else:
        m, export_batch = symbolic_batch(m)
        m = check("batch", m)
    if export_batch is not None:
        fixed = f"the export fixed the batch at {export_batch}; dim 0 of the input and outputs is now N"
        log.append(Rewrite("batch", fixed))
    m = channels_first_regions(m, log)  # before the simplifier, whose Gemm fusion would hide the MatMuls
    m = check("channels-last", m)
    m = check("rows", batch_major_rows(m, export_batch, log))  # before the token pass: it finds the Linears moved
    m = check("tokens", token_images(m, cfg, export_batch, log))  # before the simplifier too (its Gemm fusion)
    if cfg.simplify:
        m = check("simplify", simplify(m, log))
    m = check("pad", zero_channel_concats(m, log))  # before free_batch: the zeros are of the export's batch
    m = check("pooled-vectors", pooled_vector_images(m, log))  # before free_batch: its views back go
    m = check("radix", split_attention_images(m, log))  # before free_batch: its 5-D views go
    m = check("linear-maps", linear_spatial_maps(m, export_batch, log))  # before free_batch: the soups' constants
    m, freed = free_batch(m, export_batch, cfg.batch_sizes)
    m = check("batch", m)
    if freed:
        log.append(Rewrite("batch", freed))
    m = check("resize", static_resize_scales(m, log))
    m = check("resize", separable_resizes(m, log))
    m = check("iree-forms", iree_forms(m, log))
    m = check("pools", global_max_pools(m, log))
    m = check("pad", channel_pad_convs(m, log))
    m = check("pad", fold_zero_pads(m, log))
    m = check("stack", unstack_reductions(m, log))
    m = check("convtranspose", sub_pixel_convtransposes(m, log))
    m = check("reparam", parallel_branches(m, cfg.precision, log))  # before the precision: fp32 weights summed
    m = check("names", unique_parameter_keys(m, log))
    m, precision = convert_precision(m, cfg.precision, log, fp32)
    m = check("precision", m)
    body = m = check("scale", channel_affines(m, log))  # after the precision: the range check is the final dtype's
    wrapped = check("wrap", wrap_image_io(m, cfg.preprocess, cfg.postprocess, log))
    full_check(wrapped, f"the model after the front end ({cfg.model.name})")
    classes = cfg.postprocess.classes if cfg.postprocess is not None else None
    return FrontEnd(wrapped, body, original, export_batch, precision, classes, log, upgraded)


def load(cfg: BuildConfig) -> tuple[BuildConfig, FrontEnd]:
    """The front end of a config, and the config with the precision it resolved (what the
    partition, the tuners and the build take)."""
    try:
        fe = prepare(cfg)
    except DualtrackError:
        raise
    except Exception as e:  # a bug in a stage: one line naming where (exit code 1), the traceback under --verbose
        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if "dualtrack" in Path(f.filename).parts and not f.name.startswith("<")]
        where = f" in {Path(ours[-1].filename).stem}.{ours[-1].name}" if ours else ""
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise InternalError(
            f"the front end failed on {cfg.model.name}{where} ({type(e).__name__}: {first}); this is a dualtrack "
            "bug: please report it with the model and --verbose output",
            detail=traceback.format_exc(),
        ) from e
    return cfg.model_copy(update={"precision": fe.precision, **_fixed_settings(cfg, fe)}), fe


def _fixed_settings(cfg: BuildConfig, fe: FrontEnd) -> dict[str, object]:
    """What `batch: fixed` means for the stages after the front end: one batch size, the input's dim 0
    (the plan's specs are exact there), and every node on Track B (Track A kernels compute per image)."""
    if cfg.batch != "fixed":
        return {}
    shape = fixed_input_shape(fe.model)
    partition = cfg.partition.model_copy(update={"mode": "iree", "switch_cost_us": None})
    return {"batch_sizes": (shape[0],), "partition": partition}


__all__ = ["FrontEnd", "Rewrite", "load", "load_model", "prepare"]
