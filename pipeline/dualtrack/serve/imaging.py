"""The service's image and mask conventions: they are :mod:`dualtrack.imaging`'s, shared with
``dualtrack run``. This name stays for code that imports ``dualtrack.serve.imaging`` (a client's
``decode_mask_png``); nothing is defined here.
"""

from __future__ import annotations

from dualtrack.imaging import (
    ACCEPTED_FORMATS,
    MAX_PIXELS,
    MemoryBudget,
    ModelImage,
    class_counts,
    decode_image,
    decode_mask_png,
    encode_mask_png,
    img_format,
    load_for_model,
    map_large_buffers,
    mask_bytes,
    mask_to_size,
    release_freed_memory,
    to_model_input,
    to_rgb,
)

__all__ = [
    "ACCEPTED_FORMATS",
    "MAX_PIXELS",
    "MemoryBudget",
    "ModelImage",
    "class_counts",
    "decode_image",
    "decode_mask_png",
    "encode_mask_png",
    "img_format",
    "load_for_model",
    "map_large_buffers",
    "mask_bytes",
    "mask_to_size",
    "release_freed_memory",
    "to_model_input",
    "to_rgb",
]
