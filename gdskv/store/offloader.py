"""The offloader of a :class:`gdskv.Store`: the queue to SSD, its batches, its thread.

Objects go to SSD only from here. ``eager`` offload queues every committed put
(:meth:`Offloader.on_committed`); ``watermark`` offload selects the coldest DRAM-only
objects when DRAM passes its high watermark. One thread waits until a batch is due
(:func:`gdskv.store.offload_rule.batch_due`), takes it, writes it through the NVMe backend
*outside* the lock from pinned DRAM views, and then commits it (the DRAM copies become
evictable) or keeps it queued at the front and pauses for ``offload_retry_s``.

It is configured by its own :class:`~gdskv.offload_config.OffloaderConfig` (a store's is
``StoreConfig.offloader``: the policy, the watermarks, the batch limits, the retry pause),
never by a ``StoreConfig``; the one figure of another tier it needs, the NVMe tier's byte cap
(``ssd_bytes``: a batch takes at most a quarter of it), is passed on its own.

What it owns: the queue, the batch in flight, the copies left on SSD by values removed
meanwhile (taken back out), the last error and the disk-full state, the thread, and its
figures (:meth:`Offloader.stats`). What it is given besides its config and that cap: the
store's lock and condition (one lock guards the DRAM tier the entries live in, so the two
never take locks in different orders), the DRAM tier, the NVMe backend, and an
:class:`OffloadHost`, the narrow interface through which it tells the store what happened.
Every method but :meth:`Offloader.start` and :meth:`Offloader.join` is called with the lock
held.

:class:`NullOffloader` is the null object for a store without an NVMe tier.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Set

from gdskv.errors import GdskvError, IoError, TimedOutError
from gdskv.metrics import Counters, rate
from gdskv.offload_config import OffloaderConfig
from gdskv.store.offload_rule import batch_due, batch_full, batch_limit_bytes
from gdskv.tiers.backends.record import record_size
from gdskv.tiers.dram import DramEntry, DramTier, SsdState

log = logging.getLogger("gdskv.store")


class OffloadHost(Protocol):
    """What the offloader asks of and tells the store that owns it (lock held)."""

    def waiting_for_room(self) -> int:
        """How many puts wait for DRAM room now (a batch is then due at once)."""

    def evict_until(self, until: Callable[[], bool]) -> bool:
        """Evict evictable DRAM objects in policy order until ``until()``; whether it holds."""

    def on_written(self, entries: List[DramEntry]) -> None:
        """``entries`` (live ones) are now COMPLETE on NVMe."""

    def on_write_ended(self) -> None:
        """A batch write ended, well or not: what it evicted from NVMe is to be applied."""


class Offloader:
    """The store's queue to SSD and the thread that empties it (see the module docstring)."""

    def __init__(
        self, config: OffloaderConfig, dram: DramTier, backend: Any, host: OffloadHost, *,
        ssd_bytes: int, cond: threading.Condition,
    ) -> None:
        """``config``: how it offloads (``policy``, the watermarks, ``bucket_*``,
        ``offload_retry_s``). ``ssd_bytes``: the NVMe tier's byte cap (a batch takes at most
        a quarter of it, :func:`~gdskv.store.offload_rule.batch_limit_bytes`).
        ``backend``: the NVMe backend (``write`` and ``remove``). ``cond``: the store's
        condition, on its lock."""
        self.config = config
        #: The most record bytes one batch takes (the config and the cap are fixed).
        self._batch_limit = batch_limit_bytes(config, ssd_bytes)
        self._dram = dram
        self._backend = backend
        self._host = host
        self._cond = cond
        self._pending: Deque[DramEntry] = collections.deque()
        self._pending_bytes = 0
        self._inflight: List[DramEntry] = []
        #: Keys with a copy on SSD that a batch wrote for a value removed or overwritten
        #: meanwhile and that could not be taken back out yet (:meth:`_take_back`).
        self._stale_on_ssd: Set[bytes] = set()
        self._flush_waiters = 0
        self._draining = False  # close() began: write everything queued now, then stop
        self._stopped = False
        self.error: Optional[GdskvError] = None
        self.failures = 0
        self._paused_until = 0.0
        self._counters = Counters()
        self._thread = threading.Thread(target=self._loop, name="gdskv-offload", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()

    def begin_drain(self) -> None:
        """From now on every queued object is due (close); the thread ends once the queue is empty."""
        self._draining = True
        self._cond.notify_all()

    def stop(self) -> None:
        """Stop taking batches (the one in flight ends); :meth:`join` waits for the thread."""
        self._stopped = True
        self._cond.notify_all()

    def join(self) -> None:
        """Wait for the thread to end (lock not held)."""
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------ queueing

    def on_committed(self, entry: DramEntry) -> None:
        """A DRAM object became readable with no copy on SSD: under ``eager`` it is queued;
        under ``watermark`` the thread looks at DRAM usage when it passes the high watermark."""
        if self.config.policy == "eager":
            self.enqueue(entry)
        elif self._dram.used > self.config.high_watermark * self._dram.capacity:
            self._cond.notify_all()

    def enqueue(self, entry: DramEntry) -> None:
        """Queue ``entry`` for SSD (whatever the policy)."""
        entry.ssd = SsdState.PENDING
        entry.queued_at = time.monotonic()
        self._pending.append(entry)
        self._pending_bytes += entry.size
        if len(self._pending) == 1 or batch_full(self._pending_bytes, len(self._pending), self.config):
            self._cond.notify_all()

    def evictable(self, entry: DramEntry) -> bool:
        """Whether evicting ``entry`` from DRAM loses nothing: its SSD copy is COMPLETE (or
        was, and SSD evicted it since)."""
        return entry.ssd in (SsdState.ON_SSD, SsdState.LOST)

    def queued(self) -> int:
        """Objects queued or being written."""
        return len(self._pending) + len(self._inflight)

    # ------------------------------------------------------------------ removes

    def await_not_in_flight(self, k: bytes) -> None:
        """Wait (releasing the lock meanwhile) until no batch in flight holds a copy of ``k``:
        a remove returns only once what that batch landed of the key is taken back out."""
        while any(e.key == k for e in self._inflight):
            self._cond.wait()

    def take_back_stale(self, k: bytes) -> None:
        """Remove a stale SSD copy of ``k`` that a batch could not take back out; raises the
        backend's error when it still cannot (the copy is then still stored)."""
        if k in self._stale_on_ssd:
            self._backend.remove(k)
            self._stale_on_ssd.discard(k)

    # ------------------------------------------------------------------ waiting

    def flush(self, deadline: Optional[float], check: Callable[[], None]) -> None:
        """Wait until every queued object is COMPLETE on SSD, or :class:`TimedOutError` past
        ``deadline`` (a ``time.monotonic()`` value; None: no limit). Under ``watermark``,
        first queue what the policy selects now. Raises the error of a batch that fails
        meanwhile. ``check()`` after each wait (the store's: raises once it is closed)."""
        failures = self.failures
        if self.config.policy == "watermark" and not self._draining:
            self._select()
        self._flush_waiters += 1
        self._cond.notify_all()
        try:
            while self._pending or self._inflight:
                if self.failures > failures and self.error is not None:
                    raise self.error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimedOutError("flush timed out", queued=len(self._pending), in_flight=len(self._inflight))
                self._cond.wait(remaining)
                check()
        finally:
            self._flush_waiters -= 1

    def queue_unsaved(self) -> None:
        """Queue every DRAM object that has no copy on SSD yet (close drains them)."""
        for entry in list(self._dram.entries.values()):
            if entry.complete and entry.ssd is SsdState.NONE:
                self.enqueue(entry)

    def wait_drained(self, tries: int, check: Callable[[], None]) -> Optional[GdskvError]:
        """At close: wait until the queue is empty, through up to ``tries`` failed batches
        (each retried after ``offload_retry_s``); with ``tries=0``, not at all (what is left
        is logged). Returns the last error, or None once drained."""
        error: Optional[GdskvError] = None
        for _ in range(max(tries, 1)):
            try:
                self.flush(None if tries else time.monotonic(), check)
                return None
            except GdskvError as exc:
                error = exc
        log.warning("gdskv: closing with %d objects not on SSD: %s", self.queued(), error)
        return error

    def unsaved(self) -> int:
        """Live DRAM objects with no COMPLETE copy on SSD (queued ones included)."""
        return sum(
            1 for entry in self._dram.entries.values()
            if entry.complete and entry.ssd in (SsdState.NONE, SsdState.PENDING)
        )

    def stats(self) -> Dict[str, Any]:
        c = self._counters.snapshot()
        return {
            "policy": self.config.policy,
            "objects": int(c.get("offloaded", 0)),
            "bytes": int(c.get("offloaded_bytes", 0)),
            "bytes_per_s": rate(c.get("offloaded_bytes", 0), c.get("offload_seconds", 0)),
            "queued": len(self._pending),
            "in_flight": len(self._inflight),
            "stale_copies": len(self._stale_on_ssd),
            "failures": self.failures,
            "paused": time.monotonic() < self._paused_until,
            "disk_full": is_no_space(self.error),
            "last_error": str(self.error) if self.error else None,
        }

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return
                self._inflight = batch
                items = [(e.key, self._dram.view(e), e.crc) for e in batch]
            t0 = time.perf_counter()
            error: Optional[GdskvError] = None
            try:
                self._backend.write(items)  # (evictions are heard by the store's evict listener)
            except GdskvError as exc:
                error = exc
            except OSError as exc:
                error = IoError(f"offload failed: {exc}", errno=exc.errno)
            except Exception as exc:  # noqa: BLE001 - a bug or MemoryError must not kill the offloader
                # (flush(), close() and remove() of these keys would wait for it forever).
                log.error("gdskv: offload raised %s", type(exc).__name__, exc_info=True)
                error = IoError(f"offload failed: {type(exc).__name__}: {exc}")
            elapsed = time.perf_counter() - t0
            del items
            with self._cond:
                self._inflight = []
                if error is None:
                    self._finish(batch, elapsed)
                else:
                    self._fail(batch, error)
                self._cond.notify_all()

    def _next_batch(self) -> Optional[List[DramEntry]]:
        """Wait until a batch is due; take its entries. None: stop."""
        cfg = self.config
        while True:
            if self._stopped:
                return None
            if cfg.policy == "watermark":
                self._select()
            now = time.monotonic()
            timeout: Optional[float] = None
            if self._pending:
                age = now - self._pending[0].queued_at
                waited_for = bool(self._flush_waiters or self._host.waiting_for_room() or self._draining)
                due = batch_due(self._pending_bytes, len(self._pending), age, cfg, waited_for=waited_for)
                if due and now >= self._paused_until:
                    return self._take()
                # Due but paused after a failure: wake when the pause ends, not when the
                # oldest object would reach bucket_max_age_s.
                wake = self._paused_until - now if due else max(cfg.bucket_max_age_s - age, self._paused_until - now)
                timeout = max(wake, 0.001)
            elif self._draining:
                return None
            self._cond.wait(timeout)

    def _take(self) -> List[DramEntry]:
        limit = self._batch_limit
        batch: List[DramEntry] = []
        nbytes = 0
        while self._pending and len(batch) < self.config.bucket_max_keys:
            entry = self._pending[0]
            if batch and nbytes + record_size(len(entry.key), entry.size) > limit:
                break
            self._pending.popleft()
            self._pending_bytes -= entry.size
            if entry.detached:  # removed or overwritten while queued
                entry.ssd = SsdState.NONE
                self._dram.release(entry)
                continue
            batch.append(entry)
            nbytes += record_size(len(entry.key), entry.size)
        return batch

    def _finish(self, batch: List[DramEntry], elapsed: float) -> None:
        self.error = None
        self._host.on_write_ended()
        for entry in batch:
            entry.ssd = SsdState.ON_SSD
            if not entry.detached:
                self._stale_on_ssd.discard(entry.key)  # this copy replaced any stale one
        stale = self._release_detached(batch)
        self._host.on_written([e for e in batch if not e.detached])
        self._counters.add("offloaded", len(batch))
        self._counters.add("offloaded_bytes", sum(e.size for e in batch))
        self._counters.add("offload_seconds", elapsed)
        if self.config.policy == "watermark":
            low = self.config.low_watermark * self._dram.capacity
            self._host.evict_until(lambda: self._dram.used <= low)
        self._take_back(stale)  # last, as it can fail

    def _fail(self, batch: List[DramEntry], error: GdskvError) -> None:
        """Keep the batch in DRAM, queued again at the front, and pause a while. Its entries
        removed or overwritten meanwhile are let go instead, and whatever the failed write may
        have left of them on SSD is taken back out."""
        self.error = error
        self.failures += 1
        self._host.on_write_ended()  # a write can evict before it fails
        pause = self.config.offload_retry_s
        self._paused_until = time.monotonic() + pause
        log.warning("gdskv: offload of %d objects failed, retrying in %.1fs: %s", len(batch), pause, error)
        for entry in reversed(batch):
            if entry.detached:
                entry.ssd = SsdState.NONE
                continue
            self._pending.appendleft(entry)
            self._pending_bytes += entry.size
        self._take_back(self._release_detached(batch))

    def _release_detached(self, batch: List[DramEntry]) -> List[bytes]:
        """Free the DRAM copies of the batch's entries that were removed or overwritten
        while it was written; return their keys whose SSD copy is stale: all but those whose
        key's current DRAM copy holds the same bytes (published again from HBM meanwhile),
        which may already count on that copy."""
        stale: List[bytes] = []
        for entry in batch:
            if not entry.detached:
                continue
            self._dram.release(entry)
            live = self._dram.lookup(entry.key)
            if live is None or (live.size, live.crc) != (entry.size, entry.crc):
                stale.append(entry.key)
        return stale

    def _take_back(self, keys: List[bytes]) -> None:
        """Remove from SSD the copies of ``keys`` that a batch wrote (or may have written,
        when it failed) for values removed or overwritten meanwhile, and any stale copy an
        earlier call could not remove. A copy that cannot be removed stays listed: the next
        batch tries again, and a remove() of its key tries before it returns
        (:meth:`take_back_stale`), raising if it still cannot."""
        self._stale_on_ssd.update(keys)
        for key in list(self._stale_on_ssd):
            try:
                self._backend.remove(key)
            except GdskvError as exc:
                # The offloader must live on: it tries again after its next batch. (A failed
                # write's own error stays the one flush() raises.)
                self.error = self.error or exc
                log.warning("gdskv: could not remove a stale copy of %r from SSD: %s", key[:64], exc)
            else:
                self._stale_on_ssd.discard(key)

    def _select(self) -> None:
        """Watermark policy: above the high watermark, queue the coldest DRAM-only objects
        (and evict those already on SSD) until usage would reach the low watermark; while a
        put waits for room and nothing is being offloaded, queue at least one batch."""
        cap = self._dram.capacity
        waiting = self._host.waiting_for_room()
        if self._dram.used <= self.config.high_watermark * cap and not waiting:
            return
        low = self.config.low_watermark * cap
        self._host.evict_until(lambda: self._dram.used <= low)
        projected = self._dram.used - self._pending_bytes - sum(e.size for e in self._inflight)
        target = low
        if waiting and not self._pending and not self._inflight:
            # A waiting put needs a free extent that usage does not show (the arena can be
            # fragmented below the low watermark): queue at least one batch of the coldest
            # DRAM-only objects, so that evicting them can make room.
            target = min(low, projected - max(1, self._batch_limit))
        if projected <= target:
            return
        chosen = []
        for key in self._dram.policy.ordered():
            entry = self._dram.entries[key]
            if entry.complete and entry.ssd is SsdState.NONE:
                chosen.append(entry)
                projected -= entry.size
                if projected <= target:
                    break
        for entry in chosen:
            self.enqueue(entry)


class NullOffloader:
    """The offloader of a store without an NVMe tier: nothing is queued, and every DRAM
    object is evictable (evicting drops it: the cache's job, counted by the store). It takes
    no config: with no NVMe tier, no offload setting applies."""

    error: Optional[GdskvError] = None
    failures = 0

    def start(self) -> None:
        pass

    def begin_drain(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def join(self) -> None:
        pass

    def on_committed(self, entry: DramEntry) -> None:
        pass

    def enqueue(self, entry: DramEntry) -> None:
        pass

    def evictable(self, entry: DramEntry) -> bool:
        return True

    def queued(self) -> int:
        return 0

    def await_not_in_flight(self, k: bytes) -> None:
        pass

    def take_back_stale(self, k: bytes) -> None:
        pass

    def flush(self, deadline: Optional[float], check: Callable[[], None]) -> None:
        pass

    def queue_unsaved(self) -> None:
        pass

    def wait_drained(self, tries: int, check: Callable[[], None]) -> Optional[GdskvError]:
        return None

    def unsaved(self) -> int:
        return 0

    def stats(self) -> Optional[Dict[str, Any]]:
        return None


def is_no_space(error: Optional[GdskvError]) -> bool:
    """Whether ``error`` (the last offload error) says the filesystem is full (ENOSPC)."""
    return error is not None and error.context.get("errno") == errno.ENOSPC
