"""Does the SSD data path run at the device's speed? gdskv's backends x I/O engines against fio.

For each engine x backend, through the backend API (the layer that puts objects on NVMe):

- write N objects of each size (256 KiB, 2 MiB, 16 MiB by default; ``--size`` bytes of
  each), in batches as the offloader does, durably (the backend's fsyncs included);
- the same into a tier that is full (``write full``: a store of a quarter of those bytes,
  filled first past its cap, so that every batch evicts older objects and the store's first
  eviction is behind it: a cache's steady state);
- cold-read them all in random order, ``--qd`` objects per batch (O_DIRECT, so nothing
  comes from the page cache; a buffered engine's files are dropped from it first), each
  read right after a fio read of its own, both after gdskv's write (``--read-pairs N``:
  N such pairs per store written);
- 4 KiB random reads of ``--rand-objects`` small objects, 64 per batch (``--rand-qd``);
  the random batches are drawn before the clock starts (fio draws its offsets at no cost
  worth counting), so the time is gdskv's reading and verifying. The ``psync`` engine runs
  as many reads at once as it has threads (the waiting caller here is the main thread,
  which runs none): after the table its 4 KiB figures are also compared, without a
  target, with fio's ``psync`` engine running that many jobs.

In the same run fio measures the same block size, queue depth and filesystem (io_uring,
O_DIRECT, a file of the same size), and each gdskv figure is printed as a ratio of fio's:
``write`` against fio writing a new file, ``write full`` (whose backends overwrite the
files of evicted objects) against fio overwriting a file it wrote, reads against reads.
Each gdskv run is paired with a fio run of the same operation taken before it (fio's
writes right before gdskv's writes, each fio read right before a gdskv read; once per
engine x backend and repeat, reads ``--read-pairs`` times), and its ratio is gdskv's
figure over that fio's: on a disk whose speed drifts within seconds (shared virtual disks
do), a ratio then compares two figures taken seconds apart, not a gdskv figure with a fio
one from another minute. Every repeat runs each engine x backend, in an order rotated
from one repeat to the next; the table shows the medians of the figures and of the paired ratios (every repeat's
figure and ratio is printed after it), and then how far fio's runs of one operation differ
from one another: the noise a single ratio carries on this disk. Each large read is also
paired with fio reading and checking its own data (``--verify=crc32c``, right before fio's
plain read): fio's CPU then reads every byte it read, as gdskv's copy and checksum do, and
on a virtual disk reads into memory the CPU reads can fall into a slow mode that fio's
plain read never sees (``benchmarks/bench_read_touch.py``, docs/notes/read-slow-mode.md).
Those ratios are printed
after the table, without a target.
Targets: objects >= 1 MiB through ``uring`` >= 0.9x fio (read and write); the batched
4 KiB path >= 0.5x fio's IOPS. A target is checked only against a fair fio: on huge pages
like gdskv's memory (``--fio-mem``), and not where the filesystem refused gdskv O_DIRECT.
fio is installed from the distribution's packages when it is missing
(``--no-fio-install`` skips that); without it only absolute numbers are printed.

A finished run's store is not deleted before the next run: its files are truncated, and
deleted at the end (:class:`RetiredStores`: on ext4 without a journal, files made within a
minute of deleting many are slow to make, which would charge one run for the last).

Values are written from an arena laid out like the DRAM tier's (``--value-align dram``:
64-byte aligned, page-aligned from 64 KiB, so a large value's whole pages go to the disk
straight from it; ``--value-align 64`` puts every value 64 bytes past a page boundary, so
every byte is copied through the engines' staging). Reads land in buffers aligned as
``--out-align`` says (default 64 bytes, like numpy arrays), so the engines' bounce path is
what is measured there.

    python benchmarks/bench_io.py --size 1GiB --dir /var/tmp/gdskv-bench
"""

from __future__ import annotations

import argparse
import atexit
import functools
import itertools
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from gdskv.config import format_size, parse_size
from gdskv.errors import GdskvError
from gdskv.gds import make_engine
from gdskv.gds.aligned import is_direct_fd, transparent_huge_pages
from gdskv.gds.engine import IoRequest
from gdskv.gds.probe import fs_type
from gdskv.tiers.backends import make_backend
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.dram import alloc_arena, value_alignment

MiB = 1 << 20
TARGET_LARGE = 0.9
TARGET_SMALL = 0.5


# --------------------------------------------------------------------------- fio


def ensure_fio(install: bool) -> Optional[str]:
    """Path of fio, installing the distribution's package first if asked and possible."""
    found = shutil.which("fio")
    if found or not install:
        return found
    apt = shutil.which("apt-get")
    if apt and os.geteuid() == 0:
        print("# fio not found: apt-get install -y fio", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run([apt, "install", "-y", "-q", "fio"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not shutil.which("fio"):  # stale package lists
            subprocess.run([apt, "update", "-q"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run([apt, "install", "-y", "-q", "fio"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return shutil.which("fio")


def fio_run(
    fio: str, directory: Path, *, rw: str, bs: int, qd: int, size: int, direct: bool, ios: Optional[int] = None,
    mem: str = "malloc", fresh: bool = True, ioengine: str = "io_uring", jobs: int = 1, checked: bool = False,
    seconds: Optional[float] = None,
) -> float:
    """One fio job over a file of ``size`` bytes; returns bytes/s, or IOPS for 4 KiB blocks.
    ``ios``: that many I/Os (the same count gdskv does), spread over the file as needed.
    ``mem``: fio's ``--mem`` (where its I/O buffers live: see :class:`FioMemory`).
    A write goes to a fresh file (fio preallocates it), as the backends write new files into
    a new store; with ``fresh=False`` it overwrites the file the last write left, whose
    blocks are all written: the peer of writing into a full tier, which reuses the files
    of evicted objects (:func:`gdskv.tiers.backends.files.fit_reused_file`).
    ``ioengine``/``jobs``: fio's engine and its number of jobs (processes) on the file; the
    figure is their sum, and ``ios`` is shared among them.
    ``checked``: fio's own checksums (``--verify=crc32c``), on a file of its own
    (``fio-checked.dat``): a write puts a header and a CRC32C in every block, and a read
    checks every block it reads (fio's CPU then reads every byte, as gdskv's checksum
    does) and fails on one not written so. A checked read needs a checked write of the
    same block size first. ``seconds``: run for that long (over the file again as needed)
    instead of to the end of the file or of ``ios``."""
    target = directory / ("fio-checked.dat" if checked else "fio.dat")
    if rw == "write" and fresh and target.exists():
        target.unlink()
    cmd = [
        fio, "--name=gdskv", f"--filename={target}", f"--size={size}", f"--bs={bs}", f"--rw={rw}",
        f"--iodepth={qd}", f"--ioengine={ioengine}", f"--direct={int(direct)}", "--output-format=json",
        "--randrepeat=0", "--group_reporting", f"--mem={mem}", f"--numjobs={jobs}",
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    if checked:
        # (--verify_state_save=0: no state file of fio's left in the working directory)
        cmd += ["--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0"] + (["--do_verify=0"] if rw == "write" else [])
    if seconds:
        cmd += [f"--runtime={seconds:g}", "--time_based"]
    if ios:
        # A random job ends once it has covered the file; ask for as many I/Os as gdskv
        # does (a file of 8192 blocks read once is a short, coarse baseline).
        cmd.append(f"--io_size={ios // jobs * bs}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed: {done.stderr.strip() or done.stdout.strip()}")
    job = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return float(side["iops"]) if bs == 4096 else float(side["bw_bytes"])


def meminfo(field: str) -> int:
    """A /proc/meminfo figure (a count, or bytes for a kB figure); 0 when absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == field:
                parts = rest.split()
                return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0


class FioMemory:
    """Where fio's I/O buffers live, so that fio is measured on the same kind of memory as
    gdskv (the DRAM arena is on transparent huge pages).

    On a virtual disk an O_DIRECT request costs per scatter-gather segment, and a buffer on
    4 KiB pages is one segment per page: fio's default buffers (``--mem=malloc``) make fio
    slower than the device, and gdskv's ratios would flatter it. fio can only put its
    buffers on hugetlb pages (``--mem=shmhuge``), which must be reserved
    (``vm.nr_hugepages``) and which SysV shared memory may only lock for root, members of
    ``vm.hugetlb_shm_group`` or a large enough ``RLIMIT_MEMLOCK``. ``mode``:

    - ``auto``: huge pages when enough are free and allowed, else fio's default (the header
      says which, and why);
    - ``huge``: huge pages; as root, reserves what is missing for the run and gives it back
      at the end (:meth:`restore`, also on SIGTERM); otherwise an error before the run;
    - ``malloc``: fio's default.

    ``need_bytes``: the largest buffer memory of any fio job of the run (queue depth x block).
    """

    def __init__(self, mode: str, need_bytes: int) -> None:
        self.mode = mode
        self.page = meminfo("Hugepagesize") or (2 << 20)
        # fio rounds its buffer memory (plus alignment) up to whole huge pages; keep a margin.
        self.need = -(-need_bytes // self.page) + 4
        self._reserved_from: Optional[int] = None
        self.why = "as asked"
        allowed, who = self._may_lock(need_bytes)
        free = self._free()
        if mode == "huge":
            if not allowed:
                raise SystemExit(f"--fio-mem huge: fio may not lock huge pages here ({who})")
            if free < self.need:
                self._reserve(free)
                free = self._free()
        self.huge = mode != "malloc" and allowed and free >= self.need
        if mode == "auto" and not self.huge:
            self.why = who if not allowed else f"{self.need} free huge pages needed, {free} free"
        self.option = "shmhuge" if self.huge else "malloc"

    @staticmethod
    def _free() -> int:
        """Huge pages free and not promised to a mapping already."""
        return meminfo("HugePages_Free") - meminfo("HugePages_Rsvd")

    @staticmethod
    def _may_lock(nbytes: int) -> "tuple[bool, str]":
        """Whether fio may create huge-page shared memory here, and who decides."""
        if os.geteuid() == 0:
            return True, "root"
        try:
            group = int(Path("/proc/sys/vm/hugetlb_shm_group").read_text())
            if group in (os.getegid(), *os.getgroups()):
                return True, "member of vm.hugetlb_shm_group"
        except (OSError, ValueError):
            pass
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        if soft == resource.RLIM_INFINITY or soft >= nbytes:
            return True, "RLIMIT_MEMLOCK"
        return False, "not root, not in vm.hugetlb_shm_group, RLIMIT_MEMLOCK too small"

    def _reserve(self, free: int) -> None:
        """Raise vm.nr_hugepages by what is missing (root); restored by :meth:`restore`."""
        if os.geteuid() != 0:
            raise SystemExit(f"--fio-mem huge: {self.need} huge pages needed, {free} free; "
                             f"reserve them (sysctl vm.nr_hugepages) or run as root")
        total = meminfo("HugePages_Total")
        self._reserved_from = total  # before the write: restore() undoes even a partial one
        try:
            Path("/proc/sys/vm/nr_hugepages").write_text(str(total + self.need - free))
        except OSError as exc:
            self._reserved_from = None
            raise SystemExit(f"--fio-mem huge: cannot reserve huge pages: {exc}") from None
        if self._free() < self.need:
            got = self._free()
            self.restore()
            raise SystemExit(f"--fio-mem huge: the kernel found only {got} of {self.need} huge pages")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so restore() runs

    def describe(self) -> str:
        if self.huge:
            return f"on huge pages (--mem=shmhuge, {self.need} of {self.page >> 20} MiB), like gdskv's arena"
        return (f"on 4 KiB pages (--mem=malloc; {self.why}): gdskv's arena asks for huge pages, so its ratios may flatter it; "
                f"--fio-mem huge reserves huge pages for fio")

    def restore(self) -> None:
        """Give back the huge pages reserved for this run, if any."""
        if self._reserved_from is not None:
            try:
                Path("/proc/sys/vm/nr_hugepages").write_text(str(self._reserved_from))
            except OSError as exc:
                print(f"# could not give back the huge pages reserved for fio (vm.nr_hugepages={self._reserved_from}): {exc}",
                      file=sys.stderr)
            self._reserved_from = None


# --------------------------------------------------------------------------- gdskv side


class Arena:
    """``count`` values of ``size`` bytes in one allocation.

    The memory is allocated as the DRAM tier's arena is (:func:`gdskv.tiers.dram.alloc_arena`:
    huge pages where the kernel allows). ``placement="dram"``: where the DRAM tier puts
    values (:func:`gdskv.tiers.dram.value_alignment`: 64-byte aligned, page-aligned from
    64 KiB), after a 64-byte value, so that nothing is page-aligned by accident. ``"64"``:
    every value 64 bytes past a page boundary, so every O_DIRECT write of it goes through
    the engines' staging.
    """

    def __init__(self, count: int, size: int, seed: int, placement: str = "dram") -> None:
        if placement == "dram":
            align = value_alignment(size)
            self.first = max(align, 128)  # the first free offset after a 64-byte value at 0
            self.stride = -(-size // align) * align
        else:
            self.first = 64
            self.stride = -(-(size + 64) // 4096) * 4096
        self.map, _ = alloc_arena(self.first + self.stride * count + 4096)
        self.arr = np.frombuffer(self.map, dtype=np.uint8)
        self.size = size
        rng = np.random.default_rng(seed)
        self.arr[:] = rng.integers(0, 256, self.arr.size, dtype=np.uint8)

    def view(self, i: int) -> memoryview:
        start = self.first + i * self.stride
        return memoryview(self.arr[start : start + self.size])


def out_buffers(count: int, size: int, align: str) -> Tuple[memoryview, List[memoryview]]:
    """Destination buffers, page-aligned or 64 bytes past a page boundary, in one numpy
    array (the memory a caller's arrays live in). Returns that array's memory and the
    buffers."""
    pad = 0 if align == "page" else 64
    stride = -(-(size + pad) // 4096) * 4096
    area = np.empty(stride * count + 4096, dtype=np.uint8)
    first = -area.ctypes.data % 4096
    return memoryview(area), [memoryview(area[first + i * stride + pad : first + i * stride + pad + size]) for i in range(count)]


def warm_memory(engine, directory: Path, *areas: memoryview) -> bool:
    """Move every page-aligned 2 MiB piece of ``areas`` through one O_DIRECT write to a
    scratch file in ``directory`` and one read back (the bytes stay as they were), before
    anything is timed. The first O_DIRECT transfer of memory that never took part in one
    can run slower than every later one, also after the CPU rewrote that memory
    (docs/notes/odirect-memory.md); a store's DRAM arena pays that once in its life, and
    fio's buffers come from the same reserved huge pages run after run. Returns whether the
    scratch file took O_DIRECT (a filesystem may refuse it: the memory then went through the
    page cache)."""
    scratch = directory / "warm.tmp"
    fd = engine.open_file(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    direct = is_direct_fd(fd)
    try:
        for area in areas:
            start = -np.frombuffer(area, np.uint8).ctypes.data % 4096  # the first page boundary
            end = start + (area.nbytes - start) // 4096 * 4096  # the last one
            pieces = [area[pos : min(pos + (2 << 20), end)] for pos in range(start, end, 2 << 20)]
            os.ftruncate(fd, sum(piece.nbytes for piece in pieces))
            offsets = list(itertools.accumulate((piece.nbytes for piece in pieces), initial=0))
            engine.run([IoRequest.write(fd, offset, piece) for offset, piece in zip(offsets, pieces)])
            engine.run([IoRequest.read(fd, offset, piece) for offset, piece in zip(offsets, pieces)])
    finally:
        os.close(fd)
        scratch.unlink()
    return direct


def drop_cache(directory: Path) -> None:
    """Evict a buffered engine's files from the page cache (O_DIRECT needs nothing)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def open_backend(name: str, directory: Path, engine, capacity: int):
    """A fresh backend ``name`` in ``directory``; ``file_per_key/<mode>`` is the
    file_per_key backend with that sync mode."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    kind, _, sync = name.partition("/")
    options = {"sync": sync} if sync else {}
    backend = make_backend(kind, directory, engine, capacity=capacity, eviction="fifo", verify_on_open="index", **options)
    backend.recover()
    return backend


class RetiredStores:
    """Where the stores of finished runs go: their files are truncated at once (their disk
    space comes back) and deleted only at the end of the run (:meth:`clear`).

    On ext4 without a journal the inode allocator passes over every inode freed less than a
    minute ago (five more while its inode table block is dirty), testing them one by one
    (the kernel's ``recently_deleted()``), so a file made within a minute of deleting a few
    thousand is many times slower to make. Deleting the last run's store at once (a
    ``file_per_key`` store of 2 MiB objects is 256 files, of 256 KiB 2048) would charge the
    next store's writes for what the benchmark did before them; fio's peer makes one file.
    A retired store keeps its inodes in use: the allocator passes over those in its bitmap,
    without looking at each one (figures: docs/notes/file-per-key-and-filesystem.md)."""

    def __init__(self, base: Path) -> None:
        #: A directory of this run's own (what a killed run left in ``base`` is not in the way).
        self.dir = Path(tempfile.mkdtemp(prefix="retired-stores-", dir=base))
        self.count = 0

    def retire(self, store: Path) -> None:
        """Truncate every file under ``store`` and move ``store`` out of the way."""
        for path in store.rglob("*"):
            if path.is_file() and not path.is_symlink():
                os.truncate(path, 0)
        store.rename(self.dir / str(self.count))
        self.count += 1

    def clear(self) -> None:
        """Delete every retired store."""
        shutil.rmtree(self.dir, ignore_errors=True)


def gdskv_write(backend, arena: Arena, keys: Sequence[bytes], batch_bytes: int, evicting: bool = False) -> float:
    """Write every object in batches of about ``batch_bytes``; returns bytes/s. Unless
    ``evicting``, a write that evicts anything is an error (the capacity is too small)."""
    items = [(k, arena.view(i), 0) for i, k in enumerate(keys)]
    items = [(k, v, checksum(k, v)) for k, v, _ in items]
    per_batch = max(1, batch_bytes // arena.size)
    t0 = time.perf_counter()
    for start in range(0, len(items), per_batch):
        evicted = backend.write(items[start : start + per_batch])
        if evicted and not evicting:
            raise RuntimeError("the benchmark's NVMe capacity is too small: objects were evicted")
    return len(items) * arena.size / (time.perf_counter() - t0)


def gdskv_write_full(name: str, work: Path, engine, arena: Arena, keys: Sequence[bytes], batch_bytes: int,
                     retired: RetiredStores) -> float:
    """Write every object into a new store of ``name`` a quarter of their size (at least two
    batches) that a quarter of the objects and one batch more filled first, so that (with
    the default sizes) the fill's last batch is the store's first eviction and every batch
    timed evicts: a cache's steady state. (The first eviction of a store is not: a
    ``file_per_key`` store has no spare files to overwrite yet and creates its files.)
    Returns bytes/s of that second pass; the store is then retired."""
    total = len(keys) * arena.size
    backend = open_backend(name, work, engine, max(total // 4, 2 * batch_bytes) + (1 << 20))
    try:
        fill = max(1, len(keys) // 4) + max(1, batch_bytes // arena.size)
        gdskv_write(backend, arena, [b"fill-" + k for k in keys[:fill]], batch_bytes, evicting=True)
        return gdskv_write(backend, arena, keys, batch_bytes, evicting=True)
    finally:
        backend.close()
        retired.retire(work)


def gdskv_read(backend, keys: Sequence[bytes], size: int, qd: int, outs: List[memoryview], seed: int) -> float:
    """Read every object once, in random order, ``qd`` per batch; returns bytes/s."""
    order = list(keys)
    random.Random(seed).shuffle(order)
    t0 = time.perf_counter()
    for start in range(0, len(order), qd):
        batch = order[start : start + qd]
        got = backend.read_batch(list(zip(batch, outs)))
        if any(n != size for n in got):
            raise RuntimeError("a read missed or failed verification")
    return len(order) * size / (time.perf_counter() - t0)


def gdskv_rand4k(backend, keys: Sequence[bytes], ops: int, qd: int, outs: List[memoryview], seed: int) -> float:
    """``ops`` reads of random 4 KiB objects, ``qd`` per batch; returns IOPS. The batches
    are drawn before the clock starts, as fio draws its offsets with a generator that costs
    next to nothing: what is timed is gdskv reading and verifying them."""
    rng = random.Random(seed)
    batches = []
    for start in range(0, ops, qd):
        batches.append([(keys[rng.randrange(len(keys))], out) for out in outs[: min(qd, ops - start)]])
    t0 = time.perf_counter()
    for batch in batches:
        got = backend.read_batch(batch)
        if any(n != 4096 for n in got):
            raise RuntimeError("a 4 KiB read missed or failed verification")
    return ops / (time.perf_counter() - t0)


# --------------------------------------------------------------------------- report


def fmt_ratio(ratio: Optional[float]) -> str:
    """``ratio`` with two decimals, rounded down: a figure below a target never prints as
    the target itself ("0.50x ... MISSED")."""
    return "-" if ratio is None else f"{math.floor(round(ratio * 100, 6)) / 100:.2f}x"


def rotated(items: Sequence, shift: int) -> list:
    shift %= max(1, len(items))
    return list(items[shift:]) + list(items[:shift])


def open_engines(names: Sequence[str], base: Path) -> Dict[str, object]:
    """The engines to measure, O_DIRECT where the filesystem allows; unavailable ones are
    reported and skipped."""
    engines = {}
    for name in names:
        try:
            engine = make_engine(name, direct=True, directory=base)
        except (GdskvError, OSError) as exc:
            print(f"# engine {name}: unavailable ({exc}); skipped")
            continue
        engines[name] = engine
        described = engine.describe()
        print(f"# engine {name}: " + ", ".join(f"{k}={v}" for k, v in described.items() if k != "name"))
    return engines


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{cpu}, {os.cpu_count()} cores, {format_size(mem)} RAM, Linux {platform.release()}"


def device_of(directory: Path) -> str:
    dev = os.stat(directory).st_dev
    name = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[2] == name:
                return fields[fields.index("-") + 2]
    except (OSError, ValueError, IndexError):
        pass
    return name


def median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fio_self_ratios(samples: Dict[tuple, List[float]]) -> Dict[Tuple[str, int], List[float]]:
    """For each fio operation and block size run more than once, each run's figure over the
    figure of the run before it: how far two fio runs seconds apart differ with nothing else
    changed, the noise in every paired ratio."""
    out: Dict[Tuple[str, int], List[float]] = {}
    for key, values in samples.items():
        if key[0] == "fio" and len(values) > 1:
            out[(key[1], key[-1])] = [after / before for before, after in zip(values, values[1:])]
    return out


def fmt_rate(value: float, small: bool) -> str:
    return f"{value / 1000:.1f}k IOPS" if small else f"{value / MiB:.0f} MiB/s"


def add_fio_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that measure against fio on one filesystem: ``--dir``,
    ``--no-fio-install`` and ``--fio-mem`` (shared by bench_read_staging, bench_read_touch)."""
    p.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temp dir in /var/tmp)")
    p.add_argument("--no-fio-install", action="store_true", help="do not apt-get install fio when it is missing")
    p.add_argument("--fio-mem", choices=("auto", "huge", "malloc"), default="auto",
                   help="fio's buffers: on huge pages like gdskv's arena when enough are free (auto), always (huge: "
                        "as root, reserves them for the run), or fio's default malloc (default auto)")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_fio_arguments(p)
    p.add_argument("--size", default="512MiB", help="bytes written and read per object size (default 512MiB; more makes "
                        "each run longer, so a slow second of the disk weighs less on it)")
    p.add_argument("--sizes", default="256KiB,2MiB,16MiB", help="object sizes (default 256KiB,2MiB,16MiB)")
    p.add_argument("--engines", default="uring,psync")
    p.add_argument("--backends", default="bucket,offset,file_per_key",
                   help="backends to measure (default bucket,offset,file_per_key); file_per_key/file is "
                        "file_per_key syncing file by file instead of the filesystem at once")
    p.add_argument("--qd", type=int, default=16, help="objects per read batch for large objects (default 16)")
    p.add_argument("--batch", default="64MiB", help="bytes per write batch (default 64MiB, the bucket size)")
    p.add_argument("--rand-objects", type=int, default=8192, help="4 KiB objects for random reads (default 8192)")
    p.add_argument("--rand-ops", type=int, default=40000, help="4 KiB reads per run (default 40000)")
    p.add_argument("--rand-qd", type=int, default=64, help="4 KiB reads per batch (default 64)")
    p.add_argument("--out-align", choices=("64", "page"), default="64", help="alignment of read buffers (default 64)")
    p.add_argument("--value-align", choices=("dram", "64"), default="dram",
                   help="where written values sit: as the DRAM tier places them, or all 64 bytes past a page (default dram)")
    p.add_argument("--repeat", type=int, default=5, help="runs per figure; the median is printed (default 5: on a disk whose speed drifts, a median "
                        "of three paired ratios moved too far between two runs of the same code)")
    p.add_argument("--read-pairs", type=int, default=1,
                   help="fio and gdskv reads, one after the other, per store written (default 1); more give each read "
                        "ratio more pairs, taken closer together")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.read_pairs < 1 or args.repeat < 1:
        p.error("--repeat and --read-pairs must be at least 1")

    total = parse_size(args.size, field="--size")
    sizes = [parse_size(s, field="--sizes") for s in args.sizes.split(",")]
    batch_bytes = parse_size(args.batch, field="--batch")
    engine_names = args.engines.split(",")
    backends = args.backends.split(",")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gdskv-bench-io-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    fio = ensure_fio(not args.no_fio_install)

    print("# bench_io: gdskv backends x I/O engines against fio")
    print(f"# machine: {machine()}")
    print(f"# filesystem: {fs_type(base)} on {device_of(base)} at {base}")
    fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip() if fio else None
    print(f"# fio: {fio_version or 'not available: absolute numbers only, no ratios'}")
    rand_size = args.rand_objects * 4096
    fio_buffers = max(args.qd * max(sizes), 8 * min(MiB, rand_size), args.rand_qd * 4096)  # its largest job
    fio_mem = FioMemory(args.fio_mem if fio else "malloc", fio_buffers)
    atexit.register(fio_mem.restore)  # at the end, on an error, and on SIGTERM (see FioMemory)
    if fio:
        print(f"# fio buffers: {fio_mem.describe()}")
    print(f"# python {platform.python_version()}, numpy {np.__version__}; read buffers aligned to {args.out_align}; "
          f"values placed {'as the DRAM tier does' if args.value_align == 'dram' else '64 bytes past a page'}, "
          f"in memory allocated as the DRAM tier's arena (transparent huge pages: {transparent_huge_pages() or 'none'})")
    print(f"# {format_size(total)} per object size; large reads {args.qd}/batch; writes {format_size(batch_bytes)}/batch; "
          f"4 KiB: {args.rand_objects} objects, {args.rand_ops} reads, {args.rand_qd}/batch; median of {args.repeat}"
          + (f" (large reads: of {args.repeat * args.read_pairs}, {args.read_pairs} pairs per store written)" if args.read_pairs > 1 else ""))
    print("# a finished run's store is truncated, and deleted at the end: files made within a minute of deleting "
          "many are slow to make on ext4 without a journal (RetiredStores)")

    engines = open_engines(engine_names, base)
    warmer = next(iter(engines.values()), None)  # moves the values' memory once before the clock (warm_memory)
    capacity = max(sizes) * 4 + total * 2 + args.rand_objects * 16384
    fio_dir = base / "fio"
    fio_dir.mkdir(exist_ok=True)
    retired = RetiredStores(base)  # measured stores, deleted at the end (see RetiredStores)
    fio_job = functools.partial(fio_run, fio, fio_dir, direct=True, mem=fio_mem.option)  # O_DIRECT, as gdskv
    samples: Dict[tuple, List[float]] = {}
    ratios: Dict[tuple, List[float]] = {}  # gdskv's figure over its paired fio's, by gdskv key
    small: Dict[tuple, object] = {}  # the 4 KiB data sets, by (engine, backend)
    # What one repeat runs: each engine x backend, each right after its fio peers; every
    # repeat starts one step further along this list, so no run always follows the same
    # neighbour (a big write leaves the disk busy flushing for a while).
    runs = [(e, b) for e in engines for b in backends]
    # A backend's variant (file_per_key/file) only syncs differently: its 4 KiB reads are
    # its backend's. (Each 4 KiB data set of file_per_key keeps its 8192 files open.)
    rand_backends = [b for b in backends if "/" not in b]
    rand_runs = [(e, b) for e, b in runs if b in rand_backends]

    def add(key: tuple, value: float) -> None:
        samples.setdefault(key, []).append(value)

    def add_ratio(key: tuple, value: float, peer: Optional[float]) -> None:
        """``value``'s ratio to ``peer``, fio's figure taken right before it (none without fio)."""
        if peer:
            ratios.setdefault(key, []).append(value / peer)

    def add_paired(key: tuple, value: float, peer: Optional[float]) -> None:
        """A gdskv figure and its ratio to ``peer`` (:func:`add_ratio`)."""
        add(key, value)
        add_ratio(key, value, peer)

    try:
        # Large objects. Every repeat measures every engine x backend, each right after fio
        # does the same operations, so that a ratio compares figures taken seconds apart.
        for size in sizes:
            n = max(1, total // size)
            arena = Arena(n, size, args.seed + size, args.value_align)
            keys = [f"obj-{size}-{i}".encode() for i in range(n)]
            out_area, outs = out_buffers(args.qd, size, args.out_align)
            if warmer is not None and warm_memory(warmer, base, memoryview(arena.map), out_area) and size == sizes[0]:
                print("# values and read buffers moved by O_DIRECT once before the timed runs, as a store's memory is after its first pass")
            if fio:  # the file fio's checked reads read (untimed: its writes carry fio's checksums)
                fio_job(rw="write", bs=size, qd=args.qd, size=n * size, checked=True)
            for r in range(args.repeat):
                for engine_name, backend_name in rotated(runs, r):
                    peer: Dict[str, Optional[float]] = {"write": None, "write full": None}
                    if fio:
                        peer["write"] = fio_job(rw="write", bs=size, qd=args.qd, size=n * size)
                        peer["write full"] = fio_job(rw="write", bs=size, qd=args.qd, size=n * size, fresh=False)
                        for op, value in peer.items():
                            add(("fio", op, size), value)  # type: ignore[arg-type]
                    engine = engines[engine_name]
                    work = base / f"{engine_name}-{backend_name.replace('/', '-')}"  # (a variant's name has a /)
                    backend = open_backend(backend_name, work, engine, capacity)
                    try:
                        add_paired((engine_name, backend_name, "write", size), gdskv_write(backend, arena, keys, batch_bytes), peer["write"])
                        # Each read right after a fio read of its own (of the file fio wrote), both
                        # after gdskv's write of the store: the two are a second or so apart.
                        # (fio's checked read first, so that its plain read stays right before gdskv's.)
                        for again in range(args.read_pairs):
                            peer_checked = peer_read = None
                            if fio:
                                peer_checked = fio_job(rw="randread", bs=size, qd=args.qd, size=n * size, checked=True)
                                add(("fio", "read checked", size), peer_checked)
                                peer_read = fio_job(rw="randread", bs=size, qd=args.qd, size=n * size)
                                add(("fio", "read", size), peer_read)
                            if not engine.direct or engine.direct_refused:
                                drop_cache(work)
                            got = gdskv_read(backend, keys, size, args.qd, outs, args.seed + r * args.read_pairs + again)
                            add_paired((engine_name, backend_name, "read", size), got, peer_read)
                            # (a ratio only: the figure is the read row's)
                            add_ratio((engine_name, backend_name, "read checked", size), got, peer_checked)
                    finally:
                        backend.close()
                    retired.retire(work)
                    add_paired((engine_name, backend_name, "write full", size),
                               gdskv_write_full(backend_name, work, engine, arena, keys, batch_bytes, retired),
                               peer["write full"])
            del arena, outs, out_area

        # 4 KiB random reads: one data set per engine x backend, written once, read each repeat.
        arena = Arena(args.rand_objects, 4096, args.seed, args.value_align)
        keys = [f"small-{i}".encode() for i in range(args.rand_objects)]
        out_area, outs = out_buffers(args.rand_qd, 4096, args.out_align)
        if warmer is not None:
            warm_memory(warmer, base, memoryview(arena.map), out_area)
        for engine_name, engine in engines.items():
            for backend_name in rand_backends:
                work = base / f"small-{engine_name}-{backend_name}"
                backend = small[(engine_name, backend_name)] = open_backend(backend_name, work, engine, capacity)
                gdskv_write(backend, arena, keys, batch_bytes)
                if not engine.direct or engine.direct_refused:
                    drop_cache(work)
        if fio:
            fio_job(rw="write", bs=min(MiB, rand_size), qd=8, size=rand_size)
        for r in range(args.repeat):
            for engine_name, backend_name in rotated(rand_runs, r):
                rand_peer = psync_peer = None
                if fio:
                    rand_peer = fio_job(rw="randread", bs=4096, qd=args.rand_qd, size=rand_size, ios=args.rand_ops)
                    add(("fio", "rand", 4096), rand_peer)
                    if engine_name == "psync":  # the like-for-like peer of a thread pool (see the notes after the table)
                        psync_peer = fio_job(rw="randread", bs=4096, qd=1, size=rand_size, ios=args.rand_ops,
                                             ioengine="psync", jobs=engines["psync"].threads)
                        add(("fio", "rand psync", 4096), psync_peer)
                backend = small[(engine_name, backend_name)]
                got = gdskv_rand4k(backend, keys, args.rand_ops, args.rand_qd, outs, args.seed + r)
                add_paired((engine_name, backend_name, "rand", 4096), got, rand_peer)
                add_ratio(("psync", backend_name, "rand psync", 4096), got, psync_peer)  # (the figure is the row above's)
    finally:
        for backend in small.values():
            backend.close()
        refused = {name: engine.direct_refused for name, engine in engines.items()}
        for engine in engines.values():
            engine.close()
        for engine_name, backend_name in small:  # a given --dir keeps only what was there
            shutil.rmtree(base / f"small-{engine_name}-{backend_name}", ignore_errors=True)
        shutil.rmtree(fio_dir, ignore_errors=True)
        retired.clear()

    rows = []
    for engine_name in engines:
        for backend_name in backends:
            for size in sizes:
                n = max(1, total // size)
                for op in ("write", "read", "write full"):
                    key = (engine_name, backend_name, op, size)
                    ref = median(samples[("fio", op, size)]) if fio else None
                    rows.append((engine_name, backend_name, size, op, n, median(samples[key]), ref, median(ratios[key]) if fio else None))
            if backend_name not in rand_backends:
                continue
            key = (engine_name, backend_name, "rand", 4096)
            ref = median(samples[("fio", "rand", 4096)]) if fio else None
            rows.append((engine_name, backend_name, 4096, "rand read", args.rand_ops, median(samples[key]), ref,
                         median(ratios[key]) if fio else None))

    # A verdict needs a fair peer: fio on the kind of memory gdskv uses, and gdskv's files
    # really O_DIRECT (a refusal is counted as files are opened, so it is known only now).
    no_verdict = {}
    for engine_name, count in refused.items():
        if count:
            print(f"# engine {engine_name}: the filesystem refused O_DIRECT for {count} files (buffered I/O, "
                  f"page cache dropped before reads): no verdicts")
            no_verdict[engine_name] = "n/a: O_DIRECT refused"
    fio_fair = fio_mem.huge
    print()
    print("# ratios are rounded down to two decimals (0.497x prints as 0.49x), as the targets are checked")
    print("# write: into a new store, against fio writing a new file; write full: into a full tier (evicting), "
          "against fio overwriting a written file")
    print("# gdskv, fio: medians of the figures; ratio: median of each gdskv run over the fio run taken right before it")
    if fio and not fio_fair:
        print("# fio's buffers are on 4 KiB pages, which makes fio slower than the device here: no verdicts "
              "(--fio-mem huge puts them on huge pages)")
    head = f"{'engine':<7} {'backend':<13} {'object':>8} {'op':<10} {'count':>6} {'gdskv':>14} {'fio':>14} {'ratio':>6}  target"
    print(head)
    print("-" * len(head))
    for engine_name, backend_name, size, op, n, value, fio_value, ratio in rows:
        small = op == "rand read"
        target = TARGET_SMALL if small else (TARGET_LARGE if size >= MiB and engine_name == "uring" else None)
        verdict = "" if target is None or ratio is None else f">= {target:.1f}x {'met' if ratio >= target else 'MISSED'}"
        if verdict and (engine_name in no_verdict or not fio_fair):
            verdict = no_verdict.get(engine_name, "n/a: fio on 4 KiB pages")
        print(
            f"{engine_name:<7} {backend_name:<13} {format_size(size):>8} {op:<10} {n:>6} {fmt_rate(value, small):>14} "
            f"{fmt_rate(fio_value, small) if fio_value else '-':>14} {fmt_ratio(ratio):>6}  {verdict}"
        )
    if fio and "psync" in engines:
        peer = median(samples[("fio", "rand psync", 4096)])
        jobs = engines["psync"].threads
        print()
        print(f"# psync runs at most {jobs} 4 KiB reads at a time here (one per pool thread; the waiting caller is the main "
              f"thread, which runs none), so a queue depth of {args.rand_qd} is out of its reach. Against fio's psync "
              f"engine with {jobs} jobs "
              f"({fmt_rate(peer, True)}, median; no target): "
              + ", ".join(f"{b} {fmt_ratio(median(ratios[('psync', b, 'rand psync', 4096)]))}" for b in rand_backends))
    if fio:
        print()
        print("# reads against fio reading and checking its data (--verify=crc32c), paired the same way (no target): "
              "fio's CPU then reads every byte it reads, as gdskv's checksum does (and its copy out of staging, where reads are staged). "
              "fio checked read, medians: "
              + ", ".join(f"{format_size(size)} {fmt_rate(median(samples[('fio', 'read checked', size)]), False)}" for size in sizes))
        for engine_name in engines:
            print(f"#   {engine_name}: " + "; ".join(
                f"{backend_name} " + " ".join(fmt_ratio(median(ratios[(engine_name, backend_name, 'read checked', size)])) for size in sizes)
                for backend_name in backends) + f"  ({', '.join(format_size(size) for size in sizes)})")
        floor = fio_self_ratios(samples)
        if floor:
            print()
            print("# fio against itself: each fio run over the run of the same operation before it (seconds apart), "
                  "lowest-highest (median): how far a ratio moves on this disk with nothing of gdskv in it")
            for (op, size), spread in floor.items():
                print(f"#   {'fio/fio ' + op:<30} {format_size(size):>9}: {fmt_ratio(min(spread))}-{fmt_ratio(max(spread))} "
                      f"({fmt_ratio(median(spread))}, {len(spread)} pairs)")
    print()
    print("# every run's figure (MiB/s; 4 KiB: IOPS) in the order they ran, and for gdskv its ratio to the fio run before it")
    for key, values in samples.items():
        small = key[-1] == 4096
        paired = ratios.get(key, [])
        print(f"#   {' '.join(str(k) for k in key[:-1]):<30} {format_size(key[-1]):>9}: "
              + ", ".join((f"{v:.0f}" if small else f"{v / MiB:.0f}") + (f" ({fmt_ratio(paired[i])})" if i < len(paired) else "")
                          for i, v in enumerate(values)))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
