"""What one hand-over between threads and between processes costs on this machine (issue 15).

Every request of ``dualtrack serve --workers N`` crosses a dozen of them (docs/performance.md lists
them): a thread woken by a queue, an event or a socket. This measures the bare cost of each kind,
with nothing else running: one side stamps ``time.monotonic()`` (one clock for every process of the
machine) and wakes the other, which stamps when it runs; ``--rounds`` times, one message in flight.

    python bench/wake_probe.py --out DIR [--rounds 4000] [--commit HASH]

Prints a table and writes ``DIR/wake_probe-<commit>.json`` (one-way latency percentiles, µs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from queue import SimpleQueue


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1e6  # noqa: E731
    return {"p50_us": round(at(0.5), 1), "p90_us": round(at(0.9), 1), "p99_us": round(at(0.99), 1),
            "mean_us": round(statistics.fmean(s) * 1e6, 1)}  # fmt: skip


def _thread_pair(make: Callable[[], tuple[Callable[[float], None], Callable[[], float]]], rounds: int) -> list[float]:
    """One-way latencies through a channel ``make()`` builds: (put(stamp), get() -> stamp), both ways."""
    there, back = make(), make()
    latencies: list[float] = []

    def echo() -> None:
        for _ in range(rounds):
            stamp = there[1]()
            latencies.append(time.monotonic() - stamp)
            back[0](time.monotonic())

    t = threading.Thread(target=echo)
    t.start()
    for _ in range(rounds):
        there[0](time.monotonic())
        stamp = back[1]()
        latencies.append(time.monotonic() - stamp)
        time.sleep(50e-6)  # the other side goes back to sleep, as between requests
    t.join()
    return latencies


def _simple_queue() -> tuple[Callable[[float], None], Callable[[], float]]:
    q: SimpleQueue[float] = SimpleQueue()
    return q.put, q.get


def _event() -> tuple[Callable[[float], None], Callable[[], float]]:
    box: list[float] = []
    ev = threading.Event()

    def put(stamp: float) -> None:
        box.append(stamp)
        ev.set()

    def get() -> float:
        ev.wait()
        ev.clear()
        return box.pop()

    return put, get


def _socket_echo(sock: socket.socket, rounds: int) -> None:
    for _ in range(rounds):
        data = sock.recv(64)
        sock.sendall(f"{float(data)!r},{time.monotonic()!r}".encode())


def _process_pair(rounds: int) -> list[float]:
    """One-way latencies over a Unix socket between two processes (a worker and the engine process)."""
    a, b = socket.socketpair()
    child = mp.get_context("spawn").Process(target=_socket_echo, args=(b, rounds))
    child.start()
    latencies: list[float] = []
    for _ in range(rounds):
        a.sendall(repr(time.monotonic()).encode())
        sent, echoed = map(float, a.recv(128).split(b","))
        now = time.monotonic()
        latencies += [echoed - sent, now - echoed]
        time.sleep(50e-6)
    child.join()
    return latencies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=4000)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    kinds = {
        "thread -> thread, SimpleQueue": lambda: _thread_pair(_simple_queue, args.rounds),
        "thread -> thread, threading.Event": lambda: _thread_pair(_event, args.rounds),
        "process -> process, Unix socket": lambda: _process_pair(args.rounds),
    }
    results = {name: _percentiles(run()) for name, run in kinds.items()}
    print(f"{'one-way hand-over':38s} {'p50 us':>8s} {'p90 us':>8s} {'p99 us':>8s}")
    for name, r in results.items():
        print(f"{name:38s} {r['p50_us']:8.1f} {r['p90_us']:8.1f} {r['p99_us']:8.1f}")
    idle = Path("/sys/devices/system/cpu/cpuidle/current_driver")
    report = {
        "commit": args.commit,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "cpuidle_driver": idle.read_text().strip() if idle.exists() else None,
        },
        "rounds": args.rounds,
        "one_way": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"wake_probe-{args.commit}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
