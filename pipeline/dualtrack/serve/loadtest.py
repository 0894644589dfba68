"""A closed-loop load generator for ``POST /v1/segment``, bounded in requests and in seconds.

``concurrency`` threads each keep one keep-alive connection and send the same image back to back
until ``requests`` have been issued or ``duration_s`` has passed, whichever comes first. A request
already sent when time is up may take up to ``timeout_s`` more, so the whole run lasts at most
``duration_s + timeout_s``. It only targets this machine: the URL's host must be loopback.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from dualtrack.errors import InputError

DEFAULT_PATH = "/v1/segment"
_CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}


@dataclass(frozen=True)
class Target:
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

    def lines(self) -> list[str]:
        """A few human-readable lines (what the CLI prints)."""
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        lat = self.latency_ms
        latency = (
            f"p50 {lat['p50']:.1f} ms   p99 {lat['p99']:.1f} ms   max {lat['max']:.1f} ms" if lat else "no 2xx answers"
        )
        return [
            f"target      {self.url}   concurrency {self.concurrency}",
            f"requests    {self.sent} sent, {self.ok} ok   errors: {errors}",
            f"throughput  {self.throughput_rps:.1f} req/s over {self.elapsed_s:.2f} s",
            f"latency     {latency}",
        ]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def loopback_target(url: str) -> Target:
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
    return Target(host, port, f"{path}?{parts.query}" if parts.query else path)


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
    """Send ``body`` to ``url`` from ``concurrency`` threads until ``requests`` or ``duration_s`` runs out."""
    for name, value in (("concurrency", concurrency), ("requests", requests), ("duration_s", duration_s)):
        if value <= 0:
            raise InputError(f"loadtest {name}={value} must be > 0")
    target = loopback_target(url)
    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    lock = threading.Lock()
    issued = 0
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    start = time.monotonic()
    deadline = start + duration_s

    def claim() -> bool:
        nonlocal issued
        with lock:
            if issued >= requests or time.monotonic() >= deadline:
                return False
            issued += 1
            return True

    def worker() -> None:
        conn: http.client.HTTPConnection | None = None
        while claim():
            if conn is None:
                conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout_s)
            t0 = time.perf_counter()
            try:
                conn.request("POST", target.path, body=body, headers=headers)
                response = conn.getresponse()
                response.read()
                outcome = str(response.status)
                if response.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as err:
                outcome = type(err).__name__
                conn.close()
                conn = None
            elapsed = time.perf_counter() - t0
            with lock:
                outcomes[outcome] += 1
                if outcome.startswith("2"):
                    latencies.append(elapsed)
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=worker, name=f"loadtest-{i}", daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed_s = time.monotonic() - start
    ok = sum(n for k, n in outcomes.items() if k.startswith("2"))
    return LoadTestReport(
        url=f"http://{f'[{target.host}]' if ':' in target.host else target.host}:{target.port}{target.path}",
        concurrency=concurrency,
        sent=sum(outcomes.values()),
        ok=ok,
        errors={k: n for k, n in outcomes.items() if not k.startswith("2")},
        elapsed_s=round(elapsed_s, 3),
        throughput_rps=round(ok / elapsed_s, 2) if elapsed_s > 0 else 0.0,
        latency_ms=_percentiles_ms(latencies),
    )


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
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
