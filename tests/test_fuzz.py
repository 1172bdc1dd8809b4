"""Fuzzing, seeded: generated, mutated and replayed messages thrown at the openers (datagrams and
streams), at the protocols mid-collective and at the aggregator's reduction engine. Nothing raises,
nothing is accepted that should not be, and the collectives running beside stay bit-exact.

170,000 messages per run (50,000 at the datagram opener, 20,000 into streams, 60,000 replays and
40,000 generated datagrams mid-collective); `pytest --fuzz-scale N` throws N times as many.
"""

import collections
import random
import socket

import numpy as np
import pytest

from fabric import Fabric
from overcast.protocols.base import Descriptor
from overcast.protocols.budget import LinkBudget
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.protocols.multicast import MulticastGather
from overcast.protocols.session import DATAGRAM_KINDS
from overcast.schedules.chains import concurrent_senders
from overcast.switch.aggregator import Aggregator
from overcast.transport.stream import Stream, StreamClosed
from overcast.wire.auth import Drops, Opener, Sealer
from overcast.wire.header import AGGREGATOR, ANY, HEADER_BYTES, Kind

KEY, JOB, COMM = bytes(range(16)), 0x0B5E55ED, 7
KINDS = [int(k) for k in Kind]
WORLD, CHUNK, RATE = 4, 64, 1e6


def sealed(rng: random.Random, sealer: Sealer) -> bytes:
    payload = rng.randbytes(rng.choice((0, 1, 8, 64, 300)))
    return sealer.seal(rng.choice(KINDS), rng.randrange(8), rng.choice((0, 1, 2, 3, ANY)),
                       rng.randrange(1 << 16), payload)


def mutated(rng: random.Random, message: bytes, other: bytes) -> bytes:
    """A different byte string made from an authentic message: a flipped bit, cut or grown,
    or spliced with another message."""
    how = rng.randrange(4)
    if how == 0:
        i = rng.randrange(len(message) * 8)
        return message[:i // 8] + bytes([message[i // 8] ^ (1 << i % 8)]) + message[i // 8 + 1:]
    if how == 1:
        return message[:rng.randrange(len(message))]
    if how == 2:
        return message + rng.randbytes(rng.randint(1, 32))
    spliced = message[:HEADER_BYTES] + other[HEADER_BYTES:]
    return spliced if spliced != message else spliced + b"\0"


def test_the_datagram_opener_takes_each_authentic_message_once_and_nothing_else(fuzz_scale):
    rng = random.Random(1)
    senders = [Sealer(KEY, JOB, COMM, r) for r in range(WORLD)]
    drops = Drops()
    opener, windows = Opener(KEY, JOB, COMM, drops), {}
    captured: list[bytes] = []
    fresh = thrown = 0
    for _ in range(50_000 * fuzz_scale):
        roll = rng.random()
        thrown += 1
        if roll < 0.25 or len(captured) < 2:
            message = sealed(rng, rng.choice(senders))
            opened = opener.open(memoryview(message), windows=windows, window_width=1024)
            assert opened is not None and bytes(opened[1]) == message[HEADER_BYTES:-16]
            captured = (captured + [message])[-256:]
            fresh += 1
            continue
        if roll < 0.5:
            message = rng.choice(captured)  # replayed as it was
        elif roll < 0.85:
            message = mutated(rng, rng.choice(captured), rng.choice(captured))
        else:
            message = rng.randbytes(rng.randrange(200))
        assert opener.open(memoryview(message), windows=windows, window_width=1024) is None
    assert sum(drops.values()) == thrown - fresh
    assert thrown >= 50_000 and set(drops) <= {"malformed", "foreign", "bad_mac", "replayed"}


def test_a_stream_delivers_its_authentic_frames_in_order_and_drops_the_rest(fuzz_scale):
    """Frames with a bad tag are dropped and the stream goes on; a header that cannot be a frame
    ends the stream (StreamClosed), never anything else."""
    rng = random.Random(2)
    thrown = 0
    listener = socket.create_server(("127.0.0.1", 0))
    while thrown < 20_000 * fuzz_scale:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        sealer = Sealer(KEY, JOB, COMM, 1)
        stream = Stream(b, 1, Opener(KEY, JOB, COMM, Drops()))
        sent, got, ended = [], [], False
        try:
            for _ in range(200):
                message = sealed(rng, sealer)
                roll = rng.random()
                if roll < 0.6:
                    sent.append(message[HEADER_BYTES:-16])
                elif roll < 0.9:  # the same length, another tag: dropped, the stream goes on
                    message = message[:-16] + rng.randbytes(16)
                else:  # garbage where a header should be: the stream ends here
                    message = rng.randbytes(HEADER_BYTES + rng.randrange(64))
                    ended = True
                a.sendall(message)
                thrown += 1
                try:
                    stream.read(lambda hdr, payload: got.append(bytes(payload)))
                except StreamClosed:
                    assert ended
                    break
                if ended:  # garbage that parsed as a header: the next read may end it
                    break
            assert got == sent[:len(got)]
            if not ended:
                assert got == sent
        finally:
            a.close()
            b.close()
    listener.close()


def pair(rank: int):
    """The overlapped pair: a multicast AllGather and an in-network ReduceScatter."""
    gather = Descriptor("all_gather", "multicast", np.dtype(np.uint8), 1000, param=WORLD)
    ag = MulticastGather(0, rank, WORLD, gather, np.empty(WORLD * 1000, np.uint8),
                         [(q, q * 1000, 1000) for q in range(WORLD)],
                         source=np.full(1000, rank + 1, np.uint8), roots=WORLD,
                         chunk_bytes=CHUNK,
                         budget=LinkBudget(RATE * concurrent_senders(WORLD, WORLD)))
    reduce = Descriptor("reduce_scatter", "innetwork", np.dtype(np.int32), 300, "sum")
    rs = InNetworkReduceScatter(1, rank, WORLD, reduce, np.empty(300, np.int32),
                                np.arange(WORLD * 300, dtype=np.int32) * (rank + 1),
                                chunk_bytes=CHUNK, slots=8, budget=LinkBudget(RATE))
    return ag, rs


def expected_pair(rank: int):
    gathered = np.repeat(np.arange(1, WORLD + 1, dtype=np.uint8), 1000)
    reduced = np.arange(WORLD * 300, dtype=np.int32)[rank * 300:(rank + 1) * 300] * \
        sum(range(1, WORLD + 1))
    return gathered, reduced


def under_fire(seed: int, budget: int, make_hostile):
    """Run the pair over a lossy, reordering fabric, throwing up to `budget` hostile messages
    at random ranks and the aggregator between deliveries; `make_hostile(rng, seen)` makes
    one from what went by on the network (some of it not delivered yet). Returns the fabric,
    the collectives (ag, rs per rank) and how many were thrown."""
    rng = random.Random(seed)
    fabric = Fabric(WORLD, seed=seed, loss=0.02, duplicate=0.02, reorder=True,
                    aggregator=Aggregator(slots=8))
    colls = []
    for r in range(WORLD):
        for coll in pair(r):
            colls.append(coll)
            fabric.post(r, coll)
    thrown = 0
    while True:
        while fabric.step():
            if fabric.seen and thrown < budget and rng.random() < 0.5:
                hdr, payload, datagram = make_hostile(rng, fabric.seen)
                target = rng.randrange(WORLD + 1)
                if target == WORLD:
                    fabric.aggregator.receive(fabric.key, hdr, memoryview(payload), fabric.now)
                else:
                    fabric.sessions[target].receive(hdr, memoryview(payload), fabric.now,
                                                    datagram)
                thrown += 1
        timers = [t for m in fabric._machines() if (t := m.get_timer()) is not None]
        if fabric.done() or not timers:
            return fabric, colls, thrown
        fabric.now = max(fabric.now, min(timers))
        fabric._fire()


def replayed(rng, seen):
    """An authentic message seen on the network, sent again by datagram, to anyone, perhaps
    before the original arrives. Stream frames too: an eavesdropper can lift them off the
    wire."""
    hdr, payload, _ = rng.choice(seen)
    return hdr, payload, True


def test_replayed_messages_mid_collective_are_dropped_and_the_pair_stays_bit_exact(fuzz_scale):
    thrown, seed, drops = 0, 0, collections.Counter()
    while thrown < 60_000 * fuzz_scale:
        fabric, colls, n = under_fire(seed, 3_000, replayed)
        for r in range(WORLD):
            ag, rs = colls[2 * r], colls[2 * r + 1]
            gathered, reduced = expected_pair(r)
            assert ag.error is None and ag.done, (r, ag.error)
            assert rs.error is None and rs.done, (r, rs.error)
            assert ag.buffer.tobytes() == gathered.tobytes()
            assert rs.output.tobytes() == reduced.tobytes()
        for session in fabric.sessions:
            drops.update(session.drops)
        thrown += n
        seed += 1
    assert drops["misdirected"] and drops["wrong_channel"], drops


def generated(rng, seen):
    """What a keyed rank gone wrong could send by datagram: any header, any payload."""
    hdr, payload, _ = rng.choice(seen)
    kind = rng.choice(sorted(DATAGRAM_KINDS)) if rng.random() < 0.7 else rng.choice(KINDS)
    fields = hdr._replace(kind=kind, seq=rng.choice((hdr.seq, rng.randrange(4))),
                          src=rng.choice((hdr.src, rng.randrange(WORLD + 2), AGGREGATOR)),
                          dst=rng.choice((hdr.dst, rng.randrange(WORLD), ANY, AGGREGATOR)),
                          chunk=rng.choice((hdr.chunk, rng.randrange(1 << 12),
                                            (1 << 32) - 1)))
    body = rng.choice((payload, payload[:rng.randrange(len(payload) + 1)],
                       rng.randbytes(rng.choice((0, 3, 4, 8, 64, 72)))))
    return fields._replace(length=len(body)), body, True


def test_generated_datagrams_never_raise_or_abort(fuzz_scale):
    """Datagrams with any header a keyed sender could write: they may be taken if they fit (the
    MAC is the boundary), so results are not checked here; nothing raises, no rank aborts."""
    thrown, seed = 0, 1000
    while thrown < 40_000 * fuzz_scale:
        fabric, colls, n = under_fire(seed, 3_000, generated)
        assert all(s.error is None for s in fabric.sessions), \
            [str(s.error) for s in fabric.sessions]
        thrown += n
        seed += 1


@pytest.fixture
def fuzz_scale(request) -> int:
    return request.config.getoption("--fuzz-scale")
