"""The aggregator's reduction engine, sans I/O: what a switch that sums does (SHARP's aggregation
nodes, SwitchML's software stand-in), for many communicators at once.

Per reduction (one communicator's in-network ReduceScatter) it keeps a pool of `slots` slots.
Chunk g belongs to the block its number says (overcast.schedules.reduction; the ranks name the
numbering's group in every contribution). Chunk g may occupy a slot once every chunk below
g - slots has been released; a rank never sends beyond that window, so chunk g can have slot
g mod `slots`. A slot holds one row per rank, so contributions are kept as they arrive, a
retransmitted one is recognised by the contributor bitmap and never counted twice, and the sum
is taken in rank order once all P-1 contributors (every rank but the block's owner) are in: the
same bits whatever the arrival order. 16-bit floats are summed in float32. The pool is one
array (slot, rank, element): a run of contributions from one rank (wire.runs) lands with one
numpy call, and the slots it completes are summed with one more. The sum goes to the owner; the
slot is released when the owner acknowledges it, and the release is announced to every rank
as credit now and then, and to an owner with every batch of results (as that send's last
datagram: no send or read of its own). Slots waiting on contributors ask them again (NACK);
unacknowledged results are sent again: at once when their owner acknowledges a result sent
after them, else after the round trip's timeout. Memory is the pool's, whatever the message
size.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from overcast.buffers import accumulator_dtype, dtype_from_code
from overcast.limits import check_slots
from overcast.protocols.base import Outgoing
from overcast.schedules.reduction import chunk_owner, owner_span
from overcast.wire.header import AGGREGATOR, ANY, Kind, MalformedError
from overcast.wire.messages import CONTRIB_PREFIX, pack_credit, unpack_acks, \
    unpack_credit_probe
from overcast.wire.runs import Run

NACK_SECONDS = 0.02
# A result not acknowledged within the round trip's timeout is sent again. The timeout follows
# the round trip from a result to its acknowledgement, as TCP's does (RFC 6298): the smoothed
# time plus four times its variation, within [RESEND_SECONDS, MAX_RESEND_SECONDS]. Ranks or an
# aggregator slowed by their CPU then do not resend results that are only late.
RESEND_SECONDS = 0.05
MAX_RESEND_SECONDS = 1.0
# Each further resend of the same result waits twice as long: an overloaded path is not made
# worse by its own retries. A wait never exceeds LONGEST_RESEND_WAIT, whatever the round trip.
MAX_BACKOFF = 8
LONGEST_RESEND_WAIT = RESEND_SECONDS * (1 << MAX_BACKOFF)
# Slots are checked for overdue contributions and acknowledgements this often.
TICK_SECONDS = 0.01
# Announce the credit to every rank after this fraction of the pool has been released since
# the last time (owners hear it with their results in between).
CREDIT_EVERY = 1 / 4
# Reductions of one communicator in flight at once; contributions for more wait for a retry.
MAX_REDUCTIONS = 4
# Finished reductions remembered, to answer late retransmissions with the final credit.
TOMBSTONES = 64


@dataclass
class Slot:
    g: int
    elems: int                  # elements per contribution (row g mod window of the pool)
    have: int = 0               # bitmap of ranks whose contribution is in
    first_seen: float = 0.0
    nacked: float = 0.0
    result: np.ndarray | None = None  # the sum's bytes: a row of its run's sums, not a copy
    sent_at: float = 0.0
    sent: int = 0               # the reduction's result sends when its last copy left
    resends: int = 0
    acked: bool = False


@dataclass
class Reduction:
    seq: int
    world: int
    dtype: np.dtype
    code: int                   # the dtype's code on the wire
    group: int                  # of the chunk numbering (schedules.reduction)
    total: int
    window: int                 # slots: chunks that may be in the aggregator at once
    released: int = 0
    announced: int = 0
    highest: int = -1           # the highest chunk any contribution has come for
    passed: list[int] = field(default_factory=list)  # per rank: the highest chunk it sent
    slots: dict[int, Slot] = field(default_factory=dict)
    holes: dict[int, float] = field(default_factory=dict)  # chunk -> when it was last asked for
    pool: np.ndarray | None = None  # (window, world, widest chunk): the contributions, by slot
    results_sent: int = 0
    # per owner: (sends so far, chunk) of each result sent it, in order, until acknowledged
    unacked: collections.defaultdict = field(
        default_factory=lambda: collections.defaultdict(collections.deque))

    def owner(self, g: int) -> int:
        """The rank whose block chunk g is of: the one its sum goes to."""
        return chunk_owner(g, self.world, self.total // self.world, self.group)

    def owner_span(self, g: int) -> tuple[int, int, int]:
        """(owner, first, end): g's owner, and the chunks first to end - 1 that are all its."""
        return owner_span(g, self.world, self.total // self.world, self.group)


class RoundTrip:
    """The round trip from a result to its acknowledgement (RFC 6298's estimator). Only results
    sent once are sampled (Karn's rule): an acknowledgement does not say which copy it answers."""

    __slots__ = ("smoothed", "variation")

    def __init__(self):
        self.smoothed: float | None = None
        self.variation = 0.0

    def sample(self, seconds: float) -> None:
        if self.smoothed is None:
            self.smoothed, self.variation = seconds, seconds / 2
        else:
            self.variation += (abs(self.smoothed - seconds) - self.variation) / 4
            self.smoothed += (seconds - self.smoothed) / 8

    def timeout(self) -> float:
        if self.smoothed is None:
            return RESEND_SECONDS
        return min(MAX_RESEND_SECONDS,
                   max(RESEND_SECONDS, self.smoothed + 4 * self.variation))


class CommState:
    """One registered communicator: its world, its reductions, and the round trip to its ranks
    (one estimate: they share the switch)."""

    def __init__(self, world: int, slots: int):
        self.world, self.slots = world, slots
        self.round_trip = RoundTrip()
        self.reductions: dict[int, Reduction] = {}
        self.finished: collections.OrderedDict[int, int] = collections.OrderedDict()


class Aggregator:
    """Feed it authenticated messages (`receive`) and the clock (`handle_timer`); take what it
    wants sent from `outbox`: (communicator key, destination rank, Outgoing).

    Whatever does not fit is dropped and counted in `drops` by reason (one line each): any rank
    of a communicator can be impersonated by a replay, so nothing here raises.
    """

    # What ranks send the aggregator besides contributions (taken a run at a time, by
    # _on_contributions): kind -> (payload parser, handler). Any rank of the communicator may
    # send each; whether it fits the reduction's state is the handler's check.
    HANDLERS = {Kind.RESULT_ACK: (unpack_acks, "_on_acks"),
                Kind.CREDIT: (unpack_credit_probe, "_on_credit_probe")}

    def __init__(self, slots: int = 256, drops: collections.Counter | None = None):
        check_slots(slots)
        self.slots = slots
        self.comms: dict[object, CommState] = {}
        self.outbox: collections.deque[tuple[object, int, Outgoing]] = collections.deque()
        self.stats: collections.Counter = collections.Counter()
        self.drops = collections.Counter() if drops is None else drops
        self.pool_bytes = 0       # contribution rows alive, in slots or kept for reuse
        self.peak_pool_bytes = 0
        self.next_tick: float | None = None

    # -- registration ----------------------------------------------------------------------
    def register(self, key, world: int, slots: int | None = None) -> int:
        """Take a communicator of `world` ranks; its reductions get at most `slots` slots
        (and never more than the aggregator's own). Returns the slots granted."""
        comm = self.comms.get(key)
        if comm is None or comm.world != world:
            granted = self.slots if slots is None else max(1, min(slots, self.slots))
            comm = self.comms[key] = CommState(world, granted)
        return comm.slots

    def unregister(self, key) -> None:
        comm = self.comms.pop(key, None)
        if comm is not None:
            for red in comm.reductions.values():
                self._free(red)

    # -- the contract ----------------------------------------------------------------------
    def receive(self, key, hdr, payload: memoryview, now: float) -> None:
        """Take one authentic message."""
        self.receive_run(key, Run.one(hdr, payload), now)

    def receive_run(self, key, run: Run, now: float) -> None:
        """Take a run of authentic messages from one rank (wire.runs); a run that does not fit
        is dropped whole, each of its messages counted."""
        hdr = run.hdr
        comm = self.comms.get(key)
        if comm is None:
            self.drops["unregistered"] += len(run)
        elif hdr.dst != AGGREGATOR:
            self.drops["misdirected"] += len(run)
        elif not 0 <= hdr.src < comm.world:
            self.drops["wrong_sender"] += len(run)
        elif hdr.kind == Kind.CONTRIB:
            self._on_contributions(key, comm, run, now)
        elif hdr.kind not in self.HANDLERS:
            self.drops["unexpected_kind"] += len(run)
        else:
            parse, handler = self.HANDLERS[hdr.kind]
            for hdr, payload in run.messages():
                try:
                    message = parse(payload)
                except MalformedError:
                    self.drops["malformed"] += 1
                    continue
                getattr(self, handler)(key, comm, hdr, message, now)

    def _on_acks(self, key, comm: CommState, hdr, chunks: list[int], now: float) -> None:
        red = comm.reductions.get(hdr.seq)
        if red is None:
            self.drops["stale"] += 1
            return
        newest = 0  # the latest send among the results acknowledged that were sent once
        for g in chunks:
            sent = self._on_ack(key, comm, red, hdr.src, g, now)
            if sent > newest:
                newest = sent
        if newest and hdr.seq in comm.reductions:
            self._resend_overtaken(key, red, hdr.src, newest, now)

    def _resend_overtaken(self, key, red: Reduction, owner: int, newest: int,
                          now: float) -> None:
        """Results to `owner` still unacknowledged that left before the result sent `newest`,
        which the owner has acknowledged: the path to an owner keeps order, and an owner
        acknowledges every result it takes, so these were lost. They go again at once (TCP's
        fast retransmit), not after the resend timeout, which would hold the window's head, and
        with it every rank's credit, for 50 ms or more."""
        queue = red.unacked[owner]
        while queue:
            sent, g = queue[0]
            slot = red.slots.get(g)
            if slot is None or slot.acked or slot.sent != sent:  # released, or sent again since
                queue.popleft()
                continue
            if sent > newest:
                break
            queue.popleft()
            slot.resends += 1
            self._send_result(key, red, slot, owner, now)
            self.stats["results_resent_early"] += 1

    def _on_credit_probe(self, key, comm: CommState, hdr, sent_below: int, now: float) -> None:
        """A rank's credit has stalled: say what it still owes. A reduction that is neither in
        flight nor finished was refused (MAX_REDUCTIONS were in flight): the rank sends its
        first window again, and it is taken once there is room."""
        red = comm.reductions.get(hdr.seq)
        if red is None and hdr.seq not in comm.finished:  # refused
            owed = list(range(min(sent_below, comm.slots)))  # the rank skips its own
            self.outbox.append((key, hdr.src, Outgoing(Kind.CREDIT, hdr.seq, 0,
                                                       pack_credit(0, owed), hdr.src)))
        else:
            owed = self._owed(red, hdr.src, sent_below) if red is not None else []
            self._answer_credit(key, comm, hdr.seq, hdr.src, owed)
        self.stats["nacks"] += len(owed)

    def get_timer(self) -> float | None:
        if self.next_tick is None and any(c.reductions for c in self.comms.values()):
            return 0.0
        return self.next_tick

    def handle_timer(self, now: float) -> None:
        """Ask again for overdue contributions, send again unacknowledged results."""
        busy = any(c.reductions for c in self.comms.values())
        self.next_tick = now + TICK_SECONDS if busy else None
        for key, comm in self.comms.items():
            timeout = comm.round_trip.timeout()
            for red in list(comm.reductions.values()):
                nacks: dict[int, list[int]] = collections.defaultdict(list)
                for slot in red.slots.values():
                    if slot.result is not None:
                        wait = min(timeout * (1 << min(slot.resends, MAX_BACKOFF)),
                                   LONGEST_RESEND_WAIT)
                        if not slot.acked and now >= slot.sent_at + wait:
                            slot.resends += 1
                            self._send_result(key, red, slot, red.owner(slot.g), now)
                            self.stats["results_resent"] += 1
                    elif now >= max(slot.first_seen, slot.nacked) + NACK_SECONDS:
                        slot.nacked = now
                        for rank in self._missing(red, slot.g, slot.have):
                            nacks[rank].append(slot.g)
                # A chunk with no slot below the highest seen may have lost every contribution.
                for g in range(red.released, red.highest):
                    if g in red.slots:
                        continue
                    asked = red.holes.setdefault(g, now)
                    if now >= asked + NACK_SECONDS:
                        red.holes[g] = now
                        for rank in self._missing(red, g, 0):
                            nacks[rank].append(g)
                for rank, gs in nacks.items():
                    self._credit(key, red, rank, gs)
                    self.stats["nacks"] += len(gs)

    # -- contributions ---------------------------------------------------------------------
    def _on_contributions(self, key, comm: CommState, run: Run, now: float) -> None:
        """A run of contributions from one rank, to one reduction: checked once, each chunk's
        slot found, their rows put in the pool with one numpy call, and the slots they complete
        summed with one more."""
        hdr, count = run.hdr, len(run)
        if run.length < CONTRIB_PREFIX.size:
            self.drops["malformed"] += count
            return
        data, at, stride, size = run.data, run.offset, run.stride, CONTRIB_PREFIX.size
        prefix = data[at:at + size]
        if any(data[i:i + size] != prefix for i in range(at + stride, at + count * stride,
                                                         stride)):
            self.drops["inconsistent"] += count  # one collective, one prefix
            return
        code, group, world, total = CONTRIB_PREFIX.unpack(prefix)
        red = comm.reductions.get(hdr.seq)
        if red is None:
            if hdr.seq in comm.finished:
                self._answer_credit(key, comm, hdr.seq, hdr.src, [])
                return
            try:
                dtype = dtype_from_code(code)
            except ValueError:
                self.drops["malformed"] += count
                return
            if world != comm.world or total % world or not group:
                self.drops["inconsistent"] += count
                return
            if len(comm.reductions) >= MAX_REDUCTIONS:  # sent again when the rank's credit stalls
                self.stats["refused"] += count
                return
            red = comm.reductions[hdr.seq] = Reduction(hdr.seq, world, dtype, code, group,
                                                       total, comm.slots, passed=[-1] * world)
        nbytes = run.length - CONTRIB_PREFIX.size
        if world != red.world or total != red.total or code != red.code \
                or group != red.group or nbytes % red.dtype.itemsize:
            self.drops["inconsistent"] += count
            return
        elems = nbytes // red.dtype.itemsize
        pool = self._pool(red, elems)
        src, bit = hdr.src, 1 << hdr.src
        everyone = (1 << red.world) - 1
        taken, places, complete, owners = [], [], [], []  # owners: of the complete slots
        late = False
        # this loop runs per contribution: what it reads of the reduction is read once
        total, released, window, slots = red.total, red.released, red.window, red.slots
        drops, stats = self.drops, self.stats
        owner = want = first = end = -1  # chunks first to end - 1 are owner's; want: their set
        for i, g in enumerate(run.chunks):
            if g >= total:
                drops["out_of_range"] += 1
                continue
            if not first <= g < end:
                owner, first, end = red.owner_span(g)
                want = everyone & ~(1 << owner)
            if owner == src:
                drops["wrong_sender"] += 1
                continue
            if g < released:  # done already: the sender missed the credit
                stats["late_contributions"] += 1
                late = True
                continue
            if g >= released + window:
                drops["beyond_window"] += 1
                continue
            if g > red.passed[src]:
                red.passed[src] = g
            slot = slots.get(g)
            if slot is None:
                slot = slots[g] = Slot(g, elems, first_seen=now)
                red.holes.pop(g, None)
                red.highest = max(red.highest, g)
            if slot.have & bit or slot.result is not None:
                stats["duplicate_contributions"] += 1
                continue
            if slot.elems != elems:
                drops["wrong_length"] += 1
                continue
            slot.have |= bit
            taken.append(i)
            places.append(g % window)
            if slot.have == want:
                complete.append(slot)
                owners.append(owner)
        if late:
            self._answer_credit(key, comm, hdr.seq, src, [])
        if not taken:
            return
        rows = run.rows(CONTRIB_PREFIX.size).view(red.dtype)
        pool[_index(places), src, :elems] = rows[_index(taken)]
        self.stats["contributions"] += len(taken)
        if complete:
            self._sum(red, pool, complete, owners, elems)
            for slot, owner in zip(complete, owners):
                self._send_result(key, red, slot, owner, now)
            for owner in dict.fromkeys(owners):
                self._credit(key, red, owner, [])

    def _sum(self, red: Reduction, pool: np.ndarray, slots: list[Slot], owners: list[int],
             elems: int) -> None:
        """Each slot's sum, in rank order, every slot with one numpy call. The owner adds its
        own contribution: its row counts nothing. A slot keeps its row of the sums, not a copy:
        sealing copies it once, into the datagram."""
        places = [slot.g % red.window for slot in slots]
        pool[places, owners, :elems] = 0
        sums = pool[_index(places), :, :elems].sum(axis=1, dtype=accumulator_dtype(red.dtype))
        sums = sums.astype(red.dtype, copy=False)
        for slot, result in zip(slots, sums.view(np.uint8)):
            slot.result = result
        self.stats["results"] += len(slots)

    def _pool(self, red: Reduction, elems: int) -> np.ndarray:
        """The reduction's pool, wide enough for `elems` per contribution. It is made as wide as
        the first contribution and made wider, keeping its rows, if a wider one comes (ranks
        send their widest chunks first, so that is rare)."""
        pool = red.pool
        if pool is None or pool.shape[2] < elems:
            wider = np.empty((red.window, red.world, elems), red.dtype)
            self.pool_bytes += wider.nbytes
            self.peak_pool_bytes = max(self.peak_pool_bytes, self.pool_bytes)
            if pool is not None:
                wider[:, :, :pool.shape[2]] = pool
                self.pool_bytes -= pool.nbytes
            pool = red.pool = wider
        return pool

    def _free(self, red: Reduction) -> None:
        if red.pool is not None:
            self.pool_bytes -= red.pool.nbytes
            red.pool = None
        red.slots.clear()

    def _send_result(self, key, red: Reduction, slot: Slot, owner: int, now: float) -> None:
        slot.sent_at = now
        red.results_sent += 1
        slot.sent = red.results_sent
        red.unacked[owner].append((slot.sent, slot.g))
        self.outbox.append((key, owner, Outgoing(Kind.RESULT, red.seq, slot.g, slot.result,
                                                 owner)))

    # -- release and credit ----------------------------------------------------------------
    def _on_ack(self, key, comm: CommState, red: Reduction, src: int, g: int,
                now: float) -> int:
        """Returns when the result acknowledged left (the reduction's sends so far) if this is
        the first acknowledgement of a result sent once, else 0."""
        slot = red.slots.get(g)
        if slot is None or slot.result is None or red.owner(g) != src:
            self.drops["stray_acks"] += 1
            return 0
        sent = 0
        if not slot.acked and not slot.resends:
            comm.round_trip.sample(now - slot.sent_at)
            sent = slot.sent
        slot.acked = True
        while (head := red.slots.get(red.released)) is not None and head.acked:
            del red.slots[red.released]
            red.released += 1
        if red.released == red.total:
            self._finish(key, red)
        elif red.released - red.announced >= max(1, int(red.window * CREDIT_EVERY)):
            self._announce(key, red)
        return sent

    def _announce(self, key, red: Reduction) -> None:
        """Tell every rank the credit, in one message to the group."""
        red.announced = red.released
        self._credit(key, red, ANY, [])

    def _finish(self, key, red: Reduction) -> None:
        comm = self.comms[key]
        self._announce(key, red)
        self._free(red)
        del comm.reductions[red.seq]
        comm.finished[red.seq] = red.total
        while len(comm.finished) > TOMBSTONES:
            comm.finished.popitem(last=False)
        self.stats["reductions"] += 1

    def _missing(self, red: Reduction, g: int, have: int) -> list[int]:
        """Contributors to chunk g not in `have` that have sent chunks past g: ranks send in
        order, so theirs was lost (or is very late). Ranks not there yet are left alone."""
        owner = red.owner(g)
        return [r for r in range(red.world)
                if r != owner and not have >> r & 1 and red.passed[r] > g]

    def _owed(self, red: Reduction, rank: int, sent_below: int) -> list[int]:
        """Chunks in the window below `sent_below` that `rank` has sent and that never came."""
        return [g for g in range(red.released, min(sent_below, red.released + red.window))
                if red.owner(g) != rank and not (g in red.slots and
                                               (red.slots[g].have >> rank & 1 or
                                                red.slots[g].result is not None))]

    def _answer_credit(self, key, comm: CommState, seq: int, rank: int, gs: list[int]) -> None:
        red = comm.reductions.get(seq)
        if red is not None:
            self._credit(key, red, rank, gs)
        elif seq in comm.finished:
            self.outbox.append((key, rank, Outgoing(Kind.CREDIT, seq, 0,
                                                    pack_credit(comm.finished[seq]), rank)))

    def _credit(self, key, red: Reduction, rank: int, resend: list[int]) -> None:
        self.outbox.append((key, rank, Outgoing(Kind.CREDIT, red.seq, 0,
                                                pack_credit(red.released, resend), rank)))


def _index(positions: list[int]):
    """Rising `positions` (they may wrap round once) as an index: a slice where they are
    consecutive (a view, and a cheaper copy), else the list."""
    first = positions[0]
    if positions[-1] - first == len(positions) - 1:
        return slice(first, first + len(positions))
    return positions


__all__ = ["Aggregator", "AGGREGATOR"]
