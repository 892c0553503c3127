"""Does the CPU reading what was read slow the next reads down? Large O_DIRECT reads into
memory nobody reads, against the same reads while the CPU reads that memory.

On the test VM (docs/notes/read-slow-mode.md) gdskv's staged reads of large objects ran in one
of two modes, at fio's speed or well below it, for seconds to minutes at a time, while
fio ran at full speed in between. This separates the two things a staged read does that
fio's plain read does not: it moves the bytes through the same few staging chunks, and the
CPU reads them (the copy out, the checksum). Rounds alternate between, all on one file of
``--size`` bytes, random ``--block`` reads, ``--qd`` in flight:

- ``untouched``: gdskv's ``uring`` engine reading straight into the same ``--qd``
  page-aligned buffers again and again, which nobody reads (as fio's plain read);
- ``read by CPU``: the same, while a second thread copies those buffers out over and over
  (numpy, which lets go of the GIL while it copies; half a millisecond between passes), as
  a consumer reads what arrived;
- ``read, flushed``: the same, the copying thread then pushing each buffer's lines out of
  the CPU's caches (``clflushopt``, see ``cache_flush.py``; left out where it cannot be
  built), so that reads land in memory that is cached nowhere, or being flushed;
- ``flushed only``: the thread flushing those buffers without copying them (also left
  out where the flush cannot be built): what the flushing costs the reads by itself;
- ``staged``: gdskv reading into buffers 64 bytes past a page, so that every byte goes
  through the engine's staging chunks and is copied out of them by the ring;
- ``fio``: fio's plain random read of the file (its buffers are never read);
- ``fio checked``: fio's random read with ``--verify=crc32c``, its CPU reading every block
  it read to check it (the file is written by fio with its checksums).

Each row prints MiB/s and the block device's time per request over the round (from its
``/sys/class/block/<dev>/stat``: the time requests spent between issue and completion,
over the requests completed), so a slow round shows whether the requests themselves took
longer or fewer were in flight. The median and range of each kind close the run.

    python benchmarks/bench_read_touch.py --size 2GiB --rounds 12
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_io  # noqa: E402  (the sibling benchmark: its fio runner and machine banner)
from cache_flush import Flusher, load_flusher  # noqa: E402

from gdskv.config import format_size, parse_size  # noqa: E402
from gdskv.gds.aligned import alloc_aligned  # noqa: E402
from gdskv.gds.engine import IoRequest  # noqa: E402
from gdskv.gds.probe import fs_type  # noqa: E402
from gdskv.io_config import UringConfig  # noqa: E402


class DeviceStat:
    """Requests completed and their time on the device, from a block device's ``stat``
    (reads: fields 1 and 4); None where the file cannot be read."""

    def __init__(self, device: str) -> None:
        self.path = Path("/sys/class/block") / Path(device).name / "stat"

    def sample(self) -> Optional[Tuple[int, int]]:
        try:
            fields = self.path.read_text().split()
            return int(fields[0]), int(fields[3])
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def ms_per_request(before: Optional[Tuple[int, int]], after: Optional[Tuple[int, int]]) -> Optional[float]:
        if before is None or after is None or after[0] == before[0]:
            return None
        return (after[1] - before[1]) / (after[0] - before[0])


class Copier:
    """A thread that, while :meth:`running`, copies ``sources`` into memory of its own
    over and over, half a millisecond between passes: a consumer reading what the reads
    brought in. With a ``flush`` set, it pushes each source out of the CPU's caches once
    copied; with ``copy`` unset, it only flushes."""

    def __init__(self, sources: List[memoryview]) -> None:
        self._sources = [np.frombuffer(s, dtype=np.uint8) for s in sources]
        self._sink = np.empty(max(s.size for s in self._sources), dtype=np.uint8)
        self.flush: Optional[Flusher] = None
        self.copy = True
        self._on = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="bench-read-touch-copier", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not self._on.wait(0.1):
                continue
            flush, copy = self.flush, self.copy
            for src in self._sources:
                if copy:
                    np.copyto(self._sink[: src.size], src)
                if flush is not None:
                    flush(src)
            time.sleep(0.0005)  # lets the reading thread take the GIL between passes

    def running(self, on: bool) -> None:
        (self._on.set if on else self._on.clear)()

    def close(self) -> None:
        self._stop = True
        self._on.set()
        self._thread.join()


#: Reads per batch, per buffer: the engine keeps as many in flight as it has buffers (its cap
#: on large reads in flight), refilling as reads complete, so the device never waits for a
#: batch to end but once every this many reads.
READS_PER_BUFFER = 16


def gdskv_reads(engine, fd: int, file_size: int, block: int, buffers: List[memoryview], seconds: float, seed: int) -> float:
    """Random ``block`` reads of the file into ``buffers`` in turn, in batches of
    :data:`READS_PER_BUFFER` reads per buffer, for about ``seconds``; bytes/s. (Two reads
    may land in one buffer at once when a later one is let through before an earlier one
    ends: nothing checks these bytes, and the device's work is the same.)"""
    rng = random.Random(seed)
    slots = file_size // block
    moved = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = [IoRequest.read(fd, rng.randrange(slots) * block, buf) for _ in range(READS_PER_BUFFER) for buf in buffers]
        got = engine.submit(batch).result()
        if any(n != block for n in got):
            raise RuntimeError(f"a read returned short: {got}")
        moved += block * len(batch)
    return moved / (time.perf_counter() - t0)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", help="bytes of the file read (default 1GiB)")
    p.add_argument("--block", default="1MiB", help="bytes per read (default 1MiB, a staging chunk)")
    p.add_argument("--qd", type=int, default=4, help="reads in flight: fio's queue depth, and the engine's cap on large reads in flight over --block (default 4)")
    p.add_argument("--rounds", type=int, default=8, help="rounds; each runs every kind once, in a rotated order (default 8)")
    p.add_argument("--seconds", type=float, default=1.5, help="seconds per kind and round (default 1.5)")
    bench_io.add_fio_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    block = parse_size(args.block, field="--block")
    if block % 4096 or args.qd < 1 or args.rounds < 1 or args.seconds <= 0:
        p.error("--block must be a multiple of 4 KiB, --qd and --rounds at least 1, --seconds positive")
    size = parse_size(args.size, field="--size") // block * block
    if size < block * args.qd:
        p.error(f"--size must hold at least --qd blocks ({format_size(block * args.qd)})")

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gdskv-bench-touch-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    work = base / "read-touch"
    work.mkdir(exist_ok=True)
    fio = bench_io.ensure_fio(not args.no_fio_install)
    fio_mem = bench_io.FioMemory(args.fio_mem if fio else "malloc", args.qd * block)
    device = bench_io.device_of(base)
    stat = DeviceStat(device)
    engine = UringConfig(direct=True, read_inflight_bytes=args.qd * block).build(work)  # --qd in flight
    copier: Optional[Copier] = None
    flush, flush_how = load_flusher()
    staging_area = direct_area = None
    fd = -1
    try:
        print("# bench_read_touch: O_DIRECT reads into memory nobody reads, against the same while the CPU reads it")
        print(f"# machine: {bench_io.machine()}")
        print(f"# filesystem: {fs_type(base)} on {device} at {base}")
        print(f"# {format_size(size)} file, random {format_size(block)} reads, {args.qd} in flight, {args.seconds:g} s per kind "
              f"and round, {args.rounds} rounds; fio: {'yes, ' + fio_mem.describe() if fio else 'not available: gdskv rows only'}")
        print(f"# flushing the CPU's caches: {flush_how if flush else 'left out, ' + flush_how}")
        checked_file = work / "fio-checked.dat"
        if fio:  # fio writes the file with its checksums, so that its checked reads can check it
            bench_io.fio_run(fio, work, rw="write", bs=block, qd=args.qd, size=size, direct=True, mem=fio_mem.option, checked=True)
            os.link(checked_file, work / "fio.dat")  # fio's plain reads read the same bytes
        else:
            with open(checked_file, "wb") as f:
                for _ in range(size // block):
                    f.write(os.urandom(block))
                f.flush()
                os.fsync(f.fileno())
        fd = engine.open_file(checked_file, os.O_RDONLY)
        # Page-aligned buffers on huge pages (as the staging is), read straight into.
        direct_area = alloc_aligned(args.qd * block)
        direct = [direct_area.view[i * block : (i + 1) * block] for i in range(args.qd)]
        # Buffers 64 bytes past a page: every byte goes through the engine's staging.
        staging_area = alloc_aligned(args.qd * (block + 4096))
        staged = [staging_area.view[i * (block + 4096) + 64 : i * (block + 4096) + 64 + block] for i in range(args.qd)]
        for buf in (*direct, *staged):  # touched once before the clock, as a store's memory is
            buf[:] = b"\0" * block
        copier = Copier(direct)

        def touched(on: bool, flushed: bool = False, copied: bool = True) -> Callable[[int], float]:
            def run(seed: int) -> float:
                copier.flush = flush if flushed else None
                copier.copy = copied
                copier.running(on)
                try:
                    return gdskv_reads(engine, fd, size, block, direct, args.seconds, seed)
                finally:
                    copier.running(False)
            return run

        def fio_read(checked: bool) -> Callable[[int], float]:
            def run(seed: int) -> float:
                return bench_io.fio_run(fio, work, rw="randread", bs=block, qd=args.qd, size=size, direct=True,
                                        mem=fio_mem.option, checked=checked, seconds=args.seconds)
            return run

        runs: Dict[str, Callable[[int], float]] = {
            "untouched": touched(False),
            "read by CPU": touched(True),
        }
        if flush is not None:
            runs["read, flushed"] = touched(True, flushed=True)
            runs["flushed only"] = touched(True, flushed=True, copied=False)
        runs["staged"] = lambda seed: gdskv_reads(engine, fd, size, block, staged, args.seconds, seed)
        if fio:
            runs["fio"] = fio_read(False)
            runs["fio checked"] = fio_read(True)
        figures: Dict[str, List[float]] = {kind: [] for kind in runs}
        print()
        print(f"{'round':>5}  " + "  ".join(f"{kind:>22}" for kind in runs))
        for r in range(args.rounds):
            cells = {}
            for kind in bench_io.rotated(list(runs), r):
                before = stat.sample()
                rate = runs[kind](args.seed + r)
                ms = DeviceStat.ms_per_request(before, stat.sample())
                figures[kind].append(rate)
                cells[kind] = f"{rate / (1 << 20):.0f} MiB/s" + (f" ({ms:.2f} ms)" if ms is not None else "")
            print(f"{r:>5}  " + "  ".join(f"{cells[kind]:>22}" for kind in runs), flush=True)
        print()
        print("# MiB/s over the rounds, median (lowest-highest); in brackets above: the device's milliseconds per request")
        for kind in runs:
            values = [v / (1 << 20) for v in figures[kind]]
            print(f"#   {kind:<14} {statistics.median(values):6.0f} ({min(values):.0f}-{max(values):.0f})")
    finally:
        if copier is not None:
            copier.close()
        if fd >= 0:
            os.close(fd)
        engine.close()
        for area in (direct_area, staging_area):
            if area is not None:
                area.close()
        fio_mem.restore()
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
