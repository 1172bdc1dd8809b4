"""all_to_all as a pairwise exchange: each rank sends each peer the block meant for it on their
stream, and receives each peer's block for it on the peer's.

Every rank's DESCRIBE of the call carries its split sizes (what it sends each rank and what it
expects from each, in rows) to every peer, so that every rank knows the whole matrix one hop
after the call, and sizes that do not fit fail the call on every rank with the same
InvalidArgumentError, naming the rank (`sizes_error`), whatever moved meanwhile; the
communicator goes on. Every rank sends
and receives only what the sizes say: N(P-1)/P bytes each way for N bytes per rank split evenly,
against the (P-1)N of an AllGather of every rank's input.

The receiver paces it: a sender sends a block only when its receiver PULLs it, which a receiver
does once the sender's sizes have come and agree with its own. A rank pulls from its peers in
the order r-1, r-2, ... (mod P), keeping PULL_AHEAD bytes pulled and not yet arrived, so that
its downlink is fed by one or two senders at a time and never runs dry between them; at step k
rank s is pulled by s+k, so every uplink too carries one or two blocks at a time. Were every
rank to send every block at once, P-1 TCP flows would start together toward each receiver and
overflow its switch port's queue (an incast): the losses and retransmissions cost more than the
link time. Blocks are cut into frames of `frame_bytes` (512 KiB) that a receiver puts in place
as they come.
"""

from __future__ import annotations

import itertools
from typing import cast

import numpy as np

from overcast.errors import InvalidArgumentError
from overcast.protocols.base import STREAM, Accept, Collective, Descriptor, Outgoing, Phase
from overcast.schedules.ring import frames
from overcast.wire.header import Kind

# Bytes a rank keeps pulled and not yet arrived: two of 4 MiB's blocks over 8 ranks, and time
# enough at the links' rates for a PULL to reach the next sender before the downlink idles.
PULL_AHEAD = 1 << 20


def offsets(sizes: list[int]) -> list[int]:
    """Where each block starts, blocks of `sizes` laid end to end."""
    return list(itertools.accumulate(sizes, initial=0))[:-1]


def sizes_error(sizes: list[list[int] | None], rank: int, here: str) -> str | None:
    """Why every rank's split sizes (sizes[r]: rows rank r sends each rank, then rows it expects
    from each; None: its own do not fit its buffers) cannot run, the same words on every rank
    but for `here` (this rank's own sizes, said of it alone); None if they can."""
    world = len(sizes)
    for src, vector in enumerate(sizes):
        if vector is None:
            return (
                f"all_to_all: rank {src}'s split sizes do not divide its input and output "
                f"rows among {world} ranks" + (f" (here: {here})" if src == rank else "")
            )
    vectors = cast(list[list[int]], sizes)  # none is None past the check above
    for src in range(world):
        for dst in range(world):
            sent, expected = vectors[src][dst], vectors[dst][world + src]
            if sent != expected:
                return (
                    f"all_to_all: rank {src} sends {sent} rows to rank {dst}, whose output "
                    f"split sizes expect {expected}"
                )
    return None


class PairwiseAllToAll(Collective):
    """`sizes` this rank's split sizes (rows it sends each rank, then rows it expects from
    each; None if they do not fit its buffers, `here` saying what they are), rows of
    `row_bytes`; blocks lie in rank order in `input` and `output`. The rank's own block is
    copied across."""

    # Each peer's DESCRIBE, with its sizes, leads its stream, before any pull or frame.
    verify_every_peer = True
    ACCEPTS = {
        Kind.A2A_PULL: Accept("_on_pull", "peers", frozenset((Phase.RECEIVING,))),
        Kind.A2A_DATA: Accept("_on_data", "peers", frozenset((Phase.RECEIVING,))),
    }

    def __init__(
        self,
        seq: int,
        rank: int,
        world: int,
        desc: Descriptor,
        output: np.ndarray,
        input: np.ndarray,
        sizes: list[int] | None,
        here: str,
        row_bytes: int,
        frame_bytes: int,
    ):
        super().__init__(seq, rank, world, desc)
        self.output, self.input = output.view(np.uint8), input.view(np.uint8)
        self.here, self.frame_bytes = here, frame_bytes
        self.sizes: list[list[int] | None] = [None] * world
        self.sizes[rank] = sizes
        self.heard = {rank}  # whose sizes are in
        self.peers = frozenset(range(world)) - {rank}
        vector = sizes or [0] * (2 * world)
        self.send_bytes = [n * row_bytes for n in vector[:world]]
        self.recv_bytes = [n * row_bytes for n in vector[world:]]
        self.sent_at, self.got_at = offsets(self.send_bytes), offsets(self.recv_bytes)
        self.layouts = [frames(n, frame_bytes, 1) if n else [] for n in self.recv_bytes]
        order = [(rank - k) % world for k in range(1, world)]
        self.to_pull = [p for p in order if self.recv_bytes[p]]  # in pulling order
        self.unpulled = {p for p in order if self.send_bytes[p]}  # peers yet to pull
        self.arrived = [0] * world
        self.outstanding = 0  # bytes pulled, not yet arrived
        self.expected = sum(len(self.layouts[p]) for p in self.peers)
        self.received = 0
        # the DESCRIBE goes by the session, whatever befalls the call here: every peer needs
        # these sizes to find the call good or bad
        self.described += np.array(sizes or [-1] * (2 * world), "<i8").tobytes()

    def start(self, now: float) -> None:
        mine, sent_at, got_at = self.send_bytes[self.rank], self.sent_at, self.got_at
        self.output[got_at[self.rank] : got_at[self.rank] + mine] = self.input[
            sent_at[self.rank] : sent_at[self.rank] + mine
        ]
        self.enter(Phase.RECEIVING)
        self._settle()

    def described_by(self, peer: int, extra: memoryview, now: float) -> None:
        """A peer's DESCRIBE matched; what follows its descriptor is its split sizes. Once
        every rank's are in, every rank finds them good or bad alike."""
        if peer in self.heard:
            self.reject("duplicate", f"rank {peer} described the call twice")
        if len(extra) != 16 * self.world:
            self.reject(
                "malformed",
                f"rank {peer}'s split sizes are {len(extra)} bytes, not {16 * self.world}",
            )
        vector = np.frombuffer(extra, "<i8").tolist()
        self.sizes[peer] = None if min(vector) < 0 else vector
        self.heard.add(peer)
        self.progress += 1
        if len(self.heard) == self.world and (why := sizes_error(self.sizes, self.rank, self.here)):
            self.fail(InvalidArgumentError(why))
            return
        self._pull()
        self._settle()

    def _agrees(self, peer: int) -> bool:
        """Whether `peer`'s sizes are in and say it sends this rank what this rank expects."""
        mine, theirs = self.sizes[self.rank], self.sizes[peer]
        return (
            mine is not None and theirs is not None and theirs[self.rank] == mine[self.world + peer]
        )

    def _pull(self) -> None:
        while self.to_pull and self.outstanding < PULL_AHEAD and self._agrees(self.to_pull[0]):
            peer = self.to_pull.pop(0)
            self.outstanding += self.recv_bytes[peer]
            self.queue((STREAM, peer), Outgoing(Kind.A2A_PULL, self.seq, 0, b"", peer))

    def _on_pull(self, hdr, payload, now: float) -> None:
        peer = hdr.src
        if peer not in self.unpulled:
            self.reject(
                "out_of_range",
                f"rank {peer} pulled a block this rank does not send it, or pulled it twice",
            )
        self.unpulled.discard(peer)
        self.progress += 1
        n, at = self.send_bytes[peer], self.sent_at[peer]
        self.queue_all(
            (STREAM, peer),
            (
                Outgoing(Kind.A2A_DATA, self.seq, j, self.input[at + off : at + off + length], peer)
                for j, (off, length) in enumerate(frames(n, self.frame_bytes, 1))
            ),
        )
        self._settle()

    def _on_data(self, hdr, payload: memoryview, now: float) -> None:
        src, j = hdr.src, hdr.chunk
        if j != self.arrived[src] or j >= len(self.layouts[src]):
            self.reject(
                "out_of_range",
                f"frame {j} from rank {src}; frame "
                f"{self.arrived[src]} of {len(self.layouts[src])} next",
            )
        off, length = self.layouts[src][j]
        if len(payload) != length:
            self.reject(
                "wrong_length",
                f"frame {j} from rank {src} has {len(payload)} bytes, expected {length}",
            )
        at = self.got_at[src] + off
        self.output[at : at + length] = np.frombuffer(payload, np.uint8)
        self.arrived[src] += 1
        self.received += 1
        self.outstanding -= length
        self.progress += 1
        self._pull()
        self._settle()

    def _settle(self) -> None:
        """Every rank's sizes in, every block in place and every peer's block on its way: only
        the outbox is left."""
        if len(self.heard) == self.world and self.received == self.expected and not self.unpulled:
            self.enter(Phase.DRAINING)
        self._check_done()

    def waiting_for(self) -> str:
        short = [f"the split sizes of rank {p}" for p in sorted(self.peers - self.heard)]
        short += [
            f"frames from rank {p}: {self.arrived[p]} of {len(self.layouts[p])}"
            for p in sorted(self.peers)
            if self.arrived[p] < len(self.layouts[p])
        ]
        short += [f"rank {p} to pull its block" for p in sorted(self.unpulled)]
        return ", ".join(short)
