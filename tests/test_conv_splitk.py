"""Split-K of the general conv (conv_nhwc.cu's tile entries, then ``conv_nhwc_f16_splitk``) as pure
logic: which launches split and into how many slices on which device, the grids and workspace
they get, what the chooser and the launch preparation answer, and that the kernel's share of
k-tiles (``kt_range``, mirrored here) covers every k-tile once. The numbers are the GPU's:
tests/gpu/test_conv_splitk_gpu.py runs these launches against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from dualtrack.compiler.cost import DEFAULT_RATES, ConvTarget, node_cost
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import KERNELS, Activation, ConvGeneralSpec, ConvGeometry
from dualtrack.kernels.base import cdiv
from dualtrack.kernels.device import DEVICES, REFERENCE
from dualtrack.kernels.problems import ConvProblem
from dualtrack.kernels.select import choose_conv
from dualtrack.runtime.tensors import GpuTensor

SPEC = KERNELS["conv"]
assert isinstance(SPEC, ConvGeneralSpec)
H100, A10 = DEVICES["h100"], DEVICES["a10"]
PAN = ConvGeometry(7, 7, pad_top=3, pad_left=3, pad_bottom=3, pad_right=3)  # PAN's FPA block: 7x7 512 -> 1
S1 = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
NARROW, SMALL = "conv_nhwc_f16_narrow", "conv_nhwc_f16_small"
F16 = np.dtype("float16")


def split(N: int, H: int, W: int, C: int, K: int, geom: ConvGeometry, device=H100) -> tuple[str, int]:
    entry = SPEC.variant("float16", N, H, W, C, K, geom, device=device)
    return entry, SPEC.split_k("float16", N, H, W, C, K, geom, entry, device=device)


def kt_range(total: int, splits: int, s: int) -> range:
    """conv_nhwc.cu's kt_range: slice s of splits takes ceil(total / splits) k-tiles."""
    per = cdiv(total, splits)
    begin = min(total, s * per)
    return range(begin, min(total, begin + per))


def test_pans_deep_one_channel_conv_splits_over_the_gpu() -> None:
    # 784 k-tiles (49 taps x 16 channel blocks) on one 128-pixel tile: at most max_splits slices of
    # at least min_split_kt k-tiles, none empty: 61 slices of 13.
    assert SPEC.k_tiles(512, PAN, NARROW) == 784
    assert split(1, 8, 8, 512, 1, PAN) == (NARROW, 61)
    assert split(8, 8, 8, 512, 1, PAN) == (NARROW, 61)  # 4 tiles: still far from a wave
    cfg = SPEC.launch("float16", 1, 8, 8, 512, 1, geom=PAN, entry=NARROW, splits=61)
    assert cfg.grid == (1, 1, 61) and cfg.block == (128, 1, 1)
    assert SPEC.splitk_workspace_bytes(1, 8, 8, 1, PAN, 61) == 61 * 64 * 1 * 4
    assert SPEC.splitk_workspace_bytes(1, 8, 8, 1, PAN, 1) == 0


def test_a_conv_whose_tiles_fill_the_gpu_does_not_split() -> None:
    assert split(8, 128, 128, 64, 64, S1)[1] == 1  # ResNet layer 1 at batch 8
    # 64 x 2 small tiles: a block on every SM (128 of the H100's 132 count as a wave), no split
    assert split(1, 64, 64, 128, 128, S1) == (SMALL, 1)
    # 16 x 4 small tiles and 72 k-tiles: 8 slices of 9 make the wave of 4 blocks an SM
    assert split(1, 32, 32, 256, 256, S1) == (SMALL, 8)


def test_a_shallow_reduction_does_not_split() -> None:
    # 1x1 with 64 channels: 2 k-tiles, fewer than two slices of min_split_kt
    assert split(1, 2, 2, 64, 16, ConvGeometry(1, 1))[1] == 1
    assert split(1, 2, 2, 2048, 16, ConvGeometry(1, 1)) == (NARROW, 8)  # 64 k-tiles: 8 slices of 8


def test_a_deep_reduction_on_few_pixels_leaves_the_direct_entry_for_a_split_tile() -> None:
    """The direct entry (K <= 8) sums a pixel's whole reduction in one thread: a deep one over too
    few pixels goes to a split tile; a head's shallow one, or one over a wave of pixels, stays."""
    g5 = ConvGeometry(5, 5, stride_h=2, stride_w=2, pad_top=2, pad_left=2, pad_bottom=2, pad_right=2)
    for n, h, c, k, geom in ((1, 8, 512, 1, S1), (8, 8, 512, 1, S1), (1, 13, 96, 3, g5)):
        entry, splits = split(n, h, h, c, k, geom)
        assert entry == NARROW and splits > 1, (n, h, c, k, entry, splits)
        p = ConvProblem.dense(n, h, h, c, k)
        assert choose_conv(SPEC, p, H100, window=geom, act=Activation(), wgmma_off="off").entry == NARROW
    one = ConvGeometry(1, 1)
    assert split(1, 128, 128, 64, 2, one)[0] == SPEC.direct_entry  # 64 taps: a head
    assert split(1, 200, 200, 512, 1, S1)[0] == SPEC.direct_entry  # 4608 taps but 40000 pixels
    assert SPEC.direct_serial(40000, 512, S1) is None and SPEC.direct_serial(64, 512, S1) is not None


def test_the_split_count_follows_the_device() -> None:
    # 3x3/2 256 -> 512 on 16x16 at N=1 (ResNet-34's layer 4 entry): 8 small tiles, 72 k-tiles.
    g = ConvGeometry(3, 3, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
    assert split(1, 16, 16, 256, 512, g, H100) == (SMALL, 9)
    # N=8: 64 tiles; the H100's wave of 512 blocks asks for 8 slices, the A10's of 279 for 5 (of 15 k-tiles)
    assert split(8, 16, 16, 256, 512, g, H100) == (SMALL, 8)
    assert split(8, 16, 16, 256, 512, g, A10) == (SMALL, 5)


def test_groups_split_each_group_and_multiply_grid_z() -> None:
    g = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, groups=2)
    entry, s = split(1, 4, 4, 1000, 40, g)  # 500 channels a group: C % 8 != 0, the gather entry
    assert entry == "conv_nhwc_f16_gather" and SPEC.k_tiles(500, g, entry) == cdiv(9 * 500, 32)
    assert s > 1
    assert SPEC.launch("float16", 1, 4, 4, 1000, 40, geom=g, entry=entry, splits=s).grid == (1, 1, 2 * s)
    assert SPEC.splitk_workspace_bytes(1, 4, 4, 40, g, s) == s * 16 * 40 * 4  # every group's channels


@pytest.mark.parametrize("total", [16, 17, 63, 64, 100, 784, 1000, 1999])
def test_the_chosen_slices_cover_every_k_tile_once_and_none_is_empty(total: int) -> None:
    for want in range(2, min(SPEC.max_splits, total // SPEC.min_split_kt) + 1):
        per = cdiv(total, want)
        splits = cdiv(total, per)  # what split_k does with its wish
        parts = [kt_range(total, splits, s) for s in range(splits)]
        assert all(len(p) > 0 for p in parts)
        assert [k for p in parts for k in p] == list(range(total))


def test_entries_that_do_not_split_refuse_slices() -> None:
    assert SPEC.split_k("float16", 1, 8, 8, 64, 4, S1, SPEC.direct_entry, device=H100) == 1
    assert SPEC.split_k("float32", 1, 8, 8, 512, 1, PAN, "conv_nhwc_f32", device=H100) == 1
    with pytest.raises(InputError, match="split-K runs on the fp16 tile entries"):
        SPEC.launch("float16", 1, 8, 8, 64, 4, geom=S1, entry=SPEC.direct_entry, splits=4)
    with pytest.raises(InputError, match="needs a workspace"):
        SPEC.args(x=1, w=2, y=3, N=1, H=8, W=8, C=512, K=1, geom=PAN, splits=4)
    with pytest.raises(InputError, match=r"exceed grid\.z"):
        SPEC.launch("float16", 1, 8, 8, 64, 64 * 64, geom=ConvGeometry(1, 1, groups=64), entry=NARROW, splits=1024)


def test_the_chooser_reports_the_split() -> None:
    c = choose_conv(SPEC, ConvProblem.dense(1, 8, 8, 512, 1), H100, window=PAN, act=Activation(), wgmma_off="off")
    assert (c.impl, c.entry, c.splits) == ("mma.sync", NARROW, 61)
    assert "x 61 split-K" in c.reason and c.to_json()["splits"] == 61
    c = choose_conv(SPEC, ConvProblem.dense(8, 128, 128, 64, 64), H100, window=S1, act=Activation(), wgmma_off="off")
    assert c.splits == 1 and "splits" not in c.to_json()


class Context:
    """A LaunchContext that hands out one workspace address and records its size."""

    wgmma_off = "off"
    device = REFERENCE

    def tuned_entry(self, call, batch):
        return None

    def tensor_map(self, m):
        raise AssertionError("no tensor maps on the mma.sync path")

    def workspace(self, nbytes: int) -> int:
        self.nbytes = nbytes
        return 0x9000


def test_a_split_call_prepares_the_slices_then_their_sum() -> None:
    leaky = Activation.named("leakyrelu", 0.1)
    call = KernelCall("conv", ("x", "r"), ("y",), ("w", "b"), (*PAN.attrs(), *leaky.attrs(), ("residual", 1)), ("c",))
    x = GpuTensor(0x1000, (3, 8, 8, 512), F16)
    r = GpuTensor(0x2000, (3, 8, 8, 1), F16, ld=4)
    y = GpuTensor(0x3000, (3, 8, 8, 1), F16, ld=8)
    ctx = Context()
    p = SPEC.prepare_inputs(call, [x, r], y, [GpuTensor(0x4000, (1, 7, 7, 512), F16)] * 2, ctx)
    (slices,) = p.before
    assert slices.entry == NARROW and p.entry == SPEC.splitk_entry and p.choice is not None
    s = p.choice.splits
    assert s > 1 and slices.config.grid == (2, 1, s) and ctx.nbytes == s * 3 * 64 * 4
    first = dict(zip(SPEC.PARAMS, [v for v, _ in slices.args], strict=True))
    assert (first["ws"], first["splits"], first["y"]) == (0x9000, s, 0x3000)
    last = dict(zip(SPEC.SPLITK_PARAMS, [v for v, _ in p.args], strict=True))
    assert (last["ws"], last["bias"], last["res"], last["y"]) == (0x9000, 0x4000, 0x2000, 0x3000)
    assert (last["M"], last["K"], last["splits"], last["ldy"], last["ldr"]) == (192, 1, s, 8, 4)
    assert last["act"] == leaky.code and last["p0"] == pytest.approx(0.1)
    assert p.config.block == (SPEC.splitk_threads, 1, 1) and p.config.grid[0] * 256 >= 192


def test_the_cost_model_charges_a_split_conv_its_second_launch() -> None:
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="fpa", kernel_shape=[7, 7], pads=[3, 3, 3, 3])
    specs = {"x": ((1, 512, 8, 8), "float16"), "w": ((1, 512, 7, 7), "float16"), "y": ((1, 1, 8, 8), "float16")}
    target = ConvTarget.of("h100")
    assert target.splits(node, specs, 1) == 61 and target.splits(node, specs, 8) == 61
    split = node_cost(node, specs, {"w"}, [1, 8], on_a=None, kernel="conv", target=target)
    plain = node_cost(node, specs, {"w"}, [1, 8], on_a=None, kernel="conv")
    assert split.a_us == pytest.approx(plain.a_us + 2 * DEFAULT_RATES.track_a_conv.launch_us)
    wide = {"x": ((8, 64, 128, 128), "float16"), "w": ((64, 64, 7, 7), "float16")}
    assert target.splits(node, {**wide, "y": ((8, 64, 128, 128), "float16")}, 8) == 1
