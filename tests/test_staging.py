"""The CUDA staging's parts that run without a GPU (overcast/staging.py, overcast/fsdp/timing.py):
the pinned pool's bookkeeping over pageable memory, the timing of the staging copies, the stream
gates' ticketing and the fenced store of their word. tests/test_cuda.py runs the rest on a GPU.

CUDA cannot run here, so these give stand-ins for a CUDA stream and events (`Stream`, `Copies`,
`Event`): they only say when the copies queued are done, and when the GPU passed an event. The
pool's memory is its own pageable allocator, counted."""

import gc
import signal
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from overcast.fsdp.timing import CommTime
from overcast.native import store_u32_fenced
from overcast.staging import ClockReference, GateTickets, MappedMemory, PinnedPool, StreamGates

MiB = 1 << 20


def until(condition, seconds: float = 10.0) -> bool:
    """Whether `condition()` came true within `seconds` (polled, as another thread changes it)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_two_threads_waiting_for_a_slot_get_different_gates():
    """With every slot of the ring held, two threads each ask for a gate: each takes its ticket
    before it waits for the slot to open, so the two never share one (which would open the
    later's gate with the earlier's collective)."""
    slots = StreamGates.SLOTS
    tickets = GateTickets(slots)
    held = [tickets.take() for _ in range(slots)]
    assert held == [(slot, 1) for slot in range(slots)]
    got: list[tuple[int, int]] = []
    threads = [threading.Thread(target=lambda: got.append(tickets.take()), daemon=True)
               for _ in range(2)]
    for t in threads:
        t.start()
    took_first = until(lambda: tickets.taken == slots + 2)
    assert all(t.is_alive() for t in threads)  # their slots are still closed
    for slot, value in held[:2]:
        tickets.opened(slot, value)
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert (took_first, sorted(got)) == (True, [(0, 2), (1, 2)])


def test_a_ticket_whose_wait_is_interrupted_does_not_close_its_slot_for_good():
    """Ctrl-C while waiting for a slot gives the ticket up: once the gate before it opens, the
    slot's next gate is given out, where it would wait for a gate that is never queued."""
    tickets = GateTickets(2)
    first, second = tickets.take(), tickets.take()
    main = threading.get_ident()
    interrupted = threading.Event()

    def once(signum, frame):  # Ctrl-C, the first time only: the interrupter may send again
        if not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt

    def interrupt_the_wait():
        while True:  # the lock is free only once the main thread waits with its ticket
            with tickets._lock:
                if tickets._count == 3:
                    break
        # A signal that lands after the main thread's last check for one and before it blocks
        # in the lock's wait is handled only once that wait ends (CPython's signal handling):
        # sent again until handled.
        while not interrupted.is_set():
            signal.pthread_kill(main, signal.SIGINT)
            interrupted.wait(0.05)

    old = signal.signal(signal.SIGINT, once)
    try:
        interrupter = threading.Thread(target=interrupt_the_wait, daemon=True)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            tickets.take()  # (0, 2), its slot closed
        interrupter.join(timeout=10)
    finally:
        signal.signal(signal.SIGINT, old)
    tickets.opened(*first)
    tickets.opened(*second)
    assert tickets.take() == (1, 2)
    got: list[tuple[int, int]] = []
    waiter = threading.Thread(target=lambda: got.append(tickets.take()), daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert got == [(0, 3)]  # (0, 2) given up counts as opened after (0, 1)


def test_a_slot_is_given_again_only_after_its_gate_opened():
    """Gates opened out of order: a thread asking for more than the ring holds waits for the
    slot it was given, not for whichever opens first."""
    tickets = GateTickets(2)
    first, second = tickets.take(), tickets.take()
    got: list[tuple[int, int]] = []
    waiter = threading.Thread(target=lambda: got.append(tickets.take()), daemon=True)
    waiter.start()
    assert until(lambda: tickets.taken == 3)
    tickets.opened(*second)  # not the slot the waiter holds
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and got == []
    tickets.opened(*first)
    waiter.join(timeout=10)
    assert got == [(0, 2)]


def test_the_gate_word_is_stored_where_asked_and_nowhere_else():
    words = np.zeros(8, dtype=np.int32)
    store_u32_fenced(words, 5, 0xFFFF_FFFF)
    store_u32_fenced(words, 0, 7)
    assert words.view(np.uint32).tolist() == [7, 0, 0, 0, 0, 0xFFFF_FFFF, 0, 0]
    with pytest.raises(IndexError):
        store_u32_fenced(words, 8, 1)
    with pytest.raises(IndexError):
        store_u32_fenced(words, -1, 1)
    with pytest.raises(IndexError):  # not aligned to a word
        store_u32_fenced(memoryview(words.view(np.uint8))[1:9], 0, 1)
    with pytest.raises(TypeError):
        store_u32_fenced(bytes(8), 0, 1)
    with pytest.raises(OverflowError):
        store_u32_fenced(words, 0, 1 << 32)
    assert words.view(np.uint32).tolist() == [7, 0, 0, 0, 0, 0xFFFF_FFFF, 0, 0]


class Copies:
    """A stand-in for a CUDA event (CUDA cannot run here): done once the test says so."""

    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


class Stream:
    """A stand-in for a CUDA stream (CUDA cannot run here): the events the pool made it wait
    for, and those it recorded on it."""

    def __init__(self):
        self.waited: list[Copies] = []
        self.recorded: list[Copies] = []

    def wait_event(self, event: Copies) -> None:
        self.waited.append(event)

    def record_event(self) -> Copies:
        self.recorded.append(Copies())
        return self.recorded[-1]


class CountedMemory(MappedMemory):
    """The pool's pageable allocator, counting the bytes allocated and not freed, what was
    freed (addresses), and each buffer (weakly); with `hold`, an allocation says it began
    (`allocating`) and waits until the test lets it go on (`resume`), as a long pinning would."""

    def __init__(self):
        self.live = 0
        self.freed: list[int] = []
        self.buffers: list[weakref.ref] = []
        self.hold = False
        self.allocating, self.resume = threading.Event(), threading.Event()
        self.counting = threading.Lock()

    def allocate(self, nbytes: int) -> torch.Tensor:
        if self.hold:
            self.allocating.set()
            assert self.resume.wait(30)
        memory = super().allocate(nbytes)
        with self.counting:  # the pool allocates and frees on its callers' threads
            self.live += nbytes
            self.buffers.append(weakref.ref(memory))
        return memory

    def free(self, memory: torch.Tensor) -> None:
        with self.counting:
            self.live -= memory.numel()
            self.freed.append(memory.data_ptr())


def test_the_pool_is_not_locked_while_it_allocates():
    """Pinning takes long: a call giving buffers back (the engine's thread) or asking for the
    pool's state does not wait for another call's allocation."""
    memory = CountedMemory()
    pool, stream = PinnedPool(64 * MiB, memory), Stream()
    first = pool.take(MiB, stream)
    memory.hold = True
    taking = threading.Thread(target=pool.take, args=(2 * MiB, stream), daemon=True)
    taking.start()
    assert memory.allocating.wait(10)
    meanwhile = threading.Thread(
        target=lambda: (pool.give([first], Copies(True)), pool.stats()), daemon=True
    )
    meanwhile.start()
    meanwhile.join(timeout=5)
    blocked = meanwhile.is_alive()
    memory.resume.set()
    taking.join(timeout=10)
    meanwhile.join(timeout=10)
    assert not blocked
    assert pool.stats()["held_bytes"] == 3 * MiB == memory.live


def test_a_buffer_over_the_limit_is_freed_once_its_last_copy_is_done():
    memory = CountedMemory()
    pool, stream = PinnedPool(2 * MiB, memory), Stream()
    views = [pool.take(MiB, stream) for _ in range(3)]  # the third is over the limit
    over = views[2].data_ptr()
    copies = Copies()
    pool.give(views, copies)
    stats = pool.stats()
    assert (stats["overflows"], stats["held_bytes"], memory.live) == (1, 3 * MiB, 3 * MiB)
    assert memory.freed == []  # its copy back is still queued
    copies.done = True
    assert pool.stats()["held_bytes"] == 2 * MiB == memory.live
    assert memory.freed == [over]
    del views
    gc.collect()
    assert [ref() is None for ref in memory.buffers] == [False, False, True]  # unmapped


def test_an_idle_buffer_in_the_way_of_a_larger_one_is_freed():
    memory = CountedMemory()
    pool, stream = PinnedPool(4 * MiB, memory), Stream()
    small = pool.take(2 * MiB, stream)
    address = small.data_ptr()
    pool.give([small], Copies(True))
    pool.give([pool.take(3 * MiB, stream)], Copies(True))
    stats = pool.stats()
    assert (stats["allocations"], stats["overflows"], stats["held_bytes"]) == (2, 0, 3 * MiB)
    assert memory.freed == [address] and memory.live == 3 * MiB


def test_an_idle_buffer_still_copied_counts_until_it_is_freed():
    """Evicted with its copy queued, it stays pinned until the copy is done, and the room it
    leaves is the new buffer's, which the pool keeps."""
    memory = CountedMemory()
    pool, stream = PinnedPool(4 * MiB, memory), Stream()
    copies = Copies()
    pool.give([pool.take(2 * MiB, stream)], copies)
    larger = pool.take(3 * MiB, stream)
    assert pool.stats()["overflows"] == 0 and memory.live == 5 * MiB
    pool.give([larger], Copies(True))
    copies.done = True
    assert pool.stats()["held_bytes"] == 3 * MiB == memory.live


def test_a_demand_over_the_room_lets_go_of_no_more_than_it_needs():
    """Idle buffers whose copies are still queued count as room once let go: a demand needing
    one buffer's room lets go of one, not of every idle buffer."""
    memory = CountedMemory()
    pool, stream = PinnedPool(4 * MiB, memory), Stream()
    copies = Copies()
    pool.give([pool.take(MiB, stream) for _ in range(3)], copies)
    pool.give([pool.take(2 * MiB, stream)], Copies(True))
    copies.done = True
    stats = pool.stats()
    assert (stats["overflows"], stats["held_bytes"], len(memory.freed)) == (0, 4 * MiB, 1)


def test_the_memory_allocated_stays_within_the_limit_whatever_the_sizes():
    """Two threads taking buffers of changing sizes, a few at a time: once their copies are
    done, what the allocator holds is what the pool counts, within the limit."""
    memory = CountedMemory()
    pool = PinnedPool(6 * MiB, memory)

    def calls(sizes):
        stream = Stream()
        for i in range(0, len(sizes), 3):
            views = [pool.take(n * MiB - 100, stream) for n in sizes[i : i + 3]]
            pool.give(views, Copies(True))

    threads = [
        threading.Thread(target=calls, args=([1, 3, 2, 5, 1, 4] * 10,)),
        threading.Thread(target=calls, args=([2, 2, 6, 1, 3, 1] * 10,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = pool.stats()
    assert stats["overflows"] > 0  # the demand went over the limit
    assert memory.live == stats["held_bytes"] <= 6 * MiB


def test_a_buffer_never_given_back_returns_once_no_tensor_is_over_it():
    """A call dropped without giving its buffer back: the buffer stays taken while any tensor
    over it lives, then returns to the pool behind what its stream had queued by then."""
    memory = CountedMemory()
    pool, stream = PinnedPool(4 * MiB, memory), Stream()
    twin = pool.take(MiB, stream).view(torch.float32)  # the view given out is gone already
    address = twin.data_ptr()
    gc.collect()
    other = pool.take(MiB, stream)  # twin's buffer is still in use
    assert pool.stats()["allocations"] == 2
    del twin
    gc.collect()
    reused = pool.take(MiB, stream)
    assert (pool.stats()["allocations"], reused.data_ptr()) == (2, address)
    assert stream.waited == stream.recorded != []  # behind the dropped call's copies
    pool.give([reused, other], Copies(True))
    assert pool.stats()["held_bytes"] == 2 * MiB == memory.live


class Event:
    """A stand-in for a CUDA timing event (CUDA cannot run here): when the GPU passes it, in ms
    on the GPU's clock, and whether it has."""

    def __init__(self, ms: float, done: bool = True):
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True  # the GPU got there

    def elapsed_time(self, other: "Event") -> float:
        return other.ms - self.ms


class Call:
    """A staged call as its timing sees it: a Staging's four events (its copy to the host from
    `at` ms to 2 ms later, back from 5 ms to 6 ms), the clock's reference (the GPU's 0 ms at
    100 s), and the CUDA tensor it holds (FSDP2's buffer)."""

    def __init__(self, at: float, output: torch.Tensor, done: bool = True):
        events = [Event(at + ms, done) for ms in (0.0, 2.0, 5.0, 6.0)]
        self.began, self.copied_in, self.copying_out, self.finished = events
        self.clock = ClockReference(Event(0.0), 100.0)
        self._outputs = {0: (output, None)}


def test_the_copies_timing_holds_no_call_and_the_events_of_copies_in_flight_only():
    """A loop that never calls stats(): the timing lets go of each call at once (its tensors
    are FSDP2's buffers) and of its events once its copies are done."""
    times = CommTime()
    output = torch.empty(1 << 10)
    held = weakref.ref(output)
    times.copies.add(Call(0.0, output))
    del output
    assert held() is None
    pending = Call(10.0, torch.empty(1), done=False)
    kept, done = weakref.ref(pending.finished), []
    times.copies.add(pending)
    del pending
    for i in range(1000):
        call = Call(20.0 + i, torch.empty(1))
        done.append(weakref.ref(call.finished))
        times.copies.add(call)
    del call
    assert kept() is not None and not any(ref() for ref in done)
    kept().done = True
    times.copies.add(Call(2000.0, torch.empty(1)))
    assert kept() is None
    stats = times.as_dict()
    assert stats["staging_in_seconds"] == pytest.approx(1003 * 0.002)
    assert stats["staging_out_seconds"] == pytest.approx(1003 * 0.001)


def test_with_spans_each_copy_is_placed_on_the_monotonic_clock():
    times = CommTime(keep_labels=True)
    times.copies.add(Call(10.0, torch.empty(1)))
    assert [(d, round(a, 6), round(b, 6)) for d, a, b in times.copies.spans] == [
        ("to host", 100.010, 100.012),
        ("to GPU", 100.015, 100.016),
    ]
