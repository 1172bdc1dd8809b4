"""Errors overcast raises into user code. Every one names what went wrong and where."""


class OvercastError(RuntimeError):
    """Base of every error a collective or communicator raises."""


class InvalidArgumentError(OvercastError, ValueError):
    """A call overcast cannot carry out as asked: buffer type, dtype, layout, size, op."""


class CollectiveMismatchError(OvercastError):
    """Ranks issued different collectives (kind, size, dtype, op, order) at one sequence number."""


class PeerFailureError(OvercastError):
    """A peer rank died, closed early or aborted; the communicator cannot continue."""


class CollectiveTimeoutError(OvercastError, TimeoutError):
    """A collective made no progress within the communicator's timeout."""


class ProtocolError(OvercastError):
    """An authenticated peer sent something the protocol cannot accept (a bug or a mismatch)."""


class CommunicatorClosedError(OvercastError):
    """The communicator was closed before or while the collective ran."""
