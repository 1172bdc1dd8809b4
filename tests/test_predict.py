"""overcast train's cost model: the training thread's schedule run against the link's rate."""

import pytest

from overcast.schedules.cost import pair_floor_seconds
from overcast.train.config import SHAPES, GPTConfig
from overcast.train.predict import predict, simulate_step, step_collectives, step_schedule

B = 12.5e6  # 100 Mbit/s in bytes/s
N = 1_000_000
NO_COMPUTE = {"forward": 0.0, "backward": 0.0, "other": 0.0}


@pytest.mark.parametrize("world", [3, 4, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_without_compute_each_collective_takes_its_floor(shape, world):
    """Nothing to hide behind: the step is the sum of its collectives at their floors, a
    backward pair at the pair's floor with overcast and as two rings without."""
    cfg = GPTConfig(**SHAPES[shape])
    p = predict(cfg, world, 8 * B, NO_COMPUTE)
    rings = sum((world - 1) * (g + s) for _, g, s in step_collectives(cfg, world)) / B
    overcast = sum(pair_floor_seconds(g, s, world, B) if kind == "pair" else
                   (world - 1) * (g + s) / B for kind, g, s in step_collectives(cfg, world))
    assert p["step_seconds"]["rings"] == pytest.approx(rings, rel=1e-9)
    assert p["step_seconds"]["overcast"] == pytest.approx(overcast, rel=1e-9)
    assert p["comm_seconds"] == p["step_seconds"]


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("compute", [0.1, 0.3])
def test_compute_hides_a_prefetched_allgather(overlapped, compute):
    """An AllGather posted before compute and waited after costs only what the compute does
    not cover: max(compute, (P-1)N/B) either way (both receive (P-1)N)."""
    schedule = [("post", "AG", "allgather", N), ("compute", compute), ("wait", "AG")]
    assert simulate_step(schedule, 4, B, overlapped) == pytest.approx(max(compute, 3 * N / B))


def test_a_reduce_scatter_behind_the_backward_pairs_with_the_next_allgather():
    """A ReduceScatter left in flight while the next block's AllGather runs: overcast's two share
    the link as a pair (N·P/B), rings add up (2(P-1)N/B); the backward waits for both."""
    schedule = [("post", "RS 1", "reduce_scatter", N), ("post", "AG 0", "allgather", N),
                ("wait", "AG 0"), ("wait", "RS 1")]
    assert simulate_step(schedule, 4, B, True) == pytest.approx(4 * N / B)
    assert simulate_step(schedule, 4, B, False) == pytest.approx(6 * N / B)


def test_the_compute_is_shared_by_the_modules_and_counted_once():
    """With a link too fast to matter the step is the compute: micro-steps' forward and
    backward, and the optimizer once."""
    cfg = GPTConfig(micro_steps=3)
    compute = {"forward": 0.2, "backward": 0.5, "other": 0.1}
    p = predict(cfg, 4, 1e15, compute)
    assert p["compute_seconds"] == pytest.approx(3 * 0.7 + 0.1)
    for seconds in p["step_seconds"].values():
        assert seconds == pytest.approx(2.2, rel=1e-6)


@pytest.mark.parametrize("prefetch", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_deeper_prefetch_posts_each_allgather_once_and_earlier(shape, prefetch):
    """overlap(prefetch=k): when block i waits for its forward AllGather, blocks up to i+k-1
    have been posted (the root posted the first k); each AllGather is posted once, so a step
    has as many as with k=1."""
    cfg = GPTConfig(**SHAPES[shape])
    schedule = step_schedule(cfg, 4, NO_COMPUTE, prefetch)
    posts = [a[1] for a in schedule if a[0] == "post"]
    assert len(posts) == len(set(posts)) == \
        sum(1 for a in step_schedule(cfg, 4, NO_COMPUTE) if a[0] == "post")
    for i in range(cfg.blocks):
        waited = schedule.index(("wait", f"AG {i} 0"))
        posted = {a[1] for a in schedule[:waited] if a[0] == "post" and a[1].startswith("AG ")}
        assert posted == {"AG root 0"} | {f"AG {j} 0"
                                          for j in range(min(i + prefetch, cfg.blocks))}


@pytest.mark.parametrize("prefetch", [2, 3])
def test_without_compute_a_deeper_prefetch_moves_the_same_bytes(prefetch):
    """With nothing to hide behind and no backward AllGathers, AllGathers in flight together
    share the link: the step takes what one at a time takes, either way."""
    cfg = GPTConfig(reshard="none")
    one = predict(cfg, 4, 8 * B, NO_COMPUTE)
    deeper = predict(cfg, 4, 8 * B, NO_COMPUTE, prefetch)
    for way in ("rings", "overcast"):
        assert deeper["step_seconds"][way] == pytest.approx(one["step_seconds"][way], rel=1e-9)
