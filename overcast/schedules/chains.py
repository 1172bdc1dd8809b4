"""The chained schedule of the multicast AllGather.

Ranks are split into `roots` contiguous chains. The first rank of each chain multicasts at once;
every other rank multicasts after its chain predecessor has finished and activated it. So at most
`roots` ranks multicast at any moment, and each may be paced at B / min(roots, P-1): the most any
receiver then takes in is its link rate.
"""

from __future__ import annotations


def chains(world: int, roots: int) -> list[list[int]]:
    """Contiguous chains of ranks, as even as possible, the longer ones first."""
    roots = max(1, min(roots, world))
    base, extra = divmod(world, roots)
    out, start = [], 0
    for c in range(roots):
        length = base + (1 if c < extra else 0)
        out.append(list(range(start, start + length)))
        start += length
    return out


def chain_position(world: int, roots: int, rank: int) -> tuple[bool, int | None]:
    """(whether `rank` starts its chain, the rank it activates when done or None)."""
    for chain in chains(world, roots):
        if rank in chain:
            i = chain.index(rank)
            return i == 0, chain[i + 1] if i + 1 < len(chain) else None
    raise ValueError(f"rank {rank} outside world {world}")


def concurrent_senders(world: int, roots: int) -> int:
    """How many multicast streams a receiver takes in at once, at most."""
    return max(1, min(roots, world - 1))


def stream_rate(budget: float, world: int, concurrent: int, reductions: bool) -> float:
    """Link bytes per second of one root's multicast stream, from its host's uplink budget:
    what receivers can take, shared among the `concurrent` streams they take at once; while
    in-network reductions run, their results get 1/P of each receiver's link (the AllGather's
    receive is P-1 times the reduction's)."""
    return budget * ((world - 1) / world if reductions else 1.0) / concurrent


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)
