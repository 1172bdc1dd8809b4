"""What the cost model predicts for one `overcast train` shape: the collectives its training step
issues, how they meet in the backward pass, and the step each way should take.

The step's collectives follow from the shape alone (FSDP2 as overcast.fsdp.overlap drives it):
per micro-step the forward gathers the root and every block; the backward runs the blocks last
to first, and a block that resharded after forward is gathered again, prefetched while the block
after it computes, so its AllGather meets that block's ReduceScatter (a pair). A block that kept
its parameters has no backward AllGather, so the ReduceScatter before stays alone; so does block
0's, and the root's, which FSDP2 runs once the whole backward is done. Micro-steps that do not
sync gradients have no ReduceScatter at all.

Each collective is taken at its floor on links of B bytes/s per direction, fully exposed: the
step's communication is the sum. Rings (and gloo, in one group or two) move (P-1)N each way for
an AllGather or a ReduceScatter, so a ring pair costs the two added; overcast's pair costs
max(gather + (P-1)·scatter, (P-1)·gather + scatter) / B. The predicted step is the compute
measured with gloo (its step less its exposed communication, in the same run) plus the way's
communication.
"""

from __future__ import annotations

from overcast.schedules.cost import floor_seconds, pair_floor_seconds
from overcast.train.gpt import GPTConfig, TinyGPT

# fp32 parameters and gradients: the trainer keeps FSDP2's default dtypes
BYTES_PER_ELEMENT = 4


def _shard_bytes(params, world: int) -> int:
    """One rank's AllGather input for a group of parameters: FSDP2 shards each on dim 0,
    padded to a multiple of the ranks."""
    return BYTES_PER_ELEMENT * sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0])
                                   for p in params)


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
                kind = "pair" if gathering and reducing else \
                    "allgather" if gathering else "reduce_scatter"
                out.append((kind, gathering, reducing))
            reducing = block if sync else 0
        if sync:
            out += [("reduce_scatter", 0, block), ("reduce_scatter", 0, root)]
    return out


def collective_seconds(kind: str, gather: int, scatter: int, world: int, overlapped: bool,
                       link_bytes_per_s: float) -> float:
    """One collective at its floor; `overlapped`: overcast's pair (multicast + in-network)
    rather than two rings."""
    if kind == "pair" and overlapped:
        return pair_floor_seconds(gather, scatter, world, link_bytes_per_s)
    return floor_seconds("allgather", gather, world, link_bytes_per_s) + \
        floor_seconds("reduce_scatter", scatter, world, link_bytes_per_s)


def counts(collectives: list[tuple[str, int, int]]) -> dict:
    """How many of each kind a step has."""
    return {kind: sum(1 for c in collectives if c[0] == kind)
            for kind in ("allgather", "reduce_scatter", "pair")}


def predict(cfg: GPTConfig, world: int, link_bits_per_s: float, compute_seconds: float) -> dict:
    """Each way's predicted communication and step; the speed-up over rings it implies."""
    collectives = step_collectives(cfg, world)
    comm = {}
    for name, overlapped in (("rings", False), ("overcast", True)):
        comm[name] = sum(collective_seconds(kind, g, s, world, overlapped, link_bits_per_s / 8)
                         for kind, g, s in collectives)
    step = {name: compute_seconds + seconds for name, seconds in comm.items()}
    return {"collectives": counts(collectives), "compute_seconds": compute_seconds,
            "comm_seconds": comm, "step_seconds": step,
            "speedup_over_rings": step["rings"] / step["overcast"]}
