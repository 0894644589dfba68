"""Architecture resolution: what each toolchain really accepts, as pure functions.

Users (and the seed config) speak of `sm_90`, `sm_90a`, `sm_120`, `hopper`, `enable_tma`. The two
tracks' toolchains accept different things (see shared FACTS 1-4, 13):

- Track A keeps hand-written PTX for three targets: compute_80 (the portable baseline, JIT-able on
  any newer GPU), compute_90a (Hopper only: wgmma and the bulk tensor copy engine) and compute_120
  (consumer Blackwell). Cubins are assembled from those PTX files for each exact device arch.
- Track B goes through IREE 3.13, whose `--iree-cuda-target` takes sm_70..sm_89 and sm_120 but
  rejects sm_90/sm_90a/sm_100. For Hopper we compile sm_89 PTX and the driver JITs it (FACTS 4).

Every decision here is recorded in the bundle and printed, so nobody has to guess what ran.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from dualtrack.errors import ArchError, DeviceError

# What `iree-compile --iree-cuda-target=` accepts in IREE 3.13 (FACTS 1).
IREE_CUDA_TARGETS = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_120")
# PTX targets kept under handwritten_ptx/ptx/ (Track A).
PTX_ARCHES = ("compute_80", "compute_90a", "compute_120")


@dataclass(frozen=True)
class ArchInfo:
    """How one GPU architecture is served by each track."""

    name: str  # canonical, e.g. "sm_90a"
    cc: tuple[int, int]  # compute capability of the devices it runs on
    ptx_arch: str  # which of PTX_ARCHES Track A uses for it
    cubin_arch: str  # nvJitLink -arch for the cubin shipped in the bundle
    iree_target: str  # what IREE compiles for it
    tma: bool  # bulk tensor copy engine (sm_90 and newer)
    wgmma: bool  # warpgroup MMA (sm_90a only)

    @property
    def cc_str(self) -> str:
        return f"{self.cc[0]}.{self.cc[1]}"


_ARCHES = (
    ArchInfo("sm_80", (8, 0), "compute_80", "sm_80", "sm_80", tma=False, wgmma=False),
    ArchInfo("sm_86", (8, 6), "compute_80", "sm_86", "sm_86", tma=False, wgmma=False),
    ArchInfo("sm_89", (8, 9), "compute_80", "sm_89", "sm_89", tma=False, wgmma=False),
    ArchInfo("sm_90a", (9, 0), "compute_90a", "sm_90a", "sm_89", tma=True, wgmma=True),
    ArchInfo("sm_100", (10, 0), "compute_80", "sm_100", "sm_89", tma=True, wgmma=False),
    ArchInfo("sm_120", (12, 0), "compute_120", "sm_120", "sm_120", tma=True, wgmma=False),
)
ARCHES: dict[str, ArchInfo] = {a.name: a for a in _ARCHES}

# Names people use for the same hardware. Plain sm_90 means the H100/H200: the sm_90a cubin runs
# there and is the only Hopper code worth shipping.
ALIASES: dict[str, str] = {
    "sm_90": "sm_90a",
    "ampere": "sm_80",
    "a100": "sm_80",
    "rtx3090": "sm_86",
    "a10": "sm_86",
    "ada": "sm_89",
    "l4": "sm_89",
    "l40s": "sm_89",
    "rtx4090": "sm_89",
    "hopper": "sm_90a",
    "h100": "sm_90a",
    "h200": "sm_90a",
    "b200": "sm_100",
    "rtx5090": "sm_120",
}
_AMBIGUOUS = {"blackwell": "sm_100 (B200, datacenter) or sm_120 (RTX 50, consumer)"}

# PTX ISA version -> the oldest CUDA driver (cuDriverGetVersion) that can JIT it (FACTS 13).
ISA_MIN_DRIVER: dict[tuple[int, int], int] = {
    (7, 0): 11000, (7, 1): 11010, (7, 2): 11020, (7, 3): 11030, (7, 4): 11040,
    (7, 5): 11050, (7, 6): 11060, (7, 7): 11070, (7, 8): 11080,
    (8, 0): 12000, (8, 1): 12010, (8, 2): 12020, (8, 3): 12030, (8, 4): 12040,
    (8, 5): 12050, (8, 6): 12070, (8, 7): 12080, (8, 8): 12090,
    (9, 0): 13000,
}  # fmt: skip


def resolve(name: str) -> ArchInfo:
    """Map a user's arch name to an :class:`ArchInfo`, or raise ArchError naming the fix."""
    key = name.strip().lower()
    if key in _AMBIGUOUS:
        raise ArchError(f"'{name}' is ambiguous: say {_AMBIGUOUS[key]} in `targets`")
    key = ALIASES.get(key, key)
    if key in ARCHES:
        return ARCHES[key]
    known = sorted(ARCHES) + sorted(ALIASES)
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise ArchError(
        f"'{name}' is not an architecture dualtrack can target{hint}; use one of {', '.join(sorted(ARCHES))}"
    )


@dataclass(frozen=True)
class Resolution:
    """The outcome of resolving one requested target, with the reasons recorded."""

    requested: str
    arch: ArchInfo
    iree_target: str
    use_tma: bool
    notes: tuple[str, ...]

    def to_json(self) -> dict:
        return {
            "requested": self.requested,
            "arch": self.arch.name,
            "cc": self.arch.cc_str,
            "track_a_ptx": self.arch.ptx_arch,
            "track_a_cubin": self.arch.cubin_arch,
            "track_b_iree_target": self.iree_target,
            "tma": self.use_tma,
            "notes": list(self.notes),
        }


def resolve_targets(
    requested: list[str], *, enable_tma: bool | None = None, iree_target: str | None = None
) -> list[Resolution]:
    """Resolve the config's targets into what each toolchain is asked for.

    ``iree_target`` overrides the IREE target for every entry (it must be one IREE accepts).
    ``enable_tma`` turns on Track A's bulk-tensor-copy kernels where the arch has the engine
    (None, the default: on for every such target, silently off for the others; True: the same, but
    an error when no target has the engine; False: off); IREE 3.13 has no TMA option (FACTS 2), so
    it never reaches Track B.
    """
    if not requested:
        raise ArchError("`targets` is empty; list at least one, e.g. [sm_90a]")
    if iree_target is not None and iree_target not in IREE_CUDA_TARGETS:
        raise ArchError(
            f"`track_b.iree_target: {iree_target}` is not a target IREE 3.13 accepts; use one of "
            f"{', '.join(IREE_CUDA_TARGETS)}"
        )
    out: list[Resolution] = []
    seen: set[str] = set()
    for name in requested:
        arch = resolve(name)
        if arch.name in seen:
            continue
        seen.add(arch.name)
        notes: list[str] = []
        if name.strip().lower() != arch.name:
            notes.append(f"'{name}' means {arch.name} (compute capability {arch.cc_str})")
        target = iree_target or arch.iree_target
        if target != arch.name:
            why = (
                "override from track_b.iree_target"
                if iree_target
                else (f"IREE 3.13 rejects {arch.name}; its {target} PTX is JIT-compiled by the driver")
            )
            notes.append(f"Track B: {target} ({why})")
        if arch.ptx_arch.removeprefix("compute_") != arch.name.removeprefix("sm_"):
            notes.append(f"Track A: {arch.ptx_arch} PTX assembled to a {arch.cubin_arch} cubin")
        use_tma = enable_tma is not False and arch.tma
        if enable_tma and not arch.tma:
            notes.append(f"enable_tma ignored for {arch.name}: the bulk tensor copy engine needs sm_90 or newer")
        if use_tma:
            kernel = "the TMA + wgmma conv3x3" if arch.wgmma else "no TMA kernel for this arch yet (mma.sync)"
            how = "enable_tma" if enable_tma else "enable_tma (default on)"
            notes.append(
                f"{how}: Track A only, {kernel} (IREE 3.13 has no TMA option; --iree-cuda-enable-tma does not exist)"
            )
        out.append(Resolution(name, arch, target, use_tma, tuple(notes)))
    if enable_tma and not any(r.use_tma for r in out):
        raise ArchError(
            "enable_tma is set but no target has the bulk tensor copy engine; add sm_90a or sm_120 to "
            "`targets`, or drop enable_tma"
        )
    return out


def parse_ptx_isa(ptx: str) -> tuple[int, int]:
    """Read the `.version X.Y` directive of a PTX text."""
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith(".version"):
            major, minor = line.split()[1].split(".")
            return int(major), int(minor)
    raise ArchError("PTX text has no .version directive; regenerate it with `make ptx`")


def parse_ptx_target(ptx: str) -> str:
    """Read the `.target` directive of a PTX text (e.g. 'sm_90a')."""
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith(".target"):
            return line.split()[1].rstrip(",")
    raise ArchError("PTX text has no .target directive; regenerate it with `make ptx`")


def min_driver_for_isa(isa: tuple[int, int]) -> int | None:
    """The oldest driver (cuDriverGetVersion form, e.g. 13000) that JITs this PTX ISA, or None if unknown."""
    return ISA_MIN_DRIVER.get(isa)


def driver_str(version: int) -> str:
    return f"{version // 1000}.{(version % 1000) // 10}"


def check_ptx_loadable(isa: tuple[int, int], driver_version: int, *, origin: str = "PTX") -> None:
    """Refuse, before the driver does, a PTX whose ISA this driver cannot JIT (FACTS 13)."""
    need = min_driver_for_isa(isa)
    if need is None:
        raise DeviceError(
            f"{origin} uses PTX ISA {isa[0]}.{isa[1]}, newer than any dualtrack knows; rebuild the bundle "
            "with the pinned NVRTC 13.0 (`make ptx build`)"
        )
    if driver_version < need:
        raise DeviceError(
            f"{origin} uses PTX ISA {isa[0]}.{isa[1]}, which needs a CUDA {driver_str(need)} driver; this driver "
            f"is CUDA {driver_str(driver_version)}: upgrade the driver or rebuild with an older NVRTC"
        )


@dataclass(frozen=True)
class ImageChoice:
    """Which Track A code object to load on a device, and why."""

    kind: str  # "cubin" or "ptx"
    arch: str  # cubin arch (sm_90a) or PTX arch (compute_80)
    reason: str


def choose_image(device_cc: tuple[int, int], cubins: list[str], ptx: list[str]) -> ImageChoice:
    """Pick the best Track A code object for a device.

    An exact-arch cubin avoids the JIT entirely. Otherwise the newest PTX the device can JIT:
    an arch-specific PTX (compute_90a) only on exactly its compute capability, a plain one on its
    own or any newer device.
    """
    for c in cubins:
        a = ARCHES.get(c)
        if a is not None and a.cc == device_cc:
            return ImageChoice("cubin", c, f"cubin built for {c} matches the device (cc {device_cc[0]}.{device_cc[1]})")

    def ptx_cc(p: str) -> tuple[int, int]:
        digits = p.removeprefix("compute_").rstrip("a")
        return int(digits[:-1]), int(digits[-1])

    usable = [p for p in ptx if (ptx_cc(p) == device_cc) or (not p.endswith("a") and ptx_cc(p) <= device_cc)]
    if usable:
        best = max(usable, key=ptx_cc)
        return ImageChoice("ptx", best, f"no cubin for cc {device_cc[0]}.{device_cc[1]}; the driver JITs {best} PTX")
    raise ArchError(
        f"the bundle has no Track A code for a device of compute capability {device_cc[0]}.{device_cc[1]} "
        f"(cubins: {', '.join(cubins) or 'none'}; PTX: {', '.join(ptx) or 'none'}); "
        "add its arch to `targets` and rebuild"
    )


def choose_iree_target(device_cc: tuple[int, int], built: list[tuple[str, str]]) -> str:
    """Which of a bundle's IREE CUDA modules to run on a device: ``built`` is (arch, IREE target) pairs.

    The module of the device's own arch if there is one; else the newest one built for an older
    arch, whose PTX the driver JITs forward (IREE emits plain, not arch-specific, PTX).
    """
    usable = [(ARCHES[a].cc, target) for a, target in built if ARCHES[a].cc <= device_cc]
    exact = [target for cc, target in usable if cc == device_cc]
    if exact:
        return exact[0]
    if usable:
        return max(usable)[1]
    names = ", ".join(a for a, _ in built) or "none"
    raise ArchError(
        f"the bundle has no code a device of compute capability {device_cc[0]}.{device_cc[1]} can run "
        f"(built for {names}); add sm_{device_cc[0]}{device_cc[1]} to `targets` and rebuild"
    )
