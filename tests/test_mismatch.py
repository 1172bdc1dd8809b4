"""Mismatched calls across ranks, sans I/O, over a lossy and reordering fabric: whatever the
timing, every rank fails with the same CollectiveMismatchError naming both calls. The datagrams
of a mismatched call race the DESCRIBEs that name it; they are dropped and counted, never taken
as a broken peer. A call one rank refuses fails on the others with its reason, and the
communicator goes on."""

import numpy as np
import pytest

from fabric import Fabric
from overcast.errors import CollectiveMismatchError, InvalidArgumentError
from overcast.protocols.base import Descriptor
from overcast.protocols.budget import LinkBudget
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.protocols.multicast import MulticastGather
from overcast.protocols.ring import RingAllGather, RingBroadcast, RingReduceScatter
from overcast.schedules.chains import concurrent_senders
from overcast.aggregator.reduction import Aggregator

WORLD, CHUNK, RATE = 4, 64, 1e6
U8, F32 = np.dtype(np.uint8), np.dtype(np.float32)


def all_gather(seq, rank, n=128, dtype=U8, roots=WORLD, chunk=CHUNK):
    desc = Descriptor("all_gather", "multicast", dtype, n, param=roots)
    size = n * dtype.itemsize
    return MulticastGather(seq, rank, WORLD, desc, np.empty(WORLD * n, dtype),
                           [(q, q * size, size) for q in range(WORLD)],
                           source=np.full(n, rank, dtype), roots=roots, chunk_bytes=chunk,
                           budget=LinkBudget(RATE * concurrent_senders(WORLD, roots)))


def broadcast(seq, rank, n=300, root=0, chunk=CHUNK):
    desc = Descriptor("broadcast", "multicast", U8, n, param=root)
    buf = np.full(n, 7 if rank == root else 0, np.uint8)
    return MulticastGather(seq, rank, WORLD, desc, buf, [(root, 0, n)], source=None, roots=1,
                           chunk_bytes=chunk, budget=LinkBudget(RATE))


def reduce_scatter(seq, rank, n=100, dtype=F32, op="sum", chunk=CHUNK):
    desc = Descriptor("reduce_scatter", "innetwork", dtype, n, op)
    return InNetworkReduceScatter(seq, rank, WORLD, desc, np.empty(n, dtype),
                                  np.ones(WORLD * n, dtype), chunk_bytes=chunk, slots=8,
                                  budget=LinkBudget(RATE))


# What every rank issues, and what rank 1 issues instead: (seq, rank) -> collective
CASES = {
    "all_gather size": (lambda s, r: all_gather(s, r), lambda s, r: all_gather(s, r, n=129)),
    "all_gather dtype": (lambda s, r: all_gather(s, r, n=32, dtype=F32),
                         lambda s, r: all_gather(s, r, n=128)),  # the same bytes
    "broadcast root": (lambda s, r: broadcast(s, r), lambda s, r: broadcast(s, r, root=2)),
    "broadcast size": (lambda s, r: broadcast(s, r), lambda s, r: broadcast(s, r, n=301)),
    "reduce_scatter size": (lambda s, r: reduce_scatter(s, r),
                            lambda s, r: reduce_scatter(s, r, n=101)),
    "reduce_scatter op": (lambda s, r: reduce_scatter(s, r),
                          lambda s, r: reduce_scatter(s, r, op="avg")),
    "reduce_scatter dtype": (lambda s, r: reduce_scatter(s, r),
                             lambda s, r: reduce_scatter(s, r, dtype=np.dtype(np.int32))),
    # ranks that cut datagrams for different path MTUs: chunk numbers mean different bytes
    "all_gather chunk size": (lambda s, r: all_gather(s, r, n=320),
                              lambda s, r: all_gather(s, r, n=320, chunk=2 * CHUNK)),
    "broadcast chunk size": (lambda s, r: broadcast(s, r, n=320),
                             lambda s, r: broadcast(s, r, n=320, chunk=2 * CHUNK)),
    "reduce_scatter chunk size": (lambda s, r: reduce_scatter(s, r),
                                  lambda s, r: reduce_scatter(s, r, chunk=2 * CHUNK)),
}


def pair(seq, rank, swapped=False):
    """The overlapped pair: AllGather and ReduceScatter in flight at once (rank 1 swaps
    their order)."""
    first, second = (reduce_scatter, all_gather) if swapped else (all_gather, reduce_scatter)
    return [first(seq, rank), second(seq + 1, rank)]


def run(seed, make):
    fabric = Fabric(WORLD, seed=seed, loss=0.02, duplicate=0.02, reorder=True,
                    aggregator=Aggregator())
    colls = []
    for r in range(WORLD):
        for coll in make(r):
            colls.append(coll)
            fabric.post(r, coll)
    fabric.run()
    return colls, fabric


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", range(40))
def test_one_call_mismatched(case, seed):
    same, odd = CASES[case]
    colls, fabric = run(seed, lambda r: [(odd if r == 1 else same)(0, r)])
    expect = (str(same(0, 0).desc), str(odd(0, 1).desc))
    for c in colls:
        assert isinstance(c.error, CollectiveMismatchError), (c.rank, c.error)
        assert all(d in str(c.error) for d in expect), c.error


@pytest.mark.parametrize("seed", range(40))
def test_the_overlapped_pair_issued_in_another_order(seed):
    colls, fabric = run(seed, lambda r: pair(0, r, swapped=r == 1))
    for c in colls:
        assert isinstance(c.error, CollectiveMismatchError), (c.rank, c.seq, c.error)


def test_misfit_datagrams_are_counted():
    """A mismatched size sends chunks that fit no receiver: they are dropped and counted."""
    same, odd = CASES["all_gather size"]
    counted = 0
    for seed in range(10):
        colls, fabric = run(seed, lambda r: [(odd if r == 1 else same)(0, r)])
        counted += sum(sum(s.drops.values()) for s in fabric.sessions)
    assert counted > 0


def ring_all_gather(seq, rank, n=300):
    desc = Descriptor("all_gather", "ring", U8, n)
    return RingAllGather(seq, rank, WORLD, desc, np.empty(WORLD * n, np.uint8),
                         np.full(n, rank, np.uint8), 64)


def ring_reduce_scatter(seq, rank, n=100):
    desc = Descriptor("reduce_scatter", "ring", F32, n, "sum")
    return RingReduceScatter(seq, rank, WORLD, desc, np.empty(n, np.float32),
                             np.ones(WORLD * n, np.float32), 64)


def ring_broadcast(seq, rank, root, n=300):
    desc = Descriptor("broadcast", "ring", U8, n, param=root)
    return RingBroadcast(seq, rank, WORLD, desc, np.full(n, 7 if rank == root else 0, np.uint8),
                         64)


# What every rank but 1 issues at #0 while rank 1 refuses its call (bad arguments).
REFUSED = {
    "all_gather ring": ring_all_gather,
    "reduce_scatter ring": ring_reduce_scatter,
    # rank 1 forwards nothing when its successor is the root: only its DESCRIBE tells
    "broadcast ring, root 2": lambda s, r: ring_broadcast(s, r, root=2),
    "broadcast ring, root 1": lambda s, r: ring_broadcast(s, r, root=1),
    "all_gather multicast": all_gather,
    "broadcast multicast": broadcast,
    "reduce_scatter innetwork": reduce_scatter,
}


@pytest.mark.parametrize("case", list(REFUSED))
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("seed", range(6))
def test_a_call_refused_on_one_rank_fails_there_alone_and_the_next_one_runs(case, when, seed):
    """Rank 1 refuses its call #0 (its arguments are bad) before the others issue theirs, or
    after they are under way: theirs fails with the reason, naming rank 1, on every rank,
    nothing of it is left at the aggregator, and call #1 runs on every rank, numbered alike."""
    agg = Aggregator()
    fabric = Fabric(WORLD, seed=seed, loss=0.02, duplicate=0.02, reorder=True, aggregator=agg)
    reason = InvalidArgumentError("all_gather: the output holds 3 elements")
    others = [REFUSED[case](0, r) for r in range(WORLD) if r != 1]
    if when == "before":
        fabric.sessions[1].refuse(0, reason, fabric.now)
        fabric.run()
    for coll in others:
        fabric.post(coll.rank, coll)
    if when == "after":
        fabric.run()
        assert not any(c.error for c in others)
        if case.endswith("innetwork"):
            assert agg.reductions(fabric.key)  # under way at the aggregator
        fabric.sessions[1].refuse(0, reason, fabric.now)
    fabric.run_timed()
    for c in others:
        assert isinstance(c.error, InvalidArgumentError), (c.rank, c.error)
        assert "rank 1 refused the call: all_gather: the output holds 3 elements" in \
            str(c.error), c.error
    assert agg.reductions(fabric.key) == {}
    if case.endswith("innetwork") and when == "after":
        assert agg.stats["withdrawn"] == 1
    after = [ring_all_gather(1, r) for r in range(WORLD)]
    for coll in after:
        fabric.post(coll.rank, coll)
    fabric.run_timed()
    for coll in after:
        assert coll.error is None and coll.done, coll.error
        assert coll.output.tolist() == np.repeat(np.arange(WORLD), 300).tolist()
    assert all(s.error is None for s in fabric.sessions)
