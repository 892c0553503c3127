#!/usr/bin/env python3
"""How fast is trace replay, next to the simplest loop over the same accesses?

Measures, on the shared Mooncake trace (or a synthetic one):

==============================  ===================================================
gdskv figure                    peer measured in the same run
==============================  ===================================================
read (``read_trace``)           bare ``json.loads`` of every line
replay, one configuration       bare Python loop over the same block accesses doing
                                one dict lookup each (and an insert on a miss)
sweep (all points)              the sum of single replays of the same points
==============================  ===================================================

Replay throughput is block accesses per second (every block of every request, hit or
miss). Each round runs the peer and then every replay configuration back to back; the
table shows medians over ``--repeat`` rounds of wall time and of this process's CPU time
(the CPU figure is what to read on a shared machine). The target (issue 7) is >= 1,000,000
block accesses/s on one core for the default configuration (eager offload). The sweep runs
once (``--jobs`` processes) and its wall time is printed beside the time of its points.

Usage::

    python benchmarks/bench_trace.py [--trace PATH | --synthetic N] [--repeat 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

from gdskv import GdskvError, StoreConfig, format_size, parse_size
from gdskv.trace import SimConfig, TierSimulator, parse_size_list, read_trace, sweep, synthetic_trace
from gdskv.trace.model import Trace

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TARGET_ACCESSES_PER_S = 1_000_000


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def timed(fn: Callable[[], object]) -> Tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def peer_dict_loop(block_lists: Sequence[Sequence[int]]) -> None:
    """The floor any replay must stand on: one dict lookup per access, insert on a miss."""
    seen: Dict[int, None] = {}
    for blocks in block_lists:
        for b in blocks:
            if b in seen:
                pass
            else:
                seen[b] = None


def peer_json(path: str) -> None:
    loads = json.loads
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                loads(line)


def configurations(dram: int, ssd: int, base: StoreConfig) -> Dict[str, StoreConfig]:
    return {
        "DRAM only, LRU": base.replace(dram_bytes=dram, ssd_bytes=0),
        "DRAM+SSD eager (default)": base.replace(dram_bytes=dram, ssd_bytes=ssd),
        "DRAM+SSD eager, SSD LRU": base.replace(dram_bytes=dram, ssd_bytes=ssd, ssd_eviction="lru"),
        "DRAM+SSD watermark": base.replace(dram_bytes=dram, ssd_bytes=ssd, offload="watermark"),
    }


def table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace file (default: the shared Mooncake trace)")
    ap.add_argument("--synthetic", type=int, metavar="N", help="use a synthetic trace of N requests instead")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of peer + replays (medians shown)")
    ap.add_argument("--kv-bytes-per-token", default="131072")
    ap.add_argument("--dram", default="64GiB")
    ap.add_argument("--ssd", default="2TiB")
    ap.add_argument("--sweep-dram", default="8GiB..512GiB")
    ap.add_argument("--sweep-ssd", default="0,1TiB,4TiB")
    ap.add_argument("--jobs", type=int, default=1, help="processes for the sweep")
    args = ap.parse_args(argv)

    if args.synthetic:
        trace: Trace = synthetic_trace(args.synthetic, seed=args.seed)
        read_s = json_s = None
        source = f"synthetic ({args.synthetic} requests, seed {args.seed})"
    else:
        if not Path(args.trace).exists():
            print(f"bench_trace: no trace at {args.trace}; pass --trace PATH or --synthetic N", file=sys.stderr)
            return 2
        json_s = min(timed(lambda: peer_json(args.trace))[0] for _ in range(max(1, args.repeat // 2)))
        read_s = min(timed(lambda: read_trace(args.trace))[0] for _ in range(max(1, args.repeat // 2)))
        trace = read_trace(args.trace)
        source = args.trace
    block_lists = trace.block_lists()
    n = trace.accesses
    block_bytes = trace.block_tokens * parse_size(args.kv_bytes_per_token, field="kv_bytes_per_token")
    dram, ssd = parse_size(args.dram, field="dram"), parse_size(args.ssd, field="ssd")
    configs = configurations(dram, ssd, StoreConfig())

    print(f"bench_trace: Python {platform.python_version()} on {cpu_model()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"trace: {source}: {len(trace.requests):,} requests, {n:,} block accesses, "
          f"{trace.block_tokens} tokens/block = {format_size(block_bytes)}")
    print(f"tiers: DRAM {format_size(dram)}, SSD {format_size(ssd)}; {args.repeat} rounds, medians\n")

    walls: Dict[str, List[float]] = {"peer": []}
    cpus: Dict[str, List[float]] = {"peer": []}
    hit: Dict[str, float] = {}
    for name in configs:
        walls[name], cpus[name] = [], []
    for _ in range(args.repeat):
        w, c = timed(lambda: peer_dict_loop(block_lists))
        walls["peer"].append(w)
        cpus["peer"].append(c)
        for name, store in configs.items():
            sim = TierSimulator(SimConfig(store=store, block_bytes=block_bytes))
            w, c = timed(lambda sim=sim: sim.run(block_lists))
            walls[name].append(w)
            cpus[name].append(c)
            hit[name] = (sim.counters.dram_hits + sim.counters.nvme_hits) / n

    med = {k: statistics.median(v) for k, v in walls.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpus.items()}
    rows = [["peer: dict lookup per access", f"{n / med['peer'] / 1e6:.2f}M", f"{n / med_cpu['peer'] / 1e6:.2f}M", "1.00", "-"]]
    for name in configs:
        rows.append([
            f"replay: {name}",
            f"{n / med[name] / 1e6:.2f}M",
            f"{n / med_cpu[name] / 1e6:.2f}M",
            f"{med_cpu['peer'] / med_cpu[name]:.3f}",
            f"{hit[name]:.3f}",
        ])
    print(table(rows, ["block accesses/s", "wall", "CPU", "x peer (CPU)", "hit rate"]))
    default = "DRAM+SSD eager (default)"
    rate = n / med_cpu[default]
    print(f"\ntarget >= {TARGET_ACCESSES_PER_S / 1e6:.0f}M block accesses/s (default configuration, CPU time): "
          f"{rate / 1e6:.2f}M -> {'met' if rate >= TARGET_ACCESSES_PER_S else 'NOT met'}")
    if read_s is not None and json_s is not None:
        print(f"read_trace: {read_s:.3f} s for {len(trace.requests):,} lines; bare json.loads {json_s:.3f} s "
              f"({json_s / read_s:.2f}x)")

    dram_sizes = parse_size_list(args.sweep_dram, field="sweep_dram")
    ssd_sizes = parse_size_list(args.sweep_ssd, field="sweep_ssd")
    base = configs[default]
    report = sweep(trace, dram_sizes=dram_sizes, ssd_sizes=ssd_sizes, base=base, block_bytes=block_bytes, jobs=args.jobs)
    inside = sum(p.seconds for p in report.points)
    print(f"sweep: {len(report.points)} points ({len(dram_sizes)} DRAM x {len(ssd_sizes)} SSD sizes) in "
          f"{report.seconds:.2f} s wall with {report.jobs} process(es); the replays themselves took {inside:.2f} s "
          f"({inside / report.seconds:.2f}x of wall), "
          f"{len(report.points) * n / report.seconds / 1e6:.2f}M block accesses/s overall")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GdskvError as exc:
        print(f"bench_trace: error: {exc}", file=sys.stderr)
        sys.exit(2)
