"""Making room in a store's DRAM: eviction of what is safe to evict, and puts that wait.

An entry may leave DRAM only when the offloader says it is evictable (its SSD copy is
COMPLETE, or there is no SSD tier and evicting drops it: the cache's job). Victims go in the
DRAM policy's order, each told to the listeners before its bytes go (two-phase eviction). A
put that finds no room and nothing evictable waits for the offloader to make some, up to its
deadline, then gets :class:`NoSpaceError`. Every method is called with the store lock held.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional

from gdskv.errors import NoSpaceError
from gdskv.metrics import Counters
from gdskv.store.listeners import Listeners
from gdskv.tiers.dram import DramEntry, DramTier, SsdState
from gdskv.types import Tier


class DramRoom:
    """Eviction and back-pressure for one DRAM tier (see the module docstring)."""

    def __init__(
        self, dram: DramTier, cond: threading.Condition, counters: Counters, listeners: Listeners, *,
        evictable: Callable[[DramEntry], bool], evicted: Callable[[bytes], None],
    ) -> None:
        """``evictable(entry)``: the offloader's say. ``evicted(key)``: told after each
        eviction (the promoter forgets the key's NVMe reads)."""
        self._dram = dram
        self._cond = cond
        self._counters = counters
        self._listeners = listeners
        self._evictable = evictable
        self._evicted = evicted
        self.waiters = 0  # puts waiting for room now

    def evict_until(self, until: Callable[[], bool]) -> bool:
        """Evict evictable entries in policy order until ``until()``; True if it now holds."""
        while not until():
            victim = next(self._dram.victims(self._evictable), None)
            if victim is None:
                return False
            self._counters.add("dram_evicted" if victim.ssd is SsdState.ON_SSD else "dram_dropped")
            self._counters.add("dram_evicted_bytes", victim.size)
            self._evicted(victim.key)
            self._listeners.evicting(Tier.DRAM, [victim.key])
            self._dram.detach(victim)
        return True

    def reserve(
        self, k: bytes, size: int, crc: int, deadline: float, *,
        check: Callable[[], None], why_full: Callable[[], Dict[str, object]],
    ) -> Optional[DramEntry]:
        """Make room for and reserve an unlisted DRAM entry (see
        :meth:`DramTier.reserve_unlisted`), evicting what may be evicted. None after waiting
        for the offloader to make room: the lock was released meanwhile, so the caller looks
        at the key again (``check()`` ran after the wait). Raises :class:`NoSpaceError`
        past ``deadline``, with ``why_full()`` in its context."""
        while True:
            entry = self._dram.reserve_unlisted(k, size)
            if entry is not None:
                entry.crc = crc
                return entry
            if self.evict_until(lambda: self._dram.fits(size)):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._counters.add("put_no_space")
                raise NoSpaceError(
                    "DRAM full and nothing evictable in time", key=k[:64], size=size,
                    dram_used=self._dram.used, dram_capacity=self._dram.capacity, **why_full(),
                )
            self._counters.add("put_waits")
            self.waiters += 1
            self._cond.notify_all()
            try:
                self._cond.wait(remaining)
            finally:
                self.waiters -= 1
            check()
            return None

    def room_made(self) -> None:
        """DRAM room may have been made: wake the puts waiting for it."""
        if self.waiters:
            self._cond.notify_all()

    def unpin(self, entries: "list[DramEntry]") -> None:
        """Release the read pins of ``entries``: free the bytes of those removed meanwhile,
        and wake the puts waiting for room (a pinned entry cannot be evicted)."""
        for entry in entries:
            entry.readers -= 1
            self._dram.release(entry)
        if entries:
            self.room_made()
