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
from collections.abc import Callable, Iterable

import torch

from overcast.limits import bytes_from_env

PIECE_BYTES_ENV = "OVERCAST_STAGING_PIECE_BYTES"
# A piece's share of the larger buffer: small enough that the first is on the wire within a
# fraction of a large gather's copy, large enough that a piece's own cost (a collective's set-up,
# a few hundred microseconds) stays small beside its transfer at tens of Gbit/s.
DEFAULT_PIECE_BYTES = 32 << 20
# The most pieces a call is cut into: each is a collective of its own, and a rank's stream gates
# (256) must hold a few calls' pieces. An in-network ReduceScatter is cut into no more than the
# reductions an aggregator keeps in flight per communicator (MAX_REDUCTIONS): a fifth would be
# refused until one finishes, and its ranks would stall on their credit probe.
MOST_PIECES = 64


def piece_bytes() -> int:
    """Bytes of the larger buffer per piece (OVERCAST_STAGING_PIECE_BYTES, default 32 MiB; 0:
    never cut). A collective whose larger buffer is under two pieces runs whole."""
    return bytes_from_env(PIECE_BYTES_ENV, DEFAULT_PIECE_BYTES)


def column_spans(
    shard: int, world: int, itemsize: int, piece: int, most: int = MOST_PIECES
) -> list[tuple[int, int]]:
    """The column ranges [a, b) of a [world, shard] buffer of `itemsize`-byte elements to cut
    into pieces of about `piece` bytes each (larger where that would make more than `most`), as
    even as whole columns allow; one range, the whole, where the buffer is under two pieces or
    `piece` is 0."""
    total = world * shard * itemsize
    if piece <= 0 or total < 2 * piece:
        return [(0, shard)]
    count = min(shard, most, -(-total // piece))
    return list(itertools.pairwise(shard * i // count for i in range(count + 1)))


def cut(
    kind: str,
    output: torch.Tensor,
    input: torch.Tensor,
    world: int,
    piece: int,
    most: int = MOST_PIECES,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, input) views of each piece (at most `most`) of a collective of `kind` ("AG" or
    "RS") on flat buffers, in column order: one pair, the buffers themselves, where it is not
    cut (buffers that are not flat, or not of a [world, shard] layout, are never cut)."""
    whole = [(output, input)]
    gathered, shard = (output, input) if kind == "AG" else (input, output)
    if (
        output.dim() != 1
        or input.dim() != 1
        or not gathered.is_contiguous()
        or gathered.numel() != world * shard.numel()
    ):
        return whole
    spans = column_spans(shard.numel(), world, gathered.element_size(), piece, most)
    if len(spans) == 1:
        return whole
    rows = gathered.view(world, shard.numel())
    if kind == "AG":
        return [(rows[:, a:b], input[a:b]) for a, b in spans]
    return [(output[a:b], rows[:, a:b]) for a, b in spans]


def each_then_first_failure(calls: Iterable[Callable[[], object]]) -> None:
    """Call each of `calls` whichever raised before (waits for several collectives, each of
    which must end), then raise the first failure."""
    failures = []
    for call in calls:
        try:
            call()
        except Exception as err:
            failures.append(err)
    if failures:
        raise failures[0]


class Pieces:
    """A collective's pieces through the poster (fsdp/collectives.py), their copies in queued
    (`staged`): each piece's gate and copy back are queued (`gate(staged)`, a `_Gated`) as it is
    handed to the poster, so that a gate takes its slot only once every earlier piece of the
    call is the poster's (a slot is given out again only once its last gate opened, which a
    piece not handed yet would never do). Each gate opens once its own piece is done."""

    def __init__(self, staged: list, gate):
        self.staged, self._gate = staged, gate
        self.gates: list = []  # queued so far, in order
        self.posted = 0  # the first `posted` pieces are the poster's

    def hand(self, post) -> list:
        """Queue each piece's gate and hand it on with `post(gated, index)`: their handles."""
        handles = []
        for index, staged in enumerate(self.staged):
            self.gates.append(self._gate(staged))
            handles.append(post(self.gates[-1], index))
            self.posted += 1
        return handles

    def order_caller(self) -> None:
        """Make the current stream wait for every piece's copy back (on one stream: the last
        piece's follows the others)."""
        self.gates[-1].order_caller()

    def open(self) -> None:
        """Undo what is not the poster's (a call that failed part-way): open the gates not
        handed on, give back the buffers of the pieces not gated. A piece handed on has its
        collective still writing its host buffers, which its own gate's opening gives back."""
        for gated in self.gates[self.posted :]:
            gated.open()
        for staged in self.staged[len(self.gates) :]:
            staged.staging.release()


class PostedPieces:
    """The poster's handles on a collective's pieces (`_Posted`), as one: complete once every
    piece is; its wait() raises the first piece's failure."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self, timeout: float | None = None) -> bool:
        """Wait `timeout` seconds at most in all for every piece, then raise the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def waiting(handle):
            return lambda: handle.wait(
                None if deadline is None else max(0.0, deadline - time.monotonic())
            )

        each_then_first_failure(waiting(handle) for handle in self.handles)
        return True

    def is_completed(self) -> bool:
        return all(handle.is_completed() for handle in self.handles)
