"""A timeline of one run: each collective's span per rank, and how full each direction of each
rank's link was over time, split by collective; on a GPU, each staging copy to the host and back
(a trace's "copies": {"direction": "to host" or "to GPU", "start", "end"}, on its clock) on lanes
of their own. Written as a Chrome/Perfetto trace (open it at ui.perfetto.dev or chrome://tracing)
and as a PNG of rank 0.

Which spans make "the run" is the caller's choice (`select`): the bench takes the last
collectives issued together, training takes every span of one backward step, named by module."""

from __future__ import annotations

import json

LANES = {
    "all_gather": (1, "AllGather"),
    "reduce_scatter": (2, "ReduceScatter"),
    "broadcast": (1, "Broadcast"),
}
OTHER_LANE = (3, "other")  # any other collective
# the staging copies' lanes in the Chrome trace (rows 3 and 4 of the PNG), and their colours
COPY_LANES = {"to host": (4, "copy to host", "tab:green"), "to GPU": (5, "copy to GPU", "tab:red")}
BARRIER = "all_gather(ring, 1 x int64)"
# The plot averages over this many bins at least, or over 1/WINDOWS of the run if longer: a
# 512 KiB ring frame at 400 Mbit/s takes 10 ms on the wire.
SMOOTH_BINS = 5
WINDOWS = 40


def last_run(trace: dict) -> list[dict]:
    """The spans of the last timed run: the last collectives issued that are not barriers,
    as many as were issued together (those that overlap the very last one)."""
    spans = every_span(trace)
    if not spans:
        return []
    last = spans[-1]
    return [s for s in spans if s["end"] >= last["start"] and s["start"] <= last["end"]]


def every_span(trace: dict) -> list[dict]:
    """Every finished collective of the trace but barriers (a trace already cut to a window)."""
    return [s for s in trace["spans"] if s["name"] != BARRIER and s["end"] is not None]


def copies_between(trace: dict, t0: float, t1: float) -> list[dict]:
    """The trace's staging copies (none off a GPU) that overlap [t0, t1]."""
    return [c for c in trace.get("copies", []) if c["end"] >= t0 and c["start"] <= t1]


def _title(span: dict) -> str:
    return span.get("label") or span["name"]


def _lane(name: str) -> tuple[int, str]:
    return LANES.get(name.split("(")[0], OTHER_LANE)


def _lane_names(spans: list[dict]) -> list[tuple[int, str]]:
    """(tid, name) of each collective lane, one name a lane (a viewer shows a thread by its
    last): "AllGather / Broadcast" share a lane; "other" only where one of the spans falls in it."""
    names: dict[int, list[str]] = {}
    for tid, lane in LANES.values():
        names.setdefault(tid, []).append(lane)
    if any(_lane(s["name"]) == OTHER_LANE for s in spans):
        names[OTHER_LANE[0]] = [OTHER_LANE[1]]
    return [(tid, " / ".join(lanes)) for tid, lanes in sorted(names.items())]


def series(trace: dict, spans: list[dict], t0: float, t1: float):
    """{direction: {lane name: [(seconds from t0, bytes/s)]}} for the spans' collectives."""
    width = trace["bin_seconds"]
    lanes = {s["seq"]: _lane(s["name"])[1] for s in spans}
    first, last = int(t0 / width), int(t1 / width) + 1
    out: dict[str, dict[str, list[float]]] = {"tx": {}, "rx": {}}
    for b in trace["bins"]:
        if b["seq"] in lanes and first <= b["bin"] < last:
            row = out[b["direction"]].setdefault(lanes[b["seq"]], [0.0] * (last - first))
            row[b["bin"] - first] += b["bytes"] / width
    return {
        d: {
            lane: [((first + i) * width - t0, v) for i, v in enumerate(row)]
            for lane, row in rows.items()
        }
        for d, rows in out.items()
    }


def chrome_trace(traces: list[dict], link_bits: float, select=last_run) -> dict:
    events = []
    runs = [select(t) for t in traces]
    starts = [s["start"] for run in runs for s in run]
    ends = [s["end"] for run in runs for s in run]
    if not starts:
        return {"traceEvents": []}
    t0, t1 = min(starts), max(ends)
    us = lambda t: round((t - t0) * 1e6, 1)  # noqa: E731
    for rank, (trace, run) in enumerate(zip(traces, runs)):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        copies = copies_between(trace, t0, t1)
        threads = _lane_names(run)
        if copies:
            threads += [(tid, lane) for tid, lane, _ in sorted(COPY_LANES.values())]
        for tid, lane in threads:
            events.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}}
            )
        bars = [(_title(s), _lane(s["name"])[0], s) for s in run]
        bars += [(COPY_LANES[c["direction"]][1], COPY_LANES[c["direction"]][0], c) for c in copies]
        for name, tid, s in bars:
            events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": rank,
                    "tid": tid,
                    "ts": us(s["start"]),
                    "dur": round((s["end"] - s["start"]) * 1e6, 1),
                }
            )
        for direction, rows in series(trace, run, t0, t1).items():
            lanes = sorted(rows)
            if not lanes:
                continue
            for i in range(len(rows[lanes[0]])):
                t = rows[lanes[0]][i][0] + t0
                events.append(
                    {
                        "name": f"link {direction} (% of rate)",
                        "ph": "C",
                        "pid": rank,
                        "ts": us(t),
                        "args": {
                            lane: round(100 * rows[lane][i][1] * 8 / link_bits, 1) for lane in lanes
                        },
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _smooth(values: list[float]) -> list[float]:
    """A moving average, wide enough that single datagrams and frames do not show as spikes."""
    half = max(SMOOTH_BINS, len(values) // WINDOWS) // 2
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


def figure(trace: dict, link_bits: float, title: str, select=last_run):
    """The PNG's picture of one rank's trace (a matplotlib Figure), or None if it ran nothing:
    its collectives' spans (and copies) over its link's use, send and receive."""
    from matplotlib.figure import Figure

    run = select(trace)
    if not run:
        return None
    t0, t1 = min(s["start"] for s in run), max(s["end"] for s in run)
    copies = copies_between(trace, t0, t1)
    fig = Figure(figsize=(9, 6))
    axes = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [2 if copies else 1, 2, 2]}
    )
    colors = {"AllGather": "tab:blue", "ReduceScatter": "tab:orange", "Broadcast": "tab:blue"}
    for s in run:
        tid, lane = _lane(s["name"])
        axes[0].broken_barh(
            [((s["start"] - t0) * 1e3, (s["end"] - s["start"]) * 1e3)],
            (tid - 0.4, 0.8),
            color=colors.get(lane, "grey"),
        )
        label = s["label"].split(" ", 1)[1] + ", " if s.get("label") else ""
        axes[0].text(
            (s["start"] - t0) * 1e3,
            tid + 0.45,
            f"{label}{(s['end'] - s['start']) * 1e3:.0f} ms",
            va="bottom",
            fontsize=7,
        )
    names = ["AllGather", "ReduceScatter"]
    for c in copies:
        tid, _, color = COPY_LANES[c["direction"]]
        axes[0].broken_barh(
            [((c["start"] - t0) * 1e3, (c["end"] - c["start"]) * 1e3)],
            (tid - 1.4, 0.8),
            color=color,
        )
    if copies:
        names += [lane for _, lane, _ in sorted(COPY_LANES.values())]
    axes[0].set_yticks(range(1, len(names) + 1), names)
    axes[0].set_ylim(0.4, len(names) + 0.9)
    axes[0].set_title(title)
    for ax, direction, label in ((axes[1], "tx", "send"), (axes[2], "rx", "receive")):
        rows = series(trace, run, t0, t1)[direction]
        lanes = sorted(rows)
        if lanes:
            times = [t * 1e3 for t, _ in rows[lanes[0]]]
            ax.stackplot(
                times,
                *[
                    [100 * v * 8 / link_bits for v in _smooth([v for _, v in rows[lane]])]
                    for lane in lanes
                ],
                labels=lanes,
                colors=[colors.get(lane, "grey") for lane in lanes],
                alpha=0.8,
            )
        ax.axhline(100, color="black", linestyle="--", linewidth=0.8)
        ax.set_ylabel(f"{label}, % of link")
        ax.set_ylim(0, 130)
        ax.legend(loc="upper right", fontsize=8)
    axes[2].set_xlabel("ms")
    fig.tight_layout()
    return fig


def plot(
    traces: list[dict], path: str, link_bits: float, title: str, rank: int = 0, select=last_run
) -> None:
    fig = figure(traces[rank], link_bits, f"{title}: rank {rank}", select)
    if fig is not None:
        fig.savefig(path, dpi=120)


def write_timeline(
    traces: list[dict], path: str, link_bits: float, title: str, select=last_run
) -> None:
    """`path`.json (Chrome trace of every rank) and `path`.png (rank 0)."""
    with open(path + ".json", "w") as f:
        json.dump(chrome_trace(traces, link_bits, select), f)
    plot(traces, path + ".png", link_bits, title, select=select)
