"""`overcast check`: a job's network ready, or not and why, as every rank found it; on the emulated
cluster, and with its switch dropping the multicast for a host."""

import json
import os
import subprocess
import sys

import pytest

from conftest import root_only
from overcast.bench.check import scaled_bytes, verdict

OVERCAST = [sys.executable, "-m", "overcast.cli.main"]


FLOOR = 0.1
# each collective's time over its floor on a network that is ready (the rings' pair moves
# 2(P-1)/P of what overcast's does)
READY_RATIOS = {("allgather", "ring"): 1.0, ("allgather", "multicast"): 1.02,
                ("reduce_scatter", "ring"): 1.0, ("reduce_scatter", "innetwork"): 1.03,
                ("overlap", "ring"): 1.6, ("overlap", "overcast"): 1.05}


def runs(**changed) -> list[dict]:
    """Every collective's runs, each the slowest rank's time alike on every rank, at the ratios
    to their floors of READY_RATIOS, or those given as collective_algorithm=ratio."""
    out = []
    for (collective, algorithm), ratio in READY_RATIOS.items():
        ratio = changed.get(f"{collective}_{algorithm}", ratio)
        out.append({"collective": collective, "algorithm": algorithm, "bytes_per_rank": 1 << 20,
                    "seconds": [ratio * FLOOR * x for x in (0.98, 1.0, 1.03)],
                    "floor_seconds": FLOOR, "correct": True})
    return out


def finding(rank: int, **changed) -> dict:
    """A rank's findings on a network that is ready."""
    return {"rank": rank, "host": f"h{rank}", "secret": True, "aggregators": "10.0.0.9:18515",
            "link_bits_per_s": 1e8, "receive_buffer_bytes": 16 << 20,
            "address": f"10.0.0.{rank + 1}", "mtu": 9000, "chunk_bytes": 8920, "unheard": {},
            "multicast": None, "aggregator": None, "endpoints": 2, "aggregator_started": False,
            "runs": runs(), **changed}


def test_a_ready_network_is_ready_and_says_what_it_found():
    doc = verdict([finding(0), finding(1)])
    assert doc["ready"] and doc["verdict"] == "ready" and doc["exit_code"] == 0
    states = {name: state for name, state, _ in doc["checks"]}
    assert set(states.values()) == {"ok"}
    row = doc["collectives"][1]
    assert row["algorithm"] == "multicast" and row["seconds"] == pytest.approx(0.102)
    assert row["range"] == pytest.approx([0.09996, 0.10506])
    assert row["ratio"] == pytest.approx(1.02) and row["correct"]
    details = dict((name, detail) for name, _, detail in doc["checks"])
    assert details["overcast's pair"] == "overcast's pair 105 ms against its rings' 160 ms " \
                                        "measured here, 1.52x faster"
    assert details["datagram collectives"] == "multicast AllGather 1.02x, in-network " \
                                              "ReduceScatter 1.03x its floor (within 1.5x " \
                                              "expected)"
    assert details["rate"] == "a ring AllGather moved about 100 Mbit/s per link, 1.00x the " \
                              "100 Mbit/s given"


SLOWER = "works, but slower than rings here: overcast's pair "


@pytest.mark.parametrize("every,cause", [
    # an aggregator behind the hosts' rate
    ([finding(r, runs=runs(reduce_scatter_innetwork=5.49, overlap_overcast=12.5,
                           overlap_ring=5.0)) for r in range(4)],
     "the aggregator at 10.0.0.9:18515 takes the contributions at about 1/5.5 of the hosts' "
     "rate: its link or cores are behind what 4 ranks send it"),
    # two ranks per node
    ([finding(r, address=f"10.0.0.{r // 2 + 1}", runs=runs(reduce_scatter_innetwork=2.1,
                                                          overlap_overcast=7.9,
                                                          overlap_ring=4.75))
      for r in range(4)],
     "2 ranks share a NIC, and each sends its whole gradient through it to the aggregator, "
     "2x what a ring sends"),
    # a rate given 4x the link's
    ([finding(r, link_bits_per_s=4e8, runs=runs(allgather_ring=4.0, allgather_multicast=4.6,
                                                reduce_scatter_ring=4.0,
                                                reduce_scatter_innetwork=4.4,
                                                overlap_ring=6.4, overlap_overcast=7.0))
      for r in range(2)],
     "the links (or the hosts) carry less than OVERCAST_LINK_BITS_PER_S says, and multicast, "
     "paced to the rate given, overruns them and resends"),
    # a rate given a quarter of the link's: multicast paces to it and meets its floor
    ([finding(r, link_bits_per_s=2.5e7, runs=runs(allgather_ring=0.25, reduce_scatter_ring=0.25,
                                                  overlap_ring=0.4)) for r in range(2)],
     "the links carry more than OVERCAST_LINK_BITS_PER_S says, and multicast, paced to the "
     "rate given, leaves the rest unused"),
    # no OVERCAST_AGGREGATORS: the aggregator beside rank 0
    ([finding(r, aggregator_started=True, runs=runs(reduce_scatter_innetwork=1.61,
                                                    overlap_overcast=1.9)) for r in range(4)],
     "the aggregator rank 0 started beside itself (no OVERCAST_AGGREGATORS) takes every rank's "
     "contributions through rank 0's link"),
])
def test_overcast_slower_than_its_rings_is_not_ready_and_says_why(every, cause):
    doc = verdict(every)
    assert doc["exit_code"] == 3 and not doc["ready"], doc["verdict"]
    assert doc["verdict"].startswith(SLOWER) and cause in doc["verdict"], doc["verdict"]
    assert " measured here (ready takes at most 95% of theirs); likely: " in doc["verdict"]


def test_a_rate_below_the_links_is_named_even_where_overcast_still_wins():
    doc = verdict([finding(r, link_bits_per_s=7.5e7, runs=runs(allgather_ring=0.75,
                                                               reduce_scatter_ring=0.75,
                                                               overlap_ring=1.2))
                   for r in range(2)])
    assert doc["verdict"] == "ready"
    assert ("rate", "note", "a ring AllGather moved about 100 Mbit/s per link, 1.33x the 75 "
                            "Mbit/s given: the links carry more than OVERCAST_LINK_BITS_PER_S "
                            "says, and multicast, paced to the rate given, leaves the rest "
                            "unused") in doc["checks"]


def test_each_failure_is_named_and_notes_do_not_fail():
    wrong = runs()
    wrong[1] = {**wrong[1], "correct": False}
    doc = verdict([finding(0, mtu=1500, secret=False, aggregator_started=True),
                   finding(1, aggregator="in-network reduction is unavailable: cannot reach "
                                         "the aggregator at 10.0.0.9:18515: refused",
                           runs=wrong, receive_buffer_bytes=208 << 10, secret=False,
                           aggregator_started=True)])
    states = {name: state for name, state, _ in doc["checks"]}
    assert states == {"link rate": "ok", "multicast": "ok", "path MTU": "note",
                      "socket buffers": "note", "aggregator": "fail", "secret": "note",
                      "collectives": "fail", "rate": "ok", "datagram collectives": "ok",
                      "overcast's pair": "ok"}
    assert doc["verdict"] == (
        "not ready: aggregator: rank 1: in-network reduction is unavailable: cannot reach the "
        "aggregator at 10.0.0.9:18515: refused; collectives: wrong results: allgather "
        "multicast")
    assert doc["exit_code"] == 1


def test_a_missing_link_rate_is_its_own_failure_not_the_aggregators():
    skipped = [{**r, "floor_seconds": None} if r["algorithm"] == "ring" else
               {"collective": r["collective"], "algorithm": r["algorithm"],
                "skipped": "link rate"} for r in runs()]
    doc = verdict([finding(r, link_bits_per_s=None, runs=skipped) for r in range(2)])
    states = {name: state for name, state, _ in doc["checks"]}
    assert states["link rate"] == "fail" and states["aggregator"] == "ok"
    assert doc["verdict"].startswith("not ready: link rate: no link rate: set "
                                     "OVERCAST_LINK_BITS_PER_S") and doc["exit_code"] == 1
    assert "aggregator" not in doc["verdict"]
    assert [r.get("skipped") for r in doc["collectives"]] == \
        [None, "link rate", None, "link rate", None, "link rate"]


def test_a_registration_that_fails_is_most_likely_the_secret():
    failed = ("in-network reduction is unavailable: registration with the aggregator at "
              "10.0.0.9:18515 failed: the connection closed")
    doc = verdict([finding(0, secret=False), finding(1, secret=False, aggregator=failed)])
    assert doc["verdict"] == (
        f"not ready: aggregator: rank 1: {failed}: most likely the secret: an aggregator "
        f"closes a registration from a job whose secret it does not hold, and OVERCAST_SECRET "
        f"is not set on ranks 0, 1; secret: OVERCAST_SECRET is not set on ranks 0, 1: rank 0 "
        f"drew a secret of its own, which the aggregator at 10.0.0.9:18515 (OVERCAST_AGGREGATORS) "
        f"cannot hold; set OVERCAST_SECRET on every rank to the one it was started with")
    doc = verdict([finding(0), finding(1, aggregator=failed)])
    assert doc["verdict"].endswith("the aggregator must be started with the OVERCAST_SECRET "
                                   "the ranks have")
    doc = verdict([finding(0, aggregator=failed), finding(1, aggregator=failed)])
    assert doc["verdict"].startswith(f"not ready: aggregator: ranks 0, 1: {failed}: most "
                                     f"likely the secret")


def test_each_call_takes_about_a_quarter_second_here():
    """Sized by a ring AllGather's time, not by a rate that may be wrong or missing."""
    assert scaled_bytes(1 << 20, 0.25) == 1 << 20
    assert scaled_bytes(1 << 20, 0.0625) == 4 << 20
    assert scaled_bytes(1 << 20, 2.5) == 64 << 10  # 104,857 bytes, in 64 KiB
    assert scaled_bytes(64 << 20, 0.01) == 64 << 20 and scaled_bytes(64 << 10, 9) == 64 << 10


def test_check_with_one_rank_says_there_is_nothing_to_check():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    run = subprocess.run([*OVERCAST, "check"], capture_output=True, text=True, env=env)
    assert run.returncode == 2
    assert run.stderr.strip() == "overcast: check needs 2 ranks or more (WORLD_SIZE is 1): a " \
                                 "job of one rank sends nothing over the network, so there is " \
                                 "nothing to check"


def test_check_outside_a_launcher_says_how_to_run_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([*OVERCAST, "check"], capture_output=True, text=True, env=env)
    assert run.returncode == 2
    assert "check runs on every rank of the job" in run.stderr
    assert "--no-python overcast check" in run.stderr


def _cluster_check(tmp_path, *flags, before=()) -> tuple[int, dict, str]:
    out = tmp_path / "check.json"
    run = subprocess.run([*OVERCAST, "cluster", "run", "--hosts", "3", "--link-mbit", "100",
                          *flags, "--", *before, *OVERCAST, "check", "--seconds", "0.2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    return run.returncode, json.loads(out.read_text()), run.stdout


@root_only
def test_check_on_the_emulated_cluster(tmp_path):
    code, doc, shown = _cluster_check(tmp_path)
    assert code == 0 and doc["verdict"] == "ready", shown
    assert [r["correct"] for r in doc["collectives"]] == [True] * 6
    assert "[rank 0] verdict: ready" in shown
    code, doc, shown = _cluster_check(tmp_path, "--drop-multicast", "2")
    named = ("multicast not delivered: rank 2 (198.18.0.3) heard no other rank's multicast")
    assert code == 1 and doc["verdict"] == f"not ready: {named}", shown
    assert [r.get("skipped") for r in doc["collectives"]] == \
        [None, "multicast", None, None, None, "multicast"]
    # no link rate: its own failure; the rings alone, each call sized by its time here (a
    # quarter second at 100 Mbit/s: 1.5 MiB per rank of 3), not by a rate assumed
    code, doc, shown = _cluster_check(tmp_path, before=("env", "-u",
                                                        "OVERCAST_LINK_BITS_PER_S"))
    states = {name: state for name, state, _ in doc["checks"]}
    assert code == 1 and states["link rate"] == "fail" and states["aggregator"] == "ok", shown
    assert [r.get("skipped") for r in doc["collectives"]] == \
        [None, "link rate", None, "link rate", None, "link rate"]
    assert all(r["correct"] and 512 << 10 <= r["bytes_per_rank"] <= 4 << 20
               for r in doc["collectives"] if "skipped" not in r), doc["collectives"]
