"""`overcast switch`: the aggregator as a service on the network, standing in the switch.

One TCP port takes registrations: each rank of a communicator connects, gets a fresh nonce, sends
a HELLO that carries it, sealed under its communicator key (the aggregator derives that key from
the job secret it was given and the salt in the HELLO, so a HELLO it can verify comes from the
job, and from this connection), and keeps the connection open: when the service dies, every rank
sees it at once. A connection that has not registered within REGISTRATION_SECONDS is closed.
One UDP port, the same number, carries the contributions, results, acknowledgements and credit,
all authenticated per communicator and replay-checked like every other overcast datagram.

The datagrams never reach Python: the native core (overcast/native/service.h) reads them in GRO
batches, opens, reduces and seals them, and sends in GSO batches, with the GIL released, until a
registration connection has something to say; this loop then handles it and hands the socket
back. The reduction itself is the native engine's (overcast/native/aggregator.h).
"""

from __future__ import annotations

import json
import resource
import secrets
import signal
import socket
import time

from overcast.limits import check_port
from overcast.switch.aggregator import Aggregator
from overcast.transport.datagram import (DATAGRAM_TRUESIZE, enlarge_receive_buffer,
                                         multicast_group, prepare_sender)
from overcast.wire.auth import Drops, Opener, ReplayWindow, derive_key, job_id_of
from overcast.wire.header import HEADER_BYTES, Kind, MalformedError, unpack_header
from overcast.wire.registration import (HELLO, NONCE_BYTES, SWITCH_CHALLENGE, SWITCH_MAGIC,
                                        WELCOME)

REGISTRATION_SECONDS = 10.0


class _Comm:
    """A registered communicator: its handle in the engine, the slots its reductions were
    granted, its ranks' connections."""

    def __init__(self, handle: int, world: int, slots: int):
        self.handle, self.world, self.slots = handle, world, slots
        self.conns: set[socket.socket] = set()


class _Registration:
    """A TCP connection from a rank, before and after its HELLO."""

    def __init__(self, sock: socket.socket, due: float):
        self.sock = sock
        self.buf = bytearray()
        self.comm_key: tuple[int, int] | None = None
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.due = due  # until when it may take to register


class SwitchService:
    def __init__(self, host: str, port: int, job_secrets: list[bytes], slots: int = 256,
                 lifeline: int | None = None):
        check_port(port)
        self.lifeline = lifeline  # a pipe whose closing (its writer gone) stops the service
        self.secrets = {job_id_of(s): s for s in job_secrets}
        self.drops = Drops()  # the registrations'; the data path counts its own
        self.aggregator = Aggregator(slots)
        self.comms: dict[tuple[int, int], _Comm] = {}
        self.listener = socket.create_server((host, port), backlog=256)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.receive_buffer = enlarge_receive_buffer(self.udp)
        self.udp.bind((host, self.port))
        if host != "0.0.0.0":
            prepare_sender(self.udp, host, loop=False)
        self.aggregator.engine.attach(self.udp.fileno())
        self.connections: dict[socket.socket, _Registration] = {}
        self.unregistered: set[_Registration] = set()
        self.stopped = False

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
        salt, world, udp_port, ip, hears_group, nonce, theirs = HELLO.unpack_from(frame,
                                                                                  HEADER_BYTES)
        if hdr.comm != int.from_bytes(salt[:4], "little") or not 0 <= hdr.src < world:
            self.drops["foreign"] += 1
            return False
        key = derive_key(secret, salt, b"comm")
        opened = Opener(key, hdr.job, hdr.comm, self.drops).open(frame, window=ReplayWindow(0))
        if opened is None:
            return False
        if nonce != reg.nonce:  # an authentic HELLO, from another connection: replayed
            self.drops["replayed"] += 1
            return False
        comm_key = (hdr.job, hdr.comm)
        comm = self.comms.get(comm_key)
        engine = self.aggregator.engine
        if comm is None or comm.world != world:
            # A window no deeper than the receive buffer holds for all ranks at once: a slow
            # aggregator then slows the senders (they wait for credit) instead of losing
            # datagrams. Nonces must never repeat under a key, even across restarts of this
            # service: its counter starts at the clock in nanoseconds.
            slots = self.aggregator.register(comm_key, world,
                                             self.receive_buffer // (world * DATAGRAM_TRUESIZE),
                                             ids=comm_key, secret_key=key,
                                             counter=time.time_ns())
            comm = self.comms[comm_key] = _Comm(self.aggregator.handle(comm_key), world, slots)
            group, port = multicast_group(hdr.comm)
            engine.set_group(comm.handle, socket.inet_aton(group), port)
        engine.set_address(comm.handle, hdr.src, ip, udp_port, bool(hears_group))
        comm.conns.add(reg.sock)
        reg.comm_key = comm_key
        self.unregistered.discard(reg)
        try:  # a few bytes into a socket it has only read from: it blocks only if broken
            reg.sock.sendall(engine.seal(comm.handle, Kind.HELLO, 0, hdr.src, 0,
                                         WELCOME.pack(comm.slots, self.port, theirs)))
        except OSError:
            return False
        return True

    def _disconnect(self, reg: _Registration) -> None:
        self.unregistered.discard(reg)
        del self.connections[reg.sock]
        reg.sock.close()
        comm = self.comms.get(reg.comm_key) if reg.comm_key else None
        if comm is not None:
            comm.conns.discard(reg.sock)
            if not comm.conns:  # every rank has gone: forget the communicator
                del self.comms[reg.comm_key]
                self.aggregator.unregister(reg.comm_key)

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Run until stop(), SIGTERM/SIGINT or the lifeline closes: the native data path until
        a registration connection is readable, a signal comes, or a registration's time is up."""
        engine = self.aggregator.engine
        while not self.stopped:
            now = time.monotonic()
            self._expire_registrations(now)
            due = min((r.due for r in self.unregistered), default=now + 0.5)
            control = [self.listener, *self.connections]
            if self.lifeline is not None:
                control.append(self.lifeline)
            ready = engine.serve(control, min(due, now + 0.5))
            if ready == 0:
                self._accept()
            elif self.lifeline is not None and ready == len(control) - 1:
                self.stopped = True  # whoever started it has ended
            elif ready > 0:
                self._on_registration(self.connections[control[ready]])

    def stop(self, *_) -> None:
        self.stopped = True

    def close(self) -> None:
        """Close every socket: the listener, the datagram port, every rank's connection."""
        for sock in [self.listener, self.udp, *self.connections]:
            sock.close()
        self.connections.clear()

    def report(self) -> dict:
        agg = self.aggregator
        io = agg.engine.io()
        stats = agg.stats
        contributions = stats["contributions"]
        return {"drops": dict(self.drops + agg.drops), "stats": dict(stats), "slots": agg.slots,
                "receive_buffer_bytes": self.receive_buffer,
                "pool_bytes": agg.pool_bytes, "peak_pool_bytes": agg.peak_pool_bytes,
                "kept_pool_bytes": agg.kept_pool_bytes,
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "cpu_seconds": time.process_time(),
                "data_path_cpu_seconds": io["serve_cpu_seconds"],
                "cpu_us_per_contribution": io["serve_cpu_seconds"] / contributions * 1e6
                if contributions else None,
                "datagrams_in": io["datagrams_in"], "datagrams_out": io["datagrams_out"],
                "reads": io["reads"], "sends": io["sends"], "wakeups": io["wakeups"],
                "gro": bool(io["gro"]), "gso": bool(io["gso"]),
                "communicators": len(self.comms)}


def run(host: str, port: int, job_secrets: list[bytes], slots: int, stats_path: str | None,
        ready=print, lifeline: int | None = None) -> None:
    service = SwitchService(host, port, job_secrets, slots, lifeline)
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    ready(f"overcast switch listening on {host}:{service.port} (tcp and udp), "
          f"{slots} slots per reduction")
    try:
        service.serve()
    finally:
        if stats_path:
            with open(stats_path, "w") as f:
                json.dump(service.report(), f, indent=1)
        service.close()
