"""Does the offset backend's index cost grow with the store? Writes into a full tier of many objects.

For each ``--sizes`` capacity: fill an ``offset`` store of that capacity with objects of
``--object`` bytes, then write ``--write`` bytes more (every batch evicts, and a checkpoint
comes each time the window fills), and print the write's MiB/s, the time spent in
checkpoints, the bytes they wrote and how many of them were bases (``bases``: bases /
checkpoints). A base lists every object, so one in the write weighs on its figure. A base
comes once the deltas since the last one add up to more bytes than it (or number 64), so
while a store fills one comes each time the store has doubled: a 16 GiB store of 64 KiB
objects (a checkpoint per 256 MiB) took bases at its 4th, 8th, 16th and 32nd checkpoints,
then at its 63rd, in the first batches written after the fill, and none in the 14
checkpoints of the next 3.5 GiB. A longer ``--write`` spreads that one. In the same run the
same is done:

- with every checkpoint a *base* (a full listing of the store, as before checkpoint deltas;
  ``bases only``), the peer that shows what the deltas save;
- through the ``bucket`` backend (whole-bucket eviction and an index per bucket, no
  checkpoints), the peer that shows what the offset layout costs at all.

Ratios are the offset figure over each peer's. The write of a store of N objects runs
through the backend API as ``bench_io.py`` does (``--batch`` bytes at a time, 64 MiB by
default; O_DIRECT; ``uring``).

    python benchmarks/bench_checkpoint.py --sizes 1GiB,4GiB,16GiB --dir /var/tmp/gdskv-bench-ckpt
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gdskv.tiers.backends.offset.checkpoint_log as checkpoint_log  # noqa: E402
from bench_io import Arena, gdskv_write, machine, open_backend, warm_memory  # noqa: E402
from gdskv.config import format_size, parse_size  # noqa: E402
from gdskv.gds import make_engine  # noqa: E402

#: Distinct values in memory; the objects cycle through them (a store of 16 GiB of 64 KiB
#: objects would not fit in memory otherwise).
VALUES = 4096


class Cycling:
    """``Arena``'s interface for any number of objects: object ``i`` is value ``i % VALUES``."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.size = arena.size

    def view(self, i: int):
        return self.arena.view(i % VALUES)


def measure(name: str, work: Path, engine, capacity: int, values: Cycling, written: int, batch: int, bases_only: bool) -> dict:
    """Fill a store of ``capacity``, write ``written`` bytes more; the write's figures (the
    checkpoint ones from the backend's counters: zero for ``bucket``, which takes none).
    ``bases_only``: every checkpoint a base, as before deltas (the one policy switched)."""
    real_due = checkpoint_log.base_is_due
    if bases_only:
        checkpoint_log.base_is_due = lambda *_: True
    try:
        backend = open_backend(name, work, engine, capacity)
        try:
            fill = capacity // (values.size + 4096)
            gdskv_write(backend, values, [b"fill-%010d" % i for i in range(fill)], batch, evicting=True)
            counters = getattr(backend, "counters", {})
            watched = ("checkpoint_seconds", "checkpoint_bytes", "checkpoints", "checkpoint_bases")
            before = {counter: counters.get(counter, 0) for counter in watched}
            rate = gdskv_write(backend, values, [b"more-%010d" % i for i in range(written // values.size)], batch, evicting=True)
            taken = {counter: counters.get(counter, 0) - value for counter, value in before.items()}
            return {
                "objects": fill, "rate": rate, "checkpoint_s": taken["checkpoint_seconds"],
                "checkpoint_bytes": taken["checkpoint_bytes"], "checkpoints": taken["checkpoints"],
                "bases": taken["checkpoint_bases"],
            }
        finally:
            backend.close()
    finally:
        checkpoint_log.base_is_due = real_due
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1GiB,4GiB,16GiB", help="store capacities (default 1GiB,4GiB,16GiB)")
    p.add_argument("--object", default="64KiB", help="object size (default 64KiB)")
    p.add_argument("--write", default="1GiB", help="bytes written into each full store (default 1GiB)")
    p.add_argument("--batch", default="64MiB", help="bytes per write batch (default 64MiB, the bucket size)")
    p.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temporary one)")
    p.add_argument("--engine", default="uring", help="I/O engine (default uring)")
    args = p.parse_args()
    sizes = [parse_size(s, field="--sizes") for s in args.sizes.split(",")]
    object_size = parse_size(args.object, field="--object")
    written = parse_size(args.write, field="--write")
    batch = parse_size(args.batch, field="--batch")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gdskv-bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    engine = make_engine(args.engine, direct=True, directory=base)
    values = Cycling(Arena(VALUES, object_size, 1))
    warm_memory(engine, base, memoryview(values.arena.map))
    print(f"# bench_checkpoint: {machine()}; {args.engine}, objects of {format_size(object_size)}, "
          f"{format_size(written)} written into each full store")
    print(f"{'capacity':>10} {'objects':>9} {'run':<12} {'MiB/s':>7} {'checkpoints':>12} {'ckpt MiB':>9} {'bases':>9}  ratio")
    try:
        for capacity in sizes:
            runs = {
                "offset": measure("offset", base / "offset", engine, capacity, values, written, batch, False),
                "bases only": measure("offset", base / "offset", engine, capacity, values, written, batch, True),
                "bucket": measure("bucket", base / "bucket", engine, capacity, values, written, batch, False),
            }
            for label, run in runs.items():
                ratio = "" if label == "offset" else f"offset {runs['offset']['rate'] / run['rate']:.2f}x"
                ckpt = "" if label == "bucket" else f"{run['checkpoint_s']:.2f} s"
                mib = "" if label == "bucket" else f"{run['checkpoint_bytes'] / 2**20:.1f}"
                bases = "" if label == "bucket" else f"{run['bases']}/{run['checkpoints']}"
                print(f"{format_size(capacity):>10} {run['objects']:>9} {label:<12} {run['rate'] / 2**20:>7.0f} {ckpt:>12} {mib:>9} "
                      f"{bases:>9}  {ratio}", flush=True)
    finally:
        engine.close()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
