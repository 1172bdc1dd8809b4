"""`overcast simulate` and `overcast plan`: the commands that run no network, and need no root."""

from __future__ import annotations

from dataclasses import replace

from overcast.cli.common import (
    check_writable,
    console_for,
    csv_items,
    file_flags,
    hosts_flag,
    link_flags,
    link_rates,
    parse_floats,
    parse_ints,
    parse_sizes,
    png_of,
    progress_bar,
    read_json_files,
    save_results,
)


def _simulate(args) -> int:
    from overcast.report.simulate import plot_simulate, simulate_table
    from overcast.sim.engine import AggregatorPool, engine
    from overcast.sim.run import compare, sweep

    console = console_for(args)
    model = engine(args.engine)
    if args.host_cores is not None:
        model = model.with_cores(args.host_cores)
    rates = link_rates(args, several=True)
    sizes = parse_sizes(args.sizes)
    hosts = parse_ints(args.hosts, "--hosts")
    measured = read_json_files(csv_items(args.compare), "--compare") if args.compare else None
    pool = (
        None
        if args.aggregators is None
        else AggregatorPool(
            args.aggregators,
            args.shards,
            None if args.aggregator_link_gbit is None else args.aggregator_link_gbit * 1e9,
            args.us_per_contribution,
        )
    )
    check_writable(args.json, "--json")
    check_writable(png_of(args), "--png")
    bar, progress = progress_bar(console)
    with bar:  # sweep checks every setting before the first run
        doc = sweep(
            hosts,
            args.topology,
            rates,
            sizes,
            csv_items(args.collectives),
            csv_items(args.algorithms),
            radix=args.radix,
            oversubscription=parse_floats(args.oversubscription, "--oversubscription"),
            levels=args.levels,
            roots=None if args.roots == "all" else parse_ints(args.roots, "--roots")[0],
            engine=model,
            place=args.placement,
            latency=args.latency_us * 1e-6,
            shared_cores=args.machine_cores,
            aggregators=pool,
            progress=progress,
        )
    if measured is not None:
        compare(doc, measured)
    console.print(simulate_table(doc, wide=args.wide))
    save_results(doc, console, args.json, png_of(args), plot_simulate)
    return 0


def _plan(args) -> int:
    from overcast.report.simulate import plan_lines, plan_table, plot_plan
    from overcast.sim.plan import (
        PRESETS,
        AggregatorSizing,
        Job,
        Model,
        compute_from_profile,
        parse_count,
        plan,
    )

    console = console_for(args)
    kind, radix = args.topology, args.radix
    if args.preset:
        if args.preset not in PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}; available: {', '.join(PRESETS)}")
        kind, radix, hosts, gbits = PRESETS[args.preset]
        rates = [g * 1e9 for g in gbits]
    else:
        hosts, rates = parse_ints(args.hosts, "--hosts"), link_rates(args, several=True)
    options = {
        "dtype": args.dtype,
        "reduce_dtype": args.reduce_dtype,
        "micro_steps": args.micro_steps,
    }
    if args.layer_params:
        model = Model(
            tuple(parse_count(x, "--layer-params") for x in csv_items(args.layer_params)), **options
        )
    else:
        model = Model.uniform(parse_count(args.params, "--params"), args.layers, **options)
    job = Job(
        args.ranks_per_node,
        args.mtu,
        args.host_cores,
        aggregators=int(args.aggregators) if args.aggregators.isdigit() else args.aggregators,
    )
    if args.compute_ms and args.timed:
        raise ValueError(
            "give the compute per layer (--compute-ms) or a step profile (--timed), not both"
        )
    if args.compute_ms:
        given = parse_floats(args.compute_ms, "--compute-ms")
        if len(given) not in (1, 2):
            raise ValueError(
                f"--compute-ms takes a layer's forward milliseconds, and its "
                f"backward's (default: twice the forward), not {args.compute_ms!r}"
            )
        forward, backward = given[0] / 1e3, (given[1] if len(given) > 1 else 2 * given[0]) / 1e3
        job = replace(
            job,
            compute=(forward, backward),
            compute_from=f"{forward * 1e3:g} ms forward, {backward * 1e3:g} ms backward (given)",
        )
    elif args.timed:
        compute, said = compute_from_profile(args.timed, model)
        job = replace(job, compute=compute, compute_from=said)
    check_writable(args.json, "--json")
    check_writable(png_of(args), "--png")
    sizing = AggregatorSizing(
        args.within,
        args.aggregator_cores,
        None if args.aggregator_link_gbit is None else args.aggregator_link_gbit * 1e9,
    )
    bar, progress = progress_bar(console)
    with bar:  # plan checks the model, the job and the cluster before the first run
        doc = plan(
            model,
            kind,
            hosts,
            rates,
            radix=radix,
            oversubscription=parse_floats(args.oversubscription, "--oversubscription"),
            job=job,
            sizing=sizing,
            progress=progress,
        )
    console.print(plan_table(doc, wide=args.wide))
    for line in plan_lines(doc):
        console.print(line, highlight=False)
    save_results(doc, console, args.json, png_of(args), plot_plan)
    return 0


def add_commands(command) -> None:
    """simulate and plan, as subcommands made by `command(name, help)`."""
    from overcast.sim.engine import AGGREGATOR_US_PER_CONTRIBUTION

    m = command(
        "simulate",
        "predict collectives on a large cluster (a flow-level simulator; "
        "nothing runs on a network, no root needed)",
    )
    hosts_flag(m, "8,64,188,1024", many=True)
    link_flags(m, "100", "--link-gbit", several=True)
    m.add_argument("--topology", default="fat-tree", help="star (one switch) or fat-tree")
    m.add_argument("--radix", type=int, default=32, help="fat tree: ports per switch")
    m.add_argument(
        "--levels",
        type=int,
        help="fat tree: switch levels (default: the fewest that hold the hosts)",
    )
    m.add_argument(
        "--oversubscription",
        default="1",
        help="fat tree: down over up ports, one per level from the leaves up, or one for all",
    )
    m.add_argument(
        "--placement",
        default="contiguous",
        help="contiguous (rank r on leaf r // hosts per leaf) or strided",
    )
    m.add_argument("--latency-us", type=float, default=1.0, help="latency per link, us")
    m.add_argument(
        "--sizes",
        "--bytes-per-rank",
        "--size",
        dest="sizes",
        default="64MiB",
        help="bytes per rank, comma-separated",
    )
    m.add_argument(
        "--collectives",
        default="allgather,reduce_scatter,overlap",
        help="allgather, reduce_scatter, overlap; comma-separated",
    )
    m.add_argument(
        "--algorithms",
        default="ring,multicast,innetwork,overcast",
        help="ring, multicast, innetwork, overcast; comma-separated",
    )
    m.add_argument("--roots", default="all", help="multicast roots sending at once, or 'all'")
    m.add_argument(
        "--engine",
        default="ideal",
        help="ideal (links only), native (overcast's engine as measured) or offload "
        "(an engine on the NIC)",
    )
    m.add_argument(
        "--host-cores",
        "--cores",
        dest="host_cores",
        type=float,
        help="engine cores per host (default: the engine's own)",
    )
    m.add_argument(
        "--machine-cores",
        type=float,
        help="every host and the aggregator share this many cores, as the emulated "
        "cluster's one machine does",
    )
    m.add_argument(
        "--aggregators",
        type=int,
        help="software aggregators that sum in-network reductions, the chunks "
        "striped over them (default: the switch sums at line rate)",
    )
    m.add_argument("--shards", type=int, default=1, help="cores per aggregator, one shard each")
    m.add_argument(
        "--aggregator-link-gbit",
        type=float,
        help="each aggregator's link, Gbit/s per direction (default: unbounded)",
    )
    m.add_argument(
        "--us-per-contribution",
        type=float,
        default=AGGREGATOR_US_PER_CONTRIBUTION,
        help="a shard's wall time per contribution, microseconds (measured)",
    )
    m.add_argument(
        "--compare",
        help="overcast bench JSON files (comma-separated, one per run): "
        "their measured times beside the predictions",
    )
    file_flags(
        m, "write {meta, results} here (JSON)", "time over the floor and link traffic against hosts"
    )
    m.add_argument(
        "--wide",
        action="store_true",
        help="every column (link traffic, busiest link, rx per NIC, engine cores); "
        "the JSON has them all",
    )
    m.set_defaults(func=_simulate)

    n = command(
        "plan",
        "your training job's step on a cluster, against an NCCL-like ring at "
        "line rate, which to use and the hardware it assumes (simulated, no "
        "root needed)",
    )
    n.add_argument(
        "--preset",
        help="a cluster by name: emulated, ethernet-fat-tree, rail-400g "
        "(instead of --hosts, --link-gbit, --topology, --radix)",
    )
    hosts_flag(n, "8,64,188,1024", many=True)
    link_flags(n, "100,400,1600", "--link-gbit", several=True)
    n.add_argument("--topology", default="fat-tree", help="star or fat-tree")
    n.add_argument("--radix", type=int, default=32, help="fat tree: ports per switch")
    n.add_argument(
        "--oversubscription",
        default="1",
        help="fat tree: down over up ports, per level or one for all",
    )
    n.add_argument("--params", default="7B", help="the model's parameter count (7B, 350M, 1.3e9)")
    n.add_argument("--layers", type=int, default=32, help="FSDP units (one per block)")
    n.add_argument(
        "--layer-params",
        help="each unit's parameter count, comma-separated (instead of --params and --layers)",
    )
    n.add_argument("--dtype", default="bf16", help="the gathered dtype (FSDP2's param_dtype)")
    n.add_argument("--reduce-dtype", help="the gradients' dtype (default: --dtype)")
    n.add_argument("--micro-steps", type=int, default=1, help="gradient accumulation steps")
    n.add_argument(
        "--ranks-per-node", type=int, default=1, help="ranks on each node, sharing its NIC"
    )
    n.add_argument(
        "--mtu",
        type=int,
        default=9000,
        help="the path MTU, bytes: overcast's engine pays per datagram",
    )
    n.add_argument(
        "--host-cores",
        "--cores",
        dest="host_cores",
        type=float,
        help="cores per node overcast's engine may use (default: one per rank, "
        "what it uses: a thread per rank)",
    )
    n.add_argument(
        "--compute-ms",
        help="each layer's compute per micro-step, ms: forward[,backward] (default "
        "backward: twice the forward; default: none, communication alone)",
    )
    n.add_argument(
        "--timed",
        metavar="FILE",
        help="a step profile from overcast.fsdp.timed(model) (handle.profile) or "
        "overcast train: its compute, the step less its exposed "
        "communication, shared among the layers (instead of --compute-ms)",
    )
    n.add_argument(
        "--aggregators",
        default="sized",
        help="what sums the in-network reductions: sized (aggregator hosts sized "
        "for --within), switch (a switch that sums at line rate), "
        "beside-rank-0 (one on node 0, as overlap() starts without "
        "OVERCAST_AGGREGATORS), or a number of aggregator hosts",
    )
    n.add_argument(
        "--within",
        type=float,
        default=1.10,
        help="size overcast's software aggregators for the pair to hold this many times its floor",
    )
    n.add_argument(
        "--aggregator-cores",
        type=int,
        default=16,
        help="cores per aggregator host (one shard each)",
    )
    n.add_argument(
        "--aggregator-link-gbit",
        type=float,
        default=None,
        help="each aggregator host's link, Gbit/s per direction (default: the hosts' link rate)",
    )
    file_flags(n, "write {meta, results} here (JSON)", "the speedup against hosts and link rate")
    n.add_argument(
        "--wide",
        action="store_true",
        help="every column (exposed communication, an offloaded engine's step, the "
        "pair on the sized aggregators); the JSON has them all",
    )
    n.set_defaults(func=_plan)
