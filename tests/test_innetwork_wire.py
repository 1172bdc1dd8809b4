"""In-network ReduceScatter through a real aggregator process on the emulated cluster: sums under
injected loss, a dying aggregator, one of two that dies or cannot be reached (named), ranks that
name two in different orders, a rank killed mid-reduction, two communicators at once, memory
within the pool, and the pair."""

import json
import os
import signal

import numpy as np
import pytest

import overcast
from conftest import root_only
from overcast.cluster.launch import RankError
from overcast.cluster.netns import Cluster, aggregator_address
from overcast.limits import LOWEST_MTU
from overcast.transport.loss import LossSpec
from overcast.wire.registration import DEFAULT_AGGREGATOR_PORT

pytestmark = root_only
LOSSES = [LossSpec(0.0), LossSpec(0.01, seed=1), LossSpec(0.10, seed=2),
          LossSpec(0.05, burst=16, seed=3)]


def inputs(rank, world, count, dtype):
    rng = np.random.default_rng(rank * 7919 + count)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(world * count).astype(dtype)
    return rng.integers(-10_000, 10_000, world * count).astype(dtype)


def sums(rank, sizes):
    """Every size, dtype and loss setting; returns failures (empty when all are right)."""
    failures = []
    for i, loss in enumerate(LOSSES):
        with overcast.Communicator(name=f"loss{i}", timeout=60, loss=loss) as comm:
            world = comm.world_size
            for count in sizes:
                for dtype in (np.int32, np.int64, np.float32, np.float16):
                    out = np.empty(count, dtype)
                    comm.reduce_scatter(out, inputs(rank, world, count, dtype),
                                        algorithm="innetwork")
                    mine = slice(rank * count, (rank + 1) * count)
                    exact = sum(inputs(r, world, count, np.float64 if
                                       np.dtype(dtype).kind == "f" else np.int64)[mine]
                                for r in range(world))
                    if np.dtype(dtype).kind == "f":
                        ref = sum(inputs(r, world, count, dtype)[mine].astype(np.float64)
                                  for r in range(world))
                        eps = float(np.finfo(dtype).eps)
                        ok = np.allclose(out.astype(np.float64), ref, rtol=0,
                                         atol=4 * world * eps * (1 + np.abs(ref).max()))
                    else:
                        ok = np.array_equal(out, exact.astype(dtype))
                    if not ok:
                        failures.append(f"{np.dtype(dtype)} x {count} at loss {loss.rate}")
            comm.barrier()
    return failures


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_sums_under_loss(world):
    sizes = [1, 1000, 100_003] + ([1 << 20] if world <= 3 else [])
    with Cluster(world, 1_000_000_000) as cluster:
        aggregator = cluster.start_aggregator()
        results = cluster.run(sums, args=(sizes,), timeout=900)
        cluster.stop_aggregator(aggregator)
    assert results == [[] for _ in range(world)]


def smallest_path(rank):
    """In-network ReduceScatter where a datagram carries 24 bytes of data: many results to
    acknowledge, and credit naming many chunks, each in datagrams the path takes."""
    with overcast.Communicator(timeout=20, link_bits_per_s=1e9) as comm:
        world, right = comm.world_size, []
        for dtype in (np.float32, np.int64):
            out = np.empty(3000, dtype)
            comm.reduce_scatter(out, np.arange(world * 3000, dtype=dtype) + rank,
                                algorithm="innetwork")
            mine = np.arange(rank * 3000, (rank + 1) * 3000, dtype=dtype)
            right.append(bool(np.array_equal(out, mine * world + sum(range(world)))))
        return [comm.chunk_bytes, right, comm.counters()["drops"].get("send_error", 0)]


def test_in_network_reduction_at_the_smallest_mtu():
    with Cluster(2, 1_000_000_000, mtu=LOWEST_MTU) as cluster:
        aggregator = cluster.start_aggregator()
        results = cluster.run(smallest_path, timeout=120)
        cluster.stop_aggregator(aggregator)
    for chunk, right, send_errors in results:
        assert right == [True, True] and send_errors == 0, (chunk, right, send_errors)


def kill_mid_reduction(rank, killer, pid=None):
    """Rank `killer` kills process `pid` (itself if None, once its contributions are going)
    while an in-network ReduceScatter is in flight; returns how it ended on this rank: "ok",
    why in-network reduction falls back (an aggregator lost), whether the sums are exact; or
    the error's class and message."""
    comm = overcast.Communicator(timeout=30)
    try:
        comm.barrier()
        out = np.empty(8 << 20, np.int32)
        work = comm.reduce_scatter(out, np.ones(comm.world_size * (8 << 20), np.int32),
                                   algorithm="innetwork", async_op=True)
        if rank == killer:
            while pid is None and not comm.counters().get("datagrams_out"):
                pass
            os.kill(pid or os.getpid(), signal.SIGKILL)
        try:
            work.wait()
            return ["ok", comm.in_network_fallback, bool((out == comm.world_size).all())]
        except overcast.OvercastError as err:
            return [type(err).__name__, str(err)]
    finally:
        comm.close()


def test_a_dead_aggregator_mid_reduction_is_survived_on_every_rank():
    """The aggregator killed mid-reduction: every rank completes it on the ring, exact, and
    names the aggregator (protocols.failover; tests/test_failover.py has the cases)."""
    with Cluster(3, 200_000_000) as cluster:
        aggregator = cluster.start_aggregator()
        results = cluster.run(kill_mid_reduction, args=(0, aggregator.pid), timeout=60)
    for name, fallback, exact in results:
        assert name == "ok" and exact, fallback
        assert f"lost the aggregator at {cluster.aggregator_addresses} " in fallback, fallback


def innetwork_refusal(rank):
    """Why this rank's in-network ReduceScatter failed."""
    with overcast.Communicator(timeout=30) as comm:
        world = comm.world_size
        try:
            comm.reduce_scatter(np.empty(1000, np.int64), inputs(rank, world, 1000, np.int64),
                                algorithm="innetwork")
        except overcast.OvercastError as err:
            return str(err)
        return ""


def test_an_aggregator_of_two_that_cannot_be_reached_is_named_on_every_rank():
    with Cluster(3, 200_000_000, aggregators=2) as cluster:
        aggregator = cluster.start_aggregator(aggregator=0)
        missing = f"{aggregator_address(1)}:{DEFAULT_AGGREGATOR_PORT}"
        results = cluster.run(innetwork_refusal, timeout=60,
                              env={"OVERCAST_AGGREGATORS":
                                   f"{cluster.aggregator_addresses},{missing}"})
        cluster.stop_aggregator(aggregator)
    for refused in results:
        assert f"unavailable: cannot reach the aggregator at {missing}" in refused, refused


def innetwork_refusal_reversed(rank, spec):
    """innetwork_refusal, rank 2 naming the aggregators in the other order."""
    if rank == 2:
        os.environ["OVERCAST_AGGREGATORS"] = ",".join(reversed(spec.split(",")))
    return innetwork_refusal(rank)


def test_ranks_that_name_the_aggregators_in_different_orders_are_refused_saying_so():
    with Cluster(3, 200_000_000, aggregators=2) as cluster:
        procs = cluster.start_aggregators(shards=1)
        results = cluster.run(innetwork_refusal_reversed, args=(cluster.aggregator_addresses,),
                              timeout=60)
        for aggregator in procs:
            cluster.stop_aggregator(aggregator)
    for refused in results:
        assert "refused this communicator" in refused and \
            "must name the same aggregators in the same order on every rank" in refused, refused


def test_one_dead_aggregator_of_two_is_named_on_every_rank():
    with Cluster(3, 200_000_000, aggregators=2) as cluster:
        procs = cluster.start_aggregators(shards=2)
        first, second = cluster.aggregator_addresses.split(",")
        results = cluster.run(kill_mid_reduction, args=(0, procs[1].pid), timeout=60)
        cluster.stop_aggregator(procs[0])
    for name, fallback, exact in results:
        assert name == "ok" and exact, fallback
        assert f"lost the aggregator at {second} " in fallback, fallback
        assert f"the 2 endpoints left ({first})" in fallback, fallback


def two_at_once(rank):
    """Two communicators of one job, each with an in-network ReduceScatter in flight."""
    a = overcast.Communicator(name="a", timeout=60)
    b = overcast.Communicator(name="b", timeout=60)
    try:
        world = a.world_size
        xa, xb = inputs(rank, world, 50_000, np.int64), inputs(rank + 100, world, 70_000,
                                                                np.int64)
        oa, ob = np.empty(50_000, np.int64), np.empty(70_000, np.int64)
        wa = a.reduce_scatter(oa, xa, algorithm="innetwork", async_op=True)
        wb = b.reduce_scatter(ob, xb, algorithm="innetwork", async_op=True)
        wa.wait()
        wb.wait()
        ea = sum(inputs(r, world, 50_000, np.int64) for r in range(world))
        eb = sum(inputs(r + 100, world, 70_000, np.int64) for r in range(world))
        return [bool(np.array_equal(oa, ea[rank * 50_000:(rank + 1) * 50_000])),
                bool(np.array_equal(ob, eb[rank * 70_000:(rank + 1) * 70_000]))]
    finally:
        a.close()
        b.close()


def test_two_communicators_share_the_aggregator():
    with Cluster(3, 400_000_000) as cluster:
        aggregator = cluster.start_aggregator()
        results = cluster.run(two_at_once, timeout=120)
        cluster.stop_aggregator(aggregator)
    assert results == [[True, True]] * 3


OTHER_JOB = "ab" * 32


def two_jobs(rank):
    """Two jobs' communicators (different secrets) through one aggregator, and a third job the
    aggregator does not serve."""
    mine = overcast.Communicator(name="mine", timeout=60)
    other = overcast.Communicator(name="other", timeout=60, secret=bytes.fromhex(OTHER_JOB))
    stranger = overcast.Communicator(name="stranger", timeout=60, secret=b"s" * 32)
    try:
        world = mine.world_size
        x = inputs(rank, world, 30_000, np.float32)
        o1, o2 = np.empty(30_000, np.float32), np.empty(30_000, np.float32)
        w1 = mine.reduce_scatter(o1, x, op="avg", algorithm="innetwork", async_op=True)
        w2 = other.reduce_scatter(o2, x, op="avg", algorithm="innetwork", async_op=True)
        w1.wait()
        w2.wait()
        try:
            stranger.reduce_scatter(np.empty(10, np.int32), np.zeros(world * 10, np.int32),
                                    algorithm="innetwork")
            refused = ""
        except overcast.InvalidArgumentError as err:
            refused = str(err)
        mean = sum(inputs(r, world, 30_000, np.float64) for r in range(world))[
            rank * 30_000:(rank + 1) * 30_000] / world
        close = lambda o: bool(np.allclose(o, mean, rtol=0, atol=1e-5))  # noqa: E731
        return [close(o1), close(o2), o1.tobytes() == o2.tobytes(), refused]
    finally:
        for comm in (mine, other, stranger):
            comm.close()


def test_jobs_with_different_secrets_share_the_aggregator_and_strangers_are_refused():
    with Cluster(3, 400_000_000) as cluster:
        aggregator = cluster.start_aggregator(secrets=[cluster.secret, OTHER_JOB])
        results = cluster.run(two_jobs, timeout=120)
        cluster.stop_aggregator(aggregator)
    for avg_mine, avg_other, same_bits, refused in results:
        assert avg_mine and avg_other and same_bits
        assert "in-network reduction is unavailable" in refused
        assert "did not authenticate" in refused or "failed" in refused


def big_reduction(rank, count):
    with overcast.Communicator(timeout=60, loss=LossSpec(0.01, seed=rank)) as comm:
        out = np.empty(count, np.float32)
        comm.reduce_scatter(out, np.ones(comm.world_size * count, np.float32),
                            algorithm="innetwork")
        return bool((out == comm.world_size).all())


def test_the_aggregator_stays_within_its_pool(tmp_path):
    """One shard's pool (each shard of several holds one of its own: the budget counts them)."""
    slots, world, count = 16, 4, 4 << 20  # 64 MiB of input per rank: over 100 times the pool
    stats = tmp_path / "aggregator.json"
    with Cluster(world, 1_000_000_000) as cluster:
        aggregator = cluster.start_aggregator(slots=slots, stats_path=str(stats), shards=1)
        assert cluster.run(big_reduction, args=(count,), timeout=300) == [True] * world
        cluster.stop_aggregator(aggregator)
    report = json.loads(stats.read_text())
    pool = slots * world * 8912  # slots x rows x the largest chunk, in its one shard
    assert report["peak_pool_bytes"] <= pool
    assert report["peak_pool_bytes"] * 100 < world * count * 4
    assert report["stats"]["contributions"] >= world * (world - 1) * (count * 4 // 8912)


def test_a_rank_killed_mid_reduction_leaves_nothing_in_the_aggregator(tmp_path):
    """The reduction's slots hold the dead rank's half-finished chunks; the others fail with the
    peer named, close, and with the communicator's last connection gone the aggregator frees
    its pool and forgets the communicator."""
    stats = tmp_path / "aggregator.json"
    with Cluster(3, 200_000_000) as cluster:
        aggregator = cluster.start_aggregator(stats_path=str(stats))
        with pytest.raises(RankError) as info:
            cluster.run(kill_mid_reduction, args=(2,), timeout=60)
        cluster.stop_aggregator(aggregator)
    assert list(info.value.failures) == [2]
    for name, message in info.value.results[:2]:
        assert name == "PeerFailureError" and "rank 2" in message, message
    report = json.loads(stats.read_text())
    assert report["stats"]["contributions"] > 0 and "reductions" not in report["stats"]
    assert report["peak_pool_bytes"] > 0
    assert report["pool_bytes"] == 0 and report["communicators"] == 0


def test_sums_striped_over_two_aggregators_of_two_shards_each(tmp_path):
    """Two aggregators, each on an attachment of its own with two shard threads: the ranks
    stripe every reduction over the four endpoints; the sums are right under loss, and each
    aggregator, each of its shards, takes its share of the contributions and of the bytes."""
    world = 4
    with Cluster(world, 1_000_000_000, aggregators=2) as cluster:
        procs = cluster.start_aggregators(stats_dir=str(tmp_path), shards=2)
        assert cluster.aggregator_addresses.count(",") == 1
        before = [cluster.counters(None, a).rx_bytes for a in range(2)]
        results = cluster.run(sums, args=([1000, 100_003],), timeout=900)
        carried = [cluster.counters(None, a).rx_bytes - before[a] for a in range(2)]
        reports = cluster.stop_aggregators(procs, str(tmp_path))
    assert results == [[] for _ in range(world)]
    taken = [r["stats"]["contributions"] for r in reports]
    assert min(taken) > 0.8 * max(taken), taken
    assert all(r["shards"] == 2 and min(r["shard_cpu_seconds"]) > 0 for r in reports)
    assert all(r["pool_bytes"] == 0 and r["communicators"] == 0 for r in reports)
    assert min(carried) > 0.8 * max(carried), carried
