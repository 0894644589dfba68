"""Reference cases: a few model inputs and onnxruntime's outputs for them, stored in the bundle by
the build (compiler/verify.py computes them) so that a runtime can check what a device computes
without onnxruntime (runtime/selfcheck.py).

The file (``verify/cases.npz``, hashed in the manifest like every bundle file) holds K images and,
per plan output, each image's reference:

- an integer output (the class mask) whole;
- a float output whole when it has at most :data:`FULL_MAX` elements per image, else a strided
  sample of its flat elements (:func:`sample_stride`: about :data:`SAMPLE` kept, the stride coprime
  with the last dimension so every row and column is visited);
- beside a mask and its probabilities, each pixel's reference top-2 margin (float16), so that the
  tie rule of :func:`dualtrack.contract.checks.compare_outputs` applies: a mask pixel within twice
  the measured probability error of a tie is left out. With sampled probabilities that error is
  the sample's.

A check at batch ``b`` runs the K images tiled over the b rows (row i is image i mod K) and compares
every row with its image's reference.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dualtrack.contract.checks import MASK, PROBS, Check, Tolerance, compare, compare_mask, decided_pixels, top2_margin
from dualtrack.contract.plan import TensorSpec
from dualtrack.errors import BundleError

FULL_MAX = 1 << 20  # float elements per image kept whole
SAMPLE = 1 << 18  # about this many kept of a larger float output


def sample_stride(shape: Sequence[int], dtype: str) -> int:
    """1 for an output stored whole (integers, and floats of at most FULL_MAX elements per image);
    else the stride of its flat sample, the smallest >= size / SAMPLE coprime with ``shape[-1]``."""
    size = math.prod(shape)
    if np.issubdtype(np.dtype(dtype), np.integer) or size <= FULL_MAX:
        return 1
    stride = -(-size // SAMPLE)
    while math.gcd(stride, int(shape[-1])) != 1:
        stride += 1
    return stride


def _rows(arr: np.ndarray, stride: int) -> np.ndarray:
    """Each row's stored part: the whole row, or its flat elements 0, stride, 2 * stride, ..."""
    return arr if stride == 1 else np.ascontiguousarray(arr.reshape(arr.shape[0], -1)[:, ::stride])


def _stored(arr: np.ndarray) -> np.ndarray:
    """Integers as they are; floats in float32 (the reference's precision, whatever the engine's)."""
    return arr if np.issubdtype(arr.dtype, np.integer) else arr.astype(np.float32)


@dataclass(frozen=True)
class ReferenceCases:
    """K model inputs (``inputs``, one row each) and their stored reference outputs."""

    seed: int
    inputs: np.ndarray
    outputs: Mapping[str, np.ndarray]  # name -> (K, ...) whole, or (K, n) sampled
    strides: Mapping[str, int]
    margin: np.ndarray | None = None  # (K, H, W) float16: the reference top-2 margin of each pixel

    @classmethod
    def from_reference(
        cls, seed: int, inputs: np.ndarray, specs: Sequence[TensorSpec], ref: Mapping[str, np.ndarray]
    ) -> ReferenceCases:
        """What to store of the reference outputs ``ref`` (name -> (K, ...)) of ``inputs``."""
        strides = {s.name: sample_stride(s.at_batch(1)[1:], s.dtype) for s in specs}
        outputs = {s.name: _rows(_stored(np.asarray(ref[s.name])), strides[s.name]) for s in specs}
        margin = None
        if MASK in ref and PROBS in ref and np.ndim(ref[PROBS]) == 4:
            margin = top2_margin(np.asarray(ref[PROBS])).astype(np.float16)
        return cls(seed, inputs, outputs, strides, margin)

    def to_bytes(self) -> bytes:
        names = list(self.outputs)
        arrays = {"seed": np.int64(self.seed), "inputs": self.inputs, "names": np.array(names, dtype=str)}
        for i, name in enumerate(names):
            arrays[f"out{i}"] = self.outputs[name]
            arrays[f"stride{i}"] = np.int64(self.strides[name])
        if self.margin is not None:
            arrays["margin"] = self.margin
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def load(cls, path: Path) -> ReferenceCases:
        try:
            with np.load(path, allow_pickle=False) as z:
                names = [str(n) for n in z["names"]]
                return cls(
                    int(z["seed"]),
                    z["inputs"],
                    {n: z[f"out{i}"] for i, n in enumerate(names)},
                    {n: int(z[f"stride{i}"]) for i, n in enumerate(names)},
                    z["margin"] if "margin" in z.files else None,
                )
        except (OSError, KeyError, ValueError) as e:
            raise BundleError(
                f"{path}: unreadable reference cases ({type(e).__name__}: {e}); rebuild the bundle"
            ) from None

    def batch(self, b: int) -> np.ndarray:
        """The input of a check at batch ``b``: the K images tiled over the rows."""
        return np.ascontiguousarray(self.inputs[np.arange(b) % len(self.inputs)])

    def check(self, got: Mapping[str, np.ndarray], b: int, tol: Tolerance, where: str) -> list[Check]:
        """One check per stored output of the batch-``b`` result ``got`` of :meth:`batch` ``(b)``."""
        rows = np.arange(b) % len(self.inputs)
        ref = {n: out[rows] for n, out in self.outputs.items()}
        mine = {n: _rows(np.asarray(got[n]), self.strides[n]) for n in self.outputs if n in got}
        decided = None
        if self.margin is not None and MASK in mine and PROBS in mine and mine[PROBS].shape == ref[PROBS].shape:
            diff = np.abs(mine[PROBS].astype(np.float64) - ref[PROBS].astype(np.float64))
            decided = decided_pixels(self.margin[rows].astype(np.float64), float(np.max(diff, initial=0.0)), tol)
        checks = []
        for name, want in ref.items():
            label = f"{where} {name}" + (f" (1 in {self.strides[name]} sampled)" if self.strides[name] > 1 else "")
            if name not in mine:
                checks.append(Check(label, float("inf"), float("inf"), 1.0, 0, False, "output missing"))
            elif name == MASK and decided is not None:
                checks.append(compare_mask(label, want, mine[name], decided, tol))
            else:
                checks.append(compare(label, want, mine[name], tol))
        return checks

    def check_whole(self, got: Mapping[str, np.ndarray], tol: Tolerance, where: str) -> list[Check]:
        """A fixed-shape plan's check: its one case (``inputs``, no rows of images) run whole, every
        stored output compared whole with the result ``got``."""
        checks = []
        for name, want in self.outputs.items():
            label = f"{where} {name}" + (f" (1 in {self.strides[name]} sampled)" if self.strides[name] > 1 else "")
            if name not in got:
                checks.append(Check(label, float("inf"), float("inf"), 1.0, 0, False, "output missing"))
            else:
                checks.append(compare(label, want, _rows(np.asarray(got[name]), self.strides[name]), tol))
        return checks


__all__ = ["FULL_MAX", "SAMPLE", "ReferenceCases", "sample_stride"]
