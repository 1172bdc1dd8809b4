"""An in-memory network for sans-I/O protocol tests: sessions exchange messages through queues,
on a clock the test controls. Stream routes stay in order per pair of ranks, as TCP keeps them."""

from __future__ import annotations

import collections
import random

from overcast.protocols.session import Session
from overcast.wire.header import Header


class Fabric:
    def __init__(self, world: int, timeout: float = 10.0, seed: int = 0):
        self.world = world
        self.sessions = [Session(r, world, timeout) for r in range(world)]
        self.now = 0.0
        self.rng = random.Random(seed)
        self.queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self.silent: set[int] = set()
        self.delivered = 0

    def post(self, rank: int, coll) -> None:
        self.sessions[rank].post(coll, self.now)

    def _collect(self) -> None:
        for src, session in enumerate(self.sessions):
            if src in self.silent:
                continue
            for route in list(session.pending_routes()):
                while (msg := session.pop(route)) is not None:
                    payload = bytes(memoryview(msg.payload).cast("B"))
                    hdr = Header(msg.kind, 0, 0, msg.seq, src, msg.dst, msg.chunk,
                                 len(payload), 0)
                    self.queues[(src, route[1])].append((hdr, payload))

    def step(self) -> bool:
        """Deliver one message from a randomly chosen non-empty pair; False if none is left."""
        self._collect()
        pairs = [p for p, q in self.queues.items() if q]
        if not pairs:
            return False
        src, dst = self.rng.choice(pairs)
        hdr, payload = self.queues[(src, dst)].popleft()
        if dst not in self.silent:
            self.sessions[dst].receive(hdr, memoryview(payload), self.now)
        self.delivered += 1
        return True

    def run(self, limit: int = 10_000_000) -> None:
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("fabric did not go quiet")

    def advance(self, seconds: float) -> None:
        """Move the clock and fire every timer that has come due."""
        self.now += seconds
        for session in self.sessions:
            timer = session.get_timer()
            if timer is not None and self.now >= timer:
                session.handle_timer(self.now)
