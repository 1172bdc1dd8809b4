"""How the "overcast" backend runs a group's calls, against gloo in the same job: in the order
they are made, a call made from a callback included, whether the callback was attached before
its call completed or after (on a completer either way); callbacks that wait for later calls;
a future the caller completed itself; abort() while the group is closing, and with overlap()'s
companion; the ranks' settings told apart; what a group leaves in the store; calls keyed apart
across groups, and not shifted by callbacks one rank alone adds that make none; a key two
calls share; calls whose futures no completer is free for; and errors of a subgroup naming
global ranks."""

import datetime
import functools
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

import overcast.distributed  # noqa: F401  (registers the backend)
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.distributed import calls
from overcast.distributed.calls import _calling_from as calling_from
from overcast.job import agreed_name
from test_backend import LINK, start


def late_callbacks(rank, backend):
    """Each scenario on a group of `backend`, its results as lists. Ranks other than 0 attach
    their callbacks before rank 0 has made its first call (so those run later, on whatever
    thread completes the call); rank 0 attaches its own once its call is complete (gloo runs
    them at once, on its own thread; overcast on a completer). `sync` is a gloo group of its own
    for the ordering."""
    sync = dist.new_group(backend="gloo")
    group = dist.group.WORLD if backend == "overcast" else dist.new_group(backend="gloo")

    def tensor(scale):
        return torch.full((1000,), scale * (rank + 1), dtype=torch.int64)

    a, b, c, d, e, f = (tensor(10 ** i) for i in range(6))
    said = {}

    def made(calls, callbacks):
        """`calls()` then `callbacks(works)`: on ranks other than 0 both before rank 0 makes
        its calls, on rank 0 once its first call is complete."""
        if rank:
            works = calls()
            futures = callbacks(works)
            dist.barrier(sync)
        else:
            dist.barrier(sync)
            works = calls()
            works[0].wait()
            futures = callbacks(works)
        return works, futures

    # 1. the callback makes a call: it takes its place after b's on every rank
    (_, wb), (issued,) = made(
        lambda: [dist.all_reduce(a, group=group, async_op=True),
                 dist.all_reduce(b, group=group, async_op=True)],
        lambda works: [works[0].get_future().then(lambda _: dist.all_reduce(c, group=group))])
    issued.wait()
    wb.wait()
    said["order"] = [a[0].item(), b[0].item(), c[0].item()]

    # 2. callbacks that wait for a later call's Work, or its future, or make a call and wait
    # for its future (PowerSGD's)
    def waiting(works):
        first, later = works
        return [first.get_future().then(lambda _: later.wait()),
                first.get_future().then(lambda _: later.get_future().wait()[0][0].item()),
                first.get_future().then(lambda _: dist.all_reduce(
                    f, group=group, async_op=True).get_future().wait()[0][0].item()),
                first.get_future().then(lambda _: later.get_future().then(
                    lambda fut: fut.value()[0][0].item()).wait()),
                first.get_future().then(lambda _: torch.futures.wait_all(
                    [later.get_future()])[0][0][0].item())]
    _, futures = made(lambda: [dist.all_reduce(d, group=group, async_op=True),
                               dist.all_reduce(e, group=group, async_op=True)], waiting)
    said["waited"] = [fut.wait() for fut in futures]
    said["sums"] = [d[0].item(), e[0].item(), f[0].item()]

    # 3. callbacks never run on the thread that runs calls
    where = []
    _, (fut,) = made(lambda: [dist.all_reduce(tensor(1), group=group, async_op=True)],
                     lambda works: [works[0].get_future().then(
                         lambda _: where.append(threading.current_thread().name))])
    fut.wait()
    said["callback_thread"] = where

    # 4. wait() returns once the call's callbacks have run, as gloo's: a slow one halves the sum
    halved = tensor(1)
    (work,), _ = made(lambda: [dist.all_reduce(halved, group=group, async_op=True)],
                      lambda works: [works[0].get_future().then(
                          lambda _: time.sleep(0.2) or halved.div_(2, rounding_mode="floor"))])
    work.wait()
    said["halved"] = halved[0].item()

    # 5. a callback that blocks on a lock the program holds while it makes a call
    lock = threading.RLock()  # gloo's rank 0 runs its callback on this thread, holding it
    with lock:
        (blocked,), _ = made(lambda: [dist.all_reduce(tensor(1), group=group, async_op=True)],
                             lambda works: [works[0].get_future().then(
                                 lambda _: lock.acquire() and lock.release())])
        held = tensor(1)
        dist.all_reduce(held, group=group)
    said["under_lock"] = held[0].item()
    dist.destroy_process_group(sync)
    if group is not dist.group.WORLD:
        dist.destroy_process_group(group)
    return said


def against_gloo(rank):
    start(timeout=30)
    said = {backend: late_callbacks(rank, backend) for backend in ("gloo", "overcast")}
    dist.destroy_process_group()
    return said


@pytest.mark.parametrize("world", [2, 3, 4])
def test_calls_made_by_callbacks_take_their_place_and_may_wait_for_later_ones(world):
    began = time.monotonic()
    results = run_ranks(against_gloo, loopback_placements(world), timeout=60)
    ranks = sum(range(1, world + 1))
    for rank, said in enumerate(results):
        assert said["overcast"]["order"] == said["gloo"]["order"] == [ranks, 10 * ranks,
                                                                       100 * ranks]
        assert said["overcast"]["sums"] == said["gloo"]["sums"] == [1000 * ranks,
                                                                     10000 * ranks,
                                                                     100000 * ranks]
        assert said["overcast"]["waited"] == said["gloo"]["waited"] == [
            True, 10000 * ranks, 100000 * ranks, 10000 * ranks, 10000 * ranks]
        assert said["overcast"]["halved"] == said["gloo"]["halved"] == ranks // 2
        assert said["overcast"]["under_lock"] == said["gloo"]["under_lock"] == ranks
        where = said["overcast"]["callback_thread"]
        assert where[0].startswith(f"overcast-pg-0-{world}-0-completer-"), where
    assert time.monotonic() - began < 60


def powersgd_buckets(rank):
    """DDP with PowerSGD over several buckets, rank 1 slow to hand buckets 0 and 1 to its hook:
    rank 0 makes bucket 1's all_reduce before bucket 0's can complete, so bucket 0's callback
    makes its all_reduce after it; rank 1 makes bucket 1's once that callback has made its own.
    Rank 0's order runs on both; the ranks end with the same parameters."""
    start(timeout=30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                          nn.Linear(24, 8))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2, min_compression_rate=0.5,
                                        use_error_feedback=True, warm_start=True, random_seed=7)

    def hook(state, bucket):
        if rank == 1 and bucket.index() < 2:
            time.sleep(0.2)  # the scenario: this rank's backward is slower here
        return powerSGD_hook.powerSGD_hook(state, bucket)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(step * 2 + rank)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    dist.destroy_process_group()
    return flat.tolist()


def test_powersgd_over_buckets_whose_callbacks_race_the_backward():
    first, second = run_ranks(powersgd_buckets, loopback_placements(2), timeout=60)
    assert first == second


def completed_by_the_caller(rank):
    """Rank 1 completes its call's future itself before the call can complete (rank 0 has not
    made it): that call fails, and the group goes on."""
    gloo = start(timeout=30)
    t = torch.ones(10)
    said = {}
    if rank == 1:
        work = dist.all_reduce(t, async_op=True)
        work.get_future().set_result([t])
    dist.barrier(gloo)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=20))
        said["own"] = None
    except Exception as err:
        said["own"] = type(err).__name__
    later = torch.full((10,), float(rank + 1))
    dist.all_reduce(later, async_op=True).wait(timeout=datetime.timedelta(seconds=20))
    said["later"] = later.tolist()
    dist.destroy_process_group()
    return said


def test_a_future_completed_by_the_caller_fails_that_call_alone():
    results = run_ranks(completed_by_the_caller, loopback_placements(2), timeout=60)
    assert results[0]["own"] is None and results[1]["own"] == "RuntimeError"
    for said in results:
        assert said["later"] == [3.0] * 10


def abort_mid_shutdown(group, said: dict) -> tuple[threading.Thread, float]:
    """Shut `group` down on a thread and, once the shutdown has begun, abort it: the thread,
    and when the abort began; how long the abort took in said["abort_seconds"]."""
    closing = threading.Thread(target=group.shutdown)
    closing.start()
    while group._lifetime._state == "open":  # until the shutdown has begun
        time.sleep(0.01)
    began = time.monotonic()
    group.abort()
    said["abort_seconds"] = time.monotonic() - began
    return closing, began


def abort_while_closing(rank):
    """Rank 0's call waits for rank 1, which never makes it; rank 0's group is shut down on a
    thread (it waits for that call, half the group's timeout) and aborted meanwhile: abort()
    returns soon, the call fails naming the abort, the shutdown ends, and overlap()'s companion
    fails too; rank 1's next calls fail, naming it."""
    gloo = start(timeout=30)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    companion = group.companion_communicator(in_network=False)
    said = {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(100), group=group, async_op=True)
        on_companion = companion.comm.all_gather(torch.empty(2).numpy(),
                                                 torch.ones(1).numpy(), async_op=True)
        closing, began = abort_mid_shutdown(group, said)
        closing.join(10)
        said["shutdown_ended"] = not closing.is_alive()
        for what, pending in [("call", work), ("companion", on_companion)]:
            try:
                pending.wait()
            except Exception as err:
                said[what] = str(err)
        said["seconds"] = time.monotonic() - began
        dist.barrier(gloo)
    else:
        dist.barrier(gloo)
        for what, call in [("call", lambda: dist.all_reduce(torch.ones(100), group=group)),
                           ("companion", lambda: companion.comm.all_gather(
                               torch.empty(2).numpy(), torch.ones(1).numpy()))]:
            try:
                call()
            except Exception as err:
                said[what] = str(err)
        group.shutdown()
    companion.close()
    dist.destroy_process_group()
    return said


def test_abort_while_the_group_closes_ends_its_calls_and_its_companions():
    results = run_ranks(abort_while_closing, loopback_placements(2), timeout=60)
    first = results[0]
    assert first["abort_seconds"] < 15 and first["shutdown_ended"], first
    assert first["seconds"] < 15, first
    for said in results:
        assert "aborted" in said["call"] and "aborted" in said["companion"], said


def abort_while_waiting_for_peers(rank):
    """Rank 0 started the group's aggregator; its shutdown waits for rank 1 to close before it
    stops it, and is aborted meanwhile: the abort returns at once, the aggregator stopped."""
    gloo = start(timeout=30)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1000), group=group)
    said = {}
    if rank == 0:
        closing, _ = abort_mid_shutdown(group, said)
        said["aggregator_stopped"] = group._group.job_aggregator.proc.poll() is not None
        closing.join()
    dist.barrier(gloo)
    group.shutdown()
    dist.destroy_process_group()
    return said


def test_abort_does_not_wait_for_the_peers_to_close():
    first = run_ranks(abort_while_waiting_for_peers, loopback_placements(2, LINK), timeout=60)[0]
    assert first["abort_seconds"] < 3 and first["aggregator_stopped"], first


def ended_by_a_callback(rank):
    """A callback of call a shuts its group down (runs the calls made: b), or aborts it (at
    once): rank 1 attaches it before a can complete, so it runs on a completer."""
    gloo = start(timeout=30)
    said = {}
    for how in ("shutdown", "abort"):
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
        a, b = torch.full((4,), rank + 1.0), torch.full((4,), rank + 1.0)
        if rank == 0:
            dist.barrier(gloo)
        wa = dist.all_reduce(a, group=group, async_op=True)
        wb = dist.all_reduce(b, group=group, async_op=True)

        def end(_, group=group, how=how):
            began = time.monotonic()
            getattr(group, how)()
            return time.monotonic() - began
        ended = wa.get_future().then(end)
        if rank == 1:
            dist.barrier(gloo)
        seconds = ended.wait()
        try:
            wb.wait()
            said[how] = [seconds, b.tolist()]
        except Exception as err:
            said[how] = [seconds, str(err)]
        dist.barrier(gloo)
    dist.destroy_process_group()
    return said


def test_a_callback_may_shut_its_group_down_or_abort_it():
    for said in run_ranks(ended_by_a_callback, loopback_placements(2), timeout=60):
        assert said["shutdown"][1] == [3.0] * 4, said  # the call made before it ran
        assert said["shutdown"][0] < 10 and said["abort"][0] < 5, said


def settings_differ(rank):
    """Rank 1 runs every collective on the ring by its environment, rank 0 chooses "auto"."""
    if rank == 1:
        for env in ("OVERCAST_ALL_GATHER", "OVERCAST_REDUCE_SCATTER", "OVERCAST_ALL_REDUCE",
                    "OVERCAST_BROADCAST"):
            os.environ[env] = "ring"
    began = time.monotonic()
    try:
        dist.init_process_group("overcast", timeout=datetime.timedelta(seconds=60))
        said = None
    except Exception as err:
        said = [type(err).__name__, str(err)]
    return said, time.monotonic() - began


def test_ranks_whose_algorithms_differ_are_told_so_at_once():
    for said, seconds in run_ranks(settings_differ, loopback_placements(2, LINK), timeout=60):
        assert said[0] == "InvalidArgumentError", said
        assert "rank 0 has OVERCAST_ALL_GATHER=auto" in said[1], said
        assert "rank 1 OVERCAST_ALL_GATHER=ring" in said[1], said
        assert seconds < 20


def keys_left(rank):
    """Keys a group leaves in the job's store, made and destroyed (with an aggregator rank 0
    starts, and a companion), against what a gloo group leaves."""
    start(timeout=30)
    store = dist.distributed_c10d._get_default_store()
    left = {}
    for backend in ("gloo", "overcast"):
        dist.barrier()
        before = store.num_keys()
        for _ in range(3):
            group = dist.new_group(backend=backend)
            t = torch.ones(1000)
            dist.all_reduce(t, group=group)
            if backend == "overcast":
                companion = group.companion_communicator(in_network=True)
                companion.close()
            dist.destroy_process_group(group)
        dist.barrier()
        left[backend] = store.num_keys() - before
    dist.destroy_process_group()
    return left


def test_a_group_leaves_one_key_in_the_store():
    for left in run_ranks(keys_left, loopback_placements(3, LINK), timeout=120):
        # per overcast group: its count of members, and the companion's
        assert left["overcast"] <= left["gloo"] + 3 * 2, left


def test_ranks_agree_on_names_in_a_store_reused_by_worlds_of_other_sizes():
    store = dist.HashStore()
    assert {agreed_name(store, "pg-0", 3) for _ in range(3)} == {"pg-0-3-0"}
    assert {agreed_name(store, "pg-0", 2) for _ in range(2)} == {"pg-0-2-0"}
    assert {agreed_name(store, "pg-0", 3) for _ in range(3)} == {"pg-0-3-1"}


def callbacks_of_two_groups(rank):
    """A callback of WORLD's first call and one of B's first call (B over the same ranks) each
    make a call on B, both pending at once on every rank: rank 0's B is held by a call rank 1
    makes only once both ranks' callbacks have made theirs. Each key names its future's group,
    so the two never clash."""
    gloo = start(timeout=30)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    x, y, gate = torch.ones(2), torch.ones(2), torch.ones(1)
    p, q = torch.full((3,), rank + 1.0), torch.full((3,), 10.0 * (rank + 1))
    wa = dist.all_reduce(x, async_op=True)
    wb = dist.all_reduce(y, group=group, async_op=True)
    if rank == 0:
        gated = dist.all_reduce(gate, group=group, async_op=True)
    fa = wa.get_future().then(lambda _: dist.all_reduce(p, group=group, async_op=True))
    fb = wb.get_future().then(lambda _: dist.all_reduce(q, group=group, async_op=True))
    inner = [fa.wait(), fb.wait()]
    dist.barrier(gloo)
    if rank == 1:
        gated = dist.all_reduce(gate, group=group, async_op=True)
    said = []
    for work in [gated, *inner]:
        try:
            work.wait(timeout=datetime.timedelta(seconds=30))
            said.append("done")
        except Exception as err:
            said.append(type(err).__name__)
    said += [p.tolist(), q.tolist()]
    dist.destroy_process_group()
    return said


def test_callbacks_of_two_groups_make_calls_keyed_apart():
    for said in run_ranks(callbacks_of_two_groups, loopback_placements(2), timeout=90):
        assert said == ["done"] * 3 + [[3.0] * 3, [30.0] * 3], said


def keys_alike(rank):
    """Two calls made under one key (as from one callback run twice) while the first is pending:
    rank 0's is held by a call rank 1 makes only once rank 0 has made both. The second fails
    naming its key, and the group aborts on every rank."""
    gloo = start(timeout=30)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    works = []
    if rank == 1:
        dist.barrier(gloo)
    works.append(dist.all_reduce(torch.ones(1), group=group, async_op=True))
    for _ in range(2):
        with calling_from(("one callback",)):
            works.append(dist.all_reduce(torch.ones(4), group=group, async_op=True))
    if rank == 0:
        dist.barrier(gloo)
    said = []
    for work in works:
        try:
            work.wait(timeout=datetime.timedelta(seconds=30))
            said.append("done")
        except Exception as err:
            said.append(str(err))
    dist.destroy_process_group()
    return said


def test_a_call_keyed_as_a_pending_one_fails_and_aborts_the_group():
    for said in run_ranks(keys_alike, loopback_placements(2), timeout=90):
        assert len(said) == 3 and "done" not in said, said
        assert all("('one callback',), 0)" in s and "cannot tell the two apart" in s
                   for s in said), said


def note(said, what, fut):
    said.append(what)


class Noted:
    """A callback object that makes no call: it notes that it ran."""

    def __init__(self, said):
        self.said = said

    def __call__(self, fut):
        note(self.said, "object", fut)


def reduced(t, group, fut):
    dist.all_reduce(t, group=group)
    return t[0].item()


def callbacks_that_make_no_call(rank):
    """Rank 0 alone attaches callbacks that make no call (a function, a partial, a callable
    object) before those that every rank attaches, which do: two of one function through
    partials, then a lambda. Rank 1 attaches them before the call completes, rank 0 after (so
    they run at once, on its thread). Only the callbacks that make calls key them."""
    gloo = start(timeout=30)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
    said = []
    c, d, e = (torch.full((4,), 10.0 ** k * (rank + 1)) for k in range(3))
    if rank == 0:
        dist.barrier(gloo)
    work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    fut = work.get_future()
    if rank == 0:
        work.wait()
        fut.then(lambda _: said.append("logged"))
        fut.then(functools.partial(note, said, "partial"))
        fut.add_done_callback(Noted(said))
    futures = [fut.then(functools.partial(reduced, c, group)),
               fut.then(functools.partial(reduced, d, group)),
               fut.then(lambda _: dist.all_reduce(e, group=group))]
    if rank == 1:
        dist.barrier(gloo)
    try:
        values = [f.wait() for f in futures[:2]]
        futures[2].wait()
        said += [values, e[0].item()]
    except Exception as err:
        said.append(type(err).__name__)
    dist.destroy_process_group()
    return said


def test_callbacks_that_make_no_call_on_one_rank_shift_no_keys():
    first, second = run_ranks(callbacks_that_make_no_call, loopback_placements(2), timeout=90)
    assert first == ["logged", "partial", "object", [3.0, 30.0], 300.0], first
    assert second == [[3.0, 30.0], 300.0], second


def no_thread_to_complete(rank, limit):
    """Rank 1 parks four callbacks that block until it lets them go, on calls that complete
    once it has attached them, and may have three completer threads (by MAX_COMPLETERS, or by
    the system: a thread start that fails past them stands in for its limit): three callbacks
    block the three completers, and the fourth call, and a later one, fail at once, naming why.
    Let go, the parked futures complete and the group goes on."""
    gloo = start(timeout=30)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    real_start = threading.Thread.start
    started = []

    def start_thread(thread):
        if "-completer-" in thread.name:
            started.append(thread.name)
            if len(started) > 2 and limit == "system":
                raise RuntimeError("can't start new thread")
        real_start(thread)

    said = {}
    let_go = threading.Event()
    if rank == 0:
        dist.barrier(gloo)
    else:
        threading.Thread.start = start_thread
        if limit == "completers":
            calls.MAX_COMPLETERS = 3
    try:
        parked = [dist.all_reduce(torch.ones(4), group=group, async_op=True) for _ in range(4)]
        if rank == 1:
            futures = [w.get_future().then(lambda f: let_go.wait() and len(f.value()))
                       for w in parked]
            dist.barrier(gloo)
        later = torch.ones(4)
        try:
            dist.all_reduce(later, group=group, async_op=True).wait(
                timeout=datetime.timedelta(seconds=30))
            said["later"] = later.tolist()
        except Exception as err:
            said["later"] = str(err)
        let_go.set()
        if rank == 1:
            said["parked"] = []
            for fut in futures:
                try:
                    said["parked"].append(fut.wait())
                except Exception as err:
                    said["parked"].append(type(err).__name__)
        final = torch.full((4,), rank + 1.0)
        dist.all_reduce(final, group=group, async_op=True).wait(
            timeout=datetime.timedelta(seconds=30))
        said["final"] = final.tolist()
    finally:
        threading.Thread.start = real_start
    dist.destroy_process_group()
    return said


@pytest.mark.parametrize("limit", ["completers", "system"])
def test_a_call_no_completer_can_take_fails_and_the_group_goes_on(limit):
    first, second = run_ranks(no_thread_to_complete, loopback_placements(2), args=(limit,),
                              timeout=120)
    assert first == {"later": [2.0] * 4, "final": [3.0] * 4}, first
    assert "every completer thread of the group is busy" in second["later"], second
    assert ("has 3, its most (MAX_COMPLETERS)" if limit == "completers" else
            "can't start new thread") in second["later"], second
    assert second["parked"] == [1, 1, 1, "OvercastError"], second
    assert second["final"] == [3.0] * 4, second


def late_callback_waits(rank):
    """Rank 1 attaches, once its call is complete, a callback that makes a call and waits for
    it, then makes its next call; rank 0 attaches the same callback before its call completes,
    and makes its next call before the callback makes its own, so rank 0 runs the program's next
    call first. The callback runs on a completer, not on rank 1's thread, which makes that next
    call meanwhile."""
    gloo = start(timeout=30)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
    c, d = torch.full((4,), rank + 1.0), torch.full((4,), 10.0 * (rank + 1))
    next_made = threading.Event()

    def reduce_c(_):
        if rank == 0:
            next_made.wait()
        dist.all_reduce(c, group=group)
        return threading.current_thread().name

    work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    if rank == 1:
        work.wait()
    fut = work.get_future().then(reduce_c)
    said = {}
    try:
        next_call = dist.all_reduce(d, group=group, async_op=True)
        next_made.set()
        next_call.wait()
        said["thread"] = fut.wait()
        said["values"] = [c[0].item(), d[0].item()]
    except Exception as err:
        said["error"] = type(err).__name__
    dist.barrier(gloo)
    dist.destroy_process_group()
    return said


def test_a_callback_attached_once_its_call_is_complete_runs_on_a_completer():
    for said in run_ranks(late_callback_waits, loopback_placements(2), timeout=90):
        assert said.get("values") == [3.0, 30.0], said
        assert "-completer-" in said["thread"], said


def subgroup_errors(rank):
    """On a group of global ranks 1 and 2 (its ranks 0 and 1), global rank 2 refuses a call
    (bad arguments), then aborts the group: global rank 1's errors name global rank 2; global
    rank 2's own error names no rank, and says nothing of them."""
    gloo = start(timeout=30)
    group = dist.new_group([1, 2], timeout=datetime.timedelta(seconds=20))
    said = []

    def call(fn):
        try:
            fn()
            said.append("done")
        except Exception as err:
            said.append(str(err))
    if rank:
        call(lambda: dist.all_gather_into_tensor(torch.empty(4 if rank == 1 else 5),
                                                 torch.ones(2), group=group))
    dist.barrier(gloo)
    if rank == 2:
        group.abort()
    dist.barrier(gloo)
    if rank == 1:
        call(lambda: dist.all_reduce(torch.ones(2), group=group))
    dist.barrier(gloo)
    dist.destroy_process_group()
    return said


def test_errors_on_a_subgroup_name_global_ranks():
    _, said, refused = run_ranks(subgroup_errors, loopback_placements(3), timeout=90)
    assert len(said) == 2 and all("rank 1 is global rank 2" in s for s in said), said
    assert refused[0].startswith("all_gather: the output holds 5") and \
        "global rank" not in refused[0], refused  # it names no rank
