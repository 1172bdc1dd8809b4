import contextlib
import os
import signal
import subprocess
import time
import uuid

# The ranks are forked from this process: asked whether there is a GPU, torch must not
# initialize CUDA here (a forked child could not use it then), so it asks NVML instead.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402

from overcast.cluster.launch import loopback_placements, run_ranks  # noqa: E402
from overcast.cluster.netns import list_namespaces, run_owner  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--fuzz-scale", type=int, default=1,
                     help="tests/test_fuzz.py throws this many times its 170,000 messages")
    parser.addoption("--fuzz-report", help="tests/test_fuzz.py writes its tallies here (JSON)")


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def widest(text: str) -> int:
    """The longest line of a command's output, in characters (a table must fit a terminal)."""
    return max((len(line) for line in text.splitlines()), default=0)


def made_here(name: str) -> bool:
    """Whether emulated-cluster namespace `name` is this session's to answer for: its run was
    made by this process or one it started, or by one that is gone (nobody will remove it). A
    live run of another process on the machine (another suite, a soak) is not."""
    pid = run_owner(name)
    if pid is None:
        return True  # no owner on record
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent
        except (OSError, ValueError, IndexError):
            return True  # its owner is gone
    return False


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite: no namespace of ours and no child process of ours remain."""
    before = set(list_namespaces()) if os.geteuid() == 0 else set()
    yield
    if os.geteuid() == 0:
        left = {name for name in set(list_namespaces()) - before if made_here(name)}
        assert not left, f"namespaces left behind: {sorted(left)}"
    children = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "--ppid", str(os.getpid())],
                              capture_output=True, text=True).stdout.split("\n")
    alive = [c for c in children if c.strip() and " Z" not in c and "ps -o" not in c]
    assert not alive, f"child processes left behind: {alive}"


def processes_marked(mark: str) -> list[int]:
    """The processes whose environment holds `mark` (what a command started with it in its
    environment made: torchrun, its ranks, an aggregator a rank started)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark.encode() in f.read().split(b"\0"):
                    found.append(int(entry))
        except (ValueError, OSError):
            continue  # not a process, or one that has ended
    return found


def run_marked(argv: list[str], env: dict[str, str], timeout: float, cwd=None):
    """Run a command that starts processes of its own (torchrun, a framework's launcher) with
    `env` added to this one's and one compute thread each; its completed run, and the processes
    still running 5 s after it returned (found by a mark in their environment, then killed):
    one that ends on its parent's death, as an aggregator does, may take a moment to go."""
    name, mark = "OVERCAST_TEST_RUN", uuid.uuid4().hex
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **env, name: mark})
    finally:
        deadline = time.monotonic() + 5
        while (left := processes_marked(f"{name}={mark}")) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return run, left


def _integer_parameter_refusal(rank):
    """What this torch's fully_shard says to an int16 parameter (None: it shards it)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    try:
        module = nn.Module()
        module.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.int16),
                                                        requires_grad=False))
        fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
        return None
    except RuntimeError as err:
        return str(err)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def integer_parameters():
    """Skips a test with integer parameters where torch's own fully_shard refuses them (2.11
    makes every sharded parameter require gradients; 2.13 shards them)."""
    refusal = run_ranks(_integer_parameter_refusal, loopback_placements(1), timeout=60)[0]
    if refusal is not None:
        pytest.skip(f"this torch's fully_shard refuses an integer parameter: {refusal}")
