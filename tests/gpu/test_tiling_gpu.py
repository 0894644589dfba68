"""Sliding-window inference on a GPU: the ``blend_nhwc`` kernels against their numpy references
(kernels/blend.py, runtime/tiling.py), bit for bit, over images, windows, ring bands and class
counts no zoo model has; then the GPU path (:class:`~dualtrack.runtime.tiling.GpuTiler`) against
the CPU path on the same engine's windows.

Tolerance 0 for the kernels: every product, sum and division is one IEEE float32 rounding in the
reference's order (the .cu's _rn intrinsics), so the accumulator, the probabilities and the mask
are the reference's bits.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import window_net
from gpu_ptx import checked_in_entries

from dualtrack.contract.manifest import Window
from dualtrack.kernels import BLEND
from dualtrack.runtime import tiling
from dualtrack.runtime.engine import Engine

MASK_MISMATCH = 1e-4  # GPU path vs CPU path on the same engine's probabilities: only exact ties may differ
MASK_AGREE = 0.999  # GPU (Track A / IREE CUDA, fp32) vs torch fp32 under MONAI: the bar


@pytest.fixture(scope="module")
def window_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/window_net.py's bundle with `window:` for sm_90a and sm_80 (DUALTRACK_TEST_WINDOW_BUNDLE:
    carried, built by bench/prepare_carry.sh), else built here where iree-compile is."""
    from dualtrack.settings import tool_path

    carried = os.environ.get("DUALTRACK_TEST_WINDOW_BUNDLE")
    if carried:
        return Path(carried)
    if shutil.which(tool_path("iree-compile")) is None:
        pytest.skip("no iree-compile here to build the window bundle: carry one as DUALTRACK_TEST_WINDOW_BUNDLE")
    root = tmp_path_factory.mktemp("window_gpu")
    return window_net.build_window_bundle(root, root / "bundle", ("sm_90a", "sm_80"))


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path):
    with Engine.load(tiny_bundle, "cuda") as e:
        yield e


@pytest.fixture(scope="module")
def blend_kernels(engine: Engine):
    with checked_in_entries(engine, (BLEND.stem,)) as found:
        yield found


def _launch(engine: Engine, kernel, call) -> None:
    config, args = call
    kernel.launch(config.grid, config.block, config.shared_bytes, engine.backend.stream, args)


def _download(engine: Engine, ptr: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    from dualtrack.runtime.tensors import GpuTensor

    return engine.backend.to_host(GpuTensor(ptr, shape, np.dtype(dtype)))


@pytest.mark.parametrize(
    ("image", "window", "origins"),
    [((37, 51), (16, 24), [(0, 0), (-3, 40), (30, -7), (21, 27)]), ((9, 300), (16, 16), [(-4, 284), (-4, 0)])],
)
def test_cut_copies_windows_and_zeroes_outside_the_image(engine: Engine, blend_kernels, image, window, origins) -> None:
    rng = np.random.default_rng()
    img = rng.integers(1, 256, (*image, 3), dtype=np.uint8)
    batch = len(origins) + 1  # one padding row, which must come back zero
    src = engine.backend.from_host(img)
    dst = engine.backend.from_host(np.full((batch, *window, 3), 77, np.uint8))
    call = BLEND.cut_call(src.ptr, dst.ptr, *image, *window, batch, origins)
    _launch(engine, blend_kernels[BLEND.cut_entry], call)
    got = _download(engine, dst.ptr, (batch, *window, 3), np.uint8)
    np.testing.assert_array_equal(got, tiling.cut(img, origins, window, batch))


@pytest.mark.parametrize(
    ("image", "window", "batch", "classes", "blend"),
    [
        ((200, 150), (64, 64), 4, 3, "gaussian"),
        ((333, 97), (48, 32), 8, 1, "gaussian"),  # one class: p > 0.5
        ((130, 300), (64, 64), 3, 5, "constant"),
        ((40, 200), (64, 48), 2, 2, "gaussian"),  # padded rows: windows hang over the image
    ],
)
def test_accumulate_and_finish_are_the_references_bits(
    engine: Engine, blend_kernels, image, window, batch, classes, blend
) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    be, (H, W) = engine.backend, image
    t = tiling.Tiling.plan(image, Window(overlap=0.25, blend=blend), window, batch)
    ref = tiling.BandAccumulator(image, classes, t.band, t.weights, probs=True)
    acc = be.from_host(np.zeros((classes + 1, t.band, W), np.float32))
    mask = be.from_host(np.full((H, W), 255, np.uint8))
    probs = be.from_host(np.full((classes, H, W), np.nan, np.float32))
    weights = be.from_host(t.weights)
    done = 0
    for origins in t.runs():
        p = rng.random((len(origins), classes, *window), dtype=np.float32)
        upto = max(origins[0][0], 0)
        if upto > done:
            call = BLEND.finish_call(acc.ptr, mask.ptr, probs.ptr, classes, H, W, t.band, done, upto)
            _launch(engine, blend_kernels[BLEND.finish_entry], call)
            done = upto
        ref.add(p, origins)
        dp = be.from_host(p)
        call = BLEND.accumulate_call(dp.ptr, weights.ptr, acc.ptr, classes, *window, H, W, t.band, done, origins)
        _launch(engine, blend_kernels[BLEND.accumulate_entry], call)
        got = _download(engine, acc.ptr, (classes + 1, t.band, W), np.float32)
        np.testing.assert_array_equal(got, ref.acc, err_msg=f"seed {seed}: accumulator after {origins}")
    _launch(
        engine,
        blend_kernels[BLEND.finish_entry],
        BLEND.finish_call(acc.ptr, mask.ptr, probs.ptr, classes, H, W, t.band, done, H),
    )
    ref.finish()
    np.testing.assert_array_equal(
        _download(engine, probs.ptr, (classes, H, W), np.float32), ref.probs, err_msg=f"seed {seed}"
    )
    np.testing.assert_array_equal(_download(engine, mask.ptr, (H, W), np.uint8), ref.mask, err_msg=f"seed {seed}")
    assert not _download(engine, acc.ptr, (classes + 1, t.band, W), np.float32).any()  # finished rows zeroed


@pytest.mark.parametrize(
    ("shape", "blend"), [((200, 150), "gaussian"), ((97, 300), "constant"), ((50, 130), "gaussian")]
)
def test_the_gpu_path_answers_as_the_cpu_path(engine: Engine, shape, blend) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    image = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    spec = Window(overlap=0.25, blend=blend)
    size = engine.input_spec.shape[1:3]
    classes = next(o.shape[1] for o in engine.output_specs if o.name == "probs")
    t = tiling.Tiling.plan(shape, spec, size, engine.batch_sizes[-1])  # every run at the largest batch
    cpu = tiling.tile_numpy(image, t, lambda b: engine.run(b, outputs=["probs"])["probs"], classes, probs=True)
    fitted = tiling.Tiling.plan(shape, spec, size, engine.batch_sizes[-1], engine.batch_sizes)  # a short last run
    tiler = tiling.GpuTiler(engine.backend)
    try:
        with engine._lock:
            gpu = tiler.run(image, fitted, spec, engine.run_batch, classes, probs=True)
    finally:
        tiler.close()
    assert gpu.mask.shape == shape and gpu.probs is not None
    np.testing.assert_allclose(gpu.probs, cpu.probs, rtol=1e-6, atol=1e-7, err_msg=f"seed {seed}")
    assert np.mean(gpu.mask != cpu.mask) <= MASK_MISMATCH, f"seed {seed}"


@pytest.mark.parametrize("shape", [(200, 150), (90, 300)])
def test_engine_run_tiles_on_the_gpu_as_on_the_host_and_as_monai(window_bundle: Path, shape) -> None:
    """Engine.run of an image larger than the bundle's size on cuda: the blend_nhwc path, against the
    numpy path over the same engine's windows, and against MONAI around the fp32 torch network where
    MONAI is installed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    image = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    with Engine.load(window_bundle, "cuda") as engine:
        win = engine.bundle.manifest.window
        got = engine.run(image[None], outputs=["mask", "probs"])
        assert engine.last_windows == len(tiling.window_origins(shape, window_net.WINDOW, win.overlap))
        t = tiling.Tiling.plan(shape, win, window_net.WINDOW, win.batch)
        host = tiling.tile_numpy(image, t, lambda b: engine.run(b, outputs=["probs"])["probs"], 3, probs=True)
    np.testing.assert_allclose(got["probs"][0], host.probs, rtol=1e-6, atol=1e-7, err_msg=f"seed {seed}")
    assert np.mean(got["mask"][0] != host.mask) <= MASK_MISMATCH, f"seed {seed}"
    monai = pytest.importorskip("monai.inferers")
    import torch

    net = window_net.small_net()
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255.0
    x = (x - torch.tensor(window_net.MEAN).view(1, 3, 1, 1)) / torch.tensor(window_net.STD).view(1, 3, 1, 1)
    with torch.no_grad():
        p = monai.sliding_window_inference(
            x, window_net.WINDOW, 4, lambda w: torch.softmax(net(w), 1), overlap=0.25, mode="gaussian"
        )
    agree = float(np.mean(got["mask"][0] == p[0].argmax(0).numpy()))
    assert agree >= MASK_AGREE, f"seed {seed}: {agree:.5f}"
