"""Shared fixtures: a tiny U-Net (base 4, depth 2, 64x64) and its bundle, built once per session.

The tiny model has the reference model's structure (pre/, enc*, mid/, dec*, head/, post/), so the
whole pipeline — partition, both tracks' builds, verification, the CPU runtime — runs in seconds.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest

from dualtrack.compiler.reference import UNetSpec, build_unet

DATA = Path(__file__).parent / "data"
TINY = UNetSpec(base=4, depth=2, height=64, width=64, precision="fp32", seed=1)


# pytest-xdist: `make test` runs `-n 2 --dist loadfile`, which this scheduler refines. A test file's cases run on one
# worker, so that its module fixtures and module state (tests/test_ptx.py's FRESH) are built once, but for two kinds:
# cases marked `spread` (independent and costly: each zoo model's build, each PTX assembly) go to whichever worker
# is free, after the files; and the files that take a bundle of SHARED_BUILDS (a CPU build each, session fixtures)
# run on one worker together, which builds it once. The controller reads both from the test files' source, since it
# does not collect (xdist's own xdist_group marks do not reach it with pytest 9). Each worker is its own session,
# with its own tmp_path_factory root and build cache (_isolated_cache).
SHARED_BUILDS = frozenset({"tiny_full_bundle", "tiny_tuned_bundle"})


@functools.cache
def _file_scheduling(path: Path) -> tuple[frozenset[str], bool]:
    """The test functions of ``path`` marked `spread`, and whether one of its tests takes a SHARED_BUILDS bundle."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return frozenset(), False
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    spread = {f.name for f in functions if any(ast.unparse(d) == "pytest.mark.spread" for d in f.decorator_list)}
    shared = any(a.arg in SHARED_BUILDS for f in functions for a in f.args.args)
    return frozenset(spread), shared


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, rest = nodeid.partition("::")
            spread, shared = _file_scheduling(config.rootpath / path)
            if rest.split("[", 1)[0].rsplit("::", 1)[-1] in spread:
                return nodeid
            return "tests using SHARED_BUILDS" if shared else path

    return FileScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Builds in tests use the run's own cache, never the user's: one for every pytest-xdist worker of
    the run (its entries are content-addressed and written atomically), so a cubin or IREE module one
    worker compiled is not compiled again by the other (ptxas alone took minutes a worker)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = root / "dualtrack-cache"
    cache.mkdir(exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("DUALTRACK_CACHE_DIR", str(cache))
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
    from dualtrack.compiler.build import build

    prebuilt = os.environ.get("DUALTRACK_TEST_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    build(tiny_config, out)
    return out


# tests/data/tiny_wgmma.yaml: channels the sm_90a wgmma conv takes (multiples of 32), partial tiles.
WGMMA_NET = UNetSpec(base=32, depth=2, height=48, width=48, precision="fp16", seed=3)


@pytest.fixture(scope="session")
def tiny_wgmma_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_project(tmp_path_factory.mktemp("tiny_wgmma"), WGMMA_NET, config="tiny_wgmma.yaml")


@pytest.fixture(scope="session")
def tiny_wgmma_bundle(tiny_wgmma_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base-32 fp16 U-Net for the wgmma GPU tests (DUALTRACK_TEST_WGMMA_BUNDLE: prebuilt)."""
    prebuilt = os.environ.get("DUALTRACK_TEST_WGMMA_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    return build_tiny_wgmma(tmp_path_factory.mktemp("bundles") / "tiny_wgmma", tiny_wgmma_config)


def build_tiny_wgmma(dest: str | Path, config: Path | None = None) -> Path:
    """Build the wgmma test bundle at ``dest`` (to carry to a GPU machine: see bench/README.md)."""
    from dualtrack.compiler.build import build

    if config is None:
        config = write_tiny_project(Path(tempfile.mkdtemp(prefix="tiny_wgmma-")), WGMMA_NET, "tiny_wgmma.yaml")
    build(config, dest)
    return Path(dest)


@pytest.fixture(scope="session")
def tiny_full_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/data/tiny_full.yaml and its fp16 model in a temporary folder."""
    spec = UNetSpec(**{**TINY.__dict__, "precision": "fp16"})
    return write_tiny_project(tmp_path_factory.mktemp("tiny_full"), spec, config="tiny_full.yaml")


@pytest.fixture(scope="session")
def tiny_full_bundle(tiny_full_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny U-Net with encoder, bottleneck and decoder on Track A (DUALTRACK_TEST_FULL_BUNDLE: prebuilt)."""
    from dualtrack.compiler.build import build

    prebuilt = os.environ.get("DUALTRACK_TEST_FULL_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("bundles") / "tiny_full"
    build(tiny_full_config, out)
    return out


def build_tiny_head(dest: str | Path, root: Path | None = None) -> Path:
    """The tiny fp16 U-Net with `partition: auto` (tests/data/tiny_head.yaml): its plan ends in the
    seghead kernel on Track A (bench/prepare_carry.sh builds it for GPU machines)."""
    from dualtrack.compiler.build import build

    spec = UNetSpec(**{**TINY.__dict__, "precision": "fp16"})
    config = write_tiny_project(Path(root or tempfile.mkdtemp(prefix="tiny_head-")), spec, config="tiny_head.yaml")
    build(config, dest)
    return Path(dest)


@pytest.fixture(scope="session")
def tiny_head_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`build_tiny_head`'s bundle (DUALTRACK_TEST_HEAD_BUNDLE: prebuilt)."""
    prebuilt = os.environ.get("DUALTRACK_TEST_HEAD_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    return build_tiny_head(tmp_path_factory.mktemp("bundles") / "tiny_head", tmp_path_factory.mktemp("tiny_head"))


# Tiles a hand-written tuning file picks (all in the H200 search space), in turn per problem; every
# fourth problem gets a fixed entry other than the heuristic's instead. tests/test_cli.py's info
# test and the GPU tests expect these three.
HAND_TILES = ((64, 32, 32, 2, 2, 4, 4), (64, 64, 32, 2, 4, 4, 3), (128, 32, 64, 4, 1, 2, 4))


def write_hand_tuning(config: Path, path: Path, time_ms: float = 0.01, tiles: tuple = HAND_TILES) -> list:
    """A tuning file for the tiny fp16 U-Net as `dualtrack tune` on an H200 would write it, with
    chosen winners: a tuned tile or another fixed entry for every conv problem (cc 9.0, twice as fast
    as the baseline), one cc 8.0 record slower than its baseline (recorded, not used) and one stale
    record (another source hash)."""
    from dualtrack.compiler import partition
    from dualtrack.compiler import tuned as tuning
    from dualtrack.compiler.config import load_config
    from dualtrack.kernels import KERNELS, F16Tile
    from dualtrack.kernels.problems import by_problem, conv_layers

    cfg = load_config(config)
    plan, _ = partition.plan_config(cfg)
    conv = KERNELS["conv3x3"]
    source = tuning.source_sha256()
    records = []
    for i, (p, layers) in enumerate(by_problem(conv_layers(plan)).items()):
        baseline = conv.variant(p.dtype, p.N, p.H, p.W, p.C, p.K)
        if i % 4 == 3:
            entry = next(e for e in conv.f16_tiles() if e != baseline)
        else:
            entry = conv.tuned_entry(F16Tile(*tiles[i % 4]))
        common = {
            "kernel": conv.source, "entry": entry, "params": conv.entry_tile(entry), "source_sha256": source,
            "problem": p, "gpu": "NVIDIA H200", "cc": "9.0", "arch": "sm_90a", "driver": 13000, "nvrtc": "13.0",
            "time_ms": time_ms, "baseline_entry": baseline, "baseline_ms": 2 * time_ms, "rel_l2": 4e-4,
            "tried": 39, "layers": tuple(f"{x.node}@{x.batch}" for x in layers),
        }  # fmt: skip
        records.append(tuning.TileRecord(**common))
        if i == 0:
            slower = {"gpu": "NVIDIA A100", "cc": "8.0", "arch": "sm_80", "time_ms": 3 * time_ms}
            records.append(tuning.TileRecord(**{**common, **slower}))
            records.append(tuning.TileRecord(**{**common, "source_sha256": "0" * 64}))
    tuning.save(path, records)
    return records


@pytest.fixture(scope="session")
def hand_tuning() -> Callable[..., list]:
    """:func:`write_hand_tuning` (test modules cannot import from conftest: tests/gpu has one too)."""
    return write_hand_tuning


@pytest.fixture(scope="session")
def tiny_tuned_bundle(tiny_full_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny fp16 U-Net built with a hand-written tuning file (DUALTRACK_TEST_TUNED_BUNDLE: prebuilt)."""
    prebuilt = os.environ.get("DUALTRACK_TEST_TUNED_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    return build_tiny_tuned(tmp_path_factory.mktemp("bundles") / "tiny_tuned", tiny_full_config)


def build_tiny_tuned(dest: str | Path, config: Path | None = None) -> Path:
    """Build the tuned tiny bundle at ``dest`` (to carry to a GPU machine: see bench/README.md)."""
    from dualtrack.compiler.build import build

    dest = Path(dest)
    if config is None:
        spec = UNetSpec(**{**TINY.__dict__, "precision": "fp16"})
        config = write_tiny_project(Path(tempfile.mkdtemp(prefix="tiny_tuned-")), spec, config="tiny_full.yaml")
    tuning_file = config.parent / "tuning.json"
    write_hand_tuning(config, tuning_file)
    build(config, dest, tuning=tuning_file)
    return dest
