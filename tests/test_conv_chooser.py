"""The one convolution chooser (kernels/select.py) and the device it plans for (kernels/device.py).

tests/data/conv_choices_h200.json was written by the choosers as they were before they became one
(conv3x3's policy, the general conv's ``hopper_choice``/``variant``, H200 constants in code), on the
reference U-Net's conv3x3 launches, smp Unet-resnet34-like and LR-ASPP-like shapes at N=1 and N=8:
kernel, entry, split-K and launch grid. On an H200 :class:`DeviceInfo` the chooser must answer the
same for every one of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dualtrack import kernels
from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import ArchError, InputError
from dualtrack.kernels import ConvGeometry
from dualtrack.kernels.device import ATTRIBUTES, DEVICES, REFERENCE, DeviceInfo, for_target
from dualtrack.kernels.problems import ConvProblem

PINNED = json.loads((Path(__file__).parent / "data" / "conv_choices_h200.json").read_text())
H200 = for_target("h200")
G = ConvGeometry
GEOMS = {
    "7x7s2": G(7, 7, 2, 2, 1, 1, 3, 3, 3, 3),
    "3x3s1": G(3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
    "3x3s2": G(3, 3, 2, 2, 1, 1, 1, 1, 1, 1),
    "1x1s2": G(1, 1, 2, 2),
    "1x1": G(1, 1),
    "3x3d2": G(3, 3, 1, 1, 2, 2, 2, 2, 2, 2),
    "5x5s1": G(5, 5, 1, 1, 1, 1, 2, 2, 2, 2),
}
# The activations the old table was written with, by their old codes (none, relu, hardsigmoid).
ACTS = ("none", "relu", "hardsigmoid")


def _narrowed(entry: str | None, C: int, K: int) -> str | None:
    """The pinned wgmma entry as the chooser answers since the narrow column-copy tiles (session 13): where a
    256x32 column-copy tile took K <= 16 output channels, or C <= 16 input channels with K <= 32, the tile of 16
    channels, with 16-channel k-blocks for C <= 16 (conv_layers-82ea7be-s13variants-dec4-h100.json: 0.57x the
    time on a 16 -> 16 layer at 512x512)."""
    if entry is None or not (entry.startswith("conv3x3_wgmma_bn32_mt2_wg2_bk") and entry.endswith("_h16")):
        return entry
    if K > 16 and C > 16:
        return entry
    bk = 16 if C <= 16 else int(entry.split("_bk")[1].split("_")[0])
    return f"conv3x3_wgmma_bn{16 if K <= 16 else 32}_mt2_wg2_bk{bk}_h16"


def _launch(c: kernels.ConvChoice, p: ConvProblem) -> kernels.LaunchConfig:
    if c.impl == "wgmma":
        return kernels.CONV3X3_WGMMA.launch(p.dtype, p.N, p.H, p.W, p.C, p.K, entry=c.entry, splits=c.splits)
    return kernels.KERNELS["conv3x3"].launch(p.dtype, p.N, p.H, p.W, p.C, p.K, entry=c.entry)


def _conv_call(geom: ConvGeometry, act: str) -> KernelCall:
    attrs = (*geom.attrs(), *Activation.named(act).attrs(), ("residual", 0))
    return KernelCall("conv", ("x",), ("y",), ("w",), attrs, ("node",))


def test_the_h200_chooser_picks_what_the_old_conv3x3_policy_picked() -> None:
    assert len(PINNED["conv3x3"]) > 150
    got, want = [], []
    for r in PINNED["conv3x3"]:
        p = ConvProblem.from_json(r["problem"])
        c = kernels.conv_choice(p, H200, wgmma_off=r["wgmma_off"])
        lc = _launch(c, p)
        got.append((p.label(), r["wgmma_off"], c.impl, c.entry, c.splits, list(lc.grid), list(lc.block)))
        entry = _narrowed(r["entry"], p.C, p.K)
        want.append((p.label(), r["wgmma_off"], r["impl"], entry, r["splits"], r["grid"], r["block"]))
    assert got == want


def _rule_kept(geom: str, act: str) -> bool:
    """Whether the wgmma kernel's rule for this window and activation is the pinned one: since its
    1x1 entries and its epilogue of every activation (tests/test_wgmma1x1.py), it takes 1x1 windows
    and activations other than none and ReLU too, where the pinned table has the mma.sync kernel; since
    its dilation (tests/gpu/test_wgmma_gpu.py), dilated 3x3s too."""
    return geom not in ("1x1", "3x3d2") and act in ("none", "relu")


def _pinned_hopper(r: dict[str, Any]) -> list[Any]:
    kept = [h for act, h in zip(ACTS, r["hopper"], strict=False) if _rule_kept(r["geom"], act)]
    return [h if h is None else [_narrowed(h[0], r["C"], r["K"]), h[1]] for h in kept]


def _general(r: dict[str, Any]) -> tuple[Any, ...]:
    spec = kernels.KERNELS["conv"]
    assert isinstance(spec, kernels.ConvGeneralSpec)
    g = GEOMS[r["geom"]]
    p = ConvProblem.dense(r["N"], r["H"], r["W"], r["C"], r["K"], r["dtype"])
    off = kernels.conv_choice(p, H200, call=_conv_call(g, "none"), wgmma_off="off")
    lc = spec.launch(r["dtype"], r["N"], r["H"], r["W"], r["C"], r["K"], geom=g, entry=off.entry, device=H200)
    hopper = []
    for act in ACTS[: len(r["hopper"])]:
        c = kernels.conv_choice(p, H200, call=_conv_call(g, act))
        if _rule_kept(r["geom"], act):
            hopper.append([c.entry, c.splits] if c.impl == "wgmma" else None)
    return off.entry, list(lc.grid), list(lc.block), hopper


def _stem_taken(r: dict[str, Any]) -> bool:
    """Whether a stem entry (C <= 8, kernels/conv_stem.py: newer than the pinned table) now takes the
    row's fp16 launch where the pinned table has a GEMM tile."""
    spec = kernels.KERNELS["conv"]
    assert isinstance(spec, kernels.ConvGeneralSpec)
    fp16 = r["dtype"] == "float16" and r["entry"] != spec.direct_entry
    return fp16 and spec.stem_entry(r["C"], r["K"], GEOMS[r["geom"]]) is not None


def test_the_h200_chooser_picks_what_the_old_general_conv_picked() -> None:
    assert len(PINNED["conv"]) > 500
    rows = [r for r in PINNED["conv"] if not _stem_taken(r)]
    got = [_general(r) for r in rows]
    want = [(r["entry"], r["grid"], r["block"], _pinned_hopper(r)) for r in rows]
    assert got == want
    stems = [r for r in PINNED["conv"] if _stem_taken(r)]
    assert stems and all(_general(r)[0] in kernels.KERNELS["conv"].stem_tiles() for r in stems)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("n", "hw", "c", "k", "d"), [(8, 32, 512, 512, 2), (1, 64, 2048, 256, 12), (2, 33, 40, 24, 3)])
def test_a_dilated_3x3_of_same_size_runs_on_the_per_tap_wgmma_tiles(n, hw, c, k, d) -> None:
    p = ConvProblem.dense(n, hw, hw, c, k)
    same = G(3, 3, 1, 1, d, d, d, d, d, d)
    got = kernels.conv_choice(p, H200, call=_conv_call(same, "relu"))
    assert got.impl == "wgmma" and not kernels.CONV3X3_WGMMA.config(got.entry).halo_tw, got
    assert f"dilation {d}" in got.reason
    # padding other than the dilation (the map would change size), or two dilations: not the wgmma kernel
    for g in (G(3, 3, 1, 1, d, d, 1, 1, 1, 1), G(3, 3, 1, 1, d, d + 1, d, d + 1, d, d + 1)):
        assert kernels.conv_choice(p, H200, call=_conv_call(g, "relu")).impl != "wgmma"
    with pytest.raises(InputError, match="dilation 1 only"):
        halo = next(c.entry for c in kernels.CONV3X3_WGMMA.configs if c.halo_tw)
        kernels.CONV3X3_WGMMA.args(p, tmx=_FakeMap(), tmw=_FakeMap(), y=0x1000, entry=halo, dil=d)


class _FakeMap:
    """Stands in for a CUtensorMap where only the argument checks run (no launch)."""

    def getPtr(self) -> int:  # cuda-python's name
        return 0


def test_a_device_with_fewer_sms_fills_with_smaller_tiles() -> None:
    # 512 tiles of 128x64 fill the H200's 132 SMs at 4 a SM, not a 170-SM RTX 5090's (659 do).
    p = ConvProblem.dense(4, 128, 128, 64, 64)
    off = "not sm_90a"
    assert kernels.conv_choice(p, H200, wgmma_off=off).entry == "conv3x3_nhwc_f16"
    assert kernels.conv_choice(p, for_target("rtx5090"), wgmma_off=off).entry == "conv3x3_nhwc_f16_small"
    assert H200.full_wave() == 128 and H200.full_wave(2) == 256 and H200.full_wave(4) == 512


def test_the_direct_entry_grid_follows_the_device() -> None:
    spec = kernels.KERNELS["conv"]
    assert isinstance(spec, kernels.ConvGeneralSpec)
    entry = spec.direct_entry
    for gpu in (H200, for_target("a100")):
        lc = spec.launch("float16", 8, 512, 512, 16, 2, geom=G(3, 3, 1, 1, 1, 1, 1, 1, 1, 1), entry=entry, device=gpu)
        assert lc.grid == (gpu.sm_count * spec.direct_blocks_per_sm, 1, 1)


def test_device_info_reads_every_attribute_through_the_reader() -> None:
    values = {
        "COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "MULTIPROCESSOR_COUNT": 132,
        "MAX_GRID_DIM_X": 2**31 - 1, "MAX_GRID_DIM_Y": 65535, "MAX_GRID_DIM_Z": 65535,
        "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
        "L2_CACHE_SIZE": 52428800,
    }  # fmt: skip
    asked: list[str] = []

    def read(name: str) -> int:
        asked.append(name)
        return values[name]

    info = DeviceInfo.from_attributes("NVIDIA H200", read)
    assert sorted(asked) == sorted(ATTRIBUTES.values())
    assert info == DeviceInfo("NVIDIA H200", (9, 0), 132, (2**31 - 1, 65535, 65535), 232448, 233472, 52428800)
    assert info.key == "h200" and info.full_wave() == 128
    # The table's H200 row plans exactly as the real one: the same SMs, grid and shared memory.
    assert (REFERENCE.sm_count, REFERENCE.max_grid, REFERENCE.shared_per_block) == (132, info.max_grid, 232448)


@pytest.mark.parametrize(
    ("target", "sms", "key"),
    [("sm_90a", 132, "h200"), ("h100", 132, "h100"), ("SM_80", 108, "sm_80"), ("a100", 108, "sm_80"),
     ("sm_89", 58, "sm_89"), ("rtx5090", 170, "sm_120"), ("sm_120", 170, "sm_120"), ("sm_90", 132, "h200")],
)  # fmt: skip
def test_a_build_target_names_a_table_device(target: str, sms: int, key: str) -> None:
    info = for_target(target)
    assert (info.sm_count, info.key) == (sms, key) and info.source != "cuDeviceGetAttribute"


def test_a_target_that_is_no_gpu_is_one_line_naming_the_targets() -> None:
    with pytest.raises(ArchError, match=r"^'h300' is not an architecture dualtrack can target.*use one of"):
        for_target("h300")
    assert for_target(None) is REFERENCE
    assert all(d.shared_per_block < d.shared_per_sm for d in DEVICES.values())
