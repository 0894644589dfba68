"""``dualtrack serve`` and ``dualtrack loadtest``: plain click commands over the serve API.

They depend on no group; ``dualtrack.cli`` adds them with ``main.add_command``, and its group turns
any :class:`~dualtrack.errors.DualtrackError` raised here into one line and the documented exit code.
Only click and the options are imported up front, so ``dualtrack --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dualtrack.errors import ConfigError, DualtrackError
from dualtrack.serve.options import ServeOptions
from dualtrack.settings import Settings

if TYPE_CHECKING:
    from dualtrack.runtime.engine import Engine
    from dualtrack.serve.ray_config import RayAppOptions


# The `dualtrack serve` options that set a ServeOptions field, in --help order: (field, click type,
# help). Each becomes --<field with dashes>, its default the ServeOptions one.
_SERVE_OPTIONS: tuple[tuple[str, click.ParamType, str | None], ...] = (
    ("device", click.Choice(["cpu", "cuda"]), None),
    ("device_index", click.IntRange(0), None),
    ("max_batch_delay_ms", click.FloatRange(0), "Longest a request waits for others to share its batch."),
    (
        "batches_in_flight",
        click.IntRange(0),
        "While fewer batches than this are in the engine, the next one starts with the rows it has instead of "
        "waiting to fill (0: it waits for a full batch or --max-batch-delay-ms).",
    ),
    ("max_queue", click.IntRange(1), "Requests waiting for a batch; one more is answered 503 with Retry-After."),
    ("max_body_bytes", click.IntRange(1), "Larger request bodies are answered 413."),
    ("shutdown_timeout_s", click.FloatRange(0), "On SIGTERM/SIGINT, how long to wait for in-flight requests."),
    ("image_threads", click.IntRange(0), "Threads that decode, resize and encode images (0: one per core)."),
    (
        "image_memory_mb",
        click.IntRange(1),
        "Memory for full-size images in flight (decodes, masks); one that does not fit waits (with --workers: "
        "split between them).",
    ),
)


def _serve_options(command: Callable[..., None]) -> Callable[..., None]:
    """Adds the :data:`_SERVE_OPTIONS` to ``command`` (click lists the last one added first)."""
    for field, type_, help_ in reversed(_SERVE_OPTIONS):
        flag = "--" + field.replace("_", "-")
        default = getattr(ServeOptions, field)
        command = click.option(flag, field, default=default, show_default=True, type=type_, help=help_)(command)
    return command


@click.command("serve")
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@_serve_options
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="HTTP processes sharing the port, in front of one engine in this process (one CUDA context, one "
    "batcher for all of them, one /metrics); the image threads are split between them.",
)
@click.option(
    "--jpeg-decoder",
    type=click.Choice(["auto", "cpu"]),
    default="auto",
    show_default=True,
    help="auto: JPEGs are decoded on the engine's GPU where nvImageCodec is installed (with --workers the "
    "workers send the engine process the JPEG bytes); cpu: always Pillow. The startup line and /readyz say "
    "which runs.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
@click.option(
    "--backend",
    type=click.Choice(["uvicorn", "ray"]),
    default="uvicorn",
    show_default=True,
    help="uvicorn: one engine in this process. ray: Ray Serve, one engine per model replica (the `ray` extra).",
)
@click.option("--replicas", type=click.IntRange(1), help="[ray] Model replicas (one GPU each on cuda). [default: 1]")
@click.option("--autoscale", metavar="MIN..MAX", help="[ray] Let Ray scale the model replicas between MIN and MAX.")
@click.option(
    "--replicas-per-gpu",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="[ray] Model replicas sharing one GPU (each 1/K of it): where one replica's process cannot keep its GPU busy.",
)
@click.option(
    "--ingress-replicas",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="[ray] CPU replicas for HTTP in front of the model replicas (0: these answer HTTP).",
)
@click.option("--ray-address", help="[ray] A running Ray cluster (`ray start`); default: RAY_ADDRESS, else local.")
@click.option(
    "--gil-switch-ms",
    type=click.FloatRange(0.05, 100),
    help="This process's GIL switch interval (Python's default: 5 ms): how long a thread woken by I/O may "
    "wait for the one running Python code; docs/performance.md has what it measured.",
)
def serve(
    bundle: Path,
    host: str,
    port: int,
    workers: int,
    jpeg_decoder: str,
    log_level: str,
    backend: str,
    replicas: int | None,
    autoscale: str | None,
    replicas_per_gpu: int,
    ingress_replicas: int,
    ray_address: str | None,
    gil_switch_ms: float | None,
    **settings: Any,
) -> None:
    """Serve BUNDLE over HTTP: POST /v1/segment, /healthz, /readyz, /metrics and a web page at /.

    The bundle is loaded before the server listens, so a bad bundle or device fails here with its
    own error; warmup runs once the server is up, and /readyz answers 200 when it is done.
    Uses uvloop and httptools when they are installed (the `serve` extra), else asyncio and h11.
    """
    if backend == "ray":
        service = {k: v for k, v in settings.items() if k not in ("device", "device_index")}
        options = _ray_options(bundle, settings["device"], replicas, autoscale, ingress_replicas)(
            replicas_per_gpu=replicas_per_gpu, **service
        )
        _serve_ray(bundle, options, host=host, port=port, address=ray_address)
        return
    if replicas is not None or autoscale is not None or ray_address is not None or replicas_per_gpu != 1:
        raise click.UsageError("--replicas, --autoscale, --replicas-per-gpu and --ray-address go with --backend ray")
    if gil_switch_ms is not None:  # the engine's process: its batcher, launcher and connection threads
        sys.setswitchinterval(gil_switch_ms / 1e3)

    import uvicorn

    from dualtrack.runtime.engine import Engine
    from dualtrack.serve.app import create_app

    options = ServeOptions(**settings)
    loop, http = server_stack()
    engine = Engine.load(bundle, device=options.device, device_index=options.device_index)
    try:
        if workers > 1:
            # Split between the workers: with one thread per core in every worker, 512 KB PNGs
            # (CPU-bound) ran 10-20% slower on the H200 machine (serve_bench-f552e5d.json).
            shares = replace(
                options,
                image_threads=options.image_threads or max(1, ServeOptions().threads // workers),
                image_memory_mb=max(1, options.image_memory_mb // workers),
            )
            _serve_workers(
                engine, workers, shares, jpeg_decoder, host=host, port=port, log_level=log_level, loop=loop, http=http
            )
            return
        app = create_app(engine, jpeg_decoder=jpeg_decoder, **asdict(options))
        click.echo(f"serving with {loop} and {http}, {app.state.options.threads} image threads", err=True)
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level=log_level,
            loop=loop,
            http=http,
            timeout_graceful_shutdown=int(options.shutdown_timeout_s) or None,
        )
    finally:
        engine.close()


def _serve_workers(engine: Engine, workers: int, options: ServeOptions, jpeg_decoder: str, **server: Any) -> None:
    """``workers`` HTTP processes on one port (uvicorn's supervisor, spawned) in front of ``engine``,
    which stays in this process (:mod:`dualtrack.serve.shared`): one CUDA context, one batcher
    gathering every worker's requests (and decoding their JPEGs on the GPU where ``jpeg_decoder``
    and nvImageCodec allow), one metrics registry."""
    import os

    import uvicorn

    from dualtrack.serve.shared import ENGINE_ENV, EngineHost
    from dualtrack.serve.workers import run_workers

    host = EngineHost(engine, options, workers, jpeg_decoder=jpeg_decoder)
    host.start()
    try:
        app_options = {
            "max_body_bytes": options.max_body_bytes,
            "retry_after_s": options.retry_after_s,
            "shutdown_timeout_s": options.shutdown_timeout_s,
            "image_threads": options.image_threads,
            "image_memory_mb": options.image_memory_mb,
        }
        os.environ[ENGINE_ENV] = host.worker_env(app_options)  # the spawned workers inherit it
        balanced = Settings.from_env().balance_workers
        spread = "each connection handed to the one holding the fewest" if balanced else "racing for connections"
        click.echo(
            f"serving with {server['loop']} and {server['http']}: {workers} HTTP processes x "
            f"{options.image_threads} image threads ({spread}), one engine in process {os.getpid()}",
            err=True,
        )
        graceful = int(options.shutdown_timeout_s) or None
        app = "dualtrack.serve.app:worker_app"
        if not balanced:  # DUALTRACK_BALANCE_WORKERS=0: uvicorn's supervisor, one listening socket shared
            uvicorn.run(app, factory=True, workers=workers, timeout_graceful_shutdown=graceful, **server)
        elif not run_workers(
            uvicorn.Config(app, factory=True, workers=workers, timeout_graceful_shutdown=graceful, **server), workers
        ):
            raise DualtrackError("an HTTP worker process failed to start; the lines above say why")
    finally:
        # The workers have answered their requests and exited: finish anything still queued.
        if not host.close(options.shutdown_timeout_s):
            click.echo(f"the engine was still busy after {options.shutdown_timeout_s:.0f} s; exiting anyway", err=True)


# --- --backend ray and `dualtrack ray-config` (dualtrack.serve.ray_app; only it imports ray) ---------


def _ray_options(
    bundle: Path, device: str, replicas: int | None, autoscale: str | None, ingress_replicas: int
) -> Callable[..., RayAppOptions]:
    """The options of a Ray deployment of ``bundle`` as far as these flags go; call it with the rest."""
    from dualtrack.serve.ray_config import RayAppOptions, parse_autoscale

    if replicas is not None and autoscale is not None:
        raise click.UsageError("give --replicas N or --autoscale MIN..MAX, not both")
    scale = parse_autoscale(autoscale) if autoscale is not None else None
    return functools.partial(
        RayAppOptions,
        bundle=str(bundle.resolve()),
        device=device,
        replicas=replicas or 1,
        autoscale=scale,
        ingress_replicas=ingress_replicas,
    )


def _serve_ray(bundle: Path, options: RayAppOptions, **where: Any) -> None:
    from dualtrack.contract.bundle import Bundle

    Bundle.open(bundle)  # a bad bundle fails here with its own error, before Ray starts
    try:
        from dualtrack.serve.ray_app import run_service
    except ImportError as err:
        raise ConfigError(f"--backend ray needs Ray Serve ({err}): pip install 'dualtrack[ray]'") from None
    run_service(options, echo=lambda line: click.echo(line, err=True), **where)


@click.command("ray-config")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="YAML to write.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--replicas", type=click.IntRange(1), help="Model replicas (one GPU each on cuda). [default: 1]")
@click.option("--autoscale", metavar="MIN..MAX", help="Let Ray scale the model replicas between MIN and MAX.")
@click.option(
    "--replicas-per-gpu",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Model replicas sharing one GPU (each 1/K of it).",
)
@click.option(
    "--ingress-replicas",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="CPU replicas for HTTP in front of the model replicas (0: these answer HTTP).",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address Ray's HTTP proxies listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--bundle-path", help="The bundle's path on the cluster's nodes, if not BUNDLE's absolute path here.")
@click.option("--max-batch-delay-ms", default=ServeOptions.max_batch_delay_ms, show_default=True, type=float)
@click.option(
    "--batches-in-flight",
    default=ServeOptions.batches_in_flight,
    show_default=True,
    type=click.IntRange(0),
    help="As for `dualtrack serve`, in each model replica.",
)
@click.option("--max-queue", default=ServeOptions.max_queue, show_default=True, type=click.IntRange(1))
def ray_config(
    bundle: Path,
    output: Path,
    device: str,
    replicas: int | None,
    autoscale: str | None,
    replicas_per_gpu: int,
    ingress_replicas: int,
    host: str,
    port: int,
    bundle_path: str | None,
    max_batch_delay_ms: float,
    batches_in_flight: int,
    max_queue: int,
) -> None:
    """Write a Ray Serve config for BUNDLE: `serve run FILE`, `serve deploy FILE`, a KubeRay RayService.

    The bundle is read here for its batch sizes; the nodes read it at --bundle-path (default: the
    absolute path of BUNDLE), so it must be there on every node (a shared volume or the image).
    """
    from dualtrack.serve.ray_config import write_serve_config

    options = _ray_options(bundle, device, replicas, autoscale, ingress_replicas)(
        max_batch_delay_ms=max_batch_delay_ms,
        batches_in_flight=batches_in_flight,
        max_queue=max_queue,
        replicas_per_gpu=replicas_per_gpu,
    ).resolved()
    if bundle_path is not None:
        options = dataclasses.replace(options, bundle=bundle_path)
    write_serve_config(options, output, host=host, port=port)
    click.echo(f"wrote {output}: `serve run {output}` or `serve deploy {output}`")


def server_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools when importable, else asyncio and h11.

    With uvloop and httptools (C) the event loop spends a third to a half less CPU per request than
    with asyncio and h11 (0.47 against 0.74 ms for a 512 KB upload, 0.20 against 0.35 ms for a
    small one, on a 2-core EPYC VM), and the event loop's time is what every request shares.
    """
    from importlib.util import find_spec

    loop = "uvloop" if find_spec("uvloop") else "asyncio"
    http = "httptools" if find_spec("httptools") else "h11"
    return loop, http


@click.command("loadtest")
@click.argument("url")
@click.option(
    "--image", "image", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="PNG/JPEG."
)
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(1, 1024))
@click.option("--requests", "requests_", default=1000, show_default=True, type=click.IntRange(1), help="At most.")
@click.option("--duration-s", default=30.0, show_default=True, type=click.FloatRange(0, min_open=True), help="At most.")
@click.option("--timeout-s", default=30.0, show_default=True, type=click.FloatRange(0, min_open=True))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the report.")
def loadtest(
    url: str,
    image: Path,
    concurrency: int,
    requests_: int,
    duration_s: float,
    timeout_s: float,
    json_path: Path | None,
) -> None:
    """Load URL (loopback only; a bare host:port means /v1/segment) with IMAGE and report.

    Stops after --requests or --duration-s, whichever comes first; prints throughput, p50/p99
    latency and error counts by status code or exception.
    """
    from dualtrack.serve.loadtest import content_type_for, loopback_target, run_loadtest, write_report

    loopback_target(url)  # refuse before reading the image or starting threads
    report = run_loadtest(
        url,
        image.read_bytes(),
        content_type=content_type_for(image),
        concurrency=concurrency,
        requests=requests_,
        duration_s=duration_s,
        timeout_s=timeout_s,
    )
    for line in report.lines():
        click.echo(line)
    if json_path is not None:
        write_report(report, json_path)
        click.echo(f"report      {json_path}")
    if report.ok == 0:
        raise click.ClickException(f"no request succeeded: errors {report.errors}")
