"""Replay a trace through the tier simulator and report hit rates, bytes and speedup.

``replay(trace, config)`` runs one :class:`TierSimulator` over the whole trace, request by
request in timestamp order, and returns a :class:`ReplayReport`: requests, block accesses,
unique blocks, the ideal hit rate (an infinite cache, prefix-matched), the hit rate per
tier and overall, the bytes read per tier, and the estimated prefill speedup ``1 / (1 - r)``
(only ``1 - r`` of the prompt's blocks are recomputed).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Optional

from gdskv.trace.model import Trace, ideal_hits
from gdskv.trace.simulator import SimConfig, TierSimulator


def speedup(hit_rate: float) -> Optional[float]:
    """Estimated prefill speedup 1/(1 - r); None when every block hits (no prefill left)."""
    return None if hit_rate >= 1.0 else 1.0 / (1.0 - hit_rate)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayReport:
    """Everything ``gdskv trace replay`` prints. Rates are fractions of block accesses."""

    trace: Dict[str, Any]
    config: Dict[str, Any]
    requests: int
    accesses: int
    unique_blocks: int
    ideal_hit_rate: float
    dram_hit_rate: float
    nvme_hit_rate: float
    hit_rate: float
    dram_read_bytes: int
    nvme_read_bytes: int
    prefill_speedup: Optional[float]
    ideal_prefill_speedup: Optional[float]
    counters: Dict[str, int]
    seconds: float

    @property
    def accesses_per_s(self) -> float:
        return self.accesses / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["accesses_per_s"] = self.accesses_per_s
        return out


def trace_info(trace: Trace) -> Dict[str, Any]:
    return {
        "path": trace.path,
        "format": trace.format,
        "block_tokens": trace.block_tokens,
        "duration_s": trace.duration_s,
        "skipped_lines": trace.skipped,
    }


def config_info(sim: TierSimulator) -> Dict[str, Any]:
    cfg = sim.config.store
    return {
        "dram_bytes": cfg.dram_bytes,
        "ssd_bytes": cfg.ssd_bytes,
        "block_bytes": sim.block_bytes,
        "dram_blocks": sim.dram_slots,
        "ssd_blocks": sim.ssd_slots,
        "bucket_blocks": sim.bucket_blocks if sim.has_ssd else 0,
        "eviction": cfg.eviction,
        "ssd_eviction": cfg.ssd_eviction if sim.has_ssd else None,
        "offload": cfg.offload if sim.has_ssd else None,
        "promote_after_reads": cfg.promote_after_reads if sim.has_ssd else 0,
        "high_watermark": cfg.high_watermark,
        "low_watermark": cfg.low_watermark,
    }


def replay(trace: Trace, config: SimConfig, *, ideal: Optional[int] = None) -> ReplayReport:
    """Replay ``trace`` under ``config``. ``ideal`` reuses a precomputed :func:`ideal_hits`."""
    block_lists = trace.block_lists()
    sim = TierSimulator(config)
    t0 = time.perf_counter()
    c = sim.run(block_lists)
    seconds = time.perf_counter() - t0
    if ideal is None:
        ideal = ideal_hits(block_lists)
    n = c.accesses
    rate = (lambda x: x / n) if n else (lambda x: 0.0)
    hit_rate = rate(c.dram_hits + c.nvme_hits)
    ideal_rate = rate(ideal)
    return ReplayReport(
        trace=trace_info(trace),
        config=config_info(sim),
        requests=c.requests,
        accesses=n,
        unique_blocks=trace.unique_blocks(),
        ideal_hit_rate=ideal_rate,
        dram_hit_rate=rate(c.dram_hits),
        nvme_hit_rate=rate(c.nvme_hits),
        hit_rate=hit_rate,
        dram_read_bytes=c.dram_hits * sim.block_bytes,
        nvme_read_bytes=c.nvme_hits * sim.block_bytes,
        prefill_speedup=speedup(hit_rate),
        ideal_prefill_speedup=speedup(ideal_rate),
        counters=c.as_dict(),
        seconds=seconds,
    )
