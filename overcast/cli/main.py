"""The `overcast` command: train (the main job), bench, soak, simulate and plan (at scale,
without a network), check (a job's network), the emulated cluster (up, run, clean) and the
aggregator.

Every command names one thing one way (--hosts, --link-mbit or --link-gbit, --sizes, --png,
--host-cores; the older names stay as aliases), shows its defaults in --help, and checks every
flag, output path and input file before any work, saying what is wrong in one line that names
the flag as typed."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from overcast.cli import commands, scale
from overcast.cli.common import (
    HelpFormatter,
    aggregator_flags,
    drop_flag,
    file_flags,
    hosts_flag,
    link_flags,
)

# Older names each flag still answers to, and the one it has now.
ALIASES = {
    "--nodes": "--hosts",
    "--size": "--sizes",
    "--bytes-per-rank": "--sizes",
    "--plot": "--png",
    "--cores": "--host-cores",
    "--width": "--dim",
    "--no-switch": "--no-aggregators",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("overcast")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed)"


def _add_bench(command) -> None:
    """`overcast bench`, made by `command(name, help)` as every command is."""
    b = command("bench", "benchmark collectives on the emulated cluster, beside gloo")
    hosts_flag(b, 8)
    link_flags(b, "400", "--link-mbit", several=True)
    b.add_argument(
        "--within",
        type=float,
        default=1.15,
        help="a sweep of several link rates names, per point, the highest rate at "
        "which it takes at most this many times its floor",
    )
    b.add_argument(
        "--sizes",
        "--size",
        "--bytes-per-rank",
        dest="sizes",
        default="64KiB,1MiB,4MiB",
        help="bytes per rank, comma-separated (64KiB = 65,536; 64KB = 64,000; 64k = 64KiB)",
    )
    b.add_argument(
        "--collectives",
        default="allgather,reduce_scatter",
        help="allgather, reduce_scatter, overlap (the two at once), all_reduce, "
        "all_to_all, all_to_all_uneven, send_recv (each even rank to the "
        "next); comma-separated",
    )
    b.add_argument(
        "--algorithms",
        default="ring,gloo",
        help="ring, multicast, innetwork, overcast (multicast with in-network), "
        "fullduplex, pairwise (all_to_all), stream (send_recv), gloo; "
        "comma-separated",
    )
    b.add_argument("--reps", type=int, default=5, help="timed runs per point")
    b.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    b.add_argument("--mtu", type=int, default=9000, help="the links' MTU, bytes")
    b.add_argument(
        "--roots",
        default="all",
        help="multicast AllGather: ranks sending at once, comma-separated to "
        "compare; 'all' = every rank",
    )
    b.add_argument(
        "--loss",
        type=float,
        default=0.0,
        help="fraction of received datagrams each host drops (TCP is untouched)",
    )
    b.add_argument(
        "--loss-burst",
        type=float,
        default=1.0,
        help="mean length of a loss burst, in datagrams (1 = independent losses)",
    )
    b.add_argument(
        "--timeline",
        metavar="PREFIX",
        help="overlap: write the last run of overcast and ring at the largest size "
        "as PREFIX-<algorithm>.json (Chrome trace) and .png",
    )
    b.add_argument(
        "--slots",
        type=int,
        default=256,
        help="the aggregator's slots per reduction (its pool), chunks",
    )
    aggregator_flags(b)
    file_flags(b, "write the results here (JSON)", "busbw against size")
    b.add_argument(
        "--wide",
        action="store_true",
        help="every column (algbw, payload ratios, CPU, the aggregator's); the JSON has them all",
    )
    b.set_defaults(func=commands.bench)


def _add_train(command) -> None:
    """`overcast train`."""
    t = command(
        "train",
        "train a small GPT with FSDP2 four ways on the emulated cluster and "
        "compare them (the main job)",
    )
    hosts_flag(t, 4)
    link_flags(t, "100", "--link-mbit", several=False)
    t.add_argument(
        "--ways",
        default="gloo,gloo-separate,overcast-ring,overcast",
        help="comma-separated: gloo (one group), gloo-separate (ReduceScatter on its "
        "own group), overcast-ring, overcast (multicast + in-network)",
    )
    t.add_argument("--steps", type=int, default=6, help="training steps per way")
    t.add_argument("--warmup", type=int, default=1, help="first steps left out of the times")
    t.add_argument(
        "--shapes",
        help="train several model shapes in turn, comma-separated: small, default, "
        "long, deep, wide, kept; each changes the shape flags below, the rest "
        "hold for all",
    )
    t.add_argument("--vocab", type=int, default=512, help="vocabulary size, tokens")
    t.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    t.add_argument("--dim", "--width", dest="dim", type=int, default=256, help="model width")
    t.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    t.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-step")
    t.add_argument(
        "--reshard",
        default="all-but-last",
        help="blocks that free their parameters after forward (and gather them "
        "again in backward): all-but-last, all, none, or block numbers, "
        "comma-separated",
    )
    t.add_argument(
        "--micro-steps",
        type=int,
        default=1,
        help="gradient accumulation: micro-batches per optimizer step, gradients "
        "reduced on the last only",
    )
    t.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward",
    )
    t.add_argument(
        "--prefetch",
        type=int,
        default=1,
        help="blocks each gathers ahead in forward and behind in backward, every way but gloo",
    )
    t.add_argument(
        "--sched-trace",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="record the scheduler (tracefs, root) to say what the training threads "
        "waited behind for a CPU; it slows short steps, so compare step times "
        "without",
    )
    t.add_argument(
        "--aggregator-link-mbit",
        type=float,
        default=None,
        help="the aggregator's link, Mbit/s per direction (default: unshaped, a "
        "switch that sums at line rate)",
    )
    drop_flag(t)
    t.set_defaults(aggregators=1, shards=None)  # one aggregator, its default shards
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    t.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where each host's rank trains (cuda: every rank on this machine's "
        "first GPU, staged through pinned host memory)",
    )
    t.add_argument("--out", default="out/train", help="folder for results, plots and traces")
    t.add_argument(
        "--wide",
        action="store_true",
        help="every column (CPU waits, engine and per-rank CPU); the JSON has them all",
    )
    t.set_defaults(func=commands.train)


def _add_soak(command) -> None:
    """`overcast soak`."""
    s = command(
        "soak",
        "many overlapped pairs under bursty loss: exact results, flat memory, "
        "no drift, nothing left behind",
    )
    hosts_flag(s, 8)
    link_flags(s, "400", "--link-mbit", several=False)
    s.add_argument(
        "--pairs",
        type=int,
        default=1000,
        help="overlapped pairs (multicast AllGather + in-network ReduceScatter)",
    )
    s.add_argument(
        "--sizes",
        "--size",
        dest="sizes",
        default="256KiB",
        help="bytes per rank of each collective (one size)",
    )
    s.add_argument(
        "--loss", type=float, default=0.01, help="fraction of received datagrams each host drops"
    )
    s.add_argument(
        "--loss-burst", type=float, default=4.0, help="mean length of a loss burst, in datagrams"
    )
    s.add_argument(
        "--marks",
        default="100",
        help="pairs after which memory is read, comma-separated (the last pair always is)",
    )
    s.add_argument(
        "--kill-aggregator-every",
        type=int,
        default=0,
        metavar="N",
        help="kill an aggregator (SIGKILL, each in turn) every N pairs and start it "
        "again at its address; the ranks go on without it, and take it back (0: "
        "never)",
    )
    aggregator_flags(s)
    file_flags(s, "write the results here (JSON)", "per-pair time")
    s.set_defaults(func=commands.soak)


def _add_check(command) -> None:
    """`overcast check`."""
    k = command(
        "check",
        "is this job's network ready for overcast? Run on every rank under "
        "torchrun (--no-python overcast check) or overcast cluster run: "
        "multicast delivered between every pair of ranks, the path MTU, "
        "socket buffers, the aggregator, the secret, the link rate, and a few "
        "seconds of each collective against its floor, and overcast's pair "
        "against its rings; exit code 0: ready (the pair saves 5% of the "
        "rings' or more), 1: not ready (the reason for each failure), 3: "
        "works, but slower than the rings here (the likely causes), 2: a "
        "usage error",
    )
    k.add_argument(
        "--link-mbit",
        type=float,
        help="the links' rate per direction, Mbit/s (default: OVERCAST_LINK_BITS_PER_S)",
    )
    k.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="seconds of each collective (at least 3 runs after a warm-up; each "
        "moves what a ring AllGather takes a quarter second to gather here)",
    )
    k.add_argument("--json", help="rank 0 writes the findings and the verdict here (JSON)")
    k.set_defaults(func=commands.check)


def _add_cluster(command) -> None:
    """`overcast cluster` and its actions: up, run, clean."""
    c = command("cluster", "the emulated cluster of network namespaces: up, run, clean")
    actions = c.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        a.set_defaults(func=commands.cluster)
        return a

    for name, help in (
        ("up", "build the cluster and hold it until Ctrl-C"),
        (
            "run",
            "build the cluster and run a command on every host, its output "
            "under [rank N]: overcast cluster run --hosts 4 -- COMMAND "
            "[ARGS...]",
        ),
    ):
        a = action(name, help)
        hosts_flag(a, 4)
        link_flags(a, "400", "--link-mbit", several=False)
        a.add_argument("--mtu", type=int, default=9000, help="the links' MTU, bytes")
        aggregator_flags(a)
        drop_flag(a)
        if name == "run":
            a.add_argument(
                "--no-aggregators",
                "--no-switch",
                dest="aggregators_run",
                action="store_false",
                help="do not start the aggregators (overcast aggregator) on their attachments",
            )
    action("clean", "remove what killed runs left behind").add_argument(
        "--force", action="store_true", help="also remove live runs' namespaces"
    )


def _add_aggregator(command) -> None:
    """`overcast aggregator`, and `overcast switch`, its old name, with the same flags."""
    for name, func, help in (
        (
            "aggregator",
            commands.aggregator,
            "the aggregator for in-network reduction, standing in for a switch that sums; it "
            "serves the jobs whose secrets it holds: set OVERCAST_SECRET (64 hex digits, the "
            "job's), or OVERCAST_SECRETS to several, comma-separated",
        ),
        (
            "switch",
            commands.switch,
            "the old name of `overcast aggregator`, kept as an alias: the same flags, the same "
            "service (set OVERCAST_SECRET, or OVERCAST_SECRETS, as for it)",
        ),
    ):
        _aggregator_flags(command(name, help)).set_defaults(func=func)


def _aggregator_flags(w: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from overcast.aggregator.service import Limits
    from overcast.native import EXPIRY_SECONDS

    w.add_argument("--host", default="0.0.0.0", help="address to listen on")
    w.add_argument(
        "--port",
        type=int,
        default=18515,
        help="TCP port, and the first shard's UDP port (the others' are any free)",
    )
    w.add_argument(
        "--shards",
        type=int,
        default=None,
        help="data-path threads, each with its own UDP port, engine and pools; the "
        "ranks stripe their contributions over them (default: the cores this "
        "process may use)",
    )
    w.add_argument(
        "--slots",
        type=int,
        default=256,
        help="chunks each reduction may have in the aggregator at once (its pool)",
    )
    w.add_argument("--stats", help="write counters and peak memory here (JSON) on exit")
    w.add_argument(
        "--max-world",
        type=int,
        default=Limits.max_world,
        help="the largest communicator it registers, ranks",
    )
    w.add_argument(
        "--max-communicators",
        type=int,
        default=Limits.max_communicators,
        help="communicators one job may register at once",
    )
    w.add_argument(
        "--pool-bytes",
        default="1G",
        help="what every communicator's reductions may hold together at their "
        "largest, set aside when each registers, each job an even share "
        "(bytes; k, M, G: powers of 1024)",
    )
    w.add_argument(
        "--expiry",
        type=float,
        default=EXPIRY_SECONDS,
        help="seconds a reduction may go without a contribution or acknowledgement "
        "before it is given up and its memory freed",
    )
    w.add_argument(
        "--lifeline",
        type=int,
        metavar="FD",
        help="exit when this inherited pipe closes (how a process that starts the "
        "aggregator ties its life to its own)",
    )
    return w


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="overcast", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--version", action="version", version=f"overcast {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        # argparse expands % in the list's help (not in a description): "5%" would break it
        return sub.add_parser(
            name, help=help.replace("%", "%%"), description=help, formatter_class=HelpFormatter
        )

    for add in (
        _add_bench,
        _add_train,
        _add_soak,
        scale.add_commands,
        _add_check,
        _add_cluster,
        _add_aggregator,
    ):
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
        argv, command = argv[:cut], argv[cut + 1 :]
    args = parser().parse_args(argv)
    args.command = command
    if args.cmd in ("bench", "cluster", "train", "soak"):
        # Not root: become root of a user namespace of our own, where the kernel allows it.
        from overcast.cluster.userns import reexec

        reexec(["-m", "overcast.cli.main", *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Before torch loads: gloo's warnings about hosts without names (namespaces have none).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from overcast.cluster.launch import RankError
    from overcast.cluster.netns import ClusterError

    try:
        return args.func(args)
    except (ClusterError, ValueError) as err:
        print(f"overcast: {_as_typed(str(err), argv)}", file=sys.stderr)
        return 2
    except RankError as err:  # each rank's last line: what it raised, died of, or timed out on
        print(f"overcast: the job failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("overcast: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
