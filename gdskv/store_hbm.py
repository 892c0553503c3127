"""The HBM (GPU) tier of a :class:`gdskv.Store`: device puts and reads, eviction into DRAM.

With ``hbm_bytes > 0`` (``gdskv.open(path, hbm="8GiB")``) the store owns one device pool
(:class:`gdskv.tiers.devpool.TorchCudaPool`, allocated once) sub-allocated by an
:class:`gdskv.tiers.hbm.HbmTier`. Contracts:

- ``put(key, value)`` of a *device* value (a CUDA torch tensor, a cupy array; for the pool's
  kind, see ``DevicePool.is_device``) copies it device-to-device into HBM; no host copy is
  made. Host values go to DRAM as before. The rules for an existing key are the store's
  (same bytes: no-op; different bytes: ``KeyExistsError`` unless ``overwrite``); checking
  "same bytes" of a device value against a stored one copies it to the host, which happens
  only when the key already exists and ``overwrite`` is not given. An overwrite removes the
  old copies once HBM has room for the new value: one that raises ``NoSpaceError`` leaves
  them as they were.
- ``get_into`` / ``batch_get_into`` look in HBM first: a hit is copied device-to-device into
  a device ``out`` (one batched copy for a batch), or device-to-host into a host ``out``. A
  device ``out`` missing in HBM is filled from DRAM (host-to-device copy) or NVMe (read and
  verified in a slot of the page-locked DRAM arena, :class:`DeviceStaging`, then copied to
  the device while the rest of the batch is read); with ``hbm_promote`` the bytes are then
  also kept in HBM if it has free room (nothing is evicted for a promotion).
- When a device put needs room, the coldest HBM objects are evicted into DRAM: the
  device-to-host copy runs on a side stream into a DRAM slot (the DRAM arena is page-locked
  once at open), the object stays readable in HBM until it completes, and the DRAM copy is
  then committed with its CRC and offloaded to NVMe like any put (at once under ``eager``
  offload). DRAM makes room for it by evicting objects that are safe on NVMe; when nothing
  frees up within ``put_timeout_s`` the device put raises ``NoSpaceError``.
- ``close()`` (with ``drain``) first evicts every HBM object down, so nothing acknowledged
  is lost; ``flush()`` covers the offload queue only, not objects still in HBM.
- HBM objects are local: cluster listeners hear of them once they reach DRAM, and
  ``inventory()`` lists DRAM and NVMe replicas only.

This is a mixin: it shares the store's lock (the HBM tier is built on it, so the tier, the
DRAM tier and the sink never take locks in different orders), counters and DRAM tier, and
only :class:`gdskv.store.Store` uses it. A caller holding the store lock must never call
``HbmTier.put`` (it can wait for evictions, which need the offloader).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional, Tuple, Union

from gdskv.errors import GdskvError, InvalidValueError
from gdskv.gds.aligned import alloc_aligned
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.devpool import DONE, Completion, DevicePool
from gdskv.tiers.dram import DramEntry, SsdState
from gdskv.tiers.hbm import DramSink, HbmTier
from gdskv.types import Tier

log = logging.getLogger("gdskv.store")

#: What a read lands in: a host memoryview, or a device buffer of the HBM pool's kind.
OutBuffer = Union[memoryview, Any]


class HbmStoreMixin:
    """The store's HBM tier (see the module docstring)."""

    _hbm: Optional[HbmTier]

    def _open_hbm(self, pool: Optional[DevicePool]) -> Optional[HbmTier]:
        """Build the HBM tier from ``pool`` (tests pass a stand-in) or from the config."""
        config = self.config
        if pool is None:
            if not config.has_hbm:
                return None
            from gdskv.tiers.devpool import TorchCudaPool

            pool = TorchCudaPool(config.hbm_bytes, device=config.hbm_device)
        if hasattr(pool, "pin"):  # copies between the arena and the device become real DMA
            try:
                self._arena_pinned = bool(pool.pin(memoryview(self._dram.arena)))
            except Exception as exc:  # noqa: BLE001 - unpinned copies still work, synchronously
                log.warning("gdskv: could not page-lock the DRAM arena for the HBM tier: %s", exc)
        sink = DramSink(self._dram, self._lock, on_published=self._hbm_published, make_room=self._hbm_make_room)
        return HbmTier(pool, sink, policy=config.hbm_eviction, put_timeout_s=config.put_timeout_s, lock=self._lock)

    def _is_device(self, buf: Any) -> bool:
        return self._hbm is not None and self._hbm.pool.is_device(buf)

    def _room(self, out: OutBuffer) -> int:
        return out.nbytes if isinstance(out, memoryview) else self._hbm.pool.size_of(out)

    # -- puts ---------------------------------------------------------------------

    def _put_device(self, k: bytes, value: Any, overwrite: bool) -> None:
        hbm = self._hbm
        assert hbm is not None
        size = hbm.pool.size_of(value)
        if size == 0:
            raise InvalidValueError("value must not be empty", key=k[:64])
        self._check_value_size(k, size)
        if size > hbm.capacity:
            raise InvalidValueError("value larger than the HBM tier", key=k[:64], size=size, capacity=hbm.capacity)
        with self._lock:
            self._check_accepting()
            same, replacing = self._settle_existing(k, size, lambda: checksum(k, hbm.pool.download(value)), overwrite)
            if same:
                return
            self._putting += 1
            self._device_puts[k] = threading.get_ident()  # other puts and removes of k wait for this one

        def replace() -> None:
            # Only once the new value has room do the old copies go: an overwrite that
            # fails for want of HBM room leaves them as they were (as a host put does).
            with self._lock:
                if not self._remove_locked(k):  # the old value was in HBM: the tier let it go
                    self._counters.add("removes")

        try:
            t0 = time.perf_counter()
            hbm.put(k, value, on_room=replace if replacing else None)
            elapsed = time.perf_counter() - t0
        finally:
            self._device_puts.pop(k, None)  # (atomic: done even if an interrupt lands before the lock)
            with self._lock_through_interrupts():
                self._put_done()
        with self._lock:
            self._counters.add("puts")
            self._counters.add("hbm_puts")
            self._counters.add("put_bytes", size)
            self._counters.add("put_seconds", elapsed)

    def _hbm_crc(self, k: bytes, size: int) -> Optional[int]:
        """CRC of the HBM value of ``k`` (copied to the host), or None if it left meanwhile.
        Not a read of the object: no hit is counted and its place in the eviction order stays."""
        buf = memoryview(bytearray(size))
        n = self._hbm.get_into(k, buf, count=False)  # type: ignore[union-attr]
        return None if n is None else checksum(k, buf[:n])

    # -- eviction into DRAM (called by the tier's sink, store lock held) -------------

    def _hbm_make_room(self, size: int) -> None:
        if not self._evict_dram(until=lambda: self._dram.fits(size)):
            self._cond.notify_all()  # the offloader may make DRAM objects evictable

    def _hbm_published(self, entry: DramEntry) -> None:
        self._counters.add("hbm_evicted")
        self._counters.add("hbm_evicted_bytes", entry.size)
        self._notify_stored(Tier.DRAM, [(entry.key, entry.size, entry.crc)])
        if self._backend is None:
            return
        info = self._backend.lookup(entry.key)
        if info is not None and (info.size, info.crc) == (entry.size, entry.crc):
            entry.ssd = SsdState.ON_SSD  # promoted from NVMe earlier: already safe there
        elif self.config.offload == "eager":
            self._enqueue(entry)
        elif self._dram.used > self.config.high_watermark * self._dram.capacity:
            self._cond.notify_all()

    # -- reads ----------------------------------------------------------------------

    def _read_hbm(
        self, ks: List[bytes], outs: List[OutBuffer], rooms: List[int], results: List[Optional[int]]
    ) -> List[int]:
        """Serve what HBM holds; return the indexes still to read from DRAM/NVMe."""
        assert self._hbm is not None
        sizes = self._hbm.batch_get_into(ks, outs, rooms=rooms)  # the tier counts its hits and bytes
        todo = []
        for i, n in enumerate(sizes):
            if n is None:
                todo.append(i)
            else:
                results[i] = n
        return todo

    def _copy_to_device(
        self, k: bytes, host: memoryview, out: Any, *, crc: int, pinned: bool = False
    ) -> Completion:
        """Fill the device buffer ``out`` with ``host`` (a value read from DRAM or NVMe) and,
        with ``hbm_promote``, keep a copy in HBM when it has free room. With ``pinned``
        (``host`` lies in the page-locked DRAM arena) the copy is asynchronous: ``host``
        must stay as it is until the returned completion is done. ``crc``: the CRC32C of
        ``host`` (the DRAM entry's, or the one an NVMe read was verified against). A
        promotion is registered only if, at that moment (lock held), DRAM or NVMe still
        holds the same bytes (size and CRC) and no device put of the key is copying in;
        it never replaces a value HBM has."""
        hbm = self._hbm
        assert hbm is not None
        if pinned:
            copied = hbm.pool.upload_async(host, out)
        else:
            hbm.pool.upload(host, out)
            copied = DONE
        if not self.config.hbm_promote or hbm.size_of_key(k) is not None or k in self._device_puts:
            return copied
        lower = (host.nbytes, crc)

        def still_the_value() -> bool:  # (the tier's lock is the store's: held when asked)
            return k not in self._device_puts and self._lower_of(k) == lower

        try:  # a device-to-device copy from ``out``, ordered after the upload on the stream
            stored = hbm.put(k, _prefix(hbm.pool, out, host.nbytes), evict=False, keep=still_the_value)
        except GdskvError as exc:  # the read succeeded; a failed promotion only costs speed
            log.debug("gdskv: promotion of %r into HBM failed: %s", k[:64], exc)
            return copied
        if stored:
            with self._lock:
                self._counters.add("hbm_promoted")
        return copied

    def _lower_of(self, k: bytes) -> Optional[Tuple[int, int]]:
        """Size and CRC of ``k`` in DRAM or NVMe (not HBM), or None. Lock held."""
        entry = self._dram.readable(k)
        if entry is not None:
            return entry.size, entry.crc
        info = self._backend.lookup(k) if self._backend is not None else None
        return (info.size, info.crc) if info is not None else None

    # -- lifecycle ------------------------------------------------------------------

    def _hbm_only(self) -> List[bytes]:
        """The HBM objects with no copy in DRAM or on NVMe (a promoted one has its NVMe
        record, of the same size and CRC)."""
        hbm = self._hbm
        if hbm is None:
            return []
        only = []
        for key in hbm.keys():
            if key in self._dram.entries:
                continue
            info = self._backend.lookup(key) if self._backend is not None else None
            if info is None or info.size != hbm.size_of_key(key):
                only.append(key)
                continue
            try:
                same = self._hbm_crc(key, info.size) == info.crc
            except GdskvError:  # (replaced by a larger value meanwhile, say)
                same = False
            if not same:
                only.append(key)
        return only

    def _drain_hbm(self, patience_s: float) -> None:
        """Evict every HBM object into DRAM (and so towards NVMe); called by ``close``."""
        hbm = self._hbm
        if hbm is None:
            return
        deadline = time.monotonic() + patience_s
        while True:
            before = len(hbm.keys())
            if before == 0:
                return
            hbm.evict(hbm.capacity)
            hbm.drain()
            left = len(hbm.keys())
            if left == 0:
                return
            if left == before:  # DRAM had no room: let the offloader make some
                if time.monotonic() > deadline:
                    log.warning("gdskv: closing with %d objects still in HBM (DRAM stayed full), %d of them on no other tier",
                                left, len(self._hbm_only()))
                    return
                try:
                    self.flush(timeout=1.0)
                except GdskvError:
                    pass

    def _hbm_stats(self) -> dict:
        """The tier's own figures (hits, read_bytes, ...; device copies are asynchronous, so
        there is no bytes/s here) and what the store counted around it."""
        c = self._counters.snapshot()
        return {
            **self._hbm.stats(),  # type: ignore[union-attr]
            "evicted_to_dram": int(c.get("hbm_evicted", 0)),
            "promoted": int(c.get("hbm_promoted", 0)),
        }


def _prefix(pool: DevicePool, out: Any, n: int) -> Any:
    """The first ``n`` bytes of the device buffer ``out`` (a view, no copy), for a promotion."""
    if pool.size_of(out) == n:
        return out
    if hasattr(out, "reshape") and hasattr(out, "view") and hasattr(out, "is_cuda"):  # torch
        import torch

        return out.reshape(-1).view(torch.uint8)[:n]
    import numpy as np

    if isinstance(out, np.ndarray):
        return out.reshape(-1).view(np.uint8)[:n]
    raise InvalidValueError("cannot take a byte prefix of this device buffer", type=type(out).__name__)


class DeviceStaging:
    """Host memory that NVMe values bound for device buffers are read (and verified) into,
    for one batch read of a :class:`gdskv.Store` with an HBM tier.

    A value gets a slot of the DRAM arena when the arena is page-locked and has room (the
    device copy is then an asynchronous DMA; the slot is never listed as a DRAM object),
    else page-aligned memory of its own (O_DIRECT reads it without a bounce copy; the device
    copy is synchronous). ``add`` (store lock held) hands out the view to read into;
    ``upload`` starts the device copy of a verified value; ``close`` waits for every copy
    and gives the memory back.
    """

    def __init__(self, store: "HbmStoreMixin") -> None:
        self.store = store
        self._slots: dict = {}  # index -> (view, DramEntry or AlignedBuffer)
        self._copies: List[Completion] = []

    def add(self, i: int, key: bytes, size: int) -> memoryview:
        store = self.store
        entry = store._dram.reserve_unlisted(key, size) if store._arena_pinned else None
        if entry is not None:
            view = store._dram.view(entry)
            self._slots[i] = (view, entry)
        else:
            buf = alloc_aligned(size)
            view = buf.view[:size]
            self._slots[i] = (view, buf)
        return view

    def upload(self, i: int, key: bytes, n: int, crc: int, out: Any) -> None:
        """Start the device copy of the verified value of ``key`` (``n`` bytes, CRC ``crc``)."""
        view, holder = self._slots[i]
        self._copies.append(self.store._copy_to_device(key, view[:n], out, pinned=isinstance(holder, DramEntry), crc=crc))

    def close(self) -> None:
        try:
            for copy in self._copies:
                copy.wait()
        finally:
            slots, self._slots = self._slots, {}
            with self.store._lock:
                for view, holder in slots.values():
                    if isinstance(holder, DramEntry):
                        self.store._dram.discard_unlisted(holder)  # frees the slot
            for view, holder in slots.values():
                if not isinstance(holder, DramEntry):
                    view.release()
                    holder.close()
