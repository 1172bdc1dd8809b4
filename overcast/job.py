"""A Communicator for a torch.distributed job's group: the ranks meet through the group's store,
and when in-network reduction is wanted and no aggregator is configured (OVERCAST_AGGREGATORS), the
group's rank 0 starts one beside itself and tells the others where it is. The FSDP adapter and
the "overcast" torch.distributed backend both make their communicators here."""

from __future__ import annotations

import dataclasses
import datetime
import os
import secrets as secrets_module
import threading
import time

from overcast.aggregator.launch import AggregatorStartError, start_aggregator, stop_aggregator
from overcast.comm import Communicator
from overcast.errors import OvercastError
from overcast.limits import aggregators_from_env
from overcast.transport.rendezvous import local_address, meeting_host
from overcast.transport.store import forget

# How long rank 0 waits for the other ranks, before stopping the aggregator it started or before
# failing when it could not start one (a rank that died never answers).
CLOSE_WAIT_SECONDS = 10.0
_WAIT_SLICE = 0.2


class JobAggregator:
    """An aggregator rank 0 started for one communicator: the others learn its address (or why
    it did not start) through the store, and tell rank 0 when they closed, so that it is not
    stopped while a peer still waits for a result."""

    def __init__(self, store, key: str, world: int, proc=None):
        self.store, self.key, self.world, self.proc = store, key, world, proc
        self.aborted = threading.Event()  # stop waiting for the others: nobody needs results

    def wait_for_others(self, what: str) -> None:
        """Until every other rank has said `what`, CLOSE_WAIT_SECONDS, or an abort: rank 0
        serves the store, so it must not leave before they have read what they need from it.
        Their words are deleted after."""
        keys = [f"{self.key}{what}/{r}" for r in range(1, self.world)]
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        while not self.aborted.is_set() and (left := deadline - time.monotonic()) > 0:
            try:  # in slices, to see an abort
                self.store.wait(keys, datetime.timedelta(seconds=min(left, _WAIT_SLICE)))
                break
            except RuntimeError:  # torch's DistStoreError on timeout: a rank that died or hangs
                pass
        forget(self.store, keys)

    def close(self, rank: int, wait_for_peers: bool = True) -> None:
        if self.proc is None:
            self.store.set(f"{self.key}closed/{rank}", b"1")
            return
        try:
            if wait_for_peers:
                self.wait_for_others("closed")
        finally:
            stop_aggregator(self.proc)


@dataclasses.dataclass
class GroupCommunicator:
    """What group_communicator made: the communicator; the aggregator rank 0 started for it
    (close it after the communicator), or None; and what another communicator of the same ranks
    needs to share that aggregator: the job secret (hex) and the aggregators' "host:port,..."."""

    comm: Communicator
    job_aggregator: JobAggregator | None
    secret_hex: str
    aggregators: str | None

    def close(self, wait_for_peers: bool = True) -> None:
        """Close the communicator, then the aggregator rank 0 started: once every other rank
        has closed (CLOSE_WAIT_SECONDS at most), or at once if not `wait_for_peers` (the job
        was aborted: no rank waits for a result)."""
        try:
            self.comm.close()
        finally:
            if self.job_aggregator is not None:
                self.job_aggregator.close(self.comm.rank, wait_for_peers)


def agreed_name(store, base: str, world: int) -> str:
    """`base` made unique in `store` by how many communicators of that base and world size met
    there before, the same number on every member rank: each adds one, and all of a group's
    ranks have added before any of them can meet under that base again (a count per world size,
    so that a store reused by jobs of other sizes does not split the ranks)."""
    count = store.add(f"overcast/{base}/members/{world}", 1)
    return f"{base}-{world}-{(count - 1) // world}"


def group_communicator(
    store,
    rank: int,
    world: int,
    base: str,
    *,
    in_network: bool,
    secret_hex: str | None = None,
    aggregators: str | None = None,
    **settings,
) -> GroupCommunicator:
    """An overcast Communicator named after `base` over `world` ranks meeting through `store`,
    a torch.distributed Store. The aggregators are `aggregators` ("host[:port],..."), else
    OVERCAST_AGGREGATORS; with neither, and `in_network`, rank 0 starts one. The secret is
    `secret_hex`, else OVERCAST_SECRET, else one rank 0 draws. `settings` go to the
    Communicator."""
    name = agreed_name(store, base, world)
    key = f"overcast/{name}/"
    secret_hex = secret_hex or os.environ.get("OVERCAST_SECRET")
    aggregators = aggregators or aggregators_from_env()
    job_aggregator = None
    if not aggregators and in_network and world > 1:
        job_aggregator = JobAggregator(store, key, world)
    if rank == 0:
        if not secret_hex:
            secret_hex = secrets_module.token_hex(32)
            store.set(key + "secret", secret_hex)
        if job_aggregator is not None:
            try:
                host = local_address(meeting_host(store))
                job_aggregator.proc, aggregators = start_aggregator(host, 0, secrets=[secret_hex])
            except (AggregatorStartError, OSError) as err:
                store.set(
                    key + "aggregators", f"error: rank 0 could not start an aggregator: {err}"
                )
                job_aggregator.wait_for_others("read")
                forget(store, [key + "secret", key + "aggregators"])
                raise
        store.set(key + "aggregators", aggregators or "")
    else:
        if not secret_hex:
            secret_hex = bytes(store.get(key + "secret")).decode()
        aggregators = bytes(store.get(key + "aggregators")).decode() or None
        if aggregators and aggregators.startswith("error: "):
            store.set(f"{key}read/{rank}", b"1")  # rank 0 waits for this before it leaves
            raise OvercastError(aggregators[len("error: ") :])
    try:
        comm = Communicator(
            rank,
            world,
            name=name,
            store=store,
            secret=bytes.fromhex(secret_hex),
            aggregators=aggregators or "",
            **settings,
        )
    except BaseException:
        if job_aggregator is not None and job_aggregator.proc is not None:
            stop_aggregator(job_aggregator.proc)
        raise
    if rank == 0:  # every rank has met every other: each has read these
        forget(store, [key + "secret", key + "aggregators"])
    return GroupCommunicator(comm, job_aggregator, secret_hex, aggregators or None)
