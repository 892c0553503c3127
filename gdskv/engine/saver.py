"""Asynchronous saves of KV pages into a :class:`~gdskv.kvstore.KVStore`, off the engine's
thread.

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
- Two-phase form, for engines that copy a page layer by layer (vLLM's ``save_kv_layer``):
  :meth:`AsyncSaver.reserve` takes a staging slot for each page not stored, queued or
  reserved yet (dropping, counted, when none is free) and returns a :class:`Reservation`;
  the engine fills each slot's segments, then :meth:`Reservation.commit` queues the pages
  (visible to lookups from then on) or :meth:`Reservation.abort` gives the slots back.
  :meth:`save` is ``reserve`` + ``read_page`` into every slot + ``commit``.

Staging is one host arena allocated once, cut into ``page_nbytes`` slots.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from gdskv.engine.layout import PageLayout
from gdskv.engine.prefix import PrefixKeys
from gdskv.errors import GdskvError, KeyExistsError, StoreClosedError
from gdskv.kvstore import KVStore

log = logging.getLogger(__name__)

ReadPage = Callable[[int, Sequence[np.ndarray]], None]


class AsyncSaver:
    """Background saver of page snapshots into ``store``. See the module docstring."""

    def __init__(self, store: KVStore, layout: PageLayout, *, staging_bytes: int) -> None:
        self.store = store
        self.layout = layout
        self.slots = max(1, staging_bytes // layout.page_nbytes)
        self._arena = np.empty(self.slots * layout.page_nbytes, dtype=np.uint8)
        self._free: List[int] = list(range(self.slots - 1, -1, -1))
        self._pending: Dict[bytes, int] = {}  # page key -> slot, until its put completes
        self._queue: Deque[bytes] = collections.deque()
        self._reserved: Set[bytes] = set()  # keys whose slot the engine is filling
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
        reservation = self.reserve(keys)
        try:
            for k, (index, _key, _slot) in enumerate(reservation.items):
                read_page(pages[index], reservation.segments(k))
        except BaseException:
            reservation.abort()
            raise
        return reservation.commit()

    def reserve(self, keys: Sequence[bytes]) -> "Reservation":
        """A staging slot for each of ``keys`` not stored, queued or reserved yet (see the
        module docstring). Never waits for the store."""
        with self._lock:
            if self._closed:
                return Reservation(self, [])
            seen = set()
            todo = []
            for i, k in enumerate(keys):
                if k in self._pending or k in self._reserved or k in seen:
                    continue
                seen.add(k)
                todo.append((i, k))
            self.counters["skipped_pending"] += len(keys) - len(todo)
        if not todo:
            return Reservation(self, [])
        stored = self._stored([k for _, k in todo])
        items = []
        with self._lock:
            for (index, key), is_stored in zip(todo, stored):
                if is_stored:
                    self.counters["skipped_stored"] += 1
                elif key in self._pending or key in self._reserved:
                    self.counters["skipped_pending"] += 1
                elif not self._free:
                    self.counters["dropped_full"] += 1
                else:
                    slot = self._free.pop()
                    self._reserved.add(key)
                    items.append((index, key, slot))
        return Reservation(self, items)

    def _commit(self, items: Sequence[tuple]) -> int:
        with self._lock:
            for _index, key, slot in items:
                self._reserved.discard(key)
                if self._closed:
                    self._free.append(slot)
                    continue
                self._pending[key] = slot
                self._queue.append(key)
            self._cond.notify_all()
            queued = 0 if self._closed else len(items)
            self.counters["submitted"] += queued
        return queued

    def _abort(self, items: Sequence[tuple]) -> None:
        with self._lock:
            for _index, key, slot in items:
                self._reserved.discard(key)
                self._free.append(slot)
            self._cond.notify_all()

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


class Reservation:
    """Staging slots taken by :meth:`AsyncSaver.reserve`, being filled by the engine.

    ``items`` holds ``(index in the keys asked for, key, slot)`` for each page that got a
    slot; :meth:`segments` gives the writable segment buffers of item ``k``. Exactly one of
    :meth:`commit` and :meth:`abort` ends it (later calls do nothing).
    """

    def __init__(self, saver: Optional[AsyncSaver], items: List[Tuple[int, bytes, int]]) -> None:
        self.saver = saver
        self.items = items
        self._done = False

    def segments(self, k: int) -> List[np.ndarray]:
        return self.saver._segments(self.items[k][2])

    def commit(self) -> int:
        """Queue the filled pages for the store; return how many were queued."""
        if self._done:
            return 0
        self._done = True
        return self.saver._commit(self.items) if self.items else 0

    def abort(self) -> None:
        """Give the slots back without saving."""
        if self._done:
            return
        self._done = True
        if self.items:
            self.saver._abort(self.items)
