"""Which staging chunk and cap on large reads in flight suit this disk? uring settings against fio.

Large reads through the ``uring`` engine wait while ``read_inflight_bytes`` of them are in
flight (config ``io_read_inflight_bytes``, ``GDSKV_IO_READ_INFLIGHT``), and a read into
memory O_DIRECT cannot use (a numpy array is 64-byte aligned) goes through staging chunks
of ``chunk_bytes``. What suits a disk depends on the disk: the test VM's virtual disk reads
large blocks faster the fewer are in flight, an array of NVMe drives wants more.

For each setting ``CHUNK:CAP`` this writes ``--size`` bytes of ``--object``-sized objects
into one backend (``bucket`` by default) and reads them all back in random order,
``--qd`` objects per batch, as ``benchmarks/bench_io.py`` does; every run is paired with
fio reading the same block size at the same queue depth right before it, and the table
shows the median of those paired ratios. The settings run in an order rotated from one
round to the next. Read buffers are 64 bytes past a page boundary (staged), or page-aligned
with ``--out-align page`` (straight into them: the chunk does not matter then).

    python benchmarks/bench_read_staging.py --settings 256KiB:8MiB,1MiB:4MiB --rounds 8
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_io  # noqa: E402  (the sibling benchmark: its fio runner, arena and timed loops)

from gdskv.config import format_size, parse_size  # noqa: E402
from gdskv.gds.uring import UringEngine  # noqa: E402
from gdskv.tiers.backends import make_backend  # noqa: E402


def parse_settings(text: str) -> List[Tuple[int, int]]:
    """``CHUNK:CAP,...`` (sizes such as ``1MiB:4MiB``) as (chunk bytes, cap bytes) pairs."""
    settings = []
    for item in text.split(","):
        chunk, sep, cap = item.partition(":")
        if not sep:
            raise SystemExit(f"--settings: {item!r} is not CHUNK:CAP (for example 1MiB:4MiB)")
        settings.append((parse_size(chunk, field="--settings chunk"), parse_size(cap, field="--settings cap")))
    return settings


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="256KiB:8MiB,1MiB:4MiB", help="CHUNK:CAP pairs to compare (default 256KiB:8MiB,1MiB:4MiB)")
    p.add_argument("--object", default="2MiB", help="object size (default 2MiB)")
    p.add_argument("--size", default="512MiB", help="bytes of objects written and read (default 512MiB)")
    p.add_argument("--backend", default="bucket")
    p.add_argument("--qd", type=int, default=16, help="objects per read batch, and fio's queue depth (default 16)")
    p.add_argument("--rounds", type=int, default=8, help="paired runs per setting (default 8)")
    p.add_argument("--out-align", choices=("64", "page"), default="64", help="alignment of read buffers (default 64)")
    bench_io.add_fio_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    settings = parse_settings(args.settings)
    size = parse_size(args.object, field="--object")
    count = max(1, parse_size(args.size, field="--size") // size)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gdskv-bench-staging-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    fio = bench_io.ensure_fio(not args.no_fio_install)
    fio_mem = bench_io.FioMemory(args.fio_mem if fio else "malloc", args.qd * size)
    engines = {s: UringEngine(direct=True, chunk_bytes=s[0], read_inflight_bytes=s[1]) for s in settings}
    figures: Dict[Tuple[int, int], List[float]] = {s: [] for s in settings}
    ratios: Dict[Tuple[int, int], List[float]] = {s: [] for s in settings}
    work, fio_dir = base / "store", base / "fio"
    try:
        print("# bench_read_staging: uring staging chunk and cap on large reads in flight, against fio")
        print(f"# machine: {bench_io.machine()}")
        print(f"# filesystem: {bench_io.fs_type(base)} on {bench_io.device_of(base)} at {base}")
        print(f"# {count} objects of {format_size(size)} in {args.backend}, read {args.qd} per batch in random order, "
              f"into buffers aligned to {args.out_align}; {args.rounds} rounds; fio: {'yes, ' + fio_mem.describe() if fio else 'not available: absolute numbers only'}")
        arena = bench_io.Arena(count, size, args.seed, "dram")
        keys = [f"obj-{i}".encode() for i in range(count)]
        out_area, outs = bench_io.out_buffers(args.qd, size, args.out_align)
        first = engines[settings[0]]
        bench_io.warm_memory(first, base, memoryview(arena.map), out_area)
        backend = bench_io.open_backend(args.backend, work, first, 2 * count * (size + (1 << 20)))
        try:
            bench_io.gdskv_write(backend, arena, keys, 64 << 20)
        finally:
            backend.close()
        fio_dir.mkdir(exist_ok=True)
        fio_job = functools.partial(bench_io.fio_run, fio, fio_dir, direct=True, mem=fio_mem.option) if fio else None
        if fio_job:
            fio_job(rw="write", bs=size, qd=args.qd, size=count * size)
        for r in range(args.rounds):
            for setting in bench_io.rotated(settings, r):
                peer = fio_job(rw="randread", bs=size, qd=args.qd, size=count * size) if fio_job else None
                backend = make_backend(args.backend, work, engines[setting], capacity=2 * count * (size + (1 << 20)),
                                       eviction="fifo", verify_on_open="index")
                try:
                    backend.recover()
                    got = bench_io.gdskv_read(backend, keys, size, args.qd, outs, args.seed + r)
                finally:
                    backend.close()
                figures[setting].append(got)
                if peer:
                    ratios[setting].append(got / peer)
    finally:
        for engine in engines.values():
            engine.close()
        fio_mem.restore()
        for path in (work, fio_dir):
            shutil.rmtree(path, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    print()
    print(f"{'chunk':>9} {'in flight':>10} {'gdskv':>12} {'ratio':>6}  every round's ratio")
    for setting in settings:
        chunk, cap = setting
        ratio = bench_io.fmt_ratio(statistics.median(ratios[setting])) if ratios[setting] else "-"
        rounds = ", ".join(bench_io.fmt_ratio(x) for x in ratios[setting])
        print(f"{format_size(chunk):>9} {format_size(cap):>10} {bench_io.fmt_rate(statistics.median(figures[setting]), False):>12} "
              f"{ratio:>6}  {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
