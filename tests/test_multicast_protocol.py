"""The reliable multicast Broadcast and AllGather, sans I/O: bit-exact under loss, bursts,
duplicates and reordering, with repairs that chain toward the root and bounded state."""

import itertools

import numpy as np
import pytest

from fabric import Fabric
from overcast.errors import CollectiveTimeoutError
from overcast.protocols.base import Descriptor, Phase
from overcast.protocols.budget import LinkBudget
from overcast.protocols.multicast import MulticastGather
from overcast.schedules.chains import chains, concurrent_senders
from overcast.wire.header import Kind

CHUNK = 64
RATE = 1e6  # link bytes per second of one stream: pacing in simulated time


def all_gather(fabric, nbytes, roots=2, seq=0, budgets=None):
    """Every rank's AllGather of `nbytes` each; `budgets`, one per rank, are the links its
    collectives share (default: a link of its own for this one)."""
    world = fabric.world
    shards = [np.frombuffer(np.random.default_rng(r + 17 * seq).bytes(nbytes), np.uint8)
              for r in range(world)]
    outs = [np.empty(world * nbytes, np.uint8) for _ in range(world)]
    colls = []
    for r in range(world):
        desc = Descriptor("all_gather", "multicast", np.dtype(np.uint8), nbytes, param=roots)
        coll = MulticastGather(seq, r, world, desc, outs[r],
                               [(q, q * nbytes, nbytes) for q in range(world)], source=shards[r],
                               roots=roots, chunk_bytes=CHUNK,
                               budget=budgets[r] if budgets else link(world, roots,
                                                                      fabric.runs))
        colls.append(coll)
        fabric.post(r, coll)
    return colls, outs, np.concatenate(shards)


def link(world, roots, batch=1):
    """A host's link, paced so that each of the streams a receiver takes at once gets RATE."""
    return LinkBudget(RATE * concurrent_senders(world, roots), batch=batch)


def broadcast(fabric, nbytes, root):
    world = fabric.world
    data = np.frombuffer(np.random.default_rng(5).bytes(nbytes), np.uint8)
    bufs = [data.copy() if r == root else np.zeros(nbytes, np.uint8) for r in range(world)]
    colls = []
    for r in range(world):
        desc = Descriptor("broadcast", "multicast", np.dtype(np.uint8), nbytes, param=root)
        coll = MulticastGather(0, r, world, desc, bufs[r], [(root, 0, nbytes)], source=None,
                               roots=1, chunk_bytes=CHUNK, budget=LinkBudget(RATE))
        colls.append(coll)
        fabric.post(r, coll)
    return colls, bufs, data


def check(colls, outs, expect):
    for c in colls:
        assert c.error is None, c.error
        assert c.done, c.waiting_for()
    for out in outs:
        assert out.tobytes() == expect.tobytes()


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("loss,burst", [(0.0, 1), (0.01, 1), (0.10, 1), (0.05, 8)])
@pytest.mark.parametrize("runs", [1, 4])
def test_all_gather_bit_exact_under_loss(world, loss, burst, runs):
    fabric = Fabric(world, seed=world * 7 + int(loss * 100), loss=loss, burst=burst,
                    duplicate=0.02, reorder=True, runs=runs)
    colls, outs, expect = all_gather(fabric, 20000 + 37 * world)
    fabric.run_timed()
    check(colls, outs, expect)
    repaired = sum(c.stats["repaired_chunks"] for c in colls)
    if loss:
        assert fabric.dropped > 0 and repaired > 0
    else:
        assert repaired == 0
    # every lost chunk was repaired exactly once: duplicates are from the network, not repair
    assert repaired <= fabric.dropped


@pytest.mark.parametrize("nbytes", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 10 * CHUNK + 3])
def test_all_gather_sizes_and_tails(nbytes):
    fabric = Fabric(3, seed=nbytes, loss=0.05, reorder=True)
    colls, outs, expect = all_gather(fabric, nbytes)
    fabric.run_timed()
    check(colls, outs, expect)


@pytest.mark.parametrize("world,root", [(2, 0), (3, 2), (5, 1), (8, 7)])
def test_broadcast_bit_exact_under_loss(world, root):
    fabric = Fabric(world, seed=root, loss=0.1, duplicate=0.05, reorder=True)
    colls, bufs, data = broadcast(fabric, 5000, root)
    fabric.run_timed()
    check(colls, bufs, data)


def test_total_loss_is_repaired_through_the_ring_toward_the_root():
    """Nothing multicast arrives: every chunk comes by repair, each rank reading from rank+1,
    which defers until it has the data itself, back to the root."""
    world = 4
    fabric = Fabric(world, loss=1.0)
    colls, bufs, data = broadcast(fabric, 20 * CHUNK, root=0)
    fabric.run_timed()
    check(colls, bufs, data)
    # every rank repaired all 20 chunks from its successor (rank q serves rank q-1): only rank
    # 3 read from the root, and a successor asked before it had the data deferred the answer
    assert [c.stats["repaired_chunks"] for c in colls] == [0, 20, 20, 20]
    assert [c.stats["repair_bytes_served"] for c in colls] == [20 * CHUNK, 0, 20 * CHUNK,
                                                              20 * CHUNK]
    assert colls[2].stats["repair_deferrals"] + colls[3].stats["repair_deferrals"] > 0


def test_roots_multicast_in_chains_never_more_at_once_than_roots():
    """Count the streams arriving at once: with pacing, what a receiver takes in never exceeds
    min(roots, P-1) streams."""
    world, roots = 8, 2
    fabric = Fabric(world)
    colls, outs, expect = all_gather(fabric, 50 * CHUNK, roots=roots)
    sending_at_once = 0
    while True:
        fabric.run()
        active = sum(1 for c in colls if c.phase is Phase.SENDING)
        sending_at_once = max(sending_at_once, active)
        timers = [t for s in fabric.sessions if (t := s.get_timer()) is not None]
        if not timers:
            break
        fabric.advance(min(timers) - fabric.now)
    check(colls, outs, expect)
    assert sending_at_once == roots == len(chains(world, roots))
    assert concurrent_senders(world, roots) == roots


def test_pacing_spreads_a_stream_over_time():
    fabric = Fabric(2)
    colls, outs, expect = all_gather(fabric, 100 * CHUNK, roots=2)
    fabric.run_timed()
    check(colls, outs, expect)
    wire = 100 * (CHUNK + 52 + 42)
    assert fabric.now == pytest.approx(wire / RATE, rel=0.05)


def test_gathers_in_flight_at_once_share_the_link():
    """Two AllGathers posted together on one link each per host: each root's streams share its
    pace while both are in flight, so together they take as long as one after the other. At
    the full pace each, what reaches a receiver would be twice what its link carries."""
    world = 3
    fabric = Fabric(world)
    budgets = [link(world, world) for _ in range(world)]
    gathers = [all_gather(fabric, 100 * CHUNK, roots=world, seq=seq, budgets=budgets)
               for seq in (0, 1)]
    assert [b.gathers_in_flight for b in budgets] == [2] * world
    fabric.run_timed()
    for colls, outs, expect in gathers:
        check(colls, outs, expect)
    assert [b.gathers_in_flight for b in budgets] == [0] * world
    wire = 2 * 100 * (CHUNK + 52 + 42)
    assert fabric.now == pytest.approx(wire / RATE, rel=0.05)


@pytest.mark.parametrize("world,roots", [(3, 3), (4, 2)])
@pytest.mark.parametrize("seed", range(4))
def test_a_gather_whose_streams_have_ended_stops_sharing_the_pace(world, roots, seed):
    """Once every root of a gather has ended its multicast, it sends nothing more into the
    receivers' links: while it still waits for repairs and its FIN, it no longer divides the
    pace of the gather beside it. Never before: at every step, a gather a rank has stopped
    counting has no root, on any rank, still waiting to send or sending. Under loss (so repairs
    keep gathers open after their streams end), with all roots at once and with chained ones."""
    fabric = Fabric(world, seed=seed, loss=0.1)
    budgets = [link(world, roots) for _ in range(world)]
    gathers = [all_gather(fabric, n * CHUNK, roots=roots, seq=seq, budgets=budgets)
               for seq, n in ((0, 20), (1, 200))]
    ended_before_done = 0
    while True:
        fabric.run()
        for colls, _, _ in gathers:
            if any(c.streams_ended for c in colls):
                assert not any(c.phase in (Phase.WAITING, Phase.SENDING) for c in colls)
        for r in range(world):
            counted = sum(not colls[r].done and not colls[r].streams_ended
                          for colls, _, _ in gathers)
            assert budgets[r].gathers_in_flight == counted, (r, fabric.now)
            ended_before_done += sum(colls[r].streams_ended and not colls[r].done
                                     for colls, _, _ in gathers)
        timers = [t for s in fabric.sessions if (t := s.get_timer()) is not None]
        if not timers:
            break
        fabric.advance(min(timers) - fabric.now)
    for colls, outs, expect in gathers:
        check(colls, outs, expect)
    assert ended_before_done > 0
    assert [b.gathers_in_flight for b in budgets] == [0] * world


def test_an_all_gather_rank_says_nothing_on_a_stream_before_its_end_notice():
    """Rank 1's link is ten times slower, so it has every other root's chunks while its own
    are still going out: its FIN (it will ask nothing more) waits for its MCAST_END, the
    first thing on each of its streams, which carries its call to be checked before anything
    else of it is taken."""
    world = 3
    fabric = Fabric(world)
    budgets = [link(world, world) for _ in range(world)]
    budgets[1] = LinkBudget(RATE / 10 * concurrent_senders(world, world))
    colls, outs, expect = all_gather(fabric, 20 * CHUNK, roots=world, budgets=budgets)
    fabric.run_timed()
    check(colls, outs, expect)
    first: dict[tuple[int, int], int] = {}
    for hdr, _, datagram in fabric.seen:
        if not datagram:
            first.setdefault((hdr.src, hdr.dst), hdr.kind)
    assert first == {pair: Kind.MCAST_END for pair in itertools.permutations(range(world), 2)}


def test_a_root_that_never_sends_times_out_everywhere():
    world = 3
    fabric = Fabric(world, timeout=2.0)
    fabric.silent.add(1)
    colls, _, _ = all_gather(fabric, 10 * CHUNK)
    fabric.run_timed(until=1.0)
    assert not any(c.error for c in colls)
    fabric.advance(2.5)
    fabric.run()
    for r in (0, 2):
        assert isinstance(colls[r].error, CollectiveTimeoutError)
        assert "rank 1" in str(colls[r].error)


def test_state_is_bounded_by_the_buffers():
    """Besides the user buffers, a rank keeps one byte per chunk and a few lists, throughout:
    checked whenever the network is quiet, under loss that makes every rank note gaps, ask
    for repairs and serve them. Once done, the plane lets the gather go."""
    fabric = Fabric(3, loss=0.2, reorder=True)
    colls, outs, expect = all_gather(fabric, 200 * CHUNK)
    first = most = max(c.state_bytes() for c in colls)
    while True:
        fabric.run()
        for c in colls:  # in the plane: a byte of state per chunk, a few lists
            if c.posted:
                most = max(most, c.state_bytes())
                assert 3 * 200 <= c.state_bytes() <= 3 * 200 + 2048
        timers = [t for s in fabric.sessions if (t := s.get_timer()) is not None]
        if not timers:
            break
        fabric.advance(min(timers) - fabric.now)
    check(colls, outs, expect)
    assert all(c.stats["repaired_chunks"] and c.stats["repair_bytes_served"] for c in colls)
    assert most > first  # the lists grew, within the bound
    for c in colls:
        assert c.plane.gather_state(c.seq) is None and not c.deferred
        assert c.plane.memory()[0] < 64 * 1024
