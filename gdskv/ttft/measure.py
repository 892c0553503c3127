"""What the TTFT benchmark measures, the same way on every engine.

A request's TTFT runs from its arrival (the round's start) to its first token, queueing
included; its ``service_s`` is its own service time (prefill plus the saves it
triggered). :func:`round_figures` turns a round's requests and the store's counters before
and after into the figures of that round (hit rate, TTFT mean/p50/p90, tokens per tier).
Between rounds the page cache of the store's files is dropped (:func:`drop_page_cache`:
``posix_fadvise DONTNEED`` on fsynced files) so SSD hits are read from the device, not from
the kernel's memory; :func:`disk_read_bytes` shows that they were. :func:`banner` describes
the run.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from gdskv.config import format_size
from gdskv.ttft.workload import Plan, TtftConfig, Workload


def round_figures(
    round_no: int,
    requests: List[Dict[str, Any]],
    before: Optional[Dict[str, Any]],
    after: Optional[Dict[str, Any]],
    queued: int,
    engine,
) -> Dict[str, Any]:
    """The figures of round ``round_no``: ``requests`` as the runner recorded them, the
    store's ``stats()`` ``before`` and ``after`` it (None without a store), the tokens
    loaded from the save queue, and ``engine`` (whose ``kv.stats()`` are the allocator's)."""
    ttft = np.array([q["ttft_s"] for q in requests])
    prompt = sum(q["prompt_tokens"] for q in requests)
    device = sum(q["device_tokens"] for q in requests)
    stored = sum(q["store_tokens"] for q in requests)
    tiers = {"device_tokens": device, "dram_tokens": 0, "ssd_tokens": 0, "queued_tokens": queued}
    store = {}
    if before is not None:
        # The store counts hits per object, not per page: split the pages loaded from it
        # between DRAM and SSD in the proportion of its object hits.
        dram_hits = after["dram"]["hits"] - before["dram"]["hits"]
        ssd_hits = after.get("nvme", {}).get("hits", 0) - before.get("nvme", {}).get("hits", 0)
        from_store = stored - queued
        if dram_hits + ssd_hits:
            tiers["ssd_tokens"] = round(from_store * ssd_hits / (dram_hits + ssd_hits))
        tiers["dram_tokens"] = from_store - tiers["ssd_tokens"]
        store = {
            "dram_hits": dram_hits,
            "ssd_hits": ssd_hits,
            "dram_used_bytes": after["dram"]["used_bytes"],
            "dram_dropped": after["dram"]["dropped"] - before["dram"]["dropped"],
            "dram_evicted": after["dram"]["evicted"] - before["dram"]["evicted"],
            "promoted": after["promoted"] - before["promoted"],
            "nvme_used_bytes": after.get("nvme", {}).get("used_bytes", 0),
        }
    return {
        "round": round_no,
        "requests": requests,
        "prompt_tokens": prompt,
        "hit_rate": (device + stored) / prompt,
        "ideal_hit_rate": sum(q["ideal_tokens"] for q in requests) / prompt,
        "computed_tokens": sum(q["computed_tokens"] for q in requests),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "service_mean_s": float(np.mean([q["service_s"] for q in requests])),
        "cpu_mean_s": float(np.mean([q["cpu_s"] for q in requests])),
        **tiers,
        "store": store,
        "allocator": {k: v for k, v in engine.kv.stats().items() if k != "save"},
    }


def disk_read_bytes() -> int:
    """Bytes this process has read from storage devices (Linux ``/proc/self/io``; 0 elsewhere).
    Shows that SSD hits were read from the device, not from the page cache."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_page_cache(root: Path) -> None:
    """Drop the page cache of every file under ``root`` (best effort)."""
    for path in root.rglob("*"):
        if path.is_file():
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def banner(cfg: TtftConfig, shape, p: Plan) -> Dict[str, Any]:
    """The machine, model, workload and capacities of a run, as printed and written."""
    import torch

    lengths = [Workload.prompt_tokens(cfg, r) for r in (1, cfg.rounds)]
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_implementation()} {platform.python_version()}",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "model": shape.describe() + f", float32, seed {shape.seed}",
        "workload": (
            f"{cfg.conversations} conversations x {cfg.rounds} rounds; first message {cfg.first_tokens} tokens, "
            f"+{cfg.turn_tokens} user tokens and 1 output token a round; prompts {lengths[0]}..{lengths[1]} tokens; seed {cfg.seed}"
        ),
        "page": f"{cfg.page_size} tokens = {format_size(p.page_nbytes)} of KV",
        "kv_per_round": [format_size(n * p.page_nbytes) for n in p.round_pages],
        "pool": f"{p.pool_pages} pages = {format_size(p.pool_pages * p.page_nbytes)}",
        "dram": format_size(p.dram_bytes),
        "ssd": format_size(p.ssd_bytes),
        "memory_runs_out_near_round": p.target_round,
        "drop_page_cache": cfg.drop_page_cache,
        "configs": list(cfg.configs),
    }


__all__ = ["banner", "disk_read_bytes", "drop_page_cache", "round_figures"]
