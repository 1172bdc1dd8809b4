"""Point-to-point on the "overcast" backend between real processes over loopback, against gloo in
the same job: send, recv, isend, irecv and batch_isend_irecv with tags, a recv from any rank,
two ranks that each send before they receive, a recv that waits for a send its peer makes after
a collective, every dtype, non-contiguous tensors, messages past the copy budget or with no
room to copy, sizes that differ, and a peer that dies."""

import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

from overcast.cluster.launch import RankError, loopback_placements, run_ranks
from test_backend import DTYPES, same, start, values

COPY_BYTES = 1 << 20  # messages past it are sent from the caller's tensor


def exchanges(rank, backend_group=None, device="cpu"):
    """The same transfers on `backend_group` (None: the default group, overcast, with tensors on
    `device`) as on gloo (CPU tensors): what each rank received, in order, on the CPU."""
    world = dist.get_world_size()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = []
    on = device if backend_group is None else "cpu"

    def keep(t):
        assert t.device.type == on
        got.append(t.contiguous().cpu().clone())
    # a ring of blocking sends: every rank sends, then receives (gloo's send waits for the
    # recv: it does this with isend)
    t = values(rank, 1001, torch.float32).to(on)
    if backend_group is None:
        dist.send(t, nxt)
    else:
        work = dist.isend(t, nxt, group=backend_group)
    r = torch.empty(1001, device=on)
    dist.recv(r, prev, group=backend_group)
    if backend_group is not None:
        work.wait()
    keep(r)
    # tags keep their own order: rank 0 sends tag 1, 2, 1; rank 1 takes tag 2 first
    if rank == 0:
        works = [dist.isend(values(k, 7 + k, torch.int64).to(on), 1, group=backend_group, tag=tag)
                 for k, tag in enumerate([1, 2, 1])]
        for w in works:
            w.wait()
    elif rank == 1:
        for k, tag in [(1, 2), (0, 1), (2, 1)]:
            r = torch.empty(7 + k, dtype=torch.int64, device=on)
            dist.recv(r, 0, group=backend_group, tag=tag)
            keep(r)
    # a batch around the ring, each dtype
    for dtype in DTYPES + [torch.bool, torch.complex64]:
        out = values(rank, 33, torch.float32).to(dtype).to(on)
        into = torch.empty(33, dtype=dtype, device=on)
        ops = [dist.P2POp(dist.isend, out, nxt, backend_group, tag=3),
               dist.P2POp(dist.irecv, into, prev, backend_group, tag=3)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        keep(into)
    # larger than the copy budget, into a non-contiguous tensor (gloo takes contiguous ones)
    big = (torch.arange(3 * COPY_BYTES // 4, dtype=torch.float32).view(-1, 4) + rank).to(on)
    into = (torch.empty(4, big.shape[0], device=on).t() if backend_group is None
            else torch.empty_like(big))
    work = dist.isend(big, nxt, group=backend_group, tag=9)
    dist.recv(into, prev, group=backend_group, tag=9)
    work.wait()
    keep(into)
    return got


def p2p(rank):
    gloo = start(timeout=30)
    world = dist.get_world_size()
    said = {"differ": []}
    mine, theirs = exchanges(rank), exchanges(rank, gloo)
    if len(mine) != len(theirs) or not all(same(a, b) for a, b in zip(mine, theirs)):
        said["differ"].append("exchanges")
    # a recv from any rank returns the sender, on the backend and on its Communicator
    comm = dist.group.WORLD.communicator
    if rank == 0:
        senders = []
        for _ in range(world - 1):
            r = torch.empty(5)
            senders.append((dist.recv(r, tag=4), int(r[0])))
        for _ in range(world - 1):
            a = np.empty(5, np.float32)
            source = comm.recv(a, None, tag=4)
            senders.append((source, int(a[0])))
        said["senders"] = sorted(senders)
    else:
        dist.send(torch.full((5,), float(rank)), 0, tag=4)
        comm.send(np.full(5, rank, np.float32), 0, tag=4)
    # a recv that waits for a send its peer makes after a collective and a recv of its own
    # (on a queue of calls this would hold the collective: rank 0 waits for 1's all_reduce)
    if rank == 1:
        late = torch.empty(3)
        work = dist.irecv(late, 0, tag=5)
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.send(torch.full((3,), 11.0), 0, tag=6)
        work.wait()
        said["late"] = late.tolist()
    else:
        t = torch.ones(3)
        dist.all_reduce(t)
        if rank == 0:
            back = torch.empty(3)
            dist.recv(back, 1, tag=6)
            dist.send(back * 2, 1, tag=5)
    # sizes that differ: the recv raises, naming both
    if rank in (0, 1):
        try:
            if rank == 0:
                dist.recv(torch.empty(6), 1, tag=7)
            else:
                dist.send(torch.empty(2 * COPY_BYTES), 0, tag=7)  # not copied: it waits
            said["sizes"] = None
        except Exception as err:
            said["sizes"] = str(err)
    t = torch.full((9,), float(rank))
    dist.all_reduce(t)
    said["usable"] = t.tolist() == [float(sum(range(world)))] * 9
    dist.destroy_process_group()
    return said


def test_point_to_point_agrees_with_gloo_and_leaves_the_group_usable():
    env = {"OVERCAST_SEND_COPY_BYTES": str(COPY_BYTES)}
    results = run_ranks(p2p, loopback_placements(3, env), timeout=120)
    for said in results:
        assert said["differ"] == [] and said["usable"], said
    assert results[0]["senders"] == [[1, 1], [1, 1], [2, 2], [2, 2]]
    assert results[1]["late"] == [22.0] * 3
    for rank in (0, 1):
        assert f"rank 1 sent {8 * COPY_BYTES} B with tag 7 to rank 0, whose recv takes 24 B" \
            in results[rank]["sizes"], results[rank]["sizes"]


def killed_peer(rank):
    """Rank 1 dies while ranks 0 and 2 wait on it: for its send, and with a send it never
    takes (past the copy budget, so not complete at once)."""
    start(timeout=20)
    if rank == 1:
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    recv = dist.irecv(torch.empty(4), 1)
    send = dist.isend(torch.empty(2 * COPY_BYTES), 1)
    try:  # rank 1 may die before the barrier is through here
        dist.barrier()
    except Exception:
        pass
    said = {}
    for what, work in (("recv", recv), ("send", send)):
        try:
            work.wait()
            said[what] = None
        except Exception as err:
            said[what] = [type(err).__name__, str(err)]
    dist.destroy_process_group()
    return said


def test_a_peer_that_dies_fails_the_transfers_waiting_on_it():
    env = {"OVERCAST_SEND_COPY_BYTES": str(COPY_BYTES)}
    with pytest.raises(RankError) as info:
        run_ranks(killed_peer, loopback_placements(3, env), timeout=60)
    assert set(info.value.failures) == {1}
    for said in (info.value.results[0], info.value.results[2]):
        for what in ("recv", "send"):
            kind, message = said[what]
            assert kind == "PeerFailureError" and "rank 1" in message, (what, said)


def no_room_to_copy(rank):
    """Rank 0's address space has no room for a copy of its 96 MiB send: it goes from the
    caller's array, and its Work completes only once rank 1 has taken it all."""
    import resource

    import overcast
    comm = overcast.Communicator(timeout=30)
    n = 96 << 20
    try:
        if rank == 0:
            data = np.full(n, 7, np.uint8)
            limits = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/status") as f:
                size = next(int(line.split()[1]) * 1024 for line in f
                            if line.startswith("VmSize"))
            resource.setrlimit(resource.RLIMIT_AS, (size + (32 << 20), limits[1]))
            try:
                work = comm.isend(data, 1)
                at_once = work.is_completed()
            finally:
                resource.setrlimit(resource.RLIMIT_AS, limits)
            comm.barrier()  # rank 1 posts its recv after this
            work.wait()
            return at_once
        comm.barrier()
        got = np.empty(n, np.uint8)
        comm.recv(got, 0)
        return bool((got == 7).all())
    finally:
        comm.close()


def test_a_send_memory_has_no_room_to_copy_goes_from_the_callers_buffer():
    assert run_ranks(no_room_to_copy, loopback_placements(2), timeout=120) == [False, True]
