#!/usr/bin/env python3
"""How close does the store come to the machine's own limits, tier by tier?

Measures put and get throughput of :class:`gdskv.Store` per tier and prints each figure
beside the limit of this machine measured in the same run, as a ratio:

==========================  ==================================================================
gdskv figure                machine limit it is compared with
==========================  ==================================================================
DRAM put                    numpy copy of the same blocks into resident memory
DRAM hit (``get_into``)     numpy copy of the same blocks into one reused buffer
NVMe write (offload)        sequential write + fsync of the same bytes (buffered or O_DIRECT)
NVMe cold read              sequential read of the same bytes (cache dropped, or O_DIRECT)
==========================  ==================================================================

- *DRAM put*: ``put`` of every block into a DRAM-only store (``ssd=0``) whose arena was
  faulted in by a first pass; that first pass is shown too, beside a numpy copy into fresh
  (not yet faulted) memory. Includes the CRC32C the store computes for every value.
  *DRAM hit*: ``get_into`` of every block into one preallocated buffer.
- *NVMe write*: wall time from the first ``put`` of a chunk into a fresh store (eager
  offload, DRAM tier 1/8 of the data, so puts wait for the offloader once DRAM is full)
  until ``flush()`` returns, i.e. until every bucket and its index are written, fsynced and
  renamed. The limit is the fastest of three plain sequential writes of the same bytes from
  the same buffers: an fsync every 64 MiB (the bucket size); one fsync per chunk;
  write-back started after every block (``sync_file_range``) with an fsync every 64 MiB;
  and O_DIRECT writes of up to 64 MiB per ``pwritev`` with an fsync every 64 MiB (the
  store writes with O_DIRECT too; on a fast disk the buffered writes are far slower than
  the device, and a limit taken from them alone would flatter the store).
- *NVMe cold read*: the store is closed and reopened with a small DRAM tier, the page cache
  is dropped (``drop_caches`` when permitted, else ``posix_fadvise(DONTNEED)`` on every file
  after fsync; the banner says which); then ``get_into`` of every block, one at a time, and
  after another drop ``batch_get_into`` in batches (one engine submission each). The store
  verifies every value's CRC32C before returning it; that is part of the figure. The limit
  is the faster of two sequential reads (block-sized ``preadv``, one at a time) of a plain
  file holding the same bytes: buffered, and O_DIRECT.

Other processes change the speed of a shared machine from one second to the next, so every
figure is measured *interleaved*: gdskv and its limit take turns on chunks of the blocks
(64 MiB; 512 MiB for writes, so that puts overlap the offload within a chunk as in a long
run; the one that goes first rotates) and each one's time is summed. Every pass moves all
``--size`` bytes. GB/s figures are
medians over ``--repeats`` passes; a ratio is the median over passes of gdskv / limit
within the same pass. After the timed passes every block is read back and compared with
what was written (untimed). Targets (issue 2): DRAM get >= 0.7x memcpy; NVMe read and write
>= 0.8x raw file I/O.

Usage::

    python benchmarks/bench_store.py --size 4GiB --block 2MiB [--dir DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import errno
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

import gdskv
from gdskv import format_size, parse_size
from gdskv.gds.aligned import alloc_aligned
from gdskv.gds.psync import start_writeback
from gdskv.tiers.dram import alloc_arena

#: Distinct source blocks; block ``i`` is pool block ``i % POOL`` with ``i`` stamped in front.
POOL = 32
#: The store's bucket size (the StoreConfig default), also the raw write's fsync interval.
BUCKET_BYTES = gdskv.StoreConfig().bucket_bytes
#: The NVMe phase's DRAM tier holds this fraction of the data, so the data must go through SSD.
NVME_DRAM_FRACTION = 8
#: Interleaving unit of reads: gdskv and its limit take turns on chunks of this many bytes.
CHUNK_BYTES = 64 << 20
#: Interleaving unit of writes: eight buckets, so the store's puts overlap its offload
#: within a chunk as they do in a long run (a chunk ends with flush()).
WRITE_CHUNK_BYTES = 8 * BUCKET_BYTES
#: Ratios each figure must reach (issue 2); None: shown, no target.
TARGETS = {"dram_get": 0.7, "nvme_write": 0.8, "nvme_read": 0.8}


# ---------------------------------------------------------------------------- data


class Blocks:
    """Deterministic, distinct blocks that cost one 8-byte store to produce.

    ``view(i)`` returns a pool block whose first 8 bytes now hold ``i``; it stays valid until
    the next call with another index of the same pool slot.
    """

    def __init__(self, count: int, size: int, seed: int) -> None:
        self.count = count
        self.size = size
        rng = np.random.default_rng(seed)
        rows = min(POOL, count)
        # Page-aligned, so that the O_DIRECT peer of the NVMe write can write it as it is.
        self._memory = alloc_aligned(rows * size)
        self.pool = np.frombuffer(self._memory.view, dtype=np.uint8)[: rows * size].reshape(rows, size)
        self.pool[:] = rng.integers(0, 256, (rows, size), dtype=np.uint8)
        self._stamps = self.pool[:, :8].view(np.uint64)

    def key(self, i: int) -> str:
        return f"bench/{i:08d}"

    def view(self, i: int) -> np.ndarray:
        slot = i % len(self.pool)
        self._stamps[slot, 0] = i
        return self.pool[slot]

    def matches(self, i: int, out: np.ndarray) -> bool:
        slot = i % len(self.pool)
        return int(out[:8].view(np.uint64)[0]) == i and np.array_equal(out[8:], self.pool[slot, 8:])


# ---------------------------------------------------------------------------- machine


def filesystem_of(path: Path) -> str:
    """``fstype device mountpoint`` of the filesystem holding ``path``."""
    real = os.path.realpath(path)
    best = ("?", "?", "/")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[2]):
                    best = (fstype, dev, mnt)
    except OSError:
        pass
    return f"{best[0]} on {best[1]} (mounted at {best[2]})"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


class CacheDropper:
    """Evicts files from the page cache so the next read comes from the device.

    ``drop_caches``: ``sync`` then ``3 > /proc/sys/vm/drop_caches`` (whole machine; needs root).
    ``fadvise``: ``fsync`` then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every given file.
    ``auto`` tries the first and falls back to the second.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        if mode == "auto":
            self.mode = "drop_caches" if self._drop_caches() else "fadvise"

    @staticmethod
    def _drop_caches() -> bool:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False

    def drop(self, paths: List[Path]) -> None:
        if self.mode == "drop_caches":
            if not self._drop_caches():
                raise SystemExit("cannot write /proc/sys/vm/drop_caches; use --cache-drop fadvise")
            return
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def describe(self) -> str:
        if self.mode == "drop_caches":
            return "sync + echo 3 > /proc/sys/vm/drop_caches before every cold read"
        return "fsync + posix_fadvise(DONTNEED) on every file before every cold read"


def files_under(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(chunks: List[range], *fns: Callable[[range], None]) -> List[float]:
    """Run every ``fn`` on each chunk in turn, rotating which goes first, and return each
    one's total seconds: all of them see the same machine, a chunk apart."""
    totals = [0.0] * len(fns)
    for j, chunk in enumerate(chunks):
        for k in range(len(fns)):
            k = (k + j) % len(fns)
            t0 = time.perf_counter()
            fns[k](chunk)
            totals[k] += time.perf_counter() - t0
    return totals


class Results:
    """Seconds per pass for each named measurement; every pass moves the same bytes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.seconds: Dict[str, List[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)

    def rate(self, name: str) -> float:
        """Median bytes/s over the passes of ``name``."""
        return self.nbytes / statistics.median(self.seconds[name])

    def ratio(self, name: str, limit: str) -> float:
        """Median over passes of (rate of ``name`` / rate of ``limit`` in the same pass)."""
        return statistics.median(lim / s for s, lim in zip(self.seconds[name], self.seconds[limit]))

    def spread(self, name: str) -> str:
        rates = sorted(self.nbytes / s for s in self.seconds[name])
        if len(rates) == 1:
            return f"1 pass, {gbps(rates[0])}"
        return f"{len(rates)} passes, {gbps(rates[0])}..{gbps(rates[-1])}"


def gbps(rate: float) -> str:
    return f"{rate / 1e9:.2f}"


# ---------------------------------------------------------------------------- passes


def dram_passes(blocks: Blocks, res: Results, repeats: int, root: Path, chunks: List[range]) -> List[int]:
    """DRAM puts and hits on a DRAM-only store, interleaved chunk by chunk with numpy copies
    of the same blocks in the same pattern; returns the indices read back wrong."""
    n, size = blocks.count, blocks.size
    keys = [blocks.key(i) for i in range(n)]
    out = np.empty(size, dtype=np.uint8)
    # Memory allocated as the store's arena is (huge pages where the kernel allows, which
    # fault in at another speed than small ones); not touched yet: the first pass faults it in.
    mapping, _ = alloc_arena(n * size)
    resident = np.frombuffer(mapping, dtype=np.uint8).reshape(n, size)
    dram = n * (size + 64) + (1 << 20)
    bad: List[int] = []
    with gdskv.open(root / "dram", dram=dram, ssd=0, put_timeout_s=600.0) as store:

        def copy_in(chunk: range) -> None:
            for i in chunk:
                np.copyto(resident[i], blocks.view(i))

        def put(chunk: range) -> None:
            for i in chunk:
                store.put(keys[i], blocks.view(i))

        def copy_out(chunk: range) -> None:
            for i in chunk:
                np.copyto(out, resident[i])

        def get(chunk: range) -> None:
            get_into = store.get_into
            for i in chunk:
                get_into(keys[i], out)

        copied, stored = interleaved(chunks, copy_in, put)  # both fault their memory in
        res.add("memcpy_put_first", copied)
        res.add("dram_put_first", stored)
        for _ in range(repeats):
            for k in keys:  # make room again; the arena stays faulted in
                store.remove(k)
            copied, stored = interleaved(chunks, copy_in, put)
            res.add("memcpy_put", copied)
            res.add("dram_put", stored)
            copied, got = interleaved(chunks, copy_out, get)
            res.add("memcpy_get", copied)
            res.add("dram_get", got)
        for i in range(n):
            if store.get_into(keys[i], out) != size or not blocks.matches(i, out):
                bad.append(i)
        hits = store.stats()["dram"]["hits"]
        if hits != n * (repeats + 1):
            raise SystemExit(f"expected every DRAM get to hit; stats say {hits} of {n * (repeats + 1)}")
    resident = None  # release the view before unmapping
    mapping.close()
    shutil.rmtree(root / "dram")
    return bad


def open_direct(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> Optional[int]:
    """``path`` opened with ``flags`` and O_DIRECT, or None where the filesystem refuses it."""
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def _pwrite_all(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


class NvmePass:
    """One repeat of the NVMe measurements: store writes interleaved with three plain
    sequential writes of the same bytes, then cold reads of that store interleaved with
    cold reads of the plain file, with ``get_into`` and then with ``batch_get_into``."""

    def __init__(self, blocks: Blocks, root: Path, dropper: CacheDropper, args: argparse.Namespace) -> None:
        self.blocks = blocks
        self.raw = root / "raw.bin"
        self.raw2 = root / "raw2.bin"
        self.raw3 = root / "raw3.bin"
        self.raw4 = root / "raw4.bin"
        self.path = root / "store"
        self.dropper = dropper
        self.args = args
        self.keys = [blocks.key(i) for i in range(blocks.count)]
        n, size = blocks.count, blocks.size
        self.options = dict(ssd=2 * n * (size + 8192) + (64 << 20), io_threads=args.io_threads, io_engine=args.io_engine,
                            put_timeout_s=600.0, promote_after_reads=0)
        self.write_stats: dict = {}

    def fresh_store(self) -> "gdskv.Store":
        """An empty store: eager offload, DRAM tier 1/8 of the data."""
        shutil.rmtree(self.path, ignore_errors=True)
        n, size = self.blocks.count, self.blocks.size
        dram = max(n * size // NVME_DRAM_FRACTION, 8 * (size + 64))
        return gdskv.open(self.path, dram=dram, offload="eager", **self.options)

    def writes(self, res: Results) -> None:
        """Store puts + flush() and three plain sequential writes of the same bytes (an fsync
        per bucket size; an fsync per chunk; write-back started after every block and an
        fsync per bucket size), interleaved chunk by chunk. Leaves the store and the first
        plain file for the reads."""
        n, size = self.blocks.count, self.blocks.size
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in (self.raw, self.raw2, self.raw3)]
        direct_fd = open_direct(self.raw4) if size % 4096 == 0 else None
        store = self.fresh_store()
        try:

            def put(chunk: range) -> None:
                for i in chunk:
                    store.put(self.keys[i], self.blocks.view(i))
                store.flush()

            def raw_fsync_per_bucket(chunk: range) -> None:
                for i in chunk:
                    _pwrite_all(fds[0], self.blocks.view(i), i * size)
                    if ((i + 1) * size) % BUCKET_BYTES < size or i == chunk.stop - 1:
                        os.fsync(fds[0])

            def raw_fsync_per_chunk(chunk: range) -> None:
                for i in chunk:
                    _pwrite_all(fds[1], self.blocks.view(i), i * size)
                os.fsync(fds[1])

            def raw_writeback(chunk: range) -> None:
                for i in chunk:
                    _pwrite_all(fds[2], self.blocks.view(i), i * size)
                    start_writeback(fds[2], i * size, size)
                    if ((i + 1) * size) % BUCKET_BYTES < size or i == chunk.stop - 1:
                        os.fsync(fds[2])

            def raw_direct(chunk: range) -> None:
                # O_DIRECT, up to 64 MiB per pwritev (the kernel splits it into requests that
                # the device runs side by side), an fsync every 64 MiB.
                per_call = max(1, min(len(self.blocks.pool), BUCKET_BYTES // size))
                for first in range(chunk.start, chunk.stop, per_call):
                    group = range(first, min(chunk.stop, first + per_call))
                    views = [memoryview(self.blocks.view(i)) for i in group]
                    if os.pwritev(direct_fd, views, first * size) != len(group) * size:
                        raise SystemExit(f"short O_DIRECT write of {self.raw4}")
                    os.fsync(direct_fd)

            peers = {"raw_write_fsync_64MiB": raw_fsync_per_bucket, "raw_write_fsync_chunk": raw_fsync_per_chunk,
                     "raw_write_writeback": raw_writeback}
            if direct_fd is not None:
                peers["raw_write_direct"] = raw_direct
            chunks = chunked(n, size, WRITE_CHUNK_BYTES)
            stored, *plain = interleaved(chunks, put, *peers.values())
            res.add("nvme_write", stored)
            for name, seconds in zip(peers, plain):
                res.add(name, seconds)
            res.add("raw_write", min(plain))
            self.write_stats = store.stats()
        finally:
            for fd in fds + ([direct_fd] if direct_fd is not None else []):
                os.close(fd)
            store.close()
        os.unlink(self.raw2)
        os.unlink(self.raw3)
        if self.raw4.exists():
            os.unlink(self.raw4)

    def run(self, res: Results, verify: bool) -> Tuple[List[int], dict]:
        n, size = self.blocks.count, self.blocks.size
        chunks = chunked(n, size)
        self.writes(res)
        out = np.empty(size, dtype=np.uint8)
        outs = [np.empty(size, dtype=np.uint8) for _ in range(self.args.batch)]
        bad: List[int] = []
        store = gdskv.open(self.path, dram=max(4 * size, 16 << 20), **self.options)
        fd = os.open(self.raw, os.O_RDONLY)
        direct_fd = open_direct(self.raw, os.O_RDONLY) if size % 4096 == 0 else None
        aligned = alloc_aligned(size)
        try:
            if store.recovery.objects != n:
                raise SystemExit(f"reopen found {store.recovery.objects} objects, expected {n}")
            raw_view = memoryview(out)
            direct_view = aligned.view[:size]

            def raw_read(chunk: range) -> None:
                for i in chunk:
                    if os.preadv(fd, [raw_view], i * size) != size:
                        raise SystemExit(f"short read of {self.raw}")

            def raw_read_direct(chunk: range) -> None:
                for i in chunk:
                    if os.preadv(direct_fd, [direct_view], i * size) != size:
                        raise SystemExit(f"short O_DIRECT read of {self.raw}")

            # The limit is the faster of a buffered and an O_DIRECT read of the same blocks,
            # one at a time (the store reads with O_DIRECT; on a fast disk a buffered read
            # alone may be below what the device does).
            raw_reads = [raw_read] + ([raw_read_direct] if direct_fd is not None else [])

            def get(chunk: range) -> None:
                get_into = store.get_into
                for i in chunk:
                    if get_into(self.keys[i], out) is None:
                        raise SystemExit(f"miss on {self.keys[i]}")

            def batch_get(chunk: range) -> None:
                b = self.args.batch
                for start in range(chunk.start, chunk.stop, b):
                    keys = self.keys[start : min(start + b, chunk.stop)]
                    if None in store.batch_get_into(keys, outs[: len(keys)]):
                        raise SystemExit(f"miss in the batch at {start}")

            files = files_under(self.path) + [self.raw]
            self.dropper.drop(files)
            *raw_s, store_s = interleaved(chunks, *raw_reads, get)
            for name, seconds in zip(("raw_read_buffered", "raw_read_direct"), raw_s):
                res.add(name, seconds)
            res.add("raw_read", min(raw_s))
            res.add("nvme_read", store_s)
            self.dropper.drop(files)
            *raw_s, store_s = interleaved(chunks, *raw_reads, batch_get)
            res.add("raw_read_2", min(raw_s))
            res.add("nvme_read_batch", store_s)
            if verify:
                for i in range(n):
                    if store.get_into(self.keys[i], out) != size or not self.blocks.matches(i, out):
                        bad.append(i)
            read_stats = store.stats()
            if read_stats["dram"]["hits"]:
                raise SystemExit("a cold read was served from DRAM; its tier must be too small to hold the data")
        finally:
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)
            aligned.close()
            store.close()
        shutil.rmtree(self.path)
        os.unlink(self.raw)
        return bad, {"write": self.write_stats, "read": read_stats}


def chunked(n: int, size: int, nbytes: int = 0) -> List[range]:
    """Block index ranges of about ``nbytes`` (default CHUNK_BYTES) each: the unit of interleaving."""
    step = max(1, (nbytes or CHUNK_BYTES) // size)
    return [range(i, min(i + step, n)) for i in range(0, n, step)]


# ---------------------------------------------------------------------------- report


def print_banner(args: argparse.Namespace, root: Path, dropper: CacheDropper, n: int) -> None:
    io = gdskv.StoreConfig(io_engine=args.io_engine, io_threads=args.io_threads).io  # the stores' engine
    with io.build(root) as engine:
        engine_desc = ", ".join(f"{k}={v}" for k, v in engine.describe().items())
    lines = [
        ("gdskv", f"{gdskv.__version__}  bench_store: per-tier throughput vs this machine's limits"),
        ("engine", f"{engine_desc}, bucket backend ({format_size(BUCKET_BYTES)} buckets), eager offload, no GPU path"),
        ("python", f"{platform.python_implementation()} {platform.python_version()}, numpy {np.__version__}"),
        ("machine", f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}"),
        ("dir", f"{root}: {filesystem_of(root)}"),
        ("cold reads", dropper.describe()),
        ("workload", f"{n} blocks x {format_size(args.block)} = {format_size(n * args.block)}, "
                     f"seed {args.seed}, median of {args.repeats} passes, batch {args.batch}"),
    ]
    width = max(len(k) for k, _ in lines)
    print("=" * 100)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    print("=" * 100)


ROWS = [
    # name, label, limit name, limit label, target key
    ("dram_put", "DRAM put", "memcpy_put", "numpy copy into resident memory", None),
    ("dram_put_first", "DRAM put, first touch", "memcpy_put_first", "numpy copy into fresh memory", None),
    ("dram_get", "DRAM hit get_into", "memcpy_get", "numpy copy into one buffer", "dram_get"),
    ("nvme_write", "NVMe write (puts -> flush done)", "raw_write", "sequential write + fsync, best of 4", "nvme_write"),
    ("nvme_read", "NVMe cold read get_into", "raw_read", "cold sequential read, best of 2", "nvme_read"),
    ("nvme_read_batch", "NVMe cold read batch_get_into", "raw_read_2", "cold sequential read, best of 2", None),
]


def print_table(res: Results, batch: int) -> bool:
    header = ("measurement", "gdskv GB/s", "limit GB/s", "machine limit", "ratio", "target", "")
    rows = []
    ok = True
    for name, label, limit, limit_label, target_key in ROWS:
        if name not in res.seconds:
            continue
        if name == "nvme_read_batch":
            label = f"{label} ({batch})"
        ratio = res.ratio(name, limit)
        target = TARGETS.get(target_key) if target_key else None
        verdict = ""
        if target is not None:
            verdict = "met" if ratio >= target else "MISSED"
            ok = ok and ratio >= target
        rows.append((label, gbps(res.rate(name)), gbps(res.rate(limit)), limit_label, f"{ratio:.2f}x",
                     f">= {target}x" if target is not None else "-", verdict))
    widths = [max(len(str(r[c])) for r in rows + [header]) for c in range(len(header))]
    aligns = ["<", ">", ">", "<", ">", "<", "<"]
    sep = "  "
    print(sep.join(f"{h:{a}{w}}" for h, a, w in zip(header, aligns, widths)).rstrip())
    print(sep.join("-" * w for w in widths).rstrip())
    for r in rows:
        print(sep.join(f"{c:{a}{w}}" for c, a, w in zip(r, aligns, widths)).rstrip())
    print("GB/s: medians over passes. ratio: median over passes of gdskv / limit within the pass.")
    return ok


def print_spread(res: Results) -> None:
    print()
    print("passes (GB/s, min..max):")
    for name in res.seconds:
        print(f"  {name:<18} {res.spread(name)}")


def print_store_stats(stats: dict) -> None:
    w, r = stats["write"], stats["read"]
    off = w["offload"]
    print()
    print(
        f"offload: {off['objects']} objects, {format_size(off['bytes'])} in {w['nvme']['buckets_written']} buckets, "
        f"{gbps(off['bytes_per_s'])} GB/s inside the bucket writer (excl. queueing); "
        f"{w['puts']['waited']} puts waited for DRAM room, {w['dram']['evicted']} DRAM evictions"
    )
    print(
        f"cold reads: {r['nvme']['hits']} NVMe hits, {r['dram']['hits']} DRAM hits, "
        f"{r['gets']['misses']} misses, {r['nvme']['corrupt_reads']} corrupt; "
        f"reopen recovered {r['recovery']['objects']} objects"
    )


# ---------------------------------------------------------------------------- main


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="4GiB", help="bytes per pass (default 4GiB)")
    p.add_argument("--block", default="2MiB", help="block (value) size (default 2MiB)")
    p.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the block contents (default 0)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per measurement (default 3)")
    p.add_argument("--batch", type=int, default=16, help="keys per batch_get_into (default 16)")
    p.add_argument("--io-engine", default="auto", help="I/O engine of the store: auto, uring, psync (default auto)")
    p.add_argument("--io-threads", type=int, default=4, help="psync engine threads (default 4)")
    p.add_argument("--cache-drop", choices=("auto", "drop_caches", "fadvise"), default="auto",
                   help="how cold reads bypass the page cache (default auto: drop_caches if permitted)")
    p.add_argument("--skip", choices=("dram", "nvme"), action="append", default=[], help="skip a tier")
    args = p.parse_args(argv)
    args.size = parse_size(args.size, field="--size")
    args.block = parse_size(args.block, field="--block")
    if args.block < 16 or args.size < args.block:
        p.error("--size must hold at least one --block of at least 16 bytes")
    if args.repeats < 1 or args.batch < 1 or args.io_threads < 1:
        p.error("--repeats, --batch and --io-threads must be positive")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    n = args.size // args.block
    parent = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gdskv-bench-", dir=parent))
    try:
        dropper = CacheDropper(args.cache_drop)
        print_banner(args, root, dropper, n)
        blocks = Blocks(n, args.block, args.seed)
        res = Results(n * args.block)
        bad: List[int] = []
        stats = None
        if "dram" not in args.skip:
            bad += dram_passes(blocks, res, args.repeats, root, chunked(n, args.block))
        if "nvme" not in args.skip:
            nvme = NvmePass(blocks, root, dropper, args)
            for r in range(args.repeats):
                wrong, stats = nvme.run(res, verify=(r == args.repeats - 1))
                bad += wrong
        print()
        met = print_table(res, args.batch)
        print_spread(res)
        if stats is not None:
            print_store_stats(stats)
        print()
        if bad:
            print(f"FAIL: {len(bad)} blocks read back wrong (first: {bad[:5]})")
            return 1
        print(f"verified: every block read back byte-exact; targets {'all met' if met else 'NOT all met'}")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
