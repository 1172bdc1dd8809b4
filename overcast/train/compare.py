"""`overcast train`: the GPT trained with FSDP2 four ways on one emulated cluster, compared.

Every way starts from the same weights and sees the same batches, so their losses must agree
step by step (up to the order in which each sums gradients). A step's time is its slowest rank's;
a way's step time is the median over the steps after the warm-up ones.
"""

from __future__ import annotations

import datetime
import os
import statistics

from overcast.bench.run import machine, process_cpu_seconds
from overcast.cluster.netns import Cluster
from overcast.limits import check_hosts, check_link_rate
from overcast.report.timeline import every_span, write_timeline
from overcast.train.gpt import GPTConfig
from overcast.train.worker import OVERCAST_WAYS, WAYS, train_rank

# The fair peer: gloo with the same prefetch and asynchronous unshard, ReduceScatter on its own
# group. Speed-ups are against it, and losses are compared with the first way run.
PEER = "gloo-separate"


def check_request(ways: list[str], hosts: int, steps: int, warmup: int,
                  link_bits: float = 1e8, cfg: GPTConfig = GPTConfig(), lr: float = 1e-3) -> None:
    """Raise ValueError naming what is wrong, before any cluster is built."""
    unknown = [w for w in ways if w not in WAYS]
    if unknown or not ways:
        raise ValueError(f"unknown way {', '.join(unknown) or '(none)'}; available: "
                         f"{', '.join(WAYS)}")
    check_hosts(hosts)
    if warmup < 0 or steps <= warmup:
        raise ValueError(f"--steps ({steps}) must be more than --warmup ({warmup}), which must "
                         f"be 0 or more")
    check_link_rate(link_bits)
    if cfg.blocks < 1 or cfg.batch_per_rank < 1 or cfg.micro_steps < 1:
        raise ValueError(f"--blocks ({cfg.blocks}), --batch ({cfg.batch_per_rank}) and "
                         f"--micro-steps ({cfg.micro_steps}) must be 1 or more")
    if cfg.dim < cfg.heads or cfg.dim % cfg.heads:
        raise ValueError(f"--dim must be a positive multiple of {cfg.heads} (the attention "
                         f"heads), not {cfg.dim}")
    if not lr > 0:
        raise ValueError(f"--lr must be above 0, not {lr:g}")


def summarize(way: str, per_rank: list[dict], warmup: int, switch_cpu: float | None) -> dict:
    steps = len(per_rank[0]["steps"])

    def per_step(key, over_ranks=max):
        """Each step's value of `key` across ranks (the slowest, by default)."""
        return [over_ranks(r["steps"][k][key] for r in per_rank) for k in range(steps)]

    def slowest(key):
        return statistics.median(per_step(key)[warmup:])

    def median_of_means(key):
        return statistics.median(per_step(key, statistics.fmean)[warmup:])
    return {
        "way": way, "description": WAYS[way],
        "step_seconds": slowest("seconds"),
        "step_seconds_all": per_step("seconds"),
        "forward_comm_seconds": slowest("forward_comm_seconds"),
        "backward_comm_seconds": slowest("backward_comm_seconds"),
        "backward_seconds": slowest("backward_seconds"),
        "cpu_seconds_per_rank": median_of_means("cpu_seconds"),
        "training_thread_cpu_seconds_per_rank": median_of_means("thread_cpu_seconds"),
        "losses": per_step("loss", statistics.fmean),
        "tx_bytes_per_host_per_step": statistics.fmean(r["tx_bytes"] for r in per_rank) / steps,
        "rx_bytes_per_host_per_step": statistics.fmean(r["rx_bytes"] for r in per_rank) / steps,
        "collectives_per_step": {k: v / steps for k, v in per_rank[0]["comm"].items()
                                 if k in ("allgathers", "reduce_scatters")},
        # the training thread's own CPU in the collective hooks: posting, and waiting
        "comm_thread_cpu_seconds_per_step": statistics.fmean(
            r["comm"]["thread_cpu_seconds"] for r in per_rank) / steps,
        "aggregator_cpu_seconds_per_step": switch_cpu / steps if switch_cpu is not None
        else None,
    }


def compare(results: list[dict]) -> None:
    """Speed-up against the fair peer and loss differences against the first way, in place."""
    peer = next((r for r in results if r["way"] == PEER), None)
    reference = results[0]["losses"]
    for r in results:
        r["speedup_vs_" + PEER.replace("-", "_")] = \
            peer["step_seconds"] / r["step_seconds"] if peer else None
        r["max_loss_difference"] = max(abs(a - b) for a, b in zip(r["losses"], reference))


def run_training(hosts: int, link_bits: int, ways: list[str], steps: int, warmup: int,
                 cfg: GPTConfig, lr: float = 1e-3, out_dir: str | None = None,
                 progress=None) -> dict:
    """Train every way on one cluster; return {"meta": ..., "results": [...]} and, with
    `out_dir`, write the backward-step timelines of the overcast ways there."""
    check_request(ways, hosts, steps, warmup, link_bits, cfg, lr)
    import torch  # imported once here so that forked hosts start fast

    results, timelines = [], []
    with Cluster(hosts, link_bits) as cluster:
        switch = cluster.start_switch() if "overcast" in ways else None
        for i, way in enumerate(ways):
            if progress:
                progress(i, len(ways), f"training {way}: {steps} steps on {hosts} hosts")
            cpu0 = process_cpu_seconds(switch.pid) if switch and way == "overcast" else None
            trace = bool(out_dir) and way in OVERCAST_WAYS
            per_rank = cluster.run(train_rank, timeout=900,
                                   args=(way, cfg.as_dict(), steps, lr, trace))
            switch_cpu = process_cpu_seconds(switch.pid) - cpu0 if cpu0 is not None else None
            results.append(summarize(way, per_rank, warmup, switch_cpu))
            if trace:
                path = os.path.join(out_dir, f"timeline-{way}")
                write_timeline([r["trace"] for r in per_rank], path, link_bits,
                               f"backward, {way}, {hosts} hosts, {link_bits / 1e6:g} Mbit/s",
                               select=every_span)
                timelines.append(path)
        if switch:
            cluster.stop_switch(switch)
        if progress:
            progress(len(ways), len(ways), "done")
    compare(results)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hosts": hosts, "link_bits_per_s": link_bits, "steps": steps, "warmup": warmup,
            "lr": lr, "model": cfg.as_dict(),
            "parameters": cfg.parameters(),
            "block_parameters": cfg.block_parameters(), "timelines": timelines,
            "machine": machine(), "torch": torch.__version__}
    return {"meta": meta, "results": results}

