"""How an "overcast" process group's calls run: in the order they are made, one at a time, on the
group's worker thread; their futures completed by the group's completer threads, never by the
worker. They follow gloo's contract (a call takes its place in the order when it is made, on the
calling thread) and keep it where gloo's two threads could not:

- A call made from a future's callback is queued when it is made, like any other: a callback
  attached to a call already complete runs at once on the attaching thread, one attached before
  runs on a completer when the call completes, and either way the new call follows every call
  made before the callback ran.
- Callbacks never run on the worker, and a completer blocked in a callback (waiting for a later
  call, its future, a future then() made of it, or a lock) has the next completion taken by
  another completer, started when none is idle: a callback may wait for anything the program
  does later.
- An error anywhere in a call's bookkeeping (a CUDA error in its staging, a future the caller
  completed itself) fails that call alone; the threads go on. One raised before the call's
  collectives are made (bad arguments, a failed staging copy) is also told to the group's other
  ranks (`refuse`, Communicator.refuse), whose own call then raises it, naming this rank, rather
  than wait for this rank's part.

Point-to-point calls (send, recv) are no collectives: the other ranks do not make them too. They
go to a third thread, the poster, which posts them to the communicator in the order they are
made (a CUDA tensor's once its staging copy is done), and each completes when its transfer ends,
on a completer, out of turn with the collectives. So a recv that waits for a send its peer
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
        self._done = threading.Event()  # and its callbacks have run
        # on a GPU, the future records an event on the side stream when it completes, and a
        # value() or wait() of it makes the then-current stream wait for it
        self._fut = torch.futures.Future(devices=[staging.device] if staging else None)
        # the future's first callback, before any of the caller's: the call is complete the
        # moment its future is, not once every callback has run (one may wait for this Work)
        self._fut.add_done_callback(lambda _: self._ran and self._marked.set())

    def _complete(self) -> None:
        """Complete the future (its callbacks run here, on a completer)."""
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
            self._done.set()

    def wait(self, timeout=None) -> bool:
        """Once the call is complete and its future's callbacks have run, as gloo's; from a
        callback (on a completer), once the call is complete: its own callbacks, or a later
        call's that wait for it, may still be running."""
        seconds = _seconds(timeout)
        done = self._marked if self._calls.completing() else self._done
        if not done.wait(seconds):
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


# A completer idle this long ends, unless it is the last one.
_IDLE_SECONDS = 5.0


class Calls:
    """The group's worker, poster and completer threads (see the module's doc). `refuse(error)`
    tells the group's other ranks that this rank's call failed before its collectives were
    made."""

    def __init__(self, name: str, refuse=None):
        self._name, self._refuse = name, refuse
        self._lock = threading.Condition()
        self._calls: collections.deque = collections.deque()  # made, not yet run
        self._transfers: collections.deque = collections.deque()  # made, not yet posted
        # what the completers do next, in order: complete the future of a call run, or of a
        # transfer that ended
        self._completions: collections.deque = collections.deque()
        self._posted = 0  # transfers posted, not yet ended
        self._closed = False  # no more calls taken
        self._worker_done = self._poster_done = False
        self._completers: set[threading.Thread] = set()
        self._idle = 0  # completers waiting for a completion
        self._started = 0
        self.worker = threading.Thread(target=self._work, name=name, daemon=True)
        self.poster = threading.Thread(target=self._post, name=f"{name}-p2p", daemon=True)
        self.worker.start()
        self.poster.start()
        with self._lock:
            self._start_completer()

    def _start_completer(self) -> None:
        """Under the lock: one more completer thread."""
        self._started += 1
        thread = threading.Thread(target=self._complete, daemon=True,
                                  name=f"{self._name}-completer-{self._started}")
        self._completers.add(thread)
        thread.start()

    def completing(self) -> bool:
        """Whether this thread is one of the group's completers (a callback runs on it)."""
        return threading.current_thread() in self._completers

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [self.worker, self.poster, *self._completers]

    def submit(self, what: str, fn, result, staging: Staging | None = None) -> Work:
        """A collective call: `fn` runs on the worker, after every call made before it."""
        return self._queue(self._calls, what, fn, result, staging)

    def submit_transfer(self, what: str, post, result, staging: Staging | None = None,
                        landed=None) -> Work:
        """A point-to-point call: `post()` runs on the poster, after every transfer made before
        it, and returns the communicator's Work of it; the call completes when that does (then
        `landed()` runs, on a completer), whatever the collectives do meanwhile."""
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

    def _to_complete(self, step) -> None:
        """Under the lock: `step` for the completers, with one more of them if none is idle (each
        blocked in a callback, or busy)."""
        self._completions.append(step)
        if self._idle < len(self._completions):
            self._start_completer()
        self._lock.notify_all()

    def _work(self) -> None:
        while (call := self._take(self._calls)) is not None:
            fn, work = call
            _run(fn, work, self._refuse)
            work._ran = True
            with self._lock:
                self._to_complete(work._complete)
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
        a completer, out of turn with the collectives'."""
        with self._lock:
            if posted is not None:
                self._posted -= 1
            self._to_complete(functools.partial(_land, work, posted, landed))

    def _finished(self) -> bool:
        """Under the lock: every thread but the completers stopped, nothing left to complete."""
        return self._worker_done and self._poster_done and not self._posted and \
            not self._completions

    def _complete(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._idle += 1
                self._lock.wait_for(lambda: self._completions or self._finished(), _IDLE_SECONDS)
                self._idle -= 1
                if not self._completions and (self._finished() or len(self._completers) > 1):
                    self._completers.discard(me)
                    return
                step = self._completions.popleft() if self._completions else None
            if step is not None:
                step()

    def stop(self, seconds: float) -> bool:
        """Take no more calls, run those made and complete them; True once done, False if a call
        or a callback still runs after `seconds`, or if transfers are still under way once every
        call made has run (no call will end them: closing the communicator fails them). From a
        callback, the other threads are waited for."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        deadline = time.monotonic() + seconds
        me = threading.current_thread()
        for thread in (self.worker, self.poster):
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._posted:
                return False
        while True:
            others = [t for t in self.threads() if t is not me and t.is_alive()]
            if not others or time.monotonic() >= deadline:
                return not others
            others[0].join(max(0.0, deadline - time.monotonic()))


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
