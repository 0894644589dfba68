"""Numeric checks of computed outputs against a reference: the one implementation the build's
verification (compiler/verify.py, against onnxruntime) and a runtime's first-load check
(runtime/selfcheck.py, against the reference cases the build stored) share.

Pure numpy: a serving process imports it without the compiler's dependencies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from dualtrack.errors import VerificationError

# The image wrap's outputs (compiler/frontend.py adds them): a class-id mask decided from the probabilities.
MASK, PROBS = "mask", "probs"


@dataclass(frozen=True)
class Tolerance:
    """Per-output limits. ``max_abs`` scales with the output: an output passes when
    ``max|got - ref| <= max_abs * max(1, max|ref|)``, so logits that reach 1e4 are held to the same
    relative standard as probabilities in [0, 1] (an absolute bound would fail exact results there).
    ``mismatch`` is the fraction of integer outputs (class ids) allowed to differ.

    A stdlib dataclass, not a pydantic model, so the runtime needs no pydantic; the build config
    (compiler/config.py) validates it through pydantic all the same (unknown keys are refused)."""

    __pydantic_config__ = {"extra": "forbid"}  # noqa: RUF012 (pydantic reads it; never mutated)

    rel_l2: float
    max_abs: float
    mismatch: float

    def __post_init__(self) -> None:
        for name in ("rel_l2", "max_abs"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")
        if not self.mismatch >= 0:
            raise ValueError(f"mismatch must be >= 0, not {self.mismatch}")

    def to_json(self) -> dict[str, float]:
        return asdict(self)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    # fp16, against the same weights computed in fp32 (verify.upcast): each fp16 op rounds its output,
    # so a probability near 0.5 moves by up to 0.07 on LR-ASPP (IREE and onnxruntime's fp16 alike; logits
    # of O(10)); max_abs 0.15 keeps twice that, and a wrong tile (errors of 0.5 and more) still fails.
    # argmax may flip where two classes are within rounding.
    "fp16": Tolerance(rel_l2=2e-2, max_abs=0.15, mismatch=5e-3),
    "fp32": Tolerance(rel_l2=1e-4, max_abs=1e-3, mismatch=1e-4),
}


@dataclass(frozen=True)
class Check:
    name: str
    rel_l2: float
    max_abs: float
    mismatch: float
    nonfinite: int
    passed: bool
    note: str = ""
    integer: bool = False


REL_L2_MIN_ELEMENTS = 16  # fewer values: the scaled max-abs bound alone (see compare)


def compare(name: str, ref: np.ndarray, got: np.ndarray, tol: Tolerance, note: str = "") -> Check:
    """Relative L2 and max-abs error for floats; the fraction of differing elements for integers.

    The max-abs bound scales with the output (:class:`Tolerance`): a float output passes when
    rel_l2 <= tol.rel_l2 and max|got - ref| <= tol.max_abs * max(1, max|ref|).
    ``Check.max_abs`` reports that scaled difference, max|got - ref| / max(1, max|ref|).
    """
    if ref.shape != got.shape:
        return Check(name, float("inf"), float("inf"), 1.0, 0, False, f"shape {got.shape} != reference {ref.shape}")
    if np.issubdtype(ref.dtype, np.integer):
        mism = float(np.mean(ref != got)) if ref.size else 0.0
        return Check(name, 0.0, 0.0, mism, 0, mism <= tol.mismatch, note, integer=True)
    r, g = ref.astype(np.float64), got.astype(np.float64)
    # A non-finite value where the reference has the same one (the log of a negative input: NaN in both)
    # agrees with it; only the others are wrong results.
    agree = (np.isnan(r) & np.isnan(g)) | (np.isinf(r) & (r == g))
    if agree.any():
        r, g = r[~agree], g[~agree]
    nonfinite = int(np.count_nonzero(~np.isfinite(g)))
    diff = g - r
    rel = float(np.linalg.norm(diff) / max(np.linalg.norm(r), 1e-30)) if nonfinite == 0 else float("inf")
    scale = max(1.0, float(np.max(np.abs(r)))) if r.size and np.isfinite(r).all() else 1.0
    mx = (
        float(np.max(np.abs(diff))) / scale
        if diff.size and nonfinite == 0
        else (0.0 if not diff.size else float("inf"))
    )
    # A relative L2 over a handful of values is one value's relative error, which fp16 arithmetic on a
    # few long reductions (IREE's CPU code for a pooled 1x1 map) moves by percents: there the scaled
    # max-abs bound alone decides, and the note says so.
    few = r.size < REL_L2_MIN_ELEMENTS
    if few:
        note = f"{note}; " if note else ""
        note += f"{r.size} value(s): rel_l2 not judged"
    passed = nonfinite == 0 and (few or rel <= tol.rel_l2) and mx <= tol.max_abs
    return Check(name, rel, mx, 0.0, nonfinite, passed, note)


def top2_margin(probs: np.ndarray) -> np.ndarray:
    """Each pixel's distance from a tie of ``probs`` (N, C, H, W): the top class's probability less
    the runner-up's; with one class (a sigmoid), |2p - 1|, the distance from 0.5."""
    p = probs.astype(np.float64)
    if p.shape[1] == 1:
        return np.abs(2 * p[:, 0] - 1)
    top = np.sort(p, axis=1)
    return top[:, -1] - top[:, -2]


def decided_pixels(margin: np.ndarray, err: float, tol: Tolerance) -> np.ndarray:
    """The mask pixels whose class rounding cannot flip: a reference margin beyond twice the
    measured probability error ``err``. Only an error the probs check accepts can excuse a flip:
    beyond it, every pixel counts."""
    return margin > 2 * err if err <= tol.max_abs else np.ones(margin.shape, bool)


def compare_mask(name: str, ref: np.ndarray, got: np.ndarray, decided: np.ndarray, tol: Tolerance) -> Check:
    """A class-id mask compared where the class is decided (:func:`decided_pixels`); the pixels
    left out are counted in the note."""
    if ref.shape != decided.shape or np.shape(got) != ref.shape:
        return compare(name, ref, np.asarray(got), tol)
    undecided = int(decided.size - np.count_nonzero(decided))
    note = f"{undecided} of {decided.size} pixels within rounding of a tie left out" if undecided else ""
    return compare(name, ref[decided], np.asarray(got)[decided], tol, note)


def compare_outputs(
    where: str, tag: str, ref: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], tol: Tolerance
) -> list[Check]:
    """One check per output of ``got``. A class-id ``mask`` computed beside its ``probs`` (the image
    wrap's outputs) is compared where the class is decided: a pixel whose reference top two classes
    are within twice the measured probability error can flip by rounding alone, so it is left out
    (and counted in the note); anywhere else a different class is a mismatch. A probability error
    beyond the tolerance excuses nothing: then every pixel is compared."""
    decided = None
    if MASK in got and PROBS in got and ref[PROBS].ndim == 4 and ref[PROBS].shape == got[PROBS].shape:
        p_ref = ref[PROBS].astype(np.float64)
        err = float(np.max(np.abs(got[PROBS].astype(np.float64) - p_ref))) if p_ref.size else 0.0
        decided = decided_pixels(top2_margin(p_ref), err, tol)
    checks = []
    for name in got:
        if name == MASK and decided is not None:
            checks.append(compare_mask(f"{where} {name} {tag}", ref[name], got[name], decided, tol))
        else:
            checks.append(compare(f"{where} {name} {tag}", ref[name], got[name], tol))
    return checks


@dataclass
class Report:
    device: str
    precision: str
    tolerance: Tolerance
    checks: list[Check]
    seed: int

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "precision": self.precision,
            "tolerance": self.tolerance.to_json(),
            "seed": self.seed,
            "passed": self.passed,
            "checks": [asdict(c) for c in self.checks],
        }

    def lines(self) -> list[str]:
        return [self.line(c) for c in self.checks]

    @staticmethod
    def line(c: Check) -> str:
        what = f"mismatch {c.mismatch:.2e}" if c.integer else f"rel_l2 {c.rel_l2:.2e} max_abs {c.max_abs:.2e}"
        return f"{'ok  ' if c.passed else 'FAIL'} {c.name:<44} {what}{'  ' + c.note if c.note else ''}"

    def raise_if_failed(self) -> None:
        if not self.passed:
            bad = [c for c in self.checks if not c.passed]
            first = bad[0]
            raise VerificationError(
                f"{len(bad)} of {len(self.checks)} checks exceed the {self.precision} tolerance "
                f"(rel_l2 {self.tolerance.rel_l2:g}, max_abs {self.tolerance.max_abs:g} scaled, "
                f"mismatch {self.tolerance.mismatch:g}); "
                f"first: {first.name} rel_l2 {first.rel_l2:.3g} max_abs {first.max_abs:.3g} "
                f"mismatch {first.mismatch:.3g}"
                f"{' (' + first.note + ')' if first.note else ''}; {self.fix(bad)}",
                detail="\n".join(self.lines()),
            )

    def fix(self, bad: list[Check]) -> str:
        """The config key that sets the tolerance, with values the failed checks would pass at (a
        quarter more than they measured), where the failures are finite: an error that is rounding
        alone (a deep fp16 network) is accepted there; NaN or infinity never is."""
        if any(c.nonfinite or not (np.isfinite(c.rel_l2) and np.isfinite(c.max_abs)) for c in bad):
            why = "non-finite outputs are a wrong result: no tolerance accepts them"
            if self.precision in ("fp16", "fp8"):  # fp16's range ends at 65504: a sum or a product overflowed
                return f"{why}; the {self.precision} build overflows on these inputs: set `precision: fp32`"
            return why
        t = self.tolerance
        want = Tolerance(
            rel_l2=float(f"{max(t.rel_l2, *(1.25 * c.rel_l2 for c in bad)):.2g}"),
            max_abs=float(f"{max(t.max_abs, *(1.25 * c.max_abs for c in bad)):.2g}"),
            mismatch=float(f"{max(t.mismatch, *(1.25 * c.mismatch for c in bad)):.2g}"),
        )
        return (
            f"if that is rounding, set `verify: {{tolerance: {{rel_l2: {want.rel_l2:g}, max_abs: {want.max_abs:g}, "
            f"mismatch: {want.mismatch:g}}}}}` in the config and rebuild"
            + (", or build with `precision: fp32`" if self.precision == "fp16" else "")
        )


__all__ = [
    "DEFAULT_TOLERANCES",
    "MASK",
    "PROBS",
    "Check",
    "Report",
    "Tolerance",
    "compare",
    "compare_mask",
    "compare_outputs",
    "decided_pixels",
    "top2_margin",
]
