"""The flow-level simulator held to closed forms: floors, byte counts, fairness, oversubscription,
and the authors' traffic anchors; and `overcast simulate`'s contract."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import widest
from overcast.schedules import cost
from overcast.sim.collectives import ALGORITHMS as SIM_ALGORITHMS
from overcast.sim.engine import AggregatorPool, Engine, pool_for
from overcast.sim.fairness import max_min_rates
from overcast.sim.run import compare, simulate
from overcast.sim.topology import fat_tree, placement, star

MIB = 1 << 20
PAIRS = sorted((c, a) for c, algorithms in SIM_ALGORITHMS.items() for a in algorithms)


def expected_seconds(collective, algorithm, n, p, b):
    """Bandwidth-optimal algorithms take their floor; the ring pair takes 2N(P-1)/B."""
    if (collective, algorithm) == ("overlap", "ring"):
        return 2 * n * (p - 1) / b
    return cost.floor_seconds(collective, n, p, b)


@pytest.mark.parametrize("p", [2, 3, 8, 64])
@pytest.mark.parametrize("collective,algorithm", PAIRS)
def test_single_switch_meets_the_closed_forms(collective, algorithm, p):
    n, bits = 64 * MIB, 100e9
    row = simulate(collective, algorithm, star(p, bits), n)
    assert row["seconds"] == pytest.approx(expected_seconds(collective, algorithm, n, p, bits / 8),
                                           rel=0.01)
    sent, received = cost.traffic(collective, algorithm, n, p)
    assert row["tx_bytes_per_nic_max"] == sent == row["tx_bytes_per_nic_mean"]
    assert row["rx_bytes_per_nic_max"] == received == row["rx_bytes_per_nic_mean"]
    # On one switch every byte crosses a sender's uplink and a receiver's downlink.
    assert row["link_bytes_total"] == p * (sent + received)
    assert row["max_link_bytes"] == max(sent, received)


@pytest.mark.parametrize("p,roots", [(8, 1), (8, 2), (8, 3), (9, 4), (16, 8), (5, 5)])
def test_chained_multicast_takes_its_chains_one_after_another(p, roots):
    """Each chain's roots multicast in turn, each paced at B / min(R, P-1): the longest chain
    sets the time."""
    n, b = 4 * MIB, 1e9 / 8
    row = simulate("allgather", "multicast", star(p, 1e9), n, roots=roots)
    longest = -(-p // roots)
    assert row["seconds"] == pytest.approx(longest * n * min(roots, p - 1) / b, rel=1e-3)
    assert row["events"] >= longest


def test_max_min_fairness_on_the_textbook_example():
    """Links A (cap 1) and B (cap 2); flow 0 crosses A and B, flow 1 only A, flow 2 only B,
    flow 3 only B but capped at 0.2: A splits evenly (0.5, 0.5); B gives flow 3 its cap and
    flow 2 what is left."""
    demand = np.array([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=np.float32)
    rate = max_min_rates(demand, np.array([1.0, 2.0]), np.array([math.inf] * 3 + [0.2]),
                         np.ones(4, bool))
    assert rate == pytest.approx([0.5, 0.5, 1.3, 0.2])


def test_weights_count_as_demand():
    """A flow whose bytes weigh twice on a link (headers, CPU) gets half the rate."""
    rate = max_min_rates(np.array([[2, 1]], dtype=np.float32), np.array([3.0]),
                         np.full(2, math.inf), np.ones(2, bool))
    assert rate == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("hosts,radix,levels", [(32, 8, 2), (128, 8, 3)])
@pytest.mark.parametrize("over", [2, 4])
def test_oversubscription_slows_a_ring_by_the_bottleneck(hosts, radix, levels, over):
    """Strided, every ring hop leaves its leaf: k/2 flows share k/(2o) uplinks, so the ring
    slows by o. Contiguous, one flow per leaf crosses: no slower."""
    n = 16 * MIB
    flat = fat_tree(hosts, 10e9, radix)
    thin = fat_tree(hosts, 10e9, radix, (over,))
    assert thin.levels == levels
    for place, factor in (("strided", over), ("contiguous", 1)):
        ratio = simulate("allgather", "ring", thin, n, place=place)["seconds"] / \
            simulate("allgather", "ring", flat, n, place=place)["seconds"]
        assert ratio == pytest.approx(factor, rel=0.01)


@pytest.mark.parametrize("p,ratio", [(4, 1.5), (8, 1.75)])
def test_traffic_anchors_on_a_radix_32_fat_tree(p, ratio):
    """Ring against multicast AllGather, total link traffic: within one leaf it is
    2(P-1)·P / P·P (the authors' 1.50 at 4 nodes, 1.75 at 8)."""
    tree = fat_tree(p, 100e9, 32)
    ring = simulate("allgather", "ring", tree, MIB)["link_bytes_total"]
    mcast = simulate("allgather", "multicast", tree, MIB)["link_bytes_total"]
    assert ring / mcast == ratio


def test_traffic_ratio_approaches_two_at_scale():
    ratios = []
    for p in (64, 1024):
        tree = fat_tree(p, 100e9, 32)
        ratios.append(simulate("allgather", "ring", tree, MIB)["link_bytes_total"]
                      / simulate("allgather", "multicast", tree, MIB)["link_bytes_total"])
    assert 1.9 < ratios[0] < ratios[1] < 2


def test_multicast_tree_holds_each_link_once():
    """A root's tree on a 3-level fat tree: its uplink, one way up to the core, one way down
    into each other pod and leaf, and every other host's downlink, each link once."""
    tree = fat_tree(1024, 100e9, 32)  # 64 leaves of 16 in 4 pods of 16 leaves
    links, _ = tree.multicast_tree(0, range(1, 1024))
    assert len(set(links.tolist())) == len(links)
    # host 0 up; leaf 0 -> agg; agg -> core; core -> 3 other pods' aggs; each pod's agg ->
    # its 16 leaves (15 in pod 0); 1023 host downlinks.
    assert len(links) == 1 + 1 + 1 + 3 + (15 + 3 * 16) + 1023


def test_reduction_tree_is_the_multicast_tree_reversed():
    tree = fat_tree(64, 100e9, 32)
    down, _ = tree.multicast_tree(5, [h for h in range(64) if h != 5])
    up, _ = tree.reduction_tree(5, [h for h in range(64) if h != 5])
    assert sorted(up.tolist()) == sorted((down ^ 1).tolist())
    assert tree.downlink[5] in up and tree.uplink[5] not in up


def test_strided_placement_deals_ranks_over_the_leaves():
    tree = fat_tree(32, 10e9, 8)  # 8 leaves of 4
    hosts = placement("strided", 32, tree)
    assert sorted(hosts) == list(range(32))
    assert [h // 4 for h in hosts[:9]] == [0, 1, 2, 3, 4, 5, 6, 7, 0]


def test_an_engine_that_cannot_keep_up_sets_the_time():
    """Each host's engine takes 10 us per 1000-byte datagram on one core: 100 MB/s of
    datagrams sent plus received. The multicast AllGather moves N out and N(P-1) in per host,
    so it takes N·P / 100 MB/s, not the link's N(P-1)/B."""
    slow = Engine("slow", chunk_bytes=1000, us_per_datagram=10.0, cores=1.0)
    p, n = 8, 4 * MIB
    row = simulate("allgather", "multicast", star(p, 100e9), n, engine=slow)
    assert row["seconds"] == pytest.approx(n * p / 100e6, rel=0.01)
    assert row["engine_cores_busy"] == pytest.approx(1.0, rel=0.01)
    idle = simulate("allgather", "multicast", star(p, 100e9), n, engine=slow.with_cores(1e9))
    assert idle["seconds"] == pytest.approx(n * (p - 1) / 12.5e9, rel=0.01)
    assert idle["engine_cores_busy"] == pytest.approx(row["seconds"] / idle["seconds"], rel=0.01)


def test_headers_and_pacing_share_stretch_the_time():
    e = Engine("framed", chunk_bytes=1000, datagram_headers=100, pacing_share=0.5)
    p, n = 4, MIB
    row = simulate("reduce_scatter", "innetwork", star(p, 1e9), n, engine=e)
    # senders fill half their uplink with 1.1 wire bytes per payload byte
    assert row["seconds"] == pytest.approx(n * (p - 1) * 1.1 / (0.5 * 1e9 / 8), rel=0.01)
    assert row["tx_bytes_per_nic_max"] == pytest.approx(n * (p - 1) * 1.1)


def test_small_messages_pay_the_ring_its_hops():
    """At 1 KiB per rank a 64-rank ring waits a frame and a hop per step; a multicast tree
    pays its depth once."""
    tree = star(64, 100e9, latency=5e-6)
    ring = simulate("allgather", "ring", tree, 1024)["seconds"]
    mcast = simulate("allgather", "multicast", tree, 1024)["seconds"]
    assert ring >= 63 * 2 * 5e-6
    assert mcast < ring / 10


def overcast(*args):
    return subprocess.run([sys.executable, "-m", "overcast.cli.main", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_and_wide_simulate_print_what_they_promise():
    """plan fits a terminal too, nothing cut short, its reasons wrapped; --wide shows
    simulate's every column."""
    done = overcast("plan", "--preset", "ethernet-fat-tree", "--params", "7B", "--layers", "32")
    assert done.returncode == 0 and widest(done.stdout) <= 120, done.stdout + done.stderr
    assert "\u2026" not in done.stdout, done.stdout
    done = overcast("simulate", "--nodes", "8", "--wide")
    assert done.returncode == 0 and "busiest link" in done.stdout and \
        "engine cores" in done.stdout, done.stdout + done.stderr


def test_simulate_writes_the_json_contract(tmp_path):
    out = tmp_path / "sim.json"
    done = overcast("simulate", "--nodes", "8,64", "--topology", "fat-tree", "--radix", "32",
                    "--link-gbit", "100,400", "--bytes-per-rank", "64MiB",
                    "--collectives", "allgather,reduce_scatter,overlap",
                    "--algorithms", "ring,multicast,innetwork,overcast", "--json", str(out),
                    "--plot", str(tmp_path / "sim.png"))
    assert done.returncode == 0, done.stderr
    assert widest(done.stdout) <= 120, done.stdout  # a terminal's width; --wide for the rest
    doc = json.loads(out.read_text())
    assert set(doc) == {"meta", "results"}
    rows = doc["results"]
    assert len(rows) == 6 * 2 * 2  # the 6 valid (collective, algorithm) pairs, nodes, rates
    for row in rows:
        for field in ("collective", "algorithm", "nodes", "topology", "bytes_per_rank",
                      "link_bits_per_s", "seconds", "floor_seconds", "link_bytes_total",
                      "max_link_bytes", "tx_bytes_per_nic_max", "rx_bytes_per_nic_max"):
            assert field in row
        assert row["topology"] == "fat-tree" and row["bytes_per_rank"] == 64 * MIB
        assert row["seconds"] >= row["floor_seconds"] * 0.999
    assert (tmp_path / "sim.png").stat().st_size > 10_000


SIMULATE = ["simulate", "--nodes", "64"]


@pytest.mark.parametrize("flags,message", [
    (SIMULATE + ["--nodes", "1"], "the number of hosts must be between 2"),
    (SIMULATE + ["--link-gbit", "0"], "the link rate must be above 0"),
    (SIMULATE + ["--topology", "ring"], "unknown topology 'ring'"),
    (SIMULATE + ["--radix", "7"], "the radix must be an even whole number"),
    (SIMULATE + ["--nodes", "9000", "--radix", "32"], "9000 hosts need more than three levels"),
    (SIMULATE + ["--oversubscription", "40"], "an oversubscription must be between 1 and 16"),
    (SIMULATE + ["--algorithms", "gloo"], "no algorithm gloo"),
    (SIMULATE + ["--engine", "fpga"], "unknown engine 'fpga'"),
    (SIMULATE + ["--placement", "strided", "--nodes", "40"],
     "a multiple of the hosts per leaf (16)"),
])
def test_bad_settings_are_refused_in_one_line(flags, message):
    done = overcast(*flags)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_a_shared_machine_bounds_every_host_and_the_aggregator_together():
    """The emulated cluster's hosts and aggregator share one machine's cores: the in-network
    ReduceScatter then takes (all ranks' CPU + the aggregator's) / cores when that exceeds the
    link's time."""
    e = Engine("shared", chunk_bytes=1000, us_per_datagram=10.0, aggregator_us_per_datagram=5.0)
    p, n = 4, MIB
    row = simulate("reduce_scatter", "innetwork", star(p, 100e9), n, engine=e, shared_cores=2)
    datagrams = n / 1000
    ranks = p * (p - 1 + 1) * datagrams * 10e-6      # each rank sends P-1 blocks, receives 1
    aggregator = p * (p - 1 + 1) * datagrams * 5e-6  # per block: P-1 contributions in, 1 out
    assert row["seconds"] == pytest.approx((ranks + aggregator) / 2, rel=0.01)


def test_compare_puts_measured_runs_beside_the_prediction():
    doc = {"results": [simulate("allgather", "ring", star(8, 100e6), 4 * MIB)]}
    bench = [{"results": [{"collective": "allgather", "algorithm": "ring", "hosts": 8,
                           "bytes_per_rank": 4 * MIB, "link_bits_per_s": 100_000_000,
                           "seconds": s}]} for s in (2.40, 2.50, 2.45)]
    compare(doc, bench)
    (row,) = doc["results"]
    assert row["measured_seconds"] == 2.45 and row["measured_seconds_range"] == [2.40, 2.50]
    assert row["prediction_error"] == pytest.approx(row["seconds"] / 2.45 - 1)


# The 8-host sweep the aggregator model was calibrated on (16-core GPU machine, 4 MiB per rank,
# in-network ReduceScatter, one aggregator of one shard): link rate -> measured seconds.
MEASURED_ONE_SHARD = {1e9: 0.2412, 2e9: 0.2048, 4e9: 0.2035}


@pytest.mark.parametrize("bits", sorted(MEASURED_ONE_SHARD))
def test_the_aggregator_model_meets_the_measured_8_host_sweep(bits):
    row = simulate("reduce_scatter", "innetwork", star(8, bits), 4 * MIB,
                   aggregators=AggregatorPool())
    assert row["seconds"] == pytest.approx(MEASURED_ONE_SHARD[bits], rel=0.10)


@pytest.mark.parametrize("count,shards,nic", [(1, 1, None), (2, 3, None), (4, 16, 10e9),
                                              (1, 64, 25e9)])
def test_a_pool_of_aggregators_bounds_a_reduction_by_its_cores_and_its_links(count, shards, nic):
    """Every contribution takes a shard's time and crosses an aggregator's link in: the
    ReduceScatter takes the longest of its floor, the pool's cores and the pool's links."""
    p, n, bits = 16, 64 * MIB, 100e9
    pool = AggregatorPool(count, shards, nic)
    row = simulate("reduce_scatter", "innetwork", star(p, bits), n, aggregators=pool)
    contributions = p * (p - 1) * n  # each of the P blocks: P-1 contributions of n bytes
    cores = contributions / (count * shards * pool.core_bytes_per_s(8920))
    links = contributions / (count * nic / 8) if nic else 0.0
    floor = cost.floor_seconds("reduce_scatter", n, p, bits / 8)
    assert row["seconds"] == pytest.approx(max(floor, cores, links), rel=0.02)


@pytest.mark.parametrize("hosts,gbits", [(64, 100), (64, 400), (256, 200)])
def test_the_pool_sized_for_a_cluster_holds_the_pair_within_its_bar(hosts, gbits):
    pool = pool_for(hosts, gbits * 1e9, 1.10, chunk_bytes=8920)
    row = simulate("overlap", "overcast", star(hosts, gbits * 1e9), 16 * MIB, aggregators=pool)
    assert row["ratio_to_floor"] <= 1.10 + 1e-9
    smaller = AggregatorPool(pool.count, pool.shards - 1, pool.nic_bits_per_s) \
        if pool.shards > 1 else AggregatorPool(pool.count - 1, pool.shards, pool.nic_bits_per_s)
    assert simulate("overlap", "overcast", star(hosts, gbits * 1e9), 16 * MIB,
                    aggregators=smaller)["ratio_to_floor"] > 1.10 - 0.02


