"""The native core (overcast/native): its own C unit tests and fuzz targets, built here with
AddressSanitizer and UndefinedBehaviorSanitizer and run; and the native engine against the
Python side of the wire: a message sealed by either opens in the other, and every dtype sums to
the bits numpy gives in rank order."""

import pathlib
import socket
import subprocess
import types

import numpy as np
import pytest

from overcast.buffers import DTYPES, accumulator_dtype, dtype_code
from overcast.native import Aggregator as Engine
from overcast.native import _core
from overcast.native._core import OUTBOX_BYTES
from overcast.wire.auth import Drops, Opener, Sealer
from overcast.wire.header import AGGREGATOR, HEADER_BYTES, TAG_BYTES, Kind, endpoint
from overcast.wire.messages import CONTRIB_PREFIX, pack_acks, pack_contribution_prefix, unpack_credit

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = ROOT / "overcast" / "native"
PARTS = (NATIVE / "parts.txt").read_text().split()  # the core without its Python binding
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer"]
# Inputs per fuzz target in the suite; tools/fuzz runs millions, coverage-guided.
FUZZ_RUNS = {"fuzz_datagrams": 300_000, "fuzz_aggregator": 60_000, "fuzz_plane": 60_000,
             "fuzz_stream": 100_000}


def build(out: pathlib.Path, *sources: pathlib.Path, sanitize=SANITIZE,
          link=()) -> pathlib.Path:
    cmd = ["gcc", "-std=c11", "-g", "-O1", "-Wall", "-Wextra", "-Werror", *sanitize,
           f"-I{NATIVE}", *map(str, sources), *(str(NATIVE / f"{p}.c") for p in PARTS),
           "-lcrypto", "-lm", *link, "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, pathlib.Path]:
    where = tmp_path_factory.mktemp("native")
    tests = ROOT / "tests" / "native"
    built = {"test_core": build(where / "test_core", tests / "test_core.c")}
    for target in FUZZ_RUNS:
        built[target] = build(where / target, tests / f"{target}.c", tests / "fuzz_main.c")
    return built


def test_the_cores_unit_tests_pass_under_the_sanitizers(programs):
    run = subprocess.run([programs["test_core"]], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith(" passed, 0 failed"), run.stdout
    assert "ERROR" not in run.stderr and "runtime error" not in run.stderr, run.stderr


def test_the_aggregator_survives_out_of_memory_at_each_allocation(tmp_path):
    """Its whole life run once per allocation it makes, that one failing (tests/native/
    test_oom.c): no crash, no leak, and what it could not take counted as out_of_memory. And a
    rank's gather whose list of requests cannot grow leaves the chunks missing, to be asked
    for again."""
    program = build(tmp_path / "test_oom", ROOT / "tests" / "native" / "test_oom.c",
                    link=["-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc"])
    run = subprocess.run([program], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip().endswith(" failed in turn, 0 failed"), run.stdout


def test_planes_and_aggregators_of_several_threads_pass_under_threadsanitizer(tmp_path):
    """What two communicators of one process are: rank planes, an aggregator's loop, ports and
    sealers, each on a thread of its own, all at once."""
    program = build(tmp_path / "test_core_tsan", ROOT / "tests" / "native" / "test_core.c",
                    sanitize=["-fsanitize=thread"])
    run = subprocess.run([program, "threads"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip().endswith(" passed, 0 failed"), run.stdout
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("target", list(FUZZ_RUNS))
def test_the_fuzz_targets_find_nothing_under_the_sanitizers(programs, target):
    """Random and mutated inputs, after every input the fuzzers once found a fault with
    (tests/native/corpus/TARGET: each is replayed first)."""
    corpus = sorted((ROOT / "tests" / "native" / "corpus" / target).glob("*"))
    run = subprocess.run([programs[target], f"-runs={FUZZ_RUNS[target]}", "-seed=7",
                          *map(str, corpus)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{FUZZ_RUNS[target]} inputs run" in run.stdout
    assert "runtime error" not in run.stderr


# -- the native engine against the Python wire ----------------------------------------------

KEY, JOB, COMM, WORLD = bytes(range(16)), 0x10203, 0x405, 4


def keyed_engine(slots: int = 64) -> tuple[Engine, int]:
    engine = Engine(slots)
    handle, granted = engine.register(JOB, COMM, WORLD, slots, KEY, 1 << 40)
    assert granted == slots
    return engine, handle


def contributions(sealer: Sealer, dtype, rows: np.ndarray, chunks: list[int],
                  total: int, seq: int = 0) -> bytes:
    """One read: rank `sealer.src`'s contributions to `chunks` of reduction `seq`, back to
    back."""
    prefix = pack_contribution_prefix(dtype_code(dtype), 1, WORLD, total)
    return b"".join(sealer.seal(Kind.CONTRIB, seq, AGGREGATOR, g,
                                (prefix, rows[i].view(np.uint8)))
                    for i, g in enumerate(chunks))


def opened(batches) -> list[tuple]:
    """Every datagram the engine sealed, opened by the Python side: (header, payload); no
    counter twice."""
    opener = Opener(KEY, JOB, COMM, Drops())
    messages, counters = [], set()
    for _, _, data, segment in batches:
        for at in range(0, len(data), segment):
            got = opener.open(data[at:at + segment])
            assert got is not None and got[0].counter not in counters, opener.drops
            counters.add(got[0].counter)
            messages.append((got[0], bytes(got[1])))
    return messages


@pytest.mark.parametrize("dtype", sorted(DTYPES, key=str), ids=str)
def test_sealed_by_python_summed_natively_opened_by_python_bit_for_bit(dtype):
    """Each rank's contributions, sealed by overcast.wire's Sealer, go in as reads of
    back-to-back datagrams; the results come out sealed, open under overcast.wire's Opener, and
    are the sums numpy takes in rank order (16-bit floats accumulated in float32)."""
    engine, _ = keyed_engine()
    rng = np.random.default_rng(3)
    chunks, elems = 8, 37  # chunk g is rank g % 4's (a group of 1)
    if np.dtype(dtype).kind == "f":
        data = rng.standard_normal((WORLD, WORLD * chunks, elems)).astype(dtype)
    else:
        data = rng.integers(-128, 127, (WORLD, WORLD * chunks, elems)).astype(dtype)
    sealers = [Sealer(KEY, JOB, COMM, r) for r in range(WORLD)]
    for r in range(WORLD):
        mine = [g for g in range(WORLD * chunks) if g % WORLD != r]
        batch = contributions(sealers[r], dtype, data[r, mine], mine, WORLD * chunks)
        engine.feed(batch, len(batch) // len(mine), 0.0)
    results = {hdr.chunk: (hdr.dst, payload) for hdr, payload in opened(engine.flush())
               if hdr.kind == Kind.RESULT}
    assert sorted(results) == list(range(WORLD * chunks))
    acc = accumulator_dtype(np.dtype(dtype))
    for g, (dst, payload) in results.items():
        others = [r for r in range(WORLD) if r != g % WORLD]
        expected = np.add.reduce(data[others, g].astype(acc), axis=0).astype(dtype)
        assert dst == g % WORLD
        assert payload == expected.tobytes(), g


def test_what_is_not_authentic_is_dropped_by_reason():
    engine, _ = keyed_engine()
    prefix = pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, WORLD, 8)
    good = Sealer(KEY, JOB, COMM, 1).seal(Kind.CONTRIB, 0, AGGREGATOR, 0, prefix + bytes(16))
    engine.feed(good, len(good), 0.0)
    engine.feed(good, len(good), 0.0)  # the same counter again
    forged = Sealer(bytes(16), JOB, COMM, 1).seal(Kind.CONTRIB, 0, AGGREGATOR, 0, prefix)
    engine.feed(forged, len(forged), 0.0)
    other_job = Sealer(KEY, JOB + 1, COMM, 1).seal(Kind.CONTRIB, 0, AGGREGATOR, 0, prefix)
    engine.feed(other_job, len(other_job), 0.0)
    engine.feed(good[:-1], len(good) - 1, 0.0)  # cut short: its length disagrees
    outsider = Sealer(KEY, JOB, COMM, WORLD).seal(Kind.CONTRIB, 0, AGGREGATOR, 0, prefix)
    engine.feed(outsider, len(outsider), 0.0)
    drops, stats = engine.counters()
    assert drops == {"replayed": 1, "bad_mac": 1, "foreign": 1, "malformed": 1,
                     "wrong_sender": 1}
    assert stats == {"contributions": 1}


def test_an_endpoint_seals_as_its_stripe_and_takes_only_its_own_chunks():
    """Registered as the job's endpoint 2 of 3, the engine takes contributions addressed to
    it with its stripe in their prefix (numbered in its own chunks), seals the results as
    that endpoint, its counter going on from where it was registered, and drops what is meant
    for another endpoint; where the ranks stripe over fewer endpoints (an aggregator lost), it
    takes the place their prefix gives it."""
    engine = Engine(8)
    engine.register(JOB, COMM, 2, 8, KEY, 1 << 40, stripe=2)
    sealer = Sealer(KEY, JOB, COMM, 1)
    prefix = pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, 2, 12, 2, 3)
    row = np.arange(4, dtype=np.int32).view(np.uint8)
    # its chunks are 2, 5, 8, 11 of 12 (a group of 1): its chunk 0 is rank 0's (chunk 2)
    good = sealer.seal(Kind.CONTRIB, 0, endpoint(2), 0, (prefix, row))
    elsewhere = sealer.seal(Kind.CONTRIB, 0, endpoint(1), 1, (prefix, row))
    other_stripe = sealer.seal(Kind.CONTRIB, 0, endpoint(2), 1, (
        pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, 2, 12, 1, 3), row))
    for datagram in (good, elsewhere, other_stripe):
        engine.feed(datagram, len(datagram), 0.0)
    [(hdr, payload)] = [m for m in opened(engine.flush()) if m[0].kind == Kind.RESULT]
    assert (hdr.src, hdr.dst, hdr.chunk, hdr.counter) == (endpoint(2), 0, 0, (1 << 40) + 1)
    assert payload == row.tobytes()
    # addressed to another endpoint; another stripe's prefix for a reduction it holds
    assert engine.counters()[0] == {"misdirected": 1, "inconsistent": 1}
    # the only endpoint left (the others' aggregators lost): place 0 of 1, all chunks its own
    alone = sealer.seal(Kind.CONTRIB, 1, endpoint(2), 0, (
        pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, 2, 12, 0, 1), row))
    engine.feed(alone, len(alone), 0.0)
    [(hdr, payload)] = [m for m in opened(engine.flush()) if m[0].kind == Kind.RESULT]
    assert (hdr.seq, hdr.src, hdr.dst, hdr.chunk) == (1, endpoint(2), 0, 0)
    assert payload == row.tobytes()



def test_a_pool_made_wider_keeps_the_rows_held_in_it():
    """A narrow contribution waits in its row of the pool; a wider one to another chunk of the
    same reduction widens the pool in place: the waiting row moves with it, and both chunks'
    results are the sums numpy takes."""
    engine, _ = keyed_engine(slots=4)
    sealers = [Sealer(KEY, JOB, COMM, r) for r in range(WORLD)]
    data = np.random.default_rng(5).integers(-1000, 1000, (WORLD, 2, 8)).astype(np.int32)
    narrow, wide = data[:, 1, :2], data[:, 0]  # chunk 1 (rank 1's): 2 elements; chunk 0: 8

    def send(rank, chunk, rows):
        engine.feed(contributions(sealers[rank], np.int32, rows[rank:rank + 1], [chunk], 8),
                    sealer_segment(rows[rank:rank + 1]), 0.0)
    send(3, 1, narrow)  # waits: rank 0 comes first
    assert engine.memory()[0] == 4 * WORLD * narrow[0].nbytes
    send(3, 0, wide)  # waits too, in a pool made wide enough for it
    assert engine.memory()[0] == 4 * WORLD * wide[0].nbytes
    for rank, chunk, rows in ((0, 1, narrow), (2, 1, narrow), (1, 0, wide), (2, 0, wide)):
        send(rank, chunk, rows)
    results = {h.chunk: p for h, p in opened(engine.flush()) if h.kind == Kind.RESULT}
    assert results == {1: narrow[[0, 2, 3]].sum(axis=0, dtype=np.int32).tobytes(),
                       0: wide[[1, 2, 3]].sum(axis=0, dtype=np.int32).tobytes()}


def first_chunks_summed() -> tuple[Engine, list[Sealer]]:
    """A 4-slot engine into which every rank has sent its contributions (ones) to chunks 0-3
    of a reduction of 16, so their results wait in its outbox; and the ranks' sealers."""
    engine, _ = keyed_engine(slots=4)
    sealers = [Sealer(KEY, JOB, COMM, r) for r in range(WORLD)]
    rows = np.ones((WORLD - 1, 2), np.float32)
    for r in range(WORLD):
        chunks = [g for g in range(4) if g != r]
        engine.feed(contributions(sealers[r], np.float32, rows, chunks, 4 * WORLD),
                    HEADER_BYTES + CONTRIB_PREFIX.size + 8 + TAG_BYTES, 0.0)
    return engine, sealers


def test_acknowledged_results_release_the_window_and_the_credit_says_so():
    engine, sealers = first_chunks_summed()
    engine.flush()
    for r in range(WORLD):
        ack = sealers[r].seal(Kind.RESULT_ACK, 0, AGGREGATOR, 1, pack_acks([r]))
        engine.feed(ack, len(ack), 0.01)
    credits = [unpack_credit(p)[0] for h, p in opened(engine.flush()) if h.kind == Kind.CREDIT]
    assert credits and max(credits) == 4
    assert engine.reductions(0) == [(0, 4)]


def test_a_result_released_before_the_flush_is_not_sent():
    """Results are sealed from the pool when the outbox is flushed: one whose owner
    acknowledged it in the meantime (its slot released) does not go; the others do."""
    engine, sealers = first_chunks_summed()
    ack = sealers[0].seal(Kind.RESULT_ACK, 0, AGGREGATOR, 1, pack_acks([0]))
    engine.feed(ack, len(ack), 0.01)
    results = {h.chunk: p for h, p in opened(engine.flush()) if h.kind == Kind.RESULT}
    assert sorted(results) == [1, 2, 3]
    assert all(p == np.full(2, WORLD - 1, np.float32).tobytes() for p in results.values())


def test_an_outbox_of_a_communicator_gone_is_never_sealed():
    engine, handle = keyed_engine()
    probe = Sealer(KEY, JOB, COMM, 1).seal(Kind.CREDIT, 5, AGGREGATOR, 0, (3).to_bytes(4, "little"))
    engine.feed(probe, len(probe), 0.0)  # answered: what rank 1 owes of a reduction refused
    engine.unregister(handle)
    assert engine.flush() == []


def test_credit_probes_queue_no_more_than_the_outbox_takes():
    """One read of a keyed member's CREDIT probes for a reduction never begun, each naming
    every chunk sent: each answer names the whole window to send again (4 KiB for 1,024
    slots). The outbox takes answers up to OUTBOX_BYTES and counts the rest as outbox_full;
    emptied, it takes the next read's as many."""
    engine = Engine(1024)
    engine.register(JOB, COMM, 2, 1024, KEY, 1 << 40)
    sealer = Sealer(KEY, JOB, COMM, 1)
    answer = (0).to_bytes(4, "little") + np.arange(1024, dtype="<u4").tobytes()
    taken = []
    for _ in range(2):
        probes = [sealer.seal(Kind.CREDIT, 7, AGGREGATOR, 0, (2**32 - 1).to_bytes(4, "little"))
                  for _ in range(65536 // (HEADER_BYTES + 4 + TAG_BYTES))]  # a read's worth
        engine.feed(b"".join(probes), len(probes[0]), 0.0)
        queued = engine.take_outbox()
        assert all((dst, kind, seq, payload) == (1, Kind.CREDIT, 7, answer)
                   for _, dst, kind, seq, _, payload in queued)
        taken.append(len(queued))
    assert taken[0] == taken[1] and OUTBOX_BYTES * 0.9 < taken[0] * len(answer) <= OUTBOX_BYTES
    assert engine.counters()[0] == {"outbox_full": 2 * len(probes) - sum(taken)}


def test_a_run_that_does_not_lie_in_its_buffer_is_refused():
    engine, handle = keyed_engine()
    for offset, stride, length, count in ((0, 0, 0, 2), (0, 4, 8, 2), (10, 8, 8, 1),
                                          (0, 8, 8, 3)):
        with pytest.raises(ValueError, match="inside its buffer"):
            engine.receive_run(handle, Kind.CONTRIB, 0, 1, AGGREGATOR, length,
                               list(range(count)), bytes(16), offset, stride, 0.0)


def test_shards_serve_their_stripes_on_threads_while_python_registers_and_reads():
    """Two shards, each a native thread on its own socket: a communicator registered in both
    (shard i as endpoint first + i), each takes its stripe's contributions and answers as its
    own endpoint, and what they counted is read while they park."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    *shard_sockets, rank = sockets
    rank.settimeout(10)
    shards = _core.Shards(8, 300.0, [s.fileno() for s in shard_sockets])
    shards.start()
    try:
        handle, granted = shards.register(JOB, COMM, 2, 3, 8, KEY, 1 << 40, 1408)
        for r in range(2):
            shards.set_address(handle, r, "127.0.0.1", rank.getsockname()[1], False)
        # 10 chunks in groups of 1 striped over 5 endpoints: this aggregator's are 3 and 4,
        # whose first chunks are g = 3 (rank 1's) and g = 4 (rank 0's)
        for r, stripe in ((0, 0), (1, 1)):
            prefix = pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, 2, 10,
                                              3 + stripe, 5)
            datagram = Sealer(KEY, JOB, COMM, r).seal(Kind.CONTRIB, 0, endpoint(3 + stripe), 0,
                                                      prefix + np.int32(40 + r).tobytes())
            rank.sendto(datagram, shard_sockets[stripe].getsockname())
        opener, results = Opener(KEY, JOB, COMM, Drops()), {}
        while len(results) < 2:
            hdr, payload = opener.open(rank.recv(4096))
            if hdr.kind == Kind.RESULT:
                results[hdr.src] = (hdr.dst, hdr.counter, bytes(payload))
        drops, stats, memory, io = shards.counters()
    finally:
        shards.close()
        for sock in sockets:
            sock.close()
    assert results == {endpoint(3): (1, (1 << 40) + 1, np.int32(40).tobytes()),
                       endpoint(4): (0, (1 << 40) + 1, np.int32(41).tobytes())}
    assert (handle, granted) == (0, 8)
    assert drops == {} and stats["contributions"] == 2 and stats["results"] == 2
    assert len(io["serve_cpu_seconds"]) == 2 and io["datagrams_in"] >= 2
    with pytest.raises(RuntimeError, match="not initialised"):
        shards.counters()


# -- the bindings' arguments ------------------------------------------------------------------

def test_numbers_out_of_their_wire_range_are_refused_not_wrapped():
    """A kind is a u8, a destination or a port a u16, a sequence number a u32: 266 would have
    sealed a RING_DATA header, route 256 set the aggregator's address, -1 slots a window of
    2^32 - 1."""
    sealer = Sealer(KEY, JOB, COMM, 1).native
    for kind, seq, dst in ((Kind.FIN + 256, 1, 0), (Kind.FIN, -1, 0), (Kind.FIN, 1, 1 << 16),
                           (Kind.FIN, 1 << 32, 0)):
        with pytest.raises(OverflowError):
            sealer.seal_detached(kind, seq, dst, 0, b"")
    with pytest.raises(OverflowError):
        sealer.counter = -1
    plane = _core.Plane(0, 2, JOB, COMM, KEY, sealer)
    with pytest.raises(OverflowError):
        plane.set_address(256, 1, "127.0.0.1", 9)
    with pytest.raises(OverflowError):
        plane.set_address(_core.ROUTE_RANK, 1, "127.0.0.1", 70000)
    with pytest.raises(OverflowError):
        plane.gather_state(-1)
    with pytest.raises(OverflowError):
        Engine(-1)
    engine, handle = keyed_engine()
    with pytest.raises(OverflowError):
        engine.set_group(handle, bytes(4), 70000)
    with pytest.raises(OverflowError):
        engine.unregister(1 << 32)
    assert sealer.counter == 0  # nothing was sealed


def test_a_spent_key_seals_nothing_more():
    """The counter is the GCM nonce: after 2^64 - 1 under one key there is none left."""
    sealer = Sealer(KEY, JOB, COMM, 1).native
    sealer.counter = (1 << 64) - 2
    sealer.seal_detached(Kind.FIN, 1, 0, 0, b"")
    with pytest.raises(ValueError, match="spent"):
        sealer.seal_detached(Kind.FIN, 2, 0, 0, b"")
    with pytest.raises(ValueError, match="spent"):
        sealer.seal_into(bytearray(128), 0, Kind.FIN, 2, 0, 0, b"")
    assert sealer.counter == (1 << 64) - 1


def test_a_budget_is_set_up_once():
    """Gathers and reductions count themselves in their budget; set up again, its counts would
    go negative when they leave."""
    budget = _core.Budget(1e6)
    with pytest.raises(RuntimeError, match="once"):
        budget.__init__(2e6)
    assert budget.rate == 1e6


# -- nonces and what a peer may make the aggregator hold --------------------------------------

def test_a_sealers_counter_only_moves_forward():
    """The counters between would be spent twice under the key: GCM's nonces repeated."""
    sealer = Sealer(KEY, JOB, COMM, 1).native
    sealer.counter = 100
    with pytest.raises(ValueError, match="only moves forward"):
        sealer.counter = 99
    sealer.counter = 100
    sealer.counter = 101
    assert sealer.counter == 101


def test_a_sealer_seals_for_one_plane():
    """Two planes serving at once would spend one counter twice; the second is refused until
    the first is gone."""
    sealer = Sealer(KEY, JOB, COMM, 1).native
    first = _core.Plane(0, 2, JOB, COMM, KEY, sealer)
    with pytest.raises(ValueError, match="another plane"):
        _core.Plane(0, 2, JOB, COMM, KEY, sealer)
    del first
    _core.Plane(0, 2, JOB, COMM, KEY, sealer)


def test_an_aggregator_is_set_up_once():
    """Set up again, it would drop its communicators, its socket and its counters."""
    engine, _ = keyed_engine()
    with pytest.raises(RuntimeError, match="initialised already"):
        engine.__init__(8)


def one_reduction(expiry: float, now: float):
    """An engine whose reductions expire after `expiry` s, rank 1 having contributed to two
    chunks of reduction #0 at `now`: (engine, handle, rank 1's sealer, the rows it sent)."""
    engine = Engine(16, expiry)
    handle, _ = engine.register(JOB, COMM, WORLD, 16, KEY, 1 << 40)
    sealer = Sealer(KEY, JOB, COMM, 1)
    rows = np.ones((2, 8), np.float32)
    engine.feed(contributions(sealer, np.float32, rows, [0, 2], 8), sealer_segment(rows), now)
    assert engine.reductions(handle) == [(0, 0)] and engine.memory()[0] > 0
    return engine, handle, sealer, rows


def test_an_idle_reduction_expires_and_frees_its_pool():
    """Rank 1 contributes to a reduction whose other ranks never do (dead, or buggy): after
    the expiry its pool is freed and its slot goes to others; the reduction is remembered as
    finished, so its late contributions make nothing new."""
    engine, handle, sealer, rows = one_reduction(1.0, 10.0)
    engine.handle_timer(10.5)
    assert engine.reductions(handle) == [(0, 0)]
    engine.handle_timer(11.1)
    assert engine.reductions(handle) == [] and engine.memory()[0] == 0
    assert dict(engine.counters()[1])["expired"] == 1
    engine.feed(contributions(sealer, np.float32, rows, [6], 8), sealer_segment(rows), 11.2)
    assert engine.reductions(handle) == []


def test_a_withdrawn_reduction_is_freed_at_once_and_not_started_again():
    """Ranks whose call a peer refused WITHDRAW the reduction: once every rank that contributed
    has, its pool is freed and its place among the communicator's reductions given back, now
    rather than at its expiry, and contributions still on their way make nothing new. A rank
    that never contributed, or one rank alone of those that did, ends nothing; a WITHDRAW for a
    reduction not begun here is let go (stale), and one with a payload is malformed."""
    engine, handle, sealer, rows = one_reduction(300.0, 1.0)
    other = Sealer(KEY, JOB, COMM, 2)
    engine.feed(contributions(other, np.float32, rows[:1], [1], 8), sealer_segment(rows), 1.0)

    def withdraw(by, seq=0, body=b""):
        sealed = by.seal(Kind.WITHDRAW, seq, AGGREGATOR, 0, body)
        engine.feed(sealed, len(sealed), 1.1)
    withdraw(Sealer(KEY, JOB, COMM, 3))  # rank 3 never contributed
    withdraw(other)
    assert engine.reductions(handle) == [(0, 0)]  # rank 1 goes on
    withdraw(sealer)
    assert engine.reductions(handle) == [] and engine.memory()[0] == 0
    assert dict(engine.counters()[1])["withdrawn"] == 1
    engine.feed(contributions(sealer, np.float32, rows, [6], 8), sealer_segment(rows), 1.2)
    assert engine.reductions(handle) == []
    withdraw(sealer, seq=1)  # nothing of #1 here yet
    assert dict(engine.counters()[0])["stale"] == 1
    withdraw(sealer, seq=2, body=b"x")
    assert dict(engine.counters()[0])["malformed"] == 1


def sealer_segment(rows: np.ndarray) -> int:
    """The size of one sealed contribution of a row of `rows`."""
    return HEADER_BYTES + CONTRIB_PREFIX.size + rows[0].nbytes + TAG_BYTES


@pytest.mark.parametrize("case", ["total 0", "chunk out of range", "beyond the window",
                                  "wider than registered"])
def test_a_contribution_that_cannot_be_taken_holds_nothing(case):
    """No reduction, slot or pool is made for it: it is dropped and counted by its reason."""
    engine = Engine(4)
    handle, _ = engine.register(JOB, COMM, WORLD, 4, KEY, 1 << 40, 64)
    sealer = Sealer(KEY, JOB, COMM, 1)
    rows = np.ones((1, 32 if case == "wider than registered" else 8), np.float32)
    total, chunk = {"total 0": (0, 0), "chunk out of range": (8, 9),
                    "beyond the window": (64, 40), "wider than registered": (8, 0)}[case]
    engine.feed(contributions(sealer, np.float32, rows, [chunk], total), sealer_segment(rows),
                1.0)
    reason = {"total 0": "inconsistent", "chunk out of range": "out_of_range",
              "beyond the window": "beyond_window", "wider than registered": "wrong_length"}
    assert dict(engine.counters()[0])[reason[case]] == 1
    assert engine.reductions(handle) == [] and engine.memory() == (0, 0, 0)


def test_a_budget_paces_one_planes_collectives():
    """A plane changes its budget without the GIL while it serves: a second plane's collective
    on the same budget is refused while the first's hold it."""
    budget = _core.Budget(1e6)
    first, second = (_core.Plane(0, 2, JOB, COMM, KEY) for _ in range(2))
    code = dtype_code(np.dtype(np.float32))
    first.reduce(0, code, False, 8, np.zeros(16, np.float32), np.zeros(8, np.float32), 64, 4, 1,
                 budget, 0.0)
    with pytest.raises(ValueError, match="another plane"):
        second.reduce(0, code, False, 8, np.zeros(16, np.float32), np.zeros(8, np.float32), 64,
                      4, 1, budget, 0.0)
    second.reduce(0, code, False, 8, np.zeros(16, np.float32), np.zeros(8, np.float32), 64, 4,
                  1, _core.Budget(1e6), 0.0)


def test_a_plane_detached_while_its_messages_are_read_sends_nothing():
    """A message's attributes run Python code, which may detach the plane: its port is gone, and
    the send must not use it."""
    plane = _core.Plane(0, 2, JOB, COMM, KEY, Sealer(KEY, JOB, COMM, 0).native)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    wake, other = socket.socketpair()
    try:
        plane.attach(udp.fileno(), -1, wake.fileno())
        plane.set_address(_core.ROUTE_RANK, 1, "127.0.0.1", udp.getsockname()[1])

        class Detaching:
            kind, seq, dst, chunk = Kind.FIN, 0, 1, 0

            @property
            def payload(self):
                plane.detach()
                return b"x"
        with pytest.raises(RuntimeError, match="detached"):
            plane.send(_core.ROUTE_RANK, [Detaching()])
    finally:
        for s in (udp, wake, other):
            s.close()


def test_the_registration_fuzz_target_finds_nothing():
    """HELLOs of every shape from keyed members (tests/fuzz_registration.py): nothing raised out
    of the service, its books within its limits after every input, another job served
    bit-exact throughout. tools/fuzz runs millions."""
    import fuzz_registration
    stats = fuzz_registration.run(20_000, seed=7, report_every=0)
    assert stats["inputs"] == 20_000 and stats["served"] == 2
    assert stats["welcomed"] > 0 and stats["registration_drops"]["refused_world"] > 0


def dicts_the_binding_returns() -> dict[str, dict]:
    """One of each dict the binding returns by key, from a plane with a reduction and a gather
    posted and from shards on a socket, by the name of its TypedDict in the stubs."""
    budget = _core.Budget(1e6)
    plane = _core.Plane(0, 2, JOB, COMM, KEY)
    plane.reduce(0, dtype_code(np.dtype(np.float32)), False, 8, np.zeros(16, np.float32),
                 np.zeros(8, np.float32), 64, 4, 1, budget, 0.0)
    plane.gather(1, np.zeros(128, np.uint8), [(0, 0), (1, 64)], 64, 32, 0, 1, budget)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        shards = _core.Shards(8, 300.0, [sock.fileno()])
        try:
            _, _, shards_memory, shards_io = shards.counters()
        finally:
            shards.close()
    return {"ReducerState": plane.reducer(0), "GatherState": plane.gather_state(1),
            "PlaneIO": plane.counters()[2], "ShardsMemory": shards_memory,
            "ShardsIO": shards_io}


def test_the_stubs_name_what_the_binding_offers():
    """overcast/native/_core.pyi lists every type, method, attribute, function and constant of
    _core, and nothing it lacks; and each dict it types by key (a TypedDict) with the keys the
    binding returns, no more, no fewer."""
    import ast
    tree = ast.parse((NATIVE / "_core.pyi").read_text())

    def members(node: ast.ClassDef) -> set[str]:
        return {n.name if isinstance(n, ast.FunctionDef) else n.target.id
                for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}

    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    keyed = {node.name: members(node) for node in classes
             if any(isinstance(b, ast.Name) and b.id == "TypedDict" for b in node.bases)}
    stubbed = {node.name: members(node) - {"__init__"} for node in classes
               if node.name not in keyed}
    constants = {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    offered = {name: {m for m in vars(obj) if not m.startswith("__")}
               for name, obj in vars(_core).items() if isinstance(obj, type)}
    assert stubbed == offered
    assert functions == {name for name, v in vars(_core).items()
                         if isinstance(v, types.BuiltinFunctionType)}
    assert constants == {name for name, v in vars(_core).items()
                         if isinstance(v, (int, float)) and not name.startswith("__")}
    assert keyed == {name: set(d) for name, d in dicts_the_binding_returns().items()}
