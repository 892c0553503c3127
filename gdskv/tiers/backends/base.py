"""The storage backend protocol: how the NVMe tier lays objects out on disk.

A backend decides *where* bytes go; an :class:`gdskv.gds.IoEngine` moves them. Every backend
keeps its own key index, persists it so that a reopen finds every object that was durable,
and enforces its byte cap by evicting at its own granularity (whole buckets for the bucket
backend). Primitives and their contracts:

- ``recover() -> RecoveryReport``: scan the directory once at open; rebuild the index from
  what is intact; drop (delete, count, log) what is torn or corrupt; never raise for a
  corrupt object, raise :class:`FormatVersionError` for a newer format.
- ``write(items) -> list[bytes]``: make every ``(key, value, crc)`` durable and readable,
  evicting older objects if the cap requires; returns the keys evicted to make room. On an
  I/O error nothing of the batch becomes visible and :class:`IoError` is raised.
- ``lookup(key) -> ObjectInfo | None``: size and checksum of a stored object.
- ``read_batch(items) -> list[int | None]``: fill each ``out`` with the value of ``key`` and
  return its size; ``None`` is a miss: absent, failed its checksum, or unreadable (the last
  two are counted, logged and the replica dropped). Bytes are verified before a size is
  returned, so a returned size always means correct bytes.
- ``remove(key) -> bool``: forget the object durably (a reopen does not bring it back).
- ``check() -> list[bytes]``: verify every object; drop and return the corrupt ones' keys.
- ``keys()``, ``__len__``, ``used_bytes``, ``capacity``, ``stats()``, ``close()``.
- ``evict_listener``: when set (by the store), called with the keys of objects about to be
  evicted for capacity, *before* their bytes are deleted (with the backend's lock held, so
  it must be quick and must not call the backend). Not called for ``remove`` or for
  objects dropped as corrupt.

Backends are thread-safe: reads run concurrently with a write and with each other.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from crc32c import crc32c

from gdskv.errors import InvalidValueError, StoreClosedError


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    size: int
    crc: int


@dataclasses.dataclass
class RecoveryReport:
    """What a backend found when it reopened its directory."""

    objects: int = 0
    bytes: int = 0
    containers: int = 0  # buckets (or files) that were intact
    dropped_torn: int = 0  # unsealed / partly written containers removed
    dropped_corrupt: int = 0  # containers or objects that failed verification

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


WriteItem = Tuple[bytes, memoryview, int]  # key, value view, crc32c(key + value)
ReadItem = Tuple[bytes, memoryview]  # key, destination view (at least the value's size)


class StorageBackend:
    """Base class; see the module docstring for the contract of each primitive."""

    name = "base"
    capacity: int
    evict_listener: Optional[Callable[[List[bytes]], None]] = None

    def recover(self) -> RecoveryReport:  # pragma: no cover
        raise NotImplementedError

    def write(self, items: Sequence[WriteItem]) -> List[bytes]:  # pragma: no cover
        raise NotImplementedError

    def lookup(self, key: bytes) -> Optional[ObjectInfo]:  # pragma: no cover
        raise NotImplementedError

    def read_batch(self, items: Sequence[ReadItem]) -> List[Optional[int]]:  # pragma: no cover
        raise NotImplementedError

    def remove(self, key: bytes) -> bool:  # pragma: no cover
        raise NotImplementedError

    def check(self) -> List[bytes]:  # pragma: no cover
        raise NotImplementedError

    #: Subdirectory of the store directory that holds this backend's files.
    subdir = ""

    def __init__(
        self, root: Path, engine: Any, *, capacity: int, eviction: str = "fifo", verify_on_open: str = "index"
    ) -> None:
        """Set up what every backend has: its directory, engine, cap, policy and lock."""
        from gdskv.tiers.policies import make_policy  # a sibling layer: keep this module light

        self.dir = Path(root) / self.subdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.capacity = capacity
        self.verify_on_open = verify_on_open
        self._policy = make_policy(eviction)
        self._lock = threading.Lock()
        self._closed = False

    def _value_len(self, key: bytes) -> Optional[int]:
        """Size of the stored value of ``key`` or None (lock held). The default suits
        backends whose ``_objects`` values carry ``value_len`` (index entries)."""
        entry = self._objects.get(key)
        return None if entry is None else entry.value_len

    def _check_out_sizes(self, items: Sequence[ReadItem]) -> None:
        """Raise InvalidValueError, before any read starts, for an ``out`` that is too small
        for its value (lock held)."""
        for key, out in items:
            size = self._value_len(key)
            if size is not None and out.nbytes < size:
                raise InvalidValueError("output buffer smaller than the value", key=key[:64], size=size, got=out.nbytes)

    def _verify_reads(
        self, future: Any, items: Sequence[ReadItem], slots: Sequence[Tuple[int, Any]], results: List[Optional[int]]
    ) -> List[Tuple[int, Any, str]]:
        """Verify each read of ``future`` as soon as it completes, while the rest are in flight.

        Request ``j`` of the batch read ``items[slots[j][0]]``, whose index entry is
        ``slots[j][1]`` (with ``value_len`` and ``crc``). A verified read sets its size in
        ``results``; the failed ones are counted and returned as ``(j, entry, why)`` for the
        caller to drop.
        """
        bad: List[Tuple[int, Any, str]] = []
        for j, outcome in future.as_completed():
            i, entry = slots[j]
            key, out = items[i]
            size = entry.value_len
            if isinstance(outcome, BaseException):
                self.counters["read_errors"] += 1
                bad.append((j, entry, f"read failed: {outcome}"))
            elif outcome != size or crc32c(out if out.nbytes == size else out[:size], crc32c(key)) != entry.crc:
                self.counters["corrupt_reads"] += 1
                bad.append((j, entry, "value checksum mismatch" if outcome == size else f"read {outcome} of {size} bytes"))
            else:
                results[i] = size
        return bad

    # -- shared bookkeeping ---------------------------------------------------------
    # Subclasses keep ``self._objects`` (key -> their own record of it), ``self._lock``,
    # ``self._closed``, ``self.counters`` (name -> int) and ``self.dir``, and implement
    # ``used_bytes``; the queries below then come for free.

    _objects: Dict[bytes, Any]
    _lock: threading.Lock
    _closed: bool
    counters: Dict[str, int]
    dir: Path

    def keys(self) -> List[bytes]:
        with self._lock:
            return list(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: bytes) -> bool:
        return key in self._objects

    @property
    def used_bytes(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def layout_stats(self) -> Dict[str, Any]:
        """Backend-specific figures for :meth:`stats` (called with the lock held)."""
        return {}

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "backend": self.name,
                "objects": len(self._objects),
                "used_bytes": self.used_bytes,
                "capacity": self.capacity,
                **self.layout_stats(),
                **self.counters,
            }

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("backend is closed", path=str(self.dir))

    def close(self) -> None:  # pragma: no cover
        raise NotImplementedError
