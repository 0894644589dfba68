"""The registry of Track A's hand-written kernels: the one place that knows which ones exist.

Each kernel has one module here, named after its op, holding its :class:`KernelSpec`: its CUDA
source (``handwritten_ptx/<stem>.cu``), the PTX arches it is built for, its entry symbols, the
``-D`` macros that fix its tile sizes at compile time (so the source and the launch geometry cannot
disagree), its launch geometry, its ``cuLaunchKernel`` argument list (the ABI of
``handwritten_ptx/README.md``), its weight packing, its tensor maps where it has them, and its numpy
reference. ``base.py`` holds what every spec shares, ``conv.py`` what the conv-like ones share,
``select.py`` the one chooser of a convolution's kernel, ``device.py`` the GPU it plans for,
``tensormap.py`` tensor maps as data.

:data:`KERNELS` holds each plan op's spec; :data:`CONV3X3_WGMMA` is the Hopper-only (compute_90a)
3x3 and 1x1 convolution (its ``_1x1`` entries) that the conv specs hand a launch to where
:func:`conv_choice` picks it;
:data:`RESIZE_RGB` prepares the service's GPU-decoded JPEGs (no plan calls it, no bundle ships it).
:data:`SPECS` lists every source. Adding a kernel: its module, its ``.cu``, and one line below.

Tensors are NHWC with a per-pixel channel stride (``ldx``/``ldy``); conv weights are KRSC in the
activation dtype and the bias is fp32. The references take dense arrays (stride = channels);
reading or writing channel slices is the runtime's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dualtrack.contract.activations import ACTIVATIONS, Activation
from dualtrack.contract.arch import PTX_ARCHES
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.manifest import Target
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.attention import AttentionSpec
from dualtrack.kernels.base import (
    DTYPES,
    DeviceTensor,
    KernelArg,
    KernelSpec,
    LaunchConfig,
    LaunchContext,
    PreparedCall,
    dtype_name,
)
from dualtrack.kernels.blend import BlendSpec
from dualtrack.kernels.conv import pack_conv_weights
from dualtrack.kernels.conv1x1 import Conv1x1Spec
from dualtrack.kernels.conv3x3 import Conv3x3Spec, F16Tile
from dualtrack.kernels.conv3x3_wgmma import WGMMA_CONFIGS, Conv3x3WgmmaSpec, WgmmaConfig
from dualtrack.kernels.conv_fp8 import ConvFp8Spec
from dualtrack.kernels.conv_general import ConvGeneralSpec, ConvGeometry
from dualtrack.kernels.convt import ConvTGeometry, ConvTSpec
from dualtrack.kernels.convt2x2 import ConvT2x2Spec, pack_convt_weights
from dualtrack.kernels.creduce import CReduceSpec
from dualtrack.kernels.depth_to_space import DepthToSpace, DepthToSpaceSpec
from dualtrack.kernels.device import DeviceInfo, for_target
from dualtrack.kernels.dwconv import DwConvSpec, DwGeometry
from dualtrack.kernels.eltwise import EltwiseSpec
from dualtrack.kernels.fc import FcSpec
from dualtrack.kernels.gap import GapSpec
from dualtrack.kernels.maxpool import MaxPoolSpec, PoolGeometry
from dualtrack.kernels.maxpool2x2 import MaxPool2x2Spec
from dualtrack.kernels.norm import NormSpec
from dualtrack.kernels.pad import PadMode, PadSpec
from dualtrack.kernels.problems import ConvProblem, conv_layers
from dualtrack.kernels.quantize_fp8 import QuantizeFp8Spec
from dualtrack.kernels.resize import ResizeMode, ResizeSpec
from dualtrack.kernels.resize_rgb import ResizeRgbSpec
from dualtrack.kernels.seghead import HeadMode, SegHeadSpec
from dualtrack.kernels.select import PLANNED, SMALL_C_K_MAX, SMALL_C_MAX, ConvChoice, Pointers, choose_conv

__all__ = [
    "ACTIVATIONS",
    "BLEND",
    "CONV3X3_WGMMA",
    "DTYPES",
    "KERNELS",
    "RESIZE_RGB",
    "SMALL_C_K_MAX",
    "SMALL_C_MAX",
    "SPECS",
    "WGMMA_CONFIGS",
    "Activation",
    "AttentionSpec",
    "Conv1x1Spec",
    "Conv3x3Spec",
    "Conv3x3WgmmaSpec",
    "ConvChoice",
    "ConvFp8Spec",
    "ConvGeneralSpec",
    "ConvGeometry",
    "ConvT2x2Spec",
    "ConvTGeometry",
    "ConvTSpec",
    "DepthToSpace",
    "DepthToSpaceSpec",
    "DeviceInfo",
    "DeviceTensor",
    "DwConvSpec",
    "DwGeometry",
    "EltwiseSpec",
    "F16Tile",
    "FcSpec",
    "GapSpec",
    "HeadMode",
    "KernelArg",
    "KernelSpec",
    "LaunchConfig",
    "LaunchContext",
    "MaxPool2x2Spec",
    "MaxPoolSpec",
    "NormSpec",
    "PadMode",
    "PadSpec",
    "Pointers",
    "PoolGeometry",
    "PreparedCall",
    "QuantizeFp8Spec",
    "ResizeMode",
    "ResizeRgbSpec",
    "ResizeSpec",
    "SegHeadSpec",
    "WgmmaConfig",
    "choose_conv",
    "conv_choice",
    "defines_for_stem",
    "dtype_name",
    "kernel",
    "output_shape",
    "pack_conv_weights",
    "pack_convt_weights",
    "planned_conv_choices",
    "ptx_arches_for_stem",
    "spec_for_stem",
]  # fmt: skip

CONV3X3_WGMMA = Conv3x3WgmmaSpec(op="conv3x3", stem="conv3x3_wgmma")

KERNELS: Mapping[str, KernelSpec] = {
    "conv3x3": Conv3x3Spec(op="conv3x3", stem="conv3x3_nhwc", hopper=CONV3X3_WGMMA),
    "maxpool2x2": MaxPool2x2Spec(op="maxpool2x2", stem="maxpool2x2_nhwc"),
    "maxpool": MaxPoolSpec(op="maxpool", stem="maxpool_nhwc"),  # any window; maxpool2x2 keeps 2x2/2
    "convt2x2": ConvT2x2Spec(op="convt2x2", stem="convt2x2_nhwc"),
    "convt": ConvTSpec(op="convt", stem="convt_nhwc"),  # any other ConvTranspose (gather form, CUDA cores)
    "conv1x1": Conv1x1Spec(op="conv1x1", stem="conv1x1_nhwc"),
    "conv": ConvGeneralSpec(op="conv", stem="conv_nhwc", hopper=CONV3X3_WGMMA),  # 3x3/1, 1x1/1 fp16: wgmma where it can
    # The mobile network kernels (MobileNetV3 / LR-ASPP: depthwise, SE, HardSwish, bilinear heads).
    "dwconv": DwConvSpec(op="dwconv", stem="dwconv_nhwc"),
    "gap": GapSpec(op="gap", stem="gap_nhwc"),
    "creduce": CReduceSpec(op="creduce", stem="creduce_nhwc"),  # Reduce{Sum,Mean,Max,Min} over channels
    "fc": FcSpec(op="fc", stem="fc_nhwc"),
    "eltwise": EltwiseSpec(op="eltwise", stem="eltwise_nhwc"),
    "resize": ResizeSpec(op="resize", stem="resize_nhwc"),
    "seghead": SegHeadSpec(op="seghead", stem="seghead_nhwc"),  # softmax/sigmoid + argmax: the model's outputs
    "norm": NormSpec(op="norm", stem="norm_nhwc"),  # Group/Instance/Layer/BatchNorm + affine + activation
    "pad": PadSpec(op="pad", stem="pad_nhwc"),  # Pad over H, W; with zero pads a channel-slice copy
    "depth_to_space": DepthToSpaceSpec(op="depth_to_space", stem="depth_to_space_nhwc"),  # DCR and CRD
    "attention": AttentionSpec(op="attention", stem="attention"),  # fused Q·Kᵀ, scale, bias, softmax, ·V (fp16)
    # FP8 (issue 42, sm_90a): fp16 -> e4m3 bytes, and the e4m3 rows of the wgmma family (its source).
    "quantize_fp8": QuantizeFp8Spec(op="quantize_fp8", stem="quantize_fp8"),
    "conv_fp8": ConvFp8Spec(op="conv_fp8", stem=CONV3X3_WGMMA.stem, hopper=CONV3X3_WGMMA),
}

# Not a plan op: the service's GPU JPEG path resizes decoded pictures into the batch's input rows with it.
RESIZE_RGB = ResizeRgbSpec(op="resize_rgb", stem="resize_rgb_u8")

# Not a plan op: the engine's sliding-window path cuts windows and blends their outputs with it (runtime/tiling.py).
BLEND = BlendSpec(op="blend", stem="blend_nhwc")

# each handwritten_ptx/*.cu once: conv_fp8's rows are compiled into CONV3X3_WGMMA's source
SPECS: tuple[KernelSpec, ...] = (
    *(s for s in KERNELS.values() if s.stem != CONV3X3_WGMMA.stem),
    CONV3X3_WGMMA,
    RESIZE_RGB,
    BLEND,
)


def conv_choice(
    p: ConvProblem,
    device: DeviceInfo,
    *,
    call: KernelCall | None = None,
    tuned: str | None = None,
    wgmma_off: str | None = None,
    at: Pointers = PLANNED,
) -> ConvChoice:
    """:func:`choose_conv` with the registry's spec: of ``call``'s op (``conv3x3`` or the general
    ``conv``, whose window and activation are the call's attributes), or conv3x3 where ``call`` is
    None. What the bundle, the build, the cost model, the tuner and tools ask for a planned launch."""
    op = "conv3x3" if call is None else call.op
    spec = KERNELS[op]
    if isinstance(spec, ConvGeneralSpec):
        assert call is not None
        geom, act = ConvGeometry.from_call(call), Activation.of(call)
        return choose_conv(spec, p, device, window=geom, act=act, tuned=tuned, wgmma_off=wgmma_off, at=at)
    if not isinstance(spec, Conv3x3Spec):
        raise InputError(f"{op} is not a convolution the chooser knows; it takes conv3x3 and conv calls")
    return choose_conv(spec, p, device, tuned=tuned, wgmma_off=wgmma_off, at=at)


def planned_conv_choices(bundle: Bundle, target: Target, device: DeviceInfo | None = None) -> list[tuple[Any, Any]]:
    """Which kernel each Track A conv3x3 launch of ``bundle``'s plan runs on ``device`` (default: the
    GPU ``target`` names, ``kernels.device.for_target``) of ``target`` (an entry of the manifest's
    ``targets``), as (``ConvLayer``, ``ConvChoice``) pairs in plan order: :func:`conv_choice`'s answer
    with the target's image (wgmma where it has it) and tuned entries, pointers assumed aligned, as
    planned buffers are. What did run on a device: the engine's ``backend.stats.conv3x3``. The general
    conv's calls that the wgmma kernel takes or that split their reduction (split-K) are listed too;
    its other calls are not."""
    image = bundle.track_a.get("ptx", {}).get(target.track_a_ptx, {})
    off = None if CONV3X3_WGMMA.stem in image else f"not in the {target.track_a_ptx} PTX"
    tuned = bundle.tuned_calls(target.cc_tuple)
    gpu = device if device is not None else for_target(target.requested)
    out = []
    for layer in conv_layers(bundle.plan, ops=("conv3x3", "conv")):
        call = layer.call
        assert call is not None  # conv_layers sets it
        entry = tuned.get(layer.node, {}).get(str(layer.batch)) if call.op == "conv3x3" else None
        choice = conv_choice(layer.problem, gpu, call=call, tuned=entry, wgmma_off=off)
        if call.op == "conv3x3" or choice.impl == "wgmma" or choice.splits > 1:
            out.append((layer, choice))
    return out


def kernel(op: str) -> KernelSpec:
    """The spec of a plan op, or InputError naming the ops that exist."""
    try:
        return KERNELS[op]
    except KeyError:
        raise InputError(f"no Track A kernel for op '{op}'; Track A has {', '.join(sorted(KERNELS))}") from None


def output_shape(op: str, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
    """NHWC output shape of ``op`` on an (N,H,W,C) input (K: output channels, conv only)."""
    return kernel(op).output_shape(N, H, W, C, K)


def spec_for_stem(stem: str) -> KernelSpec | None:
    """The spec of a source stem (``conv3x3_wgmma``), or None."""
    return next((spec for spec in SPECS if spec.stem == stem), None)


def defines_for_stem(stem: str) -> dict[str, int | str]:
    """The ``-D`` macros a source file is compiled with (empty for a stem no spec names)."""
    spec = spec_for_stem(stem)
    return spec.defines() if spec is not None else {}


def ptx_arches_for_stem(stem: str) -> tuple[str, ...]:
    """The PTX arches a source is compiled for (every one of ``arch.PTX_ARCHES`` unless its spec
    says otherwise: conv3x3_wgmma is compute_90a only)."""
    spec = spec_for_stem(stem)
    return spec.ptx_arches if spec is not None else PTX_ARCHES
