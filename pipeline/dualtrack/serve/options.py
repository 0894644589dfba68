"""The service's options and their defaults (the CLI's defaults too), validated once.

Kept apart from the app so ``dualtrack --help`` can show them without importing Starlette or numpy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dualtrack.errors import ConfigError


@dataclass(frozen=True)
class ServeOptions:
    """How the service batches, queues and limits. The CLI's defaults are these."""

    max_batch_delay_ms: float = 5.0  # longest a request waits for others to share its batch
    # A batch not yet full starts while fewer than this many batches are in the engine (0: it waits
    # to fill or for max_batch_delay_ms); serve/batcher.py's batching policy.
    batches_in_flight: int = 0
    max_queue: int = 64  # requests waiting for a batch; one more is answered 503
    max_body_bytes: int = 16 * 1024 * 1024  # larger request bodies are answered 413
    device: str = "cpu"  # used only when the app loads the bundle itself
    device_index: int = 0
    retry_after_s: int = 1  # the Retry-After of every 503
    shutdown_timeout_s: float = 30.0  # how long shutdown waits for queued work
    image_threads: int = 0  # threads that decode, resize and encode images; 0: one per usable core
    # Memory for full-size images in flight, decodes and masks (dualtrack.imaging.MemoryBudget): 1 GiB
    # holds two 64-megapixel RGB decodes at once; a larger one runs alone.
    image_memory_mb: int = 1024

    @property
    def threads(self) -> int:
        """``image_threads``, with 0 resolved to the cores this process may run on."""
        if self.image_threads:
            return self.image_threads
        if hasattr(os, "sched_getaffinity"):  # honours taskset and cpusets; not on macOS
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1

    def __post_init__(self) -> None:
        checks = (
            (self.max_batch_delay_ms >= 0, "max_batch_delay_ms", self.max_batch_delay_ms, ">= 0"),
            (self.batches_in_flight >= 0, "batches_in_flight", self.batches_in_flight, ">= 0 (0: off)"),
            (self.max_queue >= 1, "max_queue", self.max_queue, ">= 1"),
            (self.max_body_bytes >= 1, "max_body_bytes", self.max_body_bytes, ">= 1"),
            (self.device in ("cpu", "cuda"), "device", self.device, "'cpu' or 'cuda'"),
            (self.device_index >= 0, "device_index", self.device_index, ">= 0"),
            (self.retry_after_s >= 0, "retry_after_s", self.retry_after_s, ">= 0"),
            (self.shutdown_timeout_s >= 0, "shutdown_timeout_s", self.shutdown_timeout_s, ">= 0"),
            (self.image_threads >= 0, "image_threads", self.image_threads, ">= 0 (0: one per core)"),
            (self.image_memory_mb >= 1, "image_memory_mb", self.image_memory_mb, ">= 1"),
        )
        for ok, name, value, rule in checks:
            if not ok:
                raise ConfigError(f"serve option {name}={value!r} is invalid: it must be {rule}")
