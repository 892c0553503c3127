"""The TTFT benchmark on the reference engine (:mod:`gdskv.ttft.reference_engine`).

The workload, configurations and capacities are those of :mod:`gdskv.ttft.workload`; the
figures those of :mod:`gdskv.ttft.measure`. Each configuration gets its own store and
engine (:class:`_ConfigRun`); the configurations run interleaved request by request, so
that a machine shared with other work slows them alike. The pool is saved to the store
when it evicts (``save_on="evict"``).

:func:`run` returns a :class:`~gdskv.ttft.report.TtftReport`.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

import gdskv
from gdskv.ttft import report as ttft_report
from gdskv.ttft.measure import banner, disk_read_bytes, drop_page_cache, round_figures
from gdskv.ttft.reference_engine import ModelShape, ReferenceEngine
from gdskv.ttft.report import TtftReport
from gdskv.ttft.workload import Plan, TtftConfig, Workload, plan, store_options


def run(cfg: TtftConfig, *, progress: bool = True, write: bool = True) -> TtftReport:
    """Run every configuration of ``cfg``; write the JSON and plots when ``write``.

    The configurations run interleaved request by request (request i of round r on each
    configuration, in an order rotated every request), so that a machine shared with other
    work slows them alike. See :class:`_ConfigRun` for how TTFT is accounted.
    """
    ttft_report.require_extras(plots=write)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress=progress, write=write)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: TtftConfig, *, progress: bool, write: bool) -> TtftReport:
    shape = ModelShape.named(cfg.shape)
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    p = plan(cfg, kv_per_token * cfg.page_size)
    workload = Workload(cfg, shape.vocab_size)
    info = banner(cfg, shape, p)
    results: Dict[str, List[Dict[str, Any]]] = {name: [] for name in cfg.configs}
    total = len(cfg.configs) * cfg.rounds * cfg.conversations
    with tempfile.TemporaryDirectory(prefix="gdskv-ttft-", dir=cfg.store_dir) as tmp:
        runs = {}
        try:
            for name in cfg.configs:
                runs[name] = _ConfigRun(name, cfg, shape, p, workload, Path(tmp) / name.replace("+", "_"))
            with ttft_report.Progress(total, enabled=progress) as bar:
                for r in range(cfg.rounds):
                    for one in runs.values():
                        one.begin_round(r)
                    for i, c in enumerate(workload.order[r]):
                        bar.describe(f"round {r + 1}/{cfg.rounds}, request {i + 1}/{cfg.conversations}")
                        shift = (r * cfg.conversations + i) % len(cfg.configs)
                        for name in cfg.configs[shift:] + cfg.configs[:shift]:
                            runs[name].serve(int(c))
                            bar.advance()
                    for name, one in runs.items():
                        results[name].append(one.end_round())
                        one.settle()
        finally:
            for one in runs.values():
                one.close()
    return ttft_report.finish(info, results, p.target_round, Path(cfg.out_dir) if write else None)


class _ConfigRun:
    """One configuration: its store, engine and conversation histories.

    The engine serves a round's requests one at a time and is never idle in between, so a
    request's TTFT (arrival at the round's start to first token) is the sum of the service
    times of the requests before it and its own. A service time is the prefill plus the
    wait for the saves it triggered: a save does not block the engine, but its CPU time is
    charged to the request that caused it rather than to whatever runs next.
    """

    def __init__(self, name: str, cfg: TtftConfig, shape: ModelShape, p: Plan, workload: Workload, path: Path) -> None:
        self.name, self.cfg, self.workload, self.path = name, cfg, workload, path
        self.options = store_options(name, p)
        self.store = gdskv.open(path, **self.options) if self.options is not None else None
        self.engine = ReferenceEngine(shape=shape, pool_pages=p.pool_pages, page_size=cfg.page_size, store=self.store)
        _warm_up(self.engine, cfg)
        self.history = [f.copy() for f in workload.first]
        self.previous = [0] * cfg.conversations

    @property
    def has_ssd(self) -> bool:
        return bool(self.options and self.options.get("ssd"))

    def begin_round(self, r: int) -> None:
        if self.cfg.drop_page_cache and self.has_ssd:
            drop_page_cache(self.path)
        self._round = r
        self._requests: List[Dict[str, Any]] = []
        self._clock = 0.0
        self._disk_read = 0
        self._before = self.store.stats() if self.store is not None else None
        self._queued_before = self.engine.kv.stats()["pages_loaded_from_queue"]

    def serve(self, c: int) -> None:
        """Serve conversation ``c``'s request of the current round."""
        cfg, engine = self.cfg, self.engine
        t0, cpu0, io0 = time.perf_counter(), time.process_time(), disk_read_bytes()
        res = engine.prefill(self.history[c])
        engine.kv.flush()
        service = time.perf_counter() - t0
        self._disk_read += disk_read_bytes() - io0
        self._clock += service
        prompt = len(self.history[c])
        self._requests.append(
            dict(
                conversation=c,
                prompt_tokens=prompt,
                ideal_tokens=min(self.previous[c] // cfg.page_size, (prompt - 1) // cfg.page_size) * cfg.page_size,
                device_tokens=res.device_tokens,
                store_tokens=res.store_tokens,
                computed_tokens=res.computed_tokens,
                ttft_s=self._clock,
                service_s=service,
                prefill_s=res.seconds,
                cpu_s=time.process_time() - cpu0,
            )
        )
        self.previous[c] = prompt
        self.history[c] = np.concatenate([self.history[c], [res.token], self.workload.turns[c][self._round]])

    def end_round(self) -> Dict[str, Any]:
        after = self.store.stats() if self.store is not None else None
        queued = (self.engine.kv.stats()["pages_loaded_from_queue"] - self._queued_before) * self.cfg.page_size
        figures = round_figures(self._round + 1, self._requests, self._before, after, queued, self.engine)
        figures["disk_read_bytes"] = self._disk_read
        return figures

    def settle(self) -> None:
        """The barrier: this round's saves and SSD offloads finish before the next round."""
        self.engine.kv.flush()
        if self.has_ssd:
            self.store.flush()

    def close(self) -> None:
        self.engine.close()
        if self.store is not None:
            _close_quietly(self.store)


def _close_quietly(store) -> None:
    """Close a throw-away store without writing its DRAM-only objects to SSD (and without
    the warning that skipping this logs)."""
    logger = logging.getLogger("gdskv.store")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        store.close(drain=False)
    finally:
        logger.setLevel(level)


def _warm_up(engine, cfg: TtftConfig) -> None:
    """Run the model once per shape class so one-time kernel setup is not timed."""
    rng = np.random.default_rng(12345)
    for n in (cfg.turn_tokens + 1, cfg.first_tokens):
        engine.reference_logits(rng.integers(0, engine.shape.vocab_size, n))

__all__ = ["run"]
