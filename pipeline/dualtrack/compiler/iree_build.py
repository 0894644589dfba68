"""Track B build stages: segment ONNX -> MLIR (iree-import-onnx) -> .vmfb (iree-compile).

Each stage is a function with explicit inputs and outputs. Weights are externalized (FACTS 11a):
a module holds code only, and the runtime supplies the weights from the bundle's ONNX initializers,
so every batch and target variant shares one copy. Compiled modules are cached by a key that covers
everything that can change them: the segment graph and its weights, the batch, the target and user
flags, and the compiler version.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from dualtrack import atomic
from dualtrack.compiler.iree_forms import depth_to_space_crd, fp32_sums
from dualtrack.compiler.launch_extract import extract
from dualtrack.compiler.onnx_graph import infer_shapes
from dualtrack.compiler.partition import with_batch
from dualtrack.compiler.tools import run_tool, tool_version
from dualtrack.contract.launch_plan import LaunchPlan, NotReplayable
from dualtrack.errors import ConfigError, ToolError, UnsupportedOpError

CACHE_FORMAT = "trackb-4"  # bump when the stages below change what they produce (2: launch plans, 3: gather_pads,
# 4: fp32_sums)


@dataclass(frozen=True)
class IreeTarget:
    """One thing IREE compiles for: a CUDA arch, or the CPU."""

    name: str  # "cuda-sm_89", "llvm-cpu"
    flags: tuple[str, ...]

    @property
    def driver(self) -> str:
        return "cuda" if self.name.startswith("cuda") else "cpu"


def cuda_target(iree_arch: str) -> IreeTarget:
    return IreeTarget(f"cuda-{iree_arch}", ("--iree-hal-target-device=cuda", f"--iree-cuda-target={iree_arch}"))


# The CPU runs every batch as single images: one image already keeps every core busy, and IREE 3.13's
# CPU codegen fails ArgMax over (8, 2, 512, 512) ("exceeded stack allocation limit", 192 KiB).
CPU_BATCH = 1


def cpu_target(cpu: str) -> IreeTarget:
    return IreeTarget(
        "llvm-cpu",
        (
            "--iree-hal-target-device=local",
            "--iree-hal-local-target-device-backends=llvm-cpu",
            f"--iree-llvmcpu-target-cpu={cpu}",
        ),
    )


def gather_pads(model: onnx.ModelProto) -> onnx.ModelProto:
    """Stage 0: every reflect or edge Pad of a 4-D tensor over H and W as two Gathers of constant
    indices (reflect: ... 2 1 | 0 1 .. n-1 | n-2 ...; edge: 0 0 | 0 .. n-1 | n-1 n-1), the same values
    bit for bit. IREE 3.13's llvm-cpu backend fails to compile many reflect Pads ("LLVM Translation
    failed for operation: builtin.unrealized_conversion_cast": ReflectionPad2d(1) with a dynamic
    batch, (0,1,3,2) always), while a Gather compiles on every target. The indices are Constant nodes,
    not initializers: initializers are externalized and supplied from the bundle's weights at run time."""
    pads_of = {n.output[0]: n for n in model.graph.node if n.op_type == "Pad" and _pad_mode(n) in ("reflect", "edge")}
    if not pads_of:
        return model
    shapes = {
        vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in [*infer_shapes(model).graph.value_info, *model.graph.input]
    }
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    consts.update(
        {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"}
    )
    nodes: list[onnx.NodeProto] = []
    for n in model.graph.node:
        gathers = _pad_gathers(n, shapes.get(n.input[0], []), consts) if n.output[0] in pads_of else None
        nodes.extend(gathers or [n])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _pad_mode(node: onnx.NodeProto) -> str:
    mode = next((a.s for a in node.attribute if a.name == "mode"), b"constant")
    return mode.decode()


def _pad_gathers(node: onnx.NodeProto, shape: list[int], consts: dict) -> list[onnx.NodeProto] | None:
    """The Gathers that compute ``node`` (a reflect/edge Pad), or None where its pads are not constant
    or touch an axis other than H and W of a 4-D tensor of known H and W."""
    pads = consts.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if pads is None:
        pads = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "pads"), None)
    axes = list(range(len(shape)))
    if len(node.input) > 3 and node.input[3]:
        if node.input[3] not in consts:
            return None
        axes = [int(a) % len(shape) for a in consts[node.input[3]]] if shape else []
    if pads is None or len(shape) != 4 or not all(shape[2:]):
        return None
    before = dict(zip(axes, [int(v) for v in list(pads)[: len(axes)]], strict=True))
    after = dict(zip(axes, [int(v) for v in list(pads)[len(axes) :]], strict=True))
    if any(before.get(a, 0) or after.get(a, 0) for a in (0, 1)) or min([*before.values(), *after.values()]) < 0:
        return None
    reflect = _pad_mode(node) == "reflect"
    out, x = [], node.input[0]
    for axis in (2, 3):
        lo, hi, size = before.get(axis, 0), after.get(axis, 0), shape[axis]
        if not (lo or hi):
            continue
        idx = [abs(i) if reflect else 0 for i in range(-lo, 0)] + list(range(size))
        idx += [2 * (size - 1) - i if reflect else size - 1 for i in range(size, size + hi)]
        name = f"{node.output[0]}.gather{axis}"
        tensor = onnx.numpy_helper.from_array(np.array(idx, np.int64), f"{name}.idx")
        out.append(onnx.helper.make_node("Constant", [], [f"{name}.idx"], value=tensor))
        y = node.output[0] if axis == 3 or not (after.get(3, 0) or before.get(3, 0)) else name
        out.append(onnx.helper.make_node("Gather", [x, f"{name}.idx"], [y], axis=axis))
        x = y
    return out or None


def split_grouped_convtransposes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Stage 0: every grouped ConvTranspose as one ConvTranspose a group, its input, weight and bias
    split by Split nodes (of Constant sizes) and the outputs concatenated: IREE 3.13 cannot compile a
    grouped ConvTranspose ("tensor.collapse_shape ... expanded rank"; MedNeXt's depthwise upsampling),
    for any target. Here, not in the front end: Track A's convt kernel takes the groups in one launch.
    The weight is split at run time, so the bundle's weights keep their names (they are externalized)."""
    if not any(n.op_type == "ConvTranspose" and _group(n) > 1 for n in model.graph.node):
        return model
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    shapes.update(
        (vi.name, [d.dim_value for d in vi.type.tensor_type.shape.dim]) for vi in infer_shapes(model).graph.value_info
    )
    nodes: list[onnx.NodeProto] = []
    for n in model.graph.node:
        per_group = _convtranspose_per_group(n, shapes) if n.op_type == "ConvTranspose" and _group(n) > 1 else None
        nodes.extend(per_group or [n])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _group(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _convtranspose_per_group(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> list[onnx.NodeProto] | None:
    g, w = _group(node), shapes.get(node.input[1])
    if w is None or len(w) < 3 or w[0] % g or min(w) <= 0:
        return None
    base = node.name or node.output[0]
    cin, cout = w[0] // g, w[1]

    def split(x: str, size: int, what: str) -> tuple[list[onnx.NodeProto], list[str]]:
        # The sizes as a Constant's value_ints, which iree-import-onnx keeps inline: a `value` tensor of g
        # elements it externalizes past its element threshold, as a parameter the bundle does not have.
        sizes, parts = f"{base}/{what}_sizes", [f"{base}/{what}{k}" for k in range(g)]
        axis = 1 if what == "x" else 0
        return [
            onnx.helper.make_node("Constant", [], [sizes], value_ints=[size] * g),
            onnx.helper.make_node("Split", [x, sizes], parts, name=f"{base}/{what}_split", axis=axis),
        ], parts

    nodes, xs = split(node.input[0], cin, "x")
    more, ws = split(node.input[1], cin, "w")
    nodes += more
    bs: list[str] = []
    if len(node.input) > 2 and node.input[2]:
        more, bs = split(node.input[2], cout, "b")
        nodes += more
    ys = [f"{base}/y{k}" for k in range(g)]
    for k in range(g):
        one = onnx.helper.make_node("ConvTranspose", [xs[k], ws[k], *bs[k : k + 1]], [ys[k]], name=f"{base}/g{k}")
        one.attribute.extend(a for a in node.attribute if a.name != "group")
        nodes.append(one)
    nodes.append(onnx.helper.make_node("Concat", ys, [node.output[0]], name=f"{base}/groups", axis=1))
    return nodes


def iree_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """Stage 0, every rewrite: the graph IREE is given for ``model``. Its reflect and edge Pads as Gathers
    (:func:`gather_pads`), its grouped ConvTransposes a group at a time (:func:`split_grouped_convtransposes`),
    its fp16 pools and sums computed in fp32 (iree_forms.fp32_sums: IREE would accumulate them in fp16), its
    CRD DepthToSpaces as their definition (iree_forms.depth_to_space_crd: IREE computes them wrong).
    Each rewrite leaves its own output unchanged, so a second pass changes nothing."""
    return depth_to_space_crd(fp32_sums(gather_pads(split_grouped_convtransposes(model))))


def import_onnx(model: onnx.ModelProto, workdir: Path) -> Path:
    """Stage 1: write the model as IREE is given it (:func:`iree_graph`) and import it to MLIR with
    externalized weights."""
    src = workdir / "segment.onnx"
    onnx.save(iree_graph(model), str(src))
    mlir = workdir / "segment.mlir"
    args = [str(src), "-o", str(mlir), "--externalize-params", "--save-params-to", str(workdir / "unused.irpa")]
    try:
        run_tool("iree-import-onnx", args, what="importing the segment ONNX")
    except ToolError as e:
        _raise_unsupported(e)
        raise
    return mlir


def compile_module(
    mlir: Path, target: IreeTarget, flags: tuple[str, ...], out: Path, *, phases: Path | None = None
) -> Path:
    """Stage 2: compile MLIR to a .vmfb for one target. ``phases``: where the compiler also writes
    each phase's IR (the HAL stage is what :func:`launch_plan` reads)."""
    dump = [f"--dump-compilation-phases-to={phases}"] if phases is not None else []
    args = [str(mlir), *target.flags, *flags, *dump, "-o", str(out)]
    try:
        run_tool("iree-compile", args, what=f"compiling for {target.name}")
    except ToolError as e:
        unknown = re.search(r"Unknown command line argument '([^']+)'", e.stderr)
        if unknown:
            raise ConfigError(
                f"track_b.flags: iree-compile 3.13 does not know `{unknown.group(1)}`; "
                "remove it (see `iree-compile --help`)"
            ) from None
        _raise_unsupported(e)
        raise
    return out


def _raise_unsupported(e: ToolError) -> None:
    op = re.search(r'torch\.operator "onnx\.(\w+)"', e.stderr) or re.search(r"onnx\.(\w+)", e.stderr)
    if op and ("failed to legalize" in e.stderr or "unsupported" in e.stderr.lower()):
        raise UnsupportedOpError(
            f"ONNX op {op.group(1)} cannot be compiled by IREE 3.13 (Track B) and has no Track A kernel; "
            "replace it in the model or export with a different opset",
            detail=e.detail,
        ) from None


def cache_key(model: onnx.ModelProto, batch: int, target: IreeTarget, flags: tuple[str, ...], compiler: str) -> str:
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, compiler, target.name, *target.flags, "|", *flags, f"batch={batch}"):
        h.update(part.encode() + b"\0")
    h.update(model.SerializeToString(deterministic=True))
    return h.hexdigest()


@dataclass(frozen=True)
class CompileJob:
    segment: str
    model: onnx.ModelProto
    batch: int
    target: IreeTarget
    flags: tuple[str, ...]


@dataclass(frozen=True)
class Replay:
    """A CUDA module's launch plan and PTX modules (runtime/replay.py runs them without IREE), or
    why it has none (``refused``)."""

    plan: LaunchPlan | None
    ptx: tuple[bytes, ...] = ()
    refused: str = ""

    def to_json(self) -> dict:
        if self.plan is None:
            return {"refused": self.refused}
        return {"plan": self.plan.to_json(), "ptx": [m.decode() for m in self.ptx]}

    @classmethod
    def from_json(cls, d: dict) -> Replay:
        if "refused" in d:
            return cls(None, (), d["refused"])
        return cls(LaunchPlan.from_json(d["plan"]), tuple(m.encode() for m in d["ptx"]))


def launch_plan(phases: Path, vmfb: bytes) -> Replay:
    """Stage 3 (CUDA targets): the launch plan from the HAL-stage IR and the .vmfb, or the reason
    there is none (launch_plan.py: replay or refuse, never guess)."""
    hal = sorted(phases.glob("*.hal.mlir"))
    if len(hal) != 1:
        return Replay(None, (), f"iree-compile wrote {len(hal)} HAL-stage files, expected 1")
    try:
        plan, ptx = extract(hal[0].read_text(), vmfb)
    except NotReplayable as e:
        return Replay(None, (), str(e))
    return Replay(plan, ptx)


@dataclass(frozen=True)
class CompileResult:
    job: CompileJob
    vmfb: bytes
    key: str
    cached: bool
    replay: Replay | None = None  # CUDA targets only


class ModuleCache:
    """Content-addressed store of compiled modules: `<dir>/<key[:2]>/<key>.vmfb`, written atomically."""

    def __init__(self, root: Path, enabled: bool = True) -> None:
        self.root = root
        self.enabled = enabled

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.vmfb"

    def get(self, key: str) -> bytes | None:
        p = self.path(key)
        return p.read_bytes() if self.enabled and p.exists() else None

    def get_replay(self, key: str) -> Replay | None:
        p = self.path(key).with_suffix(".replay.json")
        if not (self.enabled and p.exists()):
            return None
        try:
            return Replay.from_json(json.loads(p.read_text()))
        except (ValueError, KeyError, TypeError):
            return None  # an unreadable entry is compiled again

    def put(self, key: str, data: bytes, replay: Replay | None = None) -> None:
        if not self.enabled:
            return
        if replay is not None:  # first: a module in the cache always has its plan beside it
            atomic.write_text(self.path(key).with_suffix(".replay.json"), json.dumps(replay.to_json()))
        atomic.write_bytes(self.path(key), data)


def compiler_version() -> str:
    return tool_version("iree-compile")


def run_job(
    job: CompileJob,
    cache: ModuleCache,
    compiler: str,
    save_temps: Path | None = None,
    *,
    keep_failed: Path | None = None,
) -> CompileResult:
    """Import and compile one (segment, batch, target), or take it from the cache.

    ``keep_failed``: where a failing job's stage inputs are kept (``<segment>-b<batch>-<target>``),
    so that the repro command the error carries still works after the temporary folder is gone.
    """
    # Keyed on the model as IREE imports it (stage 0's rewrites done): a change to those is a new module.
    static = iree_graph(with_batch(job.model, job.batch))
    key = cache_key(static, job.batch, job.target, job.flags, compiler)
    cuda = job.target.driver == "cuda"
    hit = cache.get(key)
    replay = cache.get_replay(key) if cuda else None
    if hit is not None and (replay is not None or not cuda):
        return CompileResult(job, hit, key, cached=True, replay=replay)
    with tempfile.TemporaryDirectory(prefix="dualtrack-") as tmp:
        work = Path(tmp)
        if save_temps is not None:
            work = save_temps / f"{job.segment}-b{job.batch}-{job.target.name}"
            work.mkdir(parents=True, exist_ok=True)
        try:
            mlir = import_onnx(static, work)
            phases = work / "phases" if cuda else None
            out = compile_module(mlir, job.target, job.flags, work / "module.vmfb", phases=phases)
        except ToolError as e:
            if keep_failed is None or save_temps is not None:
                raise
            kept = keep_failed / f"{job.segment}-b{job.batch}-{job.target.name}"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(work, kept)
            raise ToolError(
                e.tool,
                e.message.removeprefix(f"{e.tool}: "),
                returncode=e.returncode,
                stderr=e.stderr,
                argv=[a.replace(str(work), str(kept)) for a in e.argv],
            ) from None
        data = out.read_bytes()
        replay = launch_plan(phases, data) if phases is not None else None
    cache.put(key, data, replay)
    return CompileResult(job, data, key, cached=False, replay=replay)
