"""bench/segment_trace.py on the CPU: the tiny bundle's segments agree with onnxruntime on their own inputs,
and a segment made to compute wrong is the one the trace flags (those before it are not), with the
batch row it is wrong in."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import segment_trace

from dualtrack.runtime import engine as engine_mod


def _rows(result: dict, batch: int) -> list[dict]:
    return [r for r in result["batches"][str(batch)] if r["segment"] not in ("whole_plan_vs_chain", "self_check")]


def test_a_correct_bundle_has_no_suspect_segment(tiny_bundle: Path) -> None:
    result = segment_trace.trace(str(tiny_bundle), [2], "cpu")
    rows = _rows(result, 2)
    assert rows and not any(segment_trace.suspect(r) or r["clobbered"] for r in rows), rows
    checks = [r for r in result["batches"]["2"] if r["segment"] == "self_check"]
    assert checks and all(r["passed"] for r in checks)


def test_the_segment_that_computes_wrong_is_the_one_flagged(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = engine_mod.CpuBackend.run_segment
    from dualtrack.contract.bundle import Bundle

    segments = Bundle.open(tiny_bundle).plan.segments
    assert len(segments) >= 2
    bad = segments[len(segments) // 2].name

    def wrong_in_row_1(self, seg, batch, inputs):
        out = original(self, seg, batch, inputs)
        if seg.name != bad:
            return out
        changed = {}
        for k, v in out.items():
            a = np.array(self.to_host(v), copy=True)
            a[1] = a[1] * 1.5 + 1.0  # row 1 only: the cases' second image
            changed[k] = self.from_host(a)
        return changed

    monkeypatch.setattr(engine_mod.CpuBackend, "run_segment", wrong_in_row_1)
    rows = _rows(segment_trace.trace(str(tiny_bundle), [2], "cpu"), 2)
    flagged = [r["segment"] for r in rows if segment_trace.suspect(r)]
    assert flagged and flagged[0] == bad, rows
    assert all(r["worst_row"] == 1 for r in rows if r["segment"] == bad)
