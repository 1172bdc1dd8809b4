"""`overcast bench` end to end on a small cluster: the JSON contract, verified results, NIC
counters that match the traffic each algorithm must move, and the plot."""

import json
import subprocess
import sys

from conftest import root_only

pytestmark = root_only


def test_bench_contract(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "overcast.cli.main", "bench", "--hosts", "3",
                    "--link-mbit", "200", "--sizes", "64KiB,1000003",
                    "--collectives", "allgather,reduce_scatter", "--algorithms", "ring,gloo",
                    "--reps", "2", "--warmup", "0", "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["meta"]["hosts"] == 3 and doc["meta"]["link_bits_per_s"] == 200_000_000
    rows = {(r["collective"], r["algorithm"], r["bytes_per_rank"]): r for r in doc["results"]}
    assert set(rows) == {(c, a, n) for c in ("allgather", "reduce_scatter")
                         for a in ("ring", "gloo") for n in (65536, 1000000)}
    for (collective, algorithm, n), row in rows.items():
        for key in ("hosts", "link_bits_per_s", "seconds", "tx_bytes_per_host",
                    "rx_bytes_per_host", "correct"):
            assert key in row
        assert row["correct"] is True
        assert row["seconds"] > 0 and len(row["seconds_all"]) == 2
        if n == 1000000:
            # N(P-1) per direction, plus headers, plus the barriers around each run
            factor = 2 if (algorithm, collective) == ("gloo", "reduce_scatter") else 1
            assert 1.0 <= row["tx_over_payload"] / factor < 1.05, row
            assert 1.0 <= row["rx_over_payload"] / factor < 1.05, row
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
