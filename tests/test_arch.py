"""Architecture decisions as pure functions: names, what each toolchain is asked for, which PTX a
driver can JIT, and which Track A code object a device loads. No GPU, no tools."""

from __future__ import annotations

import pytest

from dualtrack.contract import arch
from dualtrack.errors import ArchError, DeviceError

# --- resolve ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("sm_90", "sm_90a"),
        ("SM_90A", "sm_90a"),
        (" h200 ", "sm_90a"),
        ("h100", "sm_90a"),
        ("hopper", "sm_90a"),
        ("rtx5090", "sm_120"),
        ("a100", "sm_80"),
        ("l4", "sm_89"),
        ("b200", "sm_100"),
        ("sm_86", "sm_86"),
    ],
)
def test_resolve_aliases(name: str, canonical: str) -> None:
    assert arch.resolve(name).name == canonical


def test_resolved_hopper_serves_each_track_differently() -> None:
    a = arch.resolve("sm_90")
    assert (a.cc, a.ptx_arch, a.cubin_arch, a.iree_target) == ((9, 0), "compute_90a", "sm_90a", "sm_89")
    assert a.tma and a.wgmma and a.cc_str == "9.0"


def test_every_arch_targets_what_its_toolchains_accept() -> None:
    for a in arch.ARCHES.values():
        assert a.iree_target in arch.IREE_CUDA_TARGETS, a
        assert a.ptx_arch in arch.PTX_ARCHES, a
    assert all(target in arch.ARCHES for target in arch.ALIASES.values())


def test_ambiguous_blackwell() -> None:
    with pytest.raises(
        ArchError,
        match=r"^'Blackwell' is ambiguous: say sm_100 \(B200, datacenter\) or sm_120 \(RTX 50, consumer\) "
        r"in `targets`$",
    ):
        arch.resolve("Blackwell")


def test_unknown_arch_suggests_the_nearest() -> None:
    with pytest.raises(
        ArchError,
        match=r"^'sm_95' is not an architecture dualtrack can target \(did you mean 'sm_90'\?\); "
        r"use one of sm_100, sm_120, sm_80, sm_86, sm_89, sm_90a$",
    ):
        arch.resolve("sm_95")


def test_unknown_arch_without_a_near_name() -> None:
    with pytest.raises(ArchError, match=r"^'xyz' is not an architecture dualtrack can target; use one of sm_100"):
        arch.resolve("xyz")


# --- resolve_targets --------------------------------------------------------------------------


def test_resolve_targets_records_why_for_hopper() -> None:
    (r,) = arch.resolve_targets(["sm_90"], enable_tma=False)
    assert (r.requested, r.arch.name, r.iree_target, r.use_tma) == ("sm_90", "sm_90a", "sm_89", False)
    assert r.notes == (
        "'sm_90' means sm_90a (compute capability 9.0)",
        "Track B: sm_89 (IREE 3.13 rejects sm_90a; its sm_89 PTX is JIT-compiled by the driver)",
    )
    assert r.to_json() == {
        "requested": "sm_90",
        "arch": "sm_90a",
        "cc": "9.0",
        "track_a_ptx": "compute_90a",
        "track_a_cubin": "sm_90a",
        "track_b_iree_target": "sm_89",
        "tma": False,
        "notes": list(r.notes),
    }


def test_tma_kernels_are_on_by_default_where_the_arch_has_the_engine() -> None:
    hopper, ampere = arch.resolve_targets(["sm_90a", "sm_80"])
    assert (hopper.use_tma, ampere.use_tma) == (True, False)
    assert any("enable_tma (default on): Track A only, the TMA + wgmma conv3x3" in n for n in hopper.notes)
    assert not any("enable_tma" in n for n in ampere.notes)  # unset: no note where it cannot apply
    (only_ampere,) = arch.resolve_targets(["sm_80"])  # unset and no TMA target: no error
    assert only_ampere.use_tma is False


def test_resolve_targets_plain_arch_has_no_notes() -> None:
    (r,) = arch.resolve_targets(["sm_80"])
    assert (r.arch.name, r.iree_target, r.notes) == ("sm_80", "sm_80", ())


def test_resolve_targets_notes_ptx_assembled_for_another_arch() -> None:
    (r,) = arch.resolve_targets(["sm_89"])
    assert r.notes == ("Track A: compute_80 PTX assembled to a sm_89 cubin",)


def test_resolve_targets_deduplicates_aliases_in_order() -> None:
    out = arch.resolve_targets(["h100", "sm_80", "sm_90a", "h200"])
    assert [r.arch.name for r in out] == ["sm_90a", "sm_80"]


def test_resolve_targets_empty() -> None:
    with pytest.raises(ArchError, match=r"^`targets` is empty; list at least one, e\.g\. \[sm_90a\]$"):
        arch.resolve_targets([])


def test_enable_tma_on_sm80_only_raises() -> None:
    with pytest.raises(
        ArchError,
        match=r"^enable_tma is set but no target has the bulk tensor copy engine; add sm_90a or sm_120 to `targets`, "
        r"or drop enable_tma$",
    ):
        arch.resolve_targets(["sm_80"], enable_tma=True)


def test_enable_tma_with_hopper_is_track_a_only_and_ignored_on_sm80() -> None:
    sm80, sm90a = arch.resolve_targets(["sm_80", "sm_90a"], enable_tma=True)
    assert not sm80.use_tma and sm90a.use_tma
    assert "enable_tma ignored for sm_80: the bulk tensor copy engine needs sm_90 or newer" in sm80.notes
    assert any(n.startswith("enable_tma: Track A only") for n in sm90a.notes)
    assert sm90a.iree_target == "sm_89"  # TMA never changes what IREE is asked for


def test_iree_target_override() -> None:
    sm80, sm90a = arch.resolve_targets(["sm_80", "sm_90a"], iree_target="sm_86")
    assert sm80.iree_target == sm90a.iree_target == "sm_86"
    assert "Track B: sm_86 (override from track_b.iree_target)" in sm80.notes


@pytest.mark.parametrize("bad", ["sm_90", "sm_90a", "sm_100", "compute_80"])
def test_iree_target_override_must_be_one_iree_accepts(bad: str) -> None:
    with pytest.raises(
        ArchError,
        match=rf"^`track_b.iree_target: {bad}` is not a target IREE 3.13 accepts; use one of "
        r"sm_70, sm_75, sm_80, sm_86, sm_89, sm_120$",
    ):
        arch.resolve_targets(["sm_80"], iree_target=bad)


# --- PTX text and drivers ---------------------------------------------------------------------

PTX = """//
// Generated by NVIDIA NVVM Compiler
.version 9.0
.target sm_90a
.address_size 64
.visible .entry k() { ret; }
"""


def test_parse_ptx_isa_and_target() -> None:
    assert arch.parse_ptx_isa(PTX) == (9, 0)
    assert arch.parse_ptx_target(PTX) == "sm_90a"
    assert arch.parse_ptx_target(".version 8.7\n.target sm_80, debug\n") == "sm_80"
    assert arch.parse_ptx_isa("  .version 8.7\n") == (8, 7)


def test_parse_ptx_without_directives() -> None:
    with pytest.raises(ArchError, match=r"^PTX text has no \.version directive; regenerate it with `make ptx`$"):
        arch.parse_ptx_isa(".target sm_80\n")
    with pytest.raises(ArchError, match=r"^PTX text has no \.target directive; regenerate it with `make ptx`$"):
        arch.parse_ptx_target(".version 9.0\n")


def test_min_driver_for_isa() -> None:
    assert arch.min_driver_for_isa((9, 0)) == 13000
    assert arch.min_driver_for_isa((8, 7)) == 12080
    assert arch.min_driver_for_isa((9, 9)) is None
    assert arch.driver_str(12080) == "12.8" and arch.driver_str(13000) == "13.0"


def test_isa_9_0_refused_on_driver_12_8_naming_cuda_13() -> None:
    with pytest.raises(
        DeviceError,
        match=r"^conv3x3\.ptx uses PTX ISA 9\.0, which needs a CUDA 13\.0 driver; this driver is CUDA 12\.8: "
        r"upgrade the driver or rebuild with an older NVRTC$",
    ):
        arch.check_ptx_loadable((9, 0), 12080, origin="conv3x3.ptx")


def test_unknown_isa_refused() -> None:
    with pytest.raises(
        DeviceError, match=r"^PTX uses PTX ISA 9\.9, newer than any dualtrack knows; rebuild the bundle"
    ):
        arch.check_ptx_loadable((9, 9), 13000)


@pytest.mark.parametrize(("isa", "driver"), [((9, 0), 13000), ((9, 0), 13010), ((8, 7), 12080), ((7, 0), 12000)])
def test_loadable_isa(isa: tuple[int, int], driver: int) -> None:
    assert arch.check_ptx_loadable(isa, driver) is None


# --- choose_image -----------------------------------------------------------------------------

ALL_PTX = ["compute_80", "compute_90a", "compute_120"]


def test_exact_cubin_wins_over_ptx() -> None:
    choice = arch.choose_image((9, 0), ["sm_80", "sm_90a"], ALL_PTX)
    assert (choice.kind, choice.arch) == ("cubin", "sm_90a")
    assert choice.reason == "cubin built for sm_90a matches the device (cc 9.0)"


def kind_arch(choice: arch.ImageChoice) -> tuple[str, str]:
    return choice.kind, choice.arch


def test_compute_90a_ptx_only_on_cc_9_0() -> None:
    assert kind_arch(arch.choose_image((9, 0), ["sm_80"], ALL_PTX)) == ("ptx", "compute_90a")
    # On Blackwell the arch-specific Hopper PTX cannot run: the portable one is JIT-compiled.
    assert kind_arch(arch.choose_image((10, 0), [], ["compute_80", "compute_90a"])) == ("ptx", "compute_80")


def test_compute_80_ptx_used_on_ada_without_cubin() -> None:
    choice = arch.choose_image((8, 9), ["sm_80", "sm_90a"], ALL_PTX)
    assert (choice.kind, choice.arch) == ("ptx", "compute_80")
    assert choice.reason == "no cubin for cc 8.9; the driver JITs compute_80 PTX"


def test_newest_usable_ptx_is_chosen() -> None:
    assert kind_arch(arch.choose_image((12, 0), [], ALL_PTX)) == ("ptx", "compute_120")


def test_nothing_usable_names_the_fix() -> None:
    with pytest.raises(
        ArchError,
        match=r"^the bundle has no Track A code for a device of compute capability 7\.5 "
        r"\(cubins: sm_80; PTX: compute_80\); add its arch to `targets` and rebuild$",
    ):
        arch.choose_image((7, 5), ["sm_80"], ["compute_80"])
    with pytest.raises(ArchError, match=r"compute capability 8\.0 \(cubins: none; PTX: compute_90a\)"):
        arch.choose_image((8, 0), [], ["compute_90a"])


def test_choose_iree_target_exact_then_newest_older() -> None:
    built = [("sm_90a", "sm_89"), ("sm_80", "sm_80"), ("sm_120", "sm_120")]
    assert arch.choose_iree_target((9, 0), built) == "sm_89"
    assert arch.choose_iree_target((8, 6), built) == "sm_80"  # sm_80 PTX, JIT-compiled forward
    assert arch.choose_iree_target((12, 1), built) == "sm_120"
    with pytest.raises(
        ArchError,
        match=r"^the bundle has no code a device of compute capability 7\.5 can run "
        r"\(built for sm_90a, sm_80, sm_120\); add sm_75 to `targets` and rebuild$",
    ):
        arch.choose_iree_target((7, 5), built)
