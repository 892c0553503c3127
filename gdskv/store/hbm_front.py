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

The front is a component of the store: it owns the HBM tier (built on the store's lock, so
the tier, the DRAM tier and the sink never take locks in different orders), the page-locking
of the DRAM arena, its figures, and the staging of NVMe reads bound for device buffers. It
reads the DRAM tier and the NVMe backend below it (never writes them but through the sink)
and tells the store through an :class:`HbmHost`. It is given the three settings it needs
(the HBM eviction policy, whether to promote, the put timeout), not the store's config. A
caller holding the store lock must never call :meth:`HbmFront.put` (it can wait for
evictions, which need the offloader).
:class:`NullHbmFront` is the null object for a store without an HBM tier.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional, Protocol, Tuple, Union

from gdskv.errors import GdskvError, InvalidValueError, ValueTooLargeError
from gdskv.gds.aligned import alloc_aligned
from gdskv.metrics import Counters
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.devpool import DONE, Completion, DevicePool
from gdskv.tiers.dram import DramEntry, DramTier
from gdskv.tiers.hbm import DramSink, HbmTier

log = logging.getLogger("gdskv.store")

#: What a read lands in: a host memoryview, or a device buffer of the HBM pool's kind.
OutBuffer = Union[memoryview, Any]


class HbmHost(Protocol):
    """What the HBM front tells the store that owns it (store lock held)."""

    def on_published(self, entry: DramEntry) -> None:
        """An HBM object evicted into DRAM is committed there: tell listeners, offload it."""

    def make_room(self, size: int) -> None:
        """DRAM has no room for an HBM victim of ``size`` bytes: evict what is safe on NVMe."""

    def device_put_in_progress(self, k: bytes) -> bool:
        """Whether a device put of ``k`` is copying its value in right now."""


class HbmFront:
    """The HBM tier in front of the store's DRAM (see the module docstring)."""

    present = True

    def __init__(
        self, pool: DevicePool, dram: DramTier, nvme: Any, host: HbmHost, *, lock: "threading.RLock",
        eviction: str, promote: bool, put_timeout_s: float,
    ) -> None:
        """``pool``: the device memory (owned from now on: closed with the front).
        ``dram``, ``nvme``: the tiers below, read only (lookups, views, the sink's slots).
        ``eviction``: the HBM tier's eviction policy (a store's ``hbm_eviction``).
        ``promote``: keep in HBM a copy of what a device buffer read from below, when HBM
        has free room (``hbm_promote``). ``put_timeout_s``: how long a device put waits for
        room (the store's)."""
        self._promote = promote
        self._dram = dram
        self._nvme = nvme
        self._host = host
        self._lock = lock
        self._counters = Counters()
        self.arena_pinned = False
        if hasattr(pool, "pin"):  # copies between the arena and the device become real DMA
            try:
                self.arena_pinned = bool(pool.pin(memoryview(dram.arena)))
            except Exception as exc:  # noqa: BLE001 - unpinned copies still work, synchronously
                log.warning("gdskv: could not page-lock the DRAM arena for the HBM tier: %s", exc)
        sink = DramSink(dram, lock, on_published=self._published, make_room=host.make_room)
        self.tier = HbmTier(pool, sink, policy=eviction, put_timeout_s=put_timeout_s, lock=lock)
        self.pool = pool

    # -- what the store asks ----------------------------------------------------------

    def is_device(self, buf: Any) -> bool:
        return self.pool.is_device(buf)

    def room(self, out: OutBuffer) -> int:
        """How many bytes ``out`` (a host view or a device buffer) can take."""
        return out.nbytes if isinstance(out, memoryview) else self.pool.size_of(out)

    def size_of_key(self, k: bytes) -> Optional[int]:
        return self.tier.size_of_key(k)

    def keys(self) -> List[bytes]:
        return self.tier.keys()

    def remove(self, k: bytes) -> bool:
        return self.tier.remove(k)

    def value_size(self, k: bytes, value: Any) -> int:
        """The size of the device ``value`` a put of ``k`` stores; raises when it is empty."""
        size = self.pool.size_of(value)
        if size == 0:
            raise InvalidValueError("value must not be empty", key=k[:64])
        return size

    def check_fits(self, k: bytes, size: int) -> None:
        """Raise :class:`ValueTooLargeError` when ``size`` bytes are more than the tier holds."""
        if size > self.tier.capacity:
            raise ValueTooLargeError("value larger than the HBM tier", key=k[:64], size=size, capacity=self.tier.capacity)

    def checksum_of(self, k: bytes, value: Any) -> int:
        """CRC32C of the device ``value`` under ``k`` (copies it to the host)."""
        return checksum(k, self.pool.download(value))

    def put(self, k: bytes, value: Any, on_room: Optional[Callable[[], None]]) -> None:
        """Copy the device ``value`` into HBM (evicting into DRAM for room); ``on_room`` runs
        once it has room. Lock not held."""
        self.tier.put(k, value, on_room=on_room)

    def stored_crc(self, k: bytes, size: int) -> Optional[int]:
        """CRC of the HBM value of ``k`` (copied to the host), or None if it left meanwhile.
        Not a read of the object: no hit is counted and its place in the eviction order stays."""
        buf = memoryview(bytearray(size))
        n = self.tier.get_into(k, buf, count=False)
        return None if n is None else checksum(k, buf[:n])

    def get_into(self, k: bytes, out: Any) -> Optional[int]:
        """The fast path: an HBM hit into a device buffer, or None."""
        return self.tier.get_into(k, out)

    def read(
        self, ks: List[bytes], outs: List[OutBuffer], rooms: List[int], results: List[Optional[int]],
        check: Callable[[], None],
    ) -> List[int]:
        """Serve what HBM holds into ``results``; return the indexes still to read below.
        ``check()`` first (lock not held): the store's size check, so nothing is written when
        an out is too small."""
        check()
        sizes = self.tier.batch_get_into(ks, outs, rooms=rooms)  # the tier counts its hits and bytes
        todo = []
        for i, n in enumerate(sizes):
            if n is None:
                todo.append(i)
            else:
                results[i] = n
        return todo

    def staging(self) -> "DeviceStaging":
        """Host memory for one batch's NVMe reads bound for device buffers."""
        return DeviceStaging(self)

    def copy_to_device(self, k: bytes, host: memoryview, out: Any, *, crc: int, pinned: bool = False) -> Completion:
        """Fill the device buffer ``out`` with ``host`` (a value read from DRAM or NVMe) and,
        with ``promote``, keep a copy in HBM when it has free room. With ``pinned``
        (``host`` lies in the page-locked DRAM arena) the copy is asynchronous: ``host``
        must stay as it is until the returned completion is done. ``crc``: the CRC32C of
        ``host`` (the DRAM entry's, or the one an NVMe read was verified against). A
        promotion is registered only if, at that moment (lock held), DRAM or NVMe still
        holds the same bytes (size and CRC) and no device put of the key is copying in;
        it never replaces a value HBM has."""
        pool, tier = self.pool, self.tier
        if pinned:
            copied = pool.upload_async(host, out)
        else:
            pool.upload(host, out)
            copied = DONE
        busy = self._host.device_put_in_progress
        if not self._promote or tier.size_of_key(k) is not None or busy(k):
            return copied
        lower = (host.nbytes, crc)

        def still_the_value() -> bool:  # (the tier's lock is the store's: held when asked)
            return not busy(k) and self._lower_of(k) == lower

        try:  # a device-to-device copy from ``out``, ordered after the upload on the stream
            stored = tier.put(k, _prefix(pool, out, host.nbytes), evict=False, keep=still_the_value)
        except GdskvError as exc:  # the read succeeded; a failed promotion only costs speed
            log.debug("gdskv: promotion of %r into HBM failed: %s", k[:64], exc)
            return copied
        if stored:
            with self._lock:
                self._counters.add("hbm_promoted")
        return copied

    def only_here(self) -> List[bytes]:
        """The HBM objects with no copy in DRAM or on NVMe (a promoted one has its NVMe
        record, of the same size and CRC)."""
        only = []
        for key in self.tier.keys():
            if key in self._dram.entries:
                continue
            info = self._nvme.lookup(key)
            if info is None or info.size != self.tier.size_of_key(key):
                only.append(key)
                continue
            try:
                same = self.stored_crc(key, info.size) == info.crc
            except GdskvError:  # (replaced by a larger value meanwhile, say)
                same = False
            if not same:
                only.append(key)
        return only

    def drain(self, patience_s: float, flush: Callable[[float], None]) -> None:
        """Evict every HBM object into DRAM (and so towards NVMe); called by ``close``.
        ``flush(timeout)``: the store's, to let the offloader make DRAM room. Lock not held."""
        tier = self.tier
        deadline = time.monotonic() + patience_s
        while True:
            before = len(tier.keys())
            if before == 0:
                return
            tier.evict(tier.capacity)
            tier.drain()
            left = len(tier.keys())
            if left == 0:
                return
            if left == before:  # DRAM had no room: let the offloader make some
                if time.monotonic() > deadline:
                    log.warning("gdskv: closing with %d objects still in HBM (DRAM stayed full), %d of them on no other tier",
                                left, len(self.only_here()))
                    return
                try:
                    flush(1.0)
                except GdskvError:
                    pass

    def stats(self) -> Optional[dict]:
        """The tier's own figures (hits, read_bytes, ...; device copies are asynchronous, so
        there is no bytes/s here) and the front's."""
        c = self._counters.snapshot()
        return {
            **self.tier.stats(),
            "evicted_to_dram": int(c.get("hbm_evicted", 0)),
            "promoted": int(c.get("hbm_promoted", 0)),
        }

    def close(self) -> None:
        self.tier.close()  # evictions in flight land in DRAM first

    # -- inside ---------------------------------------------------------------------

    def _published(self, entry: DramEntry) -> None:
        self._counters.add("hbm_evicted")
        self._counters.add("hbm_evicted_bytes", entry.size)
        self._host.on_published(entry)

    def _lower_of(self, k: bytes) -> Optional[Tuple[int, int]]:
        """Size and CRC of ``k`` in DRAM or NVMe (not HBM), or None. Lock held."""
        entry = self._dram.readable(k)
        if entry is not None:
            return entry.size, entry.crc
        info = self._nvme.lookup(k)
        return (info.size, info.crc) if info is not None else None


class NullHbmFront:
    """The HBM front of a store without an HBM tier: nothing is a device buffer, and no key is here."""

    present = False
    arena_pinned = False

    def is_device(self, buf: Any) -> bool:
        return False

    def room(self, out: memoryview) -> int:
        return out.nbytes

    def size_of_key(self, k: bytes) -> Optional[int]:
        return None

    def keys(self) -> List[bytes]:
        return []

    def remove(self, k: bytes) -> bool:
        return False

    def read(self, ks: List[bytes], outs: List[Any], rooms: List[int], results: List[Optional[int]],
             check: Callable[[], None]) -> List[int]:
        return list(range(len(ks)))

    def staging(self) -> "NullStaging":
        return NullStaging()

    def only_here(self) -> List[bytes]:
        return []

    def drain(self, patience_s: float, flush: Callable[[float], None]) -> None:
        pass

    def stats(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


class NullStaging:
    """The staging of a store without an HBM tier: every out is a host view, read into directly."""

    def close(self) -> None:
        pass

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

    def __init__(self, front: HbmFront) -> None:
        self.front = front
        self._slots: dict = {}  # index -> (view, DramEntry or AlignedBuffer)
        self._copies: List[Completion] = []

    def add(self, i: int, key: bytes, size: int) -> memoryview:
        front = self.front
        entry = front._dram.reserve_unlisted(key, size) if front.arena_pinned else None
        if entry is not None:
            view = front._dram.view(entry)
            self._slots[i] = (view, entry)
        else:
            buf = alloc_aligned(size)
            view = buf.view[:size]
            self._slots[i] = (view, buf)
        return view

    def upload(self, i: int, key: bytes, n: int, crc: int, out: Any) -> None:
        """Start the device copy of the verified value of ``key`` (``n`` bytes, CRC ``crc``)."""
        view, holder = self._slots[i]
        self._copies.append(self.front.copy_to_device(key, view[:n], out, pinned=isinstance(holder, DramEntry), crc=crc))

    def close(self) -> None:
        try:
            for copy in self._copies:
                copy.wait()
        finally:
            slots, self._slots = self._slots, {}
            with self.front._lock:
                for view, holder in slots.values():
                    if isinstance(holder, DramEntry):
                        self.front._dram.discard_unlisted(holder)  # frees the slot
            for view, holder in slots.values():
                if not isinstance(holder, DramEntry):
                    view.release()
                    holder.close()
