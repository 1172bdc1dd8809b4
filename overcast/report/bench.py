"""Bench results for people: a table in the terminal, and busbw against size as a PNG."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from overcast.units import human_bytes


# Tables fit a 120-column terminal by default; `wide` adds the rest (the JSON has it all).
WIDTH = 120


def table_of(
    title: str, spec: list[tuple], items, wide: bool = False, left=("collective", "algorithm")
) -> Table:
    """A table of `items`, a row each: `spec` lists (header, the cell of an item, whether only
    `wide` shows it); columns are right-aligned but the `left` ones."""
    shown = [(name, cell) for name, cell, only_wide in spec if wide or not only_wide]
    t = Table(title=title)
    for name, _ in shown:
        # to fit the width only a header of several words wraps (between them); names and
        # one-word headers are never cut. --wide's every column may not fit: rich shares the cut
        t.add_column(
            name,
            justify="left" if name in left else "right",
            no_wrap=not wide and (name in left or " " not in name),
        )
    for item in items:
        t.add_row(*(cell(item) for _, cell in shown))
    return t


def table(doc: dict, wide: bool = False) -> Table:
    meta = doc["meta"]
    rates = meta.get("link_rates_bits_per_s") or [meta["link_bits_per_s"]]
    sweep = len(rates) > 1
    spec = [
        ("collective", lambda r: r["collective"], False),
        ("algorithm", algorithm_label, False),
        *([("link Mbit/s", lambda r: f"{r['link_bits_per_s'] / 1e6:g}", False)] if sweep else []),
        ("size/rank", lambda r: human_bytes(r["bytes_per_rank"]), False),
        ("time ms", lambda r: f"{r['seconds'] * 1e3:.1f}", False),
        ("x floor", lambda r: f"{r['ratio_to_floor']:.3f}", False),
        ("algbw MB/s", lambda r: f"{r['algbw_bytes_per_s'] / 1e6:.1f}", True),
        ("busbw MB/s", lambda r: f"{r['busbw_bytes_per_s'] / 1e6:.1f}", False),
        ("tx/host", lambda r: human_bytes(r["tx_bytes_per_host"]), False),
        ("rx/host", lambda r: human_bytes(r["rx_bytes_per_host"]), False),
        ("tx/payload", lambda r: f"{r['tx_over_payload']:.3f}", True),
        ("rx/payload", lambda r: f"{r['rx_over_payload']:.3f}", True),
        ("cpu s/rank", lambda r: f"{r['cpu_seconds_per_rank']:.3f}", True),
        ("cpu us/dgram", lambda r: _maybe(r.get("cpu_us_per_datagram"), ".1f"), True),
        ("cpu s/GiB", lambda r: _maybe(r.get("cpu_seconds_per_gib"), ".2f"), True),
        ("agg cpu s", lambda r: _maybe(r.get("switch_cpu_seconds_per_run"), ".3f"), True),
        ("machine cpu", lambda r: f"{r['machine_cpu_busy']:.0%}", True),
        ("correct", lambda r: "yes" if r["correct"] else "[bold red]NO[/]", False),
    ]
    pool = meta.get("aggregators")
    return table_of(
        f"{meta['hosts']} hosts, {mbit_text(rates)} Mbit/s per direction, MTU "
        f"{meta['mtu']}, {meta['dtype']}, median of {meta['repetitions']} runs"
        + (f"; {aggregator_text(pool['count'], pool['link_bits_per_s'])}" if pool else ""),
        spec,
        doc["results"],
        wide,
    )


def aggregator_text(count: int, link_bits: float | None) -> str:
    """What the in-network reductions were summed by: the emulated switch's aggregators, their
    links unshaped (a switch that sums at line rate on every port) or shaped (aggregator
    hosts)."""
    who = "aggregator" if count == 1 else f"{count} aggregators, each"
    return (
        f"{who} switch-like (its link unshaped)"
        if link_bits is None
        else f"{who} behind a {link_bits / 1e6:g} Mbit/s link"
    )


def algorithm_label(r: dict) -> str:
    """A row's algorithm with its multicast roots and injected loss, where it has them."""
    return (
        r["algorithm"]
        + (f" x{r['roots']}" if r.get("roots") else "")
        + (f" loss {r['loss']:g}" if r.get("loss") else "")
    )


def point_label(r: dict) -> str:
    """A point of a bench, whatever its link rate: collective, algorithm and size."""
    return f"{r['collective']} {algorithm_label(r)}, {human_bytes(r['bytes_per_rank'])}"


def mbit_text(rates: list[float]) -> str:
    return ", ".join(f"{bits / 1e6:g}" for bits in rates)


def sweep_lines(doc: dict) -> list[str]:
    """Per point of a sweep: the highest rate it holds its bar at, and where it stops."""
    lines = []
    for p in doc.get("sweep", ()):
        name = point_label(p)
        ratio = dict(p["ratio_to_floor"])
        holds, fails, bar = p["holds_up_to_bits_per_s"], p["fails_at_bits_per_s"], p["within"]
        if holds is None:
            lines.append(
                f"{name}: not within {bar:g}x of its floor at any rate swept: "
                f"{ratio[fails]:.3f}x at {fails / 1e6:g} Mbit/s"
            )
        elif fails is None:
            lines.append(
                f"{name}: within {bar:g}x of its floor at every rate swept, up to "
                f"{holds / 1e6:g} Mbit/s ({ratio[holds]:.3f}x)"
            )
        else:
            lines.append(
                f"{name}: within {bar:g}x of its floor up to {holds / 1e6:g} Mbit/s "
                f"({ratio[holds]:.3f}x), not at {fails / 1e6:g} Mbit/s "
                f"({ratio[fails]:.3f}x)"
            )
    return lines


def _maybe(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(doc: dict, console: Console | None = None, wide: bool = False) -> None:
    console = console or Console()
    console.print(table(doc, wide))
    for line in sweep_lines(doc) + aggregator_lines(doc):
        console.print(line, highlight=False)


def aggregator_lines(doc: dict) -> list[str]:
    """What the aggregators counted themselves, per link rate they ran at; with several, each
    one's share of the contributions and of the bytes in."""
    lines = []
    setup = doc["meta"].get("aggregators") or {"count": 1, "shards": 1}
    for s in doc["meta"].get("switch", []):
        if not s["contributions"]:
            continue
        shards = f"{setup['shards']} shard{'s' * (setup['shards'] > 1)}"
        who = (
            f"aggregator ({shards})"
            if setup["count"] == 1
            else f"{setup['count']} aggregators ({shards} each)"
        )
        lines.append(
            f"{who} at "
            f"{s['link_bits_per_s'] / 1e6:g} Mbit/s: "
            f"{s['cpu_us_per_contribution']:.2f} us of the data path's CPU per "
            f"contribution ({s['contributions']:,} taken, "
            f"{s['data_path_cpu_seconds']:.3f} s; the processes "
            f"{s['cpu_seconds']:.3f} s)"
        )
        per = s.get("aggregators", [])
        if len(per) > 1:
            bytes_in = sum(a["bytes_in"] for a in per) or 1
            lines.append(
                "  shares: "
                + ", ".join(
                    f"#{i} {a['contributions'] / s['contributions']:.0%} of contributions, "
                    f"{a['bytes_in'] / bytes_in:.0%} of bytes in"
                    for i, a in enumerate(per)
                )
            )
    return lines


def plot_busbw(doc: dict, path: str) -> None:
    """busbw against bytes per rank, one line per (collective, algorithm), link rate marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = doc["meta"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in doc["results"]:
        series.setdefault((r["collective"], r["algorithm"]), []).append(
            (r["bytes_per_rank"], r["busbw_bytes_per_s"] / 1e6)
        )
    for (collective, algorithm), pts in sorted(series.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{collective} {algorithm}"
        )
    ax.axhline(
        meta["link_bits_per_s"] / 8e6, color="grey", linestyle="--", label="link rate per direction"
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("busbw (MB/s)")
    ax.set_title(f"{meta['hosts']} hosts, {meta['link_bits_per_s'] / 1e6:g} Mbit/s links")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(doc: dict, path: str) -> None:
    """A sweep against the link rate: each point's time as a multiple of its floor, with the
    bar, and the CPU it took per rank (and the aggregator's, where it ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = doc["meta"]
    fig, (ratio_ax, cpu_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    series: dict[str, list[dict]] = {}
    for r in doc["results"]:
        series.setdefault(point_label(r), []).append(r)
    for name, rows in sorted(series.items()):
        rows.sort(key=lambda r: r["link_bits_per_s"])
        mbit = [r["link_bits_per_s"] / 1e6 for r in rows]
        ratio_ax.plot(mbit, [r["ratio_to_floor"] for r in rows], marker="o", label=name)
        (line,) = cpu_ax.plot(
            mbit, [r["cpu_seconds_per_rank"] for r in rows], marker="o", label=f"{name}: per rank"
        )
        if rows[0]["switch_cpu_seconds_per_run"] is not None:
            cpu_ax.plot(
                mbit,
                [r["switch_cpu_seconds_per_run"] for r in rows],
                marker="s",
                linestyle="--",
                color=line.get_color(),
                label=f"{name}: aggregator",
            )
    ratio_ax.axhline(
        meta["within"], color="grey", linestyle="--", label=f"{meta['within']:g}x the floor"
    )
    ratio_ax.set_ylabel("time / floor")
    cpu_ax.set_ylabel("CPU seconds per run")
    for ax in (ratio_ax, cpu_ax):
        ax.set_xlabel("link rate per direction (Mbit/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{meta['hosts']} hosts, links of {mbit_text(meta['link_rates_bits_per_s'])} "
        f"Mbit/s, median of {meta['repetitions']} runs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
