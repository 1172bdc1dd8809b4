"""Simulator results for people: a table in the terminal, time and traffic against nodes."""

from __future__ import annotations

from rich.table import Table

from overcast.report.bench import columns
from overcast.units import human_bytes


def rate_text(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e12:g} Tbit/s" if bits_per_s >= 1e12 else \
        f"{bits_per_s / 1e9:g} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:g} Mbit/s"


def simulate_table(doc: dict) -> Table:
    meta = doc["meta"]
    shape = meta["topology"] + (f", radix {meta['radix']}" if meta.get("radix") else "")
    measured = any("measured_seconds" in r for r in doc["results"])
    t = columns(f"simulated: {shape}, {meta['placement']} placement, engine "
                f"{meta['engine']['name']}",
                ("collective", "algorithm", "nodes", "link", "size/rank", "time", "x floor",
                 "busbw GB/s", "link traffic", "busiest link", "tx/NIC", "rx/NIC",
                 "engine cores") + (("measured", "error") if measured else ()),
                left=("collective", "algorithm", "busiest link"))
    for r in doc["results"]:
        t.add_row(r["collective"], r["algorithm"] + (f" x{r['roots']}" if r["roots"] else ""),
                  str(r["nodes"]), rate_text(r["link_bits_per_s"]),
                  human_bytes(r["bytes_per_rank"]), seconds_text(r["seconds"]),
                  f"{r['ratio_to_floor']:.3f}", f"{r['busbw_bytes_per_s'] / 1e9:.3g}",
                  human_bytes(r["link_bytes_total"]), r["busiest_link"],
                  human_bytes(r["tx_bytes_per_nic_max"]), human_bytes(r["rx_bytes_per_nic_max"]),
                  f"{r['engine_cores_busy']:.2f}",
                  *((seconds_text(r["measured_seconds"]), f"{r['prediction_error']:+.1%}")
                    if "measured_seconds" in r else ("", "") if measured else ()))
    return t


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
        series.setdefault((r["collective"], r["algorithm"], r["link_bits_per_s"],
                           r["bytes_per_rank"]), []).append(r)
    many_rates = len({k[2] for k in series}) > 1
    many_sizes = len({k[3] for k in series}) > 1
    fig, (time_ax, bytes_ax, ratio_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    for (collective, algorithm, rate, size), rows in sorted(series.items()):
        rows.sort(key=lambda r: r["nodes"])
        label = f"{collective} {algorithm}" + (f", {rate_text(rate)}" if many_rates else "") \
            + (f", {human_bytes(size)}" if many_sizes else "")
        nodes = [r["nodes"] for r in rows]
        time_ax.plot(nodes, [r["ratio_to_floor"] for r in rows], marker="o", label=label)
        bytes_ax.plot(nodes, [r["link_bytes_total"] / 2**30 for r in rows], marker="o",
                      label=label)
        ratio_ax.plot(nodes, [r["link_bytes_total"] / least[(collective, r["nodes"], rate, size)]
                              for r in rows], marker="o", label=label)
    meta = doc["meta"]
    for ax, what in ((time_ax, "time / floor"), (bytes_ax, "total link traffic, GiB"),
                     (ratio_ax, "link traffic / the collective's least")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False) if ax is not bytes_ax else None
    bytes_ax.set_yscale("log")
    time_ax.legend(fontsize=8)
    fig.suptitle(f"overcast simulate: {meta['topology']}"
                 + (f" radix {meta['radix']}" if meta.get("radix") else "")
                 + f", engine {meta['engine']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_table(doc: dict) -> Table:
    meta = doc["meta"]
    t = columns(f"plan: {meta['params'] / 1e9:.2f}B parameters in {meta['layers']} layers, "
                f"{meta['dtype']} gathered, {meta['reduce_dtype']} reduced, "
                f"{meta['micro_steps']} micro-step(s); communication per step",
                ("nodes", "link", "rings", "rings-separate", "overcast", "speedup",
                 "cores (native)", "engines (offload)", "use"), left=("use",))
    for p in doc["results"]:
        ways = p["ways"]
        t.add_row(str(p["nodes"]), rate_text(p["link_bits_per_s"]),
                  *(seconds_text(ways[w]["seconds"]) for w in ("rings", "rings-separate",
                                                                "overcast")),
                  f"{p['speedup_over_rings']:.2f}x",
                  f"{ways['overcast']['engine_cores_native']:.1f}",
                  f"{ways['overcast']['engine_cores_offload']:.2f}", p["choice"])
    return t


def plot_plan(doc: dict, path: str) -> None:
    """The speedup of overcast over rings (one group), against nodes for each link rate (left)
    and against the link rate for each node count (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = doc["results"]
    for rate in sorted({p["link_bits_per_s"] for p in rows}):
        pts = sorted((p["nodes"], p["speedup_over_rings"]) for p in rows
                     if p["link_bits_per_s"] == rate)
        left.plot(*zip(*pts), marker="o", label=rate_text(rate))
    for nodes in sorted({p["nodes"] for p in rows}):
        pts = sorted((p["link_bits_per_s"] / 1e9, p["speedup_over_rings"]) for p in rows
                     if p["nodes"] == nodes)
        right.plot(*zip(*pts), marker="o", label=f"{nodes} nodes")
    for ax, what in ((left, "nodes"), (right, "link rate per direction, Gbit/s")):
        ax.set_xscale("log", base=2 if ax is left else 10)
        ax.set_xlabel(what)
        ax.set_ylabel("step communication: rings / overcast")
        ax.axhline(1, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    meta = doc["meta"]
    fig.suptitle(f"overcast plan: {meta['params'] / 1e9:.2f}B parameters, {meta['layers']} "
                 f"layers, {meta['topology']}" + (f" radix {meta['radix']}" if meta["radix"]
                                                   else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
