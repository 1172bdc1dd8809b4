"""What a training thread waited behind while it waited for a CPU: a trace of the scheduler.

On the emulated cluster every host's training thread, the ranks' communication threads, the
aggregator and the kernel's network share the machine's cores. The kernel's run delay says how
long a training thread was runnable but not running; this says what the cores ran meanwhile.

The trace is a tracefs instance of its own (so it neither disturbs nor is disturbed by other
tracing): `sched_switch`, `sched_wakeup` and the softirq entries and exits, stamped with
CLOCK_MONOTONIC, the clock the ranks read with `time.monotonic()`, and each task's process id
recorded. It needs root. Where tracefs is not mounted, `mount_tracefs` mounts it at its usual
place and leaves it there, as trace-cmd does; where that fails, or `SchedTrace.start` does, they
say why and nothing is attributed. A training thread waits from its wake-up (or from being
preempted) until it is switched in; every slice of that wait is shared among the cores, each
core's share going to what it ran: another host's training thread, a communication thread of a
rank (overcast's engine or gloo's), the aggregator, the kernel's network (softirq), nothing (a
core idle while the thread waited: the latency of its wake-up), or anything else.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

TRACEFS = "/sys/kernel/tracing"
EVENTS = ("sched/sched_switch", "sched/sched_wakeup", "irq/softirq_entry", "irq/softirq_exit")
BUFFER_KB_PER_CPU = 32768  # a minute of a 4-host way's events, with room to spare

# what a core ran while a training thread waited for one
TRAINING = "other hosts' training"
COMMUNICATION = "communication threads"
AGGREGATOR = "aggregator"
NETWORK = "kernel network"
IDLE = "wake-up latency"
OTHER = "other"
CATEGORIES = (TRAINING, COMMUNICATION, AGGREGATOR, NETWORK, IDLE, OTHER)

_LINE = re.compile(r"\s*.+?-(\d+)\s+\(\s*([-\d]+)\)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(\w+):\s+(.*)")
_FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass
class Event:
    seconds: float
    cpu: int
    task: int  # the thread on the core when the event was recorded (0: the core was idle)
    kind: str
    fields: dict


def parse(text: str) -> tuple[list[Event], dict[int, int]]:
    """A tracefs `trace` file's events, in time order, and each recorded task's process id."""
    events, tgid = [], {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        if m[2] != "-------":
            tgid[int(m[1])] = int(m[2])
        fields = dict(_FIELD.findall(m[6]))
        if m[5] == "softirq_entry":  # "vec=3 [action=NET_RX]"
            fields["action"] = fields.get("action", "").rstrip("]")
        events.append(Event(float(m[4]), int(m[3]), int(m[1]), m[5], fields))
    return events, tgid


def attribute(
    events: list[Event],
    tgid: dict[int, int],
    cpus: int,
    windows: dict[int, list[tuple[float, float]]],
    ranks: set[int],
    aggregator: int | None,
) -> dict[tuple[int, int], dict[str, float]]:
    """Each training thread's waits within its windows (`windows`: its tid -> time windows,
    sorted), shared among what the `cpus` cores ran: {(tid, window index): {category: seconds}};
    `ranks` are the rank processes' ids, `aggregator` its process's."""
    training = set(windows)
    out: dict[tuple[int, int], dict[str, float]] = {}
    running: dict[int, int] = {}  # core -> tid on it
    softirq: dict[int, str] = {}  # core -> softirq in progress
    waiting: set[int] = set()
    cursor = dict.fromkeys(training, 0)

    def occupant(core: int) -> str:
        action = softirq.get(core)
        if action:
            return NETWORK if action.startswith("NET") else OTHER
        tid = running.get(core, 0)
        if tid == 0:
            return IDLE
        if tid in training:
            return TRAINING
        pid = tgid.get(tid)
        if pid in ranks:
            return COMMUNICATION
        return AGGREGATOR if aggregator is not None and pid == aggregator else OTHER

    previous = None
    for e in events:
        if previous is not None and waiting and e.seconds > previous:
            shares: dict[str, float] = {}
            for core in range(cpus):
                name = occupant(core)
                shares[name] = shares.get(name, 0.0) + 1.0 / cpus
            for tid in waiting:
                spans, i = windows[tid], cursor[tid]
                while i < len(spans) and spans[i][1] <= previous:
                    i += 1
                cursor[tid] = i
                for k in range(i, len(spans)):
                    if spans[k][0] >= e.seconds:
                        break
                    lo, hi = max(previous, spans[k][0]), min(e.seconds, spans[k][1])
                    if hi > lo:
                        slot = out.setdefault((tid, k), dict.fromkeys(CATEGORIES, 0.0))
                        for name, share in shares.items():
                            slot[name] += (hi - lo) * share
        previous = e.seconds
        if e.kind != "sched_switch":  # whatever recorded it is on that core
            running[e.cpu] = e.task
            waiting.discard(e.task)
        if e.kind == "sched_wakeup":
            tid, target = int(e.fields.get("pid", -1)), int(e.fields.get("target_cpu", -1))
            if running.get(target, 0) == 0:
                # An idle core takes the thread it was woken for at once. (Some kernels record
                # no switch away from a core's idle task: this is the only sign of it.)
                running[target] = tid
                waiting.discard(tid)
            elif tid in training and tid not in running.values():
                waiting.add(tid)
        elif e.kind == "sched_switch":
            prev, nxt = int(e.fields["prev_pid"]), int(e.fields["next_pid"])
            running[e.cpu] = nxt
            waiting.discard(nxt)
            waiting.discard(prev)  # it was running until now (whatever brought it on)
            if prev in training and e.fields.get("prev_state", "").startswith("R"):
                waiting.add(prev)  # preempted: still runnable
        elif e.kind == "softirq_entry":
            softirq[e.cpu] = e.fields["action"]
        elif e.kind == "softirq_exit":
            softirq.pop(e.cpu, None)
    return out


def mount_tracefs() -> str | None:
    """Mount tracefs at its usual place if it is not there (minimal machines boot without it;
    most mount it there at boot) and leave it mounted, as trace-cmd does: unmounting it could
    pull it from under another run's trace. None once it is there, else why it is not."""
    if os.path.isdir(os.path.join(TRACEFS, "instances")):
        return None
    if os.geteuid() != 0:
        return "no scheduler trace (tracefs is not mounted, and mounting it needs root)"
    try:
        done = subprocess.run(
            ["mount", "-t", "tracefs", "tracefs", TRACEFS], capture_output=True, text=True
        )
    except OSError as e:
        return f"no scheduler trace (mount: {e.strerror})"
    if done.returncode:
        said = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return f"no scheduler trace ({said[0]})"
    return None


def _remove_orphans() -> None:
    """Instances left by overcast processes that are gone (killed before they could close)."""
    folder = os.path.join(TRACEFS, "instances")
    for name in os.listdir(folder):
        pid = name.removeprefix("overcast-")
        if pid != name and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            os.rmdir(os.path.join(folder, name))


class SchedTrace:
    """A tracefs instance recording the scheduler between `start` and `stop`; removed by
    `close` (also on an exception or Ctrl-C when used as a context manager)."""

    def __init__(self):
        self.path = os.path.join(TRACEFS, "instances", f"overcast-{os.getpid()}")
        self.unavailable: str | None = None
        self.overrun = 0

    def _write(self, relative: str, value: str) -> None:
        with open(os.path.join(self.path, relative), "w") as f:
            f.write(value)

    def start(self) -> bool:
        """Begin recording; False (with `unavailable` saying why) where this process may not."""
        try:
            _remove_orphans()
            os.mkdir(self.path)
            self._write("trace_clock", "mono")
            self._write("options/record-tgid", "1")
            self._write("buffer_size_kb", str(BUFFER_KB_PER_CPU))
            for event in EVENTS:
                self._write(f"events/{event}/enable", "1")
            self._write("tracing_on", "1")
        except OSError as e:
            self.unavailable = f"no scheduler trace ({e.strerror}: {e.filename})"
            self.close()
            return False
        return True

    def stop(self) -> str:
        """Stop recording; the trace's text (its events come out merged in time order)."""
        self._write("tracing_on", "0")
        self.overrun = 0
        for cpu in os.listdir(os.path.join(self.path, "per_cpu")):
            with open(os.path.join(self.path, "per_cpu", cpu, "stats")) as f:
                for line in f:
                    if line.startswith("overrun:"):
                        self.overrun += int(line.split()[1])
        with open(os.path.join(self.path, "trace")) as f:
            return f.read()

    def close(self) -> None:
        if not os.path.isdir(self.path):
            return
        try:
            self._write("tracing_on", "0")
            for event in EVENTS:
                self._write(f"events/{event}/enable", "0")
        except OSError:
            pass
        os.rmdir(self.path)  # tracefs removes an instance's files with its folder

    def __enter__(self) -> SchedTrace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
