"""`overcast bench`: collectives on the emulated cluster, nccl-tests style, beside gloo.

Every (collective, algorithm, size) point runs on fresh processes on the same cluster: warm-up
runs, then timed repetitions, each between two barriers with the NIC counters read around it.
A run's time is the slowest rank's; a point's time is the median run's.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import os
import platform
import statistics
import tempfile
from collections.abc import Sequence

from overcast.bench.rank import DTYPE, run_point, uneven_splits
from overcast.cluster.netns import MAX_AGGREGATORS, Cluster
from overcast.limits import (
    check_aggregators,
    check_algorithms,
    check_count,
    check_hosts,
    check_link_rate,
    check_loss,
    check_mtu,
    check_roots,
    check_shards,
    check_size,
    check_slots,
    require,
)
from overcast.schedules import cost
from overcast.aggregator.service import default_shards
from overcast.wire.header import OVERHEAD_BYTES

COLLECTIVES = (
    "allgather",
    "reduce_scatter",
    "overlap",
    "all_reduce",
    "all_to_all",
    "all_to_all_uneven",
    "send_recv",
)
# all_to_all (split evenly, or unevenly: rank.uneven_splits) and send_recv (each even rank
# sends to the odd one after it) run on torch.distributed groups: the "overcast" backend's
# pairwise exchange and point-to-point stream, or gloo's.
ALGORITHMS = {
    "allgather": ("ring", "multicast", "gloo"),
    "reduce_scatter": ("ring", "innetwork", "gloo"),
    "overlap": ("overcast", "ring", "gloo"),
    "all_reduce": ("ring", "fullduplex", "gloo"),
    "all_to_all": ("pairwise", "gloo"),
    "all_to_all_uneven": ("pairwise", "gloo"),
    "send_recv": ("stream", "gloo"),
}
# Algorithms that need the aggregator (overcast aggregator) on the cluster.
NEEDS_AGGREGATOR = {
    ("reduce_scatter", "innetwork"),
    ("overlap", "overcast"),
    ("all_reduce", "fullduplex"),
}
# Algorithms whose ranks move datagrams, and so feel injected loss.
DATAGRAM_ALGORITHMS = {"multicast", "innetwork", "overcast", "fullduplex"}


def process_cpu_seconds(pid: int) -> float:
    """CPU time of process `pid`: its threads' time on the CPU as the scheduler counts it, in
    nanoseconds (/proc/PID/task/*/schedstat); where the kernel keeps no such count, user plus
    system time in clock ticks (/proc/PID/stat), too coarse for a short run of a process that
    spends little."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except FileNotFoundError:  # a thread that ended after the listing
                continue
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_request(collectives: list[str], algorithms: list[str]) -> None:
    """Raise InvalidArgumentError naming what is unknown, before any cluster is built."""
    check_algorithms(collectives, algorithms, ALGORITHMS)


@dataclasses.dataclass(frozen=True)
class Aggregators:
    """The aggregators in-network reduction runs on: `count` of them, each on an attachment of
    its own shaped at `link_bits` each way (None: unshaped, the switch's own compute), each
    with `shards` data-path threads (None: the cores it may use)."""

    count: int = 1
    shards: int | None = None
    link_bits: int | None = None

    def check(self) -> None:
        check_aggregators(self.count, MAX_AGGREGATORS)
        if self.shards is not None:
            check_shards(self.shards, self.count)
        if self.link_bits is not None:
            check_link_rate(self.link_bits, "--aggregator-link-mbit, link_bits / 1e6")

    def shard_count(self) -> int:
        return default_shards() if self.shards is None else self.shards


def check_flags(
    hosts: int,
    link_rates: Sequence[float],
    sizes: list[int],
    reps: int,
    warmup: int,
    mtu: int,
    roots: list[int | None],
    loss: float,
    loss_burst: float,
    slots: int,
    within: float = 1.15,
    aggregators: Aggregators = Aggregators(),
) -> None:
    """Raise InvalidArgumentError naming the first value that cannot run and what is allowed,
    before any cluster is built."""
    check_hosts(hosts)
    aggregators.check()
    for bits in link_rates:
        check_link_rate(bits)
    require(bool(link_rates), "the link rates", "at least one", "none", "--link-mbit, link_bits")
    require(
        len(set(link_rates)) == len(link_rates),
        "the link rates",
        "all different",
        ",".join(f"{bits / 1e6:g}" for bits in link_rates),
        "--link-mbit, link_bits",
    )
    require(
        math.isfinite(within) and within >= 1,
        "the sweep's bar",
        "1 or more times the floor",
        within,
        "--within, within",
    )
    for nbytes in sizes:
        check_size(nbytes)
    check_count("timed runs", reps, 1, "--reps, reps")
    check_count("warm-up runs", warmup, 0, "--warmup, warmup")
    check_mtu(mtu)
    for r in roots:
        check_roots(r, hosts)
    check_loss(loss, loss_burst)
    check_slots(slots)


def summarize(
    collective: str,
    algorithm: str,
    hosts: int,
    nbytes: int,
    link_bits: int,
    per_rank: list[dict],
    roots: int | None = None,
    loss: float = 0.0,
    aggregator_cpu: float | None = None,
) -> dict:
    """One result row from every rank's report (see rank.run_point)."""
    reps = len(per_rank[0]["runs"])
    count = max(1, nbytes // DTYPE().itemsize)
    n = count * DTYPE().itemsize
    runs = [[r["runs"][k] for r in per_rank] for k in range(reps)]
    seconds = [max(x["seconds"] for x in run) for run in runs]
    median = statistics.median(seconds)
    if collective == "all_to_all_uneven":
        matrix = [[k * DTYPE().itemsize for k in row] for row in uneven_splits(hosts, count)]
        floor = cost.exchange_floor_seconds(matrix, link_bits / 8)
        sent, received = cost.exchange_traffic(matrix)
    else:
        floor = cost.floor_seconds(collective, n, hosts, link_bits / 8)
        sent, received = cost.traffic(collective, algorithm, n, hosts)
    tx = statistics.fmean(r["tx_bytes"] for r in per_rank)
    rx = statistics.fmean(r["rx_bytes"] for r in per_rank)
    datagrams = (
        statistics.fmean(
            r["protocol"].get("datagrams_in", 0) + r["protocol"].get("datagrams_out", 0)
            for r in per_rank
        )
        if algorithm in DATAGRAM_ALGORITHMS
        else 0
    )
    cpu = statistics.median(statistics.fmean(x["cpu_seconds"] for x in run) for run in runs)
    return {
        "collective": collective,
        "algorithm": algorithm,
        "hosts": hosts,
        "bytes_per_rank": n,
        "link_bits_per_s": link_bits,
        "seconds": median,
        "seconds_all": seconds,
        "floor_seconds": floor,
        "ratio_to_floor": median / floor,
        "algbw_bytes_per_s": cost.algbw(n, hosts, median, collective),
        "busbw_bytes_per_s": cost.busbw(n, hosts, median, collective),
        "tx_bytes_per_host": round(tx),
        "rx_bytes_per_host": round(rx),
        "tx_bytes_max_host": round(max(r["tx_bytes"] for r in per_rank)),
        "rx_bytes_max_host": round(max(r["rx_bytes"] for r in per_rank)),
        "tx_packets_per_host": round(statistics.fmean(r["tx_packets"] for r in per_rank)),
        "rx_packets_per_host": round(statistics.fmean(r["rx_packets"] for r in per_rank)),
        "payload_sent_per_host": sent,
        "payload_received_per_host": received,
        "tx_over_payload": tx / sent if sent else None,
        "rx_over_payload": rx / received if received else None,
        "cpu_seconds_per_rank": cpu,
        # The cost apart from the link rate: per datagram sent or received (datagram
        # algorithms), per GiB through the NIC (every algorithm).
        "cpu_us_per_datagram": 1e6 * cpu / datagrams if datagrams else None,
        "cpu_seconds_per_gib": cpu / ((tx + rx) / 2**30) if tx + rx else None,
        "machine_cpu_busy": statistics.median(run[0]["machine_busy"] for run in runs),
        "repetitions": reps,
        "roots": (roots or hosts) if algorithm in ("multicast", "overcast") else None,
        "loss": loss if algorithm in DATAGRAM_ALGORITHMS else 0.0,
        "switch_cpu_seconds_per_run": aggregator_cpu,
        "protocol_per_host": {
            key: statistics.fmean(r["protocol"][key] for r in per_rank)
            for key in per_rank[0]["protocol"]
        },
        "chunk_bytes": per_rank[0]["chunk_bytes"],
        "mtu": per_rank[0]["mtu"],
        "correct": all(x["correct"] for run in runs for x in run),
    }


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
            )
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
    }


def run_bench(
    hosts: int,
    link_bits: int | list[int],
    sizes: list[int],
    collectives: list[str],
    algorithms: list[str],
    reps: int = 5,
    warmup: int = 1,
    mtu: int = 9000,
    roots: Sequence[int | None] = (None,),
    loss: float = 0.0,
    loss_burst: float = 1.0,
    timeline: str | None = None,
    aggregator_slots: int = 256,
    within: float = 1.15,
    progress=None,
    write_timeline=None,
    aggregators: Aggregators = Aggregators(),
) -> dict:
    """Run every requested point on a cluster of `link_bits` (bits/s per direction); return
    {"meta": ..., "results": [...]}.

    `roots` lists the multicast AllGather's numbers of concurrent roots to try (None: all
    ranks). `loss` is injected into every host's datagram receive path; TCP (ring, gloo) sees
    none of it. With `timeline`, the last run of the largest overlap point of overcast and ring
    is written as `<timeline>-<algorithm>.json` (Chrome trace) and `.png` by
    `write_timeline(traces, path, link_bits, title)` (overcast.report.timeline's).

    A list of several link rates sweeps: every point runs on a cluster of each in turn, each
    result carries its rate, meta["link_bits_per_s"] is None and meta["link_rates_bits_per_s"]
    the list, and "sweep" names per point the highest rate at which it holds `within` times
    its floor (sweep_summary). In-network reduction runs on `aggregators`. Everything is
    checked before the first cluster is built."""
    rates = list(link_bits) if isinstance(link_bits, (list, tuple)) else [link_bits]
    check_request(collectives, algorithms)
    check_flags(
        hosts,
        rates,
        sizes,
        reps,
        warmup,
        mtu,
        list(roots),
        loss,
        loss_burst,
        aggregator_slots,
        within,
        aggregators,
    )
    points = [
        (c, a, s, r)
        for c in collectives
        for a in algorithms
        if a in ALGORITHMS[c]
        for r in (roots if a in ("multicast", "overcast") else (None,))
        for s in sizes
    ]
    import torch  # imported once here so that forked hosts start fast

    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    slots = aggregator_slots if any((c, a) in NEEDS_AGGREGATOR for c, a, _, _ in points) else None
    results: list[dict] = []
    timelines: list[str] = []
    summaries: list[dict] = []
    for i, bits in enumerate(rates):

        def step(done, total, what, i=i, bits=bits):
            if progress:
                progress(
                    i * total + done,
                    len(rates) * total,
                    f"{bits / 1e6:g} Mbit/s: {what}" if len(rates) > 1 else what,
                )

        summary = _run_points(
            hosts,
            bits,
            points,
            sizes,
            reps,
            warmup,
            mtu,
            loss,
            loss_burst,
            (timeline, write_timeline) if timeline else None,
            slots,
            aggregators,
            f"-{bits / 1e6:g}mbit" if len(rates) > 1 else "",
            step,
            results,
            timelines,
        )
        if summary is not None:
            summaries.append(summary)
    meta = {
        "date": date,
        "hosts": hosts,
        "link_bits_per_s": rates[0] if len(rates) == 1 else None,
        "mtu": mtu,
        "dtype": str(DTYPE().dtype),
        "repetitions": reps,
        "warmup": warmup,
        "header_overhead_bytes": OVERHEAD_BYTES,
        "loss": loss,
        "loss_burst": loss_burst,
        "timelines": timelines,
        "switch_slots": slots,
        "switch": summaries,
        "aggregators": {
            "count": aggregators.count,
            "shards": aggregators.shard_count(),
            "link_bits_per_s": aggregators.link_bits,
        }
        if slots
        else None,
        "machine": machine(),
        "torch": torch.__version__,
    }
    if len(rates) == 1:
        return {"meta": meta, "results": results}
    meta.update(link_rates_bits_per_s=rates, within=within)
    return {"meta": meta, "results": results, "sweep": sweep_summary(results, within)}


def _run_points(
    hosts: int,
    link_bits: int,
    points: list[tuple],
    sizes: list[int],
    reps: int,
    warmup: int,
    mtu: int,
    loss: float,
    loss_burst: float,
    timeline: tuple | None,
    aggregator_slots: int | None,
    aggregators: Aggregators,
    suffix: str,
    progress,
    results: list[dict],
    timelines: list[str],
) -> dict | None:
    """Every point on one cluster of `link_bits`, with the aggregators if `aggregator_slots` says
    how many slots they have: its rows added to `results`, the timelines it writes (their names
    end in `suffix`) to `timelines`. Returns what the aggregators counted themselves over all
    the points (aggregator_summary), if they ran."""
    env = {"OVERCAST_LOSS": str(loss), "OVERCAST_LOSS_BURST": str(loss_burst)}
    with (
        Cluster(
            hosts,
            link_bits,
            mtu=mtu,
            aggregators=aggregators.count,
            aggregator_bits_per_s=aggregators.link_bits,
        ) as cluster,
        tempfile.TemporaryDirectory() as tmp,
    ):
        procs = (
            []
            if aggregator_slots is None
            else cluster.start_aggregators(aggregator_slots, tmp, aggregators.shards)
        )
        carried = [cluster.counters(None, a) for a in range(len(procs))]
        for i, (collective, algorithm, nbytes, k) in enumerate(points):
            label = f" roots={k or hosts}" if algorithm in ("multicast", "overcast") else ""
            progress(i, len(points), f"{collective} {algorithm}{label} {nbytes} B")
            traced = (
                timeline
                if collective == "overlap" and algorithm != "gloo" and nbytes == max(sizes)
                else None
            )
            trace = bool(traced)
            before = aggregators_cpu(procs)
            per_rank = cluster.run(
                run_point,
                timeout=600,
                env=env,
                args=(collective, algorithm, nbytes, reps, warmup, k, trace),
            )
            aggregator_cpu = (
                (aggregators_cpu(procs) - before) / (reps + warmup)
                if procs and (collective, algorithm) in NEEDS_AGGREGATOR
                else None
            )
            results.append(
                summarize(
                    collective,
                    algorithm,
                    hosts,
                    nbytes,
                    link_bits,
                    per_rank,
                    k,
                    loss,
                    aggregator_cpu,
                )
            )
            if traced:
                prefix, write_timeline = traced
                path = f"{prefix}-{algorithm}{suffix}"
                write_timeline(
                    [r["trace"] for r in per_rank],
                    path,
                    link_bits,
                    f"{collective} {algorithm}, {hosts} hosts, "
                    f"{link_bits / 1e6:g} Mbit/s, {nbytes} B per rank",
                )
                timelines.append(path)
        progress(len(points), len(points), "done")
        if not procs:
            return None
        carried_in = [
            cluster.counters(None, a).rx_bytes - before.rx_bytes for a, before in enumerate(carried)
        ]
        return aggregator_summary(cluster.stop_aggregators(procs, tmp), carried_in, link_bits)


def aggregators_cpu(procs) -> float:
    """The aggregators' processes' CPU seconds so far."""
    return sum(process_cpu_seconds(s.pid) for s in procs)


def aggregator_summary(reports: list[dict], carried: list[int], link_bits: int) -> dict:
    """What the aggregators counted themselves over a cluster's points: contributions taken
    and the CPU their native data paths spent on them (the shard threads' own clocks), their
    processes' CPU and memory, what they dropped; and per aggregator, its contributions and the
    bytes its link carried in (`carried`)."""
    contributions = sum(r["stats"].get("contributions", 0) for r in reports)
    data_path = sum(r["data_path_cpu_seconds"] for r in reports)
    drops: collections.Counter[str] = collections.Counter()
    for r in reports:
        drops.update(r["drops"])
    return {
        "link_bits_per_s": link_bits,
        "contributions": contributions,
        "data_path_cpu_seconds": data_path,
        # contributions that came before their turn in rank order, copied to wait
        "held": sum(r["stats"].get("held", 0) for r in reports),
        "cpu_us_per_contribution": data_path / contributions * 1e6 if contributions else None,
        "cpu_seconds": sum(r["cpu_seconds"] for r in reports),
        # datagrams per read: how much the receive path's GRO batched
        **{key: sum(r[key] for r in reports) for key in ("datagrams_in", "reads", "wakeups")},
        "max_rss_bytes": max(r["max_rss_bytes"] for r in reports),
        "drops": dict(drops),
        "aggregators": [
            {
                "contributions": r["stats"].get("contributions", 0),
                "shard_cpu_seconds": r["shard_cpu_seconds"],
                "bytes_in": bytes_in,
            }
            for r, bytes_in in zip(reports, carried)
        ],
    }


def sweep_summary(results: list[dict], within: float) -> list[dict]:
    """Per point (collective, algorithm, size, roots, loss): the highest rate up to which it
    holds `within` times its floor at every rate swept (None: not even at the lowest), the
    first rate at which it does not (None: it held at every one), and its multiple at each."""
    points: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r["collective"], r["algorithm"], r["bytes_per_rank"], r["roots"], r["loss"])
        points.setdefault(key, []).append(r)
    summary = []
    for (collective, algorithm, nbytes, roots, loss), rows in points.items():
        rows.sort(key=lambda r: r["link_bits_per_s"])
        holds = fails = None
        for r in rows:
            if r["ratio_to_floor"] > within:
                fails = r["link_bits_per_s"]
                break
            holds = r["link_bits_per_s"]
        summary.append(
            {
                "collective": collective,
                "algorithm": algorithm,
                "bytes_per_rank": nbytes,
                "roots": roots,
                "loss": loss,
                "within": within,
                "holds_up_to_bits_per_s": holds,
                "fails_at_bits_per_s": fails,
                "ratio_to_floor": [[r["link_bits_per_s"], r["ratio_to_floor"]] for r in rows],
            }
        )
    return summary
