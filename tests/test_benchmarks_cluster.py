"""Smoke runs of the cluster benchmarks with tiny sizes: they start, finish, print a table."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script, *args):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bench_master_smoke():
    out = run("bench_master.py", "--keys", "2000", "--batch", "500", "--repeat", "1")
    assert "| register (UpdateReplicas) |" in out and "| lookup, counting hotness |" in out


def test_bench_cluster_smoke(tmp_path):
    out = run("bench_cluster.py", "--block", "64KiB", "--size", "1MiB", "--batch", "4", "--repeat", "1",
              "--dir", str(tmp_path))
    assert "gdskv get from a peer's DRAM" in out and "gdskv get from a peer's NVMe" in out
