"""The SGLang backend's modes, with every rank in a process of its own as SGLang runs them.

SGLang itself cannot run here (no GPU; its package is only in the sglang engine
environment), so each rank process gets the two names of SGLang's the backend imports
(``HiCacheStorage``, whose ``register_mem_pool_host`` keeps the pool, and
``HiCacheStorageConfig``) as a stand-in module, and the host pool of test_sglang.py.
The real base class and factory are tested in test_sglang.py (marked ``sglang``).
Checked: in mode auto two TP ranks, in two processes, share the host's node (one node),
each with its own keys; a rank's pages are read back by a later process of that rank
only; while the node is gone a rank's writes return False and its lookups miss.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

RANK = textwrap.dedent(
    """
    import dataclasses, json, sys, types
    import torch

    # Stand-ins for the two names of SGLang's the backend imports.
    class HiCacheStorage:
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

    @dataclasses.dataclass
    class HiCacheStorageConfig:
        tp_rank: int
        tp_size: int
        pp_rank: int
        pp_size: int
        is_mla_model: bool
        model_name: str
        extra_config: dict

    mod = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
    mod.HiCacheStorage, mod.HiCacheStorageConfig = HiCacheStorage, HiCacheStorageConfig
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["sglang.srt.mem_cache.hicache_storage"] = mod

    from gdskv.connectors.sglang import GdskvHiCacheStorage

    PAGE, LAYERS, HEADS, DIM, TOKENS = 16, 2, 2, 32, 16 * 4

    class HostPool:
        def __init__(self, seed):
            self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, LAYERS, HEADS, DIM
            self.dtype, self.layout = torch.bfloat16, "layer_first"
            g = torch.Generator().manual_seed(seed)
            self.kv_buffer = torch.randn(2, LAYERS, TOKENS, HEADS, DIM, generator=g).to(self.dtype)

        def get_data_page(self, index, flat=True):
            return self.kv_buffer[:, :, index : index + PAGE].flatten()

        def get_dummy_flat_data_page(self):
            return torch.zeros(2 * LAYERS * PAGE * HEADS * DIM, dtype=self.dtype)

        def set_from_flat_data_page(self, index, data_page):
            self.kv_buffer[:, :, index : index + PAGE] = data_page.reshape(2, LAYERS, PAGE, HEADS, DIM)

    path, rank, action = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = HiCacheStorageConfig(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, is_mla_model=False, model_name="tiny",
                               extra_config={"path": path, "dram": "16MiB", "ssd": "64MiB"})
    pool = HostPool(seed=rank)
    backend = GdskvHiCacheStorage(cfg)
    backend.register_mem_pool_host(pool)
    hashes = [f"{i:064x}" for i in range(1, 4)]
    pages = [pool.get_data_page(i * PAGE).clone() for i in range(3)]
    out = {"node_pid": backend.store.node_info().get("node_pid")}
    if action == "save":
        out["set"] = backend.batch_set(hashes, pages)
        out["flushed"] = backend.flush(30)
    elif action == "load":
        out["exists"] = backend.batch_exists(hashes)
        targets = [torch.zeros_like(p) for p in pages]
        got = backend.batch_get(hashes, targets)
        out["equal"] = [g is not None and bool(torch.equal(g, p)) for g, p in zip(got, pages)]
    elif action == "outage":
        import os, signal, time
        os.kill(int(sys.argv[4]), signal.SIGKILL)
        time.sleep(0.5)
        out["exists"] = backend.batch_exists(hashes)
        out["set"] = backend.batch_set(hashes, pages)
        out["attached"] = backend.store.available
    backend.close()
    print(json.dumps(out), flush=True)
    """
)


def run_rank(path: str, rank: int, action: str, *extra: str) -> dict:
    done = subprocess.run([sys.executable, "-c", RANK, path, str(rank), action, *extra], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@pytest.fixture
def short_dir():
    d = Path(tempfile.mkdtemp(prefix="gdskv-s-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_two_tp_ranks_in_two_processes_share_the_hosts_node(short_dir):
    path = str(short_dir / "kv")
    pids = set()
    try:
        saved = [run_rank(path, rank, "save") for rank in (0, 1)]
        pids |= {s["node_pid"] for s in saved}
        assert all(s["set"] and s["flushed"] for s in saved)
        assert len(pids) == 1 and None not in pids  # the first rank started it, the second attached
        for rank in (0, 1):  # a later process of each rank finds its own pages, whole
            loaded = run_rank(path, rank, "load")
            assert loaded["exists"] == 3 and loaded["equal"] == [True] * 3
        (node,) = pids
        gone = run_rank(path, 1, "outage", str(node))
        pids.add(gone["node_pid"])
        assert gone["exists"] == 0 and gone["set"] is False and gone["attached"] is False
    finally:
        for pid in pids - {None}:
            stop(pid)
