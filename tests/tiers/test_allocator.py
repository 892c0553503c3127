"""OffsetAllocator: first fit, exact accounting, coalescing back to one extent."""

import random

import pytest

from gdskv.errors import ConfigError, GdskvError
from gdskv.tiers.allocator import OffsetAllocator


def test_allocations_are_aligned_disjoint_and_accounted():
    alloc = OffsetAllocator(1 << 20, alignment=4096)
    a = alloc.allocate(1)
    b = alloc.allocate(4097)
    c = alloc.allocate(4096)
    assert (a, b, c) == (0, 4096, 3 * 4096)
    assert alloc.used == 4 * 4096
    assert alloc.size_of(b) == 2 * 4096


def test_returns_none_when_nothing_fits():
    alloc = OffsetAllocator(4096 * 4, alignment=4096)
    assert alloc.allocate(4096 * 4) == 0
    assert alloc.allocate(1) is None
    alloc.free(0)
    assert alloc.allocate(4096 * 5) is None
    assert alloc.allocate(4096 * 4) == 0


def test_free_coalesces_neighbours_in_any_order():
    alloc = OffsetAllocator(64 * 10, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(10)]
    for off in (offsets[1], offsets[3], offsets[2], offsets[0], offsets[9], offsets[5], offsets[7], offsets[6], offsets[8], offsets[4]):
        alloc.free(off)
    assert alloc.used == 0
    assert alloc.free_extents == 1
    assert alloc.largest_free == 640


def test_first_fit_reuses_holes():
    alloc = OffsetAllocator(64 * 8, alignment=64)
    offs = [alloc.allocate(64) for _ in range(8)]
    alloc.free(offs[2])
    alloc.free(offs[3])
    assert alloc.largest_free == 128
    assert alloc.allocate(100) == offs[2]
    assert alloc.allocate(64) is None


@pytest.mark.parametrize("aligned", [False, True], ids=["plain", "page-aligned-large"])
def test_random_workload_matches_a_model_and_fits_agrees(aligned):
    """Random allocations and frees against a model of what is live: no overlap, exact
    accounting, ``fits`` agreeing with ``allocate``, one free extent at the end. With
    ``aligned``, values of 8 KiB or more are page-aligned (as the DRAM tier places them)."""
    rng = random.Random(11 if aligned else 7)
    alloc = OffsetAllocator(1 << 18 if aligned else 1 << 16, alignment=64)
    live = {}
    for _ in range(4000 if aligned else 5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            alloc.free(off)
            del live[off]
            continue
        size = rng.randint(1, 20000 if aligned else 3000)
        align = 4096 if aligned and size >= 8192 else None
        fits = alloc.fits(size, align=align)
        off = alloc.allocate(size, align=align)
        assert fits == (off is not None)
        if off is None:
            if align is None:
                assert alloc.largest_free < alloc.rounded(size)
            continue
        assert off % (align or 64) == 0
        add_checked(alloc, live, off, size)
        assert alloc.used == sum(live.values())
    free_all(alloc, live)


def add_checked(alloc, live, off, size):
    """Record a new allocation in the model ``live`` after checking it overlaps nothing."""
    end = off + alloc.rounded(size)
    assert end <= alloc.capacity
    for o, s in live.items():
        assert end <= o or o + s <= off, "overlapping allocations"
    live[off] = alloc.rounded(size)


def free_all(alloc, live):
    for off in list(live):
        alloc.free(off)
    assert alloc.free_extents == 1 and alloc.used == 0


def test_bad_calls_raise():
    with pytest.raises(ConfigError):
        OffsetAllocator(0)
    with pytest.raises(ConfigError):
        OffsetAllocator(1024, alignment=48)
    alloc = OffsetAllocator(1024)
    with pytest.raises(GdskvError):
        alloc.allocate(0)
    with pytest.raises(GdskvError, match="not allocated"):
        alloc.free(64)


def test_aligned_allocations_leave_the_skipped_head_free():
    alloc = OffsetAllocator(1 << 16, alignment=64)
    assert alloc.allocate(100) == 0
    big = alloc.allocate(5000, align=4096)
    assert big == 4096
    assert alloc.used == 128 + 5056
    assert alloc.allocate(64) == 128  # in the head skipped by the aligned allocation
    alloc.free(big)
    assert alloc.allocate(4096, align=4096) == 4096


def test_bad_alignment_is_refused():
    alloc = OffsetAllocator(1 << 16, alignment=64)
    for align in (32, 96, 0):
        with pytest.raises(GdskvError):
            alloc.allocate(10, align=align)
