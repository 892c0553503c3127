"""The OffloadingAllocator over an in-memory engine and a real store: a request's life,
eviction with saves, asynchronous saves that never block, and store faults."""

from __future__ import annotations

import numpy as np
import pytest

from gdskv.engine import PagedKVEngine, PoolExhaustedError
from gdskv.engine.memory import MemoryEngine
from gdskv.kvstore import KVStore

from .conftest import PAGE, GatedStore, layout, tokens


def compute(engine, alloc, toks):
    """Serve ``toks`` the way an engine does: acquire, allocate, "compute" the missing
    pages (deterministic bytes from the page's index and the prompt), commit, release.
    Returns (hit, pages, the bytes every page should hold)."""
    hit = alloc.acquire(toks)
    n_pages = -(-len(toks) // PAGE)
    pages = hit.pages + alloc.allocate(n_pages - len(hit.pages))
    expected = [page_bytes(engine, toks, i) for i in range(n_pages)]
    for i in range(len(hit.pages), n_pages):
        engine.pool[pages[i]] = expected[i]
    alloc.commit(toks, pages)
    alloc.release(pages)
    return hit, pages, expected


def page_bytes(engine, toks, i):
    seed = int(np.asarray(toks[: (i + 1) * PAGE]).sum()) * 1000 + i
    return np.random.default_rng(seed).integers(0, 256, engine.layout.page_nbytes, dtype=np.uint8)


def verify_pages(engine, pages, expected):
    for page, want in zip(pages, expected):
        assert np.array_equal(engine.pool[page], want)


def test_memory_engine_implements_the_protocol():
    assert isinstance(MemoryEngine(layout(), 4), PagedKVEngine)


class ProtocolOnly:
    """A store reduced to the :class:`KVStore` protocol: any other attribute is an error,
    so the allocator provably needs nothing a cluster client lacks."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name):
        if name not in KVStore.__dict__ or name.startswith("_"):
            raise AttributeError(f"{name} is not part of the KVStore protocol")
        return getattr(self._store, name)


def test_the_allocator_needs_only_the_kvstore_protocol(make_store, make_allocator):
    store = ProtocolOnly(make_store())
    a_engine, a = make_allocator(store)
    toks = tokens(4 * PAGE + 1)
    _, pages, expected = compute(a_engine, a, toks)
    assert a.save(toks, pages[:4]) == 4
    assert a.flush(10)
    saves = a.stats()["save"]
    assert saves.get("errors", 0) == 0 and saves["saved_pages"] == 4

    b_engine, b = make_allocator(store)
    assert b.lookup(toks) == 4 * PAGE
    fresh = b.allocate(4)
    assert b.load(toks, fresh) == 4 * PAGE
    verify_pages(b_engine, fresh, expected[:4])
    assert a.stats()["store_errors"] == b.stats()["store_errors"] == 0


@pytest.mark.parametrize("kind", ["per_layer", "fused"])
def test_saved_pages_load_into_another_engine_byte_for_byte(make_store, make_allocator, kind):
    store = make_store()
    a_engine, a = make_allocator(store, kind=kind)
    toks = tokens(5 * PAGE + 3)
    hit, pages, expected = compute(a_engine, a, toks)
    assert hit.tokens == 0
    assert a.save(toks, pages[:5]) == 5
    assert a.flush(10)
    assert store.stats()["puts"]["count"] == 5 * a.layout.num_segments

    b_engine, b = make_allocator(store, kind=kind)
    assert b.lookup(toks) == 5 * PAGE
    fresh = b.allocate(5)
    assert b.load(toks, fresh) == 5 * PAGE
    verify_pages(b_engine, fresh, expected[:5])


def test_a_request_life_device_hits_then_store_hits(make_store, make_allocator):
    store = make_store()
    engine, alloc = make_allocator(store, pages=12)
    first = tokens(6 * PAGE + 5, seed=1)
    compute(engine, alloc, first)
    # Another conversation fills the pool: the first one's pages are evicted and saved.
    compute(engine, alloc, tokens(9 * PAGE, seed=2))
    assert alloc.stats()["evicted_pages"] > 0
    assert alloc.flush(10)
    follow_up = np.concatenate([first, tokens(PAGE, seed=3)])
    assert alloc.lookup(follow_up) == 6 * PAGE
    hit, pages, expected = compute(engine, alloc, follow_up)
    assert hit.tokens == 6 * PAGE
    assert hit.store_tokens > 0
    verify_pages(engine, pages, expected)


def test_the_last_token_is_always_left_to_compute(make_allocator):
    engine, alloc = make_allocator()
    toks = tokens(4 * PAGE)
    compute(engine, alloc, toks)
    assert alloc.lookup(toks) == 4 * PAGE
    hit = alloc.acquire(toks)
    assert hit.tokens == 3 * PAGE  # one page must be recomputed to get the last logits
    alloc.release(hit.pages)


def test_device_hit_pins_pages_until_release(make_allocator):
    engine, alloc = make_allocator(pages=8)
    toks = tokens(4 * PAGE + 1)
    compute(engine, alloc, toks)
    hit = alloc.acquire(toks)
    assert hit.device_tokens == 4 * PAGE and hit.store_tokens == 0
    with pytest.raises(PoolExhaustedError):
        alloc.allocate(5)  # 4 pinned, 4 free
    alloc.release(hit.pages)
    assert len(alloc.allocate(8)) == 8  # the idle cached pages were evicted


def test_without_a_store_evicted_pages_are_gone_tail_first(make_allocator):
    engine, alloc = make_allocator(None, pages=8)
    toks = tokens(6 * PAGE + 1)
    compute(engine, alloc, toks)  # 6 cached pages, 2 free
    compute(engine, alloc, tokens(7 * PAGE, seed=9))  # needs 7: evicts 5 of the 6
    assert alloc.stats()["evicted_pages"] == 5
    assert alloc.lookup(toks) == PAGE  # the head page is the one kept
    assert alloc.save(toks, [0]) == 0


def test_eviction_saves_only_pages_not_stored_yet(make_store, make_allocator):
    store = make_store()
    engine, alloc = make_allocator(store, pages=8, save_on="prefill")
    toks = tokens(6 * PAGE + 1)
    compute(engine, alloc, toks)
    assert alloc.flush(10)
    saved = alloc.stats()["save"]["saved_pages"]
    assert saved == 6
    compute(engine, alloc, tokens(7 * PAGE, seed=9))  # evicts the first prompt's pages
    assert alloc.flush(10)
    stats = alloc.stats()["save"]
    assert stats["skipped_stored"] == 5  # the 5 evicted pages were stored already
    assert stats["saved_pages"] == saved + 7


def test_save_returns_while_the_store_is_busy_and_queued_pages_are_loadable(make_store, make_allocator):
    gated = GatedStore(make_store())
    engine, alloc = make_allocator(gated)
    toks = tokens(3 * PAGE)
    _, pages, expected = compute(engine, alloc, toks)
    assert alloc.save(toks, pages[:3]) == 3  # returns at once: puts wait for the gate
    assert gated.put_started.wait(10)
    assert alloc.stats()["save"]["queued"] == 3
    other_engine, other = make_allocator(gated)
    # Another allocator over the same store does not see this one's queue...
    assert other.lookup(toks) == 0
    # ...but this one does, and loads from its staging.
    fresh = alloc.allocate(3)
    assert alloc.load(toks, fresh) == 3 * PAGE
    verify_pages(engine, fresh, expected[:3])
    alloc.release(fresh)
    gated.gate.set()
    assert alloc.flush(10)
    assert other.lookup(toks) == 3 * PAGE


def test_a_save_finding_staging_full_drops_pages_instead_of_waiting(make_store, make_allocator):
    gated = GatedStore(make_store())
    engine, alloc = make_allocator(gated, staging_bytes=2 * layout().page_nbytes)
    toks = tokens(5 * PAGE)
    _, pages, _ = compute(engine, alloc, toks)
    assert alloc.save(toks, pages[:5]) == 2
    assert alloc.stats()["save"]["dropped_full"] == 3
    gated.gate.set()
    assert alloc.flush(10)
    gated.gate.clear()  # puts wait again, so no slot frees up during the next save
    assert alloc.save(toks, pages[:5]) == 2  # the two stored ones are skipped, two more fit
    assert alloc.stats()["save"]["skipped_stored"] == 2
    gated.gate.set()


def test_a_closed_store_gives_misses_and_the_engine_keeps_serving(make_store, make_allocator, caplog):
    store = make_store()
    engine, alloc = make_allocator(store, pages=8)
    toks = tokens(3 * PAGE + 1)
    _, pages, _ = compute(engine, alloc, toks)
    store.close()
    assert alloc.save(toks, pages[:3]) == 0
    other_engine, other = make_allocator(store, pages=8)
    assert other.lookup(toks) == 0
    hit, _, _ = compute(other_engine, other, toks)
    assert hit.tokens == 0
    assert other.stats()["store_errors"] > 0
    assert "store unavailable" in caplog.text


def test_pool_exhausted_while_loading_cuts_the_prefix(make_store, make_allocator):
    store = make_store()
    a_engine, a = make_allocator(store)
    toks = tokens(6 * PAGE + 1)
    _, pages, _ = compute(a_engine, a, toks)
    a.save(toks, pages[:6])
    assert a.flush(10)
    b_engine, b = make_allocator(store, pages=8)
    held = b.allocate(5)  # leave 3 pages: too few to load 6
    hit = b.acquire(toks)
    assert hit.tokens == 0
    assert b.stats()["load_no_room"] == 1
    b.release(held)


def test_release_of_an_unpinned_page_is_an_error(make_allocator):
    from gdskv.errors import InvalidValueError

    engine, alloc = make_allocator()
    with pytest.raises(InvalidValueError):
        alloc.release([3])


def test_closed_allocator_refuses_work(make_allocator):
    from gdskv.errors import StoreClosedError

    engine, alloc = make_allocator()
    alloc.close()
    alloc.close()
    with pytest.raises(StoreClosedError):
        alloc.acquire(tokens(40))
