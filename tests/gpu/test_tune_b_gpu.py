"""IREE flag search on the GPU: every candidate is verified before it is timed.

The kit (compiled modules) comes from DUALTRACK_TEST_KIT on GPU machines without the IREE compiler,
else it is prepared here from the tiny config.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from dualtrack.compiler.config import Tolerance
from dualtrack.tuning import iree_flags as tune_b


@pytest.fixture(scope="module")
def kit(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> tune_b.Kit:
    prebuilt = os.environ.get("DUALTRACK_TEST_KIT")
    if prebuilt:
        return tune_b.Kit.open(prebuilt)
    return tune_b.prepare_kit(tiny_config, tmp_path_factory.mktemp("kit") / "kit")


def test_every_segment_and_batch_gets_a_verified_winner(kit: tune_b.Kit) -> None:
    gpu, results = tune_b.time_kit(kit, iters=5, warmup=1)
    assert gpu["gpu"] and gpu["driver"] >= 13000
    assert {(r.segment, r.batch) for r in results} == {(s.name, b) for s in kit.segments for b in kit.batch_sizes}
    for r in results:
        assert r.baseline is not None and r.baseline.passed, r
        assert r.winner is not None and r.winner.time_ms <= r.baseline.time_ms
        for c in r.results:
            if c.passed:
                assert c.time_ms > 0 and c.rel_l2 <= kit.tolerance.rel_l2
            else:
                assert c.time_ms is None and c.reason


def test_a_candidate_that_fails_verification_is_never_timed(kit: tune_b.Kit) -> None:
    strict = replace(kit, tolerance=Tolerance(rel_l2=1e-12, max_abs=1e-12, mismatch=0.0))
    _, results = tune_b.time_kit(strict, iters=2, warmup=0)
    floats = [r for r in results if any(c.rel_l2 for c in r.results)]
    assert floats, "some segment has float outputs with a nonzero error"
    for r in floats:
        assert all(not c.passed and c.time_ms is None for c in r.results if c.rel_l2), r
