"""`overcast soak`: many overlapped pairs (multicast AllGather with in-network ReduceScatter) on
the emulated cluster under bursty loss, to show what a long training run needs: every result
bit-exact, memory flat on every rank and at the aggregator, per-pair time without drift, and no
socket, thread or aggregator slot left behind when the communicator closes; with aggregators
killed and restarted while the pairs run, the same (protocols.failover)."""

from __future__ import annotations

import datetime
import gc
import os
import signal
import statistics
import tempfile
import threading
import time

import numpy as np

from overcast.bench.run import Aggregators, machine
from overcast.bench.rank import expected_sum, pattern, shard
from overcast.cluster.netns import Cluster
from overcast.limits import check_count, check_hosts, check_link_rate, check_loss, check_size

DTYPE = np.float32


def status_bytes(pid: int | str, field: str) -> int:
    """A memory figure (VmRSS, VmHWM) of a process, from /proc, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def cpu_steal_seconds() -> float:
    """CPU time the hypervisor gave to others while this machine wanted it (all CPUs)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def _held() -> dict:
    """Open file descriptors and threads of this process, once the garbage is collected (so
    that an object closed by the collector is not counted by chance)."""
    gc.collect()
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def _aggregator_rss(pids_path: str) -> int:
    """The aggregators' RSS now: those running, as the soak's file lists them."""
    with open(pids_path) as f:
        pids = [int(p) for p in f.read().split()]
    total = 0
    for pid in pids:
        try:
            total += status_bytes(pid, "VmRSS")
        except (FileNotFoundError, KeyError):  # killed a moment ago (gone, or a zombie with
            pass  # no memory): its successor is listed soon
    return total


def soak_rank(
    rank: int,
    pairs: int,
    nbytes: int,
    marks: list[int],
    pids_path: str,
    progress_path: str,
    progress_every: int = 10,
) -> dict:
    """Run `pairs` overlapped pairs; report per-pair seconds, memory at each mark, and what is
    held before the communicator opens and after it closes. Rank 0 writes how many pairs are
    done to `progress_path` every `progress_every` pairs."""
    import overcast

    # Rank 0 serves the rendezvous store for the rest of the process (as torchrun's agent
    # does), from its first communicator on: open and close one first, so that what the soak's
    # communicator holds is measured alone.
    overcast.Communicator(name="soak-warmup").close()
    before = _held()
    count = max(1, nbytes // np.dtype(DTYPE).itemsize)
    seconds, exact, at_marks = [], 0, {}
    with overcast.Communicator(name="soak", timeout=60) as comm:
        world = comm.world_size
        mine, grads = shard(rank, count), pattern(rank, count, world)
        gathered = np.concatenate([shard(r, count) for r in range(world)])
        reduced = expected_sum(rank, count, world)
        out_ag, out_rs = np.empty(world * count, DTYPE), np.empty(count, DTYPE)
        for i in range(1, pairs + 1):
            t0 = time.perf_counter()
            works = [
                comm.all_gather(out_ag, mine, algorithm="multicast", async_op=True),
                comm.reduce_scatter(out_rs, grads, algorithm="innetwork", async_op=True),
            ]
            for work in works:
                work.wait()
            seconds.append(time.perf_counter() - t0)
            exact += bool(np.array_equal(out_ag, gathered) and np.array_equal(out_rs, reduced))
            out_ag.fill(0)
            out_rs.fill(0)
            if i in marks:
                at_marks[i] = {
                    "rss_bytes": status_bytes("self", "VmRSS"),
                    "peak_rss_bytes": status_bytes("self", "VmHWM"),
                    "memory": comm.memory(),
                    **_held(),
                }
                at_marks[i]["switch_rss_bytes"] = _aggregator_rss(pids_path)
            if rank == 0 and i % progress_every == 0:
                with open(progress_path, "w") as f:
                    f.write(str(i))
        counters = comm.counters()
    return {
        "seconds": seconds,
        "exact": exact,
        "marks": at_marks,
        "before": before,
        "after": _held(),
        "counters": counters,
    }


def run_soak(
    hosts: int,
    link_bits: int,
    pairs: int,
    nbytes: int,
    loss: float,
    loss_burst: float,
    marks: list[int],
    progress=None,
    aggregators: Aggregators = Aggregators(),
    kill_every: int = 0,
) -> dict:
    """Soak on a fresh cluster, in-network reduction on `aggregators`, one of them killed
    (SIGKILL) and restarted at its address every `kill_every` pairs (0: never), each in turn;
    {"meta": ..., "summary": ..., "ranks": [...], "switches": [each aggregator's own report],
    "kills": [the pair done when each was killed, and which]}."""
    check_hosts(hosts)
    aggregators.check()
    check_link_rate(link_bits)
    check_count("pairs", pairs, 1, "--pairs, pairs")
    check_count(
        "pairs between aggregator kills", kill_every, 0, "--kill-aggregator-every, kill_every"
    )
    check_size(nbytes)
    check_loss(loss, loss_burst)
    marks = sorted({m for m in marks if 1 <= m <= pairs} | {pairs})
    steal = cpu_steal_seconds()
    with (
        tempfile.TemporaryDirectory() as tmp,
        Cluster(
            hosts,
            link_bits,
            aggregators=aggregators.count,
            aggregator_bits_per_s=aggregators.link_bits,
        ) as cluster,
    ):
        procs = cluster.start_aggregators(stats_dir=tmp, shards=aggregators.shards)
        progress_path, pids_path = os.path.join(tmp, "progress"), os.path.join(tmp, "pids")
        _write(pids_path, " ".join(str(s.pid) for s in procs))
        stop = threading.Event()
        kills: list[dict] = []
        if progress:
            threading.Thread(
                target=_report_progress, daemon=True, args=(progress_path, pairs, progress, stop)
            ).start()
        killer = (
            threading.Thread(
                target=_kill_aggregators,
                daemon=True,
                args=(cluster, procs, kill_every, pairs, tmp, kills, aggregators.shards, stop),
            )
            if kill_every
            else None
        )
        if killer:
            killer.start()
        try:
            ranks = cluster.run(
                soak_rank,
                timeout=24 * 3600,
                env={"OVERCAST_LOSS": str(loss), "OVERCAST_LOSS_BURST": str(loss_burst)},
                args=(pairs, nbytes, marks, pids_path, progress_path, 1 if kill_every else 10),
            )
        finally:
            stop.set()
            if killer:
                killer.join()
        reports = cluster.stop_aggregators(procs, tmp)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hosts": hosts,
        "link_bits_per_s": link_bits,
        "pairs": pairs,
        "bytes_per_rank": nbytes,
        "loss": loss,
        "loss_burst": loss_burst,
        "marks": marks,
        "aggregators": {
            "count": aggregators.count,
            "shards": aggregators.shard_count(),
            "link_bits_per_s": aggregators.link_bits,
        },
        "cpu_steal_seconds": cpu_steal_seconds() - steal,
        "machine": machine(),
        "kill_aggregator_every": kill_every,
    }
    summary = summarize(ranks, reports, marks)
    summary["aggregator_kills"] = len(kills)
    return {"meta": meta, "summary": summary, "ranks": ranks, "switches": reports, "kills": kills}


def _write(path: str, text: str) -> None:
    """Write `text` whole: a reader sees the old file or the new one, never half of it."""
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)


def _kill_aggregators(
    cluster,
    procs: list,
    every: int,
    pairs: int,
    tmp: str,
    kills: list[dict],
    shards: int | None,
    stop: threading.Event,
) -> None:
    """Each time rank 0 has done another `every` pairs, kill the next aggregator in turn
    (SIGKILL: its connections close, its state is gone) and start it again at its address,
    writing its stats where the first wrote; `procs` and the pids file follow. Polls the
    progress file: a soak's clock, not a test's."""
    due = every
    while due < pairs and not stop.wait(0.005):
        try:
            with open(os.path.join(tmp, "progress")) as f:
                done = int(f.read() or 0)
        except (OSError, ValueError):
            continue
        if done < due:
            continue
        a = len(kills) % len(procs)
        address = cluster.aggregator_addresses.split(",")[a]
        procs[a].send_signal(signal.SIGKILL)
        procs[a].wait()
        cluster.stop_aggregator(procs[a])  # its lifeline and pipes
        kills.append({"pair": done, "aggregator": address})
        procs[a] = cluster.start_aggregator(
            stats_path=os.path.join(tmp, f"aggregator-{a}.json"), aggregator=a, shards=shards
        )
        _write(os.path.join(tmp, "pids"), " ".join(str(s.pid) for s in procs))
        due += every


def _report_progress(path: str, pairs: int, progress, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        try:
            with open(path) as f:
                done = int(f.read() or 0)
        except (OSError, ValueError):
            done = 0
        progress(done, pairs, f"pair {done} of {pairs}")


def slowest_rank_seconds(ranks: list[dict]) -> list[float]:
    """Each pair's time: its slowest rank's."""
    return [max(times) for times in zip(*(r["seconds"] for r in ranks))]


def summarize(ranks: list[dict], reports: list[dict], marks: list[int]) -> dict:
    """The soak's verdict: exact pairs, memory at each mark, drift, what was left behind (the
    aggregators' figures added up)."""
    pair_seconds = slowest_rank_seconds(ranks)
    n = len(pair_seconds)
    window = max(1, min(100, n // 10))
    first = statistics.median(pair_seconds[:window])
    last = statistics.median(pair_seconds[-window:])
    slope = float(np.polyfit(np.arange(n), pair_seconds, 1)[0]) if n > 1 else 0.0
    return {
        "pairs_exact": min(r["exact"] for r in ranks),
        "pairs": n,
        "pair_seconds_median": statistics.median(pair_seconds),
        "pair_seconds_first": first,
        "pair_seconds_last": last,
        "drift_window": window,
        "drift_seconds_per_1000_pairs": slope * 1000,
        "rank_rss_bytes_max": {
            str(m): max(r["marks"][str(m)]["rss_bytes"] for r in ranks) for m in marks
        },
        "rank_peak_rss_bytes_max": {
            str(m): max(r["marks"][str(m)]["peak_rss_bytes"] for r in ranks) for m in marks
        },
        "switch_rss_bytes": {str(m): ranks[0]["marks"][str(m)]["switch_rss_bytes"] for m in marks},
        "switch_peak_rss_bytes": sum(s["max_rss_bytes"] for s in reports),
        "switch_pool_bytes_after": sum(s["pool_bytes"] for s in reports),
        "switch_peak_pool_bytes": sum(s["peak_pool_bytes"] for s in reports),
        "switch_communicators_after": sum(s["communicators"] for s in reports),
        # more fds or threads after the soak's communicator closed than before it opened (rank
        # 0 may have fewer: the store's connections from the warm-up close on their own time)
        "left_behind": {
            f"rank {i}": {k: max(0, r["after"][k] - r["before"][k]) for k in r["before"]}
            for i, r in enumerate(ranks)
        },
        "injected_losses": sum(r["counters"]["injected_losses"] for r in ranks),
        "aggregators_lost": max(r["counters"].get("aggregators_lost", 0) for r in ranks),
        "aggregators_taken_back": max(
            r["counters"].get("aggregators_taken_back", 0) for r in ranks
        ),
        "in_network_redone_on_ring": max(
            r["counters"].get("in_network_redone_on_ring", 0) for r in ranks
        ),
        "repaired_chunks": sum(r["counters"].get("repaired_chunks", 0) for r in ranks),
        "contributions_resent": sum(r["counters"].get("contributions_resent", 0) for r in ranks),
    }
