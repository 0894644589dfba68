"""Which kernel runs a convolution on a device: :func:`choose_conv`, the one place that decides.

Both conv ops go through it: ``conv3x3`` (conv3x3_nhwc's entries) and the general ``conv``
(conv_nhwc's), each preferring the Hopper kernel conv3x3_wgmma where it takes the launch. The
runtime's launch preparation, the bundle's report, the build's kernel list, the partition's cost
model and the tuner all ask it, so they cannot disagree. Each kernel's own shape rules stay with
its spec (:meth:`Conv3x3WgmmaSpec.supported` and ``.choose``, :meth:`Conv3x3Spec.smallc_supported`
and ``.variant``, :meth:`ConvGeneralSpec.hopper_window`, ``.direct_supported`` and ``.variant``);
this module holds their order. It takes the spec as an argument and imports no kernel module, so
the specs can call it; ``dualtrack.kernels.conv_choice`` asks it with the registry's specs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dualtrack.kernels.base import dtype_name
from dualtrack.kernels.device import DeviceInfo
from dualtrack.kernels.problems import ConvProblem

if TYPE_CHECKING:  # annotations only: the spec modules import this one
    from dualtrack.contract.activations import Activation
    from dualtrack.kernels.conv3x3_wgmma import Conv3x3WgmmaSpec
    from dualtrack.kernels.conv_general import ConvGeometry

# The small-C conv3x3 entry (``conv3x3_nhwc_f16_smallc``, a direct convolution on CUDA cores) takes
# fp16 layers with at most SMALL_C_MAX input channels (the RGB first layer), where the implicit
# GEMM's 9*C-deep reduction is too short for tensor-core tiles, and at most SMALL_C_K_MAX output
# channels (its fp32 weights stay in shared memory). Such a layer always runs it.
SMALL_C_MAX = 4
SMALL_C_K_MAX = 128


@dataclass(frozen=True)
class ConvChoice:
    """Which kernel runs one convolution launch, and why (:func:`choose_conv`)."""

    # "wgmma" (conv3x3_wgmma, sm_90a), "mma.sync" (a tensor-core GEMM entry), "direct" (a direct
    # convolution on CUDA cores: conv3x3's small-C entry, the general conv's few-K entry), "simt" (fp32)
    impl: str
    entry: str
    reason: str
    splits: int = 1  # split-K parts of the reduction (wgmma: grid.y; the general conv's tiles: grid.z)

    def to_json(self) -> dict[str, Any]:
        split = {"splits": self.splits} if self.splits > 1 else {}
        return {"impl": self.impl, "entry": self.entry, "reason": self.reason, **split}


@dataclass(frozen=True)
class Pointers:
    """The device addresses of a launch, where known: 0 (and ``res`` None: no residual) plans with
    aligned buffers, as planned buffers are."""

    x: int = 0
    w: int = 0
    y: int = 0
    res: int | None = None  # the general conv's residual input
    ldr: int = 0  # its channel stride


PLANNED = Pointers()


class ConvFamily(Protocol):
    """What :func:`choose_conv` asks a conv op's spec (``Conv3x3Spec``, ``ConvGeneralSpec``): its
    shape rules, never the order between its kernels."""

    stem: str
    hopper: Conv3x3WgmmaSpec | None  # the wgmma kernel it hands launches to, or None

    def hopper_window(self, geom: ConvGeometry | None, act: Activation | None) -> str | None:
        """Why the wgmma kernel cannot compute this window and activation, or None."""
        ...

    def direct_for(self, p: ConvProblem, geom: ConvGeometry | None) -> tuple[str, str] | None:
        """Its direct-convolution entry and why, where that takes ``p``; else None."""
        ...

    def variant(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int, geom: Any = None, *, device: DeviceInfo
    ) -> str:
        """Its heuristic entry for this shape on ``device``."""
        ...

    def split_k(
        self, dtype: Any, N: int, H: int, W: int, C: int, K: int, geom: Any, entry: str, *, device: DeviceInfo
    ) -> int:
        """Split-K slices of its heuristic ``entry`` for this shape on ``device`` (1: none)."""
        ...


def choose_conv(
    spec: ConvFamily,
    p: ConvProblem,
    device: DeviceInfo,
    *,
    window: ConvGeometry | None = None,
    act: Activation | None = None,
    tuned: str | None = None,
    wgmma_off: str | None = None,
    at: Pointers = PLANNED,
) -> ConvChoice:
    """The kernel for launch ``p`` of ``spec``'s op on ``device``, in this order:

    1. the wgmma kernel (``spec.hopper``) wherever it is available (``wgmma_off`` None: a cc 9.0
       device whose image has it, DUALTRACK_WGMMA not 0) and takes the launch: its shape and
       pointers (:meth:`Conv3x3WgmmaSpec.supported`), for the general conv also its ``window``
       (3x3 stride 1 padding 1, or 1x1 stride 1 padding 0: its ``_1x1`` entries; group 1) and
       residual; with :meth:`Conv3x3WgmmaSpec.choice`'s tile and split-K for ``device``;
    2. the direct entry where the op has one that takes the shape (conv3x3: fp16 with C <=
       :data:`SMALL_C_MAX`, even over a tuned entry, which is an mma.sync tile that would gather
       such a layer's A tile element by element; the general conv: a few output channels);
    3. the tuned mma.sync entry of the layer (``tuned``, from a `dualtrack tune` file);
    4. the spec's ``variant`` for ``device`` (the tile that fills its SMs; for the general conv's
       layers of C <= 8 input channels and group 1, its stem entries, kernels/conv_stem.py), with
       the spec's ``split_k`` slices where its tiles cannot fill the GPU and the reduction is deep.

    A tuned entry never displaces the wgmma kernel: the tuner searches mma.sync tiles only, and the
    wgmma kernel beat cuDNN on every U-Net layer it takes (bench/results/wgmma_check-e477c6d.json).
    ``window`` is None for conv3x3 (3x3, stride 1, padding 1) and the geometry of a general conv.
    """
    why = _wgmma_refusal(spec, p, window, act, wgmma_off, at)
    if why is None and spec.hopper is not None:
        pointwise = window is not None and (window.R, window.S) == (1, 1)
        return spec.hopper.choice(p, device, pointwise=pointwise, dilation=window.dil_h if window else 1)
    wgmma = f"wgmma: {why}"
    direct = spec.direct_for(p, window)
    if direct is not None:
        unused = f"; tuned {tuned.removeprefix(spec.stem + '_')} not used" if tuned else ""
        return ConvChoice("direct", direct[0], f"{direct[1]}{unused}; {wgmma}")
    impl = "mma.sync" if dtype_name(p.dtype) == "float16" else "simt"
    if tuned:
        return ConvChoice(impl, tuned, f"tuned (dualtrack tune); {wgmma}")
    entry = spec.variant(p.dtype, p.N, p.H, p.W, p.C, p.K, window, device=device)
    splits = spec.split_k(p.dtype, p.N, p.H, p.W, p.C, p.K, window, entry, device=device)
    split = f" x {splits} split-K" if splits > 1 else ""
    return ConvChoice(impl, entry, f"heuristic{split}; {wgmma}", splits)


def _wgmma_refusal(
    spec: ConvFamily,
    p: ConvProblem,
    window: ConvGeometry | None,
    act: Activation | None,
    wgmma_off: str | None,
    at: Pointers,
) -> str | None:
    """Why the wgmma kernel does not take this launch, or None where it does."""
    hopper = spec.hopper
    if wgmma_off is not None:
        return wgmma_off
    if hopper is None:
        return f"{spec.stem} has no Hopper kernel"
    why = spec.hopper_window(window, act) or hopper.supported(p, x=at.x, w=at.w, y=at.y)
    if why is None and at.res is not None:
        why = hopper.residual_supported(p.K, at.res, at.ldr)
    return why
