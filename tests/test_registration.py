"""A keyed job member registering what the aggregator cannot hold: each registration is refused
to its connection alone, with the reason the rank reports, and the aggregator goes on serving
another job's collectives bit-exact, its pools within the budget it was given. And aggregators
a rank cannot use (a malformed or unresolvable name, nothing listening) are the reason it
reports, not an exception out of its rendezvous."""

import json
import os
import socket
import types

import numpy as np
import pytest

import overcast
from overcast.cluster.launch import loopback_placements, run_ranks
from overcast.switch.launch import start_switch, stop_switch
from overcast.switch.service import Limits
from overcast.transport.rendezvous import register_with_aggregators
from overcast.wire.auth import Drops, Opener, Sealer, derive_key, job_id_of

HOSTILE, GOOD = os.urandom(32), os.urandom(32)
LIMITS = Limits(max_world=4096, max_communicators=40, pool_bytes=64 << 20)


def member(address: str, world: int, *, salt: bytes | None = None, src: int = 0,
           mtu: int = 1500) -> types.SimpleNamespace:
    """Register as rank `src` of a communicator of `world` ranks of the hostile job, as a rank
    does (rendezvous.register_with_aggregators); the links it filled (switches: the connection
    held open, or switch_error)."""
    salt = salt or os.urandom(16)
    key = derive_key(HOSTILE, salt, b"comm")
    job, comm = job_id_of(HOSTILE), int.from_bytes(salt[:4], "little")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    links = types.SimpleNamespace(world=world, udp=udp, multicast=None, mtu=mtu,
                                  sealer=Sealer(key, job, comm, src),
                                  opener=Opener(key, job, comm, Drops()), switches={},
                                  switch_names={}, endpoints=[], switch_slots=0,
                                  switch_error="unregistered")
    register_with_aggregators(links, address, HOSTILE, salt, 5.0)
    udp.close()
    return links


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
                bool((buf == world * (world + 1) / 2).all()), comm._switch_error]
    finally:
        comm.close()


def test_hostile_registrations_are_refused_and_the_aggregator_serves_on(tmp_path):
    stats = tmp_path / "switch.json"
    proc, address = start_switch("127.0.0.1", 0, secrets=[HOSTILE.hex(), GOOD.hex()],
                                 stats_path=str(stats), limits=LIMITS, shards=1)
    held = []
    try:
        said = {}
        for world in (0, 1, 65534, 65535):
            said[world] = member(address, world).switch_error
        said["rank past its world"] = member(address, 4, src=9).switch_error
        # a window larger than the receive buffer: 4096 ranks' datagrams do not fit 16 MiB
        said["buffer"] = member(address, 4096).switch_error
        # two communicators whose salts share their first 4 bytes: one id on the wire
        first = member(address, 2, salt=b"same" + os.urandom(12))
        held.append(first)
        said["identity"] = member(address, 2, salt=b"same" + os.urandom(12)).switch_error
        # one salt, registered again with another world
        salt = os.urandom(16)
        held.append(member(address, 2, salt=salt))
        said["inconsistent"] = member(address, 3, salt=salt, src=1).switch_error
        # a thousand communicators held open, where the job may hold 40
        opened = [member(address, 2, mtu=300) for _ in range(1000)]
        said["communicators"] = opened[-1].switch_error
        welcomed = sum(bool(m.switches) for m in opened)
        for m in opened:
            for sock in m.switches.values():
                sock.close()  # the aggregator forgets them
        # pools: loopback's 64 KiB rows, 16 ranks: 4 MiB a slot; the job's share is 32 MiB
        big = [member(address, 16, mtu=65536) for _ in range(3)]
        held += big
        said["pool"] = big[-1].switch_error
        # the other job's collectives, while all of that is held
        results = run_ranks(good_job, loopback_placements(2, {
            "OVERCAST_SWITCH": address, "OVERCAST_SECRET": GOOD.hex(),
            "OVERCAST_LINK_BITS_PER_S": "1e9"}), timeout=120)
        alive = proc.poll() is None
    finally:
        for m in held:
            for sock in m.switches.values():
                sock.close()
        stop_switch(proc)
    for world in (0, 1, 65534, 65535):
        assert "refused this communicator" in said[world], (world, said[world])
        assert f"a world of {world}" in said[world], said[world]
    assert "rank 9 of a world of 4" in said["rank past its world"]
    assert "receive buffer" in said["buffer"], said["buffer"]
    assert "same id on the wire" in said["identity"], said["identity"]
    assert "registered with a world of 2" in said["inconsistent"], said["inconsistent"]
    assert first.switches and big[0].switches
    assert "--pool-bytes" in said["pool"], said["pool"]
    assert "--max-communicators" in said["communicators"], said["communicators"]
    assert 0 < welcomed < 40
    assert alive
    for exact_rs, exact_ar, switch_error in results:
        assert exact_rs and exact_ar and switch_error is None
    report = json.loads(stats.read_text())
    assert report["drops"]["refused_world"] == 5 and report["drops"]["refused_pool"] >= 1
    assert report["drops"]["refused_communicators"] == 1000 - welcomed
    assert max(report["peak_pool_bytes"], report["reserved_pool_bytes"]) <= LIMITS.pool_bytes


def test_a_fault_on_one_registration_costs_that_connection_alone():
    """A fault in the service's own code on one peer's input (injected into its admission)
    closes that connection and is counted; the loop serves the next registration."""
    import threading
    from overcast.switch.service import SwitchService
    service = SwitchService("127.0.0.1", 0, [HOSTILE])
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
    assert not first.switches and "failed" in first.switch_error
    assert second.switches and second.switch_error is None
    assert service.drops["registration_error"] == 1
    for sock in second.switches.values():
        sock.close()


@pytest.mark.parametrize("spec,reason", [
    ("127.0.0.1:99999", "an aggregator is host[:port], not '127.0.0.1:99999'"),
    ("a..b:18515", "cannot reach the aggregator at a..b:18515: "),  # no IDNA encoding
    ("127.0.0.1:1", "cannot reach the aggregator at 127.0.0.1:1: "),
])
def test_an_aggregator_the_rank_cannot_use_is_its_reason(spec, reason):
    links = member(spec, 2)
    assert links.switch_error.startswith(reason), links.switch_error
    assert links.switches == {} and links.endpoints == []
