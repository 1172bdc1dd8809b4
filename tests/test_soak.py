"""A short soak on the emulated cluster (`overcast soak` at small scale): overlapped pairs under
bursty loss stay bit-exact, the communicator's own memory report stays the same from pair to
pair, and closing it leaves no socket, thread or aggregator slot behind. The long run, with its
memory and drift figures, is in docs/results.md."""

import pytest

from conftest import root_only
from overcast.bench.run import Aggregators
from overcast.bench.soak import run_soak
from overcast.report.soak import plot, summary_table

pytestmark = root_only
PAIRS, MARK = 60, 20


def exact_flat_and_nothing_left(doc: dict, rejoining: int = 0) -> None:
    """Every pair bit-exact; what the communicator holds the same from a mark to the end (but,
    with aggregators killed, the thread that registers with them anew, made at the first loss,
    and at most `rejoining` registrations with restarted ones still being taken back); no
    socket, thread, aggregator slot or registration left once it closed."""
    summary = doc["summary"]
    assert summary["pairs_exact"] == PAIRS
    for rank in doc["ranks"]:
        early, late = rank["marks"][str(MARK)], rank["marks"][str(PAIRS)]
        assert early["memory"]["collectives_in_flight"] == 0
        for key in ("collectives_in_flight", "collective_state_bytes"):
            assert early["memory"][key] == late["memory"][key], key
        assert late["fds"] <= early["fds"] + rejoining
        assert late["threads"] - early["threads"] in ((0, 1) if rejoining else (0,))
        # rank 0 may hold fewer after than before: the rendezvous store it serves closes the
        # warm-up's connections on their own time
        assert rank["after"]["threads"] <= rank["before"]["threads"]
        assert rank["after"]["fds"] <= rank["before"]["fds"]
    assert not any(v for left in summary["left_behind"].values() for v in left.values())
    assert summary["switch_pool_bytes_after"] == 0
    assert summary["switch_communicators_after"] == 0


@pytest.mark.parametrize("aggregators", [Aggregators(), Aggregators(2, 2)],
                         ids=["one aggregator", "two aggregators of two shards"])
def test_a_short_soak_is_exact_and_flat_and_leaves_nothing_behind(aggregators, tmp_path):
    doc = run_soak(4, 400_000_000, PAIRS, 64 * 1024, 0.01, 4.0, [MARK],
                   aggregators=aggregators)
    summary = doc["summary"]
    assert len(doc["switches"]) == aggregators.count
    # every shard of every aggregator took contributions, none of them left anything behind
    for report in doc["switches"]:
        assert report["shards"] == aggregators.shard_count()
        assert all(c > 0 for c in report["shard_contributions"])
    assert summary["injected_losses"] > 0
    assert summary["repaired_chunks"] + summary["contributions_resent"] > 0
    exact_flat_and_nothing_left(doc)
    for rank in doc["ranks"]:
        early, late = rank["marks"][str(MARK)], rank["marks"][str(PAIRS)]
        assert early["memory"]["aggregator_slot_bytes"] == late["memory"]["aggregator_slot_bytes"]
    # what `overcast soak` shows of it: the table and the picture
    assert summary_table(doc).row_count > 8
    plot(doc, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")


def test_aggregators_killed_while_pairs_run_the_soak_stays_exact_and_flat(tmp_path):
    """Two aggregators, one killed and started again every 20 pairs, each in turn: each loss
    leaves the other (or, both lost, the ring) to take the pairs after, until the restarted one
    is taken back; every pair bit-exact, memory flat, nothing left behind on the ranks or the
    aggregators."""
    doc = run_soak(4, 400_000_000, PAIRS, 64 * 1024, 0.01, 4.0, [MARK],
                   aggregators=Aggregators(2, 2), kill_every=20)
    summary = doc["summary"]
    assert [k["pair"] >= p for k, p in zip(doc["kills"], (20, 40))] == [True, True]
    assert summary["aggregator_kills"] == summary["aggregators_lost"] == 2
    assert summary["aggregators_taken_back"] <= 2
    exact_flat_and_nothing_left(doc, rejoining=2)
    assert "aggregators killed (every 20 pairs)" in str(
        [c._cells for c in summary_table(doc).columns])
