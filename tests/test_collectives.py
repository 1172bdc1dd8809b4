"""Ring AllGather and ReduceScatter between real processes over loopback TCP: bit-exact for every
dtype, sizes from one byte to 64 MiB with uneven tails, P in {2, 3, 5, 8}."""

import threading

import numpy as np
import pytest
import torch

import overcast
from by_hand import rank_1_by_hand
from overcast.buffers import BFLOAT16
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.wire.header import Kind

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
FRAME = 1 << 12  # small frames, so modest sizes cross many frame and block boundaries


def as_dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def shard(rank, count, dtype, modulus=251):
    """Distinct per rank and position (251 is prime, so no frame-sized shift maps the pattern
    onto itself), and integers every dtype holds exactly."""
    period = ((np.arange(modulus, dtype=np.int64) * 7 + rank * 13) % modulus).astype(dtype)
    return periodic(period, count)


def periodic(period, count):
    """`period` repeated to `count` elements, by doubling (np.resize concatenates per copy)."""
    out = np.empty(count, period.dtype)
    filled = min(count, len(period))
    out[:filled] = period[:filled]
    while filled < count:
        step = min(filled, count - filled)
        out[filled:filled + step] = out[:step]
        filled += step
    return out


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def addend(rank, count, dtype):
    """ReduceScatter inputs: small enough that every partial sum of 8 ranks is exact even in
    bfloat16 (integers up to 256)."""
    return shard(rank, count, dtype, modulus=16)


def counts_for(dtype):
    size = dtype.itemsize
    return sorted({1, 3, FRAME // size - 1, FRAME // size + 1, 5 * FRAME // size + 3})


def run_case(comm, rank, dtype, count):
    """One AllGather and one ReduceScatter of `count` elements per rank; True if both exact.
    Expected blocks are built one at a time, so large cases stay within a few buffers."""
    world = comm.world_size
    out = np.empty(world * count, dtype)
    comm.all_gather(out, shard(rank, count, dtype))
    ok = all(same_bits(out[r * count:(r + 1) * count], shard(r, count, dtype))
             for r in range(world))
    del out
    rs_in = np.empty(world * count, dtype)
    for r in range(world):
        rs_in[r * count:(r + 1) * count] = addend(r, count, dtype) + dtype.type(rank)
    rs_out = np.empty(count, dtype)
    comm.reduce_scatter(rs_out, rs_in)
    del rs_in
    exact = periodic((addend(rank, 16, np.int64) * world + world * (world - 1) // 2)
                     .astype(dtype), count)
    return ok and same_bits(rs_out, exact)


def check_rank(rank, big_bytes):
    """Run every case on this rank; return a list of failures (empty when all are exact)."""
    failures = []
    with overcast.Communicator(timeout=60, frame_bytes=FRAME) as comm:
        world = comm.world_size
        for name in DTYPES:
            dtype = as_dtype(name)
            for count in counts_for(dtype):
                if not run_case(comm, rank, dtype, count):
                    failures.append(f"{name} x {count}")
        # torch tensors, including bfloat16, through the same calls
        t_in = torch.arange(1000, dtype=torch.bfloat16) % 17 + rank
        t_out = torch.empty(1000 * world, dtype=torch.bfloat16)
        comm.all_gather(t_out, t_in)
        expect_t = torch.cat([torch.arange(1000, dtype=torch.bfloat16) % 17 + r
                              for r in range(world)])
        if not torch.equal(t_out, expect_t):
            failures.append("all_gather torch bfloat16")
        f_in = torch.full((world * 10,), float(rank), dtype=torch.float32)
        f_out = torch.empty(10)
        comm.reduce_scatter(f_out, f_in, op="avg")
        if not torch.equal(f_out, torch.full((10,), (world - 1) / 2)):
            failures.append("reduce_scatter avg")
    # Large messages with the default frame size, one odd tail included.
    with overcast.Communicator(timeout=120, name="large") as comm:
        for count in ((1 << 20) + 5, big_bytes):
            if not run_case(comm, rank, np.dtype(np.uint8), count):
                failures.append(f"uint8 x {count}")
    return failures


@pytest.mark.parametrize("world,big_bytes", [(2, 64 << 20), (3, 64 << 20), (5, 8 << 20),
                                             (8, 64 << 20)])
def test_ring_collectives_bit_exact(world, big_bytes):
    results = run_ranks(check_rank, loopback_placements(world), args=(big_bytes,), timeout=600)
    assert results == [[] for _ in range(world)]


def overlapped(rank):
    """Six AllGathers in flight at once, waited on in reverse order. Ranks 1 and 2 issue
    theirs first and can finish none until rank 0 issues its own, which it does only once
    they have counted theirs unfinished and met it in a second communicator's barrier.
    (Whether the results are exact, how many of this rank's six were unfinished then.)"""
    with overcast.Communicator(timeout=60) as comm, \
            overcast.Communicator(timeout=60, name="side") as side:
        world = comm.world_size
        outs = [np.empty(world * 5000, np.int32) for _ in range(6)]
        if rank == 0:
            side.barrier()
        works = [comm.all_gather(outs[i], np.full(5000, rank * 10 + i, np.int32),
                                 async_op=True) for i in range(6)]
        unfinished = sum(not w.is_completed() for w in works)
        if rank != 0:
            side.barrier()
        for w in reversed(works):
            assert w.wait(timeout=60)
        ok = all((outs[i].reshape(world, 5000) ==
                  (np.arange(world) * 10 + i)[:, None]).all() for i in range(6))
        return [ok, unfinished]


def read_to_the_end(sock):
    while sock.recv(1 << 20):
        pass


def test_a_peer_far_ahead_is_read_in_full_and_its_calls_complete_once_issued():
    """Rank 1 (by hand) sends rank 0 its part of ten ring AllGathers of 4 MiB per rank that
    rank 0 has not issued: 40 MiB of frames. Rank 0 reads them all at once (rank 1's send is
    never held up) and holds them; issued, the ten complete exact and nothing is held after."""
    count, frame, ahead = 1 << 20, 1 << 20, 10
    with rank_1_by_hand(timeout=60, frame_bytes=frame) as (comm, links):
        sock = links.streams[0]
        frames = [links.sealer.seal(Kind.RING_DATA, seq, 0, j, part)
                  for seq in range(ahead)
                  for j, part in enumerate(np.split(np.full(count, 100 + seq, np.int32), 4))]
        sender = threading.Thread(target=lambda: [sock.sendall(f) for f in frames])
        sender.start()
        sender.join(timeout=30)
        assert not sender.is_alive()  # rank 0 took all 40 MiB
        session = comm._engine.session
        reader = threading.Thread(target=read_to_the_end, args=(sock,))
        reader.start()  # rank 1 takes what rank 0 sends, until rank 0 closes
        outs = [np.empty(2 * count, np.int32) for _ in range(ahead)]
        works = [comm.all_gather(outs[seq], np.full(count, seq, np.int32), async_op=True)
                 for seq in range(ahead)]
        for work in works:
            work.wait(timeout=60)
        assert session._early_stream_total == 0 and not session.early
    reader.join()
    for seq, out in enumerate(outs):
        assert (out[:count] == seq).all() and (out[count:] == 100 + seq).all()


def through_a_torch_store(rank, port):
    """Rendezvous through torch.distributed's own TCPStore instead of overcast's."""
    import datetime
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
    with overcast.Communicator(rank, 3, store=store, timeout=30) as comm:
        out = np.empty(3 * 100, np.int64)
        comm.all_gather(out, np.full(100, rank, np.int64))
        return bool((out.reshape(3, 100) == np.arange(3)[:, None]).all())


def test_rendezvous_through_a_torch_tcpstore():
    port = loopback_placements(3)[0].env["MASTER_PORT"]
    assert run_ranks(through_a_torch_store, loopback_placements(3), args=(int(port),),
                     timeout=60) == [True] * 3


def test_several_collectives_in_flight():
    first, *others = run_ranks(overlapped, loopback_placements(3), timeout=120)
    assert first[0] and others == [[True, 6], [True, 6]]


def callbacks_past_one_that_raises(rank):
    """Rank 0 gives an AllGather three callbacks, the first raising, before rank 1 posts its
    part (a side barrier), so the engine's thread runs them. (Whether the later two ran, what
    reached threading.excepthook, and whether a second AllGather is exact.)"""
    said = []
    threading.excepthook = lambda args: said.append(
        f"{args.thread.name}: {type(args.exc_value).__name__}: {args.exc_value}")
    with overcast.Communicator(timeout=30) as comm, \
            overcast.Communicator(timeout=30, name="side") as side:
        ran = []
        out = np.empty(2 * 100, np.int32)
        if rank == 1:
            side.barrier()
        work = comm.all_gather(out, np.full(100, rank, np.int32), async_op=True)
        if rank == 0:
            def fail():
                raise ValueError("a callback's bug")
            for fn in (fail, lambda: ran.append("second"), lambda: ran.append("third")):
                work.add_done_callback(fn)
            side.barrier()
        work.wait(timeout=30)
        again = np.empty(2 * 100, np.int32)
        comm.all_gather(again, np.full(100, 10 + rank, np.int32))
        exact = bool((again.reshape(2, 100) == np.array([[10], [11]])).all())
        return [ran, said, exact]


def test_a_callback_that_raises_leaves_the_others_and_the_engine_running():
    first, second = run_ranks(callbacks_past_one_that_raises, loopback_placements(2),
                              timeout=120)
    assert first == [["second", "third"], ["overcast-engine-0: ValueError: a callback's bug"],
                     True]
    assert second == [[], [], True]
