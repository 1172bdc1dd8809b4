"""The versioned binary header every overcast datagram and stream frame starts with.

Layout (little-endian, 36 bytes), followed by `length` payload bytes and a 16-byte MAC:

    magic  2s  b"OC"
    version u8
    kind    u8   message kind (Kind)
    job     u32  job id, from the job secret: foreign jobs are told apart before the MAC
    comm    u32  communicator id, agreed at rendezvous
    seq     u32  collective sequence number within the communicator
    src     u16  sending rank (AGGREGATOR for the aggregator)
    dst     u16  destination rank, or ANY for multicast
    chunk   u32  chunk or frame index within the collective
    length  u32  payload bytes
    counter u64  per-sender message number: the MAC nonce and the replay-window key
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

MAGIC = b"OC"
VERSION = 2  # 2: chunk size agreed at rendezvous, held stream bytes bounded, order tag
HEADER = struct.Struct("<2sBBIIIHHIIQ")
HEADER_BYTES = HEADER.size
TAG_BYTES = 16
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
MAX_PAYLOAD = 1 << 26
IP_UDP_BYTES = 20 + 8
ETHERNET_BYTES = 14


def datagram_link_bytes(payload_bytes: int) -> int:
    """What a datagram carrying `payload_bytes` occupies on an Ethernet link (tbf counts it)."""
    return payload_bytes + OVERHEAD_BYTES + IP_UDP_BYTES + ETHERNET_BYTES


AGGREGATOR = 0xFFFE
ANY = 0xFFFF
# In-network reductions may be striped over several aggregator endpoints (the shards of one or
# more aggregators, native/common/numbering.h): endpoint e is addressed as and sends as
# AGGREGATOR - e, so each has a nonce space of its own under the communicator key. Ranks are
# below them all.
MAX_STRIPES = 256
MAX_WORLD = AGGREGATOR + 1 - MAX_STRIPES


def endpoint(stripe: int) -> int:
    """The id of aggregator endpoint `stripe` on the wire."""
    return AGGREGATOR - stripe


def endpoints(stripes: int) -> frozenset[int]:
    """The ids of the first `stripes` aggregator endpoints."""
    return frozenset(endpoint(e) for e in range(stripes))


def is_aggregator(peer: int) -> bool:
    return MAX_WORLD <= peer <= AGGREGATOR


class Kind(enum.IntEnum):
    HELLO = 1
    DESCRIBE = 2
    ABORT = 3
    GOODBYE = 4
    REFUSE = 5
    FAILOVER = 6
    REJOIN = 7
    RING_DATA = 10
    A2A_DATA = 11
    A2A_PULL = 12
    MCAST_DATA = 20
    REPAIR_REQUEST = 21
    REPAIR_DATA = 22
    ACTIVATE = 23
    FIN = 24
    MCAST_END = 25
    CONTRIB = 30
    RESULT = 31
    RESULT_ACK = 32
    CREDIT = 33
    WITHDRAW = 34
    P2P_OFFER = 40
    P2P_ACCEPT = 41
    P2P_REFUSE = 42
    P2P_DATA = 43


KINDS = frozenset(int(k) for k in Kind)
# Why an authentic message did not fit its receiver's state, as the native core reports it
# (overcast/native/common/wire.h, OC_MISFIT_*), by the drop counters' names.
MISFITS = {1: "out_of_range", 2: "wrong_length", 3: "malformed", 4: "wrong_sender"}


class Header(NamedTuple):
    """A parsed header (a named tuple: one is made per message, so it must be cheap)."""

    kind: int
    job: int
    comm: int
    seq: int
    src: int
    dst: int
    chunk: int
    length: int
    counter: int

    def frame_bytes(self) -> int:
        """The whole message this header starts: header, payload, tag."""
        return HEADER_BYTES + self.length + TAG_BYTES


class MalformedError(ValueError):
    """The bytes are not an overcast message of this version."""


def unpack_header(buf) -> Header:
    """Parse and sanity-check a header; raise MalformedError on anything unexpected."""
    if len(buf) < HEADER_BYTES:
        raise MalformedError("short header")
    fields = HEADER.unpack_from(buf)
    if fields[0] != MAGIC:
        raise MalformedError("bad magic")
    if fields[1] != VERSION:
        raise MalformedError(f"version {fields[1]}")
    if fields[2] not in KINDS:
        raise MalformedError(f"unknown kind {fields[2]}")
    if fields[9] > MAX_PAYLOAD:
        raise MalformedError("oversized payload")
    return Header._make(fields[2:])
