"""The unreliable channel: UDP datagrams, unicast and multicast, one sealed message each.

Datagrams never exceed the path MTU (IP_PMTUDISC_DO makes an oversized send fail rather than
fragment). Injected loss, when configured, drops received datagrams before anything else looks
at them, as a lossy link would.

Batches, where the kernel offers them: a sender lays several datagrams back to back and sends
them in one call (UDP GSO: the kernel, or the NIC, cuts them apart); a receiver reads what the
kernel coalesced in one call (UDP GRO) and cuts it at the segment size the kernel reports. Each
datagram keeps its own header and tag, so loss, authentication and repair stay per datagram. A
device that refuses GSO turns it off for that socket, and the batch goes out one by one. What
one read brings is authenticated datagram by datagram, then handed on in runs (wire.runs): a
receiver checks a run once and moves its payloads in one numpy call.
"""

from __future__ import annotations

import collections
import errno
import socket
import struct

from overcast.transport.loss import LossModel
from overcast.wire.auth import Opener, open_datagrams

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
# linux/udp.h; Python 3.11 has no names for them.
SOL_UDP, UDP_SEGMENT, UDP_GRO = 17, 103, 104
# What one GSO send may carry: 64 segments (UDP_MAX_SEGMENTS) in one UDP payload.
GSO_MAX_SEGMENTS, GSO_MAX_BYTES = 64, MAX_DATAGRAM
# A paced sender releases a batch of datagrams per wake-up, sent in as few calls as GSO allows
# and read in as few as GRO coalesces: as many as its link carries in BATCH_SECONDS, so that the
# CPU a wake-up costs is paid per time on the link, not per datagram, whatever the link's rate.
# Never fewer than MIN_BATCH: one GSO send of jumbo datagrams, which a receiver reads in one.
# Measured at 100 Mbit/s on 8 hosts, multicast batches of 7 instead of 4 cost ranks 6-15% less
# CPU, with nothing lost in the switch ports' queues.
BATCH_SECONDS = 0.0025
MIN_BATCH, MAX_BATCH = 7, 64
# In-network contributions go to the aggregator, not into a switch port's queue beside P-1 other
# senders' multicast, so they go in larger batches: as many as the link carries in
# REDUCTION_BATCH_SECONDS, up to two whole sends (the results of a batch go to one owner
# together, through its port). Measured at 100 Mbit/s, a batch of 14 cost ranks 15% less CPU
# and the aggregator 25% less than one of 4; 28 did no better.
REDUCTION_BATCH_SECONDS = 0.01
# A GRO read holds at most one IP packet's worth.
GRO_READ_BYTES = 1 << 16
_SEGMENT = struct.Struct("=H")
_GRO_ANCILLARY = socket.CMSG_SPACE(4)
_MSG_TRUNC = int(socket.MSG_TRUNC)  # a plain int: an enum's & costs microseconds per read
# errnos a GSO send fails with when the kernel or device will not segment it (EMSGSIZE: a
# segment over the device's MTU; sent one by one, a datagram then says for itself what is wrong)
_NO_GSO = {errno.EIO, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EMSGSIZE}


def pace_batch(bytes_per_s: float | None, datagram_bytes: int,
               seconds: float = BATCH_SECONDS) -> int:
    """Datagrams of `datagram_bytes` on the link per paced batch at `bytes_per_s`: what the
    link carries in `seconds`, in whole sends (GSO takes up to 64 KiB per send) once that is
    more than one send."""
    if not bytes_per_s:
        return MIN_BATCH
    batch = bytes_per_s * seconds / datagram_bytes
    per_send = _per_send(datagram_bytes)
    if batch < per_send:
        return max(MIN_BATCH, round(batch))
    return min(round(batch / per_send), MAX_BATCH // per_send) * per_send


def reduction_batch(bytes_per_s: float | None, datagram_bytes: int) -> int:
    """Datagrams per batch of in-network contributions: never fewer than `pace_batch` gives,
    else what the link carries in REDUCTION_BATCH_SECONDS, up to two whole sends."""
    return max(pace_batch(bytes_per_s, datagram_bytes),
               min(pace_batch(bytes_per_s, datagram_bytes, REDUCTION_BATCH_SECONDS),
                   2 * _per_send(datagram_bytes)))


def _per_send(datagram_bytes: int) -> int:
    return max(1, GSO_MAX_BYTES // datagram_bytes)


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


def enable_gro(sock: socket.socket) -> bool:
    """Ask the kernel to hand over coalesced datagrams; False where it cannot."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


def seal_batches(sealer, messages, buf: bytearray):
    """Seal `messages` (each with kind, seq, dst, chunk, payload) back to back into `buf` (room
    for two of the largest sends), and yield each run of equal-sized datagrams (the last may be
    shorter) as (view, size): one send of as many as GSO takes. Each message is sealed once, in
    place; a view is valid until the next is asked for. Every run starts at the buffer's
    start: the message that begins the next one is moved there once this one is sent."""
    view = memoryview(buf)
    end = size = 0
    for msg in messages:
        sealed = sealer.seal_into(buf, end, msg.kind, msg.seq, msg.dst, msg.chunk, msg.payload)
        length = sealed - end
        if end and (length > size or end % size or sealed > GSO_MAX_BYTES or
                    end // size >= GSO_MAX_SEGMENTS):
            yield view[:end], size
            view[:length] = view[end:sealed] if length <= end else bytes(view[end:sealed])
            end = 0
        if not end:
            size = length
        end += length
    if end:
        yield view[:end], size


class UdpPort:
    """One UDP socket's batches, and their counts: reads what the kernel coalesced (GRO) and
    cuts it at the segment size it reports; sends a run of datagrams in one call (GSO), one by
    one where the kernel or device will not segment it. A read the buffer cuts short counts in
    `drops` as truncated: lost, as on a link."""

    def __init__(self, sock: socket.socket, drops, read_bytes: int = GRO_READ_BYTES):
        sock.setblocking(False)
        self.sock, self.drops = sock, drops
        self.gro = enable_gro(sock)
        self.gso = True  # until the kernel refuses it
        self._buf = bytearray(read_bytes)
        self.seal_buffer = bytearray(2 * GSO_MAX_BYTES)  # for seal_batches
        self.datagrams_in = self.datagrams_out = self.bytes_in = self.bytes_out = 0
        self.reads = self.sends = self.truncated = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self, choose, on_run, lose=None, reads: int = _READS_PER_EVENT) -> None:
        """Read up to `reads` times; open the datagrams of each read (wire.auth.open_datagrams,
        with `choose` and `lose`) and call on_run(run) for each run of authentic ones. A run is
        valid during the call only."""
        sock, buf, gro = self.sock, self._buf, self.gro
        view = memoryview(buf)
        for _ in range(reads):
            try:
                if gro:
                    n, ancillary, flags, _ = sock.recvmsg_into([buf], _GRO_ANCILLARY)
                else:
                    n, ancillary, flags = sock.recv_into(buf), (), 0
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # an ICMP error for an earlier send: nothing to act on here
            self.reads += 1
            size = n
            for level, kind, data in ancillary:
                if level == SOL_UDP and kind == UDP_GRO:
                    size = int.from_bytes(data[:4], "little")
            if flags & _MSG_TRUNC:  # the segment the buffer cut; any after it never came
                self.truncated += 1
                self.drops["truncated"] += 1
                n -= n % size if size < n else n
            if n:
                self.datagrams_in += -(-n // size)
                self.bytes_in += n
                for run in open_datagrams(view[:n], size, choose, self.drops, lose):
                    on_run(run)

    def send_some(self, view: memoryview, size: int, address: tuple[str, int]) -> int:
        """Send the datagrams laid back to back in `view` (each `size` bytes but the last)
        until the socket is full; return how many bytes went."""
        sent = 0
        if len(view) > size and self.gso:
            self.sends += 1
            try:
                sent = self.sock.sendmsg([view], [(SOL_UDP, UDP_SEGMENT, _SEGMENT.pack(size))],
                                         0, address)
            except BlockingIOError:
                return 0
            except OSError as err:
                if err.errno not in _NO_GSO:
                    raise OSError(f"cannot send {len(view)} bytes of datagrams to {address}: "
                                  f"{err.strerror}") from None
                self.gso = False  # one by one from now on
            else:
                self._count(sent, size)
                return sent
        while sent < len(view):
            datagram = view[sent:sent + size]
            self.sends += 1
            try:
                n = self.sock.sendto(datagram, address)
            except BlockingIOError:
                break
            except OSError as err:
                raise OSError(f"cannot send a {len(datagram)}-byte datagram to {address}: "
                              f"{err.strerror}") from None
            self._count(n, size)
            sent += n
        return sent

    def _count(self, nbytes: int, size: int) -> None:
        self.datagrams_out += -(-nbytes // size)
        self.bytes_out += nbytes

    def close(self) -> None:
        self.sock.close()


def prepare_sender(sock: socket.socket, local: str, loop: bool) -> None:
    """Send multicast out of `local`'s interface, one hop, and never fragment."""
    sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(local))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, struct.pack("b", 1))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, int(loop))


class Datagrams(UdpPort):
    """A rank's UDP socket: reads authentic datagrams from other ranks, and queues what the
    socket could not take yet."""

    def __init__(self, sock: socket.socket, opener: Opener, own_rank: int, windows: dict,
                 loss: LossModel | None = None, read_bytes: int = GRO_READ_BYTES):
        super().__init__(sock, opener.drops, read_bytes)
        enlarge_receive_buffer(sock)
        self._choose = opener.chooser(windows, WINDOW, exclude=own_rank)
        self.loss = loss
        self._lost = None if loss is None else self._lose  # open_datagrams' `lose`
        self._out: collections.deque[tuple[bytes, int, tuple[str, int]]] = collections.deque()
        self.injected_losses = 0

    def buffer_bytes(self) -> int:
        """User-space bytes held: the read buffer and datagrams queued to send."""
        return len(self._buf) + sum(len(d) for d, _, _ in self._out.copy())

    @property
    def queued(self) -> int:
        return len(self._out)

    def read(self, on_run) -> None:
        """Take the datagrams waiting; call on_run(run) for each run (see wire.runs) of
        authentic ones from other ranks. A run is valid during the call only."""
        self.receive(self._choose, on_run, self._lost)

    def _lose(self) -> bool:
        if self.loss.drop():
            self.injected_losses += 1
            return True
        return False

    def send(self, data, address: tuple[str, int], size: int | None = None) -> None:
        """Send one datagram, or a batch of them laid back to back, each `size` bytes but the
        last; now, or queued behind what the socket could not take yet."""
        size = size or len(data)
        sent = 0 if self._out else self.send_some(memoryview(data), size, address)
        if sent < len(data):
            self._out.append((bytes(memoryview(data)[sent:]), size, address))

    def flush(self) -> None:
        """Send what is queued until the socket is full."""
        while self._out:
            data, size, address = self._out[0]
            sent = self.send_some(memoryview(data), size, address)
            if sent < len(data):
                if sent:
                    self._out[0] = (data[sent:], size, address)
                return
            self._out.popleft()

    def clear(self) -> None:
        self._out.clear()
