"""Proof that multicast is delivered, made when a communicator is: every rank hears every other's.

A join that succeeds says nothing of the network: a cloud VPC, a routed hop (TTL 1), a switch
without IGMP snooping or querier, or a firewall carries unicast and drops the group's datagrams,
and every multicast chunk would then be repaired over the TCP chain, silently. So, once the
ranks have met and joined their group, each rank

1. multicasts a probe of the full datagram size (the agreed path MTU's) to the group, on a port
   of its own (the group's port shifted by half the range, so that no probe reaches a data
   socket), then tells every other over its stream that it has begun (BEGUN), and goes on
   probing every PROBE_INTERVAL_SECONDS;
2. listens for the others' probes: for each peer, until PROBE_SECONDS after that peer's BEGUN
   came (its first probe was on its way before it), or KNOWN_UNHEARD_SECONDS where this process
   already found, in an earlier communicator, that this host does not hear that peer's host;
   not at all where its own join failed;
3. once it has heard every other rank, or waited that long for each it has not, tells every
   other over its stream whom it did not hear (REPORT), and goes on probing until every rank
   has reported, so that a rank still listening hears it.

Every rank then holds the same picture: for each rank, the ranks it did not hear. Probes and
reports are sealed under the communicator's key (HELLO messages); a probe that does not open,
or whose counter is not above the last its sender's probes carried (a replay), is ignored and
counted in `links.probe_drops` (the communicator's counters() show them as probe_drops).
Nothing is left in the store.

Waiting from each peer's BEGUN, not from this rank's own start, takes the ranks' skew out of
the window: it need only cover a probe's delivery, milliseconds on a LAN, and a listener that
was off the CPU reads what the kernel kept for it before it concludes. Without multicast a
communicator then costs PROBE_SECONDS, and those made after it in the same process about
KNOWN_UNHEARD_SECONDS.
"""

from __future__ import annotations

import selectors
import socket
import time

from overcast.transport.datagram import chunk_bytes, open_multicast
from overcast.transport.store import read_exact
from overcast.wire.auth import Drops, Opener, Sealer, frame_length
from overcast.wire.header import ANY, HEADER_BYTES, Kind

# How long a rank listens for a peer's probes after that peer said it began probing: a LAN
# delivers in well under a millisecond, and a probe goes every PROBE_INTERVAL_SECONDS; this
# leaves room for a switch that forwards a group only once it has seen the join.
PROBE_SECONDS = 0.5
# The same for a peer whose host this process found, in an earlier communicator, does not
# reach this one: some probes' time, so that a network that has come to deliver is still heard
# (under load on 8 emulated hosts a new group's first probes came up to 20-50 ms after the word;
# docs/results.md).
KNOWN_UNHEARD_SECONDS = 0.1
PROBE_INTERVAL_SECONDS = 0.01
REPORT, PROBE, BEGUN = b"OCMR", b"OCMP", b"OCMB"
PORTS_FROM, PORTS = 20000, 20000  # transport.datagram.multicast_group's range
# (listening address, sending address): the hosts whose probes this process listened for and
# did not hear, in the last communicator that had both (a process is one job's rank)
_unheard_hosts: set[tuple[str, str]] = set()


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

    def __init__(self, streams: dict[int, socket.socket], opener: Opener, rank: int, world: int):
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
        if (
            opened is None
            or opened[0].kind != Kind.HELLO
            or opened[0].src != peer
            or opened[0].dst != self.rank
            or bytes(opened[1][:4]) != magic
        ):
            raise ConnectionError(
                f"rank {peer} said something else than {magic.decode()} on its stream"
            )
        return bytes(opened[1][4:])


class _Listening:
    """The probes one rank hears: each authentic one's sender, once per counter."""

    def __init__(self, listener: socket.socket, opener: Opener, rank: int, world: int):
        self.listener, self.opener, self.rank, self.world = listener, opener, rank, world
        self.heard: set[int] = set()
        self.last: dict[int, int] = {}  # each sender's highest probe counter taken

    def hear(self, until: float) -> None:
        """Take the probes waiting, until none is left or `until` (time.monotonic()) passes:
        a flood must not keep the rank from probing and reporting."""
        drops = self.opener.drops
        while time.monotonic() < until:
            try:
                data = self.listener.recv(65536)
            except BlockingIOError:
                return
            opened = self.opener.open(data)
            if opened is None:
                continue  # counted by the opener
            hdr, body = opened
            if hdr.src == self.rank:
                continue  # its own, where ranks share a host
            if hdr.kind != Kind.HELLO or bytes(body[:4]) != PROBE or not 0 <= hdr.src < self.world:
                drops["unexpected"] += 1
            elif hdr.counter <= self.last.get(hdr.src, -1):
                drops["replayed"] += 1
            else:
                self.last[hdr.src] = hdr.counter
                self.heard.add(hdr.src)


def prove_delivery(links, deadline: float) -> dict[int, list[int]]:
    """Each rank's list of the ranks whose multicast it did not hear (see the module's doc),
    alike on every rank, for the communicator rendezvous has just made (its Links: the streams
    still unused, the group joined unless `links.multicast` is None, in which case this rank
    hears nobody and says so at once). ConnectionError or OSError if a peer's stream fails or
    it says something else; socket.timeout past `deadline` (time.monotonic())."""
    rank, world, streams, group = links.rank, links.world, links.streams, links.group
    key, job, comm, sealer = links.key, links.job, links.comm, links.sealer
    address, others = links.address, set(streams)
    words = _Words(streams, Opener(key, job, comm, Drops()), rank, world)
    listening = None
    if links.multicast is not None:
        try:
            listener = open_multicast(address, group[0], probe_port(group[1]), False)
            listener.setblocking(False)
            listening = _Listening(listener, Opener(key, job, comm, links.probe_drops), rank, world)
        except OSError:
            pass  # hears nobody: its report says so
    window = {
        p: KNOWN_UNHEARD_SECONDS
        if (address, links.addresses[p]) in _unheard_hosts
        else PROBE_SECONDS
        for p in others
    }
    padded = PROBE.ljust(chunk_bytes(links.mtu), b"\0")

    def send_probe() -> None:
        # sealed anew each time: a listener that hears two sends of one probe would drop the
        # second as a replay, and count it
        try:
            links.udp.sendto(
                sealer.seal(Kind.HELLO, 0, ANY, 0, padded), (group[0], probe_port(group[1]))
            )
        except OSError:
            pass  # the others will not hear it, and will say so

    selector = selectors.DefaultSelector()
    try:
        for peer, sock in streams.items():
            selector.register(sock, selectors.EVENT_READ, peer)
        if listening is not None:
            selector.register(listening.listener, selectors.EVENT_READ, None)
        began = time.monotonic()  # half the time left at most: the reports must come in time
        listen_until = began + (deadline - began) / 2
        send_probe()  # on its way before the others learn that it is
        words.send(sealer, BEGUN)
        next_probe = began + PROBE_INTERVAL_SECONDS
        reports: dict[int, list[int]] = {}
        begun: dict[int, float] = {}  # when each peer's BEGUN was read
        mine: list[int] | None = None
        while mine is None or len(reports) < len(streams):
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"rank {rank} waited for the multicast reports of "
                    f"ranks {sorted(others - set(reports))}"
                )
            if now >= next_probe:
                send_probe()
                next_probe = now + PROBE_INTERVAL_SECONDS
            wake = min(next_probe, deadline)
            if mine is None:
                if listening is not None:  # what the kernel kept while this rank was away
                    listening.hear(wake)
                unheard = others - (listening.heard if listening is not None else set())
                ends = [begun[p] + window[p] for p in unheard if p in begun]
                end = (
                    now
                    if listening is None
                    else max(ends, default=now)
                    if len(ends) == len(unheard)
                    else listen_until
                )
                if time.monotonic() >= min(end, listen_until):
                    mine = sorted(unheard)
                    words.send(sealer, REPORT + _bitmap(mine, world))
                else:
                    wake = min(wake, end, listen_until)
            for key_, _ in selector.select(max(0.0, wake - time.monotonic())):
                if key_.data is None:
                    assert listening is not None  # its socket alone is registered without a peer
                    if mine is None:
                        listening.hear(min(next_probe, deadline))
                    else:  # nothing more to learn from it
                        selector.unregister(key_.fileobj)
                elif key_.data not in begun:
                    words.read(key_.data, BEGUN, deadline)
                    begun[key_.data] = time.monotonic()
                else:
                    reports[key_.data] = _ranks(words.read(key_.data, REPORT, deadline), world)
                    selector.unregister(key_.fileobj)
    finally:
        selector.close()
        if listening is not None:
            listening.listener.close()
    if listening is not None:  # what the next communicator of this process need not wait for
        for p in others:
            (_unheard_hosts.add if p in mine else _unheard_hosts.discard)(
                (address, links.addresses[p])
            )
    return {**reports, rank: mine}


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
        parts.append(
            f"rank{'s' if len(deaf) > 1 else ''} {named(deaf)} heard no other rank's multicast"
        )
    for r in partial[:8]:
        parts.append(
            f"rank {r} ({addresses[r]}) did not hear rank"
            f"{'s' if len(unheard[r]) > 1 else ''} {named(unheard[r])}"
        )
    if len(partial) > 8:
        parts.append(f"{len(partial) - 8} more ranks missed some")
    return "multicast not delivered: " + "; ".join(parts)
