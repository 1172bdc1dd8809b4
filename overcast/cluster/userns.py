"""Running the emulated cluster without root, inside an unprivileged user namespace.

Where the kernel allows unprivileged user namespaces, a process may become root of its own user
namespace and there create network namespaces, veth links, bridges and tc qdiscs, all owned by
it and invisible to the rest of the machine. `ip netns` keeps its namespaces under /run/netns,
which an unprivileged user cannot write: a private mount namespace with its own /run solves that.
The CLI re-executes itself this way when it is not root.
"""

from __future__ import annotations

import os
import shutil
import sys

MARKER = "OVERCAST_IN_USER_NAMESPACE"


def available() -> bool:
    if shutil.which("unshare") is None:
        return False
    for path, minimum in (
        ("/proc/sys/kernel/unprivileged_userns_clone", 1),
        ("/proc/sys/user/max_user_namespaces", 1),
    ):
        try:
            with open(path) as f:
                if int(f.read().strip()) < minimum:
                    return False
        except (OSError, ValueError):
            continue  # the knob does not exist on this kernel: no restriction from it
    return True


def command(argv: list[str]) -> list[str]:
    """`argv` (arguments to this Python) run as root of a fresh user, network and mount
    namespace with a private /run."""
    script = 'mount -t tmpfs overcast /run && exec "$@"'
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--net",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        sys.executable,
        *argv,
    ]


def reexec(argv: list[str]) -> None:
    """Replace this process by command(argv) unless it is root already. Returns only if that
    is not needed or not possible here."""
    if os.geteuid() == 0 or os.environ.get(MARKER) or not available():
        return
    os.environ[MARKER] = "1"
    os.execvp("unshare", command(argv))
