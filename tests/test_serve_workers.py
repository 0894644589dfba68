"""The connection balancer of `dualtrack serve --workers N` (dualtrack/serve/workers.py), on the CPU.

The balancer is tested here against plain Unix-socket peers that speak its protocol (what
HandedServer does in a worker); tests/test_serve.py runs the real thing: `dualtrack serve --workers`
with uvicorn in each worker, over HTTP.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from polling import until

from dualtrack.serve import workers
from dualtrack.serve.workers import CLOSED, CONNECTION, PING, PONG, Balancer

WAIT_S = 10.0


class Peer:
    """A worker as the balancer sees it: registers with a key, receives sockets, reports closes."""

    def __init__(self, balancer: Balancer, pid: int, key: bytes | None = None) -> None:
        self.channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel.connect(balancer.address)
        self.channel.sendall(workers._HELLO.pack(key or balancer.key, pid))
        self.channel.settimeout(WAIT_S)
        self.held: list[socket.socket] = []

    def take(self, count: int) -> None:
        """Receive ``count`` handed connections (answering pings on the way)."""
        while len(self.held) < count:
            data, fds, _, _ = socket.recv_fds(self.channel, 64, 16)
            assert data, "the balancer hung up"
            assert set(data) <= set(CONNECTION + PING), data
            assert data.count(CONNECTION) == len(fds)
            self.held += [socket.socket(fileno=fd) for fd in fds]
            if PING in data:
                self.channel.sendall(PONG)

    def close_one(self) -> None:
        self.held.pop().close()
        self.channel.sendall(CLOSED)


@contextmanager
def balancing(**options: float) -> Iterator[tuple[Balancer, tuple[str, int]]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    balancer = Balancer(listener, **options)
    balancer.start()
    try:
        yield balancer, listener.getsockname()
    finally:
        balancer.close()
        listener.close()


def _connect(where: tuple[str, int], count: int) -> list[socket.socket]:
    return [socket.create_connection(where, timeout=WAIT_S) for _ in range(count)]


def test_connections_go_to_the_worker_holding_the_fewest() -> None:
    with balancing() as (balancer, where):
        peers = [Peer(balancer, pid) for pid in (101, 102, 103, 104)]
        until(lambda: len(balancer.held()) == 4, "four registered workers", WAIT_S)
        clients = _connect(where, 16)  # opened together, as a load test's connections are
        for peer in peers:
            peer.take(4)
        until(
            lambda: balancer.held() == {101: 4, 102: 4, 103: 4, 104: 4},
            "the count {101: 4, 102: 4, 103: 4, 104: 4}",
            WAIT_S,
        )
        # Each handed socket is one client's connection: bytes cross it both ways.
        for i, c in enumerate(clients):
            c.sendall(b"%02d" % i)
        handed = [s for p in peers for s in p.held]
        for s in handed:
            s.settimeout(WAIT_S)
            s.sendall(s.recv(2))
        assert [c.recv(2) for c in clients] == [b"%02d" % i for i in range(16)]
        # Closes are counted: the next connections fill the workers that lost theirs.
        for _ in range(3):
            peers[0].close_one()
        peers[2].close_one()
        until(lambda: balancer.held() == {101: 1, 102: 4, 103: 3, 104: 4}, "the closes counted", WAIT_S)
        clients += _connect(where, 4)
        peers[0].take(4)
        peers[2].take(4)
        until(
            lambda: balancer.held() == {101: 4, 102: 4, 103: 4, 104: 4},
            "the count {101: 4, 102: 4, 103: 4, 104: 4}",
            WAIT_S,
        )
        for c in clients:
            c.close()


def test_among_equals_the_worker_served_longest_ago_comes_first() -> None:
    with balancing() as (balancer, where):
        peers = [Peer(balancer, pid) for pid in (1, 2, 3)]
        until(lambda: len(balancer.held()) == 3, "three registered workers", WAIT_S)
        order = []
        clients = []
        for _ in range(6):  # one at a time, each closed before the next: every worker always holds 0 or 1
            clients += _connect(where, 1)
            for peer in peers:
                peer.channel.settimeout(0.2)
                try:
                    peer.take(1)
                except TimeoutError:
                    continue
                order.append(peers.index(peer))
                peer.close_one()
            until(lambda: sum(balancer.held().values()) == 0, "the close counted", WAIT_S)
        assert order == [0, 1, 2, 0, 1, 2]
        for c in clients:
            c.close()


def test_a_worker_with_the_wrong_key_is_refused() -> None:
    with balancing() as (balancer, where):
        intruder = Peer(balancer, 7, key=b"k" * 32)
        assert intruder.channel.recv(1) == b""  # hung up on
        assert balancer.held() == {}
        honest = Peer(balancer, 8)
        until(lambda: balancer.held() == {8: 0}, "the worker with the key", WAIT_S)
        client = _connect(where, 1)
        honest.take(1)
        client[0].close()


def test_connections_wait_in_the_backlog_until_a_worker_registers() -> None:
    with balancing() as (balancer, where):
        clients = _connect(where, 3)  # the kernel completes the handshake; nobody is handed them yet
        time.sleep(0.2)
        peer = Peer(balancer, 9)
        peer.take(3)
        until(lambda: balancer.held() == {9: 3}, "the count {9: 3}", WAIT_S)
        for c in clients:
            c.close()


def test_a_worker_that_stops_answering_is_reported_and_served_last() -> None:
    with balancing(ping_s=0.05, unresponsive_after_s=0.5) as (balancer, where):
        quiet = Peer(balancer, 21)  # never reads its channel after this: its pings go unanswered
        lively = Peer(balancer, 22)
        until(lambda: len(balancer.held()) == 2, "two registered workers", WAIT_S)
        lively.channel.settimeout(0.02)

        def answer() -> None:
            try:
                data = lively.channel.recv(64)
            except TimeoutError:
                return
            if PING in data:
                lively.channel.sendall(PONG)

        deadline = time.monotonic() + WAIT_S
        while balancer.unresponsive() != [21]:
            answer()
            assert time.monotonic() < deadline, "the quiet worker was never reported"
        clients = _connect(where, 2)  # both go to the lively one, though it then holds more
        lively.channel.settimeout(WAIT_S)
        lively.take(2)
        until(lambda: balancer.held() == {21: 0, 22: 2}, "the count {21: 0, 22: 2}", WAIT_S)
        for c in clients:
            c.close()
        quiet.channel.close()


def test_a_worker_that_hangs_up_is_forgotten_and_its_share_goes_to_the_others() -> None:
    with balancing() as (balancer, where):
        first, second = Peer(balancer, 31), Peer(balancer, 32)
        until(lambda: len(balancer.held()) == 2, "two registered workers", WAIT_S)
        first.channel.close()
        until(lambda: balancer.held() == {32: 0}, "the first worker forgotten", WAIT_S)
        clients = _connect(where, 3)
        second.take(3)
        for c in clients:
            c.close()


@pytest.mark.parametrize("data", [b"", b"x" * 10])
def test_a_short_or_silent_registration_hands_nothing(data: bytes) -> None:
    with balancing() as (balancer, where):
        half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        half.connect(balancer.address)
        half.sendall(data)
        clients = _connect(where, 1)
        half.settimeout(0.3)
        with pytest.raises(TimeoutError):
            half.recv(1)
        assert balancer.held() == {}
        clients[0].close()
        half.close()


def test_workers_that_cannot_start_stop_the_supervisor_instead_of_restarting_forever() -> None:
    """An app that does not import: the worker exits before it registers, and run_workers returns False
    (the CLI turns that into one line) instead of starting another every half second."""
    import uvicorn

    config = uvicorn.Config("dualtrack_no_such_module:app", host="127.0.0.1", port=0, log_level="critical")
    started = time.monotonic()
    assert workers.run_workers(config, 2) is False
    assert time.monotonic() - started < 60
