"""all_to_all as a pairwise exchange, sans I/O: bit-exact with uneven and empty blocks, each rank
sending and receiving only its blocks, and what a peer's stream may not say."""

import numpy as np
import pytest

from fabric import Fabric
from overcast.errors import Rejected
from overcast.protocols.base import Descriptor
from overcast.protocols.pairwise import PairwiseAllToAll
from overcast.wire.header import Header, Kind

FRAME = 16


def matrix(world, seed):
    """Bytes rank s sends rank d: uneven, some empty (the diagonal too, now and then)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 5 * FRAME, (world, world))
    sizes[rng.random((world, world)) < 0.25] = 0
    return sizes


def block(src, dst, n):
    return ((np.arange(n) * 3 + src * 17 + dst * 101) % 251).astype(np.uint8)


def exchange(fabric, sizes, seq=0):
    world = fabric.world
    colls = []
    for r in range(world):
        send, recv = [int(n) for n in sizes[r]], [int(n) for n in sizes[:, r]]
        desc = Descriptor("all_to_all", "pairwise", np.dtype(np.uint8), int(sizes.sum()))
        inp = np.concatenate([block(r, d, send[d]) for d in range(world)] +
                             [np.empty(0, np.uint8)])
        coll = PairwiseAllToAll(seq, r, world, desc, np.full(sum(recv), 255, np.uint8), inp,
                                send, recv, FRAME)
        colls.append(coll)
        fabric.post(r, coll)
    return colls


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(6))
def test_every_rank_gets_its_blocks_and_sends_only_its_own(world, seed):
    sizes = matrix(world, seed)
    fabric = Fabric(world, seed=seed)
    colls = exchange(fabric, sizes)
    fabric.run()
    for r, coll in enumerate(colls):
        assert coll.done and coll.error is None, coll.error
        expect = np.concatenate([block(s, r, int(sizes[s, r])) for s in range(world)] +
                                [np.empty(0, np.uint8)])
        assert coll.output.tobytes() == expect.tobytes()
    data = {}
    for hdr, payload, _ in fabric.seen:
        if hdr.kind == Kind.A2A_DATA:
            data[(hdr.src, hdr.dst)] = data.get((hdr.src, hdr.dst), 0) + len(payload)
    assert data == {(s, d): int(sizes[s, d]) for s in range(world) for d in range(world)
                    if s != d and sizes[s, d]}


def inject(fabric, src, dst, chunk, body):
    hdr = Header(Kind.A2A_DATA, 0, 0, 0, src, dst, chunk, len(body), 0)
    fabric.streams[(src, dst)].append((hdr, body))


@pytest.mark.parametrize("case,reason", [("frame out of turn", "out_of_range"),
                                         ("frame too long", "wrong_length"),
                                         ("from a rank with nothing to send", "wrong_sender")])
def test_what_a_peer_may_not_send_aborts(case, reason):
    sizes = np.array([[0, 2 * FRAME, 0], [FRAME, 0, 0], [0, 0, 0]])
    fabric = Fabric(3)
    fabric.silent.add(0)  # what rank 0 sends is made by hand
    colls = exchange(fabric, sizes)
    src, chunk, body = {"frame out of turn": (0, 1, b"z" * FRAME),
                        "frame too long": (0, 0, b"z" * (FRAME + 1)),
                        "from a rank with nothing to send": (2, 0, b"z")}[case]
    if src == 2:
        fabric.silent.add(2)
    inject(fabric, src, 1, chunk, body)
    fabric.run()
    assert isinstance(colls[1].error, Rejected) and colls[1].error.reason == reason, \
        colls[1].error
