"""overcast.fsdp: stock FSDP2 training through overcast (and through torch with the same overlap),
checked against a single-process unsharded reference, on real processes over loopback."""

import copy
import importlib
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

import overcast
import overcast.fsdp
from overcast.cluster.launch import RankError, loopback_placements, run_ranks
from overcast.engine.engine import Work
from overcast.fsdp.collectives import (GatedAllGathers, Poster, TimedWork, hold_poster,
                                       premultiplied, reduce_op, release_poster)
from overcast.fsdp.overlap import Overlap
from overcast.fsdp.timing import CommTime, InFlight
from overcast.torch_api import collectives, own_reduce_scatter_group, param_groups, premul_sum

HIDDEN = 37  # every unit's parameter count (37*37 = 1369; root 449) is divisible by no P in 2..4
ROWS = 12    # global batch, split evenly over 2, 3 or 4 ranks
LINK = {"OVERCAST_LINK_BITS_PER_S": "1e9"}  # loopback has no rate; multicast paces to this
# overcast.fsdp.overlap the module (the package's `overlap` is the function): what it keeps
OVERLAP_MODULE = importlib.import_module("overcast.fsdp.overlap")


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, HIDDEN, bias=False),
                         *[nn.Sequential(nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Tanh())
                           for _ in range(3)],
                         nn.Linear(HIDDEN, 5))


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 7, generator=g), torch.randn(ROWS, 5, generator=g)


def shard_model(model, mesh, **kwargs):
    from torch.distributed.fsdp import fully_shard
    for block in model[1:4]:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def local_rows(tensor, rank, world):
    n = ROWS // world
    return tensor[rank * n:(rank + 1) * n]


def my_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The rows FSDP2 keeps on `rank` (torch.chunk along dim 0, empty past the last chunk)."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def start():
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def one_step(rank, backend, allgather, reduce_scatter, mixed=False):
    """One forward, backward and SGD step, sharded through overcast.fsdp and unsharded in this
    process; the largest differences of the local gradient and parameter shards. `mixed` adds
    an int16 parameter to a block, so FSDP2 gathers that block as uint8 bytes."""
    mesh = start()
    world = dist.get_world_size()
    try:
        ref = small_model()
        if mixed:
            ref[2].register_parameter("count", nn.Parameter(
                torch.arange(5, dtype=torch.int16) * 1000, requires_grad=False))
        model = shard_model(copy.deepcopy(ref), mesh)
        options = {} if backend == "torch" else {"allgather": allgather,
                                                 "reduce_scatter": reduce_scatter}
        with overcast.fsdp.overlap(model, backend=backend, **options) as handle:
            x, y = batch(0)
            nn.functional.mse_loss(model(local_rows(x, rank, world)),
                                   local_rows(y, rank, world)).backward()
            nn.functional.mse_loss(ref(x), y).backward()
            grad_diff = max(max_diff(p.grad.to_local(), my_shard(q.grad, rank, world))
                            for p, q in zip(model.parameters(), ref.parameters())
                            if q.requires_grad)
            for m in (model, ref):
                torch.optim.SGD(m.parameters(), lr=0.5).step()
            param_diff = max(max_diff(p.to_local(), my_shard(q.detach(), rank, world))
                             for p, q in zip(model.parameters(), ref.parameters()))
            stats = handle.stats()
        return {"grad": grad_diff, "param": param_diff, "stats": stats}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend,allgather,reduce_scatter", [
    ("overcast", "multicast", "innetwork"), ("overcast", "ring", "ring"), ("torch", None, None)])
def test_one_step_equals_unsharded_reference(world, backend, allgather, reduce_scatter):
    results = run_ranks(one_step, loopback_placements(world, LINK),
                        args=(backend, allgather, reduce_scatter), timeout=120)
    for r in results:
        assert r["grad"] < 1e-6 and r["param"] < 1e-6, r
        # 4 AllGathers forward (root and 3 blocks) and 3 more for the blocks resharded after
        # forward; one ReduceScatter per unit.
        assert r["stats"]["allgathers"] == 7 and r["stats"]["reduce_scatters"] == 4, r


def algorithms(rank, options, sync):
    """One forward and backward through overlap(**options), gradient sync on or off: each
    collective's label and algorithm, in the order posted."""
    mesh = start()
    world = dist.get_world_size()
    try:
        model = shard_model(small_model(), mesh)
        with overcast.fsdp.overlap(model, trace=True, **options) as handle:
            model.set_requires_gradient_sync(sync)
            x, y = (local_rows(t, rank, world) for t in batch(0))
            nn.functional.mse_loss(model(x), y).backward()
            return [(span["label"], span["name"].split("(")[1].split(",")[0])
                    for span in handle.timeline()["spans"]]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("options,sync,forward,backward", [
    ({}, True, "ring", "multicast"),
    ({}, False, "ring", "ring"),
    ({"unpaired_allgather": None}, True, "multicast", "multicast"),
    ({"unpaired_allgather": None}, False, "multicast", "multicast"),
    ({"allgather": "ring"}, True, "ring", "ring")])
def test_an_allgather_is_multicast_only_where_a_reduce_scatter_runs_beside_it(
        options, sync, forward, backward):
    """By default the forward's AllGathers, and the backward's when gradients are not synced,
    run on the ring: nothing fills the other direction of the link beside them."""
    for used in run_ranks(algorithms, loopback_placements(2, LINK), args=(options, sync),
                          timeout=120):
        gathers = [algorithm for label, algorithm in used if label.startswith("AG")]
        assert gathers == [forward] * 4 + [backward] * 3, used
        scatters = [algorithm for label, algorithm in used if label.startswith("RS")]
        assert scatters == (["innetwork"] * 4 if sync else []), used


def fsdp_param_groups(model) -> list:
    """Every FSDP2 parameter group of `model`."""
    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in param_groups(m)]


def reduce_scatter_groups(model) -> list:
    """The process group each module's ReduceScatter hook runs on (None: the one FSDP2
    passes), or "default" where FSDP2's own ReduceScatter is back."""
    return [getattr(collectives(g)[1], "group", "default") for g in fsdp_param_groups(model)]


def reopened(rank, opens):
    """overlap(backend="torch") opened and closed `opens` times on one model, a step each, beside
    plain FSDP2 on another copy: the parameters' largest difference, whether every opening used
    the first one's ReduceScatter group (the object: a group made again would have its name),
    the number of groups alive after each close, and whether FSDP2 had its own collectives
    back after each."""
    mesh = start()
    world = dist.get_world_size()
    try:
        model, plain = shard_model(small_model(), mesh), shard_model(small_model(), mesh)
        groups, alive, released = [], [], []
        for step in range(opens):
            x, y = (local_rows(t, rank, world) for t in batch(step))
            with overcast.fsdp.overlap(model, backend="torch") as handle:
                nn.functional.mse_loss(model(x), y).backward()
                used = set(map(id, reduce_scatter_groups(model)))
                groups.append(used if used == {id(handle.reduce_scatter_group)} else None)
            alive.append(len(dist.distributed_c10d._world.pg_names))
            released.append(set(reduce_scatter_groups(model)) == {"default"})
            nn.functional.mse_loss(plain(x), y).backward()
            for m in (model, plain):
                torch.optim.SGD(m.parameters(), lr=0.5).step()
                m.zero_grad()
        diff = max(max_diff(p.to_local(), q.to_local())
                   for p, q in zip(model.parameters(), plain.parameters()))
        return {"diff": diff, "one_group": groups[0] is not None and groups == groups[:1] * opens,
                "alive": alive, "released": released}
    finally:
        dist.destroy_process_group()


def test_torch_backend_reopens_on_the_same_reduce_scatter_group():
    """A group made after one was destroyed takes its name in torch 2.13, and gloo's rendezvous
    can then read the destroyed group's keys and hang: overlap() keeps its group instead."""
    opens = 6
    for r in run_ranks(reopened, loopback_placements(4), args=(opens,), timeout=120):
        assert r["diff"] == 0.0, r
        assert r["one_group"] and r["alive"] == r["alive"][:1] * opens, r
        assert r["released"] == [True] * opens, r


def own_group(rank):
    """A model given a separate ReduceScatter group of its own before overlap(backend="torch"):
    whether overlap() left it to FSDP2 to pass, made none, and left it in place at close."""
    mesh = start()
    world = dist.get_world_size()
    try:
        model = shard_model(small_model(), mesh)
        model.set_separate_reduce_scatter_group(True)
        fsdp_groups = fsdp_param_groups(model)
        theirs = own_reduce_scatter_group(fsdp_groups[0])
        x, y = (local_rows(t, rank, world) for t in batch(0))
        with overcast.fsdp.overlap(model, backend="torch") as handle:
            nn.functional.mse_loss(model(x), y).backward()
            used = set(reduce_scatter_groups(model)) == {None}
            made = handle.reduce_scatter_group
        return {"used": used, "made": made,
                "given_back": all(own_reduce_scatter_group(g) is theirs for g in fsdp_groups),
                "kept": any(g is theirs for g in OVERLAP_MODULE._reduce_scatter_groups.values())}
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not hasattr(FSDPModule, "set_separate_reduce_scatter_group"),
                    reason="this torch has no set_separate_reduce_scatter_group (2.13 on)")
def test_torch_backend_uses_a_group_the_model_already_had():
    for r in run_ranks(own_group, loopback_placements(2), timeout=120):
        assert r == {"used": True, "made": None, "given_back": True, "kept": False}, r


def fails_part_way(rank):
    """overlap(backend="torch") where giving the second module its ReduceScatter fails
    (injected) after the first got one: what each module has after the error, whether the
    group made was kept, and a step through the next overlap() against plain FSDP2."""
    mesh = start()
    world = dist.get_world_size()
    try:
        model, plain = shard_model(small_model(), mesh), shard_model(small_model(), mesh)

        def fail(comm):
            raise RuntimeError("injected: no ReduceScatter for this module")
        model[2].set_custom_reduce_scatter = fail
        try:
            overcast.fsdp.overlap(model, backend="torch")
            error = None
        except RuntimeError as e:
            error = str(e)
        del model[2].set_custom_reduce_scatter
        after_error = reduce_scatter_groups(model)
        kept = list(OVERLAP_MODULE._reduce_scatter_groups.values())
        x, y = (local_rows(t, rank, world) for t in batch(0))
        with overcast.fsdp.overlap(model, backend="torch") as handle:
            nn.functional.mse_loss(model(x), y).backward()
            reused = bool(kept) and handle.reduce_scatter_group is kept[0] and \
                set(reduce_scatter_groups(model)) == {kept[0]}
        nn.functional.mse_loss(plain(x), y).backward()
        diff = max(max_diff(p.grad.to_local(), q.grad.to_local())
                   for p, q in zip(model.parameters(), plain.parameters()))
        return {"error": error, "after_error": after_error, "kept": len(kept),
                "reused": reused, "diff": diff}
    finally:
        dist.destroy_process_group()


def test_torch_backend_failing_part_way_gives_the_collectives_back():
    for r in run_ranks(fails_part_way, loopback_placements(2), timeout=120):
        assert r["error"] == "injected: no ReduceScatter for this module", r
        assert r["after_error"] == ["default"] * len(r["after_error"]), r
        assert r["kept"] == 1 and r["reused"] and r["diff"] == 0.0, r


def test_mixed_dtypes_travel_as_bytes(integer_parameters):
    for r in run_ranks(one_step, loopback_placements(3, LINK),
                       args=("overcast", "multicast", "innetwork", True), timeout=120):
        assert r["grad"] < 1e-6 and r["param"] < 1e-6, r


def mixed_precision(rank, steps):
    """The same bfloat16-compute, float32-reduce training through overcast and through gloo."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mesh = start()
    world = dist.get_world_size()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    try:
        ours = shard_model(small_model(), mesh, mp_policy=policy)
        theirs = shard_model(small_model(), mesh, mp_policy=policy)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
        losses = []
        with overcast.fsdp.overlap(ours):
            for step in range(steps):
                x, y = (local_rows(t, rank, world) for t in batch(step))
                for model, opt in zip((ours, theirs), opts):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
        diff = max(max_diff(p.to_local(), q.to_local())
                   for p, q in zip(ours.parameters(), theirs.parameters()))
        return {"param_diff": diff, "losses": losses,
                "dtype": str(next(ours.parameters()).dtype)}
    finally:
        dist.destroy_process_group()


def test_mixed_precision_matches_gloo():
    results = run_ranks(mixed_precision, loopback_placements(3, LINK), args=(3,), timeout=120)
    for r in results:
        assert r["dtype"] == "torch.float32"  # sharded parameters stay float32
        # float32 sums in another order: the same to float32 rounding after AdamW
        assert r["param_diff"] < 1e-5, r
        ours, theirs = r["losses"][0::2], r["losses"][1::2]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3, r


def bad_arguments(rank):
    """Every wrong use of overlap(), and the error each gets."""
    mesh = start()
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except overcast.InvalidArgumentError as err:
            errors[name] = str(err)
    try:
        model = shard_model(small_model(), mesh)
        attempt("plain module", lambda: overcast.fsdp.overlap(nn.Linear(3, 3)))
        attempt("backend", lambda: overcast.fsdp.overlap(model, backend="nccl"))
        attempt("allgather", lambda: overcast.fsdp.overlap(model, allgather="tree"))
        attempt("reduce_scatter", lambda: overcast.fsdp.overlap(model, reduce_scatter="tree"))
        attempt("unpaired_allgather",
                lambda: overcast.fsdp.overlap(model, unpaired_allgather="tree"))
        attempt("prefetch", lambda: overcast.fsdp.overlap(model, prefetch=-1))
        attempt("prefetch bool", lambda: overcast.fsdp.overlap(model, prefetch=True))
        attempt("defer", lambda: overcast.fsdp.overlap(model, defer_reduce_scatter="yes"))
        attempt("comm with torch", lambda: overcast.fsdp.overlap(model, backend="torch",
                                                                 comm=object()))
        swapped = overcast.Communicator(1 - rank, 2, name="swapped",
                                        store=dist.distributed_c10d._get_default_store())
        attempt("ranks", lambda: overcast.fsdp.overlap(model, comm=swapped,
                                                       allgather="ring", reduce_scatter="ring"))
        swapped.close()
        return errors
    finally:
        dist.destroy_process_group()


def test_wrong_arguments_get_named_errors():
    first, second = run_ranks(bad_arguments, loopback_placements(2), timeout=120)
    assert "rank 0 of 2, but the FSDP mesh makes this process rank 1 of 2" in second.pop("ranks")
    assert {**first, "ranks": None} == {**second, "ranks": None}  # the same words on every rank
    expect = {"plain module": "fully_shard() has been applied", "backend": "'nccl'",
              "allgather": "'tree'", "reduce_scatter": "'tree'",
              "unpaired_allgather": "unpaired_allgather='tree'", "prefetch": "-1",
              "prefetch bool": "True", "defer": "True or False, not 'yes'",
              "comm with torch": "backend='torch'",
              "ranks": "rank 1 of 2, but the FSDP mesh makes this process rank 0 of 2"}
    for name, words in expect.items():
        assert first[name] is not None and words in first[name], (name, first[name])


def integer_parameters_overlapped(rank):
    """overlap() on a model whose block mixes an int16 parameter with float32 weights (FSDP2
    gathers it as uint8 bytes: carried), and on one whose block holds the int16 parameter
    alone (gathered as int16: not carried): the error each raised, or None."""
    mesh = start()
    errors = {}
    try:
        mixed = small_model()
        mixed[1].register_parameter("count", nn.Parameter(torch.zeros(4, dtype=torch.int16),
                                                          requires_grad=False))
        odd = small_model()
        odd[1] = nn.Module()
        odd[1].register_parameter("count", nn.Parameter(torch.zeros(4, dtype=torch.int16),
                                                        requires_grad=False))
        for name, model, options in (("mixed dtypes", mixed, {"allgather": "ring",
                                                              "reduce_scatter": "ring"}),
                                     ("dtype", odd, {})):
            try:
                overcast.fsdp.overlap(shard_model(model, mesh), **options).close()
                errors[name] = None
            except overcast.InvalidArgumentError as e:
                errors[name] = str(e)
        return errors
    finally:
        dist.destroy_process_group()


def test_integer_parameters_travel_as_bytes_or_get_a_named_error(integer_parameters):
    first, second = run_ranks(integer_parameters_overlapped, loopback_placements(2),
                              timeout=120)
    assert first == second, (first, second)
    assert first["mixed dtypes"] is None
    assert "torch.int16" in first["dtype"], first


def test_multicast_without_a_link_rate_is_named_on_every_rank():
    def no_rate(rank):
        mesh = start()
        try:
            overcast.fsdp.overlap(shard_model(small_model(), mesh), reduce_scatter="ring")
        except overcast.InvalidArgumentError as err:
            return str(err)
        finally:
            dist.destroy_process_group()
    for message in run_ranks(no_rate, loopback_placements(2, {"OVERCAST_LINK_BITS_PER_S": ""}),
                             timeout=60):
        assert "multicast paces its senders to the link rate" in message


def test_reduce_ops():
    assert reduce_op(dist.ReduceOp.SUM) == "sum"
    assert reduce_op(dist.ReduceOp.AVG) == "avg"
    with pytest.raises(overcast.InvalidArgumentError, match="ReduceOp.MAX"):
        reduce_op(dist.ReduceOp.MAX)
    grads = torch.tensor([1.0, -2.0, 4.0])
    assert premultiplied(premul_sum(0.25), grads, None) == dist.ReduceOp.SUM
    assert grads.tolist() == [0.25, -0.5, 1.0]  # scaled in place, as NCCL's PreMulSum does
    assert premultiplied(dist.ReduceOp.AVG, grads, None) == dist.ReduceOp.AVG
    assert grads.tolist() == [0.25, -0.5, 1.0]


def dies_mid_step(rank, victim):
    """Train; the victim kills itself in the middle of the second backward. The others return
    the error they got and how long after the death it came."""
    mesh = start()
    world = dist.get_world_size()
    model = shard_model(small_model(), mesh)
    handle = overcast.fsdp.overlap(model)
    died = []

    def hook(module, grad_in, grad_out):
        died.append(time.monotonic())
        if rank == victim and len(died) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    model[2].register_full_backward_hook(hook)
    try:
        for step in range(3):
            x, y = (local_rows(t, rank, world) for t in batch(step))
            nn.functional.mse_loss(model(x), y).backward()
        return {"error": None}
    except overcast.OvercastError as err:
        return {"error": type(err).__name__, "message": str(err),
                "seconds": time.monotonic() - died[-1], "timeout": handle.comm.timeout}
    finally:
        handle.close()


def test_rank_killed_mid_step_fails_the_others():
    with pytest.raises(RankError) as info:
        run_ranks(dies_mid_step, loopback_placements(3, LINK), args=(2,), timeout=120)
    assert set(info.value.failures) == {2}
    for r in info.value.results[:2]:
        assert r["error"] == "PeerFailureError", r
        assert "rank 2" in r["message"] and r["seconds"] < r["timeout"], r


def aggregator_fails(rank):
    mesh = start()
    try:
        overcast.fsdp.overlap(shard_model(small_model(), mesh))
    except overcast.OvercastError as err:
        return str(err)
    finally:
        dist.destroy_process_group()


def test_an_aggregator_that_cannot_start_is_named_on_every_rank():
    """Rank 0 starts the aggregator on an address this machine does not have: every rank gets
    the reason, none waits for an address that never comes."""
    placements = loopback_placements(3, LINK)
    placements[0].env["OVERCAST_ADDR"] = "198.18.254.254"
    for message in run_ranks(aggregator_fails, placements, timeout=60):
        assert "the aggregator did not start" in message, message


def reduce_scatter_through_job_communicator(rank):
    """gloo's reduce_scatter_tensor against overcast's in-network one on a Communicator made
    by job_communicator() (rank 0 starts the aggregator: no OVERCAST_AGGREGATORS here)."""
    start()
    try:
        world = dist.get_world_size()
        grads = torch.arange(world * 1000, dtype=torch.float32) * (rank + 1)
        expected, out = torch.empty(1000), torch.empty(1000)
        dist.reduce_scatter_tensor(expected, grads)
        with overcast.fsdp.job_communicator() as comm:
            comm.reduce_scatter(out, grads, algorithm="innetwork")
            results = comm.counters().get("results", 0)  # sums the aggregator sent this rank
        return [bool(torch.equal(out, expected)), comm.world_size, results > 0]
    finally:
        dist.destroy_process_group()


def test_job_communicator_starts_the_aggregator_and_reduces_in_network():
    results = run_ranks(reduce_scatter_through_job_communicator, loopback_placements(3, LINK),
                        timeout=120)
    assert results == [[True, 3, True]] * 3


def test_a_posted_collective_waits_its_timeout_in_all():
    """wait(timeout) on a GPU collective the poster thread posts late: the timeout covers the
    posting and the collective together (it used to wait it for each)."""
    poster, copied_in = Poster(refuse=lambda error: None), threading.Event()
    never = Work(0, "all_gather")  # never completes
    handle = poster.submit(copied_in.wait, lambda: never, "AG blocks.1", CommTime())
    timer = threading.Timer(0.6, copied_in.set)
    timer.start()
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        handle.wait(1.0)
    timer.join()
    assert time.monotonic() - began < 1.4
    poster.close()


def test_a_poster_outlives_calls_that_fail():
    """Each call's failure (its input's copy, its posting, the `done` that opens its gate) is
    that call's error alone: every call's `done` runs once, and the poster goes on to the
    next (a `done` that raised ended its thread, and every later wait hung)."""
    refused: list[BaseException] = []
    poster, times, ran = Poster(refused.append), CommTime(), []

    def raise_(error):
        raise error

    def done(name, error=None):
        def run():
            ran.append(name)
            if error is not None:
                raise error
        return run

    finished = Work(7, "all_gather")
    finished._finish(None)
    calls = [
        (lambda: raise_(RuntimeError("the copy in failed")), lambda: finished,
         done("copy", ValueError("the gate"))),
        (lambda: None, lambda: raise_(OSError("posting failed")), done("post")),
        (lambda: None, lambda: finished, done("done", ValueError("the gate did not open"))),
        (lambda: None, lambda: finished, done("fine")),
    ]
    handles = [poster.submit(ready, post, "AG blocks.1", times, finish)
               for ready, post, finish in calls]
    said = []
    for handle in handles:
        try:
            said.append(handle.wait(30))
        except (RuntimeError, OSError, ValueError) as err:
            said.append(str(err))
    poster.close()
    assert said == ["the copy in failed", "posting failed", "the gate did not open", True]
    assert ran == ["copy", "post", "done", "fine"]
    # the peers post the call whose copy in failed: it is refused to them, in its place
    assert [str(error) for error in refused] == ["the copy in failed"]


def beside_the_poster(rank):
    """Rank 0's poster holds an AllGather until its input is "on the host" while the program
    goes on to an all_reduce of its own on the same communicator; rank 1 calls both itself.
    (Rank 0: whether the all_reduce was still held after 2 s, and both results.)"""
    with overcast.Communicator(timeout=30) as comm:
        gathered, summed = torch.empty(200, dtype=torch.int32), torch.full((4,), rank + 1.0)
        shard = torch.full((100,), rank, dtype=torch.int32)
        if rank == 1:
            comm.all_gather(gathered, shard)
            comm.all_reduce(summed)
            return [None, summed.tolist(), gathered.tolist()]
        poster, copied_in = hold_poster(comm), threading.Event()
        handle = poster.submit(copied_in.wait,
                               lambda: comm.all_gather(gathered, shard, async_op=True),
                               "AG blocks.1", CommTime())
        said = []

        def program_goes_on():
            try:
                comm.all_reduce(summed)
                said.append("ok")
            except overcast.OvercastError as err:
                said.append(f"{type(err).__name__}: {err}")
        program = threading.Thread(target=program_goes_on)
        program.start()
        program.join(2.0)
        held = program.is_alive()
        copied_in.set()
        program.join()
        try:
            handle.wait(30)
        except overcast.OvercastError as err:
            said.append(f"{type(err).__name__}: {err}")
        release_poster(comm)
        return [held, said, summed.tolist(), gathered.tolist()]


def test_a_collective_the_program_calls_is_numbered_after_what_the_poster_holds():
    """overlap(comm=) on a GPU: FSDP2's collectives are posted by the poster once their input
    is on the host, and the program's own collective on that communicator waits until the
    poster has posted what it was handed before, so it takes the same number on every rank
    (it was numbered first on rank 0, which met rank 1's AllGather)."""
    first, second = run_ranks(beside_the_poster, loopback_placements(2), timeout=120)
    assert first == [True, ["ok"], [3.0] * 4, [0] * 100 + [1] * 100], first
    assert second == [None, [3.0] * 4, [0] * 100 + [1] * 100]


def failed_work(seq: int, collective: str) -> Work:
    """A collective of the engine's, failed: a peer lost."""
    failed = Work(seq, collective)
    failed._finish(overcast.PeerFailureError("lost the connection to rank 1"))
    return failed


def gated_allgather(poster, times, ready, label="blocks.1"):
    """An AllGather the poster posts once `ready()` returns, whose collective fails (a peer
    lost), as a gated one's TimedWork holds it."""
    failed = failed_work(3, "all_gather")
    name = f"overcast AllGather {label} (ring)"
    handle = poster.submit(ready, lambda: failed, f"AG {label}", times)
    return TimedWork(handle, times, InFlight(times, "AG", label, name), name)


def test_a_gated_allgathers_failure_is_raised_by_the_next_call_once():
    """A forward pass's AllGather whose wait() did not block: its failure is raised by the
    next collective call that finds it, naming it, and only once."""
    poster, gathers = Poster(lambda error: None), GatedAllGathers()
    times = CommTime(keep_labels=True)
    gathers.add(gated_allgather(poster, times, lambda: None))
    poster.close()  # posted, and failed
    with pytest.raises(overcast.PeerFailureError, match="rank 1") as raised:
        gathers.check()
    assert raised.value.__notes__ == ["(in overcast AllGather blocks.1 (ring))"]
    gathers.check()
    assert [span[:2] for span in times.spans] == [("AG", "blocks.1")]  # its range ended


def test_a_gated_allgathers_failure_is_raised_as_the_backward_pass_ends():
    """Still in flight at a collective call of the backward pass (its input not yet on the
    host), an AllGather of the forward pass fails later: backward() raises it, naming it."""
    poster, times, gathers = Poster(lambda error: None), CommTime(), GatedAllGathers()
    on_host = threading.Event()
    gathers.add(gated_allgather(poster, times, on_host.wait, "blocks.2"))

    class ACollectiveCall(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            gathers.check()  # finds it in flight
            on_host.set()
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    with pytest.raises(overcast.PeerFailureError) as raised:
        ACollectiveCall.apply(x).sum().backward()
    assert raised.value.__notes__ == ["(in overcast AllGather blocks.2 (ring))"]
    poster.close()
    assert times.wait_seconds > 0


@pytest.mark.parametrize("leaving", [None, KeyError("the loop's own error")])
def test_an_allgathers_failure_nothing_raised_is_raised_by_close(leaving):
    """The last forward pass of an evaluation: its gated AllGather fails after its wait() and no
    later call finds it, so its parameters held whatever the host buffer held. close() raises
    it; a `with` block left with an error of its own keeps that one."""
    poster, times = Poster(lambda error: None), CommTime()
    handle = Overlap(nn.Linear(2, 2), None, times)
    handle._gathers.add(gated_allgather(poster, times, lambda: None))
    poster.close()  # posted, and failed
    if leaving is None:
        with pytest.raises(overcast.PeerFailureError, match="rank 1"):
            handle.close()
    else:
        with pytest.raises(KeyError), handle:
            raise leaving


def test_close_waits_for_every_reduce_scatter_left_whichever_failed():
    """A backward pass that raised leaves its ReduceScatters in flight: close() waits for each,
    the second too when the first failed (it stopped at the first, and closed the communicator
    under the rest)."""
    times = CommTime()
    handle = Overlap(nn.Linear(2, 2), None, times)
    for seq, label in enumerate(["blocks.1", "blocks.2"]):
        name = f"overcast ReduceScatter {label} (ring)"
        handle._deferred._works.append(TimedWork(
            failed_work(seq, "reduce_scatter"), times, InFlight(times, "RS", label, name), name))
    handle.close()
    assert len(handle._deferred._works) == 0
