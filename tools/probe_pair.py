"""What the overlapped pair costs per pair, quickly: for A/B comparisons run back to back.

    .venv/bin/python tools/probe_pair.py --hosts 8 --link-mbit 400 --pairs 4 [--parts]

Runs `--pairs` pairs (multicast AllGather beside in-network ReduceScatter, float32, 4 MiB per
rank by default) on the emulated cluster with its aggregator, after one AllGather to warm up,
and prints per pair: the median rank's time and CPU, and the aggregator's CPU (its whole life,
start-up included, over pairs + 1). With `--parts`, each rank's engine thread also times its
own CPU in the parts of its loop (reading, sealing and sending, timers, select...), and rank
1's are printed. On a shared machine, compare configurations in interleaved runs: its speed
drifts by tens of percent over minutes. Root only (it builds the cluster).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time

import numpy as np

import overcast
from overcast.bench.run import parse_size
from overcast.cluster.netns import Cluster
from overcast.engine import engine
from overcast.protocols.session import Session
from overcast.transport.datagram import Datagrams

# (class, method) whose CPU time --parts measures on the engine thread
PARTS = ((Datagrams, "read"), (engine.Engine, "_fill_and_flush"), (Session, "handle_timer"),
         (Session, "get_timer"), (engine.Engine, "_take_submissions"),
         (engine.Engine, "_report"), (engine.Engine, "_read"))


def timed_parts() -> tuple[collections.Counter, collections.Counter]:
    """Wrap PARTS and the selector's select to add up their CPU time and calls."""
    seconds, calls = collections.Counter(), collections.Counter()

    def wrap(owner, name):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[name] += time.thread_time() - start
                calls[name] += 1
        setattr(owner, name, timed)

    for owner, name in PARTS:
        wrap(owner, name)
    wrap(engine.selectors.DefaultSelector, "select")
    return seconds, calls


def pairs(rank: int, nbytes: int, count: int, parts: bool):
    seconds, calls = timed_parts() if parts else (collections.Counter(), collections.Counter())
    with overcast.Communicator(name="probe", timeout=120) as comm:
        n = nbytes // 4
        gathered, shard = np.empty(comm.world_size * n, np.float32), np.ones(n, np.float32)
        reduced, grads = np.empty(n, np.float32), np.ones(comm.world_size * n, np.float32)
        comm.all_gather(gathered, shard, algorithm="multicast")
        comm.barrier()
        seconds.clear()
        calls.clear()
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(count):
            ag = comm.all_gather(gathered, shard, algorithm="multicast", async_op=True)
            rs = comm.reduce_scatter(reduced, grads, algorithm="innetwork", async_op=True)
            ag.wait()
            rs.wait()
        return ((time.process_time() - cpu) / count, (time.perf_counter() - start) / count,
                {k: (seconds[k] / count, calls[k] / count) for k in seconds})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--link-mbit", type=float, default=400.0)
    p.add_argument("--size", default="4MiB")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--parts", action="store_true", help="time the engine loop's parts too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stats = f"{tmp}/switch.json"
        with Cluster(args.hosts, int(args.link_mbit * 1e6)) as cluster:
            switch = cluster.start_switch(stats_path=stats)
            ranks = cluster.run(pairs, args=(parse_size(args.size), args.pairs, args.parts))
            cluster.stop_switch(switch)
        with open(stats) as f:
            aggregator = json.load(f)["cpu_seconds"] / (args.pairs + 1)
    print(f"{args.hosts} hosts, {args.link_mbit:g} Mbit/s, {args.size}: per pair "
          f"{np.median([r[1] for r in ranks]):.3f} s, CPU per rank "
          f"{np.median([r[0] for r in ranks]):.3f} s, aggregator {aggregator:.3f} s")
    for name, (seconds, calls) in sorted(ranks[1][2].items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:20s} {seconds * 1e3:7.1f} ms {calls:8.0f} calls "
              f"{seconds / max(calls, 1) * 1e6:7.1f} us each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
