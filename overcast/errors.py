"""Errors overcast raises into user code, and the one warning it gives. Every one names what went
wrong and where.

Each class has its own `abort_code`: an ABORT message carries it, so that every rank raises the
class the detecting rank raised.
"""


class OvercastError(RuntimeError):
    """Base of every error a collective or communicator raises."""

    abort_code = 0
    ranks_named = False  # the backend has said which global rank each rank it names is


class InvalidArgumentError(OvercastError, ValueError):
    """A call or a setting overcast cannot carry out as asked: buffer type, dtype, layout, size,
    op, link rate, port..."""

    abort_code = 6


class TorchFeatureError(OvercastError):
    """The installed torch lacks something overcast needs for what was asked; the message says
    which torch has it. Raised on every rank alike (each checks its own torch)."""


class CollectiveMismatchError(OvercastError):
    """Ranks issued different collectives (kind, size, dtype, op, order) at one sequence number."""

    abort_code = 1


class PeerFailureError(OvercastError):
    """A peer rank died, closed early or aborted; the communicator cannot continue."""

    abort_code = 3


class CollectiveTimeoutError(OvercastError, TimeoutError):
    """A collective made no progress within the communicator's timeout."""

    abort_code = 4


class ProtocolError(OvercastError):
    """An authenticated peer sent something the protocol cannot accept (a bug or a mismatch)."""

    abort_code = 2


class Rejected(ProtocolError):
    """A message that does not fit the protocol's state, with the reason it is counted under
    (misdirected, wrong_channel, unexpected_kind, wrong_sender, wrong_phase, out_of_range,
    wrong_length, malformed, duplicate). From a datagram it is dropped and counted; from a
    peer's authenticated stream it aborts."""

    def __init__(self, message: str, reason: str = "rejected"):
        super().__init__(message)
        self.reason = reason


class CommunicatorClosedError(OvercastError):
    """The communicator was closed before or while the collective ran."""

    abort_code = 5


class MulticastNotDeliveredWarning(UserWarning):
    """Multicast is not delivered between the ranks of a communicator (some rank did not hear
    another's probe when it was made), so overlap() and the backend's "auto" run the AllGather
    and broadcast on the ring; the message names the ranks and their hosts."""


class AggregatorLostWarning(UserWarning):
    """An aggregator was lost mid-job (its connection closed, or it fell silent while a reduction
    waited on it): the communicator goes on, its in-network ReduceScatters on the ring; the
    message names the aggregator (host:port) and which collectives the ring redid."""


def error_class(abort_code: int) -> type[OvercastError]:
    """The class an ABORT's code names (OvercastError for a code this version does not know)."""
    for cls in (
        CollectiveMismatchError,
        ProtocolError,
        PeerFailureError,
        CollectiveTimeoutError,
        CommunicatorClosedError,
        InvalidArgumentError,
    ):
        if cls.abort_code == abort_code:
            return cls
    return OvercastError


def mark_peers_told(error: BaseException) -> BaseException:
    """`error`, marked `peers_told`: raised alike on every rank, so that no peer needs telling of
    it (Communicator.refuse). Any exception may be marked; it is read with getattr."""
    error.peers_told = True  # type: ignore[attr-defined]  # a mark, not an attribute of a class
    return error
