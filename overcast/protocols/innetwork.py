"""In-network ReduceScatter, the rank's side (the aggregator's side is overcast.aggregator).

The input's P blocks are cut into K chunks of one datagram each. Chunks are numbered across the
blocks a group at a time (native/common/numbering.h), the group being the budget's reduction batch
(transport.datagram.reduction_batch): a rank that streams its contributions in increasing g
feeds every block in turn, so results reach every owner at the same steady rate, each taking
1/P of its downlink, and a batch of contributions is one owner's, so the results it completes
go to that owner in one batch too. A rank sends in increasing g, skipping its own block, paced
by the host's uplink budget a batch at a time, never more than `slots` chunks ahead of what the
aggregator has released (its credit). The aggregator sums each chunk's P-1 contributions and
sends the sum to the block's owner, with the credit; the owner adds its own contribution and
acknowledges with its next batch of contributions, which frees the slot.

Loss in either direction is repaired by retransmission: the aggregator asks the ranks missing
from a slot to send again (a NACK in its CREDIT message) and resends an unacknowledged result; a
rank whose credit stalls asks for it. A rank is done when it has its whole block and the credit
says every chunk of every block is released, so nobody can need its contributions any more.

All of that runs per datagram, so it runs in the rank's native datagram plane
(overcast/native/rank/contribute.h), on the engine's thread without the GIL; this class is the
collective's face in the session: it posts the reduction, hands the plane any result or credit
that reached Python (held while the collective was not posted yet, or delivered by the in-memory
fabric), and finishes when the plane says the reduction has drained.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from overcast.buffers import dtype_code
from overcast.protocols.base import DATAGRAM, Accept, Collective, Descriptor, Outgoing, Phase
from overcast.protocols.budget import LinkBudget
from overcast.schedules.chains import chunk_count
from overcast.schedules.ring import DEFAULT_FRAME_BYTES
from overcast.wire.header import Kind, endpoints
from overcast.wire.runs import Run

if TYPE_CHECKING:
    from overcast.native._core import ReducerState


class InNetworkReduceScatter(Collective):
    verify_every_peer = True
    # Results and credit may come until the last chunk is released; copies sent again by the
    # aggregator may still come after (they are acknowledged again).
    ACCEPTS = {
        Kind.RESULT: Accept("_to_plane", "aggregator", runs=True),
        Kind.CREDIT: Accept("_to_plane", "aggregator", runs=True),
    }

    def __init__(
        self,
        seq: int,
        rank: int,
        world: int,
        desc: Descriptor,
        output: np.ndarray,
        input: np.ndarray,
        *,
        chunk_bytes: int,
        slots: int,
        budget: LinkBudget,
        stripes: int = 1,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
    ):
        itemsize = desc.dtype.itemsize
        super().__init__(
            seq, rank, world, desc.cut(chunk_bytes // itemsize * itemsize, desc.count * itemsize)
        )
        self.aggregator = endpoints(stripes)  # the endpoints its chunks are striped over
        self.output, self.input = output, input
        self.chunk_bytes, self.slots, self.budget = chunk_bytes, slots, budget
        self.k = chunk_count(desc.count, chunk_bytes // desc.dtype.itemsize)
        self.total = world * self.k
        self.frame_bytes = frame_bytes  # the ring's, should an aggregator be lost (failover)
        self.posted = False
        self.posted_at: float | None = None
        self.frozen = False

    def start(self, now: float) -> None:
        self.plane.reduce(
            self.seq,
            dtype_code(self.desc.dtype),
            self.desc.op == "avg",
            self.desc.count,
            self.input.view(np.uint8),
            self.output.view(np.uint8),
            self.chunk_bytes,
            self.slots,
            self.budget.reduction_batch,
            self.budget.native,
            now,
        )
        self.posted, self.posted_at = True, now
        self.enter(Phase.SENDING)
        if self._posted_state()["phase"] == "drained":  # one rank, or nothing to send
            self.native_news(now)

    def _state(self) -> ReducerState | None:
        """The plane's state of the reduction, while it is posted there."""
        return self.plane.reducer(self.seq) if self.posted else None

    def _posted_state(self) -> ReducerState:
        state = self._state()
        if state is None:
            raise RuntimeError(f"{self} on rank {self.rank} is not posted to the plane")
        return state

    def stepped_at(self) -> float | None:
        state = self._state()
        return state["progress_at"] if state and state["progress_at"] >= 0 else None

    def _to_plane(self, run: Run, now: float) -> None:
        if self.frozen:
            self.reject(
                "aggregator_lost",
                "the aggregator's datagrams for a reduction frozen when an aggregator was lost",
            )
        self.plane.receive_run(*run.as_plane_args(), now)

    def native_news(self, now: float) -> None:
        """The plane has every result in place and every chunk released, and nothing of this
        reduction left to send."""
        state = self._posted_state()
        self.stats.update(
            results=state["results_in"],
            duplicate_results=state["duplicate_results"],
            contributions_resent=state["contributions_resent"],
            credit_probes=state["credit_probes"],
        )
        if self.phase is Phase.SENDING:
            self.enter(Phase.RECEIVING)
        if self.phase is Phase.RECEIVING:
            self.enter(Phase.DRAINING)
        self._check_done()

    def waits_on_aggregators(self) -> bool:
        """Posted to the plane and not drained: it waits on every endpoint it is striped over
        (each is asked for credit once the reduction stalls, and answers)."""
        return self.posted and not self.received_all  # drained: news moved it on

    def freeze(self) -> bool:
        """An aggregator was lost (protocols.failover): let the plane's reduction go, so that
        it takes no result or credit and acknowledges nothing more. Whether this rank's whole
        block was in place."""
        state = self._state()
        holds = state is not None and state["results"] == state["k"]
        self.finished()
        self.frozen = True
        return holds

    def complete_frozen(self) -> None:
        """Every rank holds its block (protocols.failover): done without the last credit."""
        for phase in (Phase.RECEIVING, Phase.DRAINING):
            if self.phase is not phase:
                self.enter(phase)
        self._check_done()

    def withdrawal(self) -> list[tuple[tuple[int, int], Outgoing]]:
        """The aggregator endpoints give the reduction up at once: a peer that refused the call
        never contributes, and the reduction would hold a pool and one of the communicator's
        few places until it expired."""
        return [
            ((DATAGRAM, e), Outgoing(Kind.WITHDRAW, self.seq, 0, b"", e))
            for e in sorted(self.aggregator)
        ]

    def finished(self) -> None:
        if self.posted:
            self.plane.release(self.seq)
            self.posted = False

    def waiting_for(self) -> str:
        state = self._state()
        if self.frozen:
            return "every rank's report of the aggregator's loss"
        if state is None:
            return "its start"
        return (
            f"the aggregator: {state['results']} of {state['k']} results, credit "
            f"{state['credit']} of {state['total']} chunks"
        )

    def state_bytes(self) -> int:
        state = self._state()
        return state["bytes"] if state else 0
