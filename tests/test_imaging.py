"""dualtrack.imaging, the one decoder of `dualtrack run` and the service: every pixel rule against a
reference computed here with numpy (exact unless a tolerance is stated), the refusals (several
frames, too many pixels: before any pixel is decoded), JPEG draft decoding and the memory budget."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image

from dualtrack import imaging
from dualtrack.contract.plan import TensorSpec
from dualtrack.errors import InputError

WHITE = 255


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()


# --- helpers: images written byte by byte, references in numpy -------------------------------


def _chunk(tag: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + tag + payload + struct.pack(">I", zlib.crc32(payload, zlib.crc32(tag)))


def raw_png(
    samples: np.ndarray,
    color_type: int,
    *,
    bit_depth: int = 16,
    claim: tuple[int, int] | None = None,
    orientation: int | None = None,
) -> bytes:
    """A PNG written without Pillow: ``samples`` (h, w[, c]) big-endian at ``bit_depth``, filter 0;
    ``claim`` puts another (width, height) in the header than the data holds; ``orientation`` adds
    an eXIf chunk."""
    height, width = samples.shape[:2]
    dtype = ">u2" if bit_depth == 16 else "u1"
    rows = b"".join(b"\0" + samples[y].astype(dtype).tobytes() for y in range(height))
    header = struct.pack(">IIBBBBB", *(claim or (width, height)), bit_depth, color_type, 0, 0, 0)
    sig = b"\x89PNG\r\n\x1a\n"
    exif = _chunk(b"eXIf", _with_orientation(orientation)[6:]) if orientation else b""  # without "Exif\0\0"
    return sig + _chunk(b"IHDR", header) + exif + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b"")


def on_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Round((c * a + 255 * (255 - a)) / 255), in int64."""
    rgb, a = rgb.astype(np.int64), alpha.astype(np.int64)[..., None]
    return ((rgb * a + WHITE * (255 - a)) * 2 + 255) // 510  # round half up, exactly


def grey3(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[..., None], 3, axis=-1)


def png_of(img: Image.Image, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **save)
    return buf.getvalue()


def resized(reference: np.ndarray, height: int, width: int) -> np.ndarray:
    """The model input the contract promises: the reference RGB, resized bilinear by Pillow."""
    img = Image.fromarray(reference.astype(np.uint8), mode="RGB")
    return np.asarray(img.resize((width, height), Image.Resampling.BILINEAR))


def assert_decodes_to(data: bytes, reference: np.ndarray) -> None:
    """decode_image gives ``reference`` exactly, and load_for_model its bilinear resize (65x47: both ways)."""
    got = np.asarray(imaging.decode_image(data))
    assert got.dtype == np.uint8 and got.shape == reference.shape
    np.testing.assert_array_equal(got, reference)
    model = imaging.load_for_model(data, 65, 47)
    assert model.size == (reference.shape[1], reference.shape[0])
    np.testing.assert_array_equal(model.pixels, resized(reference, 65, 47))


# --- to 8-bit RGB --------------------------------------------------------------------------------


def test_16_bit_grey_is_scaled_by_its_high_byte_not_clipped(rng) -> None:
    samples = rng.integers(0, 65536, (37, 53), dtype=np.uint16)
    samples[0, :4] = [0, 255, 256, 65535]  # the edges of the rule: 0, 0, 1, 255
    data = raw_png(samples, color_type=0)
    with Image.open(io.BytesIO(data)) as img:
        assert img.mode == "I;16"  # what Pillow makes of it: the case that used to clip to white
    assert_decodes_to(data, grey3((samples >> 8).astype(np.uint8)))


def test_48_bit_rgb_keeps_the_high_byte(rng) -> None:
    samples = rng.integers(0, 65536, (30, 41, 3), dtype=np.uint16)
    assert_decodes_to(raw_png(samples, color_type=2), (samples >> 8).astype(np.uint8))


def test_16_bit_grey_with_an_exif_chunk_is_turned(rng) -> None:
    samples = rng.integers(0, 65536, (30, 41), dtype=np.uint16)
    upright = np.ascontiguousarray(UPRIGHT[6](grey3((samples >> 8).astype(np.uint8))))
    assert_decodes_to(raw_png(samples, color_type=0, orientation=6), upright)


def test_16_bit_grey_with_alpha_is_composited_on_white(rng) -> None:
    samples = rng.integers(0, 65536, (30, 41, 2), dtype=np.uint16)
    grey, alpha = samples[..., 0] >> 8, samples[..., 1] >> 8
    assert_decodes_to(raw_png(samples, color_type=4), on_white(grey3(grey), alpha))


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_wide_modes_in_memory_follow_the_same_rule(rng, mode: str) -> None:
    samples = rng.integers(0, 65536, (20, 30), dtype=np.int64)
    dtype = {"I;16": "<u2", "I;16B": ">u2", "I": "<i4"}[mode]
    img = Image.frombytes(mode, (30, 20), samples.astype(dtype).tobytes())
    np.testing.assert_array_equal(np.asarray(imaging.to_rgb(img)), grey3((samples >> 8).astype(np.uint8)))


def test_32_bit_samples_outside_16_bits_are_clipped_to_its_range() -> None:
    img = Image.frombytes("I", (3, 1), np.array([-5, 70000, 0x8000], "<i4").tobytes())
    np.testing.assert_array_equal(np.asarray(imaging.to_rgb(img))[0, :, 0], [0, 255, 128])


def test_palette_with_transparency_is_composited_on_white(rng) -> None:
    palette = rng.integers(0, 256, (16, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, 16, dtype=np.uint8)
    alpha[:2] = [0, 255]
    index = rng.integers(0, 16, (33, 45), dtype=np.uint8)
    img = Image.fromarray(index, mode="P")
    img.putpalette(palette.ravel().tolist())
    data = png_of(img, transparency=alpha.tobytes())
    with Image.open(io.BytesIO(data)) as back:
        assert back.mode == "P" and "transparency" in back.info
    assert_decodes_to(data, on_white(palette[index], alpha[index]))


def test_palette_without_transparency_takes_its_colours(rng) -> None:
    palette = rng.integers(0, 256, (256, 3), dtype=np.uint8)
    index = rng.integers(0, 256, (33, 45), dtype=np.uint8)
    img = Image.fromarray(index, mode="P")
    img.putpalette(palette.ravel().tolist())
    assert_decodes_to(png_of(img), palette[index])


def test_grey_with_alpha_is_composited_on_white(rng) -> None:
    la = rng.integers(0, 256, (31, 29, 2), dtype=np.uint8)
    assert_decodes_to(png_of(Image.fromarray(la, mode="LA")), grey3(on_white(grey3(la[..., 0]), la[..., 1])[..., 0]))


def test_rgba_is_composited_on_white(rng) -> None:
    rgba = rng.integers(0, 256, (31, 29, 4), dtype=np.uint8)
    rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255
    assert_decodes_to(png_of(Image.fromarray(rgba, mode="RGBA")), on_white(rgba[..., :3], rgba[..., 3]))


def test_rgb_colour_key_becomes_white(rng) -> None:
    rgb = rng.integers(0, 200, (20, 24, 3), dtype=np.uint8)
    rgb[3:6, 4:9] = (250, 1, 2)
    data = png_of(Image.fromarray(rgb), transparency=(250, 1, 2))
    reference = rgb.copy()
    reference[np.all(rgb == (250, 1, 2), axis=-1)] = WHITE
    assert_decodes_to(data, reference)


def test_greyscale_is_copied_to_three_channels(rng) -> None:
    grey = rng.integers(0, 256, (44, 39), dtype=np.uint8)
    assert_decodes_to(png_of(Image.fromarray(grey, mode="L")), grey3(grey))


def test_cmyk_jpeg_is_converted_by_the_cmyk_formula(rng) -> None:
    cmyk = rng.integers(0, 256, (24, 32, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(cmyk, mode="CMYK").save(buf, format="JPEG", quality=95)
    with Image.open(io.BytesIO(buf.getvalue())) as img:
        assert img.mode == "CMYK"
        decoded = np.asarray(img).astype(np.int64)  # the codec's CMYK: the conversion is what is tested
    c, k = decoded[..., :3], decoded[..., 3:]
    reference = ((255 - c) * (255 - k) * 2 + 255) // 510  # round((255 - C)(255 - K) / 255)
    assert_decodes_to(buf.getvalue(), reference)


# --- orientation ---------------------------------------------------------------------------------

# The numpy turn that displays an image stored with each EXIF orientation (TIFF 6.0, tag 274).
UPRIGHT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, k=-1),
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),
    8: lambda a: np.rot90(a, k=1),
}


def _with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


@pytest.mark.parametrize("orientation", sorted(UPRIGHT))
def test_exif_orientation_is_applied_and_the_size_is_the_displayed_one(rng, orientation: int) -> None:
    pixels = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    data = png_of(Image.fromarray(pixels), exif=_with_orientation(orientation))
    assert_decodes_to(data, np.ascontiguousarray(UPRIGHT[orientation](pixels)))


# --- refusals ------------------------------------------------------------------------------------


def test_an_animated_png_is_refused_with_its_frame_count(rng) -> None:
    frames = [Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)) for _ in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    for read in (imaging.decode_image, lambda d: imaging.load_for_model(d, 8, 8)):
        with pytest.raises(InputError, match=r"^image is an animated PNG of 3 frames; .*save the frame you want"):
            read(buf.getvalue())


def test_a_jpeg_with_an_extra_mpf_picture_is_its_primary_picture(rng) -> None:
    first = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(first).save(
        buf, format="MPO", save_all=True, append_images=[Image.new("RGB", (16, 16), (0, 255, 0))], quality=100
    )
    with Image.open(io.BytesIO(buf.getvalue())) as img:
        assert (img.format, img.n_frames) == ("MPO", 2)
        primary = np.asarray(img.convert("RGB"))  # the codec's frame 0: what the contract promises
    np.testing.assert_array_equal(np.asarray(imaging.decode_image(buf.getvalue())), primary)


def test_gif_is_refused_naming_the_accepted_formats() -> None:
    buf = io.BytesIO()
    Image.new("P", (4, 4)).save(buf, format="GIF")
    with pytest.raises(InputError, match=r"^not a PNG or JPEG image \(\d+ bytes starting b'GIF8"):
        imaging.decode_image(buf.getvalue())
    with pytest.raises(InputError, match=r"^x\.gif is a GIF image; dualtrack reads PNG and JPEG: convert it to PNG$"):
        imaging.decode_image(buf.getvalue(), name="x.gif")


def _peak_rss_growth_mb(fn: Callable[[], object]) -> float:
    """How far the process's peak RSS rises while ``fn`` runs (Linux: VmHWM, reset first)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status("VmRSS")
    fn()
    return (status("VmHWM") - before) / 1024


def _refused(data: bytes, pattern: str) -> Callable[[], None]:
    def attempt() -> None:
        with pytest.raises(InputError, match=pattern):
            imaging.load_for_model(data, 64, 64)

    return attempt


@pytest.mark.parametrize(
    ("width", "height", "pattern"),
    [
        (9000, 9000, r"^image is 9000x9000 = 81000000 pixels, over the limit of 67108864 \(64 megapixels\)"),
        (8193, 8192, r"^image is 8193x8192 = 67117056 pixels, over the limit"),  # one column over
        (100_000, 100_000, r"^image refused before decoding, over the limit of 67108864 pixels"),  # Pillow's own
    ],
)
def test_a_png_over_the_pixel_limit_is_refused_from_its_header(width: int, height: int, pattern: str) -> None:
    # The header claims the size; the data is one row. A decoder that trusted it would allocate first.
    data = raw_png(np.zeros((1, 16), np.uint8), color_type=0, bit_depth=8, claim=(width, height))
    start = time.perf_counter()
    growth = _peak_rss_growth_mb(_refused(data, pattern))
    assert time.perf_counter() - start < 0.5
    assert growth < 8, f"peak RSS rose {growth:.0f} MB: pixels were allocated"


def test_a_real_png_over_the_limit_is_refused_without_decoding() -> None:
    data = png_of(Image.new("L", (9000, 8000)))  # 72 megapixels, 70 KB: a decode would take 72 MB
    start = time.perf_counter()
    growth = _peak_rss_growth_mb(_refused(data, r"^image is 9000x8000 = 72000000 pixels, over the limit"))
    assert time.perf_counter() - start < 0.5 and growth < 8, growth


def test_a_jpeg_claiming_gigapixels_is_refused_from_its_header() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 65000, 65000)  # height, width in the frame header
    growth = _peak_rss_growth_mb(_refused(bytes(data), r"^image refused before decoding, over the limit"))
    assert growth < 8


def test_the_cli_names_the_file_in_its_refusals() -> None:
    with pytest.raises(InputError, match=r"^photo\.png is empty \(0 bytes\); pass a PNG or JPEG$"):
        imaging.decode_image(b"", name="photo.png")
    with pytest.raises(InputError, match=r"^notes\.txt is not an image Pillow can read"):
        imaging.decode_image(b"hello", name="notes.txt")


# --- JPEG draft ----------------------------------------------------------------------------------


def _smooth(height: int, width: int) -> np.ndarray:
    """A smooth picture (JPEG's and DCT scaling's good case): gradients and a low-frequency wave."""
    y, x = np.mgrid[0:height, 0:width]
    r = 255 * x / width
    g = 255 * y / height
    b = 127.5 + 100 * np.sin(x / 97.0) * np.cos(y / 131.0)
    return np.stack([r, g, b], axis=-1).round().astype(np.uint8)


def _jpeg(pixels: np.ndarray, **save: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=92, **save)
    return buf.getvalue()


def test_a_large_jpeg_is_decoded_at_reduced_size_with_the_same_picture() -> None:
    pixels = _smooth(3000, 4000)
    data = _jpeg(pixels)
    model = imaging.load_for_model(data, 64, 64)
    # 1/8 scale: 500x375 is still at least twice the model's 64x64 (1/16 is not a JPEG scale).
    assert model.decoded == (500, 375) and model.size == (4000, 3000)
    full = resized(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), 64, 64).astype(np.int64)
    diff = np.abs(model.pixels.astype(np.int64) - full)
    assert diff.mean() < 0.5 and diff.max() <= 2, (diff.mean(), diff.max())  # stated tolerance for DCT scaling


def test_draft_keeps_twice_the_model_size_and_follows_the_orientation() -> None:
    data = _jpeg(_smooth(1000, 600), exif=_with_orientation(6))  # stored 600 wide, displayed 1000 wide
    model = imaging.load_for_model(data, 100, 200)  # the model wants 200 wide, 100 high (as displayed)
    # As stored the codec must keep 2x(100, 200) = 200 wide and 400 high: 1/2 of 600x1000 (1/4 is 150 wide).
    assert model.decoded == (300, 500) and model.size == (1000, 600)
    assert imaging.load_for_model(data, 300, 300).decoded == (600, 1000)  # not 4x smaller: decoded whole


# --- the bundle check ----------------------------------------------------------------------------


def test_a_bundle_that_takes_tensors_or_gives_no_mask_is_refused() -> None:
    image = TensorSpec("image", (1, 64, 64, 3), "uint8", "NHWC")
    mask, probs = TensorSpec("mask", (1, 64, 64), "uint8"), TensorSpec("probs", (1, 2, 64, 64), "float32")
    imaging.check_image_model(image, (mask, probs), "b")  # the reference model's: accepted
    with pytest.raises(InputError, match=r"^bundle b takes \(n, 3, 256, 256\) float32, not an image; add `prep"):
        imaging.check_image_model(TensorSpec("x", (1, 3, 256, 256), "float32"), (mask,), "b")
    with pytest.raises(InputError, match=r"^bundle b's outputs are probs \(n, 2, 64, 64\) float32; build it with"):
        imaging.check_image_model(image, (probs,), "b")


# --- the memory budget ---------------------------------------------------------------------------


def test_memory_budget_bounds_the_bytes_in_flight_and_trims_once_drained() -> None:
    trims: list[float] = []
    budget = imaging.MemoryBudget(100, trim_after=50, release=lambda: trims.append(time.monotonic()) or True)
    peak, lock = [0], threading.Lock()

    def work(nbytes: int) -> None:
        with budget.hold(nbytes):
            with lock:
                peak[0] = max(peak[0], budget.in_use)
            time.sleep(0.02)

    threads = [threading.Thread(target=work, args=(n,)) for n in (40, 40, 40, 30, 250, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert peak[0] <= 100  # the 250-byte hold ran alone, counted as the whole budget
    assert budget.in_use == 0 and trims  # trimmed once drained after a large hold


def test_mallopt_and_malloc_trim_are_reached_on_linux() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt and malloc_trim are glibc's")
    # In a process of its own: the mmap threshold is process-wide.
    code = "from dualtrack import imaging; print(imaging.map_large_buffers(), imaging.release_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split()[0] == "True" and out.stdout.split()[1] in ("True", "False")
