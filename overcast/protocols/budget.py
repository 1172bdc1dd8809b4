"""One direction of this host's link, shared by every collective in flight.

A token bucket at the link's rate times the pacing share. Multicast streams take from it at their
own pace (they must keep their schedule, so they may run it into debt); in-network reductions
send only when it has tokens, so they fill what the multicast leaves. It also counts the
in-network reductions in flight, so a multicast AllGather knows to leave receivers room for the
reduction's results (BRIEF section 3: the uplink and downlink budgets are shared).
"""

from __future__ import annotations


class LinkBudget:
    """`batch`: datagrams a multicast pacer releases per wake-up (the engine sends them in one
    call); `reduction_batch` (at least `batch`): what an in-network sender releases. The bucket
    holds `burst_seconds` at the rate, and at least two of the larger batches of datagrams of
    `datagram_bytes` on the link: a sender that waits for a whole batch must find one while the
    multicast streams take their pace."""

    def __init__(self, bytes_per_s: float | None, burst_seconds: float = 0.005, batch: int = 1,
                 datagram_bytes: int = 0, reduction_batch: int = 0):
        self.rate = bytes_per_s
        self.batch = batch
        self.reduction_batch = max(batch, reduction_batch)
        self.burst = max((bytes_per_s or 0) * burst_seconds,
                         2 * self.reduction_batch * datagram_bytes if bytes_per_s else 0)
        self.tokens = self.burst
        self.updated: float | None = None
        self.reductions_in_flight = 0

    def _refill(self, now: float) -> None:
        if self.updated is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, nbytes: int, now: float) -> None:
        """Spend `nbytes` whatever the balance."""
        if self.rate:
            self._refill(now)
            self.tokens -= nbytes

    def try_take(self, nbytes: int, now: float) -> bool:
        """Spend `nbytes` if the bucket holds them."""
        if not self.rate:
            return True
        self._refill(now)
        if self.tokens < min(nbytes, self.burst) - 0.5:  # half a byte: float rounding
            return False
        self.tokens -= nbytes
        return True

    def ready_at(self, nbytes: int, now: float) -> float:
        """When `try_take(nbytes)` can next succeed."""
        if not self.rate:
            return now
        self._refill(now)
        return now + max(0.0, min(nbytes, self.burst) - self.tokens) / self.rate
