"""The ring schedules for AllGather and ReduceScatter, as streams between ring neighbours.

Each rank sends one stream to rank+1 and receives one from rank-1. The stream is P-1 blocks of N
bytes, cut into frames that never cross a block boundary, so frame j of step s can be forwarded
(AllGather) or summed and forwarded (ReduceScatter) as soon as frame j of step s-1 has arrived:
a pipelined ring whose time is N(P-1)/B plus one frame per hop.
"""

from __future__ import annotations

# A ring stream's frame: large enough that the engine wakes rarely per byte (its cost per frame is
# mostly fixed), small enough to pipeline.
DEFAULT_FRAME_BYTES = 512 * 1024


def frames(nbytes: int, frame_bytes: int, align: int) -> list[tuple[int, int]]:
    """(offset, length) pairs cutting `nbytes` into frames of at most `frame_bytes`, each a
    multiple of `align` except possibly the last. An empty block still has one empty frame."""
    step = max(align, frame_bytes - frame_bytes % align)
    cuts = list(range(0, nbytes, step)) or [0]
    return [(off, min(step, nbytes - off)) for off in cuts]


def allgather_send_block(rank: int, world: int, step: int) -> int:
    """Block index rank sends at `step` (0..P-2): its own first, then what it just received."""
    return (rank - step) % world


def allgather_recv_block(rank: int, world: int, step: int) -> int:
    return (rank - step - 1) % world


def reduce_scatter_send_block(rank: int, world: int, step: int) -> int:
    """Block whose partial sum rank sends at `step`; after P-1 steps rank holds block `rank`."""
    return (rank - step - 1) % world


def reduce_scatter_recv_block(rank: int, world: int, step: int) -> int:
    return (rank - step - 2) % world
