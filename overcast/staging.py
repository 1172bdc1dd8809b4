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

import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(eq=False)  # identity: list.remove must not compare the tensors
class _Buffer:
    memory: torch.Tensor  # pinned uint8
    ready: torch.cuda.Event | None  # the last copy from or into it, queued before release


class PinnedPool:
    """Pinned host buffers for staging, reused from call to call. It keeps at most `limit` bytes:
    a buffer taken while the pool holds that much already is freed when given back instead of
    kept (counted in `stats()["overflows"]`), so a demand above the limit still runs, and the
    pool never waits for buffers another call holds (which could be its own caller's).

    A buffer given back carries the event recorded after the last copy queued on it; taking it
    for another copy makes that copy's stream wait on the event first, so no copy into a buffer
    overtakes one still reading it. Thread-safe."""

    def __init__(self, limit: int | None = None):
        self.limit = pinned_limit() if limit is None else limit
        self._lock = threading.Lock()
        self._free: list[_Buffer] = []
        self._held = 0  # bytes of buffers alive: free and taken
        self._peak = 0
        self._allocations = 0
        self._overflows = 0
        # id(view handed out) -> (its buffer, whether the buffer is kept when given back)
        self._taken: dict[int, tuple[_Buffer, bool]] = {}

    def take(self, nbytes: int, stream) -> torch.Tensor:
        """A pinned uint8 tensor of `nbytes` (a view of a buffer at least that long), safe to
        copy into on `stream` from now on."""
        with self._lock:
            fits = [b for b in self._free if b.memory.numel() >= nbytes]
            keep = True
            if fits:
                buf = min(fits, key=lambda b: b.memory.numel())
                self._free.remove(buf)
            else:
                size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
                while self._free and self._held + size > self.limit:
                    self._held -= self._free.pop(0).memory.numel()  # idle: free it for room
                keep = self._held + size <= self.limit
                self._overflows += not keep
                self._held += size
                self._allocations += 1
                self._peak = max(self._peak, self._held)
                buf = _Buffer(torch.empty(size, dtype=torch.uint8, pin_memory=True), None)
            view = buf.memory[:nbytes]
            self._taken[id(view)] = (buf, keep)
        if buf.ready is not None:
            stream.wait_event(buf.ready)
        return view

    def give(self, views: list[torch.Tensor], ready) -> None:
        """Give back the buffers under `views` (from `take`), `ready` recorded after the last copy
        queued on them."""
        with self._lock:
            for view in views:
                buf, keep = self._taken.pop(id(view))
                if keep:
                    buf.ready = ready
                    self._free.append(buf)
                else:
                    self._held -= buf.memory.numel()

    def stats(self) -> dict:
        """Bytes held now and at the peak, buffers allocated, and allocations over the limit."""
        with self._lock:
            return {
                "held_bytes": self._held,
                "peak_bytes": self._peak,
                "allocations": self._allocations,
                "overflows": self._overflows,
                "limit_bytes": self.limit,
            }


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
        self.copied_in = torch.cuda.Event(enable_timing=True)
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
            self.finished = torch.cuda.Event(enable_timing=True)
            self.finished.record(self.stream)
        if release:
            self.release()

    def release(self) -> None:
        """Give the buffers back (after `copy_out`, or when the call failed before it)."""
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

    @property
    def taken(self) -> int:
        """Gates given out so far, waiting for their slot or not."""
        with self._lock:
            return self._count

    def take(self) -> tuple[int, int]:
        """The next gate's (slot, value), once that slot's last gate has opened. The ticket is
        taken before the wait, which lets go of the lock: another caller meanwhile takes the
        next."""
        with self._lock:
            ticket, self._count = self._count, self._count + 1
            slot, value = ticket % self.slots, ticket // self.slots + 1
            self._lock.wait_for(lambda: self._opened[slot] == value - 1)
        return slot, value

    def opened(self, slot: int, value: int) -> None:
        """The gate (slot, value) opened (its word written): its slot may be given out again."""
        with self._lock:
            self._opened[slot] = value
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
