"""The Track B executor: a plan's IREE CUDA modules, on the device and context Track A uses.

Each (segment, batch) runs one of two ways (:meth:`TrackB.decide`): its launch plan replayed on
the engine's own stream (runtime/replay.py: no IREE call, no host wait, capturable in the
engine's CUDA graph), or through the IREE runtime (below) where it has no launch plan, the
both-ways check found a difference, or DUALTRACK_TRACK_B=iree asks for it.

Through the IREE runtime, inputs go in zero-copy as DLPack capsules over the runtime's buffers
(FACTS 6); results come out zero-copy as DLPack capsules over IREE's buffers (FACTS 7, with
`--cuda_async_allocations=false`). IREE runs on its own streams; its synchronous call returns
after its work is complete (FACTS 8).

cuda.core 1.2's ``StridedMemoryView``/``Buffer`` speak DLPack too; runtime/dlpack.py stays because
the hand-over is between raw pointers and IREE's own capsule API, with the owner kept alive in
the capsule's deleter: a cuda.core Buffer would own (and free) memory that IREE or the pool owns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import Segment
from dualtrack.runtime import dlpack
from dualtrack.runtime.driver import Stream
from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index
from dualtrack.runtime.replay import ReplayDecision, Replayer
from dualtrack.runtime.tensors import GpuTensor
from dualtrack.settings import Settings


class TrackB:
    """Runs Track B segments: the bundle's module for ``target`` (runtime/images.py), per batch
    size, replayed by ``replayer`` or through the IREE runtime (created on first use)."""

    def __init__(self, bundle: Bundle, device_index: int, target: str, settings: Settings, replayer: Replayer) -> None:
        self.bundle, self.device_index, self.target = bundle, device_index, target
        self.settings = settings
        self.replayer = replayer
        self._iree: IreeDevice | None = None
        self.params: Any = None
        self.modules: dict[tuple[int, int], IreeModule] = {}
        self.closed = False

    @property
    def iree(self) -> IreeDevice:
        if self._iree is None:
            assert not self.closed, "TrackB used after close()"
            self._iree = IreeDevice.create(
                "cuda", self.device_index, allocators=self.settings.iree_allocators, flags=self.settings.iree_flags
            )
            self.params = parameter_index(self.bundle.weights)
        return self._iree

    def decide(self, seg: Segment, batch: int) -> ReplayDecision:
        """Replay or the IREE runtime for this module, and why."""
        return self.replayer.decide(seg, batch)

    def replay(self, seg: Segment, batch: int, ins: dict[str, GpuTensor], stream: Stream) -> dict[str, GpuTensor]:
        """Queue the module's launches on ``stream`` (no host wait; capturable)."""
        return self.replayer.segment(seg, batch).enqueue(ins, stream)

    def module(self, seg: Segment, batch: int) -> IreeModule:
        key = (seg.index, batch)
        if key not in self.modules:
            self.modules[key] = IreeModule(self.iree, self.bundle.vmfb(seg, self.target, batch), self.params, "main")
        return self.modules[key]

    def run(
        self, seg: Segment, batch: int, ins: dict[str, GpuTensor], *, before_call: Callable[[], None]
    ) -> tuple[dict[str, GpuTensor], float]:
        """The segment's outputs and the milliseconds of IREE's call. ``before_call`` runs after the
        input views are made and before the call: where the backend waits for Track A's writes."""
        mod = self.module(seg, batch)
        dev = self.iree.device
        # The views only wrap pointers: made before the wait, they are off the A -> B critical path.
        views = [
            dev.from_dlpack_capsule(dlpack.to_capsule(t.ptr, t.shape, t.dtype, self.device_index, t.keepalive))
            for t in (ins[s.name] for s in seg.inputs)
        ]
        before_call()
        t0 = time.perf_counter()
        outs = mod.call_views(*views)  # synchronous: returns after IREE's work is complete (FACTS 8)
        call_ms = (time.perf_counter() - t0) * 1e3
        result = {}
        for spec, out in zip(seg.outputs, outs, strict=True):
            view = getattr(out, "_buffer_view", out)  # FunctionInvoker wraps results in DeviceArray
            imp = dlpack.from_capsule(
                dev.create_dlpack_capsule(view, int(dlpack.DLDeviceType.kDLCUDA), self.device_index)
            )
            # IREE exports ONNX uint8 as int8 (signless i8): the plan's dtype is the truth.
            result[spec.name] = GpuTensor(imp.ptr, imp.shape, np.dtype(spec.dtype), (imp.keepalive, view))
        return result, call_ms

    def close(self) -> None:
        self.closed = True
        self.replayer.close()
        self.modules.clear()
        self._iree = None
        self.params = None  # an index still alive at interpreter exit is reported as a leak by nanobind
