"""The soak's verdict for people: a table in the terminal, and its pair times and memory over
the run as a PNG."""

from __future__ import annotations

import numpy as np
from rich.table import Table

from overcast.bench.soak import slowest_rank_seconds
from overcast.report.bench import aggregator_text
from overcast.units import human_bytes


def summary_table(doc: dict):
    """The verdict as a table for the terminal."""
    meta, s = doc["meta"], doc["summary"]
    pool = meta["aggregators"]
    t = Table(
        title=f"soak: {s['pairs']} overlapped pairs, {meta['hosts']} hosts, "
        f"{meta['link_bits_per_s'] / 1e6:g} Mbit/s, "
        f"{human_bytes(meta['bytes_per_rank'])} per rank, loss {meta['loss']:g} "
        f"(bursts of {meta['loss_burst']:g}); "
        f"{aggregator_text(pool['count'], pool.get('link_bits_per_s'))}, "
        f"{pool['shards']} shard{'s' if pool['shards'] > 1 else ''} each"
    )
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("pairs bit-exact", f"{s['pairs_exact']} of {s['pairs']}")
    t.add_row("pair time, median", f"{s['pair_seconds_median'] * 1e3:.1f} ms")
    t.add_row(
        f"pair time, first / last {s['drift_window']} (median)",
        f"{s['pair_seconds_first'] * 1e3:.1f} / {s['pair_seconds_last'] * 1e3:.1f} ms",
    )
    t.add_row("drift (fitted)", f"{s['drift_seconds_per_1000_pairs'] * 1e3:+.2f} ms per 1000")
    for m in meta["marks"]:
        t.add_row(
            f"RSS after pair {m}: ranks (max) / aggregator",
            f"{human_bytes(s['rank_rss_bytes_max'][str(m)])} / "
            f"{human_bytes(s['switch_rss_bytes'][str(m)])}",
        )
    t.add_row(
        "aggregator: peak pool, pool and communicators after",
        f"{human_bytes(s['switch_peak_pool_bytes'])}, "
        f"{human_bytes(s['switch_pool_bytes_after'])}, {s['switch_communicators_after']}",
    )
    left = {k: v for rank in s["left_behind"].values() for k, v in rank.items() if v}
    t.add_row("fds, threads left behind on any rank", str(left or "none"))
    if meta.get("kill_aggregator_every"):
        t.add_row(
            f"aggregators killed (every {meta['kill_aggregator_every']} pairs) / lost "
            f"by the ranks / taken back / in-network collectives redone on the ring",
            f"{s['aggregator_kills']} / {s['aggregators_lost']} / "
            f"{s.get('aggregators_taken_back', 0)} / {s['in_network_redone_on_ring']}",
        )
    t.add_row(
        "losses injected / chunks repaired / contributions resent",
        f"{s['injected_losses']} / {s['repaired_chunks']} / {s['contributions_resent']}",
    )
    return t


def plot(doc: dict, path: str) -> None:
    """Per-pair time (the slowest rank's) against pair number, with a running median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks, meta = doc["ranks"], doc["meta"]
    seconds = np.array(slowest_rank_seconds(ranks)) * 1e3
    window = doc["summary"]["drift_window"]
    running = [
        float(np.median(seconds[max(0, i - window + 1) : i + 1])) for i in range(len(seconds))
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(np.arange(1, len(seconds) + 1), seconds, ".", ms=2, alpha=0.4, label="each pair")
    ax.plot(np.arange(1, len(seconds) + 1), running, label=f"running median of {window}")
    ax.set_xlabel("pair")
    ax.set_ylabel("ms (slowest rank)")
    ax.set_ylim(0, float(np.percentile(seconds, 99)) * 1.3)
    ax.set_title(
        f"overcast soak: {meta['hosts']} hosts, {meta['link_bits_per_s'] / 1e6:g} "
        f"Mbit/s, loss {meta['loss']:g} in bursts of {meta['loss_burst']:g}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
