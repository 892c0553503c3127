"""The in-memory form of a trace: requests in timestamp order, each a list of block ids.

Block ids are *prefix-chained* ints: two requests share block ``i`` only if they share
every block up to and including ``i``, so a lookup of a request's blocks in order is a
prefix match. Readers of formats whose ids are not chained (Qwen-Bailian) chain them
before building a :class:`Trace`; see :func:`chain_blocks`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Hashable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from gdskv.errors import ConfigError


class Request(NamedTuple):
    """One request of a trace (a named tuple: immutable and cheap to build by the million)."""

    #: Arrival time in seconds from the start of the trace.
    timestamp: float
    #: Prompt tokens (0 when the format does not say).
    input_length: int
    #: Generated tokens (0 when the format does not say).
    output_length: int
    #: Prefix-chained block ids of the prompt, first block first.
    blocks: List[int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trace:
    """A parsed trace: requests sorted by timestamp (stable), plus what the reader saw."""

    #: Requests in timestamp order (ties keep file order).
    requests: List[Request]
    #: Format name the file was read as ("mooncake", "qwen", "generic").
    format: str
    #: Tokens per block, which turns a block into bytes of KV.
    block_tokens: int
    #: Where the trace came from ("" for one built in memory).
    path: str = ""
    #: Malformed lines skipped (only with ``skip_bad``).
    skipped: int = 0
    #: The first few skipped lines as ``(line number, reason)``.
    skipped_lines: Tuple[Tuple[int, str], ...] = ()

    @property
    def accesses(self) -> int:
        """Block accesses: the sum of every request's block count."""
        return sum(len(r.blocks) for r in self.requests)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].timestamp - self.requests[0].timestamp

    def block_lists(self) -> List[List[int]]:
        """The requests' block lists, in replay order (what the simulator consumes)."""
        return [r.blocks for r in self.requests]

    def unique_blocks(self) -> int:
        seen: set = set()
        for r in self.requests:
            seen.update(r.blocks)
        return len(seen)


def sort_requests(requests: List[Request]) -> List[Request]:
    """Return ``requests`` in timestamp order; a sorted list is returned as is."""
    for a, b in zip(requests, requests[1:]):
        if b.timestamp < a.timestamp:
            return sorted(requests, key=lambda r: r.timestamp)
    return requests


class BlockChainer:
    """Turns per-block content hashes into prefix-chained ids.

    ``chain(hashes)`` maps block ``i`` to one id for the pair (id of block ``i-1``, hash of
    block ``i``): equal ids then mean equal prefixes, as in an engine's prefix hash. Ids are
    dense ints from 0, shared across every request chained by the same instance.
    """

    def __init__(self) -> None:
        self._ids: Dict[Tuple[int, Hashable], int] = {}

    def chain(self, hashes: Iterable[Hashable]) -> List[int]:
        ids = self._ids
        out: List[int] = []
        parent = -1
        for h in hashes:
            key = (parent, h)
            cid = ids.get(key)
            if cid is None:
                cid = ids[key] = len(ids)
            out.append(cid)
            parent = cid
        return out

    def __len__(self) -> int:
        return len(self._ids)


def chain_blocks(block_hashes: Sequence[Sequence[Hashable]]) -> List[List[int]]:
    """Chain the per-block hashes of many requests (see :class:`BlockChainer`)."""
    chainer = BlockChainer()
    return [chainer.chain(h) for h in block_hashes]


class BlockInterner:
    """Maps arbitrary hashable block ids (e.g. strings) to dense ints, keeping equality."""

    def __init__(self) -> None:
        self._ids: Dict[Hashable, int] = {}

    def intern(self, blocks: Iterable[Hashable]) -> List[int]:
        ids = self._ids
        out = []
        for b in blocks:
            i = ids.get(b)
            if i is None:
                i = ids[b] = len(ids)
            out.append(i)
        return out


def ideal_hits(block_lists: Sequence[Sequence[int]]) -> int:
    """Blocks an infinite cache would serve: each request's leading run of seen blocks."""
    seen: set = set()
    add = seen.add
    hits = 0
    for blocks in block_lists:
        prefix = True
        for b in blocks:
            if prefix and b in seen:
                hits += 1
            else:
                prefix = False
                add(b)
    return hits


def from_block_lists(
    block_lists: Sequence[Sequence[int]],
    *,
    block_tokens: int = 16,
    timestamps: Optional[Sequence[float]] = None,
) -> Trace:
    """Build a trace from prefix-chained block lists (tests, examples, synthetic traces).

    Requests are ``i`` seconds apart unless ``timestamps`` are given.
    """
    times = list(timestamps) if timestamps is not None else [float(i) for i in range(len(block_lists))]
    if len(times) != len(block_lists):
        raise ConfigError("one timestamp per request", requests=len(block_lists), timestamps=len(times))
    requests = [
        Request(timestamp=float(t), input_length=len(b) * block_tokens, output_length=0, blocks=list(b))
        for t, b in zip(times, block_lists)
    ]
    return Trace(requests=sort_requests(requests), format="generic", block_tokens=block_tokens)
