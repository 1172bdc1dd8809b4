"""A communicator of two ranks in this process: rank 0 a real Communicator, rank 1 played by
hand, its links fresh from rendezvous (its stream to rank 0, its sealer) and no engine: it sends
and reads only what a test makes it, as a peer that runs ahead or stops reading would."""

from __future__ import annotations

import contextlib
import os
import threading

import overcast
from overcast.transport.rendezvous import rendezvous
from overcast.transport.store import StoreClient, StoreServer


@contextlib.contextmanager
def rank_1_by_hand(**settings):
    """(rank 0's Communicator with `settings`, rank 1's Links); everything closed on exit."""
    secret = os.urandom(32)
    server = StoreServer("127.0.0.1", 0)
    by_hand: dict[int, object] = {}

    def meet():
        by_hand[1] = rendezvous(1, 2, store=StoreClient("127.0.0.1", server.port, 30),
                                secret=secret, timeout=30)

    thread = threading.Thread(target=meet)
    thread.start()
    try:
        comm = overcast.Communicator(0, 2, store=StoreClient("127.0.0.1", server.port, 30),
                                     secret=secret, **settings)
    finally:
        thread.join()
    links = by_hand[1]
    links.streams[0].settimeout(60)
    try:
        yield comm, links
    finally:
        comm.close()
        for sock in [*links.streams.values(), links.udp, links.multicast]:
            if sock is not None:
                sock.close()
        server.close()
