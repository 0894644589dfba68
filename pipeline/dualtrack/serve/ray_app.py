"""``dualtrack serve --backend ray``: the service as a Ray Serve application, one engine per replica.

The only module of dualtrack that imports ``ray`` (the ``ray`` extra). Two layouts
(:class:`~dualtrack.serve.ray_config.RayAppOptions`' ``ingress_replicas``); measured in docs/ray.md.

- **0 (the default): the model replicas answer HTTP.** **DualtrackModel** (:class:`ServingReplica`,
  ``replicas``, or autoscaled between ``autoscale`` bounds) runs the HTTP app of ``dualtrack serve``
  (:func:`dualtrack.serve.app.assemble`) around its own engine and
  :class:`~dualtrack.serve.batcher.Batcher`: a request reaches the engine with no deployment-handle
  hop, and its JPEG is decoded there, on the replica's GPU where the direct service decodes it there.
  With Ray Serve's throughput settings (:data:`~dualtrack.serve.ray_config.THROUGHPUT_ENV`, which a
  local instance starts with) each replica runs its own HTTP server and HAProxy on every node sends
  the Serve port's requests straight to them: no Python proxy either.
- **N: CPU ingress replicas in front.** **DualtrackIngress** (``ingress_replicas``, scaled apart from
  the model) runs the same HTTP app with a :class:`ModelClient` in place of the batcher and decodes
  the images itself, or sends a JPEG the GPU takes as its bytes (``run_jpeg``); the model replicas
  (:class:`ModelReplica`) answer those calls. One more hop per request, for a GPU whose replica's
  CPU cannot keep up with its requests.

On ``cuda`` a model replica asks Ray for one GPU (``num_gpus=1``; 1/K with ``replicas_per_gpu`` K, K
replica processes to a GPU, each with its own primary context on it): Ray sets ``CUDA_VISIBLE_DEVICES``
to that GPU, so the engine opens device 0 of the replica and owns its primary context. The
constructor loads the bundle and warms it up before it returns, so Ray routes to a replica only once
it is warm; a bundle that fails to load raises there, and Ray reports the deployment unhealthy
(``DEPLOY_FAILED``) with that reason. ``check_health`` fails a replica whose engine failed later, and
Ray replaces it. **DualtrackMetrics** (one replica, no CPU reserved) is the service's one Prometheus
registry (:class:`~dualtrack.serve.metrics.ServeMetrics`), fed by every replica (requests, latency,
batches, queue depth) the way ``--workers`` feeds the engine process's, so ``/metrics`` on any replica
is the whole service's; ``/readyz``'s ``devices`` lists where each live model replica's engine runs
(its process, ``CUDA_VISIBLE_DEVICES``, and the GPU's name, PCI bus id, UUID and primary contexts as
the replica's driver reports them: :mod:`dualtrack.serve.placement`), so a deployment can check that
no two replicas share a GPU. Every deployment-handle call is made on the calling replica's event loop
(:func:`on_loop`): under the throughput settings Ray's router runs there and refuses other threads.

Faults. Behind ingress replicas, a request in flight on a model replica that dies fails with Ray's
actor error, answered 503 with ``Retry-After`` (the client retries; Ray restarts the replica and
routes new requests to the live ones): never a hang, never another request's mask; ``/readyz`` is
200 while at least one model replica runs, 503 with Ray's reason when none can (``engine failed to
load: ...``). Where the model replicas answer HTTP, the requests a dying replica held are answered
500 by Ray's HTTP layer (plain text; measured with HAProxy, docs/ray.md), never another request's
mask, and new requests go to the live replicas; a deployment that cannot start is reported by
``dualtrack serve`` itself (:func:`failure_error`).

Batching: dualtrack's :class:`~dualtrack.serve.batcher.Batcher` inside the replica, not Ray's
``@serve.batch``. Measured on the CPU (``bench/ray_batching.py``: tiny bundle, one replica each, 16
callers through a handle, two alternating 8 s rounds; ``bench/results/ray_batching-f98ee57f44.json``)
the batcher answered 99 and 117 requests/s, ``@serve.batch`` 111 and 82: the same within the noise
of a shared 2-core machine, because the CPU engine's run dominates both. The batcher is kept
because it is the policy ``dualtrack serve`` has (the delay counted from the oldest request, the
smallest compiled size that holds the rows), it copies each image straight into its row of the
engine's page-locked host array (``@serve.batch`` hands over a list that must be stacked into a new
array: one more copy of every image, on the path the GPU waits for), it decodes JPEGs on the GPU
with their batch, and it keeps every engine call on one thread, the one that owns the CUDA context.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from dualtrack import errors, imaging
from dualtrack.errors import BundleError, DeviceError, DualtrackError
from dualtrack.serve.batcher import Batcher, BatchResult, NotReadyError, Phase, QueueFullError, QueueState
from dualtrack.serve.metrics import ServeMetrics
from dualtrack.serve.protocol import EngineInfo, Failed, LatencyObserved, Observation, RequestObserved
from dualtrack.serve.ray_config import APP_NAME, THROUGHPUT_ENV, RayAppOptions, throughput_env

MODEL = "DualtrackModel"
INGRESS = "DualtrackIngress"
METRICS = "DualtrackMetrics"
FLUSH_S = 0.25  # how often replicas send what they observed to the metrics deployment
WATCH_S = 0.5  # how often an ingress replica reads the model deployment's state from Ray
_STALE_S = 10 * FLUSH_S  # a model replica that has not reported for this long no longer counts in the queue depth
_RAISED = re.compile(r"^dualtrack\.errors\.(\w+): (.+)$", re.MULTILINE)  # the last line of a replica's traceback
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchObserved:
    """One engine run of a model replica, for the batch metrics (the rows' results without masks)."""

    queue_ms: tuple[float, ...]  # each row's wait
    batch_size: int
    padded_size: int
    run_ms: float
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, results: list[BatchResult]) -> BatchObserved:
        first = results[0]
        return cls(tuple(r.queue_ms for r in results), first.batch_size, first.padded_size, first.run_ms, first.timings)

    def results(self) -> list[BatchResult]:
        empty = np.empty((0, 0), np.uint8)
        return [
            BatchResult(empty, self.batch_size, self.padded_size, q, self.run_ms, self.timings) for q in self.queue_ms
        ]


def on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[], Any]) -> Future[Any]:
    """``call()`` (a deployment handle's ``.remote(...)``) made and awaited on ``loop``, the replica's
    event loop, from any thread: with Ray Serve's throughput settings a replica's router runs on that
    loop and refuses calls from other threads."""

    async def run() -> Any:
        return await call()

    return asyncio.run_coroutine_threadsafe(run(), loop)


def _warn_unsent(sent: Future[Any]) -> None:
    if sent.exception() is not None:
        _log.warning("could not send metrics: %s", sent.exception())


class _Observer:
    """Buffers a replica's observations and sends them to the metrics deployment every FLUSH_S.
    Made in a replica's constructor, which Ray runs on the replica's event loop."""

    def __init__(self, metrics: DeploymentHandle, depth: Any = None) -> None:
        self._metrics = metrics
        self.loop = asyncio.get_running_loop()
        self._depth = depth  # a model replica's queue depth, sent with every flush
        self.placement: dict[str, Any] | None = None  # a model replica's engine placement, likewise
        self._replica = f"{os.uname().nodename}:{os.getpid()}"
        self._buffer: list[Observation | BatchObserved] = []
        self._sent_depth: int | None = None
        self._sent_at = 0.0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._flush_periodically, name="dualtrack-metrics", daemon=True).start()

    def observe(self, observation: Observation | BatchObserved) -> None:
        with self._lock:
            self._buffer.append(observation)

    def flush(self) -> None:
        with self._lock:
            batch, self._buffer = tuple(self._buffer), []
        depth = None if self._depth is None else self._depth()
        # An idle model replica still reports its depth now and then, or it would count as gone.
        due = depth is not None and (depth != self._sent_depth or time.monotonic() - self._sent_at > _STALE_S / 2)
        if (batch or due) and not self.loop.is_closed():  # closed: the replica is being torn down
            self._sent_depth, self._sent_at = depth, time.monotonic()
            # Fire and forget: a metrics replica being restarted must not fail a request.
            sent = on_loop(self.loop, lambda: self._metrics.record.remote(batch, self._replica, depth, self.placement))
            sent.add_done_callback(_warn_unsent)

    def close(self) -> None:
        self._stopped.set()
        self.flush()

    def _flush_periodically(self) -> None:
        while not self._stopped.wait(FLUSH_S):
            self.flush()


# --- the model deployment ------------------------------------------------------------------------


class ModelReplica:
    """One engine and its batcher. ``run`` answers a :class:`BatchResult` or a :class:`Failed`."""

    def __init__(self, options: RayAppOptions, metrics: DeploymentHandle) -> None:
        device_index = 0
        if options.device == "cuda" and not ray.get_gpu_ids():
            raise DeviceError("this model replica was given no GPU: deploy it with ray_actor_options num_gpus=1")
        settled = threading.Event()
        self.batcher = Batcher(
            options.bundle,
            max_batch_delay_s=options.max_batch_delay_ms / 1e3,
            batches_in_flight=options.batches_in_flight,
            max_queue=options.max_ongoing_requests,
            device=options.device,
            device_index=device_index,  # CUDA_VISIBLE_DEVICES holds only this replica's GPU
            on_batch=lambda results: self.observer.observe(BatchObserved.of(results)),
            on_phase=lambda phase, _error: settled.set() if phase is not Phase.WARMING else None,
        )
        self.observer = _Observer(metrics, depth=lambda: self.batcher.depth)
        self.batcher.start()
        settled.wait()
        if self.batcher.phase is not Phase.READY:
            self.observer.close()
            # Raised from the constructor: Ray retries the replica, then marks the deployment
            # DEPLOY_FAILED with this message, which the ingress's /readyz reports.
            raise BundleError(self.batcher.error or f"engine is {self.batcher.phase.value}")
        assert self.batcher.engine is not None
        self.info_ = replace(EngineInfo.of(self.batcher.engine, placed=True), decoder=self.batcher.decoder)
        # Sent with every flush (a restarted metrics replica learns it again): the ingress's /readyz
        # lists every live replica's device from the metrics replica.
        self.observer.placement = self.info_.devices[0]

    def info(self) -> EngineInfo:
        return self.info_

    async def run(self, image: np.ndarray) -> BatchResult | Failed:
        return await self._answer(lambda: self.batcher.submit(image))

    async def run_jpeg(self, data: bytes, stored: tuple[int, int], orientation: int) -> BatchResult | Failed:
        """A JPEG that :func:`dualtrack.imaging.route_jpeg` gave the GPU, as its bytes (64 KB where
        ``run``'s decoded image is 768 KB: small enough for Ray to pass inline, not through its
        object store): decoded on this replica's GPU with its batch, or here on the CPU where this
        replica's decoder is not ``gpu``."""
        jpeg = imaging.GpuJpeg(data, stored, orientation)
        if self.batcher.decoder[0] == "gpu":
            return await self._answer(lambda: self.batcher.submit_jpeg(jpeg))
        _, height, width, _ = self.info_.input_spec.shape
        try:
            pixels = await asyncio.to_thread(lambda: imaging.load_for_model(data, height, width).pixels)
        except DualtrackError as err:
            return Failed.of(0, err)
        return await self._answer(lambda: self.batcher.submit(pixels))

    async def _answer(self, submit: Callable[[], Future[BatchResult]]) -> BatchResult | Failed:
        try:
            future = submit()
        except DualtrackError as err:
            return Failed.of(0, err)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the caller cancelled (its client went away): free the row
            future.cancel()
            raise
        except DualtrackError as err:
            return Failed.of(0, err)

    def check_health(self) -> None:
        if self.batcher.phase is not Phase.READY:
            raise NotReadyError(self.batcher.error or f"engine is {self.batcher.phase.value}")

    def __del__(self) -> None:
        batcher = getattr(self, "batcher", None)
        if batcher is not None:
            batcher.close(30.0)
        observer = getattr(self, "observer", None)
        if observer is not None:
            observer.close()


# --- the metrics deployment ----------------------------------------------------------------------


class MetricsReplica:
    """The service's one registry: what every replica observed, and the model replicas' queue depth."""

    def __init__(self) -> None:
        self._depths: dict[str, tuple[int, float]] = {}  # replica -> (queue depth, when reported)
        self._placements: dict[str, dict[str, Any]] = {}  # replica -> where its engine runs
        self._ready = False
        self.metrics = ServeMetrics(queue_depth=self._queue_depth, ready=lambda: self._ready)

    def record(
        self,
        batch: tuple[Observation | BatchObserved, ...],
        replica: str,
        depth: int | None,
        placement: dict[str, Any] | None = None,
    ) -> None:
        if depth is not None:
            self._depths[replica] = (depth, time.monotonic())
        if placement is not None:
            self._placements[replica] = placement
        for observation in batch:
            match observation:
                case RequestObserved(endpoint, code):
                    self.metrics.observe_request(endpoint, code)
                case LatencyObserved(seconds):
                    self.metrics.observe_latency(seconds)
                case BatchObserved():
                    self.metrics.observe_batch(observation.results())

    def exposition(self, ready: bool) -> bytes:
        """The Prometheus text; ``ready`` is the asking ingress replica's view (``/readyz`` is 200)."""
        self._ready = ready
        return self.metrics.exposition()

    def queue_depths(self) -> dict[str, int]:
        """Requests waiting in each live model replica's batcher, by ``host:pid`` (``dualtrack_queue_depth``
        is their sum): which replica holds the queue."""
        now = time.monotonic()
        return {replica: depth for replica, (depth, when) in self._depths.items() if now - when < _STALE_S}

    def placements(self) -> tuple[dict[str, Any], ...]:
        """Where each live model replica's engine runs (:mod:`dualtrack.serve.placement`), by replica."""
        live = self.queue_depths()  # a replica that stopped reporting its depth is gone
        self._placements = {replica: where for replica, where in self._placements.items() if replica in live}
        return tuple(self._placements[replica] for replica in sorted(self._placements))

    def _queue_depth(self) -> int:
        return sum(self.queue_depths().values())


# --- the ingress deployment ----------------------------------------------------------------------


class ModelClient(QueueState[EngineInfo]):
    """The ingress app's :class:`~dualtrack.serve.batcher.BatchQueue`: requests go to the model deployment.

    ``phase`` follows Ray's view of the model deployment (read every :data:`WATCH_S`): ``READY``
    while a replica runs, ``FAILED`` with Ray's message when none runs and Ray has given up or
    reports it unhealthy, ``LOADING`` before. The errors of ``submit`` and its future are the
    batcher's, so the app answers them the same way; a replica that died under a request is
    :class:`NotReadyError` (503).
    """

    def __init__(self, model: DeploymentHandle, metrics: DeploymentHandle, app_name: str) -> None:
        self._model = model
        self._app_name = app_name
        self._inflight = 0
        self._inflight_lock = threading.Lock()  # changed on image threads and on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self.observer = _Observer(metrics)
        self._metrics = metrics

    @property
    def depth(self) -> int:
        """This ingress replica's requests sent to the model deployment and not yet answered."""
        return self._inflight

    def start(self) -> None:
        # Called by the app's lifespan, on the replica's event loop: requests are sent from there.
        self._loop = asyncio.get_running_loop()
        self._watcher = self._loop.create_task(self._watch())

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests; wait up to ``timeout`` s for this replica's requests to be answered."""
        self._closing = True
        self._phase = Phase.CLOSED
        if self._loop is not None and self._watcher is not None:
            self._loop.call_soon_threadsafe(self._watcher.cancel)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._inflight and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)
        self.observer.close()
        return not self._inflight

    @property
    def decoder(self) -> tuple[str, str]:
        """The model replicas' JPEG decoder as the first one reported it: ``gpu`` makes the app send
        the JPEGs that route_jpeg gives the GPU as bytes (:meth:`submit_jpeg`)."""
        engine = self._engine
        return engine.decoder if engine is not None else ("cpu", "no model replica has reported yet")

    def submit(self, image: np.ndarray) -> Future[BatchResult]:
        # The image's shape is checked by the replica's batcher (an InputError comes back as Failed).
        image = image.copy()
        return self._send(lambda: self._model.run.remote(image))

    def submit_jpeg(self, jpeg: imaging.GpuJpeg) -> Future[BatchResult]:
        """Send the JPEG's bytes and header to a model replica (``ModelReplica.run_jpeg``)."""
        return self._send(lambda: self._model.run_jpeg.remote(jpeg.data, jpeg.stored, jpeg.orientation))

    def _send(self, remote: Callable[[], Any]) -> Future[BatchResult]:
        loop = self._loop
        if self._phase is not Phase.READY or loop is None:
            raise self._not_ready()
        with self._inflight_lock:
            self._inflight += 1
        # Cancelling the returned future cancels the task, which withdraws the request (_run).
        return asyncio.run_coroutine_threadsafe(self._run(remote), loop)

    async def _run(self, remote: Callable[[], Any]) -> BatchResult:
        response = remote()
        try:
            reply = await response
        except asyncio.CancelledError:
            # DeploymentResponse.cancel() may wait for the request to be assigned where the router runs
            # on a loop of its own (Ray's default): not on this loop. Where it runs on this one (the
            # throughput settings), cancel() only cancels futures, and must be called here.
            if getattr(response, "_is_router_running_in_separate_loop", True):
                asyncio.get_running_loop().run_in_executor(None, response.cancel)
            else:
                response.cancel()
            raise
        except BackPressureError:
            raise QueueFullError(
                "request queue is full (every model replica is busy and max_queue requests wait): retry shortly, "
                "raise max_queue or add replicas"
            ) from None
        except (RayActorError, TaskCancelledError) as err:
            raise NotReadyError(f"the model replica running this request died ({type(err).__name__}); retry") from None
        except ray.exceptions.RayError as err:
            raise DualtrackError(f"the model deployment failed on this request: {err}") from None
        finally:
            with self._inflight_lock:
                self._inflight -= 1
        if isinstance(reply, Failed):
            raise reply.error()
        return reply

    async def _watch(self) -> None:
        """Follow the model deployment's state in Ray; fetch the engine's specs once a replica runs."""
        while not self._closing:
            try:
                running, status, message = await asyncio.to_thread(model_status, self._app_name)
                if running and self._engine is None:
                    self._engine = await self._model.info.remote()
                if running and self._engine is not None:
                    devices = await self._metrics.placements.remote()
                    if devices and devices != self._engine.devices:
                        self._engine = replace(self._engine, devices=devices)
                if running and self._engine is not None:
                    self._error, self._phase = "", Phase.READY
                elif status in ("DEPLOY_FAILED", "UNHEALTHY") and message:
                    self._error, self._phase = failure_reason(status, message), Phase.FAILED
                elif self._phase is Phase.READY:
                    self._error, self._phase = "no model replica is running (Ray is starting one)", Phase.LOADING
            except asyncio.CancelledError:
                raise
            except Exception as err:  # Ray's controller unreachable for a moment: keep the last state
                _log.warning("could not read the model deployment's state: %s", err)
            await asyncio.sleep(WATCH_S)

    # --- what RemoteMetrics calls (dualtrack.serve.shared): the service's one registry --------------

    def observe(self, observation: Observation) -> None:
        self.observer.observe(observation)

    def flush(self) -> None:
        self.observer.flush()

    def ask(self, what: str) -> Future[bytes]:
        """``"metrics"``: the whole service's Prometheus text, from the metrics deployment."""
        if what != "metrics":
            raise ValueError(f"the metrics deployment answers 'metrics', not {what!r}")
        return ask_metrics(self._metrics, self._phase is Phase.READY, self.observer.loop)


def ask_metrics(metrics: DeploymentHandle, ready: bool, loop: asyncio.AbstractEventLoop) -> Future[bytes]:
    """The whole service's Prometheus text from the metrics deployment, asked on the replica's event
    ``loop``; ``ready``: the asking replica's ``/readyz`` is 200."""
    future: Future[bytes] = Future()

    def done(asked: Future[bytes]) -> None:
        err = asked.exception()
        if err is None:
            future.set_result(asked.result())
        else:
            future.set_exception(DualtrackError(f"the metrics deployment did not answer: {err}"))

    on_loop(loop, lambda: metrics.exposition.remote(ready)).add_done_callback(done)
    return future


def model_status(app_name: str) -> tuple[int, str, str]:
    """The model deployment of application ``app_name``: running replicas, Ray's status and message."""
    app = serve.status().applications.get(app_name)
    deployment = app.deployments.get(MODEL) if app is not None else None
    if deployment is None:
        return 0, "", ""
    return int(deployment.replica_states.get("RUNNING", 0)), str(deployment.status.value), deployment.message


def failure_reason(status: str, message: str) -> str:
    """Why the model deployment cannot serve, in one line: the dualtrack error a replica raised
    (``engine failed to load: ...``) when Ray's message (a replica's traceback) carries one."""
    return str(failure_error(status, message))


def failure_error(status: str, message: str) -> DualtrackError:
    """:func:`failure_reason` as the error a replica raised (its class, hence its exit code)."""
    found = _RAISED.findall(message)
    if found:
        name, reason = found[-1]
        cls = getattr(errors, name, DualtrackError)
        return (cls if isinstance(cls, type) and issubclass(cls, DualtrackError) else DualtrackError)(reason.strip())
    return DualtrackError(f"the model deployment is {status}: {' '.join(message.split())}")


class IngressReplica:
    """The HTTP app of ``dualtrack serve`` in front of the model deployment (built per replica)."""

    def __init__(self, model: DeploymentHandle, metrics: DeploymentHandle, options: RayAppOptions) -> None:
        self.client = ModelClient(model, metrics, serve.get_replica_context().app_name)
        self.options = options

    def __serve_build_asgi_app__(self) -> Any:
        from dualtrack.serve.app import assemble
        from dualtrack.serve.shared import RemoteMetrics

        return assemble(self.client, RemoteMetrics(self.client), self.options.serve_options())  # type: ignore[arg-type]


# --- the model replica as its own HTTP ingress (ingress_replicas=0, the default) ------------------


class ReplicaQueue:
    """A serving replica's batcher as its HTTP app sees it (the app's ``BatchQueue`` and
    ``RemoteMetrics``' client): already started, since the replica's constructor warmed it up before
    Ray routed here; ``engine`` the replica's :class:`EngineInfo` with every live replica's device
    (read from the metrics deployment every :data:`WATCH_S`, as an ingress replica does); and the
    app's observations sent with the batches' to the service's one registry."""

    def __init__(self, replica: ModelReplica, metrics: DeploymentHandle) -> None:
        self._replica = replica
        self._batcher = replica.batcher
        self._metrics = metrics
        self._info = replica.info_
        self._stopped = threading.Event()

    def __getattr__(self, name: str) -> Any:  # phase, error, decoder, depth, submit, submit_jpeg
        return getattr(self._batcher, name)

    @property
    def engine(self) -> EngineInfo:
        return self._info

    def start(self) -> None:
        threading.Thread(target=self._watch, name="dualtrack-devices", daemon=True).start()

    def close(self, timeout: float | None = None) -> bool:
        self._stopped.set()
        return self._batcher.close(timeout)

    def observe(self, observation: Observation) -> None:
        self._replica.observer.observe(observation)

    def flush(self) -> None:
        self._replica.observer.flush()

    def ask(self, what: str) -> Future[bytes]:
        """``"metrics"``: the whole service's Prometheus text, from the metrics deployment."""
        if what != "metrics":
            raise ValueError(f"the metrics deployment answers 'metrics', not {what!r}")
        return ask_metrics(self._metrics, self._batcher.phase is Phase.READY, self._replica.observer.loop)

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_S):
            try:
                devices = on_loop(self._replica.observer.loop, lambda: self._metrics.placements.remote()).result(10)
            except Exception as err:  # the metrics replica being restarted: keep the last list
                _log.warning("could not read the replicas' devices: %s", err)
                continue
            if devices and devices != self._info.devices:
                self._info = replace(self._info, devices=devices)


class ServingReplica(ModelReplica):
    """A model replica that answers HTTP itself: the app of ``dualtrack serve`` around its own
    batcher, so a request reaches the engine with no deployment-handle hop (Ray's proxy, or with
    :data:`~dualtrack.serve.ray_config.THROUGHPUT_ENV` HAProxy, sends it straight here). The images
    are decoded here, on the replica's GPU where the direct service decodes them there."""

    def __init__(self, options: RayAppOptions, metrics: DeploymentHandle) -> None:
        super().__init__(options, metrics)
        self.options = options
        self.queue = ReplicaQueue(self, metrics)

    def __serve_build_asgi_app__(self) -> Any:
        from dualtrack.serve.app import assemble
        from dualtrack.serve.shared import RemoteMetrics

        return assemble(self.queue, RemoteMetrics(self.queue), self.options.serve_options())  # type: ignore[arg-type]


# --- the application -----------------------------------------------------------------------------


def build_app(options: RayAppOptions) -> serve.Application:
    """The Ray Serve application for ``options`` (``serve.run(build_app(...))``): the model replicas
    answer HTTP themselves (``ingress_replicas=0``) or behind that many CPU ingress replicas."""
    options = options.resolved()
    metrics_app = serve.deployment(
        MetricsReplica,
        name=METRICS,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=0.5,
        logging_config={"enable_access_log": False},  # a line per flush of every replica otherwise
    ).bind()
    if not options.ingress_replicas:
        return _model_deployment(options, serve.ingress()(ServingReplica)).bind(options, metrics_app)
    ingress = serve.deployment(
        serve.ingress()(IngressReplica),
        name=INGRESS,
        num_replicas=options.ingress_replicas,
        ray_actor_options={"num_cpus": 1},
        # An ingress replica holds requests while their images decode and their batch runs.
        max_ongoing_requests=options.max_queue + options.max_ongoing_requests,
        graceful_shutdown_timeout_s=options.shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,  # Ray polls for in-flight requests this often (2 s by default)
    )
    return ingress.bind(_model_deployment(options, ModelReplica).bind(options, metrics_app), metrics_app, options)


def _model_deployment(options: RayAppOptions, cls: type) -> serve.Deployment:
    """The model deployment: ``replicas`` (or autoscaled) replicas of ``cls``, one GPU each on cuda."""
    if options.autoscale is not None:
        low, high = options.autoscale
        scaling: dict[str, Any] = {
            "autoscaling_config": {
                "min_replicas": low,
                "max_replicas": high,
                "initial_replicas": max(low, 1),
                # A replica is "busy" at half of what it may hold (one full batch running, one gathering
                # behind an ingress deployment).
                "target_ongoing_requests": options.max_ongoing_requests // 2,
            }
        }
    else:
        scaling = {"num_replicas": options.replicas}
    gpu = {"num_gpus": 1 / options.replicas_per_gpu} if options.device == "cuda" else {}
    return serve.deployment(
        cls,
        name=MODEL,
        ray_actor_options={"num_cpus": 1, **gpu},
        # Ray's default (5) would cap the rows a batch can gather: sized from the batch (RayAppOptions).
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queue,
        health_check_period_s=2,
        graceful_shutdown_timeout_s=options.shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        **scaling,
    )


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The ``import_path`` of a Ray Serve config (``dualtrack ray-config`` writes one): ``args`` are
    :class:`~dualtrack.serve.ray_config.RayAppOptions`' fields."""
    return build_app(RayAppOptions.from_args(args))


def run_service(
    options: RayAppOptions, *, host: str, port: int, address: str | None, echo: Callable[[str], None]
) -> None:
    """``dualtrack serve --backend ray``: deploy, answer on ``host:port`` until SIGINT/SIGTERM, then undeploy.

    ``address`` (or ``RAY_ADDRESS``) names a running cluster (``ray start``); without either, a
    local Ray instance is started and shut down here. A model deployment that cannot start raises
    the error its replica raised (a bad bundle: :class:`~dualtrack.errors.BundleError`). A local
    instance starts with Ray Serve's throughput settings where HAProxy is installed
    (:func:`~dualtrack.serve.ray_config.throughput_env`, each unless the environment sets it:
    ``RAY_SERVE_THROUGHPUT_OPTIMIZED=0`` turns them off); a cluster has the ones its ``ray start`` had.
    """
    options = options.resolved()
    local = address is None and not os.environ.get("RAY_ADDRESS")
    models = options.autoscale[1] if options.autoscale else options.replicas
    if local:
        for name, value in throughput_env().items():  # read by the processes ray.init starts, not by this one
            os.environ.setdefault(name, value)
        # Logical CPUs: a replica reserves one while it mostly waits, so a laptop with fewer cores
        # than replicas still runs them all (they share the cores) instead of waiting forever.
        ray.init(num_cpus=max(os.cpu_count() or 1, options.ingress_replicas + models), include_dashboard=False)
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus < options.gpus_needed(models):
            ray.shutdown()
            raise DeviceError(
                f"{models} model replicas ({options.replicas_per_gpu} a GPU) need {options.gpus_needed(models)} "
                f"GPUs, this machine has {gpus:.0f}: lower --replicas (or the --autoscale maximum), raise "
                "--replicas-per-gpu, or pass --ray-address of a cluster with more"
            )
    else:
        ray.init(address=address or "auto")
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(build_app(options), name=APP_NAME, route_prefix="/")
        except RuntimeError as err:
            _, status, message = model_status(APP_NAME)
            if message:
                raise failure_error(status, message) from None
            raise DualtrackError(f"Ray Serve could not deploy the application: {err}") from None
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        where = "a local Ray instance" if local else f"the Ray cluster at {address or os.environ['RAY_ADDRESS']}"
        scale = f"{options.autoscale[0]}..{options.autoscale[1]}" if options.autoscale else str(options.replicas)
        ingress = f"{options.ingress_replicas} ingress" if options.ingress_replicas else "answering HTTP themselves"
        settings = ", ".join(f"{k}={os.environ[k]}" for k in THROUGHPUT_ENV if k in os.environ) or "Ray's defaults"
        echo(
            f"running on http://{host}:{port} (Ray Serve on {where}: {scale} model replicas on {options.device}, "
            f"{ingress}; {settings}); Ctrl-C or SIGTERM stops it"
        )
        stop.wait()
        echo("shutting down: finishing in-flight requests")
    finally:
        if local:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
