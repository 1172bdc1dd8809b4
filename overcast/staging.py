"""CUDA tensors through overcast's collectives, which run on host memory: staged through pinned
host buffers as gloo stages them.

A call on CUDA tensors copies its inputs to pinned host memory on a CUDA stream, after what the
caller's stream had queued; the collective runs on the host copies; its outputs are copied back on
a stream, and an event recorded after those copies is what the caller's stream waits on. Both
users, the torch.distributed backend (distributed/backend.py) and FSDP2's custom collectives
(fsdp/collectives.py), take their host buffers from a `PinnedPool`, reused from call to call.

Nothing here needs a GPU to import; a CUDA call needs torch built with CUDA.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from overcast.errors import InvalidArgumentError
from overcast.limits import bytes_from_env
from overcast.native import store_u32_fenced

PINNED_BYTES_ENV = "OVERCAST_PINNED_BYTES"
GATES_ENV = "OVERCAST_STREAM_GATES"  # "0": no gates; a synchronous ReduceScatter then blocks
DEFAULT_PINNED_BYTES = 1 << 30
_ALIGN = 1 << 20  # buffers are whole MiBs, so that sizes near each other reuse one buffer


def pinned_limit() -> int:
    """The bytes of pinned host memory a pool keeps (OVERCAST_PINNED_BYTES, default 1 GiB)."""
    return bytes_from_env(PINNED_BYTES_ENV, DEFAULT_PINNED_BYTES)


def device_of(tensors, what: str) -> torch.device | None:
    """The one CUDA device `tensors` are on, or None if all are CPU tensors; a named
    InvalidArgumentError for any other device, or for CPU and CUDA tensors (or two GPUs) in one
    call, as gloo refuses them."""
    found: torch.device | None = None
    cpu = False
    for t in tensors:
        kind = t.device.type
        if kind == "cpu":
            cpu = True
        elif kind == "cuda":
            if found is not None and t.device != found:
                raise InvalidArgumentError(
                    f"{what}: tensors on {found} and {t.device} in one "
                    f"call; overcast stages one GPU's tensors per call"
                )
            found = t.device
        else:
            raise InvalidArgumentError(
                f"{what}: a tensor is on {t.device}; overcast moves CPU and CUDA tensors"
            )
    if found is not None and cpu:
        raise InvalidArgumentError(
            f"{what}: CPU and CUDA ({found}) tensors in one call; give it tensors on one device"
        )
    return found


class MappedMemory:
    """Host buffers, each an anonymous mapping of its own (page-aligned, sharing no page with
    another), which a forked child does not inherit; unmapped once no tensor over it is left.
    Pageable: `PinnedMemory` pins them. A pool's allocator: `allocate` and `free`, which the pool
    calls once for each buffer it lets go, after the last copy queued on it."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` (a multiple of the page size) over a new mapping."""
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_DONTFORK)
        return torch.frombuffer(mapping, dtype=torch.uint8)  # it holds the mapping

    def free(self, memory: torch.Tensor) -> None:
        """Nothing to undo: the mapping goes with the last tensor over it."""


class PinnedMemory(MappedMemory):
    """Mapped buffers pinned with cudaHostRegister (for every device's context) and unpinned
    with cudaHostUnregister when freed. Not torch's pinned tensors: its caching host allocator
    keeps a freed one pinned for the life of the process, so a pool's limit would bound nothing;
    and torch.cuda.cudart()'s two calls have been public, and let go of the GIL, in every
    supported torch, where emptying torch's host cache is private and was renamed."""

    _PORTABLE = 0x1  # cudaHostRegisterPortable

    def allocate(self, nbytes: int) -> torch.Tensor:
        memory = super().allocate(nbytes)
        torch.cuda.check_error(
            torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes, self._PORTABLE)
        )
        return memory

    def free(self, memory: torch.Tensor) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(memory.data_ptr()))


@dataclass(eq=False)  # identity: list.remove must not compare the tensors
class _Buffer:
    memory: torch.Tensor  # uint8, from the pool's allocator
    keep: bool  # back in the pool when given back; else freed (it came over the limit)
    ready: Any = None  # an event after the last copy queued on it (None: never used)


@dataclass(eq=False)
class _Lease:
    """A buffer taken, until given back; `dropped` calls the pool back if every tensor over
    it is gone first (a call that never gave it back)."""

    buffer: _Buffer
    stream: Any  # the stream its copies are queued on
    dropped: weakref.finalize | None = None


class PinnedPool:
    """Pinned host buffers for staging, reused from call to call. It keeps at most `limit` bytes:
    a buffer taken while the pool holds that much already is freed once given back instead of
    kept (counted in `stats()["overflows"]`), so a demand above the limit still runs, and the
    pool never waits for buffers another call holds (which could be its own caller's). A buffer
    it lets go (over the limit, or idle and in the way of a larger one) is freed with its
    allocator's `free` (unpinned) once the last copy queued on it is done, at the next `take`
    or `stats`; until then it counts as held.

    A buffer given back carries the event recorded after the last copy queued on it; taking it
    for another copy makes that copy's stream wait on the event first, so no copy into a buffer
    overtakes one still reading it. A buffer taken and never given back returns to the pool once
    no tensor over it is left, after what its stream had queued by then. The allocator runs
    outside the pool's lock (pinning takes long), so a `give` never waits for it. Thread-safe."""

    def __init__(self, limit: int | None = None, memory: MappedMemory | None = None):
        self.limit = pinned_limit() if limit is None else limit
        self.memory = PinnedMemory() if memory is None else memory
        self._lock = threading.Lock()
        self._free: list[_Buffer] = []
        self._retiring: list[_Buffer] = []  # let go, their last copy not done yet
        self._held = 0  # bytes of buffers allocated and not freed, or being allocated
        self._peak = 0
        self._allocations = 0
        self._overflows = 0
        self._taken: dict[int, _Lease] = {}  # by the buffer's address, unique while it lives
        self._dropped: collections.deque[_Lease] = collections.deque()  # appended lock-free

    def take(self, nbytes: int, stream) -> torch.Tensor:
        """A pinned uint8 tensor of `nbytes` (over a buffer at least that long), safe to copy
        into on `stream` from now on."""
        freeing: list[_Buffer] = []
        with self._lock:
            self._reclaim(freeing)
            fits = [b for b in self._free if b.memory.numel() >= nbytes]
            buf = min(fits, key=lambda b: b.memory.numel()) if fits else None
            if buf is not None:
                self._free.remove(buf)
            else:
                size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
                let_go = _size(freeing)  # freed now, or once their last copies are done
                while self._free and self._held - let_go + size > self.limit:
                    idle = self._free.pop(0)  # free it for room
                    self._retire(idle, freeing)
                    let_go += idle.memory.numel()
                keep = self._held - let_go + size <= self.limit
                self._held += size  # reserved now, so that no other call counts it free
        self._let_go(freeing)
        if buf is None:
            try:
                buf = _Buffer(self.memory.allocate(size), keep)
            except BaseException:
                with self._lock:
                    self._held -= size
                raise
            with self._lock:
                self._allocations += 1
                self._overflows += not keep
                self._peak = max(self._peak, self._held)
        if buf.ready is not None:
            stream.wait_event(buf.ready)
        return self._lend(buf, nbytes, stream)

    def _lend(self, buf: _Buffer, nbytes: int, stream) -> torch.Tensor:
        """A tensor of its own over `buf`'s first `nbytes`: the memoryview under it lives as
        long as any tensor over it does, so its end says the lease is dropped."""
        lease = _Lease(buf, stream)
        view = buf.memory.numpy().data[:nbytes]
        lease.dropped = weakref.finalize(view, self._dropped.append, lease)
        lease.dropped.atexit = False
        with self._lock:
            self._taken[buf.memory.data_ptr()] = lease
        return torch.frombuffer(view, dtype=torch.uint8)

    def give(self, views: list[torch.Tensor], ready) -> None:
        """Give back the buffers under `views` (from `take`), `ready` recorded after the last copy
        queued on them. It frees nothing itself (the caller may be the engine's thread)."""
        with self._lock:
            for view in views:
                lease = self._taken.pop(view.data_ptr())
                assert lease.dropped is not None  # set as it was lent
                lease.dropped.detach()
                self._back(lease.buffer, ready)

    def _back(self, buf: _Buffer, ready) -> None:
        buf.ready = ready
        (self._free if buf.keep else self._retiring).append(buf)

    def _retire(self, buf: _Buffer, freeing: list[_Buffer]) -> None:
        """Let `buf` go: freed now if its copies are done, else once they are."""
        done = buf.ready is None or buf.ready.query()
        (freeing if done else self._retiring).append(buf)

    def _reclaim(self, freeing: list[_Buffer]) -> None:
        """Take back the buffers of leases dropped without a give (after what their stream
        queued so far); move those let go whose copies are done to `freeing`."""
        while self._dropped:
            lease = self._dropped.popleft()
            address = lease.buffer.memory.data_ptr()
            if self._taken.get(address) is lease:
                del self._taken[address]
                self._back(lease.buffer, lease.stream.record_event())
        retiring, self._retiring = self._retiring, []
        for buf in retiring:
            self._retire(buf, freeing)

    def _let_go(self, freeing: list[_Buffer]) -> None:
        """Free `freeing` (outside the lock) and stop counting them."""
        freed = 0
        try:
            for buf in freeing:
                self.memory.free(buf.memory)
                freed += buf.memory.numel()
        finally:
            if freed:
                with self._lock:
                    self._held -= freed

    def stats(self) -> dict:
        """Bytes held now (after freeing what is done) and at the peak, buffers allocated, and
        allocations over the limit."""
        freeing: list[_Buffer] = []
        with self._lock:
            self._reclaim(freeing)
        self._let_go(freeing)
        with self._lock:
            return {
                "held_bytes": self._held,
                "peak_bytes": self._peak,
                "allocations": self._allocations,
                "overflows": self._overflows,
                "limit_bytes": self.limit,
            }


def _size(buffers: list[_Buffer]) -> int:
    return sum(b.memory.numel() for b in buffers)


_pools: dict[int, PinnedPool] = {}
_pools_lock = threading.Lock()


def process_pool() -> PinnedPool:
    """The process's one pool, shared by every group and model (its limit is per process)."""
    with _pools_lock:
        pool = _pools.get(os.getpid())  # a forked child starts its own
        if pool is None:
            pool = _pools[os.getpid()] = PinnedPool()
        return pool


def host_twin(t: torch.Tensor, pool: PinnedPool, stream, views: list) -> torch.Tensor:
    """A contiguous pinned host tensor of t's dtype and shape, from `pool` (its view appended to
    `views`, for giving back)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    raw = pool.take(nbytes, stream)
    views.append(raw)
    return raw.view(t.dtype).view(t.shape)


class Staging:
    """One call's staging on `stream`: host twins of its CUDA tensors, copies in (queued as the
    caller's stream stood when the call was made), copies out, and the event after them.

    `twin` and `sealed` run on the caller's thread; `arrived` (waits for the copies in) and
    `copy_out` on whichever thread runs the collective; `finished` is the event the caller's
    stream waits on. Its events time the copies: (`began`, `copied_in`) and (`copying_out`,
    `finished`)."""

    def __init__(self, device: torch.device, stream, pool: PinnedPool):
        self.device, self.stream, self.pool = device, stream, pool
        self._views: list[torch.Tensor] = []
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(twin): (t, twin)
        # blocking: a thread that waits for the copies in (the poster's) sleeps, not spins
        self.copied_in = torch.cuda.Event(enable_timing=True, blocking=True)
        self.copying_out: torch.cuda.Event | None = None  # both recorded by copy_out
        self.finished: torch.cuda.Event | None = None
        caller = torch.cuda.current_stream(device)
        if stream != caller:
            stream.wait_stream(caller)
        self.began = torch.cuda.Event(enable_timing=True)
        self.began.record(stream)

    def twin(self, t: torch.Tensor, *, read: bool, written: bool) -> torch.Tensor:
        """t's host twin: filled from t if the collective reads it, copied back into t after
        if it writes it. t is kept from the caching allocator's reuse until the copies on the
        stream are done."""
        host = host_twin(t, self.pool, self.stream, self._views)
        if host.numel():
            t.record_stream(self.stream)
            if read:
                with torch.cuda.stream(self.stream):
                    host.copy_(t, non_blocking=True)
        if written:
            self._outputs[id(host)] = (t, host)
        return host

    def original(self, host: torch.Tensor) -> torch.Tensor | None:
        """The CUDA tensor a written twin `host` is the twin of, or None."""
        pair = self._outputs.get(id(host))
        return pair[0] if pair is not None and pair[1] is host else None

    def sealed(self) -> None:
        """Every twin made: mark the point the copies in end at."""
        self.copied_in.record(self.stream)

    def arrived(self) -> None:
        """Block until the copies in are done (the host may read the twins)."""
        self.copied_in.synchronize()

    def copy_out(
        self, extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), release: bool = True
    ) -> None:
        """Queue the copies of the written twins (and of `extra` (host, device) pairs) back to
        the GPU, record `finished` after them, and give the buffers back to the pool (unless
        not `release`: queued behind a gate, they are copied once the collective is done, and
        the caller releases them then). The host does not wait for them."""
        with torch.cuda.stream(self.stream):
            self.copying_out = torch.cuda.Event(enable_timing=True)
            self.copying_out.record(self.stream)
            for t, host in [*self._outputs.values(), *((t, host) for host, t in extra)]:
                t.copy_(host, non_blocking=True)
            self.finished = torch.cuda.Event(enable_timing=True, blocking=True)
            self.finished.record(self.stream)
        # the CUDA tensors go now, on the thread that queued their copies (record_stream keeps
        # them from reuse until the copies are done): dropped later by the engine's thread, the
        # last reference to one would take the caching allocator's lock there, which a thread
        # freeing cached memory holds while it waits for streams stopped at later gates
        self._outputs = {}
        if release:
            self.release()

    @property
    def clock(self) -> ClockReference:
        """Its device's `clock_reference`, to place its events in time."""
        return clock_reference(self.device)

    def release(self) -> None:
        """Give the buffers back (after `copy_out`, or when the call failed before it) and let
        go of the CUDA tensors (the stream's copies hold them from reuse until done)."""
        self._outputs = {}
        views, self._views = self._views, []
        if views:
            ready = self.finished
            if ready is None:
                ready = torch.cuda.Event()
                ready.record(self.stream)
            self.pool.give(views, ready)

    def order_caller(self) -> None:
        """Make the caller's current stream wait for the copies out (Work.wait's part on the
        GPU: the host does not block on them)."""
        if self.finished is not None:
            torch.cuda.current_stream(self.device).wait_event(self.finished)


class GateTickets:
    """The stream gates' ring of `slots` words, without CUDA: each gate is the next slot, with a
    value one higher than that slot's last; a slot is not given out again before its last gate
    opened, so a gate opens only when its own collective is done, never by a later one.
    Thread-safe."""

    def __init__(self, slots: int):
        self.slots = slots
        self._lock = threading.Condition()
        self._count = 0
        self._opened = [0] * slots  # the value each slot was last opened with
        self._given_up: set[tuple[int, int]] = set()  # tickets whose wait raised

    @property
    def taken(self) -> int:
        """Gates given out so far, waiting for their slot or not."""
        with self._lock:
            return self._count

    def take(self) -> tuple[int, int]:
        """The next gate's (slot, value), once that slot's last gate has opened. The ticket is
        taken before the wait, which lets go of the lock: another caller meanwhile takes the
        next. A wait ended by an exception (Ctrl-C) gives the ticket up: it counts as opened
        once the gate before it opens, so the slot's later gates still open."""
        with self._lock:
            ticket, self._count = self._count, self._count + 1
            slot, value = ticket % self.slots, ticket // self.slots + 1
            try:
                self._lock.wait_for(lambda: self._opened[slot] >= value - 1)
            except BaseException:
                self._given_up.add((slot, value))
                self._open_given_up(slot)
                raise
        return slot, value

    def opened(self, slot: int, value: int) -> None:
        """The gate (slot, value) opened (its word written): its slot may be given out again."""
        with self._lock:
            self._opened[slot] = max(self._opened[slot], value)
            self._open_given_up(slot)
            self._lock.notify_all()

    def _open_given_up(self, slot: int) -> None:
        """Count the slot's tickets given up as opened, as far as the gates before them have."""
        while (slot, self._opened[slot] + 1) in self._given_up:
            self._given_up.discard((slot, self._opened[slot] + 1))
            self._opened[slot] += 1
            self._lock.notify_all()


class StreamGates:
    """Gates a CUDA stream stops at until the host opens them, so that an operation queued on a
    stream behind a gate (a collective's copy back) waits for the host (the collective) without
    the host waiting: the stream waits for a word of pinned host memory to reach a value
    (the driver's cuStreamWaitValue32), and the host writes the value. The words and values are
    a `GateTickets` ring of SLOTS. Thread-safe."""

    SLOTS = 256
    _WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ

    def __init__(self):
        libcuda = ctypes.CDLL("libcuda.so.1")
        self._wait = getattr(libcuda, "cuStreamWaitValue32_v2", None) or libcuda.cuStreamWaitValue32
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        self._words = torch.zeros(self.SLOTS, dtype=torch.int32, pin_memory=True)
        self._host = self._words.numpy()
        device_pointer = ctypes.c_uint64()
        get = getattr(libcuda, "cuMemHostGetDevicePointer_v2", None)
        if (
            get is None
            or get(ctypes.byref(device_pointer), ctypes.c_void_p(self._words.data_ptr()), 0) != 0
        ):
            device_pointer.value = self._words.data_ptr()  # unified addressing: the same
        self._base = device_pointer.value
        self._tickets = GateTickets(self.SLOTS)
        probe = torch.cuda.Stream()  # a gate already open: the driver must take it
        code = self._wait(
            ctypes.c_void_p(probe.cuda_stream), ctypes.c_uint64(self._base), 0, self._WAIT_GEQ
        )
        probe.synchronize()
        if code != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {code}")

    def close_on(self, stream):
        """Queue a gate on `stream`; returns the function that opens it (call it once)."""
        slot, value = self._tickets.take()
        code = self._wait(
            ctypes.c_void_p(stream.cuda_stream),
            ctypes.c_uint64(self._base + 4 * slot),
            ctypes.c_uint32(value),
            self._WAIT_GEQ,
        )
        if code != 0:
            self._open(slot, value)
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {code}")
        return lambda: self._open(slot, value)

    def _open(self, slot: int, value: int) -> None:
        # the word last, after the collective's writes (a fenced store: the GPU must not see the
        # gate open before it sees the result it copies back)
        store_u32_fenced(self._host, slot, value)
        self._tickets.opened(slot, value)


class ClockReference(NamedTuple):
    """A CUDA event the GPU passed at `seconds` on time.monotonic()'s clock (the engine traces'):
    another event of its device passed `event.elapsed_time(other) / 1e3` seconds after it."""

    event: Any
    seconds: float


_clocks: dict[tuple[int, torch.device], ClockReference] = {}
# A reference is made anew once this old: elapsed_time is float32 milliseconds, whose steps are
# 4 us a minute from the reference and 1 ms three hours from it.
CLOCK_REFERENCE_SECONDS = 60.0


def clock_reference(device: torch.device) -> ClockReference:
    """The process's reference for `device`, made anew each CLOCK_REFERENCE_SECONDS: an event
    recorded on a stream with nothing queued, its time halfway between the record and the host
    seeing it done (tens of microseconds apart)."""
    with _pools_lock:
        key = (os.getpid(), device)
        last = _clocks.get(key)
        if last is None or time.monotonic() - last.seconds > CLOCK_REFERENCE_SECONDS:
            stream = torch.cuda.Stream(device)
            event = torch.cuda.Event(enable_timing=True)
            before = time.monotonic()
            event.record(stream)
            event.synchronize()
            _clocks[key] = ClockReference(event, (before + time.monotonic()) / 2)
        return _clocks[key]


_gates: dict[int, StreamGates | None] = {}


def stream_gates() -> StreamGates | None:
    """The process's gates, or None where the driver offers none (or OVERCAST_STREAM_GATES=0):
    a synchronous collective on CUDA tensors then blocks the host until its result is back."""
    with _pools_lock:
        pid = os.getpid()
        if pid not in _gates:
            gates = None
            if os.environ.get(GATES_ENV, "1") != "0":
                try:
                    gates = StreamGates()
                except (OSError, AttributeError, RuntimeError):
                    gates = None
            _gates[pid] = gates
        return _gates[pid]
