"""Simulator results for people: a table in the terminal, time and traffic against nodes."""

from __future__ import annotations

from rich.table import Table

from overcast.bench.report import human_bytes


def rate_text(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e12:g} Tbit/s" if bits_per_s >= 1e12 else \
        f"{bits_per_s / 1e9:g} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:g} Mbit/s"


def simulate_table(doc: dict) -> Table:
    meta = doc["meta"]
    shape = meta["topology"] + (f", radix {meta['radix']}" if meta.get("radix") else "")
    t = Table(title=f"simulated: {shape}, {meta['placement']} placement, engine "
                    f"{meta['engine']['name']}")
    for name in ("collective", "algorithm", "nodes", "link", "size/rank", "time", "x floor",
                 "busbw GB/s", "link traffic", "busiest link", "tx/NIC", "rx/NIC",
                 "engine cores"):
        t.add_column(name, justify="left" if name in ("collective", "algorithm",
                                                       "busiest link") else "right")
    for r in doc["results"]:
        t.add_row(r["collective"], r["algorithm"] + (f" x{r['roots']}" if r["roots"] else ""),
                  str(r["nodes"]), rate_text(r["link_bits_per_s"]),
                  human_bytes(r["bytes_per_rank"]), seconds_text(r["seconds"]),
                  f"{r['ratio_to_floor']:.3f}", f"{r['busbw_bytes_per_s'] / 1e9:.2f}",
                  human_bytes(r["link_bytes_total"]), r["busiest_link"],
                  human_bytes(r["tx_bytes_per_nic_max"]), human_bytes(r["rx_bytes_per_nic_max"]),
                  f"{r['engine_cores_busy']:.2f}")
    return t


def seconds_text(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def plot_simulate(doc: dict, path: str) -> None:
    """Time over its floor (left) and total link traffic (right) against nodes, one line per
    (collective, algorithm, link rate, size)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple, list[dict]] = {}
    for r in doc["results"]:
        series.setdefault((r["collective"], r["algorithm"], r["link_bits_per_s"],
                           r["bytes_per_rank"]), []).append(r)
    many_rates = len({k[2] for k in series}) > 1
    many_sizes = len({k[3] for k in series}) > 1
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (collective, algorithm, rate, size), rows in sorted(series.items()):
        rows.sort(key=lambda r: r["nodes"])
        label = f"{collective} {algorithm}" + (f", {rate_text(rate)}" if many_rates else "") \
            + (f", {human_bytes(size)}" if many_sizes else "")
        nodes = [r["nodes"] for r in rows]
        left.plot(nodes, [r["ratio_to_floor"] for r in rows], marker="o", label=label)
        right.plot(nodes, [r["link_bytes_total"] / 2**30 for r in rows], marker="o", label=label)
    meta = doc["meta"]
    for ax, what in ((left, "time / floor"), (right, "total link traffic, GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    fig.suptitle(f"overcast simulate: {meta['topology']}"
                 + (f" radix {meta['radix']}" if meta.get("radix") else "")
                 + f", engine {meta['engine']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
