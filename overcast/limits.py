"""The settings users give, checked alike on the command line and in the Python API.

Each check raises InvalidArgumentError (a ValueError) in one line: what must hold, the value
given, and the names it goes by (the flag, then the keyword). The commands run them before
anything is built; `Cluster`, `Communicator`, `LossSpec`, the aggregator and `run_bench` run the
same ones, so a script gets the words a shell user gets.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

from overcast.errors import InvalidArgumentError
from overcast.wire.header import IP_UDP_BYTES, MAX_PAYLOAD, MAX_STRIPES, OVERHEAD_BYTES
from overcast.wire.messages import CONTRIB_PREFIX

# 198.18.0.0/16 less the switch's and the service's addresses
MAX_HOSTS = 65279
# One 8-byte element of an in-network contribution, after its prefix, in one datagram, whose
# payload is cut to a multiple of 8 bytes (transport.datagram.chunk_bytes).
LOWEST_MTU = IP_UDP_BYTES + OVERHEAD_BYTES + -(-(CONTRIB_PREFIX.size + 8) // 8) * 8
MAX_SLOTS = 65535


def require(ok: bool, what: str, allowed: str, value, names: str) -> None:
    if not ok:
        raise InvalidArgumentError(
            f"{what} must be {allowed}, not {value:g} ({names})"
            if isinstance(value, float)
            else f"{what} must be {allowed}, not {value} ({names})"
        )


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_hosts(hosts: int, least: int = 2) -> None:
    require(
        _whole(hosts) and least <= hosts <= MAX_HOSTS,
        "the number of hosts",
        f"between {least} and {MAX_HOSTS}",
        hosts,
        "--hosts, hosts",
    )


def check_link_rate(bits_per_s: float, names: str = "--link-mbit, link_bits_per_s / 1e6") -> None:
    require(
        math.isfinite(bits_per_s) and bits_per_s > 0,
        "the link rate",
        "above 0 Mbit/s",
        bits_per_s / 1e6,
        names,
    )


def check_aggregators(aggregators: int, most: int) -> None:
    require(
        _whole(aggregators) and 1 <= aggregators <= most,
        "the number of aggregators",
        f"between 1 and {most}",
        aggregators,
        "--aggregators, aggregators",
    )


def check_count(what: str, value: int, least: int, names: str) -> None:
    require(_whole(value) and value >= least, what, f"{least} or more", value, names)


def check_shards(shards: int, aggregators: int = 1) -> None:
    """An aggregator's shards; all the aggregators' together are the job's endpoints."""
    require(
        _whole(shards) and shards >= 1 and shards * aggregators <= MAX_STRIPES,
        "the shards per aggregator",
        f"1 to {MAX_STRIPES // aggregators} (a job stripes over at most {MAX_STRIPES} endpoints)",
        shards,
        "--shards, shards",
    )


def check_loss(rate: float, burst: float) -> None:
    require(
        0 <= rate < 1,
        "the loss rate",
        "a fraction from 0 up to (not including) 1",
        rate,
        "--loss, loss",
    )
    require(
        1 <= burst < math.inf,
        "the mean loss burst",
        "1 or more datagrams",
        burst,
        "--loss-burst, loss_burst",
    )


def check_mtu(mtu: int) -> None:
    require(
        _whole(mtu) and LOWEST_MTU <= mtu <= 65535,
        "the MTU",
        f"between {LOWEST_MTU} (the smallest that carries a chunk) and 65535",
        mtu,
        "--mtu, mtu",
    )


def check_frame_bytes(frame_bytes: int) -> None:
    """A ring frame's payload: a frame is sealed and opened whole."""
    require(
        _whole(frame_bytes) and 8 <= frame_bytes <= MAX_PAYLOAD,
        "the ring frame size",
        f"between 8 and {MAX_PAYLOAD} (the largest payload a frame carries)",
        frame_bytes,
        "frame_bytes",
    )


def check_roots(roots: int | None, hosts: int) -> None:
    """None means every rank."""
    require(
        roots is None or (_whole(roots) and 1 <= roots <= hosts),
        "the multicast roots",
        f"'all' or between 1 and the number of ranks ({hosts})",
        roots,
        "--roots, roots",
    )


def check_slots(slots: int) -> None:
    require(
        _whole(slots) and 1 <= slots <= MAX_SLOTS,
        "the aggregator's slots",
        f"between 1 and {MAX_SLOTS}",
        slots,
        "--slots, slots",
    )


def check_port(port: int) -> None:
    require(
        _whole(port) and 0 <= port <= 65535,
        "the port",
        "between 0 (any free port) and 65535",
        port,
        "--port, port",
    )


def check_size(nbytes: int) -> None:
    require(_whole(nbytes) and nbytes >= 1, "a size", "1 byte or more", nbytes, "--sizes, sizes")


def check_positive(what: str, value: float, names: str, unit: str = "") -> None:
    require(math.isfinite(value) and value > 0, what, f"above 0{unit}", value, names)


def check_algorithms(collectives, algorithms, table: dict) -> None:
    """Every collective named is in `table` and every algorithm runs one of them."""
    for c in collectives:
        if c not in table:
            raise InvalidArgumentError(f"unknown collective {c!r}; available: {', '.join(table)}")
    unknown = set(algorithms) - {a for c in collectives for a in table[c]}
    if unknown:
        known = "; ".join(f"{c}: {', '.join(table[c])}" for c in collectives)
        raise InvalidArgumentError(
            f"no algorithm {', '.join(sorted(unknown))} for "
            f"{', '.join(collectives)} (available: {known})"
        )


def _from_env(name: str, default, parse, fits, what: str):
    """The value the environment variable `name` gives, parsed and checked, or `default`."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not fits(value):
        raise InvalidArgumentError(f"{name}={text!r} is not {what}")
    return value


def seconds_from_env(name: str, default: float) -> float:
    """A number of seconds the environment variable `name` gives (above 0), or `default`."""
    return _from_env(
        name, default, float, lambda v: math.isfinite(v) and v > 0, "a number of seconds above 0"
    )


def bytes_from_env(name: str, default: int) -> int:
    """A number of bytes the environment variable `name` gives (0 or more), or `default`."""
    return _from_env(name, default, int, lambda v: v >= 0, "a number of bytes")


def aggregators_from_env() -> str | None:
    """The job's aggregators, "host[:port],host[:port],..." in order, as OVERCAST_AGGREGATORS
    names them, or OVERCAST_SWITCH (its old name, still read, saying so once); None where
    neither does. Where both are set, the new name wins: an old one left in a shell or a
    launcher's environment cannot contradict what a job (or the emulated cluster) sets."""
    given, old = os.environ.get("OVERCAST_AGGREGATORS"), os.environ.get("OVERCAST_SWITCH")
    if old and not given:
        _say_once(
            "OVERCAST_SWITCH is the old name of OVERCAST_AGGREGATORS: it is read, set that instead"
        )
    elif old and given and old != given:
        _say_once(
            f"OVERCAST_SWITCH={old!r} (the old name of OVERCAST_AGGREGATORS) is ignored: "
            f"OVERCAST_AGGREGATORS={given!r} is set"
        )
    return given or old or None


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, FutureWarning, stacklevel=3)
