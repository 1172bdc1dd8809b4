"""The flows each collective makes, from the schedules the real protocols run
(overcast.schedules), placed on a topology.

- ring: every rank streams P-1 blocks to its successor (schedules.ring's send blocks), one flow
  per rank along the unicast route; the pipeline adds, per step, what a frame's way across a
  hop takes beyond a block's time on the link.
- multicast AllGather: the chains of schedules.chains; each root's flow covers its replication
  tree, paced at schedules.chains.stream_rate, and starts when its chain predecessor's ends
  (plus the activation's way).
- in-network ReduceScatter: one flow per block, from every other rank to the block's owner over
  the reduction tree, the switches summing.
- overlap: the AllGather and the ReduceScatter at once (ring + ring, or multicast +
  in-network: "overcast").
"""

from __future__ import annotations

import numpy as np

from overcast.limits import check_algorithms
from overcast.schedules import chains, cost, ring
from overcast.sim.engine import Engine
from overcast.sim.flows import Flow
from overcast.sim.topology import Topology

COLLECTIVES = ("allgather", "reduce_scatter", "overlap")
# The algorithms the cost model knows for each collective (the simulator runs exactly those).
ALGORITHMS = {c: tuple(a for (k, a) in cost.TRAFFIC if k == c) for c in COLLECTIVES}
# Which schedule each half of a pair runs.
PAIRS = {"ring": ("ring", "ring"), "overcast": ("multicast", "innetwork")}


def check_request(collectives, algorithms) -> None:
    check_algorithms(collectives, algorithms, ALGORITHMS)


def ring_flows(
    lane: str,
    topo: Topology,
    hosts: list[int],
    n: int,
    engine: Engine,
    frame_bytes: int = ring.DEFAULT_FRAME_BYTES,
) -> list[Flow]:
    send_block = {
        "allgather": ring.allgather_send_block,
        "reduce_scatter": ring.reduce_scatter_send_block,
    }[lane]
    p = len(hosts)
    frame = ring.frames(n, frame_bytes, 1)[0][1] * engine.stream_wire
    routes = [topo.route(hosts[r], hosts[(r + 1) % p]) for r in range(p)]
    ways = [topo.path_latency(links) for links in routes]
    rate = min(float(topo.rate[links].min()) for links in routes)
    # Each step's first frame must have arrived before it is forwarded: when a block takes less
    # time to send than a frame takes to cross a hop (on average over the ring), every step
    # waits the difference.
    stall = max(0.0, frame / rate + sum(ways) / p - n * engine.stream_wire / rate)
    flows = []
    for r, links in enumerate(routes):
        blocks = [send_block(r, p, step) for step in range(p - 1)]
        flows.append(
            Flow(
                lane,
                n * len(blocks),
                np.asarray(links, dtype=np.int64),
                (hosts[r],),
                (hosts[(r + 1) % p],),
                tail=(p - 1) * stall + max(ways),
                wire=engine.stream_wire,
            )
        )
    return flows


def multicast_flows(
    lane: str,
    topo: Topology,
    hosts: list[int],
    n: int,
    engine: Engine,
    roots: int | None,
    with_reductions: bool,
) -> list[Flow]:
    p = len(hosts)
    roots = p if roots is None else roots
    concurrent = chains.concurrent_senders(p, roots)
    flows = []
    for chain in chains.chains(p, roots):
        before = None
        for r in chain:
            others = [hosts[x] for x in range(p) if x != r]
            budget = float(topo.rate[topo.uplink[hosts[r]]]) * engine.pacing_share
            pace = chains.stream_rate(budget, p, concurrent, with_reductions)
            activation = (
                0.0 if before is None else topo.path_latency(topo.route(hosts[before], hosts[r]))
            )
            tree, depth = topo.multicast_tree(hosts[r], others)
            flows.append(
                Flow(
                    lane,
                    n,
                    tree,
                    (hosts[r],),
                    tuple(others),
                    cap=pace / engine.datagram_wire,
                    after=None if before is None else len(flows) - 1,
                    delay=activation,
                    tail=depth,
                    datagram=True,
                    wire=engine.datagram_wire,
                )
            )
            before = r
    return flows


def innetwork_flows(
    lane: str, topo: Topology, hosts: list[int], n: int, engine: Engine
) -> list[Flow]:
    flows = []
    for owner in range(len(hosts)):
        others = [h for r, h in enumerate(hosts) if r != owner]
        tree, depth = topo.reduction_tree(hosts[owner], others)
        flows.append(
            Flow(
                lane,
                n,
                tree,
                tuple(others),
                (hosts[owner],),
                tail=depth,
                datagram=True,
                wire=engine.datagram_wire,
            )
        )
    return flows


def collective_flows(
    collective: str,
    algorithm: str,
    topo: Topology,
    hosts: list[int],
    n: int,
    engine: Engine,
    roots: int | None = None,
    reduce_bytes: int | None = None,
) -> list[Flow]:
    """Every flow of one collective; lanes are "allgather" and "reduce_scatter". In a pair the
    ReduceScatter's shard may be `reduce_bytes` (gradients in another dtype), else n."""
    check_request([collective], [algorithm])
    if collective == "overlap":
        gather, scatter = PAIRS[algorithm]
        return _half("allgather", gather, topo, hosts, n, engine, roots, True) + _half(
            "reduce_scatter",
            scatter,
            topo,
            hosts,
            n if reduce_bytes is None else reduce_bytes,
            engine,
            roots,
            True,
        )
    return _half(collective, algorithm, topo, hosts, n, engine, roots, False)


def _half(lane, algorithm, topo, hosts, n, engine, roots, paired) -> list[Flow]:
    if algorithm == "ring":
        return ring_flows(lane, topo, hosts, n, engine)
    if algorithm == "multicast":
        return multicast_flows(lane, topo, hosts, n, engine, roots, paired)
    return innetwork_flows(lane, topo, hosts, n, engine)
