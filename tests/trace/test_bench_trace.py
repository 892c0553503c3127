"""Smoke run of benchmarks/bench_trace.py with a tiny synthetic trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_trace.py"


def test_bench_trace_runs_and_prints_ratios():
    args = [sys.executable, str(SCRIPT), "--synthetic", "150", "--repeat", "1", "--kv-bytes-per-token", "8KiB",
            "--dram", "1MiB", "--ssd", "256MiB", "--sweep-dram", "1MiB..2MiB", "--sweep-ssd", "0,256MiB"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "peer: dict lookup per access" in text and "x peer (CPU)" in text
    assert "replay: DRAM+SSD eager (default)" in text and "target >= 1M block accesses/s" in text
    assert "sweep: 4 points (2 DRAM x 2 SSD sizes)" in text


def test_bench_trace_without_a_trace_says_what_to_do(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--trace", str(tmp_path / "none.jsonl")], capture_output=True, text=True)
    assert out.returncode == 2 and "--synthetic N" in out.stderr
