"""`overcast train` results for people: a table in the terminal, losses and step times as PNGs."""

from __future__ import annotations

import json
import os

from rich.table import Table

from overcast.bench.report import human_bytes
from overcast.train.compare import PEER


def table(doc: dict) -> Table:
    meta = doc["meta"]
    m = meta["model"]
    recipe = (f", {m['micro_steps']} micro-steps" if m.get("micro_steps", 1) > 1 else "") + \
        (", activation checkpointing" if m.get("activation_checkpointing") else "")
    t = Table(title=f"GPT ({meta['parameters'] / 1e6:.2f} M parameters, {m['blocks']} blocks, "
                    f"dim {m['dim']}{recipe}) with FSDP2 on {meta['hosts']} hosts, "
                    f"{meta['link_bits_per_s'] / 1e6:g} Mbit/s per direction; median of steps "
                    f"{meta['warmup'] + 1}-{meta['steps']}")
    for name in ("way", "step s", f"speedup vs {PEER}", "fwd comm s", "bwd comm s",
                 "tx/host/step", "rx/host/step", "cpu s/rank", "comm cpu ms (thread)",
                 "max |loss diff|"):
        t.add_column(name, justify="left" if name == "way" else "right")
    key = "speedup_vs_" + PEER.replace("-", "_")
    for r in doc["results"]:
        t.add_row(r["way"], f"{r['step_seconds']:.3f}",
                  f"{r[key]:.2f}x" if r[key] else "-",
                  f"{r['forward_comm_seconds']:.3f}", f"{r['backward_comm_seconds']:.3f}",
                  human_bytes(r["tx_bytes_per_host_per_step"]),
                  human_bytes(r["rx_bytes_per_host_per_step"]),
                  f"{r['cpu_seconds_per_rank']:.3f}",
                  f"{r['comm_thread_cpu_seconds_per_step'] * 1e3:.1f}",
                  f"{r['max_loss_difference']:.2e}")
    return t


def _figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_losses(doc: dict, path: str) -> None:
    """Loss per step, one line per way: they lie on each other when training is the same."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, style in zip(doc["results"], ("-", "--", "-.", ":")):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, marker="o", label=r["way"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("The same training four ways")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_steps(doc: dict, path: str) -> None:
    """Step time per way, split into exposed forward and backward communication and the rest."""
    plt = _figure()
    meta, results = doc["meta"], doc["results"]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    names = [r["way"] for r in results]
    forward = [r["forward_comm_seconds"] for r in results]
    backward = [r["backward_comm_seconds"] for r in results]
    rest = [max(0.0, r["step_seconds"] - f - b) for r, f, b in zip(results, forward, backward)]
    ax.barh(names, forward, label="forward communication (exposed)", color="tab:blue")
    ax.barh(names, backward, left=forward, label="backward communication (exposed)",
            color="tab:orange")
    ax.barh(names, rest, left=[f + b for f, b in zip(forward, backward)],
            label="compute and optimizer", color="tab:grey")
    for i, r in enumerate(results):
        ax.text(r["step_seconds"], i, f" {r['step_seconds']:.2f} s", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(r["step_seconds"] for r in results))
    ax.set_xlabel("seconds per training step (slowest rank, median)")
    ax.set_title(f"FSDP2 step on {meta['hosts']} hosts, {meta['link_bits_per_s'] / 1e6:g} Mbit/s")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(doc: dict, out_dir: str) -> list[str]:
    """train.json, losses.png and steps.png in `out_dir`; returns the paths written."""
    paths = [os.path.join(out_dir, name) for name in ("train.json", "losses.png", "steps.png")]
    with open(paths[0], "w") as f:
        json.dump(doc, f, indent=1)
    plot_losses(doc, paths[1])
    plot_steps(doc, paths[2])
    return paths
