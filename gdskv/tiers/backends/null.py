"""The backend of a store without an NVMe tier (``ssd_bytes=0``): it holds nothing.

A null object, so that the store asks "what does NVMe hold of this key?" the same way with
or without an SSD: every lookup is a miss, every read a miss, every remove finds nothing.
Nothing is ever written to it (the store's offloader is a null one too): :meth:`write`
raises, so a bug that tries shows up at once.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from gdskv.errors import GdskvError
from gdskv.tiers.backends.base import ObjectInfo


class NullBackend:
    """No NVMe tier: stores nothing, finds nothing."""

    engine = None
    evict_listener: Optional[Callable[[List[bytes]], None]] = None

    def lookup(self, key: bytes) -> Optional[ObjectInfo]:
        return None

    def read_batch(self, items: Sequence[Tuple[bytes, memoryview]], on_verified: Any = None) -> List[Optional[int]]:
        return [None] * len(items)

    def write(self, items: Sequence[Any]) -> List[bytes]:
        raise GdskvError("the store has no NVMe tier to write to", objects=len(items))

    def remove(self, key: bytes) -> bool:
        return False

    def keys(self) -> List[bytes]:
        return []

    def check(self) -> List[bytes]:
        return []

    def __len__(self) -> int:
        return 0

    def __contains__(self, key: bytes) -> bool:
        return False

    def close(self) -> None:
        pass
