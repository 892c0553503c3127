"""The local tiered store: DRAM in front, NVMe behind, embeddable, no network; with
``hbm_bytes`` an HBM (GPU) tier sits in front of DRAM (:mod:`gdskv.store.hbm_front`).

The API is :class:`gdskv.kvstore.KVStore` (its contracts are stated there) and, beyond it:
a put is copied into DRAM and readable at once, never waiting for SSD; when DRAM is full and
nothing can be evicted yet it waits up to ``put_timeout_s`` for the offloader, then raises
:class:`NoSpaceError`. Nothing acknowledged is dropped silently: an object leaves DRAM only
once its SSD copy is COMPLETE (or, without an SSD tier, by eviction: the cache's job, counted
in ``stats()``). A value read from SSD is verified against its CRC32C; a mismatch is a miss.
``flush()``, ``check()`` and ``close()`` are the store's own; the cluster hooks
(``add_listener``, ``borrow``, ``promote``, ``offload``, ``inventory``) serve :mod:`gdskv.node`.

How the store is composed, and which way its parts depend::

    HbmFront  =>  DramTier  =>  Offloader  =>  NVMe backend  =>  IoEngine
    (memory)      (memory)      (the pipe)     (storage)         (byte movement)

A part calls only the parts to its right, and the store through the narrow host interface it
is given (:class:`~gdskv.store.offloader.OffloadHost`, :class:`~gdskv.store.hbm_front.HbmHost`);
storage never holds memory: the backend knows nothing of DRAM entries and tells what it
evicts through its ``evict_listener``. Beside them: :class:`~gdskv.store.reads.TierReader`
(the read path), :class:`~gdskv.store.dram_room.DramRoom` (eviction and back-pressure),
:class:`~gdskv.store.promoter.Promoter`, :class:`~gdskv.store.activity.Activity` (work in
progress) and :class:`~gdskv.store.listeners.Listeners`. The store coordinates them: what a
put finds under its key, the order of a put's steps, removes, and closing. One lock (an
``RLock`` with one condition) guards the store and every part but the NVMe backend, which
has its own (its ``evict_listener`` runs under it); bytes are copied outside them,
from and into pinned entries. A missing tier is a null part (:class:`NullHbmFront`,
:class:`NullBackend`, :class:`NullOffloader`), never ``None``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from gdskv.config import StoreConfig, format_size
from gdskv.errors import ConfigError, GdskvError, InvalidValueError, IoError, StoreClosedError
from gdskv.gds import IoEngine
from gdskv.metrics import Counters
from gdskv.store.activity import Activity, deadline_arg
from gdskv.store.dram_room import DramRoom
from gdskv.store.hbm_front import HbmFront, NullHbmFront, OutBuffer
from gdskv.store.listeners import Listeners, StoreListener
from gdskv.store.locking import lock_through_interrupts
from gdskv.store.offloader import NullOffloader, Offloader
from gdskv.store.parts import StoreParts
from gdskv.store.promoter import Promoter
from gdskv.store.reads import PinnedValue, TierReader
from gdskv.store.report import CheckReport, store_stats
from gdskv.store.writes import SAME, REPLACE, PutSlot, Writer
from gdskv.storedir import open_store_directory
from gdskv.tiers.backends.null import NullBackend
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.devpool import DevicePool
from gdskv.tiers.dram import DramEntry, DramTier, SsdState
from gdskv.tiers.policies import make_policy
from gdskv.types import Key, Tier, byte_view, encode_key, sequence_arg

log = logging.getLogger("gdskv.store")

#: Failed offload batches (each retried after ``offload_retry_s``) after which ``close()``
#: stops draining and reports what it could not write.
CLOSE_DRAIN_TRIES = 3


class Store:
    """An HBM + DRAM + NVMe tiered key-value store for KV-cache blocks. Open with :func:`gdskv.open`."""

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        config: StoreConfig,
        *,
        engine: Optional[IoEngine] = None,
        hbm_pool: Optional[DevicePool] = None,
    ) -> None:
        """Open the store in ``path``. ``engine`` replaces the one ``config.io_engine`` names
        (the store owns it from then on and closes it); used to test fault handling.
        ``hbm_pool`` replaces the device pool ``config.hbm_bytes`` asks for (the store owns
        and closes it); tests pass a :class:`~gdskv.tiers.devpool.HostStandInPool`."""
        if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
            raise ConfigError("a store path must be a str or os.PathLike of str", got=type(path).__name__)
        self.path = Path(path)
        self.config = config
        self._lock_fd = open_store_directory(self.path, config)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._counters = Counters()
        self._closed = False
        #: Set first by close(): no new put is taken (the ones copying in are drained).
        self._refusing = False
        self._activity = Activity(self._cond, room_waiters=lambda: self._room.waiters)
        #: Keys the NVMe tier evicted, for :meth:`_mark_lost` to mark their DRAM copies LOST.
        self._nvme_evicted: List[bytes] = []
        self._listeners = Listeners()
        self._engine: Optional[IoEngine] = None
        self._nvme: Any = NullBackend()
        self._hbm: Any = NullHbmFront()
        self._offloader: Any = NullOffloader()
        self.recovery = None
        host = _Host(self)
        try:
            self._dram = DramTier(
                config.dram_bytes, make_policy(config.eviction), huge_pages=config.dram_huge_pages, shared=config.dram_shared
            )
            if config.has_ssd:
                self._engine = engine if engine is not None else config.io.build(self.path)
                engine = None
                self._nvme = config.nvme_backend.build(self.path, self._engine)
                self.recovery = self._nvme.recover()
                self._nvme.evict_listener = self._nvme_evicting
                self._offloader = Offloader(
                    config.offloader, self._dram, self._nvme, host, ssd_bytes=config.ssd_bytes, cond=self._cond
                )
            elif engine is not None:  # no NVMe tier: nothing to move bytes for
                engine.close()
                engine = None
            if hbm_pool is None and config.has_hbm:
                from gdskv.tiers.devpool import TorchCudaPool

                hbm_pool = TorchCudaPool(config.hbm_bytes, device=config.hbm_device)
            self._promoter = Promoter(
                self._dram, self._nvme, self._lock, self._counters, self._listeners,
                after_reads=config.promote_after_reads, high_watermark=config.offloader.high_watermark,
            )
            self._room = DramRoom(
                self._dram, self._cond, self._counters, self._listeners,
                evictable=self._offloader.evictable, evicted=self._promoter.forget,
            )
            if hbm_pool is not None:
                self._hbm = HbmFront(
                    hbm_pool, self._dram, self._nvme, host, lock=self._lock, eviction=config.hbm_eviction,
                    promote=config.hbm_promote, put_timeout_s=config.put_timeout_s,
                )
                hbm_pool = None
            self._writer = Writer(
                self._lock, self._dram, self._nvme, self._hbm, room=self._room, activity=self._activity,
                ssd_bytes=config.ssd_bytes if config.has_ssd else 0, put_timeout_s=config.put_timeout_s,
                listeners=self._listeners, counters=self._counters, offloader=self._offloader,
                check_accepting=self._check_accepting, remove_locked=self._remove_locked,
            )
            self._reader = TierReader(
                self._lock, self._dram, self._nvme, self._hbm, counters=self._counters,
                room=self._room, promoter=self._promoter, activity=self._activity, check_open=self._check_open,
            )
            self._offloader.start()
        except BaseException:
            if engine is not None:
                engine.close()
            if hbm_pool is not None:
                hbm_pool.close()
            self._release_resources()
            raise

    @property
    def parts(self) -> StoreParts:
        """The store's parts (see :class:`StoreParts`)."""
        return StoreParts(
            lock=self._lock, dram=self._dram, nvme=self._nvme,
            hbm=self._hbm.tier if self._hbm.present else None, offloader=self._offloader, promoter=self._promoter,
            room=self._room, activity=self._activity,
        )

    # ================================================================== writes

    def put(self, key: Key, value: Any, *, overwrite: bool = False) -> None:
        """Store ``value`` (any contiguous host buffer; a device buffer goes to the HBM tier,
        see :mod:`gdskv.store.hbm_front`) under ``key``. See the module docstring."""
        k = encode_key(key)
        if self._hbm.is_device(value):
            return self._put_device(k, value, overwrite)
        view = byte_view(value)
        slot = self._writer.reserve(k, view.nbytes, checksum(k, view), overwrite)
        if slot is None:
            return  # these bytes are stored already
        try:
            t0 = time.perf_counter()
            slot.write(view)
            elapsed = time.perf_counter() - t0
        except BaseException:
            slot.abort()
            raise
        slot.commit(elapsed)

    def reserve(self, key: Key, size: int, crc: int, *, overwrite: bool = False) -> Optional[PutSlot]:
        """The first phase of a put (see :mod:`gdskv.store.writes`): a slot of ``size`` bytes
        in the DRAM arena for a value whose :func:`~gdskv.tiers.backends.record.checksum` is
        ``crc``, or None when these bytes are stored already. The caller copies the value in
        with ``slot.write(value)`` (or, attached to a node, into the shared arena at
        ``slot.offset``) and
        ends the slot with ``commit()`` or ``abort()``; until then ``close()`` waits for it.
        Raises what :meth:`put` raises."""
        k = encode_key(key)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidValueError("a value size must be a positive integer", key=k[:64], got=size)
        if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 1 << 32:
            raise InvalidValueError("a CRC32C must be an integer in [0, 2**32)", key=k[:64], got=crc)
        return self._writer.reserve(k, size, crc, overwrite)

    def _put_device(self, k: bytes, value: Any, overwrite: bool) -> None:
        """A put of a device buffer: copied device-to-device into HBM (see
        :mod:`gdskv.store.hbm_front`); the rules for an existing key are a host put's."""
        hbm = self._hbm
        size = hbm.value_size(k, value)
        self._writer.check_size(k, size)
        hbm.check_fits(k, size)
        with self._lock:
            self._check_accepting()
            existing = self._writer.existing(k, size, lambda: hbm.checksum_of(k, value), overwrite)
            if existing is SAME:
                return
            self._activity.put_began()
            self._activity.device_put_began(k)  # other puts and removes of k wait for this one

        def replace() -> None:
            # Only once the new value has room do the old copies go: an overwrite that
            # fails for want of HBM room leaves them as they were (as a host put does).
            with self._lock:
                if not self._remove_locked(k):  # the old value was in HBM: the tier let it go
                    self._counters.add("removes")

        try:
            t0 = time.perf_counter()
            hbm.put(k, value, on_room=replace if existing is REPLACE else None)
            elapsed = time.perf_counter() - t0
        finally:
            self._activity.device_put_ended(k)
            with lock_through_interrupts(self._lock):
                self._activity.put_done()
        with self._lock:
            self._counters.add("hbm_puts")
            self._writer.count_put(size, elapsed)

    def batch_put(self, keys: Sequence[Key], values: Sequence[Any], *, overwrite: bool = False) -> None:
        """Put each ``(key, value)`` pair; stops at the first error (earlier pairs stay stored)."""
        if len(sequence_arg(keys, "keys")) != len(sequence_arg(values, "values")):
            raise InvalidValueError("keys and values differ in length", keys=len(keys), values=len(values))
        for key, value in zip(keys, values):
            self.put(key, value, overwrite=overwrite)

    def remove(self, key: Key) -> bool:
        """Forget ``key`` in every tier, durably. Returns whether it was stored.

        If the key's bucket is being written right now, waits for that write to finish: the
        offloader then takes the copy it landed on SSD back out (the DRAM entry is detached)
        before this returns. Where it could not (an I/O error), this tries once more and
        raises the error if it fails again: the copy is then still stored.
        """
        k = encode_key(key)
        with self._lock:
            self._check_open()
            self._activity.await_device_put(k, self._check_open)
            found = self._remove_locked(k)
            # Any copy of the key being written (the current value's, or an overwritten one's
            # that is detached already) is taken back out by the offloader once written.
            self._offloader.await_not_in_flight(k)
            self._offloader.take_back_stale(k)
            return found

    def batch_remove(self, keys: Sequence[Key]) -> List[bool]:
        """``remove`` for many keys: per key, whether it was stored. Stops at the first error
        (the keys before it are removed)."""
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        return [self.remove(k) for k in ks]

    def _remove_locked(self, k: bytes) -> bool:
        found = False
        entry = self._dram.lookup(k)
        if entry is not None:
            found = entry.complete
            self._dram.detach(entry)
            self._room.room_made()  # its bytes may be free now
        if self._nvme.remove(k):
            found = True
        if self._hbm.remove(k):
            found = True
        self._promoter.forget(k)
        if found:
            self._counters.add("removes")
        return found

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued offload is COMPLETE on SSD.

        With the watermark policy, first queue what the policy selects now (DRAM above the
        high watermark is offloaded down to the low one), so a flush right after the put that
        crossed the watermark waits for that offload too.

        Raises the offloader's error if a batch fails meanwhile (the objects stay in DRAM and
        are retried), and :class:`TimedOutError` if ``timeout`` seconds pass first.
        """
        deadline = deadline_arg(timeout, "flush")
        with self._lock:
            if not self.config.has_ssd:
                return
            self._check_open()
            self._offloader.flush(deadline, check=self._check_open)

    # ================================================================== reads

    def get(self, key: Key) -> Optional[bytearray]:
        """Return a new buffer holding the value of ``key``, or None on a miss."""
        return self._reader.get(encode_key(key))

    def batch_get(self, keys: Sequence[Key]) -> List[Optional[bytearray]]:
        """``get`` for many keys: a new buffer per key, or None for a miss."""
        return [self.get(k) for k in sequence_arg(keys, "keys")]

    def get_into(self, key: Key, out: Any) -> Optional[int]:
        """Copy the value of ``key`` into ``out`` (writable, at least the value's size; a
        device buffer with an HBM tier, see :mod:`gdskv.store.hbm_front`).

        Returns the value's size, or None on a miss. Raises InvalidValueError when ``out``
        is too small (nothing is written then).
        """
        k = encode_key(key)
        if not self._closed and self._hbm.is_device(out):
            n = self._hbm.get_into(k, out)  # the fast path: an HBM hit into a device buffer
            if n is not None:
                return n
            return self._reader.read([k], [out], hbm_looked=True)[0]  # HBM said no already
        return self._reader.read([k], [self._out_buffer(out)])[0]

    def batch_get_into(self, keys: Sequence[Key], outs: Sequence[Any]) -> List[Optional[int]]:
        """``get_into`` for many keys; NVMe reads go out as one batch, HBM hits as one
        batched device copy. None marks a miss.

        Raises what ``get_into`` raises. An error can come after some tiers were read (an
        out found too small for a value replaced meanwhile, a closed store), so when it
        raises, the contents of every one of ``outs`` are unspecified."""
        if len(sequence_arg(keys, "keys")) != len(sequence_arg(outs, "outs")):
            raise InvalidValueError("keys and outs differ in length", keys=len(keys), outs=len(outs))
        ks = [encode_key(k) for k in keys]
        return self._reader.read(ks, [self._out_buffer(o) for o in outs])

    def _out_buffer(self, out: Any) -> OutBuffer:
        """A device buffer as it is (with an HBM tier), anything else as a writable byte view."""
        return out if self._hbm.is_device(out) else byte_view(out, writable=True, what="out")

    # ================================================================== queries

    def exists(self, key: Key) -> bool:
        """Whether ``key`` is stored in any tier."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]:
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        with self._lock:
            self._check_open()
            return [self._reader.size_of(k) is not None for k in ks]

    def __contains__(self, key: Key) -> bool:
        return self.exists(key)

    def __len__(self) -> int:
        """How many keys the store holds, in any tier. StoreClosedError after close()."""
        with self._lock:
            self._check_open()
            keys = {k for k, e in self._dram.entries.items() if e.complete}
            keys.update(self._nvme.keys())
            keys.update(self._hbm.keys())
            return len(keys)

    def stats(self) -> dict:
        """A snapshot of usage, hits per tier, bytes/s per tier, offload and eviction counts.
        It works after :meth:`close` too, and then gives the final figures."""
        with self._lock:
            return store_stats(
                self.config, self._counters.snapshot(), self._dram, self._nvme if self.config.has_ssd else None,
                hbm=self._hbm.stats(), offload=self._offloader.stats(),
                io_engine=self._engine.describe() if self._engine is not None else None, recovery=self.recovery,
            )

    def check(self) -> CheckReport:
        """Verify every object in every tier; drop the corrupt ones and report them."""
        dram_objects, corrupt = self._reader.verify_dram()
        nvme_objects = len(self._nvme)
        dropped = self._nvme.check()
        corrupt.extend(dropped)
        with self._lock:
            for k in dropped:
                self._ssd_copy_dropped(k)
            self._counters.add("corrupt", len(corrupt))
        return CheckReport(dram_objects=dram_objects, nvme_objects=nvme_objects, corrupt_keys=corrupt)

    def _ssd_copy_dropped(self, k: bytes) -> None:
        """The SSD copy of ``k`` failed verification and was dropped. A DRAM copy that
        counted on it is now the only one: it becomes DRAM-only again (not evictable, and
        written to SSD anew: queued at once under eager offload, by watermark or close
        otherwise). Lock held."""
        entry = self._dram.readable(k)
        if entry is not None and entry.ssd is SsdState.ON_SSD and self._nvme.lookup(k) is None:
            entry.ssd = SsdState.NONE
            self._offloader.on_committed(entry)

    # ================================================================== cluster hooks

    def add_listener(self, listener: StoreListener) -> None:
        """Register a :class:`StoreListener` (see :mod:`gdskv.store.listeners`)."""
        with self._lock:
            self._listeners.add(listener)

    def remove_listener(self, listener: StoreListener) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def _nvme_evicting(self, keys: List[bytes]) -> None:
        """The backend's ``evict_listener``: called with the backend's lock held and not the
        store's (taking it here could deadlock), so the keys are only noted, for
        :meth:`_mark_lost`, and the listeners told. Also hears evictions by a write that
        then fails."""
        self._nvme_evicted.extend(keys)
        self._listeners.evicting(Tier.NVME, keys)

    def _mark_lost(self) -> None:
        """DRAM copies whose NVMe copy was evicted are no longer backed by it (lock held)."""
        while self._nvme_evicted:
            entry = self._dram.lookup(self._nvme_evicted.pop())
            if entry is not None and entry.ssd is SsdState.ON_SSD:
                entry.ssd = SsdState.LOST

    @contextlib.contextmanager
    def borrow(self, keys: Sequence[Key]) -> Iterator[List[Optional[Tuple[memoryview, int]]]]:
        """Zero-copy, read-only access to DRAM values: yields, per key, ``(view, crc)`` or
        None when the key is not in DRAM. The entries stay pinned (neither evicted nor freed)
        until the block ends; do not keep the views beyond it."""
        with self._reader.borrow([encode_key(k) for k in sequence_arg(keys, "keys")]) as views:
            yield views

    def pin(self, keys: Sequence[Key], rooms: Sequence[int]) -> List[Optional[PinnedValue]]:
        """Per key, what the store holds, for a caller that copies DRAM values out of the
        arena itself (a process attached to a node, through the shared arena): a
        :class:`~gdskv.store.reads.PinnedValue` that is ``in_dram`` (pinned at its offset
        until :meth:`unpin`), one that is not (in HBM or on NVMe, with its size: read it with
        :meth:`get_into`), or None (a miss). A DRAM hit counts as one here; the other tiers
        count when read. Raises :class:`InvalidValueError` when a value is larger than its
        ``rooms`` entry (nothing is pinned then)."""
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        if len(sequence_arg(rooms, "rooms")) != len(ks):
            raise InvalidValueError("keys and rooms differ in length", keys=len(ks), rooms=len(rooms))
        return self._reader.pin(ks, list(rooms))

    def unpin(self, pins: Sequence[PinnedValue]) -> None:
        """Give back values of :meth:`pin`: from now on they may be evicted or freed."""
        with lock_through_interrupts(self._lock):
            self._reader.unpin(list(pins))

    def promote(self, key: Key) -> bool:
        """Copy an NVMe-only object into DRAM now, if DRAM is below its high watermark.
        Returns whether a DRAM copy was made."""
        k = encode_key(key)
        with self._lock:
            self._check_open()
        return self._promoter.promote_now(k)

    def offload(self, keys: Sequence[Key]) -> int:
        """Queue DRAM-only objects for SSD now (whatever the offload policy); returns how many."""
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        if not self.config.has_ssd:
            return 0
        with self._lock:
            self._check_open()
            queued = 0
            for k in ks:
                entry = self._dram.readable(k)
                if entry is not None and entry.ssd is SsdState.NONE:
                    self._offloader.enqueue(entry)
                    queued += 1
            if queued:
                self._cond.notify_all()
            return queued

    def inventory(self) -> List[Tuple[bytes, Tier, int, int]]:
        """``(key, tier, size, crc)`` of every readable object, per tier it is in."""
        with self._lock:
            self._check_open()
            out = [(e.key, Tier.DRAM, e.size, e.crc) for e in self._dram.entries.values() if e.complete]
            for k in self._nvme.keys():
                info = self._nvme.lookup(k)
                if info is not None:
                    out.append((k, Tier.NVME, info.size, info.crc))
            return out

    # ================================================================== lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("store is closed", path=str(self.path))

    def _check_accepting(self) -> None:
        """Like :meth:`_check_open`, and no new value once :meth:`close` has begun."""
        if self._closed or self._refusing:
            raise StoreClosedError("store is closed" if self._closed else "store is closing", path=str(self.path))

    def close(self, *, drain: bool = True) -> None:
        """Close the store. With an SSD tier, first evict every HBM object into DRAM and
        write every DRAM-only object to SSD (``drain=False`` skips that: HBM- and DRAM-only
        objects are then lost). Idempotent.

        A failed offload batch is retried (every ``offload_retry_s``, up to
        :data:`CLOSE_DRAIN_TRIES` failures in all). When the drain still fails (the disk is
        full, or fails), the store is closed all the same and then :class:`IoError` is
        raised, saying how many objects were lost (``lost``: live objects only in DRAM or
        HBM), with the last offload error as its cause and its ``errno``. The store is
        closed whatever escapes, a ``KeyboardInterrupt`` included."""
        with self._lock:
            if self._closed or self._refusing:
                return
            self._refusing = True  # no new put; the ones copying in commit, and are drained
        error: Optional[GdskvError] = None
        lost = 0
        drain_to_ssd = drain and self.config.has_ssd
        try:
            with self._lock:
                self._activity.wait_no_puts()
            if drain_to_ssd:
                self._hbm.drain(patience_s=max(self.config.put_timeout_s, 5.0), flush=lambda t: self.flush(timeout=t))
            with self._lock:
                self._offloader.begin_drain()
                if drain:
                    self._offloader.queue_unsaved()
                error = self._offloader.wait_drained(CLOSE_DRAIN_TRIES if drain else 0, check=self._check_open)
        finally:
            with self._lock:
                self._closed = True
                self._offloader.stop()
                self._activity.wait_no_reads()  # reads copy out of the tiers outside the lock
            self._offloader.join()
            try:
                if drain_to_ssd:
                    # What the drain left behind, now that the offloader has stopped:
                    lost = self._offloader.unsaved() + len(self._hbm.only_here())
            finally:
                self._release_resources()
        if lost:
            raise IoError(
                f"closed with {lost} objects that could not be written to SSD (lost)" + (f": {error}" if error else ""),
                path=str(self.path), lost=lost, errno=error.context.get("errno") if error else None,
            ) from error

    def _release_resources(self) -> None:
        self._hbm.close()  # evictions in flight land in DRAM first
        self._nvme.close()
        if self._engine is not None:
            self._engine.close()
        if hasattr(self, "_dram"):
            self._dram.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Close the store. When the block raised, that exception goes on: a failure of
        ``close()`` is then only logged, not raised in its place."""
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except GdskvError as close_error:
            log.error("gdskv: closing the store after an error in the with block failed too: %s", close_error)

    def __repr__(self) -> str:
        return (
            f"Store({str(self.path)!r}, dram={format_size(self.config.dram_bytes)}, "
            f"ssd={format_size(self.config.ssd_bytes)}, offload={self.config.offload!r})"
        )


class _Host:
    """The narrow interface through which the store's parts call back into it (lock held):
    an :class:`~gdskv.store.offloader.OffloadHost` and an :class:`~gdskv.store.hbm_front.HbmHost`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def waiting_for_room(self) -> int:
        return self._store._room.waiters

    def evict_until(self, until: Callable[[], bool]) -> bool:
        return self._store._room.evict_until(until)

    def on_written(self, entries: List[DramEntry]) -> None:
        self._store._listeners.stored(Tier.NVME, [(e.key, e.size, e.crc) for e in entries])

    def on_write_ended(self) -> None:
        self._store._mark_lost()  # what the write evicted (the backend's evict_listener heard it)

    def on_published(self, entry: DramEntry) -> None:
        store = self._store
        store._listeners.stored(Tier.DRAM, [(entry.key, entry.size, entry.crc)])
        info = store._nvme.lookup(entry.key)
        if info is not None and (info.size, info.crc) == (entry.size, entry.crc):
            entry.ssd = SsdState.ON_SSD  # promoted from NVMe earlier: already safe there
        else:
            store._offloader.on_committed(entry)

    def make_room(self, size: int) -> None:
        store = self._store
        if not store._room.evict_until(lambda: store._dram.fits(size)):
            store._cond.notify_all()  # the offloader may make DRAM objects evictable

    def device_put_in_progress(self, k: bytes) -> bool:
        return self._store._activity.device_put_in_progress(k)
