"""The progress engine: the one place that owns sockets, a thread and the clock.

It runs the session's protocols without the caller's thread: reads and authenticates what
arrives, feeds it to the session, seals and writes what the session wants sent as fast as each
socket takes it, fires timers, and completes Work handles. Callers only post collectives and
point-to-point transfers, and wait.

The datagram sockets belong to the rank's native plane (overcast/native/rank/port.h): the engine's
thread waits in it with the GIL released, and it reads, opens, sends and paces datagrams there,
coming back to Python only for what Python must act on: messages of Python's protocols, a
reduction drained, a stream or a submission ready (the selector's own descriptor is in its
wait), or a Python timer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import selectors
import socket
import threading
import time
import warnings
from typing import cast

from overcast.engine.rejoin import Rejoiner
from overcast.engine.trace import Trace
from overcast.errors import (
    AggregatorLostWarning,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    OvercastError,
    mark_peers_told,
)
from overcast.native import _core
from overcast.protocols.base import DATAGRAM, MULTICAST, STREAM, Collective
from overcast.protocols.p2p import P2P_KINDS, Transfer
from overcast.protocols.session import Session
from overcast.transport.datagram import enlarge_receive_buffer
from overcast.transport.loss import LossSpec
from overcast.transport.rendezvous import Links, Registration
from overcast.transport.stream import Stream, StreamClosed
from overcast.wire.header import Header, Kind, datagram_link_bytes, endpoint
from overcast.wire.registration import MAX_EPOCH
from overcast.wire.runs import Run

# Bytes sealed ahead into a stream's queue: enough to keep the socket busy, small enough that
# the session, not the queue, decides the interleaving of collectives.
_STREAM_HIGH_WATER = 1 << 20
_CLOSE_FLUSH_SECONDS = 10.0
# How long a closing engine waits for its peers to read its last words (a GOODBYE, an ABORT)
# and close their side: a socket closed with bytes unread resets its connection, and a peer's
# kernel that takes the reset throws away what it had not read yet, those words too.
_LINGER_SECONDS = 0.5
# The longest the engine waits in the plane before it looks at its own state again.
_MAX_WAIT = 0.5


def _report_callback_error(err: Exception) -> None:
    """Say what a Work's callback raised the way a thread's uncaught error is said, without
    ending the thread: never raised into the engine's loop."""
    try:
        threading.excepthook(
            threading.ExceptHookArgs(
                (type(err), err, err.__traceback__, threading.current_thread())
            )
        )
    except Exception:  # a hook that raises: nothing more can be said from here
        pass


class Work:
    """A handle on one collective or transfer in flight, as torch.distributed's Work. `source`
    is a recv's sender, once it is complete."""

    def __init__(self, seq: int, description: str):
        self.seq, self.description = seq, description
        self.source: int | None = None
        self._event = threading.Event()
        # set once no peer can refuse the call any more: every peer described a matching one,
        # or it finished (see Communicator.all_reduce)
        self._verified = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list = []

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._event.set()
            self._verified.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception as err:  # each still runs (one may open another's stream gate)
                _report_callback_error(err)

    def add_done_callback(self, fn) -> None:
        """Call fn() once the collective finished, failed or not: at once if it has, otherwise on
        the thread that finishes it (the engine's). fn must be quick. What it raises on the
        engine's thread goes to threading.excepthook (printed, as for a thread that died), and
        the engine and the other callbacks go on."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the collective finished; raise its error if it failed (marked
        `peers_told`: it came from the communicator, which needs no refusal sent for it)."""
        if not self._event.wait(timeout):
            name = self.description if self.seq < 0 else f"{self.description} #{self.seq}"
            raise TimeoutError(f"{name} not complete after {timeout} s")
        if self._error is not None:
            raise mark_peers_told(type(self._error)(str(self._error)))
        return True

    def wait_verified(self) -> None:
        """Block until no peer can refuse the collective any more (it may still be running)."""
        self._verified.wait()

    def exception(self) -> BaseException | None:
        return self._error


class Engine:
    def __init__(
        self,
        links: Links,
        session: Session,
        loss: LossSpec | None = None,
        trace: Trace | None = None,
    ):
        self.links, self.session = links, session
        self.trace = trace
        self.sealer = links.sealer
        self.streams = {
            peer: Stream(sock, peer, links.opener) for peer, sock in links.streams.items()
        }
        # kept open: an aggregator's death is seen at once
        for peer, sock in links.aggregator_sockets.items():
            self.streams[peer] = Stream(sock, peer, links.opener)
        self._selector = selectors.DefaultSelector()
        self._masks: dict[int, int] = {}  # what each stream is watched for
        self._closed_bytes = [0, 0]  # bytes out, in, of streams already closed
        self.python_cpu_seconds = 0.0  # the engine thread's CPU outside the plane's wait
        self._python_since = 0.0  # the engine thread's CPU time when it last left the wait
        for stream in self.streams.values():
            self._selector.register(stream, selectors.EVENT_READ, stream)
            self._masks[stream.peer] = selectors.EVENT_READ
        # The datagram sockets go to the native plane, which shares the senders' replay windows
        # between them (one counter per sender) and applies the injected loss: loss is a
        # property of this host's link.
        self.plane = session.plane
        self._datagram_sockets = [s for s in (links.udp, links.multicast) if s is not None]
        for sock in self._datagram_sockets:
            sock.setblocking(False)
            enlarge_receive_buffer(sock)
        self.plane.attach(
            links.udp.fileno(),
            -1 if links.multicast is None else links.multicast.fileno(),
            self._selector.fileno(),
        )
        if loss is not None and loss.rate:
            self.plane.set_loss(loss.rate, loss.burst, loss.seed)
        if trace is not None:  # the plane counts the datagrams it sends and takes itself
            self.plane.set_trace(trace.bin_seconds)
        self._routes = {
            (MULTICAST, -1): _core.ROUTE_GROUP,
            **{
                (DATAGRAM, endpoint(e)): _core.ROUTE_AGGREGATOR
                for e in range(max(len(links.endpoints), 1))
            },
        }
        self.plane.set_address(_core.ROUTE_GROUP, 0, *links.group)
        for peer, (address, port) in enumerate(zip(links.addresses, links.udp_ports)):
            self.plane.set_address(_core.ROUTE_RANK, peer, address, port)
        if links.endpoints:
            self.plane.set_stripes(len(links.endpoints))
        for stripe, (address, port) in enumerate(links.endpoints):
            self.plane.set_address(_core.ROUTE_AGGREGATOR, stripe, address, port)
        if links.aggregator_sockets:
            session.watch_aggregators(links.aggregator_names, len(links.endpoints))
        # Aggregators lost: a thread that registers with them anew (made at the first loss),
        # the new registrations not taken back yet, and the rounds acted on.
        self._rejoiner: Rejoiner | None = None
        self._renewed: dict[int, Stream] = {}
        self._epoch_seen = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._submitted: collections.deque = collections.deque()
        self._works: dict[int, Work] = {}
        # done, waiting for their streams to write them, each until its deadline
        self._finishing: list[tuple[Collective | Transfer, float]] = []
        self._close_requested = False
        self._close_deadline: float | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"overcast-engine-{links.rank}", daemon=True
        )
        self._thread.start()

    # -- called from user threads ----------------------------------------------------------
    def submit(self, coll: Collective, work: Work) -> None:
        self._submit("post", coll, work)

    def submit_transfer(self, op: Transfer, work: Work) -> None:
        """Post a point-to-point send or recv; `work` completes when it does."""
        self._submit("transfer", op, work)

    def _submit(self, action: str, item, work: Work) -> None:
        with self._lock:
            if self._close_requested:
                work._finish(CommunicatorClosedError("the communicator is closed"))
                return
            self._submitted.append((action, item, work))
        self._wake()

    def _hand(self, action: str, *args) -> bool:
        """Hand the engine's thread something from another (False: it is closing)."""
        with self._lock:
            if self._close_requested:
                return False
            self._submitted.append((action, *args))
        self._wake()
        return True

    def refuse(self, seq: int, error: OvercastError) -> None:
        """Give collective number `seq` to a call this rank refused (Session.refuse)."""
        with self._lock:
            if self._close_requested:
                return
            self._submitted.append(("refuse", seq, error))
        self._wake()

    def abort(self, error: OvercastError) -> None:
        """Fail this communicator on every rank with `error` (bad input found by a caller)."""
        with self._lock:
            self._submitted.append(("abort", error))
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._close_requested = True
        self._wake()
        self._thread.join()
        if self._rejoiner is not None:  # stopped by the engine's thread on its way out
            self._rejoiner.join()

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
        self._python_since = time.thread_time()  # its CPU outside the plane's wait holds the GIL
        back_by = time.monotonic()  # when the loop should be back here
        while True:
            now = time.monotonic()
            if now - back_by > min(session.timeout, session.failover_seconds):
                # The engine stood still past the timeout or the bound an aggregator may stay
                # silent (its process was stopped, or starved of CPU): what came meanwhile is
                # read before the timers judge anyone by it.
                self._python_events()
                self._serve(now)
                now = time.monotonic()
            self._take_submissions(now)
            timer = session.get_timer()
            if timer is not None and now >= timer:
                session.handle_timer(now)
                timer = session.get_timer()
            self._fill_and_flush()
            self._report()
            if session.epoch != self._epoch_seen:  # a loss or take-back agreed on
                self._rejoin()
            if self._close_deadline is not None:
                drained = (
                    not any(s.queued_bytes for s in self.streams.values())
                    and not session.pending_routes()
                )
                if drained or now >= self._close_deadline:
                    return
            wait = _MAX_WAIT if timer is None else min(_MAX_WAIT, max(0.0, timer - now))
            if self._close_deadline is not None:
                wait = min(wait, 0.05)
            self._serve(now + wait)
            back_by = now + wait

    def _serve(self, until: float) -> None:
        """Wait in the plane (which serves the datagrams) until `until`, or until it has
        something for Python, and act on that: it looks at the sockets at least once."""
        self.python_cpu_seconds += time.thread_time() - self._python_since
        why = self.plane.serve(until)
        self._python_since = time.thread_time()
        if self.trace:
            self.trace.add_bins(self.plane.trace_bins())
        if why == _core.PORT_RUNS:
            self._deliver_runs()
        self.session.poll_plane(time.monotonic())
        if why == _core.PORT_PYTHON:
            self._python_events()
        elif why == _core.PORT_ERROR:
            raise OSError("the datagram plane's wait failed")

    def _deliver_runs(self) -> None:
        """Hand the session the messages of the plane's last read that are Python's."""
        copy, runs = self.plane.runs()
        if copy is None:  # nothing of the plane's last read is Python's
            return
        data = memoryview(copy)
        deliver = self._deliverer(time.monotonic(), datagram=True)
        for kind, job, comm, seq, src, dst, length, counter, chunks, offset, stride in runs:
            deliver(
                Run(
                    Header(kind, job, comm, seq, src, dst, chunks[0], length, counter),
                    chunks,
                    data,
                    offset,
                    stride,
                )
            )

    def _python_events(self) -> None:
        for key, mask in self._selector.select(0):
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
        for action, *args in batch:
            if action == "abort":
                self.session.abort(*args)
            elif action == "refuse":
                seq, error = args
                self.session.refuse(seq, error, now)
            elif action == "transfer":
                op, work = args
                self._works[op.holder] = work
                self.session.transfer(op, now)
            elif action == "seal":  # a registration's HELLO: the sealer's counter is this thread's
                payload, dst, future = args
                if future.set_running_or_notify_cancel():
                    future.set_result(bytes(self.sealer.seal(Kind.HELLO, 0, dst, 0, payload)))
            elif action == "registered":
                peer, registration = args
                self._take_registration(peer, registration, now)
            else:
                coll, work = args
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
            if run.hdr.kind not in P2P_KINDS:  # their numbers are no collective's
                trace.count("rx", run.hdr.seq, len(run) * datagram_link_bytes(run.length), now)
            session.receive_run(run, now, datagram)

        return deliver

    def _read(self, stream: Stream) -> None:
        deliver = self._deliverer(time.monotonic(), datagram=False)
        try:
            stream.read(lambda hdr, payload: deliver(Run.one(hdr, payload)))
        except StreamClosed:
            self._lose(stream)

    def _flush(self, stream: Stream) -> None:
        written = None
        if self.trace:
            trace, now = self.trace, time.monotonic()
            written = lambda seq, nbytes: trace.count("tx", seq, nbytes, now)  # noqa: E731
        try:
            stream.flush(written)
        except StreamClosed:
            # What the peer sent before it went is still to be read (an ABORT or a GOODBYE may
            # wait behind the failed write), and says why it went.
            self._read(stream)
            if stream.peer in self.streams:
                self._lose(stream)
            return
        # always read (a peer's death or ABORT is seen at once); written while frames wait
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if stream.queued_bytes else 0)
        if self._masks[stream.peer] != want:
            self._selector.modify(stream, want, stream)
            self._masks[stream.peer] = want

    def _fill_and_flush(self) -> None:
        """Seal what the session has for each route and write until the sockets are full.
        Datagrams go out as soon as the protocols release them: pacing is theirs."""
        session, seal = self.session, self.sealer.seal_for_stream
        for channel, peer in session.pending_routes():
            if channel != STREAM:
                self._send_datagrams(session.drain((channel, peer)), (channel, peer))
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
                    stream.enqueue(
                        seal(msg.kind, msg.seq, msg.dst, msg.chunk, msg.payload),
                        msg.seq if msg.holder is None else msg.holder,
                    )
                if not stream.queued_bytes:
                    break
                self._flush(stream)
                stream = self.streams.get(peer)

    def _send_datagrams(self, messages: list, route: tuple[int, int]) -> None:
        """Seal the messages back to back and send each run of equal-sized datagrams in one
        call, natively (the plane's outbox: one counter with the streams' sealer; the plane
        counts them for the trace)."""
        code = self._routes.get(route, _core.ROUTE_RANK)
        self.plane.send(code, messages)

    def _lose(self, stream: Stream) -> None:
        """The connection to stream's peer went: drop it and tell the session (an aggregator by
        the host:port its registration named)."""
        self._drop_stream(stream)
        if self._renewed.get(stream.peer) is stream:  # a new registration: to register again
            self.session.registration_closed(stream.peer)
            self._rejoin()
        else:
            self.session.peer_lost(stream.peer, self.links.aggregator_names.get(stream.peer))

    def _drop_stream(self, stream: Stream) -> None:
        if self.streams.pop(stream.peer, None) is not None:
            self._closed_bytes[0] += stream.bytes_out
            self._closed_bytes[1] += stream.bytes_in
            self._selector.unregister(stream)
            self._masks.pop(stream.peer)
            stream.close()

    # -- aggregators lost and restarted (protocols.failover) ---------------------------------
    def _rejoin(self) -> None:
        """Close the registrations of aggregators a round agreed lost (so one still running
        forgets the communicator once every rank's has closed) and the new ones a round ended
        without taking back, and ask the rejoiner for a new registration with each one lost.
        Run when a round was decided or a new registration came or went."""
        session = self.session
        self._epoch_seen = session.epoch
        for peer in session.lost:
            stream = self.streams.get(peer)
            if stream is not None and self._renewed.get(peer) is not stream:
                self._drop_stream(stream)
        for peer, stream in list(self._renewed.items()):
            if peer not in session.lost:  # taken back: its connection watches it now
                del self._renewed[peer]
            elif session.rank not in session.registered_anew.get(peer, {}):
                del self._renewed[peer]  # closed, or a round ended it: to register again
                self._drop_stream(stream)
        if self.links.reregister is None:
            return
        wanted = (
            [peer for peer in session.lost if peer not in self._renewed]
            if session.epoch <= MAX_EPOCH
            else []
        )  # past what a HELLO can say: kept lost
        if self._rejoiner is None and wanted:
            self._rejoiner = Rejoiner(
                str(self.links.rank),
                self.links.reregister,
                self._seal_hello,
                lambda peer, registration: self._hand("registered", peer, registration),
            )
        if self._rejoiner is not None:
            self._rejoiner.want(wanted, session.epoch)

    def _seal_hello(self, payload: bytes, dst: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._hand("seal", payload, dst, future):
            future.cancel()
        return future

    def _take_registration(self, peer: int, registration: Registration, now: float) -> None:
        """A new registration with lost aggregator `peer`: watched as its first was, and the
        session told, if it is still wanted and the aggregator offers what it did."""
        session = self.session
        stripes = session.aggregators[peer][1]
        wanted = peer in session.lost and peer not in self._renewed
        why = None
        if not wanted:
            why = "not wanted any more"
        elif len(registration.ports) != len(stripes):
            why = (
                f"it offers {len(registration.ports)} endpoints, not the {len(stripes)} it "
                f"had: the communicator stripes over those"
            )
        elif registration.slots < self.links.aggregator_slots:
            why = (
                f"it grants {registration.slots} slots a reduction, fewer than the "
                f"{self.links.aggregator_slots} the communicator uses"
            )
        if why is not None:
            registration.sock.close()
            if wanted:  # it answers, but not as the communicator needs
                session.cannot_take_back(peer, why)
                if self._rejoiner is not None:
                    self._rejoiner.refused(peer)
            return
        for stripe, port in zip(stripes, registration.ports, strict=True):
            host = self.links.endpoints[stripe][0]
            self.links.endpoints[stripe] = (host, port)
            self.plane.set_address(_core.ROUTE_AGGREGATOR, stripe, host, port)
        if (old := self.streams.get(peer)) is not None:
            self._drop_stream(old)
        stream = self._renewed[peer] = self.streams[peer] = Stream(
            registration.sock, peer, self.links.opener
        )
        self._selector.register(stream, selectors.EVENT_READ, stream)
        self._masks[peer] = selectors.EVENT_READ
        if not session.aggregator_registered(peer, now):
            del self._renewed[peer]
            self._drop_stream(stream)
        self._rejoin()

    def _report(self) -> None:
        now = time.monotonic()
        while self.session.notices:  # once per communicator and aggregator lost
            # from this thread no frame is the user's: named as overcast's, without a source line
            try:
                warnings.warn_explicit(
                    self.session.notices.pop(0), AggregatorLostWarning, "overcast", 0
                )
            except Warning:  # a filter made it an error: the loss is in in_network_fallback
                pass  # and the counters; the engine's thread is no place to raise it
        verified = self.session.verified
        while verified:
            work = self._works.get(verified.pop())
            if work is not None:
                work._verified.set()
        for finished in (self.session.finished, self.session.p2p.finished):
            while finished:
                self._finishing.append((finished.pop(), now + self.session.timeout))
        if self._finishing:
            self._finishing = [
                (coll, due) for coll, due in self._finishing if not self._finish(coll, now >= due)
            ]

    def _finish(self, item: Collective | Transfer, overdue: bool) -> bool:
        """Complete a collective's or transfer's Work, unless a stream has yet to write bytes it
        sent: those are written from its own buffers, which the caller may reuse once the Work
        is complete. A failed one completes at once. One whose streams are still not written
        the communicator's timeout after it was done (`overdue`) fails: the peers that take
        nothing (a frozen process, a partition) are dropped, unsent frames and all, and the
        communicator aborts, as for any collective that makes no progress."""
        holding = [s for s in self.streams.values() if s.holds(item.holder)]
        if item.error is None and holding:
            if not overdue:
                return False
            peers = ", ".join(f"rank {s.peer}" for s in holding)
            error = CollectiveTimeoutError(
                f"{item} on rank {self.session.rank} was done, but {peers} did not take its "
                f"last frames within {self.session.timeout:.1f} s"
            )
            item.fail(error)
            self.session.abort(error)
            for stream in holding:
                self._lose(stream)
        if self.trace:
            self.trace.end(item.holder, time.monotonic())
        work = self._works.pop(item.holder, None)
        if work is not None:
            if isinstance(item, Transfer):
                work.source = item.source
            work._finish(item.error)
        return True

    def _shutdown(self) -> None:
        self.session.fail(CommunicatorClosedError("the communicator is closed"))
        self._report()
        with self._lock:
            self._close_requested = True
            leftover = list(self._submitted)
            self._submitted.clear()
        if self._rejoiner is not None:
            self._rejoiner.stop()
        for action, *args in leftover:
            if action in ("post", "transfer"):
                args[1]._finish(CommunicatorClosedError("the communicator is closed"))
            elif action == "seal":
                args[2].cancel()
            elif action == "registered":
                args[1].sock.close()
        self._linger()
        for stream in list(self.streams.values()):
            self._drop_stream(stream)
        self._report()  # what waited for its streams: they are gone
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        self.plane.detach()
        for sock in self._datagram_sockets:
            sock.close()

    def _linger(self) -> None:
        """End every stream with a FIN, then read (and drop) what the peers still send until
        each closes its side, for _LINGER_SECONDS at most: see _LINGER_SECONDS."""
        waiting = selectors.DefaultSelector()
        for stream in self.streams.values():
            stream.finish()
            waiting.register(stream.sock, selectors.EVENT_READ)
        deadline = time.monotonic() + _LINGER_SECONDS
        with waiting:
            while waiting.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in waiting.select(left):
                    try:
                        data = cast(socket.socket, key.fileobj).recv(1 << 16)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        waiting.unregister(key.fileobj)

    # -- introspection ---------------------------------------------------------------------
    def memory(self) -> dict:
        """What this engine holds now: the kernel's socket buffers (send and receive, as the
        kernel sized them), its own read buffers, and the bookkeeping of the collectives in
        flight. Read from any thread: the containers are copied first (atomic in CPython)."""
        streams = list(self.streams.copy().values())
        sockets = [s.sock for s in streams] + list(self._datagram_sockets)
        kernel = 0
        for sock in sockets:
            if sock.fileno() >= 0:
                kernel += sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) + sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF
                )
        active = list(self.session.active.copy().values())
        plane_bytes, unsent = self.plane.memory()
        return {
            "socket_buffer_bytes": kernel,
            "read_buffer_bytes": sum(s.buffer_bytes() for s in streams) + unsent,
            "datagram_plane_bytes": plane_bytes,
            "collectives_in_flight": len(active),
            "collective_state_bytes": sum(c.state_bytes() for c in active),
        }

    def counters(self) -> dict:
        streams = list(self.streams.values())
        _, stats, io = self.plane.counters()
        return {
            "drops": dict(self.links.drops),  # the plane's among them: the session polls it
            "probe_drops": dict(self.links.probe_drops),  # when it was made (transport.probe)
            "stale": self.session.stale,
            "early_dropped": self.session.early_dropped,
            "datagrams_in": io["datagrams_in"],
            "datagrams_out": io["datagrams_out"],
            "datagram_reads": io["datagram_reads"],
            "datagram_sends": stats["datagram_sends"],
            "datagram_bytes_out": stats["datagram_bytes_out"],
            "injected_losses": stats["injected_losses"],
            "data_path_cpu_seconds": io["data_path_cpu_seconds"],
            "python_cpu_seconds": self.python_cpu_seconds,
            "wakeups": io["wakeups"],
            **self.session.stats,
            "stream_bytes_out": self._closed_bytes[0] + sum(s.bytes_out for s in streams),
            "stream_bytes_in": self._closed_bytes[1] + sum(s.bytes_in for s in streams),
        }


__all__ = ["Engine", "Work"]
