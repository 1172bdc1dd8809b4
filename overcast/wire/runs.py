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
    __slots__ = ("headers", "data", "offset", "stride", "length")

    def __init__(self, headers: list[Header], data: memoryview, offset: int, stride: int):
        self.headers = headers
        self.data = data  # bytes holding every payload; valid during delivery only
        self.offset, self.stride = offset, stride  # the first payload's, and between payloads
        self.length = headers[0].length

    @classmethod
    def one(cls, hdr: Header, payload) -> "Run":
        return cls([hdr], memoryview(payload).cast("B"), 0, hdr.length)

    @property
    def hdr(self) -> Header:
        """The first message's header: kind, collective, sender and destination of them all."""
        return self.headers[0]

    def __len__(self) -> int:
        return len(self.headers)

    def payload(self, i: int) -> memoryview:
        start = self.offset + i * self.stride
        return self.data[start:start + self.length]

    def rows(self, skip: int = 0) -> np.ndarray:
        """The payloads as rows of a (messages, length - skip) uint8 array, each row's first
        `skip` bytes left out: a view, no copy."""
        return np.ndarray((len(self.headers), self.length - skip), np.uint8, self.data,
                          self.offset + skip, (self.stride, 1))

    def messages(self):
        """(header, payload) of each message, for handlers that take one at a time."""
        return ((hdr, self.payload(i)) for i, hdr in enumerate(self.headers))
