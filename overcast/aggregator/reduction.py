"""The aggregator's reduction engine: what a switch that sums does (SHARP's aggregation nodes,
SwitchML's software stand-in), for many communicators at once.

The engine is native (overcast/native/aggregator/aggregator.h says how it works, message by
message, and who owns which buffer); this is its Python face for the control plane and the
sans-I/O tests: communicators named by any key, messages in as the fabric delivers them
(authentic runs, overcast.wire.runs), the clock in; what it wants sent out, in `outbox`, as
(key, destination rank, Outgoing). The service (overcast.aggregator.service) runs the same engine on
each of its shards' threads (native/aggregator/shards.h), sealed datagrams in and out, without
Python in the loop.

Whatever does not fit is dropped and counted in `drops` by reason (one line each): any rank of a
communicator can be impersonated by a replay, so nothing here raises.
"""

from __future__ import annotations

import collections
import itertools

from overcast.limits import check_slots
from overcast.native import EXPIRY_SECONDS, MAX_REDUCTIONS, MAX_RESEND_SECONDS, RESEND_SECONDS
from overcast.native import Aggregator as Engine
from overcast.protocols.base import Outgoing
from overcast.wire.header import AGGREGATOR
from overcast.transport.datagram import MAX_DATAGRAM as MAX_ROW  # the widest a datagram holds
from overcast.wire.runs import Run


class Aggregator:
    """`slots` per reduction at most; a reduction with no contribution or acknowledgement for
    `expiry` seconds (default EXPIRY_SECONDS) is given up, its memory freed."""

    def __init__(self, slots: int = 256, expiry: float | None = None):
        check_slots(slots)
        self.slots = slots
        self.engine = Engine(slots, EXPIRY_SECONDS if expiry is None else expiry)
        self.outbox: collections.deque[tuple[object, int, Outgoing]] = collections.deque()
        self._handles: dict[object, int] = {}
        self._keys: dict[int, object] = {}
        self._ids: dict[object, tuple[int, int]] = {}
        self._unkeyed = itertools.count(1)  # wire ids for communicators registered without

    # -- registration ----------------------------------------------------------------------
    def register(
        self,
        key,
        world: int,
        slots: int | None = None,
        *,
        ids: tuple[int, int] | None = None,
        secret_key: bytes | None = None,
        counter: int = 0,
        max_row: int = MAX_ROW,
        stripe: int = 0,
    ) -> int:
        """Take a communicator of `world` ranks under `key`; its reductions get at most `slots`
        slots (and never more than the aggregator's own) and contributions of at most
        `max_row` bytes, as the job's aggregator endpoint `stripe` (it takes that stripe's
        chunks, native/common/numbering.h, and sends as wire.header.endpoint(stripe)). `ids` are its
        job and communicator ids on the wire, and `secret_key` its key, for an engine that
        opens and seals its datagrams (sealing counts on from `counter`). Returns the slots
        granted."""
        if ids is None:
            ids = self._ids.get(key) or (0, next(self._unkeyed))
        self._ids[key] = ids
        handle, granted = self.engine.register(
            *ids, world, slots or 0, secret_key, counter, max_row, stripe
        )
        self._handles[key], self._keys[handle] = handle, key
        return granted

    def unregister(self, key) -> None:
        handle = self._handles.pop(key, None)
        if handle is not None:
            self.engine.unregister(handle)
            del self._keys[handle]
            del self._ids[key]

    def handle(self, key) -> int:
        """The engine's handle of a registered communicator."""
        return self._handles[key]

    # -- the contract ----------------------------------------------------------------------
    def receive(self, key, hdr, payload, now: float) -> None:
        """Take one authentic message."""
        self.receive_run(key, Run.one(hdr._replace(length=len(payload)), payload), now)

    def receive_run(self, key, run: Run, now: float) -> None:
        """Take a run of authentic messages from one rank (wire.runs); a run that does not fit
        is dropped whole, each of its messages counted."""
        self.engine.receive_run(self._handles.get(key, -1), *run.as_plane_args(), now)
        self._take()

    def get_timer(self) -> float | None:
        return self.engine.timer()

    def handle_timer(self, now: float) -> None:
        """Ask again for overdue contributions, send again unacknowledged results."""
        self.engine.handle_timer(now)
        self._take()

    def _take(self) -> None:
        for handle, dst, kind, seq, chunk, payload in self.engine.take_outbox():
            key = self._keys.get(handle)
            if key is not None:
                self.outbox.append((key, dst, Outgoing(kind, seq, chunk, payload, dst)))

    # -- what it has counted ---------------------------------------------------------------
    @property
    def drops(self) -> collections.Counter:
        return collections.Counter(self.engine.counters()[0])

    @property
    def stats(self) -> collections.Counter:
        return collections.Counter(self.engine.counters()[1])

    @property
    def pool_bytes(self) -> int:
        """Contribution rows alive, in every reduction's pool."""
        return self.engine.memory()[0]

    @property
    def peak_pool_bytes(self) -> int:
        return self.engine.memory()[1]

    @property
    def kept_pool_bytes(self) -> int:
        """The pools finished reductions left, each communicator's largest, kept for its next
        reduction until it is unregistered."""
        return self.engine.memory()[2]

    def resend_timeout(self, key, owner: int) -> float:
        """How long a result to `owner` waits for its acknowledgement before it is sent again
        (RFC 6298's, from the round trips measured to that owner)."""
        return self.engine.resend_timeout(self._handles[key], owner)

    def reductions(self, key) -> dict[int, int]:
        """The communicator's reductions in flight: collective sequence -> chunks released."""
        return dict(self.engine.reductions(self._handles[key]))


__all__ = ["Aggregator", "AGGREGATOR", "MAX_REDUCTIONS", "MAX_RESEND_SECONDS", "RESEND_SECONDS"]
