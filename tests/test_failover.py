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
from overcast.protocols.failover import NO_LOSS, RingInstead, pack_rejoin, pack_report, \
    unpack_report
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


# -- an aggregator restarted: taken back ----------------------------------------------------

def restart(fabric: Fabric, stripes=(0,)) -> None:
    """The aggregator of endpoints `stripes` comes back at its address: a new instance, none of
    the old one's state."""
    for stripe in stripes:
        fabric.aggregators[stripe] = Aggregator(slots=8)
        fabric.aggregators[stripe].register(fabric.key, fabric.world, stripe=stripe)
        fabric.silent.discard(endpoint(stripe))


def register_anew(fabric: Fabric, ranks, stripes=(0,)) -> None:
    for r in ranks:
        assert fabric.sessions[r].aggregator_registered(endpoint(stripes[0]), fabric.now)


def kinds(fabric: Fabric) -> dict[int, str]:
    """How each collective ran ("ring" or "innetwork"), the same on every rank."""
    return {seq: "ring" if ring else "innetwork" for seq, ring in on_ring(fabric).items()}


@pytest.mark.parametrize("seed", range(4))
def test_a_restarted_aggregator_is_taken_back_where_every_rank_agrees(seed):
    """Lost, then restarted and registered with anew by the ranks one by one while they post
    at their own pace: taken back once the last has, at one collective every rank agrees on;
    what was in flight then is the ring's, what follows the new instance's, bit for bit the
    sums an aggregator never lost gives."""
    world = 4
    inputs = [inputs_for(world, np.int32, 10 * seed + seq) for seq in range(6)]
    fabric = fabric_with(world, seed=seed)
    outs = [post(fabric, 0, inputs[0])]
    steps(fabric, 60)
    lose(fabric, [seed % world])
    fabric.run_timed()
    outs.append(post(fabric, 1, inputs[1]))
    restart(fabric)
    register_anew(fabric, [0, 1, 2])
    fabric.run()
    assert all(len(s.rounds) == 1 for s in fabric.sessions)  # not every rank yet: no round
    outs.append(post(fabric, 2, inputs[2], ranks=[0, 1]))
    register_anew(fabric, [3])
    for _ in range(20 * seed):  # the clock stands still: no rank times out the late ones
        fabric.step()
    outs[2][2:] = post(fabric, 2, inputs[2], ranks=[2, 3])[2:]  # late here, maybe reported
    fabric.run_timed()
    outs += [post(fabric, seq, inputs[seq]) for seq in (3, 4)]
    fabric.run_timed()
    ran = kinds(fabric)
    assert ran[0] == ran[1] == "ring" and ran[3] == ran[4] == "innetwork"
    (boundary,) = {s.rounds[1].posted for s in fabric.sessions}
    assert all(ran[seq] == ("innetwork" if seq >= boundary else "ring") for seq in ran)
    for seq, out in enumerate(outs):
        assert b"".join(o.tobytes() for o in out) == in_network(world, inputs[seq])
    for s in fabric.sessions:
        assert s.stats["aggregators_lost"] == s.stats["aggregators_taken_back"] == 1
        assert not s.lost and s.lanes == [0] and not s.registered_anew
        assert "took back the aggregator at 198.18.0.1:7000" in s.rounds[1].outcome
        assert "the 1 endpoints (198.18.0.1:7000)" in s.rounds[1].outcome
        assert not s.rounds[1].still_lost and s.rounds[0].still_lost
    assert fabric.aggregators[0].stats["results"] > 0
    assert fabric.aggregators[0].pool_bytes == 0


def test_a_round_that_does_not_take_it_back_ends_every_registration_and_the_next_does():
    """Of two aggregators, A lost and restarted, two ranks registered with it anew when B is
    lost: that round takes nothing back and ends both registrations on every rank alike; once
    all four register again, A is taken back, and it alone runs what follows."""
    world = 4
    inputs = [inputs_for(world, np.int32, seq) for seq in range(3)]
    fabric = fabric_with(world, aggregators=2, seed=5)
    lose(fabric, [0], stripes=(0,))
    fabric.run_timed()
    restart(fabric, stripes=(0,))
    register_anew(fabric, [1, 2])
    lose(fabric, [3], stripes=(1,))
    fabric.run_timed()
    for s in fabric.sessions:
        assert len(s.rounds) == 2 and not s.rounds[1].back and not s.registered_anew
        assert set(s.lost) == {endpoint(0), endpoint(1)} and not s.lanes
    outs = [post(fabric, 0, inputs[0])]
    fabric.run_timed()
    register_anew(fabric, range(world))
    fabric.run_timed()
    outs += [post(fabric, seq, inputs[seq]) for seq in (1, 2)]
    fabric.run_timed()
    assert kinds(fabric) == {0: "ring", 1: "innetwork", 2: "innetwork"}
    for seq, out in enumerate(outs):
        assert b"".join(o.tobytes() for o in out) == in_network(world, inputs[seq])
    for s in fabric.sessions:
        assert len(s.rounds) == 3 and s.lanes == [0] and set(s.lost) == {endpoint(1)}
        assert s.stats["aggregators_taken_back"] == 1 and s.rounds[2].still_lost
    assert fabric.aggregators[0].stats["results"] > 0


def test_a_registration_anew_that_closes_before_the_round_is_not_taken_back():
    """A rank's new registration closes (the new instance died too) after every rank said it
    had registered: its report names nothing back, so nothing is, alike on every rank; the rank
    registers again, and then it is."""
    world = 3
    fabric = fabric_with(world)
    lose(fabric, [0])
    fabric.run_timed()
    restart(fabric)
    register_anew(fabric, [1, 2])
    fabric.run_timed()
    fabric.sessions[1].registration_closed(endpoint(0))  # before rank 0 registers and reports
    register_anew(fabric, [0])
    fabric.run_timed()
    for s in fabric.sessions:
        assert len(s.rounds) == 2 and not s.rounds[1].back and endpoint(0) in s.lost
        assert "took back no aggregator" in s.rounds[1].outcome
    register_anew(fabric, range(world))
    fabric.run_timed()
    for s in fabric.sessions:
        assert len(s.rounds) == 3 and s.rounds[2].back and not s.lost


@pytest.mark.parametrize("seed", range(3))
def test_a_take_back_agreed_as_the_new_instance_dies_is_found_lost_at_once(seed):
    """Every rank reported its new registration, then the new instance dies (each rank's new
    connection closes) before the round decides: the round takes it back, and each rank finds it
    lost again as it decides, without waiting for its silence; the next collective runs on the
    ring at once, exact."""
    world = 3
    fabric = fabric_with(world, seed=seed)
    lose(fabric, [0])
    fabric.run_timed()
    restart(fabric)
    register_anew(fabric, range(world))
    while not all(s.failover is not None and s.failover.number == 1 and s.rank in
                  s.failover.reports for s in fabric.sessions):
        assert fabric.step()
    fabric.silent.add(endpoint(0))
    for s in fabric.sessions:
        s.registration_closed(endpoint(0))
    fabric.run()  # the clock stands still: nothing waits out a bound
    for s in fabric.sessions:
        assert s.epoch == 3 and s.rounds[1].back and s.rounds[2].lost and endpoint(0) in s.lost
    inputs = inputs_for(world, np.int32, seed)
    outs = post(fabric, 0, inputs)
    start = fabric.now
    fabric.run_timed()
    assert fabric.now == start and kinds(fabric) == {0: "ring"}
    assert b"".join(o.tobytes() for o in outs) == in_network(world, inputs)


def test_the_old_instances_connection_closing_late_is_not_a_new_registration_closing():
    """The killed instance's connection closes on ranks 1 and 2 only after the round that agreed
    it lost (rank 0 found it first): nothing more happens, and the take-back after is the last
    round."""
    fabric = fabric_with(3)
    lose(fabric, [0])
    fabric.run_timed()
    for s in fabric.sessions[1:]:
        s.peer_lost(endpoint(0), "198.18.0.1:7000")
    restart(fabric)
    register_anew(fabric, range(3))
    fabric.run_timed()
    for s in fabric.sessions:
        assert s.epoch == 2 and not s.lost and s.error is None
        assert s.stats["aggregators_lost"] == s.stats["aggregators_taken_back"] == 1


def test_an_aggregator_back_that_cannot_be_taken_back_is_said_once_per_reason():
    fabric = fabric_with(2)
    lose(fabric, [0, 1])
    fabric.run_timed()
    session = fabric.sessions[0]
    session.notices.clear()
    for why in ("it offers 2 endpoints", "it offers 2 endpoints", "it grants 4 slots"):
        session.cannot_take_back(endpoint(0), why)
    assert session.notices == [f"rank 0: the aggregator at 198.18.0.1:7000 answers again but "
                               f"cannot be taken back: {why}" for why in
                               ("it offers 2 endpoints", "it grants 4 slots")]


def test_taken_back_then_lost_again_the_ring_takes_over_again():
    """Lost, taken back, lost again: each time every rank agrees, and the counters say so."""
    world = 4
    inputs = [inputs_for(world, np.int32, 40 + seq) for seq in range(4)]
    fabric = fabric_with(world, seed=3)
    outs = []
    for seq in range(2):
        outs.append(post(fabric, 2 * seq, inputs[2 * seq]))
        steps(fabric, 50)
        lose(fabric, [seq])
        fabric.run_timed()
        restart(fabric)
        register_anew(fabric, range(world))
        fabric.run_timed()
        outs.append(post(fabric, 2 * seq + 1, inputs[2 * seq + 1]))
        fabric.run_timed()
    assert kinds(fabric) == {0: "ring", 1: "innetwork", 2: "ring", 3: "innetwork"}
    for seq, out in enumerate(outs):
        assert b"".join(o.tobytes() for o in out) == in_network(world, inputs[seq])
    for s in fabric.sessions:
        assert s.stats["aggregators_lost"] == s.stats["aggregators_taken_back"] == 2
        assert s.epoch == 4 and not s.lost


def test_a_registration_with_an_aggregator_not_lost_is_not_wanted():
    fabric = fabric_with(2)
    assert not fabric.sessions[0].aggregator_registered(endpoint(0), 0.0)
    assert not fabric.sessions[0].registered_anew


def test_a_report_that_does_not_parse_or_comes_twice_aborts():
    assert unpack_report(pack_report(endpoint(1), [endpoint(2)], 9, [3, 7])) == \
        (endpoint(1), frozenset([endpoint(2)]), 9, frozenset((3, 7)))
    for bad in (b"", pack_report(endpoint(0), [], 9, [3])[:-1],
                pack_report(endpoint(0), [], 3, [3]),
                pack_report(NO_LOSS, [endpoint(0)], 3, [])[:-2],
                pack_report(NO_LOSS, [endpoint(0), endpoint(0)], 3, [])):
        with pytest.raises(ProtocolError):
            unpack_report(bad)
    for world, again in ((3, "twice"), (2, "again")):  # the round open, or decided
        fabric = fabric_with(world)
        report = pack_report(endpoint(0), [], 0, [])
        session = fabric.sessions[0]
        hdr = Header(Kind.FAILOVER, 0, 0, 0, 1, 0, 0, len(report), 0)
        session.receive(hdr, memoryview(report), 0.0, False)
        assert session.failover is not None and session.error is None
        session.receive(hdr, memoryview(report), 0.0, False)
        assert isinstance(session.error, ProtocolError) and again in str(session.error)
    # one aggregator of one endpoint: no endpoint 1, lost or taken back, and no REJOIN for it
    for kind, bad in ((Kind.FAILOVER, pack_report(endpoint(1), [], 0, [])),
                      (Kind.FAILOVER, pack_report(NO_LOSS, [endpoint(1)], 0, [])),
                      (Kind.REJOIN, pack_rejoin(endpoint(1))), (Kind.REJOIN, b"\0")):
        session = fabric_with(2).sessions[0]
        session.receive(Header(kind, 0, 0, 0, 1, 0, 0, len(bad), 0), memoryview(bad), 0.0, False)
        assert isinstance(session.error, ProtocolError), (kind, bad)


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
        after = np.zeros(count, np.float32)  # on the ring now, or the aggregator left
        before = comm.counters()
        comm.reduce_scatter(after, grads, algorithm="innetwork")
        counters = comm.counters()
        last = {k: counters[k] - before[k] for k in ("in_network_on_ring",
                                                      "in_network_on_fewer_endpoints")}
        return {"exact": [np.array_equal(o, want) for o in outs + [after]],
                "fallback": comm.in_network_fallback,
                "warned": [str(w.message) for w in said
                           if w.category is overcast.AggregatorLostWarning],
                "last": last,
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
        # the last, posted once every rank agreed: on the ring, or on the aggregator left (those
        # in flight as the ranks' engines had posted them when they reported: complete, redone
        # or run on the ring, or, posted by no rank yet, on what is left)
        expected = {"in_network_on_ring": 1, "in_network_on_fewer_endpoints": 0} \
            if aggregators == 1 else {"in_network_on_ring": 0, "in_network_on_fewer_endpoints": 1}
        assert r["last"] == expected, r
    if signum == signal.SIGSTOP:
        assert any("silent for 2 s" in r["fallback"] for r in results)
    for a in range(1, aggregators):
        with open(tmp_path / f"aggregator-{a}.json") as f:
            survivor = json.load(f)
        assert survivor["pool_bytes"] == 0, survivor


def reduce_through_a_restart(rank: int, count: int, kill_path: str):
    """An in-network ReduceScatter on the aggregator; then, once rank 0 has asked for it to be
    killed and restarted, more of them (on the ring while it is lost) until every rank has
    taken it back, the ranks agreeing when by an all_reduce; then one more, on it again."""
    import warnings

    import overcast
    from overcast.bench.rank import expected_sum, pattern
    with warnings.catch_warnings(), overcast.Communicator(name="restart", timeout=30) as comm:
        warnings.simplefilter("ignore", overcast.AggregatorLostWarning)
        world = comm.world_size
        grads, want = pattern(rank, count, world), expected_sum(rank, count, world)
        out = np.zeros(count, np.float32)
        exact = []
        for calls in range(600):
            comm.reduce_scatter(out, grads, algorithm="innetwork")
            exact.append(np.array_equal(out, want))
            if rank == 0 and calls == 0:
                with open(kill_path, "w") as f:
                    f.write("kill")
            back = np.array([comm.counters()["aggregators_taken_back"]], np.float32)
            comm.all_reduce(back, op="min")
            if back[0] >= 1:
                break
        before = comm.counters()
        comm.reduce_scatter(out, grads, algorithm="innetwork")
        exact.append(np.array_equal(out, want))
        after = comm.counters()
        return {"exact": exact, "fallback": comm.in_network_fallback,
                "rounds": [r.outcome for r in comm._engine.session.rounds],
                "boundaries": [r.posted for r in comm._engine.session.rounds],
                "on_ring": after["in_network_on_ring"] - before["in_network_on_ring"],
                "counters": {k: after[k] for k in ("aggregators_lost", "aggregators_taken_back",
                                                   "in_network_redone_on_ring")}}


@root_only
def test_an_aggregator_killed_and_restarted_is_taken_back_exact(tmp_path):
    """The only aggregator killed after the first collective and started again at its address:
    the ranks go on on the ring, register with the new instance, and take it back at one
    collective every rank agrees on; every result is exact, the last runs on the new instance."""
    import threading

    from overcast.cluster.netns import Cluster
    kill_path = tmp_path / "kill"
    with Cluster(4, 400_000_000) as cluster:
        aggregators = cluster.start_aggregators(stats_dir=str(tmp_path))
        restarted = threading.Event()

        def kill_and_restart():
            while not kill_path.exists():  # rank 0 asks, once its first collective is done
                if restarted.wait(0.01):
                    return
            aggregators[0].kill()
            aggregators[0].wait()
            cluster.stop_aggregator(aggregators[0])
            aggregators[0] = cluster.start_aggregator(
                stats_path=str(tmp_path / "aggregator-0.json"))
            restarted.set()
        killer = threading.Thread(target=kill_and_restart, daemon=True)
        killer.start()
        try:
            results = cluster.run(reduce_through_a_restart, timeout=300,
                                  args=(1 << 18, str(kill_path)))
        finally:
            restarted.set()
            killer.join()
            cluster.stop_aggregator(aggregators[0])
    with open(tmp_path / "aggregator-0.json") as f:
        second = json.load(f)
    assert len({len(r["exact"]) for r in results}) == 1
    for r in results:
        assert all(r["exact"]) and r["fallback"] is None and r["on_ring"] == 0, r
        assert r["counters"]["aggregators_lost"] == r["counters"]["aggregators_taken_back"] == 1
        assert len(r["rounds"]) == 2 and "took back the aggregator" in r["rounds"][1], r
    assert len({tuple(r["boundaries"]) for r in results}) == 1  # alike on every rank
    assert second["stats"]["contributions"] > 0 and second["pool_bytes"] == 0, second
