"""Every environment variable dualtrack reads, and every default, in one place."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dualtrack.errors import ConfigError


@dataclass(frozen=True)
class Settings:
    """Process-wide settings read once from the environment.

    DUALTRACK_CACHE_DIR   compiled artifacts (IREE modules, cubins, JIT cubins); default ~/.cache/dualtrack
    DUALTRACK_SAVE_TEMPS  a folder: keep every build stage's inputs and outputs there (like IREE_SAVE_TEMPS)
    DUALTRACK_JOBS        parallel compiler processes; default: CPU count
    DUALTRACK_NO_CACHE    set to 1 to ignore the cache (every build compiles everything)
    DUALTRACK_CUDA_GRAPHS set to 0 to launch Track A kernels one by one instead of replaying a CUDA graph
    DUALTRACK_WGMMA       set to 0 to keep every conv3x3 on the mma.sync kernel on sm_90a too (for comparisons);
                          by default the TMA + wgmma kernel runs every conv it supports there
    DUALTRACK_IREE_ALLOCATOR  IREE CUDA device allocator specs, comma-separated; default "caching" (reuses
                          freed buffers instead of a cuMemAlloc/cuMemFree pair per call); "none": IREE's plain one
    DUALTRACK_IREE_FLAGS  extra IREE runtime flags for the CUDA device, space-separated (read once per process)
    DUALTRACK_GPU_SELF_CHECK  set to 0 to skip the check a bundle's first load on a GPU makes (runtime/selfcheck.py)
    DUALTRACK_TRACK_B     "replay" (default): Track B modules with a launch plan run on the engine's stream
                          (runtime/replay.py); "iree": every Track B module through the IREE runtime
    DUALTRACK_JPEG_LANES  the service's GPU JPEG decode threads, each with an nvImageCodec decoder and
                          stream (1-16, default 3); GPUs differ in hardware JPEG engines (the H200 has 7)
    DUALTRACK_JPEG_AHEAD_MB  GPU memory the service's JPEGs decoded ahead of their batch may hold, MiB
                          (1-65536, default 256; a 512x512 JPEG decodes to 0.75 MiB)
    DUALTRACK_PIN_SLOTS   set to 0 to leave the image slot file of `serve --workers N` pageable: the masks
                          then take two host copies each instead of going from the GPU straight into it
    DUALTRACK_HOLD_GIL    set to 0 to let the GIL go in every CUDA driver call (cuda-python's way); by default
                          the calls that only queue work keep it (runtime/driver.py HeldCalls)
    DUALTRACK_BALANCE_WORKERS  set to 0 to let the HTTP processes of `serve --workers N` race for connections
                          on one listening socket (uvicorn's supervisor) instead of the engine process handing
                          each to the one holding the fewest (serve/workers.py)
    DUALTRACK_SLOT_ANSWERS  set to 0 to answer the workers of `serve --workers N` by message only; by default a
                          request's answer is written into its slot and its worker woken by a shared semaphore
    DUALTRACK_GPU_SIGNALS  set to 0 to have the engine process's collector thread mark each answer in its slot
                          and wake its worker; by default the GPU does both itself once the batch has run
                          (Engine.signal: a store, then sem_post on the CUDA driver's thread)
    """

    cache_dir: Path
    save_temps: Path | None
    jobs: int
    use_cache: bool
    cuda_graphs: bool
    wgmma: bool = True
    iree_allocators: tuple[str, ...] = ("caching",)
    iree_flags: tuple[str, ...] = ()
    gpu_self_check: bool = True
    track_b: str = "replay"
    jpeg_lanes: int = 3
    jpeg_ahead_mb: int = 256
    pin_slots: bool = True
    hold_gil: bool = True
    balance_workers: bool = True
    slot_answers: bool = True
    gpu_signals: bool = True

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        cache = Path(
            env.get("DUALTRACK_CACHE_DIR") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dualtrack"
        )
        temps = env.get("DUALTRACK_SAVE_TEMPS")
        return cls(
            cache_dir=cache,
            save_temps=Path(temps) if temps else None,
            jobs=max(1, int(env.get("DUALTRACK_JOBS") or os.cpu_count() or 1)),
            use_cache=env.get("DUALTRACK_NO_CACHE", "") not in ("1", "true", "yes"),
            cuda_graphs=env.get("DUALTRACK_CUDA_GRAPHS", "1") not in ("0", "false", "no"),
            wgmma=env.get("DUALTRACK_WGMMA", "1") not in ("0", "false", "no"),
            iree_allocators=_allocators(env.get("DUALTRACK_IREE_ALLOCATOR", "caching")),
            iree_flags=tuple(env.get("DUALTRACK_IREE_FLAGS", "").split()),
            gpu_self_check=env.get("DUALTRACK_GPU_SELF_CHECK", "1") not in ("0", "false", "no"),
            track_b=_track_b(env.get("DUALTRACK_TRACK_B", "replay")),
            jpeg_lanes=_int_in("DUALTRACK_JPEG_LANES", env.get("DUALTRACK_JPEG_LANES") or "3", 1, 16),
            jpeg_ahead_mb=_int_in("DUALTRACK_JPEG_AHEAD_MB", env.get("DUALTRACK_JPEG_AHEAD_MB") or "256", 1, 65536),
            pin_slots=env.get("DUALTRACK_PIN_SLOTS", "1") not in ("0", "false", "no"),
            hold_gil=env.get("DUALTRACK_HOLD_GIL", "1") not in ("0", "false", "no"),
            balance_workers=env.get("DUALTRACK_BALANCE_WORKERS", "1") not in ("0", "false", "no"),
            slot_answers=env.get("DUALTRACK_SLOT_ANSWERS", "1") not in ("0", "false", "no"),
            gpu_signals=env.get("DUALTRACK_GPU_SIGNALS", "1") not in ("0", "false", "no"),
        )


def _track_b(value: str) -> str:
    if value not in ("replay", "iree"):
        raise ConfigError(f"DUALTRACK_TRACK_B={value!r}: use 'replay' (the default) or 'iree'")
    return value


def _int_in(name: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise ConfigError(f"{name}={value!r}: use a whole number from {low} to {high}")
    return number


def _allocators(value: str) -> tuple[str, ...]:
    specs = tuple(s.strip() for s in value.split(",") if s.strip())
    return () if specs in ((), ("none",)) else specs


def tool_path(name: str) -> str:
    """An IREE command-line tool: the one installed beside this Python first, then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    return found or name
