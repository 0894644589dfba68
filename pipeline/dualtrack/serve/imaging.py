"""Image bytes in, model input out; model mask in, PNG bytes out.

The contract the server keeps (and the page and any client can rely on):

- **Accepted input**: PNG or JPEG bytes, nothing else. JPEG EXIF orientation is applied first, so a
  phone photo is segmented the way it is displayed. Any mode is converted to RGB; an alpha channel
  is dropped (not composited). Images over :data:`MAX_PIXELS` are refused before they are decoded.
- **To the model**: the whole image is resized to the model's ``H×W`` with bilinear filtering
  (Pillow ``Image.Resampling.BILINEAR``), aspect ratio not kept, and given to the engine as ``uint8`` RGB,
  NHWC. No normalisation happens here: the bundle's input is ``uint8`` and the model owns it.
- **Back to the client**: the ``H×W`` mask of class ids is resized to the original image size with
  nearest-neighbour filtering (``Image.Resampling.NEAREST``), so every pixel still holds a class id and no
  blended value appears at class borders.
- **Mask PNG**: 8-bit grayscale (mode ``L``), one pixel per image pixel, the value is the class id
  ``0 .. classes-1`` (not scaled to 0..255: read it as data, not as a picture).

The server runs these functions on its image threads, several at once: decoding, resizing and the
mask's compression release the GIL (Pillow's decoders and resampling, ``zlib``), so they scale with
the cores instead of queueing behind one another.

Every failure to decode raises :class:`~dualtrack.errors.InputError` whose message gives the reason.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dualtrack.errors import InputError

ACCEPTED_FORMATS = ("PNG", "JPEG")
# 64 megapixels: larger than any camera image a client sends here, small enough that a hostile PNG
# (a few KiB that inflate to gigabytes) is refused from its header, before it is decompressed.
MAX_PIXELS = 64 * 1024 * 1024


def decode_image(data: bytes) -> Image.Image:
    """Decode PNG or JPEG bytes into an RGB image with EXIF orientation applied.

    Raises :class:`InputError` naming the reason: empty body, not PNG/JPEG, too many pixels,
    truncated or corrupt data.
    """
    if not data:
        raise InputError("empty image: send PNG or JPEG bytes as the body or as the multipart field `image`")
    try:
        with warnings.catch_warnings():
            # Pillow warns (rather than raises) between MAX_IMAGE_PIXELS and twice that; we want a refusal.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
            if img.width * img.height > MAX_PIXELS:
                raise InputError(
                    f"image is {img.width}x{img.height} = {img.width * img.height} pixels, over the limit of "
                    f"{MAX_PIXELS}: downscale it before sending"
                )
            img.load()
    except UnidentifiedImageError:
        raise InputError(
            f"not a PNG or JPEG image ({len(data)} bytes starting {data[:8]!r}): send PNG or JPEG bytes"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise InputError(f"image refused as a decompression bomb: {err}") from None
    except (OSError, SyntaxError, ValueError) as err:
        # Pillow reports truncated and corrupt streams as OSError/SyntaxError/ValueError.
        raise InputError(f"corrupt or truncated {img_format(data)} image: {err}") from None
    ImageOps.exif_transpose(img, in_place=True)  # in place: no copy of an image that needs no turn
    return img if img.mode == "RGB" else img.convert("RGB")


def img_format(data: bytes) -> str:
    """``"PNG"`` or ``"JPEG"`` from the magic bytes, ``"image"`` when neither (for error messages)."""
    if data.startswith(b"\x89PNG"):
        return "PNG"
    if data.startswith(b"\xff\xd8"):
        return "JPEG"
    return "image"


def to_model_input(img: Image.Image, height: int, width: int) -> np.ndarray:
    """Resize ``img`` (RGB) to ``height×width`` with bilinear filtering; return ``(H, W, 3)`` uint8.

    The array is read-only: it is Pillow's export of the pixels, not a copy of it (the batcher
    copies it once, into the batch's input buffer).
    """
    if img.mode != "RGB":
        img = img.convert("RGB")
    if img.size != (width, height):
        img = img.resize((width, height), Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.uint8)


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
