"""How an "overcast" process group's calls run: in the order they are made, one at a time, on the
group's worker thread; their futures completed on another thread, the group's completer, in the
same order. Both follow gloo's contract (a call takes its place in the order when it is made,
on the calling thread) and keep it where gloo's threads could not:

- A call made from a future's callback is queued when it is made, like any other: a callback
  attached to a call already complete runs at once on the attaching thread, one attached before
  runs on the completer when the call completes, and either way the new call follows every
  call made before the callback ran. So the order is the one the program made, on every rank.
- Callbacks never run on the worker, so a callback may wait for any later call. A callback that
  waits on the completer (Work.wait(), or its future's wait() or value()) for a call whose future
  is not complete yet completes the futures before it itself, in order: a callback never waits
  behind itself, and callbacks run in the same order on every rank. (A future made by then() on
  a later call's future is torch's own: waiting on one of those inside a callback would wait
  behind itself; wait on the call's own future, as PowerSGD's hook does.)
- An error anywhere in a call's bookkeeping (a CUDA error in its staging, a future the caller
  completed itself) fails that call alone; the threads go on. One raised before the call's
  collectives are made (bad arguments, a failed staging copy) is also told to the group's other
  ranks (`refuse`, Communicator.refuse), whose own call then raises it, naming this rank, rather
  than wait for this rank's part.

Point-to-point calls (send, recv) are no collectives: the other ranks do not make them too. They
go to a third thread, the poster, which posts them to the communicator in the order they are
made (a CUDA tensor's once its staging copy is done), and each completes when its transfer ends,
on the completer, out of turn with the collectives. So a recv that waits for a send its peer
makes after some collective holds none of the group's collectives, and a collective made after
a send does not wait for the send's receiver, as on gloo, whose transfers bypass its queue.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time

import torch
import torch.distributed as dist

from overcast.errors import CollectiveTimeoutError, CommunicatorClosedError
from overcast.staging import Staging


def _seconds(timeout) -> float | None:
    """A Work.wait timeout (a timedelta, or seconds) in seconds; None for none (torch's 0)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return seconds if seconds > 0 else None


def _tensors(result) -> list[torch.Tensor]:
    """A call's outputs (a tensor list, or a list of lists) as one flat list."""
    if result is None:
        return []
    return [t for item in result for t in (item if isinstance(item, (list, tuple)) else [item])]


class _Future(torch.futures.Future):
    """A call's future: torch's, but whose wait() and value() on the group's completer thread
    complete the calls before it first (see the module's doc)."""

    def __init__(self, work: "Work", devices):
        super().__init__(devices=devices)
        self._work = work

    def wait(self):
        self._work._wait_marked(None)
        return super().wait()

    def value(self):
        self._work._wait_marked(None)
        return super().value()


class Work(dist._Work):
    """A call's handle, as gloo's: wait() raises what the call raised (a Work made by torch from
    a Future alone returns True whatever happened), and honours its timeout; the future's value
    is the call's outputs, so DDP's comm hooks chain on it."""

    def __init__(self, what: str, result, staging: Staging | None, calls: "Calls"):
        super().__init__()
        self._what, self._result, self._staging, self._calls = what, result, staging, calls
        self._error: BaseException | None = None
        self._source: int | None = None  # a recv's sender
        self._ran = False  # the worker is through with it: its outputs and error are final
        self._marked = threading.Event()  # its future is complete
        # on a GPU, the future records an event on the side stream when it completes, and a
        # value() or wait() of it makes the then-current stream wait for it
        self._fut = _Future(self, [staging.device] if staging else None)
        # the future's first callback, before any of the caller's: the call is complete the
        # moment its future is, not once every callback has run (one may wait for this Work)
        self._fut.add_done_callback(lambda _: self._ran and self._marked.set())

    def _complete(self) -> None:
        """Complete the future (its callbacks run here, on the completer)."""
        try:
            with (torch.cuda.stream(self._staging.stream) if self._staging else
                  contextlib.nullcontext()):
                if self._error is None:
                    self._fut.set_result(self._result)
                else:
                    self._fut.set_exception(self._error)
        except BaseException as err:  # a CUDA error, or a future completed by someone else
            if self._error is None:
                self._error = err
        finally:
            self._marked.set()

    def _wait_marked(self, seconds: float | None) -> bool:
        if threading.current_thread() is self._calls.completer:
            return self._calls.complete_through(self, seconds)
        return self._marked.wait(seconds)

    def wait(self, timeout=None) -> bool:
        seconds = _seconds(timeout)
        if not self._wait_marked(seconds):
            raise CollectiveTimeoutError(f"{self._what} not complete after {seconds} s "
                                         f"(the timeout given to wait(); the call goes on)")
        if self._error is not None:
            raise self._error
        self.synchronize()
        return True

    def is_completed(self) -> bool:
        return self._marked.is_set()

    def is_success(self) -> bool:
        return self._marked.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors, once it completed; CUDA ones kept from the caching
        allocator until the current stream is through with them (they were made on the side
        stream)."""
        self.wait()
        outputs = _tensors(self._result)
        for t in outputs:
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
        return outputs

    def synchronize(self) -> None:
        """Make the current stream wait for the copies of a call's CUDA outputs back to the GPU
        (nothing to order on CPU tensors, or before the copies are queued)."""
        if self._staging is not None:
            self._staging.order_caller()

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def _source_rank(self) -> int:
        """A recv's sender (torch.distributed.recv asks it of a recv from any rank)."""
        self.wait()
        if self._source is None:
            raise ValueError(f"{self._what} is not a recv: it has no source rank")
        return self._source


class Calls:
    """The group's worker, poster and completer threads (see the module's doc). `refuse(error)`
    tells the group's other ranks that this rank's call failed before its collectives were
    made."""

    def __init__(self, name: str, refuse=None):
        self._refuse = refuse
        self._lock = threading.Condition()
        self._calls: collections.deque = collections.deque()  # made, not yet run
        self._transfers: collections.deque = collections.deque()  # made, not yet posted
        self._ran: collections.deque = collections.deque()  # run, futures not yet complete
        # transfers ended in the communicator (work, its Work there), futures not yet complete
        self._settled: collections.deque = collections.deque()
        self._posted = 0  # transfers posted, not yet settled
        self._closed = False  # no more calls taken
        self._worker_done = self._poster_done = False
        self.worker = threading.Thread(target=self._work, name=name, daemon=True)
        self.poster = threading.Thread(target=self._post, name=f"{name}-p2p", daemon=True)
        self.completer = threading.Thread(target=self._complete, name=f"{name}-completer",
                                          daemon=True)
        for thread in (self.worker, self.poster, self.completer):
            thread.start()

    def submit(self, what: str, fn, result, staging: Staging | None = None) -> Work:
        """A collective call: `fn` runs on the worker, after every call made before it."""
        return self._queue(self._calls, what, fn, result, staging)

    def submit_transfer(self, what: str, post, result, staging: Staging | None = None,
                        landed=None) -> Work:
        """A point-to-point call: `post()` runs on the poster, after every transfer made before
        it, and returns the communicator's Work of it; the call completes when that does (then
        `landed()` runs, on the completer), whatever the collectives do meanwhile."""
        return self._queue(self._transfers, what, (post, landed), result, staging)

    def _queue(self, queue: collections.deque, what: str, fn, result,
               staging: Staging | None) -> Work:
        work = Work(what, result, staging, self)
        with self._lock:
            if self._closed:
                raise CommunicatorClosedError(f"{what}: the overcast process group is shut down")
            queue.append((fn, work))
            self._lock.notify_all()
        return work

    def _take(self, queue: collections.deque):
        """The next call of `queue`, once there is one; None once closed and it is empty."""
        with self._lock:
            self._lock.wait_for(lambda: queue or self._closed)
            return queue.popleft() if queue else None

    def _work(self) -> None:
        while (call := self._take(self._calls)) is not None:
            fn, work = call
            _run(fn, work, self._refuse)
            work._ran = True
            with self._lock:
                self._ran.append(work)
                self._lock.notify_all()
        with self._lock:
            self._worker_done = True
            self._lock.notify_all()

    def _post(self) -> None:
        while (call := self._take(self._transfers)) is not None:
            (post, landed), work = call
            try:
                if work._staging is not None:
                    work._staging.arrived()
                posted = post()
            except BaseException as err:  # a transfer is no collective: nothing to refuse
                work._error = err
                self._settle(work, None, landed)
                continue
            with self._lock:
                self._posted += 1
            posted.add_done_callback(lambda w=work, p=posted, f=landed: self._settle(w, p, f))
        with self._lock:
            self._poster_done = True
            self._lock.notify_all()

    def _settle(self, work: Work, posted, landed) -> None:
        """A transfer ended (on the engine's thread, or the poster's): its future completes on
        the completer, out of turn with the collectives'."""
        with self._lock:
            if posted is not None:
                self._posted -= 1
            self._settled.append((work, posted, landed))
            self._lock.notify_all()

    def _next(self, seconds: float | None = None):
        """What the completer does next, once there is something (within `seconds`): complete
        the future of the oldest call run, or of a transfer that ended; None once every thread
        has stopped and every future is complete, or after `seconds`."""
        with self._lock:
            self._lock.wait_for(lambda: self._ran or self._settled or (
                self._worker_done and self._poster_done and not self._posted), seconds)
            if self._settled:
                return functools.partial(_land, *self._settled.popleft())
            return self._ran.popleft()._complete if self._ran else None

    def _complete(self) -> None:
        while (step := self._next()) is not None:
            step()

    def complete_through(self, work: Work, seconds: float | None) -> bool:
        """On the completer (a callback waiting for `work`): complete the futures in order up to
        and including `work`'s, and those of transfers that end meanwhile; False if `work` is
        not complete within `seconds`."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while not work._marked.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            step = self._next(left if left is None else max(left, 0.0))
            if step is None:
                return False
            step()
        return True

    def stop(self, seconds: float) -> bool:
        """Take no more calls, run those made and complete them; True once done, False if a call
        or a callback still runs after `seconds` (or if asked from a callback, which the
        completer runs), or if transfers are still under way once every call made has run
        (no call will end them: closing the communicator fails them)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        threads = (self.worker, self.poster, self.completer)
        if threading.current_thread() in threads:
            return False
        deadline = time.monotonic() + seconds
        for thread in (self.worker, self.poster):
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._posted:
                return False
        self.completer.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


def _land(work: Work, posted, landed) -> None:
    """Complete a transfer's future: its error or its source, its output copied back (a
    non-contiguous tensor's, `landed`; a CUDA one's, queued), its staging released."""
    try:
        if posted is not None:
            work._source, work._error = posted.source, posted.exception()
        if work._error is None:
            if landed is not None:
                landed()
            _copy_out(work)
    except BaseException as err:
        work._error = work._error or err
    finally:
        _release(work)
    work._ran = True
    work._complete()


def _run(fn, work: Work, refuse) -> None:
    """Run a call's body on the worker: for a staged call, once its copies to the host are
    done, its outputs' copies back queued after it. Whatever raises, its own or its
    bookkeeping's, is the call's error; one raised before or by the body that did not come from
    the network (not `peers_told`) is refused to the other ranks too."""
    try:
        try:
            if work._staging is not None:
                work._staging.arrived()
            fn()
        except Exception as err:
            if refuse is not None and not getattr(err, "peers_told", False):
                refuse(err)
            raise
        _copy_out(work)
    except BaseException as err:  # the caller's wait() raises it
        work._error = err
    finally:
        _release(work)


def _copy_out(work: Work) -> None:
    """A staged call's outputs: their copies back to the GPU queued (see _copied_out)."""
    if work._staging is not None:
        work._result = _copied_out(work._result, work._staging)


def _release(work: Work) -> None:
    """A staged call's host memory given back; what fails there is the call's error, if it has
    none."""
    if work._staging is not None:
        try:
            work._staging.release()
        except BaseException as err:
            work._error = work._error or err


def _copied_out(result, staging: Staging):
    """A staged call's outputs on its GPU, their copies back queued: each host twin its CUDA
    tensor; a tensor the call made on the host (all_gather's stacked value), a new one there."""
    made: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_device(host: torch.Tensor) -> torch.Tensor:
        original = staging.original(host)
        if original is None:
            with torch.cuda.stream(staging.stream):  # its memory belongs to the side stream
                original = torch.empty(host.shape, dtype=host.dtype, device=staging.device)
            made.append((host, original))
        return original
    value = mapped(result, on_device)
    staging.copy_out(made)
    return value


def mapped(value, fn):
    """`value` (a tensor, or lists of them, or None) with fn applied to every tensor."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return [mapped(v, fn) for v in value]
    return value
