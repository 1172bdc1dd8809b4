"""Handshakes are challenge-response and served at once: a connection that says nothing, or a
HELLO captured from another handshake and replayed, neither delays a rendezvous nor takes a
rank's place; the same at the aggregator's registration."""

import os
import socket
import threading
import time

import pytest

from overcast.aggregator.service import AggregatorService
from overcast.transport.rendezvous import HANDSHAKE_SECONDS, rendezvous
from overcast.transport.store import StoreClient, StoreError, StoreServer
from overcast.wire.auth import Sealer, derive_key, job_id_of
from overcast.wire.header import AGGREGATOR, Kind
from overcast.wire.registration import ANSWER, HELLO, NONCE_BYTES, AGGREGATOR_CHALLENGE

WORLD, TIMEOUT = 3, 30.0


def captured_hello(secret: bytes, salt: bytes, src: int, dst: int, payload: bytes) -> bytes:
    """A HELLO as rank `src` sealed it in another handshake of this communicator: authentic,
    but carrying that handshake's nonces."""
    sealer = Sealer(derive_key(secret, salt, b"comm"), job_id_of(secret),
                    int.from_bytes(salt[:4], "little"), src)
    return sealer.seal(Kind.HELLO, 0, dst, 0, payload)


def close(links) -> None:
    for sock in [*links.streams.values(), links.udp, links.multicast, *links.aggregator_sockets.values()]:
        if sock is not None:
            sock.close()


class Ranks:
    """Ranks of one communicator, each rendezvousing in a thread of its own."""

    def __init__(self, secret: bytes, switch: str | None = None):
        self.server = StoreServer("127.0.0.1", 0)
        self.secret, self.switch = secret, switch
        self.links: dict[int, object] = {}
        self.errors: dict[int, BaseException] = {}
        self.threads: list[threading.Thread] = []

    def start(self, rank: int) -> None:
        def run():
            try:
                self.links[rank] = rendezvous(rank, WORLD, store=self.store(), secret=self.secret,
                                              timeout=TIMEOUT, aggregators=self.switch)
            except BaseException as err:  # reported by the test
                self.errors[rank] = err
        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def store(self) -> StoreClient:
        return StoreClient("127.0.0.1", self.server.port, TIMEOUT)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        for links in self.links.values():
            close(links)
        self.server.close()


def test_a_silent_connection_and_a_replayed_hello_neither_delay_nor_join_the_rendezvous():
    ranks = Ranks(os.urandom(32))
    began = time.monotonic()
    ranks.start(0)
    store = ranks.store()
    host, port, _ = bytes(store.get("overcast/default/addr/0")).decode().split()
    salt = bytes(store.get("overcast/default/salt"))
    store.close()
    silent = socket.create_connection((host, int(port)))
    replay = socket.create_connection((host, int(port)))
    replay.sendall(captured_hello(ranks.secret, salt, 1, 0, ANSWER.pack(
        os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES))))
    for rank in range(1, WORLD):
        ranks.start(rank)
    for thread in ranks.threads:
        thread.join()
    took = time.monotonic() - began
    try:
        assert not ranks.errors, ranks.errors
        assert sorted(ranks.links) == list(range(WORLD))
        for rank, links in ranks.links.items():
            assert sorted(links.streams) == sorted(set(range(WORLD)) - {rank})
        # rank 0 challenged the replay, found its own nonce missing, and hung up
        assert ranks.links[0].drops["handshake_failed"] == 1
        replay.settimeout(TIMEOUT)
        assert replay.recv(4096)  # the challenge
        assert replay.recv(4096) == b""  # then nothing: closed
        # the silent connection held no one up: the rendezvous ended before its deadline
        assert took < HANDSHAKE_SECONDS, took
    finally:
        silent.close()
        replay.close()
        ranks.join()


def test_the_aggregator_takes_no_replayed_registration_and_drops_a_silent_one(monkeypatch):
    service = AggregatorService("127.0.0.1", 0, [secret := os.urandom(32)])
    serving = threading.Thread(target=service.serve)
    serving.start()
    silent = replay = None
    ranks = Ranks(secret, switch=f"127.0.0.1:{service.port}")
    try:
        for rank in range(WORLD):
            ranks.start(rank)
        for thread in ranks.threads:
            thread.join()
        assert not ranks.errors, ranks.errors
        assert all(links.aggregator_error is None for links in ranks.links.values())
        links = ranks.links[1]
        salt = bytes(ranks.store().get("overcast/default/salt"))
        replay = socket.create_connection(("127.0.0.1", service.port))
        replay.settimeout(TIMEOUT)
        assert len(replay.recv(AGGREGATOR_CHALLENGE.size)) == AGGREGATOR_CHALLENGE.size
        hello = HELLO.pack(salt, WORLD, links.udp.getsockname()[1], True, 1408, 0, 0,
                           os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES))
        replay.sendall(captured_hello(secret, salt, 1, AGGREGATOR, hello))
        assert replay.recv(4096) == b""  # closed, no WELCOME
        replay.close()
        # a short registration time for this connection only: the ranks and the replay had
        # the usual one, so a stall of this process could not have timed them out instead
        monkeypatch.setattr("overcast.aggregator.service.REGISTRATION_SECONDS", 0.2)
        silent = socket.create_connection(("127.0.0.1", service.port))
        silent.settimeout(TIMEOUT)
        assert len(silent.recv(AGGREGATOR_CHALLENGE.size)) == AGGREGATOR_CHALLENGE.size
        assert silent.recv(4096) == b""  # closed once its registration time was up
        assert service.drops["replayed"] == 1 and service.drops["registration_timeout"] == 1
    finally:
        for conn in (silent, replay):
            if conn is not None:
                conn.close()
        ranks.join()
        service.stop()
        serving.join()
        service.close()


@pytest.mark.parametrize("name", ["OVERCAST_AGGREGATORS", "OVERCAST_SWITCH"])
def test_the_ranks_register_with_the_aggregator_the_environment_names(name, monkeypatch):
    """Either name of the setting (OVERCAST_SWITCH is the old one) is read when no aggregator
    is given."""
    service = AggregatorService("127.0.0.1", 0, [secret := os.urandom(32)])
    serving = threading.Thread(target=service.serve)
    serving.start()
    monkeypatch.delenv("OVERCAST_AGGREGATORS", raising=False)
    monkeypatch.delenv("OVERCAST_SWITCH", raising=False)
    monkeypatch.setenv(name, f"127.0.0.1:{service.port}")
    ranks = Ranks(secret)
    try:
        for rank in range(WORLD):
            ranks.start(rank)
        ranks.join()
        assert not ranks.errors, ranks.errors
        assert [(links.aggregator_error, list(links.aggregator_names.values()))
                for links in ranks.links.values()] == [(None, [f"127.0.0.1:{service.port}"])] * 3
    finally:
        ranks.join()
        for links in ranks.links.values():
            close(links)
        service.stop()
        serving.join()
        service.close()


def test_a_closed_store_stops_listening_and_serving_at_once():
    """close() ends the store's threads, those blocked in accept() and recv() included (a
    socket's close() from another thread wakes neither on Linux): its port refuses the next
    connection, where it used to accept one more and serve it; a client waiting for a key
    gets a StoreError, never a bare socket error."""
    others = set(threading.enumerate())
    server = StoreServer("127.0.0.1", 0)
    stranger = socket.create_connection(("127.0.0.1", server.port))  # says nothing
    client = StoreClient("127.0.0.1", server.port, timeout=30)
    waiter = StoreClient("127.0.0.1", server.port, timeout=30)
    said: list[BaseException] = []
    try:
        client.set("k", b"v")  # answered: accepted after the stranger, whose thread then runs
        assert bytes(client.get("k")) == b"v"

        def wait_for_a_key_never_set():
            try:
                waiter.get("never")
            except BaseException as err:  # noqa: BLE001  (what it raises is the point)
                said.append(err)

        waiting = threading.Thread(target=wait_for_a_key_never_set)
        waiting.start()
        while True:  # its GET is in: the server's thread for it waits for the key
            with server._cond:
                if server._cond._waiters:
                    break
        theirs = set(threading.enumerate()) - others - {waiting}
        assert len(theirs) == 4  # accepting, and a thread for each of three connections
        server.close()
        waiting.join(timeout=30)
        assert not any(t.is_alive() for t in theirs)
        assert [type(e) for e in said] == [StoreError], said
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert stranger.recv(1) == b""  # its connection shut down
        server.close()  # twice: nothing more to do
    finally:
        for sock in (stranger, client, waiter):
            sock.close()
        server.close()
