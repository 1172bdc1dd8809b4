"""What a rank's engine did over time, for timelines: each collective's span, and the bytes it
put on and took off the link in small time bins, by direction. Off unless asked for."""

from __future__ import annotations

import collections
import time

BIN_SECONDS = 0.002


class Trace:
    def __init__(self, bin_seconds: float = BIN_SECONDS):
        self.bin_seconds = bin_seconds
        self.bins: collections.Counter = collections.Counter()  # (direction, seq, bin) -> bytes
        self.spans: dict[int, list] = {}  # seq -> [description, start, end]

    def count(self, direction: str, seq: int, nbytes: int, now: float) -> None:
        self.bins[(direction, seq, int(now / self.bin_seconds))] += nbytes

    def add_bins(self, bins) -> None:
        """Bins counted elsewhere (the native plane): (direction, seq, bin, bytes)."""
        for direction, seq, index, nbytes in bins:
            self.bins[(direction, seq, index)] += nbytes

    def begin(self, seq: int, description: str, now: float) -> None:
        self.spans[seq] = [description, now, None]

    def end(self, seq: int, now: float) -> None:
        if seq in self.spans:
            self.spans[seq][2] = now

    def to_dict(self) -> dict:
        """Plain data (JSON): times in seconds on the machine's monotonic clock, which every
        process on it shares."""
        return {
            "bin_seconds": self.bin_seconds,
            "clock": "monotonic",
            "taken": time.monotonic(),
            "spans": [
                {"seq": s, "name": n, "start": a, "end": b}
                for s, (n, a, b) in sorted(self.spans.items())
            ],
            "bins": [
                {"direction": d, "seq": s, "bin": b, "bytes": n}
                for (d, s, b), n in sorted(self.bins.items())
            ],
        }
