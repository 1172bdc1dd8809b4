"""`overcast train` results for people: a table in the terminal, losses and step times as PNGs."""

from __future__ import annotations

import json
import os

from rich.table import Table

from overcast.report.bench import aggregator_text, table_of
from overcast.units import human_bytes
from overcast.train.compare import PEER
from overcast.train.config import OVERCAST_WAYS
from overcast.train.waits import AGGREGATOR, COMMUNICATION, NETWORK, TRAINING


def _shape_text(run: dict) -> str:
    m = run["model"]
    recipe = (f", {m['micro_steps']} micro-steps" if m["micro_steps"] > 1 else "") + (
        ", activation checkpointing" if m["activation_checkpointing"] else ""
    )
    return (
        f"{run['shape']}: {run['parameters'] / 1e6:.2f} M parameters, vocab {m['vocab']}, "
        f"{m['blocks']} blocks (reshard {m['reshard']}), width {m['dim']}, seq {m['seq']}, "
        f"batch {m['batch_per_rank']}{recipe}"
    )


def _columns(meta: dict) -> list[tuple[str, object, bool]]:
    """(header, the cell of a result, shown only with --wide) of the table's columns."""
    waits = meta.get("cpu_waits_measured", True)
    key = "speedup_vs_" + PEER.replace("-", "_")
    return [
        ("way", lambda r: r["way"], False),
        ("step s", lambda r: f"{r['step_seconds']:.3f}", False),
        ("speedup", lambda r: f"{r[key]:.2f}x" if r[key] else "-", False),
        ("fwd comm s", lambda r: f"{r['forward_comm_seconds']:.3f}", False),
        ("bwd comm s", lambda r: f"{r['backward_comm_seconds']:.3f}", False),
        ("compute s", lambda r: f"{r['compute_seconds']:.3f}", False),
        ("GIL wait ms", lambda r: f"{r['gil_wait_seconds'] * 1e3:.1f}" if waits else "-", True),
        ("CPU wait ms", lambda r: f"{r['cpu_wait_seconds'] * 1e3:.1f}" if waits else "-", True),
        ("behind hosts / comm ms", _behind, True),
        (
            "own-host compute s",
            lambda r: (
                f"{r['own_host_compute_seconds']:.3f}" if "own_host_compute_seconds" in r else "-"
            ),
            True,
        ),
        ("engine py ms", lambda r: f"{r['engine_python_cpu_seconds'] * 1e3:.0f}", True),
        ("tx/host/step", lambda r: human_bytes(r["tx_bytes_per_host_per_step"]), False),
        ("rx/host/step", lambda r: human_bytes(r["rx_bytes_per_host_per_step"]), False),
        ("cpu s/rank", lambda r: f"{r['cpu_seconds_per_rank']:.3f}", True),
        ("loss diff", lambda r: f"{r['max_loss_difference']:.1e}", False),
    ]


def table(doc: dict, run: dict, wide: bool = False) -> Table:
    """One shape: each way's step, its parts and traffic; with `wide`, its CPU waits and CPU
    too (the JSON has them all)."""
    meta = doc["meta"]
    prefetch = meta.get("prefetch", 1)
    t = table_of(
        f"GPT {_shape_text(run)}; FSDP2 on {meta['hosts']} hosts, "
        f"{meta['link_bits_per_s'] / 1e6:g} Mbit/s per direction"
        f"{_aggregator(meta, run['results'])}"
        f"{f', prefetch {prefetch} blocks' if prefetch != 1 else ''}; median of "
        f"steps {meta['warmup'] + 1}-{meta['steps']}; speedup over {PEER}; loss "
        f"diff: the largest from {run['results'][0]['way']}'s at any step",
        _columns(meta),
        run["results"],
        wide,
        left=("way",),
    )
    captions = []
    cores = meta["machine"]["cpus"]
    if cores < meta["hosts"]:
        captions.append(
            f"The {meta['hosts']} hosts share this machine's {cores} cores: training "
            f"threads that compute at once wait for each other, which a cluster "
            f"would not make them do"
            + (" (own-host compute leaves that wait out)." if wide else ".")
        )
    if wide and meta.get("cpu_waits_traced"):
        captions.append(
            "CPU wait: the training thread runnable, not running, outside the "
            "collective hooks; behind hosts: while other hosts' training threads "
            "held the cores; behind comm: the ranks' communication threads, the "
            "aggregator and the kernel's network (a scheduler trace). Own-host "
            "compute: compute less the wait behind other hosts."
        )
    if run["prediction"]:
        p = run["prediction"]
        c = p["collectives"]
        captions.append(
            f"per step: {c['pair']} backward pairs, {c['allgather']} AllGathers and "
            f"{c['reduce_scatter']} ReduceScatters alone; predicted (the step's "
            f"schedule, {p['compute_from']}'s compute, collectives at the link's "
            f"rate): overcast {p['step_seconds']['overcast']:.3f} s, rings "
            f"{p['step_seconds']['rings']:.3f} s, speed-up over rings "
            f"{p['speedup_over_rings']:.2f}x"
        )
    for r in run["results"]:
        captions += [f"{r['way']}: {said}" for said in r.get("warnings", [])]
    t.caption = "\n".join(captions) or None
    return t


def _aggregator(meta: dict, results: list[dict]) -> str:
    """ ", " and the aggregator's link, where a way reduced in the network; else nothing."""
    if not any(r.get("algorithms", {}).get("reduce_scatter") == "innetwork" for r in results):
        return ""
    return ", " + aggregator_text(1, meta.get("aggregator_link_bits_per_s"))


def _behind(result: dict) -> str:
    behind = result.get("cpu_wait_behind_seconds")
    if not behind:
        return "-"
    comm = behind[COMMUNICATION] + behind[AGGREGATOR] + behind[NETWORK]
    return f"{behind[TRAINING] * 1e3:.0f} / {comm * 1e3:.0f}"


def matrix_table(doc: dict, wide: bool = False) -> Table:
    """Every shape: overcast against its rings and the fair peer, predicted beside measured;
    with `wide`, the compute against the fair peer's too."""
    meta = doc["meta"]

    def step(run, way):
        ways = {r["way"]: r for r in run["results"]}
        return f"{ways[way]['step_seconds']:.3f}" if way in ways else "-"

    def against_peer(run, key):
        ways = {r["way"]: r for r in run["results"]}
        if "overcast" not in ways or PEER not in ways or key not in ways[PEER]:
            return "-"
        return f"{ways['overcast'][key] / ways[PEER][key]:.2f}x"

    def predicted(run, key, spec):
        p = run["prediction"] or {}
        return format(p[key], spec) + ("x" if spec == ".2f" else "") if key in p else "-"

    spec = [
        ("shape", lambda run: run["shape"], False),
        (
            "pairs",
            lambda run: str((run["prediction"] or {}).get("collectives", {}).get("pair", "-")),
            False,
        ),
        ("overcast s", lambda run: step(run, "overcast"), False),
        ("rings s", lambda run: step(run, "overcast-ring"), False),
        (PEER + " s", lambda run: step(run, PEER), False),
        ("vs rings", lambda run: predicted(run, "measured_speedup_over_rings", ".2f"), False),
        ("predicted", lambda run: predicted(run, "speedup_over_rings", ".2f"), False),
        ("vs predicted", lambda run: predicted(run, "overcast_over_predicted", ".3f"), False),
        ("compute vs peer", lambda run: against_peer(run, "compute_seconds"), True),
        (
            "own-host compute vs peer",
            lambda run: against_peer(run, "own_host_compute_seconds"),
            True,
        ),
        (
            "loss diff",
            lambda run: f"{max(r['max_loss_difference'] for r in run['results']):.1e}",
            False,
        ),
    ]
    return table_of(
        f"Shapes on {meta['hosts']} hosts, {meta['link_bits_per_s'] / 1e6:g} Mbit/s"
        f"{_aggregator(meta, [r for run in doc['shapes'] for r in run['results']])}: "
        f"step seconds, median of steps {meta['warmup'] + 1}-{meta['steps']}; vs "
        f"rings measured and predicted; overcast's step over the predicted one",
        spec,
        doc["shapes"],
        wide,
        left=("shape",),
    )


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(run: dict, path: str) -> None:
    """Loss per step, one line per way: they lie on each other when training is the same."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, style in zip(run["results"], ("-", "--", "-.", ":")):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, marker="o", label=r["way"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"{run['shape']}: the same training every way")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PREDICTED_AS = {"overcast": "overcast", "overcast-ring": "rings"}


def plot_steps(doc: dict, run: dict, path: str) -> None:
    """Step time per way, split into exposed forward and backward communication and the rest;
    the cost model's predicted step marked where there is one."""
    plt = _figure()
    meta, results = doc["meta"], run["results"]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    names = [r["way"] for r in results]
    forward = [r["forward_comm_seconds"] for r in results]
    backward = [r["backward_comm_seconds"] for r in results]
    rest = [max(0.0, r["step_seconds"] - f - b) for r, f, b in zip(results, forward, backward)]
    ax.barh(names, forward, label="forward communication (exposed)", color="tab:blue")
    ax.barh(
        names, backward, left=forward, label="backward communication (exposed)", color="tab:orange"
    )
    ax.barh(
        names,
        rest,
        left=[f + b for f, b in zip(forward, backward)],
        label="compute and optimizer",
        color="tab:grey",
    )
    for i, r in enumerate(results):
        ax.text(r["step_seconds"], i, f" {r['step_seconds']:.2f} s", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(r["step_seconds"] for r in results))
    ax.set_xlabel("seconds per training step (slowest rank, median)")
    predicted = (run["prediction"] or {}).get("step_seconds", {})
    for i, r in enumerate(results):
        way = PREDICTED_AS.get(r["way"])  # gloo's ReduceScatter is an allreduce: not modelled
        if way in predicted:
            ax.plot(
                [predicted[way]] * 2,
                [i - 0.4, i + 0.4],
                color="black",
                lw=1.5,
                label="predicted" if i == 0 else None,
            )
    ax.set_title(
        f"{run['shape']}: FSDP2 step on {meta['hosts']} hosts, "
        f"{meta['link_bits_per_s'] / 1e6:g} Mbit/s"
    )
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(doc: dict, out_dir: str) -> list[str]:
    """train.json, and losses-<shape>.png and steps-<shape>.png per shape, in `out_dir`, and
    where the gloo way ran (overcast.fsdp.timed), its step profile for `overcast plan --timed`
    as profile-<shape>.json; returns the paths written."""
    paths = [os.path.join(out_dir, "train.json")]
    with open(paths[0], "w") as f:
        json.dump(doc, f, indent=1)
    for run in doc["shapes"]:
        losses = os.path.join(out_dir, f"losses-{run['shape']}.png")
        steps = os.path.join(out_dir, f"steps-{run['shape']}.png")
        plot_losses(run, losses)
        plot_steps(doc, run, steps)
        paths += [losses, steps]
        timed = next((r for r in run["results"] if r["way"] == "gloo"), None)
        if timed is not None:
            paths.append(os.path.join(out_dir, f"profile-{run['shape']}.json"))
            with open(paths[-1], "w") as f:
                json.dump(profile_of(doc["meta"], timed), f, indent=1)
    return paths


def profile_of(meta: dict, result: dict) -> dict:
    """A way's step as a step profile (overcast.fsdp.Overlap.profile's form): the step, the
    communication it left exposed, its compute and that split between forward and backward."""
    return {
        "what": f"overcast train, way {result['way']}, {meta['hosts']} hosts at "
        f"{meta['link_bits_per_s'] / 1e6:g} Mbit/s",
        "steps": meta["steps"] - meta["warmup"],
        "step_seconds": result["step_seconds"],
        "exposed_seconds": result["forward_comm_seconds"] + result["backward_comm_seconds"],
        "compute_seconds": result["compute_seconds"],
        "forward_compute_seconds": result["forward_compute_seconds"],
        "backward_compute_seconds": result["backward_compute_seconds"],
    }


def staging_lines(run: dict) -> list[str]:
    """On a GPU, per way: the staging copies' GPU time per step beside the step, the pinned
    host memory held at the peak, and how much GPU memory grew after the warm-up."""
    return [
        f"{r['way']}: staging {r['staging_seconds'] * 1e3:.1f} ms/step of "
        f"{r['step_seconds'] * 1e3:.0f} ms, pinned peak {r['pinned_peak_bytes'] / 2**20:.0f} "
        f"MiB/rank, GPU memory growth {r['gpu_memory_growth_bytes'] / 2**20:.1f} MiB"
        + (", ReduceScatters gated" if r["stream_gates"] and r["way"] in OVERCAST_WAYS else "")
        for r in run["results"]
    ]
