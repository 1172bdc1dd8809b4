"""What every collective protocol shares: its descriptor, its outbox, and the sans-I/O contract.

A protocol is a state machine. The session feeds it authenticated messages, in runs from one
sender (`receive(run, now)`, see wire.runs), and the clock (`handle_timer(now)`); it says what
it wants to send by filling per-route queues that the engine drains at the rate the network
allows (`pop(route)`), and when it wants to be woken (`get_timer()`). It never touches a socket,
a thread or the real clock, so loss, reordering and timeouts are tested deterministically and
the same code runs on the wire.
"""

from __future__ import annotations

import collections
import enum
import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from overcast.buffers import REDUCE_OPS, dtype_code, dtype_from_code
from overcast.errors import ProtocolError, Rejected
from overcast.wire.header import Kind, is_aggregator
from overcast.wire.runs import Run

if TYPE_CHECKING:
    from overcast.native import _core

# Routes: where a message goes. (channel, peer); peer is a rank, or -1 for the multicast group
# or the aggregator.
STREAM, DATAGRAM, MULTICAST = 0, 1, 2

COLLECTIVES = ("all_gather", "reduce_scatter", "broadcast", "all_to_all")
ALGORITHMS = ("ring", "multicast", "innetwork", "pairwise")
OPS = ("none", *REDUCE_OPS)

_DESCRIPTOR = struct.Struct("<BBBBQII")


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What a rank asked for at one sequence number; ranks compare these to catch mismatches."""

    collective: str
    algorithm: str
    dtype: np.dtype
    count: int  # elements per rank (the shard); an all_to_all's: per row
    op: str = "none"
    param: int = 0  # broadcast root, or the number of multicast roots
    # Bytes per datagram chunk, as the datagram protocols cut the data (each rank cuts for its
    # path MTU, and chunk numbers mean nothing across ranks that cut differently); 0 for rings.
    chunk_bytes: int = 0

    SIZE = _DESCRIPTOR.size

    def pack(self) -> bytes:
        return _DESCRIPTOR.pack(
            COLLECTIVES.index(self.collective),
            ALGORITHMS.index(self.algorithm),
            dtype_code(self.dtype),
            OPS.index(self.op),
            self.count,
            self.param,
            self.chunk_bytes,
        )

    @classmethod
    def unpack(cls, payload) -> Descriptor:
        try:
            c, a, d, o, count, param, chunk_bytes = _DESCRIPTOR.unpack(payload)
            return cls(
                COLLECTIVES[c], ALGORITHMS[a], dtype_from_code(d), count, OPS[o], param, chunk_bytes
            )
        except (struct.error, IndexError, ValueError) as err:
            raise ProtocolError(f"undecodable collective descriptor: {err}") from None

    def stream_bytes_bound(self, world: int) -> int:
        """The most payload a peer sends one rank on its stream for this call, with what came
        before it posted: every rank's block (a broadcast's buffer, a row each) once."""
        return world * self.count * self.dtype.itemsize

    def cut(self, chunk_bytes: int, whole: int) -> Descriptor:
        """This call as a datagram protocol cuts `whole` bytes (a segment, a block) into chunks
        of `chunk_bytes`: what every rank's cut must match. Data within one chunk is cut alike
        whatever the chunk size, so the chunk counts for at most `whole`."""
        return replace(self, chunk_bytes=min(chunk_bytes, whole))

    def __str__(self) -> str:
        op = f", {self.op}" if self.op != "none" else ""
        param = f", param={self.param}" if self.param else ""
        chunks = f", {self.chunk_bytes} B chunks" if self.chunk_bytes else ""
        return (
            f"{self.collective}({self.algorithm}, {self.count} x {self.dtype}{op}{param}{chunks})"
        )


@dataclass(slots=True)
class Outgoing:
    """One message a protocol wants sent; the engine seals it (header, MAC) when it goes out."""

    kind: int
    seq: int
    chunk: int
    payload: object  # any contiguous buffer; copied when sealed
    dst: int
    # what the payload's buffer belongs to, for the streams that write it from where it lies
    # (engine.Engine._finish): its collective's `seq` when None
    holder: int | None = None


class Phase(enum.Enum):
    """Where a collective is in its life. Each protocol says in which phases it takes each kind
    of message; `Collective.enter` allows only the transitions in `_NEXT`."""

    POSTED = "posted"
    WAITING = "waiting for its turn to send"
    SENDING = "sending its own data"
    RECEIVING = "receiving"
    DRAINING = "every byte in place; its last messages queued"
    DONE = "done"
    FAILED = "failed"


_NEXT = {
    Phase.POSTED: {Phase.WAITING, Phase.SENDING, Phase.RECEIVING, Phase.DRAINING, Phase.FAILED},
    Phase.WAITING: {Phase.SENDING, Phase.FAILED},
    Phase.SENDING: {Phase.RECEIVING, Phase.FAILED},
    Phase.RECEIVING: {Phase.DRAINING, Phase.FAILED},
    Phase.DRAINING: {Phase.DONE, Phase.FAILED},
    # Done here, but the session holds it until every peer's DESCRIBE has matched: an abort
    # meanwhile still fails it.
    Phase.DONE: {Phase.FAILED},
    Phase.FAILED: set(),
}
# Every phase after start: copies of data already in place (a repair that crossed a multicast
# chunk, a result sent again) may come until the session lets the collective go.
STARTED = frozenset((Phase.WAITING, Phase.SENDING, Phase.RECEIVING, Phase.DRAINING, Phase.DONE))


@dataclass(frozen=True, slots=True)
class Accept:
    """One row of a protocol's table of incoming messages: the method that handles the kind,
    the attribute that names who may send it (a rank, or a frozenset of ranks), the phases in
    which it may arrive, and whether the handler takes a whole run (wire.runs) at once rather
    than (header, payload) one message at a time."""

    handler: str
    sender: str
    phases: frozenset = STARTED
    runs: bool = False


class Collective:
    """Base of a collective's state machine.

    Subclasses list the messages they take in `ACCEPTS` (kind -> Accept), fill
    `self.outbox[route]`, move through `Phase`s with `enter`, and call `self._check_done()`.
    Whatever does not fit is rejected with `reject(reason, message)`: one line per check.
    """

    # Whether the collective may finish only once every peer's DESCRIBE has matched. A ring's
    # data passes every rank on the streams behind the DESCRIBEs, so a mismatch always shows
    # first; datagram protocols need the check, or a rank could finish a mismatched call.
    verify_every_peer = False
    # Whether every peer will send it an end-of-multicast notice before anything else it
    # sends on its stream but repair requests (both carry the sender's descriptor, checked as
    # a DESCRIBE is): then it describes itself to no one.
    described_by_end_notices = False
    ACCEPTS: dict[int, Accept] = {}

    def __init__(self, seq: int, rank: int, world: int, desc: Descriptor):
        self.seq, self.rank, self.world, self.desc = seq, rank, world, desc
        self.described = desc.pack()  # as DESCRIBEs, end notices and repair requests carry it
        self.outbox: dict[tuple[int, int], collections.deque[Outgoing]] = {}
        self.phase = Phase.POSTED
        # Steps toward the result (data stored, own data sent, a notice or credit taken), not
        # messages: the session's timeout runs from the last step, so copies and retransmissions
        # going round without end cannot keep a stuck collective alive.
        self.progress = 0
        self.error: BaseException | None = None
        self.stats: collections.Counter = collections.Counter()
        self._plane: _core.Plane | None = None

    @property
    def plane(self) -> _core.Plane:
        """The rank's native datagram plane, which the session gives every collective it posts
        (Session.post); the protocols that run there reach it only once posted."""
        if self._plane is None:
            raise RuntimeError(f"{self} on rank {self.rank} is not posted: it has no plane")
        return self._plane

    @plane.setter
    def plane(self, plane: _core.Plane) -> None:
        self._plane = plane

    @property
    def holder(self) -> int:
        """What the engine knows this collective's buffers by (Outgoing.holder): its number."""
        return self.seq

    def __str__(self) -> str:
        return f"{self.desc} #{self.seq}"

    @property
    def received_all(self) -> bool:
        return self.phase in (Phase.DRAINING, Phase.DONE)

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def enter(self, phase: Phase) -> None:
        """Move to `phase`; a move the lifecycle does not allow is a bug in the protocol."""
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(
                f"{type(self).__name__} #{self.seq} on rank {self.rank}: "
                f"{self.phase.name} -> {phase.name} is not a transition"
            )
        self.phase = phase

    def reject(self, reason: str, message: str) -> NoReturn:
        raise Rejected(f"{self.desc} #{self.seq} on rank {self.rank}: {message}", reason)

    # -- the sans-I/O contract -------------------------------------------------------------
    def start(self, now: float) -> None:
        """Called once when the session posts the collective."""

    def receive(self, run: Run, now: float) -> None:
        """Check a run of messages (wire.runs: one kind, one sender) against `ACCEPTS` (kind,
        sender, phase) once, and hand it on."""
        hdr = run.hdr
        rule = self.ACCEPTS.get(hdr.kind)
        if rule is None:
            self.reject(
                "unexpected_kind",
                f"{Kind(hdr.kind).name} from rank {hdr.src} is not part of this protocol",
            )
        allowed = getattr(self, rule.sender)
        if not (hdr.src in allowed if isinstance(allowed, frozenset) else hdr.src == allowed):
            self.reject(
                "wrong_sender",
                f"{Kind(hdr.kind).name} from rank {hdr.src}; only "
                f"{rule.sender} ({_ranks(allowed)}) sends it",
            )
        if self.phase not in rule.phases:
            self.reject(
                "wrong_phase", f"{Kind(hdr.kind).name} from rank {hdr.src} while {self.phase.value}"
            )
        handler = getattr(self, rule.handler)
        if rule.runs:
            handler(run, now)
        else:
            for hdr, payload in run.messages():
                handler(hdr, payload, now)
        self.after_receive(now)

    def after_receive(self, now: float) -> None:
        """Called after every message a handler took."""

    def get_timer(self) -> float | None:
        return None

    def native_news(self, now: float) -> None:
        """The rank's native plane has news of this collective (see Session.poll_plane)."""

    def stepped_at(self) -> float | None:
        """When the collective last made progress the session did not see (in the native
        plane), or None."""
        return None

    def handle_timer(self, now: float) -> None:
        """Called when `get_timer()` has passed."""

    def finished(self) -> None:
        """Called once when the collective is done or failed: release shared resources."""

    def described_by(self, peer: int, extra: memoryview, now: float) -> None:
        """A peer's DESCRIBE matched this call's; `extra` is what it carried after its
        descriptor (this call's `described` may carry more than the descriptor)."""

    def withdrawal(self) -> list[tuple[tuple[int, int], Outgoing]]:
        """What to send, as (route, message), when a peer refused the call and the communicator
        goes on without it: whatever this rank started elsewhere for it, given up."""
        return []

    def waiting_for(self) -> str:
        """What the collective still waits for, for timeout messages."""
        return "data"

    def state_bytes(self) -> int:
        """Bytes of bookkeeping this collective owns (its own arrays, not the caller's buffers
        it reads and writes in place)."""
        return sum(
            v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray) and v.base is None
        )

    # -- outbox ----------------------------------------------------------------------------
    def queue(self, route: tuple[int, int], msg: Outgoing) -> None:
        self.queue_all(route, (msg,))

    def queue_all(self, route: tuple[int, int], msgs) -> None:
        """Queue several messages for the route, in order (a batch: one call, not one each)."""
        box = self.outbox.get(route)
        if box is None:
            box = self.outbox[route] = collections.deque()
        box.extend(msgs)

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
        if self.phase is Phase.DRAINING and not self.outbox:
            self.enter(Phase.DONE)

    def fail(self, error: BaseException) -> None:
        if self.phase is not Phase.FAILED:
            self.enter(Phase.FAILED)
            self.error = error
            self.outbox.clear()


def _ranks(allowed) -> str:
    if allowed is None:
        return "nobody"
    if isinstance(allowed, frozenset) and allowed and all(map(is_aggregator, allowed)):
        return "the aggregator"
    if isinstance(allowed, frozenset):
        return "ranks " + ", ".join(map(str, sorted(allowed))) if allowed else "nobody"
    return f"rank {allowed}"
