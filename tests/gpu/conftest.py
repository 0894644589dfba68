"""GPU tests: marked `gpu`, and skipped, each with the reason, where no NVIDIA GPU can be used."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualtrack.errors import DeviceError
from dualtrack.runtime.driver import load_driver

HERE = Path(__file__).parent


def _no_gpu_reason() -> str | None:
    try:
        load_driver()
    except DeviceError as exc:
        return f"needs an NVIDIA GPU: {exc}"
    return None


NO_GPU = _no_gpu_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if NO_GPU:
                item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path):
    """The tiny bundle's CUDA engine: context, stream and memory pool for the kernel tests."""
    from dualtrack.runtime.engine import Engine

    with Engine.load(tiny_bundle, "cuda") as e:
        yield e
