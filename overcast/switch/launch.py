"""Start `overcast switch` (the aggregator) as a child process and learn where it listens.

One way to start it serves both the emulated cluster (inside the service namespace, through a
command prefix such as `ip netns exec NS`) and a job that names no aggregator (rank 0 starts one
beside itself). The child dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from overcast.errors import OvercastError


class SwitchStartError(OvercastError):
    """The aggregator process did not come up; the message has its first line of output."""


_prctl = ctypes.CDLL(None).prctl  # looked up here: the forked child must not dlopen


def _die_with_parent() -> None:
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_switch(host: str, port: int = 0, *, secrets: list[str], slots: int = 256,
                 stats_path: str | None = None,
                 prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Start the aggregator for the jobs whose secrets (hex) are given, listening on
    `host`:`port` (0: any free port); return the process and its "host:port" once it listens."""
    argv = [*prefix, sys.executable, "-m", "overcast.cli.main", "switch", "--host", host,
            "--port", str(port), "--slots", str(slots)]
    if stats_path:
        argv += ["--stats", stats_path]
    full_env = {**os.environ, "OVERCAST_SECRETS": ",".join(secrets)}
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, text=True,
                            preexec_fn=_die_with_parent)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise SwitchStartError(f"the aggregator did not start: {line.strip() or 'no output'}")
    address = line.split("listening on", 1)[1].split()[0]
    return proc, address


def stop_switch(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop the aggregator gracefully (it writes its stats file on the way out)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()
