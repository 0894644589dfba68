"""The llvm-cpu modules' x86-64 level (dualtrack.hostcpu): ``auto`` resolves to what the building
CPU runs, a level it lacks is refused before compiling, and a bundle whose CPU code this CPU cannot
run is refused at load, each with one line that names the fix. Hosts are archspec's own
microarchitectures (its feature lists), so the tests hold on any x86-64 machine."""

from __future__ import annotations

import json
from pathlib import Path

import archspec.cpu
import pytest
from click.testing import CliRunner

from dualtrack import hostcpu
from dualtrack.cli import main
from dualtrack.contract.manifest import Manifest
from dualtrack.errors import BundleError
from dualtrack.runtime.engine import Engine

TINY_YAML = Path(__file__).parent / "data" / "tiny.yaml"
x86_only = pytest.mark.skipif(
    str(archspec.cpu.host().family) != "x86_64", reason="the x86-64 levels are checked on x86-64 CPUs only"
)


def as_host(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(hostcpu, "_host", lambda: archspec.cpu.TARGETS[name])


@pytest.mark.parametrize(
    ("host", "level"),
    [("skylake_avx512", "x86-64-v4"), ("zen2", "x86-64-v3"), ("haswell", "x86-64-v3"), ("nehalem", "x86-64-v2"),
     ("core2", "x86-64")],
)  # fmt: skip
def test_auto_is_the_best_level_the_cpu_runs(monkeypatch: pytest.MonkeyPatch, host: str, level: str) -> None:
    as_host(monkeypatch, host)
    assert hostcpu.resolve("auto") == level
    assert hostcpu.cannot_run(level) is None
    assert hostcpu.resolve("x86-64-v4") == "x86-64-v4"  # an explicit level is taken as written


def test_a_level_the_cpu_lacks_names_the_missing_features(monkeypatch: pytest.MonkeyPatch) -> None:
    as_host(monkeypatch, "zen2")  # AVX2, no AVX-512: an AMD EPYC of 2019
    why = hostcpu.cannot_run("x86-64-v4")
    assert why is not None
    assert "avx512f" in why and "zen2" in why
    assert hostcpu.cannot_run("host") is None and hostcpu.cannot_run("znver3") is None  # not levels: not checked
    as_host(monkeypatch, "power9le")
    assert hostcpu.resolve("auto") == "host"
    assert "ppc64le" in (hostcpu.cannot_run("x86-64-v3") or "")


@x86_only
def test_a_build_for_a_level_this_cpu_lacks_is_refused_before_compiling(
    monkeypatch: pytest.MonkeyPatch, tiny_config: Path, tmp_path: Path
) -> None:
    config = tmp_path / "tiny.yaml"
    text = tiny_config.read_text().replace("model: tiny_fp32.onnx", f"model: {tiny_config.parent / 'tiny_fp32.onnx'}")
    config.write_text(text + "\ntrack_b:\n  cpu_target: x86-64-v4\n")
    as_host(monkeypatch, "zen2")
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["build", str(config), "-o", str(out)])
    assert result.exit_code == 2, (result.stderr, result.exception)
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: track_b.cpu_target x86-64-v4: x86-64-v4 code needs avx512bw")
    assert last.endswith("set track_b.cpu_target: auto (x86-64-v3 here)")
    assert not (out / "manifest.json").exists()


@x86_only
def test_the_bundle_records_its_level_and_a_cpu_without_it_refuses_to_load(
    monkeypatch: pytest.MonkeyPatch, tiny_bundle: Path, tmp_path: Path
) -> None:
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    assert manifest["config"]["track_b"]["cpu_target"] == "auto"
    assert manifest["cpu_target"] in hostcpu.LEVELS
    assert hostcpu.cannot_run(manifest["cpu_target"]) is None  # built here: runs here
    as_host(monkeypatch, "core2")  # below x86-64-v2: runs no level a build resolves to on a current CPU
    with pytest.raises(BundleError, match=r"CPU modules cannot run here: x86-64-v\d code needs .*rebuild it"):
        Engine.load(tiny_bundle, device="cpu")
    result = CliRunner().invoke(main, ["verify", str(tiny_bundle), "--device", "cpu"])
    assert result.exit_code == 8, (result.stderr, result.exception)
    assert "rebuild it on this machine (track_b.cpu_target: auto)" in result.stderr.splitlines()[-1]


def test_a_manifest_from_before_the_level_was_recorded_takes_its_configs(tiny_bundle: Path) -> None:
    d = json.loads((tiny_bundle / "manifest.json").read_text())
    del d["cpu_target"]
    d["config"]["track_b"]["cpu_target"] = "x86-64-v4"  # what such builds wrote: the old default
    assert Manifest.from_json(d, "old").cpu_target == "x86-64-v4"
