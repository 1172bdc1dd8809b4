"""Staging copies cut into pieces under the transfer.

On a GPU, a collective FSDP2 calls runs on pinned host twins of its buffers: the input is copied
to the host, the collective runs, the output is copied back (fsdp/collectives.py). Whole, the
transfer starts only once the whole input is on the host, and the copy back only once the whole
result is in. A large collective is therefore run as several smaller ones over column ranges of
its [world, shard] layout, each posted once its own piece of the input is on the host: the first
piece is on the wire while the next is copied, and each piece's result is copied back while the
later pieces move.

An AllGather's input is [shard] and its output [world, shard]; a ReduceScatter's input is
[world, shard] and its output [shard]. Piece j covers columns [a, b) of the shard: input[a:b] and
output[:, a:b] for an AllGather, input[:, a:b] and output[a:b] for a ReduceScatter, so each piece
is itself an AllGather or ReduceScatter of the same world. Every rank cuts its call alike (the
same sizes, and the same OVERCAST_STAGING_PIECE_BYTES on every rank), so the pieces are numbered
alike everywhere.

Nothing here needs a GPU: the cutting is tensor views alone.
"""

from __future__ import annotations

import itertools
import time

import torch

from overcast.limits import bytes_from_env

PIECE_BYTES_ENV = "OVERCAST_STAGING_PIECE_BYTES"
# A piece's share of the larger buffer: small enough that the first is on the wire within a
# fraction of a large gather's copy, large enough that a piece's own cost (a collective's set-up,
# a few hundred microseconds) stays small beside its transfer at tens of Gbit/s.
DEFAULT_PIECE_BYTES = 32 << 20


def piece_bytes() -> int:
    """Bytes of the larger buffer per piece (OVERCAST_STAGING_PIECE_BYTES, default 32 MiB; 0:
    never cut). A collective whose larger buffer is under two pieces runs whole."""
    return bytes_from_env(PIECE_BYTES_ENV, DEFAULT_PIECE_BYTES)


def column_spans(shard: int, world: int, itemsize: int, piece: int) -> list[tuple[int, int]]:
    """The column ranges [a, b) of a [world, shard] buffer of `itemsize`-byte elements to cut
    into pieces of about `piece` bytes each, as even as whole columns allow; one range, the
    whole, where the buffer is under two pieces or `piece` is 0."""
    total = world * shard * itemsize
    if piece <= 0 or total < 2 * piece:
        return [(0, shard)]
    count = min(shard, -(-total // piece))
    return list(itertools.pairwise(shard * i // count for i in range(count + 1)))


def cut(
    kind: str, output: torch.Tensor, input: torch.Tensor, world: int, piece: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, input) views of each piece of a collective of `kind` ("AG" or "RS") on flat
    buffers, in column order: one pair, the buffers themselves, where it is not cut (buffers
    that are not flat, or not of a [world, shard] layout, are never cut)."""
    whole = [(output, input)]
    gathered, shard = (output, input) if kind == "AG" else (input, output)
    if (
        output.dim() != 1
        or input.dim() != 1
        or not gathered.is_contiguous()
        or gathered.numel() != world * shard.numel()
    ):
        return whole
    spans = column_spans(shard.numel(), world, gathered.element_size(), piece)
    if len(spans) == 1:
        return whole
    rows = gathered.view(world, shard.numel())
    if kind == "AG":
        return [(rows[:, a:b], input[a:b]) for a, b in spans]
    return [(output[a:b], rows[:, a:b]) for a, b in spans]


class Pieces:
    """The gates of a collective's pieces (fsdp/collectives.py `_Gated`), as one: each opens
    once its own piece's collective is done. `open()` opens those not handed to the poster yet
    (a call that failed part-way): a piece posted has its collective still writing its host
    buffers, which its own gate's opening gives back."""

    def __init__(self, gates: list):
        self.gates = gates
        self.posted = 0  # the first `posted` pieces are the poster's to open

    def order_caller(self) -> None:
        """Make the current stream wait for every piece's copy back (on one stream: the last
        piece's follows the others)."""
        self.gates[-1].order_caller()

    def open(self) -> None:
        for gate in self.gates[self.posted :]:
            gate.open()


class PostedPieces:
    """The poster's handles on a collective's pieces (`_Posted`), as one: complete once every
    piece is; its wait() raises the first piece's failure."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self, timeout: float | None = None) -> bool:
        """Wait `timeout` seconds at most in all for every piece, then raise the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = []
        for handle in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(left)
            except Exception as err:
                failures.append(err)
        if failures:
            raise failures[0]
        return True

    def is_completed(self) -> bool:
        return all(handle.is_completed() for handle in self.handles)
