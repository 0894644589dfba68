"""A closed-loop load generator for ``POST /v1/segment``, bounded in requests and in seconds.

``concurrency`` connections (keep-alive) each send the same image back to back until ``requests``
have been issued or ``duration_s`` has passed, whichever comes first. A request already sent when
time is up may take up to ``timeout_s`` more, so the whole run lasts at most
``duration_s + timeout_s``. It only targets this machine: the URL's host must be loopback.

The client must cost far less than the server it measures, since both share the machine's cores:
it runs on one asyncio event loop (uvloop when installed), sends a request built once, and reads
answers with a minimal HTTP/1.1 parser: ~0.1 ms of CPU per 512 KB request, a third of what a
thread per connection with ``http.client`` cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from dualtrack import atomic
from dualtrack.errors import InputError

DEFAULT_PATH = "/v1/segment"
_CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}


@dataclass(frozen=True)
class Endpoint:
    """Where the load goes: a loopback host, a port and a path with its query."""

    host: str
    port: int
    path: str


@dataclass(frozen=True)
class LoadTestReport:
    """What a run measured. Latencies are over 2xx answers only; errors are counted by status or exception."""

    url: str
    concurrency: int
    sent: int
    ok: int
    errors: dict[str, int]
    elapsed_s: float
    throughput_rps: float  # 2xx answers per second of wall time
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p90, p99, max, mean
    # The mean of each duration the server's 2xx answers reported in ``Server-Timing`` (ms), over
    # the answers that reported it: where the server says a request's time went.
    server_timing_ms: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """A few human-readable lines (what the CLI prints)."""
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        lat = self.latency_ms
        latency = (
            f"p50 {lat['p50']:.1f} ms   p99 {lat['p99']:.1f} ms   max {lat['max']:.1f} ms" if lat else "no 2xx answers"
        )
        lines = [
            f"target      {self.url}   concurrency {self.concurrency}",
            f"requests    {self.sent} sent, {self.ok} ok   errors: {errors}",
            f"throughput  {self.throughput_rps:.1f} req/s over {self.elapsed_s:.2f} s",
            f"latency     {latency}",
        ]
        if self.server_timing_ms:
            said = "  ".join(f"{k} {v:.2f}" for k, v in self.server_timing_ms.items())
            lines.append(f"server says (mean ms)  {said}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def loopback_target(url: str) -> Endpoint:
    """Parse ``url`` and refuse any host that is not loopback (127.0.0.0/8, localhost, ::1).

    A path of ``/`` or none means ``/v1/segment``. Raises :class:`InputError` with one line.
    """
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise InputError(f"loadtest URL {url!r} must start with http:// (the server speaks plain HTTP on loopback)")
    host = parts.hostname or ""
    if not _is_loopback(host):
        raise InputError(
            f"loadtest only targets this machine: host {host!r} in {url!r} is not loopback "
            "(use 127.0.0.1, localhost or ::1)"
        )
    try:
        port = parts.port or 80
    except ValueError as err:
        raise InputError(f"loadtest URL {url!r} has a bad port: {err}") from None
    path = parts.path if parts.path not in ("", "/") else DEFAULT_PATH
    return Endpoint(host, port, f"{path}?{parts.query}" if parts.query else path)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        # Trust "localhost" only if every address it resolves to is loopback (a hosts file can lie).
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def content_type_for(path: Path) -> str:
    """The Content-Type to send for an image file, from its suffix."""
    return _CONTENT_TYPES.get(path.suffix.lower(), "application/octet-stream")


def run_loadtest(
    url: str,
    body: bytes,
    *,
    content_type: str = "image/png",
    concurrency: int = 16,
    requests: int = 1000,
    duration_s: float = 30.0,
    timeout_s: float = 30.0,
) -> LoadTestReport:
    """Send ``body`` to ``url`` over ``concurrency`` connections until ``requests`` or ``duration_s`` runs out.

    Runs its own event loop: call it from synchronous code, not from inside a running loop.
    """
    for name, value in (("concurrency", concurrency), ("requests", requests), ("duration_s", duration_s)):
        if value <= 0:
            raise InputError(f"loadtest {name}={value} must be > 0")
    target = loopback_target(url)
    host = f"[{target.host}]" if ":" in target.host else target.host
    head = (
        f"POST {target.path} HTTP/1.1\r\nHost: {host}:{target.port}\r\nUser-Agent: dualtrack-loadtest\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    message = head.encode("latin-1") + body
    start = time.monotonic()
    latencies, outcomes, timing = _run_loop(
        _load(target, message, concurrency, requests, start + duration_s, timeout_s)
    )
    elapsed_s = time.monotonic() - start
    ok = sum(n for k, n in outcomes.items() if k.startswith("2"))
    return LoadTestReport(
        url=f"http://{host}:{target.port}{target.path}",
        concurrency=concurrency,
        sent=sum(outcomes.values()),
        ok=ok,
        errors={k: n for k, n in outcomes.items() if not k.startswith("2")},
        elapsed_s=round(elapsed_s, 3),
        throughput_rps=round(ok / elapsed_s, 2) if elapsed_s > 0 else 0.0,
        latency_ms=_percentiles_ms(latencies),
        server_timing_ms={k: round(total / timing.seen[k], 3) for k, total in timing.total.items()},
    )


def _run_loop(main: Any) -> Any:
    try:
        import uvloop  # the faster loop when installed (the `serve` extra); asyncio's own otherwise
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


class _BadResponse(Exception):
    """The server's answer is not HTTP/1.x as this client reads it."""


# What one exchange can fail with; each is counted by its name. ValueError: a bad length or chunk size.
_FAILURES = (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, _BadResponse)


@dataclass
class _ServerTiming:
    """Sums of the durations named in answers' ``Server-Timing`` headers, and how many had each."""

    total: dict[str, float] = field(default_factory=dict)
    seen: Counter[str] = field(default_factory=Counter)

    def add(self, header: str) -> None:
        # RFC 8673's syntax as servers send it: "name;dur=1.5, other;desc=x;dur=2"; a malformed
        # entry is skipped (this is a report, never a reason to fail a request).
        for entry in header.split(","):
            name, *params = (part.strip() for part in entry.split(";"))
            for param in params:
                key, _, value = param.partition("=")
                if key.strip().lower() == "dur" and name:
                    try:
                        ms = float(value.strip().strip('"'))
                    except ValueError:
                        break
                    self.total[name] = self.total.get(name, 0.0) + ms
                    self.seen[name] += 1
                    break


async def _load(
    target: Endpoint, message: bytes, concurrency: int, requests: int, deadline: float, timeout_s: float
) -> tuple[list[float], Counter[str], _ServerTiming]:
    issued = 0
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    timing = _ServerTiming()

    def claim() -> bool:
        nonlocal issued  # one event loop: no lock needed
        if issued >= requests or time.monotonic() >= deadline:
            return False
        issued += 1
        return True

    async def connection() -> None:
        streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while claim():
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(timeout_s):
                        if streams is None:
                            streams = await asyncio.open_connection(target.host, target.port)
                        status, keep_alive, server_timing = await _exchange(*streams, message)
                    outcome = str(status)
                    if server_timing and 200 <= status < 300:
                        timing.add(server_timing)
                except _FAILURES as err:
                    outcome, keep_alive = type(err).__name__, False
                if not keep_alive and streams is not None:
                    _close(streams[1])
                    streams = None
                outcomes[outcome] += 1
                if outcome.startswith("2"):
                    latencies.append(time.perf_counter() - t0)
        finally:
            if streams is not None:
                _close(streams[1])

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return latencies, outcomes, timing


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: bytes
) -> tuple[int, bool, str]:
    """Send one request, read its whole answer; returns (status, whether the connection stays open,
    its Server-Timing header or "")."""
    writer.write(message)  # no drain(): reading the answer waits as long, and one message bounds the buffer
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise _BadResponse(f"bad status line {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    keep_alive = parts[0] != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            await reader.readexactly(size + 2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, then the empty line
            pass
    elif "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    else:  # the body runs to the end of the connection
        await reader.read()
        keep_alive = False
    return int(parts[1]), keep_alive, headers.get("server-timing", "")


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        writer.close()


def _percentiles_ms(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {}
    ms = np.asarray(latencies) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        k: round(float(v), 3)
        for k, v in (("p50", p50), ("p90", p90), ("p99", p99), ("max", ms.max()), ("mean", ms.mean()))
    }


def write_report(report: LoadTestReport, path: Path) -> None:
    """Write the report as JSON."""
    atomic.write_text(path, json.dumps(report.to_json(), indent=2) + "\n")
