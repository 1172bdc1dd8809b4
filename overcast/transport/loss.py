"""Injected loss of received datagrams, for tests and benchmarks (this kernel has no netem).

A Gilbert-Elliott channel per receiver: in the good state nothing is lost, in the bad state
everything is; the chances of switching are set so the mean loss is `rate` and the mean burst is
`burst` datagrams (burst 1 is uniform, independent loss). Seeded, so a run can be repeated.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from overcast.limits import check_loss


@dataclass(frozen=True)
class LossSpec:
    rate: float = 0.0
    burst: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_loss(self.rate, self.burst)

    @classmethod
    def from_env(cls) -> LossSpec:
        """OVERCAST_LOSS (fraction), OVERCAST_LOSS_BURST (datagrams), OVERCAST_LOSS_SEED."""
        return cls(
            float(os.environ.get("OVERCAST_LOSS", 0)),
            float(os.environ.get("OVERCAST_LOSS_BURST", 1)),
            int(os.environ.get("OVERCAST_LOSS_SEED", 0)),
        )


class LossModel:
    def __init__(self, spec: LossSpec, stream: int = 0):
        self.spec = spec
        self._rng = random.Random(spec.seed * 1_000_003 + stream)
        self._bad = False
        r, b = spec.rate, spec.burst
        self._enter = 1.0 if r >= 1 else r / (b * (1 - r))
        self._stay = 1.0 if r >= 1 else 1 - 1 / b

    def drop(self) -> bool:
        """Whether the next datagram is lost."""
        if not self.spec.rate:
            return False
        self._bad = self._rng.random() < (self._stay if self._bad else self._enter)
        return self._bad
