"""The read path of a :class:`gdskv.Store`: each key from the fastest tier that holds it.

HBM first (a batch's hits as one batched device copy), then DRAM (entries pinned under the
lock, copied out outside it), then NVMe (one submission for the batch, every value verified
against its CRC32C before it is handed out; a device ``out`` is filled from host staging as
soon as its value is verified). Before anything is copied, every ``out`` is checked to be
large enough for its value: one that is not raises :class:`InvalidValueError` and nothing of
the batch is written (a value replaced meanwhile can still make a later tier raise, see
``Store.batch_get_into``). Values read from NVMe are shown to the promoter. Also here: the
zero-copy ``borrow`` of DRAM values and the DRAM half of ``check()``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from gdskv.errors import InvalidValueError
from gdskv.metrics import Counters
from gdskv.store.activity import Activity
from gdskv.store.dram_room import DramRoom
from gdskv.store.hbm_front import OutBuffer
from gdskv.store.locking import lock_through_interrupts
from gdskv.store.promoter import Promoter
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.dram import DramEntry, DramTier
from gdskv.types import Tier


class PinnedValue:
    """What ``Store.pin`` found for a key. ``in_dram``: the value's ``size`` bytes are at
    ``offset`` in the DRAM arena, neither evicted nor freed until given back with
    ``Store.unpin``. Otherwise the value is in another tier (HBM, NVMe): read it with
    ``get_into`` (``offset`` is -1)."""

    __slots__ = ("size", "offset", "_entry")

    def __init__(self, size: int, entry: Optional[DramEntry]) -> None:
        self.size = size
        self._entry = entry
        self.offset = entry.offset if entry is not None else -1

    @property
    def in_dram(self) -> bool:
        return self._entry is not None


class TierReader:
    """Reads batches across the tiers (see the module docstring)."""

    def __init__(
        self, lock: "threading.RLock", dram: DramTier, nvme: Any, hbm: Any, *,
        counters: Counters, room: DramRoom, promoter: Promoter, activity: Activity, check_open: Callable[[], None],
    ) -> None:
        """``activity`` counts the reads in progress (close() waits for them); ``check_open()``
        raises once the store is closed."""
        self._lock = lock
        self._dram = dram
        self._nvme = nvme
        self._hbm = hbm
        self._counters = counters
        self._room = room
        self._promoter = promoter
        self._activity = activity
        self._check_open = check_open

    def size_of(self, k: bytes) -> Optional[int]:
        """The size of the value of ``k`` in the fastest tier holding it, or None (lock held)."""
        size = self._hbm.size_of_key(k)
        if size is not None:
            return size
        entry = self._dram.readable(k)
        if entry is not None:
            return entry.size
        info = self._nvme.lookup(k)
        return info.size if info is not None else None

    def get(self, k: bytes) -> Optional[bytearray]:
        """A new buffer holding the value of ``k``, or None on a miss (lock not held)."""
        for _ in range(3):  # the value may be replaced by one of another size meanwhile
            with self._lock:
                self._check_open()
                size = self.size_of(k)
            if size is None:
                with self._lock:
                    self._counters.add("misses")
                return None
            buf = bytearray(size)
            try:
                n = self.read([k], [memoryview(buf)])[0]
            except InvalidValueError:
                continue
            if n is None:
                return None
            if n == size:
                return buf
        return None

    def read(self, ks: List[bytes], outs: List[OutBuffer], hbm_looked: bool = False) -> List[Optional[int]]:
        """Read ``ks`` into ``outs`` (lock not held); per key its size, or None on a miss.
        ``hbm_looked``: HBM was asked already (and missed), so it is not asked (nor its miss
        counted) again."""
        with self._lock:
            self._check_open()
            self._activity.read_began()
        try:
            return self._read_tiers(ks, outs, hbm_looked)
        finally:
            with lock_through_interrupts(self._lock):
                self._activity.read_done()

    def _read_tiers(self, ks: List[bytes], outs: List[OutBuffer], hbm_looked: bool) -> List[Optional[int]]:
        results: List[Optional[int]] = [None] * len(ks)
        dram_hits: List[Tuple[int, DramEntry]] = []
        nvme: List[int] = []
        rooms = [self._hbm.room(out) for out in outs]
        todo = list(range(len(ks)))
        if not hbm_looked:
            def check() -> None:  # nothing is written if any out is too small
                with self._lock:
                    self._check_sizes(ks, rooms, todo)

            todo = self._hbm.read(ks, outs, rooms, results, check)
            if not todo:
                return results
        with self._lock:
            self._check_sizes(ks, rooms, todo)  # again: a value may have been replaced meanwhile
            for i in todo:
                entry = self._dram.readable(ks[i])
                if entry is not None:
                    entry.readers += 1
                    self._dram.touch(entry)
                    dram_hits.append((i, entry))
                else:
                    nvme.append(i)
        t0 = time.perf_counter()
        copies = []  # device copies from pinned DRAM entries: done before the pins go
        try:
            for i, entry in dram_hits:
                if isinstance(outs[i], memoryview):
                    self._dram.read_into(entry, outs[i])
                else:
                    view = self._dram.view(entry)
                    copies.append(self._hbm.copy_to_device(ks[i], view, outs[i], pinned=self._hbm.arena_pinned, crc=entry.crc))
                results[i] = entry.size
        finally:
            for copy in copies:
                copy.wait()
            elapsed = time.perf_counter() - t0
            with lock_through_interrupts(self._lock):  # (a pin left behind would keep the entry for good)
                self._room.unpin([entry for _, entry in dram_hits])
                self._count(Tier.DRAM, len(dram_hits), sum(e.size for _, e in dram_hits), elapsed)
        if nvme:
            self._read_nvme(ks, outs, nvme, results)
        return results

    def pin(self, ks: List[bytes], rooms: List[int]) -> List[Optional["PinnedValue"]]:
        """Per key, its DRAM value pinned in the arena, where it is in another tier, or None
        on a miss (lock not held; see ``Store.pin``)."""
        pins: List[Optional[PinnedValue]] = [None] * len(ks)
        with self._lock:
            self._check_sizes(ks, rooms, list(range(len(ks))))
            hits = 0
            for i, k in enumerate(ks):
                entry = self._dram.readable(k)
                if entry is not None:
                    entry.readers += 1
                    self._dram.touch(entry)
                    pins[i] = PinnedValue(entry.size, entry)
                    hits += 1
                    continue
                size = self.size_of(k)
                if size is not None:
                    pins[i] = PinnedValue(size, None)
            self._counters.add("dram_hits", hits)
            self._counters.add("misses", pins.count(None))
        return pins

    def unpin(self, pins: "List[PinnedValue]") -> None:
        """Give back values of :meth:`pin` (lock held)."""
        self._room.unpin([p._entry for p in pins if p._entry is not None])

    @contextlib.contextmanager
    def borrow(self, ks: List[bytes]) -> Iterator[List[Optional[Tuple[memoryview, int]]]]:
        """Per key, ``(read-only view, crc)`` of its DRAM value, or None when it is not in
        DRAM; the entries stay pinned (neither evicted nor freed) until the block ends."""
        pinned: List[DramEntry] = []
        out: List[Optional[Tuple[memoryview, int]]] = []
        with self._lock:
            self._check_open()
            for k in ks:
                entry = self._dram.readable(k)
                if entry is None:
                    out.append(None)
                    continue
                entry.readers += 1
                self._dram.touch(entry)
                pinned.append(entry)
                out.append((self._dram.view(entry).toreadonly(), entry.crc))
            self._counters.add("dram_hits", len(pinned))
        try:
            yield out
        finally:
            with self._lock:
                self._room.unpin(pinned)

    def verify_dram(self) -> Tuple[int, List[bytes]]:
        """Check every DRAM value against its CRC32C (lock not held): drop the corrupt ones.
        Returns how many were checked and the keys of those dropped."""
        corrupt: List[bytes] = []
        with self._lock:
            self._check_open()
            entries = [e for e in self._dram.entries.values() if e.complete]
            for e in entries:
                e.readers += 1
        try:
            for e in entries:
                if checksum(e.key, self._dram.view(e)) != e.crc:
                    corrupt.append(e.key)
        finally:
            with self._lock:
                for e in entries:
                    if e.key in corrupt:
                        self._dram.detach(e)  # (its bytes are freed once unpinned)
                self._room.unpin(entries)
        return len(entries), corrupt

    def _check_sizes(self, ks: List[bytes], rooms: List[int], idx: List[int]) -> None:
        """Raise InvalidValueError if ``ks[i]`` (``i`` in ``idx``) is stored with more bytes
        than ``rooms[i]``. Lock held; checked before anything is pinned or copied."""
        self._check_open()
        for i in idx:
            size = self.size_of(ks[i])
            if size is not None and rooms[i] < size:
                raise InvalidValueError("out is smaller than the value", key=ks[i][:64], size=size, got=rooms[i])

    def _read_nvme(self, ks: List[bytes], outs: List[OutBuffer], idx: List[int], results: List[Optional[int]]) -> None:
        """Read ``ks[i]`` for ``i`` in ``idx`` from NVMe, verified. A device ``out`` is filled
        from host staging (:class:`gdskv.store.hbm_front.DeviceStaging`) the value is read
        and verified into first; its device copy starts as soon as it is verified."""
        views: Dict[int, memoryview] = {}
        staging = self._hbm.staging()
        try:
            with self._lock:
                for i in idx:
                    if isinstance(outs[i], memoryview):
                        views[i] = outs[i]
                    else:
                        info = self._nvme.lookup(ks[i])
                        if info is not None:  # else a miss: nothing to read it into
                            views[i] = staging.add(i, ks[i], info.size)
            t0 = time.perf_counter()
            reads = [i for i in idx if i in views]

            def to_device(r: int, n: int, crc: int) -> None:  # as each read is verified, the rest in flight
                i = reads[r]
                if views[i] is not outs[i]:
                    staging.upload(i, ks[i], n, crc, outs[i])

            sizes = self._nvme.read_batch([(ks[i], views[i]) for i in reads], to_device) if reads else []
            elapsed = time.perf_counter() - t0
            hits = [(i, n) for i, n in zip(reads, sizes) if n is not None]
            with self._lock:
                self._count(Tier.NVME, len(hits), sum(n for _, n in hits), elapsed)
                self._counters.add("misses", len(idx) - len(hits))
            for i, n in hits:
                results[i] = n
                self._promoter.read_seen(ks[i], views[i][:n])
        finally:
            staging.close()  # after every device copy from it is done

    def _count(self, tier: Tier, count: int, nbytes: int, seconds: float) -> None:
        if count:
            self._counters.add(f"{tier.value}_hits", count)
            self._counters.add(f"{tier.value}_read_bytes", nbytes)
            self._counters.add(f"{tier.value}_read_seconds", seconds)
