"""An SGLang HiCache storage backend backed by gdskv (HiCache's L3 tier in DRAM and SSD).

SGLang loads it through its storage factory's ``dynamic`` backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "gdskv",
        "module_path": "gdskv.connectors.sglang", "class_name": "GdskvHiCacheStorage",
        "path": "/var/tmp/gdskv", "dram": "8GiB", "ssd": "200GiB"}'

The gdskv keys of the extra config are those of :class:`~gdskv.engine.attach.AttachConfig`.

Contract (SGLang's :class:`HiCacheStorage`; one call per batch of pages, from HiCache's
own prefetch and backup threads):

- Keys are SGLang's page hashes: each names a page *and its whole prefix*. They are
  mapped into gdskv's namespace (:meth:`~gdskv.engine.prefix.PrefixKeys.external_keys`):
  model (``model_id``, else SGLang's model name, plus the pipeline stage), page geometry,
  dtype, page size, host-pool layout and TP rank start every key, so a store written by
  another model or geometry gives misses, never foreign KV.
- A page is one store object: SGLang's flat host page (every layer, K and V), moved as
  bytes through the same :class:`~gdskv.engine.allocator.OffloadingAllocator` logic as
  every gdskv engine integration.
- ``batch_exists(keys)``: the number of leading pages stored (or queued for the store).
- ``batch_get(keys, target_locations)``: reads the leading stored pages into the given host
  tensors; ``None`` from the first page that is missing or of the wrong size.
  ``get`` is the one-page form.
- ``batch_set(keys, values)``: snapshots the pages into host staging and returns; the
  store's writes happen on a background thread (queued pages are visible to
  ``batch_exists`` and ``batch_get`` at once). False when staging was full and pages
  were shed. ``set`` is the one-page form; ``exists`` the one-key lookup.
- With ``"interface_v1": 1`` in the extra config SGLang calls ``batch_get_v1`` /
  ``batch_set_v1`` with host-pool indices instead of tensors; both are implemented over
  the host pool's ``get_data_page`` / ``set_from_flat_data_page``.
- The extra config's ``mode`` says how the store is reached (``auto``, the default:
  the host's node, started by the first rank that finds none; ``embedded``; ``node``;
  ``cluster``; see :mod:`gdskv.engine.attach`). With a node, every rank of every SGLang
  instance on the host shares one store; each rank keys its own pages (the TP rank is in
  the namespace).
- A store that cannot be opened, or fails, or whose node is gone, gives misses and a
  warning (``batch_set`` returns False); SGLang keeps serving, and a node that comes back
  is attached again.

MHA host pools only (``layer_num``, ``head_num``, ``head_dim``); an MLA pool is refused with
a ConfigError.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"gdskv.connectors.sglang needs sglang and torch: {exc}") from exc

from gdskv.engine.allocator import OffloadConfig, OffloadingAllocator
from gdskv.engine.attach import AttachConfig, acquire_store, release_store
from gdskv.engine.errors import LayoutMismatchError
from gdskv.engine.layout import DTYPE_BYTES, PageLayout
from gdskv.engine.prefix import KeyNamespace
from gdskv.errors import ConfigError, GdskvError, InvalidValueError

log = logging.getLogger(__name__)

#: Extra-config keys that belong to SGLang, not to gdskv.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


class _PageBuffers:
    """The paged-KV engine protocol over the host tensors of one storage call: page ``i``
    is ``buffers[i]``, a flat host tensor of one page (or, with a host pool and indices,
    the pool's page at ``indices[i]``)."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self.buffers: Sequence[Any] = ()
        self.pool: Any = None
        self.indices: Sequence[int] = ()

    @property
    def num_free_pages(self) -> int:
        return 0

    def allocate(self, n: int) -> List[int]:
        raise InvalidValueError("HiCache owns its host pages", wanted=n)

    def free(self, pages: Sequence[int]) -> None:
        raise InvalidValueError("HiCache owns its host pages")

    def read_page(self, page: int, outs: Sequence[Any]) -> None:
        if self.pool is not None:
            src = self.pool.get_data_page(self.indices[page], flat=True)
        else:
            src = self.buffers[page]
        outs[0][:] = _bytes_of(src, self.layout.page_nbytes)

    def write_page(self, page: int, srcs: Sequence[Any]) -> None:
        if self.pool is not None:
            data = self.pool.get_dummy_flat_data_page()
            _bytes_of(data, self.layout.page_nbytes)[:] = srcs[0]
            self.pool.set_from_flat_data_page(self.indices[page], data)
        else:
            _bytes_of(self.buffers[page], self.layout.page_nbytes)[:] = srcs[0]


def _bytes_of(tensor: Any, nbytes: int):
    """A writable uint8 numpy view of a contiguous host tensor of ``nbytes`` bytes."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise InvalidValueError("a page must be a contiguous host tensor", got=type(tensor).__name__)
    view = tensor.view(-1).view(torch.uint8).numpy()
    if view.nbytes != nbytes:
        raise LayoutMismatchError("host page has the wrong size", expected=nbytes, got=view.nbytes)
    return view


class GdskvHiCacheStorage(HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.storage_config = storage_config
        self.attach = AttachConfig.from_mapping(storage_config.extra_config, ignore=SGLANG_KEYS)
        model_id = self.attach.model_id or storage_config.model_name
        if not model_id:
            raise ConfigError("set model_id in the extra config: SGLang gave no model name")
        if storage_config.pp_size > 1:
            model_id = f"{model_id}/pp{storage_config.pp_rank}of{storage_config.pp_size}"
        if storage_config.is_mla_model:
            raise ConfigError("gdskv's SGLang backend supports MHA models only (MLA host pools are not handled yet)")
        self.model_id = model_id
        who = f"SGLang TP rank {storage_config.tp_rank} of {storage_config.tp_size}"
        if storage_config.pp_size > 1:
            who += f", PP rank {storage_config.pp_rank}"
        self.store = acquire_store(self.attach, role=who)
        self.allocator: Optional[OffloadingAllocator] = None
        self._pages: Optional[_PageBuffers] = None
        self._closed = False
        host = (kwargs or {}).get("mem_pool_host") if isinstance(kwargs, dict) else None
        if host is not None:
            self.register_mem_pool_host(host)

    # ------------------------------------------------------------ setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page geometry from SGLang's host pool and build the allocator."""
        super().register_mem_pool_host(mem_pool_host)
        if self.allocator is not None:
            return
        layout = _layout_of(mem_pool_host)
        cfg = self.storage_config
        host_layout = getattr(mem_pool_host, "layout", "layer_first")
        offload = OffloadConfig(
            model_id=f"{self.model_id}#{host_layout}", tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, staging_bytes=self.attach.staging_bytes
        )
        self._pages = _PageBuffers(layout)
        namespace = KeyNamespace.for_layout(offload.model_id, layout, tp_rank=cfg.tp_rank, tp_size=cfg.tp_size)
        self.allocator = OffloadingAllocator(self._pages, self.store, config=offload, namespace=namespace)

    def _ready(self) -> OffloadingAllocator:
        if self.allocator is None:
            raise ConfigError("register_mem_pool_host must come first (SGLang calls it after creating the backend)")
        return self.allocator

    # ------------------------------------------------------------ lookups

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        alloc = self._ready()
        return alloc.stored_pages(alloc.keys.external_keys(keys))

    # ------------------------------------------------------------ reads

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[Any]:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> List[Optional[Any]]:
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidValueError("one host page per key", keys=len(keys), pages=None if target_locations is None else len(target_locations))
        n = self._load(keys, buffers=list(target_locations))
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        n = self._load(keys, indices=self._page_starts(keys, host_indices))
        return [i < n for i in range(len(keys))]

    def _load(self, keys: List[str], *, buffers: Sequence[Any] = (), indices: Sequence[int] = ()) -> int:
        alloc = self._ready()
        assert self._pages is not None
        with alloc._lock:  # one call's buffers at a time
            self._bind(buffers, indices)
            try:
                return alloc.load_keys(alloc.keys.external_keys(keys), range(len(keys)))
            except GdskvError as exc:
                log.warning("gdskv: HiCache read failed, treated as misses: %s", exc)
                return 0
            finally:
                self._bind((), ())

    # ------------------------------------------------------------ writes

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            raise InvalidValueError("one host page per key", keys=len(keys), pages=None if values is None else len(values))
        return self._save(keys, buffers=list(values))

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        ok = self._save(keys, indices=self._page_starts(keys, host_indices))
        return [ok] * len(keys)

    def _save(self, keys: List[str], *, buffers: Sequence[Any] = (), indices: Sequence[int] = ()) -> bool:
        alloc = self._ready()
        if alloc.store is None or not getattr(alloc.store, "available", True):
            return False  # no store, or its node is gone: nothing would be kept
        with alloc._lock:
            self._bind(buffers, indices)
            before = alloc.stats()["save"].get("dropped_full", 0)
            try:
                alloc.save_keys(alloc.keys.external_keys(keys), range(len(keys)))
            except GdskvError as exc:
                log.warning("gdskv: HiCache write failed: %s", exc)
                return False
            finally:
                self._bind((), ())
            return alloc.stats()["save"].get("dropped_full", 0) == before

    # ------------------------------------------------------------ helpers

    def _bind(self, buffers: Sequence[Any], indices: Sequence[int]) -> None:
        assert self._pages is not None
        self._pages.buffers = buffers
        self._pages.indices = indices
        self._pages.pool = self.mem_pool_host if indices else None

    def _page_starts(self, keys: List[str], host_indices: Any) -> List[int]:
        page = self.mem_pool_host.page_size
        flat = [int(i) for i in host_indices.tolist()] if hasattr(host_indices, "tolist") else [int(i) for i in host_indices]
        if len(flat) != len(keys) * page:
            raise InvalidValueError("host indices must cover one page per key", keys=len(keys), indices=len(flat), page_size=page)
        return [flat[i * page] for i in range(len(keys))]

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued page reached the store."""
        return True if self.allocator is None else self.allocator.flush(timeout)

    def stats(self) -> Dict[str, Any]:
        return {} if self.allocator is None else self.allocator.stats()

    def close(self) -> None:
        """Drain queued writes and let go of the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.allocator is not None:
            self.allocator.close(drain=True)
        release_store(self.store)


def _layout_of(pool: Any) -> PageLayout:
    """The page layout of an MHA host pool, checked against its flat page size."""
    try:
        dtype = str(pool.dtype).removeprefix("torch.")
        layout = PageLayout(
            page_size=int(pool.page_size),
            num_layers=int(pool.layer_num),
            num_kv_heads=int(pool.head_num),
            head_dim=int(pool.head_dim),
            dtype=dtype,
            kind="fused",
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError("gdskv's SGLang backend needs an MHA host pool (page_size, layer_num, head_num, head_dim, dtype)", cause=str(exc)) from None
    if dtype not in DTYPE_BYTES:
        raise ConfigError("unsupported KV dtype", got=dtype)
    flat = pool.get_dummy_flat_data_page()
    nbytes = flat.numel() * flat.element_size()
    if nbytes != layout.page_nbytes:
        raise LayoutMismatchError("host pool pages are not 2 x layers x heads x page x head_dim", expected=layout.page_nbytes, got=nbytes)
    return layout


__all__ = ["GdskvHiCacheStorage", "SGLANG_KEYS"]
