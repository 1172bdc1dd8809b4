"""What the training thread spends on communication, collective by collective.

The training thread only posts and waits; `CommTime` counts how long it spends doing each. Each
collective is also a `torch.profiler` range ("overcast AllGather blocks.1 (multicast)") from its
post to the end of its wait, so the overlap shows in the traces users already take.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

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
    # on a GPU: each staged collective's Staging (overcast.staging), its copies queued, until
    # their events are read into the seconds below
    staged: list = field(default_factory=list)
    staging_in_seconds: float = 0.0  # GPU time of the copies to the host
    staging_out_seconds: float = 0.0  # ... and back

    def read_staging(self) -> None:
        """Add up the staging copies' GPU time so far (waits for the copies still queued)."""
        for s in self.staged:
            s.finished.synchronize()
            self.staging_in_seconds += s.began.elapsed_time(s.copied_in) / 1e3
            self.staging_out_seconds += s.copying_out.elapsed_time(s.finished) / 1e3
        self.staged.clear()

    @property
    def seconds(self) -> float:
        """Posting and waiting so far."""
        return self.post_seconds + self.wait_seconds

    def as_dict(self) -> dict:
        self.read_staging()
        return {
            "post_seconds": self.post_seconds,
            "wait_seconds": self.wait_seconds,
            "staging_in_seconds": self.staging_in_seconds,
            "staging_out_seconds": self.staging_out_seconds,
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
