"""Image bytes in, model input out; model mask in, mask out. One module for ``dualtrack run``, the
service (``dualtrack serve``) and its page, so a file gives the same pixels to the model everywhere.

The contract (the service's clients and the CLI's users can rely on it):

- **Accepted input**: PNG or JPEG, nothing else (no GIF, TIFF, WebP: convert them). A JPEG with
  extra MPF pictures (a camera's preview, an Ultra HDR gain map) is its primary picture: those are
  not frames.
- **One frame**: an image of several frames (an animated PNG) is refused with the frame count,
  never reduced to its first frame: segmenting a frame the user did not choose would be a silently
  wrong answer.
- **Pixel limit**: images over :data:`MAX_PIXELS` (64 megapixels, 8192x8192) are refused from the
  header, before a pixel is decoded, so a small file that claims or inflates to gigapixels costs
  nothing. Pillow's own decompression-bomb error (at twice its 89-megapixel limit) is reported the
  same way.
- **Orientation**: EXIF orientation (1-8) is applied first, so a phone photo is segmented the way it
  is displayed, and the mask comes back at the displayed size.
- **To 8-bit RGB, scaled, never clipped**: 16-bit samples (``I;16``, ``I;16B``, ``I``; 48- and
  64-bit PNGs, which Pillow already gives as 8-bit ``RGB``/``RGBA``) keep their high byte,
  ``value >> 8`` (the rule Pillow and libpng use for the 48-bit PNGs, so every 16-bit image follows
  one rule). Greyscale is copied to the three channels; palette images take their palette colours;
  CMYK is ``(255 - C) * (255 - K) / 255`` (rounded; Pillow's conversion). Transparency (an alpha
  channel, a palette's tRNS, a colour key) is composited onto white, rounded: the colour stored
  under a transparent pixel is arbitrary (often black), and the model should see what a viewer
  shows on a white page.
- **To the model**: the whole image is resized to the model's ``H×W`` with bilinear filtering
  (Pillow ``Image.Resampling.BILINEAR``), aspect ratio not kept, given as ``uint8`` RGB NHWC. A
  JPEG at least four times the model's size in both directions is decoded at 1/2, 1/4 or 1/8 scale
  by the codec (``Image.draft``), never below twice the model's size, then resized the same way.
  Greyscale images are resized before being copied to three channels (the same pixels, a third of
  the memory). No normalisation: the bundle's input is ``uint8`` and the model owns it.
- **At its own size** (a bundle built with ``sizes``, contract/sizes.py): an image that a compiled
  size holds (both dims) is not resized: the engine pads it by its edge pixels and crops the mask back,
  so the mask is at the image's own size with no resampling. One larger than every compiled size is
  resized to the largest, as above (or, where the bundle has a sliding window, kept at its size).
- **Back**: the ``H×W`` mask of class ids is resized to the displayed image size with
  nearest-neighbour filtering, so every pixel still holds a class id. The service answers it as an
  8-bit grayscale PNG (pixel value = class id ``0 .. classes-1``, not scaled to 0..255).

**Memory** (the service): a decode holds several full-size buffers (the decoded image and its RGB
conversion: up to 9 bytes a pixel, :func:`decode_bytes`), and so does a mask resized to a large
image (:func:`mask_bytes`), so :class:`MemoryBudget` caps the bytes of those in flight, whatever the
number of image threads; one larger than the whole budget runs alone. glibc serves large blocks
from per-thread arenas that keep their peak, so the service maps every allocation over 4 MiB on its
own (:func:`map_large_buffers`) and calls ``malloc_trim(0)`` when the budget drains
(:func:`release_freed_memory`). Measured with ``dualtrack serve`` of the tiny bundle on 2 cores, 8
image threads, the 1 GiB default budget, 50 concurrent 8192x8192 palette PNGs (8 KB each; the test
``test_memory_stays_bounded_under_a_burst_of_large_images``), RSS from /proc: before this module a
13.4 GB peak with 13.1 GB held 10 s later (greyscale PNGs, in-process server); with the budget and
trim alone, a 1.8 GB peak and 141-173 MB held after from 80 MB idle (each arena kept its own); with
the mmap threshold too, a 1.05 GB peak and 94 MB at once after the burst. ``MALLOC_ARENA_MAX=1``
gave as much (1.16 GB, 92 MB) but only takes effect before the process starts its threads.

Every failure raises :class:`~dualtrack.errors.InputError` (exit code 10) whose one line gives the
reason and the fix.
"""

from __future__ import annotations

import ctypes
import io
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from dualtrack.contract import sizes as size_rule
from dualtrack.errors import InputError

if TYPE_CHECKING:
    from dualtrack.contract.plan import TensorSpec

ACCEPTED_FORMATS = ("PNG", "JPEG")
# 64 megapixels: larger than any camera image a client sends here, small enough that a hostile PNG
# (a few KiB that inflate to gigabytes) is refused from its header, before it is decompressed.
MAX_PIXELS = 64 * 1024 * 1024
# Formats whose extra pictures are not frames of the picture (MPO: a JPEG with MPF previews or gain maps).
_SINGLE_PICTURE_FORMATS = ("JPEG", "MPO")
# Orientations 5-8 turn the picture a quarter: the displayed width is the stored height.
_QUARTER_TURNS = (5, 6, 7, 8)
_WHITE = 255

# Peak bytes per pixel of a decode, by the mode Pillow decodes to: the decoded image plus what the
# conversion to RGB allocates at full size. Pillow keeps 1, L and P in 1 byte a pixel, I;16 in 2 and
# every other mode in 4. Greyscale is resized before it is widened (no full-size RGB); I;16 goes
# through numpy (a copy of the samples, the shifted copy, the 8-bit result); transparency adds the
# white RGB canvas it is composited onto (and, for a palette, its RGBA expansion).
_DECODE_BYTES_PER_PIXEL = {
    "1": 2,
    "L": 1,
    "P": 5,
    "RGB": 4,
    "CMYK": 8,
    "YCbCr": 8,
    "I;16": 7,
    "I;16B": 7,
    "I;16L": 7,
    "I": 17,
    "LA": 7,
    "RGBA": 8,
}
_TRANSPARENT_PALETTE_BYTES_PER_PIXEL = 9  # P (1) + its RGBA expansion (4) + the white canvas (4)
_OTHER_BYTES_PER_PIXEL = 17  # a mode not in the table: assume the widest path


@dataclass(frozen=True)
class ModelImage:
    """An image ready for the model: ``pixels`` at the model's size (or the image's own: ``sizes``),
    ``size`` to resize the mask back to."""

    pixels: np.ndarray  # (H, W, 3) uint8 RGB at the model's size, or at the image's own where a compiled size holds it
    size: tuple[int, int]  # (width, height) of the image as displayed (EXIF orientation applied)
    decoded: tuple[int, int]  # (width, height) the codec decoded, as stored: smaller where a JPEG was drafted


def load_for_model(
    data: bytes,
    height: int,
    width: int,
    *,
    sizes: Sequence[size_rule.Size] = (),
    window: bool = False,
    budget: MemoryBudget | None = None,
    name: str | None = None,
) -> ModelImage:
    """Decode PNG or JPEG bytes and resize them to the model's ``height×width`` (the module's contract).

    ``sizes``: the compiled sizes of a bundle that takes images at their own size (``Engine.sizes``):
    an image one of them holds (any image, with ``window``: the bundle has a sliding window) keeps its
    size, and only one larger than all of them is resized to ``height×width`` (the largest).
    ``budget`` (the service's) holds the decode until its bytes fit; ``name`` (a path, for the CLI)
    names the image in errors, which otherwise speak of the request body. Raises :class:`InputError`.
    """
    with _open(data, name) as img:
        stored = img.size
        if not sizes or _resized(img, sizes, window):
            _draft(img, height, width)
        decoded = img.size
        with budget.hold(decode_bytes(img)) if budget is not None else nullcontext():
            try:
                turns = _load_oriented(img, data, name)
                shown_hw = (img.height, img.width)  # upright now
                own = sizes and size_rule.choose(shown_hw, sizes, window=window).mode != size_rule.RESIZE
                pixels = to_model_input(to_rgb(img, keep_grey=True), *(shown_hw if own else (height, width)))
            finally:
                img.close()  # the full-size pixels are freed before the budget is given back (and trimmed)
    shown = (stored[1], stored[0]) if turns in _QUARTER_TURNS else stored
    return ModelImage(pixels, shown, decoded)


@dataclass(frozen=True)
class GpuJpeg:
    """A JPEG the GPU decoder may take (:func:`route_jpeg`): its bytes and what its header says."""

    data: bytes
    stored: tuple[int, int]  # (width, height) as stored
    orientation: int  # EXIF orientation 1-8, applied on the GPU by the resize kernel

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) as displayed: what the mask is resized back to."""
        w, h = self.stored
        return (h, w) if self.orientation in _QUARTER_TURNS else (w, h)


def route_jpeg(data: bytes, height: int, width: int, *, max_downscale: int) -> GpuJpeg | str:
    """Whether the GPU decoder takes ``data`` (a :class:`GpuJpeg`) or, with the reason, the CPU path.

    The header is read here with the CPU path's own checks, so a refused image (not PNG/JPEG, over
    :data:`MAX_PIXELS`, several frames, an unreadable header) raises the same :class:`InputError`
    whichever decoder is active. The GPU takes a baseline or progressive 3-component (YCbCr) JPEG
    that the CPU path would decode at full size and that ends in its EOI marker; greyscale and CMYK
    (the decoder would not give the CPU path's RGB), a JPEG the CPU path decodes at reduced size
    (``Image.draft``: at least four times the model's size both ways), a downscale over
    ``max_downscale`` per axis (more taps than the resize kernel holds) and a truncated stream (the
    CPU path answers it 400; nvJPEG might fill it in) go to the CPU path.
    """
    with _open(data, None) as img:
        if img.format not in _SINGLE_PICTURE_FORMATS:
            return f"{img.format} is decoded on the CPU"
        if img.mode != "RGB":
            return f"a {img.mode} JPEG is decoded on the CPU (the GPU decoder gives RGB from YCbCr only)"
        turns = _orientation(img)
        stored = img.size
        want = (2 * width, 2 * height)
        if turns in _QUARTER_TURNS:
            want = (want[1], want[0])
        if img.width >= 2 * want[0] and img.height >= 2 * want[1]:
            return "a large JPEG is decoded on the CPU at reduced size (DCT scaling)"
    shown = (stored[1], stored[0]) if turns in _QUARTER_TURNS else stored
    if shown[0] > max_downscale * width or shown[1] > max_downscale * height:
        return f"a downscale over {max_downscale}x is resized on the CPU"
    sos = data.find(b"\xff\xda")
    if sos < 0 or data.rfind(b"\xff\xd9") < sos:  # entropy-coded data cannot hold FFD9: no EOI after SOS
        return "a JPEG without its end marker is decoded on the CPU (truncated)"
    return GpuJpeg(data, stored, turns)


def decode_image(data: bytes, *, name: str | None = None) -> Image.Image:
    """Decode PNG or JPEG bytes into a full-size 8-bit RGB image with EXIF orientation applied.

    Raises :class:`InputError` naming the reason: empty, not PNG/JPEG, several frames, too many
    pixels, truncated or corrupt data.
    """
    with _open(data, name) as img:
        _load_oriented(img, data, name)
        return to_rgb(img)


def decode_bytes(img: Image.Image) -> int:
    """Peak bytes that decoding ``img`` (opened, not loaded) and converting it to RGB allocate."""
    per_pixel = _DECODE_BYTES_PER_PIXEL.get(img.mode, _OTHER_BYTES_PER_PIXEL)
    if img.mode == "P" and "transparency" in img.info:
        per_pixel = _TRANSPARENT_PALETTE_BYTES_PER_PIXEL
    elif img.mode in ("L", "RGB") and "transparency" in img.info:
        per_pixel += 4 + 1  # the RGBA or LA expansion the colour key goes through
    return img.width * img.height * per_pixel


def mask_bytes(width: int, height: int) -> int:
    """Peak bytes of a mask resized to ``width×height`` and encoded or counted: the resized image,
    its numpy copy, then the PNG scanlines (or a count's comparison) and the compressed stream."""
    return width * height * 4


def to_model_input(img: Image.Image, height: int, width: int) -> np.ndarray:
    """Resize ``img`` (RGB, or L: copied to three channels after the resize) to ``height×width`` with
    bilinear filtering; return ``(H, W, 3)`` uint8.

    The array is read-only: it is Pillow's export of the pixels, not a copy of it (the batcher
    copies it once, into the batch's input buffer).
    """
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    if img.size != (width, height):
        img = img.resize((width, height), Image.Resampling.BILINEAR)
    if img.mode == "L":  # widening commutes with the per-channel resize: the same pixels
        img = img.convert("RGB")
    return np.asarray(img, dtype=np.uint8)


def check_image_model(input_spec: TensorSpec, output_specs: Sequence[TensorSpec], bundle: str) -> None:
    """Refuse a bundle that does not take images or give a mask: its input must be ``(n, H, W, 3)``
    uint8 and one output must be ``mask``. Raises :class:`InputError` naming what the bundle has."""
    shape, dtype = input_spec.shape, input_spec.dtype
    if len(shape) != 4 or shape[3] != 3 or dtype != "uint8":
        takes = f"(n, {', '.join(map(str, shape[1:]))}) {dtype}"
        raise InputError(
            f"bundle {bundle} takes {takes}, not an image; add `preprocess:` to the config to build an image model"
        )
    if not any(o.name == "mask" for o in output_specs):
        outputs = ", ".join(f"{o.name} (n, {', '.join(map(str, o.shape[1:]))}) {o.dtype}" for o in output_specs)
        raise InputError(
            f"bundle {bundle}'s outputs are {outputs}; build it with `postprocess:` in the config so it outputs a mask"
        )


# --- decoding ------------------------------------------------------------------------------------


def _subject(name: str | None) -> str:
    return name if name is not None else "image"


def _open(data: bytes, name: str | None) -> Image.Image:
    """Open ``data`` (the header only) and refuse it, before any pixel is decoded, for its format,
    its frame count or its size."""
    subject = _subject(name)
    if not data:
        if name is None:
            raise InputError("empty image: send PNG or JPEG bytes as the body or as the multipart field `image`")
        raise InputError(f"{name} is empty (0 bytes); pass a PNG or JPEG")
    try:
        img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except UnidentifiedImageError:
        raise InputError(_not_accepted(data, name)) from None
    except Image.DecompressionBombError as err:
        raise InputError(
            f"{subject} refused before decoding, over the limit of {MAX_PIXELS} pixels ({err}); downscale it"
        ) from None
    except (OSError, SyntaxError, ValueError, struct.error) as err:
        # A header Pillow recognised but could not parse.
        raise InputError(f"corrupt {img_format(data)} {subject} ({err}); re-export it as PNG or JPEG") from None
    pixels = img.width * img.height
    if pixels > MAX_PIXELS:
        img.close()
        raise InputError(
            f"{subject} is {img.width}x{img.height} = {pixels} pixels, over the limit of {MAX_PIXELS} "
            f"(64 megapixels): downscale it first"
        )
    frames = getattr(img, "n_frames", 1)
    if frames > 1 and img.format not in _SINGLE_PICTURE_FORMATS:
        img.close()
        raise InputError(
            f"{subject} is an animated {img.format} of {frames} frames; dualtrack segments one still "
            f"picture: save the frame you want as a PNG or JPEG"
        )
    return img


def _not_accepted(data: bytes, name: str | None) -> str:
    """Why ``data`` is refused as neither PNG nor JPEG (the file's real format when Pillow knows it)."""
    if name is None:
        return f"not a PNG or JPEG image ({len(data)} bytes starting {data[:8]!r}): send PNG or JPEG bytes"
    try:  # the user's own file: worth naming what it is
        with Image.open(io.BytesIO(data)) as other:
            return f"{name} is a {other.format} image; dualtrack reads PNG and JPEG: convert it to PNG"
    except Exception:
        return f"{name} is not an image Pillow can read (UnidentifiedImageError); pass a PNG or JPEG"


def img_format(data: bytes) -> str:
    """``"PNG"`` or ``"JPEG"`` from the magic bytes, ``"image"`` when neither (for error messages)."""
    if data.startswith(b"\x89PNG"):
        return "PNG"
    if data.startswith(b"\xff\xd8"):
        return "JPEG"
    return "image"


def _orientation(img: Image.Image) -> int:
    value = img.getexif().get(ExifTags.Base.Orientation, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _resized(img: Image.Image, sizes: Sequence[size_rule.Size], window: bool) -> bool:
    """Whether an image (header read, not decoded) goes the resize path of a bundle of ``sizes``: the
    only case where a JPEG may be decoded at a reduced scale. A PNG's orientation may follow its
    pixels, but a PNG is never drafted."""
    shown = (img.width, img.height) if _orientation(img) in _QUARTER_TURNS else (img.height, img.width)
    return size_rule.choose(shown, sizes, window=window).mode == size_rule.RESIZE


def _draft(img: Image.Image, height: int, width: int) -> None:
    """Let the JPEG codec decode at 1/2, 1/4 or 1/8 scale, keeping at least twice the model's size."""
    if img.format not in _SINGLE_PICTURE_FORMATS:
        return
    want = (2 * width, 2 * height)
    if _orientation(img) in _QUARTER_TURNS:  # the codec works on the stored picture
        want = (want[1], want[0])
    if img.width >= 2 * want[0] and img.height >= 2 * want[1]:
        img.draft(img.mode, want)


def _load_oriented(img: Image.Image, data: bytes, name: str | None) -> int:
    """Decode the pixels, then turn them upright; return the EXIF orientation that was applied."""
    try:
        img.load()
    except (OSError, SyntaxError, ValueError, struct.error, zlib.error) as err:
        # Pillow reports truncated and corrupt streams as OSError/SyntaxError/ValueError.
        raise InputError(f"corrupt or truncated {img_format(data)} {_subject(name)}: {err}") from None
    turns = _orientation(img)  # a PNG's eXIf chunk may come after its pixels: read it after load()
    if turns != 1:
        ImageOps.exif_transpose(img, in_place=True)  # in place: no copy of an image that needs no turn
    return turns


def to_rgb(img: Image.Image, *, keep_grey: bool = False) -> Image.Image:
    """``img`` (loaded) as 8-bit RGB by the module's rules; as L when ``keep_grey`` and it is grey."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode.startswith("I"):
        grey = _grey_from_wide(img)
    elif "transparency" in img.info or mode in ("RGBA", "RGBa", "PA"):
        return _on_white(img)
    elif mode in ("LA", "La"):
        grey = Image.new("L", img.size, _WHITE)
        grey.paste(img.getchannel("L"), mask=img.getchannel("A"))
    elif mode in ("L", "1"):
        grey = img if mode == "L" else img.convert("L")
    else:  # P without transparency, CMYK, YCbCr: Pillow's conversions
        return img.convert("RGB")
    return grey if keep_grey else grey.convert("RGB")


def _grey_from_wide(img: Image.Image) -> Image.Image:
    """I;16, I;16B, I;16L or I (32-bit, read as 16-bit samples) to L by ``value >> 8``; a 16-bit
    colour key (tRNS) becomes white."""
    samples = np.asarray(img)
    if img.mode == "I":
        samples = np.clip(samples, 0, 0xFFFF)
    grey = (samples >> 8).astype(np.uint8)
    key = img.info.get("transparency")
    if isinstance(key, int):
        grey[samples == key] = _WHITE
    return Image.fromarray(grey, mode="L")


def _on_white(img: Image.Image) -> Image.Image:
    """Composite an image with transparency (alpha, palette tRNS, colour key) onto white, as RGB."""
    rgba = img if img.mode == "RGBA" else img.convert("RGBA")  # applies a palette's or a key's transparency
    canvas = Image.new("RGB", rgba.size, (_WHITE, _WHITE, _WHITE))
    canvas.paste(rgba, mask=rgba)  # rounds (src * a + 255 * (255 - a)) / 255
    return canvas


# --- memory --------------------------------------------------------------------------------------


class MemoryBudget:
    """A weighted semaphore over the bytes of full-size image buffers in flight: decodes
    (:func:`decode_bytes`) and masks at the image's size (:func:`mask_bytes`).

    ``hold(n)`` waits until ``n`` more bytes fit in ``capacity``; a hold larger than the whole
    budget waits for an empty budget and then runs alone. When the budget drains after a hold of
    at least ``trim_after`` bytes, ``release`` (default :func:`release_freed_memory`) gives the
    freed memory back to the OS. Threads block in ``hold``: call it on worker threads, never on an
    event loop, and free the buffers inside the ``with``.
    """

    def __init__(
        self,
        capacity: int,
        *,
        trim_after: int = 32 * 1024 * 1024,
        release: Callable[[], bool] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a decode budget of {capacity} bytes cannot hold any image: give it at least 1")
        self.capacity = capacity
        self.trim_after = trim_after
        self.release = release if release is not None else release_freed_memory
        self.in_use = 0
        self._large_since_trim = False
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the budget for the body of the ``with``."""
        share = min(nbytes, self.capacity)
        with self._cond:
            self._cond.wait_for(lambda: self.in_use + share <= self.capacity)
            self.in_use += share
        try:
            yield
        finally:
            with self._cond:
                self.in_use -= share
                self._large_since_trim |= nbytes >= self.trim_after
                trim = self.in_use == 0 and self._large_since_trim
                if trim:
                    self._large_since_trim = False
                self._cond.notify_all()
            if trim:
                self.release()


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()
_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
LARGE_BUFFER_BYTES = 4 * 1024 * 1024  # images over 1 megapixel; a 512x512 image and its mask stay under it


def map_large_buffers(threshold: int = LARGE_BUFFER_BYTES) -> bool:
    """Serve every allocation of ``threshold`` bytes or more from its own mmap, returned to the OS
    when freed (glibc ``mallopt(M_MMAP_THRESHOLD)``, process-wide); False where the C library cannot.

    Why: glibc's default threshold rises to the size of the last large block freed (Pillow's 16 MiB
    image blocks), after which those blocks come from per-thread arenas, and every arena keeps its
    own peak: the sum over the image threads, not the budget, and ``malloc_trim`` only after a lull.
    Costs a page fault per 4 KiB of a large image on every decode (only images over 1 megapixel).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim(0)``, every arena); False when
    the C library cannot.

    Why: Pillow allocates a large image in 16 MiB blocks; once one is freed glibc raises its mmap
    threshold past that size, so later blocks come from the arenas and stay mapped after they are
    freed (13 GB held after a burst, measured: see the module docstring).
    """
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))


# --- the mask ------------------------------------------------------------------------------------


def mask_to_size(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize a ``(h, w)`` uint8 class-id mask to ``height×width`` with nearest-neighbour filtering."""
    if mask.shape == (height, width):
        return mask
    return np.asarray(Image.fromarray(mask).resize((width, height), Image.Resampling.NEAREST))


def encode_mask_png(mask: np.ndarray) -> bytes:
    """Encode a ``(h, w)`` uint8 class-id mask as an 8-bit grayscale PNG (pixel value = class id).

    Written here, not by Pillow: Pillow's PNG encoder holds the GIL for the whole compression when
    it writes to memory (3.7 ms for a 512x512 mask on a 2.x GHz core), so every other request
    waited behind it; ``zlib.compress`` releases the GIL. Every scanline uses filter type 0 (none)
    and zlib level 1: 1.4 ms, and smaller than Pillow's level 1 with adaptive filters on a mask at
    the model's size (37 KB against 44 KB for the sample's 512x512 mask; a mask scaled up to a
    large image compresses less well than with Pillow's filters).
    """
    height, width = mask.shape
    rows = np.zeros((height, width + 1), dtype=np.uint8)  # each scanline: its filter type byte, then the pixels
    rows[:, 1:] = mask
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit, grayscale, deflate, no interlace
    return b"".join(
        (_PNG_SIGNATURE, _png_chunk(b"IHDR", header), _png_chunk(b"IDAT", zlib.compress(rows, 1)), _png_chunk(b"IEND"))
    )


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(tag: bytes, payload: bytes = b"") -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(tag))
    return struct.pack(">I", len(payload)) + tag + payload + struct.pack(">I", crc)


def decode_mask_png(png: bytes) -> np.ndarray:
    """Decode a mask PNG from ``/v1/segment`` into a ``(h, w)`` uint8 class-id array (for clients)."""
    with Image.open(io.BytesIO(png), formats=("PNG",)) as img:
        if img.mode != "L":
            raise InputError(f"a dualtrack mask PNG is 8-bit gray (mode L), this one is mode {img.mode}")
        return np.asarray(img).copy()


def class_counts(mask: np.ndarray, classes: int) -> list[int]:
    """Pixels per class id ``0 .. classes-1``; they sum to ``mask.size``."""
    if classes <= 16:
        # One compare-and-count pass per class is ~10x faster than np.bincount, which first widens
        # every uint8 to intp (0.45 ms for a 512x512 mask).
        return [int(np.count_nonzero(mask == c)) for c in range(classes)]
    return np.bincount(mask.ravel(), minlength=classes)[:classes].tolist()
