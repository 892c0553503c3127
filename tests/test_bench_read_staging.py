"""Smoke runs of benchmarks/bench_read_staging.py with tiny sizes: it runs, reads every
object back verified (a read that misses fails the run), prints a row per setting, and
leaves its directory as it found it. Nothing here checks a speed."""

from __future__ import annotations

import subprocess

import pytest

from bench_scripts import run_fio_benchmark
from conftest import uring_unavailable


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return run_fio_benchmark("bench_read_staging.py", tmp_path, *args)


def test_bench_read_staging_prints_a_row_per_setting(tmp_path):
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    done = run(tmp_path, "--size", "2MiB", "--object", "256KiB", "--qd", "4", "--rounds", "2",
               "--settings", "64KiB:512KiB,256KiB:1MiB", "--backend", "file_per_key")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("8 objects of 256.0 KiB in file_per_key, read 4 per batch" in line for line in lines)
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["chunk", "in"])
    rows = [line.split() for line in lines[start + 1 :] if line.strip()]
    assert [row[:4] for row in rows] == [["64.0", "KiB", "512.0", "KiB"], ["256.0", "KiB", "1.0", "MiB"]]
    assert all(row[5] == "MiB/s" for row in rows)
    assert list(tmp_path.iterdir()) == []


def test_bench_read_staging_rejects_a_setting_without_a_cap(tmp_path):
    done = run(tmp_path, "--settings", "1MiB")
    assert done.returncode != 0 and "is not CHUNK:CAP" in done.stderr
