"""Reuse analysis: how long after its last use does a block come back?

For every access of a block seen before, the *reuse gap* is the time since that block's
previous access (any request that contained it). The distribution tells how long a tier
must keep a block for it to hit: the shares within 10 minutes, 10-30 minutes and beyond 30
minutes separate a DRAM-sized hot set from the cold tail an SSD tier is for.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

from gdskv.trace.model import Trace

#: Boundaries of the headline shares, in seconds (gap <= 10 min, <= 30 min, beyond).
NEAR_S = 600.0
FAR_S = 1800.0

#: Rows of the gap table: (label, upper bound in seconds, inclusive).
GAP_BINS: Tuple[Tuple[str, float], ...] = (
    ("<= 1 s", 1.0),
    ("1-10 s", 10.0),
    ("10-60 s", 60.0),
    ("1-5 min", 300.0),
    ("5-10 min", 600.0),
    ("10-30 min", 1800.0),
    ("30-60 min", 3600.0),
    ("1-2 h", 7200.0),
    ("> 2 h", float("inf")),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReuseReport:
    """Reuse-gap statistics of one trace; shares are fractions of all reuses."""

    requests: int
    accesses: int
    unique_blocks: int
    reused_blocks: int  # blocks accessed more than once
    reuses: int  # accesses of a block seen before
    median_gap_s: float
    p90_gap_s: float
    p99_gap_s: float
    within_10min: float
    from_10_to_30min: float
    beyond_30min: float
    bins: List[Dict[str, Any]]  # {"label", "upper_s" (None: no bound), "count", "share"}
    gaps: List[float] = dataclasses.field(repr=False)  # every gap, sorted (for plots)

    @property
    def reused_share(self) -> float:
        """Fraction of unique blocks that are ever used again."""
        return self.reused_blocks / self.unique_blocks if self.unique_blocks else 0.0

    def as_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["gaps"]
        out["reused_share"] = self.reused_share
        return out


def reuse_gaps(requests_times: Sequence[float], block_lists: Sequence[Sequence[int]]) -> Tuple[List[float], int, int]:
    """Every reuse gap (unsorted), the number of unique blocks and of reused blocks."""
    last: Dict[int, float] = {}
    reused = set()
    gaps: List[float] = []
    append = gaps.append
    for t, blocks in zip(requests_times, block_lists):
        for b in blocks:
            prev = last.get(b)
            if prev is not None:
                append(t - prev)
                reused.add(b)
            last[b] = t
    return gaps, len(last), len(reused)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """The value at rank ``floor(q * n)`` (nearest rank, 0-based); 0 for no values."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def analyze_reuse(trace: Trace) -> ReuseReport:
    """The reuse-gap distribution of ``trace`` (requests in timestamp order)."""
    times = [r.timestamp for r in trace.requests]
    gaps, unique, reused = reuse_gaps(times, trace.block_lists())
    gaps.sort()
    n = len(gaps)
    near = bisect.bisect_right(gaps, NEAR_S)
    far = bisect.bisect_right(gaps, FAR_S)
    share = (lambda k: k / n) if n else (lambda k: 0.0)
    bins = []
    lower = 0
    for label, upper in GAP_BINS:
        upto = bisect.bisect_right(gaps, upper)
        bound = None if upper == float("inf") else upper  # JSON has no infinity
        bins.append({"label": label, "upper_s": bound, "count": upto - lower, "share": share(upto - lower)})
        lower = upto
    return ReuseReport(
        requests=len(trace.requests),
        accesses=trace.accesses,
        unique_blocks=unique,
        reused_blocks=reused,
        reuses=n,
        median_gap_s=_quantile(gaps, 0.5),
        p90_gap_s=_quantile(gaps, 0.9),
        p99_gap_s=_quantile(gaps, 0.99),
        within_10min=share(near),
        from_10_to_30min=share(far - near),
        beyond_30min=share(n - far),
        bins=bins,
        gaps=gaps,
    )
