"""Smoke runs of the benchmarks with tiny sizes: they run, verify, and print their table.

Nothing here checks a speed: ratios on a busy test machine mean nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_bench_store_smoke(tmp_path):
    out = run_benchmark(
        "bench_store.py", "--size", "8MiB", "--block", "1MiB", "--repeats", "1", "--batch", "4",
        "--cache-drop", "fadvise", "--dir", str(tmp_path), "--seed", "5",
    )
    for text in ("engine", "python", "machine", "mounted at", "posix_fadvise", "8 blocks x 1.0 MiB"):
        assert text in out, text
    header = next(line for line in out.splitlines() if line.startswith("measurement"))
    for column in ("gdskv GB/s", "limit GB/s", "ratio", "target"):
        assert column in header
    rows = ("DRAM put ", "DRAM put, first touch", "DRAM hit get_into", "NVMe write", "NVMe cold read get_into",
            "NVMe cold read batch_get_into (4)")
    for row in rows:
        line = next((ln for ln in out.splitlines() if ln.startswith(row)), None)
        assert line is not None, row
        assert re.search(r"  \d+\.\d\d  .*  \d+\.\d\dx  ", line), line  # both figures and a ratio
    # 8 blocks read three times: get_into, batch_get_into, the verification pass
    assert "cold reads: 24 NVMe hits, 0 DRAM hits, 0 misses, 0 corrupt" in out
    assert "verified: every block read back byte-exact" in out
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_bench_store_rejects_bad_sizes(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_store.py"), "--size", "1MiB", "--block", "2MiB",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--size must hold at least one --block" in proc.stderr


def test_bench_node_smoke(tmp_path):
    out = run_benchmark("bench_node.py", "--size", "8MiB", "--block", "1MiB", "--repeat", "1", "--batch", "4",
                        "--dir", str(tmp_path / "node"), "--cluster", timeout=180)
    assert any(ln.startswith("embedded put ") for ln in out.splitlines())
    for row in ("attached put", "attached batch_put", "cluster put", "cluster batch_put",
                "attached get_into", "attached batch_get_into"):
        line = next((ln for ln in out.splitlines() if ln.startswith(row + " ")), None)
        assert line is not None, row
        assert re.search(r"\d+\.\d\dx  >= 0\.\dx (met|missed)", line), line
