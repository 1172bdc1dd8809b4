"""How P processes find each other and set up their authenticated channels.

Ranks meet through a key-value store (ours at MASTER_ADDR:MASTER_PORT, or any object with
torch.distributed.Store's set/get). Rank 0 draws a random salt per communicator; every rank
publishes its address and ports; the communicator key is derived from the job secret and the salt.
The job secret comes from the caller or OVERCAST_SECRET (hex); without one, rank 0 draws one and
shares it through the store, which then must be trusted as torchrun's TCPStore is.

Then every pair of ranks opens one TCP connection (the higher rank connects) and both sides prove
who they are before anything else crosses, challenge-response: the accepting rank sends a fresh
nonce, the connecting rank answers with it and a nonce of its own under the communicator key's MAC,
the accepting rank replies with the second nonce. A HELLO captured in one handshake is worth
nothing in another. A rank serves the connections it accepts all at once, each with its own
short deadline, so a connection that says nothing delays no one.
"""

from __future__ import annotations

import os
import secrets
import selectors
import socket
import time
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from overcast.errors import OvercastError
from overcast.limits import aggregators_from_env
from overcast.transport.datagram import (
    chunk_bytes,
    multicast_group,
    open_multicast,
    path_mtu,
    prepare_sender,
)
from overcast.transport.probe import prove_delivery
from overcast.transport.store import (
    StoreClient,
    StoreError,
    StoreServer,
    connect_until,
    forget,
    read_exact,
)
from overcast.wire.auth import Drops, Opener, Sealer, derive_key, frame_length, job_id_of
from overcast.wire.header import (
    AGGREGATOR,
    ANY,
    HEADER_BYTES,
    MAX_STRIPES,
    TAG_BYTES,
    Kind,
    MalformedError,
    endpoint,
    unpack_header,
)
from overcast.wire.messages import CONTRIB_PREFIX
from overcast.wire.registration import (
    AGGREGATOR_CHALLENGE,
    AGGREGATOR_MAGIC,
    ANSWER,
    CHALLENGE,
    DEFAULT_AGGREGATOR_PORT,
    HELLO,
    NONCE_BYTES,
    REFUSAL_BYTES,
    REFUSAL_LABEL,
    REFUSAL_MAGIC,
    WELCOME,
    WELCOME_LABEL,
    WELCOME_MAGIC,
    open_refusal,
    open_welcome,
    welcome_bytes,
)

# How long an accepted connection has to answer the challenge.
HANDSHAKE_SECONDS = 5.0


class RendezvousError(OvercastError):
    """The ranks could not meet or connect; the message says which step failed."""


@dataclass
class Links:
    """Everything a communicator's engine needs, fresh from rendezvous."""

    rank: int
    world: int
    address: str
    addresses: list[str]
    streams: dict[int, socket.socket]
    udp: socket.socket
    udp_ports: list[int]
    sealer: Sealer
    opener: Opener
    key: bytes
    job: int
    comm: int
    drops: Drops
    mtu: int  # the smallest path MTU any rank measured to its peers
    group: tuple[str, int]
    multicast: socket.socket | None
    multicast_error: str | None
    # The registration streams to the aggregators (kept open: their closing says one died) and
    # their host:port as OVERCAST_AGGREGATORS names them, by the id of each one's first
    # endpoint, and the aggregator endpoints in-network reductions are striped over, by stripe.
    aggregator_sockets: dict[int, socket.socket] = dataclasses.field(default_factory=dict)
    aggregator_names: dict[int, str] = dataclasses.field(default_factory=dict)
    endpoints: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    aggregator_slots: int = 0
    aggregator_error: str | None = "no aggregator configured (set OVERCAST_AGGREGATORS=host:port)"
    # Registers this rank anew with the aggregator of `peer` (the id of its first endpoint) at
    # `epoch`, its HELLO sealed by `seal`, within `timeout` seconds, restarted after it was
    # lost: its Registration, or why not (register_with_aggregator)
    reregister: (
        Callable[[int, int, Callable[[bytes, int], bytes], float], Registration | str] | None
    ) = None
    # the ranks whose multicast each rank did not hear, alike on every rank (transport.probe):
    # empty where every rank heard every other; and the probes this rank dropped, by why
    multicast_unheard: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    probe_drops: Drops = dataclasses.field(default_factory=Drops)


_server: StoreServer | None = None


def store_from_env(rank: int, timeout: float):
    """The store at MASTER_ADDR:MASTER_PORT, served by rank 0 in this process if need be."""
    global _server
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise RendezvousError(
            "set MASTER_ADDR and MASTER_PORT (as torchrun does), or pass store="
        ) from None
    if rank == 0 and _server is None:
        try:
            _server = StoreServer(host, port)
        except OSError as err:
            raise RendezvousError(
                f"rank 0 cannot serve the rendezvous store on {host}:{port}: {err}"
            ) from None
    return StoreClient(host, port, timeout)


def meeting_host(store=None) -> str:
    """The host the ranks meet at, to pick this host's interface toward it: MASTER_ADDR; else
    the host of the TCPStore `store` is or wraps (a tcp:// init_method); else the address this
    host's name resolves to (gloo's choice where nothing else says, as under file://); else
    loopback."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def local_address(peer_host: str) -> str:
    """The address of this host's interface toward `peer_host` (OVERCAST_ADDR overrides)."""
    override = os.environ.get("OVERCAST_ADDR")
    if override:
        return override
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, 9))
        return probe.getsockname()[0]


def _read_frame(sock: socket.socket, deadline: float) -> bytes:
    head = read_exact(sock, HEADER_BYTES, deadline)
    return head + read_exact(sock, frame_length(head) - HEADER_BYTES, deadline)


def _open_hello(
    frame: bytes, opener: Opener, src: int, size: int, after: int = -1
) -> tuple[int, memoryview] | None:
    """(counter, payload) of an authentic HELLO from `src` of `size` bytes whose counter is
    above `after` (src's HELLO before it in the same handshake), or None."""
    opened = opener.open(frame, after)
    if (
        opened is None
        or opened[0].kind != Kind.HELLO
        or opened[0].src != src
        or len(opened[1]) != size
    ):
        return None
    return opened[0].counter, opened[1]


def _connect_handshake(
    sock: socket.socket, opener: Opener, sealer: Sealer, peer: int, deadline: float
) -> None:
    """The connecting side: answer `peer`'s challenge with it and a nonce of ours; accept only a
    reply that carries ours back."""
    opened = _open_hello(_read_frame(sock, deadline), opener, peer, CHALLENGE.size)
    if opened is None:
        raise ConnectionError(f"rank {peer}'s challenge did not authenticate")
    counter, challenge = opened
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(sealer.seal(Kind.HELLO, 0, peer, 0, ANSWER.pack(bytes(challenge), mine)))
    reply = _open_hello(_read_frame(sock, deadline), opener, peer, NONCE_BYTES, after=counter)
    if reply is None or bytes(reply[1]) != mine:
        raise ConnectionError(f"rank {peer}'s reply is not to this handshake")


class _Accepted:
    """A connection this rank accepted and challenged, until it answers."""

    __slots__ = ("nonce", "due", "buf")

    def __init__(self, nonce: bytes, due: float):
        self.nonce, self.due, self.buf = nonce, due, bytearray()


_ANSWER_FRAME = HEADER_BYTES + ANSWER.size + TAG_BYTES


def _challenge(listener: socket.socket, sealer: Sealer, due: float):
    """Accept a connection and send it a fresh nonce: (socket, _Accepted), or None."""
    try:
        sock, _ = listener.accept()
    except OSError:
        return None
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:  # a few bytes into an empty socket buffer: never blocks
        sock.sendall(sealer.seal(Kind.HELLO, 0, ANY, 0, CHALLENGE.pack(nonce)))
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock, _Accepted(nonce, due)


def _answer(sock: socket.socket, accepted: _Accepted, opener: Opener):
    """(rank, its nonce) once the whole answer is in and carries our nonce; None while it is
    not. ConnectionError if the connection ended or the answer is forged or replayed."""
    try:
        data = sock.recv(_ANSWER_FRAME)
    except BlockingIOError:
        return None
    except OSError:
        data = b""
    if not data:
        raise ConnectionError("closed during handshake")
    accepted.buf += data
    if len(accepted.buf) < _ANSWER_FRAME:
        return None
    try:
        src = unpack_header(accepted.buf).src
    except MalformedError:
        raise ConnectionError("not an overcast frame") from None
    answer = _open_hello(bytes(accepted.buf), opener, src, ANSWER.size)
    if answer is None or ANSWER.unpack(answer[1])[0] != accepted.nonce:
        raise ConnectionError("forged or replayed")
    return src, ANSWER.unpack(answer[1])[1]


def _accept_peers(
    listener: socket.socket,
    rank: int,
    world: int,
    opener: Opener,
    sealer: Sealer,
    deadline: float,
    streams: dict[int, socket.socket],
) -> None:
    """Take the connections of every higher rank, handshaking with all of them at once."""
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    pending: dict[socket.socket, _Accepted] = {}

    def drop(sock: socket.socket, reason: str) -> None:
        opener.drops[reason] += 1
        selector.unregister(sock)
        del pending[sock]
        sock.close()

    try:
        while len(streams) < world - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world)) - set(streams) - {rank})
                raise RendezvousError(
                    f"rank {rank} timed out waiting for ranks {missing} to connect"
                )
            for sock in [s for s, a in pending.items() if now >= a.due]:
                drop(sock, "handshake_timeout")
            wake = min([deadline, *(a.due for a in pending.values())])
            for key, _ in selector.select(max(0.0, wake - now)):
                if key.fileobj is listener:
                    challenged = _challenge(listener, sealer, now + HANDSHAKE_SECONDS)
                    if challenged is not None:
                        pending[challenged[0]] = challenged[1]
                        selector.register(challenged[0], selectors.EVENT_READ)
                    continue
                sock = cast(socket.socket, key.fileobj)  # an accepted connection
                try:
                    answered = _answer(sock, pending[sock], opener)
                except ConnectionError:
                    drop(sock, "handshake_failed")
                    continue
                if answered is None:
                    continue
                src, theirs = answered
                if not rank < src < world or src in streams:
                    drop(sock, "handshake_failed")  # not a higher rank, or a rank twice
                    continue
                selector.unregister(sock)
                del pending[sock]
                sock.setblocking(True)
                try:
                    sock.sendall(sealer.seal(Kind.HELLO, 0, src, 0, theirs))
                except OSError:  # it hung up after answering: it may connect again
                    opener.drops["handshake_failed"] += 1
                    sock.close()
                    continue
                streams[src] = sock
    finally:
        for sock in pending:
            sock.close()
        selector.close()


def rendezvous(
    rank: int,
    world: int,
    *,
    name: str = "default",
    store=None,
    secret: bytes | None = None,
    timeout: float = 60.0,
    aggregators: str | None = None,
) -> Links:
    if not 0 <= rank < world:
        raise RendezvousError(f"rank {rank} is outside world size {world}")
    deadline = time.monotonic() + timeout
    own_store = store is None
    if own_store:
        store = store_from_env(rank, timeout)
    prefix = f"overcast/{name}/"
    try:
        if secret is None and os.environ.get("OVERCAST_SECRET"):
            secret = bytes.fromhex(os.environ["OVERCAST_SECRET"])
        if rank == 0:
            if secret is None:
                secret = secrets.token_bytes(32)
                store.set(prefix + "secret", secret)
            store.set(prefix + "salt", secrets.token_bytes(16))
        if secret is None:
            secret = bytes(store.get(prefix + "secret"))
        salt = bytes(store.get(prefix + "salt"))

        address = local_address(meeting_host(store))
        listener = socket.create_server((address, 0), backlog=max(world, 8))
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((address, 0))
        store.set(
            f"{prefix}addr/{rank}",
            f"{address} {listener.getsockname()[1]} {udp.getsockname()[1]}".encode(),
        )
        peers = [bytes(store.get(f"{prefix}addr/{r}")).decode().split() for r in range(world)]
        # Datagrams are cut into chunks of one size on every rank (their numbering is shared):
        # the smallest path MTU any rank measured to its peers.
        store.set(
            f"{prefix}mtu/{rank}", str(min(path_mtu(address, peer[0]) for peer in peers)).encode()
        )
        mtu = min(int(bytes(store.get(f"{prefix}mtu/{r}"))) for r in range(world))
    except StoreError as err:
        raise RendezvousError(
            f"rendezvous of communicator {name!r} failed on rank {rank}: {err}"
        ) from None
    finally:
        if own_store:
            store.close()

    key = derive_key(secret, salt, b"comm")
    job, comm = job_id_of(secret), int.from_bytes(salt[:4], "little")
    drops = Drops()
    sealer = Sealer(key, job, comm, rank)
    opener = Opener(key, job, comm, drops)
    streams: dict[int, socket.socket] = {}
    try:
        for peer in range(rank):
            host, port = peers[peer][0], int(peers[peer][1])
            try:
                sock = connect_until(host, port, deadline)
            except OSError as err:
                raise RendezvousError(
                    f"rank {rank} cannot connect to rank {peer} at {host}:{port}: {err}"
                ) from None
            try:
                _connect_handshake(sock, opener, sealer, peer, deadline)
            except (OSError, ConnectionError, MalformedError) as err:
                sock.close()
                raise RendezvousError(
                    f"rank {rank} could not handshake with rank {peer} at {host}:{port}: {err}"
                ) from None
            streams[peer] = sock
        _accept_peers(listener, rank, world, opener, sealer, deadline, streams)
        if not own_store:  # every rank has met every other: each has read these
            forget(
                store,
                [f"{prefix}addr/{rank}", f"{prefix}mtu/{rank}"]
                + ([prefix + "salt", prefix + "secret"] if rank == 0 else []),
            )
    except BaseException:
        for sock in streams.values():
            sock.close()
        udp.close()
        raise
    finally:
        listener.close()
    addresses = [p[0] for p in peers]
    loop = addresses.count(address) > 1  # ranks sharing a host hear each other's multicast
    group = multicast_group(comm)
    multicast, multicast_error = None, None
    try:
        prepare_sender(udp, address, loop)
        multicast = open_multicast(address, *group, loop)
    except OSError as err:
        multicast_error = (
            f"cannot join multicast group {group[0]}:{group[1]} on {address}: {err.strerror or err}"
        )
    links = Links(
        rank,
        world,
        address,
        addresses,
        streams,
        udp,
        [int(p[2]) for p in peers],
        sealer,
        opener,
        key,
        job,
        comm,
        drops,
        mtu,
        group,
        multicast,
        multicast_error,
    )
    if world > 1:
        try:
            links.multicast_unheard = {
                r: ranks for r, ranks in prove_delivery(links, deadline).items() if ranks
            }
        except BaseException as err:
            close_links(links)
            if isinstance(err, (OSError, ConnectionError, MalformedError)):
                raise RendezvousError(
                    f"rank {rank} could not prove multicast delivery with "
                    f"its peers of communicator {name!r}: {err}"
                ) from None
            raise
    if aggregators is None:
        aggregators = aggregators_from_env()
    if aggregators:
        register_with_aggregators(links, aggregators, secret, salt, min(timeout, 5.0))
    return links


def close_links(links: Links) -> None:
    """Close every socket of `links` (a rendezvous that failed after meeting)."""
    for sock in [
        *links.streams.values(),
        links.udp,
        links.multicast,
        *links.aggregator_sockets.values(),
    ]:
        if sock is not None:
            sock.close()


def parse_aggregators(spec: str) -> list[tuple[str, int]]:
    """OVERCAST_AGGREGATORS' aggregators, "host[:port],host[:port],...", in order."""
    out = []
    for part in spec.split(","):
        host, _, port = part.strip().partition(":")
        if not host or (port and not port.isdigit()) or not 0 < int(port or 1) < 65536:
            raise ValueError(f"an aggregator is host[:port], not {part.strip()!r} (in {spec!r})")
        out.append((host, int(port) if port else DEFAULT_AGGREGATOR_PORT))
    return out


def register_with_aggregators(
    links: Links, spec: str, secret: bytes, salt: bytes, timeout: float
) -> None:
    """Register this rank with every aggregator `spec` names (parse_aggregators), in order: each
    one's endpoints take the stripes after the ones before it. On any failure, or a refusal
    (its reason), say why in links.aggregator_error (only in-network collectives need it) and
    keep none of them. links.reregister registers anew with one of them later (restarted)."""
    try:
        aggregators = parse_aggregators(spec)
    except ValueError as err:
        links.aggregator_error = str(err)
        return
    where: dict[int, tuple[str, int]] = {}
    for host, port in aggregators:
        first = len(links.endpoints)
        got = register_with_aggregator(links, host, port, first, 0, secret, salt, timeout)
        if isinstance(got, str):
            for sock in links.aggregator_sockets.values():
                sock.close()
            links.aggregator_sockets, links.aggregator_names = {}, {}
            links.endpoints, links.aggregator_slots = [], 0
            links.aggregator_error = got
            return
        where[endpoint(first)] = (host, port)
        links.aggregator_sockets[endpoint(first)] = got.sock
        links.aggregator_names[endpoint(first)] = f"{host}:{port}"
        links.endpoints += [(host, p) for p in got.ports]
        links.aggregator_slots = min(links.aggregator_slots or got.slots, got.slots)
    links.aggregator_error = None
    links.reregister = lambda peer, epoch, seal, timeout: register_with_aggregator(
        links, *where[peer], AGGREGATOR - peer, epoch, secret, salt, timeout, seal
    )


@dataclass
class Registration:
    """This rank registered with an aggregator: the connection that stays open while it serves
    the communicator, its endpoints' datagram ports, and the slots it grants a reduction."""

    sock: socket.socket
    ports: list[int]
    slots: int


def register_with_aggregator(
    links: Links,
    host: str,
    port: int,
    first: int,
    epoch: int,
    secret: bytes,
    salt: bytes,
    timeout: float,
    seal: Callable[[bytes, int], bytes] | None = None,
) -> Registration | str:
    """Register with the aggregator at host:port as the stripes from `first` on, at `epoch`
    (wire.registration): its Registration, or why it failed. `seal(hello, dst)` seals the
    HELLO (default: links.sealer, which only the thread that owns it may use)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except (OSError, UnicodeError) as err:  # UnicodeError: a name IDNA cannot encode
        return f"cannot reach the aggregator at {host}:{port}: {err}"
    try:
        deadline = time.monotonic() + timeout
        magic, challenge = AGGREGATOR_CHALLENGE.unpack(
            read_exact(sock, AGGREGATOR_CHALLENGE.size, deadline)
        )
        if magic != AGGREGATOR_MAGIC:
            raise ConnectionError("it did not greet as an overcast aggregator")
        mine = secrets.token_bytes(NONCE_BYTES)
        widest = chunk_bytes(links.mtu) - CONTRIB_PREFIX.size
        hello = HELLO.pack(
            salt,
            links.world,
            links.udp.getsockname()[1],
            links.multicast is not None,
            widest,
            first,
            epoch,
            challenge,
            mine,
        )
        if seal is None:
            sock.sendall(links.sealer.seal(Kind.HELLO, 0, endpoint(first), 0, hello))
        else:
            sock.sendall(seal(hello, endpoint(first)))
        start = read_exact(sock, len(REFUSAL_MAGIC), deadline)
        if start == REFUSAL_MAGIC:
            refusal = open_refusal(
                derive_key(secret, salt, REFUSAL_LABEL),
                mine,
                start + read_exact(sock, REFUSAL_BYTES - len(start), deadline),
            )
            if refusal is None:
                raise ConnectionError("its refusal did not authenticate")
            sock.close()
            return f"the aggregator at {host}:{port} refused this communicator: {refusal[1]}"
        if start != WELCOME_MAGIC:
            raise ConnectionError("its answer is neither a welcome nor a refusal")
        head = start + read_exact(sock, WELCOME.size - len(start), deadline)
        data = head + read_exact(sock, welcome_bytes(head) - len(head), deadline)
        welcome = open_welcome(derive_key(secret, salt, WELCOME_LABEL), mine, data)
        if welcome is None:
            raise ConnectionError("its answer did not authenticate (another job's aggregator?)")
        slots, ports = welcome
        if not ports or first + len(ports) > MAX_STRIPES:
            raise ConnectionError(
                f"it offers {len(ports)} endpoints after {first}; a job "
                f"stripes over 1 to {MAX_STRIPES}"
            )
    except (OSError, ConnectionError, MalformedError, ValueError) as err:
        sock.close()
        return f"registration with the aggregator at {host}:{port} failed: {err}"
    return Registration(sock, list(ports), slots)
