"""What runs on each host during `overcast train`: the GPT trained with FSDP2 one of four ways,
timed per step, its communication time and NIC bytes counted, its losses recorded."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import warnings

from overcast.train.config import WAYS, GPTConfig


def configure(model, way: str, trace: bool, prefetch: int):
    """The overcast.fsdp handle that makes `model` train `way`; every way but gloo (FSDP2's
    defaults) gathers `prefetch` blocks ahead."""
    import overcast.fsdp

    if way == "gloo":
        return overcast.fsdp.timed(model)
    if way == "gloo-separate":
        return overcast.fsdp.overlap(model, backend="torch", prefetch=prefetch)
    if way == "overcast-ring":
        return overcast.fsdp.overlap(
            model, allgather="ring", reduce_scatter="ring", trace=trace, prefetch=prefetch
        )
    if way == "overcast":
        return overcast.fsdp.overlap(model, trace=trace, prefetch=prefetch)
    raise ValueError(f"unknown way {way!r}; available: {', '.join(WAYS)}")


def _window(trace: dict, start: float, end: float) -> dict:
    """The part of a communicator trace (and of its staging copies) that falls in [start, end]."""
    spans = [
        s
        for s in trace["spans"]
        if s["end"] is not None and s["end"] >= start and s["start"] <= end
    ]
    seqs = {s["seq"] for s in spans}
    return {
        **trace,
        "spans": spans,
        "bins": [b for b in trace["bins"] if b["seq"] in seqs],
        "copies": [c for c in trace["copies"] if c["end"] >= start and c["start"] <= end],
    }


@contextlib.contextmanager
def told_in_table(categories: tuple[type[Warning], ...]):
    """Gather the warnings of `categories`, from any thread (an aggregator's loss is warned of
    on the engine's), into the list this yields, each time one is warned of, in place of showing
    them: the table tells them. Every other warning is shown as ever."""
    said: list[str] = []
    with warnings.catch_warnings():
        for category in categories:
            warnings.simplefilter("always", category)
        show = warnings.showwarning

        def gather(message, category, *args, **kwargs):
            if issubclass(category, categories):
                said.append(str(message))
            else:
                show(message, category, *args, **kwargs)

        warnings.showwarning = gather  # catch_warnings puts the old one back
        yield said


def engine_python_cpu(handle) -> float:
    """CPU seconds the engine thread has spent outside the native plane's wait: the Python part
    of the engine, which holds the GIL while it runs (0 for the gloo ways: no engine)."""
    return handle.comm.counters()["python_cpu_seconds"] if handle.comm is not None else 0.0


def train_rank(
    rank: int,
    way: str,
    config: dict,
    steps: int,
    lr: float,
    trace: bool,
    prefetch: int,
    device: str = "cpu",
    kill_at_step: tuple[int, int] | None = None,
) -> dict:
    """Train `steps` steps on `device` ("cpu", or "cuda": every rank on this host's first GPU);
    return per-step loss, time, communication seconds, CPU, and the NIC bytes of the whole
    run; with `trace`, the last step's backward timeline (overcast ways); on a GPU, the GPU
    memory each step ends with and the pinned host memory staging held at its peak. With
    `kill_at_step` (pid, step), rank 0 kills that process (the aggregator) as the step begins."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    import overcast
    from overcast.cluster.netns import read_nic_counters
    from overcast.fsdp.timing import thread_clock
    from overcast.staging import process_pool, stream_gates
    from overcast.train.gpt import build, rank_batch, shard

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    cfg = GPTConfig(**config)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    gpu = device == "cuda"
    if gpu:
        torch.cuda.set_device(0)
    try:
        model = shard(build(cfg), init_device_mesh(device, (world,)))
        assert isinstance(model, FSDPModule)  # fully_shard gave its class FSDPModule as a base
        told = (overcast.MulticastNotDeliveredWarning, overcast.AggregatorLostWarning)
        with told_in_table(told) as said, configure(model, way, trace, prefetch) as handle:
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            times = handle.times
            rows = []
            dist.barrier()
            nic0 = read_nic_counters()
            micro = cfg.micro_steps
            for step in range(steps):
                if kill_at_step is not None and rank == 0 and step == kill_at_step[1]:
                    os.kill(kill_at_step[0], signal.SIGKILL)
                t0, cpu0, (thread0, delay0) = time.monotonic(), time.process_time(), thread_clock()
                comm_start, engine0 = times.as_dict(), engine_python_cpu(handle)
                losses, forward_comm, backward_comm = [], 0.0, 0.0
                forward_seconds = backward_seconds = 0.0
                for m in range(micro):  # gradient accumulation: only the last one reduces
                    if micro > 1:
                        model.set_requires_gradient_sync(m == micro - 1)
                    inputs, targets = (
                        t.to(device) for t in rank_batch(cfg, step * micro + m, rank, world)
                    )
                    forward_start, comm0 = time.monotonic(), times.seconds
                    loss = model(inputs, targets)
                    backward_start, comm1 = time.monotonic(), times.seconds
                    (loss / micro).backward()
                    backward_end, comm2 = time.monotonic(), times.seconds
                    losses.append(loss.item())
                    forward_comm += comm1 - comm0
                    backward_comm += comm2 - comm1
                    forward_seconds += backward_start - forward_start
                    backward_seconds += backward_end - backward_start
                optimizer.step()
                optimizer.zero_grad()
                thread, delay = thread_clock()
                comm = {k: v - comm_start[k] for k, v in times.as_dict().items()}
                t1 = time.monotonic()
                rows.append(
                    {
                        "loss": sum(losses) / micro,
                        "seconds": t1 - t0,
                        "window": [t0, t1],  # CLOCK_MONOTONIC, the scheduler trace's
                        "forward_comm_seconds": forward_comm,
                        "backward_comm_seconds": backward_comm,
                        "forward_seconds": forward_seconds,
                        "backward_seconds": backward_seconds,
                        "cpu_seconds": time.process_time() - cpu0,
                        "thread_cpu_seconds": thread - thread0,
                        "run_delay_seconds": delay - delay0,
                        "comm_thread_cpu_seconds": comm["thread_cpu_seconds"],
                        "comm_run_delay_seconds": comm["run_delay_seconds"],
                        "engine_python_cpu_seconds": engine_python_cpu(handle) - engine0,
                        "staging_seconds": comm["staging_in_seconds"] + comm["staging_out_seconds"],
                        "gpu_memory_bytes": torch.cuda.memory_allocated() if gpu else 0,
                        # the last micro-step's: the one that reduces gradients
                        "backward_window": [backward_start, backward_end],
                    }
                )
            nic = read_nic_counters() - nic0
            timeline = handle.timeline()  # on a GPU, the staging copies beside the collectives
            backward = rows[-1]["backward_window"]
            return {
                "steps": rows,
                "tx_bytes": nic.tx_bytes,
                "rx_bytes": nic.rx_bytes,
                "pid": os.getpid(),
                "training_tid": threading.get_native_id(),
                "comm": handle.stats(),
                "pinned_peak_bytes": process_pool().stats()["peak_bytes"] if gpu else 0,
                "stream_gates": gpu and stream_gates() is not None,
                "trace": _window(timeline, *backward) if timeline else None,
                "algorithms": handle.algorithms,
                "warnings": said,
            }
    finally:
        dist.destroy_process_group()
