"""`overcast check`: a job's network ready, or not and why, as every rank found it; on the emulated
cluster, and with its switch dropping the multicast for a host."""

import json
import os
import subprocess
import sys

from conftest import root_only
from overcast.bench.check import bytes_per_rank, verdict

OVERCAST = [sys.executable, "-m", "overcast.cli.main"]


def finding(rank: int, **changed) -> dict:
    """A rank's findings on a network that is ready."""
    return {"rank": rank, "host": f"h{rank}", "secret": True, "switch": "10.0.0.9:18515",
            "link_bits_per_s": 1e8, "receive_buffer_bytes": 16 << 20,
            "address": f"10.0.0.{rank + 1}", "mtu": 9000, "chunk_bytes": 8920, "unheard": {},
            "multicast": None, "aggregator": None, "endpoints": 2, "aggregator_started": False,
            "runs": [{"collective": "allgather", "algorithm": "multicast",
                      "bytes_per_rank": 1 << 20, "seconds": [0.09, 0.1, 0.11],
                      "floor_seconds": 0.1, "correct": True}], **changed}


def test_a_ready_network_is_ready_and_says_what_it_found():
    doc = verdict([finding(0), finding(1, runs=[{**finding(1)["runs"][0],
                                                  "seconds": [0.1, 0.12, 0.1]}])])
    assert doc["ready"] and doc["verdict"] == "ready"
    states = {name: state for name, state, _ in doc["checks"]}
    assert set(states.values()) == {"ok"}
    [row] = doc["collectives"]
    # each run's slowest rank: 0.1, 0.12, 0.11 s
    assert row["seconds"] == 0.11 and row["range"] == [0.1, 0.12]
    assert abs(row["ratio"] - 1.1) < 1e-9 and row["correct"]


def test_each_failure_is_named_and_notes_do_not_fail():
    wrong = {**finding(0)["runs"][0], "correct": False}
    doc = verdict([finding(0, mtu=1500, secret=False),
                   finding(1, aggregator="in-network reduction is unavailable: cannot reach "
                                         "the aggregator at 10.0.0.9:18515: refused",
                           runs=[wrong], receive_buffer_bytes=208 << 10)])
    states = {name: state for name, state, _ in doc["checks"]}
    assert states == {"link rate": "ok", "multicast": "ok", "path MTU": "note",
                      "socket buffers": "note", "aggregator": "fail", "secret": "note",
                      "collectives": "fail", "rate": "ok"}
    assert doc["verdict"] == (
        "not ready: aggregator: rank 1: in-network reduction is unavailable: cannot reach the "
        "aggregator at 10.0.0.9:18515: refused; collectives: wrong results: allgather "
        "multicast")
    no_rate = verdict([finding(0, link_bits_per_s=None, runs=[])])
    assert no_rate["verdict"].startswith("not ready: link rate: no link rate: set "
                                         "OVERCAST_LINK_BITS_PER_S")


def test_each_call_takes_about_a_quarter_second_at_the_link_rate():
    assert bytes_per_rank(1e8, 4) == 960 << 10  # 1.04 MB a quarter second / 3, in 64 KiB
    assert bytes_per_rank(1e12, 2) == 64 << 20 and bytes_per_rank(1e3, 2) == 64 << 10


def test_check_outside_a_launcher_says_how_to_run_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([*OVERCAST, "check"], capture_output=True, text=True, env=env)
    assert run.returncode == 2
    assert "check runs on every rank of the job" in run.stderr
    assert "--no-python overcast check" in run.stderr


def _cluster_check(tmp_path, *flags) -> tuple[int, dict, str]:
    out = tmp_path / "check.json"
    run = subprocess.run([*OVERCAST, "cluster", "run", "--hosts", "3", "--link-mbit", "100",
                          *flags, "--", *OVERCAST, "check", "--seconds", "0.2", "--json",
                          str(out)], capture_output=True, text=True, timeout=300)
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
