"""Bench results for people: a table in the terminal, and busbw against size as a PNG."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def columns(title: str, names: tuple[str, ...], left=("collective", "algorithm")) -> Table:
    """A table of right-aligned columns but the `left` ones (names)."""
    t = Table(title=title)
    for name in names:
        t.add_column(name, justify="left" if name in left else "right")
    return t


def table(doc: dict) -> Table:
    meta = doc["meta"]
    t = columns(f"{meta['hosts']} hosts, {meta['link_bits_per_s'] / 1e6:g} Mbit/s per "
                f"direction, MTU {meta['mtu']}, {meta['dtype']}, median of "
                f"{meta['repetitions']} runs",
                ("collective", "algorithm", "size/rank", "time ms", "x floor", "algbw MB/s",
                 "busbw MB/s", "tx/host", "rx/host", "tx/payload", "rx/payload", "cpu s/rank",
                 "cpu us/dgram", "cpu s/GiB", "machine cpu", "correct"))
    for r in doc["results"]:
        algorithm = r["algorithm"] + (f" x{r['roots']}" if r.get("roots") else "") + \
            (f" loss {r['loss']:g}" if r.get("loss") else "")
        t.add_row(r["collective"], algorithm, human_bytes(r["bytes_per_rank"]),
                  f"{r['seconds'] * 1e3:.1f}", f"{r['ratio_to_floor']:.3f}",
                  f"{r['algbw_bytes_per_s'] / 1e6:.1f}", f"{r['busbw_bytes_per_s'] / 1e6:.1f}",
                  human_bytes(r["tx_bytes_per_host"]), human_bytes(r["rx_bytes_per_host"]),
                  f"{r['tx_over_payload']:.3f}", f"{r['rx_over_payload']:.3f}",
                  f"{r['cpu_seconds_per_rank']:.3f}", _maybe(r.get("cpu_us_per_datagram"), ".1f"),
                  _maybe(r.get("cpu_seconds_per_gib"), ".2f"), f"{r['machine_cpu_busy']:.0%}",
                  "yes" if r["correct"] else "[bold red]NO[/]")
    return t


def _maybe(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(doc: dict, console: Console | None = None) -> None:
    (console or Console()).print(table(doc))


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
            (r["bytes_per_rank"], r["busbw_bytes_per_s"] / 1e6))
    for (collective, algorithm), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{collective} {algorithm}")
    ax.axhline(meta["link_bits_per_s"] / 8e6, color="grey", linestyle="--",
               label="link rate per direction")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("busbw (MB/s)")
    ax.set_title(f"{meta['hosts']} hosts, {meta['link_bits_per_s'] / 1e6:g} Mbit/s links")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
