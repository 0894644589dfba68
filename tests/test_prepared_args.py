"""Every registered spec prepares, for a representative plan call, the launch it prepared before the
specs shared their preparation (issue 18): the same entry, geometry and argument list, value by value
and type by type. The expectations are data written out from the specs as they were, so a refactor of
the preparation cannot move what the checked-in PTX receives without this test failing."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dualtrack.contract.activations import ACTIVATIONS as PLAN_ACTS
from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import ELTWISE_OPS, NORM_KINDS, NORM_RES, KernelCall, f32_bits
from dualtrack.kernels import (
    ACTIVATIONS,
    KERNELS,
    RESIZE_RGB,
    ConvGeometry,
    ConvTGeometry,
    DwGeometry,
    HeadMode,
    PoolGeometry,
    ResizeMode,
)
from dualtrack.kernels.base import PreparedCall
from dualtrack.kernels.device import REFERENCE
from dualtrack.kernels.norm import STATS_PARAMS
from dualtrack.kernels.resize_rgb import ResizeJob
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime.tensors import GpuTensor

f16, f32, u8 = np.dtype("float16"), np.dtype("float32"), np.dtype("uint8")


class EncodedMap:
    """What the runtime's encoder hands back, as far as the wgmma spec looks (a ``getPtr``)."""

    def __init__(self, m: TiledMap) -> None:
        self.m = m

    def getPtr(self) -> int:  # cuda.bindings' spelling
        return 0


class Context:
    """A LaunchContext without a tuning file; ``wgmma_off`` None lets conv3x3 pick the Hopper kernel."""

    def __init__(self, wgmma_off: str | None) -> None:
        self.wgmma_off = wgmma_off
        self.device = REFERENCE  # the H200 the choices were measured on

    def tuned_entry(self, call: KernelCall, batch: int) -> str | None:
        return None

    def tensor_map(self, m: TiledMap) -> EncodedMap:
        return EncodedMap(m)

    def workspace(self, nbytes: int) -> int:
        self.workspace_bytes = nbytes
        return 0x9000


def T(ptr: int, shape: tuple[int, ...], dtype: np.dtype = f16, ld: int = 0) -> GpuTensor:
    return GpuTensor(ptr, shape, dtype, ld=ld)


# An argument's kind: a 64-bit address, an int32, a float32 (each from a Python value of that
# kind), or a tensor map passed by value (written as the address, dims and box it was encoded for).
KINDS = {(int, ctypes.c_void_p): "P", (int, ctypes.c_int32): "I", (float, ctypes.c_float): "F"}


def plain(entry: str, config: Any, args: list[tuple[Any, Any]]) -> tuple[Any, ...]:
    """entry, grid, block, shared bytes, the argument values and their kinds (:data:`KINDS`)."""
    values = [(v.m.address, v.m.dims, v.m.box) if t is None else v for v, t in args]
    kinds = "".join("M" if t is None else KINDS.get((type(v), t), "?") for v, t in args)
    return (entry, config.grid, config.block, config.shared_bytes, values, kinds)


def prepared(p: PreparedCall) -> tuple[Any, ...]:
    return plain(p.entry, p.config, p.args)


K = KERNELS
G = ConvGeometry(3, 3, stride_h=2, stride_w=2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
G1 = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
G2 = ConvGeometry(5, 3, dil_h=2, pad_top=4, pad_bottom=4, pad_left=1, pad_right=1)
DW = (("R", 5), ("stride", 2), ("dilation", 1), ("pad_t", 2), ("pad_l", 1), ("pad_b", 2), ("pad_r", 2))
DW_UNIT = (("R", 7), ("stride", 1), ("dilation", 1), ("pad_t", 3), ("pad_l", 3), ("pad_b", 3), ("pad_r", 3))
DW_3X3 = (("R", 3), ("stride", 1), ("dilation", 1), ("pad_t", 1), ("pad_l", 1), ("pad_b", 1), ("pad_r", 1))
DW_DILATED = (("R", 3), ("stride", 1), ("dilation", 2), ("pad_t", 2), ("pad_l", 2), ("pad_b", 2), ("pad_r", 2))
CLIP = (("act", PLAN_ACTS["clip"]), ("act_p0", f32_bits(0.5)), ("act_p1", f32_bits(6.25)))
RELU6 = Activation.named("clip", 0, 6)
HSIG = (("act", PLAN_ACTS["hardsigmoid"]), ("act_p0", f32_bits(0.2)), ("act_p1", f32_bits(0.5)))
LINEAR = (*ResizeMode("linear", "half_pixel", "floor", 2.0, 2.5).attrs(), ("Ho", 10), ("Wo", 15))
NEAREST = (*ResizeMode("nearest", "asymmetric", "round_prefer_ceil", 0.5, 0.75).attrs(), ("Ho", 4), ("Wo", 6))
C3 = KernelCall("conv3x3", ("x",), ("y",), ("w", "b"), (("relu", 1),), ("c",))
P, Q = G.output_hw(9, 10)
P2, Q2 = G2.output_hw(12, 11)
HO, WO = DwGeometry(5, 2, 1, (2, 1, 2, 2)).output_hw(13, 14)
TG = ConvTGeometry(3, 3, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, out_pad_h=1, out_pad_w=1, groups=2)
TG2 = ConvTGeometry(4, 5, 3, 2, pad_top=1, pad_left=2, pad_bottom=0, pad_right=1)
RES = ("residual", 1)
GG = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, groups=32)
GD = ConvGeometry(3, 3, dil_h=2, dil_w=2, pad_top=2, pad_left=2, pad_bottom=2, pad_right=2)  # DeepLab's same-size 3x3
POOL3 = PoolGeometry(3, 3, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
POOL_CEIL = PoolGeometry(3, 2, 2, 3, dil_h=2, pad_bottom=1, ceil_mode=1)

# Each case: how to prepare it (the plan call on device tensors, channel slices included).
CASES: dict[str, Callable[[], PreparedCall]] = {
    "conv3x3 f16 portable": lambda: K["conv3x3"].prepare(
        C3, T(0x1000, (2, 16, 16, 32), ld=48), T(0x2000, (2, 16, 16, 64), ld=96),
        [T(0x3000, (64, 3, 3, 32)), T(0x4000, (64,), f32)], Context("off"),
    ),
    "conv3x3 f32": lambda: K["conv3x3"].prepare(
        C3, T(0x1000, (1, 8, 8, 16), f32), T(0x2000, (1, 8, 8, 24), f32), [T(0x3000, (24, 3, 3, 16), f32)],
        Context("off"),
    ),
    "conv3x3 f16 hopper": lambda: K["conv3x3"].prepare_inputs(
        C3, [T(0x1000, (2, 64, 64, 64))], T(0x2000, (2, 64, 64, 128), ld=192),
        [T(0x3000, (128, 3, 3, 64)), T(0x4000, (128,), f32)], Context(None),
    ),
    "maxpool2x2": lambda: K["maxpool2x2"].prepare(
        KernelCall("maxpool2x2", ("x",), ("y",)), T(0x1000, (2, 9, 8, 40), ld=72), T(0x2000, (2, 4, 4, 40), ld=48),
        [], Context("off"),
    ),
    "maxpool": lambda: K["maxpool"].prepare(
        KernelCall("maxpool", ("x",), ("y",), (), POOL3.attrs()), T(0x1000, (2, 9, 8, 40), ld=72),
        T(0x2000, (2, 5, 4, 40), ld=48), [], Context("off"),
    ),
    "maxpool ceil f32": lambda: K["maxpool"].prepare_inputs(
        KernelCall("maxpool", ("x",), ("y",), (), POOL_CEIL.attrs()), [T(0x1000, (1, 11, 10, 5), f32)],
        T(0x2000, (1, *POOL_CEIL.output_hw(11, 10), 5), f32), [], Context("off"),
    ),
    "convt2x2": lambda: K["convt2x2"].prepare_inputs(
        KernelCall("convt2x2", ("x",), ("y",), ("w", "b")), [T(0x1000, (1, 4, 4, 16), f32)],
        T(0x2000, (1, 8, 8, 8), f32, ld=24), [T(0x3000, (32, 16), f32), T(0x4000, (8,), f32)], Context("off"),
    ),
    "conv1x1": lambda: K["conv1x1"].prepare(
        KernelCall("conv1x1", ("x",), ("y",), ("w", "b"), (("relu", 1),)), T(0x1000, (1, 5, 7, 32), ld=64),
        T(0x2000, (1, 5, 7, 3)), [T(0x3000, (3, 1, 1, 32)), T(0x4000, (3,), f32)], Context("off"),
    ),
    "conv residual": lambda: K["conv"].prepare_inputs(
        KernelCall("conv", ("x", "r"), ("y",), ("w", "b"), (*G.attrs(), ("act", ACTIVATIONS["silu"]), ("residual", 1))),
        [T(0x1000, (2, 9, 10, 24), ld=40), T(0x2000, (2, P, Q, 48), ld=96)], T(0x3000, (2, P, Q, 48), ld=64),
        [T(0x4000, (48, 3, 3, 24)), T(0x5000, (48,), f32)], Context("off"),
    ),
    "conv residual hopper": lambda: K["conv"].prepare_inputs(
        KernelCall(
            "conv", ("x", "r"), ("y",), ("w", "b"), (*G1.attrs(), ("act", ACTIVATIONS["relu"]), ("residual", 1))
        ),
        [T(0x1000, (2, 16, 16, 64)), T(0x2000, (2, 16, 16, 128), ld=136)], T(0x3000, (2, 16, 16, 128)),
        [T(0x4000, (128, 3, 3, 64)), T(0x5000, (128,), f32)], Context(None),
    ),
    "conv residual hopper split-k": lambda: K["conv"].prepare_inputs(
        KernelCall(
            "conv", ("x", "r"), ("y",), ("w", "b"), (*G1.attrs(), ("act", ACTIVATIONS["relu"]), ("residual", 1))
        ),
        [T(0x1000, (1, 16, 16, 512)), T(0x2000, (1, 16, 16, 512))], T(0x3000, (1, 16, 16, 512)),
        [T(0x4000, (512, 3, 3, 512)), T(0x5000, (512,), f32)], Context(None),
    ),
    # Added with the wgmma kernel's dilation: a dilated same-size 3x3 on a per-tap tile, `dil` 2.
    "conv dilated hopper": lambda: K["conv"].prepare_inputs(
        KernelCall("conv", ("x",), ("y",), ("w", "b"), (*GD.attrs(), ("act", ACTIVATIONS["relu"]), ("residual", 0))),
        [T(0x1000, (2, 20, 24, 64))], T(0x3000, (2, 20, 24, 128)),
        [T(0x4000, (128, 3, 3, 64)), T(0x5000, (128,), f32)], Context(None),
    ),
    "conv f32 plain": lambda: K["conv"].prepare(
        KernelCall("conv", ("x",), ("y",), ("w",), (*G2.attrs(), *RELU6.attrs())), T(0x1000, (1, 12, 11, 5), f32),
        T(0x3000, (1, P2, Q2, 7), f32, ld=9), [T(0x4000, (7, 5, 3, 5), f32)], Context("off"),
    ),
    "conv grouped": lambda: K["conv"].prepare_inputs(
        KernelCall("conv", ("x",), ("y",), ("w", "b"), (*GG.attrs(), ("residual", 0))), [T(0x1000, (2, 16, 16, 128))],
        T(0x3000, (2, 16, 16, 128)), [T(0x4000, (128, 3, 3, 4)), T(0x5000, (128,), f32)], Context(None),
    ),
    "convt": lambda: K["convt"].prepare_inputs(
        KernelCall("convt", ("x", "r"), ("y",), ("w", "b"), (*TG.attrs(), ("act", ACTIVATIONS["relu"]), RES)),
        [T(0x1000, (2, 5, 6, 16), ld=24), T(0x2000, (2, 10, 12, 32), ld=40)], T(0x3000, (2, 10, 12, 32), ld=48),
        [T(0x4000, (2, 3, 3, 8, 16)), T(0x5000, (32,), f32)], Context("off"),
    ),
    "convt f32 plain": lambda: K["convt"].prepare_inputs(
        KernelCall("convt", ("x",), ("y",), ("w",), TG2.attrs()), [T(0x1000, (1, 4, 5, 3), f32)],
        T(0x3000, (1, 12, 10, 7), f32), [T(0x4000, (1, 4, 5, 3, 7), f32)], Context("off"),
    ),
    "dwconv": lambda: K["dwconv"].prepare(
        KernelCall("dwconv", ("x",), ("y",), ("w", "b"), (*DW, ("act", PLAN_ACTS["hardswish"]))),
        T(0x1000, (2, 13, 14, 24), ld=40), T(0x2000, (2, HO, WO, 24), ld=56),
        [T(0x3000, (5, 5, 24)), T(0x4000, (24,), f32)], Context("off"),
    ),
    "dwconv tile": lambda: K["dwconv"].prepare(  # stride 1, fp16, aligned: the tiled entry
        KernelCall("dwconv", ("x",), ("y",), ("w", "b"), (*DW_UNIT, ("act", PLAN_ACTS["relu"]))),
        T(0x1000, (2, 20, 30, 96)), T(0x2000, (2, 20, 30, 96), ld=104),
        [T(0x3000, (7, 7, 96)), T(0x4000, (96,), f32)], Context("off"),
    ),
    "dwconv cols": lambda: replace(K["dwconv"], cols=True).prepare(  # a 3x3, fp16, aligned: the column entry
        KernelCall("dwconv", ("x",), ("y",), ("w", "b"), (*DW_3X3, ("act", PLAN_ACTS["gelu"]))),
        T(0x1000, (2, 20, 30, 96)), T(0x2000, (2, 20, 30, 96), ld=104),
        [T(0x3000, (3, 3, 96)), T(0x4000, (96,), f32)], Context("off"),
    ),
    "dwconv tile misaligned": lambda: K["dwconv"].prepare(  # the same but x 8 bytes off 16: per element
        KernelCall("dwconv", ("x",), ("y",), ("w", "b"), (*DW_UNIT, ("act", PLAN_ACTS["relu"]))),
        T(0x1008, (2, 20, 30, 96)), T(0x2000, (2, 20, 30, 96), ld=104),
        [T(0x3000, (7, 7, 96)), T(0x4000, (96,), f32)], Context("off"),
    ),
    "dwconv nobias f32": lambda: K["dwconv"].prepare_inputs(
        KernelCall("dwconv", ("x",), ("y",), ("w",), DW_DILATED), [T(0x1000, (1, 6, 7, 8), f32)],
        T(0x2000, (1, 6, 7, 8), f32), [T(0x3000, (3, 3, 8), f32)], Context("off"),
    ),
    "gap": lambda: K["gap"].prepare(  # a call without op (a bundle before the reduction table): the mean
        KernelCall("gap", ("x",), ("y",)), T(0x1000, (3, 7, 9, 72), ld=80), T(0x2000, (3, 1, 1, 72), ld=96), [],
        Context("off"),
    ),
    "gap l2": lambda: K["gap"].prepare(  # ConvNeXt-V2's GRN norm
        KernelCall("gap", ("x",), ("y",), (), (("op", 5),)), T(0x1000, (3, 7, 9, 72), ld=80),
        T(0x2000, (3, 1, 1, 72), ld=96), [], Context("off"),
    ),
    "creduce max": lambda: K["creduce"].prepare(  # CBAM's max into channel 0 of a 2-channel Concat
        KernelCall("creduce", ("x",), ("y",), (), (("op", 2),)), T(0x1000, (2, 5, 7, 24), ld=40),
        T(0x2000, (2, 5, 7, 1), ld=2), [], Context("off"),
    ),
    "fc": lambda: K["fc"].prepare(
        KernelCall("fc", ("x",), ("y",), ("w", "b"), CLIP), T(0x1000, (4, 1, 1, 40), ld=48),
        T(0x2000, (4, 1, 1, 10), ld=16), [T(0x3000, (10, 40, 1, 1)), T(0x4000, (10,), f32)], Context("off"),
    ),
    "fc nobias f32": lambda: K["fc"].prepare_inputs(
        KernelCall("fc", ("x",), ("y",), ("w",)), [T(0x1000, (2, 1, 1, 8), f32)], T(0x2000, (2, 1, 1, 3), f32),
        [T(0x3000, (3, 8, 1, 1), f32)], Context("off"),
    ),
    "eltwise unary": lambda: K["eltwise"].prepare(
        KernelCall("eltwise", ("a",), ("y",), (), (("op", ELTWISE_OPS["unary"]), *HSIG)),
        T(0x1000, (2, 5, 6, 16), ld=32), T(0x2000, (2, 5, 6, 16)), [], Context("off"),
    ),
    "eltwise add": lambda: K["eltwise"].prepare_inputs(
        KernelCall("eltwise", ("a", "b"), ("y",), (), (("op", ELTWISE_OPS["add"]), ("act", PLAN_ACTS["relu"]))),
        [T(0x1000, (2, 5, 6, 16), f32), T(0x1800, (2, 5, 6, 16), f32, ld=20)], T(0x2000, (2, 5, 6, 16), f32, ld=24),
        [], Context("off"),
    ),
    "eltwise mul bcast": lambda: K["eltwise"].prepare_inputs(
        KernelCall("eltwise", ("a", "b"), ("y",), (), (("op", ELTWISE_OPS["mul"]),)),
        [T(0x1000, (2, 5, 6, 16)), T(0x1800, (2, 1, 1, 16))], T(0x2000, (2, 5, 6, 16)), [], Context("off"),
    ),
    "resize linear": lambda: K["resize"].prepare(
        KernelCall("resize", ("x",), ("y",), (), LINEAR), T(0x1000, (1, 5, 6, 12), ld=20),
        T(0x2000, (1, 10, 15, 12), ld=16), [], Context("off"),
    ),
    "resize nearest f32": lambda: K["resize"].prepare_inputs(
        KernelCall("resize", ("x",), ("y",), (), NEAREST), [T(0x1000, (2, 8, 8, 3), f32)], T(0x2000, (2, 4, 6, 3), f32),
        [], Context("off"),
    ),
    # Two outputs (probabilities NCHW, uint8 mask): prepared with prepare_outputs, as the runtime does.
    "seghead softmax f16": lambda: K["seghead"].prepare_outputs(
        KernelCall("seghead", ("x",), ("p", "m"), (), HeadMode("softmax", round_probs=True, round_arg=True).attrs()),
        [T(0x1000, (2, 5, 6, 3), ld=8)], [T(0x2000, (2, 3, 5, 6), f32), T(0x3000, (2, 5, 6), u8)], [], Context("off"),
    ),
    "seghead threshold f32": lambda: K["seghead"].prepare_outputs(
        KernelCall("seghead", ("x",), ("p", "m"), (), HeadMode("sigmoid", threshold=0.5).attrs()),
        [T(0x1000, (1, 4, 4, 1), f32)], [T(0x2000, (1, 1, 4, 4), f32), T(0x3000, (1, 4, 4), u8)], [], Context("off"),
    ),
}  # fmt: skip


# Written out from the specs before the refactor (main at d88e21e): entry, grid, block, shared bytes,
# argument values and kinds.
EXPECTED: dict[str, tuple[Any, ...]] = {
    "conv3x3 f16 portable": (
        "conv3x3_nhwc_f16_small",
        (8, 1, 1),
        (128, 1, 1),
        0,
        [4096, 12288, 16384, 8192, 2, 16, 16, 32, 64, 48, 96, 1],
        "PPPPIIIIIIII",
    ),
    "conv3x3 f32": (
        "conv3x3_nhwc_f32",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 12288, 0, 8192, 1, 8, 8, 16, 24, 16, 24, 1],
        "PPPPIIIIIIII",
    ),
    "conv3x3 f16 hopper": (
        "conv3x3_wgmma_bn64_mt1_wg2_bk64_h16",
        (128, 1, 1),
        (288, 1, 1),
        91136,
        [
            (4096, (64, 64, 64, 2), (64, 16, 10, 1)),
            (12288, (576, 128), (64, 64)),
            16384,
            0,  # no residual (added with the general conv's Hopper path)
            8192,
            2,
            64,
            64,
            64,
            128,
            192,
            0,
            1,
            0.0,  # p0, p1: ReLU has no parameters
            0.0,
            4,
            1,  # dil: a plain 3x3
            0,
            0,
        ],
        "MMPPPIIIIIIIIFFIIPP",
    ),
    # Added with the general conv's Hopper path: ResNet's conv2 + residual + ReLU on the wgmma kernel.
    "conv residual hopper": (
        "conv3x3_wgmma_bn64_mt1_wg1_bk64",
        (16, 1, 1),  # 2 images x 4 tiles of 8x8 pixels x 2 of 64 channels
        (160, 1, 1),
        66560,  # 4 stages of (64 + 64) rows of 128 bytes, + 1024 for the alignment
        [
            (4096, (64, 16, 16, 2), (64, 16, 4, 1)),
            (16384, (576, 128), (64, 64)),
            20480,
            8192,
            12288,
            2,
            16,
            16,
            64,
            128,
            128,
            136,
            1,
            0.0,  # p0, p1: ReLU has no parameters
            0.0,
            4,
            1,  # dil: a plain 3x3
            0,
            0,
        ],
        "MMPPPIIIIIIIIFFIIPP",
    ),
    "maxpool2x2": ("maxpool2x2_nhwc_f16", (1, 1, 1), (256, 1, 1), 0, [4096, 8192, 2, 9, 8, 40, 72, 48], "PPIIIIII"),
    "conv dilated hopper": (
        "conv3x3_wgmma_bn64_mt1_wg1_bk64",  # a per-tap tile: the column copies hold the rows of dilation 1
        (40, 1, 1),  # 2 images x 10 tiles of 2 rows x 32 columns x 2 of 64 channels
        (160, 1, 1),
        66560,
        [
            (4096, (64, 24, 20, 2), (64, 32, 2, 1)),
            (16384, (576, 128), (64, 64)),
            20480,
            0,
            12288,
            2,
            20,
            24,
            64,
            128,
            128,
            0,
            1,
            0.0,  # p0, p1: ReLU has no parameters
            0.0,
            5,
            2,  # dil: the taps at (r-1)*2, (s-1)*2
            0,
            0,
        ],
        "MMPPPIIIIIIIIFFIIPP",
    ),
    "maxpool": (
        "maxpool_nhwc_f16",
        (1, 1, 1),  # 2*5*4 pixels x 5 chunks of 8 channels
        (256, 1, 1),
        0,
        [4096, 8192, 2, 9, 8, 40, 5, 4, 72, 48, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 0, 1],  # pad_b, pad_r, mode: max, lanes
        "PPIIIIIIIIIIIIIIIIIIII",
    ),
    "maxpool ceil f32": (
        "maxpool_nhwc_f32",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 8192, 1, 11, 10, 5, 5, 4, 5, 5, 3, 2, 2, 3, 2, 1, 0, 0, 1, 0, 0, 1],
        "PPIIIIIIIIIIIIIIIIIIII",
    ),
    "convt2x2": (
        "convt2x2_nhwc_f32",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 12288, 16384, 8192, 1, 4, 4, 16, 8, 16, 24],
        "PPPPIIIIIII",
    ),
    "conv1x1": (
        "conv1x1_nhwc_f16",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 12288, 16384, 8192, 1, 5, 7, 32, 3, 64, 3, 1],
        "PPPPIIIIIIII",
    ),
    "conv residual": (
        "conv_nhwc_f16_small",
        (1, 1, 1),
        (128, 1, 1),
        0,
        [
            4096,
            16384,
            20480,
            8192,
            12288,
            0,
            2,
            9,
            10,
            24,
            48,
            5,
            5,
            3,
            3,
            2,
            2,
            1,
            1,
            1,
            1,
            40,
            64,
            96,
            6,
            0.0,
            0.0,
            1,
        ],
        "PPPPPPIIIIIIIIIIIIIIIIIIIFFI",
    ),
    # ResNet-34's last stage at N=1: 32 tiles of 64x64, so the reduction (72 k-blocks) splits four ways
    # (grid.y); ws: the context's workspace of 32 * 4 * 64 * 64 floats and 32 counters.
    "conv residual hopper split-k": (
        "conv3x3_wgmma_bn64_mt1_wg1_bk64",
        (32, 4, 1),
        (160, 1, 1),
        66560,
        [
            (4096, (512, 16, 16, 1), (64, 16, 4, 1)),
            (16384, (4608, 512), (64, 64)),
            20480,
            8192,
            12288,
            1,
            16,
            16,
            512,
            512,
            512,
            512,
            1,
            0.0,  # p0, p1: ReLU has no parameters
            0.0,
            4,
            1,  # dil
            0x9000,
            0,
        ],
        "MMPPPIIIIIIIIFFIIPP",
    ),
    "conv f32 plain": (
        "conv_nhwc_f32",
        (3, 1, 1),
        (256, 1, 1),
        0,
        [4096, 16384, 0, 0, 12288, 0, 1, 12, 11, 5, 7, 12, 11, 5, 3, 1, 1, 4, 1, 2, 1, 5, 9, 7, 2, 0.0, 6.0, 1],
        "PPPPPPIIIIIIIIIIIIIIIIIIIFFI",
    ),
    "conv grouped": (
        "conv_nhwc_f16_direct",  # 4 -> 4 channels a group: the direct entry, one grid layer a group
        (2, 1, 32),
        (256, 1, 1),
        0,
        [
            4096,
            16384,
            20480,
            0,
            12288,
            0,
            2,
            16,
            16,
            4,
            4,
            16,
            16,
            3,
            3,
            1,
            1,
            1,
            1,
            1,
            1,
            128,
            128,
            128,
            0,
            0.0,
            0.0,
            1,
        ],
        "PPPPPPIIIIIIIIIIIIIIIIIIIFFI",
    ),
    "convt": (
        "convt_nhwc_f16",
        (4, 1, 1),  # 2*10*12 pixels x 2 groups x 2 blocks of 8 channels, 256 a block
        (256, 1, 1),
        0,
        [4096, 16384, 20480, 8192, 12288, 2, 5, 6, 8, 16, 2, 10, 12, 3, 3, 2, 2, 1, 1, 1, 1, 24, 48, 40, 1, 0.0, 0.0],
        "PPPPPIIIIIIIIIIIIIIIIIIIIFF",
    ),
    "convt f32 plain": (
        "convt_nhwc_f32",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 16384, 0, 0, 12288, 1, 4, 5, 3, 7, 1, 12, 10, 4, 5, 3, 2, 1, 2, 1, 1, 3, 7, 7, 0, 0.0, 0.0],
        "PPPPPIIIIIIIIIIIIIIIIIIIIFF",
    ),
    "dwconv": (
        "dwconv_nhwc_f16",
        (2, 1, 1),  # fp16, C and the strides multiples of 8: a thread per 8 channels
        (256, 1, 1),
        0,
        [4096, 12288, 16384, 8192, 2, 13, 14, 24, 7, 7, 40, 56, 5, 5, 2, 2, 1, 1, 2, 1, 1, 4, 0.0, 0.0],
        "PPPPIIIIIIIIIIIIIIIIIIFF",
    ),
    "dwconv tile": (
        "dwconv_nhwc_f16_tile_short",  # 24 tall tiles are far from filling the GPU
        (12, 3, 1),  # 2 images x 3 x 2 tiles of 8x16 outputs, 3 blocks of 32 channels
        (128, 1, 1),
        39424,  # the (8 + 6) x (16 + 6) pixel patch, 32 fp32 channels a pixel
        [4096, 12288, 16384, 8192, 2, 20, 30, 96, 20, 30, 96, 104, 7, 7, 1, 1, 1, 1, 3, 3, 1, 1, 0.0, 0.0],
        "PPPPIIIIIIIIIIIIIIIIIIFF",
    ),
    "dwconv cols": (
        "dwconv_nhwc_f16_cols_short",  # 12 tall blocks are far from filling the GPU
        (40, 1, 1),  # 2 images x 10 row pairs x 2 strips of 21 columns, one block of the 12 vectors
        (12, 21, 1),
        0,
        [4096, 12288, 16384, 8192, 2, 20, 30, 96, 20, 30, 96, 104, 3, 3, 1, 1, 1, 1, 1, 1, 1, 13, 0.0, 0.0],
        "PPPPIIIIIIIIIIIIIIIIIIFF",
    ),
    "dwconv tile misaligned": (
        "dwconv_nhwc_f16",
        (15, 1, 1),  # the row path: 2*20*ceil(30/4) items x 12 vectors of 8 channels, 256 a block
        (256, 1, 1),
        0,
        [4104, 12288, 16384, 8192, 2, 20, 30, 96, 20, 30, 96, 104, 7, 7, 1, 1, 1, 1, 3, 3, 1, 1, 0.0, 0.0],
        "PPPPIIIIIIIIIIIIIIIIIIFF",
    ),
    "dwconv nobias f32": (
        "dwconv_nhwc_f32",
        (2, 1, 1),
        (256, 1, 1),
        0,
        [4096, 12288, 0, 8192, 1, 6, 7, 8, 6, 7, 8, 8, 3, 3, 1, 1, 2, 2, 2, 2, 1, 0, 0.0, 0.0],
        "PPPPIIIIIIIIIIIIIIIIIIFF",
    ),
    "gap": ("gap_nhwc_f16", (3, 3, 1), (1024, 1, 1), 0, [4096, 8192, 3, 7, 9, 72, 80, 96, 1], "PPIIIIIII"),
    "gap l2": ("gap_nhwc_f16", (3, 3, 1), (1024, 1, 1), 0, [4096, 8192, 3, 7, 9, 72, 80, 96, 5], "PPIIIIIII"),
    "creduce max": ("creduce_nhwc_f16", (1, 1, 1), (256, 1, 1), 0, [4096, 8192, 2, 5, 7, 24, 40, 2, 2], "PPIIIIIII"),
    "fc": (
        "fc_nhwc_f16",
        (5, 1, 1),
        (256, 1, 1),
        0,
        [4096, 12288, 16384, 8192, 4, 40, 10, 48, 16, 2, 0.5, 6.25],
        "PPPPIIIIIIFF",
    ),
    "fc nobias f32": (
        "fc_nhwc_f32",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 12288, 0, 8192, 2, 8, 3, 8, 3, 0, 0.0, 0.0],
        "PPPPIIIIIIFF",
    ),
    "eltwise unary": (
        "eltwise_nhwc_f16",
        (1, 1, 1),  # the fp16 vector path: 2*5*6*16/8 threads
        (256, 1, 1),
        0,
        [4096, 0, 8192, 2, 5, 6, 16, 32, 16, 16, 0, 0, 3, 0.20000000298023224, 0.5],
        "PPPIIIIIIIIIIFF",
    ),
    "eltwise add": (
        "eltwise_nhwc_f32",
        (4, 1, 1),
        (256, 1, 1),
        0,
        [4096, 6144, 8192, 2, 5, 6, 16, 16, 20, 24, 1, 0, 1, 0.0, 0.0],
        "PPPIIIIIIIIIIFF",
    ),
    "eltwise mul bcast": (
        "eltwise_nhwc_f16",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 6144, 8192, 2, 5, 6, 16, 16, 16, 16, 2, 1, 0, 0.0, 0.0],
        "PPPIIIIIIIIIIFF",
    ),
    "resize linear": (
        "resize_nhwc_f16",
        (1, 10, 1),  # one strip of the 15 columns (C 12: 3 items of 4 channels a pixel) by the 10 output rows
        (256, 1, 1),
        0,
        [4096, 8192, 1, 5, 6, 12, 10, 15, 20, 16, 1, 0, 0, 2.0, 2.5],
        "PPIIIIIIIIIIIFF",
    ),
    "resize nearest f32": (
        "resize_nhwc_f32",
        (1, 8, 1),  # one strip by the 2 x 4 output rows
        (256, 1, 1),
        0,
        [4096, 8192, 2, 8, 8, 3, 4, 6, 3, 3, 0, 3, 3, 0.5, 0.75],
        "PPIIIIIIIIIIIFF",
    ),
    # Added with the kernel (not in d88e21e): entry, one thread a pixel, x probs mask N H W C ldx act flags thr.
    "seghead softmax f16": (
        "seghead_nhwc_f16",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 8192, 12288, 2, 5, 6, 3, 8, 1, 6, 0.0],
        "PPPIIIIIIIF",
    ),
    "seghead threshold f32": (
        "seghead_nhwc_f32",
        (1, 1, 1),
        (256, 1, 1),
        0,
        [4096, 8192, 12288, 1, 4, 4, 1, 1, 2, 16, 0.5],
        "PPPIIIIIIIF",
    ),
    # one struct ResizeJobs by value: the jobs' table (src, dst, w, h, pitch, orientation), then out_w, out_h
    "resize_rgb": (
        "resize_rgb_u8",
        (20, 16, 2),
        (16, 16, 1),
        0,
        [[(4096, 8192, 640, 480, 1920, 6), (12288, 16384, 480, 640, 1440, 1)], (320, 256)],
        "S",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_registered_op_prepares_the_argument_list_the_ptx_takes(case: str) -> None:
    assert prepared(CASES[case]()) == EXPECTED[case]


def test_the_jpeg_resize_takes_the_argument_list_its_ptx_takes() -> None:
    jobs = [ResizeJob(0x1000, 0x2000, 640, 480, 1920, 6), ResizeJob(0x3000, 0x4000, 480, 640, 1440)]
    [(table, ctype)] = RESIZE_RGB.args(jobs=jobs, out_w=320, out_h=256)
    assert ctype is None and isinstance(table, ctypes.Structure)  # the PTX's one .param .b8[2056]
    rows = [(j.src, j.dst, j.src_w, j.src_h, j.src_pitch, j.orientation) for j in table.job[: len(jobs)]]
    config = RESIZE_RGB.launch(320, 256, len(jobs))
    got = (RESIZE_RGB.stem, config.grid, config.block, config.shared_bytes, [rows, (table.out_w, table.out_h)], "S")
    assert got == EXPECTED["resize_rgb"]


def ptx_param_kinds(stem: str, entry: str) -> str:
    """The kinds of an entry's parameters as the checked-in compute_90a PTX of ``stem`` declares them."""
    text = (Path(__file__).resolve().parents[1] / "handwritten_ptx" / "ptx" / "compute_90a" / f"{stem}.ptx").read_text()
    head = text[text.index(f".entry {entry}(") :]
    params = head[: head.index(")")]
    return "".join({".u64": "P", ".u32": "I", ".f32": "F"}[t] for t in re.findall(r"\.param (\.\w+)", params))


def test_a_norm_prepares_every_launch_with_the_argument_list_its_ptx_takes() -> None:
    """A group norm is two launches (statistics into the call's workspace, finalized by their last block
    of each image, then the apply pass); each one's arguments match its entry's parameters in the PTX,
    and the apply pass reads the statistics the first wrote."""
    attrs = (("kind", NORM_KINDS["group"]), ("groups", 4), ("res", NORM_RES["after_act"]), ("eps", f32_bits(1e-5)))
    call = KernelCall("norm", ("x", "r"), ("y",), ("g", "b"), (*attrs, ("act", PLAN_ACTS["silu"])))
    x, r, y = T(0x1000, (2, 9, 7, 32), ld=40), T(0x2000, (2, 9, 7, 32)), T(0x3000, (2, 9, 7, 32), ld=48)
    p = K["norm"].prepare_inputs(call, [x, r], y, [T(0x4000, (32,), f32), T(0x5000, (32,), f32)], Context("off"))
    launches = [*p.before, p]
    assert [q.entry for q in launches] == ["norm_nhwc_stats_f16", "norm_nhwc_f16"]
    for q in launches:
        assert plain(q.entry, q.config, q.args)[5] == ptx_param_kinds("norm_nhwc", q.entry), q.entry
    apply = dict(zip(K["norm"].PARAMS, [v for v, _ in p.args], strict=True))
    assert (apply["x"], apply["r"], apply["y"], apply["gamma"], apply["beta"]) == (
        0x1000,
        0x2000,
        0x3000,
        0x4000,
        0x5000,
    )
    assert (apply["N"], apply["H"], apply["W"], apply["C"], apply["ldx"], apply["ldr"], apply["ldy"]) == (
        2,
        9,
        7,
        32,
        40,
        32,
        48,
    )
    assert apply["G"] == 4 and apply["res"] == NORM_RES["after_act"] and apply["mean"] > 0x9000
    stats = dict(zip(STATS_PARAMS, [v for v, _ in p.before[0].args], strict=True))
    assert (stats["x"], stats["mean"], stats["var"]) == (0x1000, apply["mean"], apply["var"])
    layer = K["norm"].prepare_inputs(
        KernelCall("norm", ("x",), ("y",), ("g", "b"), (("kind", NORM_KINDS["layer"]), ("eps", f32_bits(1e-6)))),
        [T(0x1000, (1, 5, 6, 96), f32)], T(0x3000, (1, 5, 6, 96), f32), [T(0x4000, (96,), f32)] * 2, Context("off"),
    )  # fmt: skip
    assert not layer.before and plain(layer.entry, layer.config, layer.args)[5] == ptx_param_kinds(
        "norm_nhwc", layer.entry
    )


def test_a_split_k_conv_prepares_both_launches_with_the_argument_lists_their_ptx_takes() -> None:
    """PAN's 7x7 512 -> 1 on 8x8 pixels: the tile entry's slices into the call's workspace, then
    conv_nhwc_f16_splitk's sum and epilogue; each launch's arguments match its entry in the PTX."""
    pan = ConvGeometry(7, 7, pad_top=3, pad_left=3, pad_bottom=3, pad_right=3)
    call = KernelCall("conv", ("x", "r"), ("y",), ("w", "b"), (*pan.attrs(), ("act", PLAN_ACTS["relu"]), RES))
    ctx = Context("off")
    p = K["conv"].prepare_inputs(
        call, [T(0x1000, (1, 8, 8, 512)), T(0x2000, (1, 8, 8, 4))], T(0x3000, (1, 8, 8, 4), ld=8),
        [T(0x4000, (4, 7, 7, 512)), T(0x5000, (4,), f32)], ctx,
    )  # fmt: skip
    launches = [*p.before, p]
    assert [q.entry for q in launches] == ["conv_nhwc_f16_narrow", "conv_nhwc_f16_splitk"]
    for q in launches:
        assert plain(q.entry, q.config, q.args)[5] == ptx_param_kinds("conv_nhwc", q.entry), q.entry
    assert p.before[0].args[5][0] == p.args[0][0] == 0x9000 and ctx.workspace_bytes == 61 * 64 * 4 * 4


def test_a_pad_prepares_the_argument_list_its_ptx_takes() -> None:
    from dualtrack.kernels import PadMode

    call = KernelCall("pad", ("x",), ("y",), (), PadMode("reflect", pt=2, pl=0, pb=1, pr=3).attrs())
    p = K["pad"].prepare_inputs(call, [T(0x1000, (2, 7, 5, 16), ld=24)], T(0x3000, (2, 10, 8, 16)), [], Context("off"))
    assert plain(p.entry, p.config, p.args)[5] == ptx_param_kinds("pad_nhwc", p.entry)
    values = [v for v, _ in p.args]
    assert values[:2] == [0x1000, 0x3000] and {2, 7, 5, 16, 24} <= set(values)


def test_a_depth_to_space_prepares_the_argument_list_its_ptx_takes() -> None:
    from dualtrack.kernels import DepthToSpace

    call = KernelCall("depth_to_space", ("x",), ("y",), (), DepthToSpace(3, "CRD").attrs())
    p = K["depth_to_space"].prepare_inputs(
        call, [T(0x1000, (2, 7, 5, 18), ld=24)], T(0x3000, (2, 21, 15, 2), ld=8), [], Context("off")
    )
    assert plain(p.entry, p.config, p.args)[5] == ptx_param_kinds("depth_to_space_nhwc", p.entry)
    assert [v for v, _ in p.args] == [0x1000, 0x3000, 2, 7, 5, 2, 24, 8, 3, 1]


def test_an_attention_prepares_the_argument_list_its_ptx_takes() -> None:
    from dualtrack.kernels.attention import AttentionGeometry, OperandView

    heads, d, lq, lk = 3, 32, 70, 20  # token tensors (N, L, heads*d), no bias
    c = heads * d
    views = (
        OperandView(0, lq * c, d, c, 1), OperandView(0, lk * c, d, c, 1),
        OperandView(0, lk * c, d, c, 1), OperandView(0, lq * c, d, c, 1),
    )  # fmt: skip
    geom = AttentionGeometry(heads, d, lq, lk, d**-0.5, views, (lq, c))
    call = KernelCall("attention", ("q", "k", "v"), ("o",), (), geom.attrs())
    ins = [T(0x1000, (2, lq, c)), T(0x3000, (2, lk, c)), T(0x5000, (2, lk, c))]
    p = K["attention"].prepare_inputs(call, ins, T(0x7000, (2, lq, c)), [], Context("off"))
    assert p.entry == "attention_f16_d32"
    assert plain(p.entry, p.config, p.args)[5] == ptx_param_kinds("attention", p.entry)
    assert [v for v, _ in p.args][:5] == [0x1000, 0x3000, 0x5000, 0, 0x7000]


def test_the_cases_cover_every_registered_spec() -> None:
    covered = {case.split()[0] for case in EXPECTED} | {"norm", "pad", "depth_to_space", "attention"}  # tests above
    covered |= {"quantize_fp8", "conv_fp8"}  # tests/test_fp8_kernels.py, against the PTX's parameter lists
    assert covered == {*KERNELS, RESIZE_RGB.op}
    assert any(entry.startswith("conv3x3_wgmma") for entry, *_ in EXPECTED.values())  # the Hopper spec too
