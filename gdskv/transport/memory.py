"""An in-memory :class:`Provider`: a dict of values, for testing and measuring the data plane
without a store behind it."""

from __future__ import annotations

import threading
from typing import Dict, Iterator, List

from gdskv.transport.base import Provider, ServedItem, Staging
from gdskv.transport.frames import ItemStatus, value_crc


class MemoryProvider(Provider):
    """Serves values kept in a dict (key -> bytes). Thread-safe. PULL is not supported:
    every pulled key answers ERROR."""

    def __init__(self) -> None:
        self.values: Dict[bytes, bytes] = {}
        self._crcs: Dict[bytes, int] = {}
        self._lock = threading.Lock()

    def read(self, keys: List[bytes], rooms: List[int], staging: Staging) -> Iterator[List[ServedItem]]:
        items: List[ServedItem] = []
        with self._lock:
            found = [(self.values.get(k), self._crcs.get(k)) for k in keys]
        for i, (value, crc) in enumerate(found):
            if value is None:
                items.append(ServedItem(i, ItemStatus.MISS))
            elif len(value) > rooms[i]:
                items.append(ServedItem(i, ItemStatus.TOO_SMALL, size=len(value)))
            else:
                items.append(ServedItem(i, ItemStatus.OK, memoryview(value), crc or 0, tier=2))
        yield items

    def write(self, keys: List[bytes], values: List[memoryview], crcs: List[int]) -> List[ItemStatus]:
        out: List[ItemStatus] = []
        for key, value, crc in zip(keys, values, crcs):
            if value_crc(key, value) != crc:
                out.append(ItemStatus.CORRUPT)
                continue
            with self._lock:
                old = self.values.get(key)
                if old is not None and old != value:
                    out.append(ItemStatus.EXISTS)
                    continue
                self.values[key] = bytes(value)
                self._crcs[key] = crc
            out.append(ItemStatus.OK)
        return out

    def remove(self, keys: List[bytes]) -> List[ItemStatus]:
        with self._lock:
            return [ItemStatus.OK if self.values.pop(k, None) is not None and self._crcs.pop(k, 0) is not None
                    else ItemStatus.MISS for k in keys]

    def pull(self, keys: List[bytes]) -> List[ItemStatus]:
        return [ItemStatus.ERROR] * len(keys)
