"""The progress engine: the one place that owns sockets, a thread and the clock.

It runs the session's protocols without the caller's thread: reads and authenticates what
arrives, feeds it to the session, seals and writes what the session wants sent as fast as each
socket takes it, fires timers, and completes Work handles. Callers only post collectives and wait.
"""

from __future__ import annotations

import collections
import selectors
import socket
import threading
import time

from overcast.errors import CommunicatorClosedError, OvercastError
from overcast.protocols.base import DATAGRAM, MULTICAST, STREAM, Collective
from overcast.protocols.session import Session
from overcast.transport.datagram import Datagrams, seal_batches
from overcast.transport.loss import LossModel, LossSpec
from overcast.transport.rendezvous import Links
from overcast.engine.trace import Trace
from overcast.transport.stream import Stream, StreamClosed
from overcast.wire.auth import sealed_bytes
from overcast.wire.header import AGGREGATOR, ETHERNET_BYTES, IP_UDP_BYTES, datagram_link_bytes
from overcast.wire.runs import Run

# Bytes sealed ahead into a stream's queue: enough to keep the socket busy, small enough that
# the session, not the queue, decides the interleaving of collectives.
_STREAM_HIGH_WATER = 1 << 20
_CLOSE_FLUSH_SECONDS = 10.0


class Work:
    """A handle on one collective in flight, as torch.distributed's Work."""

    def __init__(self, seq: int, description: str):
        self.seq, self.description = seq, description
        self._event = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the collective finished; raise its error if it failed."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.description} #{self.seq} not complete after {timeout} s")
        if self._error is not None:
            raise type(self._error)(str(self._error))
        return True

    def exception(self) -> BaseException | None:
        return self._error


class Engine:
    def __init__(self, links: Links, session: Session, loss: LossSpec | None = None,
                 trace: Trace | None = None):
        self.links, self.session = links, session
        self.trace = trace
        self.sealer = links.sealer
        self.streams = {peer: Stream(sock, peer, links.opener)
                        for peer, sock in links.streams.items()}
        if links.switch is not None:  # kept open so that the aggregator's death is seen at once
            self.streams[AGGREGATOR] = Stream(links.switch, AGGREGATOR, links.opener)
        self._selector = selectors.DefaultSelector()
        self._masks: dict[int, int] = {}
        self._closed_bytes = [0, 0]  # bytes out, in, of streams already closed
        for stream in self.streams.values():
            self._selector.register(stream, selectors.EVENT_READ, stream)
            self._masks[stream.peer] = selectors.EVENT_READ
        # Unicast and multicast datagrams share the senders' replay windows (one counter per
        # sender) and one injected-loss model: loss is a property of this host's link.
        windows: dict = {}
        model = LossModel(loss, links.rank) if loss is not None and loss.rate else None
        self.datagrams = Datagrams(links.udp, links.opener, links.rank, windows, model)
        self.multicast = None if links.multicast is None else \
            Datagrams(links.multicast, links.opener, links.rank, windows, model)
        self._datagram_sockets = [d for d in (self.datagrams, self.multicast) if d is not None]
        for d in self._datagram_sockets:
            self._selector.register(d, selectors.EVENT_READ, d)
        self._datagram_mask = selectors.EVENT_READ
        self._addresses = {(MULTICAST, -1): links.group}
        for peer, (address, port) in enumerate(zip(links.addresses, links.udp_ports)):
            self._addresses[(DATAGRAM, peer)] = (address, port)
        if links.switch_udp is not None:
            self._addresses[(DATAGRAM, AGGREGATOR)] = links.switch_udp
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._submitted: collections.deque = collections.deque()
        self._works: dict[int, Work] = {}
        self._close_requested = False
        self._close_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"overcast-engine-{links.rank}",
                                        daemon=True)
        self._thread.start()

    # -- called from user threads ----------------------------------------------------------
    def submit(self, coll: Collective, work: Work) -> None:
        with self._lock:
            if self._close_requested:
                work._finish(CommunicatorClosedError("the communicator is closed"))
                return
            self._submitted.append((coll, work))
        self._wake()

    def abort(self, error: OvercastError) -> None:
        """Fail this communicator on every rank with `error` (bad input found by a caller)."""
        with self._lock:
            self._submitted.append((None, error))
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._close_requested = True
        self._wake()
        self._thread.join()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as err:  # a bug in the engine must fail collectives, not hang them
            self.session.fail(OvercastError(f"progress engine failed: {err!r}"))
            self._report()
            raise
        finally:
            self._shutdown()

    def _loop(self) -> None:
        session = self.session
        while True:
            now = time.monotonic()
            self._take_submissions(now)
            timer = session.get_timer()
            if timer is not None and now >= timer:
                session.handle_timer(now)
                timer = session.get_timer()
            self._fill_and_flush()
            self._report()
            if self._close_deadline is not None:
                if not any(s.queued_bytes for s in self.streams.values()) \
                        and not session.pending_routes() or now >= self._close_deadline:
                    return
            wait = None if timer is None else max(0.0, timer - now)
            if self._close_deadline is not None:
                wait = 0.05 if wait is None else min(wait, 0.05)
            events = self._selector.select(wait)
            deliver = self._deliverer(time.monotonic(), datagram=True)
            # Datagrams first: a root's end-of-multicast notice on its stream must not overtake
            # its last chunks already waiting in the socket.
            for key, mask in events:
                if isinstance(key.data, Datagrams):
                    if mask & selectors.EVENT_READ:
                        key.data.read(deliver)
                    if mask & selectors.EVENT_WRITE:
                        self._flush_datagrams()
            for key, mask in events:
                stream = key.data
                if stream is None:
                    self._drain_wake()
                elif isinstance(stream, Stream):
                    if mask & selectors.EVENT_READ:
                        self._read(stream)
                    if mask & selectors.EVENT_WRITE and stream.peer in self.streams:
                        self._flush(stream)

    def _take_submissions(self, now: float) -> None:
        with self._lock:
            batch = list(self._submitted)
            self._submitted.clear()
            closing = self._close_requested
        for coll, work in batch:
            if coll is None:
                self.session.abort(work)
                continue
            self._works[coll.seq] = work
            if self.trace:
                self.trace.begin(coll.seq, str(coll.desc), now)
            self.session.post(coll, now)
        if closing and self._close_deadline is None:
            self.session.close()
            self._close_deadline = now + _CLOSE_FLUSH_SECONDS

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _deliverer(self, now: float, datagram: bool):
        """What hands each run of authentic messages (wire.runs) to the session, saying which
        channel it came by, counting it if tracing."""
        session, trace = self.session, self.trace
        if trace is None:
            return lambda run: session.receive_run(run, now, datagram)

        def deliver(run):
            trace.count("rx", run.hdr.seq, len(run) * datagram_link_bytes(run.length), now)
            session.receive_run(run, now, datagram)
        return deliver

    def _read(self, stream: Stream) -> None:
        deliver = self._deliverer(time.monotonic(), datagram=False)
        try:
            stream.read(lambda hdr, payload: deliver(Run.one(hdr, payload)))
        except StreamClosed:
            self._drop_stream(stream)
            self.session.peer_lost(stream.peer)

    def _flush(self, stream: Stream) -> None:
        written = None
        if self.trace:
            trace, now = self.trace, time.monotonic()
            written = lambda seq, nbytes: trace.count("tx", seq, nbytes, now)  # noqa: E731
        try:
            stream.flush(written)
        except StreamClosed:
            self._drop_stream(stream)
            self.session.peer_lost(stream.peer)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if stream.queued_bytes else 0)
        if self._masks.get(stream.peer) != want:
            self._selector.modify(stream, want, stream)
            self._masks[stream.peer] = want

    def _fill_and_flush(self) -> None:
        """Seal what the session has for each route and write until the sockets are full.
        Datagrams go out as soon as the protocols release them: pacing is theirs."""
        session, seal = self.session, self.sealer.seal
        for channel, peer in session.pending_routes():
            if channel != STREAM:
                if self.datagrams.queued:
                    continue
                try:
                    self._send_datagrams(session.drain((channel, peer)),
                                         self._addresses[(channel, peer)])
                except OSError as err:
                    self._datagram_failure(err)
                self._flush_datagrams()
                continue
            stream = self.streams.get(peer)
            if stream is None:  # the peer has gone (said goodbye, or failed): nothing to send to
                session.drain((channel, peer))
                continue
            while stream is not None and not stream.queued_bytes:
                while stream.queued_bytes < _STREAM_HIGH_WATER:
                    msg = session.pop((channel, peer))
                    if msg is None:
                        break
                    stream.enqueue((seal(msg.kind, msg.seq, msg.dst, msg.chunk, msg.payload),),
                                   msg.seq)
                if not stream.queued_bytes:
                    break
                self._flush(stream)
                stream = self.streams.get(peer)

    def _send_datagrams(self, messages: list, address: tuple[str, int]) -> None:
        """Seal the messages back to back and send each run of equal-sized datagrams in one
        call (see transport.datagram.seal_batches)."""
        if self.trace:
            now = time.monotonic()
            for msg in messages:
                self.trace.count("tx", msg.seq, sealed_bytes(msg.payload) + IP_UDP_BYTES +
                                 ETHERNET_BYTES, now)
        for view, size in seal_batches(self.sealer, messages, self.datagrams.seal_buffer):
            self.datagrams.send(view, address, size)

    def _datagram_failure(self, err: OSError) -> None:
        self.datagrams.clear()
        self.session.abort(OvercastError(f"rank {self.links.rank}: {err}"))

    def _flush_datagrams(self) -> None:
        try:
            self.datagrams.flush()
        except OSError as err:
            self._datagram_failure(err)
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.datagrams.queued else 0)
        if want != self._datagram_mask:
            self._selector.modify(self.datagrams, want, self.datagrams)
            self._datagram_mask = want

    def _drop_stream(self, stream: Stream) -> None:
        if self.streams.pop(stream.peer, None) is not None:
            self._closed_bytes[0] += stream.bytes_out
            self._closed_bytes[1] += stream.bytes_in
            self._selector.unregister(stream)
            self._masks.pop(stream.peer, None)
            stream.close()

    def _report(self) -> None:
        finished = self.session.finished
        while finished:
            coll = finished.pop()
            if self.trace:
                self.trace.end(coll.seq, time.monotonic())
            work = self._works.pop(coll.seq, None)
            if work is not None:
                work._finish(coll.error)

    def _shutdown(self) -> None:
        self.session.fail(CommunicatorClosedError("the communicator is closed"))
        self._report()
        with self._lock:
            self._close_requested = True
            leftover = list(self._submitted)
            self._submitted.clear()
        for coll, work in leftover:
            if coll is not None:
                work._finish(CommunicatorClosedError("the communicator is closed"))
        for stream in list(self.streams.values()):
            self._drop_stream(stream)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        for d in self._datagram_sockets:
            d.close()

    # -- introspection ---------------------------------------------------------------------
    def memory(self) -> dict:
        """What this engine holds now: the kernel's socket buffers (send and receive, as the
        kernel sized them), its own read buffers, and the bookkeeping of the collectives in
        flight. Read from any thread: the containers are copied first (atomic in CPython)."""
        streams = list(self.streams.copy().values())
        sockets = [s.sock for s in streams] + [d.sock for d in self._datagram_sockets]
        kernel = 0
        for sock in sockets:
            if sock.fileno() >= 0:
                kernel += sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) + \
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        active = list(self.session.active.copy().values())
        return {"socket_buffer_bytes": kernel,
                "read_buffer_bytes": sum(s.buffer_bytes() for s in streams) +
                sum(d.buffer_bytes() for d in self._datagram_sockets),
                "collectives_in_flight": len(active),
                "collective_state_bytes": sum(c.state_bytes() for c in active)}

    def counters(self) -> dict:
        streams = list(self.streams.values())
        return {
            "drops": dict(self.links.drops),
            "stale": self.session.stale,
            "early_dropped": self.session.early_dropped,
            "datagrams_in": sum(d.datagrams_in for d in self._datagram_sockets),
            "datagrams_out": self.datagrams.datagrams_out,
            "datagram_reads": sum(d.reads for d in self._datagram_sockets),
            "datagram_sends": self.datagrams.sends,
            "datagram_bytes_out": self.datagrams.bytes_out,
            "injected_losses": sum(d.injected_losses for d in self._datagram_sockets),
            **self.session.stats,
            "stream_bytes_out": self._closed_bytes[0] + sum(s.bytes_out for s in streams),
            "stream_bytes_in": self._closed_bytes[1] + sum(s.bytes_in for s in streams),
        }


__all__ = ["Engine", "Work"]
