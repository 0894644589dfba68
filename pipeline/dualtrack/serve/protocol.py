"""The messages between the engine process of ``dualtrack serve --workers N`` and its HTTP workers.

Each worker has one connection to the engine process (:mod:`multiprocessing.connection` over a
Unix socket; :mod:`dualtrack.serve.shared` has the processes, the threads and the slot file).
Every message is one of the frozen dataclasses below. Receivers dispatch on the type (``match``);
anything else means the peer is broken or not ours: the receiver logs it and closes that connection.

Engine process → worker
    First exactly one of :class:`Hello` (the worker's range of image slots, the engine's specs and
    phase) or :class:`Refused` (no range is free; the engine process hangs up after it). Then:

    - for every :class:`RunRequest`, exactly one answer: where the Hello names an ``answers``
      semaphore file, a request that ran is answered in its slot (the word at the start of the
      slot's answer area set to its id + 1, the worker's semaphore posted once per batch), with no
      message; otherwise, and for a request that failed or was withdrawn, exactly one of
      :class:`Done`, :class:`Failed` or :class:`Cancelled`, in the order the requests finish (not
      the order they were sent); answers that are ready together travel as one :class:`Replies`;
    - for every :class:`Question`, one :class:`Answer`, after everything the worker sent before it;
    - a :class:`PhaseChanged` whenever the batcher's phase changes (loading, warm, failed, closed),
      with the JPEG decoder the engine process has (``gpu`` once nvImageCodec opened on its GPU).

Worker → engine process, after the Hello
    - :class:`RunRequest`: slot ``slot`` of the worker's range holds an image; queue it. The slot
      belongs to the engine process until the request's answer arrives (a Done's mask is written
      into that same slot).
    - :class:`RunJpeg`: the same, but the slot holds the first ``nbytes`` of a JPEG that
      :func:`dualtrack.imaging.route_jpeg` gave the GPU; the engine process decodes it on its GPU
      with its batch. Sent only while the engine process reports the ``gpu`` decoder.
    - :class:`Cancel`: the client went away; withdraw the request if its batch has not started
      (it is then answered :class:`Cancelled`; one whose batch started is answered as usual).
    - :class:`Question`: ``"metrics"``, the whole service's Prometheus text.
    - :class:`Observations`: the worker's HTTP metrics since its last flush, in bulk.

Request and question ids are the worker's, from one counter that is never reset, so a late
answer cannot be taken for a newer request's.

Encoding: pickle, what :class:`~multiprocessing.connection.Connection` sends by default, not JSON.
Both ends run the same installed dualtrack (the engine process starts its workers), the peer has
proven it holds the engine process's random key before either side unpickles a byte, and the
payloads are Python values that JSON would need converters for (a :class:`Phase`, TensorSpecs,
the metrics text as bytes). Messages are small and few: the images travel in the slot file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np

from dualtrack.contract.plan import TensorSpec
from dualtrack.errors import DualtrackError, InputError
from dualtrack.serve.batcher import BatchResult, NotReadyError, Phase, QueueFullError
from dualtrack.serve.placement import engine_placement

ErrorKind: TypeAlias = Literal["queue_full", "not_ready", "input", "engine"]
# The errors a request can fail with, by the name they travel under: the worker raises the same
# class the batcher raised, so the app maps it to the same HTTP status in every process layout.
_ERRORS: dict[ErrorKind, type[DualtrackError]] = {
    "queue_full": QueueFullError,
    "not_ready": NotReadyError,
    "input": InputError,
    "engine": DualtrackError,
}


class ProtocolError(DualtrackError):
    """A peer sent something that is not a message of this protocol at that point."""


@dataclass(frozen=True)
class EngineInfo:
    """What an app reads from its engine (specs and sizes): the part of an Engine a worker sees."""

    input_spec: TensorSpec
    output_specs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]
    device: str
    # Where each engine runs (dualtrack.serve.placement): a Ray model replica's own, and in a Ray
    # ingress every live model replica's; empty where nobody asked (``/readyz`` then omits it).
    devices: tuple[dict[str, Any], ...] = ()
    # A Ray model replica's JPEG decoder (name, reason): "gpu" where its batcher decodes on the GPU,
    # and the ingress then sends it the JPEG bytes (ModelClient.submit_jpeg).
    decoder: tuple[str, str] = ("cpu", "Pillow in the HTTP processes")

    @classmethod
    def of(cls, engine: Any, *, placed: bool = False) -> EngineInfo:
        """``engine``'s specs; with ``placed``, also where it runs (a few CUDA driver calls)."""
        devices = (engine_placement(engine),) if placed else ()
        return cls(engine.input_spec, tuple(engine.output_specs), tuple(engine.batch_sizes), engine.device, devices)


# --- engine process -> worker --------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The first message to an accepted worker: its slot range in the slot file, and the engine."""

    slot_path: str  # the slot file, mapped by both processes
    slot_count: int  # slots in the whole file
    slot_bytes: int  # bytes per slot: one input image; its mask fits in its place
    first_slot: int  # where this worker's range starts in the file
    slots: int  # slots in this worker's range: RunRequest.slot is in 0 .. slots - 1
    info: EngineInfo
    phase: Phase
    error: str  # why loading or warmup failed; empty otherwise
    decoder: tuple[str, str] = ("cpu", "the engine is loading")  # the batcher's JPEG decoder: (name, reason)
    # The last ``answer_bytes`` of every slot hold its request's answer once it has run, and the
    # semaphore file ``answers`` (one semaphore per slot range) wakes the worker that owns the
    # range: shared.SlotFile.write_answer. Empty: answers come only as messages.
    answers: str = ""
    answer_bytes: int = 0


@dataclass(frozen=True)
class Refused:
    """The first and last message to a worker the engine process cannot take."""

    reason: str


@dataclass(frozen=True)
class Done:
    """Request ``rid`` ran: its mask is in its slot; the rest of its :class:`BatchResult` is here.

    The hand-overs around the batch, for the request's timings: ``in_ms`` from the worker's send
    of its :class:`RunRequest` to the engine process's reader having it, ``writer_ms`` from its
    batch's answer to this message, ``sent`` when this was sent (``time.monotonic()``: one clock for
    every process of the machine, so the worker times the way back)."""

    rid: int
    batch_size: int
    padded_size: int
    queue_ms: float
    run_ms: float
    timings: dict[str, float] = field(default_factory=dict)
    in_ms: float = 0.0
    writer_ms: float = 0.0
    sent: float = 0.0

    @classmethod
    def of(
        cls, rid: int, result: BatchResult, *, in_ms: float = 0.0, writer_ms: float = 0.0, sent: float = 0.0
    ) -> Done:
        return cls(
            rid, result.batch_size, result.padded_size, result.queue_ms, result.run_ms, result.timings,
            in_ms, writer_ms, sent,
        )  # fmt: skip

    def result(self, mask: np.ndarray, received: float = 0.0) -> BatchResult:
        """The request's result with ``mask``, read back from its slot; with ``received`` (when the
        worker had this message, monotonic) its timings add the hand-overs (``hop_*_ms``)."""
        timings = self.timings
        if self.sent and received:
            hops = {
                "hop_in_ms": self.in_ms,
                "hop_writer_ms": self.writer_ms,
                "hop_back_ms": (received - self.sent) * 1e3,
            }
            timings = {**timings, **hops}
        return BatchResult(mask, self.batch_size, self.padded_size, self.queue_ms, self.run_ms, timings)


@dataclass(frozen=True)
class Failed:
    """Request ``rid`` failed: refused by the batcher, a bad slot, or its batch failed."""

    rid: int
    kind: ErrorKind
    message: str

    @classmethod
    def of(cls, rid: int, err: BaseException) -> Failed:
        # Exact classes only: a subclass the worker cannot name travels as an engine failure (500).
        for kind, error in _ERRORS.items():
            if type(err) is error:
                return cls(rid, kind, str(err))
        return cls(rid, "engine", str(err))

    def error(self) -> DualtrackError:
        """The exception the batcher raised, to raise in the worker."""
        return _ERRORS[self.kind](self.message)


@dataclass(frozen=True)
class Cancelled:
    """Request ``rid`` was withdrawn before its batch ran (the worker cancelled it, or shutdown)."""

    rid: int


@dataclass(frozen=True)
class Answer:
    """The answer to :class:`Question` ``qid``."""

    qid: int
    value: bytes


@dataclass(frozen=True)
class PhaseChanged:
    """The batcher's phase changed; ``error`` says why when it failed."""

    phase: Phase
    error: str
    decoder: tuple[str, str] = ("cpu", "the engine is loading")  # the batcher's JPEG decoder: (name, reason)


# --- worker -> engine process --------------------------------------------------------------------


@dataclass(frozen=True)
class RunRequest:
    """Run the image in slot ``slot`` of the worker's range, as request ``rid``; ``sent``: when
    (``time.monotonic()``, for :attr:`Done.in_ms`)."""

    rid: int
    slot: int
    sent: float = 0.0


@dataclass(frozen=True)
class RunJpeg:
    """Run the JPEG whose first ``nbytes`` are in slot ``slot``, as request ``rid``: decoded on the
    engine's GPU. ``stored`` (width, height) and ``orientation`` are its header's
    (:class:`dualtrack.imaging.GpuJpeg`)."""

    rid: int
    slot: int
    nbytes: int
    stored: tuple[int, int]
    orientation: int
    sent: float = 0.0


@dataclass(frozen=True)
class Cancel:
    """Withdraw request ``rid`` if its batch has not started."""

    rid: int


@dataclass(frozen=True)
class Question:
    """Ask the engine process for ``what``: ``"metrics"`` (the Prometheus text of the whole service)."""

    qid: int
    what: str


@dataclass(frozen=True)
class RequestObserved:
    """One HTTP answer of a worker, for ``dualtrack_requests_total``."""

    endpoint: str
    code: int


@dataclass(frozen=True)
class LatencyObserved:
    """One ``POST /v1/segment``'s wall time in a worker, for ``dualtrack_request_latency_seconds``."""

    seconds: float


Observation: TypeAlias = RequestObserved | LatencyObserved


@dataclass(frozen=True)
class Observations:
    """What a worker's app observed since its last flush, oldest first."""

    batch: tuple[Observation, ...]


Reply: TypeAlias = Done | Failed | Cancelled


@dataclass(frozen=True)
class Replies:
    """Several requests' answers at once, in the order they finished: what the writer sends when
    more than one is waiting (a batch finishes its rows together), one message and one wake-up in
    the worker instead of one each."""

    replies: tuple[Reply, ...]


EngineMessage: TypeAlias = Hello | Refused | Done | Failed | Cancelled | Replies | Answer | PhaseChanged
WorkerMessage: TypeAlias = RunRequest | RunJpeg | Cancel | Question | Observations


def unexpected(sender: str, msg: object) -> ProtocolError:
    """The error for a message ``sender`` should not have sent (shown shortened: it may be large)."""
    shown = repr(msg)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return ProtocolError(
        f"{sender} sent {type(msg).__name__} {shown}, which is not a message of dualtrack.serve.protocol "
        "it may send there; closing the connection (are both processes the same dualtrack?)"
    )
