"""FSDP2's custom-collective objects, backed by an overcast Communicator.

FSDP2 calls `AllGather.__call__(output_tensor, input_tensor, group, async_op)` and
`ReduceScatter.__call__(output_tensor, input_tensor, group, op, async_op)` on flat buffers from
their `allocate`. It waits on an AllGather's result only if it is a `torch.distributed` Work, so
an asynchronous AllGather returns `TimedWork`, a Work subclass whose `wait` waits on
overcast's handle. On CPU FSDP2 calls the ReduceScatter synchronously; where it will not read the
result before the backward pass ends, the ReduceScatter returns once posted and the backward
pass waits for it at its end, so that the next blocks compute and gather beside it, as they do on
a GPU (docs/fsdp.md). The same objects can call the process group's collectives instead, so that
FSDP2's own path is timed the same way.

On a GPU, FSDP2 calls them on its streams and records an event right after each; through
overcast, the input is copied to pinned host memory, a `Poster` thread (one per communicator)
posts the collective once the copy is done, and the output's copy back is queued at once behind
a stream gate the collective opens when done, failed or not (overcast/staging.py). A
ReduceScatter's copies go on FSDP2's stream, so its event follows the result. An AllGather's go
on the poster's stream (unsharding asynchronously, FSDP2 calls it on the compute stream, which a
gate would hold back), and its wait() makes the waiting stream follow them without blocking the
host; its failure is raised by the model's next collective call that finds it, or at the latest
when the backward pass ends (`GatedAllGathers`). The training thread waits for neither before
the backward pass ends. Without gates, it waits for the copy in and, for an AllGather's wait()
or a synchronous call, for the result.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading

import torch
import torch.distributed as dist

from overcast.engine.engine import Work
from overcast.errors import InvalidArgumentError
from overcast.fsdp.pieces import (
    MOST_PIECES,
    Pieces,
    PostedPieces,
    cut,
    each_then_first_failure,
    piece_bytes,
)
from overcast.fsdp.timing import CommTime, Clock, InFlight
from overcast.native import MAX_REDUCTIONS
from overcast.staging import Staging, StreamGates, device_of, process_pool, stream_gates
from overcast.torch_api import (
    AllGather,
    ReduceScatter,
    RedOpType,
    all_gather_single,
    is_bw,
    output_unread,
    param_groups,
    premul_factor,
    reduce_scatter_input_buffers,
    reduce_scatter_single,
    reduces_gradients,
)


class TimedWork(dist.Work):
    """A collective in flight, overcast's or torch's, seen as a torch.distributed Work (so that
    FSDP2 waits on it), its wait timed into `CommTime`. Through the poster (`gated`), its
    output's copy back is queued behind a stream gate already, and wait() makes the waiting
    stream wait for it; for an AllGather (not `host_waits`) that is all it does: the host
    never blocks, and a failure not found yet is raised later, by `GatedAllGathers`."""

    def __init__(
        self,
        work,
        times: CommTime,
        in_flight: InFlight,
        name: str,
        staged: _Staged | None = None,
        gated: _Gated | Pieces | None = None,
        host_waits: bool = True,
    ):
        super().__init__()
        self._work, self._times, self._in_flight = work, times, in_flight
        self.name = name
        self._staged, self._gated, self._host_waits = staged, gated, host_waits
        self._failure_raised = False

    def wait(self, timeout=None) -> bool:
        """As torch's: a timeout of None or zero waits for as long as it takes."""
        if not self._host_waits:
            assert self._gated is not None  # only a gated collective leaves the host free
            with Clock(self._times, "wait"):
                self._gated.order_caller()
                if self._work.is_completed():
                    self._raise_failure(again=True)
            self._in_flight.end()  # the stream, not the training thread, waits for the rest
            return True
        if timeout is not None and not timeout.total_seconds():
            timeout = None
        with Clock(self._times, "wait"):
            try:
                if isinstance(self._work, dist.Work):
                    done = self._work.wait() if timeout is None else self._work.wait(timeout)
                else:
                    done = self._work.wait(None if timeout is None else timeout.total_seconds())
            except BaseException:
                if self._staged is not None and self._work.is_completed():
                    self._staged.staging.release()
                raise
            if self._staged is not None:
                self._staged.copy_back()
                self._staged.staging.order_caller()
                self._staged = None
            if self._gated is not None:
                self._gated.order_caller()
        self._in_flight.end()  # both raise if the collective is not done
        return done

    def settle(self) -> None:
        """Block until the collective is done (timed as a wait); raise its failure, naming
        it, unless raised before."""
        try:
            with Clock(self._times, "wait"):
                self._raise_failure(again=False)
        finally:
            self._in_flight.end()

    def _raise_failure(self, again: bool) -> None:
        """Wait for the collective; raise its failure, naming it (`again`: even if raised
        before)."""
        try:
            self._work.wait()
        except Exception as err:
            if self._failure_raised and not again:
                return
            self._failure_raised = True
            note = f"(in {self.name})"
            if note not in getattr(err, "__notes__", ()):
                err.add_note(note)
            raise

    def is_completed(self) -> bool:
        return self._work.is_completed()


_NAMES = {"AG": "AllGather", "RS": "ReduceScatter"}


class _Staged:
    """A collective's CUDA output and input through pinned host twins, staged on `stream`
    (default: the one current at the call, FSDP2's) after what the call's stream queued, the
    copies' GPU time kept in `times`."""

    def __init__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        times: CommTime,
        host_waits: bool,
        stream: torch.cuda.Stream | None = None,
    ):
        device = output.device
        self.times = times
        stream = torch.cuda.current_stream(device) if stream is None else stream
        self.staging = Staging(device, stream, process_pool())
        try:
            self.input = self.staging.twin(input, read=True, written=False)
            self.output = self.staging.twin(output, read=False, written=True)
            self.staging.sealed()
            if host_waits:
                self.staging.arrived()  # the host reads the input from here on
        except BaseException:
            self.staging.release()
            raise

    def input_on_host(self) -> None:
        """Block until the input's copy to the host is done. On the poster's thread, whose
        device it makes the call's first (a thread's first CUDA call would otherwise make a
        context on device 0)."""
        torch.cuda.set_device(self.staging.device)
        self.staging.arrived()

    def copy_back(self, release: bool = True) -> None:
        """Queue the output's copy to the GPU on the staging's stream (a waiter's stream waits
        for it: staging.order_caller). Not `release`: queued behind a gate, the buffers are
        given back when the collective is done."""
        self.staging.copy_out(release=release)
        self.times.copies.add(self.staging)  # its events only, read as they complete


def stage_on_host(
    output: torch.Tensor,
    input: torch.Tensor,
    times: CommTime,
    what: str,
    host_waits: bool = True,
    stream: torch.cuda.Stream | None = None,
) -> _Staged | None:
    """Host twins of a collective's CUDA tensors (the training thread's time counted as
    posting; with `host_waits`, it waits for the input's copy), or None for CPU tensors."""
    if device_of([output, input], what) is None:
        return None
    with Clock(times, "post"):
        return _Staged(output, input, times, host_waits, stream)


class _Gated:
    """A collective's output copied back behind a stream gate on its staging's stream: the
    stream stops there until `open()`, called once the collective is done, failed or not (the
    output is undefined then, but the stream goes on), or by the call when posting it failed.
    The gate opens and the buffers go back once, whichever path comes first."""

    def __init__(self, staged: _Staged, gates: StreamGates):
        self.staged = staged
        self._open_gate = None
        self._opened = False
        self._lock = threading.Lock()
        try:
            self._open_gate = gates.close_on(staged.staging.stream)  # open if it raises
            staged.copy_back(release=False)
        except BaseException:
            self.open()
            raise

    def order_caller(self) -> None:
        """Make the current stream wait for the output's copy back."""
        self.staged.staging.order_caller()

    def open(self) -> None:
        with self._lock:
            if self._opened:
                return
            self._opened = True
        try:
            if self._open_gate is not None:
                self._open_gate()
        finally:
            self.staged.staging.release()


class _Posted:
    """A collective handed to a `Poster`, as overcast's Work: complete once posted, done and
    its `done` run, failed or not (so a stream gate that `done` opens is open by then)."""

    def __init__(self, description: str):
        self.description = description
        self.work: Work | None = None
        self.error: BaseException | None = None  # from posting it, or from `done`
        self._complete = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait `timeout` seconds at most in all, for the posting and the collective; raise
        the collective's error, or else posting's or `done`'s."""
        if not self._complete.wait(timeout):
            raise TimeoutError(f"{self.description} not complete after {timeout} s")
        if self.work is not None:
            self.work.wait(0)
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self._complete.is_set()

    def _settle(self, done) -> None:
        """Run `done` (what it raises is this call's error, unless it has one), then complete:
        on the poster's thread or the engine's, neither of which it may end."""
        try:
            if done is not None:
                done()
        except BaseException as err:
            if self.error is None:
                self.error = err
        finally:
            self._complete.set()


class Poster:
    """On a GPU, the thread that posts the collectives FSDP2 calls on one communicator, in the
    order it called them (the same on every rank), each once its input's copy to the host is
    done: the training thread queues the copies and goes on, as it would with NCCL. Whatever a
    call raises fails that call alone: the thread goes on to the next. One per communicator
    (`hold_poster`), so that the communicator has one order of posting."""

    GATHER_STREAMS = 4  # more AllGathers than FSDP2 keeps in flight at a prefetch worth having

    def __init__(self, refuse):
        self._refuse = refuse  # the communicator's: a call this rank will not post, numbered
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._counts = threading.Condition()
        self._submitted = self._posted = 0
        self._gather_streams: dict[torch.device, list[torch.cuda.Stream]] = {}
        self._gathers = 0

    def gather_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream an AllGather is staged on, gate and all: the next of its streams, so
        that a gate holds back no other gather's copy in. Not the call's: unsharding
        asynchronously, FSDP2 calls it on the compute stream, which a gate would hold back
        until the gather is done; its wait() makes the waiting stream follow the copy back."""
        streams = self._gather_streams.get(device)
        if streams is None:
            streams = self._gather_streams[device] = [
                torch.cuda.Stream(device) for _ in range(self.GATHER_STREAMS)
            ]
        self._gathers += 1
        return streams[self._gathers % len(streams)]

    def submit(self, ready, post, label: str, times: CommTime, done=None) -> _Posted:
        """Post `post()` once `ready()` returns (the input is on the host); then call `done()`
        once the collective is done, failed or not (also if `ready` or posting raised). With
        `times.keep_labels`, the collective is named `label` there."""
        handle = _Posted(label)
        with self._counts:  # two threads' first calls start one thread
            if self._thread is None:
                thread = threading.Thread(target=self._run, daemon=True, name="overcast-poster")
                thread.start()  # where it cannot, the call raises with nothing queued
                self._thread = thread
            self._submitted += 1
            self._calls.put((ready, post, label, times, done, handle))
        return handle

    def wait_posted(self) -> None:
        """Return once every call submitted so far is posted (at once on the poster's thread,
        which posts them in order)."""
        if threading.current_thread() is self._thread:
            return
        with self._counts:
            submitted = self._submitted
            self._counts.wait_for(lambda: self._posted >= submitted)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            ready, post, label, times, done, handle = call
            try:
                try:
                    ready()
                except BaseException as err:  # the peers make the call: tell them (numbered)
                    with contextlib.suppress(Exception):
                        self._refuse(err)
                    raise
                work = post()
            except BaseException as err:  # the waiter raises it
                handle.error = err
                handle._settle(done)
            else:
                handle.work = work
                work.add_done_callback(functools.partial(handle._settle, done))
                if times.keep_labels:
                    times.labels[work.seq] = label
            finally:
                with self._counts:
                    self._posted += 1
                    self._counts.notify_all()

    def close(self) -> None:
        """Post what was submitted, then stop."""
        if self._thread is not None:
            self._calls.put(None)
            self._thread.join()
            self._thread = None


# Each communicator's poster and how many overlap()s hold it, by id(communicator). A
# collective the program calls on the communicator itself waits until the poster has posted
# what it was handed before (Communicator.number_after), so that it takes its number after
# those on every rank, as on CPU, where the thread that calls each collective posts it; two
# posters, or a caller beside one, would number them in whatever order each rank's threads
# ran (docs/fsdp.md).
_posters: dict[int, tuple[Poster, int]] = {}
_posters_lock = threading.Lock()


def hold_poster(comm) -> Poster:
    """`comm`'s poster, shared by every overlap() on it; give it back with `release_poster`."""
    with _posters_lock:
        poster, holders = _posters.get(id(comm), (None, 0))
        if poster is None:
            poster = Poster(comm.refuse)
            comm.number_after(poster.wait_posted)
        _posters[id(comm)] = (poster, holders + 1)
        return poster


def release_poster(comm) -> None:
    """One holder of `comm`'s poster less; the last posts what it was handed and stops it,
    and `comm` numbers its collectives at once again."""
    with _posters_lock:
        poster, holders = _posters.pop(id(comm))
        if holders > 1:
            _posters[id(comm)] = (poster, holders - 1)
            return
        poster.close()
        comm.number_after(None)


class _Hook:
    """One module's collective for FSDP2: posted asynchronously and timed; waited on here if
    FSDP asked for a synchronous call. `comm` None means the process group's own."""

    def __init__(
        self,
        comm,
        algorithm: str | None,
        label: str,
        times: CommTime,
        poster: Poster | None = None,
        gathers: GatedAllGathers | None = None,
    ):
        self.comm, self.algorithm, self.label, self.times = comm, algorithm, label, times
        self.poster, self.gathers = poster, gathers

    def _check_gathers(self) -> None:
        """Raise the failure of a gated AllGather called before, if one is found now."""
        if self.gathers is not None:
            self.gathers.check()

    def _poster_for(self, tensor: torch.Tensor) -> Poster | None:
        """The poster, if this call goes through it: overcast's collectives on a GPU whose
        driver offers stream gates (every call of a model alike, so their order holds)."""
        if self.poster is None or tensor.device.type != "cuda" or stream_gates() is None:
            return None
        return self.poster

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if torch.device(device).type not in ("cpu", "cuda"):
            raise InvalidArgumentError(
                f"overcast moves CPU and CUDA tensors; FSDP asked for a buffer on {device}"
            )
        return torch.empty(*size, dtype=dtype, device=device)

    def _post(
        self,
        kind: str,
        issue,
        algorithm: str | None,
        staging: _Staged | None = None,
        gated: _Gated | Pieces | None = None,
        host_waits: bool = True,
    ) -> TimedWork:
        name = f"overcast {_NAMES[kind]} {self.label} ({algorithm or 'process group'})"
        with Clock(self.times, "post"), contextlib.ExitStack() as failed:
            # whatever raises until it is posted, the gate opens and the buffers go back
            if gated is not None:
                failed.callback(gated.open)
            elif staging is not None:
                failed.callback(staging.staging.release)
            in_flight = InFlight(self.times, kind, self.label, name)
            failed.callback(in_flight.end)
            work = issue()
            failed.pop_all()
            if kind == "AG":
                self.times.allgathers += 1
            else:
                self.times.reduce_scatters += 1
            if self.times.keep_labels and isinstance(work, Work):
                self.times.labels[work.seq] = f"{kind} {self.label}"
        return TimedWork(work, self.times, in_flight, name, staging, gated, host_waits)

    def _through(
        self,
        poster: Poster,
        kind: str,
        output: torch.Tensor,
        input: torch.Tensor,
        collective,
        stream: torch.cuda.Stream | None = None,
        most: int = MOST_PIECES,
    ):
        """Through the poster, in pieces where the call is large (at most `most`;
        fsdp/pieces.py), queued on `stream` (default: the call's): every piece's input copied
        to the host now, then, as each piece is handed to the poster, its gate and its output's
        copy back (no piece's copy in waits behind an earlier piece's gate). Returns what hands
        the poster each piece's `collective(host output, host input)`, posted once that piece's
        input is on the host, and the `Pieces`, each gate opened once its piece is done. A
        piece this rank fails to hand on is refused to the peers, which post it."""
        stream_gate = stream_gates()
        assert stream_gate is not None  # the poster's calls are gated GPU ones
        staged_pieces: list[_Staged] = []
        cuts = cut(kind, output, input, self.comm.world_size, piece_bytes(), most)
        count = len(cuts)

        def refuse_from(first: int, error: BaseException) -> None:
            for _ in range(first, count):  # numbered after those handed on, as on every rank
                with contextlib.suppress(Exception):  # a communicator closed meanwhile
                    self.comm.refuse(error)

        try:
            for out, inp in cuts:
                staged = stage_on_host(out, inp, self.times, _NAMES[kind], False, stream)
                assert staged is not None  # on a GPU
                staged_pieces.append(staged)
        except BaseException as err:
            for staged in staged_pieces:
                staged.staging.release()
            refuse_from(0, err)
            raise
        pieces = Pieces(staged_pieces, lambda staged: _Gated(staged, stream_gate))

        def hand(gated: _Gated, index: int) -> _Posted:
            staged = gated.staged
            return poster.submit(
                staged.input_on_host,
                lambda: collective(staged.output, staged.input),
                f"{kind} {self.label}" + (f" [{index + 1}/{count}]" if count > 1 else ""),
                self.times,
                gated.open,
            )

        def issue() -> _Posted | PostedPieces:
            try:
                handles = pieces.hand(hand)
            except BaseException as err:
                refuse_from(pieces.posted, err)
                raise
            return handles[0] if count == 1 else PostedPieces(handles)

        return issue, pieces


class TimedAllGather(_Hook, AllGather):
    """FSDP2's parameter AllGather of one module, through overcast or through the process group
    as FSDP2's default does. Through overcast, `algorithm` in a backward pass that reduces
    gradients, where a ReduceScatter runs beside it; `unpaired` (if given) elsewhere: in the
    forward pass, and in the backward of a micro-step whose gradients are not synced (nothing
    beside it to fill the other direction of the link, so a multicast gains nothing there).
    Through the poster, its wait() does not block, and `gathers` raises its failure."""

    def __init__(
        self,
        comm,
        algorithm: str | None,
        label: str,
        times: CommTime,
        module=None,
        unpaired: str | None = None,
        poster: Poster | None = None,
        gathers: GatedAllGathers | None = None,
    ):
        super().__init__(comm, algorithm, label, times, poster, gathers)
        self.module, self.unpaired = module, unpaired

    def _algorithm(self) -> str | None:
        if self.unpaired is None or self.unpaired == self.algorithm:
            return self.algorithm
        paired = is_bw() and reduces_gradients(param_groups(self.module))
        return self.algorithm if paired else self.unpaired

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ):
        self._check_gathers()
        algorithm = None if self.comm is None else self._algorithm()
        poster = None if self.comm is None else self._poster_for(output_tensor)
        if self.comm is None:
            work = self._post(
                "AG",
                lambda: all_gather_single(output_tensor, input_tensor, group=group, async_op=True),
                None,
            )
        elif poster is not None:
            issue, gated = self._through(
                poster,
                "AG",
                output_tensor,
                input_tensor,
                lambda out, inp: self.comm.all_gather(out, inp, async_op=True, algorithm=algorithm),
                poster.gather_stream(output_tensor.device),
            )
            work = self._post("AG", issue, algorithm, gated=gated, host_waits=False)
            if self.gathers is not None:
                self.gathers.add(work)
        else:
            staging = stage_on_host(output_tensor, input_tensor, self.times, "AllGather")
            out, inp = (staging.output, staging.input) if staging else (output_tensor, input_tensor)
            work = self._post(
                "AG",
                lambda: self.comm.all_gather(out, inp, async_op=True, algorithm=algorithm),
                algorithm,
                staging,
            )
        if async_op:
            return work
        work.wait()
        return None


def premultiplied(op, tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """The op to reduce `tensor` with. ReduceOp.PREMUL_SUM(factor), which FSDP2 uses for a
    gradient divide factor, becomes SUM after multiplying `tensor` by the factor here, as
    NCCL's PreMulSum does, wherever the reduction has no PREMUL_SUM of its own: overcast's
    (group None) and gloo's."""
    factor = premul_factor(op)
    if factor is None or (group is not None and dist.get_backend(group) == "nccl"):
        return op
    if not isinstance(factor, float):
        raise InvalidArgumentError(
            "ReduceOp.PREMUL_SUM with a tensor factor is not supported; "
            "give set_gradient_divide_factor a number"
        )
    tensor.mul_(factor)
    return dist.ReduceOp.SUM


def reduce_op(op) -> str:
    """FSDP2's ReduceOp (after `premultiplied`) as overcast's op name, or a named
    InvalidArgumentError for an op overcast does not reduce with."""
    kind = op if isinstance(op, RedOpType) else getattr(op, "op", None)
    if kind == dist.ReduceOp.SUM:
        return "sum"
    if kind == dist.ReduceOp.AVG:
        return "avg"
    name = getattr(kind, "name", str(op))
    raise InvalidArgumentError(
        f"overcast cannot reduce gradients with ReduceOp.{name}; it "
        f"reduces with SUM, AVG and PREMUL_SUM (what FSDP2 uses)"
    )


class DeferredReduceScatters:
    """The ReduceScatters of one overlap() left running behind the backward pass, oldest
    first. No more stay in flight than FSDP2 keeps inputs of (`set_reduce_scatter_max_input_
    buffers` where torch has it, 1 by default), as on a GPU, so that deferring does not keep
    every block's unsharded gradients alive at once."""

    def __init__(self):
        self._works: collections.deque[TimedWork] = collections.deque()

    def make_room(self, limit: int) -> None:
        """Wait for the oldest until fewer than `limit` are in flight."""
        while len(self._works) >= limit:
            self._works.popleft().wait()

    def add(self, work: TimedWork) -> bool:
        """Have the backward pass running now wait for `work` (and those before it) once its
        graph is done: an autograd final callback, run before backward() returns. False
        outside a backward pass. The collective holds its buffers until it completes, so
        FSDP2 may drop its own references meanwhile."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._wait_through(work)
            )
        except RuntimeError:
            return False
        self._works.append(work)
        return True

    def _wait_through(self, work: TimedWork) -> None:
        while work in self._works:
            self._works.popleft().wait()

    def drain(self) -> None:
        """Wait for every one still in flight (a backward pass that raised leaves them), the
        later ones too when one failed; then raise the first failure."""
        works, self._works = self._works, collections.deque()
        each_then_first_failure(work.wait for work in works)


class GatedAllGathers:
    """The AllGathers of one overlap() that went through the poster, until the training thread
    has seen each done. Their wait() does not block, so their failures are raised here, each
    naming its collective: by the next collective call of the model that finds one failed,
    and at the latest as the backward pass ends (an autograd final callback, queued at its
    first call, waits for every one still in flight, the forward pass's too). One that fails
    in a forward pass no backward pass follows (evaluation) is raised by the next call."""

    def __init__(self):
        self._works: list[TimedWork] = []
        self._backward = -1  # autograd's id of the backward pass whose end waits for them

    def add(self, work: TimedWork) -> None:
        self._works.append(work)
        self._wait_at_backward_end()

    def check(self) -> None:
        """Forget those done, raising the first failure among them."""
        self._wait_at_backward_end()
        done: list[TimedWork] = []
        pending: list[TimedWork] = []
        for work in self._works:  # each asked once: one may complete meanwhile
            (done if work.is_completed() else pending).append(work)
        self._works = pending
        self._settle(done)

    def wait_all(self) -> None:
        """Wait for every one still in flight, raising the first failure."""
        works, self._works = self._works, []
        self._settle(works)

    def _wait_at_backward_end(self) -> None:
        backward = torch._C._current_graph_task_id()  # -1 outside a backward pass
        if self._works and backward not in (-1, self._backward):
            torch.autograd.Variable._execution_engine.queue_callback(self.wait_all)
            self._backward = backward

    @staticmethod
    def _settle(works: list[TimedWork]) -> None:
        each_then_first_failure(work.settle for work in works)  # every one's range ends


class TimedReduceScatter(_Hook, ReduceScatter):
    """FSDP2's gradient ReduceScatter of one module, through overcast with `algorithm` or
    through the process group as FSDP2's default does.

    FSDP2 calls it synchronously on CPU. Given its `module` and `deferred`, it returns at once
    when FSDP2 will not read the output before the backward pass ends, and the backward pass
    waits for it at its end: the next blocks' backward computes meanwhile and their AllGathers
    are prefetched beside it, as FSDP2 does on a GPU, where the ReduceScatter runs on a stream
    of its own. Without them it blocks, as FSDP2's own does. Through the process group,
    `group` (if given) is the process group it runs on instead of the one FSDP2 passes: a
    ReduceScatter group of its own, apart from the AllGathers'."""

    def __init__(
        self,
        comm,
        algorithm: str | None,
        label: str,
        times: CommTime,
        module=None,
        deferred: DeferredReduceScatters | None = None,
        group: dist.ProcessGroup | None = None,
        poster: Poster | None = None,
        gathers: GatedAllGathers | None = None,
    ):
        super().__init__(comm, algorithm, label, times, poster, gathers)
        self.module, self.deferred, self.group = module, deferred, group

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
        self._check_gathers()
        groups = param_groups(self.module) if self.deferred is not None else None
        poster = self._poster_for(output_tensor) if self.comm is not None else None
        # on a GPU behind a gate, FSDP2 reads the output on its stream only once it is back
        deferred = (
            self.deferred
            if not async_op
            and groups is not None
            and (
                poster is not None
                or (output_tensor.device.type == "cpu" and output_unread(groups, output_tensor, op))
            )
            else None
        )
        if deferred is not None:
            assert groups is not None  # read where a deferral is possible
            deferred.make_room(reduce_scatter_input_buffers(groups[0]))
        staging = gated = None
        if poster is not None:
            name = reduce_op(premultiplied(op, input_tensor, None))
            issue, gated = self._through(
                poster,
                "RS",
                output_tensor,
                input_tensor,
                lambda out, inp: self.comm.reduce_scatter(
                    out, inp, op=name, async_op=True, algorithm=self.algorithm
                ),
                # no more pieces than reductions an aggregator keeps in flight per communicator
                most=MAX_REDUCTIONS if self.algorithm == "innetwork" else MOST_PIECES,
            )
        elif self.comm is None:
            group = self.group or group
            op = premultiplied(op, input_tensor, group)
            issue = lambda: reduce_scatter_single(  # noqa: E731
                output_tensor,
                input_tensor,
                group=group,
                op=op,
                async_op=True,
            )
        else:
            name = reduce_op(premultiplied(op, input_tensor, None))
            staging = stage_on_host(output_tensor, input_tensor, self.times, "ReduceScatter")
            out, inp = (staging.output, staging.input) if staging else (output_tensor, input_tensor)
            issue = lambda: self.comm.reduce_scatter(  # noqa: E731
                out,
                inp,
                op=name,
                async_op=True,
                algorithm=self.algorithm,
            )
        work = self._post("RS", issue, self.algorithm, staging, gated)
        if async_op:
            return work
        if not (deferred is not None and deferred.add(work)):
            work.wait()
        return None
