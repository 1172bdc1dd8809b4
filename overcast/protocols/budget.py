"""One direction of this host's link, shared by every collective in flight.

A token bucket at the link's rate times the pacing share. Multicast streams take from it at their
own pace (they must keep their schedule, so they may run it into debt); in-network reductions
send only when it has tokens, so they fill what the multicast leaves. It also counts the
in-network reductions in flight, so a multicast AllGather knows to leave receivers room for the
reduction's results (the uplink and downlink budgets are shared), and the multicast gathers in
flight, whose streams divide the pace between them.
"""

from __future__ import annotations

from overcast.native import _core


class LinkBudget:
    """`batch`: datagrams a multicast pacer releases per wake-up (the engine sends them in one
    call); `reduction_batch` (at least `batch`): what an in-network sender releases. The bucket
    holds `burst_seconds` at the rate, and at least two of the larger batches of datagrams of
    `datagram_bytes` on the link: a sender that waits for a whole batch must find one while the
    multicast streams take their pace. The bucket itself is native (overcast/native/rank/budget.h):
    the rank's datagram plane takes from it for in-network contributions without Python."""

    def __init__(
        self,
        bytes_per_s: float | None,
        burst_seconds: float = 0.005,
        batch: int = 1,
        datagram_bytes: int = 0,
        reduction_batch: int = 0,
    ):
        self.native = _core.Budget(
            bytes_per_s or 0.0, burst_seconds, batch, datagram_bytes, reduction_batch
        )
        self.rate = bytes_per_s or None
        self.batch, self.reduction_batch = self.native.batch, self.native.reduction_batch
        self.burst = self.native.burst

    @property
    def tokens(self) -> float:
        return self.native.tokens

    @property
    def reductions_in_flight(self) -> int:
        return self.native.reductions_in_flight

    @property
    def gathers_in_flight(self) -> int:
        """Multicast gathers posted whose roots have not all ended their multicast: their
        streams share the pace."""
        return self.native.gathers_in_flight

    def take(self, nbytes: int, now: float) -> None:
        """Spend `nbytes` whatever the balance."""
        self.native.take(nbytes, now)

    def try_take(self, nbytes: int, now: float) -> bool:
        """Spend `nbytes` if the bucket holds them."""
        return self.native.try_take(nbytes, now)

    def ready_at(self, nbytes: int, now: float) -> float:
        """When `try_take(nbytes)` can next succeed."""
        return self.native.ready_at(nbytes, now)
