"""Batches on the datagram path, over real loopback sockets, through the rank's native plane:
several datagrams sent in one call (UDP GSO) arrive each whole and authentic, read in one call
where the kernel coalesced them (UDP GRO); a forged datagram among them costs only itself; a
batch the kernel will not segment goes one datagram at a time; batches end where GSO says."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from overcast.buffers import dtype_code
from overcast.limits import LOWEST_MTU
from overcast.native import _core
from overcast.protocols.base import Outgoing
from overcast.protocols.budget import LinkBudget
from overcast.transport.datagram import BATCH_SECONDS, GSO_MAX_BYTES, GSO_MAX_SEGMENTS, \
    MAX_BATCH, MIN_BATCH, REDUCTION_BATCH_SECONDS, chunk_bytes, pace_batch, reduction_batch
from overcast.wire.auth import Sealer
from overcast.wire.header import Kind, datagram_link_bytes
from overcast.wire.messages import CONTRIB_PREFIX

KEY, JOB, COMM = os.urandom(16), 7, 9
CHUNK = 8000


class Port:
    """Rank `rank`'s plane on a socket bound to `address`, its peer at `peer`. The engine's
    selector is stood in for by one end of a socket pair that nothing writes to."""

    def __init__(self, rank: int, address=("127.0.0.1", 0), peer=None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)
        self.quiet = socket.socketpair()
        self.sealer = Sealer(KEY, JOB, COMM, rank)
        self.plane = _core.Plane(rank, 2, JOB, COMM, KEY, self.sealer.native)
        self.plane.attach(self.sock.fileno(), -1, self.quiet[0].fileno())
        if peer is not None:
            self.plane.set_address(_core.ROUTE_RANK, 1 - rank, *peer)

    def send(self, messages) -> None:
        self.plane.send(_core.ROUTE_RANK, messages)

    def receive(self, expected: int, runs: list | None = None) -> list[tuple[int, bytes]]:
        """Serve until `expected` messages came (or five quiet seconds); the chunks of each run
        handed to Python go to `runs`."""
        got, deadline = [], time.monotonic() + 5
        while len(got) < expected and time.monotonic() < deadline:
            if self.plane.serve(deadline) != _core.PORT_RUNS:
                continue
            data, found = self.plane.runs()
            for kind, job, comm, seq, src, dst, length, counter, chunks, offset, stride in found:
                got.extend((g, bytes(data[offset + i * stride:offset + i * stride + length]))
                           for i, g in enumerate(chunks))
                if runs is not None:
                    runs.append(list(chunks))
        return got

    def counters(self):
        return self.plane.counters()

    def close(self) -> None:
        self.sock.close()
        for s in self.quiet:
            s.close()


def ports():
    receiver = Port(1)
    sender = Port(0, peer=receiver.sock.getsockname())
    return sender, receiver


def chunks(count: int, last: int = CHUNK) -> list[np.ndarray]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 256, CHUNK if i < count - 1 else last, dtype=np.uint8)
            for i in range(count)]


def messages(data, first: int = 0):
    return [Outgoing(Kind.MCAST_DATA, 1, first + i, d, 1) for i, d in enumerate(data)]


@pytest.mark.parametrize("count,last", [(5, CHUNK), (5, 1234), (1, 77), (7, CHUNK)])
def test_a_batch_arrives_whole_each_datagram_authentic(count, last):
    sender, receiver = ports()
    try:
        data = chunks(count, last)
        sender.send(messages(data))
        runs = []
        got = receiver.receive(count, runs)
        assert [c for c, _ in got] == list(range(count))
        assert [p for _, p in got] == [d.tobytes() for d in data]
        _, stats, io = sender.counters()
        assert io["datagrams_out"] == count and stats["datagram_sends"] == 1  # one call
        drops, _, io = receiver.counters()
        if io["gro"] and io["datagram_reads"] == 1:
            # coalesced into one read: one run, but a shorter last datagram runs on its own
            assert runs == ([list(range(count))] if last == CHUNK or count == 1
                            else [list(range(count - 1)), [count - 1]])
        if io["gro"] and count > 1:
            assert io["datagram_reads"] < count  # coalesced: fewer reads than datagrams
        assert drops == {}
    finally:
        sender.close()
        receiver.close()


def test_a_forged_datagram_among_others_costs_only_itself():
    sender, receiver = ports()
    try:
        data = chunks(5)
        sealer = Sealer(KEY, JOB, COMM, 0)
        address = receiver.sock.getsockname()
        for i, d in enumerate(data):
            sealed = sealer.seal(Kind.MCAST_DATA, 1, 1, i, d)
            if i == 2:
                sealed[len(sealed) // 2] ^= 0x40  # a bit of the third datagram's payload
            sender.sock.sendto(sealed, address)
        got = receiver.receive(4)
        assert [c for c, _ in got] == [0, 1, 3, 4]
        assert [p for _, p in got] == [data[i].tobytes() for i in (0, 1, 3, 4)]
        assert receiver.counters()[0] == {"bad_mac": 1}
    finally:
        sender.close()
        receiver.close()


def test_messages_are_sent_as_given_whatever_their_attributes_do_meanwhile():
    """send reads every message's attributes (the caller's Python code may run there) before
    it queues any: a list emptied meanwhile, or a call back into the plane, cannot make it read
    past the list or queue a payload it no longer holds."""
    sender, receiver = ports()
    try:
        data = chunks(2)
        given = messages(data)
        first = given[0]

        class Meddling:
            def __getattr__(self, name):
                if name == "kind":
                    given.clear()
                    sender.plane.take_outbox()
                return getattr(first, name)

        given[0] = Meddling()
        sender.send(given)
        got = receiver.receive(2)
        assert [p for _, p in got] == [d.tobytes() for d in data]
    finally:
        sender.close()
        receiver.close()


def test_a_plane_serving_keeps_its_sealer_to_itself():
    """While the plane seals without the GIL the sealer's counter is its own: a seal from
    another thread would spend the same counter, the GCM nonce, twice."""
    port = Port(0)
    try:
        ended, refused = [], None
        server = threading.Thread(target=lambda: ended.append(
            port.plane.serve(time.monotonic() + 60)))
        server.start()
        deadline = time.monotonic() + 30
        while refused is None and time.monotonic() < deadline:
            try:
                port.sealer.native.seal_detached(Kind.FIN, 1, 1, 0, b"")
            except RuntimeError as err:
                refused = str(err)
        port.quiet[1].send(b"x")
        server.join(30)
        assert refused == "the sealer is in use by a plane serving on another thread"
        assert ended == [_core.PORT_PYTHON]
        spent = port.sealer.native.counter
        port.sealer.native.seal_detached(Kind.FIN, 1, 1, 0, b"")  # its own again
        assert port.sealer.native.counter == spent + 1
    finally:
        port.close()


PORT = 47000
OVER_MTU = 9500  # a datagram the emulated links' 9000-byte MTU cannot carry whole


def refused_batch(rank):
    """Rank 1 listens and says so; rank 0 sends a batch the kernel refuses to segment (each
    datagram exceeds the device's MTU: EMSGSIZE), so it goes one datagram at a time (each
    fragmented by IP, as this socket allows); GSO stays on for the batches that fit."""
    from overcast.cluster.netns import host_address
    me = Port(rank, (host_address(rank), PORT), (host_address(1 - rank), PORT))
    data = [np.full(OVER_MTU, i, np.uint8) for i in range(5)]
    try:
        if rank == 1:
            got = []
            while len(got) < 5:
                me.send([Outgoing(Kind.FIN, 0, 0, b"ready", 0)])
                got.extend(p for g, p in me.receive(5 - len(got)) if len(p) == OVER_MTU)
            return [p == d.tobytes() for p, d in zip(got, data)]
        assert me.receive(1), "rank 1 never said it was ready"
        me.send(messages(data))
        _, stats, io = me.counters()
        return [io["gso"], stats["datagram_sends"], io["datagrams_out"]]
    finally:
        me.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_batch_the_kernel_refuses_to_segment_goes_one_datagram_at_a_time():
    from overcast.cluster.netns import Cluster
    with Cluster(2, 1_000_000_000, service=False) as cluster:
        sender, receiver = cluster.run(refused_batch, timeout=60)
    assert sender == [1, 1 + 5, 5]  # the refused GSO call, then five sends; GSO kept
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


@pytest.mark.parametrize("mtu", [LOWEST_MTU, 576, 900, 1500, 9000])
def test_every_mtu_and_rate_gives_batches_and_chunks_the_native_plane_takes(mtu):
    """Small datagrams: a GSO send holds at most 64 of them however many its bytes would hold,
    so a batch is whole sends of at most 64 (never 0), and an in-network batch stays within
    the group the plane takes (255). At the lowest MTU an 8-byte element still fits a
    contribution after its prefix."""
    chunk = chunk_bytes(mtu)
    datagram = datagram_link_bytes(chunk)
    assert chunk - CONTRIB_PREFIX.size >= 8
    assert chunk_bytes(LOWEST_MTU - 1) - CONTRIB_PREFIX.size < 8
    per_send = min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // datagram)
    for mbit in (10, 100, 1000, 10_000, 100_000, 400_000):
        rate = mbit * 1e6 / 8
        batch, group = pace_batch(rate, datagram), reduction_batch(rate, datagram)
        assert MIN_BATCH <= batch <= MAX_BATCH and batch <= group <= 2 * MAX_BATCH, (mbit, batch)
        assert batch < per_send or batch % per_send == 0, (mbit, batch)
        budget = LinkBudget(rate, batch=batch, datagram_bytes=datagram, reduction_batch=group)
        plane = _core.Plane(0, 2)
        data = np.arange(64, dtype=np.int64)
        plane.reduce(0, dtype_code(data.dtype), False, 32, data.view(np.uint8),
                     np.empty(32, np.int64).view(np.uint8), chunk - CONTRIB_PREFIX.size, 8,
                     budget.reduction_batch, budget.native, 0.0)  # refused: a ValueError
        plane.release(0)


def test_messages_are_sealed_into_whole_sends():
    """Datagrams of 8,952 bytes: seven fit one GSO send. A shorter one may end a send; the one
    after it starts the next."""
    lengths = [8900] * 16 + [100] + [8900] * 2
    sender, receiver = ports()
    try:
        sender.send([Outgoing(Kind.MCAST_DATA, 1, g, np.full(n, g, np.uint8), 1)
                     for g, n in enumerate(lengths)])
        got = receiver.receive(len(lengths))
        assert got == [(g, bytes([g]) * n) for g, n in enumerate(lengths)]
        assert sender.counters()[1]["datagram_sends"] == 4  # 7, 7, 3 and 2 datagrams
    finally:
        sender.close()
        receiver.close()
