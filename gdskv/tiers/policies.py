"""Eviction policies: small pluggable classes that order the residents of one tier.

A policy tracks *names* (object keys for DRAM/HBM, bucket ids for NVMe) and knows nothing
of sizes or bytes. The protocol:

- ``insert(name)``: a new resident (must not be tracked yet);
- ``touch(name)``: the resident was read (LRU moves it to the back; FIFO ignores it);
- ``remove(name)``: the resident left the tier (unknown names are ignored);
- ``victims()``: iterate residents in eviction order, first to go first. The tier decides
  which of them it can really evict (pinned or not-yet-offloaded ones are skipped), so the
  iteration must tolerate ``remove`` of the yielded name — it iterates over a snapshot.

The same classes drive the store and the trace simulator. Policies are registered by name;
:func:`make_policy` with an unknown name raises :class:`ConfigError` listing the valid ones.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Hashable, Iterator

from gdskv.errors import ConfigError


class EvictionPolicy:
    """Base class: insertion-ordered residents; subclasses decide what a touch does."""

    name = "base"

    def __init__(self) -> None:
        self._order: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, name: Hashable) -> None:
        self._order[name] = None
        self._order.move_to_end(name)

    def touch(self, name: Hashable) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def remove(self, name: Hashable) -> None:
        self._order.pop(name, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self._order))

    def ordered(self) -> Iterator[Hashable]:
        """Live iteration in eviction order: cheap, but stop before changing the policy."""
        return iter(self._order)

    def first_victim(self) -> Hashable | None:
        """The next resident to go, without taking a snapshot (None when empty)."""
        return next(iter(self._order), None)

    def __contains__(self, name: Hashable) -> bool:
        return name in self._order

    def __len__(self) -> int:
        return len(self._order)


class LruPolicy(EvictionPolicy):
    """Least recently used first: a touch moves the resident to the back."""

    name = "lru"

    def touch(self, name: Hashable) -> None:
        if name in self._order:
            self._order.move_to_end(name)


class FifoPolicy(EvictionPolicy):
    """First in, first out: reads do not change the order."""

    name = "fifo"

    def touch(self, name: Hashable) -> None:
        return None


POLICIES: Dict[str, Callable[[], EvictionPolicy]] = {
    LruPolicy.name: LruPolicy,
    FifoPolicy.name: FifoPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """Build the policy registered as ``name``."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError("unknown eviction policy", got=name, valid=", ".join(sorted(POLICIES))) from None
    return factory()
