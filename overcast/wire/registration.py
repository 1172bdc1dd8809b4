"""The handshakes' payloads: ranks meeting each other, and ranks registering with an aggregator
(overcast aggregator).

Every handshake is challenge-response: each side sends a fresh random nonce and accepts only a
HELLO that carries it back under the communicator key's MAC, so a HELLO captured in one handshake
is worth nothing in another.
"""

import enum
import hashlib
import hmac
import struct

DEFAULT_AGGREGATOR_PORT = 18515
NONCE_BYTES = 16
# Between ranks (all sealed under the communicator key, kind HELLO): the accepting rank's
# challenge (its nonce), the connecting rank's answer (that nonce, then its own), and the
# accepting rank's reply (the connecting rank's nonce).
CHALLENGE = struct.Struct(f"<{NONCE_BYTES}s")
ANSWER = struct.Struct(f"<{NONCE_BYTES}s{NONCE_BYTES}s")
# The aggregator's challenge, before it knows which job a connection is from (so unsealed): the
# magic and a nonce.
AGGREGATOR_CHALLENGE = struct.Struct(f"<4s{NONCE_BYTES}s")
AGGREGATOR_MAGIC = b"OCCH"
# HELLO from a rank: the communicator's salt, world size, the rank's datagram port, whether it
# receives the communicator's multicast group, the widest contribution it sends (bytes after
# the contribution's prefix), the stripe of this aggregator's first endpoint (its shards are
# that stripe and the ones after it: the job's aggregators in the order OVERCAST_AGGREGATORS
# names them), the rank's epoch (how many rounds of aggregator losses and take-backs its
# communicator has decided: an aggregator restarted mid-job is registered with at a later epoch
# than the instance it replaces), the aggregator's nonce, and the rank's own. Sealed under the
# communicator key, which the aggregator derives from the job secret and this salt. Results go
# to the address the registration's connection came from.
HELLO = struct.Struct(f"<16sHHBIHH{NONCE_BYTES}s{NONCE_BYTES}s")
# An aggregator's counter under a communicator key starts in its epoch's range, at a random
# place in the range's first 2^40: each instance that serves a communicator has counters of its
# own (a nonce never repeats under the key), 2^48 - 2^40 of them, above every earlier
# instance's (so the ranks' replay windows take the new one's as they come, and never again an
# old one's).
EPOCH_SHIFT = 48
MAX_EPOCH = (1 << 16) - 1
# The aggregator's WELCOME: the magic, the rank's nonce, slots per reduction, how many
# endpoints (shards) it has, then each one's datagram port, and an HMAC-SHA256 of all that
# under a key derived from the job secret and the salt for welcomes alone. Like a refusal, it
# spends no counter of the communicator key, whose nonces belong to the endpoints' threads.
WELCOME_MAGIC = b"OCOK"
WELCOME = struct.Struct(f"<4s{NONCE_BYTES}sIH")
WELCOME_LABEL = b"welcome"
_PORT = struct.Struct("<H")
# The aggregator's refusal of a registration, instead of the WELCOME: the magic (not a header's:
# its version byte differs), the rank's nonce, the reason's code and words, and an HMAC-SHA256 of
# all that under a key derived from the job secret and the salt for refusals alone. A refusal
# spends no counter of the communicator key, which may yet be registered.
REFUSAL_MAGIC = b"OCNO"
REASON_BYTES = 200
_REFUSAL_BODY = struct.Struct(f"<4s{NONCE_BYTES}sH{REASON_BYTES}s")
HMAC_BYTES = 32
REFUSAL_BYTES = _REFUSAL_BODY.size + HMAC_BYTES
REFUSAL_LABEL = b"refusal"


class Refused(enum.IntEnum):
    """Why an aggregator refuses a registration."""

    WORLD = 1  # a world outside 2..its largest
    COMMUNICATORS = 2  # the job holds as many communicators as it may
    POOL = 3  # its reductions' pools would pass the aggregator's budget
    BUFFER = 4  # the receive buffer holds less than one datagram per rank
    IDENTITY = 5  # another communicator of the job has its id on the wire
    INCONSISTENT = 6  # the communicator is registered with another world or row width
    MEMORY = 7  # the aggregator ran out of memory
    RANK = 8  # the rank is registered already, on another connection
    CONNECTIONS = 9  # its ranks' connections would pass the job's share of the descriptors


def _tag(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def pack_welcome(key: bytes, nonce: bytes, slots: int, ports: list[int]) -> bytes:
    """A welcome for the rank whose nonce is `nonce`, under the welcome key `key`."""
    body = WELCOME.pack(WELCOME_MAGIC, nonce, slots, len(ports)) + b"".join(
        _PORT.pack(p) for p in ports
    )
    return body + _tag(key, body)


def welcome_bytes(head: bytes) -> int:
    """The length of the welcome whose first WELCOME.size bytes are `head`."""
    return WELCOME.size + _PORT.size * WELCOME.unpack(head)[3] + HMAC_BYTES


def open_welcome(key: bytes, nonce: bytes, data: bytes) -> tuple[int, list[int]] | None:
    """(slots, endpoint ports) of an authentic welcome to the registration whose nonce is
    `nonce`, or None."""
    if len(data) < WELCOME.size or len(data) != welcome_bytes(data[: WELCOME.size]):
        return None
    body, tag = data[:-HMAC_BYTES], data[-HMAC_BYTES:]
    magic, theirs, slots, n = WELCOME.unpack_from(body)
    if magic != WELCOME_MAGIC or theirs != nonce or not hmac.compare_digest(tag, _tag(key, body)):
        return None
    return slots, [_PORT.unpack_from(body, WELCOME.size + 2 * i)[0] for i in range(n)]


def pack_refusal(key: bytes, nonce: bytes, reason: Refused, words: str) -> bytes:
    """A refusal for the rank whose nonce is `nonce`, under the refusal key `key`."""
    body = _REFUSAL_BODY.pack(REFUSAL_MAGIC, nonce, reason, words.encode()[:REASON_BYTES])
    return body + _tag(key, body)


def open_refusal(key: bytes, nonce: bytes, data: bytes) -> tuple[Refused | int, str] | None:
    """(reason, words) of an authentic refusal to the registration whose nonce is `nonce`, or
    None."""
    if len(data) != REFUSAL_BYTES:
        return None
    body, tag = data[: _REFUSAL_BODY.size], data[_REFUSAL_BODY.size :]
    magic, theirs, code, text = _REFUSAL_BODY.unpack(body)
    if magic != REFUSAL_MAGIC or theirs != nonce or not hmac.compare_digest(tag, _tag(key, body)):
        return None
    try:
        reason = Refused(code)
    except ValueError:
        reason = code
    return reason, text.rstrip(b"\0").decode(errors="replace")
