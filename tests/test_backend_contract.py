"""The "overcast" backend keeps torch.distributed's contract, each against gloo in the same job:
DDP's comm hooks (PowerSGD's callbacks issue collectives on the group), groups made on some
ranks only, groups of one, in-place buffers, the Work API, abort and shutdown, bad arguments
that leave the group usable, and "auto" agreed by every rank."""

import datetime
import errno
import os
import select
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import (default_hooks, powerSGD_hook,
                                                         quantization_hooks)

import overcast.distributed  # noqa: F401  (registers the backend)
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.aggregator.launch import AggregatorStartError, start_aggregator, stop_aggregator
from overcast.transport.rendezvous import meeting_host
from test_backend import LINK, same, start, values

WORLDS = [1, 2, 3, 4]


def bf16_compress(process_group, bucket):
    """bf16_compress_hook's body: DDP refuses that hook by its name on a torch built without
    CUDA and NCCL, gloo's groups too."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def hooked_ddp(rank, hook_name, process_group):
    """A DDP model on `process_group` with one of PyTorch's comm hooks, and the hook's state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=process_group,
                                              bucket_cap_mb=0.001)  # several buckets
    if hook_name.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=0.5, use_error_feedback=hook_name == "powersgd",
            warm_start=hook_name == "powersgd", random_seed=7)
        hook = powerSGD_hook.powerSGD_hook
    else:
        state = process_group
        hook = {"allreduce": default_hooks.allreduce_hook,
                "fp16": default_hooks.fp16_compress_hook,
                "bf16": bf16_compress,
                "quantize_per_tensor": quantization_hooks.quantization_pertensor_hook,
                "quantize_per_channel": quantization_hooks.quantization_perchannel_hook,
                }[hook_name]
    ddp.register_comm_hook(state, hook)
    return ddp


HOOKS = ["allreduce", "fp16", "bf16", "powersgd", "powersgd_no_error_feedback",
         "quantize_per_tensor", "quantize_per_channel"]


# gloo cannot run the quantization hooks: its all_gather's future holds the outputs as one flat
# list where they index a list of lists (NCCL's, and overcast's). Their reference is gloo with
# the plain allreduce hook, and the difference is the quantization's.
REFERENCE = {"quantize_per_tensor": "allreduce", "quantize_per_channel": "allreduce"}
TOLERANCE = {"fp16": 1e-3, "bf16": 8e-3, "quantize_per_tensor": 1e-2,
             "quantize_per_channel": 1e-2}


def comm_hooks(rank):
    """Five steps of each hook on the backend and on gloo: the largest difference of the
    parameters after, relative to their size."""
    gloo = start()
    world = dist.get_world_size()
    differ = {}
    for name in HOOKS:
        models = [hooked_ddp(rank, name, dist.group.WORLD),
                  hooked_ddp(rank, REFERENCE.get(name, name), gloo)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        for step in range(5):
            g = torch.Generator().manual_seed(step * world + rank)
            x, y = torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)
            for model, opt in zip(models, opts):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        with torch.no_grad():
            differ[name] = max(float((p - q).abs().max() / q.abs().max())
                               for p, q in zip(*(m.parameters() for m in models)))
    dist.destroy_process_group()
    return differ


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_comm_hooks_train_as_on_gloo(world):
    """PowerSGD's callbacks issue an all_reduce on the group and wait for it, from the thread
    that completed the group's call: it used to wait behind itself for good."""
    began = time.monotonic()
    for differ in run_ranks(comm_hooks, loopback_placements(world, LINK), timeout=120):
        # float32 sums in another order; overcast sums 16-bit floats in float32 and rounds once,
        # gloo rounds at every step: within the payload's epsilon; uint8 quantization further
        assert all(d < TOLERANCE.get(n, 1e-4) for n, d in differ.items()), differ
    assert time.monotonic() - began < 60


def groups(rank):
    """new_group on some ranks then all of them, with and without local synchronization,
    new_subgroups, and DeviceMesh sub-groups of every shape (dimensions of one too): an
    all_reduce and an all_gather on each. The sums are of small integers, exact in any order:
    what gloo gives on the same ranks."""
    gloo = start()
    world = dist.get_world_size()
    results = {}

    def check(label, group, ranks):
        if rank not in ranks:
            return
        mine = values(rank, 1001, torch.float32)
        dist.all_reduce(mine, group=group)
        out = torch.empty(len(ranks) * 3, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.full((3,), rank), group=group)
        expected = torch.tensor([r for r in ranks for _ in range(3)])
        results[label] = [same(mine, sum(values(r, 1001, torch.float32) for r in ranks)),
                          torch.equal(out, expected), group.getBackendName()]

    # Hashed names (meshes, local synchronization) count the groups this process is in, so
    # they come first, while every rank is in as many as the others (torch's rule, gloo's too).
    from torch.distributed.device_mesh import init_device_mesh
    shapes = [(world,), (1, world), (world, 1)] + ([(2, world // 2)] if world % 2 == 0 else [])
    for shape in shapes:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("a", "b")[:len(shape)])
        for dim, name in enumerate(mesh.mesh_dim_names):
            ranks = mesh.mesh.swapdims(dim, -1).reshape(-1, shape[dim])
            row = next(r.tolist() for r in ranks if rank in r.tolist())
            check(f"mesh {shape} {name}", mesh.get_group(name), row)
    pairs = [list(range(world))[i:i + 2] for i in range(0, world, 2)]  # of 3 ranks: [2] alone
    pair = next(p for p in pairs if rank in p)
    check("new_group pair, local sync", dist.new_group(pair, use_local_synchronization=True),
          pair)
    first = dist.new_group([0, 1])  # ranks 2 and 3 are not in it and make nothing
    check("new_group [0, 1]", first, [0, 1])
    everyone = dist.new_group(list(range(world)))
    check("new_group all", everyone, list(range(world)))
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    check("new_subgroups by pairs", mine, pair)
    dist.barrier(gloo)
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world", [3, 4])
def test_groups_of_every_shape_agree_with_gloo(world):
    began = time.monotonic()
    results = run_ranks(groups, loopback_placements(world, LINK), timeout=120)
    assert time.monotonic() - began < 60
    for rank, result in enumerate(results):
        assert "new_group all" in result and f"mesh ({world}, 1) b" in result, result
        assert ("new_group [0, 1]" in result) == (rank < 2)
        for label, outcome in result.items():
            assert outcome == [True, True, "overcast"], (rank, label, outcome)


def one_and_in_place(rank):
    """Every collective on the world (of one rank, or more), and the in-place forms Megatron
    uses, against gloo."""
    gloo = start()
    world = dist.get_world_size()
    differ = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for name, op in [("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)]:
            mine, theirs = values(rank, 1001, dtype), values(rank, 1001, dtype)
            dist.all_reduce(mine, op=op)
            dist.all_reduce(theirs, op=op, group=gloo)
            differ += [] if same(mine, theirs) else [f"all_reduce {name} {dtype}"]
        # in place: each rank's output is its slot of the input
        buf = values(rank, 301 * world, dtype)
        copy = buf.clone()
        dist.reduce_scatter_tensor(buf.chunk(world)[rank], buf)
        expected = torch.empty(301, dtype=dtype)
        dist.reduce_scatter_tensor(expected, copy, group=gloo)
        differ += [] if same(buf.chunk(world)[rank], expected) else [f"rs in place {dtype}"]
        gathered = torch.zeros(301 * world, dtype=dtype)
        gathered.chunk(world)[rank].copy_(values(rank, 301, dtype))
        dist.all_gather_into_tensor(gathered, gathered.chunk(world)[rank])
        theirs = torch.empty(301 * world, dtype=dtype)
        dist.all_gather_into_tensor(theirs, values(rank, 301, dtype), group=gloo)
        differ += [] if same(gathered, theirs) else [f"ag in place {dtype}"]
    for root in range(world):
        mine, theirs = values(rank, 77, torch.float32), values(rank, 77, torch.float32)
        dist.broadcast(mine, root)
        dist.broadcast(theirs, root, group=gloo)
        differ += [] if same(mine, theirs) else [f"broadcast {root}"]
    mine = torch.empty(world * 5, dtype=torch.int64)
    dist.all_to_all_single(mine, torch.arange(world * 5) + 100 * rank)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, torch.arange(world * 5) + 100 * rank, group=gloo)
    differ += [] if same(mine, theirs) else ["all_to_all_single"]
    dist.barrier()
    algorithms = dict(dist.group.WORLD.algorithms)
    dist.destroy_process_group()
    return {"differ": differ, "algorithms": algorithms}


@pytest.mark.parametrize("world", WORLDS)
def test_groups_of_one_and_in_place_buffers_agree_with_gloo(world):
    """With the link rate given, "auto" picks in-network reduction; a group of one has no
    aggregator and needs none: every collective is a local copy."""
    began = time.monotonic()
    for r in run_ranks(one_and_in_place, loopback_placements(world, LINK), timeout=120):
        assert r["differ"] == [], r["differ"]
        assert r["algorithms"]["reduce_scatter"] == "innetwork"
    assert time.monotonic() - began < 60


def work_api(rank):
    """Rank 1 holds back until rank 0's wait(timeout) has timed out; then the call completes,
    and the Work says so every way torch asks."""
    gloo = start(timeout=30)
    t = torch.full((1000,), float(rank + 1))
    said = {}
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        began = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.3))
            said["timed_out"] = None
        except Exception as err:
            said["timed_out"] = [type(err).__name__, time.monotonic() - began]
        said["completed_before"] = work.is_completed()
        dist.barrier(gloo)  # now rank 1 joins
    else:
        dist.barrier(gloo)
        work = dist.all_reduce(t, async_op=True)
    said["wait"] = work.wait()
    said["completed"] = work.is_completed()
    said["exception"] = work.exception()
    said["result"] = [x.tolist()[:2] for x in work.result()]
    value = work.get_future().value()
    said["future_is_output"] = value[0] is t
    # a future's callbacks that issue collectives on the group, chained (test_get_future's)
    fut = dist.group.WORLD.allreduce([torch.ones(3)]).get_future()
    chained = fut.then(lambda f: [x * 3 for x in f.wait()]).then(
        lambda f: dist.all_reduce(f.wait()[0], async_op=True).get_future().wait()[0].tolist())
    said["chained"] = chained.wait()
    dist.destroy_process_group()
    return said


def test_the_work_api_is_whole():
    results = run_ranks(work_api, loopback_placements(2), timeout=60)
    first = results[0]
    assert first["timed_out"][0] == "CollectiveTimeoutError" and first["timed_out"][1] < 5
    assert first["completed_before"] is False
    for said in results:
        assert said["wait"] is True and said["completed"] is True
        assert said["exception"] is None and said["future_is_output"] is True
        assert said["result"] == [[3.0, 3.0]]
        assert said["chained"] == [12.0, 12.0, 12.0]  # (1 + 1) x 3, summed over 2 ranks


def bad_arguments(rank):
    """Bad calls made by every rank, then ones made by rank 1 alone, each collective on the
    group's algorithms: every rank raises, at once, and the group goes on (its calls numbered
    alike: the results after are exact). In-network reductions refused more times than the
    aggregator keeps reductions in flight."""
    gloo = start(timeout=20)
    world = dist.get_world_size()
    said, spans = {}, {}

    def attempt(what, call):
        began = time.monotonic()
        try:
            call()
            said[what] = None
        except Exception as err:
            said[what] = [type(err).__name__, str(err).split("\n")[0]]
        spans[what] = (began, time.monotonic())
    for what, call in [
            ("output size", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))),
            ("bxor", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32),
                                             op=dist.ReduceOp.BXOR)),
            ("int16", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16))),
            ("dtypes differ", lambda: dist.reduce_scatter_tensor(
                torch.empty(2, dtype=torch.int32), torch.ones(2 * world))),
            ("splits on rank 1 alone", lambda: dist.all_to_all_single(
                torch.empty(world * 2), torch.ones(world * 2),
                [2] * world, [2] * world if rank != 1 else [1] * world))]:
        attempt(what, call)
    alone = rank == 1
    big = 100_000  # the full-duplex all_reduce cuts it into pieces
    one_rank = [
        ("all_gather", lambda: dist.all_gather_into_tensor(
            torch.empty(3 if alone else 2 * world), torch.ones(2))),
        ("all_reduce", lambda: dist.all_reduce(
            torch.ones(big), op=dist.ReduceOp.BXOR if alone else dist.ReduceOp.SUM)),
        ("broadcast", lambda: dist.broadcast(
            torch.ones(5, device="meta" if alone else "cpu"), 0)),
        ("reduce_scatter list", lambda: dist.reduce_scatter(
            torch.empty(4), [torch.ones(4), torch.ones(4 if not alone else 5)] +
            [torch.ones(4)] * (world - 2)))]
    # more refused reductions than the aggregator keeps in flight for a communicator
    one_rank += [(f"reduce_scatter {i}", lambda: dist.reduce_scatter_tensor(
        torch.empty(1000, dtype=torch.int32),
        torch.ones(1000 * world, dtype=torch.float32 if alone else torch.int32)))
        for i in range(6)]
    for what, call in one_rank:
        dist.barrier(gloo)
        attempt(what, call)
    t = torch.full((big,), float(rank))
    dist.all_reduce(t)
    out = torch.empty(1000, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, torch.ones(1000 * world, dtype=torch.int32))
    said["usable"] = bool((t == sum(range(world))).all()) and bool((out == world).all())
    said["spans"] = spans
    dist.destroy_process_group()
    return said


ONE_RANK = ["all_gather", "all_reduce", "broadcast", "reduce_scatter list"] + \
    [f"reduce_scatter {i}" for i in range(6)]


@pytest.mark.parametrize("settings", ["ring", "fastest"])
def test_bad_arguments_raise_on_every_rank_and_leave_the_group_usable(settings):
    results = run_ranks(bad_arguments, loopback_placements(3, LINK if settings == "fastest"
                                                           else {}), timeout=90)
    for said in results:
        assert said["usable"], said
        for what in ("output size", "bxor", "int16", "dtypes differ", "splits on rank 1 alone"):
            assert said[what] and said[what][0] == "InvalidArgumentError", (what, said[what])
        assert "rank 1's split sizes" in said["splits on rank 1 alone"][1]
    for what in ONE_RANK:
        for rank, said in enumerate(results):
            kind, message = said[what]
            assert kind == "InvalidArgumentError", (rank, what, message)
            if rank != 1:
                assert "rank 1 refused the call" in message, (rank, what, message)
        reason = results[1][what][1]
        assert all(reason in said[what][1] for said in results), (what, reason)
        # every rank raised within a second of the last one's call
        began = max(said["spans"][what][0] for said in results)
        raised = max(said["spans"][what][1] for said in results)
        assert raised - began < 1.0, (what, raised - began)


def aborted(rank):
    """Rank 0 aborts the group while its all_reduce waits for rank 1's: the call fails on
    both, quickly, naming the abort; a call after shutdown raises at once."""
    gloo = start(timeout=20)
    group = dist.new_group([0, 1])
    began = time.monotonic()
    said = {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(100), group=group, async_op=True)
        dist.distributed_c10d._abort_process_group(group)
        try:
            work.wait()
        except Exception as err:
            said["error"] = [type(err).__name__, str(err)]
        try:
            group.allreduce([torch.ones(3)], dist.AllreduceOptions())
        except Exception as err:
            said["after"] = type(err).__name__
        dist.barrier(gloo)
    else:
        dist.barrier(gloo)
        try:
            dist.all_reduce(torch.ones(100), group=group)
        except Exception as err:
            said["error"] = [type(err).__name__, str(err)]
    said["seconds"] = time.monotonic() - began
    dist.destroy_process_group()
    return said


def test_abort_ends_the_calls_of_every_rank():
    results = run_ranks(aborted, loopback_placements(2), timeout=60)
    for said in results:
        assert "aborted" in said["error"][1], said
        assert said["seconds"] < 20, said
    assert results[0]["after"] == "CommunicatorClosedError"


def auto_disagrees(rank):
    """Rank 1's host cannot join the multicast group (its join fails as a host's does, with
    ENODEV), rank 0's can: both must run the ring where multicast would run, and beside it."""
    if rank == 1:
        import overcast.transport.rendezvous as rendezvous

        def no_multicast(*args):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        rendezvous.open_multicast = no_multicast
    dist.init_process_group("overcast", timeout=datetime.timedelta(seconds=30))
    t = torch.full((10000,), float(rank))
    dist.all_reduce(t)
    out = torch.empty(200)
    dist.all_gather_into_tensor(out, torch.full((100,), float(rank)))
    pg = dist.group.WORLD
    said = {"algorithms": dict(pg.algorithms), "fallbacks": dict(pg.fallbacks),
            "right": bool((t == 1).all()) and out.tolist() == [0.0] * 100 + [1.0] * 100}
    dist.destroy_process_group()
    return said


def test_auto_is_agreed_by_every_rank():
    for said in run_ranks(auto_disagrees, loopback_placements(2, LINK), timeout=60):
        assert said["right"]
        # rank 1 hears no probe either: the ReduceScatter takes the ring too, as overlap()'s
        assert said["algorithms"] == dict.fromkeys(("all_gather", "broadcast", "all_reduce",
                                                    "reduce_scatter"), "ring")
        for collective in ("all_gather", "broadcast", "all_reduce"):
            assert said["fallbacks"][collective].startswith("rank 1: multicast is unavailable")
        assert said["fallbacks"]["reduce_scatter"].startswith(
            "multicast not delivered: rank 1 (127.0.0.1) heard no other rank's multicast: an "
            "in-network ReduceScatter beside a ring AllGather")


def aggregator_from_a_thread(rank):
    """A group whose rank 0 starts an aggregator, made on a thread that then ends."""
    start()
    made = {}
    thread = threading.Thread(target=lambda: made.update(group=dist.new_group([0, 1])))
    thread.start()
    thread.join()
    t = torch.full((100000,), float(rank))
    dist.all_reduce(t, group=made["group"])
    said = {"algorithm": made["group"].algorithms["all_reduce"], "right": bool((t == 1).all())}
    dist.destroy_process_group()
    return said


def test_the_aggregator_lives_as_long_as_its_group_whatever_thread_made_it():
    for said in run_ranks(aggregator_from_a_thread, loopback_placements(2, LINK), timeout=60):
        assert said == {"algorithm": "fullduplex", "right": True}


def started_and_left(rank):
    """Start an aggregator, then end without stopping it."""
    proc, _ = start_aggregator("127.0.0.1", 0, secrets=["00" * 32])
    return proc.pid


def test_the_aggregator_exits_when_the_process_that_started_it_ends():
    (pid,) = run_ranks(started_and_left, loopback_placements(1), timeout=60)
    fd = os.pidfd_open(pid)
    try:
        readable, _, _ = select.select([fd], [], [], 20)  # readable once the process ended
    finally:
        os.close(fd)
    assert readable, f"the aggregator {pid} still runs"


def test_an_aggregator_that_never_says_where_it_listens_fails_in_time():
    began = time.monotonic()
    with pytest.raises(AggregatorStartError, match="within 1 s: no output"):
        start_aggregator("127.0.0.1", 0, secrets=["00" * 32], start_seconds=1,
                     prefix=("python3", "-c", "import time; time.sleep(60)"))
    assert time.monotonic() - began < 10


def test_ranks_meet_where_the_store_is_without_master_addr(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("localhost", port, 1, True, wait_for_workers=False)
    assert meeting_host(dist.PrefixStore("group/", store)) == "localhost"
    assert meeting_host(dist.HashStore()) == socket.gethostbyname(socket.gethostname())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert meeting_host(store) == "127.0.0.1"


def overlap_on_the_backend(rank):
    """overlap() on a model whose group is an "overcast" group: a choice the group cannot run
    raises on every rank and leaves the group's own communicator alone; a good one runs on a
    communicator of its own, and close() gives FSDP2 back its schedule."""
    start()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    import overcast.fsdp
    from overcast.torch_api import param_groups
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def schedule():
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        return ([[g.unshard_async_op for g in param_groups(m)] for m in modules],
                [(len(m._get_fsdp_state()._states_to_forward_prefetch),
                  len(m._get_fsdp_state()._states_to_backward_prefetch)) for m in modules])

    before = schedule()
    said = {}
    try:
        overcast.fsdp.overlap(model)  # multicast without a link rate
    except Exception as err:
        said["refused"] = [type(err).__name__, str(err)]
    t = torch.ones(5)
    dist.all_reduce(t)
    said["group_usable"] = t.tolist() == [float(dist.get_world_size())] * 5
    handle = overcast.fsdp.overlap(model, allgather="ring", reduce_scatter="ring")
    said["own_communicator"] = handle.comm is not dist.group.WORLD.communicator
    said["scheduled"] = schedule() != before
    model(torch.ones(3, 8)).sum().backward()
    handle.close()
    said["restored"] = schedule() == before
    dist.destroy_process_group()
    return said


def test_overlap_on_the_backend_keeps_the_group_and_restores_fsdp2():
    for said in run_ranks(overlap_on_the_backend, loopback_placements(2), timeout=60):
        assert said["refused"][0] == "InvalidArgumentError"
        assert "paces its senders to the link rate" in said["refused"][1]
        assert said["group_usable"] and said["own_communicator"], said
        assert said["scheduled"] and said["restored"], said
