"""The GPU a launch is planned for, as data: :class:`DeviceInfo`.

The kernels' launch geometry and the convolution chooser (select.py) read the device from here and
never from constants: at run time the runtime fills one from ``cuDeviceGetAttribute``
(``runtime.driver.Device.info``); at build time, with no GPU, :func:`for_target` takes it from
:data:`DEVICES`, one row per GPU a target names (the published specifications, cited per row).
A target that is an arch, not a GPU (``sm_90a``), means the arch's reference GPU
(:data:`ARCH_DEVICE`: the H200 for Hopper, the project's reference GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dualtrack.contract import arch
from dualtrack.errors import ArchError

# What cuDeviceGetAttribute calls each field (CU_DEVICE_ATTRIBUTE_<name>): the one list the runtime reads.
ATTRIBUTES: dict[str, str] = {
    "cc_major": "COMPUTE_CAPABILITY_MAJOR",
    "cc_minor": "COMPUTE_CAPABILITY_MINOR",
    "sm_count": "MULTIPROCESSOR_COUNT",
    "grid_x": "MAX_GRID_DIM_X",
    "grid_y": "MAX_GRID_DIM_Y",
    "grid_z": "MAX_GRID_DIM_Z",
    "shared_per_block": "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "shared_per_sm": "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
    "l2_bytes": "L2_CACHE_SIZE",
}

_GRID = (2**31 - 1, 65535, 65535)
# A wave is full with 31/32 of the SMs busy: the thresholds measured on the H200 (128 CTAs, 256 and
# 512 tiles at 1, 2 and 4 a SM on 132 SMs) are exactly these, and a few idle SMs cost less than
# tiles half the size.
FULL_WAVE_NUM, FULL_WAVE_DEN = 31, 32  # every compute capability since 3.0
_KIB, _MIB = 1024, 1024 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    """What the kernels plan a launch with: SMs, grid limits, shared memory, L2."""

    name: str  # "NVIDIA H200", or the table's name
    cc: tuple[int, int]
    sm_count: int
    max_grid: tuple[int, int, int]
    shared_per_block: int  # bytes a block may opt in to (dynamic shared memory)
    shared_per_sm: int  # bytes
    l2_bytes: int
    source: str = "cuDeviceGetAttribute"  # or where the table's numbers come from

    @classmethod
    def from_attributes(cls, name: str, read: Callable[[str], int]) -> DeviceInfo:
        """The device whose ``CU_DEVICE_ATTRIBUTE_<name>`` values ``read`` returns (the runtime passes
        its checked ``cuDeviceGetAttribute``; tests a dict's ``__getitem__``)."""
        v = {field: int(read(attr)) for field, attr in ATTRIBUTES.items()}
        return cls(
            name=name,
            cc=(v["cc_major"], v["cc_minor"]),
            sm_count=v["sm_count"],
            max_grid=(v["grid_x"], v["grid_y"], v["grid_z"]),
            shared_per_block=v["shared_per_block"],
            shared_per_sm=v["shared_per_sm"],
            l2_bytes=v["l2_bytes"],
        )

    @property
    def key(self) -> str:
        """The device class that rate tables are keyed by (``h200``, ``h100``, ``sm_120``, ``sm_80``...)."""
        lowered = self.name.lower().replace(" ", "")
        for gpu in ("h200", "h100"):
            if gpu in lowered:
                return gpu
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def full_wave(self, per_sm: int = 1) -> int:
        """The fewest blocks that count as a full wave with ``per_sm`` resident on each SM: all SMs
        but 1/32 of them busy (128 of the H200's 132 at one a time). The chooser's thresholds:
        below one wave a kernel takes smaller tiles or splits its reduction."""
        return -(-self.sm_count * per_sm * FULL_WAVE_NUM // FULL_WAVE_DEN)


def _row(name: str, cc: tuple[int, int], sms: int, smem_sm_kib: int, l2_mib: int, source: str) -> DeviceInfo:
    # Opt-in shared memory per block is the SM's less the 1 KiB the system reserves per block.
    return DeviceInfo(name, cc, sms, _GRID, (smem_sm_kib - 1) * _KIB, smem_sm_kib * _KIB, l2_mib * _MIB, source)


# One row per GPU a build target may name. SMs and L2 from NVIDIA's datasheets and architecture
# whitepapers; shared memory per SM from the CUDA C Programming Guide's table of compute capabilities.
DEVICES: dict[str, DeviceInfo] = {
    "h200": _row("NVIDIA H200", (9, 0), 132, 228, 50, "H200 datasheet: GH100, 132 SMs (as the H100 SXM5)"),
    "h100": _row("NVIDIA H100 80GB HBM3", (9, 0), 132, 228, 50, "H100 whitepaper: SXM5, 132 SMs, 50 MB L2"),
    "a100": _row("NVIDIA A100-SXM4-80GB", (8, 0), 108, 164, 40, "A100 whitepaper: 108 SMs, 40 MB L2"),
    "a10": _row("NVIDIA A10", (8, 6), 72, 100, 6, "A10 datasheet: GA102, 72 SMs, 6 MB L2"),
    "l4": _row("NVIDIA L4", (8, 9), 58, 100, 48, "L4 datasheet: AD104, 58 SMs, 48 MB L2"),
    "b200": _row("NVIDIA B200", (10, 0), 148, 228, 126, "B200 datasheet: 148 SMs"),
    "rtx5090": _row("NVIDIA GeForce RTX 5090", (12, 0), 170, 100, 96, "RTX 5090 specifications: GB202, 170 SMs"),
}
# The GPU an arch target stands for: its reference part (Hopper: the project's reference H200).
ARCH_DEVICE: dict[str, str] = {
    "sm_80": "a100",
    "sm_86": "a10",
    "sm_89": "l4",
    "sm_90a": "h200",
    "sm_100": "b200",
    "sm_120": "rtx5090",
}
REFERENCE = DEVICES["h200"]  # the device whose measurements the defaults are (FACTS: reference GPU)


def for_target(target: str | None) -> DeviceInfo:
    """The device a build target names (``h100``, ``rtx5090``; an arch such as ``sm_90a`` means
    :data:`ARCH_DEVICE`'s GPU); None (a CPU-only build) is :data:`REFERENCE`. ArchError names the
    targets there are."""
    if target is None:
        return REFERENCE
    key = target.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    a = arch.resolve(key)  # ArchError for a name that is no target at all
    if a.name not in ARCH_DEVICE:
        raise ArchError(f"no device table row for {a.name}; add one to dualtrack.kernels.device.DEVICES")
    return DEVICES[ARCH_DEVICE[a.name]]
