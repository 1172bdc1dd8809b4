"""`overcast check`: is this job's network ready for overcast, and if not, why.

It runs on every rank under a launcher that sets torchrun's variables (torchrun, Slurm through
torchrun, `overcast cluster run`), meets through the job's store as overlap() does (a gloo
process group, then an overcast communicator), and finds, on every rank:

- whether multicast is delivered: every rank hears every other's probe of the full datagram
  size when the communicator is made (overcast.transport.probe), and which rank missed whom;
- the path MTU the ranks agreed on, and the datagram sockets' receive buffers the kernel grants;
- the aggregator: reached, welcomed under the job's secret, how many endpoints; or, with no
  OVERCAST_SWITCH, the one rank 0 starts beside itself;
- whether the job secret is set, and the link rate the multicast senders pace to;
- a few seconds of each collective, ring and overcast's, each result checked, each time against
  its floor at that rate.

Every rank then holds every rank's findings (a gloo all_gather_object), and `verdict` says
"ready" or "not ready", with the reason for each failure.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time

from overcast.bench.worker import DTYPE, workload
from overcast.schedules import cost
from overcast.transport.datagram import RECV_BUFFER_BYTES, enlarge_receive_buffer

# (collective, algorithm), as `overcast bench` names them; what each needs of every rank (its
# finding under that name says why it cannot)
COLLECTIVES = [("allgather", "ring"), ("allgather", "multicast"), ("reduce_scatter", "ring"),
               ("reduce_scatter", "innetwork"), ("overlap", "ring"), ("overlap", "overcast")]
NEEDS = {"multicast": ("multicast",), "innetwork": ("aggregator",),
         "overcast": ("multicast", "aggregator")}
# One AllGather's floor at the link rate: the bytes per rank follow from it.
CALL_SECONDS = 0.25
LEAST_BYTES, MOST_BYTES = 64 << 10, 64 << 20
JUMBO_MTU = 9000
# A multicast AllGather further than this from its floor says the rate given is not the link's.
RATE_SLACK = 1.25


def bytes_per_rank(link_bits: float, world: int) -> int:
    """What each rank gives an AllGather so that it takes about CALL_SECONDS at the link rate
    (a multiple of 64 KiB)."""
    n = link_bits / 8 * CALL_SECONDS / max(1, world - 1)
    return int(min(max(n, LEAST_BYTES), MOST_BYTES)) // LEAST_BYTES * LEAST_BYTES


def check_rank(rank: int, world: int, link_bits: float | None, seconds: float) -> list[dict]:
    """This rank's part (see the module's doc); every rank's findings, in rank order."""
    import torch.distributed as dist

    from overcast.errors import OvercastError
    from overcast.job import group_communicator

    mine: dict = {"rank": rank, "host": socket.gethostname(),
                  "secret": bool(os.environ.get("OVERCAST_SECRET")),
                  "switch": os.environ.get("OVERCAST_SWITCH"),
                  "link_bits_per_s": link_bits or _float(os.environ.get(
                      "OVERCAST_LINK_BITS_PER_S")),
                  "receive_buffer_bytes": _receive_buffer()}
    dist.init_process_group("gloo")
    try:
        made = None
        try:
            made = group_communicator(dist.distributed_c10d._get_default_store(), rank, world,
                                      "check", in_network=True, timeout=60,
                                      link_bits_per_s=mine["link_bits_per_s"])
        except OvercastError as err:
            mine["error"] = str(err)
        if made is not None:
            comm = made.comm
            mine.update(address=comm.address, mtu=comm.mtu, chunk_bytes=comm.chunk_bytes,
                        unheard=comm.multicast_unheard,
                        multicast=comm.unavailable("all_gather", "multicast"),
                        aggregator=comm.unavailable("reduce_scatter", "innetwork"),
                        endpoints=comm.aggregator_endpoints,
                        aggregator_started=made.job_switch is not None, switch=made.switch)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if made is None:
            return every
        try:  # every rank runs them, or none (a rank that could not meet is waited for)
            runs = [] if any("error" in r for r in every) else _runs(made.comm, every, seconds)
        finally:
            made.close()
        every = [None] * world
        dist.all_gather_object(every, {**mine, "runs": runs})
        return every
    finally:
        dist.destroy_process_group()


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _receive_buffer() -> int:
    """What the kernel grants a datagram socket that asks for the engine's receive buffer."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        return enlarge_receive_buffer(sock)


def _runs(comm, every: list[dict], seconds: float) -> list[dict]:
    """Each collective a few times, timed between barriers, its results checked: skipped, with
    the reason, where any rank cannot run it."""
    world, rank = comm.world_size, comm.rank
    link_bits = every[0]["link_bits_per_s"]
    n = bytes_per_rank(link_bits or 1e9, world)
    count = n // DTYPE().itemsize
    out = []
    for collective, algorithm in COLLECTIVES:
        why = next((need for need in NEEDS.get(algorithm, ()) for r in every if r[need]), None)
        if why is not None:  # the checks' table says why
            out.append({"collective": collective, "algorithm": algorithm, "skipped": why})
            continue
        run, reset, check = workload(comm, None, collective, algorithm, rank, count, world)
        floor = cost.floor_seconds(collective, n, world, (link_bits or 1e9) / 8)
        times, correct = [], True
        for k in range(1 + max(3, math.ceil(seconds / floor))):  # the first warms up
            reset()
            comm.barrier()
            t0 = time.perf_counter()
            run()
            if k:
                times.append(time.perf_counter() - t0)
            correct = correct and check()
        out.append({"collective": collective, "algorithm": algorithm, "bytes_per_rank": n,
                    "seconds": times, "floor_seconds": floor, "correct": correct})
    return out


def verdict(every: list[dict]) -> dict:
    """What every rank found, as checks (name, "ok"/"note"/"fail", detail), the collectives'
    rows (the slowest rank's time per run, median and range), and "ready" or why not."""
    first, world = every[0], len(every)
    checks: list[tuple[str, str, str]] = []
    rate = first["link_bits_per_s"]
    checks.append(("link rate", "ok", f"{rate / 1e6:g} Mbit/s per direction") if rate else
                  ("link rate", "fail", "no link rate: set OVERCAST_LINK_BITS_PER_S to the "
                                        "NIC's bits/s per direction (or --link-mbit); "
                                        "multicast paces its senders to it"))
    failed = [r for r in every if "error" in r]
    if failed:
        checks.append(("meeting", "fail", "; ".join(f"rank {r['rank']}: {r['error']}"
                                                    for r in failed[:4])))
        return _summed(checks, [], world)
    unheard = first["unheard"]
    joins = [f"rank {r['rank']} ({r['address']}): {r['multicast']}" for r in every
             if r["multicast"] and r["multicast"].startswith("multicast is unavailable here")]
    if joins:
        checks.append(("multicast", "fail", "; ".join(joins[:4])))
    elif unheard:
        checks.append(("multicast", "fail", first["multicast"]))
    else:
        checks.append(("multicast", "ok",
                       f"every rank heard every other's probe ({first['chunk_bytes']:,}-byte "
                       f"payloads, TTL 1)"))
    mtu = min(r["mtu"] for r in every)
    checks.append(("path MTU", "ok" if mtu >= JUMBO_MTU else "note",
                   f"{mtu} bytes, the smallest any rank measured to its peers" +
                   ("" if mtu >= JUMBO_MTU else f": below {JUMBO_MTU}, every byte takes "
                    f"{JUMBO_MTU // mtu}x the datagrams, and overcast's engine pays per "
                    f"datagram (jumbo frames: docs/deploy.md)")))
    least = min(r["receive_buffer_bytes"] for r in every)
    checks.append(("socket buffers", "ok" if least >= RECV_BUFFER_BYTES else "note",
                   f"{least / 2**20:.1f} MiB granted of {RECV_BUFFER_BYTES / 2**20:g} MiB asked" +
                   ("" if least >= RECV_BUFFER_BYTES else
                    ": net.core.rmem_max caps it and this user lacks CAP_NET_ADMIN; a burst "
                    "that does not fit is lost and repaired (sysctl -w "
                    f"net.core.rmem_max={RECV_BUFFER_BYTES})")))
    refused = [f"rank {r['rank']}: {r['aggregator']}" for r in every if r["aggregator"]]
    if refused:
        checks.append(("aggregator", "fail", "; ".join(refused[:4])))
    elif first["aggregator_started"]:
        checks.append(("aggregator", "note",
                       f"no OVERCAST_SWITCH: rank 0 started one beside itself at "
                       f"{first['switch']}, whose host's link then carries every rank's "
                       f"contributions (docs/deploy.md)"))
    else:
        checks.append(("aggregator", "ok", f"{first['switch']}: every rank welcomed under the "
                                           f"job's secret, {first['endpoints']} endpoint(s)"))
    unset = [r["rank"] for r in every if not r["secret"]]
    checks.append(("secret", "note" if unset else "ok",
                   f"no OVERCAST_SECRET on {_ranks(unset)}: rank 0 drew one and shared it "
                   f"through the job's store, which must then be trusted as torchrun's is"
                   if unset else "OVERCAST_SECRET set on every rank"))
    rows = _rows(every)
    wrong = [f"{r['collective']} {r['algorithm']}" for r in rows if not r.get("correct", True)]
    if wrong:
        checks.append(("collectives", "fail", f"wrong results: {', '.join(wrong)}"))
    multicast = next((r for r in rows if r["algorithm"] == "multicast" and "ratio" in r), None)
    if rate and multicast is not None:
        ratio = multicast["ratio"]
        checks.append(("rate", "ok" if 1 / RATE_SLACK <= ratio <= RATE_SLACK else "note",
                       f"a multicast AllGather took {ratio:.2f}x its floor at "
                       f"{rate / 1e6:g} Mbit/s" +
                       ("" if ratio <= RATE_SLACK else ": the links carry less than the rate "
                        "given, or the engines cannot keep up with it") +
                       ("" if ratio >= 1 / RATE_SLACK else ": the links carry more than the "
                        "rate given, which multicast then leaves unused")))
    return _summed(checks, rows, world)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))}" + \
        (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def _rows(every: list[dict]) -> list[dict]:
    rows = []
    for k, run in enumerate(every[0]["runs"]):
        row = {key: run[key] for key in ("collective", "algorithm")}
        if "skipped" in run:
            rows.append({**row, "skipped": run["skipped"]})
            continue
        slowest = [max(r["runs"][k]["seconds"][i] for r in every)
                   for i in range(len(run["seconds"]))]
        median = statistics.median(slowest)
        rows.append({**row, "bytes_per_rank": run["bytes_per_rank"], "seconds": median,
                     "range": [min(slowest), max(slowest)], "runs": len(slowest),
                     "ratio": median / run["floor_seconds"],
                     "correct": all(r["runs"][k]["correct"] for r in every)})
    return rows


def _summed(checks: list[tuple[str, str, str]], rows: list[dict], world: int) -> dict:
    failures = [detail if detail.startswith(name) else f"{name}: {detail}"
                for name, state, detail in checks if state == "fail"]
    return {"ranks": world, "checks": checks, "collectives": rows, "ready": not failures,
            "verdict": "ready" if not failures else "not ready: " + "; ".join(failures)}
