"""A bundle's precision record (``precision.json``): each convolution's precision and why, as the
fp8 build chose it (compiler/fp8.py, docs/fp8.md), and the mask agreement it was verified at.

Plain data with a JSON form, like the manifest: the build writes it, `dualtrack info` reads it. A
bundle built without ``precision: fp8`` has none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PRECISION_FILE = "precision.json"
FP8_OPS = frozenset({"quantize_fp8", "conv_fp8"})  # the plan ops an fp8 lowering adds (docs/fp8.md)


@dataclass(frozen=True)
class LayerPrecision:
    """One convolution: its ONNX node, the fp16 kernel op it lowered to, the precision it runs in and
    why; for a calibrated one, its input's scale and its fp8 output's relative L2 error against fp16."""

    layer: str
    op: str
    precision: str  # "fp8" or "fp16"
    reason: str
    x_scale: float | None = None
    error: float | None = None

    def line(self) -> str:
        scale = f", x_scale {self.x_scale:.4g}" if self.x_scale is not None else ""
        return f"{self.layer} ({self.op}): {self.precision}: {self.reason}{scale}"


@dataclass(frozen=True)
class Agreement:
    """Mask agreement (% of pixels with the same class) on one set of images: the fp8 plan against
    fp32 onnxruntime and against the fp16 plan, and the fp16 plan against fp32 for scale."""

    images: str  # "calibration" or "held-out"
    count: int
    vs_fp32: float
    vs_fp16: float
    fp16_vs_fp32: float

    def line(self) -> str:
        return (
            f"{self.images} ({self.count} images): fp8 vs fp32 {self.vs_fp32:.3f}%, fp8 vs fp16 {self.vs_fp16:.3f}% "
            f"(fp16 vs fp32 {self.fp16_vs_fp32:.3f}%)"
        )


@dataclass(frozen=True)
class PrecisionRecord:
    """What ``precision: fp8`` made of the plan: ``applied`` False (with its ``note``) where the
    targets cannot run fp8 and the bundle is fp16; otherwise every convolution's choice."""

    requested: str
    applied: bool
    note: str
    calibration: Mapping[str, Any]  # method, percentile, where the images came from, counts
    layers: tuple[LayerPrecision, ...] = ()
    agreement: tuple[Agreement, ...] = ()
    floor: float = 0.0  # the configured agreement floor (% of pixels, against fp32)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrecisionRecord:
        return cls(
            requested=d["requested"],
            applied=bool(d["applied"]),
            note=d.get("note", ""),
            calibration=dict(d.get("calibration", {})),
            layers=tuple(LayerPrecision(**x) for x in d.get("layers", ())),
            agreement=tuple(Agreement(**x) for x in d.get("agreement", ())),
            floor=float(d.get("floor", 0.0)),
        )

    @classmethod
    def read(cls, root: str | Path) -> PrecisionRecord | None:
        """The record in a bundle's folder, or None (a bundle built without ``precision: fp8``)."""
        path = Path(root) / PRECISION_FILE
        return cls.from_json(json.loads(path.read_text())) if path.exists() else None

    def headline(self) -> str:
        """One line: how many convolutions run fp8 and the masks' agreement with fp32 (or the note)."""
        if not self.applied:
            return self.note
        fp8 = sum(x.precision == "fp8" for x in self.layers)
        agree = ", ".join(f"{a.vs_fp32:.3f}% ({a.images})" for a in self.agreement)
        return f"{self.requested}: {fp8} of {len(self.layers)} convolutions in fp8; masks as fp32's on {agree}"

    def lines(self) -> list[str]:
        """`dualtrack info`'s lines: the outcome, the calibration, each layer, the agreement."""
        cal = ", ".join(f"{k} {v}" for k, v in self.calibration.items())
        out = [self.headline(), *([f"calibration {cal}"] if cal else [])]
        out += [x.line() for x in self.layers]
        out += [f"agreement {a.line()} (floor {self.floor:g}%)" for a in self.agreement]
        return out


__all__ = ["FP8_OPS", "PRECISION_FILE", "Agreement", "LayerPrecision", "PrecisionRecord"]
