"""What runs on each emulated host during `overcast bench`: one (collective, algorithm, size)
point, timed over repetitions, its results checked, its NIC counters read around each run."""

from __future__ import annotations

import os
import time
import warnings

import numpy as np

from overcast.cluster.netns import read_nic_counters

DTYPE = np.float32
# Per-run protocol counts reported beside the NIC counters.
PROTOCOL_COUNTERS = (
    "injected_losses",
    "multicast_chunks",
    "duplicate_chunks",
    "repaired_chunks",
    "repair_bytes",
    "repair_requests",
    "results",
    "duplicate_results",
    "contributions_resent",
    "credit_probes",
    "datagrams_in",
    "datagrams_out",
    "datagram_reads",
    "datagram_sends",
    "wakeups",
    "python_cpu_seconds",
    "data_path_cpu_seconds",
    "aggregators_lost",
    "in_network_redone_on_ring",
)
# torch.distributed groups meet at MASTER_PORT plus these (the bench's Communicator at MASTER_PORT)
PORT_OFFSETS = {"gloo": 1, "overcast": 2}


def pattern(rank: int, count: int, world: int) -> np.ndarray:
    """Rank `rank`'s input for a reduction: small integers, so float32 sums are exact."""
    return ((np.arange(world * count) % 1021) + rank).astype(DTYPE)


def expected_sum(rank: int, count: int, world: int) -> np.ndarray:
    base = (np.arange(world * count) % 1021)[rank * count : (rank + 1) * count]
    return (base * world + world * (world - 1) // 2).astype(DTYPE)


def shard(rank: int, count: int) -> np.ndarray:
    """Rank `rank`'s shard for a gather: distinct per rank and per position."""
    return ((np.arange(count) * 7 + rank * 131) % 2039).astype(DTYPE)


def uneven_splits(world: int, count: int) -> list[list[int]]:
    """Elements rank s sends rank d in the uneven all_to_all: `count` in all from every rank,
    in shares of 1 + (s + d) mod P (a rank sends its neighbours' blocks in every size), so that
    blocks differ pair by pair while every host sends and receives about as much."""
    shares = [[1 + (s + d) % world for d in range(world)] for s in range(world)]
    total = sum(shares[0])
    splits = [[count * w // total for w in row] for row in shares]
    for row in splits:
        row[-1] += count - sum(row)
    return splits


class _TorchGroup:
    """torch.distributed on the same hosts: gloo for the baseline, or the "overcast" backend
    (all_to_all and send_recv run on a group of either). ReduceScatter gets its own process
    group, as FSDP2's set_separate_reduce_scatter_group gives it, so that the two can
    overlap."""

    def __init__(self, rank: int, world: int, backend: str = "gloo"):
        import torch
        import torch.distributed as dist

        if backend == "overcast":
            import overcast.distributed  # noqa: F401  (registers the backend)
        # torch 2.13 calls these two "deprecated" in favour of *_single; they are what FSDP2
        # and users call today, so they are the baseline.
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        self.torch, self.dist = torch, dist
        port = int(os.environ["MASTER_PORT"]) + PORT_OFFSETS[backend]
        dist.init_process_group(
            backend,
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}",
            rank=rank,
            world_size=world,
        )
        self.rs_group = dist.new_group(backend="gloo") if backend == "gloo" else None

    def all_gather(self, out, inp, async_op=False):
        return self.dist.all_gather_into_tensor(
            self.torch.from_numpy(out), self.torch.from_numpy(inp), async_op=async_op
        )

    def all_reduce(self, buf):
        self.dist.all_reduce(self.torch.from_numpy(buf))

    def reduce_scatter(self, out, inp, async_op=False):
        return self.dist.reduce_scatter_tensor(
            self.torch.from_numpy(out),
            self.torch.from_numpy(inp),
            group=self.rs_group,
            async_op=async_op,
        )

    def all_to_all(self, out, inp, out_splits, in_splits):
        self.dist.all_to_all_single(
            self.torch.from_numpy(out), self.torch.from_numpy(inp), out_splits, in_splits
        )

    def send_recv(self, buf, rank: int, world: int):
        """Each even rank sends `buf` to the odd rank after it, which receives it."""
        tensor = self.torch.from_numpy(buf)
        if rank % 2 == 0 and rank + 1 < world:
            self.dist.send(tensor, rank + 1)
        elif rank % 2:
            self.dist.recv(tensor, rank - 1)

    def close(self):
        self.dist.destroy_process_group()


# Collectives timed on a torch.distributed group (overcast's or gloo's), not a Communicator
TORCH_COLLECTIVES = ("all_to_all", "all_to_all_uneven", "send_recv")
# (AllGather algorithm, ReduceScatter algorithm) of each overlapped pair
OVERLAP = {"overcast": ("multicast", "innetwork"), "ring": ("ring", "ring")}


def exchange(group: _TorchGroup, collective: str, rank: int, count: int, world: int):
    """(run, reset, check) of an all_to_all or a send_recv on a torch.distributed group: every
    element says who sent it, to whom, and where it was."""
    if collective == "send_recv":
        source = ((np.arange(count) * 7 + rank) % 2039).astype(DTYPE)
        buffer = source.copy()
        expect = ((np.arange(count) * 7 + rank - 1) % 2039).astype(DTYPE) if rank % 2 else source

        def reset():
            buffer[:] = source if rank % 2 == 0 else -1

        return (
            (lambda: group.send_recv(buffer, rank, world)),
            reset,
            lambda: np.array_equal(buffer, expect),
        )
    splits = (
        uneven_splits(world, count)
        if collective == "all_to_all_uneven"
        else [[count // world] * (world - 1) + [count - count // world * (world - 1)]] * world
    )

    def block(src, dst):
        return ((np.arange(splits[src][dst]) * 3 + src * 131 + dst * 17) % 2039).astype(DTYPE)

    inp = np.concatenate([block(rank, d) for d in range(world)])
    expect = np.concatenate([block(s, rank) for s in range(world)])
    out = np.empty_like(expect)
    ins, outs = splits[rank], [row[rank] for row in splits]
    return (
        (lambda: group.all_to_all(out, inp, outs, ins)),
        (lambda: out.fill(-1)),
        lambda: np.array_equal(out, expect),
    )


def workload(comm, group, collective: str, algorithm: str, rank: int, count: int, world: int):
    """(run, reset, check): one collective (or overlapped pair) on fixed buffers."""
    if collective in TORCH_COLLECTIVES:
        return exchange(group, collective, rank, count, world)
    ag_in, ag_out = shard(rank, count), np.empty(world * count, DTYPE)
    ag_expect = np.concatenate([shard(r, count) for r in range(world)])
    rs_in, rs_out = pattern(rank, count, world), np.empty(count, DTYPE)
    rs_expect = expected_sum(rank, count, world)
    if group:
        ag, rs = group.all_gather, group.reduce_scatter
    else:
        ag_algo, rs_algo = OVERLAP.get(algorithm, (algorithm, algorithm))
        ag = lambda o, i, async_op=False: comm.all_gather(o, i, async_op, algorithm=ag_algo)  # noqa
        rs = lambda o, i, async_op=False: comm.reduce_scatter(  # noqa: E731
            o,
            i,
            async_op=async_op,
            algorithm=rs_algo,
        )
    if collective == "all_reduce":  # `count` elements per rank: the whole buffer, reduced
        base = np.arange(count) % 1021
        source, buffer = (base + rank).astype(DTYPE), np.empty(count, DTYPE)
        expect = (base * world + world * (world - 1) // 2).astype(DTYPE)
        run = (
            (lambda: group.all_reduce(buffer))
            if group
            else (lambda: comm.all_reduce(buffer, algorithm=algorithm))
        )

        def restore():
            buffer[:] = source

        return run, restore, lambda: np.array_equal(buffer, expect)
    if collective == "allgather":
        buffers, run = [(ag_out, ag_expect)], lambda: ag(ag_out, ag_in)
    elif collective == "reduce_scatter":
        buffers, run = [(rs_out, rs_expect)], lambda: rs(rs_out, rs_in)
    else:

        def run():
            first = ag(ag_out, ag_in, async_op=True)
            second = rs(rs_out, rs_in, async_op=True)
            first.wait()
            second.wait()

        buffers = [(ag_out, ag_expect), (rs_out, rs_expect)]

    def reset():
        for out, _ in buffers:
            out.fill(-1)

    def check() -> bool:
        return all(np.array_equal(out, expect) for out, expect in buffers)

    return run, reset, check


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, all namespaces included, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def run_point(
    rank: int,
    collective: str,
    algorithm: str,
    nbytes: int,
    reps: int,
    warmup: int,
    roots: int | None,
    trace: bool = False,
) -> dict:
    """Time `reps` runs after `warmup` on this host.

    Returns the runs (time, CPU of this process, machine CPU busy fraction, correctness) and
    the NIC bytes per run. The bytes are counted over all runs at once, less the bytes of as
    many barriers alone: per-run counter reads would race with peers that leave a barrier
    first and start sending. With `trace`, the last run's timeline comes back too.
    """
    import overcast

    world = int(os.environ["WORLD_SIZE"])
    count = max(1, nbytes // DTYPE().itemsize)
    comm = overcast.Communicator(timeout=120, roots=roots or world, trace=trace)
    group = (
        _TorchGroup(rank, world)
        if algorithm == "gloo"
        else _TorchGroup(rank, world, "overcast")
        if collective in TORCH_COLLECTIVES
        else None
    )
    try:
        run, reset, check = workload(comm, group, collective, algorithm, rank, count, world)
        for _ in range(warmup):
            comm.barrier()
            run()
        runs = []
        comm.barrier()
        start, protocol_start = read_nic_counters(), comm.counters()
        for _ in range(reps):
            reset()
            comm.barrier()
            cpu0, busy0 = time.process_time(), machine_cpu()
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
            cpu, busy1 = time.process_time() - cpu0, machine_cpu()
            runs.append(
                {
                    "seconds": seconds,
                    "cpu_seconds": cpu,
                    "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
                    "correct": check(),
                }
            )
        comm.barrier()
        middle, protocol_end = read_nic_counters(), comm.counters()
        timeline = comm.trace()
        for _ in range(reps):
            comm.barrier()
        comm.barrier()
        barriers = read_nic_counters() - middle
        total = middle - start - barriers
        protocol = {
            key: (protocol_end.get(key, 0) - protocol_start.get(key, 0)) / reps
            for key in PROTOCOL_COUNTERS
        }
        return {
            "runs": runs,
            "tx_bytes": total.tx_bytes / reps,
            "rx_bytes": total.rx_bytes / reps,
            "tx_packets": total.tx_packets / reps,
            "rx_packets": total.rx_packets / reps,
            "protocol": protocol,
            "chunk_bytes": comm.chunk_bytes,
            "mtu": comm.mtu,
            "trace": timeline,
        }
    finally:
        if group:
            group.close()
        comm.close()
