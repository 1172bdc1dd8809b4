"""Proof that multicast is delivered, made when a communicator is: every rank hears every other's.

A join that succeeds says nothing of the network: a cloud VPC, a routed hop (TTL 1), a switch
without IGMP snooping or querier, or a firewall carries unicast and drops the group's datagrams,
and every multicast chunk would then be repaired over the TCP chain, silently. So, once the
ranks have met and joined their group, each rank

1. multicasts a probe of the full datagram size (the agreed path MTU's) to the group every
   PROBE_INTERVAL_SECONDS, on a port of its own (the group's port shifted by half the range, so
   that no probe reaches a data socket), and listens for the others';
2. once it has heard every other rank, or PROBE_SECONDS after it began, tells every other over
   its stream whom it did not hear (REPORT), and goes on probing until every rank has
   reported, so that a rank still listening hears it.

Every rank then holds the same picture: for each rank, the ranks it did not hear. Probes and
reports are sealed under the communicator's key (HELLO messages); a probe that does not open is
ignored, counted apart from the communicator's drops. Nothing is left in the store.
"""

from __future__ import annotations

import selectors
import socket
import time

from overcast.transport.datagram import chunk_bytes, open_multicast
from overcast.transport.store import read_exact
from overcast.wire.auth import Drops, Opener, Sealer, frame_length
from overcast.wire.header import ANY, HEADER_BYTES, Kind

# How long a rank listens for the others' probes at most: a LAN delivers in well under a
# millisecond, and the ranks start within milliseconds of each other (each has just finished
# meeting all the others); this leaves room for a rank off the CPU.
PROBE_SECONDS = 2.0
PROBE_INTERVAL_SECONDS = 0.01
REPORT, PROBE = b"OCMR", b"OCMP"
PORTS_FROM, PORTS = 20000, 20000  # transport.datagram.multicast_group's range


def probe_port(port: int) -> int:
    """The port probes go to: the group's data port shifted by half the range, inside it."""
    return PORTS_FROM + (port - PORTS_FROM + PORTS // 2) % PORTS


def _bitmap(ranks: list[int], world: int) -> bytes:
    bits = bytearray(-(-world // 8))
    for r in ranks:
        bits[r // 8] |= 1 << (r % 8)
    return bytes(bits)


def _ranks(bitmap: bytes, world: int) -> list[int]:
    return [r for r in range(world) if bitmap[r // 8] >> (r % 8) & 1]


class _Words:
    """What the peers say over their streams during the probe, one frame at a time."""

    def __init__(self, streams: dict[int, socket.socket], opener: Opener, rank: int,
                 world: int):
        self.streams, self.opener, self.rank, self.world = streams, opener, rank, world

    def send(self, sealer: Sealer, payload: bytes) -> None:
        for peer, sock in self.streams.items():
            sock.sendall(sealer.seal(Kind.HELLO, 0, peer, 0, payload))

    def read(self, peer: int, magic: bytes, deadline: float) -> bytes:
        """The next frame of `peer`'s stream, which must be its word `magic`: its body."""
        sock = self.streams[peer]
        head = read_exact(sock, HEADER_BYTES, deadline)
        frame = head + read_exact(sock, frame_length(head) - HEADER_BYTES, deadline)
        opened = self.opener.open(frame)
        if opened is None or opened[0].kind != Kind.HELLO or opened[0].src != peer or \
                opened[0].dst != self.rank or bytes(opened[1][:4]) != magic:
            raise ConnectionError(f"rank {peer} said something else than {magic.decode()} "
                                  f"on its stream")
        return bytes(opened[1][4:])


def prove_delivery(links, deadline: float) -> dict[int, list[int]]:
    """Each rank's list of the ranks whose multicast it did not hear (see the module's doc),
    alike on every rank, for the communicator rendezvous has just made (its Links: the streams
    still unused, the group joined unless `links.multicast` is None, in which case this rank
    hears nobody and says so). ConnectionError or OSError if a peer's stream fails or it says
    something else; socket.timeout past `deadline` (time.monotonic())."""
    rank, world, streams, group = links.rank, links.world, links.streams, links.group
    key, job, comm, sealer = links.key, links.job, links.comm, links.sealer
    words = _Words(streams, Opener(key, job, comm, Drops()), rank, world)
    heard: set[int] = set()
    listener = None
    if links.multicast is not None:
        try:
            listener = open_multicast(links.address, group[0], probe_port(group[1]), False)
            listener.setblocking(False)
        except OSError:
            listener = None  # hears nobody: its report says so
    try:
        probe_opener = Opener(key, job, comm, Drops())
        probe = sealer.seal(Kind.HELLO, 0, ANY, 0, PROBE.ljust(chunk_bytes(links.mtu), b"\0"))
        reports: dict[int, list[int]] = {}
        selector = selectors.DefaultSelector()
        for peer, sock in streams.items():
            selector.register(sock, selectors.EVENT_READ, peer)
        if listener is not None:
            selector.register(listener, selectors.EVENT_READ, None)
        began = time.monotonic()  # half the time left at most: the reports must come in time
        listen_until = began + min(PROBE_SECONDS, (deadline - began) / 2)
        mine: list[int] | None = None
        next_probe = 0.0
        try:
            while mine is None or len(reports) < len(streams):
                now = time.monotonic()
                if now >= deadline:
                    raise socket.timeout(f"rank {rank} waited for the multicast reports of "
                                         f"ranks {sorted(set(streams) - set(reports))}")
                if mine is None and (len(heard) == world - 1 or now >= listen_until):
                    mine = sorted(set(range(world)) - heard - {rank})
                    words.send(sealer, REPORT + _bitmap(mine, world))
                if now >= next_probe:
                    try:
                        links.udp.sendto(probe, (group[0], probe_port(group[1])))
                    except OSError:
                        pass  # the others will not hear it, and will say so
                    next_probe = now + PROBE_INTERVAL_SECONDS
                for key_, _ in selector.select(max(0.0, min(next_probe, deadline) - now)):
                    if key_.data is None:
                        _hear(listener, probe_opener, rank, world, heard)
                    else:
                        reports[key_.data] = _ranks(words.read(key_.data, REPORT, deadline),
                                                    world)
                        selector.unregister(key_.fileobj)
        finally:
            selector.close()
    finally:
        if listener is not None:
            listener.close()
    return {**reports, rank: mine}


def _hear(listener: socket.socket, opener: Opener, rank: int, world: int,
          heard: set[int]) -> None:
    """Take every probe waiting in `listener`; add each authentic one's sender to `heard`."""
    while True:
        try:
            data = listener.recv(65536)
        except BlockingIOError:
            return
        opened = opener.open(data)
        if opened is not None and opened[0].kind == Kind.HELLO and \
                bytes(opened[1][:4]) == PROBE and opened[0].src != rank and \
                0 <= opened[0].src < world:
            heard.add(opened[0].src)


def undelivered(unheard: dict[int, list[int]], addresses: list[str]) -> str | None:
    """Why multicast is not delivered, naming the ranks and their hosts; None if it is."""
    world = len(addresses)
    deaf = [r for r in sorted(unheard) if len(unheard[r]) == world - 1]
    partial = [r for r in sorted(unheard) if 0 < len(unheard[r]) < world - 1]
    if not deaf and not partial:
        return None

    def named(ranks: list[int]) -> str:
        shown = ", ".join(f"{r} ({addresses[r]})" for r in ranks[:8])
        return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")

    parts = []
    if deaf:
        parts.append(f"rank{'s' if len(deaf) > 1 else ''} {named(deaf)} heard no other "
                     f"rank's multicast")
    for r in partial[:8]:
        parts.append(f"rank {r} ({addresses[r]}) did not hear rank"
                     f"{'s' if len(unheard[r]) > 1 else ''} {named(unheard[r])}")
    if len(partial) > 8:
        parts.append(f"{len(partial) - 8} more ranks missed some")
    return "multicast not delivered: " + "; ".join(parts)
