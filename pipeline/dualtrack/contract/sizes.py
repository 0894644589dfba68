"""The input sizes of a bundle: which sizes a range compiles, which compiled size an image runs at,
and how it is padded there and cropped back. One module, read by the build (the config's ``sizes``),
the engine (:meth:`dualtrack.runtime.engine.Engine.run`) and the image I/O (:mod:`dualtrack.imaging`).

**The range rule** (``sizes: {min, opt, max}``, like a TensorRT optimization profile): the build
compiles ``min``, ``opt``, ``max``, and between ``opt`` and ``max`` each dim doubled from ``opt``
(``opt x 2``, ``opt x 4``, ...) capped at ``max``'s, while smaller than ``max``. Doubling keeps
whatever divisibility ``opt`` has (a network with five stride-2 stages wants multiples of 32), and
the padded pixels an image between two rungs costs are at most 3/4 of the rung.

**The choice rule** (:func:`choose`): an image of ``h x w`` runs at the compiled size of least area
whose both dims hold it (ties: the smaller height). An image larger than every compiled size in
either dim does not fit: :data:`RESIZE` (resized to the largest size, the one-size path) or, where
the bundle has a sliding window configured, :data:`WINDOW`.

**Pad and crop** (:func:`pad_to`, :func:`crop_to`): the image is padded at the bottom and right by
repeating its edge pixels (``numpy.pad(mode="edge")``) and every output is cropped back to
``[:h, :w]``, so the mask is at the image's own size with no resampling. Edge rather than zero:
a zero pixel is a black border that the network never saw in training (after the model's
normalisation it is ``-mean/std``, not zero), and the predictions near it bend towards it; a
repeated edge continues what the image shows. Either way, output pixels within the network's
receptive field of the padding can differ from a run of the same network at the image's own
size (what a convolution reads past the edge differs); pixels farther from the padding than the
receptive field are the same. The cropped result is exactly the network run on the padded image,
cropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Size = tuple[int, int]  # (height, width)
FITS, RESIZE, WINDOW = "fits", "resize", "window"
PAD_MODE = "edge"  # numpy.pad's mode for the pad rule (module docstring)


def range_sizes(lo: Size, opt: Size, hi: Size) -> tuple[Size, ...]:
    """The sizes a ``{min, opt, max}`` range compiles (the range rule), sorted by area."""
    out = {lo, opt, hi}
    h, w = opt
    while (h, w) != hi:
        h, w = min(2 * h, hi[0]), min(2 * w, hi[1])
        out.add((h, w))
    return sorted_sizes(out)


def sorted_sizes(sizes: Iterable[Size]) -> tuple[Size, ...]:
    """Distinct sizes in the order :func:`choose` tries them: least area first, then least height."""
    return tuple(sorted(set(sizes), key=lambda s: (s[0] * s[1], s[0], s[1])))


@dataclass(frozen=True)
class Choice:
    """How an image of ``image`` runs: at ``size`` padded (``fits``), resized to ``size`` (``resize``),
    or through a sliding window of ``size`` (``window``)."""

    mode: Literal["fits", "resize", "window"]
    size: Size
    image: Size

    @property
    def padded(self) -> bool:
        return self.mode == FITS and self.size != self.image


def choose(image: Size, sizes: Sequence[Size], *, window: bool = False) -> Choice:
    """The one decision between "fits", "resize" and "window" (the choice rule, module docstring).

    ``sizes``: the bundle's compiled sizes (any order); ``window``: the bundle has a sliding window
    configured (images larger than every size then go through it instead of being resized)."""
    ordered = sorted_sizes(sizes)
    for s in ordered:
        if image[0] <= s[0] and image[1] <= s[1]:
            return Choice(FITS, s, image)
    return Choice(WINDOW if window else RESIZE, ordered[-1], image)


def pad_to(x: np.ndarray, size: Size) -> np.ndarray:
    """A batch of NHWC images ``x`` padded at the bottom and right to ``size`` by :data:`PAD_MODE`."""
    dh, dw = size[0] - x.shape[1], size[1] - x.shape[2]
    if dh < 0 or dw < 0:
        raise ValueError(f"{x.shape[1]}x{x.shape[2]} images do not fit {size[0]}x{size[1]}")
    if dh == 0 and dw == 0:
        return x
    return np.pad(x, ((0, 0), (0, dh), (0, dw), (0, 0)), mode=PAD_MODE)


def crop_to(y: np.ndarray, size: Size, image: Size) -> np.ndarray:
    """An output computed at ``size`` cropped back to ``image``: its last two dims are the image's
    height and width (the build checks every output has them: ``mask`` (n, H, W), ``probs`` (n, C, H, W))."""
    if tuple(y.shape[-2:]) != tuple(size):
        raise ValueError(f"output of shape {y.shape} does not end in the compiled size {size}")
    return y[..., : image[0], : image[1]]


def label(size: Size) -> str:
    """``HxW``: how a size is named in the bundle's paths and messages."""
    return f"{size[0]}x{size[1]}"


__all__ = ["FITS", "PAD_MODE", "RESIZE", "WINDOW", "Choice", "Size", "choose", "crop_to", "label", "pad_to"]
