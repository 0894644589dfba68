"""JPEG decode on the engine's GPU: nvImageCodec batch-decodes, ``resize_rgb_u8`` writes the rows.

The service's JPEGs (those :func:`dualtrack.imaging.route_jpeg` sends here) are decoded by
nvImageCodec (``nvidia-nvimgcodec-cu13`` with ``nvidia-nvjpeg``: nvJPEG, the GPU's hardware JPEG
engines where it has them; FACTS 19) on the stream the engine stages its batch on, then the Track A
kernel ``resize_rgb_u8`` (:data:`dualtrack.kernels.RESIZE_RGB`) applies the EXIF orientation and
Pillow's bilinear resize and writes each picture into its row of the batch's device input. The
decoded picture never leaves the GPU; nvImageCodec owns its buffer (it cannot decode into ours), so
it is read through its ``__cuda_array_interface__`` and kept alive until the stream has passed the
resize.

Which decoder runs is :func:`choose_decoder`'s answer, a pure function of what is installed and
the device, reported by ``/readyz``, ``/metrics`` (``dualtrack_decoder_info``) and the startup line:
``gpu`` needs a CUDA engine and nvImageCodec whose GPU backends load (nvJPEG found). Anything else
is ``cpu`` (Pillow on the image threads), with the reason. A picture nvImageCodec refuses is
handed back to the caller, who decodes it on the CPU: its answer (pixels or the 400) is the
CPU path's, never a wrong mask.

Images only: the resize kernel's PTX is the checked-in one under ``handwritten_ptx/ptx`` (no
bundle ships it), loaded through the driver chokepoint with the JIT cache.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from dualtrack import arch, kernels, ptx
from dualtrack.imaging import GpuJpeg
from dualtrack.runtime.driver import Context, Kernel, Module, Stream

DECODERS = ("gpu", "cpu")
GPU_BACKENDS = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")  # nvImageCodec's BackendKinds that decode on the GPU


@dataclass(frozen=True)
class DecoderChoice:
    """Which decoder decodes the service's JPEGs, and why (``/readyz``, ``/metrics``, startup line)."""

    name: str  # "gpu" or "cpu"
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason}


def choose_decoder(device: str, library: str | None, *, wanted: str = "auto") -> DecoderChoice:
    """The decoder for an engine on ``device`` given nvImageCodec's state: ``library`` is None when
    its GPU decoder loaded, else why not. ``wanted`` (``--jpeg-decoder``): ``auto``, ``gpu`` or ``cpu``.
    """
    if wanted == "cpu":
        return DecoderChoice("cpu", "--jpeg-decoder cpu")
    if device != "cuda":
        why = f"the engine runs on {device}"
    elif library is not None:
        why = library
    else:
        return DecoderChoice("gpu", "nvImageCodec (nvJPEG) on the engine's GPU; PNG and other JPEGs on the CPU")
    return DecoderChoice("cpu", f"Pillow on the image threads: {why}")


def probe_library() -> tuple[Any, str | None]:
    """nvImageCodec's module, or None and why it cannot decode on the GPU here."""
    try:
        from nvidia import nvimgcodec  # type: ignore[import-not-found]
    except ImportError as err:
        return None, f"nvImageCodec is not installed ({err}): pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg"
    return nvimgcodec, None


@dataclass
class Decoded:
    """What one :meth:`GpuJpegDecoder.decode_into` enqueued: rows written, rows refused, and the
    nvImageCodec images to keep alive until the stream has passed the resizes."""

    written: set[int]
    refused: dict[int, str]
    keepalive: list[Any]


class GpuJpegDecoder:
    """nvImageCodec's decoder on one device plus the resize kernel, for one engine's context."""

    def __init__(
        self,
        ctx: Context,
        *,
        jit_cache: Path | None = None,
        nvimgcodec: Any = None,
        backends: tuple[str, ...] = ("HW_GPU_ONLY", "GPU_ONLY"),
    ) -> None:
        if nvimgcodec is None:
            nvimgcodec, why = probe_library()
            if why is not None:
                raise RuntimeError(why)
        self.nv = nvimgcodec
        self.ctx = ctx
        device = ctx.device
        # GPU backends only (``backends``: BackendKind names, in order; bench/decode_probe.py times
        # each): with every backend allowed, a missing nvJPEG silently falls back to nvImageCodec's
        # own CPU decoder, which would call itself GPU decode here.
        if not backends or any(b not in GPU_BACKENDS for b in backends):
            raise ValueError(f"backends must be some of {GPU_BACKENDS}, got {backends}")
        self.backends = backends
        kinds = [nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, b)) for b in backends]
        self.decoder = nvimgcodec.Decoder(device_id=device.index, backends=kinds)
        # The orientation is applied by the resize kernel, from the EXIF Pillow read (route_jpeg):
        # one reading of the EXIF for both paths.
        self.params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB, allow_any_depth=False
        )
        spec = kernels.RESIZE_RGB
        choice = arch.choose_image(device.cc, [], list(spec.ptx_arches))
        path = ptx.ptx_path(ptx.SOURCE_DIR, Path(f"{spec.stem}.cu"), choice.arch)
        module = Module.load(
            ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch, cache_dir=jit_cache
        )
        self.kernel: Kernel = module.function(spec.stem)
        self._check_decodes()

    def _check_decodes(self) -> None:
        """Decode one small JPEG now: GPU backends that cannot load (no nvJPEG) refuse every image,
        and that must be known at startup (the decoder reported is the one that runs)."""
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (200, 40, 90)).save(buf, format="JPEG", quality=90)
        with self.ctx.push_current():
            image = self.decoder.decode(self.nv.CodeStream(buf.getvalue()), params=self.params)
        if image is None or tuple(image.__cuda_array_interface__["shape"]) != (16, 16, 3):
            raise RuntimeError(
                "nvImageCodec's GPU backends decode no JPEG here (nvJPEG missing? pip install nvidia-nvjpeg)"
            )

    def decode_into(self, stream: Stream, rows: Mapping[int, GpuJpeg], dst: int, height: int, width: int) -> Decoded:
        """Decode ``rows`` (batch row -> JPEG) on ``stream`` and resize each into row ``r`` of the
        uint8 NHWC device tensor at ``dst`` (``height x width x 3`` per row). Returns the rows
        written and those nvImageCodec refused (decode them on the CPU); nothing is waited for."""
        order = sorted(rows)
        streams = [self.nv.CodeStream(rows[r].data) for r in order]
        images = self.decoder.decode(streams, params=self.params, cuda_stream=int(stream.handle))
        out = Decoded(set(), {}, [streams])
        for r, image in zip(order, images, strict=True):
            if image is None:
                out.refused[r] = "nvImageCodec could not decode it"
                continue
            why = self._resize(stream, image, rows[r], dst + r * height * width * 3, height, width)
            if why is None:
                out.written.add(r)
                out.keepalive.append(image)
            else:
                out.refused[r] = why
        return out

    def _resize(self, stream: Stream, image: Any, jpeg: GpuJpeg, dst: int, height: int, width: int) -> str | None:
        cai = image.__cuda_array_interface__
        shape = tuple(cai["shape"])
        if cai["typestr"] != "|u1" or len(shape) != 3 or shape[2] != 3:
            return f"nvImageCodec gave {cai['typestr']}{list(shape)}, not 8-bit RGB"
        h, w = shape[0], shape[1]
        if (w, h) != jpeg.stored:  # the header Pillow read must be the picture decoded
            return f"nvImageCodec decoded {w}x{h}, the header says {jpeg.stored[0]}x{jpeg.stored[1]}"
        strides = cai.get("strides")
        pitch = int(strides[0]) if strides else 3 * w
        if strides and (int(strides[1]) != 3 or int(strides[2]) != 1):
            return f"nvImageCodec gave strides {strides}, not interleaved RGB"
        spec = kernels.RESIZE_RGB
        args = spec.args(
            src=int(cai["data"][0]), dst=dst, src_w=w, src_h=h, src_pitch=pitch,
            out_w=width, out_h=height, orientation=jpeg.orientation,
        )  # fmt: skip
        config = spec.launch(width, height)
        self.kernel.launch(config.grid, config.block, config.shared_bytes, stream, args)
        return None


def open_decoder(engine: Any, wanted: str, jit_cache: Path | None) -> tuple[DecoderChoice, GpuJpegDecoder | None]:
    """The decoder an engine's service uses (:func:`choose_decoder`) and, for ``gpu``, the decoder
    itself; a GPU decoder that fails to start (no nvJPEG, no kernel) makes the answer ``cpu`` with why."""
    nv, why = probe_library() if engine.device == "cuda" and wanted != "cpu" else (None, None)
    choice = choose_decoder(engine.device, why, wanted=wanted)
    if choice.name != "gpu":
        return choice, None
    try:
        return choice, GpuJpegDecoder(engine.backend.ctx, jit_cache=jit_cache, nvimgcodec=nv)
    except Exception as err:  # reported by /readyz and the startup line, never a silent fallback
        return choose_decoder(engine.device, f"nvImageCodec failed to start: {err}", wanted=wanted), None
