"""What a training thread waited behind: the scheduler trace's parser and its attribution on a
trace written out by hand, and the tracefs instance on this machine."""

import os

import pytest

from conftest import root_only
from overcast.train.waits import (AGGREGATOR, CATEGORIES, COMMUNICATION, IDLE, NETWORK, OTHER,
                                  TRACEFS, TRAINING, SchedTrace, attribute, mount_tracefs,
                                  parse)

HEADER = """# tracer: nop
#
# entries-in-buffer/entries-written: 20/20   #P:2
#
#           TASK-PID       TGID    CPU#  |||||  TIMESTAMP  FUNCTION
#              | |           |       |   |||||     |         |
"""


def line(task: str, tid: int, tgid: int | None, cpu: int, seconds: float, event: str) -> str:
    group = f"{tgid:7d}" if tgid is not None else "-------"
    return f"{task:>16}-{tid:<7d} ({group}) [{cpu:03d}] d..2. {seconds:.6f}: {event}"


def switch(prev: str, prev_pid: int, state: str, nxt: str, next_pid: int) -> str:
    return (f"sched_switch: prev_comm={prev} prev_pid={prev_pid} prev_prio=120 "
            f"prev_state={state} ==> next_comm={nxt} next_pid={next_pid} next_prio=120")


def wakeup(comm: str, pid: int, cpu: int) -> str:
    return f"sched_wakeup: comm={comm} pid={pid} prio=120 target_cpu={cpu:03d}"


# Two hosts' training threads (101, 201), host 1's engine thread (102), the aggregator (300).
TRACE = HEADER + "\n".join([
    line("<idle>", 0, None, 0, 1.000, switch("swapper/0", 0, "R", "python", 101)),
    line("python", 201, 201, 1, 1.000, wakeup("python", 201, 1)),
    # 101 preempted by its engine thread while 201 trains on the other core, which also runs
    # the network's softirq for 2 ms: 10 ms of waiting, 5 behind the engine, 4 behind the other
    # host's training, 1 behind the network
    line("python", 101, 101, 0, 1.010, switch("python", 101, "R+", "engine", 102)),
    line("python", 201, 201, 1, 1.014, "softirq_entry: vec=3 [action=NET_RX]"),
    line("python", 201, 201, 1, 1.016, "softirq_exit: vec=3 [action=NET_RX]"),
    line("engine", 102, 101, 0, 1.020, switch("engine", 102, "S", "python", 101)),
    # 101 sleeps; woken onto its idle core, it runs at once, though this kernel recorded no
    # switch away from the idle task (only its switch out, 5 ms later): no waiting
    line("python", 101, 101, 0, 1.030, switch("python", 101, "S", "swapper/0", 0)),
    line("python", 201, 201, 1, 1.040, wakeup("python", 101, 0)),
    line("python", 101, 101, 0, 1.045, switch("python", 101, "S", "swapper/0", 0)),
    # the aggregator takes core 0; 101 is woken for it while 201 holds core 1: 6 ms of
    # waiting, shared between them, 2 ms of it in the first window and 4 in the second
    line("<idle>", 0, None, 0, 1.048, switch("swapper/0", 0, "R", "python", 300)),
    line("python", 201, 201, 1, 1.050, wakeup("python", 101, 0)),
    line("python", 300, 300, 0, 1.056, switch("python", 300, "S", "python", 101)),
    # a kernel thread on core 0 while core 1 idles: 1 ms behind it and 1 ms of wake-up latency
    line("python", 201, 201, 1, 1.060, switch("python", 201, "S", "swapper/1", 0)),
    line("python", 101, 101, 0, 1.070, switch("python", 101, "R", "kworker/0:1", 7)),
    line("kworker/0:1", 7, 7, 0, 1.072, switch("kworker/0:1", 7, "S", "python", 101)),
]) + "\n"


def test_a_trace_is_parsed_with_each_task_and_its_process():
    events, tgid = parse(TRACE)
    assert len(events) == 15
    assert [e.kind for e in events[:4]] == ["sched_switch", "sched_wakeup", "sched_switch",
                                            "softirq_entry"]
    assert (events[0].seconds, events[0].cpu, events[0].task) == (1.0, 0, 0)
    assert events[3].fields["action"] == "NET_RX"
    assert events[2].fields["prev_state"] == "R+" and events[2].fields["next_pid"] == "102"
    assert tgid == {201: 201, 101: 101, 102: 101, 300: 300, 7: 7}  # no process for idle


def test_each_slice_of_waiting_is_shared_among_what_the_cores_ran():
    events, tgid = parse(TRACE)
    waits = attribute(events, tgid, 2, {101: [(1.0, 1.052), (1.052, 1.1)], 201: [(1.0, 1.1)]},
                      ranks={101, 201}, aggregator=300)
    first, second = waits[(101, 0)], waits[(101, 1)]
    expected_first = {COMMUNICATION: 0.005, TRAINING: 0.004 + 0.001, NETWORK: 0.001,
                      AGGREGATOR: 0.001}
    expected_second = {AGGREGATOR: 0.002, TRAINING: 0.002, OTHER: 0.001, IDLE: 0.001}
    for got, expected in ((first, expected_first), (second, expected_second)):
        assert set(got) == set(CATEGORIES)
        for name in CATEGORIES:
            assert got[name] == pytest.approx(expected.get(name, 0.0), abs=1e-9), name
    assert (201, 0) not in waits  # it never waited


def test_waits_outside_every_window_are_not_counted():
    events, tgid = parse(TRACE)
    waits = attribute(events, tgid, 2, {101: [(1.021, 1.049)]}, ranks={101}, aggregator=None)
    assert waits == {}


@root_only
def test_the_trace_records_this_machine_and_leaves_nothing_behind():
    """A real trace of a thread woken on this machine, with tracefs mounted for it where the
    machine had not; the instance goes on close, and on an exception; one left by a process that
    is gone is removed by the next start."""
    if "tracefs" not in open("/proc/filesystems").read():
        pytest.skip("no tracefs in this kernel")
    why = mount_tracefs()
    if why is not None:  # a container or user namespace may refuse root the mount
        pytest.skip(why)
    orphan = os.path.join(TRACEFS, "instances", "overcast-999999999")
    os.mkdir(orphan)
    with SchedTrace() as trace:
        assert trace.start(), trace.unavailable
        assert not os.path.exists(orphan)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        events, tgid = parse(trace.stop())
    assert not os.path.exists(trace.path)
    assert trace.overrun == 0
    assert any(e.kind == "sched_switch" and e.fields["prev_pid"] == str(pid) for e in events)
    assert any(e.kind == "sched_wakeup" for e in events)
    assert tgid.get(pid) == pid
    with pytest.raises(RuntimeError):
        with SchedTrace() as trace:
            assert trace.start()
            raise RuntimeError
    assert not os.path.exists(trace.path)
