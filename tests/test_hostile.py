"""A hostile host on the emulated switch while 4 ranks run overlapped pairs (multicast AllGather
and in-network ReduceScatter): it captures every frame that crosses the switch and throws them
back, to the right and to the wrong destinations, as they were, with a bit flipped, forged, and
as floods of junk. Every pair stays bit-exact, nothing crashes, the counters say what was dropped
and why, and the attack stops by itself."""

import collections
import json
import os
import random
import socket
import struct
import time

import numpy as np

import overcast
from conftest import root_only
from overcast.cluster.launch import Placement, enter_netns, run_ranks
from overcast.cluster.netns import Cluster

pytestmark = root_only

WORLD, ELEMENTS, MIN_PAIRS = 4, 32 * 1024, 5
ATTACKS = 3000         # the hostile host stops after this many...
ATTACK_SECONDS = 40.0  # ...or this long, whichever comes first


def overcast_message(frame: bytes):
    """(protocol, source IP, (destination IP, port), message) of an IPv4 frame that carries an
    overcast message at the start of its UDP or TCP payload, else None."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        return None
    l4, proto = 14 + (frame[14] & 15) * 4, frame[23]
    source, destination = socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34])
    if proto == socket.IPPROTO_UDP:
        data = frame[l4 + 8:]
    elif proto == socket.IPPROTO_TCP and len(frame) > l4 + 12:
        data = frame[l4 + (frame[l4 + 12] >> 4) * 4:]
    else:
        return None
    if not data.startswith(b"OC"):
        return None
    return proto, source, (destination, struct.unpack_from("!H", frame, l4 + 2)[0]), data


def hostile(switch_ns: str, own_ns: str, own_address: str, stop_path: str) -> dict:
    """Capture on the switch, attack from a host of its own; returns what it threw."""
    enter_netns(switch_ns)
    # ETH_P_ALL: a tap on every port sees the frames the bridge forwards, which a packet
    # socket for IPv4 alone would not
    capture = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    capture.settimeout(0.2)
    enter_netns(own_ns)
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rng = random.Random(7)
    receivers: set[tuple[str, int]] = set()  # where datagrams go: ranks, group, aggregator
    thrown: collections.Counter = collections.Counter()
    deadline = time.monotonic() + ATTACK_SECONDS
    try:
        while sum(thrown.values()) < ATTACKS and time.monotonic() < deadline:
            try:
                found = overcast_message(capture.recv(1 << 17))
            except socket.timeout:
                continue
            if found is None or found[1] == own_address:
                continue
            proto, _, destination, message = found
            if proto == socket.IPPROTO_UDP:
                receivers.add(destination)
            elsewhere = rng.choice(sorted(receivers - {destination}) or [destination])
            attack = rng.choice(("as it was", "elsewhere", "bit flipped", "forged", "flood"))
            if proto == socket.IPPROTO_TCP:
                attack = "stream frame as a datagram"
                datagrams = [(message, elsewhere)]
            elif attack == "as it was":
                datagrams = [(message, destination)]
            elif attack == "elsewhere":
                datagrams = [(message, elsewhere)]
            elif attack == "bit flipped":
                i = rng.randrange(len(message) * 8)
                flipped = bytearray(message)
                flipped[i // 8] ^= 1 << i % 8
                datagrams = [(bytes(flipped), elsewhere)]
            elif attack == "forged":  # the header kept, the job changed, the tag made up
                datagrams = [(message[:4] + rng.randbytes(4) + message[8:-16] +
                              rng.randbytes(16), elsewhere)]
            else:
                datagrams = [(rng.randbytes(rng.randrange(1, 1500)), elsewhere)
                             for _ in range(20)]
            for datagram, to in datagrams:
                try:
                    out.sendto(datagram, to)
                except OSError:  # a full socket buffer, as on a real network
                    pass
            thrown[attack] += 1
    finally:
        open(stop_path, "w").close()
        capture.close()
        out.close()
    return dict(thrown)


def worker(rank: int, stop_path: str) -> dict:
    """Overlapped pairs until the hostile host has finished (and at least MIN_PAIRS)."""
    with overcast.Communicator(timeout=30) as comm:
        world, pairs, exact = comm.world_size, 0, 0
        while True:
            scale = pairs % 7 + 1
            gathered, reduced = np.empty(world * ELEMENTS, np.float32), \
                np.empty(ELEMENTS, np.float32)
            works = [comm.all_gather(gathered, np.full(ELEMENTS, rank + pairs, np.float32),
                                     algorithm="multicast", async_op=True),
                     comm.reduce_scatter(reduced, np.full(world * ELEMENTS, (rank + 1) * scale,
                                                          np.float32),
                                         algorithm="innetwork", async_op=True)]
            for work in works:
                work.wait()
            exact += bool(
                np.array_equal(gathered, np.repeat(np.arange(world, dtype=np.float32) + pairs,
                                                   ELEMENTS))
                and np.all(reduced == scale * world * (world + 1) / 2))
            pairs += 1
            flags = np.empty(world, np.int32)
            comm.all_gather(flags, np.array([os.path.exists(stop_path)], np.int32))
            if pairs >= MIN_PAIRS and flags.all():
                return {"pairs": pairs, "exact": exact, "counters": comm.counters()}


def host(rank: int, stop_path: str, switch_ns: str, own_ns: str, own_address: str):
    if rank == WORLD:
        return hostile(switch_ns, own_ns, own_address, stop_path)
    return worker(rank, stop_path)


def test_a_host_that_captures_and_replays_cannot_stop_the_job(tmp_path):
    stop_path, stats_path = str(tmp_path / "stop"), str(tmp_path / "aggregator.json")
    with Cluster(WORLD + 1, 400_000_000) as cluster:
        aggregator = cluster.start_aggregator(stats_path=stats_path)
        placements = [Placement(cluster.host_ns[r], cluster.environment(
            r, {"WORLD_SIZE": str(WORLD)})) for r in range(WORLD)] + [Placement(None, {})]
        results = run_ranks(host, placements, timeout=300,
                            args=(stop_path, cluster.switch_ns, cluster.host_ns[WORLD],
                                  "198.18.0.5"))
        cluster.stop_aggregator(aggregator)
    with open(stats_path) as f:
        aggregator_drops = json.load(f)["drops"]
    thrown = results[WORLD]
    *ranks, _ = results
    assert sum(thrown.values()) >= 200 and set(thrown) >= {
        "as it was", "elsewhere", "bit flipped", "forged", "flood",
        "stream frame as a datagram"}, thrown
    for r, result in enumerate(ranks):
        assert result["pairs"] >= MIN_PAIRS and result["exact"] == result["pairs"], (r, result)
    drops = collections.Counter()
    for result in ranks:
        drops.update(result["counters"]["drops"])
    # replays to where they went first, to the wrong rank, bit flips, forgeries and junk: each
    # dropped under its reason, none raised
    for reason in ("replayed", "misdirected", "bad_mac", "foreign", "malformed"):
        assert drops[reason] > 0, (reason, drops)
    assert drops["wrong_channel"] > 0, drops  # stream frames lifted off the wire
    assert sum(aggregator_drops.values()) > 0, aggregator_drops
