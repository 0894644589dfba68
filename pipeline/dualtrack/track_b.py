"""Track B build stages: segment ONNX -> MLIR (iree-import-onnx) -> .vmfb (iree-compile).

Each stage is a function with explicit inputs and outputs. Weights are externalized (FACTS 11a):
a module holds code only, and the runtime supplies the weights from the bundle's ONNX initializers,
so every batch and target variant shares one copy. Compiled modules are cached by a key that covers
everything that can change them: the segment graph and its weights, the batch, the target and user
flags, and the compiler version.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx

from dualtrack import atomic
from dualtrack.errors import ConfigError, ToolError, UnsupportedOpError
from dualtrack.partition import with_batch
from dualtrack.tools import run_tool, tool_version

CACHE_FORMAT = "trackb-1"  # bump when the stages below change what they produce


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


def import_onnx(model: onnx.ModelProto, workdir: Path) -> Path:
    """Stage 1: write the model and import it to MLIR with externalized weights."""
    src = workdir / "segment.onnx"
    onnx.save(model, str(src))
    mlir = workdir / "segment.mlir"
    args = [str(src), "-o", str(mlir), "--externalize-params", "--save-params-to", str(workdir / "unused.irpa")]
    try:
        run_tool("iree-import-onnx", args, what="importing the segment ONNX")
    except ToolError as e:
        _raise_unsupported(e)
        raise
    return mlir


def compile_module(mlir: Path, target: IreeTarget, flags: tuple[str, ...], out: Path) -> Path:
    """Stage 2: compile MLIR to a .vmfb for one target."""
    args = [str(mlir), *target.flags, *flags, "-o", str(out)]
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
class CompileResult:
    job: CompileJob
    vmfb: bytes
    key: str
    cached: bool


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

    def put(self, key: str, data: bytes) -> None:
        if not self.enabled:
            return
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
    static = with_batch(job.model, job.batch)
    key = cache_key(static, job.batch, job.target, job.flags, compiler)
    hit = cache.get(key)
    if hit is not None:
        return CompileResult(job, hit, key, cached=True)
    with tempfile.TemporaryDirectory(prefix="dualtrack-") as tmp:
        work = Path(tmp)
        if save_temps is not None:
            work = save_temps / f"{job.segment}-b{job.batch}-{job.target.name}"
            work.mkdir(parents=True, exist_ok=True)
        try:
            mlir = import_onnx(static, work)
            out = compile_module(mlir, job.target, job.flags, work / "module.vmfb")
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
    cache.put(key, data)
    return CompileResult(job, data, key, cached=False)
