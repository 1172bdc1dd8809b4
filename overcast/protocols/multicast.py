"""Reliable multicast Broadcast, and the AllGather built from chained broadcasts (BRIEF section 3).

Each root cuts its segment into MTU-sized chunks and multicasts them, paced; receivers write each
chunk straight to its place and mark it in a per-chunk state array. A chunk counts as lost once
chunks well past it have arrived from the same root (roots send in order), or once the root has
said, over its reliable stream, that it has sent everything. Lost chunks are not multicast again:
the receiver asks its ring successor (rank+1) for each contiguous gap, and the successor answers
from its own buffer over the reliable stream, or, if it misses the same chunks, defers until its
own repair (from rank+2, and so on toward the root, which has them all) has filled them.

A rank is done when it has every chunk, has sent its own segment, and has the FIN of rank-1, which
rank-1 sends once it has every chunk and so will ask nothing more: one FIN round, not a tree of
acknowledgements.
"""

from __future__ import annotations

import numpy as np

from overcast.buffers import chunk_views
from overcast.protocols.base import MULTICAST, STREAM, Accept, Collective, Descriptor, Outgoing, \
    Phase
from overcast.protocols.budget import LinkBudget
from overcast.schedules.chains import chain_position, chunk_count, concurrent_senders, \
    stream_rate
from overcast.wire.header import ANY, Kind, MalformedError, datagram_link_bytes
from overcast.wire.messages import pack_ranges, unpack_ranges

MISSING, REQUESTED, HAVE = 0, 1, 2
# A gap this many chunks behind the newest chunk seen from its root is taken as lost.
REORDER_SLACK = 4
# After a root's end-of-multicast notice, datagrams still in flight get this long to land.
TAIL_GRACE_SECONDS = 0.002
# After a stall, a sender may catch up by at most this much time's worth of datagrams at once.
MAX_BURST_SECONDS = 0.005
REPAIR_FRAME_BYTES = 128 * 1024
_RANGES_PER_REQUEST = 512
# Phases in which a rank may still be asked for chunks, told a root has ended, or get the FIN.
_BEFORE_DRAINING = frozenset((Phase.WAITING, Phase.SENDING, Phase.RECEIVING))


class MulticastGather(Collective):
    """Chained reliable broadcasts into one buffer.

    `segments` lists (root, byte offset, byte length) in order: one per rank for AllGather, one
    for Broadcast. All segments have the same length. `budget` is this host's uplink: each
    stream goes at its rate over the number of streams a receiver takes in at once, less the
    share of the receivers' links that in-network reductions in flight need for their results.
    """

    verify_every_peer = True
    ACCEPTS = {
        Kind.MCAST_DATA: Accept("_on_chunks", "roots", runs=True),
        Kind.REPAIR_DATA: Accept("_on_repair", "successor"),
        Kind.REPAIR_REQUEST: Accept("_on_repair_request", "predecessor", _BEFORE_DRAINING),
        Kind.ACTIVATE: Accept("_on_activate", "chain_prev", frozenset((Phase.WAITING,))),
        Kind.MCAST_END: Accept("_on_end", "other_roots", _BEFORE_DRAINING),
        Kind.FIN: Accept("_on_fin", "predecessor", _BEFORE_DRAINING),
    }

    def __init__(self, seq: int, rank: int, world: int, desc: Descriptor, buffer: np.ndarray,
                 segments: list[tuple[int, int, int]], *, source: np.ndarray | None,
                 roots: int, chunk_bytes: int, budget: LinkBudget):
        super().__init__(seq, rank, world, desc)
        self.buffer = buffer.view(np.uint8)
        self.bytes = memoryview(self.buffer)  # chunks are copied through this: cheaper per call
        self.source = None if source is None else source.view(np.uint8)
        self.segments = segments
        self.segment_bytes = segments[0][2]
        self.chunk_bytes = chunk_bytes
        self.k = chunk_count(self.segment_bytes, chunk_bytes)
        self.state = np.zeros(len(segments) * self.k, np.uint8)
        self.missing = [self.k] * len(segments)
        self.newest = [-1] * len(segments)
        self.gaps: list[list[tuple[int, int]]] = [[] for _ in segments]  # skipped, not yet lost
        self.tail_due: dict[int, float] = {}
        self.segment_of_root = {root: s for s, (root, _, _) in enumerate(segments)}
        self.roots = frozenset(self.segment_of_root)
        self.other_roots = self.roots - {rank}
        self.ended: set[int] = set()  # roots whose end-of-multicast notice came
        self.mine = self.segment_of_root.get(rank)
        head, self.chain_next = chain_position(world, roots, rank) if self.mine is not None \
            and len(segments) > 1 else (True, None)
        self.head = head
        self.chain_prev = rank - 1 if self.mine is not None and not head else None
        self.next_chunk = 0 if self.mine is not None else self.k
        self.next_send: float | None = None
        self.budget = budget
        self.concurrent = concurrent_senders(world, roots) if len(segments) > 1 else 1
        self.successor = (rank + 1) % world
        self.predecessor = (rank - 1) % world
        self.fin_from_predecessor = world == 1
        self.sent_fin = False
        self.deferred: list[tuple[int, int]] = []

    # -- geometry --------------------------------------------------------------------------
    def _span(self, gid: int, count: int = 1) -> tuple[int, int]:
        """Byte range in the buffer of chunks gid .. gid+count-1 (one segment)."""
        s, k = divmod(gid, self.k)
        offset = self.segments[s][1]
        start = k * self.chunk_bytes
        end = min((k + count) * self.chunk_bytes, self.segment_bytes)
        return offset + start, offset + end

    # -- the contract ----------------------------------------------------------------------
    def start(self, now: float) -> None:
        if self.mine is not None:
            lo = self.mine * self.k
            self.state[lo:lo + self.k] = HAVE
            self.missing[self.mine] = 0
            if self.source is not None:
                off, n = self.segments[self.mine][1:]
                self.buffer[off:off + n] = self.source
        if self.k == 0:  # nothing to send, nothing anyone could ask for: no messages at all
            self.missing = [0] * len(self.segments)
            self.next_chunk = 0
            self.fin_from_predecessor = self.sent_fin = True
            self.ended = set(self.other_roots)
            self.enter(Phase.RECEIVING)
        elif self.mine is None:
            self.enter(Phase.RECEIVING)
        elif self.head:
            self.enter(Phase.SENDING)
            self.next_send = now
        else:
            self.enter(Phase.WAITING)
        self._pump(now)
        self._progress(now)

    def get_timer(self) -> float | None:
        times = list(self.tail_due.values())
        if self.phase is Phase.SENDING:
            times.append(self.next_send)
        return min(times, default=None)

    def _lead(self) -> float:
        """How far ahead of its time a chunk may go: at each wake-up the chunk that is due
        leaves with the rest of the budget's batch, so batches, not chunks, are paced."""
        return (self.budget.batch - 1) * datagram_link_bytes(self.chunk_bytes) / \
            self.stream_rate() if self.budget.rate else 0.0

    def handle_timer(self, now: float) -> None:
        self._pump(now)
        for s, due in list(self.tail_due.items()):
            if now >= due:
                del self.tail_due[s]
                self.gaps[s].clear()
                self._request(s, 0, self.k)
        self._progress(now)

    def after_receive(self, now: float) -> None:
        self._progress(now)

    def _on_repair_request(self, hdr, payload, now: float) -> None:
        try:
            ranges = unpack_ranges(payload)
        except MalformedError as err:
            self.reject("malformed", str(err))
        for first, count in ranges:
            self._check_range(first, count)
        for first, count in ranges:
            if (self.state[first:first + count] == HAVE).all():
                self._serve(first, count)
            else:  # served once this rank's own repair has filled the range
                self.deferred.append((first, count))
                self.stats["repair_deferrals"] += 1

    def _on_activate(self, hdr, payload, now: float) -> None:
        self.progress += 1
        self.enter(Phase.SENDING)
        self.next_send = now
        self._pump(now)

    def _on_end(self, hdr, payload, now: float) -> None:
        if hdr.src in self.ended:
            self.reject("duplicate", f"a second end-of-multicast from rank {hdr.src}")
        self.ended.add(hdr.src)
        self.progress += 1
        self.tail_due[self.segment_of_root[hdr.src]] = now + TAIL_GRACE_SECONDS

    def _on_fin(self, hdr, payload, now: float) -> None:
        if self.fin_from_predecessor:
            self.reject("duplicate", f"a second FIN from rank {hdr.src}")
        self.fin_from_predecessor = True
        self.progress += 1

    def waiting_for(self) -> str:
        gaps = {self.segments[s][0]: m for s, m in enumerate(self.missing) if m}
        parts = []
        if gaps:
            parts.append("chunks from " + ", ".join(f"rank {r} ({m} of {self.k} missing)"
                                                    for r, m in gaps.items()))
        if self.phase is Phase.WAITING:
            parts.append(f"activation by rank {self.chain_prev}")
        elif self.phase is Phase.SENDING:
            parts.append("its own multicast to finish")
        if not self.fin_from_predecessor:
            parts.append(f"the FIN of rank {self.predecessor}")
        if len(self.ended) < len(self.other_roots):
            parts.append(f"{len(self.other_roots) - len(self.ended)} roots' end-of-multicast "
                         f"notices")
        return "; ".join(parts) or "its sends to drain"

    # -- receiving data --------------------------------------------------------------------
    def _on_chunks(self, run, now: float) -> None:
        """A run of chunks from one root. Whole consecutive chunks none of which is here yet go
        into place in one copy; any other run, one chunk at a time."""
        first, last = run.chunks[0], run.chunks[-1]
        s = self.segment_of_root[run.hdr.src]
        if not (s * self.k <= first and last < (s + 1) * self.k):
            self.reject("out_of_range", f"multicast chunks {first}..{last} from rank "
                                        f"{run.hdr.src} are not its to send")
        count = len(run)
        if count > 1 and last - first + 1 == count and run.length == self.chunk_bytes:
            start, end = self._span(first, count)
            if end - start == count * run.length and \
                    not (self.state[first:last + 1] == HAVE).any():
                self.buffer[start:end].reshape(count, run.length)[:] = run.rows()
                self.state[first:last + 1] = HAVE
                self.missing[s] -= count
                self.progress += count
                self.stats["multicast_chunks"] += count
                self._advance(s, first - s * self.k, last - s * self.k)
                return
        for i, g in enumerate(run.chunks):
            if self._store(g, run.payload(i)):
                self.stats["multicast_chunks"] += 1
            else:
                self.stats["duplicate_chunks"] += 1
            self._advance(s, g - s * self.k, g - s * self.k)

    def _advance(self, s: int, first: int, last: int) -> None:
        """Chunks first..last of segment s came: a skip before them is a gap, and a gap far
        enough behind the newest chunk is asked for."""
        newest = self.newest[s]
        if last > newest:
            gaps = self.gaps[s]
            if first > newest + 1:
                gaps.append((newest + 1, first))
            self.newest[s] = last
            while gaps and gaps[0][1] - 1 + REORDER_SLACK <= last:
                self._request(s, *gaps.pop(0))

    def _on_repair(self, hdr, payload, now: float) -> None:
        if not payload:
            self.reject("wrong_length", f"repair of chunk {hdr.chunk} carries nothing")
        first = hdr.chunk
        count = chunk_count(len(payload), self.chunk_bytes)
        self._check_range(first, count)
        start, end = self._span(first, count)
        if end - start != len(payload):
            self.reject("wrong_length", f"repair of chunks {first}+{count} carries "
                                        f"{len(payload)} bytes, not {end - start}")
        fresh = 0
        for i in range(count):
            a, b = self._span(first + i)
            fresh += self._store(first + i, payload[a - start:b - start])
        self.stats["repaired_chunks"] += fresh
        self.stats["repair_bytes"] += len(payload)

    def _store(self, gid: int, payload) -> bool:
        """Put a chunk in place; False if it was already there."""
        start, end = self._span(gid)
        if len(payload) != end - start:
            self.reject("wrong_length", f"chunk {gid} has {len(payload)} bytes, expected "
                                        f"{end - start}")
        if self.state[gid] == HAVE:
            return False
        self.bytes[start:end] = payload
        self.progress += 1
        self.state[gid] = HAVE
        self.missing[gid // self.k] -= 1
        return True

    def _check_range(self, first: int, count: int) -> None:
        if count < 1 or first + count > len(self.state) or \
                first // self.k != (first + count - 1) // self.k:
            self.reject("out_of_range", f"chunk range {first}+{count} is not within one segment")

    # -- repair ----------------------------------------------------------------------------
    def _request(self, s: int, lo: int, hi: int) -> None:
        """Ask the successor for the chunks of segment s in [lo, hi) still missing."""
        base = s * self.k
        states = self.state[base + lo:base + hi]
        idx = np.flatnonzero(states == MISSING)
        if not len(idx):
            return
        self.state[base + lo + idx] = REQUESTED
        # contiguous runs of missing chunks
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = idx[np.r_[0, breaks]]
        ends = idx[np.r_[breaks - 1, len(idx) - 1]] + 1
        ranges = [(base + lo + int(a), int(b - a)) for a, b in zip(starts, ends)]
        for i in range(0, len(ranges), _RANGES_PER_REQUEST):
            body = pack_ranges(ranges[i:i + _RANGES_PER_REQUEST])
            self.queue((STREAM, self.successor),
                       Outgoing(Kind.REPAIR_REQUEST, self.seq, 0, body, self.successor))
        self.stats["repair_requests"] += len(ranges)

    def _serve_deferred(self) -> None:
        still = []
        for first, count in self.deferred:
            if (self.state[first:first + count] == HAVE).all():
                self._serve(first, count)
            else:
                still.append((first, count))
        self.deferred = still

    def _serve(self, first: int, count: int) -> None:
        self.progress += 1  # the predecessor's wait is this rank's too: it awaits its FIN
        per_frame = max(1, REPAIR_FRAME_BYTES // self.chunk_bytes)
        for gid in range(first, first + count, per_frame):
            n = min(per_frame, first + count - gid)
            start, end = self._span(gid, n)
            self.queue((STREAM, self.predecessor),
                       Outgoing(Kind.REPAIR_DATA, self.seq, gid, self.bytes[start:end],
                                self.predecessor))
            self.stats["repair_bytes_served"] += end - start

    # -- sending ---------------------------------------------------------------------------
    def _pump(self, now: float) -> None:
        """Release the datagrams this rank's pace allows by `now`."""
        if self.phase is not Phase.SENDING:
            return
        next_send = max(self.next_send, now - MAX_BURST_SECONDS)
        rate, due = self.stream_rate(), now + self._lead()
        # each chunk is due at its own time; the ones due now leave as one batch
        first, last = self.next_chunk, self.k - 1
        full = datagram_link_bytes(self.chunk_bytes)
        shortest = datagram_link_bytes(self.segment_bytes - last * self.chunk_bytes)
        end, wire = first, 0
        while end <= last and next_send <= due:
            spent = full if end < last else shortest
            wire += spent
            next_send += spent / rate
            end += 1
        self.next_send = next_send
        if end > first:
            gid = self.mine * self.k + first
            views = chunk_views(self.bytes, *self._span(gid, end - first), self.chunk_bytes)
            self.queue_all((MULTICAST, -1), [Outgoing(Kind.MCAST_DATA, self.seq, gid + i, view,
                                                      ANY) for i, view in enumerate(views)])
            self.budget.take(wire, now)
            self.next_chunk = end
            self.progress += end - first
        if self.next_chunk == self.k:
            for peer in range(self.world):
                if peer != self.rank:
                    self.queue((STREAM, peer), Outgoing(Kind.MCAST_END, self.seq, 0, b"", peer))
            if self.chain_next is not None:
                self.queue((STREAM, self.chain_next),
                           Outgoing(Kind.ACTIVATE, self.seq, 0, b"", self.chain_next))
            self.enter(Phase.RECEIVING)

    def stream_rate(self) -> float:
        """Link bytes per second of this rank's stream (see schedules.chains.stream_rate)."""
        return stream_rate(self.budget.rate, self.world, self.concurrent,
                           bool(self.budget.reductions_in_flight))

    def _progress(self, now: float) -> None:
        if self.deferred:
            self._serve_deferred()
        complete = not any(self.missing)
        if complete and not self.sent_fin and self.world > 1:
            self.sent_fin = True
            self.queue((STREAM, self.successor), Outgoing(Kind.FIN, self.seq, 0, b"",
                                                          self.successor))
        if complete and self.fin_from_predecessor and self.phase is Phase.RECEIVING \
                and len(self.ended) == len(self.other_roots):
            self.enter(Phase.DRAINING)
        self._check_done()
