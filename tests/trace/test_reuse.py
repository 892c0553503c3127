"""Reuse analysis on a trace whose gaps are counted by hand."""

from __future__ import annotations

import json

import pytest

from gdskv.trace import analyze_reuse, from_block_lists


def test_reuse_gaps_by_hand():
    trace = from_block_lists(
        [[1, 2], [1, 3], [1, 2], [2], [2], [2]],
        timestamps=[0, 100, 1000, 4000, 4000, 4600],
    )
    # Reuses: t=100 block 1 (gap 100); t=1000 block 1 (900), block 2 (1000);
    # t=4000 block 2 (3000), again block 2 (0); t=4600 block 2 (600, counts as <= 10 min).
    r = analyze_reuse(trace)
    assert (r.requests, r.accesses, r.unique_blocks, r.reused_blocks, r.reuses) == (6, 9, 3, 2, 6)
    assert r.reused_share == pytest.approx(2 / 3)
    assert r.gaps == [0, 100, 600, 900, 1000, 3000]
    assert (r.within_10min, r.from_10_to_30min, r.beyond_30min) == pytest.approx((3 / 6, 2 / 6, 1 / 6))
    assert r.median_gap_s == 900 and r.p90_gap_s == 3000  # nearest rank, 0-based floor(q*n)
    counts = {b["label"]: b["count"] for b in r.bins}
    assert counts == {
        "<= 1 s": 1, "1-10 s": 0, "10-60 s": 0, "1-5 min": 1, "5-10 min": 1,
        "10-30 min": 2, "30-60 min": 1, "1-2 h": 0, "> 2 h": 0,
    }
    out = r.as_dict()
    assert "gaps" not in out and out["bins"][-1]["upper_s"] is None
    json.dumps(out, allow_nan=False)  # strict JSON


def test_no_reuse():
    r = analyze_reuse(from_block_lists([[1], [2]]))
    assert (r.reuses, r.within_10min, r.median_gap_s, r.reused_share) == (0, 0.0, 0.0, 0.0)
