"""The handshakes' payloads: ranks meeting each other, and ranks registering with an aggregator
(overcast switch).

Every handshake is challenge-response: each side sends a fresh random nonce and accepts only a
HELLO that carries it back under the communicator key's MAC, so a HELLO captured in one handshake
is worth nothing in another.
"""

import struct

DEFAULT_SWITCH_PORT = 18515
NONCE_BYTES = 16
# Between ranks (all sealed under the communicator key, kind HELLO): the accepting rank's
# challenge (its nonce), the connecting rank's answer (that nonce, then its own), and the
# accepting rank's reply (the connecting rank's nonce).
CHALLENGE = struct.Struct(f"<{NONCE_BYTES}s")
ANSWER = struct.Struct(f"<{NONCE_BYTES}s{NONCE_BYTES}s")
# The aggregator's challenge, before it knows which job a connection is from (so unsealed): the
# magic and a nonce.
SWITCH_CHALLENGE = struct.Struct(f"<4s{NONCE_BYTES}s")
SWITCH_MAGIC = b"OCCH"
# HELLO from a rank: the communicator's salt, world size, the rank's datagram port and IPv4
# address, whether it receives the communicator's multicast group, the aggregator's nonce, and
# the rank's own. Sealed under the communicator key, which the aggregator derives from the job
# secret and this salt.
HELLO = struct.Struct(f"<16sHH4sB{NONCE_BYTES}s{NONCE_BYTES}s")
# HELLO back from the aggregator: slots per reduction, its datagram port, the rank's nonce.
WELCOME = struct.Struct(f"<IH{NONCE_BYTES}s")
