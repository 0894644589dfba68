"""Settings read from the environment: defaults, and one line naming the fix for a bad value."""

from __future__ import annotations

import pytest

from dualtrack.errors import ConfigError
from dualtrack.settings import Settings


def test_the_jpeg_lanes_default_to_three_and_take_a_number_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUALTRACK_JPEG_LANES", raising=False)
    assert Settings.from_env().jpeg_lanes == 3
    for value, lanes in (("1", 1), ("7", 7), ("16", 16), ("", 3)):
        monkeypatch.setenv("DUALTRACK_JPEG_LANES", value)
        assert Settings.from_env().jpeg_lanes == lanes


@pytest.mark.parametrize("value", ["0", "17", "-2", "three", "2.5"])
def test_a_bad_jpeg_lanes_value_is_a_config_error_that_says_the_range(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("DUALTRACK_JPEG_LANES", value)
    with pytest.raises(ConfigError, match=rf"^DUALTRACK_JPEG_LANES={value!r}: use a whole number from 1 to 16$"):
        Settings.from_env()
    assert ConfigError.exit_code == 2


def test_the_jpeg_ahead_bound_defaults_to_256_mib_and_takes_a_number_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUALTRACK_JPEG_AHEAD_MB", raising=False)
    assert Settings.from_env().jpeg_ahead_mb == 256
    monkeypatch.setenv("DUALTRACK_JPEG_AHEAD_MB", "12")
    assert Settings.from_env().jpeg_ahead_mb == 12
    for bad in ("0", "65537", "lots"):
        monkeypatch.setenv("DUALTRACK_JPEG_AHEAD_MB", bad)
        want = rf"^DUALTRACK_JPEG_AHEAD_MB={bad!r}: use a whole number from 1 to 65536$"
        with pytest.raises(ConfigError, match=want):
            Settings.from_env()


def test_the_slot_file_is_page_locked_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUALTRACK_PIN_SLOTS", raising=False)
    assert Settings.from_env().pin_slots
    for value, pinned in (("0", False), ("no", False), ("1", True)):
        monkeypatch.setenv("DUALTRACK_PIN_SLOTS", value)
        assert Settings.from_env().pin_slots is pinned


def test_a_bad_track_b_value_names_the_two_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUALTRACK_TRACK_B", "graph")
    with pytest.raises(ConfigError, match=r"^DUALTRACK_TRACK_B='graph': use 'replay' \(the default\) or 'iree'$"):
        Settings.from_env()
