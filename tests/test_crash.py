"""Crash tests: a real process writes a store and is killed with SIGKILL mid-write.

After each kill the directory is reopened and checked against what the child reported
before it died (see tests/crash_child.py): every flushed block is served byte-exact, every
removed block stays gone, a block that was being written is either absent or byte-exact
(never torn), and recovery counts exactly the torn files that were on disk.
"""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Set

import pytest

import gdskv
from crash_child import value_of
from ondisk import torn_files

CHILD = Path(__file__).with_name("crash_child.py")
MiB = 1 << 20


@dataclasses.dataclass
class Record:
    """What the child reported before it died."""

    flushed: int = 0  # keys below this are durable (unless removed)
    last: int = 0  # no key at or above this was ever put
    removed: Set[int] = dataclasses.field(default_factory=set)
    removing: Set[int] = dataclasses.field(default_factory=set)
    tearing: Optional[str] = None
    done: bool = False

    def feed(self, line: str) -> None:
        word, *rest = line.split()
        if word == "round":
            self.last = int(rest[4])
        elif word == "flushed":
            self.flushed = int(rest[0])
        elif word == "removing":
            self.removing.add(int(rest[0]))
        elif word == "removed":
            self.removed.add(int(rest[0]))
        elif word == "tearing":
            self.tearing = rest[0]
        elif word == "done":
            self.done = True


def run_child(options: dict, kill_after: Callable[[Record, str], bool]) -> Record:
    """Start the child, feed its lines to a Record, SIGKILL it when ``kill_after(record,
    line)`` says so, and return the Record of everything it printed. A paced child is told
    to start a round after its ``ready`` and after each ``flushed`` line."""
    record = Record()
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(options)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        killed = False
        for line in proc.stdout:
            record.feed(line)
            if options.get("paced") and line.split()[0] in ("ready", "flushed"):
                proc.stdin.write("go\n")
                proc.stdin.flush()
            if kill_after(record, line):
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
        for line in proc.stdout:  # what it printed before the signal landed
            record.feed(line)
        proc.wait(timeout=30)
        stderr = proc.stderr.read() if proc.stderr else ""
        if killed:
            assert proc.returncode == -signal.SIGKILL, stderr
        else:
            assert proc.returncode == 0, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return record


@dataclasses.dataclass
class Generation:
    """One child's run: its keys are ``f"{prefix}{n}"``, its values ``value_of(seed, n)``."""

    prefix: str
    seed: int
    record: Record
    present: Optional[Set[int]] = None  # what the reopen after its crash found

    def key(self, n: int) -> str:
        return f"{self.prefix}{n}"


def verify_reopen(path: Path, generations: List[Generation], *, flushed_durable: bool = True) -> None:
    """Reopen after the crash of the last generation's child and check every key any child
    may have put; fills in the last generation's ``present``. Earlier generations must be
    found exactly as their own reopen found them."""
    torn = torn_files(path)
    last = generations[-1]
    with gdskv.open(path, dram="16MiB", ssd="256MiB") as store:
        report = store.recovery
        assert report.dropped_torn == len(torn), (report, torn)
        assert report.dropped_corrupt == 0, report
        assert torn_files(path) == []  # the torn files are gone
        total = 0
        for gen in generations:
            rec = gen.record
            found: Set[int] = set()
            for n in range(rec.last + 1):
                got = store.get(gen.key(n))
                if n in rec.removed:
                    assert got is None, f"{gen.key(n)} was removed before the crash but came back"
                elif n < rec.flushed and flushed_durable and n not in rec.removing:
                    assert got is not None, f"{gen.key(n)} was flushed before the crash but is missing"
                if got is not None:
                    assert got == value_of(gen.seed, n), f"{gen.key(n)} served with wrong bytes"
                    found.add(n)
            if gen is last:
                gen.present = found
            else:
                assert found == gen.present, f"generation {gen.prefix} changed across reopens"
            total += len(found)
        assert len(store) == total  # nothing else came back either
        assert report.objects == total
        assert store.check().ok
    # A second reopen finds the same, and nothing torn.
    with gdskv.open(path, dram="16MiB", ssd="256MiB") as store:
        assert store.recovery.dropped_torn == 0 and store.recovery.dropped_corrupt == 0
        assert len(store) == total
        for n in sorted(last.present):
            assert store.get(last.key(n)) == value_of(last.seed, n)


def child_options(path: Path, prefix: str, seed: int, **store) -> dict:
    defaults = dict(dram="8MiB", ssd="256MiB", bucket_bytes=MiB, bucket_max_age_s=0.005, promote_after_reads=0)
    defaults.update(store)
    return {
        "path": str(path), "prefix": prefix, "seed": seed, "rounds": 8, "per_round": 12,
        "store": defaults, "tear": None,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offload", ["eager", "watermark"])
def test_sigkill_at_random_points_never_loses_flushed_or_serves_torn(tmp_path, offload):
    """Crashes at seeded random points of the write loop: while puts are in flight, while
    buckets are being written, during removes. The same directory is reopened after each
    crash and written again by the next child, so later crashes hit a store with history,
    and what earlier reopens found must stay exactly as it was."""
    path = tmp_path / "store"
    generations: List[Generation] = []
    for it in range(6 if offload == "eager" else 3):
        seed = 100 * it + 7
        rng = random.Random(seed)
        kill_round = rng.randrange(1, 7)
        delay = rng.uniform(0.0, 0.01)
        dram = "2MiB" if offload == "watermark" else "8MiB"
        options = child_options(path, f"g{it}-", seed, offload=offload, dram=dram)
        options["paced"] = True

        def kill_after(record: Record, line: str) -> bool:
            if line.startswith(f"round {kill_round} "):
                time.sleep(delay)  # picks the kill point inside the round; correctness never depends on it
                return True
            return False

        record = run_child(options, kill_after)
        assert not record.done and record.last == 12 * (kill_round + 1)
        generations.append(Generation(options["prefix"], seed, record))
        verify_reopen(path, generations, flushed_durable=(offload == "eager"))
    assert any(g.present for g in generations)  # recovery did serve real data


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "what,torn",
    [
        ("data", 2),  # <bucket>.data.tmp half written, its <bucket>.index.tmp written beside it
        ("index", 2),  # <bucket>.data.tmp in flight, <bucket>.index.tmp half written beside it
        ("rewrite", 1),  # a remove's <bucket>.index.tmp half written; the old index stays
    ],
)
def test_sigkill_while_a_bucket_file_is_half_written(tmp_path, what, torn):
    path = tmp_path / "store"
    options = child_options(path, "k", 42, bucket_bytes=8 * MiB, bucket_max_age_s=5.0)
    options["tear"] = {"what": what, "round": 3}
    record = run_child(options, lambda rec, line: line.startswith("tearing"))
    assert record.tearing == what
    assert len(torn_files(path)) == torn
    gen = Generation("k", 42, record)
    verify_reopen(path, [gen])
    assert record.flushed >= 3 * 12 and len(gen.present) >= record.flushed - len(record.removed) - 1
