"""Fuzzing, seeded: generated, mutated and replayed messages thrown at the openers (datagrams and
streams), at the protocols mid-collective and at the aggregator's reduction engine. Nothing raises,
nothing is accepted that should not be, and the collectives running beside stay bit-exact.

170,000 messages per run (50,000 at the datagram opener, 20,000 into streams, 60,000 replays and
40,000 generated datagrams mid-collective); `pytest --fuzz-scale N` throws N times as many, and
`--fuzz-report FILE` writes what was thrown, by target, kind and outcome, as JSON.
"""

import collections
import json
import random
import socket

import numpy as np
import pytest

from fabric import Fabric
from overcast.errors import CollectiveTimeoutError
from overcast.native import _core
from overcast.protocols.base import Descriptor
from overcast.protocols.budget import LinkBudget
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.protocols.multicast import MulticastGather
from overcast.protocols.session import DATAGRAM_KINDS
from overcast.schedules.chains import concurrent_senders
from overcast.aggregator.reduction import Aggregator
from overcast.transport.stream import Stream, StreamClosed
from overcast.wire.auth import Drops, Opener, Sealer
from overcast.wire.header import AGGREGATOR, ANY, HEADER_BYTES, Kind, MalformedError, \
    unpack_header

KEY, JOB, COMM = bytes(range(16)), 0x0B5E55ED, 7
KINDS = [int(k) for k in Kind]
OPENING_DROPS = ("malformed", "foreign", "bad_mac", "replayed")  # what opening a datagram drops
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
        return message[:rng.randrange(1, len(message))]  # an empty read is the port's to count
    if how == 2:
        return message + rng.randbytes(rng.randint(1, 32))
    spliced = message[:HEADER_BYTES] + other[HEADER_BYTES:]
    return spliced if spliced != message else spliced + b"\0"


def own_echo(message: bytes) -> bool:
    """Whether a datagram claims to come from rank 0 itself (its header otherwise whole)."""
    try:
        return unpack_header(message).src == 0
    except MalformedError:
        return False


def test_the_datagram_opener_takes_each_authentic_message_once_and_nothing_else(fuzz_scale,
                                                                               fuzz_report):
    """Each datagram fed, one read at a time, to a rank's native datagram plane (what opens
    every datagram): an authentic one seen the first time passes opening (whatever the plane
    then does with it); a replay, a mutation or random bytes is dropped by the opening itself,
    counted once as malformed, foreign, bad_mac or replayed, but one claiming to be the rank's
    own, which it passes over uncounted (its own multicast, looped back)."""
    rng = random.Random(1)
    senders = [Sealer(KEY, JOB, COMM, r) for r in range(1, WORLD)]
    plane = _core.Plane(0, WORLD, JOB, COMM, KEY, Sealer(KEY, JOB, COMM, 0).native)
    captured: list[bytes] = []
    thrown = 0
    tally = fuzz_report["datagram opener"]

    def opening_drops() -> int:
        return sum(plane.drops().get(why, 0) for why in OPENING_DROPS)
    for _ in range(50_000 * fuzz_scale):
        roll = rng.random()
        thrown += 1
        before = opening_drops()
        if roll < 0.25 or len(captured) < 2:
            message = sealed(rng, rng.choice(senders))
            plane.feed(message, len(message), 0.0)
            assert opening_drops() == before, plane.drops()
            captured = (captured + [message])[-256:]
            tally["authentic, first time: accepted"] += 1
            continue
        if roll < 0.5:
            message, what = rng.choice(captured), "replayed"
        elif roll < 0.85:
            message = mutated(rng, rng.choice(captured), rng.choice(captured))
            what = "mutated"
        else:
            message, what = rng.randbytes(rng.randrange(1, 200)), "random bytes"
        plane.feed(message, len(message), 0.0)
        if own_echo(message):  # multicast loops a rank's own datagrams back: passed over
            tally[f"{what}: passed over as this rank's own"] += 1
            continue
        accepted = opening_drops() == before
        tally[f"{what}: {'ACCEPTED' if accepted else 'dropped'}"] += 1
        assert opening_drops() == before + 1, (what, plane.drops())
    assert thrown >= 50_000


def test_a_stream_delivers_its_authentic_frames_in_order_and_drops_the_rest(fuzz_scale,
                                                                          fuzz_report):
    """Frames with a bad tag are dropped and the stream goes on; a header that cannot be a frame
    ends the stream (StreamClosed), never anything else."""
    rng = random.Random(2)
    thrown = 0
    tally = fuzz_report["stream"]
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
                    tally["authentic frame"] += 1
                elif roll < 0.9:  # the same length, another tag: dropped, the stream goes on
                    message = message[:-16] + rng.randbytes(16)
                    tally["frame with another tag"] += 1
                else:  # garbage where a header should be: the stream ends here
                    message = rng.randbytes(HEADER_BYTES + rng.randrange(64))
                    ended = True
                    tally["garbage where a header belongs"] += 1
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
            tally["authentic frames delivered, in order"] += len(got)
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


def under_fire(seed: int, budget: int, make_hostile, tally):
    """Run the pair over a lossy, reordering fabric, throwing up to `budget` hostile messages
    at random ranks and the aggregator between deliveries; `make_hostile(rng, seen)` makes
    one from what went by on the network (some of it not delivered yet), counted in `tally` by
    kind and outcome. Returns the fabric, the collectives (ag, rs per rank) and how many were
    thrown."""
    rng = random.Random(seed)
    fabric = Fabric(WORLD, seed=seed, loss=0.02, duplicate=0.02, reorder=True,
                    aggregator=Aggregator(slots=8))
    colls = []
    for r in range(WORLD):
        for coll in pair(r):
            colls.append(coll)
            fabric.post(r, coll)
    thrown = steps = 0
    while True:
        while fabric.step():
            steps += 1
            assert steps < 2_000_000, f"seed {seed}: messages still going round at " \
                                      f"{fabric.now:.1f} s"
            if fabric.seen and thrown < budget and rng.random() < 0.5:
                hdr, payload, datagram = make_hostile(rng, fabric.seen)
                target = rng.randrange(WORLD + 1)
                machine = fabric.aggregator if target == WORLD else fabric.sessions[target]
                before = snapshot(machine)
                if target == WORLD:
                    machine.receive(fabric.key, hdr, memoryview(payload), fabric.now)
                else:
                    machine.receive(hdr, memoryview(payload), fabric.now, datagram)
                where = "aggregator" if target == WORLD else "rank"
                tally[f"{Kind(hdr.kind).name} to a {where}: "
                      f"{outcome(before, snapshot(machine))}"] += 1
                thrown += 1
        timers = [t for m in fabric._machines() if (t := m.get_timer()) is not None]
        if fabric.done() or not timers:
            return fabric, colls, thrown
        fabric.now = max(fabric.now, min(timers))
        fabric._fire()


def snapshot(machine) -> collections.Counter:
    """What a rank's session or the aggregator has counted so far."""
    counts = collections.Counter({f"dropped: {k}": v for k, v in machine.drops.items()})
    if hasattr(machine, "stale"):  # a session
        counts["dropped: stale (its collective finished)"] = machine.stale
        counts["dropped: early_dropped"] = machine.early_dropped
        counts["held for a collective not posted yet"] = sum(map(len, machine.early.values()))
    else:
        counts["taken as a duplicate"] = machine.stats["duplicate_contributions"] + \
            machine.stats["late_contributions"]
    return counts


def outcome(before: collections.Counter, after: collections.Counter) -> str:
    changed = [k for k in after if after[k] > before[k]]
    return changed[0] if changed else "taken"


def replayed(rng, seen):
    """An authentic message seen on the network, sent again by datagram, to anyone, perhaps
    before the original arrives. Stream frames too: an eavesdropper can lift them off the
    wire."""
    hdr, payload, _ = rng.choice(seen)
    return hdr, payload, True


def test_replayed_messages_mid_collective_are_dropped_and_the_pair_stays_bit_exact(fuzz_scale,
                                                                                 fuzz_report):
    """Whatever a replay is not dropped for is a copy of data already in place (taken as a
    duplicate): the pair's results, checked bit for bit, are what they would be without it."""
    thrown, seed, drops = 0, 0, collections.Counter()
    while thrown < 60_000 * fuzz_scale:
        fabric, colls, n = under_fire(seed, 3_000, replayed, fuzz_report["replayed, mid-pair"])
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


def test_generated_datagrams_never_raise_and_every_run_ends(fuzz_scale, fuzz_report):
    """Datagrams with any header a keyed sender could write. They may be taken if they fit (the
    MAC is the boundary), so results are not checked here, and a contribution of the wrong width
    can hold an aggregator slot for good: each run ends done, or with CollectiveTimeoutError on
    its ranks within the timeout. Nothing raises out of a receive; no loop goes on without
    end."""
    thrown, seed, timed_out = 0, 1000, 0
    while thrown < 40_000 * fuzz_scale:
        fabric, colls, n = under_fire(seed, 3_000, generated,
                                      fuzz_report["generated by a keyed sender, mid-pair"])
        errors = [s.error for s in fabric.sessions if s.error is not None]
        assert all(isinstance(e, CollectiveTimeoutError) for e in errors), errors
        assert fabric.now < 3 * fabric.sessions[0].timeout
        timed_out += bool(errors)
        thrown += n
        seed += 1
    fuzz_report["generated by a keyed sender, mid-pair"]["runs ended by the timeout"] += \
        timed_out


def test_retransmissions_going_round_do_not_keep_a_stuck_collective_alive():
    """Seed 1154 forges a contribution of the wrong width into an aggregator slot: the slot
    never completes, and the aggregator asks for the same chunk again and again. The timeout
    counts steps toward the result, not messages, so every rank fails in bounded time."""
    fabric, colls, _ = under_fire(1154, 3_000, generated, collections.Counter())
    assert fabric.aggregator.stats["nacks"] > 1000
    assert all(isinstance(s.error, CollectiveTimeoutError) for s in fabric.sessions)
    assert "made no progress for 10.0 s" in str(fabric.sessions[0].error)
    assert fabric.now < 2 * fabric.sessions[0].timeout


@pytest.fixture
def fuzz_scale(request) -> int:
    return request.config.getoption("--fuzz-scale")


@pytest.fixture(scope="module")
def fuzz_report(request):
    """Tallies by target, then by what was thrown and what came of it; written as JSON at the
    end if --fuzz-report names a file."""
    report = collections.defaultdict(collections.Counter)
    yield report
    path = request.config.getoption("--fuzz-report")
    if path:
        with open(path, "w") as f:
            json.dump({target: dict(sorted(c.items())) for target, c in report.items()}, f,
                      indent=1)
