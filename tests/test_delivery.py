"""Multicast delivery proven when a communicator is made: every rank hears every other's probe, or
every rank knows who did not, names them, and overlap() and the backend's "auto" run the ring
with a warning that says so. On loopback and on the emulated cluster with the switch dropping
the multicast it would send to two of the hosts."""

import copy
import os
import socket
import time
import warnings

import numpy as np

import overcast
from conftest import root_only
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.cluster.netns import Cluster
from overcast.transport import probe
from overcast.transport.probe import PROBE, PROBE_SECONDS, undelivered
from overcast.wire.auth import Drops, Opener, Sealer
from overcast.wire.header import ANY, Kind, unpack_header


def made(rank):
    with overcast.Communicator(timeout=20, link_bits_per_s=1e9) as comm:
        return [comm.multicast_unheard, comm.unavailable("all_gather", "multicast"),
                comm.counters()["probe_drops"]]


def test_every_rank_hears_every_other_on_loopback():
    assert run_ranks(made, loopback_placements(3), timeout=60) == [[{}, None, {}]] * 3


def _listening(key: bytes, drops: Drops):
    """Rank 0 of 2 listening for probes on one end of a datagram socket pair (each datagram
    queued whole as it is sent); the other end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    return probe._Listening(ours, Opener(key, 7, 9, drops), 0, 2), theirs


def test_a_probe_is_heard_once_per_counter_and_a_replay_is_dropped():
    key, drops = os.urandom(16), Drops()
    listening, theirs = _listening(key, drops)
    sealer = Sealer(key, 7, 9, 1)
    first = sealer.seal(Kind.HELLO, 0, ANY, 0, PROBE.ljust(64, b"\0"))
    later = sealer.seal(Kind.HELLO, 0, ANY, 0, PROBE.ljust(64, b"\0"))
    other_job = Sealer(os.urandom(16), 7, 9, 1).seal(Kind.HELLO, 0, ANY, 0, PROBE)
    for datagram in (first, first, later, first, other_job):
        theirs.send(datagram)
    listening.hear(time.monotonic() + 60)
    listening.listener.close()
    theirs.close()
    assert listening.heard == {1} and listening.last == {1: unpack_header(later).counter}
    assert drops == {"replayed": 2, "bad_mac": 1}


def test_a_flood_of_datagrams_does_not_hold_the_listener_past_its_time():
    drops = Drops()
    listening, theirs = _listening(os.urandom(16), drops)
    for _ in range(200):
        theirs.send(b"junk" * 16)
    listening.hear(time.monotonic())  # its time is up: it reads nothing
    assert drops == {} and listening.listener.recv(100) == b"junk" * 16
    listening.hear(time.monotonic() + 60)
    listening.listener.close()
    theirs.close()
    assert drops == {"malformed": 199} and not listening.heard


def test_undelivered_names_the_ranks_and_their_hosts():
    hosts = [f"10.0.0.{i}" for i in range(12)]
    assert undelivered({}, hosts) is None
    assert undelivered({1: [0, 2], 2: [1]}, hosts[:3]) == (
        "multicast not delivered: rank 1 (10.0.0.1) heard no other rank's multicast; "
        "rank 2 (10.0.0.2) did not hear rank 1 (10.0.0.1)")
    deaf = undelivered({r: [p for p in range(12) if p != r] for r in range(12)}, hosts)
    assert deaf.startswith("multicast not delivered: ranks 0 (10.0.0.0), 1 (10.0.0.1)")
    assert deaf.endswith("7 (10.0.0.7) and 4 more heard no other rank's multicast")


def _train(model, steps, **options):
    """`steps` SGD steps of the GPT through overlap(**options): the losses, the algorithms it
    ran, and the warnings it gave."""
    import torch
    from overcast.train.gpt import rank_batch
    import torch.distributed as dist

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with overcast.fsdp.overlap(model, **options) as handle:
            for step in range(steps):
                loss = model(*rank_batch(model.cfg, step, dist.get_rank(),
                                         dist.get_world_size()))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
    return losses, handle.algorithms, [[w.category.__name__, str(w.message)] for w in said]


def when_multicast_is_dropped(rank):
    """What a communicator, overlap() and an "overcast" process group make of a network that
    does not deliver multicast to hosts 2 and 3."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import overcast.distributed  # noqa: F401  registers the backend
    import overcast.fsdp
    from overcast.train.config import SHAPES, GPTConfig
    from overcast.train.gpt import build, shard

    out = {}
    dist.init_process_group("gloo")
    try:
        with overcast.Communicator(store=dist.distributed_c10d._get_default_store(),
                                   timeout=20) as comm:
            out["unheard"] = comm.multicast_unheard  # its keys strings once through JSON
            out["reason"] = comm.unavailable("all_gather", "multicast")
            try:
                comm.all_gather(np.empty(comm.world_size, np.float32), np.ones(1, np.float32),
                                algorithm="multicast")
            except overcast.InvalidArgumentError as err:
                out["refused"] = str(err)
        cfg = GPTConfig(**SHAPES["small"])
        model = build(cfg)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        twin = copy.deepcopy(model)
        out["fallback"] = _train(shard(model, mesh), 3)
        out["ring"] = _train(shard(twin, mesh), 3, allgather="ring", reduce_scatter="ring")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            group = dist.new_group(backend="overcast")
        out["group"] = [dict(group.algorithms), dict(group.fallbacks),
                        [[w.category.__name__, str(w.message)] for w in said]]
    finally:
        dist.destroy_process_group()
    return out


@root_only
def test_undelivered_multicast_is_named_and_the_ring_runs_instead():
    with Cluster(4, 100_000_000, drop_multicast=[2, 3]) as cluster:
        cluster.start_aggregator()
        results = cluster.run(when_multicast_is_dropped, timeout=300)
        dropped = [cluster.multicast_dropped(h) for h in range(4)]
    named = ("multicast not delivered: ranks 2 (198.18.0.3), 3 (198.18.0.4) heard no other "
             "rank's multicast")
    assert dropped[:2] == [0, 0] and min(dropped[2:]) > 0
    for r in results:
        assert r["unheard"] == {"2": [0, 1, 3], "3": [0, 1, 2]}
        assert r["reason"] == named
        assert named in r["refused"]
        losses, algorithms, said = r["fallback"]
        assert algorithms == {"allgather": "ring", "unpaired_allgather": "ring",
                              "reduce_scatter": "ring"}
        assert said == [["MulticastNotDeliveredWarning", f"{named}; overlap() runs its "
                         f"AllGathers and ReduceScatters on overcast's rings"]]
        ring_losses, _, ring_said = r["ring"]
        assert losses == ring_losses and ring_said == []
        algorithms, fallbacks, said = r["group"]
        # as overlap(): beside a ring AllGather an in-network ReduceScatter gains nothing
        assert algorithms == dict.fromkeys(("all_gather", "broadcast", "all_reduce",
                                            "reduce_scatter"), "ring")
        assert fallbacks == {**dict.fromkeys(("all_gather", "broadcast", "all_reduce"), named),
                             "reduce_scatter": f"{named}: an in-network ReduceScatter beside a "
                                               f"ring AllGather adds to the send direction the "
                                               f"ring loads already"}
        assert [category for category, _ in said] == ["MulticastNotDeliveredWarning"]
        assert said[0][1].startswith(named + "; group ")
        assert said[0][1].endswith(" runs all_gather, reduce_scatter, all_reduce, broadcast on "
                                   "the ring")


def made_again(rank):
    """Three communicators one after the other: how long each took, and what it found."""
    out = []
    for k in range(3):
        began = time.monotonic()
        with overcast.Communicator(name=f"again-{k}", timeout=20) as comm:
            out.append([time.monotonic() - began, comm.multicast_unheard])
    return out, sorted(probe._unheard_hosts)


@root_only
def test_a_process_that_found_a_host_unheard_waits_no_longer_for_it():
    """Without multicast the first communicator listens PROBE_SECONDS for each peer after it
    said it began; the next ones of the same process wait only a few probes' time for the hosts
    it did not hear, and find the same."""
    with Cluster(2, 100_000_000, service=False, drop_multicast=[0, 1]) as cluster:
        results = cluster.run(made_again, timeout=120)
    hosts = ["198.18.0.1", "198.18.0.2"]
    for rank, (made, unheard_hosts) in enumerate(results):  # through JSON: lists, str keys
        assert [found for _, found in made] == [{"0": [1], "1": [0]}] * 3
        assert unheard_hosts == [[hosts[rank], hosts[1 - rank]]]
        first, *later = [took for took, _ in made]
        assert first >= PROBE_SECONDS and max(later) < first, made
