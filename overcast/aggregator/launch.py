"""Start `overcast aggregator` as a child process and learn where it listens.

One way to start it serves both the emulated cluster (inside the service namespace, through a
command prefix such as `ip netns exec NS`) and a job that names no aggregator (rank 0 starts one
beside itself). The child lives as long as the process that started it, whichever thread did:
it watches a pipe (its lifeline) whose only writer is that process, and exits when the pipe
closes. PR_SET_PDEATHSIG would tie it to the starting thread instead, and a preexec_fn is unsafe
once threads exist.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time

from overcast.errors import OvercastError

START_SECONDS = 30.0  # how long the aggregator may take to say where it listens


class AggregatorStartError(OvercastError):
    """The aggregator process did not come up; the message has its first line of output."""


class AggregatorProcess(subprocess.Popen):
    """The aggregator's process. `lifeline` is the write end of the pipe it watches; closing it
    (stop_aggregator, or this process ending) makes the aggregator exit."""

    lifeline: int = -1
    aggregator: int = 0  # on the emulated cluster, the attachment it runs on


def _first_line(proc: subprocess.Popen, seconds: float) -> str:
    """The child's first line of output, or what it wrote before it exited or `seconds` passed."""
    deadline = time.monotonic() + seconds
    data = b""
    assert proc.stdout is not None  # start_aggregator's pipe
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def start_aggregator(
    host: str,
    port: int = 0,
    *,
    secrets: list[str],
    slots: int = 256,
    stats_path: str | None = None,
    prefix: tuple[str, ...] = (),
    start_seconds: float = START_SECONDS,
    limits=None,
    shards: int | None = None,
) -> tuple[AggregatorProcess, str]:
    """Start the aggregator for the jobs whose secrets (hex) are given, listening on
    `host`:`port` (0: any free port) with `shards` data-path threads (None: its default, the
    cores it may use), within `limits` (overcast.aggregator.service.Limits; default its own);
    return the process and its "host:port" once it listens, within `start_seconds`."""
    watched, lifeline = os.pipe()
    argv = [
        *prefix,
        sys.executable,
        "-m",
        "overcast.cli.main",
        "aggregator",
        "--host",
        host,
        "--port",
        str(port),
        "--slots",
        str(slots),
        "--lifeline",
        str(watched),
    ]
    if shards is not None:
        argv += ["--shards", str(shards)]
    if stats_path:
        argv += ["--stats", stats_path]
    if limits is not None:
        argv += [
            "--max-world",
            str(limits.max_world),
            "--max-communicators",
            str(limits.max_communicators),
            "--pool-bytes",
            str(limits.pool_bytes),
        ]
    full_env = {**os.environ, "OVERCAST_SECRETS": ",".join(secrets)}
    try:
        proc = AggregatorProcess(argv, env=full_env, stdout=subprocess.PIPE, pass_fds=(watched,))
    except BaseException:
        os.close(lifeline)
        raise
    finally:
        os.close(watched)
    proc.lifeline = lifeline
    line = _first_line(proc, start_seconds)
    if "listening on" not in line:
        stop_aggregator(proc, timeout=0)
        raise AggregatorStartError(
            f"the aggregator did not start within {start_seconds:.0f} s: "
            f"{line.strip() or 'no output'}"
        )
    address = line.split("listening on", 1)[1].split()[0]
    return proc, address


def stop_aggregator(proc: AggregatorProcess, timeout: float = 30.0) -> None:
    """Stop the aggregator gracefully (it writes its stats file on the way out); killed after
    `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.lifeline >= 0:
        os.close(proc.lifeline)
        proc.lifeline = -1
    if proc.stdout:
        proc.stdout.close()
