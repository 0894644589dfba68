"""Sliding-window inference (runtime/tiling.py) against MONAI's ``sliding_window_inference``.

Pure functions first (window origins and weights equal MONAI's over image / window / overlap
combinations no zoo model has; the band accumulator's answer equals a whole-image accumulator's
and a float64 blend), then the whole path: a small conv net in fp32 torch, exported to ONNX, built
into a CPU bundle with 64x64 windows, run on images larger than the window, against MONAI's function
around the same torch network.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import window_net
from monai.data.utils import compute_importance_map, dense_patch_slices
from monai.inferers import sliding_window_inference
from monai.inferers.utils import _get_scan_interval
from window_net import MEAN, STD, WINDOW, SmallNet

from dualtrack.compiler.config import load_config
from dualtrack.contract.manifest import Window
from dualtrack.errors import ConfigError
from dualtrack.kernels import BLEND
from dualtrack.kernels.blend import Clip
from dualtrack.runtime import tiling
from dualtrack.runtime.engine import Engine

MASK_AGREE = 0.999  # the bar: fp32 IREE llvm-cpu vs fp32 torch flip only near-tied pixels
BLEND_RTOL = 1e-5  # float32 accumulation in window order vs a float64 blend


def monai_origins(image: tuple[int, int], window: tuple[int, int], overlap: float) -> list[tuple[int, int]]:
    """MONAI's windows (its padding included) as top-left corners in the unpadded image."""
    padded = tuple(max(i, w) for i, w in zip(image, window, strict=True))
    low = [(p - i) // 2 for p, i in zip(padded, image, strict=True)]  # sliding_window_inference's pad_size
    interval = _get_scan_interval(padded, window, 2, (overlap, overlap))
    slices = dense_patch_slices(padded, window, interval)
    return [(s[0].start - low[0], s[1].start - low[1]) for s in slices]


@pytest.mark.parametrize(
    ("image", "window", "overlap"),
    [
        ((200, 150), (64, 64), 0.25),
        ((2048, 2048), (512, 512), 0.25),
        ((1000, 777), (96, 128), 0.5),
        ((129, 65), (64, 64), 0.0),
        ((513, 512), (512, 512), 0.25),
        ((300, 40), (64, 64), 0.25),  # narrower than the window: padded, centred
        ((64, 64), (64, 64), 0.9),
        ((101, 333), (7, 9), 0.8),
    ],
)
def test_window_origins_are_monais(image, window, overlap) -> None:
    assert tiling.window_origins(image, window, overlap) == monai_origins(image, window, overlap)


@pytest.mark.parametrize("blend", ["gaussian", "constant"])
@pytest.mark.parametrize(("window", "sigma"), [((64, 64), 0.125), ((96, 40), 0.125), ((33, 17), 0.3)])
def test_importance_map_is_monais(window, blend, sigma) -> None:
    ref = compute_importance_map(window, mode=blend, sigma_scale=sigma).numpy()
    got = tiling.importance_map(window, blend, sigma)
    assert got.dtype == np.float32 and got.shape == window
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)


def float64_blend(probs: list[np.ndarray], origins, weights: np.ndarray, image: tuple[int, int]) -> np.ndarray:
    """sum(w p) / sum(w) over whole-image float64 planes: the blend as written."""
    C = probs[0].shape[0]
    num = np.zeros((C, *image))
    den = np.zeros(image)
    for p, origin in zip(probs, origins, strict=True):
        k = Clip.of(origin, weights.shape, image)
        wy, wx = slice(k.r0 - k.oy, k.r1 - k.oy), slice(k.c0 - k.ox, k.c1 - k.ox)
        num[:, k.r0 : k.r1, k.c0 : k.c1] += p[:, wy, wx] * weights[wy, wx]
        den[k.r0 : k.r1, k.c0 : k.c1] += weights[wy, wx]
    return num / den


@pytest.mark.parametrize(
    ("image", "window", "batch", "classes"),
    [
        ((200, 150), (64, 64), 4, 3),
        ((333, 97), (48, 32), 8, 2),
        ((130, 300), (64, 64), 1, 1),
        ((40, 200), (64, 48), 3, 4),
    ],
)
def test_the_band_accumulator_answers_as_a_whole_image_accumulator(image, window, batch, classes) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    t = tiling.Tiling.plan(image, Window(overlap=0.25, blend="gaussian"), window, batch)
    assert t.band <= image[0] and (t.band < image[0] or image[0] <= window[0] + 64)
    probs = [rng.random((classes, *window), dtype=np.float32) for _ in t.origins]
    band = tiling.BandAccumulator(image, classes, t.band, t.weights, probs=True)
    whole = tiling.BandAccumulator(image, classes, image[0], t.weights, probs=True)
    for i, origins in enumerate(t.runs()):
        chunk = np.stack(probs[i * batch : i * batch + len(origins)])
        band.add(chunk, origins)
        whole.add(chunk, origins)
    band.finish()
    whole.finish()
    np.testing.assert_array_equal(band.probs, whole.probs, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(band.mask, whole.mask, err_msg=f"seed {seed}")
    np.testing.assert_allclose(band.probs, float64_blend(probs, t.origins, t.weights, image), rtol=BLEND_RTOL)
    # the kernels' reference, taken whole, is the same blend
    got = BLEND.reference(np.stack(probs), weights=t.weights, origins=t.origins, image=image)
    np.testing.assert_array_equal(got, band.mask, err_msg=f"seed {seed}")


def test_the_band_is_bounded_by_the_width_not_the_height() -> None:
    t = tiling.Tiling.plan((8192, 8192), Window(), (512, 512), 8)
    assert t.band == 512 + 384  # a batch of 8 spans two rows of 21 windows
    assert tiling.band_bytes(8192, (512, 512), 2, 8, t.band) < 110 * 2**20  # 88 MB + 23 MB + 1 MB


def test_cut_windows_are_zero_outside_the_image() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(1, 256, (30, 50, 3), dtype=np.uint8)
    got = tiling.cut(image, [(-5, 40), (10, 0)], (16, 16), 3)
    assert got.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(got[0, 5:, :10], image[0:11, 40:50])
    assert not got[0, :5].any() and not got[0, :, 10:].any() and not got[2].any()
    np.testing.assert_array_equal(got[1], image[10:26, 0:16])


def test_window_config_errors_name_the_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m.onnx\nwindow: {overlap: 0.25}\n")
    with pytest.raises(ConfigError, match="add `postprocess:`"):
        load_config(cfg)
    cfg.write_text("model: m.onnx\nbatch_sizes: [1, 4]\npostprocess: {}\nwindow: {batch: 8}\n")
    with pytest.raises(ConfigError, match=r"window\.batch 8 is not one of batch_sizes"):
        load_config(cfg)
    cfg.write_text("model: m.onnx\npostprocess: {}\nwindow: {overlap: 1.0}\n")
    with pytest.raises(ConfigError, match=r"window\.overlap"):
        load_config(cfg)


# --- the whole path against MONAI ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_net() -> SmallNet:
    return window_net.small_net()


@pytest.fixture(scope="module")
def window_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("window")
    return window_net.build_window_bundle(root, root / "bundle")


def monai_mask(net: SmallNet, image: np.ndarray, blend: str, overlap: float = 0.25) -> np.ndarray:
    """MONAI's sliding window around the torch network (fp32), normalised and softmaxed as the bundle is."""
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255.0
    x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        p = sliding_window_inference(x, WINDOW, 4, lambda w: torch.softmax(net(w), dim=1), overlap=overlap, mode=blend)
    return p[0].argmax(0).numpy().astype(np.uint8)


def test_the_bundle_records_its_window(window_bundle: Path) -> None:
    from click.testing import CliRunner

    from dualtrack.cli import main

    with Engine.load(window_bundle, "cpu") as engine:
        assert engine.bundle.manifest.window == Window(None, 0.25, "gaussian", 0.125, 4)
    info = CliRunner().invoke(main, ["info", str(window_bundle)])
    assert "window     64x64 windows, overlap 0.25, gaussian blend, 4 a run" in info.output, info.output


@pytest.mark.parametrize("shape", [(200, 150), (90, 40)])
def test_tiled_masks_agree_with_monais_sliding_window(window_bundle: Path, small_net: SmallNet, shape) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    image = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    with Engine.load(window_bundle, "cpu") as engine:
        out = engine.run(image[None], outputs=["mask", "probs"])
        windows = engine.last_windows
    assert out["mask"].shape == (1, *shape) and out["probs"].shape == (1, 3, *shape)
    assert windows == len(tiling.window_origins(shape, WINDOW, 0.25))
    agree = float(np.mean(out["mask"][0] == monai_mask(small_net, image, "gaussian")))
    assert agree >= MASK_AGREE, f"seed {seed}: {agree:.5f}"
    np.testing.assert_array_equal(out["mask"][0], np.argmax(out["probs"][0], axis=0))


def test_constant_blend_agrees_with_monais(window_bundle: Path, small_net: SmallNet) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    image = np.random.default_rng(seed).integers(0, 256, (200, 150, 3), dtype=np.uint8)
    spec = Window(overlap=0.5, blend="constant")
    with Engine.load(window_bundle, "cpu") as engine:
        t = tiling.Tiling.plan(image.shape[:2], spec, WINDOW, 4)
        answer = tiling.tile_numpy(image, t, lambda b: engine.run(b, outputs=["probs"])["probs"], 3)
    agree = float(np.mean(answer.mask == monai_mask(small_net, image, "constant", overlap=0.5)))
    assert agree >= MASK_AGREE, f"seed {seed}: {agree:.5f}"


def test_a_short_last_run_takes_the_smallest_batch_that_holds_it(window_bundle: Path) -> None:
    image = np.random.default_rng().integers(0, 256, (150, 150, 3), dtype=np.uint8)
    spec = Window(overlap=0.25, blend="gaussian")
    with Engine.load(window_bundle, "cpu") as engine:
        seen: list[int] = []

        def run(batch: np.ndarray) -> np.ndarray:
            seen.append(len(batch))
            return engine.run(batch, outputs=["probs"])["probs"]

        fitted = tiling.Tiling.plan(image.shape[:2], spec, WINDOW, 4, engine.batch_sizes)
        padded = tiling.Tiling.plan(image.shape[:2], spec, WINDOW, 4)  # no sizes: every run at 4
        assert len(fitted.origins) % 4 == 1  # 9 windows: 4, 4, then 1
        got = tiling.tile_numpy(image, fitted, run, 3, probs=True)
        assert seen == [4, 4, 1]
        want = tiling.tile_numpy(image, padded, run, 3, probs=True)
        assert seen[3:] == [4, 4, 4]
    assert [fitted.batch_for(n) for n in (1, 2, 3, 4)] == [1, 4, 4, 4]
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(got.probs, want.probs, rtol=1e-6, atol=1e-7)  # the same windows, another batch


def test_an_image_the_compiled_size_holds_is_not_tiled(window_bundle: Path) -> None:
    image = np.random.default_rng(3).integers(0, 256, (2, *WINDOW, 3), dtype=np.uint8)
    with Engine.load(window_bundle, "cpu") as engine:
        out = engine.run(image)
        assert engine.last_windows == 0 and out["mask"].shape == (2, *WINDOW)


def test_a_smaller_image_runs_padded_and_a_larger_one_windowed_through_run(window_bundle: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from PIL import Image

    from dualtrack.cli import main

    rng = np.random.default_rng()
    with Engine.load(window_bundle, "cpu") as engine:
        out = engine.run(rng.integers(0, 256, (1, 40, 50, 3), dtype=np.uint8))
        assert out["mask"].shape == (1, 40, 50) and engine.last_windows == 0
    Image.fromarray(rng.integers(0, 256, (200, 150, 3), dtype=np.uint8)).save(tmp_path / "big.png")
    result = CliRunner().invoke(
        main, ["run", str(window_bundle), str(tmp_path / "big.png"), "-o", str(tmp_path / "m.png")]
    )
    assert result.exit_code == 0, result.output
    assert "mask 150x200 (12 windows of 64x64)" in result.output
    assert Image.open(tmp_path / "m.png").size == (150, 200)


# --- the GPU path's glue on a stand-in device -------------------------------------------------------


class FakeMemory:
    """Device memory as numpy blocks at fake addresses: a read or write past a block fails the test."""

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.next = 1 << 32

    def alloc(self, nbytes: int, stream: object = None) -> FakeBuffer:
        base, self.next = self.next, self.next + (nbytes + 511) // 256 * 256
        self.blocks[base] = np.zeros(nbytes, np.uint8)
        return FakeBuffer(self, base)

    def view(self, ptr: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        base = max(b for b in self.blocks if b <= ptr)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        assert ptr - base + n <= self.blocks[base].size, (
            f"{n} bytes at {ptr - base} past a block of {self.blocks[base].size}"
        )
        return self.blocks[base][ptr - base : ptr - base + n].view(dtype).reshape(shape)


class FakeBuffer:
    def __init__(self, mem: FakeMemory, base: int) -> None:
        self.mem, self.base = mem, base

    def __int__(self) -> int:
        return self.base

    def close(self, stream: object = None) -> None:
        del self.mem.blocks[self.base]  # twice: KeyError


class FakeHostBuffer:
    """Page-locked host memory as a FakeMemory block: the copies between it and the device are numpy's."""

    def __init__(self, mem: FakeMemory, nbytes: int) -> None:
        self.mem, self.nbytes = mem, nbytes
        self.buf = mem.alloc(nbytes)
        self.ptr = int(self.buf)

    def numpy(self, dtype: type = np.uint8, shape: tuple[int, ...] | None = None) -> np.ndarray:
        return self.mem.view(self.ptr, shape or (self.nbytes // np.dtype(dtype).itemsize,), dtype)

    def close(self) -> None:
        self.buf.close()


class FakeStream:
    """A stream whose work is done when it is queued: waits order nothing, the copies run at once."""

    handle = 0

    def __init__(self, ctx: object = None) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        pass

    def wait(self, event: object) -> None:
        self.waited += 1


class FakeEvent:
    def __init__(self, ctx: object = None, timing: bool = True) -> None:
        self.records = 0

    def record(self, stream: object) -> FakeEvent:
        self.records += 1
        return self

    def synchronize(self) -> None:
        pass


class FakeBackend:
    """What GpuTiler asks of the CUDA backend, on FakeMemory."""

    def __init__(self, mem: FakeMemory) -> None:
        from types import SimpleNamespace

        self.mem = self.pool = mem
        self.ctx = SimpleNamespace(make_current=lambda: None)
        self.stream = FakeStream()

    def from_host(self, arr: np.ndarray):
        from dualtrack.runtime.tensors import GpuTensor

        buf = self.mem.alloc(arr.nbytes)
        self.mem.view(int(buf), arr.shape, arr.dtype)[...] = arr
        return GpuTensor(int(buf), arr.shape, arr.dtype, buf)


def fake_entries(mem: FakeMemory) -> dict:
    """The blend_nhwc entries as numpy, their arguments read in the .cu's parameter order."""
    from types import SimpleNamespace

    from dualtrack.kernels import blend

    def origins(o) -> list[tuple[int, int]]:
        return [(o.y[i], o.x[i]) for i in range(o.count)]

    def cut(image, windows, H, W, h, w, batch, o) -> None:
        img = mem.view(image, (H, W, 3), np.uint8)
        mem.view(windows, (batch, h, w, 3), np.uint8)[...] = tiling.cut(img, origins(o), (h, w), batch)

    def accumulate(probs, weights, acc, C, h, w, H, W, band, r0, r1, c0, c1, o) -> None:
        clips = [Clip.of(k, (h, w), (H, W)) for k in origins(o)]
        assert all(r0 <= k.r0 and k.r1 <= r1 and c0 <= k.c0 and k.c1 <= c1 for k in clips)  # the launch's box
        p = mem.view(probs, (o.count, C, h, w), np.float32)
        a = mem.view(acc, (C + 1, band, W), np.float32)
        blend.accumulate(a, p, mem.view(weights, (h, w), np.float32), origins(o), (H, W), r0)

    def finish(acc, mask, probs, C, H, W, band, lo, hi) -> None:
        m, p = blend.finish(mem.view(acc, (C + 1, band, W), np.float32), lo, hi)
        mem.view(mask, (H, W), np.uint8)[lo:hi] = m
        if probs:
            mem.view(probs, (C, H, W), np.float32)[:, lo:hi] = p

    def kernel(fn):
        return SimpleNamespace(launch=lambda grid, block, shared, stream, args: fn(*(v for v, _ in args)))

    return {
        BLEND.cut_entry: kernel(cut),
        BLEND.accumulate_entry: kernel(accumulate),
        BLEND.finish_entry: kernel(finish),
    }


def fake_net(x: np.ndarray, mix: np.ndarray) -> np.ndarray:
    """(n, h, w, 3) uint8 -> (n, C, h, w) softmax probabilities: a per-pixel linear map."""
    logits = np.einsum("nhwc,ck->nkhw", x.astype(np.float32) / 64.0, mix)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize(
    ("shape", "window", "batch", "classes", "blend"),
    [
        ((200, 150), (64, 64), 4, 3, "gaussian"),
        ((97, 300), (32, 48), 3, 1, "constant"),
        ((50, 130), (64, 64), 2, 2, "gaussian"),
    ],
)
def test_the_gpu_path_drives_its_kernels_as_the_cpu_path_computes(
    monkeypatch, shape, window, batch, classes, blend
) -> None:
    """GpuTiler's launches, buffers and row bookkeeping on a stand-in device whose kernels are the numpy
    references: its answer is the CPU path's, bit for bit, and it frees what it allocated."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    mem = FakeMemory()
    monkeypatch.setattr(tiling, "call", lambda fn, ptr, value, n, stream: mem.view(ptr, (n,), np.uint8).fill(value))
    copies: list[tuple[str, int]] = []

    def copy_async(kind: str, dst: int, src: int, nbytes: int, stream: object) -> None:
        copies.append((kind, nbytes))
        mem.view(dst, (nbytes,), np.uint8)[...] = mem.view(src, (nbytes,), np.uint8)

    def download(stream: object, dst: np.ndarray, src: FakeBuffer) -> None:
        dst.reshape(-1).view(np.uint8)[...] = mem.view(int(src), (dst.nbytes,), np.uint8)

    monkeypatch.setattr(tiling, "copy_async", copy_async)
    monkeypatch.setattr(tiling, "download", download)
    monkeypatch.setattr(tiling, "Stream", FakeStream)
    monkeypatch.setattr(tiling, "Event", FakeEvent)
    monkeypatch.setattr(tiling, "HostBuffer", lambda ctx, nbytes: FakeHostBuffer(mem, nbytes))
    monkeypatch.setattr(tiling._Transfers, "BAND", 24)  # several bands, reused slots, on these small images
    image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    mix = rng.standard_normal((3, classes)).astype(np.float32)
    spec = Window(overlap=0.25, blend=blend)
    t = tiling.Tiling.plan(shape, spec, window, batch)
    be = FakeBackend(mem)
    planned = mem.alloc(batch * classes * window[0] * window[1] * 4)  # the engine's output buffer

    def run_batch(x, n: int) -> dict:
        from dualtrack.runtime.tensors import GpuTensor

        out = (n, classes, *window)
        mem.view(int(planned), out, np.float32)[...] = fake_net(mem.view(x.ptr, (n, *window, 3), np.uint8), mix)
        return {"probs": GpuTensor(int(planned), out, np.dtype(np.float32))}

    tiler = tiling.GpuTiler(be, fake_entries(mem))
    for _ in range(2):  # the second image reuses the staging
        got = tiler.run(image, t, spec, run_batch, classes, probs=True)
        want = tiling.tile_numpy(image, t, lambda b: fake_net(b, mix), classes, probs=True)
        np.testing.assert_array_equal(got.probs, want.probs, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(got.mask, want.mask, err_msg=f"seed {seed}")
    # the image went up in bands of 24 rows, each once, and the mask came down in the finished rows' bands
    H, W = shape
    ups = [n for kind, n in copies if kind == "HtoD"]
    assert sum(ups) == 2 * H * W * 3 and max(ups) <= 24 * W * 3 and len(ups) == 2 * -(-H // 24)
    assert sum(n for kind, n in copies if kind == "DtoH") == 2 * H * W
    assert be.stream.waited == len(ups)  # each cut waited for its band on the device, not the host
    tiler.close()
    assert set(mem.blocks) == {int(planned)}  # the image, band, windows, mask, probs, weights and staging freed


def test_the_service_tiles_a_larger_image_and_counts_its_windows(window_bundle: Path) -> None:
    import io
    import time

    from PIL import Image
    from starlette.testclient import TestClient

    from dualtrack import imaging
    from dualtrack.serve import create_app

    image = np.random.default_rng().integers(0, 256, (200, 150, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    with Engine.load(window_bundle, "cpu") as engine:
        want = engine.run(image[None])["mask"][0]
    with TestClient(create_app(window_bundle, max_batch_delay_ms=1)) as client:
        deadline = time.monotonic() + 120
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the service did not get ready"
            time.sleep(0.1)
        r = client.post("/v1/segment", content=png.getvalue(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(imaging.decode_mask_png(r.content), want)
        small = io.BytesIO()
        Image.fromarray(image[:40, :50]).save(small, format="PNG")  # held by the compiled size: no windows
        assert client.post("/v1/segment", content=small.getvalue()).status_code == 200
        metrics = client.get("/metrics").text
    assert "dualtrack_windows_per_request_count 1.0" in metrics
    assert "dualtrack_windows_per_request_sum 12.0" in metrics
