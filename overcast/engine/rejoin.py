"""Registering anew with the aggregators a communicator lost, in case they were restarted.

A registration blocks (a TCP connect and a handshake, up to REJOIN_SECONDS), so it runs on a
thread of its own, never the engine's. It tries every lost aggregator the engine
names each REJOIN_SECONDS and hands each registration that succeeds to the engine, which
watches its connection and tells the session (protocols.failover takes it back once every rank
has registered). It never seals: the HELLO is sealed on the engine's thread (`seal`), which
owns the sealer's counter.

Lifetime: the thread ends when `stop` is called, at the latest one registration's timeout
(REJOIN_SECONDS) later; a registration it makes after `stop` is closed, never handed over.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import time

from overcast.protocols.failover import REJOIN_REFUSED_SECONDS, REJOIN_SECONDS
from overcast.transport.rendezvous import Registration

# reregister(peer, epoch, seal, timeout) -> Registration, or why not (Links.reregister)
Reregister = Callable[[int, int, Callable[[bytes, int], bytes], float], "Registration | str"]


class Rejoiner:
    def __init__(
        self,
        name: str,
        reregister: Reregister,
        seal: Callable[[bytes, int], concurrent.futures.Future],
        registered: Callable[[int, Registration], bool],
    ):
        """`seal(payload, dst)`: a future of the HELLO sealed on the engine's thread;
        `registered(peer, registration)`: hands one to the engine (False: it is closed)."""
        self._reregister, self._seal, self._registered = reregister, seal, registered
        self._lock = threading.Lock()
        self._wanted: list[int] = []
        self._epoch = 0
        self._resting: dict[int, float] = {}  # aggregators refused, until when (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"overcast-rejoin-{name}", daemon=True
        )
        self._thread.start()

    def want(self, peers: list[int], epoch: int) -> None:
        """The aggregators to register with anew (their first endpoints' ids), at `epoch`."""
        with self._lock:
            self._wanted, self._epoch = list(peers), epoch

    def refused(self, peer: int) -> None:
        """Aggregator `peer` answered but could not be taken back: tried again only after
        REJOIN_REFUSED_SECONDS (an operator may restart it as it was)."""
        with self._lock:
            self._resting[peer] = time.monotonic() + REJOIN_REFUSED_SECONDS

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        """Once stopped: within one registration's timeout."""
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(REJOIN_SECONDS):
            with self._lock:
                now = time.monotonic()
                wanted = [p for p in self._wanted if self._resting.get(p, now) <= now]
                epoch = self._epoch
            for peer in wanted:
                if self._stop.is_set():
                    return
                got = self._reregister(peer, epoch, self._sealed, REJOIN_SECONDS)
                if isinstance(got, str):  # not back yet (or not reachable): tried again
                    continue
                if self._stop.is_set() or not self._registered(peer, got):
                    got.sock.close()

    def _sealed(self, payload: bytes, dst: int) -> bytes:
        """The HELLO sealed by the engine; ConnectionError if it is closing (the registration
        then fails)."""
        try:
            return self._seal(payload, dst).result(timeout=REJOIN_SECONDS * 5)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            raise ConnectionError("the communicator is closing") from None
