"""Where a rank's engine spends its CPU in the overlapped pair (or the full-duplex all_reduce).

    .venv/bin/python tools/profile_engine.py --hosts 8 --link-mbit 100 --size 4MiB --pairs 3
    .venv/bin/python tools/profile_engine.py --mode parts --link-mbit 100
    .venv/bin/python tools/profile_engine.py --mode time --link-mbit 400
    .venv/bin/python tools/profile_engine.py --mode perf --all-reduce --pairs 20

Runs `--pairs` pairs (multicast AllGather beside in-network ReduceScatter, float32) on the
emulated cluster with its aggregator, after one AllGather to warm up, and prints per pair the
median rank's time and CPU and the aggregator's CPU (its whole life, start-up included, over
pairs + 1). With `--all-reduce` the calls are full-duplex all_reduces of `--size` per rank
instead (16 collectives each at 4 MiB). Then, by `--mode`:

- profile: rank 1's progress-engine thread under cProfile, the time its functions took sorted
  into syscalls, authentication, protocol bookkeeping, numpy, the engine and transport's own
  Python, and the rest. cProfile measures wall time and adds a cost per call: on a shared
  machine a function's share includes the time it was preempted, so read the shares. The
  number of calls does not depend on the machine: it is printed per datagram the rank sent
  or received over its whole life (the warm-up included).
- parts: each engine thread times its own CPU in the parts of its loop (reading, sealing and
  sending, timers, select...); rank 1's are printed.
- time: nothing more, and nothing slowed: for comparisons of two configurations, run back to
  back and interleaved, since a shared machine's speed drifts by tens of percent over minutes.
- perf: the whole machine sampled on CPU by Linux perf (`perf record -a`) while the ranks run,
  warm-up included; each rank's and the aggregator's samples sorted by where the CPU was: the
  Python interpreter, AES-GMAC, numpy, payload copies, the kernel's other work (network stack,
  syscalls, scheduling), the rest. Unlike cProfile this counts CPU, not wall time, and slows
  nothing; it cannot name Python functions (Python 3.11 has no perf support).

Root only (it builds the cluster).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

import overcast
from overcast.units import parse_size
from overcast.cluster.netns import Cluster
from overcast.engine import engine as engine_module
from overcast.protocols.session import Session

CATEGORIES = ("syscalls (send, receive)",
              "opening datagrams (AES-GMAC, replay window, header checks, runs)",
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


def shares(stats: pstats.Stats) -> dict[str, float]:
    seconds = collections.Counter()
    for (file, _, name), (_, _, own, _, _) in stats.stats.items():
        kind = category(file, name)
        if kind is not None:
            seconds[kind] += own
    return {k: seconds[k] for k in CATEGORIES}


# (class, method) whose CPU time the parts mode measures on the engine thread
PARTS = ((engine_module.Engine, "_deliver_runs"), (engine_module.Engine, "_fill_and_flush"),
         (Session, "handle_timer"), (Session, "get_timer"),
         (engine_module.Engine, "_take_submissions"), (engine_module.Engine, "_report"),
         (engine_module.Engine, "_read"), (engine_module.Engine, "_python_events"))


def time_parts(seconds: collections.Counter, calls: collections.Counter) -> None:
    """Wrap PARTS to add up the CPU time and calls of each."""
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


def profile_engine(profile_path: str) -> None:
    """Run the engine thread under cProfile, its stats dumped to `profile_path` at the end."""
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


def timed_calls(rank: int, nbytes: int, count: int, mode: str, profile_path: str,
          all_reduce: bool = False):
    """`count` overlapped pairs (or, with `all_reduce`, full-duplex all_reduces of the whole
    `nbytes` buffer) on this rank: (CPU s, seconds, parts, datagrams, pid) per call."""
    seconds, calls = collections.Counter(), collections.Counter()
    if mode == "parts":
        time_parts(seconds, calls)
    elif mode == "profile" and rank == 1:
        profile_engine(profile_path)
    with overcast.Communicator(name="profile", timeout=120) as comm:
        n = nbytes // 4
        gathered, shard = np.empty(comm.world_size * n, np.float32), np.ones(n, np.float32)
        reduced, grads = np.empty(n, np.float32), np.ones(comm.world_size * n, np.float32)
        comm.all_gather(gathered, shard, algorithm="multicast")  # warm: pages, imports
        comm.barrier()
        seconds.clear()
        calls.clear()
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(count):
            if all_reduce:
                comm.all_reduce(shard, algorithm="fullduplex")
                continue
            ag = comm.all_gather(gathered, shard, algorithm="multicast", async_op=True)
            rs = comm.reduce_scatter(reduced, grads, algorithm="innetwork", async_op=True)
            ag.wait()
            rs.wait()
        counters = comm.counters()
        return ((time.process_time() - cpu) / count, (time.perf_counter() - start) / count,
                {k: (seconds[k] / count, calls[k] / count) for k in seconds},
                counters["datagrams_in"] + counters["datagrams_out"], os.getpid())


SAMPLING_HZ = 999
WHERE = ("Python interpreter", "AES-GMAC (cryptography, libcrypto)", "numpy",
         "payload copies (user, kernel)", "kernel: network stack, syscalls, scheduling",
         "other (malloc, struct, socket module)", "overcast's native core (parsing, sums, loop)")
_SAMPLE = re.compile(r"^\s*(\d+)\s+\S+\s+(.*?)\s+\((.*)\)$")


def where(sym: str, dso: str) -> str:
    """Which of WHERE a CPU sample in function `sym` of object `dso` belongs to."""
    name = dso.rsplit("/", 1)[-1]
    if "memmove" in sym or "memcpy" in sym or sym in ("_copy_to_iter", "_copy_from_iter"):
        return WHERE[3]
    if name.startswith("libpython"):
        return WHERE[0]
    if name.startswith(("_rust.abi3", "libcrypto")):
        return WHERE[1]
    if "numpy" in dso or name.startswith("_multiarray_umath"):
        return WHERE[2]
    if name == "[kernel.kallsyms]":
        return WHERE[4]
    if name.startswith("_core."):
        return WHERE[6]
    return WHERE[5]


def sample_machine(path: str) -> subprocess.Popen:
    """Start sampling every CPU into `path`; stop with stop_sampling."""
    if shutil.which("perf") is None:
        raise SystemExit("--mode perf needs Linux perf (the perf command) on PATH")
    return subprocess.Popen(["perf", "record", "-a", "-q", "-F", str(SAMPLING_HZ), "-o", path],
                            stdout=subprocess.DEVNULL)


def stop_sampling(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def machine_profile(path: str, ranks: list[int], aggregator: int, pairs: int) -> None:
    """Print, per call, the CPU of a rank (the mean of the ranks) and of the aggregator by
    WHERE, from the samples in `path`."""
    out = subprocess.run(["perf", "script", "-i", path, "-F", "pid,ip,sym,dso"],
                         capture_output=True, text=True, check=True).stdout
    counts = {role: collections.Counter() for role in ("rank", "aggregator")}
    total = busy = 0
    for line in out.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        total += 1
        pid = int(m[1])
        busy += pid != 0
        role = "rank" if pid in ranks else "aggregator" if pid == aggregator else None
        if role is not None:
            counts[role][where(m[2], m[3])] += 1
    per_pair = {"rank": 1e3 / (SAMPLING_HZ * pairs * len(ranks)),
                "aggregator": 1e3 / (SAMPLING_HZ * pairs)}
    whole = {role: sum(c.values()) for role, c in counts.items()}
    total = max(total, 1)
    print(f"  machine sampled: {busy / total:.0%} busy; ranks {whole['rank'] / total:.0%}, "
          f"aggregator {whole['aggregator'] / total:.0%} of all samples")
    width = max(map(len, WHERE))
    print(f"  {'CPU per call (warm-up included)':{width}s}   a rank (mean)     aggregator")
    for kind in (*WHERE, None):
        row = []
        for role in ("rank", "aggregator"):
            n = whole[role] if kind is None else counts[role][kind]
            row.append(f"{n * per_pair[role]:6.1f} ms {n / max(whole[role], 1):4.0%}")
        print(f"  {kind or 'all':{width}s}   {row[0]}   {row[1]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--link-mbit", type=float, default=100.0)
    p.add_argument("--size", default="4MiB")
    p.add_argument("--pairs", type=int, default=3, help="calls timed (pairs, or all_reduces)")
    p.add_argument("--all-reduce", action="store_true", help="full-duplex all_reduces of "
                   "--size per rank instead of pairs")
    p.add_argument("--mode", choices=("profile", "parts", "time", "perf"), default="profile")
    p.add_argument("--top", type=int, default=0, help="profile: also list the N functions that "
                   "took the most time of their own")
    p.add_argument("--gro", choices=("on", "off"), default="on",
                   help="GRO on the hosts' and the aggregator's NICs (the cluster's default: on)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, stats = f"{tmp}/engine.prof", f"{tmp}/aggregator.json"
        with Cluster(args.hosts, int(args.link_mbit * 1e6), gro=args.gro == "on") as cluster:
            aggregator = cluster.start_aggregator(stats_path=stats)
            aggregator_pid = aggregator.pid
            sampler = sample_machine(f"{tmp}/perf.data") if args.mode == "perf" else None
            try:
                ranks = cluster.run(timed_calls, args=(parse_size(args.size), args.pairs, args.mode,
                                                 path, args.all_reduce))
            finally:
                if sampler is not None:
                    stop_sampling(sampler)
            cluster.stop_aggregator(aggregator)
        with open(stats) as f:
            aggregator_cpu = json.load(f)["cpu_seconds"] / (args.pairs + 1)
        what = "all_reduces" if args.all_reduce else "pairs"
        print(f"{args.hosts} hosts, {args.link_mbit:g} Mbit/s, {args.size}, {args.pairs} {what}: "
              f"per call {np.median([r[1] for r in ranks]):.3f} s, CPU per rank "
              f"{np.median([r[0] for r in ranks]):.3f} s (median of the ranks), aggregator "
              f"{aggregator_cpu:.3f} s")
        if args.mode == "profile":
            stats = pstats.Stats(path)
            if args.top:
                stats.sort_stats("tottime").print_stats(args.top)
            made = sum(ncalls for _, ncalls, _, _, _ in stats.stats.values())
            print(f"  rank 1's engine: {made:,} function calls, {made / ranks[1][3]:.1f} per "
                  f"datagram sent or received ({ranks[1][3]:,})")
            busy = shares(stats)
            total = sum(busy.values())
            width = max(map(len, CATEGORIES))
            for kind, seconds in sorted(busy.items(), key=lambda kv: -kv[1]):
                print(f"  {kind:{width}s} {seconds / total:5.0%}  ({seconds:.3f} s profiled)")
        if args.mode == "perf":
            machine_profile(f"{tmp}/perf.data", [r[4] for r in ranks], aggregator_pid,
                            args.pairs + 1)
    for name, (seconds, calls) in sorted(ranks[1][2].items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:20s} {seconds * 1e3:7.1f} ms {calls:8.0f} calls "
              f"{seconds / max(calls, 1) * 1e6:7.1f} us each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
