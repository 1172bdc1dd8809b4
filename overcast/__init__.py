"""overcast: full-duplex FSDP backward communication over a real network stack."""

from overcast.comm import Communicator
from overcast.engine.engine import Work
from overcast.transport.loss import LossSpec
from overcast.errors import (
    AggregatorLostWarning,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    MulticastNotDeliveredWarning,
    OvercastError,
    PeerFailureError,
    ProtocolError,
    TorchFeatureError,
)

__all__ = [
    "Communicator",
    "Work",
    "LossSpec",
    "OvercastError",
    "InvalidArgumentError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorClosedError",
    "PeerFailureError",
    "ProtocolError",
    "TorchFeatureError",
    "MulticastNotDeliveredWarning",
    "AggregatorLostWarning",
]
