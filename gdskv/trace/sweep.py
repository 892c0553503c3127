"""Sweep: hit rate as a function of DRAM size, for each SSD size.

Every point is one full replay (:func:`gdskv.trace.replay.replay`) with the given sizes and
the same policies. Points are independent, so ``jobs > 1`` runs them in worker processes
(forked, so the trace is shared, not copied through pipes).

Size lists (:func:`parse_size_list`): comma-separated sizes, each a size (``"64GiB"``, ``0``)
or a doubling range ``"8GiB..512GiB"`` (8, 16, 32, ... up to and including 512 GiB).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

from gdskv.config import StoreConfig, parse_size
from gdskv.errors import ConfigError
from gdskv.trace.model import Trace, ideal_hits
from gdskv.trace.replay import speedup
from gdskv.trace.simulator import SimConfig, TierSimulator

#: Most points a single range may expand to (a typo such as "1B..1TiB" would be 41).
MAX_RANGE_POINTS = 64


def parse_size_list(text: str, *, field: str = "sizes") -> List[int]:
    """Parse ``"8GiB..512GiB"``, ``"0,1TiB,4TiB"`` or a mix into sorted, distinct byte counts."""
    out: set = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ConfigError("empty item in a size list", field=field, got=text)
        if ".." in part:
            lo_text, _, hi_text = part.partition("..")
            lo = parse_size(lo_text.strip(), field=field)
            hi = parse_size(hi_text.strip(), field=field)
            if lo <= 0 or hi < lo:
                raise ConfigError("a range needs 0 < start <= end", field=field, got=part)
            size = lo
            points = 0
            while size <= hi:
                out.add(size)
                size *= 2
                points += 1
                if points > MAX_RANGE_POINTS:
                    raise ConfigError("range has too many points", field=field, got=part, limit=MAX_RANGE_POINTS)
        else:
            out.add(parse_size(part, field=field))
    return sorted(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepPoint:
    dram_bytes: int
    ssd_bytes: int
    dram_blocks: int
    ssd_blocks: int
    hit_rate: float
    dram_hit_rate: float
    nvme_hit_rate: float
    prefill_speedup: Optional[float]
    seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepReport:
    requests: int
    accesses: int
    block_bytes: int
    ideal_hit_rate: float
    dram_sizes: List[int]
    ssd_sizes: List[int]
    points: List[SweepPoint]
    seconds: float  # wall time of the whole sweep
    jobs: int

    def point(self, dram_bytes: int, ssd_bytes: int) -> SweepPoint:
        for p in self.points:
            if p.dram_bytes == dram_bytes and p.ssd_bytes == ssd_bytes:
                return p
        raise KeyError((dram_bytes, ssd_bytes))

    def smallest_dram_for(self, target: float) -> Dict[int, Optional[int]]:
        """For each SSD size, the smallest swept DRAM size reaching ``target`` (None: none)."""
        out: Dict[int, Optional[int]] = {}
        for ssd in self.ssd_sizes:
            hits = [p.dram_bytes for p in self.points if p.ssd_bytes == ssd and p.hit_rate >= target]
            out[ssd] = min(hits) if hits else None
        return out

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# Worker-process state: set before forking, read by _run_point.
_BLOCK_LISTS: Sequence[Sequence[int]] = ()


def _run_point(config: SimConfig) -> SweepPoint:
    sim = TierSimulator(config)
    t0 = time.perf_counter()
    c = sim.run(_BLOCK_LISTS)
    seconds = time.perf_counter() - t0
    n = c.accesses or 1
    hit_rate = (c.dram_hits + c.nvme_hits) / n
    cfg = config.store
    return SweepPoint(
        dram_bytes=cfg.dram_bytes,
        ssd_bytes=cfg.ssd_bytes,
        dram_blocks=sim.dram_slots,
        ssd_blocks=sim.ssd_slots,
        hit_rate=hit_rate,
        dram_hit_rate=c.dram_hits / n,
        nvme_hit_rate=c.nvme_hits / n,
        prefill_speedup=speedup(hit_rate),
        seconds=seconds,
    )


def sweep(
    trace: Trace,
    *,
    dram_sizes: Sequence[int],
    ssd_sizes: Sequence[int],
    base: StoreConfig,
    block_bytes: int,
    jobs: int = 1,
) -> SweepReport:
    """Replay ``trace`` at every (DRAM, SSD) size pair; other settings come from ``base``.

    Every configuration is built (and validated) before any replay starts, so a bad size
    fails at once with a :class:`ConfigError` naming it.
    """
    global _BLOCK_LISTS
    if not dram_sizes or not ssd_sizes:
        raise ConfigError("a sweep needs at least one DRAM and one SSD size")
    if jobs < 1:
        raise ConfigError("jobs must be >= 1", got=jobs)
    configs = []
    for ssd in ssd_sizes:
        for dram in dram_sizes:
            try:
                config = SimConfig(store=base.replace(dram_bytes=dram, ssd_bytes=ssd), block_bytes=block_bytes)
                TierSimulator(config)  # validates sizes against the block size
            except ConfigError as exc:
                raise ConfigError(f"sweep point dram={dram} ssd={ssd}: {exc.message}", **exc.context) from None
            configs.append(config)
    block_lists = trace.block_lists()
    _BLOCK_LISTS = block_lists
    t0 = time.perf_counter()
    try:
        if jobs > 1 and len(configs) > 1 and "fork" in multiprocessing.get_all_start_methods():
            workers = min(jobs, len(configs), os.cpu_count() or 1)
            with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
                points = list(pool.map(_run_point, configs))
        else:
            jobs = 1
            points = [_run_point(c) for c in configs]
    finally:
        _BLOCK_LISTS = ()
    seconds = time.perf_counter() - t0
    accesses = trace.accesses
    return SweepReport(
        requests=len(trace.requests),
        accesses=accesses,
        block_bytes=block_bytes,
        ideal_hit_rate=ideal_hits(block_lists) / accesses if accesses else 0.0,
        dram_sizes=sorted(set(dram_sizes)),
        ssd_sizes=sorted(set(ssd_sizes)),
        points=points,
        seconds=seconds,
        jobs=jobs,
    )
