"""Point-to-point messages between the ranks of a communicator, sans I/O: a send to one rank and
a recv from one rank or from any, matched by tag, in order per (sender, receiver, tag), on the
authenticated streams the collectives use (and within a rank, for a message to itself).

Each message is a rendezvous, so that its data lands in the receiver's own buffer and nothing of
it is held anywhere else: the sender OFFERs it (its number, tag and size); the receiver matches
the offer with a recv (the first posted that takes that sender and tag; a recv matches the
earliest offer that fits, in the order offers came) and ACCEPTs it, or REFUSEs it when the
sizes differ; on the ACCEPT the sender writes the data as DATA frames, which the receiver puts
in place. Offers come in order on a stream, and the receiver matches recvs in the order they
were posted, so the k-th send of a sender and tag meets the k-th recv of them.

Message numbers count a sender's offers to one receiver from 0 (mod 2^32): an offer must carry
the next, and an ACCEPT, REFUSE or DATA frame must name a message under way. What does not fit
is `Rejected`: stream messages are evidence, and the session aborts the communicator.

Transfers are not collectives: they take no sequence number, and ranks make different ones.
"""

from __future__ import annotations

import collections
import itertools
import struct
from typing import NoReturn

import numpy as np

from overcast.errors import InvalidArgumentError, OvercastError, Rejected, error_class
from overcast.protocols.base import STREAM, Outgoing
from overcast.schedules.ring import frames
from overcast.wire.header import Kind, MalformedError
from overcast.wire.messages import pack_abort, unpack_abort

P2P_KINDS = frozenset((Kind.P2P_OFFER, Kind.P2P_ACCEPT, Kind.P2P_REFUSE, Kind.P2P_DATA))
# OFFER: the tag, then the message's bytes.
_OFFER = struct.Struct("<IQ")
_NUMBERS = 1 << 32
# Offers a peer may have waiting for a recv here: past them the communicator aborts (the
# session), so that a peer that sends without end cannot fill this memory.
OFFERS_HELD = 1 << 16
# The highest tag is overcast's own: on the torch.distributed backend, rank 0 tells the others
# the order of a group's calls with it (overcast/distributed/calls.py). Callers have the rest.
ORDER_TAG = (1 << 32) - 1


class Transfer:
    """One send or recv: `peer` the rank it goes to or comes from (None: a recv from any
    rank), `tag`, and `buffer` (flat uint8) the bytes sent or received into. `source` is the
    sender, once a recv is matched. `copied`: the buffer is the transfer's own, no caller's:
    its caller has been told it is done, so it waits for its receiver without a timeout (the
    receiver's recv has one), and only a closed or failed peer or communicator ends it. `label`
    and `awaited`, if given, are what errors call it and what it waits for."""

    _serials = itertools.count()

    def __init__(
        self,
        kind: str,
        rank: int,
        peer: int | None,
        tag: int,
        buffer: np.ndarray,
        frame_bytes: int,
        copied: bool = False,
        label: str | None = None,
        awaited: str | None = None,
    ):
        self.kind, self.rank, self.peer, self.tag = kind, rank, peer, tag
        self.buffer, self.frame_bytes, self.copied = buffer, frame_bytes, copied
        self.label, self.awaited = label, awaited
        self.nbytes = buffer.nbytes
        # the engine's name for what holds this transfer's buffers (a stream's frames, its Work):
        # below 0, apart from collectives' sequence numbers
        self.holder = -1 - next(self._serials)
        self.source: int | None = None
        self.number: int | None = None  # the message's on the wire, once offered or matched
        self.state = "posted"
        self.filled = self.frames = 0  # a recv's bytes and frames arrived
        self.unsent = 0  # a send's frames not yet handed to its stream
        self.error: BaseException | None = None
        self.progress_at = 0.0

    @property
    def done(self) -> bool:
        return self.state == "done"

    def __str__(self) -> str:
        if self.label is not None:
            return self.label
        if self.kind == "send":
            return f"send of {self.nbytes} B to rank {self.peer} (tag {self.tag})"
        peer = "any rank" if self.peer is None else f"rank {self.peer}"
        return f"recv of {self.nbytes} B from {peer} (tag {self.tag})"

    def waiting_for(self) -> str:
        if self.awaited is not None:
            return self.awaited
        if self.state == "posted":
            return (
                f"rank {self.peer} to post a recv that matches"
                if self.kind == "send"
                else f"{'a rank' if self.peer is None else f'rank {self.peer}'} to send with "
                f"tag {self.tag}"
            )
        if self.kind == "send":
            return f"rank {self.peer} to take its data"
        return f"rank {self.source}'s data: {self.filled} of {self.nbytes} B arrived"

    def fail(self, error: BaseException) -> None:
        if self.state not in ("done", "failed"):
            self.state, self.error = "failed", error


class _Offer:
    """A sender's offer, waiting here for a recv: a peer's, or this rank's own send to itself."""

    __slots__ = ("src", "number", "tag", "nbytes", "own")

    def __init__(
        self, src: int, number: int | None, tag: int, nbytes: int, own: Transfer | None = None
    ):
        self.src, self.number, self.tag, self.nbytes, self.own = src, number, tag, nbytes, own


class PointToPoint:
    """A rank's transfers in one communicator.

    `post` adds a send or recv; `receive` takes a P2P_* message from a peer's stream; `pop(route)`
    gives the next message for a route (`routes()`): offers and answers before data frames, so
    that a message coming the other way is not held behind a large one going out; transfers that
    end, done or failed, are appended to `finished`.
    """

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        # per route: (message, the send whose frame it is, or None), in order
        self._control: dict[tuple[int, int], collections.deque] = {}
        self._frames: dict[tuple[int, int], collections.deque] = {}
        self.finished: list[Transfer] = []
        self._next_number = [0] * world  # the next offer to each peer
        self._expected = [0] * world  # the next offer from each peer
        self._offers: list[_Offer] = []  # unmatched, in the order they came
        self._held: collections.Counter[int] = collections.Counter()  # unmatched offers by sender
        self._recvs: list[Transfer] = []  # unmatched, in the order posted
        self._offered: dict[tuple[int, int], Transfer] = {}  # (peer, number): awaiting an answer
        self._sending: list[Transfer] = []  # accepted, frames queued
        self._incoming: dict[tuple[int, int], Transfer] = {}  # (peer, number): data coming

    # -- posting ---------------------------------------------------------------------------
    def post(self, op: Transfer, now: float) -> None:
        op.progress_at = now
        if op.kind == "send":
            if op.peer == self.rank:
                self._offer_arrived(_Offer(self.rank, None, op.tag, op.nbytes, own=op), now)
                return
            peer = op.peer
            assert peer is not None  # a send goes to one rank
            number = op.number = self._next_number[peer]
            self._next_number[peer] = (number + 1) % _NUMBERS
            self._offered[(peer, number)] = op
            self._queue(
                peer, Outgoing(Kind.P2P_OFFER, number, 0, _OFFER.pack(op.tag, op.nbytes), peer)
            )
            return
        offer = next(
            (o for o in self._offers if o.tag == op.tag and (op.peer is None or o.src == op.peer)),
            None,
        )
        if offer is None:
            self._recvs.append(op)
        else:
            self._offers.remove(offer)
            self._held[offer.src] -= 1
            self._match(op, offer, now)

    # -- receiving -------------------------------------------------------------------------
    def receive(self, hdr, payload: memoryview, now: float) -> None:
        """A P2P_* message from rank hdr.src's stream (authentic, in order)."""
        src, number = hdr.src, hdr.seq
        if hdr.kind == Kind.P2P_OFFER:
            if number != self._expected[src]:
                _reject(
                    "out_of_range",
                    f"rank {src} offered message {number}; {self._expected[src]} was next",
                )
            if len(payload) != _OFFER.size:
                _reject("malformed", f"rank {src} offered {len(payload)} bytes, not {_OFFER.size}")
            self._expected[src] = (number + 1) % _NUMBERS
            tag, nbytes = _OFFER.unpack(payload)
            self._offer_arrived(_Offer(src, number, tag, nbytes), now)
        elif hdr.kind in (Kind.P2P_ACCEPT, Kind.P2P_REFUSE):
            op = self._offered.pop((src, number), None)
            if op is None:
                _reject(
                    "out_of_range",
                    f"rank {src} answered message {number}, which is not offered to it",
                )
            op.progress_at = now
            if hdr.kind == Kind.P2P_REFUSE:
                try:
                    code, reason = unpack_abort(payload)
                except MalformedError:
                    code, reason = InvalidArgumentError.abort_code, "a refusal without a reason"
                self.end(op, error_class(code)(reason))
            else:
                self._send_data(op)
        else:
            self._data(hdr, payload, now)

    def _offer_arrived(self, offer: _Offer, now: float) -> None:
        op = next(
            (
                r
                for r in self._recvs
                if r.tag == offer.tag and (r.peer is None or r.peer == offer.src)
            ),
            None,
        )
        if op is None:
            self._offers.append(offer)
            self._held[offer.src] += 1
        else:
            self._recvs.remove(op)
            self._match(op, offer, now)

    def _match(self, op: Transfer, offer: _Offer, now: float) -> None:
        """Recv `op` takes `offer`: accepted, or both refused if the sizes differ."""
        op.source, op.number, op.progress_at = offer.src, offer.number, now
        if offer.nbytes != op.nbytes:
            error = InvalidArgumentError(
                f"rank {offer.src} sent {offer.nbytes} B with tag {offer.tag} to rank "
                f"{self.rank}, whose recv takes {op.nbytes} B: the sizes must be equal"
            )
            self.end(op, error)
            if offer.own is not None:
                self.end(offer.own, error)
            else:
                assert offer.number is not None  # a peer's offer
                self._queue(
                    offer.src,
                    Outgoing(
                        Kind.P2P_REFUSE,
                        offer.number,
                        0,
                        pack_abort(error.abort_code, str(error)),
                        offer.src,
                    ),
                )
            return
        if offer.own is not None:  # a message to itself: copied across at once
            op.buffer[:] = offer.own.buffer
            self.end(offer.own)
            self.end(op)
            return
        number = offer.number
        assert number is not None  # a peer's offer
        self._queue(offer.src, Outgoing(Kind.P2P_ACCEPT, number, 0, b"", offer.src))
        if op.nbytes == 0:
            self.end(op)
        else:
            op.state = "receiving"
            self._incoming[(offer.src, number)] = op

    def _send_data(self, op: Transfer) -> None:
        op.state = "sending"
        if op.nbytes == 0:
            self.end(op)
            return
        peer, number = op.peer, op.number
        assert peer is not None and number is not None  # an offered send
        layout = frames(op.nbytes, op.frame_bytes, 1)
        op.unsent = len(layout)
        self._sending.append(op)
        box = self._frames.setdefault((STREAM, peer), collections.deque())
        box.extend(
            (Outgoing(Kind.P2P_DATA, number, j, op.buffer[off : off + length], peer, op.holder), op)
            for j, (off, length) in enumerate(layout)
        )

    def _data(self, hdr, payload: memoryview, now: float) -> None:
        op = self._incoming.get((hdr.src, hdr.seq))
        if op is None:
            _reject(
                "out_of_range",
                f"rank {hdr.src} sent data of message {hdr.seq}, which is not under way",
            )
        if hdr.chunk != op.frames:
            _reject(
                "out_of_range",
                f"rank {hdr.src} sent frame {hdr.chunk} of message {hdr.seq}; {op.frames} was next",
            )
        if not 0 < len(payload) <= op.nbytes - op.filled:
            _reject(
                "wrong_length",
                f"rank {hdr.src}'s frame {hdr.chunk} of message "
                f"{hdr.seq} has {len(payload)} B; {op.nbytes - op.filled} "
                f"are left",
            )
        op.buffer[op.filled : op.filled + len(payload)] = np.frombuffer(payload, np.uint8)
        op.filled += len(payload)
        op.frames += 1
        op.progress_at = now
        if op.filled == op.nbytes:
            del self._incoming[(hdr.src, hdr.seq)]
            self.end(op)

    # -- sending ---------------------------------------------------------------------------
    def _queue(self, peer: int, msg: Outgoing) -> None:
        self._control.setdefault((STREAM, peer), collections.deque()).append((msg, None))

    def routes(self) -> set[tuple[int, int]]:
        return {r for box in (self._control, self._frames) for r, q in box.items() if q}

    def pop(self, route: tuple[int, int]) -> Outgoing | None:
        for box in (self._control, self._frames):
            queue = box.get(route)
            if queue:
                msg, op = queue.popleft()
                if op is not None:
                    op.unsent -= 1
                    if not op.unsent:  # its last frame is the stream's now
                        self._sending.remove(op)
                        self.end(op)
                return msg
        return None

    # -- ending ----------------------------------------------------------------------------
    def end(self, op: Transfer, error: BaseException | None = None) -> None:
        """Finish `op`, done or with `error`."""
        if error is None:
            op.state = "done"
        else:
            op.fail(error)
        self.finished.append(op)

    def pending(self) -> list[Transfer]:
        """Every transfer not ended."""
        return (
            self._recvs
            + [o.own for o in self._offers if o.own is not None]
            + list(self._offered.values())
            + self._sending
            + list(self._incoming.values())
        )

    def fail(self, error: OvercastError, peer: int | None = None) -> None:
        """Fail every transfer not ended, or those with `peer` only (a recv from any rank not
        matched yet stays), and drop what was queued for them and held from them."""

        def hit(op: Transfer) -> bool:
            return peer is None or op.peer == peer or op.source == peer

        for op in self.pending():
            if hit(op):
                self.end(op, error)
        self._recvs = [r for r in self._recvs if not hit(r)]
        self._offers = [
            o
            for o in self._offers
            if not ((o.own is not None and hit(o.own)) or peer in (None, o.src))
        ]
        self._held = collections.Counter(o.src for o in self._offers)
        self._offered = {k: o for k, o in self._offered.items() if not hit(o)}
        self._sending = [o for o in self._sending if not hit(o)]
        self._incoming = {k: o for k, o in self._incoming.items() if not hit(o)}
        for box in (self._control, self._frames):
            for route in [r for r in box if peer in (None, r[1])]:
                del box[route]
            for route, queue in box.items():
                box[route] = collections.deque((m, o) for m, o in queue if o is None or not hit(o))

    # -- the session's questions ------------------------------------------------------------
    def offers_held(self, peer: int) -> int:
        """How many of `peer`'s offers wait here for a recv."""
        return self._held[peer]

    def too_many_offers(self, peer: int) -> str:
        """Why the offers held from `peer` passed OFFERS_HELD: the calls rank 0 made that this
        rank has not (ORDER_TAG: the backend's order of calls), or sends no recv took."""
        orders = sum(1 for o in self._offers if o.src == peer and o.tag == ORDER_TAG)
        if orders * 2 > OFFERS_HELD:
            return (
                f"rank {peer} has made {orders:,} calls in the group that rank "
                f"{self.rank} has not made yet: past {OFFERS_HELD:,}, the group fails (a "
                f"rank may not fall that far behind; wait on the calls' Works sooner)"
            )
        return (
            f"rank {peer} sent rank {self.rank} more than {OFFERS_HELD} messages that no "
            f"recv on rank {self.rank} has taken: past that many held, the communicator "
            f"fails (rank {self.rank} must post recvs for them sooner)"
        )

    def timer(self, timeout: float) -> float | None:
        return min(
            (op.progress_at + timeout for op in self.pending() if not op.copied), default=None
        )

    def stalled(self, now: float, timeout: float) -> Transfer | None:
        """A transfer that made no progress for `timeout`, if any (a copied send has no
        timeout: see Transfer)."""
        return next(
            (op for op in self.pending() if not op.copied and now >= op.progress_at + timeout), None
        )


def _reject(reason: str, message: str) -> NoReturn:
    raise Rejected(message, reason)
