"""In-network ReduceScatter, the rank's side (the switch's side is overcast.switch).

The input's P blocks are cut into K chunks of one datagram each. Chunks are numbered across the
blocks a group at a time (schedules.reduction), the group being the budget's reduction batch
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
"""

from __future__ import annotations

import collections

import numpy as np

from overcast.buffers import add_into, chunk_views, divide_into, dtype_code
from overcast.protocols.base import DATAGRAM, Accept, Collective, Descriptor, Outgoing, Phase
from overcast.protocols.budget import LinkBudget
from overcast.schedules.chains import chunk_count
from overcast.schedules.reduction import chunk_place, owner_span
from overcast.wire.header import AGGREGATOR, Kind, MalformedError, datagram_link_bytes
from overcast.wire.messages import CONTRIB_PREFIX, pack_acks, pack_contribution_prefix, \
    pack_credit_probe, unpack_credit

RETRY_SECONDS = 0.05
# Results are acknowledged with the next batch of contributions (the acknowledgement is that
# send's last datagram, so it costs neither a send nor a read of its own), or after
# ACK_DELAY_SECONDS if none leaves by then, or at once when ACK_BATCH are waiting.
ACK_BATCH = 64
ACK_DELAY_SECONDS = 0.005


class InNetworkReduceScatter(Collective):
    verify_every_peer = True
    # Results and credit may come until the last chunk is released; copies sent again by the
    # aggregator may still come after (they are acknowledged again).
    ACCEPTS = {Kind.RESULT: Accept("_on_results", "aggregator", runs=True),
               Kind.CREDIT: Accept("_on_credit", "aggregator")}
    aggregator = AGGREGATOR

    def __init__(self, seq: int, rank: int, world: int, desc: Descriptor, output: np.ndarray,
                 input: np.ndarray, *, chunk_bytes: int, slots: int, budget: LinkBudget):
        super().__init__(seq, rank, world, desc)
        self.output, self.input = output, input
        self.input_bytes = memoryview(input.view(np.uint8))
        self.itemsize = desc.dtype.itemsize
        self.chunk_elems = chunk_bytes // self.itemsize
        self.k = chunk_count(desc.count, self.chunk_elems)
        self.total = world * self.k
        self.slots, self.budget = slots, budget
        self.route = (DATAGRAM, AGGREGATOR)
        self.group = budget.reduction_batch
        self.prefix = pack_contribution_prefix(dtype_code(desc.dtype), self.group, world,
                                               self.total)
        self.credit = 0
        self.cursor = 0  # next chunk to contribute for the first time
        self.resend: collections.deque[int] = collections.deque()
        self.have = np.zeros(self.k, bool)
        self.results = 0
        self.pump_at: float | None = None
        self.probe_at: float | None = None
        self.acks: list[int] = []
        self.ack_at: float | None = None
        self.counted = False

    # -- geometry --------------------------------------------------------------------------
    def _place(self, g: int) -> tuple[int, int]:
        """(block, chunk within the block) of chunk g."""
        return chunk_place(g, self.world, self.k, self.group)

    def _elements(self, g: int) -> slice:
        block, c = self._place(g)
        start = block * self.desc.count + c * self.chunk_elems
        return slice(start, min(start + self.chunk_elems, (block + 1) * self.desc.count))

    def _next_to_send(self, g: int) -> int:
        """The first chunk from g on that is not of this rank's own block: a span of its own
        chunks is skipped whole."""
        while g < self.total:
            owner, _, end = owner_span(g, self.world, self.k, self.group)
            if owner != self.rank:
                return g
            g = end
        return g

    def _bytes(self, g: int) -> memoryview:
        """Chunk g of this rank's input, as bytes."""
        span = self._elements(g)
        return self.input_bytes[span.start * self.itemsize:span.stop * self.itemsize]

    def _consecutive_bytes(self, first: int, end: int) -> list[memoryview]:
        """Chunks first .. end - 1, of one owner's span, as bytes: they lie back to back in
        the input, so only the span's ends need the numbering's arithmetic."""
        return chunk_views(self.input_bytes, self._elements(first).start * self.itemsize,
                           self._elements(end - 1).stop * self.itemsize,
                           self.chunk_elems * self.itemsize)

    # -- the contract ----------------------------------------------------------------------
    def start(self, now: float) -> None:
        if self.world == 1 or self.k == 0:
            self.output[:] = self.input[:self.desc.count]
            if self.desc.op == "avg":
                divide_into(self.output, self.world)
            self.enter(Phase.DRAINING)
            self._check_done()
            return
        self.budget.reductions_in_flight += 1
        self.counted = True
        self.enter(Phase.SENDING)
        self.cursor = self._next_to_send(0)
        self.probe_at = now + RETRY_SECONDS
        self._pump(now)

    def finished(self) -> None:
        if self.counted:
            self.counted = False
            self.budget.reductions_in_flight -= 1

    def get_timer(self) -> float | None:
        times = [t for t in (self.pump_at, self.probe_at, self.ack_at) if t is not None]
        return min(times, default=None)

    def handle_timer(self, now: float) -> None:
        if self.ack_at is not None and now >= self.ack_at:
            self._flush_acks()
        if self.probe_at is not None and now >= self.probe_at:
            # The credit has stalled: ask for it (the answer also carries any resend requests).
            self.queue(self.route, Outgoing(Kind.CREDIT, self.seq, 0,
                                            pack_credit_probe(self.cursor), AGGREGATOR))
            self.stats["credit_probes"] += 1
            self.probe_at = now + RETRY_SECONDS
        self._pump(now)

    def after_receive(self, now: float) -> None:
        self._pump(now)
        if self.results == self.k:
            self._flush_acks()
            if self.credit >= self.total and self.phase is Phase.RECEIVING:
                self.enter(Phase.DRAINING)
                self.probe_at = self.pump_at = None
        self._check_done()

    def waiting_for(self) -> str:
        return (f"the aggregator: {self.results} of {self.k} results, credit {self.credit} of "
                f"{self.total} chunks")

    # -- results and credit ----------------------------------------------------------------
    def _on_results(self, run, now: float) -> None:
        """A run of results. Whole consecutive chunks of this rank's block none of which is
        here yet are added with one numpy call; any other run, one result at a time."""
        first, last, count = run.chunks[0], run.chunks[-1], len(run)
        if count > 1 and last - first + 1 == count and last < self.total:
            (block, c), (last_block, last_c) = self._place(first), self._place(last)
            start, span = c * self.chunk_elems, count * self.chunk_elems
            if block == last_block == self.rank and last_c - c == count - 1 and \
                    run.length == self.chunk_elems * self.itemsize and \
                    start + span <= self.desc.count and not self.have[c:c + count].any():
                own = block * self.desc.count + start
                self._add(self.output[start:start + span], run.rows().view(self.desc.dtype),
                          self.input[own:own + span], count)
                self.have[c:c + count] = True
                self._acknowledge(range(first, last + 1), now)
                return
        for hdr, payload in run.messages():
            self._on_result(hdr, payload, now)

    def _on_result(self, hdr, payload, now: float) -> None:
        g = hdr.chunk
        block, c = self._place(g) if g < self.total else (None, 0)
        if block != self.rank:
            self.reject("out_of_range", f"result for chunk {g}, not in rank {self.rank}'s block")
        mine = self.input[self._elements(g)]
        if len(payload) != mine.nbytes:
            self.reject("wrong_length", f"result for chunk {g} has {len(payload)} bytes, not "
                                        f"{mine.nbytes}")
        if not self.have[c]:
            start = c * self.chunk_elems
            self._add(self.output[start:start + len(mine)],
                      np.frombuffer(payload, self.desc.dtype), mine, 1)
            self.have[c] = True
        else:
            self.stats["duplicate_results"] += 1
        self._acknowledge((g,), now)

    def _add(self, out: np.ndarray, sums: np.ndarray, mine: np.ndarray, count: int) -> None:
        """The aggregator's sums of `count` chunks plus this rank's own, into the output."""
        shape = sums.shape
        out, mine = out.reshape(shape), mine.reshape(shape)
        add_into(out, sums, mine)
        if self.desc.op == "avg":
            divide_into(out, self.world)
        self.results += count
        self.progress += count
        self.stats["results"] += count

    def _acknowledge(self, chunks, now: float) -> None:
        """Acknowledge every copy of a result: the acknowledgement before may have been lost."""
        self.acks.extend(chunks)
        if len(self.acks) >= ACK_BATCH:
            self._flush_acks()
        elif self.ack_at is None:
            self.ack_at = now + ACK_DELAY_SECONDS

    def _flush_acks(self) -> None:
        if self.acks:
            self.queue(self.route, Outgoing(Kind.RESULT_ACK, self.seq, len(self.acks),
                                            pack_acks(self.acks), AGGREGATOR))
            self.acks = []
        self.ack_at = None

    def _on_credit(self, hdr, payload, now: float) -> None:
        try:
            released, again = unpack_credit(payload)
        except MalformedError as err:
            self.reject("malformed", str(err))
        if released > self.total:
            self.reject("out_of_range", f"credit {released} beyond {self.total} chunks")
        if released > self.credit:
            self.credit = released
            self.progress += 1
            self.probe_at = now + RETRY_SECONDS
        pending = set(self.resend)
        for g in again:
            if g >= self.cursor or self._place(g)[0] == self.rank:
                continue  # not sent yet anyway, or not ours to send
            if g not in pending:
                self.resend.append(g)
                pending.add(g)
                self.stats["contributions_resent"] += 1

    # -- sending ---------------------------------------------------------------------------
    def _pump(self, now: float) -> None:
        """Send what the credit window and the uplink budget allow, a batch at a time: the
        budget's batch leaves together (the engine sends it in one call, the receiver reads it
        in one), or waits until the budget holds it all. Before the time set for that, nothing
        can go: credit and resend requests only make the batch larger."""
        if self.pump_at is not None and now < self.pump_at:
            return
        self.pump_at = None
        while True:
            resends = min(len(self.resend), self.group)
            chunks = [self.resend[i] for i in range(resends)]
            data = [self._bytes(g) for g in chunks]
            after = self.cursor  # the next chunk not yet sent once: never one of this rank's
            limit = min(self.total, self.credit + self.slots)
            while len(chunks) < self.group and after < limit:
                _, _, end = owner_span(after, self.world, self.k, self.group)
                take = min(end, limit, after + self.group - len(chunks))
                chunks.extend(range(after, take))
                data.extend(self._consecutive_bytes(after, take))
                after = take if take < end else self._next_to_send(end)
            if not chunks:
                return
            wire = sum(map(len, data)) + len(data) * datagram_link_bytes(CONTRIB_PREFIX.size)
            if not self.budget.try_take(wire, now):
                self.pump_at = self.budget.ready_at(wire, now)
                return
            self.queue_all(self.route, [Outgoing(Kind.CONTRIB, self.seq, g, (self.prefix, d),
                                                 AGGREGATOR) for g, d in zip(chunks, data)])
            self._flush_acks()
            for _ in range(resends):
                self.resend.popleft()
            self.progress += len(chunks) - resends
            self.cursor = after
            if self.cursor >= self.total and self.phase is Phase.SENDING:
                self.enter(Phase.RECEIVING)
