"""all_to_all as a pairwise exchange: each rank sends each peer the block meant for it on their
stream, and receives each peer's block for it on the peer's, all at once.

Every rank sends and receives only what the split sizes say (the Communicator gathers every
rank's sizes first and checks they agree, so each rank knows what each peer sends it): N(P-1)/P
bytes each way for N bytes per rank split evenly, against the (P-1)N of an AllGather of every
rank's input. Blocks are cut into frames of `frame_bytes` (512 KiB) that a receiver puts in place
as they come; every link carries one rank's blocks to its peers at once, each a stream of its
own, so a host's uplink and downlink are both full until its largest block is through.
"""

from __future__ import annotations

import itertools

import numpy as np

from overcast.protocols.base import STREAM, Accept, Collective, Descriptor, Outgoing, Phase
from overcast.schedules.ring import frames
from overcast.wire.header import Kind


def offsets(sizes: list[int]) -> list[int]:
    """Where each block starts, blocks of `sizes` laid end to end."""
    return list(itertools.accumulate(sizes, initial=0))[:-1]


class PairwiseAllToAll(Collective):
    """`send_bytes[p]` bytes of `input` (blocks in rank order) go to rank p, `recv_bytes[p]`
    bytes of `output` (likewise) come from it; the rank's own block is copied across."""

    # Each peer's DESCRIBE leads its stream, before any of its frames; a peer that sends this
    # rank nothing is heard from by its DESCRIBE alone.
    verify_every_peer = True
    ACCEPTS = {Kind.A2A_DATA: Accept("_on_data", "senders", frozenset((Phase.RECEIVING,)))}

    def __init__(self, seq: int, rank: int, world: int, desc: Descriptor, output: np.ndarray,
                 input: np.ndarray, send_bytes: list[int], recv_bytes: list[int],
                 frame_bytes: int):
        super().__init__(seq, rank, world, desc)
        self.output, self.input = output.view(np.uint8), input.view(np.uint8)
        self.send_bytes, self.recv_bytes = send_bytes, recv_bytes
        self.sent_at, self.got_at = offsets(send_bytes), offsets(recv_bytes)
        self.frame_bytes = frame_bytes
        self.layouts = [frames(n, frame_bytes, 1) if n else [] for n in recv_bytes]
        self.senders = frozenset(p for p in range(world) if p != rank and recv_bytes[p])
        self.arrived = [0] * world
        self.expected = sum(len(self.layouts[p]) for p in self.senders)
        self.received = 0

    def start(self, now: float) -> None:
        mine, sent_at, got_at = self.send_bytes[self.rank], self.sent_at, self.got_at
        self.output[got_at[self.rank]:got_at[self.rank] + mine] = \
            self.input[sent_at[self.rank]:sent_at[self.rank] + mine]
        self.enter(Phase.RECEIVING if self.expected else Phase.DRAINING)
        for step in range(1, self.world):  # the next rank first: destinations spread at once
            peer = (self.rank + step) % self.world
            n, at = self.send_bytes[peer], sent_at[peer]
            if n:
                self.queue_all((STREAM, peer), (
                    Outgoing(Kind.A2A_DATA, self.seq, j, self.input[at + off:at + off + length],
                             peer) for j, (off, length) in enumerate(frames(n, self.frame_bytes,
                                                                            1))))
        self._check_done()

    def _on_data(self, hdr, payload: memoryview, now: float) -> None:
        src, j = hdr.src, hdr.chunk
        if j != self.arrived[src] or j >= len(self.layouts[src]):
            self.reject("out_of_range", f"frame {j} from rank {src}; frame "
                                        f"{self.arrived[src]} of {len(self.layouts[src])} next")
        off, length = self.layouts[src][j]
        if len(payload) != length:
            self.reject("wrong_length", f"frame {j} from rank {src} has {len(payload)} bytes, "
                                        f"expected {length}")
        at = self.got_at[src] + off
        self.output[at:at + length] = np.frombuffer(payload, np.uint8)
        self.arrived[src] += 1
        self.received += 1
        self.progress += 1
        if self.received == self.expected:
            self.enter(Phase.DRAINING)
        self._check_done()

    def awaits_stream(self, peer: int) -> bool:
        return peer in self.senders and self.arrived[peer] < len(self.layouts[peer])

    def waiting_for(self) -> str:
        short = [f"rank {p}: {self.arrived[p]} of {len(self.layouts[p])}"
                 for p in sorted(self.senders) if self.arrived[p] < len(self.layouts[p])]
        return "frames from " + ", ".join(short)
