"""Sliding-window inference: an image larger than the bundle's largest compiled size, run as
overlapping windows through the engine, their probabilities blended, the mask answered at the
image's own size (the bundle's ``window:``, :class:`~dualtrack.contract.manifest.Window`).

The algorithm is MONAI's ``sliding_window_inference`` (monai/inferers/utils.py), restated:

- **Origins** (:func:`window_origins`): per axis the scan interval is ``int(window * (1 - overlap))``
  (at least 1), the starts ``0, interval, 2 interval, ...`` up to the first window that reaches the
  image's end, which is pulled back to end exactly there; windows in row-major order. An axis where
  the image is smaller than the window is padded, ``(window - image) // 2`` before and the rest
  after, with zero pixels. (MONAI pads the network's normalised input with 0; here the bundle's
  input is uint8 pixels, and pixel 0 normalises to ``-mean / std``: the same only where mean is 0.)
- **Weights** (:func:`importance_map`): ``gaussian``, per axis ``exp(-d^2 / 2 sigma^2)`` with
  ``sigma = sigma_scale * side`` and ``d`` the distance from the window's centre, multiplied over
  the axes and floored at ``max(min, 1e-3)``; ``constant``, ones.
- **Blend**: per pixel ``sum(w * p) / sum(w)`` over the windows covering it, accumulated in float32
  in window order, then the mask as the bundle's postprocess makes it: argmax over classes (the
  first of equal ones), or ``p > 0.5`` for one class. What is blended is the bundle's ``probs``
  output (its postprocess's activation applied: MONAI blends whatever its predictor returns, so a
  predictor that matches this one returns probabilities).

**Memory.** Windows run in row-major order, so once a batch whose first window starts at row
``y0`` is taken, no later window touches a row above ``y0``: those rows are final. The accumulator
holds only the rows in flight, as a ring of ``band`` rows (:func:`band_rows`: the largest span of
origin rows in one batch plus the window height, at most ``h + ceil(batch / per_row) * interval``)
of ``classes + 1`` float32 planes (the weighted sums and the sum of weights). Finished rows are
normalised, argmax'ed into the mask and zeroed for reuse. Beside the caller's image and mask
(``3 H W`` and ``H W`` bytes), a tiled run holds

    4 (C + 1) band W                  the accumulator
    + batch h w (3 + 4 C)             one batch of windows and their probabilities
    + 4 h w                           the weight map
    (+ 3 H W + H W on the GPU: the image the windows are cut from, and the mask, downloaded once)

bytes (:func:`band_bytes`), for C classes, ``h x w`` windows and an image ``W`` pixels wide: the
accumulator grows with the width, not the height. An 8192 x 8192 image in 512 x 512 windows
(overlap 0.25, batch 8, 21 windows a row, band 896), 2 classes: 88 MB of accumulator, 23 MB of
windows. Probabilities at the image's size are only made when asked for (``4 C H W`` bytes).

The CPU path (:func:`tile_numpy`, numpy) and the GPU path (:class:`GpuTiler`: windows cut on the
GPU, the blend and the finished rows in the ``blend_nhwc`` kernels) run the same algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from dualtrack import kernels
from dualtrack.contract import arch
from dualtrack.contract.manifest import Window
from dualtrack.errors import InputError
from dualtrack.kernels import blend, sources
from dualtrack.kernels.blend import BlendSpec
from dualtrack.runtime.driver import Event, Module, Stream, call, copy_async
from dualtrack.runtime.memory import HostBuffer, download
from dualtrack.runtime.tensors import GpuTensor

Size = tuple[int, int]
WEIGHT_FLOOR = 1e-3  # MONAI's compute_importance_map floors the weights here (a gaussian's corners)


# -- where the windows go (pure functions) ---------------------------------------------------------


def axis_starts(image: int, window: int, overlap: float) -> list[int]:
    """The windows' starts along one axis of ``image`` pixels (``image >= window``), as MONAI's
    ``_get_scan_interval`` and ``dense_patch_slices`` place them."""
    if window >= image:
        return [0]
    interval = max(int(window * (1 - overlap)), 1)
    starts = []
    for i in range(math.ceil(image / interval)):
        if i * interval + window >= image:  # the first window to reach the end ends there
            starts.append(image - window)
            break
        starts.append(i * interval)
    return starts


def window_origins(image: Size, window: Size, overlap: float) -> list[Size]:
    """Every window's top-left (row, column) in image coordinates, in row-major order; negative
    where an axis is padded (the image smaller than the window there, centred as MONAI pads)."""
    per_axis = []
    for size, side in zip(image, window, strict=True):
        if size < side:
            per_axis.append([-((side - size) // 2)])
        else:
            per_axis.append(axis_starts(size, side, overlap))
    return [(y, x) for y in per_axis[0] for x in per_axis[1]]


def importance_map(window: Size, blend: str, sigma_scale: float = 0.125) -> np.ndarray:
    """The ``(h, w)`` float32 weights of one window's outputs (MONAI's ``compute_importance_map``)."""
    if blend == "constant":
        return np.ones(window, np.float32)
    if blend != "gaussian":
        raise InputError(f"window blend {blend!r} is not gaussian or constant; rebuild with one of them")
    axes = []
    for side in window:
        d = np.arange(side, dtype=np.float64) - (side - 1) / 2.0
        axes.append(np.exp(d**2 / (-2.0 * (sigma_scale * side) ** 2)).astype(np.float32))
    weights = axes[0][:, None] * axes[1][None, :]
    return np.maximum(weights, max(float(weights.min()), WEIGHT_FLOOR)).astype(np.float32)


def batches(origins: Sequence[Size], batch: int) -> list[Sequence[Size]]:
    """The origins in engine runs of at most ``batch`` windows, in order."""
    return [origins[i : i + batch] for i in range(0, len(origins), batch)]


def band_rows(origins: Sequence[Size], window_h: int, batch: int, height: int) -> int:
    """Rows the accumulator holds: a batch's windows span its first origin row to its last plus the
    window's height (rows above the first are final by then), at most the image's height."""
    span = max(b[-1][0] - b[0][0] for b in batches(origins, batch))
    return min(span + window_h, height)


def band_bytes(width: int, window: Size, classes: int, batch: int, band: int) -> int:
    """What a tiled run holds besides the image and the mask (the module's bound)."""
    h, w = window
    return 4 * (classes + 1) * band * width + batch * h * w * (3 + 4 * classes) + 4 * h * w


# -- the accumulator (numpy) -------------------------------------------------------------------------


class BandAccumulator:
    """The blend of one image's windows in a ring of ``band`` rows (the module's memory bound):
    :meth:`add` a batch (finishing the rows above it first), :meth:`finish` the rest at the end. Its
    arithmetic is the ``blend_nhwc`` kernels' numpy reference (:mod:`dualtrack.kernels.blend`)."""

    def __init__(self, image: Size, classes: int, band: int, weights: np.ndarray, *, probs: bool) -> None:
        self.image, self.classes, self.weights = image, classes, weights
        self.acc = np.zeros((classes + 1, band, image[1]), np.float32)
        self.mask = np.empty(image, np.uint8)
        self.probs = np.empty((classes, *image), np.float32) if probs else None
        self.done = 0  # rows [0, done) are answered

    def add(self, probs: np.ndarray, origins: Sequence[Size]) -> None:
        """Blend ``probs`` (n, C, h, w) of the windows at ``origins`` (row-major order): the rows
        above the first window are final, so they are answered first."""
        self.finish(max(origins[0][0], 0))
        blend.accumulate(self.acc, probs, self.weights, origins, self.image, self.done)

    def finish(self, upto: int | None = None) -> None:
        """Answer rows ``[done, upto)`` (default: every row left)."""
        upto = self.image[0] if upto is None else upto
        if upto <= self.done:
            return
        mask, p = blend.finish(self.acc, self.done, upto)
        self.mask[self.done : upto] = mask
        if self.probs is not None:
            self.probs[:, self.done : upto] = p
        self.done = upto


@dataclass(frozen=True)
class Tiling:
    """One image's windows: the resolved window, its weights and origins, and the band.

    ``sizes``: the engine's compiled batch sizes. A run of fewer windows than ``batch`` (the last one)
    runs at the smallest of them that holds its windows (:meth:`batch_for`), not padded to ``batch``:
    25 windows of a 2048 x 2048 image in batches of 8 leave one window, which a batch-1 plan answers in
    about a third of a batch-8 run's time."""

    image: Size
    window: Size
    batch: int
    origins: tuple[Size, ...]
    weights: np.ndarray
    band: int
    sizes: tuple[int, ...] = ()

    @classmethod
    def plan(cls, image: Size, spec: Window, window: Size, batch: int, sizes: Sequence[int] = ()) -> Tiling:
        origins = tuple(window_origins(image, window, spec.overlap))
        weights = importance_map(window, spec.blend, spec.sigma_scale)
        band = band_rows(origins, window[0], batch, image[0])
        return cls(image, window, batch, origins, weights, band, tuple(sorted(sizes)))

    def runs(self) -> Iterator[Sequence[Size]]:
        yield from batches(self.origins, self.batch)

    def batch_for(self, windows: int) -> int:
        """The batch a run of ``windows`` windows runs at: the smallest compiled size that holds them,
        at most ``batch``."""
        return min((b for b in self.sizes if windows <= b <= self.batch), default=self.batch)


def cut(image: np.ndarray, origins: Sequence[Size], window: Size, batch: int) -> np.ndarray:
    """The windows at ``origins`` of an (H, W, 3) image as a (batch, h, w, 3) array, zero outside
    the image and in rows past ``len(origins)`` (the padding of a last, short batch)."""
    h, w = window
    out = np.zeros((batch, h, w, image.shape[2]), image.dtype)
    for i, origin in enumerate(origins):
        k = blend.Clip.of(origin, window, image.shape[:2])
        out[i, k.r0 - k.oy : k.r1 - k.oy, k.c0 - k.ox : k.c1 - k.ox] = image[k.r0 : k.r1, k.c0 : k.c1]
    return out


def tile_numpy(
    image: np.ndarray, t: Tiling, run: Callable[[np.ndarray], np.ndarray], classes: int, *, probs: bool = False
) -> Answer:
    """The CPU path: windows of ``image`` (H, W, 3) cut by numpy, ``run`` ((batch, h, w, 3) uint8 ->
    (batch, C, h, w) float32 probabilities), blended in a :class:`BandAccumulator`."""
    acc = BandAccumulator(t.image, classes, t.band, t.weights, probs=probs)
    for origins in t.runs():
        acc.add(run(cut(image, origins, t.window, t.batch_for(len(origins))))[: len(origins)], origins)
    acc.finish()
    return Answer(acc.mask, acc.probs)


# -- the GPU path ----------------------------------------------------------------------------------------


class _Transfers:
    """A tiled image's rows up and its mask's rows down, in bands through page-locked staging on two copy
    streams of their own (one each way: a download waits for the compute that chose its rows, and an upload
    queued behind it would wait too), beside the windows' compute on the engine's stream: a batch's cut waits (on the
    device) only for the band that holds its last row, and finished mask rows come down while later
    batches run. Why not one copy each way: from pageable memory the driver stages the whole image before
    the first window can run and the mask after the last (67 MB both ways at 4096 x 4096 on an H100, about
    5 ms of a 41 ms answer: bench/results/tiles_bench-82ea7be-s13-h100.json, the engine alone making 35 ms).

    Up: :attr:`SLOTS` staging slots of :attr:`BAND` image rows, reused in turn; the host copies a band
    into its slot only once the slot's previous upload is done (its event). Down: one page-locked mask
    of the largest image so far, copied into the caller's array at the end."""

    BAND = 256  # image rows a staging slot holds
    SLOTS = 4

    def __init__(self, backend: Any) -> None:
        self.be = backend
        self.up_stream, self.down_stream = Stream(backend.ctx), Stream(backend.ctx)
        self.slots: list[HostBuffer] = []
        self.events = [Event(backend.ctx, timing=False) for _ in range(self.SLOTS)]
        self.used = [False] * self.SLOTS
        self.finished = Event(backend.ctx, timing=False)
        self.mask: HostBuffer | None = None

    def start(self, image: np.ndarray, dst: int, mask: int) -> None:
        """Begin an image: ``dst`` its device copy, ``mask`` the device mask (H * W bytes)."""
        self.image, self.dst, self.dmask = image, dst, mask
        H, W = image.shape[:2]
        self.row_bytes, self.up, self.band = W * image.shape[2], 0, 0
        if not self.slots or self.slots[0].nbytes < self.BAND * self.row_bytes:
            self.wait()
            for b in self.slots:
                b.close()
            self.slots = [HostBuffer(self.be.ctx, self.BAND * self.row_bytes) for _ in range(self.SLOTS)]
            self.used = [False] * self.SLOTS
        if self.mask is None or self.mask.nbytes < H * W:
            self.wait()
            if self.mask is not None:
                self.mask.close()
            self.mask = HostBuffer(self.be.ctx, H * W)

    def rows(self, upto: int) -> None:
        """Image rows ``[0, upto)`` on the device before the engine's stream goes on."""
        H = self.image.shape[0]
        while self.up < min(upto, H):
            r0, r1 = self.up, min(H, self.up + self.BAND)
            k = self.band % self.SLOTS
            if self.used[k]:
                self.events[k].synchronize()  # the slot's last upload is done: it may be written
            n = (r1 - r0) * self.row_bytes
            self.slots[k].numpy(np.uint8, (n,))[:] = self.image[r0:r1].reshape(-1)
            copy_async("HtoD", self.dst + r0 * self.row_bytes, self.slots[k].ptr, n, self.up_stream.handle)
            self.events[k].record(self.up_stream)
            self.be.stream.wait(self.events[k])
            self.used[k], self.up, self.band = True, r1, self.band + 1

    def mask_rows(self, lo: int, hi: int) -> None:
        """Mask rows ``[lo, hi)``, chosen by the kernels queued so far on the engine's stream, down."""
        W = self.image.shape[1]
        self.finished.record(self.be.stream)
        self.down_stream.wait(self.finished)
        assert self.mask is not None
        copy_async("DtoH", self.mask.ptr + lo * W, self.dmask + lo * W, (hi - lo) * W, self.down_stream.handle)

    def wait(self) -> None:
        self.up_stream.synchronize()
        self.down_stream.synchronize()

    def mask_into(self, out: np.ndarray) -> None:
        """The whole mask, once every band came down, into ``out`` (H, W) uint8."""
        self.wait()
        assert self.mask is not None
        out.reshape(-1)[:] = self.mask.numpy(np.uint8, (out.size,))

    def close(self) -> None:
        self.wait()
        for b in [*self.slots, *([self.mask] if self.mask is not None else [])]:
            b.close()
        self.slots, self.mask = [], None


class GpuTiler:
    """The GPU path of one engine, on its stream: the image's rows uploaded in bands as the windows
    need them (:class:`_Transfers`), each batch's windows cut into the engine's input by
    ``blend_nhwc_cut_u8``, its probabilities blended into the band by ``blend_nhwc_accumulate_f32``,
    finished rows chosen into the device mask (and probabilities where asked) by
    ``blend_nhwc_finish_f32`` and sent down as they are done; no host wait between batches."""

    def __init__(self, backend: Any, entries: Mapping[str, Any] | None = None) -> None:
        """``entries``: the blend kernels by entry name, each with ``launch(grid, block, shared, stream,
        args)`` (default: this device's checked-in PTX, loaded here; a test passes stand-ins)."""
        self.backend = backend
        self.spec: BlendSpec = kernels.BLEND
        self.kernels = dict(entries) if entries is not None else self._load()
        self.weights: dict[tuple[Size, str, float], GpuTensor] = {}  # one upload per window and blend
        self.transfers: _Transfers | None = None

    def _load(self) -> dict[str, Any]:
        choice = arch.choose_image(self.backend.device.cc, [], list(self.spec.ptx_arches))
        path = sources.ptx_path(sources.SOURCE_DIR, Path(f"{self.spec.stem}.cu"), choice.arch)
        module = Module.load(self.backend.ctx, path.read_bytes(), kind="ptx", origin=str(path), target=choice.arch)
        return {e: module.function(e) for e in self.spec.entries}

    def _launch(self, entry: str, call_: tuple[Any, list[Any]]) -> None:
        config, args = call_
        self.kernels[entry].launch(config.grid, config.block, config.shared_bytes, self.backend.stream, args)
        # Work on the backend's stream: a Track B segment run through the IREE runtime (its own streams)
        # waits for it on the host before reading the windows (CudaBackend._handoff_to_iree).
        self.backend.stream_pending = True

    def run(
        self, image: np.ndarray, t: Tiling, spec: Window, run_batch: Callable[[Any, int], Any], classes: int,
        *, probs: bool = False,
    ) -> Answer:  # fmt: skip
        """Tile ``image`` ((H, W, 3) uint8, host) with ``run_batch(device input, batch)``, which
        returns the engine's device outputs (its ``probs``: (batch, C, h, w) float32)."""
        be, (H, W), (h, w), spec_ = self.backend, t.image, t.window, self.spec
        be.ctx.make_current()
        weights = self._weights(t, spec)
        acc_bytes = 4 * (classes + 1) * t.band * W
        bufs = {
            "image": be.pool.alloc(image.nbytes, be.stream),
            "acc": be.pool.alloc(acc_bytes, be.stream),
            "x": be.pool.alloc(t.batch * h * w * 3, be.stream),
            "mask": be.pool.alloc(H * W, be.stream),
            **({"probs": be.pool.alloc(4 * classes * H * W, be.stream)} if probs else {}),
        }
        ptr = {k: int(v) for k, v in bufs.items()}
        done = 0
        if self.transfers is None:
            self.transfers = _Transfers(be)
        move = self.transfers
        try:
            move.start(np.ascontiguousarray(image), ptr["image"], ptr["mask"])
            call(cu.cuMemsetD8Async, ptr["acc"], 0, acc_bytes, be.stream.handle)
            for origins in t.runs():
                done = self._finish(ptr, t, classes, done, max(origins[0][0], 0))
                b = t.batch_for(len(origins))
                move.rows(max(y for y, _ in origins) + h)
                self._launch(spec_.cut_entry, spec_.cut_call(ptr["image"], ptr["x"], H, W, h, w, b, origins))
                outs = run_batch(GpuTensor(ptr["x"], (b, h, w, 3), np.dtype(np.uint8), bufs["x"]), b)
                p = _probs(outs, (b, classes, h, w))
                acc = spec_.accumulate_call(p.ptr, weights, ptr["acc"], classes, h, w, H, W, t.band, done, origins)
                self._launch(spec_.accumulate_entry, acc)
            self._finish(ptr, t, classes, done, H)
            answer = Answer(np.empty((H, W), np.uint8), np.empty((classes, H, W), np.float32) if probs else None)
            if answer.probs is not None:
                download(be.stream, answer.probs, bufs["probs"])  # into pageable memory: returns once it is there
            move.mask_into(answer.mask)
        finally:
            # nothing may still read or write them when they go back to the pool
            be.stream.synchronize()
            move.wait()
            for buf in bufs.values():
                buf.close(be.stream)
        return answer

    def _weights(self, t: Tiling, spec: Window) -> int:
        key = (t.window, spec.blend, spec.sigma_scale)
        if key not in self.weights:
            self.weights[key] = self.backend.from_host(t.weights)
        return self.weights[key].ptr

    def _finish(self, ptr: dict[str, int], t: Tiling, classes: int, done: int, upto: int) -> int:
        """Rows ``[done, upto)`` chosen into the device mask; returns ``upto`` (the rows answered)."""
        if upto > done:
            H, W = t.image
            finish = self.spec.finish_call(
                ptr["acc"], ptr["mask"], ptr.get("probs", 0), classes, H, W, t.band, done, upto
            )
            self._launch(self.spec.finish_entry, finish)
            assert self.transfers is not None
            self.transfers.mask_rows(done, upto)
        return max(upto, done)

    def close(self) -> None:
        for t in self.weights.values():
            t.keepalive.close(self.backend.stream)
        self.weights.clear()
        self.kernels.clear()
        if self.transfers is not None:
            self.transfers.close()
            self.transfers = None


@dataclass
class Answer:
    """A tiled image's answer: its (H, W) mask and, where asked for, (C, H, W) probabilities."""

    mask: np.ndarray
    probs: np.ndarray | None = None


def _probs(outs: Any, want: tuple[int, ...]) -> GpuTensor:
    """The engine's ``probs`` output of a window batch, checked: what the accumulate kernel reads."""
    p = outs["probs"] if isinstance(outs, dict) else outs
    if tuple(p.shape) != want or np.dtype(p.dtype) != np.float32 or getattr(p, "ld", 0):  # ld: a channel slice
        raise InputError(
            f"the bundle's probs are {np.dtype(p.dtype)}{list(p.shape)}; windows blend float32 {list(want)}: "
            "rebuild with `postprocess:`"
        )
    return p
