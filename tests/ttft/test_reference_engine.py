"""The reference engine: logits after loading a cached prefix match a full prefill.

Tolerance: the prefix is loaded bit-exactly, but the suffix is computed in a different
batch shape than in one full pass, so float32 sums may round differently. We allow an
absolute difference of 1e-4 on logits of magnitude ~1 (float32 rounding is ~1e-7 here).
A corrupted prefix (the negative control) moves the logits far beyond that.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from gdskv.engine import LayoutMismatchError, PrefixKeys  # noqa: E402
from gdskv.errors import ConfigError, InvalidValueError  # noqa: E402
from gdskv.ttft.reference_engine import ModelShape, ReferenceEngine  # noqa: E402

torch.set_num_threads(1)  # tiny shapes: one thread is fastest on a shared machine

ATOL = 1e-4
PAGE = 16
SHAPE = ModelShape.named("tiny")


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SHAPE.vocab_size, n)


def engine(store=None, **kw) -> ReferenceEngine:
    kw.setdefault("pool_pages", 24)
    return ReferenceEngine(shape=SHAPE, page_size=PAGE, store=store, **kw)


def assert_close(got, want):
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"max |logit difference| {diff:.3g} > {ATOL}"


@pytest.mark.parametrize("kind", ["per_layer", "fused"])
def test_logits_after_loading_a_stored_prefix_match_a_full_prefill(make_store, kind):
    store = make_store()
    history = prompt(5 * PAGE + 7)
    follow_up = np.concatenate([history, prompt(21, seed=1)])
    with engine(store, kind=kind) as writer:
        first = writer.prefill(history)
        assert first.computed_tokens == len(history)
        assert writer.kv.save(history, writer.kv.acquire(history).pages) == 5
        writer.kv.flush(10)
        assert_close(first.logits, writer.reference_logits(history))
    with engine(store, kind=kind) as reader:  # a fresh pool: the prefix comes from the store
        res = reader.prefill(follow_up)
        assert res.store_tokens == 5 * PAGE and res.device_tokens == 0
        assert res.computed_tokens == len(follow_up) - 5 * PAGE
        assert_close(res.logits, reader.reference_logits(follow_up))
        assert res.token == int(torch.argmax(reader.reference_logits(follow_up)))


def test_logits_after_a_device_pool_hit_match_a_full_prefill():
    with engine() as eng:
        history = prompt(3 * PAGE + 2)
        eng.prefill(history)
        follow_up = np.concatenate([history, prompt(40, seed=2)])
        res = eng.prefill(follow_up)
        assert res.device_tokens == 3 * PAGE and res.store_tokens == 0
        assert_close(res.logits, eng.reference_logits(follow_up))
        again = eng.prefill(follow_up)  # now 5 full pages cached; the last token is recomputed
        assert again.computed_tokens == len(follow_up) - 5 * PAGE
        assert_close(again.logits, res.logits)


def test_a_corrupted_prefix_moves_the_logits_beyond_the_tolerance(make_store):
    # The negative control: the check above can fail.
    store = make_store()
    history = prompt(4 * PAGE + 1)
    follow_up = np.concatenate([history, prompt(9, seed=3)])
    with engine(store) as writer:
        writer.prefill(history)
        writer.kv.save(history, writer.kv.acquire(history).pages)
        writer.kv.flush(10)
    key = PrefixKeys.segment_keys(writer.kv.keys.page_keys(history, 2)[1], SHAPE.num_layers)[0]
    value = np.frombuffer(store.get(key), dtype=np.float32).copy()
    store.put(key, np.ascontiguousarray(value[::-1]), overwrite=True)  # same size, wrong KV
    with engine(store) as reader:
        res = reader.prefill(follow_up)
        assert res.store_tokens == 4 * PAGE
        diff = (res.logits - reader.reference_logits(follow_up)).abs().max().item()
        assert diff > 10 * ATOL


def test_eviction_saves_to_the_store_and_pages_come_back(make_store):
    store = make_store()
    with engine(store, pool_pages=8) as eng:
        a, b = prompt(6 * PAGE + 3, seed=4), prompt(7 * PAGE, seed=5)
        eng.prefill(a)
        eng.prefill(b)  # evicts a's pages into the store
        eng.kv.flush(10)
        res = eng.prefill(np.concatenate([a, prompt(5, seed=6)]))
        assert res.store_tokens > 0
        assert res.cached_tokens == 6 * PAGE
        assert_close(res.logits, eng.reference_logits(np.concatenate([a, prompt(5, seed=6)])))


def test_engines_with_another_seed_do_not_share_kv(make_store):
    store = make_store()
    history = prompt(3 * PAGE + 1)
    with engine(store) as writer:
        writer.prefill(history)
        writer.kv.save(history, writer.kv.acquire(history).pages)
        writer.kv.flush(10)
    other = ReferenceEngine(shape=ModelShape.named("tiny", seed=1), page_size=PAGE, pool_pages=8, store=store)
    with other:
        assert other.kv.lookup(history) == 0


def test_bad_requests_are_rejected():
    with engine(pool_pages=4) as eng:
        with pytest.raises(InvalidValueError):
            eng.prefill([])
        with pytest.raises(InvalidValueError):
            eng.prefill([SHAPE.vocab_size])
        with pytest.raises(InvalidValueError):
            eng.prefill([-1, 2])
        with pytest.raises(Exception) as info:
            eng.prefill(prompt(5 * PAGE))  # needs 5 pages, the pool has 4
        assert "exhausted" in str(info.value)
        assert eng.num_free_pages == 4  # nothing leaked
        (page,) = eng.allocate(1)
        with pytest.raises(LayoutMismatchError):
            eng.read_page(page, [np.zeros(8, np.uint8)] * SHAPE.num_layers)
        with pytest.raises(InvalidValueError):
            eng.free([99])


@pytest.mark.parametrize("kw", [dict(pool_pages=0), dict(pool_pages=4, kind="paged"), dict(pool_pages=4, dtype="float64x")])
def test_bad_engine_config_is_a_config_error(kw):
    with pytest.raises(ConfigError):
        engine(**kw)


def test_unknown_shape_lists_the_presets():
    with pytest.raises(ConfigError) as info:
        ModelShape.named("huge")
    assert "tiny" in str(info.value)
