"""runtime/selfcheck.py: a bundle's first load on a device checks it once, records it, and refuses a failure.

Run here on the CPU engine (the check is the one a GPU load runs: the bundle's reference cases, no
onnxruntime; tests/gpu load through it). tests/test_layering.py checks the reference cases themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualtrack.contract.checks import Check, Report
from dualtrack.errors import VerificationError
from dualtrack.runtime.engine import Engine
from dualtrack.runtime.selfcheck import GpuCheckError, check_cases, record_path, self_check


def test_the_first_load_checks_and_later_ones_read_the_record(tiny_bundle: Path, tmp_path: Path) -> None:
    calls = []

    def counted(engine):
        calls.append(engine)
        return check_cases(engine)

    with Engine.load(tiny_bundle, "cpu") as engine:
        first = self_check(engine, "Some GPU cc9.0", tmp_path, check=counted)
        again = self_check(engine, "Some GPU cc9.0", tmp_path, check=counted)
        self_check(engine, "Other GPU cc8.0", tmp_path, check=counted)  # another device checks again
    assert first["passed"] is True and again == first
    assert len(calls) == 2
    record = record_path(tmp_path, engine.bundle.manifest.build_key, "Some GPU cc9.0")
    checks = json.loads(record.read_text())["checks"]
    assert record.parent.name == "verified"
    assert {c["name"].split()[1] for c in checks} == {f"b{b}" for b in engine.plan.batch_sizes}


def test_a_device_that_computes_wrong_results_is_refused_every_time(tiny_bundle: Path, tmp_path: Path) -> None:
    def wrong(engine):
        good = check_cases(engine)
        bad = Check("plan b1 probs", 0.9, 0.8, 0.0, 0, False)
        return Report(good.device, good.precision, good.tolerance, [*good.checks, bad], good.seed)

    with Engine.load(tiny_bundle, "cpu") as engine:
        for _ in range(2):  # a failed record is not a pass: the next load checks again
            with pytest.raises(
                VerificationError,
                match=r"computes wrong results on Bad GPU: 1 of \d+ checks exceed .*first: plan b1 probs "
                r".*dualtrack verify BUNDLE --device cuda.*DUALTRACK_GPU_SELF_CHECK=0",
            ):
                self_check(engine, "Bad GPU", tmp_path, check=wrong)
    assert json.loads(record_path(tmp_path, engine.bundle.manifest.build_key, "Bad GPU").read_text())["passed"] is False


def test_a_refusal_keeps_what_it_measured(tiny_bundle: Path, tmp_path: Path) -> None:
    def wrong(engine):
        good = check_cases(engine)
        bad = [Check("plan b1 probs", 1.05, 1.0, 0.0, 0, False), Check("plan b1 mask", 0, 0, 0.5, 0, False, "", True)]
        return Report(good.device, good.precision, good.tolerance, [*good.checks, *bad], good.seed)

    with Engine.load(tiny_bundle, "cpu") as engine, pytest.raises(GpuCheckError) as err:
        self_check(engine, "Bad GPU", tmp_path, check=wrong)
    assert isinstance(err.value, VerificationError)  # the same exit code as any verification failure
    failed = [c for c in err.value.record["checks"] if not c["passed"]]
    assert [c["rel_l2"] for c in failed] == [1.05, 0]  # what the check measured travels with the refusal
    assert failed[1]["mismatch"] == 0.5
