"""Payload formats of the messages that ranks and the aggregator exchange after the header.

Each `unpack_*` checks lengths and raises MalformedError, so a receiver rejects a message that
does not parse in one line, whoever sent it. The aggregator parses what ranks send it natively
(overcast/native/aggregator/aggregator.c), with the same checks.
"""

from __future__ import annotations

import struct

from overcast.wire.header import MalformedError

# CONTRIB (rank -> aggregator): what the aggregator needs to sum it, so no other message has to
# arrive first: dtype code, the group of its chunk numbering (native/common/numbering.h), world
# size, chunks in the whole input, and the aggregator endpoint it is for among how many (the
# stripe: its chunk number is that endpoint's, numbering.h); then data.
CONTRIB_PREFIX = struct.Struct("<BBHIHH")
# CREDIT (aggregator -> rank): chunks released (every chunk below is done), then chunks the rank
# must send again, in the endpoint's numbering. CREDIT (rank -> aggregator endpoint, when its
# credit stalls): the endpoint's chunks it has sent so far, and nothing after.
_U32 = struct.Struct("<I")
# REPAIR_REQUEST (rank -> rank): the sender's collective descriptor (protocols.base), then
# (first chunk, count) ranges. MCAST_END (rank -> rank): the sender's collective descriptor.
REPAIR_RANGE = struct.Struct("<II")
# ABORT, and REFUSE (a rank's call refused in place of its collective): the error class's abort
# code, then the reason in UTF-8. WITHDRAW (rank -> aggregator endpoint): no payload.
_ABORT = struct.Struct("<B")
ABORT_REASON_BYTES = 4000
# GOODBYE: how many collectives the closing rank issued (one u32, as a rank's credit probe).


def _one_u32(payload, what: str) -> int:
    if len(payload) != _U32.size:
        raise MalformedError(f"{what} of {len(payload)} bytes, not {_U32.size}")
    return _U32.unpack(payload)[0]


def _u32_list(payload, what: str) -> list[int]:
    if len(payload) % 4:
        raise MalformedError(f"{what} of {len(payload)} bytes, not a whole number of chunks")
    return [g for (g,) in _U32.iter_unpack(payload)]


def pack_contribution_prefix(
    dtype_code: int, group: int, world: int, total: int, stripe: int = 0, stripes: int = 1
) -> bytes:
    return CONTRIB_PREFIX.pack(dtype_code, group, world, total, stripe, stripes)


def pack_credit(released: int, resend=()) -> bytes:
    return _U32.pack(released) + struct.pack(f"<{len(resend)}I", *resend)


def unpack_credit(payload) -> tuple[int, list[int]]:
    """(chunks released, or the next chunk unsent for a rank's probe; chunks to send again)."""
    if len(payload) < _U32.size:
        raise MalformedError(f"credit of {len(payload)} bytes")
    return _U32.unpack_from(payload)[0], _u32_list(payload[_U32.size :], "credit")


def pack_acks(chunks: list[int]) -> bytes:
    return struct.pack(f"<{len(chunks)}I", *chunks)


def pack_ranges(ranges) -> bytes:
    return b"".join(REPAIR_RANGE.pack(first, count) for first, count in ranges)


def unpack_ranges(payload) -> list[tuple[int, int]]:
    if not payload or len(payload) % REPAIR_RANGE.size:
        raise MalformedError(f"repair request of {len(payload)} bytes")
    return list(REPAIR_RANGE.iter_unpack(payload))


def pack_abort(code: int, reason: str) -> bytes:
    return _ABORT.pack(code) + reason.encode()[:ABORT_REASON_BYTES]


def unpack_abort(payload) -> tuple[int, str]:
    if len(payload) < _ABORT.size:
        raise MalformedError("empty abort")
    return _ABORT.unpack_from(payload)[0], bytes(payload[_ABORT.size :]).decode("utf-8", "replace")


def pack_goodbye(collectives: int) -> bytes:
    return _U32.pack(collectives)


def unpack_goodbye(payload) -> int:
    return _one_u32(payload, "goodbye")
