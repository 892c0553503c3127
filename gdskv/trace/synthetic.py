"""Synthetic multi-turn traces: for tests, examples and benchmarks without a real trace.

``synthetic_trace(n, seed=...)`` builds ``n`` requests from a pool of conversations. Each
request continues one conversation (chosen with a skew, so some are hot): its prompt is the
conversation so far plus 1..``max_new_blocks`` new blocks, behind one of a few shared system
prompts. A conversation that reaches ``max_blocks`` ends and a new one takes its place.
Arrivals are a Poisson process of ``rate_per_s`` requests per second. Block ids are
prefix-chained by :class:`gdskv.trace.model.BlockChainer`. Same arguments, same trace.
"""

from __future__ import annotations

import random
from typing import List

from gdskv.errors import ConfigError
from gdskv.trace.model import BlockChainer, Request, Trace


def synthetic_trace(
    n: int,
    *,
    seed: int = 0,
    conversations: int = 64,
    system_prompts: int = 4,
    system_blocks: int = 2,
    max_new_blocks: int = 4,
    max_blocks: int = 32,
    rate_per_s: float = 4.0,
    skew: float = 1.0,
    block_tokens: int = 16,
) -> Trace:
    """A deterministic synthetic trace; see the module docstring."""
    if n <= 0 or conversations <= 0 or max_new_blocks <= 0 or rate_per_s <= 0:
        raise ConfigError("n, conversations, max_new_blocks and rate_per_s must be positive")
    if max_blocks < system_blocks + max_new_blocks:
        raise ConfigError("max_blocks must hold the system prompt and one turn", max_blocks=max_blocks)
    rng = random.Random(seed)
    chainer = BlockChainer()
    next_content = iter(range(1 << 62))
    prompts = [[next(next_content) for _ in range(system_blocks)] for _ in range(max(1, system_prompts))]

    def new_conversation() -> List[int]:
        return list(rng.choice(prompts))

    pool = [new_conversation() for _ in range(conversations)]
    weights = [1.0 / (i + 1) ** skew for i in range(conversations)]
    requests = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        c = rng.choices(range(conversations), weights)[0]
        turn = [next(next_content) for _ in range(rng.randint(1, max_new_blocks))]
        if len(pool[c]) + len(turn) > max_blocks:
            pool[c] = new_conversation()
        pool[c].extend(turn)
        blocks = chainer.chain(pool[c])
        requests.append(
            Request(timestamp=t, input_length=len(blocks) * block_tokens, output_length=0, blocks=blocks)
        )
    return Trace(requests=requests, format="synthetic", block_tokens=block_tokens)
