"""The model zoo's export script (models/zoo/export.py) loaded for tests, or a skip that names the fix."""

from __future__ import annotations

import fcntl
import importlib.util
import os
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
# Issue 39's transformer entries cost CI a minute and more each (the dynamo exporter takes 12 to 40 s a model at 64
# px, a corpus build 74 to 93 s on two shared cores, measured 2026-12): CI runs the cheapest, the rest where
# DUALTRACK_ZOO_ALL=1 (`DUALTRACK_ZOO_ALL=1 pytest tests/test_zoo_export.py tests/test_zoo_corpus.py`). Name -> why.
ALL_ONLY = "beyond CI's time (tests/zoo.py); run with DUALTRACK_ZOO_ALL=1"
EXPORT_BEYOND_CI = {
    # tests/test_batch_free.py exports it in CI and builds it for batches 1 and 2 (IREE alone, 70 s in all).
    "smp_segformer_mit_b0": "export 21 s twice",
    "smp_segformer_mit_b2": "export 27 s twice",
    "monai_unetr": "export 40 s twice",
    "monai_swinunetr": "export 26 s twice",
    # tests/test_act_chains.py exports a MedNeXt-style block the same way in CI and builds it (its GELUs on Track A).
    "monai_mednext": "export 86 s twice",
}
BUILD_BEYOND_CI = {
    "smp_segformer_mit_b0": "export 21 s, build (2 segments) 25-38 s",
    "smp_segformer_mit_b2": "export 27 s, build (2 segments) 50-71 s",
    "monai_unetr": "export 40 s, build 80 s",
    "monai_swinunetr": "export 26 s, build (16 segments) 93 s",
    "monai_mednext": "export 86 s, build (3 segments) 205 s",
    # The breadth probe's additions (beyond issue 38's fifteen), each a minute and more on CI's two cores; what
    # they brought has tests of its own: DenseNet's nested Concats (tests/test_pad_lowering.py), ResNeSt's split
    # attention (tests/test_radix_views.py), DeepLabV3+'s dilated ASPP (tests/test_conv_family.py).
    "smp_unet_densenet121": "build 84-108 s",
    "smp_deeplabv3plus_resnet34": "build 51-89 s",
    "smp_fpn_resnest14d": "build 52 s",
    # Issue 39's UPerNet (not one of issue 38's fifteen that CI builds): its ConvNeXt encoder is built in CI in
    # smp Unet tu-convnext_tiny, its PSP pooling's index soups (AdaptiveAvgPool2d) in tests/test_linear_maps.py.
    "smp_upernet_convnext_tiny": "build 80-91 s",
}


def beyond_ci(name: str, beyond: dict[str, str]) -> bool:
    """Whether this run skips ``name`` (listed in ``beyond``, and DUALTRACK_ZOO_ALL is not 1)."""
    return name in beyond and os.environ.get("DUALTRACK_ZOO_ALL") != "1"


def in_ci(names: list[str], beyond: dict[str, str]) -> list:
    """``names`` as pytest parameters, those :func:`beyond_ci` skipped with their cost as the reason."""
    return [
        pytest.param(n, marks=pytest.mark.skipif(beyond_ci(n, beyond), reason=f"{n}, {beyond.get(n)}: {ALL_ONLY}"))
        for n in names
    ]


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


def shared_export(name: str, size: tuple[int, int]) -> Path:
    """``name`` exported at ``size`` (the entry's own exporter, opset and seed) once for the whole run, in a folder
    of its own beside the run's build cache (tests/conftest.py): every pytest-xdist worker finds it there, one
    that asks while another exports it waits on a lock. tests/test_zoo_export.py checks these exports and the
    corpus builds read them (an export takes 3 to 40 s of CI's cores)."""
    zoo = load_export()
    root = Path(os.environ["DUALTRACK_CACHE_DIR"]).parent / "zoo-exports"
    out = root / f"{name}-{size[0]}x{size[1]}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.onnx"
    with open(root / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_file():  # export_model renames the finished file into place: one that exists is whole
            zoo.export_model(name, out, size)
    return path
