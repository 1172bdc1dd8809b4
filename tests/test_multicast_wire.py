"""Reliable multicast on the emulated cluster: real UDP multicast through the bridge, injected
loss, bit-exact results; a root that dies mid-broadcast; memory bounded by the buffers."""

import os
import resource
import signal
import subprocess
import threading

import numpy as np
import pytest

import overcast
from conftest import root_only
from overcast.cluster.launch import RankError
from overcast.cluster.netns import Cluster
from overcast.transport.datagram import chunk_bytes
from overcast.transport.loss import LossSpec

pytestmark = root_only
LOSSES = [LossSpec(0.0), LossSpec(0.01, seed=1), LossSpec(0.10, seed=2),
          LossSpec(0.05, burst=16, seed=3)]


def pattern(rank, nbytes):
    return ((np.arange(nbytes, dtype=np.int64) * 31 + rank * 7) % 251).astype(np.uint8)


def gather_cases(rank, sizes, big, roots):
    """Every size under every loss setting; the big size under 1% loss only."""
    failures, repaired, lost = [], 0, 0
    for i, loss in enumerate(LOSSES):
        with overcast.Communicator(name=f"loss{i}", timeout=60, loss=loss, roots=roots) as comm:
            world = comm.world_size
            extra = [big] if loss.rate == 0.01 else []
            for nbytes in sizes + [comm.chunk_bytes - 1, comm.chunk_bytes + 1] + extra:
                out = np.empty(world * nbytes, np.uint8)
                comm.all_gather(out, pattern(rank, nbytes), algorithm="multicast")
                if not all(np.array_equal(out[r * nbytes:(r + 1) * nbytes], pattern(r, nbytes))
                           for r in range(world)):
                    failures.append(f"all_gather {nbytes} B at loss {loss}")
                root = nbytes % world
                buf = pattern(root, nbytes) if rank == root else np.zeros(nbytes, np.uint8)
                comm.broadcast(buf, root)
                if not np.array_equal(buf, pattern(root, nbytes)):
                    failures.append(f"broadcast {nbytes} B from {root} at loss {loss}")
            counters = comm.counters()
            repaired += counters.get("repaired_chunks", 0)
            lost += counters["injected_losses"]
            comm.barrier()
    return [failures, repaired, lost]


@pytest.mark.parametrize("world,roots,big", [(2, None, 64 << 20), (3, 2, 1 << 20),
                                             (5, None, 1 << 20), (8, 2, 8 << 20)])
def test_multicast_bit_exact_under_loss(world, roots, big):
    sizes = [1, 3, 1000, 100_003]
    with Cluster(world, 1_000_000_000) as cluster:
        results = cluster.run(gather_cases, args=(sizes, big, roots), timeout=900)
    for failures, repaired, lost in results:
        assert failures == []
        assert lost > 0 and repaired > 0  # loss was injected and repaired, not avoided


def one_host_at_1500(rank, nbytes):
    """Host 1's link takes frames of 1500 bytes, the others' 9000: every rank must cut its
    datagrams for 1500. (chunk_bytes, whether the AllGather and the Broadcast were exact, or
    the error's class and message.)"""
    if rank == 1:
        subprocess.run(["ip", "link", "set", "eth0", "mtu", "1500"], check=True)
    with overcast.Communicator(timeout=10) as comm:
        world = comm.world_size
        try:
            out = np.empty(world * nbytes, np.uint8)
            comm.all_gather(out, pattern(rank, nbytes), algorithm="multicast")
            gathered = all(np.array_equal(out[r * nbytes:(r + 1) * nbytes], pattern(r, nbytes))
                           for r in range(world))
            buf = pattern(2, nbytes) if rank == 2 else np.zeros(nbytes, np.uint8)
            comm.broadcast(buf, 2)
            return [comm.chunk_bytes, gathered, np.array_equal(buf, pattern(2, nbytes))]
        except overcast.OvercastError as err:
            return [comm.chunk_bytes, type(err).__name__, str(err)]


def test_ranks_agree_on_the_datagram_size_when_one_path_has_a_smaller_mtu():
    with Cluster(3, 1_000_000_000) as cluster:
        results = cluster.run(one_host_at_1500, args=(100_003,), timeout=120)
    assert results == [[chunk_bytes(1500), True, True]] * 3


def root_dies_mid_broadcast(rank, nbytes):
    """The root SIGKILLs itself once an eighth of its broadcast has left (its plane's count,
    read as of the plane's last return to Python, so polled: at the paced rate the rest takes
    the better part of a second). Each other rank returns the error it raised and how many
    bytes of the root's data reached its buffer."""
    comm = overcast.Communicator(timeout=60)
    try:
        data = pattern(0, nbytes)
        buf = data + 1  # no byte of it is the root's; made first, so that the call is at once
        comm.barrier()
        if rank == 0:
            comm.broadcast(data, 0, async_op=True)
            while comm.counters()["datagram_bytes_out"] < nbytes // 8:
                threading.Event().wait(0.005)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.broadcast(buf, 0)
            return ["ok", "", nbytes]
        except overcast.OvercastError as err:
            return [type(err).__name__, str(err), int(np.count_nonzero(buf == data))]
    finally:
        comm.close()


def test_a_root_dying_mid_broadcast_is_an_error_everywhere_in_bounded_time():
    """Every other rank had part of the data, not all, when the root died, and fails from the
    broken connection (the timeout is a minute away), naming the root."""
    nbytes = 64 << 20
    with Cluster(4, 400_000_000) as cluster:
        with pytest.raises(RankError) as info:
            cluster.run(root_dies_mid_broadcast, args=(nbytes,), timeout=60)
    assert list(info.value.failures) == [0]
    for name, message, received in info.value.results[1:]:
        assert name == "PeerFailureError" and "rank 0" in message, message
        assert 0 < received < nbytes, received


def peak_growth(rank, nbytes):
    """Peak RSS growth during lossy multicast AllGathers, beyond the buffers already touched.
    Each starts after a barrier: a rank still repairing the last one would otherwise keep the
    next one's early datagrams (up to the session's EARLY_DATAGRAM_BYTES, a bound of its own)."""
    with overcast.Communicator(timeout=60, loss=LossSpec(0.05, seed=rank)) as comm:
        world = comm.world_size
        out = np.ones(world * nbytes, np.uint8)
        inp = np.ones(nbytes, np.uint8)
        comm.all_gather(out, inp, algorithm="multicast")  # warm: imports, socket buffers
        comm.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for _ in range(3):
            comm.barrier()
            comm.all_gather(out, inp, algorithm="multicast")
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return after - before


def test_memory_is_the_buffers_plus_a_fixed_overhead():
    nbytes = 32 << 20
    with Cluster(3, 1_000_000_000) as cluster:
        growth = cluster.run(peak_growth, args=(nbytes,), timeout=300)
    # per-chunk state is one byte per 8920-byte chunk; everything else is reused
    assert max(growth) < 16 << 20, growth
