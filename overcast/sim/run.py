"""One simulated collective, as a row `overcast simulate` prints and writes.

Field names follow `overcast bench` where a field means the same thing (collective, algorithm,
bytes_per_rank, link_bits_per_s, seconds, floor_seconds, ratio_to_floor, algbw/busbw, roots).
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from dataclasses import asdict

import numpy as np

from overcast.limits import check_hosts, check_link_rate, check_positive, check_roots, check_size
from overcast.schedules import cost
from overcast.sim.collectives import ALGORITHMS, check_request, collective_flows
from overcast.sim.engine import IDEAL, AggregatorPool, Engine
from overcast.sim.flows import Constraint, Flow, run_flows
from overcast.sim.topology import DEFAULT_LATENCY_S, Topology, build, placement


def engine_constraints(
    flows: list[Flow],
    topo: Topology,
    hosts: list[int],
    engine: Engine,
    shared_cores: float | None = None,
    aggregators: AggregatorPool | None = None,
) -> tuple[list[Constraint], np.ndarray]:
    """Each host's pacing budget (datagram senders fill `pacing_share` of its uplink) and its
    engine's CPU (`engine.cores` core-seconds per second). Or, with `shared_cores`, the emulated
    cluster: one machine's cores for every host and the software aggregator together. With
    `aggregators`, reductions are summed by that pool of software aggregators: its shards'
    wall time per contribution and its NICs bound them; with `shared_cores` alone, by one
    aggregator of one core at the engine's CPU per datagram. Otherwise switches sum in
    hardware, at no cost.

    Also returns each host's CPU-seconds per byte/s of each flow (hosts x flows)."""
    index = np.empty(topo.hosts, dtype=np.int64)
    index[hosts] = np.arange(len(hosts))
    cpu = np.zeros((len(hosts), len(flows)))
    budget = np.zeros((len(hosts), len(flows)))
    aggregator_cpu = np.zeros(len(flows))
    into, out_of = np.zeros(len(flows)), np.zeros(len(flows))  # the aggregators' NIC bytes
    for f, flow in enumerate(flows):
        senders, per_byte = index[list(flow.senders)], engine.cpu_per_byte(flow.datagram)
        cpu[senders, f] += per_byte
        cpu[index[list(flow.receivers)], f] += per_byte
        if flow.datagram:
            budget[senders, f] = flow.wire
            if len(senders) > 1:  # a reduction: every contribution in, the sum out
                aggregator_cpu[f] = (
                    (
                        len(senders) * aggregators.us_per_contribution
                        if aggregators
                        else (len(senders) + 1) * engine.aggregator_us_per_datagram
                    )
                    * 1e-6
                    / engine.chunk_bytes
                )
                into[f], out_of[f] = len(senders) * flow.wire, flow.wire
    out = []
    if engine.pacing_share < 1:
        rates = topo.rate[topo.uplink[hosts]] * engine.pacing_share
        out += [
            Constraint(f"budget h{h}", rates[i], budget[i])
            for i, h in enumerate(hosts)
            if budget[i].any()
        ]
    if aggregator_cpu.any() and (aggregators or shared_cores is not None):
        pool = aggregators or AggregatorPool()
        out.append(Constraint("aggregator cpu", pool.count * pool.shards, aggregator_cpu))
        if pool.nic_bits_per_s:
            nics = pool.count * pool.nic_bits_per_s / 8
            out += [
                Constraint("aggregator links in", nics, into),
                Constraint("aggregator links out", nics, out_of),
            ]
    if shared_cores is not None:
        out.append(Constraint("machine cpu", shared_cores, cpu.sum(axis=0) + aggregator_cpu))
    elif np.isfinite(engine.cores):
        out += [
            Constraint(f"cpu h{h}", engine.cores, cpu[i])
            for i, h in enumerate(hosts)
            if cpu[i].any()
        ]
    return out, cpu


def simulate(
    collective: str,
    algorithm: str,
    topo: Topology,
    bytes_per_rank: int,
    *,
    roots: int | None = None,
    engine: Engine = IDEAL,
    place: str = "contiguous",
    shared_cores: float | None = None,
    reduce_bytes: int | None = None,
    aggregators: AggregatorPool | None = None,
) -> dict:
    """Run one collective over every host of `topo` (one rank per host) and report it. In a
    pair, the ReduceScatter's shard may be `reduce_bytes` instead of bytes_per_rank. With
    `aggregators`, in-network reductions are summed by that pool of software aggregators."""
    began = time.perf_counter()
    p = topo.hosts
    hosts = placement(place, p, topo)
    flows = collective_flows(
        collective, algorithm, topo, hosts, bytes_per_rank, engine, roots, reduce_bytes
    )
    constraints, cpu = engine_constraints(flows, topo, hosts, engine, shared_cores, aggregators)
    out = run_flows(topo.rate, flows, constraints)
    seconds = float(out.delivered.max())
    lanes = {
        lane: float(max(d for d, f in zip(out.delivered, flows) if f.lane == lane))
        for lane in dict.fromkeys(f.lane for f in flows)
    }
    link_bits = float(topo.rate[topo.uplink].min() * 8)
    floor = (
        cost.floor_seconds(collective, bytes_per_rank, p, link_bits / 8)
        if reduce_bytes is None
        else cost.pair_floor_seconds(bytes_per_rank, reduce_bytes, p, link_bits / 8)
    )
    tx, rx = out.link_bytes[topo.uplink[hosts]], out.link_bytes[topo.downlink[hosts]]
    cpu_seconds = cpu @ np.array([f.payload for f in flows])
    busiest = int(np.argmax(out.link_bytes))
    row = {
        "collective": collective,
        "algorithm": algorithm,
        "nodes": p,
        "topology": topo.kind,
        "radix": topo.radix,
        "levels": topo.levels,
        "oversubscription": list(topo.oversubscription) or None,
        "placement": place,
        "bytes_per_rank": bytes_per_rank,
        "link_bits_per_s": link_bits,
        "seconds": seconds,
        "floor_seconds": floor,
        "ratio_to_floor": seconds / floor,
        "algbw_bytes_per_s": cost.algbw(bytes_per_rank, p, seconds),
        "busbw_bytes_per_s": cost.busbw(bytes_per_rank, p, seconds),
        "lane_seconds": lanes,
        "link_bytes_total": float(out.link_bytes.sum()),
        "max_link_bytes": float(out.link_bytes[busiest]),
        "busiest_link": topo.names[busiest],
        "tx_bytes_per_nic_max": float(tx.max()),
        "rx_bytes_per_nic_max": float(rx.max()),
        "tx_bytes_per_nic_mean": float(tx.mean()),
        "rx_bytes_per_nic_mean": float(rx.mean()),
        "roots": (roots or p) if algorithm in ("multicast", "overcast") else None,
        "engine": engine.name,
        "engine_cpu_seconds_per_host_max": float(cpu_seconds.max()),
        "engine_cores_busy": float(cpu_seconds.max() / seconds) if seconds else 0.0,
        "flows": len(flows),
        "events": out.events,
        "wall_seconds": time.perf_counter() - began,
    }
    if shared_cores is not None:
        row["shared_cores"] = shared_cores
    if aggregators is not None:
        row["aggregators"] = aggregators.describe()
    return row


def sweep(
    nodes: list[int],
    kind: str,
    link_bits: list[float],
    sizes: list[int],
    collectives: list[str],
    algorithms: list[str],
    *,
    radix: int | None = None,
    oversubscription=(1.0,),
    levels: int | None = None,
    roots: int | None = None,
    engine: Engine = IDEAL,
    place: str = "contiguous",
    latency: float = DEFAULT_LATENCY_S,
    shared_cores: float | None = None,
    aggregators: AggregatorPool | None = None,
    progress=None,
) -> dict:
    """Every combination asked for, as `{"meta": ..., "results": [row, ...]}`. Settings are
    checked before the first run; `progress(done, total, what)` is called after each row.
    `shared_cores`: every host and the aggregator share that many cores (the emulated
    cluster's one machine). `aggregators`: the software aggregators that sum reductions."""
    check_request(collectives, algorithms)
    for n in nodes:
        check_hosts(n)
        check_roots(roots, n)
    for b in link_bits:
        check_link_rate(b)
    for size in sizes:
        check_size(size)
    if shared_cores is not None:
        check_positive("the machine's cores", shared_cores, "--machine-cores, shared_cores")
    if aggregators is not None:
        aggregators.check()
    topologies = {
        (n, b): build(
            kind,
            n,
            b,
            radix=radix,
            oversubscription=oversubscription,
            levels=levels,
            latency=latency,
        )
        for n in nodes
        for b in link_bits
    }
    for n in nodes:
        placement(place, n, topologies[(n, link_bits[0])])
    points = [
        (c, a, n, b, size)
        for c in collectives
        for a in algorithms
        if a in ALGORITHMS[c]
        for n in nodes
        for b in link_bits
        for size in sizes
    ]
    rows = []
    for c, a, n, b, size in points:
        rows.append(
            simulate(
                c,
                a,
                topologies[(n, b)],
                size,
                roots=roots,
                engine=engine,
                place=place,
                shared_cores=shared_cores,
                aggregators=aggregators,
            )
        )
        if progress:
            progress(len(rows), len(points), f"{c} {a}, {n} nodes")
    meta = {
        "simulator": "overcast.sim (flow level, max-min fair)",
        "topology": kind,
        "radix": radix,
        "levels": levels,
        "oversubscription": list(oversubscription),
        "placement": place,
        "link_latency_s": latency,
        "engine": {k: v if v != math.inf else None for k, v in asdict(engine).items()},
        "aggregators": aggregators.describe() if aggregators else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    return {"meta": meta, "results": rows}


def compare(doc: dict, measured: list[dict]) -> None:
    """Put measured times beside the predicted ones: for each row, the `overcast bench` rows of
    the same collective, algorithm, hosts, size and link rate in `measured` (one document per
    run), their median and range, and the prediction's error against the median."""
    for row in doc["results"]:
        key = (
            row["collective"],
            row["algorithm"],
            row["nodes"],
            row["bytes_per_rank"],
            round(row["link_bits_per_s"]),
        )
        times = [
            r["seconds"]
            for m in measured
            for r in m["results"]
            if (
                r["collective"],
                r["algorithm"],
                r["hosts"],
                r["bytes_per_rank"],
                round(r["link_bits_per_s"]),
            )
            == key
        ]
        if times:
            median = statistics.median(times)
            row["measured_seconds"] = median
            row["measured_seconds_range"] = [min(times), max(times)]
            row["measured_runs"] = len(times)
            row["prediction_error"] = row["seconds"] / median - 1
