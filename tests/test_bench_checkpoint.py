"""A smoke run of benchmarks/bench_checkpoint.py with a tiny store: it runs, measures all
three runs, and its deltas write fewer checkpoint bytes than bases at every checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_checkpoint.py"


def test_bench_checkpoint_prints_offset_bases_only_and_bucket(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--dir", str(tmp_path / "bench"), "--engine", "psync",
           "--sizes", "64MiB", "--object", "4KiB", "--write", "16MiB", "--batch", "1MiB"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip().startswith("64.0 MiB")]
    runs = {" ".join(row[3:5]) if row[3] == "bases" else row[3]: row for row in rows}
    assert set(runs) == {"offset", "bases only", "bucket"}
    assert runs["bases only"][-1].endswith("x") and runs["bucket"][-1].endswith("x")
    # checkpoint MiB: a delta lists what changed, a base everything
    assert float(runs["offset"][7]) < float(runs["bases only"][8])
    # bases / checkpoints of the write: every one with bases only, fewer with deltas
    bases, taken = map(int, runs["bases only"][9].split("/"))
    assert taken > 1 and bases == taken
    bases, taken = map(int, runs["offset"][8].split("/"))
    assert taken > 1 and bases < taken
