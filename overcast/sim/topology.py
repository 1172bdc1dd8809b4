"""Topologies for the simulator: a single switch (star) and folded-Clos fat trees.

A topology is a set of directed links (each full-duplex cable is two, one per direction), each
with a rate and a latency, and a routing function. Routing in a fat tree is up-down and
arithmetic, as InfiniBand's fat-tree routing and most Clos fabrics do it: a unicast flow climbs
to the lowest level that spans both hosts through the uplink chosen by its destination
(D-mod-k, a deterministic ECMP that spreads the flows towards one leaf over every uplink), then
descends on the only path. A multicast tree is the union of the routes from its root chosen by
the root, so each link is in it once; a reduction tree is a multicast tree rooted at the
destination with every link reversed. No graph search is needed, so no graph library either.

A fat tree of radix k is built with the fewest levels that hold the hosts (or `levels`): a leaf
switch has k/2 host ports; at each level a switch has k/2 ports down and k/(2·o) up for
oversubscription o at that level (fewer uplinks, as real oversubscribed fabrics have, every link
at the same rate). Two levels hold k·k/2 hosts (leaf-spine), three k³/4 (pods, as in the k-ary
fat tree of Al-Fares et al.).
"""

from __future__ import annotations

import itertools

import numpy as np

from overcast.errors import InvalidArgumentError
from overcast.limits import check_hosts, check_link_rate, require

TOPOLOGIES = ("star", "fat-tree")
PLACEMENTS = ("contiguous", "strided")
DEFAULT_LATENCY_S = 1e-6


class Cabling:
    """Full-duplex cables between nodes, as they are laid: each is two directed links, made
    in pairs so that link i ^ 1 is link i's other direction."""

    def __init__(self, rate: float, latency: float):
        self.rate, self.latency = rate, latency
        self.index: dict[tuple, int] = {}
        self.names: list[str] = []

    def cable(self, a, b) -> None:
        for x, y in ((a, b), (b, a)):
            self.index[(x, y)] = len(self.names)
            self.names.append(f"{_name(x)}>{_name(y)}")


class Topology:
    """Directed links (index i: `names[i]`, `rate[i]` bytes/s, `latency[i]` s) and hosts
    0..H-1, host h on leaf h // hosts_per_leaf. `uplink[h]` and `downlink[h]` are host h's NIC
    links (host to switch, switch to host). Above the leaves: `up_ports` uplinks per switch
    at each level, `pod_leaves` leaves per pod (three levels)."""

    def __init__(
        self,
        kind: str,
        hosts: int,
        cabling: Cabling,
        hosts_per_leaf: int,
        *,
        levels: int = 1,
        pod_leaves: int = 1,
        up_ports: tuple[int, ...] = (),
        radix: int | None = None,
        oversubscription: tuple[float, ...] = (),
    ):
        self.kind, self.hosts, self.levels, self.radix = kind, hosts, levels, radix
        self.oversubscription = oversubscription
        self.hosts_per_leaf, self.pod_leaves, self.up_ports = hosts_per_leaf, pod_leaves, up_ports
        self.names, self._index = cabling.names, cabling.index
        self.rate = np.full(len(self.names), cabling.rate)
        self.latency = np.full(len(self.names), cabling.latency)
        self.reverse = np.arange(len(self.names)) ^ 1
        self.uplink = np.array(
            [self._index[(("h", h), ("e", h // hosts_per_leaf))] for h in range(hosts)]
        )
        self.downlink = self.reverse[self.uplink]
        self.key_period = int(np.prod(up_ports)) if up_ports else 1
        self._ways: dict[tuple, tuple[np.ndarray, float]] = {}

    def links_of(self, path: list) -> list[int]:
        """Directed link indices along a path of nodes."""
        return [self._index[(a, b)] for a, b in itertools.pairwise(path)]

    def route(self, src: int, dst: int, key: int | None = None) -> list[int]:
        """The directed links from host src to host dst; `key` picks the uplinks (default dst)."""
        if src == dst:
            return []
        between, _ = self._way(
            src // self.hosts_per_leaf, dst // self.hosts_per_leaf, dst if key is None else key
        )
        return [int(self.uplink[src]), *between, int(self.downlink[dst])]

    def path_latency(self, links) -> float:
        return float(self.latency[list(links)].sum())

    def multicast_tree(self, root: int, members) -> tuple[np.ndarray, float]:
        """Links of the tree from host `root` to every host in `members`, each once: the routes
        (chosen by the root, so they share their way up) to every leaf with members; and the
        propagation delay to the farthest member."""
        members = np.asarray(members, dtype=np.int64)
        leaf = root // self.hosts_per_leaf
        ways = [
            self._way(leaf, int(other), root) for other in np.unique(members // self.hosts_per_leaf)
        ]
        links = np.unique(
            np.concatenate([[self.uplink[root]], *(w[0] for w in ways), self.downlink[members]])
        )
        hop = self.latency[self.uplink[root]] + self.latency[self.downlink[members]].max()
        return links, float(hop + max(w[1] for w in ways))

    def reduction_tree(self, root: int, members) -> tuple[np.ndarray, float]:
        """Links of the tree from every host in `members` to `root`, summing at each switch,
        and the propagation delay from the farthest member."""
        links, delay = self.multicast_tree(root, members)
        return self.reverse[links], delay

    def _way(self, src_leaf: int, dst_leaf: int, key: int) -> tuple[np.ndarray, float]:
        """The links from leaf to leaf (none within a leaf) and their latency, cached: the
        uplinks chosen depend on `key` only modulo the product of the uplink counts."""
        slot = (src_leaf, dst_leaf, key % self.key_period)
        way = self._ways.get(slot)
        if way is None:
            nodes = _up_down(self.levels, self.pod_leaves, self.up_ports, src_leaf, dst_leaf, key)
            links = np.asarray(self.links_of(nodes), dtype=np.int64)
            way = self._ways[slot] = (links, self.path_latency(links))
        return way


def _name(node) -> str:
    kind, *ix = node
    return kind + ".".join(str(i) for i in ix)


def _up_down(levels, pod_leaves, up_ports, ls, ld, key) -> list:
    """The switches on the up-down route from leaf ls to leaf ld."""
    if ls == ld or levels == 1:
        return []
    j = key % up_ports[0]
    if levels == 2:
        return [("e", ls), ("s", j), ("e", ld)]
    ps, pd = ls // pod_leaves, ld // pod_leaves
    if ps == pd:
        return [("e", ls), ("a", ps, j), ("e", ld)]
    m = (key // up_ports[0]) % up_ports[1]
    return [("e", ls), ("a", ps, j), ("c", j, m), ("a", pd, j), ("e", ld)]


def star(hosts: int, link_bits_per_s: float, latency: float = DEFAULT_LATENCY_S) -> Topology:
    """One switch with a port per host, as the emulated cluster's bridge."""
    check_hosts(hosts)
    check_link_rate(link_bits_per_s)
    cabling = Cabling(link_bits_per_s / 8, latency)
    for h in range(hosts):
        cabling.cable(("h", h), ("e", 0))
    return Topology("star", hosts, cabling, hosts_per_leaf=hosts)


def fat_tree(
    hosts: int,
    link_bits_per_s: float,
    radix: int,
    oversubscription=(1.0,),
    levels: int | None = None,
    latency: float = DEFAULT_LATENCY_S,
) -> Topology:
    """A fat tree of radix-`radix` switches holding `hosts` hosts.

    `oversubscription` is one ratio per level from the leaves up (a single value for every
    level): down ports over up ports at that level's switches."""
    check_hosts(hosts)
    check_link_rate(link_bits_per_s)
    require(
        isinstance(radix, int) and radix >= 4 and radix % 2 == 0,
        "the radix",
        "an even whole number, 4 or more",
        radix,
        "--radix, radix",
    )
    half = radix // 2
    fits = {1: radix, 2: radix * half, 3: radix * half * half}
    least = next((lv for lv in (1, 2, 3) if hosts <= fits[lv]), None)
    if least is None:
        raise InvalidArgumentError(
            f"{hosts} hosts need more than three levels of radix-{radix} "
            f"switches (three hold {fits[3]}); use a larger --radix"
        )
    if levels is None:
        levels = least
    require(
        levels in (1, 2, 3) and levels >= least,
        "the fat tree's levels",
        f"between {least} (the fewest that hold {hosts} hosts) and 3",
        levels,
        "--levels, levels",
    )
    over = tuple(float(o) for o in oversubscription)
    over = over * (levels - 1) if len(over) == 1 else over
    for o in over:
        require(
            1 <= o <= half,
            "an oversubscription",
            f"between 1 and {half} (radix/2)",
            o,
            "--oversubscription, oversubscription",
        )
    require(
        len(over) == max(1, levels - 1) or levels == 1,
        "the oversubscriptions given",
        f"one, or one per level above the hosts ({levels - 1})",
        len(over),
        "--oversubscription, oversubscription",
    )
    cabling = Cabling(link_bits_per_s / 8, latency)
    per_leaf = radix if levels == 1 else half
    leaves = -(-hosts // per_leaf)
    up_ports = tuple(max(1, int(half // o)) for o in over[: levels - 1])
    for h in range(hosts):
        cabling.cable(("h", h), ("e", h // per_leaf))
    if levels == 2:
        for leaf in range(leaves):
            for j in range(up_ports[0]):
                cabling.cable(("e", leaf), ("s", j))
    elif levels == 3:
        for leaf in range(leaves):
            for j in range(up_ports[0]):
                cabling.cable(("e", leaf), ("a", leaf // half, j))
        for pod in range(-(-leaves // half)):
            for j in range(up_ports[0]):
                for m in range(up_ports[1]):
                    cabling.cable(("a", pod, j), ("c", j, m))
    return Topology(
        "fat-tree",
        hosts,
        cabling,
        per_leaf,
        levels=levels,
        pod_leaves=half,
        up_ports=up_ports,
        radix=radix,
        oversubscription=over,
    )


def build(
    kind: str,
    hosts: int,
    link_bits_per_s: float,
    *,
    radix: int | None = None,
    oversubscription=(1.0,),
    levels: int | None = None,
    latency: float = DEFAULT_LATENCY_S,
) -> Topology:
    """`star` or `fat-tree` by name, as the commands take them."""
    if kind == "star":
        return star(hosts, link_bits_per_s, latency)
    if kind == "fat-tree":
        if radix is None:
            raise InvalidArgumentError(
                "a fat tree's radix must be given, not none (--radix, radix)"
            )
        return fat_tree(hosts, link_bits_per_s, radix, oversubscription, levels, latency)
    raise InvalidArgumentError(f"unknown topology {kind!r}; available: {', '.join(TOPOLOGIES)}")


def placement(kind: str, ranks: int, topology: Topology) -> list[int]:
    """The host of each rank: `contiguous` fills leaf after leaf (rank r on leaf r // hosts
    per leaf); `strided` deals ranks over the leaves in turn, so ring neighbours sit on
    different leaves (the worst case for an oversubscribed fabric)."""
    if kind == "contiguous":
        return list(range(ranks))
    if kind == "strided":
        per_leaf = topology.hosts_per_leaf
        if ranks <= per_leaf:
            return list(range(ranks))
        require(
            ranks % per_leaf == 0,
            "the ranks of a strided placement",
            f"a multiple of the hosts per leaf ({per_leaf})",
            ranks,
            "--placement",
        )
        leaves = ranks // per_leaf
        return [(r % leaves) * per_leaf + r // leaves for r in range(ranks)]
    raise InvalidArgumentError(f"unknown placement {kind!r}; available: {', '.join(PLACEMENTS)}")
