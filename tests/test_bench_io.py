"""Smoke runs of benchmarks/bench_io.py with tiny sizes: it runs, and prints its table."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_io.py"
TINY = ["--size", "512KiB", "--sizes", "256KiB", "--rand-objects", "32", "--rand-ops", "64", "--no-fio-install"]


def run_bench(tmp_path, env=None, engines="psync,uring", extra=()):
    repeat = () if "--repeat" in extra else ("--repeat", "1")
    cmd = [sys.executable, str(SCRIPT), "--dir", str(tmp_path / "bench"), "--engines", engines, *extra, *TINY, *repeat]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def skip_without_uring() -> None:
    from conftest import uring_unavailable

    if uring_unavailable():
        pytest.skip(uring_unavailable())


def has_ratio(row) -> bool:
    return any(t.endswith("x") and t[:1].isdigit() for t in row)


def table_rows(out: str):
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("engine "))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():  # the table ends; every repeat's figures follow
            break
        rows.append(line.split())
    return rows


def test_bench_io_prints_every_engine_backend_and_size(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    out = run_bench(tmp_path, env)
    assert "# machine:" in out and "# filesystem:" in out and "# fio:" in out
    rows = table_rows(out)
    engines = {r[0] for r in rows}
    assert "psync" in engines
    assert {r[1] for r in rows} == {"bucket", "offset", "file_per_key"}
    per_combo = 4  # write, read and write into a full tier of 256 KiB objects, 4 KiB random reads
    assert len(rows) == per_combo * 3 * len(engines)
    assert not list((tmp_path / "bench").iterdir())  # the given --dir is left as it was: empty
    if "fio-" in out:  # with fio, the header says where its buffers live and every row carries a ratio
        assert "# fio buffers: on huge pages" in out or "# fio buffers: on 4 KiB pages" in out
        assert all(has_ratio(r) for r in rows)
        assert "# psync runs at most 4 4 KiB reads at a time here" in out and "Against fio's psync engine with 4 jobs" in out


def test_a_sync_variant_of_file_per_key_gets_its_own_large_object_rows(tmp_path):
    """``file_per_key/file`` is file_per_key syncing file by file: its writes and reads of
    large objects get rows of their own; its 4 KiB reads would be file_per_key's, so it has
    none (and keeps no second 4 KiB data set open)."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    out = run_bench(tmp_path, env, engines="psync", extra=("--backends", "file_per_key,file_per_key/file"))
    rows = table_rows(out)
    assert {r[1] for r in rows} == {"file_per_key", "file_per_key/file"}
    variant = [r for r in rows if r[1] == "file_per_key/file"]
    assert len(variant) == 3 and not [r for r in variant if "rand" in r]
    assert len([r for r in rows if r[1] == "file_per_key"]) == 4
    assert not list((tmp_path / "bench").iterdir())  # the given --dir is left as it was: empty


def test_fio_on_its_default_buffers_gives_ratios_but_no_verdicts(tmp_path):
    """fio on 4 KiB pages is slower than the device here: a target checked against it
    would flatter gdskv."""
    skip_without_uring()
    if not shutil.which("fio"):
        pytest.skip("fio is not installed")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    out = run_bench(tmp_path, env, engines="uring", extra=("--backends", "bucket", "--fio-mem", "malloc"))
    assert "# fio buffers: on 4 KiB pages (--mem=malloc; as asked)" in out and "no verdicts" in out
    rows = table_rows(out)
    assert all(has_ratio(r) for r in rows)
    assert not any("met" in r or "MISSED" in r for r in rows)
    assert any(" ".join(r).endswith("n/a: fio on 4 KiB pages") for r in rows)  # the 4 KiB row has a target
    assert "# every run's figure" in out


def test_each_gdskv_run_is_paired_with_a_fio_run_taken_right_before_it(tmp_path):
    """fio runs once per engine x backend and repeat, and every gdskv figure carries its
    ratio to that fio run (the disk's speed drifts between runs a minute apart)."""
    skip_without_uring()
    if not shutil.which("fio"):
        pytest.skip("fio is not installed")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    out = run_bench(tmp_path, env, engines="uring", extra=("--backends", "bucket,offset", "--fio-mem", "malloc", "--repeat", "2"))
    listing = {line.split(":")[0].strip("# ").rsplit(" ", 2)[0].strip(): line.split(":", 1)[1].split(",")
               for line in out.splitlines() if line.startswith("#   ")}
    assert len(listing["fio write"]) == 4 and len(listing["fio rand"]) == 4  # 2 backends x 2 repeats
    for key in ("uring bucket write", "uring offset read", "uring bucket write full", "uring offset rand"):
        runs = listing[key]
        assert len(runs) == 2 and all(run.strip().endswith("x)") for run in runs), (key, runs)
    # fio against itself, the noise in those ratios: 4 runs of each operation, 3 pairs
    assert "fio against itself" in out
    for op in ("write", "write full", "read", "rand"):
        assert listing[f"fio/fio {op}"][-1].strip().endswith("3 pairs)"), (op, listing[f"fio/fio {op}"])


def test_more_read_pairs_read_each_store_again_after_a_fio_read_of_their_own(tmp_path):
    """``--read-pairs 3``: each store written is read three times, each read right after a
    fio read, and each read's ratio is to that fio read; writes keep one pair each."""
    skip_without_uring()
    if not shutil.which("fio"):
        pytest.skip("fio is not installed")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    out = run_bench(tmp_path, env, engines="uring", extra=("--backends", "bucket", "--fio-mem", "malloc", "--repeat", "2", "--read-pairs", "3"))
    listing = {line.split(":")[0].strip("# ").rsplit(" ", 2)[0].strip(): line.split(":", 1)[1].split(",")
               for line in out.splitlines() if line.startswith("#   ")}
    assert len(listing["fio read"]) == 6 and len(listing["fio write"]) == 2
    assert len(listing["fio read checked"]) == 6  # fio reading and checking its own file, before each plain read
    checked = next(line for line in out.splitlines() if line.startswith("#   uring: "))
    assert checked.startswith("#   uring: bucket ") and checked.endswith("x  (256.0 KiB)"), checked
    assert len(listing["uring bucket read"]) == 6 and all(run.strip().endswith("x)") for run in listing["uring bucket read"])
    assert len(listing["uring bucket write"]) == 2
    assert "(large reads: of 6, 3 pairs per store written)" in out


def test_fio_against_itself_is_each_run_over_the_one_before():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_io import fio_self_ratios
    finally:
        sys.path.remove(str(SCRIPT.parent))
    samples = {("fio", "write", 2 << 20): [100.0, 80.0, 120.0], ("fio", "read", 2 << 20): [50.0],
               ("uring", "bucket", "write", 2 << 20): [90.0, 95.0]}
    assert fio_self_ratios(samples) == {("write", 2 << 20): [0.8, 1.5]}


def test_fio_checked_reads_fail_on_blocks_fio_did_not_write_with_its_checksums(tmp_path):
    """The checked peer really checks: fio's checked read of its own checked file passes,
    and of a file written without fio's checksums (the plain peer's) fails."""
    fio = shutil.which("fio")
    if not fio:
        pytest.skip("fio is not installed")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_io import fio_run
    finally:
        sys.path.remove(str(SCRIPT.parent))
    job = dict(bs=256 << 10, qd=4, size=4 << 20, direct=False)
    fio_run(fio, tmp_path, rw="write", checked=True, **job)
    assert fio_run(fio, tmp_path, rw="randread", checked=True, **job) > 0
    fio_run(fio, tmp_path, rw="write", **job)
    os.replace(tmp_path / "fio.dat", tmp_path / "fio-checked.dat")
    with pytest.raises(RuntimeError, match="fio failed: .*verify"):
        fio_run(fio, tmp_path, rw="randread", checked=True, **job)


def test_without_fio_it_says_so_and_prints_absolute_numbers(tmp_path):
    empty = tmp_path / "no-tools"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty), "PYTHONPATH": str(SCRIPT.parent.parent)}
    out = run_bench(tmp_path, env, engines="psync")
    assert "fio: not available" in out
    rows = table_rows(out)
    assert rows and all("-" in r for r in rows)  # no fio figure, no ratio
    assert all(("MiB/s" in r) or ("IOPS" in r) for r in rows)


if not SCRIPT.exists():  # pragma: no cover
    pytest.skip("benchmarks/bench_io.py missing", allow_module_level=True)


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_io_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fio_memory_without_the_right_to_lock_huge_pages(monkeypatch):
    """A user who may not lock huge-page shared memory: auto falls back and says why; huge
    refuses before the run (fio would fail mid-run)."""
    import resource

    bench = _bench_module()
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    monkeypatch.setattr(os, "getegid", lambda: 65534)
    monkeypatch.setattr(os, "getgroups", lambda: [65534])
    monkeypatch.setattr(resource, "getrlimit", lambda _: (65536, 65536))
    auto = bench.FioMemory("auto", 32 << 20)
    assert auto.option == "malloc" and "not root" in auto.describe()
    with pytest.raises(SystemExit, match="may not lock huge pages"):
        bench.FioMemory("huge", 32 << 20)
    assert bench.FioMemory("malloc", 32 << 20).describe().startswith("on 4 KiB pages (--mem=malloc; as asked)")


def test_ratios_print_rounded_down_so_a_miss_never_reads_as_the_target():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_io import fmt_ratio
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert [fmt_ratio(r) for r in (0.4957, 0.5, 0.29, 0.899999, 1.249, None)] == ["0.49x", "0.50x", "0.29x", "0.89x", "1.24x", "-"]


def test_a_retired_store_gives_its_space_back_at_once_and_its_files_at_the_end(tmp_path):
    """A finished run's store is truncated and moved aside, not deleted (see RetiredStores):
    its bytes are freed, its inodes stay in use until the end of the run."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_io
    finally:
        sys.path.remove(str(SCRIPT.parent))
    store = tmp_path / "store"
    (store / "a" / "b").mkdir(parents=True)
    (store / "a" / "b" / "x.rec").write_bytes(b"x" * 8192)
    (store / "top.idx").write_bytes(b"y" * 100)
    (tmp_path / "retired-stores-left-by-a-killed-run" / "0").mkdir(parents=True)
    retired = bench_io.RetiredStores(tmp_path)
    retired.retire(store)
    assert not store.exists()
    kept = sorted(p for p in retired.dir.rglob("*") if p.is_file())
    assert [p.name for p in kept] == ["x.rec", "top.idx"]
    assert all(p.stat().st_size == 0 for p in kept)
    store.mkdir()  # the next run's store takes the same path
    (store / "z").write_bytes(b"z")
    retired.retire(store)
    assert len(list(retired.dir.iterdir())) == 2
    retired.clear()
    assert not retired.dir.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["retired-stores-left-by-a-killed-run"]
