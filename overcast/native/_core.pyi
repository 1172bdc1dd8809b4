"""Type stubs for overcast.native._core, the native core's Python face (module.c, bind_*.c).
Buffers are any object with the buffer protocol; times are time.monotonic() seconds."""

from collections.abc import Sequence
from typing import Any, Literal, TypedDict

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol

SERVE_DEADLINE: int
SERVE_INTERRUPTED: int
MAX_REDUCTIONS: int
MAX_STRIPES: int
OUTBOX_BYTES: int
RESEND_SECONDS: float
MAX_RESEND_SECONDS: float
EXPIRY_SECONDS: float
PORT_PYTHON: int
PORT_RUNS: int
PORT_NEWS: int
PORT_DEADLINE: int
PORT_INTERRUPTED: int
PORT_ERROR: int
ROUTE_AGGREGATOR: int
ROUTE_GROUP: int
ROUTE_RANK: int

def store_u32_fenced(words: Buffer, index: int, value: int) -> None:
    """words[index] = value, a 32-bit word, every store before it made visible first, to a GPU
    too (module.c): a stream gate's word."""

# What the binding returns as dicts, by key (tests/test_native.py checks the keys against it).
class ReducerState(TypedDict):
    """Plane.reducer(seq): an in-network reduction's state in the plane (bind_plane.c)."""

    phase: Literal["sending", "receiving", "drained"]
    progress: int  # steps toward the result
    progress_at: float  # when it last stepped; below 0 before its first
    results: int  # its own block's chunks in place
    k: int  # chunks per block
    credit: int  # chunks released, over every endpoint
    total: int  # chunks of every block
    cursor: int  # the next chunk to contribute
    stripes: int
    bytes: int  # bookkeeping it owns
    duplicate_results: int
    contributions_resent: int
    credit_probes: int
    results_in: int

class GatherState(TypedDict):
    """Plane.gather_state(seq): a multicast gather's state in the plane (bind_gather.c)."""

    missing: list[int]  # chunks missing, by segment
    sent_all: int  # this rank's multicast all sent
    complete: int  # every segment in place
    progress: int
    progress_at: float
    multicast_chunks: int
    duplicate_chunks: int
    repaired_chunks: int
    bytes: int

class PlaneIO(TypedDict):
    """Plane.counters()'s third: what the plane read and wrote (bind_plane.c)."""

    datagram_reads: int
    datagrams_in: int
    datagrams_out: int
    datagram_bytes_in: int
    truncated_reads: int
    data_path_cpu_seconds: float
    wakeups: int
    gro: int  # whether the socket coalesces datagrams
    gso: int  # whether it segments them

class ShardsMemory(TypedDict):
    """Shards.counters()'s third: the pools of every shard (bind_shards.c)."""

    pool_bytes: int
    peak_pool_bytes: int
    kept_pool_bytes: int
    engine_communicators: int

class ShardsIO(TypedDict):
    """Shards.counters()'s fourth: what the shards read and wrote, and each one's share."""

    reads: int
    sends: int
    datagrams_in: int
    datagrams_out: int
    wakeups: int
    gro: int
    gso: int
    serve_cpu_seconds: list[float]  # by shard
    serve_contributions: list[int]  # by shard

class Sealer:
    """AES-GMAC sealing under one key, with the sender's one counter (bind_wire.c)."""

    counter: int  # the last counter spent; may be set only forward
    def __init__(self, key: bytes, job: int, comm: int, src: int) -> None: ...
    def seal_into(
        self,
        buf: Buffer,
        offset: int,
        kind: int,
        seq: int,
        dst: int,
        chunk: int,
        payload: Buffer | tuple[Buffer, ...],
    ) -> int: ...
    def seal_detached(
        self, kind: int, seq: int, dst: int, chunk: int, payload: Buffer | tuple[Buffer, ...]
    ) -> bytes: ...

class TagCheck:
    """AES-GMAC tags checked under one key (bind_wire.c)."""
    def __init__(self, key: bytes) -> None: ...
    def check(self, message: Buffer, src: int, counter: int) -> bool: ...
    def open_stream(
        self, buffer: Buffer, end: int, job: int, comm: int, peer: int, next_counter: int
    ) -> tuple[list[tuple], int, int, int, int, tuple[int, int, int]]: ...

class Budget:
    """A link direction's token bucket (bind_budget.c)."""

    rate: float
    batch: int
    reduction_batch: int
    burst: float
    tokens: float
    reductions_in_flight: int
    gathers_in_flight: int
    def __init__(
        self,
        rate: float = 0.0,
        burst_seconds: float = 0.005,
        batch: int = 1,
        datagram_bytes: int = 0,
        reduction_batch: int = 0,
    ) -> None: ...
    def take(self, nbytes: float, now: float) -> None: ...
    def try_take(self, nbytes: float, now: float) -> bool: ...
    def ready_at(self, nbytes: float, now: float) -> float: ...

class Plane:
    """A rank's datagram plane and, attached to its sockets, its GIL-free loop (bind_plane.c,
    bind_gather.c)."""

    keyed: bool
    attached: bool
    def __init__(
        self,
        rank: int,
        world: int,
        job: int = 0,
        comm: int = 0,
        key: bytes | None = None,
        sealer: Sealer | None = None,
    ) -> None: ...
    def set_loss(self, rate: float, burst: float, seed: int) -> None: ...
    def set_stripes(self, stripes: int) -> None: ...
    def set_address(self, route: int, rank: int, ipv4: str | bytes, port: int) -> None: ...
    def attach(self, udp_fd: int, multicast_fd: int, selector_fd: int) -> None: ...
    def detach(self) -> None: ...
    def serve(self, until: float) -> int: ...
    def runs(self) -> tuple[bytes | None, list[tuple]]: ...
    def feed(self, datagrams: Buffer, segment: int, now: float) -> None: ...
    def receive_run(
        self,
        kind: int,
        seq: int,
        src: int,
        dst: int,
        length: int,
        chunks: Sequence[int],
        data: Buffer,
        offset: int,
        stride: int,
        now: float,
    ) -> bool: ...
    def reduce(
        self,
        seq: int,
        dtype: int,
        avg: bool,
        count: int,
        input: Buffer,
        output: Buffer,
        chunk_bytes: int,
        slots: int,
        group: int,
        budget: Budget,
        now: float,
    ) -> None: ...
    def news(self) -> list[int]: ...
    def release(self, seq: int) -> None: ...
    def set_lanes(self, endpoints: Sequence[int]) -> None: ...
    def heard(self, endpoint: int) -> float | None: ...
    def reducer(self, seq: int) -> ReducerState | None: ...
    def gather(
        self,
        seq: int,
        buffer: Buffer,
        segments: Sequence[tuple[int, int]],
        segment_bytes: int,
        chunk_bytes: int,
        mine: int,
        concurrent: int,
        budget: Budget,
    ) -> None: ...
    def gather_activate(self, seq: int, now: float) -> None: ...
    def gather_streams_ended(self, seq: int) -> bool: ...
    def gather_store(
        self, seq: int, first: int, payload: Buffer, now: float
    ) -> tuple[int, int]: ...
    def gather_have(self, seq: int, first: int, count: int) -> int: ...
    def gather_request(self, seq: int, segment: int, lo: int, hi: int) -> bool: ...
    def gather_requests(self, seq: int) -> list[tuple[int, int]]: ...
    def gather_state(self, seq: int) -> GatherState | None: ...
    def timer(self) -> float | None: ...
    def handle_timer(self, now: float) -> None: ...
    def take_outbox(self) -> list[tuple]: ...
    def send(self, route: int, messages: Sequence[tuple]) -> None: ...
    def set_trace(self, bin_seconds: float) -> None: ...
    def trace_bins(self) -> list[tuple[str, int, int, int]]: ...
    def drops(self) -> dict[str, int]: ...
    def counters(self) -> tuple[dict[str, int], dict[str, int], PlaneIO]: ...
    def memory(self) -> tuple[int, int]: ...

class Aggregator:
    """One reduction engine of the aggregator, sans I/O (bind_aggregator.c)."""
    def __init__(self, slots: int, expiry: float = ...) -> None: ...
    def register(
        self,
        job: int,
        comm: int,
        world: int,
        slots: int = 0,
        key: bytes | None = None,
        counter: int = 0,
        max_row: int = ...,
        stripe: int = 0,
    ) -> tuple[int, int]: ...
    def unregister(self, handle: int) -> None: ...
    def set_address(
        self, handle: int, rank: int, ipv4: str | bytes, port: int, hears_group: bool
    ) -> None: ...
    def set_group(self, handle: int, ipv4: str | bytes, port: int) -> None: ...
    def receive_run(
        self,
        handle: int,
        kind: int,
        seq: int,
        src: int,
        dst: int,
        length: int,
        chunks: Sequence[int],
        data: Buffer,
        offset: int,
        stride: int,
        now: float,
    ) -> bool: ...
    def feed(self, datagrams: Buffer, segment: int, now: float) -> None: ...
    def timer(self) -> float | None: ...
    def handle_timer(self, now: float) -> None: ...
    def take_outbox(self) -> list[tuple]: ...
    def flush(self) -> list[tuple[int, int, bytes, int]]: ...
    def counters(self) -> tuple[dict[str, int], dict[str, int]]: ...
    def memory(self) -> tuple[int, int, int]: ...
    def resend_timeout(self, handle: int, owner: int) -> float: ...
    def reductions(self, handle: int) -> list[tuple[int, bool]]: ...

class Shards:
    """The aggregator's data path over cores: shard threads (bind_shards.c)."""
    def __init__(self, slots: int, expiry: float, fds: Sequence[int]) -> None: ...
    def start(self) -> None: ...
    def register(
        self,
        job: int,
        comm: int,
        world: int,
        first: int,
        slots: int,
        key: bytes,
        counter: int,
        max_row: int,
    ) -> tuple[int, int]: ...
    def unregister(self, handle: int) -> None: ...
    def comm_bytes(self, world: int, slots: int, max_row: int) -> int: ...
    def set_address(
        self, handle: int, rank: int, ipv4: str | bytes, port: int, hears_group: bool
    ) -> None: ...
    def set_group(self, handle: int, ipv4: str | bytes, port: int) -> None: ...
    def counters(self) -> tuple[dict[str, int], dict[str, int], ShardsMemory, ShardsIO]: ...
    def close(self) -> None: ...
