"""Reliable multicast Broadcast, and the AllGather built from chained broadcasts.

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

What happens per datagram (the own segment paced out, chunks written in place, the per-chunk
state, gaps noticed) runs in the rank's native datagram plane (overcast/native/rank/gather.h), on
the engine's thread without the GIL. This class keeps what goes on the streams: repair requests
and repairs (written in place through the plane), activation, end-of-multicast notices and the
FIN round; the plane tells it, in batches, of ranges to request, its own multicast sent, and
every chunk in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from overcast.protocols.base import STREAM, Accept, Collective, Descriptor, Outgoing, Phase
from overcast.protocols.budget import LinkBudget
from overcast.schedules.chains import chain_position, chunk_count, concurrent_senders
from overcast.wire.header import MISFITS, Kind, MalformedError
from overcast.wire.messages import pack_ranges, unpack_ranges
from overcast.wire.runs import Run

if TYPE_CHECKING:
    from overcast.native._core import GatherState

# After a root's end-of-multicast notice, datagrams still in flight get this long to land.
TAIL_GRACE_SECONDS = 0.002
REPAIR_FRAME_BYTES = 128 * 1024
_RANGES_PER_REQUEST = 512
# Phases in which a rank may still be asked for chunks, told a root has ended, or get the FIN.
_BEFORE_DRAINING = frozenset((Phase.WAITING, Phase.SENDING, Phase.RECEIVING))


class MulticastGather(Collective):
    """Chained reliable broadcasts into one buffer.

    `segments` lists (root, byte offset, byte length) in order: one per rank for AllGather, one
    for Broadcast. All segments have the same length. `budget` is this host's uplink: each
    stream goes at its rate over the number of streams a receiver takes in at once and over the
    multicast gathers whose streams have not all ended, less the share of the receivers' links
    that in-network reductions in flight need for their results.
    """

    verify_every_peer = True
    ACCEPTS = {
        Kind.MCAST_DATA: Accept("_to_plane", "roots", runs=True),
        Kind.REPAIR_DATA: Accept("_on_repair", "successor"),
        Kind.REPAIR_REQUEST: Accept("_on_repair_request", "predecessor", _BEFORE_DRAINING),
        Kind.ACTIVATE: Accept("_on_activate", "chain_prev", frozenset((Phase.WAITING,))),
        Kind.MCAST_END: Accept("_on_end", "other_roots", _BEFORE_DRAINING),
        Kind.FIN: Accept("_on_fin", "predecessor", _BEFORE_DRAINING),
    }

    def __init__(
        self,
        seq: int,
        rank: int,
        world: int,
        desc: Descriptor,
        buffer: np.ndarray,
        segments: list[tuple[int, int, int]],
        *,
        source: np.ndarray | None,
        roots: int,
        chunk_bytes: int,
        budget: LinkBudget,
    ):
        super().__init__(seq, rank, world, desc.cut(chunk_bytes, segments[0][2]))
        self.buffer = buffer.view(np.uint8)
        self.bytes = self.buffer.data  # repairs are served through this
        self.source = None if source is None else source.view(np.uint8)
        self.segments = segments
        self.segment_bytes = segments[0][2]
        self.chunk_bytes = chunk_bytes
        self.k = chunk_count(self.segment_bytes, chunk_bytes)
        self.tail_due: dict[int, float] = {}
        self.segment_of_root = {root: s for s, (root, _, _) in enumerate(segments)}
        self.roots = frozenset(self.segment_of_root)
        self.other_roots = self.roots - {rank}
        self.ended: set[int] = set()  # roots whose end-of-multicast notice came
        self.mine = self.segment_of_root.get(rank)
        head, self.chain_next = (
            chain_position(world, roots, rank)
            if self.mine is not None and len(segments) > 1
            else (True, None)
        )
        self.head = head
        self.chain_prev = rank - 1 if self.mine is not None and not head else None
        self.budget = budget
        self.concurrent = concurrent_senders(world, roots) if len(segments) > 1 else 1
        self.successor = (rank + 1) % world
        self.predecessor = (rank - 1) % world
        self.fin_from_predecessor = world == 1
        self.sent_fin = False
        self.deferred: list[tuple[int, int]] = []
        self.posted = False
        self.streams_ended = False  # told the plane: it no longer divides the other gathers' pace
        # An AllGather's every rank is a root and ends its multicast with a notice to every
        # other: the notices, which it waits for anyway, describe the call (and the repair
        # requests, which may come first).
        self.described_by_end_notices = len(segments) == world > 1 and self.k > 0

    # -- geometry --------------------------------------------------------------------------
    def _span(self, gid: int, count: int = 1) -> tuple[int, int]:
        """Byte range in the buffer of chunks gid .. gid+count-1 (one segment)."""
        s, k = divmod(gid, self.k)
        offset = self.segments[s][1]
        start = k * self.chunk_bytes
        end = min((k + count) * self.chunk_bytes, self.segment_bytes)
        return offset + start, offset + end

    def _state(self) -> GatherState | None:
        return self.plane.gather_state(self.seq) if self.posted else None

    # -- the contract ----------------------------------------------------------------------
    def start(self, now: float) -> None:
        if self.mine is not None and self.source is not None:
            off, n = self.segments[self.mine][1:]
            self.buffer[off : off + n] = self.source
        if self.k == 0:  # nothing to send, nothing anyone could ask for: no messages at all
            self.fin_from_predecessor = self.sent_fin = True
            self.ended = set(self.other_roots)
            self.enter(Phase.RECEIVING)
            self._progress(now)
            return
        self.plane.gather(
            self.seq,
            self.buffer,
            [(root, off) for root, off, _ in self.segments],
            self.segment_bytes,
            self.chunk_bytes,
            -1 if self.mine is None else self.mine,
            self.concurrent,
            self.budget.native,
        )
        self.posted = True
        if self.mine is None:
            self.enter(Phase.RECEIVING)
        elif self.head:
            self.enter(Phase.SENDING)
            self.plane.gather_activate(self.seq, now)
        else:
            self.enter(Phase.WAITING)
        self.native_news(now)

    def get_timer(self) -> float | None:
        return min(self.tail_due.values(), default=None)

    def stepped_at(self) -> float | None:
        state = self._state()
        return state["progress_at"] if state and state["progress_at"] >= 0 else None

    def handle_timer(self, now: float) -> None:
        for s, due in list(self.tail_due.items()):
            if now >= due:  # asked once; again later if the plane had no memory to list it
                if self.plane.gather_request(self.seq, s, 0, self.k):
                    del self.tail_due[s]
                else:
                    self.tail_due[s] = now + TAIL_GRACE_SECONDS
        self.native_news(now)

    def after_receive(self, now: float) -> None:
        self._progress(now)

    def native_news(self, now: float) -> None:
        """What the plane has to tell: ranges to ask the successor for, this rank's multicast
        all sent, every chunk in place."""
        if not self.posted:
            return
        self._send_requests()
        state = self._state() if self.phase is Phase.SENDING else None
        if state is not None and state["sent_all"]:
            for peer in range(self.world):
                if peer != self.rank:
                    self.queue(
                        (STREAM, peer), Outgoing(Kind.MCAST_END, self.seq, 0, self.described, peer)
                    )
            if self.chain_next is not None:
                self.queue(
                    (STREAM, self.chain_next),
                    Outgoing(Kind.ACTIVATE, self.seq, 0, b"", self.chain_next),
                )
            self.enter(Phase.RECEIVING)
        self._progress(now)

    def _to_plane(self, run: Run, now: float) -> None:
        self.plane.receive_run(*run.as_plane_args(), now)

    def _on_repair_request(self, hdr, payload, now: float) -> None:
        try:
            ranges = unpack_ranges(payload[Descriptor.SIZE :])  # the session checked the rest
        except MalformedError as err:
            self.reject("malformed", str(err))
        have = [
            self.plane.gather_have(self.seq, first, count) if self.posted else -1
            for first, count in ranges
        ]
        for (first, count), here in zip(ranges, have):
            if here < 0:
                self.reject(
                    "out_of_range", f"chunk range {first}+{count} is not within one segment"
                )
        for (first, count), here in zip(ranges, have):
            if here:
                self._serve(first, count)
            else:  # served once this rank's own repair has filled the range
                self.deferred.append((first, count))
                self.stats["repair_deferrals"] += 1

    def _on_activate(self, hdr, payload, now: float) -> None:
        self.progress += 1
        self.enter(Phase.SENDING)
        self.plane.gather_activate(self.seq, now)
        self.native_news(now)

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
        state = self._state()
        missing = state["missing"] if state else [0] * len(self.segments)
        gaps = {self.segments[s][0]: m for s, m in enumerate(missing) if m}
        parts = []
        if gaps:
            parts.append(
                "chunks from "
                + ", ".join(f"rank {r} ({m} of {self.k} missing)" for r, m in gaps.items())
            )
        if self.phase is Phase.WAITING:
            parts.append(f"activation by rank {self.chain_prev}")
        elif self.phase is Phase.SENDING:
            parts.append("its own multicast to finish")
        if not self.fin_from_predecessor:
            parts.append(f"the FIN of rank {self.predecessor}")
        if len(self.ended) < len(self.other_roots):
            parts.append(
                f"{len(self.other_roots) - len(self.ended)} roots' end-of-multicast notices"
            )
        return "; ".join(parts) or "its sends to drain"

    def state_bytes(self) -> int:
        state = self._state()
        return state["bytes"] if state else 0

    def finished(self) -> None:
        if self.posted:
            self.plane.release(self.seq)
            self.posted = False

    # -- repair ----------------------------------------------------------------------------
    def _on_repair(self, hdr, payload, now: float) -> None:
        if not payload:
            self.reject("wrong_length", f"repair of chunk {hdr.chunk} carries nothing")
        why, fresh = (
            self.plane.gather_store(self.seq, hdr.chunk, payload, now) if self.posted else (1, 0)
        )
        if why:
            self.reject(
                MISFITS[why],
                f"repair of chunks from {hdr.chunk} carrying "
                f"{len(payload)} bytes does not fit chunks of "
                f"{self.chunk_bytes} within one segment",
            )
        self.progress += fresh
        self.stats["repaired_chunks"] += fresh
        self.stats["repair_bytes"] += len(payload)

    def _send_requests(self) -> None:
        """Ask the successor for the ranges the plane has marked requested."""
        ranges = self.plane.gather_requests(self.seq)
        for i in range(0, len(ranges), _RANGES_PER_REQUEST):
            body = self.described + pack_ranges(ranges[i : i + _RANGES_PER_REQUEST])
            self.queue(
                (STREAM, self.successor),
                Outgoing(Kind.REPAIR_REQUEST, self.seq, 0, body, self.successor),
            )
        self.stats["repair_requests"] += len(ranges)

    def _serve_deferred(self) -> None:
        still = []
        for first, count in self.deferred:
            if self.plane.gather_have(self.seq, first, count) == 1:
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
            self.queue(
                (STREAM, self.predecessor),
                Outgoing(Kind.REPAIR_DATA, self.seq, gid, self.bytes[start:end], self.predecessor),
            )
            self.stats["repair_bytes_served"] += end - start

    def _progress(self, now: float) -> None:
        if self.deferred:
            self._serve_deferred()
        if self.posted and not self.streams_ended and len(self.ended) == len(self.other_roots):
            self.streams_ended = self.plane.gather_streams_ended(self.seq)  # once its own is sent
        state = self._state()
        complete = state is None or state["complete"]
        # a root's FIN follows its own MCAST_END, which tells its call before anything else
        ended = self.phase not in (Phase.WAITING, Phase.SENDING)
        if complete and ended and not self.sent_fin and self.world > 1:
            self.sent_fin = True
            self.queue(
                (STREAM, self.successor), Outgoing(Kind.FIN, self.seq, 0, b"", self.successor)
            )
        if (
            complete
            and self.fin_from_predecessor
            and self.phase is Phase.RECEIVING
            and len(self.ended) == len(self.other_roots)
        ):
            if state is not None:
                self.stats.update(
                    multicast_chunks=state["multicast_chunks"],
                    duplicate_chunks=state["duplicate_chunks"],
                )
            self.enter(Phase.DRAINING)
        self._check_done()
