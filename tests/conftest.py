import os
import subprocess

import pytest

from overcast.cluster.netns import list_namespaces

def pytest_addoption(parser):
    parser.addoption("--fuzz-scale", type=int, default=1,
                     help="tests/test_fuzz.py throws this many times its 170,000 messages")
    parser.addoption("--fuzz-report", help="tests/test_fuzz.py writes its tallies here (JSON)")


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite: no namespace of ours and no child process of ours remain."""
    before = set(list_namespaces()) if os.geteuid() == 0 else set()
    yield
    if os.geteuid() == 0:
        left = set(list_namespaces()) - before
        assert not left, f"namespaces left behind: {sorted(left)}"
    children = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "--ppid", str(os.getpid())],
                              capture_output=True, text=True).stdout.split("\n")
    alive = [c for c in children if c.strip() and " Z" not in c and "ps -o" not in c]
    assert not alive, f"child processes left behind: {alive}"
