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

On a GPU, FSDP2 calls them on its own streams and records an event right after each; through
overcast, the input is copied to pinned host memory on that stream, a `Poster` thread posts the
collective once the copy is done, and the output's copy back is queued on the same stream: for
an AllGather when the training thread waits for it, for a ReduceScatter at once, behind a stream
gate the collective opens when done (overcast/staging.py). FSDP2's event then follows the
result, and the training thread never waits for a ReduceScatter before the backward pass ends.
Without gates, the training thread waits for the copy in and, for a synchronous call, for the
result.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import torch
import torch.distributed as dist

from overcast.engine.engine import Work
from overcast.errors import InvalidArgumentError
from overcast.fsdp.timing import CommTime, Clock, InFlight
from overcast.staging import Staging, device_of, process_pool, stream_gates
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
    FSDP2 waits on it), its wait timed into `CommTime`."""

    def __init__(self, work, times: CommTime, in_flight: InFlight, staged: _Staged | None = None):
        super().__init__()
        self._work, self._times, self._in_flight = work, times, in_flight
        self._staged = staged

    def wait(self, timeout=None) -> bool:
        """As torch's: a timeout of None or zero waits for as long as it takes."""
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
                self._staged = None
        self._in_flight.end()  # both raise if the collective is not done
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()


_NAMES = {"AG": "AllGather", "RS": "ReduceScatter"}


class _Staged:
    """A collective's CUDA output and input through pinned host twins, staged on the stream
    current at the call (FSDP2's), the copies' GPU time kept in `times`."""

    def __init__(
        self, output: torch.Tensor, input: torch.Tensor, times: CommTime, host_waits: bool
    ):
        device = output.device
        self.times = times
        self.staging = Staging(device, torch.cuda.current_stream(device), process_pool())
        self.input = self.staging.twin(input, read=True, written=False)
        self.output = self.staging.twin(output, read=False, written=True)
        self.staging.sealed()
        if host_waits:
            self.staging.arrived()  # the host reads the input from here on

    @property
    def ready(self):
        """The event after the input's copy to the host."""
        return self.staging.copied_in

    def copy_back(self, release: bool = True) -> None:
        """Queue the output's copy to the GPU on the call's stream; make the current stream
        (the call's, or the one waiting on an asynchronous call) wait for it. Not `release`:
        queued behind a gate, the buffers are given back when the collective is done."""
        self.staging.copy_out(release=release)
        self.times.copies.add(self.staging)  # its events only, read as they complete
        self.staging.order_caller()


def stage_on_host(
    output: torch.Tensor, input: torch.Tensor, times: CommTime, what: str, host_waits: bool = True
) -> _Staged | None:
    """Host twins of a collective's CUDA tensors (the training thread's time counted as
    posting; with `host_waits`, it waits for the input's copy), or None for CPU tensors."""
    if device_of([output, input], what) is None:
        return None
    with Clock(times, "post"):
        return _Staged(output, input, times, host_waits)


class _Posted:
    """A collective handed to a `Poster`, as overcast's Work: done once posted and done."""

    def __init__(self, description: str):
        self.description = description
        self.work: Work | None = None
        self.error: BaseException | None = None
        self._posted = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait `timeout` seconds at most in all, for the posting and the collective."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._posted.wait(timeout):
            raise TimeoutError(f"{self.description} not posted after {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.work is not None  # posted without an error
        return self.work.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def is_completed(self) -> bool:
        if not self._posted.is_set():
            return False
        if self.error is not None:
            return True
        assert self.work is not None  # posted without an error
        return self.work.is_completed()


class Poster:
    """On a GPU, the thread that posts one model's collectives on its communicator, in the
    order FSDP2 called them (the same on every rank), each once its input's copy to the host is
    done: the training thread queues the copies and goes on, as it would with NCCL."""

    def __init__(self, times: CommTime):
        self.times = times
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, device: torch.device, ready, post, label: str, done=None) -> _Posted:
        """Post `post()` once the CUDA event `ready` has happened; then call `done()` once the
        collective is done, failed or not (also if posting raised)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, args=(device,), daemon=True, name="overcast-poster"
            )
            self._thread.start()
        handle = _Posted(label)
        self._calls.put((ready, post, label, done, handle))
        return handle

    def _run(self, device: torch.device) -> None:
        torch.cuda.set_device(device)
        while (call := self._calls.get()) is not None:
            ready, post, label, done, handle = call
            try:
                ready.synchronize()
                handle.work = post()
                if self.times.keep_labels:
                    self.times.labels[handle.work.seq] = label
            except BaseException as err:  # the waiter raises it
                handle.error = err
                if done is not None:
                    done()
            else:
                if done is not None:
                    handle.work.add_done_callback(done)
            finally:
                handle._posted.set()

    def close(self) -> None:
        """Post what was submitted, then stop."""
        if self._thread is not None:
            self._calls.put(None)
            self._thread.join()
            self._thread = None


class _Hook:
    """One module's collective for FSDP2: posted asynchronously and timed; waited on here if
    FSDP asked for a synchronous call. `comm` None means the process group's own."""

    def __init__(
        self, comm, algorithm: str | None, label: str, times: CommTime, poster: Poster | None = None
    ):
        self.comm, self.algorithm, self.label, self.times = comm, algorithm, label, times
        self.poster = poster

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
        self, kind: str, issue, algorithm: str | None, staging: _Staged | None = None
    ) -> TimedWork:
        name = f"overcast {_NAMES[kind]} {self.label} ({algorithm or 'process group'})"
        with Clock(self.times, "post"):
            in_flight = InFlight(self.times, kind, self.label, name)
            try:
                work = issue()
            except BaseException:
                in_flight.end()
                if staging is not None:
                    staging.staging.release()
                raise
            if kind == "AG":
                self.times.allgathers += 1
            else:
                self.times.reduce_scatters += 1
            if self.times.keep_labels and isinstance(work, Work):
                self.times.labels[work.seq] = f"{kind} {self.label}"
        return TimedWork(work, self.times, in_flight, staging)


class TimedAllGather(_Hook, AllGather):
    """FSDP2's parameter AllGather of one module, through overcast or through the process group
    as FSDP2's default does. Through overcast, `algorithm` in a backward pass that reduces
    gradients, where a ReduceScatter runs beside it; `unpaired` (if given) elsewhere: in the
    forward pass, and in the backward of a micro-step whose gradients are not synced (nothing
    beside it to fill the other direction of the link, so a multicast gains nothing there)."""

    def __init__(
        self,
        comm,
        algorithm: str | None,
        label: str,
        times: CommTime,
        module=None,
        unpaired: str | None = None,
        poster: Poster | None = None,
    ):
        super().__init__(comm, algorithm, label, times, poster)
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
        algorithm = None if self.comm is None else self._algorithm()
        staging = None
        if self.comm is None:
            issue = lambda: all_gather_single(  # noqa: E731
                output_tensor,
                input_tensor,
                group=group,
                async_op=True,
            )
        else:
            poster = self._poster_for(output_tensor)
            staging = stage_on_host(
                output_tensor, input_tensor, self.times, "AllGather", host_waits=poster is None
            )
            out, inp = (staging.output, staging.input) if staging else (output_tensor, input_tensor)
            issue = lambda: self.comm.all_gather(  # noqa: E731
                out,
                inp,
                async_op=True,
                algorithm=algorithm,
            )
            if poster is not None:
                assert staging is not None  # the poster's tensors are on a GPU
                post = issue
                issue = lambda: poster.submit(  # noqa: E731
                    output_tensor.device, staging.ready, post, f"AG {self.label}"
                )
        work = self._post("AG", issue, algorithm, staging)
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
        """Wait for every one still in flight (a backward pass that raised leaves them)."""
        self.make_room(1)


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
    ):
        super().__init__(comm, algorithm, label, times, poster)
        self.module, self.deferred, self.group = module, deferred, group

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
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
        staging = None
        if poster is not None:
            issue = self._gated(poster, output_tensor, input_tensor, op)
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
        work = self._post("RS", issue, self.algorithm, staging)
        if async_op:
            return work
        if not (deferred is not None and deferred.add(work)):
            work.wait()
        return None

    def _gated(self, poster: Poster, output_tensor, input_tensor, op):
        """Through the poster on a GPU: the input's copy to the host, a gate, and the output's
        copy back are queued on FSDP2's stream, so its event after this call follows the
        result; the gate opens when the collective is done. Returns what posts it: the
        training thread goes on."""
        name = reduce_op(premultiplied(op, input_tensor, None))
        staging = stage_on_host(
            output_tensor, input_tensor, self.times, "ReduceScatter", host_waits=False
        )
        gates = stream_gates()
        assert staging is not None and gates is not None  # the poster's tensors are on a GPU
        try:
            open_gate = gates.close_on(staging.staging.stream)
        except RuntimeError:
            staging.staging.release()
            raise
        staging.copy_back(release=False)

        def done():
            open_gate()
            staging.staging.release()

        def post():
            return self.comm.reduce_scatter(
                staging.output, staging.input, op=name, async_op=True, algorithm=self.algorithm
            )

        return lambda: poster.submit(
            output_tensor.device, staging.ready, post, f"RS {self.label}", done
        )
