"""`overcast check`'s findings for people: a table of the checks, one of the collectives, and the
verdict (overcast.bench.check)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from overcast.report.bench import table_of
from overcast.units import human_bytes

STATES = {
    "ok": "[green]ok[/]",
    "note": "[yellow]note[/]",
    "slower": "[bold yellow]SLOWER[/]",
    "fail": "[bold red]FAIL[/]",
}
VERDICT_STYLES = {"ready": "bold green", "works": "bold yellow", "not": "bold red"}


def checks_table(doc: dict) -> Table:
    t = Table(title=f"overcast check: {doc['ranks']} ranks")
    for name in ("check", "result", "detail"):
        t.add_column(name, no_wrap=name != "detail")
    for name, state, detail in doc["checks"]:
        t.add_row(name, STATES[state], detail)
    return t


def collectives_table(doc: dict) -> Table:
    def time_text(r: dict) -> str:
        if "skipped" in r:
            return "skipped"
        low, high = r["range"]
        return f"{r['seconds'] * 1e3:.1f} ({low * 1e3:.1f}-{high * 1e3:.1f})"

    spec = [
        ("collective", lambda r: r["collective"], False),
        ("algorithm", lambda r: r["algorithm"], False),
        (
            "size/rank",
            lambda r: human_bytes(r["bytes_per_rank"]) if "skipped" not in r else "",
            False,
        ),
        ("time ms: median (range)", time_text, False),
        ("x floor", lambda r: f"{r['ratio']:.2f}" if "ratio" in r else "", False),
        (
            "correct",
            lambda r: (
                f"skipped: see {r['skipped']}"
                if "skipped" in r
                else "yes"
                if r["correct"]
                else "[bold red]NO[/]"
            ),
            False,
        ),
    ]
    return table_of(
        "each collective between barriers, the slowest rank's time, after one warm-up",
        spec,
        doc["collectives"],
        left=("collective", "algorithm", "correct"),
    )


def print_report(doc: dict, console: Console) -> None:
    console.print(checks_table(doc))
    if doc["collectives"]:
        console.print(collectives_table(doc))
    style = VERDICT_STYLES[doc["verdict"].split()[0].rstrip(",")]
    console.print(f"verdict: [{style}]{doc['verdict']}[/]", highlight=False)
