"""What the training thread spends on communication, collective by collective.

The training thread only posts and waits; `CommTime` counts how long it spends doing each. Each
collective is also a `torch.profiler` range ("overcast AllGather blocks.1 (multicast)") from its
post to the end of its wait, so the overlap shows in the traces users already take.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch.autograd.profiler import record_function


def thread_clock() -> tuple[float, float]:
    """The calling thread's (CPU seconds, seconds it waited runnable for a CPU). The wait is
    the kernel's run delay, which it keeps with kernel.task_delayacct=1 or schedstats on, and
    reads 0 otherwise. (The CPU comes from the thread's clock: the schedstat runtime of a
    running thread lags by up to a tick.)"""
    cpu = time.thread_time()
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        try:
            waited = int(os.read(fd, 64).split()[1])
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return cpu, 0.0
    return cpu, waited / 1e9


class _Copies(NamedTuple):
    """One staged call's four events, and where its device's clock stands (with spans)."""

    began: Any
    copied_in: Any
    copying_out: Any
    finished: Any
    clock: Any  # a ClockReference (overcast.staging), or None


class StagingTimes:
    """The GPU time of the staging copies to the host and back, on a GPU, read from each staged
    call's CUDA events as they complete. It keeps a call's events only, never the call (whose
    tensors are FSDP2's buffers), and only until its copies are done: each call added reads
    those done by then, so what it holds is what is in flight, whether or not anyone reads it.
    With `keep_spans`, each copy's span too. Not thread-safe, as CommTime is not: FSDP2's hooks
    and stats() take turns."""

    def __init__(self, keep_spans: bool = False):
        self.keep_spans = keep_spans
        self.in_seconds = 0.0  # GPU time of the copies to the host
        self.out_seconds = 0.0  # ... and back
        # with keep_spans: ("to host" or "to GPU", start, end) per copy, time.monotonic()
        # seconds (the engine traces' clock)
        self.spans: list[tuple[str, float, float]] = []
        self._queued: list[_Copies] = []

    def add(self, staged) -> None:
        """Time the copies of `staged` (a Staging, its copies back queued: anything with the
        events `began`, `copied_in`, `copying_out` and `finished` and, with `keep_spans`, a
        `clock`), and count those of every call done by now."""
        clock = staged.clock if self.keep_spans else None
        events = (staged.began, staged.copied_in, staged.copying_out, staged.finished)
        self._queued.append(_Copies(*events, clock))
        self.read(wait=False)

    def read(self, wait: bool = True) -> None:
        """Count the copies that are done; with `wait`, wait for the rest first."""
        queued, self._queued = self._queued, []
        for copies in queued:
            if wait:
                copies.finished.synchronize()
            elif not copies.finished.query():  # the others are before it on its stream
                self._queued.append(copies)
                continue
            self._count(copies)

    def _count(self, copies: _Copies) -> None:
        self.in_seconds += copies.began.elapsed_time(copies.copied_in) / 1e3
        self.out_seconds += copies.copying_out.elapsed_time(copies.finished) / 1e3
        if copies.clock is not None:
            clock = copies.clock

            def at(event) -> float:
                return clock.seconds + clock.event.elapsed_time(event) / 1e3

            self.spans.append(("to host", at(copies.began), at(copies.copied_in)))
            self.spans.append(("to GPU", at(copies.copying_out), at(copies.finished)))


@dataclass
class CommTime:
    """What the training thread spent on communication, and which collective was which."""

    post_seconds: float = 0.0  # inside the hooks, handing collectives to the engine
    wait_seconds: float = 0.0  # blocked until a collective finished
    thread_cpu_seconds: float = 0.0  # CPU time of the training thread in both
    run_delay_seconds: float = 0.0  # ... and the time it waited for a CPU in both
    allgathers: int = 0
    reduce_scatters: int = 0
    keep_labels: bool = False  # only for timelines: one entry per collective
    labels: dict[int, str] = field(default_factory=dict)  # collective seq -> "AG blocks.3"
    # with keep_labels: (kind "AG"/"RS", label, posted, waited) per collective, perf_counter
    # seconds; the time each was in flight as the training thread saw it, either backend
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    # on a GPU: the staging copies' GPU time (with keep_labels, their spans)
    copies: StagingTimes = field(init=False)

    def __post_init__(self):
        self.copies = StagingTimes(keep_spans=self.keep_labels)

    @property
    def seconds(self) -> float:
        """Posting and waiting so far."""
        return self.post_seconds + self.wait_seconds

    def as_dict(self) -> dict:
        self.copies.read()
        return {
            "post_seconds": self.post_seconds,
            "wait_seconds": self.wait_seconds,
            "staging_in_seconds": self.copies.in_seconds,
            "staging_out_seconds": self.copies.out_seconds,
            "thread_cpu_seconds": self.thread_cpu_seconds,
            "run_delay_seconds": self.run_delay_seconds,
            "allgathers": self.allgathers,
            "reduce_scatters": self.reduce_scatters,
        }


class Clock:
    """Times one stretch of the training thread into `CommTime`."""

    def __init__(self, times: CommTime, what: str):
        self.times, self.what = times, what

    def __enter__(self):
        self.t0, (self.cpu0, self.delay0) = time.perf_counter(), thread_clock()

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self.t0
        if self.what == "post":
            self.times.post_seconds += seconds
        else:
            self.times.wait_seconds += seconds
        cpu, delay = thread_clock()
        self.times.thread_cpu_seconds += cpu - self.cpu0
        self.times.run_delay_seconds += delay - self.delay0


class InFlight:
    """One collective from post to the end of its wait: a profiler range, and a span in
    `CommTime` if it keeps them."""

    def __init__(self, times: CommTime, kind: str, label: str, name: str):
        self.times, self.kind, self.label = times, kind, label
        self.range: record_function | None = record_function(name)  # None once ended
        self.range.__enter__()
        self.posted = time.perf_counter()

    def end(self) -> None:
        if self.range is None:
            return
        self.range.__exit__(None, None, None)
        self.range = None
        if self.times.keep_labels:
            self.times.spans.append((self.kind, self.label, self.posted, time.perf_counter()))
