"""JPEG decode on the engine's GPU: nvImageCodec batch-decodes, ``resize_rgb_u8`` writes the rows.

The service's JPEGs (those :func:`dualtrack.imaging.route_jpeg` sends here) are decoded by
nvImageCodec (``nvidia-nvimgcodec-cu13`` with ``nvidia-nvjpeg``: nvJPEG, the GPU's hardware JPEG
engines where it has them; FACTS 19) on the stream the engine stages its batch on, then the Track A
kernel ``resize_rgb_u8`` (:data:`dualtrack.kernels.RESIZE_RGB`) applies the EXIF orientation and
Pillow's bilinear resize and writes each picture into its row of the batch's device input, the
whole batch in one launch (:meth:`GpuJpegDecoder.resize_rows`). The
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
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from dualtrack import kernels
from dualtrack.contract import arch
from dualtrack.imaging import GpuJpeg
from dualtrack.kernels import sources
from dualtrack.kernels.resize_rgb import ResizeJob
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
        self._backend_kinds = kinds
        self.decoder = nvimgcodec.Decoder(device_id=device.index, backends=kinds)
        # The orientation is applied by the resize kernel, from the EXIF Pillow read (route_jpeg):
        # one reading of the EXIF for both paths.
        self.params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB, allow_any_depth=False
        )
        spec = kernels.RESIZE_RGB
        choice = arch.choose_image(device.cc, [], list(spec.ptx_arches))
        path = sources.ptx_path(sources.SOURCE_DIR, Path(f"{spec.stem}.cu"), choice.arch)
        module = Module.load(
            ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch, cache_dir=jit_cache
        )
        self.kernel: Kernel = module.function(spec.stem)
        with ctx.push_current():
            self.stream = Stream(ctx, urgent=True)  # decode_now's: its kernels go before the batch computing
        self._lanes: list[Stream] = []  # add_lane's streams
        self._check_decodes()

    def add_lane(self) -> Callable[[list[GpuJpeg]], list[Any]]:
        """Another :meth:`decode_now`, with a decoder and stream of its own, for another thread: one
        nvImageCodec call decodes its JPEGs together, but a call waits for the one before it on the
        same decoder, so JPEGs that arrive one by one wait for each other's decodes unless several
        threads each have a lane (the H200 has 7 hardware JPEG engines)."""
        decoder = self.nv.Decoder(device_id=self.ctx.device.index, backends=self._backend_kinds)
        with self.ctx.push_current():
            stream = Stream(self.ctx, urgent=True)
        self._lanes.append(stream)
        return lambda jpegs: self._decode_waiting(stream, jpegs, decoder)

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

    def decode(self, stream: Stream, jpegs: Sequence[GpuJpeg], decoder: Any = None) -> tuple[list[Any], list[Any]]:
        """Decode ``jpegs`` on ``stream``: per JPEG, its :class:`Picture` (ready in ``stream``'s
        order; hold it until the stream has passed its last reader) or, as a ``str``, why it was
        refused (decode that one on the CPU); and what else to hold until ``stream`` has passed the
        decode (the code streams it reads)."""
        streams = [self.nv.CodeStream(j.data) for j in jpegs]
        decoder = self.decoder if decoder is None else decoder
        images = decoder.decode(streams, params=self.params, cuda_stream=int(stream.handle))
        out: list[Any] = []
        for jpeg, image in zip(jpegs, images, strict=True):
            out.append("nvImageCodec could not decode it" if image is None else _picture(image, jpeg))
        return out, streams

    def decode_now(self, jpegs: list[GpuJpeg]) -> list[Any]:
        """:meth:`decode` on this decoder's own stream, waiting for it: complete pictures (what
        :class:`JpegPrefetcher` runs on its thread, off every request's path)."""
        return self._decode_waiting(self.stream, jpegs, self.decoder)

    def _decode_waiting(self, stream: Stream, jpegs: list[GpuJpeg], decoder: Any) -> list[Any]:
        results, streams = self.decode(stream, jpegs, decoder)
        stream.finish()  # nvJPEG's hardware decode is mostly done when decode() returns: often no wait
        del streams  # the code streams, once the decode has read them
        return results

    def close(self) -> None:
        """Destroy the decoder's streams (its pictures must be gone first); idempotent."""
        self.stream.close()
        for stream in self._lanes:
            stream.close()

    @staticmethod
    def job(picture: Picture, jpeg: GpuJpeg, dst: int) -> ResizeJob:
        """The resize of a decoded ``picture`` (shown as ``jpeg``'s orientation says) into the row at ``dst``."""
        return ResizeJob(picture.ptr, dst, picture.width, picture.height, picture.pitch, jpeg.orientation)

    def resize_rows(self, stream: Stream, jobs: Sequence[ResizeJob], height: int, width: int) -> None:
        """Resize (and orient) every job's picture into its ``height x width x 3`` uint8 row, on
        ``stream``, in one launch per :attr:`~dualtrack.kernels.resize_rgb.ResizeRgbSpec.max_rows`
        jobs (a batch's host cost is one driver call, not one per picture); the pictures must stay
        alive until ``stream`` has passed this."""
        spec = kernels.RESIZE_RGB
        for chunk in spec.chunks(jobs):
            config = spec.launch(width, height, len(chunk))
            args = spec.args(jobs=chunk, out_w=width, out_h=height)
            self.kernel.launch(config.grid, config.block, config.shared_bytes, stream, args)

    def resize_into(self, stream: Stream, image: Any, jpeg: GpuJpeg, dst: int, height: int, width: int) -> None:
        """Resize (and orient) a decoded ``image`` into the ``height x width x 3`` uint8 row at ``dst``,
        on ``stream``: the image must stay alive until ``stream`` has passed this."""
        self.resize_rows(stream, [self.job(image, jpeg, dst)], height, width)

    def decode_into(self, stream: Stream, rows: Mapping[int, GpuJpeg], dst: int, height: int, width: int) -> Decoded:
        """Decode ``rows`` (batch row -> JPEG) on ``stream`` and resize each into row ``r`` of the
        uint8 NHWC device tensor at ``dst`` (``height x width x 3`` per row). Returns the rows
        written and those nvImageCodec refused (decode them on the CPU); nothing is waited for."""
        order = sorted(rows)
        images, streams = self.decode(stream, [rows[r] for r in order])
        out = Decoded(set(), {}, [streams])
        jobs = []
        for r, image in zip(order, images, strict=True):
            if isinstance(image, str):
                out.refused[r] = image
                continue
            jobs.append(self.job(image, rows[r], dst + r * height * width * 3))
            out.written.add(r)
            out.keepalive.append(image)
        self.resize_rows(stream, jobs, height, width)
        return out


@dataclass(frozen=True)
class Picture:
    """A decoded picture on the GPU: nvImageCodec's image (its owner: keep it alive while the GPU
    reads it) and where its pixels are, read once from its ``__cuda_array_interface__`` on the
    decoding thread (reading it costs ~15 us of the GIL: not on the stager's path)."""

    image: Any
    ptr: int
    width: int
    height: int
    pitch: int  # bytes from one row to the next


def _picture(image: Any, jpeg: GpuJpeg) -> Picture | str:
    """A decoded ``image`` as ``jpeg``'s :class:`Picture`, or why it cannot be resized as it."""
    cai = image.__cuda_array_interface__
    shape = tuple(cai["shape"])
    if cai["typestr"] != "|u1" or len(shape) != 3 or shape[2] != 3:
        return f"nvImageCodec gave {cai['typestr']}{list(shape)}, not 8-bit RGB"
    if (shape[1], shape[0]) != jpeg.stored:  # the header Pillow read must be the picture decoded
        return f"nvImageCodec decoded {shape[1]}x{shape[0]}, the header says {jpeg.stored[0]}x{jpeg.stored[1]}"
    strides = cai.get("strides")
    if strides and (int(strides[1]) != 3 or int(strides[2]) != 1):
        return f"nvImageCodec gave strides {strides}, not interleaved RGB"
    pitch = int(strides[0]) if strides else 3 * shape[1]
    return Picture(image, int(cai["data"][0]), shape[1], shape[0], pitch)


@dataclass(eq=False)
class Ticket:
    """One JPEG handed to :class:`JpegPrefetcher`: decoded on its thread, taken by the stager."""

    jpeg: GpuJpeg
    done: threading.Event = field(default_factory=threading.Event)
    image: Any = None  # its Picture once decoded (complete on the GPU: its stream was synchronised)
    refused: str | None = None  # or why not (the CPU path decides)
    state: str = "queued"  # queued -> decoding -> decoded -> released (or queued -> released)

    @property
    def nbytes(self) -> int:
        """Its decoded picture's size (8-bit RGB at the size its header gives)."""
        return self.jpeg.stored[0] * self.jpeg.stored[1] * 3


class JpegPrefetcher:
    """Decodes the service's JPEGs as they arrive, on a thread and a stream of its own, so that a
    batch's decode is done (beside the previous batch's compute) by the time the batch is staged.

    Why: decoding a batch when it is staged put ~1 ms of nvJPEG (8 JPEGs, the H200's hardware
    decoder) and its host wait on the path of every batch: staging took 2.1-2.5 ms against 0.4 ms
    for pixels (``bench/decode_probe.py``, ``decode_probe-a05bb7c.json``), and under the service's
    closed loop the GPU waited for it. The JPEGs of a batch arrive over milliseconds; decoding
    them as they come (as many as are waiting, in one nvImageCodec call) leaves the stager only
    the resize kernels.

    Bounded by bytes, not pictures: the decoded pictures not yet released hold at most
    ``ahead_bytes`` of GPU memory (one picture always may, however large); more JPEGs wait in a
    queue as bytes. A picture is as large as its JPEG's pixels, up to the resize kernel's largest
    downscale of the model input (~48 MB for a 512x512 model), while a JPEG of the model's size
    decodes to 0.75 MB: a bound of pictures sized for the largest would hold back model-size JPEGs
    that fit many times over. A stager that needs a ticket still queued is served first, whatever
    the bound.
    Tickets are decoded in the order given; every ticket must be released (its picture
    freed) once its resize has run or it is dropped, and :meth:`close` frees what is left, before
    the engine's context goes.
    """

    def __init__(
        self,
        decode: Callable[[list[GpuJpeg]], list[Any]] | Sequence[Callable[[list[GpuJpeg]], list[Any]]],
        *,
        ahead_bytes: int,
        most_per_call: int,
        on_thread: Callable[[], None] | None = None,
    ) -> None:
        """``decode(jpegs)`` returns, per JPEG, its complete picture or why not (a ``str``):
        :meth:`GpuJpegDecoder.decode_now`; several (:meth:`GpuJpegDecoder.add_lane`) decode on a
        thread each, so a JPEG that arrives while another is decoding starts at once. ``on_thread``
        runs first on each decode thread (binding the engine's context)."""
        if ahead_bytes < 1 or most_per_call < 1:
            raise ValueError(f"ahead_bytes and most_per_call must be >= 1, got {ahead_bytes}, {most_per_call}")
        decoders = [decode] if callable(decode) else list(decode)
        if not decoders:
            raise ValueError("give the prefetcher at least one decode function")
        self._on_thread = on_thread
        self.ahead_bytes, self.most_per_call = ahead_bytes, most_per_call
        self._queue: deque[Ticket] = deque()
        self._held: set[Ticket] = set()  # decoding or decoded, not released
        self._held_bytes = 0  # their pictures' bytes
        self._wanted: list[Ticket] = []  # tickets a stager waits for
        self._closing = False
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, args=(d,), name=f"dualtrack-jpeg-{i}", daemon=True)
            for i, d in enumerate(decoders)
        ]
        for thread in self._threads:
            thread.start()

    def add(self, jpeg: GpuJpeg) -> Ticket:
        ticket = Ticket(jpeg)
        with self._cond:
            if self._closing:
                ticket.refused = "the GPU decoder is shutting down"
                ticket.state = "released"
                ticket.done.set()
                return ticket
            self._queue.append(ticket)
            self._cond.notify()  # one JPEG: one lane (waking them all cost each a GIL turn)
        return ticket

    def take(self, ticket: Ticket) -> Any:
        """The ticket's image, or why it was refused (a ``str``), waiting for its decode if needed."""
        if not ticket.done.is_set():
            with self._cond:
                self._wanted.append(ticket)
                if ticket.state == "queued":
                    self._cond.notify()  # a lane may go past the bound for it
            try:
                while not ticket.done.wait(0.5):
                    if not any(t.is_alive() for t in self._threads):
                        return "the GPU decoder stopped"
            finally:
                with self._cond:
                    self._wanted.remove(ticket)
        return ticket.refused if ticket.refused is not None else ticket.image

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's picture (its readers have run) or withdraw it if not decoded yet."""
        with self._cond:
            if ticket.state == "queued":
                with suppress(ValueError):
                    self._queue.remove(ticket)
                ticket.done.set()
            self._drop(ticket)
            ticket.state, ticket.image = "released", None
            if self._queue:  # room for the JPEGs waiting behind the bound; an idle lane need not wake
                self._cond.notify()

    def close(self) -> None:
        """Stop the thread and free every picture not yet released (before the context goes)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        with self._cond:
            for ticket in (*self._queue, *self._held):
                ticket.image, ticket.state = None, "released"
                if ticket.refused is None and not ticket.done.is_set():
                    ticket.refused = "the GPU decoder is shutting down"
                ticket.done.set()
            self._queue.clear()
            self._held.clear()
            self._held_bytes = 0

    def _urgent(self) -> bool:
        """A stager waits for a ticket still queued: decode past the bound until it is reached."""
        return any(t.state == "queued" for t in self._wanted)

    def _may_start(self) -> bool:
        """Whether the next queued JPEG may be decoded now (within the bound, or nothing held, or urgent)."""
        if not self._queue:
            return False
        fits = self._held_bytes + self._queue[0].nbytes <= self.ahead_bytes
        return fits or not self._held or self._urgent()

    def _drop(self, ticket: Ticket) -> None:
        if ticket in self._held:
            self._held.remove(ticket)
            self._held_bytes -= ticket.nbytes

    def _work(self, decode: Callable[[list[GpuJpeg]], list[Any]]) -> None:
        if self._on_thread is not None:
            self._on_thread()
        while True:
            with self._cond:
                while not self._closing and not self._may_start():
                    self._cond.wait()
                if self._closing:
                    return
                jobs: list[Ticket] = []
                # _may_start: the first goes (past the bound if it must); the others while they fit.
                while self._queue and len(jobs) < self.most_per_call:
                    if jobs and self._held_bytes + self._queue[0].nbytes > self.ahead_bytes:
                        break
                    ticket = self._queue.popleft()
                    ticket.state = "decoding"
                    self._held.add(ticket)
                    self._held_bytes += ticket.nbytes
                    jobs.append(ticket)
            try:
                results = decode([t.jpeg for t in jobs])
            except Exception as err:  # the CPU path decides each of them
                results = [f"nvImageCodec failed: {err}"] * len(jobs)
            with self._cond:
                for ticket, result in zip(jobs, results, strict=True):
                    if ticket.state == "decoding":  # not released meanwhile
                        ticket.state = "decoded"
                        if isinstance(result, str):
                            ticket.refused = result
                            self._drop(ticket)
                            self._cond.notify()  # its room is free again
                        else:
                            ticket.image = result
                    ticket.done.set()


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
