"""The local tiered store: DRAM in front, NVMe behind, embeddable, no network; with
``hbm_bytes`` an HBM (GPU) tier sits in front of DRAM (:mod:`gdskv.store_hbm` states what
changes for device buffers; below, "DRAM" is where host values go).

Contracts of the public API (all methods are thread-safe):

- ``put(key, value, overwrite=False)``: the value is copied into DRAM and readable when the
  call returns; it never waits for SSD. Putting the same bytes again is a no-op; different
  bytes under an existing key raise :class:`KeyExistsError` unless ``overwrite``. When DRAM
  is full and nothing can be evicted yet, the put waits up to ``put_timeout_s`` for the
  offloader to make room, then raises :class:`NoSpaceError`. Nothing acknowledged is
  dropped silently: an object leaves DRAM only once its SSD copy is COMPLETE (or, without
  an SSD tier, by eviction — the cache's job, counted in ``stats()``).
- ``get(key) -> bytearray | None`` and ``get_into(key, out) -> int | None``: the value, or
  the number of bytes written into ``out``; ``None`` is a miss. A value read from SSD is
  verified against its CRC32C before it is handed out; a mismatch is a miss (counted,
  logged, the replica dropped).
- ``batch_put``, ``batch_get_into``, ``batch_exists``: the batch forms; NVMe reads of a batch
  go to the I/O engine in one submission.
- ``exists(key)``, ``remove(key) -> bool``, ``flush()``, ``check()``, ``stats()``,
  ``close()`` (idempotent; also a context manager).

Offload: ``eager`` queues every put for SSD; ``watermark`` queues the coldest objects when
DRAM usage passes the high watermark and evicts down to the low one. A background thread
packs queued objects into buckets (sealed when full, when ``bucket_max_keys`` is reached, or
when the oldest has waited ``bucket_max_age_s``). An NVMe object read
``promote_after_reads`` times is copied back into DRAM while DRAM is below its high
watermark.

Cluster hooks (used by :mod:`gdskv.node`; see "cluster hooks" below):

- ``add_listener(listener)``: a :class:`StoreListener` is told, in the order things happen,
  ``on_stored(tier, [(key, size, crc)])`` once objects are readable in a tier (a put or a
  promotion committed to DRAM, an offload COMPLETE on NVMe) and ``on_evicting(tier, keys)``
  *before* the store evicts objects from a tier for capacity: the bytes are still readable
  while the listener runs and freed only after it returns (two-phase eviction: a node tells
  the master first). ``remove``, overwrites and corrupt replicas dropped on read are not
  reported (the caller of ``remove`` knows; a corrupt replica is never served). Listeners
  run with the store's (or the NVMe backend's) lock held: they must not call the store, and
  whatever they block on delays the puts that evict. A listener that raises is logged and
  ignored.
- ``borrow(keys)``: zero-copy views of DRAM values, pinned until the ``with`` block ends.
- ``promote(key)``, ``offload(keys)``: do now what the master's promotion and offload tasks
  ask. ``inventory()``: every readable object with its tier, size and crc.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from gdskv.config import StoreConfig, format_size
from gdskv.errors import (
    ConfigError,
    GdskvError,
    InvalidValueError,
    IoError,
    KeyExistsError,
    NoSpaceError,
    StoreClosedError,
)
from gdskv.gds import IoEngine, make_engine
from gdskv.metrics import Counters, rate
from gdskv.offload import OffloadMixin, is_no_space
from gdskv.store_hbm import DeviceStaging, HbmStoreMixin, OutBuffer
from gdskv.storedir import open_store_directory
from gdskv.tiers.backends import make_backend
from gdskv.tiers.backends.record import checksum, record_size
from gdskv.tiers.devpool import DevicePool
from gdskv.tiers.dram import DramEntry, DramTier, SsdState
from gdskv.tiers.policies import make_policy
from gdskv.types import Key, Tier, byte_view, encode_key, sequence_arg

log = logging.getLogger(__name__)

#: Failed offload batches (each retried after ``offload_retry_s``) after which ``close()``
#: stops draining and reports what it could not write.
CLOSE_DRAIN_TRIES = 3


class StoreListener:
    """Told when objects become readable in a tier and before they are evicted from one.
    See "Cluster hooks" in the module docstring for when and under which lock."""

    def on_stored(self, tier: Tier, items: List[Tuple[bytes, int, int]]) -> None:
        """``items``: (key, size, crc) of objects now readable in ``tier``."""

    def on_evicting(self, tier: Tier, keys: List[bytes]) -> None:
        """``keys`` are about to be evicted from ``tier``; their bytes go when this returns."""


@dataclasses.dataclass
class CheckReport:
    """Result of :meth:`Store.check`."""

    dram_objects: int
    nvme_objects: int
    corrupt_keys: List[bytes]

    @property
    def ok(self) -> bool:
        return not self.corrupt_keys


#: What a put finds under its key (:meth:`Store._existing`).
_ABSENT, _SAME, _REPLACE = "absent", "same", "replace"


class Store(OffloadMixin, HbmStoreMixin):
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
        self._closing = False
        #: Set first by close(): no new put is taken (the ones copying in are drained).
        self._refusing = False
        #: Puts between their reservation and their commit, and reads in progress: close()
        #: waits for them (puts before it drains, reads before it frees the tiers).
        self._putting = 0
        self._reading = 0
        self._idle_waiter = False  # close() waits for one of them to reach 0
        self._copy_waiters = 0  # puts waiting for the same bytes to finish copying in
        #: Keys whose device put is copying into HBM (outside the lock), with the thread
        #: doing it: another put or a remove of the key waits for it (:meth:`_await_device_put`).
        self._device_puts: Dict[bytes, int] = {}
        self._pending: Deque[DramEntry] = collections.deque()
        self._pending_bytes = 0
        self._inflight: List[DramEntry] = []
        #: Keys with a copy on SSD that the offloader wrote for a value removed or overwritten
        #: meanwhile and could not take back out yet (:meth:`OffloadMixin._take_back`).
        self._stale_on_ssd: Set[bytes] = set()
        self._flush_waiters = 0
        self._space_waiters = 0
        self._offload_error: Optional[GdskvError] = None
        self._offload_failures = 0
        self._offload_paused_until = 0.0
        self._nvme_reads: dict[bytes, int] = {}
        #: Keys the NVMe tier evicted, for the offloader to mark their DRAM copies LOST.
        self._nvme_evicted: List[bytes] = []
        self._listeners: List[StoreListener] = []
        self._engine: Optional[IoEngine] = None
        self._backend = None
        self._hbm = None
        self._arena_pinned = False
        self._offloader: Optional[threading.Thread] = None
        try:
            self._dram = DramTier(config.dram_bytes, make_policy(config.eviction), huge_pages=config.dram_huge_pages)
            self._hbm = self._open_hbm(hbm_pool)
            hbm_pool = None
            self.recovery = None
            if config.has_ssd:
                self._engine = engine if engine is not None else make_engine(
                    config.io_engine,
                    threads=config.io_threads,
                    depth=config.io_depth,
                    direct=config.direct_io,
                    directory=self.path,
                    read_inflight_bytes=config.io_read_inflight_bytes,
                )
                engine = None
                self._backend = make_backend(
                    config.backend,
                    self.path,
                    self._engine,
                    capacity=config.ssd_bytes,
                    eviction=config.ssd_eviction,
                    verify_on_open=config.verify_on_open,
                    **({"sync": config.file_per_key_sync} if config.backend == "file_per_key" else {}),
                )
                self.recovery = self._backend.recover()
                self._backend.evict_listener = self._nvme_evicting
                self._offloader = threading.Thread(target=self._offload_loop, name="gdskv-offload", daemon=True)
                self._offloader.start()
            elif engine is not None:  # no NVMe tier: nothing to move bytes for
                engine.close()
        except BaseException:
            if engine is not None:
                engine.close()
            if hbm_pool is not None:
                hbm_pool.close()
            self._release_resources()
            raise

    # ================================================================== writes

    def put(self, key: Key, value: Any, *, overwrite: bool = False) -> None:
        """Store ``value`` (any contiguous host buffer; a device buffer goes to the HBM tier,
        see :mod:`gdskv.store_hbm`) under ``key``. See the module docstring."""
        k = encode_key(key)
        if self._is_device(value):
            return self._put_device(k, value, overwrite)
        view = byte_view(value)
        self._check_value_size(k, view.nbytes)
        crc = checksum(k, view)
        deadline = time.monotonic() + self.config.put_timeout_s
        with self._lock:
            self._check_accepting()
            while True:
                existing = self._existing(k, view.nbytes, crc, overwrite)
                if existing is _SAME:
                    return
                entry = self._reserve(k, view.nbytes, crc, deadline)
                if entry is not None:
                    break  # else it waited for room, the lock released: the key may have changed
            try:
                if existing is _REPLACE:
                    # Only now that the new value has room do the old copies go (an overwrite
                    # that fails for want of space leaves them as they were).
                    self._remove_locked(k)
                self._dram.register(entry)
            except BaseException:
                self._dram.discard_unlisted(entry)
                raise
            self._putting += 1
        try:
            t0 = time.perf_counter()
            self._dram.write(entry, view)
            elapsed = time.perf_counter() - t0
        except BaseException:
            with self._lock_through_interrupts():
                self._dram.written(entry)
                self._dram.detach(entry)
                self._put_done()
            raise
        with self._lock_through_interrupts():
            self._dram.written(entry)
            self._put_done()
            self._counters.add("puts")
            self._counters.add("put_bytes", entry.size)
            self._counters.add("put_seconds", elapsed)
            if entry.detached:  # overwritten or removed while we copied
                self._dram.release(entry)
                return
            self._dram.commit(entry)
            self._notify_stored(Tier.DRAM, [(k, entry.size, crc)])
            if self._backend is not None:
                if self.config.offload == "eager":
                    self._enqueue(entry)
                elif self._dram.used > self.config.high_watermark * self._dram.capacity:
                    self._cond.notify_all()

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
            self._await_device_put(k, self._check_open)
            found = self._remove_locked(k)
            # Any copy of the key being written (the current value's, or an overwritten one's
            # that is detached already) is taken back out by the offloader once written.
            while any(e.key == k for e in self._inflight):
                self._cond.wait()
            if k in self._stale_on_ssd:
                self._backend.remove(k)  # type: ignore[union-attr]
                self._stale_on_ssd.discard(k)
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
            self._room_made()  # its bytes may be free now
        if self._backend is not None and self._backend.remove(k):
            found = True
        if self._hbm is not None and self._hbm.remove(k):
            found = True
        self._nvme_reads.pop(k, None)
        if found:
            self._counters.add("removes")
        return found

    def _check_value_size(self, k: bytes, size: int) -> None:
        limit = self._dram.capacity
        if size > limit:
            raise InvalidValueError("value larger than the DRAM tier", key=k[:64], size=size, capacity=limit)
        if self._backend is not None and record_size(len(k), size) > self.config.ssd_bytes:
            raise InvalidValueError(
                "value larger than the NVMe tier", key=k[:64], size=size, capacity=self.config.ssd_bytes
            )

    def _settle_existing(self, k: bytes, size: int, crc: "int | Callable[[], int]", overwrite: bool) -> Tuple[bool, bool]:
        """:meth:`_existing` for device puts: ``(same, replace)``. ``same``: these bytes are
        stored, nothing more to do. ``replace``: an old value is to go, which the device put
        removes (:meth:`_remove_locked`) once its value has room in HBM."""
        existing = self._existing(k, size, crc, overwrite)
        return existing is _SAME, existing is _REPLACE

    def _existing(self, k: bytes, size: int, crc: "int | Callable[[], int]", overwrite: bool) -> str:
        """What a put of ``key`` finds (lock held): :data:`_ABSENT`, :data:`_SAME` (these
        bytes are stored: nothing to do) or :data:`_REPLACE` (a different value, and
        ``overwrite``; without it, :class:`KeyExistsError`).
        ``crc`` is the new value's CRC, or a function computing it (a device value's CRC
        needs a copy to the host: computed only when the answer depends on it). The same
        bytes that another put is still copying in are waited for (a put returns once its
        value is readable); a different value being copied in is treated as stored."""
        while True:  # (each wait releases the lock: both are looked at again after either)
            self._await_device_put(k, self._check_accepting)
            entry = self._dram.lookup(k)
            if entry is None or entry.complete or (entry.size, entry.crc) != (size, crc):
                break
            self._copy_waiters += 1
            try:
                self._cond.wait(0.05)  # its put commits (or fails, detaching it) and notifies
            finally:
                self._copy_waiters -= 1
            self._check_accepting()
        info = self._backend.lookup(k) if self._backend is not None else None
        hbm_size = self._hbm.size_of_key(k) if self._hbm is not None else None
        if entry is None and info is None and hbm_size is None:
            return _ABSENT
        if overwrite and callable(crc):
            return _REPLACE
        new = crc() if callable(crc) else crc
        if hbm_size is not None:
            same = hbm_size == size and self._hbm_crc(k, hbm_size) == new
        elif entry is not None:
            same = (entry.size, entry.crc) == (size, new)
        else:
            same = info is not None and (info.size, info.crc) == (size, new)
        if same:
            self._counters.add("puts_idempotent")
            return _SAME
        if not overwrite:
            raise KeyExistsError(
                "a different value is stored under this key (pass overwrite=True to replace it)", key=k[:64]
            )
        return _REPLACE

    def _reserve(self, k: bytes, size: int, crc: int, deadline: float) -> Optional[DramEntry]:
        """Make room for and reserve an unlisted DRAM entry (see
        :meth:`DramTier.reserve_unlisted`), evicting what may be evicted. None after waiting
        for the offloader to make room: the lock was released meanwhile, so the caller looks
        at the key again. Raises :class:`NoSpaceError` past ``deadline``."""
        while True:
            entry = self._dram.reserve_unlisted(k, size)
            if entry is not None:
                entry.crc = crc
                return entry
            if self._evict_dram(until=lambda: self._dram.fits(size)):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._counters.add("put_no_space")
                raise NoSpaceError(
                    "DRAM full and nothing evictable in time",
                    key=k[:64],
                    size=size,
                    dram_used=self._dram.used,
                    dram_capacity=self._dram.capacity,
                    offload_pending=len(self._pending) + len(self._inflight),
                    offload_error=str(self._offload_error) if self._offload_error else None,
                )
            self._counters.add("put_waits")
            self._space_waiters += 1
            self._cond.notify_all()
            try:
                self._cond.wait(remaining)
            finally:
                self._space_waiters -= 1
            self._check_accepting()
            return None

    def _evictable(self, entry: DramEntry) -> bool:
        return self._backend is None or entry.ssd in (SsdState.ON_SSD, SsdState.LOST)

    def _evict_dram(self, until) -> bool:
        """Evict evictable entries in policy order until ``until()``; True if it now holds."""
        while not until():
            victim = next(self._dram.victims(self._evictable), None)
            if victim is None:
                return False
            self._counters.add("dram_evicted" if victim.ssd is SsdState.ON_SSD else "dram_dropped")
            self._counters.add("dram_evicted_bytes", victim.size)
            self._nvme_reads.pop(victim.key, None)
            self._notify_evicting(Tier.DRAM, [victim.key])
            self._dram.detach(victim)
        return True

    # ================================================================== reads

    def get(self, key: Key) -> Optional[bytearray]:
        """Return a new buffer holding the value of ``key``, or None on a miss."""
        k = encode_key(key)
        for _ in range(3):  # the value may be replaced by one of another size meanwhile
            with self._lock:
                self._check_open()
                size = self._size_of(k)
            if size is None:
                with self._lock:
                    self._counters.add("misses")
                return None
            buf = bytearray(size)
            try:
                n = self._get_into(k, memoryview(buf))
            except InvalidValueError:
                continue
            if n is None:
                return None
            if n == size:
                return buf
        return None

    def get_into(self, key: Key, out: Any) -> Optional[int]:
        """Copy the value of ``key`` into ``out`` (writable, at least the value's size; a
        device buffer with an HBM tier, see :mod:`gdskv.store_hbm`).

        Returns the value's size, or None on a miss. Raises InvalidValueError when ``out``
        is too small (nothing is written then).
        """
        k = encode_key(key)
        if self._hbm is not None and not self._closed and self._hbm.pool.is_device(out):
            n = self._hbm.get_into(k, out)  # the fast path: an HBM hit into a device buffer
            if n is not None:
                return n
            return self._read_batch([k], [out], hbm_looked=True)[0]  # HBM said no already
        return self._read_batch([k], [self._out_buffer(out)])[0]

    def batch_get(self, keys: Sequence[Key]) -> List[Optional[bytearray]]:
        """``get`` for many keys: a new buffer per key, or None for a miss."""
        return [self.get(k) for k in sequence_arg(keys, "keys")]

    def _get_into(self, k: bytes, view: memoryview) -> Optional[int]:
        return self._read_batch([k], [view])[0]

    def batch_get_into(self, keys: Sequence[Key], outs: Sequence[Any]) -> List[Optional[int]]:
        """``get_into`` for many keys; NVMe reads go out as one batch, HBM hits as one
        batched device copy. None marks a miss.

        Raises what ``get_into`` raises. An error can come after some tiers were read (an
        out found too small for a value replaced meanwhile, a closed store), so when it
        raises, the contents of every one of ``outs`` are unspecified."""
        if len(sequence_arg(keys, "keys")) != len(sequence_arg(outs, "outs")):
            raise InvalidValueError("keys and outs differ in length", keys=len(keys), outs=len(outs))
        ks = [encode_key(k) for k in keys]
        return self._read_batch(ks, [self._out_buffer(o) for o in outs])

    def _out_buffer(self, out: Any) -> OutBuffer:
        """A device buffer as it is (with an HBM tier), anything else as a writable byte view."""
        return out if self._is_device(out) else byte_view(out, writable=True, what="out")

    def _read_batch(self, ks: List[bytes], outs: List[OutBuffer], hbm_looked: bool = False) -> List[Optional[int]]:
        """Read ``ks`` into ``outs`` from the fastest tier holding each; ``hbm_looked``: HBM
        was asked already (and missed), so it is not asked (nor its miss counted) again."""
        with self._lock:
            self._check_open()
            self._reading += 1
        try:
            return self._read_tiers(ks, outs, hbm_looked)
        finally:
            with self._lock_through_interrupts():
                self._reading -= 1
                if self._idle_waiter and not self._reading:
                    self._cond.notify_all()

    def _read_tiers(self, ks: List[bytes], outs: List[OutBuffer], hbm_looked: bool) -> List[Optional[int]]:
        results: List[Optional[int]] = [None] * len(ks)
        dram_hits: List[tuple[int, DramEntry]] = []
        nvme: List[int] = []
        rooms = [self._room(out) for out in outs]
        todo = list(range(len(ks)))
        if self._hbm is not None and not hbm_looked:
            with self._lock:
                self._check_sizes(ks, rooms, todo)  # nothing is written if any out is too small
            todo = self._read_hbm(ks, outs, rooms, results)
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
                elif self._backend is not None:
                    nvme.append(i)
                else:
                    self._counters.add("misses")
        t0 = time.perf_counter()
        copies = []  # device copies from pinned DRAM entries: done before the pins go
        try:
            for i, entry in dram_hits:
                if isinstance(outs[i], memoryview):
                    self._dram.read_into(entry, outs[i])
                else:
                    copies.append(self._copy_to_device(ks[i], self._dram.view(entry), outs[i], pinned=self._arena_pinned, crc=entry.crc))
                results[i] = entry.size
        finally:
            for copy in copies:
                copy.wait()
            elapsed = time.perf_counter() - t0
            with self._lock_through_interrupts():  # (a pin left behind would keep the entry for good)
                self._unpin([entry for _, entry in dram_hits])
                self._count_reads(Tier.DRAM, len(dram_hits), sum(e.size for _, e in dram_hits), elapsed)
        if nvme:
            self._read_nvme(ks, outs, nvme, results)
        return results

    def _check_sizes(self, ks: List[bytes], rooms: List[int], idx: List[int]) -> None:
        """Raise InvalidValueError if ``ks[i]`` (``i`` in ``idx``) is stored with more bytes
        than ``rooms[i]``. Lock held; checked before anything is pinned or copied."""
        self._check_open()
        for i in idx:
            size = self._size_of(ks[i])
            if size is not None and rooms[i] < size:
                raise InvalidValueError("out is smaller than the value", key=ks[i][:64], size=size, got=rooms[i])

    def _read_nvme(self, ks: List[bytes], outs: List[OutBuffer], idx: List[int], results: List[Optional[int]]) -> None:
        """Read ``ks[i]`` for ``i`` in ``idx`` from NVMe, verified. A device ``out`` is filled
        from host staging (:class:`gdskv.store_hbm.DeviceStaging`) the value is read and
        verified into first; its device copy starts as soon as it is verified."""
        assert self._backend is not None
        views: dict[int, memoryview] = {}
        staging = DeviceStaging(self) if self._hbm is not None else None
        try:
            with self._lock:
                for i in idx:
                    if isinstance(outs[i], memoryview):
                        views[i] = outs[i]
                    elif staging is not None:
                        info = self._backend.lookup(ks[i])
                        if info is not None:  # else a miss: nothing to read it into
                            views[i] = staging.add(i, ks[i], info.size)
            t0 = time.perf_counter()
            reads = [i for i in idx if i in views]

            def to_device(r: int, n: int, crc: int) -> None:  # as each read is verified, the rest in flight
                i = reads[r]
                if staging is not None and views[i] is not outs[i]:
                    staging.upload(i, ks[i], n, crc, outs[i])

            sizes = self._backend.read_batch([(ks[i], views[i]) for i in reads], to_device) if reads else []
            elapsed = time.perf_counter() - t0
            hits = [(i, n) for i, n in zip(reads, sizes) if n is not None]
            with self._lock:
                self._count_reads(Tier.NVME, len(hits), sum(n for _, n in hits), elapsed)
                self._counters.add("misses", len(idx) - len(hits))
            for i, n in hits:
                results[i] = n
                self._maybe_promote(ks[i], views[i][:n])
        finally:
            if staging is not None:
                staging.close()  # after every device copy from it is done

    def _count_reads(self, tier: Tier, count: int, nbytes: int, seconds: float) -> None:
        if count:
            self._counters.add(f"{tier.value}_hits", count)
            self._counters.add(f"{tier.value}_read_bytes", nbytes)
            self._counters.add(f"{tier.value}_read_seconds", seconds)

    def _size_of(self, k: bytes) -> Optional[int]:
        if self._hbm is not None:
            size = self._hbm.size_of_key(k)
            if size is not None:
                return size
        entry = self._dram.readable(k)
        if entry is not None:
            return entry.size
        info = self._backend.lookup(k) if self._backend is not None else None
        return info.size if info is not None else None

    def _maybe_promote(self, k: bytes, data: memoryview) -> None:
        """Copy an often-read NVMe object back into DRAM while DRAM has headroom."""
        threshold = self.config.promote_after_reads
        if threshold == 0 or self._backend is None:
            return
        with self._lock:
            reads = self._nvme_reads.get(k, 0) + 1
            self._nvme_reads[k] = reads
            if reads < threshold:
                return
        self._promote(k, data)

    def _promote(self, k: bytes, data: memoryview) -> bool:
        """Copy ``data`` (the NVMe value of ``k``) into DRAM if it fits under the high watermark."""
        assert self._backend is not None
        # The key may have been overwritten since these bytes were read: promote them only
        # if they are still the stored value.
        crc = checksum(k, data)
        with self._lock:
            info = self._backend.lookup(k)
            if (
                info is None
                or (info.size, info.crc) != (data.nbytes, crc)
                or self._dram.lookup(k) is not None
                or self._dram.used + data.nbytes > self.config.high_watermark * self._dram.capacity
            ):
                return False
            entry = self._dram.reserve(k, info.size, info.crc)
            if entry is None:
                return False
            self._nvme_reads.pop(k, None)
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
            self._notify_stored(Tier.DRAM, [(k, entry.size, entry.crc)])
            return True

    # ================================================================== queries

    def exists(self, key: Key) -> bool:
        """Whether ``key`` is stored in any tier."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]:
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        with self._lock:
            self._check_open()
            return [self._size_of(k) is not None for k in ks]

    def __contains__(self, key: Key) -> bool:
        return self.exists(key)

    def __len__(self) -> int:
        """How many keys the store holds, in any tier. StoreClosedError after close()."""
        with self._lock:
            self._check_open()
            keys = {k for k, e in self._dram.entries.items() if e.complete}
            if self._backend is not None:
                keys.update(self._backend.keys())
            if self._hbm is not None:
                keys.update(self._hbm.keys())
            return len(keys)

    def stats(self) -> dict:
        """A snapshot of usage, hits per tier, bytes/s per tier, offload and eviction counts.
        It works after :meth:`close` too, and then gives the final figures."""
        with self._lock:
            c = self._counters.snapshot()
            out: dict[str, Any] = {
                "dram": {
                    "objects": sum(1 for e in self._dram.entries.values() if e.complete),
                    "used_bytes": self._dram.used,
                    "capacity": self._dram.capacity,
                    "huge_pages_advised": self._dram.huge_pages_advised,
                    "hits": int(c.get("dram_hits", 0)),
                    "read_bytes": int(c.get("dram_read_bytes", 0)),
                    "read_bytes_per_s": rate(c.get("dram_read_bytes", 0), c.get("dram_read_seconds", 0)),
                    "put_bytes_per_s": rate(c.get("put_bytes", 0), c.get("put_seconds", 0)),
                    "evicted": int(c.get("dram_evicted", 0)),
                    "dropped": int(c.get("dram_dropped", 0)),
                    "evicted_bytes": int(c.get("dram_evicted_bytes", 0)),
                    "free_extents": self._dram.allocator.free_extents,
                },
                "gets": {"misses": int(c.get("misses", 0))},
                "puts": {
                    "count": int(c.get("puts", 0)),
                    "idempotent": int(c.get("puts_idempotent", 0)),
                    "waited": int(c.get("put_waits", 0)),
                    "no_space": int(c.get("put_no_space", 0)),
                },
                "removes": int(c.get("removes", 0)),
                "promoted": int(c.get("promoted", 0)),
                "config": {"offload": self.config.offload, "eviction": self.config.eviction},
            }
            if self._hbm is not None:
                out["hbm"] = self._hbm_stats()
            if self._backend is not None:
                assert self._engine is not None and self.recovery is not None
                out["nvme"] = {
                    **self._backend.stats(),
                    "hits": int(c.get("nvme_hits", 0)),
                    "read_bytes": int(c.get("nvme_read_bytes", 0)),
                    "read_bytes_per_s": rate(c.get("nvme_read_bytes", 0), c.get("nvme_read_seconds", 0)),
                }
                out["offload"] = {
                    "policy": self.config.offload,
                    "objects": int(c.get("offloaded", 0)),
                    "bytes": int(c.get("offloaded_bytes", 0)),
                    "bytes_per_s": rate(c.get("offloaded_bytes", 0), c.get("offload_seconds", 0)),
                    "queued": len(self._pending),
                    "in_flight": len(self._inflight),
                    "stale_copies": len(self._stale_on_ssd),
                    "failures": self._offload_failures,
                    "paused": time.monotonic() < self._offload_paused_until,
                    "disk_full": is_no_space(self._offload_error),
                    "last_error": str(self._offload_error) if self._offload_error else None,
                }
                out["io_engine"] = self._engine.describe()
                out["recovery"] = self.recovery.as_dict()
            return out

    def check(self) -> CheckReport:
        """Verify every object in every tier; drop the corrupt ones and report them."""
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
                self._unpin(entries)
        nvme_objects = 0
        if self._backend is not None:
            nvme_objects = len(self._backend)
            dropped = self._backend.check()
            corrupt.extend(dropped)
            with self._lock:
                for k in dropped:
                    self._ssd_copy_dropped(k)
        with self._lock:
            self._counters.add("corrupt", len(corrupt))
        return CheckReport(dram_objects=len(entries), nvme_objects=nvme_objects, corrupt_keys=corrupt)

    def _ssd_copy_dropped(self, k: bytes) -> None:
        """The SSD copy of ``k`` failed verification and was dropped. A DRAM copy that
        counted on it is now the only one: it becomes DRAM-only again (not evictable, and
        written to SSD anew: queued at once under eager offload, by watermark or close
        otherwise). Lock held."""
        entry = self._dram.readable(k)
        if entry is not None and entry.ssd is SsdState.ON_SSD and self._backend.lookup(k) is None:  # type: ignore[union-attr]
            entry.ssd = SsdState.NONE
            if self.config.offload == "eager":
                self._enqueue(entry)

    # ================================================================== cluster hooks

    def add_listener(self, listener: StoreListener) -> None:
        """Register a :class:`StoreListener` (see the module docstring)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: StoreListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _notify_stored(self, tier: Tier, items: List[Tuple[bytes, int, int]]) -> None:
        for listener in self._listeners if items else ():
            try:
                listener.on_stored(tier, items)
            except Exception:
                log.exception("gdskv: store listener failed in on_stored")

    def _nvme_evicting(self, keys: List[bytes]) -> None:
        """The backend's ``evict_listener``: called with the backend's lock held and not the
        store's (taking it here could deadlock), so the keys are only noted, for
        :meth:`_mark_lost`, and the listeners told. Also hears evictions by a write that
        then fails."""
        self._nvme_evicted.extend(keys)
        self._notify_evicting(Tier.NVME, keys)

    def _mark_lost(self) -> None:
        """DRAM copies whose NVMe copy was evicted are no longer backed by it (lock held)."""
        while self._nvme_evicted:
            entry = self._dram.lookup(self._nvme_evicted.pop())
            if entry is not None and entry.ssd is SsdState.ON_SSD:
                entry.ssd = SsdState.LOST

    def _notify_evicting(self, tier: Tier, keys: List[bytes]) -> None:
        for listener in self._listeners if keys else ():
            try:
                listener.on_evicting(tier, keys)
            except Exception:
                log.exception("gdskv: store listener failed in on_evicting")

    @contextlib.contextmanager
    def borrow(self, keys: Sequence[Key]) -> Iterator[List[Optional[Tuple[memoryview, int]]]]:
        """Zero-copy, read-only access to DRAM values: yields, per key, ``(view, crc)`` or
        None when the key is not in DRAM. The entries stay pinned (neither evicted nor freed)
        until the block ends; do not keep the views beyond it."""
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
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
                self._unpin(pinned)

    def promote(self, key: Key) -> bool:
        """Copy an NVMe-only object into DRAM now, if DRAM is below its high watermark.
        Returns whether a DRAM copy was made."""
        k = encode_key(key)
        with self._lock:
            self._check_open()
            info = self._backend.lookup(k) if self._backend is not None else None
            if info is None or self._dram.lookup(k) is not None:
                return False
        buf = memoryview(bytearray(info.size))
        sizes = self._backend.read_batch([(k, buf)])  # type: ignore[union-attr]
        if sizes[0] is None:
            return False
        return self._promote(k, buf[: sizes[0]])

    def offload(self, keys: Sequence[Key]) -> int:
        """Queue DRAM-only objects for SSD now (whatever the offload policy); returns how many."""
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        if self._backend is None:
            return 0
        with self._lock:
            self._check_open()
            queued = 0
            for k in ks:
                entry = self._dram.readable(k)
                if entry is not None and entry.ssd is SsdState.NONE:
                    self._enqueue(entry)
                    queued += 1
            if queued:
                self._cond.notify_all()
            return queued

    def inventory(self) -> List[Tuple[bytes, Tier, int, int]]:
        """``(key, tier, size, crc)`` of every readable object, per tier it is in."""
        with self._lock:
            self._check_open()
            out = [(e.key, Tier.DRAM, e.size, e.crc) for e in self._dram.entries.values() if e.complete]
            if self._backend is not None:
                for k in self._backend.keys():
                    info = self._backend.lookup(k)
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

    def _await_device_put(self, k: bytes, check: Callable[[], None]) -> None:
        """Wait (lock held, released meanwhile) until no device put of ``k`` is copying its
        value into HBM: what the key holds is known only then. ``check()`` after each wait
        (:meth:`_check_accepting` for a put, :meth:`_check_open` for a remove). Called by
        the thread doing that device put (a listener calling the store, which it must not),
        it raises rather than wait for itself."""
        owner = self._device_puts.get(k)
        if owner is None:
            return
        if owner == threading.get_ident():
            raise GdskvError("the store was called on a key from inside that key's own put (a listener must not call the store)", key=k[:64])
        while k in self._device_puts:
            self._copy_waiters += 1
            try:
                self._cond.wait(0.05)  # the device put notifies when it is over
            finally:
                self._copy_waiters -= 1
            check()

    @contextlib.contextmanager
    def _lock_through_interrupts(self) -> Iterator[None]:
        """The store lock, for the bookkeeping that ends a put or a read (counts, pins) and
        must not be skipped. An exception raised while this thread waits for the lock (a signal
        handler's: Ctrl-C's ``KeyboardInterrupt`` in the main thread) is raised once the
        body has run, not instead of it: a put left counted as in progress made ``close()``
        wait for ever, and a put of the same bytes wait for its copy. So a Ctrl-C does not
        cut this wait short; the lock is only ever held briefly (the store's I/O runs
        outside it, but for a remove's). The caller must not hold the lock already."""
        deferred: Optional[BaseException] = None
        while True:
            try:
                self._lock.acquire()
            except BaseException as exc:  # noqa: BLE001 - raised below, once the body has run
                deferred = deferred or exc
                if not self._lock._is_owned():  # it came while waiting: wait again
                    continue
            break
        try:
            yield
        finally:
            self._lock.release()
        if deferred is not None:
            raise deferred

    def _put_done(self) -> None:
        """A put's copy is over (lock held): wake whoever waits for it, and the puts waiting
        for room (a committed entry may be evictable, a failed one's bytes are free)."""
        self._putting -= 1
        if self._copy_waiters or self._space_waiters or (self._idle_waiter and not self._putting):
            self._cond.notify_all()

    def _unpin(self, entries: Sequence[DramEntry]) -> None:
        """Release the read pins of ``entries`` (lock held): free the bytes of those removed
        meanwhile, and wake the puts waiting for room (a pinned entry cannot be evicted)."""
        for entry in entries:
            entry.readers -= 1
            self._dram.release(entry)
        if entries:
            self._room_made()

    def _room_made(self) -> None:
        """DRAM room may have been made (lock held): wake the puts waiting for it."""
        if self._space_waiters:
            self._cond.notify_all()

    def _wait_idle(self, in_progress: Callable[[], int]) -> None:
        """Wait until ``in_progress()`` (the puts or the reads in progress) is 0 (lock held)."""
        self._idle_waiter = True
        try:
            while in_progress():
                self._cond.wait()
        finally:
            self._idle_waiter = False

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
        try:
            with self._lock:
                self._wait_idle(lambda: self._putting)
            if drain and self._hbm is not None and self._backend is not None:
                self._drain_hbm(patience_s=max(self.config.put_timeout_s, 5.0))
            with self._lock:
                self._closing = True
                if drain and self._backend is not None:
                    for entry in list(self._dram.entries.values()):
                        if entry.complete and entry.ssd is SsdState.NONE:
                            self._enqueue(entry)
                self._cond.notify_all()
            if self._offloader is not None:
                error = self._drain_offloads(drain)
        finally:
            with self._lock:
                self._closed = True
                self._cond.notify_all()
                self._wait_idle(lambda: self._reading)  # reads copy out of the tiers outside the lock
            if self._offloader is not None:
                self._offloader.join()
            try:
                if drain and self._backend is not None:
                    lost = self._only_in_memory()  # what the drain left behind, now that it has stopped
            finally:
                self._release_resources()
        if lost:
            raise IoError(
                f"closed with {lost} objects that could not be written to SSD (lost)" + (f": {error}" if error else ""),
                path=str(self.path), lost=lost, errno=error.context.get("errno") if error else None,
            ) from error

    def _drain_offloads(self, drain: bool) -> Optional[GdskvError]:
        """Wait for the queued offloads at close: with ``drain``, until done or until
        :data:`CLOSE_DRAIN_TRIES` batches failed (the offloader retries a failed batch every
        ``offload_retry_s``); without, not at all (what is left is logged). Returns the last
        error, or None."""
        error: Optional[GdskvError] = None
        for _ in range(CLOSE_DRAIN_TRIES if drain else 1):
            try:
                self.flush(timeout=None if drain else 0)
                return None
            except GdskvError as exc:
                error = exc
        log.warning("gdskv: closing with %d objects not on SSD: %s", len(self._pending), error)
        return error

    def _only_in_memory(self) -> int:
        """Live objects whose only copy is in DRAM or HBM (not on SSD). The offloader has stopped."""
        in_dram = sum(
            1 for entry in self._dram.entries.values()
            if entry.complete and entry.ssd in (SsdState.NONE, SsdState.PENDING)
        )
        return in_dram + len(self._hbm_only())

    def _release_resources(self) -> None:
        if self._hbm is not None:
            self._hbm.close()  # evictions in flight land in DRAM first
        if self._backend is not None:
            self._backend.close()
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
