"""An in-memory network for sans-I/O protocol tests: sessions exchange messages through queues,
on a clock the test controls.

Stream routes stay in order per pair of ranks, as TCP keeps them. Datagram and multicast routes
may lose, duplicate and reorder, from a seeded generator; multicast goes to every other rank.
With `runs` above 1, datagrams that one sender queued back to back are delivered up to that
many at once, as a run (overcast.wire.runs), as a GRO read hands them on.
An aggregator (overcast.aggregator.reduction), if given, is reached by datagram as peer AGGREGATOR;
several fabrics (communicators) may share one, each under its own key. A list of aggregators
are the endpoints in-network reductions are striped over (native/common/numbering.h): endpoint e is
peer endpoint(e), registered as that stripe.
"""

from __future__ import annotations

import collections
import random

from overcast.protocols.base import MULTICAST, STREAM
from overcast.protocols.session import EARLY_STREAM_BYTES, Session
from overcast.transport.loss import LossModel, LossSpec
from overcast.wire.header import AGGREGATOR, ANY, Header, endpoint, is_aggregator
from overcast.wire.runs import Run


class Fabric:
    def __init__(self, world: int, timeout: float = 10.0, seed: int = 0, loss: float = 0.0,
                 burst: int = 1, duplicate: float = 0.0, reorder: bool = False,
                 aggregator=None, key="comm", runs: int = 1,
                 early_stream_bytes: int = EARLY_STREAM_BYTES):
        self.world, self.runs = world, runs
        self.aggregators = [] if aggregator is None else \
            aggregator if isinstance(aggregator, list) else [aggregator]
        self.aggregator, self.key = aggregator, key
        for stripe, agg in enumerate(self.aggregators):
            agg.register(key, world, stripe=stripe)
        self.sessions = [Session(r, world, timeout, early_stream_bytes=early_stream_bytes)
                         for r in range(world)]
        for session in self.sessions:
            session.plane.set_stripes(max(len(self.aggregators), 1))
        self.now = 0.0
        self.rng = random.Random(seed)
        # loss=1.0 drops every datagram (a LossSpec, made for real runs, stops short of it)
        self.losses = [] if loss == 1.0 else \
            [LossModel(LossSpec(loss, burst, seed), r) for r in range(world + 1)]
        self.duplicate, self.reorder = duplicate, reorder
        self.streams: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self.datagrams: dict[tuple[int, int], list] = collections.defaultdict(list)
        self.silent: set[int] = set()
        # what an eavesdropper saw go by, as it was sent: (header, payload, by datagram)
        self.seen: collections.deque = collections.deque(maxlen=4096)
        self.dropped = self.duplicated = self.delivered = 0

    def post(self, rank: int, coll) -> None:
        self.sessions[rank].post(coll, self.now)

    def _lossy(self, src: int, dst: int, hdr, payload) -> None:
        if not self.losses or self.losses[min(dst, self.world)].drop():
            self.dropped += 1
            return
        copies = 2 if self.rng.random() < self.duplicate else 1
        self.duplicated += copies - 1
        self.datagrams[(src, dst)].extend([(hdr, payload)] * copies)

    def _collect(self) -> None:
        for stripe, agg in enumerate(self.aggregators):
            src = endpoint(stripe)
            mine = [item for item in agg.outbox if item[0] == self.key]
            others = [item for item in agg.outbox if item[0] != self.key]
            agg.outbox.clear()
            agg.outbox.extend(others)
            if src in self.silent:  # dead, or cut off: what it sends goes nowhere
                continue
            for _, dst, msg in mine:
                payload = bytes(msg.payload)
                hdr = Header(msg.kind, 0, 0, msg.seq, src, dst, msg.chunk, len(payload), 0)
                self.seen.append((hdr, payload, True))
                for rank in range(self.world) if dst == ANY else [dst]:
                    self._lossy(src, rank, hdr, payload)
        for src, session in enumerate(self.sessions):
            if src in self.silent:
                continue
            for route in list(session.pending_routes()):
                while (msg := session.pop(route)) is not None:
                    parts = msg.payload if isinstance(msg.payload, tuple) else (msg.payload,)
                    payload = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
                    hdr = Header(msg.kind, 0, 0, msg.seq, src, msg.dst, msg.chunk,
                                 len(payload), 0)
                    channel, peer = route
                    self.seen.append((hdr, payload, channel != STREAM))
                    if channel == STREAM:
                        self.streams[(src, peer)].append((hdr, payload))
                        continue
                    targets = [r for r in range(self.world) if r != src] \
                        if channel == MULTICAST else [peer]
                    for dst in targets:
                        self._lossy(src, dst, hdr, payload)

    def step(self) -> bool:
        """Deliver one message from a randomly chosen pair; False if none is left."""
        self._collect()
        pairs = [("s", p) for p, q in self.streams.items() if q] + \
                [("d", p) for p, q in self.datagrams.items() if q]
        if not pairs:
            return False
        what, (src, dst) = self.rng.choice(pairs)
        if what == "s":
            run = Run.one(*self.streams[(src, dst)].popleft())
        else:
            queue = self.datagrams[(src, dst)]
            i = self.rng.randrange(len(queue)) if self.reorder else 0
            batch = [queue.pop(i)]
            while len(batch) < self.runs and i < len(queue) and _joins(batch[-1][0], queue[i][0]):
                batch.append(queue.pop(i))
            run = Run(batch[0][0], [hdr.chunk for hdr, _ in batch],
                      memoryview(b"".join(payload for _, payload in batch)), 0,
                      batch[0][0].length)
        if is_aggregator(dst):
            if dst not in self.silent:
                self.aggregators[AGGREGATOR - dst].receive_run(self.key, run, self.now)
        elif dst not in self.silent:
            self.sessions[dst].receive_run(run, self.now, what == "d")
        self.delivered += len(run)
        return True

    def run(self, limit: int = 10_000_000) -> None:
        """Deliver until nothing is in flight (the clock does not move)."""
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("fabric did not go quiet")

    def _machines(self):
        return self.sessions + self.aggregators

    def advance(self, seconds: float) -> None:
        """Move the clock and fire every timer that has come due."""
        self.now += seconds
        self._fire()

    def _fire(self) -> None:
        for machine in self._machines():
            timer = machine.get_timer()
            if timer is not None and self.now >= timer:
                machine.handle_timer(self.now)

    def run_timed(self, until: float = 60.0, messages: int | None = None) -> None:
        """Deliver, and whenever the network is quiet jump to the next timer, until no timer is
        left before `until` (simulated seconds), or `messages` are delivered."""
        left = messages
        while True:
            if left is None:
                self.run()
            else:
                while left and self.step():
                    left -= 1
                if not left:
                    return
            if self.done():
                return
            timers = [t for m in self._machines() if (t := m.get_timer()) is not None]
            if not timers or min(timers) > until:
                return
            self.now = max(self.now, min(timers))
            self._fire()

    def done(self) -> bool:
        """Nothing in flight and no collective left on any rank."""
        return all(not s.active for s in self.sessions) and not any(
            q for q in self.streams.values()) and not any(q for q in self.datagrams.values())


def _joins(last, hdr) -> bool:
    """Whether a datagram may follow `last` in a run."""
    return (hdr.kind, hdr.seq, hdr.src, hdr.dst, hdr.length) == \
        (last.kind, last.seq, last.src, last.dst, last.length) and hdr.chunk > last.chunk
