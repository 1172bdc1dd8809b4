"""How long an in-network ReduceScatter takes when an aggregator is lost in its middle, on the
emulated cluster.

    .venv/bin/python tools/failover_times.py [--hosts 8] [--link-mbit 400] [--size 4MiB]
        [--aggregators 2,1] [--trials 3] [--signal kill|stop] [--json FILE]

Per trial, with the aggregators started afresh: every rank runs the in-network ReduceScatter of
random float32s a few times (its usual time: the median), then the same call on the ring (the
ring's bits), then once more in-network while rank 0 kills aggregator 0 (SIGKILL: its
connections close) or stops it (SIGSTOP: it falls silent, found lost after the bound) half its
usual time after the call. It prints that collective's time (from the last rank's call to the
last rank's return) against twice its usual time plus the switch-over bound
(OVERCAST_FAILOVER_SECONDS, 2 s: a stopped aggregator's cost; a killed one's connections close
at once), what took it over on every rank (the ring, or complete as the aggregators summed it),
and whether every rank's block is bit-exact against the ring's (or, complete, the aggregators'
own sums). The clocks are the machine's monotonic one, which every namespace shares. Root only
(it builds the cluster); run it with the machine otherwise idle, three trials or more.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
DONE = {"kill": "killed", "stop": "stopped"}


def trial(rank: int, count: int, pid: int, signum: int, repeats: int, name: str) -> dict:
    """The usual in-network time, the ring's output and the aggregators' own, then the call
    with aggregator `pid` lost half-way: its (call, return) times, output and counters."""
    import numpy as np

    import overcast
    with overcast.Communicator(name=name, timeout=60) as comm:
        world = comm.world_size
        grads = np.random.default_rng(rank).standard_normal(world * count).astype(np.float32)
        out = np.empty(count, np.float32)
        usual = []
        for _ in range(repeats):
            comm.barrier()
            began = time.monotonic()
            comm.reduce_scatter(out, grads, algorithm="innetwork")
            usual.append(time.monotonic() - began)
        summed = out.tobytes()
        comm.reduce_scatter(out, grads, algorithm="ring")
        ring = out.tobytes()
        out.fill(0)
        comm.barrier()
        began = time.monotonic()
        work = comm.reduce_scatter(out, grads, algorithm="innetwork", async_op=True)
        if rank == 0:
            time.sleep(statistics.median(usual) / 2)  # the fault's moment, not a wait for anyone
            os.kill(pid, signum)
        work.wait()
        ended = time.monotonic()
        counters = comm.counters()
        return {"usual": usual, "span": (began, ended), "fallback": comm.in_network_fallback,
                "ring_exact": out.tobytes() == ring, "summed_exact": out.tobytes() == summed,
                "redone": counters.get("in_network_redone_on_ring", 0),
                "complete": counters.get("in_network_complete_at_failover", 0)}


def main() -> int:
    from overcast.protocols.failover import FAILOVER_ENV, FAILOVER_SECONDS
    from overcast.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--link-mbit", type=float, default=400)
    parser.add_argument("--size", default="4MiB", help="bytes per rank of each block")
    parser.add_argument("--aggregators", default="2,1", help="counts, comma-separated")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs before the loss that time the usual in-network collective")
    parser.add_argument("--signal", choices=sorted(SIGNALS), default="kill")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from overcast.cluster.netns import Cluster

    bound = float(os.environ.get(FAILOVER_ENV, FAILOVER_SECONDS))
    count = parse_size(args.size) // 4
    results, ok = [], True
    for aggregators in [int(a) for a in args.aggregators.split(",")]:
        with Cluster(args.hosts, int(args.link_mbit * 1e6), aggregators=aggregators) as cluster:
            for t in range(args.trials):
                procs = cluster.start_aggregators()
                try:
                    per_rank = cluster.run(trial, timeout=600, args=(
                        count, procs[0].pid, SIGNALS[args.signal], args.repeats,
                        f"failover-{t}"))
                finally:
                    os.kill(procs[0].pid, signal.SIGCONT)  # a stopped one, to be stopped
                    for proc in procs:
                        cluster.stop_aggregator(proc)
                usual = statistics.median(max(times) for times in
                                          zip(*(r["usual"] for r in per_rank)))
                seconds = max(r["span"][1] for r in per_rank) - \
                    max(r["span"][0] for r in per_rank)
                redone = any(r["redone"] for r in per_rank)
                exact = all(r["ring_exact"] if redone else r["summed_exact"] for r in per_rank)
                within = seconds <= 2 * usual + bound
                ok = ok and exact and within
                row = {"aggregators": aggregators, "trial": t, "usual_seconds": usual,
                       "seconds": seconds, "bound_seconds": bound, "within": within,
                       "redone_on_ring": redone, "exact": exact,
                       "fallback": per_rank[0]["fallback"]}
                results.append(row)
                print(f"{args.hosts} hosts, {args.link_mbit:g} Mbit/s, {args.size}, "
                      f"{aggregators} aggregator(s), aggregator 0 {DONE[args.signal]} half-way: "
                      f"{seconds * 1e3:.0f} ms (usual {usual * 1e3:.0f} ms; 2x + the "
                      f"{bound:g} s bound: {(2 * usual + bound) * 1e3:.0f} ms), "
                      f"{'redone on the ring' if redone else 'complete at the aggregators'}, "
                      f"bit-exact on every rank: {exact}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
