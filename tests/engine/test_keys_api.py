"""Store-level operations on page keys an engine already has (the SGLang path), and the
namespacing of engine page hashes."""

from __future__ import annotations

import numpy as np
import pytest

from gdskv.engine import KeyNamespace, PrefixKeys
from gdskv.errors import InvalidValueError

from .conftest import layout


def keys_for(model_id="model-a", **changes):
    return PrefixKeys(KeyNamespace.for_layout(model_id, layout(**changes)))


def test_external_keys_are_deterministic_and_namespaced():
    hashes = ["a" * 64, "b" * 64]
    a = keys_for().external_keys(hashes)
    assert a == keys_for().external_keys(hashes)
    assert len(set(a)) == 2
    assert a == keys_for().external_keys([h.encode() for h in hashes])
    other_model = keys_for("model-b").external_keys(hashes)
    other_page = keys_for(page_size=32).external_keys(hashes)
    assert not set(a) & set(other_model)
    assert not set(a) & set(other_page)
    # never the key of a token page either
    assert not set(a) & set(keys_for().page_keys(np.arange(64)))


def test_external_keys_reject_empty_or_wrong_types():
    with pytest.raises(InvalidValueError):
        keys_for().external_keys([""])
    with pytest.raises(InvalidValueError):
        keys_for().external_keys([12])


def test_save_keys_then_load_keys_byte_for_byte(make_store, make_allocator):
    store = make_store()
    a_engine, a = make_allocator(store)
    keys = a.keys.external_keys(["h0", "h1", "h2"])
    pages = a_engine.allocate(3)
    want = [a_engine.fill(p, seed=10 + i) for i, p in enumerate(pages)]
    assert a.save_keys(keys, pages) == 3
    assert a.stored_pages(keys) == 3  # queued or stored: visible at once
    assert a.flush(10)
    b_engine, b = make_allocator(store)
    assert b.stored_pages(keys) == 3
    assert b.stored_pages(keys[1:] + b.keys.external_keys(["nope"])) == 2
    fresh = b_engine.allocate(3)
    assert b.load_keys(keys, fresh) == 3
    for page, expected in zip(fresh, want):
        assert np.array_equal(b_engine.pool[page], expected)


def test_load_keys_stops_at_the_first_missing_page(make_store, make_allocator):
    store = make_store()
    engine, a = make_allocator(store)
    keys = a.keys.external_keys(["x0", "x1", "x2"])
    pages = engine.allocate(3)
    for i, p in enumerate(pages):
        engine.fill(p, seed=i)
    a.save_keys([keys[0], keys[2]], [pages[0], pages[2]])
    assert a.flush(10)
    fresh = engine.allocate(3)
    assert a.load_keys(keys, fresh) == 1


def test_key_operations_check_their_arguments(make_store, make_allocator):
    engine, a = make_allocator(make_store())
    keys = a.keys.external_keys(["k"])
    with pytest.raises(InvalidValueError):
        a.load_keys(keys, [0, 1])
    with pytest.raises(InvalidValueError):
        a.save_keys(["not-bytes"], [0])
    with pytest.raises(InvalidValueError):
        a.stored_pages([b""])


def test_another_namespace_sees_misses(make_store, make_allocator):
    store = make_store()
    engine, a = make_allocator(store, model_id="model-a")
    keys = a.keys.external_keys(["p0"])
    page = engine.allocate(1)
    engine.fill(page[0], seed=1)
    a.save_keys(keys, page)
    assert a.flush(10)
    _, b = make_allocator(store, model_id="model-b")
    assert b.stored_pages(b.keys.external_keys(["p0"])) == 0


def test_stage_pages_reads_several_spans_in_one_batch(make_store, make_allocator):
    store = make_store()
    engine, a = make_allocator(store)
    keys = a.keys.external_keys([f"s{i}" for i in range(4)])
    pages = engine.allocate(4)
    want = [engine.fill(p, seed=40 + i) for i, p in enumerate(pages)]
    a.save_keys(keys[:3], pages[:3])  # the fourth page is never stored
    assert a.flush(10)
    staged = a.stage_pages([keys[:2], [keys[2], keys[3], keys[0]], [keys[3]]])
    assert [len(span) for span in staged] == [2, 1, 0]
    for span, idx in ((staged[0], [0, 1]), (staged[1], [2])):
        for segs, i in zip(span, idx):
            assert np.array_equal(np.concatenate(segs), want[i])
    assert a.stats()["pages_loaded"] == 3


def test_read_pages_keeps_its_buffers_and_leaves_the_lock_free_while_reading(make_store, make_allocator):
    """read_pages (a loader thread's): the same pages as stage_pages, into buffers that a
    later stage call does not overwrite; while its store read is under way, another
    thread's allocator calls go on."""
    import threading

    store = make_store()
    engine, a = make_allocator(store)
    keys = a.keys.external_keys([f"q{i}" for i in range(3)])
    pages = engine.allocate(3)
    want = [engine.fill(p, seed=60 + i) for i, p in enumerate(pages)]
    a.save_keys(keys[:2], pages[:2])
    assert a.flush(10)
    reading, go_on = threading.Event(), threading.Event()
    real = store.batch_get_into

    def slow_batch_get_into(seg_keys, outs):
        reading.set()
        assert go_on.wait(10)
        return real(seg_keys, outs)

    store.batch_get_into = slow_batch_get_into
    got = []
    loader = threading.Thread(target=lambda: got.append(a.read_pages([keys, keys[1:2]])))
    loader.start()
    assert reading.wait(10)
    assert a.stored_pages(keys) == 2 and a.stats()["pages_loaded"] == 0  # not blocked
    go_on.set()
    loader.join(10)
    store.batch_get_into = real
    (spans,) = got
    assert [len(span) for span in spans] == [2, 1]
    a.stage_pages([keys[1:2]])  # the allocator's own staging: not read_pages' buffers
    for segs, i in zip(spans[0], (0, 1)):
        assert np.array_equal(np.concatenate(segs), want[i])
    assert np.array_equal(np.concatenate(spans[1][0]), want[1])
    assert a.stats()["pages_loaded"] == 4


def test_reserve_save_commits_pages_filled_segment_by_segment(make_store, make_allocator):
    store = make_store()
    engine, a = make_allocator(store)
    keys = a.keys.external_keys(["r0", "r1", "r2"])
    pages = engine.allocate(3)
    want = [engine.fill(p, seed=50 + i) for i, p in enumerate(pages)]
    res = a.reserve_save(keys + keys[:1])  # a repeated key gets one slot
    assert [index for index, _, _ in res.items] == [0, 1, 2]
    size = a.layout.segment_nbytes
    for layer in range(a.layout.num_segments):
        for k, (index, _key, _slot) in enumerate(res.items):
            res.segments(k)[layer][:] = want[index][layer * size : (layer + 1) * size]
    assert a.stored_pages(keys) == 0  # reserved pages are not visible before the commit
    assert a.reserve_save(keys).items == []  # nor reserved twice
    assert res.commit() == 3
    assert res.commit() == 0
    assert a.stored_pages(keys) == 3
    assert a.flush(10)
    fresh = engine.allocate(3)
    assert a.load_keys(keys, fresh) == 3
    for page, expected in zip(fresh, want):
        assert np.array_equal(engine.pool[page], expected)


def test_an_aborted_reservation_frees_its_slots(make_store, make_allocator):
    engine, a = make_allocator(make_store(), staging_bytes="64KiB")
    slots = a.stats()["save"]["free_slots"]
    res = a.reserve_save(a.keys.external_keys(["a0", "a1"]))
    assert a.stats()["save"]["free_slots"] == slots - 2
    res.abort()
    assert a.stats()["save"]["free_slots"] == slots
    assert a.stored_pages(a.keys.external_keys(["a0"])) == 0
    assert a.reserve_save(a.keys.external_keys(["a0"])).items  # reservable again


def test_without_a_store_nothing_is_reserved(make_allocator):
    _, a = make_allocator(None)
    res = a.reserve_save(a.keys.external_keys(["n0"]))
    assert res.items == [] and res.commit() == 0
    res.abort()
    assert a.stage_pages([a.keys.external_keys(["n0"])]) == [[]]
