"""overcast.Communicator: collectives on numpy arrays and CPU torch tensors among P processes."""

from __future__ import annotations

import os
import threading

import numpy as np

from overcast.buffers import as_array, check_dtype, check_reduce
from overcast.engine.engine import Engine, Work
from overcast.errors import InvalidArgumentError, OvercastError
from overcast.protocols.base import Descriptor
from overcast.protocols.ring import RingAllGather, RingReduceScatter
from overcast.protocols.session import Session
from overcast.transport.rendezvous import rendezvous

DEFAULT_FRAME_BYTES = 128 * 1024
PROTOCOLS = {
    ("all_gather", "ring"): RingAllGather,
    ("reduce_scatter", "ring"): RingReduceScatter,
}


class Communicator:
    """P ranks that run collectives together, each with its own progress engine thread.

    Collectives are issued in the same order on every rank, as in NCCL; several may be in flight.
    Rank and world size default to RANK and WORLD_SIZE; rendezvous uses MASTER_ADDR/MASTER_PORT
    unless a `store` (any object with set/get, a torch.distributed Store included) is given.
    `timeout` bounds how long any collective may go without progress before it fails.
    """

    def __init__(self, rank: int | None = None, world_size: int | None = None, *,
                 name: str = "default", store=None, secret: bytes | None = None,
                 timeout: float = 120.0, frame_bytes: int = DEFAULT_FRAME_BYTES):
        self.rank = int(os.environ["RANK"]) if rank is None else rank
        self.world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        self.name, self.timeout, self.frame_bytes = name, timeout, frame_bytes
        links = rendezvous(self.rank, self.world_size, name=name, store=store, secret=secret,
                           timeout=timeout)
        self.address = links.address
        self._engine = Engine(links, Session(self.rank, self.world_size, timeout))
        self._lock = threading.Lock()
        self._seq = 0
        self._closed = False

    # -- collectives -----------------------------------------------------------------------
    def all_gather(self, output, input, async_op: bool = False, algorithm: str = "ring"):
        """Gather every rank's `input` into `output` (world_size x input, rank order), as
        torch.distributed.all_gather_into_tensor."""
        out, inp = self._arrays(output, input, "all_gather")
        if out.size != inp.size * self.world_size:
            self._reject(f"all_gather output has {out.size} elements; it needs world_size "
                         f"({self.world_size}) x input ({inp.size}) = "
                         f"{inp.size * self.world_size}")
        return self._issue(Descriptor("all_gather", algorithm, inp.dtype, inp.size), out, inp,
                           async_op)

    def reduce_scatter(self, output, input, op: str = "sum", async_op: bool = False,
                       algorithm: str = "ring"):
        """Sum (or average) `input` across ranks and leave block `rank` of the result in
        `output`, as torch.distributed.reduce_scatter_tensor."""
        out, inp = self._arrays(output, input, "reduce_scatter")
        try:
            check_reduce(inp.dtype, op)
        except InvalidArgumentError as err:
            self._reject(str(err))
        if inp.size != out.size * self.world_size:
            self._reject(f"reduce_scatter input has {inp.size} elements; it needs world_size "
                         f"({self.world_size}) x output ({out.size}) = "
                         f"{out.size * self.world_size}")
        if np.shares_memory(out, inp):
            self._reject("reduce_scatter output and input overlap; give separate buffers")
        return self._issue(Descriptor("reduce_scatter", algorithm, inp.dtype, out.size, op), out,
                           inp, async_op)

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (a one-element all_gather)."""
        mine = np.zeros(1, np.int64)
        self.all_gather(np.empty(self.world_size, np.int64), mine)

    # -- plumbing --------------------------------------------------------------------------
    def _arrays(self, output, input, what: str):
        try:
            out = as_array(output, f"{what} output")
            inp = as_array(input, f"{what} input")
            check_dtype(inp, f"{what} input")
            if out.dtype != inp.dtype:
                raise InvalidArgumentError(f"{what} output is {out.dtype} but input is {inp.dtype}")
            if not out.flags.writeable:
                raise InvalidArgumentError(f"{what} output is read-only")
        except InvalidArgumentError as err:
            self._reject(str(err))
        return out, inp

    def _reject(self, message: str):
        """Bad input on this rank: raise here and fail the communicator on every other rank,
        which would otherwise wait for this rank's part of the collective."""
        error = InvalidArgumentError(f"rank {self.rank}: {message}")
        self._engine.abort(OvercastError(f"bad input on rank {self.rank}: {message}"))
        raise error

    def _issue(self, desc: Descriptor, out, inp, async_op: bool) -> Work | None:
        protocol = PROTOCOLS.get((desc.collective, desc.algorithm))
        if protocol is None:
            known = ", ".join(a for c, a in PROTOCOLS if c == desc.collective)
            self._reject(f"{desc.collective} has no algorithm {desc.algorithm!r}; "
                         f"available: {known}")
        with self._lock:
            if self._closed:
                raise OvercastError("the communicator is closed")
            seq = self._seq
            self._seq += 1
            coll = protocol(seq, self.rank, self.world_size, desc, out, inp, self.frame_bytes)
            work = Work(seq, str(desc))
            self._engine.submit(coll, work)
        if async_op:
            return work
        work.wait()
        return None

    def counters(self) -> dict:
        """Dropped messages by reason, stale messages, bytes through the streams."""
        return self._engine.counters()

    def close(self) -> None:
        """Tell the peers goodbye and stop the engine. Pending collectives fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
