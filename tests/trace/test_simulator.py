"""The tier simulator on small traces whose outcome is worked out by hand in each test."""

from __future__ import annotations

import pytest

from gdskv.config import StoreConfig
from gdskv.errors import ConfigError
from gdskv.tiers import policies
from gdskv.tiers.backends.record import record_size
from gdskv.trace import SimConfig, TierSimulator, from_block_lists, ideal_hits, replay

BLOCK = 4096
RECORD = record_size(32, BLOCK)  # what one block takes on NVMe: 4 KiB header + value

# Five requests, 13 block accesses, ids prefix-chained (1 -> 2 -> 3 is one prompt).
REQUESTS = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5], [1, 2, 4]]


def sim(dram_blocks, ssd_blocks=0, **options) -> TierSimulator:
    store = StoreConfig(dram_bytes=dram_blocks * BLOCK, ssd_bytes=ssd_blocks * RECORD, **options)
    return TierSimulator(SimConfig(store=store, block_bytes=BLOCK))


def run(s: TierSimulator):
    c = s.run(REQUESTS)
    assert c.accesses == 13 and c.requests == 5
    return c


def test_ideal_hit_rate_by_hand():
    # r2: 1,2 seen -> 2; r3: 1,2,3 -> 3; r4: 0; r5: 1,2,4 -> 3.  8 of 13.
    assert ideal_hits(REQUESTS) == 8


def test_dram_only_lru_by_hand():
    # 3 slots, LRU (front = next victim).
    # r1 [1,2,3]: 3 misses, puts            DRAM 1 2 3
    # r2 [1,2,4]: hit 1, hit 2, miss 4       touches -> 3 1 2; put 4 evicts 3 -> 1 2 4
    # r3 [1,2,3]: hit 1, hit 2, miss 3       touches -> 4 1 2; put 3 evicts 4 -> 1 2 3
    # r4 [5]:     miss, put evicts 1         -> 2 3 5
    # r5 [1,2,4]: miss 1 ends the prefix; put 1 evicts 2, put 2 evicts 3, put 4 evicts 5
    # hits: 2 + 2 = 4 of 13, all DRAM.
    c = run(sim(3, eviction="lru"))
    assert (c.dram_hits, c.nvme_hits, c.misses) == (4, 0, 9)
    assert c.puts == 3 + 1 + 1 + 1 + 3 and c.dram_evicted == c.puts - 3 == c.dropped


def test_dram_only_fifo_by_hand():
    # 3 slots, FIFO: reads do not reorder.
    # r1: DRAM 1 2 3.  r2: hit 1, hit 2, put 4 evicts 1 -> 2 3 4.
    # r3: miss 1 ends the prefix; puts 1 (evicts 2), 2 (evicts 3), 3 (evicts 4) -> 1 2 3.
    # r4: put 5 evicts 1 -> 2 3 5.  r5: miss 1; puts 1, 2, 4 -> 1 2 4.
    # hits: 2 of 13.
    c = run(sim(3, eviction="fifo"))
    assert (c.dram_hits, c.nvme_hits) == (2, 0)


def test_eager_ssd_by_hand():
    # DRAM 2 slots (LRU), SSD 5 blocks in one-block buckets (a bucket is one block when
    # bucket_bytes == block size), eager offload: every put is on SSD at once.
    # r1 [1,2,3]: puts 1 2 3; 3 evicts 1 from DRAM.   DRAM 2 3      SSD 1 2 3
    # r2 [1,2,4]: 1 SSD hit, 2 DRAM hit, 4 miss; put 4 evicts 3.   DRAM 2 4   SSD 1 2 3 4
    # r3 [1,2,3]: 1 SSD, 2 DRAM, 3 SSD: all hit.                  DRAM 4 2
    # r4 [5]:     miss; put 5 evicts 4.                          DRAM 2 5   SSD 1 2 3 4 5
    # r5 [1,2,4]: 1 SSD, 2 DRAM, 4 SSD.
    # DRAM hits 3, SSD hits 5: the ideal 8 of 13. Promotion after 1 read never happens:
    # eager offload keeps DRAM full, and promotion needs DRAM below its high watermark.
    s = sim(2, 5, eviction="lru", ssd_eviction="fifo", bucket_bytes=BLOCK, promote_after_reads=1)
    c = run(s)
    assert (c.dram_hits, c.nvme_hits, c.promoted) == (3, 5, 0)
    assert (c.offloaded, c.buckets_written, c.nvme_evicted) == (5, 5, 0)
    assert sorted(s.dram) == [2, 5] and sorted(s.nvme) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("ssd_eviction,dram_hits,nvme_hits", [("fifo", 0, 2), ("lru", 1, 4)])
def test_bucket_level_eviction_by_hand(ssd_eviction, dram_hits, nvme_hits):
    # DRAM 2 slots (FIFO); SSD 8 records in buckets of 2 blocks: bucket_max_keys=2 makes a
    # batch due at 2 queued blocks, and 2 records fit in bucket_bytes and in a quarter of
    # the SSD. Eager offload.
    # r1 [1,2,3,4]: puts 1, 2 -> bucket A=[1,2]; 3, 4 evict 1, 2 from DRAM -> B=[3,4].
    # r2 [5,6,7,8]: the same -> C=[5,6], D=[7,8]. SSD full: A B C D.    DRAM 7 8
    # r3 [1,2,9]:   1, 2 SSD hits (bucket A), 9 misses; put 9 evicts 7 -> DRAM 8 9; at
    #               the end of the request the partial bucket E=[9] needs room:
    #               FIFO evicts A (first written) although it was just read -> B C D E;
    #               LRU evicts B (A was touched by the reads)               -> C D A E.
    # r4 [1,2,9]:   FIFO: 1 misses (gone with A); 1, 2 are put (bucket F evicts B); 9 is
    #               still on SSD: an idempotent put. LRU: 1, 2 SSD hits, 9 a DRAM hit.
    # FIFO: 2 SSD hits. LRU: 2 + 2 SSD hits and 1 DRAM hit.
    s = sim(2, 8, eviction="fifo", ssd_eviction=ssd_eviction, bucket_bytes=2 * RECORD, bucket_max_keys=2)
    assert s.bucket_blocks == 2
    c = s.run([[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 9], [1, 2, 9]])
    assert (c.accesses, c.dram_hits, c.nvme_hits) == (14, dram_hits, nvme_hits)
    if ssd_eviction == "fifo":
        assert (c.buckets_written, c.buckets_evicted, c.nvme_evicted) == (6, 2, 4)
        assert sorted(s.nvme) == [1, 2, 5, 6, 7, 8, 9]
    else:
        assert (c.buckets_written, c.buckets_evicted, c.nvme_evicted) == (5, 1, 2)
        assert sorted(s.nvme) == [1, 2, 5, 6, 7, 8, 9]


def test_bucket_never_takes_more_than_a_quarter_of_the_ssd():
    # bucket_bytes would hold 4 records, but a quarter of an 8-record SSD holds 2.
    assert sim(2, 8, bucket_bytes=4 * RECORD).bucket_blocks == 2
    assert sim(2, 16, bucket_bytes=4 * RECORD).bucket_blocks == 4
    # A block as large as bucket_bytes still goes alone (its record is a bit larger).
    assert sim(2, 16, bucket_bytes=BLOCK).bucket_blocks == 1


def test_watermark_and_promotion_by_hand():
    # DRAM 4 slots (LRU), high watermark 0.75 (offload when a put makes 4 blocks), low 0.5
    # (down to 2 blocks); SSD 10 blocks, one-block buckets; promote after 1 SSD read when
    # DRAM stays at or below the high watermark (3 blocks) after the copy.
    # r1 [1,2,3]: puts, 3 blocks: at the high watermark, not above.         DRAM 1 2 3
    # r2 [1,2,4]: hits 1, 2 (order 3 1 2); put 4 -> 4 blocks > high: nothing is on SSD to
    #             evict, so the coldest DRAM-only blocks 3, 1 are offloaded and evicted.
    #                                                                  DRAM 2 4   SSD 3 1
    # r3 [1,2,3]: 1 SSD hit -> promoted (2 + 1 <= 3)                    DRAM 2 4 1
    #             2 DRAM hit (order 4 1 2); 3 SSD hit, not promoted (3 + 1 > 3).
    # r4 [5]:     put 5 -> 4 blocks > high: evict what is on SSD first (1), still above
    #             low, so offload the coldest DRAM-only block 4 and evict it.
    #                                                                  DRAM 2 5   SSD 3 1 4
    # r5 [1,2,4]: 1 SSD hit -> promoted (DRAM 2 5 1); 2 DRAM hit; 4 SSD hit, not promoted.
    # DRAM hits 2 + 1 + 1 = 4, SSD hits 2 + 2 = 4, promoted 2.
    s = sim(4, 10, eviction="lru", offload="watermark", high_watermark=0.75, low_watermark=0.5,
            bucket_bytes=BLOCK, promote_after_reads=1)
    c = run(s)
    assert (c.dram_hits, c.nvme_hits, c.promoted) == (4, 4, 2)
    assert sorted(s.dram) == [1, 2, 5] and sorted(s.nvme) == [1, 3, 4]
    assert c.offloaded == 3


def test_promotion_read_count_is_forgotten_on_dram_eviction():
    # Promote after 2 reads. Same watermark setup: DRAM 4, high 0.75, low 0.5.
    # r1 puts 1 2 3; r2 [4] -> 4 blocks: offload + evict 1 2 -> DRAM 3 4, SSD 1 2.
    # r3 [1]: SSD read #1 of 1. r4 [1]: read #2 -> promoted (DRAM 3 4 1).
    s = sim(4, 10, offload="watermark", high_watermark=0.75, low_watermark=0.5, bucket_bytes=BLOCK,
            promote_after_reads=2)
    s.run([[1, 2, 3], [4], [1]])
    assert s.counters.promoted == 0 and s.counters.nvme_hits == 1
    s.run([[1]])
    assert s.counters.promoted == 1 and 1 in s.dram


def test_simulator_drives_the_registered_policy_objects(monkeypatch):
    # The simulator builds its policies through the store's registry: a policy registered
    # under "lru" is what it calls, for DRAM objects and for SSD buckets alike.
    calls = []

    class Recording(policies.LruPolicy):
        def touch(self, name):
            calls.append(("touch", name))
            super().touch(name)

    monkeypatch.setitem(policies.POLICIES, "lru", Recording)
    s = sim(2, 5, eviction="lru", ssd_eviction="lru", bucket_bytes=BLOCK)
    assert isinstance(s.dram_policy, Recording) and isinstance(s.ssd_policy, Recording)
    run(s)
    # DRAM touches (block 2 in r2, r3, r5) and SSD bucket touches (r2: 1; r3: 1, 3; r5: 1, 4).
    assert sorted(n for _, n in calls) == [1, 1, 1, 2, 2, 2, 3, 4]


def test_run_in_pieces_equals_run_at_once():
    a = sim(3, 8, bucket_bytes=2 * RECORD, bucket_max_keys=2)
    b = sim(3, 8, bucket_bytes=2 * RECORD, bucket_max_keys=2)
    assert a.bucket_blocks == 2
    a.run(REQUESTS)
    for r in REQUESTS:
        b.run([r])
    assert a.counters == b.counters and a.dram == b.dram and a.nvme == b.nvme


def test_replay_report_by_hand():
    report = replay(from_block_lists(REQUESTS, block_tokens=16), SimConfig(
        store=StoreConfig(dram_bytes=2 * BLOCK, ssd_bytes=5 * RECORD, bucket_bytes=BLOCK), block_bytes=BLOCK))
    assert (report.requests, report.accesses, report.unique_blocks) == (5, 13, 5)
    assert report.ideal_hit_rate == pytest.approx(8 / 13)
    assert report.dram_hit_rate == pytest.approx(3 / 13) and report.nvme_hit_rate == pytest.approx(5 / 13)
    assert report.hit_rate == pytest.approx(8 / 13)
    assert report.prefill_speedup == pytest.approx(13 / 5)  # 1 / (1 - 8/13)
    assert (report.dram_read_bytes, report.nvme_read_bytes) == (3 * BLOCK, 5 * BLOCK)
    assert report.config["dram_blocks"] == 2 and report.config["ssd_blocks"] == 5


def test_full_hit_rate_has_no_finite_speedup():
    report = replay(from_block_lists([[1], [1]]), SimConfig(store=StoreConfig(dram_bytes=BLOCK, ssd_bytes=0), block_bytes=BLOCK))
    assert report.hit_rate == 0.5
    report = replay(from_block_lists([[1]]), SimConfig(store=StoreConfig(dram_bytes=BLOCK, ssd_bytes=0), block_bytes=BLOCK))
    assert report.hit_rate == 0.0 and report.prefill_speedup == 1.0


@pytest.mark.parametrize(
    "store,block,match",
    [
        (dict(dram_bytes=BLOCK - 64, ssd_bytes=0), BLOCK, "larger than the DRAM tier"),
        (dict(dram_bytes=BLOCK, ssd_bytes=RECORD - 1), BLOCK, "a block is larger than the NVMe tier"),
        (dict(dram_bytes=4 * BLOCK, ssd_bytes=9 * RECORD, bucket_bytes=BLOCK, offload="watermark", low_watermark=1.0,
               high_watermark=1.0),
         BLOCK, "low_watermark leaves no DRAM slot"),
    ],
)
def test_impossible_configurations_are_config_errors(store, block, match):
    with pytest.raises(ConfigError, match=match):
        TierSimulator(SimConfig(store=StoreConfig(**store), block_bytes=block))


def test_bad_names_and_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="unknown eviction policy") as info:
        SimConfig(store=StoreConfig(eviction="mru"), block_bytes=BLOCK)
    assert "lru" in info.value.context["valid"]
    with pytest.raises(ConfigError, match="positive byte count"):
        SimConfig(block_bytes=0)
