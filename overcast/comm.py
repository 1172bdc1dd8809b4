"""overcast.Communicator: collectives on numpy arrays and CPU torch tensors among P processes."""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections.abc import Callable

import numpy as np

from overcast.buffers import SUMMING_OPS, as_array, check_dtype, check_reduce
from overcast.engine.engine import Engine, Work
from overcast.engine.trace import Trace
from overcast.errors import InvalidArgumentError, OvercastError, mark_peers_told
from overcast.limits import (
    aggregators_from_env,
    bytes_from_env,
    check_count,
    check_frame_bytes,
    check_link_rate,
    check_positive,
    check_roots,
    require,
    seconds_from_env,
)
from overcast.native import _core
from overcast.protocols.base import Descriptor
from overcast.protocols.failover import FAILOVER_ENV, FAILOVER_LEAST_SECONDS, FAILOVER_SECONDS
from overcast.protocols.multicast import MulticastGather
from overcast.protocols.p2p import ORDER_TAG, Transfer
from overcast.protocols.pairwise import PairwiseAllToAll, sizes_error
from overcast.protocols.ring import RingAllGather, RingBroadcast, RingReduceScatter
from overcast.protocols.session import EARLY_STREAM_BYTES, EARLY_STREAM_ENV, Session
from overcast.protocols.budget import LinkBudget
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.schedules.ring import DEFAULT_FRAME_BYTES
from overcast.transport.datagram import chunk_bytes, pace_batch, reduction_batch
from overcast.transport.loss import LossSpec
from overcast.transport.probe import undelivered
from overcast.transport.rendezvous import rendezvous
from overcast.wire.header import datagram_link_bytes
from overcast.wire.messages import CONTRIB_PREFIX

# The share of a receiver's link the multicast streams may fill together (less leaves headroom
# for other traffic on the links). Paced natively, one link batch per receiver at a time, the
# whole link lost nothing on 8 emulated hosts at 400 Mbit/s, and under 1% bursty loss pairs took
# no longer than at 0.95 (docs/results.md).
DEFAULT_PACING_SHARE = 1.0
ALGORITHMS = {
    "all_gather": ("ring", "multicast"),
    "reduce_scatter": ("ring", "innetwork"),
    "broadcast": ("multicast", "ring"),
    "all_reduce": ("ring", "fullduplex"),
    "all_to_all": ("pairwise",),
}
# What each all_reduce algorithm runs: (its ReduceScatter's algorithm, its AllGather's).
ALL_REDUCE_PARTS = {"ring": ("ring", "ring"), "fullduplex": ("innetwork", "multicast")}
# The full-duplex all_reduce's pieces: small enough that the first ReduceScatter and the last
# AllGather, which overlap nothing, are a small share of the whole; large enough that each
# piece's collectives are not dominated by their fixed costs.
FULLDUPLEX_PIECES = 8
FULLDUPLEX_MIN_PIECE_BYTES = 64 << 10
# The most bytes of sends not yet taken by their receivers that a communicator holds copies of
# (so that their calls complete at once); a send past it is sent from the caller's buffer.
SEND_COPY_ENV = "OVERCAST_SEND_COPY_BYTES"
DEFAULT_SEND_COPY_BYTES = 256 << 20
# An all_to_all's split sizes (None: they do not fit its buffers), what they are in words, and
# the bytes of its rows: what PairwiseAllToAll takes besides the buffers.
SplitSizes = tuple[list[int] | None, str, int]


class Communicator:
    """P ranks that run collectives together, each with its own progress engine thread.

    Collectives are issued in the same order on every rank, as in NCCL; several may be in flight.
    Rank and world size default to RANK and WORLD_SIZE; rendezvous uses MASTER_ADDR/MASTER_PORT
    unless a `store` (any object with set/get, a torch.distributed Store included) is given.
    `timeout` bounds how long any collective may go without progress before it fails.

    The multicast algorithms pace each sender so that the streams a receiver takes in at once
    fill `pacing_share` of its link: they need the link rate per direction, `link_bits_per_s`
    (default: OVERCAST_LINK_BITS_PER_S, which the emulated cluster sets). `roots` is how many
    ranks of a multicast AllGather send at once (default: all of them, each paced at 1/(P-1) of
    the link; see docs/results.md for why). `loss` injects loss of received datagrams
    (default: OVERCAST_LOSS, OVERCAST_LOSS_BURST, OVERCAST_LOSS_SEED). `aggregators` names
    the aggregators for in-network reduction, "host[:port],..." in order (default:
    OVERCAST_AGGREGATORS, or OVERCAST_SWITCH, its old name; `switch=` is its old name too).
    With `trace`, the engine records each collective's span and bytes over time (see `trace()`).
    `early_stream_bytes` is the most this rank holds of what peers sent on their streams for
    collectives it has not issued yet (default: OVERCAST_EARLY_STREAM_BYTES, else 256 MiB):
    a peer further ahead fails the communicator on every rank, with an error naming it.

    An aggregator lost mid-job (its connection closed, or silent for `failover_seconds` while an
    in-network reduction waits on it: default OVERCAST_FAILOVER_SECONDS, else 2 s, never longer
    than `timeout`) fails nothing: the ranks agree which in-network ReduceScatters in flight the
    ring redoes, from the unchanged inputs, and the ring runs those after; each rank warns once
    (AggregatorLostWarning) naming the aggregator, and `in_network_fallback` says so.

    Making it proves multicast delivered (overcast.transport.probe): `multicast_unheard` is,
    alike on every rank, each rank's list of the ranks whose multicast it did not hear, and
    where it is not empty `multicast_undelivered` says so, naming them and their hosts, and the
    multicast algorithms are refused with that reason.

    Bad input (a wrong size, dtype, op or algorithm) raises InvalidArgumentError on the rank
    that gave it, before anything is sent. With `fail_peers_on_bad_input` (the default, as
    NCCL's abort) it also fails the communicator on every other rank, which would otherwise wait
    for this rank's part; without it (gloo's contract, the torch.distributed backend's) the call
    is refused: it takes its sequence number, and every other rank's call at that number raises
    InvalidArgumentError naming this rank and the reason, as soon as the refusal arrives; the
    communicator stays usable (`refuse`). A group of one rank runs every collective as a local
    copy.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        name: str = "default",
        store=None,
        secret: bytes | None = None,
        timeout: float = 120.0,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        link_bits_per_s: float | None = None,
        roots: int | None = None,
        pacing_share: float = DEFAULT_PACING_SHARE,
        loss: LossSpec | None = None,
        aggregators: str | None = None,
        trace: bool = False,
        fail_peers_on_bad_input: bool = True,
        early_stream_bytes: int | None = None,
        failover_seconds: float | None = None,
        switch: str | None = None,
    ):
        self.rank = int(os.environ["RANK"]) if rank is None else rank
        self.world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        self.name, self.timeout, self.frame_bytes = name, timeout, frame_bytes
        self.fail_peers_on_bad_input = fail_peers_on_bad_input
        if link_bits_per_s is None and os.environ.get("OVERCAST_LINK_BITS_PER_S"):
            link_bits_per_s = float(os.environ["OVERCAST_LINK_BITS_PER_S"])
        check_count("world_size", self.world_size, 1, "WORLD_SIZE, world_size")
        require(
            isinstance(self.rank, int) and 0 <= self.rank < self.world_size,
            "the rank",
            f"between 0 and world_size - 1 ({self.world_size - 1})",
            self.rank,
            "RANK, rank",
        )
        check_positive("the timeout", timeout, "timeout", " seconds")
        check_frame_bytes(frame_bytes)
        if link_bits_per_s is not None:
            check_link_rate(link_bits_per_s)
        check_roots(roots, self.world_size)
        if early_stream_bytes is None:
            early_stream_bytes = bytes_from_env(EARLY_STREAM_ENV, EARLY_STREAM_BYTES)
        check_count(
            "the bytes held for collectives not issued",
            early_stream_bytes,
            0,
            f"{EARLY_STREAM_ENV}, early_stream_bytes",
        )
        if failover_seconds is None:
            failover_seconds = seconds_from_env(FAILOVER_ENV, FAILOVER_SECONDS)
        require(
            failover_seconds >= FAILOVER_LEAST_SECONDS,
            "the aggregator's switch-over bound",
            f"at least {FAILOVER_LEAST_SECONDS} seconds (a healthy aggregator answers "
            f"within 50 ms)",
            failover_seconds,
            f"{FAILOVER_ENV}, failover_seconds",
        )
        require(
            0 < pacing_share <= 1,
            "the pacing share",
            "a fraction above 0, at most 1",
            pacing_share,
            "pacing_share",
        )
        if switch is not None:
            warnings.warn(
                "Communicator(switch=) is the old name of aggregators=",
                DeprecationWarning,
                stacklevel=2,
            )
            require(
                aggregators in (None, switch),
                "the aggregators",
                "named once, by aggregators= (switch= is its old name)",
                switch,
                "aggregators, switch",
            )
            aggregators = switch
        if aggregators is None:  # read before any work
            aggregators = aggregators_from_env()
        self.link_bits_per_s = link_bits_per_s
        self.roots = self.world_size if roots is None else roots
        self.pacing_share = pacing_share
        self.loss = LossSpec.from_env() if loss is None else loss
        links = rendezvous(
            self.rank,
            self.world_size,
            name=name,
            store=store,
            secret=secret,
            timeout=timeout,
            aggregators=aggregators,
        )
        self.address, self.mtu = links.address, links.mtu
        # One datagram per chunk, within every rank's path MTU (agreed at rendezvous).
        self.chunk_bytes = chunk_bytes(links.mtu)
        self._multicast_error = links.multicast_error
        # for each rank, the ranks whose multicast it did not hear when the communicator was
        # made (empty where every rank heard every other), alike on every rank; and why that
        # means multicast is not delivered, naming them and their hosts
        self.multicast_unheard = links.multicast_unheard
        self.multicast_undelivered = undelivered(links.multicast_unheard, links.addresses)
        self._aggregator_error = links.aggregator_error
        self._aggregator_slots = links.aggregator_slots
        # the aggregator endpoints (every shard of every aggregator) in-network reductions are
        # striped over: 0 without an aggregator
        self.aggregator_endpoints = len(links.endpoints)
        self._stripes = max(self.aggregator_endpoints, 1)
        uplink = link_bits_per_s / 8 * pacing_share if link_bits_per_s else None
        datagram = datagram_link_bytes(self.chunk_bytes)
        self._uplink = LinkBudget(
            uplink,
            batch=pace_batch(uplink, datagram),
            datagram_bytes=datagram,
            reduction_batch=reduction_batch(uplink, datagram),
        )
        plane = _core.Plane(
            self.rank, self.world_size, links.job, links.comm, links.key, links.sealer.native
        )
        session = Session(
            self.rank,
            self.world_size,
            timeout,
            links.drops,
            plane,
            early_stream_bytes,
            failover_seconds,
        )
        self._engine = Engine(links, session, self.loss, Trace() if trace else None)
        self._lock = threading.Lock()
        self._seq = 0
        self._number_after: Callable[[], None] | None = None  # see number_after
        self._closed = False
        self._copy_limit = bytes_from_env(SEND_COPY_ENV, DEFAULT_SEND_COPY_BYTES)
        self._copied = 0  # bytes of copied sends not yet taken

    # -- collectives -----------------------------------------------------------------------
    def all_gather(
        self,
        output,
        input,
        async_op: bool = False,
        algorithm: str = "ring",
        roots: int | None = None,
    ):
        """Gather every rank's `input` into `output` (world_size x input, rank order), as
        torch.distributed.all_gather_into_tensor. `roots` applies to algorithm "multicast"."""
        out, inp = self._arrays(output, input, "all_gather")
        if out.size != inp.size * self.world_size:
            self._reject(
                f"all_gather output has {out.size} elements; it needs world_size "
                f"({self.world_size}) x input ({inp.size}) = "
                f"{inp.size * self.world_size}"
            )
        roots = self.roots if roots is None else roots
        if algorithm == "multicast" and not 1 <= roots <= self.world_size:
            self._reject(f"roots must be between 1 and world_size ({self.world_size}), not {roots}")
        if np.shares_memory(out, inp):  # torch's in-place form: input is the output's slot
            inp = inp.copy()
        desc = Descriptor(
            "all_gather",
            algorithm,
            inp.dtype,
            inp.size,
            param=roots if algorithm == "multicast" else 0,
        )
        return self._issue(desc, out, inp, async_op)

    def reduce_scatter(
        self, output, input, op: str = "sum", async_op: bool = False, algorithm: str = "ring"
    ):
        """Reduce `input` across ranks (op "sum", "avg", "max", "min" or "product"; the
        in-network algorithm sums and averages only; an average of integers is their sum
        divided and truncated toward zero, as NCCL's) and leave block `rank` of the result in
        `output`, as torch.distributed.reduce_scatter_tensor."""
        out, inp = self._arrays(output, input, "reduce_scatter")
        self._check_reduce(inp.dtype, op, algorithm)
        if inp.size != out.size * self.world_size:
            self._reject(
                f"reduce_scatter input has {inp.size} elements; it needs world_size "
                f"({self.world_size}) x output ({out.size}) = "
                f"{out.size * self.world_size}"
            )
        if np.shares_memory(out, inp):  # in place, as Megatron's: buf.chunk(P)[rank] from buf
            inp = inp.copy()
        return self._issue(
            Descriptor("reduce_scatter", algorithm, inp.dtype, out.size, op), out, inp, async_op
        )

    def all_reduce(self, buffer, op: str = "sum", algorithm: str = "ring") -> None:
        """Reduce `buffer` across ranks in place, as torch.distributed.all_reduce; every rank
        ends with the same bits. "ring": a ring ReduceScatter, then a ring AllGather of its
        result. "fullduplex": the buffer in pieces, each reduced in the network (each rank
        sends the piece, receives its shard of the sum) while the piece before is multicast
        (each rank sends its shard once, receives the others'), so that both directions of
        every link carry data at once: about N/B for N bytes at link rate B, against the
        ring's 2N(P-1)/(PB). Returns when the result is in place."""
        buf, _ = self._arrays(buffer, buffer, "all_reduce")
        self.check_algorithm("all_reduce", algorithm)
        rs_algorithm, ag_algorithm = ALL_REDUCE_PARTS[algorithm]
        self._check_reduce(buf.dtype, op, rs_algorithm)
        world = self.world_size
        if buf.size == 0:
            return
        shard = -(-buf.size // world)
        padded = buf if buf.size == shard * world else np.zeros(shard * world, buf.dtype)
        if padded is not buf:
            padded[: buf.size] = buf
        results = np.empty(shard, buf.dtype)
        pieces = 1
        if algorithm == "fullduplex":
            piece_bytes = max(FULLDUPLEX_MIN_PIECE_BYTES, -(-padded.nbytes // FULLDUPLEX_PIECES))
            pieces = max(1, min(shard, -(-padded.nbytes // piece_bytes)))
        # Piece k: elements world * bounds[k] .. world * bounds[k+1] of the buffer, reduced and
        # scattered into results[bounds[k]:bounds[k+1]], then gathered back in place. The next
        # piece's ReduceScatter is posted before this piece's AllGather (the same order on
        # every rank), so the two run at once.
        bounds = [shard * k // pieces for k in range(pieces + 1)]
        spans = list(itertools.pairwise(bounds))
        reductions, gathers = [], []
        for k in range(pieces + 1):
            if k < pieces:
                a, b = spans[k]
                reductions.append(
                    self.reduce_scatter(
                        results[a:b], padded[world * a : world * b], op, True, rs_algorithm
                    )
                )
                if k == 0 and pieces > 1:
                    # A peer may refuse the call (refuse): then only its first collective
                    # fails. The rest are posted once no peer can refuse it any more, so
                    # that a refused call takes one number on every rank.
                    reductions[0].wait_verified()
                    if reductions[0].exception() is not None:
                        reductions[0].wait()
            if k > 0:
                a, b = spans[k - 1]
                reductions[k - 1].wait()
                gathers.append(
                    self.all_gather(padded[world * a : world * b], results[a:b], True, ag_algorithm)
                )
        for work in gathers:
            work.wait()
        if padded is not buf:
            buf[:] = padded[: buf.size]

    def broadcast(self, buffer, root: int, async_op: bool = False, algorithm: str = "multicast"):
        """Copy `buffer` of rank `root` into `buffer` on every rank, as
        torch.distributed.broadcast: by reliable multicast, or passed along the ring."""
        buf, _ = self._arrays(buffer, buffer, "broadcast")
        if not 0 <= root < self.world_size:
            self._reject(f"broadcast root {root} is outside world_size {self.world_size}")
        return self._issue(
            Descriptor("broadcast", algorithm, buf.dtype, buf.size, param=root), buf, buf, async_op
        )

    def all_to_all(
        self, output, input, output_splits=None, input_splits=None, *, row: int = 1
    ) -> None:
        """Send block p of `input` to rank p and receive rank p's block for this rank into block
        p of `output`, as torch.distributed.all_to_all_single: the split sizes count rows of
        `row` elements, `input_splits[p]` of them going to rank p and `output_splits[p]` coming
        from it (None: the rows split evenly). Every rank first tells every other its sizes, so
        that sizes that do not fit raise the same InvalidArgumentError on every rank, naming the
        rank; each rank sends each peer its block on their stream and receives only what the
        sizes say: N(P-1)/P bytes each way for N bytes split evenly (docs/protocols.md).
        Returns when the output is in place."""
        out, inp = self._arrays(output, input, "all_to_all")
        if not (isinstance(row, int) and row >= 1 and inp.size % row == 0 and out.size % row == 0):
            self._reject(
                f"all_to_all rows of {row!r} elements do not cut the input "
                f"({inp.size}) and the output ({out.size}) into whole rows"
            )
        world = self.world_size
        rows, out_rows = inp.size // row, out.size // row
        ins = [rows // world] * world if input_splits is None else list(input_splits)
        outs = [out_rows // world] * world if output_splits is None else list(output_splits)
        fits = (
            len(ins) == world
            and len(outs) == world
            and sum(ins) == rows
            and sum(outs) == out_rows
            and min(ins + outs) >= 0
        )
        here = (
            f"input split sizes {ins} for {rows} rows, output split sizes {outs} for "
            f"{out_rows} rows"
        )
        sizes = ins + outs if fits else None
        if world == 1:  # every rank's sizes are this one's: checked here
            why = sizes_error([sizes], 0, here)
            if why:
                raise mark_peers_told(InvalidArgumentError(why))
        self._issue(
            Descriptor("all_to_all", "pairwise", inp.dtype, row),
            out,
            inp,
            False,
            (sizes, here, row * inp.dtype.itemsize),
        )

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (a one-element all_gather)."""
        mine = np.zeros(1, np.int64)
        self.all_gather(np.empty(self.world_size, np.int64), mine)

    # -- point to point ---------------------------------------------------------------------
    def isend(self, buffer, dst: int, tag: int = 0) -> Work:
        """Send `buffer` (a numpy array or CPU tensor of any dtype: its bytes) to rank `dst`
        (this rank too) with `tag` (0 to 2^32 - 2), for the recv there that takes this rank and
        tag: the k-th send of a rank and tag meets the k-th such recv, and a recv must take as
        many bytes. Not a collective: no other rank takes part, and it is not numbered among
        the collectives. Its data moves only once the receiver has a recv for it, straight into
        that recv's buffer (docs/protocols.md). While sends not yet taken hold less than
        OVERCAST_SEND_COPY_BYTES (256 MiB) here, the data is copied and the Work returned is
        complete at once (so two ranks may each send to the other, then receive); a larger one,
        or one memory has no room to copy, is sent from `buffer`, which must then stay unchanged
        until the Work is complete, when the receiver has taken it all. Nothing of a message is
        held on the receiving side but in its recv's buffer. Bad arguments raise
        InvalidArgumentError here alone."""
        arr = self._transfer_buffer(buffer, "send buffer")
        if not (isinstance(dst, int) and 0 <= dst < self.world_size):
            raise InvalidArgumentError(
                f"send destination {dst!r} is not a rank of the "
                f"communicator (0 to {self.world_size - 1})"
            )
        tag = self._tag(tag)
        with self._lock:
            copy = self._copied + arr.nbytes <= self._copy_limit
            if copy:
                self._copied += arr.nbytes
        data = arr
        if copy:
            try:
                data = arr.copy()
            except MemoryError:  # no room for a copy: sent from the caller's buffer instead
                self._release_copy(arr.nbytes)
                copy = False
        op = Transfer("send", self.rank, dst, tag, data, self.frame_bytes, copied=copy)
        work = self._transfer(op)
        if not copy:
            return work
        work.add_done_callback(lambda: self._release_copy(arr.nbytes))
        done = Work(-1, str(op))
        done._finish(None)
        return done

    def send(self, buffer, dst: int, tag: int = 0) -> None:
        """isend, then wait: returns once the data is copied (see isend), or taken."""
        self.isend(buffer, dst, tag).wait()

    def irecv(self, buffer, src: int | None = None, tag: int = 0) -> Work:
        """Receive into `buffer` the next message sent with `tag` to this rank by rank `src`
        (this rank too), or by any rank (None): the Work's `source` is the sender once it is
        complete. A message whose size differs from the buffer's fails here and at its sender
        with an InvalidArgumentError naming both sizes. Bad arguments raise here alone."""
        arr = self._transfer_buffer(buffer, "recv buffer")
        if not arr.flags.writeable:
            raise InvalidArgumentError("recv buffer is read-only")
        if src is not None and not (isinstance(src, int) and 0 <= src < self.world_size):
            raise InvalidArgumentError(
                f"recv source {src!r} is not a rank of the "
                f"communicator (0 to {self.world_size - 1}) or None"
            )
        return self._transfer(
            Transfer("recv", self.rank, src, self._tag(tag), arr, self.frame_bytes)
        )

    def recv(self, buffer, src: int | None = None, tag: int = 0) -> int:
        """irecv, then wait; returns the sender's rank."""
        work = self.irecv(buffer, src, tag)
        work.wait()
        assert work.source is not None  # a recv done knows its sender
        return work.source

    def tell_order(self, word: bytes) -> None:
        """Rank 0's word to every other rank, on the tag kept for it (ORDER_TAG), in order:
        the backend's order of calls. Copied; nothing waits for it to be taken."""
        for dst in range(1, self.world_size):
            self._transfer(
                Transfer(
                    "send",
                    self.rank,
                    dst,
                    ORDER_TAG,
                    np.frombuffer(word, np.uint8).copy(),
                    self.frame_bytes,
                    copied=True,
                )
            )

    def hear_order(self, buffer: np.ndarray) -> Work:
        """The next word of rank 0's tell_order, into `buffer` (its size)."""
        return self._transfer(
            Transfer(
                "recv",
                self.rank,
                0,
                ORDER_TAG,
                buffer,
                self.frame_bytes,
                label="the wait for the place of this rank's next call in rank 0's order",
                awaited="rank 0 to make that call, or any call this rank has not run yet",
            )
        )

    @staticmethod
    def _transfer_buffer(buffer, what: str) -> np.ndarray:
        return as_array(buffer, what).view(np.uint8)

    @staticmethod
    def _tag(tag) -> int:
        if not (isinstance(tag, int) and 0 <= tag < ORDER_TAG):  # ORDER_TAG and up: overcast's
            raise InvalidArgumentError(
                f"tag {tag!r} is not a whole number from 0 to {ORDER_TAG - 1}"
            )
        return tag

    def _transfer(self, op: Transfer) -> Work:
        with self._lock:
            if self._closed:
                raise OvercastError("the communicator is closed")
        work = Work(-1, str(op))
        self._engine.submit_transfer(op, work)
        return work

    def _release_copy(self, nbytes: int) -> None:
        with self._lock:
            self._copied -= nbytes

    def _check_reduce(self, dtype: np.dtype, op: str, algorithm: str) -> None:
        try:
            check_reduce(dtype, op)
        except InvalidArgumentError as err:
            self._reject(str(err))
        if algorithm == "innetwork" and op not in SUMMING_OPS:
            self._reject(f"in-network reduction sums; op {op!r} needs algorithm 'ring'")

    # -- protocol choice -------------------------------------------------------------------
    def _protocol(
        self,
        seq: int,
        desc: Descriptor,
        out: np.ndarray,
        inp: np.ndarray,
        layout: SplitSizes | None,
    ):
        rank, world = self.rank, self.world_size
        if desc.algorithm == "pairwise":
            assert layout is not None  # all_to_all, the one pairwise collective, gives it
            return PairwiseAllToAll(seq, rank, world, desc, out, inp, *layout, self.frame_bytes)
        if desc.algorithm == "ring":
            if desc.collective == "broadcast":
                return RingBroadcast(seq, rank, world, desc, out, self.frame_bytes)
            cls = RingAllGather if desc.collective == "all_gather" else RingReduceScatter
            return cls(seq, rank, world, desc, out, inp, self.frame_bytes)
        if desc.algorithm == "innetwork":
            return InNetworkReduceScatter(
                seq,
                rank,
                world,
                desc,
                out,
                inp,
                chunk_bytes=self.chunk_bytes - CONTRIB_PREFIX.size,
                slots=self._aggregator_slots,
                budget=self._uplink,
                stripes=self._stripes,
                frame_bytes=self.frame_bytes,
            )
        n = desc.count * desc.dtype.itemsize
        if desc.collective == "all_gather":
            segments, roots, source = [(r, r * n, n) for r in range(world)], desc.param, inp
        else:
            segments, roots, source = [(desc.param, 0, n)], 1, None
        return MulticastGather(
            seq,
            rank,
            world,
            desc,
            out,
            segments,
            source=source,
            roots=roots,
            chunk_bytes=self.chunk_bytes,
            budget=self._uplink,
        )

    def unavailable(self, collective: str, algorithm: str) -> str | None:
        """Why this communicator cannot run `collective` with `algorithm`, or None if it can."""
        known = ALGORITHMS[collective]
        if algorithm not in known:
            return f"{collective} has no algorithm {algorithm!r}; available: {', '.join(known)}"
        if collective == "all_reduce":
            rs_algorithm, ag_algorithm = ALL_REDUCE_PARTS[algorithm]
            return self.unavailable("reduce_scatter", rs_algorithm) or self.unavailable(
                "all_gather", ag_algorithm
            )
        if algorithm in ("multicast", "innetwork") and self.world_size > 1:
            if self.network_unavailable(algorithm):
                return self.network_unavailable(algorithm)
            if not self.link_bits_per_s:
                return (
                    f"{algorithm} paces its senders to the link rate: pass "
                    "link_bits_per_s= or set OVERCAST_LINK_BITS_PER_S"
                )
        return None

    def network_unavailable(self, algorithm: str) -> str | None:
        """Why the network does not carry `algorithm` ("multicast" or "innetwork") for this
        communicator, the link rate aside: a join that failed, multicast not delivered, an
        aggregator out of reach or refusing; or None."""
        if algorithm == "multicast" and self._multicast_error:
            return f"multicast is unavailable here: {self._multicast_error}"
        if algorithm == "multicast" and self.multicast_undelivered:
            return self.multicast_undelivered
        if algorithm == "innetwork" and self._aggregator_error:
            return f"in-network reduction is unavailable: {self._aggregator_error}"
        return None

    def check_algorithm(self, collective: str, algorithm: str) -> None:
        """Raise InvalidArgumentError here, and fail the communicator on every other rank, if
        `algorithm` cannot run `collective` on this communicator."""
        reason = self.unavailable(collective, algorithm)
        if reason:
            self._reject(reason)

    # -- plumbing --------------------------------------------------------------------------
    def _arrays(self, output, input, what: str):
        try:
            out = as_array(output, f"{what} output" if output is not input else what)
            inp = out if input is output else as_array(input, f"{what} input")
            check_dtype(inp, f"{what} input")
            if out.dtype != inp.dtype:
                raise InvalidArgumentError(f"{what} output is {out.dtype} but input is {inp.dtype}")
            if not out.flags.writeable:
                raise InvalidArgumentError(f"{what} output is read-only")
        except InvalidArgumentError as err:
            self._reject(str(err))
        return out, inp

    def _reject(self, message: str):
        """Bad input on this rank: raise here; fail the communicator on every other rank (which
        would otherwise wait for this rank's part) if it is to, else refuse the call."""
        error = InvalidArgumentError(f"rank {self.rank}: {message}")
        if self.fail_peers_on_bad_input:
            self._engine.abort(OvercastError(f"bad input on rank {self.rank}: {message}"))
        else:
            self.refuse(InvalidArgumentError(message))
            mark_peers_told(error)
        raise error

    def refuse(self, error: BaseException) -> None:
        """This rank will not make the collective its peers make next (its arguments are bad,
        or whatever would prepare them failed): the call takes that collective's number, and
        every peer's collective at that number fails with `error`'s class (OvercastError for
        another) and message, naming this rank, as soon as the refusal reaches it. The
        communicator goes on, its numbers alike on every rank. `error` is marked `peers_told`."""
        mark_peers_told(error)
        if self.world_size == 1:
            return
        told = (
            error
            if isinstance(error, OvercastError)
            else OvercastError(f"{type(error).__name__}: {error}")
        )
        if self._number_after is not None:
            self._number_after()
        with self._lock:
            if self._closed:
                return
            seq = self._seq
            self._seq += 1
            self._engine.refuse(seq, told)

    def number_after(self, wait: Callable[[], None] | None) -> None:
        """Have each collective call `wait()` (None: nothing) before it takes its number.
        overlap() on a GPU passes its poster's, which returns once what the poster was handed
        before is posted: a collective the program calls itself is then numbered after them on
        every rank, as where FSDP2's collectives are posted by the thread that calls them."""
        self._number_after = wait

    def _issue(
        self, desc: Descriptor, out, inp, async_op: bool, layout: SplitSizes | None = None
    ) -> Work | None:
        self.check_algorithm(desc.collective, desc.algorithm)
        if self._number_after is not None:
            self._number_after()
        with self._lock:
            if self._closed:
                raise OvercastError("the communicator is closed")
            if self.world_size == 1:
                work = self._local(desc, out, inp)
            else:
                seq = self._seq
                self._seq += 1
                coll = self._protocol(seq, desc, out, inp, layout)
                work = Work(seq, str(desc))
                self._engine.submit(coll, work)
        if async_op:
            return work
        work.wait()
        return None

    @staticmethod
    def _local(desc: Descriptor, out: np.ndarray, inp: np.ndarray) -> Work:
        """A collective of one rank, done: every op over one input is that input."""
        if desc.collective != "broadcast":
            out[:] = inp
        work = Work(-1, str(desc))
        work._finish(None)
        return work

    def abort(self, reason: str) -> None:
        """Fail every collective in flight and every later one, here and on every other rank,
        with `reason` (torch's abort of a process group); close() after it."""
        self._engine.abort(OvercastError(f"rank {self.rank}: {reason}"))

    @property
    def in_network_fallback(self) -> str | None:
        """Why in-network ReduceScatters run on the ring or on fewer aggregators now (one was
        lost: which, how, and which collectives the ring redid; and any taken back since),
        alike on every rank but for who noticed first; None while they run on every
        aggregator (none was lost, or every one lost was taken back)."""
        session = self._engine.session
        rounds = list(session.rounds)  # the latest, one per loss or take-back agreed on
        if not rounds or not rounds[-1].still_lost:
            return None
        clear = [i for i, r in enumerate(rounds) if not r.still_lost]
        since = rounds[clear[-1] + 1 :] if clear else rounds  # since the last time none was lost
        said = "; then ".join(r.outcome for r in since)
        for peer, why in list(session.not_taken_back.items()):
            said += (
                f"; the aggregator at {session.aggregators[peer][0]} answers again but "
                f"cannot be taken back: {why}"
            )
        return said

    def counters(self) -> dict:
        """Dropped messages by reason, stale messages, bytes and datagrams, and the protocols'
        own counts (chunks multicast, repaired, repair bytes...; aggregators_lost, and the
        in-network ReduceScatters in_network_redone_on_ring, in_network_complete_at_failover
        and, posted after, in_network_on_ring, see in_network_fallback); probe_drops: the delivery
        probes this rank dropped when the communicator was made, by why (malformed, foreign,
        bad_mac, replayed, unexpected)."""
        return self._engine.counters()

    def memory(self) -> dict:
        """Bytes this communicator holds now, by kind: kernel socket buffers, its read and send
        buffers, the bookkeeping of collectives in flight, and what the aggregator may hold
        for it (each endpoint's slots of one chunk per rank). Collectives read and write the
        caller's buffers in place: of all this, only the bookkeeping grows with a collective's
        size, by a byte or so per chunk."""
        held = self._engine.memory()
        if self._aggregator_error is None:
            held["aggregator_slot_bytes"] = (
                self._stripes * self._aggregator_slots * self.world_size * self.chunk_bytes
            )
        return held

    def trace(self) -> dict | None:
        """The recorded timeline (see overcast.engine.trace), if tracing is on."""
        return self._engine.trace.to_dict() if self._engine.trace else None

    def close(self) -> None:
        """Tell the peers goodbye and stop the engine. Pending collectives fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
