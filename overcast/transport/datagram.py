"""The unreliable channel: one UDP socket per rank for unicast datagrams (and, joined to a
group, for multicast). Each datagram is one sealed message; nothing is ever fragmented by IP."""

from __future__ import annotations

import socket

from overcast.wire.auth import Opener

# The replay window per sender: datagrams may arrive out of order, but never this far.
WINDOW = 1 << 14
_MAX_DATAGRAM = 65536
_READS_PER_EVENT = 256
RECV_BUFFER_BYTES = 4 * 1024 * 1024


class Datagrams:
    def __init__(self, sock: socket.socket, opener: Opener):
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES)
        except OSError:
            pass
        self.sock, self.opener = sock, opener
        self._buf = bytearray(_MAX_DATAGRAM)
        self._windows: dict = {}
        self.datagrams_in = self.datagrams_out = 0
        self.bytes_in = self.bytes_out = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, on_message) -> None:
        """Take the datagrams waiting; call on_message(header, payload) for each authentic one."""
        view = memoryview(self._buf)
        for _ in range(_READS_PER_EVENT):
            try:
                n = self.sock.recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # ICMP errors surface here (a peer's port closed): not ours to act on.
                continue
            self.datagrams_in += 1
            self.bytes_in += n
            msg = self.opener.open(view[:n], windows=self._windows, window_width=WINDOW)
            if msg is not None:
                on_message(*msg)

    def send(self, datagram, address: tuple[str, int]) -> bool:
        """Send one datagram; False if the socket buffer is full (try again when writable)."""
        try:
            n = self.sock.sendto(datagram, address)
        except BlockingIOError:
            return False
        self.datagrams_out += 1
        self.bytes_out += n
        return True

    def close(self) -> None:
        self.sock.close()
