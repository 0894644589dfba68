"""Which kernel runs a conv3x3 launch: the policy between conv3x3_wgmma and conv3x3_nhwc's entries.

:func:`choose_conv3x3` is the one place that orders the op's kernels (Hopper first, the small-C
direct entry, a tuned tile, the heuristic); each kernel's own shape rules stay with its spec
(:meth:`Conv3x3WgmmaSpec.supported` and ``.choose``, :meth:`Conv3x3Spec.variant`). The policy
takes the conv spec as an argument, so this module imports no kernel: the specs call it
(:meth:`Conv3x3Spec.select`), and ``dualtrack.kernels.choose_conv3x3`` is the registry's one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dualtrack.kernels.base import dtype_name
from dualtrack.kernels.problems import ConvProblem

if TYPE_CHECKING:  # annotations only: conv3x3.py imports this module
    from dualtrack.kernels.conv3x3 import Conv3x3Spec

# The small-C conv3x3 entry (``conv3x3_nhwc_f16_smallc``, a direct convolution on CUDA cores) takes
# fp16 layers with at most SMALL_C_MAX input channels (the RGB first layer), where the implicit
# GEMM's 9*C-deep reduction is too short for tensor-core tiles, and at most SMALL_C_K_MAX output
# channels (its fp32 weights stay in shared memory). Such a layer always runs it:
# :meth:`Conv3x3Spec.variant` and :func:`choose_conv3x3` put it before every other fp16 entry.
SMALL_C_MAX = 4
SMALL_C_K_MAX = 128


@dataclass(frozen=True)
class ConvChoice:
    """Which kernel runs one conv3x3 launch, and why (:func:`choose_conv3x3`)."""

    # "wgmma" (conv3x3_wgmma, sm_90a), "mma.sync" (conv3x3_nhwc fp16), "direct" (its small-C fp16
    # entry, CUDA cores), "simt" (fp32)
    impl: str
    entry: str
    reason: str
    splits: int = 1  # wgmma: split-K parts of the reduction (grid.y)

    def to_json(self) -> dict[str, Any]:
        split = {"splits": self.splits} if self.splits > 1 else {}
        return {"impl": self.impl, "entry": self.entry, "reason": self.reason, **split}


def choose_conv3x3(
    conv: Conv3x3Spec,
    p: ConvProblem,
    *,
    wgmma_off: str | None,
    tuned: str | None = None,
    x: int = 0,
    w: int = 0,
    y: int = 0,
) -> ConvChoice:
    """The kernel for launch ``p`` of ``conv``'s op (``KERNELS["conv3x3"]``; ``x``, ``w``, ``y``: its
    device pointers, 0 where only the shape is known), in this order:

    1. the wgmma kernel wherever it is available (``wgmma_off`` is None: a cc 9.0 device whose
       image has it, DUALTRACK_WGMMA not 0) and :meth:`Conv3x3WgmmaSpec.supported` takes the
       launch (``conv.hopper``), with :meth:`Conv3x3WgmmaSpec.choose`'s tile (it never takes
       C <= SMALL_C_MAX: TMA needs C % 8 == 0);
    2. the small-C direct entry for fp16 with C <= :data:`SMALL_C_MAX` (and K <= :data:`SMALL_C_K_MAX`,
       :meth:`Conv3x3Spec.smallc_supported`), even where the layer has a tuned entry: tuning
       searches mma.sync tiles, and for such layers those gather their A tile element by element
       (`dualtrack tune` skips these layers, and builds ignore their records);
    3. the tuned mma.sync entry of the layer (``tuned``, from a `dualtrack tune` file);
    4. :meth:`Conv3x3Spec.variant`.

    A tuned entry never displaces the wgmma kernel: the tuner searches mma.sync tiles only, and the
    wgmma kernel beat cuDNN on every U-Net layer it takes (bench/results/wgmma_check-e477c6d.json).
    """
    hopper = conv.hopper
    if hopper is None:
        why = wgmma_off or f"{conv.stem} has no Hopper kernel"
    else:
        why = wgmma_off or hopper.supported(p, x=x, w=w, y=y)
    if why is None and hopper is not None:
        return hopper.choice(p)
    if conv.smallc_supported(p.dtype, p.C, p.K) is None:
        unused = f"; tuned {tuned.removeprefix(conv.stem + '_')} not used" if tuned else ""
        reason = f"C={p.C} <= {SMALL_C_MAX}: small-C direct conv{unused}; wgmma: {why}"
        return ConvChoice("direct", conv.smallc_entry, reason)
    impl = "mma.sync" if dtype_name(p.dtype) == "float16" else "simt"
    if tuned:
        return ConvChoice(impl, tuned, f"tuned (dualtrack tune); wgmma: {why}")
    return ConvChoice(impl, conv.variant(p.dtype, p.N, p.H, p.W, p.C, p.K), f"heuristic; wgmma: {why}")
