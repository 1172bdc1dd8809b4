"""How an "overcast" process group's calls run: in the order they are made, one at a time, on the
group's worker thread; their futures completed by the group's completer threads, never by the
worker. They follow gloo's contract (a call takes its place in the order when it is made, on the
calling thread) and keep it where gloo's two threads could not:

- Every rank runs the group's collective calls in rank 0's order: each call has a key naming
  it alike on every rank (the program's n-th call on the group, or a callback's m-th, the
  callback named by its future's key, its code and its place among that future's callbacks of
  that code), rank 0 tells the others the keys in the order its calls are made, and they run
  theirs in that order. So a call a callback makes (DDP's PowerSGD hook makes some while the
  backward makes the next bucket's) runs at the same point everywhere, whether the callback was
  attached before its call completed or after.
- Callbacks never run on the worker, nor on the thread that attaches them once their call is
  complete (torch would run them there at once, but that thread may be the one to make a call
  they wait for): they run on completers, and a completer blocked in a callback (waiting for a
  later call, its future, a future then() made of it, or a lock) has the next completion taken
  by another completer, started when none is idle: a callback may wait for anything the
  program does later. A group has at most MAX_COMPLETERS; when all are busy and no other may
  start, the call whose future none is free for fails at once, saying so, and the threads go
  on.
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
import hashlib
import itertools
import re
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from overcast.errors import CollectiveTimeoutError, CommunicatorClosedError, OvercastError
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


# Every collective call has a key, the same on every rank that makes it: (the group's name, n)
# for the n-th call the program makes on the group outside a callback, and (the callback's key,
# m) for the m-th one a callback makes; a callback's key is (its future's key, its code's
# identity, j) for the j-th callback of that code attached to the future. So a key names the
# group its outermost call was made on (calls that callbacks of two groups' futures make on one
# group are keyed apart), and a callback one rank alone attaches (one that logs) shifts the key
# of no other.
_calling = threading.local()  # the key and count of the callback running on this thread


class _Callback:
    """A callback running: its key, and how many calls it has made."""

    def __init__(self, key: tuple):
        self.key, self.made = key, 0


def _identity(callback) -> tuple:
    """A callback's code, named alike by every rank running the program wherever it is
    installed: a function's module, qualified name and first line (a partial's function's, a
    bound method's); a callable object's type's module and qualified name."""
    while isinstance(callback, functools.partial):
        callback = callback.func
    callback = getattr(callback, "__func__", callback)
    code = getattr(callback, "__code__", None)
    if code is not None:
        return callback.__module__, callback.__qualname__, code.co_firstlineno
    named = callback if hasattr(callback, "__qualname__") else type(callback)
    return getattr(named, "__module__", None), named.__qualname__


@contextlib.contextmanager
def _calling_from(key: tuple):
    outer = getattr(_calling, "callback", None)
    _calling.callback = _Callback(key)
    try:
        yield
    finally:
        _calling.callback = outer


def _word(key: tuple) -> bytes:
    """A call's key as rank 0 tells it (8 bytes of a hash: calls pending at once never share)."""
    return hashlib.blake2b(repr(key).encode(), digest_size=_WORD_BYTES).digest()


_WORD_BYTES = 8


class _Future(torch.futures.Future):
    """A call's future: torch's, whose callbacks (then, add_done_callback) run under their keys,
    so that the calls they make have the same keys on every rank, whichever thread runs them
    and whenever they are attached (a key counts the callbacks of its code attached before it,
    never the others). Futures then() makes are keyed alike (on CPU tensors; on CUDA ones,
    torch's own then() makes them). A callback attached once the future is complete runs on one
    of the group's completers too, not at once on the attaching thread as torch's would (but for
    then() on CUDA tensors, and a transfer's): that thread may be the one to make a call the
    callback waits for."""

    def __init__(self, key: tuple | None, calls: Calls, devices=None):
        super().__init__(devices=devices)
        self._key, self._calls, self._cuda = key, calls, bool(devices)
        self._attached: dict[tuple, itertools.count] = {}  # callbacks, counted by identity
        # callbacks attached once it was complete, not yet run: one completer runs them in the
        # order attached, as torch runs those attached before on the thread that completes it
        self._late: collections.deque = collections.deque()
        self._late_lock = threading.Condition()

    def _keyed(self, callback):
        if self._key is None:  # a transfer's: no counterpart on the other ranks
            return callback, None
        identity = _identity(callback)
        key = (self._key, identity, next(self._attached.setdefault(identity, itertools.count())))

        def run(fut):
            with _calling_from(key):
                return callback(fut)

        return run, key

    def _when_done(self, callback) -> None:
        """torch's add_done_callback, run on a completer even if the future is complete now (then
        torch runs it there, as it would have here). A transfer's callbacks run here then, as
        torch's: the calls they make are numbered as the program's, where they are made."""
        if self._key is None:
            return torch.futures.Future.add_done_callback(self, callback)

        def hop(fut):
            with self._late_lock:
                here = self._calls.completing() and not self._late  # after those attached late
                if not here:
                    self._late.append(callback)
                    if len(self._late) > 1:  # a completer is running the earlier ones
                        return
            if here:
                return callback(fut)
            self._calls.later(self._run_late)

        torch.futures.Future.add_done_callback(self, hop)

    def _run_late(self) -> None:
        """On a completer: the callbacks attached once the future was complete, in order."""
        with self._late_lock:
            callback = self._late[0]
        while callback is not None:
            try:
                torch.futures.Future.add_done_callback(self, callback)  # run here, at once
            finally:
                with self._late_lock:
                    self._late.popleft()
                    callback = self._late[0] if self._late else None
                    self._late_lock.notify_all()

    def _late_settled(self, seconds: float | None) -> bool:
        """Whether the callbacks attached once the future was complete have run, within
        `seconds`."""
        with self._late_lock:
            return self._late_lock.wait_for(lambda: not self._late, seconds)

    def add_done_callback(self, callback) -> None:
        self._when_done(self._keyed(callback)[0])

    def then(self, callback):
        run, key = self._keyed(callback)
        if self._cuda or key is None:
            return torch.futures.Future.then(self, run)
        child = _Future(key, self._calls)

        def chain(fut):
            try:
                value = run(fut)
            except BaseException as err:
                child.set_exception(err)
            else:
                child.set_result(value)

        self._when_done(chain)
        return child


class Work(dist._Work):
    """A call's handle, as gloo's: wait() raises what the call raised (a Work made by torch from
    a Future alone returns True whatever happened), and honours its timeout; the future's value
    is the call's outputs, so DDP's comm hooks chain on it."""

    def __init__(
        self, what: str, result, staging: Staging | None, calls: Calls, key: tuple | None = None
    ):
        super().__init__()
        self._what, self._result, self._staging, self._calls = what, result, staging, calls
        self.key = key
        self._error: BaseException | None = None
        self._source: int | None = None  # a recv's sender
        self._ran = False  # the worker is through with it: its outputs and error are final
        self._marked = threading.Event()  # its future is complete
        self._done = threading.Event()  # and its callbacks have run
        # on a GPU, the future records an event on the side stream when it completes, and a
        # value() or wait() of it makes the then-current stream wait for it
        self._fut = _Future(key, calls, [staging.device] if staging else None)
        # the future's first callback, before any of the caller's: the call is complete the
        # moment its future is, not once every callback has run (one may wait for this Work)
        torch.futures.Future.add_done_callback(self._fut, self._mark)

    def _mark(self, _fut) -> None:
        if self._ran:
            self._marked.set()

    def _complete(self) -> None:
        """Complete the future (its callbacks run here, on a completer)."""
        try:
            with (
                torch.cuda.stream(self._staging.stream)
                if self._staging
                else contextlib.nullcontext()
            ):
                if self._error is None:
                    self._fut.set_result(self._result)
                else:
                    _named_globally(self._error, self._calls.ranks)
                    self._fut.set_exception(self._error)
        except BaseException as err:  # a CUDA error, or a future completed by someone else
            if self._error is None:
                self._error = err
        finally:
            self._marked.set()
            self._done.set()

    def _fail_now(self, error: BaseException) -> None:
        """Fail the call before its future completes: wait() raises `error` (or the call's own)
        from now on; the future completes with it later."""
        self._error = self._error or error
        self._marked.set()
        self._done.set()

    def wait(self, timeout=None) -> bool:
        """Once the call is complete and its future's callbacks have run, as gloo's; from a
        callback (on a completer), once the call is complete: its own callbacks, or a later
        call's that wait for it, may still be running."""
        seconds = _seconds(timeout)
        if self._calls.completing():
            done = self._marked.wait(seconds)
        else:  # and the callbacks attached once it was complete
            began = time.monotonic()
            done = self._done.wait(seconds) and self._fut._late_settled(
                None if seconds is None else max(0.0, seconds - (time.monotonic() - began))
            )
        if not done:
            raise CollectiveTimeoutError(
                f"{self._what} not complete after {seconds} s "
                f"(the timeout given to wait(); the call goes on)"
            )
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
# At most this many completers per group: a program that parks more callbacks than this at once
# (each blocked until something later) fails the calls whose futures no completer is free for.
MAX_COMPLETERS = 256


class Calls:
    """The group's worker, poster and completer threads (see the module's doc). `refuse(error)`
    tells the group's other ranks that this rank's call failed before its collectives were
    made."""

    def __init__(
        self,
        name: str,
        refuse=None,
        order=None,
        timeout: float = 1800.0,
        ranks: list[int] | None = None,
    ):
        self._name, self._refuse, self._timeout = name, refuse, timeout
        # the global rank of each of the group's ranks, which its errors name (None: the same)
        self.ranks = ranks
        # the communicator rank 0 tells the others the order of calls on (tell_order,
        # hear_order); None for a group of one
        self._order = order
        self._lock = threading.Condition()
        # collective calls made, not yet run, by their words (_word), in the order made
        self._calls: collections.OrderedDict = collections.OrderedDict()
        self._top = 0  # calls the program made on the group outside callbacks
        self._heard: collections.deque = collections.deque()  # words of rank 0's order
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
        with self._lock:
            if (why := self._start_completer()) is not None:
                raise OvercastError(f"{name}'s first completer thread: {why}")
        self.worker = threading.Thread(target=self._work, name=name, daemon=True)
        self.poster = threading.Thread(target=self._post, name=f"{name}-p2p", daemon=True)
        self.worker.start()
        self.poster.start()

    def _start_completer(self) -> str | None:
        """Under the lock: one more completer thread; or why none starts (MAX_COMPLETERS are
        running, or the system would start no thread)."""
        if len(self._completers) >= MAX_COMPLETERS:
            return f"the group has {MAX_COMPLETERS}, its most (MAX_COMPLETERS)"
        thread = threading.Thread(
            target=self._complete, daemon=True, name=f"{self._name}-completer-{self._started + 1}"
        )
        try:
            thread.start()
        except Exception as err:  # at the system's limit of threads: "can't start new thread"
            return f"starting a thread failed ({type(err).__name__}: {err})"
        self._started += 1
        self._completers.add(thread)  # before it runs: it waits for the lock held here
        return None

    def completing(self) -> bool:
        """Whether this thread is one of the group's completers (a callback runs on it)."""
        return threading.current_thread() in self._completers

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [self.worker, self.poster, *self._completers]

    def submit(self, what: str, fn, result, staging: Staging | None = None) -> Work:
        """A collective call: `fn` runs on the worker, in rank 0's order of the calls (on rank
        0, the order they are made)."""
        with self._lock:
            self._open(what)
            callback = getattr(_calling, "callback", None)
            if callback is None:
                key, self._top = (self._name, self._top), self._top + 1
            else:
                key, callback.made = (callback.key, callback.made), callback.made + 1
            word = _word(key)
            work = Work(what, result, staging, self, key)
            if word in self._calls:
                self._clash(work)
                return work
            if self._order is not None and self._order.rank == 0:
                self._order.tell_order(word)  # under the lock: told in the order made
            self._calls[word] = (fn, work)
            self._lock.notify_all()
        return work

    def _clash(self, work: Work) -> None:
        """Under the lock: `work`'s key is that of a call made and not yet run. No order of the
        two is sound (a rank may have begun the first already), so the call fails and the group
        aborts on every rank, naming the key."""
        work._error = OvercastError(
            f"{work._what}: another call on the group not yet run has its key {work.key!r}, so "
            f"the ranks cannot tell the two apart; the group is aborted"
        )
        if self._order is not None:
            self._order.abort(str(work._error))
        work._ran = True
        self._to_complete(work._complete, work)

    def submit_transfer(
        self, what: str, post, result, staging: Staging | None = None, landed=None
    ) -> Work:
        """A point-to-point call: `post()` runs on the poster, after every transfer made before
        it, and returns the communicator's Work of it; the call completes when that does (then
        `landed()` runs, on a completer), whatever the collectives do meanwhile. Its callbacks
        have no key of their own: it has no counterpart on the other ranks."""
        work = Work(what, result, staging, self)
        with self._lock:
            self._open(what)
            self._transfers.append(((post, landed), work))
            self._lock.notify_all()
        return work

    def _open(self, what: str) -> None:
        if self._closed:
            raise CommunicatorClosedError(f"{what}: the overcast process group is shut down")

    def _take_transfer(self):
        """The next transfer made, once there is one; None once closed and there is none."""
        with self._lock:
            self._lock.wait_for(lambda: self._transfers or self._closed)
            return self._transfers.popleft() if self._transfers else None

    def _take_call(self):
        """The next collective call to run, once there is one; None once closed and every call
        made has run. Rank 0 runs them in the order made; the others in the order rank 0 tells
        (a call made from a callback may come at another point of the order on each rank:
        where it came on rank 0 is where it runs everywhere)."""
        with self._lock:
            self._lock.wait_for(lambda: self._calls or self._closed)
            if not self._calls:
                return None
            if self._order is None or self._order.rank == 0:
                return self._calls.popitem(last=False)[1]
        word = self._hear()
        with self._lock:
            if word is None:  # rank 0 is gone or the group aborted: the calls fail as they run
                return self._calls.popitem(last=False)[1]
            if not self._lock.wait_for(lambda: word in self._calls, self._timeout):
                self._out_of_order()
                return self._calls.popitem(last=False)[1]
            return self._calls.pop(word)

    def _hear(self) -> bytes | None:
        """Rank 0's next word, asked for once a call is made here (an ask waiting with nothing
        to run would time out an idle group); None if it cannot come."""
        buffer = np.empty(_WORD_BYTES, np.uint8)
        try:
            heard = self._order.hear_order(buffer)
            heard.wait()
        except OvercastError:
            return None
        return buffer.tobytes()

    def _out_of_order(self) -> None:
        """Under the lock: rank 0 ran a call this rank has not made within the group's timeout:
        the ranks' calls differ. The group aborts, naming it."""
        self._order.abort(
            f"rank {self._order.rank} has not made, within {self._timeout:.0f} s, "
            f"the call rank 0 ran next on the group (every rank makes the same "
            f"calls; only those that callbacks make may come in another order)"
        )

    def _queued(self, step) -> str | None:
        """Under the lock: `step` for the completers, with one more of them if none is idle
        (each blocked in a callback, or busy); why none can take it now, if none can start."""
        self._completions.append(step)
        self._lock.notify_all()
        return self._start_completer() if self._idle < len(self._completions) else None

    def later(self, step) -> None:
        """`step` on a completer (a callback attached to a complete future): once one is free,
        if none is and none can start."""
        with self._lock:
            self._queued(step)

    def _to_complete(self, step, work: Work) -> None:
        """Under the lock: `step`, which completes `work`'s future, for the completers. If none
        can take it now, `work` fails now, saying why (its future completes, with that error,
        once a completer is free): waiting for one could wait for ever, on callbacks that wait
        for this call."""
        if (why := self._queued(step)) is not None:
            work._fail_now(
                OvercastError(
                    f"{work._what}: complete, but every completer thread of the group is busy in a "
                    f"callback, and {why}; its future completes, with this error, once one is "
                    f"free"
                )
            )

    def _work(self) -> None:
        while (call := self._take_call()) is not None:
            fn, work = call
            _run(fn, work, self._refuse)
            work._ran = True
            with self._lock:
                self._to_complete(work._complete, work)
        with self._lock:
            self._worker_done = True
            self._lock.notify_all()

    def _post(self) -> None:
        while (call := self._take_transfer()) is not None:
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
            self._to_complete(functools.partial(_land, work, posted, landed), work)

    def _finished(self) -> bool:
        """Under the lock: every thread but the completers stopped, nothing left to complete."""
        return (
            self._worker_done and self._poster_done and not self._posted and not self._completions
        )

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


def _named_globally(error: BaseException, ranks: list[int] | None) -> None:
    """An overcast error of a group whose ranks are not the job's: its message, which names the
    group's ranks ("lost the connection to rank 1"), says the global rank of each it names.
    Once: one error may fail several calls."""
    if (
        ranks is None
        or ranks == list(range(len(ranks)))
        or not isinstance(error, OvercastError)
        or getattr(error, "ranks_named", False)
        or not error.args
        or not isinstance(error.args[0], str)
    ):
        return
    named = sorted(
        {
            int(r)
            for r in re.findall(r"(?<!global )\brank (\d+)", error.args[0])
            if int(r) < len(ranks)
        }
    )
    if not named:
        return
    error.args = (
        f"{error.args[0]} [ranks of the group of global ranks {ranks}: "
        + ", ".join(f"rank {r} is global rank {ranks[r]}" for r in named)
        + "]",
        *error.args[1:],
    )
    error.ranks_named = True


def _land(work: Work, posted, landed) -> None:
    """Complete a transfer's future: its error or its source, its output copied back (a
    non-contiguous tensor's, `landed`; a CUDA one's, queued), its staging released."""
    try:
        if posted is not None:  # an error the call has already raised stays its error
            work._source, work._error = posted.source, work._error or posted.exception()
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
