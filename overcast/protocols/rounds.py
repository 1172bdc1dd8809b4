"""A session's part in the rounds on its aggregators (protocols.failover): watching them, finding
one lost, the rounds of reports that agree on each loss and take-back, and what each decides.

Mixed into Session (protocols.session), whose state and steps its methods use: their `self` is
the session.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from overcast.errors import ProtocolError, Rejected
from overcast.protocols.failover import (
    FAILOVER_SECONDS,
    NO_LOSS,
    ROUNDS_KEPT,
    Failover,
    RingInstead,
    pack_rejoin,
    pack_report,
    unpack_rejoin,
    unpack_report,
)
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.wire.header import AGGREGATOR, Kind

if TYPE_CHECKING:
    from overcast.errors import OvercastError
    from overcast.native import _core
    from overcast.protocols.base import Collective, Outgoing


class AggregatorRounds:
    if TYPE_CHECKING:  # the session's, which the rounds use
        rank: int
        world: int
        timeout: float
        clock: float
        plane: _core.Plane
        active: dict[int, Collective]
        last_progress: dict[int, float]
        next_seq: int
        control: collections.deque[tuple[tuple[int, int], Outgoing]]
        stats: collections.Counter
        closing: bool
        error: OvercastError | None
        lost_peers: set[int]

        def abort(self, error: OvercastError) -> None: ...
        def receive(self, hdr, payload, now: float, datagram: bool) -> None: ...
        def _send_control(self, kind: int, seq: int, peer: int, payload: bytes) -> None: ...
        def _settle(self, coll: Collective) -> None: ...
        def _guard(self, coll: Collective, step, *args) -> None: ...

    def _init_rounds(self, failover_seconds: float = FAILOVER_SECONDS) -> None:
        # The aggregators in-network reductions are striped over, by the endpoint id of each
        # one's first stripe: (host:port, its stripes); none, and a lost aggregator fails the
        # communicator, until watch_aggregators.
        self.aggregators: dict[int, tuple[str, range]] = {}
        self.failover_seconds = failover_seconds
        # Aggregators lost (protocols.failover): the round of reports open, or the last decided;
        # the rounds decided; the aggregators they agreed lost, and the endpoints left that
        # in-network reductions are striped over; the first collective number not on the ring;
        # the aggregators this rank found lost that no round has agreed on yet, and how; reports
        # of peers a round ahead; the ranks (this one among them) registered anew with each
        # aggregator lost (restarted), as they said (REJOIN), each with the epoch it registered
        # at: a round numbered that or later that does not take it back ends the registration
        # (the rank registers again), alike on every rank.
        self.failover: Failover | None = None
        self.epoch = 0  # the rounds decided (a registration anew names it: wire.registration)
        self.rounds: collections.deque[Failover] = collections.deque(maxlen=ROUNDS_KEPT)
        self.lost: dict[int, str] = {}
        self.lanes: list[int] = []
        self.stripes = 0
        self.ring_below = 0
        self.found_lost: dict[int, str] = {}
        self._reports_ahead: list[tuple[int, int, int, frozenset[int], int, frozenset[int]]] = []
        self.registered_anew: dict[int, dict[int, int]] = {}
        self._closed_anew: set[int] = set()  # new registrations closed since the last round
        # the aggregators answering again that cannot be taken back, and why (said once each)
        self.not_taken_back: dict[int, str] = {}
        self.notices: list[str] = []  # what the engine warns of: an aggregator lost, and why

    def _receive_round(self, hdr, payload, now: float) -> None:
        """A FAILOVER report or a REJOIN from a peer's stream."""
        try:
            if hdr.kind == Kind.FAILOVER:
                lost, back, posted, lacking = unpack_report(payload)
                named = ([lost] if lost != NO_LOSS else []) + sorted(back)
            else:
                named = [unpack_rejoin(payload)]
            for peer in named:
                if self._aggregator_of(peer) != peer:
                    raise ProtocolError(
                        f"a {Kind(hdr.kind).name} names endpoint "
                        f"{AGGREGATOR - peer}, no aggregator's first"
                    )
        except ProtocolError as err:
            self.abort(Rejected(f"rank {hdr.src}: {err}", "malformed"))
            return
        if hdr.kind == Kind.REJOIN:
            # kept whether or not this rank has agreed on its loss yet (a report may be late)
            self.registered_anew.setdefault(named[0], {})[hdr.src] = hdr.seq
            self._take_back(now)
        elif hdr.seq < self.epoch:
            self.abort(
                Rejected(
                    f"rank {hdr.src} reported round {hdr.seq} of aggregator losses again",
                    "duplicate",
                )
            )
        elif hdr.seq > self.epoch:  # it decided the round open here: kept till then
            self._reports_ahead.append((hdr.seq, hdr.src, lost, back, posted, lacking))
        else:
            self._count_report(hdr.src, lost, back, posted, lacking, now)

    def watch_aggregators(self, names: dict[int, str], stripes: int) -> None:
        """The aggregators (host:port by the endpoint id of each one's first stripe, of
        `stripes` endpoints in all) whose loss the ring survives: one that closes its
        connection, or is silent `failover_seconds` (at most the timeout) while an in-network
        reduction waits on it."""
        firsts = sorted(AGGREGATOR - peer for peer in names)
        bounds = [*firsts[1:], stripes]
        self.aggregators = {
            AGGREGATOR - first: (names[AGGREGATOR - first], range(first, end))
            for first, end in zip(firsts, bounds)
        }
        self.lanes = list(range(stripes))
        self.stripes = stripes

    def _aggregator_of(self, peer: int) -> int | None:
        """The aggregator (its first endpoint's id) endpoint id `peer` belongs to."""
        return next(
            (
                first
                for first, (_, stripes) in self.aggregators.items()
                if AGGREGATOR - peer in stripes
            ),
            None,
        )

    def _lane_endpoints(self) -> frozenset[int]:
        return frozenset(AGGREGATOR - e for e in self.lanes)

    def aggregator_lost(self, peer: int, why: str, now: float) -> None:
        """This rank found aggregator `peer` (its first endpoint's id) lost: `why`. The ranks
        agree on it in a round of reports, this one's first if none is open."""
        if peer in self.lost or peer in self.found_lost or self.closing:
            return  # closing: nothing of its own left to save (a peer's report is answered)
        self.found_lost[peer] = why
        if self.failover is None or self.failover.decided:
            self._open_round(peer, now)

    def registration_closed(self, peer: int) -> None:
        """This rank's new registration with lost aggregator `peer` closed (the new instance
        died too): not named in its reports from now on; if a round takes it back all the same
        (this rank had reported), it is found lost again at once."""
        self.registered_anew.get(peer, {}).pop(self.rank, None)
        self._closed_anew.add(peer)

    def cannot_take_back(self, peer: int, why: str) -> None:
        """Lost aggregator `peer` answers again, but not as the communicator needs (`why`):
        said once per reason, and in in_network_fallback."""
        if self.not_taken_back.get(peer) != why:
            self.not_taken_back[peer] = why
            self.notices.append(
                f"rank {self.rank}: the aggregator at {self.aggregators[peer][0]} "
                f"answers again but cannot be taken back: {why}"
            )

    def aggregator_registered(self, peer: int, now: float) -> bool:
        """This rank registered anew with aggregator `peer` (its first endpoint's id), lost and
        restarted: tell every peer, and take it back once every rank has. False if it is not
        one lost (the registration is not wanted)."""
        self.clock = now
        if peer not in self.lost or self.error is not None or self.closing:
            return False
        self.registered_anew.setdefault(peer, {})[self.rank] = self.epoch
        for other in range(self.world):
            if other != self.rank:
                self._send_control(Kind.REJOIN, self.epoch, other, pack_rejoin(peer))
        self._take_back(now)
        return True

    def _take_back(self, now: float) -> None:
        """Open a round to take back the lost aggregators every rank has registered with anew,
        this one among them, unless a round is open (its reports name them)."""
        if (self.failover is None or self.failover.decided) and self._back_here(everyone=True):
            self._open_round(NO_LOSS, now)

    def _back_here(self, everyone: bool = False) -> list[int]:
        """The lost aggregators this rank holds a new registration with (`everyone`: and
        every rank said it does)."""
        return [
            peer
            for peer, ranks in sorted(self.registered_anew.items())
            if peer in self.lost
            and self.rank in ranks
            and (not everyone or len(ranks) == self.world)
        ]

    def _open_round(self, lost: int, now: float, told_by: int | None = None) -> None:
        """Freeze every in-network reduction in flight and tell every peer what this rank holds,
        naming aggregator `lost`, which this rank found lost or rank `told_by` reported (or
        NO_LOSS), and the lost ones it holds a new registration with."""
        failover = self.failover = Failover(self.epoch, self.rank, self.world)
        if told_by is not None:
            failover.why = f"reported by rank {told_by}"
        elif lost != NO_LOSS:
            failover.why = f"rank {self.rank} found that it {self.found_lost[lost]}"
        lacking = failover.freeze(list(self.active.values()))
        back = self._back_here()
        report = pack_report(lost, back, self.next_seq, lacking)
        for other in range(self.world):
            if other != self.rank:
                self._send_control(Kind.FAILOVER, failover.number, other, report)
        self._count_report(self.rank, lost, frozenset(back), self.next_seq, frozenset(lacking), now)

    def _count_report(
        self,
        rank: int,
        lost: int,
        back: frozenset[int],
        posted: int,
        lacking: frozenset[int],
        now: float,
    ) -> None:
        """A report for the round this rank is at: the first opens it here (naming an
        aggregator this rank found lost, if any, else the one reported); the last decides."""
        if self.failover is None or self.failover.decided:
            mine = next((p for p in self.found_lost if p not in self.lost), None)
            if mine is None:
                self._open_round(lost, now, told_by=rank)
            else:
                self._open_round(mine, now)
        failover = self.failover
        assert failover is not None  # open, or opened above
        try:
            failover.report(rank, lost, back, posted, lacking)
        except ProtocolError as err:
            self.abort(Rejected(str(err), "duplicate"))
            return
        for seq in failover.frozen:
            if seq in self.last_progress:
                self.last_progress[seq] = now
        if failover.ready:
            self._decide(failover, now)

    def _decide(self, failover: Failover, now: float) -> None:
        """Every rank's report is in for `failover`, the round open: decide, alike on every rank."""
        failover.decide(lambda peer: self.aggregators[peer][0])
        self.lost.update(failover.lost)
        self.stats["aggregators_lost"] += len(failover.lost)
        for peer in failover.back:
            del self.lost[peer]
            self.found_lost.pop(peer, None)
            self.not_taken_back.pop(peer, None)
            self.lost_peers.discard(peer)
        for peer, ranks in list(self.registered_anew.items()):  # taken back, or to register again
            kept = {r: e for r, e in ranks.items() if e > failover.number}
            if peer in failover.back or not kept:
                del self.registered_anew[peer]
            else:
                self.registered_anew[peer] = kept
        self.stats["aggregators_taken_back"] += len(failover.back)
        self.lanes = [
            e for e in range(self.stripes) if self._aggregator_of(AGGREGATOR - e) not in self.lost
        ]
        if self.lanes:
            self.plane.set_lanes(self.lanes)
        self.ring_below = failover.posted
        resumed = 0
        for seq, coll in sorted(failover.frozen.items()):
            if self.active.get(seq) is not coll:
                continue  # failed meanwhile (a refusal)
            if coll.posted_at is not None:  # started at the aggregators: free their pools
                self.control.extend(coll.withdrawal())
            if not failover.redo(seq):
                failover.complete.append(seq)
                coll.complete_frozen()
                self._settle(coll)
            elif seq < failover.posted or not self.lanes:
                failover.redone.append(seq)
                ring = self.active[seq] = RingInstead(coll)
                ring.plane = self.plane
                self._guard(ring, ring.start, now)
                self._settle(ring)
            else:  # posted here after this rank reported, and nowhere before: never started
                coll.frozen, coll.aggregator = False, self._lane_endpoints()
                resumed += 1
                self._guard(coll, coll.start, now)
                self._settle(coll)
        self.stats["in_network_redone_on_ring"] += len(failover.redone)
        self.stats["in_network_complete_at_failover"] += len(failover.complete)
        if len(self.lanes) < self.stripes:
            self.stats["in_network_on_fewer_endpoints"] += resumed
        failover.frozen.clear()
        left = (
            "the ring"
            if not self.lanes
            else f"the {len(self.lanes)} endpoints{' left' * bool(self.lost)} ("
            + ", ".join(
                name
                for first, (name, _) in sorted(self.aggregators.items())
                if first not in self.lost
            )
            + ")"
        )
        failover.outcome = failover.summary(left)
        failover.still_lost = bool(self.lost)
        self.epoch += 1
        self.rounds.append(failover)  # with its outcome: another thread reads them (Communicator)
        if failover.lost:  # a take-back alone is told by the counters and in_network_fallback
            self.notices.append(f"rank {self.rank} {failover.outcome}")
        held, failover.held = failover.held, []
        for hdr, payload in held:
            self.receive(hdr, payload, now, False)
        # the next round: a peer's report for it, or an aggregator this rank found lost since
        ahead = [r for r in self._reports_ahead if r[0] == self.epoch]
        self._reports_ahead = [r for r in self._reports_ahead if r[0] != self.epoch]
        for _, rank, lost, back, posted, lacking in ahead:
            self._count_report(rank, lost, back, posted, lacking, now)
        closed, self._closed_anew = self._closed_anew, set()
        for peer in sorted(closed & set(failover.back)):  # taken back, its connection gone here
            self.aggregator_lost(peer, "closed its connection (it exited or was killed)", now)
        unagreed = [p for p in self.found_lost if p not in self.lost]
        if unagreed and (self.failover is None or self.failover.decided):
            self._open_round(unagreed[0], now)
        self._take_back(now)

    def _silent_aggregator(self) -> tuple[int, float] | None:
        """The aggregator silent longest while an in-network reduction waits on it, and when
        it will have been silent past the bound (None: none waits on any)."""
        if not self.aggregators or (self.failover is not None and not self.failover.decided):
            return None
        waiting = [
            c.posted_at
            for c in self.active.values()
            if isinstance(c, InNetworkReduceScatter)
            and c.waits_on_aggregators()
            and c.posted_at is not None
        ]
        if not waiting:
            return None
        bound = min(self.failover_seconds, self.timeout)
        due = []
        for peer, (_, stripes) in self.aggregators.items():
            if peer in self.lost or peer in self.found_lost:
                continue
            heard = [t for e in stripes if (t := self.plane.heard(e)) is not None]
            due.append((max([*heard, min(waiting)]) + bound, peer))
        if not due:
            return None
        at, peer = min(due)
        return peer, at
