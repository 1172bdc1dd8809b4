"""Time floors and traffic per rank of each collective (BRIEF section 2), for N bytes per rank,
P ranks and B bytes/s per link direction; and nccl-tests' algbw and busbw."""

from __future__ import annotations

# (collective, algorithm) -> (bytes sent, bytes received) per rank, as multiples of N,
# each a function of P.
TRAFFIC = {
    ("allgather", "ring"): (lambda p: p - 1, lambda p: p - 1),
    ("allgather", "multicast"): (lambda p: 1, lambda p: p - 1),
    ("reduce_scatter", "ring"): (lambda p: p - 1, lambda p: p - 1),
    ("reduce_scatter", "innetwork"): (lambda p: p - 1, lambda p: 1),
    ("overlap", "ring"): (lambda p: 2 * (p - 1), lambda p: 2 * (p - 1)),
    ("overlap", "overcast"): (lambda p: p, lambda p: p),
}


def traffic(collective: str, algorithm: str, n: int, p: int) -> tuple[int, int]:
    """Payload bytes (sent, received) per rank; gloo is treated as its ring equivalent."""
    sent, received = TRAFFIC[(collective, "ring" if algorithm == "gloo" else algorithm)]
    return n * sent(p), n * received(p)


def floor_seconds(collective: str, n: int, p: int, link_bytes_per_s: float) -> float:
    """The least time any algorithm needs on full-duplex links of B bytes/s per direction:
    N(P-1)/B for AllGather or ReduceScatter alone, NP/B for the two overlapped."""
    if collective == "overlap":
        return pair_floor_seconds(n, n, p, link_bytes_per_s)
    return n * (p - 1) / link_bytes_per_s


def pair_floor_seconds(gather: int, scatter: int, p: int, link_bytes_per_s: float) -> float:
    """AllGather of `gather` bytes per rank beside ReduceScatter of `scatter` bytes out per rank
    (sizes differ when gradients are reduced in a wider dtype): a rank must send
    gather + (P-1)·scatter and receive (P-1)·gather + scatter, whichever way it is done."""
    return max(gather + (p - 1) * scatter, (p - 1) * gather + scatter) / link_bytes_per_s


def algbw(n: int, p: int, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: the whole array, N*P bytes, over the time."""
    return n * p / seconds


def busbw(n: int, p: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth for AllGather and ReduceScatter: algbw * (P-1)/P."""
    return algbw(n, p, seconds) * (p - 1) / p
