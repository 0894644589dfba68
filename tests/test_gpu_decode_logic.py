"""The GPU JPEG path and the overlapped engine path as pure logic, with no GPU: which decoder runs,
which JPEGs the GPU takes, the resize kernel's numpy reference against Pillow, the slot ring, the
decode-ahead thread's order and bound (with Pillow decoding for it)."""

from __future__ import annotations

import ctypes
import io
import struct
import threading
import time

import numpy as np
import pytest
from PIL import Image

from dualtrack import imaging
from dualtrack.errors import InputError
from dualtrack.kernels import RESIZE_RGB
from dualtrack.kernels.resize_rgb import ResizeJob, oriented
from dualtrack.runtime.gpu_jpeg import JpegPrefetcher, choose_decoder
from dualtrack.runtime.overlap import SlotRing, SlotState, rows_to_upload

TRANSPOSES = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def _jpeg(rng: np.random.Generator, w: int, h: int, *, mode: str = "RGB", orientation: int = 1) -> bytes:
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    img.save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


# --- which decoder -------------------------------------------------------------------------------


def test_the_gpu_decoder_runs_only_on_a_cuda_engine_with_the_library() -> None:
    assert choose_decoder("cuda", None).name == "gpu"
    cpu_engine = choose_decoder("cpu", None)
    assert cpu_engine.name == "cpu" and "engine runs on cpu" in cpu_engine.reason
    missing = choose_decoder("cuda", "nvImageCodec is not installed")
    assert missing.name == "cpu" and "nvImageCodec is not installed" in missing.reason
    assert choose_decoder("cuda", None, wanted="cpu").name == "cpu"


# --- which JPEGs the GPU takes -------------------------------------------------------------------


def test_a_plain_rgb_jpeg_goes_to_the_gpu_with_its_orientation_and_displayed_size(rng) -> None:
    route = imaging.route_jpeg(_jpeg(rng, 300, 200, orientation=6), 64, 64, max_downscale=8)
    assert isinstance(route, imaging.GpuJpeg)
    assert route.stored == (300, 200) and route.orientation == 6 and route.size == (200, 300)
    # The displayed size is the CPU path's: the mask is resized back to the same size on both paths.
    assert imaging.load_for_model(route.data, 64, 64).size == route.size


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda rng: _jpeg(rng, 64, 64, mode="L"), "a L JPEG"),
        (lambda rng: _jpeg(rng, 64, 64, mode="CMYK"), "a CMYK JPEG"),
        (lambda rng: _jpeg(rng, 1024, 1024), "reduced size"),
        (lambda rng: _jpeg(rng, 600, 64), "downscale over 8x"),
        (lambda rng: _jpeg(rng, 64, 64)[:-300], "truncated"),
    ],
)
def test_jpegs_the_gpu_would_not_decode_as_the_cpu_does_stay_on_the_cpu(rng, make, why) -> None:
    route = imaging.route_jpeg(make(rng), 64, 64, max_downscale=8)
    assert isinstance(route, str) and why in route


def test_a_refused_image_is_refused_the_same_way_whichever_decoder_is_active(rng) -> None:
    for data in (b"not an image", b"\xff\xd8\xff\xe0 corrupt"):
        with pytest.raises(InputError) as on_gpu:
            imaging.route_jpeg(data, 64, 64, max_downscale=8)
        with pytest.raises(InputError) as on_cpu:
            imaging.load_for_model(data, 64, 64)
        assert str(on_gpu.value) == str(on_cpu.value)


# --- the resize kernel's reference ---------------------------------------------------------------


def test_the_orientation_map_is_pillows_exif_transpose(rng) -> None:
    x = rng.integers(0, 256, (7, 5, 3), dtype=np.uint8)
    for orientation, op in TRANSPOSES.items():
        np.testing.assert_array_equal(oriented(x, orientation), np.asarray(Image.fromarray(x).transpose(op)))


def test_the_resize_reference_matches_pillow_bilinear_within_one_level(rng) -> None:
    """Tolerance: 1 of 255 on any pixel, 0 along one axis. The reference (and the kernel) run
    Pillow's two passes horizontal then vertical, as libImaging/Resample.c does; Pillow 13 may
    run them in the other order (measured: equal on a single-axis resize, within 1 level on ~20% of
    the pixels of a two-axis one where it does), and each pass rounds to 8 bits."""
    for _ in range(12):
        h, w = (int(v) for v in rng.integers(2, 700, 2))
        oh, ow = (int(v) for v in rng.integers(2, 200, 2))
        orientation = int(rng.integers(1, 9))
        x = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if RESIZE_RGB.supported(w, h, ow, oh, orientation) is not None:
            continue
        img = Image.fromarray(x)
        if orientation != 1:
            img = img.transpose(TRANSPOSES[orientation])
        want = np.asarray(img.resize((ow, oh), Image.Resampling.BILINEAR)).astype(np.int16)
        got = RESIZE_RGB.reference(x, oh, ow, orientation=orientation)
        assert np.abs(want - got).max() <= 1, (h, w, oh, ow, orientation)
        one_axis = np.asarray(img.resize((ow, img.height), Image.Resampling.BILINEAR))
        np.testing.assert_array_equal(one_axis, RESIZE_RGB.reference(np.asarray(img), img.height, ow))


def test_the_resize_kernel_refuses_a_downscale_it_cannot_hold() -> None:
    assert RESIZE_RGB.supported(512 * 8, 512, 512, 512) is None
    assert "downscale over 8x" in RESIZE_RGB.supported(512 * 8 + 1, 512, 512, 512)
    with pytest.raises(InputError, match="cannot resize"):
        RESIZE_RGB.args(jobs=[ResizeJob(1, 2, 5000, 100, 15000)], out_w=64, out_h=64)


def test_a_batch_of_resizes_travels_in_one_launch_with_every_job_checked() -> None:
    """The jobs go by value in the kernel's parameters (struct ResizeJobs: 32 bytes each, then
    out_w and out_h): each job's fields land where the PTX reads them, at most max_rows a launch."""
    jobs = [ResizeJob(0x1000 * (i + 1), 0x100000 * (i + 1), 640 + i, 480, 1920 + 3 * i, 1 + i % 8) for i in range(70)]
    chunks = RESIZE_RGB.chunks(jobs)
    assert [len(c) for c in chunks] == [RESIZE_RGB.max_rows, 70 - RESIZE_RGB.max_rows]
    [(table, ctype)] = RESIZE_RGB.args(jobs=chunks[1], out_w=320, out_h=256)
    assert ctype is None and ctypes.sizeof(table) == 32 * RESIZE_RGB.max_rows + 8
    raw = bytes(table)
    for i, job in enumerate(chunks[1]):
        src, dst, w, h, pitch, orientation = struct.unpack_from("<QQiiii", raw, 32 * i)
        assert (src, dst, w, h, pitch, orientation) == (job.src, job.dst, job.src_w, job.src_h, job.src_pitch,
                                                        job.orientation)  # fmt: skip
    assert struct.unpack_from("<ii", raw, 32 * RESIZE_RGB.max_rows) == (320, 256)
    assert RESIZE_RGB.launch(320, 256, len(chunks[1])).grid == (20, 16, 6)
    with pytest.raises(InputError, match="at most 64"):
        RESIZE_RGB.launch(320, 256, 65)
    with pytest.raises(InputError, match="1 to 64 jobs"):
        RESIZE_RGB.args(jobs=jobs, out_w=320, out_h=256)
    with pytest.raises(InputError, match="orientation=9"):
        RESIZE_RGB.args(jobs=[ResizeJob(1, 2, 64, 64, 192, 9)], out_w=64, out_h=64)


# --- the overlapped path's ordering --------------------------------------------------------------


def test_rows_the_gpu_wrote_are_not_copied_from_the_host() -> None:
    assert rows_to_upload(8, set()) == [(0, 8)]
    assert rows_to_upload(8, {0, 3, 4, 7}) == [(1, 2), (5, 2)]
    assert rows_to_upload(4, {0, 1, 2, 3}) == []


def test_slots_go_stage_launch_collect_in_one_order() -> None:
    ring = SlotRing(3)
    a, b = ring.begin_stage(), ring.begin_stage()
    assert (a, b) == (0, 1)
    ring.staged(a)
    ring.staged(b)
    with pytest.raises(RuntimeError, match="out of turn"):
        ring.begin_launch(b)
    ring.begin_launch(a)
    ring.launched(a)
    with pytest.raises(RuntimeError, match="is downloading, not running"):
        ring.launched(a)
    c = ring.begin_stage()
    assert c == 2
    with pytest.raises(TimeoutError):  # slot 0 comes round again only once its outputs are collected
        ring.begin_stage(timeout=0.05)
    ring.collected(a)
    assert ring.begin_stage(timeout=1) == 0
    assert ring.states == [SlotState.STAGING, SlotState.STAGED, SlotState.STAGING]


def test_a_stage_waiting_for_a_slot_proceeds_when_the_slot_is_collected() -> None:
    ring = SlotRing(1)
    slot = ring.begin_stage()
    ring.staged(slot)
    ring.begin_launch(slot)
    ring.launched(slot)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(ring.begin_stage(timeout=5)))
    waiter.start()
    waiter.join(0.1)
    assert not got and waiter.is_alive()
    ring.collected(slot)
    waiter.join(5)
    assert got == [0]


def test_an_abandoned_stage_passes_its_launch_turn_on() -> None:
    ring = SlotRing(2)
    a, b = ring.begin_stage(), ring.begin_stage()
    ring.abandon(a)  # its upload failed: it never launches
    ring.staged(b)
    ring.begin_launch(b)
    assert ring.states == [SlotState.FREE, SlotState.RUNNING]


# --- the decode-ahead thread (JpegPrefetcher), with Pillow as its decoder ---------------------------


class _PillowDecodes:
    """A JpegPrefetcher decoder: Pillow's pixels per JPEG, each call's size recorded; ``gate``
    (when set) holds every call until the test opens it."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, jpegs: list[imaging.GpuJpeg]) -> list[object]:
        self.gate.wait(10)
        self.calls.append(len(jpegs))
        return [np.asarray(Image.open(io.BytesIO(j.data)).convert("RGB")) for j in jpegs]


PICTURE = 40 * 30 * 3  # bytes of one decoded picture of _routed's JPEGs


def _routed(rng: np.random.Generator, n: int) -> list[imaging.GpuJpeg]:
    out = []
    for _ in range(n):
        route = imaging.route_jpeg(_jpeg(rng, 40, 30), 64, 64, max_downscale=8)
        assert isinstance(route, imaging.GpuJpeg)
        out.append(route)
    return out


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_prefetcher_decodes_each_jpeg_once_in_order_in_calls_of_at_most_its_batch(rng) -> None:
    decodes = _PillowDecodes()
    decodes.gate.clear()  # the first call waits: the others queue behind it
    prefetch = JpegPrefetcher(decodes, ahead_bytes=16 * PICTURE, most_per_call=3)
    try:
        jpegs = _routed(rng, 7)
        tickets = [prefetch.add(j) for j in jpegs]
        decodes.gate.set()
        for ticket, jpeg in zip(tickets, jpegs, strict=True):
            np.testing.assert_array_equal(prefetch.take(ticket), np.asarray(Image.open(io.BytesIO(jpeg.data))))
        assert sum(decodes.calls) == 7 and max(decodes.calls) <= 3
        for ticket in tickets:
            prefetch.release(ticket)
            assert ticket.image is None and ticket.state == "released"
    finally:
        prefetch.close()


def test_the_prefetcher_holds_at_most_ahead_bytes_but_serves_a_waiting_stager_first(rng) -> None:
    decodes = _PillowDecodes()
    prefetch = JpegPrefetcher(decodes, ahead_bytes=2 * PICTURE + PICTURE // 2, most_per_call=8)
    try:
        tickets = [prefetch.add(j) for j in _routed(rng, 6)]
        assert tickets[0].nbytes == PICTURE
        _wait_until(lambda: sum(decodes.calls) == 2)
        time.sleep(0.05)
        assert sum(decodes.calls) == 2  # the bound: two pictures held (a third does not fit), four JPEGs still bytes
        assert [t.state for t in tickets] == ["decoded"] * 2 + ["queued"] * 4
        assert isinstance(prefetch.take(tickets[3]), np.ndarray)  # past the bound: a stager waits for it
        prefetch.release(tickets[0])
        prefetch.release(tickets[4])  # withdrawn before its decode: never decoded
        for t in tickets[1:4]:
            prefetch.release(t)
        _wait_until(lambda: tickets[5].state == "decoded")  # room again: the next in line
        prefetch.release(tickets[5])
        assert sum(decodes.calls) == 5 and tickets[4].image is None
    finally:
        prefetch.close()


def test_a_picture_larger_than_the_bound_is_still_decoded_alone(rng) -> None:
    """One picture may always be held, however large: the bound only keeps others from joining it."""
    decodes = _PillowDecodes()
    prefetch = JpegPrefetcher(decodes, ahead_bytes=PICTURE // 2, most_per_call=8)
    try:
        tickets = [prefetch.add(j) for j in _routed(rng, 2)]
        _wait_until(lambda: tickets[0].state == "decoded")
        time.sleep(0.05)
        assert tickets[1].state == "queued" and decodes.calls == [1]
        prefetch.release(tickets[0])
        _wait_until(lambda: tickets[1].state == "decoded")
        prefetch.release(tickets[1])
    finally:
        prefetch.close()


class _HeldLane(_PillowDecodes):
    """A decode lane that says when a call has begun, and finishes it only once its gate opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.clear()
        self.entered = threading.Event()

    def __call__(self, jpegs: list[imaging.GpuJpeg]) -> list[object]:
        self.entered.set()
        return super().__call__(jpegs)


def test_with_several_lanes_a_jpeg_is_decoded_while_another_lane_is_busy(rng) -> None:
    lanes = [_HeldLane(), _HeldLane()]
    prefetch = JpegPrefetcher(lanes, ahead_bytes=16 * PICTURE, most_per_call=8)
    try:
        first, second = _routed(rng, 2)
        a = prefetch.add(first)
        _wait_until(lambda: any(lane.entered.is_set() for lane in lanes))  # one lane is inside a's decode
        b = prefetch.add(second)
        # b does not wait for a's decode: the other lane takes it while the first is still held.
        _wait_until(lambda: all(lane.entered.is_set() for lane in lanes))
        assert a.state == b.state == "decoding"
        for lane in lanes:
            lane.gate.set()
        for ticket, jpeg in ((a, first), (b, second)):
            np.testing.assert_array_equal(prefetch.take(ticket), np.asarray(Image.open(io.BytesIO(jpeg.data))))
            prefetch.release(ticket)
        assert [lane.calls for lane in lanes] == [[1], [1]]
    finally:
        for lane in lanes:
            lane.gate.set()
        prefetch.close()


def test_a_failed_decode_refuses_its_jpegs_and_close_frees_what_is_held(rng) -> None:
    def broken(jpegs: list[imaging.GpuJpeg]) -> list[object]:
        raise RuntimeError("decoder lost")

    prefetch = JpegPrefetcher(broken, ahead_bytes=4 * PICTURE, most_per_call=4)
    ticket = prefetch.add(_routed(rng, 1)[0])
    why = prefetch.take(ticket)
    assert isinstance(why, str) and "decoder lost" in why
    prefetch.close()

    decodes = _PillowDecodes()
    prefetch = JpegPrefetcher(decodes, ahead_bytes=PICTURE, most_per_call=4)
    held, queued = (prefetch.add(j) for j in _routed(rng, 2))
    _wait_until(lambda: held.state == "decoded")
    prefetch.close()
    assert held.image is None and held.state == "released"
    assert prefetch.take(queued) == "the GPU decoder is shutting down"  # never decoded: the CPU path takes it
    late = prefetch.add(_routed(rng, 1)[0])
    assert prefetch.take(late) == "the GPU decoder is shutting down"
