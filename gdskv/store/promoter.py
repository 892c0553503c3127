"""Promotion: an NVMe-only object read often enough is copied back into DRAM.

An object read from NVMe ``after_reads`` times (0: never) is copied into DRAM while DRAM
is below the offloader's high watermark; the master's promotion tasks ask for it at once
(:meth:`Promoter.promote_now`). The copy is made only if the bytes read are still the stored
value (a key can be overwritten meanwhile); it is committed as already safe on SSD, and the
listeners hear of it. Nothing is evicted to make room for a promotion.
"""

from __future__ import annotations

import threading
from typing import Any, Dict

from gdskv.metrics import Counters
from gdskv.store.listeners import Listeners
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.dram import DramTier, SsdState
from gdskv.types import Tier


class Promoter:
    """Counts reads of NVMe objects and promotes them (see the module docstring)."""

    def __init__(
        self, dram: DramTier, nvme: Any, lock: "threading.RLock", counters: Counters, listeners: Listeners, *,
        after_reads: int, high_watermark: float,
    ) -> None:
        """``after_reads``: the NVMe reads of an object that promote it, >= 0 (0: never; a
        store's ``promote_after_reads``). ``high_watermark``: the DRAM usage fraction a
        promotion must stay within (the offloader's, ``OffloaderConfig.high_watermark``).
        ``counters``: where ``promoted`` and ``promoted_bytes`` are counted (the store's)."""
        self._after = after_reads
        self._high = high_watermark
        self._dram = dram
        self._nvme = nvme
        self._lock = lock
        self._counters = counters
        self._listeners = listeners
        self._reads: Dict[bytes, int] = {}

    def read_seen(self, k: bytes, data: memoryview) -> None:
        """``data`` was just read from NVMe for ``k`` (lock not held): promote it once it has
        been read often enough."""
        if self._after == 0:
            return
        with self._lock:
            reads = self._reads.get(k, 0) + 1
            self._reads[k] = reads
            if reads < self._after:
                return
        self.promote(k, data)

    def forget(self, k: bytes) -> None:
        """``k`` left DRAM or the store: its reads start again from 0 (lock held)."""
        self._reads.pop(k, None)

    def promote_now(self, k: bytes) -> bool:
        """Read an NVMe-only ``k`` and promote it (lock not held); whether a DRAM copy was made."""
        with self._lock:
            info = self._nvme.lookup(k)
            if info is None or self._dram.lookup(k) is not None:
                return False
        buf = memoryview(bytearray(info.size))
        sizes = self._nvme.read_batch([(k, buf)])
        if sizes[0] is None:
            return False
        return self.promote(k, buf[: sizes[0]])

    def promote(self, k: bytes, data: memoryview) -> bool:
        """Copy ``data`` (the NVMe value of ``k``) into DRAM if it fits under the high
        watermark and is still the stored value (lock not held)."""
        crc = checksum(k, data)
        with self._lock:
            info = self._nvme.lookup(k)
            if (
                info is None
                or (info.size, info.crc) != (data.nbytes, crc)
                or self._dram.lookup(k) is not None
                or self._dram.used + data.nbytes > self._high * self._dram.capacity
            ):
                return False
            entry = self._dram.reserve(k, info.size, info.crc)
            if entry is None:
                return False
            self._reads.pop(k, None)
        self._dram.write(entry, data)
        with self._lock:
            self._dram.written(entry)
            if entry.detached:
                self._dram.release(entry)
                return False
            entry.ssd = SsdState.ON_SSD
            self._dram.commit(entry)
            self._counters.add("promoted")
            self._counters.add("promoted_bytes", entry.size)
            self._listeners.stored(Tier.DRAM, [(k, entry.size, entry.crc)])
            return True
