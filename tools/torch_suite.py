"""PyTorch's own distributed tests (torch/testing/_internal/distributed/distributed_test.py, from
the installed wheel) run on the "overcast" backend, as PyTorch's test_distributed_spawn.py runs
them on gloo: each test spawns WORLD_SIZE processes that init_process_group("overcast").

    .venv/bin/python tools/torch_suite.py --world 2,4 [-k PATTERN] [--json FILE]

It tells distributed_test.py that overcast is a plugin backend with DDP and subgroups (its
backend_feature tables), runs the tests the suite keeps for gloo or MPI that overcast meets too
(OPENED: the test of a Work's future, whose value overcast's Work has; the batched send and
recv of CPU tensors; all_to_all of CPU tensors), and prints per world size how many tests ran,
passed, were skipped (by reason) and failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

# The suite reads these at import, in the runner and in every process it spawns.
os.environ.setdefault("BACKEND", "overcast")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="overcast-torch-suite-")

import torch.testing._internal.common_distributed as common  # noqa: E402

import overcast.distributed  # noqa: E402,F401  (registers the backend)

for feature in ("plugin", "ddp", "subgroup"):
    common.DistTestCases.backend_feature[feature].add("overcast")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)

class TestOvercastBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


# Tests the suite gates by the backend's name that overcast meets: their skip is lifted. The
# other tests behind "get_future is only supported on mpi, nccl and gloo" (the
# accumulate_gradients_no_sync ones) build their model only for those three names.
_GROUPS = ("", "_complex", "_group", "_full_group")
OPENED = {"test_get_future": "get_future is only supported on mpi, nccl and gloo",
          "test_batch_isend_irecv_gloo": "GLOO Batch Send Recv CPU",
          "test_batch_isend_irecv_gloo_tags": "GLOO Batch Send Recv CPU",
          **{f"test_all_to_all_single_{split}_split{group}":
             "Only MPI supports CPU all_to_all_single"
             for split in ("equal", "unequal") for group in _GROUPS},
          **{f"test_all_to_all{group}": "Only MPI supports all_to_all" for group in _GROUPS}}


def _open() -> None:
    for name, reason in OPENED.items():
        test = getattr(TestOvercastBackend, name, None)  # not every name is in every torch
        if getattr(test, "__unittest_skip_why__", None) == reason:
            test.__unittest_skip__ = False


_open()


class _Tally(unittest.TextTestResult):
    """Counts by outcome, skips by reason, and the failures' names with their last line."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed: list[str] = []
        self.skip_reasons: collections.Counter = collections.Counter()
        self.failed: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self._started = 0.0

    def startTest(self, test):
        self._started = time.perf_counter()
        super().startTest(test)

    def stopTest(self, test):
        self.seconds[test.id().split(".")[-1]] = round(time.perf_counter() - self._started, 2)
        super().stopTest(test)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.append(test.id().split(".")[-1])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.skip_reasons[reason.strip().splitlines()[0][:160]] += 1

    def _fail(self, test, err):
        lines = self._exc_info_to_string(err, test).strip().splitlines()
        self.failed[test.id().split(".")[-1]] = lines[-1][:300] if lines else "?"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._fail(test, err)

    def addError(self, test, err):
        super().addError(test, err)
        self._fail(test, err)


def run_one_world(pattern: str | None, verbosity: int) -> dict:
    """Run the suite at this process's WORLD_SIZE; return the counts."""
    loader = unittest.TestLoader()
    if pattern:
        loader.testNamePatterns = [f"*{p}*" for p in pattern.split(",")]
    suite = loader.loadTestsFromTestCase(TestOvercastBackend)
    runner = unittest.TextTestRunner(resultclass=_Tally, verbosity=verbosity, stream=sys.stderr)
    started = time.perf_counter()
    result = runner.run(suite)
    return {"world_size": int(os.environ["WORLD_SIZE"]), "run": result.testsRun,
            "passed": len(result.passed), "skipped": sum(result.skip_reasons.values()),
            "skipped_by_reason": dict(result.skip_reasons.most_common()),
            "failed": len(result.failed), "failures": result.failed,
            "seconds": round(time.perf_counter() - started, 1), "test_seconds": result.seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("-k", dest="pattern", help="only tests whose names contain one of "
                        "these comma-separated substrings")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--one-world", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("-v", action="count", default=1, dest="verbosity")
    args = parser.parse_args()
    if args.one_world:
        print(json.dumps(run_one_world(args.pattern, args.verbosity)))
        return 0
    results = []
    for world in args.world.split(","):
        env = dict(os.environ, WORLD_SIZE=world)
        env.pop("TEMP_DIR", None)
        cmd = [sys.executable, __file__, "--one-world"] + (["-k", args.pattern]
                                                          if args.pattern else [])
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        counts = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(counts)
        print(f"WORLD_SIZE={world}: {counts['run']} run, {counts['passed']} passed, "
              f"{counts['skipped']} skipped, {counts['failed']} failed "
              f"({counts['seconds']} s)")
        for reason, n in counts["skipped_by_reason"].items():
            print(f"  skipped {n:3d}: {reason}")
        for name, why in counts["failures"].items():
            print(f"  FAILED {name}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
