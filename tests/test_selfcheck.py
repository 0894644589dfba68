"""runtime/selfcheck.py: a bundle's first load on a device verifies it once, records it, and refuses a failure.

Run here on the CPU engine (the check is the same verification a GPU load runs; tests/gpu load through it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualtrack.compiler.verify import Check, Report, verify_engine
from dualtrack.errors import VerificationError
from dualtrack.runtime.engine import Engine
from dualtrack.runtime.selfcheck import GpuCheckError, record_path, self_check


def test_the_first_load_verifies_and_later_ones_read_the_record(tiny_bundle: Path, tmp_path: Path) -> None:
    calls = []

    def counted(engine, **kw):
        calls.append(kw)
        return verify_engine(engine, **kw)

    with Engine.load(tiny_bundle, "cpu") as engine:
        first = self_check(engine, "Some GPU cc9.0", tmp_path, verify=counted)
        again = self_check(engine, "Some GPU cc9.0", tmp_path, verify=counted)
        self_check(engine, "Other GPU cc8.0", tmp_path, verify=counted)  # another device checks again
    assert first["passed"] is True and again == first
    assert len(calls) == 2 and calls[0]["interpret"] is False and calls[0]["samples"] == 1
    record = record_path(tmp_path, engine.bundle.manifest.build_key, "Some GPU cc9.0")
    assert json.loads(record.read_text())["checks"] and record.parent.name == "verified"


def test_a_device_that_computes_wrong_results_is_refused_every_time(tiny_bundle: Path, tmp_path: Path) -> None:
    def wrong(engine, **kw):
        good = verify_engine(engine, **kw)
        bad = Check("plan b1 probs #0", 0.9, 0.8, 0.0, 0, False)
        return Report(good.device, good.precision, good.tolerance, [*good.checks, bad], good.seed)

    with Engine.load(tiny_bundle, "cpu") as engine:
        for _ in range(2):  # a failed record is not a pass: the next load checks again
            with pytest.raises(
                VerificationError,
                match=r"computes wrong results on Bad GPU: 1 of \d+ checks exceed .*first: plan b1 probs #0 "
                r".*DUALTRACK_GPU_SELF_CHECK=0",
            ):
                self_check(engine, "Bad GPU", tmp_path, verify=wrong)
    assert json.loads(record_path(tmp_path, engine.bundle.manifest.build_key, "Bad GPU").read_text())["passed"] is False


def test_a_refusal_names_the_failing_module_and_its_flags_and_keeps_what_it_measured(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    with Engine.load(tiny_bundle, "cpu") as engine:
        plan = engine.bundle.manifest.plan
        seg = next(s for s in plan.segments if s.track == "B")
        batch = engine.bundle.manifest.cpu_batch
        module = engine.bundle.manifest.artifacts.iree[seg.name]["llvm-cpu"][str(batch)]

        def wrong(engine, **kw):
            good = verify_engine(engine, **kw)
            bad = [
                Check(f"{seg.name}[llvm-cpu] probs #0", 1.05, 1.0, 0.0, 0, False),
                Check("plan b1 x", 2, 1, 0, 0, False),
            ]
            return Report(good.device, good.precision, good.tolerance, [*good.checks, *bad], good.seed)

        with pytest.raises(GpuCheckError) as err:
            self_check(engine, "Bad GPU", tmp_path, verify=wrong)
    assert f"(failing module: {module} (IREE flags: " in err.value.message
    assert isinstance(err.value, VerificationError)  # the same exit code as any verification failure
    failed = [c for c in err.value.record["checks"] if not c["passed"]]
    assert [c["rel_l2"] for c in failed] == [1.05, 2]  # what the check measured travels with the refusal
