"""Overlapped runs on a GPU: the next batch's upload and the last batch's download beside the compute.

:meth:`Engine.stage <dualtrack.runtime.engine.Engine.stage>` uploads a batch into one of
:data:`SLOTS` device input slots on an upload stream (and lets the caller write rows on the GPU
first: the JPEG path), :meth:`Engine.launch <dualtrack.runtime.engine.Engine.launch>` runs the plan
on a staged slot on the compute stream and queues the outputs' download into that slot's
page-locked staging on a download stream, and :meth:`Submission.result` waits for that download
alone. Called from three threads (stage, launch and result each on one, as the service's
batcher does), batch k+1 is uploaded while batch k computes and batch k's masks come down while
batch k+1 computes.

Ordering, all device-side except where IREE needs the host (FACTS 8):

- ``ran[s]`` is recorded on the compute stream after a run on slot s (and its outputs' copy);
- an upload into slot s waits (``cuStreamWaitEvent``) for ``ran[s]`` of the previous run on s,
  whose first segment may be Track A (asynchronous);
- the upload is complete on the host before :meth:`stage` returns: IREE reads the input on its own
  streams and cannot wait on an event (one host wait per batch, on the staging thread); except
  where the caller says the run is ordered on the compute stream alone (the whole plan one CUDA
  graph, every Track B module replayed) and no row came from the host: then the launch makes the
  compute stream wait for ``uploaded[s]`` instead, and what the upload stream reads (the caller's
  decoded pictures) must stay alive until :meth:`Submission.result` (``Staged.pending``);
- a download waits for ``ran[s]``: a Track A last segment is then done, and an IREE one is done
  before its call returned;
- :meth:`Submission.result` waits for ``downloaded[s]`` and copies the outputs out, after which
  slot s may be staged again;
- an output the caller wants in its own page-locked host memory, row by row (``into``: the
  service's masks, straight into the requests' slots), is copied there on the compute stream
  before ``ran[s]``, and :meth:`Submission.result` waits for ``ran[s]`` alone when every output
  went that way: one driver call per batch instead of a device copy, a stream wait, a download
  and an event, and no host copy, for a copy on the compute stream (2 MB for a batch of eight 512x512
  masks) that the next batch's run waits for.

:class:`SlotRing` holds the slots' states (pure logic, tested without a GPU): stages and launches
take slots in one order, a slot is staged again only after its outputs were collected, so three
slots let stage(k+2) run during launch(k+1) while result(k) is collected between them.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dualtrack.runtime.driver import Event, Stream, copy_async
from dualtrack.runtime.memory import DeviceBuffer, HostBuffer, copy_rows_to_host
from dualtrack.runtime.tensors import GpuTensor

if TYPE_CHECKING:
    from dualtrack.runtime.gpu import CudaBackend

SLOTS = 3  # staging k+2, computing k+1, collecting k

Fill = Callable[[Stream, GpuTensor], "set[int]"]
"""Writes rows of the staged device input on the upload stream; returns the rows it wrote (the
others are copied from the host array)."""


class SlotState(enum.Enum):
    FREE = "free"
    STAGING = "staging"
    STAGED = "staged"
    RUNNING = "running"
    DOWNLOADING = "downloading"


class SlotRing:
    """The states of ``n`` slots used in turn: stage -> launch -> collect, in one order.

    :meth:`begin_stage` blocks until the next slot in turn has been collected; :meth:`begin_launch`
    refuses a slot out of turn or not staged (a bug in the caller, never a wait); every other
    transition checks the state it leaves. :meth:`abandon` frees a slot whose work failed.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a ring of {n} slots holds nothing: give it at least 1")
        self.states = [SlotState.FREE] * n
        self._next_stage = 0
        self._next_launch = 0
        self._cond = threading.Condition()

    def begin_stage(self, timeout: float | None = None) -> int:
        with self._cond:
            slot = self._next_stage
            if not self._cond.wait_for(lambda: self.states[slot] is SlotState.FREE, timeout):
                raise TimeoutError(f"slot {slot} was not collected within {timeout} s")
            self.states[slot] = SlotState.STAGING
            self._next_stage = (slot + 1) % len(self.states)
            return slot

    def staged(self, slot: int) -> None:
        self._move(slot, SlotState.STAGING, SlotState.STAGED)

    def begin_launch(self, slot: int) -> None:
        with self._cond:
            if slot != self._next_launch:
                raise RuntimeError(f"slot {slot} launched out of turn: slot {self._next_launch} was staged first")
            self._move_locked(slot, SlotState.STAGED, SlotState.RUNNING)
            self._next_launch = (slot + 1) % len(self.states)

    def launched(self, slot: int) -> None:
        self._move(slot, SlotState.RUNNING, SlotState.DOWNLOADING)

    def collected(self, slot: int) -> None:
        self._move(slot, SlotState.DOWNLOADING, SlotState.FREE)

    def abandon(self, slot: int) -> None:
        """Free ``slot`` after a failure; a staged slot that will never launch passes its turn on."""
        with self._cond:
            if self.states[slot] in (SlotState.STAGING, SlotState.STAGED) and slot == self._next_launch:
                self._next_launch = (slot + 1) % len(self.states)
            self.states[slot] = SlotState.FREE
            self._cond.notify_all()

    def _move(self, slot: int, before: SlotState, after: SlotState) -> None:
        with self._cond:
            self._move_locked(slot, before, after)

    def _move_locked(self, slot: int, before: SlotState, after: SlotState) -> None:
        if self.states[slot] is not before:
            raise RuntimeError(f"slot {slot} is {self.states[slot].value}, not {before.value}")
        self.states[slot] = after
        self._cond.notify_all()


@dataclass
class Staged:
    """A batch in a device input slot (or, on the CPU, the batch itself)."""

    slot: int
    x: Any  # GpuTensor of the slot on cuda; a numpy copy on cpu
    n: int
    # Where the stage's time went (ms): ``slot`` waiting for a free slot, ``rows`` the caller's
    # fill (its GPU rows), ``sync`` waiting for the upload stream. Empty on the CPU.
    timings: dict[str, float] = field(default_factory=dict)
    # The upload is ordered on the device only (no host wait): the launch waits for it on the
    # compute stream, and what fill's work reads must outlive Submission.result().
    pending: bool = False


@dataclass
class Submission:
    """A launched batch; :meth:`result` waits for its outputs and returns new numpy arrays."""

    _collect: Callable[[], dict[str, np.ndarray]]
    _result: dict[str, np.ndarray] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def result(self) -> dict[str, np.ndarray]:
        with self._lock:
            if self._result is None:
                self._result = self._collect()
            return self._result


class Overlap:
    """The GPU side: slots, the upload and download streams, the events between them."""

    def __init__(self, backend: CudaBackend, slots: int = SLOTS) -> None:
        self.be = backend
        ctx = backend.ctx
        ctx.make_current()
        # Urgent: the next batch's resizes and upload, and the last one's download, start beside the
        # running batch rather than after it (their kernels and copies are small).
        self.up = Stream(ctx, urgent=True)
        self.down = Stream(ctx, urgent=True)
        self.ring = SlotRing(slots)
        self.inputs: dict[tuple[int, int], DeviceBuffer] = {}
        self.device_out: dict[tuple[int, str], DeviceBuffer] = {}
        self.pinned_in: dict[int, HostBuffer] = {}
        self.pinned_out: dict[tuple[int, str], HostBuffer] = {}
        # One event per slot for "its run has passed": the next upload into the slot and the
        # download both wait for it (one driver call fewer per batch than an event for each; every
        # driver call lets the GIL go and must win it back: docs/performance.md, "Every driver call").
        self.ran = [Event(ctx, timing=False) for _ in range(slots)]
        self.uploaded = [Event(ctx, timing=False) for _ in range(slots)]
        self.downloaded = [Event(ctx, timing=False) for _ in range(slots)]
        for e in self.ran:
            e.record(backend.stream)  # every slot starts free
        self._stage_lock = threading.Lock()
        self._last: tuple[int, bool] | None = None  # the last launch: its slot, whether it downloads

    def stage(self, x: np.ndarray, dtype: np.dtype, fill: Fill | None, *, device_ordered: bool = False) -> Staged:
        """``device_ordered``: the launch of this batch runs on the compute stream alone, so a
        batch whose rows ``fill`` wrote on the GPU (no host row to upload) need not be waited for
        on the host: its :class:`Staged` is ``pending`` (the module's ordering)."""
        be = self.be
        be.ctx.make_current()  # callers may be on any thread
        t0 = time.monotonic()
        with self._stage_lock:
            slot = self.ring.begin_stage()
            t_slot = time.monotonic()
            try:
                n = x.shape[0]
                key = (slot, x.nbytes)
                if key not in self.inputs:
                    self.inputs[key] = be.pool.alloc(max(x.nbytes, 1), self.up)
                buf = self.inputs[key]
                tensor = GpuTensor(buf.ptr, tuple(x.shape), dtype, buf)
                self.up.wait(self.ran[slot])
                written = fill(self.up, tensor) if fill is not None else set()
                t_rows = time.monotonic()
                runs = rows_to_upload(n, written)
                src = x if not runs or be._is_host_array(x) else self._pinned_copy(slot, x)
                row = x.nbytes // max(n, 1)
                for first, count in runs:
                    copy_async(
                        "HtoD", buf.ptr + first * row, src.ctypes.data + first * row, count * row, self.up.handle
                    )
                self.uploaded[slot].record(self.up)
                t_copy = time.monotonic()
                pending = device_ordered and not runs
                if not pending:
                    self.uploaded[slot].synchronize()  # IREE reads it on its own streams (FACTS 8)
                self.ring.staged(slot)
            except BaseException:
                self.ring.abandon(slot)
                raise
        timings = {"slot": t_slot - t0, "rows": t_rows - t_slot, "sync": time.monotonic() - t_copy}
        return Staged(slot, tensor, n, {k: v * 1e3 for k, v in timings.items()}, pending)

    def wait_staged(self, staged: Staged) -> None:
        """Wait on the host until the upload stream has passed ``staged``'s stage (before freeing
        what a ``pending`` stage's rows were read from, when the batch does not run)."""
        self.be.ctx.make_current()
        self.uploaded[staged.slot].synchronize()

    def _pinned_copy(self, slot: int, x: np.ndarray) -> np.ndarray:
        held = self.pinned_in.get(slot)
        if held is None or held.nbytes < x.nbytes:
            held = self.pinned_in[slot] = HostBuffer(self.be.ctx, max(x.nbytes, 1))
        view = held.numpy(x.dtype, x.shape)
        view[...] = x
        return view

    def launch(
        self,
        staged: Staged,
        run: Callable[[GpuTensor, int], Mapping[str, Any]],
        wanted: tuple[str, ...],
        into: Mapping[str, Sequence[int | None]] | None = None,
        *,
        device_ordered: bool = False,
    ) -> Submission:
        """Queue ``run`` on the staged slot and its outputs' way to the host. An output named in
        ``into`` goes straight from the run's buffer to the page-locked host addresses given per
        row (``None``: the row is not wanted), on the compute stream before ``ran[s]`` (one batched
        copy; no device copy, no download stream, nothing to copy on the host); the others are
        copied into the slot's page-locked staging on the download stream, as the module says.
        A ``pending`` stage is waited for on the compute stream, or on the host when this run is not
        ``device_ordered`` after all (its plan changed since the stage)."""
        be, slot = self.be, staged.slot
        into = into or {}
        direct = [name for name in wanted if name in into]
        rest = tuple(name for name in wanted if name not in into)
        self.ring.begin_launch(slot)
        queued_direct = False
        try:
            if staged.pending:
                if device_ordered:
                    be.stream.wait(self.uploaded[slot])
                else:
                    self.uploaded[slot].synchronize()
            outs = run(staged.x, staged.n)
            for name in direct:
                t = outs[name]
                rows = [(i, a) for i, a in enumerate(into[name]) if a is not None]
                queued_direct = True
                copy_rows_to_host(be.stream, t.ptr, t.nbytes // t.shape[0], rows)
            # The run's outputs may live in buffers the next run rewrites (a replayed plan's CUDA
            # graph): a device copy per slot on the compute stream, which the download then reads.
            kept: dict[str, DeviceBuffer] = {}
            for name in rest:
                t = outs[name]
                kept[name] = self._device_out(slot, name, t.nbytes)
                copy_async("DtoD", kept[name].ptr, t.ptr, t.nbytes, be.stream.handle)
            self.ran[slot].record(be.stream)
            views: dict[str, np.ndarray] = {}
            done = self.ran[slot]
            if rest:
                self.down.wait(self.ran[slot])
                for name in rest:
                    t = outs[name]
                    host = self._pinned_out(slot, name, t.nbytes)
                    copy_async("DtoH", host.ptr, kept[name].ptr, t.nbytes, self.down.handle)
                    views[name] = host.numpy(t.dtype, tuple(t.shape))
                done = self.downloaded[slot].record(self.down)
            self.ring.launched(slot)
            self._last = (slot, bool(rest))
        except BaseException:
            if queued_direct:  # the caller reuses the host rows once this fails: let the copies land first
                with contextlib.suppress(Exception):
                    be.stream.synchronize()
            self.ring.abandon(slot)
            raise
        keep = dict(outs)  # IREE's output buffers stay alive until the download has passed them

        def collect() -> dict[str, np.ndarray]:
            try:
                be.ctx.make_current()  # the collecting thread need not be the launching one
                done.synchronize()
                return {name: np.array(v, copy=True) for name, v in views.items()}
            finally:
                keep.clear()
                self.ring.collected(slot)

        return Submission(collect)

    def cover_last(self) -> None:
        """Make the last launch's :meth:`Submission.result` wait also for what the compute stream
        was given since (Engine.signal's stores and host calls): its events are recorded again."""
        if self._last is None:
            return
        slot, downloads = self._last
        self.ran[slot].record(self.be.stream)
        if downloads:
            self.down.wait(self.ran[slot])
            self.downloaded[slot].record(self.down)

    def _device_out(self, slot: int, name: str, nbytes: int) -> DeviceBuffer:
        held = self.device_out.get((slot, name))
        if held is None or held.nbytes < nbytes:
            if held is not None:
                held.close(self.be.stream)
            held = self.device_out[(slot, name)] = self.be.pool.alloc(max(nbytes, 1), self.be.stream)
        return held

    def _pinned_out(self, slot: int, name: str, nbytes: int) -> HostBuffer:
        held = self.pinned_out.get((slot, name))
        if held is None or held.nbytes < nbytes:
            held = self.pinned_out[(slot, name)] = HostBuffer(self.be.ctx, max(nbytes, 1))
        return held

    def close(self) -> None:
        self.be.ctx.make_current()
        self.up.synchronize()
        self.down.synchronize()
        for buf in self.inputs.values():
            buf.close(self.up)
        for buf in self.device_out.values():
            buf.close(self.down)  # the download stream read it last
        self.up.synchronize()
        self.down.synchronize()
        for h in (*self.pinned_in.values(), *self.pinned_out.values()):
            h.close()
        for e in (*self.ran, *self.uploaded, *self.downloaded):
            e.close()
        self.up.close()
        self.down.close()


def rows_to_upload(batch: int, written: set[int]) -> list[tuple[int, int]]:
    """The ``(first row, row count)`` runs of ``0 .. batch-1`` not in ``written``: what is copied
    from the host array after the GPU wrote its rows (one copy per run, none over a GPU row)."""
    runs: list[tuple[int, int]] = []
    start = None
    for r in range(batch + 1):
        host = r < batch and r not in written
        if host and start is None:
            start = r
        elif not host and start is not None:
            runs.append((start, r - start))
            start = None
    return runs
