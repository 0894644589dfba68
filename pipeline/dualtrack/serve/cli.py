"""``dualtrack serve`` and ``dualtrack loadtest``: plain click commands over the serve API.

They depend on no group; ``dualtrack.cli`` adds them with ``main.add_command``, and its group turns
any :class:`~dualtrack.errors.DualtrackError` raised here into one line and the documented exit code.
Only click and the options are imported up front, so ``dualtrack --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dualtrack.serve.options import ServeOptions

if TYPE_CHECKING:
    from dualtrack.runtime.engine import Engine


@click.command("serve")
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=ServeOptions.device, show_default=True)
@click.option("--device-index", default=ServeOptions.device_index, show_default=True, type=click.IntRange(0))
@click.option(
    "--max-batch-delay-ms",
    default=ServeOptions.max_batch_delay_ms,
    show_default=True,
    type=click.FloatRange(0),
    help="Longest a request waits for others to share its batch.",
)
@click.option(
    "--max-queue",
    default=ServeOptions.max_queue,
    show_default=True,
    type=click.IntRange(1),
    help="Requests waiting for a batch; one more is answered 503 with Retry-After.",
)
@click.option(
    "--max-body-bytes",
    default=ServeOptions.max_body_bytes,
    show_default=True,
    type=click.IntRange(1),
    help="Larger request bodies are answered 413.",
)
@click.option(
    "--shutdown-timeout-s",
    default=ServeOptions.shutdown_timeout_s,
    show_default=True,
    type=click.FloatRange(0),
    help="On SIGTERM/SIGINT, how long to wait for in-flight requests.",
)
@click.option(
    "--image-threads",
    default=ServeOptions.image_threads,
    show_default=True,
    type=click.IntRange(0),
    help="Threads that decode, resize and encode images (0: one per core).",
)
@click.option(
    "--image-memory-mb",
    default=ServeOptions.image_memory_mb,
    show_default=True,
    type=click.IntRange(1),
    help="Memory for full-size images in flight (decodes, masks); one that does not fit waits (with --workers: "
    "split between them).",
)
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
    help="auto: JPEGs are decoded on the engine's GPU where nvImageCodec is installed (one process: not with "
    "--workers); cpu: always Pillow. The startup line and /readyz say which runs.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
def serve(
    bundle: Path,
    host: str,
    port: int,
    device: str,
    device_index: int,
    max_batch_delay_ms: float,
    max_queue: int,
    max_body_bytes: int,
    shutdown_timeout_s: float,
    image_threads: int,
    image_memory_mb: int,
    workers: int,
    jpeg_decoder: str,
    log_level: str,
) -> None:
    """Serve BUNDLE over HTTP: POST /v1/segment, /healthz, /readyz, /metrics and a web page at /.

    The bundle is loaded before the server listens, so a bad bundle or device fails here with its
    own error; warmup runs once the server is up, and /readyz answers 200 when it is done.
    Uses uvloop and httptools when they are installed (the `serve` extra), else asyncio and h11.
    """
    import uvicorn

    from dualtrack.runtime.engine import Engine
    from dualtrack.serve.app import create_app

    loop, http = server_stack()
    engine = Engine.load(bundle, device=device, device_index=device_index)
    try:
        if workers > 1:
            _serve_workers(
                engine,
                workers,
                ServeOptions(
                    max_batch_delay_ms=max_batch_delay_ms,
                    max_queue=max_queue,
                    max_body_bytes=max_body_bytes,
                    shutdown_timeout_s=shutdown_timeout_s,
                    # Split between the workers: with one thread per core in every worker, 512 KB PNGs
                    # (CPU-bound) ran 10-20% slower on the H200 machine (serve_bench-f552e5d.json).
                    image_threads=image_threads or max(1, ServeOptions().threads // workers),
                    image_memory_mb=max(1, image_memory_mb // workers),
                ),
                host=host,
                port=port,
                log_level=log_level,
                loop=loop,
                http=http,
            )
            return
        app = create_app(
            engine,
            max_batch_delay_ms=max_batch_delay_ms,
            max_queue=max_queue,
            max_body_bytes=max_body_bytes,
            shutdown_timeout_s=shutdown_timeout_s,
            image_threads=image_threads,
            image_memory_mb=image_memory_mb,
            jpeg_decoder=jpeg_decoder,
        )
        click.echo(f"serving with {loop} and {http}, {app.state.options.threads} image threads", err=True)
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level=log_level,
            loop=loop,
            http=http,
            timeout_graceful_shutdown=int(shutdown_timeout_s) or None,
        )
    finally:
        engine.close()


def _serve_workers(engine: Engine, workers: int, options: ServeOptions, **server: Any) -> None:
    """``workers`` HTTP processes on one port (uvicorn's supervisor, spawned) in front of ``engine``,
    which stays in this process (:mod:`dualtrack.serve.shared`): one CUDA context, one batcher
    gathering every worker's requests, one metrics registry."""
    import os

    import uvicorn

    from dualtrack.serve.shared import ENGINE_ENV, EngineHost

    host = EngineHost(engine, options, workers)
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
        click.echo(
            f"serving with {server['loop']} and {server['http']}: {workers} HTTP processes x "
            f"{options.image_threads} image threads, one engine in process {os.getpid()}",
            err=True,
        )
        uvicorn.run(
            "dualtrack.serve.app:worker_app",
            factory=True,
            workers=workers,
            timeout_graceful_shutdown=int(options.shutdown_timeout_s) or None,
            **server,
        )
    finally:
        # The workers have answered their requests and exited: finish anything still queued.
        if not host.close(options.shutdown_timeout_s):
            click.echo(f"the engine was still busy after {options.shutdown_timeout_s:.0f} s; exiting anyway", err=True)


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
