"""The wire: header layout, authentication, and what happens to bad input (dropped, counted)."""

import os

import numpy as np
import pytest

from overcast.native import _core
from overcast.wire.auth import STREAM_COPY_BYTES, Drops, Opener, Sealer, derive_key, job_id_of
from overcast.wire.header import (HEADER_BYTES, OVERHEAD_BYTES, TAG_BYTES, VERSION, Kind,
                                  unpack_header)

SECRET = b"s" * 32
KEY = derive_key(SECRET, b"salt-one", b"comm")
JOB = job_id_of(SECRET)


def make(src=1, key=KEY, job=JOB, comm=7):
    drops = Drops()
    return Sealer(key, job, comm, src), Opener(KEY, JOB, 7, drops), drops


def test_header_round_trip_and_size():
    sealer, opener, drops = make()
    frame = sealer.seal(Kind.RING_DATA, 5, 2, 9, b"payload")
    assert len(frame) == OVERHEAD_BYTES + 7 == HEADER_BYTES + 7 + TAG_BYTES
    hdr, payload = opener.open(frame)
    assert (hdr.kind, hdr.job, hdr.comm, hdr.seq, hdr.src, hdr.dst, hdr.chunk, hdr.length) == \
        (Kind.RING_DATA, JOB, 7, 5, 1, 2, 9, 7)
    assert bytes(payload) == b"payload" and not drops


def test_keys_differ_per_salt_and_label():
    assert derive_key(SECRET, b"a", b"comm") != derive_key(SECRET, b"b", b"comm")
    assert derive_key(SECRET, b"a", b"comm") != derive_key(SECRET, b"a", b"switch")
    assert len(KEY) == 16


@pytest.mark.parametrize("mutate,reason", [
    (lambda f: f[:10], "malformed"),                                   # short
    (lambda f: b"XX" + f[2:], "malformed"),                             # magic
    (lambda f: f[:2] + bytes([9]) + f[3:], "malformed"),                # version
    (lambda f: f[:2] + bytes([VERSION - 1]) + f[3:], "malformed"),      # the version before
    (lambda f: f[:3] + bytes([200]) + f[4:], "malformed"),              # unknown kind
    (lambda f: f + b"extra", "malformed"),                              # length disagrees
    (lambda f: f[:HEADER_BYTES] + bytes([f[HEADER_BYTES] ^ 1]) + f[HEADER_BYTES + 1:],
     "bad_mac"),                                                        # payload bit flip
    (lambda f: f[:20] + bytes([f[20] ^ 1]) + f[21:], "bad_mac"),       # header bit flip
    (lambda f: f[:-1] + bytes([f[-1] ^ 1]), "bad_mac"),                 # tag bit flip
])
def test_bad_datagrams_are_dropped_and_counted(mutate, reason):
    sealer, opener, drops = make()
    frame = bytes(sealer.seal(Kind.MCAST_DATA, 1, 0, 0, b"x" * 100))
    assert opener.open(mutate(frame)) is None
    assert drops == {reason: 1}


def test_foreign_job_communicator_and_key_are_dropped():
    _, opener, drops = make()
    other_job = Sealer(KEY, JOB ^ 1, 7, 1).seal(Kind.MCAST_DATA, 1, 0, 0, b"x")
    other_comm = Sealer(KEY, JOB, 8, 1).seal(Kind.MCAST_DATA, 1, 0, 0, b"x")
    forged = Sealer(os.urandom(16), JOB, 7, 1).seal(Kind.MCAST_DATA, 1, 0, 0, b"x")
    for frame in (other_job, other_comm, forged):
        assert opener.open(frame) is None
    assert drops == {"foreign": 2, "bad_mac": 1}


def test_a_message_whose_counter_is_not_above_the_last_taken_is_a_replay():
    """Single messages (handshakes) are taken in order: each counter above the one before. The
    data path's replay windows, which take reordered datagrams, are the native core's (its C
    unit test checks them against their definition)."""
    sealer, opener, drops = make()
    first, second = (bytes(sealer.seal(Kind.HELLO, 0, 0, 0, b"x")) for _ in range(2))
    hdr, _ = opener.open(first)
    later, _ = opener.open(second, hdr.counter)
    assert opener.open(first, later.counter) is None and opener.open(second, later.counter) is None
    assert drops == {"replayed": 2}


def test_header_parse_never_raises_other_than_malformed():
    import random
    rng = random.Random(1)
    from overcast.wire.header import MalformedError
    for _ in range(2000):
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 80)))
        if rng.random() < 0.5 and len(junk) >= 4:
            junk = b"OC\x01" + junk[3:]
        try:
            unpack_header(junk)
        except MalformedError:
            pass


def test_a_stream_closes_on_a_frame_from_anyone_but_its_peer():
    """Every rank holds the communicator key, so a frame sealed by rank 2 authenticates on rank
    1's stream too; the stream takes only its peer's."""
    import select
    import socket

    from overcast.transport.stream import Stream, StreamClosed
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    drops = Drops()
    stream = Stream(b, 1, Opener(KEY, JOB, 7, drops))
    got = []
    try:
        a.sendall(Sealer(KEY, JOB, 7, 1).seal(Kind.FIN, 0, 0, 0) +
                  Sealer(KEY, JOB, 7, 2).seal(Kind.FIN, 0, 0, 0))
        with pytest.raises(StreamClosed, match="rank 2 spoke on rank 1's stream"):
            for _ in range(1000):  # each read takes what has arrived, and returns when none has
                select.select([b], [], [], 1.0)
                stream.read(lambda hdr, payload: got.append(hdr.src))
        assert got == [1] and drops == {"wrong_sender": 1}
    finally:
        a.close()
        b.close()
        listener.close()


def test_a_detached_seal_is_the_whole_seal_in_parts():
    """The header and tag sealed for a payload where it lies are those of the whole message, in
    one part or two, and the counter advances the same."""
    whole, opener, drops = make()
    apart = Sealer(KEY, JOB, 7, 1)
    payload = os.urandom(5000)
    for body in (payload, (payload[:100], payload[100:]), b""):
        message = bytes(whole.seal(Kind.RING_DATA, 3, 0, 4, body))
        parts = apart.seal_detached(Kind.RING_DATA, 3, 0, 4, body)
        header, tag = parts[0], parts[-1]
        assert len(header) + len(tag) == OVERHEAD_BYTES
        assert header == message[:HEADER_BYTES] and tag == message[-TAG_BYTES:]
        assert b"".join(parts) == message
        assert all(part is original for part, original in
                   zip(parts[1:-1], body if type(body) is tuple else (body,)))  # not copied
        assert apart.counter == whole.counter
        assert opener.open(message) is not None
    assert not drops


def test_a_stream_seals_small_messages_whole_and_large_ones_in_place():
    """A control message is copied into one sealed buffer (one part to queue and write); a ring
    frame's payload is written from where it lies. Both are the message sealed whole."""
    whole, _, _ = make()
    sealer = Sealer(KEY, JOB, 7, 1)
    small, large = os.urandom(STREAM_COPY_BYTES), os.urandom(STREAM_COPY_BYTES + 1)
    for payload, parts_expected in ((b"", 1), (small, 1), (large, 3)):
        message = bytes(whole.seal(Kind.DESCRIBE, 3, 0, 4, payload))
        parts = sealer.seal_for_stream(Kind.DESCRIBE, 3, 0, 4, payload)
        assert len(parts) == parts_expected and b"".join(parts) == message
    assert parts[1] is large
    floats = np.arange(100, dtype=np.float32)  # its bytes count, not its elements
    assert b"".join(sealer.seal_for_stream(Kind.DESCRIBE, 3, 0, 4, floats)) == \
        bytes(whole.seal(Kind.DESCRIBE, 3, 0, 4, floats.view(np.uint8)))
    assert len(sealer.seal_for_stream(Kind.DESCRIBE, 3, 0, 4, np.zeros(2000, np.float32))) == 3


def test_a_streams_read_of_many_frames_and_one_larger_than_its_buffer_opens_whole(tcp_pair):
    """Hundreds of frames in a read (opened natively in batches, the GIL let go for large
    reads), then one frame larger than the read buffer (which grows), then more: each arrives
    once, whole and in order."""
    import select
    import threading

    from overcast.transport.stream import Stream
    a, b = tcp_pair
    sealer, opener, drops = make()
    receiver = Stream(b, 1, opener)
    payloads = [os.urandom(i % 300) for i in range(400)]
    payloads.insert(200, os.urandom(3 << 20))
    stream = b"".join(bytes(sealer.seal(Kind.FIN, i, 0, 0, p)) for i, p in enumerate(payloads))
    writer = threading.Thread(target=a.sendall, args=(stream,))
    writer.start()
    got = []
    while len(got) < len(payloads):
        assert select.select([b], [], [], 10.0)[0], "nothing arrived in 10 s"
        receiver.read(lambda hdr, payload: got.append((hdr.seq, bytes(payload))))
    writer.join()
    assert got == list(enumerate(payloads)) and not drops


def test_a_streams_opener_refuses_arguments_out_of_range():
    _, opener, _ = make()
    tags = opener._tags
    for peer, counter in ((1 << 16, 0), ((1 << 32) + 1, 0), (-1, 0), (1, -1), (1, 1 << 64)):
        with pytest.raises((ValueError, OverflowError)):
            tags.open_stream(bytearray(64), 64, JOB, 7, peer, counter)
    with pytest.raises(ValueError):
        tags.open_stream(bytearray(64), 65, JOB, 7, 1, 0)


def test_a_stream_opens_frames_cut_anywhere_once_each_and_skips_what_does_not_open(tcp_pair):
    """Frames that reach the reader a few bytes at a time are each delivered once, whole and in
    order; a replayed one, one of another communicator and one with a flipped bit are skipped
    and counted, and the stream goes on."""
    import select

    from overcast.transport.stream import Stream
    a, b = tcp_pair
    sealer, opener, drops = make()
    receiver = Stream(b, 1, opener)
    frames = [sealer.seal(Kind.FIN, seq, 0, 0, os.urandom(seq * 37)) for seq in range(6)]
    replayed = bytes(frames[1])
    foreign = Sealer(KEY, JOB, 8, 1).seal(Kind.FIN, 9, 0, 0)
    forged = bytearray(sealer.seal(Kind.FIN, 10, 0, 0, b"x" * 50))
    forged[HEADER_BYTES + 3] ^= 1
    last = sealer.seal(Kind.FIN, 11, 0, 0, b"y" * 9000)
    stream = b"".join(bytes(f) for f in frames[:3]) + replayed + bytes(foreign) + \
        bytes(forged) + b"".join(bytes(f) for f in frames[3:]) + bytes(last)
    got = []
    for start in range(0, len(stream), 7):
        a.sendall(stream[start:start + 7])
        while select.select([b], [], [], 0.0)[0]:
            receiver.read(lambda hdr, payload: got.append((hdr.seq, bytes(payload))))
    while len(got) < 7:
        assert select.select([b], [], [], 10.0)[0], "the last frame did not arrive in 10 s"
        receiver.read(lambda hdr, payload: got.append((hdr.seq, bytes(payload))))
    assert [seq for seq, _ in got] == [0, 1, 2, 3, 4, 5, 11]
    assert [p for _, p in got[:6]] == [bytes(f[HEADER_BYTES:-TAG_BYTES]) for f in frames]
    assert drops == {"replayed": 1, "foreign": 1, "bad_mac": 1}


@pytest.fixture
def tcp_pair():
    import socket
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    yield a, b
    a.close()
    b.close()


def queued_in(sock) -> int:
    """Bytes waiting in the socket's receive queue (SIOCINQ)."""
    import fcntl
    import struct
    import termios
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0]


def test_a_stream_writes_payloads_from_where_they_lie_and_holds_them_until_written(tcp_pair):
    """A frame queued on a stream is written from its caller's buffer: the stream `holds` its tag
    until the socket has taken the last byte, and a payload changed before that goes out as it
    is then, failing its tag."""
    import select

    from overcast.transport.stream import Stream
    a, b = tcp_pair
    sealer, opener, drops = make()
    sender = Stream(a, 0, opener)
    receiver = Stream(b, 1, opener)
    big = bytearray(os.urandom(8 << 20))  # more than both socket buffers hold
    changed = bytearray(1000)
    for seq, payload in ((5, big), (6, changed)):
        sender.enqueue(sealer.seal_detached(Kind.RING_DATA, seq, 0, 0, payload), seq)
    changed[0] ^= 1
    got = []
    sender.flush()
    assert sender.holds(5) and sender.holds(6)  # the reader has not read
    while sender.queued_bytes:
        readable, writable, _ = select.select([b], [a], [], 10.0)
        assert readable or writable, "neither side moved in 10 s"
        if readable:
            receiver.read(lambda hdr, p: got.append((hdr.seq, bytes(p))))
        sender.flush()
    assert not sender.holds(5) and not sender.holds(6)
    while len(got) + drops.get("bad_mac", 0) < 2:
        assert select.select([b], [], [], 10.0)[0], "the last frame did not arrive in 10 s"
        receiver.read(lambda hdr, p: got.append((hdr.seq, bytes(p))))
    assert got == [(5, bytes(big))] and drops == {"bad_mac": 1}


def test_a_stream_wakes_its_reader_only_once_the_next_frame_is_whole(tcp_pair):
    """After a read the socket's low-water mark is what the next frame still lacks: part of a
    frame leaves the socket unreadable, the rest makes it readable."""
    import select
    import socket
    import time

    from overcast.transport.stream import Stream
    a, b = tcp_pair
    sealer, opener, drops = make()
    stream = Stream(b, 1, opener)
    frames = [bytes(sealer.seal(Kind.RING_DATA, 1, 0, j, os.urandom(20_000))) for j in range(2)]

    def arrived(nbytes):  # loopback has what was sent at once, as a rule
        deadline = time.monotonic() + 10.0
        while queued_in(b) < nbytes:
            assert time.monotonic() < deadline, "the bytes sent did not arrive in 10 s"
            select.select([b], [], [], 0.01)

    a.sendall(frames[0] + frames[1][:5_000])
    arrived(len(frames[0]) + 5_000)
    got = []
    stream.read(lambda hdr, p: got.append(hdr.chunk))
    assert got == [0]
    missing = len(frames[1]) - 5_000
    assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == missing
    a.sendall(frames[1][5_000:-1])
    arrived(missing - 1)
    assert select.select([b], [], [], 0)[0] == [], "readable with a byte of the frame missing"
    a.sendall(frames[1][-1:])
    assert select.select([b], [], [], 10.0)[0] == [b]
    stream.read(lambda hdr, p: got.append(hdr.chunk))
    assert got == [0, 1] and not drops


def read_of(*frames) -> memoryview:
    """Datagrams laid back to back as one GRO read hands them over."""
    return memoryview(b"".join(bytes(f) for f in frames))


def plane_runs(read, size: int, loss: float = 0.0):
    """Rank 0's native datagram plane fed one read of datagrams `size` bytes each (but the
    last): the runs it gives Python as (sender, collective, chunks), and its drops."""
    plane = _core.Plane(0, 4, JOB, 7, KEY, Sealer(KEY, JOB, 7, 0).native)
    if loss:
        plane.set_loss(loss, 0.0, 1)
    plane.feed(read, size, 0.0)
    _, runs = plane.runs()
    return [(r[4], r[3], r[8]) for r in runs], plane.drops()


def test_a_read_is_opened_datagram_by_datagram_and_grouped_into_runs():
    """Runs break where the sender, the collective or the chunk order changes, at a datagram
    that fails (another communicator's, a forged or replayed one: each counted, the others
    taken) and before a shorter last datagram."""
    sealer = Sealer(KEY, JOB, 7, 1)
    other_rank = Sealer(KEY, JOB, 7, 2)
    stranger = Sealer(KEY, JOB, 8, 1)

    def seal(s, chunk, seq=1, size=100):
        return bytes(s.seal(Kind.MCAST_DATA, seq, 0, chunk, bytes([chunk]) * size))
    first = [seal(sealer, g) for g in range(3)]
    forged = bytearray(seal(sealer, 3))
    forged[HEADER_BYTES] ^= 1
    frames = first + [seal(other_rank, 10), seal(other_rank, 11), seal(stranger, 4),
                      seal(sealer, 5), seal(sealer, 6, seq=2), seal(sealer, 2), forged,
                      first[1], seal(sealer, 7), seal(sealer, 8, size=40)]
    runs, drops = plane_runs(read_of(*frames), len(first[0]))
    assert runs == [(1, 1, [0, 1, 2]), (2, 1, [10, 11]), (1, 1, [5]), (1, 2, [6]), (1, 1, [2]),
                    (1, 1, [7]), (1, 1, [8])]
    assert drops == {"foreign": 1, "bad_mac": 1, "replayed": 1}


def test_a_read_may_lose_datagrams_before_they_are_looked_at():
    """Injected loss takes datagrams before anything opens them: nothing is counted as dropped.
    (An empty datagram is counted as malformed where it is read: the native UDP test.)"""
    sealer = Sealer(KEY, JOB, 7, 1)
    frames = [sealer.seal(Kind.MCAST_DATA, 1, 0, g, b"x" * 50) for g in range(4)]
    assert plane_runs(read_of(*frames), len(frames[0]), loss=1.0) == ([], {})
    assert plane_runs(read_of(*frames), len(frames[0]))[0] == [(1, 1, [0, 1, 2, 3])]
