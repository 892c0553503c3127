"""Store-level page I/O over per-layer KV tensors (the vLLM worker's view of its cache)."""

from __future__ import annotations

import numpy as np
import pytest

from gdskv.engine import LayoutMismatchError, OffloadConfig, OffloadingAllocator, PagedKVEngine, PageLayout, PoolExhaustedError
from gdskv.engine.tensor_pages import NoPagesEngine, TensorPagesEngine
from gdskv.errors import InvalidValueError

torch = pytest.importorskip("torch")

LAYOUT = PageLayout(page_size=16, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")


def cpu_caches(num_blocks=6, seed=0):
    """vLLM's CPU layout: [blocks, kv heads, block size, 2 * head dim] per layer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 2, 16, 16, generator=g) for _ in range(2)]


def gpu_caches(num_blocks=6, seed=0):
    """A GPU flash-attention layout: [2, blocks, block size, kv heads, head dim]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 16, 2, 8, generator=g) for _ in range(2)]


@pytest.mark.parametrize("make", [cpu_caches, gpu_caches])
def test_pages_move_between_two_caches_through_a_store(make_store, make, tmp_path):
    store = make_store()
    src, dst = make(seed=1), make(seed=2)
    a_engine = TensorPagesEngine(LAYOUT, src, num_blocks=6)
    b_engine = TensorPagesEngine(LAYOUT, dst, num_blocks=6)
    assert isinstance(a_engine, PagedKVEngine)
    a = OffloadingAllocator(a_engine, store, config=OffloadConfig(model_id="m"))
    b = OffloadingAllocator(b_engine, store, config=OffloadConfig(model_id="m"))
    toks = np.arange(3 * 16 + 5)
    assert a.save(toks, [4, 1, 3]) == 3
    assert a.flush(10)
    assert b.load(toks, [0, 5, 2]) == 3 * 16
    dim = a_engine.block_dims[0]
    for s, d in ((4, 0), (1, 5), (3, 2)):
        for layer in range(2):
            assert torch.equal(src[layer].select(dim, s), dst[layer].select(dim, d))
    untouched = make(seed=2)
    for layer in range(2):
        assert torch.equal(dst[layer].select(dim, 1), untouched[layer].select(dim, 1))
    a.close()
    b.close()


def test_wrong_geometry_is_refused():
    with pytest.raises(LayoutMismatchError):
        TensorPagesEngine(LAYOUT, [torch.zeros(6, 2, 16, 8)] * 2, num_blocks=6)  # half the bytes
    with pytest.raises(LayoutMismatchError):
        TensorPagesEngine(LAYOUT, cpu_caches()[:1], num_blocks=6)


def test_allocation_stays_with_the_engine():
    engine = TensorPagesEngine(LAYOUT, cpu_caches(), num_blocks=6)
    assert engine.num_free_pages == 0
    assert engine.allocate(0) == []
    with pytest.raises(PoolExhaustedError):
        engine.allocate(1)
    with pytest.raises(InvalidValueError):
        engine.read_page(6, [np.empty(LAYOUT.layer_nbytes, np.uint8)] * 2)
    with pytest.raises(LayoutMismatchError):
        engine.read_page(0, [np.empty(8, np.uint8)] * 2)


def test_a_lookup_only_allocator_answers_from_the_store(make_store):
    store = make_store()
    src = TensorPagesEngine(LAYOUT, cpu_caches(), num_blocks=6)
    a = OffloadingAllocator(src, store, config=OffloadConfig(model_id="m"))
    toks = np.arange(2 * 16 + 1)
    a.save(toks, [0, 1])
    assert a.flush(10)
    look = OffloadingAllocator(NoPagesEngine(LAYOUT), store, config=OffloadConfig(model_id="m", staging_bytes=LAYOUT.page_nbytes))
    assert look.lookup(toks) == 2 * 16
    assert look.stored_pages(look.keys.page_keys(toks)) == 2
    a.close()
    look.close()


def test_one_layer_of_one_block_at_a_time():
    src, dst = cpu_caches(seed=1), cpu_caches(seed=2)
    a = TensorPagesEngine(LAYOUT, src, num_blocks=6)
    b = TensorPagesEngine(LAYOUT, dst, num_blocks=6)
    buf = np.empty(LAYOUT.layer_nbytes, np.uint8)
    a.read_segment(4, 1, buf)
    b.write_segment(2, 1, buf)
    assert torch.equal(dst[1][2], src[1][4])
    assert not torch.equal(dst[0][2], src[0][4])  # the other layer is untouched
    with pytest.raises(InvalidValueError):
        a.read_segment(4, 2, buf)
    with pytest.raises(LayoutMismatchError):
        a.read_segment(4, 0, buf[:8])
