"""The HTTP processes of ``dualtrack serve --workers N``: started, kept alive, stopped, and each given
an equal share of the connections.

Why not uvicorn's own supervisor (``uvicorn.run(workers=N)``, which this module replaced): its
processes share one listening socket and race for each connection, and asyncio and libuv accept
every pending connection in one go on the process that wakes first. A load test's 16 keep-alive
connections, opened together, landed 16 / 0 / 0 / 0, 12 / 3 / 1 / 0 and 7 / 4 / 3 / 2 on four
workers (``bench/serve_bench.py`` records the spread of every run as ``connections_per_process``).
A worker answers its connections one after another on one event loop, so the busiest one sets the
pace of every batch they share. ``SO_REUSEPORT`` spreads by a hash of the addresses, at random;
neither uvicorn, gunicorn nor the kernel offers least-connections among processes, so this module
does it:

- :class:`Balancer` (a thread of the engine process) accepts on the service's port and hands each
  connection's socket (``SCM_RIGHTS`` over a Unix socket) to the worker holding the fewest open
  connections, the one served longest ago among equals; each worker tells it when one closes.
- :class:`HandedServer` is uvicorn's ``Server`` (HTTP, lifespan, graceful shutdown all uvicorn's)
  that adopts the sockets it is handed (``loop.connect_accepted_socket``) instead of listening.
- :func:`run_workers` starts the N processes (spawned, as uvicorn does), replaces one that dies or
  whose event loop stops answering the balancer's pings for ``timeout_worker_healthcheck`` seconds
  (uvicorn's setting), and on SIGINT / SIGTERM stops accepting, then lets each worker finish its
  requests (uvicorn's ``timeout_graceful_shutdown``).

``DUALTRACK_BALANCE_WORKERS=0`` runs uvicorn's supervisor instead (for comparisons; README).
The control socket lives in a private (0700) directory and a worker proves the key the engine
process gave it before it is handed anything.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json
import logging
import multiprocessing
import os
import secrets
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

_log = logging.getLogger("uvicorn.error")  # the supervisor's messages among uvicorn's, as its own were

BALANCER_ENV = "DUALTRACK_SERVE_BALANCER"  # JSON {address, key}: set for the workers run_workers starts
PING_S = 1.0  # how often the balancer asks each worker's event loop for an answer
CONNECTION = b"c"  # balancer -> worker, with one socket attached
PING, PONG = b"?", b"!"  # balancer -> worker, worker -> balancer
CLOSED = b"-"  # worker -> balancer: one of its connections closed
_HELLO = struct.Struct("=32sI")  # worker -> balancer first: the key, the worker's pid


@dataclass(eq=False)
class _Worker:
    """A worker process as the balancer sees it: its channel and the connections it holds."""

    channel: socket.socket
    pid: int
    held: int = 0
    turn: int = 0  # when it was last handed a connection (least-recently-served first among equals)
    asked: float | None = None  # when the unanswered ping was sent
    hello: bytes = b""  # the handshake, until it is complete
    ready: bool = False


class Balancer:
    """Accepts on ``listener`` (bound, not yet listening) and hands each connection to the worker
    process holding the fewest.

    Workers register on :attr:`address` (:class:`HandedServer` does it once its app has started), so
    connections wait in the listening socket's backlog until one is ready. One thread, one selector:
    the listening socket, the control socket and every worker's channel.
    """

    def __init__(
        self, listener: socket.socket, *, backlog: int = 2048, unresponsive_after_s: float = 5.0, ping_s: float = PING_S
    ) -> None:
        self.listener = listener
        self.unresponsive_after_s = unresponsive_after_s
        self.ping_s = ping_s
        self.key = secrets.token_bytes(32)
        self._dir = Path(tempfile.mkdtemp(prefix="dualtrack-http-"))  # 0700
        self.address = str(self._dir / "balancer.sock")
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control.bind(self.address)
        self._control.listen(64)
        self._control.setblocking(False)
        self.listener.listen(backlog)
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._control, selectors.EVENT_READ, "control")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._workers: dict[socket.socket, _Worker] = {}
        self.registered: set[int] = set()  # pids of every worker that ever registered
        self._listening = False
        self._turns = itertools.count(1)
        self._lock = threading.Lock()  # the workers' table, read by held() and unresponsive()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dualtrack-balance", daemon=True)

    def env(self) -> str:
        """The value of :data:`BALANCER_ENV` for the workers."""
        return json.dumps({"address": self.address, "key": self.key.hex()})

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop handing out connections (the listening socket stays the caller's) and hang up on every worker."""
        self._closing.set()
        self._wake_w.send(b"x")
        self._thread.join(10)
        for worker in list(self._workers.values()):
            worker.channel.close()
        for sock in (self._control, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def held(self) -> dict[int, int]:
        """Open connections by worker pid, as the balancer counts them."""
        with self._lock:
            return {w.pid: w.held for w in self._workers.values() if w.ready}

    def unresponsive(self) -> list[int]:
        """Workers whose event loop has not answered a ping for ``unresponsive_after_s``."""
        now = time.monotonic()
        with self._lock:
            return [
                w.pid
                for w in self._workers.values()
                if w.ready and w.asked is not None and now - w.asked > self.unresponsive_after_s
            ]

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        next_ping = time.monotonic() + self.ping_s
        while not self._closing.is_set():
            for key, _ in self._selector.select(timeout=max(0.0, next_ping - time.monotonic())):
                if key.data == "control":
                    self._register()
                elif key.data == "listener":
                    self._hand_out()
                elif isinstance(key.data, _Worker):
                    self._hear(key.data)
            if time.monotonic() >= next_ping:
                self._ping()
                next_ping = time.monotonic() + self.ping_s

    def _register(self) -> None:
        while True:
            try:
                channel, _ = self._control.accept()
            except BlockingIOError:
                return
            except OSError as err:  # out of descriptors: the next select tries again
                _log.warning("a worker could not register with the connection balancer: %s", err)
                return
            channel.setblocking(False)
            worker = _Worker(channel, pid=0)
            self._selector.register(channel, selectors.EVENT_READ, worker)
            with self._lock:
                self._workers[channel] = worker

    def _hear(self, worker: _Worker) -> None:
        try:
            data = worker.channel.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the worker stopped (or shuts down): its connections went with it
            self._drop(worker)
            return
        if not worker.ready:
            worker.hello += data
            if len(worker.hello) < _HELLO.size:
                return
            key, pid = _HELLO.unpack(worker.hello[: _HELLO.size])
            if not hmac.compare_digest(key, self.key):
                _log.warning("refused a worker with the wrong key on the connection balancer")
                self._drop(worker)
                return
            data = worker.hello[_HELLO.size :]
            with self._lock:
                worker.pid, worker.ready, worker.hello = pid, True, b""
                self.registered.add(pid)
            if not self._listening:
                self._selector.register(self.listener, selectors.EVENT_READ, "listener")
                self._listening = True
        with self._lock:
            worker.held = max(0, worker.held - data.count(CLOSED))
            if PONG in data:
                worker.asked = None

    def _drop(self, worker: _Worker) -> None:
        self._selector.unregister(worker.channel)
        worker.channel.close()
        with self._lock:
            self._workers.pop(worker.channel, None)
            any_ready = any(w.ready for w in self._workers.values())
        if self._listening and not any_ready:
            self._selector.unregister(self.listener)  # the next connections wait in the backlog
            self._listening = False

    def _hand_out(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as err:  # out of descriptors, or a connection reset before its accept
                _log.warning("accepting an HTTP connection failed: %s", err)
                return
            with conn:  # the worker holds its own descriptor once sent; this one closes here
                self._give(conn)

    def _give(self, conn: socket.socket) -> None:
        """Send ``conn`` to the worker holding the fewest, else the next; none: the client is hung up on."""
        late = time.monotonic() - self.ping_s  # a worker slow to answer its ping comes after the others
        with self._lock:
            order = sorted(
                (w for w in self._workers.values() if w.ready),
                key=lambda w: (w.asked is not None and w.asked < late, w.held, w.turn),
            )
        for worker in order:
            try:
                socket.send_fds(worker.channel, [CONNECTION], [conn.fileno()])
            except (BlockingIOError, OSError):  # its channel is full (a stuck loop) or gone
                continue
            with self._lock:
                worker.held += 1
                worker.turn = next(self._turns)
            return
        _log.warning("no HTTP worker could take a connection: closed it")

    def _ping(self) -> None:
        now = time.monotonic()
        with self._lock:
            workers = [w for w in self._workers.values() if w.ready and w.asked is None]
        for worker in workers:
            try:
                worker.channel.send(PING)
            except (BlockingIOError, OSError):
                continue
            with self._lock:
                worker.asked = now


class HandedServer(uvicorn.Server):
    """uvicorn's server for one worker process, serving the connections the :class:`Balancer` hands it.

    Everything HTTP is uvicorn's: the protocol, the app's lifespan, the graceful shutdown. Only the
    source of connections differs: the balancer's channel (``BALANCER_ENV``) instead of a listening
    socket. When the channel closes (the engine process stops or is gone), the worker shuts down.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        spec = json.loads(os.environ[BALANCER_ENV])
        self._address, self._key = spec["address"], bytes.fromhex(spec["key"])
        self._channel: socket.socket | None = None
        self._unsent = b""
        self._adopting: set[Any] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        import asyncio

        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        for sock in sockets or ():
            sock.close()  # a listening socket uvicorn passed on: the balancer accepts, not this process
        self.servers = []
        config, server = self.config, self

        class Counted(config.http_protocol_class):  # type: ignore[name-defined,misc]
            """uvicorn's HTTP protocol, telling the balancer when its connection closes."""

            def connection_lost(self, exc: Exception | None) -> None:
                super().connection_lost(exc)
                server._tell(CLOSED)

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return Counted(config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop)

        self._create_protocol = create_protocol
        self._loop = asyncio.get_running_loop()
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            channel.connect(self._address)
            channel.sendall(_HELLO.pack(self._key, os.getpid()))
        except OSError as err:
            channel.close()
            _log.error("cannot reach the engine process's connection balancer at %s: %s", self._address, err)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        channel.setblocking(False)
        self._channel = channel
        self._loop.add_reader(channel.fileno(), self._on_channel)
        self.started = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._hang_up()  # no new connections; the balancer no longer counts this worker
        await super().shutdown(sockets=sockets)

    def _hang_up(self) -> None:
        if self._channel is not None:
            self._loop.remove_reader(self._channel.fileno())
            self._channel.close()
            self._channel = None

    def _on_channel(self) -> None:
        while self._channel is not None:
            try:
                data, fds, _, _ = socket.recv_fds(self._channel, 4096, 64)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            for fd in fds:
                self._adopt(socket.socket(fileno=fd))
            if not data:  # the balancer hung up: the engine process stops, or is gone
                self._hang_up()
                self.should_exit = True
                return
            if PING in data:
                self._tell(PONG)

    def _adopt(self, sock: socket.socket) -> None:
        if self.should_exit:
            sock.close()
            self._tell(CLOSED)
            return
        task = self._loop.create_task(self._serve_connection(sock))
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    async def _serve_connection(self, sock: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._create_protocol, sock)
        except OSError as err:  # the client hung up before its connection was set up
            _log.debug("a handed connection closed before it was served: %s", err)
            sock.close()
            self._tell(CLOSED)

    def _tell(self, what: bytes) -> None:
        """Send ``what`` to the balancer, after anything a full channel held back before."""
        if self._channel is None:
            return
        self._unsent += what
        try:
            sent = self._channel.send(self._unsent)
        except BlockingIOError:
            return
        except OSError:
            self._unsent = b""
            return
        self._unsent = self._unsent[sent:]


def _worker_main(config: uvicorn.Config) -> None:
    """A worker process: uvicorn's logging, then its server until SIGINT / SIGTERM or the balancer hangs up."""
    config.configure_logging()
    with contextlib.suppress(KeyboardInterrupt):  # the parent stops it; nothing to report
        HandedServer(config).run()


def run_workers(config: uvicorn.Config, workers: int) -> bool:
    """Serve ``config`` (an app uvicorn imports by name in each process) on ``workers`` processes.

    Returns after SIGINT / SIGTERM once every worker has finished its requests (True), or once a
    worker failed to start, its app or its registration with the balancer (False; the worker's log
    says why).
    """
    listener = config.bind_socket()  # logs where it listens, as uvicorn does
    balancer = Balancer(listener, backlog=config.backlog, unresponsive_after_s=float(config.timeout_worker_healthcheck))
    os.environ[BALANCER_ENV] = balancer.env()  # the spawned workers inherit it
    spawn = multiprocessing.get_context("spawn")
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def start() -> multiprocessing.process.BaseProcess:
        process = spawn.Process(target=_worker_main, args=(config,), name="dualtrack-http")
        process.start()
        return process

    balancer.start()
    processes = [start() for _ in range(workers)]
    started = True
    try:
        while not stop.wait(0.5):
            for pid in balancer.unresponsive():
                _log.error("HTTP worker [%d] did not answer for %.0f s: killing it", pid, balancer.unresponsive_after_s)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for i, process in enumerate(processes):
                if process.is_alive():
                    continue
                process.join()
                if process.exitcode == STARTUP_FAILURE or process.pid not in balancer.registered:
                    # Before serving (its app, the balancer): every replacement would fail the same way.
                    _log.error("HTTP worker [%d] failed to start; stopping (its log is above)", process.pid)
                    started = False
                    stop.set()
                    break
                _log.warning("HTTP worker [%d] died (exit code %s); starting another", process.pid, process.exitcode)
                processes[i] = start()
    finally:
        balancer.close()
        listener.close()  # new connections are refused from here; the workers finish the ones they hold
        for process in processes:
            if process.is_alive():
                process.terminate()
        grace = (config.timeout_graceful_shutdown or 30) + 5
        for process in processes:
            process.join(grace)
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.pop(BALANCER_ENV, None)
    return started
