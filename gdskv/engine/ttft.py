"""TTFT per conversation round: the multi-turn benchmark on the reference engine.

Workload (in the style of SGLang's ``bench_multiturn.py``): ``conversations`` conversations,
``rounds`` rounds. A conversation starts with ``first_tokens`` random tokens; every later
round appends the previous answer (output length 1, so TTFT isolates prefill) and
``turn_tokens`` new user tokens to the whole history. All requests of a round arrive at
once; the engine serves them one at a time in a shuffled (seeded) order, and the next
round starts only when every request of this one is done and its saves and offloads have
reached the store (a barrier). A request's TTFT runs from its arrival (the round's start)
to its first token, queueing included; its ``service_s`` is its own service time (prefill
plus the saves it triggered).

Configurations (same model, pool, workload and capacities):

- ``device``: the engine's page pool only;
- ``dram``: + a gdskv DRAM tier (``ssd=0``);
- ``dram+ssd``: + DRAM and SSD (``offload="watermark"``, no promotion);
- ``dram+ssd+promote``: the same, with the store's promotion of NVMe objects into DRAM
  (``promote_after_reads`` at its default).

Capacities are derived from the workload so that the pool and DRAM run out part-way
(around round ``rounds // 2 + 1``); both are printed. The pool is saved to the store when it
evicts (``save_on="evict"``). Between rounds the page cache of the store's files is
dropped (``posix_fadvise DONTNEED`` on fsynced files) so SSD hits are read from the
device, not from the kernel's memory.

:func:`run` returns a :class:`TtftReport`; :func:`add_parser` registers ``gdskv bench-ttft``;
``benchmarks/bench_ttft.py`` is the script form. Reporting lives in
:mod:`gdskv.engine.ttft_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from gdskv.config import MiB, StoreConfig, format_size, parse_size
from gdskv.errors import ConfigError

#: Engines the benchmark drives: the reference engine, or vLLM with the gdskv connector
#: (:mod:`gdskv.engine.ttft_vllm`).
ENGINES = ("reference", "vllm")

#: The four configurations, in the order they run and are plotted.
CONFIGS = ("device", "dram", "dram+ssd", "dram+ssd+promote")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TtftConfig:
    """One benchmark run. Capacities left at None are derived from the workload."""

    #: Concurrent conversations. Default 8.
    conversations: int = 8
    #: Rounds per conversation. Default 8.
    rounds: int = 8
    #: Tokens of a conversation's first message. Default 1024.
    first_tokens: int = 1024
    #: New user tokens per later round. Default 128.
    turn_tokens: int = 128
    #: Tokens per KV page. Default 64.
    page_size: int = 64
    #: Model shape preset of :mod:`gdskv.engine.reference`. Default "small".
    shape: str = "small"
    #: Engine pool, in pages (None: about a quarter of round 1's KV). Default None.
    pool_pages: Optional[int] = None
    #: DRAM tier (None: pool + DRAM run out around round ``rounds // 2 + 1``). Default None.
    dram_bytes: Optional[int] = None
    #: SSD tier cap (None: twice the last round's KV). Default None.
    ssd_bytes: Optional[int] = None
    #: Configurations to run, from :data:`CONFIGS`. Default all four.
    configs: Sequence[str] = CONFIGS
    #: Seed of the workload (the model has its own). Default 0.
    seed: int = 0
    #: Where the JSON and the plots go. Default "bench-out/ttft".
    out_dir: str = "bench-out/ttft"
    #: Parent directory of the stores (None: the system temp dir). Default None.
    store_dir: Optional[str] = None
    #: Drop the store files' page cache between rounds. Default True.
    drop_page_cache: bool = True
    #: torch intra-op threads for the model. One leaves the other cores to the store's
    #: threads and keeps timings stable on a shared machine. Default 1.
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("conversations", "rounds", "first_tokens", "turn_tokens", "page_size", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError("must be a positive integer", field=name, got=value)
        if self.rounds < 2:
            raise ConfigError("need at least 2 rounds", field="rounds", got=self.rounds)
        for name in ("dram_bytes", "ssd_bytes"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, parse_size(value, field=name))
        object.__setattr__(self, "configs", tuple(self.configs))
        for name in self.configs:
            if name not in CONFIGS:
                raise ConfigError("unknown configuration", got=name, valid=", ".join(CONFIGS))


#: ``--quick``: the tiny model and a short workload (seconds; the smoke test runs it).
QUICK = dict(conversations=4, rounds=4, first_tokens=192, turn_tokens=48, page_size=16, shape="tiny")


@dataclasses.dataclass
class Plan:
    """Capacities of a run, in pages and bytes, and the KV of every round."""

    page_nbytes: int
    pool_pages: int
    dram_bytes: int
    ssd_bytes: int
    target_round: int
    round_pages: List[int]  # full pages of all prompts of round r (index r-1)


class Workload:
    """The token streams of every conversation, drawn from ``seed``."""

    def __init__(self, cfg: TtftConfig, vocab_size: int) -> None:
        rng = np.random.default_rng(cfg.seed)
        n = cfg.conversations
        self.first = [rng.integers(0, vocab_size, cfg.first_tokens, dtype=np.int64) for _ in range(n)]
        self.turns = [[rng.integers(0, vocab_size, cfg.turn_tokens, dtype=np.int64) for _ in range(cfg.rounds)] for _ in range(n)]
        self.order = [rng.permutation(n) for _ in range(cfg.rounds)]

    @staticmethod
    def prompt_tokens(cfg: TtftConfig, round_no: int) -> int:
        """Length of every prompt of round ``round_no`` (1-based)."""
        return cfg.first_tokens + (round_no - 1) * (cfg.turn_tokens + 1)


def plan(cfg: TtftConfig, page_nbytes: int) -> Plan:
    """Derive the capacities left unset in ``cfg`` from the workload's KV per round."""
    p = cfg.page_size
    lengths = [Workload.prompt_tokens(cfg, r) for r in range(1, cfg.rounds + 1)]
    round_pages = [cfg.conversations * (n // p) for n in lengths]
    largest_request = -(-lengths[-1] // p)
    pool = cfg.pool_pages or max(largest_request + 2, round_pages[0] // 4)
    if pool <= largest_request:
        raise ConfigError("pool too small for the longest prompt", pool_pages=pool, needed=largest_request + 1)
    target = cfg.rounds // 2 + 1
    if cfg.dram_bytes is None:
        # Every page leaves the pool through the store within a round or two (the pool is
        # small), so DRAM alone must hold the KV of round target-1 and not that of target.
        dram = max((round_pages[target - 2] + round_pages[target - 1]) // 2, 4) * page_nbytes
    else:
        dram = cfg.dram_bytes
    ssd = cfg.ssd_bytes if cfg.ssd_bytes is not None else max(2 * round_pages[-1] * page_nbytes, 64 * MiB)
    return Plan(page_nbytes=page_nbytes, pool_pages=pool, dram_bytes=dram, ssd_bytes=ssd, target_round=target, round_pages=round_pages)


def store_options(name: str, p: Plan) -> Optional[Dict[str, Any]]:
    """``gdskv.open`` options of configuration ``name`` (None: no store)."""
    if name == "device":
        return None
    if name == "dram":
        return dict(dram=p.dram_bytes, ssd=0)
    return dict(
        dram=p.dram_bytes,
        ssd=p.ssd_bytes,
        offload="watermark",
        promote_after_reads=StoreConfig().promote_after_reads if name == "dram+ssd+promote" else 0,
        bucket_bytes=min(16 * MiB, max(p.dram_bytes // 8, p.page_nbytes)),
    )


@dataclasses.dataclass
class TtftReport:
    """Every figure of a run (``as_dict`` is the JSON), and where the outputs went."""

    banner: Dict[str, Any]
    results: Dict[str, List[Dict[str, Any]]]  # config -> per-round figures
    acceptance: Dict[str, Any]
    json_path: Optional[Path] = None
    plot_paths: List[Path] = dataclasses.field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"banner": self.banner, "results": self.results, "acceptance": self.acceptance}


def run(cfg: TtftConfig, *, progress: bool = True, write: bool = True) -> TtftReport:
    """Run every configuration of ``cfg``; write the JSON and plots when ``write``.

    The configurations run interleaved request by request (request i of round r on each
    configuration, in an order rotated every request), so that a machine shared with other
    work slows them alike. See :class:`_ConfigRun` for how TTFT is accounted.
    """
    from gdskv.engine import ttft_report

    ttft_report.require_extras(plots=write)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress=progress, write=write)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: TtftConfig, *, progress: bool, write: bool) -> TtftReport:
    from gdskv.engine import ttft_report
    from gdskv.engine.reference import ModelShape

    shape = ModelShape.named(cfg.shape)
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    p = plan(cfg, kv_per_token * cfg.page_size)
    workload = Workload(cfg, shape.vocab_size)
    banner = _banner(cfg, shape, p)
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
    report = TtftReport(banner=banner, results=results, acceptance=ttft_report.acceptance(results, p.target_round))
    if write:
        ttft_report.write_outputs(report, Path(cfg.out_dir))
    return report


class _ConfigRun:
    """One configuration: its store, engine and conversation histories.

    The engine serves a round's requests one at a time and is never idle in between, so a
    request's TTFT (arrival at the round's start to first token) is the sum of the service
    times of the requests before it and its own. A service time is the prefill plus the
    wait for the saves it triggered: a save does not block the engine, but its CPU time is
    charged to the request that caused it rather than to whatever runs next.
    """

    def __init__(self, name: str, cfg: TtftConfig, shape, p: Plan, workload: Workload, path: Path) -> None:
        import gdskv
        from gdskv.engine.reference import ReferenceEngine

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
            _drop_page_cache(self.path)
        self._round = r
        self._requests: List[Dict[str, Any]] = []
        self._clock = 0.0
        self._disk_read = 0
        self._before = self.store.stats() if self.store is not None else None
        self._queued_before = self.engine.kv.stats()["pages_loaded_from_queue"]

    def serve(self, c: int) -> None:
        """Serve conversation ``c``'s request of the current round."""
        cfg, engine = self.cfg, self.engine
        t0, cpu0, io0 = time.perf_counter(), time.process_time(), _disk_read_bytes()
        res = engine.prefill(self.history[c])
        engine.kv.flush()
        service = time.perf_counter() - t0
        self._disk_read += _disk_read_bytes() - io0
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
        figures = _round_figures(self._round + 1, self._requests, self._before, after, queued, self.engine)
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


def _round_figures(round_no: int, requests, before, after, queued: int, engine) -> Dict[str, Any]:
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


def _disk_read_bytes() -> int:
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


def _drop_page_cache(root: Path) -> None:
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


def _banner(cfg: TtftConfig, shape, p: Plan) -> Dict[str, Any]:
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


# ====================================================================== command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TtftConfig()
    parser.add_argument("--engine", choices=ENGINES, default="reference", help="reference (default) or vllm: the real vLLM engine with the gdskv connector")
    parser.add_argument("--quick", action="store_true", help="tiny model, short workload (well under a minute)")
    parser.add_argument("--conversations", type=int, help=f"concurrent conversations (default {d.conversations})")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {d.rounds})")
    parser.add_argument("--first-tokens", type=int, help=f"tokens of the first message (default {d.first_tokens})")
    parser.add_argument("--turn-tokens", type=int, help=f"new user tokens a round (default {d.turn_tokens})")
    parser.add_argument("--page-size", type=int, help=f"tokens per KV page (default {d.page_size})")
    parser.add_argument("--shape", help=f"model shape preset (default {d.shape})")
    parser.add_argument("--pool-pages", type=int, help="engine pool in pages (default: derived)")
    parser.add_argument("--dram", help="DRAM tier, e.g. 256MiB (default: derived)")
    parser.add_argument("--ssd", help="SSD tier cap, e.g. 4GiB (default: derived)")
    parser.add_argument("--configs", help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--seed", type=int, help="workload seed (default 0)")
    parser.add_argument("--out", help=f"output directory (default {d.out_dir})")
    parser.add_argument("--store-dir", help="parent directory of the stores (default: system temp)")
    parser.add_argument("--keep-page-cache", action="store_true", help="do not drop the store files' page cache between rounds")
    parser.add_argument("--threads", type=int, help=f"torch intra-op threads (default {d.threads})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TtftConfig:
    fields: Dict[str, Any] = dict(QUICK) if args.quick else {}
    if args.quick and getattr(args, "engine", "reference") == "vllm":
        fields["page_size"] = 32  # vLLM's CPU attention: pages of a multiple of 32 tokens
    for arg, field in (
        ("conversations", "conversations"),
        ("rounds", "rounds"),
        ("first_tokens", "first_tokens"),
        ("turn_tokens", "turn_tokens"),
        ("page_size", "page_size"),
        ("shape", "shape"),
        ("pool_pages", "pool_pages"),
        ("seed", "seed"),
        ("threads", "threads"),
        ("out", "out_dir"),
        ("store_dir", "store_dir"),
    ):
        value = getattr(args, arg)
        if value is not None:
            fields[field] = value
    if args.dram is not None:
        fields["dram_bytes"] = parse_size(args.dram, field="--dram")
    if args.ssd is not None:
        fields["ssd_bytes"] = parse_size(args.ssd, field="--ssd")
    if args.configs:
        fields["configs"] = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    fields["drop_page_cache"] = not args.keep_page_cache
    return TtftConfig(**fields)


def run_command(args: argparse.Namespace) -> int:
    """Run the benchmark, print the banner, the table and the output paths."""
    from gdskv.engine import ttft_report

    cfg = config_from_args(args)
    if getattr(args, "engine", "reference") == "vllm":
        from gdskv.engine import ttft_vllm

        report = ttft_vllm.run(cfg, progress=not args.no_progress)
    else:
        report = run(cfg, progress=not args.no_progress)
    print(ttft_report.render(report))
    return 0


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``gdskv bench-ttft``."""
    p = sub.add_parser(
        "bench-ttft",
        help="TTFT and KV hit rate per conversation round: pool only, +DRAM, +DRAM+SSD, +promotion",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(p)
    p.set_defaults(func=run_command)


__all__ = ["CONFIGS", "QUICK", "TtftConfig", "TtftReport", "add_parser", "plan", "run"]
