"""A keyed job member registering what the aggregator cannot hold: each registration is refused
to its connection alone, with the reason the rank reports, and the aggregator goes on serving
another job's collectives bit-exact, its pools within the budget it was given; registrations
that also contribute keep its memory within the budget. Anyone else, with no secret (a crowd of
connections, junk behind headers that announce the largest frame), neither stops it nor keeps a
rank out. And aggregators a rank cannot use (a malformed or unresolvable name, nothing
listening) are the reason it reports, not an exception out of its rendezvous."""

import errno
import json
import os
import pathlib
import re
import resource
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import overcast
from overcast.bench.soak import status_bytes
from overcast.buffers import dtype_code
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.native import MAX_REDUCTIONS
from overcast.aggregator.launch import start_aggregator, stop_aggregator
from overcast.aggregator.service import (ACCEPT_BACKOFF_SECONDS, ADDRESS_SHARE, MAX_UNREGISTERED,
                                     Limits, AggregatorService)
from overcast.transport.datagram import chunk_bytes
from overcast.transport.rendezvous import register_with_aggregator, register_with_aggregators
from overcast.wire.auth import Drops, Opener, Sealer, derive_key, job_id_of
from overcast.wire.header import (AGGREGATOR, HEADER, MAGIC, MAX_PAYLOAD, VERSION, Kind,
                                  endpoint, unpack_header)
from overcast.wire.messages import CONTRIB_PREFIX, pack_contribution_prefix
from overcast.wire.registration import EPOCH_SHIFT, HELLO, AGGREGATOR_CHALLENGE

HOSTILE, GOOD = os.urandom(32), os.urandom(32)
LIMITS = Limits(max_world=4096, max_communicators=40, pool_bytes=64 << 20)
SIEGE = pathlib.Path(__file__).resolve().parent.parent / "tools" / "registration_siege.py"
INT32 = dtype_code(np.dtype(np.int32))
UDP_SEGMENT = 103  # linux/udp.h: a GSO send's segment size


class Lagging:
    """A rank's sealer that takes `seconds` to seal: its HELLO leaves that long after the
    aggregator's challenge came (a long path, or a busy rank)."""

    def __init__(self, sealer: Sealer, seconds: float):
        self.sealer, self.seconds = sealer, seconds

    def seal(self, *args):
        time.sleep(self.seconds)
        return self.sealer.seal(*args)


def member(address: str, world: int, *, salt: bytes | None = None, src: int = 0,
           mtu: int = 1500, keep_udp: bool = False, hello_lag: float = 0.0,
           secret: bytes = HOSTILE, epoch: int = 0) -> types.SimpleNamespace:
    """Register as rank `src` of a communicator of `world` ranks of the hostile job (or the
    job of `secret`), as a rank does (rendezvous.register_with_aggregators), its HELLO sent
    `hello_lag` seconds after the challenge came; the links it filled (aggregator_sockets: the
    connection held open, or aggregator_error; salt; udp, the rank's datagram socket, left open if
    keep_udp)."""
    salt = salt or os.urandom(16)
    key = derive_key(secret, salt, b"comm")
    job, comm = job_id_of(secret), int.from_bytes(salt[:4], "little")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    links = types.SimpleNamespace(world=world, udp=udp, multicast=None, mtu=mtu,
                                  sealer=Lagging(Sealer(key, job, comm, src), hello_lag),
                                  opener=Opener(key, job, comm, Drops()), aggregator_sockets={},
                                  aggregator_names={}, endpoints=[], aggregator_slots=0,
                                  aggregator_error="unregistered", salt=salt)
    if epoch:  # as a rank registers anew with an aggregator restarted mid-job
        host, port = address.rsplit(":", 1)
        got = register_with_aggregator(links, host, int(port), 0, epoch, secret, salt, 5.0)
        assert not isinstance(got, str), got
        links.aggregator_sockets[endpoint(0)] = got.sock
    else:
        register_with_aggregators(links, address, secret, salt, 5.0)
    if not keep_udp:
        udp.close()
    return links


def contributions(links, seq: int, chunk: int, row: bytes) -> list[bytes]:
    """Every other rank's contribution to a chunk of an in-network ReduceScatter of one chunk
    per rank (chunk g is rank g's), sealed as each of them (their sealers kept in links, each
    rank's counter rising), the highest rank first (so each waits in its row of the pool for
    its turn)."""
    if not hasattr(links, "sealers"):
        key = derive_key(HOSTILE, links.salt, b"comm")
        job, comm = job_id_of(HOSTILE), int.from_bytes(links.salt[:4], "little")
        links.sealers = [Sealer(key, job, comm, src) for src in range(links.world)]
    prefix = pack_contribution_prefix(INT32, 1, links.world, links.world)
    return [bytes(links.sealers[src].seal(Kind.CONTRIB, seq, endpoint(0), chunk, (prefix, row)))
            for src in reversed(range(links.world)) if src != chunk]


def came(links, kind: Kind, seq: int) -> bool:
    """Whether a message of `kind` for chunk 0 of collective `seq` (a result; a CREDIT, which
    names no chunk) reaches rank 0 within 10 s: the aggregator has read every datagram sent to
    its one shard before the last one it needed."""
    links.udp.settimeout(10)
    try:
        while True:
            hdr = unpack_header(links.udp.recv(1 << 16))
            if hdr.kind == kind and hdr.seq == seq and hdr.chunk == 0:
                return True
    except TimeoutError:
        return False


def good_job(rank):
    """The other job's in-network ReduceScatter and full-duplex all_reduce, exact."""
    comm = overcast.Communicator(timeout=30)
    try:
        world = comm.world_size
        out = np.empty(5000, np.float32)
        comm.reduce_scatter(out, np.arange(5000 * world, dtype=np.float32) % 7 + rank,
                            algorithm="innetwork")
        expected = (np.arange(5000 * world, dtype=np.float32) % 7 * world +
                    sum(range(world)))[rank * 5000:(rank + 1) * 5000]
        buf = np.full(30001, rank + 1, np.float32)
        comm.all_reduce(buf, algorithm="fullduplex")
        return [bool(np.array_equal(out, expected)),
                bool((buf == world * (world + 1) / 2).all()), comm._aggregator_error]
    finally:
        comm.close()


@pytest.mark.parametrize("epoch", [0, 5])
def test_an_aggregators_counter_starts_in_the_range_of_the_epoch_it_was_registered_at(epoch):
    """A communicator registered at `epoch` (a rank registering anew with an aggregator
    restarted mid-job names how many rounds of losses and take-backs it has decided): the
    aggregator's counter under the communicator key starts in that epoch's range, so no
    instance's nonce meets an earlier one's, and the ranks' replay windows take it."""
    proc, address = start_aggregator("127.0.0.1", 0, secrets=[HOSTILE.hex()], slots=8, shards=1)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    host, port = address.rsplit(":", 1)
    links = member(address, 2, keep_udp=True, epoch=epoch)
    try:
        assert links.aggregator_sockets, links.aggregator_error
        for datagram in contributions(links, 0, 0, bytes(8)):
            sender.sendto(datagram, (host, int(port)))
        links.udp.settimeout(10)
        while (hdr := unpack_header(links.udp.recv(1 << 16))).kind != Kind.RESULT:
            pass
    finally:
        sender.close()
        links.udp.close()
        for sock in links.aggregator_sockets.values():
            sock.close()
        stop_aggregator(proc)
    assert hdr.src == endpoint(0) and hdr.counter >> EPOCH_SHIFT == epoch
    assert hdr.counter - (epoch << EPOCH_SHIFT) < 1 << 41


def test_hostile_registrations_are_refused_and_the_aggregator_serves_on(tmp_path):
    stats = tmp_path / "aggregator.json"
    proc, address = start_aggregator("127.0.0.1", 0, secrets=[HOSTILE.hex(), GOOD.hex()],
                                 stats_path=str(stats), limits=LIMITS, shards=1)
    held = []
    try:
        said = {}
        for world in (0, 1, 65534, 65535):
            said[world] = member(address, world).aggregator_error
        said["rank past its world"] = member(address, 4, src=9).aggregator_error
        # a window larger than the receive buffer: 4096 ranks' datagrams do not fit 16 MiB
        said["buffer"] = member(address, 4096).aggregator_error
        # two communicators whose salts share their first 4 bytes: one id on the wire
        first = member(address, 2, salt=b"same" + os.urandom(12))
        held.append(first)
        said["identity"] = member(address, 2, salt=b"same" + os.urandom(12)).aggregator_error
        # one salt, registered again with another world; its rank 0 on a second connection
        salt = os.urandom(16)
        held.append(member(address, 2, salt=salt))
        said["inconsistent"] = member(address, 3, salt=salt, src=1).aggregator_error
        said["rank"] = member(address, 2, salt=salt).aggregator_error
        # a thousand communicators held open, where the job may hold 40
        opened = [member(address, 2, mtu=300) for _ in range(1000)]
        said["communicators"] = opened[-1].aggregator_error
        welcomed = sum(bool(m.aggregator_sockets) for m in opened)
        for m in opened:
            for sock in m.aggregator_sockets.values():
                sock.close()  # the aggregator forgets them
        # pools: loopback's 64 KiB rows, 16 ranks: 4 MiB a slot; the job's share is 32 MiB
        big = [member(address, 16, mtu=65536) for _ in range(3)]
        held += big
        said["pool"] = big[-1].aggregator_error
        # those welcomed make their pools whole: the widest row to a chunk of each of their
        # reductions (the aggregator's one shard reads them before the other job's datagrams)
        widest = chunk_bytes(65536) - CONTRIB_PREFIX.size
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for links in big:
            for seq in range(MAX_REDUCTIONS if links.aggregator_sockets else 0):
                sender.sendto(contributions(links, seq, 0, bytes(widest))[0], links.endpoints[0])
        sender.close()
        # the other job's collectives, while all of that is held
        results = run_ranks(good_job, loopback_placements(2, {
            "OVERCAST_AGGREGATORS": address, "OVERCAST_SECRET": GOOD.hex(),
            "OVERCAST_LINK_BITS_PER_S": "1e9"}), timeout=120)
        alive = proc.poll() is None
    finally:
        for m in held:
            for sock in m.aggregator_sockets.values():
                sock.close()
        stop_aggregator(proc)
    for world in (0, 1, 65534, 65535):
        assert "refused this communicator" in said[world], (world, said[world])
        assert f"a world of {world}" in said[world], said[world]
    assert "rank 9 of a world of 4" in said["rank past its world"]
    assert "receive buffer" in said["buffer"], said["buffer"]
    assert "same id on the wire" in said["identity"], said["identity"]
    assert "registered with a world of 2" in said["inconsistent"], said["inconsistent"]
    assert "rank 0 of this communicator is registered already" in said["rank"], said["rank"]
    assert first.aggregator_sockets and big[0].aggregator_sockets
    assert "--pool-bytes" in said["pool"], said["pool"]
    assert "--max-communicators" in said["communicators"], said["communicators"]
    assert welcomed == LIMITS.max_communicators - 2  # two held already: first and salt's
    assert alive
    for exact_rs, exact_ar, aggregator_error in results:
        assert exact_rs and exact_ar and aggregator_error is None
    report = json.loads(stats.read_text())
    assert report["drops"]["refused_world"] == 5 and report["drops"]["refused_pool"] >= 1
    assert report["drops"]["refused_communicators"] == 1000 - welcomed
    assert report["drops"]["refused_rank"] == 1
    # the pools the hostile job's contributions made (4 reductions' windows of 16 rows each,
    # as many slots as each was granted) were made, and are within the job's share (half the
    # budget), the other job's beside them within the budget
    made = sum(MAX_REDUCTIONS * links.aggregator_slots * 16 * widest for links in big)
    assert LIMITS.pool_bytes // 4 < made <= LIMITS.pool_bytes // 2
    assert made <= report["peak_pool_bytes"] <= LIMITS.pool_bytes


def test_a_fault_on_one_registration_costs_that_connection_alone():
    """A fault in the service's own code on one peer's input (injected into its admission)
    closes that connection and is counted; the loop serves the next registration."""
    service = AggregatorService("127.0.0.1", 0, [HOSTILE])
    admit, faults = service._admit, []

    def faulty(*args):
        if not faults:
            faults.append(1)
            raise RuntimeError("a fault")
        return admit(*args)
    service._admit = faulty
    serving = threading.Thread(target=service.serve)
    serving.start()
    try:
        first = member(f"127.0.0.1:{service.port}", 2)
        second = member(f"127.0.0.1:{service.port}", 2)
    finally:
        service.stop()
        serving.join()
        service.close()
    assert not first.aggregator_sockets and "failed" in first.aggregator_error
    assert second.aggregator_sockets and second.aggregator_error is None
    assert service.drops["registration_error"] == 1
    for sock in second.aggregator_sockets.values():
        sock.close()


@pytest.mark.parametrize("spec,reason", [
    ("127.0.0.1:99999", "an aggregator is host[:port], not '127.0.0.1:99999'"),
    ("a..b:18515", "cannot reach the aggregator at a..b:18515: "),  # no IDNA encoding
    ("127.0.0.1:1", "cannot reach the aggregator at 127.0.0.1:1: "),
])
def test_an_aggregator_the_rank_cannot_use_is_its_reason(spec, reason):
    links = member(spec, 2)
    assert links.aggregator_error.startswith(reason), links.aggregator_error
    assert links.aggregator_sockets == {} and links.endpoints == []


def most_rss_growth(budget: int, communicators: int) -> int:
    """What the aggregator's RSS may grow by (docs/protocols.md): its --pool-bytes, 4 KiB a
    communicator, and a few MiB of its own (allocators, each shard's outbox)."""
    return budget + communicators * 4096 + (4 << 20)


def test_a_keyed_member_that_registers_and_contributes_stays_within_the_budget(tmp_path):
    """Hostile registrations that contribute: a communicator of 8 ranks whose rows are as wide
    as loopback takes, and communicators of 1,000 ranks of narrow rows until the budget refuses
    them, every rank sending (a replay window each in the aggregator) and filling the pools.
    The aggregator's peak RSS grows by at most --pool-bytes and the fixed overhead
    docs/protocols.md states: 4 KiB a communicator, and a few MiB of its own."""
    budget = 32 << 20
    stats = tmp_path / "aggregator.json"
    proc, address = start_aggregator("127.0.0.1", 0, secrets=[HOSTILE.hex()], slots=8,
                                 stats_path=str(stats), shards=1,
                                 limits=Limits(max_world=4096, max_communicators=256,
                                               pool_bytes=budget))
    members = []
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    port = int(address.rsplit(":", 1)[1])

    def contribute(links, seqs, chunks, row: bytes):
        """Every rank's contributions to `chunks` (chunk 0 last) of collectives `seqs`; an
        admitted communicator's are read once rank 0 has chunk 0's result (the aggregator's one
        shard reads them in order)."""
        for seq in seqs:
            for chunk in chunks:
                for datagram in contributions(links, seq, chunk, row):
                    sender.sendto(datagram, ("127.0.0.1", port))
            assert not links.aggregator_sockets or came(links, Kind.RESULT, seq)
    try:
        start = status_bytes(proc.pid, "VmRSS")
        wide = member(address, 8, mtu=65536, keep_udp=True)
        members = [wide] + [member(address, 1000, mtu=104, keep_udp=True) for _ in range(32)]
        narrow = members[1:]
        for links in [m for m in narrow if not m.aggregator_sockets]:  # foreign to the aggregator
            contribute(links, [0], [0], bytes(8))
        widest = chunk_bytes(65536) - CONTRIB_PREFIX.size
        contribute(wide, range(MAX_REDUCTIONS), [7, 6, 5, 4, 3, 2, 1, 0], bytes(widest))
        for links in [m for m in narrow if m.aggregator_sockets]:
            contribute(links, [0], [0], bytes(8))
        peak = status_bytes(proc.pid, "VmHWM")
    finally:
        sender.close()
        for links in members:
            links.udp.close()
            for sock in links.aggregator_sockets.values():
                sock.close()
        stop_aggregator(proc)
    report = json.loads(stats.read_text())
    admitted = [m for m in narrow if m.aggregator_sockets]
    assert peak - start <= most_rss_growth(budget, 1 + len(admitted)), (peak - start, report)
    assert wide.aggregator_sockets and admitted and len(admitted) < len(narrow)
    assert all("--pool-bytes" in m.aggregator_error for m in narrow if not m.aggregator_sockets)
    assert report["stats"]["contributions"] == \
        MAX_REDUCTIONS * wide.aggregator_slots * 7 + 999 * len(admitted)


def test_a_jobs_connections_stay_within_its_share_of_the_descriptors(tmp_path):
    """An aggregator under `ulimit -n 128` serving two jobs: the hostile job registers
    communicators of 8 ranks, each rank holding its connection, until one is refused for want
    of the job's share of the descriptors (the reason its ranks report); that is at most half
    of what is left once 32 are kept for connections waiting, and the other job's ranks
    register at once."""
    stats = tmp_path / "aggregator.json"
    proc, address = start_aggregator("127.0.0.1", 0, secrets=[HOSTILE.hex(), GOOD.hex()],
                                 shards=1, stats_path=str(stats),
                                 prefix=("sh", "-c", 'ulimit -n 128 && exec "$@"', "sh"))
    held = []
    try:
        while len(held) < 128 and all(m.aggregator_sockets for m in held):  # 128: all it may open
            salt = os.urandom(16)
            held += [member(address, 8, salt=salt, src=rank) for rank in range(8)]
        salt = os.urandom(16)
        other = [member(address, 2, salt=salt, src=rank, secret=GOOD) for rank in range(2)]
        held += other
    finally:
        for links in held:
            for sock in links.aggregator_sockets.values():
                sock.close()
        stop_aggregator(proc)
    refused = held[-3].aggregator_error
    assert "ulimit -n, shared among the jobs served" in refused, refused
    share = int(re.search(r"of the job's (\d+) are left", refused)[1])
    registered = sum(bool(m.aggregator_sockets) for m in held[:-2])
    assert registered == share // 8 * 8 and share <= (128 - 32) // 2
    assert [m.aggregator_error for m in other] == [None, None]
    assert json.loads(stats.read_text())["drops"]["refused_connections"] == 8


def test_too_few_descriptors_to_start_are_said_in_one_line():
    """`overcast aggregator` of two shards under `ulimit -n 8`: a line that says how many it needs,
    and exit status 2, not a traceback from the socket it could not open."""
    run = subprocess.run(["sh", "-c", 'ulimit -n 8 && exec "$@"', "sh", sys.executable, "-m",
                          "overcast.cli.main", "aggregator", "--port", "0", "--shards", "2"],
                         env={**os.environ, "OVERCAST_SECRET": HOSTILE.hex()},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("overcast: 8 descriptors (ulimit -n) are too few"), run.stderr


def test_the_aggregators_old_command_name_serves_after_saying_it_is_old():
    """`overcast switch` is `overcast aggregator` under its old name: it serves (says where it
    listens, and stops on SIGTERM as the aggregator does), after a line on stderr saying so."""
    with subprocess.Popen([sys.executable, "-m", "overcast.cli.main", "switch", "--host",
                           "127.0.0.1", "--port", "0", "--shards", "1"],
                          env={**os.environ, "OVERCAST_SECRET": HOSTILE.hex()},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            said = proc.stdout.readline()
        finally:
            proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert said.startswith("overcast aggregator listening on 127.0.0.1:"), said
    assert proc.returncode == 0 and err == ("overcast: `overcast switch` is the old name of "
                                            "`overcast aggregator`; running that\n"), err


def test_a_keyed_members_credit_probes_keep_the_aggregator_within_the_budget(tmp_path):
    """A keyed member of a communicator of 2 ranks and 512 slots sends 64,000 CREDIT probes for
    a reduction never begun, each naming every chunk, in GSO batches of 64 as fast as it can:
    each answer names 512 chunks to send again (2 KiB). The aggregator's peak RSS grows by no
    more than the budget allows; it grew by 8 MiB and more when a shard queued every answer of
    64 reads before it sent any."""
    budget = 2 << 20
    stats = tmp_path / "aggregator.json"
    proc, address = start_aggregator("127.0.0.1", 0, secrets=[HOSTILE.hex()], slots=512,
                                 stats_path=str(stats), shards=1, limits=Limits(pool_bytes=budget))
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    links = None
    try:
        start = status_bytes(proc.pid, "VmRSS")
        links = member(address, 2, mtu=104, keep_udp=True)
        key = derive_key(HOSTILE, links.salt, b"comm")
        sealer = Sealer(key, job_id_of(HOSTILE), int.from_bytes(links.salt[:4], "little"), 1)
        every = (2**32 - 1).to_bytes(4, "little")
        batches = [b"".join(sealer.seal(Kind.CREDIT, 7, endpoint(0), 0, every)
                            for _ in range(64)) for _ in range(1000)]
        sender.setsockopt(socket.IPPROTO_UDP, UDP_SEGMENT, len(batches[0]) // 64)
        for batch in batches:
            sender.sendto(batch, links.endpoints[0])
        # rank 0's own probe, read after all of them (from another port: a read of its own)
        links.udp.sendto(links.sealer.seal(Kind.CREDIT, 7, endpoint(0), 0, every),
                         links.endpoints[0])
        assert came(links, Kind.CREDIT, 7)
        peak = status_bytes(proc.pid, "VmHWM")
    finally:
        sender.close()
        if links is not None:
            links.udp.close()
            for sock in links.aggregator_sockets.values():
                sock.close()
        stop_aggregator(proc)
    report = json.loads(stats.read_text())
    assert links.aggregator_slots == 512 and report["stats"]["nacks"] > 0
    assert peak - start <= most_rss_growth(budget, 1), (peak - start, report)


def siege(*args: str) -> dict:
    """tools/registration_siege.py's figures (JSON) for these arguments."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1600:
        pytest.skip("the crowd's other ends need 1,600 descriptors in this process")
    run = subprocess.run([sys.executable, str(SIEGE), *args, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("hard", [False, True], ids=["soft limit", "hard limit"])
def test_a_crowd_of_connections_neither_stops_the_aggregator_nor_keeps_a_rank_out(hard):
    """1,500 connections held open, no secret needed, against an aggregator started under
    `ulimit -n 1024` (its soft limit, which it raises to the hard one, or both): every one is
    answered, the oldest waiting for their HELLO are shed once a 16th of a quarter of the
    descriptors (or of 1,024) wait from their address, and a rank registers during the crowd
    and after it, from the same address."""
    result = siege("--connections", "1500", "--junk", "0", *(["--hard"] if hard else []))
    assert result["alive"]
    assert result["during"]["error"] is None and result["after"]["error"] is None
    assert result["crowd"]["greeted"] == 1500
    # its hard limit is this process's, unless lowered to 1024 too
    limit = 1024 if hard else resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    waiting = MAX_UNREGISTERED if limit == resource.RLIM_INFINITY else \
        min(MAX_UNREGISTERED, limit // 4)
    share = waiting // ADDRESS_SHARE
    # each connection past its address's share sheds one (the two registrations' too, if
    # they come first)
    assert 1500 - share <= result["drops"]["unregistered_shed"] <= 1502 - share


# Connects to 127.0.0.1:PORT from 127.0.0.2 as fast as it can, never sends, holds the newest
# HOLD; says so once it has opened 2 x HOLD.
CHURN = """
import collections, socket, sys
port, hold = int(sys.argv[1]), int(sys.argv[2])
held, opened = collections.deque(), 0
while True:
    sock = socket.socket()
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind(("127.0.0.2", 0))
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
    except OSError:
        sock.close()
        continue
    held.append(sock)
    if len(held) > hold:
        held.popleft().close()
    opened += 1
    if opened == 2 * hold:
        print("churning", flush=True)
"""


def test_one_host_churning_connections_does_not_shed_another_hosts_slow_rank(tmp_path):
    """One process at another address (127.0.0.2) opens connections as fast as it can, never
    registering, against an aggregator under `ulimit -n 256` (64 may wait, 4 of them from one
    address). A rank whose HELLO leaves 0.1 s after the challenge (the churn sheds 64 waiting
    connections in far less) registers meanwhile, three times: the churn sheds its own
    connections alone."""
    stats = tmp_path / "aggregator.json"
    proc, address = start_aggregator("127.0.0.1", 0, secrets=[HOSTILE.hex()], shards=1,
                                 stats_path=str(stats),
                                 prefix=("sh", "-c", 'ulimit -n 256 && exec "$@"', "sh"))
    churn = subprocess.Popen([sys.executable, "-c", CHURN, address.rsplit(":", 1)[1], "128"],
                             stdout=subprocess.PIPE, text=True)
    said = []
    try:
        assert churn.stdout.readline() == "churning\n"
        for _ in range(3):
            links = member(address, 2, hello_lag=0.1)
            said.append(links.aggregator_error)
            for sock in links.aggregator_sockets.values():
                sock.close()
    finally:
        churn.kill()
        churn.wait()
        churn.stdout.close()
        stop_aggregator(proc)
    assert said == [None] * 3
    assert json.loads(stats.read_text())["drops"]["unregistered_shed"] >= 128


def test_junk_behind_the_largest_header_is_refused_as_the_header_parses():
    """Four connections each send a header announcing a 64 MiB HELLO and then 16 MiB of junk:
    each is closed as its header parses (what the kernel's buffers took is all that goes), the
    aggregator's memory does not grow by what they sent, and a rank registers meanwhile and
    after."""
    result = siege("--connections", "0", "--junk", "4", "--junk-bytes", "16M")
    assert result["alive"]
    assert result["during"]["error"] is None and result["after"]["error"] is None
    assert result["drops"]["not_hello"] == 4
    assert result["junk_sent_bytes"] < 4 * (16 << 20) // 2
    assert result["rss_growth"] < 8 << 20


@pytest.mark.parametrize("kind,length", [
    (Kind.HELLO, HELLO.size + 1), (Kind.HELLO, HELLO.size - 1), (Kind.HELLO, MAX_PAYLOAD),
    (Kind.DESCRIBE, HELLO.size)])
def test_a_header_but_a_hellos_of_its_size_closes_the_connection_at_once(kind, length):
    """The header alone, and nothing after it: the aggregator closes the connection without
    waiting for the frame it announces, and counts it."""
    service = AggregatorService("127.0.0.1", 0, [HOSTILE])
    serving = threading.Thread(target=service.serve)
    serving.start()
    try:
        with socket.create_connection(("127.0.0.1", service.port), timeout=5) as sock:
            assert len(sock.recv(AGGREGATOR_CHALLENGE.size)) == AGGREGATOR_CHALLENGE.size
            sock.sendall(HEADER.pack(MAGIC, VERSION, kind, job_id_of(HOSTILE), 0, 0, 0,
                                     AGGREGATOR, 0, length, 0))
            closed = sock.recv(1) == b""
    finally:
        service.stop()
        serving.join()
        service.close()
    assert closed and service.drops["not_hello"] == 1


def test_an_accept_out_of_descriptors_is_counted_and_rests_the_listener_shedding_nobody():
    """accept() with one descriptor left (the process's limit lowered for a moment to what is
    open, and one): the first connection takes it; the next accept fails (Linux says EMFILE at
    the limit whether or not a connection waits), is counted and rests the listener for
    ACCEPT_BACKOFF_SECONDS, and sheds nobody: the first keeps its connection, the second waits
    in the backlog and is taken once the listener listens again."""
    service = AggregatorService("127.0.0.1", 0, [HOSTILE])
    first = socket.create_connection(("127.0.0.1", service.port), timeout=5)
    second = socket.create_connection(("127.0.0.1", service.port), timeout=5)
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.dup(0)  # every descriptor below it is open
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest + 1, hard))
        try:
            taken = [service._accept(), service._accept()]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert taken == [True, False] and service.drops["accept_emfile"] == 1
        assert "unregistered_shed" not in service.drops and len(service.connections) == 1
        assert len(first.recv(64)) == AGGREGATOR_CHALLENGE.size
        first.setblocking(False)
        with pytest.raises(BlockingIOError):  # open, waiting for its HELLO
            first.recv(1)
        assert service.listener not in {k.fileobj for k in service._selector.get_map().values()}
        rested = service.listening_again
        assert rested >= time.monotonic() + ACCEPT_BACKOFF_SECONDS / 2
        service._listen_again(rested - ACCEPT_BACKOFF_SECONDS / 2)
        assert service.listening_again == rested  # still resting
        service._listen_again(rested)
        assert service.listening_again is None and service._accept()
        assert len(second.recv(64)) == AGGREGATOR_CHALLENGE.size  # taken from the backlog
        assert len(service.connections) == 2
    finally:
        first.close()
        second.close()
        service.close()


def test_a_connection_reset_before_its_challenge_is_counted():
    """A connection reset while it waits in the backlog: accept() gives it, the challenge
    cannot be sent; counted and closed, and the accept loop goes on."""
    service = AggregatorService("127.0.0.1", 0, [HOSTILE])
    try:
        reset = socket.create_connection(("127.0.0.1", service.port), timeout=5)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()  # a RST, not a FIN
        assert service._accept()
        assert service.drops["challenge_unsent"] == 1 and not service.connections
    finally:
        service.close()


class RefusingToWatch:
    """The service's real selector, but it takes no more connections to watch (as epoll does
    past the user's max_user_watches, ENOSPC): the listener and the wake-up pair, registered
    before, stay watched. A fault, injected: the test cannot lower the system's limit."""

    def __init__(self, selector: selectors.BaseSelector):
        self.selector = selector

    def __getattr__(self, name):
        return getattr(self.selector, name)

    def register(self, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_connection_the_selector_cannot_watch_costs_that_connection_alone():
    """Counted and closed (its challenge sent already), and the accept loop goes on."""
    service = AggregatorService("127.0.0.1", 0, [HOSTILE])
    service._selector = RefusingToWatch(service._selector)
    try:
        with socket.create_connection(("127.0.0.1", service.port), timeout=5) as sock:
            assert service._accept()
            assert service.drops["unwatched"] == 1 and not service.connections
            assert len(sock.recv(64)) == AGGREGATOR_CHALLENGE.size and sock.recv(1) == b""
    finally:
        service.close()


def test_a_registered_connection_that_sends_anything_is_closed_and_counted():
    """Nothing is expected on a registered connection: a byte on it closes it (its
    communicator, its last connection gone, is forgotten), where the service read whatever
    came for as long as it came."""
    service = AggregatorService("127.0.0.1", 0, [HOSTILE])
    serving = threading.Thread(target=service.serve)
    serving.start()
    try:
        links = member(f"127.0.0.1:{service.port}", 2)
        (sock,) = links.aggregator_sockets.values()
        sock.sendall(b"x")
        closed = sock.recv(1) == b""
    finally:
        service.stop()
        serving.join()
        service.close()
        for sock in links.aggregator_sockets.values():
            sock.close()
    assert closed and service.drops["sent_after_registering"] == 1 and not service.comms


class FailingOnce:
    """The service's real shards, but one call named `fails` raises (ValueError, as the
    binding does for a communicator or rank it does not hold) the first time. No input makes
    set_group or set_address fail once the communicator is registered: a fault, injected."""

    def __init__(self, shards, fails: str):
        self.shards, self.fails = shards, fails

    def __getattr__(self, name):
        call = getattr(self.shards, name)
        if name != self.fails:
            return call

        def once(*args):
            self.fails = None
            raise ValueError("a fault after the communicator was registered")
        return once


@pytest.mark.parametrize("fails", ["set_group", "set_address"])
def test_a_fault_after_registering_a_communicator_gives_back_what_it_held(fails):
    """A fault between registering a new communicator in the shards and welcoming its rank
    costs that connection alone (counted), and the communicator is given back: no budget, id
    on the wire or place in the shards is held for it, and its next registration is welcomed
    into the shards' first place again."""
    service = AggregatorService("127.0.0.1", 0, [HOSTILE])
    service.shards = FailingOnce(service.shards, fails)
    serving = threading.Thread(target=service.serve)
    serving.start()
    salt = os.urandom(16)
    try:
        first = member(f"127.0.0.1:{service.port}", 2, salt=salt)
        books = (dict(service.comms), set(service.wire_ids), service.reserved_bytes,
                 service.shards.counters()[2]["engine_communicators"])
        second = member(f"127.0.0.1:{service.port}", 2, salt=salt)
        handles = [c.handle for c in service.comms.values()]
    finally:
        service.stop()
        serving.join()
        service.close()
        for sock in second.aggregator_sockets.values():
            sock.close()
    assert not first.aggregator_sockets and "failed" in first.aggregator_error, first.aggregator_error
    assert service.drops["registration_error"] == 1
    assert books == ({}, set(), 0, 0)
    assert second.aggregator_sockets and second.aggregator_error is None and handles == [0]
