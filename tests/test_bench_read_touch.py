"""Smoke runs of benchmarks/bench_read_touch.py with tiny sizes: it runs every kind of read
each round, prints a row per round and a summary per kind, and leaves its directory as it
found it. Nothing here checks a speed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bench_scripts import BENCHMARKS, run_fio_benchmark
from conftest import uring_unavailable


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return run_fio_benchmark("bench_read_touch.py", tmp_path, *args)


def test_bench_read_touch_runs_every_kind_each_round(tmp_path):
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    done = run(tmp_path, "--size", "8MiB", "--block", "256KiB", "--qd", "2", "--rounds", "2", "--seconds", "0.2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    flushed = "# flushing the CPU's caches: clflushopt" in done.stdout
    kinds = ["untouched", "read by CPU"] + (["read, flushed", "flushed only"] if flushed else []) + ["staged"]
    kinds += ["fio", "fio checked"] if shutil.which("fio") else []
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["round"])
    rows = lines[head + 1 : head + 3]
    assert [row.split()[0] for row in rows] == ["0", "1"]
    assert all(row.count("MiB/s") == len(kinds) for row in rows), rows
    summary = [line for line in lines if line.startswith("#   ")]
    assert [line[4:18].strip() for line in summary] == kinds
    assert list(tmp_path.iterdir()) == []


def test_bench_read_touch_rejects_a_block_that_is_not_whole_pages(tmp_path):
    done = run(tmp_path, "--block", "1000")
    assert done.returncode != 0 and "--block must be a multiple of 4 KiB" in done.stderr


def test_cache_flush_keeps_the_bytes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import numpy as np
    from cache_flush import load_flusher

    flush, how = load_flusher()
    if flush is None:
        pytest.skip(f"no cache flush here: {how}")
    data = np.arange(1 << 20, dtype=np.uint8)[3:]  # starts mid-line, ends mid-line
    before = data.copy()
    flush(data)
    assert np.array_equal(data, before)


def test_cache_flush_without_a_compiler_says_so(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cache_flush

    monkeypatch.setattr(cache_flush.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cache_flush, "_cpu_flags", lambda: {"clflushopt"})
    monkeypatch.setattr(cache_flush.shutil, "which", lambda name: None)
    assert cache_flush.load_flusher() == (None, "no C compiler (cc) to build the clflushopt helper")
