"""The TTFT benchmark's workload and capacities, shared by the runner of every engine.

Workload (in the style of SGLang's ``bench_multiturn.py``): ``conversations`` conversations,
``rounds`` rounds. A conversation starts with ``first_tokens`` random tokens; every later
round appends the previous answer (output length 1, so TTFT isolates prefill) and
``turn_tokens`` new user tokens to the whole history. All requests of a round arrive at
once; the engine serves them one at a time in a shuffled (seeded) order, and the next
round starts only when every request of this one is done and its saves and offloads have
reached the store (a barrier).

Configurations (same model, pool, workload and capacities):

- ``device``: the engine's page pool only;
- ``dram``: + a gdskv DRAM tier (``ssd=0``);
- ``dram+ssd``: + DRAM and SSD (``offload="watermark"``, no promotion);
- ``dram+ssd+promote``: the same, with the store's promotion of NVMe objects into DRAM
  (``promote_after_reads`` at its default).

Capacities are derived from the workload (:func:`plan`) so that the pool and DRAM run out
part-way (around round ``rounds // 2 + 1``); both are printed. :func:`store_options` gives
each configuration's ``gdskv.open`` options.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from gdskv.config import MiB, StoreConfig, parse_size
from gdskv.errors import ConfigError

#: Engines the benchmark drives: the reference engine (:mod:`gdskv.ttft.run_reference`), or
#: vLLM with the gdskv connector (:mod:`gdskv.ttft.run_vllm`).
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
    #: Model shape preset of :mod:`gdskv.ttft.reference_engine`. Default "small".
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


__all__ = ["CONFIGS", "ENGINES", "QUICK", "Plan", "TtftConfig", "Workload", "plan", "store_options"]
