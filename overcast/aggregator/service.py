"""`overcast aggregator`: the aggregator as a service on the network, standing in the switch.

One TCP port takes registrations: each rank of a communicator connects, gets a fresh nonce, sends
a HELLO that carries it, sealed under its communicator key (the aggregator derives that key from
the job secret it was given and the salt in the HELLO, so a HELLO it can verify comes from the
job, and from this connection), and keeps the connection open, sending nothing more on it (a
byte closes it): when the service dies, every rank sees it at once. The HELLO says which stripe
this aggregator's first shard is among the job's endpoints (native/common/numbering.h); each shard
seals under its own stripe's source id, and the WELCOME (an HMAC under a key for welcomes,
binding the rank's nonce) gives the shards' datagram ports. A connection that has not
registered within REGISTRATION_SECONDS is closed.

Anyone can reach the port, so a connection costs the service little before it registers: it
may send one HELLO of its exact size and nothing else (any other header closes it as soon as it
parses), at most MAX_UNREGISTERED (or a quarter of the descriptors) wait at once, a 16th of
those from one address (one more sheds the oldest of its address, or past the cap, of the
address holding the most: one host's crowd sheds only its own), and an accept that fails
for want of descriptors, buffers or memory is counted and the listener rests for
ACCEPT_BACKOFF_SECONDS, the connections waiting in the backlog; nothing the port meets ends
the service.
The descriptor limit is raised to its hard limit at start (each rank holds a connection).

A job member may be buggy or hostile, so what a HELLO asks is held to the aggregator's Limits: a
registration beyond one (a world too large, too many communicators for its job, memory past the
budget, connections past the job's share of the descriptors, a receive buffer too small for its
world, a rank registered already) is refused to that connection alone, with the reason, and
everything else carries on. What a communicator can make the aggregator hold (its ranks'
connections here; in every shard its ranks' state and replay windows, and at most
MAX_REDUCTIONS pools of slots x world x its widest row, the one a finished reduction leaves for
the next among them: Shards.comm_bytes) is set aside from the budget when it registers, so the
budget holds by construction; so is a connection a rank of its world from its job's share of
the descriptors. Results go to the address the registration came from.
The data path runs over `shards` cores (overcast/native/aggregator/shards.h): each shard is a
native thread with its own UDP port (the first one the same number as the TCP port), engine,
pools, replay windows and timers, and is the job's aggregator endpoint first + i, so ranks
stripe their chunks over the shards and every contribution to a chunk reaches one thread. The
datagrams never reach Python: each shard reads them in GRO batches, opens, reduces and seals
them, and sends in GSO batches (overcast/native/aggregator/service.h, aggregator.h). This
thread, the control thread, takes registrations and hands each communicator to every shard,
pausing them for it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import resource
import secrets
import selectors
import signal
import socket
import time

from overcast.limits import check_port, check_shards, check_slots
from overcast.native import EXPIRY_SECONDS, _core
from overcast.transport.datagram import (
    DATAGRAM_TRUESIZE,
    MAX_DATAGRAM,
    enlarge_receive_buffer,
    multicast_group,
    prepare_sender,
)
from overcast.wire.auth import Drops, Opener, derive_key, job_id_of
from overcast.wire.header import (
    HEADER_BYTES,
    MAX_STRIPES,
    TAG_BYTES,
    Kind,
    MalformedError,
    unpack_header,
)
from overcast.wire.registration import (
    AGGREGATOR_CHALLENGE,
    AGGREGATOR_MAGIC,
    EPOCH_SHIFT,
    HELLO,
    NONCE_BYTES,
    REFUSAL_LABEL,
    WELCOME_LABEL,
    Refused,
    pack_refusal,
    pack_welcome,
)

REGISTRATION_SECONDS = 10.0
HELLO_FRAME_BYTES = HEADER_BYTES + HELLO.size + TAG_BYTES  # all a connection may send
MAX_UNREGISTERED = 1024  # connections waiting for their HELLO at once, at most
ADDRESS_SHARE = 16  # a source address holds at most this fraction (1/16) of them
ACCEPT_BACKOFF_SECONDS = 0.1
ACCEPTS_PER_WAKE = 64
# accept's errors that say the process or the system ran short: waiting helps, retrying at once
# would spin (the connections wait in the backlog meanwhile)
SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# What a registered connection costs this process (its socket object, registration, selector
# entry), set aside with its communicator for each of its ranks: measured at about 1 KiB.
CONNECTION_BYTES = 2048
# Descriptors kept beside the service's own sockets: the stats file it writes as it stops, and
# the one an accept takes before a waiting connection is shed for it.
SPARE_DESCRIPTORS = 8


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one aggregator takes (overcast aggregator --max-world, --max-communicators,
    --pool-bytes): the largest world, communicators per job, and the bytes every registered
    communicator may make it hold together at their largest (pools, replay windows, ranks'
    state and connections), each job served an even share of them."""

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
    first stripe, the slots its reductions were granted, the bytes of the budget set aside for
    it, its ranks' connections by rank."""

    def __init__(
        self,
        job: int,
        wire_id: int,
        handle: int,
        world: int,
        max_row: int,
        stripe: int,
        slots: int,
        reserved_bytes: int,
    ):
        self.job, self.wire_id, self.handle = job, wire_id, handle
        self.world, self.max_row, self.stripe, self.slots = world, max_row, stripe, slots
        self.reserved_bytes = reserved_bytes
        self.conns: dict[int, socket.socket] = {}


class _Registration:
    """A TCP connection from a rank, before and after its HELLO."""

    def __init__(self, sock: socket.socket, address: str, due: float):
        self.sock, self.address = sock, address  # address: where it came from
        self.buf = bytearray()
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.due = due  # until when it may take to register
        self.comm_key: tuple[int, bytes] | None = None  # (job, salt) once registered
        self.rank = -1  # once registered


class _Waiting:
    """The connections waiting for their HELLO: oldest first, and by the address they came
    from, so that the address holding the most gives way first."""

    def __init__(self, per_address: int):
        self.per_address = per_address
        self.oldest_first: dict[_Registration, None] = {}
        self.by_address: dict[str, dict[_Registration, None]] = {}
        # the addresses holding n connections in holding[n], in the order each came to n
        self.holding: list[dict[str, None]] = [{} for _ in range(per_address + 1)]

    def __len__(self) -> int:
        return len(self.oldest_first)

    def oldest(self) -> _Registration | None:
        return next(iter(self.oldest_first), None)

    def full(self, address: str) -> bool:
        """Whether `address` holds its share."""
        return len(self.by_address.get(address, ())) >= self.per_address

    def oldest_of(self, address: str) -> _Registration:
        return next(iter(self.by_address[address]))

    def busiest(self) -> str:
        """An address holding the most (there is one)."""
        return next(iter(next(h for h in reversed(self.holding) if h)))

    def add(self, reg: _Registration) -> None:
        """Takes a connection of an address below its share."""
        regs = self.by_address.setdefault(reg.address, {})
        self._moved(reg.address, len(regs), len(regs) + 1)
        regs[reg] = None
        self.oldest_first[reg] = None

    def remove(self, reg: _Registration) -> None:
        """Forgets a connection, if it waits."""
        if reg not in self.oldest_first:
            return
        del self.oldest_first[reg]
        regs = self.by_address[reg.address]
        del regs[reg]
        self._moved(reg.address, len(regs) + 1, len(regs))
        if not regs:
            del self.by_address[reg.address]

    def _moved(self, address: str, held: int, holds: int) -> None:
        if held:
            del self.holding[held][address]
        if holds:
            self.holding[holds][address] = None


def default_shards() -> int:
    """The cores this process may use: one shard each."""
    return len(os.sched_getaffinity(0))


def raise_descriptor_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one: a job of P ranks and C
    communicators holds P x C connections."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit the kernel does not take
        pass


class AggregatorService:
    def __init__(
        self,
        host: str,
        port: int,
        job_secrets: list[bytes],
        slots: int = 256,
        lifeline: int | None = None,
        limits: Limits = Limits(),
        expiry: float | None = None,
        shards: int = 1,
    ):
        check_port(port)
        check_slots(slots)
        check_shards(shards)
        self.limits, self.slots = limits, slots
        self.secrets = {job_id_of(s): s for s in job_secrets}
        self.drops = Drops()  # the registrations'; the data path counts its own
        self.comms: dict[tuple[int, bytes], _Comm] = {}  # by job and salt
        self.wire_ids: set[tuple[int, int]] = set()  # (job, id on the wire) of those
        self.reserved_bytes = 0  # of the budget, set aside for the communicators
        # waiting for their HELLO: a quarter of the descriptors at most, so that a crowd of
        # them leaves the rest to registered ranks, and a 16th of those from one address, so
        # that one host's crowd leaves the rest to others
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_unregistered = (
            MAX_UNREGISTERED
            if soft == resource.RLIM_INFINITY
            else max(1, min(MAX_UNREGISTERED, soft // 4))
        )
        self.unregistered = _Waiting(max(1, self.max_unregistered // ADDRESS_SHARE))
        self.job_connections = self._connections_per_job(soft, shards)
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
        self.shards = _core.Shards(
            slots,
            EXPIRY_SECONDS if expiry is None else expiry,
            [sock.fileno() for sock in self.udp],
        )
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
        self.listening_again: float | None = None  # the listener rests until then
        self.stopped = False
        # last: threads that read the sockets start once nothing above can fail and leave
        # them reading sockets garbage collection closes
        self.shards.start()

    def _connections_per_job(self, soft: int, shards: int) -> int | None:
        """Each job's even share of the descriptors this process may open (numbers below
        `soft`) that are left for registered connections, once its own are set aside (those
        open, and what the service opens: the listener, its selector, a pair to wake it, each
        shard's socket, eventfd and epoll), with those for connections waiting and
        SPARE_DESCRIPTORS: one job cannot take the descriptors another's ranks need. None if
        unlimited; ValueError if too few for a world of 2 a job."""
        if soft == resource.RLIM_INFINITY:
            return None
        open_below = sum(int(fd) < soft for fd in os.listdir("/proc/self/fd")) - 1  # listdir's
        kept = open_below + 4 + 3 * shards + self.max_unregistered + SPARE_DESCRIPTORS
        share = (soft - kept) // len(self.secrets)
        if share < 2:
            raise ValueError(
                f"{soft} descriptors (ulimit -n) are too few for the aggregator: "
                f"it keeps {kept} for itself, its {shards} shard(s) and "
                f"{self.max_unregistered} connection(s) waiting to register, and "
                f"needs 2 more for each job's ranks: {kept + 2 * len(self.secrets)} "
                f"or more"
            )
        return share

    # -- registration ----------------------------------------------------------------------
    def _accept(self) -> bool:
        """Take one connection from the backlog: whether there may be more."""
        try:
            sock, (address, *_) = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as err:  # counted, never raised: the port stays open to everyone
            name = errno.errorcode.get(err.errno, err.errno) if err.errno is not None else None
            self.drops[f"accept_{name}".lower()] += 1
            if err.errno not in SCARCE:
                return True  # that connection's own (ECONNABORTED, EPROTO, EPERM)
            # Nobody is shed for it: Linux says EMFILE at the limit whether or not a connection
            # waits, so the one that took the last descriptor would go. The backlog holds them.
            if self.listening_again is None:
                self._selector.unregister(self.listener)
            self.listening_again = time.monotonic() + ACCEPT_BACKOFF_SECONDS
            return False
        reg = _Registration(sock, address, time.monotonic() + REGISTRATION_SECONDS)
        try:  # a few bytes into an empty socket buffer: never blocks
            sock.sendall(AGGREGATOR_CHALLENGE.pack(AGGREGATOR_MAGIC, reg.nonce))
        except OSError:  # reset already
            self.drops["challenge_unsent"] += 1
            sock.close()
            return True
        sock.setblocking(False)
        try:
            self._selector.register(sock, selectors.EVENT_READ, reg)
        except OSError:  # epoll took no more (ENOMEM, ENOSPC): that connection goes
            self.drops["unwatched"] += 1
            sock.close()
            return True
        waiting = self.unregistered
        if waiting.full(address):  # its address's oldest goes
            self._shed(waiting.oldest_of(address))
        elif len(waiting) >= self.max_unregistered:  # the oldest of the address holding most
            self._shed(waiting.oldest_of(waiting.busiest()))
        self.connections[sock] = reg
        waiting.add(reg)
        return True

    def _shed(self, reg: _Registration) -> None:
        self.drops["unregistered_shed"] += 1
        self._disconnect(reg)

    def _listen_again(self, now: float) -> None:
        if self.listening_again is not None and now >= self.listening_again:
            self.listening_again = None
            self._selector.register(self.listener, selectors.EVENT_READ)

    def _expire_registrations(self, now: float) -> None:
        while (reg := self.unregistered.oldest()) is not None and now >= reg.due:
            self.drops["registration_timeout"] += 1  # oldest first: the first due
            self._disconnect(reg)

    def _on_registration(self, reg: _Registration) -> None:
        try:  # never more than the HELLO: reg.buf stays within its frame
            data = reg.sock.recv(HELLO_FRAME_BYTES - len(reg.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._disconnect(reg)
            return
        if reg.comm_key is not None:  # nothing is expected on a registered connection
            self.drops["sent_after_registering"] += 1
            self._disconnect(reg)
            return
        reg.buf += data
        if len(reg.buf) < HEADER_BYTES:
            return
        try:
            hdr = unpack_header(reg.buf)
        except MalformedError:
            self.drops["malformed"] += 1
            self._disconnect(reg)
            return
        if not self._hello_header(hdr):  # refused before a byte more is read
            self._disconnect(reg)
            return
        if len(reg.buf) == HELLO_FRAME_BYTES and not self._register(
            reg, memoryview(bytes(reg.buf)), hdr
        ):
            self._disconnect(reg)

    def _hello_header(self, hdr) -> bool:
        """Whether a header is a HELLO of its size, from a job served here; counted if not."""
        if hdr.kind != Kind.HELLO or hdr.length != HELLO.size:
            self.drops["not_hello"] += 1
            return False
        if hdr.job not in self.secrets:
            self.drops["foreign"] += 1
            return False
        return True

    def _register(self, reg: _Registration, frame: memoryview, hdr) -> bool:
        if not self._hello_header(hdr):
            return False
        secret = self.secrets[hdr.job]
        salt, world, udp_port, hears_group, max_row, stripe, epoch, nonce, theirs = (
            HELLO.unpack_from(frame, HEADER_BYTES)
        )
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
            comm = self._admit(hdr.job, salt, hdr.src, world, max_row, stripe, epoch, key)
        except Refusal as refusal:
            self.drops[f"refused_{refusal.reason.name.lower()}"] += 1
            self._say(
                reg,
                pack_refusal(
                    derive_key(secret, salt, REFUSAL_LABEL), theirs, refusal.reason, str(refusal)
                ),
            )
            return False
        try:
            self.shards.set_address(comm.handle, hdr.src, ip, udp_port, bool(hears_group))
        except BaseException:  # a communicator no connection holds is given back at once
            if not comm.conns:
                self._forget((hdr.job, salt))
            raise
        comm.conns[hdr.src] = reg.sock
        reg.comm_key, reg.rank = (hdr.job, salt), hdr.src
        self.unregistered.remove(reg)
        reg.buf = bytearray()
        return self._say(
            reg,
            pack_welcome(derive_key(secret, salt, WELCOME_LABEL), theirs, comm.slots, self.ports),
        )

    def _admit(
        self,
        job: int,
        salt: bytes,
        src: int,
        world: int,
        max_row: int,
        stripe: int,
        epoch: int,
        key: bytes,
    ) -> _Comm:
        """The registered communicator of this salt, or a new one within the limits."""
        if not src < world:
            raise Refusal(Refused.WORLD, f"rank {src} of a world of {world}")
        comm = self.comms.get((job, salt))
        if comm is not None:
            if (comm.world, comm.max_row, comm.stripe) != (world, max_row, stripe):
                raise Refusal(
                    Refused.INCONSISTENT,
                    f"this communicator is registered with a world of {comm.world}, "
                    f"rows of {comm.max_row} bytes and stripe {comm.stripe}, not "
                    f"{world}, {max_row} and {stripe} (OVERCAST_AGGREGATORS must "
                    f"name the same aggregators in the same order on every rank)",
                )
            if src in comm.conns:  # so a communicator holds at most its world's connections
                raise Refusal(
                    Refused.RANK,
                    f"rank {src} of this communicator is registered already, on another connection",
                )
            return comm
        wire_id = int.from_bytes(salt[:4], "little")
        limits = self.limits
        if not 2 <= world <= limits.max_world:
            raise Refusal(
                Refused.WORLD,
                f"a world of {world} ranks; this aggregator takes 2 "
                f"to {limits.max_world} (--max-world)",
            )
        # Each job has an even share of the descriptors, set aside a connection per rank of
        # each of its communicators: one job's members cannot lock another's ranks out.
        held = sum(c.world for c in self.comms.values() if c.job == job)
        if self.job_connections is not None and held + world > self.job_connections:
            raise Refusal(
                Refused.CONNECTIONS,
                f"a world of {world} needs as many connections here; "
                f"{self.job_connections - held} of the job's {self.job_connections} "
                f"are left (its share of the descriptors the aggregator may open: "
                f"ulimit -n, shared among the jobs served)",
            )
        if stripe + len(self.ports) > MAX_STRIPES:
            raise Refusal(
                Refused.INCONSISTENT,
                f"this aggregator's {len(self.ports)} shards "
                f"from stripe {stripe}; a job stripes over at "
                f"most {MAX_STRIPES} aggregator endpoints",
            )
        if not 0 < max_row <= MAX_DATAGRAM:
            raise Refusal(
                Refused.INCONSISTENT,
                f"rows of {max_row} bytes; a datagram carries 1 to {MAX_DATAGRAM}",
            )
        if (job, wire_id) in self.wire_ids:
            raise Refusal(
                Refused.IDENTITY,
                "another communicator of this job has the same id "
                "on the wire (its salt's first 4 bytes)",
            )
        if sum(c.job == job for c in self.comms.values()) >= limits.max_communicators:
            raise Refusal(
                Refused.COMMUNICATORS,
                f"the job holds {limits.max_communicators} communicators here "
                f"already (--max-communicators)",
            )
        # A window no deeper than the receive buffer holds for all ranks at once: a slow
        # aggregator then slows the senders (they wait for credit) instead of losing datagrams.
        slots = min(self.slots, self.receive_buffer // (world * DATAGRAM_TRUESIZE))
        if slots < 1:
            raise Refusal(
                Refused.BUFFER,
                f"the receive buffer ({self.receive_buffer} bytes) "
                f"holds less than one datagram per rank of {world}",
            )
        # Each job has an even share of the budget: one job's members cannot take another's.
        # A communicator's cost is linear in its slots: what its ranks hold whatever the slots
        # (their connections here, their state and replay windows in every shard), then each
        # slot of each of its reductions in every shard.
        share = limits.pool_bytes // len(self.secrets)
        engines = self.shards.comm_bytes(world, 0, max_row)
        per_slot = self.shards.comm_bytes(world, 1, max_row) - engines
        fixed = engines + world * CONNECTION_BYTES
        left = min(
            limits.pool_bytes - self.reserved_bytes,
            share - sum(c.reserved_bytes for c in self.comms.values() if c.job == job),
        )
        slots = min(slots, (left - fixed) // per_slot)
        if slots < 1:
            raise Refusal(
                Refused.POOL,
                f"it needs {fixed} bytes and {per_slot} per slot; "
                f"{max(left, 0)} of the job's {share} are left "
                f"(--pool-bytes, shared among the jobs served)",
            )
        # The counter's start under this key: in the range of the epoch the first HELLO names
        # (wire.registration), which an instance that served this communicator before (this
        # service, or one that ran at this address earlier) never reached; at a random place in
        # it, never the clock, which can step back.
        counter = (epoch << EPOCH_SHIFT) | secrets.randbits(40)
        try:
            handle, granted = self.shards.register(
                job, wire_id, world, stripe, slots, key, counter, max_row
            )
        except (ValueError, MemoryError) as err:
            raise Refusal(Refused.MEMORY, f"the aggregator could not take it: {err}") from None
        comm = self.comms[(job, salt)] = _Comm(
            job, wire_id, handle, world, max_row, stripe, granted, fixed + granted * per_slot
        )
        self.wire_ids.add((job, wire_id))
        self.reserved_bytes += comm.reserved_bytes
        try:
            group, port = multicast_group(wire_id)
            self.shards.set_group(comm.handle, socket.inet_aton(group), port)
        except BaseException:  # registered and booked, yet no connection holds it: undone
            self._forget((job, salt))
            raise
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
        self.unregistered.remove(reg)
        del self.connections[reg.sock]
        self._selector.unregister(reg.sock)
        reg.sock.close()
        if reg.comm_key is None:  # it never registered
            return
        comm = self.comms.get(reg.comm_key)
        if comm is not None:
            del comm.conns[reg.rank]
            if not comm.conns:  # every rank has gone: forget the communicator
                self._forget(reg.comm_key)

    def _forget(self, comm_key: tuple[int, bytes]) -> None:
        """Give back what a communicator held: its budget, its id on the wire, its place in
        every shard."""
        comm = self.comms.pop(comm_key)
        self.wire_ids.discard((comm.job, comm.wire_id))
        self.reserved_bytes -= comm.reserved_bytes
        self.shards.unregister(comm.handle)

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Take registrations until stop(), SIGTERM/SIGINT or the lifeline closes; the shards
        serve the datagrams meanwhile, on their own threads."""
        while not self.stopped:
            now = time.monotonic()
            self._expire_registrations(now)
            self._listen_again(now)
            oldest = self.unregistered.oldest()
            due = now + 0.5 if oldest is None else oldest.due
            if self.listening_again is not None:
                due = min(due, self.listening_again)
            for key, _ in self._selector.select(max(0.0, min(due, now + 0.5) - now)):
                if key.fileobj is self.listener:
                    for _ in range(ACCEPTS_PER_WAKE):
                        if not self._accept():
                            break
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
        return {
            "drops": dict(self.drops + collections.Counter(drops)),
            "stats": stats,
            "slots": self.slots,
            "shards": len(self.ports),
            "ports": self.ports,
            "receive_buffer_bytes": self.receive_buffer,
            **memory,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "cpu_seconds": time.process_time(),
            "data_path_cpu_seconds": cpu,
            "shard_cpu_seconds": io["serve_cpu_seconds"],
            "shard_contributions": io["serve_contributions"],
            "cpu_us_per_contribution": cpu / contributions * 1e6 if contributions else None,
            "datagrams_in": io["datagrams_in"],
            "datagrams_out": io["datagrams_out"],
            "reads": io["reads"],
            "sends": io["sends"],
            "wakeups": io["wakeups"],
            "gro": bool(io["gro"]),
            "gso": bool(io["gso"]),
            "communicators": len(self.comms),
            "connections": len(self.connections),
            "reserved_bytes": self.reserved_bytes,
            "pool_budget_bytes": self.limits.pool_bytes,
        }


def run(
    host: str,
    port: int,
    job_secrets: list[bytes],
    slots: int,
    stats_path: str | None,
    ready=print,
    lifeline: int | None = None,
    limits: Limits = Limits(),
    expiry: float | None = None,
    shards: int = 1,
) -> None:
    raise_descriptor_limit()
    service = AggregatorService(host, port, job_secrets, slots, lifeline, limits, expiry, shards)
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    ready(
        f"overcast aggregator listening on {host}:{service.port} (tcp and udp), "
        f"{shards} shard{'s' if shards > 1 else ''} (udp {','.join(map(str, service.ports))}), "
        f"{slots} slots per reduction"
    )
    try:
        service.serve()
    finally:
        if stats_path:
            with open(stats_path, "w") as f:
                json.dump(service.report(), f, indent=1)
        service.close()
