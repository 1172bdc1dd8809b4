"""What moving bytes costs the engine that moves them: CPU per datagram and per stream byte,
headers on the wire, and the pacing share.

An engine is the thing on each host that runs the protocol: overcast's engine on the host CPU
(its datagrams in the native core, its rings' streams in Python), or an offloaded one (the
paper's SmartNIC data-path accelerator). It spends `us_per_datagram` of one core on every
datagram a host sends or receives, and `stream_s_per_gib` per GiB a ring's TCP stream sends or
receives. The simulator turns that into a constraint per host (`cores` core-seconds per
second), so a run says when the CPU, not the link, is the floor, and how many cores the link
rate asks for.

`IDEAL` costs nothing and adds no headers: the closed forms hold exactly under it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from overcast.errors import InvalidArgumentError
from overcast.wire.header import ETHERNET_BYTES, IP_UDP_BYTES, OVERHEAD_BYTES

GIB = 1 << 30
# TCP/IP and Ethernet headers per 1448-byte segment of a ring's stream (MTU 1500; the
# emulated cluster's MTU 9000 carries 8948 per segment).
TCP_SEGMENT_HEADERS = 20 + 32 + ETHERNET_BYTES


@dataclass(frozen=True)
class Engine:
    name: str
    chunk_bytes: int = 8920  # payload per datagram
    us_per_datagram: float = 0.0  # CPU per datagram sent or received, per host
    stream_s_per_gib: float = 0.0  # CPU per GiB a ring stream sends or receives
    aggregator_us_per_datagram: float = 0.0  # the aggregator's CPU per datagram (if software)
    datagram_headers: int = 0  # wire bytes per datagram beyond its payload
    stream_headers_per_byte: float = 0.0  # wire bytes per stream payload byte, beyond it
    pacing_share: float = 1.0  # the share of a link datagram senders may fill
    cores: float = math.inf  # engine cores per host
    note: str = ""

    @property
    def datagram_wire(self) -> float:
        """Wire bytes per datagram payload byte."""
        return 1 + self.datagram_headers / self.chunk_bytes

    @property
    def stream_wire(self) -> float:
        return 1 + self.stream_headers_per_byte

    def cpu_per_byte(self, datagram: bool) -> float:
        """Core-seconds per payload byte sent or received."""
        if datagram:
            return self.us_per_datagram * 1e-6 / self.chunk_bytes
        return self.stream_s_per_gib / GIB

    def with_cores(self, cores: float) -> Engine:
        return replace(self, cores=cores)


IDEAL = Engine("ideal", note="no CPU cost, no headers, senders may fill the whole link")

# Measured with `overcast bench` on the emulated cluster (8 hosts, 400 Mbit/s, 4 MiB, MTU 9000,
# medians of three runs at commit aa969d5; docs/results.md, "Calibrating the simulator"): the
# overlapped pair's CPU per rank (every thread) over the datagrams each rank sent and received,
# the aggregator's data path over the P²·K datagrams it handled, the ring pair's CPU per GiB
# sent and received. Multicast senders fill the whole link.
NATIVE = Engine(
    "native",
    chunk_bytes=8920,
    us_per_datagram=5.6,
    stream_s_per_gib=0.77,
    aggregator_us_per_datagram=4.5,
    datagram_headers=OVERHEAD_BYTES + IP_UDP_BYTES + ETHERNET_BYTES,
    stream_headers_per_byte=TCP_SEGMENT_HEADERS / 8948,
    pacing_share=1.0,
    cores=1.0,
    note="overcast's engine on the host CPU (datagrams in its native core, rings' streams in "
    "Python), one core per host, as measured by overcast bench",
)

# The paper (SC24, arXiv 2408.13356): a SmartNIC data-path accelerator sustains line rate at
# 1.6 Tbit/s with 4 KiB chunks: 4096 B / 200 GB/s = 20.5 ns per chunk in one direction.
OFFLOAD = Engine(
    "offload",
    chunk_bytes=4096,
    us_per_datagram=4096 / 200e9 * 1e6,
    datagram_headers=OVERHEAD_BYTES + IP_UDP_BYTES + ETHERNET_BYTES,
    stream_headers_per_byte=TCP_SEGMENT_HEADERS / 1448,
    pacing_share=1.0,
    cores=math.inf,
    note="the paper's offloaded engine: one keeps up with 1.6 Tbit/s of 4 KiB chunks",
)

ENGINES = {e.name: e for e in (IDEAL, NATIVE, OFFLOAD)}

# One shard of overcast's software aggregator: 1.15 GB/s of 8,980-byte contributions, i.e.
# 7.8 us of wall-clock service per contribution (its data path's own CPU is 4.2-4.8 us of that;
# the kernel's receive path the rest). Measured on the 16-core GPU machine, 8 hosts x 4 MiB:
# in-network ReduceScatter 204.8 ms at 2 Gbit/s and 203.5 ms at 4, for 235 MB of contributions.
AGGREGATOR_US_PER_CONTRIBUTION = 7.8


@dataclass(frozen=True)
class AggregatorPool:
    """The software aggregators in-network reductions are striped over: `count` hosts, each
    with `shards` cores, each core serving a contribution in `us_per_contribution` of wall
    time, each host behind a NIC of `nic_bits_per_s` per direction (None: line rate on every
    port, as a switch's own compute). Striping spreads the contributions evenly over every
    shard of every host, so the pool is one capacity: its cores, and its NICs."""

    count: int = 1
    shards: int = 1
    nic_bits_per_s: float | None = None
    us_per_contribution: float = AGGREGATOR_US_PER_CONTRIBUTION

    def check(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 1):
            raise InvalidArgumentError(
                f"the aggregators must be 1 or more, not {self.count} (--aggregators, count)"
            )
        if not (isinstance(self.shards, int) and self.shards >= 1):
            raise InvalidArgumentError(
                f"the shards per aggregator must be 1 or more, not {self.shards} (--shards, shards)"
            )
        if self.nic_bits_per_s is not None and not self.nic_bits_per_s > 0:
            raise InvalidArgumentError(
                "the aggregators' link rate must be above 0 "
                "(--aggregator-link-gbit, nic_bits_per_s)"
            )

    def core_bytes_per_s(self, chunk_bytes: int) -> float:
        """Contribution payload one shard takes per second."""
        return chunk_bytes / (self.us_per_contribution * 1e-6)

    def describe(self) -> dict:
        return {
            "count": self.count,
            "shards": self.shards,
            "nic_bits_per_s": self.nic_bits_per_s,
            "us_per_contribution": self.us_per_contribution,
        }


def pool_for(
    hosts: int,
    link_bits: float,
    within: float,
    *,
    chunk_bytes: int,
    nic_bits_per_s: float | None = None,
    cores_per_host: int = 16,
    us_per_contribution: float = AGGREGATOR_US_PER_CONTRIBUTION,
) -> AggregatorPool:
    """The smallest pool that takes the contributions of `hosts` whose uplinks, at `link_bits`
    each, carry nothing else, at 1/`within` of that rate: the most a ReduceScatter's or a
    pair's contributions can ask. Hosts behind NICs of `nic_bits_per_s` (default: the hosts'
    rate), each with at most `cores_per_host` shards."""
    nic = link_bits if nic_bits_per_s is None else nic_bits_per_s
    need = hosts * link_bits / 8 / within  # contribution bytes/s
    per_core = chunk_bytes / (us_per_contribution * 1e-6)
    cores = math.ceil(need / per_core)
    count = max(math.ceil(need / (nic / 8)), math.ceil(cores / cores_per_host))
    return AggregatorPool(count, math.ceil(cores / count), nic, us_per_contribution)


def engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown engine {name!r}; available: {', '.join(ENGINES)}"
        ) from None
