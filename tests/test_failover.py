"""An aggregator lost mid-job, sans I/O on the in-memory fabric: every in-network ReduceScatter in
flight completes, on the ring or as the aggregators finished it, alike on every rank, and those
after run on the ring; a lost rank still fails the job."""

import json
import os
import signal

import numpy as np
import pytest

from conftest import root_only
from fabric import Fabric
from overcast.errors import CollectiveTimeoutError, PeerFailureError, ProtocolError
from overcast.protocols.base import Descriptor
from overcast.protocols.budget import LinkBudget
from overcast.protocols.failover import RingInstead, pack_report, unpack_report
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.protocols.ring import RingReduceScatter
from overcast.aggregator.reduction import Aggregator
from overcast.wire.header import Header, Kind, endpoint

CHUNK, FRAME, COUNT = 64, 256, 300


def inputs_for(world: int, dtype, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(world * COUNT).astype(dtype) for _ in range(world)]
    return [rng.integers(-1000, 1000, world * COUNT).astype(dtype) for _ in range(world)]


def fabric_with(world: int, aggregators: int = 1, shards: int = 1, seed: int = 0,
                **kw) -> Fabric:
    """A fabric whose ranks watch `aggregators` aggregators of `shards` endpoints each."""
    fabric = Fabric(world, seed=seed, aggregator=[Aggregator(slots=8)
                                                   for _ in range(aggregators * shards)], **kw)
    names = {endpoint(a * shards): f"198.18.0.{a + 1}:7000" for a in range(aggregators)}
    for session in fabric.sessions:
        session.watch_aggregators(names, aggregators * shards)
    return fabric


def post(fabric: Fabric, seq: int, inputs, ranks=None) -> list[np.ndarray]:
    world = fabric.world
    outs = [np.full(COUNT, -1, inputs[0].dtype) for _ in range(world)]
    for r in range(world) if ranks is None else ranks:
        desc = Descriptor("reduce_scatter", "innetwork", inputs[0].dtype, COUNT, "sum")
        fabric.post(r, InNetworkReduceScatter(
            seq, r, world, desc, outs[r], inputs[r], chunk_bytes=CHUNK, slots=8,
            budget=LinkBudget(1e6), stripes=len(fabric.aggregators), frame_bytes=FRAME))
    return outs


def on_the_ring(world: int, inputs) -> bytes:
    """What the ring alone gives for these inputs, every rank's block in turn."""
    fabric = Fabric(world)
    outs = [np.full(COUNT, -1, inputs[0].dtype) for _ in range(world)]
    for r in range(world):
        desc = Descriptor("reduce_scatter", "ring", inputs[0].dtype, COUNT, "sum")
        fabric.post(r, RingReduceScatter(0, r, world, desc, outs[r], inputs[r], FRAME))
    fabric.run_timed()
    return b"".join(o.tobytes() for o in outs)


def in_network(world: int, inputs, aggregators: int = 1) -> bytes:
    fabric = fabric_with(world, aggregators)
    outs = post(fabric, 0, inputs)
    fabric.run_timed()
    return b"".join(o.tobytes() for o in outs)


def finished(fabric: Fabric) -> dict[int, list]:
    """Every rank's collectives, by number, once all finished; none failed."""
    by_seq: dict[int, list] = {}
    for session in fabric.sessions:
        assert not session.active, {s: c.waiting_for() for s, c in session.active.items()}
        for coll in session.finished:
            assert coll.error is None, coll.error
            by_seq.setdefault(coll.seq, []).append(coll)
    return by_seq


def on_ring(fabric: Fabric) -> dict[int, bool]:
    """Whether each collective ran on the ring, the same on every rank."""
    ring = {seq: {isinstance(c, RingInstead) for c in colls}
            for seq, colls in finished(fabric).items()}
    assert all(len(v) == 1 for v in ring.values()), ring
    return {seq: v.pop() for seq, v in ring.items()}


def lose(fabric: Fabric, ranks, stripes=(0,)) -> None:
    """The aggregator of endpoints `stripes` dies: nothing more to or from them, its connection
    (one, to its first) closed on `ranks` (the others learn it from their reports)."""
    fabric.silent.update(map(endpoint, stripes))
    for r in ranks:
        fabric.sessions[r].peer_lost(endpoint(stripes[0]), "198.18.0.1:7000")


def steps(fabric: Fabric, n: int) -> None:
    fabric.run_timed(messages=n)


@pytest.mark.parametrize("delivered", [0, 40, 200, 600])
@pytest.mark.parametrize("told", [[0], [1, 2], [0, 1, 2, 3]])
def test_an_aggregator_killed_mid_reduction_the_ring_gives_every_rank_its_block(delivered, told):
    """Killed after `delivered` messages, its connection closed on some ranks (on all: their
    reports cross): every rank decides alike, and what is redone is the ring's result, bit for
    bit; what every rank held already is the aggregator's, and the same sums."""
    world = 4
    inputs = inputs_for(world, np.int32, delivered)
    fabric = fabric_with(world)
    outs = post(fabric, 0, inputs)
    steps(fabric, delivered)
    lose(fabric, told)
    fabric.run_timed()
    on_ring(fabric)
    assert b"".join(o.tobytes() for o in outs) == on_the_ring(world, inputs)
    for s in fabric.sessions:
        assert s.stats["aggregators_lost"] == 1
        assert s.notices and "198.18.0.1:7000" in s.notices[0]


def test_a_float_sum_is_the_rings_or_the_aggregators_never_a_mix():
    """Floats sum to other bits on the ring than at the aggregator: each collective's result is
    wholly one of them, alike on every rank."""
    world = 5
    inputs = inputs_for(world, np.float32, 7)
    ring, aggregator = on_the_ring(world, inputs), in_network(world, inputs)
    assert ring != aggregator  # else this test shows nothing
    seen = set()
    for delivered in range(0, 900, 40):
        fabric = fabric_with(world, seed=delivered)
        outs = post(fabric, 0, inputs)
        steps(fabric, delivered)
        lose(fabric, [delivered % world])
        fabric.run_timed()
        redone = on_ring(fabric)[0]
        got = b"".join(o.tobytes() for o in outs)
        assert got == (ring if redone else aggregator)
        seen.add(redone)
    assert seen == {True, False}


@pytest.mark.parametrize("delivered", [30, 120, 400])
def test_an_aggregator_that_goes_on_answering_completes_nothing_after_the_freeze(delivered):
    """Only rank 0's connection to the aggregator drops; the aggregator itself goes on sending
    results and credit. Frozen, no rank takes any more of them: every rank ends with one
    algorithm's result, the same one, never the aggregator's here and the ring's there."""
    world = 4
    inputs = inputs_for(world, np.float32, 40 + delivered)
    ring, aggregator = on_the_ring(world, inputs), in_network(world, inputs)
    fabric = fabric_with(world, seed=delivered)
    outs = post(fabric, 0, inputs)
    steps(fabric, delivered)
    fabric.sessions[0].peer_lost(endpoint(0), "198.18.0.1:7000")
    fabric.run_timed()
    redone = on_ring(fabric)[0]
    assert b"".join(o.tobytes() for o in outs) == (ring if redone else aggregator)
    assert any(s.drops["aggregator_lost"] for s in fabric.sessions)


def until(fabric: Fabric, condition, limit: int = 100_000) -> None:
    for _ in range(limit):
        if condition():
            return
        assert not fabric.done(), "all done first"
        steps(fabric, 1)
    raise AssertionError("never")


def test_a_rank_already_done_keeps_its_result_and_every_rank_agrees():
    """Rank 0 has completed the collective (its Work may have returned) when the aggregator
    dies: every rank holds its block, so every rank completes it as the aggregator summed it."""
    world = 4
    inputs = inputs_for(world, np.float32, 3)
    fabric = fabric_with(world, seed=3)
    outs = post(fabric, 0, inputs)
    until(fabric, lambda: not fabric.sessions[0].active)
    assert any(s.active for s in fabric.sessions[1:])
    lose(fabric, [1])
    fabric.run_timed()
    assert on_ring(fabric) == {0: False}
    assert fabric.sessions[0].failover.complete == []  # nothing frozen: it was done
    assert [0] in [s.failover.complete for s in fabric.sessions[1:]]
    assert b"".join(o.tobytes() for o in outs) == in_network(world, inputs)


def test_lost_during_the_last_credit_every_block_in_place_is_complete():
    """Every rank has its whole block but waits for the credit that says all is released when
    the aggregator dies: complete, without that credit."""
    world = 3
    inputs = inputs_for(world, np.float32, 5)
    fabric = fabric_with(world, seed=5)
    outs = post(fabric, 0, inputs)

    def all_in():
        states = [s.plane.reducer(0) for s in fabric.sessions]
        return all(st and st["results"] == st["k"] for st in states) and \
            any(st["phase"] != "drained" for st in states)
    until(fabric, all_in)
    lose(fabric, [2])
    fabric.run_timed()
    assert on_ring(fabric) == {0: False}
    assert b"".join(o.tobytes() for o in outs) == in_network(world, inputs)


def test_a_silent_aggregator_is_lost_within_the_bound_and_the_ring_takes_over():
    """No connection closes (the aggregator cut off): a rank whose reduction waits on it and
    hears nothing from it for the bound (2 s, well within the 10 s timeout) reports it lost."""
    world = 4
    inputs = inputs_for(world, np.int32, 9)
    fabric = fabric_with(world, seed=9)
    outs = post(fabric, 0, inputs)
    steps(fabric, 100)
    fabric.silent.add(endpoint(0))
    heard = max(t for s in fabric.sessions if (t := s.plane.heard(0)) is not None)
    fabric.run_timed(until=heard + 2.0 + 1e-9)
    finished(fabric)
    assert all(s.failover is not None for s in fabric.sessions)
    assert any("silent for 2 s" in s.notices[0] for s in fabric.sessions)
    assert b"".join(o.tobytes() for o in outs) == on_the_ring(world, inputs)


def test_of_two_aggregators_the_silent_one_is_lost_and_the_other_goes_on():
    """One of two aggregators cut off, no connection closing: the ranks find that one silent
    (the other answers), agree on it alone, and stripe the next collectives over the other."""
    world = 3
    inputs = [inputs_for(world, np.int32, seq) for seq in (20, 21)]
    fabric = fabric_with(world, aggregators=2, seed=20)
    outs = [post(fabric, 0, inputs[0])]
    steps(fabric, 60)
    fabric.silent.add(endpoint(1))
    fabric.run_timed()
    outs.append(post(fabric, 1, inputs[1]))
    fabric.run_timed()
    assert on_ring(fabric)[1] is False
    for s in fabric.sessions:
        assert s.lost == {endpoint(1): "198.18.0.2:7000"} and s.lanes == [0]
    assert any("silent for 2 s" in s.rounds[0].outcome for s in fabric.sessions)
    for seq in (0, 1):
        assert b"".join(o.tobytes() for o in outs[seq]) == on_the_ring(world, inputs[seq])


def test_an_aggregator_that_answers_is_not_lost_while_a_rank_is_slow():
    """One rank posts 5 s after the others: the aggregator answers their credit probes
    meanwhile, so nothing is lost and the aggregator sums it."""
    world = 3
    inputs = inputs_for(world, np.int32, 2)
    fabric = fabric_with(world, seed=2)
    outs = post(fabric, 0, inputs, ranks=[0, 1])
    fabric.run_timed(until=5.0)
    assert all(s.failover is None for s in fabric.sessions)
    outs[2] = post(fabric, 0, inputs, ranks=[2])[2]
    fabric.run_timed()
    finished(fabric)
    assert all(s.failover is None for s in fabric.sessions)
    assert b"".join(o.tobytes() for o in outs) == in_network(world, inputs)


def test_two_aggregators_one_lost_the_other_gives_its_pool_back():
    """Striped over two aggregators of two shards each, one dies: the other's partial
    reductions are withdrawn by every rank, so its pool is free; the results are the ring's."""
    world = 4
    inputs = inputs_for(world, np.int32, 4)
    fabric = fabric_with(world, aggregators=2, shards=2, seed=4)
    outs = post(fabric, 0, inputs)
    steps(fabric, 150)
    assert any(a.reductions("comm") for a in fabric.aggregators[2:])
    lose(fabric, [3], stripes=(0, 1))
    fabric.run_timed()
    assert on_ring(fabric) == {0: True}
    assert b"".join(o.tobytes() for o in outs) == on_the_ring(world, inputs)
    for survivor in fabric.aggregators[2:]:
        assert survivor.pool_bytes == 0 and not survivor.reductions("comm")


def test_one_of_two_aggregators_lost_the_other_takes_the_collectives_after():
    """Two aggregators of two shards each, one lost mid-reduction: what was in flight is redone
    on the ring, and the collectives posted after are striped over the survivor's two shards
    alone, its sums bit for bit those of the aggregators whole; the lost one hears nothing."""
    world = 4
    inputs = [inputs_for(world, np.float32, seq) for seq in range(3)]
    fabric = fabric_with(world, aggregators=2, shards=2, seed=11)
    outs = [post(fabric, 0, inputs[0])]
    steps(fabric, 150)
    lose(fabric, [1], stripes=(0, 1))
    fabric.run_timed()
    lost = fabric.aggregators[:2]
    heard = [dict(a.stats) for a in lost]
    outs += [post(fabric, 1, inputs[1]), post(fabric, 2, inputs[2])]
    fabric.run_timed()
    assert on_ring(fabric) == {0: True, 1: False, 2: False}
    assert [dict(a.stats) for a in lost] == heard
    for seq in (1, 2):
        assert b"".join(o.tobytes() for o in outs[seq]) == in_network(world, inputs[seq])
    for s in fabric.sessions:
        assert s.lanes == [2, 3] and s.stats["in_network_on_fewer_endpoints"] == 2
        assert "the 2 endpoints left (198.18.0.2:7000)" in s.rounds[0].outcome
    for survivor in fabric.aggregators[2:]:
        assert survivor.pool_bytes == 0 and not survivor.reductions("comm")


@pytest.mark.parametrize("together", [False, True])
def test_both_aggregators_lost_the_ring_takes_over(together):
    """Both aggregators lost: one after the other (two rounds of reports, the second once the
    survivor fails too) or together, each rank finding a different one first (one round naming
    both): every collective completes, exact, the later ones on the ring."""
    world = 4
    inputs = [inputs_for(world, np.int32, seq) for seq in range(3)]
    fabric = fabric_with(world, aggregators=2, seed=12)
    outs = [post(fabric, 0, inputs[0])]
    steps(fabric, 100)
    if together:
        fabric.silent.update((endpoint(0), endpoint(1)))
        for r in range(world):
            fabric.sessions[r].peer_lost(endpoint(r % 2))
    else:
        lose(fabric, [0], stripes=(0,))
        fabric.run_timed()
    outs.append(post(fabric, 1, inputs[1]))
    steps(fabric, 20)
    if not together:
        lose(fabric, [2], stripes=(1,))
    fabric.run_timed()
    outs.append(post(fabric, 2, inputs[2]))
    fabric.run_timed()
    ring = on_ring(fabric)
    assert ring[2]
    for seq in range(3):
        assert b"".join(o.tobytes() for o in outs[seq]) == on_the_ring(world, inputs[seq])
    for s in fabric.sessions:
        assert len(s.rounds) == (1 if together else 2) and not s.lanes
        assert set(s.lost.values()) == {"198.18.0.1:7000", "198.18.0.2:7000"}


def test_collectives_in_flight_posted_late_and_after_all_run_on_the_ring():
    """Collectives 0 and 1 in flight, 2 posted on some ranks only when the aggregator dies, 3
    posted after every rank decided: all redone or run on the ring, the same on every rank."""
    world = 4
    inputs = [inputs_for(world, np.int32, seq) for seq in range(4)]
    fabric = fabric_with(world, seed=1)
    outs = [post(fabric, 0, inputs[0]), post(fabric, 1, inputs[1])]
    outs.append(post(fabric, 2, inputs[2], ranks=[0, 1]))
    steps(fabric, 300)
    lose(fabric, [0])
    fabric.run()
    late = post(fabric, 2, inputs[2], ranks=[2, 3])
    outs[2][2:] = late[2:]
    fabric.run_timed()
    outs.append(post(fabric, 3, inputs[3]))
    fabric.run_timed()
    ring = on_ring(fabric)
    assert ring[2] and ring[3]
    assert [s.stats["in_network_on_ring"] for s in fabric.sessions] == [1, 1, 2, 2]
    for seq in range(4):
        if ring[seq]:
            assert b"".join(o.tobytes() for o in outs[seq]) == on_the_ring(world, inputs[seq])


def test_a_rank_lost_while_the_others_report_fails_the_job():
    """Rank 2 dies while the ranks report the aggregator's loss: not masked as the
    aggregator's, every other rank raises PeerFailureError naming it."""
    world = 4
    inputs = inputs_for(world, np.int32, 6)
    fabric = fabric_with(world, seed=6)
    post(fabric, 0, inputs)
    steps(fabric, 100)
    fabric.silent.add(2)
    lose(fabric, [0])
    fabric.run()
    for r in (0, 1, 3):
        fabric.sessions[r].peer_lost(2)
        assert isinstance(fabric.sessions[r].error, PeerFailureError)
        assert "rank 2" in str(fabric.sessions[r].error)


def test_a_rank_that_never_reports_times_out_naming_it():
    world = 3
    inputs = inputs_for(world, np.int32, 8)
    fabric = fabric_with(world, seed=8, timeout=5.0)
    post(fabric, 0, inputs)
    steps(fabric, 50)
    fabric.silent.add(1)
    lose(fabric, [0])
    fabric.run_timed(until=30.0)
    for r in (0, 2):
        error = fabric.sessions[r].error
        assert isinstance(error, CollectiveTimeoutError), error
        assert "reports of an aggregator's loss from rank 1" in str(error)


def test_a_report_that_does_not_parse_or_comes_twice_aborts():
    assert unpack_report(pack_report(endpoint(1), 9, [3, 7])) == (endpoint(1), 9,
                                                                  frozenset((3, 7)))
    for bad in (b"", pack_report(endpoint(0), 9, [3])[:-1], pack_report(endpoint(0), 3, [3])):
        with pytest.raises(ProtocolError):
            unpack_report(bad)
    for world, again in ((3, "twice"), (2, "again")):  # the round open, or decided
        fabric = fabric_with(world)
        report = pack_report(endpoint(0), 0, [])
        session = fabric.sessions[0]
        hdr = Header(Kind.FAILOVER, 0, 0, 0, 1, 0, 0, len(report), 0)
        session.receive(hdr, memoryview(report), 0.0, False)
        assert session.failover is not None and session.error is None
        session.receive(hdr, memoryview(report), 0.0, False)
        assert isinstance(session.error, ProtocolError) and again in str(session.error)
    session = fabric_with(2).sessions[0]
    report = pack_report(endpoint(1), 0, [])  # one aggregator of one endpoint: no endpoint 1
    session.receive(Header(Kind.FAILOVER, 0, 0, 0, 1, 0, 0, len(report), 0),
                    memoryview(report), 0.0, False)
    assert isinstance(session.error, ProtocolError) and "no aggregator's" in str(session.error)


# -- on the emulated cluster: real ranks, a real aggregator killed --------------------------

def reduce_through_a_loss(rank: int, collectives: int, count: int, pid: int, signum: int):
    """`collectives` in-network ReduceScatters posted at once, rank 0 stopping or killing the
    aggregator (`pid`) once it has posted them, with them in flight; then one more in-network
    ReduceScatter, posted once the ranks agreed what took over. Odd ranks make the loss's
    warning an error (as `python -W error` would), even ones record it."""
    import warnings

    import overcast
    from overcast.bench.rank import expected_sum, pattern
    with warnings.catch_warnings(record=True) as said, \
            overcast.Communicator(name="failover", timeout=30) as comm:
        warnings.simplefilter("error" if rank % 2 else "always", overcast.AggregatorLostWarning)
        world = comm.world_size
        grads, want = pattern(rank, count, world), expected_sum(rank, count, world)
        outs = [np.zeros(count, np.float32) for _ in range(collectives)]
        works = [comm.reduce_scatter(out, grads, algorithm="innetwork", async_op=True)
                 for out in outs]
        if rank == 0:
            os.kill(pid, signum)
        for work in works:
            work.wait()
        after = np.zeros(count, np.float32)  # on the ring now
        comm.reduce_scatter(after, grads, algorithm="innetwork")
        counters = comm.counters()
        return {"exact": [np.array_equal(o, want) for o in outs + [after]],
                "fallback": comm.in_network_fallback,
                "warned": [str(w.message) for w in said
                           if w.category is overcast.AggregatorLostWarning],
                "counters": {k: counters.get(k, 0) for k in
                             ("aggregators_lost", "in_network_redone_on_ring",
                              "in_network_complete_at_failover", "in_network_on_ring",
                              "in_network_on_fewer_endpoints")}}


@root_only
@pytest.mark.parametrize("signum,aggregators", [(signal.SIGKILL, 1), (signal.SIGSTOP, 1),
                                                (signal.SIGKILL, 2)])
def test_an_aggregator_killed_or_stopped_mid_job_the_ranks_go_on_exact(tmp_path, signum,
                                                                      aggregators):
    """Killed (its connection closes) or stopped (silent: lost after the 2 s bound), the only
    aggregator or one of two: every collective in flight completes on every rank, exact, the
    next runs on the ring or the survivor, and every rank names the aggregator; the survivor's
    pool is free."""
    from overcast.cluster.netns import Cluster
    with Cluster(4, 400_000_000, aggregators=aggregators) as cluster:
        procs = cluster.start_aggregators(stats_dir=str(tmp_path))
        lost = cluster.aggregator_addresses.split(",")[0]
        try:
            results = cluster.run(reduce_through_a_loss, timeout=300,
                                  args=(6, 1 << 20, procs[0].pid, signum))
        finally:
            if signum == signal.SIGSTOP:
                os.kill(procs[0].pid, signal.SIGCONT)
            procs[0].kill()
            for proc in procs:
                cluster.stop_aggregator(proc)
    for rank, r in enumerate(results):
        assert all(r["exact"]), r
        assert lost in r["fallback"], r["fallback"]
        assert r["warned"] == ([] if rank % 2 else [f"rank {rank} {r['fallback']}"]), r
        assert r["counters"]["aggregators_lost"] == 1
        counts = r["counters"]
        if aggregators == 1:  # the ring, for the last at least
            assert counts["in_network_redone_on_ring"] + counts["in_network_on_ring"] >= 1, r
        else:  # the last, posted once every rank agreed, on the aggregator left
            assert counts["in_network_on_fewer_endpoints"] == 1, r
    if signum == signal.SIGSTOP:
        assert any("silent for 2 s" in r["fallback"] for r in results)
    for a in range(1, aggregators):
        with open(tmp_path / f"aggregator-{a}.json") as f:
            survivor = json.load(f)
        assert survivor["pool_bytes"] == 0, survivor
