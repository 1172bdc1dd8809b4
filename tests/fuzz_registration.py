"""Fuzz target: the aggregator's registrations, as keyed job members gone wrong would send them.

Each input is one HELLO on one of a pool of real TCP connections to an in-process `overcast
switch` service (AggregatorService): sealed under the communicator key of a salt from a small pool
(so that communicators are met again), with every field drawn from its edges and beyond (worlds
0, 1, 2, the limit, 65534, 65535; a rank past its world; rows of 0 bytes to 2^32 - 1; the
connection's nonce or another; a length that disagrees), or raw bytes. Registered connections
are closed now and then, so communicators come and go. After every input the service's books
must hold: what is set aside within the budget, no job over its communicators, no communicator
over its world's connections, the engines' pools within the budget and holding the very
communicators the service books. Every 10,000 inputs a communicator of another job registers and runs a
reduction through the service's two shards, on their threads, bit-exact; nothing raised ever
leaves the service.

    .venv/bin/python tests/fuzz_registration.py [RUNS] [SEED]
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time

import numpy as np

from overcast.buffers import dtype_code
from overcast.aggregator.service import Limits, AggregatorService
from overcast.wire.auth import Drops, Opener, Sealer, derive_key, job_id_of
from overcast.wire.header import AGGREGATOR, Kind, MalformedError, endpoint, unpack_header
from overcast.wire.messages import pack_contribution_prefix
from overcast.wire.registration import HELLO, NONCE_BYTES

LIMITS = Limits(max_world=64, max_communicators=16, pool_bytes=8 << 20)
CONNECTIONS = 24
WORLDS = (0, 1, 2, 3, 4, 17, 63, 64, 65, 1000, 4096, 65534, 65535)
ROWS = (0, 1, 7, 8, 1408, 8952, 65440, 65507, 65508, 1 << 31, (1 << 32) - 1)


class Target:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.hostile, self.good = os.urandom(32), os.urandom(32)
        self.service = AggregatorService("127.0.0.1", 0, [self.hostile, self.good], slots=64,
                                     limits=LIMITS, shards=2)
        self.salts = [os.urandom(16) for _ in range(40)] + [b"same" + os.urandom(12)
                                                            for _ in range(4)]
        self.keys = {s: derive_key(self.hostile, s, b"comm") for s in self.salts}
        self.sealers: dict[tuple[bytes, int], Sealer] = {}
        self.clients: dict[socket.socket, socket.socket] = {}  # service side -> ours
        self.stats = {"inputs": 0, "welcomed": 0, "refused_or_dropped": 0, "malformed": 0,
                      "closed": 0, "served": 0}
        for _ in range(CONNECTIONS):
            self._connect()

    def _connect(self) -> None:
        ours = socket.create_connection(("127.0.0.1", self.service.port))
        ours.setblocking(False)
        before = set(self.service.connections)
        while set(self.service.connections) == before:
            self.service._accept()
        (theirs,) = set(self.service.connections) - before
        self.clients[theirs] = ours

    def _close(self, reg) -> None:
        self.service._disconnect(reg)
        self.clients.pop(reg.sock).close()
        self.stats["closed"] += 1
        self._connect()

    def _drain(self) -> None:
        for ours in self.clients.values():
            try:
                while ours.recv(1 << 16):
                    pass
            except (BlockingIOError, ConnectionError):
                pass

    def _sealer(self, salt: bytes, src: int, secret: bytes) -> Sealer:
        sealer = self.sealers.get((salt, src))
        if sealer is None:
            key = derive_key(secret, salt, b"comm")
            sealer = Sealer(key, job_id_of(secret), int.from_bytes(salt[:4], "little"), src)
            self.sealers[(salt, src)] = sealer
        return sealer

    def hello(self, reg) -> bytes:
        rng = self.rng
        if rng.random() < 0.03:  # raw bytes: the framing's problem, then this one's
            return os.urandom(rng.randrange(0, 200))
        salt = rng.choice(self.salts)
        world = rng.choice(WORLDS) if rng.random() < 0.7 else rng.randrange(1 << 16)
        src = rng.randrange(min(world, 70) + 3) if rng.random() < 0.9 else rng.randrange(1 << 16)
        row = rng.choice(ROWS) if rng.random() < 0.7 else rng.randrange(1 << 32)
        nonce = reg.nonce if rng.random() < 0.95 else os.urandom(NONCE_BYTES)
        stripe = 0 if rng.random() < 0.8 else rng.randrange(1 << 16)
        body = HELLO.pack(salt, world, rng.randrange(1 << 16), rng.randrange(256), row, stripe,
                          rng.randrange(1 << 16), nonce, os.urandom(NONCE_BYTES))
        if rng.random() < 0.03:  # a length that disagrees
            body = body[:rng.randrange(len(body))] + os.urandom(rng.randrange(8))
        return bytes(self._sealer(salt, src & 0xFFFF, self.hostile).seal(
            Kind.HELLO, 0, AGGREGATOR, 0, body))

    def one(self) -> None:
        service = self.service
        reg = self.rng.choice([r for r in service.connections.values() if r.comm_key is None]
                              or list(service.connections.values()))
        if reg.comm_key is not None or self.rng.random() < 0.002:
            self._close(reg)
            return
        frame = self.hello(reg)
        try:
            hdr = unpack_header(frame)
        except MalformedError:
            self.stats["malformed"] += 1
            return
        if len(frame) < hdr.frame_bytes():
            self.stats["malformed"] += 1
            return
        if service._register(reg, memoryview(frame[:hdr.frame_bytes()]), hdr):
            self.stats["welcomed"] += 1
        else:
            self.stats["refused_or_dropped"] += 1
            if self.rng.random() < 0.01:
                self._close(reg)  # as the service does with a registration it refused

    def check_books(self) -> None:
        service = self.service
        assert 0 <= service.reserved_bytes <= LIMITS.pool_bytes, service.reserved_bytes
        assert service.reserved_bytes == sum(c.reserved_bytes for c in service.comms.values())
        jobs: dict[int, int] = {}
        for comm in service.comms.values():
            jobs[comm.job] = jobs.get(comm.job, 0) + 1
            assert 2 <= comm.world <= LIMITS.max_world and comm.slots >= 1
        assert all(n <= LIMITS.max_communicators for n in jobs.values()), jobs
        memory = service.shards.counters()[2]
        assert memory["pool_bytes"] <= LIMITS.pool_bytes
        assert memory["engine_communicators"] == len(service.comms)
        assert all(len(c.conns) <= c.world for c in service.comms.values())

    def serve_another_job(self) -> None:
        """A communicator of 2 ranks of the good job registers and reduces one chunk each way,
        one through each shard: every result is the other rank's row, bit for bit, from the
        shard whose stripe it is."""
        service, salt = self.service, os.urandom(16)
        regs = [r for r in service.connections.values() if r.comm_key is None][:2]
        while len(regs) < 2:
            self._close(self.rng.choice([r for r in service.connections.values()
                                         if r.comm_key is not None]))
            regs = [r for r in service.connections.values() if r.comm_key is None][:2]
        sealers = [self._sealer(salt, rank, self.good) for rank in range(2)]
        ranks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
        try:
            for rank, reg in enumerate(regs):
                ranks[rank].bind(("127.0.0.1", 0))
                ranks[rank].settimeout(10)
                body = HELLO.pack(salt, 2, ranks[rank].getsockname()[1], 0, 1408, 0, 0,
                                  reg.nonce, os.urandom(NONCE_BYTES))
                frame = bytes(sealers[rank].seal(Kind.HELLO, 0, endpoint(0), 0, body))
                assert service._register(reg, memoryview(frame), unpack_header(frame)), \
                    "a good registration was refused"
            rows = np.arange(64, dtype=np.int32).reshape(2, 32) * 3 + self.stats["served"]
            # chunk g is rank g's and shard g's (its chunk 0): each rank contributes to the other's
            for rank in range(2):
                stripe = 1 - rank
                prefix = pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, 2, 2,
                                                  stripe, 2)
                datagram = sealers[rank].seal(Kind.CONTRIB, 0, endpoint(stripe), 0,
                                              (prefix, rows[rank].view(np.uint8)))
                ranks[rank].sendto(bytes(datagram), ("127.0.0.1", service.ports[stripe]))
            key = derive_key(self.good, salt, b"comm")
            opener = Opener(key, job_id_of(self.good), int.from_bytes(salt[:4], "little"),
                            Drops())
            results = {}
            for rank in range(2):
                while rank not in results:
                    hdr, payload = opener.open(ranks[rank].recv(1 << 16))
                    if hdr.kind == Kind.RESULT:
                        results[rank] = (hdr.src, bytes(payload))
        finally:
            for sock in ranks:
                sock.close()
        assert results == {0: (endpoint(0), rows[1].tobytes()),
                           1: (endpoint(1), rows[0].tobytes())}, results
        for reg in regs:
            self._close(reg)
        self.stats["served"] += 1


def run(runs: int, seed: int = 1, report_every: int = 1_000_000) -> dict:
    target = Target(seed)
    started = time.monotonic()
    try:
        for i in range(runs):
            target.one()
            target.check_books()
            target.stats["inputs"] += 1
            if i % 64 == 0:
                target._drain()
            if i % 10_000 == 0:
                target.serve_another_job()
            if report_every and i and i % report_every == 0:
                print(f"{i} inputs, {time.monotonic() - started:.0f} s: {target.stats}",
                      file=sys.stderr, flush=True)
    finally:
        for ours in target.clients.values():
            ours.close()
        target.service.close()
    target.stats["seconds"] = round(time.monotonic() - started, 1)
    target.stats["registration_drops"] = dict(target.service.drops)
    return target.stats


if __name__ == "__main__":
    stats = run(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000,
                int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    print(stats)
