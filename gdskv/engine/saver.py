"""Asynchronous saves of KV pages into a store, off the engine's thread.

Contract:

- :meth:`AsyncSaver.save` runs on the engine's thread and never waits for the store's
  writes: it skips pages already stored or already queued, copies each remaining page
  from the engine into a host staging slot (``engine.read_page``) and queues it. A page
  copied into a slot can be freed and reused by the engine at once. When every slot is
  taken, the remaining pages are *not* saved (counted as ``dropped_full``): a save never
  blocks the engine, it sheds load.
- A background thread puts queued pages into the store, one object per segment, then frees
  their slots. A queued page is readable through :meth:`AsyncSaver.copy_pending` until its
  put completes, so a save is visible to lookups and loads as soon as ``save`` returns.
- Store faults never reach the engine: a put that raises is counted (``errors``) and
  logged; a key already holding different bytes (recomputed KV can differ in the last
  bits) is counted as ``existing`` and left alone.
- :meth:`flush` waits until the queue is empty; :meth:`close` (idempotent) drains or drops
  the queue and stops the thread.

Staging is one host arena allocated once, cut into ``page_nbytes`` slots.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence

import numpy as np

from gdskv.engine.layout import PageLayout
from gdskv.engine.prefix import PrefixKeys
from gdskv.errors import GdskvError, KeyExistsError, StoreClosedError

log = logging.getLogger(__name__)

ReadPage = Callable[[int, Sequence[np.ndarray]], None]


class AsyncSaver:
    """Background saver of page snapshots into ``store``. See the module docstring."""

    def __init__(self, store, layout: PageLayout, *, staging_bytes: int) -> None:
        self.store = store
        self.layout = layout
        self.slots = max(1, staging_bytes // layout.page_nbytes)
        self._arena = np.empty(self.slots * layout.page_nbytes, dtype=np.uint8)
        self._free: List[int] = list(range(self.slots - 1, -1, -1))
        self._pending: Dict[bytes, int] = {}  # page key -> slot, until its put completes
        self._queue: Deque[bytes] = collections.deque()
        self._busy = 0  # pages taken off the queue and being put
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._drop_queue = False
        self.counters: Dict[str, int] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="gdskv-engine-save", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread

    def save(self, keys: Sequence[bytes], pages: Sequence[int], read_page: ReadPage) -> int:
        """Queue ``pages`` (holding the KV of ``keys``) for the store; return how many were
        queued. Never waits for the store; see the module docstring."""
        with self._lock:
            if self._closed:
                return 0
            todo = [(k, p) for k, p in zip(keys, pages) if k not in self._pending]
            self.counters["skipped_pending"] += len(keys) - len(todo)
        if not todo:
            return 0
        stored = self._stored([k for k, _ in todo])
        queued = 0
        for (key, page), is_stored in zip(todo, stored):
            if is_stored:
                self._count("skipped_stored")
                continue
            with self._lock:
                if not self._free:
                    self.counters["dropped_full"] += 1
                    continue
                slot = self._free.pop()
            try:
                read_page(page, self._segments(slot))
            except BaseException:
                with self._lock:
                    self._free.append(slot)
                raise
            with self._lock:
                self._pending[key] = slot
                self._queue.append(key)
                self._cond.notify_all()
            queued += 1
        self._count("submitted", queued)
        return queued

    def _stored(self, keys: List[bytes]) -> List[bool]:
        """Whether every segment of each page is in the store (a store fault: False)."""
        n = self.layout.num_segments
        seg_keys = [s for k in keys for s in PrefixKeys.segment_keys(k, n)]
        try:
            found = self.store.batch_exists(seg_keys)
        except GdskvError as exc:
            self._count("errors")
            log.warning("gdskv: store unavailable for saves: %s", exc)
            return [True] * len(keys)  # nothing can be saved now
        return [all(found[i * n : (i + 1) * n]) for i in range(len(keys))]

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def is_pending(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending

    def copy_pending(self, key: bytes, outs: Sequence[np.ndarray]) -> bool:
        """Copy a queued page's segments into ``outs``; False when ``key`` is not queued."""
        with self._lock:
            slot = self._pending.get(key)
            if slot is None:
                return False
            for out, seg in zip(outs, self._segments(slot)):
                out[:] = seg
            return True

    def _segments(self, slot: int) -> List[np.ndarray]:
        size = self.layout.segment_nbytes
        base = slot * self.layout.page_nbytes
        return [self._arena[base + i * size : base + (i + 1) * size] for i in range(self.layout.num_segments)]

    # ------------------------------------------------------------ saver thread

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and (self._drop_queue or not self._queue):
                    self._release_all_locked()
                    return
                key = self._queue.popleft()
                slot = self._pending[key]
                self._busy += 1
            try:
                self._put(key, slot)
            finally:
                with self._lock:
                    self._busy -= 1
                    del self._pending[key]
                    self._free.append(slot)
                    self._cond.notify_all()

    def _put(self, key: bytes, slot: int) -> None:
        seg_keys = PrefixKeys.segment_keys(key, self.layout.num_segments)
        t0 = time.perf_counter()
        for seg_key, seg in zip(seg_keys, self._segments(slot)):
            try:
                self.store.put(seg_key, seg)
            except KeyExistsError:
                self._count("existing")
            except StoreClosedError:
                self._count("errors")
                return
            except GdskvError as exc:
                self._count("errors")
                log.warning("gdskv: saving a KV page failed: %s", exc)
                return
        with self._lock:
            self.counters["saved_pages"] += 1
            self.counters["saved_bytes"] += self.layout.page_nbytes
            self.counters["put_ns"] += int((time.perf_counter() - t0) * 1e9)

    def _release_all_locked(self) -> None:
        for key in self._queue:
            self._free.append(self._pending.pop(key))
            self.counters["dropped_close"] += 1
        self._queue.clear()
        self._cond.notify_all()

    # ------------------------------------------------------------ lifecycle

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued page is put (or failed); False if ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue) + self._busy

    def stats(self) -> dict:
        with self._lock:
            out = {k: int(v) for k, v in self.counters.items()}
            out.update(slots=self.slots, free_slots=len(self._free), queued=len(self._queue) + self._busy)
        return out

    def close(self, *, drain: bool = True) -> None:
        """Stop the thread after putting (``drain``) or dropping what is queued. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_queue = not drain
            self._cond.notify_all()
        self._thread.join()
