"""What each `overcast` command does once its flags are parsed (overcast/cli/main.py builds the
parser): bench, soak, train, check, the emulated cluster and the aggregator."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shlex
import subprocess
import sys
import threading

from overcast.cli.common import (
    aggregators_from,
    check_writable,
    console_for,
    csv_items,
    dropped_hosts,
    link_rates,
    parse_sizes,
    png_of,
    progress_bar,
    save_results,
)
from overcast.units import parse_size


def bench(args) -> int:
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
        raise ValueError(
            f"--roots takes 'all' or whole numbers, comma-separated, not {args.roots!r}"
        ) from None
    aggregators = aggregators_from(args)
    check_flags(
        args.hosts,
        rates,
        sizes,
        args.reps,
        args.warmup,
        args.mtu,
        roots,
        args.loss,
        args.loss_burst,
        args.slots,
        args.within,
        aggregators,
    )
    check_writable(args.json, "--json")
    check_writable(png_of(args), "--png")
    check_writable(args.timeline, "--timeline")
    bar, progress = progress_bar(console)
    with bar:
        doc = run_bench(
            args.hosts,
            [int(bits) for bits in rates],
            sizes,
            csv_items(args.collectives),
            csv_items(args.algorithms),
            reps=args.reps,
            warmup=args.warmup,
            mtu=args.mtu,
            roots=roots,
            loss=args.loss,
            loss_burst=args.loss_burst,
            timeline=args.timeline,
            aggregator_slots=args.slots,
            within=args.within,
            write_timeline=write_timeline,
            progress=progress,
            aggregators=aggregators,
        )
    print_table(doc, console, wide=args.wide)
    save_results(
        doc,
        console,
        args.json,
        png_of(args),
        plot_busbw if doc["meta"]["link_bits_per_s"] else plot_sweep,
    )
    for path in doc["meta"]["timelines"]:
        console.print(f"timeline: {path}.json, {path}.png")
    return 0 if all(r["correct"] for r in doc["results"]) else 1


def soak(args) -> int:
    from overcast.bench.soak import run_soak
    from overcast.report.soak import plot, summary_table

    console = console_for(args)
    [nbytes] = parse_sizes(args.sizes, several=False)
    [bits] = link_rates(args, several=False)
    try:
        marks = [int(m) for m in csv_items(args.marks)]
    except ValueError:
        raise ValueError(
            f"--marks takes whole numbers, comma-separated, not {args.marks!r}"
        ) from None
    check_writable(args.json, "--json")
    check_writable(png_of(args), "--png")
    bar, progress = progress_bar(console)
    with bar:  # run_soak checks every setting before it builds anything
        doc = run_soak(
            args.hosts,
            int(bits),
            args.pairs,
            nbytes,
            args.loss,
            args.loss_burst,
            marks,
            progress=progress,
            aggregators=aggregators_from(args),
            kill_every=args.kill_aggregator_every,
        )
    console.print(summary_table(doc))
    save_results(doc, console, args.json, png_of(args), plot)
    return 0 if doc["summary"]["pairs_exact"] == args.pairs else 1


def train(args) -> int:
    from overcast.train.config import SHAPES, GPTConfig, check_request

    console = console_for(args)
    ways = csv_items(args.ways)
    [bits] = link_rates(args, several=False)
    given = GPTConfig(
        vocab=args.vocab,
        blocks=args.blocks,
        dim=args.dim,
        seq=args.seq,
        batch_per_rank=args.batch,
        reshard=args.reshard,
        micro_steps=args.micro_steps,
        activation_checkpointing=args.activation_checkpointing,
    )
    if args.shapes:
        names = csv_items(args.shapes)
        unknown = [n for n in names if n not in SHAPES]
        if unknown or not names:
            raise ValueError(
                f"unknown shape {', '.join(unknown) or '(none)'}; available: {', '.join(SHAPES)}"
            )
        shapes = [(n, dataclasses.replace(given, **SHAPES[n])) for n in names]
    else:
        shapes = [("default" if given == GPTConfig() else "given", given)]
    for _, cfg in shapes:
        check_request(
            ways,
            args.hosts,
            args.steps,
            args.warmup,
            bits,
            cfg,
            args.lr,
            args.prefetch,
            args.device,
        )
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
        doc = run_training(
            args.hosts,
            int(bits),
            ways,
            args.steps,
            args.warmup,
            shapes,
            aggregator_bits=aggregator_bits,
            drop_multicast=dropped,
            lr=args.lr,
            out_dir=args.out,
            progress=progress,
            prefetch=args.prefetch,
            sched_trace=args.sched_trace,
            device=args.device,
            write_timeline=functools.partial(write_timeline, select=every_span),
        )
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


def check(args) -> int:
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ValueError(
            "check runs on every rank of the job, under a launcher that sets "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: torchrun [...] "
            "--no-python overcast check, or overcast cluster run --hosts 4 -- "
            "overcast check"
        ) from None
    if world < 2:
        raise ValueError(
            f"check needs 2 ranks or more (WORLD_SIZE is {world}): a job of one "
            f"rank sends nothing over the network, so there is nothing to check"
        )
    link = None if args.link_mbit is None else args.link_mbit * 1e6
    if link is not None and not (math.isfinite(link) and link > 0):
        raise ValueError(
            f"the link rate must be above 0 Mbit/s, not {args.link_mbit:g} (--link-mbit)"
        )
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


def cluster(args) -> int:
    from overcast.cluster.netns import Cluster, clean_leftovers

    if args.action == "clean":
        removed = clean_leftovers(force=args.force)
        print(
            f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed) if removed else "")
        )
        return 0
    if args.action == "run" and not args.command:
        raise ValueError(
            "cluster run: give the command to run on every host after --, as in "
            "overcast cluster run --hosts 4 -- python train.py"
        )
    [bits] = link_rates(args, several=False)
    aggregators = aggregators_from(args)
    dropped = dropped_hosts(args)
    with Cluster(
        args.hosts,
        int(bits),
        mtu=args.mtu,
        aggregators=aggregators.count,
        aggregator_bits_per_s=aggregators.link_bits,
        drop_multicast=dropped,
    ) as cluster:
        if args.action == "up":
            print(
                f"cluster {cluster.run_id}: hosts {' '.join(cluster.host_ns)}, switch "
                f"{cluster.switch_ns}, aggregators {' '.join(cluster.aggregator_ns)}"
            )
            print("enter a host with: ip netns exec <host> <command>; Ctrl-C tears it down")
            threading.Event().wait()
        if args.aggregators_run:  # in-network reduction needs them (OVERCAST_AGGREGATORS)
            cluster.start_aggregators(shards=aggregators.shards)
        procs = [
            cluster.start(args.command, host=i, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for i in range(args.hosts)
        ]
        relays = [
            threading.Thread(target=_relay, args=(p.stdout, f"[rank {i}] ".encode()), daemon=True)
            for i, p in enumerate(procs)
        ]
        for relay in relays:
            relay.start()
        codes = [p.wait() for p in procs]
        for relay in relays:
            relay.join()
        return max(codes, key=abs)


def aggregator(args) -> int:
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
        print(
            "overcast aggregator: set OVERCAST_SECRET (hex) to the job's secret, or "
            "OVERCAST_SECRETS to several, comma-separated",
            file=sys.stderr,
        )
        return 2
    run(
        args.host,
        args.port,
        secrets,
        args.slots,
        args.stats,
        ready=lambda line: print(line, flush=True),
        lifeline=args.lifeline,
        limits=limits,
        expiry=args.expiry,
        shards=shards,
    )
    return 0


def switch(args) -> int:
    print(
        "overcast: `overcast switch` is the old name of `overcast aggregator`; running that",
        file=sys.stderr,
    )
    return aggregator(args)
