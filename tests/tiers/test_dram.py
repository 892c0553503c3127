"""DramTier: where values land in the arena."""

from gdskv.gds.aligned import address_of
from gdskv.tiers.dram import PAGE_ALIGNED_FROM, DramTier
from gdskv.tiers.policies import make_policy


def test_large_values_start_on_a_page_and_small_ones_on_a_cache_line():
    dram = DramTier(8 << 20, make_policy("lru"))
    small = dram.reserve(b"small", 100, 0)
    large = dram.reserve(b"large", PAGE_ALIGNED_FROM + 1, 0)
    tiny = dram.reserve(b"tiny", 10, 0)
    assert address_of(dram.view(small)) % 64 == 0
    assert address_of(dram.view(large)) % 4096 == 0
    assert address_of(dram.view(tiny)) % 64 == 0
    assert tiny.offset < large.offset  # the page's skipped head is reused
    assert dram.fits(PAGE_ALIGNED_FROM)
    assert not dram.fits(8 << 20)
    dram.close()
