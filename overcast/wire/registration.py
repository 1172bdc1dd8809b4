"""The payloads that register a communicator's ranks with an aggregator (overcast switch)."""

import struct

DEFAULT_SWITCH_PORT = 18515
# HELLO from a rank: the communicator's salt, world size, the rank's datagram port and IPv4
# address, and whether it receives the communicator's multicast group. Sealed under the
# communicator key, which the aggregator derives from the job secret and this salt.
HELLO = struct.Struct("<16sHH4sB")
# HELLO back from the aggregator: slots per reduction, its datagram port.
WELCOME = struct.Struct("<IH")
