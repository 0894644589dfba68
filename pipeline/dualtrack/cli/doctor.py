"""`dualtrack doctor`: what this machine has, and whether a bundle can run on it."""

from __future__ import annotations

import shutil
import subprocess
from importlib.metadata import version as pkg_version
from pathlib import Path
from typing import Any

from dualtrack.contract import arch
from dualtrack.errors import DualtrackError


def _cmd_version(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        return "not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return f"{path} (no version)"
    last = [ln for ln in out.strip().splitlines() if ln.strip()]
    return f"{last[-1].strip() if last else '?'} ({path})"


def _pkg(name: str) -> str:
    try:
        return pkg_version(name)
    except Exception:
        return "not installed"


def diagnose(bundle: Path | None = None) -> dict[str, Any]:
    """A flat report of the GPU, driver, compilers and IREE; with a bundle, whether its code loads here."""
    from dualtrack.compiler import kernel_build as ptx
    from dualtrack.compiler.tools import tool_version

    report: dict[str, Any] = {}
    device = None
    try:
        from dualtrack.runtime.driver import Device, load_driver

        load_driver()
        device = Device(0)
        report["gpu"] = f"{device.name} (compute capability {device.cc[0]}.{device.cc[1]})"
        report["driver"] = f"CUDA {arch.driver_str(device.driver_version)} ({device.driver_version})"
        report["gpu_memory_gib"] = round(device.total_memory / 2**30, 1)
    except DualtrackError as e:
        report["gpu"] = f"none: {e.message}"
    report.update({f"nvrtc/nvjitlink {k}": v for k, v in ptx.toolchain_versions().items()})
    report["ptxas"] = _cmd_version("ptxas")
    report["nvcc"] = _cmd_version("nvcc")
    try:
        report["iree-compile"] = tool_version("iree-compile")
    except DualtrackError as e:
        report["iree-compile"] = e.message
    report["iree-base-runtime"] = _pkg("iree-base-runtime")
    report["iree_cuda_targets"] = ", ".join(arch.IREE_CUDA_TARGETS) + " (not sm_90/sm_90a/sm_100: FACTS 1)"
    report["onnxruntime"] = _pkg("onnxruntime")
    report["cuda-bindings"] = _pkg("cuda-bindings")
    if bundle is not None:
        report["bundle"] = _bundle_loadable(bundle, device)
    return report


def _bundle_loadable(path: Path, device) -> str:
    from dualtrack.contract.bundle import Bundle

    try:
        b = Bundle.open(path)
    except DualtrackError as e:
        return f"unusable: {e.message}"
    ta = b.track_a
    if not ta.get("ptx"):
        return "no Track A code (IREE only)"
    if device is None:
        return f"Track A PTX {', '.join(sorted(ta['ptx']))}; no GPU here to check against"
    try:
        choice = arch.choose_image(device.cc, sorted(ta.get("cubin", {})), sorted(ta["ptx"]))
        if choice.kind == "ptx":
            for meta in ta["ptx"][choice.arch].values():
                isa = tuple(int(x) for x in meta["isa"].split("."))
                arch.check_ptx_loadable(isa, device.driver_version, origin=meta["path"])  # type: ignore[arg-type]
    except DualtrackError as e:
        return f"cannot load here: {e.message}"
    return f"loads here: {choice.reason}"
