"""The unreliable channel: UDP datagrams, unicast and multicast, one sealed message each; the
sockets, their addresses and the batch sizes. What moves on them is native: the rank's datagram
plane (overcast/native/rank/plane.h, port.h) and the aggregator's (aggregator/service.h).

Datagrams never exceed the path MTU (IP_PMTUDISC_DO makes an oversized send fail rather than
fragment). Batches, where the kernel offers them: a sender lays several datagrams back to back
and sends them in one call (UDP GSO: the kernel, or the NIC, cuts them apart); a receiver reads
what the kernel coalesced in one call (UDP GRO). Each datagram keeps its own header and tag, so
loss, authentication and repair stay per datagram.
"""

from __future__ import annotations

import socket
import struct

from overcast.wire.header import IP_UDP_BYTES, OVERHEAD_BYTES

MAX_DATAGRAM = 65507
RECV_BUFFER_BYTES = 16 * 1024 * 1024
_SO_RCVBUFFORCE = 33
# What one jumbo datagram costs a socket's receive buffer (the kernel counts the whole buffer
# the packet sits in, not just its bytes).
DATAGRAM_TRUESIZE = 16 * 1024
_IP_MTU_DISCOVER, _IP_PMTUDISC_DO, _IP_MTU = 10, 2, 14
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


def chunk_bytes(mtu: int) -> int:
    """The payload of one datagram on a path of `mtu` bytes: within the MTU and UDP's limit,
    a multiple of 8 so that no element is split."""
    n = min(mtu - IP_UDP_BYTES, MAX_DATAGRAM) - OVERHEAD_BYTES
    return n - n % 8


def pace_batch(
    bytes_per_s: float | None, datagram_bytes: int, seconds: float = BATCH_SECONDS
) -> int:
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
    return max(
        pace_batch(bytes_per_s, datagram_bytes),
        min(
            pace_batch(bytes_per_s, datagram_bytes, REDUCTION_BATCH_SECONDS),
            2 * _per_send(datagram_bytes),
        ),
    )


def _per_send(datagram_bytes: int) -> int:
    """Datagrams in one GSO send: as many as its bytes hold, at most its segments."""
    return max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // datagram_bytes))


def path_mtu(local: str, peer: str) -> int:
    """The MTU of the path to `peer`, as the kernel knows it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((local, 0))
        s.connect((peer, 9))
        return s.getsockopt(socket.IPPROTO_IP, _IP_MTU)


def multicast_group(comm: int) -> tuple[str, int]:
    """The group and port of a communicator, in 239.192.0.0/14 (organisation-local scope)."""
    return (
        f"239.{192 + (comm >> 24) % 4}.{(comm >> 8) & 255}.{comm & 255}",
        20000 + (comm >> 16) % 20000,
    )


def open_multicast(local: str, group: str, port: int, loop: bool) -> socket.socket:
    """A socket that receives `group`:`port` on the interface of `local`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((group, port))
        sock.setsockopt(
            socket.IPPROTO_IP,
            socket.IP_ADD_MEMBERSHIP,
            socket.inet_aton(group) + socket.inet_aton(local),
        )
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
