"""The cost model's rates table (pipeline/dualtrack/compiler/rates.json): one row per device class,
validated on load, picked by the build's first target; bench/measure_rates.py writes rows it accepts."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from dualtrack.compiler import cost
from dualtrack.errors import ConfigError
from dualtrack.kernels.device import DEVICES, for_target

TABLE: dict[str, Any] = json.loads(cost.RATES_FILE.read_text())


def test_the_h200_row_is_the_measured_model_the_partition_always_used() -> None:
    r = cost.rates_for_target("sm_90a")
    assert (r.device, r.status) == ("h200", "measured") and r is cost.DEFAULT_RATES
    assert (r.track_a, r.track_a_conv, r.track_a_simt, r.track_b) == (
        cost.TrackRates(300.0, 2.5, 3.0),
        cost.TrackRates(140.0, 2.5, 3.0),
        cost.TrackRates(33.0, 2.5, 3.0),
        cost.TrackRates(41.0, 1.0, 10.0),
    )


@pytest.mark.parametrize(
    ("target", "row"), [("h100", "h100"), ("sm_120", "sm_120"), ("sm_80", "sm_80"), ("sm_89", "sm_80"), (None, "h200")]
)
def test_a_target_picks_its_device_class_row(target: str | None, row: str) -> None:
    r = cost.rates_for_target(target)
    assert r.device == row and (r.status == "measured") == (row in ("h200", "h100")) and r.basis


def test_every_table_device_has_a_row() -> None:
    rows = cost.load_rates()
    assert {d.key for d in DEVICES.values()} <= set(rows)


def _bad(mutate: Any) -> str:
    doc = copy.deepcopy(TABLE)
    mutate(doc)
    with pytest.raises(ConfigError) as err:
        cost.parse_rates(doc, "rates.json")
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_bad_rates_table_is_one_line_naming_the_row_and_field() -> None:
    assert _bad(lambda d: d["rows"]["h100"]["track_a"].update(tflops=-1)) == (
        "rates.json: row 'h100' track_a.tflops = -1 must be a positive number; fix it or rerun bench/measure_rates.py"
    )
    assert "track_b must have exactly tflops, tbps, launch_us" in _bad(lambda d: d["rows"]["h200"].pop("track_b"))
    assert "needs status 'measured' or 'estimate'" in _bad(lambda d: d["rows"]["sm_80"].update(status="guess"))
    assert "covers 'h200', which row 'h200' covers too" in _bad(lambda d: d["rows"]["h100"].update(covers=["h200"]))
    assert "has no 'rows' object" in _bad(lambda d: d.pop("rows"))


def test_an_unreadable_file_and_an_unknown_device_class_are_config_errors(tmp_path: Path) -> None:
    broken = tmp_path / "rates.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match=r"^cannot read the rates table .*rates\.json: .*restore it"):
        cost.load_rates(broken)
    rows = {k: v for k, v in cost.load_rates().items() if k != "sm_120"}
    with pytest.raises(ConfigError, match=r"no row for NVIDIA GeForce RTX 5090 \(sm_120\).*measure_rates\.py"):
        cost.rates_for(for_target("rtx5090"), rows)


def test_measure_rates_writes_a_row_the_table_accepts() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        from measure_rates import merge_row  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    row = merge_row(TABLE, "h100", "NVIDIA H100 80GB HBM3 (132 SMs)", 412.3456, 151.0, 2.345, 2.5)
    rows = cost.parse_rates({**TABLE, "rows": {**TABLE["rows"], "h100": row}})
    h100 = rows["h100"]
    assert (h100.status, h100.track_a, h100.track_a_conv.tflops) == (
        "measured",
        cost.TrackRates(412.0, 2.35, 2.5),
        151.0,
    )
    assert h100.track_b == rows["h200"].track_b.__class__(**TABLE["rows"]["h100"]["track_b"])  # carried over
