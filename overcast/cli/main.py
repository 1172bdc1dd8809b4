"""The `overcast` command: train (the main job), bench, soak, simulate and plan (at scale,
without a network), the emulated cluster (up, run, clean) and the aggregator (switch)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import signal
import sys
import threading

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from overcast.report.bench import WIDTH
from overcast.units import parse_size


def _console(args) -> Console:
    """The terminal's width, or where output is not a terminal, 120 columns (or as wide as
    --wide's tables need)."""
    return Console(width=None if sys.stdout.isatty() else
                   (250 if getattr(args, "wide", False) else WIDTH))


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _bench(args) -> int:
    from overcast.bench.run import check_flags, check_request, run_bench
    from overcast.report.bench import plot_busbw, plot_sweep, print_table
    from overcast.report.timeline import write_timeline

    console = _console(args)
    sizes = [parse_size(s) for s in _csv(args.sizes)]
    rates = [mbit * 1e6 for mbit in _floats(args.link_mbit, "--link-mbit")]
    check_request(_csv(args.collectives), _csv(args.algorithms))
    try:
        roots = [None if r == "all" else int(r) for r in _csv(args.roots)]
    except ValueError:
        raise ValueError(f"--roots takes 'all' or whole numbers, comma-separated, not "
                         f"{args.roots!r}") from None
    check_flags(args.hosts, rates, sizes, args.reps, args.warmup, args.mtu, roots, args.loss,
                args.loss_burst, args.slots, args.within)
    bar, progress = _progress(console)
    with bar:
        doc = run_bench(args.hosts, [int(bits) for bits in rates], sizes, _csv(args.collectives),
                        _csv(args.algorithms), reps=args.reps, warmup=args.warmup, mtu=args.mtu,
                        roots=roots, loss=args.loss, loss_burst=args.loss_burst,
                        timeline=args.timeline, switch_slots=args.slots, within=args.within,
                        write_timeline=write_timeline,
                        progress=progress)
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
    nbytes = parse_size(args.size)
    try:
        marks = [int(m) for m in _csv(args.marks)]
    except ValueError:
        raise ValueError(f"--marks takes whole numbers, comma-separated, not {args.marks!r}") \
            from None
    bar, progress = _progress(console)
    with bar:  # run_soak checks every setting before it builds anything
        doc = run_soak(args.hosts, int(args.link_mbit * 1e6), args.pairs, nbytes, args.loss,
                       args.loss_burst, marks, progress=progress)
    console.print(summary_table(doc))
    _save(doc, console, args.json, _png(args), plot)
    return 0 if doc["summary"]["pairs_exact"] == args.pairs else 1


def _simulate(args) -> int:
    from overcast.report.simulate import plot_simulate, simulate_table
    from overcast.sim.engine import engine
    from overcast.sim.run import compare, sweep

    console = _console(args)
    model = engine(args.engine)
    if args.cores is not None:
        model = model.with_cores(args.cores)
    bar, progress = _progress(console)
    with bar:  # sweep checks every setting before the first run
        doc = sweep(_ints(args.nodes, "--nodes"), args.topology,
                    [g * 1e9 for g in _floats(args.link_gbit, "--link-gbit")],
                    [parse_size(s) for s in _csv(args.bytes_per_rank)],
                    _csv(args.collectives), _csv(args.algorithms), radix=args.radix,
                    oversubscription=_floats(args.oversubscription, "--oversubscription"),
                    levels=args.levels, roots=None if args.roots == "all" else
                    _ints(args.roots, "--roots")[0], engine=model, place=args.placement,
                    latency=args.latency_us * 1e-6, shared_cores=args.machine_cores,
                    progress=progress)
    if args.compare:
        measured = []
        for path in _csv(args.compare):
            with open(path) as f:
                measured.append(json.load(f))
        compare(doc, measured)
    console.print(simulate_table(doc, wide=args.wide))
    _save(doc, console, args.json, args.plot, plot_simulate)
    return 0


def _plan(args) -> int:
    from overcast.report.simulate import plan_table, plot_plan
    from overcast.sim.plan import PRESETS, Model, parse_count, plan

    console = _console(args)
    kind, radix, nodes, gbits = args.topology, args.radix, args.nodes, args.link_gbit
    if args.preset:
        if args.preset not in PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}; available: {', '.join(PRESETS)}")
        kind, radix, nodes, gbits = PRESETS[args.preset]
        nodes, gbits = ",".join(map(str, nodes)), ",".join(map(str, gbits))
    options = {"dtype": args.dtype, "reduce_dtype": args.reduce_dtype,
               "micro_steps": args.micro_steps}
    if args.layer_params:
        model = Model(tuple(parse_count(x, "--layer-params") for x in _csv(args.layer_params)),
                      **options)
    else:
        model = Model.uniform(parse_count(args.params, "--params"), args.layers, **options)
    bar, progress = _progress(console)
    with bar:  # plan checks the model and the cluster before the first run
        doc = plan(model, kind, _ints(nodes, "--nodes"),
                   [g * 1e9 for g in _floats(gbits, "--link-gbit")], radix=radix,
                   oversubscription=_floats(args.oversubscription, "--oversubscription"),
                   host_cores=args.host_cores, progress=progress)
    console.print(plan_table(doc))
    for p in doc["results"]:
        console.print(f"{p['nodes']} nodes, {p['link_bits_per_s'] / 1e9:g} Gbit/s: "
                      f"[bold]{p['choice']}[/]: {p['why']}", highlight=False)
    _save(doc, console, args.json, args.plot, plot_plan)
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


def _progress(console: Console):
    """A transient progress bar, and the callback (done, total, what) that moves it."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                   console=console, transient=True)
    task = bar.add_task("starting", total=None)
    return bar, lambda done, total, what: bar.update(task, completed=done, total=total,
                                                     description=what)


def _train(args) -> int:
    from overcast.train.config import SHAPES, GPTConfig, check_request

    console = _console(args)
    ways = _csv(args.ways)
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
        check_request(ways, args.hosts, args.steps, args.warmup, args.link_mbit * 1e6, cfg,
                      args.lr, args.prefetch, args.device)
    os.makedirs(args.out, exist_ok=True)
    # torch loads with these: only once every flag has been checked
    from overcast.train.compare import run_training
    from overcast.report.timeline import every_span, write_timeline
    from overcast.report.train import matrix_table, staging_lines, table, write
    bar, progress = _progress(console)
    with bar:
        doc = run_training(args.hosts, int(args.link_mbit * 1e6), ways, args.steps, args.warmup,
                           shapes, lr=args.lr, out_dir=args.out, progress=progress,
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


def _cluster(args) -> int:
    from overcast.cluster.netns import Cluster, clean_leftovers

    if args.action == "clean":
        removed = clean_leftovers(force=args.force)
        print(f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed) if removed
                                                         else ""))
        return 0
    with Cluster(args.hosts, int(args.link_mbit * 1e6), mtu=args.mtu) as cluster:
        if args.action == "up":
            print(f"cluster {cluster.run_id}: hosts {' '.join(cluster.host_ns)}, switch "
                  f"{cluster.switch_ns}, service {cluster.service_ns}")
            print("enter a host with: ip netns exec <host> <command>; Ctrl-C tears it down")
            threading.Event().wait()
        if not args.command:
            print("nothing to run: give a command after --", file=sys.stderr)
            return 2
        if args.switch:  # in-network reduction needs the aggregator; OVERCAST_SWITCH says where
            cluster.start_switch()
        procs = [cluster.start(args.command, host=i) for i in range(args.hosts)]
        codes = [p.wait() for p in procs]
        return max(codes, key=abs)


def _switch(args) -> int:
    from overcast.limits import check_count, check_port, check_positive, check_slots
    from overcast.switch.service import Limits, run

    check_port(args.port)
    check_slots(args.slots)
    check_count("the largest world", args.max_world, 2, "--max-world")
    check_count("communicators per job", args.max_communicators, 1, "--max-communicators")
    check_positive("a reduction's expiry", args.expiry, "--expiry", " seconds")
    limits = Limits(args.max_world, args.max_communicators, parse_size(args.pool_bytes))
    given = os.environ.get("OVERCAST_SECRETS", "") or os.environ.get("OVERCAST_SECRET", "")
    secrets = [bytes.fromhex(x) for x in _csv(given)]
    if not secrets:
        print("overcast switch: set OVERCAST_SECRET (hex) to the job's secret, or "
              "OVERCAST_SECRETS to several, comma-separated", file=sys.stderr)
        return 2
    run(args.host, args.port, secrets, args.slots, args.stats,
        ready=lambda line: print(line, flush=True), lifeline=args.lifeline, limits=limits,
        expiry=args.expiry)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="overcast", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bench", help="benchmark collectives on the emulated cluster")
    b.add_argument("--hosts", type=int, default=8)
    b.add_argument("--link-mbit", default="400",
                   help="link rate per direction, Mbit/s; several, comma-separated, sweep: "
                        "every point runs on a cluster of each rate")
    b.add_argument("--within", type=float, default=1.15,
                   help="a sweep names, per point, the highest rate at which it takes at most "
                        "this many times its floor")
    b.add_argument("--sizes", default="64KiB,1MiB,4MiB", help="bytes per rank, comma-separated")
    b.add_argument("--collectives", default="allgather,reduce_scatter")
    b.add_argument("--algorithms", default="ring,gloo")
    b.add_argument("--reps", type=int, default=5, help="timed runs per point")
    b.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    b.add_argument("--mtu", type=int, default=9000)
    b.add_argument("--roots", default="all",
                   help="multicast AllGather: ranks sending at once, comma-separated list to "
                        "compare; 'all' = every rank")
    b.add_argument("--loss", type=float, default=0.0,
                   help="fraction of received datagrams each host drops (TCP is untouched)")
    b.add_argument("--loss-burst", type=float, default=1.0,
                   help="mean length of a loss burst, in datagrams (1 = independent losses)")
    b.add_argument("--timeline", metavar="PREFIX",
                   help="overlap: write the last run of overcast and ring at the largest size "
                        "as PREFIX-<algorithm>.json (Chrome trace) and .png")
    b.add_argument("--slots", type=int, default=256,
                   help="the aggregator's slots per reduction (its pool)")
    b.add_argument("--json", help="write results here")
    b.add_argument("--png", help="busbw plot (default: beside --json)")
    b.add_argument("--wide", action="store_true",
                   help="every column (algbw, payload ratios, CPU, the aggregator's); the JSON "
                        "has them all")
    b.set_defaults(func=_bench)

    t = sub.add_parser("train", help="train a small GPT with FSDP2 four ways on the emulated "
                                     "cluster and compare (the main job)")
    t.add_argument("--hosts", type=int, default=4)
    t.add_argument("--link-mbit", type=float, default=100.0,
                   help="link rate per direction, Mbit/s")
    t.add_argument("--ways", default="gloo,gloo-separate,overcast-ring,overcast",
                   help="comma-separated: gloo (one group), gloo-separate (ReduceScatter on its "
                        "own group), overcast-ring, overcast (multicast + in-network)")
    t.add_argument("--steps", type=int, default=6, help="training steps per way")
    t.add_argument("--warmup", type=int, default=1, help="first steps left out of the times")
    t.add_argument("--shapes",
                   help="train several model shapes in turn, comma-separated: small, default, "
                        "long, deep, wide, kept (overcast/train/config.py SHAPES); each changes "
                        "the shape flags' values, the rest hold for all")
    t.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    t.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    t.add_argument("--dim", "--width", type=int, default=256, help="model width")
    t.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    t.add_argument("--batch", type=int, default=4,
                   help="sequences per rank per micro-step")
    t.add_argument("--reshard", default="all-but-last",
                   help="blocks that free their parameters after forward (and gather them "
                        "again in backward): all-but-last, all, none, or block numbers, "
                        "comma-separated")
    t.add_argument("--micro-steps", type=int, default=1,
                   help="gradient accumulation: micro-batches per optimizer step, gradients "
                        "reduced on the last only (set_requires_gradient_sync)")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward (checkpoint_wrapper)")
    t.add_argument("--prefetch", type=int, default=1,
                   help="blocks each gathers ahead in forward and behind in backward "
                        "(overlap(prefetch=)), every way but gloo")
    t.add_argument("--sched-trace", action=argparse.BooleanOptionalAction, default=True,
                   help="record the scheduler (tracefs, root) to say what the training threads "
                        "waited behind for a CPU; it slowed overcast's short steps more than the "
                        "others' (4%% on the small shape run alone), so compare step times "
                        "without")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--wide", action="store_true",
                   help="every column (CPU waits, engine and per-rank CPU); the JSON has them "
                        "all")
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each host's rank trains: cpu, or cuda (every host's rank on this "
                        "machine's first GPU; overcast stages through pinned host memory); "
                        "default cpu")
    t.add_argument("--out", default="out/train", help="folder for results, plots and traces")
    t.set_defaults(func=_train)

    s = sub.add_parser("soak", help="many overlapped pairs under bursty loss: exact results, "
                                    "flat memory, no drift, nothing left behind")
    s.add_argument("--hosts", type=int, default=8)
    s.add_argument("--link-mbit", type=float, default=400.0,
                   help="link rate per direction, Mbit/s")
    s.add_argument("--pairs", type=int, default=1000,
                   help="overlapped pairs (multicast AllGather + in-network ReduceScatter)")
    s.add_argument("--size", default="256KiB", help="bytes per rank of each collective")
    s.add_argument("--loss", type=float, default=0.01,
                   help="fraction of received datagrams each host drops")
    s.add_argument("--loss-burst", type=float, default=4.0,
                   help="mean length of a loss burst, in datagrams")
    s.add_argument("--marks", default="100",
                   help="pairs after which memory is read (the last pair always is)")
    s.add_argument("--json", help="write results here")
    s.add_argument("--png", help="per-pair time plot (default: beside --json)")
    s.set_defaults(func=_soak)

    m = sub.add_parser("simulate", help="predict collectives on a large cluster (flow-level "
                                        "simulator); nothing is run on the network")
    m.add_argument("--nodes", default="8,64,188,1024", help="ranks (one per host), "
                                                            "comma-separated")
    m.add_argument("--topology", default="fat-tree", help="star (one switch) or fat-tree")
    m.add_argument("--radix", type=int, default=32, help="fat tree: ports per switch")
    m.add_argument("--levels", type=int, help="fat tree: switch levels (default: the fewest "
                                              "that hold the nodes)")
    m.add_argument("--oversubscription", default="1",
                   help="fat tree: down over up ports, one per level from the leaves up, or one "
                        "for all")
    m.add_argument("--placement", default="contiguous",
                   help="contiguous (rank r on leaf r // hosts per leaf) or strided")
    m.add_argument("--link-gbit", default="100", help="link rate per direction, Gbit/s, "
                                                      "comma-separated")
    m.add_argument("--latency-us", type=float, default=1.0, help="latency per link, us")
    m.add_argument("--bytes-per-rank", default="64MiB", help="N, comma-separated")
    m.add_argument("--collectives", default="allgather,reduce_scatter,overlap")
    m.add_argument("--algorithms", default="ring,multicast,innetwork,overcast")
    m.add_argument("--roots", default="all", help="multicast roots sending at once, or 'all'")
    m.add_argument("--engine", default="ideal",
                   help="ideal (links only), native (overcast's engine as measured, one core "
                        "per host) or offload (the paper's SmartNIC engine)")
    m.add_argument("--cores", type=float, help="engine cores per host (default: the engine's)")
    m.add_argument("--machine-cores", type=float,
                   help="every host and the aggregator share this many cores, as the emulated "
                        "cluster's one machine does")
    m.add_argument("--compare", help="overcast bench JSON files (comma-separated, one per run): "
                                     "put their measured times beside the predictions")
    m.add_argument("--json", help="write {meta, results} here")
    m.add_argument("--plot", help="write time/floor and link traffic against nodes here (PNG)")
    m.add_argument("--wide", action="store_true",
                   help="every column (link traffic, busiest link, rx per NIC, engine cores); "
                        "the JSON has them all")
    m.set_defaults(func=_simulate)

    n = sub.add_parser("plan", help="a training step's communication on a cluster, rings "
                                    "against overcast, and which to use (simulated)")
    n.add_argument("--preset", help="a cluster by name: emulated, ethernet-fat-tree, rail-400g "
                                    "(instead of --nodes, --link-gbit, --topology, --radix)")
    n.add_argument("--nodes", default="8,64,188,1024", help="comma-separated")
    n.add_argument("--link-gbit", default="100,400,1600", help="comma-separated")
    n.add_argument("--topology", default="fat-tree", help="star or fat-tree")
    n.add_argument("--radix", type=int, default=32)
    n.add_argument("--oversubscription", default="1")
    n.add_argument("--params", default="7B", help="the model's parameter count (7B, 350M, 1.3e9)")
    n.add_argument("--layers", type=int, default=32, help="FSDP units (one per block)")
    n.add_argument("--layer-params", help="each unit's parameter count, comma-separated "
                                          "(instead of --params and --layers)")
    n.add_argument("--dtype", default="bf16", help="the gathered dtype (FSDP2's param_dtype)")
    n.add_argument("--reduce-dtype", help="the gradients' dtype (default: --dtype)")
    n.add_argument("--micro-steps", type=int, default=1, help="gradient accumulation steps")
    n.add_argument("--host-cores", type=float, default=8.0,
                   help="cores per host the communication engine may use")
    n.add_argument("--json", help="write {meta, results} here")
    n.add_argument("--plot", help="write the speedup against nodes and link rate here (PNG)")
    n.set_defaults(func=_plan)

    c = sub.add_parser("cluster", help="the emulated cluster of network namespaces")
    c.add_argument("action", choices=("up", "run", "clean"),
                   help="up: build and hold until Ctrl-C; run: run a command on every host; "
                        "clean: remove what killed runs left behind")
    c.add_argument("--hosts", type=int, default=4)
    c.add_argument("--link-mbit", type=float, default=400.0)
    c.add_argument("--mtu", type=int, default=9000)
    c.add_argument("--force", action="store_true", help="clean: also remove live runs' namespaces")
    c.add_argument("--no-switch", dest="switch", action="store_false",
                   help="run: do not start the aggregator (overcast switch) on the service "
                        "attachment")
    c.set_defaults(func=_cluster)

    from overcast.native import EXPIRY_SECONDS
    from overcast.switch.service import Limits

    w = sub.add_parser("switch", help="the aggregator for in-network reduction, standing in the "
                                      "switch")
    w.add_argument("--host", default="0.0.0.0")
    w.add_argument("--port", type=int, default=18515, help="TCP and UDP port")
    w.add_argument("--slots", type=int, default=256,
                   help="chunks each reduction may have in the aggregator at once (its pool)")
    w.add_argument("--stats", help="write counters and peak memory here (JSON) on exit")
    w.add_argument("--max-world", type=int, default=Limits.max_world,
                   help="the largest communicator it registers (ranks; default %(default)s)")
    w.add_argument("--max-communicators", type=int, default=Limits.max_communicators,
                   help="communicators one job may register at once (default %(default)s)")
    w.add_argument("--pool-bytes", default=str(Limits.pool_bytes),
                   help="what every communicator's reductions may hold together at their "
                        "largest, set aside when each registers, each job an even share "
                        "(bytes; k, M, G suffixes: powers of 1024; default 1G)")
    w.add_argument("--expiry", type=float, default=EXPIRY_SECONDS,
                   help="seconds a reduction may go without a contribution or acknowledgement "
                        "before it is given up and its memory freed (default %(default)s)")
    w.add_argument("--lifeline", type=int, metavar="FD",
                   help="exit when this inherited pipe closes (how a process that starts the "
                        "aggregator ties its life to its own)")
    w.set_defaults(func=_switch)
    c.epilog = "run: overcast cluster run --hosts 4 -- COMMAND [ARGS...]"
    return p


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
        print(f"overcast: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("overcast: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
