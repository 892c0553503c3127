"""Who hears what a :class:`gdskv.Store` stores and evicts: :class:`StoreListener`.

Used by :mod:`gdskv.node` (its registrar tells the master). A listener is told, in the order
things happen:

- ``on_stored(tier, [(key, size, crc)])`` once objects are readable in a tier (a put or a
  promotion committed to DRAM, an HBM object evicted into DRAM, an offload COMPLETE on NVMe);
- ``on_evicting(tier, keys)`` *before* the store evicts objects from a tier for capacity:
  the bytes are still readable while the listener runs and freed only after it returns
  (two-phase eviction: a node tells the master first).

``remove``, overwrites and corrupt replicas dropped on read are not reported (the caller of
``remove`` knows; a corrupt replica is never served). Listeners run with the store's (or the
NVMe backend's) lock held: they must not call the store, and whatever they block on delays
the puts that evict. A listener that raises is logged and ignored.
"""

from __future__ import annotations

import logging
from typing import List, Tuple

from gdskv.types import Tier

log = logging.getLogger("gdskv.store")


class StoreListener:
    """Told when objects become readable in a tier and before they are evicted from one
    (see the module docstring for when and under which lock)."""

    def on_stored(self, tier: Tier, items: List[Tuple[bytes, int, int]]) -> None:
        """``items``: (key, size, crc) of objects now readable in ``tier``."""

    def on_evicting(self, tier: Tier, keys: List[bytes]) -> None:
        """``keys`` are about to be evicted from ``tier``; their bytes go when this returns."""


class Listeners:
    """The listeners of one store, told in the order they were added. Not locked: the
    store calls every method under its lock (the backend's eviction hook under the backend's)."""

    def __init__(self) -> None:
        self._listeners: List[StoreListener] = []

    def add(self, listener: StoreListener) -> None:
        self._listeners.append(listener)

    def remove(self, listener: StoreListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def stored(self, tier: Tier, items: List[Tuple[bytes, int, int]]) -> None:
        for listener in list(self._listeners) if items else ():
            try:
                listener.on_stored(tier, items)
            except Exception:
                log.exception("gdskv: store listener failed in on_stored")

    def evicting(self, tier: Tier, keys: List[bytes]) -> None:
        for listener in list(self._listeners) if keys else ():
            try:
                listener.on_evicting(tier, keys)
            except Exception:
                log.exception("gdskv: store listener failed in on_evicting")
