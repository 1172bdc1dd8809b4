"""all_to_all as a pairwise exchange, sans I/O: bit-exact with uneven and empty blocks, each rank
sending and receiving only its blocks, blocks pulled by their receivers a few at a time, split
sizes that do not fit failing the call alike on every rank, and what a peer's stream may not
say."""

import numpy as np
import pytest

from fabric import Fabric
from overcast.errors import InvalidArgumentError, Rejected
from overcast.protocols.base import Descriptor
from overcast.protocols.pairwise import PULL_AHEAD, PairwiseAllToAll
from overcast.wire.header import Header, Kind
from overcast.wire.runs import Run

FRAME = 16


def matrix(world, seed):
    """Bytes rank s sends rank d: uneven, some empty (the diagonal too, now and then)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 5 * FRAME, (world, world))
    sizes[rng.random((world, world)) < 0.25] = 0
    return sizes


def block(src, dst, n):
    return ((np.arange(n) * 3 + src * 17 + dst * 101) % 251).astype(np.uint8)


def exchange(fabric, sizes, seq=0, vectors=None, frame=FRAME):
    """Every rank's all_to_all of `sizes` (rows of a byte, frames of `frame`), each rank telling
    its own sizes, or what `vectors` says it tells (None: its own do not fit)."""
    world = fabric.world
    colls = []
    for r in range(world):
        told = [int(n) for n in sizes[r]] + [int(n) for n in sizes[:, r]] \
            if vectors is None else vectors[r]
        send, recv = (told or [0] * 2 * world)[:world], (told or [0] * 2 * world)[world:]
        desc = Descriptor("all_to_all", "pairwise", np.dtype(np.uint8), 1)
        inp = np.concatenate([block(r, d, send[d]) for d in range(world)] +
                             [np.empty(0, np.uint8)])
        coll = PairwiseAllToAll(seq, r, world, desc, np.full(sum(recv), 255, np.uint8), inp,
                                told, f"rank {r}'s own", 1, frame)
        colls.append(coll)
        fabric.post(r, coll)
    return colls


def data_bytes(fabric):
    """Bytes of A2A_DATA that went from each rank to each other."""
    moved = {}
    for hdr, payload, _ in fabric.seen:
        if hdr.kind == Kind.A2A_DATA:
            moved[(hdr.src, hdr.dst)] = moved.get((hdr.src, hdr.dst), 0) + len(payload)
    return moved


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
    assert data_bytes(fabric) == {(s, d): int(sizes[s, d]) for s in range(world)
                                  for d in range(world) if s != d and sizes[s, d]}


def test_a_receiver_pulls_a_few_blocks_at_a_time_in_turn():
    """Rank 0 of 5, blocks of PULL_AHEAD / 2 from everyone: it pulls ranks 4 and 3 first (two
    blocks are what it keeps pulled and not yet arrived), then 2 once a frame (a quarter
    block) of theirs is in, then 1 once four more are."""
    world, n = 5, PULL_AHEAD // 2
    fabric = Fabric(world)
    colls = exchange(fabric, np.full((world, world), n), frame=n // 4)
    fabric._collect()
    for src in range(world):  # every DESCRIBE first: every rank has every rank's sizes
        for dst in range(world):
            deliver_all(fabric, src, dst)
    pulled = []
    while fabric.step():  # each pull, and the frames that had come when it went
        pulls = [h.dst for h, _, _ in fabric.seen if h.kind == Kind.A2A_PULL and h.src == 0]
        pulled += [(dst, sum(colls[0].arrived)) for dst in pulls[len(pulled):]]
    assert colls[0].done
    assert {p for p, _ in pulled[:2]} == {4, 3} and pulled[2:] == [(2, 1), (1, 5)], pulled


@pytest.mark.parametrize("case", ["own sizes", "disagree"])
@pytest.mark.parametrize("seed", range(8))
def test_sizes_that_do_not_fit_fail_the_call_alike_on_every_rank(case, seed):
    """Rank 1's sizes do not fit its buffers, or rank 2 expects from rank 0 another count
    than rank 0 sends it (while ranks 0 and 1 agree, and move their blocks): every rank's call
    fails with the same words (rank 1 alone adds its own sizes), whatever was under way when
    it found them wrong, and the next call runs."""
    world = 3
    sizes = np.full((world, world), 4 * FRAME)
    fabric = Fabric(world, seed=seed)
    vectors = [[4 * FRAME] * 6 for _ in range(world)]
    if case == "own sizes":
        vectors[1] = None
        expect = "all_to_all: rank 1's split sizes do not divide its input and output rows " \
                 "among 3 ranks"
    else:
        vectors[2][3] = 5
        expect = "all_to_all: rank 0 sends 64 rows to rank 2, whose output split sizes expect 5"
    colls = exchange(fabric, sizes, vectors=vectors)
    fabric.run()
    for r, coll in enumerate(colls):
        assert isinstance(coll.error, InvalidArgumentError), coll.error
        said = str(coll.error)
        assert said.startswith(expect), said
        assert ("(here: rank 1's own)" in said) == (case == "own sizes" and r == 1), said
    after = exchange(fabric, sizes, seq=1)
    fabric.run()
    assert all(c.done and c.error is None for c in after)
    assert all(s.error is None for s in fabric.sessions)


def deliver_all(fabric, src, dst):
    """Hand rank dst what rank src has sent it so far, by hand (dst may be silent)."""
    queue = fabric.streams[(src, dst)]
    while queue:
        fabric.sessions[dst].receive_run(Run.one(*queue.popleft()), fabric.now, False)


def test_a_rank_that_finds_the_sizes_wrong_first_leaves_no_peer_waiting():
    """Rank 2 expects from rank 0 another count than rank 0 sends it; rank 1 is the first to
    have every rank's sizes, before its own DESCRIBE has left: that still goes (the others need
    its sizes to find the same), and the communicator goes on."""
    world = 3
    sizes = np.full((world, world), 4 * FRAME)
    vectors = [[4 * FRAME] * 6 for _ in range(world)]
    vectors[2][3] = 5
    fabric = Fabric(world)
    fabric.silent.add(1)  # what it queues stays with it
    colls = exchange(fabric, sizes, vectors=vectors)
    fabric._collect()
    deliver_all(fabric, 0, 1)
    deliver_all(fabric, 2, 1)  # rank 1 has every rank's sizes, and they are wrong
    assert isinstance(colls[1].error, InvalidArgumentError)
    assert any(m.kind == Kind.DESCRIBE for _, m in fabric.sessions[1].control)
    fabric.silent.discard(1)
    fabric.run()
    for coll in colls:
        assert isinstance(coll.error, InvalidArgumentError), coll.error
    assert all(s.error is None for s in fabric.sessions)


def inject(fabric, src, dst, kind, chunk, body):
    hdr = Header(kind, 0, 0, 0, src, dst, chunk, len(body), 0)
    fabric.streams[(src, dst)].append((hdr, body))


# rank 0's: 32 rows to rank 1, 16 from it
def described(vector):
    """A DESCRIBE of the exchange in `exchange` that tells these split sizes."""
    return Descriptor("all_to_all", "pairwise", np.dtype(np.uint8), 1).pack() + \
        np.array(vector, "<i8").tobytes()


# rank 0's: 32 rows to rank 1, 16 from it
SIZES = described([0, 2 * FRAME, 0, 0, FRAME, 0])


@pytest.mark.parametrize("case,reason", [("described twice", "duplicate"),
                                         ("sizes malformed", "malformed"),
                                         ("pull twice", "out_of_range"),
                                         ("frame out of turn", "out_of_range"),
                                         ("frame too long", "wrong_length"),
                                         ("frame from a rank with nothing to send",
                                          "out_of_range")])
def test_what_a_peer_may_not_send_aborts(case, reason):
    """Rank 0's messages to rank 1 are made by hand; rank 1 sends rank 0 a block too."""
    sizes = np.array([[0, 2 * FRAME, 0], [FRAME, 0, 0], [0, 0, 0]])
    fabric = Fabric(3)
    fabric.silent.add(0)
    colls = exchange(fabric, sizes)
    sent = {"described twice": [(Kind.DESCRIBE, 0, SIZES)] * 2,
            "sizes malformed": [(Kind.DESCRIBE, 0, SIZES[:-1])],
            "pull twice": [(Kind.DESCRIBE, 0, SIZES)] + [(Kind.A2A_PULL, 0, b"")] * 2,
            "frame out of turn": [(Kind.DESCRIBE, 0, SIZES), (Kind.A2A_DATA, 1, b"z" * FRAME)],
            "frame too long": [(Kind.DESCRIBE, 0, SIZES), (Kind.A2A_DATA, 0, b"z" * 17)]}
    if case == "frame from a rank with nothing to send":
        fabric.silent.add(2)
        inject(fabric, 2, 1, Kind.A2A_DATA, 0, b"z")
    for kind, chunk, body in sent.get(case, ()):
        inject(fabric, 0, 1, kind, chunk, body)
    fabric.run()
    assert isinstance(colls[1].error, Rejected) and colls[1].error.reason == reason, \
        colls[1].error
