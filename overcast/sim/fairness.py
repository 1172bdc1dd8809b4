"""Max-min fair rates by progressive filling, in a few numpy operations per level.

Every constraint (a link direction, a host's pacing budget, an engine's CPU) has a capacity, and
each flow takes `demand[c, f]` of constraint c per byte/s of its rate (1 for a link it crosses,
more for headers, seconds of CPU per byte for an engine). All unfrozen flows rise together until
a constraint is full or a flow reaches its own cap; the flows on a full constraint and the capped
ones freeze; the rest rise again. Each round is a matrix-vector product over every flow at once,
and there are as many rounds as distinct bottleneck levels, not as links or flows.
"""

from __future__ import annotations

import numpy as np

# Constraints and caps within this share of the step that filled one are full too.
FULL = 1e-9


def max_min_rates(
    demand: np.ndarray, capacity: np.ndarray, caps: np.ndarray, active: np.ndarray
) -> np.ndarray:
    """Rates (bytes/s) of the flows where `active`; 0 elsewhere.

    demand: constraints x flows; capacity: per constraint; caps: per flow (inf for none)."""
    rate = np.zeros(demand.shape[1])
    free = active.copy()
    left = capacity.astype(np.float64).copy()
    while free.any():
        load = demand @ free.astype(demand.dtype)
        room = np.full(len(left), np.inf)
        taken = load > 0
        room[taken] = left[taken] / load[taken]
        headroom = caps - rate
        step = min(room.min(), float(headroom[free].min()))
        if not np.isfinite(step):
            raise ValueError("a flow crosses no constraint and has no cap: its rate is unbounded")
        rate[free] += step
        left = np.maximum(left - step * load, 0.0)
        full = room <= step * (1 + FULL)
        frozen = free & ((demand[full].sum(axis=0) > 0) | (headroom <= step * (1 + FULL)))
        free &= ~frozen
    return rate
