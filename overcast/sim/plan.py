"""`overcast plan`: a training step of the user's job on a given cluster, against an NCCL-like ring
at line rate, and which to use, with the hardware that answer assumes.

The job: a model (each FSDP unit's parameters, the gathered and reduced dtypes, micro-steps),
its ranks per node (one NIC per node, which the node's ranks share), the path MTU, the cores
overcast's engine may use per node (by default what it uses: a thread per rank), its compute per
layer (given, or the step less its exposed communication as `overcast.fsdp.timed(model)`
measured it), and what sums the in-network reductions: a switch that sums at line rate, software
aggregator hosts (sized for the pair, or a given count), or the one overlap() starts beside
rank 0 when no OVERCAST_AGGREGATORS is named, on node 0's link.

The step is what `overcast.fsdp.overlap` makes of FSDP2 with reshard_after_forward=True and a
prefetch of one layer: per micro-step the forward gathers every layer, the backward gathers each
again while the layer after it is reduce-scattered (the last micro-step only). Two ways:

- ring: an NCCL-like ring at line rate: an AllGather or ReduceScatter of N bytes per rank moves
  (P-1)N each way through each node's NIC, whatever the ranks per node;
- overcast: multicast AllGather (the forward's too, `overlap(unpaired_allgather=None)`) beside
  in-network ReduceScatter: a node's NIC sends its G ranks' shards once and receives the other
  (P-G) ranks' shards; for the ReduceScatter it sends its ranks' whole gradients, G(P-1)M, and
  receives their G results.

Each collective is simulated alone on the cluster (overcast.sim.run, one host per node, each
host's bytes those of its node's G ranks together: exact for what a node sends and what the
aggregators take), then the step's schedule runs against a node's link (overcast.sim.step): the
collectives in flight share each direction max-min, each moving its bytes through the node's NIC
and then taking what its simulated time adds to theirs at line rate (hops' latency, the
aggregators' pace) without the link. overcast's engine pays its CPU per datagram
(the chunk the MTU allows); where it needs more cores than the node gives it, its collectives
stretch by that much. One baseline, the ring, for every speed-up and every verdict.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, replace

from overcast.errors import InvalidArgumentError
from overcast.limits import check_count, check_mtu, check_positive
from overcast.sim.engine import IDEAL, NATIVE, OFFLOAD, AggregatorPool, pool_for
from overcast.sim.run import simulate
from overcast.sim.step import run_step
from overcast.sim.topology import Topology, build
from overcast.transport.datagram import chunk_bytes

WAYS = ("ring", "overcast")
WAY_TEXT = {
    "ring": "an NCCL-like ring at line rate: an AllGather or ReduceScatter of N bytes "
    "per rank moves (P-1)N each way through each node's NIC",
    "overcast": "multicast AllGather beside in-network ReduceScatter, at line rate",
}
# The least share of the ring's step overcast must save to be the choice.
WORTH_SAVING = 0.05
# How many pools the aggregator sizing simulates, each 10% larger than the one before.
SIZING_STEPS = 8
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
# Clusters by name: (topology, radix, nodes, link Gbit/s).
PRESETS: dict[str, tuple[str, int | None, list[int], list[float]]] = {
    "emulated": ("star", None, [4], [0.1]),
    "ethernet-fat-tree": ("fat-tree", 32, [8, 64, 188, 1024], [100, 400, 1600]),
    "rail-400g": ("fat-tree", 64, [64, 256, 1024, 2048], [400]),
}
# What sums the in-network reductions (or a whole number of aggregator hosts).
AGGREGATOR_CHOICES = ("sized", "switch", "beside-rank-0")
# A share of compute the forward takes when a profile does not split it (backward: twice).
FORWARD_SHARE = 1 / 3
# How the step profiles plan reads begin their "what": overcast.fsdp's handle.profile(), and
# overcast train's for its gloo way.
PROFILE_WRITERS = ("overcast.fsdp step profile", "overcast train")


def parse_count(text: str, flag: str) -> int:
    """'7B', '350M', '1.3e9', '125000' -> a whole count."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    s = text.strip().upper()
    try:
        value = float(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else float(s)
    except ValueError:
        raise InvalidArgumentError(
            f"{flag} takes counts such as 7B, 350M, 1.3e9 or 125000, not {text!r}"
        ) from None
    return round(value)


@dataclass(frozen=True)
class Model:
    """Per-layer parameter counts and the dtypes FSDP2 moves them in."""

    layer_params: tuple[int, ...]
    dtype: str = "bf16"
    reduce_dtype: str | None = None
    micro_steps: int = 1

    @classmethod
    def uniform(cls, params: float, layers: int, **kw) -> Model:
        check_positive("the parameter count", params, "--params, params")
        check_count("the layer count", layers, 1, "--layers, layers")
        each = math.ceil(params / layers)
        return cls(tuple([each] * layers), **kw)

    def check(self) -> None:
        for name in (self.dtype, self.reduce_dtype or self.dtype):
            if name not in DTYPE_BYTES:
                raise InvalidArgumentError(
                    f"unknown dtype {name!r}; available: {', '.join(DTYPE_BYTES)}"
                )
        for p in self.layer_params:
            check_count("a layer's parameter count", p, 1, "--layer-params, layer_params")
        check_count("micro-steps", self.micro_steps, 1, "--micro-steps, micro_steps")

    def shards(self, ranks: int) -> list[tuple[int, int]]:
        """(gathered, reduced) bytes per rank of each layer: FSDP2 pads to a multiple of P."""
        gather, reduce = DTYPE_BYTES[self.dtype], DTYPE_BYTES[self.reduce_dtype or self.dtype]
        return [(-(-p // ranks) * gather, -(-p // ranks) * reduce) for p in self.layer_params]


@dataclass(frozen=True)
class Job:
    """How the model runs: `ranks_per_node` sharing each node's NIC, the path `mtu`, the cores
    overcast's engine may use per node (None: one per rank, as its engine is a thread per rank),
    each layer's compute per micro-step (forward, backward seconds; `compute_from` says where
    it came from), and what sums the in-network reductions (AGGREGATOR_CHOICES, or a count of
    aggregator hosts)."""

    ranks_per_node: int = 1
    mtu: int = 9000
    host_cores: float | None = None
    compute: tuple[float, float] = (0.0, 0.0)
    compute_from: str = "none: communication alone"
    aggregators: str | int = "sized"

    def check(self) -> None:
        check_count(
            "the ranks per node", self.ranks_per_node, 1, "--ranks-per-node, ranks_per_node"
        )
        check_mtu(self.mtu)
        if self.host_cores is not None:
            check_positive(
                "the engine's cores per node", self.host_cores, "--host-cores, host_cores"
            )
        if not all(math.isfinite(c) and c >= 0 for c in self.compute):
            raise InvalidArgumentError(
                f"the compute per layer must be finite, 0 ms or more, "
                f"not ({', '.join(f'{c * 1e3:g}' for c in self.compute)})"
                f" ms (--compute-ms, compute)"
            )
        if self.aggregators not in AGGREGATOR_CHOICES and not (
            isinstance(self.aggregators, int) and self.aggregators >= 1
        ):
            raise InvalidArgumentError(
                f"the aggregators must be one of "
                f"{', '.join(AGGREGATOR_CHOICES)} or a count of hosts, "
                f"not {self.aggregators!r} (--aggregators, aggregators)"
            )

    @property
    def cores(self) -> float:
        return float(self.ranks_per_node if self.host_cores is None else self.host_cores)


@dataclass(frozen=True)
class AggregatorSizing:
    """What software aggregator hosts are like, and what "sized" sizes them for: the pair
    within `within` of its floor, on hosts of at most `cores` cores behind NICs of `nic_bits`
    (None: the nodes' link rate)."""

    within: float = 1.10
    cores: int = 16
    nic_bits: float | None = None

    def check(self) -> None:
        check_positive("the bar over the floor", self.within - 1, "--within, within - 1")
        check_count("an aggregator's cores", self.cores, 1, "--aggregator-cores, cores")
        if self.nic_bits is not None:
            check_positive(
                "the aggregators' link rate", self.nic_bits, "--aggregator-link-gbit, nic_bits"
            )


def compute_from_profile(path: str, model: Model) -> tuple[tuple[float, float], str]:
    """Each layer's (forward, backward) compute per micro-step from a step profile (written by
    overcast.fsdp.timed(model)'s handle, or `overcast train` for its gloo way, each naming
    itself under "what"): the step less its exposed communication, split as the profile splits
    it (else a third forward), shared evenly among the model's layers and micro-steps; and words
    saying so. InvalidArgumentError, naming the file, for anything else."""

    def refused(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"--timed {path}: {why}")

    try:
        with open(path) as f:
            profile = json.load(f)
    except OSError as err:
        raise refused((err.strerror or str(err)).lower()) from None
    except ValueError as err:
        raise refused(f"not JSON ({err})") from None
    if (
        not isinstance(profile, dict)
        or not isinstance(profile.get("what"), str)
        or not profile["what"].startswith(PROFILE_WRITERS)
    ):
        raise refused(
            f'not a step profile: its "what" is neither {" nor ".join(map(repr, PROFILE_WRITERS))}'
        )

    def seconds(key: str) -> float:
        value = profile.get(key)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        ):
            return float(value)
        why = (
            " (its exposed communication outlasts its step)"
            if key == "compute_seconds" and isinstance(value, (int, float)) and value < 0
            else ""
        )
        raise refused(
            f"{key} must be a number of seconds, finite and 0 or more, not {value!r}{why}"
        )

    step, exposed, compute = (
        seconds(k) for k in ("step_seconds", "exposed_seconds", "compute_seconds")
    )
    split = (FORWARD_SHARE, 1 - FORWARD_SHARE)
    if "forward_compute_seconds" in profile or "backward_compute_seconds" in profile:
        split = (seconds("forward_compute_seconds"), seconds("backward_compute_seconds"))
        if sum(split) == 0 and compute > 0:
            raise refused(
                f"forward_compute_seconds and backward_compute_seconds are both 0, "
                f"so nothing says how its {compute:g} s of compute split"
            )
    # the rest of the compute (the optimizer) shared between the two as they split
    forward = compute * split[0] / sum(split) if compute else 0.0
    backward = compute - forward
    share = len(model.layer_params) * model.micro_steps
    return (
        (forward / share, backward / share),
        f"timed() in {path}: a step of {step:.3f} s, {exposed:.3f} s of it exposed "
        f"communication, {compute:.3f} s compute",
    )


def _node_bytes(gather: int, reduce: int, nodes: int, g: int) -> dict:
    """What each collective of a layer moves through a node's NIC with `g` ranks per node
    (sent, received), and the bytes per rank a one-rank-per-host simulation needs for it."""
    p = nodes * g
    ring_ag, ring_rs = (p - 1) * gather, (p - 1) * reduce
    return {
        "ring_allgather": ((ring_ag, ring_ag), math.ceil(ring_ag / (nodes - 1))),
        "ring_reduce_scatter": ((ring_rs, ring_rs), math.ceil(ring_rs / (nodes - 1))),
        "multicast": ((g * gather, (p - g) * gather), g * gather),
        "innetwork": (
            (g * (p - 1) * reduce, g * reduce),
            math.ceil(g * (p - 1) * reduce / (nodes - 1)),
        ),
    }


def aggregator_pool(
    job: Job, sizing: AggregatorSizing, model: Model, topo: Topology, chunk: int
) -> tuple[AggregatorPool | None, dict]:
    """What sums the in-network reductions on `topo`, and how the table says it."""
    link = float(topo.rate[topo.uplink[0]] * 8)
    nic = sizing.nic_bits or link
    if job.aggregators == "switch":
        return None, {"placement": "switch", "short": "switch"}
    if job.aggregators == "beside-rank-0":
        pool = AggregatorPool(1, sizing.cores, link)
        return pool, {**pool.describe(), "placement": "beside-rank-0", "short": "rank 0's"}
    if job.aggregators == "sized":
        sized = size_aggregators(model, topo, sizing, job.ranks_per_node, chunk)
        return AggregatorPool(sized["count"], sized["shards"], nic), {
            **sized,
            "placement": "hosts",
            "short": f"{sized['count']:,} x {sized['shards']}",
        }
    assert isinstance(job.aggregators, int)  # Job takes a count where it is not a choice
    pool = AggregatorPool(job.aggregators, sizing.cores, nic)
    return pool, {
        **pool.describe(),
        "placement": "hosts",
        "short": f"{pool.count:,} x {pool.shards}",
    }


def assumes(job: Job, sizing: AggregatorSizing) -> list[str]:
    """The hardware beyond the nodes and the ring's network that overcast's figures assume."""
    nic = "the nodes' link rate" if sizing.nic_bits is None else f"{sizing.nic_bits / 1e9:g} Gbit/s"
    placed: dict[str | int, str] = {
        "switch": "a switch that sums at line rate on every port (SHARP-like)",
        "beside-rank-0": f"one aggregator of {sizing.cores} cores beside rank 0, on node 0's "
        f"link (what overlap() starts without OVERCAST_AGGREGATORS; node 0's own "
        f"traffic on that link is not counted)",
        "sized": f"aggregator hosts of up to {sizing.cores} cores behind links of {nic}, as many "
        f"as the aggregators column says (hosts x cores), sized for the pair within "
        f"{sizing.within:g}x its floor",
    }
    aggregators = placed.get(
        job.aggregators,
        f"{job.aggregators} aggregator host{'s' * (job.aggregators != 1)} "
        f"of {sizing.cores} cores behind links of {nic}",
    )
    return [
        f"IP multicast between the nodes at layer 2 (IGMP snooping and a querier), MTU {job.mtu}",
        aggregators,
        f"overcast's engine on {job.cores:g} core(s) per node, or, for the offloaded "
        f"column, an engine on the NIC",
    ]


def size_aggregators(
    model: Model,
    topo: Topology,
    sizing: AggregatorSizing,
    g: int = 1,
    chunk: int = NATIVE.chunk_bytes,
) -> dict:
    """The aggregator pool the pair needs on `topo` (engine.pool_for, for every rank's
    contributions), grown by 10% at a time until the largest layer's pair, simulated on it,
    holds the bar, at most SIZING_STEPS times: the pool returned is the last simulated, with its
    ratio, and `met` says whether it held the bar (it cannot where the fabric, not the
    aggregators, holds the pair back)."""
    link_bits = float(topo.rate[topo.uplink[0]] * 8)
    pool = pool_for(
        topo.hosts,
        link_bits * g,
        sizing.within,
        chunk_bytes=chunk,
        nic_bits_per_s=sizing.nic_bits or link_bits,
        cores_per_host=sizing.cores,
    )
    gather, reduce = max(model.shards(topo.hosts * g), key=sum)
    moved = _node_bytes(gather, reduce, topo.hosts, g)
    engine = replace(IDEAL, chunk_bytes=chunk)
    for step in range(SIZING_STEPS):
        if step:
            pool = AggregatorPool(
                math.ceil(pool.count * 1.1),
                pool.shards,
                pool.nic_bits_per_s,
                pool.us_per_contribution,
            )
        ratio = simulate(
            "overlap",
            "overcast",
            topo,
            moved["multicast"][1],
            reduce_bytes=moved["innetwork"][1],
            aggregators=pool,
            engine=engine,
        )["ratio_to_floor"]
        if ratio <= sizing.within:
            break
    return {
        **pool.describe(),
        "cores": pool.count * pool.shards,
        "pair_ratio": ratio,
        "within": sizing.within,
        "met": ratio <= sizing.within,
    }


def step_schedule(layers: int, micro_steps: int, forward: float, backward: float) -> list:
    """The training thread's step as overlap() drives FSDP2 (every layer resharded, a prefetch
    of one): ("compute", s), ("post", name, kind, layer), ("wait", name); kind "forward" for
    an AllGather no ReduceScatter meets, "allgather" and "reduce_scatter" in a backward that
    reduces."""
    out: list[tuple] = []
    for m in range(micro_steps):
        sync = m == micro_steps - 1
        out.append(("post", f"AG 0 {m}", "forward", 0))
        for i in range(layers):
            out.append(("wait", f"AG {i} {m}"))
            if i + 1 < layers:
                out.append(("post", f"AG {i + 1} {m}", "forward", i + 1))
            out.append(("compute", forward))
        gather = "allgather" if sync else "forward"
        out.append(("post", f"BAG {layers - 1} {m}", gather, layers - 1))
        for i in reversed(range(layers)):
            out.append(("wait", f"BAG {i} {m}"))
            if i:
                out.append(("post", f"BAG {i - 1} {m}", gather, i - 1))
            out.append(("compute", backward))
            if sync:  # one ReduceScatter in flight at a time (FSDP2's one input buffer)
                if i < layers - 1:
                    out.append(("wait", f"RS {i + 1}"))
                out.append(("post", f"RS {i}", "reduce_scatter", i))
        if sync:
            out.append(("wait", "RS 0"))
    return out


def _layer_times(topo: Topology, moved: dict, pool: AggregatorPool | None, chunk: int) -> dict:
    """Each collective of one layer alone on the cluster: seconds."""
    engine = replace(IDEAL, chunk_bytes=chunk)
    return {
        "ring_allgather": simulate("allgather", "ring", topo, moved["ring_allgather"][1])[
            "seconds"
        ],
        "ring_reduce_scatter": simulate(
            "reduce_scatter", "ring", topo, moved["ring_reduce_scatter"][1]
        )["seconds"],
        "multicast": simulate("allgather", "multicast", topo, moved["multicast"][1])["seconds"],
        "innetwork": simulate(
            "reduce_scatter",
            "innetwork",
            topo,
            moved["innetwork"][1],
            aggregators=pool,
            engine=engine,
        )["seconds"],
    }


def plan_point(
    model: Model, topo: Topology, job: Job = Job(), sizing: AggregatorSizing = AggregatorSizing()
) -> dict:
    """One cluster: each way's step, its exposed communication, the engine cores overcast
    needs, which way to use and why, and the hardware that assumes."""
    nodes, g = topo.hosts, job.ranks_per_node
    link = float(topo.rate[topo.uplink[0]] * 8)
    chunk = chunk_bytes(job.mtu)
    pool, aggregators = aggregator_pool(job, sizing, model, topo, chunk)
    layers = model.shards(nodes * g)
    memo: dict = {}
    moved, times = [], []
    for gather, reduce in layers:
        if (gather, reduce) not in memo:
            m = _node_bytes(gather, reduce, nodes, g)
            memo[(gather, reduce)] = (m, _layer_times(topo, m, pool, chunk))
        moved.append(memo[(gather, reduce)][0])
        times.append(memo[(gather, reduce)][1])
    bytes_per_s = link / 8

    def demand(way: str, stretch: float = 1.0):
        """(sent, received, seconds more) of a collective: the bytes through a node's NIC (by
        `stretch` more where overcast's engine is short of cores: it moves them that much
        slower), then what its simulated time adds to their time at line rate (latency, and
        the aggregators' pace), which takes no bandwidth from the others in flight."""

        def of(kind: str, layer: int) -> tuple[float, float, float]:
            key = (
                ("ring_allgather" if kind != "reduce_scatter" else "ring_reduce_scatter")
                if way == "ring"
                else ("multicast" if kind != "reduce_scatter" else "innetwork")
            )
            (sent, received), _ = moved[layer][key]
            more = max(0.0, times[layer][key] - max(sent, received) / bytes_per_s)
            scale = stretch if way == "overcast" else 1.0
            return sent * scale, received * scale, more

        return of

    schedule = step_schedule(len(layers), model.micro_steps, *job.compute)
    compute = model.micro_steps * len(layers) * sum(job.compute)
    alone = step_schedule(len(layers), model.micro_steps, 0.0, 0.0)
    through = sum(
        sum(m["multicast"][0]) * model.micro_steps * 2 + sum(m["innetwork"][0]) for m in moved
    )  # datagram bytes through a node's NIC per step
    busy = run_step(alone, bytes_per_s, demand("overcast"))
    cores = {
        e.name: through
        * e.us_per_datagram
        * 1e-6
        / (chunk if e is NATIVE else e.chunk_bytes)
        / busy
        for e in (NATIVE, OFFLOAD)
    }
    stretch = max(1.0, cores["native"] / job.cores)
    steps = {
        "ring": run_step(schedule, bytes_per_s, demand("ring")),
        "overcast": run_step(schedule, bytes_per_s, demand("overcast")),
        "overcast_on_host_cores": run_step(schedule, bytes_per_s, demand("overcast", stretch)),
    }
    out = {
        "nodes": nodes,
        "ranks_per_node": g,
        "ranks": nodes * g,
        "link_bits_per_s": link,
        "topology": topo.kind,
        "radix": topo.radix,
        "compute_seconds": compute,
        "ways": {
            "ring": {"step_seconds": steps["ring"], "exposed_seconds": steps["ring"] - compute},
            "overcast": {
                "step_seconds": steps["overcast"],
                "exposed_seconds": steps["overcast"] - compute,
                "step_seconds_on_host_cores": steps["overcast_on_host_cores"],
                "engine_cores_native": cores["native"],
                "engine_cores_offload": cores["offload"],
            },
        },
        "speedup_over_ring": steps["ring"] / steps["overcast_on_host_cores"],
        "speedup_over_ring_offloaded": steps["ring"] / steps["overcast"],
        "aggregators": aggregators,
    }
    out["choice"], out["why"] = _choose(out, job, _held_back(moved, times, bytes_per_s, g))
    return out


def _held_back(moved: list[dict], times: list[dict], bytes_per_s: float, g: int) -> str:
    """What holds overcast's pair back, where something does, in words ("" if nothing)."""
    largest = max(range(len(moved)), key=lambda i: sum(moved[i]["innetwork"][0]))
    (sent, _), _ = moved[largest]["innetwork"]
    slower = times[largest]["innetwork"] / (sent / bytes_per_s)
    if slower > 1.10:
        return (
            f"the aggregators take the ReduceScatter's contributions at 1/{slower:.1f} of "
            f"the nodes' line rate"
        )
    if g > 1:
        return (
            f"each of a node's {g} ranks sends its whole gradient to the aggregators "
            f"through the node's NIC, {g}x what a ring sends"
        )
    return ""


def _choose(point: dict, job: Job, held_back: str) -> tuple[str, str]:
    oc = point["ways"]["overcast"]
    on_host, offloaded = point["speedup_over_ring"], point["speedup_over_ring_offloaded"]
    needed = oc["engine_cores_native"]
    if 1 - 1 / on_host >= WORTH_SAVING:
        return "overcast", (
            f"its step {on_host:.2f}x faster than the ring's, its engine using "
            f"{needed:.2g} of the {job.cores:g} core(s) per node it has"
            if needed <= job.cores
            else f"its step {on_host:.2f}x faster than the ring's with its engine "
            f"short of cores ({needed:.2g} needed per node, {job.cores:g} "
            f"given; {offloaded:.2f}x with enough)"
        )
    if 1 - 1 / offloaded >= WORTH_SAVING:
        return "overcast-offloaded", (
            f"its step {offloaded:.2f}x faster than the ring's with an offloaded engine "
            f"({oc['engine_cores_offload']:.2f} per node; or NCCL's NVLS and CollNet/SHARP); "
            f"overcast's engine would need {oc['engine_cores_native']:.0f} cores per node (of "
            f"{job.cores:g}) and its step take {1 / on_host:.2f}x the ring's"
        )
    text = (
        f"overcast would save {100 * (1 - 1 / offloaded):.0f}% of the ring's step at most"
        if offloaded >= 1
        else f"overcast's step would take {1 / offloaded:.2f}x the ring's"
    )
    return "ring", text + (
        f": {held_back}"
        if held_back
        else ": the step is not bound by its communication's bandwidth here"
    )


def plan(
    model: Model,
    kind: str,
    nodes: list[int],
    link_bits: list[float],
    *,
    radix: int | None = None,
    oversubscription=(1.0,),
    job: Job = Job(),
    sizing: AggregatorSizing = AggregatorSizing(),
    progress=None,
) -> dict:
    """Every (nodes, link rate) of the cluster, as `{"meta": ..., "results": [point, ...]}`."""
    model.check()
    job.check()
    sizing.check()
    topologies = [
        build(kind, n, b, radix=radix, oversubscription=oversubscription)
        for n in nodes
        for b in link_bits
    ]  # every setting checked before any run
    points = []
    for topo in topologies:
        points.append(plan_point(model, topo, job, sizing))
        if progress:
            progress(len(points), len(topologies), f"{topo.hosts} nodes")
    meta = {
        "topology": kind,
        "radix": radix,
        "oversubscription": list(oversubscription),
        "layers": len(model.layer_params),
        "params": sum(model.layer_params),
        "dtype": model.dtype,
        "reduce_dtype": model.reduce_dtype or model.dtype,
        "micro_steps": model.micro_steps,
        "ranks_per_node": job.ranks_per_node,
        "mtu": job.mtu,
        "host_cores": job.cores,
        "compute_per_layer_seconds": list(job.compute),
        "compute_from": job.compute_from,
        "aggregators": job.aggregators,
        "aggregator_sizing": {
            "within": sizing.within,
            "cores": sizing.cores,
            "nic_bits_per_s": sizing.nic_bits,
        },
        "fsdp": "reshard_after_forward=True, prefetch 1; backward AllGather beside the "
        "ReduceScatter of the layer after it",
        "overcast_assumes": assumes(job, sizing),
        "ways": WAY_TEXT,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    return {"meta": meta, "results": points}
