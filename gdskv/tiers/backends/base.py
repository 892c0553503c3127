"""The storage backend protocol: how the NVMe tier lays objects out on disk.

A backend decides *where* bytes go; an :class:`gdskv.gds.IoEngine` (``backend.engine``)
moves them: every read and write of a record goes through it. Every backend keeps its own
key index, persists it so that a reopen finds every object that was durable, and enforces
its byte cap by evicting at its own granularity (whole buckets for the bucket backend).

What a backend offers (what :mod:`gdskv.store` uses), and the contract of each:

- ``recover() -> RecoveryReport``: scan the directory once at open; rebuild the index from
  what is intact; drop (delete, count, log) what is torn or corrupt; never raise for a
  corrupt object, raise :class:`FormatVersionError` for a newer format. With
  ``verify_on_open="full"`` every record is verified as ``check()`` verifies it.
- ``write(items) -> list[bytes]``: make every ``(key, value, crc)`` durable and readable,
  evicting older objects if the cap requires; returns the keys evicted to make room. On an
  I/O error nothing of the batch becomes visible and :class:`IoError` is raised.
- ``lookup(key) -> ObjectInfo | None``: size and checksum of a stored object.
- ``read_batch(items) -> list[int | None]``: fill each ``out`` with the value of ``key`` and
  return its size; ``None`` is a miss: absent, failed its checksum, or unreadable (the last
  two are counted, logged and the replica dropped, except after a failure that says nothing
  of the replica, :func:`transient`, or any once the backend is closed; those are only
  counted). Bytes are verified before a size is returned, so a returned size always means
  correct bytes.
- ``remove(key) -> bool``: forget the object durably (a reopen does not bring it back).
- ``check() -> list[bytes]``: verify every object (:func:`verify`); drop, count in
  ``corrupt_reads`` and return the corrupt ones' keys. An object removed, replaced or
  evicted while it runs, or one that cannot be read for now, is not judged.
- ``keys()``, ``__len__``, ``used_bytes``, ``capacity``, ``stats()``, ``close()``
  (idempotent; later calls raise :class:`StoreClosedError`).
- ``evict_listener``: when set (by the store), called with the keys of objects about to be
  evicted for capacity, *before* their bytes are deleted (with the backend's lock held, so
  it must be quick and must not call the backend). Not called for ``remove`` or for
  objects dropped as corrupt.

Backends are thread-safe: reads run concurrently with a write and with each other.

Written once here: ``read_batch`` (groups submitted as they are planned, each read verified
as it completes), ``check``, ``lookup``, ``keys``, ``stats``, the choice of eviction victims,
and the one rule that judges a
record read back (:func:`verify`, applied by :class:`RecordReader`). A backend provides
these hooks, each called with its lock held:

- ``_entry_of(key)``: the :class:`IndexEntry` of the key's current replica, or None.
- ``_plan_reads(items, start, end, plan, pins)``: look up, pin and build the read requests
  of ``items[start:end]``; ``_unpin_reads(pins)`` releases what it pinned.
- ``_pin_record(entry) -> (pin, fd, path, record start)``: pin one record as a read does,
  for ``check()``; raises ``OSError``, nothing pinned, when its file cannot be opened.
- ``_drop_corrupt(entry, why)``: log and drop a replica that failed its read or check,
  unless it is not current any more; never raises.
- ``_victim_size(name)``: the bytes evicting the eviction policy's resident ``name`` (a
  key, or a bucket id) frees, or None to pass over it; :meth:`StorageBackend._victims`
  then picks the victims in policy order, and the backend evicts them its own way.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from crc32c import crc32c

from gdskv.errors import CorruptionError, FormatVersionError, GdskvError, InvalidValueError, NoSpaceError, StoreClosedError
from gdskv.gds.aligned import AlignedBuffer, alloc_aligned
from gdskv.gds.engine import IoRequest
from gdskv.tiers.backends.record import RECORD_HEADER, IndexEntry, checksum, decode_head, head_size

log = logging.getLogger(__name__)


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


#: Reads of a batch handed to the engine at once (see :meth:`StorageBackend.read_batch`).
READ_GROUP = 16

#: Read failures that say nothing about the replica (this process's descriptors or memory
#: ran short, or a descriptor was closed under the read): the read is a miss, the replica
#: is kept.
TRANSIENT_ERRNOS = frozenset({errno.EBADF, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR})

WriteItem = Tuple[bytes, memoryview, int]  # key, value view, crc32c(key + value)
ReadItem = Tuple[bytes, memoryview]  # key, destination view (at least the value's size)


def transient(exc: BaseException) -> bool:
    """Whether the read failure ``exc`` says nothing of the replica: an errno of
    :data:`TRANSIENT_ERRNOS` (an ``OSError``'s, or an ``IoError``'s ``errno`` context), or
    an ``out`` buffer the engine could not use (the caller's fault)."""
    if isinstance(exc, InvalidValueError):
        return True
    code = getattr(exc, "context", {}).get("errno", getattr(exc, "errno", None))
    return code in TRANSIENT_ERRNOS


def verify(head: "bytes | bytearray | memoryview", value: memoryview, entry: IndexEntry, *, path: str = "", offset: int = 0) -> None:
    """Check a record read back against the index ``entry`` that lists it; pure (reads
    nothing, changes nothing). Returns None when the record is the one ``entry`` describes,
    else raises :class:`CorruptionError` naming the first thing that disagrees, with
    ``path``, ``offset`` (where the record starts), and what was expected and got.

    ``head``: the record's head block from its start (header and key at least); ``value``:
    the bytes where ``entry`` says the value is. The one rule for every backend: the header
    is intact (magic, header CRC32C, a format this gdskv reads: a record newer than the
    index that lists it is corrupt too), holds the key, value length, sequence number and
    CRC32C the index says, and CRC32C(key + value) is that CRC32C."""
    try:
        header = decode_head(head, path=path, offset=offset)
    except FormatVersionError as exc:
        raise CorruptionError("record of a newer format than its index", path=path, offset=offset, got=exc.context.get("got")) from exc
    key = bytes(head[RECORD_HEADER.size : RECORD_HEADER.size + header.key_len])
    if key != entry.key:
        raise CorruptionError("record holds another key than its index lists", path=path, offset=offset, expected=entry.key[:64], got=key[:64])
    expected, got = (entry.value_len, entry.seq, entry.crc), (header.value_len, header.seq, header.crc)
    if got != expected:
        raise CorruptionError("record header disagrees with the index", path=path, offset=offset, expected=expected, got=got)
    if value.nbytes != entry.value_len:
        raise CorruptionError("record shorter than its index says", path=path, offset=offset, expected=entry.value_len, got=value.nbytes)
    crc = checksum(key, value)
    if crc != entry.crc:
        raise CorruptionError("value checksum mismatch", path=path, offset=offset, expected=entry.crc, got=crc)


class RecordReader:
    """Reads whole records back through the I/O engine and :func:`verify` s them, into one
    page-aligned buffer reused from record to record (grown when a record needs more):
    for ``check()`` and a full verification at open. ``close()`` frees the buffer."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._buf: Optional[AlignedBuffer] = None

    def verify(self, fd: int, path: str, start: int, entry: IndexEntry) -> Optional[str]:
        """Why the record of ``entry`` at ``start`` of ``fd`` is not intact, or None when it
        is, or when its read failed in a way that says nothing of it (:func:`transient`:
        logged, not judged). Any other read failure (EIO, a short file) is a verdict."""
        head_len = head_size(len(entry.key))
        size = head_len + entry.value_len
        if self._buf is None or self._buf.nbytes < size:
            self.close()
            self._buf = alloc_aligned(size, huge=False)
        view = self._buf.view
        head, value = view[:head_len], view[head_len:size]
        try:
            self.engine.run([IoRequest.read(fd, start, head, value, path=path)])
            verify(head, value, entry, path=path, offset=start)
        except CorruptionError as exc:
            return str(exc)
        except (OSError, GdskvError) as exc:
            if transient(exc):
                log.warning("gdskv: could not read %r in %s for now: %s", entry.key[:64], path, exc)
                return None
            return f"read failed: {exc}"
        finally:
            head.release()
            value.release()
        return None

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StorageBackend:
    """Base class; see the module docstring for the contract of each primitive."""

    name = "base"
    capacity: int
    evict_listener: Optional[Callable[[List[bytes]], None]] = None

    def recover(self) -> RecoveryReport:  # pragma: no cover
        raise NotImplementedError

    def write(self, items: Sequence[WriteItem]) -> List[bytes]:  # pragma: no cover
        raise NotImplementedError

    def read_batch(
        self, items: Sequence[ReadItem], on_verified: Optional[Callable[[int, int, int], None]] = None
    ) -> List[Optional[int]]:
        """Read and verify a batch of values (see the module docstring).

        ``on_verified(i, size, crc)``, when given, runs (outside the lock) as soon as the read
        of ``items[i]`` is verified (``crc``: the CRC32C its bytes were checked against),
        while the rest of the batch is still in flight: a caller can start using that value
        at once (the store starts a device copy there).

        The batch goes to the engine in groups of :data:`READ_GROUP`: each group is looked
        up and pinned under the lock (:meth:`_plan_reads`) and submitted at once, so the
        device works on the first group while the next ones are planned. Then every read
        is verified as it completes (:meth:`_verify_reads`), the pins are released
        (:meth:`_unpin_reads`, never while a read is in flight) and the replicas that failed
        are dropped (:meth:`_drop_corrupt`). An ``out`` too small for its value raises
        :class:`InvalidValueError` before its group is submitted; groups already in flight
        are waited for, and nothing is returned.
        """
        results: List[Optional[int]] = [None] * len(items)
        plan: List[Tuple[int, Any]] = []  # request j of the batch reads items[i] of entry: plan[j] = (i, entry)
        pins: List[Any] = []  # what request j pinned
        futures: List[Tuple[int, Any]] = []  # (index of the group's first request, its future)
        bad: List[Tuple[Any, str]] = []
        verified = False
        try:
            for start in range(0, len(items), READ_GROUP):
                first = len(plan)
                with self._lock:
                    self._check_open()
                    requests = self._plan_reads(items, start, min(start + READ_GROUP, len(items)), plan, pins)
                if requests:
                    futures.append((first, self.engine.submit(requests)))
            for first, future in futures:
                self._verify_reads(future, items, plan, first, results, bad, on_verified)
            verified = True
        finally:
            if not verified:  # an error left reads in flight: they end before their pins go
                for _, future in futures:
                    try:
                        future.outcomes()
                    except Exception:  # noqa: BLE001 - only waiting here; the first error propagates
                        pass
            with self._lock:
                self._unpin_reads(pins)
        if bad:
            with self._lock:
                if not self._closed:  # a read cut short by close() says nothing of the replica
                    for entry, why in bad:
                        self._drop_corrupt(entry, why)
        return results

    def _plan_reads(
        self, items: Sequence[ReadItem], start: int, end: int, plan: List[Tuple[int, Any]], pins: List[Any]
    ) -> List[IoRequest]:  # pragma: no cover
        """The requests that read ``items[start:end]`` (lock held). For each item stored,
        append ``(item index, index entry)`` to ``plan``, what it pinned to ``pins``, and
        return its request; raise :class:`InvalidValueError` (before pinning it) for an
        ``out`` smaller than its value. Items that are missing get no request."""
        raise NotImplementedError

    def _unpin_reads(self, pins: List[Any]) -> None:  # pragma: no cover
        """Release what :meth:`_plan_reads` pinned (lock held; no read in flight)."""
        raise NotImplementedError

    def _drop_corrupt(self, entry: Any, why: str) -> None:  # pragma: no cover
        """Log and drop the replica ``entry``, whose read or check failed for ``why`` (lock
        held), unless it is not the key's current one any more (removed, replaced or
        evicted meanwhile). Never raises: a drop that cannot be made (an I/O error) is
        logged, and a later read or check tries again."""
        raise NotImplementedError

    def remove(self, key: bytes) -> bool:  # pragma: no cover
        raise NotImplementedError

    def lookup(self, key: bytes) -> Optional[ObjectInfo]:
        with self._lock:
            entry = self._entry_of(key)
            return None if entry is None else ObjectInfo(entry.value_len, entry.crc)

    def check(self) -> List[bytes]:
        """Verify every object; drop and return the keys of the corrupt ones (each counted
        in ``corrupt_reads``).

        The index is snapshotted under the lock; then, one record at a time, an entry that
        is still its key's current one is pinned as a read pins it (:meth:`_pin_record`),
        read through the engine and verified without the lock (:class:`RecordReader`), and
        unpinned; if it failed and is still current, it is dropped (:meth:`_drop_corrupt`)
        and counted, in the same hold of the lock. An entry removed, replaced or evicted
        meanwhile is not judged, nor is one that cannot be read for now
        (:func:`transient`). Raises :class:`StoreClosedError` once the backend is closed."""
        with self._lock:
            self._check_open()
            snapshot = [self._entry_of(key) for key in self._objects]
        corrupt: List[bytes] = []
        with RecordReader(self.engine) as reader:
            for entry in snapshot:
                pinned: List[Any] = []
                with self._lock:
                    self._check_open()
                    if self._entry_of(entry.key) is not entry:
                        continue
                    try:
                        pin, fd, path, start = self._pin_record(entry)
                        pinned.append(pin)
                        why: Optional[str] = None
                    except OSError as exc:
                        why = None if transient(exc) else f"cannot open its file: {exc}"
                try:
                    if pinned:
                        why = reader.verify(fd, path, start, entry)
                finally:
                    with self._lock:
                        self._unpin_reads(pinned)
                        if why is not None and not self._closed and self._entry_of(entry.key) is entry:
                            self.counters["corrupt_reads"] += 1
                            self._drop_corrupt(entry, why)
                            corrupt.append(entry.key)
        return corrupt

    def _victims(self, need: int) -> List[Any]:
        """The first residents in eviction-policy order whose eviction frees ``need`` bytes
        (all of them, when together they cannot), passing over those whose eviction would
        free nothing now (:meth:`_victim_size`). Lock held; nothing is changed."""
        victims: List[Any] = []
        size_of = self._victim_size
        for name in self._policy.ordered():
            if need <= 0:
                break
            size = size_of(name)
            if size is not None:
                victims.append(name)
                need -= size
        return victims

    def _victims_to_fit(self, nbytes: int, used: int) -> List[Any]:
        """The victims (:meth:`_victims`) whose eviction lets ``nbytes`` more fit under the
        cap with ``used`` bytes taken; raises :class:`NoSpaceError`, nothing chosen, when
        even all of them would not (the rest is reserved by writes in flight). Lock held."""
        victims = self._victims(used + nbytes - self.capacity)
        if used - sum(map(self._victim_size, victims)) + nbytes > self.capacity:
            raise NoSpaceError("NVMe tier full of in-flight writes", needed=nbytes, used=used, capacity=self.capacity)
        return victims

    def _victim_size(self, name: Any) -> Optional[int]:  # pragma: no cover
        """The bytes evicting the policy's resident ``name`` frees, or None when it would
        free nothing now and is to be passed over (a read in flight holds it). Lock held."""
        raise NotImplementedError

    def _entry_of(self, key: bytes) -> Optional[IndexEntry]:  # pragma: no cover
        """The index entry of ``key``'s current replica, or None (lock held)."""
        raise NotImplementedError

    def _pin_record(self, entry: IndexEntry) -> Tuple[Any, int, str, int]:  # pragma: no cover
        """Pin the current replica ``entry`` as :meth:`_plan_reads` pins one, so that its
        bytes stay where they are while ``check()`` reads them (lock held). Returns the pin
        (for :meth:`_unpin_reads`), the descriptor to read it from, its path (for messages)
        and the offset where its record starts. Raises ``OSError``, nothing pinned, when its
        file cannot be opened."""
        raise NotImplementedError

    #: Subdirectory of the store directory that holds this backend's files.
    subdir = ""
    #: Version of this backend's layout on disk, recorded as ``format_version`` in the
    #: store's ``gdskv.json`` (see :mod:`gdskv.storedir`): a gdskv that knows only a lower
    #: one refuses the store. Records and indexes carry :data:`record.FORMAT_VERSION`.
    layout_version = 1

    @classmethod
    def stored_capacity(cls, root: Path) -> Optional[int]:
        """The capacity the store in ``root`` was made with, for a backend that cannot open
        it with less (see the ``offset`` backend); None: any capacity opens it."""
        return None

    def __init__(
        self, root: Path, engine: Any, *, capacity: int, eviction: str = "fifo", verify_on_open: str = "index"
    ) -> None:
        """Set up what every backend has: its directory, engine, cap, policy and lock.

        These are the options every backend takes (``capacity``: its byte cap; ``eviction``:
        "fifo" or "lru"; ``verify_on_open``: "index" or "full"); a backend's own constructor
        names only its own and passes these on."""
        from gdskv.tiers.policies import make_policy  # a sibling layer: keep this module light

        self.dir = Path(root) / self.subdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.capacity = capacity
        self.verify_on_open = verify_on_open
        self._policy = make_policy(eviction)
        self._lock = threading.Lock()
        self._closed = False

    def _verify_reads(
        self,
        future: Any,
        items: Sequence[ReadItem],
        plan: Sequence[Tuple[int, Any]],
        first: int,
        results: List[Optional[int]],
        bad: List[Tuple[Any, str]],
        on_verified: Optional[Callable[[int, int, int], None]] = None,
    ) -> None:
        """Verify each read of ``future`` as soon as it completes, while the rest are in flight.

        Request ``k`` of ``future`` is request ``j = first + k`` of the batch; it read
        ``items[plan[j][0]]``, whose index entry is ``plan[j][1]`` (with ``value_len`` and
        ``crc``). A read is good when the engine moved exactly ``value_len`` bytes and
        CRC32C(key + bytes) matches: its size goes into ``results``. The failed ones are
        counted and, unless the failure says nothing of the replica (:data:`TRANSIENT_ERRNOS`,
        or an ``out`` the engine could not use), appended to ``bad`` as ``(entry, why)``.
        """
        for k, outcome in future.as_completed():
            j = first + k
            i, entry = plan[j]
            key, out = items[i]
            size = entry.value_len
            if isinstance(outcome, BaseException):
                self.counters["read_errors"] += 1
                if not transient(outcome):
                    bad.append((entry, f"read failed: {outcome}"))
            elif outcome != size or crc32c(out if out.nbytes == size else out[:size], crc32c(key)) != entry.crc:
                self.counters["corrupt_reads"] += 1
                bad.append((entry, "value checksum mismatch" if outcome == size else f"read {outcome} of {size} bytes"))
            else:
                results[i] = size
                if on_verified is not None:
                    on_verified(i, size, entry.crc)

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
