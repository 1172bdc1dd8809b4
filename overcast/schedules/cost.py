"""Time floors and traffic per rank of each collective, for N bytes per rank (an AllGather's
input, a ReduceScatter's output, an all_reduce's whole buffer), P ranks and B bytes/s per link
direction; and nccl-tests' algbw and busbw."""

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
    # all_reduce of N bytes: the ring's ReduceScatter and AllGather each move (P-1)/P of it;
    # the full-duplex one's in-network ReduceScatter sends (P-1)/P and receives 1/P, its
    # multicast AllGather the opposite.
    ("all_reduce", "ring"): (lambda p: 2 * (p - 1) / p, lambda p: 2 * (p - 1) / p),
    ("all_reduce", "fullduplex"): (lambda p: 1, lambda p: 1),
}


def traffic(collective: str, algorithm: str, n: int, p: int) -> tuple[float, float]:
    """Payload bytes (sent, received) per rank; gloo is treated as its ring equivalent."""
    sent, received = TRAFFIC[(collective, "ring" if algorithm == "gloo" else algorithm)]
    return n * sent(p), n * received(p)


def floor_seconds(collective: str, n: int, p: int, link_bytes_per_s: float) -> float:
    """The least time any algorithm needs on full-duplex links of B bytes/s per direction:
    N(P-1)/B for AllGather or ReduceScatter alone, NP/B for the two overlapped, N/B for an
    all_reduce with the network's help (each byte sent once, and received once)."""
    if collective == "all_reduce":
        return n / link_bytes_per_s
    if collective == "overlap":
        return pair_floor_seconds(n, n, p, link_bytes_per_s)
    return n * (p - 1) / link_bytes_per_s


def pair_floor_seconds(gather: int, scatter: int, p: int, link_bytes_per_s: float) -> float:
    """AllGather of `gather` bytes per rank beside ReduceScatter of `scatter` bytes out per rank
    (sizes differ when gradients are reduced in a wider dtype): a rank must send
    gather + (P-1)·scatter and receive (P-1)·gather + scatter, whichever way it is done."""
    return max(gather + (p - 1) * scatter, (p - 1) * gather + scatter) / link_bytes_per_s


def algbw(n: int, p: int, seconds: float, collective: str = "allgather") -> float:
    """nccl-tests' algorithm bandwidth: the whole array (N*P bytes; an all_reduce's N) over the
    time."""
    return (n if collective == "all_reduce" else n * p) / seconds


def busbw(n: int, p: int, seconds: float, collective: str = "allgather") -> float:
    """nccl-tests' bus bandwidth: algbw * (P-1)/P for AllGather and ReduceScatter, and
    algbw * 2(P-1)/P for all_reduce."""
    factor = 2 * (p - 1) / p if collective == "all_reduce" else (p - 1) / p
    return algbw(n, p, seconds, collective) * factor
