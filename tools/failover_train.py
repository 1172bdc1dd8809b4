#!/usr/bin/env python3
"""FSDP2 training on the emulated cluster with its aggregator killed mid-run: overcast's losses
against gloo's, and its steps after the loss against its rings' (which need no aggregator).

    tools/failover_train.py --hosts 4 --link-mbit 100 --steps 12 --kill-at 4 [--json FILE]

Trains the default GPT three ways on one cluster (gloo, overcast's rings, overcast); rank 0 of
the overcast way kills the aggregator (SIGKILL) as step `--kill-at` begins. Prints the largest
loss difference from gloo's at any step, overcast's median step before the loss and after it
(from two steps after, so the step the loss falls in and the next are left out), and its rings'
median step."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from overcast.train.compare import run_training
from overcast.train.config import GPTConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--link-mbit", type=float, default=100)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=4, help="the step the aggregator dies at")
    p.add_argument("--json", help="write the run here")
    args = p.parse_args()
    if not 2 <= args.kill_at <= args.steps - 4:
        p.error("--kill-at: from 2 (after the warm-up) to --steps - 4 (steps to time after)")
    run = run_training(args.hosts, int(args.link_mbit * 1e6), ["gloo", "overcast-ring", "overcast"],
                       args.steps, 2, [("default", GPTConfig())], sched_trace=False,
                       kill_aggregator_at_step=args.kill_at)
    ways = {r["way"]: r for r in run["shapes"][0]["results"]}
    steps = ways["overcast"]["step_seconds_all"]
    before = statistics.median(steps[2:args.kill_at])
    after = statistics.median(steps[args.kill_at + 2:])
    rings = statistics.median(ways["overcast-ring"]["step_seconds_all"][2:])
    print(f"{args.hosts} hosts at {args.link_mbit:g} Mbit/s, {args.steps} steps, the aggregator "
          f"killed as step {args.kill_at} began")
    print(f"overcast's losses against gloo's: at most "
          f"{ways['overcast']['max_loss_difference']:.2e} apart (its rings': "
          f"{ways['overcast-ring']['max_loss_difference']:.2e})")
    print(f"overcast's step: {before:.3f} s before the loss, {after:.3f} s after it "
          f"(steps {args.kill_at + 2}-{args.steps - 1}); its rings' {rings:.3f} s: after / rings "
          f"{after / rings:.3f}")
    print("steps: " + " ".join(f"{s:.3f}" for s in steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
