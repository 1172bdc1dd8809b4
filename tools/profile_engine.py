"""Where a rank's engine spends its CPU in the overlapped pair, by kind of work.

    .venv/bin/python tools/profile_engine.py --hosts 8 --link-mbit 100 --size 4MiB --pairs 3

Runs the pair (multicast AllGather beside in-network ReduceScatter, float32) on the emulated
cluster with its aggregator, profiles rank 1's progress-engine thread with cProfile, and sorts
the time its functions took into syscalls, authentication, protocol bookkeeping, numpy, the
engine and transport's own Python, and the rest. cProfile measures wall time: on a shared
machine a function's share includes the time it was preempted, so read the shares, not the
seconds. Root only (it builds the cluster).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import tempfile
import time

import numpy as np

import overcast
from overcast.bench.run import parse_size
from overcast.cluster.netns import Cluster
from overcast.engine import engine as engine_module

CATEGORIES = ("syscalls (send, receive)", "authentication (AES-GMAC, replay window)",
              "protocol bookkeeping", "numpy (copies, sums)", "engine and transport (Python)",
              "other (headers, builtins)")


def category(file: str, name: str) -> str | None:
    """The kind of work a profiled function is; None for waiting."""
    if "poll" in name or "acquire" in name:
        return None
    if file == "~" and any(k in name for k in ("recv", "send")):
        return CATEGORIES[0]
    if "crypt" in name or file.endswith("auth.py"):
        return CATEGORIES[1]
    if "/protocols/" in file:
        return CATEGORIES[2]
    if "numpy" in file or "numpy" in name or file.endswith("buffers.py"):
        return CATEGORIES[3]
    if "/engine/" in file or "/transport/" in file or "selectors" in file:
        return CATEGORIES[4]
    return CATEGORIES[5]


def shares(path: str) -> dict[str, float]:
    seconds = collections.Counter()
    for (file, _, name), (_, _, own, _, _) in pstats.Stats(path).stats.items():
        kind = category(file, name)
        if kind is not None:
            seconds[kind] += own
    return {k: seconds[k] for k in CATEGORIES}


def pairs(rank: int, nbytes: int, count: int, profile_path: str) -> list[float]:
    if rank == 1:
        run = engine_module.Engine._run

        def profiled(self):
            profiler = cProfile.Profile()
            profiler.enable()
            try:
                run(self)
            finally:
                profiler.disable()
                profiler.dump_stats(profile_path)
        engine_module.Engine._run = profiled
    with overcast.Communicator(name="profile", timeout=120) as comm:
        n = nbytes // 4
        gathered, shard = np.empty(comm.world_size * n, np.float32), np.ones(n, np.float32)
        reduced, grads = np.empty(n, np.float32), np.ones(comm.world_size * n, np.float32)
        comm.all_gather(gathered, shard, algorithm="multicast")  # warm: pages, imports
        comm.barrier()
        cpu = time.process_time()
        for _ in range(count):
            ag = comm.all_gather(gathered, shard, algorithm="multicast", async_op=True)
            rs = comm.reduce_scatter(reduced, grads, algorithm="innetwork", async_op=True)
            ag.wait()
            rs.wait()
        return [time.process_time() - cpu]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--link-mbit", type=float, default=100.0)
    p.add_argument("--size", default="4MiB")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--top", type=int, default=0, help="also list the N functions that took the "
                   "most time of their own")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/engine.prof"
        with Cluster(args.hosts, int(args.link_mbit * 1e6)) as cluster:
            cluster.start_switch()
            cpu = cluster.run(pairs, args=(parse_size(args.size), args.pairs, path))
        busy = shares(path)
        if args.top:
            pstats.Stats(path).sort_stats("tottime").print_stats(args.top)
    total = sum(busy.values())
    print(f"{args.hosts} hosts, {args.link_mbit:g} Mbit/s, {args.size} pairs x {args.pairs}: "
          f"CPU per rank per pair {np.median([c[0] for c in cpu]) / args.pairs:.3f} s "
          f"(median of the ranks; rank 1 profiled)")
    for kind, seconds in sorted(busy.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:44s} {seconds / total:5.0%}  ({seconds:.3f} s profiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
