"""An aggregator lost mid-job, sans I/O: which in-network ReduceScatters are redone on the ring, the
same on every rank, and the endpoints left (or the ring) for those after.

A ReduceScatter's input is whole on every rank until the collective completes, and a rank
completes an in-network one only once the aggregators say every chunk of every block is released,
which they do only once each block's owner acknowledged its result: if any rank completed a
collective, every rank holds its block of it. So when a rank finds an aggregator lost (its
connection closed, or silent past the bound while a reduction waits on it) or is told so by a
peer, it first freezes every in-network reduction it has in flight (its plane lets them go: it
takes no result or credit and acknowledges nothing more, so none of them completes anywhere
after), then tells every peer over its stream what it holds: a FAILOVER report, the first
collective it has not posted and the in-network ones it posted that lack its block. Once a rank
has every rank's report, it decides from them alone, so every rank decides alike: a collective
every rank posted and holds its block of is complete; any other in-network collective that some
rank had posted (one a rank lacks its block of, or had not posted) runs on the ring, from the
ranks' unchanged inputs into the same outputs, under the same number. Those from the first that
no rank had posted on run in-network again, striped over the endpoints of the aggregators left
(every rank's plane stripes over the same ones, in the same order), or on the ring where none is
left. A result is one algorithm's: the ring's overwrites every element the aggregator's may have
written. Each loss the ranks agree on in a round of its own: a second aggregator lost after the
first round has decided starts the next.

An aggregator restarted at its address is taken back the same way. Once a round has agreed it
lost, each rank tries to register with it anew (at the communicator's epoch: how many rounds it
has decided, so the new instance's counters never meet the old one's), and tells every peer when
it has (REJOIN). A rank that has registered and heard every peer has opens a round; every report
names the lost aggregators its rank holds a new registration with, and those every report names
are taken back: in-network ReduceScatters from the round's first collective no rank had posted
on are striped over its endpoints again, with the others left. In flight, the round freezes
what it finds as a loss's does (those not complete run on the ring): a take-back costs at most
the collectives in flight, once.
"""

from __future__ import annotations

import struct

from overcast.errors import ProtocolError
from overcast.protocols.base import Accept
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.protocols.ring import RingReduceScatter
from overcast.wire.header import Kind

# The default bound on how long an aggregator may stay silent while an in-network reduction
# waits on it (a healthy one answers a stalled rank's credit probe within 50 ms and a round
# trip), and the environment variable that sets it; never longer than the collective timeout.
FAILOVER_SECONDS = 2.0
FAILOVER_ENV = "OVERCAST_FAILOVER_SECONDS"
# The least bound allowed: a few of the aggregator's 50 ms answers, so that a healthy one is never
# taken for lost.
FAILOVER_LEAST_SECONDS = 0.25
# The counters of the losses, there from the start (zero until a loss).
FAILOVER_COUNTERS = (
    "aggregators_lost",
    "aggregators_taken_back",
    "in_network_redone_on_ring",
    "in_network_complete_at_failover",
    "in_network_on_ring",
    "in_network_on_fewer_endpoints",
)
# How often a rank tries to register anew with an aggregator lost (restarted at its address),
# each try bounded by as long; and how long it waits after an aggregator that answers but cannot
# be taken back (other endpoints, fewer slots).
REJOIN_SECONDS = 1.0
REJOIN_REFUSED_SECONDS = 15.0
# The rounds a session keeps, the latest (in_network_fallback tells them).
ROUNDS_KEPT = 16

# The lost endpoint (0: none), how many taken back, the first seq not posted, how many lack
_REPORT = struct.Struct("<HHII")
_ENDPOINT = struct.Struct("<H")
_SEQ = struct.Struct("<I")
NO_LOSS = 0  # never an aggregator's endpoint id (those are AGGREGATOR - stripe)


def pack_report(lost: int, back, posted: int, lacking: list[int]) -> bytes:
    back = sorted(back)
    return (
        _REPORT.pack(lost, len(back), posted, len(lacking))
        + b"".join(map(_ENDPOINT.pack, back))
        + b"".join(map(_SEQ.pack, lacking))
    )


def unpack_report(payload) -> tuple[int, frozenset[int], int, frozenset[int]]:
    """(the lost endpoint or NO_LOSS, the aggregators registered with anew, the first collective
    not posted, those posted that lack a block)."""
    if len(payload) < _REPORT.size:
        raise ProtocolError(f"a FAILOVER report of {len(payload)} bytes")
    lost, nback, posted, n = _REPORT.unpack_from(payload)
    if len(payload) != _REPORT.size + nback * _ENDPOINT.size + n * _SEQ.size:
        raise ProtocolError(
            f"a FAILOVER report of {len(payload)} bytes says {nback} "
            f"aggregators and {n} collectives"
        )
    at = _REPORT.size
    back = frozenset(
        _ENDPOINT.unpack_from(payload, at + i * _ENDPOINT.size)[0] for i in range(nback)
    )
    at += nback * _ENDPOINT.size
    lacking = frozenset(_SEQ.unpack_from(payload, at + i * _SEQ.size)[0] for i in range(n))
    if len(back) != nback or any(seq >= posted for seq in lacking):
        raise ProtocolError(
            "a FAILOVER report names an aggregator twice, or lacks a "
            "collective it says it has not posted"
        )
    return lost, back, posted, lacking


def pack_rejoin(peer: int) -> bytes:
    return _ENDPOINT.pack(peer)


def unpack_rejoin(payload) -> int:
    if len(payload) != _ENDPOINT.size:
        raise ProtocolError(f"a REJOIN of {len(payload)} bytes")
    return _ENDPOINT.unpack_from(payload)[0]


class RingInstead(RingReduceScatter):
    """An in-network ReduceScatter run on the ring after an aggregator was lost: its descriptor
    is the in-network call's, checked against every peer's as that call's was (a peer may have
    posted it in-network and described it to every rank), and the aggregators' results and
    credit still on their way for it are dropped and counted as `aggregator_lost`."""

    verify_every_peer = True
    ACCEPTS = {
        **RingReduceScatter.ACCEPTS,
        Kind.RESULT: Accept("_too_late", "aggregator", runs=True),
        Kind.CREDIT: Accept("_too_late", "aggregator", runs=True),
    }

    def __init__(self, coll: InNetworkReduceScatter):
        super().__init__(
            coll.seq, coll.rank, coll.world, coll.desc, coll.output, coll.input, coll.frame_bytes
        )
        self.aggregator = coll.aggregator

    def _too_late(self, run, now: float) -> None:
        self.reject(
            "aggregator_lost", "the aggregator's datagrams for a reduction the ring took over"
        )

    def __str__(self) -> str:
        return f"{self.desc} #{self.seq} (on the ring: an aggregator was lost)"


class Failover:
    """One round of reports on the aggregators, after one was lost or to take one back: round n
    is every rank's n-th report (the header's seq carries n), so rounds stay apart.

    `frozen` are the in-network collectives in flight here when it froze, or posted before the
    decision (those never start on an aggregator); `held` the stream messages peers sent for them
    meanwhile (a peer that decided first runs its ring), replayed once this rank has decided.
    Decided, `lost` is every aggregator the round's reports name lost and `back` every lost one
    that every report names registered with anew (endpoint id -> host:port, the same on every
    rank), and `posted` the first collective no rank had posted when it reported: in-network
    collectives below it that are not complete run on the ring, those from it on on the
    endpoints left (or the ring, none being left)."""

    def __init__(self, number: int, rank: int, world: int):
        self.number, self.rank, self.world = number, rank, world
        self.why = ""  # how this rank found it lost, or who told it
        self.reports: dict[int, tuple[int, frozenset[int], int, frozenset[int]]] = {}
        self.frozen: dict[int, InNetworkReduceScatter] = {}
        self.held: list = []
        self.decided = False
        self.lost: dict[int, str] = {}
        self.back: dict[int, str] = {}
        self.posted = 0
        self.redone: list[int] = []
        self.complete: list[int] = []
        self.outcome = ""  # once decided: what was lost or taken back, and what runs now
        self.still_lost = False  # once decided: whether any aggregator is lost after it

    def freeze(self, colls) -> list[int]:
        """Freeze this rank's in-network collectives in flight; the ones that lack this rank's
        block, for its report."""
        lacking = []
        for coll in colls:
            if not isinstance(coll, InNetworkReduceScatter) or coll.received_all or coll.frozen:
                continue  # done here (its block is in place), or frozen already
            if not coll.freeze():
                lacking.append(coll.seq)
            self.frozen[coll.seq] = coll
        return sorted(lacking)

    def report(
        self, rank: int, lost: int, back: frozenset[int], posted: int, lacking: frozenset[int]
    ) -> None:
        if rank in self.reports:
            raise ProtocolError(
                f"rank {rank} reported round {self.number} of aggregator losses twice"
            )
        self.reports[rank] = (lost, back, posted, lacking)

    @property
    def ready(self) -> bool:
        return not self.decided and len(self.reports) == self.world

    def decide(self, names) -> None:
        """From every rank's report: what was lost and taken back (`names(endpoint)` its
        host:port) and where collectives posted after run."""
        self.decided = True
        reports = self.reports.values()
        self.lost = {lost: names(lost) for lost, _, _, _ in reports if lost != NO_LOSS}
        back = frozenset.intersection(*(back for _, back, _, _ in reports))
        self.back = {peer: names(peer) for peer in sorted(back) if peer not in self.lost}
        self.posted = max(posted for _, _, posted, _ in reports)

    def redo(self, seq: int) -> bool:
        """Whether in-network collective `seq`, frozen, is not complete: some rank lacks its
        block of it or had not posted it. The same on every rank: it reads the reports alone."""
        return any(
            seq >= posted or seq in lacking for _, _, posted, lacking in self.reports.values()
        )

    def unreported(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.reports]

    def summary(self, left: str) -> str:
        """What was lost or taken back and what took over (`left`: what runs in-network
        collectives now), for the warning and in_network_fallback."""
        parts = []
        if self.lost:
            lost = ", ".join(sorted(self.lost.values()))
            parts.append(f"lost the aggregator{'s' * (len(self.lost) > 1)} at {lost} ({self.why})")
        if self.back:
            back = ", ".join(sorted(self.back.values()))
            parts.append(
                f"took back the aggregator{'s' * (len(self.back) > 1)} at {back} "
                f"(every rank registered with it anew)"
            )
        if not parts:
            parts.append(
                f"took back no aggregator ({self.why}: not every rank had registered with it anew)"
            )
        if self.redone:
            parts.append(
                "in-network ReduceScatter "
                + ", ".join(f"#{s}" for s in self.redone)
                + " redone on the ring"
            )
        if self.complete:
            parts.append(", ".join(f"#{s}" for s in self.complete) + " complete on every rank")
        parts.append(f"in-network ReduceScatters from #{self.posted} on run on {left}")
        return "; ".join(parts)
