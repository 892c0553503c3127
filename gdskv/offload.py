"""The background offloader of a :class:`gdskv.Store`: queue, buckets, watermark policy.

Objects go to SSD only from here. ``eager`` offload queues every committed put
(``_enqueue``); ``watermark`` offload selects the coldest DRAM-only objects when DRAM passes
its high watermark (``_select_for_offload``). One thread (``_offload_loop``) waits until a
bucket is due — full by bytes or keys, its oldest object older than ``bucket_max_age_s``,
or someone waiting (``flush``, a put under back-pressure, ``close``) — takes the batch,
writes it through the backend *outside* the store lock from pinned DRAM views, and then
commits (``_finish_batch``: the DRAM copies become evictable) or keeps the batch queued and
pauses (``_fail_batch``).

This is a mixin: it shares the store's lock, condition, DRAM tier and backend, and only
:class:`gdskv.store.Store` uses it.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from typing import List, Optional

from gdskv.config import MAX_WAIT_S
from gdskv.errors import GdskvError, InvalidValueError, IoError, NoSpaceError
from gdskv.tiers.backends.record import record_size
from gdskv.tiers.dram import DramEntry, SsdState
from gdskv.types import Tier

log = logging.getLogger("gdskv.store")


class OffloadMixin:
    """Offload state machine of the store (see the module docstring)."""


    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued offload is COMPLETE on SSD.

        With the watermark policy, first queue what the policy selects now (DRAM above the
        high watermark is offloaded down to the low one), so a flush right after the put that
        crossed the watermark waits for that offload too.

        Raises the offloader's error if a batch fails meanwhile (the objects stay in DRAM and
        are retried), and :class:`NoSpaceError` if ``timeout`` seconds pass first.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout):
            raise InvalidValueError("flush timeout must be a number of seconds or None", got=repr(timeout))
        if timeout == math.inf:
            timeout = None  # for ever
        elif timeout is not None and timeout > MAX_WAIT_S:
            raise InvalidValueError(f"flush timeout must be at most {MAX_WAIT_S:.0f} s (a year), or None", got=timeout)
        if self._backend is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._check_open()
            failures = self._offload_failures
            if self.config.offload == "watermark" and not self._closing:
                self._select_for_offload()
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                while self._pending or self._inflight:
                    if self._offload_failures > failures and self._offload_error is not None:
                        raise self._offload_error
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise NoSpaceError("flush timed out", queued=len(self._pending), in_flight=len(self._inflight))
                    self._cond.wait(remaining)
                    self._check_open()
            finally:
                self._flush_waiters -= 1

    def _enqueue(self, entry: DramEntry) -> None:
        entry.ssd = SsdState.PENDING
        entry.queued_at = time.monotonic()
        self._pending.append(entry)
        self._pending_bytes += entry.size
        if (
            len(self._pending) == 1
            or self._pending_bytes >= self.config.bucket_bytes
            or len(self._pending) >= self.config.bucket_max_keys
        ):
            self._cond.notify_all()

    def _offload_loop(self) -> None:
        while True:
            with self._lock:
                batch = self._next_batch()
                if batch is None:
                    return
                self._inflight = batch
                items = [(e.key, self._dram.view(e), e.crc) for e in batch]
            t0 = time.perf_counter()
            error: Optional[GdskvError] = None
            try:
                self._backend.write(items)  # type: ignore[union-attr]  (evictions: _nvme_evicting)
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
            with self._lock:
                self._inflight = []
                if error is None:
                    self._finish_batch(batch, elapsed)
                else:
                    self._fail_batch(batch, error)
                self._cond.notify_all()

    def _next_batch(self) -> Optional[List[DramEntry]]:
        """Wait (lock held) until a bucket should be written; take its entries. None: stop."""
        cfg = self.config
        while True:
            if self._closed:
                return None
            if cfg.offload == "watermark":
                self._select_for_offload()
            now = time.monotonic()
            timeout: Optional[float] = None
            if self._pending:
                age = now - self._pending[0].queued_at
                due = (
                    self._pending_bytes >= cfg.bucket_bytes
                    or len(self._pending) >= cfg.bucket_max_keys
                    or age >= cfg.bucket_max_age_s
                    or self._flush_waiters
                    or self._space_waiters
                    or self._closing
                )
                if due and now >= self._offload_paused_until:
                    return self._take_batch()
                # Due but paused after a failure: wake when the pause ends, not when the
                # oldest object would reach bucket_max_age_s.
                wake = self._offload_paused_until - now if due else max(cfg.bucket_max_age_s - age, self._offload_paused_until - now)
                timeout = max(wake, 0.001)
            elif self._closing:
                return None
            self._cond.wait(timeout)

    def _take_batch(self) -> List[DramEntry]:
        # A bucket never takes more than a quarter of the SSD tier, so that writing one
        # evicts only a part of what is there (a single larger object still goes alone).
        limit = min(self.config.bucket_bytes, self.config.ssd_bytes // 4)
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

    def _finish_batch(self, batch: List[DramEntry], elapsed: float) -> None:
        self._offload_error = None
        self._mark_lost()  # what the write evicted (the backend's evict_listener heard it)
        for entry in batch:
            entry.ssd = SsdState.ON_SSD
            if not entry.detached:
                self._stale_on_ssd.discard(entry.key)  # this copy replaced any stale one
        stale = self._release_detached(batch)
        self._notify_stored(Tier.NVME, [(e.key, e.size, e.crc) for e in batch if not e.detached])
        self._counters.add("offloaded", len(batch))
        self._counters.add("offloaded_bytes", sum(e.size for e in batch))
        self._counters.add("offload_seconds", elapsed)
        if self.config.offload == "watermark":
            low = self.config.low_watermark * self._dram.capacity
            self._evict_dram(until=lambda: self._dram.used <= low)
        self._take_back(stale)  # last, as it can fail

    def _fail_batch(self, batch: List[DramEntry], error: GdskvError) -> None:
        """Keep the batch in DRAM, queued again at the front, and pause offload a while.
        Its entries removed or overwritten meanwhile are let go instead, and whatever the
        failed write may have left of them on SSD is taken back out."""
        self._offload_error = error
        self._offload_failures += 1
        self._mark_lost()  # a write can evict before it fails
        pause = self.config.offload_retry_s
        self._offload_paused_until = time.monotonic() + pause
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
        while it was written (lock held); return their keys whose SSD copy is stale: all
        but those whose key's current DRAM copy holds the same bytes (published again from
        HBM meanwhile), which may already count on that copy."""
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
        earlier call could not remove (lock held). A copy that cannot be removed stays
        listed in ``_stale_on_ssd``: the next batch tries again, and a remove() of its key
        tries before it returns, raising if it still cannot."""
        self._stale_on_ssd.update(keys)
        for key in list(self._stale_on_ssd):
            try:
                self._backend.remove(key)  # type: ignore[union-attr]
            except GdskvError as exc:
                # The offloader must live on: it tries again after its next batch. (A failed
                # write's own error stays the one flush() raises.)
                self._offload_error = self._offload_error or exc
                log.warning("gdskv: could not remove a stale copy of %r from SSD: %s", key[:64], exc)
            else:
                self._stale_on_ssd.discard(key)

    def _select_for_offload(self) -> None:
        """Watermark policy: above the high watermark, queue the coldest DRAM-only objects
        (and evict those already on SSD) until usage would reach the low watermark; while a
        put waits for room and nothing is being offloaded, queue at least one bucket."""
        cap = self._dram.capacity
        if self._dram.used <= self.config.high_watermark * cap and not self._space_waiters:
            return
        low = self.config.low_watermark * cap
        self._evict_dram(until=lambda: self._dram.used <= low)
        projected = self._dram.used - self._pending_bytes - sum(e.size for e in self._inflight)
        target = low
        if self._space_waiters and not self._pending and not self._inflight:
            # A waiting put needs a free extent that usage does not show (the arena can be
            # fragmented below the low watermark): queue at least one bucket of the coldest
            # DRAM-only objects, so that evicting them can make room.
            target = min(low, projected - max(1, min(self.config.bucket_bytes, self.config.ssd_bytes // 4)))
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
            self._enqueue(entry)


def is_no_space(error: Optional[GdskvError]) -> bool:
    """Whether the last offload failed because the filesystem is full (ENOSPC)."""
    return error is not None and error.context.get("errno") == errno.ENOSPC
