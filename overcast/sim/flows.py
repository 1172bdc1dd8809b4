"""Flows over time: each starts (at 0, or when the flow it waits for ends), moves its bytes at
its max-min fair rate, recomputed whenever a flow starts or ends, and ends.

A flow is what a collective's schedule makes of one stream: a ring's stream to its successor, a
root's multicast over its replication tree, one block's reduction over its reduction tree. It
occupies every link of its path or tree once, at one rate; the switches replicate or sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from overcast.sim.fairness import max_min_rates


@dataclass
class Flow:
    """`payload` bytes over `links` (directed link indices) at one rate.

    `senders`/`receivers` are the hosts whose NICs (and engines) it crosses. It starts at 0 or,
    if `after` is a flow's index, `delay` seconds after that flow ends; `tail` is the time from
    its last byte sent to its last byte delivered (propagation, a pipeline's fill). `cap` is its
    pacing: the most bytes/s it may take. `datagram` says which engine path moves it."""

    lane: str
    payload: float
    links: np.ndarray
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    cap: float = math.inf
    after: int | None = None
    delay: float = 0.0
    tail: float = 0.0
    datagram: bool = False
    wire: float = 1.0  # bytes on a link per payload byte (headers)


@dataclass
class Constraint:
    """A shared capacity other than a link: a host's pacing budget, an engine's CPU. `demand`
    is what one byte/s of each flow's rate takes of it."""

    name: str
    capacity: float
    demand: np.ndarray


@dataclass
class Outcome:
    end: np.ndarray  # each flow's last byte sent
    delivered: np.ndarray  # and delivered: end + tail
    link_bytes: np.ndarray  # wire bytes per directed link
    events: int  # rate computations: one per start or end


def run_flows(
    link_rate: np.ndarray, flows: list[Flow], constraints: Sequence[Constraint] = ()
) -> Outcome:
    """Simulate `flows` on directed links of `link_rate` bytes/s, and `constraints`."""
    count, links = len(flows), len(link_rate)
    used = np.unique(np.concatenate([f.links for f in flows])) if flows else np.zeros(0, int)
    row = np.full(links, -1)
    row[used] = np.arange(len(used))
    demand = np.zeros((len(used) + len(constraints), count), dtype=np.float32)
    for i, f in enumerate(flows):
        demand[row[f.links], i] = f.wire
    for k, c in enumerate(constraints):
        demand[len(used) + k] = c.demand
    capacity = np.concatenate([link_rate[used], [c.capacity for c in constraints]])
    caps = np.array([f.cap for f in flows], dtype=np.float64)
    payload = np.array([f.payload for f in flows], dtype=np.float64)
    waiting: dict[int, list[int]] = {}  # flow -> the flows that start when it ends
    for i, f in enumerate(flows):
        if f.after is not None:
            waiting.setdefault(f.after, []).append(i)

    start = np.array([0.0 if f.after is None else math.inf for f in flows])
    end = np.full(count, math.inf)
    left = payload.copy()
    t, events = 0.0, 0
    while np.isinf(end).any():
        running = (start <= t) & np.isinf(end)
        rate = max_min_rates(demand, capacity, caps, running) if running.any() else np.zeros(count)
        events += 1
        with np.errstate(divide="ignore", invalid="ignore"):
            finish = np.where(running & (rate > 0), left / rate, math.inf)
        finish[running & (left <= 0)] = 0.0
        later = start[start > t]
        dt = min(finish.min(), later.min() - t if later.size else math.inf)
        if not math.isfinite(dt):
            raise RuntimeError("flows wait for one another and none can run")
        left = np.where(running, np.maximum(left - rate * dt, 0.0), left)
        t += dt
        for done in np.flatnonzero(running & (finish <= dt * (1 + 1e-12))).tolist():
            end[done] = t
            left[done] = 0.0
            for j in waiting.get(done, ()):
                start[j] = t + flows[j].delay
    link_bytes = np.zeros(links)
    for f in flows:
        link_bytes[f.links] += f.payload * f.wire
    tail = np.array([f.tail for f in flows])
    return Outcome(end, end + tail, link_bytes, events)
