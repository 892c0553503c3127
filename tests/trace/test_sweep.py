"""Sweep: size lists, agreement with single replays, parallel workers, targets."""

from __future__ import annotations

import pytest

from gdskv.config import GiB, TiB, StoreConfig
from gdskv.errors import ConfigError
from gdskv.tiers.backends.record import record_size
from gdskv.trace import SimConfig, parse_size_list, replay, sweep, synthetic_trace

BLOCK = 4096
RECORD = record_size(32, BLOCK)


def test_parse_size_list():
    assert parse_size_list("8GiB..64GiB") == [8 * GiB, 16 * GiB, 32 * GiB, 64 * GiB]
    assert parse_size_list("0,1TiB,4TiB") == [0, TiB, 4 * TiB]
    assert parse_size_list("8GiB..20GiB, 16GiB, 100") == [100, 8 * GiB, 16 * GiB]
    for bad in ("", "8GiB,,16GiB", "64GiB..8GiB", "0..8GiB", "lots", "1..4722366482869645213696"):
        with pytest.raises(ConfigError):
            parse_size_list(bad)


def test_sweep_points_equal_single_replays_and_jobs_agree():
    trace = synthetic_trace(300, seed=3, conversations=20, max_blocks=12)
    base = StoreConfig(bucket_bytes=BLOCK)
    dram = [2 * BLOCK, 4 * BLOCK, 8 * BLOCK]
    ssd = [0, 16 * RECORD]
    one = sweep(trace, dram_sizes=dram, ssd_sizes=ssd, base=base, block_bytes=BLOCK)
    two = sweep(trace, dram_sizes=dram, ssd_sizes=ssd, base=base, block_bytes=BLOCK, jobs=2)
    assert len(one.points) == 6
    for p in one.points:
        single = replay(trace, SimConfig(store=base.replace(dram_bytes=p.dram_bytes, ssd_bytes=p.ssd_bytes), block_bytes=BLOCK))
        assert p.hit_rate == single.hit_rate and p.nvme_hit_rate == single.nvme_hit_rate
        q = two.point(p.dram_bytes, p.ssd_bytes)
        assert (q.hit_rate, q.dram_hit_rate, q.nvme_hit_rate) == (p.hit_rate, p.dram_hit_rate, p.nvme_hit_rate)
    assert one.ideal_hit_rate >= max(p.hit_rate for p in one.points)
    # An SSD tier adds hits at every DRAM size on this trace.
    for d in dram:
        assert one.point(d, 16 * RECORD).hit_rate > one.point(d, 0).hit_rate


def test_smallest_dram_for_target():
    trace = synthetic_trace(300, seed=3, conversations=20, max_blocks=12)
    report = sweep(trace, dram_sizes=[2 * BLOCK, 64 * BLOCK], ssd_sizes=[0], base=StoreConfig(), block_bytes=BLOCK)
    low, high = report.point(2 * BLOCK, 0).hit_rate, report.point(64 * BLOCK, 0).hit_rate
    assert low < high
    assert report.smallest_dram_for(low) == {0: 2 * BLOCK}
    assert report.smallest_dram_for(high) == {0: 64 * BLOCK}
    assert report.smallest_dram_for(1.0) == {0: None}


def test_bad_point_fails_before_any_replay():
    trace = synthetic_trace(10)
    with pytest.raises(ConfigError, match="sweep point dram=100") as info:
        sweep(trace, dram_sizes=[100, 8 * BLOCK], ssd_sizes=[0], base=StoreConfig(), block_bytes=BLOCK)
    assert "block" in info.value.context
    with pytest.raises(ConfigError):
        sweep(trace, dram_sizes=[], ssd_sizes=[0], base=StoreConfig(), block_bytes=BLOCK)
