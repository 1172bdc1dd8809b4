"""The CUDA staging's parts that run without a GPU (overcast/staging.py): the stream gates'
ticketing and the fenced store of their word. tests/test_cuda.py runs the rest on a GPU."""

import threading
import time

import numpy as np
import pytest

from overcast.native import store_u32_fenced
from overcast.staging import GateTickets, StreamGates


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
    threads = [threading.Thread(target=lambda: got.append(tickets.take()), daemon=True) for _ in range(2)]
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
