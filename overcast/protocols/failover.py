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
FAILOVER_COUNTERS = ("aggregators_lost", "in_network_redone_on_ring",
                     "in_network_complete_at_failover", "in_network_on_ring",
                     "in_network_on_fewer_endpoints")

_REPORT = struct.Struct("<HHII")  # the lost endpoint, 0, the first seq not posted, how many lack
_SEQ = struct.Struct("<I")


def pack_report(lost: int, posted: int, lacking: list[int]) -> bytes:
    return _REPORT.pack(lost, 0, posted, len(lacking)) + b"".join(map(_SEQ.pack, lacking))


def unpack_report(payload) -> tuple[int, int, frozenset[int]]:
    """(the lost endpoint, the first collective not posted, those posted that lack a block)."""
    if len(payload) < _REPORT.size:
        raise ProtocolError(f"a FAILOVER report of {len(payload)} bytes")
    lost, zero, posted, n = _REPORT.unpack_from(payload)
    if zero or len(payload) != _REPORT.size + n * _SEQ.size:
        raise ProtocolError(f"a FAILOVER report of {len(payload)} bytes says {n} collectives")
    lacking = frozenset(_SEQ.unpack_from(payload, _REPORT.size + i * _SEQ.size)[0]
                        for i in range(n))
    if any(seq >= posted for seq in lacking):
        raise ProtocolError("a FAILOVER report lacks a collective it says it has not posted")
    return lost, posted, lacking


class RingInstead(RingReduceScatter):
    """An in-network ReduceScatter run on the ring after an aggregator was lost: its descriptor
    is the in-network call's, checked against every peer's as that call's was (a peer may have
    posted it in-network and described it to every rank), and the aggregators' results and
    credit still on their way for it are dropped and counted as `aggregator_lost`."""

    verify_every_peer = True
    ACCEPTS = {**RingReduceScatter.ACCEPTS,
               Kind.RESULT: Accept("_too_late", "aggregator", runs=True),
               Kind.CREDIT: Accept("_too_late", "aggregator", runs=True)}

    def __init__(self, coll: InNetworkReduceScatter):
        super().__init__(coll.seq, coll.rank, coll.world, coll.desc, coll.output, coll.input,
                         coll.frame_bytes)
        self.aggregator = coll.aggregator

    def _too_late(self, run, now: float) -> None:
        self.reject("aggregator_lost", "the aggregator's datagrams for a reduction the ring "
                                       "took over")

    def __str__(self) -> str:
        return f"{self.desc} #{self.seq} (on the ring: an aggregator was lost)"


class Failover:
    """One round of reports after an aggregator was lost: round n is every rank's n-th report
    (the header's seq carries n), so rounds for aggregators lost one after another stay apart.

    `frozen` are the in-network collectives in flight here when it froze, or posted before the
    decision (those never start on an aggregator); `held` the stream messages peers sent for them
    meanwhile (a peer that decided first runs its ring), replayed once this rank has decided.
    Decided, `lost` is every aggregator the round's reports name (endpoint id -> host:port, the
    same on every rank), and `posted` the first collective no rank had posted when it reported:
    in-network collectives below it that are not complete run on the ring, those from it on on
    the endpoints left (or the ring, none being left)."""

    def __init__(self, number: int, rank: int, world: int):
        self.number, self.rank, self.world = number, rank, world
        self.why = ""  # how this rank found it lost, or who told it
        self.reports: dict[int, tuple[int, int, frozenset[int]]] = {}
        self.frozen: dict[int, InNetworkReduceScatter] = {}
        self.held: list = []
        self.decided = False
        self.lost: dict[int, str] = {}
        self.posted = 0
        self.redone: list[int] = []
        self.complete: list[int] = []
        self.outcome = ""  # once decided: what was lost, and what took over

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

    def report(self, rank: int, lost: int, posted: int, lacking: frozenset[int]) -> None:
        if rank in self.reports:
            raise ProtocolError(f"rank {rank} reported round {self.number} of aggregator "
                                f"losses twice")
        self.reports[rank] = (lost, posted, lacking)

    @property
    def ready(self) -> bool:
        return not self.decided and len(self.reports) == self.world

    def decide(self, names) -> None:
        """From every rank's report: what was lost (`names(endpoint)` its host:port) and where
        collectives posted after run."""
        self.decided = True
        self.lost = {lost: names(lost) for lost, _, _ in self.reports.values()}
        self.posted = max(posted for _, posted, _ in self.reports.values())

    def redo(self, seq: int) -> bool:
        """Whether in-network collective `seq`, frozen, is not complete: some rank lacks its
        block of it or had not posted it. The same on every rank: it reads the reports alone."""
        return any(seq >= posted or seq in lacking
                   for _, posted, lacking in self.reports.values())

    def unreported(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.reports]

    def summary(self, left: str) -> str:
        """What was lost and what took over (`left`: what runs in-network collectives now), for
        the warning and in_network_fallback."""
        lost = ", ".join(sorted(self.lost.values()))
        parts = [f"lost the aggregator{'s' * (len(self.lost) > 1)} at {lost} ({self.why})"]
        if self.redone:
            parts.append("in-network ReduceScatter " + ", ".join(f"#{s}" for s in self.redone)
                         + " redone on the ring")
        if self.complete:
            parts.append(", ".join(f"#{s}" for s in self.complete) + " complete on every rank")
        parts.append(f"in-network ReduceScatters from #{self.posted} on run on {left}")
        return "; ".join(parts)
