"""`overlap(model)`: make a stock FSDP2 model run AllGather and ReduceScatter at once in the
backward pass.

Either through overcast (backend="overcast": multicast AllGather and in-network ReduceScatter on
one overcast Communicator, set with FSDP2's `set_custom_all_gather`/`set_custom_reduce_scatter`),
or through the process group's own collectives (backend="torch": ReduceScatter on a process group
of its own, the path for NCCL, whose NVLS and CollNet/SHARP algorithms are the hardware multicast
and in-network reduction). Both get the same schedule: asynchronous unshard, explicit forward
and backward prefetch, and ReduceScatters that run behind the backward pass, so that while
block i's gradients are reduce-scattered, the parameters of block i-1 are being gathered.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from overcast.buffers import DTYPES, as_array
from overcast.comm import ALGORITHMS, Communicator
from overcast.errors import InvalidArgumentError, MulticastNotDeliveredWarning
from overcast.fsdp.collectives import (
    DeferredReduceScatters,
    GatedAllGathers,
    Poster,
    TimedAllGather,
    TimedReduceScatter,
    hold_poster,
    release_poster,
)
from overcast.fsdp.timing import CommTime
from overcast.job import GroupCommunicator, group_communicator
from overcast.torch_api import (
    collectives,
    live_process_groups,
    own_reduce_scatter_group,
    param_groups,
    reshards_to_a_subgroup,
    restore_schedule,
    schedule,
    set_unshard_async_op,
    shard_process_group,
    wire_dtypes,
)

BACKENDS = ("overcast", "torch")


def _torch_dtype_ok(dtype: torch.dtype) -> bool:
    try:
        return as_array(torch.empty(0, dtype=dtype), "x").dtype in DTYPES
    except InvalidArgumentError:
        return False


def _fsdp_modules(model) -> list[tuple[str, FSDPModule]]:
    """Every FSDPModule in `model`, the model (the FSDP root) first."""
    if not isinstance(model, FSDPModule):
        inner = isinstance(model, nn.Module) and any(
            isinstance(m, FSDPModule) for m in model.modules()
        )
        raise InvalidArgumentError(
            f"overlap() needs the model's root to be sharded too; {type(model).__name__} "
            f"holds fully_shard()-ed modules but is not one: each is then an FSDP root of "
            f"its own, FSDP2 does not prefetch across roots, and nothing would overlap. Call "
            f"fully_shard(model) on the root as well (it may hold no parameters of its own)"
            if inner
            else f"overlap() needs a model that fully_shard() has been applied to (an FSDPModule); "
            f"got {type(model).__name__}. Call fully_shard on each block, then on the root"
        )
    assert isinstance(model, nn.Module)  # fully_shard gave its class FSDPModule as a base
    return [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _shard_group(modules, backend: str) -> dist.ProcessGroup:
    """The one shard process group every module's parameters are sharded over (with HSDP, the
    replica group this rank is in); FSDP2 gathers and reduce-scatters over it."""
    group, ranks = None, None
    for name, module in modules:
        for pg in param_groups(module):
            if backend == "overcast" and reshards_to_a_subgroup(pg):
                raise InvalidArgumentError(
                    f"module {name!r} reshards to a smaller group after forward "
                    f"(reshard_after_forward=<int>), whose AllGathers run on a subgroup "
                    f"overcast has no communicator for; use reshard_after_forward=True or "
                    f"False, or backend='torch'"
                )
            these = dist.get_process_group_ranks(shard_process_group(pg))
            if ranks is None:
                group, ranks = shard_process_group(pg), these
            elif these != ranks:
                raise InvalidArgumentError(
                    f"module {name!r} is sharded over ranks {these}, others over {ranks}; "
                    f"overlap() needs every module on the same mesh"
                )
    if group is None:
        raise InvalidArgumentError("no module of the model has parameters to shard")
    return group


def _check_dtypes(modules) -> None:
    """The dtypes FSDP2 will hand the collectives: a parameter group whose dtypes differ is
    gathered as uint8 bytes."""
    for name, module in modules:
        for pg in param_groups(module):
            gathered, reduced = wire_dtypes(pg)
            wire = [("parameter", gathered.pop())] if len(gathered) == 1 else []
            wire += [("gradient reduction", d) for d in sorted(reduced, key=str)]
            for what, dtype in wire:
                if not _torch_dtype_ok(dtype):
                    raise InvalidArgumentError(
                        f"module {name!r} has {what} dtype {dtype}, which overcast cannot "
                        f"carry; supported: float32, float64, float16, bfloat16, int8, int32, "
                        f"int64, uint8"
                    )


def _check_choice(what: str, value, allowed) -> None:
    if value not in allowed:
        raise InvalidArgumentError(
            f"{what}={value!r} is not one of {', '.join(map(repr, allowed))}"
        )


def _set_prefetch(blocks: list[FSDPModule], root: FSDPModule, prefetch: int) -> None:
    """Forward: each module prefetches the next `prefetch` blocks (the root, the first ones);
    backward: each block prefetches the `prefetch` blocks before it, nearest first."""
    if blocks:
        root.set_modules_to_forward_prefetch(blocks[:prefetch])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch) : i][::-1])


def _install(
    modules,
    comm,
    allgather: str | None,
    reduce_scatter: str | None,
    times: CommTime,
    deferred: DeferredReduceScatters | None,
    unpaired_allgather: str | None = None,
    reduce_scatter_group: dist.ProcessGroup | None = None,
    poster: Poster | None = None,
    gathers: GatedAllGathers | None = None,
) -> dict:
    """Give each module timed collectives (overcast's through `comm`, or the process group's if
    None), their ReduceScatters left behind the backward pass in `deferred` where FSDP2 allows,
    their AllGathers with no ReduceScatter beside them on `unpaired_allgather` if given, the
    process group's ReduceScatters on `reduce_scatter_group` if given, except where the user
    gave the module one of its own; on a GPU, overcast's through `poster`, the AllGathers'
    failures raised through `gathers`. Returns what each had, to give back on close; if one
    fails, those already set get theirs back before the error is raised."""
    saved = {}
    try:
        for name, module in modules:
            pg = param_groups(module)
            if not pg:
                continue
            saved[module] = collectives(pg[0])
            own = any(own_reduce_scatter_group(g) is not None for g in pg)
            module.set_custom_all_gather(
                TimedAllGather(
                    comm, allgather, name, times, module, unpaired_allgather, poster, gathers
                )
            )
            module.set_custom_reduce_scatter(
                TimedReduceScatter(
                    comm,
                    reduce_scatter,
                    name,
                    times,
                    module,
                    deferred,
                    None if own else reduce_scatter_group,
                    poster,
                    gathers,
                )
            )
    except BaseException:
        _give_back(saved)
        raise
    return saved


def _give_back(saved: dict) -> None:
    """Give each module the collectives `_install` saved."""
    for module, (ag, rs) in saved.items():
        module.set_custom_all_gather(ag)
        module.set_custom_reduce_scatter(rs)


class Overlap:
    """What `overlap()` set up: the communicator (backend "overcast"), the training thread's
    communication time, and `close()` to undo it (also as a context manager)."""

    def __init__(
        self,
        model,
        comm,
        times: CommTime,
        made: GroupCommunicator | None = None,
        saved=None,
        reduce_scatter_group: dist.ProcessGroup | None = None,
    ):
        self.model, self.comm, self.times = model, comm, times
        self._made, self._saved = made, saved or {}  # what overlap() opened; what it replaced
        self._schedule: dict | None = None  # FSDP2's schedule before overlap() set its own
        # backend="torch": the process group its ReduceScatters run on, apart from the
        # AllGathers' (None where every module has a ReduceScatter group of its own)
        self.reduce_scatter_group = reduce_scatter_group
        # what each collective runs (backend="overcast"; None: the process group's own)
        self.algorithms: dict[str, str | None] = {}
        self._deferred = DeferredReduceScatters()
        self._gathers = GatedAllGathers()  # on a GPU, the AllGathers whose wait() did not block
        # posts overcast's collectives on a GPU (its thread starts with the first), shared
        # with any other overlap() on the same communicator
        self._poster = hold_poster(comm) if comm is not None else None
        self._closed = False

    def stats(self) -> dict:
        """Seconds the training thread spent posting and waiting on collectives, its CPU time
        in them, and the number of each, since overlap(); with `in_network_fallback` once an
        aggregator was lost (Communicator.in_network_fallback: the ReduceScatters then run on
        the ring, beside the multicast AllGathers)."""
        stats = self.times.as_dict()
        if self.comm is not None and self.comm.in_network_fallback:
            stats["in_network_fallback"] = self.comm.in_network_fallback
        return stats

    def profile(self, steps: int, seconds: float, path: str | None = None) -> dict:
        """The step of the `steps` steps that took `seconds` since overlap() or timed() (open
        it after a warm-up step): its mean, the communication it left exposed (the training
        thread posting and waiting), its compute (the rest), the collectives per step;
        written to `path` as JSON if given, for `overcast plan --timed`."""
        if not (isinstance(steps, int) and steps >= 1 and seconds > 0):
            raise InvalidArgumentError(
                f"profile() needs 1 or more steps and their seconds "
                f"above 0, not {steps!r} and {seconds!r}"
            )
        stats = self.stats()
        step, exposed = seconds / steps, (stats["post_seconds"] + stats["wait_seconds"]) / steps
        out = {
            "what": "overcast.fsdp step profile",
            "steps": steps,
            "step_seconds": step,
            "exposed_seconds": exposed,
            "compute_seconds": step - exposed,
            "allgathers_per_step": stats["allgathers"] / steps,
            "reduce_scatters_per_step": stats["reduce_scatters"] / steps,
        }
        if path is not None:
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
        return out

    def spans(self) -> list[tuple[str, str, float, float]]:
        """With trace=True, each collective as (kind "AG"/"RS", module, posted, waited) in
        time.perf_counter() seconds: when the training thread had it in flight, either backend."""
        return list(self.times.spans)

    def memory(self) -> dict:
        """Bytes overcast holds for this model besides FSDP2's own buffers (see
        Communicator.memory()); an empty dict for backend="torch", whose buffers are the
        process group's."""
        return self.comm.memory() if self.comm is not None else {}

    def timeline(self) -> dict | None:
        """The communicator's trace (if it was made with trace=True), spans named by module,
        and on a GPU the staging copies (`copies`: direction, start, end on the trace's clock)."""
        trace = self.comm.trace() if self.comm is not None else None
        if trace is not None:
            for span in trace["spans"]:
                span["label"] = self.times.labels.get(span["seq"])
            self.times.copies.read()  # waits for the copies still queued
            trace["copies"] = [
                {"direction": direction, "start": start, "end": end}
                for direction, start, end in self.times.copies.spans
            ]
        return trace

    def close(self) -> None:
        """Give the model back its own collectives, and close what overlap() opened. The
        ReduceScatters still in flight here are those of a backward pass that raised, whose
        caller has had the error already: their errors are not raised again (a `finally:
        handle.close()` must not replace it). On a GPU, an AllGather whose failure nothing has
        raised yet (one of the last forward pass of an evaluation, whose output held whatever
        its host buffer held) is raised here, once the model has its collectives back."""
        self._close(raise_unraised=True)

    def _close(self, raise_unraised: bool) -> None:
        if self._closed:
            return
        self._closed = True
        unraised: Exception | None = None
        try:
            with contextlib.suppress(Exception):  # overcast's, or torch's re-raising them
                self._deferred.drain()
            try:
                self._gathers.wait_all()  # raises a failure none raised before
            except Exception as err:
                unraised = err
        finally:
            self._restore()
        if unraised is not None and raise_unraised:
            raise unraised

    def _restore(self) -> None:
        """Give the modules their collectives and schedule back; release what overlap()
        opened. Each step runs even if another raised (an ExitStack runs its callbacks last
        first)."""
        with contextlib.ExitStack() as steps:
            if self._made is not None:
                steps.callback(self._made.close)
            if self._poster is not None:
                steps.callback(release_poster, self.comm)
            if self._schedule is not None:
                steps.callback(restore_schedule, self._schedule)
            steps.callback(_give_back, self._saved)

    def __enter__(self) -> Overlap:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(raise_unraised=exc_type is None)  # never in place of the error leaving


# backend="torch"'s ReduceScatter groups, by shard ranks, kept from one overlap() to the next
# and shared by the models open at once. torch 2.13 names a subgroup by its ranks and the number
# of groups alive, so a group made after one was destroyed takes the destroyed one's name, and
# its gloo rendezvous can read that group's keys in the store and hang (4 ranks reopening
# overlap() hung in each of 3 runs). They are destroyed at exit, while the interpreter is alive
# (docs/fsdp.md).
_reduce_scatter_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _live_reduce_scatter_groups() -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The kept groups, less any destroy_process_group() has since destroyed (the world's)."""
    alive = live_process_groups()
    for ranks, group in list(_reduce_scatter_groups.items()):
        if group not in alive:
            del _reduce_scatter_groups[ranks]
    return _reduce_scatter_groups


def _kept_reduce_scatter_group(shard_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """backend="torch"'s ReduceScatter group over the shard group's ranks, made as FSDP2's
    set_separate_reduce_scatter_group makes one (only the members meet), once, then kept."""
    ranks = tuple(dist.get_process_group_ranks(shard_group))
    group = _live_reduce_scatter_groups().get(ranks)
    if group is None:
        group = dist.new_group(
            list(ranks), use_local_synchronization=True, group_desc="overcast_reduce_scatter"
        )
        _reduce_scatter_groups[ranks] = group
    return group


@atexit.register
def _destroy_reduce_scatter_groups() -> None:
    """Free the kept groups while the interpreter is alive: a gloo group freed while it
    finalizes can abort the process (docs/fsdp.md)."""
    for group in _live_reduce_scatter_groups().values():
        with contextlib.suppress(Exception):  # one that fails must not keep the rest
            dist.destroy_process_group(group)
    _reduce_scatter_groups.clear()


def _job_store():
    """The store the default process group met through (torchrun's, or init_method's)."""
    return dist.distributed_c10d._get_default_store()


def _communicator(group: dist.ProcessGroup, reduce_scatter: str, trace: bool) -> GroupCommunicator:
    """An overcast Communicator over `group`'s ranks, meeting through the job's store (see
    overcast.job); an "overcast" group's companion, sharing its aggregator, if it is one. Never
    the group's own communicator: the training thread would post collectives on it beside the
    group's worker thread, in orders that may differ from rank to rank."""
    in_network = reduce_scatter == "innetwork"
    companion = getattr(group, "companion_communicator", None)
    if companion is not None:
        return companion(in_network=in_network, trace=trace)
    return group_communicator(
        _job_store(),
        group.rank(),
        group.size(),
        f"fsdp-{group.group_name}",
        in_network=in_network,
        trace=trace,
    )


@contextlib.contextmanager
def job_communicator(
    group: dist.ProcessGroup | None = None,
    *,
    reduce_scatter: str = "innetwork",
    trace: bool = False,
):
    """An overcast Communicator over a process group's ranks (default: every rank), meeting
    through the job's store, as overlap() makes one: with reduce_scatter="innetwork" and no
    OVERCAST_AGGREGATORS, rank 0 starts an aggregator beside itself. Use it in a `with` on every
    rank; leaving closes the communicator and, once every rank has closed, the aggregator."""
    # the default group raises, as the store would, where none is initialised
    made = _communicator(group or dist.distributed_c10d._get_default_group(), reduce_scatter, trace)
    try:
        yield made.comm
    finally:
        made.close()


def overlap(
    model,
    *,
    comm: Communicator | None = None,
    backend: str = "overcast",
    allgather: str = "multicast",
    reduce_scatter: str = "innetwork",
    unpaired_allgather: str | None = "ring",
    prefetch: int = 1,
    defer_reduce_scatter: bool = True,
    trace: bool = False,
) -> Overlap:
    """Configure every FSDPModule in `model` for AllGather overlapped with ReduceScatter in the
    backward pass, and return the handle (close it when done, or use it in a `with`).

    Call it after fully_shard (each block, then the root) and dist.init_process_group, on every
    rank. backend="overcast" routes FSDP2's collectives through `comm` (by default the mesh's
    own when its process group is the "overcast" torch.distributed backend, otherwise a new
    Communicator over the FSDP mesh's ranks, meeting through the job's store) with the given
    AllGather ("multicast" or "ring") and ReduceScatter ("innetwork" or "ring") algorithms; an
    "overcast" group's companion communicator sharing its aggregator, not the group's own. The
    program may post collectives of its own on `comm` from the thread that runs the model: on a
    GPU each waits until FSDP2's called before it are posted (docs/fsdp.md).
    `allgather` applies where a ReduceScatter runs beside the AllGather (a backward pass that
    reduces gradients); `unpaired_allgather` everywhere else (the forward pass, and the backward
    of a micro-step with gradient sync off), None for `allgather` there too: alone, a multicast
    AllGather takes as long as a ring (both receive (P-1)N), and on a few ranks the ring costs
    less per call (docs/fsdp.md). backend="torch" keeps the process group's collectives and
    gives ReduceScatter its own group (the algorithms apply to backend="overcast" only).
    `prefetch` is how many blocks ahead FSDP gathers (forward) and behind (backward); 0 turns
    explicit prefetching off. `defer_reduce_scatter` lets a ReduceScatter run behind the rest of
    the backward pass, which waits for it at its end, wherever FSDP2 does not read its result
    sooner (docs/fsdp.md). `trace` records each collective's span (spans()) and, for
    backend="overcast", the communicator's timeline (timeline()).
    """
    modules = _fsdp_modules(model)
    _check_choice("backend", backend, BACKENDS)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise InvalidArgumentError(
            f"prefetch must be a whole number of blocks >= 0, not {prefetch!r}"
        )
    if not isinstance(defer_reduce_scatter, bool):
        raise InvalidArgumentError(
            f"defer_reduce_scatter must be True or False, not {defer_reduce_scatter!r}"
        )
    group = _shard_group(modules, backend)
    blocks = [m for _, m in modules if m is not model]
    times = CommTime(keep_labels=trace)
    if backend == "torch":
        if comm is not None:
            raise InvalidArgumentError(
                "comm= is for backend='overcast'; backend='torch' uses "
                "the process group's own collectives"
            )
        # the process group's own collectives
        gather: str | None = None
        scatter: str | None = None
        unpaired: str | None = None
        lacking = any(
            own_reduce_scatter_group(pg) is None
            for _, module in modules
            for pg in param_groups(module)
        )
        handle = Overlap(
            model,
            None,
            times,
            reduce_scatter_group=_kept_reduce_scatter_group(group) if lacking else None,
        )
    else:
        _check_choice("allgather", allgather, ALGORITHMS["all_gather"])
        if unpaired_allgather is not None:
            _check_choice("unpaired_allgather", unpaired_allgather, ALGORITHMS["all_gather"])
        _check_choice("reduce_scatter", reduce_scatter, ALGORITHMS["reduce_scatter"])
        _check_dtypes(modules)
        if comm is not None and (comm.rank, comm.world_size) != (group.rank(), group.size()):
            raise InvalidArgumentError(
                f"the communicator is rank {comm.rank} of {comm.world_size}, but the FSDP mesh "
                f"makes this process rank {group.rank()} of {group.size()}; create it over "
                f"the mesh's ranks"
            )
        made = _communicator(group, reduce_scatter, trace) if comm is None else None
        handle = Overlap(model, made.comm if made else comm, times, made)
        comm = handle.comm
        gather, scatter, unpaired = allgather, reduce_scatter, unpaired_allgather
    try:
        if comm is not None and comm.multicast_undelivered and "multicast" in (gather, unpaired):
            # Proven when the communicator was made, alike on every rank: every collective takes
            # the ring, the ReduceScatter too (beside a ring AllGather, which loads both
            # directions, an in-network one adds to the send direction: it was slower than both
            # rings, docs/results.md).
            gather = scatter = "ring"
            unpaired = unpaired and "ring"
            warnings.warn(
                f"{comm.multicast_undelivered}; overlap() runs its AllGathers and "
                f"ReduceScatters on overcast's rings",
                MulticastNotDeliveredWarning,
                stacklevel=2,
            )
        handle.algorithms = {
            "allgather": gather,
            "unpaired_allgather": unpaired or gather,
            "reduce_scatter": scatter,
        }
        if comm is not None:  # raised here alone: every rank finds the same
            for collective, algorithm in [
                ("all_gather", gather),
                ("all_gather", unpaired),
                ("reduce_scatter", scatter),
            ]:
                reason = algorithm and comm.unavailable(collective, algorithm)
                if reason:
                    raise InvalidArgumentError(reason)
        handle._saved = _install(
            modules,
            comm,
            gather,
            scatter,
            times,
            handle._deferred if defer_reduce_scatter else None,
            unpaired,
            handle.reduce_scatter_group,
            handle._poster,
            handle._gathers,
        )
        handle._schedule = schedule(modules)
        set_unshard_async_op(model, True)
        _set_prefetch(blocks, model, prefetch)
    except BaseException:
        handle.close()
        raise
    return handle


def timed(model) -> Overlap:
    """FSDP2's own collectives and schedule, unchanged but timed: the baseline's figures in the
    same terms as overlap()'s (handle.stats())."""
    modules = _fsdp_modules(model)
    times = CommTime()
    return Overlap(model, None, times, saved=_install(modules, None, None, None, times, None))


__all__ = ["overlap", "timed", "Overlap", "BACKENDS"]
