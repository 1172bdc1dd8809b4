"""Simulator results for people: a table in the terminal, time and traffic against nodes."""

from __future__ import annotations

from rich.table import Table

from overcast.report.bench import table_of
from overcast.units import human_bytes, human_count


def rate_text(bits_per_s: float) -> str:
    return (
        f"{bits_per_s / 1e12:g} Tbit/s"
        if bits_per_s >= 1e12
        else f"{bits_per_s / 1e9:g} Gbit/s"
        if bits_per_s >= 1e9
        else f"{bits_per_s / 1e6:g} Mbit/s"
    )


def simulate_table(doc: dict, wide: bool = False) -> Table:
    meta = doc["meta"]
    shape = meta["topology"] + (f", radix {meta['radix']}" if meta.get("radix") else "")
    measured = any("measured_seconds" in r for r in doc["results"])
    spec = [
        ("collective", lambda r: r["collective"], False),
        ("algorithm", lambda r: r["algorithm"] + (f" x{r['roots']}" if r["roots"] else ""), False),
        ("hosts", lambda r: str(r["nodes"]), False),
        ("link", lambda r: rate_text(r["link_bits_per_s"]), False),
        ("size/rank", lambda r: human_bytes(r["bytes_per_rank"]), False),
        ("time", lambda r: seconds_text(r["seconds"]), False),
        ("x floor", lambda r: f"{r['ratio_to_floor']:.3f}", False),
        ("busbw GB/s", lambda r: f"{r['busbw_bytes_per_s'] / 1e9:.3g}", False),
        ("link traffic", lambda r: human_bytes(r["link_bytes_total"]), True),
        ("busiest link", lambda r: r["busiest_link"], True),
        ("tx/NIC", lambda r: human_bytes(r["tx_bytes_per_nic_max"]), not measured),
        ("rx/NIC", lambda r: human_bytes(r["rx_bytes_per_nic_max"]), True),
        ("engine cores", lambda r: f"{r['engine_cores_busy']:.2f}", True),
    ]
    if measured:
        spec += [
            (
                "measured",
                lambda r: seconds_text(r["measured_seconds"]) if "measured_seconds" in r else "",
                False,
            ),
            (
                "error",
                lambda r: f"{r['prediction_error']:+.1%}" if "measured_seconds" in r else "",
                False,
            ),
        ]
    pool = meta.get("aggregators")
    summed = (
        "" if not pool else f", summed by {pool['count']} aggregator(s) x {pool['shards']} shard(s)"
    )
    return table_of(
        f"simulated: {shape}, {meta['placement']} placement, engine "
        f"{meta['engine']['name']}{summed}",
        spec,
        doc["results"],
        wide,
        left=("collective", "algorithm", "busiest link"),
    )


def seconds_text(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def plot_simulate(doc: dict, path: str) -> None:
    """Against nodes, one line per (collective, algorithm, link rate, size): time over its floor;
    total link traffic; and that traffic over the least any algorithm of the collective moved at
    the same point (ring over multicast, say)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple, list[dict]] = {}
    least: dict[tuple, float] = {}
    for r in doc["results"]:
        point = (r["collective"], r["nodes"], r["link_bits_per_s"], r["bytes_per_rank"])
        least[point] = min(least.get(point, float("inf")), r["link_bytes_total"])
        series.setdefault(
            (r["collective"], r["algorithm"], r["link_bits_per_s"], r["bytes_per_rank"]), []
        ).append(r)
    many_rates = len({k[2] for k in series}) > 1
    many_sizes = len({k[3] for k in series}) > 1
    fig, (time_ax, bytes_ax, ratio_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    for (collective, algorithm, rate, size), rows in sorted(series.items()):
        rows.sort(key=lambda r: r["nodes"])
        label = (
            f"{collective} {algorithm}"
            + (f", {rate_text(rate)}" if many_rates else "")
            + (f", {human_bytes(size)}" if many_sizes else "")
        )
        nodes = [r["nodes"] for r in rows]
        time_ax.plot(nodes, [r["ratio_to_floor"] for r in rows], marker="o", label=label)
        bytes_ax.plot(nodes, [r["link_bytes_total"] / 2**30 for r in rows], marker="o", label=label)
        ratio_ax.plot(
            nodes,
            [r["link_bytes_total"] / least[(collective, r["nodes"], rate, size)] for r in rows],
            marker="o",
            label=label,
        )
    meta = doc["meta"]
    for ax, what in (
        (time_ax, "time / floor"),
        (bytes_ax, "total link traffic, GiB"),
        (ratio_ax, "link traffic / the collective's least"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hosts")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False) if ax is not bytes_ax else None
    bytes_ax.set_yscale("log")
    time_ax.legend(fontsize=8)
    fig.suptitle(
        f"overcast simulate: {meta['topology']}"
        + (f" radix {meta['radix']}" if meta.get("radix") else "")
        + f", engine {meta['engine']['name']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pair_text(aggregators: dict) -> str:
    """The pair's time over its floor on the aggregators sized for it, and the bar it did not
    meet if it did not."""
    ratio = f"{aggregators['pair_ratio']:.2f}x"
    return ratio if aggregators["met"] else f"{ratio}, not within {aggregators['within']:g}x"


def plan_table(doc: dict, wide: bool = False) -> Table:
    meta = doc["meta"]

    def oc(p: dict) -> dict:
        return p["ways"]["overcast"]

    spec = [
        ("hosts", lambda p: str(p["nodes"]), False),
        ("link", lambda p: rate_text(p["link_bits_per_s"]), False),
        ("ring s", lambda p: f"{p['ways']['ring']['step_seconds']:.3f}", False),
        ("ring exposed s", lambda p: f"{p['ways']['ring']['exposed_seconds']:.3f}", True),
        ("overcast s", lambda p: f"{oc(p)['step_seconds_on_host_cores']:.3f}", False),
        ("vs ring", lambda p: f"{p['speedup_over_ring']:.2f}x", False),
        ("cores", lambda p: _cores(oc(p)["engine_cores_native"]), False),
        ("offloaded s", lambda p: f"{oc(p)['step_seconds']:.3f}", False),
        ("vs ring ", lambda p: f"{p['speedup_over_ring_offloaded']:.2f}x", False),
        ("overcast exposed s", lambda p: f"{oc(p)['exposed_seconds']:.3f}", True),
        ("aggregators", lambda p: p["aggregators"]["short"], False),
        (
            "pair",
            lambda p: pair_text(p["aggregators"]) if "pair_ratio" in p["aggregators"] else "",
            True,
        ),
        ("use", lambda p: p["choice"], False),
    ]
    ranks = meta["ranks_per_node"]
    t = table_of(
        f"plan: {human_count(meta['params'])} parameters in {meta['layers']} layers, "
        f"{meta['dtype']} gathered, {meta['reduce_dtype']} reduced, "
        f"{meta['micro_steps']} micro-step(s); {ranks} rank{'s' * (ranks > 1)} per "
        f"node, MTU {meta['mtu']}; compute per layer: {meta['compute_from']}",
        spec,
        doc["results"],
        wide,
        left=("use", "aggregators"),
    )
    t.caption = (
        f"A step's seconds. ring: an NCCL-like ring at line rate; overcast: with its "
        f"engine on {meta['host_cores']:g} core(s) per node (cores: how many it needs); "
        f"offloaded: overcast with an offloaded engine; vs ring: the ring's step over "
        f"the one before"
    )
    return t


def _cores(n: float) -> str:
    return f"{n:.2g}" if n < 10 else f"{n:,.0f}"


def plan_lines(doc: dict) -> list[str]:
    """Each point's choice and why, and the hardware overcast's figures assume."""
    return [
        f"{p['nodes']} hosts, {rate_text(p['link_bits_per_s'])}: [bold]{p['choice']}[/]: {p['why']}"
        for p in doc["results"]
    ] + ["overcast assumes: " + "; ".join(doc["meta"]["overcast_assumes"])]


def plot_plan(doc: dict, path: str) -> None:
    """The ring's step over overcast's (with an offloaded engine: solid; with its engine on the
    cores given: dotted), against nodes for each link rate (left) and against the link rate
    for each node count (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = doc["results"]
    cores = doc["meta"]["host_cores"]
    for key, style, what in (
        ("speedup_over_ring_offloaded", "-", "offloaded engine"),
        ("speedup_over_ring", ":", f"engine on {cores:g} core(s)"),
    ):
        for i, rate in enumerate(sorted({p["link_bits_per_s"] for p in rows})):
            pts = sorted((p["nodes"], p[key]) for p in rows if p["link_bits_per_s"] == rate)
            left.plot(
                *zip(*pts), style, marker="o", color=f"C{i}", label=f"{rate_text(rate)}, {what}"
            )
        for i, nodes in enumerate(sorted({p["nodes"] for p in rows})):
            pts = sorted((p["link_bits_per_s"] / 1e9, p[key]) for p in rows if p["nodes"] == nodes)
            right.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{nodes} nodes, {what}")
    for ax, what in ((left, "hosts"), (right, "link rate per direction, Gbit/s")):
        ax.set_xscale("log", base=2 if ax is left else 10)
        ax.set_xlabel(what)
        ax.set_ylabel("step: ring / overcast")
        ax.set_yscale("log")
        ax.axhline(1, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    meta = doc["meta"]
    fig.suptitle(
        f"overcast plan: {human_count(meta['params'])} parameters, {meta['layers']} "
        f"layers, {meta['topology']}" + (f" radix {meta['radix']}" if meta["radix"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
