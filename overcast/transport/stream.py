"""A reliable, ordered channel to one peer rank: a TCP connection carrying sealed frames.

Non-blocking both ways; the engine calls `read` when the socket is readable and `flush` when it
is writable. Frames are authenticated one by one and must carry strictly increasing counters.
"""

from __future__ import annotations

import collections
import itertools
import socket

from overcast.wire.auth import Opener
from overcast.wire.header import MalformedError, unpack_header

_READ_BYTES = 1 << 21
# The send buffer (the kernel doubles it): two ring frames' worth, so that the engine wakes
# about once per frame it writes, not three times. The price: a control message queued behind
# ring frames on the same connection waits for up to 2 MiB to leave (42 ms at 400 Mbit/s); the
# multicast and in-network collectives' connections carry only control messages.
SEND_BUFFER_BYTES = 1 << 20
_READS_PER_EVENT = 8
_IOV_MAX = 64
# The most the socket is asked to hold before it wakes the engine (SO_RCVLOWAT): one ring frame
# and its overhead. Without it every TCP segment that lands wakes the engine and runs this
# module's Python once; with it the engine wakes when the next whole frame is there.
_MAX_LOW_WATER = 1 << 20


class StreamClosed(Exception):
    """The peer closed the connection or it broke."""


class Stream:
    def __init__(self, sock: socket.socket, peer: int, opener: Opener):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self.sock, self.peer, self.opener = sock, peer, opener
        self._rbuf = bytearray(_READ_BYTES)
        self._filled = 0
        self._next_counter = 0  # the peer's counters rise strictly
        self._low_water = 1
        self._out: collections.deque[memoryview] = collections.deque()
        self._tags: collections.deque[int] = collections.deque()  # the caller's tag per part
        self.queued_bytes = 0
        self.bytes_in = self.bytes_out = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def buffer_bytes(self) -> int:
        """User-space bytes held: the read buffer and frames queued to send."""
        return len(self._rbuf) + self.queued_bytes

    # -- reading ---------------------------------------------------------------------------
    def read(self, on_message) -> None:
        """Read what is available and call on_message(header, payload) per authentic frame.

        The payload view is only valid during the call. Raises StreamClosed at EOF.
        """
        for _ in range(_READS_PER_EVENT):
            view = memoryview(self._rbuf)
            try:
                n = self.sock.recv_into(view[self._filled :])
            except BlockingIOError:
                return
            except OSError as err:
                raise StreamClosed(str(err)) from None
            if n == 0:
                raise StreamClosed("connection closed by peer")
            self.bytes_in += n
            self._filled += n
            self._parse(view, on_message)
            if self._filled < len(self._rbuf) // 2:
                return

    def _parse(self, view: memoryview, on_message) -> None:
        frames, pos, missing, fault, self._next_counter = self.opener.open_stream(
            view, self._filled, self.peer, self._next_counter
        )
        for hdr, offset in frames:
            on_message(hdr, view[offset : offset + hdr.length])
        if fault is not None:
            raise StreamClosed(self._fault(view[pos : self._filled]))
        rest = self._filled - pos
        self._wake_at(missing)
        if pos or rest == len(self._rbuf):
            if rest == len(self._rbuf):  # one frame does not fit: a larger buffer
                grown = bytearray(2 * rest)
                grown[:rest] = view
                self._rbuf = grown
            elif rest:  # the partial frame to the front (memoryview copies overlaps safely)
                view[:rest] = view[pos : self._filled]
            self._filled = rest

    def _fault(self, rest: memoryview) -> str:
        """Why the header at the front of `rest` ended the stream (the error path only)."""
        try:
            hdr = unpack_header(rest)
        except MalformedError as err:
            return f"corrupt stream from rank {self.peer}: {err}"
        # every rank holds the key: only the peer speaks here
        return f"rank {hdr.src} spoke on rank {self.peer}'s stream"

    def _wake_at(self, missing: int) -> None:
        """Have the socket report readable only once the `missing` bytes of the next frame
        (or of its header) are there; EOF and errors still wake at once."""
        low_water = max(1, min(missing, _MAX_LOW_WATER))
        if low_water != self._low_water:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low_water)
            self._low_water = low_water

    # -- writing ---------------------------------------------------------------------------
    def enqueue(self, parts, tag: int = 0) -> None:
        """Queue one frame, given as the buffers that make it up, in order. They are written
        from where they lie: each must stay unchanged while `holds(tag)`."""
        for part in parts:
            view = memoryview(part).cast("B")
            if view:
                self._out.append(view)
                self._tags.append(tag)
                self.queued_bytes += len(view)

    def holds(self, tag: int) -> bool:
        """Whether bytes of a frame queued with `tag` are still to be written."""
        return tag in self._tags

    def flush(self, on_written=None) -> None:
        """Write as much of the queue as the socket takes; call on_written(tag, nbytes) for the
        bytes of each frame as they go. Raises StreamClosed if the connection broke."""
        while self._out:
            try:
                n = self.sock.sendmsg(list(itertools.islice(self._out, _IOV_MAX)))
            except BlockingIOError:
                return
            except OSError as err:
                raise StreamClosed(str(err)) from None
            self.bytes_out += n
            self.queued_bytes -= n
            while n:
                head = self._out[0]
                done = min(len(head), n)
                if on_written is not None:
                    on_written(self._tags[0], done)
                if len(head) <= n:
                    self._out.popleft()
                    self._tags.popleft()
                else:
                    self._out[0] = head[n:]
                n -= done

    def finish(self) -> None:
        """Say no more: the peer reads EOF after what was written (a FIN, not a reset)."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:  # gone already
            pass

    def close(self) -> None:
        self.sock.close()
