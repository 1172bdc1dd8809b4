"""What the cost model predicts for one `overcast train` shape: the collectives its training step
issues, how they meet in the backward pass, and the step each way should take.

The step's collectives follow from the shape alone (FSDP2 as overcast.fsdp.overlap drives it):
per micro-step the forward gathers the root and every block; the backward runs the blocks last
to first, and a block that resharded after forward is gathered again, prefetched while the block
after it computes, so its AllGather meets that block's ReduceScatter (a pair). A block that kept
its parameters has no backward AllGather, so the ReduceScatter before stays alone; so does block
0's, and the root's, which FSDP2 runs once the whole backward is done. Micro-steps that do not
sync gradients have no ReduceScatter at all.

The predicted step runs the training thread's schedule (`step_schedule`) against links of B
bytes/s per direction (`simulate_step`): the compute gloo showed in the same run (per micro-step
its forward and backward, shared among the modules by their multiply-adds, and the optimizer),
and every collective moving at the link's rate, the ones in flight sharing each direction.
Rings (and gloo, in one group or two) move (P-1)N each way for an AllGather or a ReduceScatter;
overcast's multicast AllGather sends N and receives (P-1)N, its in-network ReduceScatter the
reverse, so beside each other the two fill both directions: a pair alone takes
max(gather + (P-1)·scatter, (P-1)·gather + scatter) / B. overcast runs the AllGathers that no
ReduceScatter meets (the forward's, and the backward's of micro-steps that do not sync) on its
ring, as overlap() does by default; alone, the two take the same time. What the compute hides
(a prefetched AllGather, a ReduceScatter behind the next block's backward) is not counted; what
it does not is the exposed communication.
"""

from __future__ import annotations

from overcast.sim.step import run_step
from overcast.train.config import GPTConfig
from overcast.train.gpt import TinyGPT

# fp32 parameters and gradients: the trainer keeps FSDP2's default dtypes
BYTES_PER_ELEMENT = 4


def _shard_bytes(params, world: int) -> int:
    """One rank's AllGather input for a group of parameters: FSDP2 shards each on dim 0,
    padded to a multiple of the ranks."""
    return BYTES_PER_ELEMENT * sum(
        -(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in params
    )


def shard_bytes(cfg: GPTConfig, world: int) -> tuple[int, int]:
    """(root, block) bytes per rank: what each of their AllGathers gathers from every rank."""
    import torch

    with torch.device("meta"):
        model = TinyGPT(cfg)
    root = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    return _shard_bytes(root, world), _shard_bytes(model.blocks[0].parameters(), world)


def step_collectives(cfg: GPTConfig, world: int) -> list[tuple[str, int, int]]:
    """The step's collectives in the order they run: ("allgather", N, 0), ("reduce_scatter",
    0, N) or ("pair", gathered N, reduced N), N in bytes per rank."""
    root, block = shard_bytes(cfg, world)
    resharded = cfg.resharded()
    out = []
    for m in range(cfg.micro_steps):
        sync = m == cfg.micro_steps - 1
        out += [("allgather", root, 0)] + [("allgather", block, 0)] * cfg.blocks
        reducing = 0  # the ReduceScatter of the block whose backward just ended
        for i in reversed(range(cfg.blocks)):
            gathering = block if resharded[i] else 0
            if gathering or reducing:
                kind = (
                    "pair"
                    if gathering and reducing
                    else "allgather"
                    if gathering
                    else "reduce_scatter"
                )
                out.append((kind, gathering, reducing))
            reducing = block if sync else 0
        if sync:
            out += [("reduce_scatter", 0, block), ("reduce_scatter", 0, root)]
    return out


def counts(collectives: list[tuple[str, int, int]]) -> dict:
    """How many of each kind a step has."""
    return {
        kind: sum(1 for c in collectives if c[0] == kind)
        for kind in ("allgather", "reduce_scatter", "pair")
    }


def compute_shares(cfg: GPTConfig) -> tuple[float, float]:
    """(one block's, the head's) share of the forward's and of the backward's compute, from
    the multiply-adds per token: a block's projections and MLP (12 d^2) and attention (2 seq d),
    the head's d x vocab; the embeddings' lookups count for nothing."""
    block = 12 * cfg.dim * cfg.dim + 2 * cfg.seq * cfg.dim
    head = cfg.dim * cfg.vocab
    total = cfg.blocks * block + head
    return block / total, head / total


def step_schedule(cfg: GPTConfig, world: int, compute: dict, prefetch: int = 1) -> list[tuple]:
    """The training thread's step as overcast.fsdp.overlap(prefetch=) drives FSDP2: ("compute",
    seconds), ("post", name, kind, N) with kind "allgather" (in a backward pass that reduces
    gradients), "unpaired_allgather" (elsewhere) or "reduce_scatter" and N bytes per rank, and
    ("wait", name).

    Each module waits for its own AllGather, then posts its prefetch of the `prefetch` blocks
    after it (forward; the root, the first ones) or before it (backward; the root prefetches
    the last block), those not already posted; a block's ReduceScatter is
    posted when its backward ends, once the one before it has finished, and the last is waited
    for at the end of the backward pass. `compute` is a micro-step's seconds of
    "forward" and "backward" (shared among the modules by `compute_shares`) and the step's
    "other" (the optimizer)."""
    root, block = shard_bytes(cfg, world)
    resharded = cfg.resharded()
    block_share, head_share = compute_shares(cfg)
    fwd, bwd = compute["forward"], compute["backward"]
    out = []
    for m in range(cfg.micro_steps):
        sync = m == cfg.micro_steps - 1
        backward_gather = "allgather" if sync else "unpaired_allgather"
        out += [("post", f"AG root {m}", "unpaired_allgather", root), ("wait", f"AG root {m}")]
        out += [
            ("post", f"AG {j} {m}", "unpaired_allgather", block)
            for j in range(min(prefetch, cfg.blocks))
        ]
        for i in range(cfg.blocks):
            out.append(("wait", f"AG {i} {m}"))
            if i + prefetch < cfg.blocks:
                out.append(("post", f"AG {i + prefetch} {m}", "unpaired_allgather", block))
            out.append(("compute", fwd * block_share))
        out.append(("compute", fwd * head_share))
        last = cfg.blocks - 1
        gathered = set()  # blocks whose backward AllGather is posted
        if resharded[last]:  # FSDP2's own prefetch, in the root's pre-backward
            gathered.add(last)
            out.append(("post", f"BAG {last} {m}", backward_gather, block))
        out.append(("compute", bwd * head_share))
        for i in reversed(range(cfg.blocks)):
            if resharded[i]:
                out.append(("wait", f"BAG {i} {m}"))
            for j in range(i - 1, max(-1, i - 1 - prefetch), -1):
                if resharded[j] and j not in gathered:
                    gathered.add(j)
                    out.append(("post", f"BAG {j} {m}", backward_gather, block))
            out.append(("compute", bwd * block_share))
            if sync:  # one ReduceScatter in flight at a time (FSDP2's one input buffer)
                if i < last:
                    out.append(("wait", f"RS {i + 1}"))
                out.append(("post", f"RS {i}", "reduce_scatter", block))
        if sync:
            out += [
                ("wait", "RS 0"),
                ("post", "RS root", "reduce_scatter", root),
                ("wait", "RS root"),
            ]
    out.append(("compute", compute["other"]))
    return out


def _bytes_each_way(kind: str, n: int, world: int, overlapped: bool) -> tuple[float, float]:
    """(sent, received) per rank: a ring's (P-1)N each way; multicast AllGather sends its shard
    once, in-network ReduceScatter receives only its result."""
    if not overlapped or kind == "unpaired_allgather":
        return (world - 1) * n, (world - 1) * n
    return (n, (world - 1) * n) if kind == "allgather" else ((world - 1) * n, n)


def simulate_step(
    schedule: list[tuple], world: int, link_bytes_per_s: float, overlapped: bool
) -> float:
    """Seconds the schedule takes with every collective at the link's rate (overcast.sim.step),
    each moving what `_bytes_each_way` says: rings, or overcast's two when `overlapped`."""
    return run_step(
        schedule, link_bytes_per_s, lambda kind, n: _bytes_each_way(kind, n, world, overlapped)
    )


def predict(
    cfg: GPTConfig, world: int, link_bits_per_s: float, compute: dict, prefetch: int = 1
) -> dict:
    """Each way's predicted step (`simulate_step` of `step_schedule`), the communication it
    leaves exposed, and the speed-up over rings it implies. `compute`, `prefetch`: as
    `step_schedule`."""
    schedule = step_schedule(cfg, world, compute, prefetch)
    total_compute = cfg.micro_steps * (compute["forward"] + compute["backward"]) + compute["other"]
    step = {
        name: float(simulate_step(schedule, world, link_bits_per_s / 8, overlapped))
        for name, overlapped in (("rings", False), ("overcast", True))
    }
    return {
        "collectives": counts(step_collectives(cfg, world)),
        "compute_seconds": total_compute,
        "compute_split": compute,
        "comm_seconds": {name: seconds - total_compute for name, seconds in step.items()},
        "step_seconds": step,
        "speedup_over_rings": step["rings"] / step["overcast"],
    }
