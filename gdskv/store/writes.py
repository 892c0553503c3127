"""The write path of a :class:`gdskv.Store`: a put in two phases, a slot then a commit.

:meth:`Writer.reserve` decides what a put of a key finds there (nothing, the same bytes, a
different value), makes DRAM room for the new value (evicting what may be evicted, waiting for
the offloader up to the put's deadline) and hands out a :class:`PutSlot`: the bytes in the
arena that the value is copied into, outside the store lock. :meth:`PutSlot.commit` makes the
value readable, tells the listeners and hands the entry to the offloader;
:meth:`PutSlot.abort` gives the bytes back. An uncommitted slot is never visible to a reader.

``Store.put`` is one reserve, one copy and one commit; a process attached to a node
(:mod:`gdskv.local`) runs the same three steps, the copy in its own address space.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional

from gdskv.errors import GdskvError, KeyExistsError, ValueTooLargeError
from gdskv.metrics import Counters
from gdskv.store.activity import Activity
from gdskv.store.dram_room import DramRoom
from gdskv.store.listeners import Listeners
from gdskv.store.locking import lock_through_interrupts
from gdskv.tiers.backends.record import record_size
from gdskv.tiers.dram import DramEntry, DramTier
from gdskv.types import Tier

#: What a put finds under its key (:meth:`Writer.existing`).
ABSENT, SAME, REPLACE = "absent", "same", "replace"


class PutSlot:
    """A reserved, invisible DRAM entry that one value is copied into (see the module
    docstring). Exactly one of :meth:`commit` and :meth:`abort` ends it; a second end is a
    no-op returning False. Not thread-safe: one owner copies and ends it."""

    __slots__ = ("_writer", "_entry", "key", "size", "crc", "offset", "_ended")

    def __init__(self, writer: "Writer", entry: DramEntry) -> None:
        self._writer = writer
        self._entry = entry
        self.key = entry.key
        self.size = entry.size
        self.crc = entry.crc
        #: Where the value goes in the DRAM arena (bytes ``[offset, offset + size)``).
        self.offset = entry.offset
        self._ended = False

    def write(self, value: memoryview) -> None:
        """Copy ``value`` (exactly :attr:`size` bytes) into the slot."""
        self._writer.dram.write(self._entry, value)

    def commit(self, copy_seconds: float = 0.0) -> bool:
        """Make the value readable. False if it was ended already, or the key was removed or
        overwritten while the value was copied in (the value is then dropped, as a put that
        lost that race is). ``copy_seconds`` is counted as the put's time."""
        if self._ended:
            return False
        self._ended = True
        return self._writer.commit(self._entry, copy_seconds)

    def abort(self) -> bool:
        """Give the slot's bytes back; nothing was stored. False if it was ended already."""
        if self._ended:
            return False
        self._ended = True
        self._writer.abort(self._entry)
        return True


class Writer:
    """Two-phase puts into one store's DRAM tier (see the module docstring)."""

    def __init__(
        self, lock: "threading.RLock", dram: DramTier, nvme: Any, hbm: Any, *,
        ssd_bytes: int, put_timeout_s: float,
        room: DramRoom, activity: Activity, listeners: Listeners, counters: Counters, offloader: Any,
        check_accepting: Callable[[], None], remove_locked: Callable[[bytes], bool],
    ) -> None:
        """``ssd_bytes``: the NVMe tier's capacity (0: no NVMe tier); ``put_timeout_s``: how
        long a reservation waits for room by default. ``check_accepting()`` raises once the
        store refuses new values (closed or closing); ``remove_locked(key)`` forgets a key in
        every tier (lock held): the old value of an overwrite goes through it once the new
        one has room."""
        self._ssd_bytes = ssd_bytes
        self._put_timeout_s = put_timeout_s
        self._lock = lock
        self.dram = dram
        self._nvme = nvme
        self._hbm = hbm
        self._room = room
        self._activity = activity
        self._listeners = listeners
        self._counters = counters
        self._offloader = offloader
        self._check_accepting = check_accepting
        self._remove_locked = remove_locked

    def check_size(self, k: bytes, size: int) -> None:
        """:class:`ValueTooLargeError` for a value no tier could hold."""
        limit = self.dram.capacity
        if size > limit:
            raise ValueTooLargeError("value larger than the DRAM tier", key=k[:64], size=size, capacity=limit)
        if self._ssd_bytes and record_size(len(k), size) > self._ssd_bytes:
            raise ValueTooLargeError("value larger than the NVMe tier", key=k[:64], size=size, capacity=self._ssd_bytes)

    def reserve(self, k: bytes, size: int, crc: int, overwrite: bool) -> Optional[PutSlot]:
        """A slot for a value of ``size`` bytes with CRC ``crc`` under ``k``, or None when
        these very bytes are stored already (nothing to copy). Raises what a put raises:
        :class:`KeyExistsError`, :class:`NoSpaceError` once the store's ``put_timeout_s``
        passes without room, :class:`StoreClosedError`."""
        self.check_size(k, size)
        deadline = time.monotonic() + self._put_timeout_s
        with self._lock:
            self._check_accepting()
            while True:
                existing = self.existing(k, size, crc, overwrite)
                if existing is SAME:
                    return None
                entry = self._room.reserve(k, size, crc, deadline, check=self._check_accepting, why_full=self._why_full)
                if entry is not None:
                    break  # else it waited for room, the lock released: the key may have changed
            try:
                if existing is REPLACE:
                    # Only now that the new value has room do the old copies go (an overwrite
                    # that fails for want of space leaves them as they were).
                    self._remove_locked(k)
                self.dram.register(entry)
            except BaseException:
                self.dram.discard_unlisted(entry)
                raise
            self._activity.put_began()
        return PutSlot(self, entry)

    def commit(self, entry: DramEntry, copy_seconds: float) -> bool:
        with lock_through_interrupts(self._lock):
            self.dram.written(entry)
            self._activity.put_done()
            self.count_put(entry.size, copy_seconds)
            if entry.detached:  # overwritten or removed while it was copied in
                self.dram.release(entry)
                return False
            self.dram.commit(entry)
            self._listeners.stored(Tier.DRAM, [(entry.key, entry.size, entry.crc)])
            self._offloader.on_committed(entry)
            return True

    def abort(self, entry: DramEntry) -> None:
        with lock_through_interrupts(self._lock):
            self.dram.written(entry)
            self.dram.detach(entry)
            self._activity.put_done()

    def count_put(self, size: int, seconds: float) -> None:
        self._counters.add("puts")
        self._counters.add("put_bytes", size)
        self._counters.add("put_seconds", seconds)

    def existing(self, k: bytes, size: int, crc: "int | Callable[[], int]", overwrite: bool) -> str:
        """What a put of ``key`` finds (lock held): :data:`ABSENT`, :data:`SAME` (these
        bytes are stored: nothing to do) or :data:`REPLACE` (a different value, and
        ``overwrite``; without it, :class:`KeyExistsError`).
        ``crc`` is the new value's CRC, or a function computing it (a device value's CRC
        needs a copy to the host: computed only when the answer depends on it). The same
        bytes that another put is still copying in are waited for (a put returns once its
        value is readable); a different value being copied in is treated as stored."""
        while True:  # (each wait releases the lock: both are looked at again after either)
            self._activity.await_device_put(k, self._check_accepting)
            entry = self.dram.lookup(k)
            if entry is None or entry.complete or (entry.size, entry.crc) != (size, crc):
                break
            self._activity.wait_for_copy()  # its put commits (or fails, detaching it) and notifies
            self._check_accepting()
        info = self._nvme.lookup(k)
        hbm_size = self._hbm.size_of_key(k)
        if entry is None and info is None and hbm_size is None:
            return ABSENT
        if overwrite and callable(crc):
            return REPLACE
        new = crc() if callable(crc) else crc
        if hbm_size is not None:
            same = hbm_size == size and self._hbm.stored_crc(k, hbm_size) == new
        elif entry is not None:
            same = (entry.size, entry.crc) == (size, new)
        else:
            same = info is not None and (info.size, info.crc) == (size, new)
        if same:
            self._counters.add("puts_idempotent")
            return SAME
        if not overwrite:
            raise KeyExistsError(
                "a different value is stored under this key (pass overwrite=True to replace it)", key=k[:64]
            )
        return REPLACE

    def _why_full(self) -> Dict[str, object]:
        """What a put that found no DRAM room is told of the offloader (lock held)."""
        error: Optional[GdskvError] = self._offloader.error
        return {"offload_pending": self._offloader.queued(), "offload_error": str(error) if error else None}
