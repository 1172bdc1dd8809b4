"""A large FSDP2 collective on a GPU runs in pieces (overcast/fsdp/pieces.py): the pieces' views
and their collectives, run here on CPU tensors through a real communicator, give what the whole
collective gives, bit for bit."""

import itertools

import numpy as np
import pytest
import torch

import overcast
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.fsdp.collectives import _Posted
from overcast.fsdp.pieces import Pieces, PostedPieces, column_spans, cut
from overcast.staging import GateTickets

WORLD, SHARD = 3, 997  # a prime number of columns: the pieces cannot all be alike
PIECE = 2000  # bytes of the [WORLD, SHARD] float32 buffer (11,964 bytes): 6 pieces


def test_the_columns_are_cut_into_even_pieces_covering_the_shard_once():
    spans = column_spans(SHARD, WORLD, 4, PIECE)
    assert len(spans) == -(-WORLD * SHARD * 4 // PIECE) == 6
    assert spans[0][0] == 0 and spans[-1][1] == SHARD
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(spans))
    widths = [b - a for a, b in spans]
    assert max(widths) - min(widths) <= 1


def test_a_call_is_cut_into_no_more_pieces_than_asked():
    assert len(column_spans(SHARD, WORLD, 4, PIECE, most=4)) == 4
    assert len(cut("RS", torch.empty(SHARD), torch.empty(WORLD * SHARD), WORLD, 1, most=4)) == 4


def test_a_pieces_gate_takes_its_slot_only_once_the_earlier_pieces_are_handed_on():
    """More pieces than the ring has gate slots: each piece's gate is taken as it is handed to
    the poster, whose collectives then open the earlier gates, so the call never waits for a
    slot only an unposted piece of its own would free (it waited for good past 256)."""
    tickets = GateTickets(4)
    opened: list[int] = []

    def post(gate, index):  # the poster posts it, and its collective ends, at once
        tickets.opened(*gate)
        opened.append(index)
        return index

    pieces = Pieces(list(range(10)), lambda staged: tickets.take())
    assert pieces.hand(post) == list(range(10)) and opened == list(range(10))
    assert pieces.posted == 10 and tickets.taken == 10


@pytest.mark.parametrize("piece", [0, WORLD * SHARD * 4 // 2 + 1, 1 << 30])
def test_a_collective_under_two_pieces_or_with_pieces_off_runs_whole(piece):
    assert column_spans(SHARD, WORLD, 4, piece) == [(0, SHARD)]
    out, inp = torch.empty(WORLD * SHARD), torch.empty(SHARD)
    [(o, i)] = cut("AG", out, inp, WORLD, piece)
    assert o is out and i is inp


def test_buffers_of_another_layout_are_never_cut():
    gathered = torch.empty(WORLD * SHARD + 1)  # not world x shard
    assert len(cut("AG", gathered, torch.empty(SHARD), WORLD, PIECE)) == 1
    assert len(cut("RS", torch.empty(SHARD), gathered, WORLD, PIECE)) == 1
    rows = torch.empty(WORLD, SHARD)  # not flat
    assert len(cut("RS", torch.empty(SHARD), rows, WORLD, PIECE)) == 1


def pieces_against_whole(rank):
    """Each collective whole, then piece by piece through contiguous twins of the pieces' views
    (as the host twins are), written back into the views: (AllGather exact, ReduceScatter
    exact, pieces of each)."""
    gen = np.random.default_rng(rank)
    shard = torch.from_numpy(gen.standard_normal(SHARD).astype(np.float32))
    grads = torch.from_numpy(gen.standard_normal(WORLD * SHARD).astype(np.float32))
    with overcast.Communicator(timeout=60) as comm:
        whole_ag = torch.empty(WORLD * SHARD)
        comm.all_gather(whole_ag, shard)
        whole_rs = torch.empty(SHARD)
        comm.reduce_scatter(whole_rs, grads, op="sum")

        pieced_ag = torch.full((WORLD * SHARD,), float("nan"))
        ag_pieces = cut("AG", pieced_ag, shard, WORLD, PIECE)
        for out, inp in ag_pieces:
            host_out = torch.empty(out.shape)
            comm.all_gather(host_out, inp.contiguous())
            out.copy_(host_out)
        pieced_rs = torch.full((SHARD,), float("nan"))
        rs_pieces = cut("RS", pieced_rs, grads, WORLD, PIECE)
        for out, inp in rs_pieces:
            host_out = torch.empty(out.shape)
            comm.reduce_scatter(host_out, inp.contiguous(), op="sum")
            out.copy_(host_out)
    same = lambda a, b: bool((a.view(torch.int32) == b.view(torch.int32)).all())  # noqa: E731
    return [same(pieced_ag, whole_ag), same(pieced_rs, whole_rs), len(ag_pieces), len(rs_pieces)]


def test_the_pieces_give_what_the_whole_collective_gives_bit_for_bit():
    results = run_ranks(pieces_against_whole, loopback_placements(WORLD), timeout=120)
    assert results == [[True, True, 6, 6]] * WORLD


def settled(error=None) -> _Posted:
    handle = _Posted("piece")
    handle.error = error
    handle._settle(None)
    return handle


def test_the_pieces_wait_for_each_and_raise_the_first_failure():
    first, second = RuntimeError("piece 2"), RuntimeError("piece 3")
    pieces = PostedPieces([settled(), settled(first), settled(second)])
    assert pieces.is_completed()
    with pytest.raises(RuntimeError) as raised:
        pieces.wait(1.0)
    assert raised.value is first
    assert PostedPieces([settled(), settled()]).wait(1.0)
    unfinished = PostedPieces([settled(), _Posted("still in flight")])
    assert not unfinished.is_completed()
    with pytest.raises(TimeoutError):
        unfinished.wait(0.01)
