"""The `overcast` command: train (the main job), bench, soak, simulate and plan (at scale,
without a network), the emulated cluster (up, run, clean) and the aggregator (switch).

Every command names one thing one way (--hosts, --link-mbit or --link-gbit, --sizes, --png,
--host-cores; the older names stay as aliases), shows its defaults in --help, and checks every
flag, output path and input file before any work, saying what is wrong in one line that names
the flag as typed."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from overcast.report.bench import WIDTH
from overcast.units import parse_size

# Older names each flag still answers to, and the one it has now.
ALIASES = {"--nodes": "--hosts", "--size": "--sizes", "--bytes-per-rank": "--sizes",
           "--plot": "--png", "--cores": "--host-cores", "--width": "--dim"}
# The link rate's flags: bits/s per unit, the unit, and the scale as the API's names say it.
UNITS = {"--link-mbit": (1e6, "Mbit/s", "1e6"), "--link-gbit": (1e9, "Gbit/s", "1e9")}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("overcast")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed)"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, where it has one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or \
                not action.help or "%(default)" in action.help or action.nargs == 0:  # a switch
            return action.help
        return super()._get_help_string(action)


def _console(args) -> Console:
    """The terminal's width, or where output is not a terminal, 120 columns (or as wide as
    --wide's tables need)."""
    return Console(width=None if sys.stdout.isatty() else
                   (250 if getattr(args, "wide", False) else WIDTH))


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _link_rates(args, several: bool) -> list[float]:
    """The link rates per direction in bits/s, from --link-mbit or --link-gbit (whichever was
    given, else the command's default), each checked in the unit typed."""
    typed = ((flag, getattr(args, flag[2:].replace("-", "_"))) for flag in UNITS)
    flag, text = next(((f, t) for f, t in typed if t is not None), args.link_default)
    scale, unit, scale_text = UNITS[flag]
    values = _floats(text, flag)
    if not values:
        raise ValueError(f"the link rates must be at least one, not none ({flag}, link_bits)")
    if not several and len(values) > 1:
        raise ValueError(f"{flag} takes one link rate here, not {text!r}")
    for value in values:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"the link rate must be above 0 {unit}, not {value:g} ({flag}, "
                             f"link_bits_per_s / {scale_text})")
    return [v * scale for v in values]


def _aggregator_flags(p) -> None:
    p.add_argument("--aggregators", type=int, default=1,
                   help="aggregators for in-network reduction, each on an attachment of its "
                        "own; the ranks stripe their chunks over all their shards")
    p.add_argument("--aggregator-link-mbit", type=float, default=None,
                   help="each aggregator's link, Mbit/s per direction (default: unshaped, the "
                        "switch's own compute)")
    p.add_argument("--shards", type=int, default=None,
                   help="each aggregator's data-path threads (default: the cores it may use)")


def _aggregators(args):
    """The aggregators the flags ask for, checked."""
    from overcast.bench.run import Aggregators

    rate = args.aggregator_link_mbit
    aggregators = Aggregators(args.aggregators, args.shards, None if rate is None else rate * 1e6)
    aggregators.check()  # in the unit typed, before the rate is made whole
    return dataclasses.replace(aggregators, link_bits=None if rate is None else round(rate * 1e6))


def _sizes(text: str, several: bool = True) -> list[int]:
    sizes = [parse_size(s) for s in _csv(text)]
    if not sizes or (not several and len(sizes) > 1):
        raise ValueError(f"--sizes takes {'sizes, comma-separated' if several else 'one size'}"
                         f", not {text!r}")
    return sizes


def _writable(path: str | None, flag: str) -> None:
    """An output file the command will write: its folder must exist and take files."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def _readable_json(paths: list[str], flag: str) -> list[dict]:
    """Input files the command reads, each JSON."""
    docs = []
    for path in paths:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except OSError as err:
            raise ValueError(f"{flag} {path}: {err.strerror.lower()}") from None
        except ValueError:
            raise ValueError(f"{flag} {path}: not a JSON file") from None
    return docs


def _bench(args) -> int:
    from overcast.bench.run import check_flags, check_request, run_bench
    from overcast.report.bench import plot_busbw, plot_sweep, print_table
    from overcast.report.timeline import write_timeline

    console = _console(args)
    sizes = _sizes(args.sizes)
    rates = _link_rates(args, several=True)
    check_request(_csv(args.collectives), _csv(args.algorithms))
    try:
        roots = [None if r == "all" else int(r) for r in _csv(args.roots)]
    except ValueError:
        raise ValueError(f"--roots takes 'all' or whole numbers, comma-separated, not "
                         f"{args.roots!r}") from None
    aggregators = _aggregators(args)
    check_flags(args.hosts, rates, sizes, args.reps, args.warmup, args.mtu, roots, args.loss,
                args.loss_burst, args.slots, args.within, aggregators)
    _writable(args.json, "--json")
    _writable(_png(args), "--png")
    _writable(args.timeline, "--timeline")
    bar, progress = _progress(console)
    with bar:
        doc = run_bench(args.hosts, [int(bits) for bits in rates], sizes, _csv(args.collectives),
                        _csv(args.algorithms), reps=args.reps, warmup=args.warmup, mtu=args.mtu,
                        roots=roots, loss=args.loss, loss_burst=args.loss_burst,
                        timeline=args.timeline, switch_slots=args.slots, within=args.within,
                        write_timeline=write_timeline, progress=progress,
                        aggregators=aggregators)
    print_table(doc, console, wide=args.wide)
    _save(doc, console, args.json, _png(args),
          plot_busbw if doc["meta"]["link_bits_per_s"] else plot_sweep)
    for path in doc["meta"]["timelines"]:
        console.print(f"timeline: {path}.json, {path}.png")
    return 0 if all(r["correct"] for r in doc["results"]) else 1


def _soak(args) -> int:
    from overcast.bench.soak import run_soak
    from overcast.report.soak import plot, summary_table

    console = _console(args)
    [nbytes] = _sizes(args.sizes, several=False)
    [bits] = _link_rates(args, several=False)
    try:
        marks = [int(m) for m in _csv(args.marks)]
    except ValueError:
        raise ValueError(f"--marks takes whole numbers, comma-separated, not {args.marks!r}") \
            from None
    _writable(args.json, "--json")
    _writable(_png(args), "--png")
    bar, progress = _progress(console)
    with bar:  # run_soak checks every setting before it builds anything
        doc = run_soak(args.hosts, int(bits), args.pairs, nbytes, args.loss, args.loss_burst,
                       marks, progress=progress, aggregators=_aggregators(args))
    console.print(summary_table(doc))
    _save(doc, console, args.json, _png(args), plot)
    return 0 if doc["summary"]["pairs_exact"] == args.pairs else 1


def _simulate(args) -> int:
    from overcast.report.simulate import plot_simulate, simulate_table
    from overcast.sim.engine import AggregatorPool, engine
    from overcast.sim.run import compare, sweep

    console = _console(args)
    model = engine(args.engine)
    if args.host_cores is not None:
        model = model.with_cores(args.host_cores)
    rates = _link_rates(args, several=True)
    sizes = _sizes(args.sizes)
    hosts = _ints(args.hosts, "--hosts")
    measured = _readable_json(_csv(args.compare), "--compare") if args.compare else None
    pool = None if args.aggregators is None else AggregatorPool(
        args.aggregators, args.shards, None if args.aggregator_link_gbit is None else
        args.aggregator_link_gbit * 1e9, args.us_per_contribution)
    _writable(args.json, "--json")
    _writable(_png(args), "--png")
    bar, progress = _progress(console)
    with bar:  # sweep checks every setting before the first run
        doc = sweep(hosts, args.topology, rates, sizes, _csv(args.collectives),
                    _csv(args.algorithms), radix=args.radix,
                    oversubscription=_floats(args.oversubscription, "--oversubscription"),
                    levels=args.levels, roots=None if args.roots == "all" else
                    _ints(args.roots, "--roots")[0], engine=model, place=args.placement,
                    latency=args.latency_us * 1e-6, shared_cores=args.machine_cores,
                    aggregators=pool, progress=progress)
    if measured is not None:
        compare(doc, measured)
    console.print(simulate_table(doc, wide=args.wide))
    _save(doc, console, args.json, _png(args), plot_simulate)
    return 0


def _plan(args) -> int:
    from overcast.report.simulate import plan_table, plot_plan
    from overcast.sim.plan import PRESETS, AggregatorSizing, Model, parse_count, plan

    console = _console(args)
    kind, radix = args.topology, args.radix
    if args.preset:
        if args.preset not in PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}; available: {', '.join(PRESETS)}")
        kind, radix, hosts, gbits = PRESETS[args.preset]
        rates = [g * 1e9 for g in gbits]
    else:
        hosts, rates = _ints(args.hosts, "--hosts"), _link_rates(args, several=True)
    options = {"dtype": args.dtype, "reduce_dtype": args.reduce_dtype,
               "micro_steps": args.micro_steps}
    if args.layer_params:
        model = Model(tuple(parse_count(x, "--layer-params") for x in _csv(args.layer_params)),
                      **options)
    else:
        model = Model.uniform(parse_count(args.params, "--params"), args.layers, **options)
    _writable(args.json, "--json")
    _writable(_png(args), "--png")
    sizing = AggregatorSizing(args.within, args.aggregator_cores,
                              None if args.aggregator_link_gbit is None else
                              args.aggregator_link_gbit * 1e9)
    bar, progress = _progress(console)
    with bar:  # plan checks the model and the cluster before the first run
        doc = plan(model, kind, hosts, rates, radix=radix,
                   oversubscription=_floats(args.oversubscription, "--oversubscription"),
                   host_cores=args.host_cores, sizing=sizing, progress=progress)
    console.print(plan_table(doc))
    for p in doc["results"]:
        a = p["aggregators"]
        console.print(f"{p['nodes']} hosts, {p['link_bits_per_s'] / 1e9:g} Gbit/s: "
                      f"[bold]{p['choice']}[/]: {p['why']}; its software aggregators: "
                      f"{a['count']:,} hosts x {a['shards']} cores ({a['cores']:,} cores) "
                      f"behind {a['nic_bits_per_s'] / 1e9:g} Gbit/s links hold the pair at "
                      f"{a['pair_ratio']:.2f}x its floor" + ("" if a["met"] else
                      f", not within {a['within']:g}x (the largest pool the sizing tried)"),
                      highlight=False)
    _save(doc, console, args.json, _png(args), plot_plan)
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in _csv(text)]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers, comma-separated, not {text!r}") from None


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in _csv(text)]
    except ValueError:
        raise ValueError(f"{flag} takes numbers, comma-separated, not {text!r}") from None


def _png(args) -> str | None:
    """--png, or beside --json."""
    return args.png or (os.path.splitext(args.json)[0] + ".png" if args.json else None)


def _save(doc: dict, console: Console, json_path: str | None, png_path: str | None,
          plot) -> None:
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
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
        self.task = None

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.task is not None:
            self.bar.stop()

    def step(self, done: int, total: int | None, what: str) -> None:
        if self.task is None:
            self.task = self.bar.add_task(what, total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done, total=total, description=what)


def _progress(console: Console):
    """A progress bar to run the work in, and the callback (done, total, what) that moves it."""
    bar = _Progress(console)
    return bar, bar.step


def _train(args) -> int:
    from overcast.train.config import SHAPES, GPTConfig, check_request

    console = _console(args)
    ways = _csv(args.ways)
    [bits] = _link_rates(args, several=False)
    given = GPTConfig(vocab=args.vocab, blocks=args.blocks, dim=args.dim, seq=args.seq,
                      batch_per_rank=args.batch, reshard=args.reshard,
                      micro_steps=args.micro_steps,
                      activation_checkpointing=args.activation_checkpointing)
    if args.shapes:
        names = _csv(args.shapes)
        unknown = [n for n in names if n not in SHAPES]
        if unknown or not names:
            raise ValueError(f"unknown shape {', '.join(unknown) or '(none)'}; available: "
                             f"{', '.join(SHAPES)}")
        shapes = [(n, dataclasses.replace(given, **SHAPES[n])) for n in names]
    else:
        shapes = [("default" if given == GPTConfig() else "given", given)]
    for _, cfg in shapes:
        check_request(ways, args.hosts, args.steps, args.warmup, bits, cfg, args.lr,
                      args.prefetch, args.device)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {args.out}: {err.strerror.lower()}") from None
    if not os.access(args.out, os.W_OK):
        raise ValueError(f"--out {args.out}: the folder is not writable")
    # torch loads with these: only once every flag has been checked
    from overcast.train.compare import run_training
    from overcast.report.timeline import every_span, write_timeline
    from overcast.report.train import matrix_table, staging_lines, table, write
    bar, progress = _progress(console)
    with bar:
        doc = run_training(args.hosts, int(bits), ways, args.steps, args.warmup, shapes,
                           lr=args.lr, out_dir=args.out, progress=progress,
                           prefetch=args.prefetch, sched_trace=args.sched_trace,
                           device=args.device,
                           write_timeline=functools.partial(write_timeline, select=every_span))
    doc["meta"]["command"] = "overcast " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    for run in doc["shapes"]:
        console.print(table(doc, run, wide=args.wide))
        if args.device == "cuda":
            for line in staging_lines(run):
                console.print(line)
    if len(doc["shapes"]) > 1:
        console.print(matrix_table(doc, wide=args.wide))
    for path in write(doc, args.out):
        console.print(f"wrote {path}")
    for path in (p for run in doc["shapes"] for p in run["timelines"]):
        console.print(f"timeline: {path}.json (open at ui.perfetto.dev), {path}.png")
    return 0


def _relay(stream, prefix: str) -> None:
    """Copy a host's output to ours line by line, each line under its rank's prefix."""
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


def _cluster(args) -> int:
    from overcast.cluster.netns import Cluster, clean_leftovers

    if args.action == "clean":
        removed = clean_leftovers(force=args.force)
        print(f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed) if removed
                                                         else ""))
        return 0
    if args.action == "run" and not args.command:
        raise ValueError("cluster run: give the command to run on every host after --, as in "
                         "overcast cluster run --hosts 4 -- python train.py")
    [bits] = _link_rates(args, several=False)
    aggregators = _aggregators(args)
    with Cluster(args.hosts, int(bits), mtu=args.mtu, aggregators=aggregators.count,
                 aggregator_bits_per_s=aggregators.link_bits) as cluster:
        if args.action == "up":
            print(f"cluster {cluster.run_id}: hosts {' '.join(cluster.host_ns)}, switch "
                  f"{cluster.switch_ns}, aggregators {' '.join(cluster.aggregator_ns)}")
            print("enter a host with: ip netns exec <host> <command>; Ctrl-C tears it down")
            threading.Event().wait()
        if args.switch:  # in-network reduction needs them; OVERCAST_SWITCH says where
            cluster.start_switches(shards=aggregators.shards)
        procs = [cluster.start(args.command, host=i, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT) for i in range(args.hosts)]
        relays = [threading.Thread(target=_relay, args=(p.stdout, f"[rank {i}] ".encode()),
                                   daemon=True) for i, p in enumerate(procs)]
        for relay in relays:
            relay.start()
        codes = [p.wait() for p in procs]
        for relay in relays:
            relay.join()
        return max(codes, key=abs)


def _switch(args) -> int:
    from overcast.limits import check_count, check_port, check_positive, check_shards, check_slots
    from overcast.switch.service import Limits, default_shards, run

    check_port(args.port)
    check_slots(args.slots)
    shards = default_shards() if args.shards is None else args.shards
    check_shards(shards)
    check_count("the largest world", args.max_world, 2, "--max-world")
    check_count("communicators per job", args.max_communicators, 1, "--max-communicators")
    check_positive("a reduction's expiry", args.expiry, "--expiry", " seconds")
    limits = Limits(args.max_world, args.max_communicators, parse_size(args.pool_bytes))
    _writable(args.stats, "--stats")
    given = os.environ.get("OVERCAST_SECRETS", "") or os.environ.get("OVERCAST_SECRET", "")
    secrets = [bytes.fromhex(x) for x in _csv(given)]
    if not secrets:
        print("overcast switch: set OVERCAST_SECRET (hex) to the job's secret, or "
              "OVERCAST_SECRETS to several, comma-separated", file=sys.stderr)
        return 2
    run(args.host, args.port, secrets, args.slots, args.stats,
        ready=lambda line: print(line, flush=True), lifeline=args.lifeline, limits=limits,
        expiry=args.expiry, shards=shards)
    return 0


def _hosts(p, default, many: bool = False) -> None:
    if many:
        p.add_argument("--hosts", "--nodes", dest="hosts", default=default,
                       help="hosts (one rank each), comma-separated for several")
    else:
        p.add_argument("--hosts", "--nodes", dest="hosts", type=int, default=default,
                       help="emulated hosts, one rank each")


def _link(p, default: str, unit: str, several: bool) -> None:
    """--link-mbit and --link-gbit, one of them: the link rate per direction."""
    many = "; comma-separated for several" if several else ""
    group = p.add_mutually_exclusive_group()
    for flag, name in (("--link-mbit", "Mbit/s"), ("--link-gbit", "Gbit/s")):
        group.add_argument(flag, help=f"link rate per direction in {name}{many}" +
                           (f" (default: {default})" if flag == unit else
                            f" (instead of {unit})"))
    p.set_defaults(link_default=(unit, default))


def _files(p, json_help: str, png_help: str) -> None:
    p.add_argument("--json", help=json_help)
    p.add_argument("--png", "--plot", dest="png", help=png_help + " (default: beside --json)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="overcast", description=__doc__.split("\n\n")[0],
                                formatter_class=_Help)
    p.add_argument("--version", action="version", version=f"overcast {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_Help)

    b = command("bench", "benchmark collectives on the emulated cluster, beside gloo")
    _hosts(b, 8)
    _link(b, "400", "--link-mbit", several=True)
    b.add_argument("--within", type=float, default=1.15,
                   help="a sweep of several link rates names, per point, the highest rate at "
                        "which it takes at most this many times its floor")
    b.add_argument("--sizes", "--size", "--bytes-per-rank", dest="sizes",
                   default="64KiB,1MiB,4MiB",
                   help="bytes per rank, comma-separated (64KiB = 65,536; 64KB = 64,000; "
                        "64k = 64KiB)")
    b.add_argument("--collectives", default="allgather,reduce_scatter",
                   help="allgather, reduce_scatter, overlap (the two at once), all_reduce, "
                        "all_to_all, all_to_all_uneven, send_recv (each even rank to the "
                        "next); comma-separated")
    b.add_argument("--algorithms", default="ring,gloo",
                   help="ring, multicast, innetwork, overcast (multicast with in-network), "
                        "fullduplex, pairwise (all_to_all), stream (send_recv), gloo; "
                        "comma-separated")
    b.add_argument("--reps", type=int, default=5, help="timed runs per point")
    b.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    b.add_argument("--mtu", type=int, default=9000, help="the links' MTU, bytes")
    b.add_argument("--roots", default="all",
                   help="multicast AllGather: ranks sending at once, comma-separated to "
                        "compare; 'all' = every rank")
    b.add_argument("--loss", type=float, default=0.0,
                   help="fraction of received datagrams each host drops (TCP is untouched)")
    b.add_argument("--loss-burst", type=float, default=1.0,
                   help="mean length of a loss burst, in datagrams (1 = independent losses)")
    b.add_argument("--timeline", metavar="PREFIX",
                   help="overlap: write the last run of overcast and ring at the largest size "
                        "as PREFIX-<algorithm>.json (Chrome trace) and .png")
    b.add_argument("--slots", type=int, default=256,
                   help="the aggregator's slots per reduction (its pool), chunks")
    _aggregator_flags(b)
    _files(b, "write the results here (JSON)", "busbw against size")
    b.add_argument("--wide", action="store_true",
                   help="every column (algbw, payload ratios, CPU, the aggregator's); the JSON "
                        "has them all")
    b.set_defaults(func=_bench)

    t = command("train", "train a small GPT with FSDP2 four ways on the emulated cluster and "
                         "compare them (the main job)")
    _hosts(t, 4)
    _link(t, "100", "--link-mbit", several=False)
    t.add_argument("--ways", default="gloo,gloo-separate,overcast-ring,overcast",
                   help="comma-separated: gloo (one group), gloo-separate (ReduceScatter on its "
                        "own group), overcast-ring, overcast (multicast + in-network)")
    t.add_argument("--steps", type=int, default=6, help="training steps per way")
    t.add_argument("--warmup", type=int, default=1, help="first steps left out of the times")
    t.add_argument("--shapes",
                   help="train several model shapes in turn, comma-separated: small, default, "
                        "long, deep, wide, kept; each changes the shape flags below, the rest "
                        "hold for all")
    t.add_argument("--vocab", type=int, default=512, help="vocabulary size, tokens")
    t.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    t.add_argument("--dim", "--width", dest="dim", type=int, default=256, help="model width")
    t.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    t.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-step")
    t.add_argument("--reshard", default="all-but-last",
                   help="blocks that free their parameters after forward (and gather them "
                        "again in backward): all-but-last, all, none, or block numbers, "
                        "comma-separated")
    t.add_argument("--micro-steps", type=int, default=1,
                   help="gradient accumulation: micro-batches per optimizer step, gradients "
                        "reduced on the last only")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward")
    t.add_argument("--prefetch", type=int, default=1,
                   help="blocks each gathers ahead in forward and behind in backward, every "
                        "way but gloo")
    t.add_argument("--sched-trace", action=argparse.BooleanOptionalAction, default=True,
                   help="record the scheduler (tracefs, root) to say what the training threads "
                        "waited behind for a CPU; it slows short steps, so compare step times "
                        "without")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each host's rank trains (cuda: every rank on this machine's "
                        "first GPU, staged through pinned host memory)")
    t.add_argument("--out", default="out/train", help="folder for results, plots and traces")
    t.add_argument("--wide", action="store_true",
                   help="every column (CPU waits, engine and per-rank CPU); the JSON has them "
                        "all")
    t.set_defaults(func=_train)

    s = command("soak", "many overlapped pairs under bursty loss: exact results, flat memory, "
                        "no drift, nothing left behind")
    _hosts(s, 8)
    _link(s, "400", "--link-mbit", several=False)
    s.add_argument("--pairs", type=int, default=1000,
                   help="overlapped pairs (multicast AllGather + in-network ReduceScatter)")
    s.add_argument("--sizes", "--size", dest="sizes", default="256KiB",
                   help="bytes per rank of each collective (one size)")
    s.add_argument("--loss", type=float, default=0.01,
                   help="fraction of received datagrams each host drops")
    s.add_argument("--loss-burst", type=float, default=4.0,
                   help="mean length of a loss burst, in datagrams")
    s.add_argument("--marks", default="100",
                   help="pairs after which memory is read, comma-separated (the last pair "
                        "always is)")
    _aggregator_flags(s)
    _files(s, "write the results here (JSON)", "per-pair time")
    s.set_defaults(func=_soak)

    from overcast.sim.engine import AGGREGATOR_US_PER_CONTRIBUTION

    m = command("simulate", "predict collectives on a large cluster (a flow-level simulator; "
                            "nothing runs on a network, no root needed)")
    _hosts(m, "8,64,188,1024", many=True)
    _link(m, "100", "--link-gbit", several=True)
    m.add_argument("--topology", default="fat-tree", help="star (one switch) or fat-tree")
    m.add_argument("--radix", type=int, default=32, help="fat tree: ports per switch")
    m.add_argument("--levels", type=int, help="fat tree: switch levels (default: the fewest "
                                              "that hold the hosts)")
    m.add_argument("--oversubscription", default="1",
                   help="fat tree: down over up ports, one per level from the leaves up, or one "
                        "for all")
    m.add_argument("--placement", default="contiguous",
                   help="contiguous (rank r on leaf r // hosts per leaf) or strided")
    m.add_argument("--latency-us", type=float, default=1.0, help="latency per link, us")
    m.add_argument("--sizes", "--bytes-per-rank", "--size", dest="sizes", default="64MiB",
                   help="bytes per rank, comma-separated")
    m.add_argument("--collectives", default="allgather,reduce_scatter,overlap",
                   help="allgather, reduce_scatter, overlap; comma-separated")
    m.add_argument("--algorithms", default="ring,multicast,innetwork,overcast",
                   help="ring, multicast, innetwork, overcast; comma-separated")
    m.add_argument("--roots", default="all", help="multicast roots sending at once, or 'all'")
    m.add_argument("--engine", default="ideal",
                   help="ideal (links only), native (overcast's engine as measured) or offload "
                        "(an engine on the NIC)")
    m.add_argument("--host-cores", "--cores", dest="host_cores", type=float,
                   help="engine cores per host (default: the engine's own)")
    m.add_argument("--machine-cores", type=float,
                   help="every host and the aggregator share this many cores, as the emulated "
                        "cluster's one machine does")
    m.add_argument("--aggregators", type=int,
                   help="software aggregators that sum in-network reductions, the chunks "
                        "striped over them (default: the switch sums at line rate)")
    m.add_argument("--shards", type=int, default=1, help="cores per aggregator, one shard each")
    m.add_argument("--aggregator-link-gbit", type=float,
                   help="each aggregator's link, Gbit/s per direction (default: unbounded)")
    m.add_argument("--us-per-contribution", type=float, default=AGGREGATOR_US_PER_CONTRIBUTION,
                   help="a shard's wall time per contribution, microseconds (measured)")
    m.add_argument("--compare", help="overcast bench JSON files (comma-separated, one per run): "
                                     "their measured times beside the predictions")
    _files(m, "write {meta, results} here (JSON)", "time over the floor and link traffic "
                                                   "against hosts")
    m.add_argument("--wide", action="store_true",
                   help="every column (link traffic, busiest link, rx per NIC, engine cores); "
                        "the JSON has them all")
    m.set_defaults(func=_simulate)

    n = command("plan", "a training step's communication on a cluster, rings against "
                        "overcast, and which to use (simulated, no root needed)")
    n.add_argument("--preset", help="a cluster by name: emulated, ethernet-fat-tree, rail-400g "
                                    "(instead of --hosts, --link-gbit, --topology, --radix)")
    _hosts(n, "8,64,188,1024", many=True)
    _link(n, "100,400,1600", "--link-gbit", several=True)
    n.add_argument("--topology", default="fat-tree", help="star or fat-tree")
    n.add_argument("--radix", type=int, default=32, help="fat tree: ports per switch")
    n.add_argument("--oversubscription", default="1",
                   help="fat tree: down over up ports, per level or one for all")
    n.add_argument("--params", default="7B", help="the model's parameter count (7B, 350M, 1.3e9)")
    n.add_argument("--layers", type=int, default=32, help="FSDP units (one per block)")
    n.add_argument("--layer-params", help="each unit's parameter count, comma-separated "
                                          "(instead of --params and --layers)")
    n.add_argument("--dtype", default="bf16", help="the gathered dtype (FSDP2's param_dtype)")
    n.add_argument("--reduce-dtype", help="the gradients' dtype (default: --dtype)")
    n.add_argument("--micro-steps", type=int, default=1, help="gradient accumulation steps")
    n.add_argument("--host-cores", "--cores", dest="host_cores", type=float, default=8.0,
                   help="cores per host the communication engine may use")
    n.add_argument("--within", type=float, default=1.10,
                   help="size overcast's software aggregators for the pair to hold this "
                        "many times its floor")
    n.add_argument("--aggregator-cores", type=int, default=16,
                   help="cores per aggregator host (one shard each)")
    n.add_argument("--aggregator-link-gbit", type=float, default=None,
                   help="each aggregator host's link, Gbit/s per direction (default: the "
                        "hosts' link rate)")
    _files(n, "write {meta, results} here (JSON)", "the speedup against hosts and link rate")
    n.set_defaults(func=_plan)

    c = command("cluster", "the emulated cluster of network namespaces: up, run, clean")
    actions = c.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help, description=help, formatter_class=_Help)
        a.set_defaults(func=_cluster)
        return a

    for name, help in (("up", "build the cluster and hold it until Ctrl-C"),
                       ("run", "build the cluster and run a command on every host, its output "
                               "under [rank N]: overcast cluster run --hosts 4 -- COMMAND "
                               "[ARGS...]")):
        a = action(name, help)
        _hosts(a, 4)
        _link(a, "400", "--link-mbit", several=False)
        a.add_argument("--mtu", type=int, default=9000, help="the links' MTU, bytes")
        _aggregator_flags(a)
        if name == "run":
            a.add_argument("--no-switch", dest="switch", action="store_false",
                           help="do not start the aggregators (overcast switch) on their "
                                "attachments")
    action("clean", "remove what killed runs left behind").add_argument(
        "--force", action="store_true", help="also remove live runs' namespaces")

    from overcast.native import EXPIRY_SECONDS
    from overcast.switch.service import Limits

    w = command("switch", "the aggregator for in-network reduction, standing in for the switch")
    w.add_argument("--host", default="0.0.0.0", help="address to listen on")
    w.add_argument("--port", type=int, default=18515,
                   help="TCP port, and the first shard's UDP port (the others' are any free)")
    w.add_argument("--shards", type=int, default=None,
                   help="data-path threads, each with its own UDP port, engine and pools; the "
                        "ranks stripe their contributions over them (default: the cores this "
                        "process may use)")
    w.add_argument("--slots", type=int, default=256,
                   help="chunks each reduction may have in the aggregator at once (its pool)")
    w.add_argument("--stats", help="write counters and peak memory here (JSON) on exit")
    w.add_argument("--max-world", type=int, default=Limits.max_world,
                   help="the largest communicator it registers, ranks")
    w.add_argument("--max-communicators", type=int, default=Limits.max_communicators,
                   help="communicators one job may register at once")
    w.add_argument("--pool-bytes", default="1G",
                   help="what every communicator's reductions may hold together at their "
                        "largest, set aside when each registers, each job an even share "
                        "(bytes; k, M, G: powers of 1024)")
    w.add_argument("--expiry", type=float, default=EXPIRY_SECONDS,
                   help="seconds a reduction may go without a contribution or acknowledgement "
                        "before it is given up and its memory freed")
    w.add_argument("--lifeline", type=int, metavar="FD",
                   help="exit when this inherited pipe closes (how a process that starts the "
                        "aggregator ties its life to its own)")
    w.set_defaults(func=_switch)
    return p


def _as_typed(message: str, argv: list[str]) -> str:
    """An error message naming each flag as the user typed it (an older alias)."""
    for alias, name in ALIASES.items():
        if any(a == alias or a.startswith(alias + "=") for a in argv):
            message = re.sub(re.escape(name) + r"(?![\w-])", alias, message)
    return message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv)
    args.command = command
    if args.cmd in ("bench", "cluster", "train", "soak"):
        # Not root: become root of a user namespace of our own, where the kernel allows it.
        from overcast.cluster.userns import reexec
        reexec(["-m", "overcast.cli.main", *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Before torch loads: gloo's warnings about hosts without names (namespaces have none).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from overcast.cluster.netns import ClusterError
    try:
        return args.func(args)
    except (ClusterError, ValueError) as err:
        print(f"overcast: {_as_typed(str(err), argv)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("overcast: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
