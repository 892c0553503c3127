"""Smoke test on the real Mooncake trace: the measured properties in its README.

The trace lives beside the repository (``../shared/traces/`` from the repository root), as
in CI; without it these tests are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gdskv.config import StoreConfig
from gdskv.trace import SimConfig, analyze_reuse, read_trace, replay

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 512 * 131072  # 64 MiB: 512 tokens of a Llama-3-8B-class model

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"real trace not found at {TRACE} (shared/ beside the repo)")


@pytest.fixture(scope="module")
def trace():
    return read_trace(TRACE)


def test_shape(trace):
    assert (trace.format, trace.block_tokens, trace.skipped) == ("mooncake", 512, 0)
    assert len(trace.requests) == 12_031
    assert trace.unique_blocks() == 182_790
    assert 58 * 60 < trace.duration_s < 60 * 60


@pytest.mark.parametrize("blocks,expected", [(1_000, 0.045), (5_000, 0.110), (20_000, 0.288)])
def test_dram_only_lru_matches_the_readme(trace, blocks, expected):
    report = replay(trace, SimConfig(store=StoreConfig(dram_bytes=blocks * BLOCK, ssd_bytes=0), block_bytes=BLOCK))
    # The README gives three decimals (0.04447 is listed as 0.045): agree within 0.001.
    assert report.hit_rate == pytest.approx(expected, abs=1e-3)
    assert round(report.ideal_hit_rate, 3) == 0.366


def test_ssd_tier_keeps_most_of_the_ideal(trace):
    dram_only = replay(trace, SimConfig(store=StoreConfig(dram_bytes=64 << 30, ssd_bytes=0), block_bytes=BLOCK))
    tiered = replay(trace, SimConfig(store=StoreConfig(dram_bytes=64 << 30, ssd_bytes=4 << 40), block_bytes=BLOCK))
    assert dram_only.hit_rate < 0.06 < 0.3 < tiered.hit_rate <= tiered.ideal_hit_rate


def test_reuse_matches_the_readme(trace):
    r = analyze_reuse(trace)
    assert round(r.reused_share, 3) == 0.242
    assert round(r.median_gap_s) == 114 and round(r.p90_gap_s) == 519
    assert (round(r.within_10min, 3), round(r.from_10_to_30min, 3), round(r.beyond_30min, 3)) == (0.937, 0.055, 0.008)
