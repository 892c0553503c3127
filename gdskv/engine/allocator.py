"""Wrapping an engine's paged KV allocator with the tiers of a gdskv store.

The store is any :class:`gdskv.kvstore.KVStore`: an embedded :class:`gdskv.Store`
(``gdskv.open``) or a cluster :class:`gdskv.Client` (``gdskv.connect``); the allocator uses
only that protocol (``batch_exists``, ``batch_get_into``, ``get_into``, ``put``).

The protocol a paged-KV engine implements (:class:`PagedKVEngine`):

- ``layout``: a :class:`~gdskv.engine.layout.PageLayout`, the geometry of every page.
- ``num_free_pages``: pages the engine can hand out now.
- ``allocate(n) -> list[int]``: ``n`` free page numbers; raises
  :class:`~gdskv.engine.errors.PoolExhaustedError` (taking nothing) when fewer are free.
- ``free(pages)``: give pages back.
- ``read_page(page, outs)``: copy the page's KV into ``outs``, one writable uint8 host array
  of ``layout.segment_nbytes`` bytes per segment (per layer, or one fused buffer).
- ``write_page(page, srcs)``: the reverse; ``srcs`` as ``outs``.

:class:`OffloadingAllocator` wraps it. The engine asks it for pages instead of its own
allocator, and gets a prefix cache across every tier — its own page pool (the device
tier), then the store's DRAM and SSD (and, through a cluster client, its peers'):

- ``lookup(token_ids) -> int``: leading tokens cached in any tier, whole pages only. No
  side effect.
- ``acquire(token_ids) -> PrefixHit``: pins the pages of the cached prefix — indexed pool
  pages as they are, store pages loaded into freshly allocated pool pages — and returns
  them. At least the last token is always left uncached, so the engine has logits to
  compute.
- ``allocate(n)``: fresh pinned pages; when the engine runs short, idle cached pages are
  evicted least-recently-used first, each saved to the store first unless stored already.
- ``commit(token_ids, pages)``: ``pages[i]`` now holds page ``i`` of ``token_ids``; the full
  pages enter the pool index (and, with ``save_on="prefill"``, are saved at once).
- ``release(pages)``: the request is done; indexed pages stay cached (idle), others go
  back to the engine.
- ``load(token_ids, pages, start_page=0) -> int``: store level. Loads the stored pages
  ``start_page, start_page+1, ...`` of ``token_ids`` into ``pages`` with one
  ``KVStore.batch_get_into``; returns the tokens loaded, a whole number of leading pages.
- ``save(token_ids, pages, start_page=0) -> int``: store level, asynchronous. Snapshots
  the pages not stored yet and queues them (see :mod:`gdskv.engine.saver`); never waits
  for the store.
- ``stored_pages(keys)``, ``load_keys(keys, pages)``, ``save_keys(keys, pages)``: the same
  three store-level operations on page keys an engine already has (SGLang hands out its
  own chained page hashes, mapped into this namespace by
  :meth:`~gdskv.engine.prefix.PrefixKeys.external_keys`). ``load`` and ``save`` are these
  with the keys of ``token_ids``.
- Layer by layer, for engines that move a page's layers one at a time (vLLM's per-layer
  hooks): ``stage_pages(spans)`` reads the stored pages of several spans of keys into host
  staging with one batch read and returns, per span, the segment buffers of its leading
  pages that arrived whole, for the engine to copy from (valid until the next load or
  stage); ``read_pages(spans, buffer)`` does the same into memory of the caller's without
  holding the allocator's lock during the read (a loader thread's asynchronous loads);
  ``reserve_save(keys)`` takes staging slots for the pages not stored yet and
  returns a :class:`~gdskv.engine.saver.Reservation` whose segments the engine fills before
  it commits (or aborts) it.

Safety: keys carry the namespace (model, layout, dtype, page size, TP rank), so a store
written under another geometry gives misses. A stored object whose size is not exactly
the engine's segment size is a miss (counted as ``size_mismatch``); loads go through host
staging and a page reaches the engine only when all its segments arrived whole. A store
fault (closed, I/O error) is a miss plus a warning; the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, List, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from gdskv.config import MiB, check_choice, parse_size
from gdskv.engine.errors import LayoutMismatchError, PoolExhaustedError
from gdskv.engine.layout import PageLayout
from gdskv.engine.pool import DevicePrefixIndex
from gdskv.engine.prefix import KeyNamespace, PrefixKeys, as_tokens
from gdskv.engine.saver import AsyncSaver, Reservation
from gdskv.errors import ConfigError, GdskvError, InvalidValueError, StoreClosedError
from gdskv.kvstore import KVStore

log = logging.getLogger(__name__)

SAVE_TRIGGERS = ("evict", "prefill")


@runtime_checkable
class PagedKVEngine(Protocol):
    """What an engine implements to be wrapped. See the module docstring."""

    layout: PageLayout

    @property
    def num_free_pages(self) -> int: ...

    def allocate(self, n: int) -> List[int]: ...

    def free(self, pages: Sequence[int]) -> None: ...

    def read_page(self, page: int, outs: Sequence[np.ndarray]) -> None: ...

    def write_page(self, page: int, srcs: Sequence[np.ndarray]) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """How an :class:`OffloadingAllocator` names and moves pages. Validated on construction."""

    #: Model identity, part of every key (a hub id and revision, or a hash of the weights).
    #: No default.
    model_id: str
    #: Tensor-parallel rank and world size of this process, part of every key. Default 0, 1.
    tp_rank: int = 0
    tp_size: int = 1
    #: When pages are saved: "evict" (when the pool evicts them) or "prefill" (also right
    #: after they are computed). Default "evict".
    save_on: str = "evict"
    #: Host staging for asynchronous saves; a save that finds it full drops pages
    #: (counted) instead of waiting. Default 64 MiB.
    staging_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        if isinstance(self.staging_bytes, str):
            object.__setattr__(self, "staging_bytes", parse_size(self.staging_bytes, field="staging_bytes"))
        if not isinstance(self.staging_bytes, int) or self.staging_bytes <= 0:
            raise ConfigError("must be a positive byte count", field="staging_bytes", got=self.staging_bytes)
        check_choice("save trigger", self.save_on, SAVE_TRIGGERS)
        # model_id / tp fields are validated by KeyNamespace


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The cached prefix of a request: pinned pages, and the tier each part came from."""

    pages: List[int]
    device_tokens: int
    store_tokens: int

    @property
    def tokens(self) -> int:
        return self.device_tokens + self.store_tokens


class OffloadingAllocator:
    """A prefix-caching page allocator over an engine pool and a
    :class:`~gdskv.kvstore.KVStore` (or None: the pool only).

    Not for concurrent use by several engine threads (calls are serialised by a lock);
    saves run on a background thread of their own. See the module docstring.
    """

    def __init__(
        self,
        engine: PagedKVEngine,
        store: Optional[KVStore] = None,
        *,
        config: OffloadConfig,
        namespace: Optional[KeyNamespace] = None,
    ) -> None:
        layout = getattr(engine, "layout", None)
        if not isinstance(layout, PageLayout):
            raise ConfigError("engine.layout must be a PageLayout", got=type(layout).__name__)
        expected = KeyNamespace.for_layout(config.model_id, layout, tp_rank=config.tp_rank, tp_size=config.tp_size)
        if namespace is None:
            namespace = expected
        for field in ("layout", "dtype", "page_size"):
            if getattr(namespace, field) != getattr(expected, field):
                raise LayoutMismatchError(
                    "namespace does not match the engine's page layout",
                    field=field,
                    namespace=getattr(namespace, field),
                    engine=getattr(expected, field),
                )
        self.engine = engine
        self.store = store
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self.keys = PrefixKeys(namespace)
        self.page_size = layout.page_size
        self.index = DevicePrefixIndex()
        self._lock = threading.RLock()
        self._saver = AsyncSaver(store, layout, staging_bytes=config.staging_bytes) if store is not None else None
        self._staging = np.empty(0, dtype=np.uint8)
        self._closed = False
        self.counters = {
            "lookups": 0,
            "device_hit_tokens": 0,
            "store_hit_tokens": 0,
            "pages_loaded": 0,
            "pages_loaded_from_queue": 0,
            "size_mismatch": 0,
            "store_errors": 0,
            "evicted_pages": 0,
            "load_no_room": 0,
        }

    # ================================================================== queries

    def lookup(self, token_ids: Any) -> int:
        """Leading tokens of ``token_ids`` cached in any tier (whole pages; no side effect)."""
        keys = self.keys.page_keys(token_ids)
        with self._lock:
            kinds = self._classify(keys)
        return len(kinds) * self.page_size

    def _classify(self, keys: Sequence[bytes]) -> List[str]:
        """Where each leading key is: "device" or "store", up to the first missing one."""
        kinds: List[str] = []
        for key in keys:
            if self.index.lookup(key) is None:
                break
            kinds.append("device")
        rest = keys[len(kinds) :]
        if not rest:
            return kinds
        in_store = self._stored(rest)
        for key, stored in zip(rest, in_store):
            if self.index.lookup(key) is not None:
                kinds.append("device")
            elif stored:
                kinds.append("store")
            else:
                break
        return kinds

    def _stored(self, keys: Sequence[bytes]) -> List[bool]:
        """Whether each page is queued for saving or has every segment in the store."""
        if self.store is None:
            return [False] * len(keys)
        assert self._saver is not None
        n = self.layout.num_segments
        seg_keys = [s for k in keys for s in PrefixKeys.segment_keys(k, n)]
        try:
            found = self.store.batch_exists(seg_keys)
        except GdskvError as exc:
            self._store_fault(exc)
            found = [False] * len(seg_keys)
        return [self._saver.is_pending(k) or all(found[i * n : (i + 1) * n]) for i, k in enumerate(keys)]

    # ================================================================== a request's pages

    def acquire(self, token_ids: Any) -> PrefixHit:
        """Pin the cached prefix of ``token_ids``, loading its stored part. See the module docstring."""
        tokens = as_tokens(token_ids)
        usable = max(0, (tokens.size - 1) // self.page_size)
        keys = self.keys.page_keys(tokens, usable)
        with self._lock:
            self._check_open()
            kinds = self._classify(keys)
            pages: List[Optional[int]] = []
            for key, kind in zip(keys, kinds):
                pages.append(self.index.lookup(key) if kind == "device" else None)
            device = [p for p in pages if p is not None]
            self.index.pin(device)
            need = [i for i, p in enumerate(pages) if p is None]
            fresh: List[int] = []
            loaded = 0
            if need:
                try:
                    fresh = self.allocate(len(need))
                except PoolExhaustedError:  # no room to load into: the prefix ends here
                    self.counters["load_no_room"] += 1
                else:
                    loaded = self._load_keys([keys[i] for i in need], fresh)
            cut = need[loaded] if loaded < len(need) else len(pages)
            for i, page in zip(need[:loaded], fresh[:loaded]):
                pages[i] = page
                self.index.insert(keys[i], page)
            self._unpin_and_free([p for p in pages[cut:] if p is not None] + fresh[loaded:])
            kept = [p for p in pages[:cut] if p is not None]
            n_store = sum(1 for i in need[:loaded] if i < cut)
            hit = PrefixHit(
                pages=kept,
                device_tokens=(len(kept) - n_store) * self.page_size,
                store_tokens=n_store * self.page_size,
            )
            self.counters["lookups"] += 1
            self.counters["device_hit_tokens"] += hit.device_tokens
            self.counters["store_hit_tokens"] += hit.store_tokens
            return hit

    def allocate(self, n: int) -> List[int]:
        """``n`` fresh pinned pages, evicting (and saving) idle cached pages if needed."""
        if not isinstance(n, int) or n < 0:
            raise InvalidValueError("page count must be a non-negative integer", got=n)
        with self._lock:
            self._check_open()
            short = n - self.engine.num_free_pages
            if short > 0:
                victims = self.index.evict(short)
                if victims:
                    self.counters["evicted_pages"] += len(victims)
                    if self._saver is not None:
                        self._saver.save([k for k, _ in victims], [p for _, p in victims], self.engine.read_page)
                    self.engine.free([p for _, p in victims])
            if self.engine.num_free_pages < n:
                raise PoolExhaustedError(
                    "engine page pool exhausted: every page is in use",
                    wanted=n,
                    free=self.engine.num_free_pages,
                    pinned=self.index.pinned,
                )
            pages = list(self.engine.allocate(n))
            self.index.pin(pages)
            return pages

    def commit(self, token_ids: Any, pages: Sequence[int]) -> int:
        """Index the full pages of ``token_ids`` held by ``pages``; return how many were new."""
        pages = _page_list(pages)
        keys = self.keys.page_keys(token_ids, min(len(pages), self.keys.full_pages(len(as_tokens(token_ids)))))
        with self._lock:
            self._check_open()
            new_keys, new_pages = [], []
            for key, page in zip(keys, pages):
                if self.index.insert(key, page):
                    new_keys.append(key)
                    new_pages.append(page)
            if self.config.save_on == "prefill" and self._saver is not None and new_keys:
                self._saver.save(new_keys[::-1], new_pages[::-1], self.engine.read_page)
            return len(new_keys)

    def release(self, pages: Sequence[int]) -> None:
        """Unpin ``pages``: indexed ones stay cached, the rest go back to the engine."""
        with self._lock:
            self._unpin_and_free(_page_list(pages))

    def _unpin_and_free(self, pages: List[int]) -> None:
        freed = self.index.unpin(pages)
        if freed:
            self.engine.free(freed)

    # ================================================================== store level

    def load(self, token_ids: Any, pages: Sequence[int], *, start_page: int = 0) -> int:
        """Load stored pages ``start_page..`` of ``token_ids`` into ``pages``; return the
        tokens loaded (leading whole pages). See the module docstring."""
        pages = _page_list(pages)
        if not isinstance(start_page, int) or start_page < 0:
            raise InvalidValueError("start_page must be a non-negative integer", got=start_page)
        keys = self.keys.page_keys(token_ids, start_page + len(pages))[start_page:]
        return self.load_keys(keys, pages) * self.page_size

    def save(self, token_ids: Any, pages: Sequence[int], *, start_page: int = 0) -> int:
        """Queue pages ``start_page..`` of ``token_ids``, held by ``pages``, for the store;
        return how many pages were queued (stored or queued ones are skipped)."""
        pages = _page_list(pages)
        if not isinstance(start_page, int) or start_page < 0:
            raise InvalidValueError("start_page must be a non-negative integer", got=start_page)
        keys = self.keys.page_keys(token_ids, start_page + len(pages))[start_page:]
        return self.save_keys(keys, pages)

    def stored_pages(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are in the store or queued for it (no side effect)."""
        keys = _key_list(keys)
        with self._lock:
            present = 0
            for stored in self._stored(keys):
                if not stored:
                    break
                present += 1
            return present

    def load_keys(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Load the stored pages named by ``keys`` into ``pages``; return how many leading
        pages were loaded (a page reaches the engine only when all its segments did)."""
        keys, pages = _key_list(keys), _page_list(pages)
        if len(keys) != len(pages):
            raise InvalidValueError("one page per key", keys=len(keys), pages=len(pages))
        with self._lock:
            self._check_open()
            present = 0
            for stored in self._stored(keys):
                if not stored:
                    break
                present += 1
            return self._load_keys(keys[:present], pages[:present])

    def save_keys(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Queue ``pages``, holding the KV named by ``keys``, for the store; return how many
        were queued. Never waits for the store (see :mod:`gdskv.engine.saver`)."""
        keys, pages = _key_list(keys), _page_list(pages)
        if len(keys) != len(pages):
            raise InvalidValueError("one page per key", keys=len(keys), pages=len(pages))
        if self._saver is None:
            return 0
        with self._lock:
            self._check_open()
            return self._saver.save(keys[::-1], pages[::-1], self.engine.read_page)

    def stage_pages(self, spans: Sequence[Sequence[bytes]]) -> List[List[List[np.ndarray]]]:
        """Read the stored pages of each span of page keys into host staging (one batch
        read); return per span the segment buffers of its leading pages that arrived whole.
        The buffers stay valid until the next load or stage call. See the module docstring."""
        spans = [_key_list(keys) for keys in spans]
        with self._lock:
            self._check_open()
            leading = self._leading_stored(spans)
            segs, ok, from_queue = self._stage([k for keys in leading for k in keys])
            return self._whole_leading(leading, segs, ok, from_queue)

    def read_pages(
        self, spans: Sequence[Sequence[bytes]], buffer: Optional[Callable[[int], np.ndarray]] = None
    ) -> List[List[List[np.ndarray]]]:
        """:meth:`stage_pages` for a loader thread beside the engine's: the pages are read
        into memory of the caller's (``buffer(nbytes)``: a uint8 array of at least that
        many bytes, which a loader reuses from one load to the next; default: a new one),
        and the allocator's lock is not held while the store reads, so that the engine's
        calls (lookups, saves) never wait for a slow load. A closed allocator raises
        StoreClosedError."""
        spans = [_key_list(keys) for keys in spans]
        self._check_open()
        leading = self._leading_stored(spans)
        flat = [k for keys in leading for k in keys]
        lay = self.layout
        nbytes = len(flat) * lay.num_segments * lay.segment_nbytes
        segs, ok, from_queue = self._stage(flat, buffer(nbytes) if buffer is not None else np.empty(nbytes, dtype=np.uint8))
        with self._lock:
            return self._whole_leading(leading, segs, ok, from_queue)

    def _leading_stored(self, spans: List[List[bytes]]) -> List[List[bytes]]:
        """Per span, its leading keys that are stored (up to the first that is not)."""
        leading = []
        for keys in spans:
            present = 0
            for stored in self._stored(keys):
                if not stored:
                    break
                present += 1
            leading.append(keys[:present])
        return leading

    def _whole_leading(self, leading: List[List[bytes]], segs: List[Any], ok: List[bool], from_queue: List[bool]) -> List[List[Any]]:
        """Per span, the segment buffers of its leading pages that arrived whole (counted as
        loaded). Lock held."""
        out: List[List[List[np.ndarray]]] = []
        at = 0
        for keys in leading:
            span_ok = ok[at : at + len(keys)]
            n = next((i for i, good in enumerate(span_ok) if not good), len(keys))
            out.append(segs[at : at + n])
            self._count_loaded(n, from_queue[at : at + len(keys)])
            at += len(keys)
        return out

    def reserve_save(self, keys: Sequence[bytes]) -> Reservation:
        """Staging slots for the pages of ``keys`` not stored, queued or reserved yet; the
        engine fills them and commits. See :mod:`gdskv.engine.saver`. A closed allocator or
        one without a store reserves nothing."""
        keys = _key_list(keys)
        with self._lock:
            if self._saver is None or self._closed:
                return Reservation(self._saver, [])
            return self._saver.reserve(keys)

    def _load_keys(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Read ``keys`` into host staging, then copy the leading whole pages into
        ``pages``. Returns the number of pages loaded. Lock held."""
        segs, ok, from_queue = self._stage(keys)
        loaded = next((i for i in range(len(ok)) if not ok[i]), len(ok))
        for i in range(loaded):
            self.engine.write_page(pages[i], segs[i])
        self._count_loaded(loaded, from_queue)
        return loaded

    def _stage(self, keys: Sequence[bytes], staging: Optional[np.ndarray] = None):
        """Read ``keys`` (queued pages from the save queue, the rest with one batch read)
        into host staging (``staging``, else the allocator's own); return each page's
        segment buffers and whether it arrived whole and whether it came from the save
        queue. Lock held unless ``staging`` is the caller's."""
        if not keys or self.store is None:
            return [], [False] * len(keys), [False] * len(keys)
        assert self._saver is not None
        lay = self.layout
        n, s, size = len(keys), lay.num_segments, lay.segment_nbytes
        if staging is None:
            staging = self._staging_for(n * s * size)
        segs = [[staging[(i * s + j) * size : (i * s + j + 1) * size] for j in range(s)] for i in range(n)]
        ok = [self._saver.copy_pending(k, segs[i]) for i, k in enumerate(keys)]
        want = [i for i in range(n) if not ok[i]]
        # Tail first, so that the store's LRU keeps a sequence's head longest.
        seg_keys = [sk for i in reversed(want) for sk in PrefixKeys.segment_keys(keys[i], s)]
        outs = [seg for i in reversed(want) for seg in segs[i]]
        sizes = self._batch_get(seg_keys, outs)
        queued = set(i for i in range(n) if ok[i])
        for pos, i in enumerate(reversed(want)):
            got = sizes[pos * s : (pos + 1) * s]
            if all(g == size for g in got):
                ok[i] = True
            elif any(g is not None and g != size for g in got):
                self.counters["size_mismatch"] += 1
                log.warning("gdskv: stored KV page has the wrong size, treated as a miss: %r", keys[i][:64])
            # else: some segment is gone (evicted since the lookup): a plain miss
        return segs, ok, [i in queued for i in range(n)]

    def _count_loaded(self, n: int, from_queue: Sequence[bool]) -> None:
        self.counters["pages_loaded"] += n
        self.counters["pages_loaded_from_queue"] += sum(1 for q in from_queue[:n] if q)

    def _batch_get(self, keys: List[bytes], outs: List[np.ndarray]) -> List[Optional[int]]:
        """``KVStore.batch_get_into``; an object larger than its segment (which fails the
        whole batch up front) is retried key by key and counted as a miss of wrong size."""
        if not keys:
            return []
        try:
            return self.store.batch_get_into(keys, outs)
        except InvalidValueError:
            pass
        except GdskvError as exc:
            self._store_fault(exc)
            return [None] * len(keys)
        sizes: List[Optional[int]] = []
        for key, out in zip(keys, outs):
            try:
                sizes.append(self.store.get_into(key, out))
            except InvalidValueError:
                sizes.append(-1)  # larger than the engine's segment: never copied
            except GdskvError as exc:
                self._store_fault(exc)
                sizes.append(None)
        return sizes

    def _staging_for(self, nbytes: int) -> np.ndarray:
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(max(nbytes, 2 * self._staging.nbytes), dtype=np.uint8)
        return self._staging

    def _store_fault(self, exc: GdskvError) -> None:
        self.counters["store_errors"] += 1
        log.warning("gdskv: store unavailable, serving without it: %s", exc)

    # ================================================================== lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("offloading allocator is closed")

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued save reached the store; False if ``timeout`` passed."""
        return True if self._saver is None else self._saver.flush(timeout)

    def stats(self) -> dict:
        with self._lock:
            out: dict = dict(self.counters)
            out.update(
                cached_pages=len(self.index),
                idle_pages=self.index.idle,
                pinned_pages=self.index.pinned,
                free_pages=self.engine.num_free_pages,
            )
        if self._saver is not None:
            out["save"] = self._saver.stats()
        return out

    def close(self, *, drain: bool = True) -> None:
        """Stop saving: put what is queued (``drain``) or drop it. Idempotent; the store
        and the engine stay open (they belong to the caller)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._saver is not None:
            self._saver.close(drain=drain)

    def __enter__(self) -> "OffloadingAllocator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _page_list(pages: Sequence[int]) -> List[int]:
    try:
        items = list(pages)
    except TypeError:
        raise InvalidValueError("pages must be a sequence of page numbers", got=type(pages).__name__) from None
    if any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) for p in items):
        raise InvalidValueError("page numbers must be integers", got=[type(p).__name__ for p in items][:8])
    out = [int(p) for p in items]
    if any(p < 0 for p in out):
        raise InvalidValueError("page numbers must be non-negative", got=[p for p in out if p < 0][:8])
    return out


def _key_list(keys: Sequence[bytes]) -> List[bytes]:
    try:
        items = list(keys)
    except TypeError:
        raise InvalidValueError("keys must be a sequence of page keys", got=type(keys).__name__) from None
    if any(not isinstance(k, bytes) or not k for k in items):
        raise InvalidValueError("page keys must be non-empty bytes", got=[type(k).__name__ for k in items][:8])
    return items
