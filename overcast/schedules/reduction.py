"""How in-network ReduceScatter numbers its chunks; the ranks and the aggregator both follow it.

Each of the P blocks is cut into k chunks. Chunks are numbered group by group: `group` chunks of
block 0, then as many of block 1, and so on to block P-1, then the next chunks of block 0; where
`group` does not divide k, the last round holds the k mod `group` chunks left of each block. So
a rank that contributes in increasing number feeds every block in turn (results reach every
owner at the same steady rate), and `group` consecutive chunks share an owner: their sums go to
it together, in one batch. A group of 1 numbers chunk c of block b as c * P + b.
"""

from __future__ import annotations


def chunk_place(g: int, world: int, k: int, group: int) -> tuple[int, int]:
    """(block, chunk within the block) of chunk g; the block is its owner's rank."""
    whole = k - k % group  # chunks per block in whole groups
    if g < whole * world:
        turn, rest = divmod(g, world * group)
        block, j = divmod(rest, group)
        return block, turn * group + j
    block, j = divmod(g - whole * world, k - whole)
    return block, whole + j


def chunk_owner(g: int, world: int, k: int, group: int) -> int:
    return chunk_place(g, world, k, group)[0]


def owner_span(g: int, world: int, k: int, group: int) -> tuple[int, int, int]:
    """(owner, first, end) of chunk g: its owner, and the consecutive chunk numbers around g,
    first to end - 1, that are all that owner's (g's group, or the last round's rest)."""
    block, c = chunk_place(g, world, k, group)
    whole = k - k % group
    j, size = (c % group, group) if c < whole else (c - whole, k - whole)
    return block, g - j, g - j + size
