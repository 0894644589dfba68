"""The GPU JPEG path and the overlapped engine path on a GPU (the CPU halves: test_gpu_decode_logic.py).

Tolerances, stated here and checked below:
- resize_rgb_u8 against its numpy reference (kernels/resize_rgb.py): 0, into poisoned rows;
- nvJPEG (nvImageCodec) against libjpeg-turbo (Pillow), model input after the same resize: at most
  ``DECODE_MAX_ABS`` levels on any value and a mean under ``DECODE_MEAN_ABS`` (the two decoders'
  IDCT and chroma upsampling differ by a few levels; the test prints the measured numbers);
- masks of the service path via GPU decode against CPU decode: at least ``MASK_AGREEMENT`` of pixels;
- Engine.submit against Engine.run: bit-identical.
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as cu
from gpu_serving import host_and_client
from PIL import Image
from starlette.testclient import TestClient

from dualtrack import imaging
from dualtrack.kernels import RESIZE_RGB
from dualtrack.kernels.resize_rgb import ResizeJob
from dualtrack.runtime.driver import call
from dualtrack.runtime.gpu_jpeg import open_decoder, probe_library
from dualtrack.runtime.memory import download, upload
from dualtrack.serve import create_app

DECODE_MAX_ABS = 24
DECODE_MEAN_ABS = 2.0
MASK_AGREEMENT = 0.99
NO_LIBRARY = probe_library()[1]
needs_nvimgcodec = pytest.mark.skipif(NO_LIBRARY is not None, reason=f"needs nvImageCodec: {NO_LIBRARY}")


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path):
    from dualtrack.runtime.engine import Engine

    with Engine.load(tiny_bundle, "cuda") as e:
        yield e


def _photo(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Smooth random content (a JPEG of white noise is mostly quantization error)."""
    small = rng.integers(0, 256, (max(h // 16, 2), max(w // 16, 2), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC))


def _jpeg(pixels: np.ndarray, orientation: int = 1) -> bytes:
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


def _device_rows(engine, n: int):
    be = engine.backend
    h, w = engine.input_spec.shape[1:3]
    buf = be.pool.alloc(n * h * w * 3, be.stream)
    return buf, (n, h, w, 3)


def _read(engine, buf, shape) -> np.ndarray:
    out = np.empty(shape, np.uint8)
    download(engine.backend.stream, out, buf)
    return out


@needs_nvimgcodec
def test_the_resize_kernel_matches_its_reference_into_poisoned_rows(engine) -> None:
    choice, decoder = open_decoder(engine, "auto", None)
    assert decoder is not None, choice.reason
    be = engine.backend
    rng = np.random.default_rng(7)
    h, w = engine.input_spec.shape[1:3]
    # Sources within the kernel's 8x downscale (larger JPEGs take the CPU path, DCT-scaled): sizes
    # relative to the model input, whatever bundle the test runs on.
    cases = ((5 * h - 20, 7 * w + 4, 1), (h, w, 1), (37, 23, 6), (7 * h, 5 * w, 8), (h * 3, w * 2, 3))
    sources, jobs = [], []
    dbuf, shape = _device_rows(engine, len(cases))
    call(cu.cuMemsetD8Async, dbuf.ptr, 0xA5, dbuf.nbytes, be.stream.handle)  # poison
    for i, (src_h, src_w, orientation) in enumerate(cases):
        src = rng.integers(0, 256, (src_h, src_w, 3), dtype=np.uint8)
        sbuf = be.pool.alloc(src.nbytes, be.stream)
        upload(be.stream, sbuf, src)
        sources.append((src, sbuf))
        jobs.append(ResizeJob(sbuf.ptr, dbuf.ptr + i * h * w * 3, src_w, src_h, 3 * src_w, orientation))
    # Every case in one launch (the service's batch), then each alone: the same pixels.
    decoder.resize_rows(be.stream, jobs, h, w)
    together = _read(engine, dbuf, shape)
    for job in jobs:
        call(cu.cuMemsetD8Async, job.dst, 0x5A, h * w * 3, be.stream.handle)
        decoder.resize_rows(be.stream, [job], h, w)
    alone = _read(engine, dbuf, shape)
    be.stream.synchronize()
    for i, (src, _) in enumerate(sources):
        want = RESIZE_RGB.reference(src, h, w, orientation=cases[i][2])
        np.testing.assert_array_equal(together[i], want)
        np.testing.assert_array_equal(alone[i], want)


@needs_nvimgcodec
def test_gpu_decoded_jpegs_match_the_cpu_path_within_the_decoders_difference(engine) -> None:
    choice, decoder = open_decoder(engine, "auto", None)
    assert decoder is not None, choice.reason
    be = engine.backend
    h, w = engine.input_spec.shape[1:3]
    rng = np.random.default_rng(8)
    # Pictures the GPU path takes: a JPEG at least twice the model input in both axes is decoded on
    # the CPU at reduced size (DCT scaling), so these stay under 2x in one axis.
    cases = [(3 * w, h + h // 2, 1), (w + 13, 5 * h, 6), (w, h, 1), (2 * w - 3, 7 * h, 3)]
    rows = {}
    for i, (pw, ph, orientation) in enumerate(cases):
        route = imaging.route_jpeg(_jpeg(_photo(rng, pw, ph), orientation), h, w, max_downscale=8)
        assert isinstance(route, imaging.GpuJpeg), route
        rows[i] = route
    dbuf, shape = _device_rows(engine, len(cases))
    decoded = decoder.decode_into(be.stream, rows, dbuf.ptr, h, w)
    assert decoded.written == set(rows) and not decoded.refused
    got = _read(engine, dbuf, shape)
    be.stream.synchronize()
    for i, route in rows.items():
        cpu = imaging.load_for_model(route.data, h, w).pixels
        diff = np.abs(got[i].astype(np.int16) - cpu)
        print(f"case {cases[i]}: max |nvJPEG - libjpeg| {diff.max()}, mean {diff.mean():.3f}")
        assert diff.max() <= DECODE_MAX_ABS and diff.mean() < DECODE_MEAN_ABS


@needs_nvimgcodec
def test_a_jpeg_nvimgcodec_refuses_is_handed_back_for_the_cpu_path(engine) -> None:
    _, decoder = open_decoder(engine, "auto", None)
    assert decoder is not None
    h, w = engine.input_spec.shape[1:3]
    good = _jpeg(_photo(np.random.default_rng(9), 200, 200))
    sos = good.find(b"\xff\xda")
    broken = good[: sos + 20] + bytes(200) + b"\xff\xd9"  # a scan of zeros: header fine, data corrupt
    rows = {0: imaging.GpuJpeg(broken, (200, 200), 1), 1: imaging.GpuJpeg(good, (200, 200), 1)}
    dbuf, _shape = _device_rows(engine, 2)
    decoded = decoder.decode_into(engine.backend.stream, rows, dbuf.ptr, h, w)
    engine.backend.stream.synchronize()
    assert 1 in decoded.written
    assert decoded.written | set(decoded.refused) == {0, 1}  # nvJPEG either decodes it or hands it back


def test_submit_is_bit_identical_to_run(engine) -> None:
    rng = np.random.default_rng(10)
    for b in engine.batch_sizes:
        x = rng.integers(0, 256, engine.input_spec.at_batch(b), dtype=np.uint8)
        want = engine.run(x)
        pinned = engine.host_array(b)
        pinned[:] = x
        subs = [engine.submit(x), engine.submit(pinned)]  # from plain numpy (staged) and from a host array
        for sub in subs:
            got = sub.result()
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value)


def test_launch_into_page_locked_rows_is_bit_identical_to_run(engine) -> None:
    """Engine.launch(into=...): each wanted row of the mask lands in its own array of memory
    pin_host registered (rows in any order, a row not wanted left alone), bit-identical to run;
    the result then leaves the mask out. An array outside pinned memory is refused."""
    from dualtrack.errors import InputError

    rng = np.random.default_rng(14)
    b = max(engine.batch_sizes)
    h, w = engine.input_spec.shape[1:3]
    x = rng.integers(0, 256, engine.input_spec.at_batch(b), dtype=np.uint8)
    want = engine.run(x, outputs=("mask",))["mask"]
    slots = np.full((b + 2, h, w), 0xEE, np.uint8)
    pinned = engine.pin_host(slots)
    try:
        order = list(range(b + 1, 1, -1))  # row i -> slot order[i]
        into = [slots[s] for s in order]
        into[0] = None  # not wanted: slot b + 1 stays as it was
        sub = engine.launch(engine.stage(x), outputs=("mask",), into={"mask": into})
        assert "mask" not in sub.result()
        for i, s in enumerate(order[1:], start=1):
            np.testing.assert_array_equal(slots[s], want[i])
        assert (slots[[0, 1, b + 1]] == 0xEE).all()
        with pytest.raises(InputError, match="pin_host"):
            engine.launch(engine.stage(x), outputs=("mask",), into={"mask": [np.zeros((h, w), np.uint8)] * b})
    finally:
        pinned.close()


def test_a_stage_whose_rows_the_gpu_wrote_is_ordered_on_the_device(engine) -> None:
    """A batch whose every row fill wrote on the GPU, for a plan that runs as one graph on the
    compute stream, is not waited for on the host (Staged.pending): the launch waits for it on the
    compute stream. Its masks are bit-identical to run() on the same rows; a batch with a row from
    the host is waited for as before, with the same masks."""
    be = engine.backend
    b = max(engine.batch_sizes)
    h, w = engine.input_spec.shape[1:3]
    rng = np.random.default_rng(15)
    rows = rng.integers(0, 256, (b, h, w, 3), dtype=np.uint8)
    engine.run(rows)  # decides (and captures) the one graph at this batch size
    assert be.runs_on_stream(b)
    src = be.pool.alloc(rows.nbytes, be.stream)
    upload(be.stream, src, rows)
    be.stream.synchronize()
    want = engine.run(rows, outputs=("mask",))["mask"]

    def fill_all(stream, tensor) -> set[int]:  # the rows come from device memory, as JPEG rows do
        call(cu.cuMemcpyDtoDAsync, tensor.ptr, src.ptr, rows.nbytes, stream.handle)
        return set(range(b))

    def fill_but_last(stream, tensor) -> set[int]:
        call(cu.cuMemcpyDtoDAsync, tensor.ptr, src.ptr, rows.nbytes - h * w * 3, stream.handle)
        return set(range(b - 1))

    host = np.zeros_like(rows)
    host[b - 1] = rows[b - 1]
    for fill, x, pending in ((fill_all, np.zeros_like(rows), True), (fill_but_last, host, False)):
        for _ in range(3):  # more batches than slots: every slot's turn
            staged = engine.stage(x, fill)
            assert staged.pending is pending
            got = engine.launch(staged, outputs=("mask",)).result()["mask"]
            np.testing.assert_array_equal(got, want)
    src.close(be.stream)
    be.stream.synchronize()


@needs_nvimgcodec
def test_the_batcher_keeps_decoded_pictures_until_a_pending_batch_has_run(tiny_bundle: Path) -> None:
    """Batcher.submit_jpeg one JPEG at a time (batches of 1: no host row, so the stage is pending):
    each mask agrees with the CPU decode's on at least MASK_AGREEMENT of pixels, and once answered
    every decoded picture is released (the prefetcher holds nothing)."""
    from dualtrack.runtime.engine import Engine
    from dualtrack.serve import Batcher, Phase

    rng = np.random.default_rng(16)
    bodies = [_jpeg(_photo(rng, 96 + 8 * i, 72), o) for i, o in enumerate((1, 6, 3, 8, 1))]
    with Engine.load(tiny_bundle, "cuda") as e:
        h, w = e.input_spec.shape[1:3]
        want = [e.run(imaging.load_for_model(b, h, w).pixels[None], outputs=("mask",))["mask"][0] for b in bodies]
        batcher = Batcher(e, max_batch_delay_s=0.0, max_queue=16)
        batcher.start()
        try:
            deadline = time.monotonic() + 120
            while batcher.phase is not Phase.READY and time.monotonic() < deadline:
                time.sleep(0.05)
            assert batcher.decoder[0] == "gpu", batcher.decoder
            for body, expected in zip(bodies, want, strict=True):
                route = imaging.route_jpeg(body, h, w, max_downscale=RESIZE_RGB.max_downscale)
                result = batcher.submit_jpeg(route).result(60)  # type: ignore[arg-type]
                assert (result.batch_size, result.padded_size) == (1, 1)
                agreement = float((result.mask == expected).mean())
                assert agreement >= MASK_AGREEMENT, agreement
            deadline = time.monotonic() + 10
            while batcher._prefetch._held_bytes and time.monotonic() < deadline:  # released after answering
                time.sleep(0.01)
            assert batcher._prefetch._held_bytes == 0 and not batcher._prefetch._held
        finally:
            assert batcher.close(60)


def test_overlapped_stage_and_launch_on_two_threads_answer_every_batch_in_order(engine) -> None:
    rng = np.random.default_rng(11)
    b = max(engine.batch_sizes)
    batches = [rng.integers(0, 256, engine.input_spec.at_batch(b), dtype=np.uint8) for _ in range(6)]
    want = [engine.run(x, outputs=("mask",))["mask"] for x in batches]
    staged: list = []
    ready = threading.Semaphore(0)

    def stager() -> None:
        for x in batches:
            staged.append(engine.stage(x))
            ready.release()

    t = threading.Thread(target=stager)
    t.start()
    pending = None
    got = []
    for _ in batches:
        ready.acquire()
        sub = engine.launch(staged[len(got) + (pending is not None)], outputs=("mask",))
        if pending is not None:
            got.append(pending.result()["mask"])
        pending = sub
    got.append(pending.result()["mask"])
    t.join()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@needs_nvimgcodec
def test_service_masks_agree_between_gpu_and_cpu_decode(tiny_bundle: Path) -> None:
    rng = np.random.default_rng(12)
    bodies = [_jpeg(_photo(rng, 320, 240), o) for o in (1, 6, 3)]
    masks = {}
    for decoder in ("auto", "cpu"):
        app = create_app(tiny_bundle, device="cuda", jpeg_decoder=decoder)
        with TestClient(app) as http:
            deadline = time.monotonic() + 120
            while http.get("/readyz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            ready = http.get("/readyz").json()
            assert ready["jpeg_decoder"]["name"] == ("gpu" if decoder == "auto" else "cpu"), ready
            metrics = http.get("/metrics").text
            assert f'dualtrack_jpeg_decoder{{decoder="{ready["jpeg_decoder"]["name"]}"}} 1.0' in metrics
            masks[decoder] = [imaging.decode_mask_png(http.post("/v1/segment", content=b).content) for b in bodies]
            assert http.post("/v1/segment", content=bodies[0][:-400]).status_code == 400  # truncated: the CPU's 400
    for gpu, cpu in zip(masks["auto"], masks["cpu"], strict=True):
        agreement = float((gpu == cpu).mean())
        print(f"mask agreement GPU decode vs CPU decode: {agreement:.5f}")
        assert gpu.shape == cpu.shape and agreement >= MASK_AGREEMENT


@needs_nvimgcodec
@pytest.mark.parametrize("gpu_signals", ["1", "0"])
def test_workers_send_their_jpegs_to_the_engine_process_gpu_decoder(
    tiny_bundle: Path, gpu_signals, monkeypatch
) -> None:
    """`serve --workers N`: a worker sends a JPEG that route_jpeg gives the GPU as bytes (RunJpeg);
    the engine process decodes it on its GPU with its batch. Its mask agrees with the CPU decode's
    on at least MASK_AGREEMENT of pixels, as in the one-process service. With the GPU marking the
    answers (the default) and without (DUALTRACK_GPU_SIGNALS=0), over rounds that reuse the slots."""
    monkeypatch.setenv("DUALTRACK_GPU_SIGNALS", gpu_signals)
    from dualtrack.runtime.engine import Engine

    rng = np.random.default_rng(13)
    bodies = [_jpeg(_photo(rng, 96, 72), o) for o in (1, 6, 3)]  # each fits one slot of the tiny model's 64x64x3
    with Engine.load(tiny_bundle, "cuda") as e:
        h, w = e.input_spec.shape[1:3]
        want = [e.run(imaging.load_for_model(b, h, w).pixels[None], outputs=("mask",))["mask"][0] for b in bodies]
        with host_and_client(e) as (host, client):
            assert client.decoder[0] == "gpu", client.decoder
            jpegs = [imaging.route_jpeg(b, h, w, max_downscale=RESIZE_RGB.max_downscale) for b in bodies]
            assert all(isinstance(j, imaging.GpuJpeg) for j in jpegs)
            assert bool(host._signals) == (gpu_signals == "1")
            for _ in range(4):
                futures = [client.submit_jpeg(j) for j in jpegs]  # type: ignore[arg-type]
                for f, expected in zip(futures, want, strict=True):
                    result = f.result(120)
                    agreement = float((result.mask == expected).mean())
                    print(f"--workers GPU decode vs CPU decode, mask agreement {agreement:.5f}")
                    assert result.mask.shape == expected.shape and agreement >= MASK_AGREEMENT
                    assert 0 < result.timings["batch_gpu_ms"] == result.run_ms < 120e3
