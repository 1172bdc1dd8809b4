"""Run one Python function per rank, each in its own process (and network namespace, if given).

Children are forked, so the function and its arguments need no serialisation; each child enters
its namespace with setns(2), gets torchrun-style rendezvous variables in its environment (and,
as torchrun gives them, a share of the machine's cores for its compute threads), and sends back
its return value as JSON through a pipe (never pickle). Children die with the parent
(PR_SET_PDEATHSIG) and are killed on timeout, error or Ctrl-C: nothing is left running.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


class RankError(RuntimeError):
    """One or more ranks raised, died or timed out; `failures` maps rank to what happened."""

    def __init__(self, failures: dict[int, str], results: list | None = None):
        self.failures = failures
        self.results = results or []  # what the other ranks returned (None where failed)
        lines = [
            f"rank {r}: {msg.strip().splitlines()[-1] if msg.strip() else msg}"
            for r, msg in sorted(failures.items())
        ]
        super().__init__("; ".join(lines))


@dataclass
class Placement:
    """Where rank `rank` runs: a network namespace (None: this one) and its environment."""

    netns: str | None
    env: dict[str, str]


def enter_netns(name: str) -> None:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


_threads_said = False


def compute_threads(ranks: int) -> dict[str, str]:
    """torchrun's convention for `ranks` processes sharing this machine: unless the user set
    OMP_NUM_THREADS (torch's intra-op threads), each gets the cores this process may use
    divided among them, at least 1, said once per process on stderr as torchrun says it.
    Returns the variable to add to each rank's environment ({} where the user's stands)."""
    global _threads_said
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // max(1, ranks))
    if not _threads_said:
        _threads_said = True
        print(
            f"overcast: OMP_NUM_THREADS={threads} for each of {ranks} ranks sharing {cores} "
            f"cores (set OMP_NUM_THREADS to choose)",
            file=sys.stderr,
        )
    return {"OMP_NUM_THREADS": str(threads)}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_placements(world: int, extra_env: dict[str, str] | None = None) -> list[Placement]:
    """Every rank on this host's loopback, as a single-machine torchrun would place them."""
    port, threads = free_port(), compute_threads(world)
    return [
        Placement(
            None,
            {
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **threads,
                **(extra_env or {}),
            },
        )
        for r in range(world)
    ]


def _child(fn, rank: int, placement: Placement, args, write_fd: int) -> None:
    status = 0
    try:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if placement.netns:
            enter_netns(placement.netns)
        os.environ.update(placement.env)
        torch = sys.modules.get("torch")  # imported before the fork: it read its threads then
        if torch is not None and "OMP_NUM_THREADS" in placement.env:
            torch.set_num_threads(int(placement.env["OMP_NUM_THREADS"]))
        reply = {"ok": fn(rank, *args)}
    except BaseException:
        reply = {"error": traceback.format_exc()}
        status = 1
    try:
        data = json.dumps(reply).encode()
    except (TypeError, ValueError) as err:
        data = json.dumps(
            {"error": f"rank {rank} returned a value JSON cannot carry: {err}"}
        ).encode()
        status = 1
    view = memoryview(data)
    while view:
        view = view[os.write(write_fd, view) :]
    os._exit(status)


def run_ranks(fn, placements: list[Placement], args=(), timeout: float = 600.0) -> list:
    """Call fn(rank, *args) in one forked process per placement; return their results in rank
    order, or raise RankError naming every rank that failed (the others are killed)."""
    procs: dict[int, tuple[int, int]] = {}
    outputs: dict[int, bytearray] = {}
    try:
        for rank, placement in enumerate(placements):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                for _, earlier in procs.values():  # the other ranks' pipes are not its own
                    os.close(earlier)
                _child(fn, rank, placement, args, write_fd)
            os.close(write_fd)
            procs[rank] = (pid, read_fd)
            outputs[rank] = bytearray()
        return _collect(procs, outputs, timeout)
    finally:
        for pid, read_fd in procs.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            os.close(read_fd)


def _collect(procs, outputs, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    open_fds = {read_fd: rank for rank, (_, read_fd) in procs.items()}
    failures: dict[int, str] = {}
    with selectors.DefaultSelector() as sel:
        for fd in open_fds:
            sel.register(fd, selectors.EVENT_READ)
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                for rank in open_fds.values():
                    failures[rank] = f"still running after {timeout:.0f} s; killed"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    outputs[open_fds[key.fd]] += chunk
                else:
                    sel.unregister(key.fd)
                    del open_fds[key.fd]
    results: list[Any] = []  # each rank's return value, None where it failed
    for rank in sorted(procs):
        if rank in failures:
            results.append(None)
            continue
        try:
            reply = json.loads(outputs[rank])
        except ValueError:
            failures[rank] = "exited without a result (killed or crashed)"
            results.append(None)
            continue
        if "error" in reply:
            failures[rank] = reply["error"]
            results.append(None)
        else:
            results.append(reply["ok"])
    if failures:
        raise RankError(failures, results)
    return results
