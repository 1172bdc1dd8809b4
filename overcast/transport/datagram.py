"""The unreliable channel: UDP datagrams, unicast and multicast, one sealed message each.

Datagrams never exceed the path MTU (IP_PMTUDISC_DO makes an oversized send fail rather than
fragment). Injected loss, when configured, drops received datagrams before anything else looks
at them, as a lossy link would.
"""

from __future__ import annotations

import collections
import socket
import struct

from overcast.transport.loss import LossModel
from overcast.wire.auth import Opener

# The replay window per sender: datagrams may arrive out of order, but never this far.
WINDOW = 1 << 14
MAX_DATAGRAM = 65507
_READS_PER_EVENT = 256
RECV_BUFFER_BYTES = 16 * 1024 * 1024
_SO_RCVBUFFORCE = 33
# What one jumbo datagram costs a socket's receive buffer (the kernel counts the whole buffer
# the packet sits in, not just its bytes).
DATAGRAM_TRUESIZE = 16 * 1024
_IP_MTU_DISCOVER, _IP_PMTUDISC_DO, _IP_MTU = 10, 2, 14


def path_mtu(local: str, peer: str) -> int:
    """The MTU of the path to `peer`, as the kernel knows it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((local, 0))
        s.connect((peer, 9))
        return s.getsockopt(socket.IPPROTO_IP, _IP_MTU)


def multicast_group(comm: int) -> tuple[str, int]:
    """The group and port of a communicator, in 239.192.0.0/14 (organisation-local scope)."""
    return (f"239.{192 + (comm >> 24) % 4}.{(comm >> 8) & 255}.{comm & 255}",
            20000 + (comm >> 16) % 20000)


def open_multicast(local: str, group: str, port: int, loop: bool) -> socket.socket:
    """A socket that receives `group`:`port` on the interface of `local`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((group, port))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        socket.inet_aton(group) + socket.inet_aton(local))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, int(loop))
    except OSError:
        sock.close()
        raise
    return sock


def enlarge_receive_buffer(sock: socket.socket, nbytes: int = RECV_BUFFER_BYTES) -> int:
    """Ask for a deep receive buffer, past net.core.rmem_max where privileged (as the emulated
    cluster is): a burst must wait in the socket, not be dropped, while the process is off the
    CPU. Returns the bytes granted."""
    for option in (_SO_RCVBUFFORCE, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, nbytes)
            break
        except OSError:
            continue
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2  # the kernel doubles it


def prepare_sender(sock: socket.socket, local: str, loop: bool) -> None:
    """Send multicast out of `local`'s interface, one hop, and never fragment."""
    sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(local))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, struct.pack("b", 1))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, int(loop))


class Datagrams:
    """One UDP socket: reads authentic datagrams, queues sends the socket could not take."""

    def __init__(self, sock: socket.socket, opener: Opener, own_rank: int, windows: dict,
                 loss: LossModel | None = None):
        sock.setblocking(False)
        enlarge_receive_buffer(sock)
        self.sock, self.opener, self.own_rank = sock, opener, own_rank
        self._windows = windows
        self.loss = loss
        self._buf = bytearray(MAX_DATAGRAM + 1)
        self._out: collections.deque[tuple[bytes, tuple[str, int]]] = collections.deque()
        self.datagrams_in = self.datagrams_out = self.bytes_in = self.bytes_out = 0
        self.injected_losses = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def buffer_bytes(self) -> int:
        """User-space bytes held: the read buffer and datagrams queued to send."""
        return len(self._buf) + sum(len(d) for d, _ in self._out.copy())

    @property
    def queued(self) -> int:
        return len(self._out)

    def read(self, on_message) -> None:
        """Take the datagrams waiting; call on_message(header, payload) for each authentic one
        from another rank. The payload view is valid during the call only."""
        view = memoryview(self._buf)
        for _ in range(_READS_PER_EVENT):
            try:
                n = self.sock.recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # an ICMP error for an earlier send: nothing to act on here
            self.datagrams_in += 1
            self.bytes_in += n
            if self.loss is not None and self.loss.drop():
                self.injected_losses += 1
                continue
            msg = self.opener.open(view[:n], windows=self._windows, window_width=WINDOW)
            if msg is not None and msg[0].src != self.own_rank:
                on_message(*msg)

    def _sendto(self, datagram, address: tuple[str, int]) -> bool:
        try:
            n = self.sock.sendto(datagram, address)
        except BlockingIOError:
            return False
        except OSError as err:
            raise OSError(f"cannot send a {len(datagram)}-byte datagram to {address}: "
                          f"{err.strerror}") from None
        self.datagrams_out += 1
        self.bytes_out += n
        return True

    def send(self, datagram, address: tuple[str, int]) -> None:
        """Send now, or queue behind what the socket could not take yet."""
        if self._out or not self._sendto(datagram, address):
            self._out.append((datagram, address))

    def flush(self) -> None:
        """Send what is queued until the socket is full."""
        while self._out and self._sendto(*self._out[0]):
            self._out.popleft()

    def clear(self) -> None:
        self._out.clear()

    def close(self) -> None:
        self.sock.close()
