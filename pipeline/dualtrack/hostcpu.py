"""Which x86-64 level Track B's llvm-cpu modules are compiled for, and whether this CPU runs it.

IREE compiles a CPU module for one ``--iree-llvmcpu-target-cpu``. Code for a level the CPU lacks
(``x86-64-v4``'s AVX-512 on an AVX2-only AMD EPYC) dies of SIGILL at its first call, with no
message and no exit code of ours. So ``track_b.cpu_target: auto`` (the default) resolves to the best
level of the machine that builds, a build refuses to compile CPU code it could not verify here,
and the CPU runtime refuses a bundle whose CPU code this machine cannot run; each says the fix.

The CPU's features come from archspec (Spack's CPU detection, which knows the x86-64 levels), not
from parsing ``/proc/cpuinfo`` here. Names other than the x86-64 levels (``host``, an LLVM CPU
name such as ``znver3``) are passed to IREE as given and not checked.
"""

from __future__ import annotations

import functools

AUTO = "auto"
# LLVM's name of each x86-64 level -> archspec's, best first.
LEVELS = {"x86-64-v4": "x86_64_v4", "x86-64-v3": "x86_64_v3", "x86-64-v2": "x86_64_v2", "x86-64": "x86_64"}


@functools.cache
def _host() -> object:
    import archspec.cpu

    return archspec.cpu.host()


def _missing(level: str) -> list[str]:
    import archspec.cpu

    host = _host()
    return sorted(archspec.cpu.TARGETS[LEVELS[level]].features - host.features)  # type: ignore[attr-defined]


def resolve(requested: str) -> str:
    """``requested`` as IREE's target CPU: ``auto`` is the best x86-64 level this CPU runs (``host``
    on a CPU that is not x86-64); any other name as given."""
    if requested != AUTO:
        return requested
    if str(_host().family) != "x86_64":  # type: ignore[attr-defined]
        return "host"
    return next((level for level in LEVELS if not _missing(level)), "x86-64")


def cannot_run(target: str | None) -> str | None:
    """Why this CPU cannot run code compiled for ``target`` (None: it can, or ``target`` is not an
    x86-64 level and is not checked)."""
    if target not in LEVELS:
        return None
    family = str(_host().family)  # type: ignore[attr-defined]
    if family != "x86_64":
        return f"{target} code is x86-64 and this CPU is {family}"
    missing = _missing(target)
    if not missing:
        return None
    return f"{target} code needs {', '.join(missing)}, which this CPU ({_host()}) lacks"
