"""PyTorch's own distributed tests (distributed_test.py from the installed wheel) on the
"overcast" backend, through tools/torch_suite.py: a subset of collectives, DDP and subgroups
that takes a few minutes. The whole suite's counts are in docs/results.md."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBSET = ",".join([
    "test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_product",
    "test_all_reduce_coalesced_sum", "test_all_gather", "test_all_gather_into_tensor_basic",
    "test_reduce_scatter_tensor", "test_broadcast", "test_barrier", "test_reduce_sum",
    "test_gather", "test_scatter", "test_all_to_all_single_equal_split",
    "test_new_subgroups_with_group_param", "test_DistributedDataParallel_SyncBatchNorm_2D",
    "test_ddp_comm_hook_logging", "test_get_backend", "test_destroy_group",
])


def test_pytorch_distributed_tests_pass_on_the_backend(tmp_path):
    out = tmp_path / "suite.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "torch_suite.py"), "--world",
                    "2", "-k", SUBSET, "--json", str(out)], cwd=ROOT, timeout=1200,
                   capture_output=True, text=True)
    (counts,) = json.loads(out.read_text())
    assert counts["failed"] == 0, counts["failures"]
    assert counts["passed"] >= 20, counts
