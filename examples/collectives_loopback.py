"""AllGather, ReduceScatter and the overlapped pair of both on one machine's loopback, three ways
each in the same run: overcast's datagram algorithms (multicast AllGather, in-network
ReduceScatter through an aggregator that rank 0 starts beside itself), overcast's rings, and
gloo (the pair on two gloo groups, as FSDP runs it). Every result is checked bit for bit. Run it
with torchrun:

    OVERCAST_LINK_BITS_PER_S=10e9 torchrun --standalone --nproc-per-node 4 \\
        examples/collectives_loopback.py --mib 16

`--mib` is each rank's shard (the AllGather's input, the ReduceScatter's output). Each
repetition runs between barriers and counts its slowest rank; the median of `--reps` is
printed, with the CPU each rank's process spent per repetition (every thread).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import overcast.fsdp


def timed(call, reps: int) -> tuple[float, float]:
    """The median over `reps` of the slowest rank's time, and this rank's mean CPU seconds."""
    call()  # warm-up
    times, cpu0 = [], time.process_time()
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        call()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times), (time.process_time() - cpu0) / reps


def both(*works) -> None:
    for work in works:
        work.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=16.0)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    dist.init_process_group("gloo")
    second = dist.new_group()  # gloo's pair: the ReduceScatter on a group of its own
    rank, world = dist.get_rank(), dist.get_world_size()
    count = int(args.mib * (1 << 20)) // 4
    seeded = torch.Generator().manual_seed(rank)
    # small integers in float32: every order of summation gives the same bits
    grads = torch.randint(-1000, 1000, (world * count,), generator=seeded).to(torch.float32)
    shard = torch.randint(-1000, 1000, (count,), generator=seeded).to(torch.float32)
    want_rs, want_ag = torch.empty(count), torch.empty(world * count)
    dist.reduce_scatter_tensor(want_rs, grads)
    dist.all_gather_into_tensor(want_ag, shard)
    rs, ag = torch.empty(count), torch.empty(world * count)
    results = {}
    with overcast.fsdp.job_communicator() as comm:
        def pair(gather: str, reduce: str):
            return lambda: both(comm.all_gather(ag, shard, algorithm=gather, async_op=True),
                                comm.reduce_scatter(rs, grads, algorithm=reduce, async_op=True))

        runs = {
            "AllGather": (
                ("overcast multicast", lambda: comm.all_gather(ag, shard, algorithm="multicast")),
                ("overcast ring", lambda: comm.all_gather(ag, shard, algorithm="ring")),
                ("gloo", lambda: dist.all_gather_into_tensor(ag, shard))),
            "ReduceScatter": (
                ("overcast in-network", lambda: comm.reduce_scatter(rs, grads,
                                                                    algorithm="innetwork")),
                ("overcast ring", lambda: comm.reduce_scatter(rs, grads, algorithm="ring")),
                ("gloo", lambda: dist.reduce_scatter_tensor(rs, grads))),
            "pair": (
                ("overcast multicast + in-network", pair("multicast", "innetwork")),
                ("overcast rings", pair("ring", "ring")),
                ("gloo, two groups", lambda: both(
                    dist.all_gather_into_tensor(ag, shard, async_op=True),
                    dist.reduce_scatter_tensor(rs, grads, group=second, async_op=True)))),
        }
        for what, calls in runs.items():
            for name, call in calls:
                rs.fill_(float("nan"))
                ag.fill_(float("nan"))
                seconds, cpu = timed(call, args.reps)
                exact = (what == "AllGather" or torch.equal(rs, want_rs)) and \
                    (what == "ReduceScatter" or torch.equal(ag, want_ag))
                agreed = torch.tensor([int(exact)])
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
                results[(what, name)] = (seconds, cpu, bool(agreed.item()))
    if rank == 0:
        print(f"On loopback: {world} ranks, {args.mib:g} MiB per rank's shard, median of "
              f"{args.reps}")
        for (what, name), (seconds, cpu, exact) in results.items():
            print(f"  {what:13s} {name:32s} {seconds * 1e3:8.1f} ms   {cpu:6.3f} s CPU/rank   "
                  f"{'exact' if exact else 'WRONG'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
