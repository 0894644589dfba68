"""Dynamic micro-batching: one worker thread owns the engine; requests wait in a bounded queue.

The engine is not safe for concurrent callers, so every engine call (load, warmup, run, close)
happens on the worker thread; on a GPU the worker stages each batch and hands it to a launcher
thread, which queues it on the GPU, and a collector thread answers it once its masks are down
(:meth:`Engine.stage` / :meth:`Engine.launch` / ``Submission.result``, each on one thread).
Request handlers only :meth:`Batcher.submit` an image and wait on the returned future.

Batching policy (Triton's "dynamic batcher" with ``max_queue_delay``):

- The worker takes the oldest waiting request and gathers more until it holds the largest compiled
  batch size or ``max_batch_delay_s`` has passed since that oldest request arrived, whichever is
  first. A request that already waited while the previous batch ran does not wait again.
- With ``batches_in_flight=K`` (``serve --batches-in-flight``), a batch also stops gathering as
  soon as fewer than ``K`` batches are in the engine (launched and not yet answered): rather than
  let the GPU idle while a batch fills, it starts with the rows it has. Under light load batches
  are then small and start at once; under heavy load they fill while the ones ahead run. ``0``
  (the default) keeps the rule above alone. On the CPU a batch runs before the next is taken, so
  there any ``K >= 1`` starts each batch with whatever is waiting.
- ``n`` gathered requests run at the smallest compiled batch size ``>= n``; pad rows are zeros and
  their outputs are dropped.
- At most ``max_queue`` requests wait (requests inside a running batch do not count). One more is
  refused at once with :class:`QueueFullError`, which the app turns into 503 + ``Retry-After``.
- :meth:`Batcher.close` refuses new work, runs everything already queued without waiting out the
  delay, then closes the engine if the batcher loaded it (an engine passed in is borrowed).

The HTTP app needs only :class:`BatchQueue` of a batcher: a :class:`Batcher` here, or in a worker of
``dualtrack serve --workers N`` an :class:`~dualtrack.serve.shared.EngineClient` that reaches the
engine process's batcher.

Where a batch's time goes, in every request's ``BatchResult.timings`` (ms; the app's JSON
``timings_ms`` and ``Server-Timing``, and ``dualtrack_batch_phase_seconds`` in /metrics):
``batch_gather_ms`` from its oldest request's arrival until it stopped taking rows; on a GPU then
``batch_stage_ms`` (a free device slot, its JPEG decodes finishing, resizes and upload; of it
``batch_slot_ms`` waiting for the slot, ``batch_rows_ms`` writing the GPU rows, of that
``batch_decode_ms`` waiting for the decodes, and ``batch_sync_ms`` waiting for the upload stream),
``batch_handoff_ms`` (staged until the launcher took it) and ``batch_gpu_ms`` (launched until its
masks were on the host: its compute, queued behind the batch ahead, and the download).

Copies: :meth:`Batcher.submit` writes the image straight into its row of the batch it joins, on the
caller's thread, and that batch's array is what the worker hands to ``engine.run``: an
:meth:`~dualtrack.runtime.engine.Engine.host_array` (page-locked on a GPU), reused batch after
batch. The worker thread, the one every batch waits for, copies no image.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, Union, runtime_checkable

import numpy as np

from dualtrack import imaging
from dualtrack.errors import BundleError, DualtrackError, InputError

if TYPE_CHECKING:
    from dualtrack.contract.plan import TensorSpec
    from dualtrack.runtime.engine import Engine
    from dualtrack.runtime.gpu_jpeg import JpegPrefetcher, Ticket
    from dualtrack.runtime.overlap import Staged, Submission

EngineSource = Union["Engine", str, os.PathLike[str], Callable[[], "Engine"]]
"""An engine to borrow, a bundle path to load, or a zero-argument factory that returns an engine."""

MASK_OUTPUT = "mask"
_log = logging.getLogger(__name__)


class QueueFullError(DualtrackError):
    """The request queue holds ``max_queue`` requests already; retry after a short wait."""


class NotReadyError(DualtrackError):
    """The engine is still loading or warming up, failed to load, or the server is shutting down."""


class Phase(enum.Enum):
    """Where the worker is in its life. Only ``READY`` accepts requests."""

    LOADING = "loading"
    WARMING = "warming up"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(frozen=True)
class BatchResult:
    """One request's share of a batch run."""

    mask: np.ndarray  # (H, W) uint8 class ids at the model's resolution; owned by the caller
    batch_size: int  # real requests in the batch
    padded_size: int  # the compiled batch size that ran
    queue_ms: float  # from submit to the start of the engine run
    run_ms: float  # wall time of engine.run for the whole batch
    timings: dict[str, float] = field(default_factory=dict)  # engine.last_timings of that run


@dataclass
class _Request:
    future: Future[BatchResult]
    enqueued: float
    into: np.ndarray | None = None  # where its mask goes (submit's ``into``), else a new array


@dataclass
class _Batch:
    """Requests gathered for one engine run; row ``i`` of ``x`` is ``requests[i]``'s image."""

    x: np.ndarray  # (largest batch size, H, W, 3): an engine host array, reused by later batches
    requests: list[_Request] = field(default_factory=list)
    copying: int = 0  # rows claimed whose image is still being copied in (by submit, off the lock)
    jpegs: dict[int, Ticket] = field(default_factory=dict)  # rows the GPU decodes (submit_jpeg): their decodes
    closed: float = 0.0  # when it stopped taking rows (monotonic)


@dataclass
class _Staged:
    """A batch in the engine's device slot, waiting for its launch (the overlapped path)."""

    requests: list[_Request]  # the live rows, in row order
    failed: set[int]  # rows whose request already failed (a JPEG the CPU path refused too)
    size: int
    staged: Staged
    phases: dict[str, float]  # the batch's phases so far, ms (the module's "Where a batch's time goes")
    ready: float = 0.0  # when it was handed to the launcher (monotonic)
    # The masks' destinations by row (None: a failed or pad row) when every live row has one: the
    # launch writes them there; else None, and _resolve copies into those that have one.
    into: list[np.ndarray | None] | None = None
    # Decoded pictures the GPU still reads (a stage not waited for on the host, Staged.pending):
    # released once the batch's result is in, or after Engine.wait_staged if it never runs.
    tickets: list[Ticket] = field(default_factory=list)


@dataclass(frozen=True)
class LaunchedBatch:
    """What ``on_launch`` learns of a batch the launcher has just queued on the GPU, before its
    requests are resolved: each row the launch writes into its request's ``into`` array, as that
    array and the request's wait from submit to the launch (ms); the batch's real and compiled
    sizes; its timings so far (its phases, the launch's engine timings: ``batch_gpu_ms`` is not
    known yet); when it was launched (``time.monotonic()``); and the engine it runs on."""

    engine: Engine
    rows: tuple[tuple[np.ndarray, float], ...]
    batch_size: int
    padded_size: int
    timings: dict[str, float]
    launched: float


@dataclass(frozen=True)
class _Landed:
    """A launched batch, waiting for the collector: its submission, launch time and engine timings."""

    item: _Staged
    submission: Submission
    start: float
    timings: dict[str, float]


class EngineSpecs(Protocol):
    """What an app reads of an engine: its specs and sizes (an ``Engine``, or a worker's ``EngineInfo``)."""

    @property
    def input_spec(self) -> TensorSpec: ...
    @property
    def output_specs(self) -> tuple[TensorSpec, ...]: ...
    @property
    def batch_sizes(self) -> tuple[int, ...]: ...
    @property
    def device(self) -> str: ...


@runtime_checkable
class BatchQueue(Protocol):
    """What the HTTP app uses of a batcher: its life cycle, its readiness, the engine's specs, submit.

    :class:`Batcher` is one; :class:`~dualtrack.serve.shared.EngineClient`, a worker's handle on the
    engine process, is the other. Both raise the same errors from ``submit`` and from the future it
    returns, so the app answers the same HTTP status whichever it holds.
    """

    @property
    def phase(self) -> Phase: ...
    @property
    def error(self) -> str:
        """Why the engine cannot serve (failed to load, unreachable); empty otherwise."""
        ...

    @property
    def engine(self) -> EngineSpecs | None:
        """The engine's specs once loaded (``None`` before)."""
        ...

    def start(self) -> None:
        """Begin loading or connecting; readiness is reported by :attr:`phase`, never raised."""
        ...

    def close(self, timeout: float | None = None) -> bool:
        """Finish the accepted requests and stop; False if still busy after ``timeout`` seconds."""
        ...

    def submit(self, image: np.ndarray) -> Future[BatchResult]:
        """Queue one ``(H, W, 3)`` uint8 image (copied before this returns); a future of its result.

        Raises :class:`NotReadyError`, :class:`QueueFullError` or :class:`InputError` at once; the
        future fails with one of those or with a :class:`DualtrackError` (the engine failed).
        """
        ...


EngineT = TypeVar("EngineT")  # what a queue knows of its engine: an Engine, or a worker's EngineInfo


class QueueState(Generic[EngineT]):
    """The readiness every :class:`BatchQueue` keeps, and its three properties: the phase, why it
    failed, and the engine once known. The holder sets the fields (from any thread: each is
    replaced whole; :attr:`_error` before :attr:`_phase`, so a reader that sees FAILED finds why)."""

    _phase: Phase = Phase.LOADING
    _error: str = ""
    _engine: EngineT | None = None

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def error(self) -> str:
        """Why loading, warmup or connecting failed; empty otherwise."""
        return self._error

    @property
    def engine(self) -> EngineT | None:
        """The engine once loaded (a worker's: its specs). A :class:`Batcher`'s specs may be read
        from any thread; it is called only through the batcher."""
        return self._engine

    def _not_ready(self) -> NotReadyError:
        """What ``submit`` raises before the phase is READY."""
        reason = f": {self._error}" if self._error else ""
        return NotReadyError(f"engine is {self._phase.value}{reason}")


def padded_batch_size(n: int, batch_sizes: tuple[int, ...]) -> int:
    """The smallest compiled batch size that holds ``n`` rows."""
    for size in sorted(batch_sizes):
        if size >= n:
            return size
    raise InputError(f"{n} rows exceed the largest compiled batch size {max(batch_sizes)}")


class Batcher(QueueState["Engine"]):
    """Owns an engine on one worker thread and runs queued images in micro-batches.

    ``on_batch`` (if given) is called on the worker thread (on a GPU, the collector) after every batch with the batch's
    :class:`BatchResult` of every row, in row order (sizes and timings are shared by all rows),
    on the thread that resolved the batch's futures and after all of them (``serve --workers``
    wakes the workers with answers in the batch then: serve/shared.py).
    ``on_phase`` (if given) is called with the new :class:`Phase` and :attr:`error` whenever the
    phase changes, on the thread that changed it. ``on_launch`` (if given) is called on the GPU
    path's launcher thread with a :class:`LaunchedBatch` once a batch whose rows go into their
    requests' ``into`` arrays is queued, before the collector may resolve it (``serve --workers``
    has the GPU mark those answers and wake the workers then: serve/shared.py). None of them may
    block: the next batch waits for them.
    """

    def __init__(
        self,
        source: EngineSource,
        *,
        max_batch_delay_s: float,
        max_queue: int,
        device: str = "cpu",
        device_index: int = 0,
        on_batch: Callable[[list[BatchResult]], None] | None = None,
        on_phase: Callable[[Phase, str], None] | None = None,
        jpeg_decoder: str = "auto",
        batches_in_flight: int = 0,
        on_launch: Callable[[LaunchedBatch], None] | None = None,
    ) -> None:
        if max_batch_delay_s < 0:
            raise ValueError(f"max_batch_delay_s must be >= 0, got {max_batch_delay_s}")
        if batches_in_flight < 0:
            raise ValueError(f"batches_in_flight must be >= 0, got {batches_in_flight}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._source = source
        self._device = device
        self._device_index = device_index
        self._delay = max_batch_delay_s
        self._max_queue = max_queue
        self._in_flight_wanted = batches_in_flight
        self._in_flight = 0  # batches handed to the launcher whose results have not come back (GPU path)
        self._on_batch = on_batch
        self._on_phase = on_phase
        self._on_launch = on_launch
        self._pending: deque[_Batch] = deque()  # oldest first; only the last one may still take rows
        self._waiting = 0  # requests in _pending
        self._spare: list[np.ndarray] = []  # batch arrays not in use
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="dualtrack-batcher", daemon=True)
        self._wanted_decoder = jpeg_decoder
        self.decoder = ("cpu", "the engine is loading")  # (name, reason): which decoder takes JPEGs
        self._jpeg: Any = None  # runtime.gpu_jpeg.GpuJpegDecoder when the decoder is "gpu"
        self._prefetch: JpegPrefetcher | None = None  # decodes each JPEG as it arrives, with _jpeg

    # --- state, read from any thread -------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Requests waiting, not counting a batch that is running."""
        return self._waiting

    # --- life cycle ------------------------------------------------------------------------------

    def _set_phase(self, phase: Phase) -> None:
        self._phase = phase
        if self._on_phase is not None:
            try:
                self._on_phase(phase, self._error)
            except Exception:  # a listener's bug must not stop inference
                _log.exception("on_phase callback failed")

    def start(self) -> None:
        """Start the worker: it loads (if needed) and warms up the engine, then serves the queue."""
        self._thread.start()

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests, finish the queued ones, stop the worker.

        Returns False if the worker was still busy after ``timeout`` seconds.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def submit(self, image: np.ndarray, *, into: np.ndarray | None = None) -> Future[BatchResult]:
        """Queue one ``(H, W, 3)`` uint8 image; the future resolves to its :class:`BatchResult`.

        The image is copied into its batch's input array before this returns (on the calling
        thread, so callers copy in parallel); the caller may reuse ``image`` at once. With
        ``into`` (an ``(H, W)`` uint8 array the caller keeps untouched until the future resolves)
        the mask is written there and the result's ``mask`` is ``into``: when every row of a batch
        has one in memory :meth:`Engine.pin_host <dualtrack.runtime.engine.Engine.pin_host>`
        registered, the masks go there straight from the GPU (``serve --workers N``: the requests'
        slots), else they are copied there.
        Raises :class:`NotReadyError` before the engine is warm or after :meth:`close`,
        :class:`QueueFullError` when ``max_queue`` requests wait, :class:`InputError` on a wrong shape.
        """
        engine = self._ready_engine()
        expected = tuple(engine.input_spec.shape[1:])
        if image.shape != expected or image.dtype != np.uint8:
            raise InputError(f"image is {image.dtype}{list(image.shape)}, the engine takes uint8{list(expected)}")
        request, batch, row = self._claim_row(engine, into)
        try:
            batch.x[row] = image
        except BaseException:
            request.future.cancel()  # the worker drops a cancelled row
            raise
        finally:
            self._copied(batch)
        return request.future

    def tile(self, image: np.ndarray) -> tuple[BatchResult, int]:
        """An ``(H, W, 3)`` image larger than every compiled size through the engine's sliding window (a
        bundle with ``window:``, runtime/tiling.py), on the calling thread (an image thread), and the
        windows it ran. Not a batch of its own: the engine's lock orders its window runs with the
        batches (on a GPU the whole image at once, on the CPU each batch of windows)."""
        engine = self._ready_engine()
        t0 = time.perf_counter()
        mask = engine.run(image[None], outputs=["mask"])["mask"][0]
        run_ms = (time.perf_counter() - t0) * 1e3
        return BatchResult(mask, 1, 1, 0.0, run_ms), engine.windows(image.shape[:2])

    def submit_jpeg(self, jpeg: imaging.GpuJpeg, *, into: np.ndarray | None = None) -> Future[BatchResult]:
        """Queue one JPEG that :func:`dualtrack.imaging.route_jpeg` gave the GPU: it is decoded and
        resized on the engine's GPU when its batch is staged (a JPEG nvImageCodec refuses is decoded
        on the CPU then, and fails its future with the CPU path's :class:`InputError` if that refuses
        it too). Raises as :meth:`submit`, and :class:`NotReadyError` when the decoder is not ``gpu``.
        Its decode starts at once, while its batch fills (:class:`~dualtrack.runtime.gpu_jpeg.JpegPrefetcher`).
        ``into`` as for :meth:`submit`."""
        engine = self._ready_engine()
        if self._jpeg is None:
            raise NotReadyError(f"the JPEG decoder is {self.decoder[0]}: decode on the CPU and call submit()")
        request, batch, row = self._claim_row(engine, into)
        assert self._prefetch is not None
        ticket = self._prefetch.add(jpeg)  # its decode starts now, on the prefetcher's thread
        with self._cond:
            batch.jpegs[row] = ticket
        self._copied(batch)
        return request.future

    def _copied(self, batch: _Batch) -> None:
        """A claimed row is filled in; the worker waits for that only once the batch has closed.
        (Each wake-up of the worker is a GIL turn for a thread that would go back to waiting.)"""
        with self._cond:
            batch.copying -= 1
            if not batch.copying and batch.closed:
                self._cond.notify()

    def _ready_engine(self) -> Engine:
        engine = self._engine
        if self._phase is not Phase.READY or engine is None:
            raise self._not_ready()
        return engine

    def _claim_row(self, engine: Engine, into: np.ndarray | None) -> tuple[_Request, _Batch, int]:
        """A row of the batch that takes requests now (counted as copying until the caller is done)."""
        if into is not None:
            shape = next(tuple(o.shape[1:]) for o in engine.output_specs if o.name == MASK_OUTPUT)
            if into.shape != shape or into.dtype != np.uint8 or not into.flags.c_contiguous or not into.flags.writeable:
                raise InputError(
                    f"into is a {into.dtype}{list(into.shape)} array; "
                    f"a mask needs a writable C-contiguous uint8{list(shape)}"
                )
        request = _Request(Future(), time.monotonic(), into)
        with self._cond:
            if self._closing:
                raise NotReadyError("server is shutting down")
            if self._waiting >= self._max_queue:
                raise QueueFullError(
                    f"request queue is full ({self._max_queue} waiting): retry shortly or raise --max-queue"
                )
            batch = self._pending[-1] if self._pending else None
            opened = batch is None or len(batch.requests) == len(batch.x)
            if opened:
                batch = _Batch(self._spare.pop() if self._spare else self._new_array(engine))
                self._pending.append(batch)
            assert batch is not None
            row = len(batch.requests)
            batch.requests.append(request)
            batch.copying += 1
            self._waiting += 1
            if opened or len(batch.requests) == len(batch.x):  # what the worker waits for (_take_batch)
                self._cond.notify()
        return request, batch, row

    def _new_array(self, engine: Engine) -> np.ndarray:
        # At most ceil(max_queue / largest batch) + 1 are ever in use at once (the queued batches and
        # the running one), so no more are ever made. Engines without host arrays (test doubles) get
        # plain numpy.
        size = max(engine.batch_sizes)
        host_array = getattr(engine, "host_array", None)
        if host_array is None:
            return np.zeros((size, *engine.input_spec.shape[1:]), dtype=np.uint8)
        return host_array(size)

    # --- worker thread ---------------------------------------------------------------------------

    def _work(self) -> None:
        owned = not _is_engine(self._source)
        try:
            engine = self._load()
        except Exception as err:  # any load failure is reported by /readyz, never raised into the server
            self._fail(f"engine failed to load: {err}")
            return
        try:
            self._set_phase(Phase.WARMING)
            engine.warmup()
            # The running batch and the next one: no request thread waits for page-locked memory
            # (milliseconds to allocate) until the load calls for a third.
            self._spare = [self._new_array(engine) for _ in range(2)]
            self._open_decoder(engine)
            self._engine = engine
            self._set_phase(Phase.READY)
            if getattr(engine, "device", "cpu") == "cuda":
                self._pipeline(engine)
            else:  # on the CPU there is no copy to overlap: one batch at a time, as before
                while self._serve_one_batch(engine):
                    pass
        except Exception as err:
            self._fail(f"engine failed: {err}")
        finally:
            self._set_phase(Phase.CLOSED if not self._error else Phase.FAILED)
            with self._cond:
                self._spare.clear()  # host arrays die with the engine: drop them first
            if self._prefetch is not None:
                self._prefetch.close()  # its pictures and stream, while the context lives
                self._prefetch = None
            if self._jpeg is not None:
                self._jpeg.close()
            self._jpeg = None  # its nvImageCodec decoder and kernel before the engine's context
            gc.collect()  # and anything of theirs that a reference cycle still holds, while the context lives
            if owned:
                engine.close()

    def _open_decoder(self, engine: Engine) -> None:
        if getattr(engine, "device", "cpu") == "cuda" or self._wanted_decoder == "gpu":
            from dualtrack.runtime.gpu_jpeg import open_decoder  # the GPU stack, only for a GPU engine
            from dualtrack.settings import Settings

            settings = Settings.from_env()
            choice, self._jpeg = open_decoder(engine, self._wanted_decoder, settings.cache_dir / "jit")
            self.decoder = (choice.name, choice.reason)
            if self._jpeg is not None:
                from dualtrack.runtime.gpu_jpeg import JpegPrefetcher

                largest = max(engine.batch_sizes)
                # JPEG decode threads, each with an nvImageCodec decoder and stream (DUALTRACK_JPEG_LANES).
                lanes = [self._jpeg.decode_now, *(self._jpeg.add_lane() for _ in range(settings.jpeg_lanes - 1))]
                self._prefetch = JpegPrefetcher(
                    lanes,
                    ahead_bytes=settings.jpeg_ahead_mb << 20,  # DUALTRACK_JPEG_AHEAD_MB
                    most_per_call=largest,
                    on_thread=self._jpeg.ctx.make_current,
                )
        else:
            self.decoder = ("cpu", f"Pillow on the image threads: the engine runs on {engine.device}")
        sys.stderr.write(f"dualtrack serve: JPEG decoder {self.decoder[0]} ({self.decoder[1]})\n")

    # --- the overlapped path: stage here, launch on the launcher thread, answer on the collector ----

    def _pipeline(self, engine: Engine) -> None:
        """Stage each batch (upload, GPU decode) on this thread while the launcher thread queues the
        previous one on the GPU and the collector thread waits for the one before and answers it
        (runtime/overlap.py). The launcher never waits for a result: a batch staged while the one
        ahead still computes is queued behind it at once, so the GPU does not idle while a batch's
        masks come down and its requests are answered."""
        handoff: queue.Queue[_Staged | None] = queue.Queue(maxsize=1)
        # Launched batches, oldest first: at most the engine's slots (a stage waits for a collected slot).
        # SimpleQueue (C): queue.Queue's Python Condition costs its callers GIL time on every put and get.
        landed: queue.SimpleQueue[_Landed | None] = queue.SimpleQueue()
        failure: list[BaseException] = []
        launcher = threading.Thread(
            target=self._launch_loop, args=(engine, handoff, landed, failure), name="dualtrack-launcher", daemon=True
        )
        collector = threading.Thread(
            target=self._collect_loop, args=(landed, failure), name="dualtrack-collector", daemon=True
        )
        launcher.start()
        collector.start()
        try:
            while not failure:
                batch = self._take_batch()
                if batch is None:
                    break
                try:
                    staged = self._stage(engine, batch)
                except Exception as err:  # one bad batch fails its requests, not the server
                    _fail_unanswered(batch.requests, err)
                    continue
                finally:
                    with self._cond:
                        self._spare.append(batch.x)  # uploaded (or failed): the host array is free
                if staged is not None:
                    staged.ready = time.monotonic()
                    with self._cond:
                        self._in_flight += 1  # until the collector has its result (_landed)
                    handoff.put(staged)
        finally:
            handoff.put(None)
            launcher.join()  # it ends the collector's queue
            collector.join()
        if failure:
            raise failure[0]

    def _stage(self, engine: Engine, batch: _Batch) -> _Staged | None:
        x = batch.x
        live = [i for i, r in enumerate(batch.requests) if r.future.set_running_or_notify_cancel()]
        jpegs: dict[int, Ticket] = {}
        for row, i in enumerate(live):
            if i in batch.jpegs:
                jpegs[row] = batch.jpegs[i]
            elif row != i:
                x[row] = x[i]
        requests = [batch.requests[i] for i in live]
        n = len(requests)
        prefetch = self._prefetch
        if n == 0:
            for ticket in batch.jpegs.values():
                prefetch.release(ticket)  # type: ignore[union-attr]
            return None
        size = padded_batch_size(n, engine.batch_sizes)
        x[n:size] = 0
        failed: set[int] = set()
        fill = None
        # The decoded pictures (the prefetcher's tickets) are released after stage() has
        # synchronised its upload stream, the resizes' stream, on this thread while the engine's
        # context is alive; if staging fails after fill queued resizes, that stream is waited for first.
        # A stage the engine orders on the GPU alone (Staged.pending: no host wait) hands them to
        # the _Staged, released once its result is in (_release_tickets).
        used: list[Any] = []
        decode_wait = [0.0]  # seconds fill waited for the prefetcher's decodes
        if jpegs:
            assert prefetch is not None
            _, height, width, _ = engine.input_spec.shape

            def fill(stream: Any, tensor: Any) -> set[int]:
                used.append(stream)
                written: set[int] = set()
                resizes = []  # every GPU row's resize in one launch: one driver call per batch
                for row, ticket in jpegs.items():
                    t0 = time.monotonic()
                    image = prefetch.take(ticket)
                    decode_wait[0] += time.monotonic() - t0
                    if not isinstance(image, str):
                        resizes.append(self._jpeg.job(image, ticket.jpeg, tensor.ptr + row * height * width * 3))
                        written.add(row)
                        continue
                    try:  # refused by nvImageCodec: the CPU path decides, pixels or its 400
                        x[row] = imaging.load_for_model(ticket.jpeg.data, height, width).pixels
                    except InputError as err:
                        _log.info("JPEG refused by nvImageCodec (%s) and by the CPU path: %s", image, err)
                        x[row] = 0
                        failed.add(row)
                        requests[row].future.set_exception(err)
                self._jpeg.resize_rows(stream, resizes, height, width)
                return written

        ok = False
        held: list[Ticket] = []  # the tickets a pending stage keeps until its result
        try:
            staged = _Staged(requests, failed, size, engine.stage(x[:size], fill), {})
            if getattr(staged.staged, "pending", False):
                held = staged.tickets = list(batch.jpegs.values())
            staged.phases["batch_gather_ms"] = (batch.closed - batch.requests[0].enqueued) * 1e3
            staged.phases["batch_stage_ms"] = (time.monotonic() - batch.closed) * 1e3
            for part, ms in getattr(staged.staged, "timings", {}).items():  # slot wait, rows written, upload wait
                staged.phases[f"batch_{part}_ms"] = ms
            if jpegs:
                staged.phases["batch_decode_ms"] = decode_wait[0] * 1e3
            if all(r.into is not None for r in requests):
                # A failed row's request is answered already, and its caller may reuse its array.
                staged.into = [None if row in failed else r.into for row, r in enumerate(requests)]
                staged.into += [None] * (size - n)
            ok = True
            return staged
        finally:
            if not ok and used:
                used[0].synchronize()
            for ticket in batch.jpegs.values():
                if not (ok and held):
                    prefetch.release(ticket)  # type: ignore[union-attr]

    def _launch_loop(
        self,
        engine: Engine,
        handoff: queue.Queue[_Staged | None],
        landed: queue.SimpleQueue[_Landed | None],
        failure: list[BaseException],
    ) -> None:
        try:
            while (item := handoff.get()) is not None:
                start = time.monotonic()
                item.phases["batch_handoff_ms"] = (start - item.ready) * 1e3
                try:
                    into = None if item.into is None else {MASK_OUTPUT: item.into}
                    submission = engine.launch(item.staged, outputs=(MASK_OUTPUT,), into=into)
                except Exception as err:
                    self._landed()
                    self._release_tickets(item, unlaunched_on=engine)
                    self._fail_rows(item, err)
                    continue
                timings = dict(engine.last_timings)  # this launch's
                if self._on_launch is not None and item.into is not None:
                    self._launched(engine, item, start, timings)
                landed.put(_Landed(item, submission, start, timings))
        except BaseException as err:  # a bug here stops the worker: no request may hang
            failure.append(err)
            while (item := handoff.get()) is not None:
                self._release_tickets(item, unlaunched_on=engine)
                self._fail_rows(item, err)
        finally:
            landed.put(None)

    def _launched(self, engine: Engine, item: _Staged, start: float, timings: dict[str, float]) -> None:
        assert self._on_launch is not None and item.into is not None
        rows = tuple(
            (into, (start - r.enqueued) * 1e3)
            for r, into in zip(item.requests, item.into, strict=False)
            if into is not None
        )
        batch = LaunchedBatch(engine, rows, len(item.requests), item.size, {**timings, **item.phases}, start)
        try:
            self._on_launch(batch)
        except Exception:  # its requests are answered as any others, once resolved
            _log.exception("on_launch callback failed")

    def _collect_loop(self, landed: queue.SimpleQueue[_Landed | None], failure: list[BaseException]) -> None:
        try:
            while (entry := landed.get()) is not None:
                self._answer(entry)
        except BaseException as err:  # a bug here stops the worker: no request may hang
            failure.append(err)
            self._fail_rows(entry.item, err)  # type: ignore[union-attr]
            while (entry := landed.get()) is not None:
                with contextlib.suppress(Exception):
                    entry.submission.result()  # its slot is collected: a stage waiting for it goes on
                self._release_tickets(entry.item)
                self._fail_rows(entry.item, err)

    def _release_tickets(self, item: _Staged, unlaunched_on: Engine | None = None) -> None:
        """Free the decoded pictures a pending stage kept: after its result (the GPU passed the
        resizes before the compute), or, for a batch never launched on ``unlaunched_on``, once
        that GPU has passed its stage (Engine.wait_staged)."""
        if not item.tickets:
            return
        if unlaunched_on is not None:
            with contextlib.suppress(Exception):  # a broken context: nothing reads them any more
                unlaunched_on.wait_staged(item.staged)
        tickets, item.tickets = item.tickets, []
        for ticket in tickets:
            self._prefetch.release(ticket)  # type: ignore[union-attr]

    def _landed(self) -> None:
        """One batch fewer in the engine; with ``batches_in_flight``, the gathering batch may start."""
        with self._cond:
            self._in_flight -= 1
            if self._in_flight < self._in_flight_wanted:
                self._cond.notify()

    def _fail_rows(self, item: _Staged, err: BaseException) -> None:
        _fail_unanswered([r for row, r in enumerate(item.requests) if row not in item.failed], err)

    def _answer(self, entry: _Landed) -> None:
        item = entry.item
        try:
            masks = entry.submission.result().get(MASK_OUTPUT)  # None: the launch wrote them into the rows' arrays
        except Exception as err:
            self._fail_rows(item, err)
            return
        finally:
            self._landed()  # its GPU work is done (or failed): a batch gathering may start
            self._release_tickets(item)
        run_ms = (time.monotonic() - entry.start) * 1e3
        timings = {**entry.timings, **item.phases, "batch_gpu_ms": run_ms}
        self._resolve(item.requests, masks, item.size, entry.start, run_ms, timings, item.failed)

    def _load(self) -> Engine:
        source = self._source
        if _is_engine(source):
            engine = source
        elif callable(source):
            engine = source()
        else:
            from dualtrack.runtime.engine import Engine

            engine = Engine.load(Path(source), device=self._device, device_index=self._device_index)
        spec = engine.input_spec
        if len(spec.shape) != 4 or spec.shape[-1] != 3 or spec.dtype != "uint8":
            raise BundleError(
                f"the bundle's input {spec.name!r} is {spec.dtype}{list(spec.shape)}; serving needs uint8 (1, H, W, 3) "
                "RGB images, channels last"
            )
        names = [spec.name for spec in engine.output_specs]
        if MASK_OUTPUT not in names:
            raise BundleError(f"the bundle's outputs are {names}; serving needs an output named {MASK_OUTPUT!r}")
        return engine

    def _fail(self, message: str) -> None:
        self._error = message
        self._set_phase(Phase.FAILED)
        with self._cond:
            failed = [r for batch in self._pending for r in batch.requests]
            self._pending.clear()
            self._waiting = 0
        for request in failed:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(NotReadyError(message))

    def _take_batch(self) -> _Batch | None:
        """Block until a batch is due; None once closing and drained."""
        with self._cond:
            while not self._pending and not self._closing:
                self._cond.wait()
            if not self._pending:
                return None
            batch = self._pending[0]
            deadline = batch.requests[0].enqueued + self._delay
            while len(batch.requests) < len(batch.x) and not self._closing:
                if self._in_flight < self._in_flight_wanted:
                    break  # the engine would idle while this batch fills: start it with the rows it has
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            self._pending.popleft()  # from here on, new requests start the next batch
            batch.closed = time.monotonic()
            self._waiting -= len(batch.requests)
            while batch.copying:  # rows claimed just before: their copies take microseconds
                self._cond.wait()
        return batch

    def _serve_one_batch(self, engine: Engine) -> bool:
        batch = self._take_batch()
        if batch is None:
            return False
        try:
            self._run(engine, batch)
        except BaseException as err:  # a bug here stops the worker (_work): its requests must not hang
            _fail_unanswered(batch.requests, err)
            raise
        finally:
            with self._cond:
                self._spare.append(batch.x)
        return True

    def _run(self, engine: Engine, batch: _Batch) -> None:
        x = batch.x
        # A client that went away cancelled its future: do not spend a batch row on it. The rows
        # after it move up (rare: only a disconnect or a failed copy leaves a hole).
        live = [i for i, r in enumerate(batch.requests) if r.future.set_running_or_notify_cancel()]
        for row, i in enumerate(live):
            if row != i:
                x[row] = x[i]
        requests = [batch.requests[i] for i in live]
        n = len(requests)
        if n == 0:
            return
        size = padded_batch_size(n, engine.batch_sizes)
        x[n:size] = 0  # pad rows are zeros, not an earlier batch's images
        start = time.monotonic()
        try:
            outputs = engine.run(x[:size], outputs=(MASK_OUTPUT,))  # probs stay on the device
        except Exception as err:  # one bad batch fails its requests, not the server
            for request in requests:
                request.future.set_exception(err)
            return
        run_ms = (time.monotonic() - start) * 1e3
        timings = {**engine.last_timings, "batch_gather_ms": (batch.closed - batch.requests[0].enqueued) * 1e3}
        masks = outputs[MASK_OUTPUT]  # new arrays each run (Engine.run): the rows need no copy
        self._resolve(requests, masks, size, start, run_ms, timings, set())

    def _resolve(
        self,
        requests: list[_Request],
        masks: np.ndarray | None,
        size: int,
        start: float,
        run_ms: float,
        timings: dict[str, float],
        failed: set[int],
    ) -> None:
        """Answer every request of a run with its mask row (but the ``failed`` rows), then ``on_batch``.
        ``masks`` None: each row's mask is in its request's ``into`` already."""
        n = len(requests)
        rows: list[np.ndarray] = []
        for i, r in enumerate(requests):
            if r.into is None:
                assert masks is not None, "a request without into in a batch launched into the rows' arrays"
                rows.append(masks[i])
                continue
            if masks is not None and i not in failed:
                r.into[...] = masks[i]
            rows.append(r.into)
        results = [
            BatchResult(rows[i], n, size, (start - r.enqueued) * 1e3, run_ms, timings) for i, r in enumerate(requests)
        ]
        for row, (request, result) in enumerate(zip(requests, results, strict=True)):
            if row not in failed:
                request.future.set_result(result)
        if self._on_batch is not None:
            try:
                self._on_batch(results)
            except Exception:  # a metrics bug must not stop inference
                _log.exception("on_batch callback failed")


def _fail_unanswered(requests: list[_Request], err: BaseException) -> None:
    for request in requests:
        if not request.future.done():
            request.future.set_exception(err)


def _is_engine(source: object) -> bool:
    # Duck-typed so the batcher does not import the runtime (and its GPU stack) to check a type.
    return hasattr(source, "run") and hasattr(source, "batch_sizes") and hasattr(source, "input_spec")
