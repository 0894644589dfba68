"""Build handwritten_ptx/conv3x3_wgmma.cu (dualtrack's sm_90a conv): NVRTC -> PTX -> nvJitLink -> sm_90a cubin.

    python bench/wgmma/build.py            # writes conv3x3_wgmma.ptx, .sm_90a.cubin, build.json here
    python bench/wgmma/build.py --check    # also fail unless every entry is spill-free and has HGMMA

Standalone on purpose (cuda.bindings only, no dualtrack import): check.py reuses compile_ptx() as
its fallback on the GPU machine. Stages are named functions, each returning its artifact:
compile_ptx (source -> PTX text), assemble_cubin (PTX -> cubin + ptxas resources), sass_summary
(cubin -> HGMMA count per kernel, when a cuobjdump is found).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import conv_plan  # noqa: E402

SOURCE = HERE.parents[1] / "handwritten_ptx" / "conv3x3_wgmma.cu"  # the kernel dualtrack ships
PTX_OUT = HERE / "conv3x3_wgmma.ptx"
CUBIN_OUT = HERE / "conv3x3_wgmma.sm_90a.cubin"
MANIFEST = HERE / "build.json"
ARCH = "compute_90a"
CUBIN_ARCH = "sm_90a"


class BuildError(RuntimeError):
    """A build stage failed; the tool's log is in the message."""


def source_key(source: Path = SOURCE, macro: str | None = None) -> str:
    """Hash of everything that changes the PTX: the source text and the configuration macro."""
    h = hashlib.sha256()
    h.update(source.read_bytes())
    for body in headers(source).values():
        h.update(body)
    h.update((macro if macro is not None else conv_plan.entries_macro()).encode())
    return h.hexdigest()


def nvrtc_options(macro: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        f"--gpu-architecture={ARCH}",
        "-std=c++17",
        f"-DCONV_WGMMA_ENTRIES={macro if macro is not None else conv_plan.entries_macro()}",
        *extra,
    ]


def headers(source: Path = SOURCE) -> dict[str, bytes]:
    """The in-memory headers the kernel includes (dualtrack_activations.cuh: the activation table's
    device code), the ``*.cuh`` beside it, as dualtrack's `make ptx` passes them."""
    return {p.name: p.read_bytes() for p in sorted(source.parent.glob("*.cuh"))}


def compile_ptx(source: Path = SOURCE, macro: str | None = None, extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """NVRTC: (PTX text, compile log). Raises BuildError with the log on failure."""
    from cuda.bindings import nvrtc

    opts = nvrtc_options(macro, extra)
    hdrs = headers(source)
    err, prog = nvrtc.nvrtcCreateProgram(
        source.read_bytes(), source.name.encode(), len(hdrs), list(hdrs.values()), [n.encode() for n in hdrs]
    )
    if int(err):
        raise BuildError(f"nvrtcCreateProgram: {err}")
    try:
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.rstrip(b"\0").decode(errors="replace")
        if int(status):
            raise BuildError(f"NVRTC failed ({status}) for {source.name}:\n{log_text}\nrepro options: {opts}")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetPTX(prog, buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return buf.rstrip(b"\0").decode(), log_text


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


@dataclass(frozen=True)
class Resources:
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    static_smem: int


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_resources(info_log: str) -> dict[str, Resources]:
    """Per-kernel registers / stack / spills / static smem from ptxas' verbose log."""
    out: dict[str, Resources] = {}
    parts = _ENTRY.split(info_log)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        used = _USED.search(body)
        if used is None:
            continue
        sp = _SPILLS.search(body)
        stack, st, ld = (int(g) for g in sp.groups()) if sp else (0, 0, 0)
        out[name] = Resources(int(used.group(1)), stack, st, ld, int(used.group(2) or 0))
    return out


def assemble_cubin(ptx: str, arch: str = CUBIN_ARCH) -> tuple[bytes, str]:
    """nvJitLink: (cubin bytes, info log with ptxas' -v report)."""
    from cuda.bindings import nvjitlink

    options = [f"-arch={arch}", "-verbose"]
    handle = nvjitlink.create(len(options), options)
    image = ptx.encode().rstrip(b"\0") + b"\0"

    def log(kind: str) -> str:
        size_fn = getattr(nvjitlink, f"get_{kind}_log_size")
        get_fn = getattr(nvjitlink, f"get_{kind}_log")
        try:
            size = size_fn(handle)
            if size <= 1:
                return ""
            buf = bytearray(size)
            get_fn(handle, buf)
            return bytes(buf).rstrip(b"\0").decode(errors="replace")
        except nvjitlink.nvJitLinkError:
            return ""

    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, image, len(image), "conv3x3_wgmma.ptx")
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            raise BuildError(f"nvJitLink failed: {exc}\n{log('error')}\n{log('info')}") from exc
        size = nvjitlink.get_linked_cubin_size(handle)
        cubin = bytearray(size)
        nvjitlink.get_linked_cubin(handle, cubin)
        info = log("info")
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin), info


def find_cuobjdump() -> str | None:
    """cuobjdump from $CUOBJDUMP, PATH, the CUDA toolkit, or the nvidia-cuda-cuobjdump wheel."""
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    try:
        import nvidia.cu13  # type: ignore[import-not-found]

        for root in nvidia.cu13.__path__:
            candidates.append(str(Path(root) / "bin" / "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


def sass_summary(cubin: bytes, tool: str | None = None) -> dict[str, dict[str, int]] | None:
    """Count HGMMA / HMMA / UTMALDG / local-memory instructions per kernel in the SASS (None when
    no cuobjdump is found)."""
    tool = tool or find_cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "conv3x3_wgmma.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([tool, "--dump-sass", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise BuildError(f"{tool} --dump-sass failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return count_sass(proc.stdout)


def count_sass(text: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            current = out.setdefault(m.group(1), {"HGMMA": 0, "HMMA": 0, "UTMALDG": 0, "LDL/STL": 0, "SYNCS": 0})
            continue
        if current is None:
            continue
        if "HGMMA" in line:
            current["HGMMA"] += 1
        elif re.search(r"\bHMMA\b", line):
            current["HMMA"] += 1
        if "UTMALDG" in line:
            current["UTMALDG"] += 1
        if re.search(r"\b(LDL|STL)\b", line):
            current["LDL/STL"] += 1
        if "SYNCS" in line:
            current["SYNCS"] += 1
    return out


@dataclass
class BuildRecord:
    source_sha256: str
    nvrtc: str
    ptx_isa: str
    ptx_target: str
    configs: list[dict] = field(default_factory=list)
    resources: dict[str, dict] = field(default_factory=dict)
    sass: dict[str, dict[str, int]] | None = None
    nvrtc_log: str = ""
    ptxas_warnings: list[str] = field(default_factory=list)


def build(write: bool = True) -> BuildRecord:
    ptx, log = compile_ptx()
    isa = re.search(r"^\.version\s+(\S+)", ptx, re.M)
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    cubin, info = assemble_cubin(ptx)
    resources = parse_resources(info)
    warnings = [ln for ln in info.splitlines() if "warning" in ln.lower()]
    record = BuildRecord(
        source_sha256=source_key(),
        nvrtc=nvrtc_version(),
        ptx_isa=isa.group(1) if isa else "?",
        ptx_target=target.group(1) if target else "?",
        configs=[{**asdict(c), "entry": c.entry, "smem_bytes": c.smem_bytes} for c in conv_plan.CONFIGS],
        resources={k: asdict(v) for k, v in resources.items()},
        sass=sass_summary(cubin),
        nvrtc_log=log,
        ptxas_warnings=warnings,
    )
    if write:
        PTX_OUT.write_text(ptx)
        CUBIN_OUT.write_bytes(cubin)
        MANIFEST.write_text(json.dumps(asdict(record), indent=2) + "\n")
    return record


def problems(record: BuildRecord) -> list[str]:
    """What makes a build unacceptable: a missing entry, spills/stack, no HGMMA, ptxas warnings."""
    out = []
    for c in conv_plan.CONFIGS:
        r = record.resources.get(c.entry)
        if r is None:
            out.append(f"{c.entry}: not in the ptxas report")
            continue
        if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]:
            out.append(f"{c.entry}: {r['stack_bytes']} B stack, {r['spill_stores']}/{r['spill_loads']} B spills")
        if record.sass is not None:
            s = record.sass.get(c.entry, {})
            if not s.get("HGMMA"):
                out.append(f"{c.entry}: no HGMMA in the SASS")
            if s.get("LDL/STL"):
                out.append(f"{c.entry}: {s['LDL/STL']} local-memory instructions in the SASS")
    out += [f"ptxas: {w}" for w in record.ptxas_warnings]
    if record.ptx_isa != "9.0":
        out.append(f"PTX ISA {record.ptx_isa}: driver 580 JITs at most 9.0 (use NVRTC 13.0)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 on spills, missing HGMMA or ptxas warnings")
    args = ap.parse_args(argv)
    record = build()
    print(f"NVRTC {record.nvrtc}, PTX ISA {record.ptx_isa}, target {record.ptx_target}")
    for c in conv_plan.CONFIGS:
        r = record.resources.get(c.entry, {})
        s = (record.sass or {}).get(c.entry, {})
        print(
            f"  {c.entry:32s} stages={c.stages} smem={c.smem_bytes:6d} regs={r.get('registers', '?'):>3} "
            f"stack={r.get('stack_bytes', '?')} spills={r.get('spill_stores', '?')}/{r.get('spill_loads', '?')} "
            f"HGMMA={s.get('HGMMA', '?')} UTMALDG={s.get('UTMALDG', '?')}"
        )
    for w in record.ptxas_warnings:
        print("  ptxas:", w)
    bad = problems(record)
    for p in bad:
        print("PROBLEM:", p)
    print(f"wrote {PTX_OUT.name}, {CUBIN_OUT.name}, {MANIFEST.name}")
    return 1 if (bad and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
