"""Counters for :meth:`gdskv.Store.stats`. A leaf module: imports nothing of gdskv.

Counters are plain integers and floats updated under the owner's lock; :class:`Counters`
only gives them names, a snapshot and derived rates.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict


class Counters:
    """Named numeric counters. Not locked: the owner serialises updates."""

    def __init__(self) -> None:
        self._values: Dict[str, float] = defaultdict(int)

    def add(self, name: str, amount: float = 1) -> None:
        self._values[name] += amount

    def get(self, name: str) -> float:
        return self._values.get(name, 0)

    def snapshot(self) -> Dict[str, float]:
        return dict(self._values)


def rate(nbytes: float, seconds: float) -> float:
    """Bytes per second, 0 when nothing was timed."""
    return nbytes / seconds if seconds > 0 else 0.0
