"""The per-rank launcher's conventions, as torchrun's: each forked rank's compute threads."""

import os

import torch  # noqa: F401  (imported before the fork, as in a test or a training script)

from overcast.cluster.launch import loopback_placements, run_ranks


def threads(rank):
    import torch
    return [os.environ["OMP_NUM_THREADS"], torch.get_num_threads()]


def test_forked_ranks_share_the_cores_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    want = max(1, len(os.sched_getaffinity(0)) // 3)
    assert run_ranks(threads, loopback_placements(3), timeout=60) == [[str(want), want]] * 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert all("OMP_NUM_THREADS" not in p.env for p in loopback_placements(3))
