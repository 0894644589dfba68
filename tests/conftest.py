"""Shared fixtures: a tiny U-Net (base 4, depth 2, 64x64) and its bundle, built once per session.

The tiny model has the reference model's structure (pre/, enc*, mid/, dec*, head/, post/), so the
whole pipeline — partition, both tracks' builds, verification, the CPU runtime — runs in seconds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx
import pytest

from dualtrack.reference import UNetSpec, build_unet

DATA = Path(__file__).parent / "data"
TINY = UNetSpec(base=4, depth=2, height=64, width=64, precision="fp32", seed=1)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Builds in tests use their own cache, never the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DUALTRACK_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def write_tiny_project(root: Path, spec: UNetSpec = TINY, config: str = "tiny.yaml") -> Path:
    """A config + model folder like configs/ and models/; returns the config path."""
    root.mkdir(parents=True, exist_ok=True)
    onnx.save(build_unet(spec), str(root / f"tiny_{spec.precision}.onnx"))
    cfg = root / config
    shutil.copy(DATA / config, cfg)
    return cfg


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_project(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny bundle. DUALTRACK_TEST_BUNDLE names a prebuilt one: GPU machines carry it, since
    the IREE compiler is too large to install there."""
    from dualtrack.build import build

    prebuilt = os.environ.get("DUALTRACK_TEST_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    build(tiny_config, out)
    return out


@pytest.fixture(scope="session")
def tiny_full_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny U-Net with encoder, bottleneck and decoder on Track A (DUALTRACK_TEST_FULL_BUNDLE: prebuilt)."""
    from dualtrack.build import build

    prebuilt = os.environ.get("DUALTRACK_TEST_FULL_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    spec = UNetSpec(**{**TINY.__dict__, "precision": "fp16"})
    cfg = write_tiny_project(tmp_path_factory.mktemp("tiny_full"), spec, config="tiny_full.yaml")
    out = tmp_path_factory.mktemp("bundles") / "tiny_full"
    build(cfg, out)
    return out
