"""PyTorch's own distributed tests (distributed_test.py from the installed wheel) on the
"overcast" backend, through tools/torch_suite.py: a subset of collectives, point-to-point, DDP
and subgroups that takes about a minute (all_reduce's other ops are left to tests/test_backend.py,
which checks each against gloo's). The whole suite's counts are in docs/results.md."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSING = 13  # of the 14 tests the subset selects; one needs 3 ranks or more
SUBSET = ",".join([
    "test_all_reduce_sum_async", "test_all_gather_coalesced_simple", "test_all_gather_complex",
    "test_reduce_full_group_min",  # the one test of the rooted reduce
    "test_broadcast_full_group", "test_gather_full_group", "test_scatter_full_group",
    "test_barrier_full_group", "test_DistributedDataParallelCPU", "test_get_backend",
    "test_get_future", "test_irecv", "test_batch_isend_irecv_gloo_tags",
])


def test_pytorch_distributed_tests_pass_on_the_backend(tmp_path):
    out = tmp_path / "suite.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "torch_suite.py"), "--world",
                    "2", "-k", SUBSET, "--json", str(out)], cwd=ROOT, timeout=1200,
                   capture_output=True, text=True)
    (counts,) = json.loads(out.read_text())
    assert counts["failed"] == 0, counts["failures"]
    assert counts["passed"] >= PASSING, counts
