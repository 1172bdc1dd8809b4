"""What every collective protocol shares: its descriptor, its outbox, and the sans-I/O contract.

A protocol is a state machine. The session feeds it authenticated messages and the clock
(`receive(hdr, payload, now)`, `handle_timer(now)`); it says what it wants to send by filling
per-route queues that the engine drains at the rate the network allows (`pop(route)`), and when
it wants to be woken (`get_timer()`). It never touches a socket, a thread or the real clock, so
loss, reordering and timeouts are tested deterministically and the same code runs on the wire.
"""

from __future__ import annotations

import collections
import struct
from dataclasses import dataclass

import numpy as np

from overcast.buffers import dtype_code, dtype_from_code
from overcast.errors import ProtocolError

# Routes: where a message goes. (channel, peer); peer is a rank, or -1 for the multicast group
# or the aggregator.
STREAM, DATAGRAM, MULTICAST = 0, 1, 2

COLLECTIVES = ("all_gather", "reduce_scatter", "broadcast")
ALGORITHMS = ("ring", "multicast", "innetwork")
OPS = ("none", "sum", "avg")

_DESCRIPTOR = struct.Struct("<BBBBQI")


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What a rank asked for at one sequence number; ranks compare these to catch mismatches."""

    collective: str
    algorithm: str
    dtype: np.dtype
    count: int  # elements per rank (the shard)
    op: str = "none"
    param: int = 0  # broadcast root, or the number of multicast roots

    def pack(self) -> bytes:
        return _DESCRIPTOR.pack(COLLECTIVES.index(self.collective),
                                ALGORITHMS.index(self.algorithm), dtype_code(self.dtype),
                                OPS.index(self.op), self.count, self.param)

    @classmethod
    def unpack(cls, payload) -> "Descriptor":
        try:
            c, a, d, o, count, param = _DESCRIPTOR.unpack(payload)
            return cls(COLLECTIVES[c], ALGORITHMS[a], dtype_from_code(d), count, OPS[o], param)
        except (struct.error, IndexError, ValueError) as err:
            raise ProtocolError(f"undecodable collective descriptor: {err}") from None

    def __str__(self) -> str:
        op = f", {self.op}" if self.op != "none" else ""
        param = f", param={self.param}" if self.param else ""
        return f"{self.collective}({self.algorithm}, {self.count} x {self.dtype}{op}{param})"


@dataclass(slots=True)
class Outgoing:
    """One message a protocol wants sent; the engine seals it (header, MAC) when it goes out."""

    kind: int
    seq: int
    chunk: int
    payload: object  # any contiguous buffer; copied when sealed
    dst: int


class Collective:
    """Base of a collective's state machine.

    Subclasses fill `self.outbox[route]` and call `self._check_done()`; they set `received_all`
    when every byte they need is in place.
    """

    # Whether the collective may finish only once every peer's DESCRIBE has matched. A ring's
    # data passes every rank on the streams behind the DESCRIBEs, so a mismatch always shows
    # first; datagram protocols need the check, or a rank could finish a mismatched call.
    verify_every_peer = False

    def __init__(self, seq: int, rank: int, world: int, desc: Descriptor):
        self.seq, self.rank, self.world, self.desc = seq, rank, world, desc
        self.outbox: dict[tuple[int, int], collections.deque[Outgoing]] = {}
        self.received_all = False
        self.done = False
        self.error: BaseException | None = None
        self.stats: collections.Counter = collections.Counter()

    # -- the sans-I/O contract -------------------------------------------------------------
    def start(self, now: float) -> None:
        """Called once when the session posts the collective."""

    def receive(self, hdr, payload: memoryview, now: float) -> None:
        raise NotImplementedError

    def get_timer(self) -> float | None:
        return None

    def handle_timer(self, now: float) -> None:
        """Called when `get_timer()` has passed."""

    def finished(self) -> None:
        """Called once when the collective is done or failed: release shared resources."""

    def waiting_for(self) -> str:
        """What the collective still waits for, for timeout messages."""
        return "data"

    def state_bytes(self) -> int:
        """Bytes of bookkeeping this collective owns (its own arrays, not the caller's buffers
        it reads and writes in place)."""
        return sum(v.nbytes for v in vars(self).values()
                   if isinstance(v, np.ndarray) and v.base is None)

    # -- outbox ----------------------------------------------------------------------------
    def queue(self, route: tuple[int, int], msg: Outgoing) -> None:
        box = self.outbox.get(route)
        if box is None:
            box = self.outbox[route] = collections.deque()
        box.append(msg)

    def pop(self, route: tuple[int, int]) -> Outgoing | None:
        box = self.outbox.get(route)
        if not box:
            return None
        msg = box.popleft()
        if not box:
            del self.outbox[route]
            self._check_done()
        return msg

    def take_all(self, route: tuple[int, int]) -> collections.deque[Outgoing] | None:
        """Every message queued for the route, at once."""
        box = self.outbox.pop(route, None)
        if box:
            self._check_done()
        return box

    def _check_done(self) -> None:
        if self.received_all and not self.outbox:
            self.done = True

    def fail(self, error: BaseException) -> None:
        if not self.done and self.error is None:
            self.error = error
            self.outbox.clear()
