"""`dualtrack.Engine`: what a segmentation service imports.

The engine executes a bundle's plan segment by segment. On the CPU every segment, Track A ones
included, runs through its IREE llvm-cpu module. On a GPU Track A runs the hand-written kernels and
Track B the IREE CUDA modules, in one CUDA context (runtime/gpu.py). There is no silent fallback:
asking for `cuda` where there is no GPU is an error.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dualtrack import hostcpu
from dualtrack.contract import sizes
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import Segment, TensorSpec
from dualtrack.errors import BundleError, CudaError, InputError
from dualtrack.runtime import tiling
from dualtrack.runtime.driver import held_calls
from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index
from dualtrack.runtime.memory import PinnedRange
from dualtrack.runtime.overlap import Fill, Overlap, Staged, Submission
from dualtrack.runtime.selfcheck import replay_check, self_check
from dualtrack.settings import Settings

DEVICES = ("cpu", "cuda")


# A C function of one pointer argument (CUDA's CUhostFn); Engine.signal calls one on the CPU.
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Backend(Protocol):
    def run_segment(self, seg: Segment, batch: int, inputs: Mapping[str, Any]) -> dict[str, Any]: ...
    def run_plan(self, batch: int, inputs: Mapping[str, Any], *, timed: bool = True) -> dict[str, Any]: ...
    def to_host(self, value: Any) -> np.ndarray: ...
    def from_host(self, arr: np.ndarray, *, slot: str | None = None) -> Any: ...
    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray: ...
    def close(self) -> None: ...


def as_dtype(arr: np.ndarray, dtype: str) -> np.ndarray:
    """IREE reports ONNX uint8 as signless i8 (int8): reinterpret to the plan's dtype, no copy."""
    want = np.dtype(dtype)
    if arr.dtype == want:
        return arr
    if arr.dtype.itemsize == want.itemsize and arr.dtype.kind in "iub" and want.kind in "iub":
        return arr.view(want)
    return arr.astype(want)


class CpuBackend:
    """Every segment through IREE's llvm-cpu modules (local-task driver)."""

    target = "llvm-cpu"

    def __init__(self, bundle: Bundle) -> None:
        target = bundle.manifest.cpu_target
        if why := hostcpu.cannot_run(target):  # its first call would die of SIGILL
            raise BundleError(
                f"{bundle.root}'s CPU modules cannot run here: {why}; rebuild it on this machine "
                "(track_b.cpu_target: auto) or run it on a GPU (--device cuda)"
            )
        self.bundle = bundle
        self.device = IreeDevice.create("cpu")
        self.params = parameter_index(bundle.weights)
        self.modules: dict[tuple[int, int], IreeModule] = {}
        self.lock = threading.Lock()
        self.timings = {"A": 0.0, "B": 0.0, "graph": 0.0}

    def module(self, seg: Segment, batch: int) -> IreeModule:
        with self.lock:
            key = (seg.index, batch)
            if key not in self.modules:
                self.modules[key] = IreeModule(
                    self.device, self.bundle.vmfb(seg, self.target, batch), self.params, "main"
                )
            return self.modules[key]

    def run_segment(self, seg: Segment, batch: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run one segment; a batch runs in rows of the manifest's ``cpu_batch`` (the batch the llvm-cpu
        modules were compiled for, track_b.CPU_BATCH at build time)."""
        step = self.bundle.manifest.cpu_batch
        mod = self.module(seg, step)
        t0 = time.perf_counter()
        rows: list[dict[str, np.ndarray]] = []
        for i in range(0, batch, step):
            # One call takes its tensors whole: a fixed-shape plan's may have more rows than its batch.
            part = slice(None) if step == batch else slice(i, i + step)
            outs = mod(*[np.ascontiguousarray(inputs[t.name][part]) for t in seg.inputs])
            # Copy out of IREE's buffers: a host view must not outlive the device (use-after-free at exit).
            rows.append(
                {
                    t.name: as_dtype(np.array(o.to_host(), copy=True), t.dtype)
                    for t, o in zip(seg.outputs, outs, strict=True)
                }
            )
        self.timings[seg.track] += (time.perf_counter() - t0) * 1e3
        if len(rows) == 1:
            return rows[0]
        return {t.name: np.concatenate([r[t.name] for r in rows]) for t in seg.outputs}

    def run_plan(self, batch: int, inputs: Mapping[str, Any], *, timed: bool = True) -> dict[str, Any]:
        env = dict(inputs)
        for seg in self.bundle.plan.segments:
            env.update(self.run_segment(seg, batch, env))
        return {o.name: env[o.name] for o in self.bundle.plan.outputs}

    def to_host(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def from_host(self, arr: np.ndarray, *, slot: str | None = None) -> Any:
        return arr

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype)

    def close(self) -> None:
        # Modules before the device, the device before the weights they read (IREE needs this order).
        self.modules.clear()
        self.device = None  # type: ignore[assignment]
        self.params = None  # an index still alive at interpreter exit is reported as a leak by nanobind


class Engine:
    """A loaded bundle, ready to segment images.

    ``run`` takes any batch size: it pads up to the next compiled batch size (or splits larger
    batches) and returns exactly as many rows as it was given.
    """

    def __init__(self, bundle: Bundle, backend: Backend, device: str) -> None:
        self.bundle = bundle
        self.plan = bundle.plan
        self.backend = backend
        self.device = device
        self.batch_sizes: tuple[int, ...] = tuple(self.plan.batch_sizes)
        self.input_spec: TensorSpec = self.plan.inputs[0]
        self.output_specs: tuple[TensorSpec, ...] = self.plan.outputs
        self.last_timings: dict[str, float] = {}
        # A bundle of several input sizes (config `sizes`) or with a sliding window (`window:`): every size,
        # smallest first; run() takes an image at its own size (contract/sizes.py; a larger one windowed where
        # the bundle has `window:`). Empty for a one-size bundle without a window, which takes its one size only.
        self.sizes: tuple[sizes.Size, ...] = bundle.sizes if bundle.manifest.sizes or bundle.manifest.window else ()
        self.last_size: sizes.Choice | None = None  # how the last run at an image's own size ran
        self.device_index = 0
        self._at_size: dict[sizes.Size, Engine] = {}  # the other sizes' engines, loaded on first use
        self._at_size_lock = threading.Lock()
        self.last_windows = 0  # windows the last run's sliding window ran (0: none)
        self._tiler: Any = None  # runtime/tiling.py's GPU path, made by the first tiled run on cuda
        self._lock = threading.Lock()
        self._closed = False
        self._overlap: Any = None  # runtime/overlap.py's slots and streams, made by the first stage() on cuda
        self._pinned: list[PinnedRange] = []  # host memory pin_host registered: what launch(into=...) may write

    @classmethod
    def load(
        cls, bundle: str | Path | Bundle, device: str = "cpu", device_index: int = 0, *, model: str | Path | None = None
    ) -> Engine:
        """Open a bundle on `cpu` or `cuda` (GPU `device_index`). `model` refuses a bundle built from another file."""
        b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
        if model is not None:
            b.check_model(Path(model))
        if device == "cpu":
            return cls(b, CpuBackend(b), "cpu")
        if device == "cuda":
            from dualtrack.runtime.gpu import CudaBackend

            engine = cls(b, CudaBackend(b, device_index), "cuda")
            engine.device_index = device_index
            settings = Settings.from_env()
            if settings.gpu_self_check:
                dev = engine.backend.device
                name = f"{dev.name} cc{dev.cc[0]}.{dev.cc[1]} driver{dev.driver_version}"
                try:
                    replay_check(engine, name, settings.cache_dir)
                    self_check(engine, name, settings.cache_dir)
                except BaseException:
                    engine.close()
                    raise
            return engine
        raise InputError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")

    # -- validation -------------------------------------------------------------------------------

    def check_input(self, x: Any) -> tuple[int, ...]:
        return self._check(tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", "?")))

    def _check(self, shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
        spec = self.input_spec
        if self.plan.fixed_shape:
            want = f"{spec.shape} {spec.dtype}"
            if shape != spec.shape:
                raise InputError(
                    f"input has shape {shape}; this bundle was built with `batch: fixed` and takes exactly {want}: "
                    "pass that shape, or rebuild with `batch: images` to run any number of images"
                )
        want = f"(n, {', '.join(map(str, spec.shape[1:]))}) {spec.dtype}" if spec.batched else want
        if len(shape) != len(spec.shape) or shape[1:] != spec.shape[1:] or shape[0] < 1:
            layout = f" ({spec.layout})" if spec.layout else ""
            raise InputError(f"input has shape {shape}; this bundle takes {want}{layout}")
        if dtype != spec.dtype:
            raise InputError(
                f"input has dtype {dtype}; this bundle takes {want}: convert with .astype(np.{spec.dtype})"
            )
        return shape

    def _chunks(self, n: int) -> list[tuple[int, int, int]]:
        """(start, rows, compiled batch) covering n rows with the fewest padded rows."""
        out, start, top = [], 0, self.batch_sizes[-1]
        while start < n:
            rows = min(top, n - start)
            batch = next(b for b in self.batch_sizes if b >= rows)
            out.append((start, rows, batch))
            start += rows
        return out

    # -- execution --------------------------------------------------------------------------------

    def run_batch(self, x: Any, batch: int) -> dict[str, Any]:
        """Run the plan on exactly one compiled batch size; values stay on the backend's device (on
        a GPU in the engine's planned buffers: valid until the next run)."""
        return self.backend.run_plan(batch, {self.input_spec.name: x})

    def run(self, x: Any, outputs: Sequence[str] | None = None) -> dict[str, Any]:
        """Segment a batch of images: `x` is (n, *input.shape[1:]) in the input dtype.

        A numpy array gives numpy arrays back, new ones that the caller owns (the next run does not
        touch them); one from :meth:`host_array` goes to the GPU without a staging copy. On `cuda`,
        a GPU tensor (DLPack or `__cuda_array_interface__`: torch, cupy, ...) stays on the GPU and
        gives DeviceArrays back (DLPack-capable, zero-copy); its batch must then be one of `batch_sizes`.
        `outputs` names the outputs wanted (default: all); the others are not copied off the GPU.
        """
        if self._closed:
            raise InputError("this engine is closed; load the bundle again")
        self.last_windows = 0
        if (choice := self._window_choice(x)) is not None:
            return self._run_windows(np.asarray(x), outputs, choice)
        if self.sizes and len(getattr(x, "shape", ())) == 4 and tuple(x.shape[1:3]) != self.input_spec.shape[1:3]:
            return self._run_at_own_size(x, outputs)
        if not isinstance(x, np.ndarray) and (hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")):
            return self._run_on_device(x)
        wanted = self._wanted(outputs)
        n = self.check_input(np.asarray(x))[0]
        x = np.asarray(x)
        with self._lock:
            t0 = time.perf_counter()
            for k in self.backend.timings:
                self.backend.timings[k] = 0.0
            parts: dict[str, list[np.ndarray]] = {name: [] for name in wanted}
            for start, rows, batch in self._chunks(n):
                chunk = x[start : start + rows]
                if rows < batch:
                    chunk = np.concatenate([chunk, np.zeros((batch - rows, *chunk.shape[1:]), chunk.dtype)])
                outs = self.run_batch(self.backend.from_host(np.ascontiguousarray(chunk), slot="input"), batch)
                for name in wanted:  # a fixed-shape plan runs whole: its outputs have rows of their own
                    out = self.backend.to_host(outs[name])
                    parts[name].append(out if self.plan.fixed_shape else out[:rows])
            total = (time.perf_counter() - t0) * 1e3
            self.last_timings = {
                "track_a_ms": self.backend.timings["A"],
                "track_b_ms": self.backend.timings["B"],
                "total_ms": total,
            }
            if self.backend.timings.get("graph"):  # on a GPU, the whole inference as one CUDA graph
                self.last_timings["graph_ms"] = self.backend.timings["graph"]
        return {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in parts.items()}

    def _run_at_own_size(self, x: Any, outputs: Sequence[str] | None) -> dict[str, Any]:
        """Images of another height and width than this plan's, in a bundle of several sizes: run at the
        smallest compiled size that holds them, padded by their edge pixels, every output cropped back
        (contract/sizes.py says why, and what the padding can change near the border). A GPU tensor
        runs unpadded on the engine of its own size, which must be a compiled one."""
        hw = (int(x.shape[1]), int(x.shape[2]))
        if not isinstance(x, np.ndarray) and (hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")):
            if hw not in self.sizes:
                have = ", ".join(sizes.label(s) for s in self.sizes)
                raise InputError(
                    f"a GPU tensor of {sizes.label(hw)} is not a compiled size ({have}): pass one of those, or a numpy "
                    "array (padded to the smallest size that holds it)"
                )
            engine = self.at_size(hw)
            out = engine.run(x, outputs)
            self.last_size, self.last_timings = sizes.Choice(sizes.FITS, hw, hw), engine.last_timings
            return out
        x = np.asarray(x)
        choice = sizes.choose((x.shape[1], x.shape[2]), self.sizes, window=self.bundle.manifest.window is not None)
        if choice.mode != sizes.FITS:  # the one hook for images too large: sizes.choose decides, this refuses
            have = ", ".join(sizes.label(s) for s in self.sizes)
            raise InputError(
                f"an image of {sizes.label(choice.image)} is larger than every compiled size ({have}): resize it to "
                f"{sizes.label(choice.size)} (dualtrack.imaging does, for `dualtrack run` and the service), or add the "
                "size to `sizes` and rebuild"
            )
        engine = self.at_size(choice.size)
        out = engine.run(sizes.pad_to(x, choice.size), outputs)
        self.last_size, self.last_timings = choice, engine.last_timings
        return {k: np.ascontiguousarray(sizes.crop_to(v, choice.size, choice.image)) for k, v in out.items()}

    def _window_choice(self, x: Any) -> sizes.Choice | None:
        """The sliding window's choice for a numpy batch of images larger than every compiled size, in
        a bundle with ``window:``; None for everything else (which runs as before)."""
        if self.bundle.manifest.window is None or not isinstance(x, np.ndarray) or x.ndim != 4:
            return None
        choice = sizes.choose((x.shape[1], x.shape[2]), self.sizes or (self.input_spec.shape[1:3],), window=True)
        return choice if choice.mode == sizes.WINDOW else None

    def windows(self, image: sizes.Size) -> int:
        """How many windows :meth:`run` tiles an image of ``image`` (height, width) into: 0 where a
        compiled size holds it or the bundle has no ``window:`` (the service's metrics count them)."""
        win = self.bundle.manifest.window
        if win is None:
            return 0
        choice = sizes.choose(image, self.sizes or (self.input_spec.shape[1:3],), window=True)
        if choice.mode != sizes.WINDOW:
            return 0
        return len(tiling.window_origins(image, win.size or choice.size, win.overlap))

    def _run_windows(self, x: np.ndarray, outputs: Sequence[str] | None, choice: sizes.Choice) -> dict[str, Any]:
        """Images larger than every compiled size through the sliding window (runtime/tiling.py): ``mask``
        at each image's own size, ``probs`` only where ``outputs`` names it (4 C H W bytes an image)."""
        win = self.bundle.manifest.window
        assert win is not None
        size = win.size or choice.size
        if size not in (self.sizes or (self.input_spec.shape[1:3],)):
            raise InputError(f"window.size {sizes.label(size)} is not a compiled size; set it to one and rebuild")
        engine = self.at_size(size)
        engine._check((x.shape[0], *size, x.shape[3]), str(x.dtype))
        want_probs = outputs is not None and "probs" in outputs
        t0, spent, masks, probs, windows = time.perf_counter(), {"A": 0.0, "B": 0.0}, [], [], 0
        for image in x:
            t = tiling.Tiling.plan(image.shape[:2], win, size, win.batch or engine.batch_sizes[-1], engine.batch_sizes)
            answer = engine._tile(image, t, spent, probs=want_probs)
            masks.append(answer.mask)
            probs.append(answer.probs)
            windows += len(t.origins)
        self.last_windows, self.last_size = windows, choice
        total = (time.perf_counter() - t0) * 1e3
        self.last_timings = {"track_a_ms": spent["A"], "track_b_ms": spent["B"], "total_ms": total}
        out = {"mask": np.stack(masks)}
        return {**out, "probs": np.stack(probs)} if want_probs else out

    def _tile(self, image: np.ndarray, t: tiling.Tiling, spent: dict[str, float], *, probs: bool) -> tiling.Answer:
        """One image's windows through this engine (of the window's size): numpy on ``cpu``, the
        ``blend_nhwc`` kernels on ``cuda``; each track's time added to ``spent``."""
        probs_spec = next((o for o in self.output_specs if o.name == "probs"), None)
        if probs_spec is None or probs_spec.dtype != "float32" or probs_spec.shape[2:] != self.input_spec.shape[1:3]:
            raise InputError(
                f"{self.bundle.root} has no float32 (n, classes, H, W) `probs` output to blend windows of; "
                "rebuild it with `postprocess:`"
            )
        classes = probs_spec.shape[1]
        win = self.bundle.manifest.window
        assert win is not None
        if self.device != "cuda":

            def run(batch: np.ndarray) -> np.ndarray:
                out = self.run(batch, outputs=["probs"])["probs"]
                for k in spent:
                    spent[k] += self.backend.timings[k]
                return out

            return tiling.tile_numpy(image, t, run, classes, probs=probs)
        with self._lock:
            if self._tiler is None:
                self._tiler = tiling.GpuTiler(self.backend)
            for k in self.backend.timings:
                self.backend.timings[k] = 0.0
            answer = self._tiler.run(image, t, win, self.run_batch, classes, probs=probs)
            for k in spent:  # segment by segment only: a whole-inference graph is not timed per track
                spent[k] += self.backend.timings[k]
            return answer

    def at_size(self, size: sizes.Size) -> Engine:
        """The engine of one compiled input size of this bundle (itself for its own), loaded on first use
        on this engine's device; closed with this engine."""
        if size == self.input_spec.shape[1:3]:
            return self
        with self._at_size_lock:
            if size not in self._at_size:
                self._at_size[size] = Engine.load(self.bundle.at_size(size), self.device, self.device_index)
            return self._at_size[size]

    def _wanted(self, outputs: Sequence[str] | None) -> tuple[str, ...]:
        names = tuple(o.name for o in self.output_specs)
        if outputs is None:
            return names
        unknown = [o for o in outputs if o not in names]
        if unknown:
            raise InputError(f"no output named {unknown[0]!r}; this bundle's outputs are {', '.join(names)}")
        return tuple(outputs)

    def _run_on_device(self, x: Any) -> dict[str, Any]:
        if self.device != "cuda":
            raise InputError("a GPU tensor was given to a CPU engine; pass a numpy array or load with device='cuda'")
        from dualtrack.runtime import dlpack

        t = self.backend.import_tensor(x)  # type: ignore[attr-defined]
        n = self._check(t.shape, t.dtype.name)[0]
        if n not in self.batch_sizes:
            raise InputError(
                f"a GPU batch of {n} is not a compiled batch size {list(self.batch_sizes)}; pad it or pass numpy"
            )
        with self._lock:
            outs = self.run_batch(t, n)
            # The results are the caller's: out of the planned buffers the next run rewrites.
            outs = {k: self.backend.own(t) for k, t in outs.items()}  # type: ignore[attr-defined]
        dev = self.backend.device.index  # type: ignore[attr-defined]
        # Written on the engine's stream, which a consumer's own stream does not follow: the arrays carry
        # it, so their __dlpack__ waits for it (and __cuda_array_interface__ names it). Without it a torch
        # consumer copied the outputs before the inference had written them (zeros at 720x1280).
        stream = self.backend.stream  # type: ignore[attr-defined]
        return {
            k: dlpack.DeviceArray(t.ptr, t.shape, t.dtype, dev, t.keepalive, stream=stream) for k, t in outs.items()
        }

    # -- overlapped runs (runtime/overlap.py) ---------------------------------------------------------

    def stage(self, x: np.ndarray, fill: Fill | None = None) -> Staged:
        """Upload ``x`` (a compiled batch size of images, numpy; from :meth:`host_array` it is copied
        without staging) into a free device slot, for :meth:`launch`. On ``cuda`` the copy runs on an
        upload stream, beside whatever the compute stream runs, and is complete when this returns
        (``x`` is the caller's again); ``fill(stream, slot_tensor)`` may first write rows on the GPU
        (the service's JPEG decode) and returns them: those rows of ``x`` are not copied. Safe to
        call from one thread while another calls :meth:`launch`; waits while every slot is in use
        (until a :meth:`Submission.result` collects one). On ``cpu``: a copy of ``x``."""
        if self._closed:
            raise InputError("this engine is closed; load the bundle again")
        n = self.check_input(x)[0]
        if n not in self.batch_sizes:
            raise InputError(f"a staged batch of {n} is not a compiled batch size {list(self.batch_sizes)}; pad it")
        if self.device != "cuda":
            if fill is not None:
                raise InputError("fill writes rows on the GPU: stage on a cuda engine")
            return Staged(0, np.array(x, copy=True), n)
        if self._overlap is None:
            with self._lock:
                if self._overlap is None:
                    self._overlap = Overlap(self.backend)  # type: ignore[arg-type]
        x = np.ascontiguousarray(x)
        ordered = fill is not None and self.backend.runs_on_stream(n)  # type: ignore[attr-defined]
        return self._overlap.stage(x, np.dtype(self.input_spec.dtype), fill, device_ordered=ordered)

    def wait_staged(self, staged: Staged) -> None:
        """Wait until the GPU has passed what :meth:`stage` queued for ``staged`` (its ``fill``'s
        work): a caller that drops a ``pending`` staged batch unlaunched frees what it read after this."""
        if self._overlap is not None and staged.pending:
            self._overlap.wait_staged(staged)

    def launch(
        self,
        staged: Staged,
        outputs: Sequence[str] | None = None,
        *,
        into: Mapping[str, Sequence[np.ndarray | None]] | None = None,
    ) -> Submission:
        r"""Run the plan on a :meth:`stage`\ d batch; the outputs named (default: all) come back
        through :meth:`Submission.result` as new numpy arrays, as :meth:`run` returns them. On
        ``cuda`` this returns once the compute is queued and the outputs' download is queued on a
        download stream: collect the result while the next batch runs. Launch staged batches in
        the order they were staged, on one thread.

        ``into`` names outputs to write row by row into the caller's arrays instead (one per row
        of the staged batch, ``None`` for a row not wanted; each of the output's row shape and
        dtype, C-contiguous). On ``cuda`` they must lie in memory :meth:`pin_host` registered:
        the rows go there straight from the GPU, and are there once ``Submission.result()`` has
        returned (which then leaves those outputs out). An ``into`` array must not be read or
        written until then."""
        wanted = self._wanted(outputs)
        into = dict(into or {})
        try:
            self._check_into(into, wanted, staged.n)
            addresses = {name: [self._pinned_address(d) for d in rows] for name, rows in into.items()}
        except InputError:
            if self._overlap is not None:
                self._overlap.ring.abandon(staged.slot)  # the staged batch will not run: its slot is free
            raise
        if self.device != "cuda":
            result = self.run(staged.x, outputs=wanted)
            for name, rows in into.items():
                for row, dst in zip(result.pop(name), rows, strict=False):
                    if dst is not None:
                        dst[...] = row
            return Submission(lambda: result)
        with self._lock:
            t0 = time.perf_counter()
            for k in self.backend.timings:
                self.backend.timings[k] = 0.0
            name = self.input_spec.name
            submission = self._overlap.launch(  # nobody reads a launch's graph time: no timing events
                staged,
                lambda x, n: self.backend.run_plan(n, {name: x}, timed=False),
                wanted,
                addresses,
                device_ordered=self.backend.runs_on_stream(staged.n),  # type: ignore[attr-defined]
            )
            self.last_timings = {
                "track_a_ms": self.backend.timings["A"],
                "track_b_ms": self.backend.timings["B"],
                "total_ms": (time.perf_counter() - t0) * 1e3,
            }
        return submission

    def _check_into(self, into: Mapping[str, Sequence[np.ndarray | None]], wanted: tuple[str, ...], n: int) -> None:
        specs = {s.name: s for s in self.output_specs}
        for name, rows in into.items():
            if name not in wanted:
                raise InputError(f"into names {name!r}, which is not among the outputs asked for {list(wanted)}")
            if len(rows) != n:
                raise InputError(f"into[{name!r}] has {len(rows)} rows for a staged batch of {n}")
            spec = specs[name]
            shape, dtype = tuple(spec.shape[1:]), np.dtype(spec.dtype)
            for dst in rows:
                if dst is not None and (dst.shape != shape or dst.dtype != dtype or not dst.flags.c_contiguous):
                    raise InputError(
                        f"into[{name!r}] holds a {dst.dtype}{list(dst.shape)} array; each row must be a C-contiguous "
                        f"{dtype}{list(shape)}"
                    )

    def _pinned_address(self, dst: np.ndarray | None) -> int | None:
        if dst is None or self.device != "cuda":
            return None
        ptr = int(dst.ctypes.data)
        if not dst.flags.writeable or not any(r.holds(ptr, dst.nbytes) for r in self._pinned):
            raise InputError("an into array must be writable memory registered with Engine.pin_host on this engine")
        return ptr

    def pin_host(self, array: np.ndarray) -> PinnedRange | None:
        """Page-lock ``array`` (host memory the caller keeps mapped, e.g. a shared file) so that
        :meth:`launch` may write outputs into it directly; ``None`` on ``cpu``, where nothing needs
        it. Close the returned range (or this engine) before unmapping the memory. Raises
        :class:`~dualtrack.errors.CudaError` when the driver refuses the memory."""
        if self._closed:
            raise InputError("this engine is closed; load the bundle again")
        if self.device != "cuda":
            return None
        self.backend.ctx.make_current()  # type: ignore[attr-defined]
        pinned = PinnedRange(self.backend.ctx, array)  # type: ignore[attr-defined]
        self._pinned = [r for r in self._pinned if r.alive] + [pinned]
        return pinned

    def signal(self, marks: Sequence[tuple[int, int]], calls: Sequence[tuple[int, int]] = ()) -> None:
        """Queue behind every :meth:`launch` so far: a 64-bit store of each ``(address, value)`` of
        ``marks``, then a call of each ``(C function address, argument)`` of ``calls``.

        The stores are made by the GPU once it has passed those launches, after a fence: a host
        that reads a mark's value there may read every output written before it (the ``into`` rows
        included). The addresses must be 8-byte aligned, in memory :meth:`pin_host` registered.
        The calls run on the driver's own thread, no thread of this process woken: a function
        that never blocks and touches no CUDA API (``sem_post`` of a process-shared semaphore, which
        wakes another process as soon as the GPU is there). The last launch's
        :meth:`Submission.result` returns only once the GPU has passed them too: until then the
        marked memory and the calls' arguments must stay valid. On ``cpu``, where a launch has run
        when it returns, the stores and the calls are made here and now.

        Raises :class:`~dualtrack.errors.CudaError` where the driver refuses them (then nothing
        may be assumed of what was queued) and :class:`~dualtrack.errors.InputError` for an
        address outside the registered memory."""
        if self._closed:
            raise InputError("this engine is closed; load the bundle again")
        for address, _ in marks:
            if address % 8:
                raise InputError(f"mark address {address:#x} is not 8-byte aligned")
        if self.device != "cuda":
            for address, value in marks:
                ctypes.c_uint64.from_address(address).value = value
            for fn, arg in calls:
                _HOST_FN(fn)(arg)
            return
        targets = []
        for address, value in marks:
            pinned = next((r for r in self._pinned if r.holds(address, 8)), None)
            if pinned is None:
                raise InputError("a mark address must lie in memory registered with Engine.pin_host on this engine")
            targets.append((pinned.device_address(address), value))
        held = held_calls()
        if held is None or not (held.has("cuStreamWriteValue64") and held.has("cuLaunchHostFunc")):
            raise CudaError("cuStreamWriteValue64", "CUDA_ERROR_NOT_SUPPORTED", "needs libcuda through ctypes")
        with self._lock:
            be = self.backend
            be.ctx.make_current()  # type: ignore[attr-defined]
            for address, value in targets:
                held.write_value(be.stream.handle, address, value)  # type: ignore[attr-defined]
            for fn, arg in calls:
                held.host_call(be.stream.handle, fn, arg)  # type: ignore[attr-defined]
            if self._overlap is not None:
                self._overlap.cover_last()

    def submit(self, x: np.ndarray, outputs: Sequence[str] | None = None) -> Submission:
        """:meth:`stage` then :meth:`launch`: ``submit(x).result()`` is ``run(x)`` for a compiled batch size."""
        return self.launch(self.stage(x), outputs)

    def host_array(self, n: int) -> np.ndarray:
        """A zeroed ``(n, *input.shape[1:])`` input array for :meth:`run`, to fill in place.

        On ``cuda`` it is page-locked memory that ``run`` uploads from directly, without first
        copying it into its own staging buffer (for a batch of 8 512x512 images, 6 MiB less to copy
        per run). It belongs to the engine: valid until :meth:`close`, not to be used after it.
        Safe to call from any thread.
        """
        if self._closed:
            raise InputError("this engine is closed; load the bundle again")
        return self.backend.host_array(self.input_spec.at_batch(n), self.input_spec.dtype)

    def warmup(self) -> None:
        """Load every module and run each compiled batch size once, so the first request pays nothing."""
        rng = np.random.default_rng(0)
        for b in self.batch_sizes:
            x = rng.integers(0, 255, size=self.input_spec.at_batch(b)).astype(self.input_spec.dtype)
            self.run(x)
        for size in self.sizes:
            if self.at_size(size) is not self:
                self.at_size(size).warmup()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for engine in self._at_size.values():
                engine.close()
            if self._tiler is not None:
                self._tiler.close()  # its weights and kernels before the backend's context
            if self._overlap is not None:
                self._overlap.close()  # its buffers and streams before the backend's context
            for pinned in self._pinned:
                pinned.close()
            self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
