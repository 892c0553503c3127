"""The device-pool prefix index: which engine pages hold which committed KV pages.

The index is the fastest tier of the prefix cache (the engine's own memory, HBM on a GPU).
It knows pages only by number and never touches their bytes. Contract:

- ``pin(pages)``: a request uses ``pages`` (fresh or indexed); pinned pages are never
  evicted. Pins nest.
- ``insert(key, page)``: ``page`` (pinned) now holds the KV of ``key``. False, and nothing
  changes, when ``key`` is already held by another page.
- ``match(keys)``: the pages holding the leading ``keys`` that are indexed (no side effect).
- ``unpin(pages)``: the request is done with them. An indexed page whose last pin goes
  becomes *idle* (kept, evictable); any other page whose last pin goes is returned, for
  the caller to give back to the engine.
- ``evict(n)``: forget up to ``n`` idle pages, least recently unpinned first; returns
  ``(key, page)`` pairs, for the caller to save and then free.

Idle pages are ordered by the time of their last unpin; within one unpin, later pages of
a sequence become idle first, so a sequence loses its tail before its head (its head is
what every later turn needs first). Not thread-safe: the owning allocator serialises calls.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from gdskv.errors import InvalidValueError


class DevicePrefixIndex:
    """See the module docstring."""

    def __init__(self) -> None:
        self._page_of: Dict[bytes, int] = {}
        self._key_of: Dict[int, bytes] = {}
        self._pins: Dict[int, int] = {}
        self._idle: "OrderedDict[int, None]" = OrderedDict()

    def lookup(self, key: bytes) -> Optional[int]:
        return self._page_of.get(key)

    def key_of(self, page: int) -> Optional[bytes]:
        return self._key_of.get(page)

    def match(self, keys: Sequence[bytes]) -> List[int]:
        pages: List[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def pin(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._pins[page] = self._pins.get(page, 0) + 1
            self._idle.pop(page, None)

    def insert(self, key: bytes, page: int) -> bool:
        if page not in self._pins:
            raise InvalidValueError("only a pinned page can be indexed", page=page)
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def unpin(self, pages: Sequence[int]) -> List[int]:
        """Unpin ``pages``; return those to give back to the engine. See the module docstring."""
        freed: List[int] = []
        for page in reversed(pages):
            pins = self._pins.get(page)
            if pins is None:
                raise InvalidValueError("page is not pinned", page=page)
            if pins > 1:
                self._pins[page] = pins - 1
                continue
            del self._pins[page]
            if page in self._key_of:
                self._idle[page] = None
            else:
                freed.append(page)
        return freed

    def evict(self, n: int) -> List[Tuple[bytes, int]]:
        out: List[Tuple[bytes, int]] = []
        while len(out) < n and self._idle:
            page, _ = self._idle.popitem(last=False)
            key = self._key_of.pop(page)
            del self._page_of[key]
            out.append((key, page))
        return out

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def pinned(self) -> int:
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._page_of)
