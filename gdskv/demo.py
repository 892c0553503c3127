"""``gdskv demo``: the main job on the embedded store.

Opens a store in a temporary directory whose DRAM tier is much smaller than the data, writes
``--size`` bytes of ``--block``-sized KV blocks, flushes, reads every block back with
``get_into`` and verifies every byte. Then, as when sessions end, it removes the newest
blocks until DRAM has room, and reads a hot set of old, NVMe-only blocks twice: the first
pass promotes them into DRAM, the second is served from there. It prints where reads were
served from, bytes/s per tier, and what was offloaded, evicted, dropped and promoted. The
last line is ``PASS`` or ``FAIL``; the command exits 1 on any wrong byte or lost block.

Block ``i`` is the window of one random base buffer that starts at offset
``i * STRIDE mod span``: distinct for every block, free to generate, and cheap to verify.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

import gdskv
from gdskv.config import format_size, parse_size
from gdskv.errors import ConfigError

#: Odd stride between block windows of the base buffer (coprime with any power-of-two span).
STRIDE = 4099


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "demo",
        help="write and verify a few GB of KV blocks through a small DRAM tier onto SSD",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--size", default="3GiB", help="bytes of blocks to write (default 3GiB)")
    p.add_argument("--block", default="2MiB", help="block (value) size (default 2MiB)")
    p.add_argument("--dram", default="512MiB", help="DRAM tier capacity (default 512MiB)")
    p.add_argument("--ssd", default=None, help="NVMe tier cap (default: twice --size)")
    p.add_argument("--dir", default=None,
                   help="where to create the demo's temporary store directory, removed after (default: $TMPDIR)")
    p.add_argument("--seed", type=int, default=0, help="seed of the block contents (default 0)")
    p.add_argument(
        "--offload",
        default="watermark",
        help="offload policy: watermark (default here: offload, eviction and promotion all show) or eager",
    )
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------- blocks


class Blocks:
    """The demo's data set: ``count`` distinct blocks of ``size`` bytes from one base buffer."""

    def __init__(self, count: int, size: int, seed: int) -> None:
        self.count = count
        self.size = size
        self.span = 1 << max(20, (count - 1).bit_length())  # >= count distinct window starts
        self.base = np.random.default_rng(seed).integers(0, 256, size + self.span, dtype=np.uint8)

    def key(self, i: int) -> str:
        return f"demo/block-{i:08d}"

    def value(self, i: int) -> np.ndarray:
        start = (i * STRIDE) % self.span
        return self.base[start : start + self.size]

    def verify(self, i: int, out: np.ndarray, n: Optional[int]) -> bool:
        return n == self.size and np.array_equal(out, self.value(i))


# ---------------------------------------------------------------------------- run


@dataclasses.dataclass
class Phase:
    """One pass over some blocks: what it moved and where reads were served from."""

    name: str
    blocks: int
    nbytes: int
    seconds: float
    dram_hits: int = 0
    nvme_hits: int = 0
    misses: int = 0
    #: Blocks read back wrong (for "remove newest": removed blocks still found).
    wrong: int = 0
    #: Whether the phase read blocks (and the hit columns mean something).
    reads: bool = False

    @property
    def rate(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class DemoResult:
    phases: List[Phase]
    stats: Dict[str, Any]
    path: str

    @property
    def reads(self) -> List["Phase"]:
        return [p for p in self.phases if p.reads]

    @property
    def passed(self) -> bool:
        return bool(self.reads) and all(p.misses == 0 and p.wrong == 0 for p in self.phases)


def run_demo(
    path: Path,
    *,
    size: int,
    block: int,
    dram: int,
    ssd: int,
    seed: int = 0,
    offload: str = "watermark",
    progress: Optional[Callable[[str, int], Iterator[int]]] = None,
) -> DemoResult:
    """Write, flush, read back and verify; return the phases and the store's stats."""
    if block <= 0 or size < block:
        raise ConfigError("--size must hold at least one --block", size=size, block=block)
    if block > dram:
        raise ConfigError("--block must fit in the DRAM tier", block=block, dram=dram)
    n = size // block
    blocks = Blocks(n, block, seed)
    steps = progress or (lambda _label, total: iter(range(total)))
    out = np.empty(block, dtype=np.uint8)
    phases: List[Phase] = []
    with gdskv.open(path, dram=dram, ssd=ssd, offload=offload, put_timeout_s=120.0) as store:

        def read_pass(name: str, indices: List[int]) -> None:
            before = _counts(store.stats())
            wrong = 0
            t0 = time.perf_counter()
            for j in steps(name, len(indices)):
                i = indices[j]
                got = store.get_into(blocks.key(i), out)
                if not blocks.verify(i, out, got):
                    wrong += 1
            seconds = time.perf_counter() - t0
            after = _counts(store.stats())
            d = {k: after[k] - before[k] for k in after}
            phases.append(Phase(name, len(indices), len(indices) * block, seconds,
                                d["dram"], d["nvme"], d["misses"], wrong - d["misses"], reads=True))

        t0 = time.perf_counter()
        for i in steps("write", n):
            store.put(blocks.key(i), blocks.value(i))
        store.flush()
        phases.append(Phase("write", n, n * block, time.perf_counter() - t0))
        read_pass("read all", list(range(n)))
        hot = list(range(max(1, min(n // 8, dram // block // 8))))
        phases.append(_free_room(store, blocks, keep=set(hot), room=len(hot) * block))
        for r in (1, 2):
            read_pass(f"hot set #{r}", hot)
        stats = store.stats()
    return DemoResult(phases, stats, str(path))


def _free_room(store: Any, blocks: Blocks, *, keep: set, room: int) -> Phase:
    """Remove the newest blocks (as when sessions end) until DRAM has ``room`` bytes below
    its high watermark, so promotion can bring an NVMe-only hot set back; check they are gone."""
    t0 = time.perf_counter()
    high = store.config.high_watermark
    removed = []
    for i in reversed(range(blocks.count)):
        dram = store.stats()["dram"]
        if dram["used_bytes"] + room <= high * dram["capacity"] or i in keep:
            break
        if store.remove(blocks.key(i)):
            removed.append(i)
    still_there = sum(store.batch_exists([blocks.key(i) for i in removed])) if removed else 0
    return Phase("remove newest", len(removed), len(removed) * blocks.size, time.perf_counter() - t0,
                 misses=0, wrong=still_there)


def _counts(stats: Dict[str, Any]) -> Dict[str, int]:
    return {
        "dram": stats["dram"]["hits"],
        "nvme": stats.get("nvme", {}).get("hits", 0),
        "misses": stats["gets"]["misses"],
    }


def run(args: argparse.Namespace) -> int:
    size = parse_size(args.size, field="--size")
    block = parse_size(args.block, field="--block")
    dram = parse_size(args.dram, field="--dram")
    ssd = parse_size(args.ssd, field="--ssd") if args.ssd is not None else 2 * size + (64 << 20)
    if ssd == 0:
        raise ConfigError("the demo needs an NVMe tier", field="--ssd", got=args.ssd)
    parent = Path(args.dir) if args.dir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gdskv-demo-", dir=parent))
    try:
        free = shutil.disk_usage(workdir).free
        if free < size + (256 << 20):
            raise ConfigError("not enough free disk space for the demo", path=str(workdir),
                              needed=size, free=free)
        ui = _Ui()
        ui.intro(size=size, block=block, dram=dram, ssd=ssd, offload=args.offload, path=workdir)
        result = run_demo(workdir / "store", size=size, block=block, dram=dram, ssd=ssd,
                          seed=args.seed, offload=args.offload, progress=ui.progress)
        ui.report(result)
        return 0 if result.passed else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------- output


class _Ui:
    """Tables and progress through ``rich`` when it is installed, plain text otherwise."""

    WIDTH = 100  # used when stdout is not a terminal

    def __init__(self) -> None:
        try:
            from rich.console import Console
        except ImportError:
            self.console = None
        else:
            self.console = Console()
            if not self.console.is_terminal:
                self.console = Console(width=self.WIDTH)

    def print(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, markup=False)
        else:
            print(text, flush=True)

    def intro(self, *, size: int, block: int, dram: int, ssd: int, offload: str, path: Path) -> None:
        self.print(
            f"gdskv demo: {size // block} blocks x {format_size(block)} = {format_size(size // block * block)} "
            f"through a {format_size(dram)} DRAM tier onto SSD (cap {format_size(ssd)}), "
            f"{offload} offload, in {path}"
        )

    def progress(self, label: str, total: int) -> Iterator[int]:
        if self.console is not None and self.console.is_terminal:
            from rich.progress import track

            yield from track(range(total), description=f"{label:<14}", console=self.console, transient=True)
        else:
            yield from range(total)

    def table(self, title: str, header: List[str], rows: List[List[str]]) -> None:
        if self.console is not None:
            from rich import box
            from rich.table import Table

            t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
            for i, h in enumerate(header):
                t.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
            for row in rows:
                t.add_row(*row)
            self.console.print(t)
            return
        widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]
        print(f"\n{title}")
        for row in [header, ["-" * w for w in widths]] + rows:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))

    def report(self, result: DemoResult) -> None:
        s = result.stats
        rows = []
        for p in result.phases:
            hits = [str(p.dram_hits), str(p.nvme_hits), str(p.misses)] if p.reads else ["-", "-", "-"]
            check = str(p.wrong) if p.reads or p.name.startswith("remove") else "-"
            rate = f"{p.rate / 1e9:.2f}" if p.reads or p.name == "write" else "-"
            rows.append([p.name, str(p.blocks), format_size(p.nbytes), f"{p.seconds:.2f}", rate, *hits, check])
        self.table(
            "Where reads were served from (wrong: blocks whose bytes differ; for removes: still found)",
            ["phase", "blocks", "bytes", "s", "GB/s", "DRAM hits", "NVMe hits", "misses", "wrong"],
            rows,
        )
        dram, nvme, off = s["dram"], s["nvme"], s["offload"]
        self.table(
            "Tiers (bytes/s timed by the store around its own copies and I/O)",
            ["tier", "capacity", "used", "objects", "read GB/s", "write GB/s"],
            [
                ["DRAM", format_size(dram["capacity"]), format_size(dram["used_bytes"]), str(dram["objects"]),
                 f"{dram['read_bytes_per_s'] / 1e9:.2f}", f"{dram['put_bytes_per_s'] / 1e9:.2f} (put)"],
                ["NVMe", format_size(nvme["capacity"]), format_size(nvme["used_bytes"]), str(nvme["objects"]),
                 f"{nvme['read_bytes_per_s'] / 1e9:.2f}", f"{off['bytes_per_s'] / 1e9:.2f} (offload)"],
            ],
        )
        self.table(
            "Data movement",
            ["what", "objects", "detail"],
            [
                ["offloaded to NVMe", str(off["objects"]),
                 f"{format_size(off['bytes'])} in {nvme['buckets_written']} buckets"],
                ["evicted from DRAM, copy on NVMe", str(dram["evicted"]), format_size(dram["evicted_bytes"])],
                ["dropped from DRAM, no copy", str(dram["dropped"]), "only without an NVMe tier"],
                ["promoted NVMe -> DRAM", str(s["promoted"]), "read twice from NVMe"],
                ["puts that waited for DRAM room", str(s["puts"]["waited"]), "back-pressure, never a drop"],
                ["evicted from NVMe", str(nvme["objects_evicted"]), f"{nvme['buckets_evicted']} buckets"],
                ["corrupt NVMe reads", str(nvme["corrupt_reads"]), "never served"],
            ],
        )
        reads = result.reads
        total = sum(p.blocks for p in reads)
        dram_hits = sum(p.dram_hits for p in reads)
        nvme_hits = sum(p.nvme_hits for p in reads)
        if result.passed:
            self.print(f"PASS: {total} reads verified byte for byte ({dram_hits} from DRAM, {nvme_hits} from NVMe)")
        else:
            wrong = sum(p.wrong for p in result.phases)
            missing = sum(p.misses for p in reads)
            self.print(f"FAIL: {wrong} blocks wrong or not removed, {missing} missing, of {total} reads")
