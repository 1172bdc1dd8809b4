"""`overcast train`: the GPT trained with FSDP2 four ways on one emulated cluster, compared.

Every way starts from the same weights and sees the same batches, so their losses must agree
step by step (up to the order in which each sums gradients). A step's time is its slowest rank's;
a way's step time is the median over the steps after the warm-up ones.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
from collections.abc import Sequence

from overcast.bench.run import machine, process_cpu_seconds
from overcast.cluster.netns import Cluster
from overcast.train.config import OVERCAST_WAYS, WAYS, GPTConfig, check_request
from overcast.train.predict import predict
from overcast.train.waits import CATEGORIES, TRAINING, SchedTrace, attribute, mount_tracefs, parse
from overcast.train.rank import train_rank

# The fair peer: gloo with the same prefetch and asynchronous unshard, ReduceScatter on its own
# group. Speed-ups are against it, and losses are compared with the first way run.
PEER = "gloo-separate"


def split_step(row: dict) -> dict:
    """A step of the training thread outside its communication hooks: compute (the step less
    its exposed communication), and of that the time it waited for a CPU (runnable, not
    running: the kernel's run delay) and the time it was blocked. Outside the hooks the thread
    only runs torch on its own (one intra-op thread), so what blocks it there is the GIL."""
    comm = row["forward_comm_seconds"] + row["backward_comm_seconds"]
    compute = row["seconds"] - comm
    cpu = row["thread_cpu_seconds"] - row["comm_thread_cpu_seconds"]
    cpu_wait = row["run_delay_seconds"] - row["comm_run_delay_seconds"]
    out = {
        **row,
        "compute_seconds": compute,
        "cpu_wait_seconds": cpu_wait,
        "gil_wait_seconds": max(0.0, compute - cpu - cpu_wait),
    }
    traced = row.get("waited_behind")
    if traced is not None:
        # The trace covers the whole step, hooks included; the compute's own CPU wait is
        # shared out in the same proportions. Without the other hosts' training threads on its
        # cores (a host of its own, as on a real cluster), that share of it would not be.
        total = sum(traced.values())
        behind = {k: cpu_wait * v / total if total else 0.0 for k, v in traced.items()}
        out.update(
            traced_wait_seconds=total,
            cpu_wait_behind=behind,
            own_host_compute_seconds=compute - behind[TRAINING],
        )
    return out


def attribute_waits(trace_text: str, per_rank: list[dict], aggregator: int | None) -> None:
    """Each step's CPU wait of each rank's training thread by what ran instead, from the
    scheduler trace of the run (overcast.train.waits), into the steps' rows."""
    events, tgid = parse(trace_text)
    windows = {r["training_tid"]: [tuple(row["window"]) for row in r["steps"]] for r in per_rank}
    waits = attribute(
        events, tgid, os.cpu_count() or 1, windows, {r["pid"] for r in per_rank}, aggregator
    )
    for r in per_rank:
        for k, row in enumerate(r["steps"]):
            row["waited_behind"] = waits.get((r["training_tid"], k), dict.fromkeys(CATEGORIES, 0.0))


def summarize(way: str, per_rank: list[dict], warmup: int, aggregator_cpu: float | None) -> dict:
    per_rank = [{**r, "steps": [split_step(row) for row in r["steps"]]} for r in per_rank]
    steps = len(per_rank[0]["steps"])

    def per_step(key, over_ranks=max):
        """Each step's value of `key` (a row's key, or a function of the row) across ranks (the
        slowest, by default)."""
        get = key if callable(key) else (lambda row: row[key])
        return [over_ranks(get(r["steps"][k]) for r in per_rank) for k in range(steps)]

    def slowest(key):
        return statistics.median(per_step(key)[warmup:])

    def median_of_means(key):
        return statistics.median(per_step(key, statistics.fmean)[warmup:])

    traced = "cpu_wait_behind" in per_rank[0]["steps"][0]
    waits = (
        {
            "own_host_compute_seconds": median_of_means("own_host_compute_seconds"),
            "cpu_wait_behind_seconds": {
                c: median_of_means(lambda row, c=c: row["cpu_wait_behind"][c]) for c in CATEGORIES
            },
            # the trace's whole-step wait beside the kernel's run delay for the same steps
            "traced_step_wait_seconds": median_of_means("traced_wait_seconds"),
            "step_run_delay_seconds": median_of_means("run_delay_seconds"),
        }
        if traced
        else {}
    )
    return {
        "way": way,
        "description": WAYS[way],
        **waits,
        # what overlap() ran each collective on, and what it warned of (rank 0's)
        "algorithms": per_rank[0]["algorithms"],
        "warnings": per_rank[0]["warnings"],
        "step_seconds": slowest("seconds"),
        "step_seconds_all": per_step("seconds"),
        "forward_comm_seconds": slowest("forward_comm_seconds"),
        "backward_comm_seconds": slowest("backward_comm_seconds"),
        "backward_seconds": slowest("backward_seconds"),
        "compute_seconds": median_of_means("compute_seconds"),
        # of the compute, the forward passes' and the backward passes'
        "forward_compute_seconds": median_of_means(
            lambda row: row["forward_seconds"] - row["forward_comm_seconds"]
        ),
        "backward_compute_seconds": median_of_means(
            lambda row: row["backward_seconds"] - row["backward_comm_seconds"]
        ),
        "gil_wait_seconds": median_of_means("gil_wait_seconds"),
        "cpu_wait_seconds": median_of_means("cpu_wait_seconds"),
        "comm_cpu_wait_seconds": median_of_means("comm_run_delay_seconds"),
        "engine_python_cpu_seconds": median_of_means("engine_python_cpu_seconds"),
        "cpu_seconds_per_rank": median_of_means("cpu_seconds"),
        "training_thread_cpu_seconds_per_rank": median_of_means("thread_cpu_seconds"),
        "losses": per_step("loss", statistics.fmean),
        "tx_bytes_per_host_per_step": statistics.fmean(r["tx_bytes"] for r in per_rank) / steps,
        "rx_bytes_per_host_per_step": statistics.fmean(r["rx_bytes"] for r in per_rank) / steps,
        "collectives_per_step": {
            k: v / steps
            for k, v in per_rank[0]["comm"].items()
            if k in ("allgathers", "reduce_scatters")
        },
        # the training thread's own CPU in the collective hooks: posting, and waiting
        "comm_thread_cpu_seconds_per_step": statistics.fmean(
            r["comm"]["thread_cpu_seconds"] for r in per_rank
        )
        / steps,
        "aggregator_cpu_seconds_per_step": aggregator_cpu / steps
        if aggregator_cpu is not None
        else None,
        # on a GPU: the staging copies' GPU time, the pinned host memory and GPU memory held
        "staging_seconds": median_of_means("staging_seconds"),
        "pinned_peak_bytes": max(r["pinned_peak_bytes"] for r in per_rank),
        "stream_gates": all(r["stream_gates"] for r in per_rank),
        "gpu_memory_growth_bytes": max(
            r["steps"][-1]["gpu_memory_bytes"]
            - r["steps"][min(warmup, steps - 1)]["gpu_memory_bytes"]
            for r in per_rank
        ),
    }


def compare(results: list[dict]) -> None:
    """Speed-up against the fair peer and loss differences against the first way, in place."""
    peer = next((r for r in results if r["way"] == PEER), None)
    reference = results[0]["losses"]
    for r in results:
        r["speedup_vs_" + PEER.replace("-", "_")] = (
            peer["step_seconds"] / r["step_seconds"] if peer else None
        )
        r["max_loss_difference"] = max(abs(a - b) for a, b in zip(r["losses"], reference))


def prediction(
    cfg: GPTConfig, hosts: int, link_bits: float, results: list[dict], prefetch: int
) -> dict | None:
    """The cost model's step per way (overcast.train.predict) from the compute gloo showed in
    this run, beside what was measured; None without a gloo way to take the compute from."""
    gloo = next((r for r in results if r["way"] == PEER), None) or next(
        (r for r in results if r["way"] == "gloo"), None
    )
    if gloo is None:
        return None
    forward, backward = gloo["forward_compute_seconds"], gloo["backward_compute_seconds"]
    other = max(0.0, gloo["compute_seconds"] - forward - backward)
    out = predict(
        cfg,
        hosts,
        link_bits,
        {
            "forward": forward / cfg.micro_steps,
            "backward": backward / cfg.micro_steps,
            "other": other,
        },
        prefetch,
    )
    out["compute_from"] = gloo["way"]
    measured = {r["way"]: r["step_seconds"] for r in results}
    if "overcast" in measured:
        out["overcast_over_predicted"] = measured["overcast"] / out["step_seconds"]["overcast"]
    if "overcast" in measured and "overcast-ring" in measured:
        out["measured_speedup_over_rings"] = measured["overcast-ring"] / measured["overcast"]
    return out


def run_training(
    hosts: int,
    link_bits: int,
    ways: list[str],
    steps: int,
    warmup: int,
    shapes: list[tuple[str, GPTConfig]],
    lr: float = 1e-3,
    out_dir: str | None = None,
    progress=None,
    prefetch: int = 1,
    sched_trace: bool = True,
    device: str = "cpu",
    write_timeline=None,
    aggregator_bits: int | None = None,
    drop_multicast: Sequence[int] = (),
    kill_aggregator_at_step: int | None = None,
) -> dict:
    """Train every shape every way on one cluster; return {"meta": ..., "shapes": [...]} and,
    with `out_dir` and `write_timeline(traces, path, link_bits, title)` (overcast.report.
    timeline's), write the backward-step timelines of the overcast ways there.
    `sched_trace` records the scheduler to say what the training threads waited behind
    (overcast.train.waits); it slows overcast's steps more than the others' where steps are
    short (docs/results.md), so step times meant for comparison are best taken without it.
    The aggregator's link is unshaped (a switch that sums at line rate), or `aggregator_bits`
    each way (an aggregator host's NIC); the switch drops the multicast it would send to the
    hosts `drop_multicast` names (a network without multicast). With `kill_aggregator_at_step`,
    rank 0 of the "overcast" way kills the aggregator (SIGKILL) as that step begins."""
    for _, cfg in shapes:
        check_request(ways, hosts, steps, warmup, link_bits, cfg, lr, prefetch, device)
    import torch  # imported once here so that forked hosts start fast

    runs: list[dict] = []
    total = len(shapes) * len(ways)
    why_untraced = mount_tracefs() if sched_trace else "--no-sched-trace"
    with (
        Cluster(
            hosts, link_bits, aggregator_bits_per_s=aggregator_bits, drop_multicast=drop_multicast
        ) as cluster,
        kernel_run_delays() as delays_kept,
    ):
        aggregator = cluster.start_aggregator() if "overcast" in ways else None
        for name, cfg in shapes:
            results: list[dict] = []
            timelines: list[str] = []
            for way in ways:
                if progress:
                    progress(
                        len(runs) * len(ways) + len(results),
                        total,
                        f"{name}: training {way}, {steps} steps on {hosts} hosts",
                    )
                cpu0 = (
                    process_cpu_seconds(aggregator.pid)
                    if aggregator and way == "overcast"
                    else None
                )
                trace_dir = out_dir if write_timeline is not None and way in OVERCAST_WAYS else None
                trace = bool(trace_dir)
                with SchedTrace() as sched:
                    traced = why_untraced is None and sched.start()
                    kill = (
                        (aggregator.pid, kill_aggregator_at_step)
                        if aggregator and way == "overcast" and kill_aggregator_at_step is not None
                        else None
                    )
                    per_rank = cluster.run(
                        train_rank,
                        timeout=1800,
                        args=(way, cfg.as_dict(), steps, lr, trace, prefetch, device, kill),
                    )
                    if traced:
                        attribute_waits(
                            sched.stop(), per_rank, aggregator.pid if aggregator else None
                        )
                aggregator_cpu = (
                    process_cpu_seconds(aggregator.pid) - cpu0
                    if aggregator and cpu0 is not None
                    else None
                )
                results.append(summarize(way, per_rank, warmup, aggregator_cpu))
                results[-1]["trace_overrun_events"] = sched.overrun if traced else None
                why_untraced = why_untraced or sched.unavailable
                if trace_dir:
                    path = os.path.join(trace_dir, f"timeline-{name}-{way}")
                    write_timeline(
                        [r["trace"] for r in per_rank],
                        path,
                        link_bits,
                        f"backward, {name}, {way}, {hosts} hosts, {link_bits / 1e6:g} Mbit/s",
                    )
                    timelines.append(path)
            compare(results)
            runs.append(
                {
                    "shape": name,
                    "model": cfg.as_dict(),
                    "parameters": cfg.parameters(),
                    "block_parameters": cfg.block_parameters(),
                    "results": results,
                    "prediction": prediction(cfg, hosts, link_bits, results, prefetch),
                    "timelines": timelines,
                }
            )
        if aggregator:
            cluster.stop_aggregator(aggregator)
        if progress:
            progress(total, total, "done")
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hosts": hosts,
        "link_bits_per_s": link_bits,
        "steps": steps,
        "warmup": warmup,
        "aggregator_link_bits_per_s": aggregator_bits,
        "multicast_dropped_to": list(drop_multicast),
        "lr": lr,
        "prefetch": prefetch,
        "device": device,
        "cpu_waits_measured": delays_kept,
        "machine": machine(),
        "cpu_waits_traced": why_untraced is None,
        "untraced_because": why_untraced,
        "torch": torch.__version__,
    }
    return {"meta": meta, "shapes": runs}


@contextlib.contextmanager
def kernel_run_delays():
    """Have the kernel keep each thread's run delay (the time it waited runnable for a CPU),
    which it does only with schedstats or delay accounting on; turn delay accounting on for the
    run if it is off and this process may, and back off after."""
    path = "/proc/sys/kernel/task_delayacct"
    try:
        with open(path) as f:
            before = f.read().strip()
        if before == "0":
            with open(path, "w") as f:
                f.write("1")
    except OSError:  # not root, or no such switch: the CPU waits then read 0
        before = None
    try:
        yield before is not None
    finally:
        if before == "0":
            with open(path, "w") as f:
                f.write("0")
