"""The HTTP service: a Starlette app in front of one :class:`~dualtrack.serve.batcher.Batcher` (in a
worker of ``dualtrack serve --workers N``: of the engine process's, see :mod:`dualtrack.serve.shared`).

Endpoints (every error is JSON ``{"error": "<one line>"}``; none takes the process down):

``POST /v1/segment``
    Body: the image's raw PNG/JPEG bytes, or ``multipart/form-data`` with a file field ``image``.
    ``?format=png`` (default) answers ``image/png``: the mask at the image's own size, 8-bit gray,
    pixel value = class id ``0 .. classes-1`` (see :mod:`dualtrack.imaging`).
    ``?format=json`` answers ``{"shape": [h, w], "model_shape": [H, W], "classes": C,
    "counts": [pixels of class 0, 1, ...], "batch_size": n, "padded_size": s, "timings_ms": {...}}``;
    ``counts`` are over the returned ``h×w`` mask and sum to ``h*w``. Both formats carry the
    timings in a ``Server-Timing`` header. 400: not an image (the reason is given), bad multipart,
    bad ``format``; 413: body over ``max_body_bytes``; 503 + ``Retry-After``: queue full, engine
    not ready, or shutting down; 500: the engine failed on this batch.
``GET /healthz``
    200 while the process runs (liveness).
``GET /readyz``
    200 with the model's shape once the engine is loaded and warmed up; 503 with the reason before
    that, if loading failed, and during shutdown (readiness). Under ``--backend ray``, ``devices``
    says where each model replica's engine runs (:mod:`dualtrack.serve.placement`).
``GET /metrics``
    Prometheus text format, see :mod:`dualtrack.serve.metrics`.
``GET /``
    A small page to upload an image and see its mask overlaid.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dualtrack import imaging
from dualtrack.contract import sizes as size_rule
from dualtrack.errors import DualtrackError, InputError
from dualtrack.kernels import RESIZE_RGB
from dualtrack.serve.batcher import (
    Batcher,
    BatchQueue,
    BatchResult,
    EngineSource,
    EngineSpecs,
    NotReadyError,
    Phase,
    QueueFullError,
)
from dualtrack.serve.metrics import ServeMetrics
from dualtrack.serve.options import ServeOptions

if TYPE_CHECKING:
    import numpy as np

    from dualtrack.serve.shared import RemoteMetrics

_log = logging.getLogger(__name__)

# Past the limit the server keeps reading (and dropping) up to this many more bytes before it
# answers 413: a client still sending its body when the socket closes sees a reset, not the answer.
_DRAIN_BYTES = 8 * 1024 * 1024


class _BodyTooLarge(Exception):
    pass


def worker_app() -> Starlette:
    """The app of one `dualtrack serve --workers N` process (a uvicorn factory).

    It has no engine of its own: it reaches the engine process that started it
    (:mod:`dualtrack.serve.shared`), whose batcher and metrics registry every worker shares.
    """
    from dualtrack.serve.shared import RemoteMetrics, connect_from_env

    client, options = connect_from_env()
    return assemble(client, RemoteMetrics(client), ServeOptions(**options))


def create_app(
    source: EngineSource,
    *,
    max_batch_delay_ms: float = ServeOptions.max_batch_delay_ms,
    batches_in_flight: int = ServeOptions.batches_in_flight,
    max_queue: int = ServeOptions.max_queue,
    max_body_bytes: int = ServeOptions.max_body_bytes,
    device: str = ServeOptions.device,
    device_index: int = ServeOptions.device_index,
    retry_after_s: int = ServeOptions.retry_after_s,
    shutdown_timeout_s: float = ServeOptions.shutdown_timeout_s,
    image_threads: int = ServeOptions.image_threads,
    image_memory_mb: int = ServeOptions.image_memory_mb,
    jpeg_decoder: str = "auto",
) -> Starlette:
    """Build the ASGI app for ``source``: an ``Engine`` (borrowed), a bundle path, or an engine factory.

    The engine is loaded (if needed) and warmed up on the batcher's worker thread once the server
    starts (ASGI lifespan), so ``/healthz`` answers at once and ``/readyz`` turns 200 when warm.
    Images are decoded, resized and encoded on ``image_threads`` threads (0: one per core), never
    on the event loop, with at most ``image_memory_mb`` of full-size images in flight; allocations
    over 4 MiB in this process are mmapped from then on (:func:`dualtrack.imaging.map_large_buffers`).
    ``jpeg_decoder``: ``auto`` decodes JPEGs on the engine's GPU where nvImageCodec is installed
    (:mod:`dualtrack.runtime.gpu_jpeg`), ``cpu`` always with Pillow; ``/readyz`` says which runs.
    ``app.state.batcher``, ``app.state.metrics`` and ``app.state.options`` are there for embedding.
    """
    options = ServeOptions(
        max_batch_delay_ms=max_batch_delay_ms,
        batches_in_flight=batches_in_flight,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        device=device,
        device_index=device_index,
        retry_after_s=retry_after_s,
        shutdown_timeout_s=shutdown_timeout_s,
        image_threads=image_threads,
        image_memory_mb=image_memory_mb,
    )
    # The gauges read the batcher at scrape time (the closures see `batcher` once it is assigned).
    metrics = ServeMetrics(
        queue_depth=lambda: batcher.depth,
        ready=lambda: batcher.phase is Phase.READY,
        decoder=lambda: batcher.decoder[0],
    )
    batcher = Batcher(
        source,
        max_batch_delay_s=options.max_batch_delay_ms / 1e3,
        max_queue=options.max_queue,
        device=options.device,
        device_index=options.device_index,
        on_batch=metrics.observe_batch,
        jpeg_decoder=jpeg_decoder,
        batches_in_flight=options.batches_in_flight,
    )
    return assemble(batcher, metrics, options)


def assemble(batcher: BatchQueue, metrics: ServeMetrics | RemoteMetrics, options: ServeOptions) -> Starlette:
    """The app around a batcher and its metrics: a :class:`Batcher`, a worker's client of the engine
    process (``--workers``), or a Ray ingress replica's client of the model deployment (``--backend ray``)."""
    service = _Service(batcher, metrics, options)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            # Uvicorn calls this after in-flight requests have been answered; close() still runs
            # anything queued, so no accepted request is dropped.
            if not await run_in_threadpool(batcher.close, options.shutdown_timeout_s):
                _log.error("batcher still busy after %.0f s; exiting anyway", options.shutdown_timeout_s)
            service.images.shutdown(wait=False)

    routes = [
        Route("/", service.index, methods=["GET"]),
        Route("/v1/segment", service.segment, methods=["POST"]),
        Route("/healthz", service.healthz, methods=["GET"]),
        Route("/readyz", service.readyz, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(_CountRequests, metrics=metrics, endpoints={r.path for r in routes})],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.options = options
    return app


class _Service:
    """The endpoint handlers, sharing one batcher, one metrics registry and the options."""

    def __init__(self, batcher: BatchQueue, metrics: ServeMetrics | RemoteMetrics, options: ServeOptions) -> None:
        self.batcher = batcher
        self.stats = metrics
        self.options = options
        # Decoding, resizing and encoding release the GIL (imaging.py): one thread per core runs
        # that many images at once, and the event loop only moves bytes.
        self.images = ThreadPoolExecutor(options.threads, thread_name_prefix="dualtrack-image")
        # Threads bound how many decodes run, not their memory: an 8192x8192 PNG of 65 KB decodes
        # to hundreds of MB, so full-size images in flight (decodes and masks) share a memory budget.
        self.image_budget = imaging.MemoryBudget(options.image_memory_mb * 1024 * 1024)
        imaging.map_large_buffers()  # process-wide: freed image buffers go back to the OS, not to an arena
        self.index_html = resources.files("dualtrack.serve").joinpath("static/index.html").read_text("utf-8")

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.index_html)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(self, request: Request) -> Response:
        engine = self.batcher.engine
        if self.batcher.phase is not Phase.READY or engine is None:
            reason = self.batcher.error or f"engine is {self.batcher.phase.value}"
            return self._unavailable(reason)
        _, height, width, _ = engine.input_spec.shape
        body = {
            "status": "ready",
            "model_shape": [height, width],
            "classes": _num_classes(engine),
            "batch_sizes": list(engine.batch_sizes),
            "device": engine.device,
            "jpeg_decoder": {"name": self.decoder[0], "reason": self.decoder[1]},
        }
        devices = getattr(engine, "devices", ())  # where each Ray model replica's engine runs (EngineInfo)
        if devices:
            body["devices"] = list(devices)
        return JSONResponse(body)

    async def metrics_text(self, request: Request) -> Response:
        # A worker of `serve --workers N` asks the engine process: off the event loop.
        return Response(await run_in_threadpool(self.stats.exposition), media_type=self.stats.content_type)

    async def segment(self, request: Request) -> Response:
        start = time.perf_counter()
        fmt = request.query_params.get("format", "png")
        if fmt not in ("png", "json"):
            return _error(400, f"format={fmt!r} is not supported: use format=png (the default) or format=json")
        engine = self.batcher.engine
        if self.batcher.phase is not Phase.READY or engine is None:
            return self._unavailable(self.batcher.error or f"engine is {self.batcher.phase.value}")
        try:
            data = await _image_bytes(request, self.options.max_body_bytes)
            _, height, width, _ = engine.input_spec.shape
            route = self._gpu_route(data, height, width)  # a header read (~40 us): here, not on a thread
            if isinstance(route, imaging.GpuJpeg):
                answer = await self._segment_gpu_jpeg(route, engine, fmt, start)
            else:
                answer = await asyncio.wrap_future(self._segment_on_threads(data, engine, fmt, start))
        except _BodyTooLarge as err:
            return _error(413, str(err))
        except ClientDisconnect:
            return _error(400, "the client disconnected before sending the whole body")
        except InputError as err:
            return _error(400, str(err))
        except (QueueFullError, NotReadyError) as err:
            return self._unavailable(str(err))
        except DualtrackError as err:
            _log.error("segment failed: %s", err)
            return _error(500, str(err))
        headers = {"Server-Timing": ", ".join(f"{k};dur={v:.3f}" for k, v in answer.timings.items())}
        response = Response(answer.body, media_type=answer.media_type, headers=headers)
        self.stats.observe_latency(time.perf_counter() - start)
        return response

    async def _segment_gpu_jpeg(self, route: imaging.GpuJpeg, engine: EngineSpecs, fmt: str, start: float) -> _Answer:
        """A JPEG the GPU decodes: queued from the event loop (its bytes are copied, nothing decoded
        here), answered on the event loop when that is cheap (JSON counts of a picture of the
        model's size, ~60 us), on an image thread otherwise (a mask PNG, or a mask resized first).

        Why not the image threads throughout, as for other images: each hand-over between the loop,
        an image thread and the thread that resolves the batch waits for the GIL, and this path has
        no step that needs a thread. Cancelling (the client went away) withdraws it from its batch.
        """
        queued = self.batcher.submit_jpeg(route)  # type: ignore[attr-defined]
        result = await asyncio.wrap_future(queued)  # cancelling this cancels `queued`
        classes = _num_classes(engine)
        if fmt == "json" and result.mask.shape == (route.size[1], route.size[0]):
            return self._json_answer(result, route.size, classes, start)
        return await asyncio.get_running_loop().run_in_executor(
            self.images, self._answer, result, route.size, fmt, classes, start
        )

    def _segment_on_threads(self, data: bytes, engine: EngineSpecs, fmt: str, start: float) -> Future[_Answer]:
        """Decode and queue on an image thread; once the batch has run, answer on an image thread.

        The event loop waits on the returned future alone: one wake-up per request instead of one
        per step (each costs the loop ~35 µs of CPU, and the loop's time is what all requests share).
        Cancelling the future (the handler was cancelled) withdraws the image from its batch.
        """
        answer: Future[_Answer] = Future()
        _, height, width, _ = engine.input_spec.shape
        classes = _num_classes(engine)

        def queue() -> _Answer | None:
            # Only the model-size pixels and the displayed size outlive this call: the full-size
            # decode is freed here. (A JPEG the GPU decoder takes never comes here: _segment_gpu_jpeg.)
            sizes, tiles = _own_sizes(engine), _tiles(self.batcher)
            image = imaging.load_for_model(data, height, width, sizes=sizes, window=tiles, budget=self.image_budget)
            pixels, region = image.pixels, None
            if tiles and (pixels.shape[0] > height or pixels.shape[1] > width):  # larger: the sliding window
                result, windows = self.batcher.tile(pixels)  # type: ignore[attr-defined]
                if (observe := getattr(self.stats, "observe_windows", None)) is not None:
                    observe(windows)
                return self._answer(result, image.size, fmt, classes, start)
            if pixels.shape[:2] != (height, width):  # at its own size: padded to the batch's, its mask cropped back
                region = pixels.shape[:2]
                pixels = size_rule.pad_to(pixels[None], (height, width))[0]
            queued, size = self.batcher.submit(pixels), image.size

            def withdraw(_: Future[_Answer]) -> None:
                if answer.cancelled():
                    queued.cancel()  # a no-op once its batch has started

            def batch_done(_: Future[BatchResult]) -> None:  # on the batcher's thread: hand over, no more
                self.images.submit(_step, answer, reply, queued, size, region)

            answer.add_done_callback(withdraw)
            queued.add_done_callback(batch_done)
            return None

        def reply(queued: Future[BatchResult], size: tuple[int, int], region: tuple[int, int] | None) -> _Answer:
            return self._answer(queued.result(), size, fmt, classes, start, region)

        self.images.submit(_step, answer, queue)
        return answer

    def _gpu_route(self, data: bytes, height: int, width: int) -> imaging.GpuJpeg | str:
        """The GPU decoder's :class:`~dualtrack.imaging.GpuJpeg` for a JPEG it takes, else why not."""
        if self.decoder[0] != "gpu" or not data.startswith(b"\xff\xd8"):
            return "not a JPEG for the GPU decoder"
        if len(data) > getattr(self.batcher, "max_jpeg_bytes", len(data)):  # --workers: it travels in one slot
            return "a JPEG longer than an image slot is decoded on the CPU"
        route = imaging.route_jpeg(data, height, width, max_downscale=RESIZE_RGB.max_downscale)
        sizes = _own_sizes(self.batcher.engine) if isinstance(route, imaging.GpuJpeg) else ()
        shown = (route.size[1], route.size[0]) if isinstance(route, imaging.GpuJpeg) else (0, 0)
        mode = size_rule.choose(shown, sizes, window=_tiles(self.batcher)).mode if sizes else ""
        if mode == size_rule.FITS:
            return "an image a compiled size holds is decoded on the CPU and run at its own size"
        if mode == size_rule.WINDOW:  # the GPU path resizes to the batch shape: the sliding window starts on the CPU
            return "an image larger than every compiled size is decoded on the CPU and run through the sliding window"
        return route

    @property
    def decoder(self) -> tuple[str, str]:
        """(name, reason) of the JPEG decoder: the batcher's, or under ``--workers`` the engine
        process's (``gpu``: the workers send it the JPEGs that route_jpeg gives the GPU)."""
        return getattr(self.batcher, "decoder", ("cpu", "Pillow in the HTTP processes"))

    def _answer(
        self,
        result: BatchResult,
        size: tuple[int, int],
        fmt: str,
        classes: int,
        start: float,
        region: tuple[int, int] | None = None,
    ) -> _Answer:
        """The response to one request (mask PNG or JSON counts), built on an image thread; ``region``:
        the (height, width) of an image run at its own size, padded, whose mask is cropped back to it."""
        width, height = size
        # The mask at a large image's size is as large as a decode: it shares the budget.
        with self.image_budget.hold(imaging.mask_bytes(width, height)):
            own = result.mask if region is None else result.mask[: region[0], : region[1]]
            mask = imaging.mask_to_size(own, height, width)
            if fmt == "png":
                body = imaging.encode_mask_png(mask)
                del mask
                return _Answer(body, "image/png", _timings_ms(result, start))
            return self._json_answer(result, size, classes, start, mask)

    def _json_answer(
        self, result: BatchResult, size: tuple[int, int], classes: int, start: float, mask: np.ndarray | None = None
    ) -> _Answer:
        """The JSON counts of ``mask`` (default: the batch's mask, at the model's size)."""
        width, height = size
        mask = result.mask if mask is None else mask
        classes = classes or int(mask.max()) + 1
        counts = imaging.class_counts(mask, classes)
        timings = _timings_ms(result, start)
        payload: dict[str, Any] = {
            "shape": [height, width],
            "model_shape": list(result.mask.shape),  # the mask comes at the model's resolution
            "classes": classes,
            "counts": counts,
            "batch_size": result.batch_size,
            "padded_size": result.padded_size,
            "timings_ms": timings,
        }
        # What JSONResponse renders, built here rather than on the event loop.
        body = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        return _Answer(body, "application/json", timings)

    def _unavailable(self, reason: str) -> Response:
        return _error(503, reason, headers={"Retry-After": str(self.options.retry_after_s)})


@dataclass(frozen=True)
class _Answer:
    body: bytes
    media_type: str
    timings: dict[str, float]


def _step(answer: Future[_Answer], fn: Callable[..., _Answer | None], *args: Any) -> None:
    """One step of a request on an image thread: what ``fn`` returns answers it, what it raises fails it."""
    if answer.done():  # cancelled: nobody waits for it any more
        return
    try:
        result = fn(*args)
        if result is not None:
            answer.set_result(result)
    except InvalidStateError:  # cancelled meanwhile
        pass
    except BaseException as err:
        with suppress(InvalidStateError):
            answer.set_exception(err)


async def _image_bytes(request: Request, limit: int) -> bytes:
    """The image from a raw body or from the multipart file field ``image``."""
    body = await _read_body(request, limit)
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        return body
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=4, max_fields=16, max_part_size=limit)
    except HTTPException as err:  # Starlette reports malformed multipart this way
        raise InputError(f"malformed multipart body: {err.detail}") from None
    try:
        field = form.get("image")
        if field is None:
            raise InputError(f"multipart body has no field 'image' (fields: {sorted(form.keys())})")
        if not isinstance(field, UploadFile):
            raise InputError("multipart field 'image' must be a file part (with a filename), not a text field")
        return await field.read()
    finally:
        await form.close()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_large = _BodyTooLarge(f"request body is over the limit of {limit} bytes: send a smaller image")
    if declared.isdigit() and int(declared) > limit:
        # A client waiting on "Expect: 100-continue" has sent nothing yet; do not ask for the body.
        if request.headers.get("expect", "").lower() != "100-continue" and int(declared) <= limit + _DRAIN_BYTES:
            async for _ in request.stream():
                pass
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + _DRAIN_BYTES:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_large
    return b"".join(chunks)


def _timings_ms(result: BatchResult, start: float) -> dict[str, float]:
    timings = {"queue": result.queue_ms, "inference": result.run_ms}
    for key, ms in result.timings.items():
        timings[key.removesuffix("_ms")] = ms
    timings["request"] = (time.perf_counter() - start) * 1e3
    return {k: round(v, 3) for k, v in timings.items()}


def _own_sizes(engine: EngineSpecs | None) -> tuple[tuple[int, int], ...]:
    """The one size at which the service takes images at their own size: the batch shape (the largest
    compiled size), for a bundle of several sizes (``Engine.sizes``, config `sizes`) whose engine this
    process holds. The batcher runs one shape, so an image that size holds is padded to it by its edge
    pixels (contract/sizes.py) and its mask cropped back, with no resampling; any other image is
    resized to it as before, also one a smaller, wider compiled size would hold (``Engine.run`` and
    `dualtrack run` use that one). Under ``--workers`` (a worker's ``EngineInfo`` carries no sizes)
    every image is resized, as for a one-size bundle."""
    if engine is None or not getattr(engine, "sizes", ()):
        return ()
    return (tuple(engine.input_spec.shape[1:3]),)  # type: ignore[return-value]


def _tiles(batcher: BatchQueue) -> bool:
    """Whether images larger than the batch shape go through the sliding window: a bundle with ``window:``
    whose engine this process holds (its :class:`Batcher` tiles them); under ``--workers`` and Ray they
    are resized, as for a bundle without one."""
    manifest = getattr(getattr(batcher.engine, "bundle", None), "manifest", None)
    return hasattr(batcher, "tile") and getattr(manifest, "window", None) is not None


def _num_classes(engine: EngineSpecs) -> int:
    """Classes from the probability output's channel dim (NCHW, or NHWC when so laid out); 0 if unknown."""
    for spec in engine.output_specs:
        if spec.name != "mask" and len(spec.shape) == 4:
            return int(spec.shape[-1] if spec.layout == "NHWC" else spec.shape[1])
    return 0


def _error(code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())}, status_code=code, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    _log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}: {exc}")


class _CountRequests:
    """ASGI middleware: counts every HTTP answer by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics, endpoints: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Behind a route prefix (Ray Serve's, a proxy's root_path) the path still carries the prefix.
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        endpoint = path if path in self.endpoints else "other"
        status = 500  # what ServerErrorMiddleware answers if the app raises before starting a response

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.observe_request(endpoint, status)
