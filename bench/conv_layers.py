#!/usr/bin/env python3
"""Per-layer time of the general conv (op ``conv``, handwritten_ptx/conv_nhwc.cu) against torch's
cuDNN convolution, on the distinct convolution shapes of smp ``Unet("resnet34")`` at 512x512.

    python bench/conv_layers.py OUT.json [--batches 1 8] [--iters 50] [--only stem] [--net unet] [--fp8]
    python bench/conv_layers.py OUT.json --net split [--splits 1 4 16 61]

Needs a CUDA GPU, torch with CUDA (random data, the fp32 reference, cuDNN) and dualtrack on the
path (the kernel is the checked-in PTX for the device's arch, JIT-compiled by the driver, launched
through dualtrack's driver layer on torch's stream; torch and dualtrack share the primary context).

Each layer runs as the partition lowers it: bias, the residual (ResNet's ``Add``) and ReLU fused
where the network has them. Two of our timings per layer: ``ours_ms``, the general conv's mma.sync
entry (``variant()``), and ``engine_ms``, the kernel the engine launches for the layer's op on this
device (``KernelSpec.prepare_inputs`` with tensor maps and split-K workspace: on sm_90a the wgmma
kernel for every 3x3 stride-1 layer, residual ones included; ``engine_entry`` names it). Before it
is timed, each kernel's output (NaN-poisoned first) is checked against torch's fp32 convolution of
the same fp16 data (rel L2 <= 2e-3). Times are the median of ``--iters`` launches between CUDA
events after 5 warm-ups; cuDNN is ``F.conv2d`` on channels_last fp16 tensors with
``cudnn.benchmark`` on, conv + bias only (its residual add and ReLU would be further kernels in
eager torch). ``op`` says which Track A op the partition gives the layer. Prints a table and writes
the rows and per-batch totals (weighted by how often each shape occurs) as JSON.

``--only stem --variants``: the stems of the corpus (ResNet's 7x7/2 on RGB, MONAI's 3x3/2 C=3 -> 16, and
their 8-channel twins) on every fp16 entry that takes them, so one run shows the stem entries
(``_stem``, ``_stem_narrow``: the patch in shared memory) beside the ``_gather`` entry they replace.

``--net fcn``: torchvision FCN-ResNet50's 1x1 and dilated 3x3 layers; ``--net resnext``: smp
Unet-resnext50's grouped 3x3s, ``ours_ms`` their ONNX groups as they are and ``engine_ms`` as the
partition lowers them (narrow groups merged, ``engine_merge``); ``--net segformer_b2``: smp
Segformer mit_b2's Linears as 1x1 convs, its spatial-reduction and patch-embedding convs and its head's
1x1s (small GEMMs at N=1, where its 1.33x against torch.compile is). ``--wgmma-variants`` (sm_90a): every
wgmma configuration of the layer's window forced on it, checked and timed (``wgmma_ms``), to fit
the chooser. ``--net unet``: the reference U-Net's 3x3 layers (models/, 512x512) instead of ResNet-34's.
``--net split``:
convolutions whose output tiles cannot fill the GPU while their reduction is deep, the ones split-K
is for (PAN-resnet34's FPA 7x7 512 -> 1 on 8x8 pixels, and shapes no zoo model has): ``ours_ms`` is
then the unsplit tile entry and ``engine_ms`` what the engine runs (the split, ``engine_reason``
says how many slices; on sm_90a the wgmma kernel where it takes the layer). ``--splits S ...``: also
the layer's mma.sync entry forced to each split count S (1: unsplit through the same preparation),
``splits_ms``, both launches timed together (the slices, then ``conv_nhwc_f16_splitk``). ``--fp8``
(sm_90a): beside the engine's fp16 kernel, the layer in FP8 as a ``precision: fp8`` plan runs it
(issue 42): ``quantize_fp8`` of the input (per-tensor scale from its amax) then ``conv_fp8`` (the
wgmma family's e4m3 rows, per-output-channel weight scales): ``fp8_ms`` (both launches),
``fp8_conv_ms`` (the convolution alone), ``fp8_speedup`` (``engine_ms / fp8_ms``) and ``fp8_rel_l2``
against the fp32 convolution (printed, not a pass/fail: what e4m3 costs in accuracy before calibration).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dualtrack.compiler.kernel_build import SOURCE_DIR, ptx_path
from dualtrack.contract.arch import PTX_ARCHES, choose_image
from dualtrack.contract.plan import KernelCall, f32_bits
from dualtrack.errors import InputError
from dualtrack.kernels import KERNELS, Activation, ConvChoice, ConvGeometry, DeviceInfo, pack_conv_weights
from dualtrack.kernels.conv import block_diagonal
from dualtrack.runtime import tma
from dualtrack.runtime.driver import Device, Module, Stream
from dualtrack.runtime.tensors import GpuTensor

SPEC = KERNELS["conv"]
QUANT, FP8 = KERNELS["quantize_fp8"], KERNELS["conv_fp8"]
TOL = 2e-3  # fp16 output rounding and a different summation order


@dataclass(frozen=True)
class Layer:
    name: str
    op: str  # what the partition lowers it to
    uses: int  # how often the shape occurs in the network
    H: int
    W: int
    C: int
    K: int
    R: int
    stride: int
    residual: bool
    relu: bool
    groups: int = 1
    dil: int = 1
    pad: int | None = None  # None: "same" padding, dil * (R // 2)

    @property
    def geom(self) -> ConvGeometry:
        p = self.dil * (self.R // 2) if self.pad is None else self.pad
        return ConvGeometry(
            self.R,
            self.R,
            self.stride,
            self.stride,
            self.dil,
            self.dil,
            pad_top=p,
            pad_left=p,
            pad_bottom=p,
            pad_right=p,
            groups=self.groups,
        )

    @property
    def engine_geom(self) -> ConvGeometry:
        """The geometry the partition lowers (fp16): narrow groups merged (ConvGeneralSpec.merged)."""
        return SPEC.merged("float16", self.C, self.K, self.geom) if self.op == "conv" else self.geom


LAYERS = (
    Layer("stem 7x7/2", "conv", 1, 512, 512, 3, 64, 7, 2, False, True),
    Layer("l1 conv1", "conv3x3", 3, 128, 128, 64, 64, 3, 1, False, True),
    Layer("l1 conv2+res", "conv", 3, 128, 128, 64, 64, 3, 1, True, True),
    Layer("l2.0 conv1 /2", "conv", 1, 128, 128, 64, 128, 3, 2, False, True),
    Layer("l2.0 down 1x1/2", "conv", 1, 128, 128, 64, 128, 1, 2, False, False),
    Layer("l2 conv1", "conv3x3", 3, 64, 64, 128, 128, 3, 1, False, True),
    Layer("l2 conv2+res", "conv", 4, 64, 64, 128, 128, 3, 1, True, True),
    Layer("l3.0 conv1 /2", "conv", 1, 64, 64, 128, 256, 3, 2, False, True),
    Layer("l3.0 down 1x1/2", "conv", 1, 64, 64, 128, 256, 1, 2, False, False),
    Layer("l3 conv1", "conv3x3", 5, 32, 32, 256, 256, 3, 1, False, True),
    Layer("l3 conv2+res", "conv", 6, 32, 32, 256, 256, 3, 1, True, True),
    Layer("l4.0 conv1 /2", "conv", 1, 32, 32, 256, 512, 3, 2, False, True),
    Layer("l4.0 down 1x1/2", "conv", 1, 32, 32, 256, 512, 1, 2, False, False),
    Layer("l4 conv1", "conv3x3", 2, 16, 16, 512, 512, 3, 1, False, True),
    Layer("l4 conv2+res", "conv", 3, 16, 16, 512, 512, 3, 1, True, True),
    Layer("dec0 conv1", "conv3x3", 1, 32, 32, 768, 256, 3, 1, False, True),
    Layer("dec0 conv2", "conv3x3", 1, 32, 32, 256, 256, 3, 1, False, True),
    Layer("dec1 conv1", "conv3x3", 1, 64, 64, 384, 128, 3, 1, False, True),
    Layer("dec1 conv2", "conv3x3", 1, 64, 64, 128, 128, 3, 1, False, True),
    Layer("dec2 conv1", "conv3x3", 1, 128, 128, 192, 64, 3, 1, False, True),
    Layer("dec2 conv2", "conv3x3", 1, 128, 128, 64, 64, 3, 1, False, True),
    Layer("dec3 conv1", "conv3x3", 1, 256, 256, 128, 32, 3, 1, False, True),
    Layer("dec3 conv2", "conv3x3", 1, 256, 256, 32, 32, 3, 1, False, True),
    Layer("dec4 conv1", "conv3x3", 1, 512, 512, 32, 16, 3, 1, False, True),
    Layer("dec4 conv2", "conv3x3", 1, 512, 512, 16, 16, 3, 1, False, True),
    Layer("head", "conv", 1, 512, 512, 16, 2, 3, 1, False, False),  # the direct entry (partition.DIRECT_MIN_PIXELS)
    # The stems with the image widened to 8 channels (zeros; a front-end stage in 098e45a, reverted: its
    # Pad and transposes on Track B cost more than the stem gained), beside the 3-channel ones: the vector
    # entries against the gather entry. uses 0: not in the network's totals.
    Layer("stem 7x7/2 c8", "conv", 0, 512, 512, 8, 64, 7, 2, False, True),
    Layer("stem 3x3/2 k16", "conv", 0, 512, 512, 3, 16, 3, 2, False, False),  # MONAI UNet's first unit
    Layer("stem 3x3/2 k16 c8", "conv", 0, 512, 512, 8, 16, 3, 2, False, False),
    Layer("stem 3x3/2 k32 c1", "conv", 0, 512, 512, 1, 32, 3, 2, False, True),  # a grayscale first layer
)

# The reference U-Net's 3x3 layers (tests/test_wgmma.py's UNET_LAYERS) at a 512x512 input, conv + ReLU
# (the first layer, C = 3, left out: conv_fp8 needs C % 16 == 0); uses: an encoder's and its decoder's twin.
UNET_LAYERS = tuple(
    Layer(name, "conv3x3", 2 if "/" in name else 1, hw, hw, c, k, 3, 1, False, True)
    for name, c, k, hw in (
        ("enc1b/dec1b", 32, 32, 512), ("enc2a", 32, 64, 256), ("enc2b/dec2b", 64, 64, 256),
        ("enc3a", 64, 128, 128), ("enc3b/dec3b", 128, 128, 128), ("enc4a", 128, 256, 64),
        ("enc4b/dec4b", 256, 256, 64), ("bott_a", 256, 512, 32), ("bott_b", 512, 512, 32),
        ("dec4a", 512, 256, 64), ("dec3a", 256, 128, 128), ("dec2a", 128, 64, 256), ("dec1a", 64, 32, 512),
    )
)  # fmt: skip


# Split-K's layers (--net split): few output tiles, deep reductions. uses: PAN's FPA 7x7 once a network.
SPLIT_LAYERS = (
    Layer("pan fpa 7x7 512->1", "conv", 1, 8, 8, 512, 1, 7, 1, False, True),
    Layer("5x5/2 96->3 +res", "conv", 0, 5, 7, 96, 3, 5, 2, True, True),
    Layer("3x3 g2 1000->40", "conv", 0, 4, 4, 1000, 40, 3, 1, False, True, 2),
    Layer("1x1 2048->16", "conv", 0, 2, 2, 2048, 16, 1, 1, False, True),
    Layer("l4.0 conv1 /2", "conv", 0, 32, 32, 256, 512, 3, 2, False, True),  # ResNet-34's, at few tiles
    Layer("3x3 512->64 on 8x8", "conv", 0, 8, 8, 512, 64, 3, 1, False, True),
    # K <= 8 with filters that fit the direct entry: it runs unsplit (a thread a pixel, 64 of them);
    # --splits times the narrow tile split beside it, --variants every entry.
    Layer("3x3 512->1 on 8x8", "conv", 0, 8, 8, 512, 1, 3, 1, False, True),
)
# torchvision FCN-ResNet50 (--net fcn) at 512x512: its distinct 1x1 layers (the bottlenecks' reduce and
# expand, the expand with the residual Add and ReLU fused; the wgmma kernel's _1x1 entries on sm_90a) and
# its dilated 3x3s (layers 3 and 4 keep 64x64 with dilation 2 and 4). uses: how often each shape occurs.
FCN_LAYERS = (
    Layer("l1.0 reduce 64", "conv", 1, 128, 128, 64, 64, 1, 1, False, True),
    Layer("l1 reduce 256", "conv", 2, 128, 128, 256, 64, 1, 1, False, True),
    Layer("l1 expand+res", "conv", 3, 128, 128, 64, 256, 1, 1, True, True),
    Layer("l1.0 down", "conv", 1, 128, 128, 64, 256, 1, 1, False, False),
    Layer("l2.0 reduce", "conv", 1, 128, 128, 256, 128, 1, 1, False, True),
    Layer("l2 reduce", "conv", 3, 64, 64, 512, 128, 1, 1, False, True),
    Layer("l2 expand+res", "conv", 4, 64, 64, 128, 512, 1, 1, True, True),
    Layer("l3.0 reduce", "conv", 1, 64, 64, 512, 256, 1, 1, False, True),
    Layer("l3 reduce", "conv", 5, 64, 64, 1024, 256, 1, 1, False, True),
    Layer("l3 expand+res", "conv", 6, 64, 64, 256, 1024, 1, 1, True, True),
    Layer("l3.0 down", "conv", 1, 64, 64, 512, 1024, 1, 1, False, False),
    Layer("l4.0 reduce", "conv", 1, 64, 64, 1024, 512, 1, 1, False, True),
    Layer("l4 reduce", "conv", 2, 64, 64, 2048, 512, 1, 1, False, True),
    Layer("l4 expand+res", "conv", 3, 64, 64, 512, 2048, 1, 1, True, True),
    Layer("l4.0 down", "conv", 1, 64, 64, 1024, 2048, 1, 1, False, False),
    Layer("l3 3x3 d2", "conv", 6, 64, 64, 256, 256, 3, 1, False, True, dil=2),
    Layer("l4 3x3 d4", "conv", 3, 64, 64, 512, 512, 3, 1, False, True, dil=4),
    Layer("head 3x3", "conv", 1, 64, 64, 2048, 512, 3, 1, False, True),
)

# smp Unet-resnext50_32x4d's grouped 3x3s (--net resnext) at 512x512: 32 groups of 4, 8, 16 and 32 channels.
# ``ours_ms`` is the general conv's entry for the ONNX groups as they are (the direct entry for 4 and 8 a
# group), ``engine_ms`` the launch as the partition lowers it: narrow groups merged into block-diagonal weights.
RESNEXT_LAYERS = (
    Layer("l1 g32x4", "conv", 3, 128, 128, 128, 128, 3, 1, False, True, 32),
    Layer("l2.0 g32x8 /2", "conv", 1, 128, 128, 256, 256, 3, 2, False, True, 32),
    Layer("l2 g32x8", "conv", 3, 64, 64, 256, 256, 3, 1, False, True, 32),
    Layer("l3.0 g32x16 /2", "conv", 1, 64, 64, 512, 512, 3, 2, False, True, 32),
    Layer("l3 g32x16", "conv", 5, 32, 32, 512, 512, 3, 1, False, True, 32),
    Layer("l4 g32x32", "conv", 2, 16, 16, 1024, 1024, 3, 1, False, True, 32),
)


def _segformer_layers(
    dims: tuple[int, ...], depths: tuple[int, ...], srs: tuple[int, ...], side: int
) -> tuple[Layer, ...]:
    """A SegFormer (MiT encoder, smp's all-MLP head of 256 channels) at a ``side`` x ``side`` input: per stage its
    patch embedding (3x3/2 but the first, a 7x7/4 stem: left out, C = 3), and per block the attention's q, its
    spatial reduction (an sr x sr / sr conv) and kv, the projection with the residual, and Mix-FFN's two Linears
    (the second with the residual) as the 1x1 convs the front end makes of them; then the head's per-stage 1x1s to
    256 and its fuse 1x1 + ReLU. GELU and LayerNorm are other launches: conv + bias (+ residual) here."""
    layers, prev = [], 0
    for s, (c, d, sr) in enumerate(zip(dims, depths, srs, strict=True)):
        hw = side // (4 << s)
        if s:
            layers.append(Layer(f"s{s + 1} embed 3x3/2", "conv", 1, 2 * hw, 2 * hw, prev, c, 3, 2, False, False))
        kv_hw = hw // sr
        reduce = Layer(f"s{s + 1} sr {sr}x{sr}/{sr}", "conv", d, hw, hw, c, c, sr, sr, False, False, pad=0)
        layers += [
            Layer(f"s{s + 1} q", "conv", d, hw, hw, c, c, 1, 1, False, False),
            *([reduce] if sr > 1 else []),
            Layer(f"s{s + 1} kv", "conv", d, kv_hw, kv_hw, c, 2 * c, 1, 1, False, False),
            Layer(f"s{s + 1} proj+res", "conv", d, hw, hw, c, c, 1, 1, True, False),
            Layer(f"s{s + 1} fc1", "conv", d, hw, hw, c, 4 * c, 1, 1, False, False),
            Layer(f"s{s + 1} fc2+res", "conv", d, hw, hw, 4 * c, c, 1, 1, True, False),
            Layer(f"head s{s + 1} -> 256", "conv", 1, hw, hw, c, 256, 1, 1, False, False),
        ]
        prev = c
    fuse = side // 4
    layers.append(Layer("head fuse 1024->256", "conv", 1, fuse, fuse, 4 * 256, 256, 1, 1, False, True))
    return tuple(layers)


# smp Segformer mit_b2 (--net segformer_b2) at 512x512: embed dims 64/128/320/512, depths 3/4/6/3, spatial
# reductions 8/4/2/1. At N=1 these are small GEMMs (16x16 to 128x128 tokens), where launch and tail dominate.
SEGFORMER_B2_LAYERS = _segformer_layers((64, 128, 320, 512), (3, 4, 6, 3), (8, 4, 2, 1), 512)

NETS = {
    "resnet34": LAYERS,
    "unet": UNET_LAYERS,
    "split": SPLIT_LAYERS,
    "fcn": FCN_LAYERS,
    "resnext": RESNEXT_LAYERS,
    "segformer_b2": SEGFORMER_B2_LAYERS,
}


def median_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class EngineContext:
    """What the engine's Track A gives a spec preparing a launch (runtime/track_a.py's _Context):
    tensor maps encoded by the driver, zeroed workspace (torch memory, kept alive here)."""

    def __init__(self, wgmma_off: str | None, device: DeviceInfo) -> None:
        self.wgmma_off = wgmma_off
        self.device = device  # the GPU measured on (runtime.driver.Device.info)
        self.keep: list[torch.Tensor] = []

    def tuned_entry(self, call: KernelCall, batch: int) -> str | None:
        return None

    def tensor_map(self, m):
        return tma.encode(m)

    def workspace(self, nbytes: int) -> int:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        self.keep.append(buf)
        return buf.data_ptr()


def _t(t: torch.Tensor) -> GpuTensor:
    return GpuTensor(t.data_ptr(), tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch.")))


def engine_launch(kernels: dict, stream: Stream, ctx: EngineContext, layer: Layer, tensors: dict):
    """The launch the engine prepares for this layer's op (conv3x3 or the general conv), as a
    callable, and its (impl, entry, why)."""
    g, act = layer.engine_geom, Activation.named("relu" if layer.relu else "none")
    ins = ("x", "r") if layer.residual else ("x",)
    if layer.op == "conv3x3":
        call = KernelCall("conv3x3", ins, ("y",), ("w", "b"), (("relu", int(layer.relu)),), (layer.name,))
    else:
        attrs = (*g.attrs(), *act.attrs(), ("residual", int(layer.residual)))
        call = KernelCall("conv", ins, ("y",), ("w", "b"), attrs, (layer.name,))
    inputs = [_t(tensors[i]) for i in ins]
    w = tensors["w_engine"] if "w_engine" in tensors else tensors["w"]
    p = KERNELS[layer.op].prepare_inputs(call, inputs, _t(tensors["y"]), [_t(w), _t(tensors["b"])], ctx)
    impl, why = (p.choice.impl, p.choice.reason) if p.choice is not None else ("mma.sync", "variant()")
    entry = p.choice.entry if p.choice is not None else p.entry  # a split's tile, not its summing entry
    return prepared_launch(kernels, stream, p), impl, entry, why


def prepared_launch(kernels: dict, stream: Stream, p):
    """A PreparedCall as one callable: its ``before`` launches (split-K's slices), then its own."""
    steps = [(kernels[q.entry], q) for q in (*p.before, p)]

    def launch() -> None:
        for fn, q in steps:
            fn.launch(q.config.grid, q.config.block, q.config.shared_bytes, stream, q.args)

    return launch


def split_tile(layer: Layer, entry: str) -> str:
    """The tile entry whose split-K ``--splits`` times: the layer's own where it is one, else (the
    direct or a stem entry) the tile its channels would get (``_gather`` for C % 8 != 0 a group)."""
    if entry in SPEC.f16_tiles():
        return entry
    cg, kg = layer.C // layer.groups, layer.K // layer.groups
    if cg % 8:
        return f"{SPEC.stem}_f16_gather"
    return f"{SPEC.stem}_f16_narrow" if kg <= SPEC.f16_narrow.bn else f"{SPEC.stem}_f16_small"


def split_launch(
    kernels: dict, stream: Stream, ctx: EngineContext, layer: Layer, tensors: dict, entry: str, splits: int
):
    """The general conv's ``entry`` forced to ``splits`` split-K slices on this layer, as one callable."""
    act = Activation.named("relu" if layer.relu else "none")
    ins = ("x", "r") if layer.residual else ("x",)
    attrs = (*layer.geom.attrs(), *act.attrs(), ("residual", int(layer.residual)))
    call = KernelCall("conv", ins, ("y",), ("w", "b"), attrs, (layer.name,))
    kw = SPEC.call_args(call, [_t(tensors[i]) for i in ins], _t(tensors["y"]), [_t(tensors["w"]), _t(tensors["b"])])
    return prepared_launch(
        kernels, stream, SPEC.prepare_entry(ConvChoice("mma.sync", entry, "forced", splits), kw, ctx)
    )


def fp8_row(kernels: dict, stream: Stream, ctx: EngineContext, layer: Layer, tensors: dict, ref, iters: int) -> dict:
    """The layer as a ``precision: fp8`` plan runs it: quantize_fp8, then conv_fp8 (module docstring);
    {} where conv_fp8 does not take it (its ``supports`` reason in ``fp8_skip``)."""
    g, x = layer.geom, tensors["x"]
    s_x = float(x.float().abs().max()) / 448
    attrs = (*g.attrs(), *Activation.named("relu" if layer.relu else "none").attrs())
    attrs = (*attrs, ("residual", int(layer.residual)), ("x_scale", f32_bits(s_x)))
    ins = ("xq", "r") if layer.residual else ("xq",)
    call = KernelCall("conv_fp8", ins, ("y",), ("w", "b"), attrs, (layer.name,))
    why = FP8.supports(call, C=layer.C, K=layer.K)
    if QUANT.entry("float16") not in kernels:
        why = "the FP8 kernels are sm_90a only"
    if why:
        return {"fp8_skip": why}
    quant = KernelCall("quantize_fp8", ("x",), ("xq",), (), (("inv_scale", f32_bits(1 / s_x)),), (layer.name,))
    xq = torch.empty(tuple(x.shape), dtype=torch.uint8, device="cuda")
    pq = QUANT.prepare_inputs(quant, [_t(x)], _t(xq), [], ctx)
    w_onnx = tensors["w"].permute(0, 3, 1, 2).float().cpu().numpy()  # KRSC -> ONNX (K, C, R, S)
    packed = FP8.pack_weights(call, {"w": w_onnx, "b": tensors["b"].cpu().numpy()})
    wq, bq = (torch.from_numpy(packed[k]).cuda() for k in ("w", "b"))
    inputs = [_t(xq), *([_t(tensors["r"])] if layer.residual else [])]
    y = tensors["y"]
    y.fill_(float("nan"))
    pc = FP8.prepare_inputs(call, inputs, _t(y), [_t(wq), _t(bq)], ctx)
    fq, fc = kernels[pq.entry], kernels[pc.entry]

    def quantize() -> None:
        fq.launch(pq.config.grid, pq.config.block, pq.config.shared_bytes, stream, pq.args)

    def conv() -> None:
        fc.launch(pc.config.grid, pc.config.block, pc.config.shared_bytes, stream, pc.args)

    quantize()
    conv()
    torch.cuda.synchronize()
    got = y.permute(0, 3, 1, 2).float()
    rel = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
    row = {"fp8_entry": pc.entry, "fp8_reason": pc.choice.reason if pc.choice else "", "fp8_rel_l2": rel}
    if not np.isfinite(rel):
        return row
    row["fp8_ms"] = median_ms(lambda: (quantize(), conv()), iters)
    row["fp8_conv_ms"] = median_ms(conv, iters)
    return row


def wgmma_rows(kernels, stream, ctx, layer: Layer, n: int, x, w, b, res, y, ref, iters: int) -> dict:
    """Every fp16 wgmma configuration of the layer's window (the ``_1x1`` entries for a 1x1, the per-tap
    and column-copy ones for a 3x3 of dilation 1, per-tap only where dilated) forced on it, unsplit, each
    checked against ``ref`` first: entry -> median ms, or why it was skipped / failed."""
    hopper = KERNELS["conv3x3"].hopper  # type: ignore[attr-defined]
    g = layer.geom
    if g.groups != 1 or (g.R, g.S) not in ((1, 1), (3, 3)) or layer.stride != 1:
        return {}
    act = Activation.named("relu" if layer.relu else "none")
    out: dict[str, float | str] = {}
    for cfg in hopper.configs:
        if cfg.pointwise != (g.R == 1) or (cfg.halo_tw and layer.dil != 1):
            continue
        choice = ConvChoice("wgmma", cfg.entry, "forced", 1)
        try:
            p = hopper.prepare_entry(
                choice, _t(x), _t(y), [_t(w), _t(b)], act, ctx, res=None if res is None else _t(res), dil=layer.dil
            )
        except InputError as exc:
            out[cfg.entry] = f"skipped: {exc}"
            continue
        fn = prepared_launch(kernels, stream, p)
        y.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        got = y.permute(0, 3, 1, 2).float()
        rel = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
        out[cfg.entry] = median_ms(fn, iters) if rel <= TOL else f"FAILED: rel_l2 {rel:.1e}"
    return out


def run_layer(
    kernels: dict,
    stream: Stream,
    layer: Layer,
    n: int,
    iters: int,
    variants: bool = False,
    ctx: EngineContext | None = None,
    fp8: bool = False,
    splits: tuple[int, ...] = (),
    wgmma_variants: bool = False,
) -> dict:
    g = layer.geom
    _, p, q, _ = SPEC.output_shape(n, layer.H, layer.W, layer.C, layer.K, geom=g)
    x = torch.randn(n, layer.H, layer.W, layer.C, device="cuda", dtype=torch.float16)
    cg = layer.C // layer.groups
    w = (torch.randn(layer.K, layer.R, layer.R, cg, device="cuda") / (cg * layer.R**2) ** 0.5).half()
    b = torch.randn(layer.K, device="cuda")
    res = torch.randn(n, p, q, layer.K, device="cuda", dtype=torch.float16) if layer.residual else None
    y = torch.full((n, p, q, layer.K), float("nan"), device="cuda", dtype=torch.float16)
    act = Activation.named("relu" if layer.relu else "none")
    entry = SPEC.variant("float16", n, layer.H, layer.W, layer.C, layer.K, g)
    args = SPEC.args(
        x=x.data_ptr(), w=w.data_ptr(), bias=b.data_ptr(), res=None if res is None else res.data_ptr(),
        y=y.data_ptr(), N=n, H=layer.H, W=layer.W, C=layer.C, K=layer.K, geom=g, act=act,
    )  # fmt: skip

    def launcher(name: str):
        cfg = SPEC.launch("float16", n, layer.H, layer.W, layer.C, layer.K, geom=g, entry=name)
        fn = kernels[name]
        return lambda: fn.launch(cfg.grid, cfg.block, cfg.shared_bytes, stream, args)

    ours = launcher(entry)
    ours()
    torch.cuda.synchronize()
    x_cl = x.permute(0, 3, 1, 2)  # NHWC data = a channels_last NCHW tensor, no copy
    w_cl = w.permute(0, 3, 1, 2)
    pad = layer.geom.pad_top
    conv = {"stride": layer.stride, "padding": pad, "dilation": layer.dil, "groups": layer.groups}
    ref = F.conv2d(x_cl.float(), w_cl.float(), b, **conv)
    if res is not None:
        ref = ref + res.permute(0, 3, 1, 2).float()
    if layer.relu:
        ref = torch.relu(ref)
    got = y.permute(0, 3, 1, 2).float()
    rel = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
    row = {**asdict(layer), "N": n, "entry": entry, "rel_l2": rel, "passed": rel <= TOL}
    if not row["passed"]:
        return row
    if ctx is not None:
        y.fill_(float("nan"))
        tensors = {"x": x, "w": w, "b": b, "r": res, "y": y}
        merge = layer.engine_geom.merge
        if merge > 1:  # the partition's block-diagonal weights of the merged groups, KRSC
            onnx_w = w.permute(0, 3, 1, 2).cpu().numpy()
            packed = pack_conv_weights(block_diagonal(onnx_w, layer.groups, merge), any_size=True)[0]
            tensors["w_engine"] = torch.from_numpy(packed).cuda()
            row["engine_merge"] = merge
        engine, impl, engine_entry, why = engine_launch(kernels, stream, ctx, layer, tensors)
        engine()
        torch.cuda.synchronize()
        got = y.permute(0, 3, 1, 2).float()
        erel = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
        row.update(engine_impl=impl, engine_entry=engine_entry, engine_reason=why, engine_rel_l2=erel)
        row["passed"] = erel <= TOL
        if not row["passed"]:
            return row
        row["engine_ms"] = median_ms(engine, iters)
        if fp8:
            row.update(fp8_row(kernels, stream, ctx, layer, tensors, ref, iters))
            if "fp8_ms" in row:
                row["fp8_speedup"] = row["engine_ms"] / row["fp8_ms"]
    row["ours_ms"] = median_ms(ours, iters)
    bh = b.half()
    row["cudnn_ms"] = median_ms(lambda: F.conv2d(x_cl, w_cl, bh, **conv), iters)
    row["ratio"] = row["ours_ms"] / row["cudnn_ms"]
    if "engine_ms" in row:
        row["engine_ratio"] = row["engine_ms"] / row["cudnn_ms"]
    if splits and ctx is not None:  # a tile entry at each forced split count, checked first
        tile = split_tile(layer, entry)
        row["split_entry"] = tile
        row["mma_splits"] = SPEC.split_k("float16", n, layer.H, layer.W, layer.C, layer.K, g, tile, device=ctx.device)
        row["splits_ms"] = {}
        tensors = {"x": x, "w": w, "b": b, "r": res, "y": y}
        for s in splits:
            try:
                fn = split_launch(kernels, stream, ctx, layer, tensors, tile, s)
            except InputError as exc:  # more slices than the grid takes
                row["splits_ms"][str(s)] = f"skipped: {exc}"
                continue
            y.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            got = y.permute(0, 3, 1, 2).float()
            srel = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
            row["splits_ms"][str(s)] = median_ms(fn, iters) if srel <= TOL else f"FAILED: rel_l2 {srel:.1e}"
            row["passed"] = row["passed"] and srel <= TOL
    if wgmma_variants and ctx is not None and ctx.wgmma_off is None:
        row["wgmma_ms"] = wgmma_rows(kernels, stream, ctx, layer, n, x, w, b, res, y, ref, iters)
    if variants:  # every fp16 entry that takes this layer (same arguments), to check the selection policy
        row["variants_ms"] = {}
        for e in (*SPEC.f16_tiles(), SPEC.direct_entry, *SPEC.stem_tiles()):
            try:
                row["variants_ms"][e] = median_ms(launcher(e), iters)
            except InputError as exc:  # an entry for other shapes (the direct one's K <= 8...)
                row["variants_ms"][e] = f"skipped: {exc}"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="", help="run the layers whose name contains this")
    ap.add_argument("--variants", action="store_true", help="also time every fp16 entry on each layer")
    ap.add_argument("--net", choices=tuple(NETS), default="resnet34", help="whose layers (default: %(default)s)")
    ap.add_argument(
        "--splits", type=int, nargs="+", default=[], help="also time the mma.sync entry at these split-K counts"
    )
    ap.add_argument("--fp8", action="store_true", help="also run each layer as quantize_fp8 + conv_fp8 (sm_90a)")
    ap.add_argument(
        "--wgmma-variants", action="store_true", help="also time every wgmma configuration of each layer's window"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_layers: needs a CUDA GPU and torch with CUDA", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    torch.cuda.init()
    dev = Device(0)
    ctx = dev.primary_context()  # the one torch uses
    ctx.make_current()
    choice = choose_image(dev.cc, [], list(PTX_ARCHES))
    path = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{SPEC.stem}.cu", choice.arch)
    mods, kernels = [], {}
    wgmma = KERNELS["conv3x3"].hopper  # type: ignore[attr-defined]
    for spec in (SPEC, KERNELS["conv3x3"], wgmma, *((QUANT,) if args.fp8 else ())):
        if choice.arch not in spec.ptx_arches:
            continue
        path = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{spec.stem}.cu", choice.arch)
        mod = Module.load(ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch)
        mods.append(mod)
        kernels.update({e: mod.function(e) for e in spec.entries})
    has_wgmma = wgmma.configs[0].entry in kernels
    for c in wgmma.all_configs if has_wgmma else ():  # the e4m3 rows (--fp8) too
        kernels[c.entry].set_max_dynamic_shared(c.smem_bytes)
    engine_ctx = EngineContext(None if has_wgmma else f"no wgmma kernel for {choice.arch}", dev.info())
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream, ctx)

    rows = []
    print(
        f"{'layer':18} {'op':8} {'N':>2} {'entry':22} {'rel_l2':>8} {'ours ms':>8} {'cudnn ms':>8} {'ratio':>6}"
        f"  {'engine kernel':36} {'ms':>8} {'ratio':>6}"
    )
    for n in args.batches:
        for layer in NETS[args.net]:
            if args.only and args.only not in layer.name:
                continue
            row = run_layer(
                kernels, stream, layer, n, args.iters, args.variants, engine_ctx, args.fp8, tuple(args.splits),
                args.wgmma_variants,
            )  # fmt: skip
            rows.append(row)
            times = f"{row['ours_ms']:8.4f} {row['cudnn_ms']:8.4f} {row['ratio']:6.2f}" if row["passed"] else "  FAILED"
            if row["passed"] and "engine_ms" in row:
                split = (
                    f" x{row['engine_reason'].split(' x ')[1].split()[0]}" if " split-K" in row["engine_reason"] else ""
                )
                name = row["engine_entry"].removeprefix("conv3x3_") + split
                times += f"  {name:36} {row['engine_ms']:8.4f} {row['engine_ratio']:6.2f}"
            entry = row["entry"].removeprefix("conv_nhwc_")
            print(f"{layer.name:18} {layer.op:8} {n:>2} {entry:22} {row['rel_l2']:8.1e} {times}")
            if "fp8_ms" in row:
                fp8 = row["fp8_entry"].removeprefix("conv3x3_wgmma_")
                speed, rel = row["fp8_speedup"], row["fp8_rel_l2"]
                print(f"{'':30} fp8 {fp8:36} {row['fp8_ms']:8.4f} x{speed:.2f} rel_l2 {rel:.1e}")
            for s, ms in row.get("splits_ms", {}).items():
                shown = f"{ms:8.4f}" if isinstance(ms, float) else ms
                auto = " (the chooser's)" if int(s) == row.get("mma_splits") else ""
                tile = row["split_entry"].removeprefix("conv_nhwc_")
                print(f"{'':30} {tile + ' x' + s + auto:22} {'':8} {shown}")
            for e, ms in {**row.get("wgmma_ms", {}), **row.get("variants_ms", {})}.items():
                shown = f"{ms:8.4f}" if isinstance(ms, float) else ms
                print(f"{'':30} {e.removeprefix('conv_nhwc_'):22} {'':8} {shown}")
    totals = {}
    for n in args.batches:
        mine = [r for r in rows if r["N"] == n and r["op"] == "conv" and r["passed"]]
        totals[str(n)] = {
            "general_conv_layers_ours_ms": sum(r["ours_ms"] * r["uses"] for r in mine),
            "general_conv_layers_cudnn_ms": sum(r["cudnn_ms"] * r["uses"] for r in mine),
        }
        every = [r for r in rows if r["N"] == n and r["passed"] and "engine_ms" in r]
        totals[str(n)]["all_layers_engine_ms"] = sum(r["engine_ms"] * r["uses"] for r in every)
        totals[str(n)]["all_layers_cudnn_ms"] = sum(r["cudnn_ms"] * r["uses"] for r in every)
        both = [r for r in every if "fp8_ms" in r]
        if both:  # the layers conv_fp8 takes: fp16 (the engine's kernel) against fp8, weighted by use
            totals[str(n)]["fp8_layers_fp16_ms"] = sum(r["engine_ms"] * r["uses"] for r in both)
            totals[str(n)]["fp8_layers_fp8_ms"] = sum(r["fp8_ms"] * r["uses"] for r in both)
            t16, t8 = totals[str(n)]["fp8_layers_fp16_ms"], totals[str(n)]["fp8_layers_fp8_ms"]
            print(f"N={n}: the {len(both)} layers conv_fp8 takes, weighted by use: fp16 {t16:.3f} ms, fp8 {t8:.3f} ms")
        t = totals[str(n)]
        print(f"N={n}: every layer, weighted by use: the engine's kernels {t['all_layers_engine_ms']:.3f} ms, "
              f"cuDNN {t['all_layers_cudnn_ms']:.3f} ms")  # fmt: skip
        print(
            f"N={n}: the general conv's layers, weighted by use: ours {t['general_conv_layers_ours_ms']:.3f} ms, "
            f"cuDNN {t['general_conv_layers_cudnn_ms']:.3f} ms"
        )
    doc = {
        "commit": os.environ.get("DUALTRACK_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(),
        "driver": subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "arch": choice.arch,
        "rows": rows,
        "totals": totals,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    for mod in mods:
        mod.close()
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
