"""A training step's schedule against one host's link: the training thread computes, posts
collectives and waits for them, while the collectives in flight share each direction of its
link max-min fairly. `overcast train`'s prediction and `overcast plan` both run their steps
here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from overcast.sim.fairness import max_min_rates


@dataclass
class _Flight:
    """A collective in flight: bytes left in its busier direction, the share of those its send
    and its receive direction each carry, and the seconds it still takes once they are through
    (its latency, which takes no bandwidth)."""

    left: float
    sent: float
    received: float
    tail: float = 0.0


def run_step(schedule: list[tuple], link_bytes_per_s: float, demand) -> float:
    """Seconds `schedule` takes: ("compute", seconds), ("post", name, kind, n) and ("wait",
    name), in order. A posted collective moves demand(kind, n) = (bytes sent, bytes received)
    through the link, whose directions each carry `link_bytes_per_s`, and then, where demand
    gives a third value, takes that many seconds more without the link; the collectives in
    flight share the link max-min fairly (a flow's rate is the bytes/s of its busier direction)
    while the training thread computes or waits."""
    flights: dict[str, _Flight] = {}
    posted: set[str] = set()
    now = 0.0

    def run(until: float = math.inf, name: str | None = None) -> None:
        """Move the flights on until `until`, or until `name` has landed."""
        nonlocal now
        while flights and (name in flights if name else now < until):
            moving = [n for n in flights if flights[n].left > 0]
            need = np.array(
                [[flights[n].sent for n in moving], [flights[n].received for n in moving]]
            )
            rates = (
                max_min_rates(
                    need,
                    np.full(2, link_bytes_per_s),
                    np.full(len(moving), np.inf),
                    np.ones(len(moving), bool),
                )
                if moving
                else np.zeros(0)
            )
            step = min(
                [flights[n].left / r for n, r in zip(moving, rates)]
                + [f.tail for f in flights.values() if f.left <= 0]
                + [until - now]
            )
            now += step
            for n, r in zip(moving, rates):
                flights[n].left -= r * step
                if flights[n].left <= 1e-9 * link_bytes_per_s:
                    flights[n].left = 0.0
            for n in [n for n in flights if flights[n].left <= 0 and n not in moving]:
                flights[n].tail -= step
            for n in [n for n in flights if flights[n].left <= 0 and flights[n].tail <= 1e-12]:
                del flights[n]
        if until < math.inf:
            now = max(now, until)

    for action in schedule:
        if action[0] == "compute":
            run(until=now + action[1])
        elif action[0] == "post":
            _, name, kind, n = action
            posted.add(name)
            sent, received, *tail = demand(kind, n)
            busier = max(sent, received)
            if busier > 0 or (tail and tail[0] > 0):
                flights[name] = _Flight(
                    busier,
                    sent / busier if busier else 0.0,
                    received / busier if busier else 0.0,
                    tail[0] if tail else 0.0,
                )
        else:
            if action[1] not in posted:
                raise ValueError(f"the schedule waits for {action[1]!r} before posting it")
            run(name=action[1])
    return now
