"""Every flag of every command is checked before anything is built: one line saying what is
wrong and what is allowed, exit 2, no traceback, no namespace left; and the Python API
(run_bench, Cluster, Communicator, LossSpec, the aggregator) raises InvalidArgumentError with the
same words."""

import os
import subprocess
import sys

import pytest

from overcast.aggregator.service import AggregatorService
from overcast.bench.run import Aggregators, run_bench
from overcast.cli.main import parser
from overcast.cluster.netns import Cluster, list_namespaces
from overcast.comm import Communicator
from overcast.errors import InvalidArgumentError
from overcast.limits import aggregators_from_env
from overcast.transport.loss import LossSpec

CLI = [sys.executable, "-m", "overcast.cli.main"]


def bench(**kw):
    args = dict(hosts=2, link_bits=10**8, sizes=[1024], collectives=["allgather"],
                algorithms=["ring"])
    args.update(kw)
    run_bench(**args)


def communicator(**kw):
    args = dict(rank=0, world_size=2, store=object())
    args.update(kw)
    Communicator(**args)


HOSTS = "the number of hosts must be between 2 and 65279, not {} (--hosts, hosts)"
RATE = "the link rate must be above 0 Mbit/s, not {} (--link-mbit, link_bits_per_s / 1e6)"
MTU = "the MTU must be between 104 (the smallest that carries a chunk) and 65535, not {} " \
      "(--mtu, mtu)"
LOSS = "the loss rate must be a fraction from 0 up to (not including) 1, not {} (--loss, loss)"
BURST = "the mean loss burst must be 1 or more datagrams, not {} (--loss-burst, loss_burst)"
ROOTS = "the multicast roots must be 'all' or between 1 and the number of ranks ({}), not {} " \
        "(--roots, roots)"
SLOTS = "the aggregator's slots must be between 1 and 65535, not {} (--slots, slots)"
AGGREGATORS = "the number of aggregators must be between 1 and 200, not {} (--aggregators, " \
    "aggregators)"
SHARDS = "the shards per aggregator must be 1 to {} (a job stripes over at most 256 " \
    "endpoints), not {} (--shards, shards)"
FRAME = "the ring frame size must be between 8 and 67108864 (the largest payload a frame " \
    "carries), not {} (frame_bytes)"
PORT = "the port must be between 0 (any free port) and 65535, not {} (--port, port)"

# (command line, the same through the API, the line both say)
CASES = {
    "bench --hosts 1": (["bench", "--hosts", "1"], lambda: bench(hosts=1), HOSTS.format(1)),
    "bench --hosts 70000": (["bench", "--hosts", "70000"], lambda: bench(hosts=70000),
                            HOSTS.format(70000)),
    "bench --link-mbit 0": (["bench", "--link-mbit", "0"], lambda: bench(link_bits=0),
                            RATE.format(0)),
    "bench --link-mbit -5": (["bench", "--link-mbit", "-5"], lambda: bench(link_bits=-5e6),
                             RATE.format(-5)),
    "bench --link-mbit inf": (["bench", "--link-mbit", "inf"],
                              lambda: bench(link_bits=float("inf")), RATE.format("inf")),
    "bench --link-mbit 100,0": (["bench", "--link-mbit", "100,0"],
                                lambda: bench(link_bits=[10**8, 0]), RATE.format(0)),
    "bench --link-mbit ,": (["bench", "--link-mbit", ","], lambda: bench(link_bits=[]),
                            "the link rates must be at least one, not none "
                            "(--link-mbit, link_bits)"),
    "bench --link-mbit 100,100": (["bench", "--link-mbit", "100,100"],
                                  lambda: bench(link_bits=[10**8, 10**8]),
                                  "the link rates must be all different, not 100,100 "
                                  "(--link-mbit, link_bits)"),
    "bench --within 0.5": (["bench", "--link-mbit", "100,200", "--within", "0.5"],
                           lambda: bench(link_bits=[10**8, 2 * 10**8], within=0.5),
                           "the sweep's bar must be 1 or more times the floor, not 0.5 "
                           "(--within, within)"),
    "bench --sizes 0": (["bench", "--sizes", "64KiB,0"], lambda: bench(sizes=[65536, 0]),
                        "a size must be 1 byte or more, not 0 (--sizes, sizes)"),
    "bench --reps 0": (["bench", "--reps", "0"], lambda: bench(reps=0),
                       "timed runs must be 1 or more, not 0 (--reps, reps)"),
    "bench --warmup -1": (["bench", "--warmup", "-1"], lambda: bench(warmup=-1),
                          "warm-up runs must be 0 or more, not -1 (--warmup, warmup)"),
    "bench --loss 1.5": (["bench", "--loss", "1.5"], lambda: bench(loss=1.5),
                         LOSS.format(1.5)),
    "bench --loss 1": (["bench", "--loss", "1"], lambda: LossSpec(1.0), LOSS.format(1)),
    "bench --loss -0.1": (["bench", "--loss", "-0.1"], lambda: LossSpec(-0.1),
                          LOSS.format(-0.1)),
    "bench --loss-burst 0.5": (["bench", "--loss-burst", "0.5"], lambda: LossSpec(0.1, 0.5),
                               BURST.format(0.5)),
    "bench --mtu 50": (["bench", "--mtu", "50"], lambda: bench(mtu=50), MTU.format(50)),
    "bench --mtu 70000": (["bench", "--mtu", "70000"], lambda: bench(mtu=70000),
                          MTU.format(70000)),
    "bench --roots 9": (["bench", "--hosts", "8", "--roots", "2,9"],
                        lambda: bench(hosts=8, roots=[2, 9]), ROOTS.format(8, 9)),
    "bench --roots 0": (["bench", "--hosts", "8", "--roots", "0"],
                        lambda: communicator(roots=0, world_size=8), ROOTS.format(8, 0)),
    "bench --slots 0": (["bench", "--slots", "0"], lambda: bench(aggregator_slots=0),
                        SLOTS.format(0)),
    "bench --slots 70000": (["bench", "--slots", "70000"], lambda: bench(aggregator_slots=70000),
                            SLOTS.format(70000)),
    "bench --aggregators 0": (["bench", "--aggregators", "0"],
                              lambda: bench(aggregators=Aggregators(0)), AGGREGATORS.format(0)),
    "bench --shards 200": (["bench", "--aggregators", "2", "--shards", "200"],
                           lambda: bench(aggregators=Aggregators(2, 200)), SHARDS.format(128, 200)),
    "bench --aggregator-link-mbit 0": (["bench", "--aggregator-link-mbit", "0"],
                                       lambda: bench(aggregators=Aggregators(link_bits=0)),
                                       "the link rate must be above 0 Mbit/s, not 0 "
                                       "(--aggregator-link-mbit, link_bits / 1e6)"),
    "cluster --aggregators 201": (["cluster", "run", "--aggregators", "201", "--", "true"],
                                  lambda: Cluster(2, 10**8, aggregators=201),
                                  AGGREGATORS.format(201)),
    "cluster --hosts 0": (["cluster", "run", "--hosts", "0", "--", "true"],
                          lambda: Cluster(0, 10**8),
                          "the number of hosts must be between 1 and 65279, not 0 "
                          "(--hosts, hosts)"),
    "cluster --link-mbit 0": (["cluster", "run", "--link-mbit", "0", "--", "true"],
                              lambda: Cluster(2, 0), RATE.format(0)),
    "cluster --mtu 50": (["cluster", "up", "--mtu", "50"], lambda: Cluster(2, 10**8, mtu=50),
                         MTU.format(50)),
    "aggregator --port 70000": (["aggregator", "--port", "70000"],
                                lambda: AggregatorService("127.0.0.1", 70000, [b"s"]),
                                PORT.format(70000)),
    "aggregator --port -1": (["aggregator", "--port", "-1"],
                             lambda: AggregatorService("127.0.0.1", -1, [b"s"]),
                             PORT.format(-1)),
    "aggregator --shards 0": (["aggregator", "--shards", "0"],
                              lambda: AggregatorService("127.0.0.1", 0, [b"s"], shards=0),
                              SHARDS.format(256, 0)),
    "aggregator --slots 0": (["aggregator", "--slots", "0"],
                             lambda: AggregatorService("127.0.0.1", 0, [b"s"], slots=0),
                             SLOTS.format(0)),
}

# what `overcast switch`, the aggregator's old name, says before it runs `overcast aggregator`
SWITCH_NOTE = "overcast: `overcast switch` is the old name of `overcast aggregator`; running that\n"


@pytest.mark.parametrize("case", list(CASES))
def test_a_flag_out_of_range_is_one_line_on_the_command_line_and_in_the_api(case):
    argv, api, line = CASES[case]
    before = set(list_namespaces()) if os.geteuid() == 0 else set()
    env = dict(os.environ, OVERCAST_SECRET="00" * 32)
    out = subprocess.run(CLI + argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"overcast: {line}\n"
    if os.geteuid() == 0:
        assert set(list_namespaces()) == before
    with pytest.raises(InvalidArgumentError) as err:
        api()
    assert str(err.value) == line


@pytest.mark.parametrize("kwargs,line", [
    (dict(rank=2), "the rank must be between 0 and world_size - 1 (1), not 2 (RANK, rank)"),
    (dict(world_size=0), "world_size must be 1 or more, not 0 (WORLD_SIZE, world_size)"),
    (dict(timeout=0.0), "the timeout must be above 0 seconds, not 0 (timeout)"),
    (dict(frame_bytes=4), FRAME.format(4)),
    (dict(frame_bytes=(1 << 26) + 1), FRAME.format((1 << 26) + 1)),
    (dict(link_bits_per_s=-1e6), RATE.format(-1)),
    (dict(pacing_share=1.5), "the pacing share must be a fraction above 0, at most 1, not 1.5 "
                             "(pacing_share)"),
    (dict(early_stream_bytes=-1), "the bytes held for collectives not issued must be 0 or more, "
                                  "not -1 (OVERCAST_EARLY_STREAM_BYTES, early_stream_bytes)"),
    (dict(failover_seconds=0.01), "the aggregator's switch-over bound must be at least 0.25 "
                                  "seconds (a healthy aggregator answers within 50 ms), not 0.01 "
                                  "(OVERCAST_FAILOVER_SECONDS, failover_seconds)")])
def test_communicator_settings_are_checked_before_rendezvous(kwargs, line):
    """The store given is not one: were rendezvous reached, it would fail otherwise."""
    with pytest.raises(InvalidArgumentError) as err:
        communicator(**kwargs)
    assert str(err.value) == line


# What a newcomer typed, and the one line that answers it: the flag as typed (an older name
# included), the unit typed, paths checked before any work (these exit 2 with nothing built).
TYPED = {
    "simulate --nodes 0": (["simulate", "--nodes", "0"], "the number of hosts must be between 2 "
                                                         "and 65279, not 0 (--nodes, hosts)"),
    "plan --nodes 1": (["plan", "--nodes", "1"],
                       "the number of hosts must be between 2 and 65279, not 1 (--nodes, hosts)"),
    "simulate --link-gbit 0": (["simulate", "--link-gbit", "0"],
                               "the link rate must be above 0 Gbit/s, not 0 (--link-gbit, "
                               "link_bits_per_s / 1e9)"),
    "train --link-gbit 0.1,0.2": (["train", "--link-gbit", "0.1,0.2"],
                                  "--link-gbit takes one link rate here, not '0.1,0.2'"),
    "simulate --json in a missing folder": (
        ["simulate", "--json", "/missing/dir/x.json"],
        "--json /missing/dir/x.json: the folder /missing/dir does not exist"),
    "simulate --compare a missing file": (["simulate", "--compare", "/missing.json"],
                                          "--compare /missing.json: no such file or directory"),
    "plan --plot in a missing folder": (["plan", "--plot", "/missing/p.png"],
                                        "--plot /missing/p.png: the folder /missing does not "
                                        "exist"),
    "soak --size two sizes": (["soak", "--size", "1KiB,2KiB"],
                              "--size takes one size, not '1KiB,2KiB'"),
    "soak --kill-aggregator-every -1": (["soak", "--kill-aggregator-every", "-1"],
                                        "pairs between aggregator kills must be 0 or more, not "
                                        "-1 (--kill-aggregator-every, kill_every)"),
    "cluster run without a command": (["cluster", "run"],
                                      "cluster run: give the command to run on every host "
                                      "after --, as in overcast cluster run --hosts 4 -- "
                                      "python train.py"),
}


@pytest.mark.parametrize("case", list(TYPED))
def test_a_bad_value_is_named_as_typed_before_any_work(case):
    argv, line = TYPED[case]
    out = subprocess.run(CLI + argv, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"overcast: {line}\n")


@pytest.mark.parametrize("command", [["bench"], ["train"], ["soak"], ["simulate"], ["plan"],
                                     ["cluster", "up"], ["cluster", "run"], ["aggregator"]])
def test_every_help_shows_the_defaults(command):
    out = subprocess.run(CLI + command + ["--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    text = " ".join(out.split())
    assert "(default: " in text and ("--hosts" in text or command == ["aggregator"])
    assert "--link-mbit" in text or command == ["aggregator"]


def test_the_old_name_of_the_aggregator_says_so_and_takes_the_same_flags():
    def help_of(name: str) -> list[str]:
        return subprocess.run(CLI + [name, "--help"], capture_output=True, text=True,
                              timeout=60, check=True).stdout.split("\n\n")
    usage, about, *flags = help_of("switch")
    new_usage, _, *new_flags = help_of("aggregator")
    assert " ".join(about.split()) == ("the old name of `overcast aggregator`, kept as an "
                                       "alias: the same flags, the same service (set "
                                       "OVERCAST_SECRET, or OVERCAST_SECRETS, as for it)")
    assert usage.split(maxsplit=3)[3] .split() == new_usage.split(maxsplit=3)[3].split()
    assert flags == new_flags


def test_the_old_name_of_the_aggregator_runs_it_after_a_note():
    """`overcast switch` checks its flags as `overcast aggregator` does, after saying which it
    runs; `cluster run --no-switch` is `--no-aggregators` under its old name."""
    out = subprocess.run(CLI + ["switch", "--port", "70000"], capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == SWITCH_NOTE + f"overcast: {PORT.format(70000)}\n"
    runs = [parser().parse_args(["cluster", "run", *flag]).aggregators_run
            for flag in ([], ["--no-aggregators"], ["--no-switch"])]
    assert runs == [True, False, False]


@pytest.mark.filterwarnings("ignore:OVERCAST_SWITCH")  # what it says: the next test's
def test_the_aggregators_are_read_under_either_name_the_new_one_winning(monkeypatch):
    for new, old, read in ((None, None, None), ("10.0.0.1", None, "10.0.0.1"),
                           (None, "10.0.0.2:9", "10.0.0.2:9"),
                           ("10.0.0.1", "10.0.0.1", "10.0.0.1"),
                           ("10.0.0.1,10.0.0.2", "10.0.0.1", "10.0.0.1,10.0.0.2")):
        for name, value in (("OVERCAST_AGGREGATORS", new), ("OVERCAST_SWITCH", old)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert aggregators_from_env() == read


def test_the_old_name_of_the_aggregators_variable_says_so_once(monkeypatch):
    import overcast.limits

    overcast.limits._say_once.cache_clear()
    monkeypatch.delenv("OVERCAST_AGGREGATORS", raising=False)
    monkeypatch.setenv("OVERCAST_SWITCH", "10.0.0.2:9")
    with pytest.warns(FutureWarning, match="OVERCAST_SWITCH is the old name of "
                                           "OVERCAST_AGGREGATORS") as said:
        assert aggregators_from_env() == aggregators_from_env() == "10.0.0.2:9"
    monkeypatch.setenv("OVERCAST_AGGREGATORS", "10.0.0.1")
    with pytest.warns(FutureWarning) as ignored:
        assert aggregators_from_env() == aggregators_from_env() == "10.0.0.1"
    assert len(said) == len(ignored) == 1
    assert str(ignored[0].message) == ("OVERCAST_SWITCH='10.0.0.2:9' (the old name of "
                                       "OVERCAST_AGGREGATORS) is ignored: "
                                       "OVERCAST_AGGREGATORS='10.0.0.1' is set")


def test_the_communicators_old_keyword_for_its_aggregators_says_so_and_never_contradicts():
    with pytest.warns(DeprecationWarning, match=r"\(switch=\) is the old name of aggregators="), \
            pytest.raises(InvalidArgumentError) as err:
        communicator(switch="10.0.0.1", aggregators="10.0.0.2")
    assert "named once, by aggregators= (switch= is its old name)" in str(err.value)


def test_the_top_level_help_lists_every_command():
    out = subprocess.run(CLI + ["--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert {"bench", "train", "soak", "simulate", "plan", "check", "cluster"} <= listed
    assert "5% of the rings'" in " ".join(out.split())  # a % in a help is taken as it stands


def test_version():
    out = subprocess.run(CLI + ["--version"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.startswith("overcast ")
