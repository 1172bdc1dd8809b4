"""A run: authentic messages that one sender sealed back to back and one read delivered
together, so that a receiver can check them once and move their payloads in one numpy call.

Every message of a run has the same kind, job, communicator, collective, sender and destination,
a payload of the same length, and a higher chunk number than the one before it; their payloads
lie in one buffer at a fixed stride (a GRO read cuts every datagram but the last at the same
size). Each message was authenticated and replay-checked on its own before it joined the run.
A single message is a run of one.
"""

from __future__ import annotations

import numpy as np

from overcast.wire.header import Header


class Run:
    __slots__ = ("hdr", "chunks", "data", "offset", "stride", "length")

    def __init__(self, hdr: Header, chunks: list[int], data: memoryview, offset: int, stride: int):
        self.hdr = hdr  # the first message's: kind, collective, sender and destination of all
        self.chunks = chunks  # each message's chunk, rising
        self.data = data  # bytes holding every payload; valid during delivery only
        self.offset, self.stride = offset, stride  # the first payload's, and between payloads
        self.length = hdr.length

    @classmethod
    def one(cls, hdr: Header, payload) -> Run:
        return cls(hdr, [hdr.chunk], memoryview(payload).cast("B"), 0, hdr.length)

    def __len__(self) -> int:
        return len(self.chunks)

    def payload(self, i: int) -> memoryview:
        start = self.offset + i * self.stride
        return self.data[start : start + self.length]

    def rows(self, skip: int = 0) -> np.ndarray:
        """The payloads as rows of a (messages, length - skip) uint8 array, each row's first
        `skip` bytes left out: a view, no copy."""
        return np.ndarray(
            (len(self.chunks), self.length - skip),
            np.uint8,
            self.data,
            self.offset + skip,
            (self.stride, 1),
        )

    def as_plane_args(self) -> tuple[int, int, int, int, int, list[int], memoryview, int, int]:
        """The run as the native plane's and aggregator's receive_run take it, but for the
        clock: kind, seq, src, dst, length, chunks, data, offset, stride."""
        hdr = self.hdr
        return (
            hdr.kind,
            hdr.seq,
            hdr.src,
            hdr.dst,
            self.length,
            self.chunks,
            self.data,
            self.offset,
            self.stride,
        )

    def messages(self):
        """(header, payload) of each message, for handlers that take one at a time. A header is
        the first's with the message's own chunk: the counters were spent on the replay check
        and are not kept."""
        hdr = self.hdr
        return (
            (hdr if g == hdr.chunk else hdr._replace(chunk=g), self.payload(i))
            for i, g in enumerate(self.chunks)
        )
