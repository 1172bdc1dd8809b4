"""Point-to-point transfers, sans I/O, on the in-memory fabric: tags, order per (sender, tag),
a recv from any rank, sizes that differ, messages to oneself, two ranks that send before they
receive, peers that close or vanish, timeouts, and what a peer's stream may not say."""

import numpy as np
import pytest

from fabric import Fabric
from overcast.errors import (CollectiveTimeoutError, InvalidArgumentError, OvercastError,
                             PeerFailureError, ProtocolError, Rejected)
from overcast.protocols.base import STREAM, Descriptor
from overcast.protocols.p2p import OFFERS_HELD, ORDER_TAG, Transfer
from overcast.protocols.ring import RingAllGather
from overcast.wire.header import Header, Kind

FRAME = 64


def send(fabric, rank, dst, data, tag=0):
    op = Transfer("send", rank, dst, tag, np.frombuffer(bytes(data), np.uint8), FRAME)
    fabric.sessions[rank].transfer(op, fabric.now)
    return op


def recv(fabric, rank, src, nbytes, tag=0):
    op = Transfer("recv", rank, src, tag, np.zeros(nbytes, np.uint8), FRAME)
    fabric.sessions[rank].transfer(op, fabric.now)
    return op


def offer_of(tag, nbytes):
    """An OFFER's payload: the tag, then the message's bytes."""
    return np.array([tag], "<u4").tobytes() + np.array([nbytes], "<u8").tobytes()


def payload(n, seed):
    return ((np.arange(n) * 7 + seed * 31) % 251).astype(np.uint8).tobytes()


@pytest.mark.parametrize("seed", range(8))
def test_tags_keep_their_own_order_and_any_source_takes_the_first_offer(seed):
    """Rank 0 sends A (tag 1), B (tag 2), C (tag 1) to rank 1, which takes tag 2 first, then
    tag 1 twice: B, A, C. Ranks 2 and 3 each send one message with tag 5 to rank 1, whose two
    recvs from any rank take them, each knowing its sender. A rank sends to itself. Messages of
    several frames, of one byte and of none arrive whole."""
    fabric = Fabric(4, seed=seed)
    sizes = {"A": 1000, "B": 1, "C": 0}
    sent = [send(fabric, 0, 1, payload(sizes[n], i), tag) for i, (n, tag) in
            enumerate([("A", 1), ("B", 2), ("C", 1)])]
    others = [send(fabric, r, 1, payload(300, r), tag=5) for r in (2, 3)]
    mine = send(fabric, 3, 3, payload(77, 9), tag=4)
    fabric.run()
    got = [recv(fabric, 1, 0, 1, tag=2), recv(fabric, 1, 0, 1000, tag=1),
           recv(fabric, 1, 0, 0, tag=1), recv(fabric, 1, None, 300, tag=5),
           recv(fabric, 1, None, 300, tag=5), recv(fabric, 3, 3, 77, tag=4)]
    fabric.run()
    for op in sent + others + [mine] + got:
        assert op.done and op.error is None, (op, op.error)
    assert [bytes(g.buffer) for g in got[:3]] == [payload(1, 1), payload(1000, 0), b""]
    for g in got[3:5]:
        assert g.source in (2, 3) and bytes(g.buffer) == payload(300, g.source)
    assert {got[3].source, got[4].source} == {2, 3}
    assert got[5].source == 3 and bytes(got[5].buffer) == payload(77, 9)


def test_two_ranks_that_each_send_before_they_receive_both_complete():
    """Each offers its message; each takes the other's once its recv is posted."""
    fabric = Fabric(2)
    sends = [send(fabric, r, 1 - r, payload(5000, r)) for r in range(2)]
    fabric.run()
    recvs = [recv(fabric, r, 1 - r, 5000) for r in range(2)]
    fabric.run()
    for r in range(2):
        assert sends[r].done and recvs[r].done
        assert bytes(recvs[r].buffer) == payload(5000, 1 - r)


def test_an_answer_goes_ahead_of_the_data_going_out():
    """Rank 0 has a large message's frames queued for rank 1 when rank 1 offers one back: rank
    0's ACCEPT leaves before them, so the two move at once, not one after the other."""
    fabric = Fabric(2)
    big = send(fabric, 0, 1, payload(50 * FRAME, 0))
    recv(fabric, 1, 0, 50 * FRAME)
    recv(fabric, 0, 1, 10)
    session = fabric.sessions[0]
    while big.state != "sending":  # until rank 1's ACCEPT has come: the frames are queued
        assert fabric.step()
    offer = offer_of(0, 10)
    session.receive(Header(Kind.P2P_OFFER, 0, 0, 0, 1, 0, 0, len(offer), 0), memoryview(offer),
                    fabric.now, False)
    assert session.pop((STREAM, 1)).kind == Kind.P2P_ACCEPT
    assert session.pop((STREAM, 1)).kind == Kind.P2P_DATA


def test_sizes_that_differ_fail_the_recv_and_the_send_naming_both():
    fabric = Fabric(2)
    out = send(fabric, 0, 1, payload(100, 0), tag=3)
    into = recv(fabric, 1, 0, 80, tag=3)
    fabric.run()
    for op in (out, into):
        assert isinstance(op.error, InvalidArgumentError), op.error
        assert "rank 0 sent 100 B with tag 3 to rank 1, whose recv takes 80 B" in str(op.error)
    after = [send(fabric, 0, 1, payload(8, 1), tag=3), recv(fabric, 1, 0, 8, tag=3)]
    fabric.run()
    assert all(op.done for op in after) and bytes(after[1].buffer) == payload(8, 1)


def test_transfers_with_a_peer_that_closes_or_vanishes_fail_and_the_rest_go_on():
    fabric = Fabric(3)
    waiting = [recv(fabric, 0, 1, 10), send(fabric, 0, 1, b"x" * 10)]
    anyone = recv(fabric, 0, None, 4, tag=8)
    fabric.sessions[1].close()
    fabric.run()
    for op in waiting:
        assert isinstance(op.error, PeerFailureError) and "rank 1 closed" in str(op.error)
    assert anyone.state == "posted"  # rank 2 may still send it
    later = send(fabric, 0, 1, b"y")
    assert isinstance(later.error, PeerFailureError)
    send(fabric, 2, 0, b"abcd", tag=8)
    fabric.run()
    assert anyone.done and anyone.source == 2
    left = recv(fabric, 0, 2, 4)
    fabric.sessions[0].peer_lost(2)
    assert isinstance(left.error, PeerFailureError) and "rank 2" in str(left.error)


def test_a_recv_no_one_sends_to_times_out_naming_what_it_waits_for():
    fabric = Fabric(2, timeout=5.0)
    op = recv(fabric, 0, 1, 10, tag=6)
    fabric.advance(4.9)
    assert op.error is None
    fabric.advance(0.1)
    fabric.run()
    assert isinstance(op.error, CollectiveTimeoutError), op.error
    assert "recv of 10 B from rank 1 (tag 6)" in str(op.error)
    assert "rank 1 to send with tag 6" in str(op.error)
    assert fabric.sessions[1].error is not None  # every rank is told


def test_a_copied_send_waits_for_its_receiver_without_a_timeout():
    """A copied send has told its caller it is done: no recv for it within the timeout fails
    nothing (the receiver's recv has the timeout); a recv posted long after takes it whole."""
    fabric = Fabric(2, timeout=5.0)
    data = payload(3000, 4)
    op = Transfer("send", 0, 1, 3, np.frombuffer(data, np.uint8).copy(), FRAME, copied=True)
    fabric.sessions[0].transfer(op, fabric.now)
    fabric.run()
    fabric.advance(60.0)
    fabric.run()
    assert op.error is None and not op.done
    assert all(session.error is None for session in fabric.sessions)
    late = recv(fabric, 1, 0, 3000, tag=3)
    fabric.run()
    assert op.done and late.done and bytes(late.buffer) == data


def test_a_transfer_with_a_label_is_named_by_it_when_it_times_out():
    fabric = Fabric(2, timeout=5.0)
    op = Transfer("recv", 0, 1, ORDER_TAG, np.zeros(8, np.uint8), FRAME,
                  label="rank 0's wait for its next call", awaited="rank 1 to make it")
    fabric.sessions[0].transfer(op, fabric.now)
    fabric.advance(5.0)
    fabric.run()
    assert str(op.error) == ("rank 0's wait for its next call on rank 0 made no progress for "
                             "5.0 s; waiting for rank 1 to make it")


def test_order_words_past_offers_held_say_how_many_calls_the_rank_is_behind():
    """Rank 0's order of calls (ORDER_TAG, copied) far ahead of rank 1: the communicator fails
    naming the calls, not sends the user never made."""
    fabric = Fabric(2)
    for _ in range(OFFERS_HELD + 1):
        op = Transfer("send", 0, 1, ORDER_TAG, np.zeros(8, np.uint8), FRAME, copied=True)
        fabric.sessions[0].transfer(op, fabric.now)
    fabric.run()
    assert str(fabric.sessions[1].error) == (
        f"rank 0 has made {OFFERS_HELD + 1:,} calls in the group that rank 1 has not made yet: "
        f"past {OFFERS_HELD:,}, the group fails (a rank may not fall that far behind; wait on "
        f"the calls' Works sooner)")


def inject(fabric, src, dst, kind, seq, chunk, body):
    """A message rank `src` sends on its stream to `dst`, made by hand."""
    hdr = Header(kind, 0, 0, seq, src, dst, chunk, len(body), 0)
    fabric.streams[(src, dst)].append((hdr, body))


@pytest.mark.parametrize("case,reason", [
    ("answer to nothing", "out_of_range"), ("offer out of turn", "out_of_range"),
    ("offer malformed", "malformed"), ("data of no message", "out_of_range"),
    ("frame out of turn", "out_of_range"), ("data past the end", "wrong_length"),
])
def test_what_a_peer_may_not_say_on_its_stream_aborts(case, reason):
    """A stream is authenticated and in order: a message that does not fit is evidence, and
    the communicator aborts on every rank with a ProtocolError naming it."""
    fabric = Fabric(2)
    into = recv(fabric, 1, 0, 100)
    offer = offer_of(0, 100)
    if case == "answer to nothing":
        inject(fabric, 0, 1, Kind.P2P_ACCEPT, 0, 0, b"")
    elif case == "offer out of turn":
        inject(fabric, 0, 1, Kind.P2P_OFFER, 5, 0, offer)
    elif case == "offer malformed":
        inject(fabric, 0, 1, Kind.P2P_OFFER, 0, 0, offer[:-1])
    elif case == "data of no message":
        inject(fabric, 0, 1, Kind.P2P_DATA, 0, 0, b"z" * 10)
    else:
        send(fabric, 0, 1, payload(100, 0))
        while into.state != "receiving":
            assert fabric.step()
        fabric.silent.add(0)  # its data never comes: what does is made by hand
        chunk, body = (1, b"z" * 10) if case == "frame out of turn" else (0, b"z" * 101)
        inject(fabric, 0, 1, Kind.P2P_DATA, 0, chunk, body)
    fabric.run()
    assert isinstance(into.error, Rejected) and into.error.reason == reason, into.error
    if 0 not in fabric.silent:
        assert isinstance(fabric.sessions[0].error, ProtocolError)


def test_a_recv_is_served_while_messages_for_later_collectives_are_held():
    """Rank 0 runs ahead in collectives rank 1 has not posted, then sends: rank 1 holds what
    came for the collectives and serves its recv from rank 0 (or from anyone) all the same."""
    for src in (0, None):
        fabric = Fabric(2)
        for seq in range(3):
            desc = Descriptor("all_gather", "ring", np.dtype(np.uint8), 600)
            fabric.post(0, RingAllGather(seq, 0, 2, desc, np.empty(1200, np.uint8),
                                         np.zeros(600, np.uint8), 64))
        out = send(fabric, 0, 1, payload(30, 0))
        fabric.run()
        into = recv(fabric, 1, src, 30)
        fabric.run()
        assert out.done and into.done and bytes(into.buffer) == payload(30, 0)
        assert len(fabric.sessions[1].early) == 3


def test_a_peer_that_offers_without_end_fails_the_communicator_naming_it():
    """Past OFFERS_HELD offers waiting for a recv, the communicator fails on both ranks, naming
    the rank that sent them; the sends fail with it."""
    fabric = Fabric(2)
    sends = [send(fabric, 0, 1, b"", tag=1) for _ in range(OFFERS_HELD + 1)]
    fabric.run()
    error = fabric.sessions[1].error
    assert type(error) is OvercastError
    assert str(error) == (f"rank 0 sent rank 1 more than {OFFERS_HELD} messages that no recv on "
                          f"rank 1 has taken: past that many held, the communicator fails "
                          f"(rank 1 must post recvs for them sooner)")
    assert str(fabric.sessions[0].error) == f"{error} (reported by rank 1)"
    assert all(str(op.error) == f"{error} (reported by rank 1)" for op in sends)
    assert fabric.sessions[1].p2p.offers_held(0) == 0
