"""What runs on this device: the bundle's Track A image (cubin or PTX, for which arch) and IREE target.

:func:`device_images` is the one answer, a pure function of the bundle's manifest, the device's
compute capability and the wgmma switch, so the choice is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dualtrack import kernels
from dualtrack.contract import arch
from dualtrack.contract.bundle import Bundle
from dualtrack.errors import BundleError
from dualtrack.kernels.sources import expected_abi


@dataclass(frozen=True)
class DeviceImages:
    """The images a device loads: Track A's kernels (``files``: stem -> manifest entry, empty where
    the bundle has no Track A kernels), whether conv3x3 may run the wgmma kernel, the tuned entries
    for this arch, and the IREE module target of Track B."""

    iree_target: str
    kind: str = ""  # "cubin" or "ptx"; "" with no Track A kernels
    arch: str = ""
    reason: str = ""
    files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    wgmma_off: str | None = "the bundle has no Track A kernels"  # None: conv3x3 may run wgmma
    tuned: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # Conv node -> batch -> entry

    @property
    def description(self) -> str:
        return f"{self.kind} {self.arch}: {self.reason}" if self.kind else ""

    @property
    def wgmma(self) -> str:
        """``stats.wgmma``: "on: ..." or "off: why"."""
        if self.wgmma_off:
            return f"off: {self.wgmma_off}"
        return f"on: {kernels.CONV3X3_WGMMA.stem} in the {self.arch} {self.kind}"


def device_images(bundle: Bundle, cc: tuple[int, int], *, wgmma: bool) -> DeviceImages:
    """The images of ``bundle`` for a device of compute capability ``cc``: the IREE module built
    for this arch (sm_89 PTX on Hopper, FACTS 1 and 4), the Track A cubin for this exact arch else
    its PTX (runtime/driver.py JITs it), and the wgmma kernel where the image has it and
    ``wgmma`` (DUALTRACK_WGMMA) allows it."""
    built = [(t.arch, t.track_b_iree_target) for t in bundle.manifest.targets]
    target = "cuda-" + arch.choose_iree_target(cc, built)
    ta = bundle.track_a
    if not ta.get("kernels"):
        return DeviceImages(target)
    choice = arch.choose_image(cc, sorted(ta.get("cubin", {})), sorted(ta.get("ptx", {})))
    files = ta[choice.kind][choice.arch]  # stem -> file: each target has its own set of kernels
    check_abi(bundle, ta, choice.kind, choice.arch, files)
    wgmma_stem = kernels.CONV3X3_WGMMA.stem
    if not wgmma:
        off: str | None = "DUALTRACK_WGMMA=0"
    elif wgmma_stem not in files:
        off = f"the {choice.arch} {choice.kind} has no {wgmma_stem} (sm_90a targets only)"
    else:
        off = None
    # Tuned tiles for this arch (dualtrack tune): their entries are in the image chosen above,
    # which the build compiled from the same target's PTX.
    return DeviceImages(target, choice.kind, choice.arch, choice.reason, files, off, bundle.tuned_calls(cc))


def check_abi(bundle: Bundle, ta: Mapping[str, Any], kind: str, image_arch: str, files: Mapping[str, Any]) -> None:
    """Refuse an image whose kernels take other arguments than this dualtrack launches them with
    (kernels/sources.launch_abi, recorded per PTX module by the build): a bundle built by another
    version would otherwise run with a shifted argument list, wrong results and no error."""
    for stem, entry in sorted(files.items()):
        ptx_arch = entry.get("from", image_arch) if kind == "cubin" else image_arch
        record = ta.get("ptx", {}).get(ptx_arch, {}).get(stem, {})
        recorded = record.get("abi")
        ours = expected_abi(ptx_arch, stem)
        spec = kernels.spec_for_stem(stem)
        if ours is None or spec is None:
            continue  # a kernel this version does not launch (TrackA.load skips it too)
        # every entry this version may launch from the module (TrackA.load looks each one up)
        missing = sorted(set(spec.entries) - set(record.get("entries", spec.entries)))
        if recorded != ours or missing:
            if recorded is None:
                what = "records no kernel ABI"
            elif recorded != ours:
                what = f"has {stem} kernels of another argument list"
            else:
                what = f"has no {missing[0]} kernel ({len(missing)} entries this version launches are missing)"
            raise BundleError(
                f"{bundle.root} {what} (built by dualtrack {bundle.manifest.dualtrack_version} at another kernel "
                "version than this one); rebuild it with this version (`dualtrack build CONFIG -o BUNDLE`)"
            )
