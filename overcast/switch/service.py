"""`overcast switch`: the aggregator as a service on the network, standing in the switch.

One TCP port takes registrations: each rank of a communicator connects, gets a fresh nonce, sends
a HELLO that carries it, sealed under its communicator key (the aggregator derives that key from
the job secret it was given and the salt in the HELLO, so a HELLO it can verify comes from the
job, and from this connection), and keeps the connection open: when the service dies, every rank
sees it at once. A connection that has not registered within REGISTRATION_SECONDS is closed.
One UDP port, the same number, carries the contributions, results, acknowledgements and credit,
all authenticated per communicator and replay-checked like every other overcast datagram. The
reduction itself is Aggregator's.
"""

from __future__ import annotations

import json
import resource
import secrets
import selectors
import signal
import socket
import time

from overcast.limits import check_port
from overcast.switch.aggregator import Aggregator
from overcast.transport.datagram import (DATAGRAM_TRUESIZE, WINDOW, UdpPort,
                                         enlarge_receive_buffer, multicast_group,
                                         prepare_sender, seal_batches)
from overcast.wire.auth import Drops, Opener, ReplayWindow, Sealer, derive_key, job_id_of
from overcast.wire.header import (AGGREGATOR, ANY, HEADER_BYTES, Kind, MalformedError,
                                  unpack_header)
from overcast.wire.registration import (HELLO, NONCE_BYTES, SWITCH_CHALLENGE, SWITCH_MAGIC,
                                        WELCOME)

REGISTRATION_SECONDS = 10.0



class _Comm:
    """A registered communicator: its keys, its ranks' datagram addresses, its connections."""

    def __init__(self, key: bytes, job: int, comm: int, world: int, drops: Drops):
        self.world = world
        self.sealer = Sealer(key, job, comm, AGGREGATOR)
        # Nonces must never repeat under a key, even across restarts of this service.
        self.sealer.counter = time.time_ns()
        self.choose = Opener(key, job, comm, drops).chooser({}, WINDOW)
        self.addresses: dict[int, tuple[str, int]] = {}
        self.hears_group: dict[int, bool] = {}
        self.group = multicast_group(comm)
        self.conns: set[socket.socket] = set()

    def everyone(self) -> list[tuple[str, int]]:
        """Where a message for every rank goes: the group if all ranks hear it."""
        if len(self.hears_group) == self.world and all(self.hears_group.values()):
            return [self.group]
        return list(self.addresses.values())


class _Registration:
    """A TCP connection from a rank, before and after its HELLO."""

    def __init__(self, sock: socket.socket, due: float):
        self.sock = sock
        self.buf = bytearray()
        self.comm_key: tuple[int, int] | None = None
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.due = due  # until when it may take to register


class SwitchService:
    def __init__(self, host: str, port: int, job_secrets: list[bytes], slots: int = 256):
        check_port(port)
        self.secrets = {job_id_of(s): s for s in job_secrets}
        self.drops = Drops()
        self.aggregator = Aggregator(slots, self.drops)
        self.comms: dict[tuple[int, int], _Comm] = {}
        self.listener = socket.create_server((host, port), backlog=256)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.receive_buffer = enlarge_receive_buffer(self.udp)
        self.udp.bind((host, self.port))
        if host != "0.0.0.0":
            prepare_sender(self.udp, host, loop=False)
        self.datagrams = UdpPort(self.udp, self.drops)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.udp, selectors.EVENT_READ, "udp")
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
        self.selector.register(sock, selectors.EVENT_READ, reg)
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
        if comm is None or comm.world != world:
            comm = self.comms[comm_key] = _Comm(key, hdr.job, hdr.comm, world, self.drops)
        # A window no deeper than the receive buffer holds for all ranks at once: a slow
        # aggregator then slows the senders (they wait for credit) instead of losing datagrams.
        slots = self.aggregator.register(comm_key, world,
                                         self.receive_buffer // (world * DATAGRAM_TRUESIZE))
        comm.addresses[hdr.src] = (socket.inet_ntoa(ip), udp_port)
        comm.hears_group[hdr.src] = bool(hears_group)
        comm.conns.add(reg.sock)
        reg.comm_key = comm_key
        self.unregistered.discard(reg)
        try:  # a few bytes into a socket it has only read from: it blocks only if broken
            reg.sock.sendall(comm.sealer.seal(Kind.HELLO, 0, hdr.src, 0,
                                              WELCOME.pack(slots, self.port, theirs)))
        except OSError:
            return False
        return True

    def _disconnect(self, reg: _Registration) -> None:
        self.unregistered.discard(reg)
        self.selector.unregister(reg.sock)
        reg.sock.close()
        comm = self.comms.get(reg.comm_key) if reg.comm_key else None
        if comm is not None:
            comm.conns.discard(reg.sock)
            if not comm.conns:  # every rank has gone: forget the communicator
                del self.comms[reg.comm_key]
                self.aggregator.unregister(reg.comm_key)

    # -- datagrams -------------------------------------------------------------------------
    def _on_datagrams(self, now: float) -> None:
        def take(run) -> None:
            self.aggregator.receive_run((run.hdr.job, run.hdr.comm), run, now)

        self.datagrams.receive(self._choose, take)

    def _choose(self, job: int, comm: int, src: int):
        """The opener and replay window of a datagram's communicator (wire.auth.open_datagrams);
        None for one not registered here."""
        registered = self.comms.get((job, comm))
        if registered is None:
            self.drops["foreign"] += 1
            return None
        return registered.choose(job, comm, src)

    def _send(self) -> None:
        """Send what the aggregator wants sent: per destination, in order, in batches."""
        outbox, routes = self.aggregator.outbox, {}
        while outbox:
            key, rank, msg = outbox.popleft()
            routes.setdefault((key, rank), []).append(msg)
        for (key, rank), messages in routes.items():
            comm = self.comms.get(key)
            if comm is None:
                continue
            if rank == ANY:
                addresses = comm.everyone()
            else:
                addresses = [comm.addresses[rank]] if rank in comm.addresses else []
            if not addresses:
                continue
            port = self.datagrams
            for view, size in seal_batches(comm.sealer, messages, port.seal_buffer):
                for address in addresses:
                    try:
                        sent = port.send_some(view, size, address)
                    except OSError:
                        self.drops["send_error"] += 1
                        continue
                    if sent < len(view):  # as a switch port would: the ranks retry
                        self.drops["send_buffer_full"] += -(-(len(view) - sent) // size)

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Run until stop() or SIGTERM/SIGINT."""
        while not self.stopped:
            now = time.monotonic()
            timer = self.aggregator.get_timer()
            if timer is not None and now >= timer:
                self.aggregator.handle_timer(now)
                timer = self.aggregator.get_timer()
            self._send()
            self._expire_registrations(now)
            wait = 0.5 if timer is None else min(0.5, max(0.0, timer - now))
            for key, _ in self.selector.select(wait):
                now = time.monotonic()
                if key.data == "accept":
                    self._accept()
                elif key.data == "udp":
                    self._on_datagrams(now)
                else:
                    self._on_registration(key.data)
                self._send()

    def stop(self, *_) -> None:
        self.stopped = True

    def close(self) -> None:
        """Close every socket: the listener, the datagram port, every rank's connection."""
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()

    def report(self) -> dict:
        agg = self.aggregator
        return {"drops": dict(self.drops), "stats": dict(agg.stats), "slots": agg.slots,
                "receive_buffer_bytes": self.receive_buffer,
                "pool_bytes": agg.pool_bytes, "peak_pool_bytes": agg.peak_pool_bytes,
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "cpu_seconds": time.process_time(), "datagrams_in": self.datagrams.datagrams_in,
                "datagrams_out": self.datagrams.datagrams_out, "reads": self.datagrams.reads,
                "sends": self.datagrams.sends,
                "communicators": len(self.comms)}


def run(host: str, port: int, job_secrets: list[bytes], slots: int, stats_path: str | None,
        ready=print) -> None:
    service = SwitchService(host, port, job_secrets, slots)
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
