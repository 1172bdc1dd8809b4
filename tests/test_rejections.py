"""Every rejection path, sans I/O: each message that does not fit a protocol's table (kind,
sender, phase) or its state (range, length, format) is one named reason. From a datagram it is
dropped and counted, and the collective still finishes bit-exact; from a peer's authenticated
stream it is ProtocolError on every rank. The aggregator drops and counts, never raises."""

import numpy as np
import pytest

from fabric import Fabric
from overcast.buffers import dtype_code
from overcast.errors import (CollectiveMismatchError, CollectiveTimeoutError,
                             CommunicatorClosedError, InvalidArgumentError, OvercastError,
                             PeerFailureError, ProtocolError, Rejected, error_class)
from overcast.protocols.base import Descriptor, Phase
from overcast.protocols.budget import LinkBudget
from overcast.protocols.multicast import MulticastGather
from overcast.protocols.ring import RingAllGather
from overcast.protocols.session import DATAGRAM_KINDS
from overcast.aggregator.reduction import Aggregator
from overcast.wire.header import AGGREGATOR, ANY, Header, Kind
from overcast.wire.runs import Run
from overcast.wire.messages import (pack_abort, pack_acks, pack_contribution_prefix,
                                    pack_credit, pack_goodbye, pack_ranges, unpack_credit)
from test_mismatch import U8, WORLD, all_gather, broadcast, reduce_scatter

F32 = np.dtype(np.float32)
CHUNK_BYTES = 64
CONTRIBUTION = pack_contribution_prefix(dtype_code(F32), 1, WORLD, 28) + bytes(64)


def ring(seq, rank, n=128):
    desc = Descriptor("all_gather", "ring", U8, n)
    return RingAllGather(seq, rank, WORLD, desc, np.empty(WORLD * n, np.uint8),
                         np.full(n, rank, np.uint8), frame_bytes=CHUNK_BYTES)


MAKERS = {
    "all_gather": lambda r: all_gather(0, r),             # 2 chunks of 64 B per root
    "all_gather in chains": lambda r: all_gather(0, r, roots=2),  # chains [0, 1], [2, 3]
    "broadcast": lambda r: broadcast(0, r),                # root 0, 5 chunks
    "reduce_scatter": lambda r: reduce_scatter(0, r),      # 28 chunks, rank 1 owns g % 4 == 1
    "ring": lambda r: ring(0, r),                          # 6 frames of 64 B to receive
}


def expected(name, rank):
    if name.startswith("all_gather") or name == "ring":
        return np.repeat(np.arange(WORLD, dtype=np.uint8), 128)
    if name == "broadcast":
        return np.full(300, 7, np.uint8)
    return np.full(100, WORLD, np.float32)


def result(coll):
    return coll.buffer if hasattr(coll, "buffer") else coll.output


def start(name):
    fabric = Fabric(WORLD, aggregator=Aggregator())
    colls = [MAKERS[name](r) for r in range(WORLD)]
    for r, coll in enumerate(colls):
        fabric.post(r, coll)
    return fabric, colls


def inject(fabric, rank, kind, src, payload=b"", chunk=0, dst=None, datagram=None):
    """Give rank `rank` a message, by datagram if its kind goes so (unless told otherwise)."""
    hdr = Header(kind, 0, 0, 0, src, rank if dst is None else dst, chunk, len(payload), 0)
    datagram = kind in DATAGRAM_KINDS if datagram is None else datagram
    fabric.sessions[rank].receive(hdr, memoryview(payload), fabric.now, datagram)


# (collective, kind, src, chunk, payload, dst) -> the reason rank 1 drops it
DATAGRAMS = {
    "chunk of another root's segment": ("all_gather", Kind.MCAST_DATA, 0, 5, bytes(64), None,
                                        "out_of_range"),
    "chunk of the wrong length": ("all_gather", Kind.MCAST_DATA, 0, 0, bytes(10), None,
                                  "wrong_length"),
    "chunk for another rank": ("all_gather", Kind.MCAST_DATA, 0, 0, bytes(64), 2, "misdirected"),
    "chunk from a rank that is not the root": ("broadcast", Kind.MCAST_DATA, 2, 0, bytes(64),
                                               ANY, "wrong_sender"),
    "contribution replayed to a rank": ("reduce_scatter", Kind.CONTRIB, 0, 2, CONTRIBUTION,
                                        AGGREGATOR, "misdirected"),
    "contribution addressed to a rank": ("reduce_scatter", Kind.CONTRIB, 0, 2, CONTRIBUTION,
                                         None, "unexpected_kind"),
    "multicast chunk to an in-network reduction": ("reduce_scatter", Kind.MCAST_DATA, 0, 0,
                                                   bytes(64), ANY, "unexpected_kind"),
    "result from a rank": ("reduce_scatter", Kind.RESULT, 0, 1, bytes(64), None,
                           "wrong_sender"),
    "result for another rank's block": ("reduce_scatter", Kind.RESULT, AGGREGATOR, 2,
                                        bytes(64), None, "out_of_range"),
    "result past the last chunk": ("reduce_scatter", Kind.RESULT, AGGREGATOR, 29, bytes(64),
                                   None, "out_of_range"),
    "result of the wrong length": ("reduce_scatter", Kind.RESULT, AGGREGATOR, 1, bytes(10),
                                   None, "wrong_length"),
    "credit too short": ("reduce_scatter", Kind.CREDIT, AGGREGATOR, 0, bytes(3), ANY,
                         "malformed"),
    "credit with a torn resend list": ("reduce_scatter", Kind.CREDIT, AGGREGATOR, 0, bytes(6),
                                       None, "malformed"),
    "credit beyond the input": ("reduce_scatter", Kind.CREDIT, AGGREGATOR, 0, pack_credit(29),
                                ANY, "out_of_range"),
}


@pytest.mark.parametrize("case", list(DATAGRAMS) + ["a stream frame sent by datagram"])
def test_a_datagram_that_does_not_fit_is_dropped_and_counted(case):
    name, kind, src, chunk, payload, dst, reason = DATAGRAMS.get(case) or (
        "all_gather", Kind.FIN, 0, 0, b"", None, "wrong_channel")
    fabric, colls = start(name)
    inject(fabric, 1, kind, src, payload, chunk, dst, datagram=True)
    fabric.run_timed()
    assert fabric.sessions[1].drops == {reason: 1}
    for r, coll in enumerate(colls):
        assert coll.error is None and coll.done, (r, coll.error)
        assert result(coll).tobytes() == expected(name, r).tobytes()


# (collective, [(kind, src, chunk, payload, dst), ...]) -> the reason rank 1 aborts with;
# described(rest) stands for the collective's own descriptor followed by rest (an end-of-multicast
# notice and a repair request open with their sender's)
def described(rest=b""):
    return ("described", rest)


STREAMS = {
    "activation from a rank not before it in its chain": (
        "all_gather in chains", [(Kind.ACTIVATE, 2, 0, b"", None)], "wrong_sender"),
    "activation twice": (
        "all_gather in chains", [(Kind.ACTIVATE, 0, 0, b"", None)] * 2, "wrong_phase"),
    "FIN twice": ("all_gather", [(Kind.FIN, 0, 0, b"", None)] * 2, "duplicate"),
    "FIN from a rank that is not the predecessor": (
        "all_gather", [(Kind.FIN, 3, 0, b"", None)], "wrong_sender"),
    "repair request from a rank that is not the predecessor": (
        "all_gather", [(Kind.REPAIR_REQUEST, 3, 0, described(pack_ranges([(0, 1)])), None)],
        "wrong_sender"),
    "torn repair request": ("all_gather", [(Kind.REPAIR_REQUEST, 0, 0, described(bytes(5)),
                                            None)], "malformed"),
    "empty repair request": ("all_gather", [(Kind.REPAIR_REQUEST, 0, 0, described(), None)],
                             "malformed"),
    "repair request without a descriptor": (
        "all_gather", [(Kind.REPAIR_REQUEST, 0, 0, pack_ranges([(0, 1)]), None)], "malformed"),
    "repair request across segments": (
        "all_gather", [(Kind.REPAIR_REQUEST, 0, 0, described(pack_ranges([(1, 2)])), None)],
        "out_of_range"),
    "repair request beyond the buffer": (
        "all_gather", [(Kind.REPAIR_REQUEST, 0, 0, described(pack_ranges([(7, 5)])), None)],
        "out_of_range"),
    "repair request of no chunks": (
        "all_gather", [(Kind.REPAIR_REQUEST, 0, 0, described(pack_ranges([(0, 0)])), None)],
        "out_of_range"),
    "repair data of the wrong length": (
        "all_gather", [(Kind.REPAIR_DATA, 2, 0, bytes(10), None)], "wrong_length"),
    "repair data past the buffer": (
        "all_gather", [(Kind.REPAIR_DATA, 2, 8, bytes(64), None)], "out_of_range"),
    "repair data from a rank that is not the successor": (
        "all_gather", [(Kind.REPAIR_DATA, 3, 0, bytes(64), None)], "wrong_sender"),
    "end-of-multicast from a rank that is not a root": (
        "broadcast", [(Kind.MCAST_END, 2, 0, described(), None)], "wrong_sender"),
    "end-of-multicast twice": ("all_gather", [(Kind.MCAST_END, 0, 0, described(), None)] * 2,
                               "duplicate"),
    "end-of-multicast without a descriptor": (
        "all_gather", [(Kind.MCAST_END, 0, 0, b"", None)], "malformed"),
    "ring frame to a multicast collective": (
        "all_gather", [(Kind.RING_DATA, 0, 0, bytes(64), None)], "unexpected_kind"),
    "ring frame from a rank that is not the predecessor": (
        "ring", [(Kind.RING_DATA, 2, 0, bytes(64), None)], "wrong_sender"),
    "ring frame beyond those expected": (
        "ring", [(Kind.RING_DATA, 0, 6, bytes(64), None)], "out_of_range"),
    "ring frame of the wrong length": (
        "ring", [(Kind.RING_DATA, 0, 0, bytes(10), None)], "wrong_length"),
    "stream frame for another rank": ("all_gather", [(Kind.FIN, 0, 0, b"", 2)], "misdirected"),
    "torn goodbye": ("all_gather", [(Kind.GOODBYE, 0, 0, bytes(3), None)], "malformed"),
}
# a peer sending on its stream what goes by datagram
STREAMS["a datagram kind on a stream"] = ("all_gather", [(Kind.MCAST_DATA, 0, 0, bytes(64),
                                                           None)], "wrong_channel")


@pytest.mark.parametrize("case", list(STREAMS))
def test_a_stream_frame_that_does_not_fit_is_a_protocol_error_on_every_rank(case):
    name, messages, reason = STREAMS[case]
    fabric, colls = start(name)
    for kind, src, chunk, payload, dst in messages:
        if isinstance(payload, tuple):
            payload = colls[1].desc.pack() + payload[1]
        inject(fabric, 1, kind, src, payload, chunk, dst, datagram=False)
    fabric.run_timed()
    error = colls[1].error
    assert isinstance(error, Rejected) and error.reason == reason, error
    assert "\n" not in str(error)
    for r, coll in enumerate(colls):
        assert isinstance(coll.error, ProtocolError), (r, coll.error)
        if r != 1:
            assert "(reported by rank 1)" in str(coll.error)
    assert not fabric.sessions[1].drops


def test_a_ring_frame_after_every_frame_arrived_is_in_the_wrong_phase():
    fabric, colls = start("ring")
    for step in range(WORLD - 1):  # what rank 0 forwards to rank 1, before anyone moves
        for j in range(2):
            inject(fabric, 1, Kind.RING_DATA, 0, bytes(64), step * 2 + j)
    assert colls[1].phase is Phase.DRAINING  # its own frames are still queued
    inject(fabric, 1, Kind.RING_DATA, 0, bytes(64), 0)
    assert isinstance(colls[1].error, Rejected) and colls[1].error.reason == "wrong_phase"


def test_an_illegal_phase_change_is_a_bug_not_a_rejection():
    coll = all_gather(0, 1)
    with pytest.raises(RuntimeError, match="POSTED -> DONE is not a transition"):
        coll.enter(Phase.DONE)


@pytest.mark.parametrize("cls", [OvercastError, CollectiveMismatchError, ProtocolError,
                                 PeerFailureError, CollectiveTimeoutError,
                                 CommunicatorClosedError, InvalidArgumentError, Rejected])
def test_an_abort_carries_the_class_of_the_error_by_its_code(cls):
    error = cls("why")
    fabric, colls = start("all_gather")
    fabric.sessions[0].abort(error)
    fabric.run_timed()
    for coll in colls[1:]:
        assert type(coll.error) is (ProtocolError if cls is Rejected else cls), coll.error
        assert str(coll.error) == "why (reported by rank 0)"
    assert len({c.abort_code for c in (OvercastError, CollectiveMismatchError, ProtocolError,
                                       PeerFailureError, CollectiveTimeoutError,
                                       CommunicatorClosedError, InvalidArgumentError)}) == 7
    assert error_class(200) is OvercastError


def test_an_abort_without_a_code_is_still_an_error():
    fabric, colls = start("all_gather")
    inject(fabric, 1, Kind.ABORT, 0, b"")
    assert isinstance(colls[1].error, OvercastError)
    assert "an abort without a reason (reported by rank 0)" in str(colls[1].error)
    assert pack_abort(2, "x" * 5000)[1:] == b"x" * 4000


# --- the aggregator ----------------------------------------------------------------------------

def contribution(g, src, world=WORLD, total=8, elems=4, code=None, dst=AGGREGATOR,
                 kind=Kind.CONTRIB, seq=0):
    payload = pack_contribution_prefix(dtype_code(F32) if code is None else code, 1, world,
                                       total) + np.ones(elems, F32).tobytes()
    return Header(kind, 0, 0, seq, src, dst, g, len(payload), 0), payload


def message(kind, src, payload, g=0, seq=0, dst=AGGREGATOR):
    return Header(kind, 0, 0, seq, src, dst, g, len(payload), 0), payload


AGGREGATOR_CASES = {
    "an unregistered communicator": ("other", contribution(1, 0), "unregistered"),
    "a datagram for a rank": ("comm", contribution(1, 0, dst=1), "misdirected"),
    "a sender outside the world": ("comm", contribution(1, 9), "wrong_sender"),
    "a kind ranks never send it": ("comm", message(Kind.RESULT, 0, bytes(16)),
                                   "unexpected_kind"),
    "a contribution shorter than its prefix": ("comm", message(Kind.CONTRIB, 0, bytes(3)),
                                               "malformed"),
    "a contribution of an unknown dtype": ("comm", contribution(1, 0, code=250, seq=1),
                                           "malformed"),
    "a contribution for another world": ("comm", contribution(1, 0, world=5, total=10),
                                         "inconsistent"),
    "a contribution past the last chunk": ("comm", contribution(8, 0), "out_of_range"),
    "a contribution from the chunk's owner": ("comm", contribution(1, 1), "wrong_sender"),
    "a contribution beyond the window": ("comm", contribution(7, 0), "beyond_window"),
    "acknowledgements torn": ("comm", message(Kind.RESULT_ACK, 1, bytes(5)), "malformed"),
    "acknowledgements of no reduction": ("comm", message(Kind.RESULT_ACK, 1, pack_acks([1]),
                                                         seq=3), "stale"),
    "an acknowledgement of a chunk with no result": (
        "comm", message(Kind.RESULT_ACK, 1, pack_acks([1])), "stray_acks"),
    "a credit probe of the wrong length": ("comm", message(Kind.CREDIT, 1, pack_credit(0, [1])),
                                           "malformed"),
}


@pytest.mark.parametrize("case", list(AGGREGATOR_CASES))
def test_the_aggregator_drops_and_counts_what_does_not_fit(case):
    key, (hdr, payload), reason = AGGREGATOR_CASES[case]
    agg = Aggregator(slots=4)
    agg.register("comm", WORLD)
    # a reduction in flight, chunk 1 holding rank 0's contribution, so later ones meet state
    agg.receive("comm", *contribution(1, 0), 0.0)
    before = dict(agg.stats)
    agg.receive(key, hdr, memoryview(payload), 0.0)
    assert agg.drops == {reason: 1}
    assert dict(agg.stats) == before and not agg.outbox


def test_the_aggregator_drops_a_contribution_whose_length_differs_from_its_slot():
    agg = Aggregator(slots=4)
    agg.register("comm", WORLD)
    agg.receive("comm", *contribution(1, 0), 0.0)
    agg.receive("comm", *contribution(1, 2, elems=3), 0.0)
    assert agg.drops == {"wrong_length": 1}
    assert agg.stats["contributions"] == 1


def test_a_goodbye_carries_a_count():
    fabric, colls = start("all_gather")
    inject(fabric, 1, Kind.GOODBYE, 0, pack_goodbye(0))
    assert isinstance(colls[1].error, PeerFailureError)


def done_but_unverified():
    """Rank 1 of 3 with its multicast Broadcast from rank 0 done, waiting only for rank 2's
    DESCRIBE (rank 0's end-of-multicast notice carried rank 0's descriptor)."""
    fabric = Fabric(3)
    coll = MulticastGather(0, 1, 3, Descriptor("broadcast", "multicast", U8, 64, param=0),
                           np.empty(64, np.uint8), [(0, 0, 64)], source=None, roots=1,
                           chunk_bytes=CHUNK_BYTES, budget=LinkBudget(1e6))
    fabric.post(1, coll)
    inject(fabric, 1, Kind.MCAST_DATA, 0, bytes(64), 0, ANY)
    inject(fabric, 1, Kind.MCAST_END, 0, coll.desc.pack())
    inject(fabric, 1, Kind.FIN, 0)
    session = fabric.sessions[1]
    for route in list(session.pending_routes()):
        session.drain(route)
    assert coll.phase is Phase.DONE and coll in session.active.values()
    assert session.unverified[0] == {2}
    return fabric, session, coll


def test_a_repair_that_crossed_its_chunk_is_taken_after_done():
    fabric, session, coll = done_but_unverified()
    inject(fabric, 1, Kind.REPAIR_DATA, 2, bytes(64), 0)  # from rank 1's successor
    assert session.error is None and coll.stats["repaired_chunks"] == 0
    inject(fabric, 1, Kind.DESCRIBE, 2, coll.desc.pack())
    assert coll in session.finished and coll.error is None


@pytest.mark.parametrize("kind,rest", [(Kind.MCAST_END, b""),
                                       (Kind.REPAIR_REQUEST, pack_ranges([(0, 1)]))])
def test_an_all_gather_describes_itself_by_its_end_notices_only(kind, rest):
    """Every rank of a multicast AllGather ends its multicast with a notice to every other,
    which the AllGather waits for anyway: the notices carry the descriptor, no DESCRIBE is
    sent. A repair request, which may reach the successor before the notice, carries it too.
    Either naming another call fails it on every rank as a DESCRIBE would."""
    fabric, colls = start("all_gather")
    sent = [m for s in fabric.sessions for route in list(s.pending_routes())
            for m in s.drain(route)]
    assert sent and not [m for m in sent if m.kind == Kind.DESCRIBE]
    other = Descriptor("all_gather", "multicast", U8, 65, param=WORLD)
    inject(fabric, 1, kind, 0, other.pack() + rest)  # rank 0: a root, and rank 1's predecessor
    assert isinstance(colls[1].error, CollectiveMismatchError), colls[1].error
    fabric.run_timed()
    assert all(isinstance(c.error, CollectiveMismatchError) for c in colls), \
        [c.error for c in colls]


def test_an_abort_fails_a_collective_done_but_not_yet_verified():
    fabric, session, coll = done_but_unverified()
    session.abort(ProtocolError("broken"))
    assert coll in session.finished and isinstance(coll.error, ProtocolError)
    assert not session.active and session.get_timer() is None


def test_a_rejection_is_raised_again_from_its_message_as_work_wait_does():
    again = type(Rejected("frame 9 is beyond the 6 expected", "out_of_range"))("again")
    assert isinstance(again, ProtocolError) and str(again) == "again"


def run_of(messages):
    """Contributions laid back to back, as one read hands a run on."""
    first = messages[0][0]
    return Run(first, [hdr.chunk for hdr, _ in messages],
               memoryview(b"".join(p for _, p in messages)), 0, first.length)


def test_a_run_of_contributions_is_taken_as_its_messages_one_by_one_would_be():
    """Each rank sends its contributions to chunks 3, 5, 6 and 7 (owned by ranks 3, 1, 2 and
    3) as one run; the last two runs complete two slots each: one sum each, the same bits as
    one message at a time."""
    results = []
    for as_runs in (False, True):
        agg = Aggregator(slots=8)
        agg.register("comm", WORLD)
        for src in range(WORLD):
            messages = [contribution(g, src) for g in (3, 5, 6, 7) if g % WORLD != src]
            if as_runs:
                agg.receive_run("comm", run_of(messages), 0.0)
            else:
                for hdr, payload in messages:
                    agg.receive("comm", hdr, memoryview(payload), 0.0)
        assert not agg.drops and agg.stats["contributions"] == 4 * (WORLD - 1)
        results.append(sorted((msg.chunk, dst, bytes(msg.payload)) for _, dst, msg in agg.outbox
                              if msg.kind == Kind.RESULT))
    assert [(g, dst) for g, dst, _ in results[1]] == [(3, 3), (5, 1), (6, 2), (7, 3)]
    assert results[0] == results[1]
    assert all(np.frombuffer(p, F32).tolist() == [WORLD - 1] * 4 for _, _, p in results[1])


def test_a_run_whose_contributions_disagree_is_dropped_whole():
    agg = Aggregator(slots=8)
    agg.register("comm", WORLD)
    agg.receive_run("comm", run_of([contribution(1, 0), contribution(2, 0, world=5, total=10)]),
                    0.0)
    assert agg.drops == {"inconsistent": 2}
    assert not agg.stats["contributions"] and not agg.reductions("comm")


def test_a_credit_probe_past_the_last_chunk_is_answered_with_what_is_owed():
    """A keyed rank's probe may name any chunk as its next unsent one: what it is told to send
    again stops at the reduction's last chunk (the numbering has nothing past it)."""
    agg = Aggregator(slots=8)
    agg.register("comm", WORLD)
    agg.receive("comm", *contribution(1, 0), 0.0)  # 28 chunks, chunk 1 holding rank 0's
    agg.receive("comm", *message(Kind.CREDIT, 2, pack_credit((1 << 32) - 1)), 0.0)
    (_, dst, msg), = agg.outbox
    released, again = unpack_credit(msg.payload)
    assert dst == 2 and released == 0
    assert again == [g for g in range(8) if g % WORLD != 2]  # the window: 8 slots
    assert not agg.drops
