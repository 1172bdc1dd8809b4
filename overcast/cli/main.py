"""The `overcast` command: train (the main job), bench, soak, simulate and plan (at scale,
without a network), check (a job's network), the emulated cluster (up, run, clean) and the
aggregator.

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

from overcast.cli import scale
from overcast.cli.common import (HelpFormatter, aggregator_flags, aggregators_from,
                                 check_writable, console_for, csv_items, drop_flag,
                                 dropped_hosts, file_flags, hosts_flag, link_flags, link_rates,
                                 parse_sizes, png_of, progress_bar, save_results)
from overcast.units import parse_size

# Older names each flag still answers to, and the one it has now.
ALIASES = {"--nodes": "--hosts", "--size": "--sizes", "--bytes-per-rank": "--sizes",
           "--plot": "--png", "--cores": "--host-cores", "--width": "--dim",
           "--no-switch": "--no-aggregators"}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("overcast")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed)"


def _bench(args) -> int:
    from overcast.bench.run import check_flags, check_request, run_bench
    from overcast.report.bench import plot_busbw, plot_sweep, print_table
    from overcast.report.timeline import write_timeline

    console = console_for(args)
    sizes = parse_sizes(args.sizes)
    rates = link_rates(args, several=True)
    check_request(csv_items(args.collectives), csv_items(args.algorithms))
    try:
        roots = [None if r == "all" else int(r) for r in csv_items(args.roots)]
    except ValueError:
        raise ValueError(f"--roots takes 'all' or whole numbers, comma-separated, not "
                         f"{args.roots!r}") from None
    aggregators = aggregators_from(args)
    check_flags(args.hosts, rates, sizes, args.reps, args.warmup, args.mtu, roots, args.loss,
                args.loss_burst, args.slots, args.within, aggregators)
    check_writable(args.json, "--json")
    check_writable(png_of(args), "--png")
    check_writable(args.timeline, "--timeline")
    bar, progress = progress_bar(console)
    with bar:
        doc = run_bench(args.hosts, [int(bits) for bits in rates], sizes,
                        csv_items(args.collectives), csv_items(args.algorithms), reps=args.reps,
                        warmup=args.warmup, mtu=args.mtu, roots=roots, loss=args.loss,
                        loss_burst=args.loss_burst, timeline=args.timeline,
                        aggregator_slots=args.slots, within=args.within,
                        write_timeline=write_timeline, progress=progress,
                        aggregators=aggregators)
    print_table(doc, console, wide=args.wide)
    save_results(doc, console, args.json, png_of(args),
                 plot_busbw if doc["meta"]["link_bits_per_s"] else plot_sweep)
    for path in doc["meta"]["timelines"]:
        console.print(f"timeline: {path}.json, {path}.png")
    return 0 if all(r["correct"] for r in doc["results"]) else 1


def _soak(args) -> int:
    from overcast.bench.soak import run_soak
    from overcast.report.soak import plot, summary_table

    console = console_for(args)
    [nbytes] = parse_sizes(args.sizes, several=False)
    [bits] = link_rates(args, several=False)
    try:
        marks = [int(m) for m in csv_items(args.marks)]
    except ValueError:
        raise ValueError(f"--marks takes whole numbers, comma-separated, not {args.marks!r}") \
            from None
    check_writable(args.json, "--json")
    check_writable(png_of(args), "--png")
    bar, progress = progress_bar(console)
    with bar:  # run_soak checks every setting before it builds anything
        doc = run_soak(args.hosts, int(bits), args.pairs, nbytes, args.loss, args.loss_burst,
                       marks, progress=progress, aggregators=aggregators_from(args),
                       kill_every=args.kill_aggregator_every)
    console.print(summary_table(doc))
    save_results(doc, console, args.json, png_of(args), plot)
    return 0 if doc["summary"]["pairs_exact"] == args.pairs else 1


def _train(args) -> int:
    from overcast.train.config import SHAPES, GPTConfig, check_request

    console = console_for(args)
    ways = csv_items(args.ways)
    [bits] = link_rates(args, several=False)
    given = GPTConfig(vocab=args.vocab, blocks=args.blocks, dim=args.dim, seq=args.seq,
                      batch_per_rank=args.batch, reshard=args.reshard,
                      micro_steps=args.micro_steps,
                      activation_checkpointing=args.activation_checkpointing)
    if args.shapes:
        names = csv_items(args.shapes)
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
    aggregator_bits = aggregators_from(args).link_bits
    dropped = dropped_hosts(args)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {args.out}: {(err.strerror or str(err)).lower()}") from None
    if not os.access(args.out, os.W_OK):
        raise ValueError(f"--out {args.out}: the folder is not writable")
    # torch loads with these: only once every flag has been checked
    from overcast.train.compare import run_training
    from overcast.report.timeline import every_span, write_timeline
    from overcast.report.train import matrix_table, staging_lines, table, write
    bar, progress = progress_bar(console)
    with bar:
        doc = run_training(args.hosts, int(bits), ways, args.steps, args.warmup, shapes,
                           aggregator_bits=aggregator_bits, drop_multicast=dropped,
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


def _check(args) -> int:
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ValueError("check runs on every rank of the job, under a launcher that sets "
                         "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: torchrun [...] "
                         "--no-python overcast check, or overcast cluster run --hosts 4 -- "
                         "overcast check") from None
    if world < 2:
        raise ValueError(f"check needs 2 ranks or more (WORLD_SIZE is {world}): a job of one "
                         f"rank sends nothing over the network, so there is nothing to check")
    link = None if args.link_mbit is None else args.link_mbit * 1e6
    if link is not None and not (math.isfinite(link) and link > 0):
        raise ValueError(f"the link rate must be above 0 Mbit/s, not {args.link_mbit:g} "
                         f"(--link-mbit)")
    if not (math.isfinite(args.seconds) and args.seconds > 0):
        raise ValueError(f"--seconds must be above 0, not {args.seconds:g}")
    check_writable(args.json, "--json")
    from overcast.bench.check import check_rank, verdict
    from overcast.report.check import print_report

    doc = verdict(check_rank(rank, world, link, args.seconds))
    if rank == 0:
        print_report(doc, console_for(args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    return doc["exit_code"]


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
    [bits] = link_rates(args, several=False)
    aggregators = aggregators_from(args)
    dropped = dropped_hosts(args)
    with Cluster(args.hosts, int(bits), mtu=args.mtu, aggregators=aggregators.count,
                 aggregator_bits_per_s=aggregators.link_bits, drop_multicast=dropped) as cluster:
        if args.action == "up":
            print(f"cluster {cluster.run_id}: hosts {' '.join(cluster.host_ns)}, switch "
                  f"{cluster.switch_ns}, aggregators {' '.join(cluster.aggregator_ns)}")
            print("enter a host with: ip netns exec <host> <command>; Ctrl-C tears it down")
            threading.Event().wait()
        if args.aggregators_run:  # in-network reduction needs them (OVERCAST_AGGREGATORS)
            cluster.start_aggregators(shards=aggregators.shards)
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


def _aggregator(args) -> int:
    from overcast.limits import check_count, check_port, check_positive, check_shards, check_slots
    from overcast.aggregator.service import Limits, default_shards, run

    check_port(args.port)
    check_slots(args.slots)
    shards = default_shards() if args.shards is None else args.shards
    check_shards(shards)
    check_count("the largest world", args.max_world, 2, "--max-world")
    check_count("communicators per job", args.max_communicators, 1, "--max-communicators")
    check_positive("a reduction's expiry", args.expiry, "--expiry", " seconds")
    limits = Limits(args.max_world, args.max_communicators, parse_size(args.pool_bytes))
    check_writable(args.stats, "--stats")
    given = os.environ.get("OVERCAST_SECRETS", "") or os.environ.get("OVERCAST_SECRET", "")
    secrets = [bytes.fromhex(x) for x in csv_items(given)]
    if not secrets:
        print("overcast aggregator: set OVERCAST_SECRET (hex) to the job's secret, or "
              "OVERCAST_SECRETS to several, comma-separated", file=sys.stderr)
        return 2
    run(args.host, args.port, secrets, args.slots, args.stats,
        ready=lambda line: print(line, flush=True), lifeline=args.lifeline, limits=limits,
        expiry=args.expiry, shards=shards)
    return 0


def _add_bench(command) -> None:
    """`overcast bench`, made by `command(name, help)` as every command is."""
    b = command("bench", "benchmark collectives on the emulated cluster, beside gloo")
    hosts_flag(b, 8)
    link_flags(b, "400", "--link-mbit", several=True)
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
    aggregator_flags(b)
    file_flags(b, "write the results here (JSON)", "busbw against size")
    b.add_argument("--wide", action="store_true",
                   help="every column (algbw, payload ratios, CPU, the aggregator's); the JSON "
                        "has them all")
    b.set_defaults(func=_bench)


def _add_train(command) -> None:
    """`overcast train`."""
    t = command("train", "train a small GPT with FSDP2 four ways on the emulated cluster and "
                         "compare them (the main job)")
    hosts_flag(t, 4)
    link_flags(t, "100", "--link-mbit", several=False)
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
    t.add_argument("--aggregator-link-mbit", type=float, default=None,
                   help="the aggregator's link, Mbit/s per direction (default: unshaped, a "
                        "switch that sums at line rate)")
    drop_flag(t)
    t.set_defaults(aggregators=1, shards=None)  # one aggregator, its default shards
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each host's rank trains (cuda: every rank on this machine's "
                        "first GPU, staged through pinned host memory)")
    t.add_argument("--out", default="out/train", help="folder for results, plots and traces")
    t.add_argument("--wide", action="store_true",
                   help="every column (CPU waits, engine and per-rank CPU); the JSON has them "
                        "all")
    t.set_defaults(func=_train)


def _add_soak(command) -> None:
    """`overcast soak`."""
    s = command("soak", "many overlapped pairs under bursty loss: exact results, flat memory, "
                        "no drift, nothing left behind")
    hosts_flag(s, 8)
    link_flags(s, "400", "--link-mbit", several=False)
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
    s.add_argument("--kill-aggregator-every", type=int, default=0, metavar="N",
                   help="kill an aggregator (SIGKILL, each in turn) every N pairs and start it "
                        "again at its address; the ranks go on without it, and take it back (0: "
                        "never)")
    aggregator_flags(s)
    file_flags(s, "write the results here (JSON)", "per-pair time")
    s.set_defaults(func=_soak)


def _add_check(command) -> None:
    """`overcast check`."""
    k = command("check", "is this job's network ready for overcast? Run on every rank under "
                         "torchrun (--no-python overcast check) or overcast cluster run: "
                         "multicast delivered between every pair of ranks, the path MTU, "
                         "socket buffers, the aggregator, the secret, the link rate, and a few "
                         "seconds of each collective against its floor, and overcast's pair "
                         "against its rings; exit code 0: ready (the pair saves 5% of the "
                         "rings' or more), 1: not ready (the reason for each failure), 3: "
                         "works, but slower than the rings here (the likely causes), 2: a "
                         "usage error")
    k.add_argument("--link-mbit", type=float,
                   help="the links' rate per direction, Mbit/s (default: "
                        "OVERCAST_LINK_BITS_PER_S)")
    k.add_argument("--seconds", type=float, default=2.0,
                   help="seconds of each collective (at least 3 runs after a warm-up; each "
                        "moves what a ring AllGather takes a quarter second to gather here)")
    k.add_argument("--json", help="rank 0 writes the findings and the verdict here (JSON)")
    k.set_defaults(func=_check)


def _add_cluster(command) -> None:
    """`overcast cluster` and its actions: up, run, clean."""
    c = command("cluster", "the emulated cluster of network namespaces: up, run, clean")
    actions = c.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        a.set_defaults(func=_cluster)
        return a

    for name, help in (("up", "build the cluster and hold it until Ctrl-C"),
                       ("run", "build the cluster and run a command on every host, its output "
                               "under [rank N]: overcast cluster run --hosts 4 -- COMMAND "
                               "[ARGS...]")):
        a = action(name, help)
        hosts_flag(a, 4)
        link_flags(a, "400", "--link-mbit", several=False)
        a.add_argument("--mtu", type=int, default=9000, help="the links' MTU, bytes")
        aggregator_flags(a)
        drop_flag(a)
        if name == "run":
            a.add_argument("--no-aggregators", "--no-switch", dest="aggregators_run",
                           action="store_false",
                           help="do not start the aggregators (overcast aggregator) on their "
                                "attachments")
    action("clean", "remove what killed runs left behind").add_argument(
        "--force", action="store_true", help="also remove live runs' namespaces")


def _switch(args) -> int:
    print("overcast: `overcast switch` is the old name of `overcast aggregator`; running that",
          file=sys.stderr)
    return _aggregator(args)


def _add_aggregator(command) -> None:
    """`overcast aggregator`, and `overcast switch`, its old name, with the same flags."""
    for name, func, help in (
            ("aggregator", _aggregator,
             "the aggregator for in-network reduction, standing in for a switch that sums; it "
             "serves the jobs whose secrets it holds: set OVERCAST_SECRET (64 hex digits, the "
             "job's), or OVERCAST_SECRETS to several, comma-separated"),
            ("switch", _switch, "the old name of `overcast aggregator`, kept as an alias: the "
                                "same flags, the same service")):
        _aggregator_flags(command(name, help)).set_defaults(func=func)


def _aggregator_flags(w: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from overcast.aggregator.service import Limits
    from overcast.native import EXPIRY_SECONDS

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
    return w


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="overcast", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"overcast {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        # argparse expands % in the list's help (not in a description): "5%" would break it
        return sub.add_parser(name, help=help.replace("%", "%%"), description=help,
                              formatter_class=HelpFormatter)

    for add in (_add_bench, _add_train, _add_soak, scale.add_commands, _add_check,
                _add_cluster, _add_aggregator):
        add(command)
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
