"""How soon every rank raises when one rank alone makes a bad call, on the emulated cluster.

    .venv/bin/python tools/refusal_times.py [--hosts 2,4,8] [--link-mbit 400] [--trials 10]
        [--json FILE]

On an "overcast" process group (torch.distributed) of each number of hosts, with its aggregator:
all ranks meet at a barrier, then make the same call but rank 1, whose arguments are bad (an
all_gather_into_tensor output of the wrong size; a reduce_scatter_tensor input of another
dtype). Rank 1 refuses it, and every other rank's call raises naming rank 1 (docs/backend.md);
the group goes on. Per algorithm (ring and multicast AllGather, in-network ReduceScatter) it
prints the time from the last rank's call to the last rank's raise, median and largest over
the trials, and checks that a good call after each runs. The clocks are the machine's
monotonic one, which every namespace shares. Root only (it builds the cluster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

# (name, environment, collective called)
CASES = [("all_gather ring", {"OVERCAST_ALL_GATHER": "ring"}, "all_gather"),
         ("all_gather multicast", {"OVERCAST_ALL_GATHER": "multicast"}, "all_gather"),
         ("reduce_scatter innetwork", {"OVERCAST_REDUCE_SCATTER": "innetwork"},
          "reduce_scatter")]


def trials(rank: int, collective: str, count: int) -> dict:
    """`count` bad calls of rank 1's: per trial, this rank's (call, raise) times and what it
    raised; whether a good call after each ran."""
    import torch
    import torch.distributed as dist

    import overcast.distributed  # noqa: F401  (registers the backend)
    dist.init_process_group("overcast", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    bad = rank == 1
    spans, said, usable = [], set(), True
    for _ in range(count):
        dist.barrier()
        began = time.monotonic()
        try:
            if collective == "all_gather":
                dist.all_gather_into_tensor(torch.empty(3 if bad else 2 * world),
                                            torch.ones(2))
            else:
                dist.reduce_scatter_tensor(
                    torch.empty(1000), torch.ones(1000 * world,
                                                  dtype=torch.float64 if bad else torch.float32))
            said.add("returned")
        except Exception as err:  # the refusing rank's own, or rank 1's named
            named = bad or "rank 1 refused the call" in str(err)
            said.add(type(err).__name__ + ("" if named else " not naming rank 1"))
        spans.append((began, time.monotonic()))
        t = torch.full((4,), float(rank))
        dist.all_reduce(t)
        usable = usable and t.tolist() == [float(sum(range(world)))] * 4
    algorithms = dict(dist.group.WORLD.algorithms)
    dist.destroy_process_group()
    return {"spans": spans, "said": sorted(said), "usable": usable, "algorithms": algorithms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="2,4,8", help="numbers of hosts, comma-separated")
    parser.add_argument("--link-mbit", type=float, default=400)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from overcast.cluster.netns import Cluster

    results = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        with Cluster(hosts, int(args.link_mbit * 1e6)) as cluster:
            cluster.start_aggregator()
            for name, env, collective in CASES:
                per_rank = cluster.run(trials, args=(collective, args.trials), env=env,
                                       timeout=300)
                seconds = [max(r["spans"][t][1] for r in per_rank) -
                           max(r["spans"][t][0] for r in per_rank)
                           for t in range(args.trials)]
                row = {"hosts": hosts, "case": name, "seconds": seconds,
                       "median_ms": round(statistics.median(seconds) * 1e3, 2),
                       "max_ms": round(max(seconds) * 1e3, 2),
                       "said": sorted({s for r in per_rank for s in r["said"]}),
                       "usable": all(r["usable"] for r in per_rank),
                       "algorithms": per_rank[0]["algorithms"]}
                results.append(row)
                print(f"{hosts} hosts, {name}: every rank raised {row['median_ms']} ms after "
                      f"the last call (median of {args.trials}; largest {row['max_ms']} ms); "
                      f"raised {', '.join(row['said'])}; group usable after: {row['usable']}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["usable"] and "returned" not in r["said"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
