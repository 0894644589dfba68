"""The kernels' launch ABI in the bundle (kernels/sources.launch_abi): recorded per PTX module by the
build, checked by the loader against this version's own PTX, so that a bundle whose kernels take
another argument list (built by another version: conv3x3_wgmma gained its dilation in session 9), or that
lacks an entry this version launches, is refused with the way out instead of launched with shifted
arguments or failing on a missing function."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dualtrack import kernels
from dualtrack.contract.bundle import Bundle
from dualtrack.errors import BundleError
from dualtrack.kernels.sources import SOURCE_DIR, expected_abi, launch_abi
from dualtrack.runtime.code_images import device_images

ENTRY = """.visible .entry {name}(
\t.param .align 64 .b8 {name}_param_0[128],
\t.param .u64 .ptr .align 1 {name}_param_1,
{extra}\t.param .u32 {name}_param_2
)
{{ ret; }}
"""


def _ptx(*entries: tuple[str, str]) -> str:
    return "\n".join(ENTRY.format(name=n, extra=extra) for n, extra in entries)


def test_the_abi_is_the_parameter_lists_not_the_entry_names() -> None:
    one = launch_abi(_ptx(("k_a", "")))
    assert launch_abi(_ptx(("k_a", ""), ("k_b", ""))) == one  # another tile of the same kernel
    assert launch_abi(_ptx(("k_b", ""))) == one
    assert launch_abi(_ptx(("k_a", "\t.param .u32 k_a_param_9,\n"))) != one  # a parameter more
    assert launch_abi(_ptx(("k_a", "\t.param .f32 k_a_param_9,\n"))) != launch_abi(
        _ptx(("k_a", "\t.param .u32 k_a_param_9,\n"))
    )  # its type
    two = launch_abi(_ptx(("k_a", ""), ("k_e4m3", "\t.param .u64 .ptr .align 1 k_e4m3_param_9,\n")))
    assert two != one  # a second kind of entry in the module


def test_every_checked_in_kernel_has_an_abi() -> None:
    for arch_dir in sorted((SOURCE_DIR / "ptx").iterdir()):
        for ptx in sorted(arch_dir.glob("*.ptx")):
            assert expected_abi(arch_dir.name, ptx.stem) == launch_abi(ptx.read_text())
    assert expected_abi("compute_80", "conv3x3_wgmma") is None  # sm_90a only


def _copy(bundle: Path, dest: Path) -> Path:
    shutil.copytree(bundle, dest)
    return dest


def _edit(bundle: Path, edit) -> None:
    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    edit(m["artifacts"]["track_a"])
    path.write_text(json.dumps(m))


def test_the_loader_refuses_kernels_of_another_argument_list(tiny_full_bundle: Path, tmp_path: Path) -> None:
    ok = Bundle.open(tiny_full_bundle)
    recorded = ok.manifest.artifacts.track_a["ptx"]["compute_90a"]
    assert all(r["abi"] == expected_abi("compute_90a", stem) for stem, r in recorded.items())
    assert device_images(ok, (9, 0), wgmma=True).kind == "cubin"  # the check passes on its own build

    old = _copy(tiny_full_bundle, tmp_path / "old")
    _edit(
        old, lambda ta: ta["ptx"]["compute_90a"]["conv3x3_wgmma"].update(abi="c9a625d7f8cee139")
    )  # before its dilation
    with pytest.raises(BundleError, match=r"conv3x3_wgmma kernels of another argument list.*rebuild it"):
        device_images(Bundle.open(old, check_hashes=False), (9, 0), wgmma=True)
    # the sm_80 image does not carry the wgmma kernel: an A100 loads the same bundle
    assert device_images(Bundle.open(old, check_hashes=False), (8, 0), wgmma=True).arch == "sm_80"

    # a bundle whose module lacks an entry this version launches (a tile added since it was built)
    fewer = _copy(tiny_full_bundle, tmp_path / "fewer")
    gone = recorded["conv3x3_wgmma"]["entries"][0]
    _edit(fewer, lambda ta: ta["ptx"]["compute_90a"]["conv3x3_wgmma"]["entries"].remove(gone))
    with pytest.raises(BundleError, match=rf"has no {gone} kernel.*rebuild it"):
        device_images(Bundle.open(fewer, check_hashes=False), (9, 0), wgmma=True)
    assert set(recorded["conv3x3_wgmma"]["entries"]) >= set(kernels.CONV3X3_WGMMA.entries)

    older = _copy(tiny_full_bundle, tmp_path / "older")
    _edit(older, lambda ta: [r.pop("abi") for per in ta["ptx"].values() for r in per.values()])
    with pytest.raises(BundleError, match="records no kernel ABI"):
        device_images(Bundle.open(older, check_hashes=False), (8, 0), wgmma=True)
