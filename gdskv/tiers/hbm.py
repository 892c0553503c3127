"""The HBM tier: one device pool allocated once, sub-allocated by :class:`OffsetAllocator`.

Objects live at offsets of a :class:`~gdskv.tiers.devpool.DevicePool`; an eviction policy
(LRU or FIFO, :mod:`gdskv.tiers.policies`) orders them. When a put does not fit, the tier
evicts into a :class:`HostSink` (the DRAM tier, through :class:`DramSink`):

1. the victim leaves the policy and its bytes start copying to a host buffer the sink
   reserved (``pool.to_host_async``: a CUDA stream on a GPU) — state EVICTING;
2. while the copy runs the object stays readable from HBM (``get_into`` serves it);
3. once the copy is done (:meth:`HbmTier.poll`, or a put waiting for room) the sink
   publishes the host copy, the object leaves HBM, and its device bytes are freed as soon
   as no reader holds them.

An object removed or overwritten while EVICTING is forgotten at once; its host copy is
then abandoned (``sink.complete(..., ok=False)``), never published, so a stale value never
reaches DRAM. A sink that cannot take a victim (DRAM full) makes the tier try the next one;
when nothing can be evicted in ``put_timeout_s``, the put raises :class:`NoSpaceError`.

Thread-safe: metadata changes under one lock. A put copies in outside it, an eviction
copies out, and a hit into host memory copies out (a blocking copy), from entries they pin
(``readers``), as in the DRAM tier. A hit into a device buffer issues its copy under the
lock instead: on a GPU that only enqueues it on the caller's current stream, where it runs
before any later write of those bytes *on the same stream*; a reader on a stream of its
own must synchronise that stream before the key can be removed, overwritten or evicted
and its bytes reused. An owning store passes its own (re-entrant) lock, so the tier, the
DRAM tier and the sink share one lock and no lock order can invert.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from gdskv.errors import GdskvError, InvalidValueError, NoSpaceError, StoreClosedError
from gdskv.tiers.allocator import OffsetAllocator
from gdskv.tiers.devpool import Completion, DevicePool
from gdskv.tiers.policies import make_policy

#: Allocation granularity in the pool: 256 B, the CUDA allocation alignment.
HBM_ALIGNMENT = 256


class HostSink:
    """Where evicted objects go. ``reserve(key, size)`` returns a writable host buffer of
    ``size`` bytes that stays valid until ``complete`` (or None: no room now);
    ``complete(key, buffer, ok)`` publishes it (ok) or abandons it (not ok)."""

    def reserve(self, key: bytes, size: int) -> Optional[memoryview]:  # pragma: no cover
        raise NotImplementedError

    def complete(self, key: bytes, buffer: memoryview, ok: bool) -> None:  # pragma: no cover
        raise NotImplementedError


class DramSink(HostSink):
    """Evicts into a :class:`gdskv.tiers.dram.DramTier`, under ``lock`` (the lock that
    guards that tier). A published copy replaces any older DRAM entry of the key and
    carries its CRC, computed from the copied bytes; when the older entry holds the same
    bytes, it stays and the copy is dropped. ``on_published(entry)`` runs under
    ``lock`` after each publication (an owning store queues the entry for offload there).
    ``make_room(size)``, when given, runs under ``lock`` when the arena has no room for a
    victim (an owning store evicts DRAM objects that are safe on NVMe there)."""

    def __init__(
        self,
        dram: Any,
        lock: "threading.Lock | threading.RLock",
        *,
        on_published: Optional[Callable[[Any], None]] = None,
        make_room: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.dram = dram
        self.lock = lock
        self.on_published = on_published
        self.make_room = make_room
        self._pending: Dict[Tuple[bytes, int], Any] = {}

    def reserve(self, key: bytes, size: int) -> Optional[memoryview]:
        with self.lock:
            entry = self.dram.reserve_unlisted(key, size)
            if entry is None and self.make_room is not None:
                self.make_room(size)
                entry = self.dram.reserve_unlisted(key, size)
            if entry is None:
                return None
            view = self.dram.view(entry)
            self._pending[(key, id(view))] = entry
            return view

    def complete(self, key: bytes, buffer: memoryview, ok: bool) -> None:
        from gdskv.tiers.backends.record import checksum

        crc = checksum(key, buffer) if ok else 0
        with self.lock:
            entry = self._pending.pop((key, id(buffer)))
            if not ok:
                self.dram.discard_unlisted(entry)
                return
            entry.crc = crc
            old = self.dram.lookup(key)
            if old is not None and old.complete and (old.size, old.crc) == (entry.size, crc):
                # DRAM already holds these bytes (the object was promoted from there): keep
                # that entry, whose NVMe state (queued, written) stays true, and drop this copy.
                self.dram.discard_unlisted(entry)
                self.dram.touch(old)
                return
            if old is not None:
                self.dram.detach(old)
            self.dram.entries[key] = entry
            self.dram.written(entry)
            self.dram.commit(entry)
            if self.on_published is not None:
                self.on_published(entry)


class HbmState(enum.Enum):
    RESIDENT = "resident"
    EVICTING = "evicting"  # copy to the host in flight; still readable here


class HbmEntry:
    __slots__ = ("key", "offset", "size", "state", "readers", "detached", "copy", "host")

    def __init__(self, key: bytes, offset: int, size: int) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.state = HbmState.RESIDENT
        self.readers = 0
        self.detached = False
        self.copy: Optional[Completion] = None
        self.host: Optional[memoryview] = None


class HbmTier:
    """Device-resident objects with eviction into a host sink. See the module docstring."""

    def __init__(
        self,
        pool: DevicePool,
        sink: HostSink,
        *,
        policy: str = "lru",
        put_timeout_s: float = 5.0,
        lock: "threading.Lock | threading.RLock | None" = None,
    ) -> None:
        self.pool = pool
        self.sink = sink
        self.allocator = OffsetAllocator(pool.nbytes, alignment=HBM_ALIGNMENT)
        self.capacity = self.allocator.capacity
        self.policy = make_policy(policy)
        self.put_timeout_s = put_timeout_s
        self.entries: Dict[bytes, HbmEntry] = {}
        self._evicting: List[HbmEntry] = []  # copies in flight, oldest first
        self._lock = lock if lock is not None else threading.Lock()
        self._closed = False
        self.counters = {"puts": 0, "hits": 0, "read_bytes": 0, "misses": 0, "evictions": 0, "evictions_abandoned": 0,
                         "eviction_failures": 0, "sink_full": 0}

    # -- public API --------------------------------------------------------------

    def put(
        self, key: bytes, value: Any, *, evict: bool = True, keep: Optional[Callable[[], bool]] = None,
        on_room: Optional[Callable[[], None]] = None,
    ) -> bool:
        """Store ``value`` (a device array of the pool's kind, or a host buffer) under
        ``key``, replacing an older value; return True. Evicts into the sink to make room;
        raises NoSpaceError when no room appears in ``put_timeout_s``, GdskvError for a
        value larger than the pool. An older value of the key stays until room for the new
        one is found: a put that raises NoSpaceError leaves it as it was. ``on_room``:
        called (the lock not held) once the room is reserved, before the bytes are copied
        in; if it raises, the room goes back and the put raises. With ``evict=False`` (a
        promotion) nothing is evicted and nothing replaced: a value that does not fit in
        the free space, or whose key has a value here by the time it would be registered,
        is not stored, and the call returns False. ``keep``: asked with the lock held just
        before the value is registered; False drops it (returns False)."""
        size = self.pool.size_of(value)
        if size <= 0 or size > self.capacity:
            raise GdskvError("value does not fit in the HBM tier", key=key, size=size, capacity=self.capacity)
        entry = self._reserve(key, size, evict)
        if entry is None:
            return False
        try:
            if on_room is not None:
                on_room()
            self.pool.write(entry.offset, value)
        except BaseException:
            with self._lock:
                entry.readers -= 1
                self._detach(entry)
            raise
        with self._lock:
            entry.readers -= 1
            if entry.detached:  # the tier closed while it was being written
                self._release(entry)
                return
            old = self.entries.get(key)
            dropped = True  # (also when keep() raises: the space goes back)
            try:
                dropped = (old is not None and not evict) or (keep is not None and not keep())  # a promotion never replaces a value
            finally:
                if dropped:
                    entry.detached = True
                    self._release(entry)
            if dropped:
                return False
            if old is not None:  # a concurrent put of the key finished first: last one wins
                self._detach(old)
            self.entries[key] = entry
            self.policy.insert(key)
            self.counters["puts"] += 1
        return True

    def get_into(self, key: bytes, out: Any, *, count: bool = True) -> Optional[int]:
        """Copy the object into ``out`` (device-to-device for a device ``out``); return its
        size, or None when it is not in HBM. An EVICTING object is still served; an ``out``
        smaller than the object is an InvalidValueError. ``count=False``: a read for the
        store's own bookkeeping (the CRC of a value it compares), neither a hit nor a miss,
        and the object keeps its place in the eviction order.

        Into a device buffer the copy is issued under the lock (its bytes cannot be freed and
        handed to another object meanwhile): on a GPU a launch, the copy itself running
        after the call returns, on the current stream (see the module docstring). Into host
        memory the entry is pinned and the (blocking) copy runs outside the lock."""
        with self._lock:
            self._check_open()
            self._reap()
            entry = self.entries.get(key)
            if entry is None:
                if count:
                    self.counters["misses"] += 1
                return None
            device = self.pool.is_device(out)
            if not (self.pool.copy_out(entry.offset, entry.size, out) if device else self.pool.size_of(out) >= entry.size):
                raise InvalidValueError("output buffer too small", key=key, size=entry.size, got=self.pool.size_of(out))
            if count:
                self.policy.touch(key)
                self.counters["hits"] += 1
                self.counters["read_bytes"] += entry.size
            if device:
                return entry.size
            entry.readers += 1
        self._copy_pinned([entry], [out])
        return entry.size

    def batch_get_into(
        self, keys: Sequence[bytes], outs: Sequence[Any], *, rooms: Optional[Sequence[int]] = None
    ) -> List[Optional[int]]:
        """:meth:`get_into` for each ``(key, out)`` pair: sizes, None for keys not here.
        Every ``out`` is checked before anything is copied (a too-small one is an
        InvalidValueError and nothing is written); the hits are served by one
        :meth:`DevicePool.read_many` call. ``rooms``: the byte sizes of ``outs``, when the
        caller has them already."""
        if len(keys) != len(outs):
            raise InvalidValueError("keys and outputs differ in length", keys=len(keys), outs=len(outs))
        if rooms is None:
            rooms = [self.pool.size_of(out) for out in outs]
        results: List[Optional[int]] = [None] * len(keys)
        pinned: List[HbmEntry] = []  # hits into host memory: copied outside the lock
        host_outs: List[Any] = []
        with self._lock:
            self._check_open()
            self._reap()
            found = [self.entries.get(key) for key in keys]
            for key, entry, room in zip(keys, found, rooms):
                if entry is not None and room < entry.size:
                    raise InvalidValueError("output buffer too small", key=key, size=entry.size, got=room)
            copies = []
            for i, entry in enumerate(found):
                if entry is None:
                    continue
                if self.pool.is_device(outs[i]):
                    copies.append((entry.offset, entry.size, outs[i]))
                else:
                    entry.readers += 1
                    pinned.append(entry)
                    host_outs.append(outs[i])
                results[i] = entry.size
                self.policy.touch(entry.key)
            if copies:  # issued under the lock, as in get_into
                self.pool.read_many(copies)
            hits = len(copies) + len(pinned)
            self.counters["hits"] += hits
            self.counters["read_bytes"] += sum(r for r in results if r is not None)
            self.counters["misses"] += len(keys) - hits
        if pinned:
            self._copy_pinned(pinned, host_outs)
        return results

    def _copy_pinned(self, entries: List[HbmEntry], outs: List[Any]) -> None:
        """Copy pinned entries into host ``outs`` outside the lock, then unpin them."""
        try:
            for entry, out in zip(entries, outs):
                self.pool.read_into(entry.offset, entry.size, out)
        finally:
            with self._lock:
                for entry in entries:
                    entry.readers -= 1
                    self._release(entry)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            self._reap()
            return key in self.entries

    def size_of_key(self, key: bytes) -> Optional[int]:
        """The size of the object stored under ``key``, or None when it is not here."""
        with self._lock:
            entry = self.entries.get(key)
            return None if entry is None else entry.size

    def keys(self) -> List[bytes]:
        with self._lock:
            return list(self.entries)

    def state(self, key: bytes) -> Optional[HbmState]:
        with self._lock:
            entry = self.entries.get(key)
            return None if entry is None else entry.state

    def remove(self, key: bytes) -> bool:
        """Forget ``key``; an eviction of it in flight is abandoned. True if it was here."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                return False
            self._detach(entry)
            return True

    def evict(self, nbytes: int) -> int:
        """Start evicting at least ``nbytes`` (in policy order); return the bytes started."""
        with self._lock:
            self._check_open()
            return self._start_evictions(nbytes)

    def poll(self) -> int:
        """Finish the evictions whose copies are done; return how many finished."""
        with self._lock:
            return self._reap()

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait for every eviction in flight and finish them."""
        with self._lock:
            pending = list(self._evicting)
        for entry in pending:
            if entry.copy is not None:
                entry.copy.wait(timeout)
        self.poll()

    @property
    def used(self) -> int:
        return self.allocator.used

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "pool": self.pool.kind,
                "hit_copy": self.pool.hit_copy,
                "capacity": self.capacity,
                "used": self.allocator.used,
                "objects": len(self.entries),
                "evicting": len(self._evicting),
                "policy": self.policy.name,
                **self.counters,
            }

    def close(self) -> None:
        """Finish evictions in flight (their copies are published), then free the pool."""
        with self._lock:
            if self._closed:
                return
        self.drain()
        with self._lock:
            self._closed = True
            self.entries.clear()
            self.policy = make_policy(self.policy.name)
        self.pool.close()

    # -- internals (lock held) ---------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("HBM tier is closed")

    def _reserve(self, key: bytes, size: int, evict: bool = True) -> Optional[HbmEntry]:
        deadline = time.monotonic() + self.put_timeout_s
        while True:
            with self._lock:
                self._check_open()
                self._reap()
                old = self.entries.get(key)
                if old is not None and not evict:
                    return None  # a promotion never replaces a value
                offset = self.allocator.allocate(size)
                if offset is None and not evict:
                    return None  # an older value stays as it was
                if offset is None and old is not None:
                    offset = self._allocate_over(old, size)
                if offset is not None:
                    if old is not None:
                        self._detach(old)
                    entry = HbmEntry(key, offset, size)
                    entry.readers = 1  # the writer; invisible until put() registers it
                    return entry
                self._start_evictions(size - self.allocator.largest_free, spare=key)
                waiting = self._evicting[0] if self._evicting else None
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoSpaceError("no room in the HBM tier", key=key, size=size, used=self.used, capacity=self.capacity)
            if waiting is None or waiting.copy is None:
                # No eviction in flight: room can only come from pins letting go (a put
                # still copying in, another put's reservation being undone).
                time.sleep(min(0.001, left))
            else:
                waiting.copy.wait(left)

    def _allocate_over(self, old: HbmEntry, size: int) -> Optional[int]:
        """Room for a new value of ``old``'s key that may take ``old``'s own extent, when
        nothing else fits and no read or eviction holds ``old``: its extent is freed and the
        allocation tried; if the new value still does not fit, the extent is taken back as
        it was. Returns the offset (``old``'s extent no longer its own: the caller detaches
        it), or None with ``old`` untouched."""
        if old.readers or old.state is not HbmState.RESIDENT or old.offset < 0:
            return None
        start, extent = old.offset, self.allocator.size_of(old.offset)
        self.allocator.free(start)
        offset = self.allocator.allocate(size)
        if offset is None:
            self.allocator.claim(start, extent)
            return None
        old.offset = -1  # freed above: detaching it frees nothing more
        return offset

    def _start_evictions(self, nbytes: int, *, spare: Optional[bytes] = None) -> int:
        """Start evicting the coldest objects into the sink, about ``nbytes`` of them; never
        ``spare`` (the key a put is making room for: its old value goes when the new one
        has room, see :meth:`_allocate_over`)."""
        started = 0
        for key in self.policy.victims():
            if started >= nbytes:
                break
            if key == spare:
                continue
            entry = self.entries[key]
            host = self.sink.reserve(key, entry.size)
            if host is None:
                self.counters["sink_full"] += 1
                continue
            self.policy.remove(key)
            entry.state = HbmState.EVICTING
            entry.host = host
            entry.readers += 1  # the copy reads the device bytes
            try:
                entry.copy = self.pool.to_host_async(entry.offset, entry.size, host)
            except BaseException:
                entry.readers -= 1
                entry.state = HbmState.RESIDENT
                entry.host = None
                self.policy.insert(key)
                self.sink.complete(key, host, False)
                raise
            self._evicting.append(entry)
            started += self.allocator.size_of(entry.offset)
        return started

    def _reap(self) -> int:
        if not self._evicting:
            return 0
        finished = 0
        still: List[HbmEntry] = []
        for entry in self._evicting:
            if entry.copy is None or not entry.copy.done():
                still.append(entry)
                continue
            finished += 1
            failed = False
            try:
                entry.copy.wait(0)
            except Exception:
                failed = True
            ok = not entry.detached and not failed
            self.sink.complete(entry.key, entry.host, ok)
            entry.host = None
            entry.copy = None
            entry.readers -= 1
            if ok:
                self.counters["evictions"] += 1
                if self.entries.get(entry.key) is entry:
                    del self.entries[entry.key]
                entry.detached = True
            elif failed and not entry.detached:  # the copy broke: the object stays here
                self.counters["eviction_failures"] += 1
                entry.state = HbmState.RESIDENT
                self.policy.insert(entry.key)
            else:
                self.counters["evictions_abandoned"] += 1
            self._release(entry)
        self._evicting = still
        return finished

    def _detach(self, entry: HbmEntry) -> None:
        if entry.detached:
            return
        entry.detached = True
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
            self.policy.remove(entry.key)
        self._release(entry)

    def _release(self, entry: HbmEntry) -> None:
        if entry.detached and entry.readers == 0 and entry.offset >= 0:
            self.allocator.free(entry.offset)
            entry.offset = -1
