"""Training as users run it: examples/train_gpt.py under torchrun (no root) and under
`overcast cluster run`, examples/own_model.py (a model of the user's own), and `overcast train`,
the four-way comparison."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import root_only, widest
from overcast.train.waits import TRACEFS, TRAINING, mount_tracefs

INSTANCES = os.path.join(TRACEFS, "instances")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", "2",
           "--blocks", "2", "--dim", "64"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2"]
CLI = [sys.executable, "-m", "overcast.cli.main"]


def aggregators_running(tag: str) -> int:
    """Aggregator processes started under `tag` (an environment variable's value they inherit):
    this test's, not another's on the machine."""
    out = subprocess.run(["pgrep", "-f", "overcast.cli.main aggregator"], capture_output=True,
                         text=True).stdout
    mark = f"OVERCAST_TEST_RUN={tag}".encode()
    running = 0
    for pid in out.split():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                running += mark in f.read().split(b"\0")
        except OSError:  # gone meanwhile
            pass
    return running


def losses(stdout: str) -> list[float]:
    """The losses an example printed (under `cluster run`, after its "[rank N]")."""
    lines = (re.sub(r"^\[rank \d+\] ", "", line) for line in stdout.splitlines())
    return [float(line.split()[-1]) for line in lines if line.startswith("step ")]


@pytest.mark.parametrize("flags", [[], ["--allgather", "ring", "--reduce-scatter", "ring"],
                                   ["--backend", "torch"]])
def test_example_under_torchrun(flags):
    """The same script, unchanged, on one machine's loopback: rank 0 starts the aggregator for
    in-network reduction; the torch backend's separate ReduceScatter group exits cleanly."""
    tag = os.urandom(8).hex()
    env = {**os.environ, "OVERCAST_LINK_BITS_PER_S": "1e9", "OMP_NUM_THREADS": "1",
           "OVERCAST_TEST_RUN": tag}
    for name in ("OVERCAST_AGGREGATORS", "OVERCAST_SWITCH"):  # its old name
        env.pop(name, None)
    proc = subprocess.run(TORCHRUN + EXAMPLE[1:] + flags, capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert len(losses(proc.stdout)) == 2
    assert aggregators_running(tag) == 0


def test_own_model_trains_as_under_gloo():
    """examples/own_model.py, a model written with plain torch.nn (nn.MultiheadAttention's
    packed projections, every block resharded, accumulation over 2 micro-steps, activation
    checkpointing): overcast gives the losses gloo gives, bit for bit (two ranks' sums do not
    depend on their order)."""
    script = [os.path.join(ROOT, "examples", "own_model.py"), "--steps", "2", "--blocks", "2",
              "--dim", "64", "--vocab", "512", "--seq", "32", "--micro-steps", "2",
              "--checkpoint"]
    env = {**os.environ, "OVERCAST_LINK_BITS_PER_S": "1e9", "OMP_NUM_THREADS": "1"}
    for name in ("OVERCAST_AGGREGATORS", "OVERCAST_SWITCH"):  # its old name
        env.pop(name, None)
    runs = {}
    for way in ("overcast", "torch"):
        proc = subprocess.run(TORCHRUN + script + ["--way", way], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[way] = [line.split()[3] for line in proc.stdout.splitlines()
                     if line.startswith("step ")]
    assert len(runs["overcast"]) == 2
    assert runs["overcast"] == runs["torch"]


@root_only
def test_example_under_cluster_run():
    """`overcast cluster run` starts the aggregator itself: multicast + in-network by default."""
    proc = subprocess.run(CLI + ["cluster", "run", "--hosts", "2", "--link-mbit", "200", "--",
                                 *EXAMPLE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(proc.stdout)) == 2


@root_only
def test_overcast_train_compares_four_ways(tmp_path):
    # 50 Mbit/s: an AllGather outlasts the compute between it and the next ReduceScatter even
    # when the suite's load stretches that compute (at 200 Mbit/s it led by 1-5 ms, and one CI
    # run under load saw neither pair overlap)
    untraced_because = mount_tracefs()  # what the command will find: None where it can trace
    proc = subprocess.run(CLI + ["train", "--hosts", "3", "--link-mbit", "50", "--steps", "3",
                                 "--warmup", "1", "--blocks", "3", "--dim", "64", "--out",
                                 str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert widest(proc.stdout + proc.stderr) <= 120, proc.stdout  # a terminal's width
    doc = json.loads((tmp_path / "train.json").read_text())
    [run] = doc["shapes"]
    ways = {r["way"]: r for r in run["results"]}
    assert list(ways) == ["gloo", "gloo-separate", "overcast-ring", "overcast"]
    assert "aggregator switch-like (its link unshaped)" in " ".join(proc.stdout.split())
    assert ways["overcast"]["algorithms"] == {"allgather": "multicast",
                                              "unpaired_allgather": "ring",
                                              "reduce_scatter": "innetwork"}
    for r in ways.values():
        assert r["max_loss_difference"] < 1e-4, r["way"]
        assert r["collectives_per_step"] == {"allgathers": 6.0, "reduce_scatters": 4.0}, r
        # the training thread's step, taken apart: its blocked time outside the hooks can't
        # exceed what is left of the step once its CPU is taken out
        assert 0 <= r["gil_wait_seconds"] <= r["compute_seconds"] <= r["step_seconds"], r
    assert doc["meta"]["cpu_waits_measured"]
    assert all(ways[w]["cpu_wait_seconds"] > 0 for w in ways)  # 3 hosts share 2 cores
    assert ("The 3 hosts share this machine's" in proc.stdout) == \
        (doc["meta"]["machine"]["cpus"] < 3)
    # What the training threads waited behind, from a trace of the scheduler (where tracefs
    # is): the trace's waits are the kernel's run delay of the same steps, and some are behind
    # the other hosts' training threads, which on a real cluster would have cores of their own
    assert doc["meta"]["cpu_waits_traced"] == (untraced_because is None), doc["meta"]
    if doc["meta"]["cpu_waits_traced"]:
        for r in ways.values():
            assert r["trace_overrun_events"] == 0
            assert r["traced_step_wait_seconds"] == pytest.approx(
                r["step_run_delay_seconds"], rel=0.1, abs=0.005), r
            assert r["cpu_wait_behind_seconds"][TRAINING] > 0, r
            assert 0 < r["own_host_compute_seconds"] <= r["compute_seconds"], r
        assert not [n for n in os.listdir(INSTANCES) if n.startswith("overcast-")]
    # the engine's Python holds the GIL: none with gloo, some with overcast's engine
    assert ways["gloo"]["engine_python_cpu_seconds"] == 0
    assert ways["overcast"]["engine_python_cpu_seconds"] > 0
    check_prediction(run, hosts=3)
    # gloo's ReduceScatter is an allreduce; multicast sends each shard once, in-network
    # reduction receives one shard: bytes per host per step, from the NIC counters
    assert ways["gloo-separate"]["tx_bytes_per_host_per_step"] > \
        ways["overcast-ring"]["tx_bytes_per_host_per_step"] > \
        ways["overcast"]["tx_bytes_per_host_per_step"]
    for name in ("losses-given.png", "steps-given.png", "timeline-given-overcast.png",
                 "timeline-given-overcast.json"):
        assert (tmp_path / name).stat().st_size > 0
    # the gloo way ran under overcast.fsdp.timed(): its step profile, for overcast plan --timed
    profile = json.loads((tmp_path / "profile-given.json").read_text())
    assert profile["step_seconds"] == ways["gloo"]["step_seconds"]
    assert profile["compute_seconds"] == ways["gloo"]["compute_seconds"]
    # The backward overlaps a block's ReduceScatter with the AllGather of the block before.
    # Whether a given pair's spans meet depends on how long the compute between them took on
    # these shared cores (one CI run saw only blocks.1's on rank 0): on some rank, one must.
    trace = json.loads((tmp_path / "timeline-given-overcast.json").read_text())["traceEvents"]
    overlapped = []
    for rank in sorted({e["pid"] for e in trace if e["ph"] == "X"}):
        spans = [e for e in trace if e["ph"] == "X" and e["pid"] == rank]
        gathers = {e["name"].split()[1]: e for e in spans if e["name"].startswith("AG ")}
        scatters = {e["name"].split()[1]: e for e in spans if e["name"].startswith("RS ")}
        overlapped += [(rank, b) for b in ("blocks.1", "blocks.2")
                       if f"blocks.{int(b[-1]) - 1}" in gathers and b in scatters
                       and _overlap(scatters[b], gathers[f"blocks.{int(b[-1]) - 1}"]) > 0]
    assert overlapped, [e for e in trace if e["ph"] == "X"]


def _small_train(tmp_path, *flags) -> tuple[str, dict]:
    proc = subprocess.run(CLI + ["train", "--hosts", "3", "--link-mbit", "50", "--steps", "2",
                                 "--warmup", "1", "--blocks", "2", "--dim", "64", "--ways",
                                 "overcast", "--no-sched-trace", "--out", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "train.json").read_text())
    return " ".join(proc.stdout.split()), doc


@root_only
def test_overcast_train_names_a_shaped_aggregator(tmp_path):
    shown, doc = _small_train(tmp_path, "--aggregator-link-mbit", "50")
    assert "3 hosts, 50 Mbit/s per direction, aggregator behind a 50 Mbit/s link;" in shown
    assert doc["meta"]["aggregator_link_bits_per_s"] == 50_000_000


@root_only
def test_overcast_train_without_multicast_says_so_and_runs_its_rings(tmp_path):
    """--drop-multicast 1: overlap() runs its rings, the table saying why."""
    shown, doc = _small_train(tmp_path, "--drop-multicast", "1")
    said = ("multicast not delivered: rank 1 (198.18.0.2) heard no other rank's multicast; "
            "overlap() runs its AllGathers and ReduceScatters on overcast's rings")
    assert f"overcast: {said}" in shown
    [result] = doc["shapes"][0]["results"]
    assert result["warnings"] == [said]
    assert result["algorithms"] == {"allgather": "ring", "unpaired_allgather": "ring",
                                    "reduce_scatter": "ring"}
    assert doc["meta"]["multicast_dropped_to"] == [1]


@root_only
def test_overcast_train_shapes_with_accumulation_and_checkpointing(tmp_path):
    """Two shapes of the matrix, each with 4 micro-steps (only the last one reducing), every
    block recomputed in backward and two blocks prefetched: overcast trains exactly as gloo with
    a separate ReduceScatter group does, and each issues the collectives the cost model counts
    for it. Without the scheduler trace."""
    proc = subprocess.run(CLI + ["train", "--hosts", "3", "--link-mbit", "200", "--steps", "2",
                                 "--warmup", "1", "--shapes", "small,kept", "--dim", "64",
                                 "--micro-steps", "4", "--activation-checkpointing",
                                 "--prefetch", "2", "--no-sched-trace",
                                 "--ways", "gloo-separate,overcast", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 micro-steps, activation checkpointing" in " ".join(proc.stdout.split())  # wrapped
    assert "prefetch 2 blocks" in " ".join(proc.stdout.split())
    doc = json.loads((tmp_path / "train.json").read_text())
    assert doc["meta"]["prefetch"] == 2
    assert (doc["meta"]["cpu_waits_traced"], doc["meta"]["untraced_because"]) == \
        (False, "--no-sched-trace")
    assert doc["meta"]["cpu_waits_measured"]  # the run delays need no trace
    assert [run["shape"] for run in doc["shapes"]] == ["small", "kept"]
    small, kept = doc["shapes"]
    assert (small["model"]["dim"], small["model"]["blocks"], kept["model"]["dim"]) == (128, 2, 64)
    for run in doc["shapes"]:
        for r in run["results"]:
            assert r["max_loss_difference"] < 1e-4, r  # 3 ranks: sums in another order
        check_prediction(run, hosts=3)
    # small, per micro-step: the root and 2 blocks gathered for forward, block 0 again for
    # backward; the last micro-step pairs it with block 1's ReduceScatter, then block 0's and
    # the root's alone. kept: no block gathers in backward, so nothing pairs.
    assert small["prediction"]["collectives"] == {"allgather": 15, "reduce_scatter": 2,
                                                  "pair": 1}
    assert kept["prediction"]["collectives"] == {"allgather": 20, "reduce_scatter": 5,
                                                 "pair": 0}
    assert kept["prediction"]["speedup_over_rings"] == 1.0


def check_prediction(run: dict, hosts: int) -> None:
    """The cost model's collectives are the ones the step ran, and their bytes the ones the
    rings' NICs carried."""
    from overcast.train.config import GPTConfig
    from overcast.train.predict import step_collectives
    cfg = GPTConfig(**run["model"])
    p = run["prediction"]
    assert p["compute_from"] == "gloo-separate"
    for r in run["results"]:
        assert r["collectives_per_step"] == {
            "allgathers": p["collectives"]["allgather"] + p["collectives"]["pair"],
            "reduce_scatters": p["collectives"]["reduce_scatter"] + p["collectives"]["pair"]}, r
    ring = (hosts - 1) * sum(g + s for _, g, s in step_collectives(cfg, hosts))
    for r in run["results"]:
        if r["way"] == "overcast-ring":  # gloo's ReduceScatter is an allreduce: more
            # headers and the rendezvous besides the payload
            assert 1.0 < r["tx_bytes_per_host_per_step"] / ring < 1.05, r
    assert p["step_seconds"]["rings"] >= p["step_seconds"]["overcast"] > p["compute_seconds"]


def _overlap(a: dict, b: dict) -> float:
    return min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"])


def test_the_request_is_checked_without_torch():
    """What `overcast train` checks before anything is built loads no torch, so a bad flag is
    named at once."""
    code = ("import sys, overcast.train.config, overcast.cli.main; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr)


@root_only
@pytest.mark.parametrize("flags,words", [
    (["--ways", "gloo,nccl"], "unknown way nccl"), (["--hosts", "1"],
     "the number of hosts must be between 2 and 65279, not 1 (--hosts, hosts)"),
    (["--steps", "1", "--warmup", "1"], "must be more than --warmup"),
    (["--link-mbit", "0"], "the link rate must be above 0 Mbit/s, not 0 (--link-mbit"),
    (["--link-mbit", "-5"], "the link rate must be above 0 Mbit/s, not -5 (--link-mbit"),
    (["--blocks", "0"], "--blocks (0)"), (["--dim", "30"], "--dim must be a positive multiple"),
    (["--micro-steps", "0"], "--micro-steps (0)"), (["--vocab", "1"], "--vocab (1) 2 or more"),
    (["--seq", "0"], "--seq (0)"), (["--reshard", "4"], "--reshard takes all-but-last, all, "
                                    "none or block numbers from 0 to 3"),
    (["--reshard", "x"], "not 'x'"), (["--shapes", "small,huge"], "unknown shape huge"),
    (["--lr", "0"], "--lr must be above 0"),
    (["--prefetch", "0"], "--prefetch must be 1 or more blocks, not 0")])
def test_train_flags_checked_before_anything_is_built(flags, words, tmp_path):
    proc = subprocess.run(CLI + ["train", "--out", str(tmp_path / "out"), *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@root_only
def test_an_aggregator_lost_mid_training_is_told_under_the_table():
    """The aggregator killed as step 2 begins: overcast trains on, with gloo's losses, and the
    loss's warning, warned of on the engine's thread mid-run, reaches the table's caption."""
    from overcast.report.train import table
    from overcast.train.compare import run_training
    from overcast.train.config import GPTConfig
    run = run_training(3, 50_000_000, ["gloo", "overcast"], 4, 1,
                       [("small", GPTConfig(blocks=2, dim=64))], sched_trace=False,
                       kill_aggregator_at_step=2)
    [shape] = run["shapes"]
    ways = {r["way"]: r for r in shape["results"]}
    said = ways["overcast"]["warnings"]
    assert said and all(w.startswith("rank 0 ") and "aggregator" in w for w in said), said
    assert ways["overcast"]["max_loss_difference"] < 1e-5
    caption = table(run, shape).caption or ""
    assert all(f"overcast: {w}" in caption for w in said), caption
