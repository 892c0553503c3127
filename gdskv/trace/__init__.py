"""Trace replay and capacity planning: how much DRAM and SSD does a workload need?

- :func:`read_trace` reads Mooncake, Qwen-Bailian and generic JSON-lines traces into a
  :class:`Trace` of prefix-chained block ids (:mod:`gdskv.trace.readers`).
- :func:`replay` drives :class:`TierSimulator` — the store's own eviction policies and
  placement rules, no bytes and no I/O — and reports hit rates per tier
  (:mod:`gdskv.trace.replay`, :mod:`gdskv.trace.simulator`).
- :func:`sweep` replays many DRAM/SSD sizes; :func:`analyze_reuse` measures reuse gaps.
- ``gdskv trace replay|sweep|reuse`` is the command line (:mod:`gdskv.trace.command`).

Nothing here imports matplotlib until a plot is asked for.
"""

from __future__ import annotations

from gdskv.trace.errors import TraceFormatError
from gdskv.trace.model import BlockChainer, Request, Trace, chain_blocks, from_block_lists, ideal_hits
from gdskv.trace.readers import FORMATS, read_trace
from gdskv.trace.replay import ReplayReport, replay
from gdskv.trace.reuse import ReuseReport, analyze_reuse
from gdskv.trace.simulator import SimConfig, SimCounters, TierSimulator
from gdskv.trace.sweep import SweepReport, parse_size_list, sweep
from gdskv.trace.synthetic import synthetic_trace

__all__ = [
    "FORMATS",
    "BlockChainer",
    "ReplayReport",
    "Request",
    "ReuseReport",
    "SimConfig",
    "SimCounters",
    "SweepReport",
    "TierSimulator",
    "Trace",
    "TraceFormatError",
    "analyze_reuse",
    "chain_blocks",
    "from_block_lists",
    "ideal_hits",
    "parse_size_list",
    "read_trace",
    "replay",
    "sweep",
    "synthetic_trace",
]
