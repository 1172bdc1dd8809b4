"""`overcast check`: is this job's network ready for overcast, and if not, why.

It runs on every rank under a launcher that sets torchrun's variables (torchrun, Slurm through
torchrun, `overcast cluster run`), meets through the job's store as overlap() does (a gloo
process group, then an overcast communicator), and finds, on every rank:

- whether multicast is delivered: every rank hears every other's probe of the full datagram
  size when the communicator is made (overcast.transport.probe), and which rank missed whom;
- the path MTU the ranks agreed on, and the datagram sockets' receive buffers the kernel grants;
- the aggregator: reached, welcomed under the job's secret, how many endpoints; or, with no
  OVERCAST_AGGREGATORS, the one rank 0 starts beside itself;
- whether the job secret is set, and the link rate the multicast senders pace to;
- a few seconds of each collective, ring and overcast's, each result checked, each call moving
  what a ring AllGather takes CALL_SECONDS to gather here, each time against its floor at that
  rate.

Every rank then holds every rank's findings (a gloo all_gather_object), and `verdict` judges what
they measured: "ready" where nothing failed and overcast's pair beats its rings' pair timed in
the same run; "works, but slower than rings here" with the likely causes where it does not;
"not ready" with the reason for each failure; each with its exit code.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import statistics
import time
from typing import Any

import numpy as np

from overcast.bench.rank import DTYPE, workload
from overcast.limits import aggregators_from_env
from overcast.schedules import cost
from overcast.sim.plan import WORTH_SAVING
from overcast.transport.datagram import RECV_BUFFER_BYTES, enlarge_receive_buffer

# (collective, algorithm), as `overcast bench` names them; what each needs (a finding of that
# name says why it cannot run)
COLLECTIVES = [
    ("allgather", "ring"),
    ("allgather", "multicast"),
    ("reduce_scatter", "ring"),
    ("reduce_scatter", "innetwork"),
    ("overlap", "ring"),
    ("overlap", "overcast"),
]
NEEDS = {
    "multicast": ("link rate", "multicast"),
    "innetwork": ("link rate", "aggregator"),
    "overcast": ("link rate", "multicast", "aggregator"),
}
# What each call should take: a ring AllGather's bytes per rank are grown until it takes this
# long here, whatever the links' rate, and every collective moves that many.
CALL_SECONDS = 0.25
LEAST_BYTES, MOST_BYTES = 64 << 10, 64 << 20
JUMBO_MTU = 9000
# A rate given more than this far from what the rings measured is not the links'.
RATE_SLACK = 1.25
# A datagram collective (multicast AllGather, in-network ReduceScatter) further than this from
# its floor at the link rate is held back by something the checks try to name.
DATAGRAM_SLACK = 1.5
# The exit codes: ready; not ready (a check failed); working, but overcast's pair slower than
# its rings here (each usage error exits 2, as every command's does).
READY, NOT_READY, SLOWER = 0, 1, 3


def scaled_bytes(n: int, seconds: float) -> int:
    """The bytes per rank that take CALL_SECONDS where `n` took `seconds` (a multiple of 64 KiB,
    within LEAST_BYTES and MOST_BYTES)."""
    wanted = n * CALL_SECONDS / max(seconds, 1e-6)
    return int(min(max(wanted, LEAST_BYTES), MOST_BYTES)) // LEAST_BYTES * LEAST_BYTES


def check_rank(rank: int, world: int, link_bits: float | None, seconds: float) -> list[dict]:
    """This rank's part (see the module's doc); every rank's findings, in rank order."""
    import torch.distributed as dist

    from overcast.errors import OvercastError
    from overcast.job import group_communicator

    mine: dict = {
        "rank": rank,
        "host": socket.gethostname(),
        "secret": bool(os.environ.get("OVERCAST_SECRET")),
        "aggregators": aggregators_from_env(),
        "link_bits_per_s": link_bits or _float(os.environ.get("OVERCAST_LINK_BITS_PER_S")),
        "receive_buffer_bytes": _receive_buffer(),
    }
    dist.init_process_group("gloo")
    try:
        made = None
        try:
            made = group_communicator(
                dist.distributed_c10d._get_default_store(),
                rank,
                world,
                "check",
                in_network=True,
                timeout=60,
                link_bits_per_s=mine["link_bits_per_s"],
            )
        except OvercastError as err:
            mine["error"] = str(err)
        if made is not None:
            comm = made.comm
            mine.update(
                address=comm.address,
                mtu=comm.mtu,
                chunk_bytes=comm.chunk_bytes,
                unheard=comm.multicast_unheard,
                multicast=comm.network_unavailable("multicast"),
                aggregator=comm.network_unavailable("innetwork"),
                endpoints=comm.aggregator_endpoints,
                aggregator_started=made.job_aggregator is not None,
                aggregators=made.aggregators,
            )
        every: list[Any] = [None] * world  # all_gather_object fills every slot
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


def _blocked(algorithm: str, every: list[dict]) -> str | None:
    """The finding that keeps `algorithm` from running on some rank, or None."""
    for need in NEEDS.get(algorithm, ()):
        if (need == "link rate" and not every[0]["link_bits_per_s"]) or (
            need != "link rate" and any(r[need] for r in every)
        ):
            return need
    return None


def _slowest(comm, seconds: float) -> float:
    """The most `seconds` any rank gives: alike on every rank."""
    every = np.empty(comm.world_size, np.float64)
    comm.all_gather(every, np.array([seconds], np.float64))
    return float(every.max())


def _timed(comm, run, reset) -> float:
    """One call between barriers: the slowest rank's seconds."""
    reset()
    comm.barrier()
    began = time.perf_counter()
    run()
    return _slowest(comm, time.perf_counter() - began)


def _sized(comm) -> int:
    """The bytes per rank a ring AllGather takes about CALL_SECONDS to gather here, timed
    (growing from LEAST_BYTES), not worked out from a rate that may be wrong or missing."""
    n = LEAST_BYTES
    while True:
        run, reset, _ = workload(
            comm, None, "allgather", "ring", comm.rank, n // DTYPE().itemsize, comm.world_size
        )
        took = _timed(comm, run, reset)
        if took >= CALL_SECONDS / 4 or n >= MOST_BYTES:
            return scaled_bytes(n, took)
        n = min(MOST_BYTES, n * 16)


def _runs(comm, every: list[dict], seconds: float) -> list[dict]:
    """Each collective after a warm-up, as many times as fit in `seconds` (3 at least), timed
    between barriers, its results checked: skipped, with the reason, where any rank cannot run
    it. Each moves what a ring AllGather takes CALL_SECONDS to gather here."""
    world, rank = comm.world_size, comm.rank
    link_bits = every[0]["link_bits_per_s"]
    n = _sized(comm)
    count = n // DTYPE().itemsize
    out: list[dict] = []
    for collective, algorithm in COLLECTIVES:
        why = _blocked(algorithm, every)
        if why is not None:  # the checks' table says why
            out.append({"collective": collective, "algorithm": algorithm, "skipped": why})
            continue
        run, reset, check = workload(comm, None, collective, algorithm, rank, count, world)
        warm = _timed(comm, run, reset)
        times, correct = [], check()
        for _ in range(max(3, math.ceil(seconds / max(warm, 1e-6)))):
            times.append(_timed(comm, run, reset))
            correct = correct and check()
        out.append(
            {
                "collective": collective,
                "algorithm": algorithm,
                "bytes_per_rank": n,
                "seconds": times,
                "correct": correct,
                "floor_seconds": cost.floor_seconds(collective, n, world, link_bits / 8)
                if link_bits
                else None,
            }
        )
    return out


def verdict(every: list[dict]) -> dict:
    """What every rank found, as checks (name, "ok", "note", "slower" or "fail", detail), the
    collectives' rows (the slowest rank's time per run, median and range), and the verdict with
    its exit code: "ready" where overcast's pair saves WORTH_SAVING of its rings' pair measured
    in the same run, else "works, but slower than rings here" and why, or "not ready" and the
    reason for each failure."""
    first, world = every[0], len(every)
    checks: list[tuple[str, str, str]] = []
    rate = first["link_bits_per_s"]
    checks.append(
        ("link rate", "ok", f"{rate / 1e6:g} Mbit/s per direction")
        if rate
        else (
            "link rate",
            "fail",
            "no link rate: set OVERCAST_LINK_BITS_PER_S to the "
            "NIC's bits/s per direction (or --link-mbit): "
            "multicast paces its senders to it, and the "
            "collectives that need it were skipped",
        )
    )
    failed = [r for r in every if "error" in r]
    if failed:
        checks.append(
            ("meeting", "fail", "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed[:4]))
        )
        return _summed(checks, [], world)
    unheard = first["unheard"]
    joins = [
        f"rank {r['rank']} ({r['address']}): {r['multicast']}"
        for r in every
        if r["multicast"] and r["multicast"].startswith("multicast is unavailable here")
    ]
    if joins:
        checks.append(("multicast", "fail", "; ".join(joins[:4])))
    elif unheard:
        checks.append(("multicast", "fail", first["multicast"]))
    else:
        checks.append(
            (
                "multicast",
                "ok",
                f"every rank heard every other's probe ({first['chunk_bytes']:,}-byte "
                f"payloads, TTL 1)",
            )
        )
    mtu = min(r["mtu"] for r in every)
    checks.append(
        (
            "path MTU",
            "ok" if mtu >= JUMBO_MTU else "note",
            f"{mtu} bytes, the smallest any rank measured to its peers"
            + (
                ""
                if mtu >= JUMBO_MTU
                else f": below {JUMBO_MTU}, every byte takes "
                f"{JUMBO_MTU // mtu}x the datagrams, and overcast's engine pays per "
                f"datagram (jumbo frames: docs/deploy.md)"
            ),
        )
    )
    least = min(r["receive_buffer_bytes"] for r in every)
    checks.append(
        (
            "socket buffers",
            "ok" if least >= RECV_BUFFER_BYTES else "note",
            f"{least / 2**20:.1f} MiB granted of {RECV_BUFFER_BYTES / 2**20:g} MiB asked"
            + (
                ""
                if least >= RECV_BUFFER_BYTES
                else ": net.core.rmem_max caps it and this user lacks CAP_NET_ADMIN; a burst "
                "that does not fit is lost and repaired (sysctl -w "
                f"net.core.rmem_max={RECV_BUFFER_BYTES})"
            ),
        )
    )
    checks += _secret_and_aggregator(every)
    rows = _rows(every)
    wrong = [f"{r['collective']} {r['algorithm']}" for r in rows if not r.get("correct", True)]
    if wrong:
        checks.append(("collectives", "fail", f"wrong results: {', '.join(wrong)}"))
    checks += _measured(rows, every)
    return _summed(checks, rows, world)


def _secret_and_aggregator(every: list[dict]) -> list[tuple[str, str, str]]:
    """The aggregator's check and the secret's: a registration that fails (not a refusal, nor
    an aggregator out of reach) is most likely a secret the aggregator does not hold, as it
    closes such a registration without a word."""
    first = every[0]
    unset = [r["rank"] for r in every if not r["secret"]]
    external = not first["aggregator_started"]
    out = []
    refused = [r for r in every if r["aggregator"]]
    if refused:
        said: dict[str, list[int]] = {}  # each reason once, with the ranks that gave it
        for r in refused:
            said.setdefault(r["aggregator"], []).append(r["rank"])
        detail = "; ".join(f"{_ranks(ranks)}: {why}" for why, ranks in list(said.items())[:4])
        if any("registration with the aggregator" in r["aggregator"] for r in refused):
            detail += (
                ": most likely the secret: an aggregator closes a registration from a job "
                "whose secret it does not hold, and "
                + (
                    f"OVERCAST_SECRET is not set on {_ranks(unset)}"
                    if unset
                    else "the aggregator must be started with the OVERCAST_SECRET the ranks have"
                )
            )
        out.append(("aggregator", "fail", detail))
    elif not external:
        out.append(
            (
                "aggregator",
                "note",
                f"no OVERCAST_AGGREGATORS: rank 0 started one beside itself at "
                f"{first['aggregators']}, whose host's link then carries every rank's "
                f"contributions (docs/deploy.md)",
            )
        )
    else:
        out.append(
            (
                "aggregator",
                "ok",
                f"{first['aggregators']}: every rank welcomed under the "
                f"job's secret, {first['endpoints']} endpoint(s)",
            )
        )
    if not unset:
        out.append(("secret", "ok", "OVERCAST_SECRET set on every rank"))
    elif external and first["aggregators"]:
        out.append(
            (
                "secret",
                "fail",
                f"OVERCAST_SECRET is not set on {_ranks(unset)}: rank 0 drew a secret of "
                f"its own, which the aggregator at {first['aggregators']} "
                f"(OVERCAST_AGGREGATORS) cannot hold; set OVERCAST_SECRET on every rank to "
                f"the one it was started with",
            )
        )
    else:
        out.append(
            (
                "secret",
                "note",
                f"no OVERCAST_SECRET on {_ranks(unset)}: rank 0 drew one and shared it "
                f"through the job's store, which must then be trusted as torchrun's is",
            )
        )
    return out


def _measured(rows: list[dict], every: list[dict]) -> list[tuple[str, str, str]]:
    """What the times say: the link rate against what the rings moved, each datagram
    collective against its floor (within DATAGRAM_SLACK), and overcast's pair against the
    rings' pair, with the likely causes where it does not beat it."""
    first, world = every[0], len(every)
    rate = first["link_bits_per_s"]
    timed = {(r["collective"], r["algorithm"]): r for r in rows if "seconds" in r}
    ring, multicast, ring_rs, innetwork = (
        timed.get(k)
        for k in (
            ("allgather", "ring"),
            ("allgather", "multicast"),
            ("reduce_scatter", "ring"),
            ("reduce_scatter", "innetwork"),
        )
    )
    out, causes = [], []
    if rate and ring is not None:
        moved, ratio = rate / ring["ratio"], ring["ratio"]
        said = (
            f"a ring AllGather moved about {moved / 1e6:.3g} Mbit/s per link, "
            f"{1 / ratio:.2f}x the {rate / 1e6:g} Mbit/s given"
        )
        why = None
        if ratio < 1 / RATE_SLACK:
            why = (
                "the links carry more than OVERCAST_LINK_BITS_PER_S says, and multicast, "
                "paced to the rate given, leaves the rest unused"
            )
        elif ratio > RATE_SLACK and multicast is not None and multicast["ratio"] > RATE_SLACK:
            why = (
                "the links (or the hosts) carry less than OVERCAST_LINK_BITS_PER_S says, "
                "and multicast, paced to the rate given, overruns them and resends"
            )
        if why:
            causes.append(why)
        out.append(("rate", "note" if why else "ok", said + (f": {why}" if why else "")))
    datagram = [
        (name, r)
        for name, r in (("multicast AllGather", multicast), ("in-network ReduceScatter", innetwork))
        if r
    ]
    if datagram:
        slow = [name for name, r in datagram if r["ratio"] > DATAGRAM_SLACK]
        out.append(
            (
                "datagram collectives",
                "note" if slow else "ok",
                ", ".join(f"{name} {r['ratio']:.2f}x" for name, r in datagram)
                + f" its floor (within {DATAGRAM_SLACK:g}x expected)",
            )
        )
    sharing = max(collections.Counter(r["address"] for r in every).values())
    if sharing > 1:
        causes.append(
            f"{sharing} ranks share a NIC, and each sends its whole gradient through "
            f"it to the aggregator, {sharing}x what a ring sends"
        )
    if first["aggregator_started"]:
        causes.append(
            "the aggregator rank 0 started beside itself (no OVERCAST_AGGREGATORS) takes "
            "every rank's contributions through rank 0's link"
        )
    elif innetwork is not None and ring_rs is not None:
        # against the ring's ReduceScatter of the same bytes where the links are slower than
        # the rate given, and less what ranks sharing a NIC send through it
        behind = innetwork["ratio"] / max(1.0, ring_rs["ratio"]) / sharing
        if behind > DATAGRAM_SLACK:
            causes.append(
                f"the aggregator at {first['aggregators']} takes the contributions at "
                f"about 1/{behind:.1f} of the hosts' rate: its link or cores are "
                f"behind what {world} ranks send it"
            )
    if (
        multicast is not None
        and multicast["ratio"] > DATAGRAM_SLACK
        and not any("OVERCAST_LINK_BITS_PER_S" in c for c in causes)
    ):
        causes.append(
            f"a multicast AllGather took {multicast['ratio']:.2f}x its floor: "
            f"datagrams lost and resent, or the engines short of CPU"
        )
    pair, rings = timed.get(("overlap", "overcast")), timed.get(("overlap", "ring"))
    if pair is not None and rings is not None:
        said = (
            f"overcast's pair {pair['seconds'] * 1e3:.0f} ms against its rings' "
            f"{rings['seconds'] * 1e3:.0f} ms measured here"
        )
        if pair["seconds"] <= (1 - WORTH_SAVING) * rings["seconds"]:
            out.append(
                (
                    "overcast's pair",
                    "ok",
                    f"{said}, {rings['seconds'] / pair['seconds']:.2f}x faster",
                )
            )
        else:
            out.append(
                (
                    "overcast's pair",
                    "slower",
                    f"{said} (ready takes at most {1 - WORTH_SAVING:.0%} of theirs); "
                    f"likely: "
                    + (
                        "; ".join(causes)
                        or "no cause found among the link "
                        "rate, the aggregator and ranks "
                        "sharing a NIC"
                    ),
                )
            )
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))}" + (
        f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    )


def _rows(every: list[dict]) -> list[dict]:
    rows = []
    for k, run in enumerate(every[0]["runs"]):
        row = {key: run[key] for key in ("collective", "algorithm")}
        if "skipped" in run:
            rows.append({**row, "skipped": run["skipped"]})
            continue
        slowest = run["seconds"]  # every rank's: each call's slowest, agreed
        median = statistics.median(slowest)
        rows.append(
            {
                **row,
                "bytes_per_rank": run["bytes_per_rank"],
                "seconds": median,
                "range": [min(slowest), max(slowest)],
                "runs": len(slowest),
                "correct": all(r["runs"][k]["correct"] for r in every),
                **({"ratio": median / run["floor_seconds"]} if run["floor_seconds"] else {}),
            }
        )
    return rows


def _summed(checks: list[tuple[str, str, str]], rows: list[dict], world: int) -> dict:
    def said(state: str) -> list[str]:
        return [
            detail if detail.startswith(name) else f"{name}: {detail}"
            for name, state_, detail in checks
            if state_ == state
        ]

    failures, slower = said("fail"), said("slower")
    code = NOT_READY if failures else SLOWER if slower else READY
    return {
        "ranks": world,
        "checks": checks,
        "collectives": rows,
        "ready": code == READY,
        "exit_code": code,
        "verdict": {
            READY: "ready",
            NOT_READY: "not ready: " + "; ".join(failures),
            SLOWER: "works, but slower than rings here: " + "; ".join(slower),
        }[code],
    }
