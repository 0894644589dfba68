"""Prometheus metrics of one app, in a registry of its own (two apps in one process never collide).

With ``dualtrack serve --workers N`` the registry lives in the engine process and the HTTP workers
send it what they observe (:mod:`dualtrack.serve.shared`): every worker's ``/metrics`` is the
whole service's, with a worker's last 0.25 s of counts possibly still on their way.

Exposed at ``GET /metrics``:

==========================================  =========  ==============================================
name                                        type       meaning
==========================================  =========  ==============================================
``dualtrack_requests_total``                counter    requests by ``endpoint`` and HTTP ``code``
``dualtrack_request_errors_total``          counter    4xx/5xx answers by ``endpoint`` and ``code``
``dualtrack_request_latency_seconds``       histogram  ``POST /v1/segment`` wall time, body to answer
``dualtrack_queue_wait_seconds``            histogram  time a request waited for its batch to start
``dualtrack_batch_size``                    histogram  real requests per engine run (pad rows excluded)
``dualtrack_padded_rows_total``             counter    pad rows run to reach a compiled batch size
``dualtrack_inference_seconds``             histogram  wall time of one ``engine.run`` (whole batch)
``dualtrack_track_seconds``                 histogram  engine-reported time per ``track`` (``a``, ``b``)
``dualtrack_batch_phase_seconds``           histogram  a batch's time per ``phase``: ``gather``, ``stage``
                                                       (of it ``slot``, ``rows``, ``decode``, ``sync``),
                                                       ``handoff``, ``gpu`` (serve/batcher.py)
``dualtrack_windows_per_request``          histogram  sliding windows one image larger than every compiled
                                                       size ran (runtime/tiling.py; a bundle with ``window:``)
``dualtrack_queue_depth``                   gauge      requests waiting for a batch, at scrape time
``dualtrack_ready``                         gauge      1 when ``/readyz`` answers 200, else 0
``dualtrack_jpeg_decoder``                  gauge      1 for the ``decoder`` (``gpu``, ``cpu``) that takes JPEGs
==========================================  =========  ==============================================
"""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dualtrack.serve.batcher import BatchResult

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_WINDOW_BUCKETS = (1, 4, 9, 16, 25, 36, 49, 64, 100, 144, 256, 484, 1024)  # n x n windows: 2048^2 in 512s is 25
_TRACK_KEY = re.compile(r"^track_([a-z0-9]+)_ms$")
_PHASE_KEY = re.compile(r"^batch_([a-z]+)_ms$")


class ServeMetrics:
    """The metrics of one app. Record with the ``observe_*`` methods; export with :meth:`exposition`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self, queue_depth: Callable[[], int], ready: Callable[[], bool], decoder: Callable[[], str] = lambda: "cpu"
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dualtrack_requests", "HTTP requests", ["endpoint", "code"], registry=r)
        self.errors = Counter("dualtrack_request_errors", "HTTP 4xx/5xx answers", ["endpoint", "code"], registry=r)
        self.latency = Histogram(
            "dualtrack_request_latency_seconds", "segment request wall time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "dualtrack_queue_wait_seconds", "wait before the batch started", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "dualtrack_batch_size", "real requests per engine run", buckets=_BATCH_BUCKETS, registry=r
        )
        self.padded_rows = Counter("dualtrack_padded_rows", "pad rows run to fill a compiled batch size", registry=r)
        self.inference = Histogram(
            "dualtrack_inference_seconds", "engine.run wall time per batch", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.track = Histogram(
            "dualtrack_track_seconds", "engine-reported time per track", ["track"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.phase = Histogram(
            "dualtrack_batch_phase_seconds",
            "time per phase of a batch",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.windows = Histogram(
            "dualtrack_windows_per_request", "sliding windows per tiled image", buckets=_WINDOW_BUCKETS, registry=r
        )
        Gauge("dualtrack_queue_depth", "requests waiting for a batch", registry=r).set_function(queue_depth)
        Gauge("dualtrack_ready", "1 when ready to serve", registry=r).set_function(lambda: float(ready()))
        active = Gauge("dualtrack_jpeg_decoder", "1 for the decoder that takes JPEGs", ["decoder"], registry=r)
        for name in ("gpu", "cpu"):
            active.labels(name).set_function(lambda name=name: float(decoder() == name))

    def observe_request(self, endpoint: str, code: int) -> None:
        """Count one answered request."""
        self.requests.labels(endpoint, str(code)).inc()
        if code >= 400:
            self.errors.labels(endpoint, str(code)).inc()

    def observe_latency(self, seconds: float) -> None:
        """Record one ``POST /v1/segment``'s wall time, body to answer."""
        self.latency.observe(seconds)

    def observe_batch(self, results: list[BatchResult]) -> None:
        """Record one engine run and each of its requests' queue wait (on the batcher's thread)."""
        for row in results:
            self.queue_wait.observe(row.queue_ms / 1e3)
        result = results[0]
        self.batch_size.observe(result.batch_size)
        self.padded_rows.inc(result.padded_size - result.batch_size)
        self.inference.observe(result.run_ms / 1e3)
        for key, ms in result.timings.items():
            if match := _TRACK_KEY.match(key):
                self.track.labels(match.group(1)).observe(ms / 1e3)
            elif match := _PHASE_KEY.match(key):
                self.phase.labels(match.group(1)).observe(ms / 1e3)

    def observe_windows(self, windows: int) -> None:
        """Record the sliding windows one image ran (``Engine.last_windows``; an image that fits runs none)."""
        if windows:
            self.windows.observe(windows)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric in this app's registry."""
        return generate_latest(self.registry)
