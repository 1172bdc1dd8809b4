"""What the `overcast` command's subcommands share: the flags every command spells one way, their
checks, the console, the progress bar and the results files."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from overcast.report.bench import WIDTH
from overcast.units import parse_size

# The link rate's flags: bits/s per unit, the unit, and the scale as the API's names say it.
UNITS = {"--link-mbit": (1e6, "Mbit/s", "1e6"), "--link-gbit": (1e9, "Gbit/s", "1e9")}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, where it has one."""

    def _get_help_string(self, action):
        if (
            action.default is None
            or action.default is argparse.SUPPRESS
            or not action.help
            or "%(default)" in action.help
            or action.nargs == 0
        ):  # a switch
            return action.help
        return super()._get_help_string(action)


def console_for(args) -> Console:
    """The terminal's width, or where output is not a terminal, 120 columns (or as wide as
    --wide's tables need)."""
    return Console(
        width=None if sys.stdout.isatty() else (250 if getattr(args, "wide", False) else WIDTH)
    )


def csv_items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def link_rates(args, several: bool) -> list[float]:
    """The link rates per direction in bits/s, from --link-mbit or --link-gbit (whichever was
    given, else the command's default), each checked in the unit typed."""
    typed = ((flag, getattr(args, flag[2:].replace("-", "_"))) for flag in UNITS)
    flag, text = next(((f, t) for f, t in typed if t is not None), args.link_default)
    scale, unit, scale_text = UNITS[flag]
    values = parse_floats(text, flag)
    if not values:
        raise ValueError(f"the link rates must be at least one, not none ({flag}, link_bits)")
    if not several and len(values) > 1:
        raise ValueError(f"{flag} takes one link rate here, not {text!r}")
    for value in values:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"the link rate must be above 0 {unit}, not {value:g} ({flag}, "
                f"link_bits_per_s / {scale_text})"
            )
    return [v * scale for v in values]


def aggregator_flags(p) -> None:
    p.add_argument(
        "--aggregators",
        type=int,
        default=1,
        help="aggregators for in-network reduction, each on an attachment of its "
        "own; the ranks stripe their chunks over all their shards",
    )
    p.add_argument(
        "--aggregator-link-mbit",
        type=float,
        default=None,
        help="each aggregator's link, Mbit/s per direction (default: unshaped, the "
        "switch's own compute)",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=None,
        help="each aggregator's data-path threads (default: the cores it may use)",
    )


def aggregators_from(args):
    """The aggregators the flags ask for, checked."""
    from overcast.bench.run import Aggregators

    rate = args.aggregator_link_mbit
    aggregators = Aggregators(args.aggregators, args.shards, None if rate is None else rate * 1e6)
    aggregators.check()  # in the unit typed, before the rate is made whole
    return dataclasses.replace(aggregators, link_bits=None if rate is None else round(rate * 1e6))


def parse_sizes(text: str, several: bool = True) -> list[int]:
    sizes = [parse_size(s) for s in csv_items(text)]
    if not sizes or (not several and len(sizes) > 1):
        raise ValueError(
            f"--sizes takes {'sizes, comma-separated' if several else 'one size'}, not {text!r}"
        )
    return sizes


def check_writable(path: str | None, flag: str) -> None:
    """An output file the command will write: its folder must exist and take files."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def read_json_files(paths: list[str], flag: str) -> list[dict]:
    """Input files the command reads, each JSON."""
    docs = []
    for path in paths:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except OSError as err:
            raise ValueError(f"{flag} {path}: {(err.strerror or str(err)).lower()}") from None
        except ValueError:
            raise ValueError(f"{flag} {path}: not a JSON file") from None
    return docs


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in csv_items(text)]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers, comma-separated, not {text!r}") from None


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in csv_items(text)]
    except ValueError:
        raise ValueError(f"{flag} takes numbers, comma-separated, not {text!r}") from None


def png_of(args) -> str | None:
    """--png, or beside --json."""
    return args.png or (os.path.splitext(args.json)[0] + ".png" if args.json else None)


def save_results(
    doc: dict, console: Console, json_path: str | None, png_path: str | None, plot
) -> None:
    """Stamp the command line on the results; write them, and their plot, where asked."""
    doc["meta"]["command"] = "overcast " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
        console.print(f"results: {json_path}")
    if png_path:
        plot(doc, png_path)
        console.print(f"plot: {png_path}")


class _Progress:
    """A transient progress bar shown from its first step on, so that a check that fails
    before any work leaves the terminal as it was."""

    def __init__(self, console: Console):
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task: TaskID | None = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.task is not None:
            self.bar.stop()

    def step(self, done: int, total: int | None, what: str) -> None:
        if self.task is None:
            self.task = self.bar.add_task(what, total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done, total=total, description=what)


def progress_bar(console: Console):
    """A progress bar to run the work in, and the callback (done, total, what) that moves it."""
    bar = _Progress(console)
    return bar, bar.step


def hosts_flag(p, default, many: bool = False) -> None:
    if many:
        p.add_argument(
            "--hosts",
            "--nodes",
            dest="hosts",
            default=default,
            help="hosts (one rank each), comma-separated for several",
        )
    else:
        p.add_argument(
            "--hosts",
            "--nodes",
            dest="hosts",
            type=int,
            default=default,
            help="emulated hosts, one rank each",
        )


def link_flags(p, default: str, unit: str, several: bool) -> None:
    """--link-mbit and --link-gbit, one of them: the link rate per direction."""
    many = "; comma-separated for several" if several else ""
    group = p.add_mutually_exclusive_group()
    for flag, name in (("--link-mbit", "Mbit/s"), ("--link-gbit", "Gbit/s")):
        group.add_argument(
            flag,
            help=f"link rate per direction in {name}{many}"
            + (f" (default: {default})" if flag == unit else f" (instead of {unit})"),
        )
    p.set_defaults(link_default=(unit, default))


def file_flags(p, json_help: str, png_help: str) -> None:
    p.add_argument("--json", help=json_help)
    p.add_argument("--png", "--plot", dest="png", help=png_help + " (default: beside --json)")


def drop_flag(p) -> None:
    p.add_argument(
        "--drop-multicast",
        default="",
        help="hosts, comma-separated, or all: the switch drops the multicast it would "
        "send them, as a network without multicast does",
    )


def dropped_hosts(args) -> list[int]:
    return (
        list(range(args.hosts))
        if args.drop_multicast == "all"
        else parse_ints(args.drop_multicast, "--drop-multicast")
    )
