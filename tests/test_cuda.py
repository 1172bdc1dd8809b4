"""overcast with CUDA tensors, on a machine with a GPU (skipped elsewhere, saying why): the
backend's collectives bit-exact against gloo's, the caller's stream ordering kept, DDP and FSDP2
(alone and through overlap()) trained on the GPU as one process trains on the CPU, and the pinned
host memory of the staging reused, bounded, and the GPU's memory flat (also with stats() never
read); more stream gates in flight than the ring has slots; the process's pinned memory after a
demand over the pool's limit; FSDP2's collectives through the poster and stream gates: the
caller's stream order kept, a failed collective's gate opened, an AllGather's wait() not blocking
the host; examples/gpu_train.py under torchrun; point-to-point against gloo. Every rank shares
the machine's first GPU. `tools/cuda_checks` runs these with one line per check."""

import gc
import os
import queue
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import overcast
import overcast.fsdp
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.errors import InvalidArgumentError
from overcast.fsdp.collectives import (GatedAllGathers, TimedAllGather, TimedReduceScatter,
                                       hold_poster, release_poster)
from overcast.fsdp.timing import CommTime
from overcast.staging import process_pool, stream_gates
from test_backend import (LINK, SETTINGS, against_gloo, assert_one_process_losses, batch,
                          example_losses, same, small_model, start, train)
from test_backend_p2p import COPY_BYTES, exchanges

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU here (torch.cuda.is_available() is False)")

CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
SPIN = 50_000_000  # GPU cycles torch.cuda._sleep keeps a stream busy: tens of milliseconds


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("settings", ["ring", "fastest"])
def test_cuda_collectives_agree_with_gloo(world, settings):
    results = run_ranks(against_gloo, loopback_placements(world, SETTINGS[settings]),
                        args=("cuda", CUDA_DTYPES), timeout=300)
    for r in results:
        assert r["differ"] == [], r["differ"]


def stream_order(rank):
    """Each of FSDP2's collectives, and all_reduce, with the caller's stream kept busy before
    the call: what the stream queued before the call reads the old values, what it runs after
    wait() the results; a future's value waited on from another stream too."""
    start()
    torch.cuda.set_device(0)
    world = dist.get_world_size()
    total = float(sum(2 * (r + 1) for r in range(world)))
    seen = {}

    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    torch.cuda._sleep(SPIN)
    x.mul_(2)                      # queued behind the spin: the collective must read it
    before = x.clone()             # queued before the call: must not see the sum
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    after = x.clone()              # queued after wait(): must see it
    seen["all_reduce before"] = bool((before == 2 * (rank + 1)).all())
    seen["all_reduce after"] = bool((after == total).all())

    shard = torch.full((1 << 18,), float(rank), device="cuda")
    gathered = torch.empty(world << 18, device="cuda")
    torch.cuda._sleep(SPIN)
    shard.add_(1)
    work = dist.all_gather_into_tensor(gathered, shard, async_op=True)
    work.wait()
    expect = torch.arange(1, world + 1, device="cuda").repeat_interleave(1 << 18).float()
    seen["all_gather after"] = bool(torch.equal(gathered, expect))

    grads = torch.full((world << 18,), float(rank + 1), device="cuda")
    out = torch.zeros(1 << 18, device="cuda")
    torch.cuda._sleep(SPIN)
    grads.mul_(2)
    dist.reduce_scatter_tensor(out, grads)   # synchronous, as FSDP2 calls it
    seen["reduce_scatter after"] = bool((out == total).all())

    y = torch.full((4,), float(rank + 1), device="cuda")
    torch.cuda._sleep(SPIN)
    y.mul_(2)
    future = dist.all_reduce(y, async_op=True).get_future()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        value = future.wait()[0] * 1   # `other` waits for the copy back
    other.synchronize()
    seen["future on another stream"] = bool((value == total).all())
    dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("settings", ["ring", "fastest"])
def test_cuda_streams_are_ordered_as_the_callers(settings):
    for seen in run_ranks(stream_order, loopback_placements(2, SETTINGS[settings]),
                          timeout=120):
        assert seen and all(seen.values()), seen


def mixed_devices(rank):
    start()
    said = {}
    for what, call in [
            ("cpu and cuda", lambda: dist.all_gather_into_tensor(
                torch.empty(2, device="cuda"), torch.ones(1))),
            ("meta", lambda: dist.all_reduce(torch.ones(3, device="meta")))]:
        try:
            call()
            said[what] = None
        except InvalidArgumentError as err:
            said[what] = str(err)
    dist.destroy_process_group()
    return said


def test_mixed_devices_are_refused_by_name():
    said = run_ranks(mixed_devices, loopback_placements(1), timeout=60)[0]
    assert "CPU and CUDA" in said["cpu and cuda"]
    assert "meta" in said["meta"]


@pytest.mark.parametrize("how,gates,piece", [("ddp", "1", None), ("fsdp", "1", None),
                                             ("overlap", "1", None), ("overlap", "0", None),
                                             ("overlap", "1", "1024")])
def test_cuda_training_on_the_backend_matches_one_process(how, gates, piece):
    """overlap() with stream gates (its ReduceScatters behind the backward pass, their copies
    back queued behind a gate), without (each blocks until its result is back), and with its
    collectives cut into pieces of 1 KiB (overcast/fsdp/pieces.py: the small model's are
    under the default's two pieces)."""
    env = {**LINK, "OVERCAST_STREAM_GATES": gates}
    if piece is not None:
        env["OVERCAST_STAGING_PIECE_BYTES"] = piece
    for r in run_ranks(train, loopback_placements(2, env), args=(how, "cuda"), timeout=180):
        assert r["param"] < 1e-5 and r["loss"] < 1e-5 and r["own_communicator"], r


def overlapped_steps(rank, steps, read_stats=True):
    """FSDP2 through overlap() on the GPU: per step, the pool's pinned bytes and allocations
    and the GPU memory allocated at the step's end; handle.stats() after the last (unless not
    `read_stats`: never)."""
    start()
    torch.cuda.set_device(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    world = dist.get_world_size()
    model = small_model().cuda()
    mesh = init_device_mesh("cuda", (world,))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rows = []
    with overcast.fsdp.overlap(model) as handle:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            x, y = batch(step)
            part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
            nn.functional.mse_loss(model(x[part].cuda()), y[part].cuda()).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            rows.append({**process_pool().stats(), "gpu": torch.cuda.memory_allocated()})
        staging = handle.stats() if read_stats else None
    dist.destroy_process_group()
    return {"rows": rows, "staging": staging, "gated": stream_gates() is not None}


def assert_flat(rows: list[dict], first: int, keys: tuple[str, ...]) -> None:
    """The most each of `keys` reached in the last 10 steps is no more than in the 10 from step
    `first` (a step's end may still count a block whose free waits for a stream's event, or a
    pinned buffer made when more calls were in flight at once; a leak grows every step)."""
    early, late = rows[first:first + 10], rows[-10:]
    for key in keys:
        assert max(row[key] for row in late) <= max(row[key] for row in early), (key, early, late)


def test_cuda_overlap_reuses_pinned_memory_and_keeps_gpu_memory_flat():
    steps = 50
    for r in run_ranks(overlapped_steps, loopback_placements(2, LINK), args=(steps,),
                       timeout=300):
        rows = r["rows"]
        assert rows[2]["allocations"] == rows[-1]["allocations"], rows  # reused after warm-up
        assert all(row["overflows"] == 0 and row["held_bytes"] <= row["limit_bytes"]
                   for row in rows), rows[-1]
        assert_flat(rows, first=2, keys=("gpu",))
        assert r["staging"]["staging_in_seconds"] > 0 and r["staging"]["staging_out_seconds"] > 0
        assert r["gated"]  # the driver offers stream memory operations (H100/H200, CUDA 12+)


# The poster's gated collectives, called as FSDP2 calls them, on a communicator of their own.

def gated_hooks(comm, gathers=None):
    """A ReduceScatter and an AllGather hook through `comm`'s poster (stream gates needed)."""
    assert stream_gates() is not None  # the driver offers stream memory operations
    poster, times = hold_poster(comm), CommTime()
    return (TimedReduceScatter(comm, "ring", "rs", times, poster=poster),
            TimedAllGather(comm, "ring", "ag", times, poster=poster, gathers=gathers), times)


def gated_stream_order(rank):
    """With the caller's stream kept busy before each call: what it queued before the call
    reads the old output; what a ReduceScatter's stream queues right after the call (no wait)
    and what the stream that waited on an AllGather queues after wait() read the result,
    bit-exact against this process's own sum and concatenation."""
    torch.cuda.set_device(0)
    seen = {}
    with overcast.Communicator(timeout=60) as comm:
        world, n = comm.world_size, 1 << 18
        reduce_scatter, all_gather, _ = gated_hooks(comm, GatedAllGathers())
        ints = torch.arange(world * n, dtype=torch.float32) % 251  # sums exact in float32
        grads = (ints + rank).cuda()
        out = torch.full((n,), -1.0, device="cuda")
        stream = torch.cuda.Stream()  # as FSDP2's reduce-scatter stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN)
            grads.mul_(2)              # queued behind the spin: the collective must read it
            before = out.clone()
            work = reduce_scatter(out, grads, None, dist.ReduceOp.SUM, async_op=True)
            after = out.clone()        # queued behind the gate
        stream.synchronize()
        work.wait()
        total = sum((ints + r) * 2 for r in range(world)).view(world, n)[rank]
        seen["reduce_scatter before"] = bool((before == -1).all())
        seen["reduce_scatter after"] = torch.equal(after.cpu(), total)

        shard = torch.full((n,), float(rank), device="cuda")
        gathered = torch.full((world * n,), -1.0, device="cuda")
        torch.cuda._sleep(SPIN)
        shard.add_(1)
        before = gathered.clone()
        work = all_gather(gathered, shard, None, async_op=True)
        work.wait()
        after = gathered.clone()
        torch.cuda.synchronize()
        expect = torch.arange(1, world + 1).repeat_interleave(n).float()
        seen["all_gather before"] = bool((before == -1).all())
        seen["all_gather after"] = torch.equal(after.cpu(), expect)
        release_poster(comm)
    return seen


def test_cuda_gated_collectives_keep_the_callers_stream_order():
    for seen in run_ranks(gated_stream_order, loopback_placements(2), timeout=120):
        assert seen and all(seen.values()), seen


def gates_after_a_failure(rank):
    """Rank 0 queues a gated ReduceScatter and a gated AllGather (and a wait on the latter);
    rank 1 then aborts instead of calling its part. (Rank 0: whether both streams got past
    their gates within 20 s, well inside the 60 s timeout, and what each collective raised.)"""
    torch.cuda.set_device(0)
    with overcast.Communicator(timeout=60) as comm, \
            overcast.Communicator(timeout=60, name="side") as side:
        if rank == 1:
            side.barrier()
            comm.abort("rank 1 leaves its collectives")
            return None
        gathers = GatedAllGathers()
        reduce_scatter, all_gather, _ = gated_hooks(comm, gathers)
        n = 1 << 18
        out, grads = torch.empty(n, device="cuda"), torch.ones(2 * n, device="cuda")
        compute, stream = torch.cuda.current_stream(), torch.cuda.Stream()
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            rs = reduce_scatter(out, grads, None, dist.ReduceOp.SUM, async_op=True)
        gathered, shard = torch.empty(2 * n, device="cuda"), torch.ones(n, device="cuda")
        all_gather(gathered, shard, None, async_op=True).wait()  # `compute` waits for it
        side.barrier()
        through = threading.Event()

        def synchronize():
            torch.cuda.set_device(0)
            stream.synchronize()
            compute.synchronize()
            through.set()
        threading.Thread(target=synchronize, daemon=True).start()
        began = time.monotonic()
        passed = through.wait(20)
        seconds = time.monotonic() - began
        raised = []
        for finish in (rs.wait, gathers.wait_all):
            try:
                finish()
                raised.append(None)
            except overcast.OvercastError as err:
                raised.append([str(err), getattr(err, "__notes__", [])])
        release_poster(comm)
        return {"passed": passed, "seconds": seconds, "raised": raised}


def test_cuda_a_failed_collective_opens_its_gate():
    said = run_ranks(gates_after_a_failure, loopback_placements(2), timeout=120)[0]
    assert said["passed"], said
    (rs, _), (ag, notes) = said["raised"]  # each raised an OvercastError (rank 1's abort)
    assert rs and ag and notes == ["(in overcast AllGather ag (ring))"], said


def allgather_wait_in_flight(rank):
    """Rank 0's wait() on a gated AllGather rank 1 has not called yet (it calls it once rank
    0 has timed the wait): (its seconds, whether the collective was in flight after it, and
    whether the result is exact once rank 1 has called its part)."""
    torch.cuda.set_device(0)
    with overcast.Communicator(timeout=20) as comm, \
            overcast.Communicator(timeout=20, name="side") as side:
        world, n = comm.world_size, 1 << 16
        gathers = GatedAllGathers()
        _, all_gather, times = gated_hooks(comm, gathers)
        shard, gathered = torch.full((n,), float(rank + 1), device="cuda"), torch.empty(
            world * n, device="cuda")
        seconds = in_flight = None
        if rank == 1:
            side.barrier()
            all_gather(gathered, shard, None, async_op=True).wait()
        else:
            work = all_gather(gathered, shard, None, async_op=True)
            began = time.perf_counter()
            work.wait()
            seconds = time.perf_counter() - began
            in_flight = not work.is_completed()
            side.barrier()
        torch.cuda.current_stream().synchronize()
        gathers.wait_all()
        exact = torch.equal(gathered.cpu(), torch.arange(1, world + 1).repeat_interleave(n).float())
        release_poster(comm)
        return [seconds, in_flight, exact, times.wait_seconds]


def test_cuda_an_allgathers_wait_does_not_block_the_host():
    (seconds, in_flight, exact, _), (_, _, other, _) = run_ranks(
        allgather_wait_in_flight, loopback_placements(2), timeout=120)
    assert in_flight and exact and other
    assert seconds < 0.5  # the collective could not end before rank 1 called it, after this


def test_cuda_memory_stays_flat_over_200_steps_with_stats_never_read():
    """The staging copies' timing keeps no call's tensors (FSDP2's unsharded parameters and
    ReduceScatter outputs) and only the events of copies in flight, so a loop that never calls
    handle.stats() holds as much GPU and pinned memory at its 200th step as at its 10th."""
    for r in run_ranks(overlapped_steps, loopback_placements(2, LINK), args=(200, False),
                       timeout=600):
        assert_flat(r["rows"], first=10, keys=("gpu", "held_bytes"))
        assert r["gated"]


def gates_in_flight(rank, per_thread):
    """Two threads each queue `per_thread` stream gates, each on a stream of its own and each
    followed by a copy that sets the gate's flag in pinned host memory; a third thread opens
    them in the order they were queued, once the ring's every slot is taken (the two queuing
    threads then wait for slots while 256 gates are closed), checking first that the stream
    has not passed the gate. What it found: gates already passed, flags set at the end."""
    torch.cuda.set_device(0)
    gates = stream_gates()
    assert gates is not None
    flags = torch.zeros(2, per_thread, dtype=torch.int32, pin_memory=True)
    seen = flags.numpy()
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    queued: queue.SimpleQueue = queue.SimpleQueue()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def close(t):
        for i in range(per_thread):
            open_gate = gates.close_on(streams[t])
            with torch.cuda.stream(streams[t]):
                flags[t, i : i + 1].copy_(one, non_blocking=True)
            queued.put((t, i, open_gate))

    passed, opened = [], []

    def open_all():
        waiting = [queued.get(timeout=60) for _ in range(gates.SLOTS)]
        for _ in range(2 * per_thread):
            t, i, open_gate = waiting.pop(0) if waiting else queued.get(timeout=60)
            if seen[t, i] != 0:
                passed.append((t, i))
            open_gate()
            opened.append((t, i))

    threads = [threading.Thread(target=close, args=(t,)) for t in (0, 1)]
    threads.append(threading.Thread(target=open_all))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if len(opened) == 2 * per_thread:  # else a stream waits at a gate for good
        for stream in streams:
            stream.synchronize()
    return {"stuck": stuck, "passed": passed, "opened": len(opened), "set": int(flags.sum())}


def test_cuda_more_gates_than_the_ring_holds_each_open_only_by_its_own_collective():
    per_thread = 200  # 400 gates, the ring's 256 slots all closed at once
    [r] = run_ranks(gates_in_flight, loopback_placements(1), args=(per_thread,), timeout=300)
    assert r == {"stuck": [], "passed": [], "opened": 2 * per_thread, "set": 2 * per_thread}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def demand_over_the_limit(rank, buffers, nbytes):
    """`buffers` staging buffers of `nbytes` taken at once from the process's pool (its limit
    below their sum), a copy into each, all given back: whether each was pinned (the driver's
    word, cudaPointerGetAttributes through is_pinned), whether each still is once the copies
    are done and the pool has freed what it let go, and the process's resident memory (which
    counts the pool's pinned pages) before, with them, and after."""
    torch.cuda.set_device(0)
    source = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    pool, stream = process_pool(), torch.cuda.Stream()
    before = resident_bytes()
    views = [pool.take(nbytes, stream) for _ in range(buffers)]
    pinned = [v.is_pinned() for v in views]
    with torch.cuda.stream(stream):
        for v in views:
            v.copy_(source, non_blocking=True)
    ready = stream.record_event()
    stream.synchronize()
    during = resident_bytes()
    firsts = [v[:1] for v in views]  # the memory stays mapped: the driver can be asked
    pool.give(views, ready)
    stats = pool.stats()  # frees what it let go, their copies done
    still = [f.is_pinned() for f in firsts]
    del views, firsts
    gc.collect()
    return {"pinned": pinned, "still": still, "stats": stats, "before": before,
            "during": during, "after": resident_bytes()}


def test_cuda_the_process_pins_no_more_than_the_pool_keeps_after_a_demand_over_it():
    mib, nbytes = 1 << 20, 48 << 20
    env = {"OVERCAST_PINNED_BYTES": str(64 * mib)}
    [r] = run_ranks(demand_over_the_limit, loopback_placements(1, env), args=(4, nbytes),
                    timeout=300)
    assert r["pinned"] == [True] * 4
    assert r["still"] == [True, False, False, False]  # the first is kept, within the limit
    assert r["stats"]["overflows"] == 3 and r["stats"]["held_bytes"] == nbytes
    assert r["during"] - r["before"] >= 4 * nbytes - 16 * mib
    assert r["after"] - r["before"] <= nbytes + 16 * mib


@pytest.mark.parametrize("way", ["ddp", "fsdp", "overlap"])
def test_cuda_the_gpu_example_trains_as_one_process_would(way):
    """examples/gpu_train.py under torchrun, 2 ranks on the one GPU, as a user runs it: DDP,
    FSDP2 and FSDP2 through overlap() on CUDA tensors on "overcast", each with the losses of one
    process on the whole batch, which are gloo's (not run on gloo: it can abort at exit after
    training correctly, docs/fsdp.md)."""
    assert_one_process_losses(example_losses(
        "gpu_train.py", "--way", way, ranks=2, steps=6,
        env={"OVERCAST_LINK_BITS_PER_S": "10e9"}))


def cuda_point_to_point(rank):
    """tests/test_backend_p2p.py's transfers (blocking sends around a ring, tags in their own
    order, batches of every dtype, past the copy budget into a non-contiguous tensor) with CUDA
    tensors on the backend, against gloo's on CPU tensors."""
    gloo = start(timeout=60)
    torch.cuda.set_device(0)
    mine, theirs = exchanges(rank, device="cuda"), exchanges(rank, gloo)
    agree = len(mine) == len(theirs) and all(same(a, b) for a, b in zip(mine, theirs))
    dist.destroy_process_group()
    return agree


def test_cuda_point_to_point_agrees_with_gloo():
    env = {"OVERCAST_SEND_COPY_BYTES": str(COPY_BYTES)}
    assert run_ranks(cuda_point_to_point, loopback_placements(3, env), timeout=180) == [True] * 3
