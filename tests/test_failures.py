"""Errors across real processes: bad input named on every rank, dead, closing and silent ranks
turned into errors in bounded time, and a peer that stops reading; forged, foreign and replayed
datagrams dropped and counted."""

import os
import re
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

import overcast
from by_hand import rank_1_by_hand
from conftest import root_only
from overcast.cluster.launch import RankError, loopback_placements, run_ranks
from overcast.errors import CollectiveTimeoutError
from overcast.transport.store import StoreClient, StoreServer
from overcast.wire.auth import Sealer, derive_key
from overcast.wire.header import Kind

TIMEOUT = 3.0


def outcome(call):
    """Run `call`; return ("ok", elapsed) or (error class name, message, elapsed)."""
    t0 = time.monotonic()
    try:
        call()
        return ["ok", "", time.monotonic() - t0]
    except Exception as err:  # the class and message are what the tests check
        return [type(err).__name__, str(err), time.monotonic() - t0]


def with_comm(body):
    def run(rank, *args):
        comm = overcast.Communicator(timeout=TIMEOUT)
        try:
            return body(rank, comm, *args)
        finally:
            comm.close()
    return run


def ag(comm, count, dtype=np.float32):
    comm.all_gather(np.empty(comm.world_size * count, dtype), np.zeros(count, dtype))


def rs(comm, count, dtype=np.float32):
    comm.reduce_scatter(np.empty(count, dtype), np.zeros(comm.world_size * count, dtype))


@pytest.mark.parametrize("case", ["size", "dtype", "order"])
def test_mismatch_across_ranks_is_named_on_every_rank(case):
    def body(rank, comm):
        if case == "size":
            return outcome(lambda: ag(comm, 100 if rank != 1 else 101))
        if case == "dtype":
            return outcome(lambda: ag(comm, 100, np.float32 if rank != 1 else np.int32))
        first, second = (ag, rs) if rank != 1 else (rs, ag)
        return outcome(lambda: (first(comm, 100), second(comm, 100)))

    results = run_ranks(with_comm(body), loopback_placements(3), timeout=60)
    expect = {"size": "101 x float32", "dtype": "100 x int32", "order": "reduce_scatter"}[case]
    for name, message, elapsed in results:
        assert name == "CollectiveMismatchError", message
        assert "differs across ranks" in message and expect in message
        assert elapsed < TIMEOUT  # found by comparison, not by waiting


def test_bad_input_on_one_rank_fails_it_at_once_and_the_others_with_its_reason():
    def body(rank, comm):
        if rank == 1:
            strided = np.zeros(200, np.float32)[::2]
            return outcome(lambda: comm.all_gather(np.empty(300, np.float32), strided))
        return outcome(lambda: ag(comm, 100))

    results = run_ranks(with_comm(body), loopback_placements(3), timeout=60)
    assert results[1][0] == "InvalidArgumentError" and "not C-contiguous" in results[1][1]
    for name, message, elapsed in (results[0], results[2]):
        assert name == "OvercastError" and "bad input on rank 1" in message, message
        assert elapsed < TIMEOUT


@pytest.mark.parametrize("call,needle", [
    (lambda c: c.all_gather(np.empty(10, np.float32), np.zeros(10, np.float32)),
     "world_size (2) x input (10) = 20"),
    (lambda c: c.all_gather(np.empty(20, np.float64), np.zeros(10, np.float32)),
     "output is float64 but input is float32"),
    (lambda c: c.reduce_scatter(np.empty(10, np.int32), np.zeros(20, np.int32), op="bxor"),
     "unsupported reduce op 'bxor'"),
    (lambda c: c.reduce_scatter(np.empty(10, np.float32), np.zeros(20, np.float32), op="max",
                                algorithm="innetwork"),
     "in-network reduction sums; op 'max' needs algorithm 'ring'"),
    (lambda c: c.all_gather(np.empty(20, np.complex64), np.zeros(10, np.complex64)),
     "unsupported dtype complex64"),
    (lambda c: c.all_gather([0] * 20, np.zeros(10, np.float32)),
     "must be a numpy array or a CPU torch tensor"),
    (lambda c: c.all_gather(np.empty(20, np.float32), np.zeros(10, np.float32),
                            algorithm="tree"), "has no algorithm 'tree'"),
])
def test_invalid_arguments_are_named(call, needle):
    def body(rank, comm):
        return outcome(lambda: call(comm))

    for name, message, _ in run_ranks(with_comm(body), loopback_placements(2), timeout=60):
        assert name in ("InvalidArgumentError", "OvercastError")
        assert needle in message, message


def test_killed_rank_becomes_an_error_on_the_others_quickly():
    def body(rank, comm):
        ag(comm, 1000)  # everyone is connected and working
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return outcome(lambda: [ag(comm, 1000) for _ in range(3)])

    with pytest.raises(RankError) as info:
        run_ranks(with_comm(body), loopback_placements(4), timeout=60)
    assert list(info.value.failures) == [2]
    for rank in (0, 1, 3):
        name, message, elapsed = info.value.results[rank]
        assert name == "PeerFailureError", message
        assert "rank 2" in message
        assert elapsed < 1.0  # from the broken connection, not from the timeout


def test_a_rank_that_closes_with_a_collective_pending_is_named_on_the_others_at_once():
    """Rank 2 closes while its all_gather #1 is pending (it cannot finish: rank 1 issues #1
    only once rank 2 has closed, told through a store of the test's own). Rank 0, waiting in
    #1, and rank 1, issuing it after, fail from rank 2's word, not at the timeout."""
    def body(rank, comm, port):
        comm.barrier()
        store = StoreClient("127.0.0.1", port, 30)
        try:
            if rank == 2:
                work = comm.all_gather(np.empty(3000, np.float32), np.zeros(1000, np.float32),
                                       async_op=True)
                comm.close()
                store.set("closed", b"1")
                return outcome(work.wait)
            if rank == 1:
                store.get("closed")
            return outcome(lambda: ag(comm, 1000))
        finally:
            store.close()

    server = StoreServer("127.0.0.1", 0)
    try:
        results = run_ranks(with_comm(body), loopback_placements(3), args=(server.port,),
                            timeout=60)
    finally:
        server.close()
    assert results[2][0] == "CommunicatorClosedError", results[2]
    for name, message, elapsed in results[:2]:
        assert name == "PeerFailureError", message
        assert "rank 2 closed the communicator with all_gather" in message, message
        assert elapsed < 1.0  # told by rank 2, not found by waiting


def closes_mid_transfer(rank, port):
    """Rank 0 closes as soon as it has posted a ring AllGather of 1.2 MiB a rank, while rank 1,
    in the same call, still sends to it: what rank 1 hears, eight times over."""
    heard = []
    for attempt in range(8):
        comm = overcast.Communicator(rank, 2, store=StoreClient("127.0.0.1", port, 30),
                                     name=f"closing-{attempt}", secret=b"k" * 32, timeout=TIMEOUT)
        comm.barrier()
        if rank == 0:
            comm.all_gather(np.empty(600_000, np.float32), np.ones(300_000, np.float32),
                            async_op=True)
            comm.close()
            continue
        heard.append(outcome(lambda: comm.all_gather(np.empty(600_000, np.float32),
                                                     np.ones(300_000, np.float32)))[:2])
        comm.close()
    return heard


def test_a_rank_that_closes_mid_transfer_is_heard_not_reset():
    """Closed with its peer's frames unread, a socket would reset the connection, and the reset
    would discard the closing rank's ABORT on the peer, which then saw only a lost connection."""
    server = StoreServer("127.0.0.1", 0)
    try:
        _, heard = run_ranks(closes_mid_transfer, loopback_placements(2), args=(server.port,),
                             timeout=90)
    finally:
        server.close()
    for name, message in heard:
        assert name == "ok" or (name == "PeerFailureError" and
                                "rank 0 closed the communicator with" in message), message


def test_a_done_collective_whose_peer_stops_reading_fails_at_the_timeout():
    """Rank 1 (by hand) sends its part of a ring AllGather and then reads nothing, as a frozen
    process or a partitioned host: rank 0 is done, but its one frame (16 MiB, more than the
    sockets hold) cannot leave, and its Work completes only once the frame is written. It
    fails at the timeout from completion, naming rank 1."""
    frame = 16 << 20
    with rank_1_by_hand(timeout=1.0, frame_bytes=frame) as (comm, links):
        count = frame // 4
        work = comm.all_gather(np.empty(2 * count, np.float32), np.zeros(count, np.float32),
                               async_op=True)
        links.streams[0].sendall(links.sealer.seal(Kind.RING_DATA, 0, 0, 0,
                                                   np.ones(count, np.float32)))
        with pytest.raises(CollectiveTimeoutError) as err:
            work.wait(timeout=10)
        assert "was done, but rank 1 did not take its last frames within 1.0 s" in \
            str(err.value)


def with_store(body, world, env=None):
    """run_ranks(body) with body(rank, store): a store of the test's own to tell ranks apart
    what the communicator's would not."""
    def run(rank, port):
        store = StoreClient("127.0.0.1", port, 30)
        try:
            return body(rank, store)
        finally:
            store.close()

    server = StoreServer("127.0.0.1", 0)
    try:
        return run_ranks(run, loopback_placements(world, env), args=(server.port,), timeout=90)
    finally:
        server.close()


def rank_0_ahead(count, ahead, then):
    """body(rank, store) for with_store: rank 0 issues `ahead` ring AllGathers of `count` int32
    a rank that rank 1 has not issued, and returns then(comm, works); rank 1 waits until it has,
    then issues one and returns how it ended."""
    def body(rank, store):
        with overcast.Communicator(timeout=30) as comm:
            comm.barrier()
            if rank == 1:
                store.get("rank 0 is done")
                return outcome(lambda: ag(comm, count, np.int32))
            works = [comm.all_gather(np.empty(2 * count, np.int32), np.zeros(count, np.int32),
                                     async_op=True) for _ in range(ahead)]
            result = then(comm, works)
            store.set("rank 0 is done", b"1")
            return result
    return body


def test_a_rank_far_ahead_that_closes_closes_at_once_and_is_named():
    """Rank 0 issues ten ring AllGathers of 4 MiB a rank that rank 1 has not issued: rank 1
    reads all 40 MiB and holds them. Rank 0 then closes with the ten pending: its close does not
    wait on rank 1, and rank 1's next call fails from rank 0's word, naming it."""
    count, ahead = 1 << 20, 10

    def close_once_sent(comm, works):
        deadline = time.monotonic() + 30
        while comm.counters()["stream_bytes_out"] < ahead * 4 * count and \
                time.monotonic() < deadline:  # until rank 1 has taken them all
            threading.Event().wait(0.01)
        return [comm.counters()["stream_bytes_out"], outcome(comm.close)]

    (sent, (name, _, close_seconds)), (error, message, _) = with_store(
        rank_0_ahead(count, ahead, close_once_sent), 2)
    assert sent >= ahead * 4 * count
    assert name == "ok" and close_seconds < 5.0  # not the close's 10 s bound on flushing
    assert error == "PeerFailureError", message
    assert message.startswith("rank 0 closed the communicator with all_gather"), message


def test_past_the_limit_held_every_rank_fails_naming_the_rank_ahead():
    """With OVERCAST_EARLY_STREAM_BYTES at 1 MiB, rank 0 issues ten ring AllGathers of 1 MiB a
    rank that rank 1 has not issued: every rank raises rank 1's words, which name rank 0, how
    far ahead it is and the setting to raise; rank 1's call issued after raises them too."""
    count, ahead = 1 << 18, 10
    failed, (name, message, elapsed) = with_store(
        rank_0_ahead(count, ahead, lambda comm, works: [outcome(w.wait)[:2] for w in works]),
        2, {"OVERCAST_EARLY_STREAM_BYTES": str(1 << 20)})
    assert name == "OvercastError" and elapsed < 1.0, message
    assert re.fullmatch(r"rank 0 is \d+ collectives ahead of rank 1: rank 1 holds .* from it "
                        r"for collectives #1 to #\d+, which it has not issued yet: .* B in all, "
                        r"past its limit of 1,048,576 B; raise early_stream_bytes \(the "
                        r"Communicator's, or OVERCAST_EARLY_STREAM_BYTES\) to let a rank fall "
                        r"further behind", message), message
    assert failed == [["OvercastError", f"{message} (reported by rank 1)"]] * ahead


def test_a_rank_that_stood_still_past_its_timeout_reads_what_came_before_it_judges():
    """Rank 1 (timeout 1 s) issues a ring AllGather and is stopped (SIGSTOP) for 2.5 s; rank 0
    issues its part meanwhile, which waits in rank 1's socket. Continued, rank 1 reads it
    before its timers judge the call, which completes, rather than failing for the time it
    stood still."""
    def body(rank, store):
        with overcast.Communicator(timeout=1.0 if rank == 1 else 30.0) as comm:
            comm.barrier()
            out = np.empty(2000, np.int32)
            if rank == 1:
                work = comm.all_gather(out, np.full(1000, 1, np.int32), async_op=True)
                store.set("pid", str(os.getpid()).encode())
                result = outcome(work.wait)[:2]
            else:
                pid = int(store.get("pid"))
                os.kill(pid, signal.SIGSTOP)
                try:
                    work = comm.all_gather(out, np.zeros(1000, np.int32), async_op=True)
                    threading.Event().wait(2.5)  # rank 1 stands still past its timeout
                finally:
                    os.kill(pid, signal.SIGCONT)
                result = outcome(work.wait)[:2]
            return result + [bool((out[:1000] == 0).all() and (out[1000:] == 1).all())]

    assert with_store(body, 2) == [["ok", "", True]] * 2


def test_silent_rank_gives_the_others_a_timeout_naming_what_they_waited_for():
    def body(rank, comm):
        if rank == 1:
            threading.Event().wait(TIMEOUT * 2.5)  # alive but never joins the collective
            return ["silent", "", 0.0]
        return outcome(lambda: ag(comm, 1000))

    results = run_ranks(with_comm(body), loopback_placements(3), timeout=60)
    for rank in (0, 2):
        name, message, elapsed = results[rank]
        assert name in ("CollectiveTimeoutError", "PeerFailureError"), message
        assert elapsed < TIMEOUT * 2, elapsed
        if "reported by" not in message:  # its own timer, not the other's abort (which may
            assert TIMEOUT * 0.9 < elapsed, elapsed  # come sooner if that one posted first)
    assert any("made no progress" in r[1] for r in (results[0], results[2]))


def test_forged_foreign_and_replayed_datagrams_are_dropped_and_counted():
    """Rank 1 throws bad datagrams at rank 0's datagram socket; rank 0 keeps working and counts
    each by reason."""
    def body(rank, comm):
        ag(comm, 100)
        comm.barrier()  # collective 0 has finished on both ranks: what comes for it is stale
        engine = comm._engine
        if rank == 1:
            links = engine.links
            target = (links.addresses[0], links.udp_ports[0])
            # Sealed under the communicator's key as rank 1 (counters far above the engine's,
            # so no nonce is reused): authentic, but for collective 0, long finished.
            valid = Sealer(links.key, links.job, links.comm, 1)
            valid.counter = 1 << 40
            valid = valid.seal(Kind.MCAST_DATA, 0, 0, 0, b"x" * 64)
            forged = Sealer(derive_key(b"wrong", b"salt", b"comm"), links.job, links.comm,
                            1).seal(Kind.RING_DATA, 0, 0, 0, b"x" * 64)
            foreign = Sealer(links.key, links.job ^ 1, links.comm, 1).seal(
                Kind.RING_DATA, 0, 0, 0, b"x")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for datagram in (b"junk", forged, foreign, valid, valid, valid):
                    s.sendto(datagram, target)
        comm.barrier()
        ag(comm, 100)  # still works; the datagrams were read long before this returns
        comm.barrier()
        return comm.counters()

    counters = run_ranks(with_comm(body), loopback_placements(2), timeout=60)[0]
    assert counters["drops"] == {"malformed": 1, "bad_mac": 1, "foreign": 1, "replayed": 2}
    assert counters["stale"] == 1


# Mismatched calls of the datagram algorithms on the emulated cluster: (what every rank issues,
# what rank 1 issues instead), as (kind, algorithm, count, dtype or root).
MISMATCHES = {
    "multicast size": (("ag", "multicast", 20_000, np.float32),
                       ("ag", "multicast", 20_100, np.float32)),
    "multicast dtype": (("ag", "multicast", 20_000, np.float32),
                        ("ag", "multicast", 20_000, np.int32)),
    "broadcast root": (("bcast", "multicast", 20_000, 0), ("bcast", "multicast", 20_000, 2)),
    "innetwork size": (("rs", "innetwork", 20_000, np.float32),
                       ("rs", "innetwork", 20_100, np.float32)),
    "pair order": (("pair", "ag,rs", 20_000, np.float32), ("pair", "rs,ag", 20_000, np.float32)),
}


def _issue(comm, kind, algorithm, count, param):
    world = comm.world_size
    if kind == "ag":
        comm.all_gather(np.empty(world * count, param), np.zeros(count, param),
                        algorithm=algorithm)
    elif kind == "bcast":
        comm.broadcast(np.zeros(count, np.float32), root=param)
    elif kind == "rs":
        comm.reduce_scatter(np.empty(count, param), np.ones(world * count, param),
                            algorithm=algorithm)
    else:  # the overlapped pair, in flight at once
        ag = lambda: comm.all_gather(np.empty(world * count, param),  # noqa: E731
                                     np.zeros(count, param), algorithm="multicast",
                                     async_op=True)
        rs = lambda: comm.reduce_scatter(np.empty(count, param),  # noqa: E731
                                         np.ones(world * count, param),
                                         algorithm="innetwork", async_op=True)
        first, second = (ag, rs) if algorithm == "ag,rs" else (rs, ag)
        works = [first(), second()]
        for work in works:
            work.wait()


def mismatches(rank, trials):
    outcomes = {}
    for name, (same, odd) in MISMATCHES.items():
        for trial in range(trials):
            with overcast.Communicator(name=f"{name}-{trial}", timeout=20) as comm:
                call = odd if rank == 1 else same
                outcomes[f"{name}/{trial}"] = outcome(lambda: _issue(comm, *call))[:2]
    return outcomes


@root_only
def test_mismatches_of_datagram_algorithms_are_named_on_every_rank_on_the_cluster():
    from overcast.cluster.netns import Cluster
    with Cluster(4, 400_000_000) as cluster:
        aggregator = cluster.start_aggregator()
        results = cluster.run(mismatches, args=(3,), timeout=600)
        cluster.stop_aggregator(aggregator)
    for rank, outcomes in enumerate(results):
        assert len(outcomes) == 3 * len(MISMATCHES)
        for trial, (name, message) in outcomes.items():
            assert name == "CollectiveMismatchError", (rank, trial, message)
            assert "differs across ranks" in message, (rank, trial, message)


def test_a_rendezvous_that_fails_is_an_overcast_error(monkeypatch):
    """Nobody serves the store: the rendezvous's own error, one of overcast's, as every error a
    Communicator raises is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(overcast.OvercastError, match="rendezvous|store"):
        overcast.Communicator(1, 2, timeout=0.5)


def pair_through_a_cut(rank, switch_ns, cut_seconds, count):
    """The overlapped pair (multicast AllGather, in-network ReduceScatter) while rank 0 cuts
    host 1's cable at the switch for `cut_seconds` (the fault's length, not a wait for anyone)."""
    from overcast.bench.rank import expected_sum, pattern, shard
    with overcast.Communicator(name="cut", timeout=5.0) as comm:
        world = comm.world_size
        gathered, grads = np.empty(world * count, np.float32), pattern(rank, count, world)
        reduced = np.empty(count, np.float32)

        def pair():
            works = [comm.all_gather(gathered, shard(rank, count), algorithm="multicast",
                                     async_op=True),
                     comm.reduce_scatter(reduced, grads, algorithm="innetwork", async_op=True)]
            if rank == 0:
                link = ["ip", "-n", switch_ns, "link", "set", "h1"]
                subprocess.run(link + ["down"], check=True)
                time.sleep(cut_seconds)
                subprocess.run(link + ["up"], check=True)
            for work in works:
                work.wait()
        said = outcome(pair)
        exact = said[0] == "ok" and np.array_equal(reduced, expected_sum(rank, count, world)) \
            and np.array_equal(gathered, np.concatenate([shard(r, count) for r in range(world)]))
        return said, exact, comm.in_network_fallback


@root_only
@pytest.mark.parametrize("cut_seconds", [1.0, 8.0])
def test_a_cable_cut_shorter_than_the_timeout_delays_longer_fails_every_rank_alike(cut_seconds):
    """A host's cable cut for 1 s (under the 2 s an aggregator may stay silent and the 5 s
    timeout) delays the pair and nothing else: exact on every rank, nothing taken for lost.
    Cut for 8 s, every rank raises CollectiveTimeoutError."""
    from overcast.cluster.netns import Cluster
    with Cluster(4, 400_000_000) as cluster:
        aggregator = cluster.start_aggregator()
        try:
            results = cluster.run(pair_through_a_cut, args=(cluster.switch_ns, cut_seconds,
                                                            1 << 18), timeout=120)
        finally:
            cluster.stop_aggregator(aggregator)
    for (name, message, _), exact, fallback in results:
        if cut_seconds < 5.0:
            assert (name, exact, fallback) == ("ok", True, None), message
        else:
            assert name == "CollectiveTimeoutError", message
