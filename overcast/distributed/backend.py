"""The "overcast" torch.distributed backend: a Python ProcessGroup whose collectives run on one
overcast Communicator per group.

torch calls the methods below from Python (dist.all_reduce...) and from C++ (DDP's reducer,
FSDP2, functional collectives); each returns a dist.Work made from a torch Future. The group's
one worker thread runs the calls in the order they were made, the same order on every rank, so
that a collective made of several overcast collectives (all_reduce's pieces, all_to_all's
exchange of sizes) keeps its sequence numbers together; inside one call, overcast's collectives
run several at a time (the full-duplex all_reduce's point).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import weakref

import numpy as np
import torch
import torch.distributed as dist

from overcast.buffers import DTYPES, SUMMING_OPS, as_array
from overcast.comm import ALGORITHMS, Communicator
from overcast.errors import InvalidArgumentError, OvercastError
from overcast.job import group_communicator
from overcast.torch_api import premul_factor

BACKEND_NAME = "overcast"
# Which algorithm each collective runs, by environment variable; "auto" (the default) picks the
# fastest the communicator can run: the multicast and in-network ones when the link rate is
# known (OVERCAST_LINK_BITS_PER_S) and multicast works here, the rings otherwise.
ALGORITHM_ENV = {"all_gather": "OVERCAST_ALL_GATHER", "reduce_scatter": "OVERCAST_REDUCE_SCATTER",
                 "all_reduce": "OVERCAST_ALL_REDUCE", "broadcast": "OVERCAST_BROADCAST"}
FASTEST = {"all_gather": "multicast", "reduce_scatter": "innetwork", "all_reduce": "fullduplex",
           "broadcast": "multicast"}
# torch's reduce ops as overcast's; PREMUL_SUM is a sum of inputs scaled first.
REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
              dist.ReduceOp.MIN: "min", dist.ReduceOp.PRODUCT: "product",
              dist.ReduceOp.PREMUL_SUM: "sum"}
_names = itertools.count()


def _reduce_op(op) -> tuple[str, object]:
    """(overcast op, premultiplying factor or None) for a torch ReduceOp."""
    kind = getattr(op, "op", op)
    for torch_op, name in REDUCE_OPS.items():
        if kind == torch_op:
            return name, premul_factor(op)
    raise InvalidArgumentError(f"reduce op {kind} is not offered by overcast; supported: SUM, "
                               f"AVG, PREMUL_SUM, MAX, MIN, PRODUCT")


def _check_cpu(tensors, what: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise InvalidArgumentError(f"{what}: a tensor is on {t.device}; the overcast "
                                       f"backend moves CPU tensors only")


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a flat uint8 array, for collectives that only move data:
    every dtype goes (bool, complex, int16...)."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def _reducible(t: torch.Tensor, op: str, what: str) -> np.ndarray:
    """A contiguous tensor as the array overcast reduces: complex numbers as pairs of reals,
    which sums and averages treat correctly and the other ops would not."""
    if t.is_complex():
        if op not in ("sum", "avg"):
            raise InvalidArgumentError(f"{what}: op {op} is not defined on complex tensors")
        t = torch.view_as_real(t)
    arr = as_array(t, what)
    if arr.dtype not in DTYPES:
        raise InvalidArgumentError(f"{what}: overcast cannot reduce {t.dtype}; supported: "
                                   f"float32, float64, float16, bfloat16, complex64, "
                                   f"complex128, int8, int32, int64, uint8")
    return arr


@contextlib.contextmanager
def _contiguous(t: torch.Tensor):
    """`t` itself if it is contiguous; otherwise a contiguous copy, written back after."""
    work = t if t.is_contiguous() else t.contiguous()
    yield work
    if work is not t:
        t.copy_(work)


class _Work(dist._Work):
    """A call's handle: wait() raises what the call raised (a Work made by torch from the
    Future alone returns True whatever happened), get_future() is what DDP chains on."""

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


class _Worker:
    """One thread that runs the group's calls in order, each completing its torch Future."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, result) -> dist.Work:
        fut = torch.futures.Future()
        self._calls.put((fn, result, fut))
        return _Work(fut)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, result, fut = call
            try:
                fn()
            except BaseException as err:  # the caller's wait() raises it
                fut.set_exception(err)
            else:
                fut.set_result(result)

    def stop(self) -> None:
        self._calls.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


def _close(worker: _Worker, comm: Communicator, job_switch) -> None:
    """Stop the worker, close the communicator and, on rank 0, the aggregator it started;
    when the group is destroyed or at exit."""
    try:
        worker.stop()
        comm.close()
    finally:
        if job_switch is not None:
            try:
                job_switch.close(comm.rank)
            except Exception:  # at exit the store's host may be gone; nothing waits for us
                pass


class ProcessGroupOvercast(dist.ProcessGroup):
    """A torch.distributed process group over one overcast Communicator (see the module's doc
    and docs/backend.md). `communicator` is that Communicator; `algorithms` the algorithm each
    collective runs."""

    def __init__(self, store, rank: int, world: int, timeout: float, group_id: str):
        super().__init__(rank, world)
        self._group_name, self._group_desc = group_id, ""
        link = os.environ.get("OVERCAST_LINK_BITS_PER_S")
        chosen = {c: os.environ.get(env, "auto") for c, env in ALGORITHM_ENV.items()}
        for collective, algorithm in chosen.items():
            known = ALGORITHMS[collective]
            if algorithm != "auto" and algorithm not in known:
                raise InvalidArgumentError(
                    f"{ALGORITHM_ENV[collective]}={algorithm!r} is not one of auto, "
                    f"{', '.join(known)}")
        in_network = any(chosen[c] in ("innetwork", "fullduplex") or
                         (chosen[c] == "auto" and link)
                         for c in ("reduce_scatter", "all_reduce"))
        name = f"pg-{group_id}-{next(_names)}"
        self.communicator, job_switch = group_communicator(store, rank, world, name,
                                                           in_network=in_network,
                                                           timeout=timeout)
        self.algorithms = {c: self._auto(c) if a == "auto" else a for c, a in chosen.items()}
        self._worker = _Worker(f"overcast-{name}")
        self._finalizer = weakref.finalize(self, _close, self._worker, self.communicator,
                                           job_switch)

    def _auto(self, collective: str) -> str:
        fastest = FASTEST[collective]
        return fastest if self.communicator.unavailable(collective, fastest) is None else "ring"

    def _algorithm(self, collective: str, op: str) -> str:
        """The group's algorithm for a reduction, or the ring for ops the network cannot do."""
        return self.algorithms[collective] if op in SUMMING_OPS else "ring"

    # -- names torch asks for --------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def shutdown(self) -> None:
        """Close the communicator now (destroy_process_group, or by hand)."""
        self._finalizer()

    # -- plumbing --------------------------------------------------------------------------
    def _submit(self, what: str, tensors, fn, result) -> dist.Work:
        _check_cpu(tensors, what)
        if not self._finalizer.alive:
            raise OvercastError(f"{what}: the overcast process group is shut down")
        return self._worker.submit(fn, result)

    def _all_reduce(self, t: torch.Tensor, op) -> None:
        name, factor = _reduce_op(op)
        with _contiguous(t) as work:
            if factor is not None:
                work.mul_(factor)
            self.communicator.all_reduce(_reducible(work, name, "all_reduce"), name,
                                         self._algorithm("all_reduce", name))

    def _all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if out.numel() != inp.numel() * self.size() or out.dtype != inp.dtype:
            raise InvalidArgumentError(
                f"all_gather: the output holds {out.numel()} x {out.dtype}, it needs "
                f"world_size ({self.size()}) x the input's {inp.numel()} x {inp.dtype}")
        with _contiguous(out) as dest:
            self.communicator.all_gather(_bytes(dest), _bytes(inp.contiguous()),
                                         algorithm=self.algorithms["all_gather"])

    def _all_gather_list(self, outs, inp: torch.Tensor, keep: bool = True) -> None:
        """All ranks' `inp` into the tensors `outs` (rank order), if `keep`."""
        if keep and (len(outs) != self.size() or any(o.numel() != inp.numel() for o in outs)):
            raise InvalidArgumentError(
                f"all_gather: needs world_size ({self.size()}) outputs of the input's "
                f"{inp.numel()} elements; got {[o.numel() for o in outs]}")
        gathered = torch.empty((self.size(),) + tuple(inp.shape), dtype=inp.dtype)
        self._all_gather_into(gathered, inp)
        if keep:
            for o, piece in zip(outs, gathered):
                o.copy_(piece)

    def _reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, op) -> None:
        name, factor = _reduce_op(op)
        if out.numel() * self.size() != inp.numel() or out.dtype != inp.dtype:
            raise InvalidArgumentError(
                f"reduce_scatter: the input holds {inp.numel()} x {inp.dtype}, it needs "
                f"world_size ({self.size()}) x the output's {out.numel()} x {out.dtype}")
        source = inp.contiguous()
        if factor is not None:
            source = source * factor
        with _contiguous(out) as dest:
            self.communicator.reduce_scatter(_reducible(dest, name, "reduce_scatter output"),
                                             _reducible(source, name, "reduce_scatter input"),
                                             name, algorithm=self._algorithm("reduce_scatter",
                                                                             name))

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        with _contiguous(t) as work:
            self.communicator.broadcast(_bytes(work), root,
                                        algorithm=self.algorithms["broadcast"])

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors, opts) -> dist.Work:
        def run():
            for t in tensors:
                self._all_reduce(t, opts.reduceOp)
        return self._submit("all_reduce", tensors, run, tensors)

    def allreduce_coalesced(self, tensors, opts) -> dist.Work:
        def run():
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                same = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.reshape(-1) for t in same])
                self._all_reduce(flat, opts.reduceOp)
                for t, piece in zip(same, flat.split([t.numel() for t in same])):
                    t.copy_(piece.view_as(t))
        return self._submit("all_reduce_coalesced", tensors, run, tensors)

    def allgather(self, output_lists, inputs, opts) -> dist.Work:
        def run():
            for outs, inp in zip(output_lists, inputs):
                self._all_gather_list(outs, inp)
        return self._submit("all_gather", list(inputs) + [o for outs in output_lists
                                                         for o in outs], run, output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts) -> dist.Work:
        """output_lists[r][i] receives rank r's inputs[i]."""
        def run():
            for i, inp in enumerate(inputs):
                self._all_gather_list([outs[i] for outs in output_lists], inp)
        return self._submit("all_gather_coalesced", list(inputs), run, output_lists)

    def all_gather_single(self, output, input, opts) -> dist.Work:
        return self._submit("all_gather_into_tensor", [output, input],
                            lambda: self._all_gather_into(output, input), [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts) -> dist.Work:
        def run():
            for out, inp in zip(outputs, inputs):
                self._all_gather_into(out, inp)
        return self._submit("all_gather_into_tensor_coalesced", list(outputs) + list(inputs),
                            run, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts) -> dist.Work:
        def run():
            for out, ins in zip(outputs, input_lists):
                if len(ins) != self.size() or any(i.numel() != out.numel() for i in ins):
                    raise InvalidArgumentError(
                        f"reduce_scatter: needs world_size ({self.size()}) inputs of the "
                        f"output's {out.numel()} elements; got {[i.numel() for i in ins]}")
                self._reduce_scatter_into(out, torch.cat([i.reshape(-1) for i in ins]),
                                          opts.reduceOp)
        return self._submit("reduce_scatter", list(outputs), run, outputs)

    def reduce_scatter_single(self, output, input, opts) -> dist.Work:
        return self._submit("reduce_scatter_tensor", [output, input],
                            lambda: self._reduce_scatter_into(output, input, opts.reduceOp),
                            [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts) -> dist.Work:
        def run():
            for out, inp in zip(outputs, inputs):
                self._reduce_scatter_into(out, inp, opts.reduceOp)
        return self._submit("reduce_scatter_tensor_coalesced", list(outputs) + list(inputs),
                            run, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def broadcast(self, tensors, opts) -> dist.Work:
        def run():
            for t in tensors:
                self._broadcast(t, opts.rootRank)
        return self._submit("broadcast", tensors, run, tensors)

    def barrier(self, opts=None) -> dist.Work:
        return self._submit("barrier", [], self.communicator.barrier, None)

    def reduce(self, tensors, opts) -> dist.Work:
        """An all_reduce whose result only the root keeps (the others reduce a copy)."""
        def run():
            for t in tensors:
                self._all_reduce(t if self.rank() == opts.rootRank else t.clone(),
                                 opts.reduceOp)
        return self._submit("reduce", tensors, run, tensors)

    def gather(self, output_lists, inputs, opts) -> dist.Work:
        """An all_gather whose result only the root keeps."""
        def run():
            for i, inp in enumerate(inputs):
                self._all_gather_list(output_lists[i] if output_lists else [], inp,
                                      keep=self.rank() == opts.rootRank)
        return self._submit("gather", inputs, run, output_lists)

    def scatter(self, outputs, input_lists, opts) -> dist.Work:
        """The root's inputs broadcast as one buffer, each rank keeping its own piece."""
        def run():
            for i, out in enumerate(outputs):
                whole = (torch.stack([x.reshape(out.shape) for x in input_lists[i]])
                         if self.rank() == opts.rootRank else
                         torch.empty((self.size(),) + tuple(out.shape), dtype=out.dtype))
                self._broadcast(whole, opts.rootRank)
                out.copy_(whole[self.rank()])
        return self._submit("scatter", outputs, run, outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,
                      opts) -> dist.Work:
        """Every rank's input gathered by every rank (P times the bytes an all-to-all needs:
        correct, not fast), after an all_gather of the split sizes."""
        return self._submit("all_to_all_single", [output, input],
                            lambda: self._all_to_all(output, input, list(output_split_sizes),
                                                     list(input_split_sizes)), [output])

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts) -> dist.Work:
        def run():
            flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype)
            flat_in = torch.cat([i.reshape(-1) for i in inputs])
            self._all_to_all(flat_out, flat_in, [o.numel() for o in outputs],
                             [i.numel() for i in inputs])
            for o, piece in zip(outputs, flat_out.split([o.numel() for o in outputs])):
                o.copy_(piece.view_as(o))
        return self._submit("all_to_all", list(outputs) + list(inputs), run, outputs)

    def _all_to_all(self, output, input, out_splits, in_splits) -> None:
        world, rank = self.size(), self.rank()
        rows = input.shape[0] if input.dim() else 1
        row = input.numel() // rows if rows else 0
        in_splits = in_splits or [rows // world] * world
        out_rows = output.shape[0] if output.dim() else 1
        out_splits = out_splits or [out_rows // world] * world
        if sum(in_splits) != rows or len(in_splits) != world or len(out_splits) != world:
            raise InvalidArgumentError(f"all_to_all: input split sizes {in_splits} do not "
                                       f"divide the input's {rows} rows among {world} ranks")
        splits = torch.empty(world * world, dtype=torch.int64)
        self._all_gather_into(splits, torch.tensor(in_splits, dtype=torch.int64))
        splits = splits.view(world, world)
        longest = int(splits.sum(dim=1).max()) * row
        padded = torch.zeros(longest, dtype=input.dtype)
        padded[:input.numel()] = input.reshape(-1)
        gathered = torch.empty(world, longest, dtype=input.dtype)
        self._all_gather_into(gathered, padded)
        dest = output.reshape(-1) if output.is_contiguous() else torch.empty(output.numel(),
                                                                             dtype=output.dtype)
        at = 0
        for src in range(world):
            start = int(splits[src, :rank].sum()) * row
            length = int(splits[src, rank]) * row
            if length != out_splits[src] * row:
                raise InvalidArgumentError(
                    f"all_to_all: rank {src} sends {int(splits[src, rank])} rows to rank "
                    f"{rank}, whose output split sizes expect {out_splits[src]}")
            dest[at:at + length] = gathered[src, start:start + length]
            at += length
        if not output.is_contiguous():
            output.copy_(dest.view_as(output))

    def send(self, tensors, dst: int, tag: int) -> dist.Work:
        raise InvalidArgumentError("the overcast backend offers no point-to-point send/recv: "
                                   "its transport is collectives only (docs/backend.md)")

    def recv(self, tensors, src: int, tag: int) -> dist.Work:
        raise InvalidArgumentError("the overcast backend offers no point-to-point send/recv: "
                                   "its transport is collectives only (docs/backend.md)")

    def recv_anysource(self, tensors, tag: int) -> dist.Work:
        return self.recv(tensors, -1, tag)


def create(backend_opts, options=None) -> ProcessGroupOvercast:
    """The backend's constructor torch calls once per group (new_group and DeviceMesh's
    subgroups too), with the group's store, rank, size, timeout and name."""
    return ProcessGroupOvercast(backend_opts.store, backend_opts.group_rank,
                                backend_opts.group_size, backend_opts.timeout.total_seconds(),
                                backend_opts.group_id)


def register() -> None:
    """Register "overcast" with torch.distributed (once; importing overcast.distributed does)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu"])
