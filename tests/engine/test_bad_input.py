"""Bad input (issue 4): mismatched page sizes, layouts or namespaces between save and load,
and stored objects of the wrong size give a clear error or a miss — never KV of the wrong
shape copied into the engine."""

from __future__ import annotations

import numpy as np
import pytest

from gdskv.engine import KeyNamespace, LayoutMismatchError, OffloadConfig, OffloadingAllocator, PageLayout, PrefixKeys
from gdskv.engine.memory import MemoryEngine
from gdskv.errors import ConfigError, InvalidValueError

from .conftest import PAGE, layout, tokens

N_PAGES = 4


def saved_prompt(store, make_allocator, **writer):
    """A writer allocator saves N_PAGES pages of a prompt; returns the prompt."""
    engine, alloc = make_allocator(store, **writer)
    toks = tokens(N_PAGES * PAGE * 4 + 1)  # long enough for readers with 4x larger pages
    pages = alloc.allocate(N_PAGES)
    for i, page in enumerate(pages):
        engine.fill(page, seed=i)
    assert alloc.save(toks, pages) == N_PAGES
    assert alloc.flush(10)
    return toks


def verify_miss(alloc, engine, toks):
    assert alloc.lookup(toks) == 0
    fresh = alloc.allocate(2)
    before = engine.pool[fresh].copy()
    assert alloc.load(toks, fresh) == 0
    assert engine.writes == []
    assert np.array_equal(engine.pool[fresh], before)


@pytest.mark.parametrize(
    "reader",
    [
        dict(layout_changes=dict(page_size=2 * PAGE)),  # page size
        dict(kind="fused"),  # layout kind
        dict(layout_changes=dict(num_layers=4)),  # geometry
        dict(layout_changes=dict(head_dim=16)),
        dict(layout_changes=dict(dtype="bfloat16")),  # dtype
        dict(model_id="model-b"),  # another model
        dict(tp_rank=1, tp_size=2),  # another tensor-parallel rank
    ],
)
def test_a_store_written_under_another_namespace_gives_misses(make_store, make_allocator, reader):
    store = make_store()
    toks = saved_prompt(store, make_allocator)
    engine, alloc = make_allocator(store, **reader)
    verify_miss(alloc, engine, toks)


def test_the_same_namespace_hits(make_store, make_allocator):
    # The control of the test above: a reader with the writer's namespace finds the pages.
    store = make_store()
    toks = saved_prompt(store, make_allocator)
    engine, alloc = make_allocator(store)
    assert alloc.lookup(toks) == N_PAGES * PAGE


@pytest.mark.parametrize("delta", [-4, +4, -layout().segment_nbytes // 2])
@pytest.mark.parametrize("kind", ["per_layer", "fused"])
def test_a_stored_object_of_another_size_is_a_miss_and_never_reaches_the_engine(make_store, make_allocator, delta, kind):
    store = make_store()
    toks = saved_prompt(store, make_allocator, kind=kind)
    engine, alloc = make_allocator(store, kind=kind)
    # Replace the last segment of page 2 with an object of another size.
    key = PrefixKeys.segment_keys(alloc.keys.page_keys(toks, 3)[2], alloc.layout.num_segments)[-1]
    store.put(key, np.ones(alloc.layout.segment_nbytes + delta, dtype=np.uint8), overwrite=True)
    fresh = alloc.allocate(N_PAGES)
    assert alloc.load(toks, fresh) == 2 * PAGE  # pages 0 and 1; page 2 is a miss, so is 3
    assert engine.writes == fresh[:2]
    assert not engine.pool[fresh[2:]].any()
    assert alloc.stats()["size_mismatch"] == 1


def test_a_namespace_that_disagrees_with_the_engine_is_refused():
    engine = MemoryEngine(layout(), 4)
    for wrong in (
        KeyNamespace.for_layout("m", layout(page_size=2 * PAGE)),
        KeyNamespace.for_layout("m", layout(kind="fused")),
        KeyNamespace.for_layout("m", layout(dtype="float16")),
    ):
        with pytest.raises(LayoutMismatchError):
            OffloadingAllocator(engine, None, config=OffloadConfig(model_id="m"), namespace=wrong)


def test_an_engine_refuses_segments_of_the_wrong_size_or_count():
    engine = MemoryEngine(layout(), 4)
    (page,) = engine.allocate(1)
    size = engine.layout.segment_nbytes
    with pytest.raises(LayoutMismatchError):
        engine.write_page(page, [np.zeros(size, np.uint8)] * 2)
    with pytest.raises(LayoutMismatchError):
        engine.write_page(page, [np.zeros(size + 1, np.uint8)] * 3)


def test_an_engine_without_a_page_layout_is_refused():
    class NoLayout:
        layout = "per_layer"

    with pytest.raises(ConfigError):
        OffloadingAllocator(NoLayout(), None, config=OffloadConfig(model_id="m"))


@pytest.mark.parametrize("pages", [[0, -1], [0.5], ["1"], [True], 7])
def test_bad_page_lists_are_rejected(make_allocator, pages):
    engine, alloc = make_allocator()
    with pytest.raises(InvalidValueError):
        alloc.load(tokens(4 * PAGE), pages)


def test_more_pages_than_the_tokens_fill_is_rejected(make_allocator):
    engine, alloc = make_allocator()
    with pytest.raises(InvalidValueError):
        alloc.load(tokens(2 * PAGE + 3), [0, 1, 2])
    with pytest.raises(InvalidValueError):
        alloc.save(tokens(2 * PAGE), [0], start_page=2)
    with pytest.raises(InvalidValueError):
        alloc.load(tokens(2 * PAGE), [0], start_page=-1)


def test_pages_the_engine_did_not_allocate_are_rejected(make_store, make_allocator):
    engine, alloc = make_allocator(make_store())
    with pytest.raises(InvalidValueError):
        alloc.save(tokens(2 * PAGE), [0, 1])  # never allocated


@pytest.mark.parametrize(
    "fields",
    [dict(save_on="never"), dict(staging_bytes=0), dict(staging_bytes="lots"), dict(model_id="")],
)
def test_bad_offload_config_is_a_config_error(fields):
    with pytest.raises(ConfigError):
        config = OffloadConfig(**{"model_id": "m", **fields})
        OffloadingAllocator(MemoryEngine(layout(), 4), None, config=config)


@pytest.mark.parametrize(
    "fields",
    [dict(page_size=0), dict(num_layers=-1), dict(dtype="float64"), dict(kind="paged"), dict(head_dim=2.5)],
)
def test_bad_page_layout_is_a_config_error(fields):
    base = dict(page_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(ConfigError):
        PageLayout(**{**base, **fields})


def test_unknown_layout_kind_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        PageLayout(page_size=16, num_layers=1, num_kv_heads=1, head_dim=1, kind="paged")
    assert "per_layer" in str(info.value) and "fused" in str(info.value)


def test_a_page_missing_one_layer_is_a_plain_miss(make_store, make_allocator, caplog):
    store = make_store()
    toks = saved_prompt(store, make_allocator)
    engine, alloc = make_allocator(store)
    key = PrefixKeys.segment_keys(alloc.keys.page_keys(toks, 2)[1], alloc.layout.num_segments)[1]
    assert store.remove(key)
    assert alloc.lookup(toks) == PAGE
    fresh = alloc.allocate(N_PAGES)
    assert alloc._load_keys(alloc.keys.page_keys(toks, N_PAGES), fresh) == 1  # bypass the lookup
    assert engine.writes == fresh[:1]
    assert alloc.stats()["size_mismatch"] == 0
    assert "wrong size" not in caplog.text
