"""The model zoo's export script (models/zoo/export.py) loaded for tests, or a skip that names the fix."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SKIP_REASON = (
    "the zoo extra (torch, torchvision, segmentation-models-pytorch, monai) is not installed: run `make zoo-deps`"
)
EXPORT_PY = Path(__file__).resolve().parents[1] / "models" / "zoo" / "export.py"
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "zoo"
# The zoo models tests/test_zoo_build.py builds at its size with the configs' batches and runs; the rest of the
# corpus is built smaller, once each, by tests/test_zoo_corpus.py (CI's time would not hold every model at 128, N=8).
FULL_BUILD = ("smp_unet_resnet34", "tv_lraspp_mobilenet_v3_large")


def load_export() -> ModuleType:
    """The export script as a module; skips the calling test module where the zoo extra is missing."""
    pytest.importorskip("torch", reason=SKIP_REASON)
    # Not importorskip: importing torchvision beside the CPU torch needs the stub that export.py installs first.
    if any(importlib.util.find_spec(m) is None for m in ("torchvision", "segmentation_models_pytorch", "monai")):
        pytest.skip(SKIP_REASON, allow_module_level=True)
    if "zoo_export" in sys.modules:
        return sys.modules["zoo_export"]
    spec = importlib.util.spec_from_file_location("zoo_export", EXPORT_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
