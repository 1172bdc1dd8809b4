"""`overcast switch`: the aggregator as a service on the network, standing in the switch.

One TCP port takes registrations: each rank of a communicator connects, gets a fresh nonce, sends
a HELLO that carries it, sealed under its communicator key (the aggregator derives that key from
the job secret it was given and the salt in the HELLO, so a HELLO it can verify comes from the
job, and from this connection), and keeps the connection open: when the service dies, every rank
sees it at once. The HELLO says which stripe this aggregator's first shard is among the job's
endpoints (native/numbering.h); each shard seals under its own stripe's source id, and the
WELCOME (an HMAC under a key for welcomes, binding the rank's nonce) gives the shards' datagram
ports. A connection that has not registered within REGISTRATION_SECONDS is closed.

A job member may be buggy or hostile, so what a HELLO asks is held to the aggregator's Limits: a
registration beyond one (a world too large, too many communicators for its job, pools past the
memory budget, a receive buffer too small for its world) is refused to that connection alone,
with the reason, and everything else carries on. Every communicator's pools are bounded when it
registers (at most MAX_REDUCTIONS reductions of slots x world x its widest row), so the budget
holds by construction. Results go to the address the registration came from.
The data path runs over `shards` cores (overcast/native/shards.h): each shard is a native
thread with its own UDP port (the first one the same number as the TCP port), engine, pools,
replay windows and timers, and is the job's aggregator endpoint first + i, so ranks stripe
their chunks over the shards and every contribution to a chunk reaches one thread. The
datagrams never reach Python: each shard reads them in GRO batches, opens, reduces and seals
them, and sends in GSO batches (overcast/native/service.h, aggregator.h). This thread, the
control thread, takes registrations and hands each communicator to every shard, pausing them
for it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import resource
import secrets
import selectors
import signal
import socket
import time

from overcast.limits import check_port, check_shards, check_slots
from overcast.native import EXPIRY_SECONDS, MAX_REDUCTIONS, _core
from overcast.transport.datagram import (DATAGRAM_TRUESIZE, MAX_DATAGRAM, enlarge_receive_buffer,
                                         multicast_group, prepare_sender)
from overcast.wire.auth import Drops, Opener, derive_key, job_id_of
from overcast.wire.header import HEADER_BYTES, MAX_STRIPES, Kind, MalformedError, unpack_header
from overcast.wire.registration import (HELLO, NONCE_BYTES, REFUSAL_LABEL, SWITCH_CHALLENGE,
                                        SWITCH_MAGIC, WELCOME_LABEL, Refused, pack_refusal,
                                        pack_welcome)

REGISTRATION_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one aggregator takes (overcast switch --max-world, --max-communicators,
    --pool-bytes): the largest world, communicators per job, and the bytes every registered
    communicator's reduction pools may reach together at their largest, each job served an
    even share of them."""

    max_world: int = 4096
    max_communicators: int = 256
    pool_bytes: int = 1 << 30


class Refusal(Exception):
    """A registration the aggregator does not take: its reason, and words for the rank."""

    def __init__(self, reason: Refused, words: str):
        super().__init__(words)
        self.reason = reason


class _Comm:
    """A registered communicator: its handle in the shards' engines, its world, widest row and
    first stripe, the slots its reductions were granted, the pool bytes set aside for them in
    all the shards, its ranks' connections."""

    def __init__(self, job: int, wire_id: int, handle: int, world: int, max_row: int,
                 stripe: int, slots: int, shards: int):
        self.job, self.wire_id, self.handle = job, wire_id, handle
        self.world, self.max_row, self.stripe, self.slots = world, max_row, stripe, slots
        self.pool_bytes = shards * MAX_REDUCTIONS * slots * world * max_row
        self.conns: set[socket.socket] = set()


class _Registration:
    """A TCP connection from a rank, before and after its HELLO."""

    def __init__(self, sock: socket.socket, due: float):
        self.sock = sock
        self.buf = bytearray()
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.due = due  # until when it may take to register
        self.comm_key: tuple[int, bytes] | None = None  # (job, salt) once registered


def default_shards() -> int:
    """The cores this process may use: one shard each."""
    return len(os.sched_getaffinity(0))


class SwitchService:
    def __init__(self, host: str, port: int, job_secrets: list[bytes], slots: int = 256,
                 lifeline: int | None = None, limits: Limits = Limits(),
                 expiry: float | None = None, shards: int = 1):
        check_port(port)
        check_slots(slots)
        check_shards(shards)
        self.limits, self.slots = limits, slots
        self.secrets = {job_id_of(s): s for s in job_secrets}
        self.drops = Drops()  # the registrations'; the data path counts its own
        self.comms: dict[tuple[int, bytes], _Comm] = {}  # by job and salt
        self.wire_ids: set[tuple[int, int]] = set()  # (job, id on the wire) of those
        self.reserved_pool_bytes = 0
        self.listener = socket.create_server((host, port), backlog=256)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.udp: list[socket.socket] = []  # a socket per shard, the first on `port`
        for i in range(shards):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.append(sock)
            self.receive_buffer = enlarge_receive_buffer(sock)
            sock.bind((host, self.port if i == 0 else 0))
            if host != "0.0.0.0":
                prepare_sender(sock, host, loop=False)
        self.ports = [sock.getsockname()[1] for sock in self.udp]
        self.shards = _core.Shards(slots, EXPIRY_SECONDS if expiry is None else expiry,
                                   [sock.fileno() for sock in self.udp])
        self.connections: dict[socket.socket, _Registration] = {}
        # what the control thread waits on: the listener, the registrations, the lifeline (a
        # pipe whose closing, its writer gone, stops the service), and a pair stop() writes to
        # (a signal or another thread)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        if lifeline is not None:
            self._selector.register(lifeline, selectors.EVENT_READ)
        self.unregistered: set[_Registration] = set()
        self.stopped = False
        # last: threads that read the sockets start once nothing above can fail and leave
        # them reading sockets garbage collection closes
        self.shards.start()

    # -- registration ----------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        reg = _Registration(sock, time.monotonic() + REGISTRATION_SECONDS)
        try:  # a few bytes into an empty socket buffer: never blocks
            sock.sendall(SWITCH_CHALLENGE.pack(SWITCH_MAGIC, reg.nonce))
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self.connections[sock] = reg
        self._selector.register(sock, selectors.EVENT_READ, reg)
        self.unregistered.add(reg)

    def _expire_registrations(self, now: float) -> None:
        for reg in [r for r in self.unregistered if now >= r.due]:
            self.drops["registration_timeout"] += 1
            self._disconnect(reg)

    def _on_registration(self, reg: _Registration) -> None:
        try:
            data = reg.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._disconnect(reg)
            return
        if reg.comm_key is not None:
            return  # nothing more is expected on a registered connection
        reg.buf += data
        if len(reg.buf) < HEADER_BYTES:
            return
        try:
            hdr = unpack_header(reg.buf)
        except MalformedError:
            self.drops["malformed"] += 1
            self._disconnect(reg)
            return
        total = hdr.frame_bytes()
        if len(reg.buf) < total:
            return
        if not self._register(reg, memoryview(bytes(reg.buf[:total])), hdr):
            self._disconnect(reg)

    def _register(self, reg: _Registration, frame: memoryview, hdr) -> bool:
        secret = self.secrets.get(hdr.job)
        if secret is None or hdr.kind != Kind.HELLO or hdr.length != HELLO.size:
            self.drops["foreign"] += 1
            return False
        salt, world, udp_port, hears_group, max_row, stripe, nonce, theirs = HELLO.unpack_from(
            frame, HEADER_BYTES)
        if hdr.comm != int.from_bytes(salt[:4], "little"):
            self.drops["foreign"] += 1
            return False
        key = derive_key(secret, salt, b"comm")
        opened = Opener(key, hdr.job, hdr.comm, self.drops).open(frame)
        if opened is None:
            return False
        if nonce != reg.nonce:  # an authentic HELLO, from another connection: replayed
            self.drops["replayed"] += 1
            return False
        try:  # results go where the registration came from, not where a HELLO says
            ip = reg.sock.getpeername()[0]
        except OSError:  # gone already: admit nothing no connection holds
            return False
        try:
            comm = self._admit(hdr.job, salt, hdr.src, world, max_row, stripe, key)
        except Refusal as refusal:
            self.drops[f"refused_{refusal.reason.name.lower()}"] += 1
            self._say(reg, pack_refusal(derive_key(secret, salt, REFUSAL_LABEL), theirs,
                                        refusal.reason, str(refusal)))
            return False
        self.shards.set_address(comm.handle, hdr.src, ip, udp_port, bool(hears_group))
        comm.conns.add(reg.sock)
        reg.comm_key = (hdr.job, salt)
        self.unregistered.discard(reg)
        return self._say(reg, pack_welcome(derive_key(secret, salt, WELCOME_LABEL), theirs,
                                           comm.slots, self.ports))

    def _admit(self, job: int, salt: bytes, src: int, world: int, max_row: int, stripe: int,
               key: bytes) -> _Comm:
        """The registered communicator of this salt, or a new one within the limits."""
        if not src < world:
            raise Refusal(Refused.WORLD, f"rank {src} of a world of {world}")
        comm = self.comms.get((job, salt))
        if comm is not None:
            if (comm.world, comm.max_row, comm.stripe) != (world, max_row, stripe):
                raise Refusal(Refused.INCONSISTENT,
                              f"this communicator is registered with a world of {comm.world}, "
                              f"rows of {comm.max_row} bytes and stripe {comm.stripe}, not "
                              f"{world}, {max_row} and {stripe} (OVERCAST_SWITCH must name the "
                              f"same aggregators in the same order on every rank)")
            return comm
        wire_id = int.from_bytes(salt[:4], "little")
        limits = self.limits
        if not 2 <= world <= limits.max_world:
            raise Refusal(Refused.WORLD, f"a world of {world} ranks; this aggregator takes 2 "
                                         f"to {limits.max_world} (--max-world)")
        if stripe + len(self.ports) > MAX_STRIPES:
            raise Refusal(Refused.INCONSISTENT, f"this aggregator's {len(self.ports)} shards "
                                                f"from stripe {stripe}; a job stripes over at "
                                                f"most {MAX_STRIPES} aggregator endpoints")
        if not 0 < max_row <= MAX_DATAGRAM:
            raise Refusal(Refused.INCONSISTENT, f"rows of {max_row} bytes; a datagram carries "
                                                f"1 to {MAX_DATAGRAM}")
        if (job, wire_id) in self.wire_ids:
            raise Refusal(Refused.IDENTITY, "another communicator of this job has the same id "
                                            "on the wire (its salt's first 4 bytes)")
        if sum(c.job == job for c in self.comms.values()) >= limits.max_communicators:
            raise Refusal(Refused.COMMUNICATORS,
                          f"the job holds {limits.max_communicators} communicators here "
                          f"already (--max-communicators)")
        # A window no deeper than the receive buffer holds for all ranks at once: a slow
        # aggregator then slows the senders (they wait for credit) instead of losing datagrams.
        slots = min(self.slots, self.receive_buffer // (world * DATAGRAM_TRUESIZE))
        if slots < 1:
            raise Refusal(Refused.BUFFER, f"the receive buffer ({self.receive_buffer} bytes) "
                                          f"holds less than one datagram per rank of {world}")
        # Each job has an even share of the budget: one job's members cannot take another's.
        share = limits.pool_bytes // len(self.secrets)
        per_slot = len(self.ports) * MAX_REDUCTIONS * world * max_row
        left = min(limits.pool_bytes - self.reserved_pool_bytes,
                   share - sum(c.pool_bytes for c in self.comms.values() if c.job == job))
        slots = min(slots, left // per_slot)
        if slots < 1:
            raise Refusal(Refused.POOL, f"its reductions need {per_slot} bytes of pool per slot; "
                                        f"{max(left, 0)} of the job's {share} are left "
                                        f"(--pool-bytes, shared among the jobs served)")
        # A fresh random start for the aggregator's counter under this key: never the clock,
        # which can step back, and never a start an earlier run of this service may have used.
        counter = secrets.randbits(62)
        try:
            handle, granted = self.shards.register(job, wire_id, world, stripe, slots, key,
                                                   counter, max_row)
        except (ValueError, MemoryError) as err:
            raise Refusal(Refused.MEMORY, f"the aggregator could not take it: {err}") from None
        comm = self.comms[(job, salt)] = _Comm(job, wire_id, handle, world, max_row, stripe,
                                               granted, len(self.ports))
        self.wire_ids.add((job, wire_id))
        self.reserved_pool_bytes += comm.pool_bytes
        group, port = multicast_group(wire_id)
        self.shards.set_group(comm.handle, socket.inet_aton(group), port)
        return comm

    @staticmethod
    def _say(reg: _Registration, data: bytes) -> bool:
        """A few bytes into a socket it has only read from: it blocks only if broken."""
        try:
            reg.sock.sendall(data)
        except OSError:
            return False
        return True

    def _disconnect(self, reg: _Registration) -> None:
        self.unregistered.discard(reg)
        del self.connections[reg.sock]
        self._selector.unregister(reg.sock)
        reg.sock.close()
        comm = self.comms.get(reg.comm_key) if reg.comm_key else None
        if comm is not None:
            comm.conns.discard(reg.sock)
            if not comm.conns:  # every rank has gone: forget the communicator
                del self.comms[reg.comm_key]
                self.wire_ids.discard((comm.job, comm.wire_id))
                self.reserved_pool_bytes -= comm.pool_bytes
                self.shards.unregister(comm.handle)

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Take registrations until stop(), SIGTERM/SIGINT or the lifeline closes; the shards
        serve the datagrams meanwhile, on their own threads."""
        while not self.stopped:
            now = time.monotonic()
            self._expire_registrations(now)
            due = min((r.due for r in self.unregistered), default=now + 0.5)
            for key, _ in self._selector.select(max(0.0, min(due, now + 0.5) - now)):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._wake_r.recv(64)
                elif key.data is None:
                    self.stopped = True  # the lifeline: whoever started it has ended
                elif key.fileobj in self.connections:
                    reg = key.data
                    try:
                        self._on_registration(reg)
                    except Exception:  # a bug on a peer's input costs that peer, not the service
                        self.drops["registration_error"] += 1
                        if reg.sock in self.connections:
                            self._disconnect(reg)

    def stop(self, *_) -> None:
        self.stopped = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # full: a wake-up is pending anyway
            pass

    def close(self) -> None:
        """Stop the shards and close every socket: the listener, the datagram ports, every
        rank's connection."""
        self.shards.close()
        self._selector.close()
        for sock in [self.listener, *self.udp, *self.connections, self._wake_r, self._wake_w]:
            sock.close()
        self.connections.clear()

    def report(self) -> dict:
        drops, stats, memory, io = self.shards.counters()
        contributions = stats.get("contributions", 0)
        cpu = sum(io["serve_cpu_seconds"])
        return {"drops": dict(self.drops + collections.Counter(drops)), "stats": stats,
                "slots": self.slots, "shards": len(self.ports), "ports": self.ports,
                "receive_buffer_bytes": self.receive_buffer, **memory,
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "cpu_seconds": time.process_time(),
                "data_path_cpu_seconds": cpu,
                "shard_cpu_seconds": io["serve_cpu_seconds"],
                "shard_contributions": io["serve_contributions"],
                "cpu_us_per_contribution": cpu / contributions * 1e6 if contributions else None,
                "datagrams_in": io["datagrams_in"], "datagrams_out": io["datagrams_out"],
                "reads": io["reads"], "sends": io["sends"], "wakeups": io["wakeups"],
                "gro": bool(io["gro"]), "gso": bool(io["gso"]),
                "communicators": len(self.comms),
                "reserved_pool_bytes": self.reserved_pool_bytes,
                "pool_budget_bytes": self.limits.pool_bytes}


def run(host: str, port: int, job_secrets: list[bytes], slots: int, stats_path: str | None,
        ready=print, lifeline: int | None = None, limits: Limits = Limits(),
        expiry: float | None = None, shards: int = 1) -> None:
    service = SwitchService(host, port, job_secrets, slots, lifeline, limits, expiry, shards)
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    ready(f"overcast switch listening on {host}:{service.port} (tcp and udp), "
          f"{shards} shard{'s' if shards > 1 else ''} (udp {','.join(map(str, service.ports))}), "
          f"{slots} slots per reduction")
    try:
        service.serve()
    finally:
        if stats_path:
            with open(stats_path, "w") as f:
                json.dump(service.report(), f, indent=1)
        service.close()
