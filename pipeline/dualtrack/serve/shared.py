"""One engine behind several server processes: what ``dualtrack serve --workers N`` runs.

Why: one process cannot both parse HTTP, decode images and keep the GPU busy. Its engine thread
waits for the GIL behind the image threads (10.4 ms per batch of 8 under load on the H200 against
4.4 ms alone), and N processes each with an engine of its own time-slice one GPU between N CUDA
contexts, each with half-empty batches. So the work is split the way Triton splits it:

- **The engine process** (the one ``dualtrack serve`` started) owns the GPU: one
  :class:`~dualtrack.runtime.engine.Engine`, one :class:`~dualtrack.serve.batcher.Batcher` that
  forms batches from the requests of every worker, and the one Prometheus registry
  (:class:`EngineHost`).
- **N worker processes** (uvicorn servers started by :mod:`dualtrack.serve.workers`, which hands each
  the connections the engine process accepts on the port) speak HTTP and decode, resize and encode images,
  each on its own cores and GIL; their apps reach the engine through an :class:`EngineClient`,
  which stands in for the batcher (same ``submit``, ``phase``, ``engine`` and life cycle).

Images do not travel through the socket. The engine process maps one shared file (``/dev/shm``
when it has room) of fixed-size **slots**, one image each; every worker connection gets a range of
``max_queue + largest batch`` slots (as many requests as the engine can hold, so a worker is never
the tighter limit). A request goes:

1. the worker decodes into a free slot of its range and sends
   :class:`~dualtrack.serve.protocol.RunRequest` ``(rid, slot)``, ``rid`` a request id of its own;
2. the engine process's reader thread for that worker submits the slot to the batcher, which
   copies it into the batch's page-locked row (numpy releases the GIL for the copy);
3. when the batch has run, its masks are in the slots (copied from the GPU straight into the
   page-locked slot file; without a GPU, or with ``DUALTRACK_PIN_SLOTS=0``, on the host), the
   rest of each answer (sizes and timings) is written at the end of its slot, and each worker
   with answers in the batch is woken once through its semaphore in a shared file
   (:mod:`dualtrack.serve.semaphores`); the worker's answer thread copies the mask out and frees
   the slot. No message, no engine process thread between the batch and the worker: on a GPU the
   launcher writes the answers when it queues the batch, and the GPU itself marks them ready and
   posts the semaphores once the batch has run (``Engine.signal``: a store per row, then ``sem_post``
   on the CUDA driver's own thread; :meth:`EngineHost._signal_answers`); otherwise, or with
   ``DUALTRACK_GPU_SIGNALS=0``, the thread that resolved the batch writes and posts, with the GIL
   kept. With ``DUALTRACK_SLOT_ANSWERS=0`` (or no process-shared semaphores) that worker's writer
   thread sends :class:`~dualtrack.serve.protocol.Done` ``(rid, sizes and timings)`` instead.

Why answers in the slots: the message way back cost a request ~0.8-0.9 ms under load on the H200
(the engine process's writer thread waking and winning the GIL, pickling, sending; the worker's
reader thread waking and unpickling: ``hop_writer`` + ``hop_back``, docs/performance.md), on the
path of every request, in a closed loop where each millisecond of a request's latency is
throughput lost. Why the GPU marks them: the collector thread that would otherwise do it must first
wake and win the engine process's GIL; with the GPU's marks a request spent ~0.6 ms less in its worker's app and
16 clients got 8.6% more (docs/performance.md, "The GPU wakes the workers").

A request that fails comes back as :class:`~dualtrack.serve.protocol.Failed` ``(rid, kind,
message)``, raised in the worker as the batcher raised it (full queue, not ready, bad input,
engine failure), so the app answers it the same way. A cancelled request (client gone) is
withdrawn from its batch if it has not started (:class:`~dualtrack.serve.protocol.Cancel`, answered
:class:`~dualtrack.serve.protocol.Cancelled`); its slot is reused only once the engine process has
answered. Each worker buffers its HTTP metrics and sends them every :data:`FLUSH_S` and before any
``/metrics`` answer, so every worker answers ``/metrics`` and ``/readyz`` for the whole service.
:mod:`dualtrack.serve.protocol` lists every message, who sends it and when; a message that is not
one of them is logged and closes its connection.

The socket is a Unix socket in a private (0700) directory with a random key, and the slot file is
readable by its owner only: nothing outside the user that started the server can reach either.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from dualtrack import imaging
from dualtrack.errors import ConfigError, DualtrackError, InputError
from dualtrack.serve import semaphores
from dualtrack.serve.batcher import (
    Batcher,
    BatchResult,
    LaunchedBatch,
    NotReadyError,
    Phase,
    QueueFullError,
    QueueState,
)
from dualtrack.serve.metrics import ServeMetrics
from dualtrack.serve.options import ServeOptions
from dualtrack.serve.protocol import (
    Answer,
    Cancel,
    Cancelled,
    Done,
    EngineInfo,
    EngineMessage,
    Failed,
    Hello,
    LatencyObserved,
    Observation,
    Observations,
    PhaseChanged,
    ProtocolError,
    Question,
    Refused,
    Replies,
    RequestObserved,
    RunJpeg,
    RunRequest,
    WorkerMessage,
    unexpected,
)
from dualtrack.serve.semaphores import SemaphoreFile
from dualtrack.settings import Settings

if TYPE_CHECKING:
    from dualtrack.runtime.engine import Engine
    from dualtrack.runtime.memory import PinnedRange

_log = logging.getLogger(__name__)

# How a worker finds the engine process: JSON with the socket address, the key (hex) and the
# app's options. Set by the engine process for the workers it starts; read by `worker_app`.
ENGINE_ENV = "DUALTRACK_SERVE_ENGINE"
FLUSH_S = 0.25  # longest a worker keeps HTTP metrics before sending them to the engine process
SPARE_RANGES = 2  # slot ranges beyond one per worker: for workers that uvicorn restarts
CONNECT_TIMEOUT_S = 30.0  # a worker gives up on an engine process that does not answer
MAX_REPLIES = 64  # most answers one Replies message carries
ANSWER_BYTES = 4096  # the end of every slot: its request's answer (SlotFile.write_answer)


class SlotFile:
    """A shared file of ``count`` slots of ``slot_bytes`` each, mapped into this process.

    A slot's first :attr:`payload_bytes` hold its request (an image, or a JPEG's bytes) and then
    its mask; the last ``answer_bytes`` (when given) the rest of its answer, written by the engine
    process once the request has run (:meth:`write_answer`): a word naming the request (its
    ``token``), the length of the answer, then the answer. The word is written last and read
    first; on a CPU that may show another core's stores out of order, the answer itself must name
    its request too (the caller checks), so a stale answer is never taken for this one."""

    def __init__(self, path: Path, count: int, slot_bytes: int, *, create: bool, answer_bytes: int = 0) -> None:
        if not 0 <= answer_bytes < slot_bytes:
            raise ValueError(f"answer_bytes={answer_bytes} must be below slot_bytes={slot_bytes}")
        self.path, self.count, self.slot_bytes = path, count, slot_bytes
        self.answer_bytes = answer_bytes
        self.payload_bytes = slot_bytes - answer_bytes
        self._map = semaphores.map_file(path, count * slot_bytes, create=create)
        self.buffer = np.frombuffer(self._map, dtype=np.uint8).reshape(count, slot_bytes)

    def array(self, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        """Slot ``slot`` as a uint8 array of ``shape`` (a view: no copy)."""
        return self.buffer[slot, : math.prod(shape)].reshape(shape)

    def write_answer(self, slot: int, token: int, body: bytes) -> bool:
        """Put ``body`` in slot ``slot``'s answer area, then ``token`` (> 0) in its word; False if
        it does not fit (the answer then travels as a message only). Plain stores: keeps the GIL."""
        if token <= 0 or self.put_answer(slot, body) is None:
            return False
        struct.pack_into("<Q", self._map, slot * self.slot_bytes + self.payload_bytes, token)
        return True

    def put_answer(self, slot: int, body: bytes) -> int | None:
        """Put ``body`` in slot ``slot``'s answer area without its word, which someone else writes
        (the GPU: ``Engine.signal``); the word's address in this process, or None if it does not fit."""
        at = slot * self.slot_bytes + self.payload_bytes
        if self.answer_bytes < _ANSWER_HEAD + len(body):
            return None
        struct.pack_into("<I", self._map, at + 8, len(body))
        self._map[at + _ANSWER_HEAD : at + _ANSWER_HEAD + len(body)] = body
        return self.word_address(slot)

    def word_address(self, slot: int) -> int:
        """The address, in this process, of slot ``slot``'s answer word (8-byte aligned when the
        payload is: :func:`payload_bytes`)."""
        return int(self.buffer.ctypes.data) + slot * self.slot_bytes + self.payload_bytes

    def index_of(self, view: np.ndarray) -> int | None:
        """The slot whose start ``view`` starts at (a view :meth:`array` gave), else None."""
        offset = int(view.ctypes.data) - int(self.buffer.ctypes.data)
        slot, rest = divmod(offset, self.slot_bytes)
        return slot if rest == 0 and 0 <= slot < self.count else None

    def clear_answer(self, slot: int) -> None:
        """Mark slot ``slot`` as holding no answer (before its next request is sent)."""
        if self.answer_bytes:
            struct.pack_into("<Q", self._map, slot * self.slot_bytes + self.payload_bytes, 0)

    def read_answer(self, slot: int, token: int) -> bytes | None:
        """Slot ``slot``'s answer if its word is ``token``, else None (not written yet)."""
        if not self.answer_bytes:
            return None
        at = slot * self.slot_bytes + self.payload_bytes
        if struct.unpack_from("<Q", self._map, at)[0] != token:
            return None
        (n,) = struct.unpack_from("<I", self._map, at + 8)
        if n > self.answer_bytes - _ANSWER_HEAD:
            return None
        return bytes(self._map[at + _ANSWER_HEAD : at + _ANSWER_HEAD + n])

    def close(self) -> None:
        self.buffer = np.empty((0, 0), np.uint8)  # drop the view before the map (mmap refuses otherwise)
        self._map.close()


_ANSWER_HEAD = 16  # an answer area's word (8 bytes) and length (4), before the answer


def payload_bytes(image_bytes: int) -> int:
    """A slot's request-and-mask part for images of ``image_bytes``: rounded up to 64 bytes, so that
    the answer word after it is aligned (the GPU's 64-bit store needs 8; a cache line keeps the
    word off the mask's last line)."""
    return -(-image_bytes // 64) * 64


def copy_holding_gil(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape, ``dst`` C-contiguous) as one memcpy that keeps the GIL.

    Why not numpy's assignment: numpy lets the GIL go for a copy of this size (a mask, 256 KB,
    ~20 us), and winning it back costs the engine process's writer thread a turn behind a dozen
    others, up to a millisecond under load (``hop_writer`` in the service's timings)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"cannot copy {src.dtype}{list(src.shape)} into {dst.dtype}{list(dst.shape)}")
    memoryview(dst).cast("B")[:] = memoryview(np.ascontiguousarray(src)).cast("B")


def slot_directory(nbytes: int) -> Path:
    """``/dev/shm`` when it has room for ``nbytes`` (memory, never written to disk), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= 2 * nbytes:
            return shm
    return Path(tempfile.gettempdir())


# --- the engine process --------------------------------------------------------------------------


class EngineHost:
    """Serves one engine to the worker processes that connect to :attr:`address`.

    ``start()`` starts the batcher (warmup on its thread) and accepts workers; ``worker_env()`` is
    what a worker needs to connect; ``close()`` stops accepting, finishes what is queued and
    releases the socket and the slot file. The engine is borrowed: the caller closes it after.
    """

    def __init__(self, engine: Engine, options: ServeOptions, workers: int, *, jpeg_decoder: str = "auto") -> None:
        self.options = options
        self.info = EngineInfo.of(engine)
        shape = self.info.input_spec.shape
        self.image_shape = tuple(shape[1:])
        self.mask_shape = tuple(shape[1:3])
        # A uint8 image (its mask, H x W, fits in its place), then the answer area.
        slot_bytes = payload_bytes(int(np.prod(self.image_shape))) + ANSWER_BYTES
        self.slots_per_range = options.max_queue + max(self.info.batch_sizes)
        ranges = workers + SPARE_RANGES
        self.metrics = ServeMetrics(
            queue_depth=lambda: self.batcher.depth, ready=lambda: self.batcher.phase is Phase.READY
        )
        self.batcher = Batcher(
            engine,
            max_batch_delay_s=options.max_batch_delay_ms / 1e3,
            max_queue=options.max_queue,
            on_batch=self._batch_answered,
            on_phase=self._phase_changed,
            jpeg_decoder=jpeg_decoder,
            batches_in_flight=options.batches_in_flight,
            on_launch=self._signal_answers,
        )
        self._signals = 0  # sem_post's address once the GPU marks answers and wakes workers (_gpu_signals)
        # Slot -> (peer, request id) of the request last sent in it: whose answer a launched row is.
        self._owners: dict[int, tuple[_Peer, int]] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="dualtrack-serve-"))  # 0700
        size = ranges * self.slots_per_range * slot_bytes
        slot_path = slot_directory(size) / f"{self._dir.name}.slots"
        try:
            self.slots = SlotFile(
                slot_path, ranges * self.slots_per_range, slot_bytes, create=True, answer_bytes=ANSWER_BYTES
            )
        except OSError as err:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise ConfigError(
                f"cannot reserve {size / 2**20:.0f} MiB for the image slots in {slot_path.parent}: {err.strerror}; "
                "free space there, or lower --max-queue or --workers"
            ) from None
        self.pinned = self._pin(engine)
        self.answers = self._answer_semaphores(ranges)
        self._signals = self._gpu_signals(engine)
        self._to_wake: set[int] = set()  # slot ranges with answers written in this batch (batcher thread only)
        self._key = secrets.token_bytes(32)
        self.address = str(self._dir / "engine.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self._key)
        self._free_ranges = list(range(ranges))
        self._peers: set[_Peer] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._accepting = threading.Thread(target=self._accept, name="dualtrack-accept", daemon=True)

    def _pin(self, engine: Engine) -> PinnedRange | None:
        """The slot file, page-locked for the engine's GPU: each batch's masks are then copied from
        the GPU straight into their requests' slots (one driver call per batch), not into a
        staging buffer, then a new array, then each slot (two host copies of every mask, the
        largest item of the engine process's GIL time: docs/performance.md). None on the CPU, with
        ``DUALTRACK_PIN_SLOTS=0``, or when the driver refuses the file (the masks then take the host
        copies); the startup line says which."""
        if getattr(engine, "device", "cpu") != "cuda":
            return None
        size = f"{self.slots.buffer.nbytes / 2**20:.0f} MiB"
        if not Settings.from_env().pin_slots:
            sys.stderr.write(
                f"dualtrack serve: masks copied into the {size} slot file on the host (DUALTRACK_PIN_SLOTS=0)\n"
            )
            return None
        try:
            pinned = engine.pin_host(self.slots.buffer)
        except DualtrackError as err:
            _log.warning("masks are copied into the slots on the host: the slot file cannot be page-locked: %s", err)
            return None
        sys.stderr.write(f"dualtrack serve: masks go from the GPU straight into the {size} slot file (page-locked)\n")
        return pinned

    def _answer_semaphores(self, ranges: int) -> SemaphoreFile | None:
        """One semaphore per slot range, with which a request's answer written into its slot wakes
        its worker (None: answers travel as messages only, with ``DUALTRACK_SLOT_ANSWERS=0`` or
        where the C library has no process-shared semaphores)."""
        if not Settings.from_env().slot_answers:
            sys.stderr.write("dualtrack serve: answers go to the workers as messages (DUALTRACK_SLOT_ANSWERS=0)\n")
            return None
        if not semaphores.available():
            sys.stderr.write("dualtrack serve: answers go to the workers as messages (no process-shared semaphores)\n")
            return None
        try:
            answers = SemaphoreFile(self._dir / "answers.sem", ranges, create=True)
        except OSError as err:
            _log.warning("answers go to the workers as messages: no shared semaphores: %s", err)
            return None
        sys.stderr.write("dualtrack serve: answers go to the workers through their slots (shared semaphores)\n")
        return answers

    def _gpu_signals(self, engine: Engine) -> int:
        """Whether the GPU marks each answer in its slot and wakes its worker itself, once the
        batch has run (:meth:`_signal_answers`): ``sem_post``'s address if so, after one such mark
        and post here worked end to end; 0 otherwise (the collector thread does both)."""
        if self.answers is None or self.pinned is None:
            return 0
        if not Settings.from_env().gpu_signals:
            sys.stderr.write(
                "dualtrack serve: the collector thread marks answers and wakes workers (DUALTRACK_GPU_SIGNALS=0)\n"
            )
            return 0
        post, probe = semaphores.post_function(), 0xD7A1_5EED
        try:
            engine.signal([(self.slots.word_address(0), probe)], [(post, self.answers.address(0))])
            woken = self.answers.wait(0, 5.0)
            landed = struct.unpack_from("<Q", self.slots.buffer, self.slots.payload_bytes)[0] == probe
        except DualtrackError as err:
            woken = landed = False
            _log.warning("the GPU cannot mark answers: %s", err)
        finally:
            self.slots.clear_answer(0)
            self.answers.drain(0)
        if not (woken and landed):
            sys.stderr.write(
                "dualtrack serve: the collector thread marks answers and wakes workers "
                f"(the GPU's own mark {'landed' if landed else 'did not land'}, its wake-up "
                f"{'came' if woken else 'did not come'})\n"
            )
            return 0
        sys.stderr.write("dualtrack serve: the GPU marks each answer in its slot and wakes its worker itself\n")
        return post

    def _signal_answers(self, batch: LaunchedBatch) -> None:
        """On the launcher thread, once a batch is queued: each row's answer into its slot but for
        its word, then the GPU told to write the words and post the workers' semaphores once the
        batch has run (Engine.signal). The worker then takes its answers with no thread of this
        process woken; the collector only resolves the requests (answer_in_slot sees them marked)."""
        if not self._signals or self.answers is None:
            return
        marks: list[tuple[int, int]] = []
        ranges: set[int] = set()
        taken: list[tuple[_Peer, int]] = []
        for into, queue_ms in batch.rows:
            index = self.slots.index_of(into)
            owner = None if index is None else self._owners.get(index)
            if index is None or owner is None:
                continue  # not a worker's slot: resolved as any other request
            peer, rid = owner
            body = pickle.dumps(
                (rid, batch.batch_size, batch.padded_size, queue_ms, 0.0, batch.timings, peer.transit_ms(rid),
                 batch.launched),
                protocol=pickle.HIGHEST_PROTOCOL,
            )  # fmt: skip
            word = self.slots.put_answer(index, body)
            if word is None:
                continue
            marks.append((word, rid + 1))
            ranges.add(peer.range_index)
            taken.append((peer, rid))
        if not marks:
            return
        for peer, rid in taken:  # before the GPU may get there: the collector must not answer them again
            peer.signalled.add(rid)
        try:
            batch.engine.signal(marks, [(self._signals, self.answers.address(r)) for r in sorted(ranges)])
        except DualtrackError as err:
            for peer, rid in taken:
                peer.signalled.discard(rid)
            self._signals = 0
            _log.error("the GPU cannot mark answers any more (%s): the collector thread does from now on", err)

    def answer_in_slot(self, peer: _Peer, rid: int, slot: int, future: Future[BatchResult]) -> bool:
        """Write request ``rid``'s answer into its slot and wake its worker, on the thread that
        resolved it (the batcher's collector), with the GIL kept throughout; True if so, and then
        no message answers it. False for a failed or cancelled request, which a message answers.
        A request the GPU marks itself (:meth:`_signal_answers`) is answered already: True."""
        if self.answers is None or future.cancelled() or future.exception() is not None:
            return False
        if rid in peer.signalled:
            peer.signalled.discard(rid)
            return True
        result = future.result()
        index = peer.first_slot + slot
        if self._owners.get(index) != (peer, rid):
            return False  # the slot holds a newer request: never write over its answer
        dst = self.slots.array(index, self.mask_shape)
        if result.mask.ctypes.data != dst.ctypes.data:  # not written there by the GPU (mask_into)
            copy_holding_gil(dst, result.mask)
        in_ms = peer.transit_ms(rid)
        body = pickle.dumps(
            (rid, result.batch_size, result.padded_size, result.queue_ms, result.run_ms, result.timings, in_ms, 0.0),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        if not self.slots.write_answer(index, rid + 1, body):
            return False
        self._to_wake.add(peer.range_index)  # posted once the batch's rows are all answered
        return True

    def _batch_answered(self, results: list[BatchResult]) -> None:
        """After a batch's requests are resolved (on the same thread): wake each worker that has
        answers in its slots once, then the batch's metrics."""
        if self.answers is not None:
            for index in self._to_wake:
                self.answers.post(index)
            self._to_wake.clear()
        self.metrics.observe_batch(results)

    def mask_into(self, slot: int) -> np.ndarray | None:
        """Where the batcher writes the mask of the request in ``slot`` (the slot itself, when the
        GPU can write it directly); None: the writer copies the mask there."""
        return self.slots.array(slot, self.mask_shape) if self.pinned is not None else None

    def worker_env(self, app_options: dict[str, Any]) -> str:
        """The value of :data:`ENGINE_ENV` for the workers: where to connect, the key, the app's options."""
        return json.dumps({"address": self.address, "key": self._key.hex(), "options": app_options})

    def start(self) -> None:
        self.batcher.start()
        self._accepting.start()

    def close(self, timeout: float | None = None) -> bool:
        """Stop accepting workers, finish the queued requests, release the socket and slot file.

        Returns False if the batcher was still busy after ``timeout`` seconds.
        """
        self._closing.set()
        # Closing a listening socket does not wake a thread blocked in accept() on Linux; a
        # connection does (its handshake fails, and the thread sees that the host is closing).
        with suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
            wake.connect(self.address)
        if self._accepting.is_alive():
            self._accepting.join(5)
        self._listener.close()
        done = self.batcher.close(timeout)
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.close()
        for peer in peers:
            peer.join(5)
        if self.pinned is not None:
            self.pinned.close()  # before the file is unmapped; the batcher has collected every batch
        if self.answers is not None:
            self.answers.close()
        self.slots.close()
        self.slots.path.unlink(missing_ok=True)
        shutil.rmtree(self._dir, ignore_errors=True)
        return done

    # --- threads ---------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn = self._listener.accept()
            except Exception as err:  # a bad key, a stray client, one that hung up: keep serving the others
                if not self._closing.is_set():
                    _log.warning("refused a connection to the engine: %s", err)
                continue
            if self._closing.is_set():
                conn.close()
                return
            with self._lock:
                index = self._free_ranges.pop(0) if self._free_ranges else None
            if index is None:
                ranges = self.slots.count // self.slots_per_range
                _send_quietly(conn, Refused(f"all {ranges} slot ranges are in use"))
                conn.close()
                continue
            peer = _Peer(self, conn, index)
            with self._lock:
                self._peers.add(peer)
            peer.start()

    def _released(self, peer: _Peer) -> None:
        with self._lock:
            self._peers.discard(peer)
            self._free_ranges.append(peer.range_index)

    def _phase_changed(self, phase: Phase, error: str) -> None:
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.out.put(PhaseChanged(phase, error, self.batcher.decoder))

    def hello(self, peer: _Peer) -> Hello:
        return Hello(
            slot_path=str(self.slots.path),
            slot_count=self.slots.count,
            slot_bytes=self.slots.slot_bytes,
            first_slot=peer.first_slot,
            slots=self.slots_per_range,
            info=self.info,
            phase=self.batcher.phase,
            error=self.batcher.error,
            decoder=self.batcher.decoder,
            answers=str(self.answers.path) if self.answers is not None else "",
            answer_bytes=self.slots.answer_bytes,
        )


@dataclass(frozen=True)
class _Settled:
    """Request ``rid``'s future resolved (put on the batcher's thread) and not answered in its slot:
    the writer answers it by message."""

    rid: int
    slot: int
    future: Future[BatchResult]
    at: float  # when (monotonic)


@dataclass(frozen=True)
class _ReaderGone:
    """The reader has stopped: send nothing more, wait for the requests still in a batch."""


_Outgoing: TypeAlias = EngineMessage | _Settled | _ReaderGone  # what a peer's writer thread takes


class _Peer:
    """One worker's connection in the engine process: a reader thread and a writer thread.

    The reader receives and submits; only the writer sends (one sender per connection) and writes
    masks into the slots. The slot range is given back once the worker has gone and none of its
    requests is still in a batch.
    """

    def __init__(self, host: EngineHost, conn: Connection, range_index: int) -> None:
        self.host, self.conn, self.range_index = host, conn, range_index
        self.first_slot = range_index * host.slots_per_range
        self.out: SimpleQueue[_Outgoing] = SimpleQueue()
        self.inflight: dict[int, Future[BatchResult]] = {}  # by request id
        self._arrived: dict[int, float] = {}  # by request id: seconds from the worker's send to the reader
        self.signalled: set[int] = set()  # request ids whose answers the GPU marks (EngineHost._signal_answers)
        self._reader_gone = False
        self._reader = threading.Thread(target=self._read, name=f"dualtrack-peer-{range_index}-in", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"dualtrack-peer-{range_index}-out", daemon=True)

    def start(self) -> None:
        self.out.put(self.host.hello(self))
        self._writer.start()
        self._reader.start()

    def close(self) -> None:
        _hang_up(self.conn)  # the reader ends on it, then tells the writer

    def join(self, timeout: float) -> None:
        self._reader.join(timeout)
        self._writer.join(timeout)

    def _read(self) -> None:
        frames = FrameReader(self.conn)
        try:
            while True:
                msg: object = frames.recv()  # anything: a broken or foreign peer is dropped below
                match msg:
                    case RunRequest(rid, slot, sent):
                        self._run(rid, slot, time.monotonic() - sent)
                    case RunJpeg(rid, slot, nbytes, stored, orientation, sent):
                        self._run_jpeg(rid, slot, nbytes, stored, orientation, time.monotonic() - sent)
                    case Cancel(rid):
                        future = self.inflight.get(rid)
                        if future is not None:
                            future.cancel()  # its done callback tells the worker; a no-op once the batch runs
                    case Observations(batch):
                        self._record(batch)
                    case Question(qid, what):
                        self.out.put(Answer(qid, self._answer(what)))
                    case _:
                        raise unexpected(f"worker {self.range_index}", msg)
        except (EOFError, OSError):
            pass  # the worker is gone (or close() closed the connection)
        except ProtocolError as err:
            _log.error("%s", err)  # it names the worker, the message and that its connection closes
            _shut_down(self.conn)  # the worker sees the connection end and fails its readiness
        except Exception:
            _log.exception("engine connection %d failed; dropping the worker", self.range_index)
            _shut_down(self.conn)
        finally:
            for future in list(self.inflight.values()):
                future.cancel()  # nobody waits for these any more
            self._reader_gone = True  # before the writer can see it gone: see _settled_in_slot
            self.out.put(_ReaderGone())

    def _run(self, rid: int, slot: int, transit: float) -> None:
        if not 0 <= slot < self.host.slots_per_range:
            self.out.put(Failed(rid, "input", f"slot {slot} is outside this worker's range"))
            return
        image = self.host.slots.array(self.first_slot + slot, self.host.image_shape)
        into = self.host.mask_into(self.first_slot + slot)
        self._queued(
            rid, slot, transit, lambda: self.host.batcher.submit(image, into=into)
        )  # copies the image into its batch row, here

    def _run_jpeg(
        self, rid: int, slot: int, nbytes: int, stored: tuple[int, int], orientation: int, transit: float
    ) -> None:
        if not 0 <= slot < self.host.slots_per_range or not 0 < nbytes <= self.host.slots.payload_bytes:
            self.out.put(Failed(rid, "input", f"slot {slot} of {nbytes} bytes is outside this worker's range"))
            return
        data = self.host.slots.array(self.first_slot + slot, (nbytes,)).tobytes()  # the slot gets the mask later
        jpeg = imaging.GpuJpeg(data, stored, orientation)
        into = self.host.mask_into(self.first_slot + slot)
        self._queued(rid, slot, transit, lambda: self.host.batcher.submit_jpeg(jpeg, into=into))

    def _queued(self, rid: int, slot: int, transit: float, submit: Callable[[], Future[BatchResult]]) -> None:
        try:
            future = submit()
        except DualtrackError as err:
            self.out.put(Failed.of(rid, err))
            return
        self.inflight[rid] = future
        self._arrived[rid] = transit
        self.host._owners[self.first_slot + slot] = (self, rid)

        def settled(f: Future[BatchResult], r: int = rid, s: int = slot) -> None:
            # On the batcher's thread (or the canceller's): the answer into the slot, a put.
            try:
                in_slot = self.host.answer_in_slot(self, r, s, f)
            except Exception:  # a callback's exception would be swallowed, and the request never answered
                _log.exception("request %d of worker %d: its answer goes as a message", r, self.range_index)
                in_slot = False
            if in_slot:
                self._settled_in_slot(r)
            else:
                self.out.put(_Settled(r, s, f, time.monotonic()))

        future.add_done_callback(settled)

    def _settled_in_slot(self, rid: int) -> None:
        """A request answered in its slot: forgotten here, with no wake-up of the writer (a GIL turn
        in this process per request, for nothing to send) unless the reader has gone and the
        writer waits for the last requests in a batch before giving the slot range back."""
        self.inflight.pop(rid, None)
        self._arrived.pop(rid, None)
        if self._reader_gone:  # read after the pop: the writer sees either the pop or this wake-up
            self.out.put(_ReaderGone())

    def transit_ms(self, rid: int) -> float:
        """ms from the worker's send of request ``rid`` to this reader having it (0 once answered)."""
        return self._arrived.get(rid, 0.0) * 1e3

    def _record(self, observations: tuple[Observation, ...]) -> None:
        metrics = self.host.metrics
        for observation in observations:
            match observation:
                case RequestObserved(endpoint, code):
                    metrics.observe_request(endpoint, code)
                case LatencyObserved(seconds):
                    metrics.observe_latency(seconds)
                case _:
                    raise unexpected(f"worker {self.range_index}", observation)

    def _answer(self, what: str) -> bytes:
        if what == "metrics":
            return self.host.metrics.exposition()
        raise ProtocolError(f"worker {self.range_index} asked for {what!r}; the engine process answers 'metrics'")

    def _write(self) -> None:
        closed = False
        replies: list[Done | Failed | Cancelled] = []  # answers ready together: one Replies message
        while not (closed and not self.inflight):
            items = [self.out.get()]
            while len(items) < MAX_REPLIES and not self.out.empty():
                items.append(self.out.get())
            for item in items:
                match item:
                    case _ReaderGone():
                        closed = True
                    case _Settled(rid, slot, future, at):
                        self.inflight.pop(rid, None)
                        replies.append(self._reply(rid, slot, future, at))
                    case _:  # in order: the answers before it go first
                        if not closed:
                            closed = not (self._send_replies(replies) and _send_quietly(self.conn, item))
            if closed:
                replies.clear()  # the worker is gone: nobody to tell
            else:
                closed = not self._send_replies(replies)
        self.host._released(self)

    def _send_replies(self, replies: list[Done | Failed | Cancelled]) -> bool:
        """Send the answers gathered (one message, or a Replies of several) and clear them."""
        if not replies:
            return True
        msg: EngineMessage = replies[0] if len(replies) == 1 else Replies(tuple(replies))
        replies.clear()
        return _send_quietly(self.conn, msg)

    def _reply(self, rid: int, slot: int, future: Future[BatchResult], at: float) -> Done | Failed | Cancelled:
        arrived = self._arrived.pop(rid, 0.0)
        if future.cancelled():
            return Cancelled(rid)
        err = future.exception()
        if err is not None:
            return Failed.of(rid, err)
        result = future.result()
        dst = self.host.slots.array(self.first_slot + slot, self.host.mask_shape)
        if result.mask.ctypes.data != dst.ctypes.data:  # not written there by the batcher (mask_into)
            copy_holding_gil(dst, result.mask)
        now = time.monotonic()
        return Done.of(rid, result, in_ms=arrived * 1e3, writer_ms=(now - at) * 1e3, sent=now)


def _dial(address: str, key: bytes, timeout: float) -> Connection:
    """``Client(address, authkey=key)`` that gives up after ``timeout`` s: its key handshake has no
    timeout of its own, and an engine process that never answers must fail readiness, not hang it."""
    result: dict[str, Any] = {}

    def dial() -> None:
        try:
            result["conn"] = Client(address, family="AF_UNIX", authkey=key)
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=dial, name="dualtrack-dial", daemon=True)  # left behind if stuck
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["conn"]


class FrameReader:
    """``Connection.recv()`` for one reading thread, with fewer system calls: the frames of
    :mod:`multiprocessing.connection` (a 4-byte big-endian length, or -1 and an 8-byte one, then
    the pickle), read with one ``os.read`` of up to :attr:`CHUNK` bytes per wake-up, which may
    bring several messages.

    Why: ``Connection.recv`` reads each message with two system calls (its length, then its
    body), and each lets the GIL go and must win it back, behind a dozen threads in the engine
    process under load (the hand-over ``hop_in``). The connection must not be read any other way
    once this reads it (what this has buffered would be lost to it); sending on it is unchanged.
    """

    CHUNK = 1 << 16
    MOST_PER_READ = 1 << 24  # a long message is read in parts of at most this (os.read allocates what it asks for)

    def __init__(self, conn: Connection) -> None:
        self._fd = conn.fileno()
        self._buf = bytearray()
        self._pending: deque[object] = deque()  # messages already read, not yet returned

    def recv(self) -> object:
        """The next message; raises ``EOFError`` at the end of the stream (mid-frame too) and
        ``ValueError`` for a frame with a negative length (not a Connection's)."""
        missing = 0  # bytes the first incomplete frame still lacks, when its header is in
        while not self._pending:
            data = os.read(self._fd, min(max(self.CHUNK, missing), self.MOST_PER_READ))
            if not data:
                raise EOFError("the connection ended" + (" inside a message" if self._buf else ""))
            self._buf += data
            missing = self._split()
        return self._pending.popleft()

    def _frame(self) -> tuple[int, int] | None:
        """(header size, body size) of the first frame buffered, or None while its header is incomplete."""
        if len(self._buf) < 4:
            return None
        (size,) = struct.unpack_from("!i", self._buf)
        if size < -1:
            raise ValueError(f"a frame of {size} bytes: the peer does not speak multiprocessing.connection")
        if size != -1:
            return 4, size
        if len(self._buf) < 12:
            return None
        return 12, struct.unpack_from("!Q", self._buf, 4)[0]

    def _split(self) -> int:
        """Move every complete frame buffered to the messages; returns the bytes the next still lacks
        (0 while its header is incomplete)."""
        while (frame := self._frame()) is not None:
            head, size = frame
            if len(self._buf) < head + size:
                return head + size - len(self._buf)
            self._pending.append(pickle.loads(self._buf[head : head + size]))  # a copy: the buffer may shrink
            del self._buf[: head + size]
        return 0


def _shut_down(conn: Connection) -> None:
    """End ``conn`` for both sides: a ``recv`` blocked on it here or in the peer wakes up (EOF) and a
    ``send`` fails. Closing the fd alone does not wake a blocked ``recv`` on Linux; this does. The fd
    stays open: another thread may still be using it."""
    with suppress(OSError), socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as dup:
        dup.shutdown(socket.SHUT_RDWR)


def _hang_up(conn: Connection) -> None:
    """Shut ``conn`` down (waking the thread blocked in its ``recv``), then close it."""
    _shut_down(conn)
    with suppress(OSError):
        conn.close()


def _send_quietly(conn: Connection, msg: EngineMessage | WorkerMessage) -> bool:
    try:
        conn.send(msg)
        return True
    except (OSError, ValueError):  # the other side is gone
        return False


# --- a worker process ----------------------------------------------------------------------------


class EngineClient(QueueState[EngineInfo]):
    """A worker's handle on the engine process: a :class:`~dualtrack.serve.batcher.BatchQueue` for the app.

    ``start()`` connects (a failure is reported by :attr:`phase`/:attr:`error`, like a failed load);
    ``submit(image)`` returns a future of the request's :class:`BatchResult`; ``close()`` waits for
    this worker's requests (uvicorn has answered them all by then) and disconnects.
    """

    def __init__(self, address: str, key: bytes) -> None:
        self._address, self._key = address, key
        self._conn: Connection | None = None
        self._slots: SlotFile | None = None
        # The engine process's JPEG decoder (name, reason), from its Hello and PhaseChanged: the
        # app sends a JPEG that route_jpeg gives the GPU as bytes (submit_jpeg) while it is "gpu".
        self.decoder: tuple[str, str] = ("cpu", "not connected to the engine process")
        self.max_jpeg_bytes = 0
        self._first = 0
        self._free: list[int] = []
        self._pending: dict[int, tuple[int, Future[BatchResult]]] = {}  # request id -> (slot, future)
        self._questions: dict[int, Future[bytes]] = {}
        self._next_id = 0  # request and question ids: never reused, so a late message cannot hit a newer one
        self._observations: list[Observation] = []
        self._lock = threading.Lock()  # free slots, pending, questions, observations
        self._send_lock = threading.Lock()
        self._stopped = threading.Event()
        self._reader: threading.Thread | None = None
        self._flusher: threading.Thread | None = None
        self._answers: SemaphoreFile | None = None  # the Hello's: answers written into the slots
        self._range = 0  # this worker's slot range: its semaphore in _answers
        self._watcher: threading.Thread | None = None

    @property
    def depth(self) -> int:
        """This worker's requests waiting for or inside a batch."""
        return len(self._pending)

    def start(self) -> None:
        conn: Connection | None = None
        try:
            conn = _dial(self._address, self._key, CONNECT_TIMEOUT_S)
            if not conn.poll(CONNECT_TIMEOUT_S):
                raise TimeoutError(f"no answer within {CONNECT_TIMEOUT_S:.0f} s")
            hello: object = conn.recv()
            match hello:
                case Hello():
                    pass
                case Refused(reason):
                    raise ConnectionError(reason)
                case _:
                    raise unexpected("the engine process", hello)
            self._slots = SlotFile(
                Path(hello.slot_path), hello.slot_count, hello.slot_bytes, create=False, answer_bytes=hello.answer_bytes
            )
            if hello.answers:
                self._answers = SemaphoreFile(Path(hello.answers), hello.slot_count // hello.slots, create=False)
        except Exception as err:
            if conn is not None:
                _hang_up(conn)  # the engine process gives this connection's slot range back
            self._fail(f"cannot reach the engine process at {self._address}: {err}")
            return
        self._conn = conn
        self._first = hello.first_slot
        self._free = list(range(hello.slots))[::-1]  # pop() takes the lowest: the same few stay warm
        self._engine = hello.info
        self._error = hello.error
        self.decoder = hello.decoder
        self.max_jpeg_bytes = self._slots.payload_bytes  # a JPEG for the GPU travels in one slot
        self._phase = hello.phase
        self._range = hello.first_slot // hello.slots
        self._reader = threading.Thread(target=self._read, name="dualtrack-engine-in", daemon=True)
        self._flusher = threading.Thread(target=self._flush_periodically, name="dualtrack-metrics", daemon=True)
        self._reader.start()
        self._flusher.start()
        if self._answers is not None:
            self._watcher = threading.Thread(target=self._watch_answers, name="dualtrack-answers", daemon=True)
            self._watcher.start()

    def close(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for this worker's requests, flush its metrics, disconnect."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending and self._reader is not None and self._reader.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.01)
        drained = not self._pending
        self._stopped.set()
        if self._watcher is not None and self._answers is not None:
            self._answers.post(self._range)  # wake the watcher: it sees _stopped
            self._watcher.join(5)
            if not self._watcher.is_alive():
                self._answers.close()
        self.flush()
        if self._conn is not None:
            _hang_up(self._conn)
        if self._reader is not None:
            self._reader.join(5)
        if self._slots is not None:
            self._slots.close()
        if self._phase is not Phase.FAILED:
            self._phase = Phase.CLOSED
        return drained

    # --- requests --------------------------------------------------------------------------------

    def submit(self, image: np.ndarray) -> Future[BatchResult]:
        """Queue one ``(H, W, 3)`` uint8 image (copied before this returns), as ``Batcher.submit``."""
        info = self._engine
        if self._phase is not Phase.READY or info is None or self._slots is None:
            raise self._not_ready()
        expected = tuple(info.input_spec.shape[1:])
        if image.shape != expected or image.dtype != np.uint8:
            raise InputError(f"image is {image.dtype}{list(image.shape)}, the engine takes uint8{list(expected)}")
        return self._queue(
            lambda rid, slot: RunRequest(rid, slot, time.monotonic()), lambda view: np.copyto(view, image), expected
        )

    def submit_jpeg(self, jpeg: imaging.GpuJpeg) -> Future[BatchResult]:
        """Queue one JPEG that :func:`dualtrack.imaging.route_jpeg` gave the GPU (its bytes copied into
        a slot before this returns), as ``Batcher.submit_jpeg``: the engine process decodes it on its
        GPU with its batch. :class:`NotReadyError` unless the engine process's decoder is ``gpu``;
        :class:`InputError` for a JPEG longer than a slot (:attr:`max_jpeg_bytes`: decode it here)."""
        if self._phase is not Phase.READY or self._engine is None or self._slots is None:
            raise self._not_ready()
        if self.decoder[0] != "gpu":
            raise NotReadyError(
                f"the engine process's JPEG decoder is {self.decoder[0]}: decode here and call submit()"
            )
        n = len(jpeg.data)
        if n > self.max_jpeg_bytes:
            raise InputError(f"a {n}-byte JPEG does not fit a {self.max_jpeg_bytes}-byte slot: decode it on the CPU")
        data = np.frombuffer(jpeg.data, np.uint8)
        return self._queue(
            lambda rid, slot: RunJpeg(rid, slot, n, jpeg.stored, jpeg.orientation, time.monotonic()),
            lambda view: np.copyto(view, data),
            (n,),
        )

    def _queue(
        self,
        message: Callable[[int, int], RunRequest | RunJpeg],
        fill: Callable[[np.ndarray], None],
        shape: tuple[int, ...],
    ) -> Future[BatchResult]:
        """Take a free slot, ``fill`` its first ``shape`` bytes, send ``message(rid, slot)``."""
        assert self._slots is not None
        with self._lock:
            if not self._free:
                raise QueueFullError(
                    f"this server process has {len(self._pending)} requests in flight, all it can hold: "
                    "retry shortly or raise --max-queue"
                )
            slot = self._free.pop()
            rid = self._next_id
            self._next_id += 1
            future: Future[BatchResult] = Future()
            self._pending[rid] = (slot, future)
        self._slots.clear_answer(self._first + slot)  # before the slot changes: see _answer_from_slot
        fill(self._slots.array(self._first + slot, shape))
        future.add_done_callback(lambda f, r=rid: self._withdraw(f, r))
        if not self._send(message(rid, slot)):
            with self._lock:
                self._pending.pop(rid, None)
                self._free.append(slot)
            raise self._gone()
        return future

    def _withdraw(self, future: Future[BatchResult], rid: int) -> None:
        if future.cancelled():  # its slot stays taken until the engine process answers
            self._send(Cancel(rid))

    def ask(self, what: str) -> Future[bytes]:
        """Ask the engine process ``what`` (``"metrics"``: its Prometheus text); a future of the answer."""
        future: Future[bytes] = Future()
        with self._lock:
            qid = self._next_id
            self._next_id += 1
            self._questions[qid] = future
        if not self._send(Question(qid, what)):
            with self._lock:
                self._questions.pop(qid, None)
            future.set_exception(self._gone())
        return future

    # --- metrics, sent in bulk -------------------------------------------------------------------

    def observe(self, observation: Observation) -> None:
        """Keep ``observation`` for the next flush (every :data:`FLUSH_S`, and before ``/metrics``)."""
        with self._lock:
            self._observations.append(observation)

    def flush(self) -> None:
        with self._lock:
            batch, self._observations = self._observations, []
        if batch:
            self._send(Observations(tuple(batch)))

    def _flush_periodically(self) -> None:
        while not self._stopped.wait(FLUSH_S):
            self.flush()

    # --- the connection --------------------------------------------------------------------------

    def _send(self, msg: WorkerMessage) -> bool:
        conn = self._conn
        if conn is None:
            return False
        with self._send_lock:
            return _send_quietly(conn, msg)

    def _read(self) -> None:
        assert self._conn is not None
        frames = FrameReader(self._conn)
        try:
            while True:
                msg: object = frames.recv()  # anything: a broken or foreign peer fails this worker below
                match msg:
                    case Done() | Failed() | Cancelled():
                        self._finish(msg, time.monotonic())
                    case Replies(replies):
                        received = time.monotonic()
                        for reply in replies:
                            self._finish(reply, received)
                    case PhaseChanged(phase, error, decoder):
                        self._error = error  # before the phase: a reader that sees FAILED finds the reason
                        self.decoder = decoder  # before the phase: READY comes with the decoder that serves
                        self._phase = phase
                    case Answer(qid, value):
                        with self._lock:
                            question = self._questions.pop(qid, None)
                        if question is not None:
                            question.set_result(value)
                    case _:
                        raise unexpected("the engine process", msg)
        except (EOFError, OSError):
            if not self._stopped.is_set():
                self._fail("the engine process closed the connection (it exited or is shutting down)")
        except Exception as err:  # a ProtocolError, or a message that does not unpickle here
            self._fail(f"the engine connection failed: {err}")
            _shut_down(self._conn)  # the engine process drops this worker and gives its slots back
        finally:
            self._release_all()

    def _watch_answers(self) -> None:
        """Answer each request whose answer the engine process wrote into its slot (no message
        comes for it), as this worker's semaphore is posted, and give its slot back."""
        assert self._answers is not None and self._slots is not None and self._engine is not None
        shape = tuple(self._engine.input_spec.shape[1:3])
        while not self._stopped.is_set():
            # A look on a timeout too: an answer whose post went missing (an on_batch that failed), or
            # whose pickle was read before its own (a CPU that reorders stores), is taken there.
            if self._answers.wait(self._range, 0.5):
                self._answers.drain(self._range)  # posts of several batches since: one look for all
            with self._lock:
                waiting = list(self._pending.items())
            for rid, (slot, future) in waiting:
                result = self._answer_from_slot(rid, self._first + slot, shape)
                if result is None:
                    continue
                with self._lock:
                    self._pending.pop(rid, None)
                with suppress(InvalidStateError):  # cancelled by the app meanwhile
                    future.set_result(result)
                with self._lock:
                    self._free.append(slot)  # the mask is copied out: the slot is ours again

    def _answer_from_slot(self, rid: int, index: int, shape: tuple[int, ...]) -> BatchResult | None:
        """Request ``rid``'s result from slot ``index``, if the engine process has written it there."""
        assert self._slots is not None
        body = self._slots.read_answer(index, rid + 1)
        if body is None:
            return None
        named, batch_size, padded_size, queue_ms, run_ms, timings, in_ms, launched = pickle.loads(body)
        if named != rid:  # the word seen before its own pickle (a CPU that reorders stores): the next look
            return None
        mask = np.empty(shape, np.uint8)
        copy_holding_gil(mask, self._slots.array(index, shape))  # numpy's copy lets the GIL go, then queues for it
        timings = {**timings, "hop_in_ms": in_ms}
        if launched:  # marked by the GPU at the launch: its run is timed here (one monotonic clock)
            run_ms = timings["batch_gpu_ms"] = (time.monotonic() - launched) * 1e3
        return BatchResult(mask, batch_size, padded_size, queue_ms, run_ms, timings)

    def _finish(self, reply: Done | Failed | Cancelled, received: float) -> None:
        assert self._slots is not None and self._engine is not None
        with self._lock:
            slot, future = self._pending.pop(reply.rid, (-1, None))
        if future is None:
            _log.warning("the engine process answered an unknown request %d; ignored", reply.rid)
            return
        outcome: BatchResult | DualtrackError
        match reply:
            case Done():
                mask = self._slots.array(self._first + slot, self._engine.input_spec.shape[1:3]).copy()
                outcome = reply.result(mask, received)
            case Failed():
                outcome = reply.error()
            case Cancelled():  # the engine process withdrew it (it was shutting down)
                outcome = NotReadyError("server is shutting down")
        with suppress(InvalidStateError):  # cancelled by the app meanwhile
            if isinstance(outcome, BatchResult):
                future.set_result(outcome)
            else:
                future.set_exception(outcome)
        with self._lock:
            self._free.append(slot)  # the mask is copied out: the slot is ours again

    def _gone(self) -> NotReadyError:
        return NotReadyError(self._error or "the engine process is gone")

    def _fail(self, message: str) -> None:
        self._error = message
        self._phase = Phase.FAILED
        _log.error("%s", message)

    def _release_all(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            questions, self._questions = self._questions, {}
        error = self._gone()
        futures: list[Future[Any]] = [*(f for _, f in pending.values()), *questions.values()]
        for future in futures:
            if not future.done():
                with suppress(InvalidStateError):
                    future.set_exception(error)


class RemoteMetrics:
    """The app's metrics in a worker: observations go to the engine process's one registry."""

    content_type = ServeMetrics.content_type

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def observe_request(self, endpoint: str, code: int) -> None:
        self.client.observe(RequestObserved(endpoint, code))

    def observe_latency(self, seconds: float) -> None:
        self.client.observe(LatencyObserved(seconds))

    def exposition(self, timeout: float = 10.0) -> bytes:
        """The whole service's metrics, from the engine process (this worker's sent first)."""
        self.client.flush()
        return self.client.ask("metrics").result(timeout)


def connect_from_env() -> tuple[EngineClient, dict[str, Any]]:
    """The client and the app options a worker process was started with (:data:`ENGINE_ENV`)."""
    spec = json.loads(os.environ[ENGINE_ENV])
    return EngineClient(spec["address"], bytes.fromhex(spec["key"])), spec["options"]
