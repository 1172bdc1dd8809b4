"""Batches on the datagram path, over real loopback sockets: several datagrams sent in one call
(UDP GSO) arrive each whole and authentic, read in one call where the kernel coalesced them
(UDP GRO); a batch of one, a read cut short, and a forged datagram inside a batch (the others
are still taken)."""

from __future__ import annotations

import os
import selectors
import socket

import numpy as np
import pytest

from overcast.protocols.budget import LinkBudget
from overcast.protocols.base import Outgoing
from overcast.transport.datagram import BATCH_SECONDS, GSO_MAX_BYTES, MAX_BATCH, MIN_BATCH, \
    REDUCTION_BATCH_SECONDS, Datagrams, pace_batch, reduction_batch, seal_batches
from overcast.wire.auth import Drops, Opener, Sealer, sealed_bytes
from overcast.wire.header import Kind

KEY, JOB, COMM = os.urandom(16), 7, 9
CHUNK = 8000


def pair(read_bytes: int | None = None):
    """A sender (rank 0) and a receiver (rank 1) on loopback, and the receiver's address."""
    socks = []
    for _ in range(2):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    drops = Drops()
    sender = Datagrams(socks[0], Opener(KEY, JOB, COMM, Drops()), 0, {})
    kw = {} if read_bytes is None else {"read_bytes": read_bytes}
    receiver = Datagrams(socks[1], Opener(KEY, JOB, COMM, drops), 1, {}, **kw)
    return sender, receiver, socks[1].getsockname(), drops


def batch(chunks: list[np.ndarray], first: int = 0) -> tuple[bytearray, int]:
    """The chunks sealed back to back, as the engine lays out a batch; and the segment size."""
    sealer = Sealer(KEY, JOB, COMM, 0)
    size = sealed_bytes(chunks[0])
    buf = bytearray(sum(sealed_bytes(c) for c in chunks))
    end = 0
    for i, c in enumerate(chunks):
        end = sealer.seal_into(buf, end, Kind.MCAST_DATA, 1, 1, first + i, c)
    return buf, size


def chunks(count: int, last: int = CHUNK) -> list[np.ndarray]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 256, CHUNK if i < count - 1 else last, dtype=np.uint8)
            for i in range(count)]


def receive_all(receiver: Datagrams, expected: int, runs: list | None = None) \
        -> list[tuple[int, bytes]]:
    """Read until `expected` messages came (each read waits for the socket to be readable);
    the chunks of each run handed on go to `runs`."""
    got = []

    def take(run):
        got.extend((hdr.chunk, bytes(payload)) for hdr, payload in run.messages())
        assert [bytes(row) for row in run.rows()] == [p for _, p in got[-len(run):]]
        if runs is not None:
            runs.append(list(run.chunks))

    with selectors.DefaultSelector() as sel:
        sel.register(receiver, selectors.EVENT_READ)
        while len(got) < expected and sel.select(timeout=5):
            receiver.read(take)
    return got


@pytest.mark.parametrize("count,last", [(5, CHUNK), (5, 1234), (1, 77), (7, CHUNK)])
def test_a_batch_arrives_whole_each_datagram_authentic(count, last):
    sender, receiver, address, drops = pair()
    data = chunks(count, last)
    buf, size = batch(data)
    sender.send(memoryview(buf), address, size)
    runs = []
    got = receive_all(receiver, count, runs)
    assert [c for c, _ in got] == list(range(count))
    assert [p for _, p in got] == [d.tobytes() for d in data]
    assert sender.datagrams_out == count and sender.sends == 1  # one call for the batch
    if receiver.gro and receiver.reads == 1:
        # coalesced into one read: one run, but a shorter last datagram runs on its own
        assert runs == ([list(range(count))] if last == CHUNK or count == 1
                        else [list(range(count - 1)), [count - 1]])
    if receiver.gro and count > 1:
        assert receiver.reads < count  # coalesced: fewer reads than datagrams
    assert sum(drops.values()) == 0


def test_a_read_cut_short_keeps_the_whole_datagrams_and_counts_the_cut():
    """A receive buffer of two and a half datagrams: the kernel cuts the coalesced read; the
    two whole ones are taken, the cut one is counted, nothing is misread."""
    sender, receiver, address, drops = pair(read_bytes=sealed_bytes(b"x" * CHUNK) * 5 // 2)
    if not receiver.gro:
        pytest.skip("this kernel does not coalesce UDP datagrams (no UDP_GRO)")
    data = chunks(4)
    buf, size = batch(data)
    sender.send(memoryview(buf), address, size)
    got = receive_all(receiver, 2)
    assert [p for _, p in got] == [d.tobytes() for d in data[:2]]
    assert receiver.truncated == 1 and drops["truncated"] == 1
    assert drops["malformed"] == 0 and drops["bad_mac"] == 0


def test_a_forged_datagram_inside_a_batch_costs_only_itself():
    sender, receiver, address, drops = pair()
    data = chunks(5)
    buf, size = batch(data)
    buf[2 * size + size // 2] ^= 0x40  # a bit of the third datagram's payload
    sender.send(memoryview(buf), address, size)
    runs = []
    got = receive_all(receiver, 4, runs)
    assert [c for c, _ in got] == [0, 1, 3, 4]
    assert [p for _, p in got] == [data[i].tobytes() for i in (0, 1, 3, 4)]
    assert drops["bad_mac"] == 1
    if receiver.gro and receiver.reads == 1:
        assert runs == [[0, 1], [3, 4]]  # the forged one ends a run: the rest go on


PORT = 47000
OVER_MTU = 9500  # a datagram the emulated links' 9000-byte MTU cannot carry whole


def refused_batch(rank):
    """Rank 1 listens and says so; rank 0 sends a batch the kernel refuses to segment (each
    datagram exceeds the device's MTU: EINVAL), so it goes one datagram at a time (each
    fragmented by IP, as this socket allows)."""
    from overcast.cluster.netns import host_address
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host_address(rank), PORT))
    me = Datagrams(sock, Opener(KEY, JOB, COMM, Drops()), rank, {})
    peer = (host_address(1 - rank), PORT)
    data = [np.full(OVER_MTU, i, np.uint8) for i in range(5)]
    if rank == 1:
        got = []
        with selectors.DefaultSelector() as sel:
            sel.register(me, selectors.EVENT_READ)
            while len(got) < 5:
                me.send(b"ready", peer)
                if sel.select(timeout=0.2):
                    me.read(lambda run: got.extend(bytes(p) for _, p in run.messages()))
        return [p == d.tobytes() for p, d in zip(got, data)]
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        assert sel.select(timeout=30), "rank 1 never said it was ready"
    buf, size = batch(data)
    me.send(memoryview(buf), peer, size)
    return [me.gso, me.sends, me.datagrams_out]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_batch_the_kernel_refuses_to_segment_goes_one_datagram_at_a_time():
    from overcast.cluster.netns import Cluster
    with Cluster(2, 1_000_000_000, service=False) as cluster:
        sender, receiver = cluster.run(refused_batch, timeout=60)
    assert sender == [False, 1 + 5, 5]  # the refused GSO call, then five sends
    assert receiver == [True] * 5


def test_a_paced_batch_is_a_time_on_the_link_and_the_budget_holds_two():
    frame = 9014
    rates = [r * 1e6 / 8 for r in (10, 100, 400, 800, 10_000, 100_000)]
    batches = [pace_batch(rate, frame) for rate in rates]
    per_send = GSO_MAX_BYTES // frame  # datagrams in one GSO send
    assert batches[:2] == [MIN_BATCH, MIN_BATCH] and batches == sorted(batches)
    assert MAX_BATCH - per_send < batches[-1] <= MAX_BATCH
    assert all(b % per_send == 0 for b in batches[2:])  # whole sends, once more than one
    assert abs(batches[2] * frame / rates[2] - BATCH_SECONDS) < per_send * frame / rates[2] / 2
    assert pace_batch(None, frame) == MIN_BATCH
    slow = LinkBudget(rates[1], batch=batches[1], datagram_bytes=frame)
    assert slow.burst == 2 * batches[1] * frame > rates[1] * 0.005
    fast = LinkBudget(rates[3], batch=batches[3], datagram_bytes=frame)
    assert fast.burst >= 2 * batches[3] * frame
    # contributions: REDUCTION_BATCH_SECONDS on the link, up to two whole sends, never fewer
    # than a multicast batch
    reductions = [reduction_batch(rate, frame) for rate in rates]
    assert reductions == [MIN_BATCH, 2 * per_send, 2 * per_send] + batches[3:]
    assert abs(reductions[1] * frame / rates[1] - REDUCTION_BATCH_SECONDS) < \
        per_send * frame / rates[1] / 2
    budget = LinkBudget(rates[1], batch=batches[1], datagram_bytes=frame,
                        reduction_batch=reductions[1])
    assert (budget.batch, budget.reduction_batch) == (batches[1], reductions[1])
    assert budget.burst == 2 * reductions[1] * frame


def test_messages_are_sealed_into_whole_sends():
    """Datagrams of 8,952 bytes: seven fit one GSO send. A shorter one may end a send; the one
    after it starts the next."""
    lengths = [8900] * 16 + [100] + [8900] * 2
    messages = [Outgoing(Kind.MCAST_DATA, 1, g, np.full(n, g, np.uint8), 1)
                for g, n in enumerate(lengths)]
    opener, windows, got, counts = Opener(KEY, JOB, COMM, Drops()), {}, [], []
    buf = bytearray(2 * GSO_MAX_BYTES)
    for view, size in seal_batches(Sealer(KEY, JOB, COMM, 0), messages, buf):
        assert len(view) <= GSO_MAX_BYTES
        counts.append(-(-len(view) // size))
        for start in range(0, len(view), size):
            hdr, payload = opener.open(view[start:start + size], windows=windows,
                                       window_width=64)
            got.append((hdr.chunk, bytes(payload)))
    assert counts == [7, 7, 3, 2]
    assert got == [(g, bytes([g]) * n) for g, n in enumerate(lengths)]
