"""ReduceScatter three ways on one machine's loopback: overcast's in-network reduction (through
an aggregator that rank 0 starts beside itself), overcast's ring, and gloo's
reduce_scatter_tensor, in the same run, each checked bit for bit. Run it with torchrun:

    OVERCAST_LINK_BITS_PER_S=10e9 torchrun --standalone --nproc-per-node 4 \
        examples/reduce_scatter_loopback.py --mib 16

`--mib` is each rank's share of the result (its input is world size times that). Each
repetition runs between barriers and counts its slowest rank; the median of `--reps` is
printed, with the CPU each rank spent per repetition.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=16.0)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    count = int(args.mib * (1 << 20)) // 4
    # small integers in float32: every order of summation gives the same bits
    grads = torch.randint(-1000, 1000, (world * count,), generator=torch.Generator().manual_seed(
        rank)).to(torch.float32)
    expected = torch.empty(count)
    dist.reduce_scatter_tensor(expected, grads)
    out = torch.empty(count)
    results = {}
    with overcast.fsdp.job_communicator() as comm:
        for name, call in (
                ("overcast in-network", lambda: comm.reduce_scatter(out, grads,
                                                                    algorithm="innetwork")),
                ("overcast ring", lambda: comm.reduce_scatter(out, grads, algorithm="ring")),
                ("gloo reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(out, grads))):
            out.fill_(float("nan"))
            results[name] = timed(call, args.reps)
            exact = torch.tensor([int(torch.equal(out, expected))])
            dist.all_reduce(exact, op=dist.ReduceOp.MIN)
            results[name] += (bool(exact.item()),)
    if rank == 0:
        print(f"ReduceScatter on loopback: {world} ranks, {args.mib:g} MiB per rank's share, "
              f"median of {args.reps}")
        for name, (seconds, cpu, exact) in results.items():
            print(f"  {name:28s} {seconds * 1e3:8.1f} ms   {cpu:6.3f} s CPU/rank   "
                  f"{'exact' if exact else 'WRONG'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
