"""One rank's view of a communicator, sans I/O: the collectives in flight, the cross-rank checks
that turn mismatches into errors on every rank, and the timeouts that keep anything from hanging.

Fed authenticated messages and the clock by the engine; gives back messages to send per route.
"""

from __future__ import annotations

import collections

from overcast.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    OvercastError,
    PeerFailureError,
    ProtocolError,
    Rejected,
    error_class,
)
from overcast.native import _core
from overcast.protocols.base import DATAGRAM, MULTICAST, STREAM, Collective, Descriptor, Outgoing
from overcast.protocols.failover import FAILOVER_COUNTERS, FAILOVER_SECONDS, RingInstead
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.protocols.p2p import OFFERS_HELD, P2P_KINDS, PointToPoint, Transfer
from overcast.protocols.rounds import AggregatorRounds
from overcast.units import human_bytes
from overcast.wire.header import ANY, HEADER_BYTES, Kind, MalformedError, is_aggregator
from overcast.wire.messages import pack_abort, pack_goodbye, unpack_abort, unpack_goodbye
from overcast.wire.runs import Run

_CONTROL = (Kind.DESCRIBE, Kind.ABORT, Kind.GOODBYE, Kind.REFUSE, Kind.FAILOVER, Kind.REJOIN)
# Stream messages that open with their sender's descriptor: a multicast AllGather's are the
# first it sends a peer, in place of a DESCRIBE (Collective.described_by_end_notices).
_DESCRIBED = (Kind.MCAST_END, Kind.REPAIR_REQUEST)
# The kinds that travel by datagram; every other kind goes on a peer's stream, and arriving by
# the other channel is a misfit. Datagrams may also be dropped when they arrive before their
# collective is posted and too many bytes are held already: the protocols repair such losses.
DATAGRAM_KINDS = frozenset(
    (Kind.MCAST_DATA, Kind.CONTRIB, Kind.RESULT, Kind.RESULT_ACK, Kind.CREDIT, Kind.WITHDRAW)
)
EARLY_DATAGRAM_BYTES = 16 * 1024 * 1024
# Stream messages for collectives not posted yet are never dropped (a stream is reliable) and
# every stream is always read (a peer's death or ABORT is seen at once): past this many bytes
# held in all, the communicator aborts, naming the peer that is furthest ahead.
EARLY_STREAM_BYTES = 256 << 20
EARLY_STREAM_ENV = "OVERCAST_EARLY_STREAM_BYTES"
# How many finished collectives keep their descriptor, to check a DESCRIBE that arrives late.
_HISTORY = 1024


class Session(AggregatorRounds):
    """The collectives of one rank in one communicator.

    `post` adds a collective (sequence numbers must come in order), `refuse` takes the next
    number for a call this rank refused, `transfer` adds a point-to-point send or recv (`p2p`:
    no number); `receive` takes a message; `pop(route)` gives the next message for a route;
    `get_timer`/`handle_timer` drive timeouts. Finished collectives (done or failed) are
    appended to `finished` for the engine to report, finished transfers to `p2p.finished`, and
    the numbers of collectives no peer can refuse any more (every peer has described a matching
    call, or it finished) to `verified`.

    `plane` is the rank's native datagram plane (overcast/native/rank/plane.h), which runs the
    per-datagram work of the collectives posted to it. Once attached to sockets, the engine runs
    it; until then (the in-memory fabric) the session does: its timers are the session's, its
    outbox is drained through `pop`, unsealed. Either way `poll_plane` finishes what it drained.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        timeout: float,
        drops: collections.Counter | None = None,
        plane=None,
        early_stream_bytes: int = EARLY_STREAM_BYTES,
        failover_seconds: float = FAILOVER_SECONDS,
    ):
        self.rank, self.world, self.timeout = rank, world, timeout
        self.plane = _core.Plane(rank, world) if plane is None else plane
        self._plane_drops: dict[str, int] = {}  # the plane's drops already in `drops`
        self.clock = 0.0  # the latest time the session was given
        # Datagrams that do not fit, by reason (misdirected, wrong_sender, out_of_range...):
        # the transport's own drop counter when the engine passes it, so one place counts all.
        self.drops = collections.Counter() if drops is None else drops
        self.active: dict[int, Collective] = {}
        self.last_progress: dict[int, float] = {}
        self.next_seq = 0
        self.early: dict[int, list] = collections.defaultdict(list)
        # finished collectives' descriptors; None for a call this rank refused (refuse)
        self.history: collections.OrderedDict[int, Descriptor | None] = collections.OrderedDict()
        # messages of no collective's outbox: control, and the plane's while the session runs it
        self.control: collections.deque[tuple[tuple[int, int], Outgoing]] = collections.deque()
        self.finished: list[Collective] = []
        self.verified: list[int] = []
        self.p2p = PointToPoint(rank, world)
        self.error: OvercastError | None = None
        self.closed_peers: dict[int, int] = {}
        self.lost_peers: set[int] = set()
        self.closing = False
        self.stale = 0
        self.early_dropped = 0
        self._early_datagram_bytes = 0
        self.early_stream_limit = early_stream_bytes
        self.early_stream_bytes: collections.Counter = collections.Counter()  # by sender
        self._early_stream_total = 0
        # the payload bytes held for each collective not posted, by sender, and what each
        # sender's DESCRIBE of it allows: the next collective's, up to that, are not counted
        # against the limit (a late rank holds one collective it is about to issue, whatever
        # its size, and no more than the limit of those after it)
        self._held_by: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self._allowed: dict[int, dict[int, int]] = collections.defaultdict(dict)
        self.stats: collections.Counter = collections.Counter(dict.fromkeys(FAILOVER_COUNTERS, 0))
        # collectives that verify every peer: seq -> peers whose DESCRIBE has not matched yet
        self.unverified: dict[int, set[int]] = {}
        self._rr = 0
        self._init_rounds(failover_seconds)

    # -- posting and finishing -----------------------------------------------------------
    def post(self, coll: Collective, now: float) -> None:
        self.clock = now
        if coll.seq != self.next_seq:
            raise ValueError(f"collective #{coll.seq} posted, #{self.next_seq} expected")
        self.next_seq += 1
        # off the counts before any is replayed: a replay that aborts clears them
        held = self._release(coll.seq)
        if self.error is not None:
            coll.fail(self.error)
            self.finished.append(coll)
            return
        for peer, count in self.closed_peers.items():
            if coll.seq >= count:
                coll.fail(
                    PeerFailureError(
                        f"rank {peer} closed the communicator after {count} collectives; "
                        f"{coll.desc} #{coll.seq} cannot run"
                    )
                )
                self.stale += len(held)
                self.finished.append(coll)
                return
        refusal = next((m for m in held if m[0].kind == Kind.REFUSE), None)
        if refusal is not None:  # refused by a peer before it was posted here: never started
            coll.fail(self._refusal_error(coll, *refusal))
            self.stale += len(held)
            self._remember(coll.seq, coll.desc)
            self.finished.append(coll)
            return
        deferred = False
        if self.failover is not None and isinstance(coll, InNetworkReduceScatter):
            if not self.failover.decided:  # waits for the decision
                self.failover.frozen[coll.seq] = coll
                coll.frozen = deferred = True
            elif coll.seq < self.ring_below or not self.lanes:
                coll = RingInstead(coll)
                self.stats["in_network_on_ring"] += 1
            else:
                coll.aggregator = self._lane_endpoints()
                if len(self.lanes) < self.stripes:
                    self.stats["in_network_on_fewer_endpoints"] += 1
        self.active[coll.seq] = coll
        self.last_progress[coll.seq] = now
        coll.plane = self.plane
        if self.world > 1:
            if coll.verify_every_peer:
                peers = self.unverified[coll.seq] = set(range(self.world)) - {self.rank}
            else:
                peers = {(self.rank + 1) % self.world}
            if not coll.described_by_end_notices:
                for peer in sorted(peers):
                    self._send_control(Kind.DESCRIBE, coll.seq, peer, coll.described)
        try:
            if not deferred:
                self._guard(coll, coll.start, now)
        except ValueError as err:  # the native plane refuses to run it: the settings given
            self.abort(
                InvalidArgumentError(
                    f"{coll.desc} #{coll.seq} cannot run on rank {self.rank}: {err}"
                )
            )
        for hdr, payload in held:
            self.receive(hdr, payload, now, hdr.kind in DATAGRAM_KINDS)
        self._settle(coll)

    def transfer(self, op: Transfer, now: float) -> None:
        """Post a point-to-point send or recv (protocols.p2p)."""
        self.clock = now
        if self.error is not None:
            self.p2p.end(op, self.error)
        elif op.peer in self.closed_peers:
            self.p2p.end(
                op, PeerFailureError(f"rank {op.peer} closed the communicator; {op} cannot run")
            )
        else:
            self.p2p.post(op, now)

    def refuse(self, seq: int, error: OvercastError, now: float) -> None:
        """This rank refused its call #seq (bad arguments, found before anything was sent): the
        number is taken as a collective's would be, and every peer is told why in place of a
        DESCRIBE, so that its own #seq fails with the reason, naming this rank, and the
        communicator goes on with the numbers alike on every rank."""
        self.clock = now
        if seq != self.next_seq:
            raise ValueError(f"call #{seq} refused, #{self.next_seq} expected")
        self.next_seq += 1
        self._remember(seq, None)
        self.stale += len(self._release(seq))
        if self.error is None:
            message = pack_abort(error.abort_code, str(error))
            for peer in range(self.world):
                if peer != self.rank and peer not in self.closed_peers:
                    self._send_control(Kind.REFUSE, seq, peer, message)

    def _release(self, seq: int) -> list[tuple]:
        """What peers sent for collective `seq` before it was posted, taken off the counts of
        what is held (a message's channel was checked on arrival: its kind says which)."""
        held = self.early.pop(seq, [])
        self._held_by.pop(seq, None)
        self._allowed.pop(seq, None)
        for hdr, payload in held:
            if hdr.kind in DATAGRAM_KINDS:
                self._early_datagram_bytes -= len(payload)
            else:
                self.early_stream_bytes[hdr.src] -= HEADER_BYTES + len(payload)
                self._early_stream_total -= HEADER_BYTES + len(payload)
        return held

    def _refusal_error(self, coll: Collective, hdr, payload) -> OvercastError:
        try:
            code, reason = unpack_abort(payload)
        except MalformedError:
            code, reason = InvalidArgumentError.abort_code, "a refusal without a reason"
        return error_class(code)(
            f"{coll.desc} #{coll.seq} on rank {self.rank}: rank "
            f"{hdr.src} refused the call: {reason}"
        )

    def _remember(self, seq: int, desc: Descriptor | None) -> None:
        self.history[seq] = desc
        while len(self.history) > _HISTORY:
            self.history.popitem(last=False)

    def _settle(self, coll: Collective) -> None:
        """Finish `coll` if it failed, or if it is done and every DESCRIBE it waits for has
        matched."""
        if coll.error is None and (not coll.done or self.unverified.get(coll.seq)):
            return
        if coll.seq in self.active:
            self.unverified.pop(coll.seq, None)
            del self.active[coll.seq]
            del self.last_progress[coll.seq]
            self._remember(coll.seq, coll.desc)
            self.stats.update(coll.stats)
            coll.finished()
            self.finished.append(coll)

    def _guard(self, coll: Collective, step, *args) -> None:
        """Run a protocol step; a protocol error aborts the whole communicator."""
        try:
            step(*args)
        except ProtocolError as err:
            self.abort(err)

    # -- receiving -------------------------------------------------------------------------
    def receive(self, hdr, payload: memoryview, now: float, datagram: bool) -> None:
        """Take an authentic message that came by datagram or on a peer's stream."""
        self.receive_run(Run.one(hdr, payload), now, datagram)

    def receive_run(self, run: Run, now: float, datagram: bool) -> None:
        """Take a run of authentic messages (wire.runs): what is checked of one is checked of
        all, so the run is checked once and fits or misfits whole."""
        self.clock = now
        hdr = run.hdr
        kind = hdr.kind
        if datagram != (kind in DATAGRAM_KINDS):
            # A stream frame lifted off the wire and sent to the datagram port, or a peer that
            # sends on its stream what goes by datagram.
            self._misfit(
                datagram,
                "wrong_channel",
                lambda: f"rank {hdr.src} sent {Kind(kind).name} on its stream",
            )
            return
        if hdr.dst != self.rank and hdr.dst != ANY:
            self._misfit(
                datagram,
                "misdirected",
                lambda: (
                    f"rank {hdr.src} sent {Kind(kind).name} for rank {hdr.dst} "
                    f"over its stream to rank {self.rank}"
                ),
            )
            return
        if kind in _CONTROL:
            for hdr, payload in run.messages():
                self._receive_control(hdr, payload, now)
            return
        if kind in P2P_KINDS:  # a stream's: one message a run
            try:
                self.p2p.receive(hdr, run.payload(0), now)
            except Rejected as err:
                self._misfit(datagram, err.reason, err.__str__)
                return
            if kind == Kind.P2P_OFFER and self.p2p.offers_held(hdr.src) > OFFERS_HELD:
                self.abort(OvercastError(self.p2p.too_many_offers(hdr.src)))
            return
        coll = self.active.get(hdr.seq)
        if coll is None:
            for hdr, payload in run.messages():
                self._hold(hdr, payload, datagram)
            return
        if not datagram and self.failover is not None and coll.seq in self.failover.frozen:
            # a peer that decided first runs the ring: kept until this rank has decided
            self.failover.held.extend((hdr, bytes(p)) for hdr, p in run.messages())
            return
        if kind in _DESCRIBED:  # checked before all else, as a DESCRIBE is
            for one, payload in run.messages():
                theirs = self._descriptor(one, payload)
                if theirs is None or not self._verify(coll.desc, theirs, one, coll, now):
                    return
        steps = coll.progress
        try:
            coll.receive(run, now)
        except Rejected as err:
            self._misfit(datagram, err.reason, err.__str__)
        if coll.progress != steps and hdr.seq in self.last_progress:
            self.last_progress[hdr.seq] = now
        self._settle(coll)
        self.poll_plane(now)

    def poll_plane(self, now: float | None = None) -> None:
        """Tell the collectives what the plane has news of (ranges to request, a multicast sent,
        everything in place, a reduction drained), and count what it dropped with the rest."""
        now = self.clock if now is None else now
        drops = self.plane.drops()
        if drops != self._plane_drops:
            self.drops.update({k: v - self._plane_drops.get(k, 0) for k, v in drops.items()})
            self._plane_drops = drops
        for seq in self.plane.news():
            coll = self.active.get(seq)
            if coll is not None:
                self._guard(coll, coll.native_news, now)
                self._settle(coll)

    def _hold(self, hdr, payload, datagram: bool) -> None:
        """A message for a collective not posted here yet (or finished already)."""
        if hdr.seq < self.next_seq or self.error is not None:
            self.stale += 1
        elif datagram:
            if self._early_datagram_bytes + len(payload) > EARLY_DATAGRAM_BYTES:
                self.early_dropped += 1
            else:
                self._early_datagram_bytes += len(payload)
                self.early[hdr.seq].append((hdr, bytes(payload)))
        else:
            self._hold_stream(hdr, payload)

    def _hold_stream(self, hdr, payload) -> None:
        self.early_stream_bytes[hdr.src] += HEADER_BYTES + len(payload)
        self._early_stream_total += HEADER_BYTES + len(payload)
        self._held_by[hdr.seq][hdr.src] += len(payload)
        self.early[hdr.seq].append((hdr, bytes(payload)))
        if self._counted_stream_bytes() > self.early_stream_limit:
            self.abort(OvercastError(self._too_far_ahead()))

    def _counted_stream_bytes(self) -> int:
        """What is held of the streams, less the next collective's payloads up to what each
        sender's DESCRIBE of it allows."""
        allowed = self._allowed.get(self.next_seq, {})
        spared = sum(
            min(held, allowed.get(src, 0))
            for src, held in self._held_by.get(self.next_seq, {}).items()
        )
        return self._early_stream_total - spared

    def _too_far_ahead(self) -> str:
        """Why the stream messages held here passed the limit: the peer most is held from, how
        far ahead it is, and the setting that allows more."""
        peer, held = self.early_stream_bytes.most_common(1)[0]
        seqs = [
            seq
            for seq, messages in self.early.items()
            if any(h.src == peer and h.kind not in DATAGRAM_KINDS for h, _ in messages)
        ]
        also = self._early_stream_total - held
        others = f" (and {human_bytes(also)} from other ranks)" if also else ""
        return (
            f"rank {peer} is {max(seqs) - self.next_seq + 1} collectives ahead of rank "
            f"{self.rank}: rank {self.rank} holds {human_bytes(held)} from it{others} for "
            f"collectives #{min(seqs)} to #{max(seqs)}, which it has not issued yet: "
            f"{self._counted_stream_bytes():,} B in all, past its limit of "
            f"{self.early_stream_limit:,} B; raise early_stream_bytes (the "
            f"Communicator's, or {EARLY_STREAM_ENV}) to let a rank fall further behind"
        )

    def _misfit(self, datagram: bool, reason: str, message) -> None:
        """A message (or a run of them) that does not fit. A datagram proves only that some rank
        sent it once, to someone: it is dropped and counted, a run once (a mismatched call is
        named by its DESCRIBE). A peer's authenticated stream is evidence: the communicator
        aborts with `message()`."""
        if datagram:
            self.drops[reason] += 1
        else:
            self.abort(Rejected(message(), reason))

    def _receive_control(self, hdr, payload, now: float) -> None:
        if hdr.kind == Kind.DESCRIBE:
            theirs = self._descriptor(hdr, payload)
            if theirs is None:
                return
            coll = self.active.get(hdr.seq)
            mine = coll.desc if coll is not None else self.history.get(hdr.seq)
            if mine is None:  # not posted yet, refused here, or long finished
                if hdr.seq >= self.next_seq and self.error is None:
                    self._allowed[hdr.seq][hdr.src] = theirs.stream_bytes_bound(self.world)
                self._hold(hdr, payload, False)
                return
            if self._verify(mine, theirs, hdr, coll, now) and coll is not None:
                self._guard(coll, coll.described_by, hdr.src, payload[Descriptor.SIZE :], now)
                self._settle(coll)
        elif hdr.kind == Kind.REFUSE:
            coll = self.active.get(hdr.seq)
            if coll is not None:
                coll.fail(self._refusal_error(coll, hdr, payload))
                self.control.extend(coll.withdrawal())
                self._settle(coll)
            else:  # not posted yet, or its collective failed or was refused here already
                self._hold(hdr, payload, False)
        elif hdr.kind == Kind.ABORT:
            try:
                code, reason = unpack_abort(payload)
            except MalformedError:
                code, reason = OvercastError.abort_code, "an abort without a reason"
            self.fail(error_class(code)(f"{reason} (reported by rank {hdr.src})"))
        elif hdr.kind in (Kind.FAILOVER, Kind.REJOIN):
            self._receive_round(hdr, payload, now)
        elif hdr.kind == Kind.GOODBYE:
            try:
                count = unpack_goodbye(payload)
            except MalformedError as err:
                self.abort(Rejected(f"rank {hdr.src}: {err}", "malformed"))
                return
            self.closed_peers[hdr.src] = count
            self.p2p.fail(
                PeerFailureError(
                    f"rank {hdr.src} closed the communicator while a "
                    f"transfer with it was pending here"
                ),
                peer=hdr.src,
            )
            for coll in list(self.active.values()):
                if coll.seq >= count:
                    coll.fail(
                        PeerFailureError(
                            f"rank {hdr.src} closed the communicator after {count} collectives "
                            f"while {coll.desc} #{coll.seq} was pending here"
                        )
                    )
                    self._settle(coll)

    def _descriptor(self, hdr, payload) -> Descriptor | None:
        """A peer's descriptor (a DESCRIBE, or what a message of _DESCRIBED opens with); None,
        the communicator aborted, if it cannot be decoded."""
        try:
            return Descriptor.unpack(payload[: Descriptor.SIZE])
        except ProtocolError as err:
            self.abort(Rejected(f"rank {hdr.src}: {err}", "malformed"))
            return None

    def _verify(
        self, mine: Descriptor, theirs: Descriptor, hdr, coll: Collective | None, now: float
    ) -> bool:
        """Check a peer's call against this rank's: a mismatch aborts the communicator
        (False); a match counts the peer as verified for `coll`."""
        if theirs != mine:
            self.abort(
                CollectiveMismatchError(
                    f"collective #{hdr.seq} differs across ranks: rank {hdr.src} issued "
                    f"{theirs}, rank {self.rank} issued {mine}"
                )
            )
            return False
        if coll is not None and hdr.seq in self.unverified:
            peers = self.unverified[hdr.seq]
            peers.discard(hdr.src)
            if not peers:
                self.verified.append(hdr.seq)
            self.last_progress[hdr.seq] = now
        return True

    # -- failure ---------------------------------------------------------------------------
    def fail(self, error: OvercastError) -> None:
        """Fail every collective in flight and every later one with `error`."""
        if self.error is None:
            self.error = error
        for coll in list(self.active.values()):
            coll.fail(self.error)
            self._settle(coll)
        self.p2p.fail(self.error)
        self.early.clear()
        self._early_datagram_bytes = 0
        self.early_stream_bytes.clear()
        self._early_stream_total = 0
        self._held_by.clear()
        self._allowed.clear()

    def abort(self, error: OvercastError) -> None:
        """Fail locally and tell every peer why, so the error surfaces on every rank."""
        if self.error is None:
            message = pack_abort(error.abort_code, str(error))
            for peer in range(self.world):
                if peer != self.rank and peer not in self.closed_peers:
                    self._send_control(Kind.ABORT, 0, peer, message)
        self.fail(error)

    def peer_lost(self, peer: int, where: str | None = None) -> None:
        """The engine lost the connection to `peer` (an aggregator's at `where`, host:port); an
        error unless it said goodbye."""
        self.lost_peers.add(peer)
        self.control = collections.deque((r, m) for r, m in self.control if r[1] != peer)
        if peer in self.closed_peers:
            return
        if peer in self.lost:  # the connection of an instance agreed lost (Engine._rejoin)
            return
        if is_aggregator(peer) and peer in self.aggregators:
            self.aggregator_lost(
                peer, "closed its connection (it exited or was killed)", self.clock
            )
            return
        if is_aggregator(peer):
            at = f" at {where}" if where else ""
            self.fail(
                PeerFailureError(
                    f"lost the connection to the aggregator{at} (overcast "
                    "aggregator): it exited or was killed"
                )
            )
        else:
            self.fail(
                PeerFailureError(
                    f"lost the connection to rank {peer} (its process exited or was killed)"
                )
            )

    def close(self) -> None:
        """Say goodbye to every peer; collectives still pending fail, here and, told by an
        ABORT naming this rank, on every peer (which would otherwise wait for this rank's part
        until its timeout: the GOODBYE counts them as issued)."""
        if self.closing:
            return
        self.closing = True
        pending = [self.active[seq] for seq in sorted(self.active)]
        for coll in pending:
            coll.fail(
                CommunicatorClosedError(
                    f"communicator closed while {coll.desc} #{coll.seq} was pending"
                )
            )
            self._settle(coll)
        self.p2p.fail(CommunicatorClosedError("communicator closed while the transfer was pending"))
        peers = [p for p in range(self.world) if p != self.rank and p not in self.closed_peers]
        if pending:
            also = f" and {len(pending) - 1} more" if len(pending) > 1 else ""
            message = pack_abort(
                PeerFailureError.abort_code,
                f"rank {self.rank} closed the communicator with "
                f"{pending[0].desc} #{pending[0].seq}{also} pending",
            )
            for peer in peers:
                self._send_control(Kind.ABORT, 0, peer, message)
        for peer in peers:
            self._send_control(Kind.GOODBYE, 0, peer, pack_goodbye(self.next_seq))

    # -- timers ----------------------------------------------------------------------------
    def get_timer(self) -> float | None:
        times = [t + self.timeout for t in self.last_progress.values()]
        if (silent := self._silent_aggregator()) is not None:
            times.append(silent[1])
        if (t := self.p2p.timer(self.timeout)) is not None:
            times.append(t)
        if not self.plane.attached and (t := self.plane.timer()) is not None:
            times.append(t)
        for coll in self.active.values():
            t = coll.get_timer()
            if t is not None:
                times.append(t)
        return min(times, default=None)

    def handle_timer(self, now: float) -> None:
        self.clock = now
        if not self.plane.attached and (t := self.plane.timer()) is not None and now >= t:
            self.plane.handle_timer(now)
            self._take_plane(now)
        silent = self._silent_aggregator()
        if silent is not None and now >= silent[1]:
            bound = min(self.failover_seconds, self.timeout)
            self.aggregator_lost(
                silent[0],
                f"was silent for {bound:g} s while an in-network reduction waited on it",
                now,
            )
        stalled = self.p2p.stalled(now, self.timeout)
        if stalled is not None:
            self.abort(
                CollectiveTimeoutError(
                    f"{stalled} on rank {self.rank} made no progress for {self.timeout:.1f} s; "
                    f"waiting for {stalled.waiting_for()}"
                )
            )
            return
        for seq, coll in list(self.active.items()):
            stepped = coll.stepped_at()  # progress made where the session does not see it
            if stepped is not None and stepped > self.last_progress[seq]:
                self.last_progress[seq] = stepped
            if now >= self.last_progress[seq] + self.timeout:
                self.abort(
                    CollectiveTimeoutError(
                        f"{coll.desc} #{seq} on rank {self.rank} made no progress for "
                        f"{self.timeout:.1f} s; waiting for "
                        f"{self._waiting_for(coll)}"
                    )
                )
                return
            t = coll.get_timer()
            if t is not None and now >= t:
                steps = coll.progress
                self._guard(coll, coll.handle_timer, now)
                if coll.progress != steps and seq in self.last_progress:
                    self.last_progress[seq] = now
                self._settle(coll)

    def _waiting_for(self, coll: Collective) -> str:
        if self.failover is not None and coll.seq in self.failover.frozen:
            return "the reports of an aggregator's loss from " + ", ".join(
                f"rank {r}" for r in self.failover.unreported()
            )
        if not coll.received_all:
            return coll.waiting_for()
        if coll.done:
            return "the DESCRIBE of " + ", ".join(
                f"rank {p}" for p in sorted(self.unverified.get(coll.seq, ()))
            )
        return "its sends to drain"

    # -- sending ---------------------------------------------------------------------------
    def _send_control(self, kind: int, seq: int, peer: int, payload: bytes) -> None:
        if peer in self.lost_peers:
            return
        self.control.append(((STREAM, peer), Outgoing(kind, seq, 0, payload, peer)))

    def _take_plane(self, now: float | None = None) -> None:
        """The plane's outbox, unsealed, while no engine runs it (the in-memory fabric)."""
        if self.plane.attached:
            return
        for code, dst, kind, seq, chunk, payload in self.plane.take_outbox():
            # a rank's datagrams and an aggregator endpoint's go to their destination's id
            route = (MULTICAST, -1) if code == _core.ROUTE_GROUP else (DATAGRAM, dst)
            self.control.append((route, Outgoing(kind, seq, chunk, payload, dst)))
        self.poll_plane(now)

    def pending_routes(self) -> set[tuple[int, int]]:
        self._take_plane()
        routes = {route for route, _ in self.control} | self.p2p.routes()
        for coll in self.active.values():
            routes.update(coll.outbox)
        return routes

    def drain(self, route: tuple[int, int]) -> list[Outgoing]:
        """Every message queued for the route (datagrams: the protocols pace themselves)."""
        out = [msg for r, msg in self.control if r == route]
        if out:
            self.control = collections.deque((r, m) for r, m in self.control if r != route)
        for coll in list(self.active.values()):
            box = coll.take_all(route)
            if box:
                out.extend(box)
                self._settle(coll)
        return out

    def pop(self, route: tuple[int, int]) -> Outgoing | None:
        """The next message for the route: control first, then collectives and transfers in
        turn."""
        for i, (r, control) in enumerate(self.control):
            if r == route:
                del self.control[i]
                return control
        sources: list[Collective | PointToPoint] = [
            c for c in self.active.values() if route in c.outbox
        ]
        if route in self.p2p.routes():
            sources.append(self.p2p)
        if not sources:
            return None
        self._rr += 1
        source = sources[self._rr % len(sources)]
        msg = source.pop(route)
        if isinstance(source, Collective):
            self._settle(source)
        return msg
