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
    # all_to_all of N bytes per rank split evenly: each block but its own goes out once
    ("all_to_all", "pairwise"): (lambda p: (p - 1) / p, lambda p: (p - 1) / p),
    # N bytes from each even rank to the odd one after it: per host, on average
    ("send_recv", "stream"): (lambda p: (p // 2) / p, lambda p: (p // 2) / p),
}
# What gloo's algorithm moves, as overcast's: its rings, but where it exchanges pairwise
GLOO_LIKE = {"all_to_all": "pairwise", "send_recv": "stream"}


def traffic(collective: str, algorithm: str, n: int, p: int) -> tuple[float, float]:
    """Payload bytes (sent, received) per rank; gloo is treated as its equivalent (GLOO_LIKE,
    else the ring)."""
    if algorithm == "gloo":
        algorithm = GLOO_LIKE.get(collective, "ring")
    sent, received = TRAFFIC[(collective, algorithm)]
    return n * sent(p), n * received(p)


def exchange_floor_seconds(matrix, link_bytes_per_s: float) -> float:
    """A pairwise exchange's least time, matrix[s][d] bytes going from rank s to rank d: the
    host that sends or receives the most (its own block aside), at B bytes/s each way."""
    p = len(matrix)
    out = max(sum(matrix[s][d] for d in range(p) if d != s) for s in range(p))
    into = max(sum(matrix[s][d] for s in range(p) if s != d) for d in range(p))
    return max(out, into) / link_bytes_per_s


def exchange_traffic(matrix) -> tuple[float, float]:
    """Payload bytes (sent, received) per rank of that exchange, on average."""
    p = len(matrix)
    moved = sum(matrix[s][d] for s in range(p) for d in range(p) if s != d)
    return moved / p, moved / p


def floor_seconds(collective: str, n: int, p: int, link_bytes_per_s: float) -> float:
    """The least time any algorithm needs on full-duplex links of B bytes/s per direction:
    N(P-1)/B for AllGather or ReduceScatter alone, NP/B for the two overlapped, N/B for an
    all_reduce with the network's help (each byte sent once, and received once) and for a send
    from one rank to another, N(P-1)/(PB) for an all_to_all split evenly."""
    if collective in ("all_reduce", "send_recv"):
        return n / link_bytes_per_s
    if collective == "all_to_all":
        return n * (p - 1) / p / link_bytes_per_s
    if collective == "overlap":
        return pair_floor_seconds(n, n, p, link_bytes_per_s)
    return n * (p - 1) / link_bytes_per_s


def pair_floor_seconds(gather: int, scatter: int, p: int, link_bytes_per_s: float) -> float:
    """AllGather of `gather` bytes per rank beside ReduceScatter of `scatter` bytes out per rank
    (sizes differ when gradients are reduced in a wider dtype): a rank must send
    gather + (P-1)·scatter and receive (P-1)·gather + scatter, whichever way it is done."""
    return max(gather + (p - 1) * scatter, (p - 1) * gather + scatter) / link_bytes_per_s


# Collectives whose nccl-tests size is a rank's buffer, not the whole array
_PER_RANK = ("all_reduce", "all_to_all", "all_to_all_uneven", "send_recv")


def algbw(n: int, p: int, seconds: float, collective: str = "allgather") -> float:
    """nccl-tests' algorithm bandwidth: the whole array (N*P bytes; an all_reduce's,
    all_to_all's or send's N) over the time."""
    return (n if collective in _PER_RANK else n * p) / seconds


def busbw(n: int, p: int, seconds: float, collective: str = "allgather") -> float:
    """nccl-tests' bus bandwidth: algbw * (P-1)/P for AllGather, ReduceScatter and all_to_all,
    algbw * 2(P-1)/P for all_reduce, algbw for a send."""
    factor = (
        2 * (p - 1) / p
        if collective == "all_reduce"
        else 1
        if collective == "send_recv"
        else (p - 1) / p
    )
    return algbw(n, p, seconds, collective) * factor
