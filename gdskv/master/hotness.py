"""Hotness: decayed access counters kept on each object.

A counter halves every ``half_life_s`` seconds. Instead of decaying every counter on a
timer, time is cut into epochs of one half-life; a counter remembers the epoch it was last
touched in and is halved once per epoch that passed when it is next touched. Touching is
O(1) and nothing runs in the background.
"""

from __future__ import annotations


class DecayClock:
    """Turns monotonic time into half-life epochs."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s

    def epoch(self, now: float) -> int:
        return int(now / self.half_life_s)


class Heat:
    """One decayed counter. Not locked: the registry's lock covers it."""

    __slots__ = ("value", "epoch")

    def __init__(self) -> None:
        self.value = 0.0
        self.epoch = 0

    def add(self, count: float, epoch: int) -> float:
        """Decay to ``epoch``, add ``count``, return the new value."""
        if epoch != self.epoch:
            passed = epoch - self.epoch
            self.value = self.value * 0.5**passed if passed < 64 else 0.0
            self.epoch = epoch
        self.value += count
        return self.value

    def read(self, epoch: int) -> float:
        passed = epoch - self.epoch
        return self.value * 0.5**passed if 0 < passed < 64 else (0.0 if passed >= 64 else self.value)
