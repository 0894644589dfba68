"""Track A build stages: CUDA C++ -> PTX (NVRTC) -> cubin (nvJitLink).

Each stage is a named function with explicit inputs and a frozen artifact as output:

- :func:`compile_ptx` — one ``handwritten_ptx/<stem>.cu`` to PTX for one of ``arch.PTX_ARCHES``
  with NVRTC, through ``cuda.bindings.nvrtc`` (no CUDA toolkit or GPU needed, FACTS 14);
- :func:`assemble_cubin` — PTX to a cubin for one exact GPU arch with nvJitLink, recording each
  kernel's registers and spills from the verbose info log;
- :func:`regenerate` / :func:`check_fresh` — write / verify the PTX checked in under
  ``handwritten_ptx/ptx/<arch>/<stem>.ptx`` (``python -m dualtrack.compiler.kernel_build`` and ``--check``), for the
  PTX arches each kernel states (``KernelSpec.ptx_arches``: conv3x3_wgmma is compute_90a only).

The PTX ISA is fixed by the NVRTC that emits it, and the driver caps the ISA it can JIT (FACTS 13):
NVRTC 13.0 emits ISA 9.0, which driver 580 takes. :func:`regenerate` refuses any other NVRTC.

The sources are found by :func:`dualtrack.kernels.sources.source_dir` (package data of an installed
wheel, or the checkout's ``handwritten_ptx/``); the headers next to them (``*.cuh``) reach NVRTC in memory, so no
include path or toolkit is read, and they are part of every cache key.

cuda.core 1.2's ``Program`` and ``Linker`` wrap the same two libraries, but ``Program`` needs
libcuda at compile time (FACTS 14): builds run on machines without a GPU, so NVRTC and nvJitLink
stay behind ``cuda.bindings`` here, each behind its one checker.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from cuda.bindings import nvjitlink, nvrtc

from dualtrack import atomic
from dualtrack.contract import activations
from dualtrack.contract.arch import PTX_ARCHES, parse_ptx_isa, parse_ptx_target, resolve
from dualtrack.errors import ArchError, DualtrackError, ToolError
from dualtrack.kernels import defines_for_stem, ptx_arches_for_stem
from dualtrack.kernels.sources import SOURCE_DIR, ptx_image, ptx_path, sources

PINNED_NVRTC = (13, 0)  # emits PTX ISA 9.0, the newest driver 580 (CUDA 13.0) JITs
_ENTRY = re.compile(r"^\.(?:visible|weak)\s+\.entry\s+(\w+)\s*\(", re.MULTILINE)


def nvrtc_version() -> tuple[int, int]:
    major, minor = _nvrtc_check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def nvjitlink_version() -> tuple[int, int]:
    major, minor = _nvjitlink_check(nvjitlink.version, "nvJitLinkVersion")
    return int(major), int(minor)


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def toolchain_versions() -> dict[str, str]:
    """NVRTC and nvJitLink as loaded (library version and wheel), for build records and `doctor`.
    A library that cannot be loaded is reported, not raised: this only describes the machine."""
    out: dict[str, str] = {}
    for key, probe, package in (
        ("nvrtc", nvrtc_version, "nvidia-cuda-nvrtc"),
        ("nvjitlink", nvjitlink_version, "nvidia-nvjitlink"),
    ):
        try:
            major, minor = probe()
            out[key] = f"{major}.{minor} ({package} {_package_version(package)})"
        except Exception as exc:  # a missing shared library surfaces as several exception types
            out[key] = f"not available: {exc}"
    return out


# --------------------------------------------------------------------------------------------
# NVRTC: .cu -> PTX
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileOptions:
    """NVRTC options for one compile. IEEE arithmetic (no --use_fast_math), no line info: the
    PTX must not depend on where the source lives, so that a fresh compile equals the checked-in
    file on any machine."""

    arch: str  # one of arch.PTX_ARCHES
    std: str = "c++17"
    defines: tuple[tuple[str, int | str], ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in PTX_ARCHES:
            raise ArchError(
                f"'{self.arch}' is not a PTX target of Track A; use one of {', '.join(PTX_ARCHES)} "
                "(a cubin for an exact GPU comes from assemble_cubin)"
            )

    def argv(self) -> list[str]:
        return [
            f"--gpu-architecture={self.arch}",
            f"-std={self.std}",
            *(f"-D{name}={value}" for name, value in self.defines),
        ]


@dataclass(frozen=True)
class PtxArtifact:
    """The PTX of one source for one PTX arch, and what made it."""

    source: Path
    arch: str  # compute_80, compute_90a, compute_120
    text: str  # without the trailing NUL; see :attr:`image`
    isa: tuple[int, int]  # `.version`
    target: str  # `.target`, e.g. sm_90a
    entries: tuple[str, ...]  # kernel symbols
    nvrtc_version: tuple[int, int]
    options: tuple[str, ...]
    log: str = ""  # NVRTC's program log (warnings)

    @property
    def image(self) -> bytes:
        """NUL-terminated bytes for cuModuleLoadData(Ex) or nvJitLink."""
        return ptx_image(self.text)


def _nvrtc_check(
    result: tuple[Any, ...], call: str, *, program: Any = None, context: str = "", argv: Sequence[str] = ()
) -> Any:
    """The one checker for cuda.bindings.nvrtc results: raise ToolError with the program log."""
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _program_log(program) if program is not None else ""
        _, name = nvrtc.nvrtcGetErrorString(status)
        where = f" for {context}" if context else ""
        hint = "; the compiler log is in .detail" if log.strip() else ""
        raise ToolError("NVRTC", f"{call} failed{where}: {name.decode()}{hint}", stderr=log, argv=argv)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _program_log(program: Any) -> str:
    status, size = nvrtc.nvrtcGetProgramLogSize(program)
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(program, buf)
    return buf.rstrip(b"\0").decode(errors="replace")


def _headers(source_dir: Path) -> dict[str, bytes]:
    """The headers the kernel sources may include (``handwritten_ptx/*.cuh``), by include name."""
    return {p.name: p.read_bytes() for p in sorted(Path(source_dir).glob("*.cuh"))}


def _repro(source: Path, options: CompileOptions) -> list[str]:
    argv = ["python", "-m", "dualtrack.compiler.kernel_build", "--source", str(source), "--arch", options.arch]
    for name, value in options.defines:
        argv += ["-D", f"{name}={value}"]
    return argv


def compile_ptx(source: Path, arch: str, defines: Mapping[str, int | str] | None = None) -> PtxArtifact:
    """Compile one CUDA C++ source to PTX for ``arch`` (one of ``arch.PTX_ARCHES``) with NVRTC.

    ``defines`` are ``-D`` macros; by default the tile sizes that :mod:`dualtrack.kernels`
    registers for the source's stem. Raises ArchError for an unknown arch and ToolError, with
    NVRTC's log in ``.detail``, when the source does not compile.
    """
    source = Path(source)
    if defines is None:
        defines = defines_for_stem(source.stem)
    options = CompileOptions(arch, defines=tuple(sorted(defines.items())))
    argv = options.argv()
    repro = _repro(source, options)
    try:
        code = source.read_bytes()
    except OSError as exc:
        raise ToolError("NVRTC", f"cannot read {source}: {exc.strerror}", argv=repro) from exc

    # The program is named by file name only, so nothing in the PTX depends on the checkout path;
    # the shared header is handed over in memory, so NVRTC reads no include path.
    headers = _headers(source.parent)
    program = _nvrtc_check(
        nvrtc.nvrtcCreateProgram(
            code, source.name.encode(), len(headers), list(headers.values()), [n.encode() for n in headers]
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = [a.encode() for a in argv]
        _nvrtc_check(
            nvrtc.nvrtcCompileProgram(program, len(opts), opts),
            "nvrtcCompileProgram",
            program=program,
            context=f"{source.name} ({arch})",
            argv=repro,
        )
        log = _program_log(program)
        size = _nvrtc_check(nvrtc.nvrtcGetPTXSize(program), "nvrtcGetPTXSize")
        buf = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetPTX(program, buf), "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(program)

    text = buf.rstrip(b"\0").decode()
    return PtxArtifact(
        source=source,
        arch=arch,
        text=text,
        isa=parse_ptx_isa(text),
        target=parse_ptx_target(text),
        entries=tuple(_ENTRY.findall(text)),
        nvrtc_version=nvrtc_version(),
        options=tuple(argv),
        log=log,
    )


def _inputs_key(source: Path, arch: str, defines: Mapping[str, int | str], *extra: str) -> str:
    """A hash of everything :func:`compile_ptx` reads: the source, every header beside it, the arch, the
    macros and NVRTC's version (and ``extra``)."""
    key = hashlib.sha256()
    for part in (
        Path(source).read_bytes(),
        *(name.encode() + body for name, body in _headers(Path(source).parent).items()),
        arch.encode(),
        repr(sorted(defines.items())).encode(),
        repr(nvrtc_version()).encode(),
        *(e.encode() for e in extra),
    ):
        key.update(len(part).to_bytes(8, "little") + part)
    return key.hexdigest()


def cached_ptx(
    source: Path, arch: str, defines: Mapping[str, int | str], cache_dir: Path, *, enabled: bool = True
) -> str:
    """:func:`compile_ptx`'s text, kept in ``cache_dir``: the key hashes the source, the arch, the
    macros and NVRTC's version (library and wheel), so any change that can change the PTX misses.
    For builds that compile kernels beyond the checked-in PTX (tuned entries)."""
    key = _inputs_key(source, arch, defines, _package_version("nvidia-cuda-nvrtc"))
    path = Path(cache_dir) / f"{Path(source).stem}-{arch}-{key[:40]}.ptx"
    if enabled and path.is_file():
        return path.read_text()
    text = compile_ptx(source, arch, defines).text
    if enabled:
        atomic.write_text(path, text)
    return text


# --------------------------------------------------------------------------------------------
# nvJitLink: PTX -> cubin
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_bytes: int
    shared_bytes: int  # static shared memory

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass(frozen=True)
class CubinArtifact:
    """A cubin for one exact GPU arch, and what made it."""

    arch: str  # sm_80, sm_90a, ...
    data: bytes
    ptx_target: str  # `.target` of the PTX it came from
    ptx_isa: tuple[int, int]
    nvjitlink_version: tuple[int, int]
    options: tuple[str, ...]
    info_log: str
    resources: Mapping[str, KernelResources] = field(default_factory=dict)


def _nvjitlink_check(fn: Any, call: str, *args: Any, handle: int | None = None, context: str = "") -> Any:
    """The one checker for cuda.bindings.nvjitlink calls (they raise nvJitLinkError): re-raise as
    ToolError with nvJitLink's error and info logs attached."""
    try:
        return fn(*args)
    except nvjitlink.nvJitLinkError as exc:
        logs = _link_logs(handle) if handle is not None else ""
        where = f" for {context}" if context else ""
        hint = "; the linker log is in .detail" if logs.strip() else ""
        raise ToolError("nvJitLink", f"{call} failed{where}: {exc}{hint}", stderr=logs) from exc


def _read_log(size_fn: Any, get_fn: Any, handle: int) -> str:
    try:
        size = size_fn(handle)
        if size <= 1:
            return ""
        buf = bytearray(size)
        get_fn(handle, buf)
    except nvjitlink.nvJitLinkError:
        return ""
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def _link_logs(handle: int) -> str:
    error = _read_log(nvjitlink.get_error_log_size, nvjitlink.get_error_log, handle)
    info = _read_log(nvjitlink.get_info_log_size, nvjitlink.get_info_log, handle)
    return "\n".join(part for part in (error, info) if part.strip())


def _ptx_fits(target: str, arch: str) -> bool:
    """Whether PTX written for ``target`` (sm_80, sm_90a) can be assembled for GPU ``arch``:
    arch-specific PTX (the 'a' suffix) only for exactly its arch, plain PTX for its own or newer."""

    def cc(name: str) -> int:
        return int(name.removeprefix("sm_").rstrip("a"))

    if target.endswith("a"):
        return target == arch
    return cc(target) <= cc(arch)


_LINK_OPTIONS = ("-verbose",)  # besides -arch: -verbose makes ptxas report registers and spills
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_resources(info_log: str) -> dict[str, KernelResources]:
    """Registers, spills, stack and static shared memory of each kernel, from ptxas' verbose log
    (``-verbose`` makes nvJitLink pass ``-v`` to ptxas)."""
    out: dict[str, KernelResources] = {}
    parts = _PTXAS_ENTRY.split(info_log)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        spills = _PTXAS_SPILLS.search(body)
        used = _PTXAS_USED.search(body)
        if used is None:
            continue
        stack, stores, loads = (int(g) for g in spills.groups()) if spills else (0, 0, 0)
        out[name] = KernelResources(
            registers=int(used.group(1)),
            spill_stores=stores,
            spill_loads=loads,
            stack_bytes=stack,
            shared_bytes=int(used.group(2) or 0),
        )
    return out


def assemble_cubin(ptx: str | bytes, arch: str, *, name: str = "kernels.ptx") -> CubinArtifact:
    """Assemble PTX into a cubin for one GPU ``arch`` (``sm_90a``, ``sm_86``, ...) with nvJitLink.

    Raises ArchError for an arch dualtrack does not know or PTX that cannot run on it (compute_90a
    PTX is for sm_90a only; PTX for a newer GPU cannot target an older one), and ToolError with
    nvJitLink's error and info logs when ptxas fails.
    """
    info = resolve(arch)
    text = ptx.decode().rstrip("\0") if isinstance(ptx, bytes) else ptx
    target = parse_ptx_target(text)
    isa = parse_ptx_isa(text)
    if not _ptx_fits(target, info.cubin_arch):
        raise ArchError(
            f"PTX for {target} ({name}) cannot be assembled for {info.cubin_arch}; use the "
            f"{info.ptx_arch} PTX for {info.cubin_arch}"
        )
    options = (f"-arch={info.cubin_arch}", *_LINK_OPTIONS)
    image = ptx_image(text)
    handle = _nvjitlink_check(nvjitlink.create, "nvJitLinkCreate", len(options), list(options))
    context = f"{name} -> {info.cubin_arch}"
    try:
        _nvjitlink_check(
            nvjitlink.add_data,
            "nvJitLinkAddData",
            handle,
            nvjitlink.InputType.PTX,
            image,
            len(image),
            name,
            handle=handle,
            context=context,
        )
        _nvjitlink_check(nvjitlink.complete, "nvJitLinkComplete", handle, handle=handle, context=context)
        size = _nvjitlink_check(nvjitlink.get_linked_cubin_size, "nvJitLinkGetLinkedCubinSize", handle, handle=handle)
        cubin = bytearray(size)
        _nvjitlink_check(nvjitlink.get_linked_cubin, "nvJitLinkGetLinkedCubin", handle, cubin, handle=handle)
        info_log = _read_log(nvjitlink.get_info_log_size, nvjitlink.get_info_log, handle)
    finally:
        nvjitlink.destroy(handle)
    return CubinArtifact(
        arch=info.cubin_arch,
        data=bytes(cubin),
        ptx_target=target,
        ptx_isa=isa,
        nvjitlink_version=nvjitlink_version(),
        options=options,
        info_log=info_log,
        resources=parse_resources(info_log),
    )


def cubin_cache_key(ptx: str | bytes, arch: str) -> str:
    """File name of a cached cubin: the PTX, the arch, the assembler options and nvJitLink's
    version (library and wheel) are all in the hash, so any change that can change the cubin
    misses the cache."""
    info = resolve(arch)
    key = hashlib.sha256()
    for part in (
        ptx_image(ptx),
        info.cubin_arch.encode(),
        " ".join(_LINK_OPTIONS).encode(),
        repr(nvjitlink_version()).encode(),
        _package_version("nvidia-nvjitlink").encode(),
    ):
        key.update(len(part).to_bytes(8, "little") + part)
    return f"{info.cubin_arch}-{key.hexdigest()[:40]}.cubin"


def cached_cubin(ptx: str | bytes, arch: str, cache_dir: Path, *, enabled: bool = True) -> bytes:
    """:func:`assemble_cubin`'s cubin, kept in ``cache_dir`` under :func:`cubin_cache_key`."""
    path = Path(cache_dir) / cubin_cache_key(ptx, arch)
    if enabled and path.is_file():
        return path.read_bytes()
    return cached_assembly(ptx, arch, cache_dir, enabled=enabled).data


def cached_assembly(
    ptx: str | bytes, arch: str, cache_dir: Path, *, enabled: bool = True, name: str = "kernels.ptx"
) -> CubinArtifact:
    """:func:`assemble_cubin`'s artifact, its cubin and ptxas' log kept in ``cache_dir`` (the log beside
    the cubin :func:`cached_cubin` reads): what the assembler reported, without assembling again."""
    path = Path(cache_dir) / cubin_cache_key(ptx, arch)
    log = path.with_suffix(".log")
    if enabled and path.is_file() and log.is_file():
        info, text = resolve(arch), ptx.decode().rstrip("\0") if isinstance(ptx, bytes) else ptx
        info_log = log.read_text()
        return CubinArtifact(
            arch=info.cubin_arch,
            data=path.read_bytes(),
            ptx_target=parse_ptx_target(text),
            ptx_isa=parse_ptx_isa(text),
            nvjitlink_version=nvjitlink_version(),
            options=(f"-arch={info.cubin_arch}", *_LINK_OPTIONS),
            info_log=info_log,
            resources=parse_resources(info_log),
        )
    artifact = assemble_cubin(ptx, arch, name=name)
    if enabled:  # the log first: a reader that finds the cubin finds its log (each written atomically)
        atomic.write_text(log, artifact.info_log)
        atomic.write_bytes(path, artifact.data)
    return artifact


# --------------------------------------------------------------------------------------------
# The checked-in PTX
# --------------------------------------------------------------------------------------------


def _require_pinned_nvrtc() -> None:
    found = nvrtc_version()
    if found != PINNED_NVRTC:
        raise ToolError(
            "NVRTC",
            f"NVRTC {found[0]}.{found[1]} is installed, but the checked-in PTX is built with NVRTC "
            f"{PINNED_NVRTC[0]}.{PINNED_NVRTC[1]} (PTX ISA 9.0, the newest driver 580 JITs); "
            "install nvidia-cuda-nvrtc==13.0.*",
        )


# Headers written from Python tables, by file name: the kernels include them like the others.
GENERATED_HEADERS: Mapping[str, str] = {activations.HEADER: activations.render_header()}


def regenerate(root: Path = SOURCE_DIR) -> list[Path]:
    """Write :data:`GENERATED_HEADERS` into ``root``, then compile every source under ``root`` for
    each of its PTX arches (:func:`dualtrack.kernels.ptx_arches_for_stem`) into
    ``root/ptx/<arch>/<stem>.ptx``.

    Files whose text is unchanged are not rewritten (their mtimes stay); PTX files whose source is
    gone, or that are for an arch the source is no longer built for, are deleted. Returns the paths
    of all PTX files that now exist, in build order.
    """
    _require_pinned_nvrtc()
    root = Path(root)
    for name, text in GENERATED_HEADERS.items():  # before the compiles that include them
        if not (root / name).exists() or (root / name).read_text() != text:
            (root / name).write_text(text)
    expected: list[Path] = []
    stamps: dict[str, dict[str, str]] = {}
    for source in sources(root):
        for arch in ptx_arches_for_stem(source.stem):
            artifact = compile_ptx(source, arch)
            path = ptx_path(root, source, arch)
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != artifact.text:
                path.write_text(artifact.text)
            expected.append(path)
            stamps[_rel(root, path)] = _stamp(source, arch, path)
    for orphan in sorted(set((root / "ptx").glob("*/*.ptx")) - set(expected)):
        orphan.unlink()
    text = json.dumps(stamps, indent=1, sort_keys=True) + "\n"
    if not (root / STAMPS).exists() or (root / STAMPS).read_text() != text:
        atomic.write_text(root / STAMPS, text)
    return expected


# What `make ptx` compiled each checked-in PTX file from, by path under ptx/: the hash of its inputs
# (_inputs_key) and of the PTX text it wrote. `check_fresh(compile=False)` (the test suite's check)
# compares these with the sources as they are now, in a second where compiling them all takes minutes;
# `--check` compiles every file again and compares the text.
STAMPS = "ptx/inputs.json"


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root / "ptx").as_posix()


def _stamp(source: Path, arch: str, path: Path) -> dict[str, str]:
    return {
        "inputs": _inputs_key(source, arch, defines_for_stem(source.stem)),
        "ptx": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def check_fresh(root: Path = SOURCE_DIR, compile: bool = True) -> list[str]:
    """The checked-in PTX files that differ from a fresh compile, are missing, or have no source,
    as paths relative to ``root`` with the reason (empty when everything is fresh). ``compile``
    False: from :data:`STAMPS` instead of compiling, a file is stale where its source, a header, its
    macros or NVRTC's version changed since `make ptx` wrote it, or its text did."""
    _require_pinned_nvrtc()
    root = Path(root)
    recorded = json.loads((root / STAMPS).read_text()) if (root / STAMPS).is_file() else {}
    stale = [
        f"{name} (differs from its table)"
        for name, text in GENERATED_HEADERS.items()
        if not (root / name).exists() or (root / name).read_text() != text
    ]
    expected: set[Path] = set()
    for source in sources(root):
        for arch in ptx_arches_for_stem(source.stem):
            path = ptx_path(root, source, arch)
            expected.add(path)
            rel = path.relative_to(root).as_posix()
            if not path.exists():
                stale.append(f"{rel} (missing)")
            elif compile and path.read_text() != compile_ptx(source, arch).text:
                stale.append(f"{rel} (differs from {source.name})")
            elif not compile:
                stamp, now = recorded.get(_rel(root, path)), _stamp(source, arch, path)
                if stamp is None:
                    stale.append(f"{rel} (not in {STAMPS})")
                elif stamp["inputs"] != now["inputs"]:
                    stale.append(f"{rel} (differs from {source.name}: its inputs changed since `make ptx`)")
                elif stamp["ptx"] != now["ptx"]:
                    stale.append(f"{rel} (edited since `make ptx` wrote it)")
    stems = {s.stem for s in sources(root)}
    for orphan in sorted(set((root / "ptx").glob("*/*.ptx")) - expected):
        why = "not one of its source's PTX arches" if orphan.stem in stems else "no source"
        stale.append(f"{orphan.relative_to(root).as_posix()} ({why})")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dualtrack.compiler.kernel_build`: regenerate the checked-in PTX (what `make ptx` runs)."""
    parser = argparse.ArgumentParser(prog="python -m dualtrack.compiler.kernel_build", description=main.__doc__)
    parser.add_argument("--root", type=Path, default=SOURCE_DIR, help="kernel source folder (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="list stale PTX files and exit 1 if there are any")
    parser.add_argument("--source", type=Path, help="compile this one source and print its PTX (a repro)")
    parser.add_argument(
        "--arch", choices=PTX_ARCHES, default=None, help="PTX arch for --source (default: the first it is built for)"
    )
    parser.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="macro for --source (default: the tile sizes dualtrack.kernels registers)",
    )
    args = parser.parse_args(argv)
    try:
        if args.source is not None:
            defines = None
            if args.defines is not None:
                defines = dict(d.split("=", 1) if "=" in d else (d, "1") for d in args.defines)
            arch = args.arch or ptx_arches_for_stem(args.source.stem)[0]
            artifact = compile_ptx(args.source, arch, defines)
            if artifact.log.strip():
                print(artifact.log, file=sys.stderr)
            sys.stdout.write(artifact.text)
            return 0
        if args.check:
            stale = check_fresh(args.root)
            for line in stale:
                print(f"stale: {line}")
            if stale:
                print("run `make ptx` and commit the result", file=sys.stderr)
            return 1 if stale else 0
        for path in regenerate(args.root):
            print(path)
        return 0
    except DualtrackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.detail:
            print(exc.detail, file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
