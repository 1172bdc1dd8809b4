"""The "overcast" torch.distributed backend (overcast.distributed) between real processes over
loopback: every collective and reduce op against gloo's result in the same job, DDP and FSDP2
trained on it against a single-process reference, a subgroup, and the named errors."""

import copy
import datetime
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import overcast
import overcast.distributed
import overcast.fsdp
from overcast.cluster.launch import RankError, loopback_placements, run_ranks
from overcast.torch_api import premul_sum

LINK = {"OVERCAST_LINK_BITS_PER_S": "1e9"}  # loopback has no rate; multicast paces to this
SETTINGS = {"ring": {}, "fastest": LINK}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.int8]
SIZES = [1, 7, 1001, 65537]  # none divisible by 2, 3 or 4 but the first
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def start(timeout=60):
    torch.set_num_threads(1)
    dist.init_process_group("overcast", timeout=datetime.timedelta(seconds=timeout))
    return dist.new_group(backend="gloo")


def values(rank, count, dtype, modulus=5):
    """Small integers (exact in every dtype, their sums and products over 4 ranks too)."""
    ints = (torch.arange(count) * 3 + rank) % modulus + (1 if dtype.is_floating_point else 0)
    return ints.to(dtype)


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8),
                                                                      b.view(torch.uint8))


def against_gloo(rank, device="cpu", dtypes=DTYPES):
    """Each collective, op, dtype and size on the backend, with tensors on `device`, and on gloo
    with CPU tensors (gloo's CUDA path stages to the host and runs the same reduction); the cases
    that differ."""
    gloo = start()
    if device == "cuda":
        torch.cuda.set_device(0)
    world = dist.get_world_size()
    differ = []

    def agrees(a, b) -> bool:
        return a.device.type == device and same(a.cpu(), b)

    def placed(rank, count, dtype):
        return values(rank, count, dtype).to(device)

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=device)
    for dtype in dtypes:
        for count in SIZES:
            case = f"{dtype} x {count}"
            for name, op in OPS.items():
                mine, theirs = placed(rank, count, dtype), values(rank, count, dtype)
                dist.all_reduce(mine, op=op)
                if name == "avg" and not dtype.is_floating_point:  # NCCL's: the sum truncated
                    dist.all_reduce(theirs, group=gloo)
                    theirs = torch.div(theirs, world, rounding_mode="trunc")
                elif name == "avg":  # gloo has no AVG: its exact sum, divided, rounded once
                    total = theirs.double()
                    dist.all_reduce(total, group=gloo)
                    theirs = (total / world).to(dtype)
                else:
                    dist.all_reduce(theirs, op=op, group=gloo)
                if not agrees(mine, theirs):
                    differ.append(f"all_reduce {name} {case}")
                if name == "avg":
                    continue
                big = placed(rank, count * world, dtype)
                mine, theirs = empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
                dist.reduce_scatter_tensor(mine, big, op=op)
                dist.reduce_scatter_tensor(theirs, big.cpu(), op=op, group=gloo)
                if not agrees(mine, theirs):
                    differ.append(f"reduce_scatter {name} {case}")
            mine, theirs = empty(count * world, dtype=dtype), torch.empty(count * world,
                                                                          dtype=dtype)
            dist.all_gather_into_tensor(mine, placed(rank, count, dtype))
            dist.all_gather_into_tensor(theirs, values(rank, count, dtype), group=gloo)
            if not agrees(mine, theirs):
                differ.append(f"all_gather {case}")
            for root in range(world):
                mine, theirs = placed(rank, count, dtype), values(rank, count, dtype)
                dist.broadcast(mine, root)
                dist.broadcast(theirs, root, group=gloo)
                if not agrees(mine, theirs):
                    differ.append(f"broadcast root {root} {case}")
    # The list forms, PREMUL_SUM, coalesced all_reduce, all_to_all, bool and complex tensors.
    outs = [empty(3, dtype=torch.bool) for _ in range(world)]
    dist.all_gather(outs, torch.tensor([rank % 2 == 0, True, False], device=device))
    if not all(agrees(o, torch.tensor([r % 2 == 0, True, False])) for r, o in enumerate(outs)):
        differ.append("all_gather list bool")
    ins = [placed(rank + r, 11, torch.float32) for r in range(world)]
    mine, theirs = empty(11), torch.empty(11)
    dist.reduce_scatter(mine, ins)
    dist.reduce_scatter(theirs, [i.cpu() for i in ins], group=gloo)
    if not agrees(mine, theirs):
        differ.append("reduce_scatter list")
    mine = placed(rank, 1001, torch.float32)
    dist.all_reduce(mine, op=premul_sum(0.5))
    theirs = values(rank, 1001, torch.float32) * 0.5
    dist.all_reduce(theirs, group=gloo)
    if not agrees(mine, theirs):
        differ.append("all_reduce premul_sum")
    complex_in = torch.complex(placed(rank, 101, torch.float32), placed(rank + 1, 101,
                                                                        torch.float32))
    mine, theirs = complex_in.clone(), complex_in.cpu()
    dist.all_reduce(mine)
    dist.all_reduce(theirs, group=gloo)
    if not agrees(mine, theirs):
        differ.append("all_reduce complex64")
    tensors = [placed(rank, n, torch.float32) for n in (5, 1001, 3)]
    copies = [t.cpu() for t in tensors]
    dist.all_reduce_coalesced(tensors)
    for t in copies:
        dist.all_reduce(t, group=gloo)
    if not all(agrees(a, b) for a, b in zip(tensors, copies)):
        differ.append("all_reduce_coalesced")
    splits = [(rank + r) % 3 + 1 for r in range(world)]  # uneven, different on every rank
    received = [(r + rank) % 3 + 1 for r in range(world)]
    send = torch.arange(sum(splits) * 2, dtype=torch.int64).view(-1, 2) + 1000 * rank
    mine = empty(sum(received), 2, dtype=torch.int64)
    theirs = torch.empty(sum(received), 2, dtype=torch.int64)
    dist.all_to_all_single(mine, send.to(device), received, splits)
    dist.all_to_all_single(theirs, send, received, splits, group=gloo)
    if not agrees(mine, theirs):
        differ.append("all_to_all_single uneven")
    # empty blocks (rank r sends rank d nothing when r + d is even), rows of 3 x 2, bool; even
    # splits; the list form
    splits = [0 if (rank + d) % 2 == 0 else d + 1 for d in range(world)]
    received = [0 if (s + rank) % 2 == 0 else rank + 1 for s in range(world)]
    send = (torch.arange(sum(splits) * 6).view(-1, 3, 2) + rank) % 3 == 0
    mine = empty(sum(received), 3, 2, dtype=torch.bool)
    theirs = torch.empty(sum(received), 3, 2, dtype=torch.bool)
    dist.all_to_all_single(mine, send.to(device), received, splits)
    dist.all_to_all_single(theirs, send, received, splits, group=gloo)
    if not agrees(mine, theirs):
        differ.append("all_to_all_single empty blocks")
    send = placed(rank, 4 * world, torch.float64)
    mine, theirs = empty(4 * world, dtype=torch.float64), torch.empty(4 * world,
                                                                     dtype=torch.float64)
    dist.all_to_all_single(mine, send)
    dist.all_to_all_single(theirs, send.cpu(), group=gloo)
    if not agrees(mine, theirs):
        differ.append("all_to_all_single even")
    # the list form, against what each rank sent (torch 2.11's gloo lacks it)
    ins = [placed(rank * world + d, 3, torch.int32) for d in range(world)]
    mine = [empty(3, dtype=torch.int32) for _ in range(world)]
    dist.all_to_all(mine, ins)
    sent = [placed(s * world + rank, 3, torch.int32) for s in range(world)]
    if not all(agrees(a, b) for a, b in zip(mine, sent)):
        differ.append("all_to_all list")
    # each rank sends and receives only its blocks: 64 KiB rows, rank d getting d + 1 of them
    comm = dist.group.WORLD.communicator
    before = comm.counters()
    row = 64 << 10
    send = torch.full(((world * (world + 1)) // 2, row), rank, dtype=torch.uint8)
    dist.all_to_all_single(empty(world * (rank + 1), row, dtype=torch.uint8), send.to(device),
                           [rank + 1] * world, [d + 1 for d in range(world)])
    after = comm.counters()
    out = after["stream_bytes_out"] - before["stream_bytes_out"]
    into = after["stream_bytes_in"] - before["stream_bytes_in"]
    data_out = sum(d + 1 for d in range(world) if d != rank) * row
    data_in = (world - 1) * (rank + 1) * row
    if not (data_out <= out < data_out + 16384 and data_in <= into < data_in + 16384):
        differ.append(f"all_to_all bytes: out {out} for {data_out}, in {into} for {data_in}")
    # Integer AVG, as NCCL's: the sum divided and truncated toward zero, on the backend and on
    # the group's Communicator, negative sums and positive, against the exact integers.
    base = [-29, -7, -5, -4, -3, -1, 0, 1, 3, 4, 5, 7, 29]  # sums within int8 at P = 4
    sums = [world * b + world * (world - 1) // 2 for b in base]
    exact = [abs(s) // world * (1 if s >= 0 else -1) for s in sums]
    for dtype in (torch.int8, torch.int32, torch.int64):
        mine = (torch.tensor(base) + rank).to(dtype).to(device)
        dist.all_reduce(mine, op=dist.ReduceOp.AVG)
        arr = (torch.tensor(base) + rank).to(dtype).numpy()
        dist.group.WORLD.communicator.all_reduce(arr, "avg",
                                                 dist.group.WORLD.algorithms["all_reduce"])
        if mine.tolist() != exact or arr.tolist() != exact:
            differ.append(f"all_reduce avg {dtype} of negative and positive sums: "
                          f"{mine.tolist()}, {arr.tolist()}, not {exact}")
    work = dist.all_reduce(placed(rank, 3, torch.float32), async_op=True)
    work.wait()
    if not isinstance(work, dist.Work):
        differ.append("async work")
    dist.barrier()
    algorithms = dict(dist.group.WORLD.algorithms)
    dist.destroy_process_group()
    return {"differ": differ, "algorithms": algorithms}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("settings", ["ring", "fastest"])
def test_collectives_agree_with_gloo(world, settings):
    results = run_ranks(against_gloo, loopback_placements(world, SETTINGS[settings]),
                        timeout=300)
    for r in results:
        assert r["differ"] == [], r["differ"]
    expected = ({"all_gather": "ring", "reduce_scatter": "ring", "all_reduce": "ring",
                 "broadcast": "ring"} if settings == "ring" else
                {"all_gather": "multicast", "reduce_scatter": "innetwork",
                 "all_reduce": "fullduplex", "broadcast": "multicast"})
    assert results[0]["algorithms"] == expected


def refusals(rank):
    """What the backend refuses, and the message each gives."""
    start()
    said = {}
    for what, call in [
            ("bxor", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32),
                                             op=dist.ReduceOp.BXOR)),
            ("int16 sum", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16))),
            ("complex max", lambda: dist.all_reduce(torch.ones(3, dtype=torch.complex64),
                                                    op=dist.ReduceOp.MAX)),
            ("tag", lambda: dist.isend(torch.ones(3), rank, tag=-1).wait())]:
        try:
            call()
            said[what] = None
        except Exception as err:  # torch re-raises the worker's error as its own type
            said[what] = str(err)
    dist.destroy_process_group()
    return said


def test_unsupported_ops_and_dtypes_are_named():
    said = run_ranks(refusals, loopback_placements(1), timeout=60)[0]
    assert "BXOR" in said["bxor"] and "SUM, AVG, PREMUL_SUM, MAX, MIN, PRODUCT" in said["bxor"]
    assert "torch.int16" in said["int16 sum"] and "supported" in said["int16 sum"]
    assert "complex" in said["complex max"]
    assert "tag -1 is not a whole number from 0 to 4294967294" in said["tag"]


def just_start(rank):
    start()


def test_an_unknown_algorithm_is_named():
    with pytest.raises(RankError) as info:
        run_ranks(just_start, loopback_placements(1, {"OVERCAST_ALL_REDUCE": "tree"}),
                  timeout=60)
    for message in info.value.failures.values():
        assert "OVERCAST_ALL_REDUCE='tree' is not one of auto, ring, fullduplex" in message


def subgroup(rank):
    """Collectives on the even ranks' group while the odd ones stay out of it."""
    start()
    evens = dist.new_group([0, 2])
    result = None
    if rank in (0, 2):
        t = torch.full((1001,), float(rank + 1))
        dist.all_reduce(t, group=evens)
        out = torch.empty(2 * 5, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.full((5,), rank), group=evens)
        result = [bool((t == 4).all()), out.tolist(), evens.getBackendName()]
    dist.barrier()
    dist.destroy_process_group()
    return result


def test_subgroup():
    results = run_ranks(subgroup, loopback_placements(4, LINK), timeout=120)
    assert results[1] is None and results[3] is None
    for r in (results[0], results[2]):
        assert r == [True, [0] * 5 + [2] * 5, "overcast"]


def mismatched(rank):
    start(timeout=20)
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(10))
        else:
            dist.all_gather_into_tensor(torch.empty(20), torch.ones(10))
        return None
    except Exception as err:
        return [type(err).__name__, str(err)]
    finally:
        dist.destroy_process_group()


def test_mismatched_calls_are_named():
    for kind, message in run_ranks(mismatched, loopback_placements(2), timeout=60):
        assert kind == "CollectiveMismatchError", (kind, message)
        # the group's first two collectives agreed its algorithms (ProcessGroupOvercast._agree)
        assert "collective #2 differs across ranks" in message
        assert "rank 1 issued all_gather" in message and "rank 0 issued reduce_scatter" in message


def killed(rank):
    start(timeout=20)
    dist.all_reduce(torch.ones(10))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100000))
        return None
    except Exception as err:
        said = {"kind": type(err).__name__, "message": str(err),
                "seconds": time.monotonic() - began}
    began = time.monotonic()
    dist.destroy_process_group()
    said["destroy_seconds"] = time.monotonic() - began
    return said


def test_a_killed_rank_is_named_and_destroy_returns_within_the_timeout():
    with pytest.raises(RankError) as info:
        run_ranks(killed, loopback_placements(3), timeout=120)
    assert set(info.value.failures) == {1}
    for r in (info.value.results[0], info.value.results[2]):
        assert r["kind"] == "PeerFailureError" and "rank 1" in r["message"], r
        assert r["seconds"] < 20 and r["destroy_seconds"] < 20, r


HIDDEN, ROWS, STEPS = 37, 12, 3


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, 5))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 7, generator=g), torch.randn(ROWS, 5, generator=g)


def train(rank, how, device="cpu"):
    """STEPS of SGD with DDP, FSDP2 alone, or FSDP2 with overlap(), on the backend with the
    model on `device`, and on one process unsharded on the CPU; the largest difference of the
    parameters after, and of the losses."""
    start()
    if device == "cuda":
        torch.cuda.set_device(0)
    world = dist.get_world_size()
    ref = small_model()
    model = copy.deepcopy(ref).to(device)
    handle = None
    if how == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device, (world,))  # FSDP2's default follows the accelerator
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if how == "overlap":
            handle = overcast.fsdp.overlap(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (model, ref)]
    rows = ROWS // world
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows].to(device)),
                                      y[rank * rows:(rank + 1) * rows].to(device))
        loss.backward()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        whole = loss.detach().clone()
        dist.all_reduce(whole, op=dist.ReduceOp.AVG)
        losses.append(abs(whole.item() - ref_loss.item()))
        for o in opts:
            o.step()
            o.zero_grad()
    if how == "ddp":
        diff = max((p.cpu() - q).abs().max().item()
                   for p, q in zip(model.module.parameters(), ref.parameters()))
    else:
        diff = max((p.to_local().cpu() - torch.chunk(q.detach(), world)[rank]).abs().max().item()
                   for p, q in zip(model.parameters(), ref.parameters()))
    # overlap() runs on a communicator of its own beside the group's (the group's worker posts
    # the group's calls; on a GPU, overlap()'s poster posts FSDP2's)
    own = handle is None or handle.comm is not dist.group.WORLD.communicator
    if handle is not None:
        handle.close()
    dist.destroy_process_group()
    return {"param": diff, "loss": max(losses), "own_communicator": own}


@pytest.mark.parametrize("how", ["ddp", "fsdp", "overlap"])
def test_training_on_the_backend_matches_one_process(how):
    for r in run_ranks(train, loopback_placements(3, LINK), args=(how,), timeout=180):
        assert r["param"] < 1e-5 and r["loss"] < 1e-5 and r["own_communicator"], r


def names_and_meshes(rank):
    """As PyTorch's test_c10d_pypg.py checks a Python process group: the backend's name, the
    groups' names as torch resolves them, a 2-D DeviceMesh's subgroups, and a DDP comm hook
    chained on the Work's future."""
    start()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    world = dist.get_world_size()
    pg = dist.group.WORLD
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard = mesh.get_group("shard")
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=shard)
    mine = [r for r in range(world) if r // (world // 2) == rank // (world // 2)]
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model(torch.ones(4, 3)).sum().backward()
    grads = model.module.weight.grad.clone()
    dist.all_reduce(grads, op=dist.ReduceOp.MAX)
    same_grads = torch.equal(grads, model.module.weight.grad)
    out = {"backend": dist.get_backend(), "name": pg.getBackendName(),
           "resolves": dist.distributed_c10d._resolve_process_group(pg.group_name) is pg,
           "shard_backend": shard.getBackendName(), "distinct": shard.group_name != pg.group_name,
           "shard_sum": bool((t == sum(mine)).all()), "hooked_ddp_agrees": same_grads}
    dist.destroy_process_group()
    return out


def test_names_meshes_and_ddp_hooks():
    for r in run_ranks(names_and_meshes, loopback_placements(4), timeout=120):
        assert r == {"backend": "overcast", "name": "overcast", "resolves": True,
                     "shard_backend": "overcast", "distinct": True, "shard_sum": True,
                     "hooked_ddp_agrees": True}, r


def example_losses(script: str, *args: str, ranks: int = 4, steps: int = 8, rows: int = 64,
                   env: dict | None = None) -> list[float]:
    """The losses rank 0 of examples/`script` prints, step by step, under torchrun."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(ranks), os.path.join(root, "examples", script),
                          "--steps", str(steps), "--batch", str(rows), *args],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, **(env or {})})
    # A rank's own words come long before torchrun's tail.
    assert run.returncode == 0, ([line for line in run.stderr.splitlines()
                                  if "terminate" in line or "Error" in line][-20:],
                                 run.stderr[-1500:])
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines()
              if line.startswith("step")]
    assert len(losses) == steps, run.stdout
    return losses


def assert_one_process_losses(losses: list[float], rows: int = 64) -> None:
    """`losses` are, within 1e-5 relative (float32 sums taken in another order), those of one
    process training examples/ddp_train.py's model on the whole batch: the ranks' gradients of
    equal row counts averaged, as DDP and FSDP2 do."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "ddp_train", os.path.join(root, "examples", "ddp_train.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    expected = example.one_process_losses(len(losses), rows)
    for a, b in zip(losses, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, expected)


def test_the_ddp_example_trains_as_one_process_would():
    """examples/ddp_train.py under torchrun, 4 processes on overcast, trains as one process on the
    whole batch. The reference is computed here rather than by a gloo run: gloo in torch 2.13 can
    abort at exit after training correctly (docs/fsdp.md), which would fail this test for gloo's
    sake."""
    assert_one_process_losses(example_losses("ddp_train.py"))


def test_the_gpu_example_through_overlap_trains_as_one_process_would_on_cpu():
    """examples/gpu_train.py's FSDP2 through overlap(), with --device cpu (the GPU run is
    tests/test_cuda.py's), 2 processes: the losses of one process on the whole batch."""
    assert_one_process_losses(example_losses(
        "gpu_train.py", "--way", "overlap", "--device", "cpu", ranks=2, steps=4,
        env={"OVERCAST_LINK_BITS_PER_S": "10e9"}))
