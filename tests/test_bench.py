"""`overcast bench` end to end on a small cluster: the JSON contract, verified results, NIC
counters that match the traffic each algorithm must move, and the plot."""

import json
import os
import subprocess
import sys

from conftest import root_only, widest

from overcast.bench.run import sweep_summary
from overcast.engine.trace import BIN_SECONDS

pytestmark = root_only


def test_bench_contract(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "overcast.cli.main", "bench", "--hosts", "3",
                    "--link-mbit", "200", "--sizes", "64KiB,1000003",
                    "--collectives", "allgather,reduce_scatter", "--algorithms", "ring,gloo",
                    "--reps", "2", "--warmup", "0", "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["meta"]["hosts"] == 3 and doc["meta"]["link_bits_per_s"] == 200_000_000
    rows = {(r["collective"], r["algorithm"], r["bytes_per_rank"]): r for r in doc["results"]}
    assert set(rows) == {(c, a, n) for c in ("allgather", "reduce_scatter")
                         for a in ("ring", "gloo") for n in (65536, 1000000)}
    for (collective, algorithm, n), row in rows.items():
        for key in ("hosts", "link_bits_per_s", "seconds", "tx_bytes_per_host",
                    "rx_bytes_per_host", "correct"):
            assert key in row
        assert row["correct"] is True
        assert row["seconds"] > 0 and len(row["seconds_all"]) == 2
        if n == 1000000:
            # N(P-1) per direction, plus headers, plus the barriers around each run
            factor = 2 if (algorithm, collective) == ("gloo", "reduce_scatter") else 1
            assert 1.0 <= row["tx_over_payload"] / factor < 1.05, row
            assert 1.0 <= row["rx_over_payload"] / factor < 1.05, row
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_overlap_bench_and_timeline(tmp_path):
    out = tmp_path / "overlap.json"
    run = subprocess.run([sys.executable, "-m", "overcast.cli.main", "bench", "--hosts", "3",
                    "--link-mbit", "100", "--sizes", "256KiB", "--collectives",
                    "overlap,reduce_scatter", "--algorithms", "overcast,innetwork,ring,gloo",
                    "--reps", "2", "--warmup", "1", "--timeline", str(tmp_path / "tl"),
                    "--json", str(out)], check=True, capture_output=True, text=True, timeout=600)
    assert widest(run.stdout + run.stderr) <= 120, run.stdout  # a terminal's width
    doc = json.loads(out.read_text())
    rows = {(r["collective"], r["algorithm"]): r for r in doc["results"]}
    assert set(rows) == {("overlap", "overcast"), ("overlap", "ring"), ("overlap", "gloo"),
                         ("reduce_scatter", "innetwork"), ("reduce_scatter", "ring"),
                         ("reduce_scatter", "gloo")}
    assert all(r["correct"] for r in rows.values())
    # overcast sends and receives N*P per host (ring: 2N(P-1)); in-network RS receives only N
    assert 1.0 <= rows[("overlap", "overcast")]["tx_over_payload"] < 1.05
    assert 1.0 <= rows[("overlap", "overcast")]["rx_over_payload"] < 1.05
    assert 1.0 <= rows[("reduce_scatter", "innetwork")]["rx_over_payload"] < 1.05
    assert rows[("overlap", "overcast")]["switch_cpu_seconds_per_run"] > 0
    for algorithm in ("overcast", "ring"):
        trace = json.loads((tmp_path / f"tl-{algorithm}.json").read_text())["traceEvents"]
        spans = [e for e in trace if e["ph"] == "X" and e["pid"] == 0]
        lanes = {e["tid"]: (e["ts"], e["ts"] + e["dur"]) for e in spans}
        assert set(lanes) == {1, 2}  # an AllGather and a ReduceScatter...
        (a0, a1), (b0, b1) = lanes[1], lanes[2]
        assert max(a0, b0) < min(a1, b1)  # ...in flight at the same time
        counters = [e for e in trace if e["ph"] == "C" and e["pid"] == 0]
        assert {e["name"] for e in counters} == {"link tx (% of rate)", "link rx (% of rate)"}
        # the link panels carry each collective's bytes, native datagrams included: rank 0
        # takes in the others' shards, and sends the others' blocks (to a ring neighbour, or
        # as contributions to the aggregator)
        moved = {}
        for e in counters:
            for lane, percent in e["args"].items():
                key = (e["name"].split()[1], lane)
                moved[key] = moved.get(key, 0) + percent / 100 * 100e6 / 8 * BIN_SECONDS
        shard = 256 * 1024
        assert moved[("rx", "AllGather")] >= 0.9 * 2 * shard, moved
        assert moved[("tx", "ReduceScatter")] >= 0.9 * 2 * shard, moved
        png = (tmp_path / f"tl-{algorithm}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_all_reduce_bench_moves_what_each_algorithm_must(tmp_path):
    out = tmp_path / "all_reduce.json"
    subprocess.run([sys.executable, "-m", "overcast.cli.main", "bench", "--hosts", "4",
                    "--link-mbit", "200", "--sizes", "1MiB", "--collectives", "all_reduce",
                    "--algorithms", "ring,fullduplex,gloo", "--reps", "2", "--warmup", "0",
                    "--json", str(out)], check=True, capture_output=True, text=True,
                   timeout=600)
    rows = {r["algorithm"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"ring", "fullduplex", "gloo"}
    assert all(r["correct"] for r in rows.values())
    n = 1 << 20
    # the floor is N/B; the rings move 2N(P-1)/P each way, the full-duplex one N each way
    assert rows["fullduplex"]["floor_seconds"] == n / (200e6 / 8)
    assert rows["ring"]["payload_sent_per_host"] == 2 * n * 3 / 4
    assert rows["fullduplex"]["payload_sent_per_host"] == n
    for algorithm in ("ring", "fullduplex"):
        assert 1.0 <= rows[algorithm]["tx_over_payload"] < 1.08, rows[algorithm]
        assert 1.0 <= rows[algorithm]["rx_over_payload"] < 1.08, rows[algorithm]


def test_exchanges_bench_moves_only_what_each_rank_sends(tmp_path):
    """all_to_all (even and uneven splits) and send_recv on the backend beside gloo: exact, each
    host sending and receiving the blocks its sizes say (plus headers), against their floors:
    N(P-1)/(PB), the busiest host's bytes over B, and N/B."""
    out = tmp_path / "exchanges.json"
    subprocess.run([sys.executable, "-m", "overcast.cli.main", "bench", "--hosts", "4",
                    "--link-mbit", "200", "--sizes", "1MiB", "--collectives",
                    "all_to_all,all_to_all_uneven,send_recv", "--algorithms",
                    "pairwise,stream,gloo", "--reps", "2", "--warmup", "0", "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    rows = {(r["collective"], r["algorithm"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {(c, a) for c, a in [("all_to_all", "pairwise"), ("all_to_all", "gloo"),
                                             ("all_to_all_uneven", "pairwise"),
                                             ("all_to_all_uneven", "gloo"),
                                             ("send_recv", "stream"), ("send_recv", "gloo")]}
    assert all(r["correct"] for r in rows.values())
    n, b = 1 << 20, 200e6 / 8
    assert rows[("all_to_all", "pairwise")]["floor_seconds"] == n * 3 / 4 / b
    assert rows[("all_to_all", "pairwise")]["payload_sent_per_host"] == n * 3 / 4
    assert rows[("send_recv", "stream")]["floor_seconds"] == n / b
    assert rows[("send_recv", "stream")]["payload_sent_per_host"] == n / 2
    uneven = rows[("all_to_all_uneven", "pairwise")]
    assert uneven["floor_seconds"] > n * 3 / 4 / b  # its busiest host moves more than 3N/4
    for key in (("all_to_all", "pairwise"), ("all_to_all_uneven", "pairwise"),
                ("send_recv", "stream")):
        assert 1.0 <= rows[key]["tx_over_payload"] < 1.05, rows[key]
        assert 1.0 <= rows[key]["rx_over_payload"] < 1.05, rows[key]


def test_a_sweep_runs_every_point_on_a_cluster_of_each_rate(tmp_path):
    out = tmp_path / "sweep.json"
    run = subprocess.run([sys.executable, "-m", "overcast.cli.main", "bench", "--hosts", "2",
                          "--link-mbit", "200,50", "--sizes", "1MiB", "--collectives", "overlap",
                          "--algorithms", "overcast,ring", "--reps", "2", "--warmup", "1",
                          "--within", "1.5", "--timeline", str(tmp_path / "tl"),
                          "--json", str(out)],
                         check=True, capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert meta["link_bits_per_s"] is None and meta["within"] == 1.5
    assert meta["link_rates_bits_per_s"] == [200_000_000, 50_000_000]
    rows = {(r["algorithm"], r["link_bits_per_s"]): r for r in doc["results"]}
    assert set(rows) == {(a, b) for a in ("overcast", "ring") for b in (200e6, 50e6)}
    assert all(r["correct"] for r in rows.values())
    for algorithm in ("overcast", "ring"):
        # each rate had its own links: a quarter of the rate, well over half again the time
        assert rows[(algorithm, 50e6)]["seconds"] > 1.5 * rows[(algorithm, 200e6)]["seconds"]
        for mbit in (50, 200):
            trace = json.loads((tmp_path / f"tl-{algorithm}-{mbit}mbit.json").read_text())
            assert trace["traceEvents"]
    assert rows[("overcast", 50e6)]["switch_cpu_seconds_per_run"] > 0
    assert [(p["algorithm"], p["ratio_to_floor"]) for p in doc["sweep"]] == \
        [(a, [[b, rows[(a, b)]["ratio_to_floor"]] for b in (50_000_000, 200_000_000)])
         for a in ("overcast", "ring")]
    assert doc["sweep"] == sweep_summary(doc["results"], 1.5)
    for p in doc["sweep"]:
        assert f"overlap {p['algorithm']}" in run.stdout and "of its floor" in run.stdout
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_names_the_highest_rate_held_at_every_rate_below_it():
    def rows(ratios):
        return [{"collective": "overlap", "algorithm": "overcast", "bytes_per_rank": 4 << 20,
                 "roots": 8, "loss": 0.0, "link_bits_per_s": mbit * 10**6,
                 "ratio_to_floor": x} for mbit, x in ratios]

    def held(ratios, within=1.15):
        [p] = sweep_summary(rows(ratios), within)
        return p["holds_up_to_bits_per_s"], p["fails_at_bits_per_s"]

    # in any order; a rate held again above the first that failed does not count
    assert held([(350, 1.26), (250, 1.09), (300, 1.10), (400, 1.12)]) == (300e6, 350e6)
    assert held([(100, 1.07), (200, 1.15)]) == (200e6, None)
    assert held([(100, 1.2), (200, 1.1)]) == (None, 100e6)
    assert held([(100, 1.2), (200, 1.3)], within=1.25) == (100e6, 200e6)


def test_bench_names_what_it_does_not_know():
    for argv, needle in ((["--collectives", "allreduce"], "unknown collective 'allreduce'"),
                         (["--algorithms", "tree"], "no algorithm tree"),
                         (["--link-mbit", "100,fast"],
                          "--link-mbit takes numbers, comma-separated, not '100,fast'"),
                         (["--sizes", "4 parsecs"], "cannot read size")):
        out = subprocess.run([sys.executable, "-m", "overcast.cli.main", "bench", *argv],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_the_aggregator_without_a_secret_says_what_to_set():
    env = {k: v for k, v in os.environ.items()
           if k not in ("OVERCAST_SECRET", "OVERCAST_SECRETS")}
    out = subprocess.run([sys.executable, "-m", "overcast.cli.main", "aggregator"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "set OVERCAST_SECRET" in out.stderr
