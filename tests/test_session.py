"""The ring protocols and the session's cross-rank checks, without sockets: deterministic."""

import re

import numpy as np
import pytest

from fabric import Fabric
from overcast.buffers import BFLOAT16
from overcast.errors import (CollectiveMismatchError, CollectiveTimeoutError,
                             InvalidArgumentError, OvercastError, PeerFailureError,
                             ProtocolError)
from overcast.protocols.base import Descriptor
from overcast.protocols.budget import LinkBudget
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.protocols.ring import RingAllGather, RingReduceScatter
from overcast.aggregator.reduction import Aggregator
from overcast.wire.header import HEADER_BYTES, Header, Kind


def gather(fabric, count, dtype, frame_bytes, seq=0):
    world = fabric.world
    shards = [(np.arange(count) * 3 + r * 1000).astype(dtype) for r in range(world)]
    outs = [np.empty(world * count, dtype) for _ in range(world)]
    colls = []
    for r in range(world):
        desc = Descriptor("all_gather", "ring", np.dtype(dtype), count)
        colls.append(RingAllGather(seq, r, world, desc, outs[r], shards[r], frame_bytes))
        fabric.post(r, colls[-1])
    return colls, outs, np.concatenate(shards)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("count,frame_bytes", [(0, 64), (1, 64), (7, 8), (1000, 96), (4099, 4096)])
def test_ring_all_gather_bit_exact(world, count, frame_bytes):
    fabric = Fabric(world, seed=world * 31 + count)
    colls, outs, expect = gather(fabric, count, np.int32, frame_bytes)
    fabric.run()
    assert all(c.done and c.error is None for c in colls)
    for out in outs:
        assert out.tobytes() == expect.tobytes()


FLOATS = [np.float32, np.float64, np.float16, BFLOAT16]
INTS = [np.int32, np.int64, np.uint8]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype,op", [(d, "sum") for d in FLOATS + INTS] +
                         [(d, "avg") for d in FLOATS])
def test_ring_reduce_scatter_bit_exact(world, dtype, op):
    count, frame_bytes = 37, 16
    fabric = Fabric(world, seed=7)
    inputs = [((np.arange(world * count) % 13) + r).astype(dtype) for r in range(world)]
    outs = [np.empty(count, dtype) for _ in range(world)]
    colls = []
    for r in range(world):
        desc = Descriptor("reduce_scatter", "ring", np.dtype(dtype), count, op)
        colls.append(RingReduceScatter(0, r, world, desc, outs[r], inputs[r], frame_bytes))
        fabric.post(r, colls[-1])
    fabric.run()
    total = sum(i.astype(np.float64) for i in inputs)
    for r in range(world):
        assert colls[r].done and colls[r].error is None
        exact = total[r * count:(r + 1) * count].astype(dtype)
        if op == "avg":
            acc = np.float32 if np.dtype(dtype).itemsize == 2 else dtype
            exact = np.divide(exact, world, dtype=acc, casting="unsafe").astype(dtype)
        assert outs[r].tobytes() == exact.tobytes()


def truncated_averages(inputs, world):
    """The exact average of each element of the inputs' sum, truncated toward zero (NCCL's
    integer AVG), from Python's integers: the sums here never wrap."""
    total = [sum(int(i[k]) for i in inputs) for k in range(inputs[0].size)]
    return np.array([abs(t) // world * (1 if t >= 0 else -1) for t in total], inputs[0].dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_ring_average_of_integers_truncates_toward_zero(world, dtype):
    """Sums negative and positive, dividing evenly and not: -7/3 is -2, 7/3 is 2."""
    count = 11
    low = 0 if np.dtype(dtype).kind == "u" else -20
    inputs = [((np.arange(world * count) * 7 + r * 5) % 41 + low).astype(dtype)
              for r in range(world)]
    fabric = Fabric(world, seed=11)
    outs = [np.empty(count, dtype) for _ in range(world)]
    colls = []
    for r in range(world):
        desc = Descriptor("reduce_scatter", "ring", np.dtype(dtype), count, "avg")
        colls.append(RingReduceScatter(0, r, world, desc, outs[r], inputs[r], 8))
        fabric.post(r, colls[-1])
    fabric.run()
    expect = truncated_averages(inputs, world)
    if low and world > 1:
        assert (expect < 0).any() and (expect > 0).any()
    for r in range(world):
        assert colls[r].done and colls[r].error is None
        assert outs[r].tolist() == expect[r * count:(r + 1) * count].tolist()


def test_many_collectives_in_flight_complete_in_any_delivery_order():
    fabric = Fabric(3, seed=3)
    runs = [gather(fabric, 100 + seq, np.int64, 64, seq=seq) for seq in range(4)]
    fabric.run()
    for colls, outs, expect in runs:
        assert all(c.done for c in colls)
        assert all(o.tobytes() == expect.tobytes() for o in outs)


def test_messages_for_a_collective_not_yet_posted_are_kept():
    fabric = Fabric(2)
    world, count = 2, 500
    a = np.arange(count, dtype=np.int32)
    outs = [np.empty(world * count, np.int32) for _ in range(2)]
    desc = Descriptor("all_gather", "ring", np.dtype(np.int32), count)
    c0 = RingAllGather(0, 0, world, desc, outs[0], a, 64)
    fabric.post(0, c0)
    fabric.run()  # rank 0's frames reach rank 1 before rank 1 posts
    assert fabric.sessions[1].early
    c1 = RingAllGather(0, 1, world, desc, outs[1], a + 1, 64)
    fabric.post(1, c1)
    fabric.run()
    assert c0.done and c1.done
    assert outs[0].tobytes() == outs[1].tobytes() == np.concatenate([a, a + 1]).tobytes()


@pytest.mark.parametrize("theirs", [
    Descriptor("all_gather", "ring", np.dtype(np.int32), 11),          # size
    Descriptor("all_gather", "ring", np.dtype(np.int64), 10),          # dtype
    Descriptor("reduce_scatter", "ring", np.dtype(np.int32), 10, "sum"),  # order / kind
])
def test_mismatch_is_an_error_on_every_rank(theirs):
    world = 3
    fabric = Fabric(world)
    colls = []
    for r in range(world):
        desc = theirs if r == 1 else Descriptor("all_gather", "ring", np.dtype(np.int32), 10)
        if desc.collective == "all_gather":
            coll = RingAllGather(0, r, world, desc, np.empty(world * desc.count, desc.dtype),
                                 np.zeros(desc.count, desc.dtype), 64)
        else:
            coll = RingReduceScatter(0, r, world, desc, np.empty(desc.count, desc.dtype),
                                     np.zeros(world * desc.count, desc.dtype), 64)
        colls.append(coll)
        fabric.post(r, coll)
    fabric.run()
    for c in colls:
        assert isinstance(c.error, CollectiveMismatchError), c.error
        assert "differs across ranks" in str(c.error)
        assert str(theirs) in str(c.error)


def test_silent_rank_times_out_everywhere_with_who_was_missing():
    fabric = Fabric(3, timeout=5.0)
    fabric.silent.add(2)
    colls, _, _ = gather(fabric, 10, np.int32, 64)
    fabric.run()
    fabric.advance(4.9)
    assert not any(c.error for c in colls[:2])
    fabric.advance(0.2)
    fabric.run()
    for c in colls[:2]:
        assert isinstance(c.error, CollectiveTimeoutError), c.error
    assert "rank 2" in str(colls[0].error)  # rank 0 waits on its predecessor


def test_goodbye_fails_collectives_the_closed_rank_never_issued():
    fabric = Fabric(2)
    fabric.sessions[1].close()
    colls, _, _ = gather(fabric, 10, np.int32, 64)
    fabric.run()
    assert isinstance(colls[0].error, PeerFailureError)
    assert "closed the communicator after 0 collectives" in str(colls[0].error)


def test_out_of_range_frame_is_a_protocol_error_not_a_crash():
    fabric = Fabric(2)
    colls, _, _ = gather(fabric, 10, np.int32, 64)
    bogus = Header(Kind.RING_DATA, 0, 0, 0, 1, 0, 99, 4, 0)
    fabric.sessions[0].receive(bogus, memoryview(b"\0" * 4), 0.0, False)
    assert isinstance(colls[0].error, ProtocolError)
    fabric.run()
    assert isinstance(colls[1].error, ProtocolError)  # told by rank 0's abort


def test_messages_after_completion_are_counted_stale():
    fabric = Fabric(2)
    colls, _, _ = gather(fabric, 10, np.int32, 64)
    fabric.run()
    assert all(c.done for c in colls)
    late = Header(Kind.RING_DATA, 0, 0, 0, 1, 0, 0, 40, 0)
    fabric.sessions[0].receive(late, memoryview(b"\0" * 40), 0.0, False)
    assert fabric.sessions[0].stale == 1


def test_a_rank_that_closes_mid_collective_is_named_on_every_peer_at_once():
    """Rank 2 closes while its part of #0 is pending: its GOODBYE counts #0 as issued, so only
    its ABORT tells the peers, which fail #0 at once (no clock moves), naming it."""
    fabric = Fabric(3, timeout=100.0)
    colls, _, _ = gather(fabric, 10, np.int32, 64)
    fabric.sessions[2].close()
    fabric.run()
    assert "communicator closed while" in str(colls[2].error)
    for c in colls[:2]:
        assert isinstance(c.error, PeerFailureError), c.error
        assert "rank 2 closed the communicator with all_gather(ring, 10 x int32) #0 pending" \
            in str(c.error)
    assert fabric.now == 0.0


def test_a_collective_the_native_plane_refuses_fails_on_every_rank_not_the_engine():
    """A group of 300 datagrams (what small datagrams once made of a link's batch) is more
    than a contribution's prefix can say: the plane refuses the reduction at post. The
    communicator aborts with the reason on every rank, and later calls fail with it too."""
    world = 2
    fabric = Fabric(world, aggregator=Aggregator())
    desc = Descriptor("reduce_scatter", "innetwork", np.dtype(np.float64), 10, "sum")
    budget = LinkBudget(1e6, batch=7, datagram_bytes=100, reduction_batch=300)
    colls = [InNetworkReduceScatter(0, r, world, desc, np.empty(10), np.ones(world * 10),
                                    chunk_bytes=64, slots=8, budget=budget)
             for r in range(world)]
    for r, coll in enumerate(colls):
        fabric.post(r, coll)
    fabric.run()
    for coll in colls:
        assert isinstance(coll.error, InvalidArgumentError), coll.error
        assert "#0 cannot run on rank" in str(coll.error)
    later, _, _ = gather(fabric, 10, np.int32, 64, seq=1)
    assert all(isinstance(c.error, InvalidArgumentError) for c in later)


def ring_gathers(fabric, rank, seqs, count=250, frame_bytes=256):
    """Rank `rank`'s part of ring AllGathers #seqs of `count` int32 per rank: (collective,
    output) each; rank r's block of #seq holds r * 100 + seq."""
    world = fabric.world
    posted = []
    for seq in seqs:
        desc = Descriptor("all_gather", "ring", np.dtype(np.int32), count)
        out = np.empty(world * count, np.int32)
        coll = RingAllGather(seq, rank, world, desc, out,
                             np.full(count, rank * 100 + seq, np.int32), frame_bytes)
        fabric.post(rank, coll)
        posted.append((coll, out))
    return posted


def check_gathers(posted, count=250):
    for coll, out in posted:
        assert coll.done and coll.error is None, coll.error
        world = len(out) // count
        expect = np.repeat([r * 100 + coll.seq for r in range(world)], count).astype(np.int32)
        assert out.tobytes() == expect.tobytes()


def held_stream_bytes(fabric, rank):
    """What rank `rank` holds for collectives not posted, by the counts and by the messages."""
    session = fabric.sessions[rank]
    messages = sum(HEADER_BYTES + len(payload) for held in session.early.values()
                   for _, payload in held)
    return session._early_stream_total, sum(session.early_stream_bytes.values()), messages


def test_stream_messages_for_collectives_not_posted_are_read_held_and_counted():
    """Rank 0 issues ten ring AllGathers, rank 1 none yet: rank 1 reads all of rank 0's stream
    and holds every message, counted to the byte; once it issues the ten, every result is
    exact and nothing is held or counted."""
    fabric = Fabric(2)
    first = ring_gathers(fabric, 0, range(10))
    fabric.run()
    assert not fabric.streams[(0, 1)]
    total, by_sender, messages = held_stream_bytes(fabric, 1)
    assert total == by_sender == messages > 10 * 1000
    second = ring_gathers(fabric, 1, range(10))
    fabric.run()
    check_gathers(first + second)
    assert held_stream_bytes(fabric, 1) == (0, 0, 0) and not fabric.sessions[1].early


def test_past_the_limit_held_every_rank_fails_naming_the_peer_ahead_and_the_setting():
    """Rank 0 issues ten ring AllGathers (about 1.2 kB of frames each to rank 1), rank 1 none,
    with 3000 B the most rank 1 holds for collectives not issued: the communicator fails on
    every rank with rank 1's words, which say who is ahead, by how much, and what to raise; and
    so do the calls rank 1 issues after."""
    fabric = Fabric(3, early_stream_bytes=3000)
    first = ring_gathers(fabric, 0, range(10)) + ring_gathers(fabric, 2, range(10))
    fabric.run()
    error = fabric.sessions[1].error
    said = re.fullmatch(
        r"rank 0 is (\d+) collectives ahead of rank 1: rank 1 holds [\d.]+ KiB from it for "
        r"collectives #0 to #(\d+), which it has not issued yet: 3,\d{3} B in all, past its "
        r"limit of 3,000 B; raise early_stream_bytes \(the Communicator's, or "
        r"OVERCAST_EARLY_STREAM_BYTES\) to let a rank fall further behind", str(error))
    assert type(error) is OvercastError and said, error
    assert int(said[1]) == int(said[2]) + 1
    for coll, _ in first:
        assert type(coll.error) is OvercastError
        assert str(coll.error) == f"{error} (reported by rank 1)"
    late = ring_gathers(fabric, 1, [0])[0][0]
    assert late.error is error
    assert held_stream_bytes(fabric, 1) == (0, 0, 0)


def test_the_next_collective_is_held_whole_past_the_limit_as_its_describe_allows():
    """Rank 0 issues a ring AllGather whose block (8,000 B) is past rank 1's limit (3,000 B):
    rank 1, about to issue the same call, holds it whole (its DESCRIBE says that much will
    come), and completes exact once it does. A second call's frames count again."""
    fabric = Fabric(2, early_stream_bytes=3000)
    first = ring_gathers(fabric, 0, [0], count=2000, frame_bytes=1024)
    fabric.run()
    assert fabric.sessions[1].error is None and held_stream_bytes(fabric, 1)[0] > 8000
    second = ring_gathers(fabric, 1, [0], count=2000, frame_bytes=1024)
    fabric.run()
    check_gathers(first + second, count=2000)
    ring_gathers(fabric, 0, [1, 2], count=2000, frame_bytes=1024)
    fabric.run()
    assert "rank 0 is 2 collectives ahead of rank 1" in str(fabric.sessions[1].error)


def test_an_abort_behind_what_a_peer_far_ahead_sent_is_read_at_once():
    """Rank 0 runs 20 MiB ahead of rank 1 (five ring AllGathers of 4 MiB per rank, not issued
    on rank 1), then aborts: rank 1 reads on to the ABORT and fails with rank 0's reason as soon
    as it arrives, the clock not moved, rather than at its timeout."""
    fabric = Fabric(2)
    count, frame = 1 << 20, 1 << 20
    ring_gathers(fabric, 0, range(5), count, frame)
    fabric.run()
    assert held_stream_bytes(fabric, 1)[0] > 5 * 4 * count
    fabric.sessions[0].abort(OvercastError("rank 0's user gave up"))
    fabric.run()
    assert str(fabric.sessions[1].error) == "rank 0's user gave up (reported by rank 0)"
    assert fabric.now == 0.0


def test_what_was_held_is_counted_off_once_when_a_replay_aborts():
    """Rank 1 holds rank 0's DESCRIBE and frames of #0, then issues a #0 of another size: the
    DESCRIBE replayed first aborts, and the frames replayed after it are stale, not counted off
    a second time."""
    fabric = Fabric(2)
    ring_gathers(fabric, 0, [0])
    fabric.run()
    assert held_stream_bytes(fabric, 1)[0] > 1000
    desc = Descriptor("all_gather", "ring", np.dtype(np.int32), 251)
    mine = RingAllGather(0, 1, 2, desc, np.empty(502, np.int32), np.zeros(251, np.int32), 256)
    fabric.post(1, mine)
    assert isinstance(mine.error, CollectiveMismatchError)
    assert held_stream_bytes(fabric, 1) == (0, 0, 0)


def test_what_was_held_for_collectives_a_closed_peer_never_issued_is_let_go():
    """Rank 2 closes after #0; rank 0 had issued #1-#10 already, whose frames rank 1 holds.
    Rank 1's #1-#10 fail as they are posted (rank 2 never issued them), and what was held for
    each goes with it, counted as stale."""
    fabric = Fabric(3)
    first = [posted for rank in range(3) for posted in ring_gathers(fabric, rank, [0])]
    fabric.run()
    check_gathers(first)
    ring_gathers(fabric, 0, range(1, 11))
    fabric.sessions[2].close()
    fabric.run()
    assert held_stream_bytes(fabric, 1)[0] > 10 * 1000
    stale = fabric.sessions[1].stale
    later = ring_gathers(fabric, 1, range(1, 11))
    assert all(isinstance(coll.error, PeerFailureError) for coll, _ in later)
    assert held_stream_bytes(fabric, 1) == (0, 0, 0) and not fabric.sessions[1].early
    assert fabric.sessions[1].stale > stale + 10
