"""The "overcast" torch.distributed backend: a Python ProcessGroup whose collectives run on one
overcast Communicator per group.

torch calls the methods below from Python (dist.all_reduce...) and from C++ (DDP's reducer,
FSDP2, functional collectives); each returns a dist.Work whose future's value is the call's
outputs. The group's worker thread runs the calls one at a time in the order they were made,
the same order on every rank, so that a collective made of several overcast collectives
(all_reduce's pieces, a list's tensors one by one) keeps its sequence numbers together;
inside one call, overcast's collectives run several at a time (the full-duplex all_reduce's
point). Futures complete on another thread, so a callback may wait for any later call
(overcast/distributed/calls.py).

Bad arguments raise InvalidArgumentError from the call on the rank that gave them, before any of
its data moves. When one rank alone makes such a call, its place among the group's calls is
refused (Communicator.refuse): the other ranks' same call raises it too, naming the rank, and the
group stays usable.

CUDA tensors are staged through pinned host memory as gloo stages them (overcast/staging.py): the
copies to the host queue on a side stream after the caller's stream, the collective runs on the
worker thread, the copies back queue on the side stream, and wait() makes the caller's then-current
stream wait for them (the host waits for the collective only).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.distributed_c10d import GroupName

from overcast.buffers import SUMMING_OPS
from overcast.comm import ALGORITHMS
from overcast.distributed.calls import Calls
from overcast.distributed.tensors import (
    as_bytes,
    contiguous,
    one_tensor,
    op_of,
    reduce_op,
    reducible,
    root_of,
    staged,
)
from overcast.errors import (
    CommunicatorClosedError,
    InvalidArgumentError,
    MulticastNotDeliveredWarning,
)
from overcast.job import GroupCommunicator, group_communicator

BACKEND_NAME = "overcast"
DEVICES = ("cpu", "cuda")  # the devices the backend is registered for
# Which algorithm each collective runs, by environment variable; "auto" (the default) picks the
# fastest the communicator can run: the multicast and in-network ones when the link rate is
# known (OVERCAST_LINK_BITS_PER_S) and multicast works here, the rings otherwise.
ALGORITHM_ENV = {
    "all_gather": "OVERCAST_ALL_GATHER",
    "reduce_scatter": "OVERCAST_REDUCE_SCATTER",
    "all_reduce": "OVERCAST_ALL_REDUCE",
    "broadcast": "OVERCAST_BROADCAST",
}
FASTEST = {
    "all_gather": "multicast",
    "reduce_scatter": "innetwork",
    "all_reduce": "fullduplex",
    "broadcast": "multicast",
}
# How long abort() waits for the group to close: its calls failed, its communicators closed,
# the aggregator rank 0 started stopped.
ABORT_SECONDS = 15.0


class _Lifetime:
    """A group from open through closing to closed, ended by whichever comes first: shutdown(),
    destroy_process_group, abort(), or the exit (a finalizer: this holds no reference to the
    group). It owns the group's calls, its communicator, and (to abort them with it) overlap()'s
    companions over the group."""

    def __init__(self, calls: Calls, group: GroupCommunicator, seconds: float):
        self.calls, self.group, self.seconds = calls, group, seconds
        self.companions: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._state = "open"
        self._closed = threading.Event()

    def _begin(self) -> bool:
        """Open to closing; False if it was not open."""
        with self._lock:
            if self._state != "open":
                return False
            self._state = "closing"
            return True

    def close(self) -> None:
        """Close once: the calls made run first, for half the group's timeout at most; then the
        communicator closes under them, failing them on every rank. A second caller waits for
        the first (the group's timeout at most)."""
        if self._begin():
            self._close(aborted=False)
        else:
            self._closed.wait(self.seconds)

    def abort(self, reason: str) -> None:
        """Fail every call in flight now, on every rank, unless closed; close (on a thread of its
        own, so that a call stuck outside the network cannot hold this), waiting ABORT_SECONDS
        at most (not at all from a callback: the close waits for the callbacks)."""
        with self._lock:
            closed = self._state == "closed"
        if not closed:
            for comm in [self.group.comm, *self.companions]:
                comm.abort(reason)
            if self.group.job_aggregator is not None:  # a close may be waiting for the others
                self.group.job_aggregator.aborted.set()
        if self._begin():
            threading.Thread(
                target=self._close, args=(True,), daemon=True, name="overcast-abort"
            ).start()
        if threading.current_thread() not in self.calls.threads():  # a callback's abort would
            self._closed.wait(ABORT_SECONDS)  # wait for itself

    def _close(self, aborted: bool) -> None:
        try:
            if not self.calls.stop(self.seconds / 2):
                self.group.comm.close()
                self.calls.stop(self.seconds / 4)
        finally:
            try:  # aborted, every rank fails without the aggregator: stop it now
                self.group.close(wait_for_peers=not aborted)
            except Exception:  # at exit the store's host may be gone; nothing waits for us
                pass
            with self._lock:
                self._state = "closed"
            self._closed.set()


def _gathered_json(comm, value) -> list[Any]:
    """Every rank's `value` (JSON), in rank order: two ring all_gathers over `comm`."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.empty(comm.world_size, np.int64)
    comm.all_gather(sizes, np.array([data.size], np.int64))
    width = int(sizes.max())
    padded = np.zeros(width, np.uint8)
    padded[: data.size] = data
    gathered = np.empty(comm.world_size * width, np.uint8)
    comm.all_gather(gathered, padded)
    return [
        json.loads(gathered[r * width : r * width + int(n)].tobytes()) for r, n in enumerate(sizes)
    ]


class ProcessGroupOvercast(dist.ProcessGroup):
    """A torch.distributed process group over one overcast Communicator (see the module's doc
    and docs/backend.md). `communicator` is that Communicator; `algorithms` the algorithm each
    collective runs; `global_ranks` the job's rank of each of the group's, which its calls'
    errors name beside the group's."""

    def __init__(
        self,
        store,
        rank: int,
        world: int,
        timeout: float,
        group_id: str,
        global_ranks: list[int] | None = None,
    ):
        # torch's stub names only the (store, rank, size) form; (rank, size) is the one for
        # a backend that keeps its own store
        super().__init__(rank, world)  # type: ignore[call-arg]
        self._group_name, self._group_desc = GroupName(group_id), ""
        self._store, self._timeout = store, timeout
        link = os.environ.get("OVERCAST_LINK_BITS_PER_S")
        chosen = {c: os.environ.get(env, "auto") for c, env in ALGORITHM_ENV.items()}
        for collective, algorithm in chosen.items():
            known = ALGORITHMS[collective]
            if algorithm != "auto" and algorithm not in known:
                raise InvalidArgumentError(
                    f"{ALGORITHM_ENV[collective]}={algorithm!r} is not one of auto, "
                    f"{', '.join(known)}"
                )
        in_network = any(
            chosen[c] in ("innetwork", "fullduplex") or (chosen[c] == "auto" and link)
            for c in ("reduce_scatter", "all_reduce")
        )
        # torch names a group alike on every rank (its ranks' hash, or a count every rank
        # keeps); the store tells this group from an earlier one of the same name.
        self._group = group_communicator(
            store,
            rank,
            world,
            f"pg-{group_id}",
            in_network=in_network,
            timeout=timeout,
            fail_peers_on_bad_input=False,
        )
        self.communicator = self._group.comm
        try:
            self._fallbacks: dict[str, str] = {}  # why "auto" runs the ring, by collective
            self.algorithms = self._agree(chosen)
        except BaseException:
            self._group.close(wait_for_peers=False)
            raise
        self._calling = threading.local()  # the staging of the CUDA call being made, if any
        self._side_streams: dict[torch.device, object] = {}
        self._calls = Calls(
            f"overcast-{self.communicator.name}",
            refuse=self.communicator.refuse,
            order=self.communicator if world > 1 else None,
            timeout=timeout,
            ranks=global_ranks,
        )
        self._lifetime = _Lifetime(self._calls, self._group, timeout)
        self._finalizer = weakref.finalize(self, self._lifetime.close)

    @property
    def fallbacks(self) -> dict[str, str]:
        """Why a collective runs on the ring where the algorithm chosen (or "auto") would not:
        the network could not carry it when the group was made, or an aggregator was lost
        since (the in-network ReduceScatter and all_reduce then run on the aggregators left, or
        the ring, until it is taken back)."""
        reasons = dict(self._fallbacks)
        lost = self.communicator.in_network_fallback
        for collective, algorithm in self.algorithms.items():
            if lost and algorithm in ("innetwork", "fullduplex") and collective not in reasons:
                reasons[collective] = lost
        return reasons

    def _agree(self, chosen: dict[str, str]) -> dict[str, str]:
        """The algorithms, alike on every rank: each rank's choices must be rank 0's; "auto"
        resolves to the fastest unless any rank cannot run it (its multicast join or its
        registration with the aggregator failed, or multicast was proven undelivered when the
        communicator was made: a MulticastNotDeliveredWarning says so, and the ReduceScatter
        takes the ring too, as overlap()'s does), to the ring otherwise.
        The ranks tell each other over the communicator itself, so nothing is left in the
        store."""
        comm = self.communicator
        mine: dict[str, dict[str, Any]] = {
            "chosen": chosen,
            "cannot": {
                c: comm.unavailable(c, FASTEST[c]) for c, a in chosen.items() if a == "auto"
            },
        }
        said = _gathered_json(comm, mine) if comm.world_size > 1 else [mine]
        for r, theirs in enumerate(said):
            differ = [c for c in chosen if theirs["chosen"][c] != said[0]["chosen"][c]]
            if differ:
                raise InvalidArgumentError(
                    "the ranks choose different algorithms: rank 0 has "
                    + ", ".join(f"{ALGORITHM_ENV[c]}={said[0]['chosen'][c]}" for c in differ)
                    + f", rank {r} "
                    + ", ".join(f"{ALGORITHM_ENV[c]}={theirs['chosen'][c]}" for c in differ)
                    + "; set them alike on every rank"
                )
        reasons: dict[str, str] = {}
        for r, theirs in enumerate(said):
            for c, why in theirs["cannot"].items():
                if why and why != comm.multicast_undelivered and c not in reasons:
                    reasons[c] = f"rank {r}: {why}" if comm.world_size > 1 else why
        for c, why in mine["cannot"].items():  # multicast proven undelivered, which every rank
            if why and c not in reasons:  # says alike, and none explains more closely
                reasons[c] = why
        if (
            comm.multicast_undelivered
            and "reduce_scatter" in mine["cannot"]
            and "reduce_scatter" not in reasons
        ):  # as overlap() does
            reasons["reduce_scatter"] = (
                f"{comm.multicast_undelivered}: an in-network "
                f"ReduceScatter beside a ring AllGather adds to the "
                f"send direction the ring loads already"
            )
        self._fallbacks = reasons
        # Multicast proven undelivered when the communicator was made (alike on every rank):
        # said once, naming the ranks that did not hear and the collectives that take the ring.
        undelivered = [
            c
            for c in chosen
            if comm.multicast_undelivered
            and reasons.get(c, "").startswith(comm.multicast_undelivered)
        ]
        if undelivered:
            warnings.warn(
                f"{comm.multicast_undelivered}; group {self._group_name!r} runs "
                f"{', '.join(undelivered)} on the ring",
                MulticastNotDeliveredWarning,
                stacklevel=2,
            )
        return {
            c: ("ring" if c in reasons else FASTEST[c]) if a == "auto" else a
            for c, a in chosen.items()
        }

    def companion_communicator(self, *, in_network: bool, trace: bool = False) -> GroupCommunicator:
        """Another communicator over this group's ranks, meeting through its store and sharing
        its aggregator and secret: for a caller that posts collectives from its own thread
        (overlap()), so that each communicator has one issuing order on every rank. Call it on
        every rank of the group; close it before the group."""
        made = group_communicator(
            self._store,
            self.rank(),
            self.size(),
            f"{self.communicator.name}-companion",
            in_network=in_network,
            secret_hex=self._group.secret_hex,
            aggregators=self._group.aggregators,
            timeout=self._timeout,
            trace=trace,
        )
        self._lifetime.companions.add(made.comm)
        return made

    def _algorithm(self, collective: str, op: str) -> str:
        """The group's algorithm for a reduction, or the ring for ops the network cannot do."""
        return self.algorithms[collective] if op in SUMMING_OPS else "ring"

    # -- names torch asks for --------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = GroupName(name)

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> GroupName:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # -- the group as its own backend on each device -------------------------------------
    # torch registers no backend per device for a process group a plugin returns (the group is
    # its own backend), so torch's own _device_types is empty and _get_backend raises: DCP's
    # async_save refused and a state dict's broadcast_from_rank0 took the first of no devices.
    # torch's Python code finds the group here; its C++ callers still see no backend ("What goes
    # to gloo" in docs/backend.md).
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in DEVICES]

    # torch types it a Backend; its Python callers ask only what this group answers itself
    def _get_backend(self, device) -> ProcessGroupOvercast:  # type: ignore[override]
        if torch.device(device).type not in DEVICES:
            raise RuntimeError(
                f"No backend type associated with device type {torch.device(device).type}"
            )
        return self

    # what torch asks a device's backend before using a C++ backend's extras: none here
    supports_splitting = supports_shrinking = supports_time_estimate = False

    def supports_tensor_alloc(self, device) -> bool:
        return False

    def shutdown(self) -> None:
        """Run the calls made (for half the group's timeout at most), then close the
        communicator: destroy_process_group, or by hand. Later calls raise."""
        self._lifetime.close()

    def abort(self) -> None:
        """End every call in flight now, on every rank of the group (theirs fail naming this
        rank), overlap()'s over the group too, and close, within ABORT_SECONDS: torch's
        _abort_process_group, whether the group is open or closing."""
        self._lifetime.abort("the process group was aborted")

    # -- plumbing --------------------------------------------------------------------------
    def _side_stream(self, device: torch.device):
        """The group's high-priority stream on `device`, for its staging copies (gloo's)."""
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device, priority=-1)
        return stream

    def _submit(self, what: str, fn, result) -> dist.Work:
        return self._calls.submit(what, fn, result, getattr(self._calling, "staging", None))

    def _refused(self, what: str, error: Exception) -> None:
        """A call that failed before it was queued (its tensors' devices, its staging): queued
        anyway, as a call that raises `error`, so that the worker refuses it to the other ranks
        in its place among the calls (Communicator.refuse), numbered as theirs."""

        def fail():
            raise error

        with contextlib.suppress(CommunicatorClosedError):
            self._calls.submit(what, fail, None)

    def _all_reduce(self, t: torch.Tensor, op) -> None:
        name, factor = reduce_op(op)
        with contiguous(t) as work:
            if factor is not None:
                work.mul_(factor)
            self.communicator.all_reduce(
                reducible(work, name, "all_reduce"), name, self._algorithm("all_reduce", name)
            )

    def _all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if out.numel() != inp.numel() * self.size() or out.dtype != inp.dtype:
            raise InvalidArgumentError(
                f"all_gather: the output holds {out.numel()} x {out.dtype}, it needs "
                f"world_size ({self.size()}) x the input's {inp.numel()} x {inp.dtype}"
            )
        with contiguous(out) as dest:
            self.communicator.all_gather(
                as_bytes(dest), as_bytes(inp.contiguous()), algorithm=self.algorithms["all_gather"]
            )

    def _all_gather_list(self, outs, inp: torch.Tensor, keep: bool = True) -> torch.Tensor:
        """All ranks' `inp` into the tensors `outs` (rank order), if `keep`; returns them as
        one tensor (world_size x the input's shape)."""
        if keep and (len(outs) != self.size() or any(o.numel() != inp.numel() for o in outs)):
            raise InvalidArgumentError(
                f"all_gather: needs world_size ({self.size()}) outputs of the input's "
                f"{inp.numel()} elements; got {[o.numel() for o in outs]}"
            )
        gathered = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
        self._all_gather_into(gathered, inp)
        if keep:
            for o, piece in zip(outs, gathered):
                o.copy_(piece)
        return gathered

    def _reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, op) -> None:
        name, factor = reduce_op(op)
        if out.numel() * self.size() != inp.numel() or out.dtype != inp.dtype:
            raise InvalidArgumentError(
                f"reduce_scatter: the input holds {inp.numel()} x {inp.dtype}, it needs "
                f"world_size ({self.size()}) x the output's {out.numel()} x {out.dtype}"
            )
        source = inp.contiguous()
        if factor is not None:
            source = source * factor
        with contiguous(out) as dest:
            self.communicator.reduce_scatter(
                reducible(dest, name, "reduce_scatter output"),
                reducible(source, name, "reduce_scatter input"),
                name,
                algorithm=self._algorithm("reduce_scatter", name),
            )

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        with contiguous(t) as work:
            self.communicator.broadcast(
                as_bytes(work), root, algorithm=self.algorithms["broadcast"]
            )

    # -- collectives ------------------------------------------------------------------------
    @staged("inout")
    def allreduce(self, tensors, opts=None) -> dist.Work:
        def run():
            for t in tensors:
                self._all_reduce(t, op_of(opts))

        return self._submit("all_reduce", run, tensors)

    @staged("inout")
    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        def run():
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                same = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.reshape(-1) for t in same])
                self._all_reduce(flat, op_of(opts))
                for t, piece in zip(same, flat.split([t.numel() for t in same])):
                    t.copy_(piece.view_as(t))

        return self._submit("all_reduce_coalesced", run, tensors)

    @staged("out", "in")
    def allgather(self, output_lists, inputs, opts=None) -> dist.Work:
        """The future's value is each input's gathered outputs as one tensor (world_size x the
        input's shape), as NCCL's: PyTorch's quantization comm hooks index it so."""
        gathered: list[torch.Tensor] = []

        def run():
            for outs, inp in zip(output_lists, inputs):
                gathered.append(self._all_gather_list(outs, inp))

        return self._submit("all_gather", run, gathered)

    @staged("out", "in")
    def allgather_coalesced(self, output_lists, inputs, opts=None) -> dist.Work:
        """output_lists[r][i] receives rank r's inputs[i]."""

        def run():
            for i, inp in enumerate(inputs):
                self._all_gather_list([outs[i] for outs in output_lists], inp)

        return self._submit("all_gather_coalesced", run, output_lists)

    @staged("out", "in")
    def all_gather_single(self, output, input, opts=None) -> dist.Work:
        return self._submit(
            "all_gather_into_tensor", lambda: self._all_gather_into(output, input), [output]
        )

    _allgather_base = all_gather_single

    @staged("out", "in")
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        def run():
            for out, inp in zip(outputs, inputs):
                self._all_gather_into(out, inp)

        return self._submit("all_gather_into_tensor_coalesced", run, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @staged("out", "in")
    def reduce_scatter(self, outputs, input_lists, opts=None) -> dist.Work:
        def run():
            for out, ins in zip(outputs, input_lists):
                if len(ins) != self.size() or any(i.numel() != out.numel() for i in ins):
                    raise InvalidArgumentError(
                        f"reduce_scatter: needs world_size ({self.size()}) inputs of the "
                        f"output's {out.numel()} elements; got {[i.numel() for i in ins]}"
                    )
                self._reduce_scatter_into(out, torch.cat([i.reshape(-1) for i in ins]), op_of(opts))

        return self._submit("reduce_scatter", run, outputs)

    @staged("out", "in")
    def reduce_scatter_single(self, output, input, opts=None) -> dist.Work:
        return self._submit(
            "reduce_scatter_tensor",
            lambda: self._reduce_scatter_into(output, input, op_of(opts)),
            [output],
        )

    _reduce_scatter_base = reduce_scatter_single

    @staged("out", "in")
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        def run():
            for out, inp in zip(outputs, inputs):
                self._reduce_scatter_into(out, inp, op_of(opts))

        return self._submit("reduce_scatter_tensor_coalesced", run, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @staged("inout")
    def broadcast(self, tensors, opts=None) -> dist.Work:
        def run():
            for t in tensors:
                self._broadcast(t, root_of(opts))

        return self._submit("broadcast", run, tensors)

    def barrier(self, opts=None) -> dist.Work:
        return self._submit("barrier", self.communicator.barrier, [])

    @staged("inout")
    def reduce(self, tensors, opts=None) -> dist.Work:
        """An all_reduce whose result only the root keeps (the others reduce a copy)."""

        def run():
            for t in tensors:
                self._all_reduce(t if self.rank() == root_of(opts) else t.clone(), op_of(opts))

        return self._submit("reduce", run, tensors)

    @staged("inout", "in")
    def gather(self, output_lists, inputs, opts=None) -> dist.Work:
        """An all_gather whose result only the root keeps."""

        def run():
            for i, inp in enumerate(inputs):
                self._all_gather_list(
                    output_lists[i] if output_lists else [], inp, keep=self.rank() == root_of(opts)
                )

        return self._submit("gather", run, output_lists)

    @staged("out", "in")
    def scatter(self, outputs, input_lists, opts=None) -> dist.Work:
        """The root's inputs broadcast as one buffer, each rank keeping its own piece."""

        def run():
            for i, out in enumerate(outputs):
                whole = (
                    torch.stack([x.reshape(out.shape) for x in input_lists[i]])
                    if self.rank() == root_of(opts)
                    else torch.empty((self.size(), *out.shape), dtype=out.dtype)
                )
                self._broadcast(whole, root_of(opts))
                out.copy_(whole[self.rank()])

        return self._submit("scatter", run, outputs)

    @staged("out", "in")
    def alltoall_base(
        self, output, input, output_split_sizes, input_split_sizes, opts=None
    ) -> dist.Work:
        """A pairwise exchange (Communicator.all_to_all), every rank's split sizes first."""
        return self._submit(
            "all_to_all_single",
            lambda: self._all_to_all(
                output, input, list(output_split_sizes), list(input_split_sizes)
            ),
            [output],
        )

    all_to_all_single = alltoall_base

    @staged("out", "in")
    def alltoall(self, outputs, inputs, opts=None) -> dist.Work:
        def run():
            flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype)
            flat_in = torch.cat([i.reshape(-1) for i in inputs])
            self._all_to_all(
                flat_out, flat_in, [o.numel() for o in outputs], [i.numel() for i in inputs]
            )
            for o, piece in zip(outputs, flat_out.split([o.numel() for o in outputs])):
                o.copy_(piece.view_as(o))

        return self._submit("all_to_all", run, outputs)

    def _all_to_all(self, output, input, out_splits, in_splits) -> None:
        """Rows (the first dimension) of the tensors' bytes, split as torch splits them (empty
        split lists: evenly)."""
        row_shape = tuple(input.shape[1:]) if input.dim() else ()
        if (
            output.dtype != input.dtype
            or (tuple(output.shape[1:]) if output.dim() else ()) != row_shape
        ):
            raise InvalidArgumentError(
                f"all_to_all: the output's rows are {tuple(output.shape[1:])} x {output.dtype}, "
                f"the input's {row_shape} x {input.dtype}; they must be alike"
            )
        rows = input.shape[0] if input.dim() else 1
        out_rows = output.shape[0] if output.dim() else 1
        row = math.prod(row_shape) * input.element_size()
        with contiguous(output) as dest:
            if row:
                sent, received = as_bytes(input.contiguous()), as_bytes(dest)
            else:  # rows of nothing: a byte a row stands in for each, so the sizes are checked
                sent, received, row = np.zeros(rows, np.uint8), np.empty(out_rows, np.uint8), 1
            self.communicator.all_to_all(
                received, sent, out_splits or None, in_splits or None, row=row
            )

    # -- point to point ----------------------------------------------------------------------
    @staged("in")
    def send(self, tensors, dstRank: int, tag: int) -> dist.Work:
        """Sent over the communicator's stream to the peer (Communicator.isend): complete once
        the data is copied, or taken by the peer's recv."""
        tensor = one_tensor(tensors, "send")
        return self._calls.submit_transfer(
            "send",
            lambda: self.communicator.isend(as_bytes(tensor.contiguous()), dstRank, tag),
            tensors,
            getattr(self._calling, "staging", None),
        )

    @staged("out")
    def recv(self, tensors, srcRank: int, tag: int) -> dist.Work:
        return self._recv(tensors, srcRank, tag)

    @staged("out")
    def recv_anysource(self, tensors, tag: int) -> dist.Work:
        """The work's _source_rank() is the sender, as torch.distributed.recv asks."""
        return self._recv(tensors, None, tag)

    def _recv(self, tensors, src: int | None, tag: int) -> dist.Work:
        tensor = one_tensor(tensors, "recv")
        target = (
            tensor
            if tensor.is_contiguous()
            else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        )
        return self._calls.submit_transfer(
            "recv",
            lambda: self.communicator.irecv(as_bytes(target), src, tag),
            tensors,
            getattr(self._calling, "staging", None),
            None if target is tensor else lambda: tensor.copy_(target),
        )


def create(backend_opts, options=None) -> ProcessGroupOvercast:
    """The backend's constructor torch calls once per group (new_group and DeviceMesh's
    subgroups too), with the group's store, rank, size, timeout and name."""
    return ProcessGroupOvercast(
        backend_opts.store,
        backend_opts.group_rank,
        backend_opts.group_size,
        backend_opts.timeout.total_seconds(),
        backend_opts.group_id,
        list(backend_opts.global_ranks_in_group) or None,
    )


def register() -> None:
    """Register "overcast" with torch.distributed (once; importing overcast.distributed does)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, create, extended_api=True, devices=list(DEVICES)
        )
    # torch 2.15 attaches its flight recorder to every new group but those of the backends in
    # this set, through the C++ group's name, which a group a plugin returns has none of (it is
    # its own backend): every group failed to be made. It skips such groups by their empty
    # _device_types, which this one answers for torch's Python callers (ProcessGroupOvercast).
    self_recording = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if self_recording is not None:
        self_recording.add(BACKEND_NAME)
