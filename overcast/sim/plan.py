"""`overcast plan`: a training step's communication on a given cluster, three ways, and which to
use.

The step is what `overcast.fsdp.overlap` makes of FSDP2 with reshard_after_forward=True: per
micro-step, the forward pass gathers every layer's parameters (an AllGather of the layer's
shard, in the gathered dtype) and the backward pass gathers them again while the previous
layer's gradients are reduce-scattered (in the reduce dtype). The three ways:

- rings: one process group, as gloo and NCCL run FSDP2 by default: each layer's backward
  AllGather and ReduceScatter share one ring schedule, one after the other;
- rings-separate: the ReduceScatter on a process group of its own, so the two rings overlap
  (they then share both directions of every link: no faster on the wire, only less exposed);
- overcast: multicast AllGather beside in-network ReduceScatter, overlapped; the forward's
  AllGathers multicast too (`overlap(model, unpaired_allgather=None)`). overlap() runs them on
  its ring by default, which on a few ranks costs less per call; here, with no per-call cost in
  the engine model, the two take the same time, multicast with less CPU per byte, and at a
  thousand ranks the ring's P-1 steps make it latency-bound.

Each collective is simulated (overcast.sim.run) on the cluster; the engine cores each way needs
come from the engine cost model: cores = CPU-seconds per host / seconds of communication, for
overcast's engine on the host CPU (datagrams in its native core; rings: its TCP streams) and
for an offloaded one (rings: NCCL on the GPU, no host CPU). With the host's engine and
`host_cores` cores per host, a way whose CPU needs more than that takes CPU-seconds /
host_cores instead.

overcast's in-network ReduceScatter needs something that sums. A switch that reduces (SHARP)
does it at line rate on every port; overcast's software aggregator does it at the cost measured
per contribution (overcast.sim.engine.AGGREGATOR_US_PER_CONTRIBUTION) per core. Each point says
how many aggregator hosts (behind NICs of `aggregator_nic_bits`, default the hosts' rate) of at
most `aggregator_cores` cores it takes for the pair to hold `within` times its floor
(engine.pool_for), and confirms it by simulating the largest layer's pair on that pool.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

from overcast.errors import InvalidArgumentError
from overcast.limits import check_count, check_positive
from overcast.sim.engine import NATIVE, OFFLOAD, AggregatorPool, pool_for
from overcast.sim.run import simulate
from overcast.sim.topology import Topology, build

WAYS = ("rings", "rings-separate", "overcast")
WAY_TEXT = {"rings": "rings, one group (gloo/NCCL default)",
            "rings-separate": "rings, ReduceScatter on its own group",
            "overcast": "overcast: multicast + in-network, overlapped"}
# The least share of the rings' time overcast must save to be the choice.
WORTH_SAVING = 0.05
# How many pools the aggregator sizing simulates, each 10% larger than the one before.
SIZING_STEPS = 8
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
# Clusters by name: (topology, radix, nodes, link Gbit/s).
PRESETS = {
    "emulated": ("star", None, [8], [0.1]),
    "ethernet-fat-tree": ("fat-tree", 32, [8, 64, 188, 1024], [100, 400, 1600]),
    "rail-400g": ("fat-tree", 64, [64, 256, 1024, 2048], [400]),
}


def parse_count(text: str, flag: str) -> int:
    """'7B', '350M', '1.3e9', '125000' -> a whole count."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    s = text.strip().upper()
    try:
        value = float(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else float(s)
    except ValueError:
        raise InvalidArgumentError(f"{flag} takes counts such as 7B, 350M, 1.3e9 or 125000, "
                                   f"not {text!r}") from None
    return round(value)


@dataclass(frozen=True)
class Model:
    """Per-layer parameter counts and the dtypes FSDP2 moves them in."""

    layer_params: tuple[int, ...]
    dtype: str = "bf16"
    reduce_dtype: str | None = None
    micro_steps: int = 1

    @classmethod
    def uniform(cls, params: float, layers: int, **kw) -> "Model":
        check_positive("the parameter count", params, "--params, params")
        check_count("the layer count", layers, 1, "--layers, layers")
        each = math.ceil(params / layers)
        return cls(tuple([each] * layers), **kw)

    def check(self) -> None:
        for name in (self.dtype, self.reduce_dtype or self.dtype):
            if name not in DTYPE_BYTES:
                raise InvalidArgumentError(f"unknown dtype {name!r}; available: "
                                           f"{', '.join(DTYPE_BYTES)}")
        for p in self.layer_params:
            check_count("a layer's parameter count", p, 1, "--layer-params, layer_params")
        check_count("micro-steps", self.micro_steps, 1, "--micro-steps, micro_steps")

    def shards(self, ranks: int) -> list[tuple[int, int]]:
        """(gathered, reduced) bytes per rank of each layer: FSDP2 pads to a multiple of P."""
        gather, reduce = DTYPE_BYTES[self.dtype], DTYPE_BYTES[self.reduce_dtype or self.dtype]
        return [(-(-p // ranks) * gather, -(-p // ranks) * reduce) for p in self.layer_params]


@dataclass(frozen=True)
class AggregatorSizing:
    """What the software aggregators are sized for: the pair within `within` of its floor, on
    hosts of at most `cores` cores behind NICs of `nic_bits` (None: the hosts' link rate)."""

    within: float = 1.10
    cores: int = 16
    nic_bits: float | None = None

    def check(self) -> None:
        check_positive("the bar over the floor", self.within - 1, "--within, within - 1")
        check_count("an aggregator's cores", self.cores, 1, "--aggregator-cores, cores")
        if self.nic_bits is not None:
            check_positive("the aggregators' link rate", self.nic_bits,
                           "--aggregator-link-gbit, nic_bits")


def size_aggregators(model: Model, topo: Topology, sizing: AggregatorSizing) -> dict:
    """The aggregator pool the pair needs on `topo` (engine.pool_for), grown by 10% at a time
    until the largest layer's pair, simulated on it, holds the bar, at most SIZING_STEPS times:
    the pool returned is the last simulated, with its ratio, and `met` says whether it held the
    bar (it cannot where the fabric, not the aggregators, holds the pair back)."""
    link_bits = float(topo.rate[topo.uplink[0]] * 8)
    pool = pool_for(topo.hosts, link_bits, sizing.within, chunk_bytes=NATIVE.chunk_bytes,
                    nic_bits_per_s=sizing.nic_bits, cores_per_host=sizing.cores)
    gather, reduce = max(model.shards(topo.hosts), key=sum)
    for step in range(SIZING_STEPS):
        if step:
            pool = AggregatorPool(math.ceil(pool.count * 1.1), pool.shards, pool.nic_bits_per_s,
                                  pool.us_per_contribution)
        ratio = simulate("overlap", "overcast", topo, gather, reduce_bytes=reduce,
                         aggregators=pool)["ratio_to_floor"]
        if ratio <= sizing.within:
            break
    return {**pool.describe(), "cores": pool.count * pool.shards, "pair_ratio": ratio,
            "within": sizing.within, "met": ratio <= sizing.within}


def plan_point(model: Model, topo: Topology, host_cores: float,
               sizing: AggregatorSizing = AggregatorSizing()) -> dict:
    """One cluster: each way's forward and backward communication per step, the engine cores
    it needs, which to use, and the software aggregators overcast's pair needs."""
    seconds = {w: [0.0, 0.0] for w in WAYS}   # forward, backward
    moved = {w: [0.0, 0.0] for w in WAYS}     # bytes through the busiest NIC: stream, datagram
    memo: dict = {}
    for gather, reduce in model.shards(topo.hosts):
        if (gather, reduce) not in memo:
            memo[(gather, reduce)] = _layer(topo, gather, reduce)
        for way, (fwd, bwd, stream, datagram) in memo[(gather, reduce)].items():
            seconds[way][0] += fwd * model.micro_steps
            seconds[way][1] += bwd * model.micro_steps
            moved[way][0] += stream * model.micro_steps
            moved[way][1] += datagram * model.micro_steps
    out = {"nodes": topo.hosts, "link_bits_per_s": float(topo.rate[topo.uplink[0]] * 8),
           "topology": topo.kind, "radix": topo.radix, "ways": {}}
    for way in WAYS:
        total = sum(seconds[way])
        cpu = {name: moved[way][0] * e.cpu_per_byte(False) + moved[way][1] * e.cpu_per_byte(True)
               for name, e in (("native", NATIVE), ("offload", OFFLOAD))}
        out["ways"][way] = {
            "forward_seconds": seconds[way][0], "backward_seconds": seconds[way][1],
            "seconds": total,
            "engine_cores_native": cpu["native"] / total, "engine_cores_offload":
                cpu["offload"] / total,
            "seconds_on_host_cores": max(total, cpu["native"] / host_cores)}
    out["speedup_over_rings"] = out["ways"]["rings"]["seconds"] / out["ways"]["overcast"]["seconds"]
    out["speedup_over_rings_separate"] = (out["ways"]["rings-separate"]["seconds"]
                                          / out["ways"]["overcast"]["seconds"])
    out["choice"], out["why"] = _choose(out, host_cores)
    out["aggregators"] = size_aggregators(model, topo, sizing)
    return out


def _layer(topo: Topology, gather: int, reduce: int) -> dict:
    """(forward s, backward s, stream bytes, datagram bytes through a NIC) per way, one layer."""
    ag_ring = simulate("allgather", "ring", topo, gather)
    ag_mcast = simulate("allgather", "multicast", topo, gather)
    rs_ring = simulate("reduce_scatter", "ring", topo, reduce)
    pair_ring = simulate("overlap", "ring", topo, gather, reduce_bytes=reduce)
    pair = simulate("overlap", "overcast", topo, gather, reduce_bytes=reduce)

    def nic(*rows):
        return sum(r["tx_bytes_per_nic_max"] + r["rx_bytes_per_nic_max"] for r in rows)

    return {"rings": (ag_ring["seconds"], ag_ring["seconds"] + rs_ring["seconds"],
                      nic(ag_ring, ag_ring, rs_ring), 0.0),
            "rings-separate": (ag_ring["seconds"], pair_ring["seconds"],
                               nic(ag_ring, pair_ring), 0.0),
            "overcast": (ag_mcast["seconds"], pair["seconds"], 0.0, nic(ag_mcast, pair))}


def _choose(point: dict, host_cores: float) -> tuple[str, str]:
    ways = point["ways"]
    oc, rings = ways["overcast"], ways["rings"]
    best_ring = min(("rings", "rings-separate"), key=lambda w: ways[w]["seconds"])
    gain = ways[best_ring]["seconds"] / oc["seconds"]
    saving = 1 - 1 / gain
    if saving < WORTH_SAVING:
        return best_ring, (f"overcast would save {100 * saving:.0f}% at most: the "
                           f"step's communication is not bandwidth-bound here")
    if oc["engine_cores_native"] <= host_cores:
        return "overcast", (f"communication {gain:.2f}x faster than {best_ring}; "
                            f"overcast's engine needs {oc['engine_cores_native']:.1f} "
                            f"cores per host at this rate (of {host_cores:g})")
    return "overcast-offloaded", (
        f"communication {gain:.2f}x faster than {best_ring} with an offloaded engine "
        f"(or NCCL's NVLS + CollNet/SHARP), which needs {oc['engine_cores_offload']:.2f} "
        f"engines per host; "
        f"overcast's engine would need {oc['engine_cores_native']:.0f} cores per host "
        f"(of {host_cores:g}) and take {oc['seconds_on_host_cores'] / rings['seconds']:.1f}x "
        f"the rings' time")


def plan(model: Model, kind: str, nodes: list[int], link_bits: list[float], *,
         radix: int | None = None, oversubscription=(1.0,), host_cores: float = 8.0,
         sizing: AggregatorSizing = AggregatorSizing(), progress=None) -> dict:
    """Every (nodes, link rate) of the cluster, as `{"meta": ..., "results": [point, ...]}`."""
    model.check()
    sizing.check()
    check_positive("the host's cores", host_cores, "--host-cores, host_cores")
    topologies = [build(kind, n, b, radix=radix, oversubscription=oversubscription)
                  for n in nodes for b in link_bits]  # every setting checked before any run
    points = []
    for topo in topologies:
        points.append(plan_point(model, topo, host_cores, sizing))
        if progress:
            progress(len(points), len(topologies), f"{topo.hosts} nodes")
    meta = {"topology": kind, "radix": radix, "oversubscription": list(oversubscription),
            "layers": len(model.layer_params), "params": sum(model.layer_params),
            "dtype": model.dtype, "reduce_dtype": model.reduce_dtype or model.dtype,
            "micro_steps": model.micro_steps, "host_cores": host_cores,
            "aggregator_sizing": {"within": sizing.within, "cores": sizing.cores,
                                  "nic_bits_per_s": sizing.nic_bits},
            "fsdp": "reshard_after_forward=True; backward AllGather beside ReduceScatter",
            "ways": WAY_TEXT,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return {"meta": meta, "results": points}
